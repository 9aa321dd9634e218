//! The RBD backend's volume and snapshot ids, and the names of what it keeps in Ceph.
//!
//! A volume id names the cluster, the pool and the image, so that every later RPC (and the
//! node, through the volume context) finds the image from the id alone:
//!
//! ```text
//! rbd/<cluster>/<pool>/moor-vol-<24 hex>      a volume: the image's name is the last part
//! rbd/<cluster>/<pool>/moor-snap-<24 hex>     a snapshot
//! rbd/<cluster>/<pool>/moor-group-<24 hex>    a volume group snapshot (its members are snapshots)
//! ```
//!
//! `<cluster>` is a `clusterID` of the controller's cluster list, or `@` and the monitors
//! themselves when the StorageClass names them. The 24 hex digits are random, made when the
//! volume is created: an id is never reused, even for a later volume of the same name.
//! Everything is parsed strictly; anything else names no RBD volume of moor's.

use std::fmt;

use crate::error::{Error, Result};

/// The first part of every id of the RBD backend.
pub const ID_PREFIX: &str = "rbd/";
/// Images of volumes are named this and their suffix.
pub const VOLUME_IMAGE_PREFIX: &str = "moor-vol-";
/// The RBD snapshot behind a CSI snapshot is named this and its suffix.
pub const SNAPSHOT_PREFIX: &str = "moor-snap-";
/// Group snapshots' ids end in this and their suffix; so is named the RBD group that cuts
/// one while its volumes are in use (it exists only during the create).
pub const GROUP_PREFIX: &str = "moor-group-";
/// The copy of a volume made for a member of a group snapshot cut while the volumes were in
/// use is named this and the member snapshot's suffix.
pub const COPY_IMAGE_PREFIX: &str = "moor-copy-";
/// The RBD snapshot a volume is cloned from (a volume as content source) is named this and
/// the clone's suffix.
pub const CLONE_SOURCE_PREFIX: &str = "moor-src-";
/// The CSI limit on ids.
pub const MAX_ID_LEN: usize = 128;

const SUFFIX_HEX: usize = 24;
const MAX_CLUSTER_ID_LEN: usize = 64;
const MAX_POOL_LEN: usize = 63;

/// Whether `s` is a clusterID moor takes: 1 to 64 of `[A-Za-z0-9._-]`.
pub fn cluster_id_ok(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= MAX_CLUSTER_ID_LEN
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// Whether `s` is a pool name moor takes: 1 to 63 of `[A-Za-z0-9._-]`, not starting with a
/// dot (pools such as `.mgr` are Ceph's own).
pub fn pool_ok(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= MAX_POOL_LEN
        && !s.starts_with('.')
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// Monitors as a comma-separated list without spaces ("10.0.0.1:6789,10.0.0.2"), or None
/// when `s` has characters no monitor address has (addresses, host names, ports, `v1:`/`v2:`
/// and IPv6 brackets only).
pub fn normalize_monitors(s: &str) -> Option<String> {
    let parts: Vec<&str> = s
        .split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .collect();
    let ok = |p: &str| {
        p.bytes().all(|b| {
            b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'_' | b':' | b'[' | b']')
        })
    };
    (!parts.is_empty() && parts.iter().all(|p| ok(p))).then(|| parts.join(","))
}

/// Which cluster: one of the controller's list, or monitors given directly.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ClusterRef {
    /// A clusterID of the controller's cluster list.
    Id(String),
    /// Monitor addresses, normalized ([`normalize_monitors`]).
    Monitors(String),
}

impl ClusterRef {
    /// The cluster part of an id: the clusterID, or `@` and the monitors.
    pub fn encode(&self) -> String {
        match self {
            ClusterRef::Id(id) => id.clone(),
            ClusterRef::Monitors(m) => format!("@{m}"),
        }
    }

    fn parse(s: &str) -> Option<Self> {
        match s.strip_prefix('@') {
            Some(m) => normalize_monitors(m)
                .filter(|n| n == m)
                .map(ClusterRef::Monitors),
            None => cluster_id_ok(s).then(|| ClusterRef::Id(s.to_string())),
        }
    }
}

impl fmt::Display for ClusterRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ClusterRef::Id(id) => write!(f, "cluster {id}"),
            ClusterRef::Monitors(m) => write!(f, "the cluster at {m}"),
        }
    }
}

/// A pool of a cluster.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Location {
    /// The cluster.
    pub cluster: ClusterRef,
    /// The pool's name.
    pub pool: String,
}

/// What an id names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Volume,
    Snapshot,
    Group,
}

