//! NodePublishVolume and NodeUnpublishVolume: binds, the access mode table, cleaning corrupted and stacked targets.

use super::*;
use crate::sys::{BindMount, MountAttrs};

#[tokio::test]
async fn publish_binds_the_staging_mount_and_repeats_are_ok() {
    let h = harness();
    staged(&h).await;
    h.svc
        .node_publish_volume(Request::new(publish_req(ext4(), false)))
        .await
        .expect("publish");
    assert_eq!(h.os.mount_depth(TARGET), 1);
    h.svc
        .node_publish_volume(Request::new(publish_req(ext4(), false)))
        .await
        .expect("repeat");
    assert_eq!(h.os.mount_depth(TARGET), 1, "never stack a second mount");
    // The same target with other arguments: ALREADY_EXISTS.
    assert_eq!(
        code(
            h.svc
                .node_publish_volume(Request::new(publish_req(ext4(), true)))
        )
        .await,
        Code::AlreadyExists
    );
}

/// The journal's log, as written so far.
fn journal_log(h: &Harness) -> Vec<u8> {
    std::fs::read(h.state.join(crate::journal::LOG_FILE)).expect("journal log")
}

#[tokio::test]
async fn a_stage_and_publish_found_done_write_nothing() {
    // kubelet re-drives every stage and publication when it restarts: each finds its work
    // done, and must cost no journal write.
    let h = harness();
    staged(&h).await;
    h.svc
        .node_publish_volume(Request::new(publish_req(ext4(), false)))
        .await
        .expect("publish");
    let log = journal_log(&h);
    let before = h.os.calls().len();
    staged(&h).await;
    h.svc
        .node_publish_volume(Request::new(publish_req(ext4(), false)))
        .await
        .expect("publish again");
    assert_eq!(journal_log(&h), log, "a repeat writes no journal line");
    assert_eq!(h.os.mount_depth(TARGET), 1);
    assert_eq!(h.os.mount_depth(STAGING), 1);
    let repeat = h.os.calls().split_off(before);
    assert!(
        !repeat
            .iter()
            .any(|c| matches!(c, Call::Bind(_) | Call::MountFs(_) | Call::Unmount(..))),
        "a repeat mounts and unmounts nothing: {repeat:?}"
    );
    // The record still holds both.
    let record = h.engine.journal().get("vol-1").expect("record");
    assert!(record.stage.is_some());
    assert_eq!(record.publishes.len(), 1);
}

#[tokio::test]
async fn readonly_publish_is_a_read_only_bind() {
    let h = harness();
    staged(&h).await;
    h.svc
        .node_publish_volume(Request::new(publish_req(ext4(), true)))
        .await
        .expect("publish");
    let bind = h.os.calls().into_iter().find_map(|c| match c {
        Call::Bind(b) => Some(b),
        _ => None,
    });
    assert!(bind.expect("bind").attrs.read_only);
}

#[tokio::test]
async fn publish_error_rows() {
    let h = harness();
    // Not staged: FAILED_PRECONDITION.
    assert_eq!(
        code(
            h.svc
                .node_publish_volume(Request::new(publish_req(ext4(), false)))
        )
        .await,
        Code::FailedPrecondition
    );
    staged(&h).await;
    // Staging target path not set: FAILED_PRECONDITION.
    let mut r = publish_req(ext4(), false);
    r.staging_target_path.clear();
    assert_eq!(
        code(h.svc.node_publish_volume(Request::new(r))).await,
        Code::FailedPrecondition
    );
    // Missing fields: INVALID_ARGUMENT.
    for mutate in [
        (|r: &mut csi::NodePublishVolumeRequest| r.volume_id.clear()) as fn(&mut _),
        |r| r.target_path.clear(),
        |r| r.volume_capability = None,
        |r| r.target_path = "/etc".into(),
        |r| r.target_path = format!("{K}//pods/x"),
    ] {
        let mut r = publish_req(ext4(), false);
        mutate(&mut r);
        assert_eq!(
            code(h.svc.node_publish_volume(Request::new(r))).await,
            Code::InvalidArgument
        );
    }
    // Access type other than staged: FAILED_PRECONDITION.
    assert_eq!(
        code(
            h.svc
                .node_publish_volume(Request::new(publish_req(block_cap(), false)))
        )
        .await,
        Code::FailedPrecondition
    );
    // Another volume's staging path: FAILED_PRECONDITION.
    let mut r = publish_req(ext4(), false);
    r.staging_target_path = format!("{K}/plugins/other");
    assert_eq!(
        code(h.svc.node_publish_volume(Request::new(r))).await,
        Code::FailedPrecondition
    );
    assert_eq!(h.os.mount_depth(TARGET), 0);
}

