//! The Kubernetes OpenAPI documents the manifests are checked against, kept in the repository
//! (`deploy/openapi/`), and the step that makes them from Kubernetes' published documents.
//!
//! Kubernetes publishes one OpenAPI v3 document per API group version, each holding every
//! schema of that group and every schema those refer to. The kept copies hold only the
//! schemas of [`KINDS`] and what they refer to (`$ref`, transitively), unchanged, in the same
//! file names: [`trim_dir`] (the `trim-openapi` binary) writes them, and rewriting the kept
//! copies gives them back byte for byte.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

/// The kinds the manifests under `deploy/` use: `(group, version, kind)`, the core group
/// empty. VolumeSnapshotClass is a custom resource, not in Kubernetes' documents: its schema is
/// written by hand ([`crate::volume_snapshot_class_schema`]).
pub const KINDS: &[(&str, &str, &str)] = &[
    ("", "v1", "Namespace"),
    ("", "v1", "ServiceAccount"),
    ("apps", "v1", "DaemonSet"),
    ("apps", "v1", "Deployment"),
    ("rbac.authorization.k8s.io", "v1", "ClusterRole"),
    ("rbac.authorization.k8s.io", "v1", "ClusterRoleBinding"),
    ("rbac.authorization.k8s.io", "v1", "Role"),
    ("rbac.authorization.k8s.io", "v1", "RoleBinding"),
    ("storage.k8s.io", "v1", "CSIDriver"),
    ("storage.k8s.io", "v1", "StorageClass"),
];

const REF_PREFIX: &str = "#/components/schemas/";

/// The kept documents: `deploy/openapi/`.
pub fn kept_dir() -> PathBuf {
    crate::deploy_dir().join("openapi")
}

/// Whether a schema is the schema of one of `kinds` (its `x-kubernetes-group-version-kind`).
fn is_root(schema: &Value, kinds: &[(&str, &str, &str)]) -> bool {
    let Some(Value::Array(gvks)) = schema.get("x-kubernetes-group-version-kind") else {
        return false;
    };
    gvks.iter().any(|g| {
        let f = |k: &str| g.get(k).and_then(Value::as_str).unwrap_or("");
        kinds.iter().any(|(group, version, kind)| {
            f("group") == *group && f("version") == *version && f("kind") == *kind
        })
    })
}

/// Every `$ref` to a schema anywhere inside `v`.
fn refs<'a>(v: &'a Value, out: &mut Vec<&'a str>) {
    match v {
        Value::Object(m) => {
            for (k, x) in m {
                if k == "$ref"
                    && let Some(name) = x.as_str().and_then(|r| r.strip_prefix(REF_PREFIX))
                {
                    out.push(name);
                }
                refs(x, out);
            }
        }
        Value::Array(a) => a.iter().for_each(|x| refs(x, out)),
        _ => {}
    }
}

/// One document trimmed to the schemas of `kinds` and those they refer to, with its
/// `openapi` and `info` fields; `None` when it holds none of `kinds`. The schemas kept are
/// returned unchanged.
///
/// # Errors
/// When the document has no `components.schemas`, or a kept schema refers to one the
/// document does not define.
pub fn trim(doc: &Value, kinds: &[(&str, &str, &str)]) -> Result<Option<Value>, String> {
    let Some(Value::Object(schemas)) = doc.pointer("/components/schemas") else {
        return Err("no components.schemas".into());
    };
    let mut todo: Vec<&str> = schemas
        .iter()
        .filter(|(_, s)| is_root(s, kinds))
        .map(|(n, _)| n.as_str())
        .collect();
    if todo.is_empty() {
        return Ok(None);
    }
    let mut kept: BTreeMap<&str, &Value> = BTreeMap::new();
    while let Some(name) = todo.pop() {
        if kept.contains_key(name) {
            continue;
        }
        let schema = schemas
            .get(name)
            .ok_or_else(|| format!("$ref to {name}, which the document does not define"))?;
        kept.insert(name, schema);
        refs(schema, &mut todo);
    }
    let mut out = Map::new();
    for key in ["openapi", "info"] {
        if let Some(v) = doc.get(key) {
            out.insert(key.to_owned(), v.clone());
        }
    }
    let schemas: Map<String, Value> = kept
        .into_iter()
        .map(|(n, s)| (n.to_owned(), s.clone()))
        .collect();
    out.insert(
        "components".to_owned(),
        Value::Object(Map::from_iter([(
            "schemas".to_owned(),
            Value::Object(schemas),
        )])),
    );
    Ok(Some(Value::Object(out)))
}

/// A document as the kept copies are written: pretty JSON, keys in order, a final newline.
pub fn render(doc: &Value) -> String {
    let mut s = serde_json::to_string_pretty(doc).unwrap_or_default();
    s.push('\n');
    s
}

/// What [`trim_dir`] did with one document.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Trimmed {
    /// The document's file name.
    pub file: String,
    /// Schemas it had.
    pub before: usize,
    /// Schemas kept (0: no file written).
    pub after: usize,
}

