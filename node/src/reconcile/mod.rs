//! Reconciliation: the journal against the live mount table, at start and every
//! `--reconcile-interval`.
//!
//! A full pass (at start) reads the mount table once, then walks the journal's volumes, each under its
//! volume lock (a volume busy with a call is skipped until the next pass), and decides from a
//! fresh `statx` of each recorded path:
//!
//! * an operation a crash cut short is finished (the mount is there and is moor's: the record
//!   is confirmed) or rolled back (nothing was mounted: the record, and a target moor made, go);
//!   a mkfs cut short is left for kubelet's retry, which alone may format that device again;
//! * a corrupted mount (ENOTCONN, ESTALE, EIO, ...) and the mounts of a device that is gone
//!   are detached; their records stay, so NodeGetVolumeStats reports the volume abnormal
//!   until kubelet unpublishes, unstages or stages it again;
//! * a second mount stacked on one of moor's paths is removed; a mount that is not moor's is
//!   never touched, and a path kubelet expects mounted is never unmounted while healthy;
//! * a mount on one of moor's kubelet paths that the journal does not know (the journal was
//!   damaged) is adopted back into the journal, named by kubelet's `vol_data.json`;
//! * a mount of moor's whose `vol_data.json` kubelet lost is reported, never unmounted;
//! * an RBD map or unmap a crash cut short is finished or undone, and a mapping nothing is
//!   staged on, or that no record names, is unmapped (`engine::mapped`); a volume's mapping
//!   is reconciled after its mounts, so a stage they roll back no longer holds it.
//!
//! The periodic passes are light: a `statx` per recorded path, no table read, no adoption.
//! Each action is logged on one line; a finding that changes nothing is logged when first seen.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};

use tracing::{debug, info, warn};

use crate::engine::{ADOPTED_MODE, Engine};
use crate::error::Error;
use crate::journal::{AccessRecord, Durability, Phase, PublishRecord, StageRecord, VolumeRecord};
use crate::sys::mount_table::MountEntry;
use crate::sys::{MountAttrs, MountPoint, MountState, Os, Presence};

mod action;
pub use action::Action;

/// Runs reconciliation passes over an engine.
#[derive(Debug)]
pub struct Reconciler<O: Os> {
    engine: Arc<Engine<O>>,
    driver_name: String,
    /// Findings of the previous pass, logged again only when they change.
    seen: Mutex<HashSet<Action>>,
}

/// Mounts of one pass, by mount point.
type Index<'a> = HashMap<&'a Path, Vec<&'a MountEntry>>;

impl<O: Os> Reconciler<O> {
    /// A reconciler for `engine`, adopting kubelet paths of `driver_name`.
    pub fn new(engine: Arc<Engine<O>>, driver_name: &str) -> Self {
        Self {
            engine,
            driver_name: driver_name.to_string(),
            seen: Mutex::new(HashSet::new()),
        }
    }

    /// A full pass: reads the mount table once, so stacked mounts are found and mounts the
    /// journal lost are adopted; returns every action and finding, and logs the new ones.
    pub fn run(&self) -> Result<Vec<Action>, Error> {
        self.pass_with(true)
    }

    /// A light pass for the periodic timer: a `statx` per recorded path, no table read, so
    /// its cost follows the volumes moor has, not the mounts the node has.
    pub fn run_light(&self) -> Result<Vec<Action>, Error> {
        self.pass_with(false)
    }

