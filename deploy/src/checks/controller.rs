//! The controller's pods: the one-node controller (a Deployment: one replica, Recreate, pinned
//! to a node) and a node-local controller (in a DaemonSet, beside moor-node); both keep their
//! data dir on the host at the same path, use the host's /dev, and see the kubelet's mounts to
//! freeze volumes in use for group snapshots.

use serde_json::Value;

use super::pods::Pod;

pub(super) fn controller_pod(
    doc: &Value,
    pod: &Pod<'_>,
    c: &Value,
    flag: &dyn Fn(&str) -> Option<String>,
    p: &mut Vec<String>,
) {
    if doc.pointer("/spec/replicas").and_then(Value::as_u64) != Some(1) {
        p.push("the embedded backend runs as exactly one replica: set replicas: 1".into());
    }
    if doc.pointer("/spec/strategy/type").and_then(Value::as_str) != Some("Recreate") {
        p.push("strategy must be Recreate: two controllers must never share the data dir".into());
    }
    let pinned_by_selector = pod
        .spec
        .get("nodeSelector")
        .and_then(Value::as_object)
        .is_some_and(|s| {
            s.keys()
                .any(|k| k != "kubernetes.io/os" && k != "kubernetes.io/arch")
        });
    let pinned = pinned_by_selector
        || pod.spec.get("nodeName").is_some()
        || pod
            .spec
            .pointer("/affinity/nodeAffinity/requiredDuringSchedulingIgnoredDuringExecution")
            .is_some();
    if !pinned {
        p.push(
            "the embedded backend's volumes live on one node: pin the controller to it \
             (nodeSelector, nodeName or required node affinity)"
                .into(),
        );
    }
    host_dirs(pod, c, flag, p);
}

/// A node-local controller (`--node-local`), beside its node's moor-node in a DaemonSet.
pub(super) fn node_local_controller_pod(
    pod: &Pod<'_>,
    c: &Value,
    flag: &dyn Fn(&str) -> Option<String>,
    p: &mut Vec<String>,
) {
    if flag("node-local").as_deref() != Some("true") {
        p.push(
            "moor-controller on every node serves each node's volumes: pass --node-local (else \
             every node's controller would answer for every volume)"
                .into(),
        );
    }
    host_dirs(pod, c, flag, p);
}

/// The host dirs every embedded backend needs: its data dir at the same path, /dev, and the
/// kubelet dir's mounts as they come and go (HostToContainer).
fn host_dirs(pod: &Pod<'_>, c: &Value, flag: &dyn Fn(&str) -> Option<String>, p: &mut Vec<String>) {
    if pod.host_path(c, "/dev") != Some("/dev") {
        p.push("moor-controller needs the host's /dev at /dev (loop devices)".into());
    }
    if flag("no-embedded").as_deref() == Some("true") {
        return;
    }
    let data = flag("data-dir").unwrap_or_default();
    if pod.host_path(c, &data) != Some(data.as_str()) {
        p.push(format!(
            "the data dir {data} must be the host's {data}: volumes must outlive the pod, and \
             backing-file paths are published to the node as host paths"
        ));
    }

    const KUBELET: &str = "/var/lib/kubelet";
    match pod.mount(c, KUBELET) {
        Some((v, m))
            if v.pointer("/hostPath/path").and_then(Value::as_str) == Some(KUBELET)
                && m.get("mountPropagation").and_then(Value::as_str) == Some("HostToContainer") => {
        }
        _ => p.push(format!(
            "moor-controller must see the kubelet's mounts: the host's {KUBELET} at {KUBELET} \
             with mountPropagation: HostToContainer (a group snapshot freezes the members in \
             use at their mount points, and refuses a group it cannot)"
        )),
    }
}
