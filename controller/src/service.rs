//! The CSI Controller gRPC service, over any [`Backend`].
//!
//! Each handler validates the request ([`crate::validate`]), applies the CSI rules that do not
//! depend on the storage, and calls the backend on tokio's blocking pool. A panic anywhere in a
//! handler is caught and answered with INTERNAL; the daemon stays up. Requests are never logged
//! whole (they may carry secrets): only the RPC, the object it is about, the code and the time.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use moor_proto::csi::v1 as csi;
use moor_runtime::contract;
use tonic::{Request, Response, Status};
use tracing::{info, warn};

use crate::backend::{
    Backend, CapacityQuery, ContentSource, Parameters, Snapshot, Volume, VolumeStatus,
};
use crate::encryption::{self, Encryption};
use crate::error::{Error, Result, trunc};
use crate::secrets::{self, Secrets};
use crate::validate;
use moor_runtime::contract::ENCRYPTED_DEK_KEY;

/// A request's parameters: the encryption ones checked for every backend (see
/// [`encryption::split`]), the rest by the backend, and the two put back together, normalised.
fn parse_parameters<B: Backend>(
    b: &B,
    raw: &Parameters,
) -> Result<(Option<Encryption>, Parameters)> {
    encryption::parse_with(raw, |rest| b.parse_parameters(rest))
}

/// Whether the volume `id` exists and is encrypted.
pub(crate) fn source_is_encrypted<B: Backend>(b: &B, id: &str) -> bool {
    b.get_volume(id)
        .is_ok_and(|s| encryption::is_encrypted(&s.volume.parameters))
}

/// What a clone or a restore takes of its source's encryption (docs/encryption.md): nothing
/// when there is no source or both are in the clear; when both are encrypted, the source's
/// encryption as a copy carries it ([`encryption::of_volume`]) and the id of the volume its
/// data key is wrapped for. A copy between encrypted and clear is INVALID_ARGUMENT. A source
/// this controller cannot read (not there, on another node) into a class in the clear is left
/// to the backend, whose CreateVolume answers it with its own code; into an encrypted class it
/// is that error here (the copy needs the source's key).
fn copy_encryption<B: Backend>(
    b: &B,
    source: Option<&ContentSource>,
    encrypted: bool,
) -> Result<Option<(Parameters, String)>> {
    let read = match source {
        None => return Ok(None),
        Some(ContentSource::Volume(id)) => b.get_volume(id).map(|s| {
            (
                format!("a clone of volume {:?}", trunc(id)),
                encryption::of_volume(&s.volume.parameters, &s.volume.context),
                id.clone(),
            )
        }),
        Some(ContentSource::Snapshot(id)) => b.get_snapshot(id).map(|s| {
            (
                format!("a restore of snapshot {:?}", trunc(id)),
                s.encryption,
                s.source_volume_id,
            )
        }),
    };
    let (what, mut carried, wrapped_for) = match read {
        Ok(r) => r,
        Err(_) if !encrypted => return Ok(None),
        Err(e) => return Err(e),
    };
    if let Some(ContentSource::Volume(id)) = source
        && !carried.is_empty()
    {
        // The key its record holds now (a rotation changes it; the context cannot). A backend
        // that does not rotate keys has the context's.
        let keys = b.volume_keys(id).ok();
        carried = encryption::with_record_key(carried, keys.as_ref(), id)?;
    }
    match (!carried.is_empty(), encrypted) {
        (false, false) => Ok(None),
        (true, true) => Ok(Some((carried, wrapped_for))),
        (source_encrypted, _) => Err(encryption::refuse_mixed_copy(&what, source_encrypted)),
    }
}

/// The controller capabilities moor advertises.
pub const CAPABILITIES: [csi::controller_service_capability::rpc::Type; 13] = {
    use csi::controller_service_capability::rpc::Type;
    [
        Type::CreateDeleteVolume,
        Type::PublishUnpublishVolume,
        Type::ListVolumes,
        Type::GetCapacity,
        Type::CreateDeleteSnapshot,
        Type::ListSnapshots,
        Type::CloneVolume,
        Type::ExpandVolume,
        Type::ListVolumesPublishedNodes,
        Type::VolumeCondition,
        Type::GetVolume,
        Type::SingleNodeMultiWriter,
        Type::ModifyVolume,
    ]
};

