//! The live mount table of the calling thread's mount namespace, read once per
//! reconciliation: `listmount(2)` + `statmount(2)` where the kernel has them (Linux 6.8),
//! `/proc/thread-self/mountinfo` otherwise.

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt as _;
use std::path::PathBuf;

use super::raw;
use crate::sys::mountinfo;

/// One mount.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountEntry {
    /// Mount id (unique 64-bit from statmount, the reusable one from mountinfo).
    pub id: u64,
    /// The parent mount's id.
    pub parent: u64,
    /// Device of the mounted filesystem.
    pub dev: (u32, u32),
    /// Path inside the filesystem that is mounted (e.g. `/loop3` for a device node bind).
    pub root: PathBuf,
    /// Where it is mounted.
    pub mount_point: PathBuf,
    /// Filesystem type.
    pub fs_type: String,
    /// Mount source (e.g. `/dev/loop3`).
    pub source: String,
}

/// Where a table came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TableSource {
    /// listmount + statmount.
    Statmount,
    /// /proc/thread-self/mountinfo.
    Mountinfo,
}

/// Why a table could not be read.
#[derive(Debug, thiserror::Error)]
pub enum TableError {
    /// listmount failed (other than being absent from the kernel).
    #[error("listmount: {0}")]
    Listmount(#[source] std::io::Error),
    /// statmount failed for a mount.
    #[error("statmount of mount {id}: {source}")]
    Statmount {
        /// The mount id.
        id: u64,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A statmount answer did not parse.
    #[error("statmount of mount {id}: {source}")]
    Decode {
        /// The mount id.
        id: u64,
        /// Why.
        #[source]
        source: StatmountError,
    },
    /// mountinfo could not be read.
    #[error("reading mountinfo: {0}")]
    ReadMountinfo(#[source] std::io::Error),
    /// mountinfo did not parse.
    #[error("parsing mountinfo: {0}")]
    ParseMountinfo(#[from] mountinfo::ParseError),
}

/// Why a `struct statmount` buffer is unusable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StatmountError {
    /// Shorter than the fixed header.
    #[error("answer of {0} bytes is shorter than the header")]
    Short(usize),
    /// The kernel did not fill a field that was asked for.
    #[error("the kernel did not return {0}")]
    Missing(&'static str),
    /// A string offset points outside the answer or has no terminating NUL.
    #[error("string {0} lies outside the answer")]
    BadString(&'static str),
}

/// `STATMOUNT_SB_BASIC`.
pub const STATMOUNT_SB_BASIC: u64 = 0x1;
/// `STATMOUNT_MNT_BASIC`.
pub const STATMOUNT_MNT_BASIC: u64 = 0x2;
/// `STATMOUNT_MNT_ROOT`.
pub const STATMOUNT_MNT_ROOT: u64 = 0x8;
/// `STATMOUNT_MNT_POINT`.
pub const STATMOUNT_MNT_POINT: u64 = 0x10;
/// `STATMOUNT_FS_TYPE`.
pub const STATMOUNT_FS_TYPE: u64 = 0x20;
/// `STATMOUNT_SB_SOURCE`.
pub const STATMOUNT_SB_SOURCE: u64 = 0x200;
/// What moor asks statmount for.
pub const MASK: u64 = STATMOUNT_SB_BASIC
    | STATMOUNT_MNT_BASIC
    | STATMOUNT_MNT_ROOT
    | STATMOUNT_MNT_POINT
    | STATMOUNT_FS_TYPE
    | STATMOUNT_SB_SOURCE;

/// Size of `struct statmount` before its string area (constant across kernel versions).
pub const HEADER_LEN: usize = 512;

fn u32_at(buf: &[u8], off: usize) -> u32 {
    buf.get(off..off + 4)
        .and_then(|b| b.try_into().ok())
        .map_or(0, u32::from_ne_bytes)
}

fn u64_at(buf: &[u8], off: usize) -> u64 {
    buf.get(off..off + 8)
        .and_then(|b| b.try_into().ok())
        .map_or(0, u64::from_ne_bytes)
}

fn string_at<'a>(
    buf: &'a [u8],
    size: usize,
    field: usize,
    name: &'static str,
) -> Result<&'a [u8], StatmountError> {
    let off = u32_at(buf, field) as usize;
    let area = buf
        .get(HEADER_LEN..size)
        .ok_or(StatmountError::BadString(name))?;
    let tail = area.get(off..).ok_or(StatmountError::BadString(name))?;
    let end = tail
        .iter()
        .position(|&b| b == 0)
        .ok_or(StatmountError::BadString(name))?;
    Ok(&tail[..end])
}

/// Decodes a `struct statmount` answer asked with [`MASK`]. Never panics.
pub fn parse_statmount(buf: &[u8]) -> Result<MountEntry, StatmountError> {
    if buf.len() < HEADER_LEN {
        return Err(StatmountError::Short(buf.len()));
    }
    let size = (u32_at(buf, 0) as usize).min(buf.len());
    if size < HEADER_LEN {
        return Err(StatmountError::Short(size));
    }
    let mask = u64_at(buf, 8);
    for (bit, name) in [
        (STATMOUNT_SB_BASIC, "sb_basic"),
        (STATMOUNT_MNT_BASIC, "mnt_basic"),
        (STATMOUNT_MNT_ROOT, "mnt_root"),
        (STATMOUNT_MNT_POINT, "mnt_point"),
        (STATMOUNT_FS_TYPE, "fs_type"),
    ] {
        if mask & bit == 0 {
            return Err(StatmountError::Missing(name));
        }
    }
    let source = if mask & STATMOUNT_SB_SOURCE != 0 {
        String::from_utf8_lossy(string_at(buf, size, 124, "sb_source")?).into_owned()
    } else {
        String::new()
    };
    Ok(MountEntry {
        id: u64_at(buf, 40),
        parent: u64_at(buf, 48),
        dev: (u32_at(buf, 16), u32_at(buf, 20)),
        root: PathBuf::from(OsStr::from_bytes(string_at(buf, size, 104, "mnt_root")?)),
        mount_point: PathBuf::from(OsStr::from_bytes(string_at(buf, size, 108, "mnt_point")?)),
        fs_type: String::from_utf8_lossy(string_at(buf, size, 36, "fs_type")?).into_owned(),
        source,
    })
}

/// Reads the table with listmount + statmount; `Ok(None)` when the kernel lacks them.
fn read_statmount() -> Result<Option<Vec<MountEntry>>, TableError> {
    let mut ids = Vec::new();
    let mut chunk = vec![0u64; 4096];
    let mut after = 0;
    loop {
        let n = match raw::listmount(after, &mut chunk) {
            Ok(n) => n,
            Err(e) if e.raw_os_error() == Some(libc::ENOSYS) && ids.is_empty() => return Ok(None),
            Err(e) => return Err(TableError::Listmount(e)),
        };
        let got = chunk.get(..n).unwrap_or_default();
        ids.extend_from_slice(got);
        match got.last() {
            Some(&last) if n == chunk.len() => after = last,
            _ => break,
        }
    }
    let mut buf = vec![0u8; 4096];
    let mut table = Vec::with_capacity(ids.len());
    for id in ids {
        loop {
            match raw::statmount(id, MASK, &mut buf) {
                Ok(()) => break,
                Err(e) if e.raw_os_error() == Some(libc::EOVERFLOW) && buf.len() < 1 << 20 => {
                    buf.resize(buf.len() * 4, 0);
                }
                // Unmounted between listmount and statmount.
                Err(e) if e.raw_os_error() == Some(libc::ENOENT) => break,
                Err(source) => return Err(TableError::Statmount { id, source }),
            }
        }
        if u32_at(&buf, 0) == 0 {
            continue;
        }
        let entry = parse_statmount(&buf).map_err(|source| TableError::Decode { id, source })?;
        buf.fill(0);
        table.push(entry);
    }
    Ok(Some(table))
}

fn read_mountinfo() -> Result<Vec<MountEntry>, TableError> {
    let bytes = std::fs::read("/proc/thread-self/mountinfo").map_err(TableError::ReadMountinfo)?;
    Ok(mountinfo::parse(&bytes)?
        .into_iter()
        .map(|m| MountEntry {
            id: m.mount_id,
            parent: m.parent_id,
            dev: m.dev(),
            root: m.root,
            mount_point: m.mount_point,
            fs_type: m.fs_type,
            source: m.source,
        })
        .collect())
}

/// The mount table of the calling thread's mount namespace, and where it came from.
pub fn read() -> Result<(Vec<MountEntry>, TableSource), TableError> {
    match read_statmount()? {
        Some(t) => Ok((t, TableSource::Statmount)),
        None => Ok((read_mountinfo()?, TableSource::Mountinfo)),
    }
}

/// The table from mountinfo, for comparison and for kernels without statmount.
pub fn read_from_mountinfo() -> Result<Vec<MountEntry>, TableError> {
    read_mountinfo()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(strings: &[(usize, &str)], mask: u64) -> Vec<u8> {
        let mut buf = vec![0u8; HEADER_LEN];
        buf[8..16].copy_from_slice(&mask.to_ne_bytes());
        buf[16..20].copy_from_slice(&7u32.to_ne_bytes());
        buf[20..24].copy_from_slice(&3u32.to_ne_bytes());
        buf[40..48].copy_from_slice(&0x1_0000_0042u64.to_ne_bytes());
        buf[48..56].copy_from_slice(&0x1_0000_0001u64.to_ne_bytes());
        for (field, s) in strings {
            let off = (buf.len() - HEADER_LEN) as u32;
            buf[*field..*field + 4].copy_from_slice(&off.to_ne_bytes());
            buf.extend_from_slice(s.as_bytes());
            buf.push(0);
        }
        let size = buf.len() as u32;
        buf[0..4].copy_from_slice(&size.to_ne_bytes());
        buf
    }

    #[test]
    fn decodes_a_statmount_answer() {
        let buf = answer(
            &[
                (104, "/"),
                (108, "/k/globalmount"),
                (36, "ext4"),
                (124, "/dev/loop3"),
            ],
            MASK,
        );
        let e = parse_statmount(&buf).unwrap();
        assert_eq!(e.id, 0x1_0000_0042);
        assert_eq!(e.parent, 0x1_0000_0001);
        assert_eq!(e.dev, (7, 3));
        assert_eq!(e.mount_point, PathBuf::from("/k/globalmount"));
        assert_eq!(e.root, PathBuf::from("/"));
        assert_eq!(e.fs_type, "ext4");
        assert_eq!(e.source, "/dev/loop3");
    }

    #[test]
    fn refuses_damaged_answers() {
        assert_eq!(parse_statmount(&[0; 10]), Err(StatmountError::Short(10)));
        let partial = answer(&[(104, "/")], STATMOUNT_SB_BASIC | STATMOUNT_MNT_BASIC);
        assert!(matches!(
            parse_statmount(&partial),
            Err(StatmountError::Missing(_))
        ));
        let mut bad = answer(
            &[(104, "/"), (108, "/m"), (36, "xfs")],
            MASK & !STATMOUNT_SB_SOURCE,
        );
        bad[108..112].copy_from_slice(&9999u32.to_ne_bytes());
        assert_eq!(
            parse_statmount(&bad),
            Err(StatmountError::BadString("mnt_point"))
        );
        // No terminating NUL.
        let mut open = answer(
            &[(104, "/"), (108, "/m"), (36, "xfs")],
            MASK & !STATMOUNT_SB_SOURCE,
        );
        open.pop();
        let size = open.len() as u32;
        open[0..4].copy_from_slice(&size.to_ne_bytes());
        assert_eq!(
            parse_statmount(&open),
            Err(StatmountError::BadString("fs_type"))
        );
    }

    #[test]
    fn statmount_and_mountinfo_agree() {
        let (table, source) = read().unwrap();
        let info = read_from_mountinfo().unwrap();
        if source == TableSource::Statmount {
            let mut a: Vec<_> = table.iter().map(|m| (&m.mount_point, m.dev)).collect();
            let mut b: Vec<_> = info.iter().map(|m| (&m.mount_point, m.dev)).collect();
            a.sort();
            b.sort();
            assert_eq!(a, b);
        }
    }
}
