//! The safe floor of a publish+unpublish: the system calls moor-node makes for one
//! NodePublishVolume + NodeUnpublishVolume of a staged filesystem volume, replayed raw in the
//! bench's process with no moor code, so that a paired bench can say what moor's own code adds
//! above the calls its safety needs, and what those calls add above the bare mkdir + bind +
//! umount2 + rmdir.
//!
//! The sequence is the one `strace -f` shows on the daemon (docs/performance.md, "the pair call
//! by call"), each call with the same flags:
//!
//! * publish: the staging path resolved beneath the kubelet dir without symlinks
//!   (`openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS)`) and checked to be
//!   a mount root (`statx`) and read-only or not (`fstatfs`); the target resolved the same way
//!   (absent); its parent resolved and the target made in it (`mkdirat`); the journal's record
//!   written; the checked staging mount cloned (`open_tree`), the target opened by its name in
//!   the parent (`openat2`) and the clone attached on it (`move_mount`); the journal's record
//!   written again; the daemon's log lines;
//! * unpublish: the journal's record; the target's parent resolved; the target opened in it and
//!   checked (`statx`, `fstatfs`); `umount2` of `/proc/self/fd/<parent>/<name>` with
//!   `UMOUNT_NOFOLLOW`; the target opened and checked again (no mount stacked under it); the
//!   target removed (`unlinkat(AT_REMOVEDIR)`); the journal's record; the log lines.
//!
//! The journal's records and the log lines are the very bytes moor-node wrote for one pair
//! (learnt from its files before the run), appended with `write(2)` and no sync, as moor writes
//! them (a publication's records are not synced: mounts do not outlive a reboot), to files on
//! the same filesystems as moor's; the journal's compaction is replayed at moor's cadence. The
//! two null gRPC calls of the floor are the caller's.

use std::ffi::{OsStr, OsString};
use std::fs::{File, OpenOptions};
use std::io::Write as _;
use std::os::fd::{AsRawFd as _, OwnedFd};
use std::os::unix::ffi::OsStrExt as _;
use std::path::{Path, PathBuf};

use rustix::fs::{AtFlags, CWD, Mode, OFlags, ResolveFlags, StatxAttributes, StatxFlags};
use rustix::mount::{MoveMountFlags, OpenTreeFlags, UnmountFlags};

/// `STATX_MNT_ID_UNIQUE`, as moor-node asks it.
const STATX_MNT_ID_UNIQUE: u32 = 0x4000;

/// Lines appended beyond four per live record before moor-node's journal compacts.
const COMPACT_SLACK: usize = 1024;

/// What one side of a moor pair wrote: the journal's lines and the log's, in order.
#[derive(Debug, Clone, Default)]
pub struct Written {
    /// The journal's records (each one `write(2)`).
    pub journal: Vec<Vec<u8>>,
    /// The log lines (each one `write(2)`).
    pub log: Vec<Vec<u8>>,
}

/// What moor-node wrote for one publish and one unpublish.
#[derive(Debug, Clone, Default)]
pub struct PairWrites {
    /// NodePublishVolume's.
    pub publish: Written,
    /// NodeUnpublishVolume's.
    pub unpublish: Written,
}

/// The lines appended to `path` since it was `from` bytes long (None when it shrank: a
/// compaction or a rotation in between).
fn lines_since(path: &Path, from: u64) -> Option<Vec<Vec<u8>>> {
    let all = std::fs::read(path).ok()?;
    let from = usize::try_from(from).ok()?;
    let new = all.get(from..)?;
    Some(
        new.split_inclusive(|b| *b == b'\n')
            .map(<[u8]>::to_vec)
            .collect(),
    )
}

fn len_of(path: &Path) -> u64 {
    std::fs::metadata(path).map(|m| m.len()).unwrap_or(0)
}

/// One side of a pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Call {
    /// NodePublishVolume.
    Publish,
    /// NodeUnpublishVolume.
    Unpublish,
}

