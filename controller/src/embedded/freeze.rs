//! Holding the writes of in-use volumes while a group snapshot is cut.
//!
//! A group snapshot must be write-order consistent: if a write to one member completed before
//! a write to another was issued, no member snapshot may hold the second without the first.
//! Cloning the members' files one after the other gives no such guarantee while they are
//! written. So before the first clone, the filesystem on each member's loop device is frozen
//! (`FIFREEZE`: its dirty data written through the device to the volume's file, every new
//! write held until the thaw), all members are cloned, and then all are thawed. A write that
//! completed before its filesystem froze is in the clone; one that did not waits for the thaw,
//! after the last clone: any write issued after it waits too, so no later write can be in a
//! snapshot its predecessor is missing from.
//!
//! The controller can only freeze what it can see: a member attached read-write must be a
//! filesystem mounted in the controller's mount namespace (the embedded backend's node is this
//! host). A member attached read-write that is not (a raw block volume, or a mount hidden from
//! the controller) cannot be held, and the group snapshot is refused with FAILED_PRECONDITION
//! rather than cut inconsistent. Members not attached, or attached read-only, take no writes.
//!
//! The filesystems about to be frozen are recorded first ([`FreezeRecord`]), and a controller
//! killed while they are frozen thaws them at its next start.

use std::fs::File;
use std::io;
use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};

use tracing::{info, warn};

use super::records::{FreezeRecord, RecordStore};
use crate::error::{Error, Result};

/// A filesystem to freeze: a mount point of it, and the device it is on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mounted {
    /// Where it is mounted (the first mount of it in the mount table).
    pub mount_point: PathBuf,
    /// The device (`st_rdev` of the loop device) as (major, minor).
    pub device: (u32, u32),
}

