//! Attaching volume files to this host as block devices: the embedded backend's stand-in for
//! a cloud attach, behind the small [`Attacher`] trait so the backend's logic is tested with
//! [`super::fake::FakeAttacher`] and runs with [`LoopAttacher`].
//!
//! [`LoopAttacher`] uses the loop driver's ioctls directly ([`moor_runtime::sys::loopdev`]); it
//! never runs `losetup`. Devices are identified by what they are bound to (device and inode of
//! the backing file, from `LOOP_GET_STATUS64`), never by number alone: a number can be reused
//! by anyone once a device is unbound, so every detach, resize and flush first checks that the
//! device still backs the file it is meant to.
//!
//! A device is bound with the loop driver's direct I/O (`LO_FLAGS_DIRECT_IO`): the pod's
//! reads and writes go to the backing file's blocks without a second copy in the host's page
//! cache. Buffered, a pod's data was cached twice (in its own filesystem and in the host's
//! cache of the file), reads the host happened to cache beat the disk and fsync'd writes paid
//! for both caches (docs/performance.md, the `io` bench: there the direct-I/O binding is as
//! fast as plain ext4 on the same binding, and where it falls short of the disk, so does
//! plain ext4 on it). Where the backing file cannot take direct I/O (a filesystem without
//! it), the device stays buffered, which is as safe (a flush of the device fsyncs the backing
//! file), and says so in the log.

use std::fmt;
use std::fs::File;
use std::io;
use std::os::fd::OwnedFd;
use std::os::unix::ffi::OsStrExt as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use rustix::fs::{FileType, Mode, OFlags};
use rustix::io::Errno;

use moor_runtime::sys::loopdev;

/// Which file a device is bound to: the file's device (major, minor) and inode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FileId {
    /// Device of the filesystem holding the file.
    pub dev: (u32, u32),
    /// Inode number.
    pub ino: u64,
}

impl FileId {
    /// The identity of an open file.
    pub fn of(file: &File) -> io::Result<Self> {
        let st = rustix::fs::fstat(file)?;
        Ok(Self::from_stat(&st))
    }

    /// The identity of the file at `path` (symlinks followed).
    pub fn of_path(path: &Path) -> io::Result<Self> {
        let st = rustix::fs::stat(path)?;
        Ok(Self::from_stat(&st))
    }

    fn from_stat(st: &rustix::fs::Stat) -> Self {
        Self {
            dev: (rustix::fs::major(st.st_dev), rustix::fs::minor(st.st_dev)),
            ino: st.st_ino,
        }
    }

    fn of_loop(info: &loopdev::LoopInfo64) -> Self {
        Self {
            dev: info.backing_dev(),
            ino: info.lo_inode,
        }
    }
}

/// A block device bound to a file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attachment {
    /// The device node, e.g. `/dev/loop7`.
    pub device: PathBuf,
    /// The backing file's path as the kernel reports it.
    pub backing: PathBuf,
    /// Whether the backing file was deleted (the kernel appends " (deleted)").
    pub deleted: bool,
    /// The backing file's identity.
    pub file: FileId,
    /// Whether the device is bound read-only (nothing can write through it).
    pub read_only: bool,
}

/// What a detach did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Detach {
    /// The device is unbound.
    Done,
    /// Unbinding was requested; the kernel finishes it when the last opener closes the device.
    Deferred,
    /// The device was not bound (or does not exist): nothing to do.
    AlreadyGone,
    /// The device is bound to another file now; it was left alone.
    NotOurs,
}

