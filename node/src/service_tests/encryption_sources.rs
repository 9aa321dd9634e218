//! NodeExpandVolume of encrypted volumes of every key source (docs/encryption.md): the key
//! `cryptsetup resize` needs is got as the stage got it, by the source the journal's record
//! names: for `tpm2`, the cluster half combined with this node's TPM (never a new TPM key),
//! for `kmip`, the KMIP server's configuration. And a TPM that hangs fails the call with
//! UNAVAILABLE, never holds it. The fake's cryptsetup checks the key it reads on stdin against
//! the key the LUKS header was made with.

use std::sync::atomic::{AtomicBool, AtomicUsize};

use moor_runtime::keys::tpm2::{Tpm, Tpm2Tools, Zeroizing};
use moor_runtime::keys::{KeyError, Result as KeyResult};

use super::encryption::{
    encrypted_req, grew_mapping_then_filesystem, keys, no_key_anywhere, tools,
};
use super::*;

/// A TPM in memory: a keyed function of its own seed (any TPM's HMAC is as opaque to moor),
/// or unreachable; it counts the keys it was asked to make and the HMACs it gave.
pub(super) struct FakeTpm {
    seed: u8,
    reachable: bool,
    keys_made: AtomicUsize,
    /// The HMACs it answered.
    pub(super) hmacs: AtomicUsize,
    /// The PCRs no longer hold the values its sealed keys were made with.
    pub(super) pcrs_changed: AtomicBool,
}

/// A [`FakeTpm`]'s key sealed to `pcrs`: a key of its own, refused once the PCRs change.
struct Sealed<'a> {
    tpm: &'a FakeTpm,
    pcrs: String,
}

impl Tpm for Sealed<'_> {
    fn hmac(&self, message: &[u8]) -> KeyResult<Zeroizing<Vec<u8>>> {
        if self.tpm.pcrs_changed.load(Ordering::Relaxed) {
            return Err(KeyError::Refused(format!(
                "the node's TPM refuses its key sealed to the PCRs {}: a policy check failed",
                self.pcrs
            )));
        }
        let mut sealed = self.pcrs.as_bytes().to_vec();
        sealed.extend_from_slice(message);
        self.tpm.hmac(&sealed)
    }

    fn ensure_key(&self) -> KeyResult<()> {
        self.tpm.ensure_key()
    }
}

impl FakeTpm {
    pub(super) fn new(seed: u8) -> Arc<Self> {
        Arc::new(Self {
            seed,
            reachable: true,
            keys_made: AtomicUsize::new(0),
            hmacs: AtomicUsize::new(0),
            pcrs_changed: AtomicBool::new(false),
        })
    }
}

impl Tpm for FakeTpm {
    fn hmac(&self, message: &[u8]) -> KeyResult<Zeroizing<Vec<u8>>> {
        if !self.reachable {
            return Err(KeyError::Unavailable(
                "the node's TPM: no such device".into(),
            ));
        }
        self.hmacs.fetch_add(1, Ordering::Relaxed);
        let mut out = vec![self.seed; 32];
        for (i, b) in message.iter().enumerate() {
            let o = &mut out[i % 32];
            *o = o.wrapping_mul(31).wrapping_add(*b);
        }
        Ok(Zeroizing::new(out))
    }

    fn ensure_key(&self) -> KeyResult<()> {
        self.keys_made.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    fn sealed_to(&self, pcrs: &str) -> KeyResult<Box<dyn Tpm + '_>> {
        Ok(Box::new(Sealed {
            tpm: self,
            pcrs: pcrs.to_owned(),
        }))
    }
}

/// The harness's service with `tpm` as the node's TPM.
pub(super) fn with_tpm(h: &mut Harness, tpm: Arc<dyn Tpm>) {
    h.svc = NodeService::new(Arc::clone(&h.engine), h.info.clone()).with_tpm(tpm);
}

/// `vol-1` staged as a `tpm2` volume (its cluster half under a Secret's KEK) on `tpm`, its
/// device then grown to 2 GiB.
async fn staged_tpm2(h: &mut Harness, tpm: Arc<dyn Tpm>, k: &encryption::Keys) {
    staged_tpm2_with(h, tpm, k, &[]).await;
}

/// As [`staged_tpm2`], with more of the volume context.
pub(super) async fn staged_tpm2_with(
    h: &mut Harness,
    tpm: Arc<dyn Tpm>,
    k: &encryption::Keys,
    more: &[(&str, &str)],
) {
    with_tpm(h, tpm);
    let mut req = encrypted_req(ext4(), k);
    req.volume_context.insert("kmsID".into(), "tpm2".into());
    for (key, value) in more {
        req.volume_context.insert((*key).into(), (*value).into());
    }
    h.svc
        .node_stage_volume(Request::new(req))
        .await
        .expect("stage");
    h.os.resize_device(DEV, 2 * GIB);
    h.os.clear_calls();
}

