//! moor's own `moor.keys.v1.ControllerKeys` service (`proto/keys.proto`; docs/encryption.md,
//! "Rotation"): the controller's half of a data key rotation (the pending key written before
//! the node changes a slot, promoted after) and a KEK rotation over every record, run by
//! [`crate::encryption::rotation`] on the backend, with the same handling (the blocking pool,
//! logging of the volume id and the code, never a request) as the Controller service. The
//! requests' secrets hold KEKs: they reach no log and no error.

use std::collections::HashMap;

use moor_proto::keys::v1 as keys;
use moor_runtime::keys::source::{KMS_SECRET, KeySource};
use tonic::{Request, Response, Status};

use super::ControllerService;
use crate::backend::Backend;
use crate::encryption::rotation::{self, RecordKeys};
use crate::encryption::{self, KEY_ROTATION_SCHEDULE_KEY, KMS_ID_KEY, PBKDF_KEY};
use crate::error::{Error, Result, trunc};

fn required<'a>(field: &'static str, value: &'a str) -> Result<&'a str> {
    if value.is_empty() {
        Err(Error::invalid(field, "required"))
    } else {
        Ok(value)
    }
}

/// The key source `kms_id` configured by `secrets`; INVALID_ARGUMENT naming `field`, never a
/// value.
fn source(
    field: &'static str,
    kms_id: &str,
    secrets: &HashMap<String, String>,
) -> Result<KeySource> {
    KeySource::from_secrets(kms_id, |k| secrets.get(k).map(String::as_str))
        .map_err(|e| Error::invalid(field, e.to_string()))
}

fn answer<B: Backend + ?Sized>(b: &B, volume: &str, k: RecordKeys) -> Result<keys::VolumeKeys> {
    let parameters = b.get_volume(volume)?.volume.parameters;
    Ok(keys::VolumeKeys {
        volume_id: volume.to_owned(),
        luks_pbkdf: parameters.get(PBKDF_KEY).cloned().unwrap_or_default(),
        rotation_schedule: k
            .schedule
            .clone()
            .or_else(|| parameters.get(KEY_ROTATION_SCHEDULE_KEY).cloned())
            .unwrap_or_default(),
        current_wrapped_dek: k.current,
        pending_wrapped_dek: k.pending.unwrap_or_default(),
        rotations: k.rotations,
        current_since_unix: k.current_since.unwrap_or_default(),
    })
}

/// GetVolumeKeyRotation on `b`: the record's keys and the volume's schedule (its
/// annotation's, else its class's); a volume with a schedule and no `current_since` yet has it
/// written (now), so its schedule's clock starts once, durably.
pub fn get<B: Backend + ?Sized>(
    b: &B,
    req: &keys::GetVolumeKeyRotationRequest,
) -> Result<keys::VolumeKeys> {
    let volume = required("volume_id", &req.volume_id)?;
    let parameters = b.get_volume(volume)?.volume.parameters;
    let class = parameters
        .get(KEY_ROTATION_SCHEDULE_KEY)
        .map(String::as_str);
    let (k, _) = match rotation::keys_for_schedule(b, volume, class) {
        // A backend that keeps no rotated keys (RBD) and a volume without a schedule: nothing
        // to rotate, nothing to say.
        Err(Error::FailedPrecondition(_)) if class.is_none() => {
            return Ok(keys::VolumeKeys {
                volume_id: volume.to_owned(),
                ..Default::default()
            });
        }
        r => r?,
    };
    answer(b, volume, k)
}

/// BeginVolumeKeyRotation on `b`: the new data key wrapped by the volume's key source as
/// CreateVolume wraps one (for `tpm2`, its cluster half's: a Secret's KEK or a KMIP server);
/// FAILED_PRECONDITION for a volume in the clear.
pub fn begin<B: Backend + ?Sized>(
    b: &B,
    req: &keys::BeginVolumeKeyRotationRequest,
) -> Result<keys::VolumeKeys> {
    let volume = required("volume_id", &req.volume_id)?;
    let parameters = b.get_volume(volume)?.volume.parameters;
    if !encryption::is_encrypted(&parameters) {
        return Err(Error::FailedPrecondition(format!(
            "volume {:?} is not encrypted: it has no data key to rotate",
            trunc(volume)
        )));
    }
    let kms = parameters
        .get(KMS_ID_KEY)
        .map(String::as_str)
        .unwrap_or_default();
    let kek = source("secrets", kms, &req.secrets)?;
    let k = rotation::begin_on(b, volume, &kek, req.if_rotations)?;
    answer(b, volume, k)
}

