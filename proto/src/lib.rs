//! Generated gRPC code for the protocols moor speaks.
//!
//! * [`csi::v1`]: the Container Storage Interface, served by `moor-node` and `moor-controller`.
//! * [`registration::v1`]: kubelet's plugin registration API, served by `moor-node` when it
//!   registers itself without the node-driver-registrar sidecar.

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

/// The CSI specification version this proto was written from.
pub const CSI_SPEC_VERSION: &str = "1.13.0";
