//! The KMIP codec against bytes PyKMIP 0.11 wrote, and the wrap and unwrap exchanges against a
//! fake server that decodes moor's requests and keeps its keys, as a KMIP server does.

use std::collections::HashMap;

use aes_gcm::aead::{Aead, KeyInit, Payload};
use aes_gcm::{Aes256Gcm, Nonce};

use super::*;

/// PyKMIP 0.11's encoding of a KMIP 1.4 Encrypt request: key "7", AES-GCM with a 16-byte tag,
/// 32 bytes 0x11, nonce 12 bytes 0x22, additional data "aad".
const PYKMIP_ENCRYPT_REQUEST: &str = "42007801000000f84200770100000038420069010000002042006a0200000004000000010000000042006b0200000004000000040000000042000d0200000004000000010000000042000f01000000b042005c05000000040000001f0000000042007901000000984200940700000001370000000000000042002b010000003042001105000000040000000900000000420028050000000400000003000000004200ce020000000400000010000000004200c20800000020111111111111111111111111111111111111111111111111111111111111111142003d080000000c222222222222222222222222000000004200fe08000000036161640000000000";

/// The same for Decrypt: 32 bytes 0x33 and the tag 16 bytes 0x44.
const PYKMIP_DECRYPT_REQUEST: &str = "42007801000001104200770100000038420069010000002042006a0200000004000000010000000042006b0200000004000000040000000042000d0200000004000000010000000042000f01000000c842005c0500000004000000200000000042007901000000b04200940700000001370000000000000042002b010000003042001105000000040000000900000000420028050000000400000003000000004200ce020000000400000010000000004200c20800000020333333333333333333333333333333333333333333333333333333333333333342003d080000000c222222222222222222222222000000004200fe080000000361616400000000004200ff080000001044444444444444444444444444444444";

/// PyKMIP's Encrypt response: key "7", ciphertext 32 bytes 0x33, tag 16 bytes 0x44.
const PYKMIP_ENCRYPT_RESPONSE: &str = "42007b01000000d042007a0100000048420069010000002042006a0200000004000000010000000042006b020000000400000004000000004200920900000008000000006553f10042000d0200000004000000010000000042000f010000007842005c05000000040000001f0000000042007f0500000004000000000000000042007c0100000050420094070000000137000000000000004200c2080000002033333333333333333333333333333333333333333333333333333333333333334200ff080000001044444444444444444444444444444444";

/// PyKMIP's refusal of a Decrypt: Item Not Found, "Could not locate object: 9".
const PYKMIP_REFUSED_RESPONSE: &str = "42007b01000000b042007a0100000048420069010000002042006a0200000004000000010000000042006b020000000400000004000000004200920900000008000000006553f10042000d0200000004000000010000000042000f010000005842005c0500000004000000200000000042007f0500000004000000010000000042007e0500000004000000010000000042007d070000001a436f756c64206e6f74206c6f63617465206f626a6563743a2039000000000000";

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex"))
        .collect()
}

fn encoded(t: &Ttlv) -> Vec<u8> {
    let mut out = Vec::new();
    t.encode(&mut out);
    out
}

fn decoded(b: &[u8]) -> Ttlv {
    let (t, used) = Ttlv::decode(b).expect("decode");
    assert_eq!(used, b.len(), "the whole message is one item");
    t
}

#[test]
fn moor_encodes_encrypt_and_decrypt_as_pykmip_does() {
    let enc = request(
        operation::ENCRYPT,
        encrypt_payload("7", &[0x11; 32], &[0x22; 12], b"aad"),
    );
    assert_eq!(encoded(&enc), unhex(PYKMIP_ENCRYPT_REQUEST));
    let dec = request(
        operation::DECRYPT,
        decrypt_payload("7", &[0x33; 32], &[0x22; 12], b"aad", &[0x44; 16]),
    );
    assert_eq!(encoded(&dec), unhex(PYKMIP_DECRYPT_REQUEST));
}

#[test]
fn pykmip_messages_decode_and_encode_back_to_the_same_bytes() {
    for hex in [
        PYKMIP_ENCRYPT_REQUEST,
        PYKMIP_DECRYPT_REQUEST,
        PYKMIP_ENCRYPT_RESPONSE,
        PYKMIP_REFUSED_RESPONSE,
    ] {
        let raw = unhex(hex);
        assert_eq!(encoded(&decoded(&raw)), raw);
    }
}

