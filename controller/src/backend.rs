//! The storage backend behind the Controller service, and the types it speaks.
//!
//! The gRPC layer ([`crate::service`]) checks the shape of every request (required fields,
//! sizes, enum values) and hands the backend typed requests. The backend decides everything
//! that depends on the storage: which capabilities and parameters it takes, how big a volume
//! is, what its ids look like, where a volume is accessible from, and how a volume reaches a
//! node. [`crate::embedded::EmbeddedBackend`] keeps sparse files and attaches them as loop
//! devices; a cloud backend (EBS, Cinder, ...) implements the same trait over its API, and the
//! service code does not change.
//!
//! The helpers at the end of this module ([`choose_size`], [`topology_allows`],
//! [`segment_within`], [`page_after`]) carry the CSI rules that do not depend on the storage,
//! so every backend applies them the same way.

use std::collections::BTreeMap;
use std::fmt;
use std::os::unix::fs::MetadataExt as _;
use std::path::Path;
use std::time::SystemTime;

use crate::encryption::rotation::RecordKeys;
use crate::error::{Error, Result};

/// A topology segment: topological domain → segment, e.g. `{"topology.moor.csi.io/node": "n1"}`.
pub type Segment = BTreeMap<String, String>;

/// Opaque key-value pairs (creation parameters, volume context, publish context).
pub type Parameters = BTreeMap<String, String>;

/// How a volume may be accessed, the CSI `AccessMode.Mode` values except UNKNOWN.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AccessMode {
    /// Read/write on one node.
    SingleNodeWriter,
    /// Read-only on one node.
    SingleNodeReaderOnly,
    /// Read-only on many nodes.
    MultiNodeReaderOnly,
    /// Read/write on one node, read-only on others.
    MultiNodeSingleWriter,
    /// Read/write on many nodes.
    MultiNodeMultiWriter,
    /// Read/write by one workload on one node.
    SingleNodeSingleWriter,
    /// Read/write by many workloads on one node.
    SingleNodeMultiWriter,
}

impl AccessMode {
    /// Whether the mode restricts the volume to one node.
    pub fn is_single_node(self) -> bool {
        matches!(
            self,
            AccessMode::SingleNodeWriter
                | AccessMode::SingleNodeReaderOnly
                | AccessMode::SingleNodeSingleWriter
                | AccessMode::SingleNodeMultiWriter
        )
    }

    /// Whether the mode only allows reading.
    pub fn is_reader_only(self) -> bool {
        matches!(
            self,
            AccessMode::SingleNodeReaderOnly | AccessMode::MultiNodeReaderOnly
        )
    }

    /// The proto's name for the mode, e.g. "SINGLE_NODE_WRITER".
    pub fn name(self) -> &'static str {
        match self {
            AccessMode::SingleNodeWriter => "SINGLE_NODE_WRITER",
            AccessMode::SingleNodeReaderOnly => "SINGLE_NODE_READER_ONLY",
            AccessMode::MultiNodeReaderOnly => "MULTI_NODE_READER_ONLY",
            AccessMode::MultiNodeSingleWriter => "MULTI_NODE_SINGLE_WRITER",
            AccessMode::MultiNodeMultiWriter => "MULTI_NODE_MULTI_WRITER",
            AccessMode::SingleNodeSingleWriter => "SINGLE_NODE_SINGLE_WRITER",
            AccessMode::SingleNodeMultiWriter => "SINGLE_NODE_MULTI_WRITER",
        }
    }
}

/// How a volume is presented to a workload.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum AccessType {
    /// A raw block device.
    Block,
    /// A mounted filesystem.
    Mount {
        /// The filesystem asked for (None: the node's default).
        fs_type: Option<String>,
    },
}

/// A volume capability, with its shape checked.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Capability {
    /// Block or mount.
    pub access: AccessType,
    /// Access mode.
    pub mode: AccessMode,
}

impl Capability {
    /// Whether the capability asks for a raw block device.
    pub fn is_block(&self) -> bool {
        self.access == AccessType::Block
    }
}

/// A capacity range; 0 means "not set" for either bound.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CapacityRange {
    /// The volume must be at least this big.
    pub required: u64,
    /// The volume must not be bigger than this.
    pub limit: u64,
}

impl CapacityRange {
    /// Whether a volume of `size` bytes satisfies the range.
    pub fn allows(&self, size: u64) -> bool {
        size >= self.required && (self.limit == 0 || size <= self.limit)
    }
}

/// Where the data of a new volume comes from.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ContentSource {
    /// A snapshot, by id.
    Snapshot(String),
    /// Another volume (a clone), by id.
    Volume(String),
}

