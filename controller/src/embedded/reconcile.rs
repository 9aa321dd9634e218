//! Start-up reconciliation: make the records and the loop devices of this host agree, after a
//! clean stop, a crash at any point, or a reboot.
//!
//! * `tmp/` is emptied (copies that never finished).
//! * A record's size follows its data file (a crash between growing a file and recording it).
//! * For every loop device bound to one of our volume files:
//!   - the record says the volume is published (attached, or attach in progress) and names no
//!     live device for it: the device is adopted into the record;
//!   - otherwise (not published, no record, a deleted file, a second device for the same
//!     volume): it is detached.
//! * A record saying a volume is attached whose device is gone or bound elsewhere is corrected
//!   to "not published" (the CO notices through ListVolumes' published nodes and attaches
//!   again, getting the new device).
//! * Filesystems a group snapshot froze and a crash left frozen are thawed.
//! * Member snapshots of a group snapshot whose group record was never written (a crash in the
//!   middle of CreateVolumeGroupSnapshot) are removed: the create never answered, its retry
//!   cuts the group afresh.
//! * Data files without a record (a crash between writing the data and its record, or between
//!   removing the record and the data) are removed, unless a set-aside record claims them.
//!
//! Devices whose backing file is anywhere else are never touched.

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};

use tracing::{info, warn};

use super::Layout;
use super::attach::{Attacher, Attachment, Detach, FileId};
use super::ids::{SnapshotId, VolumeId};
use super::records::{self, Loaded, RecordStore, SetAside};
use crate::error::{Error, Result};

/// What reconciliation found and did.
#[derive(Debug, Default)]
pub struct Report {
    /// Volumes on record.
    pub volumes: usize,
    /// Snapshots on record.
    pub snapshots: usize,
    /// (volume, device) adopted into a record.
    pub adopted: Vec<(String, PathBuf)>,
    /// (device, backing file) detached.
    pub detached: Vec<(PathBuf, PathBuf)>,
    /// (volume, what was wrong) publications corrected.
    pub corrected: Vec<(String, String)>,
    /// (volume, new size) records whose size followed the file.
    pub resized: Vec<(String, u64)>,
    /// Data files without a record, removed.
    pub orphans_removed: Vec<PathBuf>,
    /// Snapshots of group snapshots that were never finished, removed.
    pub unfinished_members: Vec<String>,
    /// Filesystems a killed group snapshot left frozen, thawed.
    pub thawed: Vec<PathBuf>,
    /// Volumes on record whose data file is missing.
    pub missing_data: Vec<String>,
    /// Records that could not be read.
    pub set_aside: Vec<SetAside>,
    /// Steps that failed without stopping start-up.
    pub problems: Vec<String>,
}

impl Report {
    /// Whether reconciliation changed anything or found anything wrong.
    pub fn is_clean(&self) -> bool {
        self.adopted.is_empty()
            && self.detached.is_empty()
            && self.corrected.is_empty()
            && self.resized.is_empty()
            && self.orphans_removed.is_empty()
            && self.unfinished_members.is_empty()
            && self.thawed.is_empty()
            && self.missing_data.is_empty()
            && self.set_aside.is_empty()
            && self.problems.is_empty()
    }
}

/// The volume a device's backing file is, if it is one of ours.
fn our_volume(layout: &Layout, backing: &Path) -> Option<VolumeId> {
    if backing.parent() != Some(layout.volumes.as_path()) {
        return None;
    }
    VolumeId::from_file_name(backing.file_name()?.to_str()?, "img")
}

fn detach(attacher: &impl Attacher, a: &Attachment, why: &str, report: &mut Report) {
    match attacher.detach(&a.device, a.file) {
        Ok(r @ (Detach::Done | Detach::Deferred)) => {
            info!(device = %a.device.display(), backing = %a.backing.display(), why, result = ?r, "detached leftover loop device");
            report.detached.push((a.device.clone(), a.backing.clone()));
        }
        Ok(Detach::AlreadyGone | Detach::NotOurs) => {}
        Err(e) => {
            warn!(device = %a.device.display(), error = %e, "cannot detach leftover loop device");
            report
                .problems
                .push(format!("detach {}: {e}", a.device.display()));
        }
    }
}

