//! Rendering with `kubectl kustomize`, the renderer `kubectl apply -k` uses, when kubectl is
//! there; [`render`] falls back to deploy's own renderer ([`crate::kustomize`]) when it is not.
//!
//! Which kubectl: the one [`ENV`] names (empty: none, render with the own renderer), else
//! `kubectl` on `PATH`, if `kubectl kustomize --help` runs.

use std::path::Path;
use std::process::Command;
use std::sync::OnceLock;

use serde_json::Value;

use crate::kustomize::{self, Resource};
use crate::yaml;

/// The environment variable naming the kubectl to render with; set and empty, the own
/// renderer renders everything.
pub const ENV: &str = "MOOR_DEPLOY_KUBECTL";

/// What renders the manifests.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Renderer {
    /// `<kubectl> kustomize`, with this kubectl.
    Kubectl(String),
    /// deploy's own renderer ([`kustomize::build`]).
    Own,
}

/// The renderer of this process: looked for once.
pub fn renderer() -> &'static Renderer {
    static R: OnceLock<Renderer> = OnceLock::new();
    R.get_or_init(|| find().map_or(Renderer::Own, Renderer::Kubectl))
}

/// The kubectl to render with, if there is one that has `kustomize`.
pub fn find() -> Option<String> {
    let kubectl = match std::env::var(ENV) {
        Ok(k) if k.is_empty() => return None,
        Ok(k) => k,
        Err(_) => "kubectl".to_owned(),
    };
    let runs = Command::new(&kubectl)
        .args(["kustomize", "--help"])
        .output()
        .is_ok_and(|o| o.status.success());
    runs.then_some(kubectl)
}

