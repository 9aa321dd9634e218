//! The CSI Identity service of the controller.
//!
//! It advertises CONTROLLER_SERVICE, VOLUME_ACCESSIBILITY_CONSTRAINTS (volumes live on one
//! node), GROUP_CONTROLLER_SERVICE (volume group snapshots) and ONLINE volume expansion
//! (attached volumes grow in place), and probes the backend. The SnapshotMetadata service is
//! always served; SNAPSHOT_METADATA_SERVICE is announced only when asked
//! ([`IdentityService::announce_snapshot_metadata`], `--snapshot-metadata`): the
//! external-snapshot-metadata sidecar requires it, and csi-sanity v5.3.1 fails a plugin that
//! announces it (it does not know that alpha service), so it is on where the sidecar runs.

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
    snapshot_metadata: bool,
}

impl<B: Backend> IdentityService<B> {
    /// Builds the service for `driver_name` over `backend`.
    pub fn new(driver_name: impl Into<String>, backend: Arc<B>) -> Self {
        Self {
            driver_name: driver_name.into(),
            backend,
            snapshot_metadata: false,
        }
    }

    /// Announces SNAPSHOT_METADATA_SERVICE too (see the module doc).
    pub fn announce_snapshot_metadata(mut self, on: bool) -> Self {
        self.snapshot_metadata = on;
        self
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
        use csi::plugin_capability::{Service, Type, service};
        let mut capabilities = plugin_capabilities();
        if self.snapshot_metadata {
            capabilities.push(csi::PluginCapability {
                r#type: Some(Type::Service(Service {
                    r#type: service::Type::SnapshotMetadataService as i32,
                })),
            });
        }
        Ok(Response::new(csi::GetPluginCapabilitiesResponse {
            capabilities,
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::embedded::fake::FakeAttacher;
    use crate::embedded::testdir::TestDir;
    use crate::embedded::{Config, EmbeddedBackend};
    use csi::identity_server::Identity as _;
    use csi::plugin_capability::{Type, service};

    #[tokio::test]
    async fn snapshot_metadata_is_announced_only_when_asked() {
        let dir = TestDir::new("identity-caps");
        let (backend, _) = EmbeddedBackend::open(
            Config {
                data_dir: dir.path().join("data"),
                node_id: "n1".into(),
                topology_key: "topology.moor.csi.io/node".into(),
            },
            FakeAttacher::new(),
        )
        .unwrap();
        let backend = Arc::new(backend);
        let announces = |svc: IdentityService<_>| async move {
            svc.get_plugin_capabilities(Request::new(csi::GetPluginCapabilitiesRequest {}))
                .await
                .unwrap()
                .into_inner()
                .capabilities
                .iter()
                .any(|c| {
                    matches!(&c.r#type, Some(Type::Service(s))
                        if s.r#type == service::Type::SnapshotMetadataService as i32)
                })
        };
        let plain = IdentityService::new("moor.csi.io", Arc::clone(&backend));
        assert!(!announces(plain).await);
        let on = IdentityService::new("moor.csi.io", backend).announce_snapshot_metadata(true);
        assert!(announces(on).await);
    }
}
