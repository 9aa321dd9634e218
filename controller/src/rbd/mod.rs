//! The RBD backend: volumes are RBD images in a pool of an existing Ceph cluster, chosen per
//! StorageClass ([`parameters`]); snapshots are RBD snapshots, and volumes made from a
//! snapshot or a volume are RBD clones (clone format 1: snapshot, protect, clone).
//!
//! * [`ids`]: volume and snapshot ids (cluster, pool, image), within CSI's 128 bytes;
//! * [`clusters`]: the controller's cluster list (`--rbd-clusters`, ceph-csi's format);
//! * [`credentials`]: Ceph credentials from the CSI secrets, and one open connection per
//!   (monitors, user), reused;
//! * [`records`]: what the backend knows of each volume and snapshot, kept in the pool's
//!   metadata so that it survives the controller;
//! * `volumes`, `snapshots`, `listing`: the RPCs; `reap`: images and snapshots kept for their
//!   clones after the CO deleted them, removed with the last clone;
//! * `groups`: volume group snapshots (every member's lock held while they are cut);
//!   `metadata`: allocated and changed blocks of snapshots, from librbd's diff iteration;
//! * `keys`: an encrypted volume's wrapped data keys in its image's metadata, for a key
//!   rotation;
//! * `publish` and `fence`: which node may map an image, and fencing a node that still holds
//!   it when it is taken away.
//!
//! librbd is loaded when the backend is first used (moor-rbd opens it with dlopen): a
//! controller without Ceph's libraries serves the embedded backend as before, and reports the
//! RBD backend not ready.

pub mod clusters;
pub mod credentials;
mod fence;
mod groups;
pub mod ids;
mod keys;
mod listing;
mod metadata;
pub mod parameters;
mod publish;
mod reap;
pub mod records;
mod snapshots;
mod volumes;

use std::collections::BTreeSet;
use std::time::Duration;

use moor_rbd::{Cluster, Pool};
use tracing::warn;

use self::clusters::Clusters;
use self::credentials::{Connections, Credentials};
use self::ids::ClusterRef;
use self::records::RecordError;
use crate::backend::{
    Backend, Capability, Capacity, CapacityQuery, ExpandRequest, GroupSnapshot, GroupSnapshotRef,
    MetadataSink, NewGroupSnapshot, NewSnapshot, NewVolume, Page, PageRequest, Parameters,
    PublishContext, PublishRequest, Qos, SizePolicy, Snapshot, SnapshotFilter, Volume,
    VolumeStatus,
};
use crate::encryption::rotation::RecordKeys;
use crate::error::{Error, Result};
use crate::inflight::InFlight;

pub use self::publish::{
    CLUSTER_ID_KEY as PUBLISH_CLUSTER_ID_KEY, IMAGE_KEY as PUBLISH_IMAGE_KEY,
    MONITORS_KEY as PUBLISH_MONITORS_KEY, POOL_KEY as PUBLISH_POOL_KEY,
    READ_ONLY_KEY as PUBLISH_READ_ONLY_KEY,
};

/// 1 MiB: volumes are multiples of it.
pub const GRANULARITY: u64 = 1 << 20;
/// 1 GiB: the size of a volume whose request gives none.
pub const DEFAULT_SIZE: u64 = 1 << 30;
/// The largest volume: 1 PiB.
pub const MAX_SIZE: u64 = 1 << 50;

const POLICY: SizePolicy = SizePolicy {
    default: DEFAULT_SIZE,
    granularity: GRANULARITY,
    max: MAX_SIZE,
};

/// How long a fenced client stays blocklisted unless told otherwise: a week, long enough for
/// a dead node to be repaired or replaced; an operator lifts it sooner with
/// `ceph osd blocklist rm <address>`.
pub const DEFAULT_FENCE_EXPIRY: Duration = Duration::from_secs(7 * 24 * 3600);

/// What the backend needs to know.
#[derive(Debug, Clone)]
pub struct Config {
    /// The clusters StorageClasses may name by clusterID.
    pub clusters: Clusters,
    /// The nodes volumes may be published at; None: any node the CO names.
    pub nodes: Option<BTreeSet<String>>,
    /// How long a fenced client stays blocklisted.
    pub fence_expiry: Duration,
}

impl Config {
    /// A backend with this cluster list, any node, the default fence expiry.
    pub fn new(clusters: Clusters) -> Self {
        Self {
            clusters,
            nodes: None,
            fence_expiry: DEFAULT_FENCE_EXPIRY,
        }
    }
}

/// The RBD backend.
#[derive(Debug)]
pub struct RbdBackend {
    config: Config,
    connections: Connections,
    inflight: InFlight,
}

