//! Pods: selectors match the template, the ServiceAccount exists, every mount names a volume
//! and every volume is mounted and has exactly one source, `$(VAR)`s name the container's
//! environment, images pinned; moor containers and the CSI socket they share with the sidecars.

use std::collections::{BTreeMap, BTreeSet};

use serde_json::Value;

use super::controller::{controller_pod, node_local_controller_pod};
use super::node::node_pod;
use super::probes::probes;
use super::rbac::{CONTROLLER_NEEDS, KEY_ROTATION_NEEDS, LEASES, MARK_NEEDS, NODE_NEEDS, Need};
use super::sidecars::{PROVISIONER, REGISTRAR, Sidecar, extra_needs, sidecar, sidecar_of};
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
    drivers: &BTreeSet<&str>,
    needs: &mut BTreeMap<(String, String), Vec<Need>>,
    facts: &mut Vec<DriverFact>,
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
            if bin == "moor-controller" && has_switch(&args, "mark-snapshot-contents") {
                sa_needs.extend_from_slice(MARK_NEEDS);
            }
            if bin == "moor-controller" && has_switch(&args, "key-rotation-annotations") {
                sa_needs.extend_from_slice(KEY_ROTATION_NEEDS);
            }
        } else if let Some(s) = sidecar_of(c) {
            sidecar(c, s, &args, &mut cp);
            sa_needs.extend_from_slice(s.needs);
            if s.leader_election && has_switch(&args, "leader-election") {
                sa_needs.push(LEASES);
            }
            sa_needs.extend(extra_needs(s, &args));
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
    match moor[..] {
        [_] => {}
        [("moor-node", _), ("moor-controller", _)] | [("moor-controller", _), ("moor-node", _)]
            if kind == "DaemonSet" => {}
        _ => {
            p.push(format!(
                "expected one moor container (or, in a DaemonSet, moor-node with its node-local \
                 moor-controller), found {}",
                moor.len()
            ));
            return;
        }
    }
    let mut served = Vec::new();
    for &(binary, c) in &moor {
        if let Some(s) = moor_daemon(&pod, c, binary, ctx, drivers, p) {
            served.push(s);
        }
    }
    for c in pod.containers {
        if let Some(s) = sidecar_of(c) {
            sidecar_socket(&pod, c, s, &served, p);
        }
    }
    for d in &served {
        let flag = |name: &str| d.flag(name, ctx);
        match (kind, d.binary) {
            ("DaemonSet", "moor-node") => {
                node_pod(&pod, d.container, &flag, &d.driver, &d.socket, p);
            }
            ("Deployment", "moor-controller") => {
                controller_pod(doc, &pod, d.container, &flag, p);
            }
            ("DaemonSet", "moor-controller") => {
                node_local_controller_pod(&pod, d.container, &flag, p);
            }
            (k, b) => p.push(format!("{b} does not belong in a {k}")),
        }
    }
    node_local_pair(&pod, &served, ctx, p);
    for d in &served {
        if d.binary != "moor-controller" {
            continue;
        }
        let node_local = d.flag("node-local", ctx).is_some_and(|v| v == "true");
        let capacity = pod.containers.iter().any(|c| {
            sidecar_of(c).is_some_and(|s| s.repo == PROVISIONER)
                && arg_value(&strs(c.get("args")), "csi-address") == Some(d.socket.as_str())
                && has_switch(&strs(c.get("args")), "enable-capacity")
        });
        facts.push(DriverFact {
            driver: d.driver.clone(),
            workload: format!("{kind}/{ns}/{}", meta(doc, "name").unwrap_or("?")),
            node_local,
            capacity,
        });
    }
}

/// A moor daemon of a pod: its binary, container, driver and socket.
pub(super) struct Served<'a> {
    pub(super) binary: &'a str,
    pub(super) container: &'a Value,
    pub(super) driver: String,
    pub(super) socket: String,
    pub(super) socket_dir: String,
    socket_volume: Option<&'a Value>,
    args: Vec<String>,
}

impl Served<'_> {
    /// A flag's value as the daemon sees it: given, or its default (switches: "true" when
    /// given).
    pub(super) fn flag(&self, name: &str, ctx: &Context) -> Option<String> {
        let cli = if self.binary == "moor-node" {
            &ctx.node
        } else {
            &ctx.controller
        };
        arg_value(&self.args, name)
            .map(str::to_owned)
            .or_else(|| has_switch(&self.args, name).then(|| "true".to_owned()))
            .or_else(|| cli.flags.get(name).and_then(|f| f.default.clone()))
    }
}

/// What a CSIDriver is served with, for the checks of the CSIDriver object.
#[derive(Debug, Clone)]
pub(super) struct DriverFact {
    pub(super) driver: String,
    pub(super) workload: String,
    pub(super) node_local: bool,
    pub(super) capacity: bool,
}

