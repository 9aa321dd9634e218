//! CSI 1.13's node health calls: NodeGetVolumeHealth (a volume's conditions on this node,
//! also when its stage failed) and NodeGetStorageHealth (the node's own storage: the
//! filesystems behind its loop devices, the Ceph clusters its mappings use).

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};

use tracing::debug;

use super::stats::{Condition, Health};
use super::{Engine, FsckOutcome, HealthQuery, StageReport, Stats};
use crate::error::Error;
use crate::sys::discovery::DiscoveryError;
use crate::sys::{BackingFs, Os};

/// The kinds of trouble CSI 1.13's `StorageHealthErrorType` names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StorageTrouble {
    /// The backend cannot be reached from this node.
    Unreachable,
    /// It answers, but not as it should (full, read-only).
    Degraded,
}

/// One adverse condition of the storage this node uses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StorageCondition {
    /// Its kind.
    pub trouble: StorageTrouble,
    /// A short CamelCase name of it.
    pub reason: &'static str,
    /// What, for humans.
    pub message: String,
}

/// The last NodeStageVolume of each volume that failed and was not followed by a stage that
/// worked or an unstage: what NodeGetVolumeHealth says of a volume kubelet could not stage.
/// In memory only: a restart forgets it, and kubelet's next stage tells again.
#[derive(Debug, Default)]
pub(super) struct StageFailures(std::sync::Mutex<BTreeMap<String, Condition>>);

impl StageFailures {
    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Condition>> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// What a failed stage says of the volume's health, or None for a refusal of the request
/// itself (its arguments, the node's limit, another call under way), which says nothing of
/// the volume.
fn stage_failure(volume_id: &str, e: &Error, report: &StageReport) -> Option<Condition> {
    let message = format!("the last NodeStageVolume of {volume_id:?} failed: {e}");
    if matches!(report.fsck, Some((_, FsckOutcome::Refused))) {
        return Some(Condition::trouble(
            Health::DataLoss,
            "FilesystemCorrupt",
            message,
        ));
    }
    let (health, reason) = match e {
        Error::InvalidArgument { .. }
        | Error::MountOption(_)
        | Error::OperationPending(_)
        | Error::Incompatible { .. }
        | Error::TooManyVolumes(_) => return None,
        Error::DeviceNotBlank { .. } => (Health::Inaccessible, "UnknownContent"),
        Error::Discovery(DiscoveryError::NotPresent { .. } | DiscoveryError::Deadline { .. })
        | Error::VolumeNotFound { .. } => (Health::Inaccessible, "DeviceMissing"),
        Error::Attach(_) => (Health::Inaccessible, "AttachFailed"),
        _ => (Health::Inaccessible, "StageFailed"),
    };
    Some(Condition::trouble(health, reason, message))
}

impl<O: Os> Engine<O> {
    /// Keeps what a NodeStageVolume's outcome says of its volume's health: a failure until the
    /// next stage that works, or the unstage.
    pub(super) fn note_stage(
        &self,
        volume_id: &str,
        r: &crate::error::Result<()>,
        report: &StageReport,
    ) {
        let mut failures = self.stage_failures.lock();
        match r {
            Ok(()) => {
                failures.remove(volume_id);
            }
            Err(e) => {
                if let Some(c) = stage_failure(volume_id, e, report) {
                    failures.insert(volume_id.to_string(), c);
                }
            }
        }
    }

    /// Forgets a volume's failed stage (it was unstaged).
    pub(super) fn forget_stage_failure(&self, volume_id: &str) {
        self.stage_failures.lock().remove(volume_id);
    }

