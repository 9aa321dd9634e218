//! moor-controller: the CSI controller plugin's library.
//!
//! The daemon (`main.rs`) is a thin shell around these modules:
//! * [`args`] is its command line;
//! * [`validate`] turns CSI requests into the typed requests of [`backend`], or an
//!   INVALID_ARGUMENT naming the field;
//! * [`backend`] is the [`backend::Backend`] trait the gRPC layer talks to, with the
//!   types it speaks and helpers any implementation can reuse (sizes, topology, paging);
//! * [`embedded`] is the default backend: sparse files under a data dir, attached as loop
//!   devices on this host, with crash-safe records;
//! * the loop device ioctls it attaches with are [`moor_runtime::sys::loopdev`];
//! * [`rbd`] is the RBD backend: images in a pool of an existing Ceph cluster, chosen per
//!   StorageClass; [`select`] picks the backend of each request, and [`secrets`] hands the
//!   request's CSI secrets to the backend that needs them;
//! * [`inflight`] answers ABORTED when an operation on the same object is already running;
//! * [`service`] and [`identity`] serve the CSI Controller and Identity services, and
//!   [`node_info`] a node-local controller's NodeGetInfo for the sidecars beside it;
//! * [`kube`] labels a node-local controller's snapshot contents with its node, through the
//!   API server, for the csi-snapshotter beside it;
//! * [`error`] maps every failure to the gRPC code the CSI spec names for it.

pub mod args;
pub mod backend;
pub mod embedded;
pub mod encryption;
pub mod error;
pub mod identity;
pub mod inflight;
pub mod kube;
pub mod node_info;
pub mod rbd;
pub mod secrets;
pub mod select;
pub mod service;
pub mod validate;

pub use backend::Backend;
pub use error::Error;
