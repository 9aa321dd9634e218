//! RBD image feature bits (librbd's features.h) and the options an image is created with.

use std::fmt;
use std::ops::BitOr;

/// A set of RBD image features.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Features(u64);

const NAMES: [(u64, &str); 12] = [
    (1 << 0, "layering"),
    (1 << 1, "striping"),
    (1 << 2, "exclusive-lock"),
    (1 << 3, "object-map"),
    (1 << 4, "fast-diff"),
    (1 << 5, "deep-flatten"),
    (1 << 6, "journaling"),
    (1 << 7, "data-pool"),
    (1 << 8, "operations"),
    (1 << 9, "migrating"),
    (1 << 10, "non-primary"),
    (1 << 11, "dirty-cache"),
];

impl Features {
    /// No features.
    pub const NONE: Features = Features(0);
    /// Clones of snapshots.
    pub const LAYERING: Features = Features(1 << 0);
    /// One client writes at a time; the lock moves between clients cooperatively.
    pub const EXCLUSIVE_LOCK: Features = Features(1 << 2);
    /// A map of which objects exist (needs exclusive-lock).
    pub const OBJECT_MAP: Features = Features(1 << 3);
    /// Fast diffs and usage (needs object-map).
    pub const FAST_DIFF: Features = Features(1 << 4);
    /// Flattening also detaches a clone's snapshots from the parent.
    pub const DEEP_FLATTEN: Features = Features(1 << 5);
    /// A journal of writes, for mirroring (needs exclusive-lock).
    pub const JOURNALING: Features = Features(1 << 6);
    /// What moor creates images with unless told otherwise: clones and the exclusive lock.
    pub const MOOR_DEFAULT: Features = Features(Self::LAYERING.0 | Self::EXCLUSIVE_LOCK.0);

    /// The raw bits.
    pub const fn bits(self) -> u64 {
        self.0
    }

    /// From raw bits (unknown bits are kept).
    pub const fn from_bits(bits: u64) -> Features {
        Features(bits)
    }

    /// Whether every feature of `other` is in `self`.
    pub const fn contains(self, other: Features) -> bool {
        self.0 & other.0 == other.0
    }

    /// The features' names, as `rbd info` prints them.
    pub fn names(self) -> Vec<String> {
        let mut names: Vec<String> = NAMES
            .iter()
            .filter(|(bit, _)| self.0 & bit != 0)
            .map(|(_, n)| (*n).to_owned())
            .collect();
        let unknown = NAMES.iter().fold(self.0, |rest, (bit, _)| rest & !bit);
        if unknown != 0 {
            names.push(format!("{unknown:#x}"));
        }
        names
    }

    /// From names as `rbd` takes them ("layering,exclusive-lock"); None for an unknown name.
    pub fn from_names(text: &str) -> Option<Features> {
        text.split(',')
            .map(str::trim)
            .filter(|n| !n.is_empty())
            .try_fold(Features::NONE, |acc, n| {
                NAMES
                    .iter()
                    .find(|(_, name)| *name == n)
                    .map(|(bit, _)| Features(acc.0 | bit))
            })
    }
}

impl BitOr for Features {
    type Output = Features;
    fn bitor(self, rhs: Features) -> Features {
        Features(self.0 | rhs.0)
    }
}

impl fmt::Display for Features {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0 == 0 {
            return f.write_str("none");
        }
        f.write_str(&self.names().join(", "))
    }
}

impl fmt::Debug for Features {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Features({self})")
    }
}

/// How an image is created.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageOptions {
    /// Size in bytes.
    pub size: u64,
    /// Features; [`Features::MOOR_DEFAULT`] unless set.
    pub features: Features,
    /// log2 of the object size (librbd's default, 22 = 4 MiB, when None).
    pub order: Option<u8>,
    /// A pool for the image's data (its metadata stays in the image's pool); erasure-coded
    /// pools need this.
    pub data_pool: Option<String>,
}

impl ImageOptions {
    /// An image of `size` bytes with moor's default features.
    pub fn new(size: u64) -> ImageOptions {
        ImageOptions {
            size,
            features: Features::MOOR_DEFAULT,
            order: None,
            data_pool: None,
        }
    }

    /// With these features.
    pub fn features(mut self, features: Features) -> ImageOptions {
        self.features = features;
        self
    }

    /// With objects of `1 << order` bytes.
    pub fn order(mut self, order: u8) -> ImageOptions {
        self.order = Some(order);
        self
    }

    /// With its data in another pool.
    pub fn data_pool(mut self, pool: impl Into<String>) -> ImageOptions {
        self.data_pool = Some(pool.into());
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn features_have_librbds_bits_and_names() {
        assert_eq!(Features::MOOR_DEFAULT.bits(), 0b101);
        assert_eq!(
            Features::MOOR_DEFAULT.to_string(),
            "layering, exclusive-lock"
        );
        let all = Features::from_names("layering,exclusive-lock,object-map,fast-diff,deep-flatten");
        assert_eq!(
            all,
            Some(Features::from_bits(61)),
            "librbd's default set is 61"
        );
        assert_eq!(Features::from_names("layering,nonsense"), None);
        assert_eq!(Features::from_bits(1 << 40).to_string(), "0x10000000000");
        assert!(Features::from_bits(61).contains(Features::OBJECT_MAP | Features::LAYERING));
        assert!(!Features::MOOR_DEFAULT.contains(Features::OBJECT_MAP));
    }
}
