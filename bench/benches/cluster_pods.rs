//! A hundred pods (issue 41, point 4): on a real Kubernetes (the cluster `.ci/cluster up DIR`
//! brings up, `MOOR_CLUSTER_ENV=DIR/env`), N claims and N pods created at once, all on one
//! node (node-1), each pod mounting its claim, timed from the creation to every pod Running:
//!
//! * moor: the claims of the class `moor-local` (local.moor.csi.io, the every-node driver the
//!   cluster installs: a thin file on the node, a loop device, ext4), WaitForFirstConsumer;
//! * the reference: the same with kubernetes-csi's `hostpathplugin` (a directory on the node,
//!   bind-mounted), installed by this bench for the run in a namespace of its own as the
//!   csi-driver-host-path manifests do (the plugin, csi-provisioner and the registrar in one
//!   pod on the node) with its own CSIDriver and a WaitForFirstConsumer class, its
//!   csi-provisioner run with the same flags as moor's but capacity.
//!
//! The reference runs first, then moor, each in a namespace of its own, the next run only once
//! the last one's pods, claims and volumes are gone. A pod's time is from the one `kubectl
//! apply` of all the objects to the first poll that sees it Running (polls every 250 ms plus
//! kubectl's own time: a pod's time is that coarse). moor's own call time is read from its
//! daemons' `/metrics` (moor-node and moor-controller of node-1's moor-local pod, on the
//! host's loopback: node-1 is the host's network) before and when every pod runs: every gRPC
//! call they answered in between, summed (the controller's ControllerPublishVolume, made
//! within moor-node's NodeStageVolume, counted once, in the stage), against the sum of the
//! pods' times.
//!
//! Results under `target/criterion/cluster_pods/` for `bench-report`. Run as root beside the
//! cluster: `MOOR_CLUSTER_ENV=DIR/env cargo bench -p moor-bench --bench cluster_pods`.
//! Skipped, with the reason, without a cluster or without hostpathplugin. 100 pods;
//! `MOOR_BENCH_QUICK=1`: 10; `MOOR_PODS=N`: N.

use std::collections::{BTreeMap, HashMap};
use std::io::{Read as _, Write as _};
use std::net::TcpStream;
use std::path::Path;
use std::time::{Duration, Instant};

use moor_bench::quick;
use moor_bench::storm::{hostpathplugin, nanos, nearest_rank, selected, write_result};
use moor_lab::kube::{Cluster, Namespace, claim, pod};

/// The node every pod goes to (the host's network: moor's metrics on its loopback).
const NODE: &str = "node-1";
/// moor's class: the every-node driver's thin local volumes.
const MOOR_CLASS: &str = "moor-local";
const HOSTPATH_DRIVER: &str = "hostpath.csi.k8s.io";
const HOSTPATH_CLASS: &str = "bench-hostpath";
/// moor-node's and moor-controller's `/metrics` in the moor-local pod (deploy/overlays/
/// distributed/local.yaml), on node-1's (the host's) loopback.
const MOOR_METRICS: [&str; 2] = ["127.0.0.1:9811", "127.0.0.1:9812"];
/// How long N pods may take to run, a driver to register, volumes to go.
const DEADLINE: Duration = Duration::from_secs(1200);
const CLAIM_MIB: u64 = 64;
/// The controller's calls made within moor-node's (`--local-controller`), not summed twice.
const NESTED: [&str; 2] = [" ControllerPublishVolume", " ControllerUnpublishVolume"];

