//! Publications: one writer node or many readers, fencing a node that still holds the image,
//! the secrets each request carries, and the times of the RPCs.

use std::collections::{BTreeMap, HashMap};

use moor_controller::service::ControllerService;
use moor_proto::csi::v1 as csi;
use tonic::Code;

use super::*;

#[test]
fn a_volume_is_published_at_one_writer_node_or_many_readers() {
    let Some(env) = Env::get() else {
        return;
    };
    let b = env.backend(false);
    let mut cleanup = Cleanup::new(&env, &b);
    secrets::scope(env.secrets(), || {
        let v = b
            .create_volume(&new_volume(&env, &name("publish"), 8 * MIB, None))
            .unwrap();
        cleanup.volume(&v.id);
        let id = VolumeId::parse(&v.id).unwrap();
        let started = Instant::now();
        let ctx = b
            .publish_volume(&publish(
                &v.id,
                "node-a",
                AccessMode::SingleNodeWriter,
                false,
            ))
            .unwrap();
        eprintln!("timing: publish {}", ms(started.elapsed()));
        assert_eq!(ctx["rbdPool"], env.pool);
        assert_eq!(ctx["rbdImage"], id.image());
        assert_eq!(ctx["rbdMonitors"], env.mon_host);
        assert_eq!(ctx["rbdClusterID"], CLUSTER_ID);
        assert_eq!(ctx["rbdReadOnly"], "false");
        // Idempotent at the same node.
        assert_eq!(
            b.publish_volume(&publish(
                &v.id,
                "node-a",
                AccessMode::SingleNodeWriter,
                false
            ))
            .unwrap(),
            ctx
        );
        // The same node read-only: ALREADY_EXISTS.
        let e = b
            .publish_volume(&publish(
                &v.id,
                "node-a",
                AccessMode::SingleNodeWriter,
                true,
            ))
            .unwrap_err();
        assert!(matches!(e, Error::PublishedIncompatible { .. }), "{e}");
        // A second node: FAILED_PRECONDITION, however it asks.
        for mode in [
            AccessMode::SingleNodeWriter,
            AccessMode::MultiNodeReaderOnly,
        ] {
            let e = b
                .publish_volume(&publish(&v.id, "node-b", mode, false))
                .unwrap_err();
            assert!(matches!(e, Error::PublishedElsewhere { .. }), "{e}");
            assert_eq!(e.code(), Code::FailedPrecondition);
        }
        assert_eq!(
            b.get_volume(&v.id).unwrap().published_nodes,
            vec!["node-a".to_string()]
        );
        // Not deletable while published.
        assert!(matches!(
            b.delete_volume(&v.id),
            Err(Error::VolumeInUse { .. })
        ));
        // The publication survives the controller: a new backend sees it.
        let restarted = env.backend(false);
        let e = restarted
            .publish_volume(&publish(
                &v.id,
                "node-b",
                AccessMode::SingleNodeWriter,
                false,
            ))
            .unwrap_err();
        assert!(matches!(e, Error::PublishedElsewhere { .. }), "{e}");
        // Unpublished at node-a (nothing held it: no fencing), node-b may have it.
        let started = Instant::now();
        b.unpublish_volume(&v.id, Some("node-a")).unwrap();
        eprintln!("timing: unpublish {}", ms(started.elapsed()));
        b.unpublish_volume(&v.id, Some("node-a")).unwrap();
        b.publish_volume(&publish(
            &v.id,
            "node-b",
            AccessMode::SingleNodeWriter,
            false,
        ))
        .unwrap();
        b.unpublish_volume(&v.id, None).unwrap();
        assert!(b.get_volume(&v.id).unwrap().published_nodes.is_empty());

        // Many readers.
        let mut nodes = Vec::new();
        for n in ["r1", "r2", "r3"] {
            let ctx = b
                .publish_volume(&publish(&v.id, n, AccessMode::MultiNodeReaderOnly, false))
                .unwrap();
            assert_eq!(ctx["rbdReadOnly"], "true");
            nodes.push(n.to_string());
        }
        assert_eq!(b.get_volume(&v.id).unwrap().published_nodes, nodes);
        // No writer while readers have it.
        let e = b
            .publish_volume(&publish(&v.id, "w", AccessMode::SingleNodeWriter, false))
            .unwrap_err();
        assert!(matches!(e, Error::PublishedElsewhere { .. }), "{e}");
        b.unpublish_volume(&v.id, Some("r2")).unwrap();
        assert_eq!(
            b.get_volume(&v.id).unwrap().published_nodes,
            vec!["r1".to_string(), "r3".to_string()]
        );
        b.unpublish_volume(&v.id, None).unwrap();
        // Modes an image cannot serve are refused.
        let e = b
            .publish_volume(&publish(
                &v.id,
                "x",
                AccessMode::MultiNodeMultiWriter,
                false,
            ))
            .unwrap_err();
        assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
        // Unknown volumes.
        let e = b
            .publish_volume(&publish(
                "rbd/live/moor/moor-vol-000000000000000000000000",
                "n",
                AccessMode::SingleNodeWriter,
                false,
            ))
            .unwrap_err();
        assert!(matches!(e, Error::VolumeNotFound(_)), "{e}");
        b.unpublish_volume("rbd/live/moor/moor-vol-000000000000000000000000", None)
            .unwrap();
    });
}

