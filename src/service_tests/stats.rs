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
