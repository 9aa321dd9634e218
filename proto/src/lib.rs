//! Generated gRPC code for the protocols moor speaks.
//!
//! * [`csi::v1`]: the Container Storage Interface, served by `moor-node` and `moor-controller`.
//! * [`registration::v1`]: kubelet's plugin registration API, served by `moor-node` when it
//!   registers itself without the node-driver-registrar sidecar.
//! * [`keys::v1`]: moor's own key calls (a data key rotation), served by `moor-node`.

#![allow(
    missing_docs,
    clippy::all,
    clippy::pedantic,
    missing_debug_implementations
)]

/// The CSI protocol.
pub mod csi {
    /// CSI v1 (`package csi.v1`).
    pub mod v1 {
        tonic::include_proto!("csi.v1");
    }
}

/// kubelet's plugin registration protocol.
pub mod registration {
    /// `package pluginregistration` (API version v1).
    pub mod v1 {
        tonic::include_proto!("pluginregistration");
    }
}

/// moor's own key calls (`keys.proto`), beside CSI on the node's socket.
pub mod keys {
    /// `package moor.keys.v1`.
    pub mod v1 {
        tonic::include_proto!("moor.keys.v1");
    }
}

/// The CSI specification version this proto was written from.
pub const CSI_SPEC_VERSION: &str = "1.13.0";