#[test]
fn unpublishing_a_node_that_still_holds_the_image_fences_it() {
    let Some(env) = Env::get() else {
        return;
    };
    let b = env.backend(false);
    let mut cleanup = Cleanup::new(&env, &b);
    let v = secrets::scope(env.secrets(), || {
        b.create_volume(&new_volume(&env, &name("fence"), 8 * MIB, None))
            .unwrap()
    });
    cleanup.volume(&v.id);
    let image = VolumeId::parse(&v.id).unwrap().image();
    secrets::scope(env.secrets(), || {
        b.publish_volume(&publish(
            &v.id,
            "node-a",
            AccessMode::SingleNodeWriter,
            false,
        ))
        .unwrap();
    });

    // Node A maps the image: a client of its own holds it open, takes the lock, writes.
    let node_a = env.client();
    let at_a = node_a.pool(&env.pool).unwrap().open_image(&image).unwrap();
    at_a.acquire_exclusive_lock().unwrap();
    at_a.write(0, b"written by node A").unwrap();
    at_a.flush().unwrap();
    let a_address = at_a
        .watchers()
        .unwrap()
        .into_iter()
        .find(|w| u64::try_from(w.client_id).ok() == Some(node_a.instance_id()))
        .expect("node A watches the image")
        .address;
    cleanup.fenced.push(a_address.clone());

    // Node A dies holding it; the CO force-detaches (ControllerUnpublishVolume at node A).
    let started = Instant::now();
    secrets::scope(env.secrets(), || b.unpublish_volume(&v.id, Some("node-a"))).unwrap();
    eprintln!("timing: unpublish with fencing {}", ms(started.elapsed()));

    // Node A's late writes fail: it is blocklisted.
    let e = at_a.write(4096, b"late write from A").unwrap_err();
    assert_eq!(e.errno(), Some(libc::ESHUTDOWN), "{e}");
    // The fencing is recorded with the volume.
    let rec = moor_controller::rbd::records::Registry::new(&env.pool())
        .volume(&VolumeId::parse(&v.id).unwrap().suffix)
        .unwrap()
        .unwrap();
    assert_eq!(rec.fencings.len(), 1, "{:?}", rec.fencings);
    assert_eq!(rec.fencings[0].node_id, "node-a");
    assert_eq!(rec.fencings[0].addresses, vec![a_address.clone()]);

    // Node B gets the volume, takes the lock at once, and sees A's data but not the late
    // write. Then it goes the same way, mapped but idle (it watches the image, holds no
    // lock): fenced too, its first write after the force-detach fails.
    secrets::scope(env.secrets(), || {
        b.publish_volume(&publish(
            &v.id,
            "node-b",
            AccessMode::SingleNodeWriter,
            false,
        ))
        .unwrap();
    });
    let node_b = env.client();
    let at_b = node_b.pool(&env.pool).unwrap().open_image(&image).unwrap();
    at_b.acquire_exclusive_lock().unwrap();
    assert_eq!(at_b.read(0, 17).unwrap(), b"written by node A");
    assert_eq!(at_b.read(4096, 17).unwrap(), vec![0u8; 17]);
    at_b.write(4096, b"written by node B").unwrap();
    at_b.flush().unwrap();
    at_b.release_lock().unwrap();
    drop(at_b);
    let idle = node_b.pool(&env.pool).unwrap().open_image(&image).unwrap();
    assert_eq!(idle.read(4096, 17).unwrap(), b"written by node B");
    let b_address = idle
        .watchers()
        .unwrap()
        .into_iter()
        .find(|w| u64::try_from(w.client_id).ok() == Some(node_b.instance_id()))
        .expect("node B watches the image")
        .address;
    cleanup.fenced.push(b_address.clone());
    secrets::scope(env.secrets(), || b.unpublish_volume(&v.id, Some("node-b"))).unwrap();
    let e = idle.write(0, b"late write from B").unwrap_err();
    assert_eq!(e.errno(), Some(libc::ESHUTDOWN), "{e}");
    drop(idle);
    drop(at_a);
    drop(node_a);
    let observer = env.client();
    let at = observer
        .pool(&env.pool)
        .unwrap()
        .open_image(&image)
        .unwrap();
    assert_eq!(at.read(0, 17).unwrap(), b"written by node A");
}

