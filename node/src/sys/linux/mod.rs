//! The real [`Os`]: syscalls through rustix, mounts through the new mount API.
//!
//! Every path below the kubelet dir is resolved with `openat2(RESOLVE_BENEATH |
//! RESOLVE_NO_SYMLINKS)` from a descriptor of the kubelet dir opened at start, and mounts are
//! attached by descriptor with `move_mount`, so a symlink planted anywhere below the kubelet
//! dir can never redirect a mount, a mkdir or a removal elsewhere.

use std::ffi::OsStr;
use std::os::fd::{AsFd as _, AsRawFd as _, OwnedFd};
use std::os::unix::ffi::OsStrExt as _;
use std::path::{Component, Path, PathBuf};
use std::time::{Duration, Instant};

use rustix::fs::{
    AtFlags, CWD, FileType, Mode, OFlags, ResolveFlags, StatVfsMountFlags, StatxAttributes,
    StatxFlags,
};
use rustix::io::Errno;
use rustix::mount::{
    FsMountFlags, FsOpenFlags, MountAttrFlags, MoveMountFlags, OpenTreeFlags, UnmountFlags,
};

use super::mount_table::{self, MountEntry};
use super::ownership::{self, GroupReport, OwnershipError};
use super::raw::{self, MountAttr};
use super::{
    Atime, BackingFs, BackingStore, BindMount, BlockDevice, DIRECT_ALIGN, FsMount, FsUsage, Held,
    HeldDevice, MountAttrs, MountPoint, MountState, Os, SysError, SysResult, ToolError, ToolRun,
    is_corruption_errno,
};
use super::{selinux, spawn};
use crate::sys::discovery::{self, DeviceIdentity, DiscoveryError, FoundDevice, Verdict};

/// `STATX_MNT_ID_UNIQUE` (Linux 6.8): a mount id that is never reused.
const STATX_MNT_ID_UNIQUE: u32 = 0x4000;

/// Directories searched for tools besides `$PATH` (a container's PATH may lack the sbin dirs).
const TOOL_DIRS: [&str; 4] = ["/usr/sbin", "/sbin", "/usr/bin", "/bin"];

/// The real operating system.
#[derive(Debug)]
pub struct Linux {
    root: OwnedFd,
    root_path: PathBuf,
}

impl Linux {
    /// Opens the kubelet dir, below which every mutating call works.
    pub fn new(kubelet_dir: &Path) -> SysResult<Self> {
        let root = rustix::fs::open(
            kubelet_dir,
            OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| SysError::new("open kubelet dir", kubelet_dir, e))?;
        Ok(Self {
            root,
            root_path: kubelet_dir.to_path_buf(),
        })
    }

    /// The part of `path` below the kubelet dir ("." for the dir itself).
    fn relative<'p>(&self, step: &'static str, path: &'p Path) -> SysResult<&'p Path> {
        let rel = path.strip_prefix(&self.root_path).map_err(|_| {
            SysError::new(step, path, std::io::Error::from_raw_os_error(libc::EXDEV))
        })?;
        if rel.components().any(|c| !matches!(c, Component::Normal(_))) {
            return Err(SysError::new(step, path, Errno::INVAL));
        }
        Ok(if rel.as_os_str().is_empty() {
            Path::new(".")
        } else {
            rel
        })
    }

    /// Opens `path` (below the kubelet dir) without following any symlink.
    fn open_beneath(&self, step: &'static str, path: &Path, flags: OFlags) -> SysResult<OwnedFd> {
        let rel = self.relative(step, path)?;
        rustix::fs::openat2(
            &self.root,
            rel,
            flags | OFlags::CLOEXEC | OFlags::NOFOLLOW,
            Mode::empty(),
            ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS,
        )
        .map_err(|e| SysError::new(step, path, e))
    }

