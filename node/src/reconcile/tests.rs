//! Reconciliation on the fake OS: each kind of drift, what is done about it, and what is
//! left alone.

use std::path::Path;
use std::sync::Arc;

use moor_proto::csi::v1::node_server::Node;
use tonic::Request;

use crate::engine::ADOPTED_MODE;
use crate::journal::{Durability, Phase};
use crate::reconcile::{Action, Reconciler, parse_vol_data};
use crate::service_tests::{
    DEV, Harness, STAGING, TARGET, ext4, harness, publish_req, staged, stats_req,
};
use crate::sys::Os as _;
use crate::sys::fake::{Call, FakeOs};

fn reconciler(h: &Harness) -> Reconciler<FakeOs> {
    Reconciler::new(Arc::clone(&h.engine), "moor.csi.io")
}

async fn published(h: &Harness) {
    staged(h).await;
    h.svc
        .node_publish_volume(Request::new(publish_req(ext4(), false)))
        .await
        .expect("publish");
}

fn set_publish_phase(h: &Harness, phase: Phase) {
    let journal = h.engine.journal();
    let mut r = journal.get("vol-1").expect("record");
    if let Some(p) = r.publishes.get_mut(Path::new(TARGET)) {
        p.phase = phase;
    }
    journal.put(&r, Durability::Process).expect("put");
}

fn kinds(actions: &[Action]) -> Vec<&'static str> {
    actions.iter().map(Action::kind).collect()
}

#[tokio::test]
async fn a_healthy_node_needs_nothing() {
    let h = harness();
    published(&h).await;
    h.os.clear_calls();
    let actions = reconciler(&h).run().expect("run");
    assert!(actions.is_empty(), "{actions:?}");
    assert!(h.os.calls().iter().all(|c| !matches!(
        c,
        Call::Unmount(..) | Call::Remove(_) | Call::Bind(_) | Call::MountFs(_)
    )));
}

#[tokio::test]
async fn a_bind_made_before_the_crash_is_confirmed() {
    let h = harness();
    published(&h).await;
    set_publish_phase(&h, Phase::InProgress);
    let actions = reconciler(&h).run().expect("run");
    assert_eq!(kinds(&actions), ["confirmed"]);
    let r = h.engine.journal().get("vol-1").expect("record");
    assert_eq!(r.publishes[Path::new(TARGET)].phase, Phase::Done);
    assert_eq!(h.os.mount_depth(TARGET), 1);
}

#[tokio::test]
async fn a_publish_cut_short_before_its_bind_is_rolled_back() {
    let h = harness();
    published(&h).await;
    h.os.force_unmount(TARGET);
    set_publish_phase(&h, Phase::InProgress);
    let actions = reconciler(&h).run().expect("run");
    assert_eq!(kinds(&actions), ["rolled_back"]);
    assert!(!h.os.exists(TARGET), "the target moor made is removed");
    let r = h.engine.journal().get("vol-1").expect("record");
    assert!(r.publishes.is_empty());
    assert_eq!(r.stage.expect("stage").phase, Phase::Done);
}

#[tokio::test]
async fn a_corrupted_target_is_detached_and_stays_abnormal() {
    let h = harness();
    published(&h).await;
    h.os.corrupt(TARGET, libc::ENOTCONN);
    let actions = reconciler(&h).run().expect("run");
    assert_eq!(kinds(&actions), ["cleaned_corrupted"]);
    assert!(h.os.calls().contains(&Call::Unmount(TARGET.into(), true)));
    // The record stays: kubelet still expects the volume there, and is told it is abnormal.
    assert!(
        h.engine
            .journal()
            .get("vol-1")
            .is_some_and(|r| r.publishes.contains_key(Path::new(TARGET)))
    );
    let stats = h
        .svc
        .node_get_volume_stats(Request::new(stats_req(TARGET)))
        .await
        .expect("stats")
        .into_inner();
    assert!(stats.volume_condition.expect("condition").abnormal);
}

#[tokio::test]
async fn mounts_of_a_vanished_device_are_detached() {
    let h = harness();
    published(&h).await;
    h.os.remove_device(DEV);
    let actions = reconciler(&h).run().expect("run");
    assert_eq!(kinds(&actions), ["device_gone"]);
    let calls = h.os.calls();
    assert!(calls.contains(&Call::Unmount(TARGET.into(), true)));
    assert!(calls.contains(&Call::Unmount(STAGING.into(), true)));
    // Found again on the next pass, nothing left to do.
    h.os.clear_calls();
    let again = reconciler(&h).run().expect("run");
    assert_eq!(kinds(&again), ["missing"]);
    assert!(!h.os.calls().iter().any(|c| matches!(c, Call::Unmount(..))));
}

#[tokio::test]
async fn a_second_bind_stacked_on_a_target_is_removed() {
    let h = harness();
    published(&h).await;
    h.os.bind(&crate::sys::BindMount {
        source: STAGING.into(),
        target: TARGET.into(),
        attrs: crate::sys::MountAttrs::default(),
    })
    .expect("stack");
    assert_eq!(h.os.mount_depth(TARGET), 2);
    let actions = reconciler(&h).run().expect("run");
    assert_eq!(kinds(&actions), ["unstacked"]);
    assert_eq!(h.os.mount_depth(TARGET), 1);
}

