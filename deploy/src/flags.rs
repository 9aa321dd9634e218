//! The command-line flags of moor's binaries, read from their clap-derive sources, and a check
//! of the arguments a manifest passes against them.
//!
//! The parser reads the `#[derive(Parser)]` struct of a `main.rs`: each field with
//! `#[arg(long ...)]` is a flag named by `long = "..."` or by the field name in kebab case. A
//! `bool` field (or `action = ArgAction::SetTrue/SetFalse/Count`) is a switch; anything else
//! takes a value. A field is required when it is not `bool`, `Option<_>` or `Vec<_>` and has no
//! default (clap's `env = "..."` then satisfies it too). Values of an unsigned integer type or
//! of a `ValueEnum` defined in the same file are checked. What the parser cannot read
//! (`#[command(flatten)]`, subcommands, positional arguments) is an error, never skipped.

use std::collections::BTreeMap;

/// Whether a flag takes a value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arity {
    /// `--flag`.
    Switch,
    /// `--flag=value` or `--flag value`.
    Value,
}

/// What a flag's value must look like.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ValueKind {
    /// Anything (strings, paths, types the parser does not know).
    Any,
    /// A non-negative integer.
    Unsigned,
    /// An integer.
    Signed,
    /// One of these names (a clap `ValueEnum`).
    OneOf(Vec<String>),
}

/// One flag of a binary.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Flag {
    /// The long name, without `--`.
    pub name: String,
    /// Switch or value.
    pub arity: Arity,
    /// What the value must look like.
    pub kind: ValueKind,
    /// Required (no default; not `Option`, `Vec` or `bool`).
    pub required: bool,
    /// The environment variable clap reads it from, if any.
    pub env: Option<String>,
    /// The default value, as written in the source (for `default_value = "..."` and
    /// `default_value_t = literal`).
    pub default: Option<String>,
    /// May be given more than once (`Vec<_>`, `ArgAction::Append`/`Count`).
    pub repeatable: bool,
    /// Not in the binary yet: allowed by [`COMING_FLAGS`].
    pub coming: bool,
}

/// A binary's command line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cli {
    /// The binary's name.
    pub binary: String,
    /// Flags by long name.
    pub flags: BTreeMap<String, Flag>,
}

/// A flag a manifest may use before its binary has it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ComingFlag {
    /// `moor-node` or `moor-controller`.
    pub binary: &'static str,
    /// Long name, without `--`.
    pub name: &'static str,
    /// Switch or value.
    pub arity: Arity,
}

/// COMING FLAGS: flags the manifests may pass although the binaries do not parse them yet.
///
/// Remove an entry once its flag is in the binary's `Args` (the source then wins, and the
/// tests print a note that the entry is stale). Only the optional overlays may use a flag that
/// is still coming: the default overlay (`overlays/registrar`) must run with today's binaries,
/// and a test enforces it.
pub const COMING_FLAGS: &[ComingFlag] = &[];

impl Cli {
    /// Adds the [`COMING_FLAGS`] of this binary that its source does not define yet.
    ///
    /// Returns the notes about stale entries (the flag is in the source now) and the errors
    /// (the source defines it with another arity than the manifests expect).
    pub fn with_coming(mut self, coming: &[ComingFlag]) -> (Self, Vec<String>, Vec<String>) {
        let (mut notes, mut errors) = (Vec::new(), Vec::new());
        for c in coming.iter().filter(|c| c.binary == self.binary) {
            match self.flags.get(c.name) {
                Some(f) if f.arity == c.arity => notes.push(format!(
                    "{} --{} has landed: remove it from COMING_FLAGS in deploy/src/flags.rs",
                    c.binary, c.name
                )),
                Some(_) => errors.push(format!(
                    "{} --{} landed as a {:?}, but COMING_FLAGS (and so the manifests) expect \
                     a {:?}",
                    c.binary, c.name, self.flags[c.name].arity, c.arity
                )),
                None => {
                    self.flags.insert(
                        c.name.to_owned(),
                        Flag {
                            name: c.name.to_owned(),
                            arity: c.arity,
                            kind: ValueKind::Any,
                            required: false,
                            env: None,
                            default: None,
                            repeatable: false,
                            coming: true,
                        },
                    );
                }
            }
        }
        (self, notes, errors)
    }

