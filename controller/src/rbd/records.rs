//! What the RBD backend records about its volumes and snapshots, and where: in the pool's
//! metadata (librbd's pool metadata, the omap of the pool's `rbd_info` object), one JSON
//! record per object and one name index entry per CO name:
//!
//! ```text
//! moor.vname.<CO name>   → volume suffix      (CreateVolume's idempotency, by name)
//! moor.vol.<suffix>      → VolumeRecord       (parameters, publications, fencing, state)
//! moor.sname.<CO name>   → snapshot suffix
//! moor.snap.<suffix>     → SnapshotRecord
//! moor.gname.<CO name>   → group snapshot suffix
//! moor.group.<suffix>    → GroupRecord        (its members are snapshots naming it)
//! ```
//!
//! Why there: the records live in the cluster, next to the images, so they survive the
//! controller (a restart, a move to another node, a second replica taking over) and every
//! controller of the cluster sees the same; each key is written whole in one atomic omap
//! update; and unlike image metadata, writing them takes no image lock, so a publish or an
//! unpublish never waits for (or is refused by) the node that holds the image open.
//!
//! Order of writes, so a crash at any point is finished by the retry the CO makes: create
//! writes the name index, then the record (state `creating`), then the image, then the state
//! `ready`; delete marks the record `deleting`, removes the image, the name index, the record.

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use moor_rbd::Pool;
use serde::{Deserialize, Serialize};
use tracing::warn;

use crate::backend::{ContentSource, Parameters};

/// The format of the records written here.
pub const FORMAT_VERSION: u32 = 1;

const VOLUME_PREFIX: &str = "moor.vol.";
const VOLUME_NAME_PREFIX: &str = "moor.vname.";
const SNAPSHOT_PREFIX: &str = "moor.snap.";
const SNAPSHOT_NAME_PREFIX: &str = "moor.sname.";
const GROUP_PREFIX: &str = "moor.group.";
const GROUP_NAME_PREFIX: &str = "moor.gname.";

/// Reading or writing a record failed.
#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    /// The cluster refused or failed.
    #[error("{0}")]
    Ceph(#[from] moor_rbd::Error),
    /// A record is not one this version reads.
    #[error("record {key} in pool {pool} is unreadable: {reason}")]
    Unreadable {
        /// Its key.
        key: String,
        /// Its pool.
        pool: String,
        /// Why.
        reason: String,
    },
}

/// Where a volume is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum VolumeState {
    /// Being created: the image may not exist yet.
    Creating,
    /// Created; the CO knows it.
    Ready,
    /// Being deleted.
    Deleting,
    /// Deleted for the CO; the image is kept while snapshots or clones depend on it, and
    /// removed with the last of them.
    Retained,
}

/// A node the volume is published at.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Publication {
    /// The node.
    pub node_id: String,
    /// Whether the node may only read.
    pub readonly: bool,
    /// The access mode it was published with (the proto's name).
    pub mode: String,
}

/// A fencing: clients of a node that still had the image open when it was unpublished there,
/// blocklisted before the volume could go to another node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Fencing {
    /// The node the volume was taken from.
    pub node_id: String,
    /// The client addresses blocklisted.
    pub addresses: Vec<String>,
    /// When (seconds since the epoch).
    pub at_secs: u64,
    /// When the blocklist entries expire (seconds since the epoch).
    pub expires_secs: u64,
}

/// Fencings kept per volume (the latest).
pub const FENCINGS_KEPT: usize = 8;

/// A volume.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeRecord {
    /// [`FORMAT_VERSION`].
    pub version: u32,
    /// The CO's name.
    pub name: String,
    /// Where it is in its life.
    pub state: VolumeState,
    /// Normalized creation parameters.
    pub parameters: Parameters,
    /// The volume context handed to the CO.
    pub context: Parameters,
    /// Where its data came from.
    pub source: Option<ContentSource>,
    /// Its size when created (idempotent CreateVolume accepts it as well as the current).
    pub created_bytes: u64,
    /// Its size.
    pub capacity_bytes: u64,
    /// Nodes it is published at.
    #[serde(default)]
    pub publications: Vec<Publication>,
    /// The latest fencings.
    #[serde(default)]
    pub fencings: Vec<Fencing>,
    /// Its QoS limits, as last set (also in the image's librbd settings): what a
    /// ControllerPublishVolume tells the node to apply in the pod's cgroup.
    #[serde(default, skip_serializing_if = "crate::backend::Qos::is_none")]
    pub qos: crate::backend::Qos,
}

