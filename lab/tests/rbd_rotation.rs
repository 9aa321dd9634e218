//! Key rotation of encrypted RBD volumes on a real Ceph cluster (docs/encryption.md,
//! "Rotation"; issue 40 points 2 and 3), through a real moor-controller with the RBD backend
//! and moor's own `moor.keys.v1.ControllerKeys`:
//!
//! * a data key rotation's record lives in the image's metadata: the pending key written there
//!   before the node would change a slot, promoted after; the controller killed (SIGKILL) and
//!   started again after each step resumes it (the same pending key, then the same promotion),
//!   every ControllerPublishVolume gives the node the image's keys, and a promotion cut
//!   between its two metadata writes reads as done;
//! * a KEK rotation re-wraps every image's keys (current and pending, each naming its KEK,
//!   resumed after a cut between the two) and every snapshot's record; once the old KEK is
//!   retired, a snapshot whose source is gone restores with the new KEK alone, and the
//!   restored image's LUKS header opens with the key its record gives (`cryptsetup open
//!   --test-passphrase`, as this host has no dm-crypt: the stage on dm-crypt is the VM lab's)
//!   and holds the source's bytes.
//!
//! The cluster is the one `.ci/ceph-cluster up` prints the environment of; without it every
//! test says it is skipped and passes. Each test deletes what it made through the CSI calls.

use std::collections::HashMap;
use std::os::unix::fs::FileExt as _;
use std::path::Path;

use csi::controller_client::ControllerClient;
use moor_lab::ceph::{Ceph, World, ext4, published_context};
use moor_privileged::client::connect;
use moor_privileged::luks;
use moor_privileged::runtime;
use moor_proto::csi::v1 as csi;
use moor_proto::keys::v1 as keys;
use moor_proto::keys::v1::controller_keys_client::ControllerKeysClient;
use moor_runtime::contract::{ENCRYPTED_DEK_KEY, ENCRYPTED_DEK_PENDING_KEY, RBD_IMAGE_KEY};
use moor_runtime::keys::source::KeySource;
use moor_runtime::keys::{Dek, WrappedDek};
use tonic::transport::Channel;

const MIB: u64 = 1 << 20;
const CURRENT_META: &str = "moor.csi.io/encryptedDEK";
const PENDING_META: &str = "moor.csi.io/encryptedDEKPending";
/// What the source volume holds in its LUKS payload, found on the restored image.
const MARKER: &[u8] = b"MOOR-RBD-ROTATION-SNAPSHOT-BYTES-5c1f";
/// Where: past the LUKS2 header (16 MiB), in the payload.
const MARKER_AT: u64 = 18 * MIB;

fn kek_secrets(id: &str, byte: u8) -> HashMap<String, String> {
    moor_runtime::keys::secret_entries(id, &[byte; 32])
        .into_iter()
        .collect()
}

fn source(id: &str, byte: u8) -> KeySource {
    let s = kek_secrets(id, byte);
    KeySource::from_secrets("secret", |k| s.get(k).map(String::as_str)).expect("a key source")
}

fn unwrap(kek: &KeySource, text: &str, volume: &str) -> Dek {
    kek.unwrap(&WrappedDek::decode(text).expect("a wrapped key"), volume)
        .expect("the KEK unwraps it")
}

fn kek_of(text: &str) -> String {
    WrappedDek::decode(text)
        .expect("a wrapped key")
        .kek_id()
        .to_owned()
}

/// The cluster's secrets and the KEK `id`.
fn secrets(w: &World, id: &str, byte: u8) -> HashMap<String, String> {
    let mut s = w.secrets();
    s.extend(kek_secrets(id, byte));
    s
}

async fn create(
    ctl: &mut ControllerClient<Channel>,
    w: &World,
    name: &str,
    from_snapshot: Option<&str>,
    secrets: HashMap<String, String>,
) -> Result<csi::Volume, tonic::Status> {
    let mut parameters = w.parameters();
    parameters.insert("encrypted".into(), "true".into());
    parameters.insert("kmsID".into(), "secret".into());
    let source = from_snapshot.map(|s| csi::VolumeContentSource {
        r#type: Some(csi::volume_content_source::Type::Snapshot(
            csi::volume_content_source::SnapshotSource {
                snapshot_id: s.to_owned(),
            },
        )),
    });
    ctl.create_volume(csi::CreateVolumeRequest {
        name: format!("{name}-{}", std::process::id()),
        capacity_range: Some(csi::CapacityRange {
            required_bytes: (32 * MIB) as i64,
            limit_bytes: 0,
        }),
        volume_capabilities: vec![ext4()],
        parameters,
        secrets,
        volume_content_source: source,
        ..Default::default()
    })
    .await
    .map(|r| r.into_inner().volume.expect("a volume"))
}