fn main() {
    if !selected("cluster_pods") {
        return;
    }
    let Some(cluster) = Cluster::from_env("cluster_pods") else {
        return;
    };
    let Some(program) = hostpathplugin() else {
        return;
    };
    let n: usize = std::env::var("MOOR_PODS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(if quick() { 10 } else { 100 });
    let hostpath = HostPath::install(&cluster, &program);
    let (reference, ()) = run(&cluster, "hostpath", HOSTPATH_CLASS, n, || ());
    report("hostpath", n, &reference);
    drop(hostpath);
    let before = moor_call_seconds();
    let (moor, after) = run(&cluster, "moor", MOOR_CLASS, n, moor_call_seconds);
    report("moor", n, &moor);
    let mut calls = 0.0;
    for (method, s) in &after {
        let d = s - before.get(method).copied().unwrap_or(0.0);
        if d > 0.0 {
            println!("  moor's {method}: {:.3} s", d);
            // moor-node's NodeStageVolume calls the controller beside it to attach the volume
            // (and NodeUnstageVolume to release it): that time is in the node's call already.
            if !NESTED.iter().any(|m| method.ends_with(m)) {
                calls += d;
            }
        }
    }
    let pods: f64 = moor.iter().map(|d| d.as_secs_f64()).sum();
    println!(
        "cluster_pods/moor-{n}: moor's calls {calls:.3} s of the pods' {pods:.1} s ({:.2}%)",
        calls / pods * 100.0
    );
    write_result(&format!("cluster_pods/moor-{n}/calls"), calls * 1e9);
    write_result(&format!("cluster_pods/moor-{n}/pods-sum"), pods * 1e9);
}

/// Writes and prints a run's total (its slowest pod), p50, p99 and max.
fn report(who: &str, n: usize, times: &[Duration]) {
    let mut v = times.to_vec();
    v.sort_unstable();
    let q = |q: f64| v[nearest_rank(v.len(), q)];
    let (p50, p99, max) = (q(0.5), q(0.99), q(1.0));
    let prefix = format!("cluster_pods/{who}-{n}");
    // Every pod starts at the one apply: the total is the last pod's time.
    write_result(&format!("{prefix}/total"), nanos(max));
    write_result(&format!("{prefix}/p50"), nanos(p50));
    write_result(&format!("{prefix}/p99"), nanos(p99));
    println!("{prefix}: all Running after {max:.2?}; a pod's p50 {p50:.2?}, p99 {p99:.2?}");
}

/// N claims of `class` and N pods using them, applied at once in a namespace of their own;
/// each pod's time from the apply to the first poll that saw it Running, and what `at_running`
/// found once all were (before the teardown). Everything is gone (pods, claims, their
/// volumes) when it returns.
fn run<T>(
    c: &Cluster,
    who: &str,
    class: &str,
    n: usize,
    at_running: impl FnOnce() -> T,
) -> (Vec<Duration>, T) {
    let ns = c.namespace(&format!("bench-pods-{who}"));
    let mut yaml = String::new();
    for i in 0..n {
        yaml.push_str(&claim(&format!("c{i}"), class, CLAIM_MIB, None));
        yaml.push_str("---\n");
        yaml.push_str(&pod(
            &format!("p{i}"),
            &format!("c{i}"),
            &c.busybox,
            IDLE,
            Some(NODE),
        ));
        yaml.push_str("---\n");
    }
    let start = Instant::now();
    ns.apply(&yaml);
    let mut running: HashMap<String, Duration> = HashMap::new();
    c.wait_until_or(
        &format!("{n} pods of {who} Running in {}", ns.name),
        DEADLINE,
        || {
            let pods = c.get(Some(&ns.name), "pods")?;
            let now = start.elapsed();
            for p in pods["items"].as_array().into_iter().flatten() {
                if p["status"]["phase"].as_str() == Some("Running") {
                    let name = p["metadata"]["name"].as_str().unwrap_or_default();
                    running.entry(name.to_owned()).or_insert(now);
                }
            }
            (running.len() >= n).then_some(())
        },
        || c.describe(&ns.name, "pods"),
    );
    let found = at_running();
    let times: Vec<Duration> = running.into_values().collect();
    // A straggler (the last pod past twice the median): what the cluster said meanwhile, kept
    // in the output before the namespace and its events go.
    let mut sorted = times.clone();
    sorted.sort_unstable();
    if sorted.last() > sorted.get(nearest_rank(n, 0.5)).map(|m| *m * 2).as_ref() {
        println!(
            "{who}: a straggler; the namespace's events:\n{}",
            c.ok(&["-n", &ns.name, "get", "events", "--sort-by=.lastTimestamp"])
        );
    }
    clear(c, &ns, class);
    (times, found)
}

/// Deletes the namespace's pods and claims and waits until the class has no volume left.
fn clear(c: &Cluster, ns: &Namespace<'_>, class: &str) {
    let timeout = format!("--timeout={}s", DEADLINE.as_secs());
    for kind in ["pods", "pvc"] {
        c.ok(&[
            "-n",
            &ns.name,
            "delete",
            kind,
            "--all",
            "--wait=true",
            &timeout,
        ]);
    }
    c.wait_until(
        &format!("every volume of the class {class} deleted"),
        DEADLINE,
        || {
            // kubectl prints nothing at all when there is no volume.
            let pvs = c.get(None, "pv").unwrap_or_default();
            let left = pvs["items"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|pv| pv["spec"]["storageClassName"].as_str() == Some(class))
                .count();
            (left == 0).then_some(())
        },
    );
}

/// A pod's script: Ready at once, runs until it is stopped.
const IDLE: &str = "touch /data/done
trap 'exit 0' TERM
sleep 1000000 & wait";

/// The seconds moor-node and moor-controller spent answering gRPC calls so far, by daemon and
/// method (`moor_grpc_request_duration_seconds_sum`, every code).
fn moor_call_seconds() -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    for addr in MOOR_METRICS {
        let text =
            http_get(addr, "/metrics").unwrap_or_else(|e| panic!("moor's metrics at {addr}: {e}"));
        for line in text.lines() {
            let Some(rest) = line.strip_prefix("moor_grpc_request_duration_seconds_sum{") else {
                continue;
            };
            let Some((labels, value)) = rest.rsplit_once("} ") else {
                continue;
            };
            let method = labels
                .split(',')
                .find_map(|l| l.strip_prefix("method=\""))
                .map_or("?", |m| m.trim_end_matches('"'));
            let v: f64 = value.trim().parse().unwrap_or(0.0);
            *out.entry(format!("{addr} {method}")).or_insert(0.0) += v;
        }
    }
    out
}

