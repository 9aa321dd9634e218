//! NodeGetVolumeStats: usage and condition of a volume at a path.

use std::path::Path;

use super::{Engine, Stats};
use crate::error::{Error, Result};
use crate::journal::{AccessRecord, StageRecord, VolumeRecord};
use crate::sys::{FsUsage, MountPoint, MountState, Os, Presence, is_corruption_errno};

/// The health of a volume at a path, for NodeGetVolumeStats (its `VolumeCondition`) and
/// NodeGetVolumeHealth (an entry of its `VolumeHealth`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Condition {
    /// Whether something is wrong.
    pub abnormal: bool,
    /// What.
    pub message: String,
    /// What kind of trouble, in CSI 1.13's words (`Healthy` when nothing is wrong).
    pub health: Health,
    /// A short CamelCase name of the trouble, the same for the same trouble.
    pub reason: &'static str,
}

/// The kinds of trouble CSI 1.13's `VolumeHealthErrorType` names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Health {
    /// Nothing is wrong.
    Healthy,
    /// The volume cannot be reached from this node (its device or mount is gone).
    Inaccessible,
    /// Its data is lost or strongly suspected to be (a corrupted filesystem).
    DataLoss,
    /// It works, but not as it should (read-only after errors, a device that cannot be
    /// checked now).
    Degraded,
}

impl Condition {
    /// A healthy volume, saying so.
    pub fn healthy(message: impl Into<String>) -> Self {
        Self {
            abnormal: false,
            message: message.into(),
            health: Health::Healthy,
            reason: "",
        }
    }

    /// Trouble of kind `health`, named `reason`.
    pub fn trouble(health: Health, reason: &'static str, message: impl Into<String>) -> Self {
        Self {
            abnormal: true,
            message: message.into(),
            health,
            reason,
        }
    }
}

/// What NodeGetVolumeStats reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VolumeStats {
    /// A mounted filesystem.
    Filesystem(FsUsage),
    /// A block device of this many bytes.
    Block(u64),
    /// Nothing to measure (the condition says why).
    Unavailable,
}

impl<O: Os> Engine<O> {
    /// NodeGetVolumeStats: usage and condition of the volume at `path`. A volume healthy on
    /// this node whose RBD cluster does not answer is abnormal, saying so.
    pub fn stats(&self, req: &Stats) -> Result<(VolumeStats, Condition)> {
        let (stats, condition) = self.local_stats(req)?;
        if !condition.abnormal
            && let Some(why) = self.cluster_away(self.journal.get(&req.volume_id).as_ref())
        {
            return Ok((
                stats,
                Condition::trouble(Health::Inaccessible, "StorageUnreachable", why),
            ));
        }
        Ok((stats, condition))
    }

    /// The usage and condition of the volume at `path`, as this node sees them.
    pub(super) fn local_stats(&self, req: &Stats) -> Result<(VolumeStats, Condition)> {
        // What a reboot ended is not the volume's, whatever the journal remembers of it.
        let record = self.journal.get(&req.volume_id).map(|r| self.claims(r));
        let stage = record.as_ref().and_then(|r| r.stage.as_ref());
        let known = record.as_ref().is_some_and(|r| {
            r.publishes.contains_key(&req.path)
                || r.stage.as_ref().is_some_and(|s| s.path == req.path)
        });
        let not_found = || Error::VolumeNotFound {
            volume: req.volume_id.clone(),
            reason: format!("it is not staged or published at {}", req.path.display()),
        };
        if !known && self.held_by_another(&req.volume_id, &req.path) {
            return Err(not_found());
        }
        let abnormal = |health, reason, message: String| {
            Ok((
                VolumeStats::Unavailable,
                Condition::trouble(health, reason, message),
            ))
        };
        let is_block = matches!(stage.map(|s| &s.access), Some(AccessRecord::Block));
        let state = self.os.mount_state(&req.path)?;
        // Block volumes are staged without a mount: the staging dir itself is the volume's.
        if is_block && stage.is_some_and(|s| s.path == req.path) {
            return self.block_stats(stage, None);
        }
        match state {
            MountState::Absent if known => abnormal(
                Health::Inaccessible,
                "PathMissing",
                format!("{} is missing", req.path.display()),
            ),
            MountState::NotMounted { .. } if known => abnormal(
                Health::Inaccessible,
                "NotMounted",
                format!("{} is not mounted", req.path.display()),
            ),
            MountState::Absent | MountState::NotMounted { .. } => Err(not_found()),
            MountState::Corrupted { errno } => abnormal(
                Health::DataLoss,
                "MountCorrupted",
                format!(
                    "the mount at {} is corrupted: {}",
                    req.path.display(),
                    std::io::Error::from_raw_os_error(errno)
                ),
            ),
            MountState::Mounted(mp) if mp.rdev.is_some() || is_block => {
                self.block_stats(stage, mp.rdev)
            }
            MountState::Mounted(mp) => {
                let usage = match self.os.fs_usage(&req.path) {
                    Ok(u) => u,
                    Err(e) if e.errno().is_some_and(is_corruption_errno) => {
                        return abnormal(
                            Health::DataLoss,
                            "FilesystemFailing",
                            format!("the filesystem at {} fails: {e}", req.path.display()),
                        );
                    }
                    Err(e) => return Err(e.into()),
                };
                let condition = match stage.map(|s| (s, self.presence(s))) {
                    Some((s, Presence::Gone(why))) => Condition::trouble(
                        Health::Inaccessible,
                        "DeviceGone",
                        format!("device {} is gone: {why}", s.device.display()),
                    ),
                    Some((s, Presence::Unknown(why))) => Condition::trouble(
                        Health::Degraded,
                        "DeviceUnchecked",
                        format!(
                            "device {} cannot be checked right now: {why}",
                            s.device.display()
                        ),
                    ),
                    _ => self.fs_condition(record.as_ref(), &req.path, mp),
                };
                Ok((VolumeStats::Filesystem(usage), condition))
            }
        }
    }

