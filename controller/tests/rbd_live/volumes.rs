//! Volumes: create (idempotent by name), credentials, expand, modify (QoS), ListVolumes's pages,
//! and a create or a delete interrupted half-way and finished by its retry.

use super::*;

#[test]
fn create_is_idempotent_by_name_and_delete_removes_everything() {
    let Some(env) = Env::get() else {
        return;
    };
    let b = env.backend(false);
    let mut cleanup = Cleanup::new(&env, &b);
    secrets::scope(env.secrets(), || {
        let n = name("create");
        let v = b
            .create_volume(&new_volume(&env, &n, 64 * MIB, None))
            .unwrap();
        cleanup.volume(&v.id);
        let id = VolumeId::parse(&v.id).expect("an rbd volume id");
        assert!(v.id.len() <= 128, "{}", v.id);
        assert_eq!(id.location.pool, env.pool);
        assert_eq!(v.capacity_bytes, 64 * MIB);
        assert_eq!(v.context["pool"], env.pool);
        assert_eq!(v.context["imageName"], id.image());
        assert_eq!(v.context["clusterID"], CLUSTER_ID);
        assert!(
            v.topology.is_empty(),
            "an image is reachable from every node"
        );

        let open = env.pool().open_image_read_only(&id.image()).unwrap();
        assert_eq!(open.size().unwrap(), 64 * MIB);
        assert_eq!(open.features().unwrap(), moor_rbd::Features::MOOR_DEFAULT);
        drop(open);

        // Same name and request: the same volume.
        let again = b
            .create_volume(&new_volume(&env, &n, 64 * MIB, None))
            .unwrap();
        assert_eq!(again, v);
        // Same name, another size: ALREADY_EXISTS.
        let e = b
            .create_volume(&new_volume(&env, &n, 128 * MIB, None))
            .unwrap_err();
        assert!(matches!(e, Error::VolumeExists { .. }), "{e}");
        // Same name, other parameters.
        let mut other = new_volume(&env, &n, 64 * MIB, None);
        other
            .parameters
            .insert("imageFeatures".into(), "layering".into());
        let e = b.create_volume(&other).unwrap_err();
        assert!(matches!(e, Error::VolumeExists { .. }), "{e}");

        let status = b.get_volume(&v.id).unwrap();
        assert_eq!(status.volume, v);
        assert!(!status.condition.abnormal, "{:?}", status.condition);

        b.delete_volume(&v.id).unwrap();
        assert!(
            !image_names(&env).contains(&id.image()),
            "the image is removed"
        );
        assert!(
            !metadata_keys(&env)
                .iter()
                .any(|k| k.contains(&id.suffix) || k.ends_with(&n)),
            "its records are removed"
        );
        assert!(matches!(b.get_volume(&v.id), Err(Error::VolumeNotFound(_))));
        // Deleting again, or something that never existed, is success.
        b.delete_volume(&v.id).unwrap();
        b.delete_volume("rbd/live/moor/moor-vol-000000000000000000000000")
            .unwrap();
        b.delete_volume("rbd/nosuchcluster/moor/moor-vol-000000000000000000000000")
            .unwrap_err();
        // A new volume of the old name gets a new id.
        let v2 = b
            .create_volume(&new_volume(&env, &n, 64 * MIB, None))
            .unwrap();
        cleanup.volume(&v2.id);
        assert_ne!(v2.id, v.id);
    });
}

#[test]
fn credentials_come_from_the_secrets_or_the_cluster_list() {
    let Some(env) = Env::get() else {
        return;
    };
    let b = env.backend(false);
    let n = name("creds");
    // No secrets, no credentials of the controller's own: INVALID_ARGUMENT on secrets.
    let e = b
        .create_volume(&new_volume(&env, &n, 16 * MIB, None))
        .unwrap_err();
    assert!(
        matches!(
            e,
            Error::InvalidArgument {
                field: "secrets",
                ..
            }
        ),
        "{e}"
    );
    // A wrong key is refused, and never shown.
    let wrong = Secrets::from_pairs([
        ("userID", env.user.as_str()),
        ("userKey", "AQBwrongwrongwrongwrongwrongwrongwrongw=="),
    ]);
    let e = secrets::scope(wrong, || {
        b.create_volume(&new_volume(&env, &n, 16 * MIB, None))
    })
    .unwrap_err();
    assert!(!format!("{e} {e:?}").contains("AQBwrong"), "{e}");
    // The controller's own credentials, from its cluster list, serve requests without
    // secrets (ListVolumes, GetCapacity, ControllerGetVolume carry none).
    let own = env.backend(true);
    let mut cleanup = Cleanup::new(&env, &own);
    let v = own
        .create_volume(&new_volume(&env, &n, 16 * MIB, None))
        .unwrap();
    cleanup.volume(&v.id);
    assert_eq!(own.get_volume(&v.id).unwrap().volume.id, v.id);
    let listed = own.list_volumes(&PageRequest::default()).unwrap();
    assert!(listed.entries.iter().any(|s| s.volume.id == v.id));
    let c = own
        .capacity(&CapacityQuery {
            parameters: own.parse_parameters(&env.params()).unwrap(),
            topology: None,
        })
        .unwrap();
    assert!(c.available > 0, "{c:?}");
}

