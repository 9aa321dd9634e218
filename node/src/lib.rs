//! moor-node: the CSI node plugin's library.
//!
//! The daemon is a thin shell (`main.rs`) around these modules:
//! * [`args`] is its command line;
//! * [`validate`] turns CSI requests into typed, checked requests, within the spec's
//!   limits ([`moor_runtime::limits`], shared with the controller);
//! * [`engine`] carries out the Node RPCs' semantics over the OS ([`sys`]) and the node
//!   journal ([`journal`]), one operation per volume at a time ([`volume_lock`]);
//! * [`sys::discovery`] finds a volume's block device by identity, through udev;
//! * [`attach`] maps a Ceph RBD image to a block device before it is staged, and
//!   [`local_controller`] has the controller on this node attach a node-local volume;
//! * [`superblock`] reads superblocks to tell a blank device from one that holds data;
//! * [`filesystem`] says what differs per filesystem: mkfs, fsck, growing, mount options;
//! * [`mount_options`] decides which mount flags reach the kernel; [`selinux`] checks the
//!   SELinux labels among them, and [`fsgroup`] gives a volume to its pod's group;
//! * [`sys::mountinfo`] parses the mount table where statx/statmount cannot answer;
//! * [`service`] answers the Node and Identity RPCs, which [`moor_runtime::server`] serves
//!   over gRPC on a Unix socket;
//! * [`registration`] registers the plugin with kubelet, and [`metrics`] keeps the node's
//!   Prometheus metrics, which [`moor_runtime::http`] serves with `/healthz`.

pub mod args;
pub mod attach;
pub mod crash_points;
pub mod engine;
pub mod error;
pub mod filesystem;
pub mod fsgroup;
pub mod journal;
pub mod key_schedule;
pub mod keys_service;
pub mod local_controller;
pub mod metrics;
pub mod mount_options;
pub mod reconcile;
pub mod registration;
pub mod selinux;
pub mod service;
pub mod superblock;
pub mod sys;
pub mod validate;
pub mod volume_lock;

#[cfg(test)]
mod fault_injection_rbd_tests;
#[cfg(test)]
mod fault_injection_tests;
#[cfg(test)]
mod fsgroup_tests;
#[cfg(test)]
mod power_cut_rbd_tests;
#[cfg(test)]
mod power_cut_tests;
#[cfg(test)]
mod selinux_tests;
#[cfg(test)]
mod service_tests;
