//! `moor-demo`: starts moor-controller and moor-node on the embedded backend in a temporary
//! directory and walks a whole volume life as Kubernetes would, printing each step and how long
//! it took. Everything it makes is removed at the end, also when a step fails or on Ctrl-C.
//! Needs root (loop devices and mounts); runs in its own mount namespace.

use std::collections::HashMap;
use std::future::Future;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use csi::controller_client::ControllerClient;
use csi::node_client::NodeClient;
use csi::volume_capability::{AccessMode, AccessType, BlockVolume, MountVolume, access_mode::Mode};
use moor_privileged::client::{Daemon, connect};
use moor_proto::csi::v1 as csi;
use tonic::transport::Channel;

const GIB: i64 = 1 << 30;
const NODE: &str = "demo-node";

type Step<T> = Result<T, String>;

/// What was made, so it can be undone in reverse.
#[derive(Default)]
struct Made {
    volumes: Vec<String>,
    snapshots: Vec<String>,
    attached: Vec<String>,
    staged: Vec<(String, PathBuf)>,
    published: Vec<(String, PathBuf)>,
}

struct Demo {
    ctl: ControllerClient<Channel>,
    node: NodeClient<Channel>,
    kubelet: PathBuf,
    made: Made,
}

fn mount_cap(fs: &str) -> csi::VolumeCapability {
    csi::VolumeCapability {
        access_mode: Some(AccessMode {
            mode: Mode::SingleNodeWriter as i32,
        }),
        access_type: Some(AccessType::Mount(MountVolume {
            fs_type: fs.into(),
            ..Default::default()
        })),
    }
}

fn block_cap() -> csi::VolumeCapability {
    csi::VolumeCapability {
        access_mode: Some(AccessMode {
            mode: Mode::SingleNodeWriter as i32,
        }),
        access_type: Some(AccessType::Block(BlockVolume {})),
    }
}

/// Runs one step, with a spinner while it runs and its duration after.
async fn step<T>(name: &str, fut: impl Future<Output = Step<T>>) -> Step<T> {
    let start = Instant::now();
    let spinner = async {
        let frames = ['|', '/', '-', '\\'];
        let mut i = 0;
        loop {
            tokio::time::sleep(Duration::from_millis(120)).await;
            print!(
                "\r  {} {name} ({:.1}s)",
                frames[i % 4],
                start.elapsed().as_secs_f64()
            );
            let _ = std::io::stdout().flush();
            i += 1;
        }
    };
    let r = tokio::select! {
        r = fut => r,
        () = spinner => unreachable_spinner(),
    };
    let ms = start.elapsed().as_secs_f64() * 1000.0;
    match &r {
        Ok(_) => println!("\r  ok   {name:<58} {ms:>9.1} ms"),
        Err(e) => println!("\r  FAIL {name:<58} {ms:>9.1} ms\n       {e}"),
    }
    r
}

fn unreachable_spinner<T>() -> Step<T> {
    Err("spinner stopped".into())
}

fn status(s: tonic::Status) -> String {
    format!("{:?}: {}", s.code(), s.message())
}

impl Demo {
    async fn create(
        &mut self,
        name: &str,
        bytes: i64,
        cap: csi::VolumeCapability,
        src: Option<csi::VolumeContentSource>,
    ) -> Step<String> {
        let r = self
            .ctl
            .create_volume(csi::CreateVolumeRequest {
                name: name.into(),
                capacity_range: Some(csi::CapacityRange {
                    required_bytes: bytes,
                    limit_bytes: 0,
                }),
                volume_capabilities: vec![cap],
                volume_content_source: src,
                ..Default::default()
            })
            .await
            .map_err(status)?;
        let id = r
            .into_inner()
            .volume
            .map(|v| v.volume_id)
            .ok_or("no volume in the answer")?;
        self.made.volumes.push(id.clone());
        Ok(id)
    }

    async fn attach(
        &mut self,
        vol: &str,
        cap: csi::VolumeCapability,
    ) -> Step<HashMap<String, String>> {
        let r = self
            .ctl
            .controller_publish_volume(csi::ControllerPublishVolumeRequest {
                volume_id: vol.into(),
                node_id: NODE.into(),
                volume_capability: Some(cap),
                ..Default::default()
            })
            .await
            .map_err(status)?;
        self.made.attached.push(vol.into());
        Ok(r.into_inner().publish_context)
    }