#[test]
fn every_value_type_round_trips() {
    let all = structure(
        tag::REQUEST_PAYLOAD,
        vec![
            item(tag::BATCH_COUNT, Value::Integer(-3)),
            item(tag::BATCH_COUNT, Value::LongInteger(-1 << 40)),
            item(tag::BATCH_COUNT, Value::BigInteger(vec![1; 16])),
            enumeration(tag::OPERATION, 0x1F),
            item(tag::BATCH_COUNT, Value::Boolean(true)),
            item(tag::BATCH_COUNT, Value::Boolean(false)),
            text(tag::UNIQUE_IDENTIFIER, "a key é"),
            text(tag::UNIQUE_IDENTIFIER, ""),
            bytes(tag::DATA, &[9; 33]),
            item(tag::TIME_STAMP, Value::DateTime(1_700_000_000)),
            item(tag::BATCH_COUNT, Value::Interval(7)),
            structure(tag::BATCH_ITEM, vec![]),
        ],
    );
    let raw = encoded(&all);
    assert_eq!(raw.len() % 8, 0, "every item is padded to 8 bytes");
    assert_eq!(decoded(&raw), all);
}

#[test]
fn a_damaged_message_is_an_error_never_a_panic() {
    let raw = unhex(PYKMIP_ENCRYPT_RESPONSE);
    for cut in 0..raw.len() {
        assert!(Ttlv::decode(&raw[..cut]).is_err(), "cut at {cut}");
    }
    let mut unknown_type = raw.clone();
    unknown_type[3] = 0x0F;
    assert!(Ttlv::decode(&unknown_type).is_err());
    let mut long_enum = unhex("42005c05000000050000001f0000000000000000");
    assert!(
        Ttlv::decode(&long_enum).is_err(),
        "an enumeration is 4 bytes"
    );
    long_enum[7] = 4;
    assert!(Ttlv::decode(&long_enum).is_ok());
}

#[test]
fn a_message_nested_too_deep_is_refused_not_recursed_into() {
    let mut deep = bytes(tag::DATA, b"x");
    for _ in 0..=MAX_DEPTH {
        deep = structure(tag::BATCH_ITEM, vec![deep]);
    }
    let e = Ttlv::decode(&encoded(&deep)).expect_err("too deep");
    assert!(e.contains("nested deeper"), "{e}");
    // A server's 64 KiB of nothing but structure headers: refused the same way.
    let mut headers = Vec::new();
    for i in 0..MAX_MESSAGE / 8 {
        let len = u32::try_from(MAX_MESSAGE - 8 * (i + 1)).expect("len");
        headers.extend_from_slice(&[0x42, 0x00, 0x0F, 0x01]);
        headers.extend_from_slice(&len.to_be_bytes());
    }
    assert!(Ttlv::decode(&headers).is_err());
    let mut ok = bytes(tag::DATA, b"x");
    for _ in 0..MAX_DEPTH {
        ok = structure(tag::BATCH_ITEM, vec![ok]);
    }
    assert_eq!(decoded(&encoded(&ok)), ok);
}

#[test]
fn a_pykmip_answer_gives_its_payload_or_its_refusal() {
    let ok = response_payload(
        &decoded(&unhex(PYKMIP_ENCRYPT_RESPONSE)),
        operation::ENCRYPT,
    )
    .expect("success");
    assert_eq!(ok.bytes_child(tag::DATA), Some(&[0x33; 32][..]));
    assert_eq!(
        ok.bytes_child(tag::AUTHENTICATED_ENCRYPTION_TAG),
        Some(&[0x44; 16][..])
    );
    let wrong_op = response_payload(
        &decoded(&unhex(PYKMIP_ENCRYPT_RESPONSE)),
        operation::DECRYPT,
    )
    .expect_err("an answer to another operation");
    assert!(matches!(wrong_op, KeyError::Unavailable(_)), "{wrong_op:?}");
    let refused = response_payload(
        &decoded(&unhex(PYKMIP_REFUSED_RESPONSE)),
        operation::DECRYPT,
    )
    .expect_err("refused");
    let KeyError::Refused(m) = refused else {
        panic!("{refused:?}")
    };
    assert!(m.contains("item not found"), "{m}");
    assert!(m.contains("Could not locate object: 9"), "{m}");
}

#[test]
fn byte_strings_never_show_in_debug() {
    let t = bytes(tag::DATA, &[0x5a; 32]);
    let shown = format!("{t:?}");
    assert!(shown.contains("32 bytes"), "{shown}");
    assert!(!shown.contains("90") && !shown.contains("5a") && !shown.contains('Z'));
}

/// A KMIP server in memory: its keys by Unique Identifier, active or not, and the requests
/// it saw. Speaks only what moor sends, as PyKMIP answers it.
#[derive(Default)]
struct FakeKms {
    keys: HashMap<String, ([u8; 32], bool)>,
    /// Every request, decoded, for the tests to look at.
    seen: Vec<Ttlv>,
    /// The next exchange fails as a dropped connection would.
    down: bool,
}