    /// Checks a container's `args` against this command line. `env` lists the environment
    /// variables the container defines (they satisfy required flags clap reads from `env`).
    pub fn check_args(&self, args: &[String], env: &[&str]) -> Vec<String> {
        let mut problems = Vec::new();
        let mut seen: BTreeMap<&str, usize> = BTreeMap::new();
        let mut i = 0;
        while i < args.len() {
            let arg = &args[i];
            i += 1;
            let Some(long) = arg.strip_prefix("--") else {
                problems.push(format!(
                    "{}: argument {arg:?} is not a long flag (--name or --name=value)",
                    self.binary
                ));
                continue;
            };
            let (name, inline) = match long.split_once('=') {
                Some((n, v)) => (n, Some(v.to_owned())),
                None => (long, None),
            };
            let Some(flag) = self.flags.get(name) else {
                let known: Vec<_> = self.flags.keys().map(|k| format!("--{k}")).collect();
                problems.push(format!(
                    "{} has no flag --{name} (it has: {})",
                    self.binary,
                    known.join(" ")
                ));
                continue;
            };
            *seen.entry(&flag.name).or_default() += 1;
            match flag.arity {
                Arity::Switch => {
                    if let Some(v) = inline {
                        problems.push(format!(
                            "{}: --{name} is a switch and takes no value (found {v:?})",
                            self.binary
                        ));
                    }
                }
                Arity::Value => {
                    let value = match inline {
                        Some(v) => v,
                        None if i < args.len() && !args[i].starts_with("--") => {
                            i += 1;
                            args[i - 1].clone()
                        }
                        None => {
                            problems.push(format!("{}: --{name} needs a value", self.binary));
                            continue;
                        }
                    };
                    if let Some(p) = check_value(&value, &flag.kind) {
                        problems.push(format!("{}: --{name}={value}: {p}", self.binary));
                    }
                }
            }
        }
        for (name, count) in &seen {
            if *count > 1 && !self.flags[*name].repeatable {
                problems.push(format!("{}: --{name} is given {count} times", self.binary));
            }
        }
        for f in self
            .flags
            .iter()
            .filter(|(k, f)| f.required && **k == f.name)
            .map(|(_, f)| f)
        {
            let from_env = f.env.as_deref().is_some_and(|e| env.contains(&e));
            if !seen.contains_key(f.name.as_str()) && !from_env {
                problems.push(format!(
                    "{}: required flag --{} is missing",
                    self.binary, f.name
                ));
            }
        }
        problems
    }
}

fn check_value(value: &str, kind: &ValueKind) -> Option<String> {
    if value.contains("$(") {
        // Expanded by the kubelet from the container's environment: checked elsewhere.
        return None;
    }
    match kind {
        ValueKind::Any => None,
        ValueKind::Unsigned => value
            .parse::<u64>()
            .is_err()
            .then(|| "not a non-negative integer".to_owned()),
        ValueKind::Signed => value
            .parse::<i64>()
            .is_err()
            .then(|| "not an integer".to_owned()),
        ValueKind::OneOf(names) => {
            (!names.iter().any(|n| n == value)).then(|| format!("not one of {}", names.join(", ")))
        }
    }
}

