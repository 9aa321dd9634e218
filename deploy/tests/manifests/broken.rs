//! The cross-object checks catch broken manifests.

use super::*;

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
        "a group snapshot class of another driver",
        |r| find_mut(r, "VolumeGroupSnapshotClass", "moor")["driver"] = json!("other.csi.io"),
        "VolumeGroupSnapshotClass \"moor\": driver Some(\"other.csi.io\"), not a CSIDriver",
    );
    expect_problem(
        "group snapshots without their RBAC",
        |r| {
            find_mut(r, "ClusterRole", "moor-controller")["rules"]
                .as_array_mut()
                .unwrap()
                .retain(|rule| rule["apiGroups"][0] != "groupsnapshot.storage.k8s.io");
        },
        "volumegroupsnapshotcontents",
    );
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
        "no pod info on mount",
        |r| find_mut(r, "CSIDriver", "moor.csi.io")["spec"]["podInfoOnMount"] = json!(false),
        "CSIDriver moor.csi.io: podInfoOnMount must be true",
    );
    expect_problem(
        "the cgroup root not the host's",
        |r| {
            let ds = find_mut(r, "DaemonSet", "moor-node");
            container_mut(ds, "moor-node")["args"]
                .as_array_mut()
                .unwrap()
                .push(json!("--cgroup-root=/host/cgroup"));
        },
        "moor-node's --cgroup-root /host/cgroup must be the host's /sys/fs/cgroup",
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
        "container csi-attacher: --csi-address=/run/x.sock is the socket of no moor container",
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
        "registry.k8s.io/sig-storage/csi-snapshotter must be pinned at v8.6.0",
    );
    expect_problem(
        "driver name mismatch",
        |r| find_mut(r, "StorageClass", "moor")["provisioner"] = json!("moor.example.com"),
        "StorageClass \"moor\": provisioner Some(\"moor.example.com\"), not a CSIDriver",
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

/// Breaks the every-node overlay one way and expects the checks to say so.
fn expect_distributed_problem(what: &str, change: impl FnOnce(&mut Vec<Resource>), want: &str) {
    expect_overlay_problem("distributed", what, change, want);
}

/// Breaks `overlay` (which passes as it is) one way and expects the checks to say so.
fn expect_overlay_problem(
    overlay: &str,
    what: &str,
    change: impl FnOnce(&mut Vec<Resource>),
    want: &str,
) {
    let mut res = render(&deploy_dir().join("overlays").join(overlay));
    assert!(
        checks::check_all(&res, ctx()).is_empty(),
        "the overlay itself passes"
    );
    change(&mut res);
    let p = checks::check_all(&res, ctx()).join("\n");
    assert!(p.contains(want), "{what}: {want:?} not in:\n{p}");
}

fn local_container<'a>(res: &'a mut [Resource], name: &str) -> &'a mut Value {
    container_mut(find_mut(res, "DaemonSet", "moor-local"), name)
}

fn drop_arg(c: &mut Value, arg: &str) {
    c["args"].as_array_mut().unwrap().retain(|a| a != arg);
}

fn drop_env(c: &mut Value, var: &str) {
    c["env"]
        .as_array_mut()
        .unwrap()
        .retain(|e| e["name"] != var);
}

#[test]
fn checks_catch_broken_every_node_manifests() {
    expect_distributed_problem(
        "attached local volumes",
        |r| find_mut(r, "CSIDriver", "local.moor.csi.io")["spec"]["attachRequired"] = json!(true),
        "CSIDriver local.moor.csi.io: attachRequired must be false",
    );
    expect_distributed_problem(
        "no capacity for the scheduler",
        |r| {
            find_mut(r, "CSIDriver", "local.moor.csi.io")["spec"]["storageCapacity"] = json!(false);
        },
        "CSIDriver local.moor.csi.io: storageCapacity must be true",
    );
    expect_distributed_problem(
        "capacity published for a driver that says it has none",
        |r| drop_arg(local_container(r, "csi-provisioner"), "--enable-capacity"),
        "CSIDriver local.moor.csi.io: storageCapacity must be false",
    );
    expect_distributed_problem(
        "every node's controller answering for every volume",
        |r| drop_arg(local_container(r, "moor-controller"), "--node-local"),
        "pass --node-local",
    );
    expect_distributed_problem(
        "node plugin without its controller",
        |r| {
            let c = local_container(r, "moor-node");
            let args = c["args"].as_array_mut().unwrap();
            let a = args
                .iter_mut()
                .find(|a| a.as_str().unwrap().starts_with("--local-controller="))
                .unwrap();
            *a = json!("--local-controller=unix:///csi/other.sock");
        },
        "is not the controller's socket unix:///controller/csi.sock",
    );
    expect_distributed_problem(
        "a leader among provisioners of their own nodes",
        |r| {
            local_container(r, "csi-provisioner")["args"]
                .as_array_mut()
                .unwrap()
                .push(json!("--leader-election"));
        },
        "--node-deployment runs one on each node, each for its node: no --leader-election",
    );
    expect_distributed_problem(
        "a provisioner that does not know its node",
        |r| drop_env(local_container(r, "csi-provisioner"), "NODE_NAME"),
        "needs the env var NODE_NAME from fieldRef spec.nodeName",
    );
    expect_distributed_problem(
        "capacity without an owner",
        |r| drop_env(local_container(r, "csi-provisioner"), "POD_NAME"),
        "needs the env var POD_NAME from fieldRef metadata.name",
    );
    expect_distributed_problem(
        "capacity objects it may not write",
        |r| {
            find_mut(r, "Role", "moor-local")["rules"]
                .as_array_mut()
                .unwrap()
                .retain(|rule| rule["resources"][0] != "csistoragecapacities");
        },
        "ServiceAccount moor-system/moor-local lacks create on storage.k8s.io/csistoragecapacities",
    );
    expect_distributed_problem(
        "a controller blind to the kubelet's mounts",
        |r| drop_mount(local_container(r, "moor-controller"), "kubelet-dir"),
        "moor-controller must see the kubelet's mounts",
    );
    expect_distributed_problem(
        "a provisioner on the node plugin's socket",
        |r| {
            let c = local_container(r, "csi-provisioner");
            c["args"][0] = json!("--csi-address=/csi/csi.sock");
            c["volumeMounts"][0] = json!({"name": "socket-dir", "mountPath": "/csi"});
        },
        "calls moor-controller on /csi/csi.sock, which moor-node does not serve",
    );
    expect_distributed_problem(
        "two DaemonSets on one host port",
        |r| {
            let ds = find_mut(r, "DaemonSet", "moor-local");
            container_mut(ds, "moor-node")["ports"][0]["containerPort"] = json!(9808);
            container_mut(ds, "liveness-probe")["args"][1] =
                json!("--http-endpoint=127.0.0.1:9808");
        },
        "both take port 9808 of the host's network",
    );
}