    fn pass_with(&self, full: bool) -> Result<Vec<Action>, Error> {
        let table = if full {
            self.engine.os().mount_table()?
        } else {
            Vec::new()
        };
        let kubelet_dir = self.engine.config().kubelet_dir.clone();
        let mut index: Index<'_> = HashMap::new();
        for m in table
            .iter()
            .filter(|m| m.mount_point.starts_with(&kubelet_dir))
        {
            index.entry(m.mount_point.as_path()).or_default().push(m);
        }
        // The RBD mappings on the node, listed before the journal is read.
        let mappings = if full {
            self.engine.listed_mappings()
        } else {
            Vec::new()
        };
        let mut actions = Vec::new();
        let mut known: HashSet<PathBuf> = HashSet::new();
        let mut mapped = Vec::new();
        for record in self.engine.journal().all() {
            mapped.extend(record.mapping.as_ref().map(|m| m.spec()));
            if let Some(s) = &record.stage {
                known.insert(s.path.clone());
            }
            known.extend(record.publishes.keys().cloned());
            let Ok(_guard) = self.engine.locks().try_lock_background(&record.volume_id) else {
                actions.push(Action::Busy {
                    volume: record.volume_id.clone(),
                });
                continue;
            };
            // The record as it is now, under the lock.
            let Some(record) = self.engine.journal().get(&record.volume_id) else {
                continue;
            };
            let volume_id = record.volume_id.clone();
            self.volume(record, &index, &mut actions);
            if let Some(record) = self.engine.journal().get(&volume_id) {
                self.forgotten_by_kubelet(&record, &mut actions);
            }
            // The dm-crypt mapping after the mounts (a stage they rolled back no longer
            // holds it), before the RBD mapping it sits on.
            if full && let Some(record) = self.engine.journal().get(&volume_id) {
                self.engine.reconcile_crypt(&record, &table, &mut actions);
            }
            // The mapping after the mounts: a stage they rolled back no longer holds it.
            if let Some(mut record) = self.engine.journal().get(&volume_id) {
                self.engine
                    .reconcile_mapping(&mut record, full, &mut actions);
            }
        }
        if full {
            self.engine
                .reconcile_orphans(mappings, &mapped, &mut actions);
        }
        let mut orphans: Vec<&Path> = index
            .keys()
            .copied()
            .filter(|p| !known.contains(*p))
            .collect();
        orphans.sort();
        for path in orphans {
            self.adopt(path, &index, &mut actions);
        }
        self.log(&actions);
        Ok(actions)
    }

    fn log(&self, actions: &[Action]) {
        let mut seen = self.seen.lock().unwrap_or_else(PoisonError::into_inner);
        let now: HashSet<Action> = actions
            .iter()
            .filter(|a| !a.changed_something())
            .cloned()
            .collect();
        for a in actions {
            if a.changed_something() || !seen.contains(a) {
                a.log();
                crate::metrics::record_reconcile_action(a.kind());
            }
        }
        *seen = now;
    }

    fn put(&self, record: &VolumeRecord, actions: &mut Vec<Action>, path: &Path) {
        if let Err(e) = self.engine.journal().put(record, Durability::Process) {
            actions.push(Action::Failed {
                volume: record.volume_id.clone(),
                path: path.to_path_buf(),
                error: e.to_string(),
            });
        }
    }

    fn detach(&self, volume: &str, path: &Path, actions: &mut Vec<Action>) -> bool {
        match self.engine.os().unmount(path, true) {
            Ok(()) => true,
            Err(e) => {
                actions.push(Action::Failed {
                    volume: volume.to_string(),
                    path: path.to_path_buf(),
                    error: e.to_string(),
                });
                false
            }
        }
    }

    /// Removes mounts stacked over the bottom one of moor's on `path`, top first, while
    /// the top is moor's.
    fn unstack(
        &self,
        volume: &str,
        path: &Path,
        index: &Index<'_>,
        is_ours: impl Fn(&MountPoint) -> bool,
        actions: &mut Vec<Action>,
    ) {
        let depth = index.get(path).map_or(0, Vec::len);
        let mut removed = 0;
        for _ in 1..depth {
            match self.engine.os().mount_state(path) {
                Ok(MountState::Mounted(mp)) if is_ours(&mp) => {
                    if let Err(e) = self.engine.os().unmount(path, false) {
                        actions.push(Action::Failed {
                            volume: volume.to_string(),
                            path: path.to_path_buf(),
                            error: e.to_string(),
                        });
                        break;
                    }
                    removed += 1;
                }
                _ => break,
            }
        }
        if removed > 0 {
            actions.push(Action::Unstacked {
                volume: volume.to_string(),
                path: path.to_path_buf(),
                removed,
            });
        }
    }

