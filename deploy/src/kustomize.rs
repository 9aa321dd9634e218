//! deploy's own kustomize renderer: the few features deploy/ uses, enough to render its
//! overlays where there is no kubectl ([`crate::kubectl::render`] uses kubectl when it is
//! there, and a test holds this renderer to kubectl's output):
//!
//! - `resources`: YAML files, and directories holding a `kustomization.yaml`;
//! - `patches` with a `target` (group, version, kind, name, namespace) and a JSON 6902 patch,
//!   from a file (`path`) or inline (`patch`);
//! - `images` (`name`, with `newName`, `newTag` or `digest`): the image of every container
//!   and init container named `name` (tag and digest aside) renamed, retagged or pinned,
//!   after the patches.
//!
//! Anything else in a kustomization (namePrefix, strategic-merge patches, generators,
//! label selectors, remote resources, ...) is an error naming the feature, so an overlay never
//! renders differently here than with `kubectl kustomize`. Like kustomize, two resources with
//! the same group, kind, namespace and name are an error; unlike it, a patch whose target
//! matches nothing is an error too. Objects come in the order of the files, not kustomize's.

use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use crate::schema::Gvk;
use crate::yaml;

/// The kustomization file name.
pub const FILE: &str = "kustomization.yaml";
/// The only `apiVersion` of kustomization files accepted.
pub const API_VERSION: &str = "kustomize.config.k8s.io/v1beta1";

/// A rendered object and the file it came from.
#[derive(Debug, Clone, PartialEq)]
pub struct Resource {
    /// The YAML file the object was read from.
    pub source: PathBuf,
    /// The object, with every patch applied.
    pub doc: Value,
}

impl Resource {
    /// `kind/name` (with the namespace when there is one), for messages.
    pub fn id(&self) -> String {
        let kind = self.doc.get("kind").and_then(Value::as_str).unwrap_or("?");
        let name = meta(&self.doc, "name").unwrap_or("?");
        match meta(&self.doc, "namespace") {
            Some(ns) => format!("{kind}/{ns}/{name}"),
            None => format!("{kind}/{name}"),
        }
    }
}

/// A metadata string field of an object.
pub fn meta<'a>(doc: &'a Value, field: &str) -> Option<&'a str> {
    doc.get("metadata")?.get(field)?.as_str()
}

/// Renders the kustomization in `dir`.
///
/// # Errors
/// Every problem found, each naming its file.
pub fn build(dir: &Path) -> Result<Vec<Resource>, Vec<String>> {
    let mut errors = Vec::new();
    let out = build_inner(dir, 0, &mut errors);
    if errors.is_empty() {
        Ok(out)
    } else {
        Err(errors)
    }
}

/// Parses a YAML file into its documents.
///
/// # Errors
/// When the file cannot be read or is not strict YAML.
pub fn load_file(path: &Path) -> Result<Vec<Value>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    yaml::load_all(&text)
        .map(|docs| docs.into_iter().map(|d| d.value).collect())
        .map_err(|e| format!("{}: {e}", path.display()))
}

