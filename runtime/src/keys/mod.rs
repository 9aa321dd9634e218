//! The keys of an encrypted volume (see docs/encryption.md): its data key ([`Dek`], the
//! passphrase of its LUKS key slot), the key-encryption key that wraps it ([`Kek`]), the
//! wrapped form that is stored with the volume ([`WrappedDek`]), and the simplest key source,
//! a Kubernetes Secret given as CSI secrets ([`kek_from_secret`]).
//!
//! Both daemons use it: the controller makes and wraps a volume's DEK, the node unwraps it at
//! stage. Key bytes never leave this module but through [`Dek::expose`] (for the pipe to
//! cryptsetup): `Dek` and `Kek` have no `Display`, their `Debug` shows no byte of them, no
//! [`KeyError`] holds one, and both are zeroed when dropped.
//!
//! Wrapping is AES-256-GCM: a fresh random 96-bit nonce per wrap, and the volume's id and the
//! KEK's id as associated data, so a wrapped DEK unwraps only for the volume it was made for,
//! and a wrong KEK or a damaged wrapped key is an error, never a wrong key.

use std::fmt;

use aes_gcm::aead::{Aead, KeyInit, Payload};
use aes_gcm::{Aes256Gcm, Nonce};
use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use zeroize::{Zeroize, Zeroizing};

mod rewrap;
pub use rewrap::{key_pair, rewrap};

/// The length of a DEK and of a KEK, in bytes.
pub const KEY_LEN: usize = 32;

/// The length of an AES-GCM nonce, in bytes.
const NONCE_LEN: usize = 12;

/// The length of an AES-GCM tag, in bytes.
const TAG_LEN: usize = 16;

/// The CSI secrets key of the [`kek_from_secret`] source holding the KEK, in base64.
pub const SECRET_KEK_KEY: &str = "kek";

/// The CSI secrets key of the [`kek_from_secret`] source naming the KEK.
pub const SECRET_KEK_ID_KEY: &str = "kekID";

/// The longest KEK id.
const MAX_KEK_ID_LEN: usize = 64;

/// The version tag of [`WrappedDek::encode`]'s text.
const WRAPPED_V1: &str = "v1";

/// Why a key could not be made, read, wrapped or unwrapped. No variant holds a key byte.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    /// The OS's random source failed.
    #[error("no random bytes from the kernel for a new key: {0}")]
    Random(String),
    /// A key source lacks a field.
    #[error("the key source has no {0:?}")]
    Missing(&'static str),
    /// A key source's field is malformed; says how, never what it holds.
    #[error("the key source's {field:?} {problem}")]
    Malformed {
        /// The field.
        field: &'static str,
        /// What is wrong with it, without its value.
        problem: String,
    },
    /// A wrapped DEK's text is not one [`WrappedDek::encode`] makes.
    #[error("the wrapped data key is damaged: {0}")]
    Damaged(String),
    /// The wrapped DEK was made under another KEK than the one given.
    #[error(
        "the data key of volume {volume:?} is wrapped by the key {wrapped_by:?}, not by {given:?}"
    )]
    OtherKek {
        /// The volume.
        volume: String,
        /// The KEK id the wrapped DEK names.
        wrapped_by: String,
        /// The KEK id given.
        given: String,
    },
    /// AES-GCM refused: a wrong KEK (under the right id), a wrapped DEK of another volume,
    /// or a damaged one.
    #[error(
        "the key {kek_id:?} does not unwrap the data key of volume {volume:?}: a wrong key, \
         a data key of another volume, or a damaged record"
    )]
    Unwrap {
        /// The volume.
        volume: String,
        /// The KEK id.
        kek_id: String,
    },
    /// A key server (KMIP) could not be reached or answered nonsense: the call may succeed
    /// later (UNAVAILABLE).
    #[error("{0}")]
    Unavailable(String),
    /// A key server refused: no such key, not allowed, a wrapped key that does not verify
    /// (FAILED_PRECONDITION: the key source must change first).
    #[error("{0}")]
    Refused(String),
    /// AES-GCM could not wrap (it cannot fail for a 32-byte key; kept so no call panics).
    #[error("the data key of volume {0:?} could not be wrapped")]
    Wrap(String),
}

/// What the key functions return.
pub type Result<T> = std::result::Result<T, KeyError>;

/// 32 secret bytes on the heap (moved as a pointer, never copied on the stack), zeroed when
/// dropped.
struct Secret(Box<[u8; KEY_LEN]>);

impl Secret {
    /// All zeros, to be filled in place.
    fn zeroed() -> Self {
        Self(Box::new([0; KEY_LEN]))
    }

