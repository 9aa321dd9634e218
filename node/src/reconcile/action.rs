//! What a reconciliation pass found or did, and how each is logged.

use std::path::PathBuf;

use tracing::{info, warn};

/// What a pass found or did.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Action {
    /// An operation a crash cut short had made its mount: the record is confirmed.
    Confirmed {
        /// Volume id.
        volume: String,
        /// The path.
        path: PathBuf,
    },
    /// An operation a crash cut short had not changed the mount table: its record is dropped.
    RolledBack {
        /// Volume id.
        volume: String,
        /// The path.
        path: PathBuf,
    },
    /// A corrupted mount was detached.
    CleanedCorrupted {
        /// Volume id.
        volume: String,
        /// The path.
        path: PathBuf,
        /// What the kernel said.
        errno: i32,
    },
    /// The device of a volume is gone: its mounts were detached.
    DeviceGone {
        /// Volume id.
        volume: String,
        /// The device.
        device: PathBuf,
    },
    /// Mounts stacked over moor's own on a path were removed.
    Unstacked {
        /// Volume id.
        volume: String,
        /// The path.
        path: PathBuf,
        /// How many.
        removed: usize,
    },
    /// A path kubelet expects mounted is not: reported abnormal until kubelet acts.
    Missing {
        /// Volume id.
        volume: String,
        /// The path.
        path: PathBuf,
    },
    /// A record of a publication or a mapping from before the node rebooted, of which nothing
    /// is mounted or mapped now (a memory, which holds nothing): dropped.
    Forgotten {
        /// Volume id.
        volume: String,
        /// The target, or the image.
        path: PathBuf,
    },
    /// A staging from before the node rebooted, not mounted now: kept for kubelet's next
    /// NodeStageVolume of the volume (which replaces it), holding nothing meanwhile.
    Remembered {
        /// Volume id.
        volume: String,
        /// The staging path.
        path: PathBuf,
    },
    /// A mkfs was cut short: kubelet's retry of NodeStageVolume resumes it.
    FormatPending {
        /// Volume id.
        volume: String,
    },
    /// Something that is not moor's is mounted on a recorded path: left alone.
    Foreign {
        /// Volume id.
        volume: String,
        /// The path.
        path: PathBuf,
    },
    /// A mount of moor's that the journal did not know was recorded again.
    Adopted {
        /// Volume id.
        volume: String,
        /// The path.
        path: PathBuf,
    },
    /// The volume had a call in flight: left for the next pass.
    Busy {
        /// Volume id.
        volume: String,
    },
    /// An RBD image a crash left mapped with nothing staged on it, or that no record names,
    /// was unmapped.
    Unmapped {
        /// The volume whose record named it, if one did.
        volume: Option<String>,
        /// The image.
        image: String,
    },
    /// A volume's RBD mapping whose server had died (moor-node's upgrade took it) was taken
    /// over by a new server: the device, and what is mounted on it, stayed.
    Recovered {
        /// Volume id.
        volume: String,
        /// The image.
        image: String,
    },
    /// A volume's RBD mapping is gone (a reboot, an rbd-fuse that died): reported until
    /// kubelet stages the volume again, which maps it again.
    MappingLost {
        /// Volume id.
        volume: String,
        /// The image.
        image: String,
    },
    /// An RBD mapping no record names, which moor cannot prove its own (the kernel's
    /// mappings may be anyone's): left alone.
    ForeignMapping {
        /// The image.
        image: String,
    },
    /// An encrypted volume's dm-crypt mapping open with its stage gone (no staging recorded,
    /// or one a reboot ended, and no publication) and no mount or holder on it: closed, as
    /// the unstage would have, and its record dropped.
    CryptClosed {
        /// Volume id.
        volume: String,
        /// The mapping's name.
        mapping: String,
    },
    /// An encrypted volume's dm-crypt mapping open with its stage gone but something on it
    /// (a mount, a holder): left alone, reported.
    CryptInUse {
        /// Volume id.
        volume: String,
        /// The mapping's name.
        mapping: String,
    },
    /// A mount of moor's that kubelet no longer knows: the `vol_data.json` kubelet keeps
    /// beside it is gone (kubelet restarted or the node rebooted and lost it, as in
    /// kubernetes#121937), so kubelet may never unpublish or unstage it by itself. Reported,
    /// never unmounted: a running pod may still use it; kubelet's unpublish or unstage of the
    /// path (its orphan cleanup) ends it.
    KubeletForgot {
        /// Volume id.
        volume: String,
        /// The staging path or target.
        path: PathBuf,
    },
    /// A step failed; the next pass tries again.
    Failed {
        /// Volume id.
        volume: String,
        /// The path.
        path: PathBuf,
        /// Why.
        error: String,
    },
}

