//! The `kmip` key source (see docs/encryption.md): the KEK is a symmetric key held in a KMIP
//! server, and the server wraps and unwraps a volume's DEK (KMIP Encrypt and Decrypt, AES-256-GCM
//! with moor's nonce and the volume's associated data). The KEK never leaves the server: moor
//! never asks for it (no KMIP Get), so a node that is stolen, or a Secret that leaks, gives an
//! attacker at most the right to ask the server, which the server's operator revokes.
//!
//! The wrapped DEK has the same text as the `secret` source's ([`WrappedDek`]): the KMIP
//! object's Unique Identifier as the key id, moor's 96-bit nonce, the ciphertext and the
//! 128-bit tag. Which source unwraps it is the volume's `kmsID`.
//!
//! The protocol: KMIP 1.4 requests in TTLV ([`Ttlv`]), one batch item each, over TLS 1.2 or 1.3
//! with a client certificate ([`KmipConfig::connect`], rustls). Only what moor needs: Create and
//! Activate (an operator's tool and the tests make a KEK), Encrypt, Decrypt.
//!
//! Errors, as the node and the controller answer them: the server unreachable or its TLS
//! refused is [`KeyError::Unavailable`] (UNAVAILABLE: the call may succeed later); the server
//! refusing (no such key, not allowed, a tag that does not verify) is [`KeyError::Refused`]
//! (FAILED_PRECONDITION: the key source must change first); a malformed configuration is
//! [`KeyError::Missing`] or [`KeyError::Malformed`] (INVALID_ARGUMENT).

use std::fmt;
use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::sync::Arc;
use std::time::Duration;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use zeroize::Zeroizing;

use super::{
    Dek, KEY_LEN, KeyError, NONCE_LEN, Result, Secret, TAG_LEN, WrappedDek, associated_data,
    check_kek_id,
};

/// The CSI secrets key of the server's address, `host:port` (ceph-csi's name for it).
pub const KMIP_ENDPOINT_KEY: &str = "KMIP_ENDPOINT";
/// The CSI secrets key of the CA certificates (PEM) the server's certificate must chain to.
pub const KMIP_CA_CERT_KEY: &str = "CA_CERT";
/// The CSI secrets key of moor's client certificate (PEM, with its chain).
pub const KMIP_CLIENT_CERT_KEY: &str = "CLIENT_CERT";
/// The CSI secrets key of the client certificate's private key (PEM).
pub const KMIP_CLIENT_KEY_KEY: &str = "CLIENT_KEY";
/// The CSI secrets key of the KEK's KMIP Unique Identifier.
pub const KMIP_UNIQUE_IDENTIFIER_KEY: &str = "UNIQUE_IDENTIFIER";
/// The CSI secrets key of the name the server's certificate must carry (optional: the
/// endpoint's host).
pub const KMIP_TLS_SERVER_NAME_KEY: &str = "TLS_SERVER_NAME";
/// The CSI secrets key of the seconds connecting and reading an answer may take (optional).
pub const KMIP_READ_TIMEOUT_KEY: &str = "READ_TIMEOUT";
/// The CSI secrets key of the seconds writing a request may take (optional).
pub const KMIP_WRITE_TIMEOUT_KEY: &str = "WRITE_TIMEOUT";

/// How long an exchange may take when the configuration does not say.
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);

/// The deepest nesting of structures moor decodes (its messages are 5 deep).
const MAX_DEPTH: usize = 16;

/// The largest response moor reads: its responses are a few hundred bytes.
const MAX_MESSAGE: usize = 64 * 1024;

/// The KMIP protocol version moor speaks: 1.4 (Encrypt and Decrypt are 1.2, the GCM tag
/// length 1.4).
const PROTOCOL: (i32, i32) = (1, 4);

