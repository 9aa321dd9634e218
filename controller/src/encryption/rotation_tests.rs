//! The controller's half of a rotation on the embedded backend's records: a DEK rotation's
//! steps in order and a crash after each (the records a crash leaves, what every stage is then
//! given, and that the volume's header, modelled as its key slots, opens with one of them),
//! a KEK rotation cut short and resumed, and no key byte in an error or a `Debug`.

use std::collections::HashMap;
use std::sync::Arc;

use moor_runtime::contract::{ENCRYPTED_DEK_KEY, ENCRYPTED_DEK_PENDING_KEY};
use moor_runtime::keys::source::KeySource;
use moor_runtime::keys::{Dek, WrappedDek};

use super::*;
use crate::backend::{
    AccessMode, AccessType, Backend, Capability, NewSnapshot, NewVolume, Parameters, PublishRequest,
};
use crate::embedded::fake::FakeAttacher;
use crate::embedded::testdir::TestDir;
use crate::embedded::{Config, EmbeddedBackend};

const NODE: &str = "node-1";

fn source(id: &str, byte: u8) -> KeySource {
    let secrets: HashMap<String, String> = moor_runtime::keys::secret_entries(id, &[byte; 32])
        .into_iter()
        .collect();
    KeySource::from_secrets("secret", |k| secrets.get(k).map(String::as_str)).expect("source")
}

struct World {
    _dir: TestDir,
    b: EmbeddedBackend<Arc<FakeAttacher>>,
    kek: KeySource,
}

fn world(tag: &str) -> World {
    let dir = TestDir::new(tag);
    let (b, _) = EmbeddedBackend::open(
        Config {
            data_dir: dir.path().join("data"),
            node_id: NODE.into(),
            topology_key: "topology.moor.csi.io/node".into(),
        },
        Arc::new(FakeAttacher::new()),
    )
    .expect("backend");
    World {
        _dir: dir,
        b,
        kek: source("kek-1", 1),
    }
}

/// An encrypted volume made as CreateVolume makes one: its record holds its wrapped key.
fn encrypted_volume(w: &World, name: &str) -> String {
    made_encrypted(&w.b, &w.kek, name)
}

/// An encrypted volume made on `b` as CreateVolume makes one, its key wrapped by `kek`.
fn made_encrypted(b: &EmbeddedBackend<Arc<FakeAttacher>>, kek: &KeySource, name: &str) -> String {
    let v = b.create_volume(&new_encrypted(name)).expect("create");
    let wrapped = super::super::new_wrapped_dek(kek, &v.id).expect("wrap");
    b.record_wrapped_dek(&v.id, &wrapped).expect("record");
    v.id
}

/// CreateVolume's request of an encrypted volume.
fn new_encrypted(name: &str) -> NewVolume {
    NewVolume {
        name: name.into(),
        capacity: Some(crate::backend::CapacityRange {
            required: 1 << 20,
            limit: 0,
        }),
        capabilities: vec![cap()],
        parameters: Parameters::from([
            ("encrypted".to_owned(), "true".to_owned()),
            ("kmsID".to_owned(), "secret".to_owned()),
        ]),
        source: None,
        accessibility: None,
    }
}

fn cap() -> Capability {
    Capability {
        access: AccessType::Block,
        mode: AccessMode::SingleNodeWriter,
    }
}

fn published(w: &World, id: &str) -> crate::backend::PublishContext {
    let ctx =
        w.b.publish_volume(&PublishRequest {
            volume_id: id.into(),
            node_id: NODE.into(),
            capability: cap(),
            readonly: false,
            context: Parameters::new(),
        })
        .expect("publish");
    w.b.unpublish_volume(id, None).expect("unpublish");
    ctx
}

fn unwrap(kek: &KeySource, text: &str, id: &str) -> Dek {
    kek.unwrap(&WrappedDek::decode(text).expect("decode"), id)
        .expect("unwrap")
}

/// The volume's LUKS header, as the key slots the node's rotation leaves at each of its
/// states (`engine::rotate`'s table), by which key opens them: old only, both, new only.
#[derive(Debug, Clone, Copy)]
enum Header {
    Old,
    Both,
    New,
}

