//! NodePublishVolume and NodeUnpublishVolume.

use std::path::PathBuf;
use std::sync::Arc;

use moor_proto::csi::v1::volume_capability::access_mode::Mode;
use tracing::{info, warn};

use super::{ADOPTED_MODE, Access, Engine, Publish, QosOutcome, Unpublish};
use crate::crash_points;
use crate::error::{Error, Result};
use crate::fsgroup;
use crate::journal::{AccessRecord, Durability, Phase, PublishRecord, StageRecord, VolumeRecord};
use crate::selinux;
use crate::sys::{BindMount, Held, MountAttrs, MountPoint, MountState, Os};

/// Where a publication's bind mount comes from: the staging mount, or for a block volume the
/// device node.
struct Source {
    path: PathBuf,
    /// The staging mount as it was checked, held: what the bind clones (none for a device
    /// node, which lies outside the kubelet dir and is opened by its path).
    held: Option<Held>,
    /// The device number that recognises it on the target: the staging mount's, or the
    /// device's.
    dev: (u32, u32),
    block: bool,
}

impl Source {
    /// Whether `mp` is a bind of this source.
    fn is_bound_at(&self, mp: &MountPoint) -> bool {
        if self.block {
            mp.rdev == Some(self.dev)
        } else {
            mp.dev == self.dev && mp.is_dir
        }
    }
}

/// What publishing found on the target.
enum Target {
    /// The bind is there already.
    Bound,
    /// Ready for the bind; `parent`: the directory this call made it in, held.
    Ready { parent: Option<Held> },
}

