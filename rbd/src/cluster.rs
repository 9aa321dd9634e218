//! A connection to a Ceph cluster, kept open: connecting costs tens of milliseconds, a call on
//! an open connection much less.

use std::ffi::CString;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use crate::error::{Error, Result};
use crate::info::ClusterUsage;
use crate::pool::Pool;
use crate::secret::Secret;
use crate::sys::{self, Ioctx, Rados};

/// How the client proves who it is.
#[derive(Debug, Clone)]
pub enum Auth {
    /// The cephx key itself (what a Kubernetes Secret holds).
    Key(Secret),
    /// A keyring file holding the user's key.
    Keyring(PathBuf),
}

/// Where and as whom to connect.
#[derive(Debug, Clone)]
pub struct ConnectOptions {
    mon_host: String,
    user: String,
    auth: Auth,
    timeout: Duration,
    options: Vec<(String, String)>,
}

/// How long connecting and a monitor operation may take unless told otherwise.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(15);

impl ConnectOptions {
    /// `mon_host` as ceph.conf's `mon host` takes it ("10.0.0.1,10.0.0.2:6789" or
    /// "[v2:127.0.0.1:3300,v1:127.0.0.1:6789]"); `user` without "client." ("moor").
    pub fn new(mon_host: impl Into<String>, user: impl Into<String>, auth: Auth) -> Self {
        ConnectOptions {
            mon_host: mon_host.into(),
            user: user.into(),
            auth,
            timeout: DEFAULT_TIMEOUT,
            options: Vec::new(),
        }
    }

    /// How long connecting (`client_mount_timeout`) and each monitor operation
    /// (`rados_mon_op_timeout`) may take. OSD operations are not bounded here: librbd's own
    /// watches and locks expect them not to be (set `rados_osd_op_timeout` to bound them).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Any other Ceph client option, set after this crate's defaults (so it overrides them).
    /// The key is not an option: give it as [`Auth::Key`].
    pub fn option(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.options.push((name.into(), value.into()));
        self
    }

    /// The user, without "client.".
    pub fn user(&self) -> &str {
        &self.user
    }
}

/// A connected cluster. Cloning shares the connection; it is shut down when the last clone,
/// and every pool and image opened through it, is dropped.
#[derive(Debug, Clone)]
pub struct Cluster {
    pub(crate) rados: Arc<Rados>,
    user: String,
}

fn c_string(what: &'static str, value: &str) -> Result<CString> {
    CString::new(value).map_err(|_| Error::Invalid {
        what,
        reason: format!("{value:?} contains a NUL byte"),
    })
}

impl Cluster {
    /// Loads librados and librbd (on first use), connects and authenticates.
    pub fn connect(options: &ConnectOptions) -> Result<Cluster> {
        let api = sys::api()?;
        if options.user.is_empty() || options.user.contains('\0') {
            return Err(Error::Invalid {
                what: "user",
                reason: format!("{:?} is empty or contains a NUL byte", options.user),
            });
        }
        if options.mon_host.trim().is_empty() {
            return Err(Error::Invalid {
                what: "mon_host",
                reason: "it is empty".into(),
            });
        }
        let entity = format!("client.{}", options.user);
        let subject = format!("{entity} at {}", options.mon_host);
        let rados = Rados::create(api, &c_string("user", &entity)?)
            .map_err(|f| Error::from_failure(f, &subject))?;

        let seconds = format!("{}", options.timeout.as_secs_f64().max(0.001));
        // librados's own logging would go to this process's stderr; errors come back as
        // errnos instead. `options` may turn it back on.
        let mut settings: Vec<(&str, &str)> = vec![
            ("log_to_stderr", "false"),
            ("err_to_stderr", "false"),
            ("client_mount_timeout", &seconds),
            ("rados_mon_op_timeout", &seconds),
            ("mon_host", &options.mon_host),
        ];
        if let Auth::Keyring(path) = &options.auth {
            let path = path.to_str().ok_or_else(|| Error::Invalid {
                what: "keyring path",
                reason: format!("{} is not UTF-8", path.display()),
            })?;
            settings.push(("keyring", path));
        }
        for (name, value) in &options.options {
            if name == "key" || name == "keyfile" {
                return Err(Error::Invalid {
                    what: "Ceph option",
                    reason: format!("{name} cannot be set as an option: give the key as Auth::Key"),
                });
            }
            settings.push((name, value));
        }
        for (name, value) in settings {
            set(&rados, name, value)?;
        }
        if let Auth::Key(secret) = &options.auth {
            if secret.is_empty() {
                return Err(Error::Invalid {
                    what: "key",
                    reason: "it is empty".into(),
                });
            }
            // The key goes to librados and nowhere else: an error names the option only.
            let mut key = c_string_secret(secret)?;
            let set_key = rados.conf_set(c"key", &key);
            wipe(&mut key);
            set_key.map_err(|f| Error::Invalid {
                what: "Ceph option",
                reason: format!("key: refused ({})", crate::error::Errno(f.errno)),
            })?;
        }
        rados
            .connect()
            .map_err(|f| Error::from_failure(f, &subject))?;
        Ok(Cluster {
            rados: Arc::new(rados),
            user: options.user.clone(),
        })
    }

