//! moor on a real Kubernetes (run as root against the cluster `.ci/cluster up DIR` brings up,
//! with `MOOR_CLUSTER_ENV=DIR/env`; without one, each test says it is skipped): moor installed
//! by its manifests (`kubectl apply -k`), its image and the CSI sidecars' run by containerd
//! under kubelet, and everything asked of it through the API, as a user would, then checked on
//! the node (its mounts and files, through `.ci/cluster exec`) and with moorctl in moor-node's
//! container, as an operator would.

use std::time::{Duration, Instant};

use moor_lab::kube::{Cluster, READ, WRITE, claim, pod};
use moor_runtime::contract::{BACKING_FILE_KEY, DEVICE_PATH_KEY};
use serde_json::Value;

const DRIVER: &str = "moor.csi.io";
/// How long anything the cluster does may take: a claim bound, a pod running, a volume gone.
const DEADLINE: Duration = Duration::from_secs(300);

fn s(v: &Value) -> &str {
    v.as_str().unwrap_or_default()
}

/// The VolumeAttachment of a PV, if any.
fn attachment(c: &Cluster, pv: &str) -> Option<Value> {
    c.get(None, "volumeattachments")?["items"]
        .as_array()?
        .iter()
        .find(|a| a["spec"]["source"]["persistentVolumeName"] == pv)
        .cloned()
}

#[test]
fn a_volume_life_through_the_api() {
    let Some(c) = Cluster::from_env("cluster") else {
        return;
    };
    let ns = c.namespace("moor-life");
    let n = ns.name.as_str();
    let node = c.controller_node.clone();

    // The StorageClass binds on first use: no volume until a pod needs the claim.
    ns.apply(&claim("data", &c.storage_class, 256, None));
    let pvc = c.get(Some(n), "pvc/data").expect("the claim");
    assert_eq!(pvc["status"]["phase"], "Pending", "{pvc}");
    assert!(pvc["spec"]["volumeName"].is_null(), "{pvc}");

    // A pod writes and fsyncs: Ready once its data is on the volume.
    let start = Instant::now();
    ns.apply(&pod("writer", "data", &c.busybox, WRITE, None));
    c.wait_pod_ready(n, "writer", DEADLINE);
    eprintln!(
        "cluster: claim to a Running pod that has written and fsynced its data: {:.1}s",
        start.elapsed().as_secs_f64()
    );

    // The claim is bound to a moor volume on the controller's node, where the pod runs.
    let pvc = c.get(Some(n), "pvc/data").expect("the claim");
    assert_eq!(pvc["status"]["phase"], "Bound", "{pvc}");
    let pv_name = s(&pvc["spec"]["volumeName"]).to_owned();
    let pv = c.get(None, &format!("pv/{pv_name}")).expect("the volume");
    assert_eq!(pv["spec"]["csi"]["driver"], DRIVER, "{pv}");
    assert_eq!(pv["spec"]["csi"]["fsType"], "ext4", "{pv}");
    let handle = s(&pv["spec"]["csi"]["volumeHandle"]).to_owned();
    let terms = &pv["spec"]["nodeAffinity"]["required"]["nodeSelectorTerms"];
    assert!(
        terms.to_string().contains(&format!("\"{node}\"")),
        "the volume is pinned to {node}: {terms}"
    );
    let writer = c.get(Some(n), "pod/writer").expect("the writer");
    assert_eq!(writer["spec"]["nodeName"], node.as_str(), "{writer}");

    // Attached to that node, as a loop device over a file of the controller's data dir.
    let va = attachment(&c, &pv_name).expect("a VolumeAttachment");
    assert_eq!(va["spec"]["nodeName"], node.as_str(), "{va}");
    assert_eq!(va["status"]["attached"], true, "{va}");
    let device = s(&va["status"]["attachmentMetadata"][DEVICE_PATH_KEY]).to_owned();
    let backing = s(&va["status"]["attachmentMetadata"][BACKING_FILE_KEY]).to_owned();
    assert!(device.starts_with("/dev/loop"), "{va}");
    assert!(
        c.on_node(&node, &["test", "-f", &backing]).status.success(),
        "{backing} on {node}"
    );

    // kubelet's mount of it for the pod, seen in the node's mount namespace.
    let target = format!(
        "/var/lib/kubelet/pods/{}/volumes/kubernetes.io~csi/{pv_name}/mount",
        s(&writer["metadata"]["uid"])
    );
    let mounts = c.node_mounts(&node);
    let mount = mounts.iter().find(|(t, ..)| *t == target);
    assert_eq!(
        mount.map(|(_, src, fs)| (src.as_str(), fs.as_str())),
        Some((device.as_str(), "ext4")),
        "{target} on {node}: {mounts:?}"
    );

    // What the pod wrote, read in the pod.
    let hello = c.exec(n, "writer", "c", &["cat", "/data/hello"]);
    assert_eq!(
        String::from_utf8_lossy(&hello.stdout),
        "written by the writer\n"
    );

    // An operator asks the node what it holds: moorctl in moor-node's container.
    let moor_node = c.moor_node_pod(&node);
    let status = c.exec(
        "moor-system",
        &moor_node,
        "moor-node",
        &["moorctl", "status", "-o", "json"],
    );
    let report = String::from_utf8_lossy(&status.stdout);
    assert!(
        status.status.success() && report.contains(&handle) && report.contains(&target),
        "moorctl status on {node} ({}): {report}{}",
        status.status,
        String::from_utf8_lossy(&status.stderr)
    );

    // The pod goes: its mount and the attachment go; the file stays.
    c.ok(&[
        "delete",
        "-n",
        n,
        "pod/writer",
        "--wait=true",
        "--timeout=300s",
    ]);
    c.wait_until(
        &format!("the mount of {pv_name} to leave {node}"),
        DEADLINE,
        || {
            (!c.node_mounts(&node)
                .iter()
                .any(|(t, ..)| t.contains(&pv_name)))
            .then_some(())
        },
    );
    c.wait_until(
        &format!("the VolumeAttachment of {pv_name} to go"),
        DEADLINE,
        || attachment(&c, &pv_name).is_none().then_some(()),
    );
    assert!(
        c.on_node(&node, &["test", "-f", &backing]).status.success(),
        "{backing} is kept while the claim is"
    );

    // Another pod finds the data as the writer left it: it outlived unpublish, unstage, detach.
    ns.apply(&pod("reader", "data", &c.busybox, READ, None));
    let phase = c.wait_pod_finished(n, "reader", DEADLINE);
    assert_eq!(
        phase,
        "Succeeded",
        "the reader: {}{}",
        c.logs(n, "reader"),
        c.describe(n, "pod/reader")
    );
    c.ok(&[
        "delete",
        "-n",
        n,
        "pod/reader",
        "--wait=true",
        "--timeout=300s",
    ]);

    // The claim goes: the volume goes with it (reclaim policy Delete), and its file.
    c.ok(&[
        "delete",
        "-n",
        n,
        "pvc/data",
        "--wait=true",
        "--timeout=300s",
    ]);
    c.wait_gone(None, &format!("pv/{pv_name}"), DEADLINE);
    assert!(
        !c.on_node(&node, &["test", "-e", &backing]).status.success(),
        "{backing} is removed with its volume"
    );
    let loop_file = c.on_node(&node, &["losetup", "-n", "-O", "BACK-FILE", &device]);
    assert!(
        !String::from_utf8_lossy(&loop_file.stdout).contains(&backing),
        "{device} is detached from {backing}"
    );
}

