//! Pods: selectors match the template, the ServiceAccount exists, every mount names a volume
//! and every volume is mounted and has exactly one source, `$(VAR)`s name the container's
//! environment, images pinned; moor containers and the CSI socket they share with the sidecars.

use std::collections::{BTreeMap, BTreeSet};

use serde_json::Value;

use super::controller::controller_pod;
use super::node::node_pod;
use super::probes::probes;
use super::rbac::{CONTROLLER_NEEDS, LEASES, NODE_NEEDS, Need};
use super::sidecars::{sidecar, sidecar_of};
use super::{
    Context, arg_value, array, env_field, env_names, has_switch, image_repo, moor_binary, of_kind,
    strs,
};
use crate::kustomize::{Resource, meta};

pub(super) struct Pod<'a> {
    pub(super) spec: &'a Value,
    pub(super) containers: &'a [Value],
    pub(super) volumes: BTreeMap<&'a str, &'a Value>,
}

impl<'a> Pod<'a> {
    /// The volume a container mounts at `path`, and the mount.
    pub(super) fn mount(&self, c: &'a Value, path: &str) -> Option<(&'a Value, &'a Value)> {
        let norm = |s: &str| s.trim_end_matches('/').to_owned();
        let m = array(c.get("volumeMounts"))
            .iter()
            .find(|m| m.get("mountPath").and_then(Value::as_str).map(norm) == Some(norm(path)))?;
        let v = m.get("name").and_then(Value::as_str)?;
        Some((self.volumes.get(v)?, m))
    }

