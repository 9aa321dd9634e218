//! The key sources and the choice between them by a volume's `kmsID` (see docs/encryption.md):
//! one type the controller wraps with and the node unwraps with, whatever holds the KEK.

use super::kmip::{KMIP_ENDPOINT_KEY, KmipConfig};
pub use super::tpm2::KMS_TPM2;
use super::{Dek, Kek, KeyError, Result, WrappedDek, kek_from_secret};

/// The `kmsID` of the Kubernetes Secret source ([`kek_from_secret`]).
pub const KMS_SECRET: &str = "secret";

/// The `kmsID` of the KMIP source ([`super::kmip`]).
pub const KMS_KMIP: &str = "kmip";

/// Every `kmsID` moor knows.
pub const KMS_IDS: &[&str] = &[KMS_SECRET, KMS_KMIP, KMS_TPM2];

/// Where a volume's KEK is, as its `kmsID` and the request's CSI secrets say.
#[derive(Debug)]
pub enum KeySource {
    /// The KEK itself, from a Kubernetes Secret: moor wraps and unwraps.
    Secret(Kek),
    /// A KMIP server holding the KEK: it wraps and unwraps.
    Kmip(KmipConfig),
}

impl KeySource {
    /// The source `kms_id` names, configured from the CSI secrets `get` looks up. An unknown
    /// `kms_id` is [`KeyError::Malformed`] (the StorageClass's `kmsID`). For [`KMS_TPM2`] it is
    /// the cluster half's source: a KMIP server when the secrets name one, else the Secret's
    /// KEK; the node then combines the DEK with its TPM's half ([`super::tpm2::combine`]).
    pub fn from_secrets<'a>(kms_id: &str, get: impl Fn(&str) -> Option<&'a str>) -> Result<Self> {
        match kms_id {
            KMS_SECRET => kek_from_secret(get).map(Self::Secret),
            KMS_KMIP => KmipConfig::from_secrets(get).map(Self::Kmip),
            KMS_TPM2 if get(KMIP_ENDPOINT_KEY).is_some() => {
                KmipConfig::from_secrets(get).map(Self::Kmip)
            }
            KMS_TPM2 => kek_from_secret(get).map(Self::Secret),
            _ => Err(KeyError::Malformed {
                field: "kmsID",
                problem: format!("is none of {KMS_IDS:?}"),
            }),
        }
    }

    /// The source a data key rotation's secrets configure (`moorctl rotate-key`, the node's
    /// scheduled rotation): a KMIP server when they name one (`KMIP_ENDPOINT`), else the
    /// Secret's KEK (`kek`, `kekID`).
    pub fn for_rotation<'a>(get: impl Fn(&str) -> Option<&'a str>) -> Result<Self> {
        let kms = if get(KMIP_ENDPOINT_KEY).is_some() {
            KMS_KMIP
        } else {
            KMS_SECRET
        };
        Self::from_secrets(kms, get)
    }

    /// Whether wrapping and unwrapping ask a server over the network (and so block: an async
    /// caller runs them on a blocking thread).
    #[must_use]
    pub fn is_remote(&self) -> bool {
        matches!(self, Self::Kmip(_))
    }

    /// The id of the KEK: recorded with every DEK it wraps.
    #[must_use]
    pub fn kek_id(&self) -> &str {
        match self {
            Self::Secret(k) => k.id(),
            Self::Kmip(c) => &c.kek_id,
        }
    }

    /// `dek` wrapped for `volume`.
    pub fn wrap(&self, dek: &Dek, volume: &str) -> Result<WrappedDek> {
        match self {
            Self::Secret(k) => dek.wrap(k, volume),
            Self::Kmip(c) => c.wrap(dek, volume),
        }
    }

    /// The data key of `volume`, unwrapped.
    pub fn unwrap(&self, wrapped: &WrappedDek, volume: &str) -> Result<Dek> {
        match self {
            Self::Secret(k) => k.unwrap(wrapped, volume),
            Self::Kmip(c) => c.unwrap(wrapped, volume),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kms_id_chooses_the_source_and_an_unknown_one_is_refused() {
        let entries = super::super::secret_entries("kek-1", &[7; 32]);
        let get = |k: &str| {
            entries
                .iter()
                .find(|(n, _)| n == k)
                .map(|(_, v)| v.as_str())
        };
        let secret = KeySource::from_secrets(KMS_SECRET, get).expect("secret source");
        assert!(!secret.is_remote());
        assert_eq!(secret.kek_id(), "kek-1");
        let dek = Dek::generate().expect("dek");
        let wrapped = secret.wrap(&dek, "vol-1").expect("wrap");
        assert_eq!(
            secret.unwrap(&wrapped, "vol-1").expect("unwrap").expose(),
            dek.expose()
        );
        // The Secret's fields are not a KMIP configuration.
        assert_eq!(
            KeySource::from_secrets(KMS_KMIP, get).expect_err("kmip"),
            KeyError::Missing(super::super::kmip::KMIP_ENDPOINT_KEY)
        );
        let e = KeySource::from_secrets("vault", get).expect_err("unknown");
        assert!(
            matches!(e, KeyError::Malformed { field: "kmsID", .. }),
            "{e:?}"
        );
    }
}