/// Whether a stage given `ctx` (the publish_context: current, then pending) opens a header.
fn opens(w: &World, id: &str, ctx: &crate::backend::PublishContext, header: Header, old: &Dek) {
    let keys: Vec<Dek> = [ENCRYPTED_DEK_KEY, ENCRYPTED_DEK_PENDING_KEY]
        .iter()
        .filter_map(|k| ctx.get(*k))
        .map(|t| unwrap(&w.kek, t, id))
        .collect();
    let opens_one = keys.iter().any(|k| {
        let is_old = k.expose() == old.expose();
        match header {
            Header::Old => is_old,
            Header::New => !is_old,
            Header::Both => true,
        }
    });
    assert!(opens_one, "{header:?}: no key given opens it");
}

#[test]
fn a_dek_rotation_writes_the_pending_key_before_the_node_and_promotes_it_after() {
    let w = world("rot-dek");
    let id = encrypted_volume(&w, "pvc-1");
    let first = w.b.volume_keys(&id).expect("keys");
    assert_eq!(first.pending, None);
    let old = unwrap(&w.kek, &first.current, &id);
    // Before any rotation the node is given the record's key, which is the context's.
    let ctx = published(&w, &id);
    assert_eq!(ctx.get(ENCRYPTED_DEK_KEY), Some(&first.current));
    assert_eq!(ctx.get(ENCRYPTED_DEK_PENDING_KEY), None);
    opens(&w, &id, &ctx, Header::Old, &old);

    // Step 1: the pending key, written before the node is asked.
    let begun = begin_on(&w.b, &id, &w.kek, None).expect("begin");
    let pending = begun.pending.clone().expect("a pending key");
    assert_eq!(begun.current, first.current);
    assert_eq!(w.b.volume_keys(&id).expect("keys"), begun, "written");
    // A crash here, and at every state of the node's slots until the promotion: every stage
    // is given both keys, and one of them opens the header.
    let ctx = published(&w, &id);
    assert_eq!(ctx.get(ENCRYPTED_DEK_PENDING_KEY), Some(&pending));
    for header in [Header::Old, Header::Both, Header::New] {
        opens(&w, &id, &ctx, header, &old);
    }
    // Begun again (the operator's tool retried after a crash): the same pending key, which
    // the node may already have written into a slot.
    assert_eq!(begin_on(&w.b, &id, &w.kek, None).expect("again"), begun);

    // Step 3, after the node verified the new slot: the pending key is current.
    let done = promote_on(&w.b, &id, &pending).expect("promote");
    assert_eq!(
        (done.current.as_str(), done.pending.as_ref(), done.rotations),
        (pending.as_str(), None, 1)
    );
    let ctx = published(&w, &id);
    assert_eq!(ctx.get(ENCRYPTED_DEK_KEY), Some(&pending));
    assert_eq!(ctx.get(ENCRYPTED_DEK_PENDING_KEY), None);
    opens(&w, &id, &ctx, Header::New, &old);
    // Promoted again (a crash before the answer): nothing changes.
    assert_eq!(promote_on(&w.b, &id, &pending).expect("again"), done);
    // The volume context the CO holds is the one CreateVolume answered: never changed.
    let status = w.b.get_volume(&id).expect("get");
    assert_eq!(
        status.volume.context.get(ENCRYPTED_DEK_KEY),
        Some(&first.current)
    );
}

#[test]
fn the_records_survive_a_controller_restart_at_each_step() {
    let dir = TestDir::new("rot-restart");
    let open = || {
        EmbeddedBackend::open(
            Config {
                data_dir: dir.path().join("data"),
                node_id: NODE.into(),
                topology_key: "topology.moor.csi.io/node".into(),
            },
            Arc::new(FakeAttacher::new()),
        )
        .expect("backend")
        .0
    };
    let kek = source("kek-1", 1);
    let b = open();
    let id = made_encrypted(&b, &kek, "pvc-r");
    let begun = begin_on(&b, &id, &kek, None).expect("begin");
    drop(b);
    // A crash after step 1: the pending key is in the record read at the next start.
    let b = open();
    assert_eq!(b.volume_keys(&id).expect("keys"), begun);
    let pending = begun.pending.expect("pending");
    let promoted = promote_on(&b, &id, &pending).expect("promote");
    drop(b);
    // A crash after step 3: promoted.
    let b = open();
    let keys = b.volume_keys(&id).expect("keys");
    assert_eq!(keys, promoted);
    assert_eq!(
        (keys.current, keys.pending, keys.rotations),
        (pending, None, 1)
    );
}

