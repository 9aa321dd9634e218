//! Volume and snapshot ids of the embedded backend.
//!
//! Ids are generated here ("vol-" or "snap-" and 16 random lowercase hex digits) and parsed
//! strictly: an id from a request becomes a [`VolumeId`] or [`SnapshotId`] only if it has
//! exactly that form, so it can name a file in the data dir without any risk of a path escape.
//! Everything else names no moor object.

use std::fmt;

/// What the random source failed with.
#[derive(Debug, thiserror::Error)]
#[error("getrandom: {0}")]
pub struct RandomError(#[from] std::io::Error);

const HEX_DIGITS: usize = 16;

fn parse_hex_suffix<'a>(s: &'a str, prefix: &str) -> Option<&'a str> {
    let hex = s.strip_prefix(prefix)?;
    (hex.len() == HEX_DIGITS && hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')))
        .then_some(s)
}

fn random_hex() -> Result<String, RandomError> {
    let mut buf = [0u8; HEX_DIGITS / 2];
    let mut filled = 0;
    while filled < buf.len() {
        let n = rustix::rand::getrandom(&mut buf[filled..], rustix::rand::GetRandomFlags::empty())
            .map_err(std::io::Error::from)?;
        filled += n;
    }
    Ok(buf.iter().map(|b| format!("{b:02x}")).collect())
}

macro_rules! id_type {
    ($name:ident, $prefix:literal, $what:literal) => {
        #[doc = concat!("A ", $what, " id of moor's form: \"", $prefix, "\" and 16 lowercase hex digits.")]
        #[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
        pub struct $name(String);

        impl $name {
            /// The prefix of every id of this kind.
            pub const PREFIX: &'static str = $prefix;

            /// The id, if `s` is exactly of moor's form.
            pub fn parse(s: &str) -> Option<Self> {
                parse_hex_suffix(s, Self::PREFIX).map(|s| Self(s.to_string()))
            }

            /// A new random id.
            pub fn random() -> Result<Self, RandomError> {
                Ok(Self(format!("{}{}", Self::PREFIX, random_hex()?)))
            }

            /// The id as a string.
            pub fn as_str(&self) -> &str {
                &self.0
            }

            /// The name of its data file (`<id>.img`).
            pub fn data_file(&self) -> String {
                format!("{}.img", self.0)
            }

            /// The name of its record (`<id>.json`).
            pub fn record_file(&self) -> String {
                format!("{}.json", self.0)
            }

            /// The id a data or record file name stands for, if it is one of ours.
            pub fn from_file_name(name: &str, extension: &str) -> Option<Self> {
                name.strip_suffix(extension)
                    .and_then(|stem| stem.strip_suffix('.'))
                    .and_then(Self::parse)
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }
    };
}

id_type!(VolumeId, "vol-", "volume");
id_type!(SnapshotId, "snap-", "snapshot");
id_type!(GroupId, "group-", "group snapshot");

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_is_strict() {
        assert!(VolumeId::parse("vol-0123456789abcdef").is_some());
        for bad in [
            "",
            "vol-",
            "vol-0123456789abcde",
            "vol-0123456789abcdef0",
            "vol-0123456789ABCDEF",
            "vol-../../etc/passw",
            "vol-0123456789abcdeg",
            "snap-0123456789abcdef",
            "/vol-0123456789abcdef",
            "vol-0123456789abcdef/",
            "vol-0123456789abcd\u{e9}",
        ] {
            assert!(VolumeId::parse(bad).is_none(), "{bad:?}");
        }
        assert!(SnapshotId::parse("snap-0123456789abcdef").is_some());
        assert!(SnapshotId::parse("vol-0123456789abcdef").is_none());
    }

    #[test]
    fn random_ids_parse_back_and_differ() {
        let a = VolumeId::random().unwrap();
        let b = VolumeId::random().unwrap();
        assert_ne!(a, b);
        assert_eq!(VolumeId::parse(a.as_str()), Some(a.clone()));
        assert_eq!(
            VolumeId::from_file_name(&a.data_file(), "img"),
            Some(a.clone())
        );
        assert_eq!(VolumeId::from_file_name(&a.record_file(), "json"), Some(a));
        assert!(VolumeId::from_file_name("vol-0123456789abcdef.img.tmp", "img").is_none());
        let s = SnapshotId::random().unwrap();
        assert!(s.as_str().starts_with("snap-"));
    }
}
