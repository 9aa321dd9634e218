//! Ceph credentials: from the CSI secrets the CO passes, as ceph-csi takes them, and a cache
//! of connections, one per (monitors, user), kept open and reused.
//!
//! Secrets: `adminID` and `adminKey` (the provisioner's user), else `userID` and `userKey` (the
//! user ceph-csi's RBD StorageClasses give both sidecars and nodes); an ID may be written with
//! or without "client.". A key is a [`Secret`]: it is never shown, logged or put in an error.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Mutex, MutexGuard};

use moor_rbd::{Auth, Cluster, ConnectOptions, Secret};

use super::ids::ClusterRef;
use crate::error::{Error, Result};
use crate::secrets::Secrets;

/// The provisioner's user, in CSI secrets.
pub const ADMIN_ID_KEY: &str = "adminID";
/// Its key.
pub const ADMIN_KEY_KEY: &str = "adminKey";
/// The user, in CSI secrets (also the node's, for NodeStageVolume).
pub const USER_ID_KEY: &str = "userID";
/// Its key.
pub const USER_KEY_KEY: &str = "userKey";

/// A Ceph user and its key.
#[derive(Clone, PartialEq, Eq)]
pub struct Credentials {
    /// The user, without "client.".
    pub user: String,
    /// Its cephx key.
    pub key: Secret,
}

impl fmt::Debug for Credentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Credentials(client.{}, key <redacted>)", self.user)
    }
}

impl Credentials {
    /// The credentials in a request's secrets: the admin pair, else the user pair; None when
    /// neither is there. A pair given half is INVALID_ARGUMENT (naming the key, not its value).
    pub fn from_secrets(secrets: &Secrets) -> Result<Option<Self>> {
        for (id_key, key_key) in [(ADMIN_ID_KEY, ADMIN_KEY_KEY), (USER_ID_KEY, USER_KEY_KEY)] {
            match (secrets.get(id_key), secrets.get(key_key)) {
                (Some(id), Some(key)) => {
                    let user = id.strip_prefix("client.").unwrap_or(id);
                    if user.is_empty() || user.chars().any(|c| c.is_control() || c == ' ') {
                        return Err(Error::invalid(
                            "secrets",
                            format!("{id_key} is not a Ceph user name"),
                        ));
                    }
                    return Ok(Some(Self {
                        user: user.to_string(),
                        key: Secret::new(key),
                    }));
                }
                (Some(_), None) => {
                    return Err(Error::invalid(
                        "secrets",
                        format!("{id_key} is given without {key_key}"),
                    ));
                }
                (None, Some(_)) => {
                    return Err(Error::invalid(
                        "secrets",
                        format!("{key_key} is given without {id_key}"),
                    ));
                }
                (None, None) => {}
            }
        }
        Ok(None)
    }
}

struct Open {
    cluster: Cluster,
    key: Secret,
}

#[derive(Default)]
struct Inner {
    /// (monitors, user) → connection.
    open: HashMap<(String, String), Open>,
    /// The login last used successfully for each cluster: what RPCs without secrets use.
    last: HashMap<ClusterRef, (String, String)>,
}

/// Open connections, one per (monitors, user).
#[derive(Default)]
pub struct Connections {
    inner: Mutex<Inner>,
}

impl fmt::Debug for Connections {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n = self.lock().open.len();
        write!(f, "Connections({n} open)")
    }
}

impl Connections {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A connection to `mon_host` as `creds`: the open one when its key is the same, else a
    /// new one (which replaces it). Remembered as `cluster`'s last good login.
    pub fn get(
        &self,
        cluster: &ClusterRef,
        mon_host: &str,
        creds: &Credentials,
    ) -> std::result::Result<Cluster, moor_rbd::Error> {
        let login = (mon_host.to_string(), creds.user.clone());
        {
            let mut inner = self.lock();
            let open = inner
                .open
                .get(&login)
                .filter(|o| o.key == creds.key)
                .map(|o| o.cluster.clone());
            if let Some(c) = open {
                inner.last.insert(cluster.clone(), login);
                return Ok(c);
            }
        }
        // Connecting takes tens of milliseconds: not under the lock.
        // Fencing blocklists clients itself, for as long as it is told to: breaking a lock must
        // not add an entry of librbd's own (of a shorter default expiry) over it.
        let options = ConnectOptions::new(mon_host, &creds.user, Auth::Key(creds.key.clone()))
            .option("rbd_blocklist_on_break_lock", "false");
        let connected = Cluster::connect(&options)?;
        let mut inner = self.lock();
        inner.open.insert(
            login.clone(),
            Open {
                cluster: connected.clone(),
                key: creds.key.clone(),
            },
        );
        inner.last.insert(cluster.clone(), login);
        Ok(connected)
    }

    /// The connection last used for `cluster`, if still open, and its user.
    pub fn last_for(&self, cluster: &ClusterRef) -> Option<(Cluster, String)> {
        let inner = self.lock();
        let login = inner.last.get(cluster)?;
        inner
            .open
            .get(login)
            .map(|o| (o.cluster.clone(), login.1.clone()))
    }

    /// Clusters with an open connection.
    pub fn clusters(&self) -> Vec<ClusterRef> {
        let inner = self.lock();
        inner
            .last
            .iter()
            .filter(|(_, login)| inner.open.contains_key(*login))
            .map(|(c, _)| c.clone())
            .collect()
    }

    /// Forgets the connection of this login (it was fenced or broke); the next use connects
    /// again.
    pub fn evict(&self, mon_host: &str, user: &str) {
        self.lock()
            .open
            .remove(&(mon_host.to_string(), user.to_string()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn admin_credentials_come_first_and_keys_never_show() {
        let s = Secrets::from_pairs([
            ("userID", "user"),
            ("userKey", "AQBuser"),
            ("adminID", "client.admin"),
            ("adminKey", "AQBadmin"),
        ]);
        let c = Credentials::from_secrets(&s).unwrap().unwrap();
        assert_eq!(c.user, "admin");
        assert_eq!(c.key, Secret::new("AQBadmin"));
        assert!(!format!("{c:?}").contains("AQB"));
        let s = Secrets::from_pairs([("userID", "moor"), ("userKey", "AQBuser")]);
        assert_eq!(Credentials::from_secrets(&s).unwrap().unwrap().user, "moor");
        assert_eq!(Credentials::from_secrets(&Secrets::none()).unwrap(), None);
    }

    #[test]
    fn half_a_pair_is_invalid_and_the_error_shows_no_key() {
        let s = Secrets::from_pairs([("userKey", "AQBsecret")]);
        let e = Credentials::from_secrets(&s).unwrap_err();
        assert!(
            matches!(
                e,
                Error::InvalidArgument {
                    field: "secrets",
                    ..
                }
            ),
            "{e}"
        );
        assert!(!e.to_string().contains("AQB"), "{e}");
        let s = Secrets::from_pairs([("adminID", "a")]);
        assert!(Credentials::from_secrets(&s).is_err());
    }
}