#[tokio::test]
async fn block_publish_binds_the_device_node_on_a_file() {
    let h = harness();
    h.svc
        .node_stage_volume(Request::new(stage_req(block_cap())))
        .await
        .expect("stage");
    let target = format!("{K}/plugins/kubernetes.io/csi/volumeDevices/publish/pv1/pod-uid");
    let mut r = publish_req(block_cap(), false);
    r.target_path = target.clone();
    h.svc
        .node_publish_volume(Request::new(r))
        .await
        .expect("publish");
    let calls = h.os.calls();
    assert!(calls.contains(&Call::MakeFile(target.clone().into())));
    assert!(
        calls
            .iter()
            .any(|c| matches!(c, Call::Bind(b) if b.source == Path::new(DEV)))
    );
    h.svc
        .node_unpublish_volume(Request::new(unpublish_req(&target)))
        .await
        .expect("unpublish");
    assert!(!h.os.exists(&target));
}

#[tokio::test]
async fn second_target_follows_the_access_mode_table() {
    let other = format!("{K}/pods/p2/volumes/kubernetes.io~csi/pv1/mount");
    // (mode, first publication read-only, second read-only, answer to the second)
    for (mode, first_ro, second_ro, want) in [
        (
            Mode::SingleNodeWriter,
            false,
            false,
            Code::FailedPrecondition,
        ),
        (Mode::SingleNodeWriter, false, true, Code::Ok),
        (Mode::SingleNodeWriter, true, false, Code::Ok),
        (Mode::SingleNodeWriter, true, true, Code::Ok),
        (
            Mode::SingleNodeSingleWriter,
            false,
            true,
            Code::FailedPrecondition,
        ),
        (
            Mode::SingleNodeSingleWriter,
            false,
            false,
            Code::FailedPrecondition,
        ),
        (
            Mode::SingleNodeReaderOnly,
            true,
            true,
            Code::FailedPrecondition,
        ),
        (Mode::SingleNodeMultiWriter, false, false, Code::Ok),
        (Mode::MultiNodeReaderOnly, true, true, Code::Ok),
    ] {
        let h = harness();
        h.os.add_dir(Path::new(&other).parent().unwrap_or(Path::new("/")));
        // Reader modes never format: the device holds a filesystem already.
        for (offset, bytes) in superblock("ext4") {
            h.os.write_device(DEV, offset, &bytes);
        }
        let cap = mount_cap("ext4", &[], mode);
        h.svc
            .node_stage_volume(Request::new(stage_req(cap.clone())))
            .await
            .expect("stage");
        h.svc
            .node_publish_volume(Request::new(publish_req(cap.clone(), first_ro)))
            .await
            .expect("first");
        let mut r = publish_req(cap, second_ro);
        r.target_path = other.clone();
        assert_eq!(
            code(h.svc.node_publish_volume(Request::new(r))).await,
            want,
            "{mode:?} first ro {first_ro} second ro {second_ro}"
        );
    }
}

#[tokio::test]
async fn unpublish_unmounts_removes_and_is_idempotent() {
    let h = harness();
    staged(&h).await;
    h.svc
        .node_publish_volume(Request::new(publish_req(ext4(), false)))
        .await
        .expect("publish");
    for _ in 0..2 {
        h.svc
            .node_unpublish_volume(Request::new(unpublish_req(TARGET)))
            .await
            .expect("unpublish");
        assert_eq!(h.os.mount_depth(TARGET), 0);
        assert!(!h.os.exists(TARGET));
    }
    // A target that never existed is already unpublished.
    h.svc
        .node_unpublish_volume(Request::new(unpublish_req(&format!("{K}/pods/none/mount"))))
        .await
        .expect("never published");
    assert_eq!(
        code(h.svc.node_unpublish_volume(Request::new(unpublish_req("")))).await,
        Code::InvalidArgument
    );
}

#[tokio::test]
async fn corrupted_and_stacked_targets_are_cleaned() {
    let h = harness();
    staged(&h).await;
    h.svc
        .node_publish_volume(Request::new(publish_req(ext4(), false)))
        .await
        .expect("publish");
    h.os.corrupt(TARGET, libc::ENOTCONN);
    h.svc
        .node_unpublish_volume(Request::new(unpublish_req(TARGET)))
        .await
        .expect("unpublish");
    assert!(h.os.calls().contains(&Call::Unmount(TARGET.into(), true)));
    assert!(!h.os.exists(TARGET));
    // Two mounts stacked on one target (someone else's doing) are all peeled off.
    h.svc
        .node_publish_volume(Request::new(publish_req(ext4(), false)))
        .await
        .expect("publish");
    h.engine
        .os()
        .bind(&crate::sys::BindMount {
            source: STAGING.into(),
            target: TARGET.into(),
            attrs: Default::default(),
        })
        .expect("stack");
    h.svc
        .node_unpublish_volume(Request::new(unpublish_req(TARGET)))
        .await
        .expect("unpublish");
    assert_eq!(h.os.mount_depth(TARGET), 0);
}

