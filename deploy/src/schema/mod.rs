//! A strict validator of Kubernetes objects against the API's OpenAPI v3 schemas.
//!
//! What it checks, for every value of an object, following `$ref`s and `allOf`:
//!
//! - every field exists in the schema of its object (an unknown field is an error; objects
//!   with neither `properties` nor `additionalProperties`, such as `FieldsV1`, are free-form);
//! - required fields are present, and no value is `null`;
//! - types: string, integer (with the `int32`/`int64` ranges), boolean, object, array;
//!   `int-or-string`; `Quantity` (a string in the quantity grammar, or a number);
//! - `enum`s, plus [`EXTRA_ENUMS`], the value sets these documents leave to prose;
//! - lists with `x-kubernetes-list-type: set` hold no duplicates, and lists keyed by
//!   `x-kubernetes-list-map-keys` or by a patch merge key hold no two items with the same key.
//!
//! A schema keyword it does not understand is reported as a problem, never skipped, so newer
//! documents cannot make the validation silently weaker. It does not check string formats
//! other than quantities and int-or-strings (names, label syntax, `date-time`), nor
//! cross-field rules (those are in [`crate::checks`] for the manifests' own needs).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::path::Path;

use serde_json::{Map, Value};

pub use self::additions::{EXTRA_ENUMS, LATER_FIELDS};

mod additions;

/// A problem found in a document, at a path such as `spec.template.spec.containers[moor-node]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// Where in the document.
    pub path: String,
    /// What is wrong.
    pub message: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.path.is_empty() {
            write!(f, "{}", self.message)
        } else {
            write!(f, "{}: {}", self.path, self.message)
        }
    }
}

/// Group, version and kind of an object.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Gvk {
    /// API group; empty for the core group.
    pub group: String,
    /// API version, e.g. `v1`.
    pub version: String,
    /// Kind, e.g. `DaemonSet`.
    pub kind: String,
}

impl Gvk {
    /// The GVK an object declares with `apiVersion` and `kind`.
    pub fn of(doc: &Value) -> Option<Self> {
        let api = doc.get("apiVersion")?.as_str()?;
        let kind = doc.get("kind")?.as_str()?;
        let (group, version) = api.rsplit_once('/').unwrap_or(("", api));
        Some(Self {
            group: group.to_owned(),
            version: version.to_owned(),
            kind: kind.to_owned(),
        })
    }
}

impl fmt::Display for Gvk {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.group.is_empty() {
            write!(f, "{}/{}", self.version, self.kind)
        } else {
            write!(f, "{}/{}/{}", self.group, self.version, self.kind)
        }
    }
}

/// Schema keywords the validator understands. Anything else is reported.
const KEYWORDS: &[&str] = &[
    "description",
    "default",
    "type",
    "format",
    "properties",
    "additionalProperties",
    "items",
    "required",
    "enum",
    "$ref",
    "allOf",
    "x-kubernetes-group-version-kind",
    "x-kubernetes-patch-strategy",
    "x-kubernetes-patch-merge-key",
    "x-kubernetes-map-type",
    "x-kubernetes-list-type",
    "x-kubernetes-list-map-keys",
    // Informative: which field discriminates a union (SeccompProfile); nothing to enforce.
    "x-kubernetes-unions",
];

const REF_PREFIX: &str = "#/components/schemas/";
const QUANTITY: &str = "io.k8s.apimachinery.pkg.api.resource.Quantity";

/// The schemas of every known kind.
#[derive(Debug, Default)]
pub struct Schemas {
    defs: HashMap<String, Value>,
    kinds: HashMap<Gvk, String>,
}

/// A schema with its `$ref`s and `allOf`s merged in.
#[derive(Default)]
struct Flat<'a> {
    names: Vec<&'a str>,
    types: BTreeSet<&'a str>,
    formats: BTreeSet<&'a str>,
    properties: BTreeMap<&'a str, &'a Value>,
    has_properties: bool,
    additional: Option<&'a Value>,
    required: BTreeSet<&'a str>,
    items: Vec<&'a Value>,
    enums: Vec<&'a Vec<Value>>,
    list_type: Option<&'a str>,
    list_map_keys: Vec<&'a str>,
    merge_key: Option<&'a str>,
    bad_keywords: Vec<String>,
}