    /// The health of the mounted filesystem at `path` whose device is there: a filesystem the
    /// kernel made read-only under a read-write mount (ext4's answer to I/O errors: its journal
    /// aborted, or `errors=remount-ro`), or one with errors recorded since its last check, is
    /// failing until it is checked again (the next stage's fsck). Reads only what the kernel
    /// already knows (statvfs, sysfs): never waits for the device.
    fn fs_condition(
        &self,
        record: Option<&VolumeRecord>,
        path: &Path,
        mp: MountPoint,
    ) -> Condition {
        let attrs = record.and_then(|r| match &r.stage {
            Some(s) if s.path == path => Some(s.attrs),
            _ => r.publishes.get(path).map(|p| p.attrs),
        });
        if mp.read_only && attrs.is_some_and(|a| !a.read_only) {
            return Condition::trouble(
                Health::Degraded,
                "FilesystemReadOnly",
                format!(
                    "the filesystem at {} was mounted read-write and is read-only now: the kernel \
                 stopped writing to it after errors",
                    path.display()
                ),
            );
        }
        match self.os.fs_errors(mp.dev) {
            Ok(Some(n)) if n > 0 => Condition::trouble(
                Health::DataLoss,
                "FilesystemErrors",
                format!(
                    "the filesystem at {} has recorded {n} error(s) since its last check; the \
                     next stage checks it",
                    path.display()
                ),
            ),
            Ok(_) => Condition::healthy("volume is mounted and healthy"),
            Err(e) => Condition::trouble(
                Health::Degraded,
                "FilesystemErrorsUnread",
                format!(
                    "the errors of the filesystem at {} cannot be read: {e}",
                    path.display()
                ),
            ),
        }
    }

    fn block_stats(
        &self,
        stage: Option<&StageRecord>,
        mounted_rdev: Option<(u32, u32)>,
    ) -> Result<(VolumeStats, Condition)> {
        let unavailable = |health, reason, message: String| {
            Ok((
                VolumeStats::Unavailable,
                Condition::trouble(health, reason, message),
            ))
        };
        let Some(s) = stage else {
            return unavailable(
                Health::Inaccessible,
                "NotStaged",
                "block volume without a staging record".into(),
            );
        };
        match self.presence(s) {
            Presence::Present(d) if mounted_rdev.is_none_or(|r| r == d.rdev) => Ok((
                VolumeStats::Block(d.size),
                Condition::healthy("block device is present"),
            )),
            Presence::Present(_) => unavailable(
                Health::Inaccessible,
                "DeviceReplaced",
                format!(
                    "the device mounted for {} is not {} any more",
                    s.path.display(),
                    s.device.display()
                ),
            ),
            Presence::Gone(why) => unavailable(
                Health::Inaccessible,
                "DeviceGone",
                format!("device {} is gone: {why}", s.device.display()),
            ),
            Presence::Unknown(why) => unavailable(
                Health::Degraded,
                "DeviceUnchecked",
                format!(
                    "device {} cannot be checked right now: {why}",
                    s.device.display()
                ),
            ),
        }
    }
}