/// The body of a plain HTTP/1.0 GET.
fn http_get(addr: &str, path: &str) -> std::io::Result<String> {
    let mut s = TcpStream::connect(addr)?;
    s.set_read_timeout(Some(Duration::from_secs(30)))?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n")?;
    let mut text = String::new();
    s.read_to_string(&mut text)?;
    Ok(text
        .split_once("\r\n\r\n")
        .map_or(String::new(), |(_, b)| b.to_owned()))
}

/// kubernetes-csi's hostpathplugin installed for the run on [`NODE`]: its namespace (the pod),
/// and the cluster-wide objects, deleted on drop.
struct HostPath<'a> {
    cluster: &'a Cluster,
    ns: Option<Namespace<'a>>,
    cluster_objects: String,
}

impl<'a> HostPath<'a> {
    /// Installs it and waits until its driver is registered on [`NODE`].
    fn install(c: &'a Cluster, program: &Path) -> Self {
        let ns = c.namespace("bench-hostpath");
        let cluster_objects = hostpath_cluster_objects(&ns.name);
        let me = Self {
            cluster: c,
            ns: Some(ns),
            cluster_objects,
        };
        c.apply(&me.cluster_objects);
        let ns = me.ns.as_ref().map_or("", |n| n.name.as_str());
        c.apply_in(Some(ns), &hostpath_pod(program, &c.busybox));
        c.wait_until_or(
            &format!("{HOSTPATH_DRIVER} registered on {NODE} (CSINode)"),
            DEADLINE,
            || {
                let node = c.get(None, &format!("csinode/{NODE}"))?;
                node["spec"]["drivers"]
                    .as_array()?
                    .iter()
                    .any(|d| d["name"].as_str() == Some(HOSTPATH_DRIVER))
                    .then_some(())
            },
            || c.describe(ns, "pods"),
        );
        me
    }
}

