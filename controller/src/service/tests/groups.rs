//! CreateVolumeGroupSnapshot, GetVolumeGroupSnapshot, DeleteVolumeGroupSnapshot, and the
//! members as ordinary snapshots.

use csi::group_controller_server::GroupController as _;

use super::*;

fn create_group(name: &str, volumes: &[&str]) -> csi::CreateVolumeGroupSnapshotRequest {
    csi::CreateVolumeGroupSnapshotRequest {
        name: name.into(),
        source_volume_ids: volumes.iter().map(|v| v.to_string()).collect(),
        ..Default::default()
    }
}

impl Fx {
    async fn group(
        &self,
        name: &str,
        volumes: &[&str],
    ) -> Result<csi::VolumeGroupSnapshot, Status> {
        self.svc
            .create_volume_group_snapshot(Request::new(create_group(name, volumes)))
            .await
            .map(|r| r.into_inner().group_snapshot.unwrap())
    }

    async fn get_group(
        &self,
        id: &str,
        members: &[String],
    ) -> Result<csi::VolumeGroupSnapshot, Status> {
        self.svc
            .get_volume_group_snapshot(Request::new(csi::GetVolumeGroupSnapshotRequest {
                group_snapshot_id: id.into(),
                snapshot_ids: members.to_vec(),
                ..Default::default()
            }))
            .await
            .map(|r| r.into_inner().group_snapshot.unwrap())
    }

    async fn delete_group(&self, id: &str, members: &[String]) -> Result<(), Status> {
        self.svc
            .delete_volume_group_snapshot(Request::new(csi::DeleteVolumeGroupSnapshotRequest {
                group_snapshot_id: id.into(),
                snapshot_ids: members.to_vec(),
                ..Default::default()
            }))
            .await
            .map(drop)
    }

    async fn list_snapshots(&self) -> Vec<csi::Snapshot> {
        self.svc
            .list_snapshots(Request::new(csi::ListSnapshotsRequest::default()))
            .await
            .unwrap()
            .into_inner()
            .entries
            .into_iter()
            .filter_map(|e| e.snapshot)
            .collect()
    }
}

fn ids(g: &csi::VolumeGroupSnapshot) -> Vec<String> {
    g.snapshots.iter().map(|s| s.snapshot_id.clone()).collect()
}

#[tokio::test]
async fn capabilities() {
    let fx = Fx::new("svc-group-caps");
    let caps = fx
        .svc
        .group_controller_get_capabilities(Request::new(
            csi::GroupControllerGetCapabilitiesRequest {},
        ))
        .await
        .unwrap()
        .into_inner()
        .capabilities;
    use csi::group_controller_service_capability::{Rpc, Type, rpc};
    assert_eq!(
        caps,
        vec![csi::GroupControllerServiceCapability {
            r#type: Some(Type::Rpc(Rpc {
                r#type: rpc::Type::CreateDeleteGetVolumeGroupSnapshot as i32
            }))
        }]
    );
}