    fn volume(&self, mut record: VolumeRecord, index: &Index<'_>, actions: &mut Vec<Action>) {
        let os = self.engine.os();
        let volume = record.volume_id.clone();
        // Publications a reboot ended: memories, forgotten (kubelet's publish needs no record).
        let forgotten = self.engine.forget_publications(&mut record);
        if let Some(first) = forgotten.first() {
            self.put(&record, actions, first);
            actions.extend(forgotten.into_iter().map(|path| Action::Forgotten {
                volume: volume.clone(),
                path,
            }));
        }
        let Some(mut stage) = record.stage.clone() else {
            return;
        };
        if stage.phase == Phase::Formatting {
            actions.push(Action::FormatPending { volume });
            return;
        }
        // A staging a reboot ended: kept for kubelet's next stage, and nothing to check (its
        // device's number, and what is not mounted, are the earlier boot's).
        let memory = self.engine.stage_is_memory(&stage);
        if memory {
            actions.push(Action::Remembered {
                volume: volume.clone(),
                path: stage.path.clone(),
            });
        }
        let block = matches!(stage.access, AccessRecord::Block);
        let source_matches = |path: &Path| {
            index
                .get(path)
                .and_then(|s| s.last())
                .is_some_and(|m| Path::new(&m.source) == stage.device)
        };
        let stage_dev = stage.rdev;
        let stage_is_ours = |mp: &MountPoint| mp.dev == stage_dev || source_matches(&stage.path);

        // The device: gone means every mount of the volume is dead weight.
        if !memory
            && stage.phase == Phase::Done
            && let Presence::Gone(why) = self.engine.presence(&stage)
        {
            debug!(volume, device = %stage.device.display(), why, "reconcile: device gone");
            let mut targets: Vec<PathBuf> = record.publishes.keys().cloned().collect();
            if !block {
                targets.push(stage.path.clone());
            }
            let mut detached = false;
            for t in &targets {
                if matches!(
                    os.mount_state(t),
                    Ok(MountState::Mounted(_) | MountState::Corrupted { .. })
                ) {
                    detached |= self.detach(&volume, t, actions);
                }
            }
            let finding = Action::DeviceGone {
                volume: volume.clone(),
                device: stage.device.clone(),
            };
            if detached {
                actions.push(finding);
            } else {
                // Nothing left to clean: a finding, reported once.
                actions.push(Action::Missing {
                    volume: volume.clone(),
                    path: stage.device.clone(),
                });
            }
            return;
        }

        // The staging mount.
        let mut staged_dev = None;
        if memory {
            // Nothing of it to confirm, roll back or clean.
        } else if block {
            if stage.phase == Phase::InProgress {
                // Unknown is not gone: confirm, and let stats report what is wrong.
                if !matches!(self.engine.presence(&stage), Presence::Gone(_)) {
                    stage.phase = Phase::Done;
                    actions.push(Action::Confirmed {
                        volume: volume.clone(),
                        path: stage.path.clone(),
                    });
                    record.stage = Some(stage.clone());
                } else {
                    record.stage = None;
                    actions.push(Action::RolledBack {
                        volume: volume.clone(),
                        path: stage.path.clone(),
                    });
                }
                self.put(&record, actions, &stage.path);
            }
        } else {
            match os.mount_state(&stage.path) {
                Ok(MountState::Mounted(mp)) if stage_is_ours(&mp) => {
                    staged_dev = Some(mp.dev);
                    if stage.phase == Phase::InProgress {
                        stage.phase = Phase::Done;
                        record.stage = Some(stage.clone());
                        self.put(&record, actions, &stage.path);
                        actions.push(Action::Confirmed {
                            volume: volume.clone(),
                            path: stage.path.clone(),
                        });
                    }
                    self.unstack(&volume, &stage.path, index, stage_is_ours, actions);
                }
                Ok(MountState::Mounted(_)) => actions.push(Action::Foreign {
                    volume: volume.clone(),
                    path: stage.path.clone(),
                }),
                Ok(MountState::Corrupted { errno }) => {
                    if self.detach(&volume, &stage.path, actions) {
                        actions.push(Action::CleanedCorrupted {
                            volume: volume.clone(),
                            path: stage.path.clone(),
                            errno,
                        });
                    }
                }
                Ok(MountState::Absent | MountState::NotMounted { .. }) => {
                    if stage.phase == Phase::InProgress && record.publishes.is_empty() {
                        record.stage = None;
                        self.put(&record, actions, &stage.path);
                        actions.push(Action::RolledBack {
                            volume: volume.clone(),
                            path: stage.path.clone(),
                        });
                        return;
                    }
                    actions.push(Action::Missing {
                        volume: volume.clone(),
                        path: stage.path.clone(),
                    });
                }
                Err(e) => actions.push(Action::Failed {
                    volume: volume.clone(),
                    path: stage.path.clone(),
                    error: e.to_string(),
                }),
            }
        }

        // The publications.
        let targets: Vec<(PathBuf, PublishRecord)> = record
            .publishes
            .iter()
            .map(|(t, p)| (t.clone(), p.clone()))
            .collect();
        for (target, mut publish) in targets {
            let pub_is_ours = |mp: &MountPoint| {
                if publish.block {
                    mp.rdev == Some(stage_dev)
                } else {
                    mp.is_dir && (Some(mp.dev) == staged_dev || mp.dev == stage_dev)
                }
            };
            match os.mount_state(&target) {
                Ok(MountState::Mounted(mp)) if pub_is_ours(&mp) => {
                    if publish.phase == Phase::InProgress {
                        publish.phase = Phase::Done;
                        record.publishes.insert(target.clone(), publish.clone());
                        self.put(&record, actions, &target);
                        actions.push(Action::Confirmed {
                            volume: volume.clone(),
                            path: target.clone(),
                        });
                    }
                    self.unstack(&volume, &target, index, pub_is_ours, actions);
                }
                Ok(MountState::Mounted(_)) => actions.push(Action::Foreign {
                    volume: volume.clone(),
                    path: target.clone(),
                }),
                Ok(MountState::Corrupted { errno }) => {
                    if self.detach(&volume, &target, actions) {
                        actions.push(Action::CleanedCorrupted {
                            volume: volume.clone(),
                            path: target.clone(),
                            errno,
                        });
                    }
                }
                Ok(MountState::Absent | MountState::NotMounted { .. })
                    if publish.phase == Phase::InProgress =>
                {
                    // Publish cut short before its bind, or unpublish after its unmount:
                    // either way kubelet's retry starts from nothing.
                    if let Err(e) = os.remove(&target) {
                        actions.push(Action::Failed {
                            volume: volume.clone(),
                            path: target.clone(),
                            error: e.to_string(),
                        });
                        continue;
                    }
                    record.publishes.remove(&target);
                    self.put(&record, actions, &target);
                    actions.push(Action::RolledBack {
                        volume: volume.clone(),
                        path: target.clone(),
                    });
                }
                Ok(MountState::Absent | MountState::NotMounted { .. }) => {
                    actions.push(Action::Missing {
                        volume: volume.clone(),
                        path: target.clone(),
                    });
                }
                Err(e) => actions.push(Action::Failed {
                    volume: volume.clone(),
                    path: target.clone(),
                    error: e.to_string(),
                }),
            }
        }
    }

