//! NodeStageVolume and NodeUnstageVolume.

use std::path::Path;
use std::time::{Duration, Instant};

use moor_proto::csi::v1::volume_capability::access_mode::Mode;
use tracing::{info, warn};

use super::{ADOPTED_MODE, Engine};
use crate::crash_points;
use crate::error::{Error, Result};
use crate::filesystem::{self, FSCK_CORRECTED, FSCK_CORRECTED_REBOOT, FSCK_UNCORRECTED, Fsck};
use crate::journal::{AccessRecord, Durability, Phase, StageRecord, VolumeRecord};
use crate::mount_options::Filesystem;
use crate::superblock::Content;
use crate::sys::{self, FsMount, HeldDevice, MountAttrs, MountState, Os, ToolError};
use crate::validate::{self, Access, Capability};
use crate::{fsgroup, selinux};

/// Timings of the slow steps, for metrics and logs.
#[derive(Debug, Clone, Copy, Default)]
pub struct StageReport {
    /// Whether the device was formatted.
    pub formatted: bool,
    /// How long mkfs took.
    pub mkfs: Option<Duration>,
    /// How long the mount took.
    pub mount: Option<Duration>,
    /// Whether the filesystem was grown to its device's size (a volume restored or cloned
    /// into a larger one, or grown on the controller while it was not staged).
    pub grown: bool,
}

/// A filesystem at least this much smaller than its device is grown when it is staged. Less is
/// what a tool leaves by design (resize2fs drops a last block group too small to hold its own
/// metadata), and growing would change nothing.
pub const GROW_MIN: u64 = 16 << 20;

fn access_record(access: &Access) -> AccessRecord {
    match access {
        Access::Mount { fs, options, group } => AccessRecord::Mount {
            fs_type: fs.name().to_string(),
            fs_options: options.fs_options.clone(),
            group: *group,
        },
        Access::Block { .. } => AccessRecord::Block,
    }
}

impl<O: Os> Engine<O> {
    /// Makes a filesystem `fs` with UUID `uuid` on `device` (a held device's handle). `force`
    /// only for a device moor itself was formatting when it was interrupted.
    fn mkfs(&self, fs: Filesystem, device: &Path, uuid: &str, force: bool) -> Result<Duration> {
        let run = filesystem::ops(fs).mkfs(device, uuid, force, self.cfg.mkfs_deadline);
        let start = Instant::now();
        self.os.run_tool(&run)?;
        Ok(start.elapsed())
    }

    /// Checks an existing filesystem before it is mounted read-write, as `fsck -a` before a
    /// mount does in the field, with the filesystem's own check in preen mode (it repairs what
    /// is safe to repair unattended and stops at anything else): e2fsck for ext2/3/4. A
    /// filesystem that is never repaired unattended has no check (xfs replays its log at
    /// mount; btrfs checks itself), so it is not checked here. Exit 0 is clean, 1 and 2
    /// repaired; errors left (bit 4) refuse the mount with the check's words; the check itself
    /// failing (not installed, an operational error) is logged and the mount goes on, as it
    /// would without a check.
    fn check_fs(&self, volume_id: &str, fs: Filesystem, dev: &HeldDevice) -> Result<()> {
        let Some(Fsck { run, by_hand }) =
            filesystem::ops(fs).fsck(&dev.handle, self.cfg.mkfs_deadline)
        else {
            return Ok(());
        };
        let tool = &run.program;
        let count = |outcome| crate::metrics::registry().fsck_outcome(fs.name(), outcome);
        match self.os.run_tool(&run) {
            Ok(()) => {
                count("clean");
                Ok(())
            }
            Err(ToolError::Failed {
                code: Some(code),
                stderr,
                ..
            }) if code & FSCK_UNCORRECTED != 0 => {
                count("refused");
                warn!(volume = volume_id, device = %dev.node.display(), code, output = %stderr,
                    "the filesystem has errors {tool} cannot repair unattended; not mounting it");
                Err(Error::FailedPrecondition(format!(
                    "volume {volume_id:?}: the {} filesystem on {} has errors that {tool} \
                     cannot repair unattended (exit {code}): {stderr}; repair it by hand \
                     ({by_hand}) before the volume can be staged",
                    fs.name(),
                    dev.node.display()
                )))
            }
            Err(ToolError::Failed {
                code: Some(code @ (FSCK_CORRECTED | FSCK_CORRECTED_REBOOT)),
                stderr,
                ..
            }) => {
                count("corrected");
                info!(volume = volume_id, device = %dev.node.display(), code, output = %stderr,
                    "{tool} repaired the filesystem before mounting it");
                Ok(())
            }
            Err(e @ ToolError::Timeout { .. }) => {
                count("failed");
                Err(e.into())
            }
            Err(e) => {
                count("failed");
                warn!(volume = volume_id, device = %dev.node.display(), error = %e,
                    "could not check the filesystem; mounting it unchecked");
                Ok(())
            }
        }
    }

