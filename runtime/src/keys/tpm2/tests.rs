//! The combination of the two halves: one passphrase for one volume on one TPM with one
//! cluster key, and neither half alone gives it.

use ring::hmac;

use super::*;
use crate::keys::Kek;

/// A TPM in memory: an HMAC key of its own, or none reachable.
struct FakeTpm(Option<hmac::Key>);

impl FakeTpm {
    fn new() -> Self {
        let seed = Secret::random().expect("random");
        Self(Some(hmac::Key::new(hmac::HMAC_SHA256, seed.0.as_slice())))
    }
}

impl Tpm for FakeTpm {
    fn hmac(&self, message: &[u8]) -> Result<Zeroizing<Vec<u8>>> {
        let key = self
            .0
            .as_ref()
            .ok_or_else(|| KeyError::Unavailable("the node's TPM: no device".into()))?;
        Ok(Zeroizing::new(hmac::sign(key, message).as_ref().to_vec()))
    }
}

#[test]
fn one_volume_one_tpm_one_cluster_key_give_one_passphrase() {
    let tpm = FakeTpm::new();
    let dek = Dek::generate().expect("dek");
    let a = combine(&dek, &tpm, "vol-1").expect("combine");
    let b = combine(&dek, &tpm, "vol-1").expect("combine");
    assert_eq!(
        a.expose(),
        b.expose(),
        "the same halves give the same passphrase"
    );
    assert_ne!(
        a.expose(),
        dek.expose(),
        "the cluster half is not the passphrase"
    );
    let other_volume = combine(&dek, &tpm, "vol-2").expect("combine");
    assert_ne!(a.expose(), other_volume.expose());
}

#[test]
fn the_cluster_half_alone_opens_nothing() {
    let tpm = FakeTpm::new();
    let kek = Kek::new("kek-1", &[0x11; KEY_LEN]).expect("kek");
    let dek = Dek::generate().expect("dek");
    let wrapped = dek.wrap(&kek, "vol-1").expect("wrap");
    let passphrase = combine(&dek, &tpm, "vol-1").expect("combine");
    // The cluster KEK unwraps the DEK, but without this node's TPM:
    let unwrapped = kek.unwrap(&wrapped, "vol-1").expect("unwrap");
    // no TPM at all: an error, no key;
    let e = combine(&unwrapped, &FakeTpm(None), "vol-1").expect_err("no TPM");
    assert!(matches!(e, KeyError::Unavailable(_)), "{e:?}");
    // another node's TPM: another passphrase, which the key slot refuses;
    let elsewhere = combine(&unwrapped, &FakeTpm::new(), "vol-1").expect("combine");
    assert_ne!(elsewhere.expose(), passphrase.expose());
    // the DEK itself is not the passphrase.
    assert_ne!(unwrapped.expose(), passphrase.expose());
}

#[test]
fn the_tpm_half_alone_opens_nothing() {
    let tpm = FakeTpm::new();
    let kek = Kek::new("kek-1", &[0x11; KEY_LEN]).expect("kek");
    let dek = Dek::generate().expect("dek");
    let wrapped = dek.wrap(&kek, "vol-1").expect("wrap");
    let passphrase = combine(&dek, &tpm, "vol-1").expect("combine");
    // The node's TPM with a guess at the cluster KEK: the wrapped DEK does not unwrap.
    let guess = Kek::new("kek-1", &[0x12; KEY_LEN]).expect("kek");
    let e = guess.unwrap(&wrapped, "vol-1").expect_err("wrong KEK");
    assert!(matches!(e, KeyError::Unwrap { .. }), "{e:?}");
    // The TPM with any other cluster half: another passphrase.
    let other = Dek::generate().expect("dek");
    let with_other = combine(&other, &tpm, "vol-1").expect("combine");
    assert_ne!(with_other.expose(), passphrase.expose());
}