    async fn stage(
        &mut self,
        vol: &str,
        ctx: HashMap<String, String>,
        cap: csi::VolumeCapability,
        staging: &Path,
    ) -> Step<()> {
        std::fs::create_dir_all(staging).map_err(|e| e.to_string())?;
        self.node
            .node_stage_volume(csi::NodeStageVolumeRequest {
                volume_id: vol.into(),
                publish_context: ctx,
                staging_target_path: staging.display().to_string(),
                volume_capability: Some(cap),
                ..Default::default()
            })
            .await
            .map_err(status)?;
        self.made.staged.push((vol.into(), staging.into()));
        Ok(())
    }

    async fn publish(
        &mut self,
        vol: &str,
        cap: csi::VolumeCapability,
        staging: &Path,
        target: &Path,
    ) -> Step<()> {
        if let Some(parent) = target.parent() {
            std::fs::create_dir_all(parent).map_err(|e| e.to_string())?;
        }
        self.node
            .node_publish_volume(csi::NodePublishVolumeRequest {
                volume_id: vol.into(),
                staging_target_path: staging.display().to_string(),
                target_path: target.display().to_string(),
                volume_capability: Some(cap),
                ..Default::default()
            })
            .await
            .map_err(status)?;
        self.made.published.push((vol.into(), target.into()));
        Ok(())
    }

    fn paths(&self, pv: &str) -> (PathBuf, PathBuf) {
        let staging = self.kubelet.join(format!(
            "plugins/kubernetes.io/csi/moor.csi.io/{pv}/globalmount"
        ));
        let target = self.kubelet.join(format!(
            "pods/demo-pod/volumes/kubernetes.io~csi/{pv}/mount"
        ));
        (staging, target)
    }

