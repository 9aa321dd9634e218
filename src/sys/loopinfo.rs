//! `LOOP_GET_STATUS64`: which inode a loop device reads, for the identity check. The one
//! `unsafe` ioctl of device discovery; [`super::loopdev`] binds and unbinds loop devices
//! with the same `struct loop_info64`.

use std::os::fd::AsFd;
use std::path::Path;

use rustix::fs::{Mode, OFlags};

/// `LOOP_GET_STATUS64` (`linux/loop.h`).
const LOOP_GET_STATUS64: rustix::ioctl::Opcode = 0x4C05;
/// `LO_NAME_SIZE`.
pub(crate) const LO_NAME_SIZE: usize = 64;
/// `LO_KEY_SIZE`.
const LO_KEY_SIZE: usize = 32;

/// `struct loop_info64` (`linux/loop.h`).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct LoopInfo64 {
    pub(crate) lo_device: u64,
    pub(crate) lo_inode: u64,
    pub(crate) lo_rdevice: u64,
    pub(crate) lo_offset: u64,
    pub(crate) lo_sizelimit: u64,
    pub(crate) lo_number: u32,
    pub(crate) lo_encrypt_type: u32,
    pub(crate) lo_encrypt_key_size: u32,
    pub(crate) lo_flags: u32,
    pub(crate) lo_file_name: [u8; LO_NAME_SIZE],
    pub(crate) lo_crypt_name: [u8; LO_NAME_SIZE],
    pub(crate) lo_encrypt_key: [u8; LO_KEY_SIZE],
    pub(crate) lo_init: [u64; 2],
}

impl LoopInfo64 {
    /// All zeroes: no offset, no size limit, no flags, no name.
    pub(crate) fn zeroed() -> Self {
        Self {
            lo_device: 0,
            lo_inode: 0,
            lo_rdevice: 0,
            lo_offset: 0,
            lo_sizelimit: 0,
            lo_number: 0,
            lo_encrypt_type: 0,
            lo_encrypt_key_size: 0,
            lo_flags: 0,
            lo_file_name: [0; LO_NAME_SIZE],
            lo_crypt_name: [0; LO_NAME_SIZE],
            lo_encrypt_key: [0; LO_KEY_SIZE],
            lo_init: [0; 2],
        }
    }
}

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
    get_status(fd.as_fd()).map(|info| BackingInode {
        dev: (
            rustix::fs::major(info.lo_device),
            rustix::fs::minor(info.lo_device),
        ),
        ino: info.lo_inode,
    })
}

pub(crate) fn get_status(fd: std::os::fd::BorrowedFd<'_>) -> std::io::Result<LoopInfo64> {
    // SAFETY: LOOP_GET_STATUS64 writes exactly one `struct loop_info64`, which `LoopInfo64`
    // reproduces field for field with the kernel's C layout.
    let getter = unsafe { rustix::ioctl::Getter::<LOOP_GET_STATUS64, LoopInfo64>::new() };
    // SAFETY: `fd` is an open descriptor and `getter` owns storage of the type the kernel
    // fills for this opcode.
    let info = unsafe { rustix::ioctl::ioctl(fd, getter) }?;
    Ok(info)
}

/// The device and inode of the file at `path`.
pub fn file_inode(path: &Path) -> std::io::Result<BackingInode> {
    let st = rustix::fs::stat(path)?;
    Ok(BackingInode {
        dev: (rustix::fs::major(st.st_dev), rustix::fs::minor(st.st_dev)),
        ino: st.st_ino,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loop_info64_has_the_kernel_size() {
        assert_eq!(std::mem::size_of::<LoopInfo64>(), 232);
    }
}
