//! What the node and the controller both speak, defined once: the filesystems a volume may
//! hold, the `publish_context` keys the controller hands to the node (an RBD image's among
//! them, with the secrets keys of its user), and the plugin capabilities both daemons
//! announce.

use moor_proto::csi::v1 as csi;

/// A filesystem that the node plugin can recognise, create and mount.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Filesystem {
    /// The second extended filesystem (no journal).
    Ext2,
    /// ext2 with a journal.
    Ext3,
    /// The fourth extended filesystem (extents, 64-bit, checksums, ...).
    Ext4,
    /// SGI's XFS.
    Xfs,
    /// The B-tree filesystem.
    Btrfs,
}

impl Filesystem {
    /// Every filesystem, in a fixed order.
    pub const ALL: [Filesystem; 5] = [
        Filesystem::Ext2,
        Filesystem::Ext3,
        Filesystem::Ext4,
        Filesystem::Xfs,
        Filesystem::Btrfs,
    ];

    /// The kernel's (and mkfs's) name for this filesystem: "ext2", "ext3", "ext4", "xfs" or
    /// "btrfs".
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Filesystem::Ext2 => "ext2",
            Filesystem::Ext3 => "ext3",
            Filesystem::Ext4 => "ext4",
            Filesystem::Xfs => "xfs",
            Filesystem::Btrfs => "btrfs",
        }
    }

    /// The filesystem whose [`name`](Self::name) is exactly `s` (lower case), if any.
    #[must_use]
    pub fn from_name(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|fs| fs.name() == s)
    }
}