/// Where a snapshot is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SnapshotState {
    /// Being cut.
    Creating,
    /// Cut; the CO knows it.
    Ready,
    /// Deleted for the CO; the RBD snapshot is kept while clones of it exist.
    Retained,
}

/// A snapshot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotRecord {
    /// [`FORMAT_VERSION`].
    pub version: u32,
    /// The CO's name.
    pub name: String,
    /// Where it is in its life.
    pub state: SnapshotState,
    /// The volume it was cut from (its CSI id).
    pub source_volume_id: String,
    /// That volume's suffix.
    pub volume_suffix: String,
    /// The RBD id of that volume's image (stable for the image's whole life).
    pub image_id: String,
    /// Its size: the image's size when it was cut.
    pub size_bytes: u64,
    /// When it was cut: seconds since the epoch.
    pub created_secs: u64,
    /// And nanoseconds.
    pub created_nanos: u32,
    /// The suffix of the group snapshot it was cut in, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group_suffix: Option<String>,
    /// For a member of a group snapshot cut while its volumes were in use: the image its
    /// snapshot is of, a copy of the volume at the group's instant (`image_id` is the copy's
    /// id). None: the snapshot is of the volume's image.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub copy_image: Option<String>,
    /// Its source's encryption parameters and wrapped data key when it was cut
    /// (`encryption::of_volume`); empty for a source in the clear.
    #[serde(default, skip_serializing_if = "Parameters::is_empty")]
    pub encryption: Parameters,
}

/// Where a group snapshot is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GroupState {
    /// Being cut: some members' RBD snapshots may exist; a retry removes them and cuts all
    /// again (they must be of one instant).
    Creating,
    /// Cut; the CO knows it.
    Ready,
    /// Being deleted.
    Deleting,
}

/// A volume group snapshot: one snapshot per member volume, all in this pool.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupRecord {
    /// [`FORMAT_VERSION`].
    pub version: u32,
    /// The CO's name.
    pub name: String,
    /// Where it is in its life.
    pub state: GroupState,
    /// The member volumes' suffixes, in the request's order.
    pub volume_suffixes: Vec<String>,
    /// The member snapshots' suffixes, one per volume, in the same order.
    pub snapshot_suffixes: Vec<String>,
    /// When it was cut: seconds since the epoch.
    pub created_secs: u64,
    /// And nanoseconds.
    pub created_nanos: u32,
}

impl GroupRecord {
    /// When it was cut.
    pub fn created_at(&self) -> SystemTime {
        UNIX_EPOCH + Duration::new(self.created_secs, self.created_nanos)
    }
}

impl SnapshotRecord {
    /// The name of the image its RBD snapshot is of: the volume's, or its copy's.
    pub fn image_name(&self) -> String {
        self.copy_image
            .clone()
            .unwrap_or_else(|| super::ids::VolumeId::image_of(&self.volume_suffix))
    }

    /// The time fields of `t`.
    pub fn time_fields(t: SystemTime) -> (u64, u32) {
        let d = t.duration_since(UNIX_EPOCH).unwrap_or_default();
        (d.as_secs(), d.subsec_nanos())
    }

    /// When it was cut.
    pub fn created_at(&self) -> SystemTime {
        UNIX_EPOCH + Duration::new(self.created_secs, self.created_nanos)
    }
}

/// The records of one pool.
#[derive(Debug, Clone, Copy)]
pub struct Registry<'a> {
    pool: &'a Pool,
}

impl<'a> Registry<'a> {
    /// The records kept in `pool`.
    pub fn new(pool: &'a Pool) -> Self {
        Self { pool }
    }

    fn get<T: for<'de> Deserialize<'de>>(&self, key: &str) -> Result<Option<T>, RecordError> {
        let Some(text) = self.pool.metadata_get(key)? else {
            return Ok(None);
        };
        serde_json::from_str(&text)
            .map(Some)
            .map_err(|e| RecordError::Unreadable {
                key: key.to_string(),
                pool: self.pool.name().to_string(),
                reason: e.to_string(),
            })
    }