impl Schemas {
    /// Loads every `*.json` OpenAPI v3 document in `dir` (each one's `components.schemas`).
    ///
    /// # Errors
    /// When the directory or a document cannot be read, or two documents define the same
    /// schema differently.
    pub fn load(dir: &Path) -> Result<Self, String> {
        let mut files: Vec<_> = std::fs::read_dir(dir)
            .map_err(|e| format!("{}: {e}", dir.display()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "json"))
            .collect();
        files.sort();
        if files.is_empty() {
            return Err(format!("{}: no OpenAPI documents (*.json)", dir.display()));
        }
        let mut out = Self::default();
        for file in files {
            let text =
                std::fs::read_to_string(&file).map_err(|e| format!("{}: {e}", file.display()))?;
            let doc: Value =
                serde_json::from_str(&text).map_err(|e| format!("{}: {e}", file.display()))?;
            let Some(Value::Object(schemas)) = doc.pointer("/components/schemas") else {
                return Err(format!("{}: no components.schemas", file.display()));
            };
            for (name, schema) in schemas {
                out.add(name, schema.clone())
                    .map_err(|e| format!("{}: {e}", file.display()))?;
            }
        }
        Ok(out)
    }

    /// Adds a schema; its `x-kubernetes-group-version-kind` entries make it a kind's schema.
    ///
    /// # Errors
    /// When a different schema of that name, or another schema for one of its kinds, exists.
    pub fn add(&mut self, name: &str, schema: Value) -> Result<(), String> {
        if let Some(old) = self.defs.get(name) {
            if *old != schema {
                return Err(format!("schema {name} is defined twice, differently"));
            }
            return Ok(());
        }
        if let Some(Value::Array(gvks)) = schema.get("x-kubernetes-group-version-kind") {
            for g in gvks {
                let field = |k: &str| g.get(k).and_then(Value::as_str).unwrap_or("").to_owned();
                let gvk = Gvk {
                    group: field("group"),
                    version: field("version"),
                    kind: field("kind"),
                };
                // Shared kinds (DeleteOptions, WatchEvent) name many GVKs: first one wins.
                self.kinds.entry(gvk).or_insert_with(|| name.to_owned());
            }
        }
        self.defs.insert(name.to_owned(), schema);
        Ok(())
    }

    /// Adds `property` of type `type_name` to the object schema `schema`, as a field a later
    /// Kubernetes release (`release`) added. A property the documents already have is left as
    /// they give it.
    ///
    /// # Errors
    /// When `schema` is not a known object schema.
    pub fn add_field(
        &mut self,
        schema: &str,
        property: &str,
        release: &str,
        type_name: &str,
    ) -> Result<(), String> {
        let props = self
            .defs
            .get_mut(schema)
            .and_then(|s| s.get_mut("properties"))
            .and_then(Value::as_object_mut)
            .ok_or_else(|| format!("schema {schema} has no properties to add {property} to"))?;
        props.entry(property).or_insert_with(|| {
            serde_json::json!({
                "description": format!("added in Kubernetes {release}"),
                "type": type_name,
            })
        });
        Ok(())
    }

    /// The schema name of a kind, if known.
    pub fn kind(&self, gvk: &Gvk) -> Option<&str> {
        self.kinds.get(gvk).map(String::as_str)
    }

    /// Validates an object by its `apiVersion` and `kind`.
    pub fn validate_object(&self, doc: &Value) -> Vec<Problem> {
        let Some(gvk) = Gvk::of(doc) else {
            return vec![Problem {
                path: String::new(),
                message: "an object needs string apiVersion and kind".into(),
            }];
        };
        match self.kind(&gvk) {
            Some(name) => self.validate(doc, name),
            None => vec![Problem {
                path: String::new(),
                message: format!("kind {gvk} is not in the schemas"),
            }],
        }
    }

