//! Request validation for every Controller RPC, in one place.
//!
//! Each function checks the shape of a CSI request (required fields, the spec's size limits,
//! enum values, banned characters) and turns it into a typed request of [`crate::backend`], or
//! an INVALID_ARGUMENT naming the field. What the storage accepts (parameters, access modes,
//! id forms) is the backend's to decide. Secrets are never read and never appear in an error.

use std::collections::{BTreeSet, HashMap};

use csi::volume_capability::{AccessType as CsiAccessType, access_mode::Mode};
use moor_proto::csi::v1 as csi;
use moor_runtime::limits;

use crate::backend::{
    AccessMode, AccessType, Capability, CapacityRange, ContentSource, ExpandRequest,
    GroupSnapshotRef, NewGroupSnapshot, NewSnapshot, NewVolume, PageRequest, Parameters,
    PublishRequest, QOS_KEYS, Qos, Segment, SnapshotFilter, TopologyRequirement,
};
use crate::error::{Error, Result, trunc};

pub use moor_runtime::limits::{MAX_MAP_BYTES, MAX_NODE_ID_LEN, MAX_STRING_LEN};
/// Most capabilities in one request.
pub const MAX_CAPABILITIES: usize = 32;

/// Checks an id from a request: set, at most 128 bytes, no control characters.
pub fn id(field: &'static str, raw: &str) -> Result<String> {
    checked(field, raw, MAX_STRING_LEN)
}

/// Checks a node id: as [`id`], with the spec's 192-byte limit for node ids.
pub fn node_id(field: &'static str, raw: &str) -> Result<String> {
    checked(field, raw, MAX_NODE_ID_LEN)
}

/// `raw` as an id of at most `max` bytes, or INVALID_ARGUMENT on `field`.
fn checked(field: &'static str, raw: &str, max: usize) -> Result<String> {
    match limits::id_problem(raw, max) {
        Some(reason) => Err(Error::invalid(field, reason)),
        None => Ok(raw.to_string()),
    }
}

/// Checks an optional id: empty means unset.
fn optional_id(field: &'static str, raw: &str) -> Result<Option<String>> {
    if raw.is_empty() {
        Ok(None)
    } else {
        id(field, raw).map(Some)
    }
}

/// Checks a CO-chosen name: set, at most 128 bytes, none of the characters the spec bans
/// (U+0000-U+0008, U+000B, U+000C, U+000E-U+001F, U+007F-U+009F).
pub fn name(field: &'static str, name: &str) -> Result<String> {
    if name.is_empty() {
        return Err(Error::invalid(field, "must be set"));
    }
    if name.len() > MAX_STRING_LEN {
        return Err(Error::invalid(
            field,
            format!("longer than {MAX_STRING_LEN} bytes"),
        ));
    }
    let banned = |c: char| matches!(c, '\u{0}'..='\u{8}' | '\u{b}' | '\u{c}' | '\u{e}'..='\u{1f}' | '\u{7f}'..='\u{9f}');
    if name.chars().any(banned) {
        return Err(Error::invalid(
            field,
            "contains a control character the spec bans",
        ));
    }
    Ok(name.to_string())
}

