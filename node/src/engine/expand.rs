//! NodeExpandVolume: a staged filesystem grown to its device's size.

use std::path::Path;

use moor_runtime::contract::Filesystem;

use super::{Engine, Expand};
use crate::crash_points;
use crate::error::{Error, Result};
use crate::filesystem;
use crate::journal::{AccessRecord, StageRecord, VolumeRecord};
use crate::sys::{MountState, Os};

/// The stage of the volume at the request's path (its staging path or a target it is
/// published at), which must match the staging path and access type the request names.
fn staged_for_expand(record: Option<&VolumeRecord>, req: &Expand) -> Result<StageRecord> {
    let stage = record
        .and_then(|r| r.stage.clone())
        .filter(|s| {
            s.path == req.path || record.is_some_and(|r| r.publishes.contains_key(&req.path))
        })
        .ok_or_else(|| Error::VolumeNotFound {
            volume: req.volume_id.clone(),
            reason: format!("it is not staged or published at {}", req.path.display()),
        })?;
    if let Some(staging) = &req.staging
        && *staging != stage.path
    {
        return Err(Error::invalid(
            "staging_target_path",
            format!("the volume is staged at {}", stage.path.display()),
        ));
    }
    if let Some(cap) = &req.cap
        && cap.access.is_block() != matches!(stage.access, AccessRecord::Block)
    {
        return Err(Error::invalid(
            "volume_capability",
            "the access type differs from the one the volume was staged with",
        ));
    }
    Ok(stage)
}

impl<O: Os> Engine<O> {
    /// NodeExpandVolume: grows the filesystem to the device's size; returns the capacity.
    pub fn expand(&self, req: &Expand) -> Result<u64> {
        let _guard = self.locks.try_lock(&req.volume_id)?;
        let record = self.journal.get(&req.volume_id).map(|r| self.claims(r));
        let stage = staged_for_expand(record.as_ref(), req)?;
        // An RBD image grown on the controller: its device takes the new size first.
        self.refresh_mapping(&req.volume_id)?;
        // An encrypted volume's mapping takes its device's new size before the filesystem.
        let crypt = record.as_ref().and_then(|r| r.crypt.clone());
        if crypt.is_some() {
            self.resize_mapping(&req.volume_id, req.key.as_ref())?;
        }
        let dev = self.open_device(&req.volume_id, &stage.device)?;
        if dev.rdev != stage.rdev {
            return Err(Error::FailedPrecondition(format!(
                "device {} no longer belongs to volume {:?}",
                stage.device.display(),
                req.volume_id
            )));
        }
        // kubelet asks once the controller has grown the volume: a device still smaller has
        // not seen its growth yet (a loop device's or a mapping's new size is told after), which
        // a retry meets. Not OUT_OF_RANGE: kubelet takes that as infeasible and stops trying
        // until the user changes the claim's size (RecoverVolumeExpansionFailure).
        // The size the controller gave is the encrypted volume's device's, its LUKS header
        // and the mapping together.
        let volume_size = match &crypt {
            Some(c) => self.os.block_device(&c.device).map_err(Error::Sys)?.size,
            None => dev.size,
        };
        if req.required_bytes > volume_size {
            return Err(Error::Unavailable(format!(
                "device {} has {} bytes, less than the {} required: it has not grown to the \
                 volume's new size yet",
                stage.device.display(),
                volume_size,
                req.required_bytes
            )));
        }
        // Growing fills the device: past the limit, the volume would be bigger than allowed.
        if req.limit_bytes > 0 && dev.size > req.limit_bytes {
            return Err(Error::OutOfRange(format!(
                "device {} has {} bytes, more than the limit of {}",
                stage.device.display(),
                dev.size,
                req.limit_bytes
            )));
        }
        let AccessRecord::Mount { fs_type, .. } = &stage.access else {
            return Ok(dev.size);
        };
        if stage.attrs.read_only {
            return Err(Error::FailedPrecondition(format!(
                "volume {:?} is staged read-only and cannot be grown",
                req.volume_id
            )));
        }
        match self.os.mount_state(&stage.path)? {
            MountState::Mounted(_) => {}
            other => {
                return Err(Error::FailedPrecondition(format!(
                    "volume {:?} is not mounted at {} ({other:?})",
                    req.volume_id,
                    stage.path.display()
                )));
            }
        }
        let Some(fs) = Filesystem::from_name(fs_type) else {
            return Err(Error::FailedPrecondition(format!(
                "cannot grow {fs_type:?}"
            )));
        };
        crash_points::point("expand.resizing");
        self.grow_fs(fs, &stage.device, &stage.path)?;
        crash_points::point("expand.resized");
        Ok(dev.size)
    }

    /// Grows the filesystem mounted at `mount_point` from `device` to the device's size, online,
    /// with its own tool.
    pub(super) fn grow_fs(&self, fs: Filesystem, device: &Path, mount_point: &Path) -> Result<()> {
        let run = filesystem::ops(fs).grow(device, mount_point, self.cfg.resize_deadline);
        self.os.run_tool(&run)?;
        Ok(())
    }
}
