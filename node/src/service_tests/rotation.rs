//! A data key rotation of a staged encrypted volume (`engine::rotate`, docs/encryption.md,
//! "Rotation") on the fake's cryptsetup, which keeps key slots: the steps in ceph-csi's
//! order, a crash at every cryptsetup run (before it ran and after) resumed by the next call
//! to the new key alone, a header that always opens with a key the journal holds, a wrong
//! old key refused with nothing touched, and no key byte in any argument, the journal or a
//! `Debug`.

use std::collections::BTreeMap;
use std::sync::Arc;

use moor_runtime::keys::{Dek, Kek, WrappedDek};

use super::encryption::{Keys, keys, no_key_anywhere, stage_encrypted};
use super::*;
use crate::engine::{NodeTpm, RotateDek, SLOT_SPARE, SLOT_VOLUME};
use crate::error::Error;
use crate::journal::{Durability, RotationStep};

/// The harness's volume.
const VOL: &str = "vol-1";

/// The KEK of [`keys`]`(byte)`.
fn kek(byte: u8) -> Arc<Kek> {
    Arc::new(Kek::new("kek-1", &[byte; 32]).expect("kek"))
}

/// The key source of [`kek`]`(byte)`, as a rotation's request holds it.
fn source(byte: u8) -> Arc<moor_runtime::keys::source::KeySource> {
    Arc::new(moor_runtime::keys::source::KeySource::Secret(
        Kek::new("kek-1", &[byte; 32]).expect("kek"),
    ))
}

/// A staged encrypted volume, its old keys, a new data key and the request that rotates to it.
struct Rotation {
    h: Harness,
    old: Keys,
    new: Dek,
    req: RotateDek,
}

async fn staged() -> Rotation {
    let h = harness();
    let old = keys(7);
    stage_encrypted(&h, ext4(), &old).await.expect("stage");
    let new = Dek::generate().expect("dek");
    let kek = kek(7);
    let req = RotateDek {
        volume_id: VOL.to_owned(),
        old_wrapped: WrappedDek::decode(&old.wrapped).expect("old"),
        new_wrapped: new.wrap(&kek, VOL).expect("wrap"),
        kek: source(7),
        pbkdf: "pbkdf2".to_owned(),
        tpm: NodeTpm::from_env(),
    };
    Rotation { h, old, new, req }
}

/// The mutating cryptsetup runs, as `action slot`, and the tests as `test slot`.
fn slot_calls(h: &Harness) -> Vec<String> {
    tool_calls(h)
        .into_iter()
        .filter_map(|c| match c {
            Call::Tool(p, a) if p == "cryptsetup" => {
                let after = |flag: &str| a.windows(2).find(|w| w[0] == flag).map(|w| w[1].clone());
                match a[0].as_str() {
                    "luksAddKey" => Some(format!("add {}", after("--new-key-slot")?)),
                    "luksKillSlot" => Some(format!("kill {}", a.last()?)),
                    "open" if a.contains(&"--test-passphrase".to_owned()) => {
                        Some(format!("test {}", after("--key-slot")?))
                    }
                    _ => None,
                }
            }
            _ => None,
        })
        .collect()
}

/// The header's slots, each named by the key it opens with.
fn slots(r: &Rotation) -> BTreeMap<u32, &'static str> {
    named_slots(&r.h, r.old.dek.expose(), r.new.expose())
}

/// The header's slots, each named `old` or `new` by the passphrase it opens with (`other`).
pub(super) fn named_slots(h: &Harness, old: &[u8], new: &[u8]) -> BTreeMap<u32, &'static str> {
    h.os.luks_slots(DEV)
        .into_iter()
        .map(|(s, k)| {
            let name = if k == old {
                "old"
            } else if k == new {
                "new"
            } else {
                "other"
            };
            (s, name)
        })
        .collect()
}

/// The mapping's record in the journal.
pub(super) fn crypt_record(h: &Harness) -> journal::CryptRecord {
    h.engine
        .journal()
        .get(VOL)
        .and_then(|r| r.crypt)
        .expect("the mapping's record")
}

/// Done: slot 0 alone, with the new key; the journal's mapping holds the new key, wrapped,
/// and no rotation.
fn assert_rotated(r: &Rotation) {
    assert_eq!(slots(r), BTreeMap::from([(SLOT_VOLUME, "new")]));
    let c = crypt_record(&r.h);
    assert_eq!(c.wrapped_dek, Some(r.req.new_wrapped.encode()));
    assert_eq!(c.rotation, None);
    assert!(c.rotated, "kept across an unstage");
}

