//! Cross-object checks of a rendered set of manifests: what the schemas cannot say.
//!
//! - objects: unique, no `status` or server-set metadata, namespaced kinds in a Namespace of
//!   the set and cluster-scoped ones without one;
//! - one CSIDriver, whose name every moor binary, StorageClass and VolumeSnapshotClass uses;
//! - pods: selectors match the template, the ServiceAccount exists, every mount names a volume
//!   and every volume is mounted and has exactly one source, `$(VAR)`s name the container's
//!   environment, Bidirectional propagation only in privileged containers, images pinned and
//!   known, value flags written `--name=value`;
//! - moor containers: the binary's flags ([`crate::flags`]), the node id from `spec.nodeName`,
//!   privileged, the shutdown grace shorter than the pod's termination grace period;
//! - sidecars ([`SIDECARS`]): known flags, the same CSI socket as the driver through the same
//!   volume, `--leader-election` where supported;
//! - probes: the port is declared and served in the pod; on the host network every HTTP
//!   endpoint binds loopback and the probe targets 127.0.0.1;
//! - the node plugin: kubelet dir mounted at its own path with Bidirectional propagation, the
//!   socket in `<kubelet dir>/plugins/<driver>/`, state kept on the host, exactly one way of
//!   registering with kubelet, the right registration path;
//! - the controller: one replica, Recreate, pinned to a node, data dir and /dev from the host;
//! - RBAC: each ServiceAccount is granted exactly what its containers need ([`Need`]): nothing
//!   missing, nothing more, no wildcards; bindings name existing roles and accounts.

use std::collections::{BTreeMap, BTreeSet};

use serde_json::Value;

use crate::flags::Cli;
use crate::kustomize::{Resource, meta};

/// A permission a container needs: API group, resource, verbs; cluster-wide, or in the pod's
/// namespace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Need {
    /// API group (empty: core).
    pub group: &'static str,
    /// Resource (with `/subresource`).
    pub resource: &'static str,
    /// Verbs.
    pub verbs: &'static [&'static str],
    /// Only in the pod's namespace (leader-election leases).
    pub namespaced: bool,
}

const fn need(group: &'static str, resource: &'static str, verbs: &'static [&'static str]) -> Need {
    Need {
        group,
        resource,
        verbs,
        namespaced: false,
    }
}

const GET_LIST_WATCH: &[&str] = &["get", "list", "watch"];
const EVENTS: Need = need(
    "",
    "events",
    &["list", "watch", "create", "update", "patch"],
);

/// What leader election needs in the pod's namespace.
pub const LEASES: Need = Need {
    group: "coordination.k8s.io",
    resource: "leases",
    verbs: &["get", "watch", "list", "delete", "update", "create"],
    namespaced: true,
};

/// What moor-node needs from the API.
pub const NODE_NEEDS: &[Need] = &[need("", "nodes", &["get"])];
/// What moor-controller needs from the API (nothing: the sidecars talk to it).
pub const CONTROLLER_NEEDS: &[Need] = &[];

/// A CSI sidecar the manifests may use.
#[derive(Debug, Clone, Copy)]
pub struct Sidecar {
    /// Image repository.
    pub repo: &'static str,
    /// The one tag allowed.
    pub tag: &'static str,
    /// Its flags the manifests may use: `(name, is a boolean flag)`, as in the upstream
    /// README of that release.
    pub flags: &'static [(&'static str, bool)],
    /// Supports `--leader-election` (and so must be given it).
    pub leader_election: bool,
    /// The permissions it needs (leases too when it elects a leader).
    pub needs: &'static [Need],
}

const COMMON: [(&str, bool); 4] = [
    ("csi-address", false),
    ("v", false),
    ("timeout", false),
    ("http-endpoint", false),
];