#[test]
fn a_key_the_record_does_not_hold_is_never_promoted_and_a_wrong_kek_begins_nothing() {
    let w = world("rot-refuse");
    let id = encrypted_volume(&w, "pvc-1");
    let first = w.b.volume_keys(&id).expect("keys");
    let stranger = super::super::new_wrapped_dek(&w.kek, &id).expect("wrap");
    // No rotation pending: nothing to promote.
    let e = promote_on(&w.b, &id, &stranger).expect_err("nothing pending");
    assert!(matches!(e, Error::FailedPrecondition(_)), "{e:?}");
    let begun = begin_on(&w.b, &id, &w.kek, None).expect("begin");
    // Pending, but another key.
    let e = promote_on(&w.b, &id, &stranger).expect_err("another key");
    assert!(matches!(e, Error::FailedPrecondition(_)), "{e:?}");
    assert_eq!(w.b.volume_keys(&id).expect("keys"), begun, "untouched");
    // A KEK under the same id, other bytes: refused, naming no byte, nothing written.
    let w2 = world("rot-refuse-2");
    let id2 = encrypted_volume(&w2, "pvc-2");
    let impostor = source("kek-1", 2);
    let e = begin_on(&w2.b, &id2, &impostor, None).expect_err("wrong kek");
    assert!(matches!(e, Error::FailedPrecondition(_)), "{e:?}");
    assert_eq!(
        w2.b.volume_keys(&id2).expect("keys").pending,
        None,
        "nothing written"
    );
    // No key byte in an error, a `Debug` of the keys, or the record.
    let kek_b64 = &moor_runtime::keys::secret_entries("kek-1", &[1; 32])[0].1;
    let dek = unwrap(&w.kek, &first.current, &id);
    let hex: String = dek.expose().iter().map(|b| format!("{b:02x}")).collect();
    for text in [format!("{e}"), format!("{e:?}"), format!("{begun:?}")] {
        assert!(
            !text.contains(kek_b64.as_str()) && !text.contains(&hex),
            "{text}"
        );
    }
}

#[test]
fn a_copy_carries_the_record_s_current_key_and_waits_for_a_pending_rotation() {
    let w = world("rot-copy");
    let id = encrypted_volume(&w, "pvc-1");
    let begun = begin_on(&w.b, &id, &w.kek, None).expect("begin");
    let snap = |name: &str| {
        w.b.create_snapshot(&NewSnapshot {
            name: name.into(),
            source_volume_id: id.clone(),
            parameters: Parameters::new(),
        })
    };
    let e = snap("s1").expect_err("a rotation is pending");
    assert!(matches!(e, Error::FailedPrecondition(_)), "{e:?}");
    let pending = begun.pending.expect("pending");
    promote_on(&w.b, &id, &pending).expect("promote");
    let s = snap("s2").expect("snapshot");
    let got = w.b.get_snapshot(&s.id).expect("get");
    assert_eq!(got.encryption.get(ENCRYPTED_DEK_KEY), Some(&pending));
}