/// FinishVolumeKeyRotation on `b`.
pub fn finish<B: Backend + ?Sized>(
    b: &B,
    req: &keys::FinishVolumeKeyRotationRequest,
) -> Result<keys::VolumeKeys> {
    let volume = required("volume_id", &req.volume_id)?;
    let new = required("new_wrapped_dek", &req.new_wrapped_dek)?;
    moor_runtime::keys::WrappedDek::decode(new)
        .map_err(|e| Error::invalid("new_wrapped_dek", e.to_string()))?;
    let k = rotation::promote_on(b, volume, new)?;
    answer(b, volume, k)
}

/// RotateKeyEncryptionKey on `b`.
pub fn rotate_kek<B: Backend + ?Sized>(
    b: &B,
    req: &keys::RotateKeyEncryptionKeyRequest,
) -> Result<keys::RotateKeyEncryptionKeyResponse> {
    let kms = if req.kms_id.is_empty() {
        KMS_SECRET
    } else {
        req.kms_id.as_str()
    };
    let old = source("old_secrets", kms, &req.old_secrets)?;
    let new = source("new_secrets", kms, &req.new_secrets)?;
    if old.kek_id() == new.kek_id() {
        return Err(Error::invalid(
            "new_secrets",
            format!(
                "the new KEK has the old one's id {:?}: a new KEK needs an id of its own, \
                 which is how each record says which KEK wraps it",
                old.kek_id()
            ),
        ));
    }
    let done = rotation::rotate_kek_on(b, &old, &new)?;
    Ok(keys::RotateKeyEncryptionKeyResponse {
        rewrapped: done.rewrapped,
        unchanged: done.unchanged,
        other_keks: done
            .other_keks
            .into_iter()
            .map(|(v, ids)| format!("{v}={}", ids.join(",")))
            .collect(),
    })
}

#[tonic::async_trait]
impl<B: Backend> keys::controller_keys_server::ControllerKeys for ControllerService<B> {
    async fn begin_volume_key_rotation(
        &self,
        request: Request<keys::BeginVolumeKeyRotationRequest>,
    ) -> std::result::Result<Response<keys::VolumeKeys>, Status> {
        let req = request.into_inner();
        let subject = req.volume_id.clone();
        self.call("BeginVolumeKeyRotation", &subject, move |b| begin(b, &req))
            .await
    }

    async fn finish_volume_key_rotation(
        &self,
        request: Request<keys::FinishVolumeKeyRotationRequest>,
    ) -> std::result::Result<Response<keys::VolumeKeys>, Status> {
        let req = request.into_inner();
        let subject = req.volume_id.clone();
        self.call("FinishVolumeKeyRotation", &subject, move |b| {
            finish(b, &req)
        })
        .await
    }

    async fn get_volume_key_rotation(
        &self,
        request: Request<keys::GetVolumeKeyRotationRequest>,
    ) -> std::result::Result<Response<keys::VolumeKeys>, Status> {
        let req = request.into_inner();
        let subject = req.volume_id.clone();
        self.call("GetVolumeKeyRotation", &subject, move |b| get(b, &req))
            .await
    }

    async fn rotate_key_encryption_key(
        &self,
        request: Request<keys::RotateKeyEncryptionKeyRequest>,
    ) -> std::result::Result<Response<keys::RotateKeyEncryptionKeyResponse>, Status> {
        let req = request.into_inner();
        self.call("RotateKeyEncryptionKey", "every record", move |b| {
            rotate_kek(b, &req)
        })
        .await
    }
}