/// A connection to one cluster, for one request.
#[derive(Debug, Clone)]
pub(crate) struct Session {
    cluster: Cluster,
    cref: ClusterRef,
    mon_host: String,
    user: String,
}

impl Session {
    /// The connected cluster.
    pub(crate) fn cluster(&self) -> &Cluster {
        &self.cluster
    }
}

/// Maps a failure of librados or librbd to the code the spec names, or INTERNAL.
pub(crate) fn ceph_error(what: impl Into<String>, e: moor_rbd::Error) -> Error {
    use moor_rbd::Error as E;
    match e {
        E::NotInstalled { .. } | E::TooOld { .. } => Error::NotReady(e.to_string()),
        E::TimedOut { .. } => Error::Unavailable(format!("{}: {e}", what.into())),
        E::NoSpace { .. } => Error::NoSpace(e.to_string()),
        e => Error::backend(what, e),
    }
}

impl From<RecordError> for Error {
    fn from(e: RecordError) -> Self {
        match e {
            RecordError::Ceph(c) => ceph_error("record", c),
            e => Error::backend("record", e),
        }
    }
}

impl RbdBackend {
    /// A backend over these clusters. Nothing is connected (or loaded) until used.
    pub fn new(config: Config) -> Self {
        Self {
            config,
            connections: Connections::default(),
            inflight: InFlight::new(),
        }
    }

    /// The cluster list.
    pub fn clusters(&self) -> &Clusters {
        &self.config.clusters
    }

    /// The monitors of a cluster.
    fn mon_host(&self, cref: &ClusterRef) -> Result<String> {
        match cref {
            ClusterRef::Monitors(m) => Ok(m.clone()),
            ClusterRef::Id(id) => self
                .config
                .clusters
                .get(id)
                .map(|c| c.mon_host.clone())
                .ok_or_else(|| {
                    Error::NotReady(format!(
                        "cluster {id:?} is not in the controller's cluster list (--rbd-clusters)"
                    ))
                }),
        }
    }

    /// A connection to `cref` for the request being served: as the user of its secrets, else
    /// as the controller's own user for that cluster, else as the user last used for it.
    /// Without any: INVALID_ARGUMENT on `secrets`.
    pub(crate) fn session(&self, cref: &ClusterRef) -> Result<Session> {
        let mon_host = self.mon_host(cref)?;
        let secrets = crate::secrets::current();
        let mut creds = Credentials::from_secrets(&secrets)?;
        if creds.is_none()
            && let ClusterRef::Id(id) = cref
            && let Some(cfg) = self.config.clusters.get(id)
        {
            creds = cfg
                .own_key()
                .map_err(|e| Error::NotReady(e.to_string()))?
                .map(|(user, key)| Credentials { user, key });
        }
        if let Some(creds) = creds {
            let cluster = self.connections.get(cref, &mon_host, &creds).map_err(|e| {
                ceph_error(format!("connect to {cref} as client.{}", creds.user), e)
            })?;
            return Ok(Session {
                cluster,
                cref: cref.clone(),
                mon_host,
                user: creds.user,
            });
        }
        if let Some((cluster, user)) = self.connections.last_for(cref) {
            return Ok(Session {
                cluster,
                cref: cref.clone(),
                mon_host,
                user,
            });
        }
        Err(Error::invalid(
            "secrets",
            format!(
                "no Ceph credentials for {cref}: give adminID and adminKey (or userID and \
                 userKey) in the request's secrets (Kubernetes: the StorageClass's \
                 csi.storage.k8s.io/*-secret-name parameters), or the controller's own user \
                 and keyFile in its cluster list"
            ),
        ))
    }

    /// Maps a failure on a session's connection; a connection that was fenced or broke is
    /// dropped, so the next request connects again.
    pub(crate) fn fail(&self, s: &Session, what: impl Into<String>, e: moor_rbd::Error) -> Error {
        if matches!(e.errno(), Some(libc::ESHUTDOWN | libc::ENOTCONN)) {
            warn!(cluster = %s.cref, user = s.user, error = %e, "connection lost; reconnecting on next use");
            self.connections.evict(&s.mon_host, &s.user);
        }
        ceph_error(what, e)
    }

    /// A pool of the session's cluster; None when there is no such pool.
    pub(crate) fn open_pool(&self, s: &Session, name: &str) -> Result<Option<Pool>> {
        // Opening an I/O context does not look the pool up: a lookup says whether it exists.
        match s.cluster.pool_id(name) {
            Ok(_) => {}
            Err(moor_rbd::Error::NotFound { .. }) => return Ok(None),
            Err(e) => return Err(self.fail(s, format!("pool {name}"), e)),
        }
        s.cluster
            .pool(name)
            .map(Some)
            .map_err(|e| self.fail(s, format!("pool {name}"), e))
    }
}