    /// `bytes`, which must be [`KEY_LEN`] long.
    fn from_slice(bytes: &[u8]) -> Option<Self> {
        let mut secret = Self::zeroed();
        secret
            .0
            .as_mut_slice()
            .copy_from_slice(bytes.get(..KEY_LEN)?);
        (bytes.len() == KEY_LEN).then_some(secret)
    }

    /// Random bytes from the kernel (`getrandom(2)`).
    fn random() -> Result<Self> {
        let mut secret = Self::zeroed();
        let mut filled = 0;
        while let Some(rest) = secret.0.get_mut(filled..).filter(|r| !r.is_empty()) {
            let n = rustix::rand::getrandom(rest, rustix::rand::GetRandomFlags::empty())
                .map_err(|e| KeyError::Random(e.to_string()))?;
            filled += n;
        }
        Ok(secret)
    }
}

impl Drop for Secret {
    fn drop(&mut self) {
        self.0.zeroize();
    }
}

/// A volume's data key: the passphrase of its LUKS key slot. Never printed, zeroed on drop.
pub struct Dek(Secret);

impl Dek {
    /// A new random data key.
    pub fn generate() -> Result<Self> {
        Secret::random().map(Self)
    }

    /// The key's bytes, for the one place they go: the pipe to cryptsetup.
    #[must_use]
    pub fn expose(&self) -> &[u8] {
        self.0.0.as_slice()
    }

    /// Wraps the key under `kek` for `volume`.
    pub fn wrap(&self, kek: &Kek, volume: &str) -> Result<WrappedDek> {
        let nonce: [u8; NONCE_LEN] = Secret::random().map(|s| {
            let mut n = [0; NONCE_LEN];
            n.copy_from_slice(&s.0[..NONCE_LEN]);
            n
        })?;
        let aad = associated_data(volume, &kek.id);
        let refused = || KeyError::Wrap(volume.to_owned());
        let sealed = kek
            .cipher()
            .ok_or_else(refused)?
            .encrypt(
                &Nonce::from(nonce),
                Payload {
                    msg: self.expose(),
                    aad: &aad,
                },
            )
            .map_err(|_| refused())?;
        Ok(WrappedDek {
            kek_id: kek.id.clone(),
            nonce,
            sealed,
        })
    }
}

impl Zeroize for Dek {
    fn zeroize(&mut self) {
        self.0.0.zeroize();
    }
}

impl fmt::Debug for Dek {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Dek(..)")
    }
}

/// A key-encryption key and its id. Never printed but by its id, zeroed on drop.
pub struct Kek {
    /// Names the key: recorded with every DEK it wraps.
    id: String,
    /// The key.
    key: Secret,
}

impl Kek {
    /// A KEK of `bytes` (exactly [`KEY_LEN`]) named `id` (1 to 64 of `[A-Za-z0-9._-]`).
    pub fn new(id: &str, bytes: &[u8]) -> Result<Self> {
        check_kek_id(id)?;
        let key = Secret::from_slice(bytes).ok_or_else(|| KeyError::Malformed {
            field: SECRET_KEK_KEY,
            problem: format!("is {} bytes long, not {KEY_LEN}", bytes.len()),
        })?;
        Ok(Self {
            id: id.to_owned(),
            key,
        })
    }

    /// The KEK's id.
    #[must_use]
    pub fn id(&self) -> &str {
        &self.id
    }

    /// Unwraps `wrapped`, the data key of `volume`.
    pub fn unwrap(&self, wrapped: &WrappedDek, volume: &str) -> Result<Dek> {
        if wrapped.kek_id != self.id {
            return Err(KeyError::OtherKek {
                volume: volume.to_owned(),
                wrapped_by: wrapped.kek_id.clone(),
                given: self.id.clone(),
            });
        }
        let refused = || KeyError::Unwrap {
            volume: volume.to_owned(),
            kek_id: self.id.clone(),
        };
        let aad = associated_data(volume, &self.id);
        let opened = self
            .cipher()
            .ok_or_else(refused)?
            .decrypt(
                &Nonce::from(wrapped.nonce),
                Payload {
                    msg: &wrapped.sealed,
                    aad: &aad,
                },
            )
            .map(Zeroizing::new)
            .map_err(|_| refused())?;
        Secret::from_slice(&opened).map(Dek).ok_or_else(refused)
    }

    /// The AES-256-GCM cipher of this key (its key schedule zeroed when dropped); `None`
    /// never happens (the key is always [`KEY_LEN`] bytes).
    fn cipher(&self) -> Option<Aes256Gcm> {
        Aes256Gcm::new_from_slice(self.key.0.as_slice()).ok()
    }
}

impl fmt::Debug for Kek {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Kek")
            .field("id", &self.id)
            .finish_non_exhaustive()
    }
}