    /// Opens the parent of `path` and returns it with the last component.
    fn open_parent<'p>(
        &self,
        step: &'static str,
        path: &'p Path,
    ) -> SysResult<(OwnedFd, &'p OsStr)> {
        let name = path
            .file_name()
            .ok_or_else(|| SysError::new(step, path, Errno::INVAL))?;
        let parent = path
            .parent()
            .ok_or_else(|| SysError::new(step, path, Errno::INVAL))?;
        let fd = self.open_beneath(step, parent, OFlags::PATH | OFlags::DIRECTORY)?;
        Ok((fd, name))
    }

    /// Opens a mount source: below the kubelet dir without symlinks, elsewhere (a device
    /// node under /dev) as given.
    fn open_source(&self, path: &Path) -> SysResult<OwnedFd> {
        if path.starts_with(&self.root_path) {
            let fd = self.open_beneath("open bind source", path, OFlags::PATH)?;
            rustix::mount::open_tree(
                &fd,
                "",
                OpenTreeFlags::OPEN_TREE_CLONE
                    | OpenTreeFlags::OPEN_TREE_CLOEXEC
                    | OpenTreeFlags::AT_EMPTY_PATH,
            )
        } else {
            rustix::mount::open_tree(
                CWD,
                path,
                OpenTreeFlags::OPEN_TREE_CLONE
                    | OpenTreeFlags::OPEN_TREE_CLOEXEC
                    | OpenTreeFlags::AT_SYMLINK_NOFOLLOW,
            )
        }
        .map_err(|e| SysError::new("open_tree", path, e))
    }

    /// Clones the mount to bind: the one `held` holds, else `source` resolved.
    fn source_tree(&self, source: &Path, held: Option<&Held>) -> SysResult<OwnedFd> {
        let Some(fd) = held.and_then(Held::fd) else {
            return self.open_source(source);
        };
        // The held mount root itself: if it was unmounted since it was checked, the kernel
        // refuses to clone it (EINVAL) rather than bind whatever the path names now.
        rustix::mount::open_tree(
            fd,
            "",
            OpenTreeFlags::OPEN_TREE_CLONE
                | OpenTreeFlags::OPEN_TREE_CLOEXEC
                | OpenTreeFlags::AT_EMPTY_PATH,
        )
        .map_err(|e| SysError::new("open_tree", source, e))
    }

    /// Opens the mount target: by its last component in the held `parent` (the directory
    /// this call made it in), else resolved from the kubelet dir.
    fn open_target(&self, target: &Path, parent: Option<&Held>) -> SysResult<OwnedFd> {
        let step = "open mount target";
        match held_dir(step, target, parent)? {
            Some((dir, name)) => open_in(step, dir, name, target),
            None => self.open_beneath(step, target, OFlags::PATH),
        }
    }

    /// Attaches the detached mount `mnt` on `target`, by descriptor.
    fn attach(&self, mnt: &OwnedFd, target: &Path) -> SysResult<()> {
        self.attach_in(mnt, target, None)
    }

    /// [`Linux::attach`], the target opened as [`Linux::open_target`] does.
    fn attach_in(&self, mnt: &OwnedFd, target: &Path, parent: Option<&Held>) -> SysResult<()> {
        let target_fd = self.open_target(target, parent)?;
        rustix::mount::move_mount(
            mnt,
            "",
            &target_fd,
            "",
            MoveMountFlags::MOVE_MOUNT_F_EMPTY_PATH | MoveMountFlags::MOVE_MOUNT_T_EMPTY_PATH,
        )
        .map_err(|e| SysError::new("move_mount", target, e))
    }
}

/// The descriptor `parent` holds and `path`'s last component, which is looked up in it; an
/// error when `path`'s parent is not the directory held. None when nothing is held.
fn held_dir<'h, 'p>(
    step: &'static str,
    path: &'p Path,
    parent: Option<&'h Held>,
) -> SysResult<Option<(std::os::fd::BorrowedFd<'h>, &'p OsStr)>> {
    let Some((held, dir)) = parent.and_then(|h| Some((h, h.fd()?))) else {
        return Ok(None);
    };
    let name = path
        .file_name()
        .filter(|_| path.parent() == Some(held.path.as_path()))
        .ok_or_else(|| SysError::new(step, path, Errno::INVAL))?;
    Ok(Some((dir, name)))
}

/// Opens `name` in the directory `dir` (O_PATH), following no symlink: `path` is what it names,
/// for errors.
fn open_in(
    step: &'static str,
    dir: std::os::fd::BorrowedFd<'_>,
    name: &OsStr,
    path: &Path,
) -> SysResult<OwnedFd> {
    rustix::fs::openat2(
        dir,
        name,
        OFlags::PATH | OFlags::CLOEXEC | OFlags::NOFOLLOW,
        Mode::empty(),
        ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS,
    )
    .map_err(|e| SysError::new(step, path, e))
}

/// What an opened path is (see [`state_of`]), and its descriptor for a mount root: nothing
/// when the open found nothing, a corrupted mount when it failed as one does.
fn state_after_open(
    opened: SysResult<OwnedFd>,
    path: &Path,
) -> SysResult<(MountState, Option<OwnedFd>)> {
    let fd = match opened {
        Ok(fd) => fd,
        Err(e) if e.is_not_found() => return Ok((MountState::Absent, None)),
        Err(e) => match e.errno() {
            Some(errno) if is_corruption_errno(errno) => {
                return Ok((MountState::Corrupted { errno }, None));
            }
            _ => return Err(e),
        },
    };
    let state = state_of(&fd, path)?;
    let fd = matches!(state, MountState::Mounted(_)).then_some(fd);
    Ok((state, fd))
}