/// What ControllerPublishVolume at a node tells it (published, then unpublished again).
async fn published(
    ctl: &mut ControllerClient<Channel>,
    w: &World,
    id: &str,
) -> HashMap<String, String> {
    published_context(
        ctl,
        csi::ControllerPublishVolumeRequest {
            volume_id: id.to_owned(),
            node_id: "node-0".into(),
            volume_capability: Some(ext4()),
            secrets: w.secrets(),
            ..Default::default()
        },
    )
    .await
}

/// The image's metadata `key`, as Ceph's own client reads it.
fn meta(w: &World, image: &str, key: &str) -> Option<String> {
    w.ceph
        .rbd(&["image-meta", "get", image, key])
        .ok()
        .map(|v| v.trim().to_owned())
}

/// The controller killed (SIGKILL, a crash) and started again on the same cluster.
async fn crash_and_restart(
    w: &mut World,
) -> (ControllerClient<Channel>, ControllerKeysClient<Channel>) {
    drop(w.controller.take());
    start(w).await
}

async fn start(w: &mut World) -> (ControllerClient<Channel>, ControllerKeysClient<Channel>) {
    let ctl = w.start_controller(&[]).await;
    let socket = w
        .controller
        .as_ref()
        .expect("the controller")
        .socket
        .clone();
    let k = ControllerKeysClient::new(connect(&socket).await.expect("the controller's socket"));
    (ctl, k)
}

async fn delete(ctl: &mut ControllerClient<Channel>, w: &World, volumes: &[&str], snaps: &[&str]) {
    for s in snaps {
        ctl.delete_snapshot(csi::DeleteSnapshotRequest {
            snapshot_id: (*s).to_owned(),
            secrets: w.secrets(),
        })
        .await
        .expect("DeleteSnapshot");
    }
    for v in volumes {
        ctl.delete_volume(csi::DeleteVolumeRequest {
            volume_id: (*v).to_owned(),
            secrets: w.secrets(),
        })
        .await
        .expect("DeleteVolume");
    }
}