/// The sidecars, pinned.
pub const SIDECARS: &[Sidecar] = &[
    Sidecar {
        repo: "registry.k8s.io/sig-storage/csi-node-driver-registrar",
        tag: "v2.13.0",
        flags: &[
            COMMON[0],
            COMMON[1],
            COMMON[2],
            COMMON[3],
            ("kubelet-registration-path", false),
            ("plugin-registration-path", false),
        ],
        leader_election: false,
        needs: &[],
    },
    Sidecar {
        repo: "registry.k8s.io/sig-storage/livenessprobe",
        tag: "v2.15.0",
        flags: &[
            COMMON[0],
            COMMON[1],
            COMMON[3],
            ("probe-timeout", false),
            ("health-port", false),
            ("metrics-path", false),
        ],
        leader_election: false,
        needs: &[],
    },
    Sidecar {
        repo: "registry.k8s.io/sig-storage/csi-provisioner",
        tag: "v5.2.0",
        flags: &[
            COMMON[0],
            COMMON[1],
            COMMON[2],
            COMMON[3],
            ("leader-election", true),
            ("leader-election-namespace", false),
            ("feature-gates", false),
            ("extra-create-metadata", true),
            ("default-fstype", false),
            ("worker-threads", false),
            ("strict-topology", true),
            ("immediate-topology", true),
        ],
        leader_election: true,
        needs: &[
            need(
                "",
                "persistentvolumes",
                &["get", "list", "watch", "create", "delete", "patch"],
            ),
            need(
                "",
                "persistentvolumeclaims",
                &["get", "list", "watch", "update", "patch"],
            ),
            need("storage.k8s.io", "storageclasses", GET_LIST_WATCH),
            EVENTS,
            need(
                "snapshot.storage.k8s.io",
                "volumesnapshots",
                &["get", "list"],
            ),
            need(
                "snapshot.storage.k8s.io",
                "volumesnapshotcontents",
                &["get", "list"],
            ),
            need("storage.k8s.io", "csinodes", GET_LIST_WATCH),
            need("", "nodes", GET_LIST_WATCH),
            need("storage.k8s.io", "volumeattachments", GET_LIST_WATCH),
        ],
    },
    Sidecar {
        repo: "registry.k8s.io/sig-storage/csi-attacher",
        tag: "v4.8.0",
        flags: &[
            COMMON[0],
            COMMON[1],
            COMMON[2],
            COMMON[3],
            ("leader-election", true),
            ("leader-election-namespace", false),
            ("worker-threads", false),
        ],
        leader_election: true,
        needs: &[
            need("", "persistentvolumes", &["get", "list", "watch", "patch"]),
            need("storage.k8s.io", "csinodes", GET_LIST_WATCH),
            need(
                "storage.k8s.io",
                "volumeattachments",
                &["get", "list", "watch", "patch"],
            ),
            need("storage.k8s.io", "volumeattachments/status", &["patch"]),
        ],
    },
    Sidecar {
        repo: "registry.k8s.io/sig-storage/csi-resizer",
        tag: "v1.13.1",
        flags: &[
            COMMON[0],
            COMMON[1],
            COMMON[2],
            COMMON[3],
            ("leader-election", true),
            ("leader-election-namespace", false),
            ("workers", false),
            ("handle-volume-inuse-error", true),
            ("feature-gates", false),
        ],
        leader_election: true,
        needs: &[
            need("", "persistentvolumes", &["get", "list", "watch", "patch"]),
            need("", "persistentvolumeclaims", GET_LIST_WATCH),
            need("", "persistentvolumeclaims/status", &["patch"]),
            need("", "pods", &["list", "watch"]),
            EVENTS,
        ],
    },
    Sidecar {
        repo: "registry.k8s.io/sig-storage/csi-snapshotter",
        tag: "v8.2.0",
        flags: &[
            COMMON[0],
            COMMON[1],
            COMMON[2],
            COMMON[3],
            ("leader-election", true),
            ("leader-election-namespace", false),
            ("worker-threads", false),
            ("extra-create-metadata", true),
            ("snapshot-name-prefix", false),
        ],
        leader_election: true,
        needs: &[
            need(
                "snapshot.storage.k8s.io",
                "volumesnapshotclasses",
                GET_LIST_WATCH,
            ),
            need(
                "snapshot.storage.k8s.io",
                "volumesnapshotcontents",
                &["get", "list", "watch", "update", "patch"],
            ),
            need(
                "snapshot.storage.k8s.io",
                "volumesnapshotcontents/status",
                &["update", "patch"],
            ),
            EVENTS,
        ],
    },
];