/// The new mount API's attribute bits for `attrs`.
fn attr_bits(attrs: &MountAttrs) -> u64 {
    let mut bits = 0;
    if attrs.read_only {
        bits |= raw::MOUNT_ATTR_RDONLY;
    }
    if attrs.nosuid {
        bits |= raw::MOUNT_ATTR_NOSUID;
    }
    if attrs.nodev {
        bits |= raw::MOUNT_ATTR_NODEV;
    }
    if attrs.noexec {
        bits |= raw::MOUNT_ATTR_NOEXEC;
    }
    if attrs.nodiratime {
        bits |= raw::MOUNT_ATTR_NODIRATIME;
    }
    bits |= match attrs.atime {
        Atime::Relative => 0,
        Atime::None => raw::MOUNT_ATTR_NOATIME,
        Atime::Strict => raw::MOUNT_ATTR_STRICTATIME,
    };
    bits
}

/// Reads the messages the kernel left on an fs context descriptor (`e ...`, `w ...`).
fn fs_context_messages(fs_fd: &OwnedFd) -> String {
    let mut out = Vec::new();
    let mut buf = [0u8; 512];
    for _ in 0..8 {
        match rustix::io::read(fs_fd, &mut buf) {
            Ok(n) if n > 0 => {
                if !out.is_empty() {
                    out.push(b';');
                    out.push(b' ');
                }
                out.extend_from_slice(buf.get(..n).unwrap_or_default());
            }
            _ => break,
        }
    }
    String::from_utf8_lossy(&out).trim().to_string()
}

/// What the object `fd` (resolved from `path`) is, as far as mounts go.
fn state_of(fd: &OwnedFd, path: &Path) -> SysResult<MountState> {
    let stx = match rustix::fs::statx(
        fd,
        "",
        AtFlags::EMPTY_PATH | AtFlags::SYMLINK_NOFOLLOW,
        StatxFlags::TYPE | StatxFlags::from_bits_retain(STATX_MNT_ID_UNIQUE),
    ) {
        Ok(stx) => stx,
        Err(e) if is_corruption_errno(e.raw_os_error()) => {
            return Ok(MountState::Corrupted {
                errno: e.raw_os_error(),
            });
        }
        Err(e) => return Err(SysError::new("statx", path, e)),
    };
    let file_type = FileType::from_raw_mode(stx.stx_mode.into());
    let is_dir = file_type == FileType::Directory;
    let mount_root = stx
        .stx_attributes_mask
        .contains(StatxAttributes::MOUNT_ROOT)
        && stx.stx_attributes.contains(StatxAttributes::MOUNT_ROOT);
    if !mount_root {
        return Ok(MountState::NotMounted { is_dir });
    }
    let read_only = match rustix::fs::fstatvfs(fd) {
        Ok(vfs) => vfs.f_flag.contains(StatVfsMountFlags::RDONLY),
        Err(e) if is_corruption_errno(e.raw_os_error()) => {
            return Ok(MountState::Corrupted {
                errno: e.raw_os_error(),
            });
        }
        Err(e) => return Err(SysError::new("statvfs", path, e)),
    };
    let rdev = (file_type == FileType::BlockDevice)
        .then(|| dev_pair(stx.stx_rdev_major, stx.stx_rdev_minor));
    Ok(MountState::Mounted(MountPoint {
        mount_id: stx.stx_mnt_id,
        dev: dev_pair(stx.stx_dev_major, stx.stx_dev_minor),
        rdev,
        is_dir,
        read_only,
    }))
}

fn dev_pair(major: u32, minor: u32) -> (u32, u32) {
    (major, minor)
}

impl Os for Linux {
    fn mount_state(&self, path: &Path) -> SysResult<MountState> {
        self.mount_state_held(path).map(|(state, _)| state)
    }

    fn mount_state_held(&self, path: &Path) -> SysResult<(MountState, Option<Held>)> {
        let opened = self.open_beneath("open", path, OFlags::PATH);
        let (state, fd) = state_after_open(opened, path)?;
        Ok((
            state,
            fd.map(|fd| Held::new(path.to_path_buf(), None, Some(fd))),
        ))
    }

    fn hold_parent(&self, path: &Path) -> SysResult<Option<Held>> {
        match self.open_parent("open parent", path) {
            Ok((fd, _)) => {
                let dir = path.parent().unwrap_or(path).to_path_buf();
                Ok(Some(Held::new(dir, None, Some(fd))))
            }
            Err(e) if e.is_not_found() => Ok(None),
            Err(e) => Err(e),
        }
    }

