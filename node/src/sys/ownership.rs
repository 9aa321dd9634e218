//! Giving a volume to its pod's group (the CSI `volume_mount_group`, kubelet's fsGroup).
//!
//! moor advertises VOLUME_MOUNT_GROUP, so kubelet leaves the pod's fsGroup to it and changes no
//! ownership itself. moor does what kubelet's `SetVolumeOwnership` would have done: every entry
//! of the filesystem gets the group; files become group-readable and -writable, directories
//! also group-searchable and setgid (new entries inherit the group); a symlink gets the group
//! itself, its mode and its target are left alone. Mode bits are only ever added.
//!
//! kubelet walks every time unless the pod asks for `OnRootMismatch`; moor is given no policy
//! and always takes the `OnRootMismatch` shortcut: when the root already has the group, group
//! rwx and setgid, nothing is walked. The root is changed last, after everything below it, so
//! a root that matches means a walk that finished (or a volume whose root was set up so on
//! purpose).
//!
//! The walk works by descriptor only: every entry is opened with `openat2(O_PATH | O_NOFOLLOW,
//! RESOLVE_BENEATH | RESOLVE_NO_XDEV | RESOLVE_NO_SYMLINKS)` relative to its directory's
//! descriptor, then changed through that descriptor (`fchownat` and `fchmodat2` with
//! `AT_EMPTY_PATH`): a symlink is never followed, a mount below the root is never entered, and
//! an entry swapped under the walk is never given a mode computed from another inode. It stops
//! at its deadline; run again, it skips what it already did at the cost of a stat.

use std::ffi::{CStr, OsStr};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use rustix::fs::{AtFlags, Dir, FileType, Gid, Mode, OFlags, ResolveFlags, Stat};
use rustix::io::Errno;

use super::SysError;
use super::raw;

/// Most directories open at once along one path: deeper trees are refused rather than
/// exhausting the daemon's descriptors.
pub const MAX_DEPTH: usize = 512;

/// The bits kubelet adds to every entry but a symlink: group read and write (and owner's).
const RW_BITS: u32 = 0o660;
/// The bits kubelet adds to a directory besides [`RW_BITS`]: search, and setgid.
const DIR_BITS: u32 = 0o110 | 0o2000;

/// What giving a volume to a group did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GroupReport {
    /// The root already had the group, group rwx and setgid: nothing was walked.
    pub skipped: bool,
    /// Entries looked at (the root included).
    pub entries: u64,
    /// Entries whose group or mode was changed.
    pub changed: u64,
    /// Entries the kernel refused to change (kubelet goes on past these too).
    pub refused: u64,
    /// The first refusal, for the log.
    pub first_refusal: Option<String>,
}

/// Why a volume could not be given to its group.
#[derive(Debug, thiserror::Error)]
pub enum OwnershipError {
    /// Opening, reading or inspecting the tree failed.
    #[error(transparent)]
    Sys(#[from] SysError),
    /// The walk ran past its deadline; what it did stays done.
    #[error(
        "giving {} to group {gid} did not finish within {deadline:?} ({entries} entries done); \
         a retry goes on from there",
        path.display()
    )]
    Deadline {
        /// The volume's mount.
        path: PathBuf,
        /// The group.
        gid: u32,
        /// The deadline it ran past.
        deadline: Duration,
        /// Entries looked at before it stopped.
        entries: u64,
    },
    /// A directory tree deeper than [`MAX_DEPTH`].
    #[error(
        "{} is more than {MAX_DEPTH} directories deep; its group cannot be set",
        path.display()
    )]
    TooDeep {
        /// The directory past the limit.
        path: PathBuf,
    },
}

/// The mode kubelet gives an entry of mode `mode` (permission, setuid/setgid and sticky bits).
pub fn wanted_mode(mode: u32, is_dir: bool) -> u32 {
    let mode = mode & 0o7777;
    if is_dir {
        mode | RW_BITS | DIR_BITS
    } else {
        mode | RW_BITS
    }
}

/// kubelet's `OnRootMismatch` test: whether the root already belongs to `gid`, with group rwx
/// and setgid.
pub fn root_matches(st: &Stat, gid: u32) -> bool {
    FileType::from_raw_mode(st.st_mode) == FileType::Directory
        && st.st_gid == gid
        && st.st_mode & 0o770 == 0o770
        && st.st_mode & 0o2000 != 0
}

/// One open directory of the walk.
struct Frame {
    dir: Dir,
    stat: Stat,
    path: PathBuf,
}

/// The walk's state.
struct Walk<'a> {
    gid: u32,
    root: &'a Path,
    deadline: Duration,
    stop_at: Instant,
    report: GroupReport,
}