/// An attach step failed.
#[derive(Debug, thiserror::Error)]
pub enum AttachError {
    /// No loop device can be had (the kernel cannot create another).
    #[error("no free loop device: {0}")]
    NoFreeDevice(#[source] io::Error),
    /// Every free device was taken by someone else before we could bind it.
    #[error("loop devices kept being taken by other processes; gave up after {0} attempts")]
    Busy(u32),
    /// The device is bound to another file than the one expected.
    #[error("{} is not bound to the expected file", .0.display())]
    NotOurs(PathBuf),
    /// A system call failed.
    #[error("{step} {}: {source}", path.display())]
    Sys {
        /// What was being done.
        step: &'static str,
        /// On what.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
}

impl AttachError {
    fn sys(step: &'static str, path: &Path, source: impl Into<io::Error>) -> Self {
        AttachError::Sys {
            step,
            path: path.to_path_buf(),
            source: source.into(),
        }
    }
}

/// Attaches files as block devices on this host.
pub trait Attacher: Send + Sync + fmt::Debug + 'static {
    /// Binds `backing` to a free block device and returns the device's path. No auto-clear:
    /// the binding outlives this process.
    fn attach(&self, backing: &Path, read_only: bool) -> Result<PathBuf, AttachError>;

    /// Unbinds `device` if it is still bound to the file `expect`.
    fn detach(&self, device: &Path, expect: FileId) -> Result<Detach, AttachError>;

    /// The file `device` is bound to, or None when it is not bound or does not exist.
    fn backing_of(&self, device: &Path) -> Result<Option<FileId>, AttachError>;

    /// Tells `device` (bound to `expect`) that its backing file grew.
    fn refresh_size(&self, device: &Path, expect: FileId) -> Result<(), AttachError>;

    /// Writes `device`'s cached data through to its backing file (`expect`).
    fn flush(&self, device: &Path, expect: FileId) -> Result<(), AttachError>;

    /// Stops `device` (bound to `expect`, a thick volume's file) from giving its file's blocks
    /// back: the loop driver turns a discard, and a write-zeroes that may unmap, into a hole
    /// punched in the file, which the thick reservation then no longer holds. Nothing to do
    /// where no device punches holes (the default).
    fn keep_allocated(&self, _device: &Path, _expect: FileId) -> Result<(), AttachError> {
        Ok(())
    }

    /// Every device on this host bound to a file under `root` (the data dir), with the file
    /// named under `root` (see [`under_root`] and [`named_as_a_volume_file`]: the kernel may
    /// name it through a mount this process cannot see; such a device is ours only if it reads
    /// the very file under `root`, by device and inode). No device bound to anything else (by
    /// the name the kernel gives its file) is looked at: inspecting a device
    /// reads its file's attributes, and another user's file may never answer (a FUSE file
    /// whose server hangs), which would hold the controller with it.
    fn list(&self, root: &Path) -> Result<Vec<Attachment>, AttachError>;

    /// Whether attaching can work at all (for Probe).
    fn check(&self) -> Result<(), AttachError>;
}

impl<A: Attacher> Attacher for Arc<A> {
    fn attach(&self, backing: &Path, read_only: bool) -> Result<PathBuf, AttachError> {
        (**self).attach(backing, read_only)
    }
    fn detach(&self, device: &Path, expect: FileId) -> Result<Detach, AttachError> {
        (**self).detach(device, expect)
    }
    fn backing_of(&self, device: &Path) -> Result<Option<FileId>, AttachError> {
        (**self).backing_of(device)
    }
    fn refresh_size(&self, device: &Path, expect: FileId) -> Result<(), AttachError> {
        (**self).refresh_size(device, expect)
    }
    fn flush(&self, device: &Path, expect: FileId) -> Result<(), AttachError> {
        (**self).flush(device, expect)
    }
    fn keep_allocated(&self, device: &Path, expect: FileId) -> Result<(), AttachError> {
        (**self).keep_allocated(device, expect)
    }
    fn list(&self, root: &Path) -> Result<Vec<Attachment>, AttachError> {
        (**self).list(root)
    }
    fn check(&self) -> Result<(), AttachError> {
        (**self).check()
    }
}

/// The data dir's subdirectory whose files are attached (the volumes).
pub const ATTACHED_DIR: &str = "volumes";

/// Where the file a loop device names (sysfs `backing_file`, " (deleted)" already cut off)
/// is under `root`, the data dir, as far as the path alone can tell.
///
/// The kernel names a device's file by the mount it was opened through, as seen from the
/// reader's root. A controller in a container opens volume files through its bind mount of
/// the data dir; once that container is gone (a restart, a rolling update), the mount is
/// detached and the kernel names the file from the mount's own root: `/volumes/<id>.img`
/// for a data dir mounted as itself, `/moor-controller/volumes/<id>.img` for its parent.
/// Such a path is taken as a candidate when it is the end of the path the file has under
/// `root`, and names a volume file (`volumes/vol-<id>.img`): returned with `true`, and the
/// caller must compare the device's file with the one under `root` (device and inode) before
/// calling it ours. A path under `root` is returned as it is, with `false`.
pub fn under_root(root: &Path, named: &Path) -> Option<(PathBuf, bool)> {
    if named.starts_with(root) {
        return Some((named.to_path_buf(), false));
    }
    let tail: Vec<&std::ffi::OsStr> = named.strip_prefix("/").ok()?.iter().collect();
    let [.., dir, file] = tail[..] else {
        return None;
    };
    let is_volume_file = |f: &str| super::ids::VolumeId::from_file_name(f, "img").is_some();
    if dir != ATTACHED_DIR || !file.to_str().is_some_and(is_volume_file) {
        return None;
    }
    // What the kernel shows is a suffix of <root>/volumes/<file>: the part of `root` it shows
    // must be the end of `root`.
    let shown_root = &tail[..tail.len() - 2];
    let root_parts: Vec<&std::ffi::OsStr> = root.strip_prefix("/").ok()?.iter().collect();
    if shown_root.len() > root_parts.len() || !root_parts.ends_with(shown_root) {
        return None;
    }
    Some((root.join(ATTACHED_DIR).join(file), true))
}

/// Where the file a loop device names would be under `root`, the data dir, by its name alone:
/// any path ending in `volumes/vol-<id>.img`. The kernel names a file through the mount it was
/// opened by, as seen from the reader's root; a mount of another mount namespace that still
/// lives (a controller's container not yet gone, with the data dir at another path: a rollout
/// that moved it) is named by its path there, which need not end like `root` at all. Only a
/// candidate: the caller compares the device's file with the one under `root` (device and
/// inode) before calling it ours, which the name cannot decide. Not for a deleted file, whose
/// identity cannot be compared with anything under `root` ([`under_root`] alone decides it).
pub fn named_as_a_volume_file(root: &Path, named: &Path) -> Option<PathBuf> {
    let file = named.file_name()?;
    let dir = named.parent()?.file_name()?;
    let is_volume_file = |f: &str| super::ids::VolumeId::from_file_name(f, "img").is_some();
    (dir == ATTACHED_DIR && file.to_str().is_some_and(is_volume_file))
        .then(|| root.join(ATTACHED_DIR).join(file))
}

/// How often [`LoopAttacher::attach`] asks for another free device after losing a race.
pub const ATTACH_ATTEMPTS: u32 = 64;
/// How long a detach waits for the kernel to unbind the device before calling it deferred.
pub const DETACH_WAIT: Duration = Duration::from_secs(2);

/// The real [`Attacher`]: loop devices, through `/dev/loop-control` and `/dev/loopN`.
#[derive(Debug, Clone)]
pub struct LoopAttacher {
    dev_dir: PathBuf,
    sys_block: PathBuf,
    /// Races lost to other users of loop devices (EBUSY from LOOP_CONFIGURE), for the logs.
    races_lost: Arc<AtomicU64>,
}

impl Default for LoopAttacher {
    fn default() -> Self {
        Self::new()
    }
}

impl LoopAttacher {
    /// Uses `/dev` and `/sys/block`.
    pub fn new() -> Self {
        Self {
            dev_dir: PathBuf::from("/dev"),
            sys_block: PathBuf::from("/sys/block"),
            races_lost: Arc::new(AtomicU64::new(0)),
        }
    }