#[test]
fn expand_grows_the_image_and_never_shrinks_it() {
    let Some(env) = Env::get() else {
        return;
    };
    let b = env.backend(false);
    let mut cleanup = Cleanup::new(&env, &b);
    secrets::scope(env.secrets(), || {
        let v = b
            .create_volume(&new_volume(&env, &name("expand"), 32 * MIB, None))
            .unwrap();
        cleanup.volume(&v.id);
        let image = VolumeId::parse(&v.id).unwrap().image();
        let expand = |required, limit| ExpandRequest {
            volume_id: v.id.clone(),
            capacity: CapacityRange { required, limit },
            capability: None,
        };
        assert_eq!(b.expand_volume(&expand(48 * MIB + 1, 0)).unwrap(), 49 * MIB);
        let size = env
            .pool()
            .open_image_read_only(&image)
            .unwrap()
            .size()
            .unwrap();
        assert_eq!(size, 49 * MIB);
        assert_eq!(b.get_volume(&v.id).unwrap().volume.capacity_bytes, 49 * MIB);
        // Smaller: the volume stays as it is.
        assert_eq!(b.expand_volume(&expand(16 * MIB, 0)).unwrap(), 49 * MIB);
        let e = b.expand_volume(&expand(16 * MIB, 32 * MIB)).unwrap_err();
        assert!(matches!(e, Error::OutOfRange(_)), "{e}");
        let mut missing = expand(64 * MIB, 0);
        missing.volume_id = "rbd/live/moor/moor-vol-000000000000000000000000".into();
        assert!(matches!(
            b.expand_volume(&missing),
            Err(Error::VolumeNotFound(_))
        ));
        // GetCapacity: the pool's.
        let c = b
            .capacity(&CapacityQuery {
                parameters: b.parse_parameters(&env.params()).unwrap(),
                topology: None,
            })
            .unwrap();
        let pool_avail = env.pool().capacity().unwrap().available_bytes;
        assert!(c.available > 0);
        // The pool's figure moves a little as other tests write: same order of magnitude.
        assert!(c.available / 2 < pool_avail && pool_avail / 2 < c.available);
    });
}

#[test]
fn list_volumes_pages_by_id() {
    let Some(env) = Env::get() else {
        return;
    };
    let b = env.backend(false);
    let mut cleanup = Cleanup::new(&env, &b);
    secrets::scope(env.secrets(), || {
        let mut mine = BTreeSet::new();
        for i in 0..5 {
            let v = b
                .create_volume(&new_volume(&env, &name(&format!("page{i}")), 8 * MIB, None))
                .unwrap();
            mine.insert(cleanup.volume(&v.id));
        }
        let mut seen = Vec::new();
        let mut token = None;
        for round in 0.. {
            assert!(round < 10_000, "the pages do not end");
            let page = b
                .list_volumes(&PageRequest {
                    max_entries: 2,
                    starting_token: token.clone(),
                })
                .unwrap();
            assert!(page.entries.len() <= 2);
            seen.extend(page.entries.iter().map(|s| s.volume.id.clone()));
            match page.next_token {
                Some(t) => token = Some(t),
                None => break,
            }
        }
        let seen_set: BTreeSet<String> = seen.iter().cloned().collect();
        assert_eq!(seen_set.len(), seen.len(), "no volume twice: {seen:?}");
        assert!(mine.is_subset(&seen_set), "{mine:?} in {seen:?}");
        let e = b
            .list_volumes(&PageRequest {
                max_entries: 2,
                starting_token: Some("not-a-token".into()),
            })
            .unwrap_err();
        assert!(matches!(e, Error::InvalidToken { .. }), "{e}");
    });
}

