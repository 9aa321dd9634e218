//! The schema validator rejects what it must.

use super::*;

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
    assert_eq!(
        validate(&driver(json!({"nodeAllocatableUpdatePeriodSeconds": 60}))),
        Vec::<String>::new()
    );
    let p = validate(&driver(json!({"nodeAllocatableUpdatePeriodSeconds": "60"}))).join("\n");
    assert!(p.contains("expected integer, found string"), "{p}");
    // Another field of a later release is still unknown (CSIDriver serviceAccountTokenInSecrets,
    // 1.35).
    let p = validate(&driver(json!({"serviceAccountTokenInSecrets": true}))).join("\n");
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
    let p = validate(&json!({
        "apiVersion": "groupsnapshot.storage.k8s.io/v1",
        "kind": "VolumeGroupSnapshotClass",
        "metadata": {"name": "x"},
        "driver": "moor.csi.io",
        "deletionPolicy": "Keep"
    }))
    .join("\n");
    assert!(p.contains("deletionPolicy: \"Keep\" is not one of"), "{p}");
    let p = validate(&json!({
        "apiVersion": "groupsnapshot.storage.k8s.io/v1beta1",
        "kind": "VolumeGroupSnapshotClass",
        "driver": "moor.csi.io",
        "deletionPolicy": "Delete"
    }));
    assert_eq!(
        p,
        [
            "kind groupsnapshot.storage.k8s.io/v1beta1/VolumeGroupSnapshotClass is not in the schemas"
        ]
    );
}
