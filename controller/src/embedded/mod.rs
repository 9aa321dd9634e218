//! The embedded default backend: volumes are sparse files under a data dir, attached to this
//! host as loop devices (the stand-in for a cloud attach), with snapshots and clones copied
//! sparsely or reflinked, and records that survive a crash.
//!
//! Layout of the data dir:
//!
//! ```text
//! volumes/<vol-id>.img            the volumes' data (sparse files)
//! snapshots/<snap-id>.img         the snapshots' data
//! records/volumes/<vol-id>.json   one record per volume (name, size, parameters, publication)
//! records/snapshots/<snap-id>.json
//! tmp/                            data being copied; emptied at start
//! lock                            flock'ed while a backend has the dir open
//! ```
//!
//! Ordering makes every crash recoverable ([`reconcile`] finishes the job at start): data is
//! written in `tmp/`, fsynced and renamed into place before its record is written, so a data
//! file without a record is an orphan to remove; a record is removed before its data; a publish
//! records its intent before attaching, so a device attached by a process that died before
//! recording it is adopted; an unpublish detaches before it records, so a record naming a
//! device that is gone is corrected.

pub mod attach;
pub mod copy;
pub mod fake;
pub mod ids;
pub mod reconcile;
pub mod records;
#[cfg(test)]
pub(crate) mod testdir;
#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, BTreeSet};
use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::SystemTime;

use moor_node::mount_options::Filesystem;
use tracing::{info, warn};

use self::attach::{AttachError, Attacher, Detach, FileId};
use self::copy::CopyError;
use self::ids::{RandomError, SnapshotId, VolumeId};
use self::records::{Publication, RecordError, RecordStore, SnapshotRecord, VolumeRecord};
use crate::backend::{
    self, Backend, Capability, Capacity, CapacityQuery, ContentSource, ExpandRequest, NewSnapshot,
    NewVolume, Page, PageRequest, Parameters, PublishContext, PublishRequest, Segment, SizePolicy,
    Snapshot, SnapshotFilter, Volume, VolumeCondition, VolumeStatus,
};
use crate::error::{Error, Result, trunc};
use crate::inflight::InFlight;

/// publish_context key: the block device the volume is attached as, e.g. `/dev/loop7`.
pub const DEVICE_PATH_KEY: &str = "devicePath";
/// publish_context key: the absolute path of the volume's backing file, which the node checks
/// against `/sys/block/loopN/loop/backing_file` before using the device.
pub const BACKING_FILE_KEY: &str = "backingFile";
/// Parameter (and volume context key) naming the filesystem the volume is meant for.
pub const FS_TYPE_KEY: &str = "fsType";
/// The standard Kubernetes spelling of [`FS_TYPE_KEY`].
pub const K8S_FS_TYPE_KEY: &str = "csi.storage.k8s.io/fstype";
/// Parameters with this prefix are the CO's own (e.g. PVC name and namespace): ignored.
pub const K8S_PREFIX: &str = "csi.storage.k8s.io/";

/// 1 MiB: volumes are multiples of it.
pub const GRANULARITY: u64 = 1 << 20;
/// 1 GiB: the size of a volume whose request gives none.
pub const DEFAULT_SIZE: u64 = 1 << 30;
/// The largest volume (the filesystem holding the data dir may allow less: then OUT_OF_RANGE).
pub const MAX_SIZE: u64 = 1 << 60;

const POLICY: SizePolicy = SizePolicy {
    default: DEFAULT_SIZE,
    granularity: GRANULARITY,
    max: MAX_SIZE,
};

/// What the backend needs to know.
#[derive(Debug, Clone)]
pub struct Config {
    /// Where volumes, snapshots and records live (created if missing).
    pub data_dir: PathBuf,
    /// The node this backend attaches volumes to (this host).
    pub node_id: String,
    /// The topology key of the node segment, e.g. `topology.moor.csi.io/node`.
    pub topology_key: String,
}

/// Paths inside the data dir.
#[derive(Debug, Clone)]
pub struct Layout {
    /// The data dir (canonical).
    pub root: PathBuf,
    /// Volume data.
    pub volumes: PathBuf,
    /// Snapshot data.
    pub snapshots: PathBuf,
    /// Records.
    pub records: PathBuf,
    /// Copies in progress.
    pub tmp: PathBuf,
}

impl Layout {
    fn new(root: PathBuf) -> Self {
        Self {
            volumes: root.join("volumes"),
            snapshots: root.join("snapshots"),
            records: root.join("records"),
            tmp: root.join("tmp"),
            root,
        }
    }

    /// The data file of a volume.
    pub fn volume_file(&self, id: &VolumeId) -> PathBuf {
        self.volumes.join(id.data_file())
    }

    /// The data file of a snapshot.
    pub fn snapshot_file(&self, id: &SnapshotId) -> PathBuf {
        self.snapshots.join(id.data_file())
    }
}

