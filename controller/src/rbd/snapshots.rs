//! Snapshots: an RBD snapshot of the volume's image, protected at once so that volumes can
//! be cloned from it (clone format 1).

use std::time::SystemTime;

use tracing::info;

use super::ids::{SnapshotId, VolumeId, random_suffix};
use super::parameters::{CLUSTER_ID_KEY, POOL_KEY};
use super::records::{FORMAT_VERSION, Registry, SnapshotRecord, SnapshotState, VolumeState};
use super::volumes::{snapshot_key, volume_key};
use super::{RbdBackend, Session};
use crate::backend::{NewSnapshot, Parameters, Snapshot};
use crate::embedded::K8S_PREFIX;
use crate::error::{Error, Result, trunc};

/// A snapshot as the CO sees it.
pub(super) fn snapshot_of(id: &SnapshotId, rec: &SnapshotRecord) -> Snapshot {
    Snapshot {
        id: id.to_string(),
        name: rec.name.clone(),
        source_volume_id: rec.source_volume_id.clone(),
        size_bytes: rec.size_bytes,
        created_at: rec.created_at(),
        ready_to_use: true,
        group_snapshot_id: rec.group_suffix.as_ref().map(|suffix| {
            super::ids::GroupId {
                location: id.location.clone(),
                suffix: suffix.clone(),
            }
            .to_string()
        }),
        encryption: rec.encryption.clone(),
    }
}

/// Protects `snap` of `image` (to clone it, clone format 1) unless it is, and returns its
/// size; `fail` maps a Ceph failure of a step.
pub(super) fn protect_and_size(
    image: &moor_rbd::Image,
    snap: &str,
    fail: impl Fn(&str, moor_rbd::Error) -> Error,
) -> Result<u64> {
    if !image
        .is_snapshot_protected(snap)
        .map_err(|e| fail("snapshot", e))?
    {
        image
            .protect_snapshot(snap)
            .map_err(|e| fail("protect", e))?;
    }
    image
        .snapshots()
        .map_err(|e| fail("snapshots of", e))?
        .into_iter()
        .find(|x| x.name == snap)
        .map(|x| x.size)
        .ok_or_else(|| Error::Internal(format!("snapshot {}@{snap} vanished", image.name())))
}

impl RbdBackend {
    /// Snapshot parameters: the CO's own, and (for VolumeSnapshotClasses written for
    /// ceph-csi) clusterID and pool when they are the source volume's.
    pub(super) fn check_snapshot_parameters(
        parameters: &Parameters,
        source: &VolumeId,
    ) -> Result<()> {
        for (key, value) in parameters {
            let same = match key.as_str() {
                CLUSTER_ID_KEY => Some(source.location.cluster.encode() == *value),
                POOL_KEY => Some(source.location.pool == *value),
                k if k.starts_with(K8S_PREFIX) => continue,
                _ => None,
            };
            match same {
                Some(true) => {}
                Some(false) => {
                    return Err(Error::invalid(
                        "parameters",
                        format!(
                            "{key}={:?} is not the source volume's: a snapshot stays with its \
                             volume",
                            trunc(value)
                        ),
                    ));
                }
                None => {
                    return Err(Error::invalid(
                        "parameters",
                        format!(
                            "unknown key {:?}: rbd snapshots take no parameters (clusterID and \
                             pool, when given, must be the volume's)",
                            trunc(key)
                        ),
                    ));
                }
            }
        }
        Ok(())
    }

