//! Binding a file to a loop device and unbinding it, with the kernel's loop ioctls: the block
//! device the FUSE attacher makes of an image file (`attach::fuse`).
//!
//! A device is bound with `LOOP_CONFIGURE` (Linux 5.8) in one step: the file, a 512-byte
//! logical block (what the kernel RBD client shows, so a filesystem made through one attacher
//! mounts through the other), direct I/O, and read-only when asked. Direct I/O is required:
//! without it the loop driver writes through the file's page cache, where a flush of the
//! device would stop short of the file's own server. A kernel that ignores the flag is asked
//! again with `LOOP_SET_DIRECT_IO`, and a device that still has no direct I/O is unbound and
//! refused.

use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt as _;
use std::path::{Path, PathBuf};

use rustix::fs::{Mode, OFlags};

use super::loopinfo::{self, LO_NAME_SIZE, LoopInfo64};

/// `LOOP_CLR_FD`.
const LOOP_CLR_FD: rustix::ioctl::Opcode = 0x4C01;
/// `LOOP_SET_CAPACITY`.
const LOOP_SET_CAPACITY: rustix::ioctl::Opcode = 0x4C07;
/// `LOOP_SET_DIRECT_IO`.
const LOOP_SET_DIRECT_IO: rustix::ioctl::Opcode = 0x4C08;
/// `LOOP_CONFIGURE`.
const LOOP_CONFIGURE: rustix::ioctl::Opcode = 0x4C0A;
/// `LOOP_CTL_GET_FREE`.
const LOOP_CTL_GET_FREE: libc::c_ulong = 0x4C82;
/// `LO_FLAGS_READ_ONLY`.
const LO_FLAGS_READ_ONLY: u32 = 1;
/// `LO_FLAGS_DIRECT_IO`.
const LO_FLAGS_DIRECT_IO: u32 = 16;
/// The logical block size of a bound device.
const BLOCK_SIZE: u32 = 512;
/// How often a free device another process took first is given up for the next one.
const RACES: usize = 16;

/// `struct loop_config` (`linux/loop.h`).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct LoopConfig {
    fd: u32,
    block_size: u32,
    info: LoopInfo64,
    reserved: [u64; 8],
}

/// A bound loop device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoopDevice {
    /// `/dev/loopN`.
    pub path: PathBuf,
    /// Its device number.
    pub rdev: (u32, u32),
    /// Whether it is bound read-only.
    pub read_only: bool,
}

/// Why a device could not be unbound.
#[derive(Debug, thiserror::Error)]
pub enum DetachError {
    /// Something holds it: a mount, a claim, another opener.
    #[error("{0} is in use")]
    Busy(PathBuf),
    /// The kernel refused.
    #[error("{step} {}: {source}", path.display())]
    Io {
        /// The step.
        step: &'static str,
        /// The device.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
}

/// Binds `file` to a free loop device with direct I/O, read-only when asked.
pub fn attach(file: &Path, read_only: bool) -> io::Result<LoopDevice> {
    let access = if read_only {
        OFlags::RDONLY
    } else {
        OFlags::RDWR
    };
    let backing = rustix::fs::open(file, access | OFlags::CLOEXEC, Mode::empty())?;
    let ctl = rustix::fs::open(
        "/dev/loop-control",
        OFlags::RDWR | OFlags::CLOEXEC,
        Mode::empty(),
    )?;
    let mut info = LoopInfo64::zeroed();
    info.lo_flags = LO_FLAGS_DIRECT_IO | if read_only { LO_FLAGS_READ_ONLY } else { 0 };
    let name = file.as_os_str().as_bytes();
    // The name the device shows (`losetup -a`); the kernel's own record of the file is the
    // sysfs `backing_file`, which is what identifies it.
    let keep = name.len().min(LO_NAME_SIZE - 1);
    if let (Some(dst), Some(src)) = (info.lo_file_name.get_mut(..keep), name.get(..keep)) {
        dst.copy_from_slice(src);
    }
    let config = LoopConfig {
        fd: u32::try_from(backing.as_raw_fd())
            .map_err(|_| io::Error::from_raw_os_error(libc::EBADF))?,
        block_size: BLOCK_SIZE,
        info,
        reserved: [0; 8],
    };
    let mut last = io::Error::from_raw_os_error(libc::EBUSY);
    for _ in 0..RACES {
        let n = get_free(&ctl)?;
        let path = PathBuf::from(format!("/dev/loop{n}"));
        let dev = match rustix::fs::open(&path, OFlags::RDWR | OFlags::CLOEXEC, Mode::empty()) {
            Ok(d) => d,
            Err(e) => {
                last = e.into();
                continue;
            }
        };
        match configure(&dev, config) {
            Ok(()) => return finish(&path, dev, read_only),
            // Another process bound it between the two calls: take the next free one.
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) => last = e,
            Err(e) => return Err(e),
        }
    }
    Err(last)
}

