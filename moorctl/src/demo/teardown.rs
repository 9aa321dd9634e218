//! Undoing the demo: what it made is recorded before each call, and undone in reverse.

use std::path::PathBuf;

use moor_proto::csi::v1 as csi;

use super::ui::{Ui, status};
use super::volume_life::Demo;
use super::{Failure, NODE};

/// A volume the demo asked for: its request, so an interrupted create can be repeated
/// (CreateVolume is idempotent by name) to learn the id to delete.
#[derive(Debug, Clone)]
pub(super) struct MadeVolume {
    pub(super) request: csi::CreateVolumeRequest,
    pub(super) id: Option<String>,
}

/// What the demo asked for, recorded before each call, undone in reverse.
#[derive(Debug, Default)]
pub(super) struct Made {
    pub(super) volumes: Vec<MadeVolume>,
    pub(super) snapshots: Vec<(csi::CreateSnapshotRequest, Option<String>)>,
    pub(super) attached: Vec<String>,
    pub(super) staged: Vec<(String, PathBuf)>,
    pub(super) published: Vec<(String, PathBuf)>,
}

impl Made {
    /// A volume's name, for people, or its id if it is not one the demo made.
    pub(super) fn label<'a>(&'a self, id: &'a str) -> &'a str {
        self.volumes
            .iter()
            .find(|v| v.id.as_deref() == Some(id))
            .map_or(id, |v| v.request.name.as_str())
    }
}

impl Demo {
    /// Undoes everything recorded, in reverse, as Kubernetes would on deletion: unpublish,
    /// unstage, detach, delete. Goes on past errors; returns the first.
    pub(super) async fn teardown(&mut self, ui: &Ui) -> Result<(), Failure> {
        let made = std::mem::take(&mut self.made);
        let mut first: Option<Failure> = None;
        let mut keep = |r: Result<(), Failure>| {
            if let Err(f) = r {
                first.get_or_insert(f);
            }
        };
        for (vol, target) in made.published.iter().rev() {
            let mut node = self.node.clone();
            let req = csi::NodeUnpublishVolumeRequest {
                volume_id: vol.clone(),
                target_path: target.display().to_string(),
            };
            keep(
                ui.step(
                    &format!("NodeUnpublishVolume {}", made.label(vol)),
                    false,
                    async move {
                        node.node_unpublish_volume(req)
                            .await
                            .map(drop)
                            .map_err(status("NodeUnpublishVolume"))
                    },
                )
                .await,
            );
        }
        for (vol, staging) in made.staged.iter().rev() {
            let mut node = self.node.clone();
            let req = csi::NodeUnstageVolumeRequest {
                volume_id: vol.clone(),
                staging_target_path: staging.display().to_string(),
            };
            keep(
                ui.step(
                    &format!("NodeUnstageVolume {}", made.label(vol)),
                    false,
                    async move {
                        node.node_unstage_volume(req)
                            .await
                            .map(drop)
                            .map_err(status("NodeUnstageVolume"))
                    },
                )
                .await,
            );
        }
        for vol in made.attached.iter().rev() {
            let mut ctl = self.ctl.clone();
            let req = csi::ControllerUnpublishVolumeRequest {
                volume_id: vol.clone(),
                node_id: NODE.into(),
                ..Default::default()
            };
            keep(
                ui.step(
                    &format!("ControllerUnpublishVolume {} (detach)", made.label(vol)),
                    false,
                    async move {
                        ctl.controller_unpublish_volume(req)
                            .await
                            .map(drop)
                            .map_err(status("ControllerUnpublishVolume"))
                    },
                )
                .await,
            );
        }
        for (req, id) in made.snapshots.iter().rev() {
            let mut ctl = self.ctl.clone();
            let (req, id) = (req.clone(), id.clone());
            keep(
                ui.step(&format!("DeleteSnapshot {}", req.name), false, async move {
                    let id = match id {
                        Some(id) => id,
                        // Cut short: ask again (idempotent by name) to learn the id.
                        None => match ctl.create_snapshot(req).await {
                            Ok(r) => r
                                .into_inner()
                                .snapshot
                                .map(|s| s.snapshot_id)
                                .unwrap_or_default(),
                            Err(_) => return Ok(()),
                        },
                    };
                    ctl.delete_snapshot(csi::DeleteSnapshotRequest {
                        snapshot_id: id,
                        ..Default::default()
                    })
                    .await
                    .map(drop)
                    .map_err(status("DeleteSnapshot"))
                })
                .await,
            );
        }
        for v in made.volumes.iter().rev() {
            let mut ctl = self.ctl.clone();
            let v = v.clone();
            keep(
                ui.step(
                    &format!("DeleteVolume {}", v.request.name),
                    false,
                    async move {
                        let id = match v.id {
                            Some(id) => id,
                            None => match ctl.create_volume(v.request).await {
                                Ok(r) => r
                                    .into_inner()
                                    .volume
                                    .map(|v| v.volume_id)
                                    .unwrap_or_default(),
                                Err(_) => return Ok(()),
                            },
                        };
                        ctl.delete_volume(csi::DeleteVolumeRequest {
                            volume_id: id,
                            ..Default::default()
                        })
                        .await
                        .map(drop)
                        .map_err(status("DeleteVolume"))
                    },
                )
                .await,
            );
        }
        first.map_or(Ok(()), Err)
    }
}