#[test]
fn a_kek_rotation_rewraps_current_and_pending_keys_and_resumes_after_a_crash_half_way() {
    let w = world("rot-kek");
    let ids: Vec<String> = (0..4)
        .map(|i| encrypted_volume(&w, &format!("pvc-{i}")))
        .collect();
    // One volume is half-way through a DEK rotation: its pending key is rewrapped too.
    let begun = begin_on(&w.b, &ids[1], &w.kek, None).expect("begin");
    let deks = |kek: &KeySource| -> Vec<(Vec<u8>, Option<Vec<u8>>)> {
        ids.iter()
            .map(|id| {
                let k = w.b.volume_keys(id).expect("keys");
                (
                    unwrap(kek, &k.current, id).expose().to_vec(),
                    k.pending.map(|p| unwrap(kek, &p, id).expose().to_vec()),
                )
            })
            .collect()
    };
    let before = deks(&w.kek);
    let new = source("kek-2", 2);
    // A crash half-way: the first two records written under the new KEK, the rest not.
    for id in &ids[..2] {
        let k = w.b.volume_keys(id).expect("keys");
        let (after, changed) = rewrap(&k, id, &w.kek, &new).expect("rewrap");
        assert!(changed);
        w.b.write_volume_keys(id, &k, &after).expect("write");
    }
    // Every volume still opens: each record's keys unwrap under the KEK it names.
    for id in &ids {
        let k = w.b.volume_keys(id).expect("keys");
        let by = if k.kek_ids().expect("ids")[0] == "kek-2" {
            &new
        } else {
            &w.kek
        };
        unwrap(by, &k.current, id);
    }
    // Resumed: the rest rewrapped, the two done left as they are.
    let report = rotate_kek_on(&w.b, &w.kek, &new).expect("resume");
    let sorted = |mut v: Vec<String>| {
        v.sort();
        v
    };
    assert_eq!(sorted(report.unchanged), sorted(ids[..2].to_vec()));
    assert_eq!(sorted(report.rewrapped), sorted(ids[2..].to_vec()));
    assert!(report.other_keks.is_empty());
    // The same data keys, now all under the new KEK, current and pending; the data untouched.
    assert_eq!(deks(&new), before);
    let k1 = w.b.volume_keys(&ids[1]).expect("keys");
    assert_eq!(k1.kek_ids().expect("ids"), ["kek-2", "kek-2"]);
    assert_ne!(
        Some(&k1.pending.clone().expect("pending")),
        begun.pending.as_ref()
    );
    // The node is given the rewrapped keys.
    let ctx = published(&w, &ids[3]);
    assert_eq!(
        ctx.get(ENCRYPTED_DEK_KEY),
        Some(&w.b.volume_keys(&ids[3]).expect("keys").current)
    );
    // Run again: nothing to do.
    let again = rotate_kek_on(&w.b, &w.kek, &new).expect("again");
    assert!(again.rewrapped.is_empty() && again.unchanged.len() == ids.len());
    // A volume under a third KEK is left alone and reported.
    let third = source("kek-3", 3);
    let w3 = World { kek: third, ..w };
    let other = encrypted_volume(&w3, "pvc-other");
    let report = rotate_kek_on(&w3.b, &source("kek-1", 1), &new).expect("third");
    assert_eq!(
        report.other_keks,
        [(other.clone(), vec!["kek-3".to_owned()])]
    );
    // A wrong old KEK (same id, other bytes) stops at the first record it does not unwrap.
    let w4 = world("rot-kek-wrong");
    let v4 = encrypted_volume(&w4, "pvc-w");
    let e = rotate_kek_on(&w4.b, &source("kek-1", 9), &new).expect_err("wrong old");
    assert!(matches!(e, Error::FailedPrecondition(_)), "{e:?}");
    assert_eq!(
        w4.b.volume_keys(&v4).expect("keys").kek_ids().expect("ids"),
        ["kek-1"]
    );
}