/// Checks a map's total size and copies it into a sorted map.
pub fn map(field: &'static str, map: &HashMap<String, String>) -> Result<Parameters> {
    map_size(field, map)?;
    Ok(map.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
}

/// Checks the size of a map whose contents are not used (secrets): never quoted.
fn map_size(field: &'static str, map: &HashMap<String, String>) -> Result<()> {
    match limits::map_problem(map) {
        Some(reason) => Err(Error::invalid(field, reason)),
        None => Ok(()),
    }
}

/// Checks a volume capability's shape: access type and a known access mode are set.
pub fn capability(field: &'static str, cap: Option<&csi::VolumeCapability>) -> Result<Capability> {
    let cap = cap.ok_or_else(|| Error::invalid(field, "must be set"))?;
    let mode_raw = cap
        .access_mode
        .as_ref()
        .ok_or_else(|| Error::invalid(field, "access_mode must be set"))?
        .mode;
    let mode = match Mode::try_from(mode_raw) {
        Ok(Mode::SingleNodeWriter) => AccessMode::SingleNodeWriter,
        Ok(Mode::SingleNodeReaderOnly) => AccessMode::SingleNodeReaderOnly,
        Ok(Mode::MultiNodeReaderOnly) => AccessMode::MultiNodeReaderOnly,
        Ok(Mode::MultiNodeSingleWriter) => AccessMode::MultiNodeSingleWriter,
        Ok(Mode::MultiNodeMultiWriter) => AccessMode::MultiNodeMultiWriter,
        Ok(Mode::SingleNodeSingleWriter) => AccessMode::SingleNodeSingleWriter,
        Ok(Mode::SingleNodeMultiWriter) => AccessMode::SingleNodeMultiWriter,
        Ok(Mode::Unknown) | Err(_) => {
            return Err(Error::invalid(
                field,
                format!("access_mode.mode {mode_raw} is not a known access mode"),
            ));
        }
    };
    let access = match &cap.access_type {
        None => return Err(Error::invalid(field, "access_type must be set")),
        Some(CsiAccessType::Block(_)) => AccessType::Block,
        Some(CsiAccessType::Mount(m)) => {
            if m.fs_type.len() > MAX_STRING_LEN || m.fs_type.chars().any(char::is_control) {
                return Err(Error::invalid(field, "mount.fs_type is malformed"));
            }
            let flag_bytes: usize = m.mount_flags.iter().map(String::len).sum();
            if flag_bytes > MAX_MAP_BYTES {
                return Err(Error::invalid(
                    field,
                    format!("mount.mount_flags are larger than {MAX_MAP_BYTES} bytes"),
                ));
            }
            AccessType::Mount {
                fs_type: (!m.fs_type.is_empty()).then(|| m.fs_type.clone()),
            }
        }
    };
    Ok(Capability { access, mode })
}

/// Checks a non-empty list of capabilities.
pub fn capabilities(
    field: &'static str,
    caps: &[csi::VolumeCapability],
) -> Result<Vec<Capability>> {
    if caps.is_empty() {
        return Err(Error::invalid(field, "must hold at least one capability"));
    }
    if caps.len() > MAX_CAPABILITIES {
        return Err(Error::invalid(
            field,
            format!("more than {MAX_CAPABILITIES} capabilities"),
        ));
    }
    caps.iter().map(|c| capability(field, Some(c))).collect()
}

/// Checks a capacity range: no negative bound, at least one bound set.
pub fn capacity_range(
    field: &'static str,
    range: Option<&csi::CapacityRange>,
) -> Result<Option<CapacityRange>> {
    let Some(r) = range else {
        return Ok(None);
    };
    let required = u64::try_from(r.required_bytes)
        .map_err(|_| Error::invalid(field, "required_bytes must not be negative"))?;
    let limit = u64::try_from(r.limit_bytes)
        .map_err(|_| Error::invalid(field, "limit_bytes must not be negative"))?;
    if required == 0 && limit == 0 {
        return Err(Error::invalid(
            field,
            "at least one of required_bytes and limit_bytes must be set",
        ));
    }
    Ok(Some(CapacityRange { required, limit }))
}

/// Checks a topology segment: at least one domain, each key and value set.
pub fn segment(field: &'static str, t: &csi::Topology) -> Result<Segment> {
    if t.segments.is_empty() {
        return Err(Error::invalid(field, "a topology must have segments"));
    }
    if t.segments.iter().any(|(k, v)| k.is_empty() || v.is_empty()) {
        return Err(Error::invalid(
            field,
            "topology keys and values must not be empty",
        ));
    }
    map(field, &t.segments)
}

/// Checks `accessibility_requirements`.
pub fn topology_requirement(
    req: Option<&csi::TopologyRequirement>,
) -> Result<Option<TopologyRequirement>> {
    const FIELD: &str = "accessibility_requirements";
    let Some(req) = req else {
        return Ok(None);
    };
    if req.requisite.is_empty() && req.preferred.is_empty() {
        return Err(Error::invalid(
            FIELD,
            "requisite or preferred (or both) must be set",
        ));
    }
    // No limit on the number of topologies: the spec sets none, and a CO may send one per
    // node. The gRPC message size bounds the list, and the checks below are O(n log n).
    let requisite = req
        .requisite
        .iter()
        .map(|t| segment("accessibility_requirements.requisite", t))
        .collect::<Result<Vec<_>>>()?;
    let preferred = req
        .preferred
        .iter()
        .map(|t| segment("accessibility_requirements.preferred", t))
        .collect::<Result<Vec<_>>>()?;
    let requisite_set: BTreeSet<&Segment> = requisite.iter().collect();
    if !requisite.is_empty() && preferred.iter().any(|p| !requisite_set.contains(p)) {
        return Err(Error::invalid(
            "accessibility_requirements.preferred",
            "every preferred topology must also be requisite",
        ));
    }
    Ok(Some(TopologyRequirement {
        requisite,
        preferred,
    }))
}

/// Checks `volume_content_source`.
pub fn content_source(src: Option<&csi::VolumeContentSource>) -> Result<Option<ContentSource>> {
    use csi::volume_content_source::Type;
    let Some(src) = src else {
        return Ok(None);
    };
    match &src.r#type {
        None => Err(Error::invalid(
            "volume_content_source",
            "snapshot or volume must be set",
        )),
        Some(Type::Snapshot(s)) => Ok(Some(ContentSource::Snapshot(id(
            "volume_content_source.snapshot.snapshot_id",
            &s.snapshot_id,
        )?))),
        Some(Type::Volume(v)) => Ok(Some(ContentSource::Volume(id(
            "volume_content_source.volume.volume_id",
            &v.volume_id,
        )?))),
    }
}

