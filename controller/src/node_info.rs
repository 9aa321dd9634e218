//! The Node service of a node-local controller (`--node-local`): NodeGetInfo and
//! NodeGetCapabilities only.
//!
//! The sidecars that run beside a node-local controller on its node ask the controller's
//! socket which node it serves: csi-provisioner `--node-deployment` takes the node's topology
//! from NodeGetInfo (it provisions the claims whose selected node is its own, and deletes only
//! the volumes accessible from that topology), and csi-resizer reads NodeGetCapabilities to
//! learn that volumes grow on the node. Both answers are moor-node's (same node id, same
//! topology segment, same capabilities), which serves every other Node RPC to the kubelet on
//! its own socket; here they are UNIMPLEMENTED.

use std::collections::HashMap;

use moor_proto::csi::v1 as csi;
use tonic::{Request, Response, Status};

/// The node-local controller's Node service.
#[derive(Debug, Clone)]
pub struct NodeInfoService {
    node_id: String,
    topology_key: String,
}

impl NodeInfoService {
    /// Answers for node `node_id`, whose segment is `{topology_key: <node's topology value>}`.
    pub fn new(node_id: impl Into<String>, topology_key: impl Into<String>) -> Self {
        Self {
            node_id: node_id.into(),
            topology_key: topology_key.into(),
        }
    }
}

fn elsewhere(rpc: &str) -> Status {
    Status::unimplemented(format!(
        "{rpc}: moor-controller serves no volumes on the node; moor-node does, on the kubelet's \
         socket"
    ))
}

#[tonic::async_trait]
impl csi::node_server::Node for NodeInfoService {
    async fn node_stage_volume(
        &self,
        _: Request<csi::NodeStageVolumeRequest>,
    ) -> Result<Response<csi::NodeStageVolumeResponse>, Status> {
        Err(elsewhere("NodeStageVolume"))
    }

    async fn node_unstage_volume(
        &self,
        _: Request<csi::NodeUnstageVolumeRequest>,
    ) -> Result<Response<csi::NodeUnstageVolumeResponse>, Status> {
        Err(elsewhere("NodeUnstageVolume"))
    }

    async fn node_publish_volume(
        &self,
        _: Request<csi::NodePublishVolumeRequest>,
    ) -> Result<Response<csi::NodePublishVolumeResponse>, Status> {
        Err(elsewhere("NodePublishVolume"))
    }

    async fn node_unpublish_volume(
        &self,
        _: Request<csi::NodeUnpublishVolumeRequest>,
    ) -> Result<Response<csi::NodeUnpublishVolumeResponse>, Status> {
        Err(elsewhere("NodeUnpublishVolume"))
    }

    async fn node_get_volume_stats(
        &self,
        _: Request<csi::NodeGetVolumeStatsRequest>,
    ) -> Result<Response<csi::NodeGetVolumeStatsResponse>, Status> {
        Err(elsewhere("NodeGetVolumeStats"))
    }

    async fn node_get_volume_health(
        &self,
        _: Request<csi::NodeGetVolumeHealthRequest>,
    ) -> Result<Response<csi::NodeGetVolumeHealthResponse>, Status> {
        Err(elsewhere("NodeGetVolumeHealth"))
    }

    async fn node_get_storage_health(
        &self,
        _: Request<csi::NodeGetStorageHealthRequest>,
    ) -> Result<Response<csi::NodeGetStorageHealthResponse>, Status> {
        Err(elsewhere("NodeGetStorageHealth"))
    }

    async fn node_expand_volume(
        &self,
        _: Request<csi::NodeExpandVolumeRequest>,
    ) -> Result<Response<csi::NodeExpandVolumeResponse>, Status> {
        Err(elsewhere("NodeExpandVolume"))
    }

    async fn node_get_capabilities(
        &self,
        _: Request<csi::NodeGetCapabilitiesRequest>,
    ) -> Result<Response<csi::NodeGetCapabilitiesResponse>, Status> {
        Ok(Response::new(csi::NodeGetCapabilitiesResponse {
            capabilities: moor_runtime::contract::node_capabilities(),
        }))
    }

    async fn node_get_info(
        &self,
        _: Request<csi::NodeGetInfoRequest>,
    ) -> Result<Response<csi::NodeGetInfoResponse>, Status> {
        Ok(Response::new(csi::NodeGetInfoResponse {
            node_id: self.node_id.clone(),
            max_volumes_per_node: 0,
            accessible_topology: Some(csi::Topology {
                segments: HashMap::from([(
                    self.topology_key.clone(),
                    moor_runtime::limits::topology_value(&self.node_id),
                )]),
            }),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use csi::node_server::Node as _;

    /// The node-deployment sidecars take the node's topology from here and the PV's node
    /// affinity from CreateVolume: both must be moor-node's segment, or the provisioner of the
    /// node would never delete its own volumes.
    #[tokio::test]
    async fn answers_as_moor_node_does() {
        let long = format!("{}.example.com", "n".repeat(70));
        for node in ["node-1", long.as_str()] {
            let svc = NodeInfoService::new(
                node,
                moor_runtime::contract::node_topology_key("local.moor.csi.io"),
            );
            let info = svc
                .node_get_info(Request::new(csi::NodeGetInfoRequest {}))
                .await
                .unwrap()
                .into_inner();
            assert_eq!(info.node_id, node);
            let segments = info.accessible_topology.unwrap().segments;
            assert_eq!(
                segments,
                HashMap::from([(
                    "topology.local.moor.csi.io/node".to_string(),
                    moor_runtime::limits::topology_value(node)
                )])
            );
        }
        let svc = NodeInfoService::new("n", "k");
        let caps = svc
            .node_get_capabilities(Request::new(csi::NodeGetCapabilitiesRequest {}))
            .await
            .unwrap()
            .into_inner()
            .capabilities;
        assert_eq!(caps, moor_runtime::contract::node_capabilities());
        let e = svc
            .node_stage_volume(Request::new(csi::NodeStageVolumeRequest::default()))
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unimplemented);
    }
}