#[test]
fn the_key_calls_check_their_requests_and_name_no_key() {
    use moor_proto::keys::v1 as keys;
    let w = world("rot-calls");
    let id = encrypted_volume(&w, "pvc-1");
    let secrets: HashMap<String, String> = moor_runtime::keys::secret_entries("kek-1", &[1; 32])
        .into_iter()
        .collect();
    let begun = crate::service::keys::begin(
        &w.b,
        &keys::BeginVolumeKeyRotationRequest {
            volume_id: id.clone(),
            secrets: secrets.clone(),
            if_rotations: None,
        },
    )
    .expect("begin");
    assert_eq!(
        begun.current_wrapped_dek,
        w.b.volume_keys(&id).expect("k").current
    );
    assert!(!begun.pending_wrapped_dek.is_empty());
    // A volume in the clear has no key to rotate.
    let clear =
        w.b.create_volume(&NewVolume {
            parameters: Parameters::new(),
            ..new_encrypted("pvc-clear")
        })
        .expect("clear");
    let e = crate::service::keys::begin(
        &w.b,
        &keys::BeginVolumeKeyRotationRequest {
            volume_id: clear.id,
            secrets: secrets.clone(),
            if_rotations: None,
        },
    )
    .expect_err("clear");
    assert!(matches!(e, Error::FailedPrecondition(_)), "{e:?}");
    // Finishing with a key that is not a wrapped key: INVALID_ARGUMENT.
    let e = crate::service::keys::finish(
        &w.b,
        &keys::FinishVolumeKeyRotationRequest {
            volume_id: id.clone(),
            new_wrapped_dek: "not a key".into(),
        },
    )
    .expect_err("malformed");
    assert!(matches!(e, Error::InvalidArgument { .. }), "{e:?}");
    let done = crate::service::keys::finish(
        &w.b,
        &keys::FinishVolumeKeyRotationRequest {
            volume_id: id.clone(),
            new_wrapped_dek: begun.pending_wrapped_dek.clone(),
        },
    )
    .expect("finish");
    assert_eq!(done.current_wrapped_dek, begun.pending_wrapped_dek);
    assert!(done.pending_wrapped_dek.is_empty());
    // A new KEK under the old one's id: refused, no byte of either in the error.
    let same_id: HashMap<String, String> = moor_runtime::keys::secret_entries("kek-1", &[5; 32])
        .into_iter()
        .collect();
    let e = crate::service::keys::rotate_kek(
        &w.b,
        &keys::RotateKeyEncryptionKeyRequest {
            kms_id: String::new(),
            old_secrets: secrets.clone(),
            new_secrets: same_id.clone(),
        },
    )
    .expect_err("same id");
    assert!(matches!(e, Error::InvalidArgument { .. }), "{e:?}");
    let text = format!("{e} {e:?}");
    assert!(
        !text.contains(&secrets["kek"]) && !text.contains(&same_id["kek"]),
        "{text}"
    );
}

#[test]
fn a_kek_rotation_rewraps_snapshots_so_a_restore_opens_after_the_old_kek_is_retired() {
    let w = world("rot-kek-snap");
    let id = encrypted_volume(&w, "pvc-1");
    let dek = unwrap(&w.kek, &w.b.volume_keys(&id).expect("keys").current, &id);
    let snap =
        w.b.create_snapshot(&NewSnapshot {
            name: "s1".into(),
            source_volume_id: id.clone(),
            parameters: Parameters::new(),
        })
        .expect("snapshot");
    // The snapshot outlives its source: its record alone carries the key a restore opens with.
    w.b.delete_volume(&id).expect("delete source");
    let new = source("kek-2", 2);
    let report = rotate_kek_on(&w.b, &w.kek, &new).expect("rotate");
    assert_eq!(report.rewrapped, std::slice::from_ref(&snap.id));
    assert!(report.unchanged.is_empty() && report.other_keks.is_empty());
    let carried = w.b.get_snapshot(&snap.id).expect("get").encryption;
    let wrapped = WrappedDek::decode(&carried[ENCRYPTED_DEK_KEY]).expect("decode");
    assert_eq!(wrapped.kek_id(), "kek-2", "the key names its new KEK");
    // The old KEK retired: a restore (CreateVolume's `source_dek`) opens with the new KEK
    // alone, to the same data key (the snapshot's LUKS header is the source's).
    let restored = super::super::source_dek(&carried, &snap.source_volume_id, &new)
        .expect("the new KEK unwraps the snapshot's key");
    assert_eq!(restored.expose(), dek.expose());
    let e = super::super::source_dek(&carried, &snap.source_volume_id, &w.kek)
        .expect_err("the old KEK no longer does");
    assert!(matches!(e, Error::InvalidArgument { .. }), "{e:?}");
    // Run again: nothing written twice.
    let again = rotate_kek_on(&w.b, &w.kek, &new).expect("again");
    assert!(again.rewrapped.is_empty() && again.unchanged == std::slice::from_ref(&snap.id));
    // A snapshot record whose key changed since it was read: ABORTED, nothing written.
    // The key to write already there (a step run again): nothing to do.
    w.b.write_snapshot_key(&snap.id, "v1:kek-1:stale", &carried[ENCRYPTED_DEK_KEY])
        .expect("already written");
    let e =
        w.b.write_snapshot_key(&snap.id, "v1:kek-1:stale", "v1:kek-9:other")
            .expect_err("stale");
    assert!(matches!(e, Error::OperationPending(_)), "{e:?}");
    assert_eq!(w.b.get_snapshot(&snap.id).expect("get").encryption, carried);
}

