//! XFS: made by mkfs.xfs, grown by xfs_growfs on its mount point, and never checked before a
//! mount: xfs is never repaired unattended; it replays its log at mount.

use std::path::Path;
use std::time::Duration;

use moor_runtime::contract::Filesystem;

use super::{FilesystemOps, tool, with_force};
use crate::sys::ToolRun;

/// XFS.
#[derive(Debug)]
pub struct Xfs;

/// The options the xfs driver takes.
const OPTIONS: &[&str] = &[
    "nouuid",
    "discard",
    "nodiscard",
    "inode32",
    "inode64",
    "largeio",
    "nolargeio",
    "logbufs",
    "logbsize",
    "allocsize",
    "filestreams",
    "grpid",
    "nogrpid",
    "bsdgroups",
    "sysvgroups",
    "ikeep",
    "noikeep",
    "swalloc",
    "wsync",
    "quota",
    "uquota",
    "usrquota",
    "gquota",
    "grpquota",
    "pquota",
    "prjquota",
    "noquota",
    "uqnoenforce",
    "gqnoenforce",
    "pqnoenforce",
    "qnoenforce",
    "sunit",
    "swidth",
    "dax",
];

impl FilesystemOps for Xfs {
    fn kind(&self) -> Filesystem {
        Filesystem::Xfs
    }

    fn mkfs(&self, device: &Path, uuid: &str, force: bool, deadline: Duration) -> ToolRun {
        let args = vec![
            "-q".into(),
            "-K".into(),
            "-m".into(),
            format!("uuid={uuid}"),
        ];
        tool(
            "mkfs.xfs".into(),
            with_force(args, force, "-f"),
            device,
            deadline,
        )
    }

    /// xfs_growfs takes the mount point.
    fn grow(&self, _device: &Path, mount_point: &Path, deadline: Duration) -> ToolRun {
        tool("xfs_growfs".into(), Vec::new(), mount_point, deadline)
    }

    fn mount_options(&self) -> &'static [&'static str] {
        OPTIONS
    }

    /// `nouuid`: clones and restored snapshots share their source's UUID; xfs refuses to mount
    /// a second filesystem with a UUID it already has mounted unless told otherwise.
    fn forced_options(&self) -> &'static [&'static str] {
        &["nouuid"]
    }
}
