//! Binding a file to a loop device and unbinding it: the block device the FUSE attacher makes
//! of an image file (`attach::fuse`), with the loop ioctls of [`moor_runtime::sys::loopdev`].
//!
//! A device is bound with `LOOP_CONFIGURE` in one step: the file, a 512-byte logical block
//! (what the kernel RBD client shows, so a filesystem made through one attacher mounts through
//! the other), direct I/O, and read-only when asked. Direct I/O is required: without it the
//! loop driver writes through the file's page cache, where a flush of the device would stop
//! short of the file's own server. A kernel that drops the flag is asked again with
//! `LOOP_SET_DIRECT_IO`, and a device that still has no direct I/O is unbound and refused.

use std::io;
use std::os::fd::OwnedFd;
use std::os::unix::ffi::OsStrExt as _;
use std::path::{Path, PathBuf};

use moor_runtime::sys::loopdev as ioctl;
use rustix::fs::{Mode, OFlags};

/// The logical block size of a bound device.
const BLOCK_SIZE: u32 = 512;
/// How often a free device another process took first is given up for the next one.
const RACES: usize = 16;

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
    let flags = ioctl::LO_FLAGS_DIRECT_IO
        | if read_only {
            ioctl::LO_FLAGS_READ_ONLY
        } else {
            0
        };
    // The name the device shows (`losetup -a`); the kernel's own record of the file is the
    // sysfs `backing_file`, which is what identifies it.
    let name = file.as_os_str().as_bytes();
    let mut last = io::Error::from_raw_os_error(libc::EBUSY);
    for _ in 0..RACES {
        let n = ioctl::get_free(&ctl)?;
        let path = PathBuf::from(format!("/dev/loop{n}"));
        let dev = match rustix::fs::open(&path, OFlags::RDWR | OFlags::CLOEXEC, Mode::empty()) {
            Ok(d) => d,
            Err(e) => {
                last = e.into();
                continue;
            }
        };
        match ioctl::configure_sized(&dev, &backing, flags, name, BLOCK_SIZE) {
            Ok(()) => return finish(&path, &dev, read_only),
            // Another process bound it between the two calls: take the next free one.
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) => last = e,
            Err(e) => return Err(e),
        }
    }
    Err(last)
}

/// Checks that the freshly bound device has direct I/O (asking once more if the kernel
/// dropped the flag), and reports it; a device without is unbound, and an error.
fn finish(path: &Path, dev: &OwnedFd, read_only: bool) -> io::Result<LoopDevice> {
    let checked = (|| {
        if ioctl::status(dev)?.lo_flags & ioctl::LO_FLAGS_DIRECT_IO == 0 {
            ioctl::set_direct_io(dev, true)?;
            if ioctl::status(dev)?.lo_flags & ioctl::LO_FLAGS_DIRECT_IO == 0 {
                return Err(io::Error::other(
                    "the loop driver does not use direct I/O on this file",
                ));
            }
        }
        let st = rustix::fs::fstat(dev)?;
        Ok(LoopDevice {
            path: path.to_path_buf(),
            rdev: (rustix::fs::major(st.st_rdev), rustix::fs::minor(st.st_rdev)),
            read_only,
        })
    })();
    if checked.is_err() {
        let _ = ioctl::clear_fd(dev);
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
    match ioctl::clear_fd(&dev) {
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
    ioctl::set_capacity(&dev)
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

/// A block device's I/O as sysfs counts it (`/sys/dev/block/MAJ:MIN/stat`, which asks nothing
/// of the device or what serves it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IoProgress {
    /// Requests completed: reads, writes, discards and flushes.
    pub completed: u64,
    /// Requests issued and not completed.
    pub in_flight: u64,
}

/// The I/O of device `rdev` so far; None when sysfs does not show it.
pub fn io_progress(rdev: (u32, u32)) -> Option<IoProgress> {
    let text =
        std::fs::read_to_string(format!("/sys/dev/block/{}:{}/stat", rdev.0, rdev.1)).ok()?;
    parse_stat(&text)
}

/// Fields 1, 5, 12 and 16 of a block stat are the completed reads, writes, discards and
/// flushes, field 9 the requests in flight (Documentation/block/stat.rst); older kernels
/// print fewer fields.
fn parse_stat(text: &str) -> Option<IoProgress> {
    let f: Vec<u64> = text
        .split_whitespace()
        .map(str::parse)
        .collect::<Result<_, _>>()
        .ok()?;
    let at = |i: usize| f.get(i - 1).copied().unwrap_or(0);
    (f.len() >= 11).then(|| IoProgress {
        completed: at(1) + at(5) + at(12) + at(16),
        in_flight: at(9),
    })
}

/// `major:minor`.
fn parse_dev(text: &str) -> Option<(u32, u32)> {
    let (a, b) = text.split_once(':')?;
    Some((a.parse().ok()?, b.parse().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_block_stat_gives_completed_and_in_flight_requests() {
        let stat = "     150        2     2072       15      127       75     3320       30        \
                    3       52       54        4        0        0        0       98        8\n";
        assert_eq!(
            parse_stat(stat),
            Some(IoProgress {
                completed: 150 + 127 + 4 + 98,
                in_flight: 3
            })
        );
        // A kernel before discards and flushes were counted.
        assert_eq!(
            parse_stat("1 0 8 0 2 0 16 0 1 0 0"),
            Some(IoProgress {
                completed: 3,
                in_flight: 1
            })
        );
        assert_eq!(parse_stat("1 2 3"), None);
        assert_eq!(parse_stat("x 0 8 0 2 0 16 0 1 0 0"), None);
    }

    #[test]
    fn device_numbers_parse() {
        assert_eq!(parse_dev("7:12"), Some((7, 12)));
        assert_eq!(parse_dev("7"), None);
        assert_eq!(parse_dev("x:1"), None);
    }
}