/// Checks pagination arguments. The token's meaning is the backend's to judge (ABORTED when it
/// cannot use it), but an oversized one is refused here, as ABORTED too.
pub fn page(max_entries: i32, starting_token: &str) -> Result<PageRequest> {
    let max_entries = usize::try_from(max_entries)
        .map_err(|_| Error::invalid("max_entries", "must not be negative"))?;
    if starting_token.len() > MAX_STRING_LEN {
        return Err(Error::InvalidToken {
            token: trunc(starting_token).to_string(),
            reason: "too long".into(),
        });
    }
    Ok(PageRequest {
        max_entries,
        starting_token: (!starting_token.is_empty()).then(|| starting_token.to_string()),
    })
}

/// Validates CreateVolume (parameters are checked for size only; the backend parses them).
pub fn create_volume(req: &csi::CreateVolumeRequest) -> Result<NewVolume> {
    let name = name("name", &req.name)?;
    let capacity = capacity_range("capacity_range", req.capacity_range.as_ref())?;
    let capabilities = capabilities("volume_capabilities", &req.volume_capabilities)?;
    let parameters = map("parameters", &req.parameters)?;
    map_size("secrets", &req.secrets)?;
    let source = content_source(req.volume_content_source.as_ref())?;
    let accessibility = topology_requirement(req.accessibility_requirements.as_ref())?;
    Ok(NewVolume {
        name,
        capacity,
        capabilities,
        parameters,
        source,
        accessibility,
    })
}

