//! The RBD backend against a live cluster: the one `.ci/ceph-cluster up DIR` brings up (its
//! `DIR/env` sets MOOR_CEPH_CONF, MOOR_CEPH_KEYRING, MOOR_CEPH_USER and MOOR_CEPH_POOL).
//! Without them each test prints "skipped: no Ceph cluster" and passes; with them, a cluster
//! that does not answer is a failure.
//!
//! Every test makes its own volumes (names unique to the run) and removes them, with their
//! snapshots, publications and any blocklist entry, however it ends.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use moor_controller::backend::{
    AccessMode, AccessType, Backend, Capability, CapacityQuery, CapacityRange, ContentSource,
    ExpandRequest, GroupSnapshotRef, NewSnapshot, NewVolume, PageRequest, Parameters,
    PublishRequest, SnapshotFilter,
};
use moor_controller::error::Error;
use moor_controller::rbd::clusters::Clusters;
use moor_controller::rbd::ids::{SnapshotId, VolumeId};
use moor_controller::rbd::{self, RbdBackend};
use moor_controller::secrets::{self, Secrets};
use moor_rbd::testing::TestCluster;
use moor_rbd::{Cluster, Pool};

const MIB: u64 = 1 << 20;
const CLUSTER_ID: &str = "live";

/// The test cluster, with what these tests make of it.
struct Env(TestCluster);

impl std::ops::Deref for Env {
    type Target = TestCluster;

    fn deref(&self) -> &TestCluster {
        &self.0
    }
}

impl Env {
    fn get() -> Option<Env> {
        TestCluster::from_env().map(Env)
    }

    /// The backend, with the cluster in its list as "live"; with the controller's own
    /// credentials (the keyring) when `own` is set.
    fn backend(&self, own: bool) -> RbdBackend {
        let mut entry = serde_json::json!({
            "clusterID": CLUSTER_ID,
            "monitors": [self.mon_host],
        });
        if own {
            entry["user"] = self.user.clone().into();
            entry["keyring"] = self.keyring.display().to_string().into();
        }
        let clusters = Clusters::from_json(&serde_json::json!([entry]).to_string()).unwrap();
        let mut config = rbd::Config::new(clusters);
        // Clients fenced by the tests are let go soon, should the cleanup not remove them.
        config.fence_expiry = Duration::from_secs(600);
        RbdBackend::new(config)
    }

    /// The CSI secrets a StorageClass would give.
    fn secrets(&self) -> Secrets {
        Secrets::from_pairs([
            ("userID", self.user.as_str()),
            ("userKey", &self.key_text()),
        ])
    }

    fn params(&self) -> Parameters {
        Parameters::from([
            ("backend".to_string(), "rbd".to_string()),
            ("clusterID".to_string(), CLUSTER_ID.to_string()),
            ("pool".to_string(), self.pool.clone()),
        ])
    }

    /// A connection of its own: a "node" or an observer.
    fn client(&self) -> Cluster {
        Cluster::connect(&self.options().option("rbd_cache", "false"))
            .expect("connect to the test cluster")
    }

    /// The cluster's administrator, when its keyring is next to ceph.conf (`.ci/ceph-cluster`).
    fn admin(&self) -> Option<Cluster> {
        Cluster::connect(&self.admin_options()?).ok()
    }

    fn pool(&self) -> Pool {
        self.client().pool(&self.pool).unwrap()
    }
}

/// A name unique to this run.
fn name(what: &str) -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    format!(
        "pvc-{}-{}-{what}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

fn cap(mode: AccessMode) -> Capability {
    Capability {
        access: AccessType::Mount { fs_type: None },
        mode,
    }
}

fn new_volume(env: &Env, name: &str, size: u64, source: Option<ContentSource>) -> NewVolume {
    NewVolume {
        name: name.to_string(),
        capacity: Some(CapacityRange {
            required: size,
            limit: 0,
        }),
        capabilities: vec![cap(AccessMode::SingleNodeWriter)],
        parameters: env.params(),
        source,
        accessibility: None,
    }
}

fn publish(id: &str, node: &str, mode: AccessMode, readonly: bool) -> PublishRequest {
    PublishRequest {
        volume_id: id.to_string(),
        node_id: node.to_string(),
        capability: cap(mode),
        readonly,
        context: Parameters::new(),
    }
}

/// Removes what a test made, however it ends: publications, snapshots, then volumes (the
/// last made first), and blocklist entries it caused.
struct Cleanup<'a> {
    env: &'a Env,
    backend: &'a RbdBackend,
    volumes: Vec<String>,
    snapshots: Vec<String>,
    groups: Vec<String>,
    fenced: Vec<String>,
}

impl<'a> Cleanup<'a> {
    fn new(env: &'a Env, backend: &'a RbdBackend) -> Self {
        Self {
            env,
            backend,
            volumes: Vec::new(),
            snapshots: Vec::new(),
            groups: Vec::new(),
            fenced: Vec::new(),
        }
    }

    fn volume(&mut self, id: &str) -> String {
        self.volumes.push(id.to_string());
        id.to_string()
    }

    fn snapshot(&mut self, id: &str) -> String {
        self.snapshots.push(id.to_string());
        id.to_string()
    }

    fn group(&mut self, id: &str) -> String {
        self.groups.push(id.to_string());
        id.to_string()
    }
}

impl Drop for Cleanup<'_> {
    fn drop(&mut self) {
        secrets::scope(self.env.secrets(), || {
            for v in &self.volumes {
                let _ = self.backend.unpublish_volume(v, None);
            }
            for g in self.groups.iter().rev() {
                let _ = self.backend.delete_group_snapshot(&GroupSnapshotRef {
                    id: g.clone(),
                    snapshot_ids: Vec::new(),
                });
            }
            for s in self.snapshots.iter().rev() {
                let _ = self.backend.delete_snapshot(s);
            }
            for v in self.volumes.iter().rev() {
                if let Err(e) = self.backend.delete_volume(v) {
                    eprintln!("cleanup: delete {v}: {e}");
                }
            }
        });
        // Lifting a fence takes the administrator (the rbd profile may only add entries): the
        // test cluster's admin keyring is next to its ceph.conf.
        if !self.fenced.is_empty()
            && let Some(admin) = self.env.admin()
        {
            for a in &self.fenced {
                if let Err(e) = admin.blocklist_remove(a) {
                    eprintln!("cleanup: blocklist rm {a}: {e}");
                }
            }
        }
    }
}

fn image_names(env: &Env) -> BTreeSet<String> {
    env.pool()
        .images()
        .unwrap()
        .into_iter()
        .map(|i| i.name)
        .collect()
}

fn metadata_keys(env: &Env) -> BTreeSet<String> {
    env.pool()
        .metadata_list("moor.", None, 0)
        .unwrap()
        .into_iter()
        .map(|(k, _)| k)
        .collect()
}

fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1000.0)
}

mod groups;
mod publish;
mod snapshots;
mod volumes;