    pub(super) fn create_snapshot_impl(&self, req: &NewSnapshot) -> Result<Snapshot> {
        let not_found = || Error::VolumeNotFound(trunc(&req.source_volume_id).to_string());
        let vid = VolumeId::parse(&req.source_volume_id).ok_or_else(not_found)?;
        Self::check_snapshot_parameters(&req.parameters, &vid)?;
        let name_key = format!("rbd-snapshot-name:{}", req.name);
        let _claim = self.inflight.claim(&[&name_key], &[])?;
        let s = self.session(&vid.location.cluster)?;
        let pool = self
            .open_pool(&s, &vid.location.pool)?
            .ok_or_else(not_found)?;
        let reg = Registry::new(&pool);
        let loc = vid.location.clone();

        let mut resumed = None;
        if let Some(suffix) = reg.snapshot_named(&req.name)? {
            let sid = SnapshotId {
                location: loc.clone(),
                suffix: suffix.clone(),
            };
            match reg.snapshot(&suffix)? {
                Some(rec) if rec.source_volume_id != req.source_volume_id => {
                    return Err(Error::SnapshotExists {
                        name: req.name.clone(),
                        id: sid.to_string(),
                        reason: format!("it was cut from volume {}", rec.source_volume_id),
                    });
                }
                Some(rec) if rec.state == SnapshotState::Ready => {
                    return Ok(snapshot_of(&sid, &rec));
                }
                Some(rec) if rec.state == SnapshotState::Creating => {
                    resumed = Some((suffix, Some(rec)))
                }
                Some(_) => reg.unname_snapshot(&req.name, &suffix)?,
                None => resumed = Some((suffix, None)),
            }
        }

        let _source = self.inflight.claim(&[], &[&volume_key(&vid)])?;
        let vrec = reg
            .volume(&vid.suffix)?
            .filter(|r| r.state == VolumeState::Ready)
            .ok_or_else(not_found)?;
        let image_name = vid.image();
        let image = pool
            .open_image(&image_name)
            .map_err(|e| self.fail(&s, format!("open {image_name}"), e))?;
        let (suffix, rec) = match resumed {
            Some(r) => r,
            None => {
                let suffix = random_suffix()?;
                reg.name_snapshot(&req.name, &suffix)?;
                (suffix, None)
            }
        };
        let sid = SnapshotId {
            location: loc,
            suffix: suffix.clone(),
        };
        let mut rec = match rec {
            Some(r) => r,
            None => {
                let (created_secs, created_nanos) = SnapshotRecord::time_fields(SystemTime::now());
                let rec = SnapshotRecord {
                    version: FORMAT_VERSION,
                    name: req.name.clone(),
                    state: SnapshotState::Creating,
                    source_volume_id: vid.to_string(),
                    volume_suffix: vid.suffix.clone(),
                    image_id: image
                        .id()
                        .map_err(|e| self.fail(&s, format!("id of {image_name}"), e))?,
                    size_bytes: vrec.capacity_bytes,
                    created_secs,
                    created_nanos,
                    group_suffix: None,
                    copy_image: None,
                    // The key its image's metadata holds now (a rotation changes it; the
                    // context cannot); refused while a rotation is pending.
                    encryption: crate::encryption::with_record_key(
                        crate::encryption::of_volume(&vrec.parameters, &vrec.context),
                        super::keys::image_keys(&image, &vrec)
                            .map_err(|e| self.fail(&s, format!("metadata of {image_name}"), e))?
                            .as_ref(),
                        &req.source_volume_id,
                    )?,
                };
                reg.put_snapshot(&suffix, &rec)?;
                rec
            }
        };
        let snap = sid.snap_name();
        let fail = |what: &str, e| self.fail(&s, format!("{what} {image_name}@{snap}"), e);
        // librbd hands both to the client holding the image's lock when the volume is in use.
        match image.create_snapshot(&snap) {
            Ok(()) | Err(moor_rbd::Error::AlreadyExists { .. }) => {}
            Err(e) => return Err(fail("snapshot", e)),
        }
        let size = protect_and_size(&image, &snap, fail)?;
        rec.size_bytes = size;
        rec.state = SnapshotState::Ready;
        reg.put_snapshot(&suffix, &rec)?;
        info!(snapshot = %sid, volume = %vid, size, "snapshot cut");
        Ok(snapshot_of(&sid, &rec))
    }

