//! The Kubernetes OpenAPI documents kept in `deploy/openapi/`: inside the repository, exactly
//! what trimming Kubernetes' documents to the manifests' kinds gives, and covering every kind
//! the manifests use.

use std::collections::BTreeSet;
use std::path::PathBuf;

use moor_deploy::deploy_dir;
use moor_deploy::openapi::{self, KINDS};
use moor_deploy::schema::Gvk;
use serde_json::{Value, json};

fn kept_files() -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(openapi::kept_dir())
        .expect("deploy/openapi")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    files.sort();
    files
}

fn read(path: &std::path::Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn temp_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("moor-deploy-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("temp dir");
    d
}

#[test]
fn the_schemas_are_read_from_the_repository() {
    let dir = moor_deploy::openapi_dir();
    assert!(
        dir.starts_with(moor_deploy::repo_root()),
        "{}",
        dir.display()
    );
    assert!(!kept_files().is_empty());
    let s = moor_deploy::load_schemas().unwrap_or_else(|e| panic!("{e}"));
    for (group, version, kind) in KINDS {
        let gvk = Gvk {
            group: (*group).to_owned(),
            version: (*version).to_owned(),
            kind: (*kind).to_owned(),
        };
        assert!(s.kind(&gvk).is_some(), "{gvk}");
    }
}

#[test]
fn each_kept_document_is_its_own_trim_byte_for_byte() {
    // Every $ref resolves inside its document, nothing beyond the kinds' closure is kept, and
    // the rendering is the trimming step's.
    for file in kept_files() {
        let text = read(&file);
        let doc: Value = serde_json::from_str(&text).expect("json");
        let again = openapi::trim(&doc, KINDS)
            .unwrap_or_else(|e| panic!("{}: {e}", file.display()))
            .unwrap_or_else(|| panic!("{}: holds none of the kinds", file.display()));
        assert!(
            openapi::render(&again) == text,
            "{} is not what trimming gives: run trim-openapi (deploy/openapi/README.md)",
            file.display()
        );
    }
}

#[test]
fn the_trimming_step_rewrites_the_kept_documents_unchanged() {
    let out = temp_dir("trim");
    std::fs::write(out.join("stale.json"), "{}").expect("stale file");
    let report = openapi::trim_dir(&openapi::kept_dir(), &out).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(report.len(), kept_files().len());
    assert!(report.iter().all(|t| t.before == t.after), "{report:?}");
    assert!(!out.join("stale.json").exists());
    for file in kept_files() {
        let name = file.file_name().expect("name");
        assert!(read(&out.join(name)) == read(&file), "{}", file.display());
    }
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn the_trimming_step_refuses_documents_missing_a_kind() {
    let from = temp_dir("trim-from");
    let out = temp_dir("trim-out");
    let only_core = openapi::kept_dir().join("api__v1_openapi.json");
    std::fs::copy(&only_core, from.join("api__v1_openapi.json")).expect("copy");
    let e = openapi::trim_dir(&from, &out).unwrap_err();
    assert!(e.contains("apps/v1/DaemonSet"), "{e}");
    assert!(
        std::fs::read_dir(&out).expect("out").next().is_none(),
        "nothing written on failure"
    );
    std::fs::write(
        from.join("bad.json"),
        json!({"openapi": "3.0.0"}).to_string(),
    )
    .expect("w");
    let e = openapi::trim_dir(&from, &out).unwrap_err();
    assert!(e.contains("bad.json"), "{e}");
    let _ = std::fs::remove_dir_all(&from);
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn the_kinds_kept_are_the_kinds_the_manifests_use() {
    let mut dirs = vec![deploy_dir().join("base")];
    dirs.extend(moor_deploy::overlays().expect("overlays"));
    let mut used = BTreeSet::new();
    for dir in dirs {
        let res = moor_deploy::kubectl::render(&dir)
            .unwrap_or_else(|e| panic!("{}: {}", dir.display(), e.join("\n")));
        for r in res {
            let gvk = Gvk::of(&r.doc).unwrap_or_else(|| panic!("{}", r.id()));
            // The snapshot classes are custom resources, with hand-written schemas.
            if !matches!(
                gvk.group.as_str(),
                "snapshot.storage.k8s.io" | "groupsnapshot.storage.k8s.io"
            ) {
                used.insert((gvk.group, gvk.version, gvk.kind));
            }
        }
    }
    let kept: BTreeSet<(String, String, String)> = KINDS
        .iter()
        .map(|(g, v, k)| ((*g).to_owned(), (*v).to_owned(), (*k).to_owned()))
        .collect();
    assert_eq!(
        used, kept,
        "openapi::KINDS must list exactly the kinds of deploy/ (then run trim-openapi)"
    );
}