/// The KMIP tags moor uses (KMIP 1.4, section 9.1.3.1).
pub mod tag {
    #![allow(missing_docs)]
    pub const ATTRIBUTE: u32 = 0x42_0008;
    pub const ATTRIBUTE_NAME: u32 = 0x42_000A;
    pub const ATTRIBUTE_VALUE: u32 = 0x42_000B;
    pub const BATCH_COUNT: u32 = 0x42_000D;
    pub const BATCH_ITEM: u32 = 0x42_000F;
    pub const BLOCK_CIPHER_MODE: u32 = 0x42_0011;
    pub const CRYPTOGRAPHIC_ALGORITHM: u32 = 0x42_0028;
    pub const CRYPTOGRAPHIC_LENGTH: u32 = 0x42_002A;
    pub const CRYPTOGRAPHIC_PARAMETERS: u32 = 0x42_002B;
    pub const CRYPTOGRAPHIC_USAGE_MASK: u32 = 0x42_002C;
    pub const IV_COUNTER_NONCE: u32 = 0x42_003D;
    pub const OBJECT_TYPE: u32 = 0x42_0057;
    pub const OPERATION: u32 = 0x42_005C;
    pub const PROTOCOL_VERSION: u32 = 0x42_0069;
    pub const PROTOCOL_VERSION_MAJOR: u32 = 0x42_006A;
    pub const PROTOCOL_VERSION_MINOR: u32 = 0x42_006B;
    pub const REQUEST_HEADER: u32 = 0x42_0077;
    pub const REQUEST_MESSAGE: u32 = 0x42_0078;
    pub const REQUEST_PAYLOAD: u32 = 0x42_0079;
    pub const RESPONSE_HEADER: u32 = 0x42_007A;
    pub const RESPONSE_MESSAGE: u32 = 0x42_007B;
    pub const RESPONSE_PAYLOAD: u32 = 0x42_007C;
    pub const RESULT_MESSAGE: u32 = 0x42_007D;
    pub const RESULT_REASON: u32 = 0x42_007E;
    pub const RESULT_STATUS: u32 = 0x42_007F;
    pub const TEMPLATE_ATTRIBUTE: u32 = 0x42_0091;
    pub const TIME_STAMP: u32 = 0x42_0092;
    pub const UNIQUE_IDENTIFIER: u32 = 0x42_0094;
    pub const DATA: u32 = 0x42_00C2;
    pub const TAG_LENGTH: u32 = 0x42_00CE;
    pub const AUTHENTICATED_ENCRYPTION_ADDITIONAL_DATA: u32 = 0x42_00FE;
    pub const AUTHENTICATED_ENCRYPTION_TAG: u32 = 0x42_00FF;
}

/// KMIP operations moor sends.
pub mod operation {
    #![allow(missing_docs)]
    pub const CREATE: u32 = 0x01;
    pub const ACTIVATE: u32 = 0x12;
    pub const ENCRYPT: u32 = 0x1F;
    pub const DECRYPT: u32 = 0x20;
}

/// Result Status: Success.
const STATUS_SUCCESS: u32 = 0;
/// Object Type: Symmetric Key.
const OBJECT_SYMMETRIC_KEY: u32 = 0x02;
/// Cryptographic Algorithm: AES.
const ALGORITHM_AES: u32 = 0x03;
/// Block Cipher Mode: GCM.
const MODE_GCM: u32 = 0x09;
/// Cryptographic Usage Mask: Encrypt | Decrypt.
const USAGE_ENCRYPT_DECRYPT: i32 = 0x04 | 0x08;

/// The TTLV item types (KMIP 1.4, section 9.1.1.2).
mod item_type {
    pub const STRUCTURE: u8 = 0x01;
    pub const INTEGER: u8 = 0x02;
    pub const LONG_INTEGER: u8 = 0x03;
    pub const BIG_INTEGER: u8 = 0x04;
    pub const ENUMERATION: u8 = 0x05;
    pub const BOOLEAN: u8 = 0x06;
    pub const TEXT_STRING: u8 = 0x07;
    pub const BYTE_STRING: u8 = 0x08;
    pub const DATE_TIME: u8 = 0x09;
    pub const INTERVAL: u8 = 0x0A;
}

/// A TTLV value. Byte strings (which may hold a key) are zeroed when dropped and never shown
/// by `Debug` but by their length.
#[derive(Clone, PartialEq, Eq)]
pub enum Value {
    /// Items in order.
    Structure(Vec<Ttlv>),
    /// A 32-bit signed integer.
    Integer(i32),
    /// A 64-bit signed integer.
    LongInteger(i64),
    /// A big integer's two's complement bytes, big-endian, a multiple of 8 long.
    BigInteger(Vec<u8>),
    /// A 32-bit enumeration value.
    Enumeration(u32),
    /// A boolean.
    Boolean(bool),
    /// UTF-8 text.
    Text(String),
    /// Bytes (zeroed when dropped).
    Bytes(Zeroizing<Vec<u8>>),
    /// Seconds since the epoch.
    DateTime(i64),
    /// Seconds.
    Interval(u32),
}

