//! NodeGetVolumeStats: usage and condition of a volume at a path.

use std::path::Path;

use super::{Engine, Stats};
use crate::error::{Error, Result};
use crate::journal::{AccessRecord, StageRecord, VolumeRecord};
use crate::sys::{FsUsage, MountPoint, MountState, Os, Presence, is_corruption_errno};

/// The health of a volume at a path, for NodeGetVolumeStats.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Condition {
    /// Whether something is wrong.
    pub abnormal: bool,
    /// What.
    pub message: String,
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
                Condition {
                    abnormal: true,
                    message: why,
                },
            ));
        }
        Ok((stats, condition))
    }

    /// The usage and condition of the volume at `path`, as this node sees them.
    fn local_stats(&self, req: &Stats) -> Result<(VolumeStats, Condition)> {
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
        let abnormal = |message: String| {
            Ok((
                VolumeStats::Unavailable,
                Condition {
                    abnormal: true,
                    message,
                },
            ))
        };
        let is_block = matches!(stage.map(|s| &s.access), Some(AccessRecord::Block));
        let state = self.os.mount_state(&req.path)?;
        // Block volumes are staged without a mount: the staging dir itself is the volume's.
        if is_block && stage.is_some_and(|s| s.path == req.path) {
            return self.block_stats(stage, None);
        }
        match state {
            MountState::Absent if known => abnormal(format!("{} is missing", req.path.display())),
            MountState::NotMounted { .. } if known => {
                abnormal(format!("{} is not mounted", req.path.display()))
            }
            MountState::Absent | MountState::NotMounted { .. } => Err(not_found()),
            MountState::Corrupted { errno } => abnormal(format!(
                "the mount at {} is corrupted: {}",
                req.path.display(),
                std::io::Error::from_raw_os_error(errno)
            )),
            MountState::Mounted(mp) if mp.rdev.is_some() || is_block => {
                self.block_stats(stage, mp.rdev)
            }
            MountState::Mounted(mp) => {
                let usage = match self.os.fs_usage(&req.path) {
                    Ok(u) => u,
                    Err(e) if e.errno().is_some_and(is_corruption_errno) => {
                        return abnormal(format!(
                            "the filesystem at {} fails: {e}",
                            req.path.display()
                        ));
                    }
                    Err(e) => return Err(e.into()),
                };
                let condition = match stage.map(|s| (s, self.presence(s))) {
                    Some((s, Presence::Gone(why))) => Condition {
                        abnormal: true,
                        message: format!("device {} is gone: {why}", s.device.display()),
                    },
                    Some((s, Presence::Unknown(why))) => Condition {
                        abnormal: true,
                        message: format!(
                            "device {} cannot be checked right now: {why}",
                            s.device.display()
                        ),
                    },
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
        let failing = |message: String| Condition {
            abnormal: true,
            message,
        };
        if mp.read_only && attrs.is_some_and(|a| !a.read_only) {
            return failing(format!(
                "the filesystem at {} was mounted read-write and is read-only now: the kernel \
                 stopped writing to it after errors",
                path.display()
            ));
        }
        match self.os.fs_errors(mp.dev) {
            Ok(Some(n)) if n > 0 => failing(format!(
                "the filesystem at {} has recorded {n} error(s) since its last check; the next \
                 stage checks it",
                path.display()
            )),
            Ok(_) => Condition {
                abnormal: false,
                message: "volume is mounted and healthy".into(),
            },
            Err(e) => failing(format!(
                "the errors of the filesystem at {} cannot be read: {e}",
                path.display()
            )),
        }
    }

    fn block_stats(
        &self,
        stage: Option<&StageRecord>,
        mounted_rdev: Option<(u32, u32)>,
    ) -> Result<(VolumeStats, Condition)> {
        let Some(s) = stage else {
            return Ok((
                VolumeStats::Unavailable,
                Condition {
                    abnormal: true,
                    message: "block volume without a staging record".into(),
                },
            ));
        };
        let unavailable = |message: String| {
            Ok((
                VolumeStats::Unavailable,
                Condition {
                    abnormal: true,
                    message,
                },
            ))
        };
        match self.presence(s) {
            Presence::Present(d) if mounted_rdev.is_none_or(|r| r == d.rdev) => Ok((
                VolumeStats::Block(d.size),
                Condition {
                    abnormal: false,
                    message: "block device is present".into(),
                },
            )),
            Presence::Present(_) => unavailable(format!(
                "the device mounted for {} is not {} any more",
                s.path.display(),
                s.device.display()
            )),
            Presence::Gone(why) => {
                unavailable(format!("device {} is gone: {why}", s.device.display()))
            }
            Presence::Unknown(why) => unavailable(format!(
                "device {} cannot be checked right now: {why}",
                s.device.display()
            )),
        }
    }
}