    /// The volume's mounts that kubelet no longer knows ([`Action::KubeletForgot`]): a
    /// staging or a publication done, mounted, on a path of kubelet's shape whose
    /// `vol_data.json` is gone while its dir is there. Reported only; nothing is touched.
    fn forgotten_by_kubelet(&self, record: &VolumeRecord, actions: &mut Vec<Action>) {
        let kubelet = &self.engine.config().kubelet_dir;
        let stage = record
            .stage
            .iter()
            .filter(|s| s.phase == Phase::Done && !self.engine.stage_is_memory(s))
            .map(|s| &s.path);
        let publishes = record
            .publishes
            .iter()
            .filter(|(_, p)| p.phase == Phase::Done)
            .map(|(t, _)| t);
        for path in stage.chain(publishes) {
            let forgot =
                classify(kubelet, &self.driver_name, path).is_some() && kubelet_forgot(path);
            if forgot
                && matches!(
                    self.engine.os().mount_state(path),
                    Ok(MountState::Mounted(_))
                )
            {
                actions.push(Action::KubeletForgot {
                    volume: record.volume_id.clone(),
                    path: path.clone(),
                });
            }
        }
    }

    /// Records a mount on one of moor's kubelet paths that the journal does not know.
    fn adopt(&self, path: &Path, index: &Index<'_>, actions: &mut Vec<Action>) {
        let kubelet = &self.engine.config().kubelet_dir;
        let Some(kind) = classify(kubelet, &self.driver_name, path) else {
            return;
        };
        let Some(top) = index.get(path).and_then(|s| s.last()) else {
            return;
        };
        let Some(volume) = kind
            .vol_data(kubelet, path)
            .and_then(|f| read_vol_data(&f, &self.driver_name))
        else {
            return;
        };
        let Ok(_guard) = self.engine.locks().try_lock_background(&volume) else {
            actions.push(Action::Busy { volume });
            return;
        };
        let os = self.engine.os();
        let Ok(MountState::Mounted(mp)) = os.mount_state(path) else {
            return;
        };
        let mut record = self
            .engine
            .journal()
            .get(&volume)
            .unwrap_or_else(|| VolumeRecord::new(&volume));
        let adopted_stage = |spath: PathBuf, device: PathBuf, rdev, access| StageRecord {
            path: spath,
            device,
            rdev,
            access,
            attrs: MountAttrs::default(),
            access_mode: ADOPTED_MODE,
            phase: Phase::Done,
            fs_uuid: None,
            boot: self.engine.boot().stamp(),
        };
        match kind {
            KubeletPath::Staging => {
                let device = PathBuf::from(&top.source);
                let rdev = os.block_device(&device).map_or(mp.dev, |d| d.rdev);
                if record.stage.is_some() {
                    return;
                }
                record.stage = Some(adopted_stage(
                    path.to_path_buf(),
                    device,
                    rdev,
                    AccessRecord::Mount {
                        fs_type: top.fs_type.clone(),
                        fs_options: Vec::new(),
                        group: None,
                    },
                ));
            }
            KubeletPath::PodMount => {
                if record.stage.is_none() {
                    return;
                }
                record.publishes.insert(
                    path.to_path_buf(),
                    PublishRecord {
                        block: false,
                        attrs: MountAttrs {
                            read_only: mp.read_only,
                            ..MountAttrs::default()
                        },
                        access_mode: ADOPTED_MODE,
                        phase: Phase::Done,
                        boot: self.engine.boot().stamp(),
                    },
                );
            }
            KubeletPath::BlockPublish { ref pv } => {
                let Some(rdev) = mp.rdev else {
                    return;
                };
                if record.stage.is_none() {
                    let device = Path::new("/dev")
                        .join(top.root.strip_prefix("/").unwrap_or(top.root.as_path()));
                    record.stage = Some(adopted_stage(
                        kubelet
                            .join("plugins/kubernetes.io/csi/volumeDevices/staging")
                            .join(pv),
                        device,
                        rdev,
                        AccessRecord::Block,
                    ));
                }
                record.publishes.insert(
                    path.to_path_buf(),
                    PublishRecord {
                        block: true,
                        attrs: MountAttrs {
                            read_only: mp.read_only,
                            ..MountAttrs::default()
                        },
                        access_mode: ADOPTED_MODE,
                        phase: Phase::Done,
                        boot: self.engine.boot().stamp(),
                    },
                );
            }
        }
        self.put(&record, actions, path);
        actions.push(Action::Adopted {
            volume,
            path: path.to_path_buf(),
        });
    }
}