#[tokio::test]
async fn a_rotation_copies_the_old_key_then_replaces_its_slot_verifies_and_drops_the_copy() {
    let r = staged().await;
    let before = tool_calls(&r.h).len();
    let report = r.h.engine.rotate_dek(&r.req).expect("rotate");
    // In ceph-csi's order (docs/encryption.md, "Rotation").
    assert_eq!(
        format!("{:?}", report.ran),
        "[CopyOld, KillOld, AddNew, Record, Verify, KillSpare]"
    );
    let calls = slot_calls(&r.h);
    let ran: Vec<&str> = calls.iter().map(String::as_str).collect();
    // The probe (slot 0 opens with the old key; slot 1 with neither), then the steps.
    assert_eq!(
        ran,
        [
            "test 0", "test 1", "test 1", // slot 0: the old key; slot 1: neither
            "add 1",  // 1. the old key copied into the spare
            "kill 0", // 2. the volume's slot emptied (the spare proves the old key)
            "add 0",  // 3. the new key into the volume's slot (opened by the spare)
            "test 0", // 5. the recorded key read back and tried on slot 0 alone
            "test 1", "kill 1", // 6. the old key's spare removed (slot 0 proves the new)
        ][..]
    );
    assert!(tool_calls(&r.h).len() > before);
    assert_rotated(&r);
    // The mapping stays open throughout: the rotation is online.
    assert!(r.h.os.luks_mappings().contains_key("moor-vol-1"));
    // Run again: nothing left to do but the record, and nothing changes.
    let again = r.h.engine.rotate_dek(&r.req).expect("again");
    assert_eq!(again.ran[0], RotationStep::Record);
    assert_rotated(&r);
}

#[tokio::test]
async fn the_new_slot_takes_the_volumes_pbkdf_and_every_key_goes_on_stdin() {
    let r = staged().await;
    r.h.engine.rotate_dek(&r.req).expect("rotate");
    for c in tool_calls(&r.h) {
        if let Call::Tool(p, a) = c
            && p == "cryptsetup"
            && a[0] != "luksFormat"
        {
            assert!(
                a.contains(&"--key-file=-".to_owned()) || a[0] == "close",
                "{a:?}"
            );
            assert!(
                !a.iter().any(|x| x == "--batch-mode"),
                "never kill without proof: {a:?}"
            );
            if a[0] == "luksAddKey" {
                assert_eq!(a.last().map(String::as_str), Some("/dev/stdin"), "{a:?}");
                for flag in ["--pbkdf", "pbkdf2", "--pbkdf-force-iterations"] {
                    assert!(a.contains(&flag.to_owned()), "{flag} in {a:?}");
                }
            }
        }
    }
    let new = Keys {
        secrets: r.old.secrets.clone(),
        wrapped: r.req.new_wrapped.encode(),
        dek: Dek::generate().expect("placeholder"),
    };
    no_key_anywhere(&r.h, &r.old);
    // The new key's bytes, spelled in hex, are nowhere either.
    let hex: String = r.new.expose().iter().map(|b| format!("{b:02x}")).collect();
    for c in r.h.os.calls() {
        assert!(!format!("{c:?}").contains(&hex));
    }
    let log = std::fs::read(r.h.state.join(journal::LOG_FILE)).expect("journal");
    assert!(!log.windows(32).any(|w| w == r.new.expose()));
    assert!(!String::from_utf8_lossy(&log).contains(&hex));
    drop(new);
    let debug = format!("{:?}", r.req);
    assert!(!debug.contains(&hex), "{debug}");
    assert!(!debug.contains(&r.old.secrets["kek"]), "{debug}");
}

/// The number of cryptsetup runs of a whole rotation.
async fn runs_of_a_rotation() -> u32 {
    let r = staged().await;
    let before = slot_calls(&r.h).len();
    r.h.engine.rotate_dek(&r.req).expect("rotate");
    u32::try_from(slot_calls(&r.h).len() - before).expect("runs")
}