fn build_inner(dir: &Path, depth: usize, errors: &mut Vec<String>) -> Vec<Resource> {
    let file = dir.join(FILE);
    let at = |msg: String| format!("{}: {msg}", file.display());
    if depth > 16 {
        errors.push(at("resources nest deeper than 16 (a cycle?)".into()));
        return Vec::new();
    }
    for other in ["kustomization.yml", "Kustomization"] {
        if dir.join(other).exists() {
            errors.push(format!("{}: use {FILE} only", dir.join(other).display()));
        }
    }
    let k = match load_file(&file) {
        Ok(docs) => match <[Value; 1]>::try_from(docs) {
            Ok([Value::Object(k)]) => k,
            Ok(_) => {
                errors.push(at("not a mapping".into()));
                return Vec::new();
            }
            Err(docs) => {
                errors.push(at(format!("{} documents, expected 1", docs.len())));
                return Vec::new();
            }
        },
        Err(e) => {
            errors.push(e);
            return Vec::new();
        }
    };
    for (key, value) in &k {
        match key.as_str() {
            "apiVersion" if value.as_str() == Some(API_VERSION) => {}
            "apiVersion" => errors.push(at(format!("apiVersion must be {API_VERSION}"))),
            "kind" if value.as_str() == Some("Kustomization") => {}
            "kind" => errors.push(at("kind must be Kustomization".into())),
            "resources" | "patches" | "images" => {}
            other => errors.push(at(format!(
                "field {other:?} is not implemented by deploy's kustomize renderer \
                 (deploy/src/kustomize.rs): use resources, JSON 6902 patches and images, or \
                 extend it"
            ))),
        }
    }
    for required in ["apiVersion", "kind"] {
        if !k.contains_key(required) {
            errors.push(at(format!("{required} is missing")));
        }
    }
    let mut out: Vec<Resource> = Vec::new();
    for entry in list(&k, "resources", &at, errors) {
        let Some(rel) = entry.as_str() else {
            errors.push(at(format!("resource {entry} is not a path")));
            continue;
        };
        if rel.contains("://") || rel.starts_with("github.com/") || Path::new(rel).is_absolute() {
            errors.push(at(format!(
                "resource {rel:?}: only relative local paths are supported"
            )));
            continue;
        }
        let path = dir.join(rel);
        if path.is_dir() {
            out.extend(build_inner(&path, depth + 1, errors));
        } else {
            match load_file(&path) {
                Ok(docs) => out.extend(docs.into_iter().map(|doc| Resource {
                    source: path.clone(),
                    doc,
                })),
                Err(e) => errors.push(e),
            }
        }
    }
    let mut seen = Vec::new();
    for r in &out {
        let id = identity(&r.doc);
        if seen.contains(&id) {
            errors.push(at(format!(
                "resource {} ({}) is included twice",
                r.id(),
                r.source.display()
            )));
        }
        seen.push(id);
    }
    for (i, p) in list(&k, "patches", &at, errors).iter().enumerate() {
        if let Err(e) = apply_patch_entry(dir, p, &mut out) {
            errors.push(at(format!("patches[{i}]: {e}")));
        }
    }
    for (i, entry) in list(&k, "images", &at, errors).iter().enumerate() {
        match ImageEntry::parse(entry) {
            Ok(image) => {
                for r in &mut out {
                    image.apply(&mut r.doc);
                }
            }
            Err(e) => errors.push(at(format!("images[{i}]: {e}"))),
        }
    }
    out
}

/// One entry of a kustomization's `images`.
#[derive(Debug, Clone, PartialEq, Eq)]
struct ImageEntry {
    name: String,
    new_name: Option<String>,
    new_tag: Option<String>,
    digest: Option<String>,
}

impl ImageEntry {
    fn parse(entry: &Value) -> Result<Self, String> {
        let Value::Object(entry) = entry else {
            return Err("not a mapping".into());
        };
        let field = |key: &str| -> Result<Option<String>, String> {
            match entry.get(key) {
                None => Ok(None),
                Some(Value::String(v)) if !v.is_empty() => Ok(Some(v.clone())),
                Some(_) => Err(format!("{key} must be a non-empty string")),
            }
        };
        let image = Self {
            name: field("name")?.ok_or("name is missing")?,
            new_name: field("newName")?,
            new_tag: field("newTag")?,
            digest: field("digest")?,
        };
        for key in entry.keys() {
            if !matches!(key.as_str(), "name" | "newName" | "newTag" | "digest") {
                return Err(format!(
                    "field {key:?} is not implemented (name, newName, newTag, digest)"
                ));
            }
        }
        if image.new_name.is_none() && image.new_tag.is_none() && image.digest.is_none() {
            return Err("give newName, newTag or digest".into());
        }
        Ok(image)
    }

    /// `image` with this entry applied, or None when it names another image.
    fn rewrite(&self, image: &str) -> Option<String> {
        let (rest, digest) = match image.split_once('@') {
            Some((r, d)) => (r, Some(d)),
            None => (image, None),
        };
        // A tag follows the last ':' after the last '/' (a registry's port is not a tag).
        let slash = rest.rfind('/').map_or(0, |i| i + 1);
        let (name, tag) = match rest[slash..].rfind(':') {
            Some(i) => (&rest[..slash + i], Some(&rest[slash + i + 1..])),
            None => (rest, None),
        };
        if name != self.name {
            return None;
        }
        let mut out = self.new_name.clone().unwrap_or_else(|| name.to_owned());
        if let Some(d) = &self.digest {
            out.push('@');
            out.push_str(d);
        } else if let Some(t) = &self.new_tag {
            out.push(':');
            out.push_str(t);
        } else if let Some(d) = digest {
            out.push('@');
            out.push_str(d);
        } else if let Some(t) = tag {
            out.push(':');
            out.push_str(t);
        }
        Some(out)
    }

