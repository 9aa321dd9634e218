//! What the journal remembers from before a reboot.
//!
//! A record of a mount or a mapping is written to outlive the process, not a power cut
//! (docs/durability.md): the mounts themselves end with the boot. So after a power cut the
//! journal may hold an older state than kubelet was told: a publication whose unpublish was
//! answered OK, a staging whose unstage was. Every such record carries the boot it was written
//! in ([`Boot`]); after a reboot, a record of a staging path or a target that is not mounted
//! now is a memory, not a claim. Nothing is held by a memory: it does not make a second target
//! of a single-writer volume a conflict, does not count toward `--max-volumes`, is not a
//! volume NodeGetVolumeStats or NodeExpandVolume reports on, and does not keep another
//! volume's call off its path. A memory of a staging is kept (it knows the filesystem moor made
//! and the image the volume maps, for kubelet's next NodeStageVolume of the volume, which
//! replaces it); a memory of a publication is forgotten, with a log line, since kubelet's
//! NodePublishVolume needs no record. Within one boot (a process crash) a record is a claim
//! whatever is mounted: a pod's container may still hold a mount moor no longer sees.

use std::path::{Path, PathBuf};

use super::Engine;
use crate::journal::{AccessRecord, Boot, PublishRecord, StageRecord, VolumeRecord};
use crate::sys::{MountState, Os};

/// Staged volumes and publications.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct VolumeCounts {
    /// Volumes with a staging record that holds something (not a memory of an earlier boot).
    pub staged: u64,
    /// Publication records that hold something, over all volumes.
    pub published: u64,
}

impl<O: Os> Engine<O> {
    /// The boot the node is in.
    pub(crate) fn boot(&self) -> &Boot {
        &self.cfg.boot
    }

    /// Whether nothing is mounted at `path` now (a path that cannot be looked at may be).
    fn unmounted(&self, path: &Path) -> bool {
        matches!(
            self.os.mount_state(path),
            Ok(MountState::Absent | MountState::NotMounted { .. })
        )
    }

    /// Whether a stage record is a memory: written in an earlier boot, and nothing mounted at
    /// its staging path (a block volume's stage mounts nothing: always, after a reboot).
    pub(crate) fn stage_is_memory(&self, s: &StageRecord) -> bool {
        self.boot().is_earlier(s.boot.as_deref())
            && (matches!(s.access, AccessRecord::Block) || self.unmounted(&s.path))
    }

    /// Whether the publication at `target` is a memory: written in an earlier boot, and
    /// nothing mounted at the target.
    pub(crate) fn publish_is_memory(&self, target: &Path, p: &PublishRecord) -> bool {
        self.boot().is_earlier(p.boot.as_deref()) && self.unmounted(target)
    }

    /// The record's claims: the record without its memories (not written).
    pub(crate) fn claims(&self, mut record: VolumeRecord) -> VolumeRecord {
        if record
            .stage
            .as_ref()
            .is_some_and(|s| self.stage_is_memory(s))
        {
            record.stage = None;
        }
        record
            .publishes
            .retain(|t, p| !self.publish_is_memory(t, p));
        record
    }

    /// How many volumes are staged, as `--max-volumes` counts them: memories are not.
    pub(crate) fn staged_claims(&self) -> u64 {
        self.journal
            .all()
            .iter()
            .filter(|r| r.stage.as_ref().is_some_and(|s| !self.stage_is_memory(s)))
            .count() as u64
    }

    /// The volumes staged and the publications, without the memories, for the node's gauges.
    pub fn volume_counts(&self) -> VolumeCounts {
        let mut c = VolumeCounts::default();
        for r in self.journal.all().into_iter().map(|r| self.claims(r)) {
            c.staged += u64::from(r.stage.is_some());
            c.published += r.publishes.len() as u64;
        }
        c
    }

    /// Drops the record's publications that are memories (in `record`, not written); the
    /// targets dropped.
    pub(crate) fn forget_publications(&self, record: &mut VolumeRecord) -> Vec<PathBuf> {
        let gone: Vec<PathBuf> = record
            .publishes
            .iter()
            .filter(|(t, p)| self.publish_is_memory(t, p))
            .map(|(t, _)| t.clone())
            .collect();
        for target in &gone {
            record.publishes.remove(target);
        }
        gone
    }
}