    /// Validates `value` against the named schema.
    pub fn validate(&self, value: &Value, schema_name: &str) -> Vec<Problem> {
        let mut problems = Vec::new();
        let schema = Value::String(format!("{REF_PREFIX}{schema_name}"));
        let schema = Value::Object(Map::from_iter([("$ref".to_owned(), schema)]));
        self.check(value, &schema, &mut Vec::new(), &mut problems);
        problems
    }

    fn flatten<'a>(&'a self, schema: &'a Value, flat: &mut Flat<'a>, depth: usize) {
        let Value::Object(s) = schema else {
            flat.bad_keywords
                .push(format!("schema is not an object: {schema}"));
            return;
        };
        if depth > 64 {
            flat.bad_keywords
                .push("$ref/allOf nesting deeper than 64".into());
            return;
        }
        for key in s.keys() {
            if !KEYWORDS.contains(&key.as_str()) {
                flat.bad_keywords.push(key.clone());
            }
        }
        if let Some(r) = s.get("$ref") {
            let target = r
                .as_str()
                .and_then(|r| r.strip_prefix(REF_PREFIX))
                .and_then(|n| self.defs.get_key_value(n));
            match target {
                Some((name, t)) => {
                    flat.names.push(name);
                    self.flatten(t, flat, depth + 1);
                }
                None => flat.bad_keywords.push(format!("unresolvable $ref {r}")),
            }
        }
        if let Some(all) = s.get("allOf") {
            match all.as_array() {
                Some(all) => all
                    .iter()
                    .for_each(|sub| self.flatten(sub, flat, depth + 1)),
                None => flat.bad_keywords.push("allOf is not an array".into()),
            }
        }
        if let Some(t) = s.get("type").and_then(Value::as_str) {
            flat.types.insert(t);
        }
        if let Some(f) = s.get("format").and_then(Value::as_str) {
            flat.formats.insert(f);
        }
        if let Some(Value::Object(props)) = s.get("properties") {
            flat.has_properties = true;
            for (k, v) in props {
                flat.properties.insert(k, v);
            }
        }
        if let Some(a) = s.get("additionalProperties") {
            flat.additional = Some(a);
        }
        if let Some(Value::Array(req)) = s.get("required") {
            flat.required.extend(req.iter().filter_map(Value::as_str));
        }
        if let Some(items) = s.get("items") {
            flat.items.push(items);
        }
        if let Some(Value::Array(e)) = s.get("enum") {
            flat.enums.push(e);
        }
        if let Some(t) = s.get("x-kubernetes-list-type").and_then(Value::as_str) {
            flat.list_type = Some(t);
        }
        if let Some(Value::Array(keys)) = s.get("x-kubernetes-list-map-keys") {
            flat.list_map_keys = keys.iter().filter_map(Value::as_str).collect();
        }
        if let Some(k) = s
            .get("x-kubernetes-patch-merge-key")
            .and_then(Value::as_str)
        {
            flat.merge_key = Some(k);
        }
    }

    fn check(&self, v: &Value, schema: &Value, path: &mut Vec<String>, out: &mut Vec<Problem>) {
        let mut flat = Flat::default();
        self.flatten(schema, &mut flat, 0);
        let problem = |out: &mut Vec<Problem>, path: &[String], message: String| {
            out.push(Problem {
                path: render(path),
                message,
            });
        };
        for k in &flat.bad_keywords {
            problem(
                out,
                path,
                format!("schema keyword not understood by the validator: {k}"),
            );
        }
        if v.is_null() {
            problem(
                out,
                path,
                "null value: remove the field or give it a value".into(),
            );
            return;
        }
        let is_quantity = flat.names.contains(&QUANTITY);
        let int_or_string = flat.formats.contains("int-or-string");
        for t in &flat.types {
            let ok = match *t {
                "string" if is_quantity => match v {
                    Value::String(s) => {
                        if !is_quantity_str(s) {
                            problem(out, path, format!("{s:?} is not a quantity"));
                        }
                        true
                    }
                    Value::Number(_) => true,
                    _ => false,
                },
                "string" if int_or_string => v.is_string() || v.is_i64() || v.is_u64(),
                "string" => v.is_string(),
                "integer" => v.is_i64() || v.is_u64(),
                "number" => v.is_number(),
                "boolean" => v.is_boolean(),
                "object" => v.is_object(),
                "array" => v.is_array(),
                other => {
                    problem(out, path, format!("schema type not understood: {other}"));
                    true
                }
            };
            if !ok {
                problem(out, path, format!("expected {t}, found {}", type_name(v)));
                return;
            }
        }
        for f in &flat.formats {
            let range = match *f {
                "int32" => Some((i64::from(i32::MIN), i64::from(i32::MAX))),
                "int64" => Some((i64::MIN, i64::MAX)),
                _ => None,
            };
            if let (Some((lo, hi)), Some(n)) = (range, v.as_number())
                && !n.as_i64().is_some_and(|n| (lo..=hi).contains(&n))
            {
                problem(out, path, format!("{n} is out of the {f} range"));
            }
            if *f == "int-or-string"
                && let Some(n) = v.as_i64()
                && i32::try_from(n).is_err()
            {
                problem(out, path, format!("{n} is out of the int32 range"));
            }
        }
        for e in &flat.enums {
            if !e.contains(v) {
                problem(
                    out,
                    path,
                    format!("{v} is not one of {}", Value::Array(e.to_vec())),
                );
            }
        }
        match v {
            Value::Object(map) => self.check_object(map, &flat, path, out),
            Value::Array(items) => self.check_array(items, &flat, path, out),
            _ => {}
        }
    }

    fn check_object(
        &self,
        map: &Map<String, Value>,
        flat: &Flat<'_>,
        path: &mut Vec<String>,
        out: &mut Vec<Problem>,
    ) {
        for req in &flat.required {
            if !map.contains_key(*req) {
                out.push(Problem {
                    path: render(path),
                    message: format!("required field {req} is missing"),
                });
            }
        }
        for (k, val) in map {
            path.push(format!(".{k}"));
            if let Some(prop) = flat.properties.get(k.as_str()) {
                self.check(val, prop, path, out);
                for (schema, property, allowed) in EXTRA_ENUMS {
                    if *property == k && flat.names.contains(schema) {
                        check_extra_enum(val, allowed, path, out);
                    }
                }
            } else if let Some(add) = flat.additional {
                self.check(val, add, path, out);
            } else if flat.has_properties {
                let known: Vec<_> = flat.properties.keys().copied().collect();
                out.push(Problem {
                    path: render(path),
                    message: format!("unknown field {k:?} (known: {})", known.join(", ")),
                });
            }
            path.pop();
        }
    }

    fn check_array(
        &self,
        items: &[Value],
        flat: &Flat<'_>,
        path: &mut Vec<String>,
        out: &mut Vec<Problem>,
    ) {
        for (i, item) in items.iter().enumerate() {
            path.push(item_segment(item, i));
            for schema in &flat.items {
                self.check(item, schema, path, out);
            }
            path.pop();
        }
        let keys: Vec<&str> = if !flat.list_map_keys.is_empty() {
            flat.list_map_keys.clone()
        } else {
            flat.merge_key.into_iter().collect()
        };
        let defaults = if keys.is_empty() {
            Map::new()
        } else {
            self.item_defaults(flat)
        };
        let key_of = |item: &Value| -> Value {
            if flat.list_type == Some("set") || keys.is_empty() {
                return item.clone();
            }
            Value::Array(
                keys.iter()
                    .map(|k| {
                        item.get(*k)
                            .cloned()
                            .or_else(|| defaults.get(*k).cloned())
                            .unwrap_or(Value::Null)
                    })
                    .collect(),
            )
        };
        if flat.list_type == Some("set") || !keys.is_empty() {
            let mut seen = Vec::new();
            for item in items {
                let key = key_of(item);
                if seen.contains(&key) {
                    out.push(Problem {
                        path: render(path),
                        message: format!("duplicate item {key} (list keyed by {keys:?})"),
                    });
                }
                seen.push(key);
            }
        }
    }

    /// The defaults the item schema gives its properties (e.g. a port's protocol: TCP).
    fn item_defaults(&self, flat: &Flat<'_>) -> Map<String, Value> {
        let mut out = Map::new();
        for items in &flat.items {
            let mut f = Flat::default();
            self.flatten(items, &mut f, 0);
            for (k, p) in &f.properties {
                if let Some(d) = p.get("default") {
                    out.insert((*k).to_owned(), d.clone());
                }
            }
        }
        out
    }
}