/// The capabilities a node-local controller does not announce: the CO never attaches its
/// volumes (moor-node has the controller on its node attach them, CSIDriver
/// `attachRequired: false`), and never grows them through it (csi-resizer, seeing no
/// EXPAND_VOLUME here, records the new size and leaves the growth to NodeExpandVolume, which
/// moor-node takes to the controller on its node). The RPCs are still served, for moor-node.
pub const NOT_ANNOUNCED_NODE_LOCAL: [csi::controller_service_capability::rpc::Type; 3] = {
    use csi::controller_service_capability::rpc::Type;
    [
        Type::PublishUnpublishVolume,
        Type::ListVolumesPublishedNodes,
        Type::ExpandVolume,
    ]
};

/// The Controller service.
#[derive(Debug)]
pub struct ControllerService<B: Backend> {
    backend: Arc<B>,
    node_local: bool,
}

impl<B: Backend> ControllerService<B> {
    /// Serves `backend`.
    pub fn new(backend: Arc<B>) -> Self {
        Self {
            backend,
            node_local: false,
        }
    }

    /// Serves a node-local controller's backend (see [`NOT_ANNOUNCED_NODE_LOCAL`]).
    pub fn node_local(mut self, on: bool) -> Self {
        self.node_local = on;
        self
    }

    /// Runs `f` against the backend on the blocking pool and logs the outcome.
    async fn call<T: Send + 'static>(
        &self,
        rpc: &'static str,
        subject: &str,
        f: impl FnOnce(&B) -> Result<T> + Send + 'static,
    ) -> Result<Response<T>, Status> {
        self.call_with(rpc, subject, Secrets::none(), f).await
    }

    /// [`call`](Self::call), with the request's secrets current for the backend (see
    /// [`crate::secrets`]).
    async fn call_with<T: Send + 'static>(
        &self,
        rpc: &'static str,
        subject: &str,
        secrets: Secrets,
        f: impl FnOnce(&B) -> Result<T> + Send + 'static,
    ) -> Result<Response<T>, Status> {
        let backend = Arc::clone(&self.backend);
        let start = Instant::now();
        let run = move || secrets::scope(secrets, || f(&backend));
        let result = match tokio::task::spawn_blocking(run).await {
            Ok(r) => r.map_err(Status::from),
            Err(e) => {
                warn!(rpc, error = %e, "handler panicked");
                Err(Error::Internal(format!("{rpc} panicked; see the controller log")).into())
            }
        };
        let micros = u64::try_from(start.elapsed().as_micros()).unwrap_or(u64::MAX);
        let subject = trunc(subject);
        match &result {
            Ok(_) => info!(rpc, subject, micros, "ok"),
            Err(s) => {
                warn!(rpc, subject, micros, code = ?s.code(), message = s.message(), "failed")
            }
        }
        result.map(Response::new)
    }
}

fn to_i64(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

fn to_hash(m: &Parameters) -> HashMap<String, String> {
    m.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
}

fn csi_source(src: &ContentSource) -> csi::VolumeContentSource {
    use csi::volume_content_source::{SnapshotSource, Type, VolumeSource};
    csi::VolumeContentSource {
        r#type: Some(match src {
            ContentSource::Snapshot(id) => Type::Snapshot(SnapshotSource {
                snapshot_id: id.clone(),
            }),
            ContentSource::Volume(id) => Type::Volume(VolumeSource {
                volume_id: id.clone(),
            }),
        }),
    }
}

/// A backend volume as CSI's `Volume`.
pub fn csi_volume(v: &Volume) -> csi::Volume {
    csi::Volume {
        capacity_bytes: to_i64(v.capacity_bytes),
        volume_id: v.id.clone(),
        volume_context: to_hash(&v.context),
        content_source: v.source.as_ref().map(csi_source),
        accessible_topology: v
            .topology
            .iter()
            .map(|s| csi::Topology {
                segments: to_hash(s),
            })
            .collect(),
    }
}

/// A backend snapshot as CSI's `Snapshot`.
pub fn csi_snapshot(s: &Snapshot) -> csi::Snapshot {
    csi::Snapshot {
        size_bytes: to_i64(s.size_bytes),
        snapshot_id: s.id.clone(),
        source_volume_id: s.source_volume_id.clone(),
        creation_time: Some(prost_types::Timestamp::from(s.created_at)),
        ready_to_use: s.ready_to_use,
        group_snapshot_id: s.group_snapshot_id.clone().unwrap_or_default(),
    }
}

fn csi_condition(s: &VolumeStatus) -> csi::VolumeCondition {
    csi::VolumeCondition {
        abnormal: s.condition.abnormal,
        message: s.condition.message.clone(),
    }
}

