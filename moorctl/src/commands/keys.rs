//! `rotate-key`: a data key rotation of an encrypted volume on the node where it is staged
//! (moor's own `moor.keys.v1.NodeKeys/RotateVolumeKey`, beside CSI on the node's socket;
//! docs/encryption.md, "Rotation"). The key-encryption key comes from `--secrets` (the
//! `secret` key source's `kek` and `kekID`); the new data key is made here and wrapped by it
//! when `--new-dek` is not given, and its wrapped form is printed BEFORE the call, on
//! standard error, so that the operator holds it whatever happens next: it is what the
//! volume's record must hold once the rotation is done (it is not secret).

use std::time::Duration;

use moor_proto::keys::v1 as keys;
use moor_runtime::keys::{Dek, WrappedDek, kek_from_secret};
use serde_json::json;

use super::{Clients, req};
use crate::cli;
use crate::error::CliError;
use crate::output::Report;

/// `rotate-key`.
pub async fn rotate_key(
    c: &mut Clients,
    a: &cli::RotateKeyArgs,
    t: Duration,
) -> Result<Report, CliError> {
    let secrets = c.secrets.to_map();
    let kek = kek_from_secret(|k| secrets.get(k).map(String::as_str))
        .map_err(|e| CliError::Local(format!("--secrets: {e}")))?;
    let old =
        WrappedDek::decode(&a.old_dek).map_err(|e| CliError::Local(format!("--old-dek: {e}")))?;
    let new = match &a.new_dek {
        Some(text) => {
            WrappedDek::decode(text).map_err(|e| CliError::Local(format!("--new-dek: {e}")))?
        }
        None => {
            let made = Dek::generate()
                .and_then(|d| d.wrap(&kek, &a.volume))
                .map_err(|e| CliError::Local(e.to_string()))?;
            eprintln!(
                "the new data key of volume {}, wrapped (keep it: run again with --new-dek \
                 and it to resume): {}",
                a.volume,
                made.encode()
            );
            made
        }
    };
    let answer = c
        .keys
        .rotate_volume_key(req(
            keys::RotateVolumeKeyRequest {
                volume_id: a.volume.clone(),
                old_wrapped_dek: old.encode(),
                new_wrapped_dek: new.encode(),
                luks_pbkdf: a.pbkdf.clone(),
                secrets,
            },
            t,
        ))
        .await
        .map_err(CliError::rpc("RotateVolumeKey"))?
        .into_inner();
    Ok(Report::text(
        format!(
            "volume {}: data key rotated (steps run: {}); its wrapped key is now {}",
            a.volume,
            answer.steps.join(", "),
            new.encode()
        ),
        json!({
            "volume_id": a.volume,
            "steps": answer.steps,
            "kek_id": answer.kek_id,
            "encryptedDEK": new.encode(),
        }),
    ))
}