    /// Applies the entry to every `image` of a container or init container in `doc`.
    fn apply(&self, doc: &mut Value) {
        match doc {
            Value::Object(map) => {
                for (key, value) in map.iter_mut() {
                    if matches!(key.as_str(), "containers" | "initContainers")
                        && let Value::Array(containers) = value
                    {
                        for c in containers {
                            let new = c
                                .get("image")
                                .and_then(Value::as_str)
                                .and_then(|i| self.rewrite(i));
                            if let (Some(new), Value::Object(c)) = (new, c) {
                                c.insert("image".into(), Value::String(new));
                            }
                        }
                    } else {
                        self.apply(value);
                    }
                }
            }
            Value::Array(items) => {
                for item in items {
                    self.apply(item);
                }
            }
            _ => {}
        }
    }
}

fn list<'a>(
    k: &'a Map<String, Value>,
    key: &str,
    at: &impl Fn(String) -> String,
    errors: &mut Vec<String>,
) -> &'a [Value] {
    match k.get(key) {
        None => &[],
        Some(Value::Array(items)) => items,
        Some(_) => {
            errors.push(at(format!("{key} must be a list")));
            &[]
        }
    }
}

/// What makes a resource unique: group, kind, namespace, name.
pub fn identity(doc: &Value) -> (String, String, String, String) {
    let g = Gvk::of(doc).map(|g| g.group).unwrap_or_default();
    let kind = doc.get("kind").and_then(Value::as_str).unwrap_or_default();
    let ns = meta(doc, "namespace").unwrap_or_default();
    let name = meta(doc, "name").unwrap_or_default();
    (g, kind.to_owned(), ns.to_owned(), name.to_owned())
}

fn apply_patch_entry(dir: &Path, entry: &Value, out: &mut [Resource]) -> Result<(), String> {
    let Value::Object(entry) = entry else {
        return Err("not a mapping".into());
    };
    for key in entry.keys() {
        if !matches!(key.as_str(), "path" | "patch" | "target") {
            return Err(format!(
                "field {key:?} is not implemented (path, patch, target)"
            ));
        }
    }
    let ops = match (entry.get("path"), entry.get("patch")) {
        (Some(Value::String(path)), None) => {
            let docs = load_file(&dir.join(path))?;
            match <[Value; 1]>::try_from(docs) {
                Ok([doc]) => doc,
                Err(docs) => return Err(format!("{path}: {} documents, expected 1", docs.len())),
            }
        }
        (None, Some(Value::String(inline))) => {
            let docs = yaml::load_all(inline).map_err(|e| format!("inline patch: {e}"))?;
            match <[yaml::Doc; 1]>::try_from(docs) {
                Ok([doc]) => doc.value,
                Err(docs) => return Err(format!("inline patch: {} documents", docs.len())),
            }
        }
        _ => return Err("give exactly one of path and patch, as a string".into()),
    };
    let Value::Array(ops) = ops else {
        return Err(
            "strategic-merge patches are not implemented by deploy's kustomize \
                    renderer: write a JSON 6902 patch (a list of operations)"
                .into(),
        );
    };
    let Some(Value::Object(target)) = entry.get("target") else {
        return Err("a JSON 6902 patch needs a target".into());
    };
    for (key, value) in target {
        if !matches!(
            key.as_str(),
            "group" | "version" | "kind" | "name" | "namespace"
        ) {
            return Err(format!("target field {key:?} is not implemented"));
        }
        if !value.is_string() {
            return Err(format!("target field {key:?} must be a string"));
        }
    }
    let want = |k: &str| target.get(k).and_then(Value::as_str);
    let mut matched = 0;
    for r in out.iter_mut() {
        let gvk = Gvk::of(&r.doc);
        let matches = want("group").is_none_or(|g| gvk.as_ref().is_some_and(|x| x.group == g))
            && want("version").is_none_or(|v| gvk.as_ref().is_some_and(|x| x.version == v))
            && want("kind").is_none_or(|k| gvk.as_ref().is_some_and(|x| x.kind == k))
            && want("name").is_none_or(|n| meta(&r.doc, "name") == Some(n))
            && want("namespace").is_none_or(|n| meta(&r.doc, "namespace") == Some(n));
        if matches {
            matched += 1;
            json_patch(&mut r.doc, &ops).map_err(|e| format!("{}: {e}", r.id()))?;
        }
    }
    if matched == 0 {
        return Err(format!(
            "target {} matches no resource",
            Value::Object(target.clone())
        ));
    }
    Ok(())
}

/// Applies a JSON patch (RFC 6902): add, remove, replace, move, copy and test. All or nothing.
///
/// # Errors
/// The first operation that is malformed or does not apply.
pub fn json_patch(doc: &mut Value, ops: &[Value]) -> Result<(), String> {
    let mut work = doc.clone();
    for (i, op) in ops.iter().enumerate() {
        apply_op(&mut work, op).map_err(|e| format!("operation {i} ({op}): {e}"))?;
    }
    *doc = work;
    Ok(())
}