#[tokio::test]
async fn a_crash_at_every_cryptsetup_run_leaves_a_key_the_journal_holds_and_the_next_call_finishes()
{
    let runs = runs_of_a_rotation().await;
    assert_eq!(runs, 9);
    let mut states = 0;
    for at in 0..runs {
        for done in [false, true] {
            let r = staged().await;
            r.h.os.crash_tool_at("cryptsetup", at, done);
            let e = r.h.engine.rotate_dek(&r.req).expect_err("crashed");
            assert!(
                matches!(e, Error::Tool(_)),
                "run {at} (done: {done}): {e:?}"
            );
            // At this instant: every slot holds the old or the new key, some slot does, and
            // the journal holds both wrapped.
            let now = slots(&r);
            assert!(!now.is_empty(), "run {at} (done: {done}): no slot left");
            assert!(
                now.values().all(|k| *k != "other"),
                "run {at} (done: {done}): {now:?}"
            );
            let c = crypt_record(&r.h);
            match c.rotation.as_ref() {
                Some(rot) => {
                    assert_eq!(rot.old_wrapped, r.old.wrapped);
                    assert_eq!(rot.new_wrapped, r.req.new_wrapped.encode());
                }
                // Cut short while the header was being read: nothing written at all.
                None => {
                    assert!(
                        at < 3,
                        "run {at} (done: {done}): the rotation is not journaled"
                    );
                    assert_eq!(now, BTreeMap::from([(SLOT_VOLUME, "old")]));
                }
            }
            // The key the journal's mapping names opens the header.
            let named = c.wrapped_dek.expect("wrapped");
            let key = r
                .req
                .kek
                .unwrap(&WrappedDek::decode(&named).expect("decode"), VOL)
                .expect("unwrap");
            assert!(
                r.h.os.luks_opens_with(DEV, key.expose()),
                "run {at} (done: {done}): the journal's key opens nothing: {now:?}"
            );
            // The next call, with the same keys, finishes it.
            r.h.engine.rotate_dek(&r.req).expect("resumed");
            assert_rotated(&r);
            states += 1;
        }
    }
    assert_eq!(states, 18);
}

#[tokio::test]
async fn a_wrong_old_key_or_kek_is_refused_and_touches_nothing() {
    let r = staged().await;
    let kek = kek(7);
    let stranger = Dek::generate().expect("dek").wrap(&kek, VOL).expect("wrap");
    let wrong = RotateDek {
        old_wrapped: stranger,
        ..r.req.clone()
    };
    let before = slot_calls(&r.h).len();
    let e = r.h.engine.rotate_dek(&wrong).expect_err("a wrong old key");
    assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
    assert!(e.to_string().contains("old data key"), "{e}");
    let tried = slot_calls(&r.h).split_off(before);
    assert!(tried.iter().all(|c| c.starts_with("test")), "{tried:?}");
    assert_eq!(slots(&r), BTreeMap::from([(SLOT_VOLUME, "old")]));
    assert_eq!(crypt_record(&r.h).rotation, None);
    assert_eq!(crypt_record(&r.h).wrapped_dek, Some(r.old.wrapped.clone()));
    // A KEK under the same id with other bytes unwraps neither key.
    let impostor = RotateDek {
        kek: source(8),
        ..r.req.clone()
    };
    let e = r.h.engine.rotate_dek(&impostor).expect_err("a wrong KEK");
    assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
    assert!(!e.to_string().contains(&r.old.secrets["kek"]));
    assert_eq!(slots(&r), BTreeMap::from([(SLOT_VOLUME, "old")]));
    // The same key twice.
    let same = RotateDek {
        new_wrapped: r.req.old_wrapped.clone(),
        ..r.req.clone()
    };
    assert_eq!(
        r.h.engine.rotate_dek(&same).expect_err("same").code(),
        Code::InvalidArgument
    );
}

#[tokio::test]
async fn a_spare_slot_holding_an_unknown_key_is_left_alone() {
    let r = staged().await;
    // Someone's own key in slot 1.
    let mut both = r.old.dek.expose().to_vec();
    both.extend_from_slice(&[0x33; 32]);
    let add = crate::sys::ToolRun {
        program: "cryptsetup".into(),
        args: [
            "luksAddKey",
            "--new-key-slot",
            "1",
            "--key-file=-",
            "--keyfile-size",
            "32",
            "--new-keyfile-size",
            "32",
            DEV,
            "/dev/stdin",
        ]
        .map(String::from)
        .to_vec(),
        deadline: std::time::Duration::from_secs(5),
    };
    crate::sys::Os::run_tool_with_key(&*r.h.os, &add, &both).expect("foreign key");
    let e = r.h.engine.rotate_dek(&r.req).expect_err("spare in use");
    assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
    let now = slots(&r);
    assert_eq!(now.get(&SLOT_VOLUME), Some(&"old"));
    assert_eq!(now.get(&SLOT_SPARE), Some(&"other"), "left alone");
}