#[test]
fn a_data_key_rotation_keeps_its_record_in_the_image_metadata_through_controller_crashes() {
    let test =
        "a_data_key_rotation_keeps_its_record_in_the_image_metadata_through_controller_crashes";
    let Some(ceph) = Ceph::from_env(test) else {
        return;
    };
    let mut w = World::new("rbd-rot-dek", ceph, 1);
    runtime().block_on(async {
        let (mut ctl, mut k) = start(&mut w).await;
        // KEK ids of this test's own: the tests share the pool, and a KEK rotation goes
        // over every record under its old KEK.
        let kek_id = format!("rotdek-{}", std::process::id());
        let kek = source(&kek_id, 1);
        let made = create(&mut ctl, &w, "rotdek", None, secrets(&w, &kek_id, 1))
            .await
            .expect("CreateVolume of an encrypted RBD class");
        let id = made.volume_id.clone();
        let context_key = made.volume_context[ENCRYPTED_DEK_KEY].clone();
        let ctx = published(&mut ctl, &w, &id).await;
        let image = ctx[RBD_IMAGE_KEY].clone();
        assert_eq!(meta(&w, &image, CURRENT_META).as_ref(), Some(&context_key));
        assert_eq!(meta(&w, &image, PENDING_META), None);
        assert_eq!(ctx.get(ENCRYPTED_DEK_KEY), Some(&context_key));
        assert_eq!(ctx.get(ENCRYPTED_DEK_PENDING_KEY), None);

        // Step 1: the pending key in the image's metadata before the answer (before the node
        // would be asked to change a slot).
        let begin = keys::BeginVolumeKeyRotationRequest {
            volume_id: id.clone(),
            secrets: kek_secrets(&kek_id, 1),
            if_rotations: None,
        };
        let begun = k
            .begin_volume_key_rotation(begin.clone())
            .await
            .expect("BeginVolumeKeyRotation of an RBD volume")
            .into_inner();
        assert_eq!(begun.current_wrapped_dek, context_key);
        let pending = begun.pending_wrapped_dek.clone();
        assert!(!pending.is_empty());
        assert_eq!(meta(&w, &image, PENDING_META).as_ref(), Some(&pending));
        assert_eq!(meta(&w, &image, CURRENT_META).as_ref(), Some(&context_key));
        assert_ne!(
            unwrap(&kek, &pending, &id).expose(),
            unwrap(&kek, &context_key, &id).expose(),
            "a new data key"
        );

        // A crash after step 1: the restarted controller gives every publish both keys, and
        // resumes with the very same pending key (it may be in the header already).
        let (mut ctl, mut k) = crash_and_restart(&mut w).await;
        let ctx = published(&mut ctl, &w, &id).await;
        assert_eq!(ctx.get(ENCRYPTED_DEK_KEY), Some(&context_key));
        assert_eq!(ctx.get(ENCRYPTED_DEK_PENDING_KEY), Some(&pending));
        let again = k
            .begin_volume_key_rotation(begin.clone())
            .await
            .expect("BeginVolumeKeyRotation again")
            .into_inner();
        assert_eq!(again.pending_wrapped_dek, pending, "resumed, not a new key");
        // A copy waits for the rotation: its header opens with either key, a copy carries one.
        let e = ctl
            .create_snapshot(csi::CreateSnapshotRequest {
                source_volume_id: id.clone(),
                name: format!("rotdek-snap-{}", std::process::id()),
                secrets: w.secrets(),
                parameters: HashMap::new(),
            })
            .await
            .expect_err("a snapshot during a rotation");
        assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e:?}");

        // Step 3, after the node verified: promoted in the image's metadata.
        let finish = keys::FinishVolumeKeyRotationRequest {
            volume_id: id.clone(),
            new_wrapped_dek: pending.clone(),
        };
        let done = k
            .finish_volume_key_rotation(finish.clone())
            .await
            .expect("FinishVolumeKeyRotation")
            .into_inner();
        assert_eq!(done.current_wrapped_dek, pending);
        assert!(done.pending_wrapped_dek.is_empty());
        assert_eq!(meta(&w, &image, CURRENT_META).as_ref(), Some(&pending));
        assert_eq!(meta(&w, &image, PENDING_META), None);

        // A crash after step 3: the promotion holds, and run again it changes nothing.
        let (mut ctl, mut k) = crash_and_restart(&mut w).await;
        let ctx = published(&mut ctl, &w, &id).await;
        assert_eq!(ctx.get(ENCRYPTED_DEK_KEY), Some(&pending));
        assert_eq!(ctx.get(ENCRYPTED_DEK_PENDING_KEY), None);
        k.finish_volume_key_rotation(finish.clone())
            .await
            .expect("FinishVolumeKeyRotation again");
        assert_eq!(meta(&w, &image, CURRENT_META).as_ref(), Some(&pending));
        // The scheduler's guard and clock live in the image too, through the restart: one
        // rotation counted (not two: Finish run again changed nothing), its time recorded.
        let state = k
            .get_volume_key_rotation(keys::GetVolumeKeyRotationRequest {
                volume_id: id.clone(),
            })
            .await
            .expect("GetVolumeKeyRotation")
            .into_inner();
        assert_eq!(state.rotations, 1, "{state:?}");
        assert_ne!(state.current_since_unix, 0, "{state:?}");

        // A promotion cut between its two writes (the current key written, the pending one
        // not yet removed) reads as done: the node gets one key, a new rotation begins anew.
        w.ceph
            .rbd(&["image-meta", "set", &image, PENDING_META, &pending])
            .expect("rbd image-meta set");
        let ctx = published(&mut ctl, &w, &id).await;
        assert_eq!(ctx.get(ENCRYPTED_DEK_KEY), Some(&pending));
        assert_eq!(ctx.get(ENCRYPTED_DEK_PENDING_KEY), None);
        let next = k
            .begin_volume_key_rotation(begin.clone())
            .await
            .expect("a second rotation")
            .into_inner();
        assert_eq!(next.current_wrapped_dek, pending);
        assert_ne!(next.pending_wrapped_dek, pending);
        assert_eq!(
            meta(&w, &image, PENDING_META).as_ref(),
            Some(&next.pending_wrapped_dek)
        );
        delete(&mut ctl, &w, &[&id], &[]).await;
    });
}