/// CreateVolume's `accessibility_requirements`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TopologyRequirement {
    /// The volume must be accessible from at least one of these.
    pub requisite: Vec<Segment>,
    /// Preferred segments, in order.
    pub preferred: Vec<Segment>,
}

/// CreateVolume, validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewVolume {
    /// The CO's name for the volume (the idempotency key).
    pub name: String,
    /// Requested capacity (None: the backend's default).
    pub capacity: Option<CapacityRange>,
    /// Every capability the volume must support (at least one).
    pub capabilities: Vec<Capability>,
    /// Creation parameters, as [`Backend::parse_parameters`] normalised them.
    pub parameters: Parameters,
    /// Data to fill the volume with.
    pub source: Option<ContentSource>,
    /// Where the volume must be accessible from.
    pub accessibility: Option<TopologyRequirement>,
}

/// A volume, as CreateVolume, ListVolumes and ControllerGetVolume report it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Volume {
    /// The backend's id for the volume.
    pub id: String,
    /// The CO's name for it.
    pub name: String,
    /// Size in bytes.
    pub capacity_bytes: u64,
    /// The normalised creation parameters (kept to check later requests against; not sent).
    pub parameters: Parameters,
    /// The volume context handed to the CO (immutable for the volume's life).
    pub context: Parameters,
    /// Where its data came from.
    pub source: Option<ContentSource>,
    /// Where it is accessible from.
    pub topology: Vec<Segment>,
}

/// The health of a volume as the controller sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeCondition {
    /// Whether something is wrong.
    pub abnormal: bool,
    /// What, or that all is well.
    pub message: String,
}

/// A volume with its publications and condition.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeStatus {
    /// The volume.
    pub volume: Volume,
    /// Nodes it is controller-published at.
    pub published_nodes: Vec<String>,
    /// Its condition.
    pub condition: VolumeCondition,
}

/// ControllerPublishVolume, validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PublishRequest {
    /// The volume.
    pub volume_id: String,
    /// The node to publish at.
    pub node_id: String,
    /// How the node will use it.
    pub capability: Capability,
    /// Publish read-only.
    pub readonly: bool,
    /// The volume context the CO passed (may be empty).
    pub context: Parameters,
}

/// What a publish tells the node (ControllerPublishVolumeResponse.publish_context).
pub type PublishContext = BTreeMap<String, String>;

/// A volume's QoS limits: the mutable parameters of its VolumeAttributesClass
/// (ControllerModifyVolume, and CreateVolume's `mutable_parameters`). Each is a cap on the
/// volume's I/O, none when unset; a new set replaces the old whole, as a claim that moves to
/// another class takes that class's parameters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Qos {
    /// Bytes read per second.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub read_bps: Option<u64>,
    /// Bytes written per second.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub write_bps: Option<u64>,
    /// Reads per second.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub read_iops: Option<u64>,
    /// Writes per second.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub write_iops: Option<u64>,
}

/// The mutable parameters moor knows, as a VolumeAttributesClass names them.
pub use moor_runtime::contract::QOS_KEYS;

impl Qos {
    /// No limit at all.
    #[must_use]
    pub fn is_none(&self) -> bool {
        *self == Self::default()
    }

    /// Each limit with its key of [`QOS_KEYS`].
    #[must_use]
    pub fn limits(&self) -> [(&'static str, Option<u64>); 4] {
        [
            (QOS_KEYS[0], self.read_bps),
            (QOS_KEYS[1], self.write_bps),
            (QOS_KEYS[2], self.read_iops),
            (QOS_KEYS[3], self.write_iops),
        ]
    }

    /// The limits as the node reads them ([`moor_runtime::contract::QOS_LIMITS_KEY`]).
    #[must_use]
    pub fn to_context(&self) -> String {
        moor_runtime::contract::qos_to_context(&[
            self.read_bps,
            self.write_bps,
            self.read_iops,
            self.write_iops,
        ])
    }

    /// Sets the limit of `key` (one of [`QOS_KEYS`]); false for another key.
    pub fn set(&mut self, key: &str, value: u64) -> bool {
        let slot = match key {
            k if k == QOS_KEYS[0] => &mut self.read_bps,
            k if k == QOS_KEYS[1] => &mut self.write_bps,
            k if k == QOS_KEYS[2] => &mut self.read_iops,
            k if k == QOS_KEYS[3] => &mut self.write_iops,
            _ => return false,
        };
        *slot = Some(value);
        true
    }
}

/// ControllerExpandVolume, validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExpandRequest {
    /// The volume.
    pub volume_id: String,
    /// The new capacity range.
    pub capacity: CapacityRange,
    /// How the volume is used, if the CO said.
    pub capability: Option<Capability>,
}

