//! Every manifest under deploy/, rendered by `kubectl kustomize` (by deploy's own renderer
//! without kubectl), validated strictly against the Kubernetes API schemas and checked across
//! objects; and the validator's own negative cases.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock, PoisonError};

use moor_deploy::checks::{self, Context};
use moor_deploy::kustomize::{self, Resource, meta};
use moor_deploy::schema::Schemas;
use moor_deploy::{deploy_dir, yaml};
use serde_json::{Value, json};

fn schemas() -> &'static Schemas {
    static S: OnceLock<Schemas> = OnceLock::new();
    S.get_or_init(|| moor_deploy::load_schemas().unwrap_or_else(|e| panic!("{e}")))
}

/// The binaries' flags with the coming ones.
fn ctx() -> &'static Context {
    static C: OnceLock<Context> = OnceLock::new();
    C.get_or_init(|| {
        let (ctx, notes) = moor_deploy::context(true).unwrap_or_else(|e| panic!("{e}"));
        for n in notes {
            eprintln!("note: {n}");
        }
        ctx
    })
}

/// The kustomization in `dir`, rendered once per test process (kubectl is slow to start).
fn render(dir: &Path) -> Vec<Resource> {
    static RENDERED: Mutex<BTreeMap<PathBuf, Vec<Resource>>> = Mutex::new(BTreeMap::new());
    let mut rendered = RENDERED.lock().unwrap_or_else(PoisonError::into_inner);
    rendered
        .entry(dir.to_owned())
        .or_insert_with(|| {
            moor_deploy::kubectl::render(dir).unwrap_or_else(|errors| {
                panic!("{} does not render:\n{}", dir.display(), errors.join("\n"))
            })
        })
        .clone()
}

fn problems(res: &[Resource], ctx: &Context) -> Vec<String> {
    let mut p = moor_deploy::validate_set(schemas(), res);
    p.extend(checks::check_all(res, ctx));
    p
}

fn base() -> Vec<Resource> {
    render(&deploy_dir().join("base"))
}

fn find<'a>(res: &'a [Resource], kind: &str, name: &str) -> &'a Value {
    res.iter()
        .map(|r| &r.doc)
        .find(|d| d["kind"] == kind && meta(d, "name") == Some(name))
        .unwrap_or_else(|| panic!("no {kind} {name}"))
}

fn find_mut<'a>(res: &'a mut [Resource], kind: &str, name: &str) -> &'a mut Value {
    res.iter_mut()
        .map(|r| &mut r.doc)
        .find(|d| d["kind"] == kind && meta(d, "name") == Some(name))
        .unwrap_or_else(|| panic!("no {kind} {name}"))
}

fn container<'a>(workload: &'a Value, name: &str) -> &'a Value {
    workload["spec"]["template"]["spec"]["containers"]
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["name"] == name))
        .unwrap_or_else(|| panic!("no container {name}"))
}

fn container_mut<'a>(workload: &'a mut Value, name: &str) -> &'a mut Value {
    workload["spec"]["template"]["spec"]["containers"]
        .as_array_mut()
        .and_then(|cs| cs.iter_mut().find(|c| c["name"] == name))
        .unwrap_or_else(|| panic!("no container {name}"))
}

#[test]
fn base_and_every_overlay_render_validate_and_check() {
    let mut dirs = vec![deploy_dir().join("base")];
    dirs.extend(moor_deploy::overlays().unwrap());
    let names: Vec<_> = dirs.iter().filter_map(|d| d.file_name()).collect();
    assert_eq!(
        names,
        [
            "base",
            "builtin-registration",
            "registrar",
            "selinux",
            "xfs"
        ]
    );
    eprintln!("rendered by {:?}", moor_deploy::kubectl::renderer());
    for dir in dirs {
        let res = render(&dir);
        assert!(res.len() >= 14, "{}: {} objects", dir.display(), res.len());
        let p = problems(&res, ctx());
        assert!(p.is_empty(), "{}:\n{}", dir.display(), p.join("\n"));
    }
}

