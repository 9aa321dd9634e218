//! NodeStageVolume and NodeUnstageVolume: formatting a blank device once, mounting, growing, the error rows.

use super::*;

#[tokio::test]
async fn stage_formats_a_blank_device_once_and_mounts_it() {
    let h = harness();
    staged(&h).await;
    let calls = h.os.calls();
    let mkfs: Vec<_> = calls
        .iter()
        .filter_map(|c| match c {
            Call::Tool(p, a) => Some((p.clone(), a.clone())),
            _ => None,
        })
        .collect();
    assert_eq!(mkfs.len(), 1);
    assert_eq!(mkfs[0].0, "mkfs.ext4");
    assert!(
        mkfs[0].1.iter().any(|a| a.contains("lazy_itable_init=1")),
        "{mkfs:?}"
    );
    assert!(
        mkfs[0].1.iter().any(|a| a.contains("nodiscard")),
        "{mkfs:?}"
    );
    assert_eq!(h.os.mount_depth(STAGING), 1);
    // A repeat is OK and does nothing.
    h.os.clear_calls();
    staged(&h).await;
    assert_eq!(mkfs_calls(&h), 0);
    assert_eq!(h.os.mount_depth(STAGING), 1);
}

#[tokio::test]
async fn stage_xfs_always_mounts_with_nouuid() {
    let h = harness();
    h.svc
        .node_stage_volume(Request::new(stage_req(mount_cap(
            "xfs",
            &["noatime"],
            Mode::SingleNodeWriter,
        ))))
        .await
        .expect("stage");
    let m = h.os.calls().into_iter().find_map(|c| match c {
        Call::MountFs(m) => Some(m),
        _ => None,
    });
    let m = m.expect("mounted");
    assert_eq!(m.fs_type, "xfs");
    assert!(m.options.contains(&"nouuid".to_string()));
    assert_eq!(m.attrs.atime, crate::sys::Atime::None);
}

#[tokio::test]
async fn stage_of_a_device_with_another_filesystem_fails_and_touches_nothing() {
    let h = harness();
    for (offset, bytes) in superblock("xfs") {
        h.os.write_device(DEV, offset, &bytes);
    }
    let r = h
        .svc
        .node_stage_volume(Request::new(stage_req(ext4())))
        .await;
    let s = r.expect_err("must fail");
    assert_eq!(s.code(), Code::FailedPrecondition);
    assert!(s.message().contains("xfs"), "{}", s.message());
    assert_eq!(mkfs_calls(&h), 0);
    assert_eq!(h.os.mount_depth(STAGING), 0);
    assert!(h.engine.journal().get("vol-1").is_none());
}

#[tokio::test]
async fn stage_never_formats_partition_tables_or_unknown_data() {
    for (offset, bytes) in [
        (512u64, b"EFI PART".to_vec()),
        (1_000_000, vec![0xAB]),
        (GIB - 100, vec![1]),
        (0, b"LUKS\xba\xbe\x00\x02".to_vec()),
    ] {
        let h = harness();
        h.os.write_device(DEV, offset, &bytes);
        let c = code(h.svc.node_stage_volume(Request::new(stage_req(ext4())))).await;
        assert_eq!(c, Code::FailedPrecondition, "data at {offset}");
        assert_eq!(mkfs_calls(&h), 0, "data at {offset}");
    }
}

#[tokio::test]
async fn stage_never_formats_a_luks2_device_whose_start_was_wiped() {
    // A LUKS2 secondary header past the head window (metadata of 1, 2 or 4 MiB) with all
    // else zero: cryptsetup still opens it, so it is LUKS, never blank.
    for offset in [0x10_0000u64, 0x20_0000, 0x40_0000] {
        let h = harness();
        h.os.write_device(DEV, offset, b"SKUL\xba\xbe\x00\x02");
        let s = h
            .svc
            .node_stage_volume(Request::new(stage_req(ext4())))
            .await
            .expect_err("must fail");
        assert_eq!(s.code(), Code::FailedPrecondition, "header at {offset:#x}");
        assert!(s.message().contains("LUKS2"), "{}", s.message());
        assert_eq!(mkfs_calls(&h), 0, "header at {offset:#x}");
    }
}

