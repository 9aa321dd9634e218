//! `bare-node`: the least a CSI node plugin that speaks gRPC can be, for the benches' floors.
//!
//!     bare-node --endpoint PATH [--kubelet]
//!
//! With `--kubelet` every connection goes through moor-runtime's `AuthorityFix`, as moor-node's
//! do: kubelet's grpc-go sends the socket's path as the `:authority`, which tonic's HTTP/2
//! server refuses, so a plugin in Rust that serves kubelet needs it (the benches that call as
//! kubelet does ask for it; the others leave it out).
//!
//! It serves the CSI Node service on the Unix socket at PATH with tonic on a multi-thread
//! runtime, from a worker, as moor-node does, and does nothing but the syscalls each call stands for:
//! * NodeStageVolume: mount(2) of `publish_context["devicePath"]` on the staging path as the
//!   capability's fs type (xfs with `nouuid`, as moor mounts it); first moor's mkfs command on
//!   the device when `volume_context["mkfs"]` is `"true"`, or `e2fsck -p` of it when
//!   `volume_context["e2fsck"]` is `"true"` (exit 0 or 1 goes on, as moor's check does);
//! * NodeUnstageVolume: umount2 of the staging path;
//! * NodePublishVolume: mkdir of the target, then a bind mount of the staging path on it;
//! * NodeUnpublishVolume: umount2 of the target, then rmdir;
//! * NodeGetCapabilities: STAGE_UNSTAGE_VOLUME.
//!
//! It checks nothing, keeps no records and probes no device: never point it at data. SIGTERM
//! stops it where it stands. The
//! calls that block in the kernel run with the runtime told they block (`block_in_place`), so
//! the server goes on reading its sockets meanwhile, which any plugin must; what it measures
//! is therefore the gRPC, runtime and process wake-ups a plugin cannot leave out. Errors come
//! back as INTERNAL with the failed step.

use std::path::PathBuf;
use std::process::ExitCode;

use moor_bench::{mkfs, mount_data};
use moor_proto::csi::v1 as csi;
use moor_runtime::authority::AuthorityFix;
use moor_runtime::contract::DEVICE_PATH_KEY;
use rustix::mount::{MountFlags, UnmountFlags};
use tokio_stream::StreamExt as _;
use tokio_stream::wrappers::UnixListenerStream;
use tonic::{Request, Response, Status};

#[derive(Debug)]
struct Bare;

type Answer<T> = Result<Response<T>, Status>;

/// Runs `f`, which blocks in the kernel, with the runtime told so; its error as INTERNAL.
fn blocking(f: impl FnOnce() -> Result<(), String>) -> Result<(), Status> {
    tokio::task::block_in_place(f).map_err(Status::internal)
}

/// `e2fsck -p` of `dev`: clean (0) or repaired (1) goes on.
fn e2fsck_preen(dev: &str) -> Result<(), String> {
    let status = std::process::Command::new("e2fsck")
        .arg("-p")
        .arg(dev)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .map_err(|e| format!("e2fsck: {e}"))?;
    match status.code() {
        Some(0 | 1) => Ok(()),
        _ => Err(format!("e2fsck -p {dev}: {status}")),
    }
}

fn mount(dev: &str, dir: &str, fs: &str) -> Result<(), String> {
    rustix::mount::mount(dev, dir, fs, MountFlags::empty(), mount_data(fs))
        .map_err(|e| format!("mount {dev} on {dir}: {e}"))
}

fn unmount(dir: &str) -> Result<(), String> {
    rustix::mount::unmount(dir, UnmountFlags::empty()).map_err(|e| format!("umount {dir}: {e}"))
}

/// The fs type of a mount capability ("" without one).
fn fs_type(cap: Option<&csi::VolumeCapability>) -> String {
    match cap.and_then(|c| c.access_type.as_ref()) {
        Some(csi::volume_capability::AccessType::Mount(m)) => m.fs_type.clone(),
        _ => String::new(),
    }
}

#[tonic::async_trait]
impl csi::node_server::Node for Bare {
    async fn node_stage_volume(
        &self,
        request: Request<csi::NodeStageVolumeRequest>,
    ) -> Answer<csi::NodeStageVolumeResponse> {
        let r = request.into_inner();
        let dev = r
            .publish_context
            .get(DEVICE_PATH_KEY)
            .cloned()
            .unwrap_or_default();
        let fs = fs_type(r.volume_capability.as_ref());
        let format = r.volume_context.get("mkfs").is_some_and(|v| v == "true");
        let check = r.volume_context.get("e2fsck").is_some_and(|v| v == "true");
        blocking(|| {
            if format {
                mkfs(&fs, dev.as_ref())?;
            }
            if check {
                e2fsck_preen(&dev)?;
            }
            mount(&dev, &r.staging_target_path, &fs)
        })?;
        Ok(Response::new(csi::NodeStageVolumeResponse {}))
    }

