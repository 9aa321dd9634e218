//! A volume's QoS limits in its pod's cgroup at NodePublishVolume, on fake cgroup trees:
//! cgroup v1 blkio and v2 `io.max`, kubelet's cgroupfs and systemd layouts, the pod named by
//! kubelet or by the target path, what cannot be applied (a health entry, the publication
//! still made), what the kernel refuses (INVALID_ARGUMENT, nothing mounted), the rule's
//! removal at NodeUnpublishVolume, and no search for one when the publication set no limits.

use super::health::health;
use super::*;
use crate::engine::QosOutcome;
use moor_runtime::contract::QOS_LIMITS_KEY;

use csi::VolumeHealthErrorType as V;

const UID: &str = "0b6c0e6e-1d3f-4c55-9a8b-2f1e2f3a4b5c";
const CG: &str = "/sys/fs/cgroup";
const V1_FILES: [&str; 4] = [
    "blkio.throttle.read_bps_device",
    "blkio.throttle.write_bps_device",
    "blkio.throttle.read_iops_device",
    "blkio.throttle.write_iops_device",
];

fn pod_target() -> String {
    format!("{K}/pods/{UID}/volumes/kubernetes.io~csi/pv1/mount")
}

/// A cgroup v1 host whose blkio hierarchy has the pod's cgroup at `pod_dir` (below blkio).
fn v1_host(h: &Harness, pod_dir: &str) -> String {
    h.os.add_cgroup_file(format!("{CG}/blkio/{}", V1_FILES[0]), "");
    let dir = format!("{CG}/blkio/{pod_dir}");
    for f in V1_FILES {
        h.os.add_cgroup_file(format!("{dir}/{f}"), "");
    }
    dir
}

/// A cgroup v2 host with `controllers`, the pod's cgroup at `pod_dir` (with io.max when
/// `io`).
fn v2_host(h: &Harness, controllers: &str, pod_dir: &str) -> String {
    h.os.add_cgroup_file(format!("{CG}/cgroup.controllers"), controllers);
    let dir = format!("{CG}/{pod_dir}");
    h.os.add_cgroup_file(format!("{dir}/io.max"), "");
    dir
}

/// A publication at the pod's target of `limits`: in the publish_context (`ctx`), else in the
/// volume_context; the pod named by kubelet when `named`.
fn limited(limits: &str, in_publish_context: bool, named: bool) -> csi::NodePublishVolumeRequest {
    let mut req = publish_req(ext4(), false);
    req.target_path = pod_target();
    let ctx = if in_publish_context {
        &mut req.publish_context
    } else {
        &mut req.volume_context
    };
    ctx.insert(QOS_LIMITS_KEY.into(), limits.into());
    if named {
        req.volume_context
            .insert(crate::validate::POD_UID_KEY.into(), UID.into());
    }
    req
}

async fn staged_for_pod(h: &Harness) {
    h.os.add_dir(format!("{K}/pods/{UID}/volumes/kubernetes.io~csi/pv1"));
    staged(h).await;
}

fn file(h: &Harness, path: String) -> String {
    h.os.cgroup_file(&path)
        .unwrap_or_else(|| panic!("no {path}"))
}

/// The node's plugin started again on the same node and journal (after a restart or a crash:
/// the process's memory is gone either way).
fn restarted(h: &Harness) -> NodeService<FakeOs> {
    let (journal, _) = Journal::open(&h.state, false).expect("journal");
    let engine = Engine::new(
        Arc::clone(&h.os),
        Arc::new(journal),
        h.engine.config().clone(),
    );
    NodeService::new(Arc::new(engine), h.info.clone())
}

async fn unpublish_at_pod(svc: &NodeService<FakeOs>) {
    svc.node_unpublish_volume(Request::new(unpublish_req(&pod_target())))
        .await
        .expect("unpublish");
}

fn no_rule(h: &Harness, dir: &str) {
    for f in V1_FILES {
        assert_eq!(file(h, format!("{dir}/{f}")), "", "{f} after unpublish");
    }
}

fn outcome(h: &Harness, req: &csi::NodePublishVolumeRequest) -> QosOutcome {
    let v = crate::validate::publish(req, Path::new(K)).expect("valid");
    h.engine.publish_report(&v).expect("publish")
}

#[tokio::test]
async fn a_v1_cgroupfs_pod_gets_its_volumes_limits_and_loses_them_at_unpublish() {
    let h = harness();
    staged_for_pod(&h).await;
    let dir = v1_host(&h, &format!("kubepods/burstable/pod{UID}"));
    h.svc
        .node_publish_volume(Request::new(limited(
            "readBytesPerSecond=1048576,writeIOPS=100",
            true,
            true,
        )))
        .await
        .expect("publish");
    assert_eq!(h.os.mount_depth(pod_target()), 1, "published");
    assert_eq!(file(&h, format!("{dir}/{}", V1_FILES[0])), "7:7 1048576\n");
    assert_eq!(file(&h, format!("{dir}/{}", V1_FILES[1])), "");
    assert_eq!(file(&h, format!("{dir}/{}", V1_FILES[2])), "");
    assert_eq!(file(&h, format!("{dir}/{}", V1_FILES[3])), "7:7 100\n");
    assert!(health(&h, STAGING, &pod_target()).await.is_empty());

    h.svc
        .node_unpublish_volume(Request::new(unpublish_req(&pod_target())))
        .await
        .expect("unpublish");
    no_rule(&h, &dir);
}

