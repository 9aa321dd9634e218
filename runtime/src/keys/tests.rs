//! The key primitives: wrapping round trips, every refusal is a clear error, and no key byte
//! shows in any `Debug`, error or message.

use super::*;

/// A KEK of recognisable bytes (0x5a, 'Z'), named `kek-1`.
fn kek() -> Kek {
    Kek::new("kek-1", &[0x5a; KEY_LEN]).expect("kek")
}

/// A new DEK for `volume`, wrapped by `kek`.
fn new_wrapped(kek: &Kek, volume: &str) -> WrappedDek {
    Dek::generate()
        .expect("dek")
        .wrap(kek, volume)
        .expect("wrap")
}

/// Every way a key's bytes could be spelled in text: hex, decimal list, base64, raw.
fn spellings(bytes: &[u8]) -> Vec<String> {
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    let chunk = &bytes[..8];
    vec![
        hex[..16].to_owned(),
        hex[..16].to_uppercase(),
        format!("{:?}", chunk).trim_end_matches(']').to_owned(),
        BASE64.encode(bytes)[..12].to_owned(),
        String::from_utf8_lossy(chunk).into_owned(),
    ]
}

/// Fails if `text` spells any part of `bytes`.
fn assert_no_key(text: &str, bytes: &[u8]) {
    for spelling in spellings(bytes) {
        assert!(
            !text.contains(&spelling),
            "{text:?} shows key bytes as {spelling:?}"
        );
    }
}

#[test]
fn a_wrapped_dek_unwraps_to_itself_for_its_volume() {
    let kek = kek();
    let dek = Dek::generate().expect("dek");
    let wrapped = dek.wrap(&kek, "vol-1").expect("wrap");
    assert_eq!(wrapped.kek_id(), "kek-1");
    let text = wrapped.encode();
    assert!(text.starts_with("v1:kek-1:"), "{text}");
    let back = WrappedDek::decode(&text).expect("decode");
    assert_eq!(back, wrapped);
    let opened = kek.unwrap(&back, "vol-1").expect("unwrap");
    assert_eq!(opened.expose(), dek.expose());
    // The wrapped form holds no byte of the DEK in the clear.
    assert_no_key(&text, dek.expose());
    assert_no_key(&format!("{wrapped:?}"), dek.expose());
}

#[test]
fn two_dek_are_different_and_two_wraps_of_one_are_too() {
    let kek = kek();
    let a = Dek::generate().expect("dek");
    let b = Dek::generate().expect("dek");
    assert_ne!(a.expose(), b.expose());
    assert_ne!(a.expose(), &[0; KEY_LEN]);
    let once = a.wrap(&kek, "vol-1").expect("wrap").encode();
    let twice = a.wrap(&kek, "vol-1").expect("wrap").encode();
    assert_ne!(once, twice, "a fresh nonce per wrap");
}

#[test]
fn a_wrong_kek_is_a_clear_error() {
    let dek = Dek::generate().expect("dek");
    let wrapped = dek.wrap(&kek(), "vol-1").expect("wrap");
    let other = Kek::new("kek-1", &[0x33; KEY_LEN]).expect("kek");
    let e = other.unwrap(&wrapped, "vol-1").expect_err("wrong kek");
    assert_eq!(
        e,
        KeyError::Unwrap {
            volume: "vol-1".to_owned(),
            kek_id: "kek-1".to_owned()
        }
    );
    assert!(e.to_string().contains("does not unwrap"), "{e}");
    let renamed = Kek::new("kek-2", &[0x5a; KEY_LEN]).expect("kek");
    let e = renamed.unwrap(&wrapped, "vol-1").expect_err("other id");
    assert_eq!(
        e.to_string(),
        "the data key of volume \"vol-1\" is wrapped by the key \"kek-1\", not by \"kek-2\""
    );
    for text in [e.to_string(), format!("{e:?}")] {
        assert_no_key(&text, dek.expose());
        assert_no_key(&text, &[0x5a; KEY_LEN]);
    }
}

#[test]
fn a_wrapped_dek_opens_only_for_its_own_volume() {
    let kek = kek();
    let wrapped = new_wrapped(&kek, "vol-1");
    let e = kek.unwrap(&wrapped, "vol-2").expect_err("another volume");
    assert!(
        matches!(e, KeyError::Unwrap { ref volume, .. } if volume == "vol-2"),
        "{e}"
    );
}

#[test]
fn a_damaged_wrapped_dek_never_unwraps_and_never_panics() {
    let kek = kek();
    let text = new_wrapped(&kek, "vol-1").encode();
    // Any byte of the body flipped: decodes, but AES-GCM's tag refuses it.
    let (head, body) = text.split_at("v1:kek-1:".len());
    let mut raw = BASE64.decode(body).expect("base64");
    for i in 0..raw.len() {
        raw[i] ^= 1;
        let flipped =
            WrappedDek::decode(&format!("{head}{}", BASE64.encode(&raw))).expect("decode");
        assert!(
            matches!(kek.unwrap(&flipped, "vol-1"), Err(KeyError::Unwrap { .. })),
            "byte {i}"
        );
        raw[i] ^= 1;
    }
    for bad in [
        "",
        "v1",
        "v1:kek-1",
        "v2:kek-1:AAAA",
        "v1::AAAA",
        "v1:k e k:AAAA",
        "v1:kek-1:not base64!",
        "v1:kek-1:AAAA",
        &text[..text.len() - 4],
    ] {
        let e = WrappedDek::decode(bad).expect_err(bad);
        assert!(matches!(e, KeyError::Damaged(_)), "{bad:?}: {e}");
    }
}

