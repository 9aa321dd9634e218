//! A real Kubernetes for the tests that run against one: the cluster `.ci/cluster up DIR` brings
//! up (its control plane, nodes and moor installed by its manifests), whose environment file
//! (`DIR/env`) [`ENV`] names. The tests drive it as an operator would, with kubectl, and look
//! into a node (its mounts, its files) through `.ci/cluster exec`.
//!
//! Every namespaced object a test makes goes in its own [`Namespace`], deleted (with what is in
//! it: pods, claims, and so the volumes behind them) when it drops, also after a failure.
//! Waits are for conditions, through `kubectl wait` or by asking again; each has a deadline and
//! says what it waited for.

use std::collections::HashMap;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

/// The environment variable naming the cluster's environment file (`DIR/env` of
/// `.ci/cluster up DIR`).
pub const ENV: &str = "MOOR_CLUSTER_ENV";

/// The cluster an environment file describes.
#[derive(Debug, Clone)]
pub struct Cluster {
    /// The file's variables (`export NAME=VALUE` lines).
    pub vars: HashMap<String, String>,
    /// The administrator's kubeconfig.
    pub kubeconfig: PathBuf,
    /// The nodes' names, node-1 first.
    pub nodes: Vec<String>,
    /// The node moor's controller (and so every embedded volume) is on.
    pub controller_node: String,
    /// moor's StorageClass.
    pub storage_class: String,
    /// An image with a shell for test workloads (busybox), on every node.
    pub busybox: String,
    /// `.ci/cluster`, and the cluster's dir, for `exec`.
    script: PathBuf,
    dir: PathBuf,
    kubectl: String,
}

/// Reads `export NAME=VALUE` lines (VALUE optionally in double quotes).
fn parse_env(text: &str) -> HashMap<String, String> {
    text.lines()
        .filter_map(|l| l.trim().strip_prefix("export "))
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.trim_matches('"').to_owned()))
        .collect()
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

impl Cluster {
    /// The cluster [`ENV`] names, or None (the reason printed) when it names none.
    ///
    /// # Panics
    /// When the file it names cannot be read or lacks a variable `.ci/cluster` writes.
    pub fn from_env(test: &str) -> Option<Self> {
        let Some(file) = std::env::var_os(ENV).filter(|f| !f.is_empty()) else {
            eprintln!(
                "{test}: skipped: {ENV} is not set (`.ci/cluster up DIR` brings a cluster up; \
                 then {ENV}=DIR/env)"
            );
            return None;
        };
        moor_privileged::require_root();
        let vars = parse_env(
            &std::fs::read_to_string(&file)
                .unwrap_or_else(|e| panic!("{ENV}={}: {e}", Path::new(&file).display())),
        );
        let var = |k: &str| {
            vars.get(k)
                .filter(|v| !v.is_empty())
                .cloned()
                .unwrap_or_else(|| panic!("{} has no {k}", Path::new(&file).display()))
        };
        Some(Self {
            kubeconfig: PathBuf::from(var("KUBECONFIG")),
            nodes: var("MOOR_CLUSTER_NODES")
                .split_whitespace()
                .map(str::to_owned)
                .collect(),
            controller_node: var("MOOR_CLUSTER_CONTROLLER_NODE"),
            storage_class: var("MOOR_CLUSTER_STORAGE_CLASS"),
            busybox: var("MOOR_CLUSTER_BUSYBOX_IMAGE"),
            script: PathBuf::from(var("MOOR_CLUSTER_SCRIPT")),
            dir: PathBuf::from(var("MOOR_CLUSTER_DIR")),
            kubectl: std::env::var("KUBECTL").unwrap_or_else(|_| "kubectl".to_owned()),
            vars,
        })
    }

