//! deploy's own renderer refuses the kustomize features it does not implement.

use super::*;

#[test]
fn kustomizations_use_only_the_implemented_features() {
    let dir = std::env::temp_dir().join(format!("moor-deploy-k-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let write = |k: &str| std::fs::write(dir.join("kustomization.yaml"), k).unwrap();
    let head = "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n";
    let base = deploy_dir().join("base");
    let base = base.to_str().unwrap();
    let cases = [
        (
            format!("{head}namePrefix: x-\n"),
            "field \"namePrefix\" is not implemented",
        ),
        (
            format!("{head}resources: [https://x/y]\n"),
            "only relative local paths",
        ),
        (
            format!("{head}resources: [missing.yaml]\n"),
            "missing.yaml: No such file",
        ),
        (
            format!("{head}resources: [{base}]\n"),
            "only relative local paths",
        ),
    ];
    for (k, want) in &cases {
        write(k);
        let e = kustomize::build(&dir).unwrap_err().join("\n");
        assert!(e.contains(want), "{want:?} not in:\n{e}");
    }
    // Patches: strategic merge refused, a target matching nothing refused, a failing test op.
    let rel = pathdiff(&dir, Path::new(base));
    for (patch, want) in [
        (
            "patch: |-\n      spec: {}",
            "strategic-merge patches are not implemented",
        ),
        (
            "patch: |-\n      - {op: test, path: /spec/replicas, value: 2}",
            "test failed: found 1",
        ),
    ] {
        write(&format!(
            "{head}resources: [{rel}]\npatches:\n  - target: {{kind: Deployment}}\n    {patch}\n"
        ));
        let e = kustomize::build(&dir).unwrap_err().join("\n");
        assert!(e.contains(want), "{want:?} not in:\n{e}");
    }
    write(&format!(
        "{head}resources: [{rel}]\npatches:\n  - target: {{kind: StatefulSet}}\n    patch: \
         '[]'\n"
    ));
    let e = kustomize::build(&dir).unwrap_err().join("\n");
    assert!(e.contains("matches no resource"), "{e}");
    // The same resources twice.
    write(&format!("{head}resources: [{rel}, {rel}/../base]\n"));
    let e = kustomize::build(&dir).unwrap_err().join("\n");
    assert!(e.contains("is included twice"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The README's way to a registry: an overlay of the operator's own with an `images` entry
/// (what `kustomize edit set image moor=registry.example/moor:0.1.0` writes) renames both moor
/// containers' image and nothing else, with kubectl (when it is there) and the own renderer.
#[test]
fn an_images_entry_renames_moors_image_in_one_place() {
    let dir = std::env::temp_dir().join(format!("moor-deploy-img-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let rel = pathdiff(&dir, &deploy_dir().join("overlays/registrar"));
    let want = moor_deploy::moor_image().replace("moor:", "registry.example:5000/moor:");
    std::fs::write(
        dir.join("kustomization.yaml"),
        format!(
            "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n\
             resources: [{rel}]\nimages:\n  - name: moor\n    newName: \
             registry.example:5000/moor\n"
        ),
    )
    .unwrap();
    let images = |res: &[Resource]| -> Vec<String> {
        let mut out = Vec::new();
        for r in res {
            if let Some(cs) = r.doc["spec"]["template"]["spec"]["containers"].as_array() {
                out.extend(cs.iter().map(|c| c["image"].as_str().unwrap().to_owned()));
            }
        }
        out
    };
    let own = kustomize::build(&dir).unwrap_or_else(|e| panic!("{}", e.join("\n")));
    let kubectl = moor_deploy::kubectl::render(&dir).unwrap_or_else(|e| panic!("{}", e.join("\n")));
    let _ = std::fs::remove_dir_all(&dir);
    for res in [&own, &kubectl] {
        let images = images(res);
        let moor: Vec<&String> = images.iter().filter(|i| i.contains("moor")).collect();
        assert_eq!(moor, [&want, &want], "{images:?}");
        assert!(
            images
                .iter()
                .all(|i| *i == want || i.starts_with("registry.k8s.io/sig-storage/")),
            "{images:?}"
        );
    }
}

/// `to` relative to `from` (both absolute).
fn pathdiff(from: &Path, to: &Path) -> String {
    let depth = from.components().count() - 1;
    format!(
        "{}{}",
        "../".repeat(depth),
        to.strip_prefix("/").unwrap().display()
    )
}
