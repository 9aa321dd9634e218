//! NodeStageVolume's filesystem: an interrupted mkfs resumed only by moor, a whole filesystem never formatted, reader-only stages never formatting, the check before a read-write mount.

use super::*;

/// A stage of DEV, named by its backing file.
fn backed_req() -> csi::NodeStageVolumeRequest {
    let mut r = stage_req(ext4());
    r.publish_context
        .insert("backingFile".into(), "/var/lib/moor/vol-1.img".into());
    r
}

/// A first stage of DEV (named by its backing file) whose mkfs fails, leaving partial data
/// behind; the journal says moor was formatting this device.
async fn mkfs_interrupted(h: &Harness) {
    h.os.set_backing_file((7, 7), "/var/lib/moor/vol-1.img");
    h.os.fail_next("tool", 1);
    assert_eq!(
        code(h.svc.node_stage_volume(Request::new(backed_req()))).await,
        Code::Internal
    );
    h.os.write_device(DEV, 4096, &[0xFF; 16]);
}

#[tokio::test]
async fn interrupted_mkfs_is_resumed_only_by_moor() {
    let h = harness();
    let req = backed_req;
    mkfs_interrupted(&h).await;
    h.svc
        .node_stage_volume(Request::new(req()))
        .await
        .expect("resumed");
    let forced = h.os.calls().iter().any(
        |c| matches!(c, Call::Tool(p, a) if p == "mkfs.ext4" && a.contains(&"-F".to_string())),
    );
    assert!(forced, "resumed mkfs must be forced");
}

#[tokio::test]
async fn an_interrupted_mkfs_named_by_path_alone_is_not_resumed_over_data() {
    // The request names the device by path only: the path proves nothing about the unknown
    // data on it now (a loop number reused by another volume reads the same).
    let h = harness();
    h.os.fail_next("tool", 1);
    assert_eq!(
        code(h.svc.node_stage_volume(Request::new(stage_req(ext4())))).await,
        Code::Internal
    );
    h.os.write_device(DEV, 4096, &[0xFF; 16]);
    h.os.clear_calls();
    let s = h
        .svc
        .node_stage_volume(Request::new(stage_req(ext4())))
        .await
        .expect_err("refused");
    assert_eq!(s.code(), Code::FailedPrecondition, "{}", s.message());
    assert_eq!(mkfs_calls(&h), 0);
    // And a path that names another device number now is refused before anything is read.
    h.os.remove_device(DEV);
    h.os.add_device(DEV, (7, 70), GIB);
    h.os.write_device(DEV, 4096, &[0xFF; 16]);
    let s = h
        .svc
        .node_stage_volume(Request::new(stage_req(ext4())))
        .await
        .expect_err("refused");
    assert_eq!(s.code(), Code::FailedPrecondition, "{}", s.message());
    assert!(s.message().contains("7:7"), "{}", s.message());
    assert_eq!(mkfs_calls(&h), 0);
}

#[tokio::test]
async fn a_whole_filesystem_is_never_formatted_whatever_the_journal_says() {
    // The newest durable record says "formatting" (a power cut lost the lines after it), but
    // mkfs finished: the device holds the filesystem with the UUID moor chose.
    let h = harness();
    staged(&h).await;
    let mut record = h.engine.journal().get("vol-1").expect("record");
    let uuid = record
        .stage
        .as_ref()
        .and_then(|s| s.fs_uuid.clone())
        .expect("the UUID moor chose is recorded");
    let mkfs_args = h.os.calls().into_iter().find_map(|c| match c {
        Call::Tool(p, a) if p == "mkfs.ext4" => Some(a),
        _ => None,
    });
    assert!(
        mkfs_args.is_some_and(|a| a.contains(&uuid)),
        "mkfs is given the recorded UUID"
    );
    h.os.force_unmount(STAGING);
    if let Some(st) = record.stage.as_mut() {
        st.phase = crate::journal::Phase::Formatting;
    }
    h.engine
        .journal()
        .put(&record, crate::journal::Durability::Power)
        .expect("put");
    h.os.clear_calls();
    staged(&h).await;
    assert_eq!(mkfs_calls(&h), 0, "{:?}", h.os.calls());
    assert_eq!(h.os.mount_depth(STAGING), 1);
    let after = h.engine.journal().get("vol-1").and_then(|r| r.stage);
    assert_eq!(after.and_then(|s| s.fs_uuid), Some(uuid));
}

