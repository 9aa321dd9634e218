//! Cross-object checks of a rendered set of manifests: what the schemas cannot say.
//!
//! - objects: unique, no `status` or server-set metadata, namespaced kinds in a Namespace of
//!   the set and cluster-scoped ones without one;
//! - CSIDrivers, one of whose names every moor binary, StorageClass and snapshot class uses;
//!   a driver served by node-local controllers is never attached (`attachRequired: false`)
//!   and has `storageCapacity` exactly when its provisioners publish capacity, one served by
//!   a one-node controller is attached; every driver has `podInfoOnMount` (the pod whose
//!   cgroup a volume's QoS limits go in);
//! - host-network pods of different workloads never declare the same port (DaemonSets share
//!   every node);
//! - pods: selectors match the template, the ServiceAccount exists, every mount names a volume
//!   and every volume is mounted and has exactly one source, `$(VAR)`s name the container's
//!   environment, Bidirectional propagation only in privileged containers, images pinned and
//!   known, value flags written `--name=value`;
//! - moor containers: the binary's flags ([`crate::flags`]), the node id from `spec.nodeName`,
//!   privileged, the shutdown grace shorter than the pod's termination grace period;
//! - sidecars ([`SIDECARS`]): known flags, the socket of a moor daemon of their pod that serves
//!   what they call, through the same volume, `--leader-election` where supported unless
//!   `--node-deployment` (then none, and NODE_NAME from the node), capacity publishing with its
//!   env and its rights;
//! - probes: the port is declared and served in the pod; on the host network every HTTP
//!   endpoint binds loopback and the probe targets 127.0.0.1;
//! - the node plugin: kubelet dir mounted at its own path with Bidirectional propagation, the
//!   socket in `<kubelet dir>/plugins/<driver>/`, state kept on the host, exactly one way of
//!   registering with kubelet, the right registration path; `--key-rotation-secrets` a
//!   Secret's volume mounted read-only, with a controller to ask;
//! - the controller: one replica, Recreate, pinned to a node (a Deployment) or `--node-local`
//!   beside moor-node `--local-controller` (a DaemonSet); data dir, /dev and the kubelet's
//!   mounts (HostToContainer) from the host;
//! - RBAC: each ServiceAccount is granted exactly what its containers need ([`Need`]): nothing
//!   missing, nothing more, no wildcards; bindings name existing roles and accounts.

mod controller;
mod node;
mod pods;
mod probes;
mod rbac;
mod sidecars;

use std::collections::{BTreeMap, BTreeSet};

use serde_json::Value;

use crate::flags::Cli;
use crate::kustomize::{Resource, meta};

use self::pods::{DriverFact, workload};
use self::rbac::rbac;
pub use self::rbac::{CONTROLLER_NEEDS, KEY_ROTATION_NEEDS, LEASES, MARK_NEEDS, NODE_NEEDS, Need};
pub use self::sidecars::{REGISTRAR, REGISTRAR_DEFAULT_DIR, SIDECARS, Sidecar};

/// Kinds the checks know, and whether they are namespaced.
pub const SCOPES: &[(&str, bool)] = &[
    ("Namespace", false),
    ("CSIDriver", false),
    ("StorageClass", false),
    ("VolumeSnapshotClass", false),
    ("VolumeGroupSnapshotClass", false),
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
    let drivers: BTreeSet<&str> = of_kind(res, "CSIDriver")
        .filter_map(|d| meta(d, "name"))
        .collect();
    if drivers.is_empty() {
        p.push("no CSIDriver".into());
    }
    for sc in of_kind(res, "StorageClass") {
        let prov = sc.get("provisioner").and_then(Value::as_str);
        if !prov.is_some_and(|d| drivers.contains(d)) {
            p.push(format!(
                "StorageClass {:?}: provisioner {prov:?}, not a CSIDriver of the manifests \
                 ({drivers:?})",
                name(sc)
            ));
        }
    }
    for kind in ["VolumeSnapshotClass", "VolumeGroupSnapshotClass"] {
        for class in of_kind(res, kind) {
            let d = class.get("driver").and_then(Value::as_str);
            if !d.is_some_and(|d| drivers.contains(d)) {
                p.push(format!(
                    "{kind} {:?}: driver {d:?}, not a CSIDriver of the manifests ({drivers:?})",
                    name(class)
                ));
            }
        }
    }
    let mut needs: BTreeMap<(String, String), Vec<Need>> = BTreeMap::new();
    let mut facts = Vec::new();
    for w in res.iter().filter(|r| is_workload(&r.doc)) {
        let mut wp = Vec::new();
        workload(&w.doc, res, ctx, &drivers, &mut needs, &mut facts, &mut wp);
        p.extend(wp.into_iter().map(|m| format!("{}: {m}", w.id())));
    }
    csi_drivers(res, &facts, &mut p);
    host_ports(res, &mut p);
    rbac(res, &needs, &mut p);
    p
}