impl fmt::Debug for Value {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Structure(items) => f.debug_list().entries(items).finish(),
            Self::Integer(v) => write!(f, "Integer({v})"),
            Self::LongInteger(v) => write!(f, "LongInteger({v})"),
            Self::BigInteger(v) => write!(f, "BigInteger({} bytes)", v.len()),
            Self::Enumeration(v) => write!(f, "Enumeration({v:#x})"),
            Self::Boolean(v) => write!(f, "Boolean({v})"),
            Self::Text(v) => write!(f, "Text({v:?})"),
            Self::Bytes(v) => write!(f, "Bytes({} bytes)", v.len()),
            Self::DateTime(v) => write!(f, "DateTime({v})"),
            Self::Interval(v) => write!(f, "Interval({v})"),
        }
    }
}

/// One TTLV item: a tag and its value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ttlv {
    /// The tag (3 bytes).
    pub tag: u32,
    /// The value.
    pub value: Value,
}

/// A TTLV item of `tag`.
#[must_use]
pub fn item(tag: u32, value: Value) -> Ttlv {
    Ttlv { tag, value }
}

/// A structure of `tag`.
#[must_use]
pub fn structure(tag: u32, items: Vec<Ttlv>) -> Ttlv {
    item(tag, Value::Structure(items))
}

/// A byte string of `tag`.
#[must_use]
pub fn bytes(tag: u32, b: &[u8]) -> Ttlv {
    item(tag, Value::Bytes(Zeroizing::new(b.to_vec())))
}

/// An enumeration of `tag`.
#[must_use]
pub fn enumeration(tag: u32, v: u32) -> Ttlv {
    item(tag, Value::Enumeration(v))
}

/// A text string of `tag`.
#[must_use]
pub fn text(tag: u32, v: &str) -> Ttlv {
    item(tag, Value::Text(v.to_owned()))
}

/// `len` rounded up to a multiple of 8.
fn padded(len: usize) -> usize {
    len.div_ceil(8) * 8
}

