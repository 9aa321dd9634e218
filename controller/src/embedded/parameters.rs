//! The embedded backend's creation parameters, and the capabilities it serves.

use moor_runtime::contract::Filesystem;

use super::{FS_TYPE_KEY, K8S_FS_TYPE_KEY, K8S_PREFIX};
use crate::backend::{self, Capability, Parameters};
use crate::error::{Error, Result, trunc};

/// Parses the embedded backend's creation parameters: `fsType` (or the standard
/// `csi.storage.k8s.io/fstype`) naming a filesystem the node can make; keys with the prefix
/// `csi.storage.k8s.io/` are the CO's and ignored; anything else is INVALID_ARGUMENT.
pub fn parse_parameters(raw: &Parameters) -> Result<Parameters> {
    let mut fs_type: Option<&str> = None;
    for (key, value) in raw {
        let is_fs = key == FS_TYPE_KEY || key.eq_ignore_ascii_case(K8S_FS_TYPE_KEY);
        if is_fs {
            if value.is_empty() {
                continue;
            }
            if Filesystem::from_name(value).is_none() {
                return Err(Error::invalid(
                    "parameters",
                    format!(
                        "{key}={:?}: not a filesystem moor makes (ext2, ext3, ext4, xfs, btrfs)",
                        trunc(value)
                    ),
                ));
            }
            if fs_type.is_some_and(|f| f != value) {
                return Err(Error::invalid(
                    "parameters",
                    format!("{FS_TYPE_KEY} and {K8S_FS_TYPE_KEY} disagree"),
                ));
            }
            fs_type = Some(value);
        } else if key.starts_with(K8S_PREFIX) {
            continue;
        } else {
            return Err(Error::invalid(
                "parameters",
                format!(
                    "unknown key {:?}: moor takes only {FS_TYPE_KEY} (and ignores {K8S_PREFIX}*)",
                    trunc(key)
                ),
            ));
        }
    }
    Ok(fs_type
        .map(|f| Parameters::from([(FS_TYPE_KEY.to_string(), f.to_string())]))
        .unwrap_or_default())
}

/// Whether the embedded backend can serve `cap` for a volume with `params`.
pub fn check_capability(cap: &Capability, params: &Parameters) -> Result<(), String> {
    if !cap.mode.is_single_node() {
        return Err(format!(
            "access mode {} is not supported: a moor volume is attached to one node",
            cap.mode.name()
        ));
    }
    if let backend::AccessType::Mount {
        fs_type: Some(fs), ..
    } = &cap.access
    {
        if Filesystem::from_name(fs).is_none() {
            return Err(format!(
                "filesystem {:?} is not supported (ext2, ext3, ext4, xfs, btrfs)",
                trunc(fs)
            ));
        }
        if let Some(want) = params.get(FS_TYPE_KEY)
            && want != fs
        {
            return Err(format!(
                "the volume is meant for {want}, the capability asks for {fs}"
            ));
        }
    }
    Ok(())
}
