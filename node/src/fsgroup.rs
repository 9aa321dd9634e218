//! The pod's fsGroup (CSI `volume_mount_group`), given to a volume the way kubelet would have
//! given it: see [`crate::sys::ownership`] for what changes and when nothing does.
//!
//! It is applied to the staging mount at NodeStageVolume, and again at NodePublishVolume (the
//! publish's group may be another pod's: as with kubelet, the last one given wins, and the
//! root check makes a publish with the stage's group cost one stat). A read-only mount is left
//! as it is, as kubelet leaves a read-only volume.

use std::path::Path;

use tracing::{info, warn};

use crate::engine::Engine;
use crate::error::Result;
use crate::sys::Os;

/// Gives the filesystem mounted at `path` (volume `volume_id`) to group `gid`, and logs what it
/// did. The walk has the tools' deadline (`--tool-timeout`, as mkfs).
pub fn apply<O: Os>(engine: &Engine<O>, volume_id: &str, path: &Path, gid: u32) -> Result<()> {
    let deadline = engine.config().mkfs_deadline;
    let report = engine.os().share_with_group(path, gid, deadline)?;
    if let Some(first) = &report.first_refusal {
        warn!(
            volume = volume_id,
            gid,
            refused = report.refused,
            first,
            "some entries of the volume could not be given to its group"
        );
    }
    if !report.skipped && report.changed > 0 {
        info!(
            volume = volume_id,
            gid,
            entries = report.entries,
            changed = report.changed,
            "volume given to its group"
        );
    }
    Ok(())
}