#[tokio::test]
async fn create_group_rows() {
    let fx = Fx::new("svc-group-create");
    let a = fx.create("pvc-a", 2 * MIB).await;
    let b = fx.create("pvc-b", 4 * MIB).await;
    let c = fx.create("pvc-c", 2 * MIB).await;
    assert_invalid(fx.group("", &[&a.volume_id]).await, "name");
    assert_invalid(fx.group("g", &[]).await, "source_volume_ids");
    assert_invalid(
        fx.group("g", &[&a.volume_id, &a.volume_id]).await,
        "source_volume_ids",
    );
    assert_code(
        fx.group("g", &[&a.volume_id, "vol-00000000000000aa"]).await,
        Code::NotFound,
    );
    let mut with_params = create_group("g", &[&a.volume_id]);
    with_params
        .parameters
        .insert("consistency".into(), "crash".into());
    assert_invalid(
        fx.svc
            .create_volume_group_snapshot(Request::new(with_params))
            .await,
        "parameters",
    );

    fx.write_at(&a.volume_id, 0, b"alpha");
    fx.write_at(&b.volume_id, 0, b"beta");
    let g = fx.group("g", &[&a.volume_id, &b.volume_id]).await.unwrap();
    assert!(g.group_snapshot_id.starts_with("group-"));
    assert!(g.ready_to_use);
    assert!(g.creation_time.is_some());
    assert_eq!(g.snapshots.len(), 2);
    for (s, v) in g.snapshots.iter().zip([&a, &b]) {
        assert_eq!(s.source_volume_id, v.volume_id);
        assert_eq!(s.group_snapshot_id, g.group_snapshot_id);
        assert!(s.ready_to_use);
        assert_eq!(s.creation_time, g.creation_time);
    }
    // Idempotent by name, whatever the order of the volumes.
    assert_eq!(
        fx.group("g", &[&b.volume_id, &a.volume_id]).await.unwrap(),
        g
    );
    assert_code(
        fx.group("g", &[&a.volume_id, &c.volume_id]).await,
        Code::AlreadyExists,
    );
    // ListSnapshots shows the members with their group.
    let listed = fx.list_snapshots().await;
    assert_eq!(listed.len(), 2);
    assert!(
        listed
            .iter()
            .all(|s| s.group_snapshot_id == g.group_snapshot_id)
    );
    // A lone snapshot named like a member is another snapshot.
    let member_name = format!("g/{}", a.volume_id);
    let lone = fx.snapshot(&member_name, &a.volume_id).await.unwrap();
    assert!(!ids(&g).contains(&lone.snapshot_id));
    assert_eq!(lone.group_snapshot_id, "");

    // Each member is a volume source on its own, holding its volume's data at the cut.
    fx.write_at(&b.volume_id, 0, b"later");
    let mut from_member = create_req("restored-b", 4 * MIB);
    from_member.volume_content_source = Some(csi::VolumeContentSource {
        r#type: Some(csi::volume_content_source::Type::Snapshot(
            csi::volume_content_source::SnapshotSource {
                snapshot_id: g.snapshots[1].snapshot_id.clone(),
            },
        )),
    });
    let restored = fx.created(from_member).await;
    assert_eq!(restored.capacity_bytes, 4 * MIB);
    let data = std::fs::read(fx.volume_path(&restored.volume_id)).unwrap();
    assert_eq!(&data[..4], b"beta");
    assert!(data[4..].iter().all(|&x| x == 0));
}

#[tokio::test]
async fn in_use_members_whose_writes_cannot_be_held_are_refused() {
    let fx = Fx::new("svc-group-in-use");
    let a = fx.create("pvc-a", 2 * MIB).await;
    let b = fx.create("pvc-b", 2 * MIB).await;
    // Read-only: nothing writes through it.
    let mut ro = publish_req(&a.volume_id, NODE);
    ro.readonly = true;
    fx.svc
        .controller_publish_volume(Request::new(ro))
        .await
        .unwrap();
    fx.group("ro", &[&a.volume_id, &b.volume_id]).await.unwrap();
    // Read-write, and no filesystem of it that the controller could freeze.
    fx.publish(&b.volume_id).await.unwrap();
    let s = assert_code(
        fx.group("rw", &[&a.volume_id, &b.volume_id]).await,
        Code::FailedPrecondition,
    );
    assert!(s.message().contains(&b.volume_id), "{}", s.message());
    // Nothing was left behind.
    assert_eq!(fx.list_snapshots().await.len(), 2);
    let tmp: Vec<_> = std::fs::read_dir(&fx.backend.layout().tmp)
        .unwrap()
        .collect();
    assert!(tmp.is_empty(), "{tmp:?}");
}

