//! The operating system, behind a trait.
//!
//! Everything the node engine asks of the kernel or of external tools goes through [`Os`]:
//! mounting, unmounting, inspecting a path, reading a device, running mkfs. [`linux::Linux`]
//! is the real thing (the only `unsafe` code is in [`raw`] and [`spawn`]);
//! [`fake::FakeOs`] keeps an in-memory model of mounts, directories and devices and records
//! every call, so the CSI logic is unit-tested without root.

pub mod discovery;
pub mod fake;
pub mod linux;
pub mod loopdev;
pub mod loopinfo;
pub mod mount_table;
pub mod mountinfo;
pub mod ownership;
pub mod raw;
pub mod selinux;
pub mod spawn;

use std::path::{Path, PathBuf};
use std::time::Duration;

use discovery::{DeviceIdentity, DiscoveryError, FoundDevice, Verdict};
pub use ownership::{GroupReport, OwnershipError};

/// The alignment (buffer address, length, offset) that lets a device read use O_DIRECT.
pub const DIRECT_ALIGN: usize = 4096;

/// A zeroed byte buffer whose start is aligned to [`DIRECT_ALIGN`], for device reads that
/// bypass the page cache.
#[derive(Debug)]
pub struct AlignedBuf {
    storage: Vec<u8>,
    start: usize,
    len: usize,
}

impl AlignedBuf {
    /// `len` zero bytes, aligned.
    pub fn zeroed(len: usize) -> Self {
        let storage = vec![0u8; len + DIRECT_ALIGN];
        // At most DIRECT_ALIGN - 1 in practice; if the platform cannot say, the buffer is
        // merely unaligned and reads take the page cache.
        let start = storage
            .as_ptr()
            .align_offset(DIRECT_ALIGN)
            .min(DIRECT_ALIGN);
        Self {
            storage,
            start,
            len,
        }
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        self.storage
            .get(self.start..self.start + self.len)
            .unwrap_or_default()
    }

    /// The bytes, writable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        self.storage
            .get_mut(self.start..self.start + self.len)
            .unwrap_or_default()
    }
}

/// Aligned buffers of one length kept for reuse. A fresh megabyte-sized buffer is a fresh
/// mapping that the kernel faults in and zeroes page by page, and unmaps when dropped; for the
/// two windows a blank proof reads, that came to a fifth of the whole proof. A pool keeps up to
/// `keep` buffers between calls (their memory stays resident); callers beyond that get a fresh
/// one.
#[derive(Debug)]
pub struct BufPool {
    len: usize,
    keep: usize,
    free: std::sync::Mutex<Vec<AlignedBuf>>,
}

impl BufPool {
    /// A pool of `len`-byte buffers that keeps at most `keep` of them.
    pub fn new(len: usize, keep: usize) -> Self {
        Self {
            len,
            keep,
            free: std::sync::Mutex::new(Vec::new()),
        }
    }

    /// A buffer of the pool's length, which goes back to the pool when dropped. A reused one
    /// still holds what its last user read into it: read into it before looking at it.
    pub fn take(&self) -> PooledBuf<'_> {
        let reused = self.lock().pop();
        PooledBuf {
            buf: Some(reused.unwrap_or_else(|| AlignedBuf::zeroed(self.len))),
            pool: self,
        }
    }

    /// How many buffers wait for reuse.
    #[cfg(test)]
    fn idle(&self) -> usize {
        self.lock().len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<AlignedBuf>> {
        // A user that panicked left nothing half-changed in a Vec of buffers.
        self.free
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// A buffer taken from a [`BufPool`].
#[derive(Debug)]
pub struct PooledBuf<'a> {
    buf: Option<AlignedBuf>,
    pool: &'a BufPool,
}

impl PooledBuf<'_> {
    /// The bytes, writable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        self.buf
            .as_mut()
            .map(AlignedBuf::as_mut_slice)
            .unwrap_or_default()
    }
}

impl Drop for PooledBuf<'_> {
    fn drop(&mut self) {
        if let Some(buf) = self.buf.take() {
            let mut free = self.pool.lock();
            if free.len() < self.pool.keep {
                free.push(buf);
            }
        }
    }
}