#[tokio::test]
async fn reader_only_stages_never_format() {
    for (mode, flags) in [
        (Mode::SingleNodeReaderOnly, &[][..]),
        (Mode::MultiNodeReaderOnly, &[][..]),
        (Mode::SingleNodeWriter, &["ro"][..]),
    ] {
        let h = harness();
        let s = h
            .svc
            .node_stage_volume(Request::new(stage_req(mount_cap("ext4", flags, mode))))
            .await
            .expect_err("refused");
        assert_eq!(s.code(), Code::FailedPrecondition, "{mode:?}");
        assert!(s.message().contains("read-only"), "{}", s.message());
        assert_eq!(mkfs_calls(&h), 0, "{mode:?}");
        assert!(
            !h.os
                .mutations()
                .iter()
                .any(|c| matches!(c, Call::Tool(..) | Call::MountFs(_))),
            "{:?}",
            h.os.mutations()
        );
        assert!(
            h.engine
                .probe_device(Path::new(DEV), GIB)
                .expect("probe")
                .is_blank()
        );
        assert!(h.engine.journal().get("vol-1").is_none());
        // A formatted device is staged read-only as before, unchecked (nothing is written).
        for (offset, bytes) in superblock("ext4") {
            h.os.write_device(DEV, offset, &bytes);
        }
        h.svc
            .node_stage_volume(Request::new(stage_req(mount_cap("ext4", flags, mode))))
            .await
            .expect("stage of a formatted device");
        assert_eq!(tool_calls(&h), vec![], "{mode:?}");
    }
}

#[tokio::test]
async fn an_existing_ext_filesystem_is_checked_before_a_read_write_mount() {
    let preen = || Call::Tool("e2fsck".into(), vec!["-p".into(), DEV.into()]);
    // Clean (0), repaired (1), and the check itself failing (8): mounted.
    for (code_, mounted) in [
        (None, true),
        (Some(1), true),
        (Some(8), true),
        (Some(4), false),
    ] {
        let h = harness();
        for (offset, bytes) in superblock("ext4") {
            h.os.write_device(DEV, offset, &bytes);
        }
        if let Some(c) = code_ {
            h.os.fail_tool("e2fsck", c);
        }
        let r = h
            .svc
            .node_stage_volume(Request::new(stage_req(ext4())))
            .await;
        assert_eq!(tool_calls(&h), vec![preen()], "{code_:?}");
        assert_eq!(h.os.mount_depth(STAGING), usize::from(mounted), "{code_:?}");
        match r {
            Ok(_) => assert!(mounted),
            Err(s) => {
                assert!(!mounted, "{code_:?}: {}", s.message());
                assert_eq!(s.code(), Code::FailedPrecondition);
                assert!(s.message().contains("injected failure"), "{}", s.message());
                assert!(h.engine.journal().get("vol-1").is_none());
            }
        }
    }
    // A filesystem moor has just made, and xfs, are not checked.
    let h = harness();
    staged(&h).await;
    assert!(!h.os.calls().contains(&preen()));
    let h = harness();
    for (offset, bytes) in superblock("xfs") {
        h.os.write_device(DEV, offset, &bytes);
    }
    stage_xfs(&h, Mode::SingleNodeWriter).await.expect("xfs");
    assert_eq!(tool_calls(&h), vec![]);
}

/// An interrupted mkfs, then kubelet's unstage (it unstages a stage that failed, or timed out,
/// before it tries again): the unstage ends the staging but not moor's knowledge that it was
/// formatting this device, so kubelet's next stage resumes that mkfs and the volume converges
/// (it used to be refused for ever: the device held unknown data, and the unstage had dropped
/// the only record that it was moor's partial mkfs).
#[tokio::test]
async fn an_unstage_after_an_interrupted_mkfs_keeps_the_intent_and_the_next_stage_converges() {
    let h = harness();
    let req = backed_req;
    mkfs_interrupted(&h).await;
    // kubelet's unstage, and its retry.
    for _ in 0..2 {
        h.svc
            .node_unstage_volume(Request::new(unstage_req()))
            .await
            .expect("unstage");
    }
    // It holds no place and no path (a memory), and the device is not formatted meanwhile.
    assert_eq!(h.engine.volume_counts().staged, 0);
    assert_eq!(mkfs_calls(&h), 1);
    h.os.clear_calls();
    h.svc
        .node_stage_volume(Request::new(req()))
        .await
        .expect("the next stage resumes moor's mkfs");
    assert_eq!(mkfs_calls(&h), 1);
    assert_eq!(h.os.mount_depth(STAGING), 1);
}