    /// How many times an attach found the free device it was given taken by someone else and
    /// asked for another.
    pub fn races_lost(&self) -> u64 {
        self.races_lost.load(Ordering::Relaxed)
    }

    fn control_path(&self) -> PathBuf {
        self.dev_dir.join("loop-control")
    }

    fn device_path(&self, n: u32) -> PathBuf {
        self.dev_dir.join(format!("loop{n}"))
    }

    /// Opens `/dev/loopN`; when the node is missing (a /dev without devtmpfs), creates it from
    /// the device number sysfs gives.
    fn open_device(&self, n: u32, path: &Path) -> Result<OwnedFd, AttachError> {
        let flags = OFlags::RDWR | OFlags::CLOEXEC;
        match rustix::fs::open(path, flags, Mode::empty()) {
            Ok(fd) => return Ok(fd),
            Err(Errno::NOENT) => {}
            Err(e) => return Err(AttachError::sys("open", path, e)),
        }
        let dev_file = self.sys_block.join(format!("loop{n}/dev"));
        let text = std::fs::read_to_string(&dev_file)
            .map_err(|e| AttachError::sys("read", &dev_file, e))?;
        let (major, minor) = text
            .trim()
            .split_once(':')
            .and_then(|(a, b)| Some((a.parse::<u32>().ok()?, b.parse::<u32>().ok()?)))
            .ok_or_else(|| AttachError::sys("parse", &dev_file, io::Error::from(Errno::INVAL)))?;
        match rustix::fs::mknodat(
            rustix::fs::CWD,
            path,
            FileType::BlockDevice,
            Mode::from_raw_mode(0o660),
            rustix::fs::makedev(major, minor),
        ) {
            Ok(()) | Err(Errno::EXIST) => {}
            Err(e) => return Err(AttachError::sys("mknod", path, e)),
        }
        rustix::fs::open(path, flags, Mode::empty()).map_err(|e| AttachError::sys("open", path, e))
    }

