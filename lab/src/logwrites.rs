//! The log of device-mapper's `log-writes` target, read and replayed (the format is the
//! kernel's, `Documentation/admin-guide/device-mapper/log-writes.rst`): every write a device
//! took, in the order it completed, with its flushes (FLUSH, FUA) and the marks a test adds.
//! Replaying a prefix of the log onto a copy of the device as it was at the start gives the
//! device as a power cut at that point could have left it.
//!
//! Layout (little-endian, in units of the device's logical block, `sectorsize`): block 0 is
//! the super (`magic`, `version`, `nr_entries`, `sectorsize`); each entry is one block holding
//! `sector`, `nr_sectors`, `flags`, `data_len` (and a mark's text after them), followed by its
//! `nr_sectors` blocks of data (none for a discard or a mark).

use std::fs::File;
use std::io::{self, Read as _, Seek as _, SeekFrom};
use std::os::unix::fs::FileExt as _;
use std::path::Path;

/// The super's magic.
pub const MAGIC: u64 = 0x006a_7366_7773_6872;
/// A flush: what was written before it is durable.
pub const FLUSH: u64 = 1 << 0;
/// A write that was durable when it completed.
pub const FUA: u64 = 1 << 1;
/// A discard.
pub const DISCARD: u64 = 1 << 2;
/// A mark a test added (`dmsetup message <dev> 0 mark <name>`).
pub const MARK: u64 = 1 << 3;

/// One entry of the log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// Its index.
    pub index: usize,
    /// The first block written (in `sectorsize` units).
    pub sector: u64,
    /// How many blocks.
    pub nr_sectors: u64,
    /// FLUSH, FUA, DISCARD, MARK.
    pub flags: u64,
    /// A mark's text.
    pub mark: Option<String>,
    /// Where its data starts in the log, in bytes.
    pub data_at: u64,
}

impl Entry {
    /// Whether the device's state after this entry is one a power cut can leave with
    /// everything before it durable: a flush or a FUA write.
    pub fn is_durable_point(&self) -> bool {
        self.flags & (FLUSH | FUA) != 0
    }
}

/// A log, read.
#[derive(Debug)]
pub struct Log {
    file: File,
    /// The device's logical block size.
    pub sectorsize: u64,
    /// Its entries, in order.
    pub entries: Vec<Entry>,
}

