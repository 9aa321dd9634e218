//! RBAC: each ServiceAccount is granted exactly what its containers need ([`Need`]): nothing
//! missing, nothing more, no wildcards; bindings name existing roles and accounts.

use std::collections::{BTreeMap, BTreeSet};

use serde_json::Value;

use super::{array, name, of_kind, strs};
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

pub(super) const fn need(
    group: &'static str,
    resource: &'static str,
    verbs: &'static [&'static str],
) -> Need {
    Need {
        group,
        resource,
        verbs,
        namespaced: false,
    }
}

pub(super) const GET_LIST_WATCH: &[&str] = &["get", "list", "watch"];
pub(super) const EVENTS: Need = need(
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
/// What moor-controller `--mark-snapshot-contents` needs: its node's contents labelled, its
/// node's copy of the driver's group snapshot classes made (controller/src/kube.rs).
pub const MARK_NEEDS: &[Need] = &[
    need(
        "snapshot.storage.k8s.io",
        "volumesnapshotcontents",
        &["list", "patch"],
    ),
    need(
        "groupsnapshot.storage.k8s.io",
        "volumegroupsnapshotcontents",
        &["list", "patch"],
    ),
    need(
        "groupsnapshot.storage.k8s.io",
        "volumegroupsnapshotclasses",
        &["list", "create"],
    ),
];

/// What moor-controller `--key-rotation-annotations` needs: the driver's PersistentVolumes and
/// their claims listed, for their rotation schedule annotations (controller/src/kube.rs,
/// `schedules_once`: a GET of each collection, nothing else).
pub const KEY_ROTATION_NEEDS: &[Need] = &[
    need("", "persistentvolumes", &["list"]),
    need("", "persistentvolumeclaims", &["list"]),
];

/// A permission triple granted or needed, with its scope (`None`: cluster-wide).
type Grant = (Option<String>, String, String, String);

pub(super) fn rbac(
    res: &[Resource],
    needs: &BTreeMap<(String, String), Vec<Need>>,
    p: &mut Vec<String>,
) {
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