/// An error from one step of talking to the OS: which step, on what, and the errno.
#[derive(Debug, thiserror::Error)]
#[error("{step} {}: {source}{detail}", path.display())]
pub struct SysError {
    /// The operation that failed, e.g. "move_mount", "open target".
    pub step: &'static str,
    /// The path the operation was about.
    pub path: PathBuf,
    /// The underlying error.
    #[source]
    pub source: std::io::Error,
    /// What else is known (the kernel's own message for a failed mount), with a leading space.
    pub detail: String,
}

impl SysError {
    /// Builds an error for `step` on `path`.
    pub fn new(step: &'static str, path: &Path, source: impl Into<std::io::Error>) -> Self {
        Self {
            step,
            path: path.to_path_buf(),
            source: source.into(),
            detail: String::new(),
        }
    }

    /// Adds what else is known, e.g. the kernel's message.
    #[must_use]
    pub fn with_detail(mut self, detail: &str) -> Self {
        if !detail.is_empty() {
            self.detail = format!(" ({detail})");
        }
        self
    }

    /// The raw errno, if the error came from the kernel.
    pub fn errno(&self) -> Option<i32> {
        self.source.raw_os_error()
    }

    /// Whether the error says the path does not exist.
    pub fn is_not_found(&self) -> bool {
        self.errno() == Some(libc::ENOENT)
    }
}

/// Result of an OS call.
pub type SysResult<T> = Result<T, SysError>;

/// Per-mount attributes the kernel enforces (the new mount API's `MOUNT_ATTR_*`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MountAttrs {
    /// Read-only mount.
    pub read_only: bool,
    /// Ignore set-user/group-id bits.
    pub nosuid: bool,
    /// Do not interpret device nodes.
    pub nodev: bool,
    /// Do not allow execution.
    pub noexec: bool,
    /// Access time policy.
    pub atime: Atime,
    /// Do not update directory access times.
    pub nodiratime: bool,
}

/// Access-time update policy of a mount.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Atime {
    /// The kernel default (relatime).
    #[default]
    Relative,
    /// Never update access times.
    None,
    /// Always update access times.
    Strict,
}

/// A filesystem mount of a block device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FsMount {
    /// The block device.
    pub device: PathBuf,
    /// Where to mount it (a directory under the kubelet dir).
    pub target: PathBuf,
    /// Filesystem type, e.g. "ext4".
    pub fs_type: String,
    /// Per-mount attributes.
    pub attrs: MountAttrs,
    /// Filesystem options (`key` or `key=value`), already validated.
    pub options: Vec<String>,
    /// Mount the superblock read-only (not only this mount).
    pub sb_read_only: bool,
}

/// A bind mount of a directory or a file (a staged filesystem, or a device node).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BindMount {
    /// What to bind.
    pub source: PathBuf,
    /// Where (an existing directory or file under the kubelet dir).
    pub target: PathBuf,
    /// Attributes applied to the new mount before it becomes visible.
    pub attrs: MountAttrs,
}

/// What a path is, as far as mounts go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MountState {
    /// Nothing at the path.
    Absent,
    /// A directory, file or other object that is not the root of a mount.
    NotMounted {
        /// Whether it is a directory.
        is_dir: bool,
    },
    /// The root of a mount.
    Mounted(MountPoint),
    /// The mount is there but unusable (ENOTCONN, ESTALE, EIO, EHOSTDOWN, ...).
    Corrupted {
        /// The errno the kernel gave.
        errno: i32,
    },
}

/// What statx says of a mount root.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MountPoint {
    /// The kernel's unique mount id.
    pub mount_id: u64,
    /// Device of the mounted filesystem (major, minor).
    pub dev: (u32, u32),
    /// For a bind-mounted device node: the device it stands for.
    pub rdev: Option<(u32, u32)>,
    /// Whether the root is a directory.
    pub is_dir: bool,
    /// Whether the mount is read-only.
    pub read_only: bool,
}

/// A block device as opened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockDevice {
    /// Its device number (major, minor).
    pub rdev: (u32, u32),
    /// Size in bytes.
    pub size: u64,
}