fn expand_with(secrets: &HashMap<String, String>) -> csi::NodeExpandVolumeRequest {
    let mut req = expand_req(STAGING, 2 * GIB as i64);
    req.secrets = secrets.clone();
    req
}

#[tokio::test]
async fn a_tpm2_volume_grows_with_the_key_its_stage_opened_with() {
    let mut h = harness();
    let k = keys(7);
    let tpm = FakeTpm::new(1);
    staged_tpm2(&mut h, Arc::clone(&tpm) as _, &k).await;
    assert_eq!(
        crypt_record(&h).kms_id.as_deref(),
        Some("tpm2"),
        "the journal keeps the source"
    );
    h.svc
        .node_expand_volume(Request::new(expand_with(&k.secrets)))
        .await
        .expect("expand");
    // The fake's cryptsetup took the key: the cluster half combined with the TPM's.
    grew_mapping_then_filesystem(&h);
    assert_eq!(
        tpm.keys_made.load(Ordering::Relaxed),
        1,
        "the stage makes the node's key if need be; the expansion never does"
    );
    no_key_anywhere(&h, &k);
}

#[tokio::test]
async fn a_tpm2_volume_does_not_grow_on_another_tpm_or_without_one() {
    let mut h = harness();
    let k = keys(7);
    staged_tpm2(&mut h, FakeTpm::new(1), &k).await;
    // Another node's TPM (or this one's cleared): the combined key opens no slot.
    with_tpm(&mut h, FakeTpm::new(2));
    let s = h
        .svc
        .node_expand_volume(Request::new(expand_with(&k.secrets)))
        .await
        .expect_err("another TPM");
    assert_eq!(s.code(), Code::FailedPrecondition, "{s:?}");
    assert!(
        s.message().contains("does not open volume") && s.message().contains("nothing was resized"),
        "{}",
        s.message()
    );
    assert_eq!(tools(&h), ["cryptsetup resize"], "refused, nothing grown");
    // The TPM cannot be reached: UNAVAILABLE (the CO retries), nothing run.
    h.os.clear_calls();
    with_tpm(
        &mut h,
        Arc::new(FakeTpm {
            seed: 1,
            reachable: false,
            keys_made: AtomicUsize::new(0),
            hmacs: AtomicUsize::new(0),
            pcrs_changed: AtomicBool::new(false),
        }),
    );
    let s = h
        .svc
        .node_expand_volume(Request::new(expand_with(&k.secrets)))
        .await
        .expect_err("no TPM");
    assert_eq!(s.code(), Code::Unavailable, "{s:?}");
    assert!(tools(&h).is_empty(), "{:?}", tools(&h));
    // The cluster half missing (no node-expand secret): INVALID_ARGUMENT naming it.
    with_tpm(&mut h, FakeTpm::new(1));
    let s = h
        .svc
        .node_expand_volume(Request::new(expand_req(STAGING, 2 * GIB as i64)))
        .await
        .expect_err("no secret");
    assert_eq!(s.code(), Code::InvalidArgument, "{s:?}");
    assert!(s.message().contains("node-expand"), "{}", s.message());
    assert!(tools(&h).is_empty());
    // Both halves: it grows.
    h.svc
        .node_expand_volume(Request::new(expand_with(&k.secrets)))
        .await
        .expect("expand");
    grew_mapping_then_filesystem(&h);
}

#[tokio::test]
async fn a_kmip_volume_grows_only_through_its_kmip_server() {
    let h = harness();
    let k = keys(7);
    super::encryption::stage_encrypted(&h, ext4(), &k)
        .await
        .expect("stage");
    // The record of a volume its stage opened with a KMIP server's key (the fake OS has no
    // KMIP server: privileged/tests/kmip.rs grows one against PyKMIP).
    let mut record = h.engine.journal().get("vol-1").expect("record");
    if let Some(c) = record.crypt.as_mut() {
        c.kms_id = Some("kmip".into());
    }
    h.engine
        .journal()
        .put(&record, journal::Durability::Process)
        .expect("put");
    h.os.resize_device(DEV, 2 * GIB);
    h.os.clear_calls();
    // A Secret's KEK is not that source: the KMIP server's configuration is missing.
    let s = h
        .svc
        .node_expand_volume(Request::new(expand_with(&k.secrets)))
        .await
        .expect_err("not the volume's source");
    assert_eq!(s.code(), Code::InvalidArgument, "{s:?}");
    assert!(
        s.message().contains("KMIP_ENDPOINT") && s.message().contains("node-expand"),
        "{}",
        s.message()
    );
    assert!(tools(&h).is_empty());
}