impl Drop for HostPath<'_> {
    fn drop(&mut self) {
        // The pod first (its namespace), then what the cluster holds of it.
        drop(self.ns.take());
        let out = self.cluster.kubectl_with(
            &["delete", "--ignore-not-found", "-f", "-"],
            Some(&self.cluster_objects),
        );
        if !out.status.success() {
            eprintln!(
                "deleting hostpathplugin's objects: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }
}

/// hostpathplugin's CSIDriver, class and its provisioner's rights (those of csi-provisioner's
/// upstream RBAC, bound to the namespace's default ServiceAccount).
fn hostpath_cluster_objects(ns: &str) -> String {
    format!(
        "apiVersion: storage.k8s.io/v1
kind: CSIDriver
metadata: {{name: {HOSTPATH_DRIVER}}}
spec:
  attachRequired: false
  podInfoOnMount: true
  fsGroupPolicy: File
  volumeLifecycleModes: [Persistent]
---
apiVersion: storage.k8s.io/v1
kind: StorageClass
metadata: {{name: {HOSTPATH_CLASS}}}
provisioner: {HOSTPATH_DRIVER}
volumeBindingMode: WaitForFirstConsumer
reclaimPolicy: Delete
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {{name: {ns}}}
rules:
  - {{apiGroups: [''], resources: [persistentvolumes], verbs: [get, list, watch, create, delete, patch]}}
  - {{apiGroups: [''], resources: [persistentvolumeclaims], verbs: [get, list, watch, update, patch]}}
  - {{apiGroups: [storage.k8s.io], resources: [storageclasses, csinodes, volumeattachments], verbs: [get, list, watch]}}
  - {{apiGroups: [''], resources: [events], verbs: [list, watch, create, update, patch]}}
  - {{apiGroups: [snapshot.storage.k8s.io], resources: [volumesnapshots, volumesnapshotcontents], verbs: [get, list]}}
  - {{apiGroups: [''], resources: [nodes], verbs: [get, list, watch]}}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {{name: {ns}}}
roleRef: {{apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: {ns}}}
subjects: [{{kind: ServiceAccount, name: default, namespace: {ns}}}]
"
    )
}

/// The plugin's pod on [`NODE`]: hostpathplugin (the binary from this machine, run in the
/// busybox image, whose `mount` it execs), csi-provisioner as moor's runs on each node (but
/// capacity), and the registrar.
fn hostpath_pod(program: &Path, busybox: &str) -> String {
    // A hostPath is absolute and without `..`.
    let program = std::fs::canonicalize(program).unwrap_or_else(|_| program.to_path_buf());
    let program = program.display();
    let socket_dir = format!("/var/lib/kubelet/plugins/{HOSTPATH_DRIVER}");
    format!(
        "apiVersion: v1
kind: Pod
metadata: {{name: hostpathplugin}}
spec:
  nodeName: {NODE}
  terminationGracePeriodSeconds: 5
  containers:
    - name: plugin
      image: {busybox}
      imagePullPolicy: Never
      command: [/hostpathplugin]
      args: [--endpoint=unix:///csi/csi.sock, --nodeid={NODE}, --drivername={HOSTPATH_DRIVER},
        --statedir=/csi-data-dir]
      securityContext: {{privileged: true}}
      volumeMounts:
        - {{name: program, mountPath: /hostpathplugin}}
        - {{name: socket-dir, mountPath: /csi}}
        - {{name: kubelet-dir, mountPath: /var/lib/kubelet, mountPropagation: Bidirectional}}
        - {{name: state, mountPath: /csi-data-dir}}
        - {{name: dev, mountPath: /dev}}
    - name: csi-provisioner
      image: registry.k8s.io/sig-storage/csi-provisioner:v5.2.0
      imagePullPolicy: Never
      args: [--csi-address=/csi/csi.sock, --node-deployment, --feature-gates=Topology=true,
        --strict-topology, --extra-create-metadata]
      env:
        - name: NODE_NAME
          valueFrom: {{fieldRef: {{fieldPath: spec.nodeName}}}}
      volumeMounts: [{{name: socket-dir, mountPath: /csi}}]
    - name: registrar
      image: registry.k8s.io/sig-storage/csi-node-driver-registrar:v2.13.0
      imagePullPolicy: Never
      args: [--csi-address=/csi/csi.sock, --kubelet-registration-path={socket_dir}/csi.sock]
      volumeMounts:
        - {{name: socket-dir, mountPath: /csi}}
        - {{name: registration-dir, mountPath: /registration}}
  volumes:
    - {{name: program, hostPath: {{path: {program}, type: File}}}}
    - {{name: socket-dir, hostPath: {{path: {socket_dir}, type: DirectoryOrCreate}}}}
    - {{name: registration-dir, hostPath: {{path: /var/lib/kubelet/plugins_registry, type: Directory}}}}
    - {{name: kubelet-dir, hostPath: {{path: /var/lib/kubelet, type: Directory}}}}
    - {{name: state, hostPath: {{path: /var/lib/bench-hostpath, type: DirectoryOrCreate}}}}
    - {{name: dev, hostPath: {{path: /dev, type: Directory}}}}
"
    )
}