/// Gives the filesystem whose root directory is `root` (opened for reading, `root_path` for
/// messages) to group `gid`, within `deadline`.
pub fn share(
    root: OwnedFd,
    root_path: &Path,
    gid: u32,
    deadline: Duration,
) -> Result<GroupReport, OwnershipError> {
    let stat = rustix::fs::fstat(&root).map_err(|e| SysError::new("stat", root_path, e))?;
    let mut walk = Walk {
        gid,
        root: root_path,
        deadline,
        stop_at: Instant::now() + deadline,
        report: GroupReport::default(),
    };
    if root_matches(&stat, gid) {
        walk.report.skipped = true;
        walk.report.entries = 1;
        return Ok(walk.report);
    }
    let dir = Dir::new(root).map_err(|e| SysError::new("read dir", root_path, e))?;
    let mut stack = vec![Frame {
        dir,
        stat,
        path: root_path.to_path_buf(),
    }];
    while let Some(top) = stack.last_mut() {
        walk.check_deadline()?;
        let entry = match top.dir.read() {
            Some(Ok(entry)) => entry,
            Some(Err(e)) => return Err(SysError::new("read dir", &top.path, e).into()),
            None => {
                // Everything below is done: now the directory itself, the root last of all.
                if let Some(done) = stack.pop() {
                    let fd = done
                        .dir
                        .fd()
                        .map_err(|e| SysError::new("read dir", &done.path, e))?;
                    walk.fix(fd, &done.stat, &done.path);
                }
                continue;
            }
        };
        let name = entry.file_name();
        if name == c"." || name == c".." {
            continue;
        }
        let parent = top
            .dir
            .fd()
            .map_err(|e| SysError::new("read dir", &top.path, e))?;
        let path = top.path.join(OsStr::from_bytes(name.to_bytes()));
        let Some(fd) = open_entry(parent, name, &path)? else {
            continue;
        };
        let stat = rustix::fs::fstat(&fd).map_err(|e| SysError::new("stat", &path, e))?;
        if FileType::from_raw_mode(stat.st_mode) != FileType::Directory {
            walk.fix(fd.as_fd(), &stat, &path);
            continue;
        }
        if stack.len() >= MAX_DEPTH {
            return Err(OwnershipError::TooDeep { path });
        }
        // A readable descriptor of the very directory the O_PATH one holds.
        let dir_fd = rustix::fs::openat(
            &fd,
            c".",
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| SysError::new("open dir", &path, e))?;
        let dir = Dir::new(dir_fd).map_err(|e| SysError::new("read dir", &path, e))?;
        stack.push(Frame { dir, stat, path });
    }
    Ok(walk.report)
}

/// Opens the entry `name` of `parent` as an O_PATH descriptor of the entry itself (a symlink's
/// own). `None` when it is gone, or is another mount's root (never entered).
fn open_entry(
    parent: BorrowedFd<'_>,
    name: &CStr,
    path: &Path,
) -> Result<Option<OwnedFd>, SysError> {
    match rustix::fs::openat2(
        parent,
        name,
        OFlags::PATH | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
        ResolveFlags::BENEATH
            | ResolveFlags::NO_XDEV
            | ResolveFlags::NO_SYMLINKS
            | ResolveFlags::NO_MAGICLINKS,
    ) {
        Ok(fd) => Ok(Some(fd)),
        Err(Errno::NOENT | Errno::XDEV) => Ok(None),
        Err(e) => Err(SysError::new("open", path, e)),
    }
}

impl Walk<'_> {
    fn check_deadline(&self) -> Result<(), OwnershipError> {
        if Instant::now() < self.stop_at {
            return Ok(());
        }
        Err(OwnershipError::Deadline {
            path: self.root.to_path_buf(),
            gid: self.gid,
            deadline: self.deadline,
            entries: self.report.entries,
        })
    }

    /// Gives the entry open as `fd`, whose stat is `st`, to the group, and its mode kubelet's
    /// bits. A refusal is counted, not fatal.
    fn fix(&mut self, fd: BorrowedFd<'_>, st: &Stat, path: &Path) {
        self.report.entries += 1;
        let file_type = FileType::from_raw_mode(st.st_mode);
        let mode = st.st_mode & 0o7777;
        let mut changed = false;
        if st.st_gid != self.gid {
            let r = rustix::fs::chownat(
                fd,
                c"",
                None,
                Some(Gid::from_raw(self.gid)),
                AtFlags::EMPTY_PATH,
            );
            if let Err(e) = r {
                self.refused("chown", path, e.into());
                return;
            }
            changed = true;
        }
        if file_type != FileType::Symlink {
            let want = wanted_mode(mode, file_type == FileType::Directory);
            // A chown clears setuid and setgid of a file: kubelet sets them back.
            let cleared = changed && mode & 0o6000 != 0;
            if want != mode || cleared {
                if let Err(e) = raw::fchmodat2_empty(fd, want) {
                    self.refused("chmod", path, e);
                    return;
                }
                changed = true;
            }
        }
        if changed {
            self.report.changed += 1;
        }
    }

    fn refused(&mut self, step: &'static str, path: &Path, e: std::io::Error) {
        self.report.refused += 1;
        if self.report.first_refusal.is_none() {
            self.report.first_refusal = Some(SysError::new(step, path, e).to_string());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_are_kubelets() {
        // Files: group (and owner) read-write added, nothing taken away.
        assert_eq!(wanted_mode(0o644, false), 0o664);
        assert_eq!(wanted_mode(0o600, false), 0o660);
        assert_eq!(wanted_mode(0o4755, false), 0o4775);
        assert_eq!(wanted_mode(0o100644, false), 0o664);
        // Directories: also search for owner and group, and setgid.
        assert_eq!(wanted_mode(0o755, true), 0o2775);
        assert_eq!(wanted_mode(0o700, true), 0o2770);
        assert_eq!(wanted_mode(0o1777, true), 0o3777);
    }
}
