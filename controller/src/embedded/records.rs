//! The embedded backend's records: one JSON file per volume and per snapshot, written so that
//! a crash at any point leaves either the old or the new record, never a torn one.
//!
//! A write goes to a temporary file in the same directory, which is fsynced, renamed over the
//! record, and the directory fsynced. A removal unlinks the record and fsyncs the directory.
//! Records that cannot be read are set aside (renamed `*.corrupt`) with the id they stood for,
//! so the data they describe is kept, not mistaken for an orphan.

use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::io::Write as _;
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use super::ids::{GroupId, SnapshotId, VolumeId};
use crate::backend::{ContentSource, Parameters, Qos};

/// The record format version this code writes.
pub const FORMAT_VERSION: u32 = 1;

/// A record step failed.
#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    /// The filesystem refused.
    #[error("{step} {}: {source}", path.display())]
    Io {
        /// What was being done.
        step: &'static str,
        /// On which file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A record could not be encoded.
    #[error("encode record {id}: {source}")]
    Encode {
        /// The object's id.
        id: String,
        /// Why.
        #[source]
        source: serde_json::Error,
    },
    /// A record of a newer format than this code's: a newer moor-controller wrote the data
    /// dir. Nothing was changed.
    #[error(
        "{} is a record of format version {version}, newer than this moor-controller's \
         {FORMAT_VERSION}; it changed nothing and will not start on this data dir: run the \
         moor-controller that wrote it, or a newer one",
        path.display()
    )]
    Newer {
        /// The record.
        path: PathBuf,
        /// Its version.
        version: u64,
    },
}

fn io<'a>(step: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> RecordError + 'a {
    move |source| RecordError::Io {
        step,
        path: path.to_path_buf(),
        source,
    }
}

/// Where and how a volume is published.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Publication {
    /// The node.
    pub node_id: String,
    /// Published read-only.
    pub readonly: bool,
    /// The loop device, once attached; None while the attach is in progress (written before
    /// the attach, so that a crash in between leaves a device that start-up adopts).
    pub device: Option<String>,
}

/// One volume.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeRecord {
    /// Record format version.
    pub version: u32,
    /// The volume id.
    pub id: String,
    /// The CO's name.
    pub name: String,
    /// Current size in bytes.
    pub capacity_bytes: u64,
    /// Size at creation.
    pub created_bytes: u64,
    /// Normalised creation parameters.
    pub parameters: Parameters,
    /// Volume context handed to the CO.
    pub context: Parameters,
    /// Where the data came from.
    pub source: Option<ContentSource>,
    /// Its publication, if any.
    pub publication: Option<Publication>,
    /// Its QoS limits (its VolumeAttributesClass), if any.
    #[serde(default, skip_serializing_if = "Qos::is_none")]
    pub qos: Qos,
    /// An encrypted volume's wrapped data keys once a rotation has begun (the current one and
    /// a pending one; docs/encryption.md, "Rotation"); `None`: its context's `encryptedDEK`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keys: Option<crate::encryption::rotation::RecordKeys>,
}

/// One snapshot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotRecord {
    /// Record format version.
    pub version: u32,
    /// The snapshot id.
    pub id: String,
    /// The CO's name.
    pub name: String,
    /// The volume it was cut from.
    pub source_volume_id: String,
    /// Size of the data.
    pub size_bytes: u64,
    /// When it was cut: seconds since the epoch.
    pub created_secs: u64,
    /// When it was cut: nanoseconds within the second.
    pub created_nanos: u32,
    /// The group snapshot it was cut in, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group_snapshot_id: Option<String>,
    /// Its source's encryption parameters and wrapped data key when it was cut
    /// (`encryption::of_volume`); empty for a source in the clear.
    #[serde(default, skip_serializing_if = "Parameters::is_empty")]
    pub encryption: Parameters,
}

