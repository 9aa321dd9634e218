//! The StorageClass parameters of an encrypted volume (docs/encryption.md): `encrypted`,
//! `kmsID` and the LUKS parameters, the same for every backend. [`split`] takes them out of a
//! request's parameters, checks them (INVALID_ARGUMENT naming the one that is wrong) and fills
//! in the defaults, and leaves the rest to the backend's own parser.
//!
//! CreateVolume of an encrypted class makes the volume's data key, wraps it with the key
//! source's KEK ([`kek_from_secrets`], [`new_wrapped_dek`]) and keeps the wrapped key in the
//! volume's record and context. A copy of an encrypted volume (a snapshot, a clone, a restore)
//! is its source's LUKS volume: it opens with its source's data key, wrapped again for the copy
//! ([`source_dek`], [`wrap_for`]); a copy between encrypted and clear is refused ([`refuse_mixed_copy`]).

use crate::backend::Parameters;
use crate::error::{Error, Result, trunc};

pub mod rotation;

/// `"true"` makes the volume LUKS2 on the node; `"false"` (the default) does not.
pub use moor_runtime::contract::ENCRYPTED_KEY;
/// How often a volume's data key is rotated by schedule.
pub use moor_runtime::contract::KEY_ROTATION_SCHEDULE_KEY;
/// The key source of an encrypted volume's key-encryption key.
pub use moor_runtime::contract::KMS_ID_KEY;
/// The LUKS cipher.
pub use moor_runtime::contract::LUKS_CIPHER_KEY as CIPHER_KEY;
/// The LUKS key size in bits.
pub use moor_runtime::contract::LUKS_KEY_SIZE_KEY as KEY_SIZE_KEY;
/// The PBKDF of the LUKS key slot.
pub use moor_runtime::contract::LUKS_PBKDF_KEY as PBKDF_KEY;
/// The LUKS sector size in bytes.
pub use moor_runtime::contract::LUKS_SECTOR_SIZE_KEY as SECTOR_SIZE_KEY;
/// The PCRs a `tpm2` volume's node half is sealed to.
pub use moor_runtime::contract::TPM2_PCRS_KEY;

/// The parameters that say how a volume is encrypted.
const ENCRYPTION_KEYS: [&str; 8] = [
    ENCRYPTED_KEY,
    KMS_ID_KEY,
    CIPHER_KEY,
    KEY_SIZE_KEY,
    SECTOR_SIZE_KEY,
    PBKDF_KEY,
    TPM2_PCRS_KEY,
    KEY_ROTATION_SCHEDULE_KEY,
];

/// The key sources this driver knows (`moor_runtime::keys::source`): the Kubernetes Secret
/// given as CSI secrets, a KMIP server, a node's TPM2 with a cluster key.
pub const KMS_IDS: &[&str] = moor_runtime::keys::source::KMS_IDS;

/// A cipher moor makes LUKS volumes with, the key sizes it takes, and its default one.
struct Cipher {
    /// cryptsetup's name of it.
    name: &'static str,
    /// The key sizes in bits it takes.
    key_sizes: &'static [u32],
}

/// The ciphers moor makes volumes with; the first is the default, and each one's first key
/// size is its default.
const CIPHERS: [Cipher; 5] = [
    Cipher {
        name: "aes-xts-plain64",
        key_sizes: &[512, 256],
    },
    Cipher {
        name: "serpent-xts-plain64",
        key_sizes: &[512, 256],
    },
    Cipher {
        name: "twofish-xts-plain64",
        key_sizes: &[512, 256],
    },
    Cipher {
        name: "xchacha12,aes-adiantum-plain64",
        key_sizes: &[256],
    },
    Cipher {
        name: "xchacha20,aes-adiantum-plain64",
        key_sizes: &[256],
    },
];

/// The LUKS sector sizes moor takes; the first is the default.
const SECTOR_SIZES: [u32; 4] = [4096, 512, 1024, 2048];

/// The PBKDFs moor takes; the first is the default (the key slot's passphrase is a random
/// 256-bit data key: see docs/encryption.md).
const PBKDFS: [&str; 3] = ["pbkdf2", "argon2id", "argon2i"];