impl From<RecordError> for Error {
    fn from(e: RecordError) -> Self {
        Error::backend("record", e)
    }
}

impl From<AttachError> for Error {
    fn from(e: AttachError) -> Self {
        match e {
            AttachError::NoFreeDevice(_) => Error::TooManyAttachments(e.to_string()),
            AttachError::Busy(_) => Error::Unavailable(e.to_string()),
            e => Error::backend("loop device", e),
        }
    }
}

impl From<CopyError> for Error {
    fn from(e: CopyError) -> Self {
        if e.is_no_space() {
            Error::NoSpace(e.to_string())
        } else {
            Error::backend("copy", e)
        }
    }
}

impl From<RandomError> for Error {
    fn from(e: RandomError) -> Self {
        Error::backend("generate id", e)
    }
}

/// Maps a failure to size a file: too big for the filesystem is OUT_OF_RANGE, no space is
/// RESOURCE_EXHAUSTED.
fn size_error(path: &Path, size: u64, e: io::Error) -> Error {
    match rustix::io::Errno::from_io_error(&e) {
        Some(rustix::io::Errno::FBIG | rustix::io::Errno::INVAL) => Error::OutOfRange(format!(
            "{size} bytes is more than the data dir's filesystem allows in one file"
        )),
        Some(rustix::io::Errno::NOSPC | rustix::io::Errno::DQUOT) => {
            Error::NoSpace(format!("{}: {e}", path.display()))
        }
        _ => Error::io("size", path, e),
    }
}

fn volume_key(id: &VolumeId) -> String {
    format!("volume:{id}")
}

fn snapshot_key(id: &SnapshotId) -> String {
    format!("snapshot:{id}")
}

/// In-memory mirror of the records.
#[derive(Debug, Default)]
struct State {
    volumes: BTreeMap<String, VolumeRecord>,
    snapshots: BTreeMap<String, SnapshotRecord>,
    /// Ids whose record was set aside: their data is never treated as an orphan.
    protected: BTreeSet<String>,
}

/// A file in `tmp/` removed on drop unless kept.
struct TempFile {
    path: PathBuf,
    keep: bool,
}

impl Drop for TempFile {
    fn drop(&mut self) {
        if !self.keep {
            let _ = fs::remove_file(&self.path);
        }
    }
}

/// A content source, resolved.
struct Source {
    path: PathBuf,
    size: u64,
    /// The device the source volume is attached as, to flush first.
    device: Option<PathBuf>,
}

/// The embedded backend.
#[derive(Debug)]
pub struct EmbeddedBackend<A: Attacher> {
    node_id: String,
    segment: Segment,
    layout: Layout,
    attacher: A,
    store: RecordStore,
    state: Mutex<State>,
    inflight: InFlight,
    /// Held (flock'ed) while the backend is open: one backend per data dir.
    _lock: File,
}

impl<A: Attacher> EmbeddedBackend<A> {
    /// Opens the data dir (creating it), reads the records and reconciles them with the loop
    /// devices on this host (see [`reconcile`]). Refuses a data dir another backend holds.
    pub fn open(cfg: Config, attacher: A) -> Result<(Self, reconcile::Report)> {
        if cfg.node_id.is_empty() {
            return Err(Error::invalid("node_id", "must be set"));
        }
        std::os::unix::fs::DirBuilderExt::mode(fs::DirBuilder::new().recursive(true), 0o700)
            .create(&cfg.data_dir)
            .map_err(|e| Error::io("create data dir", &cfg.data_dir, e))?;
        crate::backend::check_data_dir(&cfg.data_dir)?;
        let root = fs::canonicalize(&cfg.data_dir)
            .map_err(|e| Error::io("resolve data dir", &cfg.data_dir, e))?;
        let layout = Layout::new(root);
        for dir in [&layout.volumes, &layout.snapshots, &layout.tmp] {
            fs::create_dir_all(dir).map_err(|e| Error::io("create dir", dir, e))?;
        }
        let lock_path = layout.root.join("lock");
        let lock = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .open(&lock_path)
            .map_err(|e| Error::io("open", &lock_path, e))?;
        rustix::fs::flock(&lock, rustix::fs::FlockOperation::NonBlockingLockExclusive).map_err(
            |e| {
                Error::Unavailable(format!(
                    "data dir {} is in use by another moor-controller ({e})",
                    layout.root.display()
                ))
            },
        )?;
        let (store, mut loaded) = RecordStore::open(&layout.records)?;
        let mut report = reconcile::Report::default();
        reconcile::run(&layout, &store, &attacher, &mut loaded, &mut report)?;
        let state = State {
            volumes: loaded.volumes,
            snapshots: loaded.snapshots,
            protected: loaded
                .set_aside
                .iter()
                .filter_map(|a| a.id.clone())
                .collect(),
        };
        report.set_aside = loaded.set_aside;
        let segment = Segment::from([(
            cfg.topology_key,
            moor_node::limits::topology_value(&cfg.node_id),
        )]);
        Ok((
            Self {
                node_id: cfg.node_id,
                segment,
                layout,
                attacher,
                store,
                state: Mutex::new(state),
                inflight: InFlight::new(),
                _lock: lock,
            },
            report,
        ))
    }

