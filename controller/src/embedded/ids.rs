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

/// How a backend's ids are seen outside it: as they are (`vol-<hex>`: the one controller of
/// its data dir's host), or with the node they live on (`vol-<hex>@<node>`: a node-local
/// controller, one on each node, each serving its own volumes). The node is its topology value
/// ([`moor_runtime::limits::topology_value`]): a label value, at most 63 characters, so an id
/// stays within the spec's 128 bytes. Records and files always use the bare id.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Scope {
    node: Option<String>,
}

/// Where an id from a request points.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Inward<'a> {
    /// This backend's own form: the bare id (to [`VolumeId::parse`] and the like).
    Here(&'a str),
    /// An id of the node-local form naming another node.
    Elsewhere {
        /// The bare id.
        id: &'a str,
        /// The node it names.
        node: &'a str,
    },
}

impl Scope {
    /// Ids as they are.
    pub const HOST: Self = Self { node: None };

    /// Ids that name `node_value` (a topology value).
    pub fn node(node_value: impl Into<String>) -> Self {
        Self {
            node: Some(node_value.into()),
        }
    }

    /// The node ids name, if they do.
    pub fn node_value(&self) -> Option<&str> {
        self.node.as_deref()
    }

    /// The id a bare id is seen as outside.
    pub fn show(&self, bare: &str) -> String {
        match &self.node {
            Some(n) => format!("{bare}@{n}"),
            None => bare.to_string(),
        }
    }

    /// Where `raw`, an id from a request, points. Anything not of this backend's form is
    /// handed on as it is, to be refused by the parse of the bare id (an id with an `@` never
    /// parses as one).
    pub fn inward<'a>(&self, raw: &'a str) -> Inward<'a> {
        match (&self.node, raw.rsplit_once('@')) {
            (Some(ours), Some((id, node))) if node != ours => Inward::Elsewhere { id, node },
            (Some(_), Some((id, _))) => Inward::Here(id),
            // A node-local backend's ids always name their node: a bare one is not its own.
            (Some(_), None) => Inward::Here("@"),
            (None, _) => Inward::Here(raw),
        }
    }
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
    fn scoped_ids_name_their_node() {
        let host = Scope::HOST;
        assert_eq!(host.show("vol-0123456789abcdef"), "vol-0123456789abcdef");
        assert_eq!(
            host.inward("vol-0123456789abcdef"),
            Inward::Here("vol-0123456789abcdef")
        );
        // Not of the host's form: handed on as it is, and refused by the parse.
        assert_eq!(
            host.inward("vol-0123456789abcdef@n1"),
            Inward::Here("vol-0123456789abcdef@n1")
        );
        assert!(VolumeId::parse("vol-0123456789abcdef@n1").is_none());

        let n1 = Scope::node("n1");
        assert_eq!(n1.show("vol-0123456789abcdef"), "vol-0123456789abcdef@n1");
        assert_eq!(
            n1.inward("vol-0123456789abcdef@n1"),
            Inward::Here("vol-0123456789abcdef")
        );
        assert_eq!(
            n1.inward("snap-0123456789abcdef@node-2.example.com"),
            Inward::Elsewhere {
                id: "snap-0123456789abcdef",
                node: "node-2.example.com"
            }
        );
        // None of these is an id of any node.
        for raw in ["vol-0123456789abcdef", "", "@", "x@n1@n1", "@n1"] {
            let bare = match n1.inward(raw) {
                Inward::Here(b) | Inward::Elsewhere { id: b, .. } => b,
            };
            assert!(VolumeId::parse(bare).is_none(), "{raw:?} -> {bare:?}");
        }
        // The longest node value keeps an id within the spec's 128 bytes.
        let long = Scope::node("n".repeat(63));
        assert!(long.show("group-0123456789abcdef").len() <= 128);
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
