//! Fencing a node that still holds an image when the volume is taken from it.
//!
//! A client that maps an image read-write watches its header and holds the image's exclusive
//! lock: the kernel attacher takes it at the map (`exclusive`), rbd-fuse's librbd at its first
//! write. When a volume is unpublished at
//! a node whose clients still do either, the node did not unmap it: it is dead, cut off, or
//! stuck (Kubernetes force-detaches after a node's `out-of-service` taint, or after
//! kubelet's wait for unmount ran out). Before the volume can be published anywhere else,
//! those clients are blocklisted (`ceph osd blocklist add <address>` through the monitors:
//! every OSD refuses their requests from then on, so a late write fails with ESHUTDOWN
//! instead of reaching the image), and the lock they held is broken so that the next node
//! can take it at once.
//!
//! Order matters: the entries go in first and the controller waits for the OSD map that holds
//! them; the lock break that follows is a request with that map, and so is every request of
//! the next node (which connects later): an OSD catches up to a client's map before serving
//! it, so from the first of them on, the fenced clients' requests are refused there. What
//! they wrote before is simply the last thing they wrote.
//!
//! The addresses come from the image itself: its lockers and watchers, less the controller's
//! own client. Each is one client instance ("IP:PORT/NONCE"), so only the processes that held
//! this image are fenced, not the node's other clients; the entries expire after the
//! configured time (a week by default), or an operator removes them with
//! `ceph osd blocklist rm <address>` once the node is repaired.

use std::collections::BTreeSet;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use moor_rbd::Pool;
use tracing::{info, warn};

use super::ids::VolumeId;
use super::records::Fencing;
use super::{RbdBackend, Session};
use crate::error::Result;

impl RbdBackend {
    /// Fences the clients other than this controller that hold `id`'s image open; the fencing
    /// done, or None when no one held it.
    pub(super) fn fence_holders(
        &self,
        s: &Session,
        pool: &Pool,
        id: &VolumeId,
        node_id: &str,
    ) -> Result<Option<Fencing>> {
        let image_name = id.image();
        let fail = |what: &str, e| self.fail(s, format!("{what} {image_name}"), e);
        // Read-only: no watch of the controller's own among the watchers.
        let image = match pool.open_image_read_only(&image_name) {
            Ok(i) => i,
            Err(moor_rbd::Error::NotFound { .. }) => return Ok(None),
            Err(e) => return Err(fail("open", e)),
        };
        let me = s.cluster().instance_id();
        let myself = format!("client.{me}");
        let lockers: Vec<_> = image
            .lockers()
            .map_err(|e| fail("lockers of", e))?
            .lockers
            .into_iter()
            .filter(|l| l.client != myself)
            .collect();
        let watchers: Vec<_> = image
            .watchers()
            .map_err(|e| fail("watchers of", e))?
            .into_iter()
            .filter(|w| u64::try_from(w.client_id).ok() != Some(me))
            .collect();
        let addresses: BTreeSet<String> = lockers
            .iter()
            .map(|l| l.address.clone())
            .chain(watchers.iter().map(|w| w.address.clone()))
            .filter(|a| !a.is_empty())
            .collect();
        if addresses.is_empty() {
            return Ok(None);
        }
        warn!(
            volume = %id,
            node = node_id,
            clients = ?addresses,
            "unpublished while still open there: fencing before another node gets it"
        );
        let expiry = self.config.fence_expiry;
        for address in &addresses {
            s.cluster()
                .blocklist_add(address, expiry)
                .map_err(|e| fail(&format!("blocklist {address} holding"), e))?;
        }
        for l in &lockers {
            match image.break_lock(l) {
                Ok(()) | Err(moor_rbd::Error::NotFound { .. }) => {}
                // Fenced already; the next client to take the lock breaks it too.
                Err(e) => {
                    warn!(volume = %id, locker = l.client, error = %e, "cannot break the lock")
                }
            }
        }
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or(Duration::ZERO);
        info!(volume = %id, node = node_id, clients = ?addresses, "fenced");
        Ok(Some(Fencing {
            node_id: node_id.to_string(),
            addresses: addresses.into_iter().collect(),
            at_secs: now.as_secs(),
            expires_secs: (now + expiry).as_secs(),
        }))
    }
}
