//! Volume group snapshots of the embedded backend: one snapshot file per member, all cloned
//! while the members' writes are held (see [`super::freeze`]), each an ordinary snapshot
//! (usable as a volume source, deletable on its own) whose record names the group.
//!
//! Order on disk: the member files are cloned into `tmp/` (frozen), then each is fsynced and
//! renamed into `snapshots/` (thawed); then the members' records; the group's record last. A
//! crash before the group record leaves member files without records (orphans, removed at
//! start) or member records naming a group that has none (removed at start with their data).
//! Deleting removes the members first and the group record last.

use std::fs::{self, File};
use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};
use std::time::{Instant, SystemTime};

use tracing::{info, warn};

use super::attach::{Attacher, FileId};
use super::freeze::{self, Frozen, Mounted};
use super::ids::{GroupId, SnapshotId, VolumeId};
use super::records::{self, GroupRecord, SnapshotRecord};
use super::{EmbeddedBackend, Found, TempFile, copy, no_parameters, snapshot_key, volume_key};
use crate::backend::{GroupSnapshot, GroupSnapshotRef, NewGroupSnapshot};
use crate::error::{Error, Result, trunc};

fn group_key(id: &GroupId) -> String {
    format!("group:{id}")
}

/// One member being cut.
struct Member {
    volume: VolumeId,
    snapshot: SnapshotId,
    source: PathBuf,
    size: u64,
    /// Every device bound read-write to the member's file, as the kernel has them now (not
    /// as the records say): each must be held, and flushed before the clone.
    writers: Vec<PathBuf>,
    /// How the clone may share the member's extents (never a thick volume's).
    sharing: copy::Sharing,
    tmp: Option<TempFile>,
}

impl<A: Attacher> EmbeddedBackend<A> {
    fn new_group_id(&self) -> Result<GroupId> {
        for _ in 0..16 {
            let id = GroupId::random()?;
            let taken = {
                let st = self.state();
                st.groups.contains_key(id.as_str()) || st.protected.contains(id.as_str())
            };
            if !taken {
                return Ok(id);
            }
        }
        Err(Error::Internal("no unused group id after 16 tries".into()))
    }

    fn group_of(&self, rec: &GroupRecord) -> GroupSnapshot {
        let st = self.state();
        GroupSnapshot {
            id: self.show(&rec.id),
            snapshots: rec
                .snapshot_ids
                .iter()
                .filter_map(|s| st.snapshots.get(s))
                .map(|s| self.snapshot_of(s))
                .collect(),
            created_at: rec.created_at(),
        }
    }

    /// The filesystem of each member attached read-write, to freeze; FAILED_PRECONDITION for
    /// one whose writes cannot be held (see [`super::freeze`]).
    fn writers(&self, members: &[Member]) -> Result<Vec<Mounted>> {
        if members.iter().all(|m| m.writers.is_empty()) {
            return Ok(Vec::new());
        }
        let table = freeze::mount_table()?;
        let mut out = Vec::new();
        for m in members {
            for dev in &m.writers {
                // A device node that cannot be read names no mount: refused like one unmounted.
                let device = freeze::device_number(dev).ok();
                match device.and_then(|d| freeze::mount_of(&table, d).map(|m| (d, m))) {
                    Some((device, mount_point)) => out.push(Mounted {
                        mount_point,
                        device,
                    }),
                    None => {
                        return Err(Error::GroupRefused(format!(
                            "volume {} is attached read-write as {} and no filesystem of it \
                             is mounted where the controller can freeze it (a raw block volume, \
                             or a mount outside the controller's view): its writes cannot be \
                             held while the group is cut",
                            m.volume,
                            dev.display()
                        )));
                    }
                }
            }
        }
        Ok(out)
    }

    /// Clones every member into `tmp/` while their writes are held.
    fn clone_members(&self, members: &mut [Member]) -> Result<()> {
        let mounts = self.writers(members)?;
        let data_dev = fs::metadata(&self.layout.root)
            .map_err(|e| Error::io("stat", &self.layout.root, e))?
            .dev();
        let start = Instant::now();
        let frozen = Frozen::freeze(&self.store, &mounts, data_dev)?;
        if frozen.count() != mounts.len() {
            return Err(Error::Internal(format!(
                "{} of the members' {} filesystems were frozen",
                frozen.count(),
                mounts.len()
            )));
        }
        for m in members.iter_mut() {
            for dev in &m.writers {
                self.flush_device(dev, &m.source)?;
            }
            let src = File::open(&m.source).map_err(|e| Error::io("open", &m.source, e))?;
            let (tmp, dst) = self.create_temp(&m.snapshot.data_file())?;
            m.tmp = Some(tmp);
            let size = src
                .metadata()
                .map_err(|e| Error::io("stat", &m.source, e))?
                .len();
            copy::copy(&src, &dst, size, m.sharing)?;
            m.size = size;
        }
        let held = frozen.count();
        drop(frozen);
        info!(
            members = members.len(),
            writers = members.iter().map(|m| m.writers.len()).sum::<usize>(),
            frozen = held,
            micros = u64::try_from(start.elapsed().as_micros()).unwrap_or(u64::MAX),
            "group cloned"
        );
        Ok(())
    }

