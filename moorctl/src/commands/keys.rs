//! `rotate-key`: a data key rotation of an encrypted volume on the node where it is staged
//! (moor's own `moor.keys.v1.NodeKeys/RotateVolumeKey`, beside CSI on the node's socket;
//! docs/encryption.md, "Rotation"). With `--controller`, the controller's record owns it:
//! `ControllerKeys/BeginVolumeKeyRotation` writes the new key as pending and gives both keys,
//! the node rotates the slot to the pending key and verifies it, and
//! `FinishVolumeKeyRotation` makes it current; each step is safe to run again, so running the
//! command again resumes a rotation cut short. Without it, the node's call alone: the
//! key-encryption key comes from `--secrets`; the new data key is made here and wrapped by it
//! when `--new-dek` is not given, and its wrapped form is printed BEFORE the call, on
//! standard error, so that the operator holds it whatever happens next (it is not secret).
//!
//! `rotate-kek`: `ControllerKeys/RotateKeyEncryptionKey` on the controller, the old KEK from
//! `--secrets` and the new one from `--new-secrets`.
//!
//! `key unwrap`: no daemon; a volume's data key unwrapped here, by the key source its
//! `kmsID` names and `--secrets` configures, and written to standard output as the bytes the
//! node gives cryptsetup on its standard input, for a pipe only (docs/encryption.md,
//! "Recovery when the key source is gone").

use std::fs::File;
use std::io::{IsTerminal as _, Write as _};
use std::os::fd::BorrowedFd;
use std::time::Duration;

use moor_proto::keys::v1 as keys;
use moor_proto::keys::v1::controller_keys_client::ControllerKeysClient;
use moor_runtime::keys::source::{KMS_TPM2, KeySource};
use moor_runtime::keys::{Dek, WrappedDek};
use serde_json::json;

use super::{Clients, req};
use crate::cli;
use crate::error::CliError;
use crate::output::Report;
use crate::secrets::Secrets;

