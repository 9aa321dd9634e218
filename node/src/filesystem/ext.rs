//! ext2, ext3 and ext4: made by mke2fs, checked by e2fsck, grown by resize2fs, and mounted by
//! the ext4 driver, which takes all three.

use std::path::Path;
use std::time::Duration;

use moor_runtime::contract::Filesystem;

use super::{FilesystemOps, Fsck, tool, with_force};
use crate::sys::ToolRun;

/// One of the ext family.
#[derive(Debug)]
pub struct Ext {
    fs: Filesystem,
    /// Whether mkfs zeroes the journal's blocks.
    zero_journal: bool,
}

// ext4's journal is checksummed with a seed from the filesystem's UUID (a fresh one, chosen
// for every mkfs), so blocks an earlier filesystem left where the journal goes can never be
// replayed: it need not be zeroed. ext3's journal has no checksums: zero it.
// (docs/durability.md has the measurements.) ext2 has no journal.

/// ext2.
pub static EXT2: Ext = Ext {
    fs: Filesystem::Ext2,
    zero_journal: false,
};
/// ext3.
pub static EXT3: Ext = Ext {
    fs: Filesystem::Ext3,
    zero_journal: true,
};
/// ext4.
pub static EXT4: Ext = Ext {
    fs: Filesystem::Ext4,
    zero_journal: false,
};

/// The options the ext4 driver takes (for ext2 and ext3 too).
const OPTIONS: &[&str] = &[
    "data",
    "barrier",
    "nobarrier",
    "discard",
    "nodiscard",
    "commit",
    "errors",
    "journal_checksum",
    "nojournal_checksum",
    "journal_async_commit",
    "delalloc",
    "nodelalloc",
    "dioread_nolock",
    "dioread_lock",
    "auto_da_alloc",
    "noauto_da_alloc",
    "max_batch_time",
    "min_batch_time",
    "stripe",
    "init_itable",
    "noinit_itable",
    "grpid",
    "bsdgroups",
    "nogrpid",
    "sysvgroups",
    "resgid",
    "resuid",
    "user_xattr",
    "acl",
    "noacl",
    "quota",
    "noquota",
    "usrquota",
    "grpquota",
    "prjquota",
    "inode_readahead_blks",
    "i_version",
    "nombcache",
    "block_validity",
    "noblock_validity",
    "journal_ioprio",
    "data_err",
];

impl FilesystemOps for Ext {
    fn kind(&self) -> Filesystem {
        self.fs
    }

    fn mkfs(&self, device: &Path, uuid: &str, force: bool, deadline: Duration) -> ToolRun {
        let args = vec![
            "-q".into(),
            "-U".into(),
            uuid.into(),
            "-E".into(),
            format!(
                "lazy_itable_init=1,lazy_journal_init={},nodiscard",
                u8::from(!self.zero_journal)
            ),
        ];
        let program = format!("mkfs.{}", self.fs.name());
        tool(program, with_force(args, force, "-F"), device, deadline)
    }

    /// e2fsck in preen mode, as `fsck -a` before a mount does in the field.
    fn fsck(&self, device: &Path, deadline: Duration) -> Option<Fsck> {
        Some(Fsck {
            run: tool("e2fsck".into(), vec!["-p".into()], device, deadline),
            by_hand: "e2fsck -f",
        })
    }

    /// resize2fs takes the device of the mounted filesystem.
    fn grow(&self, device: &Path, _mount_point: &Path, deadline: Duration) -> ToolRun {
        tool("resize2fs".into(), Vec::new(), device, deadline)
    }

    /// Any of the family: the ext4 driver mounts ext2 and ext3 as well.
    fn mounts(&self, found: Filesystem) -> bool {
        matches!(
            found,
            Filesystem::Ext2 | Filesystem::Ext3 | Filesystem::Ext4
        )
    }

    fn mount_options(&self) -> &'static [&'static str] {
        OPTIONS
    }
}