#[test]
fn a_kek_rotation_rewraps_images_and_snapshots_and_a_restore_opens_after_the_old_kek_is_retired() {
    let test = "a_kek_rotation_rewraps_images_and_snapshots_and_a_restore_opens_after_the_old_kek_is_retired";
    let Some(ceph) = Ceph::from_env(test) else {
        return;
    };
    if std::process::Command::new("cryptsetup")
        .arg("--version")
        .output()
        .is_err()
    {
        eprintln!("{test}: skipped: no cryptsetup on this host");
        return;
    }
    let mut w = World::new("rbd-rot-kek", ceph, 1);
    let pid = std::process::id();
    runtime().block_on(async {
        let (mut ctl, mut k) = start(&mut w).await;
        // KEK ids of this test's own: the tests share the pool, and a KEK rotation goes
        // over every record under its old KEK (the others' are left alone).
        let (old_id, new_id) = (format!("rotkek-old-{pid}"), format!("rotkek-new-{pid}"));
        let (old, new) = (source(&old_id, 1), source(&new_id, 2));

        // Volume A: a LUKS2 header of its data key and bytes in its payload, written into
        // its image as the node's first stage would (no dm-crypt here to write through).
        let a = create(&mut ctl, &w, "rotkek-a", None, secrets(&w, &old_id, 1))
            .await
            .expect("CreateVolume A");
        let a_dek = unwrap(&old, &a.volume_context[ENCRYPTED_DEK_KEY], &a.volume_id);
        let a_image = published(&mut ctl, &w, &a.volume_id).await[RBD_IMAGE_KEY].clone();
        let file = w.sb.root.join("a.luks");
        luks::luks_format(&file, a_dek.expose());
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(&file)
            .expect("the LUKS file");
        f.set_len(32 * MIB).expect("grow to the volume's size");
        f.write_all_at(MARKER, MARKER_AT).expect("the marker");
        drop(f);
        let staging_image = format!("rotkek-import-{pid}");
        let diff = w.sb.root.join("a.diff");
        let (file_s, diff_s) = (file.display().to_string(), diff.display().to_string());
        w.ceph
            .rbd(&["import", &file_s, &staging_image])
            .expect("rbd import");
        w.ceph
            .rbd(&["export-diff", &staging_image, &diff_s])
            .expect("rbd export-diff");
        w.ceph
            .rbd(&["import-diff", &diff_s, &a_image])
            .expect("rbd import-diff into A's image");
        w.ceph
            .rbd(&["rm", &staging_image])
            .expect("rbd rm the import");

        // Volume B, half-way through a data key rotation, and cut half-way through an
        // earlier KEK rotation: its current key already under the new KEK, its pending one
        // not (each names its KEK).
        let b = create(&mut ctl, &w, "rotkek-b", None, secrets(&w, &old_id, 1))
            .await
            .expect("CreateVolume B");
        let b_image = published(&mut ctl, &w, &b.volume_id).await[RBD_IMAGE_KEY].clone();
        let begun = k
            .begin_volume_key_rotation(keys::BeginVolumeKeyRotationRequest {
                volume_id: b.volume_id.clone(),
                secrets: kek_secrets(&old_id, 1),
                if_rotations: None,
            })
            .await
            .expect("BeginVolumeKeyRotation B")
            .into_inner();
        let b_current = unwrap(&old, &begun.current_wrapped_dek, &b.volume_id);
        let b_pending = unwrap(&old, &begun.pending_wrapped_dek, &b.volume_id);
        let half = new
            .wrap(&b_current, &b.volume_id)
            .expect("wrap under the new KEK")
            .encode();
        w.ceph
            .rbd(&["image-meta", "set", &b_image, CURRENT_META, &half])
            .expect("rbd image-meta set");

        // A snapshot of A, and A deleted: the snapshot's record alone carries its key.
        let snap = ctl
            .create_snapshot(csi::CreateSnapshotRequest {
                source_volume_id: a.volume_id.clone(),
                name: format!("rotkek-snap-{pid}"),
                secrets: w.secrets(),
                parameters: HashMap::new(),
            })
            .await
            .expect("CreateSnapshot of A")
            .into_inner()
            .snapshot
            .expect("a snapshot");
        delete(&mut ctl, &w, &[&a.volume_id], &[]).await;

        let rotate = keys::RotateKeyEncryptionKeyRequest {
            kms_id: String::new(),
            old_secrets: kek_secrets(&old_id, 1),
            new_secrets: kek_secrets(&new_id, 2),
        };
        let report = k
            .rotate_key_encryption_key(rotate.clone())
            .await
            .expect("RotateKeyEncryptionKey over the RBD backend")
            .into_inner();
        let mut rewrapped = report.rewrapped.clone();
        rewrapped.sort();
        let mut expected = vec![b.volume_id.clone(), snap.snapshot_id.clone()];
        expected.sort();
        assert_eq!(rewrapped, expected, "{report:?}");
        assert!(
            !report
                .other_keks
                .iter()
                .any(|o| o.contains(&b.volume_id) || o.contains(&snap.snapshot_id)),
            "{report:?}"
        );
        // B: both keys under the new KEK in its image's metadata, the same data keys.
        let b_now = (
            meta(&w, &b_image, CURRENT_META).expect("current"),
            meta(&w, &b_image, PENDING_META).expect("pending"),
        );
        assert_eq!(
            (kek_of(&b_now.0), kek_of(&b_now.1)),
            (new_id.clone(), new_id.clone())
        );
        assert_eq!(
            unwrap(&new, &b_now.0, &b.volume_id).expose(),
            b_current.expose()
        );
        assert_eq!(
            unwrap(&new, &b_now.1, &b.volume_id).expose(),
            b_pending.expose()
        );
        let ctx = published(&mut ctl, &w, &b.volume_id).await;
        assert_eq!(ctx.get(ENCRYPTED_DEK_KEY), Some(&b_now.0));
        assert_eq!(ctx.get(ENCRYPTED_DEK_PENDING_KEY), Some(&b_now.1));
        // Run again (a crash after it, an operator's retry): nothing written twice.
        let again = k
            .rotate_key_encryption_key(rotate.clone())
            .await
            .expect("RotateKeyEncryptionKey again")
            .into_inner();
        assert!(again.rewrapped.is_empty(), "{again:?}");
        assert_eq!(again.unchanged.len(), 2, "{again:?}");

        // The old KEK retired: the snapshot restores with the new one alone ...
        let e = create(
            &mut ctl,
            &w,
            "rotkek-old",
            Some(&snap.snapshot_id),
            secrets(&w, &old_id, 1),
        )
        .await
        .expect_err("the old KEK no longer unwraps the snapshot's key");
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
        let r = create(
            &mut ctl,
            &w,
            "rotkek-r",
            Some(&snap.snapshot_id),
            secrets(&w, &new_id, 2),
        )
        .await
        .expect("a restore with the new KEK alone");
        let r_key = r.volume_context[ENCRYPTED_DEK_KEY].clone();
        assert_eq!(kek_of(&r_key), new_id);
        let r_dek = unwrap(&new, &r_key, &r.volume_id);
        assert_eq!(r_dek.expose(), a_dek.expose(), "the source's data key");
        // ... and its image holds A's LUKS header, which that key opens, and A's bytes.
        let r_ctx = published(&mut ctl, &w, &r.volume_id).await;
        assert_eq!(r_ctx.get(ENCRYPTED_DEK_KEY), Some(&r_key));
        let exported = w.sb.root.join("r.img");
        let exported_s = exported.display().to_string();
        w.ceph
            .rbd(&["export", &r_ctx[RBD_IMAGE_KEY], &exported_s])
            .expect("rbd export of the restore");
        assert!(
            luks::opens(&exported, r_dek.expose()),
            "the restored header opens with the key its record gives"
        );
        assert!(!luks::opens(&exported, b_current.expose()));
        let mut got = vec![0; MARKER.len()];
        std::fs::File::open(&exported)
            .and_then(|f| f.read_exact_at(&mut got, MARKER_AT))
            .expect("read the restore");
        assert_eq!(got, MARKER, "the source's bytes");
        for p in [&file, &diff, &exported] {
            let _ = std::fs::remove_file(Path::new(p));
        }
        delete(
            &mut ctl,
            &w,
            &[&r.volume_id, &b.volume_id],
            &[&snap.snapshot_id],
        )
        .await;
    });
}
