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
//! records/groups/<group-id>.json  one record per group snapshot (its members are snapshots)
//! records/freezing.json           filesystems a group snapshot holds frozen (module freeze)
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
pub mod freeze;
mod groups;
pub mod ids;
pub mod metadata;
mod operations;
mod parameters;
pub mod reconcile;
pub mod records;
pub mod space;
#[cfg(test)]
pub(crate) mod testdir;
#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, BTreeSet};
use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};

use moor_runtime::contract::{
    BACKING_FILE_KEY, DEVICE_PATH_KEY, ENCRYPTED_DEK_KEY, ENCRYPTED_DEK_PENDING_KEY, QOS_LIMITS_KEY,
};
use tracing::{info, warn};

use self::attach::{AttachError, Attacher, FileId};
use self::copy::CopyError;
use self::ids::{GroupId, Inward, RandomError, Scope, SnapshotId, VolumeId};
use self::records::{Publication, RecordError, RecordStore, SnapshotRecord, VolumeRecord};
use crate::backend::{
    self, ContentSource, NewVolume, Parameters, PublishContext, PublishRequest, Segment,
    SizePolicy, Snapshot, Volume, VolumeCondition, VolumeStatus,
};
use crate::error::{Error, Result, trunc};
use crate::inflight::InFlight;

pub use self::parameters::{
    PROVISIONING_KEY, THICK, THIN, check_capability, is_thick, parse_parameters,
};
pub use self::space::Overcommit;

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

/// How the backend serves its data dir (beyond where it is).
#[derive(Debug, Clone, Copy, Default)]
pub struct Policy {
    /// How far thin volumes may be overcommitted ([`space`]).
    pub overcommit: Overcommit,
    /// One controller on each node, each serving its own node's volumes: ids name their node
    /// ([`ids::Scope`]), and one that names another node is answered as such.
    pub node_local: bool,
}

/// Where an id from a request points, resolved.
enum Found<T> {
    /// One of this backend's.
    Here(T),
    /// Of the node-local form, on another node (named).
    Elsewhere(String),
    /// Not of this backend's form: nothing.
    Unknown,
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

/// INVALID_ARGUMENT for a parameter that is not the CO's own: moor takes none for `what`.
fn no_parameters(parameters: &Parameters, what: &str) -> Result<()> {
    match parameters.keys().find(|k| !k.starts_with(K8S_PREFIX)) {
        Some(key) => Err(Error::invalid(
            "parameters",
            format!(
                "unknown key {:?}: moor takes no {what} parameters",
                trunc(key)
            ),
        )),
        None => Ok(()),
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
    groups: BTreeMap<String, records::GroupRecord>,
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
    /// A thick volume: never to share an extent with the copy.
    thick: bool,
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
    policy: Policy,
    /// How ids are seen outside.
    scope: Scope,
    /// The claims admitted and not yet measurable (see [`space::Pending`]). Held while an
    /// operation checks the space it needs and takes it, so that two cannot both be admitted
    /// for the same free space; not held while a new volume's file is written and synced (its
    /// [`Reservation`] stands for it meanwhile), so creates at once do not queue on the disk.
    space_lock: Mutex<space::Pending>,
    /// Held (flock'ed) while the backend is open: one backend per data dir.
    _lock: File,
    /// Tests: run once by the next new data file's write, once its data is laid out.
    #[cfg(test)]
    write_hook: Mutex<Option<WriteHook>>,
}

/// A test's step inside a data file's write.
#[cfg(test)]
pub(crate) struct WriteHook(pub(crate) Box<dyn FnOnce() + Send>);

#[cfg(test)]
impl std::fmt::Debug for WriteHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("WriteHook")
    }
}

fn lock_pending(lock: &Mutex<space::Pending>) -> MutexGuard<'_, space::Pending> {
    // Claims are added and removed whole: a panic elsewhere cannot leave a half-counted one.
    lock.lock().unwrap_or_else(|e| e.into_inner())
}