    /// Opens an existing device to inspect it; None when it does not exist.
    fn open_existing(device: &Path) -> Result<Option<OwnedFd>, AttachError> {
        match rustix::fs::open(device, OFlags::RDONLY | OFlags::CLOEXEC, Mode::empty()) {
            Ok(fd) => Ok(Some(fd)),
            Err(Errno::NOENT | Errno::NXIO | Errno::NODEV) => Ok(None),
            Err(e) => Err(AttachError::sys("open", device, e)),
        }
    }

    /// The file an open device is bound to; None when unbound.
    fn bound_to(fd: &OwnedFd, device: &Path) -> Result<Option<FileId>, AttachError> {
        match loopdev::status(fd) {
            Ok(info) => Ok(Some(FileId::of_loop(&info))),
            Err(e) if e.raw_os_error() == Some(Errno::NXIO.raw_os_error()) => Ok(None),
            Err(e) => Err(AttachError::sys("LOOP_GET_STATUS64", device, e)),
        }
    }

    /// Opens `device` and checks it is bound to `expect`.
    fn open_bound(device: &Path, expect: FileId) -> Result<OwnedFd, AttachError> {
        let fd = Self::open_existing(device)?.ok_or_else(|| AttachError::NotOurs(device.into()))?;
        match Self::bound_to(&fd, device)? {
            Some(id) if id == expect => Ok(fd),
            _ => Err(AttachError::NotOurs(device.to_path_buf())),
        }
    }

    /// The backing file sysfs names for `loopN`, if bound.
    fn sysfs_backing(&self, name: &str) -> Option<String> {
        let path = self.sys_block.join(name).join("loop/backing_file");
        let text = std::fs::read_to_string(path).ok()?;
        let text = text.strip_suffix('\n').unwrap_or(&text);
        (!text.is_empty()).then(|| text.to_string())
    }

    /// `loopN`'s queue attribute `attr` (sysfs), trimmed; None when it cannot be read.
    fn queue_attr(&self, name: &str, attr: &str) -> Option<String> {
        let text = std::fs::read_to_string(self.sys_block.join(name).join("queue").join(attr));
        text.ok().map(|t| t.trim().to_string())
    }

    /// Whether `loopN`'s discards were turned off by [`Attacher::keep_allocated`]: the kernel
    /// would offer them (`discard_max_hw_bytes`) but the device takes none. The kernel keeps
    /// that setting on the device number after it is unbound, and it cannot be undone through
    /// sysfs (with discards off the granularity reads 0, and any other value is refused).
    fn discard_turned_off(&self, name: &str) -> bool {
        let off = self.queue_attr(name, "discard_max_bytes").as_deref() == Some("0");
        let offered = self
            .queue_attr(name, "discard_max_hw_bytes")
            .is_some_and(|v| v != "0");
        off && offered
    }