/// How an encrypted volume is made: every parameter, defaults filled in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Encryption {
    /// The key source, one of [`KMS_IDS`].
    pub kms_id: String,
    /// The LUKS cipher.
    pub cipher: &'static str,
    /// The key size in bits.
    pub key_size: u32,
    /// The sector size in bytes.
    pub sector_size: u32,
    /// The PBKDF.
    pub pbkdf: &'static str,
    /// The PCRs a `tpm2` volume's node half is sealed to (`tpm2PCRs`, in its one form).
    pub tpm2_pcrs: Option<String>,
    /// How often its data key is rotated by schedule (`keyRotationSchedule`); `None`: never.
    pub rotation_schedule: Option<String>,
}

impl Encryption {
    /// The parameters that say it, every one explicit (so that a class that names a default
    /// and one that leaves it out make the same volumes).
    #[must_use]
    pub fn parameters(&self) -> Parameters {
        [
            (ENCRYPTED_KEY, "true".to_owned()),
            (KMS_ID_KEY, self.kms_id.clone()),
            (CIPHER_KEY, self.cipher.to_owned()),
            (KEY_SIZE_KEY, self.key_size.to_string()),
            (SECTOR_SIZE_KEY, self.sector_size.to_string()),
            (PBKDF_KEY, self.pbkdf.to_owned()),
        ]
        .into_iter()
        .chain(self.tpm2_pcrs.clone().map(|p| (TPM2_PCRS_KEY, p)))
        .chain(
            self.rotation_schedule
                .clone()
                .map(|p| (KEY_ROTATION_SCHEDULE_KEY, p)),
        )
        .map(|(k, v)| (k.to_owned(), v))
        .collect()
    }
}

/// A parameter's INVALID_ARGUMENT: `key="value": why`.
fn bad(key: &str, value: &str, why: impl std::fmt::Display) -> Error {
    Error::invalid("parameters", format!("{key}={:?}: {why}", trunc(value)))
}

/// One of `allowed` (the first is the default when the parameter is absent).
fn one_of<T: Copy + std::fmt::Display + PartialEq>(
    raw: &Parameters,
    key: &str,
    allowed: &[T],
    parse: impl Fn(&str) -> Option<T>,
) -> Result<Option<T>> {
    let Some(value) = raw.get(key) else {
        return Ok(allowed.first().copied());
    };
    match parse(value).filter(|v| allowed.contains(v)) {
        Some(v) => Ok(Some(v)),
        None => {
            let names: Vec<String> = allowed.iter().map(ToString::to_string).collect();
            Err(bad(key, value, format!("one of {}", names.join(", "))))
        }
    }
}