/// Trims every `*.json` OpenAPI document in `from` to [`KINDS`] and writes those that hold
/// one into `to` under the same name; other `*.json` files in `to` are removed.
///
/// # Errors
/// When a document cannot be read, parsed or trimmed, a kind of [`KINDS`] is in none of them,
/// or `to` cannot be written.
pub fn trim_dir(from: &Path, to: &Path) -> Result<Vec<Trimmed>, String> {
    let json_files = |dir: &Path| -> Result<Vec<PathBuf>, String> {
        let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
            .map_err(|e| format!("{}: {e}", dir.display()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "json"))
            .collect();
        files.sort();
        Ok(files)
    };
    let mut report = Vec::new();
    let mut outputs = Vec::new();
    let mut found: BTreeSet<(&str, &str, &str)> = BTreeSet::new();
    for file in json_files(from)? {
        let name = file
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let text =
            std::fs::read_to_string(&file).map_err(|e| format!("{}: {e}", file.display()))?;
        let doc: Value =
            serde_json::from_str(&text).map_err(|e| format!("{}: {e}", file.display()))?;
        let before = doc
            .pointer("/components/schemas")
            .and_then(Value::as_object)
            .map_or(0, Map::len);
        let trimmed = trim(&doc, KINDS).map_err(|e| format!("{}: {e}", file.display()))?;
        let after = trimmed
            .as_ref()
            .and_then(|d| d.pointer("/components/schemas"))
            .and_then(Value::as_object)
            .map_or(0, |m| {
                for s in m.values() {
                    found.extend(KINDS.iter().filter(|k| is_root(s, &[**k])));
                }
                m.len()
            });
        report.push(Trimmed {
            file: name.clone(),
            before,
            after,
        });
        if let Some(t) = trimmed {
            outputs.push((name, render(&t)));
        }
    }
    let missing: Vec<String> = KINDS
        .iter()
        .filter(|k| !found.contains(*k))
        .map(|(g, v, k)| format!("{g}/{v}/{k}"))
        .collect();
    if !missing.is_empty() {
        return Err(format!(
            "{}: no document defines {}",
            from.display(),
            missing.join(", ")
        ));
    }
    std::fs::create_dir_all(to).map_err(|e| format!("{}: {e}", to.display()))?;
    for old in json_files(to)? {
        std::fs::remove_file(&old).map_err(|e| format!("{}: {e}", old.display()))?;
    }
    for (name, text) in outputs {
        let path = to.join(name);
        std::fs::write(&path, text).map_err(|e| format!("{}: {e}", path.display()))?;
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn doc() -> Value {
        let r = |n: &str| json!({"$ref": format!("{REF_PREFIX}{n}")});
        json!({
            "openapi": "3.0.0",
            "info": {"title": "Kubernetes"},
            "paths": {"/apis/g/v1": {}},
            "components": {"schemas": {
                "g.v1.Thing": {
                    "properties": {
                        "metadata": {"allOf": [r("meta.ObjectMeta")]},
                        "spec": {"items": r("g.v1.Spec")}
                    },
                    "x-kubernetes-group-version-kind": [{"group": "g", "version": "v1", "kind": "Thing"}]
                },
                "g.v1.Spec": {"additionalProperties": r("g.v1.Leaf")},
                "g.v1.Leaf": {"type": "string"},
                "meta.ObjectMeta": {"type": "object"},
                "g.v1.Other": {
                    "properties": {"x": r("g.v1.Unused")},
                    "x-kubernetes-group-version-kind": [{"group": "g", "version": "v1", "kind": "Other"}]
                },
                "g.v1.Unused": {"type": "string"}
            }}
        })
    }

    #[test]
    fn keeps_the_kinds_and_what_they_refer_to_unchanged_and_nothing_else() {
        let d = doc();
        let t = trim(&d, &[("g", "v1", "Thing")]).unwrap().unwrap();
        let kept: Vec<&String> = t["components"]["schemas"]
            .as_object()
            .unwrap()
            .keys()
            .collect();
        assert_eq!(
            kept,
            ["g.v1.Leaf", "g.v1.Spec", "g.v1.Thing", "meta.ObjectMeta"]
        );
        for n in kept {
            assert_eq!(t["components"]["schemas"][n], d["components"]["schemas"][n]);
        }
        assert_eq!(t["openapi"], "3.0.0");
        assert!(t.get("paths").is_none());
        // Trimming a trimmed document changes nothing.
        assert_eq!(trim(&t, &[("g", "v1", "Thing")]).unwrap().unwrap(), t);
    }

    #[test]
    fn a_document_without_the_kinds_gives_none() {
        assert_eq!(trim(&doc(), &[("apps", "v1", "Thing")]).unwrap(), None);
        assert_eq!(trim(&doc(), &[("g", "v2", "Thing")]).unwrap(), None);
    }

    #[test]
    fn a_dangling_ref_or_no_schemas_is_an_error() {
        let mut d = doc();
        d["components"]["schemas"]
            .as_object_mut()
            .unwrap()
            .remove("g.v1.Leaf");
        let e = trim(&d, &[("g", "v1", "Thing")]).unwrap_err();
        assert!(e.contains("g.v1.Leaf"), "{e}");
        assert!(trim(&json!({"openapi": "3.0.0"}), KINDS).is_err());
    }
}
