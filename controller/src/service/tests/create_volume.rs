//! CreateVolume.

use super::*;

#[tokio::test]
async fn create_volume_required_fields() {
    let fx = Fx::new("svc-create-fields");
    let mut r = create_req("", GIB);
    assert_invalid(fx.svc.create_volume(Request::new(r.clone())).await, "name");
    r.name = "pvc-a".into();
    r.volume_capabilities.clear();
    assert_invalid(
        fx.svc.create_volume(Request::new(r.clone())).await,
        "volume_capabilities",
    );
    r.volume_capabilities = vec![csi::VolumeCapability {
        access_mode: None,
        access_type: Some(AccessType::Block(BlockVolume {})),
    }];
    assert_invalid(
        fx.svc.create_volume(Request::new(r.clone())).await,
        "volume_capabilities",
    );
    r.volume_capabilities = vec![cap(Mode::MultiNodeMultiWriter, true)];
    assert_invalid(
        fx.svc.create_volume(Request::new(r.clone())).await,
        "volume_capabilities",
    );
    r.volume_capabilities = vec![fs_cap("ntfs")];
    assert_invalid(
        fx.svc.create_volume(Request::new(r.clone())).await,
        "volume_capabilities",
    );
    r.volume_capabilities = vec![mount_cap()];
    r.capacity_range = Some(csi::CapacityRange {
        required_bytes: -1,
        limit_bytes: 0,
    });
    assert_invalid(
        fx.svc.create_volume(Request::new(r.clone())).await,
        "capacity_range",
    );
    r.capacity_range = None;
    r.mutable_parameters.insert("iops".into(), "5".into());
    assert_invalid(
        fx.svc.create_volume(Request::new(r.clone())).await,
        "mutable_parameters",
    );
    r.mutable_parameters.clear();
    r.name = "bad\u{7}name".into();
    assert_invalid(fx.svc.create_volume(Request::new(r)).await, "name");
    assert!(fx.fake.devices().is_empty());
}

#[tokio::test]
async fn create_volume_parameters() {
    let fx = Fx::new("svc-create-params");
    let with = |pairs: &[(&str, &str)]| {
        let mut r = create_req("pvc-p", MIB);
        for (k, v) in pairs {
            r.parameters.insert((*k).into(), (*v).into());
        }
        r
    };
    for bad in [
        vec![("type", "gp3")],
        vec![("fsType", "ntfs")],
        vec![("fsType", "xfs"), ("csi.storage.k8s.io/fstype", "ext4")],
    ] {
        assert_invalid(
            fx.svc.create_volume(Request::new(with(&bad))).await,
            "parameters",
        );
    }
    let ok = with(&[
        ("csi.storage.k8s.io/fstype", "xfs"),
        ("csi.storage.k8s.io/pvc/name", "claim"),
        ("csi.storage.k8s.io/pvc/namespace", "default"),
    ]);
    let v = fx.created(ok).await;
    assert_eq!(
        v.volume_context.get("fsType").map(String::as_str),
        Some("xfs")
    );
    // The same volume, asked for with the other spelling of the same parameter.
    let again = with(&[("fsType", "xfs")]);
    let v2 = fx.created(again).await;
    assert_eq!(v2.volume_id, v.volume_id);
    // A capability for another filesystem than the parameter names.
    let mut clash = with(&[("fsType", "xfs")]);
    clash.name = "pvc-q".into();
    clash.volume_capabilities = vec![fs_cap("ext4")];
    assert_invalid(
        fx.svc.create_volume(Request::new(clash)).await,
        "volume_capabilities",
    );
}