    fn mount_state_in(&self, path: &Path, parent: &Held) -> SysResult<MountState> {
        let opened = match held_dir("open", path, Some(parent))? {
            Some((dir, name)) => open_in("open", dir, name, path),
            None => self.open_beneath("open", path, OFlags::PATH),
        };
        // The descriptor of a mount root is closed here: held, it would make the mount busy.
        state_after_open(opened, path).map(|(state, _)| state)
    }
    fn mount_table(&self) -> SysResult<Vec<MountEntry>> {
        mount_table::read().map(|(t, _)| t).map_err(|e| {
            SysError::new(
                "read mount table",
                Path::new("/proc/thread-self/mountinfo"),
                std::io::Error::other(e.to_string()),
            )
        })
    }

    fn mount_fs(&self, m: &FsMount) -> SysResult<()> {
        let fs_fd = rustix::mount::fsopen(m.fs_type.as_str(), FsOpenFlags::FSOPEN_CLOEXEC)
            .map_err(|e| SysError::new("fsopen", &m.target, e))?;
        let fail = |step: &'static str, e: Errno| {
            SysError::new(step, &m.device, e).with_detail(&fs_context_messages(&fs_fd))
        };
        rustix::mount::fsconfig_set_string(&fs_fd, "source", m.device.as_os_str())
            .map_err(|e| fail("fsconfig source", e))?;
        for opt in &m.options {
            match opt.split_once('=') {
                Some((k, v)) => rustix::mount::fsconfig_set_string(&fs_fd, k, v),
                None => rustix::mount::fsconfig_set_flag(&fs_fd, opt.as_str()),
            }
            .map_err(|e| fail("fsconfig option", e))?;
        }
        if m.sb_read_only {
            rustix::mount::fsconfig_set_flag(&fs_fd, "ro").map_err(|e| fail("fsconfig ro", e))?;
        }
        rustix::mount::fsconfig_create(&fs_fd).map_err(|e| fail("fsconfig create", e))?;
        let attrs = MountAttrFlags::from_bits_retain(attr_bits(&m.attrs) as u32);
        let mnt = rustix::mount::fsmount(&fs_fd, FsMountFlags::FSMOUNT_CLOEXEC, attrs)
            .map_err(|e| fail("fsmount", e))?;
        self.attach(&mnt, &m.target)
    }

    fn bind_held(
        &self,
        b: &BindMount,
        source: Option<&Held>,
        parent: Option<&Held>,
    ) -> SysResult<()> {
        let tree = self.source_tree(&b.source, source)?;
        let set = attr_bits(&b.attrs);
        if set != 0 {
            let attr = MountAttr {
                attr_set: set,
                attr_clr: if set & raw::MOUNT_ATTR_ATIME_MASK != 0 {
                    raw::MOUNT_ATTR_ATIME_MASK
                } else {
                    0
                },
                ..MountAttr::default()
            };
            raw::mount_setattr_fd(&tree, &attr)
                .map_err(|e| SysError::new("mount_setattr", &b.source, e))?;
        }
        self.attach_in(&tree, &b.target, parent)
    }

    fn unmount_held(&self, target: &Path, detach: bool, parent: Option<&Held>) -> SysResult<()> {
        // Resolve the parent without symlinks (or take the one held) and unmount the last
        // component through the parent descriptor's magic link with UMOUNT_NOFOLLOW: a symlink
        // swapped in anywhere cannot redirect the unmount. (A descriptor of the target itself
        // would pin the mount and make it busy.)
        let step = "open unmount target";
        let resolved;
        let (dir, name) = match held_dir(step, target, parent)? {
            Some(held) => held,
            None => {
                let (fd, name) = self.open_parent(step, target)?;
                resolved = fd;
                (resolved.as_fd(), name)
            }
        };
        let mut proc_path = format!("/proc/self/fd/{}/", dir.as_raw_fd()).into_bytes();
        proc_path.extend_from_slice(name.as_bytes());
        let mut flags = UnmountFlags::NOFOLLOW;
        if detach {
            flags |= UnmountFlags::DETACH;
        }
        rustix::mount::unmount(OsStr::from_bytes(&proc_path), flags)
            .map_err(|e| SysError::new("umount2", target, e))
    }

    fn make_dir(&self, path: &Path) -> SysResult<()> {
        self.make_dir_held(path).map(drop)
    }

    fn make_dir_held(&self, path: &Path) -> SysResult<Held> {
        let (parent, name) = self.open_parent("open parent", path)?;
        let made = match rustix::fs::mkdirat(&parent, name, Mode::from_raw_mode(0o750)) {
            Ok(()) => Ok(()),
            Err(Errno::EXIST) => {
                let st = rustix::fs::statat(&parent, name, AtFlags::SYMLINK_NOFOLLOW)
                    .map_err(|e| SysError::new("stat", path, e))?;
                if FileType::from_raw_mode(st.st_mode) == FileType::Directory {
                    Ok(())
                } else {
                    Err(SysError::new("mkdir", path, Errno::NOTDIR))
                }
            }
            Err(e) => Err(SysError::new("mkdir", path, e)),
        };
        made?;
        let dir = path.parent().unwrap_or(path).to_path_buf();
        Ok(Held::new(dir, None, Some(parent)))
    }

    fn make_file(&self, path: &Path) -> SysResult<()> {
        let (parent, name) = self.open_parent("open parent", path)?;
        rustix::fs::openat(
            &parent,
            name,
            OFlags::CREATE | OFlags::WRONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::from_raw_mode(0o640),
        )
        .map(drop)
        .map_err(|e| SysError::new("create file", path, e))
    }

    fn remove_held(&self, path: &Path, parent: Option<&Held>) -> SysResult<()> {
        let step = "open parent";
        let resolved;
        let (dir, name) = match held_dir(step, path, parent)? {
            Some(held) => held,
            None => match self.open_parent(step, path) {
                Ok((fd, name)) => {
                    resolved = fd;
                    (resolved.as_fd(), name)
                }
                Err(e) if e.is_not_found() => return Ok(()),
                Err(e) => return Err(e),
            },
        };
        // A directory (a mount's target) is the usual case; anything else (a block volume's
        // file, a symlink, never followed) is not a directory to rmdir, and is unlinked.
        let removed = match rustix::fs::unlinkat(dir, name, AtFlags::REMOVEDIR) {
            Err(Errno::NOTDIR) => rustix::fs::unlinkat(dir, name, AtFlags::empty()),
            other => other,
        };
        match removed {
            Ok(()) | Err(Errno::NOENT) => Ok(()),
            Err(e) => Err(SysError::new("remove", path, e)),
        }
    }

    fn block_device(&self, path: &Path) -> SysResult<BlockDevice> {
        block_device(path)
    }

    fn hold_device(&self, path: &Path) -> SysResult<HeldDevice> {
        let (fd, dev) = open_block(path)?;
        let handle = PathBuf::from(format!(
            "/proc/{}/fd/{}",
            rustix::process::getpid().as_raw_nonzero(),
            fd.as_raw_fd()
        ));
        let node = kernel_node(dev.rdev).unwrap_or_else(|| handle.clone());
        Ok(HeldDevice::new(dev, handle, node, Some(fd)))
    }

    fn check_unclaimed(&self, dev: &HeldDevice) -> SysResult<()> {
        rustix::fs::open(
            &dev.handle,
            OFlags::RDONLY | OFlags::CLOEXEC | OFlags::EXCL,
            Mode::empty(),
        )
        .map(drop)
        .map_err(|e| SysError::new("open device exclusively", &dev.handle, e))
    }

    fn read_device(&self, path: &Path, offset: u64, buf: &mut [u8]) -> SysResult<usize> {
        let aligned = (buf.as_ptr() as usize).is_multiple_of(DIRECT_ALIGN)
            && buf.len().is_multiple_of(DIRECT_ALIGN)
            && offset.is_multiple_of(DIRECT_ALIGN as u64);
        if aligned {
            // O_DIRECT: the bytes come from the device, not through its page cache (the kernel
            // writes back cached dirty pages of the range first). A device or a size it
            // refuses (EINVAL) falls back to a cached read.
            match read_all(path, OFlags::DIRECT, offset, buf) {
                Err(e) if e.errno() == Some(libc::EINVAL) => {}
                other => return other,
            }
        }
        read_all(path, OFlags::empty(), offset, buf)
    }

    fn fs_usage(&self, path: &Path) -> SysResult<FsUsage> {
        let fd = self.open_beneath("open", path, OFlags::PATH)?;
        let v = rustix::fs::fstatvfs(&fd).map_err(|e| SysError::new("statvfs", path, e))?;
        let total_bytes = v.f_blocks.saturating_mul(v.f_frsize);
        let available_bytes = v.f_bavail.saturating_mul(v.f_frsize);
        let free_bytes = v.f_bfree.saturating_mul(v.f_frsize);
        Ok(FsUsage {
            total_bytes,
            available_bytes,
            used_bytes: total_bytes.saturating_sub(free_bytes),
            total_inodes: v.f_files,
            free_inodes: v.f_ffree,
            used_inodes: v.f_files.saturating_sub(v.f_ffree),
        })
    }

    fn share_with_group(
        &self,
        path: &Path,
        gid: u32,
        deadline: Duration,
    ) -> Result<GroupReport, OwnershipError> {
        let fd = self.open_beneath("open", path, OFlags::RDONLY | OFlags::DIRECTORY)?;
        ownership::share(fd, path, gid, deadline)
    }

    fn selinux(&self) -> bool {
        selinux::in_kernel()
    }

    fn selinux_label_known(&self, label: &str) -> bool {
        selinux::label_known(label)
    }

    fn read_cgroup(&self, path: &Path) -> SysResult<String> {
        std::fs::read_to_string(path).map_err(|e| SysError::new("read cgroup file", path, e))
    }

    fn write_cgroup(&self, path: &Path, line: &str) -> SysResult<()> {
        use std::io::Write as _;
        use std::os::unix::fs::OpenOptionsExt as _;
        // An existing control file only (no create), not through a symlink; the kernel takes
        // one rule per write.
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(path)
            .map_err(|e| SysError::new("open cgroup file", path, e))?;
        file.write_all(line.as_bytes())
            .map_err(|e| SysError::new("write cgroup file", path, e).with_detail(line))
    }

    fn run_tool(&self, run: &ToolRun) -> Result<(), ToolError> {
        run_with_deadline(run)
    }

    fn run_tool_with_key(&self, run: &ToolRun, key: &[u8]) -> Result<(), ToolError> {
        run_with_input(run, Some(key))
    }

    fn has_program(&self, program: &str) -> bool {
        find_program(program).is_some()
    }

    fn fs_errors(&self, (major, minor): (u32, u32)) -> SysResult<Option<u64>> {
        let link = PathBuf::from(format!("/sys/dev/block/{major}:{minor}"));
        let target = match std::fs::read_link(&link) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(SysError::new("read device link", &link, e)),
        };
        let Some(name) = target.file_name() else {
            return Ok(None);
        };
        let file = Path::new("/sys/fs/ext4").join(name).join("errors_count");
        match std::fs::read_to_string(&file) {
            Ok(text) => text.trim().parse().map(Some).map_err(|_| {
                SysError::new(
                    "read filesystem errors",
                    &file,
                    std::io::Error::from(std::io::ErrorKind::InvalidData),
                )
                .with_detail(text.trim())
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(SysError::new("read filesystem errors", &file, e)),
        }
    }

    fn backing_store(&self, (major, minor): (u32, u32)) -> SysResult<Option<BackingStore>> {
        let attr = PathBuf::from(format!("/sys/dev/block/{major}:{minor}/loop/backing_file"));
        let raw = match std::fs::read(&attr) {
            Ok(raw) => raw,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(SysError::new("read backing file", &attr, e)),
        };
        let Some(b) = discovery::BackingFile::parse(&raw) else {
            return Ok(None);
        };
        let fs = match rustix::fs::statvfs(&b.path) {
            Ok(v) => Some(BackingFs::Answers {
                read_only: v.f_flag.contains(StatVfsMountFlags::RDONLY),
                available_bytes: v.f_bavail.saturating_mul(v.f_frsize),
            }),
            // Not in this container's mounts (or unlinked): nothing to say of its filesystem.
            Err(Errno::NOENT) => None,
            Err(e) => Some(BackingFs::Fails(e.raw_os_error())),
        };
        Ok(Some(BackingStore {
            file: b.path,
            deleted: b.deleted,
            fs,
        }))
    }

    fn devices_under(&self, (major, minor): (u32, u32)) -> SysResult<Vec<(u32, u32)>> {
        let dir = PathBuf::from(format!("/sys/dev/block/{major}:{minor}/slaves"));
        let entries = match std::fs::read_dir(&dir) {
            Ok(entries) => entries,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(SysError::new("read device-mapper slaves", &dir, e)),
        };
        let mut under = Vec::new();
        for entry in entries {
            let entry = entry.map_err(|e| SysError::new("read device-mapper slaves", &dir, e))?;
            let file = entry.path().join("dev");
            let text = std::fs::read_to_string(&file)
                .map_err(|e| SysError::new("read a slave's number", &file, e))?;
            let number = text
                .trim()
                .split_once(':')
                .and_then(|(a, b)| Some((a.parse().ok()?, b.parse().ok()?)));
            match number {
                Some(n) => under.push(n),
                None => {
                    return Err(SysError::new(
                        "read a slave's number",
                        &file,
                        std::io::Error::from_raw_os_error(libc::EINVAL),
                    )
                    .with_detail(text.trim()));
                }
            }
        }
        under.sort_unstable();
        Ok(under)
    }

    fn identify(&self, rdev: (u32, u32), want: &DeviceIdentity) -> Verdict {
        discovery::identify_with_udev(rdev, want)
    }

    fn find_device(
        &self,
        want: &DeviceIdentity,
        wait: Duration,
    ) -> Result<FoundDevice, DiscoveryError> {
        discovery::find_with_udev(want, wait)
    }
}