/// Breaks the key rotation overlay one way and expects the checks to say so.
fn expect_rotation_problem(what: &str, change: impl FnOnce(&mut Vec<Resource>), want: &str) {
    expect_overlay_problem("key-rotation", what, change, want);
}

fn drop_mount(c: &mut Value, volume: &str) {
    c["volumeMounts"]
        .as_array_mut()
        .unwrap()
        .retain(|m| m["name"] != volume);
}

/// The element of a list named `name` (a volume, a mount).
fn named<'a>(list: &'a mut Value, name: &str) -> &'a mut Value {
    list.as_array_mut()
        .unwrap()
        .iter_mut()
        .find(|x| x["name"] == name)
        .unwrap_or_else(|| panic!("no {name}"))
}

/// moor-local without its sidecars: what the moor daemons alone need.
fn only_moor_containers(r: &mut [Resource]) {
    let ds = find_mut(r, "DaemonSet", "moor-local");
    ds["spec"]["template"]["spec"]["containers"]
        .as_array_mut()
        .unwrap()
        .retain(|c| c["name"] == "moor-node" || c["name"] == "moor-controller");
}

#[test]
fn checks_catch_broken_key_rotation_manifests() {
    expect_rotation_problem(
        "the secrets dir not mounted",
        |r| drop_mount(local_container(r, "moor-node"), "key-rotation"),
        "--key-rotation-secrets=/etc/moor/key-rotation is not mounted",
    );
    expect_rotation_problem(
        "the KEK writable",
        |r| {
            let mounts = &mut local_container(r, "moor-node")["volumeMounts"];
            let m = named(mounts, "key-rotation");
            m.as_object_mut().unwrap().remove("readOnly");
        },
        "mount the Secret readOnly: true",
    );
    expect_rotation_problem(
        "the KEK from the host, not a Secret",
        |r| {
            let ds = find_mut(r, "DaemonSet", "moor-local");
            *named(
                &mut ds["spec"]["template"]["spec"]["volumes"],
                "key-rotation",
            ) = json!({"name": "key-rotation", "hostPath": {"path": "/etc/moor/key-rotation"}});
        },
        "must be a Secret's volume",
    );
    expect_rotation_problem(
        "no controller to ask",
        |r| {
            let c = local_container(r, "moor-node");
            c["args"]
                .as_array_mut()
                .unwrap()
                .retain(|a| !a.as_str().unwrap().starts_with("--local-controller="));
        },
        "--key-rotation-secrets needs --key-rotation-controller or --local-controller",
    );
    // The controller's own need, not hidden by the sidecars' (which also list PVs and PVCs):
    // with the sidecars gone and no rule on PVs or PVCs left, the annotations' list is missing.
    expect_rotation_problem(
        "annotations the controller may not list",
        |r| {
            only_moor_containers(r);
            for role in ["moor-local", "moor-key-rotation"] {
                find_mut(r, "ClusterRole", role)["rules"]
                    .as_array_mut()
                    .unwrap()
                    .retain(|rule| {
                        !rule["resources"]
                            .as_array()
                            .unwrap()
                            .iter()
                            .any(|x| x == "persistentvolumes" || x == "persistentvolumeclaims")
                    });
            }
        },
        "ServiceAccount moor-system/moor-local lacks list on persistentvolumes",
    );
    expect_rotation_problem(
        "the annotations' rule without the flag that needs it",
        |r| {
            only_moor_containers(r);
            drop_arg(
                local_container(r, "moor-controller"),
                "--key-rotation-annotations",
            );
        },
        "ServiceAccount moor-system/moor-local is granted list on /persistentvolumeclaims \
         cluster-wide, which none of its containers needs",
    );
}