/// Reads the command line of `binary` from the source of its `main.rs`.
///
/// # Errors
/// When there is no `#[derive(Parser)]` struct, or it uses what this parser cannot read.
pub fn parse_clap_source(binary: &str, src: &str) -> Result<Cli, String> {
    let clean = strip_comments(src);
    let enums = value_enums(&clean);
    let body = find_item(&clean, "struct", "Parser")
        .ok_or_else(|| format!("{binary}: no #[derive(Parser)] struct"))?;
    let mut flags = BTreeMap::new();
    for field in split_top(&body, ',') {
        let field = field.trim();
        if field.is_empty() {
            continue;
        }
        let (attrs, rest) = take_attributes(field);
        let decl = rest.trim();
        let decl = decl
            .strip_prefix("pub(crate)")
            .or_else(|| decl.strip_prefix("pub "))
            .unwrap_or(decl);
        let Some((ident, ty)) = decl.split_once(':') else {
            return Err(format!("{binary}: cannot read field {field:?}"));
        };
        let (ident, ty) = (ident.trim(), ty.split_whitespace().collect::<String>());
        let mut arg = None;
        for a in &attrs {
            let (path, inner) = a.split_once('(').unwrap_or((a.as_str(), ")"));
            let inner = inner.strip_suffix(')').unwrap_or(inner);
            match path.trim() {
                "arg" | "clap" => {
                    let items = split_top(inner, ',');
                    if items
                        .iter()
                        .any(|i| i.trim() == "flatten" || i.trim() == "subcommand")
                    {
                        return Err(format!(
                            "{binary}: field {ident}: flatten/subcommand is not \
                                            supported by deploy's flag reader"
                        ));
                    }
                    arg = Some(items);
                }
                "command" => {
                    return Err(format!(
                        "{binary}: field {ident}: #[command({inner})] is not \
                                        supported by deploy's flag reader"
                    ));
                }
                _ => {}
            }
        }
        let Some(items) = arg else {
            return Err(format!(
                "{binary}: field {ident} is positional (no #[arg(long)])"
            ));
        };
        let mut opts: BTreeMap<String, String> = BTreeMap::new();
        let mut aliases = Vec::new();
        for item in &items {
            let item = item.trim();
            let (k, v) = match item.split_once('=') {
                Some((k, v)) => (k.trim(), v.trim().to_owned()),
                None => (item, String::new()),
            };
            if matches!(k, "alias" | "visible_alias") {
                aliases.push(unquote(&v));
            } else if matches!(k, "aliases" | "visible_aliases") {
                aliases.extend(
                    split_top(v.trim_start_matches('[').trim_end_matches(']'), ',')
                        .iter()
                        .map(|a| unquote(a.trim())),
                );
            }
            opts.insert(k.to_owned(), v);
        }
        let Some(long) = opts.get("long") else {
            return Err(format!("{binary}: field {ident} has no long flag"));
        };
        let name = if long.is_empty() {
            ident.replace('_', "-")
        } else {
            unquote(long)
        };
        let action = opts
            .get("action")
            .map(|a| a.rsplit("::").next().unwrap_or(a).to_owned());
        let (outer, inner_ty) = wrapper(&ty);
        let arity = match action.as_deref() {
            Some("SetTrue" | "SetFalse" | "Count" | "Help" | "Version") => Arity::Switch,
            Some(_) => Arity::Value,
            None if ty == "bool" => Arity::Switch,
            None => Arity::Value,
        };
        let has_default = [
            "default_value",
            "default_value_t",
            "default_values_t",
            "default_values",
        ]
        .iter()
        .any(|k| opts.contains_key(*k));
        let required = match opts.get("required").map(String::as_str) {
            Some("" | "true") => true,
            Some(_) => false,
            None => arity == Arity::Value && outer.is_none() && !has_default,
        };
        // A value enum may be named by a path (`daemon::LogFormat`): its last segment.
        let type_name = inner_ty.rsplit("::").next().unwrap_or(&inner_ty);
        let kind = match type_name {
            "u8" | "u16" | "u32" | "u64" | "u128" | "usize" => ValueKind::Unsigned,
            "i8" | "i16" | "i32" | "i64" | "i128" | "isize" => ValueKind::Signed,
            t if enums.contains_key(t) && !opts.contains_key("value_parser") => {
                ValueKind::OneOf(enums[t].clone())
            }
            _ => ValueKind::Any,
        };
        let default = opts
            .get("default_value")
            .map(|v| unquote(v))
            .or_else(|| opts.get("default_value_t").map(|v| unquote(v)));
        let flag = Flag {
            name: name.clone(),
            arity,
            kind,
            required,
            env: opts.get("env").map(|v| unquote(v)),
            default,
            repeatable: outer == Some("Vec")
                || matches!(action.as_deref(), Some("Append" | "Count")),
            coming: false,
        };
        for n in std::iter::once(name).chain(aliases) {
            if flags.insert(n.clone(), flag.clone()).is_some() {
                return Err(format!("{binary}: flag --{n} is defined twice"));
            }
        }
    }
    Ok(Cli {
        binary: binary.to_owned(),
        flags,
    })
}

