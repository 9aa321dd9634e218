//! CreateSnapshot, DeleteSnapshot, ListSnapshots.

use super::*;

#[tokio::test]
async fn create_snapshot_rows() {
    let fx = Fx::new("svc-snap");
    let v = fx.create("pvc-s", 2 * MIB).await;
    let w = fx.create("pvc-w", 2 * MIB).await;
    assert_invalid(fx.snapshot("", &v.volume_id).await, "name");
    assert_invalid(fx.snapshot("s1", "").await, "source_volume_id");
    assert_code(
        fx.snapshot("s1", "vol-00000000000000aa").await,
        Code::NotFound,
    );
    assert_code(fx.snapshot("s1", "nope").await, Code::NotFound);
    let a = fx.snapshot("s1", &v.volume_id).await.unwrap();
    assert!(a.snapshot_id.starts_with("snap-"));
    assert!(a.ready_to_use);
    assert!(a.creation_time.is_some());
    assert_eq!(a.source_volume_id, v.volume_id);
    assert_eq!(fx.snapshot("s1", &v.volume_id).await.unwrap(), a);
    assert_code(fx.snapshot("s1", &w.volume_id).await, Code::AlreadyExists);
    let mut bad = csi::CreateSnapshotRequest {
        source_volume_id: v.volume_id.clone(),
        name: "s2".into(),
        ..Default::default()
    };
    bad.parameters.insert("retention".into(), "7d".into());
    assert_invalid(
        fx.svc.create_snapshot(Request::new(bad.clone())).await,
        "parameters",
    );
    bad.parameters.clear();
    bad.parameters.insert(
        "csi.storage.k8s.io/volumesnapshot/name".into(),
        "snap".into(),
    );
    assert!(fx.svc.create_snapshot(Request::new(bad)).await.is_ok());
    // A snapshot of a published volume flushes its device first.
    fx.publish(&w.volume_id).await.unwrap();
    let before = fx.fake.flushes();
    fx.snapshot("s3", &w.volume_id).await.unwrap();
    assert_eq!(fx.fake.flushes(), before + 1);
    // Snapshots outlive their volume.
    fx.svc
        .delete_volume(Request::new(csi::DeleteVolumeRequest {
            volume_id: v.volume_id.clone(),
            ..Default::default()
        }))
        .await
        .unwrap();
    let got = fx
        .svc
        .get_snapshot(Request::new(csi::GetSnapshotRequest {
            snapshot_id: a.snapshot_id.clone(),
            ..Default::default()
        }))
        .await
        .unwrap()
        .into_inner()
        .snapshot
        .unwrap();
    assert_eq!(got, a);
}

#[tokio::test]
async fn delete_and_get_snapshot_rows() {
    let fx = Fx::new("svc-snap-del");
    let del = |id: &str| csi::DeleteSnapshotRequest {
        snapshot_id: id.into(),
        ..Default::default()
    };
    let get = |id: &str| csi::GetSnapshotRequest {
        snapshot_id: id.into(),
        ..Default::default()
    };
    assert_invalid(
        fx.svc.delete_snapshot(Request::new(del(""))).await,
        "snapshot_id",
    );
    assert_invalid(
        fx.svc.get_snapshot(Request::new(get(""))).await,
        "snapshot_id",
    );
    for unknown in ["snap-00000000000000aa", "x/../y"] {
        fx.svc
            .delete_snapshot(Request::new(del(unknown)))
            .await
            .unwrap();
        assert_code(
            fx.svc.get_snapshot(Request::new(get(unknown))).await,
            Code::NotFound,
        );
    }
    let v = fx.create("pvc-x", MIB).await;
    let s = fx.snapshot("s", &v.volume_id).await.unwrap();
    let file = fx
        .backend
        .layout()
        .snapshots
        .join(format!("{}.img", s.snapshot_id));
    assert!(file.exists());
    fx.svc
        .delete_snapshot(Request::new(del(&s.snapshot_id)))
        .await
        .unwrap();
    assert!(!file.exists());
    fx.svc
        .delete_snapshot(Request::new(del(&s.snapshot_id)))
        .await
        .unwrap();
    assert_code(
        fx.svc.get_snapshot(Request::new(get(&s.snapshot_id))).await,
        Code::NotFound,
    );
}

#[tokio::test]
async fn list_snapshots_filters_and_pages() {
    let fx = Fx::new("svc-snap-list");
    let a = fx.create("pvc-a", MIB).await.volume_id;
    let b = fx.create("pvc-b", MIB).await.volume_id;
    let mut of_a = Vec::new();
    for i in 0..3 {
        of_a.push(fx.snapshot(&format!("a{i}"), &a).await.unwrap().snapshot_id);
    }
    let of_b = fx.snapshot("b0", &b).await.unwrap().snapshot_id;
    of_a.sort();
    let list = |req: csi::ListSnapshotsRequest| async {
        fx.svc
            .list_snapshots(Request::new(req))
            .await
            .map(|r| r.into_inner())
    };
    let ids = |r: &csi::ListSnapshotsResponse| -> Vec<String> {
        r.entries
            .iter()
            .map(|e| e.snapshot.as_ref().unwrap().snapshot_id.clone())
            .collect()
    };
    let all = list(Default::default()).await.unwrap();
    assert_eq!(all.entries.len(), 4);
    let by_source = list(csi::ListSnapshotsRequest {
        source_volume_id: a.clone(),
        ..Default::default()
    })
    .await
    .unwrap();
    assert_eq!(ids(&by_source), of_a);
    let one = list(csi::ListSnapshotsRequest {
        snapshot_id: of_b.clone(),
        ..Default::default()
    })
    .await
    .unwrap();
    assert_eq!(ids(&one), vec![of_b.clone()]);
    for nothing in [
        csi::ListSnapshotsRequest {
            snapshot_id: "snap-00000000000000aa".into(),
            ..Default::default()
        },
        csi::ListSnapshotsRequest {
            snapshot_id: "not-ours".into(),
            ..Default::default()
        },
        csi::ListSnapshotsRequest {
            snapshot_id: of_b.clone(),
            source_volume_id: a.clone(),
            ..Default::default()
        },
        csi::ListSnapshotsRequest {
            source_volume_id: "vol-00000000000000aa".into(),
            ..Default::default()
        },
    ] {
        assert!(list(nothing).await.unwrap().entries.is_empty());
    }
    let mut got = Vec::new();
    let mut token = String::new();
    loop {
        let page = list(csi::ListSnapshotsRequest {
            source_volume_id: a.clone(),
            max_entries: 2,
            starting_token: token.clone(),
            ..Default::default()
        })
        .await
        .unwrap();
        got.extend(ids(&page));
        if page.next_token.is_empty() {
            break;
        }
        token = page.next_token;
    }
    assert_eq!(got, of_a);
    assert_code(
        list(csi::ListSnapshotsRequest {
            starting_token: "bogus".into(),
            ..Default::default()
        })
        .await,
        Code::Aborted,
    );
    assert_invalid(
        list(csi::ListSnapshotsRequest {
            max_entries: -5,
            ..Default::default()
        })
        .await,
        "max_entries",
    );
}