    /// The data dir's layout.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// The attacher.
    pub fn attacher(&self) -> &A {
        &self.attacher
    }

    /// The node this backend attaches to.
    pub fn node_id(&self) -> &str {
        &self.node_id
    }

    /// The one topology segment every volume is accessible from.
    pub fn segment(&self) -> &Segment {
        &self.segment
    }

    fn state(&self) -> MutexGuard<'_, State> {
        // Records are only inserted or removed whole, so a panic elsewhere cannot leave the
        // map half-updated.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn volume_record(&self, id: &VolumeId) -> Option<VolumeRecord> {
        self.state().volumes.get(id.as_str()).cloned()
    }

    /// Writes a volume record and mirrors it in memory.
    fn save_volume(&self, rec: &VolumeRecord) -> Result<()> {
        self.store.put_volume(rec)?;
        self.state().volumes.insert(rec.id.clone(), rec.clone());
        Ok(())
    }

    fn volume_of(&self, rec: &VolumeRecord) -> Volume {
        Volume {
            id: rec.id.clone(),
            name: rec.name.clone(),
            capacity_bytes: rec.capacity_bytes,
            parameters: rec.parameters.clone(),
            context: rec.context.clone(),
            source: rec.source.clone(),
            topology: vec![self.segment.clone()],
        }
    }

    fn snapshot_of(rec: &SnapshotRecord) -> Snapshot {
        Snapshot {
            id: rec.id.clone(),
            name: rec.name.clone(),
            source_volume_id: rec.source_volume_id.clone(),
            size_bytes: rec.size_bytes,
            created_at: rec.created_at(),
            ready_to_use: true,
        }
    }

    /// The volume's health: its data file is there and, when published, its device still
    /// backs that file.
    fn condition_of(&self, id: &VolumeId, rec: &VolumeRecord) -> VolumeCondition {
        let path = self.layout.volume_file(id);
        let abnormal = |message: String| VolumeCondition {
            abnormal: true,
            message,
        };
        let file = match FileId::of_path(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return abnormal(format!("backing file {} is missing", path.display()));
            }
            Err(e) => return abnormal(format!("backing file {}: {e}", path.display())),
        };
        if let Some(Publication {
            device: Some(dev), ..
        }) = &rec.publication
        {
            match self.attacher.backing_of(Path::new(dev)) {
                Ok(None) => return abnormal(format!("loop device {dev} is gone")),
                Ok(Some(f)) if f != file => {
                    return abnormal(format!("loop device {dev} is bound to another file"));
                }
                Ok(Some(_)) => {}
                Err(e) => return abnormal(format!("loop device {dev}: {e}")),
            }
        }
        VolumeCondition {
            abnormal: false,
            message: "volume is healthy".into(),
        }
    }

    fn status_of(&self, id: &VolumeId, rec: &VolumeRecord) -> VolumeStatus {
        VolumeStatus {
            volume: self.volume_of(rec),
            published_nodes: rec.publication.iter().map(|p| p.node_id.clone()).collect(),
            condition: self.condition_of(id, rec),
        }
    }

    fn new_volume_id(&self) -> Result<VolumeId> {
        for _ in 0..16 {
            let id = VolumeId::random()?;
            let taken = {
                let st = self.state();
                st.volumes.contains_key(id.as_str()) || st.protected.contains(id.as_str())
            };
            if !taken && !self.layout.volume_file(&id).exists() {
                return Ok(id);
            }
        }
        Err(Error::Internal("no unused volume id after 16 tries".into()))
    }

    fn new_snapshot_id(&self) -> Result<SnapshotId> {
        for _ in 0..16 {
            let id = SnapshotId::random()?;
            let taken = {
                let st = self.state();
                st.snapshots.contains_key(id.as_str()) || st.protected.contains(id.as_str())
            };
            if !taken && !self.layout.snapshot_file(&id).exists() {
                return Ok(id);
            }
        }
        Err(Error::Internal(
            "no unused snapshot id after 16 tries".into(),
        ))
    }

    /// Writes an attached device's cached data through to its file before the file is copied.
    fn flush_device(&self, device: &Path, file: &Path) -> Result<()> {
        let id = FileId::of_path(file).map_err(|e| Error::io("stat", file, e))?;
        match self.attacher.flush(device, id) {
            Ok(()) => Ok(()),
            // The device went away: nothing is cached for this file any more.
            Err(AttachError::NotOurs(_)) => {
                warn!(device = %device.display(), "flush: device no longer backs the volume");
                Ok(())
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Creates `tmp/<name>`, fills it (`fill`), fsyncs it and renames it to `target`.
    fn write_data_file(
        &self,
        name: &str,
        target: &Path,
        fill: impl FnOnce(&File) -> Result<()>,
    ) -> Result<()> {
        let tmp = TempFile {
            path: self.layout.tmp.join(name),
            keep: false,
        };
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp.path)
            .map_err(|e| Error::io("create", &tmp.path, e))?;
        fill(&file)?;
        file.sync_all()
            .map_err(|e| Error::io("fsync", &tmp.path, e))?;
        drop(file);
        fs::rename(&tmp.path, target).map_err(|e| Error::io("rename", target, e))?;
        let mut tmp = tmp;
        tmp.keep = true;
        let dir = target.parent().unwrap_or(&self.layout.root);
        records::sync_dir(dir).map_err(|e| Error::io("fsync dir", dir, e))
    }

    fn remove_data_file(path: &Path) -> Result<()> {
        match fs::remove_file(path) {
            Ok(()) => {
                if let Some(dir) = path.parent() {
                    records::sync_dir(dir).map_err(|e| Error::io("fsync dir", dir, e))?;
                }
                Ok(())
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(Error::io("remove", path, e)),
        }
    }

    /// Checks that a request for an existing volume of the same name asks for what it is.
    fn check_same_volume(
        &self,
        existing: &VolumeRecord,
        req: &NewVolume,
        params: &Parameters,
    ) -> Result<()> {
        let differs = |reason: String| Error::VolumeExists {
            name: req.name.clone(),
            id: existing.id.clone(),
            reason,
        };
        if &existing.parameters != params {
            return Err(differs(format!(
                "parameters differ (it was created with {:?})",
                existing.parameters
            )));
        }
        if existing.source != req.source {
            return Err(differs("volume_content_source differs".into()));
        }
        if let Some(r) = &req.capacity
            && !r.allows(existing.capacity_bytes)
            && !r.allows(existing.created_bytes)
        {
            return Err(differs(format!(
                "it holds {} bytes, outside capacity_range (required {}, limit {})",
                existing.capacity_bytes, r.required, r.limit
            )));
        }
        if let Some(acc) = &req.accessibility
            && !backend::topology_allows(acc, &self.segment)
        {
            return Err(differs(format!(
                "it is accessible from node {:?} only, which accessibility_requirements exclude",
                self.node_id
            )));
        }
        Ok(())
    }

    /// Resolves and claims (shared) a content source. Returns the claim with the source.
    fn resolve_source(&self, src: &ContentSource) -> Result<(crate::inflight::Claim<'_>, Source)> {
        match src {
            ContentSource::Snapshot(raw) => {
                let not_found = || Error::SourceNotFound {
                    kind: "snapshot",
                    id: trunc(raw).to_string(),
                };
                let id = SnapshotId::parse(raw).ok_or_else(not_found)?;
                let claim = self.inflight.claim(&[], &[&snapshot_key(&id)])?;
                let rec = self
                    .state()
                    .snapshots
                    .get(id.as_str())
                    .cloned()
                    .ok_or_else(not_found)?;
                Ok((
                    claim,
                    Source {
                        path: self.layout.snapshot_file(&id),
                        size: rec.size_bytes,
                        device: None,
                    },
                ))
            }
            ContentSource::Volume(raw) => {
                let not_found = || Error::SourceNotFound {
                    kind: "volume",
                    id: trunc(raw).to_string(),
                };
                let id = VolumeId::parse(raw).ok_or_else(not_found)?;
                let claim = self.inflight.claim(&[], &[&volume_key(&id)])?;
                let rec = self.volume_record(&id).ok_or_else(not_found)?;
                Ok((
                    claim,
                    Source {
                        path: self.layout.volume_file(&id),
                        size: rec.capacity_bytes,
                        device: rec.publication.and_then(|p| p.device).map(PathBuf::from),
                    },
                ))
            }
        }
    }

    fn publish_context(device: &str, file: &Path) -> PublishContext {
        PublishContext::from([
            (DEVICE_PATH_KEY.to_string(), device.to_string()),
            (BACKING_FILE_KEY.to_string(), file.display().to_string()),
        ])
    }

    /// Attaches the volume and records it, intent first.
    fn attach_and_record(
        &self,
        rec: &VolumeRecord,
        req: &PublishRequest,
        path: &Path,
    ) -> Result<PublishContext> {
        let mut intent = rec.clone();
        intent.publication = Some(Publication {
            node_id: req.node_id.clone(),
            readonly: req.readonly,
            device: None,
        });
        self.save_volume(&intent)?;
        let device = match self.attacher.attach(path, req.readonly) {
            Ok(d) => d,
            Err(e) => {
                if let Err(undo) = self.save_volume(rec) {
                    warn!(volume = %rec.id, error = %undo, "cannot clear the publish intent; start-up will");
                }
                return Err(e.into());
            }
        };
        let device = device.display().to_string();
        let mut done = intent;
        if let Some(p) = done.publication.as_mut() {
            p.device = Some(device.clone());
        }
        if let Err(e) = self.save_volume(&done) {
            // Without a record of it the attach would leak: undo it.
            if let Ok(id) = FileId::of_path(path) {
                let _ = self.attacher.detach(Path::new(&device), id);
            }
            if let Err(undo) = self.save_volume(rec) {
                warn!(volume = %rec.id, error = %undo, "cannot clear the publish intent; start-up will");
            }
            return Err(e);
        }
        info!(volume = %rec.id, device, node = %req.node_id, "attached");
        Ok(Self::publish_context(&device, path))
    }

    /// Detaches every device bound to the volume's file (used when the record does not say
    /// which one).
    fn detach_all(&self, path: &Path) -> Result<()> {
        let Ok(file) = FileId::of_path(path) else {
            return Ok(());
        };
        for a in self.attacher.list()? {
            if a.file == file {
                let r = self.attacher.detach(&a.device, a.file)?;
                info!(device = %a.device.display(), result = ?r, "detached");
            }
        }
        Ok(())
    }
}

/// Parses the embedded backend's creation parameters: `fsType` (or the standard
/// `csi.storage.k8s.io/fstype`) naming a filesystem the node can make; keys with the prefix
/// `csi.storage.k8s.io/` are the CO's and ignored; anything else is INVALID_ARGUMENT.
pub fn parse_parameters(raw: &Parameters) -> Result<Parameters> {
    let mut fs_type: Option<&str> = None;
    for (key, value) in raw {
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
                    "unknown key {:?}: moor takes only {FS_TYPE_KEY} (and ignores {K8S_PREFIX}*)",
                    trunc(key)
                ),
            ));
        }
    }
    Ok(fs_type
        .map(|f| Parameters::from([(FS_TYPE_KEY.to_string(), f.to_string())]))
        .unwrap_or_default())
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

