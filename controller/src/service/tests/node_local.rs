//! A node-local controller (`--node-local`), one on each node: its ids name its node, it does
//! not announce what the CO must not do through it, and it answers for an id of another
//! node with where that node is: a volume cannot be made here from a source there.

use super::*;
use crate::backend::Backend as _;
use crate::embedded::Policy;
use csi::group_controller_server::GroupController as _;
use csi::volume_content_source::{SnapshotSource, Type as SourceType, VolumeSource};

fn node_local(tag: &str, node: &str) -> Fx {
    Fx::open_with(
        TestDir::new(tag),
        Arc::new(FakeAttacher::new()),
        node,
        Policy {
            node_local: true,
            ..Policy::default()
        },
    )
}

fn from_snapshot(name: &str, snapshot: &str) -> csi::CreateVolumeRequest {
    let mut r = create_req(name, 4 * MIB);
    r.volume_content_source = Some(csi::VolumeContentSource {
        r#type: Some(SourceType::Snapshot(SnapshotSource {
            snapshot_id: snapshot.into(),
        })),
    });
    r
}

fn from_volume(name: &str, volume: &str) -> csi::CreateVolumeRequest {
    let mut r = create_req(name, 4 * MIB);
    r.volume_content_source = Some(csi::VolumeContentSource {
        r#type: Some(SourceType::Volume(VolumeSource {
            volume_id: volume.into(),
        })),
    });
    r
}

#[tokio::test]
async fn ids_name_their_node_and_what_the_co_must_not_do_is_not_announced() {
    use csi::controller_service_capability::rpc;
    let fx = node_local("svc-local-ids", NODE);
    let v = fx.create("pvc-a", 4 * MIB).await;
    assert!(v.volume_id.ends_with("@node-1"), "{}", v.volume_id);
    assert_eq!(v.accessible_topology, vec![topo(NODE)]);
    let s = fx.snapshot("snap-a", &v.volume_id).await.unwrap();
    assert!(s.snapshot_id.ends_with("@node-1"), "{}", s.snapshot_id);
    assert_eq!(s.source_volume_id, v.volume_id);
    // Ids come back as they went out: restores, clones, listings, deletes.
    let r = fx.created(from_snapshot("pvc-r", &s.snapshot_id)).await;
    let c = fx.created(from_volume("pvc-c", &v.volume_id)).await;
    for id in [&r.volume_id, &c.volume_id] {
        assert!(id.ends_with("@node-1"), "{id}");
    }
    let listed: Vec<String> = fx
        .svc
        .list_snapshots(Request::new(csi::ListSnapshotsRequest {
            source_volume_id: v.volume_id.clone(),
            ..Default::default()
        }))
        .await
        .unwrap()
        .into_inner()
        .entries
        .into_iter()
        .filter_map(|e| e.snapshot.map(|s| s.snapshot_id))
        .collect();
    assert_eq!(listed, vec![s.snapshot_id.clone()]);
    // The host form of the same id is not this controller's.
    let bare = v.volume_id.split('@').next().unwrap();
    assert_code(
        fx.svc
            .controller_get_volume(Request::new(csi::ControllerGetVolumeRequest {
                volume_id: bare.into(),
            }))
            .await,
        Code::NotFound,
    );
    let caps = announced(&fx).await;
    for t in [
        rpc::Type::PublishUnpublishVolume,
        rpc::Type::ExpandVolume,
        rpc::Type::ListVolumesPublishedNodes,
    ] {
        assert!(!caps.contains(&t), "{t:?} announced");
    }
    for t in [
        rpc::Type::CreateDeleteVolume,
        rpc::Type::GetCapacity,
        rpc::Type::CreateDeleteSnapshot,
        rpc::Type::CloneVolume,
        rpc::Type::GetVolume,
    ] {
        assert!(caps.contains(&t), "{t:?} not announced");
    }
    // Still served, for moor-node on the node: attach and grow.
    let ctx = fx.publish(&v.volume_id).await.unwrap();
    assert!(ctx.contains_key(DEVICE_PATH_KEY));
    fx.svc
        .controller_expand_volume(Request::new(expand_req(&v.volume_id, 8 * MIB)))
        .await
        .unwrap();
    for id in [&r.volume_id, &c.volume_id] {
        fx.svc
            .delete_volume(Request::new(csi::DeleteVolumeRequest {
                volume_id: id.clone(),
                ..Default::default()
            }))
            .await
            .unwrap();
    }
}