/// Each CSIDriver against what serves it: a driver of node-local controllers is never attached
/// (no attacher runs for it, and its volumes never leave their node) and lets the scheduler
/// place by capacity exactly when its provisioners publish it; a driver of a one-node
/// controller is attached (ControllerPublishVolume binds the device its node stages).
fn csi_drivers(res: &[Resource], facts: &[DriverFact], p: &mut Vec<String>) {
    for d in of_kind(res, "CSIDriver") {
        let dname = name(d);
        let spec_bool = |f: &str| d.pointer(&format!("/spec/{f}")).and_then(Value::as_bool);
        for f in facts.iter().filter(|f| f.driver == dname) {
            let (attach, why) = if f.node_local {
                (
                    false,
                    "its node-local controllers attach volumes for moor-node, not for a CO",
                )
            } else {
                (
                    true,
                    "its controller attaches volumes to the node (ControllerPublishVolume)",
                )
            };
            if spec_bool("attachRequired") != Some(attach) {
                p.push(format!(
                    "CSIDriver {dname}: attachRequired must be {attach}: {why} ({})",
                    f.workload
                ));
            }
            if spec_bool("podInfoOnMount") != Some(true) {
                p.push(format!(
                    "CSIDriver {dname}: podInfoOnMount must be true: moor-node puts a volume's \
                     QoS limits in the cgroup of the pod kubelet names ({})",
                    f.workload
                ));
            }
            if f.node_local && spec_bool("storageCapacity") != Some(f.capacity) {
                p.push(format!(
                    "CSIDriver {dname}: storageCapacity must be {} as its provisioners {} \
                     (--enable-capacity in {})",
                    f.capacity,
                    if f.capacity {
                        "publish capacity"
                    } else {
                        "publish none"
                    },
                    f.workload
                ));
            }
        }
    }
}

/// Host-network pods of different workloads never declare the same port: DaemonSets meet on
/// every node.
fn host_ports(res: &[Resource], p: &mut Vec<String>) {
    let mut seen: BTreeMap<u64, String> = BTreeMap::new();
    for w in res.iter().filter(|r| is_workload(&r.doc)) {
        let Some(spec) = w.doc.pointer("/spec/template/spec") else {
            continue;
        };
        if spec.get("hostNetwork") != Some(&Value::Bool(true)) {
            continue;
        }
        for c in array(spec.get("containers")) {
            for port in array(c.get("ports")) {
                let Some(n) = port.get("containerPort").and_then(Value::as_u64) else {
                    continue;
                };
                if let Some(other) = seen.insert(n, w.id())
                    && other != w.id()
                {
                    p.push(format!(
                        "{} and {other} both take port {n} of the host's network",
                        w.id()
                    ));
                }
            }
        }
    }
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
                "{id}: kind {kind} is not in deploy/src/checks/mod.rs SCOPES"
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

fn image_repo(image: &str) -> (&str, Option<&str>) {
    match image.rsplit_once(':') {
        Some((repo, tag)) if !tag.contains('/') => (repo, Some(tag)),
        _ => (image, None),
    }
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
