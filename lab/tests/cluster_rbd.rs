//! Ceph RBD volumes beside local ones, one install, on a real Kubernetes (the cluster
//! `.ci/cluster up DIR` brings up with `MOOR_CLUSTER_CEPH_ENV` naming a Ceph cluster of
//! `.ci/ceph-cluster`: moor installed by `deploy/examples/rbd`, the StorageClass `moor-rbd`;
//! run with `MOOR_CLUSTER_ENV=DIR/env`; without a cluster, or without Ceph in it, each test says
//! it is skipped). The nodes have no kernel RBD client: moor-node maps with rbd-fuse and a loop
//! device, in its container.
//!
//! The two tests share the nodes (one cordons them, the other cuts one off): they run one at a
//! time.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use moor_lab::kube::{Cluster, READ, WRITE, claim, pod};
use serde_json::Value;

/// How long anything the cluster does may take: a claim bound, a pod running, a volume gone.
const DEADLINE: Duration = Duration::from_secs(300);
/// One test at a time: they cordon and cut off nodes.
static NODES: Mutex<()> = Mutex::new(());

fn s(v: &Value) -> &str {
    v.as_str().unwrap_or_default()
}

/// The cluster, when it has Ceph: with its RBD StorageClass.
fn cluster(test: &str) -> Option<(Cluster, String)> {
    let c = Cluster::from_env(test)?;
    let Some(class) = c.vars.get("MOOR_CLUSTER_RBD_STORAGE_CLASS").cloned() else {
        eprintln!(
            "{test}: skipped: the cluster has no Ceph (.ci/cluster up with MOOR_CLUSTER_CEPH_ENV)"
        );
        return None;
    };
    Some((c, class))
}

/// The VolumeAttachments of a PV: node → attached.
fn attachments(c: &Cluster, pv: &str) -> BTreeMap<String, bool> {
    c.get(None, "volumeattachments")
        .and_then(|l| l["items"].as_array().cloned())
        .unwrap_or_default()
        .iter()
        .filter(|a| a["spec"]["source"]["persistentVolumeName"] == pv)
        .map(|a| {
            (
                s(&a["spec"]["nodeName"]).to_owned(),
                a["status"]["attached"] == true,
            )
        })
        .collect()
}

/// The PV of a bound claim: its name and volume id, checked to be an RBD volume of moor's that
/// any node may use (no node affinity).
fn rbd_pv(c: &Cluster, namespace: &str, claim: &str) -> (String, String) {
    let pvc = c
        .get(Some(namespace), &format!("pvc/{claim}"))
        .expect("the claim");
    assert_eq!(pvc["status"]["phase"], "Bound", "{pvc}");
    let name = s(&pvc["spec"]["volumeName"]).to_owned();
    let pv = c.get(None, &format!("pv/{name}")).expect("the volume");
    assert_eq!(pv["spec"]["csi"]["driver"], "moor.csi.io", "{pv}");
    assert!(
        s(&pv["spec"]["csi"]["volumeHandle"]).starts_with("rbd/ceph/"),
        "an RBD volume of the cluster ceph: {pv}"
    );
    assert!(
        pv["spec"]["nodeAffinity"].is_null(),
        "an RBD volume is pinned to no node: {pv}"
    );
    (name, s(&pv["spec"]["csi"]["volumeHandle"]).to_owned())
}