/// The kubelet paths a mount of moor's can sit on.
#[derive(Debug, Clone, PartialEq, Eq)]
enum KubeletPath {
    /// `plugins/kubernetes.io/csi/<driver>/<hash>/globalmount`.
    Staging,
    /// `pods/<uid>/volumes/kubernetes.io~csi/<pv>/mount`.
    PodMount,
    /// `plugins/kubernetes.io/csi/volumeDevices/publish/<pv>/<pod uid>`.
    BlockPublish {
        /// The PV name.
        pv: String,
    },
}

impl KubeletPath {
    /// Where kubelet keeps the `vol_data.json` naming the volume.
    fn vol_data(&self, kubelet: &Path, path: &Path) -> Option<PathBuf> {
        match self {
            KubeletPath::Staging | KubeletPath::PodMount => {
                path.parent().map(|p| p.join("vol_data.json"))
            }
            KubeletPath::BlockPublish { pv } => Some(
                kubelet
                    .join("plugins/kubernetes.io/csi/volumeDevices")
                    .join(pv)
                    .join("data/vol_data.json"),
            ),
        }
    }
}

fn classify(kubelet: &Path, driver: &str, path: &Path) -> Option<KubeletPath> {
    let rel = path.strip_prefix(kubelet).ok()?;
    let parts: Vec<&str> = rel.iter().map(|c| c.to_str()).collect::<Option<_>>()?;
    match parts.as_slice() {
        [
            "plugins",
            "kubernetes.io",
            "csi",
            "volumeDevices",
            "publish",
            pv,
            _uid,
        ] => Some(KubeletPath::BlockPublish {
            pv: (*pv).to_string(),
        }),
        ["plugins", "kubernetes.io", "csi", d, _hash, "globalmount"] if *d == driver => {
            Some(KubeletPath::Staging)
        }
        ["pods", _uid, "volumes", "kubernetes.io~csi", _pv, "mount"] => Some(KubeletPath::PodMount),
        _ => None,
    }
}