#[test]
fn a_probe_sees_only_its_own_device_through_the_reused_buffer() {
    // The probe's buffer is kept between probes; what one device put in it must never
    // decide what the next one is.
    let h = harness();
    let small = "/dev/loop8";
    let other = "/dev/loop9";
    h.os.add_device(small, (7, 8), 300 * 1024);
    h.os.add_device(other, (7, 9), GIB);
    // A blank device as large as DEV, one smaller than the windows, and one shorter than it
    // is said to be (it shrank since), whose reads come back short.
    for (dev, size) in [(other, GIB), (small, 300 * 1024), (small, GIB)] {
        for (offset, bytes) in [(1_000_000u64, vec![0xAB]), (GIB - 100, vec![1])] {
            h.os.write_device(DEV, offset, &bytes);
            let dirty = h.engine.probe_device(Path::new(DEV), GIB).expect("probe");
            assert!(!dirty.is_blank(), "data at {offset}");
            h.os.write_device(DEV, offset, &vec![0; bytes.len()]);
            let c = h.engine.probe_device(Path::new(dev), size).expect("probe");
            assert!(c.is_blank(), "{dev} ({size}) after data at {offset}: {c:?}");
        }
    }
    // And a formatted device is still known after the blank ones, by its first bytes.
    for (offset, bytes) in superblock("xfs") {
        h.os.write_device(small, offset, &bytes);
    }
    let c = h.engine.probe_device(Path::new(small), 300 * 1024);
    assert!(
        matches!(c, Ok(crate::superblock::Content::Filesystem { .. })),
        "{c:?}"
    );
}

#[tokio::test]
async fn stage_of_an_existing_matching_filesystem_mounts_without_mkfs() {
    let h = harness();
    for (offset, bytes) in superblock("ext4") {
        h.os.write_device(DEV, offset, &bytes);
    }
    staged(&h).await;
    assert_eq!(mkfs_calls(&h), 0);
    assert_eq!(h.os.mount_depth(STAGING), 1);
}

#[tokio::test]
async fn stage_error_rows() {
    let h = harness();
    // Volume does not exist (the device is not on this node): NOT_FOUND.
    let mut r = stage_req(ext4());
    r.publish_context
        .insert("devicePath".into(), "/dev/loop99".into());
    assert_eq!(
        code(h.svc.node_stage_volume(Request::new(r))).await,
        Code::NotFound
    );
    // Missing fields: INVALID_ARGUMENT.
    for mutate in [
        (|r: &mut csi::NodeStageVolumeRequest| r.volume_id.clear()) as fn(&mut _),
        |r| r.staging_target_path.clear(),
        |r| r.volume_capability = None,
        |r| r.publish_context.clear(),
        |r| r.staging_target_path = "/etc/globalmount".into(),
        |r| r.staging_target_path = format!("{K}/plugins/../../../etc"),
        |r| r.staging_target_path = "relative/path".into(),
        |r| r.volume_id = "x".repeat(129),
        |r| r.volume_capability = Some(mount_cap("vfat", &[], Mode::SingleNodeWriter)),
        |r| r.volume_capability = Some(mount_cap("ext4", &["bind"], Mode::SingleNodeWriter)),
        |r| r.volume_capability = Some(mount_cap("ext4", &[], Mode::Unknown)),
        |r| {
            r.publish_context
                .insert("devicePath".into(), "/etc/passwd".into())
                .map(drop)
                .unwrap_or(())
        },
    ] {
        let mut r = stage_req(ext4());
        mutate(&mut r);
        assert_eq!(
            code(h.svc.node_stage_volume(Request::new(r.clone()))).await,
            Code::InvalidArgument,
            "{r:?}"
        );
    }
    assert!(
        h.os.calls()
            .iter()
            .all(|c| !matches!(c, Call::MountFs(_) | Call::Tool(..) | Call::MakeDir(_)))
    );
    // Exceeds capabilities: a multi-node writer on a node-local filesystem.
    let r = stage_req(mount_cap("ext4", &[], Mode::MultiNodeMultiWriter));
    assert_eq!(
        code(h.svc.node_stage_volume(Request::new(r))).await,
        Code::FailedPrecondition
    );
    // Staged, then the same volume and path with another capability: ALREADY_EXISTS.
    staged(&h).await;
    let r = stage_req(mount_cap("ext4", &["noatime"], Mode::SingleNodeWriter));
    assert_eq!(
        code(h.svc.node_stage_volume(Request::new(r))).await,
        Code::AlreadyExists
    );
}