impl<A: Attacher> Backend for EmbeddedBackend<A> {
    fn parse_parameters(&self, raw: &Parameters) -> Result<Parameters> {
        parse_parameters(raw)
    }

    fn check_capability(&self, cap: &Capability, parameters: &Parameters) -> Result<(), String> {
        check_capability(cap, parameters)
    }

    fn probe(&self) -> Result<()> {
        static PROBES: AtomicU64 = AtomicU64::new(0);
        let probe = self
            .layout
            .tmp
            .join(format!(".probe-{}", PROBES.fetch_add(1, Ordering::Relaxed)));
        fs::write(&probe, b"ok")
            .and_then(|()| fs::remove_file(&probe))
            .map_err(|e| {
                Error::NotReady(format!(
                    "data dir {} is not writable: {e}",
                    self.layout.root.display()
                ))
            })?;
        self.attacher
            .check()
            .map_err(|e| Error::NotReady(format!("loop devices are not usable: {e}")))
    }

    fn create_volume(&self, req: &NewVolume) -> Result<Volume> {
        let params = parse_parameters(&req.parameters)?;
        for cap in &req.capabilities {
            check_capability(cap, &params).map_err(|r| Error::invalid("volume_capabilities", r))?;
        }
        let name_key = format!("volume-name:{}", req.name);
        let _claim = self.inflight.claim(&[&name_key], &[])?;
        let existing = self
            .state()
            .volumes
            .values()
            .find(|v| v.name == req.name)
            .cloned();
        if let Some(existing) = existing {
            self.check_same_volume(&existing, req, &params)?;
            return Ok(self.volume_of(&existing));
        }
        if let Some(acc) = &req.accessibility
            && !backend::topology_allows(acc, &self.segment)
        {
            return Err(Error::TopologyUnsatisfiable(format!(
                "volumes are accessible from {:?} only, and no requisite topology includes it",
                self.segment
            )));
        }
        let (_source_claim, source) = match &req.source {
            Some(src) => {
                let (c, s) = self.resolve_source(src)?;
                (Some(c), Some(s))
            }
            None => (None, None),
        };
        let floor = source.as_ref().map_or(0, |s| s.size);
        let size = backend::choose_size(req.capacity.as_ref(), &POLICY, floor)?;
        let id = self.new_volume_id()?;
        let target = self.layout.volume_file(&id);
        self.write_data_file(&id.data_file(), &target, |file| match &source {
            None => file.set_len(size).map_err(|e| size_error(&target, size, e)),
            Some(src) => {
                if let Some(dev) = &src.device {
                    self.flush_device(dev, &src.path)?;
                }
                let from =
                    File::open(&src.path).map_err(|e| Error::io("open source", &src.path, e))?;
                let method = copy::copy_sparse(&from, file, size)?;
                info!(volume = %id, source = %src.path.display(), ?method, "copied");
                Ok(())
            }
        })?;
        let rec = VolumeRecord {
            version: records::FORMAT_VERSION,
            id: id.to_string(),
            name: req.name.clone(),
            capacity_bytes: size,
            created_bytes: size,
            parameters: params.clone(),
            context: params,
            source: req.source.clone(),
            publication: None,
        };
        if let Err(e) = self.save_volume(&rec) {
            let _ = Self::remove_data_file(&target);
            return Err(e);
        }
        info!(volume = %id, name = %req.name, size, "created");
        Ok(self.volume_of(&rec))
    }