#[tokio::test]
async fn create_volume_sizes() {
    let fx = Fx::new("svc-create-sizes");
    let v = fx.create("pvc-default", 0).await;
    assert_eq!(v.capacity_bytes, GIB);
    assert!(v.volume_id.starts_with("vol-") && v.volume_id.len() == 20);
    let meta = std::fs::metadata(fx.volume_path(&v.volume_id)).unwrap();
    assert_eq!(meta.len() as i64, GIB);
    use std::os::unix::fs::MetadataExt as _;
    assert_eq!(meta.blocks(), 0, "a new volume is all hole");
    let v = fx.create("pvc-round", MIB + 1).await;
    assert_eq!(v.capacity_bytes, 2 * MIB);
    assert_eq!(
        v.accessible_topology,
        vec![topo(NODE)],
        "the single node segment"
    );
    let range = |required_bytes, limit_bytes| {
        let mut r = create_req("pvc-range", 0);
        r.capacity_range = Some(csi::CapacityRange {
            required_bytes,
            limit_bytes,
        });
        r
    };
    let v = fx.created(range(0, 10 * MIB)).await;
    assert_eq!(v.capacity_bytes, 10 * MIB);
    for (req, lim) in [(0, 1000), (2 * MIB, MIB), (1000, 1000), (i64::MAX, 0)] {
        let mut r = range(req, lim);
        r.name = format!("pvc-oor-{req}-{lim}");
        assert_code(
            fx.svc.create_volume(Request::new(r)).await,
            Code::OutOfRange,
        );
    }
}

#[tokio::test]
async fn create_volume_is_idempotent_by_name() {
    let fx = Fx::new("svc-create-idem");
    let a = fx.create("pvc-1", 10 * MIB).await;
    let b = fx.create("pvc-1", 10 * MIB).await;
    assert_eq!(a, b);
    // A range the existing volume satisfies is the same volume too.
    let c = fx.create("pvc-1", 5 * MIB).await;
    assert_eq!(c.volume_id, a.volume_id);
    let s = assert_code(
        fx.svc
            .create_volume(Request::new(create_req("pvc-1", 20 * MIB)))
            .await,
        Code::AlreadyExists,
    );
    assert!(s.message().contains(&a.volume_id));
    let mut r = create_req("pvc-1", 10 * MIB);
    r.parameters.insert("fsType".into(), "xfs".into());
    assert_code(
        fx.svc.create_volume(Request::new(r)).await,
        Code::AlreadyExists,
    );
    let mut r = create_req("pvc-1", 10 * MIB);
    r.volume_content_source = Some(csi::VolumeContentSource {
        r#type: Some(csi::volume_content_source::Type::Volume(
            csi::volume_content_source::VolumeSource {
                volume_id: a.volume_id.clone(),
            },
        )),
    });
    assert_code(
        fx.svc.create_volume(Request::new(r)).await,
        Code::AlreadyExists,
    );
    let mut r = create_req("pvc-1", 10 * MIB);
    r.accessibility_requirements = Some(csi::TopologyRequirement {
        requisite: vec![topo("node-2")],
        preferred: vec![],
    });
    assert_code(
        fx.svc.create_volume(Request::new(r)).await,
        Code::AlreadyExists,
    );
    let list = fx
        .svc
        .list_volumes(Request::new(csi::ListVolumesRequest::default()))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(list.entries.len(), 1);
}

#[tokio::test]
async fn create_volume_topology() {
    let fx = Fx::new("svc-create-topo");
    let mut r = create_req("pvc-t", MIB);
    r.accessibility_requirements = Some(csi::TopologyRequirement {
        requisite: vec![topo("node-2")],
        preferred: vec![topo("node-2")],
    });
    assert_code(
        fx.svc.create_volume(Request::new(r.clone())).await,
        Code::ResourceExhausted,
    );
    r.accessibility_requirements = Some(csi::TopologyRequirement {
        requisite: vec![topo("node-2"), topo(NODE)],
        preferred: vec![topo("node-2")],
    });
    let v = fx.created(r.clone()).await;
    assert_eq!(v.accessible_topology, vec![topo(NODE)]);
    // Preferred alone binds nothing.
    r.name = "pvc-t2".into();
    r.accessibility_requirements = Some(csi::TopologyRequirement {
        requisite: vec![],
        preferred: vec![topo("node-2")],
    });
    assert!(fx.svc.create_volume(Request::new(r.clone())).await.is_ok());
    // One requisite topology per node of a large cluster, ours among them.
    r.name = "pvc-t-many".into();
    let mut many: Vec<_> = (0..999).map(|i| topo(&format!("node-x{i}"))).collect();
    many.insert(500, topo(NODE));
    r.accessibility_requirements = Some(csi::TopologyRequirement {
        preferred: many.clone(),
        requisite: many,
    });
    let v = fx.created(r.clone()).await;
    assert_eq!(v.accessible_topology, vec![topo(NODE)]);
    r.name = "pvc-t3".into();
    r.accessibility_requirements = Some(csi::TopologyRequirement::default());
    assert_invalid(
        fx.svc.create_volume(Request::new(r)).await,
        "accessibility_requirements",
    );
}