/// The StorageClass parameters of both backends: fixed at creation, never mutable.
const CREATION_KEYS: [&str; 12] = [
    crate::embedded::PROVISIONING_KEY,
    crate::embedded::FS_TYPE_KEY,
    crate::rbd::parameters::BACKEND_KEY,
    crate::rbd::parameters::CLUSTER_ID_KEY,
    crate::rbd::parameters::MONITORS_KEY,
    crate::rbd::parameters::POOL_KEY,
    crate::rbd::parameters::IMAGE_FEATURES_KEY,
    crate::rbd::parameters::DATA_POOL_KEY,
    crate::rbd::parameters::EXCLUSIVE_LOCK_KEY,
    crate::rbd::parameters::IMAGE_FORMAT_KEY,
    crate::rbd::parameters::IMAGE_NAME_KEY,
    crate::embedded::K8S_FS_TYPE_KEY,
];

/// The mutable parameters of CreateVolume or ControllerModifyVolume as QoS limits; a key
/// that is not one of [`QOS_KEYS`] is INVALID_ARGUMENT naming it (saying so when it is a
/// creation parameter, which cannot change), as is a value that is not a whole number.
pub fn mutable_parameters(field: &'static str, raw: &HashMap<String, String>) -> Result<Qos> {
    let raw = map(field, raw)?;
    let mut qos = Qos::default();
    for (key, value) in &raw {
        let Ok(n) = value.parse::<u64>() else {
            if QOS_KEYS.contains(&key.as_str()) {
                return Err(Error::invalid(
                    field,
                    format!("{}: {:?} is not a whole number", trunc(key), trunc(value)),
                ));
            }
            return Err(not_mutable(field, key));
        };
        if !qos.set(key, n) {
            return Err(not_mutable(field, key));
        }
    }
    Ok(qos)
}

fn not_mutable(field: &'static str, key: &str) -> Error {
    let why = if CREATION_KEYS.contains(&key) {
        "a parameter of the volume's StorageClass, which cannot change after creation"
    } else {
        "not a mutable parameter of moor's"
    };
    Error::invalid(
        field,
        format!(
            "{}: {why} (the mutable ones: {})",
            trunc(key),
            QOS_KEYS.join(", ")
        ),
    )
}

/// Validates ControllerModifyVolume: the volume id and its new QoS limits.
pub fn modify_volume(req: &csi::ControllerModifyVolumeRequest) -> Result<(String, Qos)> {
    let volume_id = id("volume_id", &req.volume_id)?;
    map_size("secrets", &req.secrets)?;
    Ok((
        volume_id,
        mutable_parameters("mutable_parameters", &req.mutable_parameters)?,
    ))
}

/// Validates DeleteVolume; returns the volume id.
pub fn delete_volume(req: &csi::DeleteVolumeRequest) -> Result<String> {
    map_size("secrets", &req.secrets)?;
    id("volume_id", &req.volume_id)
}

/// Validates ControllerPublishVolume.
pub fn publish(req: &csi::ControllerPublishVolumeRequest) -> Result<PublishRequest> {
    let volume_id = id("volume_id", &req.volume_id)?;
    let node_id = node_id("node_id", &req.node_id)?;
    let capability = capability("volume_capability", req.volume_capability.as_ref())?;
    map_size("secrets", &req.secrets)?;
    let context = map("volume_context", &req.volume_context)?;
    Ok(PublishRequest {
        volume_id,
        node_id,
        capability,
        readonly: req.readonly,
        context,
    })
}

/// Validates ControllerUnpublishVolume; returns the volume id and the node id (None: all).
pub fn unpublish(req: &csi::ControllerUnpublishVolumeRequest) -> Result<(String, Option<String>)> {
    map_size("secrets", &req.secrets)?;
    Ok((
        id("volume_id", &req.volume_id)?,
        if req.node_id.is_empty() {
            None
        } else {
            Some(node_id("node_id", &req.node_id)?)
        },
    ))
}

/// ValidateVolumeCapabilities, validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ValidateRequest {
    /// The volume.
    pub volume_id: String,
    /// Capabilities to check.
    pub capabilities: Vec<Capability>,
    /// Volume context the CO holds.
    pub context: Parameters,
    /// Parameters the CO holds (unparsed).
    pub parameters: Parameters,
    /// Whether mutable parameters were given (moor has none).
    pub has_mutable_parameters: bool,
}

