//! The volume's device: found by identity and held for NodeStageVolume, opened for the other
//! operations, read for what is on it, and checked for presence.

use std::path::{Path, PathBuf};

use moor_runtime::contract::Filesystem;
use std::time::Duration;

use super::{Engine, Stage};
use crate::error::{Error, Result};
use crate::journal::StageRecord;
use crate::superblock::{self, Content};
use crate::sys::discovery::{DiscoveryError, Verdict};
use crate::sys::{self, BlockDevice, HeldDevice, Os, Presence, SysError, is_gone_errno};

fn sys_not_found(e: &SysError) -> bool {
    e.errno().is_some_and(is_gone_errno)
}

/// The error of a failed open of a volume's device: gone is NOT_FOUND, not a block device is
/// FAILED_PRECONDITION, anything else the OS's error.
fn device_error(volume_id: &str, device: &Path, e: SysError) -> Error {
    if sys_not_found(&e) {
        Error::VolumeNotFound {
            volume: volume_id.to_string(),
            reason: format!("device {} is not present on this node", device.display()),
        }
    } else if e.errno() == Some(libc::ENOTBLK) {
        Error::FailedPrecondition(format!("{} is not a block device", device.display()))
    } else {
        Error::Sys(e)
    }
}

impl<O: Os> Engine<O> {
    pub(super) fn open_device(&self, volume_id: &str, device: &Path) -> Result<BlockDevice> {
        self.os
            .block_device(device)
            .map_err(|e| device_error(volume_id, device, e))
    }

    fn hold_device(&self, volume_id: &str, device: &Path) -> Result<HeldDevice> {
        self.os
            .hold_device(device)
            .map_err(|e| device_error(volume_id, device, e))
    }

    /// Finds the volume's device for NodeStageVolume and checks its identity before use.
    ///
    /// devicePath is a hint, taken only when the device there is the volume's; otherwise the
    /// device is searched for by identity, waiting for it to appear up to the discovery
    /// deadline. A hint that is another volume's device (a reused loop number, a stale link)
    /// is refused unless the volume's own device is attached elsewhere right now.
    pub(super) fn resolve_device(&self, req: &Stage) -> Result<(PathBuf, HeldDevice)> {
        let want = &req.identity;
        let hint = req.device.as_deref();
        if want.is_empty() {
            // Nothing to check the device against: the path is all the controller gave.
            let path = hint.ok_or_else(|| {
                Error::invalid("publish_context", "names neither a device nor its identity")
            })?;
            return Ok((path.to_path_buf(), self.hold_device(&req.volume_id, path)?));
        }
        let mut conflict = None;
        if let Some(path) = hint {
            match self.os.hold_device(path) {
                Ok(dev) => match self.os.identify(dev.rdev, want) {
                    Verdict::Match => return Ok((path.to_path_buf(), dev)),
                    Verdict::Other(got) => conflict = Some(format!("{} is {got}", path.display())),
                    Verdict::Unknown => {}
                },
                Err(e) if sys_not_found(&e) => {}
                // Not a block device, or the OS refused: report it as opening it does.
                Err(e) => return Err(device_error(&req.volume_id, path, e)),
            }
        }
        // With a conflicting hint, only a device attached now may stand in for it.
        let wait = if conflict.is_some() {
            Duration::ZERO
        } else {
            self.cfg.discovery_deadline
        };
        let found = match (self.os.find_device(want, wait), conflict) {
            (Ok(found), _) => found,
            (Err(DiscoveryError::NotPresent { .. }), Some(conflict)) => {
                return Err(Error::FailedPrecondition(format!(
                    "volume {:?} is the device with {want}, but {conflict}: refusing to use it",
                    req.volume_id
                )));
            }
            (Err(e), _) => return Err(e.into()),
        };
        // Identity before use, on the descriptor that is used from here on: the device may
        // have changed since it was seen, and cannot change while it is held.
        let dev = self.hold_device(&req.volume_id, &found.path)?;
        match self.os.identify(dev.rdev, want) {
            Verdict::Match => Ok((found.path, dev)),
            Verdict::Other(got) => Err(Error::FailedPrecondition(format!(
                "volume {:?} is the device with {want}, but {} is now {got}: refusing to use it",
                req.volume_id,
                found.path.display()
            ))),
            Verdict::Unknown => Err(Error::FailedPrecondition(format!(
                "volume {:?}: {} lost its identity ({want}) while being opened",
                req.volume_id,
                found.path.display()
            ))),
        }
    }