#[tokio::test]
async fn create_volume_from_sources() {
    use std::os::unix::fs::FileExt as _;
    let fx = Fx::new("svc-create-src");
    let src = fx.create("pvc-src", 4 * MIB).await;
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(fx.volume_path(&src.volume_id))
        .unwrap();
    f.write_all_at(b"moor data", 3 * MIB as u64).unwrap();
    drop(f);
    let snap = fx.snapshot("snap-1", &src.volume_id).await.unwrap();
    assert!(snap.ready_to_use);
    assert_eq!(snap.size_bytes, 4 * MIB);
    let from = |name: &str, ty: csi::volume_content_source::Type, bytes| {
        let mut r = create_req(name, bytes);
        r.volume_content_source = Some(csi::VolumeContentSource { r#type: Some(ty) });
        r
    };
    let snap_src = |id: &str| {
        csi::volume_content_source::Type::Snapshot(csi::volume_content_source::SnapshotSource {
            snapshot_id: id.into(),
        })
    };
    let vol_src = |id: &str| {
        csi::volume_content_source::Type::Volume(csi::volume_content_source::VolumeSource {
            volume_id: id.into(),
        })
    };
    // Smaller than the source: the source's size. Larger: grown.
    let restored = fx
        .created(from("pvc-r", snap_src(&snap.snapshot_id), MIB))
        .await;
    assert_eq!(restored.capacity_bytes, 4 * MIB);
    assert!(restored.content_source.is_some());
    let clone = fx
        .created(from("pvc-c", vol_src(&src.volume_id), 8 * MIB))
        .await;
    assert_eq!(clone.capacity_bytes, 8 * MIB);
    for id in [&restored.volume_id, &clone.volume_id] {
        let f = std::fs::File::open(fx.volume_path(id)).unwrap();
        let mut b = [0u8; 9];
        f.read_exact_at(&mut b, 3 * MIB as u64).unwrap();
        assert_eq!(&b, b"moor data");
    }
    for missing in [
        snap_src("snap-00000000000000ff"),
        snap_src("some-snapshot"),
        vol_src("vol-00000000000000ff"),
        vol_src("../../etc/passwd"),
    ] {
        assert_code(
            fx.svc
                .create_volume(Request::new(from("pvc-missing", missing, MIB)))
                .await,
            Code::NotFound,
        );
    }
    // A limit below the source's size cannot be honoured.
    let mut r = from("pvc-small", snap_src(&snap.snapshot_id), 0);
    r.capacity_range = Some(csi::CapacityRange {
        required_bytes: 0,
        limit_bytes: 2 * MIB,
    });
    assert_code(
        fx.svc.create_volume(Request::new(r)).await,
        Code::OutOfRange,
    );
    assert_invalid(
        fx.svc
            .create_volume(Request::new(from("pvc-e", snap_src(""), MIB)))
            .await,
        "volume_content_source",
    );
}

/// Whether the backend holds no volume.
fn no_volume(fx: &Fx) -> bool {
    use crate::backend::Backend as _;
    fx.backend
        .list_volumes(&Default::default())
        .unwrap()
        .entries
        .is_empty()
}

/// The CSI secrets of the `secret` key source: a KEK and its id.
fn kek_secrets(id: &str, byte: u8) -> std::collections::HashMap<String, String> {
    moor_runtime::keys::secret_entries(id, &[byte; 32])
        .into_iter()
        .collect()
}

#[tokio::test]
async fn an_encrypted_volume_gets_a_wrapped_data_key_of_its_own_and_its_copies_its_key() {
    use crate::backend::Backend as _;
    use moor_runtime::keys::{WrappedDek, kek_from_secret};
    let fx = Fx::new("svc-create-encrypted");
    let encrypted = |name: &str, extra: &[(&str, &str)]| {
        let mut r = create_req(name, 1 << 20);
        for (k, v) in [("encrypted", "true"), ("kmsID", "secret")]
            .iter()
            .chain(extra)
        {
            r.parameters.insert((*k).into(), (*v).into());
        }
        r.secrets = kek_secrets("kek-1", 7);
        r
    };
    let s = fx
        .svc
        .create_volume(Request::new(encrypted("enc", &[("luksKeySize", "384")])))
        .await
        .expect_err("bad key size");
    assert_eq!(s.code(), Code::InvalidArgument);
    assert!(
        s.message().contains("luksKeySize=\"384\""),
        "{}",
        s.message()
    );
    // No KEK in the secrets: INVALID_ARGUMENT naming the secrets key, and nothing made.
    for (drop, named) in [("kek", "\"kek\""), ("kekID", "\"kekID\"")] {
        let mut r = encrypted("enc", &[]);
        r.secrets.remove(drop);
        let s = fx
            .svc
            .create_volume(Request::new(r))
            .await
            .expect_err("no KEK");
        assert_eq!(s.code(), Code::InvalidArgument);
        assert!(s.message().contains(named), "{}", s.message());
    }
    let mut short = encrypted("enc", &[]);
    short.secrets.insert("kek".into(), "c2hvcnQ=".into());
    let s = fx
        .svc
        .create_volume(Request::new(short))
        .await
        .expect_err("a short KEK");
    assert_eq!(s.code(), Code::InvalidArgument);
    assert!(!s.message().contains("c2hvcnQ="), "{}", s.message());
    assert!(no_volume(&fx), "nothing made");
    // Made: the context says how to open it, with the data key wrapped for this volume by
    // the secret's KEK, and no key in the clear.
    let v = fx
        .svc
        .create_volume(Request::new(encrypted("enc", &[])))
        .await
        .expect("encrypted")
        .into_inner()
        .volume
        .expect("volume");
    let ctx = &v.volume_context;
    for (k, want) in [
        ("encrypted", "true"),
        ("kmsID", "secret"),
        ("luksCipher", "aes-xts-plain64"),
        ("luksKeySize", "512"),
        ("luksSectorSize", "4096"),
        ("luksPBKDF", "pbkdf2"),
    ] {
        assert_eq!(ctx.get(k).map(String::as_str), Some(want), "{k} in {ctx:?}");
    }
    let wrapped = WrappedDek::decode(&ctx["encryptedDEK"]).expect("a wrapped key");
    assert_eq!(wrapped.kek_id(), "kek-1");
    let secrets = kek_secrets("kek-1", 7);
    let kek = kek_from_secret(|k| secrets.get(k).map(String::as_str)).unwrap();
    let dek = kek
        .unwrap(&wrapped, &v.volume_id)
        .expect("unwraps for its volume");
    assert!(kek.unwrap(&wrapped, "vol-other").is_err());
    let secrets = kek_secrets("kek-1", 8);
    let wrong = kek_from_secret(|k| secrets.get(k).map(String::as_str)).unwrap();
    assert!(wrong.unwrap(&wrapped, &v.volume_id).is_err());
    for value in ctx.values() {
        assert!(!value.contains(&secrets["kek"]));
    }
    // A retry answers the same volume, with the same key (not a new one).
    let again = fx
        .svc
        .create_volume(Request::new(encrypted("enc", &[])))
        .await
        .expect("retry")
        .into_inner()
        .volume
        .expect("volume");
    assert_eq!(again.volume_id, v.volume_id);
    assert_eq!(again.volume_context, v.volume_context);
    // The record keeps it: ControllerGetVolume after a restart of the backend says the same.
    let status = fx.backend.get_volume(&v.volume_id).unwrap();
    assert_eq!(status.volume.context["encryptedDEK"], ctx["encryptedDEK"]);
    let other = kek.unwrap(
        &WrappedDek::decode(&status.volume.context["encryptedDEK"]).unwrap(),
        &v.volume_id,
    );
    assert_eq!(other.unwrap().expose(), dek.expose());
    // A snapshot of it, a clone and a restore: encrypted, each with its source's data key
    // wrapped for itself (the copy holds its source's LUKS header), and its source's LUKS
    // parameters whatever the class says.
    let snap_enc = fx
        .snapshot("snap-enc", &v.volume_id)
        .await
        .expect("a snapshot of an encrypted volume");
    use csi::volume_content_source::{SnapshotSource, Type, VolumeSource};
    let with_source = |mut r: csi::CreateVolumeRequest, ty: Type| {
        r.volume_content_source = Some(csi::VolumeContentSource { r#type: Some(ty) });
        r
    };
    let of_volume = |id: &str| {
        Type::Volume(VolumeSource {
            volume_id: id.to_owned(),
        })
    };
    let of_snapshot = |id: &str| {
        Type::Snapshot(SnapshotSource {
            snapshot_id: id.to_owned(),
        })
    };
    let clone = fx
        .svc
        .create_volume(Request::new(with_source(
            encrypted("enc-clone", &[]),
            of_volume(&v.volume_id),
        )))
        .await
        .expect("a clone")
        .into_inner()
        .volume
        .expect("volume");
    // The source goes: its snapshot keeps what a restore needs.
    fx.svc
        .delete_volume(Request::new(csi::DeleteVolumeRequest {
            volume_id: v.volume_id.clone(),
            secrets: Default::default(),
        }))
        .await
        .expect("delete the source");
    let restored = fx
        .svc
        .create_volume(Request::new(with_source(
            encrypted("enc-restore", &[("luksCipher", "serpent-xts-plain64")]),
            of_snapshot(&snap_enc.snapshot_id),
        )))
        .await
        .expect("a restore")
        .into_inner()
        .volume
        .expect("volume");
    for copy in [&clone, &restored] {
        let ctx = &copy.volume_context;
        assert_eq!(
            ctx["luksCipher"], "aes-xts-plain64",
            "the source's: {ctx:?}"
        );
        let w = WrappedDek::decode(&ctx["encryptedDEK"]).expect("a wrapped key");
        let copy_dek = kek
            .unwrap(&w, &copy.volume_id)
            .expect("wrapped for the copy");
        assert!(copy_dek.expose() == dek.expose(), "the source's data key");
        assert!(
            kek.unwrap(&w, &v.volume_id).is_err(),
            "not the source's wrap"
        );
    }
    // A copy between encrypted and clear, or under a KEK that does not unwrap the source's
    // key: INVALID_ARGUMENT, nothing made.
    let plain = fx.create("plain-src", 1 << 20).await;
    let snap = fx.snapshot("snap-plain", &plain.volume_id).await.unwrap();
    let mut wrong_kek = with_source(encrypted("enc-wrong", &[]), of_volume(&clone.volume_id));
    wrong_kek.secrets = kek_secrets("kek-1", 9);
    for (r, says) in [
        (
            with_source(
                create_req("clear-clone", 1 << 20),
                of_volume(&clone.volume_id),
            ),
            "the source is encrypted",
        ),
        (
            with_source(
                create_req("clear-restore", 1 << 20),
                of_snapshot(&snap_enc.snapshot_id),
            ),
            "the source is encrypted",
        ),
        (
            with_source(encrypted("enc-of-plain", &[]), of_volume(&plain.volume_id)),
            "the source is in the clear",
        ),
        (
            with_source(
                encrypted("enc-of-plain-snap", &[]),
                of_snapshot(&snap.snapshot_id),
            ),
            "the source is in the clear",
        ),
        (wrong_kek, "unwrap"),
    ] {
        let s = fx
            .svc
            .create_volume(Request::new(r))
            .await
            .expect_err("copy");
        assert_eq!(s.code(), Code::InvalidArgument, "{s:?}");
        assert!(s.message().contains(says), "{says}: {}", s.message());
    }
    assert_eq!(
        fx.backend
            .list_volumes(&Default::default())
            .unwrap()
            .entries
            .len(),
        3,
        "the clone, the restore, the plain source"
    );
    // encrypted: "false" is the default, and dropped.
    let mut plain = create_req("plain", 1 << 20);
    plain.parameters.insert("encrypted".into(), "false".into());
    let v = fx
        .svc
        .create_volume(Request::new(plain))
        .await
        .expect("plain");
    let v = v.into_inner().volume.expect("volume");
    assert!(!v.volume_context.contains_key("encrypted"), "{v:?}");
}

#[tokio::test]
async fn kms_id_chooses_the_source_that_wraps_the_data_key() {
    use moor_runtime::keys::{WrappedDek, kek_from_secret};
    let fx = Fx::new("svc-create-kms");
    let with_kms = |name: &str, kms: &str| {
        let mut r = create_req(name, 1 << 20);
        r.parameters.insert("encrypted".into(), "true".into());
        r.parameters.insert("kmsID".into(), kms.into());
        r.secrets = kek_secrets("cluster-1", 9);
        r
    };
    // kmip, with a Secret source's fields: its endpoint is missing; nothing is made.
    let s = fx
        .svc
        .create_volume(Request::new(with_kms("enc-kmip", "kmip")))
        .await
        .expect_err("no KMIP endpoint");
    assert_eq!(s.code(), Code::InvalidArgument, "{s:?}");
    assert!(s.message().contains("KMIP_ENDPOINT"), "{}", s.message());
    assert!(no_volume(&fx), "nothing made");
    // tpm2: the cluster half is the Secret's KEK's; the node adds its TPM's half at stage.
    let v = fx
        .svc
        .create_volume(Request::new(with_kms("enc-tpm2", "tpm2")))
        .await
        .expect("a tpm2 volume")
        .into_inner()
        .volume
        .expect("volume");
    assert_eq!(
        v.volume_context.get("kmsID").map(String::as_str),
        Some("tpm2")
    );
    let wrapped = WrappedDek::decode(&v.volume_context["encryptedDEK"]).expect("wrapped");
    assert_eq!(wrapped.kek_id(), "cluster-1");
    let secrets = kek_secrets("cluster-1", 9);
    let kek = kek_from_secret(|k| secrets.get(k).map(String::as_str)).expect("kek");
    kek.unwrap(&wrapped, &v.volume_id)
        .expect("the cluster KEK unwraps the cluster half");
}

#[tokio::test]
async fn a_tpm2_volume_sealed_to_pcrs_carries_them_to_the_node() {
    let fx = Fx::new("svc-create-tpm2-pcrs");
    let mut r = create_req("sealed", 1 << 20);
    for (k, v) in [
        ("encrypted", "true"),
        ("kmsID", "tpm2"),
        ("tpm2PCRs", "sha256:7,0"),
    ] {
        r.parameters.insert(k.into(), v.into());
    }
    r.secrets = kek_secrets("kek-1", 7);
    let v = fx
        .svc
        .create_volume(Request::new(r.clone()))
        .await
        .expect("a tpm2 volume sealed to PCRs")
        .into_inner()
        .volume
        .expect("volume");
    assert_eq!(
        v.volume_context.get("tpm2PCRs").map(String::as_str),
        Some("sha256:0,7"),
        "{:?}",
        v.volume_context
    );
    r.name = "not-a-selection".into();
    r.parameters.insert("tpm2PCRs".into(), "sha256:99".into());
    let s = fx
        .svc
        .create_volume(Request::new(r))
        .await
        .expect_err("not a selection");
    assert_eq!(s.code(), Code::InvalidArgument);
    assert!(s.message().contains("tpm2PCRs"), "{}", s.message());
}
