//! The volume life the demo walks, as Kubernetes would: create, attach, stage, publish, write,
//! status, snapshot and restore, grow online, and a raw block volume.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use csi::controller_client::ControllerClient;
use csi::node_client::NodeClient;
use csi::volume_capability::{AccessMode, AccessType, BlockVolume, MountVolume, access_mode::Mode};
use moor_proto::csi::v1 as csi;
use tonic::transport::Channel;

use super::teardown::{Made, MadeVolume};
use super::ui::{Ui, status};
use super::{Failure, GIB, HELLO, NODE};
use crate::cli::Output;

/// The demo's state.
#[derive(Debug)]
pub(super) struct Demo {
    pub(super) ctl: ControllerClient<Channel>,
    pub(super) node: NodeClient<Channel>,
    pub(super) kubelet: PathBuf,
    pub(super) state_dir: PathBuf,
    pub(super) root: PathBuf,
    pub(super) fs: String,
    pub(super) made: Made,
}

pub(super) fn mount_cap(fs: &str) -> csi::VolumeCapability {
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

pub(super) fn block_cap() -> csi::VolumeCapability {
    csi::VolumeCapability {
        access_mode: Some(AccessMode {
            mode: Mode::SingleNodeWriter as i32,
        }),
        access_type: Some(AccessType::Block(BlockVolume {})),
    }
}

pub(super) fn io(what: &Path) -> impl FnOnce(std::io::Error) -> String + '_ {
    move |e| format!("{}: {e}", what.display())
}

impl Demo {
    pub(super) async fn create(
        &mut self,
        request: csi::CreateVolumeRequest,
    ) -> Result<String, String> {
        let index = self.made.volumes.len();
        self.made.volumes.push(MadeVolume {
            request: request.clone(),
            id: None,
        });
        let id = self
            .ctl
            .create_volume(request)
            .await
            .map_err(status("CreateVolume"))?
            .into_inner()
            .volume
            .map(|v| v.volume_id)
            .ok_or("CreateVolume answered without a volume")?;
        if let Some(m) = self.made.volumes.get_mut(index) {
            m.id = Some(id.clone());
        }
        Ok(id)
    }

    pub(super) async fn attach(
        &mut self,
        vol: &str,
        cap: csi::VolumeCapability,
    ) -> Result<HashMap<String, String>, String> {
        self.made.attached.push(vol.into());
        let r = self
            .ctl
            .controller_publish_volume(csi::ControllerPublishVolumeRequest {
                volume_id: vol.into(),
                node_id: NODE.into(),
                volume_capability: Some(cap),
                ..Default::default()
            })
            .await
            .map_err(status("ControllerPublishVolume"))?;
        Ok(r.into_inner().publish_context)
    }

    pub(super) async fn stage(
        &mut self,
        vol: &str,
        ctx: HashMap<String, String>,
        cap: csi::VolumeCapability,
        staging: &Path,
    ) -> Result<(), String> {
        if let Some(parent) = staging.parent() {
            std::fs::create_dir_all(parent).map_err(io(parent))?;
        }
        kubelets_vol_data(staging, vol)?;
        self.made.staged.push((vol.into(), staging.into()));
        self.node
            .node_stage_volume(csi::NodeStageVolumeRequest {
                volume_id: vol.into(),
                publish_context: ctx,
                staging_target_path: staging.display().to_string(),
                volume_capability: Some(cap),
                ..Default::default()
            })
            .await
            .map_err(status("NodeStageVolume"))?;
        Ok(())
    }

    pub(super) async fn publish(
        &mut self,
        vol: &str,
        cap: csi::VolumeCapability,
        staging: &Path,
        target: &Path,
    ) -> Result<(), String> {
        if let Some(parent) = target.parent() {
            std::fs::create_dir_all(parent).map_err(io(parent))?;
        }
        kubelets_vol_data(target, vol)?;
        self.made.published.push((vol.into(), target.into()));
        self.node
            .node_publish_volume(csi::NodePublishVolumeRequest {
                volume_id: vol.into(),
                staging_target_path: staging.display().to_string(),
                target_path: target.display().to_string(),
                volume_capability: Some(cap),
                ..Default::default()
            })
            .await
            .map_err(status("NodePublishVolume"))?;
        Ok(())
    }

