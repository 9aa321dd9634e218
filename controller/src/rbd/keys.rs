//! An RBD volume's wrapped data keys (docs/encryption.md, "Rotation"): kept in its image's
//! metadata, which is the truth for them, as the record is for an embedded volume's. The
//! state machine is [`crate::encryption::rotation`]'s, the same for both backends; this is
//! where the RBD backend reads and writes what it decides.
//!
//! ```text
//! moor.csi.io/encryptedDEK          the current key (written at CreateVolume, before the record)
//! moor.csi.io/encryptedDEKPending   the key a rotation in progress moves the slot to
//! moor.csi.io/keyRotation           the rotation count, when the current key became current
//!                                   and the PV's or PVC's schedule (JSON, one write)
//! ```
//!
//! Each key is one metadata write, atomic alone; a change of both is two, ordered so that a
//! crash between them leaves keys that still open the volume and that the next run of the
//! same step finishes: the current key first, then the pending one. A promotion writes the
//! pending key as the current one, then removes the pending one: a crash between leaves both
//! the same, which reads as promoted (the node had verified it). A KEK rotation cut between
//! leaves the current key under the new KEK and the pending one under the old, each naming
//! its KEK, which the rotation run again finishes. A begin writes the pending key alone.
//!
//! Image metadata is written through the image's exclusive lock when it has one: librbd asks
//! the client that holds it (a node that mapped the image) to hand it over and takes it back
//! after, as for a snapshot. The volume context's `encryptedDEK`, which the CO keeps and
//! cannot change, stays what CreateVolume answered; ControllerPublishVolume gives the node
//! the image's keys (`encryptedDEK`, `encryptedDEKPending`), which it tries first.

use moor_rbd::{Image, Pool};
use tracing::info;

use std::collections::BTreeSet;

use super::ids::{ClusterRef, Location, SnapshotId, VolumeId};
use super::records::{Registry, SnapshotState, VolumeRecord, VolumeState};
use super::volumes::{DEK_METADATA_KEY, snapshot_key, volume_key};
use super::{RbdBackend, Session};
use crate::backend::PublishContext;
use crate::encryption::rotation::{RecordKeys, swap_snapshot_key};
use crate::error::{Error, Result, trunc};
use moor_runtime::contract::{ENCRYPTED_DEK_KEY, ENCRYPTED_DEK_PENDING_KEY};

/// The image metadata key of the wrapped data key a rotation in progress moves the volume's
/// slot to.
pub const DEK_PENDING_METADATA_KEY: &str = "moor.csi.io/encryptedDEKPending";

/// The image metadata key of what a scheduled rotation counts on: the rotations finished,
/// when the current key became current, the schedule set on the PV or PVC ([`RotationState`]).
pub const ROTATION_METADATA_KEY: &str = "moor.csi.io/keyRotation";

/// [`RecordKeys`]' fields besides the keys, kept together in one metadata value so that they
/// change in one write. Written after the keys: a crash between leaves the keys changed and
/// the count not, which at worst lets a scheduled rotation run once more than its period asks
/// (a rotation is safe at any instant), never skips one.
#[derive(Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
struct RotationState {
    #[serde(default)]
    rotations: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    current_since: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    schedule: Option<String>,
}

impl RotationState {
    fn of(keys: &RecordKeys) -> Self {
        RotationState {
            rotations: keys.rotations,
            current_since: keys.current_since,
            schedule: keys.schedule.clone(),
        }
    }
}

/// The keys `image`'s metadata holds for the volume whose record is `rec`: its current key
/// (the record's context's when the metadata has none, as for an image written before the
/// metadata was), its pending one unless it is the current one (a promotion cut between its
/// two writes); None for a volume in the clear.
pub(super) fn image_keys(
    image: &Image,
    rec: &VolumeRecord,
) -> moor_rbd::Result<Option<RecordKeys>> {
    let Some(context) = rec.context.get(ENCRYPTED_DEK_KEY) else {
        return Ok(None);
    };
    let current = image
        .metadata(DEK_METADATA_KEY)?
        .unwrap_or_else(|| context.clone());
    let pending = image
        .metadata(DEK_PENDING_METADATA_KEY)?
        .filter(|p| *p != current);
    // A value moor did not write (changed by hand) reads as none: the schedule's clock starts
    // again, which delays a rotation by at most one period and skips none.
    let state: RotationState = image
        .metadata(ROTATION_METADATA_KEY)?
        .and_then(|v| serde_json::from_str(&v).ok())
        .unwrap_or_default();
    Ok(Some(RecordKeys {
        current,
        pending,
        rotations: state.rotations,
        current_since: state.current_since,
        schedule: state.schedule,
    }))
}

/// `keys` into a publish_context, as the embedded backend gives them.
pub(super) fn publish_keys(ctx: &mut PublishContext, keys: Option<RecordKeys>) {
    if let Some(keys) = keys {
        ctx.insert(ENCRYPTED_DEK_KEY.to_string(), keys.current);
        if let Some(p) = keys.pending {
            ctx.insert(ENCRYPTED_DEK_PENDING_KEY.to_string(), p);
        }
    }
}

impl RbdBackend {
    /// The image of the ready volume `raw`, open, with its keys.
    fn keyed_image(&self, raw: &str) -> Result<(VolumeId, Session, Image, RecordKeys)> {
        let (id, s, pool, rec) = self.ready_volume(raw)?;
        let name = id.image();
        let image = pool
            .open_image(&name)
            .map_err(|e| self.fail(&s, format!("open {name}"), e))?;
        let keys = image_keys(&image, &rec)
            .map_err(|e| self.fail(&s, format!("metadata of {name}"), e))?
            .ok_or_else(|| {
                Error::FailedPrecondition(format!(
                    "volume {}: not encrypted, it has no data key",
                    trunc(raw)
                ))
            })?;
        Ok((id, s, image, keys))
    }