/// CreateSnapshot, validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewSnapshot {
    /// The CO's name for the snapshot (the idempotency key).
    pub name: String,
    /// The volume to snapshot.
    pub source_volume_id: String,
    /// Snapshot parameters, unparsed.
    pub parameters: Parameters,
}

/// A snapshot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snapshot {
    /// The backend's id for it.
    pub id: String,
    /// The CO's name for it.
    pub name: String,
    /// The volume it was cut from.
    pub source_volume_id: String,
    /// Size of the data in bytes (the smallest volume it can restore to).
    pub size_bytes: u64,
    /// When it was cut.
    pub created_at: SystemTime,
    /// Whether it can be used as a volume source.
    pub ready_to_use: bool,
    /// The group snapshot it was cut in, if any.
    pub group_snapshot_id: Option<String>,
    /// Its source's encryption when it was cut (docs/encryption.md): the `encrypted`, `kmsID`
    /// and `luks*` parameters and the wrapped data key (`encryptedDEK`, wrapped for
    /// `source_volume_id`) that a restore opens with; empty for a source in the clear.
    pub encryption: Parameters,
}

/// CreateVolumeGroupSnapshot, validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewGroupSnapshot {
    /// The CO's name for the group snapshot (the idempotency key).
    pub name: String,
    /// The volumes to snapshot together: at least one, no repeats, in the request's order.
    pub source_volume_ids: Vec<String>,
    /// Group snapshot parameters, unparsed.
    pub parameters: Parameters,
}

/// A volume group snapshot: one snapshot of each member volume, all cut at one instant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupSnapshot {
    /// The backend's id for it.
    pub id: String,
    /// Its member snapshots (each with `group_snapshot_id` set to `id`), in the order of the
    /// volumes they were cut from. A member deleted on its own is no longer listed.
    pub snapshots: Vec<Snapshot>,
    /// When it was cut.
    pub created_at: SystemTime,
}

impl GroupSnapshot {
    /// Whether every member can be used as a volume source.
    pub fn ready_to_use(&self) -> bool {
        self.snapshots.iter().all(|s| s.ready_to_use)
    }
}

/// GetVolumeGroupSnapshot and DeleteVolumeGroupSnapshot, validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupSnapshotRef {
    /// The group snapshot.
    pub id: String,
    /// The member snapshot ids the CO knows (empty: the CO gave none, nothing to compare).
    pub snapshot_ids: Vec<String>,
}

impl GroupSnapshotRef {
    /// INVALID_ARGUMENT when the CO's `snapshot_ids` are not the group's `members` (order
    /// does not matter; an empty list is not compared).
    pub fn check_members(&self, members: &[String]) -> Result<()> {
        if self.snapshot_ids.is_empty() {
            return Ok(());
        }
        let mut theirs: Vec<&str> = self.snapshot_ids.iter().map(String::as_str).collect();
        let mut ours: Vec<&str> = members.iter().map(String::as_str).collect();
        theirs.sort_unstable();
        ours.sort_unstable();
        if theirs == ours {
            return Ok(());
        }
        Err(Error::invalid(
            "snapshot_ids",
            format!(
                "group snapshot {} holds {}, not {}",
                self.id,
                ours.join(", "),
                theirs
                    .iter()
                    .map(|s| crate::error::trunc(s))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        ))
    }
}

/// Where a snapshot metadata call (GetMetadataAllocated, GetMetadataDelta) sends what it finds.
///
/// The backend calls [`begin`](Self::begin) once, then [`range`](Self::range) for each
/// allocated or changed byte range, in ascending order, never overlapping, each a whole number
/// of blocks. The service cuts the ranges into fixed-length tuples, drops those ending at or
/// before the request's `starting_offset`, and streams them in messages of at most
/// `max_results` tuples. An error from the sink (the client went away) stops the backend.
pub trait MetadataSink {
    /// The volume's capacity and the block size of every range; OUT_OF_RANGE when the
    /// request's starting offset lies past the capacity.
    fn begin(&mut self, capacity_bytes: u64, block_size: u64) -> Result<()>;

    /// `[offset, offset + length)` is allocated (or changed).
    fn range(&mut self, offset: u64, length: u64) -> Result<()>;
}

/// A [`MetadataSink`] that keeps what it is given: for tools and tests.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CollectedBlocks {
    /// The volume's capacity.
    pub capacity_bytes: u64,
    /// The block size.
    pub block_size: u64,
    /// The ranges, as given.
    pub ranges: Vec<(u64, u64)>,
}

