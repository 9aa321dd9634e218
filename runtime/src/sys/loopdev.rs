//! Loop device ioctls, for the controller (which attaches volumes with them) and the node (which
//! asks a loop device which file it reads).
//!
//! * `LOOP_CTL_GET_FREE` on `/dev/loop-control`: the number of a free loop device (the kernel
//!   creates one when none is free);
//! * `LOOP_CTL_REMOVE` on `/dev/loop-control`: delete an unbound device, so that its number
//!   comes back (from `LOOP_CTL_GET_FREE`) as a new device with the kernel's defaults;
//! * `LOOP_CONFIGURE` (Linux 5.8) on `/dev/loopN`: bind a backing file and set the flags in
//!   one step;
//! * `LOOP_GET_STATUS64`: which file (device and inode) a loop device is bound to;
//! * `LOOP_SET_CAPACITY`: re-read the backing file's size after it grew;
//! * `LOOP_SET_DIRECT_IO`: read and write the backing file with direct I/O;
//! * `LOOP_CLR_FD`: unbind; the kernel finishes it when the last opener closes the device.
//!
//! The wrappers are safe: each takes borrowed descriptors and properly laid-out structures.
//! Deciding *which* device to touch is the caller's job (the controller's `embedded::attach`).

use std::ffi::c_void;
use std::io;
use std::os::fd::{AsFd, AsRawFd};

use rustix::io::Errno;
use rustix::ioctl::{Getter, IntegerSetter, Ioctl, IoctlOutput, NoArg, Opcode, Setter, ioctl};

const LOOP_CLR_FD: Opcode = 0x4C01;
const LOOP_GET_STATUS64: Opcode = 0x4C05;
const LOOP_SET_CAPACITY: Opcode = 0x4C07;
const LOOP_SET_DIRECT_IO: Opcode = 0x4C08;
const LOOP_CONFIGURE: Opcode = 0x4C0A;
const LOOP_CTL_REMOVE: Opcode = 0x4C81;
const LOOP_CTL_GET_FREE: Opcode = 0x4C82;

/// `LO_FLAGS_READ_ONLY`: the device refuses writes.
pub const LO_FLAGS_READ_ONLY: u32 = 1;
/// `LO_FLAGS_AUTOCLEAR`: unbind on last close. moor never sets it: an attach must outlive the
/// controller process.
pub const LO_FLAGS_AUTOCLEAR: u32 = 4;
/// `LO_FLAGS_DIRECT_IO`: the backing file is read and written with direct I/O.
pub const LO_FLAGS_DIRECT_IO: u32 = 16;
/// Size of `lo_file_name`.
pub const LO_NAME_SIZE: usize = 64;

/// `struct loop_info64` from `<linux/loop.h>`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct LoopInfo64 {
    /// Device of the backing file (`huge_encode_dev`).
    pub lo_device: u64,
    /// Inode of the backing file.
    pub lo_inode: u64,
    /// The loop device's own device number.
    pub lo_rdevice: u64,
    /// Offset into the backing file.
    pub lo_offset: u64,
    /// Size limit in bytes (0: the whole file).
    pub lo_sizelimit: u64,
    /// The loop device's number.
    pub lo_number: u32,
    /// Obsolete.
    pub lo_encrypt_type: u32,
    /// Obsolete.
    pub lo_encrypt_key_size: u32,
    /// `LO_FLAGS_*`.
    pub lo_flags: u32,
    /// Informational name of the backing file (truncated, NUL-padded).
    pub lo_file_name: [u8; LO_NAME_SIZE],
    /// Obsolete.
    pub lo_crypt_name: [u8; LO_NAME_SIZE],
    /// Obsolete.
    pub lo_encrypt_key: [u8; 32],
    /// Obsolete.
    pub lo_init: [u64; 2],
}

impl LoopInfo64 {
    /// All zeroes.
    pub const fn zeroed() -> Self {
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
            lo_encrypt_key: [0; 32],
            lo_init: [0; 2],
        }
    }

    /// The backing file's device as (major, minor), decoding the kernel's `huge_encode_dev`.
    pub fn backing_dev(&self) -> (u32, u32) {
        let d = self.lo_device;
        let major = ((d >> 8) & 0xfff) as u32;
        let minor = ((d & 0xff) | ((d >> 12) & 0xfff00)) as u32;
        (major, minor)
    }
}

/// `struct loop_config` from `<linux/loop.h>`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct LoopConfig {
    fd: u32,
    block_size: u32,
    info: LoopInfo64,
    reserved: [u64; 8],
}

const _: () = assert!(std::mem::size_of::<LoopInfo64>() == 232);
const _: () = assert!(std::mem::size_of::<LoopConfig>() == 304);

/// `LOOP_CTL_GET_FREE`: no argument; the result is the return value.
struct GetFree;

// SAFETY: LOOP_CTL_GET_FREE takes no argument (the pointer is null and never dereferenced),
// writes no user memory (IS_MUTATING is false), and returns the device number as the ioctl's
// return value, which `output_from_ptr` only converts.
unsafe impl Ioctl for GetFree {
    type Output = u32;

    const IS_MUTATING: bool = false;

    fn opcode(&self) -> Opcode {
        LOOP_CTL_GET_FREE
    }

    fn as_ptr(&mut self) -> *mut c_void {
        std::ptr::null_mut()
    }

    unsafe fn output_from_ptr(out: IoctlOutput, _: *mut c_void) -> rustix::io::Result<u32> {
        u32::try_from(out).map_err(|_| Errno::RANGE)
    }
}

