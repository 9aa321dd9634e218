//! End to end through both real binaries on Unix sockets, in the order Kubernetes calls them
//! (run as root, after `cargo build --bins`): create, attach, stage, publish, write, snapshot,
//! restore into a new volume and read the data back, expand, and tear it all down, for a
//! filesystem volume and a raw block volume. Afterwards nothing may remain: no loop device,
//! no mount, no file outside the daemons' data dirs.

use std::collections::HashMap;
use std::io::{Seek as _, SeekFrom};
use std::os::unix::fs::FileExt as _;
use std::path::{Path, PathBuf};

use csi::controller_client::ControllerClient;
use csi::node_client::NodeClient;
use csi::volume_capability::{AccessMode, AccessType, BlockVolume, access_mode::Mode};
use moor_privileged::client::{Daemon, connect};
use moor_privileged::requests::{unpublish_req, unstage_req};
use moor_privileged::{
    LoopSweep, Sandbox, fs_cap, is_block_device, is_mount_point, loops_under, no_loops_under,
};
use moor_proto::csi::v1 as csi;
use tonic::transport::Channel;

const MIB: i64 = 1 << 20;
const NODE: &str = "node-e2e";
const PATTERN: &[u8] = b"moor end to end: the same bytes after snapshot and restore";

fn mount_cap(fs: &str) -> csi::VolumeCapability {
    fs_cap(fs, Mode::SingleNodeWriter)
}

fn block_cap() -> csi::VolumeCapability {
    csi::VolumeCapability {
        access_mode: Some(AccessMode {
            mode: Mode::SingleNodeWriter as i32,
        }),
        access_type: Some(AccessType::Block(BlockVolume {})),
    }
}

/// Every file (not directory) below `dir`.
fn files_below(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return out;
    };
    for e in entries.flatten() {
        let p = e.path();
        match e.file_type() {
            Ok(t) if t.is_dir() => out.extend(files_below(&p)),
            Ok(_) => out.push(p),
            Err(_) => {}
        }
    }
    out
}

/// What the test made, to undo in reverse.
#[derive(Debug, Default)]
struct Made {
    volumes: Vec<String>,
    snapshots: Vec<String>,
    attached: Vec<String>,
    staged: Vec<(String, PathBuf)>,
    published: Vec<(String, PathBuf)>,
}

struct Cluster {
    ctl: ControllerClient<Channel>,
    node: NodeClient<Channel>,
    made: Made,
}

impl Cluster {
    async fn create(
        &mut self,
        name: &str,
        bytes: i64,
        cap: &csi::VolumeCapability,
        source: Option<csi::VolumeContentSource>,
    ) -> String {
        let v = self
            .ctl
            .create_volume(csi::CreateVolumeRequest {
                name: name.into(),
                capacity_range: Some(csi::CapacityRange {
                    required_bytes: bytes,
                    limit_bytes: 0,
                }),
                volume_capabilities: vec![cap.clone()],
                volume_content_source: source,
                ..Default::default()
            })
            .await
            .expect("CreateVolume")
            .into_inner()
            .volume
            .expect("a volume");
        assert!(v.capacity_bytes >= bytes);
        self.made.volumes.push(v.volume_id.clone());
        v.volume_id
    }

    async fn attach(&mut self, vol: &str, cap: &csi::VolumeCapability) -> HashMap<String, String> {
        let ctx = self
            .ctl
            .controller_publish_volume(csi::ControllerPublishVolumeRequest {
                volume_id: vol.into(),
                node_id: NODE.into(),
                volume_capability: Some(cap.clone()),
                ..Default::default()
            })
            .await
            .expect("ControllerPublishVolume")
            .into_inner()
            .publish_context;
        self.made.attached.push(vol.into());
        // The node finds the device by this identity, not by the path alone.
        assert!(ctx.contains_key("backingFile"), "{ctx:?}");
        ctx
    }

    async fn stage(
        &mut self,
        vol: &str,
        ctx: HashMap<String, String>,
        cap: &csi::VolumeCapability,
        staging: &Path,
    ) {
        self.node
            .node_stage_volume(csi::NodeStageVolumeRequest {
                volume_id: vol.into(),
                publish_context: ctx,
                staging_target_path: staging.display().to_string(),
                volume_capability: Some(cap.clone()),
                ..Default::default()
            })
            .await
            .expect("NodeStageVolume");
        self.made.staged.push((vol.into(), staging.into()));
    }