impl Action {
    /// A short name, for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            Action::Confirmed { .. } => "confirmed",
            Action::RolledBack { .. } => "rolled_back",
            Action::CleanedCorrupted { .. } => "cleaned_corrupted",
            Action::DeviceGone { .. } => "device_gone",
            Action::Unstacked { .. } => "unstacked",
            Action::Missing { .. } => "missing",
            Action::Forgotten { .. } => "forgotten",
            Action::Remembered { .. } => "remembered",
            Action::FormatPending { .. } => "format_pending",
            Action::Foreign { .. } => "foreign",
            Action::Adopted { .. } => "adopted",
            Action::Busy { .. } => "busy",
            Action::Unmapped { .. } => "unmapped",
            Action::Recovered { .. } => "recovered",
            Action::MappingLost { .. } => "mapping_lost",
            Action::ForeignMapping { .. } => "foreign_mapping",
            Action::CryptClosed { .. } => "crypt_closed",
            Action::CryptInUse { .. } => "crypt_in_use",
            Action::KubeletForgot { .. } => "kubelet_forgot",
            Action::Failed { .. } => "failed",
        }
    }

    /// Whether the action changed the journal or the mount table (as opposed to a finding).
    pub fn changed_something(&self) -> bool {
        matches!(
            self,
            Action::Confirmed { .. }
                | Action::RolledBack { .. }
                | Action::CleanedCorrupted { .. }
                | Action::DeviceGone { .. }
                | Action::Unstacked { .. }
                | Action::Adopted { .. }
                | Action::Unmapped { .. }
                | Action::CryptClosed { .. }
                | Action::Recovered { .. }
                | Action::Forgotten { .. }
        )
    }

    pub(super) fn log(&self) {
        match self {
            Action::Confirmed { volume, path } => {
                info!(volume, path = %path.display(), "reconcile: mount found after a cut-short call; record confirmed");
            }
            Action::RolledBack { volume, path } => {
                info!(volume, path = %path.display(), "reconcile: call cut short before it mounted; record rolled back");
            }
            Action::CleanedCorrupted {
                volume,
                path,
                errno,
            } => {
                warn!(volume, path = %path.display(), error = %std::io::Error::from_raw_os_error(*errno), "reconcile: corrupted mount detached; volume abnormal until kubelet acts");
            }
            Action::DeviceGone { volume, device } => {
                warn!(volume, device = %device.display(), "reconcile: device gone; its mounts detached; volume abnormal until kubelet acts");
            }
            Action::Unstacked {
                volume,
                path,
                removed,
            } => {
                warn!(volume, path = %path.display(), removed, "reconcile: removed mounts stacked on moor's");
            }
            Action::Missing { volume, path } => {
                warn!(volume, path = %path.display(), "reconcile: not mounted though recorded; volume abnormal until kubelet acts");
            }
            Action::Forgotten { volume, path } => {
                info!(volume, path = %path.display(), "reconcile: recorded before the node rebooted and not mounted or mapped since: forgotten (kubelet had ended it, or makes it again)");
            }
            Action::Remembered { volume, path } => {
                info!(volume, path = %path.display(), "reconcile: staged before the node rebooted and not mounted since: kept for kubelet's next stage of the volume, holding nothing meanwhile");
            }
            Action::FormatPending { volume } => {
                info!(
                    volume,
                    "reconcile: mkfs was cut short; kubelet's retry of NodeStageVolume resumes it"
                );
            }
            Action::Foreign { volume, path } => {
                warn!(volume, path = %path.display(), "reconcile: a mount that is not moor's covers this path; left alone");
            }
            Action::Adopted { volume, path } => {
                warn!(volume, path = %path.display(), "reconcile: moor's mount was missing from the journal; recorded again");
            }
            Action::Busy { volume } => {
                info!(volume, "reconcile: volume busy with a call; next pass");
            }
            Action::Unmapped { volume, image } => {
                info!(
                    volume = volume.as_deref().unwrap_or("-"),
                    image, "reconcile: RBD image mapped with nothing staged on it; unmapped"
                );
            }
            Action::Recovered { volume, image } => {
                warn!(
                    volume,
                    image,
                    "reconcile: the RBD mapping's server had died; a new one took its device over"
                );
            }
            Action::MappingLost { volume, image } => {
                warn!(
                    volume,
                    image,
                    "reconcile: the volume's RBD mapping is gone; the next stage maps it again"
                );
            }
            Action::ForeignMapping { image } => {
                info!(
                    image,
                    "reconcile: an RBD mapping no record names, not provably moor's; left alone"
                );
            }
            Action::CryptClosed { volume, mapping } => {
                info!(
                    volume,
                    mapping, "reconcile: dm-crypt mapping open with its stage gone; closed"
                );
            }
            Action::CryptInUse { volume, mapping } => {
                warn!(
                    volume,
                    mapping,
                    "reconcile: dm-crypt mapping open with its stage gone, but in use; left alone"
                );
            }
            Action::KubeletForgot { volume, path } => {
                warn!(volume, path = %path.display(), "reconcile: kubelet no longer knows this mount (the vol_data.json it keeps beside it is gone); left mounted, as a pod may use it: kubelet's unpublish or unstage of the path ends it");
            }
            Action::Failed {
                volume,
                path,
                error,
            } => {
                warn!(volume, path = %path.display(), error, "reconcile: step failed; next pass retries");
            }
        }
    }
}
