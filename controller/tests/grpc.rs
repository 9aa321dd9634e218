//! The controller over a real Unix socket: what the CO's sidecars see. The backend runs with the
//! fake attacher (no root needed); the daemon binary itself is started once, to check its flags
//! and its graceful stop.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use csi::controller_client::ControllerClient;
use csi::controller_server::ControllerServer;
use csi::group_controller_client::GroupControllerClient;
use csi::group_controller_server::GroupControllerServer;
use csi::identity_client::IdentityClient;
use csi::identity_server::IdentityServer;
use csi::snapshot_metadata_client::SnapshotMetadataClient;
use csi::snapshot_metadata_server::SnapshotMetadataServer;
use moor_controller::embedded::fake::FakeAttacher;
use moor_controller::embedded::{Config, EmbeddedBackend};
use moor_controller::identity::IdentityService;
use moor_controller::service::ControllerService;
use moor_proto::csi::v1 as csi;
use moor_runtime::contract::DEVICE_PATH_KEY;
use tonic::Code;
use tonic::transport::Channel;

static COUNTER: AtomicU32 = AtomicU32::new(0);

/// A temporary directory removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> Self {
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let p = std::env::temp_dir().join(format!(
            "moor-controller-grpc-{tag}-{}-{n}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        Self(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// How long a server or the daemon may take to answer its first call, or to stop: a bound on a
/// hang, generous for a busy machine.
const DEADLINE: Duration = Duration::from_secs(120);

/// A channel to the socket, once a call on it is answered.
async fn connect(socket: &Path) -> Channel {
    moor_runtime::client::wait_answering(socket, DEADLINE, || None)
        .await
        .unwrap_or_else(|e| panic!("{e}"))
}

/// Serves the controller on a socket in `dir` until the returned sender fires.
async fn serve(
    dir: &Path,
) -> (
    PathBuf,
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<()>,
) {
    let (backend, _) = EmbeddedBackend::open(
        Config {
            data_dir: dir.join("data"),
            node_id: "node-1".into(),
            topology_key: "topology.moor.csi.io/node".into(),
        },
        FakeAttacher::new(),
    )
    .unwrap();
    let backend = Arc::new(backend);
    let socket = dir.join("csi.sock");
    let listener = moor_runtime::server::bind_unix(&socket).unwrap();
    let router = tonic::transport::Server::builder()
        .add_service(IdentityServer::new(
            IdentityService::new("moor.csi.io", Arc::clone(&backend))
                .announce_snapshot_metadata(true),
        ))
        .add_service(ControllerServer::new(ControllerService::new(Arc::clone(
            &backend,
        ))))
        .add_service(moor_runtime::metrics::Metered::new(
            GroupControllerServer::new(ControllerService::new(Arc::clone(&backend))),
        ))
        .add_service(moor_runtime::metrics::Metered::new(
            SnapshotMetadataServer::new(ControllerService::new(backend)),
        ));
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let path = socket.clone();
    let task = tokio::spawn(async move {
        moor_runtime::server::serve(
            router,
            listener,
            &path,
            async {
                let _ = rx.await;
            },
            Duration::from_secs(5),
        )
        .await
        .unwrap();
    });
    (socket, tx, task)
}

fn mount_cap() -> csi::VolumeCapability {
    use csi::volume_capability::{AccessMode, AccessType, MountVolume, access_mode::Mode};
    csi::VolumeCapability {
        access_mode: Some(AccessMode {
            mode: Mode::SingleNodeWriter as i32,
        }),
        access_type: Some(AccessType::Mount(MountVolume::default())),
    }
}

#[tokio::test]
async fn identity_over_the_socket() {
    use csi::plugin_capability::{Type, service, volume_expansion};
    let dir = TempDir::new("identity");
    let (socket, stop, task) = serve(&dir.0).await;
    let mut id = IdentityClient::new(connect(&socket).await);
    let info = id
        .get_plugin_info(csi::GetPluginInfoRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(info.name, "moor.csi.io");
    assert!(!info.vendor_version.is_empty());
    let caps = id
        .get_plugin_capabilities(csi::GetPluginCapabilitiesRequest {})
        .await
        .unwrap()
        .into_inner()
        .capabilities;
    let services: Vec<i32> = caps
        .iter()
        .filter_map(|c| match &c.r#type {
            Some(Type::Service(s)) => Some(s.r#type),
            _ => None,
        })
        .collect();
    assert!(services.contains(&(service::Type::ControllerService as i32)));
    assert!(services.contains(&(service::Type::VolumeAccessibilityConstraints as i32)));
    assert!(services.contains(&(service::Type::GroupControllerService as i32)));
    assert!(services.contains(&(service::Type::SnapshotMetadataService as i32)));
    assert!(caps.iter().any(|c| matches!(
        &c.r#type,
        Some(Type::VolumeExpansion(e)) if e.r#type == volume_expansion::Type::Online as i32
    )));
    let probe = id.probe(csi::ProbeRequest {}).await.unwrap().into_inner();
    assert_eq!(probe.ready, Some(true));
    stop.send(()).unwrap();
    task.await.unwrap();
    assert!(!socket.exists(), "the socket is removed on shutdown");
}

#[tokio::test]
async fn volume_lifecycle_over_the_socket() {
    let dir = TempDir::new("lifecycle");
    let (socket, stop, task) = serve(&dir.0).await;
    let mut c = ControllerClient::new(connect(&socket).await);
    let vol = c
        .create_volume(csi::CreateVolumeRequest {
            name: "pvc-1".into(),
            capacity_range: Some(csi::CapacityRange {
                required_bytes: 5 << 20,
                limit_bytes: 0,
            }),
            volume_capabilities: vec![mount_cap()],
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap();
    assert_eq!(vol.capacity_bytes, 5 << 20);
    let ctx = c
        .controller_publish_volume(csi::ControllerPublishVolumeRequest {
            volume_id: vol.volume_id.clone(),
            node_id: "node-1".into(),
            volume_capability: Some(mount_cap()),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .publish_context;
    assert!(ctx.contains_key(DEVICE_PATH_KEY));
    let listed = c
        .list_volumes(csi::ListVolumesRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        listed.entries[0]
            .status
            .as_ref()
            .unwrap()
            .published_node_ids,
        vec!["node-1".to_string()]
    );
    let err = c
        .delete_volume(csi::DeleteVolumeRequest {
            volume_id: vol.volume_id.clone(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition);
    c.controller_unpublish_volume(csi::ControllerUnpublishVolumeRequest {
        volume_id: vol.volume_id.clone(),
        node_id: "node-1".into(),
        ..Default::default()
    })
    .await
    .unwrap();
    c.delete_volume(csi::DeleteVolumeRequest {
        volume_id: vol.volume_id,
        ..Default::default()
    })
    .await
    .unwrap();
    stop.send(()).unwrap();
    task.await.unwrap();
}

#[tokio::test]
async fn modify_of_a_volume_that_is_not_there_is_not_found() {
    let dir = TempDir::new("modify");
    let (socket, stop, task) = serve(&dir.0).await;
    let mut c = ControllerClient::new(connect(&socket).await);
    let e = c
        .controller_modify_volume(csi::ControllerModifyVolumeRequest {
            volume_id: "vol-0000000000000001".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound);
    stop.send(()).unwrap();
    task.await.unwrap();
}

/// The value of one line of the process's gRPC metrics, 0 when absent.
fn counted(method: &str, code: &str) -> u64 {
    let want = format!("moor_grpc_requests_total{{method=\"{method}\",code=\"{code}\"}} ");
    moor_runtime::metrics::render_grpc()
        .lines()
        .find_map(|l| l.strip_prefix(want.as_str()))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

#[tokio::test]
async fn group_snapshots_and_metadata_over_the_socket() {
    let dir = TempDir::new("group");
    let (socket, stop, task) = serve(&dir.0).await;
    let channel = connect(&socket).await;
    let mut c = ControllerClient::new(channel.clone());
    let mut vols = Vec::new();
    for name in ["pvc-a", "pvc-b"] {
        let v = c
            .create_volume(csi::CreateVolumeRequest {
                name: name.into(),
                capacity_range: Some(csi::CapacityRange {
                    required_bytes: 1 << 20,
                    limit_bytes: 0,
                }),
                volume_capabilities: vec![mount_cap()],
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner()
            .volume
            .unwrap();
        vols.push(v.volume_id);
    }
    let mut g = GroupControllerClient::new(channel.clone());
    let caps = g
        .group_controller_get_capabilities(csi::GroupControllerGetCapabilitiesRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(caps.capabilities.len(), 1);
    let group = g
        .create_volume_group_snapshot(csi::CreateVolumeGroupSnapshotRequest {
            name: "g".into(),
            source_volume_ids: vols.clone(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .group_snapshot
        .unwrap();
    assert_eq!(group.snapshots.len(), 2);
    let got = g
        .get_volume_group_snapshot(csi::GetVolumeGroupSnapshotRequest {
            group_snapshot_id: group.group_snapshot_id.clone(),
            snapshot_ids: group
                .snapshots
                .iter()
                .map(|s| s.snapshot_id.clone())
                .collect(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(got.group_snapshot.as_ref(), Some(&group));

    // A stream, and its errors as the call's status (and as the metrics count them).
    let mut m = SnapshotMetadataClient::new(channel);
    let snap = group.snapshots[0].snapshot_id.clone();
    let mut stream = m
        .get_metadata_allocated(csi::GetMetadataAllocatedRequest {
            snapshot_id: snap.clone(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let first = stream.message().await.unwrap().unwrap();
    assert_eq!(first.volume_capacity_bytes, 1 << 20);
    assert!(first.block_metadata.is_empty());
    assert!(stream.message().await.unwrap().is_none());
    let before = counted("GetMetadataAllocated", "OutOfRange");
    let e = m
        .get_metadata_allocated(csi::GetMetadataAllocatedRequest {
            snapshot_id: snap,
            starting_offset: 2 << 20,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::OutOfRange);
    assert_eq!(counted("GetMetadataAllocated", "OutOfRange"), before + 1);
    let e = m
        .get_metadata_delta(csi::GetMetadataDeltaRequest {
            base_snapshot_id: "snap-00000000000000aa".into(),
            target_snapshot_id: group.snapshots[1].snapshot_id.clone(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound);

    g.delete_volume_group_snapshot(csi::DeleteVolumeGroupSnapshotRequest {
        group_snapshot_id: group.group_snapshot_id.clone(),
        snapshot_ids: Vec::new(),
        ..Default::default()
    })
    .await
    .unwrap();
    stop.send(()).unwrap();
    task.await.unwrap();
}

fn binary() -> &'static str {
    env!("CARGO_BIN_EXE_moor-controller")
}

#[test]
fn binary_help_and_version() {
    let help = std::process::Command::new(binary())
        .arg("--help")
        .output()
        .unwrap();
    assert!(help.status.success());
    let text = String::from_utf8_lossy(&help.stdout);
    for flag in [
        "--endpoint",
        "--driver-name",
        "--node-id",
        "--data-dir",
        "--log-format",
    ] {
        assert!(text.contains(flag), "{flag} missing from --help");
    }
    let version = std::process::Command::new(binary())
        .arg("--version")
        .output()
        .unwrap();
    assert!(version.status.success());
    assert!(String::from_utf8_lossy(&version.stdout).contains(env!("CARGO_PKG_VERSION")));
    let bad = std::process::Command::new(binary())
        .args(["--node-id", "bad\nnode", "--endpoint", "unix:///tmp/x.sock"])
        .output()
        .unwrap();
    assert!(!bad.status.success());
}

#[tokio::test]
async fn binary_stops_gracefully_on_sigterm() {
    if !rustix::process::geteuid().is_root() {
        eprintln!("skipped: the daemon inspects loop devices, which needs root");
        return;
    }
    let dir = TempDir::new("binary");
    let socket = dir.0.join("csi.sock");
    // Killed if the test fails (dropped as it unwinds), and by the kernel if the test process
    // dies: never left serving.
    let mut child = moor_runtime::child::Guarded::spawn(
        std::process::Command::new(binary())
            .args(["--endpoint", &format!("unix://{}", socket.display())])
            .args(["--node-id", "node-1", "--log-format", "json"])
            .arg("--data-dir")
            .arg(dir.0.join("data"))
            .stderr(std::process::Stdio::null()),
        rustix::process::Signal::KILL,
    )
    .unwrap();
    let channel = moor_runtime::client::wait_answering(&socket, DEADLINE, || {
        moor_runtime::client::exited(&mut child)
    })
    .await
    .unwrap_or_else(|e| panic!("moor-controller: {e}"));
    let mut id = IdentityClient::new(channel);
    let info = id
        .get_plugin_info(csi::GetPluginInfoRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(info.name, "moor.csi.io");
    rustix::process::kill_process(child.pid(), rustix::process::Signal::TERM).unwrap();
    // The runtime runs on while it stops: this client's connection answers its graceful stop.
    let start = std::time::Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        assert!(
            start.elapsed() < DEADLINE,
            "moor-controller still runs {DEADLINE:?} after SIGTERM"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(status.success(), "{status:?}");
    assert!(!socket.exists(), "the socket is removed on SIGTERM");
}
