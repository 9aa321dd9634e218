//! Mount options: what a `VolumeCapability.mount.mount_flags` list may say, and what it means.
//!
//! Every option is checked against an allow-list before anything reaches the kernel: the
//! per-mount flags the new mount API enforces (`ro`, `nosuid`, `noatime`, ...), and per
//! filesystem the options its driver understands. Options that change what or how something
//! is mounted (`bind`, `remount`, propagation, `loop`, ...) or that hurt the node (`errors=panic`,
//! `noload`) are refused with the option named.

use crate::sys::{Atime, MountAttrs};

/// A filesystem moor can format and mount.
pub use crate::probe::Filesystem;

/// Why a mount option list was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OptionError {
    /// An option moor does not know or does not allow for this filesystem.
    #[error("mount option {option:?} is not supported for {fs}")]
    Unsupported {
        /// The option as given.
        option: String,
        /// The filesystem.
        fs: String,
    },
    /// An option that would change what is mounted or endanger the node.
    #[error("mount option {0:?} is not allowed")]
    Forbidden(String),
    /// A value with characters no option value needs.
    #[error("mount option {0:?} has a malformed value")]
    BadValue(String),
    /// Two options contradict each other.
    #[error("mount options {0:?} and {1:?} contradict each other")]
    Conflict(String, String),
}

/// Parsed mount options.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MountOptions {
    /// Per-mount flags.
    pub attrs: MountAttrs,
    /// Filesystem options (`key` or `key=value`) for fsconfig, in the order given.
    pub fs_options: Vec<String>,
}

/// Options that never reach the kernel from a user.
const FORBIDDEN: &[&str] = &[
    "bind",
    "rbind",
    "move",
    "remount",
    "loop",
    "offset",
    "sizelimit",
    "user",
    "users",
    "owner",
    "group",
    "nofail",
    "shared",
    "rshared",
    "slave",
    "rslave",
    "private",
    "rprivate",
    "unbindable",
    "runbindable",
    "make-shared",
    "make-rshared",
    "make-slave",
    "make-rslave",
    "make-private",
    "make-rprivate",
    "make-unbindable",
    "make-runbindable",
    "noload",
    "norecovery",
    "errors=panic",
    "mand",
    "degraded",
    "clear_cache",
    "nologreplay",
    "X-mount.mkdir",
];

/// Superblock flags the VFS accepts for every filesystem through fsconfig.
const GENERIC_SB: &[&str] = &[
    "sync",
    "async",
    "dirsync",
    "lazytime",
    "nolazytime",
    "silent",
];

