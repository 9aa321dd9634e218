//! The CSI requests the privileged tests and the benches send most: built from a volume id
//! and the paths, the way kubelet fills them in.

use std::collections::HashMap;
use std::path::Path;

use csi::volume_capability::access_mode::Mode;
use moor_proto::csi::v1 as csi;
use moor_runtime::contract::DEVICE_PATH_KEY;

/// A mount volume capability for `fs`, single-node multi-writer.
pub fn cap(fs: &str) -> csi::VolumeCapability {
    crate::fs_cap(fs, Mode::SingleNodeMultiWriter)
}

/// NodeStageVolume of `dev` as `fs` on `staging`.
pub fn stage_req(vol: &str, dev: &Path, staging: &Path, fs: &str) -> csi::NodeStageVolumeRequest {
    csi::NodeStageVolumeRequest {
        volume_id: vol.into(),
        publish_context: HashMap::from([(DEVICE_PATH_KEY.into(), dev.display().to_string())]),
        staging_target_path: staging.display().to_string(),
        volume_capability: Some(cap(fs)),
        secrets: HashMap::new(),
        volume_context: HashMap::new(),
    }
}

/// NodePublishVolume of an ext4 volume staged on `staging` to `target`, read-write.
pub fn publish_req(vol: &str, staging: &Path, target: &Path) -> csi::NodePublishVolumeRequest {
    csi::NodePublishVolumeRequest {
        volume_id: vol.into(),
        publish_context: HashMap::new(),
        staging_target_path: staging.display().to_string(),
        target_path: target.display().to_string(),
        volume_capability: Some(cap("ext4")),
        readonly: false,
        secrets: HashMap::new(),
        volume_context: HashMap::new(),
    }
}

/// NodeUnpublishVolume of `target`.
pub fn unpublish_req(vol: &str, target: &Path) -> csi::NodeUnpublishVolumeRequest {
    csi::NodeUnpublishVolumeRequest {
        volume_id: vol.into(),
        target_path: target.display().to_string(),
    }
}

/// NodeUnstageVolume of `staging`.
pub fn unstage_req(vol: &str, staging: &Path) -> csi::NodeUnstageVolumeRequest {
    csi::NodeUnstageVolumeRequest {
        volume_id: vol.into(),
        staging_target_path: staging.display().to_string(),
    }
}

/// A single-node-writer block volume capability, as the key rotation tests attach with.
pub fn block_cap() -> csi::VolumeCapability {
    csi::VolumeCapability {
        access_mode: Some(csi::volume_capability::AccessMode {
            mode: Mode::SingleNodeWriter as i32,
        }),
        access_type: Some(csi::volume_capability::AccessType::Block(
            csi::volume_capability::BlockVolume {},
        )),
    }
}

/// CreateVolume of `name`, `bytes` large, a [`block_cap`] volume encrypted with the key source
/// `kms` and the `more` parameters, `secrets` its provisioner secret.
pub fn encrypted_create_req(
    name: &str,
    bytes: i64,
    kms: &str,
    more: &[(&str, &str)],
    secrets: &HashMap<String, String>,
) -> csi::CreateVolumeRequest {
    csi::CreateVolumeRequest {
        name: name.to_owned(),
        capacity_range: Some(csi::CapacityRange {
            required_bytes: bytes,
            limit_bytes: 0,
        }),
        volume_capabilities: vec![block_cap()],
        parameters: [("encrypted", "true"), ("kmsID", kms)]
            .iter()
            .chain(more)
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect(),
        secrets: secrets.clone(),
        ..Default::default()
    }
}