    fn put<T: Serialize>(&self, key: &str, value: &T) -> Result<(), RecordError> {
        let text = serde_json::to_string(value).map_err(|e| RecordError::Unreadable {
            key: key.to_string(),
            pool: self.pool.name().to_string(),
            reason: e.to_string(),
        })?;
        Ok(self.pool.metadata_set(key, &text)?)
    }

    fn list<T: for<'de> Deserialize<'de>>(
        &self,
        prefix: &str,
    ) -> Result<BTreeMap<String, T>, RecordError> {
        let mut out = BTreeMap::new();
        for (key, text) in self.pool.metadata_list(prefix, None, 0)? {
            let suffix = key[prefix.len()..].to_string();
            match serde_json::from_str(&text) {
                Ok(rec) => {
                    out.insert(suffix, rec);
                }
                Err(e) => warn!(
                    pool = self.pool.name(),
                    key, error = %e, "unreadable record left alone"
                ),
            }
        }
        Ok(out)
    }

    /// A volume's record.
    pub fn volume(&self, suffix: &str) -> Result<Option<VolumeRecord>, RecordError> {
        self.get(&format!("{VOLUME_PREFIX}{suffix}"))
    }

    /// Writes a volume's record.
    pub fn put_volume(&self, suffix: &str, rec: &VolumeRecord) -> Result<(), RecordError> {
        self.put(&format!("{VOLUME_PREFIX}{suffix}"), rec)
    }

    /// Removes a volume's record.
    pub fn remove_volume(&self, suffix: &str) -> Result<(), RecordError> {
        self.pool
            .metadata_remove(&format!("{VOLUME_PREFIX}{suffix}"))?;
        Ok(())
    }

    /// Every volume record of the pool, by suffix (unreadable ones are skipped, logged).
    pub fn volumes(&self) -> Result<BTreeMap<String, VolumeRecord>, RecordError> {
        self.list(VOLUME_PREFIX)
    }

    /// The suffix of the volume named `name`.
    pub fn volume_named(&self, name: &str) -> Result<Option<String>, RecordError> {
        Ok(self
            .pool
            .metadata_get(&format!("{VOLUME_NAME_PREFIX}{name}"))?)
    }

    /// Records that `name` is the volume of `suffix`.
    pub fn name_volume(&self, name: &str, suffix: &str) -> Result<(), RecordError> {
        Ok(self
            .pool
            .metadata_set(&format!("{VOLUME_NAME_PREFIX}{name}"), suffix)?)
    }

    /// Forgets that `name` is the volume of `suffix` (a name that now means another volume is
    /// left alone).
    pub fn unname_volume(&self, name: &str, suffix: &str) -> Result<(), RecordError> {
        if self.volume_named(name)?.as_deref() == Some(suffix) {
            self.pool
                .metadata_remove(&format!("{VOLUME_NAME_PREFIX}{name}"))?;
        }
        Ok(())
    }

    /// A snapshot's record.
    pub fn snapshot(&self, suffix: &str) -> Result<Option<SnapshotRecord>, RecordError> {
        self.get(&format!("{SNAPSHOT_PREFIX}{suffix}"))
    }

    /// Writes a snapshot's record.
    pub fn put_snapshot(&self, suffix: &str, rec: &SnapshotRecord) -> Result<(), RecordError> {
        self.put(&format!("{SNAPSHOT_PREFIX}{suffix}"), rec)
    }

    /// Removes a snapshot's record.
    pub fn remove_snapshot(&self, suffix: &str) -> Result<(), RecordError> {
        self.pool
            .metadata_remove(&format!("{SNAPSHOT_PREFIX}{suffix}"))?;
        Ok(())
    }

    /// Every snapshot record of the pool, by suffix.
    pub fn snapshots(&self) -> Result<BTreeMap<String, SnapshotRecord>, RecordError> {
        self.list(SNAPSHOT_PREFIX)
    }

    /// The suffix of the snapshot named `name`.
    pub fn snapshot_named(&self, name: &str) -> Result<Option<String>, RecordError> {
        Ok(self
            .pool
            .metadata_get(&format!("{SNAPSHOT_NAME_PREFIX}{name}"))?)
    }

    /// Records that `name` is the snapshot of `suffix`.
    pub fn name_snapshot(&self, name: &str, suffix: &str) -> Result<(), RecordError> {
        Ok(self
            .pool
            .metadata_set(&format!("{SNAPSHOT_NAME_PREFIX}{name}"), suffix)?)
    }