    /// The host path behind the mount at `path` in container `c`.
    pub(super) fn host_path(&self, c: &'a Value, path: &str) -> Option<&'a str> {
        self.mount(c, path)?
            .0
            .get("hostPath")?
            .get("path")?
            .as_str()
    }

    pub(super) fn host_network(&self) -> bool {
        self.spec.get("hostNetwork") == Some(&Value::Bool(true))
    }
}

pub(super) fn workload(
    doc: &Value,
    res: &[Resource],
    ctx: &Context,
    driver: &str,
    needs: &mut BTreeMap<(String, String), Vec<Need>>,
    p: &mut Vec<String>,
) {
    let kind = doc.get("kind").and_then(Value::as_str).unwrap_or("");
    let ns = meta(doc, "namespace").unwrap_or("");
    let Some(spec) = doc.pointer("/spec/template/spec") else {
        p.push("no pod template".into());
        return;
    };
    // Selector and template labels.
    let labels = doc
        .pointer("/spec/template/metadata/labels")
        .and_then(Value::as_object);
    match doc
        .pointer("/spec/selector/matchLabels")
        .and_then(Value::as_object)
    {
        Some(sel) if !sel.is_empty() => {
            for (k, v) in sel {
                if labels.and_then(|l| l.get(k)) != Some(v) {
                    p.push(format!(
                        "selector {k}={v} does not match the pod template's labels"
                    ));
                }
            }
        }
        _ => p.push("spec.selector.matchLabels is empty".into()),
    }
    if doc.pointer("/spec/selector/matchExpressions").is_some() {
        p.push("selector matchExpressions are not checked: use matchLabels".into());
    }
    // Service account.
    let sa = spec.get("serviceAccountName").and_then(Value::as_str);
    match sa {
        None => p.push("no serviceAccountName".into()),
        Some(sa) => {
            let exists = of_kind(res, "ServiceAccount")
                .any(|s| meta(s, "name") == Some(sa) && meta(s, "namespace") == Some(ns));
            if !exists {
                p.push(format!("ServiceAccount {ns}/{sa} is not in the manifests"));
            }
        }
    }
    if spec.get("initContainers").is_some() || spec.get("ephemeralContainers").is_some() {
        p.push("init and ephemeral containers are not checked: add checks first".into());
    }
    let pod = Pod {
        spec,
        containers: array(spec.get("containers")),
        volumes: array(spec.get("volumes"))
            .iter()
            .filter_map(|v| Some((v.get("name")?.as_str()?, v)))
            .collect(),
    };
    volumes(&pod, p);
    let mut sa_needs: Vec<Need> = Vec::new();
    let mut moor: Vec<(&str, &Value)> = Vec::new();
    for c in pod.containers {
        let cname = c.get("name").and_then(Value::as_str).unwrap_or("?");
        let mut cp = Vec::new();
        container_common(c, &mut cp);
        let args = strs(c.get("args"));
        if let Some(bin) = moor_binary(c, ctx) {
            moor.push((bin, c));
            moor_container(c, bin, ctx, &args, &mut cp);
            sa_needs.extend_from_slice(match bin {
                "moor-node" => NODE_NEEDS,
                _ => CONTROLLER_NEEDS,
            });
        } else if let Some(s) = sidecar_of(c) {
            sidecar(c, s, &args, &mut cp);
            sa_needs.extend_from_slice(s.needs);
            if s.leader_election && has_switch(&args, "leader-election") {
                sa_needs.push(LEASES);
            }
        } else {
            cp.push(format!(
                "image {:?} is neither {} nor a known sidecar (SIDECARS in deploy/src/checks/sidecars.rs)",
                c.get("image"),
                ctx.moor_image
            ));
        }
        p.extend(cp.into_iter().map(|m| format!("container {cname}: {m}")));
    }
    if let Some(sa) = sa {
        needs
            .entry((ns.to_owned(), sa.to_owned()))
            .or_default()
            .extend(sa_needs);
    }
    probes(&pod, ctx, p);
    let (endpoint_container, binary) = match moor[..] {
        [(bin, c)] => (c, bin),
        _ => {
            p.push(format!("expected one moor container, found {}", moor.len()));
            return;
        }
    };
    let cli = if binary == "moor-node" {
        &ctx.node
    } else {
        &ctx.controller
    };
    let args = strs(endpoint_container.get("args"));
    let flag = |name: &str| -> Option<String> {
        arg_value(&args, name)
            .map(str::to_owned)
            .or_else(|| cli.flags.get(name).and_then(|f| f.default.clone()))
    };
    // Shutdown grace < termination grace period.
    let period = spec
        .get("terminationGracePeriodSeconds")
        .and_then(Value::as_u64)
        .unwrap_or(30);
    if let Some(grace) = flag("shutdown-grace").and_then(|g| g.parse::<u64>().ok())
        && grace >= period
    {
        p.push(format!(
            "{binary} --shutdown-grace={grace} is not shorter than the pod's \
             terminationGracePeriodSeconds ({period}): in-flight calls would be killed"
        ));
    }
    // The driver name.
    if flag("driver-name").as_deref() != Some(driver) {
        p.push(format!(
            "{binary} --driver-name is not the CSIDriver's name {driver}"
        ));
    }
    // Every sidecar reaches the driver's socket through the same volume.
    let endpoint = flag("endpoint").unwrap_or_default();
    let Some(socket) = endpoint.strip_prefix("unix://") else {
        p.push(format!(
            "{binary} --endpoint={endpoint} is not a unix:// socket"
        ));
        return;
    };
    let socket_dir = socket.rsplit_once('/').map_or("", |(d, _)| d);
    let socket_volume = pod.mount(endpoint_container, socket_dir).map(|(v, _)| v);
    if socket_volume.is_none() {
        p.push(format!(
            "{binary}: the socket dir {socket_dir} is not a volume mount"
        ));
    }
    for c in pod.containers.iter().filter(|c| sidecar_of(c).is_some()) {
        let cname = c.get("name").and_then(Value::as_str).unwrap_or("?");
        let cargs = strs(c.get("args"));
        if arg_value(&cargs, "csi-address") != Some(socket) {
            p.push(format!("container {cname}: --csi-address is not {socket}"));
        }
        let v = pod.mount(c, socket_dir).map(|(v, _)| v);
        if v.is_none() || v != socket_volume {
            p.push(format!(
                "container {cname}: does not mount {binary}'s socket volume at {socket_dir}"
            ));
        }
    }
    match (kind, binary) {
        ("DaemonSet", "moor-node") => node_pod(&pod, endpoint_container, &flag, driver, socket, p),
        ("Deployment", "moor-controller") => {
            controller_pod(doc, &pod, endpoint_container, &flag, p);
        }
        (k, b) => p.push(format!("{b} does not belong in a {k}")),
    }
}

fn volumes(pod: &Pod<'_>, p: &mut Vec<String>) {
    let mut used = BTreeSet::new();
    for c in pod.containers {
        for m in array(c.get("volumeMounts")) {
            let v = m.get("name").and_then(Value::as_str).unwrap_or("");
            used.insert(v);
            if !pod.volumes.contains_key(v) {
                p.push(format!("volume mount {v:?} names no volume of the pod"));
            }
        }
    }
    for (name, v) in &pod.volumes {
        if !used.contains(name) {
            p.push(format!("volume {name:?} is mounted by no container"));
        }
        let sources = v
            .as_object()
            .map_or(0, |o| o.keys().filter(|k| *k != "name").count());
        if sources != 1 {
            p.push(format!("volume {name:?} has {sources} sources, expected 1"));
        }
    }
}

fn container_common(c: &Value, p: &mut Vec<String>) {
    let image = c.get("image").and_then(Value::as_str).unwrap_or("");
    match image_repo(image) {
        (_, None) => p.push(format!("image {image:?} has no tag")),
        (_, Some("latest")) => p.push(format!("image {image:?}: pin a version, not latest")),
        _ => {}
    }
    if image.contains('@') {
        p.push("digests are not checked: use a tag".into());
    }
    let env = env_names(c);
    let privileged = c.pointer("/securityContext/privileged") == Some(&Value::Bool(true));
    let mut words = strs(c.get("command"));
    words.extend(strs(c.get("args")));
    for w in &words {
        let mut rest = w.as_str();
        while let Some(start) = rest.find("$(") {
            let after = &rest[start + 2..];
            let Some(end) = after.find(')') else { break };
            let var = &after[..end];
            if !env.contains(&var) {
                p.push(format!(
                    "{w:?} refers to $({var}), which the container does not define: \
                     the kubelet would pass it literally"
                ));
            }
            rest = &after[end..];
        }
    }
    let args = strs(c.get("args"));
    for pair in args.windows(2) {
        if pair[0].starts_with("--") && !pair[0].contains('=') && !pair[1].starts_with("--") {
            p.push(format!(
                "write {} {} as {}={}",
                pair[0], pair[1], pair[0], pair[1]
            ));
        }
    }
    for m in array(c.get("volumeMounts")) {
        if m.get("mountPropagation").and_then(Value::as_str) == Some("Bidirectional") && !privileged
        {
            p.push("Bidirectional mount propagation needs a privileged container".into());
        }
    }
}

fn moor_container(c: &Value, bin: &str, ctx: &Context, args: &[String], p: &mut Vec<String>) {
    let cli = match bin {
        "moor-node" => &ctx.node,
        "moor-controller" => &ctx.controller,
        other => {
            p.push(format!("runs {other:?}, which is not a moor binary"));
            return;
        }
    };
    let image = c.get("image").and_then(Value::as_str).unwrap_or("");
    if image != ctx.moor_image {
        p.push(format!("image {image} is not {}", ctx.moor_image));
    }
    let want = format!("{}/{bin}", ctx.bin_dir);
    if strs(c.get("command")) != [want.clone()] {
        p.push(format!(
            "command must be [{want}] (where the Containerfile installs it)"
        ));
    }
    p.extend(cli.check_args(args, &env_names(c)));
    if c.pointer("/securityContext/privileged") != Some(&Value::Bool(true)) {
        p.push(format!("{bin} must run privileged (mounts, loop devices)"));
    }
    // The node id is the name of the node the pod runs on.
    let var = match arg_value(args, "node-id") {
        Some(v) => v.strip_prefix("$(").and_then(|v| v.strip_suffix(')')),
        None => cli.flags.get("node-id").and_then(|f| f.env.as_deref()),
    };
    if var.and_then(|v| env_field(c, v)) != Some("spec.nodeName") {
        p.push("--node-id must come from an env var set from fieldRef spec.nodeName".into());
    }
}
