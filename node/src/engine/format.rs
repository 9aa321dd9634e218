//! The filesystem of a stage: whether the device is formatted, the mkfs, what is found on the
//! device afterwards, and the check of an existing filesystem before a read-write mount.

use std::path::Path;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use moor_runtime::contract::Filesystem;
use tracing::{debug, info, warn};

use super::stage::Staging;
use super::{Engine, StageReport};
use crate::crash_points;
use crate::error::{Error, Result};
use crate::filesystem::{self, FSCK_CORRECTED, FSCK_CORRECTED_REBOOT, FSCK_UNCORRECTED, Fsck};
use crate::journal::{Durability, Phase, VolumeRecord};
use crate::superblock::Content;
use crate::superblock::ext_clean::{self, Verdict};
use crate::sys::{self, AlignedBuf, HeldDevice, Os, ToolError};

impl Staging<'_> {
    /// Whether the device is formatted. Only a blank device is, and a device moor was
    /// formatting when a crash cut its mkfs short (`interrupted`; its partial work reads as
    /// unknown data: mkfs writes the superblock that makes a filesystem whole last). A whole
    /// filesystem is never formatted, whatever the journal says: the device, not a journal
    /// that may lag it, has the last word.
    pub(super) fn must_format(&self, content: &Content, interrupted: bool) -> Result<bool> {
        match content {
            c if c.is_blank() => Ok(true),
            // moor's fresh LUKS volume (its UUID recorded durably before luksFormat).
            Content::Unknown { .. } if self.fresh_luks => Ok(true),
            Content::Unknown { .. } if interrupted => {
                if self.req.identity.is_empty() {
                    return Err(Error::FailedPrecondition(format!(
                        "volume {:?}: moor's mkfs on {} was interrupted, and the request names \
                         the device by path only, which does not prove the unknown data on it \
                         is that mkfs's; refusing to format it (wipe the device by hand if it \
                         is this volume's)",
                        self.req.volume_id,
                        self.path.display()
                    )));
                }
                Ok(true)
            }
            _ => Ok(false),
        }
    }
}

impl<O: Os> Engine<O> {
    /// Formats the held device with `fs` under a fresh UUID, with the intent durable first.
    /// `interrupted`: moor's own mkfs was cut short on it, and this one overwrites its partial
    /// work. The UUID and how long mkfs took.
    pub(super) fn format(
        &self,
        record: &mut VolumeRecord,
        st: &Staging<'_>,
        fs: Filesystem,
        interrupted: bool,
    ) -> Result<(String, Duration)> {
        let req = st.req;
        // A reader promises not to write; several readers may share the device.
        if st.attrs.read_only {
            return Err(Error::FailedPrecondition(format!(
                "volume {:?}: device {} is blank and the volume is staged read-only ({}); \
                 a read-only stage never formats: stage it once read-write to create its \
                 filesystem",
                req.volume_id,
                st.path.display(),
                if req.cap.is_reader_only() {
                    req.cap.mode.as_str_name()
                } else {
                    "ro mount flag"
                }
            )));
        }
        // Mounted or claimed anywhere (another mkfs, a mount this node does not know):
        // never formatted.
        self.os.check_unclaimed(&st.dev).map_err(|e| {
            if e.errno() == Some(libc::EBUSY) {
                Error::FailedPrecondition(format!(
                    "volume {:?}: device {} is in use (mounted or claimed); refusing to \
                     format it",
                    req.volume_id,
                    st.path.display()
                ))
            } else {
                Error::Sys(e)
            }
        })?;
        let uuid = sys::random_uuid().map_err(Error::Sys)?;
        // Durable before mkfs: only this record lets a later call format a device that
        // is no longer blank (mkfs's partial work), and only with this UUID's mkfs
        // unfinished.
        record.stage = Some(st.record(Phase::Formatting, Some(uuid.clone())));
        self.journal.put(record, Durability::Power)?;
        crash_points::point("stage.formatting");
        let took = self.mkfs(fs, &st.dev.handle, &uuid, interrupted)?;
        crash_points::point("stage.formatted");
        Ok((uuid, took))
    }