    /// Reads the device's superblock regions and says what is on it.
    ///
    /// The windows are read into page-aligned buffers, so the OS layer can read them with
    /// O_DIRECT: no copy through the device's page cache, which the mount would throw away.
    pub fn probe_device(&self, device: &Path, size: u64) -> Result<Content> {
        self.probe_device_keeping(device, size, &mut None)
    }

    /// [`probe_device`](Self::probe_device), and when it finds an ext filesystem, the first
    /// bytes it read (its superblock and group descriptors) in `ext_head`, for the check that
    /// decides from them whether e2fsck need run.
    pub(super) fn probe_device_keeping(
        &self,
        device: &Path,
        size: u64,
        ext_head: &mut Option<Vec<u8>>,
    ) -> Result<Content> {
        let head_len = (superblock::HEAD_LEN as u64).min(size) as usize;
        let quick_len = superblock::QUICK_LEN.min(head_len);
        let tail_len = (superblock::TAIL_LEN as u64).min(size) as usize;
        // One buffer holds both windows: the head in its first HEAD_LEN bytes, the tail after.
        // Only the bytes a read filled are looked at (a reused buffer holds an older device's).
        let mut buf = self.probe_bufs.take();
        let (head, tail) = buf
            .as_mut_slice()
            .split_at_mut_checked(superblock::HEAD_LEN)
            .unwrap_or_default();
        let head = head.get_mut(..head_len).unwrap_or_default();
        // A formatted device (every stage after the first) is known from its first bytes.
        let n = self
            .os
            .read_device(device, 0, head.get_mut(..quick_len).unwrap_or_default())?;
        if let Some(found) = superblock::probe_quick(head.get(..n).unwrap_or_default()) {
            if let Content::Filesystem {
                fs: Filesystem::Ext2 | Filesystem::Ext3 | Filesystem::Ext4,
                ..
            } = found
            {
                *ext_head = head.get(..n).map(<[u8]>::to_vec);
            }
            return Ok(found);
        }
        let mut got = n;
        if n == quick_len && head_len > n {
            got += self
                .os
                .read_device(device, n as u64, head.get_mut(n..).unwrap_or_default())?;
        }
        let tail = tail.get_mut(..tail_len).unwrap_or_default();
        let tail_got = self.os.read_device(device, size - tail_len as u64, tail)?;
        let content = superblock::probe(
            head.get(..got).unwrap_or_default(),
            tail.get(..tail_got).unwrap_or_default(),
            size,
        );
        if !content.is_blank() {
            return Ok(content);
        }
        // Blank so far: the head is all zeros, and its first blocks now take the far reads
        // (where a LUKS2 secondary header outlives a wiped start).
        let far_at = superblock::FAR_OFFSETS
            .into_iter()
            .filter(|&at| at.saturating_add(superblock::FAR_LEN as u64) <= size);
        let mut far = Vec::with_capacity(superblock::FAR_OFFSETS.len());
        for (at, block) in far_at.zip(head.chunks_mut(superblock::FAR_LEN)) {
            let n = self.os.read_device(device, at, block)?;
            let block: &[u8] = block;
            far.push((at, block.get(..n).unwrap_or_default()));
        }
        Ok(superblock::confirm_blank(&far))
    }

    /// Whether a staged volume's device is there (see [`sys::device_presence`]).
    pub fn presence(&self, stage: &StageRecord) -> Presence {
        sys::device_presence(self.os.as_ref(), &stage.device, stage.rdev)
    }
}