/// A CreateVolume or DeleteVolume interrupted at any step (the controller killed, the cluster
/// out of reach) leaves records its retry finishes: each state is set up here as a crash
/// would leave it.
#[test]
fn an_interrupted_create_or_delete_is_finished_by_its_retry() {
    use moor_controller::rbd::records::{Registry, VolumeState};
    let Some(env) = Env::get() else {
        return;
    };
    let b = env.backend(false);
    let mut cleanup = Cleanup::new(&env, &b);
    let pool = env.pool();
    let reg = Registry::new(&pool);
    secrets::scope(env.secrets(), || {
        // Killed after the name index was written, before the record.
        let n = name("after-index");
        let suffix = moor_controller::rbd::ids::random_suffix().unwrap();
        reg.name_volume(&n, &suffix).unwrap();
        let v = b
            .create_volume(&new_volume(&env, &n, 8 * MIB, None))
            .unwrap();
        cleanup.volume(&v.id);
        assert_eq!(
            VolumeId::parse(&v.id).unwrap().suffix,
            suffix,
            "the named id is used"
        );
        assert!(image_names(&env).contains(&VolumeId::parse(&v.id).unwrap().image()));

        // Killed after the image was made, before the record said ready.
        let n = name("before-ready");
        let v = b
            .create_volume(&new_volume(&env, &n, 8 * MIB, None))
            .unwrap();
        cleanup.volume(&v.id);
        let id = VolumeId::parse(&v.id).unwrap();
        let mut rec = reg.volume(&id.suffix).unwrap().unwrap();
        rec.state = VolumeState::Creating;
        reg.put_volume(&id.suffix, &rec).unwrap();
        assert!(matches!(b.get_volume(&v.id), Err(Error::VolumeNotFound(_))));
        let again = b
            .create_volume(&new_volume(&env, &n, 8 * MIB, None))
            .unwrap();
        assert_eq!(again.id, v.id);
        assert_eq!(
            reg.volume(&id.suffix).unwrap().unwrap().state,
            VolumeState::Ready
        );

        // Killed in a delete, after its name was freed, before the image went.
        rec.state = VolumeState::Deleting;
        reg.put_volume(&id.suffix, &rec).unwrap();
        reg.unname_volume(&n, &id.suffix).unwrap();
        b.delete_volume(&v.id).unwrap();
        assert!(!image_names(&env).contains(&id.image()));
        assert!(reg.volume(&id.suffix).unwrap().is_none());
        // The name makes a new volume now.
        let fresh = b
            .create_volume(&new_volume(&env, &n, 8 * MIB, None))
            .unwrap();
        cleanup.volume(&fresh.id);
        assert_ne!(fresh.id, v.id);
    });
}