impl Ttlv {
    /// The TTLV encoding, appended to `out` (which the caller zeroes if it may hold a key).
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.tag.to_be_bytes()[1..]);
        let (kind, body): (u8, Zeroizing<Vec<u8>>) = match &self.value {
            Value::Structure(items) => {
                let mut inner = Vec::new();
                for i in items {
                    i.encode(&mut inner);
                }
                (item_type::STRUCTURE, Zeroizing::new(inner))
            }
            Value::Integer(v) => (item_type::INTEGER, Zeroizing::new(v.to_be_bytes().to_vec())),
            Value::LongInteger(v) => (
                item_type::LONG_INTEGER,
                Zeroizing::new(v.to_be_bytes().to_vec()),
            ),
            Value::BigInteger(v) => (item_type::BIG_INTEGER, Zeroizing::new(v.clone())),
            Value::Enumeration(v) => (
                item_type::ENUMERATION,
                Zeroizing::new(v.to_be_bytes().to_vec()),
            ),
            Value::Boolean(v) => (
                item_type::BOOLEAN,
                Zeroizing::new(u64::from(*v).to_be_bytes().to_vec()),
            ),
            Value::Text(v) => (
                item_type::TEXT_STRING,
                Zeroizing::new(v.as_bytes().to_vec()),
            ),
            Value::Bytes(v) => (item_type::BYTE_STRING, v.clone()),
            Value::DateTime(v) => (
                item_type::DATE_TIME,
                Zeroizing::new(v.to_be_bytes().to_vec()),
            ),
            Value::Interval(v) => (
                item_type::INTERVAL,
                Zeroizing::new(v.to_be_bytes().to_vec()),
            ),
        };
        out.push(kind);
        // Every length moor encodes is far below 4 GiB (a request is a few hundred bytes).
        out.extend_from_slice(&u32::try_from(body.len()).unwrap_or(u32::MAX).to_be_bytes());
        out.extend_from_slice(&body);
        out.resize(out.len() + padded(body.len()) - body.len(), 0);
    }

    /// The item at the start of `buf` and the bytes it took (its padding included).
    pub fn decode(buf: &[u8]) -> std::result::Result<(Self, usize), String> {
        Self::decode_at(buf, 0)
    }

    /// [`decode`](Self::decode) of an item `depth` structures deep: a message deeper than
    /// [`MAX_DEPTH`] is refused, not decoded on a stack it could exhaust.
    fn decode_at(buf: &[u8], depth: usize) -> std::result::Result<(Self, usize), String> {
        if depth > MAX_DEPTH {
            return Err(format!("structures nested deeper than {MAX_DEPTH}"));
        }
        let head = buf
            .get(..8)
            .ok_or("a TTLV item shorter than its 8-byte header")?;
        let tag = u32::from_be_bytes([0, head[0], head[1], head[2]]);
        let kind = head[3];
        let len = u32::from_be_bytes([head[4], head[5], head[6], head[7]]) as usize;
        let body = buf
            .get(8..8 + len)
            .ok_or_else(|| format!("item {tag:#08x} is longer than the message"))?;
        let fixed = |n: usize| -> std::result::Result<&[u8], String> {
            if len == n {
                Ok(body)
            } else {
                Err(format!(
                    "item {tag:#08x} of type {kind} has length {len}, not {n}"
                ))
            }
        };
        let be4 = |b: &[u8]| [b[0], b[1], b[2], b[3]];
        let be8 = |b: &[u8]| [b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]];
        let value = match kind {
            item_type::STRUCTURE => {
                let mut items = Vec::new();
                let mut at = 0;
                while at < body.len() {
                    let (i, used) = Self::decode_at(&body[at..], depth + 1)?;
                    items.push(i);
                    at += used;
                }
                if at != body.len() {
                    return Err(format!("structure {tag:#08x} overruns its length"));
                }
                Value::Structure(items)
            }
            item_type::INTEGER => Value::Integer(i32::from_be_bytes(be4(fixed(4)?))),
            item_type::LONG_INTEGER => Value::LongInteger(i64::from_be_bytes(be8(fixed(8)?))),
            item_type::BIG_INTEGER => Value::BigInteger(body.to_vec()),
            item_type::ENUMERATION => Value::Enumeration(u32::from_be_bytes(be4(fixed(4)?))),
            item_type::BOOLEAN => Value::Boolean(u64::from_be_bytes(be8(fixed(8)?)) != 0),
            item_type::TEXT_STRING => Value::Text(
                String::from_utf8(body.to_vec())
                    .map_err(|_| format!("text {tag:#08x} is not UTF-8"))?,
            ),
            item_type::BYTE_STRING => Value::Bytes(Zeroizing::new(body.to_vec())),
            item_type::DATE_TIME => Value::DateTime(i64::from_be_bytes(be8(fixed(8)?))),
            item_type::INTERVAL => Value::Interval(u32::from_be_bytes(be4(fixed(4)?))),
            other => return Err(format!("item {tag:#08x} has the unknown type {other}")),
        };
        let used = 8 + padded(len);
        if buf.len() < used {
            return Err(format!("item {tag:#08x} lacks its padding"));
        }
        Ok((Self { tag, value }, used))
    }

    /// The first item of this structure with `tag`.
    #[must_use]
    pub fn child(&self, tag: u32) -> Option<&Ttlv> {
        match &self.value {
            Value::Structure(items) => items.iter().find(|i| i.tag == tag),
            _ => None,
        }
    }

    /// The enumeration value of the child `tag`.
    fn enum_child(&self, tag: u32) -> Option<u32> {
        match self.child(tag)?.value {
            Value::Enumeration(v) => Some(v),
            _ => None,
        }
    }

    /// The text of the child `tag`.
    fn text_child(&self, tag: u32) -> Option<&str> {
        match &self.child(tag)?.value {
            Value::Text(v) => Some(v),
            _ => None,
        }
    }

    /// The bytes of the child `tag`.
    fn bytes_child(&self, tag: u32) -> Option<&[u8]> {
        match &self.child(tag)?.value {
            Value::Bytes(v) => Some(v),
            _ => None,
        }
    }
}

/// A request message of one batch item: `op` with `payload`.
#[must_use]
pub fn request(op: u32, payload: Vec<Ttlv>) -> Ttlv {
    structure(
        tag::REQUEST_MESSAGE,
        vec![
            structure(
                tag::REQUEST_HEADER,
                vec![
                    structure(
                        tag::PROTOCOL_VERSION,
                        vec![
                            item(tag::PROTOCOL_VERSION_MAJOR, Value::Integer(PROTOCOL.0)),
                            item(tag::PROTOCOL_VERSION_MINOR, Value::Integer(PROTOCOL.1)),
                        ],
                    ),
                    item(tag::BATCH_COUNT, Value::Integer(1)),
                ],
            ),
            structure(
                tag::BATCH_ITEM,
                vec![
                    enumeration(tag::OPERATION, op),
                    structure(tag::REQUEST_PAYLOAD, payload),
                ],
            ),
        ],
    )
}