/// One group snapshot. Its member snapshots have records of their own (naming the group), all
/// written before this one: a member whose group has no record is what a crash in the middle
/// of a create left, and start-up removes it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupRecord {
    /// Record format version.
    pub version: u32,
    /// The group snapshot id.
    pub id: String,
    /// The CO's name.
    pub name: String,
    /// The volumes, in the request's order.
    pub source_volume_ids: Vec<String>,
    /// The member snapshots, one per volume, in the same order.
    pub snapshot_ids: Vec<String>,
    /// When it was cut: seconds since the epoch.
    pub created_secs: u64,
    /// When it was cut: nanoseconds within the second.
    pub created_nanos: u32,
}

impl GroupRecord {
    /// When it was cut.
    pub fn created_at(&self) -> SystemTime {
        UNIX_EPOCH + Duration::new(self.created_secs, self.created_nanos.min(999_999_999))
    }
}

/// The filesystems a group snapshot froze: written before the first freeze, removed after the
/// last thaw, so that a controller killed in between thaws them at its next start.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct FreezeRecord {
    /// Mount points, one per frozen filesystem.
    pub mounts: Vec<PathBuf>,
}

impl SnapshotRecord {
    /// When it was cut.
    pub fn created_at(&self) -> SystemTime {
        UNIX_EPOCH + Duration::new(self.created_secs, self.created_nanos.min(999_999_999))
    }

    /// Splits `t` into the record's fields.
    pub fn time_fields(t: SystemTime) -> (u64, u32) {
        let d = t.duration_since(UNIX_EPOCH).unwrap_or_default();
        (d.as_secs(), d.subsec_nanos())
    }
}

/// A record file that could not be read, set aside.
#[derive(Debug)]
pub struct SetAside {
    /// The id it stood for, when the file name said.
    pub id: Option<String>,
    /// Where it now is.
    pub path: PathBuf,
    /// Why it was set aside.
    pub reason: String,
}

/// Everything read at start-up.
#[derive(Debug, Default)]
pub struct Loaded {
    /// Volumes by id.
    pub volumes: BTreeMap<String, VolumeRecord>,
    /// Snapshots by id.
    pub snapshots: BTreeMap<String, SnapshotRecord>,
    /// Group snapshots by id.
    pub groups: BTreeMap<String, GroupRecord>,
    /// Filesystems left frozen by a group snapshot that never finished.
    pub frozen: Option<FreezeRecord>,
    /// Unreadable records.
    pub set_aside: Vec<SetAside>,
}

/// The record directories.
#[derive(Debug, Clone)]
pub struct RecordStore {
    root: PathBuf,
    volumes: PathBuf,
    snapshots: PathBuf,
    groups: PathBuf,
}

/// The freeze record's file name, in the records dir.
const FREEZE_FILE: &str = "freezing.json";

impl RecordStore {
    /// Opens (creating) `root/volumes`, `root/snapshots` and `root/groups` and reads every
    /// record.
    /// A record of a newer format refuses the whole store before anything is changed
    /// ([`RecordError::Newer`]): a downgrade never sets aside or rewrites what it cannot read.
    pub fn open(root: &Path) -> Result<(Self, Loaded), RecordError> {
        let store = Self {
            root: root.to_path_buf(),
            volumes: root.join("volumes"),
            snapshots: root.join("snapshots"),
            groups: root.join("groups"),
        };
        for dir in [&store.volumes, &store.snapshots, &store.groups] {
            refuse_newer(dir)?;
        }
        for dir in [root, &store.volumes, &store.snapshots, &store.groups] {
            fs::create_dir_all(dir).map_err(io("create dir", dir))?;
        }
        let mut loaded = Loaded::default();
        loaded.volumes = load_dir(
            &store.volumes,
            |name| VolumeId::from_file_name(name, "json").map(|i| i.to_string()),
            |r: &VolumeRecord| (r.id.clone(), r.version),
            "volume",
            &mut loaded.set_aside,
        )?;
        loaded.snapshots = load_dir(
            &store.snapshots,
            |name| SnapshotId::from_file_name(name, "json").map(|i| i.to_string()),
            |r: &SnapshotRecord| (r.id.clone(), r.version),
            "snapshot",
            &mut loaded.set_aside,
        )?;
        loaded.groups = load_dir(
            &store.groups,
            |name| GroupId::from_file_name(name, "json").map(|i| i.to_string()),
            |r: &GroupRecord| (r.id.clone(), r.version),
            "group snapshot",
            &mut loaded.set_aside,
        )?;
        let freeze = root.join(FREEZE_FILE);
        match fs::read(&freeze) {
            Ok(data) => match serde_json::from_slice::<FreezeRecord>(&data) {
                Ok(rec) => loaded.frozen = Some(rec),
                Err(e) => set_aside(&freeze, None, e.to_string(), &mut loaded.set_aside),
            },
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(io("read", &freeze)(e)),
        }
        Ok((store, loaded))
    }