/// Takes the encryption parameters out of `raw`: the volume's [`Encryption`] (`None` when it
/// is not encrypted) and the other parameters, for the backend. INVALID_ARGUMENT names the
/// parameter that is wrong: an `encrypted` other than `"true"` or `"false"`, no `kmsID` or an
/// unknown one, a cipher, key size, sector size or PBKDF moor does not take, a key size the
/// cipher does not take, a `tpm2PCRs` that is not a PCR selection or is given with another
/// `kmsID` than `tpm2`, a `keyRotationSchedule` that is not a period, any of them on a volume
/// that is not encrypted.
pub fn split(raw: &Parameters) -> Result<(Option<Encryption>, Parameters)> {
    const KEYS: [&str; 8] = ENCRYPTION_KEYS;
    let rest: Parameters = raw
        .iter()
        .filter(|(k, _)| !KEYS.contains(&k.as_str()))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    let encrypted = match raw.get(ENCRYPTED_KEY).map(String::as_str) {
        Some("true") => true,
        None | Some("false") => false,
        Some(other) => return Err(bad(ENCRYPTED_KEY, other, "either \"true\" or \"false\"")),
    };
    if !encrypted {
        if let Some(key) = KEYS[1..].iter().find(|k| raw.contains_key(**k)) {
            let value = raw.get(*key).map(String::as_str).unwrap_or_default();
            return Err(bad(key, value, "only for a volume with encrypted=\"true\""));
        }
        return Ok((None, rest));
    }
    let kms_id = raw.get(KMS_ID_KEY).ok_or_else(|| {
        Error::invalid(
            "parameters",
            format!("{KMS_ID_KEY} is required with {ENCRYPTED_KEY}=\"true\""),
        )
    })?;
    if !KMS_IDS.contains(&kms_id.as_str()) {
        let why = format!("not a key source moor knows ({})", KMS_IDS.join(", "));
        return Err(bad(KMS_ID_KEY, kms_id, why));
    }
    let names: Vec<&'static str> = CIPHERS.iter().map(|c| c.name).collect();
    let name = one_of(raw, CIPHER_KEY, &names, |v| {
        names.iter().copied().find(|n| *n == v)
    })?
    .unwrap_or_default();
    let cipher = CIPHERS
        .iter()
        .find(|c| c.name == name)
        .unwrap_or(&CIPHERS[0]);
    let key_size = one_of(raw, KEY_SIZE_KEY, cipher.key_sizes, |v| v.parse().ok())
        .map_err(|e| with_cipher(e, cipher.name))?
        .unwrap_or_default();
    let sector_size =
        one_of(raw, SECTOR_SIZE_KEY, &SECTOR_SIZES, |v| v.parse().ok())?.unwrap_or_default();
    let pbkdf = one_of(raw, PBKDF_KEY, &PBKDFS, |v| {
        PBKDFS.iter().copied().find(|p| *p == v)
    })?
    .unwrap_or_default();
    let tpm2_pcrs = match raw.get(TPM2_PCRS_KEY) {
        None => None,
        Some(v) if kms_id != moor_runtime::keys::source::KMS_TPM2 => {
            return Err(bad(TPM2_PCRS_KEY, v, "only with kmsID=\"tpm2\""));
        }
        Some(v) => Some(moor_runtime::keys::tpm2::pcr_selection(v).map_err(|_| {
            bad(
                TPM2_PCRS_KEY,
                v,
                "<bank>:<index>[,<index>...], the bank sha1, sha256 or sha384, indices 0 to 23",
            )
        })?),
    };
    let rotation_schedule = match raw.get(KEY_ROTATION_SCHEDULE_KEY) {
        None => None,
        Some(v) => {
            moor_runtime::keys::schedule::period(v)
                .map_err(|why| bad(KEY_ROTATION_SCHEDULE_KEY, v, why))?;
            Some(v.clone())
        }
    };
    Ok((
        Some(Encryption {
            kms_id: kms_id.clone(),
            cipher: cipher.name,
            key_size,
            sector_size,
            pbkdf,
            tpm2_pcrs,
            rotation_schedule,
        }),
        rest,
    ))
}

/// Says which cipher a key size was refused for.
fn with_cipher(e: Error, cipher: &str) -> Error {
    match e {
        Error::InvalidArgument { field, reason } => Error::InvalidArgument {
            field,
            reason: format!("{reason} (for {cipher})"),
        },
        other => other,
    }
}

/// Whether a volume made with `parameters` (normalised) is encrypted.
#[must_use]
pub fn is_encrypted(parameters: &Parameters) -> bool {
    parameters.get(ENCRYPTED_KEY).is_some_and(|v| v == "true")
}

/// `raw` split by [`split`], the rest parsed by the backend's `parse`, and the two put back
/// together, normalised: what a volume's record keeps.
pub fn parse_with(
    raw: &Parameters,
    parse: impl FnOnce(&Parameters) -> Result<Parameters>,
) -> Result<(Option<Encryption>, Parameters)> {
    let (encryption, rest) = split(raw)?;
    let mut parameters = parse(&rest)?;
    if let Some(e) = &encryption {
        parameters.extend(e.parameters());
    }
    Ok((encryption, parameters))
}