/// Validates ValidateVolumeCapabilities.
pub fn validate_capabilities(
    req: &csi::ValidateVolumeCapabilitiesRequest,
) -> Result<ValidateRequest> {
    let volume_id = id("volume_id", &req.volume_id)?;
    let capabilities = capabilities("volume_capabilities", &req.volume_capabilities)?;
    map_size("secrets", &req.secrets)?;
    Ok(ValidateRequest {
        volume_id,
        capabilities,
        context: map("volume_context", &req.volume_context)?,
        parameters: map("parameters", &req.parameters)?,
        has_mutable_parameters: !req.mutable_parameters.is_empty(),
    })
}

/// GetCapacity, validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CapacityRequest {
    /// Capabilities new volumes must have.
    pub capabilities: Vec<Capability>,
    /// Parameters (unparsed).
    pub parameters: Parameters,
    /// Where new volumes must be accessible from.
    pub topology: Option<Segment>,
}

/// Validates GetCapacity.
pub fn get_capacity(req: &csi::GetCapacityRequest) -> Result<CapacityRequest> {
    if req.volume_capabilities.len() > MAX_CAPABILITIES {
        return Err(Error::invalid(
            "volume_capabilities",
            format!("more than {MAX_CAPABILITIES} capabilities"),
        ));
    }
    let capabilities = req
        .volume_capabilities
        .iter()
        .map(|c| capability("volume_capabilities", Some(c)))
        .collect::<Result<Vec<_>>>()?;
    let topology = req
        .accessible_topology
        .as_ref()
        .map(|t| segment("accessible_topology", t))
        .transpose()?;
    Ok(CapacityRequest {
        capabilities,
        parameters: map("parameters", &req.parameters)?,
        topology,
    })
}

/// Validates ControllerExpandVolume.
pub fn expand(req: &csi::ControllerExpandVolumeRequest) -> Result<ExpandRequest> {
    let volume_id = id("volume_id", &req.volume_id)?;
    let capacity = capacity_range("capacity_range", req.capacity_range.as_ref())?
        .ok_or_else(|| Error::invalid("capacity_range", "must be set"))?;
    map_size("secrets", &req.secrets)?;
    let capability = req
        .volume_capability
        .as_ref()
        .map(|c| capability("volume_capability", Some(c)))
        .transpose()?;
    Ok(ExpandRequest {
        volume_id,
        capacity,
        capability,
    })
}

/// Validates ControllerGetVolume; returns the volume id.
pub fn get_volume(req: &csi::ControllerGetVolumeRequest) -> Result<String> {
    id("volume_id", &req.volume_id)
}

/// Validates CreateSnapshot.
pub fn create_snapshot(req: &csi::CreateSnapshotRequest) -> Result<NewSnapshot> {
    let source_volume_id = id("source_volume_id", &req.source_volume_id)?;
    let name = name("name", &req.name)?;
    map_size("secrets", &req.secrets)?;
    Ok(NewSnapshot {
        name,
        source_volume_id,
        parameters: map("parameters", &req.parameters)?,
    })
}

/// Validates DeleteSnapshot; returns the snapshot id.
pub fn delete_snapshot(req: &csi::DeleteSnapshotRequest) -> Result<String> {
    map_size("secrets", &req.secrets)?;
    id("snapshot_id", &req.snapshot_id)
}

/// Validates GetSnapshot; returns the snapshot id.
pub fn get_snapshot(req: &csi::GetSnapshotRequest) -> Result<String> {
    map_size("secrets", &req.secrets)?;
    id("snapshot_id", &req.snapshot_id)
}

/// Validates ListSnapshots.
pub fn list_snapshots(req: &csi::ListSnapshotsRequest) -> Result<(SnapshotFilter, PageRequest)> {
    map_size("secrets", &req.secrets)?;
    let filter = SnapshotFilter {
        source_volume_id: optional_id("source_volume_id", &req.source_volume_id)?,
        snapshot_id: optional_id("snapshot_id", &req.snapshot_id)?,
    };
    Ok((filter, page(req.max_entries, &req.starting_token)?))
}

