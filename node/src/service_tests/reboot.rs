//! Calls after a reboot against what the journal kept of the boot before. A power cut may take
//! the records of calls kubelet was answered (they only had to outlive the process), so the
//! journal may remember a publication or a staging kubelet has ended: after a reboot, a record
//! whose path is not mounted is a memory and holds nothing; one whose path is mounted, and any
//! record within one boot (a process crash), holds as before.

use super::*;
use crate::journal::VolumeRecord;
use crate::sys::BindMount;

const BOOT_1: &str = "4d1f8c2a-93b0-4e57-8a61-0c2e7b9d5f11";
const BOOT_2: &str = "a7e05b93-1c48-4f2d-b6d9-3e8f0a1c7d22";
/// The target of another pod.
const TARGET2: &str = "/var/lib/kubelet/pods/p2/volumes/kubernetes.io~csi/pv1/mount";

fn boot(id: &str) -> Boot {
    Boot::new(Some(id.into()))
}

/// The node after a power cut of `h`: in boot `id`, on the journal as `h` left it (what a cut
/// that took nothing leaves; the calls after it stand for the ones the cut took), with DEV's
/// data, nothing mounted.
fn rebooted(h: &Harness, id: &str, max_volumes: u64) -> Harness {
    let log = std::fs::read(h.state.join(journal::LOG_FILE)).expect("log");
    let after = node(max_volumes, &boot(id), &log);
    after
        .os
        .add_dir(Path::new(TARGET2).parent().unwrap_or(Path::new("/")));
    for (offset, bytes) in h.os.device_data(DEV) {
        after.os.write_device(DEV, offset, &bytes);
    }
    after
}

async fn publish_at(h: &Harness, target: &str) -> Code {
    let mut req = publish_req(ext4(), false);
    req.target_path = target.into();
    code(h.svc.node_publish_volume(Request::new(req))).await
}

async fn stats_at(h: &Harness, path: &str) -> Code {
    code(h.svc.node_get_volume_stats(Request::new(stats_req(path)))).await
}

fn record(h: &Harness) -> VolumeRecord {
    h.engine.journal().get("vol-1").expect("record")
}

/// The volume staged and published at TARGET in boot 1: the journal as a power cut right
/// after kubelet's unpublish answered OK may leave it.
async fn published_in_boot_1() -> Harness {
    let h = node(0, &boot(BOOT_1), b"");
    staged(&h).await;
    assert_eq!(publish_at(&h, TARGET).await, Code::Ok);
    h
}

#[tokio::test]
async fn a_publication_from_before_a_reboot_holds_no_target_and_is_forgotten() {
    let h = published_in_boot_1().await;
    let after = rebooted(&h, BOOT_2, 0);
    // Not the volume's any more, before kubelet does anything.
    assert_eq!(stats_at(&after, TARGET).await, Code::NotFound);
    assert_eq!(
        code(
            after
                .svc
                .node_expand_volume(Request::new(expand_req(TARGET, 0)))
        )
        .await,
        Code::NotFound
    );
    // kubelet stages the volume again for the pod that replaced the one it ended, and
    // publishes it at that pod's target: served, and the ended publication forgotten.
    staged(&after).await;
    assert_eq!(publish_at(&after, TARGET2).await, Code::Ok);
    let r = record(&after);
    assert_eq!(
        r.publishes.keys().collect::<Vec<_>>(),
        [Path::new(TARGET2)],
        "{r:?}"
    );
    assert_eq!(
        r.publishes
            .get(Path::new(TARGET2))
            .and_then(|p| p.boot.as_deref()),
        Some(BOOT_2)
    );
    assert_eq!(after.os.mount_depth(TARGET), 0);
    // The journal on disk says so too: a process crash now does not bring it back.
    let log = std::fs::read(after.state.join(journal::LOG_FILE)).expect("log");
    let on_disk = journal::replay(&log)
        .records
        .remove("vol-1")
        .expect("record");
    assert_eq!(
        on_disk.publishes.keys().collect::<Vec<_>>(),
        [Path::new(TARGET2)]
    );
}