/// The registrar sidecar's repository.
pub const REGISTRAR: &str = "registry.k8s.io/sig-storage/csi-node-driver-registrar";
/// The registrar's default `--plugin-registration-path`.
pub const REGISTRAR_DEFAULT_DIR: &str = "/registration";

/// Kinds the checks know, and whether they are namespaced.
pub const SCOPES: &[(&str, bool)] = &[
    ("Namespace", false),
    ("CSIDriver", false),
    ("StorageClass", false),
    ("VolumeSnapshotClass", false),
    ("ClusterRole", false),
    ("ClusterRoleBinding", false),
    ("ServiceAccount", true),
    ("Role", true),
    ("RoleBinding", true),
    ("DaemonSet", true),
    ("Deployment", true),
];

/// What the checks need to know besides the manifests.
#[derive(Debug, Clone)]
pub struct Context {
    /// moor-node's command line.
    pub node: Cli,
    /// moor-controller's command line.
    pub controller: Cli,
    /// The image the moor containers must use, `repo:tag`.
    pub moor_image: String,
    /// Where the image installs the binaries (e.g. `/usr/local/bin`).
    pub bin_dir: String,
}

/// Runs every check over one rendered set of objects.
pub fn check_all(res: &[Resource], ctx: &Context) -> Vec<String> {
    let mut p = Vec::new();
    objects(res, &mut p);
    let drivers: Vec<&str> = of_kind(res, "CSIDriver")
        .filter_map(|d| meta(d, "name"))
        .collect();
    let driver = match drivers[..] {
        [d] => d,
        _ => {
            p.push(format!("expected exactly one CSIDriver, found {drivers:?}"));
            "moor.csi.io"
        }
    };
    for sc in of_kind(res, "StorageClass") {
        let prov = sc.get("provisioner").and_then(Value::as_str);
        if prov != Some(driver) {
            p.push(format!(
                "StorageClass {:?}: provisioner {prov:?}, not {driver}",
                name(sc)
            ));
        }
    }
    for vsc in of_kind(res, "VolumeSnapshotClass") {
        let d = vsc.get("driver").and_then(Value::as_str);
        if d != Some(driver) {
            p.push(format!(
                "VolumeSnapshotClass {:?}: driver {d:?}, not {driver}",
                name(vsc)
            ));
        }
    }
    let mut needs: BTreeMap<(String, String), Vec<Need>> = BTreeMap::new();
    for w in res.iter().filter(|r| is_workload(&r.doc)) {
        let mut wp = Vec::new();
        workload(&w.doc, res, ctx, driver, &mut needs, &mut wp);
        p.extend(wp.into_iter().map(|m| format!("{}: {m}", w.id())));
    }
    rbac(res, &needs, &mut p);
    p
}

fn of_kind<'a>(res: &'a [Resource], kind: &'a str) -> impl Iterator<Item = &'a Value> {
    res.iter()
        .map(|r| &r.doc)
        .filter(move |d| d.get("kind").and_then(Value::as_str) == Some(kind))
}

fn name(doc: &Value) -> &str {
    meta(doc, "name").unwrap_or("?")
}

fn is_workload(doc: &Value) -> bool {
    matches!(
        doc.get("kind").and_then(Value::as_str),
        Some("DaemonSet" | "Deployment")
    )
}

