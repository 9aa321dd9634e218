//! deploy's own kustomize renderer held to `kubectl kustomize`: for the base and every overlay,
//! the same objects (compared as parsed objects: order and YAML formatting aside). Skipped,
//! saying so, when there is no kubectl: the own renderer is then what renders the manifests.

use moor_deploy::kubectl::{self, ENV};
use moor_deploy::{deploy_dir, kustomize};

#[test]
fn own_renderer_renders_what_kubectl_renders() {
    let Some(kubectl) = kubectl::find() else {
        eprintln!(
            "skipped: no kubectl with kustomize (on PATH, or named by {ENV}); the own \
             renderer is not compared"
        );
        return;
    };
    let mut dirs = vec![deploy_dir().join("base")];
    dirs.extend(moor_deploy::overlays().unwrap());
    let mut problems = Vec::new();
    for dir in &dirs {
        let theirs = kubectl::kustomize(&kubectl, dir).unwrap_or_else(|e| panic!("{e}"));
        let own = match kustomize::build(dir) {
            Ok(res) => res.into_iter().map(|r| r.doc).collect::<Vec<_>>(),
            Err(errors) => {
                problems.push(format!(
                    "{}: kubectl renders it, deploy's renderer refuses it:\n  {}",
                    dir.display(),
                    errors.join("\n  ")
                ));
                continue;
            }
        };
        assert!(
            !theirs.is_empty(),
            "{}: kubectl renders nothing",
            dir.display()
        );
        problems.extend(
            kubectl::differences(&own, &theirs)
                .into_iter()
                .map(|d| format!("{}: {d}", dir.display())),
        );
    }
    assert!(
        problems.is_empty(),
        "deploy/src/kustomize.rs renders differently from {kubectl} kustomize:\n{}",
        problems.join("\n")
    );
    eprintln!(
        "{} kustomizations render the same with {kubectl}",
        dirs.len()
    );
}