#[tonic::async_trait]
impl<B: Backend> csi::controller_server::Controller for ControllerService<B> {
    async fn create_volume(
        &self,
        request: Request<csi::CreateVolumeRequest>,
    ) -> Result<Response<csi::CreateVolumeResponse>, Status> {
        let req = request.into_inner();
        let subject = req.name.clone();
        let secrets = Secrets::from_map(&req.secrets);
        self.call_with("CreateVolume", &subject, secrets, move |b| {
            let mut v = validate::create_volume(&req)?;
            let qos = validate::mutable_parameters("mutable_parameters", &req.mutable_parameters)?;
            let (encryption, parameters) = parse_parameters(b, &v.parameters)?;
            // An encrypted volume's key-encryption key, before anything is made.
            let kek = match &encryption {
                Some(_) if !b.serves_encryption() => return Err(encryption::refuse_backend()),
                Some(e) => Some(encryption::kek_from_secrets(&e.kms_id, &req.secrets)?),
                None => None,
            };
            let copy = copy_encryption(b, v.source.as_ref(), encryption.is_some())?;
            v.parameters = parameters;
            // A copy is its source's LUKS volume: its LUKS parameters are the source's, and
            // its data key, taken before anything is made.
            let copy_dek = match (&copy, &kek) {
                (Some((carried, source_id)), Some(kek)) => {
                    v.parameters
                        .extend(encryption::encryption_parameters(carried));
                    Some(encryption::source_dek(carried, source_id, kek)?)
                }
                _ => None,
            };
            for cap in &v.capabilities {
                b.check_capability(cap, &v.parameters)
                    .map_err(|r| Error::invalid("volume_capabilities", r))?;
            }
            let mut vol = b.create_volume(&v)?;
            // Its data key, made and wrapped once (a retry finds it in the record), kept in
            // the record before the volume is first answered: a copy's is its source's,
            // wrapped again for the copy (the source's LUKS header opens with it).
            if let Some(kek) = &kek
                && !vol.context.contains_key(ENCRYPTED_DEK_KEY)
            {
                let wrapped = match &copy_dek {
                    Some(dek) => encryption::wrap_for(dek, kek, &vol.id)?,
                    None => encryption::new_wrapped_dek(kek, &vol.id)?,
                };
                vol = b.record_wrapped_dek(&vol.id, &wrapped)?;
            }
            // Its VolumeAttributesClass: set once it exists (again, harmlessly, on a retry).
            let mut volume = csi_volume(&vol);
            if !qos.is_none() {
                b.modify_volume(&vol.id, &qos)?;
                // The limits the node applies where no ControllerPublishVolume tells it the
                // current ones (a driver without attach).
                volume
                    .volume_context
                    .insert(contract::QOS_LIMITS_KEY.to_string(), qos.to_context());
            }
            Ok(csi::CreateVolumeResponse {
                volume: Some(volume),
            })
        })
        .await
    }

    async fn delete_volume(
        &self,
        request: Request<csi::DeleteVolumeRequest>,
    ) -> Result<Response<csi::DeleteVolumeResponse>, Status> {
        let req = request.into_inner();
        let subject = req.volume_id.clone();
        let secrets = Secrets::from_map(&req.secrets);
        self.call_with("DeleteVolume", &subject, secrets, move |b| {
            let id = validate::delete_volume(&req)?;
            b.delete_volume(&id)?;
            Ok(csi::DeleteVolumeResponse {})
        })
        .await
    }

    async fn controller_publish_volume(
        &self,
        request: Request<csi::ControllerPublishVolumeRequest>,
    ) -> Result<Response<csi::ControllerPublishVolumeResponse>, Status> {
        let req = request.into_inner();
        let subject = req.volume_id.clone();
        let secrets = Secrets::from_map(&req.secrets);
        self.call_with("ControllerPublishVolume", &subject, secrets, move |b| {
            let p = validate::publish(&req)?;
            let ctx = b.publish_volume(&p)?;
            Ok(csi::ControllerPublishVolumeResponse {
                publish_context: to_hash(&ctx),
            })
        })
        .await
    }

    async fn controller_unpublish_volume(
        &self,
        request: Request<csi::ControllerUnpublishVolumeRequest>,
    ) -> Result<Response<csi::ControllerUnpublishVolumeResponse>, Status> {
        let req = request.into_inner();
        let subject = req.volume_id.clone();
        let secrets = Secrets::from_map(&req.secrets);
        self.call_with("ControllerUnpublishVolume", &subject, secrets, move |b| {
            let (id, node) = validate::unpublish(&req)?;
            b.unpublish_volume(&id, node.as_deref())?;
            Ok(csi::ControllerUnpublishVolumeResponse {})
        })
        .await
    }

