//! Which file a loop device reads, for the identity check: `LOOP_GET_STATUS64` (through
//! [`moor_runtime::sys::loopdev`], where the ioctl lives) against a `stat` of the file.

use std::path::Path;

use moor_runtime::sys::loopdev;
use rustix::fs::{Mode, OFlags};

/// The file a bound loop device reads: the device of its filesystem and its inode number.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BackingInode {
    /// Device (major, minor) of the filesystem holding the file.
    pub dev: (u32, u32),
    /// Inode number.
    pub ino: u64,
}

/// Asks the loop device at `device` which inode it reads (ENXIO: it is not bound).
pub fn backing_inode(device: &Path) -> std::io::Result<BackingInode> {
    let fd = rustix::fs::open(
        device,
        OFlags::RDONLY | OFlags::CLOEXEC | OFlags::NONBLOCK,
        Mode::empty(),
    )?;
    loopdev::status(&fd).map(|info| BackingInode {
        dev: info.backing_dev(),
        ino: info.lo_inode,
    })
}

/// The name a bound loop device keeps for its file: the path its attacher gave
/// (`lo_file_name`, at most 63 bytes of it), whatever mount it was opened through.
pub fn attached_name(device: &Path) -> std::io::Result<Vec<u8>> {
    let fd = rustix::fs::open(
        device,
        OFlags::RDONLY | OFlags::CLOEXEC | OFlags::NONBLOCK,
        Mode::empty(),
    )?;
    loopdev::status(&fd).map(|info| {
        let end = info
            .lo_file_name
            .iter()
            .position(|&b| b == 0)
            .unwrap_or(info.lo_file_name.len());
        info.lo_file_name[..end].to_vec()
    })
}

/// The device and inode of the file at `path`.
pub fn file_inode(path: &Path) -> std::io::Result<BackingInode> {
    let st = rustix::fs::stat(path)?;
    Ok(BackingInode {
        dev: (rustix::fs::major(st.st_dev), rustix::fs::minor(st.st_dev)),
        ino: st.st_ino,
    })
}
