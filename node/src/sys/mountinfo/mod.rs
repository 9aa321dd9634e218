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
mod tests;