    /// NodeStageVolume.
    pub fn stage(&self, req: &validate::Stage) -> Result<StageReport> {
        let _guard = self.locks.try_lock(&req.volume_id)?;
        selinux::require_support(&*self.os, &req.cap.access)?;
        let mut record = self.record(&req.volume_id);
        let mut report = StageReport::default();
        let access = access_record(&req.cap.access);
        let attrs = self.stage_attrs(&req.cap);

        if let Some(st) = &record.stage {
            if st.path != req.staging {
                return Err(Error::FailedPrecondition(format!(
                    "volume {:?} is already staged at {}",
                    req.volume_id,
                    st.path.display()
                )));
            }
            if st.access_mode != ADOPTED_MODE
                && (st.access != access
                    || st.attrs != attrs
                    || st.access_mode != req.cap.mode as i32)
            {
                return Err(Error::Incompatible {
                    volume: req.volume_id.clone(),
                    what: "staged",
                    reason: "the volume capability differs from the one it was staged with".into(),
                });
            }
        } else if self.cfg.max_volumes > 0 && self.journal.staged_count() >= self.cfg.max_volumes {
            return Err(Error::TooManyVolumes(self.cfg.max_volumes));
        }

        let (device_path, dev) = self.resolve_device(req)?;
        if let Some(st) = &record.stage
            && st.rdev != dev.rdev
            && st.phase == Phase::Done
        {
            return Err(Error::FailedPrecondition(format!(
                "volume {:?} was staged from device {}:{}, but {} is now {}:{}",
                req.volume_id,
                st.rdev.0,
                st.rdev.1,
                device_path.display(),
                dev.rdev.0,
                dev.rdev.1
            )));
        }
        // moor's own mkfs that a crash cut short, on this very device: an identity the request
        // carries proves it (resolve_device checked it); without one, only the same device
        // number does, and a number alone cannot tell a reused loop device from this one.
        let interrupted = record
            .stage
            .clone()
            .filter(|s| s.phase == Phase::Formatting);
        if let Some(st) = &interrupted
            && req.identity.is_empty()
            && st.rdev != dev.rdev
        {
            return Err(Error::FailedPrecondition(format!(
                "volume {:?}: moor was formatting device {}:{} ({}) when it was interrupted, \
                 but {} is now {}:{}; refusing to use it",
                req.volume_id,
                st.rdev.0,
                st.rdev.1,
                st.device.display(),
                device_path.display(),
                dev.rdev.0,
                dev.rdev.1
            )));
        }

        // The staging dir: the CO creates it; tolerate its absence.
        match self.os.mount_state(&req.staging)? {
            MountState::Mounted(mp) => {
                let ours = record
                    .stage
                    .as_ref()
                    .is_some_and(|s| s.phase != Phase::Formatting)
                    && (mp.dev == dev.rdev
                        || matches!(&req.cap.access, Access::Mount { fs, .. }
                            if !filesystem::ops(*fs).mount_shows_device()));
                if ours && !req.cap.access.is_block() {
                    // Already staged (a retry, or a crash after the mount): confirm. A crash
                    // may have come before the filesystem was grown to its device (and the
                    // restart's reconciliation confirmed the mount): grow it now. (A mounted
                    // xfs writes its grown superblock back lazily; the tool then finds
                    // nothing to do.)
                    if !attrs.read_only {
                        let content = self.probe_device(&dev.handle, dev.size)?;
                        report.grown =
                            self.grow_to_device(&content, (&dev.handle, dev.size), &req.staging)?;
                        // ... or before the volume was given to its group.
                        if let Access::Mount {
                            group: Some(gid), ..
                        } = &req.cap.access
                        {
                            fsgroup::apply(self, &req.volume_id, &req.staging, *gid)?;
                        }
                    }
                    let fs_uuid = record.stage.as_ref().and_then(|s| s.fs_uuid.clone());
                    self.confirm_stage(&mut record, req, (&device_path, &dev), fs_uuid)?;
                    return Ok(report);
                }
                return Err(Error::Incompatible {
                    volume: req.volume_id.clone(),
                    what: "staged",
                    reason: format!("something else is mounted on {}", req.staging.display()),
                });
            }
            MountState::Corrupted { .. } => self.os.unmount(&req.staging, true)?,
            MountState::Absent => self.os.make_dir(&req.staging)?,
            MountState::NotMounted { is_dir: false } => {
                return Err(Error::FailedPrecondition(format!(
                    "staging_target_path {} is not a directory",
                    req.staging.display()
                )));
            }
            MountState::NotMounted { is_dir: true } => {}
        }

        let Access::Mount { fs, options, group } = &req.cap.access else {
            // Block: the device is verified; nothing is mounted at stage.
            self.confirm_stage(&mut record, req, (&device_path, &dev), None)?;
            return Ok(report);
        };

        let mut content = self.probe_device(&dev.handle, dev.size)?;
        // Only a blank device is formatted, and a device moor was formatting when a crash cut
        // its mkfs short (its partial work reads as unknown data: mkfs writes the superblock
        // that makes a filesystem whole last). A whole filesystem is never formatted, whatever
        // the journal says: the device, not a journal that may lag it, has the last word.
        let format = match &content {
            c if c.is_blank() => true,
            Content::Unknown { .. } if interrupted.is_some() => {
                if req.identity.is_empty() {
                    return Err(Error::FailedPrecondition(format!(
                        "volume {:?}: moor's mkfs on {} was interrupted, and the request names \
                         the device by path only, which does not prove the unknown data on it \
                         is that mkfs's; refusing to format it (wipe the device by hand if it \
                         is this volume's)",
                        req.volume_id,
                        device_path.display()
                    )));
                }
                true
            }
            _ => false,
        };
        // The recorded UUID stays only while the device shows it.
        let mut fs_uuid = match (&record.stage, &content) {
            (Some(s), Content::Filesystem { uuid: Some(u), .. })
                if s.fs_uuid.as_deref() == Some(u.as_str()) =>
            {
                Some(u.clone())
            }
            _ => None,
        };
        if format {
            // A reader promises not to write; several readers may share the device.
            if attrs.read_only {
                return Err(Error::FailedPrecondition(format!(
                    "volume {:?}: device {} is blank and the volume is staged read-only ({}); \
                     a read-only stage never formats: stage it once read-write to create its \
                     filesystem",
                    req.volume_id,
                    device_path.display(),
                    if req.cap.is_reader_only() {
                        req.cap.mode.as_str_name()
                    } else {
                        "ro mount flag"
                    }
                )));
            }
            // Mounted or claimed anywhere (another mkfs, a mount this node does not know):
            // never formatted.
            self.os.check_unclaimed(&dev).map_err(|e| {
                if e.errno() == Some(libc::EBUSY) {
                    Error::FailedPrecondition(format!(
                        "volume {:?}: device {} is in use (mounted or claimed); refusing to \
                         format it",
                        req.volume_id,
                        device_path.display()
                    ))
                } else {
                    Error::Sys(e)
                }
            })?;
            let uuid = sys::random_uuid().map_err(Error::Sys)?;
            // Durable before mkfs: only this record lets a later call format a device that
            // is no longer blank (mkfs's partial work), and only with this UUID's mkfs
            // unfinished.
            record.stage = Some(StageRecord {
                path: req.staging.clone(),
                device: device_path.clone(),
                rdev: dev.rdev,
                access: access.clone(),
                attrs,
                access_mode: req.cap.mode as i32,
                phase: Phase::Formatting,
                fs_uuid: Some(uuid.clone()),
            });
            self.journal.put(&record, Durability::Power)?;
            crash_points::point("stage.formatting");
            report.mkfs = Some(self.mkfs(*fs, &dev.handle, &uuid, interrupted.is_some())?);
            crash_points::point("stage.formatted");
            report.formatted = true;
            fs_uuid = Some(uuid);
            content = self.probe_device(&dev.handle, dev.size)?;
        }
        match &content {
            Content::Filesystem { fs: found, .. } if filesystem::ops(*fs).mounts(*found) => {}
            other => {
                if record
                    .stage
                    .as_ref()
                    .is_some_and(|s| s.phase == Phase::Formatting)
                {
                    // Not what moor's mkfs should have left: never format it again.
                    let mut r = record.clone();
                    r.stage = None;
                    self.journal.put(&r, Durability::Power)?;
                }
                return Err(Error::DeviceNotBlank {
                    device: device_path.display().to_string(),
                    content: other.describe(),
                    fs_type: fs.name().to_string(),
                });
            }
        }
        if !report.formatted && !attrs.read_only {
            self.check_fs(&req.volume_id, *fs, &dev)?;
        }

        record.stage = Some(StageRecord {
            path: req.staging.clone(),
            device: device_path.clone(),
            rdev: dev.rdev,
            access: access.clone(),
            attrs,
            access_mode: req.cap.mode as i32,
            phase: Phase::InProgress,
            fs_uuid: fs_uuid.clone(),
        });
        // After a mkfs, durable before the first mount: from the mount on the device holds
        // data, and the record that let mkfs run must never be the newest one a power cut
        // leaves.
        let durability = if report.formatted {
            Durability::Power
        } else {
            Durability::Process
        };
        self.journal.put(&record, durability)?;
        crash_points::point("stage.mounting");
        let start = Instant::now();
        let mounted = self.os.mount_fs(&FsMount {
            device: dev.node.clone(),
            target: req.staging.clone(),
            fs_type: fs.name().to_string(),
            attrs,
            options: options.fs_options.clone(),
            sb_read_only: req.cap.mode == Mode::MultiNodeReaderOnly,
        });
        if let Err(e) = mounted {
            record.stage = None;
            self.journal.put(&record, Durability::Process)?;
            return Err(e.into());
        }
        report.mount = Some(start.elapsed());
        crash_points::point("stage.mounted");
        let after = (|| -> Result<bool> {
            match self.os.mount_state(&req.staging)? {
                // A filesystem whose mounts have a device number of their own (btrfs gives its
                // mounts an anonymous one): nothing to compare.
                MountState::Mounted(mp)
                    if mp.dev == dev.rdev || !filesystem::ops(*fs).mount_shows_device() => {}
                other => {
                    return Err(Error::FailedPrecondition(format!(
                        "{} is not a mount of device {}:{} after mounting it: {other:?}",
                        req.staging.display(),
                        dev.rdev.0,
                        dev.rdev.1
                    )));
                }
            }
            if let Some(gid) = group
                && !attrs.read_only
            {
                fsgroup::apply(self, &req.volume_id, &req.staging, *gid)?;
            }
            if attrs.read_only {
                return Ok(false);
            }
            self.grow_to_device(&content, (&dev.handle, dev.size), &req.staging)
        })();
        match after {
            Ok(grown) => {
                report.grown = grown;
                self.confirm_stage(&mut record, req, (&device_path, &dev), fs_uuid)?;
                crash_points::point("stage.done");
                Ok(report)
            }
            Err(e) => {
                // Leave nothing half-done.
                let _ = self.os.unmount(&req.staging, false);
                record.stage = None;
                self.journal.put(&record, Durability::Process)?;
                Err(e)
            }
        }
    }