/// Where kubelet keeps the `vol_data.json` of the mount at `path`, by the path's shape alone:
/// beside a staging path (`.../globalmount`) or a pod's target (`.../mount`), and for a block
/// publication (`.../volumeDevices/publish/<pv>/<pod uid>`) in `.../volumeDevices/<pv>/data`.
/// None for a path of another shape.
pub fn vol_data_by_shape(path: &Path) -> Option<PathBuf> {
    let name = path.file_name()?.to_str()?;
    if matches!(name, "globalmount" | "mount") {
        return Some(path.parent()?.join("vol_data.json"));
    }
    let pv_dir = path.parent()?;
    let publish = pv_dir.parent()?;
    let devices = publish.parent()?;
    let pv = pv_dir.file_name()?;
    (publish.file_name()? == "publish" && devices.file_name()? == "volumeDevices")
        .then(|| devices.join(pv).join("data/vol_data.json"))
}

/// Whether kubelet lost the `vol_data.json` it keeps for the mount at `path` (kubelet
/// restarted or the node rebooted and lost it, kubernetes#121937): its dir is there, the
/// file is not. False for a path of no kubelet shape. Reconciliation and `moorctl status`
/// report such a mount and leave it mounted.
pub fn kubelet_forgot(path: &Path) -> bool {
    vol_data_by_shape(path).is_some_and(|file| {
        file.parent().is_some_and(Path::is_dir)
            && std::fs::symlink_metadata(&file)
                .is_err_and(|e| e.kind() == std::io::ErrorKind::NotFound)
    })
}

/// The volume handle in kubelet's `vol_data.json`, if it names `driver`.
pub fn read_vol_data(file: &Path, driver: &str) -> Option<String> {
    let bytes = std::fs::read(file).ok()?;
    parse_vol_data(&bytes, driver)
}

/// Parses kubelet's `vol_data.json`: the volume handle, if the driver is `driver`.
pub fn parse_vol_data(bytes: &[u8], driver: &str) -> Option<String> {
    #[derive(serde::Deserialize)]
    struct VolData {
        #[serde(rename = "driverName")]
        driver_name: String,
        #[serde(rename = "volumeHandle")]
        volume_handle: String,
    }
    let d: VolData = serde_json::from_slice(bytes).ok()?;
    (d.driver_name == driver && !d.volume_handle.is_empty()).then_some(d.volume_handle)
}

impl<O: Os> Reconciler<O> {
    /// One pass on a blocking thread, with a summary line; errors are logged, not returned
    /// (the next pass tries again).
    pub async fn pass(self: &Arc<Self>, full: bool) -> Vec<Action> {
        let this = Arc::clone(self);
        let start = std::time::Instant::now();
        match tokio::task::spawn_blocking(move || this.pass_with(full)).await {
            Ok(Ok(actions)) => {
                let changed = actions.iter().filter(|a| a.changed_something()).count();
                info!(
                    full,
                    volumes = self.engine.journal().all().len(),
                    actions = changed,
                    findings = actions.len() - changed,
                    elapsed_ms = start.elapsed().as_secs_f64() * 1e3,
                    "reconciled the journal with the mount table"
                );
                actions
            }
            Ok(Err(e)) => {
                warn!(error = %e, "reconciliation failed; next pass retries");
                Vec::new()
            }
            Err(e) => {
                warn!(error = %e, "reconciliation pass panicked; next pass retries");
                Vec::new()
            }
        }
    }

    /// Runs a light pass every `every` until the task is aborted.
    pub fn spawn_periodic(
        self: Arc<Self>,
        every: std::time::Duration,
    ) -> tokio::task::JoinHandle<()> {
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            tick.tick().await;
            loop {
                tick.tick().await;
                self.pass(false).await;
            }
        })
    }
}

#[cfg(test)]
mod tests;