/// Where the kernel names the boot it runs (a random UUID, new at every boot; not namespaced,
/// so a container reads the host's).
const BOOT_ID: &str = "/proc/sys/kernel/random/boot_id";

/// The node's boot id, as the kernel names it; None when it cannot be read.
pub fn boot_id() -> Option<String> {
    std::fs::read_to_string(BOOT_ID)
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
}

/// Opens the block device at `path` and reports its number and size.
pub fn block_device(path: &Path) -> SysResult<BlockDevice> {
    open_block(path).map(|(_, dev)| dev)
}

/// Opens the block device at `path`: the descriptor, its number and size.
fn open_block(path: &Path) -> SysResult<(OwnedFd, BlockDevice)> {
    let fd = rustix::fs::open(path, OFlags::RDONLY | OFlags::CLOEXEC, Mode::empty())
        .map_err(|e| SysError::new("open device", path, e))?;
    let st = rustix::fs::fstat(&fd).map_err(|e| SysError::new("stat device", path, e))?;
    if FileType::from_raw_mode(st.st_mode) != FileType::BlockDevice {
        return Err(SysError::new("open device", path, Errno::NOTBLK));
    }
    let size = rustix::fs::seek(&fd, rustix::fs::SeekFrom::End(0))
        .map_err(|e| SysError::new("size of device", path, e))?;
    let rdev = st.st_rdev;
    let dev = BlockDevice {
        rdev: (rustix::fs::major(rdev), rustix::fs::minor(rdev)),
        size,
    };
    Ok((fd, dev))
}