fn apply_op(doc: &mut Value, op: &Value) -> Result<(), String> {
    let Value::Object(op) = op else {
        return Err("not a mapping".into());
    };
    let name = op.get("op").and_then(Value::as_str).ok_or("no op")?;
    let allowed: &[&str] = match name {
        "add" | "replace" | "test" => &["op", "path", "value"],
        "remove" => &["op", "path"],
        "move" | "copy" => &["op", "path", "from"],
        other => return Err(format!("unknown op {other:?}")),
    };
    for key in op.keys() {
        if !allowed.contains(&key.as_str()) {
            return Err(format!(
                "field {key:?} does not belong to a {name} operation"
            ));
        }
    }
    for key in allowed {
        if !op.contains_key(*key) {
            return Err(format!("{name} needs {key}"));
        }
    }
    let path = pointer(
        op.get("path")
            .and_then(Value::as_str)
            .ok_or("path is not a string")?,
    )?;
    let from = || -> Result<Vec<String>, String> {
        pointer(
            op.get("from")
                .and_then(Value::as_str)
                .ok_or("from is not a string")?,
        )
    };
    match name {
        "add" => add(doc, &path, op["value"].clone()),
        "remove" => remove(doc, &path).map(drop),
        "replace" => {
            let slot = get_mut(doc, &path)?;
            *slot = op["value"].clone();
            Ok(())
        }
        "test" => {
            let found = get_mut(doc, &path)?;
            if *found == op["value"] {
                Ok(())
            } else {
                Err(format!("test failed: found {found}"))
            }
        }
        "move" => {
            let from = from()?;
            if path.len() > from.len() && path[..from.len()] == from[..] {
                return Err("cannot move a value into itself".into());
            }
            let v = remove(doc, &from)?;
            add(doc, &path, v)
        }
        _ => {
            let v = get_mut(doc, &from()?)?.clone();
            add(doc, &path, v)
        }
    }
}

/// Splits a JSON pointer (RFC 6901) into unescaped tokens.
fn pointer(p: &str) -> Result<Vec<String>, String> {
    if p.is_empty() {
        return Ok(Vec::new());
    }
    let Some(rest) = p.strip_prefix('/') else {
        return Err(format!("pointer {p:?} does not start with /"));
    };
    rest.split('/')
        .map(|t| {
            if t.replace("~0", "").replace("~1", "").contains('~') {
                Err(format!("pointer {p:?}: bad escape"))
            } else {
                Ok(t.replace("~1", "/").replace("~0", "~"))
            }
        })
        .collect()
}

fn index(token: &str, len: usize, allow_end: bool) -> Result<usize, String> {
    let bad = || format!("array index {token:?} is out of range (length {len})");
    if token == "-" {
        return if allow_end { Ok(len) } else { Err(bad()) };
    }
    if token.len() > 1 && token.starts_with('0') || token.starts_with('+') {
        return Err(bad());
    }
    let i: usize = token.parse().map_err(|_| bad())?;
    if i < len || (allow_end && i == len) {
        Ok(i)
    } else {
        Err(bad())
    }
}

fn get_mut<'a>(doc: &'a mut Value, path: &[String]) -> Result<&'a mut Value, String> {
    let mut cur = doc;
    for t in path {
        cur = match cur {
            Value::Object(m) => m.get_mut(t).ok_or_else(|| format!("no field {t:?}"))?,
            Value::Array(a) => {
                let i = index(t, a.len(), false)?;
                &mut a[i]
            }
            _ => return Err(format!("{t:?}: not inside an object or array")),
        };
    }
    Ok(cur)
}

fn add(doc: &mut Value, path: &[String], value: Value) -> Result<(), String> {
    let Some((last, parent)) = path.split_last() else {
        *doc = value;
        return Ok(());
    };
    match get_mut(doc, parent)? {
        Value::Object(m) => {
            m.insert(last.clone(), value);
            Ok(())
        }
        Value::Array(a) => {
            let i = index(last, a.len(), true)?;
            a.insert(i, value);
            Ok(())
        }
        _ => Err(format!("{last:?}: parent is not an object or array")),
    }
}

