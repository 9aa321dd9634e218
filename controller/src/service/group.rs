//! The CSI GroupController service: volume group snapshots, over the same backend and with the
//! same handling (validation, the blocking pool, logging) as the Controller service.

use moor_proto::csi::v1 as csi;
use tonic::{Request, Response, Status};

use super::{ControllerService, csi_snapshot};
use crate::backend::{Backend, GroupSnapshot};
use crate::secrets::Secrets;
use crate::validate;

/// The group controller capabilities moor advertises.
pub const GROUP_CAPABILITIES: [csi::group_controller_service_capability::rpc::Type; 1] =
    [csi::group_controller_service_capability::rpc::Type::CreateDeleteGetVolumeGroupSnapshot];

/// A backend group snapshot as CSI's `VolumeGroupSnapshot`.
pub fn csi_group_snapshot(g: &GroupSnapshot) -> csi::VolumeGroupSnapshot {
    csi::VolumeGroupSnapshot {
        group_snapshot_id: g.id.clone(),
        snapshots: g.snapshots.iter().map(csi_snapshot).collect(),
        creation_time: Some(prost_types::Timestamp::from(g.created_at)),
        ready_to_use: g.ready_to_use(),
    }
}

#[tonic::async_trait]
impl<B: Backend> csi::group_controller_server::GroupController for ControllerService<B> {
    async fn group_controller_get_capabilities(
        &self,
        _: Request<csi::GroupControllerGetCapabilitiesRequest>,
    ) -> Result<Response<csi::GroupControllerGetCapabilitiesResponse>, Status> {
        use csi::group_controller_service_capability::{Rpc, Type};
        Ok(Response::new(csi::GroupControllerGetCapabilitiesResponse {
            capabilities: GROUP_CAPABILITIES
                .iter()
                .map(|t| csi::GroupControllerServiceCapability {
                    r#type: Some(Type::Rpc(Rpc { r#type: *t as i32 })),
                })
                .collect(),
        }))
    }

    async fn create_volume_group_snapshot(
        &self,
        request: Request<csi::CreateVolumeGroupSnapshotRequest>,
    ) -> Result<Response<csi::CreateVolumeGroupSnapshotResponse>, Status> {
        let req = request.into_inner();
        let subject = req.name.clone();
        let secrets = Secrets::from_map(&req.secrets);
        self.call_with("CreateVolumeGroupSnapshot", &subject, secrets, move |b| {
            let new = validate::create_group_snapshot(&req)?;
            if let Some(id) = new
                .source_volume_ids
                .iter()
                .find(|id| super::source_is_encrypted(b, id))
            {
                return Err(crate::encryption::refuse_copy(&format!(
                    "a group snapshot of volume {:?}",
                    crate::error::trunc(id)
                )));
            }
            let g = b.create_group_snapshot(&new)?;
            Ok(csi::CreateVolumeGroupSnapshotResponse {
                group_snapshot: Some(csi_group_snapshot(&g)),
            })
        })
        .await
    }

    async fn delete_volume_group_snapshot(
        &self,
        request: Request<csi::DeleteVolumeGroupSnapshotRequest>,
    ) -> Result<Response<csi::DeleteVolumeGroupSnapshotResponse>, Status> {
        let req = request.into_inner();
        let subject = req.group_snapshot_id.clone();
        let secrets = Secrets::from_map(&req.secrets);
        self.call_with("DeleteVolumeGroupSnapshot", &subject, secrets, move |b| {
            b.delete_group_snapshot(&validate::delete_group_snapshot(&req)?)?;
            Ok(csi::DeleteVolumeGroupSnapshotResponse {})
        })
        .await
    }

    async fn get_volume_group_snapshot(
        &self,
        request: Request<csi::GetVolumeGroupSnapshotRequest>,
    ) -> Result<Response<csi::GetVolumeGroupSnapshotResponse>, Status> {
        let req = request.into_inner();
        let subject = req.group_snapshot_id.clone();
        let secrets = Secrets::from_map(&req.secrets);
        self.call_with("GetVolumeGroupSnapshot", &subject, secrets, move |b| {
            let g = b.get_group_snapshot(&validate::get_group_snapshot(&req)?)?;
            Ok(csi::GetVolumeGroupSnapshotResponse {
                group_snapshot: Some(csi_group_snapshot(&g)),
            })
        })
        .await
    }
}