#[tokio::test]
async fn a_publication_from_before_a_reboot_whose_target_is_mounted_holds_it() {
    let h = published_in_boot_1().await;
    let after = rebooted(&h, BOOT_2, 0);
    staged(&after).await;
    // Something mounted at the target since the boot (never moor's from before it: a reboot
    // ends every mount): a writer may be behind it, so the single-writer rule holds.
    after.os.add_dir("/srv/elsewhere");
    after.os.add_dir(TARGET);
    after
        .os
        .bind(&BindMount {
            source: "/srv/elsewhere".into(),
            target: TARGET.into(),
            attrs: crate::sys::MountAttrs::default(),
        })
        .expect("bind");
    assert_eq!(publish_at(&after, TARGET2).await, Code::FailedPrecondition);
    assert!(record(&after).publishes.contains_key(Path::new(TARGET)));
    // Once it is gone, the record is a memory.
    after.os.force_unmount(TARGET);
    assert_eq!(publish_at(&after, TARGET2).await, Code::Ok);
}

#[tokio::test]
async fn within_one_boot_a_publication_holds_its_target_mounted_or_not() {
    let h = published_in_boot_1().await;
    // moor-node restarted (a process crash): the same boot, and the target's mount gone from
    // moor's view. A pod's container may still hold it: the record is still a claim.
    let restarted = rebooted(&h, BOOT_1, 0);
    staged(&restarted).await;
    assert_eq!(
        publish_at(&restarted, TARGET2).await,
        Code::FailedPrecondition
    );
    assert_eq!(stats_at(&restarted, TARGET).await, Code::Ok);
    // A record written before moor kept the boot is taken as this boot's, after a reboot too.
    let old = harness();
    staged(&old).await;
    assert_eq!(publish_at(&old, TARGET).await, Code::Ok);
    let after = rebooted(&old, BOOT_2, 0);
    staged(&after).await;
    assert_eq!(publish_at(&after, TARGET2).await, Code::FailedPrecondition);
}

#[tokio::test]
async fn a_staging_from_before_a_reboot_takes_no_place_and_is_no_stage() {
    let h = node(1, &boot(BOOT_1), b"");
    staged(&h).await;
    let after = rebooted(&h, BOOT_2, 1);
    after
        .os
        .add_dir("/var/lib/kubelet/plugins/kubernetes.io/csi/moor.csi.io/def");
    after.os.add_device("/dev/loop8", (7, 8), GIB);
    assert_eq!(stats_at(&after, STAGING).await, Code::NotFound);
    assert_eq!(after.engine.volume_counts().staged, 0, "the staged gauge");
    // Not staged until kubelet stages it again: a publish before that is refused.
    assert_eq!(publish_at(&after, TARGET).await, Code::FailedPrecondition);
    // Another volume takes the node's one place.
    let mut other = stage_req(ext4());
    other.volume_id = "vol-2".into();
    other.staging_target_path =
        "/var/lib/kubelet/plugins/kubernetes.io/csi/moor.csi.io/def/globalmount".into();
    other.publish_context = HashMap::from([("devicePath".into(), "/dev/loop8".into())]);
    assert_eq!(
        code(after.svc.node_stage_volume(Request::new(other))).await,
        Code::Ok
    );
    assert_eq!(after.engine.volume_counts().staged, 1);
    // The memory is kept until kubelet stages or unstages the volume...
    assert!(record(&after).stage.is_some());
    assert_eq!(
        code(after.svc.node_stage_volume(Request::new(stage_req(ext4())))).await,
        Code::ResourceExhausted
    );
    // ... and an unstage (kubelet's, of a volume it had staged before the reboot) drops it.
    assert_eq!(
        code(after.svc.node_unstage_volume(Request::new(unstage_req()))).await,
        Code::Ok
    );
    assert!(after.engine.journal().get("vol-1").is_none());
}

#[tokio::test]
async fn a_staging_from_before_a_reboot_is_replaced_at_another_path_or_capability() {
    let h = node(0, &boot(BOOT_1), b"");
    staged(&h).await;
    let after = rebooted(&h, BOOT_2, 0);
    // Within the boot that staged it, another capability is refused...
    let restarted = rebooted(&h, BOOT_1, 0);
    let ro = mount_cap("ext4", &[], Mode::SingleNodeReaderOnly);
    assert_eq!(
        code(
            restarted
                .svc
                .node_stage_volume(Request::new(stage_req(ro.clone())))
        )
        .await,
        Code::AlreadyExists
    );
    // ... after a reboot, it stages the volume afresh, on its filesystem.
    assert_eq!(
        code(after.svc.node_stage_volume(Request::new(stage_req(ro)))).await,
        Code::Ok
    );
    assert_eq!(mkfs_calls(&after), 0);
    let s = record(&after).stage.expect("stage");
    assert_eq!(
        (s.access_mode, s.boot.as_deref()),
        (Mode::SingleNodeReaderOnly as i32, Some(BOOT_2))
    );
    assert!(s.fs_uuid.is_some(), "the UUID of moor's mkfs is remembered");
}