#[test]
fn a_kek_rotation_over_both_backends_reaches_the_embedded_records() {
    let w = world("rot-kek-rbd");
    let id = encrypted_volume(&w, "pvc-1");
    let rbd = crate::rbd::RbdBackend::new(crate::rbd::Config::new(
        crate::rbd::clusters::Clusters::empty(),
    ));
    let both = crate::select::Backends::new(Some(Box::new(w.b)), Some(Box::new(rbd)));
    // The RBD backend keeps its keys too (its images' metadata; tested on Ceph in
    // lab/tests/rbd_rotation.rs): with no cluster it has none, and the rotation is done.
    let report = rotate_kek_on(&both, &w.kek, &source("kek-2", 2)).expect("rotate");
    assert_eq!(report.rewrapped, std::slice::from_ref(&id));
    assert_eq!(
        both.volume_keys(&id).expect("keys").kek_ids().expect("ids"),
        ["kek-2"]
    );
}

#[test]
fn a_kek_rotation_refuses_before_writing_when_an_rbd_cluster_cannot_be_read() {
    let w = world("rot-kek-unseen");
    let id = encrypted_volume(&w, "pvc-1");
    let before = w.b.volume_keys(&id).expect("keys");
    // A cluster of the list without the controller's own credentials, and no connection to
    // it: its volumes cannot be seen, so the rotation is refused before any record is
    // written (reporting done would let the operator retire a KEK its records still need).
    let clusters = crate::rbd::clusters::Clusters::from_json(
        r#"[{"clusterID": "unseen", "monitors": ["192.0.2.1:6789"]}]"#,
    )
    .expect("clusters");
    let rbd = crate::rbd::RbdBackend::new(crate::rbd::Config::new(clusters));
    let both = crate::select::Backends::new(Some(Box::new(w.b)), Some(Box::new(rbd)));
    let e = rotate_kek_on(&both, &w.kek, &source("kek-2", 2)).expect_err("unseen cluster");
    assert!(
        matches!(&e, Error::FailedPrecondition(m) if m.contains("unseen")),
        "{e:?}"
    );
    assert_eq!(
        both.volume_keys(&id).expect("keys"),
        before,
        "nothing written"
    );
}

/// A scheduled rotation (docs/encryption.md, "Scheduled rotation"): its clock starts once, at
/// the scheduler's first look, durably; each promotion counts and restarts it; a Begin
/// guarded by a count that moved on (a rotation ran since the scheduler read the record)
/// begins nothing, so a due rotation is never run twice; a pending one is still answered.
#[test]
fn a_scheduled_rotation_starts_its_clock_once_and_is_never_begun_twice() {
    use crate::encryption::rotation::keys_for_schedule;
    let w = world("rot-sched");
    let id = encrypted_volume(&w, "pvc-1");
    let (unscheduled, none) = keys_for_schedule(&w.b, &id, None).expect("keys");
    assert_eq!(
        (unscheduled.current_since, none),
        (None, None),
        "no schedule, no clock"
    );
    let (started, _) = keys_for_schedule(&w.b, &id, Some("@daily")).expect("keys");
    let since = started.current_since.expect("the clock started");
    assert_eq!(w.b.volume_keys(&id).expect("k"), started, "written");
    assert_eq!(
        keys_for_schedule(&w.b, &id, Some("@daily"))
            .expect("again")
            .0,
        started,
        "started once"
    );
    assert_eq!(started.rotations, 0);
    let begun = begin_on(&w.b, &id, &w.kek, Some(0)).expect("begin");
    let pending = begun.pending.clone().expect("pending");
    // Begun again with a stale count: the pending rotation is still answered.
    assert_eq!(begin_on(&w.b, &id, &w.kek, Some(7)).expect("again"), begun);
    let done = promote_on(&w.b, &id, &pending).expect("promote");
    assert_eq!(done.rotations, 1);
    assert_eq!(done.current, pending);
    assert!(done.current_since.expect("since") >= since);
    // The scheduler read 0 before the promotion: its Begin begins nothing now.
    let stale = begin_on(&w.b, &id, &w.kek, Some(0)).expect("stale");
    assert_eq!(stale, done, "nothing begun");
    // Read afresh, the next one begins.
    let next = begin_on(&w.b, &id, &w.kek, Some(1)).expect("next");
    assert!(next.pending.is_some());
}

