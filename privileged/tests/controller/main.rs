//! The controller's embedded backend on real loop devices (run as root:
//! `cargo test -p moor-privileged --test controller`).
//!
//! Every test works in its own directory under the system temp dir and cleans up after itself
//! even when it fails: [`Fixture`]'s drop detaches every loop device bound to a file under that
//! directory and removes it. Loop devices are checked through sysfs, independently of the code
//! under test.

mod fixture;
mod groups;
mod grpc;
mod killed;
mod reflink;
mod restarted;
mod thick;
mod volumes;