#[test]
fn an_rbd_volume_follows_its_pod_to_another_node() {
    let Some((c, class)) = cluster("cluster_rbd") else {
        return;
    };
    let _nodes = NODES
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let ns = c.namespace("moor-rbd-move");
    let n = ns.name.as_str();
    let (first, second) = (&c.nodes[0], &c.nodes[1]);

    ns.apply(&claim("data", &class, 256, None));
    let start = Instant::now();
    ns.apply(&pod("writer", "data", &c.busybox, WRITE, Some(first)));
    c.wait_pod_ready(n, "writer", DEADLINE);
    eprintln!(
        "cluster_rbd: an RBD claim to its pod Running on {first} with 4 MiB written and fsynced: {:.1}s",
        start.elapsed().as_secs_f64()
    );
    let (pv, _) = rbd_pv(&c, n, "data");
    assert_eq!(
        attachments(&c, &pv),
        BTreeMap::from([(first.clone(), true)]),
        "attached at {first}"
    );

    // The pod goes: kubelet unstages (moor-node unmaps: rbd-fuse and its loop device go), the
    // attachment goes (ControllerUnpublishVolume: nothing to fence, nobody holds the image).
    c.ok(&["delete", "-n", n, "pod/writer", "--wait=true"]);
    c.wait_until(
        &format!("the VolumeAttachment of {pv} at {first} to go"),
        DEADLINE,
        || attachments(&c, &pv).is_empty().then_some(()),
    );

    // A pod on another node (a kubelet in namespaces of its own) reads what the first wrote.
    let start = Instant::now();
    ns.apply(&pod("reader", "data", &c.busybox, READ, Some(second)));
    let phase = c.wait_pod_finished(n, "reader", DEADLINE);
    assert_eq!(
        phase,
        "Succeeded",
        "the reader on {second}: {}\n{}",
        c.logs(n, "reader"),
        c.describe(n, "pod/reader")
    );
    eprintln!(
        "cluster_rbd: the volume moved from {first} to {second}, a pod there read it: {:.1}s",
        start.elapsed().as_secs_f64()
    );
    assert_eq!(
        attachments(&c, &pv),
        BTreeMap::from([(second.clone(), true)]),
        "attached at {second} now"
    );
}

/// The writer of the dead-node test: appends numbered lines, each fsynced (`sync FILE`: not
/// sync(2), which would also wait on the dead node's filesystem, in the kernel the simulated
/// nodes share), to /data/log, having
/// noted how many lines it found (`/data/seen.<pod>`, before its first line); Ready once it
/// has written its first.
const APPEND: &str = "set -e
me=$(hostname)
touch /data/log
wc -l < /data/log > /data/seen.$me
i=0
while :; do
  i=$((i + 1))
  echo \"$me $i\" >> /data/log
  sync /data/log
  [ $i -gt 1 ] || touch /data/ready.$me
  sleep 0.2
done";