/// Two nodes, each with its controller: what lives on one is answered for on the other,
/// saying where it is, and nothing is made or deleted across them.
#[tokio::test]
async fn what_lives_on_another_node_is_refused_there_with_where_it_is() {
    let one = node_local("svc-local-one", NODE);
    let two = node_local("svc-local-two", "node-2");
    let v = one.create("pvc-a", 4 * MIB).await;
    let s = one.snapshot("snap-a", &v.volume_id).await.unwrap();
    // A restore or a clone placed on the other node: RESOURCE_EXHAUSTED, so the provisioner
    // has the scheduler choose again; the message names the node the source lives on.
    for r in [
        from_snapshot("pvc-r", &s.snapshot_id),
        from_volume("pvc-c", &v.volume_id),
    ] {
        let e = assert_code(
            two.svc.create_volume(Request::new(r)).await,
            Code::ResourceExhausted,
        );
        assert!(
            e.message().contains("lives on node \"node-1\"") && e.message().contains("node-2"),
            "{}",
            e.message()
        );
    }
    assert!(
        two.backend
            .list_volumes(&Default::default())
            .unwrap()
            .entries
            .is_empty(),
        "nothing made on the other node"
    );
    // Reads and uses: NOT_FOUND, saying where.
    let e = assert_code(
        two.svc
            .controller_get_volume(Request::new(csi::ControllerGetVolumeRequest {
                volume_id: v.volume_id.clone(),
            }))
            .await,
        Code::NotFound,
    );
    assert!(e.message().contains("node-1"), "{}", e.message());
    assert_code(
        two.svc
            .controller_publish_volume(Request::new(publish_req(&v.volume_id, "node-2")))
            .await,
        Code::NotFound,
    );
    assert_code(two.snapshot("snap-x", &v.volume_id).await, Code::NotFound);
    assert_code(
        two.svc
            .create_volume_group_snapshot(Request::new(csi::CreateVolumeGroupSnapshotRequest {
                name: "g".into(),
                source_volume_ids: vec![v.volume_id.clone()],
                ..Default::default()
            }))
            .await,
        Code::FailedPrecondition,
    );
    // Deletes: never "success" for what lives elsewhere and stays there.
    for e in [
        two.svc
            .delete_volume(Request::new(csi::DeleteVolumeRequest {
                volume_id: v.volume_id.clone(),
                ..Default::default()
            }))
            .await
            .map(|_| ()),
        two.svc
            .delete_snapshot(Request::new(csi::DeleteSnapshotRequest {
                snapshot_id: s.snapshot_id.clone(),
                ..Default::default()
            }))
            .await
            .map(|_| ()),
    ] {
        let e = assert_code(e, Code::FailedPrecondition);
        assert!(
            e.message().contains("only that node's controller"),
            "{}",
            e.message()
        );
    }
    // An unpublish there is success: it is not published there.
    two.svc
        .controller_unpublish_volume(Request::new(csi::ControllerUnpublishVolumeRequest {
            volume_id: v.volume_id.clone(),
            node_id: "node-2".into(),
            ..Default::default()
        }))
        .await
        .unwrap();
    // A listing there does not match it.
    let listed = two
        .svc
        .list_snapshots(Request::new(csi::ListSnapshotsRequest {
            snapshot_id: s.snapshot_id.clone(),
            ..Default::default()
        }))
        .await
        .unwrap()
        .into_inner();
    assert!(listed.entries.is_empty());
    // On its own node, all of it is there.
    one.created(from_snapshot("pvc-r", &s.snapshot_id)).await;
    assert!(one.volume_path(&v.volume_id).exists());
}