/// What AES-GCM authenticates besides the key: the format, the volume and the KEK's id.
fn associated_data(volume: &str, kek_id: &str) -> Vec<u8> {
    [
        b"moor-dek-v1".as_slice(),
        volume.as_bytes(),
        kek_id.as_bytes(),
    ]
    .join(&0u8)
}

/// A KEK id is 1 to 64 of `[A-Za-z0-9._-]`: it is written into [`WrappedDek::encode`]'s text.
fn check_kek_id(id: &str) -> Result<()> {
    let ok = (1..=MAX_KEK_ID_LEN).contains(&id.len())
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if ok {
        Ok(())
    } else {
        Err(KeyError::Malformed {
            field: SECRET_KEK_ID_KEY,
            problem: format!("must be 1 to {MAX_KEK_ID_LEN} of A-Z, a-z, 0-9, '.', '_', '-'"),
        })
    }
}

/// A DEK wrapped by a KEK: not secret, stored with the volume.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WrappedDek {
    /// The id of the KEK that wrapped it.
    kek_id: String,
    /// The AES-GCM nonce.
    nonce: [u8; NONCE_LEN],
    /// The ciphertext and its tag.
    sealed: Vec<u8>,
}

impl WrappedDek {
    /// The id of the KEK that wrapped it.
    #[must_use]
    pub fn kek_id(&self) -> &str {
        &self.kek_id
    }

    /// As stored: `v1:<kek id>:<base64 of nonce, ciphertext and tag>`.
    #[must_use]
    pub fn encode(&self) -> String {
        let mut raw = Vec::with_capacity(NONCE_LEN + self.sealed.len());
        raw.extend_from_slice(&self.nonce);
        raw.extend_from_slice(&self.sealed);
        format!("{WRAPPED_V1}:{}:{}", self.kek_id, BASE64.encode(raw))
    }

    /// The text [`encode`](Self::encode) makes.
    pub fn decode(text: &str) -> Result<Self> {
        let damaged = |what: &str| KeyError::Damaged(what.to_owned());
        let mut parts = text.splitn(3, ':');
        let (Some(version), Some(kek_id), Some(body)) = (parts.next(), parts.next(), parts.next())
        else {
            return Err(damaged("not v1:<key id>:<base64>"));
        };
        if version != WRAPPED_V1 {
            return Err(damaged("an unknown format version"));
        }
        check_kek_id(kek_id).map_err(|_| damaged("its key id is malformed"))?;
        let raw = BASE64
            .decode(body)
            .map_err(|_| damaged("its body is not base64"))?;
        if raw.len() != NONCE_LEN + KEY_LEN + TAG_LEN {
            return Err(damaged("its body has the wrong length"));
        }
        let (nonce, sealed) = raw.split_at(NONCE_LEN);
        Ok(Self {
            kek_id: kek_id.to_owned(),
            nonce: nonce.try_into().map_err(|_| damaged("no nonce"))?,
            sealed: sealed.to_vec(),
        })
    }
}

/// The KEK of the `secret` key source: CSI secrets (a Kubernetes Secret the StorageClass
/// names) holding [`SECRET_KEK_KEY`], 32 bytes in base64, and [`SECRET_KEK_ID_KEY`], its id.
/// `get` looks a key up in the request's secrets.
pub fn kek_from_secret<'a>(get: impl Fn(&str) -> Option<&'a str>) -> Result<Kek> {
    let id = get(SECRET_KEK_ID_KEY).ok_or(KeyError::Missing(SECRET_KEK_ID_KEY))?;
    let encoded = get(SECRET_KEK_KEY).ok_or(KeyError::Missing(SECRET_KEK_KEY))?;
    // base64's own error names the offending byte: it is not passed on.
    let bytes = BASE64
        .decode(encoded.trim())
        .map(Zeroizing::new)
        .map_err(|_| KeyError::Malformed {
            field: SECRET_KEK_KEY,
            problem: "is not base64".to_owned(),
        })?;
    Kek::new(id, &bytes)
}

/// The CSI secrets of the [`kek_from_secret`] source for the KEK `bytes` named `id`, as a
/// Kubernetes Secret holds them: [`SECRET_KEK_KEY`] (base64) and [`SECRET_KEK_ID_KEY`]. For
/// what makes such a Secret (an operator's tool, the tests); the text holds the key.
#[must_use]
pub fn secret_entries(id: &str, bytes: &[u8]) -> [(String, String); 2] {
    [
        (SECRET_KEK_KEY.to_owned(), BASE64.encode(bytes)),
        (SECRET_KEK_ID_KEY.to_owned(), id.to_owned()),
    ]
}

pub mod kmip;
pub mod schedule;
pub mod source;
pub mod tpm2;

#[cfg(test)]
mod tests;
