//! Mount options: what a `VolumeCapability.mount.mount_flags` list may say, and what it means.
//!
//! Every option is checked against an allow-list before anything reaches the kernel: the
//! per-mount flags the new mount API enforces (`ro`, `nosuid`, `noatime`, ...), and per
//! filesystem the options its driver understands (each filesystem's
//! [`FilesystemOps`](crate::filesystem::FilesystemOps) lists them, and names the options its
//! mounts always get, such as xfs's `nouuid`). Options that change what or how something
//! is mounted (`bind`, `remount`, propagation, `loop`, ...) or that hurt the node (`errors=panic`,
//! `noload`) are refused with the option named.
//!
//! A value may be written in double quotes, as kubelet writes an SELinux label, whose MLS
//! categories hold a comma: `context="system_u:object_r:container_file_t:s0:c15,c25"`. Commas
//! inside quotes do not separate options; the quotes do not reach the kernel.

use moor_runtime::contract::Filesystem;

use crate::filesystem;
use crate::sys::{Atime, MountAttrs};

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

/// The SELinux labelling options: the LSM takes them for a filesystem mount of any type (they
/// belong to the superblock; a bind mount of it shares them).
pub const SELINUX_OPTIONS: &[&str] = &["context", "fscontext", "defcontext", "rootcontext"];

/// Longest SELinux label accepted.
const MAX_LABEL_LEN: usize = 1024;

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

fn value_ok(v: &str) -> bool {
    !v.is_empty()
        && v.len() <= 256
        && v.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"_.:/-+@".contains(&b))
}

/// Splits a CSI mount_flags list: each entry may itself be a comma-separated list, and a value
/// in double quotes may hold commas. A quoted value comes back without its quotes.
fn split(flags: &[String]) -> Result<Vec<String>, OptionError> {
    let mut out = Vec::new();
    for flag in flags {
        let mut quoted = false;
        let mut start = 0;
        for (i, c) in flag
            .char_indices()
            .chain(std::iter::once((flag.len(), ',')))
        {
            match c {
                '"' => quoted = !quoted,
                ',' if !quoted || i == flag.len() => {
                    if quoted {
                        return Err(OptionError::BadValue(flag.trim().to_string()));
                    }
                    let opt = flag.get(start..i).unwrap_or_default().trim();
                    if !opt.is_empty() {
                        out.push(unquote(opt)?);
                    }
                    start = i + 1;
                }
                _ => {}
            }
        }
    }
    Ok(out)
}

/// `key="value"` as `key=value`; an option without quotes as it is. Quotes anywhere else are
/// refused.
fn unquote(opt: &str) -> Result<String, OptionError> {
    if !opt.contains('"') {
        return Ok(opt.to_string());
    }
    let bad = || OptionError::BadValue(opt.to_string());
    let (key, value) = opt.split_once('=').ok_or_else(bad)?;
    let inner = value
        .strip_prefix('"')
        .and_then(|v| v.strip_suffix('"'))
        .filter(|v| !key.contains('"') && !v.contains('"'))
        .ok_or_else(bad)?;
    Ok(format!("{key}={inner}"))
}

/// Whether `v` looks like an SELinux label: `user:role:type`, then optionally the MLS/MCS
/// level or range (`s0:c15,c25`, `s0-s0:c0.c1023`).
fn label_ok(v: &str) -> bool {
    let mut parts = v.splitn(4, ':');
    v.len() <= MAX_LABEL_LEN
        && (0..3).all(|_| parts.next().is_some_and(|p| !p.is_empty()))
        && v.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"_.:,-".contains(&b))
}

/// The SELinux options (`context=...`, `fscontext=...`, ...) among validated filesystem
/// options, in their order.
pub fn selinux_options(fs_options: &[String]) -> Vec<&str> {
    fs_options
        .iter()
        .map(String::as_str)
        .filter(|o| is_selinux(o))
        .collect()
}

fn is_selinux(opt: &str) -> bool {
    opt.split_once('=')
        .is_some_and(|(k, _)| SELINUX_OPTIONS.contains(&k))
}

impl MountOptions {
    /// The SELinux options asked for (empty when none).
    pub fn selinux(&self) -> Vec<&str> {
        selinux_options(&self.fs_options)
    }
}