impl FakeKms {
    fn answer(&mut self, req: &Ttlv) -> std::result::Result<(u32, Vec<Ttlv>), (u32, String)> {
        let batch = req
            .child(tag::BATCH_ITEM)
            .ok_or((0x04, "no batch".into()))?;
        let op = batch
            .enum_child(tag::OPERATION)
            .ok_or((0x04, "no op".into()))?;
        let p = batch
            .child(tag::REQUEST_PAYLOAD)
            .ok_or((0x04, "no payload".into()))?;
        let id = p
            .text_child(tag::UNIQUE_IDENTIFIER)
            .unwrap_or("")
            .to_owned();
        let not_found = || (0x01, format!("Could not locate object: {id}"));
        match op {
            operation::CREATE => {
                let id = (self.keys.len() + 1).to_string();
                let key = Secret::random().expect("random");
                self.keys.insert(id.clone(), (*key.0, false));
                Ok((op, vec![text(tag::UNIQUE_IDENTIFIER, &id)]))
            }
            operation::ACTIVATE => {
                self.keys.get_mut(&id).ok_or_else(not_found)?.1 = true;
                Ok((op, vec![text(tag::UNIQUE_IDENTIFIER, &id)]))
            }
            operation::ENCRYPT | operation::DECRYPT => {
                let (key, active) = *self.keys.get(&id).ok_or_else(not_found)?;
                if !active {
                    return Err((0x0C, "not Active".into()));
                }
                let cipher = Aes256Gcm::new_from_slice(&key).expect("key");
                let nonce: [u8; 12] = p
                    .bytes_child(tag::IV_COUNTER_NONCE)
                    .and_then(|n| n.try_into().ok())
                    .ok_or((0x07, "nonce".into()))?;
                let aad = p
                    .bytes_child(tag::AUTHENTICATED_ENCRYPTION_ADDITIONAL_DATA)
                    .unwrap_or(&[]);
                let data = p.bytes_child(tag::DATA).ok_or((0x06, "data".into()))?;
                if op == operation::ENCRYPT {
                    let mut out = cipher
                        .encrypt(&Nonce::from(nonce), Payload { msg: data, aad })
                        .expect("encrypt");
                    let t = out.split_off(out.len() - 16);
                    Ok((
                        op,
                        vec![
                            text(tag::UNIQUE_IDENTIFIER, &id),
                            bytes(tag::DATA, &out),
                            bytes(tag::AUTHENTICATED_ENCRYPTION_TAG, &t),
                        ],
                    ))
                } else {
                    let mut sealed = data.to_vec();
                    sealed.extend_from_slice(
                        p.bytes_child(tag::AUTHENTICATED_ENCRYPTION_TAG)
                            .unwrap_or(&[]),
                    );
                    let plain = cipher
                        .decrypt(&Nonce::from(nonce), Payload { msg: &sealed, aad })
                        .map_err(|_| (0x0A, "InvalidTag".to_owned()))?;
                    Ok((
                        op,
                        vec![text(tag::UNIQUE_IDENTIFIER, &id), bytes(tag::DATA, &plain)],
                    ))
                }
            }
            _ => Err((0x05, "operation not supported".into())),
        }
    }
}

impl Transport for FakeKms {
    fn exchange(&mut self, request: &[u8]) -> std::io::Result<Zeroizing<Vec<u8>>> {
        if self.down {
            return Err(std::io::Error::new(
                std::io::ErrorKind::ConnectionReset,
                "connection reset by peer",
            ));
        }
        let req = decoded(request);
        let batch = match self.answer(&req) {
            Ok((op, payload)) => vec![
                enumeration(tag::OPERATION, op),
                enumeration(tag::RESULT_STATUS, STATUS_SUCCESS),
                structure(tag::RESPONSE_PAYLOAD, payload),
            ],
            Err((reason, message)) => vec![
                enumeration(tag::RESULT_STATUS, 1),
                enumeration(tag::RESULT_REASON, reason),
                text(tag::RESULT_MESSAGE, &message),
            ],
        };
        self.seen.push(req);
        let response = structure(
            tag::RESPONSE_MESSAGE,
            vec![
                structure(
                    tag::RESPONSE_HEADER,
                    vec![item(tag::BATCH_COUNT, Value::Integer(1))],
                ),
                structure(tag::BATCH_ITEM, batch),
            ],
        );
        Ok(Zeroizing::new(encoded(&response)))
    }
}

