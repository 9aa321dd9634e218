//! volume_mount_group through the gRPC service, on the fake OS: where the volume is given to
//! the group (stage, a stage found already mounted, publish), where it is not (read-only), and
//! a walk past its deadline leaves nothing mounted or published.

use csi::volume_capability::{AccessMode, AccessType, MountVolume, access_mode::Mode};
use moor_proto::csi::v1 as csi;
use moor_proto::csi::v1::node_server::Node;
use tonic::{Code, Request};

use crate::service_tests::{Harness, STAGING, TARGET, harness, publish_req, stage_req};
use crate::sys::fake::Call;

fn cap(group: &str, mode: Mode) -> csi::VolumeCapability {
    csi::VolumeCapability {
        access_mode: Some(AccessMode { mode: mode as i32 }),
        access_type: Some(AccessType::Mount(MountVolume {
            fs_type: "ext4".into(),
            mount_flags: vec![],
            volume_mount_group: group.into(),
        })),
    }
}

fn rw(group: &str) -> csi::VolumeCapability {
    cap(group, Mode::SingleNodeMultiWriter)
}

async fn stage(h: &Harness, c: csi::VolumeCapability) -> Result<(), tonic::Status> {
    h.svc
        .node_stage_volume(Request::new(stage_req(c)))
        .await
        .map(drop)
}

async fn publish(
    h: &Harness,
    c: csi::VolumeCapability,
    readonly: bool,
) -> Result<(), tonic::Status> {
    h.svc
        .node_publish_volume(Request::new(publish_req(c, readonly)))
        .await
        .map(drop)
}

/// The groups the volume was given, with the path each time.
fn shares(h: &Harness) -> Vec<(String, u32)> {
    h.os.calls()
        .into_iter()
        .filter_map(|c| match c {
            Call::ShareWithGroup(p, g) => Some((p.display().to_string(), g)),
            _ => None,
        })
        .collect()
}

fn staging(gid: u32) -> (String, u32) {
    (STAGING.to_string(), gid)
}

#[tokio::test]
async fn stage_and_publish_give_the_staged_filesystem_to_the_group() {
    let h = harness();
    stage(&h, rw("2345")).await.expect("stage");
    assert_eq!(shares(&h), [staging(2345)]);
    h.os.clear_calls();
    publish(&h, rw("2345"), false).await.expect("publish");
    // Before the pod sees it: the share comes before the bind.
    let calls = h.os.calls();
    let share = calls
        .iter()
        .position(|c| matches!(c, Call::ShareWithGroup(..)));
    let bind = calls.iter().position(|c| matches!(c, Call::Bind(_)));
    assert!(share.is_some() && share < bind, "{calls:?}");
    assert_eq!(shares(&h), [staging(2345)]);
    // A second pod with another group: the last one given wins, as with kubelet.
    h.os.clear_calls();
    let other = "/var/lib/kubelet/pods/p2/volumes/kubernetes.io~csi/pv1/mount";
    h.os.add_dir("/var/lib/kubelet/pods/p2/volumes/kubernetes.io~csi/pv1");
    let mut req = publish_req(rw("3000"), false);
    req.target_path = other.into();
    h.svc
        .node_publish_volume(Request::new(req))
        .await
        .expect("second publish");
    assert_eq!(shares(&h), [staging(3000)]);
}

#[tokio::test]
async fn a_stage_found_mounted_is_given_to_the_group_again() {
    // A crash after the mount may have cut the walk short; the retry finishes it (the root
    // check makes it one stat when it had finished).
    let h = harness();
    stage(&h, rw("2345")).await.expect("stage");
    stage(&h, rw("2345")).await.expect("retry");
    assert_eq!(shares(&h), [staging(2345), staging(2345)]);
    assert_eq!(h.os.mount_depth(STAGING), 1);
}

#[tokio::test]
async fn read_only_volumes_are_left_as_they_are() {
    let h = harness();
    // A reader never formats: the device holds a filesystem already.
    for (offset, bytes) in crate::sys::fake::superblock("ext4") {
        h.os.write_device(crate::service_tests::DEV, offset, &bytes);
    }
    stage(&h, cap("2345", Mode::SingleNodeReaderOnly))
        .await
        .expect("stage");
    publish(&h, cap("2345", Mode::SingleNodeReaderOnly), false)
        .await
        .expect("publish");
    assert!(shares(&h).is_empty());

    let h = harness();
    stage(&h, rw("")).await.expect("stage without a group");
    publish(&h, rw("2345"), true)
        .await
        .expect("read-only publish");
    assert!(shares(&h).is_empty());
}

#[tokio::test]
async fn a_stage_walk_past_its_deadline_leaves_nothing_mounted() {
    let h = harness();
    h.os.fail_next("share_deadline", 0);
    let e = stage(&h, rw("2345")).await.unwrap_err();
    assert_eq!(e.code(), Code::DeadlineExceeded, "{e:?}");
    assert_eq!(h.os.mount_depth(STAGING), 0);
    assert!(
        h.engine
            .journal()
            .get("vol-1")
            .is_none_or(|r| r.stage.is_none())
    );
    // The retry mounts and walks again.
    stage(&h, rw("2345")).await.expect("retry");
    assert_eq!(h.os.mount_depth(STAGING), 1);
}

#[tokio::test]
async fn a_publish_walk_past_its_deadline_publishes_nothing() {
    let h = harness();
    stage(&h, rw("")).await.expect("stage");
    h.os.fail_next("share_deadline", 0);
    let e = publish(&h, rw("2345"), false).await.unwrap_err();
    assert_eq!(e.code(), Code::DeadlineExceeded, "{e:?}");
    assert_eq!(h.os.mount_depth(TARGET), 0);
    assert!(
        h.engine
            .journal()
            .get("vol-1")
            .is_some_and(|r| r.publishes.is_empty())
    );
    publish(&h, rw("2345"), false).await.expect("retry");
    assert_eq!(h.os.mount_depth(TARGET), 1);
}