    /// The user this connection authenticated as, without "client.".
    pub fn user(&self) -> &str {
        &self.user
    }

    /// Opens a pool (an I/O context on it; cheap, and kept as long as the `Pool` lives).
    pub fn pool(&self, name: &str) -> Result<Pool> {
        let c_name = c_string("pool name", name)?;
        let ioctx = Ioctx::create(&self.rados, &c_name)
            .map_err(|f| Error::from_failure(f, format!("pool {name}")))?;
        Ok(Pool::new(Arc::new(ioctx), name.to_owned()))
    }

    /// The pool's id; [`Error::NotFound`] when there is no such pool.
    pub fn pool_id(&self, name: &str) -> Result<i64> {
        let c_name = c_string("pool name", name)?;
        self.rados
            .pool_lookup(&c_name)
            .map_err(|f| Error::from_failure(f, format!("pool {name}")))
    }

    /// The raw capacity and usage of the whole cluster (before replication).
    pub fn usage(&self) -> Result<ClusterUsage> {
        self.rados
            .cluster_stat()
            .map_err(|f| Error::from_failure(f, "the cluster"))
    }

    /// Runs a monitor command (a JSON object, "format": "json" added) and parses its output.
    pub fn mon_command(&self, command: &serde_json::Value) -> Result<serde_json::Value> {
        mon_command(&self.rados, command)
    }
}

pub(crate) fn mon_command(rados: &Rados, command: &serde_json::Value) -> Result<serde_json::Value> {
    let mut command = command.clone();
    let prefix = command
        .get("prefix")
        .and_then(|p| p.as_str())
        .unwrap_or("?")
        .to_owned();
    if let Some(object) = command.as_object_mut() {
        object.insert("format".into(), "json".into());
    }
    let text = c_string("monitor command", &command.to_string())?;
    let output = rados
        .mon_command(&text)
        .map_err(|(f, status)| Error::MonCommand {
            command: prefix.clone(),
            detail: format!(
                "{}: {} {}",
                f.call,
                crate::error::Errno(f.errno),
                status.trim()
            ),
        })?;
    serde_json::from_slice(&output).map_err(|e| Error::MonCommand {
        command: prefix,
        detail: format!("unreadable output: {e}"),
    })
}

fn set(rados: &Rados, name: &str, value: &str) -> Result<()> {
    let c_name = c_string("Ceph option", name)?;
    let c_value = c_string("Ceph option value", value)?;
    rados
        .conf_set(&c_name, &c_value)
        .map_err(|f| Error::Invalid {
            what: "Ceph option",
            reason: format!(
                "{name} = {value}: refused ({})",
                crate::error::Errno(f.errno)
            ),
        })
}

fn c_string_secret(secret: &Secret) -> Result<CString> {
    CString::new(secret.expose()).map_err(|_| Error::Invalid {
        what: "key",
        reason: "it contains a NUL byte".into(),
    })
}

/// Overwrites a C string copy of the key.
fn wipe(key: &mut CString) {
    let mut bytes = std::mem::take(key).into_bytes();
    bytes.fill(0);
    std::hint::black_box(&bytes);
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: &str = "AQBcVdNm8nV7JRAAm0vIYSlZ0yq3xQ0qkQ6y5A==";

    #[test]
    fn options_never_show_the_key() {
        let options = ConnectOptions::new("127.0.0.1:3300", "moor", Auth::Key(Secret::new(KEY)))
            .option("rbd_cache", "false");
        let shown = format!("{options:?} {options:#?}");
        assert!(!shown.contains(KEY) && !shown.contains("AQB"), "{shown}");
        assert!(shown.contains("<redacted>"), "{shown}");
    }

    #[test]
    fn the_key_cannot_be_smuggled_in_as_an_option() {
        // Refused before the key would reach an error message, whether or not librados loads.
        let options = ConnectOptions::new("127.0.0.1:3300", "moor", Auth::Key(Secret::new("x")))
            .option("key", KEY);
        let e = Cluster::connect(&options).unwrap_err();
        let shown = format!("{e} {e:?}");
        assert!(!shown.contains(KEY), "{shown}");
        assert!(
            matches!(
                e,
                Error::Invalid {
                    what: "Ceph option",
                    ..
                } | Error::NotInstalled { .. }
            ),
            "{e:?}"
        );
    }
}