impl Kind {
    fn prefix(self) -> &'static str {
        match self {
            Kind::Volume => VOLUME_IMAGE_PREFIX,
            Kind::Snapshot => SNAPSHOT_PREFIX,
            Kind::Group => GROUP_PREFIX,
        }
    }
}

fn suffix_ok(s: &str) -> bool {
    s.len() == SUFFIX_HEX && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

fn parse_id(s: &str, kind: Kind) -> Option<(Location, String)> {
    if s.len() > MAX_ID_LEN {
        return None;
    }
    let rest = s.strip_prefix(ID_PREFIX)?;
    let mut parts = rest.split('/');
    let (cluster, pool, name) = (parts.next()?, parts.next()?, parts.next()?);
    if parts.next().is_some() || !pool_ok(pool) {
        return None;
    }
    let suffix = name.strip_prefix(kind.prefix()).filter(|x| suffix_ok(x))?;
    Some((
        Location {
            cluster: ClusterRef::parse(cluster)?,
            pool: pool.to_string(),
        },
        suffix.to_string(),
    ))
}

fn format_id(loc: &Location, kind: Kind, suffix: &str) -> String {
    format!(
        "{ID_PREFIX}{}/{}/{}{suffix}",
        loc.cluster.encode(),
        loc.pool,
        kind.prefix()
    )
}

/// Whether `s` is meant as an id of the RBD backend (it starts with [`ID_PREFIX`]); it may
/// still name nothing.
pub fn is_rbd_id(s: &str) -> bool {
    s.starts_with(ID_PREFIX)
}

/// A new random suffix (24 lowercase hex digits).
pub fn random_suffix() -> Result<String> {
    let mut buf = [0u8; SUFFIX_HEX / 2];
    let mut filled = 0;
    while filled < buf.len() {
        let n = rustix::rand::getrandom(&mut buf[filled..], rustix::rand::GetRandomFlags::empty())
            .map_err(|e| Error::backend("generate an id", std::io::Error::from(e)))?;
        filled += n;
    }
    Ok(buf.iter().map(|b| format!("{b:02x}")).collect())
}

/// A volume of the RBD backend.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct VolumeId {
    /// Its pool.
    pub location: Location,
    /// The random part of its image's name.
    pub suffix: String,
}

impl VolumeId {
    /// The volume `s` names, if it is an id of this form.
    pub fn parse(s: &str) -> Option<Self> {
        parse_id(s, Kind::Volume).map(|(location, suffix)| Self { location, suffix })
    }

    /// The image's name.
    pub fn image(&self) -> String {
        format!("{VOLUME_IMAGE_PREFIX}{}", self.suffix)
    }

    /// The image's name for a volume suffix.
    pub fn image_of(suffix: &str) -> String {
        format!("{VOLUME_IMAGE_PREFIX}{suffix}")
    }
}

impl fmt::Display for VolumeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&format_id(&self.location, Kind::Volume, &self.suffix))
    }
}

/// A snapshot of the RBD backend.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SnapshotId {
    /// The pool of its volume.
    pub location: Location,
    /// The random part of its RBD snapshot's name.
    pub suffix: String,
}

impl SnapshotId {
    /// The snapshot `s` names, if it is an id of this form.
    pub fn parse(s: &str) -> Option<Self> {
        parse_id(s, Kind::Snapshot).map(|(location, suffix)| Self { location, suffix })
    }

    /// The RBD snapshot's name.
    pub fn snap_name(&self) -> String {
        format!("{SNAPSHOT_PREFIX}{}", self.suffix)
    }
}

impl fmt::Display for SnapshotId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&format_id(&self.location, Kind::Snapshot, &self.suffix))
    }
}

/// A volume group snapshot of the RBD backend: its record is in the pool of its members.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct GroupId {
    /// The pool of its members.
    pub location: Location,
    /// Its random part.
    pub suffix: String,
}

impl GroupId {
    /// The group snapshot `s` names, if it is an id of this form.
    pub fn parse(s: &str) -> Option<Self> {
        parse_id(s, Kind::Group).map(|(location, suffix)| Self { location, suffix })
    }
}

impl fmt::Display for GroupId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&format_id(&self.location, Kind::Group, &self.suffix))
    }
}