    pub(super) async fn snapshot(&mut self, vol: &str, name: &str) -> Result<String, String> {
        let request = csi::CreateSnapshotRequest {
            source_volume_id: vol.into(),
            name: name.into(),
            ..Default::default()
        };
        let index = self.made.snapshots.len();
        self.made.snapshots.push((request.clone(), None));
        let id = self
            .ctl
            .create_snapshot(request)
            .await
            .map_err(status("CreateSnapshot"))?
            .into_inner()
            .snapshot
            .map(|s| s.snapshot_id)
            .ok_or("CreateSnapshot answered without a snapshot")?;
        if let Some(s) = self.made.snapshots.get_mut(index) {
            s.1 = Some(id.clone());
        }
        Ok(id)
    }

    pub(super) fn paths(&self, pv: &str) -> (PathBuf, PathBuf) {
        (
            self.kubelet.join(format!(
                "plugins/kubernetes.io/csi/moor.csi.io/{pv}/globalmount"
            )),
            self.kubelet.join(format!(
                "pods/demo-pod/volumes/kubernetes.io~csi/{pv}/mount"
            )),
        )
    }

    pub(super) fn volume_request(
        name: &str,
        bytes: i64,
        cap: csi::VolumeCapability,
        src: Option<csi::VolumeContentSource>,
    ) -> csi::CreateVolumeRequest {
        csi::CreateVolumeRequest {
            name: name.into(),
            capacity_range: Some(csi::CapacityRange {
                required_bytes: bytes,
                limit_bytes: 0,
            }),
            volume_capabilities: vec![cap],
            volume_content_source: src,
            ..Default::default()
        }
    }