/// The kernel's node of device `rdev`, `/dev/<DEVNAME>` as its uevent names it, when that node
/// is this device.
fn kernel_node((major, minor): (u32, u32)) -> Option<PathBuf> {
    let uevent = std::fs::read_to_string(format!("/sys/dev/block/{major}:{minor}/uevent")).ok()?;
    let name = uevent.lines().find_map(|l| l.strip_prefix("DEVNAME="))?;
    if name.is_empty() || name.split('/').any(|c| c.is_empty() || c == "..") {
        return None;
    }
    let node = Path::new("/dev").join(name);
    let st = rustix::fs::stat(&node).ok()?;
    let same = FileType::from_raw_mode(st.st_mode) == FileType::BlockDevice
        && (rustix::fs::major(st.st_rdev), rustix::fs::minor(st.st_rdev)) == (major, minor);
    same.then_some(node)
}

/// Opens the device at `path` with `extra` flags and reads `buf` at `offset`, up to its end.
fn read_all(path: &Path, extra: OFlags, offset: u64, buf: &mut [u8]) -> SysResult<usize> {
    let fd = rustix::fs::open(
        path,
        OFlags::RDONLY | OFlags::CLOEXEC | extra,
        Mode::empty(),
    )
    .map_err(|e| SysError::new("open device", path, e))?;
    let mut done = 0;
    while done < buf.len() {
        let rest = buf.get_mut(done..).unwrap_or_default();
        match rustix::io::pread(&fd, rest, offset + done as u64) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(Errno::INTR) => {}
            Err(e) => return Err(SysError::new("read device", path, e)),
        }
    }
    Ok(done)
}