/// A read-only view of a moor-node container's state dir, over it (a bind of it made read-only:
/// the dir itself, which moor-node holds files of open for writing, cannot be); undone when
/// dropped after a failure.
struct ReadOnly<'a> {
    c: &'a Cluster,
    pod: String,
}

impl<'a> ReadOnly<'a> {
    fn over(c: &'a Cluster, pod: &str) -> Self {
        let ro = Self {
            c,
            pod: pod.to_owned(),
        };
        let out = ro.sh(
            "mount --bind /var/lib/moor /var/lib/moor && mount -o remount,bind,ro /var/lib/moor",
        );
        assert!(
            out.status.success(),
            "a read-only state dir in {pod}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        ro
    }

    fn sh(&self, script: &str) -> std::process::Output {
        self.c
            .exec("moor-system", &self.pod, "moor-node", &["sh", "-c", script])
    }

    /// The state dir writable again.
    fn undo(&self) -> std::process::Output {
        self.sh("umount /var/lib/moor")
    }
}

impl Drop for ReadOnly<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let _ = self.undo();
        }
    }
}

/// The pod's Ready condition.
fn ready(c: &Cluster, namespace: &str, pod: &str) -> Option<bool> {
    let p = c.get(Some(namespace), &format!("pod/{pod}"))?;
    p["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == "Ready")
        .map(|c| c["status"] == "True")
}

#[test]
fn moor_node_is_not_ready_while_it_cannot_write_its_journal() {
    let Some(c) = Cluster::from_env("cluster") else {
        return;
    };
    // Not the controller's node, whose moor-node the other test's volume needs.
    let Some(node) = c.nodes.iter().find(|n| **n != c.controller_node).cloned() else {
        eprintln!("cluster: skipped: one node only, the controller's");
        return;
    };
    let pod = c.moor_node_pod(&node);
    c.wait_pod_ready("moor-system", &pod, DEADLINE);
    // Its state dir read-only in its container: moor-node's /healthz says it is not ready (the
    // CSI Probe would), and so does the kubelet's readiness probe.
    let ro = ReadOnly::over(&c, &pod);
    c.wait_until(&format!("{pod} to be not Ready"), DEADLINE, || {
        (ready(&c, "moor-system", &pod) == Some(false)).then_some(())
    });
    // Writable again: Ready again.
    let out = ro.undo();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    c.wait_pod_ready("moor-system", &pod, DEADLINE);
}
