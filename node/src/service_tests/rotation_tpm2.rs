//! A data key rotation of a staged `tpm2` volume (`engine::rotate`, docs/encryption.md,
//! "Rotation") on the fake's cryptsetup and a TPM in memory: the slots take each data key
//! combined with the node's half (the TPM asked once per call, under the volume's PCR
//! policy), the old combined key refused after it; a crash at every cryptsetup run resumed by
//! the next call, which asks the TPM again; another TPM or changed PCRs refused with nothing
//! touched; a stage during the rotation opening with the journaled key combined.

use std::collections::BTreeMap;

use moor_runtime::keys::tpm2::NodeHalf;
use moor_runtime::keys::{Dek, Kek, WrappedDek};

use super::encryption::{Keys, keys};
use super::encryption_sources::{FakeTpm, staged_tpm2_with};
use super::rotation::{crypt_record, named_slots};
use super::*;
use crate::engine::{NodeTpm, RotateDek, SLOT_VOLUME};
use crate::error::Error;

/// The harness's volume.
const VOL: &str = "vol-1";

/// The PCRs the volume's node half is sealed to.
const PCRS: &str = "sha256:7";

/// A staged `tpm2` volume, its node's TPM, its old keys, a new data key and the request.
struct Rotation {
    h: Harness,
    tpm: Arc<FakeTpm>,
    old: Keys,
    new: Dek,
    req: RotateDek,
}

async fn staged() -> Rotation {
    let mut h = harness();
    let tpm = FakeTpm::new(1);
    let old = keys(7);
    staged_tpm2_with(&mut h, Arc::clone(&tpm) as _, &old, &[("tpm2PCRs", PCRS)]).await;
    let new = Dek::generate().expect("dek");
    let kek = Kek::new("kek-1", &[7; 32]).expect("kek");
    let req = RotateDek {
        volume_id: VOL.to_owned(),
        old_wrapped: WrappedDek::decode(&old.wrapped).expect("old"),
        new_wrapped: new.wrap(&kek, VOL).expect("wrap"),
        kek: Arc::new(moor_runtime::keys::source::KeySource::Secret(kek)),
        pbkdf: "pbkdf2".to_owned(),
        tpm: NodeTpm(Arc::clone(&tpm) as _),
    };
    Rotation {
        h,
        tpm,
        old,
        new,
        req,
    }
}

/// `dek` combined with the node half of `tpm` sealed to [`PCRS`]: a slot's passphrase.
fn passphrase(tpm: &FakeTpm, dek: &Dek) -> Vec<u8> {
    NodeHalf::of(tpm, Some(PCRS), VOL)
        .and_then(|h| h.combine(dek))
        .expect("combine")
        .expose()
        .to_vec()
}

/// The header's slots, each named by the passphrase it opens with.
fn slots(r: &Rotation) -> BTreeMap<u32, &'static str> {
    let (old, new) = (passphrase(&r.tpm, &r.old.dek), passphrase(&r.tpm, &r.new));
    named_slots(&r.h, &old, &new)
}

/// The TPM's HMACs during `f`.
fn hmacs_during<T>(r: &Rotation, f: impl FnOnce() -> T) -> (T, usize) {
    let before = r.tpm.hmacs.load(Ordering::Relaxed);
    let out = f();
    (out, r.tpm.hmacs.load(Ordering::Relaxed) - before)
}

/// Done: slot 0 alone, with the new key combined; the journal's mapping names the new key.
fn assert_rotated(r: &Rotation) {
    assert_eq!(slots(r), BTreeMap::from([(SLOT_VOLUME, "new")]));
    assert!(
        !r.h.os.luks_opens_with(DEV, r.new.expose()),
        "the cluster half alone opens nothing"
    );
    let c = crypt_record(&r.h);
    assert_eq!(c.wrapped_dek, Some(r.req.new_wrapped.encode()));
    assert_eq!(c.rotation, None);
}

#[tokio::test]
async fn a_tpm2_volume_s_slot_moves_to_the_new_key_combined_with_the_same_node_half() {
    let r = staged().await;
    assert_eq!(slots(&r), BTreeMap::from([(SLOT_VOLUME, "old")]));
    let (report, asked) = hmacs_during(&r, || r.h.engine.rotate_dek(&r.req));
    report.expect("rotate");
    assert_eq!(asked, 1, "the node half is asked once for the call");
    assert_rotated(&r);
    assert!(
        !r.h.os.luks_opens_with(DEV, &passphrase(&r.tpm, &r.old.dek)),
        "the old combined key is refused"
    );
}

