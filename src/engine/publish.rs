//! NodePublishVolume and NodeUnpublishVolume.

use moor_proto::csi::v1::volume_capability::access_mode::Mode;
use tracing::warn;

use super::{ADOPTED_MODE, Engine};
use crate::crash_points;
use crate::error::{Error, Result};
use crate::fsgroup;
use crate::journal::{AccessRecord, Durability, Phase, PublishRecord};
use crate::selinux;
use crate::sys::{BindMount, MountAttrs, MountPoint, MountState, Os};
use crate::validate::{self, Access};

impl<O: Os> Engine<O> {
    /// NodePublishVolume.
    pub fn publish(&self, req: &validate::Publish) -> Result<()> {
        let _guard = self.locks.try_lock(&req.volume_id)?;
        let mut record = self.record(&req.volume_id);
        let Some(stage) = record.stage.clone().filter(|s| s.phase == Phase::Done) else {
            return Err(Error::FailedPrecondition(format!(
                "volume {:?} is not staged on this node; NodeStageVolume must succeed first",
                req.volume_id
            )));
        };
        if stage.path != req.staging {
            return Err(Error::FailedPrecondition(format!(
                "volume {:?} is staged at {}, not {}",
                req.volume_id,
                stage.path.display(),
                req.staging.display()
            )));
        }
        let block = req.cap.access.is_block();
        if block != matches!(stage.access, AccessRecord::Block) {
            return Err(Error::FailedPrecondition(format!(
                "volume {:?} was staged as a {} volume",
                req.volume_id,
                if block { "filesystem" } else { "block" }
            )));
        }
        selinux::require_support(&*self.os, &req.cap.access)?;
        let here = record.publishes.contains_key(&req.target);
        selinux::check_publish(&req.volume_id, &req.cap.access, &stage, here)?;
        let mut attrs = match &req.cap.access {
            Access::Mount { options, .. } => options.attrs,
            Access::Block { .. } => MountAttrs::default(),
        };
        attrs.read_only |= req.readonly || req.cap.is_reader_only() || stage.attrs.read_only;
        let wanted = PublishRecord {
            block,
            attrs,
            access_mode: req.cap.mode as i32,
            phase: Phase::Done,
        };

        // Where the bind comes from, and how to recognise it on the target.
        let (source, source_dev) = if block {
            let dev = self.open_device(&req.volume_id, &stage.device)?;
            if dev.rdev != stage.rdev {
                return Err(Error::FailedPrecondition(format!(
                    "device {} is no longer the one staged for volume {:?}",
                    stage.device.display(),
                    req.volume_id
                )));
            }
            (stage.device.clone(), dev.rdev)
        } else {
            match self.os.mount_state(&stage.path)? {
                MountState::Mounted(mp) => (stage.path.clone(), mp.dev),
                other => {
                    return Err(Error::FailedPrecondition(format!(
                        "volume {:?} is not mounted at its staging path {} ({other:?}); stage it again",
                        req.volume_id,
                        stage.path.display()
                    )));
                }
            }
        };
        let matches_source = |mp: &MountPoint| {
            if block {
                mp.rdev == Some(source_dev)
            } else {
                mp.dev == source_dev && mp.is_dir
            }
        };

        // The spec's table: SINGLE_NODE_WRITER is published once read-write (read-only
        // publications beside it are fine); SINGLE_NODE_SINGLE_WRITER and
        // SINGLE_NODE_READER_ONLY once; the multi-writer and multi-node modes any number of
        // times.
        let conflicting = |p: &PublishRecord| match req.cap.mode {
            Mode::SingleNodeWriter => !attrs.read_only && !p.attrs.read_only,
            Mode::SingleNodeSingleWriter | Mode::SingleNodeReaderOnly => true,
            _ => false,
        };
        if let Some((other, _)) = record
            .publishes
            .iter()
            .find(|(t, p)| **t != req.target && conflicting(p))
        {
            return Err(Error::FailedPrecondition(format!(
                "volume {:?} is already published at {} and its access mode {} allows one {}target",
                req.volume_id,
                other.display(),
                req.cap.mode.as_str_name(),
                if req.cap.mode == Mode::SingleNodeWriter {
                    "read-write "
                } else {
                    ""
                }
            )));
        }
        if let Some(existing) = record.publishes.get(&req.target)
            && existing.access_mode != ADOPTED_MODE
            && (existing.block != wanted.block
                || existing.attrs != wanted.attrs
                || existing.access_mode != wanted.access_mode)
        {
            return Err(Error::Incompatible {
                volume: req.volume_id.clone(),
                what: "published",
                reason: format!(
                    "{} was published with other arguments",
                    req.target.display()
                ),
            });
        }
        match self.os.mount_state(&req.target)? {
            MountState::Mounted(mp) => {
                if matches_source(&mp) && mp.read_only == attrs.read_only {
                    // A retry, or a crash after the bind: the same mount is there.
                    record.publishes.insert(req.target.clone(), wanted);
                    self.journal.put(&record, Durability::Process)?;
                    return Ok(());
                }
                return Err(Error::Incompatible {
                    volume: req.volume_id.clone(),
                    what: "published",
                    reason: format!(
                        "{} is already a mount {}",
                        req.target.display(),
                        if matches_source(&mp) {
                            "with another read-only setting"
                        } else {
                            "of something else"
                        }
                    ),
                });
            }
            MountState::Corrupted { .. } => self.os.unmount(&req.target, true)?,
            MountState::Absent => {
                if block {
                    self.os.make_file(&req.target)?;
                } else {
                    self.os.make_dir(&req.target)?;
                }
            }
            MountState::NotMounted { is_dir } if is_dir == block => {
                return Err(Error::FailedPrecondition(format!(
                    "target_path {} exists and is not a {}",
                    req.target.display(),
                    if block { "file" } else { "directory" }
                )));
            }
            MountState::NotMounted { .. } => {}
        }

        if let Access::Mount {
            group: Some(gid), ..
        } = &req.cap.access
            && !attrs.read_only
        {
            fsgroup::apply(self, &req.volume_id, &stage.path, *gid)?;
        }
        record.publishes.insert(
            req.target.clone(),
            PublishRecord {
                phase: Phase::InProgress,
                ..wanted.clone()
            },
        );
        self.journal.put(&record, Durability::Process)?;
        crash_points::point("publish.binding");
        if let Err(e) = self.os.bind(&BindMount {
            source,
            target: req.target.clone(),
            attrs,
        }) {
            record.publishes.remove(&req.target);
            let _ = self.os.remove(&req.target);
            self.journal.put(&record, Durability::Process)?;
            return Err(e.into());
        }
        crash_points::point("publish.bound");
        record.publishes.insert(req.target.clone(), wanted);
        self.journal.put(&record, Durability::Process)?;
        crash_points::point("publish.done");
        Ok(())
    }

    /// NodeUnpublishVolume.
    pub fn unpublish(&self, req: &validate::Unpublish) -> Result<()> {
        let _guard = self.locks.try_lock(&req.volume_id)?;
        let mut record = self.record(&req.volume_id);
        let known = record.publishes.contains_key(&req.target);
        if !known && self.held_by_another(&req.volume_id, &req.target) {
            warn!(
                volume = req.volume_id,
                path = %req.target.display(),
                "unpublish of another volume's path: nothing to do"
            );
            return Ok(());
        }
        if known {
            if let Some(p) = record.publishes.get_mut(&req.target) {
                p.phase = Phase::InProgress;
            }
            self.journal.put(&record, Durability::Process)?;
        }
        crash_points::point("unpublish.unmounting");
        self.unmount_all(&req.target, |_| true)?;
        crash_points::point("unpublish.unmounted");
        self.os.remove(&req.target)?;
        crash_points::point("unpublish.removed");
        if known {
            record.publishes.remove(&req.target);
            self.journal.put(&record, Durability::Process)?;
        }
        crash_points::point("unpublish.done");
        Ok(())
    }
}