#[test]
fn the_server_wraps_and_unwraps_a_dek_for_its_volume_only() {
    let mut kms = FakeKms::default();
    let id = create_kek(&mut kms).expect("create");
    let dek = Dek::generate().expect("dek");
    let wrapped = wrap(&mut kms, &id, &dek, "vol-1").expect("wrap");
    assert_eq!(wrapped.kek_id(), id);
    // The stored text is the secret source's: one format, the key id names the KMIP key.
    let back = WrappedDek::decode(&wrapped.encode()).expect("decode");
    let opened = unwrap(&mut kms, &back, "vol-1").expect("unwrap");
    assert_eq!(opened.expose(), dek.expose());
    // Another volume's record: the tag does not verify, the server refuses.
    let e = unwrap(&mut kms, &back, "vol-2").expect_err("another volume");
    assert!(matches!(e, KeyError::Refused(_)), "{e:?}");
    assert!(e.to_string().contains("cryptographic failure"), "{e}");
    // The associated data the server saw binds the volume and the key id.
    let aad = kms.seen.last().and_then(|r| {
        r.child(tag::BATCH_ITEM)?
            .child(tag::REQUEST_PAYLOAD)?
            .bytes_child(tag::AUTHENTICATED_ENCRYPTION_ADDITIONAL_DATA)
            .map(<[u8]>::to_vec)
    });
    assert_eq!(aad, Some(associated_data("vol-2", &id)));
}

#[test]
fn an_unknown_or_inactive_key_is_a_refusal_and_a_dropped_connection_is_unavailable() {
    let mut kms = FakeKms::default();
    let dek = Dek::generate().expect("dek");
    let e = wrap(&mut kms, "404", &dek, "vol-1").expect_err("no such key");
    assert!(
        matches!(&e, KeyError::Refused(m) if m.contains("item not found")),
        "{e:?}"
    );
    // A key made but never activated: the server refuses to use it.
    call(
        &mut kms,
        operation::CREATE,
        vec![enumeration(tag::OBJECT_TYPE, OBJECT_SYMMETRIC_KEY)],
    )
    .expect("create");
    let e = wrap(&mut kms, "1", &dek, "vol-1").expect_err("pre-active");
    assert!(
        matches!(&e, KeyError::Refused(m) if m.contains("permission denied")),
        "{e:?}"
    );
    kms.down = true;
    let e = wrap(&mut kms, "1", &dek, "vol-1").expect_err("down");
    assert!(
        matches!(&e, KeyError::Unavailable(m) if m.contains("reset")),
        "{e:?}"
    );
}

#[test]
fn no_key_byte_reaches_an_error_or_a_debug() {
    let mut kms = FakeKms::default();
    let id = create_kek(&mut kms).expect("create");
    let dek = Dek::generate().expect("dek");
    let wrapped = wrap(&mut kms, &id, &dek, "vol-1").expect("wrap");
    let e = unwrap(&mut kms, &wrapped, "vol-2").expect_err("another volume");
    let hex: String = dek.expose().iter().map(|b| format!("{b:02x}")).collect();
    for text in [
        e.to_string(),
        format!("{e:?}"),
        format!("{:?}", kms.seen),
        format!("{wrapped:?}"),
    ] {
        assert!(!text.contains(&hex[..16]), "{text}");
    }
}

#[test]
fn the_configuration_names_what_is_missing_or_malformed() {
    let none = |_: &str| None;
    assert_eq!(
        KmipConfig::from_secrets(none).expect_err("empty"),
        KeyError::Missing(KMIP_ENDPOINT_KEY)
    );
    let only = |pairs: &'static [(&'static str, &'static str)]| {
        move |k: &str| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| *v)
    };
    let e = KmipConfig::from_secrets(only(&[(KMIP_ENDPOINT_KEY, "kmip.example")]))
        .expect_err("no port");
    assert!(
        matches!(
            e,
            KeyError::Malformed {
                field: KMIP_ENDPOINT_KEY,
                ..
            }
        ),
        "{e:?}"
    );
    let e = KmipConfig::from_secrets(only(&[(KMIP_ENDPOINT_KEY, "kmip.example:5696")]))
        .expect_err("no key id");
    assert_eq!(e, KeyError::Missing(KMIP_UNIQUE_IDENTIFIER_KEY));
    let e = KmipConfig::from_secrets(only(&[
        (KMIP_ENDPOINT_KEY, "kmip.example:5696"),
        (KMIP_UNIQUE_IDENTIFIER_KEY, "7"),
        (KMIP_CA_CERT_KEY, "not pem"),
    ]))
    .expect_err("no certificate");
    assert!(
        matches!(
            e,
            KeyError::Malformed {
                field: KMIP_CA_CERT_KEY,
                ..
            }
        ),
        "{e:?}"
    );
}
