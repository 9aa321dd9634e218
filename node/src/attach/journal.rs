//! A volume's mapping, as the node journal keeps it (in the volume's record, beside its
//! stage and publications).
//!
//! Written before the map with [`Phase::InProgress`], confirmed [`Phase::Done`] with the
//! device after it; set back to `InProgress` before an unmap and dropped after it. A mapping
//! lasts no longer than the node's boot (a reboot drops every kernel mapping, every rbd-fuse
//! and every loop device), so its record only has to survive the death of the process, as a
//! mount's does (see docs/durability.md). The key is never recorded.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::ImageSpec;
use crate::journal::{Boot, Phase};

/// A volume's RBD mapping.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MappingRecord {
    /// The attacher that made it ("kernel", "ublk" or "fuse").
    pub attacher: String,
    /// The cluster, as the controller names it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cluster_id: Option<String>,
    /// The pool.
    pub pool: String,
    /// The image.
    pub image: String,
    /// Whether it is mapped read-only.
    pub read_only: bool,
    /// The device, once mapped (ublk's `/dev/ublkbN` names the device a new server takes
    /// over after an upgrade: its number stays across recoveries).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<PathBuf>,
    /// Its number, once mapped.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rdev: Option<(u32, u32)>,
    /// `InProgress` while a map or an unmap runs (the device may or may not be there);
    /// `Done` once mapped.
    pub phase: Phase,
    /// The monitors it was mapped through, as the publish context named them (the volume's
    /// condition asks them whether the cluster answers).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub monitors: Option<String>,
    /// The boot it was written in ([`crate::journal::Boot`]): a mapping never outlives it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub boot: Option<String>,
}

impl MappingRecord {
    /// The image it maps.
    pub fn spec(&self) -> ImageSpec {
        ImageSpec {
            cluster_id: self.cluster_id.clone(),
            pool: self.pool.clone(),
            image: self.image.clone(),
        }
    }

    /// An intent to map `image` with `attacher`, in boot `boot`.
    pub fn intent(attacher: &str, image: &ImageSpec, read_only: bool, boot: &Boot) -> Self {
        Self {
            attacher: attacher.to_string(),
            cluster_id: image.cluster_id.clone(),
            pool: image.pool.clone(),
            image: image.image.clone(),
            read_only,
            device: None,
            rdev: None,
            phase: Phase::InProgress,
            monitors: None,
            boot: boot.stamp(),
        }
    }
}