/// Runs reconciliation over the loaded records, writing back the records it changes.
pub fn run(
    layout: &Layout,
    store: &RecordStore,
    attacher: &impl Attacher,
    loaded: &mut Loaded,
    report: &mut Report,
) -> Result<()> {
    let protected: BTreeSet<String> = loaded
        .set_aside
        .iter()
        .filter_map(|a| a.id.clone())
        .collect();
    let mut changed: BTreeSet<String> = BTreeSet::new();

    // Filesystems a killed group snapshot left frozen.
    if let Some(rec) = loaded.frozen.take() {
        report.thawed = super::freeze::thaw_left_over(store, &rec, &mut report.problems);
    }

    // Members of group snapshots that were never finished: their data goes with the orphans.
    for id in
        super::groups::incomplete_members(loaded.snapshots.values(), &loaded.groups, &protected)
    {
        let Some(sid) = SnapshotId::parse(&id) else {
            continue;
        };
        store.remove_snapshot(&sid)?;
        loaded.snapshots.remove(&id);
        super::groups::log_incomplete(&id, &layout.snapshot_file(&sid));
        report.unfinished_members.push(id);
    }

    // Unfinished copies.
    if let Ok(entries) = fs::read_dir(&layout.tmp) {
        for e in entries.flatten() {
            if let Err(err) = fs::remove_file(e.path()) {
                report
                    .problems
                    .push(format!("remove {}: {err}", e.path().display()));
            }
        }
    }

    // Sizes follow the files.
    for (id, rec) in loaded.volumes.iter_mut() {
        let Some(vid) = VolumeId::parse(id) else {
            continue;
        };
        match fs::metadata(layout.volume_file(&vid)) {
            Ok(m) if m.len() != rec.capacity_bytes => {
                rec.capacity_bytes = m.len();
                report.resized.push((id.clone(), m.len()));
                changed.insert(id.clone());
            }
            Ok(_) => {}
            Err(_) => {
                warn!(volume = %id, "data file missing");
                report.missing_data.push(id.clone());
            }
        }
    }

    // Loop devices bound to our volume files.
    let attachments = attacher.list(&layout.root).map_err(Error::from)?;
    let mut matched: BTreeSet<String> = BTreeSet::new();
    for a in &attachments {
        let Some(vid) = our_volume(layout, &a.backing) else {
            continue;
        };
        if protected.contains(vid.as_str()) {
            report.problems.push(format!(
                "{} backs volume {vid}, whose record was set aside; left alone",
                a.device.display()
            ));
            continue;
        }
        let current = FileId::of_path(&layout.volume_file(&vid)).ok();
        let same_file = !a.deleted && current == Some(a.file);
        let device = a.device.display().to_string();
        let Some(rec) = loaded.volumes.get_mut(vid.as_str()) else {
            detach(attacher, a, "no record", report);
            continue;
        };
        let Some(p) = rec.publication.as_mut().filter(|_| same_file) else {
            let why = if same_file {
                "not published"
            } else {
                "backs a deleted file"
            };
            detach(attacher, a, why, report);
            continue;
        };
        if p.device.as_deref() == Some(device.as_str()) {
            matched.insert(vid.to_string());
            continue;
        }
        let recorded_alive = p.device.as_ref().is_some_and(|d| {
            attachments
                .iter()
                .any(|o| o.device.display().to_string() == *d && o.file == a.file && !o.deleted)
        });
        if recorded_alive || matched.contains(vid.as_str()) {
            detach(attacher, a, "second device for the volume", report);
            continue;
        }
        info!(volume = %vid, device, "adopting loop device into the record");
        p.device = Some(device);
        report.adopted.push((vid.to_string(), a.device.clone()));
        matched.insert(vid.to_string());
        changed.insert(vid.to_string());
    }

    // Publications whose device is gone.
    for (id, rec) in loaded.volumes.iter_mut() {
        if matched.contains(id) {
            continue;
        }
        let Some(p) = rec.publication.take() else {
            continue;
        };
        let what = match &p.device {
            Some(d) => format!("loop device {d} is gone or bound to another file"),
            None => "the attach never completed".to_string(),
        };
        warn!(volume = %id, node = %p.node_id, what, "publication corrected: not published");
        report.corrected.push((id.clone(), what));
        changed.insert(id.clone());
    }

    // Data without a record.
    remove_orphans(
        &layout.volumes,
        |name| VolumeId::from_file_name(name, "img").map(|i| i.to_string()),
        |id| loaded.volumes.contains_key(id) || protected.contains(id),
        report,
    );
    remove_orphans(
        &layout.snapshots,
        |name| SnapshotId::from_file_name(name, "img").map(|i| i.to_string()),
        |id| loaded.snapshots.contains_key(id) || protected.contains(id),
        report,
    );

    for id in &changed {
        if let Some(rec) = loaded.volumes.get(id) {
            store.put_volume(rec)?;
        }
    }
    report.volumes = loaded.volumes.len();
    report.snapshots = loaded.snapshots.len();
    Ok(())
}

fn remove_orphans(
    dir: &Path,
    id_of: impl Fn(&str) -> Option<String>,
    known: impl Fn(&str) -> bool,
    report: &mut Report,
) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    let mut removed = false;
    for e in entries.flatten() {
        let Some(id) = e.file_name().to_str().and_then(&id_of) else {
            continue;
        };
        if known(&id) {
            continue;
        }
        let path = e.path();
        match fs::remove_file(&path) {
            Ok(()) => {
                info!(file = %path.display(), "removed data without a record");
                report.orphans_removed.push(path);
                removed = true;
            }
            Err(err) => report
                .problems
                .push(format!("remove {}: {err}", path.display())),
        }
    }
    if removed && let Err(err) = records::sync_dir(dir) {
        report
            .problems
            .push(format!("fsync {}: {err}", dir.display()));
    }
}