fn le64(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

impl Log {
    /// Reads the log in `path`.
    pub fn open(path: &Path) -> io::Result<Self> {
        let mut file = File::open(path)?;
        let mut sup = [0u8; 28];
        file.read_exact(&mut sup)?;
        if le64(&sup, 0) != MAGIC {
            return Err(io::Error::other(format!(
                "{} is not a log-writes log (magic {:#x})",
                path.display(),
                le64(&sup, 0)
            )));
        }
        let nr = le64(&sup, 16);
        let sectorsize = u64::from(u32::from_le_bytes([sup[24], sup[25], sup[26], sup[27]]));
        if !(512..=65536).contains(&sectorsize) || !sectorsize.is_power_of_two() {
            return Err(io::Error::other(format!("bad sector size {sectorsize}")));
        }
        let len = file.seek(SeekFrom::End(0))?;
        let mut entries = Vec::new();
        let mut at = sectorsize;
        let mut block = vec![0u8; sectorsize as usize];
        for index in 0..nr as usize {
            if at + sectorsize > len {
                break;
            }
            file.read_exact_at(&mut block, at)?;
            let (sector, nr_sectors, flags, data_len) = (
                le64(&block, 0),
                le64(&block, 8),
                le64(&block, 16),
                le64(&block, 24),
            );
            let mark = (flags & MARK != 0).then(|| {
                let end = (32 + data_len as usize).min(block.len());
                String::from_utf8_lossy(&block[32..end]).into_owned()
            });
            let data_at = at + sectorsize;
            let data_blocks = if flags & (DISCARD | MARK) != 0 {
                0
            } else {
                nr_sectors
            };
            entries.push(Entry {
                index,
                sector,
                nr_sectors,
                flags,
                mark,
                data_at,
            });
            at = data_at + data_blocks * sectorsize;
        }
        Ok(Self {
            file,
            sectorsize,
            entries,
        })
    }

    /// The index of the mark `name`.
    pub fn mark(&self, name: &str) -> Option<usize> {
        self.entries
            .iter()
            .find(|e| e.mark.as_deref() == Some(name))
            .map(|e| e.index)
    }

    /// Applies entry `e` to `dev` (a discard zeroes its range: what a device that discards
    /// may read back).
    pub fn apply(&self, e: &Entry, dev: &File) -> io::Result<()> {
        if e.flags & MARK != 0 || e.nr_sectors == 0 {
            return Ok(());
        }
        let len = (e.nr_sectors * self.sectorsize) as usize;
        let buf = if e.flags & DISCARD != 0 {
            vec![0u8; len]
        } else {
            let mut b = vec![0u8; len];
            self.file.read_exact_at(&mut b, e.data_at)?;
            b
        };
        dev.write_all_at(&buf, e.sector * self.sectorsize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A log as the kernel writes it: the super, then each entry's block and its data.
    fn log_of(entries: &[(u64, u64, u64, &[u8])]) -> Vec<u8> {
        let ss = 512usize;
        let mut out = vec![0u8; ss];
        out[0..8].copy_from_slice(&MAGIC.to_le_bytes());
        out[8..16].copy_from_slice(&1u64.to_le_bytes());
        out[16..24].copy_from_slice(&(entries.len() as u64).to_le_bytes());
        out[24..28].copy_from_slice(&(ss as u32).to_le_bytes());
        for (sector, nr, flags, data) in entries {
            let mut block = vec![0u8; ss];
            block[0..8].copy_from_slice(&sector.to_le_bytes());
            block[8..16].copy_from_slice(&nr.to_le_bytes());
            block[16..24].copy_from_slice(&flags.to_le_bytes());
            block[24..32].copy_from_slice(&(data.len() as u64).to_le_bytes());
            if flags & MARK != 0 {
                block[32..32 + data.len()].copy_from_slice(data);
                out.extend_from_slice(&block);
            } else {
                out.extend_from_slice(&block);
                let mut d = data.to_vec();
                d.resize(*nr as usize * ss, 0);
                out.extend_from_slice(&d);
            }
        }
        out
    }

    #[test]
    fn a_log_is_read_and_its_prefixes_replayed() {
        let dir = std::env::temp_dir().join(format!("moor-logwrites-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("log");
        std::fs::write(
            &path,
            log_of(&[
                (2, 1, 0, b"first"),
                (0, 0, FLUSH, b""),
                (0, 0, MARK, b"synced"),
                (3, 2, FUA, b"second"),
                (2, 1, DISCARD, b""),
            ]),
        )
        .unwrap();
        let log = Log::open(&path).unwrap();
        assert_eq!(log.sectorsize, 512);
        assert_eq!(log.entries.len(), 5);
        assert_eq!(log.mark("synced"), Some(2));
        let durable: Vec<usize> = log
            .entries
            .iter()
            .filter(|e| e.is_durable_point())
            .map(|e| e.index)
            .collect();
        assert_eq!(durable, vec![1, 3]);
        let dev_path = dir.join("dev");
        let dev = File::create(&dev_path).unwrap();
        dev.set_len(8 * 512).unwrap();
        for e in &log.entries[..4] {
            log.apply(e, &dev).unwrap();
        }
        let image = std::fs::read(&dev_path).unwrap();
        assert_eq!(&image[2 * 512..2 * 512 + 5], b"first");
        assert_eq!(&image[3 * 512..3 * 512 + 6], b"second");
        log.apply(&log.entries[4], &dev).unwrap();
        let image = std::fs::read(&dev_path).unwrap();
        assert!(image[2 * 512..3 * 512].iter().all(|b| *b == 0), "discarded");
        std::fs::write(&path, b"not a log at all, not at all, no").unwrap();
        assert!(Log::open(&path).is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