/// Defines a publish_context key, and the name an error gives that field of a request.
macro_rules! publish_context_key {
    ($(#[$doc:meta])* $key:ident, $field:ident = $name:literal) => {
        $(#[$doc])*
        pub const $key: &str = $name;
        #[doc = concat!("How an error names the [`", stringify!($key), "`] field of a request.")]
        pub const $field: &str = concat!("publish_context.", $name);
    };
}

publish_context_key!(
    /// publish_context key: the block device the controller attached, e.g. `/dev/loop7`. Only a
    /// hint to the node, taken when the device there is the volume's.
    DEVICE_PATH_KEY, DEVICE_PATH_FIELD = "devicePath"
);
publish_context_key!(
    /// publish_context key: the absolute path of the file behind a loop device (the embedded
    /// backend's identity of the volume): the node refuses a device backed by anything else.
    BACKING_FILE_KEY, BACKING_FILE_FIELD = "backingFile"
);
publish_context_key!(
    /// publish_context key: the disk's serial number (udev `ID_SERIAL` or `ID_SERIAL_SHORT`,
    /// sysfs `serial`): a cloud backend's identity of the volume.
    DEVICE_SERIAL_KEY, DEVICE_SERIAL_FIELD = "deviceSerial"
);
publish_context_key!(
    /// publish_context key: the disk's World Wide Name (udev `ID_WWN`, sysfs `wwid`;
    /// `0x`/`naa.`/`eui.` prefixes and case do not matter).
    DEVICE_WWN_KEY, DEVICE_WWN_FIELD = "deviceWWN"
);
publish_context_key!(
    /// publish_context key: the Ceph pool of an RBD volume's image. Its presence makes a volume
    /// an RBD one: the node maps the image itself, and the keys above are not needed.
    RBD_POOL_KEY, RBD_POOL_FIELD = "rbdPool"
);
publish_context_key!(
    /// publish_context key: the RBD image's name in its pool.
    RBD_IMAGE_KEY, RBD_IMAGE_FIELD = "rbdImage"
);
publish_context_key!(
    /// publish_context key: the Ceph monitors' addresses, comma-separated (`host[:port]`,
    /// `[ipv6][:port]`).
    RBD_MONITORS_KEY, RBD_MONITORS_FIELD = "rbdMonitors"
);
publish_context_key!(
    /// publish_context key (optional): the controller's name for the Ceph cluster; with the
    /// pool and image, the identity of the node's mapping.
    RBD_CLUSTER_ID_KEY, RBD_CLUSTER_ID_FIELD = "rbdClusterID"
);

publish_context_key!(
    /// publish_context key: "true" when the node must map the RBD image read-only (a
    /// MULTI_NODE_READER_ONLY publication).
    RBD_READ_ONLY_KEY, RBD_READ_ONLY_FIELD = "rbdReadOnly"
);

publish_context_key!(
    /// publish_context key: "true" when the node must map the RBD image with the exclusive
    /// lock held (the StorageClass's `exclusiveLock`): no other client, on any node, may take
    /// the lock and write while it is mapped; the image grows only while it is not mapped.
    RBD_EXCLUSIVE_KEY, RBD_EXCLUSIVE_FIELD = "rbdExclusiveLock"
);

/// StorageClass parameter and volume_context key: `"true"` for a volume that is LUKS2 on the
/// node (docs/encryption.md). A node that does not open encrypted volumes refuses to stage one,
/// so that no volume meant to be encrypted is ever formatted or written in the clear.
pub const ENCRYPTED_KEY: &str = "encrypted";
/// How an error names the [`ENCRYPTED_KEY`] field of a NodeStageVolume.
pub const ENCRYPTED_FIELD: &str = "volume_context.encrypted";

/// The mutable parameters moor knows (a VolumeAttributesClass's QoS limits), in the order of
/// [`QosLimits`]' fields: bytes read, bytes written, reads, writes per second.
pub const QOS_KEYS: [&str; 4] = [
    "readBytesPerSecond",
    "writeBytesPerSecond",
    "readIOPS",
    "writeIOPS",
];

/// publish_context and volume_context key: a volume's QoS limits for the node to apply to the
/// pod's cgroup, as `readIOPS=100,writeBytesPerSecond=1048576` (empty: no limit). The
/// controller puts the limits of the moment in a ControllerPublishVolume's publish_context
/// (which wins) and those given at creation in the volume_context (for a driver without
/// attach).
pub const QOS_LIMITS_KEY: &str = "qosLimits";
/// How an error names the [`QOS_LIMITS_KEY`] field of a NodePublishVolume.
pub const QOS_LIMITS_FIELD: &str = "publish_context.qosLimits";

/// QoS limits per second, each none when unset, as [`QOS_LIMITS_KEY`] carries them.
pub type QosLimits = [Option<u64>; 4];

/// The text of [`QOS_LIMITS_KEY`] for `limits`.
#[must_use]
pub fn qos_to_context(limits: &QosLimits) -> String {
    QOS_KEYS
        .iter()
        .zip(limits)
        .filter_map(|(k, v)| v.map(|n| format!("{k}={n}")))
        .collect::<Vec<_>>()
        .join(",")
}

/// The limits a [`QOS_LIMITS_KEY`] text gives, or what is wrong with it.
pub fn qos_from_context(text: &str) -> Result<QosLimits, String> {
    let mut limits: QosLimits = [None; 4];
    for item in text.split(',').filter(|i| !i.is_empty()) {
        let (key, value) = item
            .split_once('=')
            .ok_or_else(|| format!("{item:?} is not key=value"))?;
        let slot = QOS_KEYS
            .iter()
            .position(|k| *k == key)
            .and_then(|i| limits.get_mut(i))
            .ok_or_else(|| {
                format!(
                    "{key:?} is not a QoS limit (known: {})",
                    QOS_KEYS.join(", ")
                )
            })?;
        *slot = Some(
            value
                .parse()
                .map_err(|_| format!("{key}: {value:?} is not a whole number"))?,
        );
    }
    Ok(limits)
}

/// volume_context key of an encrypted volume: its data key wrapped by the key-encryption key
/// (`v1:<kek id>:<base64>`, `moor_runtime::keys::WrappedDek`), not secret. Written by the
/// controller once, before CreateVolume first answers, from the volume's record.
pub const ENCRYPTED_DEK_KEY: &str = "encryptedDEK";
/// How an error names the [`ENCRYPTED_DEK_KEY`] field of a NodeStageVolume.
pub const ENCRYPTED_DEK_FIELD: &str = "volume_context.encryptedDEK";
/// How an error names the [`ENCRYPTED_DEK_KEY`] field of a NodeStageVolume's publish_context,
/// where the controller puts the key its record holds now (it changes at a rotation; the
/// volume context's cannot).
pub const PUBLISHED_DEK_FIELD: &str = "publish_context.encryptedDEK";
/// publish_context key of an encrypted volume during a data key rotation: the new data key,
/// wrapped, that the controller's record holds as pending until the node has proven it on the
/// volume's key slot (docs/encryption.md, "Rotation"). A stage tries the current key, then this.
pub const ENCRYPTED_DEK_PENDING_KEY: &str = "encryptedDEKPending";
/// How an error names the [`ENCRYPTED_DEK_PENDING_KEY`] field of a NodeStageVolume.
pub const ENCRYPTED_DEK_PENDING_FIELD: &str = "publish_context.encryptedDEKPending";
/// StorageClass parameter of an encrypted volume: how often its data key is rotated, by the
/// node where it is staged (`moor-node --key-rotation-secrets`; docs/encryption.md,
/// "Scheduled rotation"): `@hourly`, `@daily`, `@weekly`, `@monthly` (30 days) or a period
/// `<n>s`, `<n>m`, `<n>h`, `<n>d` ([`crate::keys::schedule::period`]). Absent: never by
/// schedule.
pub const KEY_ROTATION_SCHEDULE_KEY: &str = "keyRotationSchedule";
/// StorageClass parameter and volume_context key: the key source of an encrypted volume's
/// key-encryption key (`secret`: the CSI secrets of the call).
pub const KMS_ID_KEY: &str = "kmsID";
/// StorageClass parameter and volume_context key: the LUKS cipher.
pub const LUKS_CIPHER_KEY: &str = "luksCipher";
/// StorageClass parameter and volume_context key: the LUKS key size in bits.
pub const LUKS_KEY_SIZE_KEY: &str = "luksKeySize";
/// StorageClass parameter and volume_context key: the LUKS sector size in bytes.
pub const LUKS_SECTOR_SIZE_KEY: &str = "luksSectorSize";
/// StorageClass parameter and volume_context key: the PBKDF of the LUKS key slot.
pub const LUKS_PBKDF_KEY: &str = "luksPBKDF";
/// StorageClass parameter and volume_context key of a `tpm2` volume: the PCRs the node's TPM
/// key is sealed to (`sha256:7`; `moor_runtime::keys::tpm2::pcr_selection`).
pub const TPM2_PCRS_KEY: &str = "tpm2PCRs";

/// The secrets key naming the Ceph user (without `client.`), as ceph-csi names it.
pub const RBD_USER_ID_SECRET: &str = "userID";
/// The secrets key giving that user's cephx key.
pub const RBD_USER_KEY_SECRET: &str = "userKey";

/// The plugin capabilities: the same from the node and the controller, as the spec has every
/// instance of a version answer, whichever services it serves. The controller service,
/// volumes that live on one node (accessibility constraints), volume group snapshots (the
/// group controller service), and volumes that grow while in use. (moor-controller adds
/// SNAPSHOT_METADATA_SERVICE when told to: see its `--snapshot-metadata`.)
pub fn plugin_capabilities() -> Vec<csi::PluginCapability> {
    use csi::plugin_capability::{Service, Type, VolumeExpansion, service, volume_expansion};
    let service = |t: service::Type| csi::PluginCapability {
        r#type: Some(Type::Service(Service { r#type: t as i32 })),
    };
    vec![
        service(service::Type::ControllerService),
        service(service::Type::VolumeAccessibilityConstraints),
        service(service::Type::GroupControllerService),
        csi::PluginCapability {
            r#type: Some(Type::VolumeExpansion(VolumeExpansion {
                r#type: volume_expansion::Type::Online as i32,
            })),
        },
    ]
}

