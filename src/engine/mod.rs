//! The mount engine: the CSI Node semantics, over an [`Os`] and the [`Journal`].
//!
//! Every operation takes the volume's guard (a second call on the same volume gets ABORTED),
//! writes its intent to the journal before it changes the mount table and confirms it after,
//! and decides "is this mounted, and is it ours" by statx on the one path involved (mount
//! root attribute and the kernel's unique mount id), never by reading the whole mount table.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use moor_proto::csi::v1::volume_capability::access_mode::Mode;
use tracing::{info, warn};

use crate::crash_points;
use crate::error::{Error, Result};
use crate::journal::{
    AccessRecord, Durability, Journal, Phase, PublishRecord, StageRecord, VolumeRecord,
};
use crate::mount_options::Filesystem;
use crate::superblock::{self, Content};
use crate::sys::discovery::{DEFAULT_DISCOVERY_DEADLINE, DiscoveryError, Verdict};
use crate::sys::{
    self, BindMount, BlockDevice, BufPool, FsMount, FsUsage, HeldDevice, MountAttrs, MountPoint,
    MountState, Os, Presence, SysError, ToolError, ToolRun, is_corruption_errno, is_gone_errno,
};
use crate::validate::{self, Access, Capability};
use crate::volume_lock::VolumeLocks;
use crate::{fsgroup, selinux};

/// e2fsck's exit code bits: errors corrected; corrected, and a reboot would be due (for the
/// root filesystem); errors left uncorrected.
const FSCK_CORRECTED: i32 = 1;
const FSCK_CORRECTED_REBOOT: i32 = 2;
const FSCK_UNCORRECTED: i32 = 4;
/// How many stacked mounts an unmount peels off before giving up.
const MAX_STACKED: usize = 16;
/// Retries of an unmount that fails with EBUSY (2 ms doubling: about half a second in all).
const UNMOUNT_BUSY_RETRIES: u32 = 8;
/// The access mode of a record adopted from the mount table (the journal had lost it): the
/// next request's capability is taken as the volume's.
pub const ADOPTED_MODE: i32 = 0;

/// Engine settings.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// The kubelet dir; every path lies below it.
    pub kubelet_dir: PathBuf,
    /// Most volumes staged at once (0: no limit).
    pub max_volumes: u64,
    /// Deadline for mkfs.
    pub mkfs_deadline: Duration,
    /// Deadline for resize tools.
    pub resize_deadline: Duration,
    /// How long NodeStageVolume waits for the volume's device to appear.
    pub discovery_deadline: Duration,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            kubelet_dir: PathBuf::from("/var/lib/kubelet"),
            max_volumes: 0,
            mkfs_deadline: Duration::from_secs(600),
            resize_deadline: Duration::from_secs(600),
            discovery_deadline: DEFAULT_DISCOVERY_DEADLINE,
        }
    }
}

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

/// The node engine.
#[derive(Debug)]
pub struct Engine<O: Os> {
    os: Arc<O>,
    journal: Arc<Journal>,
    locks: VolumeLocks,
    cfg: EngineConfig,
    /// The buffer a device probe reads its windows into, kept between probes.
    probe_bufs: BufPool,
}

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

/// Whether the filesystem found on a device can be mounted as the requested one.
fn compatible(found: Filesystem, wanted: Filesystem) -> bool {
    let ext = |f| matches!(f, Filesystem::Ext2 | Filesystem::Ext3 | Filesystem::Ext4);
    found == wanted || (ext(found) && ext(wanted))
}

impl<O: Os> Engine<O> {
    /// Builds an engine.
    pub fn new(os: Arc<O>, journal: Arc<Journal>, cfg: EngineConfig) -> Self {
        Self {
            os,
            journal,
            locks: VolumeLocks::default(),
            cfg,
            probe_bufs: BufPool::new(superblock::HEAD_LEN + superblock::TAIL_LEN, 1),
        }
    }

    /// The settings.
    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    /// The OS layer.
    pub fn os(&self) -> &Arc<O> {
        &self.os
    }

    /// The journal.
    pub fn journal(&self) -> &Arc<Journal> {
        &self.journal
    }

    /// The per-volume guards.
    pub fn locks(&self) -> &VolumeLocks {
        &self.locks
    }

    fn record(&self, volume_id: &str) -> VolumeRecord {
        self.journal
            .get(volume_id)
            .unwrap_or_else(|| VolumeRecord::new(volume_id))
    }