    async fn run(&mut self) -> Step<()> {
        let fs = "xfs";
        let vol = step(
            "CreateVolume demo (1 GiB)",
            self.create("demo", GIB, mount_cap(fs), None),
        )
        .await?;
        let ctx = step(
            "ControllerPublishVolume (attach as a loop device)",
            self.attach(&vol, mount_cap(fs)),
        )
        .await?;
        println!("       publish_context: {ctx:?}");
        let (staging, target) = self.paths("pv-demo");
        step(
            "NodeStageVolume (probe, mkfs.xfs, mount)",
            self.stage(&vol, ctx, mount_cap(fs), &staging),
        )
        .await?;
        step(
            "NodePublishVolume (bind mount into the pod)",
            self.publish(&vol, mount_cap(fs), &staging, &target),
        )
        .await?;
        step("write a file in the pod's volume", async {
            std::fs::write(target.join("hello.txt"), b"hello from moor\n")
                .map_err(|e| e.to_string())?;
            rustix::fs::sync();
            Ok(())
        })
        .await?;
        let snap = step("CreateSnapshot", async {
            let r = self
                .ctl
                .create_snapshot(csi::CreateSnapshotRequest {
                    source_volume_id: vol.clone(),
                    name: "demo-snap".into(),
                    ..Default::default()
                })
                .await
                .map_err(status)?;
            let id = r
                .into_inner()
                .snapshot
                .map(|s| s.snapshot_id)
                .ok_or("no snapshot")?;
            self.made.snapshots.push(id.clone());
            Ok(id)
        })
        .await?;
        let src = csi::VolumeContentSource {
            r#type: Some(csi::volume_content_source::Type::Snapshot(
                csi::volume_content_source::SnapshotSource { snapshot_id: snap },
            )),
        };
        let restored = step(
            "CreateVolume restored from the snapshot",
            self.create("demo-restored", GIB, mount_cap(fs), Some(src)),
        )
        .await?;
        let ctx2 = step(
            "ControllerPublishVolume restored",
            self.attach(&restored, mount_cap(fs)),
        )
        .await?;
        let (staging2, target2) = self.paths("pv-restored");
        step(
            "NodeStageVolume restored (no mkfs: it holds data)",
            self.stage(&restored, ctx2, mount_cap(fs), &staging2),
        )
        .await?;
        step(
            "NodePublishVolume restored",
            self.publish(&restored, mount_cap(fs), &staging2, &target2),
        )
        .await?;
        step("read the file back from the restored volume", async {
            let got =
                std::fs::read_to_string(target2.join("hello.txt")).map_err(|e| e.to_string())?;
            if got == "hello from moor\n" {
                Ok(())
            } else {
                Err(format!("read back {got:?}"))
            }
        })
        .await?;
        step("ControllerExpandVolume demo to 2 GiB", async {
            self.ctl
                .controller_expand_volume(csi::ControllerExpandVolumeRequest {
                    volume_id: vol.clone(),
                    capacity_range: Some(csi::CapacityRange {
                        required_bytes: 2 * GIB,
                        limit_bytes: 0,
                    }),
                    volume_capability: Some(mount_cap(fs)),
                    ..Default::default()
                })
                .await
                .map_err(status)
                .map(drop)
        })
        .await?;
        step("NodeExpandVolume demo online (xfs_growfs)", async {
            let r = self
                .node
                .node_expand_volume(csi::NodeExpandVolumeRequest {
                    volume_id: vol.clone(),
                    volume_path: target.display().to_string(),
                    capacity_range: Some(csi::CapacityRange {
                        required_bytes: 2 * GIB,
                        limit_bytes: 0,
                    }),
                    staging_target_path: staging.display().to_string(),
                    ..Default::default()
                })
                .await
                .map_err(status)?;
            let v = rustix::fs::statvfs(target.as_path()).map_err(|e| e.to_string())?;
            println!(
                "\r       capacity {} bytes, filesystem now {} MiB",
                r.into_inner().capacity_bytes,
                (v.f_blocks * v.f_frsize) >> 20
            );
            Ok(())
        })
        .await?;
        let blk = step(
            "CreateVolume demo-block (64 MiB, raw block)",
            self.create("demo-block", 64 << 20, block_cap(), None),
        )
        .await?;
        let ctx3 = step(
            "ControllerPublishVolume demo-block",
            self.attach(&blk, block_cap()),
        )
        .await?;
        let staging3 = self
            .kubelet
            .join("plugins/kubernetes.io/csi/volumeDevices/staging/pv-block");
        let target3 = self
            .kubelet
            .join("plugins/kubernetes.io/csi/volumeDevices/publish/pv-block/demo-pod");
        step(
            "NodeStageVolume demo-block",
            self.stage(&blk, ctx3, block_cap(), &staging3),
        )
        .await?;
        step(
            "NodePublishVolume demo-block (device node on a file)",
            self.publish(&blk, block_cap(), &staging3, &target3),
        )
        .await?;
        step("write and read 4 KiB through the block device", async {
            use std::os::unix::fs::FileExt as _;
            let f = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(&target3)
                .map_err(|e| e.to_string())?;
            let data = [0x5Au8; 4096];
            f.write_all_at(&data, 1 << 20).map_err(|e| e.to_string())?;
            let mut back = [0u8; 4096];
            f.read_exact_at(&mut back, 1 << 20)
                .map_err(|e| e.to_string())?;
            if back == data {
                Ok(())
            } else {
                Err("block data differs".into())
            }
        })
        .await?;
        Ok(())
    }

    /// Undoes everything made, in reverse; reports but does not stop on errors.
    async fn teardown(&mut self) -> bool {
        let mut clean = true;
        let made = std::mem::take(&mut self.made);
        for (vol, target) in made.published.iter().rev() {
            let r = self
                .node
                .node_unpublish_volume(csi::NodeUnpublishVolumeRequest {
                    volume_id: vol.clone(),
                    target_path: target.display().to_string(),
                });
            clean &= step(&format!("NodeUnpublishVolume {vol}"), async {
                r.await.map(drop).map_err(status)
            })
            .await
            .is_ok();
        }
        for (vol, staging) in made.staged.iter().rev() {
            let r = self
                .node
                .node_unstage_volume(csi::NodeUnstageVolumeRequest {
                    volume_id: vol.clone(),
                    staging_target_path: staging.display().to_string(),
                });
            clean &= step(&format!("NodeUnstageVolume {vol}"), async {
                r.await.map(drop).map_err(status)
            })
            .await
            .is_ok();
        }
        for vol in made.attached.iter().rev() {
            let r = self
                .ctl
                .controller_unpublish_volume(csi::ControllerUnpublishVolumeRequest {
                    volume_id: vol.clone(),
                    node_id: NODE.into(),
                    ..Default::default()
                });
            clean &= step(
                &format!("ControllerUnpublishVolume {vol} (detach)"),
                async { r.await.map(drop).map_err(status) },
            )
            .await
            .is_ok();
        }
        for snap in made.snapshots.iter().rev() {
            let r = self.ctl.delete_snapshot(csi::DeleteSnapshotRequest {
                snapshot_id: snap.clone(),
                ..Default::default()
            });
            clean &= step(&format!("DeleteSnapshot {snap}"), async {
                r.await.map(drop).map_err(status)
            })
            .await
            .is_ok();
        }
        for vol in made.volumes.iter().rev() {
            let r = self.ctl.delete_volume(csi::DeleteVolumeRequest {
                volume_id: vol.clone(),
                ..Default::default()
            });
            clean &= step(&format!("DeleteVolume {vol}"), async {
                r.await.map(drop).map_err(status)
            })
            .await
            .is_ok();
        }
        clean
    }
}