impl MetadataSink for CollectedBlocks {
    fn begin(&mut self, capacity_bytes: u64, block_size: u64) -> Result<()> {
        self.capacity_bytes = capacity_bytes;
        self.block_size = block_size;
        Ok(())
    }

    fn range(&mut self, offset: u64, length: u64) -> Result<()> {
        self.ranges.push((offset, length));
        Ok(())
    }
}

impl CollectedBlocks {
    /// The offset of every block the ranges cover, in order.
    pub fn offsets(&self) -> Vec<u64> {
        let step = usize::try_from(self.block_size.max(1)).unwrap_or(usize::MAX);
        self.ranges
            .iter()
            .flat_map(|&(o, l)| (o..o + l).step_by(step))
            .collect()
    }
}

/// Sends ranges to a [`MetadataSink`] in order, joining those that touch or overlap: what a
/// backend finds (data segments, changed extents) widened to whole blocks can overlap the
/// range before it.
#[derive(Debug)]
pub struct BlockRanges<'a> {
    sink: &'a mut dyn MetadataSink,
    pending: Option<(u64, u64)>,
}

impl<'a> BlockRanges<'a> {
    /// Ranges for `sink`.
    pub fn new(sink: &'a mut dyn MetadataSink) -> Self {
        Self {
            sink,
            pending: None,
        }
    }

    /// `[start, end)`, block-aligned, starting at or after the start of everything before.
    pub fn push(&mut self, start: u64, end: u64) -> Result<()> {
        if end <= start {
            return Ok(());
        }
        match &mut self.pending {
            Some((_, e)) if start <= *e => *e = (*e).max(end),
            _ => {
                if let Some((s, e)) = self.pending.take() {
                    self.sink.range(s, e - s)?;
                }
                self.pending = Some((start, end));
            }
        }
        Ok(())
    }

    /// The end of what was pushed so far.
    pub fn end(&self) -> u64 {
        self.pending.map_or(0, |(_, e)| e)
    }

    /// Sends what is pending.
    pub fn finish(mut self) -> Result<()> {
        if let Some((s, e)) = self.pending.take() {
            self.sink.range(s, e - s)?;
        }
        Ok(())
    }
}

impl fmt::Debug for dyn MetadataSink + '_ {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("MetadataSink")
    }
}

/// ListSnapshots filters.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SnapshotFilter {
    /// Only snapshots of this volume.
    pub source_volume_id: Option<String>,
    /// Only this snapshot.
    pub snapshot_id: Option<String>,
}

/// A page request: at most `max_entries` (0: no limit), starting where `starting_token` says.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PageRequest {
    /// Most entries to return (0: all).
    pub max_entries: usize,
    /// A `next_token` from an earlier page.
    pub starting_token: Option<String>,
}

/// One page of a listing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Page<T> {
    /// The entries.
    pub entries: Vec<T>,
    /// Where the next page starts, if there is one.
    pub next_token: Option<String>,
}

/// GetCapacity, validated.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct CapacityQuery {
    /// Normalised parameters.
    pub parameters: Parameters,
    /// Only storage accessible from this segment.
    pub topology: Option<Segment>,
}

/// GetCapacity's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Capacity {
    /// Bytes available for new volumes.
    pub available: u64,
    /// Largest volume that can be created, if there is a limit.
    pub maximum_volume_size: Option<u64>,
    /// Smallest volume that can be created, if there is a minimum.
    pub minimum_volume_size: Option<u64>,
}