    /// Deletes the unbound device `loopN` whose discards were turned off, so that the next
    /// volume given this number (a thin one, for which punching holes is right) gets a new
    /// device with the kernel's defaults. Best effort: a device bound or opened again
    /// meanwhile is busy and stays.
    fn forget_device(&self, name: &str) {
        let Some(n) = name
            .strip_prefix("loop")
            .and_then(|n| n.parse::<u32>().ok())
        else {
            return;
        };
        let control_path = self.control_path();
        let result = rustix::fs::open(&control_path, OFlags::RDWR | OFlags::CLOEXEC, Mode::empty())
            .map_err(io::Error::from)
            .and_then(|control| loopdev::remove(&control, n));
        match result {
            Ok(()) => tracing::debug!(device = name, "removed a device whose discards were off"),
            Err(e) => tracing::warn!(
                device = name,
                error = %e,
                "cannot remove a device whose discards were turned off for a thick volume; \
                 a thin volume bound to it will not give space back"
            ),
        }
    }

    /// A short pause after losing a race for a device, growing with the attempt and spread
    /// out so that racing attachers do not collide again in lockstep.
    fn backoff(attempt: u32) {
        let spread = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos() % 500)
            .unwrap_or(0);
        let micros = 100 * u64::from(attempt.min(20)) + u64::from(spread);
        std::thread::sleep(Duration::from_micros(micros));
    }
}

/// Asks once more with `LOOP_SET_DIRECT_IO` when the bind left the freshly bound `device`
/// buffered (the kernel drops the flag for a file it cannot give direct I/O to). A device that
/// stays buffered is kept and logged: it is as safe, only cached twice.
fn ensure_direct_io(device: &OwnedFd, path: &Path, backing: &Path) {
    let has = |d: &OwnedFd| {
        loopdev::status(d).is_ok_and(|i| i.lo_flags & loopdev::LO_FLAGS_DIRECT_IO != 0)
    };
    if has(device) {
        return;
    }
    let reason = match loopdev::set_direct_io(device, true) {
        Ok(()) if has(device) => return,
        Ok(()) => "the driver kept it buffered".to_string(),
        Err(e) => e.to_string(),
    };
    tracing::info!(
        device = %path.display(),
        backing = %backing.display(),
        %reason,
        "loop device bound without direct I/O (its backing file cannot take it): buffered through the host's page cache"
    );
}

