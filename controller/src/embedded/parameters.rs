//! The embedded backend's creation parameters, and the capabilities it serves.

use moor_runtime::contract::Filesystem;

use super::{FS_TYPE_KEY, K8S_FS_TYPE_KEY, K8S_PREFIX};

/// Parameter (and volume context key) choosing how a volume holds its space: `thin` (the
/// default: a sparse file, space taken as it is written) or `thick` (all of it reserved when
/// the volume is made and when it grows). See [`super::space`].
pub const PROVISIONING_KEY: &str = "provisioning";
/// [`PROVISIONING_KEY`]'s value for a thick volume.
pub const THICK: &str = "thick";
/// [`PROVISIONING_KEY`]'s value for a thin volume (the default, so never kept).
pub const THIN: &str = "thin";

/// Whether volumes made with `params` (normalised) are thick.
pub fn is_thick(params: &Parameters) -> bool {
    params.get(PROVISIONING_KEY).is_some_and(|v| v == THICK)
}
use crate::backend::{self, Capability, Parameters};
use crate::error::{Error, Result, trunc};

/// Parses the embedded backend's creation parameters: `fsType` (or the standard
/// `csi.storage.k8s.io/fstype`) naming a filesystem the node can make, and `provisioning`
/// (`thin`, the default, or `thick`); keys with the prefix `csi.storage.k8s.io/` are the CO's
/// and ignored; anything else is INVALID_ARGUMENT. `provisioning: thin` is dropped, so that a
/// class that says it names the same volumes as one that does not.
pub fn parse_parameters(raw: &Parameters) -> Result<Parameters> {
    let mut fs_type: Option<&str> = None;
    let mut thick = false;
    for (key, value) in raw {
        if key == PROVISIONING_KEY {
            match value.as_str() {
                THICK => thick = true,
                THIN => {}
                other => {
                    return Err(Error::invalid(
                        "parameters",
                        format!(
                            "{PROVISIONING_KEY}={:?}: either {THIN:?} (the default) or {THICK:?}",
                            trunc(other)
                        ),
                    ));
                }
            }
            continue;
        }
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
                    "unknown key {:?}: moor takes only {FS_TYPE_KEY} and {PROVISIONING_KEY} \
                     (and ignores {K8S_PREFIX}*)",
                    trunc(key)
                ),
            ));
        }
    }
    let mut out = Parameters::new();
    if let Some(f) = fs_type {
        out.insert(FS_TYPE_KEY.to_string(), f.to_string());
    }
    if thick {
        out.insert(PROVISIONING_KEY.to_string(), THICK.to_string());
    }
    Ok(out)
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