/// The objects `<kubectl> kustomize <dir>` renders, in its order.
///
/// # Errors
/// When kubectl cannot run, fails (its error output), or prints what is not strict YAML.
pub fn kustomize(kubectl: &str, dir: &Path) -> Result<Vec<Value>, String> {
    let out = Command::new(kubectl)
        .arg("kustomize")
        .arg(dir)
        .output()
        .map_err(|e| format!("{kubectl} kustomize {}: {e}", dir.display()))?;
    if !out.status.success() {
        return Err(format!(
            "{kubectl} kustomize {}: {}: {}",
            dir.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    let text = String::from_utf8(out.stdout)
        .map_err(|e| format!("{kubectl} kustomize {}: {e}", dir.display()))?;
    let docs = yaml::load_all(&text)
        .map_err(|e| format!("{kubectl} kustomize {}: output: {e}", dir.display()))?;
    Ok(docs
        .into_iter()
        .map(|d| d.value)
        .filter(|v| !v.is_null())
        .collect())
}

/// Renders the kustomization in `dir` with [`renderer`]. kubectl does not say which file an
/// object came from: its objects name the kustomization file as their source.
///
/// # Errors
/// Every problem found (the own renderer's), or kubectl's failure.
pub fn render(dir: &Path) -> Result<Vec<Resource>, Vec<String>> {
    match renderer() {
        Renderer::Own => kustomize::build(dir),
        Renderer::Kubectl(kubectl) => {
            let source = dir.join(kustomize::FILE);
            let docs = kustomize(kubectl, dir).map_err(|e| vec![e])?;
            Ok(docs
                .into_iter()
                .map(|doc| Resource {
                    source: source.clone(),
                    doc,
                })
                .collect())
        }
    }
}

/// The differences between two renderings of the same kustomization, compared as objects
/// (order and YAML formatting aside): objects only one of them has, and for an object both
/// have, the first field where they differ.
pub fn differences(own: &[Value], theirs: &[Value]) -> Vec<String> {
    let by_key = |docs: &[Value]| {
        let mut m = std::collections::BTreeMap::new();
        for d in docs {
            m.entry(kustomize::identity(d))
                .or_insert_with(Vec::new)
                .push(d.clone());
        }
        m
    };
    let (own, theirs) = (by_key(own), by_key(theirs));
    let mut out = Vec::new();
    // kind.group/namespace/name, as kubectl names objects.
    let name = |(group, kind, ns, name): &(String, String, String, String)| {
        let mut s = kind.clone();
        for (sep, part) in [('.', group), ('/', ns), ('/', name)] {
            if !part.is_empty() {
                s.push(sep);
                s.push_str(part);
            }
        }
        s
    };
    for (k, docs) in &own {
        match theirs.get(k) {
            None => out.push(format!("{}: only in deploy's renderer", name(k))),
            Some(other) if other.len() != docs.len() => out.push(format!(
                "{}: {} times in deploy's renderer, {} times in kubectl's",
                name(k),
                docs.len(),
                other.len()
            )),
            Some(other) => {
                for (a, b) in docs.iter().zip(other) {
                    if let Some((at, a, b)) = first_difference(a, b, String::new()) {
                        out.push(format!(
                            "{}: at {at}, deploy's renderer has {a}, kubectl's {b}",
                            name(k)
                        ));
                    }
                }
            }
        }
    }
    for k in theirs.keys().filter(|k| !own.contains_key(*k)) {
        out.push(format!("{}: only in kubectl's renderer", name(k)));
    }
    out
}

/// The first place (a JSON pointer) where two values differ, and what each has there
/// (`(absent)` for a field one of them lacks).
fn first_difference(a: &Value, b: &Value, at: String) -> Option<(String, String, String)> {
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            let mut keys: Vec<&String> = x.keys().chain(y.keys()).collect();
            keys.sort();
            keys.dedup();
            let show =
                |v: Option<&Value>| v.map_or_else(|| "(absent)".to_owned(), Value::to_string);
            keys.into_iter().find_map(|k| {
                let here = format!("{at}/{}", k.replace('~', "~0").replace('/', "~1"));
                match (x.get(k), y.get(k)) {
                    (Some(p), Some(q)) => first_difference(p, q, here),
                    (p, q) => Some((here, show(p), show(q))),
                }
            })
        }
        (Value::Array(x), Value::Array(y)) if x.len() == y.len() => x
            .iter()
            .zip(y)
            .enumerate()
            .find_map(|(i, (p, q))| first_difference(p, q, format!("{at}/{i}"))),
        _ if a == b => None,
        _ => Some((at, a.to_string(), b.to_string())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn differences_ignore_order_and_name_the_field() {
        let cm = |name: &str, v: Value| {
            json!({"apiVersion": "v1", "kind": "ConfigMap",
                   "metadata": {"name": name, "namespace": "n"}, "data": v})
        };
        let a = [
            cm("a", json!({"x": "1"})),
            cm("b", json!({"y/z": ["p", "q"]})),
        ];
        let b = [
            cm("b", json!({"y/z": ["p", "q"]})),
            cm("a", json!({"x": "1"})),
        ];
        assert_eq!(differences(&a, &b), Vec::<String>::new());
        let c = [cm("b", json!({"y/z": ["p", "r"]})), cm("c", json!({}))];
        let d = differences(&a, &c);
        assert_eq!(
            d,
            [
                "ConfigMap/n/a: only in deploy's renderer",
                "ConfigMap/n/b: at /data/y~1z/1, deploy's renderer has \"q\", kubectl's \"r\"",
                "ConfigMap/n/c: only in kubectl's renderer",
            ]
        );
        let e = [
            cm("a", json!({"x": "1", "w": "2"})),
            cm("b", json!({"y/z": ["p"]})),
        ];
        let d = differences(&a, &e);
        assert_eq!(
            d,
            [
                "ConfigMap/n/a: at /data/w, deploy's renderer has (absent), kubectl's \"2\"",
                "ConfigMap/n/b: at /data/y~1z, deploy's renderer has [\"p\",\"q\"], kubectl's [\"p\"]",
            ]
        );
    }
}