/// A block device held open from the check of its identity until the engine is done with it,
/// so that the device it reads, formats and mounts is the one it checked.
///
/// While the descriptor is open the kernel keeps the device as it is: a loop device asked to
/// detach is only detached when its last opener closes it, so it cannot be bound to another
/// file in between. [`HeldDevice::handle`] names this open descriptor (`/proc/<pid>/fd/<n>`),
/// not whatever the device's path names by then; tools and reads go through it.
#[derive(Debug)]
pub struct HeldDevice {
    /// Its device number (major, minor).
    pub rdev: (u32, u32),
    /// Size in bytes.
    pub size: u64,
    /// A path that names the held descriptor itself (for reads and tools).
    pub handle: PathBuf,
    /// The kernel's own node of the device (`/dev/<name>`, whose number is fixed by the
    /// kernel): what a mount names as its source, so the mount table shows a device path.
    pub node: PathBuf,
    /// The descriptor (none in the fake).
    _fd: Option<std::os::fd::OwnedFd>,
}

impl HeldDevice {
    /// A held device: `fd` is the open descriptor behind `handle`.
    pub fn new(
        dev: BlockDevice,
        handle: PathBuf,
        node: PathBuf,
        fd: Option<std::os::fd::OwnedFd>,
    ) -> Self {
        Self {
            rdev: dev.rdev,
            size: dev.size,
            handle,
            node,
            _fd: fd,
        }
    }

    /// Its number and size.
    pub fn block(&self) -> BlockDevice {
        BlockDevice {
            rdev: self.rdev,
            size: self.size,
        }
    }
}

/// A path below the kubelet dir resolved once (without symlinks, as every resolution is) and
/// held, so that a later call acts on the object it named then, not on whatever the path names
/// by then. [`Os::mount_state_held`] holds a mount root: [`Os::bind_held`] clones that very
/// mount, and fails if it has been unmounted since (the kernel clones no mount outside the
/// namespace's tree), so a mount put on the path after the check is never bound.
/// [`Os::make_dir_held`] holds the new directory's parent: [`Os::bind_held`] opens the target
/// by its one name in it (no symlink followed), the entry it made. [`Os::hold_parent`] holds
/// a path's parent for an unmount: [`Os::mount_state_in`], [`Os::unmount_held`] and
/// [`Os::remove_held`] each look the last component up in that very directory, so a directory
/// renamed into the path after the check is never what is unmounted or removed. Held only
/// within one call: the descriptor pins the mount it names.
#[derive(Debug)]
pub struct Held {
    /// The path it was resolved from.
    pub path: PathBuf,
    /// The fake's record of what was resolved: the mount id of a mount root.
    pub mount_id: Option<u64>,
    /// The descriptor (none in the fake).
    fd: Option<std::os::fd::OwnedFd>,
}

impl Held {
    /// `fd`, resolved from `path`; `mount_id` for a mount root.
    pub fn new(path: PathBuf, mount_id: Option<u64>, fd: Option<std::os::fd::OwnedFd>) -> Self {
        Self { path, mount_id, fd }
    }

    /// The descriptor, if this is the real OS's.
    pub fn fd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        std::os::fd::AsFd::as_fd(self.fd.as_ref()?).into()
    }
}

/// The file behind a loop device, and the filesystem that holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackingStore {
    /// The backing file, as the kernel names it.
    pub file: PathBuf,
    /// The file was unlinked since the loop device was bound to it.
    pub deleted: bool,
    /// What the file's filesystem says of itself; None when this process cannot see the file
    /// (it lives outside this container's mounts: the controller's data dir).
    pub fs: Option<BackingFs>,
}

/// What the filesystem holding a backing file says of itself (statvfs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackingFs {
    /// It answered: mounted read-only or not, with this many bytes left to unprivileged
    /// writers.
    Answers {
        /// Mounted read-only.
        read_only: bool,
        /// Bytes left.
        available_bytes: u64,
    },
    /// It failed with this errno (EIO, ENOTCONN, ESTALE: the disk or the share is gone).
    Fails(i32),
}

/// Usage of a mounted filesystem.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FsUsage {
    /// Total bytes.
    pub total_bytes: u64,
    /// Bytes available to unprivileged users.
    pub available_bytes: u64,
    /// Bytes used.
    pub used_bytes: u64,
    /// Total inodes.
    pub total_inodes: u64,
    /// Free inodes.
    pub free_inodes: u64,
    /// Used inodes.
    pub used_inodes: u64,
}

