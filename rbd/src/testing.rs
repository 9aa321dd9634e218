//! The Ceph cluster the live tests run against: the one `.ci/ceph-cluster up DIR` brings up,
//! named by the environment its `DIR/env` sets (MOOR_CEPH_CONF, MOOR_CEPH_KEYRING,
//! MOOR_CEPH_USER, MOOR_CEPH_POOL). For tests only: it panics on a cluster it cannot read.

use std::path::PathBuf;

use crate::{Auth, ConnectOptions, Secret};

/// What a test skipped for want of a cluster prints.
pub const NO_CLUSTER: &str = "skipped: no Ceph cluster (MOOR_CEPH_CONF and MOOR_CEPH_KEYRING \
                              unset; `.ci/ceph-cluster up DIR` then `. DIR/env`)";

/// The test cluster.
#[derive(Debug, Clone)]
pub struct TestCluster {
    /// Its ceph.conf.
    pub conf: PathBuf,
    /// Its monitors, as ceph.conf's `mon host` names them.
    pub mon_host: String,
    /// The client the tests run as (without `client.`).
    pub user: String,
    /// That client's keyring.
    pub keyring: PathBuf,
    /// That client's key.
    pub key: Secret,
    /// The pool.
    pub pool: String,
}

impl TestCluster {
    /// The cluster the environment names; None, with [`NO_CLUSTER`] printed, when it names
    /// none. Panics when the files it names cannot be read.
    pub fn from_env() -> Option<Self> {
        let (Some(conf), Some(keyring)) = (
            std::env::var_os("MOOR_CEPH_CONF"),
            std::env::var_os("MOOR_CEPH_KEYRING"),
        ) else {
            eprintln!("{NO_CLUSTER}");
            return None;
        };
        let (conf, keyring) = (PathBuf::from(conf), PathBuf::from(keyring));
        let conf_text = std::fs::read_to_string(&conf)
            .unwrap_or_else(|e| panic!("MOOR_CEPH_CONF={}: {e}", conf.display()));
        let mon_host = conf_text
            .lines()
            .filter_map(|l| l.split_once('='))
            .find(|(k, _)| matches!(k.trim(), "mon host" | "mon_host"))
            .map(|(_, v)| v.trim().to_owned())
            .unwrap_or_else(|| panic!("no mon host in {}", conf.display()));
        let user = std::env::var("MOOR_CEPH_USER").unwrap_or_else(|_| "moor".into());
        let keyring_text = std::fs::read_to_string(&keyring)
            .unwrap_or_else(|e| panic!("MOOR_CEPH_KEYRING={}: {e}", keyring.display()));
        let key = Secret::from_keyring(&keyring_text, &user)
            .unwrap_or_else(|| panic!("no key for client.{user} in {}", keyring.display()));
        let pool = std::env::var("MOOR_CEPH_POOL").unwrap_or_else(|_| "moor".into());
        Some(Self {
            conf,
            mon_host,
            user,
            keyring,
            key,
            pool,
        })
    }

    /// Options to connect as the test client, by its key.
    pub fn options(&self) -> ConnectOptions {
        ConnectOptions::new(&self.mon_host, &self.user, Auth::Key(self.key.clone()))
    }

    /// Options to connect as the cluster's administrator, when its keyring is next to
    /// ceph.conf (as `.ci/ceph-cluster` leaves it).
    pub fn admin_options(&self) -> Option<ConnectOptions> {
        let keyring = self.conf.parent()?.join("ceph.client.admin.keyring");
        keyring
            .exists()
            .then(|| ConnectOptions::new(&self.mon_host, "admin", Auth::Keyring(keyring)))
    }
}

impl TestCluster {
    /// The key's text, for what passes it on as a CSI secret.
    pub fn key_text(&self) -> String {
        self.key.expose().to_owned()
    }
}
