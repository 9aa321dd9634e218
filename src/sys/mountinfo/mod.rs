//! Parser for `/proc/<pid>/mountinfo` (see proc(5)).
//!
//! Each line describes one mount:
//!
//! ```text
//! 36 35 98:0 /mnt1 /mnt2 rw,noatime master:1 - ext3 /dev/root rw,errors=continue
//! (1)(2)(3)   (4)   (5)      (6)      (7)   (8) (9)   (10)         (11)
//! ```
//!
//! Fields are separated by single spaces; the kernel escapes space, tab, newline and backslash
//! inside paths as `\040`, `\011`, `\012` and `\134`. Zero or more optional fields (7) end at
//! the `-` separator (8). The source (10) may be empty, which shows as two spaces in a row.
//!
//! Everything here works on bytes, does no I/O and never panics, so it can be fuzzed directly.

use std::ffi::OsString;
use std::ops::ControlFlow;
use std::os::unix::ffi::OsStringExt;
use std::path::PathBuf;

/// One line of a mountinfo table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountInfo {
    /// Unique id of the mount (field 1).
    pub mount_id: u64,
    /// Id of the parent mount, or of itself for the root of the mount namespace (field 2).
    pub parent_id: u64,
    /// Major number of the device (`st_dev`) of files on this filesystem (field 3).
    pub major: u32,
    /// Minor number of the device (`st_dev`) of files on this filesystem (field 3).
    pub minor: u32,
    /// The directory of the filesystem that forms the root of this mount, unescaped (field 4).
    pub root: PathBuf,
    /// Where the mount sits, relative to the process's root, unescaped (field 5).
    pub mount_point: PathBuf,
    /// Per-mount options such as `rw,nosuid,relatime`, as printed (field 6).
    pub mount_options: String,
    /// Optional `tag[:value]` fields such as `shared:1` or `master:2` (field 7).
    pub optional_fields: Vec<String>,
    /// Filesystem type, possibly with a subtype such as `fuse.sshfs`, unescaped (field 9).
    pub fs_type: String,
    /// Filesystem-specific source such as `/dev/sda1`, `none` or empty, unescaped (field 10).
    pub source: String,
    /// Per-superblock options, as printed (values keep their escapes) (field 11).
    pub super_options: String,
}

impl MountInfo {
    /// True if writes through this mount are refused: `ro` is among the mount options or
    /// among the superblock options (for instance after `errors=remount-ro` fired).
    #[must_use]
    pub fn is_read_only(&self) -> bool {
        has_option(&self.mount_options, "ro") || has_option(&self.super_options, "ro")
    }

    /// The `(major, minor)` device number of files on this mount.
    #[must_use]
    pub fn dev(&self) -> (u32, u32) {
        (self.major, self.minor)
    }
}

/// True if the comma-separated `options` contain `name` exactly.
fn has_option(options: &str, name: &str) -> bool {
    options.split(',').any(|opt| opt == name)
}

/// A malformed mountinfo line. Every variant carries the 1-based line number in the table.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParseError {
    /// The line ends before a mandatory field.
    #[error("mountinfo line {line}: missing {field}")]
    MissingField {
        /// 1-based line number.
        line: usize,
        /// Which field is missing.
        field: &'static str,
    },
    /// A field that must not be empty is empty (two spaces in a row).
    #[error("mountinfo line {line}: empty {field}")]
    EmptyField {
        /// 1-based line number.
        line: usize,
        /// Which field is empty.
        field: &'static str,
    },
    /// The mount id or parent id is not a decimal number that fits in 64 bits.
    #[error("mountinfo line {line}: {field} is not a decimal number")]
    InvalidNumber {
        /// 1-based line number.
        line: usize,
        /// Which field is not a number.
        field: &'static str,
    },
    /// The device field is not `major:minor` with two decimal 32-bit numbers.
    #[error("mountinfo line {line}: device is not major:minor")]
    InvalidDevice {
        /// 1-based line number.
        line: usize,
    },
    /// No `-` field ends the optional fields.
    #[error("mountinfo line {line}: no \"-\" separator after the optional fields")]
    MissingSeparator {
        /// 1-based line number.
        line: usize,
    },
    /// There is more on the line after the super options.
    #[error("mountinfo line {line}: unexpected field after the super options")]
    TrailingField {
        /// 1-based line number.
        line: usize,
    },
}