/// A claim admitted and pending (see [`space::Pending`]) until this is dropped.
#[derive(Debug)]
struct Reservation<'a> {
    lock: &'a Mutex<space::Pending>,
    claim: space::Claim,
}

impl Reservation<'_> {
    /// Replaces the claim with `claim`, admitted against everything else (what is measured
    /// now and the others' pending claims): for an operation that knows what it takes only
    /// once it has made its file (a copy). Refused, the reservation keeps nothing.
    fn settle<A: Attacher>(
        &mut self,
        backend: &EmbeddedBackend<A>,
        claim: space::Claim,
        what: &str,
    ) -> Result<()> {
        let mut pending = lock_pending(self.lock);
        pending.remove(self.claim);
        self.claim = space::Claim::default();
        backend.admit_with(&pending, claim, what)?;
        pending.add(claim);
        self.claim = claim;
        Ok(())
    }
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        lock_pending(self.lock).remove(self.claim);
    }
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
            groups: loaded.groups,
            protected: loaded
                .set_aside
                .iter()
                .filter_map(|a| a.id.clone())
                .collect(),
        };
        report.set_aside = loaded.set_aside;
        let segment = Segment::from([(
            cfg.topology_key,
            moor_runtime::limits::topology_value(&cfg.node_id),
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
                policy: Policy::default(),
                scope: Scope::HOST,
                space_lock: Mutex::new(space::Pending::default()),
                _lock: lock,
                #[cfg(test)]
                write_hook: Mutex::new(None),
            },
            report,
        ))
    }

    /// Serves the data dir with `policy` (the default: thin volumes without limit, ids as
    /// they are).
    pub fn with_policy(mut self, policy: Policy) -> Self {
        self.policy = policy;
        self.scope = if policy.node_local {
            Scope::node(moor_runtime::limits::topology_value(&self.node_id))
        } else {
            Scope::HOST
        };
        self
    }

    /// An id as the outside sees it (see [`Scope`]).
    pub fn show(&self, bare: &str) -> String {
        self.scope.show(bare)
    }

    /// Resolves an id from a request with `parse` (the bare id's form).
    fn find<T>(&self, raw: &str, parse: impl Fn(&str) -> Option<T>) -> Found<T> {
        match self.scope.inward(raw) {
            Inward::Here(bare) => parse(bare).map_or(Found::Unknown, Found::Here),
            Inward::Elsewhere { id, node } if parse(id).is_some() => {
                Found::Elsewhere(node.to_string())
            }
            Inward::Elsewhere { .. } => Found::Unknown,
        }
    }

    fn find_volume(&self, raw: &str) -> Found<VolumeId> {
        self.find(raw, VolumeId::parse)
    }

    fn find_snapshot(&self, raw: &str) -> Found<SnapshotId> {
        self.find(raw, SnapshotId::parse)
    }

    fn find_group(&self, raw: &str) -> Found<GroupId> {
        self.find(raw, GroupId::parse)
    }

    /// NOT_FOUND for an object on another node, saying where it is.
    fn on_other_node(&self, kind: &'static str, raw: &str, node: String) -> Error {
        Error::OnOtherNode {
            kind,
            id: trunc(raw).to_string(),
            node,
            here: self.node_id.clone(),
        }
    }

    /// A volume from a request, or NOT_FOUND.
    fn volume_here(&self, raw: &str) -> Result<VolumeId> {
        match self.find_volume(raw) {
            Found::Here(id) => Ok(id),
            Found::Elsewhere(node) => Err(self.on_other_node("volume", raw, node)),
            Found::Unknown => Err(Error::VolumeNotFound(trunc(raw).to_string())),
        }
    }

    /// A snapshot from a request, or NOT_FOUND.
    fn snapshot_here(&self, raw: &str) -> Result<SnapshotId> {
        match self.find_snapshot(raw) {
            Found::Here(id) => Ok(id),
            Found::Elsewhere(node) => Err(self.on_other_node("snapshot", raw, node)),
            Found::Unknown => Err(Error::SnapshotNotFound(trunc(raw).to_string())),
        }
    }

    /// For a delete of `raw`: the bare id to delete, None when there is nothing (the spec's
    /// success), FAILED_PRECONDITION for an object on another node, which only that node's
    /// controller can delete (answering success would leave it there unseen).
    fn to_delete<T>(&self, kind: &str, raw: &str, found: Found<T>) -> Result<Option<T>> {
        match found {
            Found::Here(id) => Ok(Some(id)),
            Found::Unknown => Ok(None),
            Found::Elsewhere(node) => Err(Error::FailedPrecondition(format!(
                "{kind} {} lives on node {node:?}: only that node's controller deletes it (this \
                 one serves node {:?})",
                trunc(raw),
                self.node_id
            ))),
        }
    }

    /// The policy the data dir is served with.
    pub fn policy(&self) -> &Policy {
        &self.policy
    }

    /// The data dir's space now: its filesystem, and what the thin volumes may still claim.
    pub fn space(&self) -> Result<space::Space> {
        let pending = self.lock_space();
        self.space_with(&pending)
    }

    /// The data dir's space as measured, with the pending claims taken.
    fn space_with(&self, pending: &space::Pending) -> Result<space::Space> {
        let thin: Vec<PathBuf> = self
            .state()
            .volumes
            .values()
            .filter(|r| !is_thick(&r.parameters))
            .filter_map(|r| VolumeId::parse(&r.id))
            .map(|id| self.layout.volume_file(&id))
            .collect();
        space::measure(&self.layout.root, thin.iter().map(PathBuf::as_path))
            .map(|s| pending.apply(s))
            .map_err(|e| Error::io("measure", &self.layout.root, e))
    }

    /// The data dir's space as Prometheus gauges: its filesystem, what thin volumes may still
    /// claim, what a new volume of each kind can have now, and the volumes it holds. The
    /// filling of a node's data dir shows here before it refuses a volume.
    pub fn space_metrics(&self) -> String {
        use moor_runtime::metrics::render_gauge;
        let mut out = String::new();
        let Ok(s) = self.space() else {
            return out;
        };
        let oc = self.policy.overcommit;
        let (mut count, mut thin, mut thick) = (0u64, 0u64, 0u64);
        for r in self.state().volumes.values() {
            count += 1;
            if is_thick(&r.parameters) {
                thick = thick.saturating_add(r.capacity_bytes);
            } else {
                thin = thin.saturating_add(r.capacity_bytes);
            }
        }
        let gauges = [
            (
                "moor_data_dir_size_bytes",
                "Size of the filesystem holding the data dir.",
                s.total,
            ),
            (
                "moor_data_dir_free_bytes",
                "What the data dir's filesystem has free.",
                s.free,
            ),
            (
                "moor_thin_unbacked_bytes",
                "What thin volumes may still claim: their sizes minus what they hold.",
                s.unbacked,
            ),
            (
                "moor_thin_overcommit_milli",
                "The thin overcommit ratio in thousandths (0: no limit).",
                oc.milli().unwrap_or(0),
            ),
            (
                "moor_thick_available_bytes",
                "The largest thick volume the data dir takes now.",
                space::thick_available(&s, oc),
            ),
            (
                "moor_thin_available_bytes",
                "The largest thin volume the data dir takes now (without a ratio: what is free).",
                space::thin_available(&s, oc).unwrap_or(s.free),
            ),
            ("moor_volumes", "Volumes on record.", count),
            (
                "moor_thin_volume_bytes",
                "The sizes of the thin volumes.",
                thin,
            ),
            (
                "moor_thick_volume_bytes",
                "The sizes of the thick volumes (all of it held).",
                thick,
            ),
        ];
        for (name, help, value) in gauges {
            render_gauge(&mut out, name, help, value);
        }
        out
    }

    /// RESOURCE_EXHAUSTED unless the data dir can take `claim` now ([`space::admits`]).
    fn admit(&self, claim: space::Claim, what: &str) -> Result<()> {
        let pending = self.lock_space();
        self.admit_with(&pending, claim, what)
    }

    /// Whether `claim` fits with the space lock held (`pending`).
    fn admit_with(&self, pending: &space::Pending, claim: space::Claim, what: &str) -> Result<()> {
        let s = self.space_with(pending)?;
        space::admits(&s, self.policy.overcommit, claim)
            .map_err(|why| Error::NoSpace(format!("{what}: {why}")))
    }

    /// Admits `claim` and keeps it pending until the reservation is dropped: for an operation
    /// whose space is not measurable until it finishes (a new volume's file, before its record
    /// is saved). Drop the reservation once the operation's result is measurable, or undone.
    fn reserve(&self, claim: space::Claim, what: &str) -> Result<Reservation<'_>> {
        let mut pending = self.lock_space();
        self.admit_with(&pending, claim, what)?;
        pending.add(claim);
        Ok(Reservation {
            lock: &self.space_lock,
            claim,
        })
    }

    /// Holds the space lock (see the field `space_lock`).
    fn lock_space(&self) -> MutexGuard<'_, space::Pending> {
        lock_pending(&self.space_lock)
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

    /// A volume's QoS limits, for tests.
    #[cfg(test)]
    pub(crate) fn qos_of(&self, raw: &str) -> Option<crate::backend::Qos> {
        let id = self.volume_here(raw).ok()?;
        self.volume_record(&id).map(|r| r.qos)
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
            id: self.show(&rec.id),
            name: rec.name.clone(),
            capacity_bytes: rec.capacity_bytes,
            parameters: rec.parameters.clone(),
            context: rec.context.clone(),
            source: rec.source.clone(),
            topology: vec![self.segment.clone()],
        }
    }

    fn snapshot_of(&self, rec: &SnapshotRecord) -> Snapshot {
        Snapshot {
            id: self.show(&rec.id),
            name: rec.name.clone(),
            source_volume_id: self.show(&rec.source_volume_id),
            size_bytes: rec.size_bytes,
            created_at: rec.created_at(),
            ready_to_use: true,
            group_snapshot_id: rec.group_snapshot_id.as_deref().map(|g| self.show(g)),
            encryption: rec.encryption.clone(),
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
        if let Some(why) = self.thin_at_risk(&path, rec) {
            return abnormal(why);
        }
        VolumeCondition {
            abnormal: false,
            message: "volume is healthy".into(),
        }
    }

    /// Why a thin volume may fail a write for want of space: it may still claim more than the
    /// data dir's filesystem has free (written elsewhere, or overcommitted), so the next write
    /// into a hole can fail with ENOSPC under its filesystem. A thick volume never can.
    fn thin_at_risk(&self, path: &Path, rec: &VolumeRecord) -> Option<String> {
        if is_thick(&rec.parameters) {
            return None;
        }
        let (holds, size) = space::held(path).ok()?;
        let claims = size.saturating_sub(holds);
        let st = rustix::fs::statvfs(&self.layout.root).ok()?;
        let free = st.f_bavail.saturating_mul(st.f_frsize);
        (claims > free).then(|| {
            format!(
                "thin volume may run out of space: it may still write {claims} bytes it does not \
                 hold, and the data dir's filesystem has {free} free"
            )
        })
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

    /// Creates `tmp/<name>` (new, private), removed when the returned [`TempFile`] is dropped
    /// unless kept.
    fn create_temp(&self, name: &str) -> Result<(TempFile, File)> {
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
        Ok((tmp, file))
    }

    /// Creates `tmp/<name>`, fills it (`fill`), fsyncs it and renames it to `target`.
    fn write_data_file(
        &self,
        name: &str,
        target: &Path,
        fill: impl FnOnce(&File) -> Result<()>,
    ) -> Result<()> {
        let (tmp, file) = self.create_temp(name)?;
        fill(&file)?;
        #[cfg(test)]
        {
            let hook = self
                .write_hook
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .take();
            if let Some(WriteHook(step)) = hook {
                step();
            }
        }
        file.sync_all()
            .map_err(|e| Error::io("fsync", &tmp.path, e))?;
        drop(file);
        fs::rename(&tmp.path, target).map_err(|e| Error::io("rename", target, e))?;
        let mut tmp = tmp;
        tmp.keep = true;
        let dir = target.parent().unwrap_or(&self.layout.root);
        records::sync_dir(dir).map_err(|e| Error::io("fsync dir", dir, e))
    }

    /// Reserves `[offset, offset + len)` of a thick volume's file: allocated now, so that no
    /// write to it ever needs space later. ENOSPC is RESOURCE_EXHAUSTED; a filesystem that
    /// cannot allocate ahead refuses thick volumes.
    fn reserve_range(file: &File, path: &Path, offset: u64, len: u64) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        match rustix::fs::fallocate(file, rustix::fs::FallocateFlags::empty(), offset, len) {
            Ok(()) => Ok(()),
            Err(rustix::io::Errno::OPNOTSUPP | rustix::io::Errno::NOSYS) => Err(Error::invalid(
                "parameters",
                format!(
                    "{PROVISIONING_KEY}={THICK}: the data dir's filesystem cannot reserve space \
                     ahead (fallocate is not supported on {})",
                    path.display()
                ),
            )),
            Err(e) => Err(size_error(path, offset.saturating_add(len), e.into())),
        }
    }

    /// Allocates again whatever of a thick volume's file is a hole (fallocate over all of it,
    /// which keeps every byte written: a hole reads as zeroes and is made zeroed blocks), for a
    /// file whose holes were punched through its device before [`Attacher::keep_allocated`]
    /// existed. Without the space for it the volume is still attached, with a warning: its
    /// data is worth more than the reservation.
    fn refill(rec: &VolumeRecord, path: &Path) {
        let result = OpenOptions::new()
            .write(true)
            .open(path)
            .map_err(|e| Error::io("open", path, e))
            .and_then(|file| {
                let len = file
                    .metadata()
                    .map_err(|e| Error::io("stat", path, e))?
                    .len();
                Self::reserve_range(&file, path, 0, len)
            });
        if let Err(e) = result {
            warn!(volume = %rec.id, error = %e, "cannot reserve all of a thick volume's file again");
        }
    }

    /// Makes a new, still empty file thick-ready: on btrfs, copy-on-write would make every
    /// rewrite of a reserved block need a new one, so the file is made no-COW (which only an
    /// empty file can be). Other filesystems overwrite in place and refuse the flag: ignored.
    fn no_cow(file: &File) {
        if let Ok(flags) = rustix::fs::ioctl_getflags(file) {
            let _ = rustix::fs::ioctl_setflags(file, flags | rustix::fs::IFlags::NOCOW);
        }
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
    /// A source on another node is RESOURCE_EXHAUSTED, the spec's answer for "not in this
    /// topology": a volume made from it can only be made on its node (copying it across nodes
    /// is not done), and the provisioner, given that answer, has the scheduler choose again.
    fn resolve_source(&self, src: &ContentSource) -> Result<(crate::inflight::Claim<'_>, Source)> {
        let elsewhere = |kind: &str, raw: &str, node: String| {
            Error::TopologyUnsatisfiable(format!(
                "volume_content_source: {kind} {} lives on node {node:?}, and a volume made \
                 from it can only be made there (this is node {:?}): schedule the pod that \
                 uses the new volume on that node",
                trunc(raw),
                self.node_id
            ))
        };
        match src {
            ContentSource::Snapshot(raw) => {
                let not_found = || Error::SourceNotFound {
                    kind: "snapshot",
                    id: trunc(raw).to_string(),
                };
                let id = match self.find_snapshot(raw) {
                    Found::Here(id) => id,
                    Found::Elsewhere(node) => return Err(elsewhere("snapshot", raw, node)),
                    Found::Unknown => return Err(not_found()),
                };
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
                        thick: false,
                    },
                ))
            }
            ContentSource::Volume(raw) => {
                let not_found = || Error::SourceNotFound {
                    kind: "volume",
                    id: trunc(raw).to_string(),
                };
                let id = match self.find_volume(raw) {
                    Found::Here(id) => id,
                    Found::Elsewhere(node) => return Err(elsewhere("volume", raw, node)),
                    Found::Unknown => return Err(not_found()),
                };
                let claim = self.inflight.claim(&[], &[&volume_key(&id)])?;
                let rec = self.volume_record(&id).ok_or_else(not_found)?;
                Ok((
                    claim,
                    Source {
                        path: self.layout.volume_file(&id),
                        size: rec.capacity_bytes,
                        thick: is_thick(&rec.parameters),
                        device: rec.publication.and_then(|p| p.device).map(PathBuf::from),
                    },
                ))
            }
        }
    }

    /// What the node is told: the device, its file, the volume's QoS limits of now, which
    /// the node applies to the pods it publishes the volume to, and an encrypted volume's
    /// wrapped data keys as its record holds them now (`encryptedDEK`, and
    /// `encryptedDEKPending` during a rotation): the node tries them before the volume
    /// context's, which a rotation cannot change.
    fn publish_context(device: &str, file: &Path, rec: &VolumeRecord) -> PublishContext {
        let mut ctx = PublishContext::from([
            (DEVICE_PATH_KEY.to_string(), device.to_string()),
            (BACKING_FILE_KEY.to_string(), file.display().to_string()),
            (QOS_LIMITS_KEY.to_string(), rec.qos.to_context()),
        ]);
        if let Some(keys) = Self::keys_of(rec) {
            ctx.insert(ENCRYPTED_DEK_KEY.to_string(), keys.current);
            if let Some(p) = keys.pending {
                ctx.insert(ENCRYPTED_DEK_PENDING_KEY.to_string(), p);
            }
        }
        ctx
    }

    /// An encrypted volume's wrapped data keys as its record holds them now: its rotation's,
    /// else its context's; `None` for a volume in the clear.
    fn keys_of(rec: &VolumeRecord) -> Option<crate::encryption::rotation::RecordKeys> {
        rec.keys.clone().or_else(|| {
            rec.context
                .get(ENCRYPTED_DEK_KEY)
                .map(|w| crate::encryption::rotation::RecordKeys::of_context(w))
        })
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
        let thick = is_thick(&rec.parameters) && !req.readonly;
        if thick {
            Self::refill(rec, path);
        }
        let device = match self.attacher.attach(path, req.readonly) {
            Ok(d) => d,
            Err(e) => {
                if let Err(undo) = self.save_volume(rec) {
                    warn!(volume = %rec.id, error = %undo, "cannot clear the publish intent; start-up will");
                }
                return Err(e.into());
            }
        };
        if thick {
            let kept = match FileId::of_path(path) {
                Ok(id) => self.attacher.keep_allocated(&device, id),
                Err(e) => Err(AttachError::Sys {
                    step: "stat",
                    path: path.to_path_buf(),
                    source: e,
                }),
            };
            if let Err(e) = kept {
                warn!(volume = %rec.id, device = %device.display(), error = %e,
                    "cannot stop the device from punching holes in a thick volume's file: \
                     discards and fstrim on it give its reserved space back");
            }
        }
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
        Ok(Self::publish_context(&device, path, rec))
    }

    /// Detaches every device bound to the volume's file (used when the record does not say
    /// which one).
    fn detach_all(&self, path: &Path) -> Result<()> {
        let Ok(file) = FileId::of_path(path) else {
            return Ok(());
        };
        for a in self.attacher.list(&self.layout.root)? {
            if a.file == file {
                let r = self.attacher.detach(&a.device, a.file)?;
                info!(device = %a.device.display(), result = ?r, "detached");
            }
        }
        Ok(())
    }
}