    fn open_device(&self, volume_id: &str, device: &Path) -> Result<BlockDevice> {
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
    fn resolve_device(&self, req: &validate::Stage) -> Result<(PathBuf, HeldDevice)> {
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

    /// Unmounts everything stacked on `path` that `is_ours` accepts, and a corrupted mount.
    pub(crate) fn unmount_all(
        &self,
        path: &Path,
        is_ours: impl Fn(&MountPoint) -> bool,
    ) -> Result<()> {
        for _ in 0..MAX_STACKED {
            match self.os.mount_state(path)? {
                MountState::Mounted(mp) if is_ours(&mp) => self.unmount_busy_retry(path)?,
                MountState::Corrupted { .. } => self.os.unmount(path, true)?,
                MountState::Mounted(_) | MountState::Absent | MountState::NotMounted { .. } => {
                    return Ok(());
                }
            }
        }
        Err(Error::FailedPrecondition(format!(
            "{} still has mounts after {MAX_STACKED} unmounts",
            path.display()
        )))
    }

    /// Unmounts `path`, retrying a short while on EBUSY: a tool this daemon just forked for
    /// another volume briefly holds copies of its descriptors, which pin the mount until it
    /// execs. A mount that stays busy (a process really uses it) fails with the error.
    fn unmount_busy_retry(&self, path: &Path) -> Result<()> {
        let mut pause = Duration::from_millis(2);
        for attempt in 0.. {
            match self.os.unmount(path, false) {
                Err(e) if e.errno() == Some(libc::EBUSY) && attempt < UNMOUNT_BUSY_RETRIES => {
                    std::thread::sleep(pause);
                    pause *= 2;
                }
                other => return other.map_err(Error::from),
            }
        }
        Ok(())
    }

    /// Reads the device's superblock regions and says what is on it.
    ///
    /// The windows are read into page-aligned buffers, so the OS layer can read them with
    /// O_DIRECT: no copy through the device's page cache, which the mount would throw away.
    pub fn probe_device(&self, device: &Path, size: u64) -> Result<Content> {
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
        Ok(superblock::probe(
            head.get(..got).unwrap_or_default(),
            tail.get(..tail_got).unwrap_or_default(),
            size,
        ))
    }

    /// Makes a filesystem `fs` with UUID `uuid` on `device` (a held device's handle). `force`
    /// only for a device moor itself was formatting when it was interrupted.
    fn mkfs(&self, fs: Filesystem, device: &Path, uuid: &str, force: bool) -> Result<Duration> {
        let (program, mut args): (String, Vec<String>) = match fs {
            // ext4's journal is checksummed with a seed from the filesystem's UUID (a fresh
            // one, chosen here), so blocks an earlier filesystem left where the journal goes
            // can never be replayed: it need not be zeroed. ext3's journal has no checksums:
            // zero it. (The README's durability section has the measurements.)
            Filesystem::Ext2 | Filesystem::Ext3 | Filesystem::Ext4 => (
                format!("mkfs.{}", fs.name()),
                vec![
                    "-q".into(),
                    "-U".into(),
                    uuid.into(),
                    "-E".into(),
                    format!(
                        "lazy_itable_init=1,lazy_journal_init={},nodiscard",
                        u8::from(fs != Filesystem::Ext3)
                    ),
                ],
            ),
            Filesystem::Xfs => (
                "mkfs.xfs".into(),
                vec![
                    "-q".into(),
                    "-K".into(),
                    "-m".into(),
                    format!("uuid={uuid}"),
                ],
            ),
            Filesystem::Btrfs => (
                "mkfs.btrfs".into(),
                vec!["-q".into(), "-K".into(), "-U".into(), uuid.into()],
            ),
        };
        if force {
            args.push(
                if program.starts_with("mkfs.ext") {
                    "-F"
                } else {
                    "-f"
                }
                .into(),
            );
        }
        args.push(device.display().to_string());
        let start = Instant::now();
        self.os.run_tool(&ToolRun {
            program,
            args,
            deadline: self.cfg.mkfs_deadline,
        })?;
        Ok(start.elapsed())
    }

    /// Checks an existing filesystem before it is mounted read-write, as `fsck -a` before a
    /// mount does in the field: ext2/3/4 with e2fsck in preen mode (it repairs what is safe to
    /// repair unattended and stops at anything else). xfs and btrfs are never repaired
    /// unattended (xfs replays its log at mount; btrfs checks itself), so they are not
    /// checked here. Exit 0 is clean, 1 and 2 repaired; errors left (bit 4) refuse the mount
    /// with e2fsck's words; the check itself failing (not installed, an operational error) is
    /// logged and the mount goes on, as it would without a check.
    fn check_fs(&self, volume_id: &str, fs: Filesystem, dev: &HeldDevice) -> Result<()> {
        if !matches!(fs, Filesystem::Ext2 | Filesystem::Ext3 | Filesystem::Ext4) {
            return Ok(());
        }
        let run = ToolRun {
            program: "e2fsck".into(),
            args: vec!["-p".into(), dev.handle.display().to_string()],
            deadline: self.cfg.mkfs_deadline,
        };
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
                    "the filesystem has errors e2fsck cannot repair unattended; not mounting it");
                Err(Error::FailedPrecondition(format!(
                    "volume {volume_id:?}: the {} filesystem on {} has errors that e2fsck \
                     cannot repair unattended (exit {code}): {stderr}; repair it by hand \
                     (e2fsck -f) before the volume can be staged",
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
                    "e2fsck repaired the filesystem before mounting it");
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
                        || matches!(
                            req.cap.access,
                            Access::Mount {
                                fs: Filesystem::Btrfs,
                                ..
                            }
                        ));
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
            Content::Filesystem { fs: found, .. } if compatible(*found, *fs) => {}
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
                // btrfs gives its mounts an anonymous device number: nothing to compare.
                MountState::Mounted(mp) if mp.dev == dev.rdev || *fs == Filesystem::Btrfs => {}
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

    /// Whether the journal has a volume other than `volume_id` staged or published at `path`.
    /// Without a record of its own at a path, a volume's call is taken at the CO's word (the
    /// journal may be new); this keeps that word from reaching another volume's mounts.
    fn held_by_another(&self, volume_id: &str, path: &Path) -> bool {
        self.journal.all().iter().any(|r| {
            r.volume_id != volume_id
                && (r.stage.as_ref().is_some_and(|s| s.path == path)
                    || r.publishes.contains_key(path))
        })
    }

    /// NodeGetVolumeStats: usage and condition of the volume at `path`.
    pub fn stats(&self, req: &validate::Stats) -> Result<(VolumeStats, Condition)> {
        let record = self.journal.get(&req.volume_id);
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
            MountState::Mounted(_) => {
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
                    _ => Condition {
                        abnormal: false,
                        message: "volume is mounted and healthy".into(),
                    },
                };
                Ok((VolumeStats::Filesystem(usage), condition))
            }
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

    /// Whether a staged volume's device is there (see [`sys::device_presence`]).
    pub fn presence(&self, stage: &StageRecord) -> Presence {
        sys::device_presence(self.os.as_ref(), &stage.device, stage.rdev)
    }

    /// NodeExpandVolume: grows the filesystem to the device's size; returns the capacity.
    pub fn expand(&self, req: &validate::Expand) -> Result<u64> {
        let _guard = self.locks.try_lock(&req.volume_id)?;
        let record = self.journal.get(&req.volume_id);
        let stage = record
            .as_ref()
            .and_then(|r| r.stage.clone())
            .filter(|s| {
                s.path == req.path
                    || record
                        .as_ref()
                        .is_some_and(|r| r.publishes.contains_key(&req.path))
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
        let dev = self.open_device(&req.volume_id, &stage.device)?;
        if dev.rdev != stage.rdev {
            return Err(Error::FailedPrecondition(format!(
                "device {} no longer belongs to volume {:?}",
                stage.device.display(),
                req.volume_id
            )));
        }
        if req.required_bytes > dev.size {
            return Err(Error::OutOfRange(format!(
                "device {} has {} bytes, less than the {} required; expand it on the controller first",
                stage.device.display(),
                dev.size,
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
    fn grow_fs(&self, fs: Filesystem, device: &Path, mount_point: &Path) -> Result<()> {
        let mount_point = mount_point.display().to_string();
        let (program, args) = match fs {
            Filesystem::Ext2 | Filesystem::Ext3 | Filesystem::Ext4 => {
                ("resize2fs", vec![device.display().to_string()])
            }
            Filesystem::Xfs => ("xfs_growfs", vec![mount_point]),
            Filesystem::Btrfs => (
                "btrfs",
                vec![
                    "filesystem".into(),
                    "resize".into(),
                    "max".into(),
                    mount_point,
                ],
            ),
        };
        self.os.run_tool(&ToolRun {
            program: program.into(),
            args,
            deadline: self.cfg.resize_deadline,
        })?;
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