/// `Option<T>` → `(Some("Option"), "T")`; `T` → `(None, "T")`.
fn wrapper(ty: &str) -> (Option<&'static str>, String) {
    for w in ["Option", "Vec"] {
        if let Some(inner) = ty
            .strip_prefix(w)
            .and_then(|t| t.strip_prefix('<'))
            .and_then(|t| t.strip_suffix('>'))
        {
            return (Some(w), inner.to_owned());
        }
    }
    (None, ty.to_owned())
}

fn unquote(s: &str) -> String {
    let s = s.trim();
    s.strip_prefix('"')
        .and_then(|s| s.strip_suffix('"'))
        .unwrap_or(s)
        .to_owned()
}

/// Removes `//` and `/* */` comments, keeping string and char literals intact.
fn strip_comments(src: &str) -> String {
    let b: Vec<char> = src.chars().collect();
    let mut out = String::with_capacity(src.len());
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        if c == '"' {
            let start = i;
            i += 1;
            while i < b.len() && b[i] != '"' {
                i += if b[i] == '\\' { 2 } else { 1 };
            }
            i += 1;
            out.extend(&b[start..i.min(b.len())]);
        } else if c == '\'' && i + 2 < b.len() && (b[i + 2] == '\'' || b[i + 1] == '\\') {
            // A char literal ('x' or '\n'), not a lifetime.
            let start = i;
            i += 2;
            while i < b.len() && b[i] != '\'' {
                i += 1;
            }
            i += 1;
            out.extend(&b[start..i.min(b.len())]);
        } else if c == '/' && b.get(i + 1) == Some(&'/') {
            while i < b.len() && b[i] != '\n' {
                i += 1;
            }
        } else if c == '/' && b.get(i + 1) == Some(&'*') {
            i += 2;
            while i + 1 < b.len() && !(b[i] == '*' && b[i + 1] == '/') {
                i += 1;
            }
            i += 2;
        } else {
            out.push(c);
            i += 1;
        }
    }
    out
}

/// Splits at `sep` outside brackets, braces, parentheses, angle brackets and strings.
fn split_top(s: &str, sep: char) -> Vec<String> {
    let mut parts = Vec::new();
    let mut cur = String::new();
    let (mut depth, mut angle, mut in_str) = (0i32, 0i32, false);
    let mut prev = '\0';
    for c in s.chars() {
        if in_str {
            cur.push(c);
            if c == '"' && prev != '\\' {
                in_str = false;
            }
            prev = if prev == '\\' && c == '\\' { '\0' } else { c };
            continue;
        }
        match c {
            '"' => in_str = true,
            '(' | '[' | '{' => depth += 1,
            ')' | ']' | '}' => depth -= 1,
            '<' if depth == 0 => angle += 1,
            '>' if depth == 0 && prev != '-' && prev != '=' => angle -= 1,
            _ => {}
        }
        if c == sep && depth == 0 && angle == 0 {
            parts.push(std::mem::take(&mut cur));
        } else {
            cur.push(c);
        }
        prev = c;
    }
    parts.push(cur);
    parts
}

/// Leading `#[...]` attributes of an item (their inner text) and the rest.
fn take_attributes(s: &str) -> (Vec<String>, &str) {
    let mut attrs = Vec::new();
    let mut rest = s.trim_start();
    while let Some(after) = rest.strip_prefix("#[") {
        let mut depth = 1;
        let mut in_str = false;
        let mut end = None;
        let mut prev = '\0';
        for (i, c) in after.char_indices() {
            if in_str {
                if c == '"' && prev != '\\' {
                    in_str = false;
                }
            } else {
                match c {
                    '"' => in_str = true,
                    '[' => depth += 1,
                    ']' => {
                        depth -= 1;
                        if depth == 0 {
                            end = Some(i);
                            break;
                        }
                    }
                    _ => {}
                }
            }
            prev = c;
        }
        let Some(end) = end else { break };
        attrs.push(after[..end].trim().to_owned());
        rest = after[end + 1..].trim_start();
    }
    (attrs, rest)
}

/// The body (between the braces) of the first `keyword` item whose derive names `derive`.
fn find_item(src: &str, keyword: &str, derive: &str) -> Option<String> {
    items(src, keyword)
        .into_iter()
        .find(|(derives, _, _)| derives.iter().any(|d| d == derive))
        .map(|(_, _, body)| body)
}