/// Learns what moor-node writes for a pair: `call`s a publish then an unpublish (one pair of
/// the daemon's) and reads what each appended to its `journal` and its `log`. Retries a few pairs
/// when a compaction of the journal fell inside one.
pub fn learn(journal: &Path, log: &Path, mut call: impl FnMut(Call)) -> PairWrites {
    for _ in 0..4 {
        let (j0, l0) = (len_of(journal), len_of(log));
        call(Call::Publish);
        let (j1, l1) = (len_of(journal), len_of(log));
        call(Call::Unpublish);
        let (j2, l2) = (len_of(journal), len_of(log));
        let (Some(pj), Some(pl), Some(uj), Some(ul)) = (
            lines_since(journal, j0).filter(|_| j1 >= j0),
            lines_since(log, l0).filter(|_| l1 >= l0),
            lines_since(journal, j1).filter(|_| j2 >= j1),
            lines_since(log, l1).filter(|_| l2 >= l1),
        ) else {
            continue;
        };
        // What the publish appended is what was there before the unpublish began.
        let cut = |lines: Vec<Vec<u8>>, upto: u64, from: u64| {
            let mut left = upto.saturating_sub(from) as usize;
            lines
                .into_iter()
                .take_while(|l| {
                    let take = left >= l.len();
                    left = left.saturating_sub(l.len());
                    take
                })
                .collect::<Vec<_>>()
        };
        let writes = PairWrites {
            publish: Written {
                journal: cut(pj, j1, j0),
                log: cut(pl, l1, l0),
            },
            unpublish: Written {
                journal: uj,
                log: ul,
            },
        };
        assert!(
            !writes.publish.journal.is_empty() && !writes.unpublish.journal.is_empty(),
            "moor-node wrote no journal record for a pair in {}: {writes:?}",
            journal.display()
        );
        return writes;
    }
    panic!(
        "could not learn moor-node's writes of a pair from {} and {}: each try was cut by a compaction",
        journal.display(),
        log.display()
    );
}

/// The pair's system calls, replayed raw on a staging mount and a target of the bench's own
/// below the kubelet dir.
#[derive(Debug)]
pub struct SafeFloor {
    root: OwnedFd,
    staging_rel: PathBuf,
    target_rel: PathBuf,
    parent_rel: PathBuf,
    name: OsString,
    writes: PairWrites,
    journal_dir: PathBuf,
    journal: File,
    journal_lines: usize,
    log: File,
}

/// The resolution moor-node makes of every path below the kubelet dir.
fn open_beneath(dir: &OwnedFd, rel: &Path, flags: OFlags) -> rustix::io::Result<OwnedFd> {
    rustix::fs::openat2(
        dir,
        rel,
        flags | OFlags::PATH | OFlags::CLOEXEC | OFlags::NOFOLLOW,
        Mode::empty(),
        ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS,
    )
}

/// moor-node's check of what an opened path is: a mount root or not (`statx`), and for a
/// mount root whether it is read-only (`fstatfs`). Whether it is a mount root.
fn check(fd: &OwnedFd) -> bool {
    let stx = rustix::fs::statx(
        fd,
        "",
        AtFlags::EMPTY_PATH | AtFlags::SYMLINK_NOFOLLOW,
        StatxFlags::TYPE | StatxFlags::from_bits_retain(STATX_MNT_ID_UNIQUE),
    )
    .expect("statx");
    let root = stx
        .stx_attributes_mask
        .contains(StatxAttributes::MOUNT_ROOT)
        && stx.stx_attributes.contains(StatxAttributes::MOUNT_ROOT);
    if root {
        rustix::fs::fstatvfs(fd).expect("fstatfs");
    }
    root
}

fn rel(root: &Path, path: &Path) -> PathBuf {
    path.strip_prefix(root)
        .expect("below the kubelet dir")
        .to_path_buf()
}

