//! Group snapshots of local volumes on a real Kubernetes, as deployed (issue 37 point 5; run
//! as root against the cluster `.ci/cluster up DIR` brings up with the distributed overlay,
//! `MOOR_CLUSTER_ENV=DIR/env`; without one, it says it is skipped).
//!
//! The snapshot-controller (external-snapshotter v8.6.0) never labels a
//! VolumeGroupSnapshotContent with its node, and each node's csi-snapshotter
//! `--node-deployment` sees only contents so labelled: moor-controller
//! `--mark-snapshot-contents` labels its node's (docs/local.md). Through the API as a user
//! would: a VolumeGroupSnapshot of two claims in use on one node becomes ReadyToUse, cut with
//! both filesystems frozen, and each member restores with its data whole; a group whose members
//! live on two nodes is refused with the reason in its status.

use std::time::{Duration, Instant};

use moor_lab::kube::{Cluster, READ, WRITE, claim, pod};
use serde_json::Value;

const THIN: &str = "moor-local";
const MANAGED_BY: &str = "snapshot.storage.kubernetes.io/managed-by";
/// How long anything the cluster does may take: a claim bound, a pod running, a group cut.
const DEADLINE: Duration = Duration::from_secs(300);

fn s(v: &Value) -> &str {
    v.as_str().unwrap_or_default()
}

/// A VolumeGroupSnapshot of the claims labelled `group`, of `node`'s class (`moor-local-<node>`,
/// which that node's controller publishes).
fn group_snapshot(name: &str, group: &str, node: &str) -> String {
    format!(
        "apiVersion: groupsnapshot.storage.k8s.io/v1
kind: VolumeGroupSnapshot
metadata: {{name: {name}}}
spec:
  volumeGroupSnapshotClassName: {THIN}-{node}
  source:
    selector: {{matchLabels: {{moor.test/group: {group}}}}}
"
    )
}

/// A claim of the group `group` with a writer pod on `node`, Ready once its data is synced.
fn member(c: &Cluster, ns: &str, name: &str, group: &str, node: &str) {
    c.apply_in(Some(ns), &claim(name, THIN, 64, None));
    c.ok(&[
        "label",
        "-n",
        ns,
        &format!("pvc/{name}"),
        &format!("moor.test/group={group}"),
    ]);
    c.apply_in(Some(ns), &pod(name, name, &c.busybox, WRITE, Some(node)));
}

/// Lines of the moor-controller in `node`'s moor-local pod that contain `what`.
fn controller_log(c: &Cluster, node: &str, what: &str) -> Vec<String> {
    let Some((_, name)) = c.moor_pods("local").into_iter().find(|(nd, _)| nd == node) else {
        return Vec::new();
    };
    let out = c.kubectl(&["logs", "-n", "moor-system", &name, "-c", "moor-controller"]);
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.contains(what))
        .map(str::to_owned)
        .collect()
}

#[test]
fn group_snapshots_of_local_volumes_in_use() {
    let Some(c) = Cluster::from_env("cluster_groups") else {
        return;
    };
    if c.get(None, &format!("storageclass/{THIN}")).is_none() {
        eprintln!("cluster_groups: skipped: no StorageClass {THIN} (not the distributed overlay)");
        return;
    }
    if c.nodes.len() < 2 {
        eprintln!("cluster_groups: skipped: needs 2 nodes");
        return;
    }
    let ns = c.namespace("moor-groups");
    let n = ns.name.as_str();
    // node-2: a kubelet in namespaces of its own (node-1 is the host's).
    let (home, other) = (c.nodes[1].clone(), c.nodes[0].clone());

    // ---- Two claims in use on one node, cut as one group.
    member(&c, n, "ga", "g1", &home);
    member(&c, n, "gb", "g1", &home);
    c.wait_pod_ready(n, "ga", DEADLINE);
    c.wait_pod_ready(n, "gb", DEADLINE);
    let cut_before = controller_log(&c, &home, "group cloned").len();
    let start = Instant::now();
    ns.apply(&group_snapshot("both", "g1", &home));
    let vgs = c.wait_until("the group snapshot both to be ready", DEADLINE, || {
        let g = c.get(Some(n), "volumegroupsnapshot/both")?;
        assert!(
            g["status"]["error"].is_null(),
            "the group snapshot failed: {g}"
        );
        (g["status"]["readyToUse"] == true).then_some(g)
    });
    eprintln!(
        "cluster_groups: a group of two volumes in use on {home} ready in {:.1} s",
        start.elapsed().as_secs_f64()
    );
    let content_name = s(&vgs["status"]["boundVolumeGroupSnapshotContentName"]).to_owned();
    let content = c
        .get(None, &format!("volumegroupsnapshotcontent/{content_name}"))
        .expect("the group's content");
    assert_eq!(
        content["metadata"]["labels"][MANAGED_BY],
        home.as_str(),
        "marked with its node: {content}"
    );
    // One instant: both members' filesystems frozen for the cut, none missing.
    let cuts = controller_log(&c, &home, "group cloned");
    let cut = cuts
        .get(cut_before)
        .expect("the cut in the node's controller log");
    assert!(
        cut.contains("\"frozen\":2") && cut.contains("\"members\":2"),
        "both members frozen: {cut}"
    );

    // ---- Each member restores on the group's node with its data whole.
    let snaps = c.get(Some(n), "volumesnapshots").expect("the members");
    let members: Vec<String> = snaps["items"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|v| s(&v["metadata"]["name"]).to_owned())
        .collect();
    assert_eq!(members.len(), 2, "one snapshot per member: {snaps}");
    for (i, snap) in members.iter().enumerate() {
        c.wait_until(&format!("the member {snap} to be ready"), DEADLINE, || {
            let v = c.get(Some(n), &format!("volumesnapshot/{snap}"))?;
            (v["status"]["readyToUse"] == true).then_some(())
        });
        let restored = format!("restored-{i}");
        ns.apply(&claim(&restored, THIN, 64, Some(snap)));
        let reader = format!("read-{i}");
        c.apply_in(
            Some(n),
            &pod(&reader, &restored, &c.busybox, READ, Some(&home)),
        );
        c.wait_pod_succeeded(n, &reader, DEADLINE);
    }

    // ---- A group of two nodes' volumes: refused, with the reason in its status.
    member(&c, n, "gc", "g2", &home);
    member(&c, n, "gd", "g2", &other);
    c.wait_pod_ready(n, "gc", DEADLINE);
    c.wait_pod_ready(n, "gd", DEADLINE);
    ns.apply(&group_snapshot("split", "g2", &home));
    let why = c.wait_until("the group snapshot split to be refused", DEADLINE, || {
        let g = c.get(Some(n), "volumegroupsnapshot/split")?;
        assert_ne!(
            g["status"]["readyToUse"], true,
            "a group of two nodes cut: {g}"
        );
        let message = s(&g["status"]["error"]["message"]);
        message
            .contains("a group snapshot is cut on one node")
            .then(|| message.to_owned())
    });
    eprintln!("cluster_groups: a group of {home}'s and {other}'s volumes: {why}");
}
