//! The controller's list of Ceph clusters: what a StorageClass's `clusterID` names.
//!
//! A JSON file (`--rbd-clusters`), the same shape as ceph-csi's `config.json` so the same
//! ConfigMap serves both (keys moor does not use are ignored):
//!
//! ```json
//! [
//!   {
//!     "clusterID": "prod",
//!     "monitors": ["10.0.0.1:6789", "10.0.0.2:6789"],
//!     "user": "moor",
//!     "keyFile": "/etc/moor/ceph/prod.key"
//!   }
//! ]
//! ```
//!
//! `user` with `keyFile` (the bare key, e.g. a mounted Kubernetes Secret) or `keyring` (a
//! keyring file) are optional: they are the controller's own credentials for the RPCs that
//! carry no secrets (ListVolumes, GetCapacity, ControllerGetVolume) and for StorageClasses
//! that name no secrets. The key file is read when a connection is made, so a rotated Secret
//! is picked up without a restart.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use moor_rbd::Secret;
use serde::Deserialize;

use super::ids::{cluster_id_ok, normalize_monitors};

/// What can be wrong with the cluster list.
#[derive(Debug, thiserror::Error)]
pub enum ClustersError {
    /// The file cannot be read.
    #[error("cluster list {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The file is not a JSON list of clusters.
    #[error("cluster list: not a JSON list of clusters: {0}")]
    Parse(#[from] serde_json::Error),
    /// An entry is not usable.
    #[error("cluster list: entry {index} ({cluster_id:?}): {reason}")]
    Invalid {
        /// Its place in the list (0-based).
        index: usize,
        /// Its clusterID as written.
        cluster_id: String,
        /// What is wrong.
        reason: String,
    },
    /// Two entries have the same clusterID.
    #[error("cluster list: clusterID {0:?} appears twice")]
    Duplicate(String),
    /// The controller's own key for a cluster cannot be read.
    #[error("the key of client.{user} for cluster {cluster_id}: {reason}")]
    Key {
        /// The cluster.
        cluster_id: String,
        /// The user.
        user: String,
        /// Why.
        reason: String,
    },
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Monitors {
    List(Vec<String>),
    Text(String),
}

#[derive(Debug, Deserialize)]
struct Entry {
    #[serde(rename = "clusterID")]
    cluster_id: String,
    monitors: Monitors,
    #[serde(default)]
    user: Option<String>,
    #[serde(default, rename = "keyFile")]
    key_file: Option<PathBuf>,
    #[serde(default)]
    keyring: Option<PathBuf>,
}

/// Where the controller's own key for a cluster is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeySource {
    /// A file holding the key alone.
    KeyFile(PathBuf),
    /// A keyring file with a `[client.USER]` section.
    Keyring(PathBuf),
}

/// The controller's own credentials for a cluster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OwnCredentials {
    /// The user, without "client.".
    pub user: String,
    /// Where its key is.
    pub key: KeySource,
}

/// One cluster of the list.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterConfig {
    /// Its clusterID.
    pub id: String,
    /// Its monitors, comma-separated (`mon_host`).
    pub mon_host: String,
    /// The controller's own credentials, if given.
    pub credentials: Option<OwnCredentials>,
}

impl ClusterConfig {
    /// Reads the controller's own key for this cluster (None when the list gives none).
    pub fn own_key(&self) -> Result<Option<(String, Secret)>, ClustersError> {
        let Some(c) = &self.credentials else {
            return Ok(None);
        };
        let fail = |reason: String| ClustersError::Key {
            cluster_id: self.id.clone(),
            user: c.user.clone(),
            reason,
        };
        let read = |p: &Path| {
            std::fs::read_to_string(p).map_err(|e| fail(format!("{}: {e}", p.display())))
        };
        let key = match &c.key {
            KeySource::KeyFile(p) => Secret::new(read(p)?),
            KeySource::Keyring(p) => Secret::from_keyring(&read(p)?, &c.user)
                .ok_or_else(|| fail(format!("{} has no key for client.{}", p.display(), c.user)))?,
        };
        if key.is_empty() {
            return Err(fail("the key is empty".into()));
        }
        Ok(Some((c.user.clone(), key)))
    }
}

/// The cluster list, by clusterID.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Clusters {
    by_id: BTreeMap<String, ClusterConfig>,
}

impl Clusters {
    /// No clusters (StorageClasses must name monitors).
    pub fn empty() -> Self {
        Self::default()
    }