/// The Result Reasons of a refusal moor names (KMIP 1.4, 9.1.3.2.29).
fn reason_name(reason: u32) -> &'static str {
    match reason {
        0x01 => "item not found",
        0x03 => "authentication not successful",
        0x04 => "invalid message",
        0x05 => "operation not supported",
        0x06 => "missing data",
        0x07 => "invalid field",
        0x08 => "feature not supported",
        0x0A => "cryptographic failure",
        0x0B => "illegal operation",
        0x0C => "permission denied",
        0x0D => "object archived",
        _ => "general failure",
    }
}

/// The longest part of a server's message moor repeats.
const MAX_SERVER_MESSAGE: usize = 200;

/// The payload of `response`, a response message to `op`: its batch item's Response Payload,
/// or the server's refusal as [`KeyError::Refused`].
pub fn response_payload(response: &Ttlv, op: u32) -> Result<Ttlv> {
    let bad = |what: &str| KeyError::Unavailable(format!("the KMIP server's answer {what}"));
    if response.tag != tag::RESPONSE_MESSAGE {
        return Err(bad("is not a response message"));
    }
    let batch = response
        .child(tag::BATCH_ITEM)
        .ok_or_else(|| bad("has no batch item"))?;
    let status = batch
        .enum_child(tag::RESULT_STATUS)
        .ok_or_else(|| bad("has no result status"))?;
    if status != STATUS_SUCCESS {
        let reason = batch.enum_child(tag::RESULT_REASON).unwrap_or(0x100);
        let message: String = batch
            .text_child(tag::RESULT_MESSAGE)
            .unwrap_or("")
            .chars()
            .take(MAX_SERVER_MESSAGE)
            .collect();
        return Err(KeyError::Refused(format!(
            "the KMIP server refused: {} ({message:?})",
            reason_name(reason)
        )));
    }
    if let Some(answered) = batch.enum_child(tag::OPERATION)
        && answered != op
    {
        return Err(bad("is to another operation"));
    }
    batch
        .child(tag::RESPONSE_PAYLOAD)
        .cloned()
        .ok_or_else(|| bad("has no payload"))
}

/// One request and its response: what moor needs of a connection to a KMIP server. The
/// tests' fake server is one.
pub trait Transport {
    /// Sends the encoded `request` and reads one response message, encoded.
    fn exchange(&mut self, request: &[u8]) -> std::io::Result<Zeroizing<Vec<u8>>>;
}

/// Sends `op` with `payload` over `t`, and returns the response's payload.
pub fn call(t: &mut dyn Transport, op: u32, payload: Vec<Ttlv>) -> Result<Ttlv> {
    let mut encoded = Zeroizing::new(Vec::new());
    request(op, payload).encode(&mut encoded);
    let answer = t
        .exchange(&encoded)
        .map_err(|e| KeyError::Unavailable(format!("the KMIP server: {e}")))?;
    let (message, _) = Ttlv::decode(&answer)
        .map_err(|e| KeyError::Unavailable(format!("the KMIP server's answer is not KMIP: {e}")))?;
    response_payload(&message, op)
}

/// The Cryptographic Parameters of moor's wraps: AES-GCM with a 16-byte tag.
fn gcm_parameters() -> Ttlv {
    structure(
        tag::CRYPTOGRAPHIC_PARAMETERS,
        vec![
            enumeration(tag::BLOCK_CIPHER_MODE, MODE_GCM),
            enumeration(tag::CRYPTOGRAPHIC_ALGORITHM, ALGORITHM_AES),
            item(tag::TAG_LENGTH, Value::Integer(TAG_LEN as i32)),
        ],
    )
}

/// The payload of an Encrypt of `data` under the key `kek_id`, AES-GCM with `nonce` and `aad`.
#[must_use]
pub fn encrypt_payload(kek_id: &str, data: &[u8], nonce: &[u8], aad: &[u8]) -> Vec<Ttlv> {
    vec![
        text(tag::UNIQUE_IDENTIFIER, kek_id),
        gcm_parameters(),
        bytes(tag::DATA, data),
        bytes(tag::IV_COUNTER_NONCE, nonce),
        bytes(tag::AUTHENTICATED_ENCRYPTION_ADDITIONAL_DATA, aad),
    ]
}

