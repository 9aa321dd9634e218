//! Snapshot metadata of the embedded backend: which blocks of a snapshot file hold data, and
//! which differ between two snapshot files of one volume.
//!
//! * Allocated: the file's data segments (`SEEK_DATA`/`SEEK_HOLE`), widened to whole blocks.
//!   A filesystem that cannot report holes has every block allocated.
//! * Delta: both files' extent maps (`FIEMAP`) are walked side by side. Where both are holes,
//!   or both map the same place on the device (extents a reflink clone still shares), the data
//!   is the same and is not read. Everywhere else (an extent written since, a filesystem
//!   without reflinks, extents the filesystem cannot place) the two files are read and compared
//!   block by block, and only blocks that differ are reported. A filesystem that cannot map
//!   files at all is compared wherever either file has data. The result is exact at block
//!   granularity whatever the filesystem; reflinks only make it cheap.
//!
//! A part of the volume past the end of a (smaller, older) base reads as zeroes, as it did in
//! the volume before it grew.

use std::fs::File;
use std::os::unix::fs::FileExt as _;

use moor_runtime::sys::fsctl::{self, Extent};
use rustix::fs::SeekFrom;
use rustix::io::Errno;

use crate::backend::{BlockRanges as Ranges, MetadataSink};
use crate::error::{Error, Result};

/// The block size of every range reported: 4 KiB, the page size and the usual filesystem
/// block, so a block is the unit a filesystem on the volume writes.
pub const BLOCK: u64 = 4096;

/// How much of each file is read at a time when comparing.
const CHUNK: u64 = 1 << 20;

fn floor(n: u64) -> u64 {
    n / BLOCK * BLOCK
}

fn ceil(n: u64) -> u64 {
    n.div_ceil(BLOCK).saturating_mul(BLOCK)
}

fn io<'a>(step: &'static str, path: &'a std::path::Path) -> impl FnOnce(Errno) -> Error + 'a {
    move |e| Error::io(step, path, e.into())
}

/// The data segments of `file` within `[from, to)`, or None when the filesystem cannot tell.
fn data_segments(
    file: &File,
    path: &std::path::Path,
    from: u64,
    to: u64,
) -> Result<Option<Vec<(u64, u64)>>> {
    let mut out = Vec::new();
    let mut pos = from;
    while pos < to {
        let data = match rustix::fs::seek(file, SeekFrom::Data(pos)) {
            Ok(d) => d,
            Err(Errno::NXIO) => break,
            Err(Errno::INVAL | Errno::OPNOTSUPP) => return Ok(None),
            Err(e) => return Err(io("SEEK_DATA", path)(e)),
        };
        if data >= to {
            break;
        }
        let hole = rustix::fs::seek(file, SeekFrom::Hole(data))
            .map_err(io("SEEK_HOLE", path))?
            .min(to);
        out.push((data, hole));
        pos = hole;
    }
    Ok(Some(out))
}

/// The allocated blocks of the snapshot file from `start` on (see the module doc).
pub fn allocated(
    file: &File,
    path: &std::path::Path,
    capacity: u64,
    start: u64,
    sink: &mut dyn MetadataSink,
) -> Result<()> {
    sink.begin(capacity, BLOCK)?;
    let from = floor(start);
    let mut out = Ranges::new(sink);
    match data_segments(file, path, from, capacity)? {
        Some(segments) => {
            for (s, e) in segments {
                let s = floor(s).max(out.end());
                out.push(s, ceil(e).min(ceil(capacity)))?;
            }
        }
        None => out.push(from, ceil(capacity))?,
    }
    out.finish()
}

/// Flags that make an extent's physical address meaningless for comparing.
const UNPLACED: u32 = fsctl::FIEMAP_EXTENT_UNKNOWN
    | fsctl::FIEMAP_EXTENT_DELALLOC
    | fsctl::FIEMAP_EXTENT_ENCODED
    | fsctl::FIEMAP_EXTENT_DATA_INLINE
    | fsctl::FIEMAP_EXTENT_DATA_TAIL
    | fsctl::FIEMAP_EXTENT_NOT_ALIGNED;