fn remove(doc: &mut Value, path: &[String]) -> Result<Value, String> {
    let Some((last, parent)) = path.split_last() else {
        return Err("cannot remove the whole document".into());
    };
    match get_mut(doc, parent)? {
        Value::Object(m) => m.remove(last).ok_or_else(|| format!("no field {last:?}")),
        Value::Array(a) => {
            let i = index(last, a.len(), false)?;
            Ok(a.remove(i))
        }
        _ => Err(format!("{last:?}: parent is not an object or array")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn patch(doc: Value, ops: Value) -> Result<Value, String> {
        let mut doc = doc;
        json_patch(&mut doc, ops.as_array().unwrap())?;
        Ok(doc)
    }

    #[test]
    fn rfc6902_operations() {
        let doc = json!({"a": {"b": [1, 2, 3]}, "x~/y": 0});
        let out = patch(
            doc.clone(),
            json!([
                {"op": "test", "path": "/a/b/1", "value": 2},
                {"op": "remove", "path": "/a/b/1"},
                {"op": "add", "path": "/a/b/-", "value": 4},
                {"op": "add", "path": "/a/b/0", "value": 0},
                {"op": "replace", "path": "/x~0~1y", "value": 9},
                {"op": "copy", "from": "/a/b", "path": "/c"},
                {"op": "move", "from": "/c/0", "path": "/d"},
            ]),
        )
        .unwrap();
        assert_eq!(
            out,
            json!({"a": {"b": [0, 1, 3, 4]}, "x~/y": 9, "c": [1, 3, 4], "d": 0})
        );
        for bad in [
            json!([{"op": "test", "path": "/a/b/0", "value": 5}]),
            json!([{"op": "remove", "path": "/a/b/3"}]),
            json!([{"op": "replace", "path": "/nope", "value": 1}]),
            json!([{"op": "add", "path": "/a/b/01", "value": 1}]),
            json!([{"op": "add", "path": "a", "value": 1}]),
            json!([{"op": "add", "path": "/a"}]),
            json!([{"op": "remove", "path": "/a", "value": 1}]),
            json!([{"op": "move", "from": "/a", "path": "/a/b/x"}]),
            json!([{"op": "merge", "path": "/a"}]),
        ] {
            assert!(patch(doc.clone(), bad.clone()).is_err(), "{bad}");
        }
        // All or nothing: a failing test leaves the document as it was.
        let mut d = doc.clone();
        let ops = json!([{"op": "remove", "path": "/a"}, {"op": "test", "path": "/a", "value": 1}]);
        assert!(json_patch(&mut d, ops.as_array().unwrap()).is_err());
        assert_eq!(d, doc);
    }

    #[test]
    fn images_rename_retag_and_pin_by_name_only() {
        let entry = |v: Value| ImageEntry::parse(&v).unwrap();
        let tag = entry(json!({"name": "moor", "newTag": "0.2.0"}));
        assert_eq!(tag.rewrite("moor").as_deref(), Some("moor:0.2.0"));
        assert_eq!(tag.rewrite("moor:0.1.0").as_deref(), Some("moor:0.2.0"));
        assert_eq!(tag.rewrite("moor@sha256:ab").as_deref(), Some("moor:0.2.0"));
        assert_eq!(tag.rewrite("moorx:0.1.0"), None);
        assert_eq!(tag.rewrite("r.example/moor:0.1.0"), None);
        let name = entry(json!({"name": "moor", "newName": "r.example:5000/moor"}));
        assert_eq!(
            name.rewrite("moor:0.1.0").as_deref(),
            Some("r.example:5000/moor:0.1.0")
        );
        let moved = entry(json!({"name": "r.example:5000/moor", "newTag": "1"}));
        assert_eq!(
            moved.rewrite("r.example:5000/moor").as_deref(),
            Some("r.example:5000/moor:1")
        );
        let pin = entry(json!({"name": "moor", "digest": "sha256:cd", "newTag": "x"}));
        assert_eq!(pin.rewrite("moor:0.1.0").as_deref(), Some("moor@sha256:cd"));
        let mut doc = json!({"spec": {"template": {"spec": {
            "initContainers": [{"name": "i", "image": "moor"}],
            "containers": [{"name": "a", "image": "moor"}, {"name": "b", "image": "other:1"}],
            "volumes": [{"name": "v", "image": "moor"}]
        }}}});
        tag.apply(&mut doc);
        let spec = &doc["spec"]["template"]["spec"];
        assert_eq!(spec["initContainers"][0]["image"], "moor:0.2.0");
        assert_eq!(spec["containers"][0]["image"], "moor:0.2.0");
        assert_eq!(spec["containers"][1]["image"], "other:1");
        assert_eq!(
            spec["volumes"][0]["image"], "moor",
            "only containers' images"
        );
        for bad in [
            json!({"newTag": "1"}),
            json!({"name": "moor"}),
            json!({"name": "moor", "newTag": 1}),
            json!({"name": "moor", "newTag": "1", "tagSuffix": "x"}),
        ] {
            assert!(ImageEntry::parse(&bad).is_err(), "{bad}");
        }
    }
}