/// A PV's or PVC's annotation (copied into the record) is the volume's schedule over its
/// class's, starts its clock like a class's, survives a rotation, and goes when it is removed;
/// one that is not a period is refused, nothing written.
#[test]
fn an_annotation_schedule_overrides_the_class_and_starts_the_clock() {
    use crate::encryption::rotation::{keys_for_schedule, set_schedule_on};
    let w = world("rot-annotation");
    let id = encrypted_volume(&w, "pvc-1");
    assert!(set_schedule_on(&w.b, &id, Some("12h")).expect("set"));
    assert!(
        !set_schedule_on(&w.b, &id, Some("12h")).expect("again"),
        "unchanged"
    );
    let (keys, schedule) = keys_for_schedule(&w.b, &id, Some("@weekly")).expect("keys");
    assert_eq!(
        schedule.as_deref(),
        Some("12h"),
        "the annotation's, over the class's"
    );
    let (_, schedule) = keys_for_schedule(&w.b, &id, None).expect("keys");
    assert_eq!(schedule.as_deref(), Some("12h"), "a class without one");
    assert!(keys.current_since.is_some(), "its clock started");
    let begun = begin_on(&w.b, &id, &w.kek, Some(0)).expect("begin");
    let done = promote_on(&w.b, &id, &begun.pending.expect("pending")).expect("promote");
    assert_eq!(
        done.schedule.as_deref(),
        Some("12h"),
        "kept through a rotation"
    );
    let e = set_schedule_on(&w.b, &id, Some("weekly")).expect_err("not a period");
    assert!(matches!(e, Error::InvalidArgument { .. }), "{e:?}");
    assert!(set_schedule_on(&w.b, &id, None).expect("removed"));
    let (_, schedule) = keys_for_schedule(&w.b, &id, Some("@weekly")).expect("keys");
    assert_eq!(schedule.as_deref(), Some("@weekly"), "the class's again");
}

#[test]
fn begin_on_a_tpm2_volume_wraps_the_new_key_by_its_cluster_half_s_kek() {
    use moor_proto::keys::v1 as keys;
    let w = world("rot-tpm2");
    let v =
        w.b.create_volume(&NewVolume {
            parameters: Parameters::from([
                ("encrypted".to_owned(), "true".to_owned()),
                ("kmsID".to_owned(), "tpm2".to_owned()),
            ]),
            ..new_encrypted("pvc-tpm2")
        })
        .expect("create");
    let wrapped = super::super::new_wrapped_dek(&w.kek, &v.id).expect("wrap");
    w.b.record_wrapped_dek(&v.id, &wrapped).expect("record");
    let secrets: HashMap<String, String> = moor_runtime::keys::secret_entries("kek-1", &[1; 32])
        .into_iter()
        .collect();
    let begun = crate::service::keys::begin(
        &w.b,
        &keys::BeginVolumeKeyRotationRequest {
            volume_id: v.id.clone(),
            secrets,
            if_rotations: None,
        },
    )
    .expect("a tpm2 volume's rotation begins");
    // The pending key is the cluster half, wrapped by the Secret's KEK for this volume (the
    // node combines it with its TPM's half), and another key than the current one.
    let pending =
        moor_runtime::keys::WrappedDek::decode(&begun.pending_wrapped_dek).expect("pending");
    assert_eq!(pending.kek_id(), "kek-1");
    let new = w.kek.unwrap(&pending, &v.id).expect("unwraps");
    let old = w
        .kek
        .unwrap(
            &moor_runtime::keys::WrappedDek::decode(&begun.current_wrapped_dek).expect("current"),
            &v.id,
        )
        .expect("unwraps");
    assert_ne!(new.expose(), old.expose());
    assert_eq!(
        w.b.volume_keys(&v.id).expect("keys").pending,
        Some(begun.pending_wrapped_dek)
    );
}