    async fn publish(
        &mut self,
        vol: &str,
        cap: &csi::VolumeCapability,
        staging: &Path,
        target: &Path,
    ) {
        self.node
            .node_publish_volume(csi::NodePublishVolumeRequest {
                volume_id: vol.into(),
                staging_target_path: staging.display().to_string(),
                target_path: target.display().to_string(),
                volume_capability: Some(cap.clone()),
                ..Default::default()
            })
            .await
            .expect("NodePublishVolume");
        self.made.published.push((vol.into(), target.into()));
    }

    async fn snapshot(&mut self, vol: &str, name: &str) -> csi::VolumeContentSource {
        let s = self
            .ctl
            .create_snapshot(csi::CreateSnapshotRequest {
                source_volume_id: vol.into(),
                name: name.into(),
                ..Default::default()
            })
            .await
            .expect("CreateSnapshot")
            .into_inner()
            .snapshot
            .expect("a snapshot");
        assert!(s.ready_to_use);
        self.made.snapshots.push(s.snapshot_id.clone());
        csi::VolumeContentSource {
            r#type: Some(csi::volume_content_source::Type::Snapshot(
                csi::volume_content_source::SnapshotSource {
                    snapshot_id: s.snapshot_id,
                },
            )),
        }
    }

    /// ControllerExpandVolume, then NodeExpandVolume when the controller asks for it.
    async fn expand(
        &mut self,
        vol: &str,
        bytes: i64,
        cap: &csi::VolumeCapability,
        staging: &Path,
        target: &Path,
    ) -> bool {
        let r = self
            .ctl
            .controller_expand_volume(csi::ControllerExpandVolumeRequest {
                volume_id: vol.into(),
                capacity_range: Some(csi::CapacityRange {
                    required_bytes: bytes,
                    limit_bytes: 0,
                }),
                volume_capability: Some(cap.clone()),
                ..Default::default()
            })
            .await
            .expect("ControllerExpandVolume")
            .into_inner();
        assert!(r.capacity_bytes >= bytes);
        if r.node_expansion_required {
            let n = self
                .node
                .node_expand_volume(csi::NodeExpandVolumeRequest {
                    volume_id: vol.into(),
                    volume_path: target.display().to_string(),
                    capacity_range: Some(csi::CapacityRange {
                        required_bytes: bytes,
                        limit_bytes: 0,
                    }),
                    staging_target_path: staging.display().to_string(),
                    volume_capability: Some(cap.clone()),
                    ..Default::default()
                })
                .await
                .expect("NodeExpandVolume")
                .into_inner();
            assert!(n.capacity_bytes == 0 || n.capacity_bytes >= bytes);
        }
        r.node_expansion_required
    }

    /// Undoes everything made, in reverse, as Kubernetes does; every step must succeed.
    async fn teardown(&mut self) -> Vec<String> {
        let made = std::mem::take(&mut self.made);
        let mut failed = Vec::new();
        for (vol, target) in made.published.iter().rev() {
            let r = self
                .node
                .node_unpublish_volume(unpublish_req(vol, target))
                .await;
            if let Err(e) = r {
                failed.push(format!("NodeUnpublishVolume {vol}: {e}"));
            }
        }
        for (vol, staging) in made.staged.iter().rev() {
            let r = self
                .node
                .node_unstage_volume(unstage_req(vol, staging))
                .await;
            if let Err(e) = r {
                failed.push(format!("NodeUnstageVolume {vol}: {e}"));
            }
        }
        for vol in made.attached.iter().rev() {
            let r = self
                .ctl
                .controller_unpublish_volume(csi::ControllerUnpublishVolumeRequest {
                    volume_id: vol.clone(),
                    node_id: NODE.into(),
                    ..Default::default()
                })
                .await;
            if let Err(e) = r {
                failed.push(format!("ControllerUnpublishVolume {vol}: {e}"));
            }
        }
        for snap in made.snapshots.iter().rev() {
            let r = self
                .ctl
                .delete_snapshot(csi::DeleteSnapshotRequest {
                    snapshot_id: snap.clone(),
                    ..Default::default()
                })
                .await;
            if let Err(e) = r {
                failed.push(format!("DeleteSnapshot {snap}: {e}"));
            }
        }
        for vol in made.volumes.iter().rev() {
            let r = self
                .ctl
                .delete_volume(csi::DeleteVolumeRequest {
                    volume_id: vol.clone(),
                    ..Default::default()
                })
                .await;
            if let Err(e) = r {
                failed.push(format!("DeleteVolume {vol}: {e}"));
            }
        }
        failed
    }
}