/// Undoes the mount table's octal escapes (`\040` for a space, ...).
fn unescape(field: &str) -> PathBuf {
    use std::os::unix::ffi::OsStringExt as _;
    let b = field.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let octal = |c: u8| (b'0'..=b'7').contains(&c);
        if b[i] == b'\\' && i + 3 < b.len() && b[i + 1..i + 4].iter().all(|&c| octal(c)) {
            out.push((b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0'));
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    PathBuf::from(std::ffi::OsString::from_vec(out))
}

/// The first mount point of the filesystem on `device` in a mountinfo table, if any.
pub fn mount_of(mountinfo: &str, device: (u32, u32)) -> Option<PathBuf> {
    let want = format!("{}:{}", device.0, device.1);
    mountinfo.lines().find_map(|line| {
        let mut fields = line.split(' ');
        let dev = fields.nth(2)?;
        let mount_point = fields.nth(1)?;
        (dev == want).then(|| unescape(mount_point))
    })
}

/// The device number of a block device node.
pub fn device_number(device: &Path) -> Result<(u32, u32)> {
    let meta = std::fs::metadata(device).map_err(|e| Error::io("stat", device, e))?;
    let rdev = meta.rdev();
    Ok((rustix::fs::major(rdev), rustix::fs::minor(rdev)))
}

/// The mount table of the calling thread's mount namespace.
pub fn mount_table() -> Result<String> {
    let path = Path::new("/proc/thread-self/mountinfo");
    std::fs::read_to_string(path).map_err(|e| Error::io("read", path, e))
}

/// Frozen filesystems, thawed (last frozen first) and their record removed on drop.
#[derive(Debug)]
pub struct Frozen<'a> {
    store: &'a RecordStore,
    /// (mount point, its open root) of each frozen filesystem, in freezing order.
    held: Vec<(PathBuf, File)>,
    recorded: bool,
}

impl<'a> Frozen<'a> {
    /// Records, then freezes, each filesystem in turn; on a failure, thaws those already
    /// frozen and fails. `data_dev` is the data dir's filesystem, which is never frozen (the
    /// clones are written there).
    pub fn freeze(store: &'a RecordStore, mounts: &[Mounted], data_dev: u64) -> Result<Self> {
        let mut frozen = Frozen {
            store,
            held: Vec::new(),
            recorded: false,
        };
        if mounts.is_empty() {
            return Ok(frozen);
        }
        let mut roots = Vec::with_capacity(mounts.len());
        for m in mounts {
            let root =
                File::open(&m.mount_point).map_err(|e| Error::io("open", &m.mount_point, e))?;
            let dev = root
                .metadata()
                .map_err(|e| Error::io("stat", &m.mount_point, e))?
                .dev();
            if dev == data_dev {
                return Err(Error::GroupRefused(format!(
                    "{} holds the controller's data dir and cannot be frozen while snapshots \
                     are written to it",
                    m.mount_point.display()
                )));
            }
            roots.push((m.mount_point.clone(), root));
        }
        store.put_freeze(&FreezeRecord {
            mounts: mounts.iter().map(|m| m.mount_point.clone()).collect(),
        })?;
        frozen.recorded = true;
        for (path, root) in roots {
            match moor_runtime::sys::fsctl::freeze(&root) {
                Ok(()) => frozen.held.push((path, root)),
                Err(e) if e.raw_os_error() == Some(rustix::io::Errno::BUSY.raw_os_error()) => {
                    return Err(Error::Unavailable(format!(
                        "the filesystem at {} is frozen by someone else; retry once it is thawed",
                        path.display()
                    )));
                }
                Err(e) => return Err(Error::io("FIFREEZE", &path, e)),
            }
        }
        Ok(frozen)
    }

    /// How many filesystems are frozen.
    pub fn count(&self) -> usize {
        self.held.len()
    }
}

impl Drop for Frozen<'_> {
    fn drop(&mut self) {
        let mut all_thawed = true;
        while let Some((path, root)) = self.held.pop() {
            if let Err(e) = moor_runtime::sys::fsctl::thaw(&root) {
                all_thawed = false;
                warn!(mount = %path.display(), error = %e, "cannot thaw; start-up will retry");
            }
        }
        if self.recorded
            && all_thawed
            && let Err(e) = self.store.remove_freeze()
        {
            warn!(error = %e, "cannot remove the freeze record; start-up will");
        }
    }
}

/// Thaws what a killed controller left frozen (start-up); returns the mount points it thawed.
/// A filesystem that is not frozen, or no longer mounted there, is fine.
pub fn thaw_left_over(
    store: &RecordStore,
    rec: &FreezeRecord,
    problems: &mut Vec<String>,
) -> Vec<PathBuf> {
    let mut ok = true;
    let mut thawed = Vec::new();
    for m in &rec.mounts {
        let result = File::open(m).and_then(|root| match moor_runtime::sys::fsctl::thaw(&root) {
            Ok(()) => Ok(true),
            Err(e) if e.raw_os_error() == Some(rustix::io::Errno::INVAL.raw_os_error()) => {
                Ok(false)
            }
            Err(e) => Err(e),
        });
        match result {
            Ok(true) => {
                info!(mount = %m.display(), "thawed what a group snapshot left frozen");
                thawed.push(m.clone());
            }
            Ok(false) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => {
                ok = false;
                problems.push(format!("thaw {}: {e}", m.display()));
            }
        }
    }
    if ok && let Err(e) = store.remove_freeze() {
        problems.push(format!("remove the freeze record: {e}"));
    }
    thawed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mounts_are_found_by_device() {
        let table = "\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
40 22 7:3 / /var/lib/kubelet/a\\040b/globalmount rw - ext4 /dev/loop3 rw
41 22 7:3 / /var/lib/kubelet/pods/x/mount rw - ext4 /dev/loop3 rw
";
        assert_eq!(
            mount_of(table, (7, 3)),
            Some(PathBuf::from("/var/lib/kubelet/a b/globalmount"))
        );
        assert_eq!(mount_of(table, (8, 1)), Some(PathBuf::from("/")));
        assert_eq!(mount_of(table, (7, 30)), None);
        assert_eq!(mount_of("garbage\n\n1 2", (7, 3)), None);
        assert_eq!(unescape("a\\134b\\"), PathBuf::from("a\\b\\"));
    }
}
