//! moor's access to Ceph RBD images: librados and librbd, loaded at run time, behind a safe
//! API.
//!
//! Nothing links against Ceph. The libraries (`librados.so.2`, `librbd.so.1`; Ceph 15 or later)
//! are opened with dlopen the first time a [`Cluster`] connects, so a binary built with this
//! crate runs on a machine without them; there, connecting fails with
//! [`Error::NotInstalled`] ("librbd not installed: …").
//!
//! ```no_run
//! use moor_rbd::{Auth, Cluster, ConnectOptions, ImageOptions, Secret};
//! # fn main() -> Result<(), moor_rbd::Error> {
//! let options = ConnectOptions::new("10.0.0.1:3300", "moor", Auth::Key(Secret::new("AQ...")));
//! let cluster = Cluster::connect(&options)?; // keep it: connecting costs tens of ms
//! let pool = cluster.pool("moor")?;
//! pool.ensure_image("vol-1", &ImageOptions::new(1 << 30))?;
//! let image = pool.open_image("vol-1")?;
//! image.resize(2 << 30, moor_rbd::Shrink::Refuse)?;
//! # Ok(()) }
//! ```
//!
//! Every call blocks (on the network); call it from a blocking thread in async code.
//!
//! The unsafe code of the crate is in one module, `sys`: the function table and the calls.

#![deny(unsafe_code)]

mod blocklist;
mod by_id;
mod cluster;
mod error;
mod features;
mod group;
mod image;
mod info;
mod io;
mod lockers;
mod metadata;
mod pool;
mod secret;
#[allow(unsafe_code)]
mod sys;
pub mod testing;

pub use cluster::{Auth, Cluster, ConnectOptions, DEFAULT_TIMEOUT};
pub use error::{Errno, Error, Result};
pub use features::{Features, ImageOptions};
pub use image::{Image, Shrink};
pub use info::{
    ClusterUsage, ImageInfo, ImageSpec, LinkedImage, LockMode, LockOwners, Parent, PoolCapacity,
    PoolUsage, SnapInfo, TrashEntry, Watcher,
};
pub use io::ControlFlow;
pub use lockers::{Locker, Lockers};
pub use pool::{Ensured, ImagePage, Pool};
pub use secret::Secret;

/// Loads librados and librbd now (connecting does it too) and returns librbd's version
/// (major, minor, extra): a way to report at start-up whether the RBD backend can work.
pub fn load() -> Result<(i32, i32, i32)> {
    let api = sys::api()?;
    Ok(sys::rbd_version(api))
}

/// The library file names this crate opens.
pub const LIBRARIES: [&str; 2] = [sys::RADOS_LIBRARY, sys::RBD_LIBRARY];