/// Checks that the freshly bound device has direct I/O (asking once more if the kernel
/// dropped the flag), and reports it; a device without unbinds and fails.
fn finish(path: &Path, dev: OwnedFd, read_only: bool) -> io::Result<LoopDevice> {
    let checked = (|| {
        let info = loopinfo::get_status(dev.as_fd())?;
        if info.lo_flags & LO_FLAGS_DIRECT_IO == 0 {
            set_direct_io(&dev)?;
            let again = loopinfo::get_status(dev.as_fd())?;
            if again.lo_flags & LO_FLAGS_DIRECT_IO == 0 {
                return Err(io::Error::other(
                    "the loop driver does not use direct I/O on this file",
                ));
            }
        }
        let st = rustix::fs::fstat(&dev)?;
        Ok(LoopDevice {
            path: path.to_path_buf(),
            rdev: (rustix::fs::major(st.st_rdev), rustix::fs::minor(st.st_rdev)),
            read_only,
        })
    })();
    if checked.is_err() {
        let _ = clear(&dev);
    }
    checked
}

/// Unbinds the loop device at `path`. A device something holds (a mount, a claim) is
/// [`DetachError::Busy`] and stays bound; one that is not bound (any more) is done.
pub fn detach(path: &Path) -> Result<(), DetachError> {
    let io_err = |step, source: io::Error| DetachError::Io {
        step,
        path: path.to_path_buf(),
        source,
    };
    // O_EXCL on a block device claims it: it fails while mounted or claimed elsewhere.
    let dev = match rustix::fs::open(
        path,
        OFlags::RDONLY | OFlags::CLOEXEC | OFlags::EXCL,
        Mode::empty(),
    ) {
        Ok(d) => d,
        Err(rustix::io::Errno::BUSY) => return Err(DetachError::Busy(path.to_path_buf())),
        Err(rustix::io::Errno::NOENT | rustix::io::Errno::NXIO) => return Ok(()),
        Err(e) => return Err(io_err("open", e.into())),
    };
    match clear(&dev) {
        // ENXIO: not bound.
        Ok(()) => Ok(()),
        Err(e) if e.raw_os_error() == Some(libc::ENXIO) => Ok(()),
        Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {
            Err(DetachError::Busy(path.to_path_buf()))
        }
        Err(e) => Err(io_err("LOOP_CLR_FD", e)),
    }
    // Closing `dev`, the last opener, completes the unbinding.
}

/// Tells the loop device at `path` to take its file's new size (after the image grew).
pub fn set_capacity(path: &Path) -> io::Result<()> {
    let dev = rustix::fs::open(path, OFlags::RDONLY | OFlags::CLOEXEC, Mode::empty())?;
    // SAFETY: LOOP_SET_CAPACITY takes no argument.
    let op = unsafe { rustix::ioctl::NoArg::<LOOP_SET_CAPACITY>::new() };
    // SAFETY: `dev` is an open loop device and the opcode takes no argument.
    unsafe { rustix::ioctl::ioctl(&dev, op) }?;
    Ok(())
}