    /// Writes a group snapshot record durably.
    pub fn put_group(&self, rec: &GroupRecord) -> Result<(), RecordError> {
        let data = serde_json::to_vec_pretty(rec).map_err(|source| RecordError::Encode {
            id: rec.id.clone(),
            source,
        })?;
        write_atomic(&self.groups, &format!("{}.json", rec.id), &data)
    }

    /// Removes a group snapshot record durably (absent: success).
    pub fn remove_group(&self, id: &GroupId) -> Result<(), RecordError> {
        remove_durable(&self.groups, &id.record_file())
    }

    /// Records, durably, the filesystems about to be frozen.
    pub fn put_freeze(&self, rec: &FreezeRecord) -> Result<(), RecordError> {
        let data = serde_json::to_vec_pretty(rec).map_err(|source| RecordError::Encode {
            id: FREEZE_FILE.into(),
            source,
        })?;
        write_atomic(&self.root, FREEZE_FILE, &data)
    }

    /// Removes the freeze record (absent: success).
    pub fn remove_freeze(&self) -> Result<(), RecordError> {
        remove_durable(&self.root, FREEZE_FILE)
    }

    /// Writes a volume record durably.
    pub fn put_volume(&self, rec: &VolumeRecord) -> Result<(), RecordError> {
        let data = serde_json::to_vec_pretty(rec).map_err(|source| RecordError::Encode {
            id: rec.id.clone(),
            source,
        })?;
        write_atomic(&self.volumes, &format!("{}.json", rec.id), &data)
    }

    /// Removes a volume record durably (absent: success).
    pub fn remove_volume(&self, id: &VolumeId) -> Result<(), RecordError> {
        remove_durable(&self.volumes, &id.record_file())
    }

    /// Writes a snapshot record durably.
    pub fn put_snapshot(&self, rec: &SnapshotRecord) -> Result<(), RecordError> {
        let data = serde_json::to_vec_pretty(rec).map_err(|source| RecordError::Encode {
            id: rec.id.clone(),
            source,
        })?;
        write_atomic(&self.snapshots, &format!("{}.json", rec.id), &data)
    }

    /// Removes a snapshot record durably (absent: success).
    pub fn remove_snapshot(&self, id: &SnapshotId) -> Result<(), RecordError> {
        remove_durable(&self.snapshots, &id.record_file())
    }
}

/// Reads the records of one kind in `dir`: a record is kept when its file name is an id of
/// that kind (`id_of`) and the record says the same id and a version this code reads;
/// anything else is set aside.
/// [`RecordError::Newer`] for the first record in `dir` (absent: none) whose `version` is
/// newer than [`FORMAT_VERSION`]; records that do not read as JSON are left to the load, which
/// sets them aside.
fn refuse_newer(dir: &Path) -> Result<(), RecordError> {
    let entries = match fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(io("read dir", dir)(e)),
    };
    for entry in entries {
        let path = entry.map_err(io("read dir", dir))?.path();
        let is_record = path
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.ends_with(".json") && !n.starts_with('.'));
        if !is_record {
            continue;
        }
        let data = fs::read(&path).map_err(io("read", &path))?;
        let version = serde_json::from_slice::<serde_json::Value>(&data)
            .ok()
            .and_then(|v| v.get("version")?.as_u64());
        if let Some(version) = version.filter(|v| *v > u64::from(FORMAT_VERSION)) {
            return Err(RecordError::Newer { path, version });
        }
    }
    Ok(())
}