/// The checks of one moor container that need its pod: the shutdown grace, its driver, its
/// socket volume.
fn moor_daemon<'a>(
    pod: &Pod<'a>,
    c: &'a Value,
    binary: &'a str,
    ctx: &Context,
    drivers: &BTreeSet<&str>,
    p: &mut Vec<String>,
) -> Option<Served<'a>> {
    let mut d = Served {
        binary,
        container: c,
        driver: String::new(),
        socket: String::new(),
        socket_dir: String::new(),
        socket_volume: None,
        args: strs(c.get("args")),
    };
    // Shutdown grace < termination grace period.
    let period = pod
        .spec
        .get("terminationGracePeriodSeconds")
        .and_then(Value::as_u64)
        .unwrap_or(30);
    if let Some(grace) = d
        .flag("shutdown-grace", ctx)
        .and_then(|g| g.parse::<u64>().ok())
        && grace >= period
    {
        p.push(format!(
            "{binary} --shutdown-grace={grace} is not shorter than the pod's \
             terminationGracePeriodSeconds ({period}): in-flight calls would be killed"
        ));
    }
    d.driver = d.flag("driver-name", ctx).unwrap_or_default();
    if !drivers.contains(d.driver.as_str()) {
        p.push(format!(
            "{binary} --driver-name={} is not the name of a CSIDriver of the manifests \
             ({drivers:?})",
            d.driver
        ));
    }
    let endpoint = d.flag("endpoint", ctx).unwrap_or_default();
    let Some(socket) = endpoint.strip_prefix("unix://") else {
        p.push(format!(
            "{binary} --endpoint={endpoint} is not a unix:// socket"
        ));
        return None;
    };
    d.socket = socket.to_owned();
    d.socket_dir = socket
        .rsplit_once('/')
        .map_or("", |(dir, _)| dir)
        .to_owned();
    d.socket_volume = pod.mount(c, &d.socket_dir).map(|(v, _)| v);
    if d.socket_volume.is_none() {
        p.push(format!(
            "{binary}: the socket dir {} is not a volume mount",
            d.socket_dir
        ));
    }
    Some(d)
}

/// A sidecar reaches a moor daemon of its pod: the socket it dials is that daemon's, through
/// the same volume, and the daemon serves what the sidecar calls (the registrar registers a
/// node plugin; the provisioner, attacher, resizer and snapshotter call a controller).
fn sidecar_socket(
    pod: &Pod<'_>,
    c: &Value,
    s: &Sidecar,
    served: &[Served<'_>],
    p: &mut Vec<String>,
) {
    let cname = c.get("name").and_then(Value::as_str).unwrap_or("?");
    let args = strs(c.get("args"));
    let address = arg_value(&args, "csi-address").unwrap_or("");
    let Some(d) = served.iter().find(|d| d.socket == address) else {
        p.push(format!(
            "container {cname}: --csi-address={address} is the socket of no moor container of \
             the pod"
        ));
        return;
    };
    let v = pod.mount(c, &d.socket_dir).map(|(v, _)| v);
    if v.is_none() || v != d.socket_volume {
        p.push(format!(
            "container {cname}: does not mount {}'s socket volume at {}",
            d.binary, d.socket_dir
        ));
    }
    let wants = match s.repo {
        REGISTRAR => Some("moor-node"),
        r if r.ends_with("/livenessprobe") => None,
        _ => Some("moor-controller"),
    };
    if wants.is_some_and(|w| w != d.binary) {
        p.push(format!(
            "container {cname}: calls {} on {}, which {} does not serve",
            wants.unwrap_or(""),
            d.socket,
            d.binary
        ));
    }
}

/// moor-node --local-controller and moor-controller --node-local come together: in one pod,
/// for one driver, the node dialing the controller's socket through a volume both mount.
fn node_local_pair(pod: &Pod<'_>, served: &[Served<'_>], ctx: &Context, p: &mut Vec<String>) {
    let node = served.iter().find(|d| d.binary == "moor-node");
    let ctl = served.iter().find(|d| d.binary == "moor-controller");
    let local = node.and_then(|n| n.flag("local-controller", ctx));
    let node_local = ctl.is_some_and(|c| c.flag("node-local", ctx).is_some_and(|v| v == "true"));
    match (node, ctl, local) {
        (Some(n), Some(c), Some(endpoint)) if node_local => {
            if n.driver != c.driver {
                p.push(format!(
                    "moor-node serves {} and its node-local controller {}: one driver",
                    n.driver, c.driver
                ));
            }
            if endpoint.strip_prefix("unix://") != Some(c.socket.as_str()) {
                p.push(format!(
                    "moor-node --local-controller={endpoint} is not the controller's socket \
                     unix://{}",
                    c.socket
                ));
            }
            let v = pod.mount(n.container, &c.socket_dir).map(|(v, _)| v);
            if v.is_none() || v != c.socket_volume {
                p.push(format!(
                    "moor-node does not mount the controller's socket volume at {}",
                    c.socket_dir
                ));
            }
        }
        (_, Some(_), _) if node_local => p.push(
            "moor-controller --node-local: its volumes are attached by the moor-node beside it \
             (--local-controller), and there is none"
                .into(),
        ),
        (Some(_), _, Some(endpoint)) => p.push(format!(
            "moor-node --local-controller={endpoint}: no moor-controller --node-local beside it"
        )),
        _ => {}
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