/// Most volumes in one group snapshot.
pub const MAX_GROUP_MEMBERS: usize = 64;

/// Checks a list of ids (each as [`id`]) of at most `max` entries, without repeats.
fn id_list(field: &'static str, raw: &[String], max: usize) -> Result<Vec<String>> {
    if raw.len() > max {
        return Err(Error::invalid(field, format!("more than {max} ids")));
    }
    let mut seen = BTreeSet::new();
    let mut out = Vec::with_capacity(raw.len());
    for r in raw {
        let id = id(field, r)?;
        if !seen.insert(id.clone()) {
            return Err(Error::invalid(
                field,
                format!("{:?} is named twice", trunc(&id)),
            ));
        }
        out.push(id);
    }
    Ok(out)
}

/// Validates CreateVolumeGroupSnapshot.
pub fn create_group_snapshot(
    req: &csi::CreateVolumeGroupSnapshotRequest,
) -> Result<NewGroupSnapshot> {
    let name = name("name", &req.name)?;
    map_size("secrets", &req.secrets)?;
    let source_volume_ids = id_list(
        "source_volume_ids",
        &req.source_volume_ids,
        MAX_GROUP_MEMBERS,
    )?;
    if source_volume_ids.is_empty() {
        return Err(Error::invalid(
            "source_volume_ids",
            "must name at least one volume",
        ));
    }
    Ok(NewGroupSnapshot {
        name,
        source_volume_ids,
        parameters: map("parameters", &req.parameters)?,
    })
}

/// Validates GetVolumeGroupSnapshot.
pub fn get_group_snapshot(req: &csi::GetVolumeGroupSnapshotRequest) -> Result<GroupSnapshotRef> {
    map_size("secrets", &req.secrets)?;
    Ok(GroupSnapshotRef {
        id: id("group_snapshot_id", &req.group_snapshot_id)?,
        snapshot_ids: id_list("snapshot_ids", &req.snapshot_ids, MAX_GROUP_MEMBERS)?,
    })
}

/// Validates DeleteVolumeGroupSnapshot.
pub fn delete_group_snapshot(
    req: &csi::DeleteVolumeGroupSnapshotRequest,
) -> Result<GroupSnapshotRef> {
    map_size("secrets", &req.secrets)?;
    Ok(GroupSnapshotRef {
        id: id("group_snapshot_id", &req.group_snapshot_id)?,
        snapshot_ids: id_list("snapshot_ids", &req.snapshot_ids, MAX_GROUP_MEMBERS)?,
    })
}

/// A snapshot metadata request, validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetadataRequest {
    /// The base snapshot (GetMetadataDelta only).
    pub base_snapshot_id: Option<String>,
    /// The snapshot whose blocks are asked for (the target of a delta).
    pub snapshot_id: String,
    /// No tuple may end at or before it.
    pub starting_offset: u64,
    /// Most tuples in one message (0: the plugin's choice).
    pub max_results: usize,
}

fn starting_offset(raw: i64) -> Result<u64> {
    u64::try_from(raw).map_err(|_| Error::OffsetOutOfRange(format!("{raw} is negative")))
}

fn max_results(raw: i32) -> Result<usize> {
    usize::try_from(raw).map_err(|_| Error::invalid("max_results", "must not be negative"))
}

/// Validates GetMetadataAllocated.
pub fn metadata_allocated(req: &csi::GetMetadataAllocatedRequest) -> Result<MetadataRequest> {
    map_size("secrets", &req.secrets)?;
    Ok(MetadataRequest {
        base_snapshot_id: None,
        snapshot_id: id("snapshot_id", &req.snapshot_id)?,
        starting_offset: starting_offset(req.starting_offset)?,
        max_results: max_results(req.max_results)?,
    })
}