/// The topology key of a driver's per-node segment, `topology.<driver>/node`: NodeGetInfo
/// names the node by it, and a volume that lives on one node is accessible from that segment.
#[must_use]
pub fn node_topology_key(driver: &str) -> String {
    format!("topology.{driver}/node")
}

/// The Node service capabilities moor-node announces: staged volumes, their stats and
/// condition, growth on the node, SINGLE_NODE_MULTI_WRITER and the pod's fsGroup on mount. A
/// node-local moor-controller repeats them to the sidecars that ask its socket (csi-resizer
/// looks for EXPAND_VOLUME there). CSI 1.13's health capabilities are not among them
/// ([`node_health_capabilities`]): a client built against an older spec may refuse a value it
/// does not know (csi-sanity v5 fails the node; csi-resizer v1.13's request logging panics on
/// it and the container crash-loops), and their numbers are moor's reading of 1.13.
#[must_use]
pub fn node_capabilities() -> Vec<csi::NodeServiceCapability> {
    rpc_capabilities(&[
        csi::node_service_capability::rpc::Type::StageUnstageVolume,
        csi::node_service_capability::rpc::Type::GetVolumeStats,
        csi::node_service_capability::rpc::Type::ExpandVolume,
        csi::node_service_capability::rpc::Type::VolumeCondition,
        csi::node_service_capability::rpc::Type::SingleNodeMultiWriter,
        csi::node_service_capability::rpc::Type::VolumeMountGroup,
    ])
}

