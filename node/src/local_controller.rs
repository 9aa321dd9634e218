//! The controller on this node (`--local-controller`): for node-local volumes, whose
//! moor-controller runs beside this moor-node on each node (`moor-controller --node-local`).
//!
//! The CO never attaches such a volume (CSIDriver `attachRequired: false`: there is no
//! ControllerPublishVolume round trip for a volume that never leaves its node) nor grows it
//! through a controller (csi-resizer's trivial resizer only records the new size). So the node
//! asks the controller beside it, over its Unix socket, for what a CO would have asked:
//!
//! * NodeStageVolume of a volume whose publish_context names no device: ControllerPublishVolume
//!   at this node first (the controller binds the volume's file to a loop device), and the
//!   stage goes on with the device and identity it answers, as after a CO's attach;
//! * NodeUnstageVolume, once the volume is unmounted: ControllerUnpublishVolume (the device is
//!   released); a volume not attached is success, so a retry, or an unstage of a stage that
//!   never finished, is too;
//! * NodeExpandVolume: ControllerExpandVolume to the size asked (the controller grows the file,
//!   reserving the new space of a thick volume, within its space policy, and tells the device),
//!   then the filesystem grows as for any volume;
//! * NodeGetVolumeStats: ControllerGetVolume's condition joins the node's own (a thin volume
//!   whose data dir can no longer back what it may still write is abnormal before it fails).
//!
//! Every call goes to the controller's socket afresh: a controller restarted meanwhile (a
//! rolling update of the pod) is simply called again.

use std::collections::HashMap;
use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use moor_proto::csi::v1 as csi;
use moor_proto::csi::v1::controller_client::ControllerClient;
use tonic::Status;
use tonic::transport::{Channel, Endpoint};

/// What the node asks of the controller on its node.
#[tonic::async_trait]
pub trait LocalController: Send + Sync + fmt::Debug + 'static {
    /// Attaches `volume_id` at `node_id` for `capability`; the publish_context the node stages
    /// with.
    async fn attach(
        &self,
        volume_id: &str,
        node_id: &str,
        capability: Option<csi::VolumeCapability>,
        context: HashMap<String, String>,
    ) -> Result<HashMap<String, String>, Status>;

    /// Releases what [`attach`](Self::attach) bound at `node_id`.
    async fn detach(&self, volume_id: &str, node_id: &str) -> Result<(), Status>;

    /// Grows the volume to at least `required` bytes (within `limit`, 0: none).
    async fn expand(
        &self,
        volume_id: &str,
        required: i64,
        limit: i64,
        capability: Option<csi::VolumeCapability>,
    ) -> Result<i64, Status>;

    /// The controller's view of the volume's condition.
    async fn condition(&self, volume_id: &str) -> Result<Option<csi::VolumeCondition>, Status>;
}

/// How long NodeGetVolumeStats waits for the controller's view of a volume's condition.
const CONDITION_TIMEOUT: Duration = Duration::from_secs(5);

/// The controller on this node, at a Unix socket.
#[derive(Debug, Clone)]
pub struct GrpcLocalController {
    socket: PathBuf,
    timeout: Duration,
}

impl GrpcLocalController {
    /// The controller serving `endpoint` (`unix:///path` or a path); each call may take up to
    /// `timeout`.
    pub fn new(endpoint: &str, timeout: Duration) -> Result<Self, String> {
        let socket = moor_runtime::server::parse_endpoint(endpoint)
            .map_err(|e| format!("--local-controller {endpoint}: {e}"))?;
        Ok(Self { socket, timeout })
    }

    async fn client(&self) -> Result<ControllerClient<Channel>, Status> {
        let endpoint = Endpoint::from_static("http://moor.invalid").timeout(self.timeout);
        let channel = moor_runtime::client::connect_endpoint(endpoint, &self.socket)
            .await
            .map_err(|e| {
                Status::unavailable(format!(
                    "the controller on this node ({}) does not answer: {e}",
                    self.socket.display()
                ))
            })?;
        Ok(ControllerClient::new(channel))
    }
}

#[tonic::async_trait]
impl LocalController for GrpcLocalController {
    async fn attach(
        &self,
        volume_id: &str,
        node_id: &str,
        capability: Option<csi::VolumeCapability>,
        context: HashMap<String, String>,
    ) -> Result<HashMap<String, String>, Status> {
        let r = self
            .client()
            .await?
            .controller_publish_volume(csi::ControllerPublishVolumeRequest {
                volume_id: volume_id.to_string(),
                node_id: node_id.to_string(),
                volume_capability: capability,
                readonly: false,
                volume_context: context,
                ..Default::default()
            })
            .await?;
        Ok(r.into_inner().publish_context)
    }

    async fn detach(&self, volume_id: &str, node_id: &str) -> Result<(), Status> {
        self.client()
            .await?
            .controller_unpublish_volume(csi::ControllerUnpublishVolumeRequest {
                volume_id: volume_id.to_string(),
                node_id: node_id.to_string(),
                ..Default::default()
            })
            .await?;
        Ok(())
    }

    async fn expand(
        &self,
        volume_id: &str,
        required: i64,
        limit: i64,
        capability: Option<csi::VolumeCapability>,
    ) -> Result<i64, Status> {
        let r = self
            .client()
            .await?
            .controller_expand_volume(csi::ControllerExpandVolumeRequest {
                volume_id: volume_id.to_string(),
                capacity_range: Some(csi::CapacityRange {
                    required_bytes: required,
                    limit_bytes: limit,
                }),
                volume_capability: capability,
                ..Default::default()
            })
            .await?;
        Ok(r.into_inner().capacity_bytes)
    }

    async fn condition(&self, volume_id: &str) -> Result<Option<csi::VolumeCondition>, Status> {
        let call = async {
            self.client()
                .await?
                .controller_get_volume(csi::ControllerGetVolumeRequest {
                    volume_id: volume_id.to_string(),
                })
                .await
        };
        // Stats are asked often and must not wait long on a controller that is busy.
        let r = tokio::time::timeout(CONDITION_TIMEOUT, call)
            .await
            .map_err(|_| Status::deadline_exceeded("the controller on this node is slow"))??;
        Ok(r.into_inner().status.and_then(|s| s.volume_condition))
    }
}

/// Whether a NodeStageVolume's publish_context names a device (a CO attached it, or it is an
/// RBD image the node maps): then the controller on the node is not asked to attach it.
pub fn names_a_device(publish_context: &HashMap<String, String>) -> bool {
    use moor_runtime::contract::{
        BACKING_FILE_KEY, DEVICE_PATH_KEY, DEVICE_SERIAL_KEY, DEVICE_WWN_KEY, RBD_POOL_KEY,
    };
    [
        DEVICE_PATH_KEY,
        BACKING_FILE_KEY,
        DEVICE_SERIAL_KEY,
        DEVICE_WWN_KEY,
        RBD_POOL_KEY,
    ]
    .iter()
    .any(|k| publish_context.contains_key(*k))
}
