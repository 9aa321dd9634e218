//! The base and every overlay: they render, validate and pass the checks, hold the objects
//! they should, and the overlays change only what they say.

use super::*;

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
            "distributed",
            "key-rotation",
            "kubernetes-1.34",
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
            "VolumeGroupSnapshotClass/moor",
            "VolumeSnapshotClass/moor",
        ]
    );
    assert_eq!(
        find(&res, "CSIDriver", "moor.csi.io")["spec"],
        json!({
            "attachRequired": true,
            "podInfoOnMount": true,
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
    let vgsc = find(&res, "VolumeGroupSnapshotClass", "moor");
    assert_eq!(vgsc["apiVersion"], "groupsnapshot.storage.k8s.io/v1");
    assert_eq!(
        (&vgsc["driver"], &vgsc["deletionPolicy"]),
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
            "/sys/fs/cgroup",
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
            "registry.k8s.io/sig-storage/csi-snapshotter:v8.6.0",
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

    // Today's Kubernetes: the CSIDriver's allocatable period and SELinux mounts, the resizer's
    // recovery on.
    let current = render(&deploy_dir().join("overlays/kubernetes-1.34"));
    let mut want = base.clone();
    let driver = find_mut(&mut want, "CSIDriver", "moor.csi.io");
    driver["spec"]["nodeAllocatableUpdatePeriodSeconds"] = json!(60);
    driver["spec"]["seLinuxMount"] = json!(true);
    let ctl = find_mut(&mut want, "Deployment", "moor-controller");
    let resizer = container_mut(ctl, "csi-resizer");
    let gates = resizer["args"]
        .as_array_mut()
        .unwrap()
        .iter_mut()
        .find(|a| {
            a.as_str()
                .is_some_and(|a| a.starts_with("--feature-gates="))
        })
        .expect("the resizer's gates");
    assert_eq!(
        *gates,
        json!("--feature-gates=RecoverVolumeExpansionFailure=false")
    );
    *gates = json!("--feature-gates=RecoverVolumeExpansionFailure=true");
    assert_eq!(docs(&current), docs(&want));

    let xfs = render(&deploy_dir().join("overlays/xfs"));
    let mut want = base;
    find_mut(&mut want, "StorageClass", "moor")["parameters"]["csi.storage.k8s.io/fstype"] =
        json!("xfs");
    assert_eq!(docs(&xfs), docs(&want));
}

#[test]
fn the_every_node_overlay_adds_the_local_driver_and_changes_nothing_else() {
    let base = base();
    let distributed = render(&deploy_dir().join("overlays/distributed"));
    // Today's binaries run it (no coming flag).
    let (today, _) = moor_deploy::context(false).unwrap();
    let p = problems(&distributed, &today);
    assert!(p.is_empty(), "{}", p.join("\n"));
    // The base's objects, as they are.
    for b in &base {
        let same = distributed
            .iter()
            .find(|d| d.id() == b.id())
            .map(|d| &d.doc);
        assert_eq!(same, Some(&b.doc), "{}", b.id());
    }
    let mut added: Vec<String> = distributed
        .iter()
        .map(Resource::id)
        .filter(|id| base.iter().all(|b| b.id() != *id))
        .collect();
    added.sort();
    assert_eq!(
        added,
        [
            "CSIDriver/local.moor.csi.io",
            "ClusterRole/moor-local",
            "ClusterRoleBinding/moor-local",
            "DaemonSet/moor-system/moor-local",
            "Role/moor-system/moor-local",
            "RoleBinding/moor-system/moor-local",
            "ServiceAccount/moor-system/moor-local",
            "StorageClass/moor-local",
            "StorageClass/moor-local-thick",
            "VolumeGroupSnapshotClass/moor-local",
            "VolumeSnapshotClass/moor-local",
        ]
    );
    assert_eq!(
        find(&distributed, "CSIDriver", "local.moor.csi.io")["spec"],
        json!({
            "attachRequired": false,
            "podInfoOnMount": true,
            "fsGroupPolicy": "File",
            "volumeLifecycleModes": ["Persistent"],
            "requiresRepublish": false,
            "storageCapacity": true
        })
    );
    for (class, params) in [
        ("moor-local", json!({"csi.storage.k8s.io/fstype": "ext4"})),
        (
            "moor-local-thick",
            json!({"csi.storage.k8s.io/fstype": "ext4", "provisioning": "thick"}),
        ),
    ] {
        let sc = find(&distributed, "StorageClass", class);
        assert_eq!(sc["provisioner"], "local.moor.csi.io");
        assert_eq!(sc["parameters"], params);
        assert_eq!(sc["volumeBindingMode"], "WaitForFirstConsumer");
        assert_eq!(sc["allowVolumeExpansion"], true);
    }
    let ds = find(&distributed, "DaemonSet", "moor-local");
    let ctl = container(ds, "moor-controller");
    for a in [
        "--node-local",
        "--driver-name=local.moor.csi.io",
        "--data-dir=/var/lib/moor-local/data",
        "--thin-overcommit=1",
    ] {
        assert!(ctl["args"].as_array().unwrap().contains(&json!(a)), "{a}");
    }
    assert!(
        container(ds, "moor-node")["args"]
            .as_array()
            .unwrap()
            .contains(&json!("--local-controller=unix:///controller/csi.sock"))
    );
    assert_eq!(
        container(ds, "csi-provisioner")["args"],
        json!([
            "--csi-address=/controller/csi.sock",
            "--node-deployment",
            "--feature-gates=Topology=true",
            "--strict-topology",
            "--enable-capacity",
            "--capacity-ownerref-level=0",
            "--extra-create-metadata"
        ])
    );
    assert_eq!(
        container(ds, "csi-snapshotter")["args"],
        json!([
            "--csi-address=/controller/csi.sock",
            "--node-deployment",
            "--feature-gates=CSIVolumeGroupSnapshot=true"
        ])
    );
}

#[test]
fn the_key_rotation_overlay_is_the_every_node_one_with_rotation_on() {
    let distributed = render(&deploy_dir().join("overlays/distributed"));
    let rotation = render(&deploy_dir().join("overlays/key-rotation"));
    // Today's binaries run it (no coming flag).
    let (today, _) = moor_deploy::context(false).unwrap();
    let p = problems(&rotation, &today);
    assert!(p.is_empty(), "{}", p.join("\n"));
    let mut want = distributed;
    let ds = find_mut(&mut want, "DaemonSet", "moor-local");
    ds["spec"]["template"]["spec"]["volumes"]
        .as_array_mut()
        .unwrap()
        .push(json!({
            "name": "key-rotation",
            "secret": {"secretName": "moor-key-rotation", "optional": true, "defaultMode": 0o400}
        }));
    let node = container_mut(ds, "moor-node");
    node["args"]
        .as_array_mut()
        .unwrap()
        .push(json!("--key-rotation-secrets=/etc/moor/key-rotation"));
    node["volumeMounts"].as_array_mut().unwrap().push(json!({
        "name": "key-rotation",
        "mountPath": "/etc/moor/key-rotation",
        "readOnly": true
    }));
    container_mut(ds, "moor-controller")["args"]
        .as_array_mut()
        .unwrap()
        .push(json!("--key-rotation-annotations"));
    let rules = json!([{
        "apiGroups": [""],
        "resources": ["persistentvolumes", "persistentvolumeclaims"],
        "verbs": ["list"]
    }]);
    assert_eq!(
        find(&rotation, "ClusterRole", "moor-key-rotation")["rules"],
        rules
    );
    let binding = find(&rotation, "ClusterRoleBinding", "moor-key-rotation");
    assert_eq!(
        binding["subjects"],
        json!([{"kind": "ServiceAccount", "name": "moor-local", "namespace": "moor-system"}])
    );
    assert_eq!(binding["roleRef"]["name"], "moor-key-rotation");
    let docs = |r: &[Resource]| {
        let mut d: Vec<Value> = r
            .iter()
            .filter(|r| meta(&r.doc, "name") != Some("moor-key-rotation"))
            .map(|r| r.doc.clone())
            .collect();
        d.sort_by_key(ToString::to_string);
        d
    };
    assert_eq!(docs(&rotation), docs(&want));
    assert_eq!(rotation.len(), want.len() + 2);
}