fn check_extra_enum(val: &Value, allowed: &[&str], path: &[String], out: &mut Vec<Problem>) {
    let values: Vec<&Value> = match val {
        Value::Array(items) => items.iter().collect(),
        v => vec![v],
    };
    for v in values {
        if !v.as_str().is_some_and(|s| allowed.contains(&s)) {
            out.push(Problem {
                path: render(path),
                message: format!("{v} is not one of {allowed:?}"),
            });
        }
    }
}

fn item_segment(item: &Value, i: usize) -> String {
    match item.get("name").and_then(Value::as_str) {
        Some(name) => format!("[{name}]"),
        None => format!("[{i}]"),
    }
}

fn render(path: &[String]) -> String {
    path.concat().trim_start_matches('.').to_owned()
}

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(n) if n.is_f64() => "a fractional number",
        Value::Number(_) => "integer",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

/// The quantity grammar of `io.k8s.apimachinery.pkg.api.resource.Quantity`:
/// `[+-]? (digits | digits.digits? | .digits) (binarySI | decimalSI | [eE][+-]?digits)?`.
pub fn is_quantity_str(s: &str) -> bool {
    let body = s.strip_prefix(['+', '-']).unwrap_or(s);
    let end = body
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(body.len());
    let (number, suffix) = body.split_at(end);
    let number_ok = match number.split_once('.') {
        Some((a, b)) => {
            !b.contains('.')
                && (!a.is_empty() || !b.is_empty())
                && a.bytes().chain(b.bytes()).all(|c| c.is_ascii_digit())
        }
        None => !number.is_empty(),
    };
    let suffix_ok = match suffix {
        "" | "Ki" | "Mi" | "Gi" | "Ti" | "Pi" | "Ei" | "m" | "k" | "M" | "G" | "T" | "P" | "E" => {
            true
        }
        exp => exp
            .strip_prefix(['e', 'E'])
            .map(|e| e.strip_prefix(['+', '-']).unwrap_or(e))
            .is_some_and(|d| !d.is_empty() && d.bytes().all(|c| c.is_ascii_digit())),
    };
    number_ok && suffix_ok
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantities() {
        for ok in [
            "1", "10m", "1.5Gi", "64Mi", ".5", "1.", "+2k", "1e3", "1E-2", "0",
        ] {
            assert!(is_quantity_str(ok), "{ok}");
        }
        for bad in ["", "Mi", "1.2.3", "1mi", "1 Gi", "e3", "1e", "abc", "."] {
            assert!(!is_quantity_str(bad), "{bad}");
        }
    }

    #[test]
    fn gvk_of_objects() {
        let g = Gvk::of(&serde_json::json!({"apiVersion": "apps/v1", "kind": "DaemonSet"}));
        assert_eq!(g.unwrap().to_string(), "apps/v1/DaemonSet");
        let g = Gvk::of(&serde_json::json!({"apiVersion": "v1", "kind": "Namespace"})).unwrap();
        assert_eq!(
            (g.group.as_str(), g.to_string().as_str()),
            ("", "v1/Namespace")
        );
        assert!(Gvk::of(&serde_json::json!({"kind": "Namespace"})).is_none());
    }
}