#[tokio::test]
async fn a_v2_systemd_pod_named_by_its_path_gets_the_limits_of_creation() {
    let h = harness();
    staged_for_pod(&h).await;
    let u = UID.replace('-', "_");
    let dir = v2_host(
        &h,
        "cpuset cpu io memory pids\n",
        &format!("kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{u}.slice"),
    );
    let got = outcome(&h, &limited("writeBytesPerSecond=2097152", false, false));
    assert_eq!(got, QosOutcome::Applied(dir.clone().into()));
    assert_eq!(
        file(&h, format!("{dir}/io.max")),
        "7:7 rbps=max wbps=2097152 riops=max wiops=max\n"
    );
    // The controller's publish, of the moment, wins over the creation's.
    let mut req = limited("writeBytesPerSecond=2097152", false, false);
    req.publish_context
        .insert(QOS_LIMITS_KEY.into(), "readIOPS=50".into());
    h.svc
        .node_unpublish_volume(Request::new(unpublish_req(&pod_target())))
        .await
        .expect("unpublish");
    assert_eq!(file(&h, format!("{dir}/io.max")), "");
    outcome(&h, &req);
    assert_eq!(
        file(&h, format!("{dir}/io.max")),
        "7:7 rbps=max wbps=max riops=50 wiops=max\n"
    );
}

#[tokio::test]
async fn a_guaranteed_pod_of_each_layout_is_found() {
    for (v2, layout) in [
        (false, format!("kubepods/pod{UID}")),
        (
            true,
            format!("kubepods.slice/kubepods-pod{}.slice", UID.replace('-', "_")),
        ),
        (true, format!("kubepods/besteffort/pod{UID}")),
    ] {
        let h = harness();
        staged_for_pod(&h).await;
        let dir = if v2 {
            v2_host(&h, "io memory", &layout)
        } else {
            v1_host(&h, &layout)
        };
        assert_eq!(
            outcome(&h, &limited("readIOPS=10", true, true)),
            QosOutcome::Applied(dir.into()),
            "{layout}"
        );
    }
}

#[tokio::test]
async fn limits_that_cannot_be_applied_leave_the_publication_and_a_health_entry() {
    // No cgroup of the pod; a v2 hierarchy without the io controller; no pod at all.
    let h = harness();
    staged_for_pod(&h).await;
    v1_host(&h, "kubepods/burstable/podsomeoneelse");
    let got = outcome(&h, &limited("readIOPS=10", true, true));
    assert!(
        matches!(
            got,
            QosOutcome::NotApplied {
                reason: "no_pod_cgroup",
                ..
            }
        ),
        "{got:?}"
    );
    assert_eq!(h.os.mount_depth(pod_target()), 1, "published all the same");
    assert_eq!(
        health(&h, STAGING, &pod_target()).await,
        vec![(V::Degraded, "QosNotApplied".to_string())]
    );
    // Unpublished: the entry goes with the publication.
    h.svc
        .node_unpublish_volume(Request::new(unpublish_req(&pod_target())))
        .await
        .expect("unpublish");
    assert!(health(&h, STAGING, "").await.is_empty());

    let h = harness();
    staged_for_pod(&h).await;
    v2_host(&h, "cpu memory pids", &format!("kubepods/pod{UID}"));
    let got = outcome(&h, &limited("readIOPS=10", true, true));
    assert!(
        matches!(
            got,
            QosOutcome::NotApplied {
                reason: "no_io_controller",
                ..
            }
        ),
        "{got:?}"
    );

    // A target of no pod's shape (as csi-sanity's), and kubelet names none.
    let h = harness();
    staged(&h).await;
    h.os.add_dir(format!("{K}/sanity"));
    let mut req = publish_req(ext4(), false);
    req.target_path = format!("{K}/sanity/target");
    req.publish_context
        .insert(QOS_LIMITS_KEY.into(), "readIOPS=10".into());
    let got = outcome(&h, &req);
    assert!(
        matches!(
            got,
            QosOutcome::NotApplied {
                reason: "no_pod",
                ..
            }
        ),
        "{got:?}"
    );

    // A cgroup file that cannot be written (EACCES): not applied, published.
    let h = harness();
    staged_for_pod(&h).await;
    v1_host(&h, &format!("kubepods/pod{UID}"));
    h.os.fail_next("write_cgroup", libc::EACCES);
    let got = outcome(&h, &limited("readIOPS=10", true, true));
    assert!(
        matches!(
            got,
            QosOutcome::NotApplied {
                reason: "not_written",
                ..
            }
        ),
        "{got:?}"
    );
    assert_eq!(h.os.mount_depth(pod_target()), 1);
}