#[test]
fn a_clean_unpublish_fences_no_one() {
    let Some(env) = Env::get() else {
        return;
    };
    let b = env.backend(false);
    let mut cleanup = Cleanup::new(&env, &b);
    secrets::scope(env.secrets(), || {
        let v = b
            .create_volume(&new_volume(&env, &name("clean"), 8 * MIB, None))
            .unwrap();
        cleanup.volume(&v.id);
        let image = VolumeId::parse(&v.id).unwrap().image();
        b.publish_volume(&publish(
            &v.id,
            "node-a",
            AccessMode::SingleNodeWriter,
            false,
        ))
        .unwrap();
        let node = env.client();
        {
            // Mapped, written, unmapped before the CO unpublishes.
            let at = node.pool(&env.pool).unwrap().open_image(&image).unwrap();
            at.acquire_exclusive_lock().unwrap();
            at.write(0, b"data").unwrap();
            at.close().unwrap();
        }
        b.unpublish_volume(&v.id, Some("node-a")).unwrap();
        let rec = moor_controller::rbd::records::Registry::new(&env.pool())
            .volume(&VolumeId::parse(&v.id).unwrap().suffix)
            .unwrap()
            .unwrap();
        assert!(rec.fencings.is_empty(), "{:?}", rec.fencings);
        // The node's client can still write (it was not blocklisted).
        let at = node.pool(&env.pool).unwrap().open_image(&image).unwrap();
        at.write(0, b"more").unwrap();
        at.flush().unwrap();
    });
}