impl Attacher for LoopAttacher {
    fn attach(&self, backing: &Path, read_only: bool) -> Result<PathBuf, AttachError> {
        let mode = if read_only {
            OFlags::RDONLY
        } else {
            OFlags::RDWR
        };
        let file = rustix::fs::open(backing, mode | OFlags::CLOEXEC, Mode::empty())
            .map_err(|e| AttachError::sys("open backing file", backing, e))?;
        let control_path = self.control_path();
        let control =
            rustix::fs::open(&control_path, OFlags::RDWR | OFlags::CLOEXEC, Mode::empty())
                .map_err(|e| AttachError::sys("open", &control_path, e))?;
        let flags = loopdev::LO_FLAGS_DIRECT_IO
            | if read_only {
                loopdev::LO_FLAGS_READ_ONLY
            } else {
                0
            };
        let name = backing.as_os_str().as_bytes();
        for attempt in 1..=ATTACH_ATTEMPTS {
            let n = loopdev::get_free(&control).map_err(|e| match e.raw_os_error() {
                Some(c) if c == Errno::NOSPC.raw_os_error() || c == Errno::NOMEM.raw_os_error() => {
                    AttachError::NoFreeDevice(e)
                }
                _ => AttachError::sys("LOOP_CTL_GET_FREE", &control_path, e),
            })?;
            let path = self.device_path(n);
            let device = match self.open_device(n, &path) {
                Ok(fd) => fd,
                // Removed by someone between GET_FREE and open: ask again.
                Err(AttachError::Sys { source, .. })
                    if matches!(
                        source.raw_os_error(),
                        Some(c) if c == Errno::NXIO.raw_os_error() || c == Errno::NOENT.raw_os_error()
                    ) =>
                {
                    Self::backoff(attempt);
                    continue;
                }
                Err(e) => return Err(e),
            };
            let mut bound = loopdev::configure(&device, &file, flags, name);
            if bound
                .as_ref()
                .is_err_and(|e| e.raw_os_error() == Some(Errno::INVAL.raw_os_error()))
            {
                // A kernel that refuses the bind for the direct I/O it cannot give this file
                // (others bind buffered and drop the flag): bound buffered instead.
                bound =
                    loopdev::configure(&device, &file, flags & !loopdev::LO_FLAGS_DIRECT_IO, name);
            }
            match bound {
                Ok(()) => {
                    ensure_direct_io(&device, &path, backing);
                    return Ok(path);
                }
                // Another process bound this device between GET_FREE and CONFIGURE.
                Err(e) if e.raw_os_error() == Some(Errno::BUSY.raw_os_error()) => {
                    self.races_lost.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(device = %path.display(), attempt, "loop device taken meanwhile; asking for another");
                    Self::backoff(attempt);
                }
                Err(e) => return Err(AttachError::sys("LOOP_CONFIGURE", &path, e)),
            }
        }
        Err(AttachError::Busy(ATTACH_ATTEMPTS))
    }