impl ParseError {
    /// The 1-based line number of the malformed line.
    #[must_use]
    pub fn line(&self) -> usize {
        match *self {
            ParseError::MissingField { line, .. }
            | ParseError::EmptyField { line, .. }
            | ParseError::InvalidNumber { line, .. }
            | ParseError::InvalidDevice { line }
            | ParseError::MissingSeparator { line }
            | ParseError::TrailingField { line } => line,
        }
    }
}

/// Parses one mountinfo line (a trailing `\n` is allowed).
///
/// # Errors
///
/// A [`ParseError`] naming line 1 if the line is malformed.
pub fn parse_line(line: &[u8]) -> Result<MountInfo, ParseError> {
    let line = line.strip_suffix(b"\n").unwrap_or(line);
    parse_numbered(line, 1)
}

/// Parses a whole mountinfo table. Blank lines are skipped; the first malformed line fails
/// the whole parse.
///
/// # Errors
///
/// The [`ParseError`] of the first malformed line.
pub fn parse(table: &[u8]) -> Result<Vec<MountInfo>, ParseError> {
    let mut entries = Vec::new();
    for_each(table, |entry| {
        entries.push(entry);
        ControlFlow::Continue(())
    })?;
    Ok(entries)
}

/// Streaming: calls `f` for each entry, stopping early if it returns ControlFlow::Break; lets
/// callers find one mount point without collecting the table.
///
/// Blank lines are skipped. A malformed line before the stop is an error; lines after the
/// stop are not looked at.
///
/// # Errors
///
/// The [`ParseError`] of the first malformed line before the stop.
pub fn for_each(
    table: &[u8],
    mut f: impl FnMut(MountInfo) -> ControlFlow<()>,
) -> Result<(), ParseError> {
    for (index, line) in table.split(|&b| b == b'\n').enumerate() {
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        let entry = parse_numbered(line, index.saturating_add(1))?;
        if f(entry).is_break() {
            break;
        }
    }
    Ok(())
}

/// Undoes the kernel's octal escapes (`\040` space, `\011` tab, `\012` newline, `\134`
/// backslash, and any other `\` followed by three octal digits up to `\377`). A backslash
/// not followed by such a sequence is kept as it is.
#[must_use]
pub fn unescape(field: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(field.len());
    let mut rest = field;
    while let Some((&byte, tail)) = rest.split_first() {
        match octal_escape(rest) {
            Some(decoded) => {
                out.push(decoded);
                rest = rest.get(4..).unwrap_or_default();
            }
            None => {
                out.push(byte);
                rest = tail;
            }
        }
    }
    out
}

/// The byte encoded by `\ooo` at the start of `bytes`, if there is one.
fn octal_escape(bytes: &[u8]) -> Option<u8> {
    let [b'\\', a, b, c, ..] = *bytes else {
        return None;
    };
    let value = [a, b, c].iter().try_fold(0u32, |acc, &d| {
        let digit = (b'0'..=b'7').contains(&d).then(|| u32::from(d - b'0'))?;
        Some(acc * 8 + digit)
    })?;
    u8::try_from(value).ok()
}

/// Parses one line (without its newline) that sits at `line` in the table.
fn parse_numbered(text: &[u8], line: usize) -> Result<MountInfo, ParseError> {
    let mut fields = text.split(|&b| b == b' ');
    let mount_id = number(next_field(&mut fields, line, "mount id")?, line, "mount id")?;
    let parent_id = number(
        next_field(&mut fields, line, "parent id")?,
        line,
        "parent id",
    )?;
    let (major, minor) = device(next_field(&mut fields, line, "device")?, line)?;
    let root = path(nonempty_field(&mut fields, line, "root")?);
    let mount_point = path(nonempty_field(&mut fields, line, "mount point")?);
    let mount_options = text_of(nonempty_field(&mut fields, line, "mount options")?);
    let optional_fields = optional(&mut fields, line)?;
    let fs_type = text_of(&unescape(nonempty_field(
        &mut fields,
        line,
        "filesystem type",
    )?));
    let source = text_of(&unescape(next_field(&mut fields, line, "source")?));
    let super_options = text_of(next_field(&mut fields, line, "super options")?);
    if fields.next().is_some() {
        return Err(ParseError::TrailingField { line });
    }
    Ok(MountInfo {
        mount_id,
        parent_id,
        major,
        minor,
        root,
        mount_point,
        mount_options,
        optional_fields,
        fs_type,
        source,
        super_options,
    })
}