/// An external tool run: mkfs, resize2fs, xfs_growfs, btrfs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolRun {
    /// Program name or path.
    pub program: String,
    /// Arguments.
    pub args: Vec<String>,
    /// How long it may take before it is killed.
    pub deadline: Duration,
}

/// Why a tool run failed.
#[derive(Debug, thiserror::Error)]
pub enum ToolError {
    /// The program could not be started.
    #[error("cannot run {program}: {source}")]
    Spawn {
        /// The program.
        program: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// It ran past its deadline and was killed.
    #[error("{program} did not finish within {deadline:?} and was killed")]
    Timeout {
        /// The program.
        program: String,
        /// The deadline it missed.
        deadline: Duration,
    },
    /// It exited with a failure.
    #[error("{program} failed ({status}): {stderr}")]
    Failed {
        /// The program.
        program: String,
        /// Its exit code, when it exited (not killed by a signal).
        code: Option<i32>,
        /// Exit status as text.
        status: String,
        /// What it printed on stdout and stderr (trimmed).
        stderr: String,
    },
    /// Waiting for it failed.
    #[error("waiting for {program}: {source}")]
    Wait {
        /// The program.
        program: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

/// The kernel and tools, as the node engine uses them.
///
/// Paths handed to the mutating calls lie under the kubelet dir (the engine checks that
/// before calling); implementations must not follow symlinks below it.
pub trait Os: Send + Sync + 'static {
    /// What is at `path`: nothing, an unmounted object, a mount root, or a corrupted mount.
    fn mount_state(&self, path: &Path) -> SysResult<MountState>;
    /// The whole mount table of moor's mount namespace, read once (for reconciliation).
    fn mount_table(&self) -> SysResult<Vec<mount_table::MountEntry>>;
    /// Mounts a block device's filesystem on an existing directory.
    fn mount_fs(&self, m: &FsMount) -> SysResult<()>;
    /// Bind-mounts `source` on the existing `target`, with `attrs` applied atomically: an
    /// [`Os::bind_held`] that holds nothing, the same for every implementation.
    fn bind(&self, b: &BindMount) -> SysResult<()> {
        self.bind_held(b, None, None)
    }
    /// [`Os::mount_state`], holding the mount root it resolved (see [`Held`]) when the state
    /// is [`MountState::Mounted`].
    fn mount_state_held(&self, path: &Path) -> SysResult<(MountState, Option<Held>)>;
    /// [`Os::make_dir`], holding the parent it resolved (see [`Held`]).
    fn make_dir_held(&self, path: &Path) -> SysResult<Held>;
    /// [`Os::bind`], without resolving again what is held: the mount `source` holds (else
    /// `b.source`), on the entry named by `b.target`'s last component in the directory
    /// `parent` holds (else `b.target`).
    fn bind_held(
        &self,
        b: &BindMount,
        source: Option<&Held>,
        parent: Option<&Held>,
    ) -> SysResult<()>;
    /// Resolves the parent of `path` once and holds it (see [`Held`]), for the calls that
    /// take `parent`; None when there is no such directory (nor anything at `path`).
    fn hold_parent(&self, path: &Path) -> SysResult<Option<Held>>;
    /// [`Os::mount_state`] of `path`'s last component in the directory `parent` holds, not
    /// resolved again.
    fn mount_state_in(&self, path: &Path, parent: &Held) -> SysResult<MountState>;
    /// Unmounts the mount at `target`; `detach` makes it lazy (for corrupted mounts): an
    /// [`Os::unmount_held`] that holds nothing, the same for every implementation.
    fn unmount(&self, target: &Path, detach: bool) -> SysResult<()> {
        self.unmount_held(target, detach, None)
    }
    /// [`Os::unmount`] of the last component of `target` in the directory `parent` holds
    /// (else `target`'s parent, resolved).
    fn unmount_held(&self, target: &Path, detach: bool, parent: Option<&Held>) -> SysResult<()>;
    /// Creates a directory (parents must exist), mode 0750. Existing directory: Ok.
    fn make_dir(&self, path: &Path) -> SysResult<()>;
    /// Creates an empty regular file, mode 0640. Existing file: Ok.
    fn make_file(&self, path: &Path) -> SysResult<()>;
    /// Removes an empty directory or a file, without following symlinks. Absent: Ok. An
    /// [`Os::remove_held`] that holds nothing, the same for every implementation.
    fn remove(&self, path: &Path) -> SysResult<()> {
        self.remove_held(path, None)
    }
    /// [`Os::remove`] of the last component of `path` in the directory `parent` holds (else
    /// `path`'s parent, resolved).
    fn remove_held(&self, path: &Path, parent: Option<&Held>) -> SysResult<()>;
    /// Opens a block device and reports its number and size.
    fn block_device(&self, path: &Path) -> SysResult<BlockDevice>;
    /// Opens a block device and keeps it open (see [`HeldDevice`]).
    fn hold_device(&self, path: &Path) -> SysResult<HeldDevice>;
    /// Proves that nothing holds the device exclusively (a mount, another mkfs, a
    /// device-mapper table): opens it with O_EXCL and closes it again. EBUSY: in use.
    fn check_unclaimed(&self, dev: &HeldDevice) -> SysResult<()>;
    /// Reads from a block device at `offset`; returns how many bytes were read (fewer only at
    /// the device's end). When `buf`, its length and `offset` are all multiples of
    /// [`DIRECT_ALIGN`] the read may bypass the page cache (O_DIRECT).
    fn read_device(&self, path: &Path, offset: u64, buf: &mut [u8]) -> SysResult<usize>;
    /// Usage of the filesystem mounted at `path`.
    fn fs_usage(&self, path: &Path) -> SysResult<FsUsage>;
    /// How many errors the mounted filesystem of device `dev` has recorded since it was last
    /// checked (ext2/3/4's `errors_count` in sysfs, which e2fsck clears), or None when it keeps
    /// no such count (another filesystem). Reads sysfs only: never waits for the device.
    fn fs_errors(&self, dev: (u32, u32)) -> SysResult<Option<u64>>;
    /// For a loop device `dev`, its backing file and the state of the filesystem that holds it
    /// (sysfs, then statvfs of the file); None for any other device. For NodeGetStorageHealth.
    fn backing_store(&self, dev: (u32, u32)) -> SysResult<Option<BackingStore>>;
    /// The devices the device-mapper device `dev` sits on (sysfs `slaves/`), by number; empty
    /// for a device that sits on none. For a dm-crypt mapping: the LUKS device under it.
    fn devices_under(&self, dev: (u32, u32)) -> SysResult<Vec<(u32, u32)>>;
    /// Gives the filesystem mounted at `path` to group `gid` as kubelet gives a volume to a
    /// pod's fsGroup (see [`ownership`]), unless its root already has the group and setgid;
    /// stops at `deadline`.
    fn share_with_group(
        &self,
        path: &Path,
        gid: u32,
        deadline: Duration,
    ) -> Result<GroupReport, OwnershipError>;
    /// Whether the kernel has SELinux, which the `context=` mount options need.
    fn selinux(&self) -> bool;
    /// Whether the loaded SELinux policy knows `label` (a mount of a label it does not know is
    /// refused); true where that cannot be asked.
    fn selinux_label_known(&self, label: &str) -> bool;
    /// Reads a cgroup control file (`io.max`, `blkio.throttle.*`, `cgroup.controllers`), for
    /// a volume's QoS limits in its pod's cgroup.
    fn read_cgroup(&self, path: &Path) -> SysResult<String>;
    /// Writes `line` to an existing cgroup control file in one write, as the kernel parses
    /// it (EINVAL: the kernel refuses the line).
    fn write_cgroup(&self, path: &Path, line: &str) -> SysResult<()>;
    /// Runs a tool to completion within its deadline.
    fn run_tool(&self, run: &ToolRun) -> Result<(), ToolError>;
    /// Runs a tool that reads a key on its standard input (cryptsetup's `--key-file=-`): the
    /// key is written to a pipe, never to argv, the environment or a file. What the tool
    /// prints is in the error as with [`run_tool`](Self::run_tool); the key never is.
    fn run_tool_with_key(&self, run: &ToolRun, key: &[u8]) -> Result<(), ToolError>;
    /// Whether a program is on the PATH.
    fn has_program(&self, program: &str) -> bool;
    /// Compares the block device `rdev` with a volume's identity (a loop device's backing
    /// file, a disk's serial or WWN).
    fn identify(&self, rdev: (u32, u32), want: &DeviceIdentity) -> Verdict;
    /// Finds the block device with identity `want`; when it is not attached yet, waits up to
    /// `wait` for it to appear (zero: look once). Blocks the calling thread.
    fn find_device(
        &self,
        want: &DeviceIdentity,
        wait: Duration,
    ) -> Result<FoundDevice, DiscoveryError>;
}

/// A random (version 4) UUID, hyphenated, from the kernel's random source.
pub fn random_uuid() -> SysResult<String> {
    let mut b = [0u8; 16];
    let mut filled = 0;
    while filled < b.len() {
        let rest = b.get_mut(filled..).unwrap_or_default();
        match rustix::rand::getrandom(rest, rustix::rand::GetRandomFlags::empty()) {
            Ok(n) => filled += n,
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(SysError::new("getrandom", Path::new(""), e)),
        }
    }
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let hex: String = b.iter().map(|x| format!("{x:02x}")).collect();
    Ok(format!(
        "{}-{}-{}-{}-{}",
        &hex[..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..]
    ))
}

/// What opening a volume's recorded device says about it.
#[derive(Debug)]
pub enum Presence {
    /// The device is there, with the recorded number.
    Present(BlockDevice),
    /// The device is gone: its path names nothing (ENOENT, ENXIO, ENODEV), or names another
    /// device now.
    Gone(String),
    /// It could not be told (any other error, or a size of 0): the device may be fine. Reported
    /// abnormal, tried again later, never acted on.
    Unknown(String),
}

/// Whether errno `e` from opening a device means the device is not there.
pub fn is_gone_errno(e: i32) -> bool {
    matches!(e, libc::ENOENT | libc::ENXIO | libc::ENODEV)
}

/// The one answer to "is this volume's device gone": the engine, reconciliation and
/// `moorctl status` all ask here. Only a device that the kernel says is not there, or whose
/// path now names another device number, is gone; a transient error (EMFILE, EIO, ENOMEM,
/// EINTR, ...) or a size of 0 is unknown.
pub fn device_presence<O: Os + ?Sized>(os: &O, path: &Path, rdev: (u32, u32)) -> Presence {
    presence_of(path, rdev, os.block_device(path))
}

/// [`device_presence`] from what opening the device at `path` gave (for a caller without an
/// [`Os`], such as `moorctl status`, which opens it with [`linux::block_device`]).
pub fn presence_of(path: &Path, rdev: (u32, u32), opened: SysResult<BlockDevice>) -> Presence {
    match opened {
        Ok(d) if d.rdev != rdev => Presence::Gone(format!(
            "{} is now device {}:{}, not {}:{}",
            path.display(),
            d.rdev.0,
            d.rdev.1,
            rdev.0,
            rdev.1
        )),
        Ok(d) if d.size == 0 => Presence::Unknown(format!("{} reads as 0 bytes", path.display())),
        Ok(d) => Presence::Present(d),
        Err(e) if e.errno().is_some_and(is_gone_errno) => Presence::Gone(e.to_string()),
        Err(e) => Presence::Unknown(e.to_string()),
    }
}

/// Errnos that mean "a mount is there but broken".
pub fn is_corruption_errno(errno: i32) -> bool {
    matches!(
        errno,
        libc::ENOTCONN | libc::ESTALE | libc::EIO | libc::EHOSTDOWN | libc::ENXIO | libc::ENODEV
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pool_keeps_at_most_its_share_of_buffers() {
        let pool = BufPool::new(8192, 1);
        {
            let mut a = pool.take();
            let mut b = pool.take();
            assert_eq!(a.as_mut_slice().len(), 8192);
            assert_eq!(b.as_mut_slice().len(), 8192);
            assert_eq!(
                a.as_mut_slice().as_ptr() as usize % DIRECT_ALIGN,
                0,
                "aligned"
            );
        }
        assert_eq!(pool.idle(), 1, "the second buffer back is dropped");
        let mut again = pool.take();
        assert_eq!(pool.idle(), 0);
        again.as_mut_slice()[0] = 7;
        drop(again);
        // The kept buffer is handed out again, as it was left.
        assert_eq!(pool.take().as_mut_slice()[0], 7);
    }
}
