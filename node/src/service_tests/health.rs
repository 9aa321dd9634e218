//! CSI 1.13's health calls: NodeGetVolumeHealth (a staged and published volume, one whose stage
//! failed, one that went bad) and NodeGetStorageHealth (the filesystem behind the loop devices).

use super::*;
use crate::sys::BackingFs;

use csi::{StorageHealthErrorType as S, VolumeHealthErrorType as V};

fn health_req(staging: &str, target: &str) -> csi::NodeGetVolumeHealthRequest {
    csi::NodeGetVolumeHealthRequest {
        volume_id: "vol-1".into(),
        volume_publish_path: target.into(),
        staging_target_path: staging.into(),
    }
}

/// The (status, reason) of each entry NodeGetVolumeHealth gives.
pub(super) async fn health(h: &Harness, staging: &str, target: &str) -> Vec<(V, String)> {
    let r = h
        .svc
        .node_get_volume_health(Request::new(health_req(staging, target)))
        .await
        .expect("volume health")
        .into_inner();
    let vh = r.volume_health.expect("volume_health");
    assert_eq!(vh.volume_id, "vol-1");
    vh.health_statuses
        .into_iter()
        .map(|e| {
            assert!(!e.message.is_empty(), "{e:?}");
            (V::try_from(e.status).expect("a known status"), e.reason)
        })
        .collect()
}

async fn storage(h: &Harness) -> Vec<(S, String)> {
    h.svc
        .node_get_storage_health(Request::new(csi::NodeGetStorageHealthRequest::default()))
        .await
        .expect("storage health")
        .into_inner()
        .backend_health
        .into_iter()
        .map(|b| (S::try_from(b.status).expect("a known status"), b.reason))
        .collect()
}

#[tokio::test]
async fn a_healthy_volume_has_no_entries_and_a_missing_id_is_invalid() {
    let h = harness();
    published(&h).await;
    // As csi-sanity asks: the volume id alone (the paths come from the journal).
    assert_eq!(health(&h, "", "").await, vec![]);
    assert_eq!(health(&h, STAGING, TARGET).await, vec![]);
    let mut no_id = health_req("", "");
    no_id.volume_id.clear();
    assert_eq!(
        code(h.svc.node_get_volume_health(Request::new(no_id))).await,
        Code::InvalidArgument
    );
    // A path outside the kubelet dir is refused, naming the field.
    let s = h
        .svc
        .node_get_volume_health(Request::new(health_req("/etc", "")))
        .await
        .expect_err("outside the kubelet dir");
    assert_eq!(s.code(), Code::InvalidArgument);
    assert!(
        s.message().contains("staging_target_path"),
        "{}",
        s.message()
    );
}

#[tokio::test]
async fn a_volume_that_went_bad_says_how() {
    let h = harness();
    published(&h).await;
    // The target unmounted behind moor's back: inaccessible there.
    h.os.force_unmount(TARGET);
    assert_eq!(
        health(&h, "", "").await,
        vec![(V::Inaccessible, "NotMounted".to_string())]
    );
    // Errors recorded by the filesystem: data loss suspected.
    h.os.fail_filesystem((7, 7), 3, false);
    let got = health(&h, STAGING, "").await;
    assert_eq!(got, vec![(V::DataLoss, "FilesystemErrors".to_string())]);
    // The device gone: inaccessible, whatever else.
    h.os.remove_device(DEV);
    let got = health(&h, STAGING, "").await;
    assert_eq!(got, vec![(V::Inaccessible, "DeviceGone".to_string())]);
}

