//! Filesystem ioctls the controller's embedded backend needs for group snapshots and snapshot
//! metadata:
//!
//! * `FIFREEZE` / `FITHAW` on any file of a mounted filesystem: block every new write to it
//!   (after writing back what is dirty), and let writes go again;
//! * `FS_IOC_FIEMAP` on a regular file: where its data lies on the device, extent by extent
//!   (reflinked files that share an extent report the same physical address for it).
//!
//! The wrappers are safe: each takes a borrowed descriptor and owns the memory the kernel reads
//! and writes.

use std::io;
use std::os::fd::AsFd;

use rustix::ioctl::{NoArg, Opcode, Updater, ioctl};

/// `FIFREEZE`, `_IOWR('X', 119, int)`: the argument is ignored.
const FIFREEZE: Opcode = 0xC004_5877;
/// `FITHAW`, `_IOWR('X', 120, int)`: the argument is ignored.
const FITHAW: Opcode = 0xC004_5878;
/// `FS_IOC_FIEMAP`, `_IOWR('f', 11, struct fiemap)`.
const FS_IOC_FIEMAP: Opcode = 0xC020_660B;

/// Freezes the filesystem `file` lies on: dirty data is written back and every new write to it
/// waits until [`thaw`]. EBUSY: it is frozen already. Needs CAP_SYS_ADMIN.
pub fn freeze(file: impl AsFd) -> io::Result<()> {
    // SAFETY: FIFREEZE takes no argument the kernel reads (the pointer passed is null).
    let op = unsafe { NoArg::<FIFREEZE>::new() };
    // SAFETY: `file` is a live descriptor borrowed for the call; no pointer is passed.
    unsafe { ioctl(file, op) }?;
    Ok(())
}

/// Thaws the filesystem `file` lies on. EINVAL: it was not frozen.
pub fn thaw(file: impl AsFd) -> io::Result<()> {
    // SAFETY: FITHAW takes no argument the kernel reads (the pointer passed is null).
    let op = unsafe { NoArg::<FITHAW>::new() };
    // SAFETY: `file` is a live descriptor borrowed for the call; no pointer is passed.
    unsafe { ioctl(file, op) }?;
    Ok(())
}

/// `FIEMAP_FLAG_SYNC`: write the file's dirty data back before mapping it.
pub const FIEMAP_FLAG_SYNC: u32 = 0x1;
/// `FIEMAP_EXTENT_LAST`: the file's last extent.
pub const FIEMAP_EXTENT_LAST: u32 = 0x1;
/// `FIEMAP_EXTENT_UNKNOWN`: the extent's place is not known yet.
pub const FIEMAP_EXTENT_UNKNOWN: u32 = 0x2;
/// `FIEMAP_EXTENT_DELALLOC`: not allocated yet (implies UNKNOWN).
pub const FIEMAP_EXTENT_DELALLOC: u32 = 0x4;
/// `FIEMAP_EXTENT_ENCODED`: the data is not stored as is (compressed, ...).
pub const FIEMAP_EXTENT_ENCODED: u32 = 0x8;
/// `FIEMAP_EXTENT_NOT_ALIGNED`: the extent is not block-aligned.
pub const FIEMAP_EXTENT_NOT_ALIGNED: u32 = 0x100;
/// `FIEMAP_EXTENT_DATA_INLINE`: the data lies in metadata (no address of its own).
pub const FIEMAP_EXTENT_DATA_INLINE: u32 = 0x200;
/// `FIEMAP_EXTENT_DATA_TAIL`: several files' tails share a block.
pub const FIEMAP_EXTENT_DATA_TAIL: u32 = 0x400;
/// `FIEMAP_EXTENT_UNWRITTEN`: allocated, reads as zeroes.
pub const FIEMAP_EXTENT_UNWRITTEN: u32 = 0x800;
/// `FIEMAP_EXTENT_SHARED`: the extent is shared with another file.
pub const FIEMAP_EXTENT_SHARED: u32 = 0x2000;

/// One extent of a file, as `struct fiemap_extent` reports it.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Extent {
    /// Byte offset in the file.
    pub logical: u64,
    /// Byte offset on the device.
    pub physical: u64,
    /// Length in bytes.
    pub length: u64,
    reserved64: [u64; 2],
    /// `FIEMAP_EXTENT_*` flags.
    pub flags: u32,
    reserved: [u32; 3],
}

/// How many extents one FIEMAP call asks for.
pub const EXTENTS_PER_CALL: usize = 128;

/// `struct fiemap` followed by room for [`EXTENTS_PER_CALL`] extents.
#[repr(C)]
#[derive(Debug)]
struct FiemapBuf {
    start: u64,
    length: u64,
    flags: u32,
    mapped_extents: u32,
    extent_count: u32,
    reserved: u32,
    extents: [Extent; EXTENTS_PER_CALL],
}

const _: () = assert!(std::mem::size_of::<Extent>() == 56);
const _: () = assert!(std::mem::size_of::<FiemapBuf>() == 32 + 56 * EXTENTS_PER_CALL);

/// The extents of `file` that overlap `[start, start + length)`, at most
/// [`EXTENTS_PER_CALL`] of them, in file order: call again from the end of the last one to go
/// on (an empty answer, or one whose last extent has [`FIEMAP_EXTENT_LAST`], ends the file).
/// EOPNOTSUPP: the filesystem cannot map files.
pub fn fiemap(file: impl AsFd, start: u64, length: u64, flags: u32) -> io::Result<Vec<Extent>> {
    let mut buf = FiemapBuf {
        start,
        length,
        flags,
        mapped_extents: 0,
        extent_count: EXTENTS_PER_CALL as u32,
        reserved: 0,
        extents: [Extent::default(); EXTENTS_PER_CALL],
    };
    // SAFETY: FS_IOC_FIEMAP reads a `struct fiemap` and writes up to `fm_extent_count`
    // `struct fiemap_extent` after it; `FiemapBuf` reproduces that layout (sizes checked at
    // compile time) with room for exactly `extent_count` extents.
    let op = unsafe { Updater::<FS_IOC_FIEMAP, FiemapBuf>::new(&mut buf) };
    // SAFETY: `file` is a live descriptor borrowed for the call, and `op` borrows `buf`
    // mutably for its duration.
    unsafe { ioctl(file, op) }?;
    let n = (buf.mapped_extents as usize).min(EXTENTS_PER_CALL);
    Ok(buf.extents[..n].to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::FileExt as _;

    #[test]
    fn fiemap_finds_the_written_extent() {
        let path = std::env::temp_dir().join(format!("moor-fiemap-{}", std::process::id()));
        let file = std::fs::File::options()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .expect("create");
        file.set_len(16 << 20).expect("size");
        file.write_all_at(&[1u8; 65536], 8 << 20).expect("write");
        let got = fiemap(&file, 0, u64::MAX, FIEMAP_FLAG_SYNC);
        let _ = std::fs::remove_file(&path);
        let extents = match got {
            Ok(e) => e,
            // tmpfs cannot map files: nothing to check here.
            Err(e) if e.raw_os_error() == Some(rustix::io::Errno::OPNOTSUPP.raw_os_error()) => {
                return;
            }
            Err(e) => panic!("fiemap: {e}"),
        };
        assert!(!extents.is_empty());
        let covered: u64 = extents
            .iter()
            .filter(|e| e.logical < (8 << 20) + 65536 && e.logical + e.length > 8 << 20)
            .map(|e| e.length)
            .sum();
        assert!(covered >= 65536, "{extents:?}");
        assert!(extents.iter().all(|e| e.logical + e.length > 8 << 20));
    }
}