/// The key source `kms_id` names, configured by a call's CSI secrets (the StorageClass's
/// provisioner secret at CreateVolume). A missing or malformed field is INVALID_ARGUMENT
/// naming the secrets key, never its value.
pub fn kek_from_secrets(
    kms_id: &str,
    secrets: &std::collections::HashMap<String, String>,
) -> Result<moor_runtime::keys::source::KeySource> {
    moor_runtime::keys::source::KeySource::from_secrets(kms_id, |k| {
        secrets.get(k).map(String::as_str)
    })
    .map_err(|e| {
        Error::invalid(
            "secrets",
            format!(
                "{e}: an encrypted volume's key source {kms_id:?} is configured by the \
                 provisioner secret (csi.storage.k8s.io/provisioner-secret-name); for {:?}: \
                 {:?} and {:?}",
                KMS_IDS[0],
                moor_runtime::keys::SECRET_KEK_KEY,
                moor_runtime::keys::SECRET_KEK_ID_KEY
            ),
        )
    })
}

/// A new data key for `volume_id`, wrapped by `kek`: the text its record keeps. A key server
/// that cannot be reached: UNAVAILABLE; one that refuses: FAILED_PRECONDITION.
pub fn new_wrapped_dek(
    kek: &moor_runtime::keys::source::KeySource,
    volume_id: &str,
) -> Result<String> {
    let dek = moor_runtime::keys::Dek::generate()
        .map_err(|e| Error::Internal(format!("volume {volume_id:?}: {e}")))?;
    wrap_for(&dek, kek, volume_id)
}

/// What a copy of a volume (a snapshot, a clone) carries of its encryption: the volume's
/// `encrypted`, `kmsID` and `luks*` parameters and its wrapped data key (`encryptedDEK`, from
/// its context); empty for a volume in the clear.
#[must_use]
pub fn of_volume(parameters: &Parameters, context: &Parameters) -> Parameters {
    if !is_encrypted(parameters) {
        return Parameters::new();
    }
    let mut carried: Parameters = parameters
        .iter()
        .filter(|(k, _)| ENCRYPTION_KEYS.contains(&k.as_str()))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    if let Some(w) = context.get(moor_runtime::contract::ENCRYPTED_DEK_KEY) {
        carried.insert(
            moor_runtime::contract::ENCRYPTED_DEK_KEY.to_owned(),
            w.clone(),
        );
    }
    carried
}

/// What a copy carries ([`of_volume`]) with the data key its source's record holds now
/// (`keys`; `None`: the context's, no rotation yet). A source whose rotation is pending is
/// FAILED_PRECONDITION, nothing made: its header may open with either key, a copy carries one.
pub fn with_record_key(
    mut carried: Parameters,
    keys: Option<&rotation::RecordKeys>,
    source_id: &str,
) -> Result<Parameters> {
    let Some(keys) = keys.filter(|_| !carried.is_empty()) else {
        return Ok(carried);
    };
    if keys.pending.is_some() {
        return Err(Error::FailedPrecondition(format!(
            "volume {:?}: a rotation of its data key is pending; finish it (moorctl \
             rotate-key --controller) before copying the volume",
            trunc(source_id)
        )));
    }
    carried.insert(
        moor_runtime::contract::ENCRYPTED_DEK_KEY.to_owned(),
        keys.current.clone(),
    );
    Ok(carried)
}