/// The extents of `file` within `[from, to)`, or None when the filesystem cannot map files.
fn extents(file: &File, path: &std::path::Path, from: u64, to: u64) -> Result<Option<Vec<Extent>>> {
    let mut out: Vec<Extent> = Vec::new();
    let mut pos = from;
    while pos < to {
        let batch = match fsctl::fiemap(file, pos, to - pos, 0) {
            Ok(b) => b,
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(c) if c == Errno::OPNOTSUPP.raw_os_error() || c == Errno::NOTTY.raw_os_error()
                ) =>
            {
                return Ok(None);
            }
            Err(e) => return Err(Error::io("FIEMAP", path, e)),
        };
        let Some(last) = batch.last().copied() else {
            break;
        };
        let next = last.logical.saturating_add(last.length);
        out.extend(batch.into_iter().filter(|e| e.length > 0));
        if last.flags & fsctl::FIEMAP_EXTENT_LAST != 0 || next <= pos {
            break;
        }
        pos = next;
    }
    Ok(Some(out))
}

/// Walks one file's extents in order: the extent at a position, and where that answer changes.
struct Cursor<'a> {
    extents: &'a [Extent],
    i: usize,
}

impl<'a> Cursor<'a> {
    fn new(extents: &'a [Extent]) -> Self {
        Self { extents, i: 0 }
    }

    /// (extent containing `pos`, the next position where that may change).
    fn at(&mut self, pos: u64, to: u64) -> (Option<&'a Extent>, u64) {
        while self
            .extents
            .get(self.i)
            .is_some_and(|e| e.logical.saturating_add(e.length) <= pos)
        {
            self.i += 1;
        }
        match self.extents.get(self.i) {
            Some(e) if e.logical <= pos => (Some(e), e.logical.saturating_add(e.length).min(to)),
            Some(e) => (None, e.logical.min(to)),
            None => (None, to),
        }
    }
}

/// Parts of `[from, to)` where the two extent maps do not prove the data equal.
fn unproven(base: &[Extent], target: &[Extent], from: u64, to: u64) -> Vec<(u64, u64)> {
    let mut out: Vec<(u64, u64)> = Vec::new();
    let (mut b, mut t) = (Cursor::new(base), Cursor::new(target));
    let mut pos = from;
    while pos < to {
        let (eb, nb) = b.at(pos, to);
        let (et, nt) = t.at(pos, to);
        let next = nb.min(nt).max(pos + 1);
        let same = match (eb, et) {
            (None, None) => true,
            (Some(x), Some(y)) => {
                x.flags & UNPLACED == 0
                    && y.flags & UNPLACED == 0
                    && x.physical.wrapping_sub(x.logical) == y.physical.wrapping_sub(y.logical)
            }
            _ => false,
        };
        if !same {
            match out.last_mut() {
                Some((_, e)) if *e == pos => *e = next,
                _ => out.push((pos, next)),
            }
        }
        pos = next;
    }
    out
}

/// Reads `buf.len()` bytes at `at`; what lies past the end of the file reads as zeroes.
fn read_padded(file: &File, path: &std::path::Path, buf: &mut [u8], at: u64) -> Result<()> {
    let mut done = 0;
    while done < buf.len() {
        match file.read_at(&mut buf[done..], at + done as u64) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(Error::io("read", path, e)),
        }
    }
    buf[done..].fill(0);
    Ok(())
}

/// Two snapshot files to compare.
#[derive(Debug)]
pub struct Pair<'a> {
    /// The base snapshot's file and path.
    pub base: (&'a File, &'a std::path::Path),
    /// The target snapshot's file and path.
    pub target: (&'a File, &'a std::path::Path),
}