    pub(super) fn delete_snapshot_impl(&self, raw: &str) -> Result<()> {
        let Some(sid) = SnapshotId::parse(raw) else {
            return Ok(());
        };
        let _claim = self.inflight.claim(&[&snapshot_key(&sid)], &[])?;
        let s = self.session(&sid.location.cluster)?;
        let Some(pool) = self.open_pool(&s, &sid.location.pool)? else {
            return Ok(());
        };
        let reg = Registry::new(&pool);
        let Some(mut rec) = reg.snapshot(&sid.suffix)? else {
            return Ok(());
        };
        reg.unname_snapshot(&rec.name, &sid.suffix)?;
        let snap = sid.snap_name();
        let image = match pool.open_image_by_id(&rec.image_id) {
            Ok(i) => i,
            Err(moor_rbd::Error::NotFound { .. }) => {
                reg.remove_snapshot(&sid.suffix)?;
                return Ok(());
            }
            Err(e) => return Err(self.fail(&s, format!("open image {}", rec.image_id), e)),
        };
        let fail = |what: &str, e| self.fail(&s, format!("{what} {snap}"), e);
        let exists = image
            .snapshots()
            .map_err(|e| fail("snapshots of", e))?
            .iter()
            .any(|x| x.name == snap);
        if exists {
            let clones = pool
                .open_snapshot_by_id(&rec.image_id, &snap)
                .and_then(|at| at.children())
                .map_err(|e| fail("clones of", e))?;
            if !clones.is_empty() {
                if rec.state != SnapshotState::Retained {
                    rec.state = SnapshotState::Retained;
                    reg.put_snapshot(&sid.suffix, &rec)?;
                }
                info!(
                    snapshot = %sid,
                    clones = clones.len(),
                    "deleted; the RBD snapshot is kept for the volumes cloned from it"
                );
                return Ok(());
            }
            if image
                .is_snapshot_protected(&snap)
                .map_err(|e| fail("snapshot", e))?
            {
                match image.unprotect_snapshot(&snap) {
                    Ok(()) => {}
                    // A clone appeared since the check: keep it for that clone.
                    Err(moor_rbd::Error::HasClones { .. }) => {
                        rec.state = SnapshotState::Retained;
                        reg.put_snapshot(&sid.suffix, &rec)?;
                        return Ok(());
                    }
                    Err(e) => return Err(fail("unprotect", e)),
                }
            }
            match image.remove_snapshot(&snap) {
                Ok(()) | Err(moor_rbd::Error::NotFound { .. }) => {}
                Err(e) => return Err(fail("remove", e)),
            }
        }
        drop(image);
        if let Some(copy) = &rec.copy_image {
            // A group member's copy of its volume: it was there for this snapshot alone.
            match pool.remove_image(copy) {
                Ok(()) | Err(moor_rbd::Error::NotFound { .. }) => {}
                Err(e) => return Err(fail("remove the copy behind", e)),
            }
        }
        reg.remove_snapshot(&sid.suffix)?;
        info!(snapshot = %sid, "deleted");
        // Its volume may have been kept for it alone.
        if let Err(e) = self.reap_volume(&s, &pool, &rec.volume_suffix) {
            tracing::warn!(snapshot = %sid, error = %e, "cannot remove the retained volume yet");
        }
        Ok(())
    }

    /// The snapshot of `raw` and its record, ready; NOT_FOUND otherwise.
    pub(super) fn ready_snapshot(
        &self,
        raw: &str,
    ) -> Result<(SnapshotId, Session, SnapshotRecord)> {
        let not_found = || Error::SnapshotNotFound(trunc(raw).to_string());
        let sid = SnapshotId::parse(raw).ok_or_else(not_found)?;
        let s = self.session(&sid.location.cluster)?;
        let pool = self
            .open_pool(&s, &sid.location.pool)?
            .ok_or_else(not_found)?;
        let rec = Registry::new(&pool)
            .snapshot(&sid.suffix)?
            .filter(|r| r.state == SnapshotState::Ready)
            .ok_or_else(not_found)?;
        Ok((sid, s, rec))
    }

    pub(super) fn get_snapshot_impl(&self, raw: &str) -> Result<Snapshot> {
        let (sid, _, rec) = self.ready_snapshot(raw)?;
        Ok(snapshot_of(&sid, &rec))
    }
}
