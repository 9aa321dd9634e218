//! The pure parts of `qos`: kubelet's layouts, the pod of a target path, the kernel's rule
//! text read back.

use super::*;

const UID: &str = "0b6c0e6e-1d3f-4c55-9a8b-2f1e2f3a4b5c";

#[test]
fn kubelets_layouts_are_all_looked_at() {
    let u = UID.replace('-', "_");
    let dirs: Vec<String> = pod_dirs(UID)
        .iter()
        .map(|d| d.display().to_string())
        .collect();
    for want in [
        format!("kubepods/pod{UID}"),
        format!("kubepods/burstable/pod{UID}"),
        format!("kubepods/besteffort/pod{UID}"),
        format!("kubepods.slice/kubepods-pod{u}.slice"),
        format!("kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{u}.slice"),
        format!("kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{u}.slice"),
    ] {
        assert!(dirs.contains(&want), "{want} not in {dirs:?}");
    }
}

#[test]
fn the_pod_of_a_target_path() {
    let k = Path::new("/var/lib/kubelet");
    let mount = k.join(format!("pods/{UID}/volumes/kubernetes.io~csi/pv1/mount"));
    let block = k.join(format!(
        "plugins/kubernetes.io/csi/volumeDevices/publish/pv1/{UID}"
    ));
    assert_eq!(pod_uid_of_target(k, &mount).as_deref(), Some(UID));
    assert_eq!(pod_uid_of_target(k, &block).as_deref(), Some(UID));
    assert_eq!(pod_uid_of_target(k, &k.join("elsewhere/x")), None);
    assert_eq!(pod_uid_of_target(k, &k.join("pods/../volumes/x")), None);
    assert_eq!(
        pod_uid_of_target(Path::new("/other"), &mount),
        None,
        "not under the kubelet dir"
    );
    assert!(!is_pod_uid("a/b") && !is_pod_uid("") && !is_pod_uid(".."));
}

#[test]
fn the_rules_read_back() {
    let v2 = "8:0 rbps=max wbps=100 riops=max wiops=7\n7:7 rbps=1 wbps=max riops=max wiops=max\n";
    assert_eq!(held(v2, (7, 7), None), Ok([Some(1), None, None, None]));
    assert_eq!(held(v2, (8, 0), None), Ok([None, Some(100), None, Some(7)]));
    assert_eq!(held(v2, (9, 9), None), Ok([None; 4]), "no rule: no limit");
    // Keys of io.max that are not limits are passed over.
    assert_eq!(
        held(
            "7:7 rbps=5 wbps=max riops=max wiops=max latency=3\n",
            (7, 7),
            None
        ),
        Ok([Some(5), None, None, None])
    );
    assert!(held("7:7 rbps=five\n", (7, 7), None).is_err());
    assert!(held("7:7 rbps\n", (7, 7), None).is_err());
    let v1 = "8:0 10\n7:7 4096\n";
    assert_eq!(
        held(v1, (7, 7), Some(1)),
        Ok([None, Some(4096), None, None])
    );
    assert!(held("7:7\n", (7, 7), Some(0)).is_err());
    assert!(held("7:7 x\n", (7, 7), Some(0)).is_err());
}

#[test]
fn the_writes_of_each_version() {
    let limits = [Some(1), None, Some(3), None];
    assert_eq!(
        Hierarchy::V2(PathBuf::from("/c")).writes((7, 7), &limits),
        vec![(V2_FILE, "7:7 rbps=1 wbps=max riops=3 wiops=max".to_string())]
    );
    assert_eq!(
        Hierarchy::V1(PathBuf::from("/c")).writes((7, 7), &limits),
        vec![
            (V1_FILES[0], "7:7 1".to_string()),
            (V1_FILES[1], "7:7 0".to_string()),
            (V1_FILES[2], "7:7 3".to_string()),
            (V1_FILES[3], "7:7 0".to_string()),
        ]
    );
}