#[tokio::test]
async fn get_and_delete_group_rows() {
    let fx = Fx::new("svc-group-get");
    let a = fx.create("pvc-a", 2 * MIB).await;
    let b = fx.create("pvc-b", 2 * MIB).await;
    assert_invalid(fx.get_group("", &[]).await, "group_snapshot_id");
    assert_invalid(fx.delete_group("", &[]).await, "group_snapshot_id");
    assert_code(
        fx.get_group("group-00000000000000aa", &[]).await,
        Code::NotFound,
    );
    assert_code(fx.get_group("nope", &[]).await, Code::NotFound);
    fx.delete_group("group-00000000000000aa", &[])
        .await
        .unwrap();
    fx.delete_group("nope", &[]).await.unwrap();

    let g = fx.group("g", &[&a.volume_id, &b.volume_id]).await.unwrap();
    let members = ids(&g);
    assert_eq!(
        fx.get_group(&g.group_snapshot_id, &members).await.unwrap(),
        g
    );
    let reversed: Vec<String> = members.iter().rev().cloned().collect();
    assert_eq!(
        fx.get_group(&g.group_snapshot_id, &reversed).await.unwrap(),
        g
    );
    assert_eq!(fx.get_group(&g.group_snapshot_id, &[]).await.unwrap(), g);
    let wrong = vec![members[0].clone(), "snap-00000000000000aa".to_string()];
    assert_invalid(
        fx.get_group(&g.group_snapshot_id, &wrong).await,
        "snapshot_ids",
    );
    assert_invalid(
        fx.delete_group(&g.group_snapshot_id, &wrong).await,
        "snapshot_ids",
    );

    // A member deleted on its own leaves the rest of the group.
    fx.svc
        .delete_snapshot(Request::new(csi::DeleteSnapshotRequest {
            snapshot_id: members[0].clone(),
            ..Default::default()
        }))
        .await
        .unwrap();
    let left = fx.get_group(&g.group_snapshot_id, &members).await.unwrap();
    assert_eq!(ids(&left), vec![members[1].clone()]);

    fx.delete_group(&g.group_snapshot_id, &members)
        .await
        .unwrap();
    assert_code(
        fx.get_group(&g.group_snapshot_id, &members).await,
        Code::NotFound,
    );
    assert!(fx.list_snapshots().await.is_empty());
    let files: Vec<_> = std::fs::read_dir(&fx.backend.layout().snapshots)
        .unwrap()
        .collect();
    assert!(files.is_empty(), "{files:?}");
    fx.delete_group(&g.group_snapshot_id, &members)
        .await
        .unwrap();
}

#[tokio::test]
async fn groups_survive_a_restart_and_unfinished_ones_are_undone() {
    let fx = Fx::new("svc-group-restart");
    let a = fx.create("pvc-a", 2 * MIB).await;
    let b = fx.create("pvc-b", 2 * MIB).await;
    let g = fx.group("g", &[&a.volume_id, &b.volume_id]).await.unwrap();
    // What a crash between the members' records and the group's leaves: a second group's
    // member records, no group record.
    let h = fx.group("h", &[&a.volume_id]).await.unwrap();
    let records = fx.backend.layout().root.join("records");
    std::fs::remove_file(
        records
            .join("groups")
            .join(format!("{}.json", h.group_snapshot_id)),
    )
    .unwrap();
    let fx = fx.reopen_as(NODE);
    assert_eq!(
        fx.get_group(&g.group_snapshot_id, &ids(&g)).await.unwrap(),
        g
    );
    assert_code(
        fx.get_group(&h.group_snapshot_id, &[]).await,
        Code::NotFound,
    );
    let listed = fx.list_snapshots().await;
    assert_eq!(listed.len(), 2, "{listed:?}");
    let orphan = fx
        .backend
        .layout()
        .snapshots
        .join(format!("{}.img", h.snapshots[0].snapshot_id));
    assert!(!orphan.exists());
    // The retry cuts it afresh.
    let again = fx.group("h", &[&a.volume_id]).await.unwrap();
    assert_ne!(again.group_snapshot_id, h.group_snapshot_id);
}