#[test]
fn default_overlay_runs_with_todays_binaries() {
    // No coming flag: what `kubectl apply -k deploy/overlays/registrar` deploys must start with
    // the binaries as they are.
    let (today, _) = moor_deploy::context(false).unwrap();
    let res = render(&deploy_dir().join("overlays/registrar"));
    let p = problems(&res, &today);
    assert!(p.is_empty(), "{}", p.join("\n"));
}

#[test]
fn every_yaml_file_is_strict_yaml() {
    fn walk(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() && p.file_name().is_some_and(|n| n != "target") {
                walk(&p, out);
            } else if p.extension().is_some_and(|x| x == "yaml" || x == "yml") {
                out.push(p);
            }
        }
    }
    let mut files = Vec::new();
    walk(&deploy_dir(), &mut files);
    assert!(files.len() >= 13, "{files:?}");
    for f in files {
        assert!(
            f.extension().is_some_and(|x| x == "yaml"),
            "{}: use .yaml",
            f.display()
        );
        let text = std::fs::read_to_string(&f).unwrap();
        yaml::load_all(&text).unwrap_or_else(|e| panic!("{}: {e}", f.display()));
    }
}

#[test]
fn base_kustomization_lists_every_manifest() {
    let dir = deploy_dir().join("base");
    let k = kustomize::load_file(&dir.join("kustomization.yaml")).unwrap();
    let listed: std::collections::BTreeSet<String> = k[0]["resources"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r.as_str().unwrap().to_owned())
        .collect();
    let present: std::collections::BTreeSet<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".yaml") && n != "kustomization.yaml")
        .collect();
    assert_eq!(listed, present);
}