    /// Makes the clones durable in `snapshots/`; returns the paths placed there.
    fn place_members(&self, members: &mut [Member]) -> Result<Vec<PathBuf>> {
        let mut placed = Vec::new();
        let result = (|| {
            for m in members.iter_mut() {
                let Some(tmp) = m.tmp.as_mut() else {
                    return Err(Error::Internal("a member was not cloned".into()));
                };
                let f = File::open(&tmp.path).map_err(|e| Error::io("open", &tmp.path, e))?;
                f.sync_all().map_err(|e| Error::io("fsync", &tmp.path, e))?;
                let target = self.layout.snapshot_file(&m.snapshot);
                fs::rename(&tmp.path, &target).map_err(|e| Error::io("rename", &target, e))?;
                tmp.keep = true;
                placed.push(target);
            }
            records::sync_dir(&self.layout.snapshots)
                .map_err(|e| Error::io("fsync dir", &self.layout.snapshots, e))
        })();
        match result {
            Ok(()) => Ok(placed),
            Err(e) => {
                for p in &placed {
                    let _ = Self::remove_data_file(p);
                }
                Err(e)
            }
        }
    }

    pub(super) fn create_group(&self, req: &NewGroupSnapshot) -> Result<GroupSnapshot> {
        no_parameters(&req.parameters, "group snapshot")?;
        let name_key = format!("group-name:{}", req.name);
        let _claim = self.inflight.claim(&[&name_key], &[])?;
        let existing = self
            .state()
            .groups
            .values()
            .find(|g| g.name == req.name)
            .cloned();
        if let Some(existing) = existing {
            let mut theirs = req.source_volume_ids.clone();
            let mut ours: Vec<String> = existing
                .source_volume_ids
                .iter()
                .map(|v| self.show(v))
                .collect();
            theirs.sort();
            ours.sort();
            if theirs != ours {
                return Err(Error::GroupSnapshotExists {
                    name: req.name.clone(),
                    id: self.show(&existing.id),
                    reason: format!("it was cut from volumes {}", ours.join(", ")),
                });
            }
            return Ok(self.group_of(&existing));
        }
        let mut ids = Vec::new();
        for raw in &req.source_volume_ids {
            let id = match self.find_volume(raw) {
                Found::Here(id) => id,
                Found::Elsewhere(node) => {
                    return Err(Error::GroupRefused(format!(
                        "volume {} lives on node {node:?}: a group snapshot is cut on one node, \
                         of volumes that all live there (this is node {:?})",
                        trunc(raw),
                        self.node_id()
                    )));
                }
                Found::Unknown => return Err(Error::VolumeNotFound(trunc(raw).to_string())),
            };
            ids.push(id);
        }
        let keys: Vec<String> = ids.iter().map(volume_key).collect();
        let key_refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        // Shared: other snapshots may be cut meanwhile, but no member is published,
        // unpublished, grown or deleted until the group is cut.
        let _sources = self.inflight.claim(&[], &key_refs)?;
        // Who can write to each member is what the kernel says now: a record can be wrong
        // (a device it lost track of), and a member written to while the others are cloned
        // would make a group that is not one instant.
        let live = self.attacher.list(&self.layout.root)?;
        let mut members = Vec::with_capacity(ids.len());
        for vid in ids {
            let Some(rec) = self.volume_record(&vid) else {
                return Err(Error::VolumeNotFound(vid.to_string()));
            };
            let source = self.layout.volume_file(&vid);
            let file = FileId::of_path(&source).map_err(|e| Error::io("stat", &source, e))?;
            let writers: Vec<PathBuf> = live
                .iter()
                .filter(|a| a.file == file && !a.deleted && !a.read_only)
                .map(|a| a.device.clone())
                .collect();
            let mut snapshot = self.new_snapshot_id()?;
            while members.iter().any(|m: &Member| m.snapshot == snapshot) {
                snapshot = self.new_snapshot_id()?;
            }
            members.push(Member {
                source,
                volume: vid,
                snapshot,
                size: 0,
                writers,
                sharing: if super::is_thick(&rec.parameters) {
                    copy::Sharing::Private
                } else {
                    copy::Sharing::Allowed
                },
                tmp: None,
            });
        }
        let gid = self.new_group_id()?;
        let created = SystemTime::now();
        self.clone_members(&mut members)?;
        // The clones hold what they copied: they must not eat the space thin volumes are
        // promised (refused, they go with their temp files).
        self.admit(
            super::space::Claim::default(),
            &format!("a group snapshot of {} volumes", members.len()),
        )?;
        let placed = self.place_members(&mut members)?;
        let (created_secs, created_nanos) = SnapshotRecord::time_fields(created);
        let snapshot_records: Vec<SnapshotRecord> = members
            .iter()
            .map(|m| SnapshotRecord {
                version: records::FORMAT_VERSION,
                id: m.snapshot.to_string(),
                name: format!("{}/{}", req.name, m.volume),
                source_volume_id: m.volume.to_string(),
                size_bytes: m.size,
                created_secs,
                created_nanos,
                group_snapshot_id: Some(gid.to_string()),
                // A group holding an encrypted volume is refused before it is cut.
                encryption: crate::backend::Parameters::new(),
            })
            .collect();
        let group = GroupRecord {
            version: records::FORMAT_VERSION,
            id: gid.to_string(),
            name: req.name.clone(),
            source_volume_ids: members.iter().map(|m| m.volume.to_string()).collect(),
            snapshot_ids: members.iter().map(|m| m.snapshot.to_string()).collect(),
            created_secs,
            created_nanos,
        };
        let mut written = Vec::new();
        let saved = (|| {
            for r in &snapshot_records {
                self.store.put_snapshot(r)?;
                written.push(r.id.clone());
            }
            self.store.put_group(&group)
        })();
        if let Err(e) = saved {
            for id in written.iter().filter_map(|s| SnapshotId::parse(s)) {
                let _ = self.store.remove_snapshot(&id);
            }
            for p in &placed {
                let _ = Self::remove_data_file(p);
            }
            return Err(e.into());
        }
        {
            let mut st = self.state();
            for r in snapshot_records {
                st.snapshots.insert(r.id.clone(), r);
            }
            st.groups.insert(group.id.clone(), group.clone());
        }
        info!(group = %gid, name = %req.name, members = members.len(), "group snapshot cut");
        Ok(self.group_of(&group))
    }