/// The next field, which must exist (it may be empty).
fn next_field<'a>(
    fields: &mut impl Iterator<Item = &'a [u8]>,
    line: usize,
    field: &'static str,
) -> Result<&'a [u8], ParseError> {
    fields
        .next()
        .ok_or(ParseError::MissingField { line, field })
}

/// The next field, which must exist and not be empty.
fn nonempty_field<'a>(
    fields: &mut impl Iterator<Item = &'a [u8]>,
    line: usize,
    field: &'static str,
) -> Result<&'a [u8], ParseError> {
    let value = next_field(fields, line, field)?;
    if value.is_empty() {
        return Err(ParseError::EmptyField { line, field });
    }
    Ok(value)
}

/// The optional fields, up to and including the `-` separator (which is consumed).
fn optional<'a>(
    fields: &mut impl Iterator<Item = &'a [u8]>,
    line: usize,
) -> Result<Vec<String>, ParseError> {
    let mut out = Vec::new();
    loop {
        match fields.next() {
            None => return Err(ParseError::MissingSeparator { line }),
            Some(b"-") => return Ok(out),
            Some([]) => {
                let field = "optional field";
                return Err(ParseError::EmptyField { line, field });
            }
            Some(tag) => out.push(text_of(tag)),
        }
    }
}

/// A decimal u64 made of ASCII digits only (no sign, no spaces).
fn number(field: &[u8], line: usize, name: &'static str) -> Result<u64, ParseError> {
    decimal(field).ok_or(ParseError::InvalidNumber { line, field: name })
}

/// `major:minor` as two decimal u32.
fn device(field: &[u8], line: usize) -> Result<(u32, u32), ParseError> {
    let parsed = (|| {
        let colon = field.iter().position(|&b| b == b':')?;
        let major = field.get(..colon)?;
        let minor = field.get(colon.checked_add(1)?..)?;
        let major = u32::try_from(decimal(major)?).ok()?;
        let minor = u32::try_from(decimal(minor)?).ok()?;
        Some((major, minor))
    })();
    parsed.ok_or(ParseError::InvalidDevice { line })
}

/// A non-empty run of ASCII digits as u64, or `None` (also on overflow).
fn decimal(digits: &[u8]) -> Option<u64> {
    if digits.is_empty() {
        return None;
    }
    digits.iter().try_fold(0u64, |acc, &d| {
        if !d.is_ascii_digit() {
            return None;
        }
        acc.checked_mul(10)?.checked_add(u64::from(d - b'0'))
    })
}

/// An unescaped path field; any bytes, not necessarily UTF-8.
fn path(field: &[u8]) -> PathBuf {
    PathBuf::from(OsString::from_vec(unescape(field)))
}