#[tokio::test]
async fn a_block_staging_from_before_a_reboot_is_no_stage_until_staged_again() {
    let h = node(0, &boot(BOOT_1), b"");
    h.svc
        .node_stage_volume(Request::new(stage_req(block_cap())))
        .await
        .expect("stage");
    let target = format!("{K}/plugins/kubernetes.io/csi/volumeDevices/publish/pv1/p1");
    let mut publish = publish_req(block_cap(), false);
    publish.target_path = target.clone();
    h.svc
        .node_publish_volume(Request::new(publish.clone()))
        .await
        .expect("publish");
    // After the reboot the device node may be another disk with the same number: nothing is
    // bound from a staging the reboot ended.
    let after = rebooted(&h, BOOT_2, 0);
    assert_eq!(
        code(after.svc.node_publish_volume(Request::new(publish.clone()))).await,
        Code::FailedPrecondition
    );
    assert_eq!(after.os.mount_depth(&target), 0);
    after
        .svc
        .node_stage_volume(Request::new(stage_req(block_cap())))
        .await
        .expect("stage again");
    assert_eq!(
        code(after.svc.node_publish_volume(Request::new(publish))).await,
        Code::Ok
    );
    assert_eq!(after.os.mount_depth(&target), 1);
}

/// A device renumbered by the reboot is the volume's when the request names it by identity,
/// whatever filesystem it carries (here one moor did not make: no UUID of moor's to match).
#[tokio::test]
async fn a_renumbered_device_named_by_its_serial_is_staged_again() {
    let stage_by_serial = || {
        let mut r = stage_req(ext4());
        r.publish_context = HashMap::from([("deviceSerial".into(), "vol-0abc".into())]);
        r
    };
    let h = node(0, &boot(BOOT_1), b"");
    h.os.set_serial((7, 7), "vol-0abc");
    for (offset, bytes) in superblock("ext4") {
        h.os.write_device(DEV, offset, &bytes);
    }
    h.svc
        .node_stage_volume(Request::new(stage_by_serial()))
        .await
        .expect("stage");
    assert_eq!(record(&h).stage.and_then(|s| s.fs_uuid), None);
    let after = rebooted(&h, BOOT_2, 0);
    let data = after.os.device_data(DEV);
    after.os.remove_device(DEV);
    after.os.add_device(DEV, (7, 99), GIB);
    for (offset, bytes) in data {
        after.os.write_device(DEV, offset, &bytes);
    }
    after.os.set_serial((7, 99), "vol-0abc");
    after
        .svc
        .node_stage_volume(Request::new(stage_by_serial()))
        .await
        .expect("stage after the reboot");
    assert_eq!(mkfs_calls(&after), 0);
    assert_eq!(record(&after).stage.map(|s| s.rdev), Some((7, 99)));
}

#[tokio::test]
async fn reconciliation_after_a_reboot_forgets_publications_and_keeps_stagings() {
    let run = |h: &Harness| {
        crate::reconcile::Reconciler::new(Arc::clone(&h.engine), "moor.csi.io")
            .run()
            .expect("reconcile")
            .iter()
            .map(crate::reconcile::Action::kind)
            .collect::<Vec<_>>()
    };
    let h = published_in_boot_1().await;
    let after = rebooted(&h, BOOT_2, 0);
    assert_eq!(run(&after), ["forgotten", "remembered"]);
    let r = record(&after);
    assert!(r.publishes.is_empty(), "{r:?}");
    assert_eq!(
        r.stage.and_then(|s| s.boot),
        Some(BOOT_1.to_string()),
        "kept as it was written, for kubelet's next stage"
    );
    assert!(
        mutating_calls(&after).is_empty(),
        "{:?}",
        mutating_calls(&after)
    );
    assert_eq!(run(&after), ["remembered"]);
    // Within one boot the same journal is drift: abnormal until kubelet acts, and kept.
    let restarted = rebooted(&h, BOOT_1, 0);
    assert_eq!(run(&restarted), ["missing", "missing"]);
    assert_eq!(record(&restarted).publishes.len(), 1);
}