fn load_dir<R: serde::de::DeserializeOwned>(
    dir: &Path,
    id_of: impl Fn(&str) -> Option<String>,
    id_version: impl Fn(&R) -> (String, u32),
    what: &str,
    aside: &mut Vec<SetAside>,
) -> Result<BTreeMap<String, R>, RecordError> {
    let mut out = BTreeMap::new();
    for (path, name, data) in read_dir_records(dir, aside)? {
        let Some(id) = id_of(&name) else {
            set_aside(&path, None, format!("not a {what} record name"), aside);
            continue;
        };
        match serde_json::from_slice::<R>(&data) {
            Ok(rec) => match id_version(&rec) {
                (rid, version) if rid == id && version <= FORMAT_VERSION => {
                    out.insert(id, rec);
                }
                (rid, version) => set_aside(
                    &path,
                    Some(id),
                    format!("record says id {rid:?} version {version}"),
                    aside,
                ),
            },
            Err(e) => set_aside(&path, Some(id), e.to_string(), aside),
        }
    }
    Ok(out)
}

/// Reads every `*.json` in `dir`; removes leftover temporary files; sets aside anything else
/// unreadable. Returns (path, file name, contents).
fn read_dir_records(
    dir: &Path,
    aside: &mut Vec<SetAside>,
) -> Result<Vec<(PathBuf, String, Vec<u8>)>, RecordError> {
    let mut out = Vec::new();
    for entry in fs::read_dir(dir).map_err(io("read dir", dir))? {
        let entry = entry.map_err(io("read dir", dir))?;
        let path = entry.path();
        let Some(name) = entry.file_name().to_str().map(str::to_string) else {
            continue;
        };
        if name.starts_with('.') && name.ends_with(".tmp") {
            // A write that never reached its rename: the record it was replacing still holds.
            fs::remove_file(&path).map_err(io("remove temporary record", &path))?;
            continue;
        }
        if let Some(stem) = name.strip_suffix(".json.corrupt") {
            // Set aside at an earlier start: its data stays protected.
            aside.push(SetAside {
                id: Some(stem.to_string()),
                path,
                reason: "set aside at an earlier start".into(),
            });
            continue;
        }
        if !name.ends_with(".json") {
            continue;
        }
        match fs::read(&path) {
            Ok(data) => out.push((path, name, data)),
            Err(e) => aside.push(SetAside {
                id: None,
                path,
                reason: e.to_string(),
            }),
        }
    }
    out.sort_by(|a, b| a.1.cmp(&b.1));
    Ok(out)
}

fn set_aside(path: &Path, id: Option<String>, reason: String, aside: &mut Vec<SetAside>) {
    let mut target = path.as_os_str().to_owned();
    target.push(".corrupt");
    let target = PathBuf::from(target);
    let path = match fs::rename(path, &target) {
        Ok(()) => target,
        Err(_) => path.to_path_buf(),
    };
    aside.push(SetAside { id, path, reason });
}

/// fsyncs a directory, making renames and unlinks in it durable.
pub fn sync_dir(dir: &Path) -> std::io::Result<()> {
    File::open(dir)?.sync_all()
}

