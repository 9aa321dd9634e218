//! Fencing clients: the OSD map's blocklist. A blocklisted client's requests are refused by
//! every OSD (its writes fail with ESHUTDOWN) until the entry expires or is removed.

use std::ffi::CString;
use std::time::Duration;

use crate::cluster::Cluster;
use crate::error::{Errno, Error, Result};

impl Cluster {
    /// This connection's instance id: other clients (an image's watchers) see it as
    /// `client.N` with this N.
    pub fn instance_id(&self) -> u64 {
        self.rados.instance_id()
    }

    /// Adds a client address ("IP:PORT/NONCE", one client instance; "IP" or "IP:0/0", every
    /// client of that host) to the blocklist for `expire`, and waits until this client has the
    /// OSD map that holds it: from then on, every request this client sends carries that map,
    /// so an OSD serving it has caught up first and refuses the blocklisted client from then
    /// on. Ceph before 16 (Pacific) calls it the blacklist; both names are tried.
    pub fn blocklist_add(&self, address: &str, expire: Duration) -> Result<()> {
        let seconds = expire.as_secs_f64().max(1.0);
        self.blocklist("add", address, Some(seconds))?;
        self.rados
            .wait_for_latest_osdmap()
            .map_err(|f| Error::from_failure(f, "the OSD map"))
    }

    /// Removes a client address from the blocklist (it was not there: success).
    pub fn blocklist_remove(&self, address: &str) -> Result<()> {
        self.blocklist("rm", address, None)
    }

    fn blocklist(&self, op: &str, address: &str, expire: Option<f64>) -> Result<()> {
        let address = address.trim();
        if address.is_empty() || address.contains(char::is_whitespace) {
            return Err(Error::Invalid {
                what: "client address",
                reason: format!("{address:?} is not an address"),
            });
        }
        let mut last = None;
        for (prefix, op_key) in [
            ("osd blocklist", "blocklistop"),
            ("osd blacklist", "blacklistop"),
        ] {
            let mut command = serde_json::json!({
                "prefix": prefix,
                op_key: op,
                "addr": address,
            });
            if let Some(seconds) = expire {
                command["expire"] = seconds.into();
            }
            let text = CString::new(command.to_string()).map_err(|_| Error::Invalid {
                what: "client address",
                reason: "contains a NUL byte".into(),
            })?;
            match self.rados.mon_command(&text) {
                Ok(_) => return Ok(()),
                // An older or newer monitor that does not know this spelling of the command.
                Err((f, status)) if f.errno == libc::EINVAL && last.is_none() => {
                    last = Some(Error::MonCommand {
                        command: prefix.into(),
                        detail: format!("{}: {} {}", f.call, Errno(f.errno), status.trim()),
                    });
                }
                Err((f, status)) => {
                    return Err(Error::MonCommand {
                        command: prefix.into(),
                        detail: format!("{}: {} {}", f.call, Errno(f.errno), status.trim()),
                    });
                }
            }
        }
        Err(last.unwrap_or_else(|| Error::MonCommand {
            command: "osd blocklist".into(),
            detail: "refused".into(),
        }))
    }
}