    fn delete_volume(&self, volume_id: &str) -> Result<()> {
        let Some(id) = VolumeId::parse(volume_id) else {
            return Ok(());
        };
        let _claim = self.inflight.claim(&[&volume_key(&id)], &[])?;
        let rec = self.volume_record(&id);
        if let Some(p) = rec.as_ref().and_then(|r| r.publication.as_ref()) {
            return Err(Error::VolumeInUse {
                volume: id.to_string(),
                reason: format!(
                    "it is published at node {:?}{}; ControllerUnpublishVolume it first",
                    p.node_id,
                    p.device
                        .as_ref()
                        .map(|d| format!(" as {d}"))
                        .unwrap_or_default()
                ),
            });
        }
        let path = self.layout.volume_file(&id);
        if let Ok(file) = FileId::of_path(&path)
            && let Some(a) = self.attacher.list()?.into_iter().find(|a| a.file == file)
        {
            return Err(Error::VolumeInUse {
                volume: id.to_string(),
                reason: format!(
                    "loop device {} is still bound to it (held open by someone)",
                    a.device.display()
                ),
            });
        }
        if rec.is_some() {
            self.store.remove_volume(&id)?;
            self.state().volumes.remove(id.as_str());
        }
        self.state().protected.remove(id.as_str());
        Self::remove_data_file(&path)?;
        info!(volume = %id, "deleted");
        Ok(())
    }