#[tokio::test]
async fn a_crash_at_every_cryptsetup_run_of_a_tpm2_rotation_resumes_with_the_tpm_asked_again() {
    let mut states = 0;
    for at in 0..9 {
        for done in [false, true] {
            let r = staged().await;
            r.h.os.crash_tool_at("cryptsetup", at, done);
            let e = r.h.engine.rotate_dek(&r.req).expect_err("crashed");
            assert!(matches!(e, Error::Tool(_)), "run {at} ({done}): {e:?}");
            let now = slots(&r);
            assert!(!now.is_empty(), "run {at} ({done}): no slot left");
            assert!(
                now.values().all(|k| *k != "other"),
                "run {at} ({done}): {now:?}"
            );
            // The journal holds the keys wrapped only, and the one it names opens, combined.
            let c = crypt_record(&r.h);
            if let Some(rot) = &c.rotation {
                assert_eq!(rot.new_wrapped, r.req.new_wrapped.encode());
            }
            let named = WrappedDek::decode(&c.wrapped_dek.expect("wrapped")).expect("decode");
            let key = r.req.kek.unwrap(&named, VOL).expect("unwrap");
            assert!(
                r.h.os.luks_opens_with(DEV, &passphrase(&r.tpm, &key)),
                "run {at} ({done}): the journal's key opens nothing: {now:?}"
            );
            let (resumed, asked) = hmacs_during(&r, || r.h.engine.rotate_dek(&r.req));
            resumed.expect("resumed");
            assert_eq!(asked, 1, "run {at} ({done}): the node half asked again");
            assert_rotated(&r);
            states += 1;
        }
    }
    assert_eq!(states, 18);
}

#[tokio::test]
async fn another_tpm_or_changed_pcrs_refuse_the_rotation_and_touch_nothing() {
    let r = staged().await;
    let other = RotateDek {
        tpm: NodeTpm(FakeTpm::new(2)),
        ..r.req.clone()
    };
    let e = r.h.engine.rotate_dek(&other).expect_err("another TPM");
    assert!(matches!(e, Error::FailedPrecondition(_)), "{e:?}");
    r.tpm.pcrs_changed.store(true, Ordering::Relaxed);
    let e = r.h.engine.rotate_dek(&r.req).expect_err("PCRs changed");
    assert!(
        matches!(&e, Error::FailedPrecondition(m) if m.contains("policy") && m.contains("nothing was rotated")),
        "{e:?}"
    );
    r.tpm.pcrs_changed.store(false, Ordering::Relaxed);
    assert_eq!(slots(&r), BTreeMap::from([(SLOT_VOLUME, "old")]));
    assert_eq!(crypt_record(&r.h).rotation, None);
    assert_eq!(crypt_record(&r.h).wrapped_dek, Some(r.old.wrapped.clone()));
    r.h.engine.rotate_dek(&r.req).expect("the PCRs back");
    assert_rotated(&r);
}

#[tokio::test]
async fn a_tpm2_volume_staged_again_during_a_rotation_opens_with_the_journaled_key_combined() {
    let mut r = staged().await;
    // Cut short right after the old key's spare slot was removed: only the new key opens it.
    r.h.os.crash_tool_at("cryptsetup", 8, true);
    r.h.engine.rotate_dek(&r.req).expect_err("crashed");
    assert_eq!(slots(&r), BTreeMap::from([(SLOT_VOLUME, "new")]));
    r.h.svc
        .node_unstage_volume(Request::new(unstage_req()))
        .await
        .expect("unstage");
    assert!(r.h.os.luks_mappings().is_empty(), "closed");
    let tpm = Arc::clone(&r.tpm);
    staged_tpm2_with(&mut r.h, tpm as _, &r.old, &[("tpm2PCRs", PCRS)]).await;
    assert!(r.h.os.luks_mappings().contains_key("moor-vol-1"));
    assert_eq!(
        crypt_record(&r.h).wrapped_dek,
        Some(r.req.new_wrapped.encode()),
        "the mapping names the key that opened it"
    );
    r.h.engine.rotate_dek(&r.req).expect("finished");
    assert_rotated(&r);
}