fn main() -> ExitCode {
    if !rustix::process::geteuid().is_root() {
        eprintln!("moor-demo needs root: it attaches loop devices and mounts filesystems");
        return ExitCode::FAILURE;
    }
    if let Err(e) = moor_privileged::sys::enter_private_mount_namespace() {
        eprintln!("cannot make a private mount namespace: {e}");
        return ExitCode::FAILURE;
    }
    let root = std::env::temp_dir().join(format!("moor-demo-{}", std::process::id()));
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let (ok, daemons) = rt.block_on(demo(&root));
    // Dropping the runtime closes the client connections; then the daemons stop at once.
    drop(rt);
    let mut stopped = true;
    for mut d in daemons {
        stopped &= d.terminate().success();
    }
    let ok = ok && stopped;
    let _ = std::fs::remove_dir_all(&root);
    if ok {
        println!("\nmoor demo finished: every step passed and everything it made is gone.");
        ExitCode::SUCCESS
    } else {
        println!("\nmoor demo failed (see the FAIL line above); what it made has been removed.");
        ExitCode::FAILURE
    }
}

async fn demo(root: &Path) -> (bool, Vec<Daemon>) {
    let kubelet = root.join("kubelet");
    let state = root.join("node-state");
    let data = root.join("controller-data");
    for d in [&kubelet, &state, &data] {
        if let Err(e) = std::fs::create_dir_all(d) {
            eprintln!("{}: {e}", d.display());
            return (false, vec![]);
        }
    }
    println!(
        "moor demo in {}: moor-controller (embedded backend) and moor-node",
        root.display()
    );
    let (ks, ss, ds) = (
        kubelet.display().to_string(),
        state.display().to_string(),
        data.display().to_string(),
    );
    let ctl_sock = root.join("controller.sock");
    let node_sock = root.join("node.sock");
    let controller = Daemon::start_program(
        "moor-controller",
        &ctl_sock,
        &["--node-id", NODE, "--data-dir", &ds],
    )
    .await;
    let node = Daemon::start(
        &node_sock,
        &["--node-id", NODE, "--state-dir", &ss, "--kubelet-dir", &ks],
    )
    .await;
    let (Ok(c1), Ok(c2)) = (connect(&ctl_sock).await, connect(&node_sock).await) else {
        eprintln!("cannot connect to the daemons");
        return (false, vec![controller, node]);
    };
    let mut d = Demo {
        ctl: ControllerClient::new(c1),
        node: NodeClient::new(c2),
        kubelet,
        made: Made::default(),
    };
    let ran = tokio::select! {
        r = d.run() => r.is_ok(),
        _ = tokio::signal::ctrl_c() => {
            println!("\ninterrupted: cleaning up");
            false
        }
    };
    println!("teardown:");
    let clean = d.teardown().await;
    (ran && clean, vec![controller, node])
}
