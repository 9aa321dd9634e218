//! NodeGetVolumeStats: usage, condition, a vanished device, block volumes.

use super::*;

#[tokio::test]
async fn stats_report_usage_and_condition() {
    let h = harness();
    staged(&h).await;
    h.svc
        .node_publish_volume(Request::new(publish_req(ext4(), false)))
        .await
        .expect("publish");
    let r = h
        .svc
        .node_get_volume_stats(Request::new(stats_req(TARGET)))
        .await
        .expect("stats")
        .into_inner();
    assert_eq!(r.usage.len(), 2);
    assert_eq!(r.usage[0].total, GIB as i64);
    assert!(!r.volume_condition.expect("condition").abnormal);
    // Unmounted behind moor's back: abnormal, with a message.
    h.os.force_unmount(TARGET);
    let r = h
        .svc
        .node_get_volume_stats(Request::new(stats_req(TARGET)))
        .await
        .expect("stats")
        .into_inner();
    let c = r.volume_condition.expect("condition");
    assert!(c.abnormal && c.message.contains("not mounted"), "{c:?}");
    // Corrupted: abnormal.
    h.os.corrupt(STAGING, libc::ENOTCONN);
    let r = h
        .svc
        .node_get_volume_stats(Request::new(stats_req(STAGING)))
        .await
        .expect("stats")
        .into_inner();
    assert!(r.volume_condition.expect("condition").abnormal);
    // Unknown path: NOT_FOUND. Missing fields: INVALID_ARGUMENT.
    assert_eq!(
        code(
            h.svc
                .node_get_volume_stats(Request::new(stats_req(&format!("{K}/pods/x/mount"))))
        )
        .await,
        Code::NotFound
    );
    assert_eq!(
        code(h.svc.node_get_volume_stats(Request::new(stats_req("")))).await,
        Code::InvalidArgument
    );
}

#[tokio::test]
async fn stats_see_a_vanished_device() {
    let h = harness();
    staged(&h).await;
    h.os.remove_device(DEV);
    let r = h
        .svc
        .node_get_volume_stats(Request::new(stats_req(STAGING)))
        .await
        .expect("stats")
        .into_inner();
    let c = r.volume_condition.expect("condition");
    assert!(c.abnormal && c.message.contains("gone"), "{c:?}");
}

#[tokio::test]
async fn block_stats_report_the_device_size() {
    let h = harness();
    h.svc
        .node_stage_volume(Request::new(stage_req(block_cap())))
        .await
        .expect("stage");
    let r = h
        .svc
        .node_get_volume_stats(Request::new(stats_req(STAGING)))
        .await
        .expect("stats")
        .into_inner();
    assert_eq!(r.usage.len(), 1);
    assert_eq!(r.usage[0].total, GIB as i64);
}

/// The condition of the volume at `path`.
async fn condition_at(h: &Harness, path: &str) -> csi::VolumeCondition {
    h.svc
        .node_get_volume_stats(Request::new(stats_req(path)))
        .await
        .expect("stats")
        .into_inner()
        .volume_condition
        .expect("condition")
}

#[tokio::test]
async fn a_filesystem_the_kernel_made_read_only_is_abnormal() {
    let h = harness();
    staged(&h).await;
    h.svc
        .node_publish_volume(Request::new(publish_req(ext4(), false)))
        .await
        .expect("publish");
    // ext4 meeting I/O errors aborts its journal and goes read-only; it keeps no count in the
    // fake here, so the read-only superblock under a read-write mount alone tells.
    h.os.fail_filesystem((7, 7), 0, true);
    h.os.clear_calls();
    for path in [STAGING, TARGET] {
        let c = condition_at(&h, path).await;
        assert!(c.abnormal && c.message.contains("read-only"), "{c:?}");
    }
    // Nothing was unmounted, checked or formatted for it.
    assert_eq!(h.os.mutations(), vec![]);
}

#[tokio::test]
async fn a_read_only_publish_of_a_healthy_filesystem_is_normal() {
    let h = harness();
    staged(&h).await;
    h.svc
        .node_publish_volume(Request::new(publish_req(ext4(), true)))
        .await
        .expect("publish read-only");
    let c = condition_at(&h, TARGET).await;
    assert!(!c.abnormal, "{c:?}");
}

#[tokio::test]
async fn a_filesystem_with_errors_recorded_is_abnormal_until_checked() {
    let h = harness();
    staged(&h).await;
    assert!(!condition_at(&h, STAGING).await.abnormal);
    // Errors recorded (the mount still read-write: `errors=continue`).
    h.os.fail_filesystem((7, 7), 3, false);
    let c = condition_at(&h, STAGING).await;
    assert!(c.abnormal && c.message.contains("3 error"), "{c:?}");
    // The count cannot be read: abnormal, saying so; the call still answers.
    h.os.fail_next("fs_errors", libc::EIO);
    let c = condition_at(&h, STAGING).await;
    assert!(c.abnormal && c.message.contains("cannot be read"), "{c:?}");
    // A check cleared it: healthy again.
    h.os.fail_filesystem((7, 7), 0, false);
    assert!(!condition_at(&h, STAGING).await.abnormal);
}