    /// Reads the list from a file.
    pub fn load(path: &Path) -> Result<Self, ClustersError> {
        let text = std::fs::read_to_string(path).map_err(|source| ClustersError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        Self::from_json(&text)
    }

    /// Parses the list.
    pub fn from_json(text: &str) -> Result<Self, ClustersError> {
        let entries: Vec<Entry> = serde_json::from_str(text)?;
        let mut by_id = BTreeMap::new();
        for (index, e) in entries.into_iter().enumerate() {
            let invalid = |reason: &str| ClustersError::Invalid {
                index,
                cluster_id: e.cluster_id.clone(),
                reason: reason.to_string(),
            };
            if !cluster_id_ok(&e.cluster_id) {
                return Err(invalid(
                    "a clusterID is 1 to 64 letters, digits, '.', '_' or '-'",
                ));
            }
            let joined = match &e.monitors {
                Monitors::List(l) => l.join(","),
                Monitors::Text(t) => t.clone(),
            };
            let mon_host = normalize_monitors(&joined)
                .ok_or_else(|| invalid("monitors must be a non-empty list of addresses"))?;
            let credentials = match (&e.user, &e.key_file, &e.keyring) {
                (None, None, None) => None,
                (Some(user), Some(f), None) => Some(OwnCredentials {
                    user: user.strip_prefix("client.").unwrap_or(user).to_string(),
                    key: KeySource::KeyFile(f.clone()),
                }),
                (Some(user), None, Some(k)) => Some(OwnCredentials {
                    user: user.strip_prefix("client.").unwrap_or(user).to_string(),
                    key: KeySource::Keyring(k.clone()),
                }),
                _ => {
                    return Err(invalid(
                        "give user with exactly one of keyFile and keyring, or none of them",
                    ));
                }
            };
            if credentials.as_ref().is_some_and(|c| c.user.is_empty()) {
                return Err(invalid("user is empty"));
            }
            let cfg = ClusterConfig {
                id: e.cluster_id.clone(),
                mon_host,
                credentials,
            };
            if by_id.insert(e.cluster_id.clone(), cfg).is_some() {
                return Err(ClustersError::Duplicate(e.cluster_id));
            }
        }
        Ok(Self { by_id })
    }

    /// The cluster of this clusterID.
    pub fn get(&self, id: &str) -> Option<&ClusterConfig> {
        self.by_id.get(id)
    }

    /// Every cluster, by clusterID.
    pub fn iter(&self) -> impl Iterator<Item = &ClusterConfig> {
        self.by_id.values()
    }

    /// How many there are.
    pub fn len(&self) -> usize {
        self.by_id.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.by_id.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ceph_csi_shaped_lists_are_read() {
        let c = Clusters::from_json(
            r#"[
              {"clusterID": "prod", "monitors": ["10.0.0.1:6789", " 10.0.0.2:6789"],
               "rbd": {"radosNamespace": ""}, "cephFS": {}},
              {"clusterID": "lab", "monitors": "[v2:127.0.0.1:3300,v1:127.0.0.1:6789]",
               "user": "client.moor", "keyFile": "/k"}
            ]"#,
        )
        .unwrap();
        assert_eq!(c.len(), 2);
        let prod = c.get("prod").unwrap();
        assert_eq!(prod.mon_host, "10.0.0.1:6789,10.0.0.2:6789");
        assert_eq!(prod.credentials, None);
        let lab = c.get("lab").unwrap();
        assert_eq!(
            lab.credentials,
            Some(OwnCredentials {
                user: "moor".into(),
                key: KeySource::KeyFile("/k".into())
            })
        );
    }

    #[test]
    fn bad_lists_say_what_is_wrong() {
        for (text, want) in [
            ("{}", "not a JSON list"),
            (
                r#"[{"clusterID": "a b", "monitors": ["m"]}]"#,
                "clusterID is 1 to 64",
            ),
            (r#"[{"clusterID": "a", "monitors": []}]"#, "monitors must"),
            (
                r#"[{"clusterID": "a", "monitors": ["m"], "user": "u"}]"#,
                "exactly one of keyFile",
            ),
            (
                r#"[{"clusterID": "a", "monitors": ["m"]}, {"clusterID": "a", "monitors": ["n"]}]"#,
                "appears twice",
            ),
        ] {
            let e = Clusters::from_json(text).unwrap_err().to_string();
            assert!(e.contains(want), "{text}: {e}");
        }
    }

    #[test]
    fn own_keys_come_from_a_key_file_or_a_keyring() {
        let dir = std::env::temp_dir().join(format!("moor-clusters-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let key = dir.join("key");
        std::fs::write(&key, "AQBkey==\n").unwrap();
        let ring = dir.join("keyring");
        std::fs::write(&ring, "[client.moor]\n\tkey = AQBring==\n").unwrap();
        let cfg = |k: KeySource| ClusterConfig {
            id: "c".into(),
            mon_host: "m".into(),
            credentials: Some(OwnCredentials {
                user: "moor".into(),
                key: k,
            }),
        };
        let (user, secret) = cfg(KeySource::KeyFile(key.clone()))
            .own_key()
            .unwrap()
            .unwrap();
        assert_eq!(user, "moor");
        assert_eq!(secret, Secret::new("AQBkey=="));
        let (_, secret) = cfg(KeySource::Keyring(ring)).own_key().unwrap().unwrap();
        assert_eq!(secret, Secret::new("AQBring=="));
        let e = cfg(KeySource::KeyFile(dir.join("missing")))
            .own_key()
            .unwrap_err();
        assert!(e.to_string().contains("client.moor"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