    pub(super) fn get_group(&self, req: &GroupSnapshotRef) -> Result<GroupSnapshot> {
        let not_found = || Error::GroupSnapshotNotFound(trunc(&req.id).to_string());
        let id = match self.find_group(&req.id) {
            Found::Here(id) => id,
            Found::Elsewhere(node) => {
                return Err(self.on_other_node("group snapshot", &req.id, node));
            }
            Found::Unknown => return Err(not_found()),
        };
        let rec = self
            .state()
            .groups
            .get(id.as_str())
            .cloned()
            .ok_or_else(not_found)?;
        req.check_members(&self.shown_members(&rec))?;
        Ok(self.group_of(&rec))
    }

    pub(super) fn delete_group(&self, req: &GroupSnapshotRef) -> Result<()> {
        let Some(id) = self.to_delete("group snapshot", &req.id, self.find_group(&req.id))? else {
            return Ok(());
        };
        let _claim = self.inflight.claim(&[&group_key(&id)], &[])?;
        let Some(rec) = self.state().groups.get(id.as_str()).cloned() else {
            return Ok(());
        };
        req.check_members(&self.shown_members(&rec))?;
        for sid in rec.snapshot_ids.iter().filter_map(|s| SnapshotId::parse(s)) {
            self.delete_member(&sid)?;
        }
        self.store.remove_group(&id)?;
        self.state().groups.remove(id.as_str());
        info!(group = %id, "group snapshot deleted");
        Ok(())
    }

    /// A group's member snapshot ids as the outside sees them.
    fn shown_members(&self, rec: &GroupRecord) -> Vec<String> {
        rec.snapshot_ids.iter().map(|s| self.show(s)).collect()
    }

    /// Deletes one member snapshot (record, then data).
    fn delete_member(&self, id: &SnapshotId) -> Result<()> {
        let _claim = self.inflight.claim(&[&snapshot_key(id)], &[])?;
        if self.state().snapshots.contains_key(id.as_str()) {
            self.store.remove_snapshot(id)?;
            self.state().snapshots.remove(id.as_str());
        }
        Self::remove_data_file(&self.layout.snapshot_file(id))
    }
}

/// Member snapshots whose group has no record (a create cut short by a crash): their ids.
pub fn incomplete_members<'a>(
    snapshots: impl IntoIterator<Item = &'a SnapshotRecord>,
    groups: &std::collections::BTreeMap<String, GroupRecord>,
    protected: &std::collections::BTreeSet<String>,
) -> Vec<String> {
    snapshots
        .into_iter()
        .filter(|s| {
            s.group_snapshot_id
                .as_ref()
                .is_some_and(|g| !groups.contains_key(g) && !protected.contains(g))
        })
        .map(|s| s.id.clone())
        .collect()
}

/// Logs a member removed at start.
pub fn log_incomplete(id: &str, path: &Path) {
    warn!(snapshot = id, file = %path.display(), "member of a group snapshot that was never finished; removed");
}