/// The filesystem access type: a file written in the pod's volume is in the restored one.
async fn filesystem_life(c: &mut Cluster, sb: &Sandbox) {
    let fs = "xfs";
    let cap = mount_cap(fs);
    let vol = c.create("e2e-fs", 512 * MIB, &cap, None).await;
    let ctx = c.attach(&vol, &cap).await;
    let staging = sb.staging("pv-fs");
    let target = sb.target("pod-e2e", "pv-fs");
    c.stage(&vol, ctx, &cap, &staging).await;
    c.publish(&vol, &cap, &staging, &target).await;
    assert!(is_mount_point(&target));
    std::fs::write(target.join("data.txt"), PATTERN).expect("write in the volume");
    rustix::fs::sync();

    let source = c.snapshot(&vol, "e2e-fs-snap").await;
    // Restored into a larger volume: the pod sees the larger size.
    let restored = c
        .create("e2e-fs-restored", 768 * MIB, &cap, Some(source))
        .await;
    let mut ctx2 = c.attach(&restored, &cap).await;
    // No path hint at all: the node finds the device by its identity alone.
    ctx2.remove("devicePath");
    let staging2 = sb.staging("pv-fs-restored");
    let target2 = sb.target("pod-e2e", "pv-fs-restored");
    c.stage(&restored, ctx2, &cap, &staging2).await;
    c.publish(&restored, &cap, &staging2, &target2).await;
    assert_eq!(
        std::fs::read(target2.join("data.txt")).expect("read from the restored volume"),
        PATTERN
    );
    let restored_fs = rustix::fs::statvfs(target2.as_path()).expect("statvfs");
    assert!(
        restored_fs.f_blocks * restored_fs.f_frsize > 700 << 20,
        "the restored filesystem was not grown to its volume: {} blocks",
        restored_fs.f_blocks
    );

    // xfs grows online (ext4 online growth needs CAP_SYS_RESOURCE, which tests lack).
    let before = rustix::fs::statvfs(target.as_path()).expect("statvfs");
    assert!(c.expand(&vol, 1024 * MIB, &cap, &staging, &target).await);
    let after = rustix::fs::statvfs(target.as_path()).expect("statvfs");
    assert!(
        after.f_blocks * after.f_frsize > before.f_blocks * before.f_frsize + 400 * (1 << 20),
        "the filesystem did not grow: {} -> {} blocks",
        before.f_blocks,
        after.f_blocks
    );
    assert_eq!(
        std::fs::read(target.join("data.txt")).expect("read after growth"),
        PATTERN
    );
}

fn device_size(path: &Path) -> u64 {
    let mut f = std::fs::File::open(path).expect("open device");
    f.seek(SeekFrom::End(0)).expect("seek to the end")
}