/// The check at the end (after `first=<pod> second=<pod>` lines): every line of the first
/// writer comes before the first of the second, numbered 1..N without a gap, and N is what the
/// second writer found when it started. Prints N.
const CHECK: &str = "set -e
seen=$(cat /data/seen.$second)
awk -v a=\"$first\" -v b=\"$second\" -v seen=\"$seen\" '
  $1 == a { if (sb) { print \"a line of the first writer after the second: \" $0; bad = 1 }
            na++; if ($2 != na) { print \"line \" NR \": \" $0 \", expected \" a \" \" na; bad = 1 } }
  $1 == b { sb = 1 }
  $1 != a && $1 != b { print \"a stray line \" NR \": \" $0; bad = 1 }
  END { if (na != seen) { print \"the first writer wrote \" na \" lines, the second found \" seen; bad = 1 }
        if (!sb) { print \"no line of the second writer\"; bad = 1 }
        print \"lines of the first writer: \" na \", as the second found\"; exit bad }' /data/log
touch /data/done";

/// A Deployment of one pod running [`APPEND`] with the claim at /data, on `nodes` only.
fn appender(claim: &str, image: &str, nodes: &[&String]) -> String {
    let script: String = APPEND
        .lines()
        .map(|l| format!("                {l}\n"))
        .collect();
    let nodes = nodes
        .iter()
        .map(|n| format!("\"{n}\""))
        .collect::<Vec<_>>()
        .join(", ");
    format!(
        "apiVersion: apps/v1
kind: Deployment
metadata: {{name: db}}
spec:
  replicas: 1
  strategy: {{type: Recreate}}
  selector: {{matchLabels: {{app: db}}}}
  template:
    metadata: {{labels: {{app: db}}}}
    spec:
      terminationGracePeriodSeconds: 5
      affinity:
        nodeAffinity:
          requiredDuringSchedulingIgnoredDuringExecution:
            nodeSelectorTerms:
              - matchExpressions:
                  - {{key: kubernetes.io/hostname, operator: In, values: [{nodes}]}}
      containers:
        - name: c
          image: {image}
          imagePullPolicy: Never
          command:
            - sh
            - -c
            - |
{script}          readinessProbe:
            exec: {{command: [sh, -c, 'test -f /data/ready.$(hostname)']}}
            periodSeconds: 1
          volumeMounts: [{{name: data, mountPath: /data}}]
      volumes: [{{name: data, persistentVolumeClaim: {{claimName: {claim}}}}}]
"
    )
}

/// The Deployment's pods: (name, node, ready), not those being deleted.
fn db_pods(c: &Cluster, namespace: &str) -> Vec<(String, String, bool)> {
    c.get(Some(namespace), "pods")
        .and_then(|l| l["items"].as_array().cloned())
        .unwrap_or_default()
        .iter()
        .filter(|p| p["metadata"]["labels"]["app"] == "db")
        .filter(|p| p["metadata"]["deletionTimestamp"].is_null())
        .map(|p| {
            let ready = p["status"]["conditions"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|c| c["type"] == "Ready" && c["status"] == "True");
            (
                s(&p["metadata"]["name"]).to_owned(),
                s(&p["spec"]["nodeName"]).to_owned(),
                ready,
            )
        })
        .collect()
}

/// A node cut off (`node-cut`) and tainted out of service, put back (`node-join`, the taint
/// removed) when dropped: also when the test fails half-way.
struct CutNode<'a> {
    cluster: &'a Cluster,
    node: String,
    joined: bool,
}

impl CutNode<'_> {
    fn join(&mut self) {
        self.joined = true;
        self.cluster.node_power("node-join", &self.node);
    }
}

impl Drop for CutNode<'_> {
    fn drop(&mut self) {
        if !self.joined {
            self.cluster.node_power("node-join", &self.node);
        }
        let _ = self.cluster.kubectl(&[
            "taint",
            "node",
            &self.node,
            "node.kubernetes.io/out-of-service-",
        ]);
    }
}

fn node_ready(c: &Cluster, node: &str) -> bool {
    c.get(None, &format!("node/{node}")).is_some_and(|n| {
        n["status"]["conditions"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|c| c["type"] == "Ready" && c["status"] == "True")
    })
}

/// The Ceph cluster's blocklist (`ceph osd blocklist ls` as its admin): (address, expiry).
fn blocklist(c: &Cluster) -> Vec<(String, String)> {
    let env = &c.vars["MOOR_CLUSTER_CEPH_ENV"];
    let text = std::fs::read_to_string(env).expect("the Ceph cluster's env file");
    let conf = text
        .lines()
        .find_map(|l| l.strip_prefix("export MOOR_CEPH_CONF="))
        .expect("MOOR_CEPH_CONF in the Ceph env file");
    let out = std::process::Command::new("ceph")
        .args(["-c", conf, "-n", "client.admin", "--connect-timeout", "10"])
        .args(["osd", "blocklist", "ls"])
        .output()
        .expect("ceph");
    assert!(out.status.success(), "ceph osd blocklist ls: {out:?}");
    // "ADDR EXPIRY" lines (the count goes to stderr).
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_once(' '))
        .map(|(a, e)| (a.to_owned(), e.trim().to_owned()))
        .collect()
}

/// The node's mounts whose target names the volume (kubelet's staging and pod mounts).
fn volume_mounts(c: &Cluster, node: &str, pv: &str) -> Vec<String> {
    c.node_mounts(node)
        .into_iter()
        .filter(|(target, _, _)| target.contains(pv))
        .map(|(target, source, fstype)| format!("{target} {source} {fstype}"))
        .collect()
}

/// Non-graceful node shutdown with an RBD volume (issue 38, point 3): the field's reports are
/// ceph-csi's on nodes that died holding a volume (a pod stuck Terminating, its replacement
/// waiting six minutes for the force-detach, Multi-Attach errors; and the dead node writing
/// again once it is back: ceph-csi #4271, #2616's kin), which KEP-2268 (non-graceful node
/// shutdown, the `node.kubernetes.io/out-of-service` taint, GA in 1.28) answers on the
/// Kubernetes side and fencing on the driver's. The node running the pod is cut off
/// (`node-cut`: its kubelet and kube-proxy killed, its link down: it reaches neither the API
/// server nor Ceph, while its pod, moor-node and rbd-fuse live on and go on trying to write, the
/// worst kind of dead); once it is NotReady the operator taints it out of service; the pod is
/// re-created on another node and Running long before the six-minute force-detach; the
/// ControllerUnpublishVolume of the force-detach fences the dead node's client (a blocklist
/// entry of moor's, a week long); the node comes back and cleans up by itself (kubelet and
/// moor-node unstage, rbd-fuse's flush refused), and nothing it wrote after the fence is on the
/// volume.
#[test]
fn a_node_that_died_holding_an_rbd_volume_is_fenced_and_its_pod_runs_elsewhere() {
    let Some((c, class)) = cluster("cluster_rbd") else {
        return;
    };
    let _nodes = NODES
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let ns = c.namespace("moor-rbd-dead");
    let n = ns.name.as_str();
    // A node of its own network namespace dies (node-1 is the host's: it cannot be cut off);
    // its pod moves to another one of them.
    let dead = c.nodes.last().expect("nodes").clone();
    let others: Vec<&String> = c.nodes[1..c.nodes.len() - 1].iter().collect();
    assert!(
        !others.is_empty(),
        "the test needs three nodes: {:?}",
        c.nodes
    );
    let mut allowed = others.clone();
    allowed.push(&dead);

    // The pod starts on the node that will die: the others are cordoned meanwhile.
    ns.apply(&claim("db", &class, 256, None));
    for o in &others {
        c.ok(&["cordon", o]);
    }
    ns.apply(&appender("db", &c.busybox, &allowed));
    let first = c.wait_until("the writer Ready", DEADLINE, || {
        db_pods(&c, n)
            .into_iter()
            .find(|(_, _, ready)| *ready)
            .map(|(name, node, _)| (name, node))
    });
    for o in &others {
        c.ok(&["uncordon", o]);
    }
    assert_eq!(first.1, dead, "the writer runs on {dead}");
    let (pv, handle) = rbd_pv(&c, n, "db");
    c.wait_until("the writer to have synced 10 lines", DEADLINE, || {
        let out = c.exec(n, &first.0, "c", &["wc", "-l", "/data/log"]);
        let lines: u32 = String::from_utf8_lossy(&out.stdout)
            .split_whitespace()
            .next()?
            .parse()
            .ok()?;
        (lines >= 10).then_some(())
    });

    // The node dies.
    let cut = Instant::now();
    c.node_power("node-cut", &dead);
    let mut cut_node = CutNode {
        cluster: &c,
        node: dead.clone(),
        joined: false,
    };
    c.wait_until(&format!("{dead} NotReady"), DEADLINE, || {
        (!node_ready(&c, &dead)).then_some(())
    });
    let not_ready = cut.elapsed();

    // The operator marks it out of service (KEP-2268).
    let taint = Instant::now();
    c.ok(&[
        "taint",
        "node",
        &dead,
        "node.kubernetes.io/out-of-service=nodeshutdown:NoExecute",
    ]);
    // The pod is deleted, the volume force-detached from the dead node (the controller fences
    // it), attached on another: the new pod Running. The six-minute force-detach would come
    // after this deadline.
    let replacement = || {
        db_pods(&c, n)
            .into_iter()
            .find(|(name, node, ready)| *ready && *name != first.0 && *node != dead)
            .map(|(name, node, _)| (name, node))
    };
    let second = loop {
        if let Some(r) = replacement() {
            break r;
        }
        assert!(
            taint.elapsed() < Duration::from_secs(240),
            "waited 240s for the writer's replacement Ready on another node (the 6-minute \
             force-detach would come later): {}\n{}",
            c.describe(n, "pods"),
            c.ok(&["get", "volumeattachments", "-o", "wide"])
        );
        std::thread::sleep(Duration::from_millis(500));
    };
    let moved = taint.elapsed();
    eprintln!(
        "cluster_rbd: {dead} cut off; NotReady after {:.1}s; out-of-service taint to the \
         replacement Running on {}: {:.1}s",
        not_ready.as_secs_f64(),
        second.1,
        moved.as_secs_f64()
    );
    assert_eq!(
        attachments(&c, &pv),
        BTreeMap::from([(second.1.clone(), true)]),
        "attached at {} only",
        second.1
    );

    // Fenced by moor: the dead node's client (its address, a kubelet in a namespace of its
    // own: NET.N) blocklisted for --rbd-fence-expiry (a week), not the hour of a lock librbd
    // breaks itself.
    let dead_ip = c
        .get(None, &format!("node/{dead}"))
        .and_then(|nd| {
            nd["status"]["addresses"]
                .as_array()?
                .iter()
                .find(|a| a["type"] == "InternalIP")
                .map(|a| s(&a["address"]).to_owned())
        })
        .expect("the dead node's address");
    let entries = blocklist(&c);
    let fenced: Vec<_> = entries
        .iter()
        .filter(|(a, _)| a.starts_with(&format!("{dead_ip}:")))
        .collect();
    assert!(
        !fenced.is_empty(),
        "a blocklist entry for {dead} ({dead_ip}): {entries:?}"
    );
    let week_on = chrono_days_from_now(6);
    assert!(
        fenced.iter().any(|(_, e)| e.as_str() > week_on.as_str()),
        "moor's fence lasts a week (later than {week_on}): {fenced:?}"
    );

    // The node comes back: its kubelet finds the pod gone and unstages; moor-node lets the
    // fenced mapping go (rbd-fuse's flush is refused by the OSDs).
    let back = Instant::now();
    cut_node.join();
    c.wait_until(
        &format!("{dead} to let the volume go: no mount of {pv} there"),
        DEADLINE,
        || volume_mounts(&c, &dead, &pv).is_empty().then_some(()),
    );
    eprintln!(
        "cluster_rbd: {dead} back: its mounts of the volume gone after {:.1}s",
        back.elapsed().as_secs_f64()
    );
    let node_pod = c.moor_node_pod(&dead);
    let status = || {
        c.exec(
            "moor-system",
            &node_pod,
            "moor-node",
            &["moorctl", "status", "-o", "json"],
        )
    };
    c.wait_until_or(
        &format!("moor-node on {dead} to hold nothing of {handle} (moorctl status)"),
        DEADLINE,
        || {
            let out = status();
            let text = String::from_utf8_lossy(&out.stdout).into_owned();
            (out.status.success() && !text.contains(&handle)).then_some(())
        },
        || {
            let out = status();
            let log = c.kubectl(&[
                "logs",
                "-n",
                "moor-system",
                &node_pod,
                "-c",
                "moor-node",
                "--tail",
                "120",
            ]);
            format!(
                "moorctl status: {}{}\nmoor-node's log, its end:\n{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr),
                String::from_utf8_lossy(&log.stdout)
            )
        },
    );

    // What is on the volume: the first writer's lines up to what the second found, nothing
    // after. Read by a fresh mount (the writer stopped, the volume unstaged everywhere).
    c.ok(&["scale", "-n", n, "deployment/db", "--replicas=0"]);
    c.wait_until("the writer gone and the volume detached", DEADLINE, || {
        (db_pods(&c, n).is_empty() && attachments(&c, &pv).is_empty()).then_some(())
    });
    let check = format!("first={}\nsecond={}\n{CHECK}", first.0, second.0);
    ns.apply(&pod("check", "db", &c.busybox, &check, Some(&c.nodes[0])));
    let phase = c.wait_pod_finished(n, "check", DEADLINE);
    let log = c.logs(n, "check");
    assert_eq!(phase, "Succeeded", "the volume after the fence: {log}");
    eprintln!("cluster_rbd: the volume after the fence: {}", log.trim());
}

/// The date `days` from now as `ceph osd blocklist ls` prints expiries (`YYYY-MM-DDT...`),
/// to the day: compared as text.
fn chrono_days_from_now(days: u64) -> String {
    let out = std::process::Command::new("date")
        .args(["-u", "-d", &format!("+{days} days"), "+%Y-%m-%dT%H:%M:%S"])
        .output()
        .expect("date");
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}
