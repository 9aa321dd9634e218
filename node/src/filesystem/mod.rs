//! What differs from one filesystem to another, behind one trait.
//!
//! The engine formats, checks, mounts and grows every filesystem the same way; what it runs
//! and which options it passes come from the filesystem's [`FilesystemOps`], looked up with
//! [`ops`]: [`ext`] for ext2, ext3 and ext4, [`xfs`] and [`btrfs`]. Nothing here runs
//! anything: the methods say what to run, and the engine runs it through the OS layer.

pub mod btrfs;
pub mod ext;
pub mod xfs;

use std::path::Path;
use std::time::Duration;

use moor_runtime::contract::Filesystem;

use crate::sys::ToolRun;

/// fsck(8)'s exit code bits, which a check's run answers with: errors corrected; corrected,
/// and a reboot would be due (for the root filesystem); errors left uncorrected.
pub const FSCK_CORRECTED: i32 = 1;
/// See [`FSCK_CORRECTED`].
pub const FSCK_CORRECTED_REBOOT: i32 = 2;
/// See [`FSCK_CORRECTED`].
pub const FSCK_UNCORRECTED: i32 = 4;

/// A filesystem's check before a read-write mount.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fsck {
    /// The run in preen mode: it repairs what is safe to repair unattended, stops at anything
    /// else, and answers with fsck(8)'s exit codes ([`FSCK_CORRECTED`] and the others).
    pub run: ToolRun,
    /// The command a person runs to repair by hand what the preen run leaves.
    pub by_hand: &'static str,
}

/// What the engine needs to know of one filesystem family.
pub trait FilesystemOps: Sync {
    /// Which filesystem these are the operations of.
    fn kind(&self) -> Filesystem;

    /// The run that makes this filesystem, with UUID `uuid`, on `device` (a held device's
    /// handle). `force` overwrites what is there: only for a device moor itself was formatting
    /// when it was interrupted.
    fn mkfs(&self, device: &Path, uuid: &str, force: bool, deadline: Duration) -> ToolRun;

    /// The check of an existing filesystem on `device` before it is mounted read-write, for a
    /// filesystem with a check that repairs unattended; None (the default) for one that is
    /// never repaired unattended.
    fn fsck(&self, _device: &Path, _deadline: Duration) -> Option<Fsck> {
        None
    }

    /// The run that grows the filesystem mounted at `mount_point` from `device` to the
    /// device's size, online.
    fn grow(&self, device: &Path, mount_point: &Path, deadline: Duration) -> ToolRun;

    /// Whether the filesystem `found` on a device can be mounted as this one.
    fn mounts(&self, found: Filesystem) -> bool {
        found == self.kind()
    }

    /// The filesystem options (`key` or the key of `key=value`) its driver takes, besides the
    /// superblock flags every filesystem takes and the SELinux labels.
    fn mount_options(&self) -> &'static [&'static str];

    /// Options every mount of it gets, asked for or not.
    fn forced_options(&self) -> &'static [&'static str] {
        &[]
    }

    /// Whether a mount of it carries its device's number, so that the mount can be told to be
    /// the device's.
    fn mount_shows_device(&self) -> bool {
        true
    }
}

/// The operations of `fs`.
#[must_use]
pub fn ops(fs: Filesystem) -> &'static dyn FilesystemOps {
    match fs {
        Filesystem::Ext2 => &ext::EXT2,
        Filesystem::Ext3 => &ext::EXT3,
        Filesystem::Ext4 => &ext::EXT4,
        Filesystem::Xfs => &xfs::Xfs,
        Filesystem::Btrfs => &btrfs::Btrfs,
    }
}

/// Every program the filesystems' operations run (mkfs, the check, growing), each once, in the
/// order of [`Filesystem::ALL`].
#[must_use]
pub fn programs() -> Vec<String> {
    let (dev, deadline) = (Path::new("/dev/null"), Duration::ZERO);
    let mut out: Vec<String> = Vec::new();
    for fs in Filesystem::ALL {
        let o = ops(fs);
        let runs = [
            Some(o.mkfs(dev, "", false, deadline)),
            o.fsck(dev, deadline).map(|f| f.run),
            Some(o.grow(dev, dev, deadline)),
        ];
        for run in runs.into_iter().flatten() {
            if !out.contains(&run.program) {
                out.push(run.program);
            }
        }
    }
    out
}