/// The longest id a volume or snapshot in `loc` gets; an error naming what is too long when
/// it would pass the CSI limit of 128 bytes.
pub fn check_fits(loc: &Location) -> Result<()> {
    let probe = "0".repeat(SUFFIX_HEX);
    let longest = format_id(loc, Kind::Snapshot, &probe).len();
    if longest > MAX_ID_LEN {
        return Err(Error::invalid(
            "parameters",
            format!(
                "the cluster ({} bytes) and pool ({} bytes) names are too long to fit a volume \
                 id in {MAX_ID_LEN} bytes (with {} bytes of moor's own); name the cluster with a \
                 short clusterID from the controller's cluster list",
                loc.cluster.encode().len(),
                loc.pool.len(),
                longest - loc.cluster.encode().len() - loc.pool.len()
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn loc(cluster: ClusterRef, pool: &str) -> Location {
        Location {
            cluster,
            pool: pool.into(),
        }
    }

    #[test]
    fn ids_round_trip_and_say_what_they_name() {
        let suffix = random_suffix().unwrap();
        assert_eq!(suffix.len(), 24);
        let v = VolumeId {
            location: loc(ClusterRef::Id("prod".into()), "rbd"),
            suffix: suffix.clone(),
        };
        let text = v.to_string();
        assert_eq!(text, format!("rbd/prod/rbd/moor-vol-{suffix}"));
        assert_eq!(VolumeId::parse(&text), Some(v.clone()));
        assert_eq!(v.image(), format!("moor-vol-{suffix}"));
        assert!(
            SnapshotId::parse(&text).is_none(),
            "a volume id is not a snapshot id"
        );
        let s = SnapshotId {
            location: loc(
                ClusterRef::Monitors("[v2:10.0.0.1:3300,v1:10.0.0.1:6789]".into()),
                "pool.ssd",
            ),
            suffix,
        };
        let text = s.to_string();
        assert!(text.starts_with("rbd/@[v2:10.0.0.1:3300,v1:10.0.0.1:6789]/pool.ssd/moor-snap-"));
        assert_eq!(SnapshotId::parse(&text), Some(s));
        assert!(VolumeId::parse(&text).is_none());
        assert!(is_rbd_id(&text) && !is_rbd_id("vol-0123456789abcdef"));
    }

    #[test]
    fn parsing_is_strict() {
        let good = "rbd/prod/rbd/moor-vol-0123456789abcdef01234567";
        assert!(VolumeId::parse(good).is_some());
        for bad in [
            "",
            "rbd/prod/rbd/moor-vol-0123456789abcdef0123456",
            "rbd/prod/rbd/moor-vol-0123456789abcdef012345678",
            "rbd/prod/rbd/moor-vol-0123456789ABCDEF01234567",
            "rbd/prod/rbd/x/moor-vol-0123456789abcdef01234567",
            "rbd/prod/../moor-vol-0123456789abcdef01234567",
            "rbd/prod/.mgr/moor-vol-0123456789abcdef01234567",
            "rbd/pr od/rbd/moor-vol-0123456789abcdef01234567",
            "rbd//rbd/moor-vol-0123456789abcdef01234567",
            "rbd/@/rbd/moor-vol-0123456789abcdef01234567",
            "rbd/@a b/rbd/moor-vol-0123456789abcdef01234567",
            "rbd/@a,,b/rbd/moor-vol-0123456789abcdef01234567",
            "RBD/prod/rbd/moor-vol-0123456789abcdef01234567",
            "rbd/prod/rbd/moor-snap-0123456789abcdef01234567",
            "vol-0123456789abcdef",
        ] {
            assert!(VolumeId::parse(bad).is_none(), "{bad:?}");
        }
    }

    #[test]
    fn monitors_are_normalized_and_checked() {
        assert_eq!(
            normalize_monitors(" 10.0.0.1:6789, 10.0.0.2 ,").as_deref(),
            Some("10.0.0.1:6789,10.0.0.2")
        );
        assert_eq!(
            normalize_monitors("[v2:127.0.0.1:3300,v1:127.0.0.1:6789]").as_deref(),
            Some("[v2:127.0.0.1:3300,v1:127.0.0.1:6789]")
        );
        assert_eq!(normalize_monitors(""), None);
        assert_eq!(normalize_monitors("a/b"), None);
        assert_eq!(normalize_monitors("a b"), None);
    }

    #[test]
    fn ids_that_would_pass_128_bytes_are_refused_up_front() {
        // "rbd/" + 64 + "/" + 24 + "/moor-snap-" + 24 hex = 128 bytes.
        assert!(check_fits(&loc(ClusterRef::Id("c".repeat(64)), &"p".repeat(24))).is_ok());
        let e = check_fits(&loc(ClusterRef::Id("c".repeat(64)), &"p".repeat(25))).unwrap_err();
        assert!(e.to_string().contains("too long"), "{e}");
        let mons = ClusterRef::Monitors(
            (1..=7)
                .map(|i| format!("10.0.0.{i}:6789"))
                .collect::<Vec<_>>()
                .join(","),
        );
        assert!(check_fits(&loc(mons, "rbd")).is_err());
    }
}