/// The loop devices bound to a file at or below `path`, with their files, read from sysfs
/// (`/sys/block/loopN/loop/backing_file`). A file unlinked since shows with " (deleted)".
pub fn bound_under(path: &Path) -> Vec<(LoopDevice, PathBuf)> {
    let Ok(entries) = std::fs::read_dir("/sys/block") else {
        return Vec::new();
    };
    let mut found = Vec::new();
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(name) = name.to_str().filter(|n| n.starts_with("loop")) else {
            continue;
        };
        let sys = e.path();
        let Ok(raw) = std::fs::read(sys.join("loop/backing_file")) else {
            continue;
        };
        let text = raw.strip_suffix(b"\n").unwrap_or(&raw);
        let text = text.strip_suffix(b" (deleted)").unwrap_or(text);
        let file = PathBuf::from(std::ffi::OsStr::from_bytes(text));
        if !file.starts_with(path) {
            continue;
        }
        let Some(rdev) = std::fs::read_to_string(sys.join("dev"))
            .ok()
            .and_then(|d| parse_dev(d.trim()))
        else {
            continue;
        };
        let read_only = std::fs::read_to_string(sys.join("ro")).is_ok_and(|r| r.trim() == "1");
        found.push((
            LoopDevice {
                path: Path::new("/dev").join(name),
                rdev,
                read_only,
            },
            file,
        ));
    }
    found.sort_by(|a, b| a.0.path.cmp(&b.0.path));
    found
}

/// `major:minor`.
fn parse_dev(text: &str) -> Option<(u32, u32)> {
    let (a, b) = text.split_once(':')?;
    Some((a.parse().ok()?, b.parse().ok()?))
}

fn get_free(ctl: &OwnedFd) -> io::Result<u32> {
    // SAFETY: LOOP_CTL_GET_FREE takes no argument and returns a device number or -1; `ctl` is
    // an open descriptor of /dev/loop-control.
    let n = unsafe { libc::ioctl(ctl.as_raw_fd(), LOOP_CTL_GET_FREE) };
    u32::try_from(n).map_err(|_| io::Error::last_os_error())
}

fn configure(dev: &OwnedFd, config: LoopConfig) -> io::Result<()> {
    // SAFETY: LOOP_CONFIGURE reads one `struct loop_config`, which `LoopConfig` reproduces
    // field for field with the kernel's C layout.
    let op = unsafe { rustix::ioctl::Setter::<LOOP_CONFIGURE, LoopConfig>::new(config) };
    // SAFETY: `dev` is an open loop device and `op` owns the argument the opcode reads.
    unsafe { rustix::ioctl::ioctl(dev, op) }?;
    Ok(())
}

fn set_direct_io(dev: &OwnedFd) -> io::Result<()> {
    // SAFETY: LOOP_SET_DIRECT_IO takes an unsigned long by value; 1 turns direct I/O on.
    let op = unsafe { rustix::ioctl::IntegerSetter::<LOOP_SET_DIRECT_IO>::new_usize(1) };
    // SAFETY: `dev` is an open loop device and `op` carries the integer the opcode takes.
    unsafe { rustix::ioctl::ioctl(dev, op) }?;
    Ok(())
}

fn clear(dev: &OwnedFd) -> io::Result<()> {
    // SAFETY: LOOP_CLR_FD takes no argument.
    let op = unsafe { rustix::ioctl::NoArg::<LOOP_CLR_FD>::new() };
    // SAFETY: `dev` is an open loop device and the opcode takes no argument.
    unsafe { rustix::ioctl::ioctl(dev, op) }?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loop_config_has_the_kernel_size() {
        assert_eq!(std::mem::size_of::<LoopConfig>(), 304);
    }

    #[test]
    fn device_numbers_parse() {
        assert_eq!(parse_dev("7:12"), Some((7, 12)));
        assert_eq!(parse_dev("7"), None);
        assert_eq!(parse_dev("x:1"), None);
    }
}