/// Issue 38, point 6 (longhorn #12006): the bind fails, and its cleanups fail too (the
/// target's dir cannot be removed, the record cannot be dropped). The answer is the bind's
/// failure, each cleanup's named after it; the retry publishes.
#[tokio::test]
async fn a_failed_bind_whose_cleanups_fail_answers_the_bind_failure() {
    let h = harness();
    staged(&h).await;
    h.os.fail_next("bind", libc::ENOSPC);
    h.os.fail_next("remove", libc::EBUSY);
    // The intent before the bind is written; the record's removal after it fails.
    h.engine.journal().fail_put_after(1);
    let err = h
        .svc
        .node_publish_volume(Request::new(publish_req(ext4(), false)))
        .await
        .expect_err("the bind fails");
    let said = err.message();
    let at = |w: &str| {
        said.find(w)
            .unwrap_or_else(|| panic!("{w:?} not in {said}"))
    };
    assert!(
        at("No space left") < at("busy") && at("busy") < at("Input/output error"),
        "the bind's failure first, then the dir's, then the journal's: {said}"
    );
    assert_eq!(err.code(), Code::Internal);
    assert_eq!(h.os.mount_depth(TARGET), 0);
    h.svc
        .node_publish_volume(Request::new(publish_req(ext4(), false)))
        .await
        .expect("the retry");
    assert_eq!(h.os.mount_depth(TARGET), 1);
}

#[tokio::test]
async fn a_publish_resolves_each_path_once_and_binds_what_it_checked() {
    // A publish resolves the staging path (is it mounted, and is it this volume's), the
    // target (is anything there) and the target's parent (to make it), each once: the bind
    // clones the staging mount it checked and attaches it on the entry it made, both held
    // open, not looked up again.
    let h = harness();
    staged(&h).await;
    h.os.clear_calls();
    h.svc
        .node_publish_volume(Request::new(publish_req(ext4(), false)))
        .await
        .expect("publish");
    let parent = Path::new(TARGET).parent().expect("a parent");
    assert_eq!(
        h.os.resolutions(),
        [Path::new(STAGING), Path::new(TARGET), parent],
        "one resolution a path"
    );
    assert_eq!(h.os.mount_depth(TARGET), 1);
    // The unpublish resolves the target's parent once: is the target mounted, its unmount,
    // is a mount stacked under it, and its removal all look its name up in that directory.
    h.os.clear_calls();
    h.svc
        .node_unpublish_volume(Request::new(unpublish_req(TARGET)))
        .await
        .expect("unpublish");
    assert_eq!(h.os.resolutions(), [parent]);
    assert_eq!(h.os.mount_depth(TARGET), 0);
    assert!(!h.os.exists(TARGET));
    // A remount of the staging path between its check and the bind: what is bound is the
    // mount checked, and it is gone, so nothing is; never the mount swapped in.
    h.os.swap_mount_after_check(STAGING, (9, 9));
    let e = h
        .svc
        .node_publish_volume(Request::new(publish_req(ext4(), false)))
        .await
        .expect_err("the checked mount is gone");
    assert_eq!(h.os.mount_depth(TARGET), 0, "{e:?}");
    assert!(!h.os.exists(TARGET), "the target made is removed: {e:?}");
    assert!(
        e.message().contains("open_tree") && e.message().contains(STAGING),
        "{}",
        e.message()
    );
}

#[tokio::test]
async fn an_unpublish_acts_in_the_directory_it_checked_not_one_renamed_into_its_path() {
    // The target's parent is resolved once and held: the checks, the unmount and the removal
    // look the target's name up in that directory. Another pod's volume dir, with a mount of
    // its own, renamed into the path right after the hold, is neither unmounted nor removed;
    // the publication's own mount, moved away with its directory, is.
    let h = harness();
    published(&h).await;
    let parent = Path::new(TARGET).parent().expect("a parent");
    let parent = parent.to_str().expect("utf-8");
    let moved = format!("{parent}-moved");
    let other_dir = format!("{K}/pods/p2/volumes/kubernetes.io~csi/pv2");
    let other = format!("{other_dir}/mount");
    h.os.add_dir(&other);
    h.os.add_dir("/srv/other");
    h.os.bind(&BindMount {
        source: "/srv/other".into(),
        target: other.clone().into(),
        attrs: MountAttrs::default(),
    })
    .expect("another pod's mount");
    h.os.rename_after_hold(parent, &[(parent, &moved), (&other_dir, parent)]);
    h.os.clear_calls();
    h.svc
        .node_unpublish_volume(Request::new(unpublish_req(TARGET)))
        .await
        .expect("unpublish");
    assert_eq!(
        h.os.mount_depth(TARGET),
        1,
        "the mount renamed into the path is not unmounted: {:?}",
        h.os.calls()
    );
    assert!(h.os.exists(TARGET), "nor its dir removed");
    let own = format!("{moved}/mount");
    assert_eq!(
        h.os.mount_depth(&own),
        0,
        "the publication's own mount is unmounted"
    );
    assert!(!h.os.exists(&own), "and its dir removed");
    assert_eq!(h.os.resolutions(), [Path::new(parent)]);
}