impl Backend for RbdBackend {
    fn parse_parameters(&self, raw: &Parameters) -> Result<Parameters> {
        parameters::parse_parameters(raw, &self.config.clusters)
    }

    fn check_capability(&self, cap: &Capability, parameters: &Parameters) -> Result<(), String> {
        parameters::check_capability(cap, parameters)
    }

    fn probe(&self) -> Result<()> {
        moor_rbd::load()
            .map(drop)
            .map_err(|e| Error::NotReady(format!("the rbd backend: {e}")))
    }

    fn create_volume(&self, req: &NewVolume) -> Result<Volume> {
        self.create_volume_impl(req)
    }

    fn serves_encryption(&self) -> bool {
        true
    }

    fn record_wrapped_dek(&self, volume_id: &str, wrapped: &str) -> Result<Volume> {
        self.record_wrapped_dek_impl(volume_id, wrapped)
    }

    fn volume_keys(&self, volume_id: &str) -> Result<RecordKeys> {
        self.volume_keys_impl(volume_id)
    }

    fn write_volume_keys(
        &self,
        volume_id: &str,
        before: &RecordKeys,
        after: &RecordKeys,
    ) -> Result<()> {
        self.write_volume_keys_impl(volume_id, before, after)
    }

    fn encrypted_volume_ids(&self) -> Result<Vec<String>> {
        self.encrypted_volume_ids_impl()
    }

    fn write_snapshot_key(&self, snapshot_id: &str, before: &str, after: &str) -> Result<()> {
        self.write_snapshot_key_impl(snapshot_id, before, after)
    }

    fn delete_volume(&self, volume_id: &str) -> Result<()> {
        self.delete_volume_impl(volume_id)
    }

    fn publish_volume(&self, req: &PublishRequest) -> Result<PublishContext> {
        self.publish_impl(req)
    }

    fn unpublish_volume(&self, volume_id: &str, node_id: Option<&str>) -> Result<()> {
        self.unpublish_impl(volume_id, node_id)
    }

    fn get_volume(&self, volume_id: &str) -> Result<VolumeStatus> {
        self.get_volume_impl(volume_id)
    }

    fn list_volumes(&self, page: &PageRequest) -> Result<Page<VolumeStatus>> {
        self.list_volumes_impl(page)
    }

    fn capacity(&self, query: &CapacityQuery) -> Result<Capacity> {
        self.capacity_impl(query)
    }

    fn expand_volume(&self, req: &ExpandRequest) -> Result<u64> {
        self.expand_impl(req)
    }

    fn modify_volume(&self, volume_id: &str, qos: &Qos) -> Result<()> {
        self.modify_impl(volume_id, qos)
    }

    fn create_snapshot(&self, req: &NewSnapshot) -> Result<Snapshot> {
        self.create_snapshot_impl(req)
    }

    fn delete_snapshot(&self, snapshot_id: &str) -> Result<()> {
        self.delete_snapshot_impl(snapshot_id)
    }

    fn get_snapshot(&self, snapshot_id: &str) -> Result<Snapshot> {
        self.get_snapshot_impl(snapshot_id)
    }

    fn list_snapshots(
        &self,
        filter: &SnapshotFilter,
        page: &PageRequest,
    ) -> Result<Page<Snapshot>> {
        self.list_snapshots_impl(filter, page)
    }

    fn create_group_snapshot(&self, req: &NewGroupSnapshot) -> Result<GroupSnapshot> {
        self.create_group_impl(req)
    }

    fn delete_group_snapshot(&self, req: &GroupSnapshotRef) -> Result<()> {
        self.delete_group_impl(req)
    }

    fn get_group_snapshot(&self, req: &GroupSnapshotRef) -> Result<GroupSnapshot> {
        self.get_group_impl(req)
    }

    fn snapshot_allocated(
        &self,
        snapshot_id: &str,
        start: u64,
        sink: &mut dyn MetadataSink,
    ) -> Result<()> {
        self.allocated_impl(snapshot_id, start, sink)
    }

    fn snapshot_delta(
        &self,
        base_snapshot_id: &str,
        target_snapshot_id: &str,
        start: u64,
        sink: &mut dyn MetadataSink,
    ) -> Result<()> {
        self.delta_impl(base_snapshot_id, target_snapshot_id, start, sink)
    }
}