/// An image's metadata value, read with Ceph's own `rbd` (None: not set).
fn image_meta(env: &Env, image: &str, key: &str) -> Option<String> {
    let out = std::process::Command::new("rbd")
        .arg("--conf")
        .arg(&env.conf)
        .arg("--keyring")
        .arg(&env.keyring)
        .args(["--id", &env.user, "image-meta", "get"])
        .arg(format!("{}/{image}", env.pool))
        .arg(key)
        .output()
        .expect("rbd image-meta get");
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

#[test]
fn modify_sets_librbds_qos_on_the_image_and_a_new_set_replaces_it() {
    let Some(env) = Env::get() else {
        return;
    };
    let b = env.backend(false);
    let mut cleanup = Cleanup::new(&env, &b);
    secrets::scope(env.secrets(), || {
        let v = b
            .create_volume(&new_volume(&env, &name("modify"), 16 * MIB, None))
            .unwrap();
        cleanup.volume(&v.id);
        let image = VolumeId::parse(&v.id).unwrap().image();
        let qos = moor_controller::backend::Qos {
            write_iops: Some(1000),
            read_bps: Some(1 << 20),
            ..Default::default()
        };
        b.modify_volume(&v.id, &qos).unwrap();
        let meta = |k: &str| image_meta(&env, &image, k);
        assert_eq!(
            meta("conf_rbd_qos_write_iops_limit").as_deref(),
            Some("1000")
        );
        assert_eq!(
            meta("conf_rbd_qos_read_bps_limit").as_deref(),
            Some("1048576")
        );
        assert_eq!(meta("conf_rbd_qos_read_iops_limit"), None);
        // Another class: its limits only.
        let qos = moor_controller::backend::Qos {
            write_bps: Some(4096),
            ..Default::default()
        };
        b.modify_volume(&v.id, &qos).unwrap();
        assert_eq!(meta("conf_rbd_qos_write_iops_limit"), None);
        assert_eq!(meta("conf_rbd_qos_read_bps_limit"), None);
        assert_eq!(
            meta("conf_rbd_qos_write_bps_limit").as_deref(),
            Some("4096")
        );
        let e = b
            .modify_volume("rbd/live/moor/moor-vol-000000000000000000000000", &qos)
            .unwrap_err();
        assert!(matches!(e, Error::VolumeNotFound(_)), "{e}");
    });
}

#[test]
fn an_encrypted_volume_keeps_its_wrapped_key_in_its_image_metadata_and_its_copies_theirs() {
    let Some(env) = Env::get() else {
        return;
    };
    let b = env.backend(false);
    let mut cleanup = Cleanup::new(&env, &b);
    const META: &str = "moor.csi.io/encryptedDEK";
    // The parameters as CreateVolume gives them to the backend: normalised.
    let class = Parameters::from([
        ("encrypted".to_owned(), "true".to_owned()),
        ("kmsID".to_owned(), "secret".to_owned()),
    ]);
    let (e, _) = moor_controller::encryption::split(&class).unwrap();
    let normalised = e.expect("encrypted").parameters();
    let encrypted = |name: &str, source| {
        let mut v = new_volume(&env, name, 16 * MIB, source);
        v.parameters.extend(normalised.clone());
        v
    };
    secrets::scope(env.secrets(), || {
        let v = b.create_volume(&encrypted(&name("enc"), None)).unwrap();
        cleanup.volume(&v.id);
        assert_eq!(v.context["encrypted"], "true", "{:?}", v.context);
        assert_eq!(v.context["luksCipher"], "aes-xts-plain64");
        let image = VolumeId::parse(&v.id).unwrap().image();
        assert_eq!(image_meta(&env, &image, META), None);
        let v = b.record_wrapped_dek(&v.id, "v1:kek-1:first").unwrap();
        assert_eq!(v.context["encryptedDEK"], "v1:kek-1:first");
        assert_eq!(
            image_meta(&env, &image, META).as_deref(),
            Some("v1:kek-1:first")
        );
        // Once: a retry keeps the first.
        b.record_wrapped_dek(&v.id, "v1:kek-1:second").unwrap();
        let status = b.get_volume(&v.id).unwrap();
        assert_eq!(status.volume.context["encryptedDEK"], "v1:kek-1:first");
        assert_eq!(
            image_meta(&env, &image, META).as_deref(),
            Some("v1:kek-1:first")
        );
        // A snapshot carries the source's encryption and wrapped key.
        let s = b
            .create_snapshot(&NewSnapshot {
                name: name("enc-snap"),
                source_volume_id: v.id.clone(),
                parameters: Parameters::new(),
            })
            .unwrap();
        cleanup.snapshot(&s.id);
        assert_eq!(s.encryption["encryptedDEK"], "v1:kek-1:first");
        assert_eq!(b.get_snapshot(&s.id).unwrap().encryption, s.encryption);
        // A clone's image starts with its parent's metadata; its own key replaces it.
        let c = b
            .create_volume(&encrypted(
                &name("enc-clone"),
                Some(ContentSource::Volume(v.id.clone())),
            ))
            .unwrap();
        cleanup.volume(&c.id);
        b.record_wrapped_dek(&c.id, "v1:kek-1:clone").unwrap();
        let clone_image = VolumeId::parse(&c.id).unwrap().image();
        assert_eq!(
            image_meta(&env, &clone_image, META).as_deref(),
            Some("v1:kek-1:clone")
        );
        // A key split with a node's TPM opens on that node only: refused, nothing made.
        let tpm2 = Parameters::from([
            ("encrypted".to_owned(), "true".to_owned()),
            ("kmsID".to_owned(), "tpm2".to_owned()),
        ]);
        let (e, _) = moor_controller::encryption::split(&tpm2).unwrap();
        let tpm2_name = name("enc-tpm2");
        let mut req = new_volume(&env, &tpm2_name, 16 * MIB, None);
        req.parameters.extend(e.expect("encrypted").parameters());
        let err = b.create_volume(&req).unwrap_err();
        assert!(
            matches!(
                err,
                Error::InvalidArgument {
                    field: "parameters",
                    ..
                }
            ),
            "{err:?}"
        );
        assert!(err.to_string().contains("TPM"), "{err}");
    });
}