    fn detach(&self, device: &Path, expect: FileId) -> Result<Detach, AttachError> {
        let Some(fd) = Self::open_existing(device)? else {
            return Ok(Detach::AlreadyGone);
        };
        // While we hold the device open nobody can unbind and rebind it, so the check and the
        // clear are about the same binding.
        match Self::bound_to(&fd, device)? {
            None => return Ok(Detach::AlreadyGone),
            Some(id) if id != expect => return Ok(Detach::NotOurs),
            Some(_) => {}
        }
        let name = device
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default()
            .to_string();
        let ours = self.sysfs_backing(&name);
        let forget = self.discard_turned_off(&name);
        match loopdev::clear_fd(&fd) {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(Errno::NXIO.raw_os_error()) => {
                return Ok(Detach::AlreadyGone);
            }
            Err(e) => return Err(AttachError::sys("LOOP_CLR_FD", device, e)),
        }
        drop(fd);
        // The kernel unbinds on last close; wait for it unless someone else holds it open.
        // Once unbound, the number is the lowest free one and may be bound again at once by
        // anyone: a device serving another file is done with ours.
        let start = Instant::now();
        while start.elapsed() < DETACH_WAIT {
            let now = self.sysfs_backing(&name);
            if now.is_none() && forget {
                self.forget_device(&name);
            }
            if now.is_none() || now != ours {
                return Ok(Detach::Done);
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        Ok(Detach::Deferred)
    }

    fn backing_of(&self, device: &Path) -> Result<Option<FileId>, AttachError> {
        match Self::open_existing(device)? {
            Some(fd) => Self::bound_to(&fd, device),
            None => Ok(None),
        }
    }

    fn refresh_size(&self, device: &Path, expect: FileId) -> Result<(), AttachError> {
        let fd = Self::open_bound(device, expect)?;
        loopdev::set_capacity(&fd).map_err(|e| AttachError::sys("LOOP_SET_CAPACITY", device, e))
    }

    fn flush(&self, device: &Path, expect: FileId) -> Result<(), AttachError> {
        let fd = Self::open_bound(device, expect)?;
        rustix::fs::fsync(&fd).map_err(|e| AttachError::sys("fsync", device, e))
    }

    /// Turns the device's discards off (sysfs `queue/discard_max_bytes` = 0). On this kind of
    /// kernel that also stops the write-zeroes that would unmap (ext4's lazy inode-table
    /// zeroing; `fallocate --punch-hole` on the device is refused): the filesystem on it then
    /// writes zeroes, and mkfs, fstrim and `-o discard` find nothing to discard with.
    fn keep_allocated(&self, device: &Path, expect: FileId) -> Result<(), AttachError> {
        // Held open: the device cannot be unbound and rebound to another file meanwhile.
        let _fd = Self::open_bound(device, expect)?;
        let name = device
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default();
        let path = self.sys_block.join(name).join("queue/discard_max_bytes");
        std::fs::write(&path, "0").map_err(|e| AttachError::sys("write", &path, e))
    }

    fn list(&self, root: &Path) -> Result<Vec<Attachment>, AttachError> {
        let entries = std::fs::read_dir(&self.sys_block)
            .map_err(|e| AttachError::sys("read dir", &self.sys_block, e))?;
        let mut out = Vec::new();
        for entry in entries.flatten() {
            let Some(name) = entry.file_name().to_str().map(str::to_string) else {
                continue;
            };
            let is_loop = name
                .strip_prefix("loop")
                .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()));
            if !is_loop {
                continue;
            }
            let Some(named) = self.sysfs_backing(&name) else {
                continue;
            };
            let (named, deleted) = match named.strip_suffix(" (deleted)") {
                Some(b) => (b.to_string(), true),
                None => (named, false),
            };
            // Someone else's device is not opened at all (sysfs names its file without
            // touching it): its status read could wait on a file that never answers.
            let candidate = under_root(root, Path::new(&named)).or_else(|| {
                let by_name = named_as_a_volume_file(root, Path::new(&named));
                by_name.filter(|_| !deleted).map(|p| (p, true))
            });
            let Some((backing, verify)) = candidate else {
                continue;
            };
            let device = self.dev_dir.join(&name);
            // A device under the data dir that cannot be inspected (its status answers an
            // error) is skipped, not fatal.
            let inspected = Self::open_existing(&device)
                .and_then(|fd| fd.map(|fd| Self::bound_to(&fd, &device)).transpose());
            // The path comes from sysfs and the identity from the device: read the path again
            // after the identity, so that a rebind in between (loop numbers are reused at once)
            // cannot pair one file's path with another's identity.
            let file = match inspected {
                Ok(Some(Some(file))) => file,
                Ok(_) => continue,
                Err(e) => {
                    tracing::warn!(device = %device.display(), backing = named, error = %e,
                        "cannot inspect this loop device; skipped");
                    continue;
                }
            };
            let again = self.sysfs_backing(&name);
            let same = again
                .as_deref()
                .is_some_and(|a| a.strip_suffix(" (deleted)").unwrap_or(a) == named.as_str());
            if !same {
                continue;
            }
            // Named through a mount this process cannot see: ours only if it is the very
            // file under the data dir. An unlinked file named so cannot be compared with
            // anything under the data dir: another install on the same filesystem (the
            // every-node controller beside the one-node one, a test's) names its volume files
            // the same way, so such a device is not ours to detach.
            if verify {
                let ours = !deleted && FileId::of_path(&backing).is_ok_and(|f| f == file);
                if !ours {
                    if deleted {
                        tracing::info!(device = %device.display(), backing = named,
                            "a loop device serves an unlinked volume file named from a mount \
                             this controller cannot see; it may be another install's: left alone");
                    }
                    continue;
                }
            }
            let read_only = std::fs::read_to_string(self.sys_block.join(&name).join("ro"))
                .is_ok_and(|s| s.trim() == "1");
            out.push(Attachment {
                device,
                backing,
                deleted,
                file,
                read_only,
            });
        }
        out.sort_by(|a, b| a.device.cmp(&b.device));
        Ok(out)
    }