/// Storage behind the CSI Controller service.
///
/// Every method blocks (the service calls them on tokio's blocking pool), must be idempotent
/// where the CSI spec says the RPC is, and must report each condition the spec names with the
/// matching [`Error`] variant; [`Error`] maps variants to gRPC codes. Ids coming from requests
/// have only their generic shape checked (non-empty, at most 128 bytes, no control
/// characters): an id that is not of the backend's own form names nothing, so it is
/// "not found" (or success for deletes and unpublishes), and must never reach a path or an API
/// call unchecked.
///
/// Operations on the same object may arrive concurrently (the CO may lose state); a backend
/// either serialises them or answers [`Error::OperationPending`] (ABORTED).
pub trait Backend: Send + Sync + fmt::Debug + 'static {
    /// Checks creation parameters and returns them normalised (e.g. aliases folded, ignored
    /// keys dropped). Unknown or malformed keys: [`Error::InvalidArgument`].
    fn parse_parameters(&self, raw: &Parameters) -> Result<Parameters>;

    /// Whether volumes created with `parameters` (normalised) can be used with `cap`; the
    /// error is a human-readable reason.
    fn check_capability(&self, cap: &Capability, parameters: &Parameters) -> Result<(), String>;

    /// Whether the backend is healthy; [`Error::NotReady`] when it is not.
    fn probe(&self) -> Result<()>;

    /// The backend's own metrics, in the Prometheus text format (none by default).
    fn metrics(&self) -> String {
        String::new()
    }

    /// Creates a volume, or returns the one created earlier under the same name when it is
    /// compatible ([`Error::VolumeExists`] when it is not).
    fn create_volume(&self, req: &NewVolume) -> Result<Volume>;

    /// Whether this backend makes encrypted volumes (docs/encryption.md): it keeps a
    /// volume's wrapped data key in its record ([`record_wrapped_dek`](Self::record_wrapped_dek)).
    fn serves_encryption(&self) -> bool {
        false
    }

    /// Keeps `wrapped`, the wrapped data key of the encrypted volume `volume_id`, in its
    /// record and its volume context, unless the record already holds one (a retry): the
    /// volume as it is then. Called before CreateVolume first answers, so the context the CO
    /// sees never changes.
    fn record_wrapped_dek(&self, volume_id: &str, wrapped: &str) -> Result<Volume> {
        let _ = wrapped;
        Err(Error::invalid(
            "parameters",
            format!(
                "volume {:?}: this backend does not keep encrypted volumes' keys yet",
                crate::error::trunc(volume_id)
            ),
        ))
    }

    /// The wrapped data keys the record of the encrypted volume `volume_id` holds now (its
    /// context's, until a rotation changes them; docs/encryption.md, "Rotation"). A volume in
    /// the clear: FAILED_PRECONDITION.
    fn volume_keys(&self, volume_id: &str) -> Result<RecordKeys> {
        Err(keys_not_kept(&format!(
            "volume {:?}",
            crate::error::trunc(volume_id)
        )))
    }

    /// Writes `after` as the keys of `volume_id`'s record, durably, if it holds `before`
    /// (ABORTED, nothing written, when another call changed them since they were read).
    fn write_volume_keys(
        &self,
        volume_id: &str,
        before: &RecordKeys,
        after: &RecordKeys,
    ) -> Result<()> {
        let _ = (before, after);
        Err(keys_not_kept(&format!(
            "volume {:?}",
            crate::error::trunc(volume_id)
        )))
    }

    /// The ids of the encrypted volumes whose keys this backend keeps, for a KEK rotation. A
    /// backend that makes encrypted volumes but does not rotate their keys refuses
    /// (FAILED_PRECONDITION), so that a KEK rotation never reports done while records of its
    /// stay under the old KEK (which the operator would then retire).
    fn encrypted_volume_ids(&self) -> Result<Vec<String>> {
        if self.serves_encryption() {
            return Err(keys_not_kept("the encrypted volumes of a backend"));
        }
        Ok(Vec::new())
    }

    /// Writes `after` as the wrapped data key the record of the snapshot `snapshot_id` of an
    /// encrypted volume carries ([`Snapshot::encryption`]'s `encryptedDEK`, wrapped for its
    /// source volume), durably, if it carries `before` (ABORTED, nothing written, when
    /// another call changed it since it was read): a KEK rotation's re-wrap, so that a
    /// restore opens after the old KEK is retired. A backend that keeps no snapshot keys
    /// refuses (FAILED_PRECONDITION).
    fn write_snapshot_key(&self, snapshot_id: &str, before: &str, after: &str) -> Result<()> {
        let _ = (before, after);
        Err(keys_not_kept(&format!(
            "snapshot {:?}",
            crate::error::trunc(snapshot_id)
        )))
    }

    /// Deletes a volume; a volume that does not exist is success.
    fn delete_volume(&self, volume_id: &str) -> Result<()>;

    /// Makes the volume available at the node and says how the node finds it.
    fn publish_volume(&self, req: &PublishRequest) -> Result<PublishContext>;

    /// Undoes [`publish_volume`](Self::publish_volume) at `node_id` (None: at every node); a
    /// volume or node that does not exist, or a volume not published there, is success.
    fn unpublish_volume(&self, volume_id: &str, node_id: Option<&str>) -> Result<()>;

    /// One volume with its publications and condition.
    fn get_volume(&self, volume_id: &str) -> Result<VolumeStatus>;

    /// A page of volumes. A token the backend cannot use: [`Error::InvalidToken`].
    fn list_volumes(&self, page: &PageRequest) -> Result<Page<VolumeStatus>>;

    /// Space available for new volumes.
    fn capacity(&self, query: &CapacityQuery) -> Result<Capacity>;

    /// Grows a volume (never shrinks it) and returns its new size.
    fn expand_volume(&self, req: &ExpandRequest) -> Result<u64>;

    /// Gives a volume the QoS limits `qos` (ControllerModifyVolume), replacing those it had.
    fn modify_volume(&self, volume_id: &str, qos: &Qos) -> Result<()>;

    /// Cuts a snapshot, or returns the one cut earlier under the same name from the same
    /// volume ([`Error::SnapshotExists`] when the source differs).
    fn create_snapshot(&self, req: &NewSnapshot) -> Result<Snapshot>;

    /// Deletes a snapshot; a snapshot that does not exist is success.
    fn delete_snapshot(&self, snapshot_id: &str) -> Result<()>;

    /// One snapshot.
    fn get_snapshot(&self, snapshot_id: &str) -> Result<Snapshot>;

    /// A page of snapshots matching the filter.
    fn list_snapshots(&self, filter: &SnapshotFilter, page: &PageRequest)
    -> Result<Page<Snapshot>>;

    /// Cuts one snapshot of every source volume at one instant (write-order consistent across
    /// them), or returns the group snapshot cut earlier under the same name from the same
    /// volumes ([`Error::GroupSnapshotExists`] when they differ); [`Error::GroupRefused`]
    /// when the volumes cannot be snapshotted together.
    fn create_group_snapshot(&self, req: &NewGroupSnapshot) -> Result<GroupSnapshot> {
        let _ = req;
        Err(Error::Unimplemented("CreateVolumeGroupSnapshot"))
    }

    /// Deletes a group snapshot and its member snapshots; one that does not exist is success.
    fn delete_group_snapshot(&self, req: &GroupSnapshotRef) -> Result<()> {
        let _ = req;
        Err(Error::Unimplemented("DeleteVolumeGroupSnapshot"))
    }

    /// One group snapshot.
    fn get_group_snapshot(&self, req: &GroupSnapshotRef) -> Result<GroupSnapshot> {
        let _ = req;
        Err(Error::Unimplemented("GetVolumeGroupSnapshot"))
    }

    /// The allocated blocks of a snapshot from `start` on, into `sink`.
    fn snapshot_allocated(
        &self,
        snapshot_id: &str,
        start: u64,
        sink: &mut dyn MetadataSink,
    ) -> Result<()> {
        let _ = (snapshot_id, start, sink);
        Err(Error::Unimplemented("GetMetadataAllocated"))
    }

    /// The blocks that differ between two snapshots of one volume from `start` on, into
    /// `sink`.
    fn snapshot_delta(
        &self,
        base_snapshot_id: &str,
        target_snapshot_id: &str,
        start: u64,
        sink: &mut dyn MetadataSink,
    ) -> Result<()> {
        let _ = (base_snapshot_id, target_snapshot_id, start, sink);
        Err(Error::Unimplemented("GetMetadataDelta"))
    }
}