#[tokio::test]
async fn a_device_backed_by_another_file_is_never_used() {
    let h = harness();
    h.os.set_backing_file((7, 7), "/data/volumes/other.img");
    let mut r = stage_req(ext4());
    r.publish_context
        .insert("backingFile".into(), "/data/volumes/vol-1.img".into());
    let s = h
        .svc
        .node_stage_volume(Request::new(r.clone()))
        .await
        .expect_err("refused");
    assert_eq!(s.code(), Code::FailedPrecondition);
    assert!(s.message().contains("other.img"), "{}", s.message());
    assert_eq!(mkfs_calls(&h), 0);
    assert_eq!(h.os.mount_depth(STAGING), 0);
    h.os.set_backing_file((7, 7), "/data/volumes/vol-1.img");
    h.svc
        .node_stage_volume(Request::new(r))
        .await
        .expect("the right device");
}

#[tokio::test]
async fn stage_with_an_operation_in_flight_is_aborted() {
    let h = harness();
    let guard = h.engine.locks().try_lock("vol-1").expect("lock");
    assert_eq!(
        code(h.svc.node_stage_volume(Request::new(stage_req(ext4())))).await,
        Code::Aborted
    );
    drop(guard);
    staged(&h).await;
}

#[tokio::test]
async fn stage_beyond_max_volumes_is_resource_exhausted() {
    let h = harness_with(1);
    staged(&h).await;
    h.os.add_device("/dev/loop8", (7, 8), GIB);
    let mut r = stage_req(ext4());
    r.volume_id = "vol-2".into();
    r.publish_context
        .insert("devicePath".into(), "/dev/loop8".into());
    r.staging_target_path = format!("{K}/plugins/kubernetes.io/csi/moor.csi.io/abc/g2");
    assert_eq!(
        code(h.svc.node_stage_volume(Request::new(r))).await,
        Code::ResourceExhausted
    );
}

#[tokio::test]
async fn node_get_info_is_cheap_and_says_the_limit_the_stage_enforces() {
    // kubelet asks every nodeAllocatableUpdatePeriodSeconds (and after an attach refused with
    // RESOURCE_EXHAUSTED) and writes the answer to the CSINode's allocatable count, from which the
    // scheduler subtracts the volumes of the pods it placed here: the answer is the node's
    // whole limit, the one NodeStageVolume enforces, read without touching the node.
    let h = harness_with(2);
    staged(&h).await;
    h.os.clear_calls();
    let info = || async {
        h.svc
            .node_get_info(Request::new(csi::NodeGetInfoRequest {}))
            .await
            .expect("info")
            .into_inner()
            .max_volumes_per_node
    };
    assert_eq!(info().await, 2);
    assert_eq!(h.os.calls(), vec![], "NodeGetInfo asks nothing of the OS");
    // Two staged: the next stage is refused, RESOURCE_EXHAUSTED.
    h.os.add_device("/dev/loop8", (7, 8), GIB);
    h.os.add_device("/dev/loop9", (7, 9), GIB);
    let stage = |id: &str, dev: &str| {
        let mut r = stage_req(ext4());
        r.volume_id = id.into();
        r.publish_context.insert("devicePath".into(), dev.into());
        r.staging_target_path = format!("{K}/plugins/kubernetes.io/csi/moor.csi.io/abc/{id}");
        r
    };
    h.svc
        .node_stage_volume(Request::new(stage("vol-2", "/dev/loop8")))
        .await
        .expect("second stage");
    assert_eq!(
        code(
            h.svc
                .node_stage_volume(Request::new(stage("vol-3", "/dev/loop9")))
        )
        .await,
        Code::ResourceExhausted
    );
    assert_eq!(info().await, 2);
}

