//! The node plugin's pod: the kubelet dir, the socket, the state dir, the host's /dev, /sys and
//! cgroups, exactly one way of registering with the kubelet, and the key rotation's Secret.

use serde_json::Value;

use super::pods::Pod;
use super::sidecars::{REGISTRAR, REGISTRAR_DEFAULT_DIR, sidecar_of};
use super::{arg_value, strs};

pub(super) fn node_pod(
    pod: &Pod<'_>,
    c: &Value,
    flag: &dyn Fn(&str) -> Option<String>,
    driver: &str,
    socket: &str,
    p: &mut Vec<String>,
) {
    let kubelet = flag("kubelet-dir").unwrap_or_default();
    let kubelet = kubelet.trim_end_matches('/');
    // kubelet passes host paths: the kubelet dir must be at the same path in the container.
    match pod.mount(c, kubelet) {
        Some((v, m)) => {
            if v.pointer("/hostPath/path").and_then(Value::as_str) != Some(kubelet) {
                p.push(format!(
                    "the kubelet dir {kubelet} is not the host's {kubelet}"
                ));
            }
            if m.get("mountPropagation").and_then(Value::as_str) != Some("Bidirectional") {
                p.push(format!(
                    "the kubelet dir {kubelet} needs mountPropagation: Bidirectional, or the \
                     kubelet and pods never see moor's mounts"
                ));
            }
        }
        None => p.push(format!(
            "moor-node does not mount the kubelet dir {kubelet}"
        )),
    }
    let (socket_dir, socket_file) = socket.rsplit_once('/').unwrap_or(("", socket));
    let plugin_dir = format!("{kubelet}/plugins/{driver}");
    if pod.host_path(c, socket_dir) != Some(plugin_dir.as_str()) {
        p.push(format!(
            "the socket dir {socket_dir} must be the host's {plugin_dir}"
        ));
    }
    let state = flag("state-dir").unwrap_or_default();
    if pod.host_path(c, &state).is_none() {
        p.push(format!(
            "the state dir {state} is not a hostPath: the journal would not outlive the pod"
        ));
    }
    for dev in ["/dev", "/sys"] {
        if pod.host_path(c, dev) != Some(dev) {
            p.push(format!("moor-node needs the host's {dev} at {dev}"));
        }
    }
    let cgroup = flag("cgroup-root").unwrap_or_default();
    if pod.host_path(c, &cgroup) != Some("/sys/fs/cgroup") {
        p.push(format!(
            "moor-node's --cgroup-root {cgroup} must be the host's /sys/fs/cgroup: a volume's \
             QoS limits go in its pod's cgroup there"
        ));
    }
    key_rotation(pod, c, flag, p);
    let registry = format!("{kubelet}/plugins_registry");
    let registrars: Vec<&Value> = pod
        .containers
        .iter()
        .filter(|x| sidecar_of(x).is_some_and(|s| s.repo == REGISTRAR))
        .collect();
    let builtin = flag("registration-dir");
    match (&registrars[..], &builtin) {
        ([r], None) => {
            let args = strs(r.get("args"));
            let want = format!("{plugin_dir}/{socket_file}");
            if arg_value(&args, "kubelet-registration-path") != Some(want.as_str()) {
                p.push(format!(
                    "node-driver-registrar: --kubelet-registration-path must be {want}"
                ));
            }
            let dir = arg_value(&args, "plugin-registration-path").unwrap_or(REGISTRAR_DEFAULT_DIR);
            if pod.host_path(r, dir) != Some(registry.as_str()) {
                p.push(format!(
                    "node-driver-registrar: {dir} must be the host's {registry}"
                ));
            }
        }
        ([], Some(dir)) => {
            if pod.host_path(c, dir) != Some(registry.as_str()) {
                p.push(format!(
                    "moor-node --registration-dir={dir} must be the host's {registry}"
                ));
            }
            // kubelet dials the path moor-node announces: the socket's path on the host.
            let want = format!("{plugin_dir}/{socket_file}");
            let announced = flag("kubelet-registration-path").unwrap_or_else(|| socket.to_owned());
            if announced != want {
                p.push(format!(
                    "moor-node announces {announced} to the kubelet: \
                     --kubelet-registration-path must be {want}"
                ));
            }
        }
        ([], None) => p.push(
            "nothing registers the driver with the kubelet: add node-driver-registrar or pass \
             --registration-dir"
                .into(),
        ),
        _ => p.push(
            "the driver would register twice: node-driver-registrar and --registration-dir \
             exclude each other"
                .into(),
        ),
    }
}

/// `--key-rotation-secrets`: the key source's fields from a Secret, mounted read-only at the
/// dir (optional or not: moor-node reads it at each rotation, not at its start), and a
/// controller to ask (`--key-rotation-controller`, else `--local-controller`'s), without which
/// moor-node refuses to start.
fn key_rotation(
    pod: &Pod<'_>,
    c: &Value,
    flag: &dyn Fn(&str) -> Option<String>,
    p: &mut Vec<String>,
) {
    let Some(dir) = flag("key-rotation-secrets") else {
        return;
    };
    match pod.mount(c, &dir) {
        Some((v, m)) => {
            if v.pointer("/secret/secretName")
                .and_then(Value::as_str)
                .is_none()
            {
                p.push(format!(
                    "--key-rotation-secrets={dir} must be a Secret's volume: it holds the KEK"
                ));
            }
            if m.get("readOnly") != Some(&Value::Bool(true)) {
                p.push(format!(
                    "--key-rotation-secrets={dir}: mount the Secret readOnly: true"
                ));
            }
        }
        None => p.push(format!(
            "--key-rotation-secrets={dir} is not mounted: every rotation would fail its pass"
        )),
    }
    if flag("key-rotation-controller").is_none() && flag("local-controller").is_none() {
        p.push(
            "--key-rotation-secrets needs --key-rotation-controller or --local-controller: \
             moor-node refuses to start without a controller to ask"
                .into(),
        );
    }
}
