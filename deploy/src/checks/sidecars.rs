//! The CSI sidecars the manifests may use ([`SIDECARS`]), pinned, and the checks of a sidecar
//! container: its image, its flags, `--leader-election` where supported.

use std::collections::BTreeSet;

use serde_json::Value;

use super::rbac::{EVENTS, GET_LIST_WATCH, Need, need};
use super::{has_switch, image_repo};

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
            ("node-deployment", true),
            ("enable-capacity", true),
            ("capacity-ownerref-level", false),
            ("capacity-poll-interval", false),
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
        tag: "v8.6.0",
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
            ("feature-gates", false),
            ("group-snapshot-name-prefix", false),
            ("node-deployment", true),
        ],
        leader_election: true,
        // With --feature-gates=CSIVolumeGroupSnapshot=true (the base passes it): the group
        // snapshot kinds, and creating the contents of a group's members.
        needs: &[
            need(
                "snapshot.storage.k8s.io",
                "volumesnapshotclasses",
                GET_LIST_WATCH,
            ),
            need(
                "snapshot.storage.k8s.io",
                "volumesnapshotcontents",
                &["create", "get", "list", "watch", "update", "patch"],
            ),
            need(
                "snapshot.storage.k8s.io",
                "volumesnapshotcontents/status",
                &["update", "patch"],
            ),
            need(
                "groupsnapshot.storage.k8s.io",
                "volumegroupsnapshotclasses",
                GET_LIST_WATCH,
            ),
            need(
                "groupsnapshot.storage.k8s.io",
                "volumegroupsnapshotcontents",
                &["get", "list", "watch", "update", "patch"],
            ),
            need(
                "groupsnapshot.storage.k8s.io",
                "volumegroupsnapshotcontents/status",
                &["update", "patch"],
            ),
            EVENTS,
        ],
    },
];

/// The registrar sidecar's repository.
pub const REGISTRAR: &str = "registry.k8s.io/sig-storage/csi-node-driver-registrar";
/// The provisioner sidecar's repository.
pub const PROVISIONER: &str = "registry.k8s.io/sig-storage/csi-provisioner";

/// What csi-provisioner `--enable-capacity` needs besides its own rules: the CSIStorageCapacity
/// objects of its namespace, and `get` on its pod to name it their owner
/// (`--capacity-ownerref-level=0`, the one level checked here).
pub const CAPACITY_NEEDS: &[Need] = &[
    Need {
        group: "storage.k8s.io",
        resource: "csistoragecapacities",
        verbs: &[
            "get", "list", "watch", "create", "update", "patch", "delete",
        ],
        namespaced: true,
    },
    Need {
        group: "",
        resource: "pods",
        verbs: &["get"],
        namespaced: true,
    },
];

/// What a sidecar needs for the flags it is given, beyond [`Sidecar::needs`].
pub(super) fn extra_needs(s: &Sidecar, args: &[String]) -> Vec<Need> {
    if s.repo == PROVISIONER && has_switch(args, "enable-capacity") {
        CAPACITY_NEEDS.to_vec()
    } else {
        Vec::new()
    }
}

/// The `fieldPath` an env var of a container is set from, if it is.
fn env_from<'a>(c: &'a Value, var: &str) -> Option<&'a str> {
    c.get("env")?
        .as_array()?
        .iter()
        .find(|e| e.get("name").and_then(Value::as_str) == Some(var))?
        .pointer("/valueFrom/fieldRef/fieldPath")?
        .as_str()
}
/// The registrar's default `--plugin-registration-path`.
pub const REGISTRAR_DEFAULT_DIR: &str = "/registration";

pub(super) fn sidecar_of(c: &Value) -> Option<&'static Sidecar> {
    let image = c.get("image").and_then(Value::as_str)?;
    let (repo, _) = image_repo(image);
    SIDECARS.iter().find(|s| s.repo == repo)
}

pub(super) fn sidecar(c: &Value, s: &Sidecar, args: &[String], p: &mut Vec<String>) {
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
    // One on each node (--node-deployment) elects no leader: each acts for its node
    // (csi-snapshotter refuses both); otherwise one acts for the cluster.
    let node_deployment = has_switch(args, "node-deployment");
    if s.leader_election && !node_deployment && !has_switch(args, "leader-election") {
        p.push("supports leader election: pass --leader-election".into());
    }
    if node_deployment && has_switch(args, "leader-election") {
        p.push(
            "--node-deployment runs one on each node, each for its node: no --leader-election"
                .into(),
        );
    }
    let mut env = Vec::new();
    if node_deployment {
        env.push(("NODE_NAME", "spec.nodeName"));
    }
    if s.repo == PROVISIONER && has_switch(args, "enable-capacity") {
        env.push(("NAMESPACE", "metadata.namespace"));
        env.push(("POD_NAME", "metadata.name"));
        if super::arg_value(args, "capacity-ownerref-level") != Some("0") {
            p.push(
                "--enable-capacity: pass --capacity-ownerref-level=0 (the pod owns its \
                 CSIStorageCapacity objects; the RBAC checked is for that level)"
                    .into(),
            );
        }
    }
    for (var, field) in env {
        if env_from(c, var) != Some(field) {
            p.push(format!("needs the env var {var} from fieldRef {field}"));
        }
    }
}