#[tokio::test]
async fn failed_mount_leaves_nothing_behind() {
    let h = harness();
    h.os.fail_next("mount_fs", libc::EINVAL);
    assert_eq!(
        code(h.svc.node_stage_volume(Request::new(stage_req(ext4())))).await,
        Code::Internal
    );
    assert_eq!(h.os.mount_depth(STAGING), 0);
    assert!(h.engine.journal().get("vol-1").is_none());
    // And the retry works, without formatting again.
    h.os.clear_calls();
    staged(&h).await;
    assert_eq!(mkfs_calls(&h), 0);
}

/// Puts on DEV an xfs superblock giving the filesystem `size` bytes (4 KiB blocks).
fn xfs_of_size(h: &Harness, size: u64) {
    let mut sb = vec![0u8; 16];
    sb[..4].copy_from_slice(b"XFSB");
    sb[4..8].copy_from_slice(&4096u32.to_be_bytes());
    sb[8..16].copy_from_slice(&(size / 4096).to_be_bytes());
    h.os.write_device(DEV, 0, &sb);
}

#[tokio::test]
async fn stage_grows_a_filesystem_smaller_than_its_device() {
    // A volume restored from a 512 MiB snapshot into 1 GiB: the spec has it present 1 GiB.
    let h = harness();
    xfs_of_size(&h, 512 << 20);
    stage_xfs(&h, Mode::SingleNodeWriter).await.expect("stage");
    assert_eq!(
        tool_calls(&h),
        vec![Call::Tool("xfs_growfs".into(), vec![STAGING.into()])]
    );
    // The tool grew it: a retry confirms without growing again.
    xfs_of_size(&h, GIB);
    h.os.clear_calls();
    stage_xfs(&h, Mode::SingleNodeWriter)
        .await
        .expect("stage again");
    assert_eq!(tool_calls(&h), vec![]);
}

#[tokio::test]
async fn stage_leaves_a_filesystem_that_fills_its_device_or_is_read_only() {
    // What a tool leaves unused at the end (less than GROW_MIN) is not grown into.
    let h = harness();
    xfs_of_size(&h, GIB - crate::engine::GROW_MIN + 4096);
    stage_xfs(&h, Mode::SingleNodeWriter).await.expect("stage");
    assert_eq!(tool_calls(&h), vec![]);
    // A volume staged read-only cannot be written, so it is not grown either.
    let h = harness();
    xfs_of_size(&h, 512 << 20);
    stage_xfs(&h, Mode::MultiNodeReaderOnly)
        .await
        .expect("stage read-only");
    assert_eq!(tool_calls(&h), vec![]);
}

#[tokio::test]
async fn stage_whose_growth_fails_leaves_nothing_behind() {
    let h = harness();
    // ext4 of 512 MiB (4 KiB blocks) on the 1 GiB device; resize2fs then fails.
    h.os.write_device(DEV, 1024, &{
        let mut sb = vec![0u8; 0x68];
        sb[0x04..0x08].copy_from_slice(&131_072u32.to_le_bytes());
        sb[0x18..0x1C].copy_from_slice(&2u32.to_le_bytes());
        sb[0x38..0x3A].copy_from_slice(&0xEF53u16.to_le_bytes());
        sb[0x5C] = 0x04;
        sb[0x60] = 0x40;
        sb
    });
    h.os.fail_tool("resize2fs", 1);
    assert_eq!(
        code(h.svc.node_stage_volume(Request::new(stage_req(ext4())))).await,
        Code::Internal
    );
    assert_eq!(
        tool_calls(&h),
        vec![
            Call::Tool("e2fsck".into(), vec!["-p".into(), DEV.into()]),
            Call::Tool("resize2fs".into(), vec![DEV.into()])
        ]
    );
    assert_eq!(h.os.mount_depth(STAGING), 0);
    assert!(h.engine.journal().get("vol-1").is_none());
}

#[tokio::test]
async fn stage_applies_volume_mount_group() {
    let h = harness();
    let mut cap = ext4();
    if let Some(AccessType::Mount(m)) = cap.access_type.as_mut() {
        m.volume_mount_group = "2000".into();
    }
    h.svc
        .node_stage_volume(Request::new(stage_req(cap)))
        .await
        .expect("stage");
    assert!(
        h.os.calls()
            .contains(&Call::ShareWithGroup(STAGING.into(), 2000))
    );
}