/// A run of `program` with `args`, then the device or mount point `path` last.
fn tool(program: String, mut args: Vec<String>, path: &Path, deadline: Duration) -> ToolRun {
    args.push(path.display().to_string());
    ToolRun {
        program,
        args,
        deadline,
    }
}

/// mkfs's arguments: `args`, then the force flag when asked for.
fn with_force(mut args: Vec<String>, force: bool, flag: &str) -> Vec<String> {
    if force {
        args.push(flag.into());
    }
    args
}

#[cfg(test)]
mod tests {
    use super::*;

    const DEADLINE: Duration = Duration::from_secs(1);

    fn words(run: &ToolRun) -> String {
        format!("{} {}", run.program, run.args.join(" "))
    }

    #[test]
    fn programs_are_every_tool_the_operations_run() {
        assert_eq!(
            programs(),
            [
                "mkfs.ext2",
                "e2fsck",
                "resize2fs",
                "mkfs.ext3",
                "mkfs.ext4",
                "mkfs.xfs",
                "xfs_growfs",
                "mkfs.btrfs",
                "btrfs"
            ]
        );
    }

    #[test]
    fn mkfs_names_the_uuid_and_forces_only_when_asked() {
        let dev = Path::new("/dev/loop7");
        let expected = [
            "mkfs.ext2 -q -U U -E lazy_itable_init=1,lazy_journal_init=1,nodiscard",
            "mkfs.ext3 -q -U U -E lazy_itable_init=1,lazy_journal_init=0,nodiscard",
            "mkfs.ext4 -q -U U -E lazy_itable_init=1,lazy_journal_init=1,nodiscard",
            "mkfs.xfs -q -K -m uuid=U",
            "mkfs.btrfs -q -K -U U",
        ];
        for (fs, want) in Filesystem::ALL.into_iter().zip(expected) {
            let run = ops(fs).mkfs(dev, "U", false, DEADLINE);
            assert_eq!(words(&run), format!("{want} /dev/loop7"), "{fs:?}");
            assert_eq!(run.deadline, DEADLINE);
            let forced = words(&ops(fs).mkfs(dev, "U", true, DEADLINE));
            let flag = if fs.name().starts_with("ext") {
                "-F"
            } else {
                "-f"
            };
            assert_eq!(forced, format!("{want} {flag} /dev/loop7"), "{fs:?}");
        }
    }

    #[test]
    fn only_ext_is_checked_and_each_family_grows_with_its_tool() {
        let (dev, mnt) = (Path::new("/dev/loop7"), Path::new("/mnt/v"));
        for fs in Filesystem::ALL {
            let check = ops(fs).fsck(dev, DEADLINE);
            let grow = words(&ops(fs).grow(dev, mnt, DEADLINE));
            match fs.name() {
                "xfs" => {
                    assert_eq!(check, None);
                    assert_eq!(grow, "xfs_growfs /mnt/v");
                }
                "btrfs" => {
                    assert_eq!(check, None);
                    assert_eq!(grow, "btrfs filesystem resize max /mnt/v");
                }
                _ => {
                    let check = check.expect("ext has a check");
                    assert_eq!(words(&check.run), "e2fsck -p /dev/loop7");
                    assert_eq!(check.by_hand, "e2fsck -f");
                    assert_eq!(grow, "resize2fs /dev/loop7");
                }
            }
        }
    }

    #[test]
    fn ext_family_mounts_each_other_and_the_rest_only_themselves() {
        for wanted in Filesystem::ALL {
            for found in Filesystem::ALL {
                let ext = |f: Filesystem| f.name().starts_with("ext");
                let same_family = found == wanted || (ext(found) && ext(wanted));
                assert_eq!(
                    ops(wanted).mounts(found),
                    same_family,
                    "{found:?} as {wanted:?}"
                );
            }
        }
    }

    #[test]
    fn only_btrfs_mounts_hide_their_device_and_only_xfs_forces_an_option() {
        for fs in Filesystem::ALL {
            assert_eq!(ops(fs).mount_shows_device(), fs != Filesystem::Btrfs);
            let forced: &[&str] = if fs == Filesystem::Xfs {
                &["nouuid"]
            } else {
                &[]
            };
            assert_eq!(ops(fs).forced_options(), forced);
            assert!(!ops(fs).mount_options().is_empty());
        }
    }
}