/// The payload of a Decrypt of `data` and its tag `tag_bytes` under the key `kek_id`.
#[must_use]
pub fn decrypt_payload(
    kek_id: &str,
    data: &[u8],
    nonce: &[u8],
    aad: &[u8],
    tag_bytes: &[u8],
) -> Vec<Ttlv> {
    let mut p = encrypt_payload(kek_id, data, nonce, aad);
    p.push(bytes(tag::AUTHENTICATED_ENCRYPTION_TAG, tag_bytes));
    p
}

/// A new AES-256 key on the server for Encrypt and Decrypt, activated: its Unique Identifier.
/// For an operator's tool and the tests; the daemons never make a KEK.
pub fn create_kek(t: &mut dyn Transport) -> Result<String> {
    let attribute = |name: &str, value: Value| {
        structure(
            tag::ATTRIBUTE,
            vec![
                text(tag::ATTRIBUTE_NAME, name),
                item(tag::ATTRIBUTE_VALUE, value),
            ],
        )
    };
    let created = call(
        t,
        operation::CREATE,
        vec![
            enumeration(tag::OBJECT_TYPE, OBJECT_SYMMETRIC_KEY),
            structure(
                tag::TEMPLATE_ATTRIBUTE,
                vec![
                    attribute("Cryptographic Algorithm", Value::Enumeration(ALGORITHM_AES)),
                    attribute("Cryptographic Length", Value::Integer(256)),
                    attribute(
                        "Cryptographic Usage Mask",
                        Value::Integer(USAGE_ENCRYPT_DECRYPT),
                    ),
                ],
            ),
        ],
    )?;
    let id = created
        .text_child(tag::UNIQUE_IDENTIFIER)
        .ok_or_else(|| KeyError::Unavailable("the KMIP server's Create named no key".into()))?
        .to_owned();
    call(
        t,
        operation::ACTIVATE,
        vec![text(tag::UNIQUE_IDENTIFIER, &id)],
    )?;
    Ok(id)
}

/// `dek` wrapped for `volume` by the server's key `kek_id` (KMIP Encrypt).
pub fn wrap(t: &mut dyn Transport, kek_id: &str, dek: &Dek, volume: &str) -> Result<WrappedDek> {
    check_kek_id(kek_id)?;
    let nonce: [u8; NONCE_LEN] = {
        let s = Secret::random()?;
        let mut n = [0; NONCE_LEN];
        n.copy_from_slice(&s.0[..NONCE_LEN]);
        n
    };
    let answer = call(
        t,
        operation::ENCRYPT,
        encrypt_payload(
            kek_id,
            dek.expose(),
            &nonce,
            &associated_data(volume, kek_id),
        ),
    )?;
    let odd = |what: &str| KeyError::Unavailable(format!("the KMIP server's Encrypt {what}"));
    let ciphertext = answer
        .bytes_child(tag::DATA)
        .filter(|d| d.len() == KEY_LEN)
        .ok_or_else(|| odd("gave no ciphertext of the key's length"))?;
    let tag_bytes = answer
        .bytes_child(tag::AUTHENTICATED_ENCRYPTION_TAG)
        .filter(|d| d.len() == TAG_LEN)
        .ok_or_else(|| odd("gave no 16-byte tag"))?;
    if let Some(iv) = answer.bytes_child(tag::IV_COUNTER_NONCE)
        && iv != nonce
    {
        return Err(odd("used another nonce than moor's"));
    }
    let mut sealed = ciphertext.to_vec();
    sealed.extend_from_slice(tag_bytes);
    Ok(WrappedDek {
        kek_id: kek_id.to_owned(),
        nonce,
        sealed,
    })
}

/// The data key of `volume`, unwrapped by the server's key the wrapped DEK names (KMIP
/// Decrypt). A tag that does not verify (another volume's key, a damaged record) is the
/// server's refusal: [`KeyError::Refused`].
pub fn unwrap(t: &mut dyn Transport, wrapped: &WrappedDek, volume: &str) -> Result<Dek> {
    let (ciphertext, tag_bytes) = wrapped.sealed.split_at(wrapped.sealed.len() - TAG_LEN);
    let answer = call(
        t,
        operation::DECRYPT,
        decrypt_payload(
            &wrapped.kek_id,
            ciphertext,
            &wrapped.nonce,
            &associated_data(volume, &wrapped.kek_id),
            tag_bytes,
        ),
    )?;
    answer
        .bytes_child(tag::DATA)
        .and_then(Secret::from_slice)
        .map(Dek)
        .ok_or_else(|| {
            KeyError::Unavailable("the KMIP server's Decrypt gave no key of 32 bytes".into())
        })
}