    /// The keys a ControllerPublishVolume gives the node: the image's, for an encrypted
    /// volume; None for one in the clear (its image not opened).
    pub(super) fn publish_keys_of(
        &self,
        s: &Session,
        pool: &Pool,
        id: &VolumeId,
        rec: &VolumeRecord,
    ) -> Result<Option<RecordKeys>> {
        if !rec.context.contains_key(ENCRYPTED_DEK_KEY) {
            return Ok(None);
        }
        let name = id.image();
        let image = pool
            .open_image(&name)
            .map_err(|e| self.fail(s, format!("open {name}"), e))?;
        image_keys(&image, rec).map_err(|e| self.fail(s, format!("metadata of {name}"), e))
    }

    pub(super) fn volume_keys_impl(&self, raw: &str) -> Result<RecordKeys> {
        let id = VolumeId::parse(raw).ok_or_else(|| Error::VolumeNotFound(trunc(raw).into()))?;
        let _claim = self.inflight.claim(&[], &[&volume_key(&id)])?;
        Ok(self.keyed_image(raw)?.3)
    }

    pub(super) fn write_volume_keys_impl(
        &self,
        raw: &str,
        before: &RecordKeys,
        after: &RecordKeys,
    ) -> Result<()> {
        let id = VolumeId::parse(raw).ok_or_else(|| Error::VolumeNotFound(trunc(raw).into()))?;
        let _claim = self.inflight.claim(&[&volume_key(&id)], &[])?;
        let (id, s, image, now) = self.keyed_image(raw)?;
        if now != *before {
            return Err(Error::OperationPending(format!(
                "volume {id}: its data keys changed since they were read; run the rotation again"
            )));
        }
        let name = id.image();
        let set = |key: &str, value: Option<&str>| {
            image
                .set_metadata(key, value)
                .map_err(|e| self.fail(&s, format!("set {key} of {name}"), e))
        };
        if after.current != before.current {
            set(DEK_METADATA_KEY, Some(&after.current))?;
        }
        if after.pending != before.pending {
            set(DEK_PENDING_METADATA_KEY, after.pending.as_deref())?;
        }
        let state = RotationState::of(after);
        if state != RotationState::of(before) {
            let value = serde_json::to_string(&state)
                .map_err(|e| Error::Internal(format!("volume {id}: its rotation state: {e}")))?;
            set(ROTATION_METADATA_KEY, Some(&value))?;
        }
        if after != before {
            info!(volume = %id, pending = after.pending.is_some(), "its data keys recorded");
        }
        Ok(())
    }

    /// Every ready encrypted volume in every RBD pool of every cluster the controller knows
    /// (its cluster list, and those it has a connection to). Unlike a listing, a cluster that
    /// cannot be read is not left out: FAILED_PRECONDITION naming it, before a KEK rotation
    /// writes anything (it asks for these first), so that a rotation never reports done while
    /// a record it did not see stays under the KEK the operator would then retire.
    pub(super) fn encrypted_volume_ids_impl(&self) -> Result<Vec<String>> {
        let mut refs: BTreeSet<ClusterRef> = self
            .clusters()
            .iter()
            .map(|c| ClusterRef::Id(c.id.clone()))
            .collect();
        refs.extend(self.connections.clusters());
        let mut ids = Vec::new();
        for cref in refs {
            let unseen = |e: Error| {
                Error::FailedPrecondition(format!(
                    "cluster {cref}: its volumes' keys cannot be read ({e}); a KEK rotation \
                     goes over every cluster the controller knows, so that none is left under \
                     the old KEK: give the controller its own credentials for it (its cluster \
                     list's user and keyFile); nothing was rewrapped"
                ))
            };
            let s = self.session(&cref).map_err(unseen)?;
            for pool in self.rbd_pools(&s).map_err(unseen)? {
                let Some(p) = self.open_pool(&s, &pool).map_err(unseen)? else {
                    continue;
                };
                let loc = Location {
                    cluster: cref.clone(),
                    pool,
                };
                for (suffix, rec) in Registry::new(&p).volumes()? {
                    if rec.state == VolumeState::Ready
                        && rec.context.contains_key(ENCRYPTED_DEK_KEY)
                    {
                        let id = VolumeId {
                            location: loc.clone(),
                            suffix,
                        };
                        ids.push(id.to_string());
                    }
                }
            }
        }
        Ok(ids)
    }

    /// A snapshot record's key rewrapped ([`swap_snapshot_key`]), written to the pool's
    /// metadata in one write.
    pub(super) fn write_snapshot_key_impl(
        &self,
        raw: &str,
        before: &str,
        after: &str,
    ) -> Result<()> {
        let not_found = || Error::SnapshotNotFound(trunc(raw).to_string());
        let sid = SnapshotId::parse(raw).ok_or_else(not_found)?;
        let _claim = self.inflight.claim(&[&snapshot_key(&sid)], &[])?;
        let s = self.session(&sid.location.cluster)?;
        let pool = self
            .open_pool(&s, &sid.location.pool)?
            .ok_or_else(not_found)?;
        let reg = Registry::new(&pool);
        let mut rec = reg
            .snapshot(&sid.suffix)?
            .filter(|r| r.state == SnapshotState::Ready)
            .ok_or_else(not_found)?;
        if swap_snapshot_key(&mut rec.encryption, raw, before, after)? {
            reg.put_snapshot(&sid.suffix, &rec)?;
            info!(snapshot = %sid, "its wrapped data key recorded");
        }
        Ok(())
    }
}