/// The block access type: bytes written through the pod's device node are in the restored
/// volume's device.
async fn block_life(c: &mut Cluster, sb: &Sandbox) {
    let cap = block_cap();
    let vol = c.create("e2e-block", 64 * MIB, &cap, None).await;
    let ctx = c.attach(&vol, &cap).await;
    let staging = sb.k("plugins/kubernetes.io/csi/volumeDevices/staging/pv-block");
    std::fs::create_dir_all(sb.k("plugins/kubernetes.io/csi/volumeDevices/staging"))
        .expect("kubelet's staging dir");
    let target = sb.block_target("pod-e2e", "pv-block");
    c.stage(&vol, ctx, &cap, &staging).await;
    c.publish(&vol, &cap, &staging, &target).await;
    assert!(is_block_device(&target));
    {
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(&target)
            .expect("open the published device");
        f.write_all_at(PATTERN, 1 << 20).expect("write");
        f.sync_all().expect("sync");
    }

    let source = c.snapshot(&vol, "e2e-block-snap").await;
    let restored = c
        .create("e2e-block-restored", 64 * MIB, &cap, Some(source))
        .await;
    let ctx2 = c.attach(&restored, &cap).await;
    let staging2 = sb.k("plugins/kubernetes.io/csi/volumeDevices/staging/pv-block-restored");
    let target2 = sb.block_target("pod-e2e", "pv-block-restored");
    c.stage(&restored, ctx2, &cap, &staging2).await;
    c.publish(&restored, &cap, &staging2, &target2).await;
    let mut back = vec![0u8; PATTERN.len()];
    std::fs::File::open(&target2)
        .expect("open the restored device")
        .read_exact_at(&mut back, 1 << 20)
        .expect("read");
    assert_eq!(back, PATTERN);

    assert_eq!(device_size(&target), 64 << 20);
    c.expand(&vol, 128 * MIB, &cap, &staging, &target).await;
    assert_eq!(device_size(&target), 128 << 20, "the device did not grow");
}

/// Runs one volume life on fresh daemons, tears it down (also after a failure) and checks
/// that nothing remains.
fn life(name: &str, body: for<'a> fn(&'a mut Cluster, &'a Sandbox) -> BoxedLife<'a>) {
    let sb = Sandbox::new(name);
    let _sweep = LoopSweep(sb.root.clone());
    let ctl_data = sb.data.join("controller");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let ds = ctl_data.display().to_string();
    let ctl_sock = sb.root.join("controller.sock");
    let node_sock = sb.root.join("node.sock");
    let mut daemons = rt.block_on(async {
        let controller = Daemon::start_program(
            "moor-controller",
            &ctl_sock,
            &["--node-id", NODE, "--data-dir", &ds],
        )
        .await;
        let node = Daemon::start(&node_sock, &sb.node_args(NODE, &[])).await;
        [controller, node]
    });
    let mut cluster = rt.block_on(async {
        Cluster {
            ctl: ControllerClient::new(connect(&ctl_sock).await.expect("controller socket")),
            node: NodeClient::new(connect(&node_sock).await.expect("node socket")),
            made: Made::default(),
        }
    });
    let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        rt.block_on(body(&mut cluster, &sb));
    }));
    let failed = rt.block_on(cluster.teardown());
    drop(cluster);
    drop(rt);
    let stopped: Vec<_> = daemons.iter_mut().map(Daemon::terminate).collect();
    if let Err(panic) = ran {
        std::panic::resume_unwind(panic);
    }
    assert!(failed.is_empty(), "teardown: {failed:#?}");
    assert!(stopped.iter().all(|s| s.success()), "{stopped:?}");

    // Nothing remains: no mount, no loop device, no file but the daemons' own records.
    assert_eq!(sb.mounts(), Vec::<PathBuf>::new());
    // A detached device goes once its last user (udev's probe, say) closes it.
    assert!(no_loops_under(&sb.root), "{:?}", loops_under(&sb.root));
    let stray: Vec<_> = files_below(&sb.root)
        .into_iter()
        .filter(|f| !f.starts_with(&ctl_data) && !f.starts_with(&sb.state))
        // kubelet's own, which the sandbox makes as kubelet does and kubelet removes.
        .filter(|f| !f.ends_with("vol_data.json"))
        .collect();
    assert_eq!(stray, Vec::<PathBuf>::new(), "files outside the data dirs");
    for dir in ["volumes", "snapshots", "tmp"] {
        let left: Vec<_> = files_below(&ctl_data.join(dir))
            .into_iter()
            .filter(|f| f.extension().is_none_or(|e| e != "json"))
            .collect();
        assert_eq!(left, Vec::<PathBuf>::new(), "{dir} still holds data");
    }
}

type BoxedLife<'a> = std::pin::Pin<Box<dyn std::future::Future<Output = ()> + 'a>>;

#[test]
fn a_filesystem_volume_lives_and_goes_through_both_daemons() {
    life("e2e-fs", |c, sb| Box::pin(filesystem_life(c, sb)));
}

#[test]
fn a_block_volume_lives_and_goes_through_both_daemons() {
    life("e2e-block", |c, sb| Box::pin(block_life(c, sb)));
}