/// The encryption parameters among `params` (`encrypted`, `kmsID`, `luks*`): what a volume's
/// context carries to the node, and what a copy is made with (its source's, from
/// [`of_volume`], whatever its class says: the copy holds its source's LUKS header, and a
/// class's LUKS parameters apply to a volume made blank).
#[must_use]
pub fn encryption_parameters(params: &Parameters) -> Parameters {
    params
        .iter()
        .filter(|(k, _)| ENCRYPTION_KEYS.contains(&k.as_str()))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

/// The data key of a copy of an encrypted volume: its source's (the copy holds the source's
/// LUKS header, whose one key slot the source's data key opens), unwrapped with `kek` (the
/// provisioner secret's) for `source_id`, the volume it was wrapped for; taken before the
/// copy is made, so that a KEK that does not unwrap it makes nothing. A source without a
/// wrapped key: INTERNAL; one `kek` does not unwrap: INVALID_ARGUMENT naming the secrets, no
/// key byte in either.
pub fn source_dek(
    carried: &Parameters,
    source_id: &str,
    kek: &moor_runtime::keys::source::KeySource,
) -> Result<moor_runtime::keys::Dek> {
    refuse_node_bound_copy(carried, source_id)?;
    let text = carried
        .get(moor_runtime::contract::ENCRYPTED_DEK_KEY)
        .ok_or_else(|| {
            Error::Internal(format!(
                "the encrypted source volume {:?} has no wrapped data key",
                trunc(source_id)
            ))
        })?;
    let wrapped = moor_runtime::keys::WrappedDek::decode(text)
        .map_err(|e| Error::Internal(format!("volume {:?}: {e}", trunc(source_id))))?;
    kek.unwrap(&wrapped, source_id).map_err(|e| match e {
        moor_runtime::keys::KeyError::Unavailable(m) => {
            Error::Unavailable(format!("volume {:?}: {m}", trunc(source_id)))
        }
        e => Error::invalid(
            "secrets",
            format!(
                "{e}: a copy of encrypted volume {:?} opens with its data key, which the \
                 provisioner secret's key-encryption key must unwrap",
                trunc(source_id)
            ),
        ),
    })
}

/// A copy of a volume whose key is split with a node's TPM (`tpm2`): refused with
/// INVALID_ARGUMENT. The node's half is bound to the volume's id, so the source's LUKS header
/// would not open under the copy's id.
fn refuse_node_bound_copy(carried: &Parameters, source_id: &str) -> Result<()> {
    if carried.get(KMS_ID_KEY).map(String::as_str) == Some(moor_runtime::keys::source::KMS_TPM2) {
        return Err(Error::invalid(
            "volume_content_source",
            format!(
                "volume {:?} is encrypted with a key split with its node's TPM ({KMS_ID_KEY} \
                 {:?}), whose half is bound to the volume's id: a copy of it could not open",
                trunc(source_id),
                moor_runtime::keys::source::KMS_TPM2
            ),
        ));
    }
    Ok(())
}

/// `dek` wrapped by `kek` for `volume_id`: the text its record keeps.
pub fn wrap_for(
    dek: &moor_runtime::keys::Dek,
    kek: &moor_runtime::keys::source::KeySource,
    volume_id: &str,
) -> Result<String> {
    use moor_runtime::keys::KeyError;
    let wrapped = kek.wrap(dek, volume_id).map_err(|e| match e {
        KeyError::Unavailable(m) => Error::Unavailable(format!("volume {volume_id:?}: {m}")),
        KeyError::Refused(m) => Error::FailedPrecondition(format!("volume {volume_id:?}: {m}")),
        e => Error::Internal(e.to_string()),
    })?;
    Ok(wrapped.encode())
}

/// CreateVolume's answer to an encrypted class on a backend that does not keep encrypted
/// volumes' keys: refused, so that nothing meant to be encrypted is made in the clear.
pub fn refuse_backend() -> Error {
    Error::invalid(
        "parameters",
        format!(
            "{ENCRYPTED_KEY}=\"true\": this backend does not serve encrypted volumes; \
             refused rather than made in the clear"
        ),
    )
}

/// The answer to a copy the backend cannot keep encrypted (a group snapshot holding an
/// encrypted volume; any copy on a backend that does not keep keys): refused, never made in
/// the clear.
pub fn refuse_copy(what: &str) -> Error {
    Error::invalid(
        "volume_content_source",
        format!(
            "{what}: this copy of an encrypted volume is not served by this version of moor \
             (docs/encryption.md); refused rather than made in the clear"
        ),
    )
}

/// The answer to a clone or a restore that would cross between encrypted and clear: an
/// encrypted source into a class in the clear (a clear copy of encrypted data), or a clear
/// source into an encrypted class (data in the clear that a volume would claim encrypted).
pub fn refuse_mixed_copy(what: &str, source_encrypted: bool) -> Error {
    let why = if source_encrypted {
        "the source is encrypted and the class is not: the copy would be the source's \
         ciphertext under a class that says clear (a copy is never made in the clear)"
    } else {
        "the source is in the clear and the class is encrypted: the copy would hold the \
         source's data in the clear (a volume is never encrypted in place)"
    };
    Error::invalid("volume_content_source", format!("{what}: {why}; refused"))
}

#[cfg(test)]
mod tests;