/// Writes `name` in `dir` atomically and durably.
pub fn write_atomic(dir: &Path, name: &str, data: &[u8]) -> Result<(), RecordError> {
    let tmp = dir.join(format!(".{name}.tmp"));
    let target = dir.join(name);
    let result = (|| {
        let mut f = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)
            .map_err(io("create", &tmp))?;
        f.write_all(data).map_err(io("write", &tmp))?;
        f.sync_all().map_err(io("fsync", &tmp))?;
        fs::rename(&tmp, &target).map_err(io("rename", &target))?;
        sync_dir(dir).map_err(io("fsync dir", dir))
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

/// Removes `name` from `dir` durably; absent is success.
pub fn remove_durable(dir: &Path, name: &str) -> Result<(), RecordError> {
    let path = dir.join(name);
    match fs::remove_file(&path) {
        Ok(()) => sync_dir(dir).map_err(io("fsync dir", dir)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(io("remove", &path)(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::embedded::testdir::TestDir;

    fn volume(id: &str) -> VolumeRecord {
        VolumeRecord {
            version: FORMAT_VERSION,
            id: id.into(),
            name: format!("name-{id}"),
            capacity_bytes: 1 << 20,
            created_bytes: 1 << 20,
            parameters: Parameters::new(),
            context: Parameters::new(),
            source: Some(ContentSource::Snapshot("snap-0000000000000001".into())),
            publication: Some(Publication {
                node_id: "n1".into(),
                readonly: false,
                device: Some("/dev/loop3".into()),
            }),
            qos: Qos::default(),
            keys: None,
        }
    }

    #[test]
    fn records_round_trip() {
        let dir = TestDir::new("records-round-trip");
        let (store, loaded) = RecordStore::open(dir.path()).unwrap();
        assert!(loaded.volumes.is_empty());
        let v = volume("vol-0000000000000001");
        store.put_volume(&v).unwrap();
        let (t, c) = SnapshotRecord::time_fields(SystemTime::now());
        let s = SnapshotRecord {
            version: FORMAT_VERSION,
            id: "snap-0000000000000001".into(),
            name: "s".into(),
            source_volume_id: v.id.clone(),
            size_bytes: 5,
            created_secs: t,
            created_nanos: c,
            group_snapshot_id: None,
            encryption: Parameters::new(),
        };
        store.put_snapshot(&s).unwrap();
        let (_, loaded) = RecordStore::open(dir.path()).unwrap();
        assert_eq!(loaded.volumes.get(&v.id), Some(&v));
        assert_eq!(loaded.snapshots.get(&s.id), Some(&s));
        store
            .remove_volume(&VolumeId::parse(&v.id).unwrap())
            .unwrap();
        store
            .remove_volume(&VolumeId::parse(&v.id).unwrap())
            .unwrap();
        let (_, loaded) = RecordStore::open(dir.path()).unwrap();
        assert!(loaded.volumes.is_empty());
    }

    #[test]
    fn torn_and_foreign_records_are_set_aside() {
        let dir = TestDir::new("records-corrupt");
        let (store, _) = RecordStore::open(dir.path()).unwrap();
        store.put_volume(&volume("vol-0000000000000002")).unwrap();
        let vols = dir.path().join("volumes");
        fs::write(vols.join("vol-0000000000000003.json"), b"{ torn").unwrap();
        // A record whose content names another id than its file.
        let mut other = volume("vol-0000000000000005");
        other.id = "vol-0000000000000006".into();
        fs::write(
            vols.join("vol-0000000000000005.json"),
            serde_json::to_vec(&other).unwrap(),
        )
        .unwrap();
        fs::write(vols.join(".vol-0000000000000004.json.tmp"), b"partial").unwrap();
        let (_, loaded) = RecordStore::open(dir.path()).unwrap();
        assert_eq!(loaded.volumes.len(), 1);
        let mut ids: Vec<_> = loaded
            .set_aside
            .iter()
            .filter_map(|a| a.id.clone())
            .collect();
        ids.sort();
        assert_eq!(ids, ["vol-0000000000000003", "vol-0000000000000005"]);
        assert!(vols.join("vol-0000000000000003.json.corrupt").exists());
        assert!(!vols.join(".vol-0000000000000004.json.tmp").exists());
    }

    /// Issue 38, point 9 (a downgrade): a data dir a newer moor-controller wrote (a record of
    /// a newer format) is refused before anything in it changes: no record set aside, no
    /// leftover temp file removed, and the error says why.
    #[test]
    fn a_newer_record_refuses_the_store_before_anything_changes() {
        let dir = TestDir::new("records-newer");
        let (store, _) = RecordStore::open(dir.path()).unwrap();
        store.put_volume(&volume("vol-0000000000000002")).unwrap();
        let snaps = dir.path().join("snapshots");
        let mut newer = serde_json::to_value(volume("vol-0000000000000007")).unwrap();
        newer["version"] = (FORMAT_VERSION + 1).into();
        newer["placement"] = "elsewhere".into();
        let newer = serde_json::to_vec(&newer).unwrap();
        let vols = dir.path().join("volumes");
        fs::write(vols.join("vol-0000000000000007.json"), &newer).unwrap();
        fs::write(vols.join("vol-0000000000000003.json"), b"{ torn").unwrap();
        fs::write(snaps.join(".snap-0000000000000004.json.tmp"), b"partial").unwrap();
        let before = |d: &Path| {
            let mut names: Vec<_> = fs::read_dir(d)
                .unwrap()
                .map(|e| e.unwrap().file_name())
                .collect();
            names.sort();
            names
        };
        let (vols_before, snaps_before) = (before(&vols), before(&snaps));
        match RecordStore::open(dir.path()) {
            Err(e @ RecordError::Newer { .. }) => {
                let said = e.to_string();
                assert!(
                    said.contains("vol-0000000000000007.json")
                        && said.contains(&format!("version {}", FORMAT_VERSION + 1))
                        && said.contains("changed nothing"),
                    "{said}"
                );
            }
            other => panic!(
                "opened a newer data dir: {:?}",
                other.map(|(_, l)| l.volumes)
            ),
        }
        assert_eq!(before(&vols), vols_before);
        assert_eq!(before(&snaps), snaps_before);
        assert_eq!(
            fs::read(vols.join("vol-0000000000000007.json")).unwrap(),
            newer
        );
    }

    /// The records the last release's moor-controller wrote: commit 10525bb (the last landed
    /// main, taken as the last release, moor having no tags), made by running that commit's
    /// daemons and moorctl with `node/src/journal/fixtures/make.sh` (which says how): three
    /// volumes attached to a node (ext4, a raw block volume, xfs) and a snapshot of the first.
    const RELEASE_10525BB: [(&str, &str); 4] = [
        (
            "volumes/vol-0303446ecad272c8.json",
            include_str!("fixtures/10525bb/volumes/vol-0303446ecad272c8.json"),
        ),
        (
            "volumes/vol-9064927857a2428d.json",
            include_str!("fixtures/10525bb/volumes/vol-9064927857a2428d.json"),
        ),
        (
            "volumes/vol-c8bac33f6c6a4a72.json",
            include_str!("fixtures/10525bb/volumes/vol-c8bac33f6c6a4a72.json"),
        ),
        (
            "snapshots/snap-c229c6394dee935a.json",
            include_str!("fixtures/10525bb/snapshots/snap-c229c6394dee935a.json"),
        ),
    ];

    /// Issue 38, point 9, an upgrade from the last release: its records read with every
    /// volume and snapshot intact (each attachment with its device), none set aside, and what
    /// this code writes of them is byte for byte what the release wrote (so the release reads
    /// it back: a downgrade reads it).
    #[test]
    fn the_records_of_the_last_release_are_read_with_every_volume_intact() {
        let dir = TestDir::new("records-release");
        for sub in ["volumes", "snapshots"] {
            fs::create_dir_all(dir.path().join(sub)).unwrap();
        }
        for (name, text) in RELEASE_10525BB {
            fs::write(dir.path().join(name), text).unwrap();
        }
        let (store, loaded) = RecordStore::open(dir.path()).unwrap();
        assert!(loaded.set_aside.is_empty(), "{:?}", loaded.set_aside);
        let attached: Vec<_> = loaded
            .volumes
            .values()
            .map(|v| {
                let p = v.publication.as_ref().expect("attached");
                (
                    v.name.as_str(),
                    v.capacity_bytes,
                    p.node_id.as_str(),
                    p.readonly,
                    p.device.as_deref(),
                )
            })
            .collect();
        assert_eq!(
            attached,
            [
                ("vol-b", 32_505_856, "node-1", false, Some("/dev/loop1")),
                ("vol-c", 320_864_256, "node-1", false, Some("/dev/loop2")),
                ("vol-a", 65_011_712, "node-1", false, Some("/dev/loop0")),
            ]
        );
        let snap = &loaded.snapshots["snap-c229c6394dee935a"];
        assert_eq!(
            (snap.source_volume_id.as_str(), snap.size_bytes),
            ("vol-c8bac33f6c6a4a72", 65_011_712)
        );
        // Written again by this code: the same bytes.
        for v in loaded.volumes.values() {
            store.put_volume(v).unwrap();
        }
        store.put_snapshot(snap).unwrap();
        for (name, text) in RELEASE_10525BB {
            assert_eq!(
                fs::read_to_string(dir.path().join(name)).unwrap(),
                text,
                "{name}"
            );
        }
    }
}