/// Finds `program` on `$PATH` or in the usual sbin/bin dirs.
pub fn find_program(program: &str) -> Option<PathBuf> {
    if program.contains('/') {
        return Path::new(program).is_file().then(|| PathBuf::from(program));
    }
    let path_var = std::env::var_os("PATH").unwrap_or_default();
    let from_env = std::env::split_paths(&path_var).collect::<Vec<_>>();
    from_env
        .into_iter()
        .chain(TOOL_DIRS.iter().map(PathBuf::from))
        .map(|dir| dir.join(program))
        .find(|p| {
            rustix::fs::access(p.as_os_str().as_bytes(), rustix::fs::Access::EXEC_OK).is_ok()
                && p.is_file()
        })
}

/// What one read of a tool's stderr gave.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Chunk {
    /// Bytes.
    Data,
    /// The end: the tool (and anything it started) closed it, or it failed.
    End,
    /// Nothing yet (a non-blocking read).
    NotReady,
}

/// A tool's stderr as it is read: the first 64 KiB kept, the rest read and dropped, so the
/// tool never blocks on a full pipe.
#[derive(Debug, Default)]
struct ToolStderr {
    bytes: Vec<u8>,
}

impl ToolStderr {
    const KEEP: usize = 64 * 1024;

    /// Reads once from `fd`.
    fn read_from(&mut self, fd: impl std::os::fd::AsFd) -> Chunk {
        let mut buf = [0u8; 4096];
        match rustix::io::read(fd, &mut buf) {
            Ok(0) => Chunk::End,
            Ok(n) => {
                let room = Self::KEEP.saturating_sub(self.bytes.len());
                self.bytes
                    .extend_from_slice(buf.get(..n.min(room)).unwrap_or_default());
                Chunk::Data
            }
            Err(Errno::INTR | Errno::AGAIN) => Chunk::NotReady,
            Err(_) => Chunk::End,
        }
    }
}

/// Runs a tool, collecting what it prints (stdout and stderr), and kills it at the deadline. Waiting is done on a
/// pidfd with poll(2): no sleeps, no busy loop.
pub fn run_with_deadline(run: &ToolRun) -> Result<(), ToolError> {
    run_with_input(run, None)
}