/// Where the KMIP server is and how moor proves itself to it: CSI secrets (a Kubernetes
/// Secret the StorageClass names) with ceph-csi's field names. Its `Debug` shows no key.
pub struct KmipConfig {
    /// `host:port`.
    pub endpoint: String,
    /// The name the server's certificate must carry.
    pub server_name: String,
    /// The KEK's Unique Identifier.
    pub kek_id: String,
    /// How long connecting and reading an answer may take.
    pub read_timeout: Duration,
    /// How long writing a request may take.
    pub write_timeout: Duration,
    /// The TLS client configuration (roots and client certificate).
    tls: Arc<rustls::ClientConfig>,
}

impl fmt::Debug for KmipConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KmipConfig")
            .field("endpoint", &self.endpoint)
            .field("server_name", &self.server_name)
            .field("kek_id", &self.kek_id)
            .finish_non_exhaustive()
    }
}

impl KmipConfig {
    /// The configuration in the CSI secrets `get` looks up: [`KMIP_ENDPOINT_KEY`],
    /// [`KMIP_CA_CERT_KEY`], [`KMIP_CLIENT_CERT_KEY`], [`KMIP_CLIENT_KEY_KEY`],
    /// [`KMIP_UNIQUE_IDENTIFIER_KEY`], and optionally [`KMIP_TLS_SERVER_NAME_KEY`],
    /// [`KMIP_READ_TIMEOUT_KEY`] and [`KMIP_WRITE_TIMEOUT_KEY`].
    pub fn from_secrets<'a>(get: impl Fn(&str) -> Option<&'a str>) -> Result<Self> {
        let need = |k: &'static str| get(k).map(str::trim).ok_or(KeyError::Missing(k));
        let malformed = |field: &'static str, problem: &str| KeyError::Malformed {
            field,
            problem: problem.to_owned(),
        };
        let endpoint = need(KMIP_ENDPOINT_KEY)?.to_owned();
        let host = endpoint
            .rsplit_once(':')
            .filter(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok())
            .map(|(h, _)| h.trim_start_matches('[').trim_end_matches(']'))
            .ok_or_else(|| malformed(KMIP_ENDPOINT_KEY, "is not host:port"))?;
        let server_name = get(KMIP_TLS_SERVER_NAME_KEY)
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .unwrap_or(host)
            .to_owned();
        let kek_id = need(KMIP_UNIQUE_IDENTIFIER_KEY)?.to_owned();
        check_kek_id(&kek_id).map_err(|_| {
            malformed(
                KMIP_UNIQUE_IDENTIFIER_KEY,
                "must be 1 to 64 of A-Z, a-z, 0-9, '.', '_', '-'",
            )
        })?;
        let seconds = |key: &'static str| match get(key) {
            None => Ok(DEFAULT_TIMEOUT),
            Some(s) => s
                .trim()
                .parse::<u64>()
                .ok()
                .filter(|n| (1..=600).contains(n))
                .map(Duration::from_secs)
                .ok_or_else(|| malformed(key, "is not 1 to 600 seconds")),
        };
        let read_timeout = seconds(KMIP_READ_TIMEOUT_KEY)?;
        let write_timeout = seconds(KMIP_WRITE_TIMEOUT_KEY)?;
        let mut roots = rustls::RootCertStore::empty();
        for c in CertificateDer::pem_slice_iter(need(KMIP_CA_CERT_KEY)?.as_bytes()) {
            let c = c.map_err(|_| malformed(KMIP_CA_CERT_KEY, "is not PEM certificates"))?;
            roots
                .add(c)
                .map_err(|_| malformed(KMIP_CA_CERT_KEY, "holds a certificate rustls refuses"))?;
        }
        if roots.is_empty() {
            return Err(malformed(KMIP_CA_CERT_KEY, "holds no certificate"));
        }
        let chain = CertificateDer::pem_slice_iter(need(KMIP_CLIENT_CERT_KEY)?.as_bytes())
            .collect::<std::result::Result<Vec<_>, _>>()
            .ok()
            .filter(|c| !c.is_empty())
            .ok_or_else(|| malformed(KMIP_CLIENT_CERT_KEY, "is not PEM certificates"))?;
        // The PEM parser's errors are not passed on: they could quote the key.
        let key = PrivateKeyDer::from_pem_slice(need(KMIP_CLIENT_KEY_KEY)?.as_bytes())
            .map_err(|_| malformed(KMIP_CLIENT_KEY_KEY, "is not a PEM private key"))?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let tls = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| KeyError::Malformed {
                field: KMIP_CA_CERT_KEY,
                problem: format!("no TLS version: {e}"),
            })?
            .with_root_certificates(roots)
            .with_client_auth_cert(chain, key)
            .map_err(|_| {
                malformed(
                    KMIP_CLIENT_KEY_KEY,
                    "does not match the client certificate or is of a kind TLS refuses",
                )
            })?;
        ServerName::try_from(server_name.clone())
            .map_err(|_| malformed(KMIP_TLS_SERVER_NAME_KEY, "is not a DNS name or address"))?;
        Ok(Self {
            endpoint,
            server_name,
            kek_id,
            read_timeout,
            write_timeout,
            tls: Arc::new(tls),
        })
    }

    /// A TLS connection to the server: [`KeyError::Unavailable`] when it cannot be made.
    pub fn connect(&self) -> Result<TlsTransport> {
        let unreachable =
            |e: String| KeyError::Unavailable(format!("KMIP server {}: {e}", self.endpoint));
        let addrs = self
            .endpoint
            .to_socket_addrs()
            .map_err(|e| unreachable(format!("no address: {e}")))?;
        let mut last = String::from("no address");
        for addr in addrs {
            match TcpStream::connect_timeout(&addr, self.read_timeout) {
                Ok(tcp) => {
                    tcp.set_read_timeout(Some(self.read_timeout))
                        .and_then(|()| tcp.set_write_timeout(Some(self.write_timeout)))
                        .map_err(|e| unreachable(e.to_string()))?;
                    let name = ServerName::try_from(self.server_name.clone())
                        .map_err(|e| unreachable(e.to_string()))?;
                    let conn = rustls::ClientConnection::new(Arc::clone(&self.tls), name)
                        .map_err(|e| unreachable(e.to_string()))?;
                    return Ok(TlsTransport {
                        stream: rustls::StreamOwned::new(conn, tcp),
                    });
                }
                Err(e) => last = format!("{addr}: {e}"),
            }
        }
        Err(unreachable(last))
    }

    /// `dek` wrapped for `volume` by this configuration's KEK.
    pub fn wrap(&self, dek: &Dek, volume: &str) -> Result<WrappedDek> {
        wrap(&mut self.connect()?, &self.kek_id, dek, volume)
    }

    /// The DEK of `volume`, unwrapped. The wrapped DEK must name this configuration's KEK:
    /// after a KEK rotation the StorageClass's Secret names the new one, and a DEK not yet
    /// re-wrapped is [`KeyError::OtherKek`].
    pub fn unwrap(&self, wrapped: &WrappedDek, volume: &str) -> Result<Dek> {
        if wrapped.kek_id != self.kek_id {
            return Err(KeyError::OtherKek {
                volume: volume.to_owned(),
                wrapped_by: wrapped.kek_id.clone(),
                given: self.kek_id.clone(),
            });
        }
        unwrap(&mut self.connect()?, wrapped, volume)
    }
}

/// A TLS connection to a KMIP server.
pub struct TlsTransport {
    /// The connection.
    stream: rustls::StreamOwned<rustls::ClientConnection, TcpStream>,
}

impl fmt::Debug for TlsTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TlsTransport").finish_non_exhaustive()
    }
}

impl Transport for TlsTransport {
    fn exchange(&mut self, request: &[u8]) -> std::io::Result<Zeroizing<Vec<u8>>> {
        self.stream.write_all(request)?;
        self.stream.flush()?;
        read_message(&mut self.stream)
    }
}

/// One TTLV message from `r`: its 8-byte header, then the length it gives.
pub fn read_message(r: &mut impl Read) -> std::io::Result<Zeroizing<Vec<u8>>> {
    let mut message = Zeroizing::new(vec![0; 8]);
    r.read_exact(&mut message)?;
    let len = u32::from_be_bytes([message[4], message[5], message[6], message[7]]) as usize;
    if len > MAX_MESSAGE {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("a message of {len} bytes, more than a KMIP answer to moor can be"),
        ));
    }
    message.resize(8 + len, 0);
    r.read_exact(&mut message[8..])?;
    Ok(message)
}

#[cfg(test)]
mod tests;