#[tokio::test]
async fn a_mount_that_is_not_moors_is_left_alone() {
    let h = harness();
    published(&h).await;
    h.os.force_unmount(TARGET);
    h.os.add_device("/dev/other", (9, 9), 1 << 20);
    h.os.mount_fs(&crate::sys::FsMount {
        device: "/dev/other".into(),
        target: TARGET.into(),
        fs_type: "ext4".into(),
        attrs: crate::sys::MountAttrs::default(),
        options: vec![],
        sb_read_only: false,
    })
    .expect("foreign mount");
    h.os.clear_calls();
    let actions = reconciler(&h).run().expect("run");
    assert_eq!(kinds(&actions), ["foreign"]);
    assert!(
        !h.os
            .calls()
            .iter()
            .any(|c| matches!(c, Call::Unmount(..) | Call::Remove(_)))
    );
    assert_eq!(h.os.mount_depth(TARGET), 1);
}

#[tokio::test]
async fn a_staging_mount_missing_after_a_reboot_is_reported_not_touched() {
    let h = harness();
    staged(&h).await;
    h.os.force_unmount(STAGING);
    h.os.clear_calls();
    let actions = reconciler(&h).run().expect("run");
    assert_eq!(kinds(&actions), ["missing"]);
    assert!(h.engine.journal().get("vol-1").is_some());
    // kubelet's NodeStageVolume after the reboot mounts it again, without formatting.
    staged(&h).await;
    assert_eq!(h.os.mount_depth(STAGING), 1);
    assert!(
        !h.os
            .calls()
            .iter()
            .any(|c| matches!(c, Call::Tool(p, _) if p.starts_with("mkfs")))
    );
}

#[tokio::test]
async fn a_cut_short_mkfs_is_left_for_kubelets_retry() {
    let h = harness();
    staged(&h).await;
    let journal = h.engine.journal();
    let mut r = journal.get("vol-1").expect("record");
    if let Some(s) = r.stage.as_mut() {
        s.phase = Phase::Formatting;
    }
    journal.put(&r, Durability::Process).expect("put");
    h.os.force_unmount(STAGING);
    h.os.clear_calls();
    let actions = reconciler(&h).run().expect("run");
    assert_eq!(kinds(&actions), ["format_pending"]);
    assert!(h.os.calls().iter().all(
        |c| matches!(c, Call::MakeDir(_)) || !matches!(c, Call::Unmount(..) | Call::Remove(_))
    ));
}

#[tokio::test]
async fn a_volume_busy_with_a_call_is_skipped() {
    let h = harness();
    published(&h).await;
    set_publish_phase(&h, Phase::InProgress);
    let guard = h.engine.locks().try_lock("vol-1").expect("lock");
    let actions = reconciler(&h).run().expect("run");
    assert_eq!(kinds(&actions), ["busy"]);
    drop(guard);
    assert_eq!(kinds(&reconciler(&h).run().expect("run")), ["confirmed"]);
}

#[tokio::test]
async fn mounts_without_kubelets_vol_data_are_never_adopted() {
    // A real kubelet dir for vol_data.json; the mounts themselves are the fake's.
    let h = harness();
    published(&h).await;
    let kubelet = h.engine.config().kubelet_dir.clone();
    assert!(kubelet.starts_with("/var/lib/kubelet"));
    // Forget everything, as a garbage journal would.
    let mut r = h.engine.journal().get("vol-1").expect("record");
    r.stage = None;
    r.publishes.clear();
    h.engine
        .journal()
        .put(&r, Durability::Process)
        .expect("forget");
    let actions = reconciler(&h).run().expect("run");
    // vol_data.json cannot be read (the fake's kubelet dir is not on disk): nothing adopted,
    // nothing touched.
    assert!(actions.is_empty(), "{actions:?}");
    assert_eq!(h.os.mount_depth(TARGET), 1);
}

#[test]
fn vol_data_names_the_volume_only_for_this_driver() {
    let data = br#"{"driverName":"moor.csi.io","volumeHandle":"vol-9","specVolID":"pv9"}"#;
    assert_eq!(parse_vol_data(data, "moor.csi.io"), Some("vol-9".into()));
    assert_eq!(parse_vol_data(data, "other.csi.io"), None);
    assert_eq!(parse_vol_data(b"{", "moor.csi.io"), None);
    assert_eq!(
        parse_vol_data(
            br#"{"driverName":"moor.csi.io","volumeHandle":""}"#,
            "moor.csi.io"
        ),
        None
    );
}

#[tokio::test]
async fn an_adopted_record_takes_the_next_requests_capability() {
    let h = harness();
    published(&h).await;
    let journal = h.engine.journal();
    let mut r = journal.get("vol-1").expect("record");
    if let Some(s) = r.stage.as_mut() {
        s.access_mode = ADOPTED_MODE;
        s.attrs.nodiratime = true;
    }
    if let Some(p) = r.publishes.get_mut(Path::new(TARGET)) {
        p.access_mode = ADOPTED_MODE;
        p.attrs.noexec = true;
    }
    journal.put(&r, Durability::Process).expect("put");
    staged(&h).await;
    h.svc
        .node_publish_volume(Request::new(publish_req(ext4(), false)))
        .await
        .expect("publish retry on an adopted record");
    let r = journal.get("vol-1").expect("record");
    assert_ne!(r.stage.expect("stage").access_mode, ADOPTED_MODE);
    assert_ne!(r.publishes[Path::new(TARGET)].access_mode, ADOPTED_MODE);
}
