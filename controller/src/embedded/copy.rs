//! Copying a volume's data into a snapshot or a new volume, keeping holes holes.
//!
//! First FICLONE: on a filesystem with reflinks (btrfs, xfs, bcachefs, ...) the copy shares
//! the source's extents and costs nothing. Otherwise the data segments are found with
//! SEEK_DATA/SEEK_HOLE and only they are copied (copy_file_range, or read/write where that is
//! refused), after sizing the destination, so every hole of the source stays a hole. When the
//! filesystem cannot report holes either, all-zero blocks are skipped instead.
//!
//! A thick volume must never share an extent: a block shared with another file is copied on
//! its next write, which needs space its reservation does not hold. So a copy from or into a
//! thick volume is [`Sharing::Private`]: neither FICLONE nor copy_file_range (which clones
//! where the filesystem can), only reads and writes.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt as _;

use rustix::fs::SeekFrom;
use rustix::io::Errno;

/// How the data was copied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CopyMethod {
    /// FICLONE: the extents are shared.
    Reflink,
    /// Only the data segments were copied.
    Sparse,
}

/// A copy step failed.
#[derive(Debug, thiserror::Error)]
#[error("{step}: {source}")]
pub struct CopyError {
    /// What was being done.
    pub step: &'static str,
    /// Why.
    #[source]
    pub source: io::Error,
}

impl CopyError {
    fn new(step: &'static str, source: impl Into<io::Error>) -> Self {
        Self {
            step,
            source: source.into(),
        }
    }

    /// Whether the filesystem ran out of space (or quota).
    pub fn is_no_space(&self) -> bool {
        matches!(
            self.source.raw_os_error(),
            Some(e) if e == Errno::NOSPC.raw_os_error() || e == Errno::DQUOT.raw_os_error()
        )
    }
}

const CHUNK: usize = 1 << 20;

/// Whether the copy may share the source's extents.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sharing {
    /// Clone (FICLONE) or let the filesystem clone (copy_file_range) where it can.
    Allowed,
    /// Never share an extent with the source: read and write.
    Private,
}

/// Copies `src` into the empty file `dst` and makes `dst` exactly `len` bytes long (a `len`
/// below the source's size copies only that much), sharing extents where the filesystem can.
/// `dst` is not fsynced here.
pub fn copy_sparse(src: &File, dst: &File, len: u64) -> Result<CopyMethod, CopyError> {
    copy(src, dst, len, Sharing::Allowed)
}

/// [`copy_sparse`], with `sharing` saying whether extents may be shared.
pub fn copy(src: &File, dst: &File, len: u64, sharing: Sharing) -> Result<CopyMethod, CopyError> {
    let src_len = src
        .metadata()
        .map_err(|e| CopyError::new("stat source", e))?
        .len();
    let share = sharing == Sharing::Allowed;
    if share && src_len <= len {
        match rustix::fs::ioctl_ficlone(dst, src) {
            Ok(()) => {
                dst.set_len(len)
                    .map_err(|e| CopyError::new("size destination", e))?;
                return Ok(CopyMethod::Reflink);
            }
            // Not supported here, or across these files: copy instead.
            Err(
                Errno::OPNOTSUPP
                | Errno::XDEV
                | Errno::INVAL
                | Errno::NOTTY
                | Errno::PERM
                | Errno::BADF
                | Errno::NOSYS,
            ) => {}
            Err(e) => return Err(CopyError::new("FICLONE", e)),
        }
    }
    dst.set_len(len)
        .map_err(|e| CopyError::new("size destination", e))?;
    let end = len.min(src_len);
    let mut pos = 0u64;
    while pos < end {
        let data = match rustix::fs::seek(src, SeekFrom::Data(pos)) {
            Ok(d) => d,
            // No data past `pos`: the rest is a hole.
            Err(Errno::NXIO) => break,
            // The filesystem cannot tell: copy the rest, skipping zero blocks.
            Err(Errno::INVAL | Errno::OPNOTSUPP) => {
                copy_range(src, dst, pos, end, true, share)?;
                break;
            }
            Err(e) => return Err(CopyError::new("SEEK_DATA", e)),
        };
        if data >= end {
            break;
        }
        let hole = rustix::fs::seek(src, SeekFrom::Hole(data))
            .map_err(|e| CopyError::new("SEEK_HOLE", e))?
            .min(end);
        copy_range(src, dst, data, hole, false, share)?;
        pos = hole;
    }
    Ok(CopyMethod::Sparse)
}

