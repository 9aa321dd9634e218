//! The encryption parameters: defaults filled in, every wrong one refused by name.

use super::*;

fn params(pairs: &[(&str, &str)]) -> Parameters {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

/// The INVALID_ARGUMENT reason of `pairs`.
fn refused(pairs: &[(&str, &str)]) -> String {
    match split(&params(pairs)) {
        Err(Error::InvalidArgument { field, reason }) => {
            assert_eq!(field, "parameters");
            reason
        }
        other => panic!("{pairs:?}: {other:?}"),
    }
}

#[test]
fn a_volume_without_encryption_parameters_is_not_encrypted() {
    let raw = params(&[("fsType", "xfs"), ("backend", "rbd")]);
    assert_eq!(split(&raw).expect("split"), (None, raw.clone()));
    let (e, rest) = split(&params(&[("fsType", "xfs"), ("encrypted", "false")])).expect("split");
    assert_eq!((e, rest), (None, params(&[("fsType", "xfs")])));
}

#[test]
fn an_encrypted_volume_takes_the_safe_defaults() {
    let (e, rest) = split(&params(&[
        ("encrypted", "true"),
        ("kmsID", "secret"),
        ("fsType", "ext4"),
    ]))
    .expect("split");
    let e = e.expect("encrypted");
    assert_eq!(
        e,
        Encryption {
            kms_id: "secret".to_owned(),
            cipher: "aes-xts-plain64",
            key_size: 512,
            sector_size: 4096,
            pbkdf: "pbkdf2",
            tpm2_pcrs: None,
            rotation_schedule: None,
        }
    );
    assert_eq!(rest, params(&[("fsType", "ext4")]));
    // Every default explicit: a class that names them makes the same volumes.
    let named = e.parameters();
    assert_eq!(named.len(), 6);
    let (again, _) = split(&named).expect("split");
    assert_eq!(again, Some(e));
}

#[test]
fn every_parameter_can_be_chosen() {
    let (e, _) = split(&params(&[
        ("encrypted", "true"),
        ("kmsID", "secret"),
        ("luksCipher", "xchacha12,aes-adiantum-plain64"),
        ("luksKeySize", "256"),
        ("luksSectorSize", "512"),
        ("luksPBKDF", "argon2id"),
    ]))
    .expect("split");
    let e = e.expect("encrypted");
    assert_eq!(
        (e.cipher, e.key_size, e.sector_size, e.pbkdf),
        ("xchacha12,aes-adiantum-plain64", 256, 512, "argon2id")
    );
    // Adiantum's only key size is its default.
    let (e, _) = split(&params(&[
        ("encrypted", "true"),
        ("kmsID", "secret"),
        ("luksCipher", "xchacha20,aes-adiantum-plain64"),
    ]))
    .expect("split");
    assert_eq!(e.expect("encrypted").key_size, 256);
}

#[test]
fn a_wrong_parameter_is_refused_by_name() {
    let on = [("encrypted", "true"), ("kmsID", "secret")];
    let with = |extra: (&'static str, &'static str)| {
        let mut v = on.to_vec();
        v.retain(|(k, _)| *k != extra.0);
        v.push(extra);
        v
    };
    for (pairs, want) in [
        (
            vec![("encrypted", "yes")],
            "encrypted=\"yes\": either \"true\" or \"false\"",
        ),
        (
            vec![("encrypted", "true")],
            "kmsID is required with encrypted=\"true\"",
        ),
        (
            with(("kmsID", "vault")),
            "kmsID=\"vault\": not a key source moor knows (secret, kmip, tpm2)",
        ),
        (
            with(("luksCipher", "aes-ecb")),
            "luksCipher=\"aes-ecb\": one of aes-xts-plain64, serpent-xts-plain64, \
             twofish-xts-plain64, xchacha12,aes-adiantum-plain64, xchacha20,aes-adiantum-plain64",
        ),
        (
            with(("luksKeySize", "384")),
            "luksKeySize=\"384\": one of 512, 256 (for aes-xts-plain64)",
        ),
        (
            vec![
                ("encrypted", "true"),
                ("kmsID", "secret"),
                ("luksCipher", "xchacha12,aes-adiantum-plain64"),
                ("luksKeySize", "512"),
            ],
            "luksKeySize=\"512\": one of 256 (for xchacha12,aes-adiantum-plain64)",
        ),
        (
            with(("luksSectorSize", "8192")),
            "luksSectorSize=\"8192\": one of 4096, 512, 1024, 2048",
        ),
        (
            with(("luksPBKDF", "scrypt")),
            "luksPBKDF=\"scrypt\": one of pbkdf2, argon2id, argon2i",
        ),
        (
            vec![("luksCipher", "aes-xts-plain64")],
            "luksCipher=\"aes-xts-plain64\": only for a volume with encrypted=\"true\"",
        ),
        (
            vec![("encrypted", "false"), ("kmsID", "secret")],
            "kmsID=\"secret\": only for a volume with encrypted=\"true\"",
        ),
    ] {
        assert_eq!(refused(&pairs), want, "{pairs:?}");
    }
}

#[test]
fn a_copy_of_a_volume_whose_key_is_split_with_a_tpm_is_refused_before_any_key_is_read() {
    let kek = moor_runtime::keys::source::KeySource::from_secrets("secret", |k| match k {
        "kek" => Some("AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8="),
        "kekID" => Some("k1"),
        _ => None,
    })
    .expect("a Secret source");
    let carried = params(&[
        (ENCRYPTED_KEY, "true"),
        (KMS_ID_KEY, "tpm2"),
        (moor_runtime::contract::ENCRYPTED_DEK_KEY, "v1:k1:AAAA"),
    ]);
    let e = source_dek(&carried, "vol-1", &kek).expect_err("a tpm2 copy refused");
    let Error::InvalidArgument { field, .. } = &e else {
        panic!("not INVALID_ARGUMENT: {e:?}");
    };
    assert_eq!(*field, "volume_content_source", "{e:?}");
    assert!(e.to_string().contains("TPM"), "{e}");
}

#[test]
fn a_tpm2_class_may_seal_to_pcrs_and_only_it() {
    let (e, rest) = split(&params(&[
        ("encrypted", "true"),
        ("kmsID", "tpm2"),
        ("tpm2PCRs", "sha256:7,0,7"),
        ("fsType", "ext4"),
    ]))
    .expect("split");
    let e = e.expect("encrypted");
    assert_eq!(
        e.tpm2_pcrs.as_deref(),
        Some("sha256:0,7"),
        "in its one form"
    );
    assert_eq!(rest, params(&[("fsType", "ext4")]));
    // It reaches the volume's parameters, and so its context.
    let named = e.parameters();
    assert_eq!(
        named.get("tpm2PCRs").map(String::as_str),
        Some("sha256:0,7")
    );
    assert_eq!(
        encryption_parameters(&named)
            .get("tpm2PCRs")
            .map(String::as_str),
        Some("sha256:0,7")
    );
    assert_eq!(split(&named).expect("split").0, Some(e));
    for (kms, pcrs) in [("tpm2", "sha256:24"), ("tpm2", "7"), ("secret", "sha256:7")] {
        let why = refused(&[("encrypted", "true"), ("kmsID", kms), ("tpm2PCRs", pcrs)]);
        assert!(why.starts_with("tpm2PCRs="), "{kms} {pcrs}: {why}");
    }
    let why = refused(&[("tpm2PCRs", "sha256:7")]);
    assert!(why.contains("only for a volume with encrypted"), "{why}");
}

#[test]
fn a_secret_class_may_schedule_its_rotation_and_only_it() {
    let (e, _) = split(&params(&[
        ("encrypted", "true"),
        ("kmsID", "secret"),
        ("keyRotationSchedule", "@weekly"),
    ]))
    .expect("split");
    let e = e.expect("encrypted");
    assert_eq!(e.rotation_schedule.as_deref(), Some("@weekly"));
    // It reaches the volume's parameters (which the controller's key calls read).
    let named = e.parameters();
    assert_eq!(
        named.get("keyRotationSchedule").map(String::as_str),
        Some("@weekly")
    );
    assert_eq!(split(&named).expect("split").0, Some(e));
    for (kms, period) in [("secret", "weekly"), ("secret", "0d"), ("tpm2", "daily")] {
        let why = refused(&[
            ("encrypted", "true"),
            ("kmsID", kms),
            ("keyRotationSchedule", period),
        ]);
        assert!(
            why.starts_with("keyRotationSchedule="),
            "{kms} {period}: {why}"
        );
    }
    let why = refused(&[("keyRotationSchedule", "@daily")]);
    assert!(why.contains("only for a volume with encrypted"), "{why}");
    // A tpm2 volume's data key rotates too (its slots take each key with the node's half).
    let raw = params(&[
        ("encrypted", "true"),
        ("kmsID", "tpm2"),
        ("keyRotationSchedule", "@daily"),
    ]);
    let e = split(&raw).expect("a tpm2 schedule").0.expect("encrypted");
    assert_eq!(e.rotation_schedule.as_deref(), Some("@daily"));
}
