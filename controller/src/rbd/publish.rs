//! ControllerPublishVolume and ControllerUnpublishVolume: which nodes may map an image.
//!
//! The publications are part of the volume's record in the pool's metadata (see
//! [`super::records`]): they survive a controller restart or a move, every controller of the
//! cluster sees them, and writing them needs no image lock, so neither a node that maps the
//! image nor a dead one that held it can stall them. A volume published for one writer (any
//! single-node mode) is refused at a second node (FAILED_PRECONDITION) until it is
//! unpublished at the first; MULTI_NODE_READER_ONLY volumes are published at many nodes,
//! read-only.
//!
//! Unpublishing a node that could write, while a client still has the image open (it holds
//! the image's lock, or watches its header), fences those clients first (see `fence`): that
//! is a force-detach from a node that did not unmap, and the volume may not go to another
//! node while the first can still write to it.

use tracing::info;

use super::ids::{ClusterRef, VolumeId};
use super::parameters;
use super::records::{FENCINGS_KEPT, Publication, Registry};
use super::volumes::volume_key;
use super::{RbdBackend, Session};
use crate::backend::{AccessMode, PublishContext, PublishRequest, Qos};
use crate::encryption::rotation::RecordKeys;
use crate::error::{Error, Result, trunc};

use moor_runtime::contract::QOS_LIMITS_KEY;
pub use moor_runtime::contract::{
    RBD_CLUSTER_ID_KEY as CLUSTER_ID_KEY, RBD_EXCLUSIVE_KEY as EXCLUSIVE_KEY,
    RBD_IMAGE_KEY as IMAGE_KEY, RBD_MONITORS_KEY as MONITORS_KEY, RBD_POOL_KEY as POOL_KEY,
    RBD_READ_ONLY_KEY as READ_ONLY_KEY,
};

/// What the node is told: the image, the monitors, how to map it (read-only; with the
/// exclusive lock held, when the volume's StorageClass asks and the map is read-write), and an
/// encrypted volume's wrapped data keys as its image's metadata holds them now (`keys`:
/// `encryptedDEK`, and `encryptedDEKPending` during a rotation), which the node tries before
/// the volume context's.
fn publish_context(
    s: &Session,
    id: &VolumeId,
    qos: &Qos,
    (readonly, exclusive): (bool, bool),
    keys: Option<RecordKeys>,
) -> PublishContext {
    let mut ctx = PublishContext::from([
        (QOS_LIMITS_KEY.to_string(), qos.to_context()),
        (POOL_KEY.to_string(), id.location.pool.clone()),
        (IMAGE_KEY.to_string(), id.image()),
        (MONITORS_KEY.to_string(), s.mon_host.clone()),
        (READ_ONLY_KEY.to_string(), readonly.to_string()),
    ]);
    if let ClusterRef::Id(c) = &id.location.cluster {
        ctx.insert(CLUSTER_ID_KEY.to_string(), c.clone());
    }
    if exclusive && !readonly {
        ctx.insert(EXCLUSIVE_KEY.to_string(), "true".to_string());
    }
    super::keys::publish_keys(&mut ctx, keys);
    ctx
}

impl RbdBackend {
    pub(super) fn publish_impl(&self, req: &PublishRequest) -> Result<PublishContext> {
        let not_found = || Error::VolumeNotFound(trunc(&req.volume_id).to_string());
        let id = VolumeId::parse(&req.volume_id).ok_or_else(not_found)?;
        if let Some(nodes) = &self.config.nodes
            && !nodes.contains(&req.node_id)
        {
            return Err(Error::NodeNotFound {
                node: trunc(&req.node_id).to_string(),
                serves: nodes.iter().cloned().collect::<Vec<_>>().join(", "),
            });
        }
        let _claim = self.inflight.claim(&[&volume_key(&id)], &[])?;
        let (id, s, pool, mut rec) = self.ready_volume(&id.to_string())?;
        parameters::check_capability(&req.capability, &rec.parameters)
            .map_err(|r| Error::invalid("volume_capability", r))?;
        for (k, v) in &req.context {
            if rec.context.get(k).is_some_and(|mine| mine != v) {
                return Err(Error::invalid(
                    "volume_context",
                    format!("{k:?} does not match the volume's context"),
                ));
            }
        }
        let readonly = req.readonly || req.capability.mode.is_reader_only();
        let exclusive = rec.parameters.contains_key(parameters::EXCLUSIVE_LOCK_KEY);
        let mode = req.capability.mode.name();
        let keys = self.publish_keys_of(&s, &pool, &id, &rec)?;
        if let Some(p) = rec.publications.iter().find(|p| p.node_id == req.node_id) {
            if p.readonly != readonly || p.mode != mode {
                return Err(Error::PublishedIncompatible {
                    volume: id.to_string(),
                    node: p.node_id.clone(),
                    reason: format!("it is published {} with {}", access(p.readonly), p.mode),
                });
            }
            return Ok(publish_context(
                &s,
                &id,
                &rec.qos,
                (readonly, exclusive),
                keys,
            ));
        }
        let shared = req.capability.mode == AccessMode::MultiNodeReaderOnly;
        let reader_only = AccessMode::MultiNodeReaderOnly.name();
        if let Some(other) = rec.publications.first()
            && !(shared && rec.publications.iter().all(|p| p.mode == reader_only))
        {
            return Err(Error::PublishedElsewhere {
                volume: id.to_string(),
                node: other.node_id.clone(),
            });
        }
        rec.publications.push(Publication {
            node_id: req.node_id.clone(),
            readonly,
            mode: mode.to_string(),
        });
        Registry::new(&pool).put_volume(&id.suffix, &rec)?;
        info!(volume = %id, node = %req.node_id, readonly, mode, "published");
        Ok(publish_context(
            &s,
            &id,
            &rec.qos,
            (readonly, exclusive),
            keys,
        ))
    }

    pub(super) fn unpublish_impl(&self, raw: &str, node_id: Option<&str>) -> Result<()> {
        let Some(id) = VolumeId::parse(raw) else {
            return Ok(());
        };
        let _claim = self.inflight.claim(&[&volume_key(&id)], &[])?;
        let s = self.session(&id.location.cluster)?;
        let Some(pool) = self.open_pool(&s, &id.location.pool)? else {
            return Ok(());
        };
        let reg = Registry::new(&pool);
        let Some(mut rec) = reg.volume(&id.suffix)? else {
            return Ok(());
        };
        let (gone, kept): (Vec<Publication>, Vec<Publication>) = rec
            .publications
            .iter()
            .cloned()
            .partition(|p| node_id.is_none_or(|n| n == p.node_id));
        if gone.is_empty() {
            return Ok(());
        }
        // A node that could write gives the image up only when none of its clients can write
        // any more: those still holding the image are fenced before the record lets another
        // node have it. A failure leaves the publication in place; the CO retries.
        for p in gone.iter().filter(|p| !p.readonly) {
            if let Some(f) = self.fence_holders(&s, &pool, &id, &p.node_id)? {
                rec.fencings.push(f);
                let extra = rec.fencings.len().saturating_sub(FENCINGS_KEPT);
                rec.fencings.drain(..extra);
            }
        }
        rec.publications = kept;
        reg.put_volume(&id.suffix, &rec)?;
        for p in &gone {
            info!(volume = %id, node = %p.node_id, "unpublished");
        }
        Ok(())
    }
}

fn access(readonly: bool) -> &'static str {
    if readonly { "read-only" } else { "read-write" }
}