/// Every `keyword` item (struct or enum) with braces: (derives, name, body).
fn items(src: &str, keyword: &str) -> Vec<(Vec<String>, String, String)> {
    let mut out = Vec::new();
    let needle = format!("{keyword} ");
    let mut search = 0;
    while let Some(pos) = src[search..].find(&needle).map(|p| p + search) {
        search = pos + needle.len();
        let before = &src[..pos];
        if before
            .chars()
            .next_back()
            .is_some_and(|c| c.is_alphanumeric() || c == '_')
        {
            continue;
        }
        let after = &src[search..];
        let name: String = after
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        let Some(open) = after.find(['{', ';', '(']) else {
            continue;
        };
        if !after[open..].starts_with('{') {
            continue;
        }
        let body_start = search + open + 1;
        let mut depth = 1;
        let mut end = None;
        for (i, c) in src[body_start..].char_indices() {
            match c {
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        end = Some(body_start + i);
                        break;
                    }
                }
                _ => {}
            }
        }
        let Some(end) = end else { continue };
        // The attributes just before the item (after the previous item's end).
        let start_of_attrs = before.rfind(['}', ';']).map_or(0, |p| p + 1);
        let header = &src[start_of_attrs..pos];
        let derives = header
            .split("derive(")
            .skip(1)
            .flat_map(|d| {
                let d = d.split(')').next().unwrap_or("");
                d.split(',')
                    .map(|x| x.trim().rsplit("::").next().unwrap_or("").to_owned())
                    .collect::<Vec<_>>()
            })
            .collect();
        out.push((derives, name, src[body_start..end].to_owned()));
    }
    out
}

/// Every `#[derive(ValueEnum)]` enum: name → the value names clap accepts.
fn value_enums(src: &str) -> BTreeMap<String, Vec<String>> {
    let mut out = BTreeMap::new();
    for (derives, name, body) in items(src, "enum") {
        if !derives.iter().any(|d| d == "ValueEnum") {
            continue;
        }
        let mut names = Vec::new();
        for variant in split_top(&body, ',') {
            let (attrs, rest) = take_attributes(variant.trim());
            let ident = rest.trim();
            if ident.is_empty() {
                continue;
            }
            let mut value_name = kebab(ident);
            let mut skip = false;
            for a in attrs {
                if let Some(inner) = a.strip_prefix("value(").and_then(|a| a.strip_suffix(')')) {
                    for item in split_top(inner, ',') {
                        match item.split_once('=') {
                            Some((k, v)) if k.trim() == "name" => value_name = unquote(v),
                            None if item.trim() == "skip" => skip = true,
                            _ => {}
                        }
                    }
                }
            }
            if !skip {
                names.push(value_name);
            }
        }
        out.insert(name, names);
    }
    out
}