    async fn validate_volume_capabilities(
        &self,
        request: Request<csi::ValidateVolumeCapabilitiesRequest>,
    ) -> Result<Response<csi::ValidateVolumeCapabilitiesResponse>, Status> {
        let req = request.into_inner();
        let subject = req.volume_id.clone();
        let secrets = Secrets::from_map(&req.secrets);
        self.call_with("ValidateVolumeCapabilities", &subject, secrets, move |b| {
            let v = validate::validate_capabilities(&req)?;
            let status = b.get_volume(&v.volume_id)?;
            let (_, params) = parse_parameters(b, &v.parameters)?;
            let mut problems = Vec::new();
            if v.has_mutable_parameters {
                problems.push("moor has no mutable parameters".to_string());
            }
            if !v.parameters.is_empty() && params != status.volume.parameters {
                problems.push("parameters differ from those the volume was created with".into());
            }
            if !v.context.is_empty() && v.context != status.volume.context {
                problems.push("volume_context differs from the volume's".into());
            }
            for cap in &v.capabilities {
                if let Err(r) = b.check_capability(cap, &status.volume.parameters) {
                    problems.push(r);
                }
            }
            if problems.is_empty() {
                use csi::validate_volume_capabilities_response::Confirmed;
                Ok(csi::ValidateVolumeCapabilitiesResponse {
                    confirmed: Some(Confirmed {
                        volume_context: req.volume_context,
                        volume_capabilities: req.volume_capabilities,
                        parameters: req.parameters,
                        mutable_parameters: HashMap::new(),
                    }),
                    message: String::new(),
                })
            } else {
                Ok(csi::ValidateVolumeCapabilitiesResponse {
                    confirmed: None,
                    message: problems.join("; "),
                })
            }
        })
        .await
    }

    async fn list_volumes(
        &self,
        request: Request<csi::ListVolumesRequest>,
    ) -> Result<Response<csi::ListVolumesResponse>, Status> {
        let req = request.into_inner();
        self.call("ListVolumes", "", move |b| {
            use csi::list_volumes_response::{Entry, VolumeStatus};
            let page = b.list_volumes(&validate::list_volumes(&req)?)?;
            Ok(csi::ListVolumesResponse {
                entries: page
                    .entries
                    .iter()
                    .map(|s| Entry {
                        volume: Some(csi_volume(&s.volume)),
                        status: Some(VolumeStatus {
                            published_node_ids: s.published_nodes.clone(),
                            volume_condition: Some(csi_condition(s)),
                        }),
                    })
                    .collect(),
                next_token: page.next_token.unwrap_or_default(),
            })
        })
        .await
    }

    async fn get_capacity(
        &self,
        request: Request<csi::GetCapacityRequest>,
    ) -> Result<Response<csi::GetCapacityResponse>, Status> {
        let req = request.into_inner();
        self.call("GetCapacity", "", move |b| {
            let q = validate::get_capacity(&req)?;
            let (_, parameters) = parse_parameters(b, &q.parameters)?;
            // Storage that cannot make volumes with these capabilities has no capacity for them.
            if q.capabilities
                .iter()
                .any(|c| b.check_capability(c, &parameters).is_err())
            {
                return Ok(csi::GetCapacityResponse::default());
            }
            let c = b.capacity(&CapacityQuery {
                parameters,
                topology: q.topology,
            })?;
            Ok(csi::GetCapacityResponse {
                available_capacity: to_i64(c.available),
                maximum_volume_size: c.maximum_volume_size.map(to_i64),
                minimum_volume_size: c.minimum_volume_size.map(to_i64),
            })
        })
        .await
    }

    async fn controller_get_capabilities(
        &self,
        _: Request<csi::ControllerGetCapabilitiesRequest>,
    ) -> Result<Response<csi::ControllerGetCapabilitiesResponse>, Status> {
        use csi::controller_service_capability::{Rpc, Type};
        Ok(Response::new(csi::ControllerGetCapabilitiesResponse {
            capabilities: CAPABILITIES
                .iter()
                .filter(|t| !(self.node_local && NOT_ANNOUNCED_NODE_LOCAL.contains(t)))
                .map(|t| csi::ControllerServiceCapability {
                    r#type: Some(Type::Rpc(Rpc { r#type: *t as i32 })),
                })
                .collect(),
        }))
    }

    async fn create_snapshot(
        &self,
        request: Request<csi::CreateSnapshotRequest>,
    ) -> Result<Response<csi::CreateSnapshotResponse>, Status> {
        let req = request.into_inner();
        let subject = req.name.clone();
        let secrets = Secrets::from_map(&req.secrets);
        self.call_with("CreateSnapshot", &subject, secrets, move |b| {
            let new = validate::create_snapshot(&req)?;
            if !b.serves_encryption() && source_is_encrypted(b, &new.source_volume_id) {
                return Err(encryption::refuse_copy(&format!(
                    "a snapshot of volume {:?}",
                    trunc(&new.source_volume_id)
                )));
            }
            let s = b.create_snapshot(&new)?;
            Ok(csi::CreateSnapshotResponse {
                snapshot: Some(csi_snapshot(&s)),
            })
        })
        .await
    }