/// Looks keys up in `pairs`, as the service does in a request's secrets.
fn read_secret(pairs: &[(&str, String)]) -> Result<Kek> {
    kek_from_secret(|k| {
        pairs
            .iter()
            .find(|(key, _)| *key == k)
            .map(|(_, v)| v.as_str())
    })
}

#[test]
fn the_secret_source_reads_a_kek_and_refuses_clearly() {
    let good = BASE64.encode([0x5a; KEY_LEN]);
    let kek =
        read_secret(&[("kek", format!("{good}\n")), ("kekID", "prod-2026".into())]).expect("kek");
    assert_eq!(kek.id(), "prod-2026");
    let dek = Dek::generate().expect("dek");
    let wrapped = dek.wrap(&kek, "v").expect("wrap");
    assert_eq!(
        kek.unwrap(&wrapped, "v").expect("unwrap").expose(),
        dek.expose()
    );

    let short = BASE64.encode([0x5a; 16]);
    let malformed = |field, problem: &str| KeyError::Malformed {
        field,
        problem: problem.to_owned(),
    };
    for (pairs, want) in [
        (vec![("kek", good.clone())], KeyError::Missing("kekID")),
        (vec![("kekID", "k".into())], KeyError::Missing("kek")),
        (
            vec![("kek", format!("{good}!")), ("kekID", "k".into())],
            malformed("kek", "is not base64"),
        ),
        (
            vec![("kek", short), ("kekID", "k".into())],
            malformed("kek", "is 16 bytes long, not 32"),
        ),
        (
            vec![("kek", good.clone()), ("kekID", "a:b".into())],
            malformed("kekID", "must be 1 to 64 of A-Z, a-z, 0-9, '.', '_', '-'"),
        ),
    ] {
        let e = read_secret(&pairs).expect_err("refused");
        assert_eq!(e, want);
        for text in [e.to_string(), format!("{e:?}")] {
            assert_no_key(&text, &[0x5a; KEY_LEN]);
        }
    }
}

#[test]
fn debug_shows_no_key_byte() {
    let kek = kek();
    let dek = Dek::generate().expect("dek");
    assert_eq!(format!("{dek:?}"), "Dek(..)");
    assert_eq!(format!("{kek:?}"), "Kek { id: \"kek-1\", .. }");
    assert_no_key(&format!("{dek:#?}"), dek.expose());
    assert_no_key(&format!("{kek:#?}"), &[0x5a; KEY_LEN]);
}

#[test]
fn zeroize_clears_a_dek() {
    let mut dek = Dek::generate().expect("dek");
    assert_ne!(dek.expose(), &[0; KEY_LEN]);
    dek.zeroize();
    assert_eq!(dek.expose(), &[0; KEY_LEN]);
}

#[test]
fn the_secret_entries_of_a_kek_read_back_as_it() {
    let entries = secret_entries("kek-1", &[0x5a; KEY_LEN]);
    let pairs: Vec<(&str, String)> = entries
        .iter()
        .map(|(k, v)| (k.as_str(), v.clone()))
        .collect();
    let read = read_secret(&pairs).expect("kek");
    assert_eq!(read.id(), "kek-1");
    let wrapped = new_wrapped(&kek(), "v");
    assert!(read.unwrap(&wrapped, "v").is_ok(), "the same key");
}

/// A second KEK of other bytes (0xa5), named `kek-2`.
fn kek2() -> Kek {
    Kek::new("kek-2", &[0xa5; KEY_LEN]).expect("kek-2")
}

#[test]
fn rewrap_moves_a_dek_to_the_new_kek_and_keeps_the_key() {
    let (old, new) = (kek(), kek2());
    let dek = Dek::generate().expect("dek");
    let wrapped = dek.wrap(&old, "vol-1").expect("wrap");
    let rewrapped = rewrap(&wrapped, "vol-1", &old, &new).expect("rewrap");
    assert_eq!(rewrapped.kek_id(), "kek-2");
    assert_eq!(
        new.unwrap(&rewrapped, "vol-1").expect("unwrap").expose(),
        dek.expose(),
        "the same data key under the new KEK: the LUKS slot still opens with it"
    );
    assert!(matches!(
        old.unwrap(&rewrapped, "vol-1"),
        Err(KeyError::OtherKek { .. })
    ));
    // Run again (a resumed rotation): the record already under the new KEK stays as it is.
    assert_eq!(
        rewrap(&rewrapped, "vol-1", &old, &new).expect("again"),
        rewrapped
    );
}

#[test]
fn rewrap_refuses_a_wrong_old_kek_and_another_volumes_key() {
    let (old, new) = (kek(), kek2());
    let wrapped = new_wrapped(&old, "vol-1");
    let impostor = Kek::new("kek-1", &[0x11; KEY_LEN]).expect("impostor");
    let e = rewrap(&wrapped, "vol-1", &impostor, &new).expect_err("wrong old KEK");
    assert!(matches!(e, KeyError::Unwrap { .. }), "{e:?}");
    assert_no_key(&e.to_string(), &[0x11; KEY_LEN]);
    let e = rewrap(&wrapped, "vol-2", &old, &new).expect_err("another volume's key");
    assert!(matches!(e, KeyError::Unwrap { .. }), "{e:?}");
    // A record claiming the new id that the new KEK does not open is refused, not kept.
    let forged = new_wrapped(
        &Kek::new("kek-2", &[0x22; KEY_LEN]).expect("forged"),
        "vol-1",
    );
    assert!(rewrap(&forged, "vol-1", &old, &new).is_err());
}