    /// NodeGetVolumeHealth: the volume's adverse conditions on this node, each once; none when
    /// none is known. At the paths the CO names, else at those the journal holds; a volume not
    /// staged whose last stage failed reports that failure. Reads only what NodeGetVolumeStats
    /// reads: never waits for a device.
    pub fn volume_health(&self, q: &HealthQuery) -> crate::error::Result<Vec<Condition>> {
        let record = self.journal.get(&q.volume_id).map(|r| self.claims(r));
        let staged = record.as_ref().is_some_and(|r| r.stage.is_some());
        let mut paths: Vec<PathBuf> = q.paths.clone();
        if paths.is_empty()
            && let Some(r) = &record
        {
            paths.extend(r.stage.iter().map(|s| s.path.clone()));
            paths.extend(r.publishes.keys().cloned());
        }
        let mut out: Vec<Condition> = Vec::new();
        let mut seen = HashSet::new();
        let mut add = |c: Condition, out: &mut Vec<Condition>| {
            if c.abnormal && seen.insert((c.health, c.reason)) {
                out.push(c);
            }
        };
        if !staged && let Some(c) = self.stage_failures.lock().get(&q.volume_id) {
            add(c.clone(), &mut out);
        }
        for path in paths {
            let req = Stats {
                volume_id: q.volume_id.clone(),
                path,
            };
            match self.local_stats(&req) {
                Ok((_, c)) => add(c, &mut out),
                // Not this volume's at that path (never staged or published there, or the
                // stage failed before it): its failure, if any, is said above.
                Err(Error::VolumeNotFound { .. }) => {}
                Err(e) => return Err(e),
            }
        }
        if let Some(why) = self.cluster_away(record.as_ref()) {
            add(
                Condition::trouble(Health::Inaccessible, "StorageUnreachable", why),
                &mut out,
            );
        }
        for c in self.qos_notes.of(&q.volume_id) {
            add(c, &mut out);
        }
        Ok(out)
    }

    /// NodeGetStorageHealth: the adverse conditions of the storage under this node's volumes,
    /// each once: the filesystem holding a staged loop device's backing file (failing,
    /// read-only, full), and each Ceph cluster a mapping uses that does not answer.
    pub fn storage_health(&self) -> Vec<StorageCondition> {
        let mut out = Vec::new();
        let mut seen = HashSet::new();
        let mut clusters = HashSet::new();
        for r in self.journal.all().into_iter().map(|r| self.claims(r)) {
            if let Some(s) = &r.stage {
                match self.os.backing_store(s.rdev) {
                    Ok(Some(b)) => {
                        if let Some(c) = backing_condition(&b.file, b.fs)
                            && seen.insert((c.reason, c.message.clone()))
                        {
                            out.push(c);
                        }
                    }
                    Ok(None) => {}
                    Err(e) => debug!(volume = r.volume_id, error = %e, "backing file unread"),
                }
            }
            if let Some(m) = &r.mapping
                && let Some(monitors) = m.monitors.clone()
                && clusters.insert(monitors.clone())
                && let Some(why) = self.cluster_away(Some(&r))
            {
                out.push(StorageCondition {
                    trouble: StorageTrouble::Unreachable,
                    reason: "CephClusterUnreachable",
                    message: format!("the Ceph cluster at {monitors} does not answer: {why}"),
                });
            }
        }
        out
    }
}

/// What the filesystem holding backing file `file` says, as a condition (None: healthy, or
/// not to be seen from here).
fn backing_condition(file: &Path, fs: Option<BackingFs>) -> Option<StorageCondition> {
    let dir = file.parent().unwrap_or(file).display();
    match fs? {
        BackingFs::Fails(errno) => Some(StorageCondition {
            trouble: StorageTrouble::Unreachable,
            reason: "BackingFilesystemFailing",
            message: format!(
                "the filesystem holding the loop devices' files in {dir} fails: {}",
                std::io::Error::from_raw_os_error(errno)
            ),
        }),
        BackingFs::Answers {
            read_only: true, ..
        } => Some(StorageCondition {
            trouble: StorageTrouble::Degraded,
            reason: "BackingFilesystemReadOnly",
            message: format!(
                "the filesystem holding the loop devices' files in {dir} is read-only: their \
                 volumes cannot be written"
            ),
        }),
        BackingFs::Answers {
            available_bytes: 0, ..
        } => Some(StorageCondition {
            trouble: StorageTrouble::Degraded,
            reason: "BackingFilesystemFull",
            message: format!(
                "the filesystem holding the loop devices' files in {dir} is full: writes to \
                 their volumes' unallocated blocks fail"
            ),
        }),
        BackingFs::Answers { .. } => None,
    }
}