/// How a backend sizes volumes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SizePolicy {
    /// Size when the request gives none.
    pub default: u64,
    /// Sizes are rounded up to a multiple of this (a power of two is not required).
    pub granularity: u64,
    /// Largest volume.
    pub max: u64,
}

/// Picks the size of a new volume: the required size (or the default, capped by the limit),
/// at least `floor` (the size of the content source), rounded up to the granularity.
/// [`Error::OutOfRange`] when no size satisfies the range.
pub fn choose_size(range: Option<&CapacityRange>, policy: &SizePolicy, floor: u64) -> Result<u64> {
    let g = policy.granularity.max(1);
    let r = range.copied().unwrap_or_default();
    if r.limit > 0 && r.required > r.limit {
        return Err(Error::OutOfRange(format!(
            "required_bytes {} is larger than limit_bytes {}",
            r.required, r.limit
        )));
    }
    let want = if r.required > 0 {
        r.required
    } else if r.limit > 0 {
        policy.default.min(r.limit / g * g)
    } else {
        policy.default
    };
    let want = want.max(floor);
    if want == 0 {
        return Err(Error::OutOfRange(format!(
            "limit_bytes {} is smaller than the allocation unit of {g} bytes",
            r.limit
        )));
    }
    let size = want.checked_next_multiple_of(g).ok_or_else(|| {
        Error::OutOfRange(format!("{want} bytes is larger than the largest volume"))
    })?;
    if r.limit > 0 && size > r.limit {
        let why = if floor > r.limit {
            format!("the content source holds {floor} bytes")
        } else {
            format!("sizes are multiples of {g} bytes")
        };
        return Err(Error::OutOfRange(format!(
            "no size within limit_bytes {}: {why}",
            r.limit
        )));
    }
    if size > policy.max {
        return Err(Error::OutOfRange(format!(
            "{size} bytes is larger than the largest volume ({} bytes)",
            policy.max
        )));
    }
    Ok(size)
}