/// Checks an SELinux option against the ones already accepted: a second value for the same
/// option, or `context` with `defcontext`, is refused as the kernel would.
fn check_selinux(opt: &str, key: &str, value: &str, seen: &[String]) -> Result<(), OptionError> {
    if !label_ok(value) {
        return Err(OptionError::BadValue(opt.to_string()));
    }
    let exclusive = |k: &str| match key {
        "context" | "defcontext" => k == "context" || k == "defcontext",
        _ => k == key,
    };
    match seen
        .iter()
        .filter(|o| o.as_str() != opt)
        .find(|o| o.split_once('=').is_some_and(|(k, _)| exclusive(k)))
    {
        Some(prev) => Err(OptionError::Conflict(prev.clone(), opt.to_string())),
        None => Ok(()),
    }
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
    for opt in &split(flags)? {
        let opt = opt.as_str();
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
        if SELINUX_OPTIONS.contains(&key) {
            check_selinux(opt, key, value.unwrap_or_default(), &out.fs_options)?;
        } else {
            let known =
                GENERIC_SB.contains(&key) || filesystem::ops(fs).mount_options().contains(&key);
            if !known {
                return Err(OptionError::Unsupported {
                    option: opt.to_string(),
                    fs: fs.name().into(),
                });
            }
            if value.is_some_and(|v| !value_ok(v)) {
                return Err(OptionError::BadValue(opt.to_string()));
            }
        }
        if !out.fs_options.iter().any(|o| o == opt) {
            out.fs_options.push(opt.to_string());
        }
    }
    for forced in filesystem::ops(fs).forced_options() {
        if !out.fs_options.iter().any(|o| o == forced) {
            out.fs_options.push((*forced).into());
        }
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

    /// kubelet's form: one mount flag, the label quoted (Go's %q), its categories comma-separated.
    const KUBELET_CONTEXT: &str = r#"context="system_u:object_r:container_file_t:s0:c15,c25""#;

    #[test]
    fn a_quoted_selinux_label_is_one_option_without_its_quotes() {
        let o = parse(&v(&["noatime", KUBELET_CONTEXT]), Filesystem::Ext4).unwrap();
        assert_eq!(
            o.fs_options,
            v(&["context=system_u:object_r:container_file_t:s0:c15,c25"])
        );
        assert_eq!(
            o.selinux(),
            ["context=system_u:object_r:container_file_t:s0:c15,c25"]
        );
        assert_eq!(o.attrs.atime, Atime::None);
        // Within a comma-separated entry too, and for every filesystem.
        let o = parse(
            &v(&[r#"dirsync,context="system_u:object_r:container_file_t:s0:c15,c25",noatime"#]),
            Filesystem::Xfs,
        )
        .unwrap();
        assert_eq!(
            o.fs_options,
            v(&[
                "dirsync",
                "context=system_u:object_r:container_file_t:s0:c15,c25",
                "nouuid"
            ])
        );
    }

    #[test]
    fn every_selinux_option_is_accepted_quoted_or_not() {
        for key in SELINUX_OPTIONS {
            let o = parse(
                &v(&[&format!("{key}=system_u:object_r:container_file_t:s0")]),
                Filesystem::Btrfs,
            )
            .unwrap();
            assert_eq!(o.selinux().len(), 1, "{key}");
            let o = parse(
                &v(&[&format!(
                    "{key}=\"system_u:object_r:container_file_t:s0-s0:c0.c1023\""
                )]),
                Filesystem::Ext4,
            )
            .unwrap();
            assert_eq!(
                o.fs_options,
                [format!(
                    "{key}=system_u:object_r:container_file_t:s0-s0:c0.c1023"
                )],
                "{key}"
            );
        }
        // Options that are not labels carry none.
        assert!(
            parse(&v(&["data=ordered"]), Filesystem::Ext4)
                .unwrap()
                .selinux()
                .is_empty()
        );
    }

    #[test]
    fn malformed_quotes_and_labels_are_refused() {
        for bad in [
            r#"context="system_u:object_r:container_file_t:s0:c15,c25"#,
            r#"context=system_u:object_r:t:s0"x""#,
            r#""context"=system_u:object_r:t:s0"#,
            r#"context="a"b""#,
            "context=",
            "context",
            "context=container_file_t",
            "context=system_u::container_file_t:s0",
            "context=system_u:object_r:container_file_t:s0 c1",
            "context=system_u:object_r:container_file_t:s0;rm",
        ] {
            assert!(
                matches!(
                    parse(&v(&[bad]), Filesystem::Ext4),
                    Err(OptionError::BadValue(_))
                ),
                "{bad}"
            );
        }
        // A quoted value is checked as the same value unquoted.
        assert!(matches!(
            parse(&v(&[r#"data="a b""#]), Filesystem::Ext4),
            Err(OptionError::BadValue(_))
        ));
        assert_eq!(
            parse(&v(&[r#"data="ordered""#]), Filesystem::Ext4)
                .unwrap()
                .fs_options,
            v(&["data=ordered"])
        );
    }

    #[test]
    fn selinux_options_the_kernel_would_refuse_together_conflict() {
        let a = "context=system_u:object_r:container_file_t:s0:c1";
        let b = "context=system_u:object_r:container_file_t:s0:c3";
        let d = "defcontext=system_u:object_r:container_file_t:s0";
        for (x, y) in [(a, b), (a, d), (d, a)] {
            assert_eq!(
                parse(&v(&[x, y]), Filesystem::Ext4),
                Err(OptionError::Conflict(x.into(), y.into())),
                "{x} {y}"
            );
        }
        // Unquoted, a label's categories would be options of their own.
        assert!(matches!(
            parse(
                &v(&["context=system_u:object_r:container_file_t:s0:c1,c2"]),
                Filesystem::Ext4
            ),
            Err(OptionError::Unsupported { .. })
        ));
        // The same option twice is once; fscontext and rootcontext go with context.
        let o = parse(
            &v(&[
                a,
                a,
                "fscontext=system_u:object_r:fs_t:s0",
                "rootcontext=system_u:object_r:root_t:s0",
            ]),
            Filesystem::Ext4,
        )
        .unwrap();
        assert_eq!(o.selinux().len(), 3);
    }
}