    /// What is on the device must be `fs`, or a filesystem its driver mounts as `fs`; anything
    /// else is refused, and never mounted.
    pub(super) fn check_found(
        &self,
        record: &VolumeRecord,
        content: &Content,
        fs: Filesystem,
        device_path: &Path,
    ) -> Result<()> {
        match content {
            Content::Filesystem { fs: found, .. } if filesystem::ops(fs).mounts(*found) => Ok(()),
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
                Err(Error::DeviceNotBlank {
                    device: device_path.display().to_string(),
                    content: other.describe(),
                    fs_type: fs.name().to_string(),
                })
            }
        }
    }

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
    /// An ext filesystem whose metadata (`ext_head`: the first bytes the probe read, and what
    /// lies past them read here) shows that `e2fsck -p` would pass it as clean without checking
    /// it is not checked: the answer is e2fsck's, without its exec (see
    /// [`superblock::ext_clean`]).
    /// The check's outcome goes into `report`, also when it refuses the mount.
    pub(super) fn check_fs(
        &self,
        volume_id: &str,
        fs: Filesystem,
        dev: &HeldDevice,
        ext_head: Option<&[u8]>,
        report: &mut StageReport,
    ) -> Result<()> {
        let Some(Fsck { run, by_hand }) =
            filesystem::ops(fs).fsck(&dev.handle, self.cfg.mkfs_deadline)
        else {
            return Ok(());
        };
        // A filesystem mounted anywhere (a pod of another volume on the same device, a mount
        // this node does not know) is never checked: a check of a mounted filesystem is how
        // it gets corrupted (linstor-csi #385). It is in use, so it is not checked now.
        if let Err(e) = self.os.check_unclaimed(dev) {
            if e.errno() != Some(libc::EBUSY) {
                return Err(Error::Sys(e));
            }
            info!(volume = volume_id, device = %dev.node.display(),
                "the device is in use (mounted or claimed); its filesystem is not checked");
            return Ok(());
        }
        if let Some(head) = ext_head.filter(|_| !self.cfg.e2fsck_always) {
            match self.ext_verdict(&dev.handle, head) {
                Verdict::Clean => {
                    report.fsck = Some((fs, FsckOutcome::Skipped));
                    return Ok(());
                }
                Verdict::Check(why) => {
                    debug!(volume = volume_id, device = %dev.node.display(), reason = why,
                        "checking the filesystem");
                }
            }
        }
        let tool = &run.program;
        let mut count = |outcome| report.fsck = Some((fs, outcome));
        match self.os.run_tool(&run) {
            Ok(()) => {
                count(FsckOutcome::Clean);
                Ok(())
            }
            Err(ToolError::Failed {
                code: Some(code),
                stderr,
                ..
            }) if code & FSCK_UNCORRECTED != 0 => {
                count(FsckOutcome::Refused);
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
                count(FsckOutcome::Corrected);
                info!(volume = volume_id, device = %dev.node.display(), code, output = %stderr,
                    "{tool} repaired the filesystem before mounting it");
                Ok(())
            }
            Err(e @ ToolError::Timeout { .. }) => {
                count(FsckOutcome::Failed);
                Err(e.into())
            }
            Err(e) => {
                count(FsckOutcome::Failed);
                warn!(volume = volume_id, device = %dev.node.display(), error = %e,
                    "could not check the filesystem; mounting it unchecked");
                Ok(())
            }
        }
    }
}

impl<O: Os> Engine<O> {
    /// Whether a stage would leave e2fsck out for the filesystem on `device` (`size` bytes):
    /// the superblock probe and the decision from its bytes, as a stage makes them.
    pub fn e2fsck_would_skip(&self, device: &Path, size: u64) -> bool {
        let mut head = None;
        self.probe_device_keeping(device, size, &mut head).is_ok()
            && head.is_some_and(|h| self.ext_verdict(device, &h) == Verdict::Clean)
    }

    /// Whether `e2fsck -p` would pass the ext filesystem on `device` as clean without
    /// checking it, from `head` (its first bytes, already read) and the few blocks of
    /// metadata past them (the journal's inode and superblock, the first backup superblock),
    /// read here with O_DIRECT as the probe reads.
    fn ext_verdict(&self, device: &Path, head: &[u8]) -> Verdict {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX));
        let align = sys::DIRECT_ALIGN as u64;
        let mut read = |offset: u64, len: usize| -> Option<Vec<u8>> {
            let start = offset - offset % align;
            let end = offset.checked_add(len as u64)?.div_ceil(align) * align;
            let mut buf = AlignedBuf::zeroed(usize::try_from(end - start).ok()?);
            let got = self
                .os
                .read_device(device, start, buf.as_mut_slice())
                .ok()?;
            let from = usize::try_from(offset - start).ok()?;
            buf.as_slice()
                .get(from..got.min(from + len))
                .filter(|b| b.len() == len)
                .map(<[u8]>::to_vec)
        };
        ext_clean::e2fsck_would_skip(head, now, &mut read)
    }
}

/// How a filesystem check before a read-write mount ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FsckOutcome {
    /// Not run: its metadata shows e2fsck would pass the filesystem as clean without
    /// checking it.
    Skipped,
    /// Nothing to repair.
    Clean,
    /// Repaired unattended.
    Corrected,
    /// Errors left that need a person: the mount was refused.
    Refused,
    /// The check itself did not run through.
    Failed,
}

impl FsckOutcome {
    /// The outcome's metric label.
    pub fn name(self) -> &'static str {
        match self {
            Self::Skipped => "skipped",
            Self::Clean => "clean",
            Self::Corrected => "corrected",
            Self::Refused => "refused",
            Self::Failed => "failed",
        }
    }
}
