//! What the engine's operations take: the Node RPCs' requests, checked. `validate` makes them
//! from the CSI messages (and refuses what is not valid); the engine trusts them as they are.

use std::path::PathBuf;

use csi::volume_capability::access_mode::Mode;
use moor_proto::csi::v1 as csi;
use moor_runtime::contract::{Filesystem, QosLimits};

use crate::mount_options::MountOptions;
use crate::sys::MountAttrs;
use crate::sys::discovery::DeviceIdentity;

/// How the volume is accessed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Access {
    /// A filesystem mount.
    Mount {
        /// The filesystem.
        fs: Filesystem,
        /// Parsed mount flags.
        options: MountOptions,
        /// volume_mount_group as a gid.
        group: Option<u32>,
    },
    /// A raw block device.
    Block {
        /// Per-mount flags for the device node bind mount.
        attrs: MountAttrs,
    },
}

impl Access {
    /// Whether this is a block volume.
    pub fn is_block(&self) -> bool {
        matches!(self, Access::Block { .. })
    }

    /// Per-mount attributes asked for.
    pub fn attrs(&self) -> MountAttrs {
        match self {
            Access::Mount { options, .. } => options.attrs,
            Access::Block { attrs } => *attrs,
        }
    }
}

/// A volume capability.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Capability {
    /// Access type.
    pub access: Access,
    /// Access mode (the CSI enum value).
    pub mode: Mode,
}

impl Capability {
    /// Whether the mode only allows reading.
    pub fn is_reader_only(&self) -> bool {
        matches!(
            self.mode,
            Mode::SingleNodeReaderOnly | Mode::MultiNodeReaderOnly
        )
    }
}

/// How an encrypted volume is opened (docs/encryption.md): its data key, unwrapped, and the
/// LUKS parameters of its first luksFormat, each checked to be a plain word (they reach a
/// command line as arguments of their own).
#[derive(Debug, Clone)]
pub struct Encryption {
    /// The data key: the passphrase of the LUKS key slot. Shared by the request's clones,
    /// zeroed when the last goes; its `Debug` shows no byte.
    pub key: std::sync::Arc<moor_runtime::keys::Dek>,
    /// The data key as the volume context gives it, wrapped (not secret): the journal keeps
    /// it for NodeExpandVolume, which has no volume context.
    pub wrapped: moor_runtime::keys::WrappedDek,
    /// The other wrapped data keys the stage was given, tried in order when no key slot takes
    /// `key` (docs/encryption.md, "Rotation"): the pending key of a rotation the controller's
    /// record holds, the volume context's key once the record's has changed.
    pub others: Vec<moor_runtime::keys::WrappedDek>,
    /// The id of the key-encryption key that unwrapped it (for errors: it is not secret).
    pub kek_id: String,
    /// That key-encryption key's source, for the keys the journal holds wrapped of a data key
    /// rotation cut short (`engine::rotate`): its `Debug` shows no key.
    pub kek: std::sync::Arc<moor_runtime::keys::source::KeySource>,
    /// `--cipher`.
    pub cipher: String,
    /// `--key-size`, in bits.
    pub key_size: u32,
    /// `--sector-size`, in bytes.
    pub sector_size: u32,
    /// `--pbkdf`.
    pub pbkdf: String,
    /// The key source the volume context names (`kmsID`): the journal keeps it for
    /// NodeExpandVolume.
    pub kms_id: String,
    /// The PCRs a `tpm2` volume's node half is sealed to (`tpm2PCRs`): the journal keeps them
    /// for NodeExpandVolume.
    pub tpm2_pcrs: Option<String>,
    /// A `tpm2` volume's node half, which `key` was combined with: the stage's other keys
    /// (a rotation's) are combined with it too. None for another source.
    pub node_half: Option<std::sync::Arc<moor_runtime::keys::tpm2::NodeHalf>>,
}

/// An encrypted volume's key at NodeExpandVolume (`cryptsetup resize` needs it): got as its
/// stage gets it, from the wrapped data key the journal keeps, by the key source the journal
/// names (`validate::expand_key`).
#[derive(Debug, Clone)]
pub struct ExpandKey {
    /// The passphrase of the LUKS key slot (for `tpm2`, combined with this node's TPM);
    /// zeroed when the last clone goes, its `Debug` shows no byte.
    pub key: std::sync::Arc<moor_runtime::keys::Dek>,
    /// The wrapped data key it was got from, as the journal held it (not secret): the engine
    /// uses the key only while the journal still names it.
    pub wrapped: String,
    /// The id of the key-encryption key that unwrapped it (for errors).
    pub kek_id: String,
}