#[tokio::test]
async fn another_rotation_in_progress_is_finished_first_and_an_unstaged_volume_is_refused() {
    let r = staged().await;
    r.h.os.crash_tool_at("cryptsetup", 5, true);
    r.h.engine.rotate_dek(&r.req).expect_err("crashed");
    let kek = kek(7);
    let other = RotateDek {
        new_wrapped: Dek::generate().expect("dek").wrap(&kek, VOL).expect("wrap"),
        ..r.req.clone()
    };
    let e =
        r.h.engine
            .rotate_dek(&other)
            .expect_err("another in progress");
    assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
    r.h.engine
        .rotate_dek(&r.req)
        .expect("the journaled one finishes");
    assert_rotated(&r);
    let h = harness();
    let e = h.engine.rotate_dek(&r.req).expect_err("not staged here");
    assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
}

#[tokio::test]
async fn a_volume_staged_again_during_a_rotation_opens_with_the_key_its_header_holds() {
    let r = staged().await;
    // Cut short right after the old key's spare slot was removed: only the new key opens it.
    r.h.os.crash_tool_at("cryptsetup", 8, true);
    r.h.engine.rotate_dek(&r.req).expect_err("crashed");
    assert_eq!(slots(&r), BTreeMap::from([(SLOT_VOLUME, "new")]));
    r.h.svc
        .node_unstage_volume(Request::new(unstage_req()))
        .await
        .expect("unstage");
    assert!(r.h.os.luks_mappings().is_empty(), "closed");
    // The unstage kept the rotation's keys: the stage's old key (the volume context's) no
    // longer opens the header, the journaled new one does.
    assert!(crypt_record(&r.h).rotation.is_some());
    stage_encrypted(&r.h, ext4(), &r.old)
        .await
        .expect("a stage during the rotation");
    assert!(r.h.os.luks_mappings().contains_key("moor-vol-1"));
    assert_eq!(
        crypt_record(&r.h).wrapped_dek,
        Some(r.req.new_wrapped.encode()),
        "the mapping names the key that opened it"
    );
    r.h.engine.rotate_dek(&r.req).expect("finished");
    assert_rotated(&r);
    // A stage retried with the volume context's old key leaves the journal's new key alone.
    stage_encrypted(&r.h, ext4(), &r.old).await.expect("again");
    assert_rotated(&r);
}

#[tokio::test]
async fn the_node_keys_call_checks_its_fields_and_rotates() {
    use moor_proto::keys::v1 as k;
    use moor_proto::keys::v1::node_keys_server::NodeKeys;
    let r = staged().await;
    let svc = crate::keys_service::KeysService::new(Arc::clone(&r.h.engine), NodeTpm::from_env());
    let good = k::RotateVolumeKeyRequest {
        volume_id: VOL.to_owned(),
        old_wrapped_dek: r.old.wrapped.clone(),
        new_wrapped_dek: r.req.new_wrapped.encode(),
        luks_pbkdf: "pbkdf2".to_owned(),
        secrets: r.old.secrets.clone(),
    };
    let bad: [(&str, k::RotateVolumeKeyRequest); 5] = [
        (
            "volume_id",
            k::RotateVolumeKeyRequest {
                volume_id: String::new(),
                ..good.clone()
            },
        ),
        (
            "secrets",
            k::RotateVolumeKeyRequest {
                secrets: HashMap::new(),
                ..good.clone()
            },
        ),
        (
            "old_wrapped_dek",
            k::RotateVolumeKeyRequest {
                old_wrapped_dek: "v1:x".into(),
                ..good.clone()
            },
        ),
        (
            "new_wrapped_dek",
            k::RotateVolumeKeyRequest {
                new_wrapped_dek: String::new(),
                ..good.clone()
            },
        ),
        (
            "pbkdf",
            k::RotateVolumeKeyRequest {
                luks_pbkdf: "--x".into(),
                ..good.clone()
            },
        ),
    ];
    for (field, req) in bad {
        let e = svc
            .rotate_volume_key(Request::new(req))
            .await
            .expect_err(field);
        assert_eq!(e.code(), Code::InvalidArgument, "{field}: {e:?}");
        assert!(e.message().contains(field), "{field}: {}", e.message());
        assert!(!e.message().contains(&r.old.secrets["kek"]));
    }
    assert_eq!(
        slots(&r),
        BTreeMap::from([(SLOT_VOLUME, "old")]),
        "nothing touched"
    );
    let answer = svc
        .rotate_volume_key(Request::new(good))
        .await
        .expect("rotate")
        .into_inner();
    assert_eq!(answer.steps.len(), 6, "{:?}", answer.steps);
    assert_eq!(answer.kek_id, "kek-1");
    assert_rotated(&r);
}