const EXT4: &[&str] = &[
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

const XFS: &[&str] = &[
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

const BTRFS: &[&str] = &[
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

fn fs_allowed(fs: Filesystem) -> &'static [&'static str] {
    match fs {
        Filesystem::Ext2 | Filesystem::Ext3 | Filesystem::Ext4 => EXT4,
        Filesystem::Xfs => XFS,
        Filesystem::Btrfs => BTRFS,
    }
}

fn value_ok(v: &str) -> bool {
    !v.is_empty()
        && v.len() <= 256
        && v.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"_.:/-+@".contains(&b))
}

/// Splits a CSI mount_flags list: each entry may itself be a comma-separated list.
fn split(flags: &[String]) -> impl Iterator<Item = &str> {
    flags
        .iter()
        .flat_map(|f| f.split(','))
        .map(str::trim)
        .filter(|f| !f.is_empty())
}

/// Applies a per-mount flag; returns false when `opt` is not one.
fn apply_generic(
    opt: &str,
    attrs: &mut MountAttrs,
    seen_rw: &mut Option<String>,
) -> Result<bool, OptionError> {
    let mut rw = |ro: bool| -> Result<(), OptionError> {
        if let Some(prev) = seen_rw.as_ref().filter(|p| (p.as_str() == "ro") != ro) {
            return Err(OptionError::Conflict(prev.clone(), opt.to_string()));
        }
        *seen_rw = Some(opt.to_string());
        attrs.read_only = ro;
        Ok(())
    };
    match opt {
        "ro" => rw(true)?,
        "rw" => rw(false)?,
        "defaults" | "suid" | "dev" | "exec" | "diratime" => {}
        "nosuid" => attrs.nosuid = true,
        "nodev" => attrs.nodev = true,
        "noexec" => attrs.noexec = true,
        "noatime" => attrs.atime = Atime::None,
        "relatime" | "atime" => attrs.atime = Atime::Relative,
        "strictatime" => attrs.atime = Atime::Strict,
        "nodiratime" => attrs.nodiratime = true,
        _ => return Ok(false),
    }
    Ok(true)
}

/// Parses the options for a filesystem mount of `fs`.
pub fn parse(flags: &[String], fs: Filesystem) -> Result<MountOptions, OptionError> {
    let mut out = MountOptions::default();
    let mut seen_rw = None;
    for opt in split(flags) {
        if apply_generic(opt, &mut out.attrs, &mut seen_rw)? {
            continue;
        }
        let (key, value) = match opt.split_once('=') {
            Some((k, v)) => (k, Some(v)),
            None => (opt, None),
        };
        if FORBIDDEN.contains(&opt) || FORBIDDEN.contains(&key) || key.starts_with("x-") {
            return Err(OptionError::Forbidden(opt.to_string()));
        }
        let known = GENERIC_SB.contains(&key) || fs_allowed(fs).contains(&key);
        if !known {
            return Err(OptionError::Unsupported {
                option: opt.to_string(),
                fs: fs.name().into(),
            });
        }
        if value.is_some_and(|v| !value_ok(v)) {
            return Err(OptionError::BadValue(opt.to_string()));
        }
        if !out.fs_options.iter().any(|o| o == opt) {
            out.fs_options.push(opt.to_string());
        }
    }
    if fs == Filesystem::Xfs && !out.fs_options.iter().any(|o| o == "nouuid") {
        // Clones and restored snapshots share their source's UUID; xfs refuses to mount a
        // second filesystem with a UUID it already has mounted unless told otherwise.
        out.fs_options.push("nouuid".into());
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(s: &[&str]) -> Vec<String> {
        s.iter().map(|s| (*s).to_string()).collect()
    }

    #[test]
    fn generic_flags_become_attrs() {
        let o = parse(
            &v(&["ro,noatime", "nosuid", "nodev", "noexec"]),
            Filesystem::Ext4,
        )
        .unwrap();
        assert!(o.attrs.read_only && o.attrs.nosuid && o.attrs.nodev && o.attrs.noexec);
        assert_eq!(o.attrs.atime, Atime::None);
        assert!(o.fs_options.is_empty());
    }

    #[test]
    fn xfs_always_gets_nouuid_once() {
        let o = parse(&[], Filesystem::Xfs).unwrap();
        assert_eq!(o.fs_options, v(&["nouuid"]));
        let o = parse(&v(&["nouuid", "inode64"]), Filesystem::Xfs).unwrap();
        assert_eq!(o.fs_options, v(&["nouuid", "inode64"]));
    }

    #[test]
    fn fs_options_are_checked_per_filesystem() {
        assert_eq!(
            parse(&v(&["data=ordered", "discard"]), Filesystem::Ext4)
                .unwrap()
                .fs_options,
            v(&["data=ordered", "discard"])
        );
        assert!(matches!(
            parse(&v(&["inode64"]), Filesystem::Ext4),
            Err(OptionError::Unsupported { .. })
        ));
        assert!(parse(&v(&["compress=zstd:3"]), Filesystem::Btrfs).is_ok());
    }

    #[test]
    fn dangerous_options_are_forbidden() {
        for bad in [
            "bind",
            "remount",
            "rshared",
            "errors=panic",
            "loop",
            "x-foo=1",
            "noload",
        ] {
            assert!(
                matches!(
                    parse(&v(&[bad]), Filesystem::Ext4),
                    Err(OptionError::Forbidden(_))
                ),
                "{bad}"
            );
        }
    }

    #[test]
    fn malformed_values_and_conflicts_are_refused() {
        assert!(matches!(
            parse(&v(&["data=a b"]), Filesystem::Ext4),
            Err(OptionError::BadValue(_))
        ));
        assert!(matches!(
            parse(&v(&["ro", "rw"]), Filesystem::Ext4),
            Err(OptionError::Conflict(..))
        ));
        assert!(matches!(
            parse(&v(&["commit="]), Filesystem::Ext4),
            Err(OptionError::BadValue(_))
        ));
    }
}