/// Through the gRPC service: the request's secrets reach the backend, and the codes are the
/// spec's.
#[tokio::test]
async fn the_service_passes_each_requests_secrets_to_the_backend() {
    use csi::controller_server::Controller;
    use csi::volume_capability::{AccessMode as CsiMode, AccessType as CsiType, MountVolume};
    let Some(env) = Env::get() else {
        return;
    };
    let svc = ControllerService::new(std::sync::Arc::new(env.backend(false)));
    let secrets: HashMap<String, String> = HashMap::from([
        ("userID".to_string(), env.user.clone()),
        ("userKey".to_string(), env.key_text()),
    ]);
    let params: HashMap<String, String> = env.params().into_iter().collect();
    let req = |secrets: HashMap<String, String>| csi::CreateVolumeRequest {
        name: name("grpc"),
        capacity_range: Some(csi::CapacityRange {
            required_bytes: (8 * MIB) as i64,
            limit_bytes: 0,
        }),
        volume_capabilities: vec![csi::VolumeCapability {
            access_mode: Some(CsiMode {
                mode: csi::volume_capability::access_mode::Mode::SingleNodeWriter as i32,
            }),
            access_type: Some(CsiType::Mount(MountVolume::default())),
        }],
        parameters: params.clone(),
        secrets,
        ..Default::default()
    };
    let e = svc
        .create_volume(tonic::Request::new(req(HashMap::new())))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains("secrets"), "{}", e.message());
    let v = svc
        .create_volume(tonic::Request::new(req(secrets.clone())))
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap();
    assert!(v.volume_id.starts_with("rbd/live/"), "{}", v.volume_id);
    // A controller that never had credentials for the cluster cannot delete without them.
    let fresh = ControllerService::new(std::sync::Arc::new(env.backend(false)));
    let e = fresh
        .delete_volume(tonic::Request::new(csi::DeleteVolumeRequest {
            volume_id: v.volume_id.clone(),
            secrets: HashMap::new(),
        }))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    svc.delete_volume(tonic::Request::new(csi::DeleteVolumeRequest {
        volume_id: v.volume_id.clone(),
        secrets,
    }))
    .await
    .unwrap();
}

/// Not a check: the costs the report quotes, printed (run with --nocapture).
#[test]
fn timings() {
    let Some(env) = Env::get() else {
        return;
    };
    let b = env.backend(false);
    let mut cleanup = Cleanup::new(&env, &b);
    secrets::scope(env.secrets(), || {
        let rounds: u32 = 5;
        let mut t: BTreeMap<&str, Duration> = BTreeMap::new();
        for i in 0..rounds {
            let started = Instant::now();
            let v = b
                .create_volume(&new_volume(&env, &name(&format!("t{i}")), 1 << 30, None))
                .unwrap();
            *t.entry("create 1 GiB").or_default() += started.elapsed();
            cleanup.volume(&v.id);
            let started = Instant::now();
            b.publish_volume(&publish(&v.id, "n", AccessMode::SingleNodeWriter, false))
                .unwrap();
            *t.entry("publish").or_default() += started.elapsed();
            let started = Instant::now();
            b.unpublish_volume(&v.id, None).unwrap();
            *t.entry("unpublish").or_default() += started.elapsed();
            let started = Instant::now();
            let s = b
                .create_snapshot(&NewSnapshot {
                    name: name("ts"),
                    source_volume_id: v.id.clone(),
                    parameters: Parameters::new(),
                })
                .unwrap();
            *t.entry("snapshot").or_default() += started.elapsed();
            cleanup.snapshot(&s.id);
            let started = Instant::now();
            let c = b
                .create_volume(&new_volume(
                    &env,
                    &name("tc"),
                    1 << 30,
                    Some(ContentSource::Snapshot(s.id.clone())),
                ))
                .unwrap();
            *t.entry("clone from snapshot").or_default() += started.elapsed();
            let started = Instant::now();
            b.delete_volume(&c.id).unwrap();
            *t.entry("delete clone").or_default() += started.elapsed();
            let started = Instant::now();
            b.delete_snapshot(&s.id).unwrap();
            *t.entry("delete snapshot").or_default() += started.elapsed();
            let started = Instant::now();
            b.delete_volume(&v.id).unwrap();
            *t.entry("delete 1 GiB").or_default() += started.elapsed();
        }
        for (what, total) in t {
            eprintln!("timing: {what} {} (mean of {rounds})", ms(total / rounds));
        }
    });
}
