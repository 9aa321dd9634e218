//! moor's labs: the worlds beyond this machine's root that tests and benches run in.
//!
//! - [`vm`]: guests on a real kernel (Debian's, under QEMU), with the host's files shared
//!   read-only and an agent in each guest (`vm-agent`); [`krbd_lab`] puts moor-node in them as
//!   nodes of a Ceph cluster using the kernel's RBD client; [`logwrites`] reads the
//!   dm-log-writes log a guest recorded, to rebuild a device as a power cut left it.
//! - [`ceph`]: a one-OSD Ceph cluster (`.ci/ceph-cluster`) and the worlds of RBD volumes on it.
//! - [`container`]: moor's image run as its pods run it, with runc.
//! - [`kube`]: a real Kubernetes of several nodes on this machine (`.ci/cluster`), driven
//!   through its API.
//!
//! Each lab is set up by a script under `.ci/` and found through the environment; a test whose
//! lab is absent says so and passes.

pub mod ceph;
pub mod container;
pub mod krbd_lab;
pub mod kube;
pub mod logwrites;
pub mod vm;