    /// Forgets that `name` is the snapshot of `suffix`.
    pub fn unname_snapshot(&self, name: &str, suffix: &str) -> Result<(), RecordError> {
        if self.snapshot_named(name)?.as_deref() == Some(suffix) {
            self.pool
                .metadata_remove(&format!("{SNAPSHOT_NAME_PREFIX}{name}"))?;
        }
        Ok(())
    }

    /// A group snapshot's record.
    pub fn group(&self, suffix: &str) -> Result<Option<GroupRecord>, RecordError> {
        self.get(&format!("{GROUP_PREFIX}{suffix}"))
    }

    /// Writes a group snapshot's record.
    pub fn put_group(&self, suffix: &str, rec: &GroupRecord) -> Result<(), RecordError> {
        self.put(&format!("{GROUP_PREFIX}{suffix}"), rec)
    }

    /// Removes a group snapshot's record.
    pub fn remove_group(&self, suffix: &str) -> Result<(), RecordError> {
        self.pool
            .metadata_remove(&format!("{GROUP_PREFIX}{suffix}"))?;
        Ok(())
    }

    /// The suffix of the group snapshot named `name`.
    pub fn group_named(&self, name: &str) -> Result<Option<String>, RecordError> {
        Ok(self
            .pool
            .metadata_get(&format!("{GROUP_NAME_PREFIX}{name}"))?)
    }

    /// Records that `name` is the group snapshot of `suffix`.
    pub fn name_group(&self, name: &str, suffix: &str) -> Result<(), RecordError> {
        Ok(self
            .pool
            .metadata_set(&format!("{GROUP_NAME_PREFIX}{name}"), suffix)?)
    }

    /// Forgets that `name` is the group snapshot of `suffix`.
    pub fn unname_group(&self, name: &str, suffix: &str) -> Result<(), RecordError> {
        if self.group_named(name)?.as_deref() == Some(suffix) {
            self.pool
                .metadata_remove(&format!("{GROUP_NAME_PREFIX}{name}"))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_read_back_and_old_ones_without_publications_still_read() {
        let rec = VolumeRecord {
            version: FORMAT_VERSION,
            name: "pvc-1".into(),
            state: VolumeState::Ready,
            parameters: Parameters::from([("pool".into(), "rbd".into())]),
            context: Parameters::new(),
            source: Some(ContentSource::Snapshot("rbd/c/p/moor-snap-x".into())),
            created_bytes: 1 << 30,
            capacity_bytes: 2 << 30,
            publications: vec![Publication {
                node_id: "n1".into(),
                readonly: false,
                mode: "SINGLE_NODE_WRITER".into(),
            }],
            fencings: vec![],
            qos: crate::backend::Qos {
                write_iops: Some(100),
                ..Default::default()
            },
        };
        let text = serde_json::to_string(&rec).unwrap();
        assert!(text.contains("\"state\":\"ready\""), "{text}");
        assert_eq!(serde_json::from_str::<VolumeRecord>(&text).unwrap(), rec);
        let bare = r#"{"version":1,"name":"n","state":"creating","parameters":{},"context":{},
                       "source":null,"created_bytes":1,"capacity_bytes":1}"#;
        let r: VolumeRecord = serde_json::from_str(bare).unwrap();
        assert!(r.publications.is_empty() && r.fencings.is_empty());
    }

    #[test]
    fn snapshot_times_round_trip() {
        let t = UNIX_EPOCH + Duration::new(1_700_000_000, 123_456_789);
        let (secs, nanos) = SnapshotRecord::time_fields(t);
        let rec = SnapshotRecord {
            version: FORMAT_VERSION,
            name: "s".into(),
            state: SnapshotState::Ready,
            source_volume_id: "v".into(),
            volume_suffix: "x".into(),
            image_id: "10ab".into(),
            size_bytes: 1,
            created_secs: secs,
            created_nanos: nanos,
            group_suffix: None,
            copy_image: None,
            encryption: Parameters::new(),
        };
        assert_eq!(rec.created_at(), t);
        // Records written before group snapshots read back as lone snapshots.
        let text = serde_json::to_string(&rec).unwrap();
        assert!(!text.contains("group"), "{text}");
        assert_eq!(serde_json::from_str::<SnapshotRecord>(&text).unwrap(), rec);
    }
}