/// The blocks that differ between two snapshot files from `start` on (see the module doc);
/// `capacity` is the target's size.
pub fn delta(
    pair: &Pair<'_>,
    capacity: u64,
    start: u64,
    sink: &mut dyn MetadataSink,
) -> Result<()> {
    sink.begin(capacity, BLOCK)?;
    let from = floor(start);
    let to = ceil(capacity);
    let (bf, bp) = pair.base;
    let (tf, tp) = pair.target;
    let candidates = match (extents(bf, bp, from, to)?, extents(tf, tp, from, to)?) {
        (Some(b), Some(t)) => unproven(&b, &t, from, to),
        // No extent maps: compare wherever either file has data.
        _ => match (
            data_segments(bf, bp, from, to)?,
            data_segments(tf, tp, from, to)?,
        ) {
            (Some(mut b), Some(t)) => {
                b.extend(t);
                b.sort_unstable();
                let mut merged: Vec<(u64, u64)> = Vec::new();
                for (s, e) in b {
                    match merged.last_mut() {
                        Some((_, me)) if s <= *me => *me = (*me).max(e),
                        _ => merged.push((s, e)),
                    }
                }
                merged
            }
            _ => vec![(from, to)],
        },
    };
    let mut out = Ranges::new(sink);
    let mut a = vec![0u8; CHUNK as usize];
    let mut b = vec![0u8; CHUNK as usize];
    let mut done = from;
    for (s, e) in candidates {
        let mut pos = floor(s).max(done);
        let end = ceil(e).min(to);
        while pos < end {
            let n = (end - pos).min(CHUNK);
            let len = usize::try_from(n).unwrap_or(CHUNK as usize);
            read_padded(bf, bp, &mut a[..len], pos)?;
            read_padded(tf, tp, &mut b[..len], pos)?;
            for (i, (x, y)) in a[..len]
                .chunks(BLOCK as usize)
                .zip(b[..len].chunks(BLOCK as usize))
                .enumerate()
            {
                if x != y {
                    let at = pos + i as u64 * BLOCK;
                    out.push(at, at + BLOCK)?;
                }
            }
            pos += n;
        }
        done = done.max(end);
    }
    out.finish()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::CollectedBlocks;

    fn ext(logical: u64, physical: u64, length: u64) -> Extent {
        let mut e = Extent::default();
        e.logical = logical;
        e.physical = physical;
        e.length = length;
        e
    }

    #[test]
    fn shared_extents_and_common_holes_are_proven_equal() {
        const K: u64 = 4096;
        // Base: [0,8K) at 100K, [16K,24K) at 200K. Target shares the first, rewrote 16K-20K.
        let base = [ext(0, 100 * K, 2 * K), ext(4 * K, 200 * K, 2 * K)];
        let target = [
            ext(0, 100 * K, 2 * K),
            ext(4 * K, 300 * K, K),
            ext(5 * K, 201 * K, K),
            ext(8 * K, 400 * K, K),
        ];
        assert_eq!(
            unproven(&base, &target, 0, 12 * K),
            vec![(4 * K, 5 * K), (8 * K, 9 * K)]
        );
        // Same extents, one of them shifted: not the same data.
        let moved = [ext(0, 101 * K, 2 * K)];
        assert_eq!(unproven(&base[..1], &moved, 0, 2 * K), vec![(0, 2 * K)]);
        // Unknown placement is never proof.
        let mut unknown = base;
        unknown[0].flags = fsctl::FIEMAP_EXTENT_DELALLOC;
        assert_eq!(unproven(&base, &unknown, 0, 2 * K), vec![(0, 2 * K)]);
    }

    #[test]
    fn delta_names_the_changed_blocks_on_any_filesystem() {
        let dir = crate::embedded::testdir::TestDir::new("metadata-delta");
        let base_path = dir.path().join("base");
        let target_path = dir.path().join("target");
        let base = File::create_new(&base_path).unwrap();
        base.set_len(4 << 20).unwrap();
        base.write_all_at(&[1u8; 3 * 4096], 4096).unwrap();
        let target = File::create_new(&target_path).unwrap();
        target.set_len(8 << 20).unwrap();
        target.write_all_at(&[1u8; 3 * 4096], 4096).unwrap();
        target.write_all_at(&[2u8; 10], 2 * 4096 + 7).unwrap();
        target.write_all_at(&[3u8; 4096], 6 << 20).unwrap();
        // Zeroes written where the base has a hole: the same data.
        target.write_all_at(&[0u8; 4096], 1 << 20).unwrap();
        let (b, t) = (
            File::open(&base_path).unwrap(),
            File::open(&target_path).unwrap(),
        );
        let pair = Pair {
            base: (&b, &base_path),
            target: (&t, &target_path),
        };
        let mut sink = CollectedBlocks::default();
        delta(&pair, 8 << 20, 0, &mut sink).unwrap();
        assert_eq!(sink.ranges, vec![(2 * 4096, 4096), (6 << 20, 4096)]);
        let mut sink = CollectedBlocks::default();
        delta(&pair, 8 << 20, 3 * 4096, &mut sink).unwrap();
        assert_eq!(sink.ranges, vec![(6 << 20, 4096)]);
        let mut sink = CollectedBlocks::default();
        allocated(&t, &target_path, 8 << 20, 0, &mut sink).unwrap();
        let covered = |at: u64| sink.ranges.iter().any(|&(o, l)| o <= at && at < o + l);
        for at in [4096, 2 * 4096 + 7, 3 * 4096, 6 << 20] {
            assert!(covered(at), "{at} not in {:?}", sink.ranges);
        }
    }
}