    fn check(&self) -> Result<(), AttachError> {
        let path = self.control_path();
        rustix::fs::open(&path, OFlags::RDWR | OFlags::CLOEXEC, Mode::empty())
            .map(drop)
            .map_err(|e| AttachError::sys("open", &path, e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::embedded::testdir::TestDir;

    #[test]
    fn a_file_named_through_a_mount_gone_since_is_a_candidate_under_the_data_dir() {
        let root = Path::new("/var/lib/moor-controller");
        let vol = "vol-0123456789abcdef.img";
        let want = root.join("volumes").join(vol);
        // Under the data dir: as it is, nothing to verify.
        assert_eq!(
            under_root(root, &want),
            Some((want.clone(), false)),
            "named as it is"
        );
        // The container that attached it is gone: the kernel names the file from the root of
        // the detached bind mount (the data dir itself, or a dir above it).
        for shown in [
            format!("/volumes/{vol}"),
            format!("/moor-controller/volumes/{vol}"),
            format!("/lib/moor-controller/volumes/{vol}"),
        ] {
            assert_eq!(
                under_root(root, Path::new(&shown)),
                Some((want.clone(), true)),
                "{shown}"
            );
        }
        // Anything else is someone else's, and is never opened.
        for shown in [
            "/volumes/vol-0123456789abcdef.img.tmp".to_string(),
            "/volumes/other.img".to_string(),
            format!("/snapshots/{vol}"),
            format!("/other/volumes/{vol}"),
            format!("/usr/var/lib/moor-controller/volumes/{vol}"),
            vol.to_string(),
            "/".to_string(),
        ] {
            assert_eq!(under_root(root, Path::new(&shown)), None, "{shown}");
        }
    }

    #[test]
    fn a_file_named_through_another_live_namespace_is_a_candidate_by_its_name() {
        let root = Path::new("/var/lib/moor-controller");
        let vol = "vol-0123456789abcdef.img";
        let want = root.join("volumes").join(vol);
        for shown in [
            format!("/data/volumes/{vol}"),
            format!("/usr/var/lib/moor-controller/volumes/{vol}"),
            format!("/volumes/{vol}"),
        ] {
            assert_eq!(
                named_as_a_volume_file(root, Path::new(&shown)),
                Some(want.clone()),
                "{shown}"
            );
        }
        for shown in [
            "/data/volumes/vol-0123456789abcdef.img.tmp".to_string(),
            "/data/volumes/other.img".to_string(),
            format!("/data/snapshots/{vol}"),
            vol.to_string(),
            "/".to_string(),
        ] {
            assert_eq!(
                named_as_a_volume_file(root, Path::new(&shown)),
                None,
                "{shown}"
            );
        }
    }

    #[test]
    fn a_device_bound_outside_the_data_dir_is_not_opened() {
        let t = TestDir::new("attach-scope");
        let (sys, dev, data) = (
            t.path().join("sys"),
            t.path().join("dev"),
            t.path().join("data"),
        );
        for (name, backing) in [
            ("loop3", data.join("volumes/v.img")),
            ("loop7", PathBuf::from("/elsewhere/fuse/file.img")),
        ] {
            std::fs::create_dir_all(sys.join(name).join("loop")).unwrap();
            std::fs::write(
                sys.join(name).join("loop/backing_file"),
                format!("{}\n", backing.display()),
            )
            .unwrap();
        }
        std::fs::create_dir_all(&dev).unwrap();
        // Someone else's device whose open never returns (as a status read of a file on a
        // hung FUSE mount would not): a FIFO nobody writes to.
        rustix::fs::mknodat(
            rustix::fs::CWD,
            dev.join("loop7"),
            rustix::fs::FileType::Fifo,
            Mode::from_raw_mode(0o600),
            0,
        )
        .unwrap();
        let a = LoopAttacher {
            dev_dir: dev.clone(),
            sys_block: sys,
            races_lost: Arc::new(AtomicU64::new(0)),
        };
        let (tx, rx) = std::sync::mpsc::channel();
        let root = data.clone();
        std::thread::spawn(move || tx.send(a.list(&root).map(|l| l.len())));
        let listed = rx.recv_timeout(Duration::from_secs(60));
        if listed.is_err() {
            // Let the stuck open return, then fail.
            let _ = std::fs::OpenOptions::new()
                .write(true)
                .open(dev.join("loop7"));
            panic!("list opened a device bound outside the data dir, and waited on it");
        }
        // Ours has no device node here: listed as nothing, and no error.
        assert_eq!(listed.unwrap().unwrap(), 0);
    }
}
