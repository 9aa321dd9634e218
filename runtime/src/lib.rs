//! moor-runtime: what moor's two daemons, moor-node and moor-controller, share.
//!
//! * [`contract`] is what the node and the controller both speak: the filesystems, the
//!   `publish_context` keys, the plugin capabilities;
//! * [`limits`] holds the CSI spec's limits on request fields and the checks both apply;
//! * [`daemon`] sets up logging and the async runtime, [`instance`] keeps one daemon per state
//!   dir;
//! * [`server`] serves gRPC on a Unix socket with a graceful stop, through [`authority`], which
//!   lets any client's `:authority` in;
//! * [`metrics`] counts the gRPC calls, and [`http`] serves `/healthz` and `/metrics`;
//! * [`client`] dials a daemon's socket and waits until a starting daemon answers, and
//!   [`child`] starts a daemon that cannot outlive what started it (moorctl's demo, the tests).

pub mod authority;
pub mod child;
pub mod client;
pub mod contract;
pub mod crc32c;
pub mod daemon;
pub mod http;
pub mod instance;
pub mod keys;
pub mod limits;
pub mod metrics;
pub mod server;
pub mod sys;
