//! A rolling update of moor's node DaemonSets under live volumes, on a real Kubernetes (issue 38
//! point 1, the cluster half; run as root against the cluster `.ci/cluster up DIR` brings up,
//! `MOOR_CLUSTER_ENV=DIR/env`; without one, it says it is skipped).
//!
//! A pod on node-2 writes and fsyncs numbered records to a local volume (`moor-local`, the
//! DaemonSet moor-local) and another on the controller's node to an embedded volume (`moor`,
//! the DaemonSet moor-node); both DaemonSets are rolled (`kubectl rollout restart`, as a new
//! image does: every old pod terminated, a new one started) while they write. Asserted: the
//! writers see no I/O error and keep writing through and after it, they are the same pods,
//! never restarted; every record they synced is on the volume; the new moor-node serves the
//! volumes (the pods deleted: unpublish and unstage done, the mounts gone; a reader staged
//! again reads the records). Only loop-backed volumes: an rbd-fuse volume cannot survive its
//! container (docs/ceph.md).

use std::time::{Duration, Instant};

use moor_lab::kube::{Cluster, claim, pod};
use serde_json::Value;

/// How long anything the cluster does may take: a pod running, a rollout done.
const DEADLINE: Duration = Duration::from_secs(300);

/// Appends numbered records to /data/log, each synced (fsync of the file) before the next;
/// any failed write or sync ends the pod Failed, with the record named. Ready (/data/done) once
/// the first record is synced. Touching /data/stop ends it: it prints the last synced record.
const WRITER: &str = "i=0
while [ ! -f /data/stop ]; do
  i=$((i+1))
  echo \"record $i\" >> /data/log || { echo \"write of record $i failed\"; exit 1; }
  sync /data/log || { echo \"sync of record $i failed\"; exit 1; }
  [ $i = 1 ] && touch /data/done
  usleep 20000
done
echo \"synced $i\"";

/// Checks that /data/log holds records 1 to N in order, N at least SYNCED; prints N.
const CHECK: &str = "set -e
n=$(wc -l < /data/log)
awk '$0 != \"record \" NR { print \"line \" NR \": \" $0; bad=1 } END { exit bad }' /data/log
[ \"$n\" -ge SYNCED ] || { echo \"only $n records, SYNCED synced\"; exit 1; }
echo \"records $n\"";

fn s(v: &Value) -> &str {
    v.as_str().unwrap_or_default()
}

/// The number of records the writer has synced so far (read in its pod).
fn records(c: &Cluster, ns: &str, pod: &str) -> u64 {
    let out = c.exec(ns, pod, "c", &["sh", "-c", "wc -l < /data/log"]);
    assert!(
        out.status.success(),
        "reading {pod}'s log: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .expect("a count")
}

/// The pod's uid, phase and restarts.
fn pod_state(c: &Cluster, ns: &str, pod: &str) -> (String, String, u64) {
    let p = c.get(Some(ns), &format!("pod/{pod}")).expect("the pod");
    (
        s(&p["metadata"]["uid"]).to_owned(),
        s(&p["status"]["phase"]).to_owned(),
        p["status"]["containerStatuses"][0]["restartCount"]
            .as_u64()
            .unwrap_or(u64::MAX),
    )
}

struct Case {
    /// The DaemonSet (and its pods' component label).
    daemonset: &'static str,
    class: &'static str,
    node: String,
    claim: &'static str,
}

#[test]
#[allow(clippy::too_many_lines)] // one rollout's story, step by step
fn rolling_update_under_live_volumes() {
    let Some(c) = Cluster::from_env("cluster_upgrade") else {
        return;
    };
    let mut cases = vec![Case {
        daemonset: "moor-node",
        class: c.vars["MOOR_CLUSTER_STORAGE_CLASS"].clone().leak(),
        node: c.vars["MOOR_CLUSTER_CONTROLLER_NODE"].clone(),
        claim: "embedded",
    }];
    if c.get(None, "storageclass/moor-local").is_some() && c.nodes.len() >= 2 {
        cases.push(Case {
            daemonset: "moor-local",
            class: "moor-local",
            node: c.nodes[1].clone(),
            claim: "local",
        });
    }
    let ns = c.namespace("moor-upgrade");
    let n = ns.name.as_str();
    for k in &cases {
        ns.apply(&claim(k.claim, k.class, 64, None));
        let writer = format!("{}-writer", k.claim);
        c.apply_in(
            Some(n),
            &pod(&writer, k.claim, &c.busybox, WRITER, Some(&k.node)),
        );
    }
    let mut before = Vec::new();
    for k in &cases {
        let writer = format!("{}-writer", k.claim);
        c.wait_pod_ready(n, &writer, DEADLINE);
        let component = if k.daemonset == "moor-node" {
            "node"
        } else {
            "local"
        };
        before.push((
            pod_state(&c, n, &writer),
            c.moor_pods(component),
            records(&c, n, &writer),
        ));
    }

    // ---- The rolling update: every node's pod of both DaemonSets replaced, one at a time.
    let start = Instant::now();
    let names: Vec<String> = cases
        .iter()
        .map(|k| format!("ds/{}", k.daemonset))
        .collect();
    let mut args = vec!["rollout", "restart", "-n", "moor-system"];
    args.extend(names.iter().map(String::as_str));
    c.ok(&args);
    for ds in &names {
        c.ok(&[
            "rollout",
            "status",
            "-n",
            "moor-system",
            ds,
            &format!("--timeout={}s", DEADLINE.as_secs()),
        ]);
    }
    eprintln!(
        "cluster_upgrade: {} rolled out in {:.1} s",
        names.join(" and "),
        start.elapsed().as_secs_f64()
    );

    for (k, ((uid, _, _), old_pods, old_records)) in cases.iter().zip(&before) {
        let writer = format!("{}-writer", k.claim);
        let component = if k.daemonset == "moor-node" {
            "node"
        } else {
            "local"
        };
        let new_pods = c.moor_pods(component);
        let old = old_pods.iter().find(|(nd, _)| *nd == k.node);
        let new = new_pods.iter().find(|(nd, _)| *nd == k.node);
        assert!(
            old.is_some() && new.is_some() && old != new,
            "{}'s pod on {} replaced: {old:?} -> {new:?}",
            k.daemonset,
            k.node
        );
        // The same pod, never restarted, still writing after the update.
        let after = records(&c, n, &writer);
        c.wait_until(
            &format!("{writer} to write on after the update (from {after} records)"),
            DEADLINE,
            || (records(&c, n, &writer) > after).then_some(()),
        );
        let (uid_now, phase, restarts) = pod_state(&c, n, &writer);
        assert_eq!(
            (&uid_now, phase.as_str(), restarts),
            (uid, "Running", 0),
            "{writer}: {}",
            c.logs(n, &writer)
        );
        assert!(after > *old_records, "{writer} wrote during the update");
    }

    // ---- The writers stop: no error, every synced record on the volume.
    let mut held = Vec::new();
    for k in &cases {
        let writer = format!("{}-writer", k.claim);
        let pv = c
            .get(Some(n), &format!("pvc/{}", k.claim))
            .map(|p| s(&p["spec"]["volumeName"]).to_owned())
            .expect("the claim");
        // The pod's mount (its path names the PV) and kubelet's staging mount of the same
        // device (.../globalmount).
        let mounts = c.node_mounts(&k.node);
        let published = mounts
            .iter()
            .find(|(target, _, _)| target.contains(&pv))
            .unwrap_or_else(|| panic!("{pv} published on {}: {mounts:?}", k.node))
            .clone();
        let staged = mounts
            .iter()
            .find(|(target, source, _)| {
                // The device, whatever subdirectory of it is bound (`/dev/loop5[/dir]`).
                let dev = |m: &str| m.split('[').next().unwrap_or_default().to_owned();
                target.ends_with("/globalmount") && dev(source) == dev(&published.1)
            })
            .unwrap_or_else(|| panic!("{pv} staged on {}: {mounts:?}", k.node))
            .0
            .clone();
        held.push((pv, published, staged));
        c.exec(n, &writer, "c", &["touch", "/data/stop"]);
    }
    for (i, k) in cases.iter().enumerate() {
        let writer = format!("{}-writer", k.claim);
        let log = c.wait_pod_succeeded(n, &writer, DEADLINE);
        let synced = log
            .lines()
            .find_map(|l| l.strip_prefix("synced "))
            .expect("the writer's last record")
            .trim()
            .to_owned();
        eprintln!(
            "cluster_upgrade: {writer} on {} ({}): {synced} records synced, no I/O error",
            k.node, k.daemonset
        );
        // Deleted: the new moor-node unpublishes and unstages, its mounts leave the node.
        let (pv, published, staged) = &held[i];
        c.ok(&["delete", "-n", n, &format!("pod/{writer}"), "--wait=true"]);
        c.wait_until(
            &format!("{pv}'s mounts to leave {}", k.node),
            DEADLINE,
            || {
                let mounts = c.node_mounts(&k.node);
                (!mounts
                    .iter()
                    .any(|(target, _, _)| *target == published.0 || target == staged))
                .then_some(())
            },
        );
        // Staged and published again by the new moor-node: every synced record there.
        let reader = format!("{}-reader", k.claim);
        let check = CHECK.replace("SYNCED", &synced);
        c.apply_in(
            Some(n),
            &pod(&reader, k.claim, &c.busybox, &check, Some(&k.node)),
        );
        let logs = c.wait_pod_succeeded(n, &reader, DEADLINE);
        eprintln!("cluster_upgrade: {reader}: {}", logs.trim());
        c.ok(&["delete", "-n", n, &format!("pod/{reader}"), "--wait=true"]);
    }
}
