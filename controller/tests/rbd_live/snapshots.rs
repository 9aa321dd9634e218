//! Snapshots, restores and clones, with their data, and deletes that wait for dependents.

use super::*;

fn write(env: &Env, image: &str, offset: u64, data: &[u8]) {
    let open = env.pool().open_image(image).unwrap();
    open.write(offset, data).unwrap();
    open.flush().unwrap();
}

fn read(env: &Env, image: &str, offset: u64, len: usize) -> Vec<u8> {
    env.pool()
        .open_image_read_only(image)
        .unwrap()
        .read(offset, len)
        .unwrap()
}

#[test]
fn snapshots_restore_and_clones_keep_their_data_and_deletes_wait_for_dependents() {
    let Some(env) = Env::get() else {
        return;
    };
    let b = env.backend(false);
    let mut cleanup = Cleanup::new(&env, &b);
    secrets::scope(env.secrets(), || {
        let a = b
            .create_volume(&new_volume(&env, &name("origin"), 32 * MIB, None))
            .unwrap();
        cleanup.volume(&a.id);
        let a_image = VolumeId::parse(&a.id).unwrap().image();
        write(&env, &a_image, 4096, b"before the snapshot");

        let sname = name("snap");
        let started = Instant::now();
        let s = b
            .create_snapshot(&NewSnapshot {
                name: sname.clone(),
                source_volume_id: a.id.clone(),
                parameters: Parameters::new(),
            })
            .unwrap();
        eprintln!("timing: snapshot {}", ms(started.elapsed()));
        cleanup.snapshot(&s.id);
        assert!(SnapshotId::parse(&s.id).is_some(), "{}", s.id);
        assert_eq!(s.source_volume_id, a.id);
        assert_eq!(s.size_bytes, 32 * MIB);
        assert!(s.ready_to_use);
        // Idempotent by name; the same name from another volume is ALREADY_EXISTS.
        let again = b
            .create_snapshot(&NewSnapshot {
                name: sname.clone(),
                source_volume_id: a.id.clone(),
                parameters: Parameters::new(),
            })
            .unwrap();
        assert_eq!(again, s);
        let other = b
            .create_volume(&new_volume(&env, &name("other"), 16 * MIB, None))
            .unwrap();
        cleanup.volume(&other.id);
        let e = b
            .create_snapshot(&NewSnapshot {
                name: sname.clone(),
                source_volume_id: other.id.clone(),
                parameters: Parameters::new(),
            })
            .unwrap_err();
        assert!(matches!(e, Error::SnapshotExists { .. }), "{e}");
        let e = b
            .create_snapshot(&NewSnapshot {
                name: name("badparam"),
                source_volume_id: a.id.clone(),
                parameters: Parameters::from([("pool".into(), "elsewhere".into())]),
            })
            .unwrap_err();
        assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
        // After the snapshot, the volume changes; the snapshot does not.
        write(&env, &a_image, 4096, b"after  the snapshot");

        // ListSnapshots: by id, by source, and all.
        let by_id = b
            .list_snapshots(
                &SnapshotFilter {
                    snapshot_id: Some(s.id.clone()),
                    source_volume_id: None,
                },
                &PageRequest::default(),
            )
            .unwrap();
        assert_eq!(by_id.entries, vec![s.clone()]);
        let by_source = b
            .list_snapshots(
                &SnapshotFilter {
                    snapshot_id: None,
                    source_volume_id: Some(a.id.clone()),
                },
                &PageRequest::default(),
            )
            .unwrap();
        assert_eq!(by_source.entries, vec![s.clone()]);
        let none = b
            .list_snapshots(
                &SnapshotFilter {
                    snapshot_id: None,
                    source_volume_id: Some(other.id.clone()),
                },
                &PageRequest::default(),
            )
            .unwrap();
        assert!(none.entries.is_empty());
        let all = b
            .list_snapshots(&SnapshotFilter::default(), &PageRequest::default())
            .unwrap();
        assert!(all.entries.contains(&s));
        assert_eq!(b.get_snapshot(&s.id).unwrap(), s);

        // A volume from the snapshot, bigger than it: the snapshot's data.
        let started = Instant::now();
        let restored = b
            .create_volume(&new_volume(
                &env,
                &name("restored"),
                48 * MIB,
                Some(ContentSource::Snapshot(s.id.clone())),
            ))
            .unwrap();
        eprintln!("timing: clone from a snapshot {}", ms(started.elapsed()));
        cleanup.volume(&restored.id);
        assert_eq!(restored.capacity_bytes, 48 * MIB);
        assert_eq!(restored.source, Some(ContentSource::Snapshot(s.id.clone())));
        let r_image = VolumeId::parse(&restored.id).unwrap().image();
        assert_eq!(read(&env, &r_image, 4096, 19), b"before the snapshot");
        assert_eq!(
            env.pool()
                .open_image_read_only(&r_image)
                .unwrap()
                .size()
                .unwrap(),
            48 * MIB
        );
        // Smaller than the snapshot: OUT_OF_RANGE.
        let mut small = new_volume(
            &env,
            &name("small"),
            16 * MIB,
            Some(ContentSource::Snapshot(s.id.clone())),
        );
        small.capacity = Some(CapacityRange {
            required: 16 * MIB,
            limit: 16 * MIB,
        });
        assert!(matches!(b.create_volume(&small), Err(Error::OutOfRange(_))));
        assert!(
            !metadata_keys(&env).iter().any(|k| k.ends_with(&small.name)),
            "a failed create leaves no record"
        );
        // A snapshot that does not exist: NOT_FOUND.
        let e = b
            .create_volume(&new_volume(
                &env,
                &name("nosnap"),
                16 * MIB,
                Some(ContentSource::Snapshot(
                    "rbd/live/moor/moor-snap-000000000000000000000000".into(),
                )),
            ))
            .unwrap_err();
        assert!(matches!(e, Error::SourceNotFound { .. }), "{e}");
        assert!(!metadata_keys(&env).iter().any(|k| k.contains("-nosnap")));

        // A clone of the volume itself: its data now.
        let started = Instant::now();
        let cloned = b
            .create_volume(&new_volume(
                &env,
                &name("cloned"),
                32 * MIB,
                Some(ContentSource::Volume(a.id.clone())),
            ))
            .unwrap();
        eprintln!("timing: clone from a volume {}", ms(started.elapsed()));
        cleanup.volume(&cloned.id);
        let c_image = VolumeId::parse(&cloned.id).unwrap().image();
        assert_eq!(read(&env, &c_image, 4096, 19), b"after  the snapshot");
        // Writing the clone leaves its source alone.
        write(&env, &c_image, 4096, b"written in the clone");
        assert_eq!(read(&env, &a_image, 4096, 19), b"after  the snapshot");

        // Delete the origin while a snapshot and a clone depend on it: success, the volume is
        // gone for the CO, its image stays for them.
        b.delete_volume(&a.id).unwrap();
        assert!(matches!(b.get_volume(&a.id), Err(Error::VolumeNotFound(_))));
        let listed = b.list_volumes(&PageRequest::default()).unwrap();
        assert!(!listed.entries.iter().any(|v| v.volume.id == a.id));
        assert!(
            image_names(&env).contains(&a_image),
            "kept for its dependents"
        );
        // Deleting it again is still success.
        b.delete_volume(&a.id).unwrap();
        // Its snapshot still restores.
        let late = b
            .create_volume(&new_volume(
                &env,
                &name("late"),
                32 * MIB,
                Some(ContentSource::Snapshot(s.id.clone())),
            ))
            .unwrap();
        cleanup.volume(&late.id);
        assert_eq!(
            read(&env, &VolumeId::parse(&late.id).unwrap().image(), 4096, 19),
            b"before the snapshot"
        );

        // Delete the snapshot while volumes are cloned from it: success, gone for the CO.
        b.delete_snapshot(&s.id).unwrap();
        assert!(matches!(
            b.get_snapshot(&s.id),
            Err(Error::SnapshotNotFound(_))
        ));
        b.delete_snapshot(&s.id).unwrap();

        // Remove the dependents one by one: the origin's image goes with the last.
        let started = Instant::now();
        b.delete_volume(&restored.id).unwrap();
        eprintln!("timing: delete a clone {}", ms(started.elapsed()));
        b.delete_volume(&late.id).unwrap();
        assert!(
            image_names(&env).contains(&a_image),
            "the volume clone remains"
        );
        b.delete_volume(&cloned.id).unwrap();
        let images = image_names(&env);
        for gone in [&a_image, &r_image, &c_image] {
            assert!(!images.contains(gone), "{gone} is removed");
        }
        let keys = metadata_keys(&env);
        for id in [&a.id, &restored.id, &cloned.id, &late.id] {
            let suffix = VolumeId::parse(id).unwrap().suffix;
            assert!(
                !keys.iter().any(|k| k.contains(&suffix)),
                "records of {id} remain"
            );
        }
        let ssuffix = SnapshotId::parse(&s.id).unwrap().suffix;
        assert!(!keys.iter().any(|k| k.contains(&ssuffix)));
    });
}