/// `rotate-key`.
pub async fn rotate_key(
    c: &mut Clients,
    a: &cli::RotateKeyArgs,
    t: Duration,
) -> Result<Report, CliError> {
    let secrets = c.secrets.to_map();
    let kek =
        moor_runtime::keys::source::KeySource::for_rotation(|k| secrets.get(k).map(String::as_str))
            .map_err(|e| CliError::Local(format!("--secrets: {e}")))?;
    if let Some(controller) = &a.controller {
        return rotate_through(c, a, controller, t).await;
    }
    let old = WrappedDek::decode(a.old_dek.as_deref().unwrap_or_default())
        .map_err(|e| CliError::Local(format!("--old-dek: {e}")))?;
    let new = match &a.new_dek {
        Some(text) => {
            WrappedDek::decode(text).map_err(|e| CliError::Local(format!("--new-dek: {e}")))?
        }
        None => {
            let made = Dek::generate()
                .and_then(|d| kek.wrap(&d, &a.volume))
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

/// `rotate-key --controller`: begin at the controller (the pending key in its record), the
/// slot rotated and verified on the node, the pending key promoted at the controller.
async fn rotate_through(
    c: &mut Clients,
    a: &cli::RotateKeyArgs,
    controller: &str,
    t: Duration,
) -> Result<Report, CliError> {
    let secrets = c.secrets.to_map();
    let mut ck = ControllerKeysClient::new(crate::client::connect(controller, t).await?);
    let begun = ck
        .begin_volume_key_rotation(req(
            keys::BeginVolumeKeyRotationRequest {
                volume_id: a.volume.clone(),
                secrets: secrets.clone(),
                if_rotations: None,
            },
            t,
        ))
        .await
        .map_err(CliError::rpc("BeginVolumeKeyRotation"))?
        .into_inner();
    if begun.pending_wrapped_dek.is_empty() {
        return Err(CliError::Local(format!(
            "volume {}: the controller began no rotation",
            a.volume
        )));
    }
    let pbkdf = if begun.luks_pbkdf.is_empty() {
        a.pbkdf.clone()
    } else {
        begun.luks_pbkdf.clone()
    };
    let rotated = c
        .keys
        .rotate_volume_key(req(
            keys::RotateVolumeKeyRequest {
                volume_id: a.volume.clone(),
                old_wrapped_dek: begun.current_wrapped_dek.clone(),
                new_wrapped_dek: begun.pending_wrapped_dek.clone(),
                luks_pbkdf: pbkdf,
                secrets,
            },
            t,
        ))
        .await
        .map_err(CliError::rpc("RotateVolumeKey"))?
        .into_inner();
    let done = ck
        .finish_volume_key_rotation(req(
            keys::FinishVolumeKeyRotationRequest {
                volume_id: a.volume.clone(),
                new_wrapped_dek: begun.pending_wrapped_dek,
            },
            t,
        ))
        .await
        .map_err(CliError::rpc("FinishVolumeKeyRotation"))?
        .into_inner();
    Ok(Report::text(
        format!(
            "volume {}: data key rotated (steps run on the node: {}); the controller's record \
             holds it: {}",
            a.volume,
            rotated.steps.join(", "),
            done.current_wrapped_dek
        ),
        json!({
            "volume_id": a.volume,
            "steps": rotated.steps,
            "kek_id": rotated.kek_id,
            "encryptedDEK": done.current_wrapped_dek,
        }),
    ))
}

/// `rotate-kek`.
pub async fn rotate_kek(
    c: &mut Clients,
    a: &cli::RotateKekArgs,
    t: Duration,
) -> Result<Report, CliError> {
    let new_secrets = Secrets::load(&a.new_secrets)?.to_map();
    let answer = c
        .controller_keys
        .rotate_key_encryption_key(req(
            keys::RotateKeyEncryptionKeyRequest {
                kms_id: a.kms_id.clone(),
                old_secrets: c.secrets.to_map(),
                new_secrets,
            },
            t,
        ))
        .await
        .map_err(CliError::rpc("RotateKeyEncryptionKey"))?
        .into_inner();
    Ok(Report::text(
        format!(
            "key-encryption key rotated: {} records written, {} already under the new key, \
             {} under another key left alone{}",
            answer.rewrapped.len(),
            answer.unchanged.len(),
            answer.other_keks.len(),
            if answer.other_keks.is_empty() {
                String::new()
            } else {
                format!(" ({})", answer.other_keks.join("; "))
            }
        ),
        json!({
            "rewrapped": answer.rewrapped,
            "unchanged": answer.unchanged,
            "other_keks": answer.other_keks,
        }),
    ))
}

/// `key unwrap`: the data key of `a.volume` written to `out` (standard output), unwrapped
/// from `a.wrapped_dek` by the key source `a.kms_id` that `secrets` configures. Refused,
/// before any key is asked for, when `out` is a terminal and for a `tpm2` volume. The key
/// goes to `out` unbuffered, and no error names a byte of it.
pub fn key_unwrap(
    a: &cli::KeyUnwrapArgs,
    secrets: &Secrets,
    out: BorrowedFd<'_>,
) -> Result<(), CliError> {
    if a.kms_id == KMS_TPM2 {
        return Err(CliError::Usage(format!(
            "volume {}: a tpm2 volume's passphrase is its data key combined with its node's \
             TPM, which only that node's moor-node can do: stage it there",
            a.volume
        )));
    }
    if out.is_terminal() {
        return Err(CliError::Usage(
            "standard output is a terminal: a data key is never shown on a screen; pipe it \
             to cryptsetup (moorctl key unwrap ... | cryptsetup open --key-file=- <device> \
             <name>)"
                .into(),
        ));
    }
    let wrapped = WrappedDek::decode(&a.wrapped_dek)
        .map_err(|e| CliError::Usage(format!("--wrapped-dek: {e}")))?;
    let map = secrets.to_map();
    let source = KeySource::from_secrets(&a.kms_id, |k| map.get(k).map(String::as_str))
        .map_err(|e| CliError::Usage(format!("--secrets for --kms-id {}: {e}", a.kms_id)))?;
    let dek = source.unwrap(&wrapped, &a.volume).map_err(|e| {
        CliError::Local(format!(
            "volume {}: the data key does not unwrap: {e}",
            a.volume
        ))
    })?;
    // A File of its own over the descriptor: unbuffered, so no copy of the key stays in a
    // buffer of the process's standard output.
    let mut file = File::from(out.try_clone_to_owned()?);
    file.write_all(dek.expose())?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::io::Read as _;
    use std::os::fd::AsFd as _;

    use moor_runtime::keys::secret_entries;

    use super::*;

    fn args(kms: &str, wrapped: &str) -> cli::KeyUnwrapArgs {
        cli::KeyUnwrapArgs {
            volume: "vol-1".into(),
            wrapped_dek: wrapped.into(),
            kms_id: kms.into(),
        }
    }

    fn secrets(byte: u8) -> Secrets {
        let lines: String = secret_entries("kek-1", &[byte; 32])
            .iter()
            .map(|(k, v)| format!("{k}={v}\n"))
            .collect();
        Secrets::parse(&lines).expect("secrets")
    }

    #[test]
    fn the_key_goes_out_whole_and_a_wrong_kek_writes_nothing() {
        let map = secrets(9).to_map();
        let source =
            KeySource::from_secrets("secret", |k| map.get(k).map(String::as_str)).expect("source");
        let dek = Dek::generate().expect("dek");
        let wrapped = source.wrap(&dek, "vol-1").expect("wrap").encode();
        let mut out = tempfile();
        key_unwrap(&args("secret", &wrapped), &secrets(9), out.as_fd()).expect("unwrap");
        let mut got = Vec::new();
        File::open(&out.1).unwrap().read_to_end(&mut got).unwrap();
        assert_eq!(got, dek.expose());

        out = tempfile();
        let e = key_unwrap(&args("secret", &wrapped), &secrets(8), out.as_fd()).unwrap_err();
        assert_eq!(e.exit_code(), 5, "{e}");
        assert_eq!(std::fs::metadata(&out.1).unwrap().len(), 0);
        let e = key_unwrap(&args("tpm2", &wrapped), &secrets(9), out.as_fd()).unwrap_err();
        assert!(e.to_string().contains("TPM"), "{e}");
        assert_eq!(std::fs::metadata(&out.1).unwrap().len(), 0);
    }

    /// A new empty file in the temp dir, open for writing, and its path.
    fn tempfile() -> TempOut {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let path = std::env::temp_dir().join(format!("moorctl-unwrap-{}-{n}", std::process::id()));
        TempOut(File::create(&path).expect("temp file"), path)
    }

    struct TempOut(File, std::path::PathBuf);

    impl TempOut {
        fn as_fd(&self) -> BorrowedFd<'_> {
            self.0.as_fd()
        }
    }

    impl Drop for TempOut {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.1);
        }
    }
}