#[tokio::test]
async fn after_a_finished_rotation_the_next_stage_here_opens_with_the_rotated_key() {
    let r = staged().await;
    r.h.engine.rotate_dek(&r.req).expect("rotate");
    r.h.svc
        .node_unstage_volume(Request::new(unstage_req()))
        .await
        .expect("unstage");
    assert!(r.h.os.luks_mappings().is_empty(), "closed");
    // The PersistentVolume's context still gives the old key; the journal keeps the new one.
    stage_encrypted(&r.h, ext4(), &r.old)
        .await
        .expect("the stage after the rotation");
    assert!(r.h.os.luks_mappings().contains_key("moor-vol-1"));
    assert_rotated(&r);
    // A key neither the header nor the journal knows still opens nothing.
    r.h.svc
        .node_unstage_volume(Request::new(unstage_req()))
        .await
        .expect("unstage");
    let stranger = keys(9);
    let e = stage_encrypted(&r.h, ext4(), &stranger)
        .await
        .expect_err("another KEK");
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    assert!(r.h.os.luks_mappings().is_empty());
}

/// NodeStageVolume of the volume with the volume context's old key and, in its
/// publish_context, the controller record's `current` and `pending` keys.
async fn stage_published(
    r: &Rotation,
    current: Option<&str>,
    pending: Option<&str>,
) -> Result<(), tonic::Status> {
    let mut req = super::encryption::encrypted_req(ext4(), &r.old);
    for (k, v) in [("encryptedDEK", current), ("encryptedDEKPending", pending)] {
        if let Some(v) = v {
            req.publish_context.insert(k.to_owned(), v.to_owned());
        }
    }
    r.h.svc.node_stage_volume(Request::new(req)).await.map(drop)
}

/// The volume unstaged and its node's journal forgotten: what another node (or this one
/// after its journal is lost) knows of it is what the stage request says.
async fn unstaged_and_forgotten(r: &Rotation) {
    r.h.svc
        .node_unstage_volume(Request::new(unstage_req()))
        .await
        .expect("unstage");
    assert!(r.h.os.luks_mappings().is_empty(), "closed");
    r.h.engine
        .journal()
        .put(&journal::VolumeRecord::new(VOL), Durability::Power)
        .expect("forget");
}

#[tokio::test]
async fn a_node_without_the_rotation_in_its_journal_opens_with_the_key_the_controller_publishes() {
    let r = staged().await;
    r.h.engine.rotate_dek(&r.req).expect("rotate");
    unstaged_and_forgotten(&r).await;
    let new = r.req.new_wrapped.encode();
    // The volume context's old key alone opens nothing now: the header holds the new key only.
    let e = stage_published(&r, None, None)
        .await
        .expect_err("the old key");
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    // The controller's record, promoted: the publish_context's current key opens it.
    stage_published(&r, Some(&new), None)
        .await
        .expect("the published key");
    assert!(r.h.os.luks_mappings().contains_key("moor-vol-1"));
    // NodeExpandVolume's key is the one that opened it.
    assert_eq!(crypt_record(&r.h).wrapped_dek, Some(new.clone()));
    unstaged_and_forgotten(&r).await;
    // Not promoted yet (the controller crashed after the node's answer): the pending key.
    stage_published(&r, Some(&r.old.wrapped), Some(&new))
        .await
        .expect("the pending key");
    assert_eq!(crypt_record(&r.h).wrapped_dek, Some(new));
    no_key_anywhere(&r.h, &r.old);
}

#[tokio::test]
async fn a_volume_staged_elsewhere_at_every_crash_of_a_rotation_opens_with_the_record_s_keys() {
    let runs = runs_of_a_rotation().await;
    let new = |r: &Rotation| r.req.new_wrapped.encode();
    for at in 0..runs {
        for done in [false, true] {
            let r = staged().await;
            r.h.os.crash_tool_at("cryptsetup", at, done);
            r.h.engine.rotate_dek(&r.req).expect_err("crashed");
            let header = slots(&r);
            unstaged_and_forgotten(&r).await;
            // The controller's record during a rotation: current the old key, pending the new.
            stage_published(&r, Some(&r.old.wrapped), Some(&new(&r)))
                .await
                .unwrap_or_else(|e| panic!("run {at} (done: {done}), header {header:?}: {e:?}"));
            // The rotation resumes where this stage opened the volume, and finishes.
            r.h.engine.rotate_dek(&r.req).expect("resumed here");
            assert_eq!(slots(&r), BTreeMap::from([(SLOT_VOLUME, "new")]));
        }
    }
}