/// A text field, decoded lossily if it is not UTF-8.
fn text_of(field: &[u8]) -> String {
    String::from_utf8_lossy(field).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::ffi::OsStrExt;
    use std::path::Path;

    const DOC_LINE: &[u8] =
        b"36 35 98:0 /mnt1 /mnt2 rw,noatime master:1 - ext3 /dev/root rw,errors=continue";

    #[test]
    fn kernel_documentation_example() {
        let m = parse_line(DOC_LINE).unwrap();
        assert_eq!(
            m,
            MountInfo {
                mount_id: 36,
                parent_id: 35,
                major: 98,
                minor: 0,
                root: PathBuf::from("/mnt1"),
                mount_point: PathBuf::from("/mnt2"),
                mount_options: "rw,noatime".to_owned(),
                optional_fields: vec!["master:1".to_owned()],
                fs_type: "ext3".to_owned(),
                source: "/dev/root".to_owned(),
                super_options: "rw,errors=continue".to_owned(),
            }
        );
        assert_eq!(m.dev(), (98, 0));
        assert!(!m.is_read_only());
    }

    #[test]
    fn this_machines_mountinfo_parses_fully() {
        let table = std::fs::read("/proc/self/mountinfo").expect("read /proc/self/mountinfo");
        let entries = parse(&table).unwrap();
        let lines = table
            .split(|&b| b == b'\n')
            .filter(|l| !l.is_empty())
            .count();
        assert_eq!(entries.len(), lines);
        assert!(entries.iter().any(|m| m.mount_point == Path::new("/")));
        for m in &entries {
            assert!(m.mount_point.is_absolute(), "{m:?}");
            assert!(!m.fs_type.is_empty(), "{m:?}");
        }
    }

    #[test]
    fn real_lines() {
        let lines: [&[u8]; 4] = [
            b"27 1 254:0 / / rw,relatime - ext4 /dev/vda rw,discard,resuid=65534\n",
            b"22 27 0:21 / /proc rw,relatime - proc proc rw",
            b"41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw",
            b"28 27 0:25 / /mnt/x ro,nosuid,nodev,relatime - tmpfs tools ro,size=4k,mode=755",
        ];
        let parsed: Vec<MountInfo> = lines.iter().map(|l| parse_line(l).unwrap()).collect();
        assert_eq!(parsed[0].mount_point, Path::new("/"));
        assert_eq!(parsed[0].source, "/dev/vda");
        assert_eq!(parsed[0].dev(), (254, 0));
        assert_eq!(parsed[1].fs_type, "proc");
        assert_eq!(parsed[2].super_options, "rw");
        assert!(parsed[3].is_read_only());
        assert!(parsed.iter().all(|m| m.optional_fields.is_empty()));
    }

    #[test]
    fn escaped_paths_and_source() {
        let line = b"100 27 8:1 /a\\040b /mnt/x\\011y\\012z\\134w rw - ext4 /dev/my\\040disk rw";
        let m = parse_line(line).unwrap();
        assert_eq!(m.root, Path::new("/a b"));
        assert_eq!(m.mount_point, Path::new("/mnt/x\ty\nz\\w"));
        assert_eq!(m.source, "/dev/my disk");
    }

    #[test]
    fn non_utf8_paths() {
        let line = b"100 27 8:1 /\xff\xfe /mnt/\\377x rw - ext4 /dev/sda1 rw";
        let m = parse_line(line).unwrap();
        assert_eq!(m.root.as_os_str().as_bytes(), b"/\xff\xfe");
        assert_eq!(m.mount_point.as_os_str().as_bytes(), b"/mnt/\xffx");
    }

    #[test]
    fn many_optional_fields() {
        let line = b"1 2 0:3 / /x rw shared:1 master:2 propagate_from:3 unbindable - tmpfs t rw";
        let m = parse_line(line).unwrap();
        assert_eq!(
            m.optional_fields,
            ["shared:1", "master:2", "propagate_from:3", "unbindable"]
        );
        assert_eq!(m.fs_type, "tmpfs");
    }

    #[test]
    fn none_and_empty_source() {
        let m = parse_line(b"1 2 0:3 / /x rw - tmpfs none rw").unwrap();
        assert_eq!(m.source, "none");
        let m = parse_line(b"1 2 0:3 / /x rw - tmpfs  rw,size=4k").unwrap();
        assert_eq!(m.source, "");
        assert_eq!(m.super_options, "rw,size=4k");
    }

    #[test]
    fn fs_type_with_subtype() {
        let m = parse_line(b"1 2 0:50 / /x rw - fuse.sshfs u@h:/ rw,user_id=0").unwrap();
        assert_eq!(m.fs_type, "fuse.sshfs");
        assert_eq!(m.source, "u@h:/");
    }

    #[test]
    fn read_only_detection() {
        let base = parse_line(DOC_LINE).unwrap();
        let with = |mount: &str, sup: &str| MountInfo {
            mount_options: mount.to_owned(),
            super_options: sup.to_owned(),
            ..base.clone()
        };
        assert!(with("ro,relatime", "rw").is_read_only());
        assert!(with("rw,relatime", "ro,errors=remount-ro").is_read_only());
        assert!(!with("rw,relatime", "rw,errors=remount-ro").is_read_only());
        assert!(!with("rox", "xro").is_read_only());
    }

    #[test]
    fn trailing_newline_blank_lines_and_line_numbers() {
        let table = b"\n1 0 0:1 / / rw - rootfs rootfs rw\n\n  \n2 1 0:2 / /x rw - tmpfs t rw\n";
        let entries = parse(table).unwrap();
        assert_eq!(entries.len(), 2);
        assert_eq!(entries[1].mount_point, Path::new("/x"));
        let no_newline = b"1 0 0:1 / / rw - rootfs rootfs rw";
        assert_eq!(parse(no_newline).unwrap().len(), 1);
        assert_eq!(parse(b"").unwrap(), []);
        assert_eq!(parse(b"\n\n").unwrap(), []);

        let bad = b"1 0 0:1 / / rw - rootfs rootfs rw\n\nx 1 0:2 / /x rw - tmpfs t rw\n";
        let err = parse(bad).unwrap_err();
        assert_eq!(err.line(), 3);
        assert_eq!(
            err.to_string(),
            "mountinfo line 3: mount id is not a decimal number"
        );
    }

    #[test]
    fn malformed_lines() {
        use ParseError::*;
        let cases: [(&[u8], ParseError); 27] = [
            (
                b"",
                InvalidNumber {
                    line: 1,
                    field: "mount id",
                },
            ),
            (
                b"x 2 0:3 / /x rw - t s rw",
                InvalidNumber {
                    line: 1,
                    field: "mount id",
                },
            ),
            (
                b"+1 2 0:3 / /x rw - t s rw",
                InvalidNumber {
                    line: 1,
                    field: "mount id",
                },
            ),
            (
                b"-1 2 0:3 / /x rw - t s rw",
                InvalidNumber {
                    line: 1,
                    field: "mount id",
                },
            ),
            (
                b"1 2x 0:3 / /x rw - t s rw",
                InvalidNumber {
                    line: 1,
                    field: "parent id",
                },
            ),
            (
                b"1 18446744073709551616 0:3 / /x rw - t s rw",
                InvalidNumber {
                    line: 1,
                    field: "parent id",
                },
            ),
            (
                b" 1 2 0:3 / /x rw - t s rw",
                InvalidNumber {
                    line: 1,
                    field: "mount id",
                },
            ),
            (
                b"1",
                MissingField {
                    line: 1,
                    field: "parent id",
                },
            ),
            (
                b"1 2",
                MissingField {
                    line: 1,
                    field: "device",
                },
            ),
            (b"1 2 03 / /x rw - t s rw", InvalidDevice { line: 1 }),
            (b"1 2 0: / /x rw - t s rw", InvalidDevice { line: 1 }),
            (b"1 2 :3 / /x rw - t s rw", InvalidDevice { line: 1 }),
            (b"1 2 a:b / /x rw - t s rw", InvalidDevice { line: 1 }),
            (b"1 2 0:3:4 / /x rw - t s rw", InvalidDevice { line: 1 }),
            (
                b"1 2 4294967296:0 / /x rw - t s rw",
                InvalidDevice { line: 1 },
            ),
            (
                b"1 2 0:3",
                MissingField {
                    line: 1,
                    field: "root",
                },
            ),
            (
                b"1 2 0:3 /",
                MissingField {
                    line: 1,
                    field: "mount point",
                },
            ),
            (
                b"1 2 0:3  /x rw - t s rw",
                EmptyField {
                    line: 1,
                    field: "root",
                },
            ),
            (
                b"1 2 0:3 / /x",
                MissingField {
                    line: 1,
                    field: "mount options",
                },
            ),
            (b"1 2 0:3 / /x rw", MissingSeparator { line: 1 }),
            (
                b"1 2 0:3 / /x rw shared:1 t s rw",
                MissingSeparator { line: 1 },
            ),
            (
                b"1 2 0:3 / /x rw shared:1  - t s rw",
                EmptyField {
                    line: 1,
                    field: "optional field",
                },
            ),
            (
                b"1 2 0:3 / /x rw -",
                MissingField {
                    line: 1,
                    field: "filesystem type",
                },
            ),
            (
                b"1 2 0:3 / /x rw -  s rw",
                EmptyField {
                    line: 1,
                    field: "filesystem type",
                },
            ),
            (
                b"1 2 0:3 / /x rw - t",
                MissingField {
                    line: 1,
                    field: "source",
                },
            ),
            (
                b"1 2 0:3 / /x rw - t s",
                MissingField {
                    line: 1,
                    field: "super options",
                },
            ),
            (b"1 2 0:3 / /x rw - t s rw extra", TrailingField { line: 1 }),
        ];
        for (line, expected) in cases {
            assert_eq!(
                parse_line(line).unwrap_err(),
                expected,
                "{:?}",
                String::from_utf8_lossy(line)
            );
        }
    }

    #[test]
    fn error_messages_name_the_line() {
        let err = parse(b"\n\n1 2 0:3 / /x rw\n").unwrap_err();
        let text = err.to_string();
        assert_eq!(
            text,
            "mountinfo line 3: no \"-\" separator after the optional fields"
        );
    }

    #[test]
    fn unescape_edge_cases() {
        let cases: [(&[u8], &[u8]); 12] = [
            (b"", b""),
            (b"plain", b"plain"),
            (b"\\040", b" "),
            (b"a\\011b\\012c\\134d", b"a\tb\nc\\d"),
            (b"\\134040", b"\\040"),
            (b"\\", b"\\"),
            (b"x\\04", b"x\\04"),
            (b"\\08a", b"\\08a"),
            (b"\\400", b"\\400"),
            (b"\\377", b"\xff"),
            (b"\\000", b"\0"),
            (b"\\\\040", b"\\ "),
        ];
        for (input, expected) in cases {
            assert_eq!(
                unescape(input),
                expected,
                "{:?}",
                String::from_utf8_lossy(input)
            );
        }
    }

    #[test]
    fn for_each_stops_early() {
        let table = synthetic(100);
        let mut seen = 0;
        let result = for_each(&table, |m| {
            seen += 1;
            if m.mount_id == 1010 {
                ControlFlow::Break(())
            } else {
                ControlFlow::Continue(())
            }
        });
        assert_eq!(result, Ok(()));
        assert_eq!(seen, 11);

        // Lines after the stop are not parsed, even when malformed.
        let mut table = synthetic(3);
        table.extend_from_slice(b"garbage\n");
        let mut first = None;
        let result = for_each(&table, |m| {
            first = Some(m.mount_id);
            ControlFlow::Break(())
        });
        assert_eq!(result, Ok(()));
        assert_eq!(first, Some(1000));
        assert_eq!(parse(&table).unwrap_err().line(), 4);
    }

    /// A table of `n` mounts with varied escapes and optional fields.
    fn synthetic(n: usize) -> Vec<u8> {
        let mut table = Vec::new();
        for i in 0..n {
            let optional = match i % 3 {
                0 => String::new(),
                1 => format!(" shared:{i}"),
                _ => format!(" shared:{i} master:{}", i / 2),
            };
            let source = if i % 5 == 0 { "" } else { "/dev/sdb" };
            let line = format!(
                "{} {} {}:{} /vol\\040{i} /var/lib/kubelet/pods/{i}/mount rw,relatime{optional} \
                 - ext4 {source} rw\n",
                1000 + i,
                999 + i,
                i % 256,
                i,
            );
            table.extend_from_slice(line.as_bytes());
        }
        table
    }

    #[test]
    fn ten_thousand_lines() {
        let table = synthetic(10_000);
        let entries = parse(&table).unwrap();
        assert_eq!(entries.len(), 10_000);
        for (i, m) in entries.iter().enumerate() {
            assert_eq!(m.mount_id, 1000 + i as u64);
            assert_eq!(m.parent_id, 999 + i as u64);
            assert_eq!(m.dev(), ((i % 256) as u32, i as u32));
            assert_eq!(m.root, PathBuf::from(format!("/vol {i}")));
            let point = format!("/var/lib/kubelet/pods/{i}/mount");
            assert_eq!(m.mount_point, PathBuf::from(point));
            assert_eq!(m.optional_fields.len(), i % 3);
            assert_eq!(m.source, if i % 5 == 0 { "" } else { "/dev/sdb" });
        }
    }

    /// A small deterministic xorshift generator, so the test needs no dependency.
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
    }

    #[test]
    fn prefixes_and_mutations_never_panic() {
        let table = synthetic(20);
        for len in 0..=table.len() {
            let _ = parse(&table[..len]);
            let _ = parse_line(&table[..len]);
        }
        let alphabet = b" -:\\0123456789abc\n\xff/";
        let mut rng = Rng(0x2545_f491_4f6c_dd1d);
        for _ in 0..2000 {
            let mut buf = table.clone();
            for _ in 0..(rng.next() % 8) {
                let i = (rng.next() % buf.len() as u64) as usize;
                let j = (rng.next() % alphabet.len() as u64) as usize;
                buf[i] = alphabet[j];
            }
            if let Ok(entries) = parse(&buf) {
                assert!(entries.len() <= 20 + 8);
            }
        }
    }
}