/// The volume's stage (`stage`: the record's, unless it is a memory from before a reboot),
/// which must be done, at the request's staging path, and of the same access type.
fn staged_for_publish(stage: Option<&StageRecord>, req: &Publish) -> Result<StageRecord> {
    let Some(stage) = stage.filter(|s| s.phase == Phase::Done).cloned() else {
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
    Ok(stage)
}

/// The per-mount attributes of the publication: read-only when asked, for a reader-only mode,
/// or over a read-only stage.
fn publish_attrs(req: &Publish, stage: &StageRecord) -> MountAttrs {
    let mut attrs = match &req.cap.access {
        Access::Mount { options, .. } => options.attrs,
        Access::Block { .. } => MountAttrs::default(),
    };
    attrs.read_only |= req.readonly || req.cap.is_reader_only() || stage.attrs.read_only;
    attrs
}

/// The publication `wanted` against the volume's others: the access mode's table, and the
/// arguments of an earlier publication at the same target.
fn check_publications(record: &VolumeRecord, req: &Publish, wanted: &PublishRecord) -> Result<()> {
    // The spec's table: SINGLE_NODE_WRITER is published once read-write (read-only
    // publications beside it are fine); SINGLE_NODE_SINGLE_WRITER and
    // SINGLE_NODE_READER_ONLY once; the multi-writer and multi-node modes any number of
    // times.
    let conflicting = |p: &PublishRecord| match req.cap.mode {
        Mode::SingleNodeWriter => !wanted.attrs.read_only && !p.attrs.read_only,
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
    Ok(())
}

impl<O: Os> Engine<O> {
    /// NodePublishVolume: a bind mount of the staged volume on the target, as the access mode
    /// allows, and the volume's QoS limits in the pod's cgroup.
    pub fn publish(&self, req: &Publish) -> Result<()> {
        self.publish_report(req).map(|_| ())
    }

    /// [`Engine::publish`], saying what became of the volume's QoS limits.
    pub fn publish_report(&self, req: &Publish) -> Result<QosOutcome> {
        let _guard = self.locks.try_lock(&req.volume_id)?;
        let mut record = self.record(&req.volume_id);
        let stage = staged_for_publish(
            record.stage.as_ref().filter(|s| !self.stage_is_memory(s)),
            req,
        )?;
        selinux::require_support(&*self.os, &req.cap.access)?;
        // Publications a reboot ended hold no target: forgotten, and written with this one.
        let forgotten = self.forget_publications(&mut record);
        for target in &forgotten {
            info!(
                volume = req.volume_id,
                path = %target.display(),
                "a publication recorded before the node rebooted is not mounted: forgotten \
                 (kubelet had ended it, or publishes it again)"
            );
        }
        let forgot = !forgotten.is_empty();
        let here = record.publishes.contains_key(&req.target);
        selinux::check_publish(&req.volume_id, &req.cap.access, &stage, here)?;
        let wanted = PublishRecord {
            block: req.cap.access.is_block(),
            attrs: publish_attrs(req, &stage),
            access_mode: req.cap.mode as i32,
            phase: Phase::Done,
            boot: self.boot().stamp(),
        };
        let source = self.bind_source(req, &stage)?;
        check_publications(&record, req, &wanted)?;
        // Before the bind: a limit the kernel refuses leaves nothing mounted.
        let qos = self.apply_qos(req, stage.rdev, !here)?;
        let parent = match self.prepare_target(req, &source, wanted.attrs.read_only)? {
            Target::Ready { parent } => parent,
            Target::Bound => {
                // A retry, or a crash after the bind: the same mount is there. The journal is
                // written only if its record says otherwise (a crash before the confirmation, an
                // adopted record): a retry that finds it all done (kubelet re-drives every
                // publication when it restarts) changes nothing, on the node or on disk.
                if forgot || record.publishes.get(&req.target) != Some(&wanted) {
                    record.publishes.insert(req.target.clone(), wanted);
                    self.journal.put(&record, Durability::Process)?;
                }
                return Ok(qos);
            }
        };
        if let Access::Mount {
            group: Some(gid), ..
        } = &req.cap.access
            && !wanted.attrs.read_only
        {
            fsgroup::apply(self, &req.volume_id, &stage.path, *gid)?;
        }
        self.bind_target(&mut record, req, &source, parent.as_ref(), wanted)?;
        Ok(qos)
    }

    /// Where the bind comes from, and how to recognise it on the target.
    fn bind_source(&self, req: &Publish, stage: &StageRecord) -> Result<Source> {
        if req.cap.access.is_block() {
            let dev = self.open_device(&req.volume_id, &stage.device)?;
            if dev.rdev != stage.rdev {
                return Err(Error::FailedPrecondition(format!(
                    "device {} is no longer the one staged for volume {:?}",
                    stage.device.display(),
                    req.volume_id
                )));
            }
            return Ok(Source {
                path: stage.device.clone(),
                held: None,
                dev: dev.rdev,
                block: true,
            });
        }
        match self.os.mount_state_held(&stage.path)? {
            (MountState::Mounted(mp), held) => Ok(Source {
                path: stage.path.clone(),
                held,
                dev: mp.dev,
                block: false,
            }),
            (other, _) => Err(Error::FailedPrecondition(format!(
                "volume {:?} is not mounted at its staging path {} ({other:?}); stage it again",
                req.volume_id,
                stage.path.display()
            ))),
        }
    }

    /// Readies the target: a file for a block volume, a directory otherwise; a corrupted mount
    /// on it is detached. Whether the bind of `source` with the same read-only setting is
    /// there already; any other mount is refused.
    fn prepare_target(&self, req: &Publish, source: &Source, read_only: bool) -> Result<Target> {
        let block = source.block;
        match self.os.mount_state(&req.target)? {
            MountState::Mounted(mp) => {
                if source.is_bound_at(&mp) && mp.read_only == read_only {
                    return Ok(Target::Bound);
                }
                return Err(Error::Incompatible {
                    volume: req.volume_id.clone(),
                    what: "published",
                    reason: format!(
                        "{} is already a mount {}",
                        req.target.display(),
                        if source.is_bound_at(&mp) {
                            "with another read-only setting"
                        } else {
                            "of something else"
                        }
                    ),
                });
            }
            MountState::Corrupted { .. } => self.os.unmount(&req.target, true)?,
            MountState::Absent if block => self.os.make_file(&req.target)?,
            // The bind opens the target by its name in the parent resolved here: the dir this
            // call made (see `Held`), not resolved again.
            MountState::Absent => {
                let parent = self.os.make_dir_held(&req.target)?;
                return Ok(Target::Ready {
                    parent: Some(parent),
                });
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
        Ok(Target::Ready { parent: None })
    }

    /// Binds `source` on the target, journaled before and after; a failed bind removes the
    /// target and its record.
    fn bind_target(
        &self,
        record: &mut VolumeRecord,
        req: &Publish,
        source: &Source,
        parent: Option<&Held>,
        wanted: PublishRecord,
    ) -> Result<()> {
        record.publishes.insert(
            req.target.clone(),
            PublishRecord {
                phase: Phase::InProgress,
                ..wanted.clone()
            },
        );
        self.journal.put(record, Durability::Process)?;
        crash_points::point("publish.binding");
        let bind = BindMount {
            source: source.path.clone(),
            target: req.target.clone(),
            attrs: wanted.attrs,
        };
        if let Err(e) = self.os.bind_held(&bind, source.held.as_ref(), parent) {
            record.publishes.remove(&req.target);
            let mut first = Error::from(e);
            if let Err(r) = self.os.remove(&req.target) {
                first = first.with_cleanup_failure(&req.volume_id, "removing the target's dir", &r);
            }
            if let Err(j) = self.journal.put(record, Durability::Process) {
                first =
                    first.with_cleanup_failure(&req.volume_id, "dropping the publish record", &j);
            }
            return Err(first);
        }
        crash_points::point("publish.bound");
        record.publishes.insert(req.target.clone(), wanted);
        self.journal.put(record, Durability::Process)?;
        crash_points::point("publish.done");
        Ok(())
    }

    /// NodeUnpublishVolume.
    pub fn unpublish(&self, req: &Unpublish) -> Result<()> {
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
        // The target's parent, resolved once: every check, the unmounts and the removal look
        // the target's name up in that one directory (see `Held`), so a directory renamed into
        // the path meanwhile is neither unmounted nor removed. None: nothing is there.
        let parent = self.os.hold_parent(&req.target)?.map(Arc::new);
        self.unmount_all_in(&req.target, parent.as_ref(), |_| true, None)?;
        crash_points::point("unpublish.unmounted");
        if let Some(parent) = &parent {
            self.os.remove_held(&req.target, Some(parent))?;
        }
        crash_points::point("unpublish.removed");
        self.remove_qos(req, record.stage.as_ref().map(|s| s.rdev));
        if known {
            record.publishes.remove(&req.target);
            self.journal.put(&record, Durability::Process)?;
        }
        crash_points::point("unpublish.done");
        Ok(())
    }
}
