use serde_json::json;

use super::*;

fn group(name: &str, driver: &str, handles: &[&str], labels: Value) -> Value {
    json!({
        "metadata": { "name": name, "labels": labels },
        "spec": { "driver": driver, "source": { "volumeHandles": handles } },
    })
}

const D: &str = "local.moor.csi.io";

#[test]
fn a_group_is_marked_by_the_node_of_its_first_member() {
    let list = json!({ "items": [
        group("home", D, &["vol-1@node-2", "vol-2@node-2"], json!(null)),
        // Members elsewhere: still node-2's, whose controller refuses it with the reason.
        group("split", D, &["vol-3@node-2", "vol-4@node-3"], json!({})),
        group("theirs", D, &["vol-5@node-3", "vol-6@node-2"], json!({})),
        group("marked", D, &["vol-7@node-2"], json!({ MANAGED_BY: "node-2" })),
        group("other-driver", "moor.csi.io", &["vol-8@node-2"], json!({})),
        // A longer node name that ends the same is another node.
        group("suffix", D, &["vol-9@xnode-2"], json!({})),
        group("bare", D, &["vol-10"], json!({})),
    ]});
    let none = HashMap::new();
    assert_eq!(
        ours(Kind::Group, &list, &none, D, "node-2"),
        ["home", "split"]
    );
    assert_eq!(ours(Kind::Group, &list, &none, D, "node-3"), ["theirs"]);
}

#[test]
fn pre_provisioned_contents_are_marked_by_their_handles() {
    let list = json!({ "items": [
        { "metadata": { "name": "g" }, "spec": { "driver": D, "source": {
            "groupSnapshotHandles": {
                "volumeGroupSnapshotHandle": "group-1@node-1",
                "volumeSnapshotHandles": ["snap-1@node-1"] } } } },
    ]});
    assert_eq!(
        ours(Kind::Group, &list, &HashMap::new(), D, "node-1"),
        ["g"]
    );
    let list = json!({ "items": [
        { "metadata": { "name": "dynamic" }, "spec": { "driver": D,
            "source": { "volumeHandle": "vol-1@node-1" } } },
        { "metadata": { "name": "by-hand" }, "spec": { "driver": D,
            "source": { "snapshotHandle": "snap-2@node-1" } } },
        { "metadata": { "name": "elsewhere" }, "spec": { "driver": D,
            "source": { "snapshotHandle": "snap-3@node-2" } } },
    ]});
    assert_eq!(
        ours(Kind::Snapshot, &list, &HashMap::new(), D, "node-1"),
        ["dynamic", "by-hand"]
    );
    assert!(ours(Kind::Snapshot, &json!({}), &HashMap::new(), D, "node-1").is_empty());
}

#[test]
fn the_patch_sets_the_label_only() {
    assert_eq!(
        label_patch("node-2"),
        json!({ "metadata": { "labels": { "snapshot.storage.kubernetes.io/managed-by": "node-2" } } })
    );
}

#[test]
fn answers_are_parsed() {
    let (status, body) =
        parse_answer(b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\n\r\n{\"a\":1}")
            .unwrap();
    assert_eq!((status, body), (200, &b"{\"a\":1}"[..]));
    let (status, _) = parse_answer(b"HTTP/1.1 403 Forbidden\r\n\r\n").unwrap();
    assert_eq!(status, 403);
    assert!(parse_answer(b"HTTP/1.0 200 OK\r\n").is_err());
    assert!(parse_answer(b"garbage\r\n\r\n").is_err());
}

#[test]
fn outside_a_pod_the_environment_is_named() {
    let e = InCluster::new(
        "127.0.0.1".into(),
        6443,
        Path::new("/nonexistent/ca.crt"),
        "/nonexistent/token".into(),
    )
    .unwrap_err();
    assert!(e.to_string().contains("/nonexistent/ca.crt"), "{e}");
}

fn class(name: &str, driver: &str, node: Option<&str>) -> Value {
    let labels = node.map_or_else(|| json!({}), |n| json!({ MANAGED_BY: n }));
    json!({
        "metadata": { "name": name, "labels": labels },
        "driver": driver,
        "deletionPolicy": "Delete",
        "parameters": { "a": "b" },
    })
}

#[test]
fn each_node_publishes_its_copy_of_the_drivers_group_classes() {
    let classes = json!({ "items": [
        class("moor-local", D, None),
        class("moor-local-node-1", D, Some("node-1")),
        class("moor", "moor.csi.io", None),
    ]});
    // node-1 has its copy already; node-2 makes one, labelled with it, the same otherwise.
    assert!(class_copies(&classes, D, "node-1").is_empty());
    assert_eq!(
        class_copies(&classes, D, "node-2"),
        [json!({
            "apiVersion": "groupsnapshot.storage.k8s.io/v1",
            "kind": "VolumeGroupSnapshotClass",
            "metadata": { "name": "moor-local-node-2", "labels": { MANAGED_BY: "node-2" } },
            "driver": D,
            "deletionPolicy": "Delete",
            "parameters": { "a": "b" },
        })]
    );
    let nodes = class_nodes(&classes, D);
    assert_eq!(nodes.len(), 1);
    assert_eq!(nodes["moor-local-node-1"], "node-1");
}

#[test]
fn a_group_of_a_nodes_class_is_that_nodes_whatever_its_members() {
    let mut g = group("g", D, &["vol-1@node-1", "vol-2@node-2"], json!({}));
    g["spec"]["volumeGroupSnapshotClassName"] = json!("moor-local-node-2");
    let list = json!({ "items": [g] });
    let classes = HashMap::from([("moor-local-node-2".to_owned(), "node-2".to_owned())]);
    assert_eq!(ours(Kind::Group, &list, &classes, D, "node-2"), ["g"]);
    assert!(ours(Kind::Group, &list, &classes, D, "node-1").is_empty());
    // A class of no node: its first member's.
    assert_eq!(
        ours(Kind::Group, &list, &HashMap::new(), D, "node-1"),
        ["g"]
    );
}

#[test]
fn a_claims_rotation_schedule_wins_over_its_volumes() {
    let pv = |handle: &str, driver: &str, claim: &str, schedule: Option<&str>| {
        json!({
            "metadata": { "name": format!("pv-{handle}"), "annotations":
                schedule.map(|s| json!({ KEY_ROTATION_SCHEDULE_ANNOTATION: s })) },
            "spec": { "csi": { "driver": driver, "volumeHandle": handle },
                      "claimRef": { "namespace": "apps", "name": claim } },
        })
    };
    let pvc = |name: &str, schedule: &str| {
        json!({ "metadata": { "namespace": "apps", "name": name, "annotations":
            { KEY_ROTATION_SCHEDULE_ANNOTATION: schedule } } })
    };
    let pvs = json!({ "items": [
        pv("vol-1", D, "db", Some("@weekly")),
        pv("vol-2", D, "cache", Some("@daily")),
        pv("vol-3", D, "logs", None),
        pv("vol-4", "other.csi.io", "db", Some("1h")),
    ]});
    let pvcs = json!({ "items": [pvc("db", "12h"), pvc("elsewhere", "1d")] });
    let got = rotation_schedules(&pvs, &pvcs, D);
    let want: std::collections::BTreeMap<String, Option<String>> = [
        ("vol-1", Some("12h")),
        ("vol-2", Some("@daily")),
        ("vol-3", None),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.map(str::to_owned)))
    .collect();
    assert_eq!(got, want);
}