fn strs(v: Option<&Value>) -> Vec<String> {
    v.and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(Value::as_str)
                .map(str::to_owned)
                .collect()
        })
        .unwrap_or_default()
}

fn array(v: Option<&Value>) -> &[Value] {
    v.and_then(Value::as_array).map_or(&[], Vec::as_slice)
}

fn objects(res: &[Resource], p: &mut Vec<String>) {
    let namespaces: BTreeSet<&str> = of_kind(res, "Namespace")
        .filter_map(|n| meta(n, "name"))
        .collect();
    for r in res {
        let id = r.id();
        let kind = r.doc.get("kind").and_then(Value::as_str).unwrap_or("");
        if r.doc.get("status").is_some() {
            p.push(format!("{id}: status is the server's to write"));
        }
        for f in [
            "uid",
            "resourceVersion",
            "creationTimestamp",
            "generation",
            "managedFields",
            "selfLink",
        ] {
            if r.doc.get("metadata").and_then(|m| m.get(f)).is_some() {
                p.push(format!("{id}: metadata.{f} is the server's to write"));
            }
        }
        if meta(&r.doc, "name").is_none_or(str::is_empty) {
            p.push(format!("{id}: no metadata.name"));
        }
        let ns = meta(&r.doc, "namespace");
        match SCOPES.iter().find(|(k, _)| *k == kind) {
            None => p.push(format!(
                "{id}: kind {kind} is not in deploy/src/checks.rs SCOPES"
            )),
            Some((_, true)) => match ns {
                None => p.push(format!(
                    "{id}: a namespaced object needs metadata.namespace"
                )),
                Some(ns) if !namespaces.contains(ns) => {
                    p.push(format!(
                        "{id}: namespace {ns} is not created by these manifests"
                    ));
                }
                Some(_) => {}
            },
            Some((_, false)) => {
                if ns.is_some() {
                    p.push(format!("{id}: a cluster-scoped object has no namespace"));
                }
            }
        }
    }
}

/// `--name=value` of a flag in an argument list (the last one).
pub fn arg_value<'a>(args: &'a [String], flag: &str) -> Option<&'a str> {
    let prefix = format!("--{flag}=");
    args.iter().rev().find_map(|a| a.strip_prefix(&prefix))
}

fn has_switch(args: &[String], flag: &str) -> bool {
    let f = format!("--{flag}");
    args.iter().any(|a| *a == f || *a == format!("{f}=true"))
}

struct Pod<'a> {
    spec: &'a Value,
    containers: &'a [Value],
    volumes: BTreeMap<&'a str, &'a Value>,
}

impl<'a> Pod<'a> {
    /// The volume a container mounts at `path`, and the mount.
    fn mount(&self, c: &'a Value, path: &str) -> Option<(&'a Value, &'a Value)> {
        let norm = |s: &str| s.trim_end_matches('/').to_owned();
        let m = array(c.get("volumeMounts"))
            .iter()
            .find(|m| m.get("mountPath").and_then(Value::as_str).map(norm) == Some(norm(path)))?;
        let v = m.get("name").and_then(Value::as_str)?;
        Some((self.volumes.get(v)?, m))
    }

    /// The host path behind the mount at `path` in container `c`.
    fn host_path(&self, c: &'a Value, path: &str) -> Option<&'a str> {
        self.mount(c, path)?
            .0
            .get("hostPath")?
            .get("path")?
            .as_str()
    }

    fn host_network(&self) -> bool {
        self.spec.get("hostNetwork") == Some(&Value::Bool(true))
    }
}

fn image_repo(image: &str) -> (&str, Option<&str>) {
    match image.rsplit_once(':') {
        Some((repo, tag)) if !tag.contains('/') => (repo, Some(tag)),
        _ => (image, None),
    }
}

fn sidecar_of(c: &Value) -> Option<&'static Sidecar> {
    let image = c.get("image").and_then(Value::as_str)?;
    let (repo, _) = image_repo(image);
    SIDECARS.iter().find(|s| s.repo == repo)
}