/// `FooBar` → `foo-bar` (clap's default for `ValueEnum` variants).
fn kebab(ident: &str) -> String {
    let mut out = String::new();
    let chars: Vec<char> = ident.chars().collect();
    for (i, c) in chars.iter().enumerate() {
        let next_lower = chars.get(i + 1).is_some_and(|n| n.is_lowercase());
        let prev_lower = i > 0 && chars[i - 1].is_lowercase();
        if c.is_uppercase() && i > 0 && (prev_lower || next_lower) {
            out.push('-');
        }
        out.extend(c.to_lowercase());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const SRC: &str = r#"
use clap::{Parser, ValueEnum};
/// Not { a struct.
#[derive(Debug, Clone, Copy, ValueEnum)]
enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
    #[value(name = "logfmt")]
    KeyValue,
    #[value(skip)]
    Hidden,
}
#[derive(Debug, Parser)]
#[command(name = "x", version)]
struct Args {
    /// gRPC endpoint, e.g. "unix:///csi/csi.sock" // not a comment.
    #[arg(long, default_value = "unix:///csi/csi.sock", env = "CSI_ENDPOINT")]
    endpoint: String,
    #[arg(long, env = "NODE_ID")]
    node_id: String,
    #[arg(long = "max", default_value_t = 0)]
    max_volumes: u64,
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    /* a block comment, with a , comma */
    #[arg(long)]
    journal_fsync: bool,
    #[arg(long, alias = "old-dir")]
    dir: Option<std::path::PathBuf>,
    #[arg(long, action = clap::ArgAction::Append)]
    label: Vec<String>,
    #[arg(long)]
    required_one: std::collections::HashMap<String, u32>,
}
"#;

    fn cli() -> Cli {
        parse_clap_source("x", SRC).unwrap()
    }

    #[test]
    fn reads_flags() {
        let cli = cli();
        let names: Vec<_> = cli.flags.keys().map(String::as_str).collect();
        assert_eq!(
            names,
            [
                "dir",
                "endpoint",
                "journal-fsync",
                "label",
                "log-format",
                "max",
                "node-id",
                "old-dir",
                "required-one"
            ]
        );
        let f = &cli.flags;
        assert_eq!(f["journal-fsync"].arity, Arity::Switch);
        assert!(f["node-id"].required && !f["endpoint"].required && !f["dir"].required);
        assert!(f["required-one"].required && !f["label"].required && f["label"].repeatable);
        assert_eq!(f["node-id"].env.as_deref(), Some("NODE_ID"));
        assert_eq!(
            f["endpoint"].default.as_deref(),
            Some("unix:///csi/csi.sock")
        );
        assert_eq!(f["max"].kind, ValueKind::Unsigned);
        assert_eq!(
            f["log-format"].kind,
            ValueKind::OneOf(vec!["text".into(), "json".into(), "logfmt".into()])
        );
    }

    #[test]
    fn checks_args() {
        let cli = cli();
        let args = |a: &[&str]| a.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
        let ok = args(&[
            "--node-id=$(NODE_ID)",
            "--max",
            "3",
            "--journal-fsync",
            "--log-format=json",
            "--label=a",
            "--label=b",
            "--required-one=x",
        ]);
        assert_eq!(cli.check_args(&ok, &[]), Vec::<String>::new());
        let bad = args(&[
            "--nope",
            "--journal-fsync=true",
            "--max=-1",
            "--log-format=xml",
            "--dir=/a",
            "--old-dir=/b",
            "positional",
            "--required-one",
        ]);
        let p = cli.check_args(&bad, &[]).join("\n");
        for want in [
            "has no flag --nope",
            "--journal-fsync is a switch",
            "--max=-1: not a non-negative integer",
            "--log-format=xml: not one of text, json, logfmt",
            "--dir is given 2 times",
            "\"positional\" is not a long flag",
            "--required-one needs a value",
            "required flag --node-id is missing",
        ] {
            assert!(p.contains(want), "{want} not in:\n{p}");
        }
        // clap reads NODE_ID from the environment: the env var satisfies the required flag.
        let p = cli.check_args(&args(&["--required-one=x"]), &["NODE_ID"]);
        assert_eq!(p, Vec::<String>::new());
    }

    #[test]
    fn coming_flags_merge() {
        let coming = [
            ComingFlag {
                binary: "x",
                name: "later",
                arity: Arity::Value,
            },
            ComingFlag {
                binary: "x",
                name: "max",
                arity: Arity::Value,
            },
            ComingFlag {
                binary: "x",
                name: "journal-fsync",
                arity: Arity::Value,
            },
            ComingFlag {
                binary: "other",
                name: "elsewhere",
                arity: Arity::Switch,
            },
        ];
        let (cli, notes, errors) = cli().with_coming(&coming);
        assert!(cli.flags["later"].coming && !cli.flags.contains_key("elsewhere"));
        assert_eq!(notes.len(), 1, "{notes:?}");
        assert!(notes[0].contains("--max has landed"));
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert!(errors[0].contains("--journal-fsync landed as a Switch"));
    }

    #[test]
    fn unreadable_sources_are_errors() {
        let flatten = "#[derive(Parser)] struct A { #[command(flatten)] common: Common, }";
        assert!(parse_clap_source("a", flatten).is_err());
        let flatten = "#[derive(Parser)] struct A { #[arg(flatten)] common: Common, }";
        assert!(parse_clap_source("a", flatten).is_err());
        let positional = "#[derive(Parser)] struct A { path: String, }";
        assert!(parse_clap_source("a", positional).is_err());
        assert!(parse_clap_source("a", "struct A { x: u8 }").is_err());
        assert_eq!(kebab("FooBar"), "foo-bar");
        assert_eq!(kebab("JSONFormat"), "json-format");
    }
}
