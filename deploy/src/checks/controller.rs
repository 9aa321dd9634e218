//! The controller's pod: one replica, Recreate, pinned to a node, data dir and /dev from the
//! host.

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
    let data = flag("data-dir").unwrap_or_default();
    if pod.host_path(c, &data) != Some(data.as_str()) {
        p.push(format!(
            "the data dir {data} must be the host's {data}: volumes must outlive the pod, and \
             backing-file paths are published to the node as host paths"
        ));
    }
    if pod.host_path(c, "/dev") != Some("/dev") {
        p.push("moor-controller needs the host's /dev at /dev (loop devices)".into());
    }
}
