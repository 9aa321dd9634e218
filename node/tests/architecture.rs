//! The import rules of docs/architecture.md, checked against the tree.
//!
//! The rules are read from the document itself, so the page and the code cannot drift apart:
//! - the crate graph ("Who may use whom"): every workspace member's moor dependencies, normal
//!   and dev, are exactly the ones its line names;
//! - the node's module rules ("Inside the node"): a directory of `node/src/` that "never uses"
//!   a module names none of them, one that "uses only" some names no other;
//! - `unsafe` code only in `sys` modules.
//!
//! It lives in the node's crate because most of the rules are the node's; it reads the whole
//! workspace.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the node crate is a directory of the workspace")
        .to_path_buf()
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}

/// The fenced block that follows the heading `heading` in docs/architecture.md.
fn doc_block(heading: &str) -> Vec<String> {
    let doc = read(&repo().join("docs/architecture.md"));
    let after = doc
        .split_once(&format!("\n{heading}\n"))
        .unwrap_or_else(|| panic!("docs/architecture.md has no heading {heading:?}"))
        .1;
    let body = after
        .split_once("```\n")
        .unwrap_or_else(|| panic!("no fenced block after {heading:?}"))
        .1;
    let block = body.split_once("```").expect("an unterminated block").0;
    block
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .map(str::to_owned)
        .collect()
}

/// The names listed after `sep` on `line`, up to a parenthesised remark.
fn names_after(line: &str, sep: &str) -> Option<BTreeSet<String>> {
    let (_, rest) = line.split_once(sep)?;
    let rest = rest.split('(').next().unwrap_or("");
    Some(
        rest.split(',')
            .map(|n| n.trim().trim_matches('`').to_owned())
            .filter(|n| !n.is_empty())
            .collect(),
    )
}

fn workspace_members() -> Vec<String> {
    let manifest = read(&repo().join("Cargo.toml"));
    let list = manifest
        .split_once("members = [")
        .and_then(|(_, m)| m.split_once(']'))
        .expect("the workspace's members")
        .0;
    list.split(',')
        .map(|m| m.trim().trim_matches('"').to_owned())
        .filter(|m| !m.is_empty())
        .collect()
}

/// A manifest's package name and the moor crates it depends on (normal and dev).
fn moor_dependencies(dir: &str) -> (String, BTreeSet<String>) {
    let manifest = read(&repo().join(dir).join("Cargo.toml"));
    let mut name = None;
    let mut deps = BTreeSet::new();
    let mut section = String::new();
    for line in manifest.lines().map(str::trim) {
        if line.starts_with('[') {
            section = line.to_owned();
            continue;
        }
        if section == "[package]"
            && let Some(v) = line.strip_prefix("name = ")
        {
            name = Some(v.trim_matches('"').to_owned());
        }
        if (section == "[dependencies]" || section == "[dev-dependencies]")
            && line.starts_with("moor-")
        {
            let dep = line.split(['.', ' ', '=']).next().unwrap_or(line);
            deps.insert(dep.to_owned());
        }
    }
    (name.expect("a package name"), deps)
}