/// Whether `candidate` names a place within `ours`: every domain it names (compared without
/// regard to case, as the spec requires of keys) is one of ours, with the same segment.
/// An empty candidate names nothing.
pub fn segment_within(candidate: &Segment, ours: &Segment) -> bool {
    !candidate.is_empty()
        && candidate.iter().all(|(k, v)| {
            ours.iter()
                .any(|(ok, ov)| ok.eq_ignore_ascii_case(k) && ov == v)
        })
}

/// Whether a volume accessible from `ours` satisfies the requirement: the spec makes only
/// `requisite` binding (with no requisite, the plugin may choose freely among all topologies,
/// `preferred` being an order of preference).
pub fn topology_allows(req: &TopologyRequirement, ours: &Segment) -> bool {
    req.requisite.is_empty() || req.requisite.iter().any(|s| segment_within(s, ours))
}

/// One page of `items` (sorted by key, ascending), starting at the first key not below
/// `start`; the next token is the first key of the next page. Deleting or adding entries
/// between calls never invalidates a token.
pub fn page_after<'a, T: Clone + 'a>(
    items: impl IntoIterator<Item = (&'a String, &'a T)>,
    start: Option<&str>,
    max_entries: usize,
) -> Page<T> {
    let mut entries = Vec::new();
    let mut next_token = None;
    for (key, item) in items {
        if start.is_some_and(|s| key.as_str() < s) {
            continue;
        }
        if max_entries > 0 && entries.len() == max_entries {
            next_token = Some(key.clone());
            break;
        }
        entries.push(item.clone());
    }
    Page {
        entries,
        next_token,
    }
}

/// Checks that a backend may keep volumes in the data dir at `path`: a real directory (not a
/// symlink), owned by this process's effective user, and writable by no one else. Anyone else
/// able to write there could plant records or backing files the controller would attach.
/// A backend calls this on its data dir before reading anything from it.
pub fn check_data_dir(path: &Path) -> Result<()> {
    let meta = std::fs::symlink_metadata(path).map_err(|e| Error::io("stat data dir", path, e))?;
    let refuse = |why: String| {
        Err(Error::NotReady(format!(
            "data dir {}: {why}; refusing to use it",
            path.display()
        )))
    };
    if meta.file_type().is_symlink() {
        return refuse("is a symlink".into());
    }
    if !meta.is_dir() {
        return refuse("is not a directory".into());
    }
    let me = rustix::process::geteuid().as_raw();
    if meta.uid() != me {
        return refuse(format!(
            "is owned by uid {}, not by this process (uid {me})",
            meta.uid()
        ));
    }
    if meta.mode() & 0o022 != 0 {
        return refuse(format!(
            "is writable by its group or others (mode {:o})",
            meta.mode() & 0o7777
        ));
    }
    Ok(())
}

/// The answer of a backend that does not rotate its volumes' keys (yet).
fn keys_not_kept(what: &str) -> Error {
    Error::FailedPrecondition(format!(
        "{what}: its backend does not rotate encrypted volumes' keys (built for the embedded \
         and RBD backends; docs/encryption.md, \"Rotation\"); nothing was changed"
    ))
}

#[cfg(test)]
mod tests {
    use super::check_data_dir;