impl SafeFloor {
    /// The replay of `writes` on the filesystem mounted at `staging` (a staging path below
    /// `kubelet`) into `target` (a target path below it whose parent exists); the journal's
    /// lines go to a file of its own in `journal_dir` (moor-node's state dir), the log lines to
    /// `log`.
    pub fn new(
        kubelet: &Path,
        staging: &Path,
        target: &Path,
        writes: PairWrites,
        journal_dir: &Path,
        log: &Path,
    ) -> Self {
        let root = rustix::fs::open(
            kubelet,
            OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .expect("open the kubelet dir");
        let target_rel = rel(kubelet, target);
        let append = |p: &Path| {
            OpenOptions::new()
                .create(true)
                .append(true)
                .open(p)
                .expect("the replay's file")
        };
        let journal_dir = journal_dir.to_path_buf();
        let journal = append(&journal_dir.join("safe-floor-journal.log"));
        Self {
            root,
            staging_rel: rel(kubelet, staging),
            parent_rel: target_rel.parent().expect("a parent").to_path_buf(),
            name: target_rel.file_name().expect("a name").to_os_string(),
            target_rel,
            writes,
            journal,
            journal_dir,
            journal_lines: 0,
            log: append(log),
        }
    }

    /// One record appended, as moor's journal appends it; at moor's cadence, the log
    /// compacted as moor compacts an unsynced one (the live record written to a temp file,
    /// renamed over the log, reopened, its mark written).
    fn record(&mut self, line: &[u8]) {
        self.journal.write_all(line).expect("journal write");
        self.journal_lines += 1;
        if self.journal_lines > 4 + COMPACT_SLACK {
            let path = self.journal_dir.join("safe-floor-journal.log");
            let tmp = self.journal_dir.join("safe-floor-journal.log.tmp");
            let mut f = File::create(&tmp).expect("compaction's temp file");
            f.write_all(line).expect("compaction's write");
            drop(f);
            std::fs::rename(&tmp, &path).expect("compaction's rename");
            self.journal = OpenOptions::new()
                .append(true)
                .open(&path)
                .expect("the compacted log");
            let mark = OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(false)
                .open(self.journal_dir.join("safe-floor-journal.log.synced"))
                .expect("the mark");
            std::os::unix::fs::FileExt::write_all_at(&mark, &[0u8; 12], 0).expect("mark");
            self.journal_lines = 1;
        }
    }

    fn log_lines(&mut self, lines: &[Vec<u8>]) {
        for l in lines {
            self.log.write_all(l).expect("log write");
        }
    }

    /// NodePublishVolume's system calls.
    pub fn publish(&mut self) {
        let writes = std::mem::take(&mut self.writes);
        let staging = open_beneath(&self.root, &self.staging_rel, OFlags::empty())
            .expect("resolve the staging path");
        assert!(check(&staging), "the staging path is a mount");
        match open_beneath(&self.root, &self.target_rel, OFlags::empty()) {
            Err(rustix::io::Errno::NOENT) => {}
            other => panic!("the target is absent before a publish: {other:?}"),
        }
        let parent = open_beneath(&self.root, &self.parent_rel, OFlags::DIRECTORY)
            .expect("resolve the target's parent");
        rustix::fs::mkdirat(&parent, &self.name, Mode::from_raw_mode(0o750)).expect("mkdirat");
        let name = self.name.clone();
        // The records before the bind, the bind, the record after it.
        let (after, before) = writes
            .publish
            .journal
            .split_last()
            .expect("a publish's records");
        for line in before {
            self.record(line);
        }
        self.bind(&staging, &parent, &name);
        self.record(after);
        drop(parent);
        drop(staging);
        self.log_lines(&writes.publish.log);
        self.writes = writes;
    }

    /// The bind: the checked staging mount cloned and attached on the target opened in its
    /// parent.
    fn bind(&self, staging: &OwnedFd, parent: &OwnedFd, name: &OsStr) {
        let tree = rustix::mount::open_tree(
            staging,
            "",
            OpenTreeFlags::OPEN_TREE_CLONE
                | OpenTreeFlags::OPEN_TREE_CLOEXEC
                | OpenTreeFlags::AT_EMPTY_PATH,
        )
        .expect("open_tree");
        let target = open_beneath(parent, Path::new(name), OFlags::empty()).expect("open target");
        rustix::mount::move_mount(
            &tree,
            "",
            &target,
            "",
            MoveMountFlags::MOVE_MOUNT_F_EMPTY_PATH | MoveMountFlags::MOVE_MOUNT_T_EMPTY_PATH,
        )
        .expect("move_mount");
    }

    /// NodeUnpublishVolume's system calls.
    pub fn unpublish(&mut self) {
        let writes = std::mem::take(&mut self.writes);
        let mut records = writes.unpublish.journal.iter();
        if let Some(first) = records.next() {
            self.record(first);
        }
        let parent = open_beneath(&self.root, &self.parent_rel, OFlags::DIRECTORY)
            .expect("resolve the target's parent");
        let name = Path::new(&self.name);
        let target = open_beneath(&parent, name, OFlags::empty()).expect("open the target");
        assert!(check(&target), "the target is a mount");
        drop(target);
        let mut proc_path = format!("/proc/self/fd/{}/", parent.as_raw_fd()).into_bytes();
        proc_path.extend_from_slice(self.name.as_bytes());
        rustix::mount::unmount(OsStr::from_bytes(&proc_path), UnmountFlags::NOFOLLOW)
            .expect("umount2");
        let target = open_beneath(&parent, name, OFlags::empty()).expect("open the target");
        assert!(!check(&target), "nothing stacked on the target");
        drop(target);
        rustix::fs::unlinkat(&parent, name, AtFlags::REMOVEDIR).expect("unlinkat");
        for line in records {
            self.record(line);
        }
        drop(parent);
        self.log_lines(&writes.unpublish.log);
        self.writes = writes;
    }

    /// A publish and an unpublish.
    pub fn pair(&mut self) {
        self.publish();
        self.unpublish();
    }
}

impl Drop for SafeFloor {
    fn drop(&mut self) {
        // A pair cut short by a panic: nothing left on the target (the sandbox unmounts the
        // rest).
        let target = PathBuf::from("/proc/self/fd")
            .join(self.root.as_raw_fd().to_string())
            .join(&self.target_rel);
        let _ = rustix::mount::unmount(&target, UnmountFlags::NOFOLLOW | UnmountFlags::DETACH);
        let _ = rustix::fs::unlinkat(CWD, &target, AtFlags::REMOVEDIR);
    }
}