    async fn delete_snapshot(
        &self,
        request: Request<csi::DeleteSnapshotRequest>,
    ) -> Result<Response<csi::DeleteSnapshotResponse>, Status> {
        let req = request.into_inner();
        let subject = req.snapshot_id.clone();
        let secrets = Secrets::from_map(&req.secrets);
        self.call_with("DeleteSnapshot", &subject, secrets, move |b| {
            b.delete_snapshot(&validate::delete_snapshot(&req)?)?;
            Ok(csi::DeleteSnapshotResponse {})
        })
        .await
    }

    async fn list_snapshots(
        &self,
        request: Request<csi::ListSnapshotsRequest>,
    ) -> Result<Response<csi::ListSnapshotsResponse>, Status> {
        let req = request.into_inner();
        let secrets = Secrets::from_map(&req.secrets);
        self.call_with("ListSnapshots", "", secrets, move |b| {
            let (filter, page) = validate::list_snapshots(&req)?;
            let page = b.list_snapshots(&filter, &page)?;
            Ok(csi::ListSnapshotsResponse {
                entries: page
                    .entries
                    .iter()
                    .map(|s| csi::list_snapshots_response::Entry {
                        snapshot: Some(csi_snapshot(s)),
                    })
                    .collect(),
                next_token: page.next_token.unwrap_or_default(),
            })
        })
        .await
    }

    async fn get_snapshot(
        &self,
        request: Request<csi::GetSnapshotRequest>,
    ) -> Result<Response<csi::GetSnapshotResponse>, Status> {
        let req = request.into_inner();
        let subject = req.snapshot_id.clone();
        let secrets = Secrets::from_map(&req.secrets);
        self.call_with("GetSnapshot", &subject, secrets, move |b| {
            let s = b.get_snapshot(&validate::get_snapshot(&req)?)?;
            Ok(csi::GetSnapshotResponse {
                snapshot: Some(csi_snapshot(&s)),
            })
        })
        .await
    }

    async fn controller_expand_volume(
        &self,
        request: Request<csi::ControllerExpandVolumeRequest>,
    ) -> Result<Response<csi::ControllerExpandVolumeResponse>, Status> {
        let req = request.into_inner();
        let subject = req.volume_id.clone();
        let secrets = Secrets::from_map(&req.secrets);
        self.call_with("ControllerExpandVolume", &subject, secrets, move |b| {
            let e = validate::expand(&req)?;
            let size = b.expand_volume(&e)?;
            // A filesystem (or an unknown use, which may be one) grows on the node too.
            let node_expansion_required = e.capability.as_ref().is_none_or(|c| !c.is_block());
            Ok(csi::ControllerExpandVolumeResponse {
                capacity_bytes: to_i64(size),
                node_expansion_required,
            })
        })
        .await
    }

    async fn controller_get_volume(
        &self,
        request: Request<csi::ControllerGetVolumeRequest>,
    ) -> Result<Response<csi::ControllerGetVolumeResponse>, Status> {
        let req = request.into_inner();
        let subject = req.volume_id.clone();
        self.call("ControllerGetVolume", &subject, move |b| {
            use csi::controller_get_volume_response::VolumeStatus;
            let s = b.get_volume(&validate::get_volume(&req)?)?;
            Ok(csi::ControllerGetVolumeResponse {
                volume: Some(csi_volume(&s.volume)),
                status: Some(VolumeStatus {
                    published_node_ids: s.published_nodes.clone(),
                    volume_condition: Some(csi_condition(&s)),
                }),
            })
        })
        .await
    }

    async fn controller_modify_volume(
        &self,
        request: Request<csi::ControllerModifyVolumeRequest>,
    ) -> Result<Response<csi::ControllerModifyVolumeResponse>, Status> {
        let req = request.into_inner();
        let subject = req.volume_id.clone();
        let secrets = Secrets::from_map(&req.secrets);
        self.call_with("ControllerModifyVolume", &subject, secrets, move |b| {
            let (id, qos) = validate::modify_volume(&req)?;
            b.modify_volume(&id, &qos)?;
            Ok(csi::ControllerModifyVolumeResponse {})
        })
        .await
    }
}

pub mod group;
pub mod keys;
pub mod metadata;
#[cfg(test)]
mod tests;