    fn stage_attrs(&self, cap: &Capability) -> MountAttrs {
        let mut attrs = cap.access.attrs();
        if cap.is_reader_only() {
            attrs.read_only = true;
        }
        attrs
    }

    fn confirm_stage(
        &self,
        record: &mut VolumeRecord,
        req: &validate::Stage,
        (device_path, dev): (&Path, &HeldDevice),
        fs_uuid: Option<String>,
    ) -> Result<()> {
        record.stage = Some(StageRecord {
            path: req.staging.clone(),
            device: device_path.to_path_buf(),
            rdev: dev.rdev,
            access: access_record(&req.cap.access),
            attrs: self.stage_attrs(&req.cap),
            access_mode: req.cap.mode as i32,
            phase: Phase::Done,
            fs_uuid,
        });
        self.journal.put(record, Durability::Process)?;
        Ok(())
    }

    /// NodeUnstageVolume.
    pub fn unstage(&self, req: &validate::Unstage) -> Result<()> {
        let _guard = self.locks.try_lock(&req.volume_id)?;
        let mut record = self.record(&req.volume_id);
        // Not staged at that path: the spec's answer is OK, and nothing is touched. A path
        // another volume holds is that volume's, whatever the CO names.
        let elsewhere = match &record.stage {
            Some(st) => st.path != req.staging,
            None => self.held_by_another(&req.volume_id, &req.staging),
        };
        if elsewhere {
            warn!(
                volume = req.volume_id,
                path = %req.staging.display(),
                "unstage of a path the volume is not staged at: nothing to do"
            );
            return Ok(());
        }
        // Refuse while a publication is really there; forget the ones that are gone.
        let mut still = Vec::new();
        for target in record.publishes.keys() {
            match self.os.mount_state(target)? {
                MountState::Mounted(_) | MountState::Corrupted { .. } => still.push(target.clone()),
                MountState::Absent | MountState::NotMounted { .. } => {}
            }
        }
        if !still.is_empty() {
            return Err(Error::FailedPrecondition(format!(
                "volume {:?} is still published at {}; unpublish it first",
                req.volume_id,
                still
                    .iter()
                    .map(|p| p.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        }
        record.publishes.clear();
        if let Some(st) = record.stage.as_mut() {
            st.phase = Phase::InProgress;
            self.journal.put(&record, Durability::Process)?;
        }
        crash_points::point("unstage.unmounting");
        let staged_dev = record.stage.as_ref().map(|s| s.rdev);
        let is_block = matches!(
            record.stage.as_ref().map(|s| &s.access),
            Some(AccessRecord::Block)
        );
        if !is_block {
            // Without a record the CO's word stands: its staging path for this volume.
            self.unmount_all(&req.staging, |mp| {
                staged_dev.is_none_or(|d| mp.dev == d || mp.rdev.is_none())
            })?;
        }
        crash_points::point("unstage.unmounted");
        record.stage = None;
        self.journal.put(&record, Durability::Process)?;
        crash_points::point("unstage.done");
        Ok(())
    }

    /// Grows the filesystem `content` found on `device` (of `device_size` bytes), mounted at
    /// `mount_point`, when its superblock gives it [`GROW_MIN`] or more less than the device:
    /// the spec has a volume made from a smaller snapshot or volume present its full size.
    /// Whether it grew it.
    fn grow_to_device(
        &self,
        content: &Content,
        (device, device_size): (&Path, u64),
        mount_point: &Path,
    ) -> Result<bool> {
        let Content::Filesystem {
            fs,
            size: Some(size),
            ..
        } = content
        else {
            return Ok(false);
        };
        if device_size < size.saturating_add(GROW_MIN) {
            return Ok(false);
        }
        crash_points::point("stage.growing");
        self.grow_fs(*fs, device, mount_point)?;
        Ok(true)
    }
}