/// Copies `[start, end)` from `src` to the same offsets of `dst`; with copy_file_range when
/// `share` allows it.
fn copy_range(
    src: &File,
    dst: &File,
    start: u64,
    end: u64,
    skip_zeroes: bool,
    share: bool,
) -> Result<(), CopyError> {
    let mut pos = start;
    if share && !skip_zeroes {
        while pos < end {
            let want = usize::try_from(end - pos)
                .unwrap_or(usize::MAX)
                .min(1 << 30);
            let (mut off_in, mut off_out) = (pos, pos);
            match rustix::fs::copy_file_range(src, Some(&mut off_in), dst, Some(&mut off_out), want)
            {
                Ok(0) => break,
                Ok(n) => pos += n as u64,
                Err(Errno::XDEV | Errno::INVAL | Errno::NOSYS | Errno::OPNOTSUPP) => break,
                Err(e) => return Err(CopyError::new("copy_file_range", e)),
            }
        }
    }
    let mut buf = vec![0u8; CHUNK];
    while pos < end {
        let want = usize::try_from(end - pos).unwrap_or(CHUNK).min(CHUNK);
        let n = src
            .read_at(&mut buf[..want], pos)
            .map_err(|e| CopyError::new("read source", e))?;
        if n == 0 {
            break;
        }
        let chunk = &buf[..n];
        if !(skip_zeroes && chunk.iter().all(|&b| b == 0)) {
            dst.write_all_at(chunk, pos)
                .map_err(|e| CopyError::new("write destination", e))?;
        }
        pos += n as u64;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::embedded::testdir::TestDir;
    use std::os::unix::fs::MetadataExt as _;

    const MIB: u64 = 1 << 20;

    #[test]
    fn sparse_copy_keeps_data_and_holes() {
        let dir = TestDir::new("copy-sparse");
        let src_path = dir.path().join("src");
        let src = File::create_new(&src_path).unwrap();
        src.set_len(64 * MIB).unwrap();
        src.write_all_at(b"head", 0).unwrap();
        src.write_all_at(&[7u8; 4096], 20 * MIB).unwrap();
        src.write_all_at(b"tail", 64 * MIB - 4).unwrap();
        src.sync_all().unwrap();
        let src = File::open(&src_path).unwrap();
        let dst = File::options()
            .read(true)
            .write(true)
            .create_new(true)
            .open(dir.path().join("dst"))
            .unwrap();
        copy_sparse(&src, &dst, 64 * MIB).unwrap();
        dst.sync_all().unwrap();
        let meta = dst.metadata().unwrap();
        assert_eq!(meta.len(), 64 * MIB);
        // Far less than 64 MiB allocated: the holes stayed holes.
        assert!(meta.blocks() * 512 < 8 * MIB, "{} blocks", meta.blocks());
        let mut b = [0u8; 4];
        dst.read_exact_at(&mut b, 0).unwrap();
        assert_eq!(&b, b"head");
        dst.read_exact_at(&mut b, 64 * MIB - 4).unwrap();
        assert_eq!(&b, b"tail");
        let mut block = vec![0u8; 4096];
        dst.read_exact_at(&mut block, 20 * MIB).unwrap();
        assert!(block.iter().all(|&x| x == 7));
        dst.read_exact_at(&mut block, 30 * MIB).unwrap();
        assert!(block.iter().all(|&x| x == 0));
    }

    #[test]
    fn copy_into_a_larger_destination() {
        let dir = TestDir::new("copy-grow");
        let src_path = dir.path().join("src");
        std::fs::write(&src_path, b"abc").unwrap();
        let src = File::open(&src_path).unwrap();
        let dst = File::options()
            .read(true)
            .write(true)
            .create_new(true)
            .open(dir.path().join("dst"))
            .unwrap();
        assert_eq!(copy_sparse(&src, &dst, MIB).unwrap(), CopyMethod::Sparse);
        assert_eq!(dst.metadata().unwrap().len(), MIB);
        let mut b = [0u8; 3];
        dst.read_exact_at(&mut b, 0).unwrap();
        assert_eq!(&b, b"abc");
    }

    #[test]
    fn zero_skipping_fallback() {
        let dir = TestDir::new("copy-zeroes");
        let src_path = dir.path().join("src");
        let mut data = vec![0u8; 3 * CHUNK];
        data[CHUNK * 2 + 5] = 9;
        std::fs::write(&src_path, &data).unwrap();
        let src = File::open(&src_path).unwrap();
        let dst = File::options()
            .read(true)
            .write(true)
            .create_new(true)
            .open(dir.path().join("dst"))
            .unwrap();
        dst.set_len(data.len() as u64).unwrap();
        copy_range(&src, &dst, 0, data.len() as u64, true, true).unwrap();
        assert_eq!(std::fs::read(dir.path().join("dst")).unwrap(), data);
    }
}