/// Asks `/dev/loop-control` for the number of a free loop device.
pub fn get_free(control: impl AsFd) -> io::Result<u32> {
    // SAFETY: `control` is a live descriptor borrowed for the call; GetFree passes no pointer.
    let n = unsafe { ioctl(control, GetFree) }?;
    Ok(n)
}

/// Binds `backing` to the loop device `device` with `flags` (`LO_FLAGS_*`); `name` is stored
/// as the informational file name (truncated to 63 bytes). EBUSY: the device is bound already.
pub fn configure(device: impl AsFd, backing: impl AsFd, flags: u32, name: &[u8]) -> io::Result<()> {
    configure_sized(device, backing, flags, name, 0)
}

/// [`configure`] with a logical block size of `block_size` bytes (0: the kernel's default).
pub fn configure_sized(
    device: impl AsFd,
    backing: impl AsFd,
    flags: u32,
    name: &[u8],
    block_size: u32,
) -> io::Result<()> {
    let raw = backing.as_fd().as_raw_fd();
    let fd = u32::try_from(raw).map_err(|_| io::Error::from(Errno::BADF))?;
    let mut info = LoopInfo64::zeroed();
    info.lo_flags = flags;
    let n = name.len().min(LO_NAME_SIZE - 1);
    info.lo_file_name[..n].copy_from_slice(&name[..n]);
    let config = LoopConfig {
        fd,
        block_size,
        info,
        reserved: [0; 8],
    };
    // SAFETY: LOOP_CONFIGURE takes a pointer to a `struct loop_config`, which `LoopConfig`
    // reproduces field for field (size checked at compile time); the kernel only reads it.
    let op = unsafe { Setter::<LOOP_CONFIGURE, LoopConfig>::new(config) };
    // SAFETY: `device` is a live descriptor borrowed for the call, and `op` owns the argument
    // for the duration of the call; `backing` stays open until we return.
    unsafe { ioctl(device, op) }?;
    Ok(())
}

/// The loop device's status; ENXIO when it is not bound.
pub fn status(device: impl AsFd) -> io::Result<LoopInfo64> {
    // SAFETY: LOOP_GET_STATUS64 writes a `struct loop_info64`, which `LoopInfo64` reproduces
    // field for field (size checked at compile time).
    let op = unsafe { Getter::<LOOP_GET_STATUS64, LoopInfo64>::new() };
    // SAFETY: `device` is a live descriptor borrowed for the call; `op` owns the buffer the
    // kernel writes, sized for the structure.
    let info = unsafe { ioctl(device, op) }?;
    Ok(info)
}

/// Tells the loop device to re-read its backing file's size.
pub fn set_capacity(device: impl AsFd) -> io::Result<()> {
    // SAFETY: LOOP_SET_CAPACITY takes no argument.
    let op = unsafe { NoArg::<LOOP_SET_CAPACITY>::new() };
    // SAFETY: `device` is a live descriptor borrowed for the call; no pointer is passed.
    unsafe { ioctl(device, op) }?;
    Ok(())
}

/// Turns direct I/O on the backing file on (or off).
pub fn set_direct_io(device: impl AsFd, on: bool) -> io::Result<()> {
    // SAFETY: LOOP_SET_DIRECT_IO takes an unsigned long by value (0 or 1), not a pointer.
    let op = unsafe { IntegerSetter::<LOOP_SET_DIRECT_IO>::new_usize(usize::from(on)) };
    // SAFETY: `device` is a live descriptor borrowed for the call; the argument is an integer.
    unsafe { ioctl(device, op) }?;
    Ok(())
}

/// Deletes the unbound loop device number `n` (EBUSY while it is bound or open).
pub fn remove(control: impl AsFd, n: u32) -> io::Result<()> {
    let n = usize::try_from(n).map_err(|_| io::Error::from(Errno::INVAL))?;
    // SAFETY: LOOP_CTL_REMOVE takes the device number by value, not a pointer.
    let op = unsafe { IntegerSetter::<LOOP_CTL_REMOVE>::new_usize(n) };
    // SAFETY: `control` is a live descriptor borrowed for the call; the argument is an integer.
    unsafe { ioctl(control, op) }?;
    Ok(())
}

/// Unbinds the loop device from its backing file (finished by the kernel on last close);
/// ENXIO when it is not bound.
pub fn clear_fd(device: impl AsFd) -> io::Result<()> {
    // SAFETY: LOOP_CLR_FD takes no argument.
    let op = unsafe { NoArg::<LOOP_CLR_FD>::new() };
    // SAFETY: `device` is a live descriptor borrowed for the call; no pointer is passed.
    unsafe { ioctl(device, op) }?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn huge_encode_dev_decodes() {
        let mut info = LoopInfo64::zeroed();
        // major 8, minor 3 (sda3) and major 259, minor 300000 (an nvme partition).
        info.lo_device = (8 << 8) | 3;
        assert_eq!(info.backing_dev(), (8, 3));
        let (major, minor) = (259u64, 300_000u64);
        info.lo_device = (minor & 0xff) | (major << 8) | ((minor & !0xff) << 12);
        assert_eq!(info.backing_dev(), (259, 300_000));
    }

    #[test]
    fn ioctls_on_a_regular_file_fail_cleanly() {
        let f = std::fs::File::open("/proc/self/status").unwrap();
        assert!(status(&f).is_err());
        assert!(clear_fd(&f).is_err());
        assert!(set_direct_io(&f, true).is_err());
        assert!(get_free(&f).is_err());
    }
}