    fn publish_volume(&self, req: &PublishRequest) -> Result<PublishContext> {
        let not_found = || Error::VolumeNotFound(trunc(&req.volume_id).to_string());
        let id = VolumeId::parse(&req.volume_id).ok_or_else(not_found)?;
        if req.node_id != self.node_id {
            return Err(Error::NodeNotFound {
                node: trunc(&req.node_id).to_string(),
                serves: self.node_id.clone(),
            });
        }
        let _claim = self.inflight.claim(&[&volume_key(&id)], &[])?;
        let rec = self.volume_record(&id).ok_or_else(not_found)?;
        check_capability(&req.capability, &rec.parameters)
            .map_err(|r| Error::invalid("volume_capability", r))?;
        for (k, v) in &req.context {
            if rec.context.get(k).is_some_and(|mine| mine != v) {
                return Err(Error::invalid(
                    "volume_context",
                    format!("{k:?} does not match the volume's context"),
                ));
            }
        }
        let path = self.layout.volume_file(&id);
        let file = FileId::of_path(&path).map_err(|e| Error::io("stat backing file", &path, e))?;
        if let Some(p) = &rec.publication {
            if p.node_id != req.node_id {
                return Err(Error::PublishedElsewhere {
                    volume: id.to_string(),
                    node: p.node_id.clone(),
                });
            }
            if p.readonly != req.readonly {
                return Err(Error::PublishedIncompatible {
                    volume: id.to_string(),
                    node: p.node_id.clone(),
                    reason: format!("it is published with readonly={}", p.readonly),
                });
            }
            if let Some(dev) = &p.device {
                if self.attacher.backing_of(Path::new(dev))? == Some(file) {
                    return Ok(Self::publish_context(dev, &path));
                }
                warn!(volume = %id, device = %dev, "recorded device no longer backs the volume; attaching again");
            }
            let mut cleared = rec.clone();
            cleared.publication = None;
            return self.attach_and_record(&cleared, req, &path);
        }
        self.attach_and_record(&rec, req, &path)
    }

    fn unpublish_volume(&self, volume_id: &str, node_id: Option<&str>) -> Result<()> {
        let Some(id) = VolumeId::parse(volume_id) else {
            return Ok(());
        };
        let _claim = self.inflight.claim(&[&volume_key(&id)], &[])?;
        let Some(rec) = self.volume_record(&id) else {
            return Ok(());
        };
        let Some(p) = &rec.publication else {
            return Ok(());
        };
        if node_id.is_some_and(|n| n != p.node_id) {
            return Ok(());
        }
        let path = self.layout.volume_file(&id);
        match (&p.device, FileId::of_path(&path)) {
            (Some(dev), Ok(file)) => {
                let r = self.attacher.detach(Path::new(dev), file)?;
                match r {
                    Detach::Done | Detach::AlreadyGone => {}
                    Detach::Deferred => warn!(
                        volume = %id, device = %dev,
                        "device still open elsewhere; the kernel detaches it on last close"
                    ),
                    Detach::NotOurs => warn!(
                        volume = %id, device = %dev,
                        "device now backs another file; left alone"
                    ),
                }
                info!(volume = %id, device = %dev, result = ?r, "detached");
            }
            (None, Ok(_)) => self.detach_all(&path)?,
            (_, Err(e)) => {
                warn!(volume = %id, error = %e, "backing file missing; nothing to detach")
            }
        }
        let mut done = rec.clone();
        done.publication = None;
        self.save_volume(&done)
    }