#[test]
fn a_node_without_the_key_blobs_says_so() {
    let dir = std::env::temp_dir().join(format!("moor-tpm2-unit-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let tools = Tpm2Tools::new(&dir, Some("swtpm:port=1".into()));
    let e = tools.hmac(b"vol-1").expect_err("no key");
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        matches!(&e, KeyError::Refused(m) if m.contains("opens only on the node that made it")),
        "{e:?}"
    );
}

/// A directory of tpm2-tools that hang (`sleep`ing in a child of their own, as a tool stuck
/// on a TPM that never answers), and a key dir that has the node's key.
fn hanging_tools(name: &str) -> (PathBuf, Tpm2Tools) {
    let root = std::env::temp_dir().join(format!("moor-tpm2-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let (bin, keys) = (root.join("bin"), root.join("keys"));
    std::fs::create_dir_all(&bin).expect("bin");
    std::fs::create_dir_all(&keys).expect("keys");
    std::fs::write(keys.join("hmac.priv"), b"blob").expect("blob");
    for tool in [
        "tpm2_createprimary",
        "tpm2_flushcontext",
        "tpm2_load",
        "tpm2_hmac",
        "tpm2_create",
    ] {
        let path = bin.join(tool);
        // Not `exec`: the sleep is the tool's child, holding its pipes, as a helper would;
        // its pid written beside the tool.
        std::fs::write(
            &path,
            "#!/bin/sh\nsleep 600 &\necho $! > \"$0.pid\"\nwait\necho never\n",
        )
        .expect("tool");
        std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .expect("chmod");
    }
    let tools = Tpm2Tools::new(&keys, None)
        .with_programs(&bin)
        .with_deadline(std::time::Duration::from_millis(300));
    (root, tools)
}

#[test]
fn a_tpm_that_hangs_is_unavailable_after_the_deadline_never_a_hung_call() {
    let (root, tools) = hanging_tools("hang");
    let e = tools.hmac(b"vol-1").expect_err("a hanging TPM");
    assert!(
        matches!(&e, KeyError::Unavailable(m)
            if m.contains("tpm2_createprimary did not answer within 300ms and was killed")),
        "{e:?}"
    );
    // The tool's own child went with it (the whole group was killed): wait for its end.
    let pid_file = root.join("bin/tpm2_createprimary.pid");
    let pid = std::fs::read_to_string(&pid_file).expect("the tool ran and wrote its child's pid");
    let stat = format!("/proc/{}/stat", pid.trim());
    let until = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let gone = loop {
        // Gone, or a zombie not reaped yet.
        let alive = std::fs::read_to_string(&stat).is_ok_and(|s| {
            !s.rsplit(')')
                .next()
                .unwrap_or("")
                .trim_start()
                .starts_with('Z')
        });
        if !alive || std::time::Instant::now() > until {
            break !alive;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    };
    let _ = std::fs::remove_dir_all(&root);
    assert!(
        gone,
        "the hung tool's child {} outlived it by 60 s",
        pid.trim()
    );
}

#[test]
fn a_pcr_selection_is_checked_and_has_one_form() {
    assert_eq!(pcr_selection("sha256:7").expect("one"), "sha256:7");
    assert_eq!(pcr_selection("sha256:7,0,7").expect("set"), "sha256:0,7");
    for bad in [
        "7",
        "md5:7",
        "sha256:",
        "sha256:24",
        "sha256:-1",
        "sha256:7;rm",
        "sha256:7 ",
    ] {
        let e = pcr_selection(bad).expect_err(bad);
        assert!(
            matches!(
                e,
                KeyError::Malformed {
                    field: "tpm2PCRs",
                    ..
                }
            ),
            "{bad}: {e:?}"
        );
    }
    let dir = Path::new("/nonexistent");
    let sealed = Tpm2Tools::new(dir, None)
        .with_pcrs("sha256:7,0")
        .expect("sealed");
    assert_eq!(sealed.blob("priv"), "hmac-sha256_0_7.priv");
    assert_eq!(Tpm2Tools::new(dir, None).blob("priv"), "hmac.priv");
}