    async fn node_unstage_volume(
        &self,
        request: Request<csi::NodeUnstageVolumeRequest>,
    ) -> Answer<csi::NodeUnstageVolumeResponse> {
        let r = request.into_inner();
        blocking(|| unmount(&r.staging_target_path))?;
        Ok(Response::new(csi::NodeUnstageVolumeResponse {}))
    }

    async fn node_publish_volume(
        &self,
        request: Request<csi::NodePublishVolumeRequest>,
    ) -> Answer<csi::NodePublishVolumeResponse> {
        let r = request.into_inner();
        let (source, target) = (r.staging_target_path.as_str(), r.target_path.as_str());
        rustix::fs::mkdir(target, rustix::fs::Mode::from_raw_mode(0o750))
            .map_err(|e| Status::internal(format!("mkdir {target}: {e}")))?;
        rustix::mount::mount_bind(source, target)
            .map_err(|e| Status::internal(format!("bind {source} on {target}: {e}")))?;
        Ok(Response::new(csi::NodePublishVolumeResponse {}))
    }

    async fn node_unpublish_volume(
        &self,
        request: Request<csi::NodeUnpublishVolumeRequest>,
    ) -> Answer<csi::NodeUnpublishVolumeResponse> {
        let target = request.into_inner().target_path;
        unmount(&target).map_err(Status::internal)?;
        rustix::fs::rmdir(target.as_str())
            .map_err(|e| Status::internal(format!("rmdir {target}: {e}")))?;
        Ok(Response::new(csi::NodeUnpublishVolumeResponse {}))
    }

    async fn node_get_volume_stats(
        &self,
        _: Request<csi::NodeGetVolumeStatsRequest>,
    ) -> Answer<csi::NodeGetVolumeStatsResponse> {
        Err(Status::unimplemented("bare-node"))
    }

    async fn node_expand_volume(
        &self,
        _: Request<csi::NodeExpandVolumeRequest>,
    ) -> Answer<csi::NodeExpandVolumeResponse> {
        Err(Status::unimplemented("bare-node"))
    }

    async fn node_get_capabilities(
        &self,
        _: Request<csi::NodeGetCapabilitiesRequest>,
    ) -> Answer<csi::NodeGetCapabilitiesResponse> {
        use csi::node_service_capability::{Rpc, Type, rpc::Type as RpcType};
        Ok(Response::new(csi::NodeGetCapabilitiesResponse {
            capabilities: vec![csi::NodeServiceCapability {
                r#type: Some(Type::Rpc(Rpc {
                    r#type: RpcType::StageUnstageVolume as i32,
                })),
            }],
        }))
    }

    async fn node_get_volume_health(
        &self,
        _: Request<csi::NodeGetVolumeHealthRequest>,
    ) -> Answer<csi::NodeGetVolumeHealthResponse> {
        Err(Status::unimplemented("bare-node"))
    }

    async fn node_get_storage_health(
        &self,
        _: Request<csi::NodeGetStorageHealthRequest>,
    ) -> Answer<csi::NodeGetStorageHealthResponse> {
        Err(Status::unimplemented("bare-node"))
    }

    async fn node_get_info(
        &self,
        _: Request<csi::NodeGetInfoRequest>,
    ) -> Answer<csi::NodeGetInfoResponse> {
        Err(Status::unimplemented("bare-node"))
    }
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (socket, kubelet) = match args.iter().map(String::as_str).collect::<Vec<_>>()[..] {
        ["--endpoint", path] => (path, false),
        ["--endpoint", path, "--kubelet"] => (path, true),
        _ => {
            eprintln!("usage: bare-node --endpoint PATH [--kubelet]");
            return ExitCode::from(2);
        }
    };
    let socket = PathBuf::from(socket.strip_prefix("unix://").unwrap_or(socket));
    let served = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("runtime: {e}"))
        .and_then(|rt| {
            // Served from a worker, as moor-node is: the accept and the connection it starts
            // run on the same thread.
            rt.block_on(async {
                let listener = tokio::net::UnixListener::bind(&socket)
                    .map_err(|e| format!("bind {}: {e}", socket.display()))?;
                tokio::spawn(async move {
                    let router = tonic::transport::Server::builder()
                        .add_service(csi::node_server::NodeServer::new(Bare));
                    let incoming = UnixListenerStream::new(listener);
                    if kubelet {
                        router
                            .serve_with_incoming(incoming.map(|c| c.map(AuthorityFix::new)))
                            .await
                    } else {
                        router.serve_with_incoming(incoming).await
                    }
                    .map_err(|e| format!("serve: {e}"))
                })
                .await
                .map_err(|e| format!("serve: {e}"))?
            })
        });
    match served {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("bare-node: {e}");
            ExitCode::FAILURE
        }
    }
}