    fn get_volume(&self, volume_id: &str) -> Result<VolumeStatus> {
        let not_found = || Error::VolumeNotFound(trunc(volume_id).to_string());
        let id = VolumeId::parse(volume_id).ok_or_else(not_found)?;
        let rec = self.volume_record(&id).ok_or_else(not_found)?;
        Ok(self.status_of(&id, &rec))
    }

    fn list_volumes(&self, page: &PageRequest) -> Result<Page<VolumeStatus>> {
        if let Some(t) = &page.starting_token
            && VolumeId::parse(t).is_none()
        {
            return Err(Error::InvalidToken {
                token: trunc(t).to_string(),
                reason: "not a token this controller hands out".into(),
            });
        }
        let page = {
            let st = self.state();
            backend::page_after(
                &st.volumes,
                page.starting_token.as_deref(),
                page.max_entries,
            )
        };
        let entries = page
            .entries
            .iter()
            .filter_map(|rec| VolumeId::parse(&rec.id).map(|id| self.status_of(&id, rec)))
            .collect();
        Ok(Page {
            entries,
            next_token: page.next_token,
        })
    }

    fn capacity(&self, query: &CapacityQuery) -> Result<Capacity> {
        if let Some(t) = &query.topology
            && !backend::segment_within(t, &self.segment)
        {
            return Ok(Capacity::default());
        }
        let st = rustix::fs::statvfs(&self.layout.root)
            .map_err(|e| Error::io("statvfs", &self.layout.root, e.into()))?;
        Ok(Capacity {
            available: st.f_bavail.saturating_mul(st.f_frsize),
            // choose_size's bounds under POLICY: sizes round up to GRANULARITY, so a limit_bytes
            // below it fits no volume, and nothing above MAX_SIZE is made. A topology this
            // backend does not serve returns early above with neither set, as no size fits.
            maximum_volume_size: Some(POLICY.max),
            minimum_volume_size: Some(POLICY.granularity),
        })
    }

    fn expand_volume(&self, req: &ExpandRequest) -> Result<u64> {
        let not_found = || Error::VolumeNotFound(trunc(&req.volume_id).to_string());
        let id = VolumeId::parse(&req.volume_id).ok_or_else(not_found)?;
        let _claim = self.inflight.claim(&[&volume_key(&id)], &[])?;
        let rec = self.volume_record(&id).ok_or_else(not_found)?;
        if let Some(cap) = &req.capability {
            check_capability(cap, &rec.parameters)
                .map_err(|r| Error::invalid("volume_capability", r))?;
        }
        let r = req.capacity;
        if r.limit > 0 && r.required > r.limit {
            return Err(Error::OutOfRange(format!(
                "required_bytes {} is larger than limit_bytes {}",
                r.required, r.limit
            )));
        }
        let path = self.layout.volume_file(&id);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .map_err(|e| Error::io("open", &path, e))?;
        let current = file
            .metadata()
            .map_err(|e| Error::io("stat", &path, e))?
            .len();
        let size = if r.required <= current {
            if r.limit > 0 && current > r.limit {
                return Err(Error::OutOfRange(format!(
                    "the volume holds {current} bytes, more than limit_bytes {}; volumes never shrink",
                    r.limit
                )));
            }
            current
        } else {
            let size = backend::choose_size(
                Some(&r),
                &SizePolicy {
                    default: current,
                    ..POLICY
                },
                current,
            )?;
            file.set_len(size).map_err(|e| size_error(&path, size, e))?;
            file.sync_all().map_err(|e| Error::io("fsync", &path, e))?;
            size
        };
        if let Some(Publication {
            device: Some(dev), ..
        }) = &rec.publication
        {
            let fid = FileId::of(&file).map_err(|e| Error::io("stat", &path, e))?;
            match self.attacher.refresh_size(Path::new(dev), fid) {
                Ok(()) => {}
                Err(AttachError::NotOurs(_)) => {
                    warn!(volume = %id, device = %dev, "device no longer backs the volume; not resized");
                }
                Err(e) => return Err(e.into()),
            }
        }
        if rec.capacity_bytes != size {
            let mut grown = rec.clone();
            grown.capacity_bytes = size;
            self.save_volume(&grown)?;
            info!(volume = %id, from = rec.capacity_bytes, to = size, "expanded");
        }
        Ok(size)
    }