/// Which moor binary a container runs, from its command.
fn moor_binary<'a>(c: &'a Value, ctx: &Context) -> Option<&'a str> {
    let image = c.get("image").and_then(Value::as_str)?;
    if image_repo(image).0 != image_repo(&ctx.moor_image).0 {
        return None;
    }
    let first = c.get("command")?.get(0)?.as_str()?;
    Some(first.rsplit('/').next().unwrap_or(first))
}

fn env_names(c: &Value) -> Vec<&str> {
    array(c.get("env"))
        .iter()
        .filter_map(|e| e.get("name").and_then(Value::as_str))
        .collect()
}

/// The `fieldPath` an env var of the container takes from the pod, if it does.
fn env_field<'a>(c: &'a Value, var: &str) -> Option<&'a str> {
    array(c.get("env"))
        .iter()
        .find(|e| e.get("name").and_then(Value::as_str) == Some(var))?
        .pointer("/valueFrom/fieldRef/fieldPath")?
        .as_str()
}

fn workload(
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
                "image {:?} is neither {} nor a known sidecar (SIDECARS in deploy/src/checks.rs)",
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

fn sidecar(c: &Value, s: &Sidecar, args: &[String], p: &mut Vec<String>) {
    let image = c.get("image").and_then(Value::as_str).unwrap_or("");
    if image_repo(image).1 != Some(s.tag) {
        p.push(format!("{} must be pinned at {}", s.repo, s.tag));
    }
    if c.get("command").is_some() {
        p.push("sidecars keep their image's entrypoint: no command".into());
    }
    let mut seen = BTreeSet::new();
    for a in args {
        let Some(long) = a.strip_prefix("--") else {
            p.push(format!("argument {a:?} is not a --flag"));
            continue;
        };
        let (name, value) = long
            .split_once('=')
            .map_or((long, None), |(n, v)| (n, Some(v)));
        match s.flags.iter().find(|(f, _)| *f == name) {
            None => p.push(format!(
                "--{name} is not a known flag of {}:{}",
                s.repo, s.tag
            )),
            Some((_, true)) if value.is_some_and(|v| v != "true" && v != "false") => {
                p.push(format!("--{name} is a boolean flag"));
            }
            Some((_, false)) if value.is_none() => p.push(format!("--{name} needs =value")),
            Some(_) => {}
        }
        if !seen.insert(name) {
            p.push(format!("--{name} is given twice"));
        }
    }
    if s.leader_election && !has_switch(args, "leader-election") {
        p.push("supports leader election: pass --leader-election".into());
    }
}

/// Where an HTTP endpoint flag makes a container listen: (host, port). A moor binary binds
/// `--http-endpoint=:port` to loopback; the sidecars (Go) bind every interface.
fn listens(c: &Value, ctx: &Context) -> Vec<(String, u16)> {
    let args = strs(c.get("args"));
    let mut out = Vec::new();
    if let Some(ep) = arg_value(&args, "http-endpoint")
        && let Some((host, port)) = ep.rsplit_once(':')
        && let Ok(port) = port.parse()
    {
        let host = if host.is_empty() && moor_binary(c, ctx).is_some() {
            "127.0.0.1"
        } else {
            host.trim_matches(['[', ']'])
        };
        out.push((host.to_owned(), port));
    }
    if let Some(port) = arg_value(&args, "health-port").and_then(|p| p.parse().ok()) {
        out.push((String::new(), port));
    }
    out
}

fn is_loopback(host: &str) -> bool {
    matches!(host, "127.0.0.1" | "localhost" | "::1")
}

fn probes(pod: &Pod<'_>, ctx: &Context, p: &mut Vec<String>) {
    let mut servers: BTreeMap<u16, (String, &str)> = BTreeMap::new();
    for c in pod.containers {
        let cname = c.get("name").and_then(Value::as_str).unwrap_or("?");
        for (host, port) in listens(c, ctx) {
            if pod.host_network() && !is_loopback(&host) {
                p.push(format!(
                    "container {cname} listens on every interface of the node (hostNetwork) at \
                     port {port}: bind 127.0.0.1"
                ));
            }
            if let Some((_, other)) = servers.insert(port, (host, cname)) {
                p.push(format!(
                    "containers {other} and {cname} both listen on port {port}"
                ));
            }
        }
    }
    for c in pod.containers {
        let cname = c.get("name").and_then(Value::as_str).unwrap_or("?");
        for kind in ["livenessProbe", "readinessProbe", "startupProbe"] {
            let Some(get) = c.get(kind).and_then(|pr| pr.get("httpGet")) else {
                continue;
            };
            let port = match get.get("port") {
                Some(Value::String(pname)) => array(c.get("ports"))
                    .iter()
                    .find(|pt| pt.get("name").and_then(Value::as_str) == Some(pname))
                    .and_then(|pt| pt.get("containerPort")?.as_u64()),
                Some(v) => v.as_u64(),
                None => None,
            };
            let Some(port) = port.and_then(|n| u16::try_from(n).ok()) else {
                p.push(format!(
                    "container {cname}: {kind} port is not declared in its ports"
                ));
                continue;
            };
            let probe_host = get.get("host").and_then(Value::as_str);
            match servers.get(&port) {
                None => p.push(format!(
                    "container {cname}: {kind} probes port {port}, which nothing in the pod serves"
                )),
                Some((host, _)) if is_loopback(host) => {
                    if !pod.host_network() {
                        p.push(format!(
                            "container {cname}: {kind}: port {port} is bound to loopback in the \
                             pod's own network namespace, which the kubelet cannot reach"
                        ));
                    } else if probe_host.is_none_or(|h| !is_loopback(h)) {
                        p.push(format!(
                            "container {cname}: {kind}: port {port} is bound to {host}: probe \
                             host must be 127.0.0.1"
                        ));
                    }
                }
                Some(_) => {
                    if probe_host.is_some() {
                        p.push(format!(
                            "container {cname}: {kind}: leave httpGet.host unset (the pod IP)"
                        ));
                    }
                }
            }
        }
    }
}

fn node_pod(
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

fn controller_pod(
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

/// A permission triple granted or needed, with its scope (`None`: cluster-wide).
type Grant = (Option<String>, String, String, String);

fn rbac(res: &[Resource], needs: &BTreeMap<(String, String), Vec<Need>>, p: &mut Vec<String>) {
    let rules_of = |kind: &str, name: &str, ns: Option<&str>| -> Option<Vec<Value>> {
        of_kind(res, kind)
            .find(|r| {
                meta(r, "name") == Some(name)
                    && (kind == "ClusterRole" || meta(r, "namespace") == ns)
            })
            .map(|r| array(r.get("rules")).to_vec())
    };
    for kind in ["ClusterRole", "Role"] {
        for r in of_kind(res, kind) {
            for rule in array(r.get("rules")) {
                for f in ["apiGroups", "resources", "verbs"] {
                    if strs(rule.get(f)).iter().any(|x| x == "*") {
                        p.push(format!("{kind} {}: no wildcards in {f}", name(r)));
                    }
                }
                if rule.get("resourceNames").is_some() || rule.get("nonResourceURLs").is_some() {
                    p.push(format!(
                        "{kind} {}: resourceNames/nonResourceURLs are not checked",
                        name(r)
                    ));
                }
            }
        }
    }
    let mut granted: BTreeMap<(String, String), BTreeSet<Grant>> = BTreeMap::new();
    for kind in ["ClusterRoleBinding", "RoleBinding"] {
        for b in of_kind(res, kind) {
            let bns = meta(b, "namespace");
            let rk = b
                .pointer("/roleRef/kind")
                .and_then(Value::as_str)
                .unwrap_or("");
            let rn = b
                .pointer("/roleRef/name")
                .and_then(Value::as_str)
                .unwrap_or("");
            if b.pointer("/roleRef/apiGroup").and_then(Value::as_str)
                != Some("rbac.authorization.k8s.io")
            {
                p.push(format!(
                    "{kind} {}: roleRef.apiGroup must be rbac.authorization.k8s.io",
                    name(b)
                ));
            }
            if kind == "ClusterRoleBinding" && rk != "ClusterRole" {
                p.push(format!("{kind} {}: can only bind a ClusterRole", name(b)));
                continue;
            }
            let Some(rules) = rules_of(rk, rn, bns) else {
                p.push(format!(
                    "{kind} {}: {rk} {rn} is not in the manifests",
                    name(b)
                ));
                continue;
            };
            let scope = if kind == "RoleBinding" {
                bns.map(str::to_owned)
            } else {
                None
            };
            for s in array(b.get("subjects")) {
                let sk = s.get("kind").and_then(Value::as_str);
                let sn = s.get("name").and_then(Value::as_str).unwrap_or("");
                let Some(sns) = s.get("namespace").and_then(Value::as_str) else {
                    p.push(format!(
                        "{kind} {}: subject {sn} needs a namespace",
                        name(b)
                    ));
                    continue;
                };
                if sk != Some("ServiceAccount") {
                    p.push(format!(
                        "{kind} {}: only ServiceAccount subjects are expected",
                        name(b)
                    ));
                    continue;
                }
                let exists = of_kind(res, "ServiceAccount")
                    .any(|a| meta(a, "name") == Some(sn) && meta(a, "namespace") == Some(sns));
                if !exists {
                    p.push(format!(
                        "{kind} {}: ServiceAccount {sns}/{sn} is not in the manifests",
                        name(b)
                    ));
                }
                let set = granted.entry((sns.to_owned(), sn.to_owned())).or_default();
                for rule in &rules {
                    for g in strs(rule.get("apiGroups")) {
                        for r in strs(rule.get("resources")) {
                            for v in strs(rule.get("verbs")) {
                                set.insert((scope.clone(), g.clone(), r.clone(), v));
                            }
                        }
                    }
                }
            }
        }
    }
    let accounts: BTreeSet<_> = needs.keys().chain(granted.keys()).cloned().collect();
    for (ns, sa) in accounts {
        let key = (ns.clone(), sa.clone());
        let empty = BTreeSet::new();
        let have = granted.get(&key).unwrap_or(&empty);
        let mut wanted: BTreeSet<Grant> = BTreeSet::new();
        for n in needs.get(&key).map_or(&[][..], Vec::as_slice) {
            for v in n.verbs {
                let scope = n.namespaced.then(|| ns.clone());
                let g = (
                    scope.clone(),
                    n.group.to_owned(),
                    n.resource.to_owned(),
                    (*v).to_owned(),
                );
                let cluster = (None, g.1.clone(), g.2.clone(), g.3.clone());
                let covered = have.contains(&g) || (n.namespaced && have.contains(&cluster));
                if !covered {
                    p.push(format!(
                        "ServiceAccount {ns}/{sa} lacks {v} on {}{}{}",
                        if n.group.is_empty() { "" } else { n.group },
                        if n.group.is_empty() { "" } else { "/" },
                        n.resource
                    ));
                }
                wanted.insert(g);
            }
        }
        for g in have.difference(&wanted) {
            let scope =
                g.0.as_deref()
                    .map_or("cluster-wide".to_owned(), |n| format!("in {n}"));
            p.push(format!(
                "ServiceAccount {ns}/{sa} is granted {} on {}/{} {scope}, which none of its \
                 containers needs",
                g.3, g.1, g.2
            ));
        }
    }
}