#[test]
fn crates_use_only_what_the_graph_allows() {
    let mut allowed: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for line in doc_block("## Who may use whom") {
        let name = line.split_whitespace().next().unwrap_or("").to_owned();
        let deps = names_after(&line, "──>").unwrap_or_default();
        assert!(
            allowed.insert(name.clone(), deps).is_none(),
            "{name} has two lines in the graph"
        );
    }
    let mut seen = BTreeSet::new();
    for dir in workspace_members() {
        let (name, deps) = moor_dependencies(&dir);
        let Some(want) = allowed.get(&name) else {
            panic!("crate {name} ({dir}/) is not in docs/architecture.md's graph");
        };
        assert_eq!(
            &deps, want,
            "{name} ({dir}/Cargo.toml) depends on other moor crates than the graph in \
             docs/architecture.md allows"
        );
        seen.insert(name);
    }
    let unknown: Vec<_> = allowed.keys().filter(|c| !seen.contains(*c)).collect();
    assert!(
        unknown.is_empty(),
        "the graph names crates the workspace does not have: {unknown:?}"
    );
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            if p.file_name().is_some_and(|n| n == "target") {
                continue;
            }
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The node's top-level modules (`node/src/lib.rs`).
fn node_modules() -> BTreeSet<String> {
    read(&repo().join("node/src/lib.rs"))
        .lines()
        .filter_map(|l| {
            let l = l.trim().strip_prefix("pub ").unwrap_or(l.trim());
            l.strip_prefix("mod ")?.strip_suffix(';').map(str::to_owned)
        })
        .collect()
}

/// The node's top-level modules a source file names through `crate::`.
fn crate_modules_named(source: &str, modules: &BTreeSet<String>) -> BTreeSet<String> {
    let mut named = BTreeSet::new();
    for line in source.lines() {
        let code = line.split("//").next().unwrap_or("");
        let mut rest = code;
        while let Some(i) = rest.find("crate::") {
            rest = &rest[i + "crate::".len()..];
            // `crate::a`, or each item of `crate::{a, b::c}` (nested names are not
            // modules of the crate root, and only those count).
            let list = rest
                .strip_prefix('{')
                .map_or(rest, |r| r.split('}').next().unwrap_or(r));
            for item in list.split(',') {
                let word: String = item
                    .trim()
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_')
                    .collect();
                if modules.contains(&word) {
                    named.insert(word);
                }
                if !rest.starts_with('{') {
                    break;
                }
            }
        }
    }
    named
}

#[test]
fn node_modules_keep_their_rules() {
    let modules = node_modules();
    let src = repo().join("node/src");
    let rules = doc_block("### Inside the node");
    assert!(!rules.is_empty());
    for line in rules {
        let dir = line
            .split_whitespace()
            .next()
            .unwrap_or("")
            .trim_end_matches('/');
        let module = dir.trim_end_matches(".rs");
        assert!(
            modules.contains(module),
            "rule for unknown module {dir}: {line}"
        );
        let (only, never) = (
            names_after(&line, "uses only:"),
            names_after(&line, "never uses:"),
        );
        let path = src.join(dir);
        let mut files = Vec::new();
        if path.is_dir() {
            rust_files(&path, &mut files);
        } else {
            files.push(src.join(format!("{module}.rs")));
        }
        assert!(!files.is_empty(), "no files for {dir}");
        for f in files {
            let named = crate_modules_named(&read(&f), &modules);
            let bad: Vec<&String> = named
                .iter()
                .filter(|m| m.as_str() != module)
                .filter(|m| match (&only, &never) {
                    (Some(only), _) => !only.contains(*m),
                    (None, Some(never)) => never.contains(*m),
                    (None, None) => {
                        panic!("a rule says neither 'uses only:' nor 'never uses:': {line}")
                    }
                })
                .collect();
            assert!(
                bad.is_empty(),
                "{} uses {bad:?}, which docs/architecture.md's rule forbids: {line}",
                f.strip_prefix(repo()).unwrap_or(&f).display()
            );
        }
    }
}

#[test]
fn unsafe_code_lives_only_in_sys_modules() {
    let mut files = Vec::new();
    for dir in workspace_members().iter().chain(["fuzz".to_owned()].iter()) {
        rust_files(&repo().join(dir), &mut files);
    }
    assert!(files.len() > 50, "found only {} source files", files.len());
    let mut bad = Vec::new();
    for f in &files {
        let rel = f.strip_prefix(repo()).unwrap_or(f);
        let in_sys = rel.components().any(|c| c.as_os_str() == "sys")
            || rel.file_name().is_some_and(|n| n == "sys.rs");
        if in_sys {
            continue;
        }
        for (n, line) in read(f).lines().enumerate() {
            let code = line.split("//").next().unwrap_or("");
            // The needles are made here, so that this line is not one of them.
            if ["{", "fn", "impl", "extern"]
                .iter()
                .any(|w| code.contains(&format!("{} {w}", "unsafe")))
            {
                bad.push(format!("{}:{}", rel.display(), n + 1));
            }
        }
    }
    assert!(bad.is_empty(), "unsafe code outside a sys module: {bad:?}");
}

/// The checks above catch what they are meant to: a forbidden import in a sample source.
#[test]
fn the_scanner_sees_grouped_and_plain_imports() {
    let modules: BTreeSet<String> = ["validate", "metrics", "sys", "journal"]
        .into_iter()
        .map(str::to_owned)
        .collect();
    let src = "use crate::validate::Stage;\nuse crate::{journal::X, sys};\n// crate::metrics\n\
               let x = crate::metrics::registry();";
    let named = crate_modules_named(src, &modules);
    let want: BTreeSet<String> = ["validate", "journal", "sys", "metrics"]
        .into_iter()
        .map(str::to_owned)
        .collect();
    assert_eq!(named, want);
}