#[test]
fn base_objects_are_as_specified() {
    let res = base();
    // In any order: kubectl sorts them its way, deploy's renderer keeps the files' order.
    let mut ids: Vec<String> = res.iter().map(Resource::id).collect();
    ids.sort();
    assert_eq!(
        ids,
        [
            "CSIDriver/moor.csi.io",
            "ClusterRole/moor-controller",
            "ClusterRole/moor-node",
            "ClusterRoleBinding/moor-controller",
            "ClusterRoleBinding/moor-node",
            "DaemonSet/moor-system/moor-node",
            "Deployment/moor-system/moor-controller",
            "Namespace/moor-system",
            "Role/moor-system/moor-controller-leader-election",
            "RoleBinding/moor-system/moor-controller-leader-election",
            "ServiceAccount/moor-system/moor-controller",
            "ServiceAccount/moor-system/moor-node",
            "StorageClass/moor",
            "VolumeSnapshotClass/moor",
        ]
    );
    assert_eq!(
        find(&res, "CSIDriver", "moor.csi.io")["spec"],
        json!({
            "attachRequired": true,
            "podInfoOnMount": false,
            "fsGroupPolicy": "File",
            "volumeLifecycleModes": ["Persistent"],
            "requiresRepublish": false,
            "storageCapacity": false
        })
    );
    let sc = find(&res, "StorageClass", "moor");
    assert_eq!(sc["provisioner"], "moor.csi.io");
    assert_eq!(
        sc["parameters"],
        json!({"csi.storage.k8s.io/fstype": "ext4"})
    );
    assert_eq!(
        (
            &sc["allowVolumeExpansion"],
            &sc["volumeBindingMode"],
            &sc["reclaimPolicy"]
        ),
        (
            &json!(true),
            &json!("WaitForFirstConsumer"),
            &json!("Delete")
        )
    );
    let vsc = find(&res, "VolumeSnapshotClass", "moor");
    assert_eq!(vsc["apiVersion"], "snapshot.storage.k8s.io/v1");
    assert_eq!(
        (&vsc["driver"], &vsc["deletionPolicy"]),
        (&json!("moor.csi.io"), &json!("Delete"))
    );

    let ds = find(&res, "DaemonSet", "moor-node");
    let node = container(ds, "moor-node");
    assert_eq!(node["securityContext"]["privileged"], true);
    assert_eq!(
        node["args"],
        json!([
            "--endpoint=unix:///csi/csi.sock",
            "--node-id=$(NODE_ID)",
            "--driver-name=moor.csi.io",
            "--state-dir=/var/lib/moor",
            "--kubelet-dir=/var/lib/kubelet",
            "--log-format=json",
            "--shutdown-grace=20",
            "--reconcile-interval=60",
            "--http-endpoint=127.0.0.1:9809"
        ])
    );
    assert_eq!(node["livenessProbe"]["httpGet"]["path"], "/healthz");
    let registrar = container(ds, "node-driver-registrar");
    assert_eq!(
        registrar["image"],
        "registry.k8s.io/sig-storage/csi-node-driver-registrar:v2.13.0"
    );
    assert_eq!(
        registrar["args"],
        json!([
            "--csi-address=/csi/csi.sock",
            "--kubelet-registration-path=/var/lib/kubelet/plugins/moor.csi.io/csi.sock"
        ])
    );
    let host_paths: Vec<&str> = ds["spec"]["template"]["spec"]["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|v| v["hostPath"]["path"].as_str())
        .collect();
    assert_eq!(
        host_paths,
        [
            "/var/lib/kubelet/plugins/moor.csi.io",
            "/var/lib/kubelet/plugins_registry",
            "/var/lib/kubelet",
            "/var/lib/moor",
            "/dev",
            "/sys",
            "/run/udev"
        ]
    );

    let dep = find(&res, "Deployment", "moor-controller");
    assert_eq!(dep["spec"]["replicas"], 1);
    let images: Vec<&str> = dep["spec"]["template"]["spec"]["containers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["image"].as_str().unwrap())
        .collect();
    assert_eq!(
        images,
        [
            moor_deploy::moor_image().as_str(),
            "registry.k8s.io/sig-storage/csi-provisioner:v5.2.0",
            "registry.k8s.io/sig-storage/csi-attacher:v4.8.0",
            "registry.k8s.io/sig-storage/csi-resizer:v1.13.1",
            "registry.k8s.io/sig-storage/csi-snapshotter:v8.2.0",
            "registry.k8s.io/sig-storage/livenessprobe:v2.15.0",
        ]
    );
    assert_eq!(
        container(dep, "csi-provisioner")["args"],
        json!([
            "--csi-address=/csi/csi.sock",
            "--leader-election",
            "--feature-gates=Topology=true",
            "--extra-create-metadata"
        ])
    );
    let ctl = container(dep, "moor-controller");
    assert!(
        ctl["args"]
            .as_array()
            .unwrap()
            .contains(&json!("--data-dir=/var/lib/moor-controller"))
    );
    assert_eq!(ctl["securityContext"]["privileged"], true);
}

#[test]
fn overlays_change_only_what_they_say() {
    let base = base();
    let registrar = render(&deploy_dir().join("overlays/registrar"));
    assert_eq!(registrar, {
        // Same objects; only the source files differ.
        let mut b = base.clone();
        for (x, y) in b.iter_mut().zip(&registrar) {
            x.source.clone_from(&y.source);
        }
        b
    });

    let builtin = render(&deploy_dir().join("overlays/builtin-registration"));
    let mut want = base.clone();
    let ds = find_mut(&mut want, "DaemonSet", "moor-node");
    let pod = &mut ds["spec"]["template"]["spec"];
    pod["containers"]
        .as_array_mut()
        .unwrap()
        .retain(|c| c["name"] != "node-driver-registrar" && c["name"] != "liveness-probe");
    let node = container_mut(ds, "moor-node");
    let args = node["args"].as_array_mut().unwrap();
    args.push(json!("--registration-dir=/registration"));
    args.push(json!(
        "--kubelet-registration-path=/var/lib/kubelet/plugins/moor.csi.io/csi.sock"
    ));
    node["ports"].as_array_mut().unwrap().remove(0);
    node["livenessProbe"]["httpGet"]["port"] = json!("http");
    node["volumeMounts"]
        .as_array_mut()
        .unwrap()
        .push(json!({"name": "registration-dir", "mountPath": "/registration"}));
    let docs = |r: &[Resource]| r.iter().map(|r| r.doc.clone()).collect::<Vec<_>>();
    assert_eq!(docs(&builtin), docs(&want));

    let selinux = render(&deploy_dir().join("overlays/selinux"));
    let mut want = base.clone();
    find_mut(&mut want, "CSIDriver", "moor.csi.io")["spec"]["seLinuxMount"] = json!(true);
    assert_eq!(docs(&selinux), docs(&want));

    let xfs = render(&deploy_dir().join("overlays/xfs"));
    let mut want = base;
    find_mut(&mut want, "StorageClass", "moor")["parameters"]["csi.storage.k8s.io/fstype"] =
        json!("xfs");
    assert_eq!(docs(&xfs), docs(&want));
}

// ----- negative cases: the validator and the checks reject what they must -----------------

const DAEMONSET: &str = r#"
apiVersion: apps/v1
kind: DaemonSet
metadata:
  name: x
  namespace: moor-system
spec:
  selector:
    matchLabels: {app: x}
  template:
    metadata:
      labels: {app: x}
    spec:
      containers:
        - name: c
          image: busybox:1
          ports:
            - containerPort: 80
          resources:
            requests: {cpu: 10m, memory: 1}
"#;

fn doc(src: &str) -> Value {
    let mut docs = yaml::load_all(src).unwrap();
    docs.remove(0).value
}

fn validate(v: &Value) -> Vec<String> {
    schemas()
        .validate_object(v)
        .iter()
        .map(ToString::to_string)
        .collect()
}

#[test]
fn validator_accepts_a_valid_inline_document() {
    assert_eq!(validate(&doc(DAEMONSET)), Vec::<String>::new());
}

#[test]
fn validator_rejects_unknown_fields() {
    let mut d = doc(DAEMONSET);
    d["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = json!("Always");
    d["spec"]["template"]["spec"]["hostNetwrok"] = json!(true);
    d["spec"]["extra"] = json!({});
    d["metadata"]["labelz"] = json!({});
    let p = validate(&d).join("\n");
    for want in [
        "spec.template.spec.containers[c].imagePullPolicyy: unknown field \"imagePullPolicyy\"",
        "spec.template.spec.hostNetwrok: unknown field",
        "spec.extra: unknown field",
        "metadata.labelz: unknown field",
    ] {
        assert!(p.contains(want), "{want:?} not in:\n{p}");
    }
    assert_eq!(p.lines().count(), 4, "{p}");
}

#[test]
fn later_fields_are_typed_and_only_where_listed() {
    let driver = |spec: Value| {
        json!({
            "apiVersion": "storage.k8s.io/v1",
            "kind": "CSIDriver",
            "metadata": {"name": "x"},
            "spec": spec
        })
    };
    assert_eq!(
        validate(&driver(json!({"seLinuxMount": true}))),
        Vec::<String>::new()
    );
    let p = validate(&driver(json!({"seLinuxMount": "true"}))).join("\n");
    assert!(
        p.contains("spec.seLinuxMount: expected boolean, found string"),
        "{p}"
    );
    // Another field of a later release is still unknown.
    let p = validate(&driver(json!({"nodeAllocatableUpdatePeriodSeconds": 60}))).join("\n");
    assert!(p.contains("unknown field"), "{p}");
    // A listed field on a schema without properties is an error, not a silent no-op.
    let mut s = moor_deploy::load_schemas().unwrap();
    let e = s
        .add_field(
            "io.k8s.apimachinery.pkg.api.resource.Quantity",
            "x",
            "v1.99",
            "boolean",
        )
        .unwrap_err();
    assert!(e.contains("has no properties"), "{e}");
}

#[test]
fn validator_rejects_bad_types_required_fields_and_values() {
    let cases: &[(&str, Value, &str)] = &[
        (
            "/spec/template/spec/hostNetwork",
            json!("true"),
            "expected boolean, found string",
        ),
        (
            "/spec/minReadySeconds",
            json!("5"),
            "expected integer, found string",
        ),
        (
            "/spec/minReadySeconds",
            json!(1.5),
            "expected integer, found a fractional number",
        ),
        (
            "/spec/minReadySeconds",
            json!(3_000_000_000u64),
            "out of the int32 range",
        ),
        (
            "/spec/template/metadata/labels/app",
            json!(true),
            "expected string, found boolean",
        ),
        (
            "/spec/template/spec/containers/0/args",
            json!("--x"),
            "expected array, found string",
        ),
        (
            "/spec/template/spec/containers/0/ports/0/containerPort",
            json!(null),
            "null value",
        ),
        (
            "/spec/template/spec/containers/0/imagePullPolicy",
            json!("Sometimes"),
            "is not one of [\"Always\",\"IfNotPresent\",\"Never\"]",
        ),
        (
            "/spec/template/spec/containers/0/resources/requests/cpu",
            json!("ten"),
            "\"ten\" is not a quantity",
        ),
        (
            "/spec/template/spec/containers/0/terminationMessagePolicy",
            json!("Always"),
            "is not one of [\"File\", \"FallbackToLogsOnError\"]",
        ),
        (
            "/spec/updateStrategy",
            json!({"rollingUpdate": {"maxUnavailable": true}}),
            "maxUnavailable: expected string, found boolean",
        ),
    ];
    for (pointer, value, want) in cases {
        let mut d = doc(DAEMONSET);
        let (parent, key) = pointer.rsplit_once('/').unwrap();
        let slot = d.pointer_mut(parent).unwrap();
        match slot {
            Value::Array(a) => a[key.parse::<usize>().unwrap()] = value.clone(),
            _ => slot[key] = value.clone(),
        }
        let p = validate(&d).join("\n");
        assert!(p.contains(want), "{pointer}={value}: {want:?} not in:\n{p}");
    }
    // int-or-string takes both.
    let mut d = doc(DAEMONSET);
    d["spec"]["updateStrategy"] = json!({"rollingUpdate": {"maxUnavailable": "10%"}});
    assert_eq!(validate(&d), Vec::<String>::new());
    d["spec"]["updateStrategy"] = json!({"rollingUpdate": {"maxUnavailable": 2}});
    assert_eq!(validate(&d), Vec::<String>::new());
    // Required fields.
    let mut d = doc(DAEMONSET);
    d["spec"]["template"]["spec"]["containers"][0]
        .as_object_mut()
        .unwrap()
        .remove("name");
    d["spec"].as_object_mut().unwrap().remove("selector");
    let p = validate(&d).join("\n");
    assert!(
        p.contains("spec: required field selector is missing"),
        "{p}"
    );
    assert!(
        p.contains("containers[0]: required field name is missing"),
        "{p}"
    );
    // Keyed lists: two containers of one name, two mounts at one path, two ports alike.
    let mut d = doc(DAEMONSET);
    let c = d["spec"]["template"]["spec"]["containers"][0].clone();
    d["spec"]["template"]["spec"]["containers"] = json!([c.clone(), c]);
    d["spec"]["template"]["spec"]["containers"][0]["ports"] =
        json!([{"containerPort": 80}, {"containerPort": 80, "protocol": "TCP"}]);
    let p = validate(&d).join("\n");
    assert!(p.contains("containers: duplicate item [\"c\"]"), "{p}");
    assert!(p.contains("ports: duplicate item [80,\"TCP\"]"), "{p}");
}

#[test]
fn validator_rejects_unknown_kinds_and_checks_hand_written_ones() {
    let p = validate(&json!({"apiVersion": "v1", "kind": "Nope", "metadata": {"name": "x"}}));
    assert_eq!(p, ["kind v1/Nope is not in the schemas"]);
    let p = validate(&json!({"apiVersion": "apps/v2", "kind": "DaemonSet"}));
    assert_eq!(p, ["kind apps/v2/DaemonSet is not in the schemas"]);
    let p = validate(&json!({"kind": "DaemonSet"}));
    assert_eq!(p, ["an object needs string apiVersion and kind"]);
    let p = validate(&json!({
        "apiVersion": "snapshot.storage.k8s.io/v1",
        "kind": "VolumeSnapshotClass",
        "metadata": {"name": "x", "nmespace": "y"},
        "driver": "moor.csi.io",
        "deletionPolicy": "Keep",
        "parameter": {}
    }))
    .join("\n");
    assert!(p.contains("metadata.nmespace: unknown field"), "{p}");
    assert!(p.contains("deletionPolicy: \"Keep\" is not one of"), "{p}");
    assert!(p.contains("parameter: unknown field"), "{p}");
}

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

/// `to` relative to `from` (both absolute).
fn pathdiff(from: &Path, to: &Path) -> String {
    let depth = from.components().count() - 1;
    format!(
        "{}{}",
        "../".repeat(depth),
        to.strip_prefix("/").unwrap().display()
    )
}

#[test]
fn flags_not_in_the_binaries_are_rejected() {
    let ctx = ctx();
    let p = ctx
        .node
        .check_args(&["--node-id=n".into(), "--no-such-flag=1".into()], &[]);
    assert_eq!(p.len(), 1, "{p:?}");
    assert!(
        p[0].starts_with("moor-node has no flag --no-such-flag"),
        "{p:?}"
    );
    let p = ctx
        .controller
        .check_args(&["--node-id=n".into(), "--state-dir=/x".into()], &[]);
    assert!(
        p[0].starts_with("moor-controller has no flag --state-dir"),
        "{p:?}"
    );
    // And through the manifests.
    let mut res = base();
    let ds = find_mut(&mut res, "DaemonSet", "moor-node");
    let args = container_mut(ds, "moor-node")["args"]
        .as_array_mut()
        .unwrap();
    args.push(json!("--no-such-flag=1"));
    args.push(json!("--log-format=xml"));
    let p = checks::check_all(&res, ctx).join("\n");
    assert!(
        p.contains("container moor-node: moor-node has no flag --no-such-flag"),
        "{p}"
    );
    assert!(p.contains("--log-format=xml: not one of text, json"), "{p}");
    assert!(p.contains("--log-format is given 2 times"), "{p}");
}

/// Breaks the base one way and expects the checks to say so.
fn expect_problem(what: &str, change: impl FnOnce(&mut Vec<Resource>), want: &str) {
    let mut res = base();
    change(&mut res);
    let p = checks::check_all(&res, ctx()).join("\n");
    assert!(p.contains(want), "{what}: {want:?} not in:\n{p}");
}

fn node_pod(res: &mut [Resource]) -> &mut Value {
    &mut find_mut(res, "DaemonSet", "moor-node")["spec"]["template"]["spec"]
}

#[test]
fn checks_catch_broken_manifests() {
    expect_problem(
        "no Bidirectional",
        |r| {
            let m = &mut container_mut(find_mut(r, "DaemonSet", "moor-node"), "moor-node")["volumeMounts"]
                [1];
            m.as_object_mut().unwrap().remove("mountPropagation");
        },
        "the kubelet dir /var/lib/kubelet needs mountPropagation: Bidirectional",
    );
    expect_problem(
        "wrong registration path",
        |r| {
            let ds = find_mut(r, "DaemonSet", "moor-node");
            container_mut(ds, "node-driver-registrar")["args"][1] =
                json!("--kubelet-registration-path=/csi/csi.sock");
        },
        "--kubelet-registration-path must be /var/lib/kubelet/plugins/moor.csi.io/csi.sock",
    );
    expect_problem(
        "double registration",
        |r| {
            let ds = find_mut(r, "DaemonSet", "moor-node");
            container_mut(ds, "moor-node")["args"]
                .as_array_mut()
                .unwrap()
                .push(json!("--registration-dir=/registration"));
        },
        "the driver would register twice",
    );
    expect_problem(
        "built-in registration announcing the container's socket path",
        |r| {
            node_pod(r)["containers"]
                .as_array_mut()
                .unwrap()
                .retain(|c| c["name"] != "node-driver-registrar");
            let ds = find_mut(r, "DaemonSet", "moor-node");
            container_mut(ds, "moor-node")["args"]
                .as_array_mut()
                .unwrap()
                .push(json!("--registration-dir=/registration"));
        },
        "--kubelet-registration-path must be /var/lib/kubelet/plugins/moor.csi.io/csi.sock",
    );
    expect_problem(
        "moor-node's http endpoint on every interface of the host network",
        |r| {
            let ds = find_mut(r, "DaemonSet", "moor-node");
            let args = container_mut(ds, "moor-node")["args"]
                .as_array_mut()
                .unwrap();
            args.retain(|a| !a.as_str().unwrap().starts_with("--http-endpoint"));
            args.push(json!("--http-endpoint=0.0.0.0:9809"));
        },
        "container moor-node listens on every interface of the node (hostNetwork) at port 9809",
    );
    expect_problem(
        "no registration",
        |r| {
            node_pod(r)["containers"]
                .as_array_mut()
                .unwrap()
                .retain(|c| c["name"] != "node-driver-registrar");
        },
        "nothing registers the driver with the kubelet",
    );
    expect_problem(
        "health endpoint exposed on the host network",
        |r| {
            let ds = find_mut(r, "DaemonSet", "moor-node");
            container_mut(ds, "liveness-probe")["args"][1] = json!("--http-endpoint=:9808");
        },
        "listens on every interface of the node (hostNetwork) at port 9808",
    );
    expect_problem(
        "probe on the pod IP for a loopback endpoint",
        |r| {
            let ds = find_mut(r, "DaemonSet", "moor-node");
            let probe = &mut container_mut(ds, "moor-node")["livenessProbe"]["httpGet"];
            probe.as_object_mut().unwrap().remove("host");
        },
        "probe host must be 127.0.0.1",
    );
    expect_problem(
        "probe port nobody serves",
        |r| {
            let dep = find_mut(r, "Deployment", "moor-controller");
            container_mut(dep, "moor-controller")["ports"][0]["containerPort"] = json!(9810);
        },
        "probes port 9810, which nothing in the pod serves",
    );
    expect_problem(
        "undefined env var",
        |r| {
            let ds = find_mut(r, "DaemonSet", "moor-node");
            container_mut(ds, "moor-node")["args"][1] = json!("--node-id=$(NODE_NAME)");
        },
        "refers to $(NODE_NAME), which the container does not define",
    );
    expect_problem(
        "node id not from the node name",
        |r| {
            let ds = find_mut(r, "DaemonSet", "moor-node");
            container_mut(ds, "moor-node")["env"][0]["valueFrom"]["fieldRef"]["fieldPath"] =
                json!("metadata.name");
        },
        "--node-id must come from an env var set from fieldRef spec.nodeName",
    );
    expect_problem(
        "socket not shared",
        |r| {
            let dep = find_mut(r, "Deployment", "moor-controller");
            container_mut(dep, "csi-attacher")["args"][0] = json!("--csi-address=/run/x.sock");
        },
        "container csi-attacher: --csi-address is not /csi/csi.sock",
    );
    expect_problem(
        "no leader election",
        |r| {
            let dep = find_mut(r, "Deployment", "moor-controller");
            container_mut(dep, "csi-resizer")["args"]
                .as_array_mut()
                .unwrap()
                .truncate(1);
        },
        "container csi-resizer: supports leader election: pass --leader-election",
    );
    expect_problem(
        "unknown sidecar flag",
        |r| {
            let dep = find_mut(r, "Deployment", "moor-controller");
            container_mut(dep, "csi-provisioner")["args"][1] = json!("--leader-elect");
        },
        "--leader-elect is not a known flag of registry.k8s.io/sig-storage/csi-provisioner",
    );
    expect_problem(
        "two controllers",
        |r| find_mut(r, "Deployment", "moor-controller")["spec"]["replicas"] = json!(2),
        "set replicas: 1",
    );
    expect_problem(
        "rolling controller",
        |r| {
            find_mut(r, "Deployment", "moor-controller")["spec"]["strategy"]["type"] =
                json!("RollingUpdate");
        },
        "strategy must be Recreate",
    );
    expect_problem(
        "controller not pinned",
        |r| {
            let pod = &mut find_mut(r, "Deployment", "moor-controller")["spec"]["template"]["spec"];
            pod["nodeSelector"] = json!({"kubernetes.io/os": "linux"});
        },
        "pin the controller to it",
    );
    expect_problem(
        "grace longer than the pod's",
        |r| node_pod(r)["terminationGracePeriodSeconds"] = json!(10),
        "--shutdown-grace=20 is not shorter than the pod's terminationGracePeriodSeconds (10)",
    );
    expect_problem(
        "missing lease permissions",
        |r| r.retain(|x| x.doc["kind"] != "RoleBinding"),
        "ServiceAccount moor-system/moor-controller lacks create on coordination.k8s.io/leases",
    );
    expect_problem(
        "missing provisioner permission",
        |r| {
            let cr = find_mut(r, "ClusterRole", "moor-controller");
            cr["rules"][0]["verbs"] = json!(["get", "list", "watch", "create", "patch"]);
        },
        "ServiceAccount moor-system/moor-controller lacks delete on persistentvolumes",
    );
    expect_problem(
        "excess permission",
        |r| {
            let cr = find_mut(r, "ClusterRole", "moor-node");
            cr["rules"][0]["verbs"] = json!(["get", "list"]);
        },
        "is granted list on /nodes cluster-wide, which none of its containers needs",
    );
    expect_problem(
        "wildcard",
        |r| find_mut(r, "ClusterRole", "moor-node")["rules"][0]["verbs"] = json!(["*"]),
        "ClusterRole moor-node: no wildcards in verbs",
    );
    expect_problem(
        "unpinned image",
        |r| {
            let dep = find_mut(r, "Deployment", "moor-controller");
            container_mut(dep, "csi-snapshotter")["image"] =
                json!("registry.k8s.io/sig-storage/csi-snapshotter:v8.1.0");
        },
        "registry.k8s.io/sig-storage/csi-snapshotter must be pinned at v8.2.0",
    );
    expect_problem(
        "driver name mismatch",
        |r| find_mut(r, "StorageClass", "moor")["provisioner"] = json!("moor.example.com"),
        "StorageClass \"moor\": provisioner Some(\"moor.example.com\"), not moor.csi.io",
    );
    expect_problem(
        "state not on the host",
        |r| {
            let vols = node_pod(r)["volumes"].as_array_mut().unwrap();
            let v = vols.iter_mut().find(|v| v["name"] == "state-dir").unwrap();
            *v = json!({"name": "state-dir", "emptyDir": {}});
        },
        "the state dir /var/lib/moor is not a hostPath",
    );
    expect_problem(
        "unused volume and dangling mount",
        |r| {
            let pod = node_pod(r);
            pod["volumes"][0]["name"] = json!("socket");
        },
        "volume mount \"socket-dir\" names no volume of the pod",
    );
    expect_problem(
        "namespace missing",
        |r| r.retain(|x| x.doc["kind"] != "Namespace"),
        "namespace moor-system is not created by these manifests",
    );
}