/// Validates GetMetadataDelta.
pub fn metadata_delta(req: &csi::GetMetadataDeltaRequest) -> Result<MetadataRequest> {
    map_size("secrets", &req.secrets)?;
    let base = id("base_snapshot_id", &req.base_snapshot_id)?;
    let target = id("target_snapshot_id", &req.target_snapshot_id)?;
    Ok(MetadataRequest {
        base_snapshot_id: Some(base),
        snapshot_id: target,
        starting_offset: starting_offset(req.starting_offset)?,
        max_results: max_results(req.max_results)?,
    })
}

/// Validates ListVolumes.
pub fn list_volumes(req: &csi::ListVolumesRequest) -> Result<PageRequest> {
    page(req.max_entries, &req.starting_token)
}

#[cfg(test)]
mod tests {
    use super::*;
    use csi::volume_capability::{AccessMode as CsiMode, BlockVolume, MountVolume};

    fn field_of(e: Error) -> &'static str {
        match e {
            Error::InvalidArgument { field, .. } => field,
            e => panic!("not INVALID_ARGUMENT: {e}"),
        }
    }

    fn mount_cap(mode: Mode) -> csi::VolumeCapability {
        csi::VolumeCapability {
            access_mode: Some(CsiMode { mode: mode as i32 }),
            access_type: Some(CsiAccessType::Mount(MountVolume::default())),
        }
    }

    #[test]
    fn ids_and_names() {
        assert_eq!(field_of(id("volume_id", "").unwrap_err()), "volume_id");
        assert!(id("volume_id", &"x".repeat(129)).is_err());
        assert!(id("volume_id", "a\nb").is_err());
        assert!(id("volume_id", "some-id").is_ok());
        assert!(name("name", "pvc-1 with spaces\tand tab").is_ok());
        assert!(name("name", "bad\u{1}").is_err());
        assert!(name("name", "bad\u{85}").is_err());
        assert!(name("name", "").is_err());
        assert!(name("name", "ünïcødé").is_ok());
    }

    #[test]
    fn node_ids_may_be_192_bytes() {
        assert!(node_id("node_id", &"n".repeat(192)).is_ok());
        assert_eq!(
            field_of(node_id("node_id", &"n".repeat(193)).unwrap_err()),
            "node_id"
        );
        assert!(node_id("node_id", &format!("{}\n", "n".repeat(150))).is_err());
        assert!(node_id("node_id", "").is_err());
        let req = csi::ControllerUnpublishVolumeRequest {
            volume_id: "v".into(),
            node_id: "n".repeat(193),
            secrets: HashMap::new(),
        };
        assert_eq!(field_of(unpublish(&req).unwrap_err()), "node_id");
    }

    #[test]
    fn capability_shapes() {
        assert_eq!(
            field_of(capability("volume_capability", None).unwrap_err()),
            "volume_capability"
        );
        let mut c = mount_cap(Mode::SingleNodeWriter);
        assert!(capability("c", Some(&c)).is_ok());
        c.access_mode = Some(CsiMode { mode: 0 });
        assert!(capability("c", Some(&c)).is_err());
        c.access_mode = Some(CsiMode { mode: 99 });
        assert!(capability("c", Some(&c)).is_err());
        c.access_mode = None;
        assert!(capability("c", Some(&c)).is_err());
        let c = csi::VolumeCapability {
            access_mode: Some(CsiMode { mode: 1 }),
            access_type: None,
        };
        assert!(capability("c", Some(&c)).is_err());
        let c = csi::VolumeCapability {
            access_mode: Some(CsiMode { mode: 7 }),
            access_type: Some(CsiAccessType::Block(BlockVolume {})),
        };
        let cap = capability("c", Some(&c)).unwrap();
        assert!(cap.is_block());
        assert_eq!(cap.mode, AccessMode::SingleNodeMultiWriter);
        assert!(capabilities("volume_capabilities", &[]).is_err());
    }

    #[test]
    fn capacity_ranges() {
        let r = |required_bytes, limit_bytes| csi::CapacityRange {
            required_bytes,
            limit_bytes,
        };
        assert_eq!(capacity_range("c", None).unwrap(), None);
        assert!(capacity_range("c", Some(&r(-1, 0))).is_err());
        assert!(capacity_range("c", Some(&r(0, -1))).is_err());
        assert!(capacity_range("c", Some(&r(0, 0))).is_err());
        assert_eq!(
            capacity_range("c", Some(&r(5, 10))).unwrap(),
            Some(CapacityRange {
                required: 5,
                limit: 10
            })
        );
    }

    #[test]
    fn topology_requirements() {
        let t = |v: &str| csi::Topology {
            segments: HashMap::from([("k".to_string(), v.to_string())]),
        };
        assert!(topology_requirement(Some(&csi::TopologyRequirement::default())).is_err());
        let ok = csi::TopologyRequirement {
            requisite: vec![t("a"), t("b")],
            preferred: vec![t("b")],
        };
        assert!(topology_requirement(Some(&ok)).is_ok());
        let bad = csi::TopologyRequirement {
            requisite: vec![t("a")],
            preferred: vec![t("b")],
        };
        assert!(topology_requirement(Some(&bad)).is_err());
        let empty = csi::TopologyRequirement {
            requisite: vec![csi::Topology::default()],
            preferred: vec![],
        };
        assert!(topology_requirement(Some(&empty)).is_err());
    }

    #[test]
    fn topology_count_is_unlimited_but_each_map_is_not() {
        let many: Vec<_> = (0..100_000)
            .map(|i| csi::Topology {
                segments: HashMap::from([("k".to_string(), format!("n{i}"))]),
            })
            .collect();
        let req = csi::TopologyRequirement {
            preferred: many.iter().rev().cloned().collect(),
            requisite: many,
        };
        let checked = topology_requirement(Some(&req)).unwrap().unwrap();
        assert_eq!(checked.requisite.len(), 100_000);
        assert_eq!(checked.preferred.len(), 100_000);
        let big = csi::TopologyRequirement {
            requisite: vec![csi::Topology {
                segments: HashMap::from([("k".to_string(), "v".repeat(MAX_MAP_BYTES))]),
            }],
            preferred: vec![],
        };
        assert_eq!(
            field_of(topology_requirement(Some(&big)).unwrap_err()),
            "accessibility_requirements.requisite"
        );
    }

    #[test]
    fn pages() {
        assert!(page(-1, "").is_err());
        assert_eq!(page(0, "").unwrap(), PageRequest::default());
        assert!(matches!(
            page(1, &"t".repeat(200)),
            Err(Error::InvalidToken { .. })
        ));
    }

    #[test]
    fn create_volume_fields() {
        let mut req = csi::CreateVolumeRequest {
            name: "pvc-1".into(),
            volume_capabilities: vec![mount_cap(Mode::SingleNodeWriter)],
            ..Default::default()
        };
        assert!(create_volume(&req).is_ok());
        req.mutable_parameters.insert("a".into(), "b".into());
        assert_eq!(
            field_of(
                mutable_parameters("mutable_parameters", &req.mutable_parameters).unwrap_err()
            ),
            "mutable_parameters"
        );
        req.mutable_parameters.clear();
        req.volume_content_source = Some(csi::VolumeContentSource { r#type: None });
        assert_eq!(
            field_of(create_volume(&req).unwrap_err()),
            "volume_content_source"
        );
        req.volume_content_source = None;
        req.parameters
            .insert("k".into(), "v".repeat(MAX_MAP_BYTES + 1));
        assert_eq!(field_of(create_volume(&req).unwrap_err()), "parameters");
        req.parameters.clear();
        req.name.clear();
        assert_eq!(field_of(create_volume(&req).unwrap_err()), "name");
    }
}