    fn scratch(tag: &str) -> std::path::PathBuf {
        let p = std::env::temp_dir().join(format!("moor-datadir-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        let _ = std::fs::remove_file(&p);
        p
    }

    #[test]
    fn data_dir_must_be_ours_and_private() {
        use std::os::unix::fs::PermissionsExt as _;
        let ok = scratch("ok");
        std::fs::create_dir(&ok).expect("dir");
        std::fs::set_permissions(&ok, std::fs::Permissions::from_mode(0o700)).expect("chmod");
        assert!(check_data_dir(&ok).is_ok());

        std::fs::set_permissions(&ok, std::fs::Permissions::from_mode(0o777)).expect("chmod");
        let e = check_data_dir(&ok).expect_err("world-writable");
        assert!(e.to_string().contains("writable"), "{e}");
        std::fs::set_permissions(&ok, std::fs::Permissions::from_mode(0o755)).expect("chmod");

        let link = scratch("link");
        std::os::unix::fs::symlink(&ok, &link).expect("symlink");
        assert!(check_data_dir(&link).is_err());
        let _ = std::fs::remove_file(&link);

        let file = scratch("file");
        std::fs::write(&file, b"").expect("file");
        assert!(check_data_dir(&file).is_err());
        let _ = std::fs::remove_file(&file);

        assert!(check_data_dir(&scratch("missing")).is_err());

        // Owned by someone else (only root can give a dir away; others skip this part).
        if rustix::process::geteuid().is_root() {
            rustix::fs::chown(&ok, Some(rustix::process::Uid::from_raw(65534)), None)
                .expect("chown");
            let e = check_data_dir(&ok).expect_err("not ours");
            assert!(e.to_string().contains("owned by uid 65534"), "{e}");
        }
        let _ = std::fs::remove_dir_all(&ok);
    }

    use super::*;

    const MIB: u64 = 1 << 20;
    const POLICY: SizePolicy = SizePolicy {
        default: 1 << 30,
        granularity: MIB,
        max: 1 << 50,
    };

    fn range(required: u64, limit: u64) -> CapacityRange {
        CapacityRange { required, limit }
    }

    #[test]
    fn size_defaults_and_rounds_up() {
        assert_eq!(choose_size(None, &POLICY, 0).unwrap(), 1 << 30);
        assert_eq!(choose_size(Some(&range(1, 0)), &POLICY, 0).unwrap(), MIB);
        assert_eq!(
            choose_size(Some(&range(MIB + 1, 0)), &POLICY, 0).unwrap(),
            2 * MIB
        );
        assert_eq!(
            choose_size(Some(&range(0, 100 * MIB + 5)), &POLICY, 0).unwrap(),
            100 * MIB
        );
        assert_eq!(
            choose_size(Some(&range(5 * MIB, 5 * MIB)), &POLICY, 0).unwrap(),
            5 * MIB
        );
    }

    #[test]
    fn size_honours_the_source_and_the_limit() {
        assert_eq!(
            choose_size(Some(&range(MIB, 0)), &POLICY, 3 * MIB).unwrap(),
            3 * MIB
        );
        for (r, floor) in [
            (range(0, 2 * MIB), 3 * MIB),
            (range(1000, 1000), 0),
            (range(0, 1000), 0),
            (range(2 * MIB, MIB), 0),
            (range(u64::MAX, 0), 0),
            (range(1 << 51, 0), 0),
        ] {
            let e = choose_size(Some(&r), &POLICY, floor).unwrap_err();
            assert!(matches!(e, Error::OutOfRange(_)), "{r:?}: {e}");
        }
    }

    #[test]
    fn topology_matching() {
        let ours = Segment::from([("topology.moor.csi.io/node".to_string(), "n1".to_string())]);
        let other = Segment::from([("topology.moor.csi.io/node".to_string(), "n2".to_string())]);
        let upper = Segment::from([("Topology.Moor.CSI.io/node".to_string(), "n1".to_string())]);
        let zone = Segment::from([("zone".to_string(), "z".to_string())]);
        assert!(segment_within(&ours, &ours));
        assert!(segment_within(&upper, &ours));
        assert!(!segment_within(&other, &ours));
        assert!(!segment_within(&zone, &ours));
        assert!(!segment_within(&Segment::new(), &ours));
        let req = |requisite: Vec<Segment>, preferred: Vec<Segment>| TopologyRequirement {
            requisite,
            preferred,
        };
        assert!(topology_allows(&req(vec![], vec![other.clone()]), &ours));
        assert!(topology_allows(
            &req(vec![other.clone(), ours.clone()], vec![]),
            &ours
        ));
        assert!(!topology_allows(&req(vec![other], vec![]), &ours));
    }

    #[test]
    fn paging() {
        let map: BTreeMap<String, u32> = (0..5).map(|i| (format!("k{i}"), i)).collect();
        let p = page_after(&map, None, 2);
        assert_eq!(p.entries, vec![0, 1]);
        assert_eq!(p.next_token.as_deref(), Some("k2"));
        let p = page_after(&map, Some("k2"), 2);
        assert_eq!(p.entries, vec![2, 3]);
        let p = page_after(&map, Some("k4"), 2);
        assert_eq!(p.entries, vec![4]);
        assert_eq!(p.next_token, None);
        // The entry the token names was deleted: the page starts at the next one.
        let p = page_after(&map, Some("k1a"), 0);
        assert_eq!(p.entries, vec![2, 3, 4]);
        assert_eq!(page_after(&map, None, 5).next_token, None);
    }
}
