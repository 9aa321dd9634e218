//! SELinux mount labels through the gRPC service, on the fake OS: kubelet's quoted `context=`
//! flag reaches the filesystem mount unquoted, a publish must carry the stage's label, and a
//! node without SELinux refuses labels before touching anything.

use csi::volume_capability::{AccessMode, AccessType, MountVolume, access_mode::Mode};
use moor_proto::csi::v1 as csi;
use moor_proto::csi::v1::node_server::Node;
use tonic::{Code, Request};

use crate::service_tests::{Harness, STAGING, TARGET, harness, publish_req, stage_req};
use crate::sys::fake::Call;

/// The label as kubelet sends it (`context=%q`).
const POD_A: &str = r#"context="system_u:object_r:container_file_t:s0:c15,c25""#;
/// What the kernel gets.
const POD_A_OPTION: &str = "context=system_u:object_r:container_file_t:s0:c15,c25";
/// Another pod's label.
const POD_B: &str = r#"context="system_u:object_r:container_file_t:s0:c7,c8""#;

/// A single-writer ext4 capability with `flags`.
fn cap(flags: &[&str]) -> csi::VolumeCapability {
    csi::VolumeCapability {
        access_mode: Some(AccessMode {
            mode: Mode::SingleNodeSingleWriter as i32,
        }),
        access_type: Some(AccessType::Mount(MountVolume {
            fs_type: "ext4".into(),
            mount_flags: flags.iter().map(|f| (*f).to_string()).collect(),
            volume_mount_group: String::new(),
        })),
    }
}

fn selinux_node() -> Harness {
    let h = harness();
    h.os.set_selinux(true);
    h
}

async fn stage(h: &Harness, flags: &[&str]) -> Result<(), tonic::Status> {
    h.svc
        .node_stage_volume(Request::new(stage_req(cap(flags))))
        .await
        .map(drop)
}

async fn publish(h: &Harness, flags: &[&str]) -> Result<(), tonic::Status> {
    h.svc
        .node_publish_volume(Request::new(publish_req(cap(flags), false)))
        .await
        .map(drop)
}

fn mount_options(h: &Harness) -> Vec<Vec<String>> {
    h.os.calls()
        .into_iter()
        .filter_map(|c| match c {
            Call::MountFs(m) => Some(m.options),
            _ => None,
        })
        .collect()
}

fn binds(h: &Harness) -> usize {
    h.os.calls()
        .iter()
        .filter(|c| matches!(c, Call::Bind(_)))
        .count()
}

fn code(r: Result<(), tonic::Status>) -> Code {
    r.err().map_or(Code::Ok, |s| s.code())
}

#[tokio::test]
async fn kubelets_label_reaches_the_filesystem_mount_and_the_publish_shares_it() {
    let h = selinux_node();
    stage(&h, &["noatime", POD_A]).await.expect("stage");
    assert_eq!(mount_options(&h), [vec![POD_A_OPTION.to_string()]]);
    publish(&h, &["noatime", POD_A]).await.expect("publish");
    assert_eq!(h.os.mount_depth(TARGET), 1);
    // Retries of both are the same success, with nothing mounted twice.
    stage(&h, &["noatime", POD_A]).await.expect("stage again");
    publish(&h, &["noatime", POD_A])
        .await
        .expect("publish again");
    assert_eq!(mount_options(&h).len(), 1);
    assert_eq!(
        (h.os.mount_depth(STAGING), h.os.mount_depth(TARGET)),
        (1, 1)
    );
}

#[tokio::test]
async fn a_restage_with_another_label_is_already_exists() {
    let h = selinux_node();
    stage(&h, &[POD_A]).await.expect("stage");
    let e = stage(&h, &[POD_B]).await.unwrap_err();
    assert_eq!(e.code(), Code::AlreadyExists, "{e:?}");
    assert_eq!(code(stage(&h, &[]).await), Code::AlreadyExists);
    assert_eq!(mount_options(&h).len(), 1, "mounted once");
    assert_eq!(h.os.mount_depth(STAGING), 1);
}

#[tokio::test]
async fn a_publish_must_carry_the_stages_label() {
    let h = selinux_node();
    stage(&h, &[POD_A]).await.expect("stage");
    // Another label, or none, cannot be had from a bind of the labelled filesystem.
    for flags in [&[POD_B][..], &[]] {
        let e = publish(&h, flags).await.unwrap_err();
        assert_eq!(e.code(), Code::FailedPrecondition, "{flags:?}: {e:?}");
        assert!(e.message().contains("c15,c25"), "{}", e.message());
    }
    assert_eq!(binds(&h), 0);
    assert_eq!(h.os.mount_depth(TARGET), 0);
    // Once published with it, the same target with another label: ALREADY_EXISTS.
    publish(&h, &[POD_A]).await.expect("publish");
    assert_eq!(code(publish(&h, &[POD_B]).await), Code::AlreadyExists);
    assert_eq!(binds(&h), 1);
}

#[tokio::test]
async fn a_stage_without_a_label_takes_no_labelled_publish() {
    let h = selinux_node();
    stage(&h, &[]).await.expect("stage");
    assert_eq!(code(publish(&h, &[POD_A]).await), Code::FailedPrecondition);
    assert_eq!(binds(&h), 0);
}

#[tokio::test]
async fn a_node_without_selinux_refuses_labels_and_touches_nothing() {
    let h = harness();
    let e = stage(&h, &[POD_A]).await.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    assert!(e.message().contains("kernel has none"), "{}", e.message());
    assert!(h.os.calls().is_empty(), "{:?}", h.os.calls());
    assert!(h.engine.journal().get("vol-1").is_none());
    // Staged without a label, a labelled publish is refused for the same reason.
    stage(&h, &[]).await.expect("stage");
    let e = publish(&h, &[POD_A]).await.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition);
    assert!(e.message().contains("kernel has none"), "{}", e.message());
    assert_eq!(binds(&h), 0);
}

#[tokio::test]
async fn a_label_the_policy_does_not_know_is_refused_before_anything() {
    // Debian's reference policy: kubelet's container_file_t (from its lxc_contexts) is not a
    // type of the policy, and the kernel would refuse the mount only after mkfs.
    let h = selinux_node();
    h.os.set_label_unknown(POD_A_OPTION.trim_start_matches("context="));
    let e = stage(&h, &[POD_A]).await.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    assert!(
        e.message().contains("policy does not know"),
        "{}",
        e.message()
    );
    assert!(h.os.calls().is_empty(), "{:?}", h.os.calls());
    assert!(h.engine.journal().get("vol-1").is_none());
    // Another label, which the policy knows, stages.
    stage(&h, &[POD_B]).await.expect("stage with a known label");
    assert_eq!(mount_options(&h).len(), 1);
}

#[tokio::test]
async fn malformed_labels_are_invalid_argument() {
    let h = selinux_node();
    for flags in [
        [r#"context="system_u:object_r:container_file_t:s0:c15,c25"#],
        ["context=system_u:object_r:container_file_t:s0:c15,c25"],
        [r#"context="container_file_t""#],
    ] {
        assert_eq!(
            code(stage(&h, &flags).await),
            Code::InvalidArgument,
            "{flags:?}"
        );
    }
    assert!(h.os.calls().is_empty());
}