#[tokio::test]
async fn a_volume_whose_stage_failed_says_why_until_a_stage_works() {
    let h = harness();
    for (offset, bytes) in superblock("ext4") {
        h.os.write_device(DEV, offset, &bytes);
    }
    // e2fsck finds errors it cannot repair unattended: the stage fails, nothing is mounted.
    h.os.fail_tool("e2fsck", 4);
    let s = h
        .svc
        .node_stage_volume(Request::new(stage_req(ext4())))
        .await
        .expect_err("a corrupt filesystem is not staged");
    assert_eq!(s.code(), Code::FailedPrecondition);
    assert_eq!(
        health(&h, STAGING, "").await,
        vec![(V::DataLoss, "FilesystemCorrupt".to_string())]
    );
    // Without paths too: the failure is the volume's, not a path's.
    assert_eq!(
        health(&h, "", "").await,
        vec![(V::DataLoss, "FilesystemCorrupt".to_string())]
    );
    // Repaired by hand (e2fsck passes now): the next stage works and the entry goes.
    staged(&h).await;
    assert_eq!(health(&h, STAGING, "").await, vec![]);
}

#[tokio::test]
async fn a_refused_request_says_nothing_of_the_volume() {
    let h = harness_with(1);
    staged(&h).await;
    let mut other = stage_req(ext4());
    other.volume_id = "vol-2".into();
    other.staging_target_path =
        format!("{K}/plugins/kubernetes.io/csi/moor.csi.io/def/globalmount");
    h.os.add_device("/dev/loop8", (7, 8), GIB);
    other.publish_context = HashMap::from([("devicePath".into(), "/dev/loop8".into())]);
    assert_eq!(
        code(h.svc.node_stage_volume(Request::new(other))).await,
        Code::ResourceExhausted
    );
    let mut q = health_req("", "");
    q.volume_id = "vol-2".into();
    let r = h
        .svc
        .node_get_volume_health(Request::new(q))
        .await
        .expect("volume health")
        .into_inner();
    assert_eq!(
        r.volume_health.expect("volume_health").health_statuses,
        vec![]
    );
}

#[tokio::test]
async fn storage_health_sees_the_filesystem_behind_the_loop_devices() {
    let h = harness();
    h.os.set_backing_file((7, 7), "/var/lib/moor-controller/volumes/vol-1.img");
    staged(&h).await;
    assert_eq!(storage(&h).await, vec![]);
    h.os.set_backing_fs(
        "/var/lib/moor-controller/volumes/vol-1.img",
        BackingFs::Answers {
            read_only: false,
            available_bytes: 0,
        },
    );
    assert_eq!(
        storage(&h).await,
        vec![(S::StorageDegraded, "BackingFilesystemFull".to_string())]
    );
    h.os.set_backing_fs(
        "/var/lib/moor-controller/volumes/vol-1.img",
        BackingFs::Answers {
            read_only: true,
            available_bytes: 1 << 30,
        },
    );
    assert_eq!(
        storage(&h).await,
        vec![(S::StorageDegraded, "BackingFilesystemReadOnly".to_string())]
    );
    h.os.set_backing_fs(
        "/var/lib/moor-controller/volumes/vol-1.img",
        BackingFs::Fails(libc::EIO),
    );
    assert_eq!(
        storage(&h).await,
        vec![(
            S::StorageUnreachable,
            "BackingFilesystemFailing".to_string()
        )]
    );
    // Unstaged: nothing of this node's stands on it any more.
    h.svc
        .node_unstage_volume(Request::new(unstage_req()))
        .await
        .expect("unstage");
    assert_eq!(storage(&h).await, vec![]);
}

#[tokio::test]
async fn a_ceph_cluster_that_does_not_answer_is_unreachable_storage_and_an_inaccessible_volume() {
    let r = super::rbd::rbd_harness();
    r.h.svc
        .node_stage_volume(Request::new(super::rbd::rbd_stage("vol-1", ext4())))
        .await
        .expect("stage");
    assert_eq!(storage(&r.h).await, vec![]);
    assert_eq!(health(&r.h, "", "").await, vec![]);
    r.attacher.set_cluster_away(Some("no monitor answered"));
    assert_eq!(
        storage(&r.h).await,
        vec![(S::StorageUnreachable, "CephClusterUnreachable".to_string())]
    );
    assert_eq!(
        health(&r.h, "", "").await,
        vec![(V::Inaccessible, "StorageUnreachable".to_string())]
    );
    r.attacher.set_cluster_away(None);
    assert_eq!(storage(&r.h).await, vec![]);
}