#[tokio::test]
async fn block_stage_mounts_nothing() {
    let h = harness();
    h.svc
        .node_stage_volume(Request::new(stage_req(block_cap())))
        .await
        .expect("stage");
    assert_eq!(mkfs_calls(&h), 0);
    assert_eq!(h.os.mount_depth(STAGING), 0);
}

#[tokio::test]
async fn unstage_while_published_fails_then_succeeds() {
    let h = harness();
    staged(&h).await;
    h.svc
        .node_publish_volume(Request::new(publish_req(ext4(), false)))
        .await
        .expect("publish");
    assert_eq!(
        code(h.svc.node_unstage_volume(Request::new(unstage_req()))).await,
        Code::FailedPrecondition
    );
    assert_eq!(h.os.mount_depth(STAGING), 1);
    h.svc
        .node_unpublish_volume(Request::new(unpublish_req(TARGET)))
        .await
        .expect("unpublish");
    for _ in 0..2 {
        h.svc
            .node_unstage_volume(Request::new(unstage_req()))
            .await
            .expect("unstage");
        assert_eq!(h.os.mount_depth(STAGING), 0);
    }
    assert!(h.engine.journal().get("vol-1").is_none());
    // Stage again: the filesystem is there, no mkfs.
    h.os.clear_calls();
    staged(&h).await;
    assert_eq!(mkfs_calls(&h), 0);
}

#[tokio::test]
async fn unstage_of_a_corrupted_staging_mount_detaches_it() {
    let h = harness();
    staged(&h).await;
    h.os.corrupt(STAGING, libc::EIO);
    h.svc
        .node_unstage_volume(Request::new(unstage_req()))
        .await
        .expect("unstage");
    assert!(h.os.calls().contains(&Call::Unmount(STAGING.into(), true)));
}

/// A reboot hands out device numbers afresh: the volume's device may come back at the same path
/// with another number. The filesystem moor made for the volume (by its UUID) is staged again,
/// unformatted; another filesystem at that path is refused, and so is a blank device.
#[tokio::test]
async fn a_device_renumbered_by_a_reboot_is_staged_again_by_its_filesystem() {
    let h = harness();
    staged(&h).await;
    let data = h.os.device_data(DEV);
    let reboot = |rdev: (u32, u32), data: &[(u64, Vec<u8>)]| {
        h.os.force_unmount(STAGING);
        h.os.remove_device(DEV);
        h.os.add_device(DEV, rdev, GIB);
        for (offset, bytes) in data {
            h.os.write_device(DEV, *offset, bytes);
        }
    };
    reboot((7, 99), &data);
    h.os.clear_calls();
    staged(&h).await;
    assert_eq!(mkfs_calls(&h), 0);
    assert_eq!(h.os.mount_depth(STAGING), 1);
    // The record follows the device: a second reboot renumbers it again.
    let data = h.os.device_data(DEV);
    reboot((7, 98), &data);
    staged(&h).await;
    for other in [
        crate::sys::fake::superblock_with_uuid(
            "ext4",
            Some("0b1c2d3e-4f50-4617-8293-a4b5c6d7e8f9"),
        ),
        Vec::new(),
    ] {
        reboot((7, 97), &other);
        h.os.clear_calls();
        let e = h
            .svc
            .node_stage_volume(Request::new(stage_req(mount_cap(
                "ext4",
                &[],
                Mode::SingleNodeWriter,
            ))))
            .await
            .expect_err("another device at the path");
        assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
        assert_eq!(mkfs_calls(&h), 0);
        assert_eq!(h.os.mount_depth(STAGING), 0);
    }
}

/// Issue 38, point 6, the first cause is the error (longhorn #12006: a failure whose cleanup
/// failed too answered with the cleanup's error, hiding why the call failed): the mount fails
/// and dropping its record fails too; the answer is the mount's failure, the journal's named
/// beside it, and the retry converges.
#[tokio::test]
async fn a_failed_mount_whose_record_cannot_be_dropped_answers_the_mount_failure() {
    let h = harness();
    h.os.fail_next("mount_fs", libc::EINVAL);
    // The intents before mkfs and before the mount are written; the record's removal after
    // the mount failed fails.
    h.engine.journal().fail_put_after(2);
    let err = h
        .svc
        .node_stage_volume(Request::new(stage_req(ext4())))
        .await
        .expect_err("the mount fails");
    // The mount's failure first, the journal's beside it.
    in_order(err.message(), &["Invalid argument", "Input/output error"]);
    assert_eq!(err.code(), Code::Internal);
    assert_eq!(h.os.mount_depth(STAGING), 0);
    staged(&h).await;
    assert_eq!(h.os.mount_depth(STAGING), 1);
}