/// A directory of tpm2-tools that hang, and a key dir holding the node's key.
fn hanging_tpm(root: &Path) -> Tpm2Tools {
    let (bin, keys) = (root.join("bin"), root.join("keys"));
    std::fs::create_dir_all(&bin).expect("bin");
    std::fs::create_dir_all(&keys).expect("keys");
    std::fs::write(keys.join("hmac.priv"), b"blob").expect("blob");
    std::fs::write(keys.join("hmac.pub"), b"blob").expect("blob");
    for tool in [
        "tpm2_createprimary",
        "tpm2_flushcontext",
        "tpm2_load",
        "tpm2_hmac",
    ] {
        let path = bin.join(tool);
        std::fs::write(&path, "#!/bin/sh\nexec sleep 600\n").expect("tool");
        std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .expect("chmod");
    }
    Tpm2Tools::new(&keys, None)
        .with_programs(&bin)
        .with_deadline(std::time::Duration::from_millis(200))
}

#[tokio::test]
async fn a_tpm_that_hangs_fails_the_stage_unavailable_and_touches_nothing() {
    let mut h = harness();
    let root = h.state.join("hanging-tpm");
    with_tpm(&mut h, Arc::new(hanging_tpm(&root)));
    let k = keys(7);
    let mut req = encrypted_req(ext4(), &k);
    req.volume_context.insert("kmsID".into(), "tpm2".into());
    let s = h
        .svc
        .node_stage_volume(Request::new(req))
        .await
        .expect_err("a hanging TPM");
    assert_eq!(s.code(), Code::Unavailable, "{s:?}");
    assert!(
        s.message().contains("did not answer within") && s.message().contains("nothing was opened"),
        "{}",
        s.message()
    );
    assert!(h.os.calls().is_empty(), "{:?}", h.os.calls());
    assert!(h.engine.journal().get("vol-1").is_none());
}

/// The mapping's record in the journal.
fn crypt_record(h: &Harness) -> journal::CryptRecord {
    h.engine
        .journal()
        .get("vol-1")
        .and_then(|r| r.crypt)
        .expect("the mapping's record")
}

#[tokio::test]
async fn a_tpm2_volume_sealed_to_pcrs_grows_while_they_hold_and_is_refused_once_they_change() {
    let mut h = harness();
    let k = keys(7);
    let tpm = FakeTpm::new(1);
    staged_tpm2_with(
        &mut h,
        Arc::clone(&tpm) as _,
        &k,
        &[("tpm2PCRs", "sha256:7,0")],
    )
    .await;
    assert_eq!(
        crypt_record(&h).tpm2_pcrs.as_deref(),
        Some("sha256:0,7"),
        "the journal keeps the selection, in its one form"
    );
    h.svc
        .node_expand_volume(Request::new(expand_with(&k.secrets)))
        .await
        .expect("expand with the sealed key");
    grew_mapping_then_filesystem(&h);

    // The key unsealed is another key: a record without the selection does not open it.
    let mut record = h.engine.journal().get("vol-1").expect("record");
    let kept = record.crypt.clone();
    if let Some(c) = record.crypt.as_mut() {
        c.tpm2_pcrs = None;
    }
    h.engine
        .journal()
        .put(&record, journal::Durability::Process)
        .expect("put");
    h.os.clear_calls();
    let s = h
        .svc
        .node_expand_volume(Request::new(expand_with(&k.secrets)))
        .await
        .expect_err("the unsealed key");
    assert_eq!(s.code(), Code::FailedPrecondition, "{s:?}");
    record.crypt = kept;
    h.engine
        .journal()
        .put(&record, journal::Durability::Process)
        .expect("put");

    // The PCRs change (another boot): refused, saying why, nothing run.
    tpm.pcrs_changed.store(true, Ordering::Relaxed);
    h.os.clear_calls();
    let s = h
        .svc
        .node_expand_volume(Request::new(expand_with(&k.secrets)))
        .await
        .expect_err("PCRs changed");
    assert_eq!(s.code(), Code::FailedPrecondition, "{s:?}");
    assert!(
        s.message().contains("sealed to the PCRs sha256:0,7"),
        "{}",
        s.message()
    );
    assert!(tools(&h).is_empty(), "{:?}", tools(&h));
}

#[tokio::test]
async fn a_pcr_selection_is_checked_and_only_for_tpm2() {
    let k = keys(7);
    for (kms, pcrs) in [
        ("tpm2", "sha256:24"),
        ("tpm2", "md5:7"),
        ("secret", "sha256:7"),
    ] {
        let h = harness();
        let mut req = encrypted_req(ext4(), &k);
        req.volume_context.insert("kmsID".into(), kms.into());
        req.volume_context.insert("tpm2PCRs".into(), pcrs.into());
        let s = h
            .svc
            .node_stage_volume(Request::new(req))
            .await
            .expect_err("refused");
        assert_eq!(s.code(), Code::InvalidArgument, "{kms} {pcrs}: {s:?}");
        assert!(s.message().contains("tpm2PCRs"), "{}", s.message());
        assert!(h.os.calls().is_empty());
    }
}