#[tokio::test]
async fn a_limit_the_kernel_refuses_fails_the_publish_before_anything_is_mounted() {
    let h = harness();
    staged_for_pod(&h).await;
    v2_host(&h, "io", &format!("kubepods/pod{UID}"));
    // The fake kernel, as the real one, refuses a limit of 0 in io.max.
    let r = h
        .svc
        .node_publish_volume(Request::new(limited("readIOPS=0", true, true)))
        .await;
    let status = r.expect_err("refused");
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert!(status.message().contains("qosLimits"), "{status:?}");
    assert_eq!(h.os.mount_depth(pod_target()), 0, "nothing mounted");

    // v1 takes 0 as "no limit": refused by moor, not silently unlimited.
    let h = harness();
    staged_for_pod(&h).await;
    v1_host(&h, &format!("kubepods/pod{UID}"));
    assert_eq!(
        code(
            h.svc
                .node_publish_volume(Request::new(limited("writeIOPS=0", true, true)))
        )
        .await,
        Code::InvalidArgument
    );
    assert_eq!(h.os.mount_depth(pod_target()), 0);
}

#[tokio::test]
async fn a_malformed_limit_is_invalid_argument_and_no_limit_touches_no_cgroup() {
    let h = harness();
    staged_for_pod(&h).await;
    v1_host(&h, &format!("kubepods/pod{UID}"));
    for bad in ["readIOPS", "readIOPS=many", "fsType=ext4"] {
        assert_eq!(
            code(
                h.svc
                    .node_publish_volume(Request::new(limited(bad, true, true)))
            )
            .await,
            Code::InvalidArgument,
            "{bad}"
        );
    }
    let mut req = publish_req(ext4(), false);
    req.target_path = pod_target();
    assert_eq!(outcome(&h, &req), QosOutcome::Unlimited);
    assert!(
        !h.os
            .calls()
            .iter()
            .any(|c| matches!(c, Call::WriteCgroup(..))),
        "no limit, no write"
    );
}

#[tokio::test]
async fn an_unpublish_of_a_publication_without_limits_looks_in_no_cgroup() {
    let h = harness();
    staged_for_pod(&h).await;
    let dir = v1_host(&h, &format!("kubepods/burstable/pod{UID}"));
    let mut unlimited = publish_req(ext4(), false);
    unlimited.target_path = pod_target();
    h.svc
        .node_publish_volume(Request::new(unlimited.clone()))
        .await
        .expect("publish");
    h.os.clear_calls();
    unpublish_at_pod(&h.svc).await;
    assert_eq!(h.os.mount_depth(pod_target()), 0, "unpublished");
    assert_eq!(h.os.cgroup_reads(), Vec::<PathBuf>::new(), "no QoS search");
    assert!(
        !h.os
            .calls()
            .iter()
            .any(|c| matches!(c, Call::WriteCgroup(..))),
        "no QoS write"
    );

    // With limits, the rule is still looked for and taken out.
    let limits = limited("readBytesPerSecond=1048576", true, true);
    h.svc
        .node_publish_volume(Request::new(limits.clone()))
        .await
        .expect("publish");
    assert_eq!(
        file(&h, format!("{dir}/{}", V1_FILES[0])),
        "7:7 1048576
"
    );
    unpublish_at_pod(&h.svc).await;
    no_rule(&h, &dir);

    // Published without limits, then again with them (the same target): limited.
    h.svc
        .node_publish_volume(Request::new(unlimited))
        .await
        .expect("publish");
    assert_eq!(
        outcome(&h, &limits),
        QosOutcome::Applied(dir.clone().into())
    );
    unpublish_at_pod(&h.svc).await;
    no_rule(&h, &dir);
}

#[tokio::test]
async fn limits_set_before_a_restart_are_taken_out_by_the_unpublish_after_it() {
    let h = harness();
    staged_for_pod(&h).await;
    let dir = v1_host(&h, &format!("kubepods/pod{UID}"));
    h.svc
        .node_publish_volume(Request::new(limited("writeIOPS=100", true, true)))
        .await
        .expect("publish");
    assert_eq!(file(&h, format!("{dir}/{}", V1_FILES[3])), "7:7 100\n");
    unpublish_at_pod(&restarted(&h)).await;
    assert_eq!(h.os.mount_depth(pod_target()), 0, "unpublished");
    no_rule(&h, &dir);

    // A publication without limits made before the restart is not known to be one: looked
    // for, as any publication this process did not make.
    let mut unlimited = publish_req(ext4(), false);
    unlimited.target_path = pod_target();
    h.svc
        .node_publish_volume(Request::new(unlimited))
        .await
        .expect("publish");
    h.os.clear_calls();
    let after = restarted(&h);
    unpublish_at_pod(&after).await;
    assert!(
        h.os.cgroup_reads().iter().any(|p| p.starts_with(&dir)),
        "the pod's cgroup looked at: {:?}",
        h.os.cgroup_reads()
    );
}