/// Issue 38, point 6 (longhorn #12006): a step after the mount fails (giving the volume to its
/// pod's group), and undoing the mount fails too. The answer is the first cause, the unmount's
/// failure beside it; the mount that could not be undone keeps its record, and kubelet's retry
/// stages the volume once, on that mount.
#[tokio::test]
async fn a_failed_stage_whose_unmount_fails_answers_the_first_cause_and_converges() {
    let h = harness();
    let mut cap = ext4();
    if let Some(AccessType::Mount(m)) = cap.access_type.as_mut() {
        m.volume_mount_group = "2000".into();
    }
    h.os.fail_next("share", libc::EROFS);
    h.os.fail_next("unmount", libc::EBUSY);
    let err = h
        .svc
        .node_stage_volume(Request::new(stage_req(cap.clone())))
        .await
        .expect_err("the group step fails");
    // The group step's failure first, the unmount's beside it.
    in_order(err.message(), &["Read-only file system", "busy"]);
    assert_eq!(h.os.mount_depth(STAGING), 1, "the unmount failed");
    let kept = h.engine.journal().get("vol-1").and_then(|r| r.stage);
    assert!(
        kept.is_some(),
        "a mount left in place keeps its record, as after a crash"
    );
    h.os.clear_calls();
    h.svc
        .node_stage_volume(Request::new(stage_req(cap)))
        .await
        .expect("the retry");
    assert_eq!(h.os.mount_depth(STAGING), 1, "staged once");
    assert_eq!(mkfs_calls(&h), 0, "never formatted again");
    assert_eq!(
        h.engine
            .journal()
            .get("vol-1")
            .and_then(|r| r.stage)
            .map(|s| s.phase),
        Some(crate::journal::Phase::Done)
    );
}

/// Issue 38, point 5 (linstor-csi #385: a filesystem check ran on a device that was mounted,
/// and corrupted it): a volume staged and published for two pods, then a stage of another
/// volume naming the same device (kubelet's stage of a second PV on it). Nothing checks or
/// formats the mounted device, and the pods' mounts stay.
#[tokio::test]
async fn a_stage_of_a_device_mounted_for_pods_never_checks_or_formats_it() {
    let h = harness();
    let shared = || mount_cap("ext4", &[], Mode::SingleNodeMultiWriter);
    h.svc
        .node_stage_volume(Request::new(stage_req(shared())))
        .await
        .expect("stage");
    let second = "/var/lib/kubelet/pods/p2/volumes/kubernetes.io~csi/pv1/mount";
    h.os.add_dir(Path::new(second).parent().unwrap_or(Path::new("/")));
    for target in [TARGET, second] {
        let mut r = publish_req(shared(), false);
        r.target_path = target.into();
        h.svc
            .node_publish_volume(Request::new(r))
            .await
            .expect("publish");
    }
    h.os.clear_calls();
    let mut other = stage_req(ext4());
    other.volume_id = "vol-2".into();
    other.staging_target_path =
        format!("{K}/plugins/kubernetes.io/csi/moor.csi.io/def/globalmount");
    h.os.add_dir(format!("{K}/plugins/kubernetes.io/csi/moor.csi.io/def"));
    // The answer is the CO's business (a second volume naming the same device); what it
    // must never do is check or format the filesystem the pods use.
    let _ = h.svc.node_stage_volume(Request::new(other)).await;
    assert!(
        tool_calls(&h).is_empty(),
        "a tool ran on the mounted device: {:?}",
        tool_calls(&h)
    );
    assert_eq!((h.os.mount_depth(TARGET), h.os.mount_depth(second)), (1, 1));
    assert_eq!(mkfs_calls(&h), 0);
}
