//! btrfs: made by mkfs.btrfs, grown by `btrfs filesystem resize` on its mount point, never
//! checked before a mount (btrfs is never repaired unattended; it checks itself), and mounted
//! under a device number of its own.

use std::path::Path;
use std::time::Duration;

use moor_runtime::contract::Filesystem;

use super::{FilesystemOps, tool, with_force};
use crate::sys::ToolRun;

/// btrfs.
#[derive(Debug)]
pub struct Btrfs;

/// The options the btrfs driver takes.
const OPTIONS: &[&str] = &[
    "compress",
    "compress-force",
    "ssd",
    "nossd",
    "ssd_spread",
    "nossd_spread",
    "discard",
    "nodiscard",
    "autodefrag",
    "noautodefrag",
    "space_cache",
    "nospace_cache",
    "commit",
    "datacow",
    "nodatacow",
    "datasum",
    "nodatasum",
    "flushoncommit",
    "noflushoncommit",
    "max_inline",
    "barrier",
    "nobarrier",
    "subvol",
    "subvolid",
    "thread_pool",
    "user_subvol_rm_allowed",
    "skip_balance",
    "notreelog",
    "treelog",
    "acl",
    "noacl",
];

impl FilesystemOps for Btrfs {
    fn kind(&self) -> Filesystem {
        Filesystem::Btrfs
    }

    fn mkfs(&self, device: &Path, uuid: &str, force: bool, deadline: Duration) -> ToolRun {
        let args = vec!["-q".into(), "-K".into(), "-U".into(), uuid.into()];
        tool(
            "mkfs.btrfs".into(),
            with_force(args, force, "-f"),
            device,
            deadline,
        )
    }

    /// `btrfs filesystem resize max` takes the mount point.
    fn grow(&self, _device: &Path, mount_point: &Path, deadline: Duration) -> ToolRun {
        let args = vec!["filesystem".into(), "resize".into(), "max".into()];
        tool("btrfs".into(), args, mount_point, deadline)
    }

    fn mount_options(&self) -> &'static [&'static str] {
        OPTIONS
    }

    /// No: btrfs gives its mounts an anonymous device number, nothing to compare with the
    /// device's.
    fn mount_shows_device(&self) -> bool {
        false
    }
}
