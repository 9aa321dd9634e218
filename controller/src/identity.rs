//! The CSI Identity service of the controller.
//!
//! It advertises CONTROLLER_SERVICE, VOLUME_ACCESSIBILITY_CONSTRAINTS (volumes live on one
//! node) and ONLINE volume expansion (attached volumes grow in place), and probes the
//! backend.

use std::collections::HashMap;
use std::sync::Arc;

use moor_proto::csi::v1 as csi;
use moor_runtime::contract::plugin_capabilities;
use tonic::{Request, Response, Status};
use tracing::warn;

use crate::backend::Backend;

/// The Identity service.
#[derive(Debug)]
pub struct IdentityService<B: Backend> {
    driver_name: String,
    backend: Arc<B>,
}

impl<B: Backend> IdentityService<B> {
    /// Builds the service for `driver_name` over `backend`.
    pub fn new(driver_name: impl Into<String>, backend: Arc<B>) -> Self {
        Self {
            driver_name: driver_name.into(),
            backend,
        }
    }
}

#[tonic::async_trait]
impl<B: Backend> csi::identity_server::Identity for IdentityService<B> {
    async fn get_plugin_info(
        &self,
        _: Request<csi::GetPluginInfoRequest>,
    ) -> Result<Response<csi::GetPluginInfoResponse>, Status> {
        Ok(Response::new(csi::GetPluginInfoResponse {
            name: self.driver_name.clone(),
            vendor_version: env!("CARGO_PKG_VERSION").to_string(),
            manifest: HashMap::from([("component".to_string(), "controller".to_string())]),
        }))
    }

    async fn get_plugin_capabilities(
        &self,
        _: Request<csi::GetPluginCapabilitiesRequest>,
    ) -> Result<Response<csi::GetPluginCapabilitiesResponse>, Status> {
        Ok(Response::new(csi::GetPluginCapabilitiesResponse {
            capabilities: plugin_capabilities(),
        }))
    }

    async fn probe(
        &self,
        _: Request<csi::ProbeRequest>,
    ) -> Result<Response<csi::ProbeResponse>, Status> {
        let backend = Arc::clone(&self.backend);
        match tokio::task::spawn_blocking(move || backend.probe()).await {
            Ok(Ok(())) => Ok(Response::new(csi::ProbeResponse { ready: Some(true) })),
            Ok(Err(e)) => {
                warn!(error = %e, "probe: not healthy");
                Err(e.into())
            }
            Err(e) => {
                warn!(error = %e, "probe panicked");
                Err(Status::internal("internal error: probe panicked"))
            }
        }
    }
}
