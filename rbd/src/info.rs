//! What the cluster reports: plain data copied out of librados and librbd.

/// An image of a pool, as listed.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct ImageSpec {
    /// The image's name.
    pub name: String,
    /// Its id (the name of its objects' prefix), unique in the pool for the image's life.
    pub id: String,
}

/// An image's geometry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImageInfo {
    /// Size in bytes.
    pub size: u64,
    /// Bytes per RADOS object (`1 << order`).
    pub object_size: u64,
    /// Objects the image spans.
    pub objects: u64,
    /// log2 of the object size.
    pub order: u8,
}

/// A snapshot of an image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapInfo {
    /// The snapshot's id.
    pub id: u64,
    /// Its name.
    pub name: String,
    /// The image's size when the snapshot was taken.
    pub size: u64,
}

/// An image that another one is linked to (a parent or a clone).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LinkedImage {
    /// The pool's id.
    pub pool_id: i64,
    /// The pool's name.
    pub pool: String,
    /// The RADOS namespace ("" for none).
    pub namespace: String,
    /// The image's name.
    pub image: String,
    /// The image's id.
    pub image_id: String,
    /// Whether the image is in the trash.
    pub in_trash: bool,
}

/// A clone's parent: an image and the snapshot it was cloned from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Parent {
    /// The parent image.
    pub image: LinkedImage,
    /// The snapshot's name.
    pub snapshot: String,
    /// The snapshot's id.
    pub snapshot_id: u64,
}

/// An image in the trash.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TrashEntry {
    /// The image's id: what removes or restores it.
    pub id: String,
    /// The name it had.
    pub name: String,
    /// Seconds since the epoch before which it may not be removed without force.
    pub deferred_until: i64,
}

/// A client watching an image (having it open).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Watcher {
    /// The client's address.
    pub address: String,
    /// The client's global id (client.N).
    pub client_id: i64,
    /// The watch's cookie.
    pub cookie: u64,
}

/// The mode of an image's managed lock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LockMode {
    /// One owner at a time (the exclusive-lock feature).
    Exclusive,
    /// Several owners.
    Shared,
}

/// An image lock's owners.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LockOwners {
    /// The lock's mode.
    pub mode: LockMode,
    /// The owning clients, as librbd names them; empty when the lock is free.
    pub owners: Vec<String>,
}

/// Raw usage of the whole cluster (`rados_cluster_stat`), before replication.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClusterUsage {
    /// Raw capacity.
    pub total_bytes: u64,
    /// Raw bytes used.
    pub used_bytes: u64,
    /// Raw bytes free.
    pub available_bytes: u64,
    /// Objects stored.
    pub objects: u64,
}

/// What a pool stores (`rados_ioctx_pool_stat`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolUsage {
    /// Bytes stored in the pool.
    pub used_bytes: u64,
    /// Objects in the pool.
    pub objects: u64,
}

/// A pool's usage and what can still be written to it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolCapacity {
    /// Bytes stored in the pool.
    pub used_bytes: u64,
    /// Objects in the pool.
    pub objects: u64,
    /// Bytes that can still be written to the pool, after its replication and the OSDs' full
    /// ratio (the monitors' `df` "max_avail"): what GetCapacity reports.
    pub available_bytes: u64,
}