/// [`run_with_deadline`], with `input` (a key: at most a few dozen bytes, well within a pipe's
/// buffer) written to a pipe that is the tool's standard input, and the pipe closed, before
/// the tool starts: the bytes never reach argv, the environment or a file.
pub fn run_with_input(run: &ToolRun, input: Option<&[u8]>) -> Result<(), ToolError> {
    let program = run.program.clone();
    let spawn_err = |source: std::io::Error| ToolError::Spawn {
        program: program.clone(),
        source,
    };
    let wait_err = |source: std::io::Error| ToolError::Wait {
        program: program.clone(),
        source,
    };
    let exe = find_program(&run.program).unwrap_or_else(|| PathBuf::from(&run.program));
    let null = rustix::fs::open("/dev/null", OFlags::RDWR | OFlags::CLOEXEC, Mode::empty())
        .map_err(|e| spawn_err(e.into()))?;
    let (stderr, stderr_w) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)
        .map_err(|e| spawn_err(e.into()))?;
    let stdin = match input {
        None => None,
        Some(bytes) => {
            let (r, w) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)
                .map_err(|e| spawn_err(e.into()))?;
            let mut left = bytes;
            while !left.is_empty() {
                let n = rustix::io::write(&w, left).map_err(|e| spawn_err(e.into()))?;
                left = left.get(n..).unwrap_or_default();
            }
            // Closed: the tool reads the bytes and then the end of its input.
            drop(w);
            Some(r)
        }
    };
    let child = spawn::spawn(
        &exe,
        &run.args,
        &tool_env(),
        [
            stdin
                .as_ref()
                .map_or(null.as_fd(), std::os::fd::AsFd::as_fd),
            stderr_w.as_fd(),
            stderr_w.as_fd(),
        ],
    )
    .map_err(spawn_err)?;
    drop(stdin);
    drop(stderr_w);
    // One poll(2) waits for the exit and collects stderr: no reader thread, no sleeps.
    let mut collected = ToolStderr::default();
    let mut stderr_open = true;
    let start = Instant::now();
    let mut timed_out = false;
    let mut failure = None;
    loop {
        let left = run.deadline.saturating_sub(start.elapsed());
        if left.is_zero() {
            timed_out = true;
            break;
        }
        let Ok(timeout) = rustix::event::Timespec::try_from(left.min(Duration::from_secs(3600)))
        else {
            failure = Some(std::io::Error::other("bad deadline"));
            break;
        };
        let (exited, readable) = {
            let mut fds = vec![rustix::event::PollFd::new(
                &child.pidfd,
                rustix::event::PollFlags::IN,
            )];
            if stderr_open {
                fds.push(rustix::event::PollFd::new(
                    &stderr,
                    rustix::event::PollFlags::IN,
                ));
            }
            match rustix::event::poll(&mut fds, Some(&timeout)) {
                Ok(_) | Err(Errno::INTR) => {}
                Err(e) => {
                    failure = Some(e.into());
                    break;
                }
            }
            let ready = |i: usize| fds.get(i).is_some_and(|f| !f.revents().is_empty());
            (ready(0), ready(1))
        };
        if readable {
            stderr_open = collected.read_from(&stderr) != Chunk::End;
        }
        if exited {
            break;
        }
    }
    if timed_out || failure.is_some() {
        // Never leave it running, nor unreaped.
        let _ = spawn::kill(&child);
    }
    let status = spawn::wait(&child).map_err(wait_err)?;
    if let Some(source) = failure {
        return Err(wait_err(source));
    }
    // What the tool wrote just before it exited; a descendant still holding the pipe cannot
    // stall this (the end is non-blocking now).
    if stderr_open {
        let _ = rustix::io::ioctl_fionbio(&stderr, true);
        while collected.read_from(&stderr) == Chunk::Data {}
    }
    let stderr = collected.bytes;
    if timed_out {
        return Err(ToolError::Timeout {
            program,
            deadline: run.deadline,
        });
    }
    if status.exit_status() == Some(0) {
        return Ok(());
    }
    Err(ToolError::Failed {
        program,
        code: status.exit_status(),
        status: spawn::describe(&status),
        stderr: String::from_utf8_lossy(&stderr).trim().to_string(),
    })
}

/// A tool's environment: the daemon's, with messages in the C locale (moor reads them).
fn tool_env() -> Vec<std::ffi::OsString> {
    std::env::vars_os()
        .filter(|(k, _)| k != "LC_ALL")
        .map(|(k, v)| {
            let mut kv = k;
            kv.push("=");
            kv.push(v);
            kv
        })
        .chain(std::iter::once("LC_ALL=C".into()))
        .collect()
}

#[cfg(test)]
mod tests;
