//! NodeStageVolume's device: found by its identity (backing file, serial), waited for, and never another volume's.

use super::*;

const VOL_FILE: &str = "/data/volumes/vol-1.img";

/// A stage request that names the volume by its backing file, with `hint` as devicePath.
fn stage_by_file(hint: Option<&str>) -> csi::NodeStageVolumeRequest {
    let mut r = stage_req(ext4());
    r.publish_context.clear();
    r.publish_context
        .insert("backingFile".into(), VOL_FILE.into());
    if let Some(h) = hint {
        r.publish_context.insert("devicePath".into(), h.into());
    }
    r
}

fn find_calls(h: &Harness) -> Vec<std::time::Duration> {
    h.os.calls()
        .into_iter()
        .filter_map(|c| match c {
            Call::FindDevice(_, wait) => Some(wait),
            _ => None,
        })
        .collect()
}

fn staged_device(h: &Harness) -> Option<PathBuf> {
    h.engine
        .journal()
        .get("vol-1")
        .and_then(|r| r.stage)
        .map(|s| s.device)
}

#[tokio::test]
async fn a_matching_device_path_is_used_without_a_search() {
    let h = harness();
    h.os.set_backing_file((7, 7), VOL_FILE);
    h.svc
        .node_stage_volume(Request::new(stage_by_file(Some(DEV))))
        .await
        .expect("staged");
    assert!(find_calls(&h).is_empty());
    assert_eq!(staged_device(&h).as_deref(), Some(Path::new(DEV)));
}

#[tokio::test]
async fn a_device_present_under_another_name_is_found_at_once() {
    let h = harness();
    h.os.add_device("/dev/loop3", (7, 3), GIB);
    h.os.set_backing_file((7, 3), VOL_FILE);
    // No hint at all, then a hint that names a device that is not there.
    h.svc
        .node_stage_volume(Request::new(stage_by_file(None)))
        .await
        .expect("found by identity");
    assert_eq!(staged_device(&h).as_deref(), Some(Path::new("/dev/loop3")));
    let mounts: Vec<_> =
        h.os.calls()
            .into_iter()
            .filter_map(|c| match c {
                Call::MountFs(m) => Some(m.device),
                _ => None,
            })
            .collect();
    assert_eq!(mounts, vec![PathBuf::from("/dev/loop3")]);
    h.svc
        .node_stage_volume(Request::new(stage_by_file(Some("/dev/loop9"))))
        .await
        .expect("a stale hint is only a hint");
    assert_eq!(
        find_calls(&h),
        vec![EngineConfig::default().discovery_deadline; 2]
    );
}

#[tokio::test]
async fn a_device_that_appears_while_stage_waits_is_used() {
    let h = harness();
    h.os.attach_on_event("/dev/loop4", (7, 4), GIB, "/data/volumes/other.img");
    h.os.attach_on_event("/dev/loop5", (7, 5), GIB, VOL_FILE);
    h.svc
        .node_stage_volume(Request::new(stage_by_file(Some("/dev/loop5"))))
        .await
        .expect("found after an event");
    assert_eq!(staged_device(&h).as_deref(), Some(Path::new("/dev/loop5")));
    assert_eq!(mkfs_calls(&h), 1);
    assert_eq!(h.os.mount_depth(STAGING), 1);
}

#[tokio::test]
async fn a_device_that_never_appears_is_deadline_exceeded() {
    let h = harness();
    let s = h
        .svc
        .node_stage_volume(Request::new(stage_by_file(Some("/dev/loop5"))))
        .await
        .expect_err("never appears");
    assert_eq!(s.code(), Code::DeadlineExceeded);
    assert!(s.message().contains(VOL_FILE), "{}", s.message());
    assert_eq!(find_calls(&h).len(), 1);
    assert!(
        h.os.calls()
            .iter()
            .all(|c| !matches!(c, Call::MountFs(_) | Call::Tool(..) | Call::MakeDir(_)))
    );
    assert!(
        h.engine
            .journal()
            .get("vol-1")
            .and_then(|r| r.stage)
            .is_none()
    );
}

#[tokio::test]
async fn no_event_source_is_unavailable() {
    let h = harness();
    h.os.fail_next("find_device", libc::EPERM);
    assert_eq!(
        code(h.svc.node_stage_volume(Request::new(stage_by_file(None)))).await,
        Code::Unavailable
    );
}

#[tokio::test]
async fn a_reused_device_is_refused_naming_both_identities() {
    let h = harness();
    // loop7 was the volume's; its number now serves another file.
    h.os.set_backing_file((7, 7), "/data/volumes/vol-2.img");
    let s = h
        .svc
        .node_stage_volume(Request::new(stage_by_file(Some(DEV))))
        .await
        .expect_err("refused");
    assert_eq!(s.code(), Code::FailedPrecondition);
    assert!(
        s.message().contains(VOL_FILE) && s.message().contains("vol-2.img"),
        "{}",
        s.message()
    );
    // The search for the right device did not wait: the hint is another volume's.
    assert_eq!(find_calls(&h), vec![std::time::Duration::ZERO]);
    assert_eq!(mkfs_calls(&h), 0);
    assert_eq!(h.os.mount_depth(STAGING), 0);
    // Its file unlinked and recreated under the same name: still not the volume.
    h.os.set_backing_file((7, 7), VOL_FILE);
    h.os.set_backing_file_deleted((7, 7));
    let s = h
        .svc
        .node_stage_volume(Request::new(stage_by_file(Some(DEV))))
        .await
        .expect_err("refused");
    assert_eq!(s.code(), Code::FailedPrecondition);
    assert!(s.message().contains("(deleted)"), "{}", s.message());
    assert_eq!(mkfs_calls(&h), 0);
}

#[tokio::test]
async fn a_conflicting_hint_yields_to_the_volume_attached_elsewhere() {
    let h = harness();
    h.os.set_backing_file((7, 7), "/data/volumes/vol-2.img");
    h.os.add_device("/dev/loop3", (7, 3), GIB);
    h.os.set_backing_file((7, 3), VOL_FILE);
    h.svc
        .node_stage_volume(Request::new(stage_by_file(Some(DEV))))
        .await
        .expect("the volume's own device");
    assert_eq!(staged_device(&h).as_deref(), Some(Path::new("/dev/loop3")));
}

#[tokio::test]
async fn a_disk_is_found_by_serial() {
    let h = harness();
    h.os.add_device("/dev/vdb", (252, 16), GIB);
    h.os.set_serial((252, 16), "vol-0abc");
    let mut r = stage_req(block_cap());
    r.publish_context.clear();
    r.publish_context
        .insert("deviceSerial".into(), "vol-0abc".into());
    h.svc
        .node_stage_volume(Request::new(r))
        .await
        .expect("found by serial");
    assert_eq!(staged_device(&h).as_deref(), Some(Path::new("/dev/vdb")));
}

#[tokio::test]
async fn device_identity_keys_are_validated() {
    let h = harness();
    for (key, value) in [
        ("deviceSerial", ""),
        ("deviceSerial", "a\nb"),
        ("deviceWWN", "   "),
        ("backingFile", "relative.img"),
    ] {
        let mut r = stage_req(ext4());
        r.publish_context.insert(key.into(), value.into());
        assert_eq!(
            code(h.svc.node_stage_volume(Request::new(r))).await,
            Code::InvalidArgument,
            "{key}={value:?}"
        );
    }
    let mut r = stage_req(ext4());
    r.publish_context.clear();
    assert_eq!(
        code(h.svc.node_stage_volume(Request::new(r))).await,
        Code::InvalidArgument
    );
    assert!(find_calls(&h).is_empty());
}