    /// The volume life, up to the point where everything is in use.
    pub(super) async fn walk(&mut self, ui: &Ui) -> Result<(), Failure> {
        let fs = self.fs.clone();
        let vol = ui
            .step(
                "CreateVolume demo (1 GiB sparse file)",
                true,
                self.create(Self::volume_request("demo", GIB, mount_cap(&fs), None)),
            )
            .await?;
        let ctx = ui
            .step(
                "ControllerPublishVolume demo (attach as a loop device)",
                true,
                self.attach(&vol, mount_cap(&fs)),
            )
            .await?;
        println!(
            "        publish_context: {}",
            crate::output::key_values(&ctx)
        );
        let (staging, target) = self.paths("pv-demo");
        ui.step(
            &format!("NodeStageVolume demo (probe: blank, mkfs.{fs}, mount)"),
            true,
            self.stage(&vol, ctx, mount_cap(&fs), &staging),
        )
        .await?;
        ui.step(
            "NodePublishVolume demo (bind mount into the pod)",
            true,
            self.publish(&vol, mount_cap(&fs), &staging, &target),
        )
        .await?;
        ui.step("write hello.txt in the pod's volume", true, async {
            let file = target.join("hello.txt");
            std::fs::write(&file, HELLO).map_err(io(&file))?;
            rustix::fs::sync();
            Ok(())
        })
        .await?;
        let (state_dir, root) = (self.state_dir.clone(), self.root.clone());
        let table = ui
            .step(
                "moorctl status (journal against the mount table)",
                true,
                async {
                    let (report, unhealthy) = crate::status::status(&state_dir, Some(&root))
                        .map_err(|e| e.to_string())?;
                    match unhealthy {
                        Some(summary) => {
                            Err(format!("{summary}\n{}", report.render(Output::Table)))
                        }
                        None => Ok(report.render(Output::Table)),
                    }
                },
            )
            .await?;
        for line in table.lines() {
            println!("        {line}");
        }
        let snap = ui
            .step(
                "CreateSnapshot demo-snap (reflink or sparse copy)",
                true,
                self.snapshot(&vol, "demo-snap"),
            )
            .await?;
        let src = csi::VolumeContentSource {
            r#type: Some(csi::volume_content_source::Type::Snapshot(
                csi::volume_content_source::SnapshotSource { snapshot_id: snap },
            )),
        };
        let restored = ui
            .step(
                "CreateVolume demo-restored from the snapshot",
                true,
                self.create(Self::volume_request(
                    "demo-restored",
                    GIB,
                    mount_cap(&fs),
                    Some(src),
                )),
            )
            .await?;
        let ctx2 = ui
            .step(
                "ControllerPublishVolume demo-restored",
                true,
                self.attach(&restored, mount_cap(&fs)),
            )
            .await?;
        let (staging2, target2) = self.paths("pv-restored");
        ui.step(
            "NodeStageVolume demo-restored (holds data: no mkfs)",
            true,
            self.stage(&restored, ctx2, mount_cap(&fs), &staging2),
        )
        .await?;
        ui.step(
            "NodePublishVolume demo-restored",
            true,
            self.publish(&restored, mount_cap(&fs), &staging2, &target2),
        )
        .await?;
        ui.step(
            "read hello.txt back from the restored volume",
            true,
            async {
                let file = target2.join("hello.txt");
                let got = std::fs::read_to_string(&file).map_err(io(&file))?;
                if got == HELLO {
                    Ok(())
                } else {
                    Err(format!("read back {got:?}, wrote {HELLO:?}"))
                }
            },
        )
        .await?;
        let mut ctl = self.ctl.clone();
        let grow = vol.clone();
        let cap = mount_cap(&fs);
        ui.step("ControllerExpandVolume demo to 2 GiB", true, async move {
            ctl.controller_expand_volume(csi::ControllerExpandVolumeRequest {
                volume_id: grow,
                capacity_range: Some(csi::CapacityRange {
                    required_bytes: 2 * GIB,
                    limit_bytes: 0,
                }),
                volume_capability: Some(cap),
                ..Default::default()
            })
            .await
            .map(drop)
            .map_err(status("ControllerExpandVolume"))
        })
        .await?;
        let mut node = self.node.clone();
        let (grow, t, s) = (vol.clone(), target.clone(), staging.clone());
        let size = ui
            .step(
                &format!("NodeExpandVolume demo online (grow {fs} while mounted)"),
                true,
                async move {
                    node.node_expand_volume(csi::NodeExpandVolumeRequest {
                        volume_id: grow,
                        volume_path: t.display().to_string(),
                        capacity_range: Some(csi::CapacityRange {
                            required_bytes: 2 * GIB,
                            limit_bytes: 0,
                        }),
                        staging_target_path: s.display().to_string(),
                        ..Default::default()
                    })
                    .await
                    .map_err(status("NodeExpandVolume"))?;
                    let v =
                        rustix::fs::statvfs(t.as_path()).map_err(|e| format!("statvfs: {e}"))?;
                    Ok(v.f_blocks.saturating_mul(v.f_frsize))
                },
            )
            .await?;
        println!(
            "        the filesystem is now {}",
            crate::output::human_bytes(i64::try_from(size).unwrap_or(i64::MAX))
        );
        let blk = ui
            .step(
                "CreateVolume demo-block (64 MiB, raw block)",
                true,
                self.create(Self::volume_request(
                    "demo-block",
                    64 << 20,
                    block_cap(),
                    None,
                )),
            )
            .await?;
        let ctx3 = ui
            .step(
                "ControllerPublishVolume demo-block",
                true,
                self.attach(&blk, block_cap()),
            )
            .await?;
        let staging3 = self
            .kubelet
            .join("plugins/kubernetes.io/csi/volumeDevices/staging/pv-block");
        let target3 = self
            .kubelet
            .join("plugins/kubernetes.io/csi/volumeDevices/publish/pv-block/demo-pod");
        ui.step(
            "NodeStageVolume demo-block (device checked, nothing mounted)",
            true,
            self.stage(&blk, ctx3, block_cap(), &staging3),
        )
        .await?;
        ui.step(
            "NodePublishVolume demo-block (the device node on a file)",
            true,
            self.publish(&blk, block_cap(), &staging3, &target3),
        )
        .await?;
        ui.step(
            "write and read 4 KiB through the block device",
            true,
            async {
                use std::os::unix::fs::FileExt as _;
                let f = std::fs::OpenOptions::new()
                    .read(true)
                    .write(true)
                    .open(&target3)
                    .map_err(io(&target3))?;
                let data = [0x5Au8; 4096];
                f.write_all_at(&data, 1 << 20).map_err(io(&target3))?;
                f.sync_all().map_err(io(&target3))?;
                let mut back = [0u8; 4096];
                f.read_exact_at(&mut back, 1 << 20).map_err(io(&target3))?;
                if back == data {
                    Ok(())
                } else {
                    Err("the block device gave back other data".into())
                }
            },
        )
        .await?;
        Ok(())
    }
}

/// Writes the `vol_data.json` kubelet keeps for the mount at `path` of volume `vol`, as the
/// demo plays kubelet (kubelet writes it before it calls the plugin, and removes it after).
fn kubelets_vol_data(path: &Path, vol: &str) -> Result<(), String> {
    let Some(file) = moor_node::reconcile::vol_data_by_shape(path) else {
        return Ok(());
    };
    if let Some(dir) = file.parent() {
        std::fs::create_dir_all(dir).map_err(io(dir))?;
    }
    let data = serde_json::json!({"driverName": "moor.csi.io", "volumeHandle": vol});
    std::fs::write(&file, data.to_string()).map_err(io(&file))
}