/// A rotation of an encrypted volume's data key (docs/encryption.md, "Rotation"), on the
/// node where the volume is staged: its LUKS slot moves from the old key to the new, both
/// given wrapped by one key-encryption key.
#[derive(Debug, Clone)]
pub struct RotateDek {
    /// Volume id.
    pub volume_id: String,
    /// The key-encryption key's source that unwraps both keys (a Secret's KEK or a KMIP
    /// server; its `Debug` shows no key).
    pub kek: std::sync::Arc<moor_runtime::keys::source::KeySource>,
    /// The volume's data key now, wrapped: what the controller's record holds.
    pub old_wrapped: moor_runtime::keys::WrappedDek,
    /// The data key replacing it, wrapped: written into the controller's record as the
    /// pending key before this request, so that the record holds it whatever a crash leaves.
    pub new_wrapped: moor_runtime::keys::WrappedDek,
    /// The new key slot's `--pbkdf` (the volume's `luksPBKDF`), a plain word.
    pub pbkdf: String,
    /// This node's TPM: a `tpm2` volume's passphrases are both keys combined with its node
    /// half, asked once per call.
    pub tpm: NodeTpm,
}

/// This node's TPM, shared by the calls that ask it (one conversation at a time); its
/// `Debug` names nothing.
#[derive(Clone)]
pub struct NodeTpm(pub std::sync::Arc<dyn moor_runtime::keys::tpm2::Tpm>);

impl NodeTpm {
    /// The TPM moor-node finds ([`moor_runtime::keys::tpm2::Tpm2Tools::from_env`]).
    #[must_use]
    pub fn from_env() -> Self {
        Self(std::sync::Arc::new(
            moor_runtime::keys::tpm2::Tpm2Tools::from_env(),
        ))
    }
}

impl std::fmt::Debug for NodeTpm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("NodeTpm")
    }
}

/// NodeStageVolume, checked.
#[derive(Debug, Clone)]
pub struct Stage {
    /// Volume id.
    pub volume_id: String,
    /// The device the controller attached, as a hint: used only if its identity matches.
    pub device: Option<PathBuf>,
    /// What the device must be (backing file, serial, WWN); empty when the controller names
    /// only a path.
    pub identity: DeviceIdentity,
    /// staging_target_path.
    pub staging: PathBuf,
    /// Capability.
    pub cap: Capability,
    /// How to open it, when it is encrypted.
    pub encryption: Option<Encryption>,
}

/// NodeUnstageVolume, checked.
#[derive(Debug, Clone)]
pub struct Unstage {
    /// Volume id.
    pub volume_id: String,
    /// staging_target_path.
    pub staging: PathBuf,
}

/// NodePublishVolume, checked.
#[derive(Debug, Clone)]
pub struct Publish {
    /// Volume id.
    pub volume_id: String,
    /// staging_target_path.
    pub staging: PathBuf,
    /// target_path.
    pub target: PathBuf,
    /// Capability.
    pub cap: Capability,
    /// readonly.
    pub readonly: bool,
    /// The pod it is published to, as kubelet names it (`csi.storage.k8s.io/pod.uid`); None:
    /// the pod of the target path, if any.
    pub pod_uid: Option<String>,
    /// The volume's QoS limits, for the pod's cgroup (`engine::qos`).
    pub limits: QosLimits,
}

/// NodeUnpublishVolume, checked.
#[derive(Debug, Clone)]
pub struct Unpublish {
    /// Volume id.
    pub volume_id: String,
    /// target_path.
    pub target: PathBuf,
}

/// NodeGetVolumeStats, checked.
#[derive(Debug, Clone)]
pub struct Stats {
    /// Volume id.
    pub volume_id: String,
    /// volume_path.
    pub path: PathBuf,
}

/// NodeExpandVolume, checked.
#[derive(Debug, Clone)]
pub struct Expand {
    /// Volume id.
    pub volume_id: String,
    /// volume_path.
    pub path: PathBuf,
    /// staging_target_path, if given.
    pub staging: Option<PathBuf>,
    /// An encrypted volume's key, got with the request's secrets (its node-expand secret):
    /// set by the service for a volume whose journal record has a mapping.
    pub key: Option<ExpandKey>,
    /// capacity_range.required_bytes (0: unset).
    pub required_bytes: u64,
    /// capacity_range.limit_bytes (0: unset).
    pub limit_bytes: u64,
    /// Capability, if given.
    pub cap: Option<Capability>,
}

/// NodeGetVolumeHealth, checked: the volume, and the paths the CO names (the staging path and
/// the target, each where the volume is or was to be), none when it names none.
#[derive(Debug, Clone)]
pub struct HealthQuery {
    /// Volume id.
    pub volume_id: String,
    /// staging_target_path and volume_publish_path, those given.
    pub paths: Vec<PathBuf>,
}
