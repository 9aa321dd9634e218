//! The syscalls rustix does not wrap yet. With `spawn` (starting a tool), the only `unsafe` code
//! in the node.
//!
//! * `mount_setattr(2)` (Linux 5.12): change the attributes of a (detached) mount tree, used to
//!   make a bind mount read-only before it becomes visible, with no window in which it is
//!   writable.
//! * `listmount(2)` and `statmount(2)` (Linux 6.8): the mount table by mount id, without
//!   formatting and parsing `/proc/self/mountinfo`.
//! * `fchmodat2(2)` (Linux 6.6) with `AT_EMPTY_PATH`: changes the mode of the inode an `O_PATH`
//!   descriptor holds, which `fchmod(2)` refuses.

use std::io;
use std::os::fd::{AsFd, AsRawFd};

/// `MOUNT_ATTR_RDONLY`.
pub const MOUNT_ATTR_RDONLY: u64 = 0x0000_0001;
/// `MOUNT_ATTR_NOSUID`.
pub const MOUNT_ATTR_NOSUID: u64 = 0x0000_0002;
/// `MOUNT_ATTR_NODEV`.
pub const MOUNT_ATTR_NODEV: u64 = 0x0000_0004;
/// `MOUNT_ATTR_NOEXEC`.
pub const MOUNT_ATTR_NOEXEC: u64 = 0x0000_0008;
/// `MOUNT_ATTR__ATIME`: the mask of the access-time policy bits.
pub const MOUNT_ATTR_ATIME_MASK: u64 = 0x0000_0070;
/// `MOUNT_ATTR_NOATIME`.
pub const MOUNT_ATTR_NOATIME: u64 = 0x0000_0010;
/// `MOUNT_ATTR_STRICTATIME`.
pub const MOUNT_ATTR_STRICTATIME: u64 = 0x0000_0020;
/// `MOUNT_ATTR_NODIRATIME`.
pub const MOUNT_ATTR_NODIRATIME: u64 = 0x0000_0080;
/// `MOUNT_ATTR_IDMAP`: the mount maps ids through the user namespace `userns_fd` names (what a
/// container runtime makes of a volume for a pod with its own user namespace).
pub const MOUNT_ATTR_IDMAP: u64 = 0x0010_0000;

/// `struct mount_attr` (`MOUNT_ATTR_SIZE_VER0`).
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct MountAttr {
    /// Attributes to set.
    pub attr_set: u64,
    /// Attributes to clear.
    pub attr_clr: u64,
    /// Propagation type.
    pub propagation: u64,
    /// User namespace fd for idmapped mounts.
    pub userns_fd: u64,
}

/// `mount_setattr(fd, "", AT_EMPTY_PATH, attr)`: applies `attr` to the mount `fd` refers to.
pub fn mount_setattr_fd(fd: impl AsFd, attr: &MountAttr) -> io::Result<()> {
    let empty = c"";
    // SAFETY: `fd` is a live descriptor borrowed for the call; `empty` is a NUL-terminated
    // string that outlives the call; `attr` points to a properly sized and initialised
    // `struct mount_attr` whose size we pass, and the kernel only reads it.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            fd.as_fd().as_raw_fd(),
            empty.as_ptr(),
            libc::AT_EMPTY_PATH as libc::c_uint,
            std::ptr::from_ref(attr),
            std::mem::size_of::<MountAttr>(),
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// `SYS_statmount` on every architecture using the common syscall table.
pub const SYS_STATMOUNT: libc::c_long = 457;
/// `SYS_listmount`.
pub const SYS_LISTMOUNT: libc::c_long = 458;
/// `LSMT_ROOT`: list the mounts of the whole namespace.
pub const LSMT_ROOT: u64 = u64::MAX;

/// `struct mnt_id_req` (`MNT_ID_REQ_SIZE_VER0`).
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
struct MntIdReq {
    size: u32,
    spare: u32,
    mnt_id: u64,
    param: u64,
}

/// `listmount(2)` of the caller's mount namespace: fills `ids` with unique mount ids greater
/// than `after` (0 to start), in order, and returns how many it wrote.
pub fn listmount(after: u64, ids: &mut [u64]) -> io::Result<usize> {
    let req = MntIdReq {
        size: std::mem::size_of::<MntIdReq>() as u32,
        spare: 0,
        mnt_id: LSMT_ROOT,
        param: after,
    };
    // SAFETY: `req` is an initialised `struct mnt_id_req` of the size it declares, only read
    // by the kernel; `ids` is a writable buffer of exactly `ids.len()` u64s, which is the
    // count we pass, and it outlives the call.
    let rc = unsafe {
        libc::syscall(
            SYS_LISTMOUNT,
            std::ptr::from_ref(&req),
            ids.as_mut_ptr(),
            ids.len(),
            0 as libc::c_uint,
        )
    };
    usize::try_from(rc).map_err(|_| io::Error::last_os_error())
}

/// `statmount(2)`: writes `struct statmount` of mount `mnt_id`, with the fields of `mask`,
/// into `buf`. EOVERFLOW means `buf` is too small for its strings.
pub fn statmount(mnt_id: u64, mask: u64, buf: &mut [u8]) -> io::Result<()> {
    let req = MntIdReq {
        size: std::mem::size_of::<MntIdReq>() as u32,
        spare: 0,
        mnt_id,
        param: mask,
    };
    // SAFETY: `req` is an initialised `struct mnt_id_req` of the size it declares, only read
    // by the kernel; `buf` is writable for `buf.len()` bytes, the size we pass, and the
    // kernel writes no further; both outlive the call.
    let rc = unsafe {
        libc::syscall(
            SYS_STATMOUNT,
            std::ptr::from_ref(&req),
            buf.as_mut_ptr(),
            buf.len(),
            0 as libc::c_uint,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// `fchmodat2(fd, "", mode, AT_EMPTY_PATH)`: sets the mode of what `fd` refers to (an `O_PATH`
/// descriptor too). The kernel refuses a symlink (EOPNOTSUPP). A kernel older than 6.6 has no
/// fchmodat2 (ENOSYS; Debian 12's 6.1): there the mode is set through `/proc/self/fd/<fd>`,
/// whose magic link names the descriptor's own inode, never a path looked up again (as glibc
/// does for `fchmodat(AT_EMPTY_PATH)`); never used on a symlink.
pub fn fchmodat2_empty(fd: impl AsFd, mode: u32) -> io::Result<()> {
    match fchmodat2_syscall(fd.as_fd(), mode) {
        Err(e) if e.raw_os_error() == Some(libc::ENOSYS) => {
            let link = format!("/proc/self/fd/{}", fd.as_fd().as_raw_fd());
            rustix::fs::chmod(link.as_str(), rustix::fs::Mode::from_raw_mode(mode))
                .map_err(io::Error::from)
        }
        r => r,
    }
}

fn fchmodat2_syscall(fd: impl AsFd, mode: u32) -> io::Result<()> {
    let empty = c"";
    // SAFETY: `fd` is a live descriptor borrowed for the call; `empty` is a NUL-terminated
    // string that outlives the call and that the kernel only reads; the mode and flags are
    // plain integers.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_fchmodat2,
            fd.as_fd().as_raw_fd(),
            empty.as_ptr(),
            mode as libc::c_uint,
            libc::AT_EMPTY_PATH as libc::c_uint,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}