    /// kubectl with the cluster's kubeconfig: `args`, `stdin` on its standard input.
    pub fn kubectl_with(&self, args: &[&str], stdin: Option<&str>) -> Output {
        let mut cmd = Command::new(&self.kubectl);
        cmd.arg("--kubeconfig")
            .arg(&self.kubeconfig)
            .args(args)
            .stdin(if stdin.is_some() {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("{}: {e}", self.kubectl));
        if let Some(input) = stdin {
            child
                .stdin
                .take()
                .expect("stdin")
                .write_all(input.as_bytes())
                .expect("write kubectl's stdin");
        }
        child.wait_with_output().expect("kubectl")
    }

    /// kubectl `args`; its output.
    pub fn kubectl(&self, args: &[&str]) -> Output {
        self.kubectl_with(args, None)
    }

    /// kubectl `args`, which must succeed; its standard output.
    ///
    /// # Panics
    /// When kubectl fails (its standard error is in the message).
    pub fn ok(&self, args: &[&str]) -> String {
        let out = self.kubectl(args);
        assert!(
            out.status.success(),
            "kubectl {}: {}{}",
            args.join(" "),
            text(&out.stderr),
            text(&out.stdout)
        );
        text(&out.stdout)
    }

    /// Creates or updates the objects of a YAML document (`kubectl apply -f -`).
    ///
    /// # Panics
    /// When kubectl refuses them.
    pub fn apply(&self, yaml: &str) {
        self.apply_in(None, yaml);
    }

    /// Creates or updates the objects of a YAML document, namespaced ones in `namespace` when
    /// given.
    ///
    /// # Panics
    /// When kubectl refuses them.
    pub fn apply_in(&self, namespace: Option<&str>, yaml: &str) {
        let mut args = vec!["apply", "-f", "-"];
        if let Some(ns) = namespace {
            args.extend(["-n", ns]);
        }
        let out = self.kubectl_with(&args, Some(yaml));
        assert!(
            out.status.success(),
            "kubectl apply: {}\n{yaml}",
            text(&out.stderr)
        );
    }

    /// The object (`kind/name`, in `namespace` when given) as JSON, or None when there is none.
    ///
    /// # Panics
    /// When kubectl fails otherwise.
    pub fn get(&self, namespace: Option<&str>, object: &str) -> Option<Value> {
        let mut args = vec!["get", object, "-o", "json", "--ignore-not-found"];
        if let Some(ns) = namespace {
            args.extend(["-n", ns]);
        }
        let out = self.ok(&args);
        (!out.trim().is_empty()).then(|| serde_json::from_str(&out).expect("kubectl get's JSON"))
    }

    /// Waits with `kubectl wait --for=<condition>` for `object`, at most `deadline`.
    ///
    /// # Panics
    /// When the deadline passes (with kubectl's words and the object as it is).
    pub fn wait(&self, namespace: &str, object: &str, condition: &str, deadline: Duration) {
        let timeout = format!("--timeout={}s", deadline.as_secs());
        let out = self.kubectl(&[
            "wait",
            "-n",
            namespace,
            &format!("--for={condition}"),
            &timeout,
            object,
        ]);
        assert!(
            out.status.success(),
            "waited {}s for {object} in {namespace} to be {condition}: {}\n{}",
            deadline.as_secs(),
            text(&out.stderr),
            self.describe(namespace, object)
        );
    }

    /// Waits until the pod is Ready, at most `deadline`.
    ///
    /// # Panics
    /// When the deadline passes, or the pod ends first (with its logs and events).
    pub fn wait_pod_ready(&self, namespace: &str, pod: &str, deadline: Duration) {
        let ended = self.wait_until(&format!("the pod {pod} to be Ready"), deadline, || {
            let p = self.get(Some(namespace), &format!("pod/{pod}"))?;
            let ready = p["status"]["conditions"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|c| c["type"] == "Ready" && c["status"] == "True");
            let phase = p["status"]["phase"].as_str().unwrap_or_default();
            if ready {
                Some(None)
            } else if matches!(phase, "Succeeded" | "Failed") {
                Some(Some(phase.to_owned()))
            } else {
                None
            }
        });
        if let Some(phase) = ended {
            panic!(
                "the pod {pod} ended ({phase}) before it was Ready: {}{}",
                self.logs(namespace, pod),
                self.describe(namespace, &format!("pod/{pod}"))
            );
        }
    }

    /// Waits until the pod has ended, at most `deadline`; its phase (Succeeded or Failed).
    ///
    /// # Panics
    /// When the deadline passes.
    pub fn wait_pod_finished(&self, namespace: &str, pod: &str, deadline: Duration) -> String {
        let start = Instant::now();
        loop {
            if let Some(p) = self.get(Some(namespace), &format!("pod/{pod}")) {
                let phase = p["status"]["phase"].as_str().unwrap_or_default();
                if matches!(phase, "Succeeded" | "Failed") {
                    return phase.to_owned();
                }
            }
            assert!(
                start.elapsed() < deadline,
                "waited {}s for the pod {pod} to end: {}",
                deadline.as_secs(),
                self.describe(namespace, &format!("pod/{pod}"))
            );
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    /// Waits until the pod has ended, at most `deadline`, and asserts it Succeeded (else its
    /// logs and events); then its logs.
    ///
    /// # Panics
    /// When the deadline passes or the pod Failed.
    pub fn wait_pod_succeeded(&self, namespace: &str, pod: &str, deadline: Duration) -> String {
        let phase = self.wait_pod_finished(namespace, pod, deadline);
        let logs = self.logs(namespace, pod);
        assert_eq!(
            phase,
            "Succeeded",
            "{pod}: {logs}{}",
            self.describe(namespace, &format!("pod/{pod}"))
        );
        logs
    }

    /// The logs of a pod's (only) container.
    pub fn logs(&self, namespace: &str, pod: &str) -> String {
        let out = self.kubectl(&["logs", "-n", namespace, pod]);
        format!("{}{}", text(&out.stdout), text(&out.stderr))
    }

    /// Asks `check` again until it answers Some, at most `deadline`; `what` says what for.
    ///
    /// # Panics
    /// When the deadline passes.
    pub fn wait_until<T>(
        &self,
        what: &str,
        deadline: Duration,
        mut check: impl FnMut() -> Option<T>,
    ) -> T {
        let start = Instant::now();
        loop {
            if let Some(v) = check() {
                return v;
            }
            assert!(
                start.elapsed() < deadline,
                "waited {}s for {what}",
                deadline.as_secs()
            );
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    /// [`wait_until`](Self::wait_until), and at the deadline the panic says also what
    /// `evidence` finds then (a node's state, a daemon's log): what the failure needs to be
    /// understood once the cluster is gone.
    ///
    /// # Panics
    /// When the deadline passes.
    pub fn wait_until_or<T>(
        &self,
        what: &str,
        deadline: Duration,
        mut check: impl FnMut() -> Option<T>,
        evidence: impl FnOnce() -> String,
    ) -> T {
        let start = Instant::now();
        loop {
            if let Some(v) = check() {
                return v;
            }
            if start.elapsed() >= deadline {
                panic!(
                    "waited {}s for {what}; then:\n{}",
                    deadline.as_secs(),
                    evidence()
                );
            }
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    /// Waits until the object is gone, at most `deadline`.
    ///
    /// # Panics
    /// When the deadline passes.
    pub fn wait_gone(&self, namespace: Option<&str>, object: &str, deadline: Duration) {
        self.wait_until(&format!("{object} to be gone"), deadline, || {
            self.get(namespace, object).is_none().then_some(())
        });
    }

    /// `kubectl describe` of an object, and the events of its namespace, for a failure's message.
    pub fn describe(&self, namespace: &str, object: &str) -> String {
        let d = self.kubectl(&["describe", "-n", namespace, object]);
        let e = self.kubectl(&["get", "events", "-n", namespace, "--sort-by=.lastTimestamp"]);
        format!("{}\n{}", text(&d.stdout), text(&e.stdout))
    }

    /// Runs `args` in the container of a pod (`kubectl exec`).
    pub fn exec(&self, namespace: &str, pod: &str, container: &str, args: &[&str]) -> Output {
        let mut all = vec!["exec", "-n", namespace, pod, "-c", container, "--"];
        all.extend(args);
        self.kubectl(&all)
    }

    /// Runs `args` in a node's namespaces (its mounts, its network), through `.ci/cluster exec`.
    pub fn on_node(&self, node: &str, args: &[&str]) -> Output {
        Command::new("bash")
            .arg(&self.script)
            .arg("exec")
            .arg(&self.dir)
            .arg(node)
            .args(args)
            .stdin(Stdio::null())
            .output()
            .expect(".ci/cluster exec")
    }

    /// Stops (`node-stop`: its kubelet, runtime and containers killed, as a crash does; its
    /// namespaces, mounts and files stay) or starts again (`node-start`: until it is Ready) a
    /// node, through `.ci/cluster`.
    ///
    /// # Panics
    /// When `.ci/cluster` fails.
    pub fn node_power(&self, verb: &str, node: &str) {
        let out = Command::new("bash")
            .arg(&self.script)
            .arg(verb)
            .arg(&self.dir)
            .arg(node)
            .stdin(Stdio::null())
            .output()
            .expect(".ci/cluster");
        assert!(
            out.status.success(),
            ".ci/cluster {verb} {node}: {}",
            text(&out.stderr)
        );
    }

    /// The mounts of a node (`findmnt` in its mount namespace): (target, source, fstype).
    ///
    /// # Panics
    /// When findmnt fails there.
    pub fn node_mounts(&self, node: &str) -> Vec<(String, String, String)> {
        let out = self.on_node(node, &["findmnt", "-rn", "-o", "TARGET,SOURCE,FSTYPE"]);
        assert!(
            out.status.success(),
            "findmnt on {node}: {}",
            text(&out.stderr)
        );
        text(&out.stdout)
            .lines()
            .filter_map(|l| {
                let mut f = l.split(' ');
                Some((
                    f.next()?.to_owned(),
                    f.next()?.to_owned(),
                    f.next()?.to_owned(),
                ))
            })
            .collect()
    }

    /// moor's pods of a component (`app.kubernetes.io/component`: `node`, `local`, ...) in
    /// moor-system: (node, pod name), sorted.
    ///
    /// # Panics
    /// When kubectl fails.
    pub fn moor_pods(&self, component: &str) -> Vec<(String, String)> {
        let out = self.ok(&[
            "get",
            "pods",
            "-n",
            "moor-system",
            "-l",
            &format!("app.kubernetes.io/component={component}"),
            "-o",
            "json",
        ]);
        let pods: Value = serde_json::from_str(&out).expect("kubectl get's JSON");
        let mut v: Vec<(String, String)> = pods["items"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|p| {
                let f = |v: &Value| v.as_str().unwrap_or_default().to_owned();
                (f(&p["spec"]["nodeName"]), f(&p["metadata"]["name"]))
            })
            .collect();
        v.sort();
        v
    }

    /// The moor-node pod on `node`.
    ///
    /// # Panics
    /// When there is none.
    pub fn moor_node_pod(&self, node: &str) -> String {
        let pods = self
            .get(Some("moor-system"), "pods")
            .expect("pods of moor-system");
        pods["items"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|p| {
                p["metadata"]["labels"]["app.kubernetes.io/component"] == "node"
                    && p["spec"]["nodeName"] == node
            })
            .and_then(|p| p["metadata"]["name"].as_str())
            .map(str::to_owned)
            .unwrap_or_else(|| panic!("no moor-node pod on {node}"))
    }

    /// The messages of the events about an object (`kind`, `name`) in `namespace`, oldest first.
    ///
    /// # Panics
    /// When kubectl fails.
    pub fn events_about(&self, namespace: &str, kind: &str, name: &str) -> Vec<String> {
        let selector = format!("involvedObject.kind={kind},involvedObject.name={name}");
        let out = self.ok(&[
            "get",
            "events",
            "-n",
            namespace,
            "--field-selector",
            &selector,
            "--sort-by=.lastTimestamp",
            "-o",
            "json",
        ]);
        let events: Value = serde_json::from_str(&out).expect("kubectl get events' JSON");
        events["items"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|e| {
                format!(
                    "{}: {}",
                    e["reason"].as_str().unwrap_or_default(),
                    e["message"].as_str().unwrap_or_default()
                )
            })
            .collect()
    }

    /// Waits until an event about the object (`kind`, `name`) says `words` (as `reason: message`),
    /// at most `deadline`; that event.
    ///
    /// # Panics
    /// When the deadline passes (with the events there were).
    pub fn wait_event(
        &self,
        namespace: &str,
        kind: &str,
        name: &str,
        words: &str,
        deadline: Duration,
    ) -> String {
        let start = Instant::now();
        loop {
            let events = self.events_about(namespace, kind, name);
            if let Some(e) = events.iter().find(|e| e.contains(words)) {
                return e.clone();
            }
            assert!(
                start.elapsed() < deadline,
                "waited {}s for an event about {kind} {name} saying {words:?}; there were: {events:#?}",
                deadline.as_secs()
            );
            std::thread::sleep(Duration::from_millis(500));
        }
    }

    /// A namespace of the test's own, made now and deleted (with everything in it) when it
    /// drops.
    pub fn namespace(&self, prefix: &str) -> Namespace<'_> {
        let name = format!("{prefix}-{}", std::process::id());
        self.apply(&format!(
            "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: {name}\n"
        ));
        // The service account controller gives it a "default" ServiceAccount, which pods need.
        self.wait_until(
            &format!("the default ServiceAccount of {name}"),
            Duration::from_secs(60),
            || self.get(Some(&name), "serviceaccount/default").map(|_| ()),
        );
        Namespace {
            cluster: self,
            name,
        }
    }
}

/// A ReadWriteOnce claim of `mib` MiB of the class, restored from the VolumeSnapshot `snapshot`
/// when given.
#[must_use]
pub fn claim(name: &str, class: &str, mib: u64, snapshot: Option<&str>) -> String {
    let source = snapshot.map_or_else(String::new, |s| {
        format!(
            "  dataSource: {{apiGroup: snapshot.storage.k8s.io, kind: VolumeSnapshot, name: {s}}}\n"
        )
    });
    format!(
        "apiVersion: v1
kind: PersistentVolumeClaim
metadata: {{name: {name}}}
spec:
  storageClassName: {class}
  accessModes: [ReadWriteOnce]
  resources: {{requests: {{storage: {mib}Mi}}}}
{source}"
    )
}

/// A pod running `script` in the busybox image `image` with the claim at /data, on `node` when
/// given (its `kubernetes.io/hostname`); Ready once /data/done exists.
#[must_use]
pub fn pod(name: &str, claim: &str, image: &str, script: &str, node: Option<&str>) -> String {
    let script: String = script.lines().map(|l| format!("          {l}\n")).collect();
    let selector = node.map_or_else(String::new, |n| {
        format!("  nodeSelector: {{kubernetes.io/hostname: {n}}}\n")
    });
    format!(
        "apiVersion: v1
kind: Pod
metadata: {{name: {name}}}
spec:
  restartPolicy: Never
  terminationGracePeriodSeconds: 10
{selector}  containers:
    - name: c
      image: {image}
      # Images are imported into the nodes, never pulled.
      imagePullPolicy: Never
      command:
        - sh
        - -c
        - |
{script}      readinessProbe:
        exec: {{command: [test, -f, /data/done]}}
        periodSeconds: 1
      volumeMounts: [{{name: data, mountPath: /data}}]
  volumes: [{{name: data, persistentVolumeClaim: {{claimName: {claim}}}}}]
"
    )
}

/// A [`pod`] script: writes and fsyncs 4 MiB and its checksum, then says it is done and waits
/// to be stopped.
pub const WRITE: &str = "set -e
echo written by the writer > /data/hello
dd if=/dev/urandom of=/data/blob bs=64k count=64 conv=fsync 2>/dev/null
sha256sum /data/blob > /data/blob.sha256
sync
touch /data/done
trap 'exit 0' TERM
sleep 1000000 & wait";

/// A [`pod`] script: checks what [`WRITE`] left, and ends.
pub const READ: &str = "set -e
cd /data
sha256sum -c blob.sha256
grep -qx 'written by the writer' hello
test -f done";

/// A resource quantity as the API writes one (`1Gi`, `573440Ki`, `500M`, `1e9`, `1234`), in
/// bytes; None when it is not one.
#[must_use]
pub fn quantity_bytes(q: &str) -> Option<u64> {
    const SUFFIXES: [(&str, u64); 12] = [
        ("Ki", 1 << 10),
        ("Mi", 1 << 20),
        ("Gi", 1 << 30),
        ("Ti", 1 << 40),
        ("Pi", 1 << 50),
        ("Ei", 1 << 60),
        ("k", 1_000),
        ("M", 1_000_000),
        ("G", 1_000_000_000),
        ("T", 1_000_000_000_000),
        ("P", 1_000_000_000_000_000),
        ("E", 1_000_000_000_000_000_000),
    ];
    let q = q.trim();
    for (suffix, unit) in SUFFIXES {
        if let Some(n) = q.strip_suffix(suffix) {
            return n.parse::<u64>().ok()?.checked_mul(unit);
        }
    }
    if let Some((m, e)) = q.split_once(['e', 'E']) {
        return m
            .parse::<u64>()
            .ok()?
            .checked_mul(10_u64.checked_pow(e.parse().ok()?)?);
    }
    q.parse().ok()
}

/// A namespace a test made; deleted when it drops.
#[derive(Debug)]
pub struct Namespace<'a> {
    cluster: &'a Cluster,
    /// Its name.
    pub name: String,
}

impl Namespace<'_> {
    /// Creates or updates the objects of a YAML document in this namespace.
    pub fn apply(&self, yaml: &str) {
        self.cluster.apply_in(Some(&self.name), yaml);
    }
}

impl Drop for Namespace<'_> {
    fn drop(&mut self) {
        // Its pods and claims go with it; the claims' volumes after them (reclaim: Delete).
        let out = self.cluster.kubectl(&[
            "delete",
            "namespace",
            &self.name,
            "--ignore-not-found",
            "--wait=true",
            "--timeout=180s",
        ]);
        if !out.status.success() {
            eprintln!(
                "deleting the namespace {}: {}",
                self.name,
                text(&out.stderr)
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{parse_env, quantity_bytes};

    #[test]
    fn quantities_are_read_as_the_api_writes_them() {
        assert_eq!(quantity_bytes("1Gi"), Some(1 << 30));
        assert_eq!(quantity_bytes("573440Ki"), Some(573_440 * 1024));
        assert_eq!(quantity_bytes("500M"), Some(500_000_000));
        assert_eq!(quantity_bytes("1e9"), Some(1_000_000_000));
        assert_eq!(quantity_bytes("1234"), Some(1234));
        assert_eq!(quantity_bytes("0"), Some(0));
        assert_eq!(quantity_bytes("1.5Gi"), None);
        assert_eq!(quantity_bytes("Gi"), None);
    }

    #[test]
    fn env_files_are_read_as_up_writes_them() {
        let vars = parse_env(
            "export KUBECONFIG=/c/kubeconfig\nexport MOOR_CLUSTER_NODES=\"node-1 node-2\"\n\
             # a comment\nnot an export\n",
        );
        assert_eq!(vars["KUBECONFIG"], "/c/kubeconfig");
        assert_eq!(vars["MOOR_CLUSTER_NODES"], "node-1 node-2");
        assert_eq!(vars.len(), 2);
    }
}