    fn create_snapshot(&self, req: &NewSnapshot) -> Result<Snapshot> {
        if let Some(key) = req.parameters.keys().find(|k| !k.starts_with(K8S_PREFIX)) {
            return Err(Error::invalid(
                "parameters",
                format!(
                    "unknown key {:?}: moor takes no snapshot parameters",
                    trunc(key)
                ),
            ));
        }
        let name_key = format!("snapshot-name:{}", req.name);
        let _claim = self.inflight.claim(&[&name_key], &[])?;
        let existing = self
            .state()
            .snapshots
            .values()
            .find(|s| s.name == req.name)
            .cloned();
        if let Some(existing) = existing {
            if existing.source_volume_id != req.source_volume_id {
                return Err(Error::SnapshotExists {
                    name: req.name.clone(),
                    id: existing.id.clone(),
                    reason: format!("it was cut from volume {}", existing.source_volume_id),
                });
            }
            return Ok(Self::snapshot_of(&existing));
        }
        let not_found = || Error::VolumeNotFound(trunc(&req.source_volume_id).to_string());
        let vid = VolumeId::parse(&req.source_volume_id).ok_or_else(not_found)?;
        let _source = self.inflight.claim(&[], &[&volume_key(&vid)])?;
        let vrec = self.volume_record(&vid).ok_or_else(not_found)?;
        let src_path = self.layout.volume_file(&vid);
        if let Some(dev) = vrec.publication.as_ref().and_then(|p| p.device.as_ref()) {
            self.flush_device(Path::new(dev), &src_path)?;
        }
        let src = File::open(&src_path).map_err(|e| Error::io("open", &src_path, e))?;
        let size = src
            .metadata()
            .map_err(|e| Error::io("stat", &src_path, e))?
            .len();
        let sid = self.new_snapshot_id()?;
        let target = self.layout.snapshot_file(&sid);
        let created = SystemTime::now();
        self.write_data_file(&sid.data_file(), &target, |dst| {
            let method = copy::copy_sparse(&src, dst, size)?;
            info!(snapshot = %sid, volume = %vid, ?method, "copied");
            Ok(())
        })?;
        let (created_secs, created_nanos) = SnapshotRecord::time_fields(created);
        let rec = SnapshotRecord {
            version: records::FORMAT_VERSION,
            id: sid.to_string(),
            name: req.name.clone(),
            source_volume_id: vid.to_string(),
            size_bytes: size,
            created_secs,
            created_nanos,
        };
        if let Err(e) = self.store.put_snapshot(&rec) {
            let _ = Self::remove_data_file(&target);
            return Err(e.into());
        }
        self.state().snapshots.insert(rec.id.clone(), rec.clone());
        info!(snapshot = %sid, volume = %vid, size, "snapshot cut");
        Ok(Self::snapshot_of(&rec))
    }

    fn delete_snapshot(&self, snapshot_id: &str) -> Result<()> {
        let Some(id) = SnapshotId::parse(snapshot_id) else {
            return Ok(());
        };
        let _claim = self.inflight.claim(&[&snapshot_key(&id)], &[])?;
        let known = self.state().snapshots.contains_key(id.as_str());
        if known {
            self.store.remove_snapshot(&id)?;
            self.state().snapshots.remove(id.as_str());
        }
        self.state().protected.remove(id.as_str());
        Self::remove_data_file(&self.layout.snapshot_file(&id))?;
        if known {
            info!(snapshot = %id, "deleted");
        }
        Ok(())
    }

    fn get_snapshot(&self, snapshot_id: &str) -> Result<Snapshot> {
        let not_found = || Error::SnapshotNotFound(trunc(snapshot_id).to_string());
        let id = SnapshotId::parse(snapshot_id).ok_or_else(not_found)?;
        let st = self.state();
        st.snapshots
            .get(id.as_str())
            .map(Self::snapshot_of)
            .ok_or_else(not_found)
    }

    fn list_snapshots(
        &self,
        filter: &SnapshotFilter,
        page: &PageRequest,
    ) -> Result<Page<Snapshot>> {
        if let Some(t) = &page.starting_token
            && SnapshotId::parse(t).is_none()
        {
            return Err(Error::InvalidToken {
                token: trunc(t).to_string(),
                reason: "not a token this controller hands out".into(),
            });
        }
        let st = self.state();
        let matching = st.snapshots.iter().filter(|(id, rec)| {
            filter.snapshot_id.as_ref().is_none_or(|s| s == *id)
                && filter
                    .source_volume_id
                    .as_ref()
                    .is_none_or(|v| *v == rec.source_volume_id)
        });
        let page = backend::page_after(matching, page.starting_token.as_deref(), page.max_entries);
        Ok(Page {
            entries: page.entries.iter().map(Self::snapshot_of).collect(),
            next_token: page.next_token,
        })
    }
}
