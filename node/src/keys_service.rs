//! moor's own key calls on the node's socket (`moor.keys.v1.NodeKeys`, `proto/keys.proto`;
//! docs/encryption.md, "Rotation"): a data key rotation of a volume staged here, checked into
//! the engine's [`RotateDek`] and run by [`Engine::rotate_dek`]. The request's secrets hold
//! the key-encryption key: the request is never logged, and no error names a key byte.

use std::sync::Arc;

use moor_proto::keys::v1 as keys;
use moor_runtime::keys::WrappedDek;
use moor_runtime::keys::source::KeySource;
use tonic::{Request, Response, Status};

use crate::engine::{Engine, NodeTpm, RotateDek};
use crate::error::{Error, Result};
use crate::service::{blocking, traced};
use crate::sys::Os;

/// The NodeKeys service.
#[derive(Debug)]
pub struct KeysService<O: Os> {
    engine: Arc<Engine<O>>,
    /// This node's TPM, for a `tpm2` volume's node half (the node service's).
    tpm: NodeTpm,
}

impl<O: Os> KeysService<O> {
    /// Builds the service, asking `tpm` for a `tpm2` volume's node half.
    pub fn new(engine: Arc<Engine<O>>, tpm: NodeTpm) -> Self {
        Self { engine, tpm }
    }
}

/// RotateVolumeKey, checked: a field missing or malformed is INVALID_ARGUMENT naming it. A
/// `tpm2` volume's node half is asked of `tpm`.
pub fn rotate(req: &keys::RotateVolumeKeyRequest, tpm: NodeTpm) -> Result<RotateDek> {
    if req.volume_id.is_empty() {
        return Err(Error::invalid("volume_id", "required"));
    }
    let wrapped = |field: &'static str, text: &str| {
        WrappedDek::decode(text).map_err(|e| Error::invalid(field, e.to_string()))
    };
    let kek = KeySource::for_rotation(|k| req.secrets.get(k).map(String::as_str))
        .map_err(|e| Error::invalid("secrets", e.to_string()))?;
    Ok(RotateDek {
        volume_id: req.volume_id.clone(),
        kek: Arc::new(kek),
        old_wrapped: wrapped("old_wrapped_dek", &req.old_wrapped_dek)?,
        new_wrapped: wrapped("new_wrapped_dek", &req.new_wrapped_dek)?,
        pbkdf: req.luks_pbkdf.clone(),
        tpm,
    })
}

#[tonic::async_trait]
impl<O: Os + 'static> keys::node_keys_server::NodeKeys for KeysService<O> {
    async fn rotate_volume_key(
        &self,
        request: Request<keys::RotateVolumeKeyRequest>,
    ) -> std::result::Result<Response<keys::RotateVolumeKeyResponse>, Status> {
        let req = request.into_inner();
        let engine = Arc::clone(&self.engine);
        let tpm = self.tpm.clone();
        traced("RotateVolumeKey", req.volume_id.clone(), async move {
            let r = rotate(&req, tpm)?;
            let report = blocking(move || engine.rotate_dek(&r)).await?;
            Ok(keys::RotateVolumeKeyResponse {
                steps: report.ran.iter().map(|s| format!("{s:?}")).collect(),
                kek_id: report.kek_id,
            })
        })
        .await
    }
}