/// CSI 1.13's GET_VOLUME_HEALTH and GET_STORAGE_HEALTH, which moor-node announces beside
/// [`node_capabilities`] only when asked to (`--health-capabilities`: a CO of CSI 1.13). The
/// calls themselves are served either way.
#[must_use]
pub fn node_health_capabilities() -> Vec<csi::NodeServiceCapability> {
    rpc_capabilities(&[
        csi::node_service_capability::rpc::Type::GetVolumeHealth,
        csi::node_service_capability::rpc::Type::GetStorageHealth,
    ])
}

fn rpc_capabilities(
    types: &[csi::node_service_capability::rpc::Type],
) -> Vec<csi::NodeServiceCapability> {
    use csi::node_service_capability::{Rpc, Type};
    types
        .iter()
        .map(|t| csi::NodeServiceCapability {
            r#type: Some(Type::Rpc(Rpc { r#type: *t as i32 })),
        })
        .collect()
}

/// The codes of a ControllerExpandVolume or NodeExpandVolume error that kubelet and
/// csi-resizer take as infeasible (RecoverVolumeExpansionFailure): they stop retrying until
/// the user changes the claim's size, and may ask for less. Every other code is retried, so
/// both daemons give these only for what no retry can change: the request itself, a limit
/// below the volume, a volume that is not there.
pub const INFEASIBLE_EXPANSION: [tonic::Code; 3] = [
    tonic::Code::InvalidArgument,
    tonic::Code::OutOfRange,
    tonic::Code::NotFound,
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qos_limits_go_through_the_context_and_back() {
        let limits = [Some(1_048_576), None, None, Some(100)];
        let text = qos_to_context(&limits);
        assert_eq!(text, "readBytesPerSecond=1048576,writeIOPS=100");
        assert_eq!(qos_from_context(&text), Ok(limits));
        assert_eq!(qos_from_context(""), Ok([None; 4]));
        assert!(qos_from_context("readIOPS").is_err());
        assert!(qos_from_context("readIOPS=ten").is_err());
        assert!(qos_from_context("fsType=ext4").is_err());
    }
}
