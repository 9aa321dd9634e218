//! Volume group snapshots of the RBD backend: one ordinary RBD snapshot per member image (so
//! each restores as a clone, is deleted on its own, and is a base for GetMetadataDelta), cut
//! while no member can be written.
//!
//! What "cannot be written" means here: no member is published (the backend holds the
//! members' claims, so none is published until the group is cut, and a node maps an image
//! only after ControllerPublishVolume), and no member image has a client with it open (no
//! watcher). A group of volumes in use is refused with FAILED_PRECONDITION rather than cut
//! inconsistent. Holding writers still is not done by taking the members' exclusive locks:
//! a client whose lock request is refused fails its writes with EROFS (a filesystem on it
//! goes read-only), it does not wait. librbd's own group snapshots hold writers without
//! failing them, but put the member snapshots in a group namespace that librbd 16 (Ceph
//! Pacific, the one here) can neither clone nor diff from: members could not be restored or
//! used as delta bases. With Squid's librbd (cloning from non-user snapshots, and
//! rbd_diff_iterate3 by snapshot id) they could.
//!
//! The group's record is in the pool of its members (all must be in one pool), with the
//! snapshot records. A create writes the name index, then the group record (`creating`, with
//! the members' suffixes), cuts, protects, writes the members' records, then `ready`. A create
//! cut short is finished by its retry: the snapshots already cut are removed (they may be of
//! another instant) and all are cut again.

use std::collections::BTreeSet;
use std::time::SystemTime;

use moor_rbd::Pool;
use tracing::{info, warn};

use super::ids::{GroupId, Location, SnapshotId, VolumeId, random_suffix};
use super::records::{
    FORMAT_VERSION, GroupRecord, GroupState, Registry, SnapshotRecord, SnapshotState, VolumeState,
};
use super::snapshots::{protect_and_size, snapshot_of};
use super::volumes::volume_key;
use super::{RbdBackend, Session};
use crate::backend::{GroupSnapshot, GroupSnapshotRef, NewGroupSnapshot};
use crate::error::{Error, Result, trunc};

fn group_key(id: &GroupId) -> String {
    format!("rbd-group:{id}")
}

fn member_id(loc: &Location, suffix: &str) -> SnapshotId {
    SnapshotId {
        location: loc.clone(),
        suffix: suffix.to_string(),
    }
}

impl RbdBackend {
    /// The group snapshot as the CO sees it: its members that still exist.
    fn group_of(
        &self,
        reg: &Registry<'_>,
        gid: &GroupId,
        rec: &GroupRecord,
    ) -> Result<GroupSnapshot> {
        let mut snapshots = Vec::new();
        for suffix in &rec.snapshot_suffixes {
            if let Some(s) = reg
                .snapshot(suffix)?
                .filter(|s| s.state == SnapshotState::Ready)
            {
                snapshots.push(snapshot_of(&member_id(&gid.location, suffix), &s));
            }
        }
        Ok(GroupSnapshot {
            id: gid.to_string(),
            snapshots,
            created_at: rec.created_at(),
        })
    }

    /// Removes what an earlier, unfinished attempt cut: the members' RBD snapshots and
    /// records.
    fn undo_members(
        &self,
        s: &Session,
        pool: &Pool,
        loc: &Location,
        rec: &GroupRecord,
    ) -> Result<()> {
        let reg = Registry::new(pool);
        for (vsuffix, ssuffix) in rec.volume_suffixes.iter().zip(&rec.snapshot_suffixes) {
            let snap = member_id(loc, ssuffix).snap_name();
            let image_name = VolumeId::image_of(vsuffix);
            let fail = |what: &str, e| self.fail(s, format!("{what} {image_name}@{snap}"), e);
            match pool.open_image(&image_name) {
                Ok(image) => {
                    let exists = image
                        .snapshots()
                        .map_err(|e| fail("snapshots of", e))?
                        .iter()
                        .any(|x| x.name == snap);
                    if exists {
                        if image
                            .is_snapshot_protected(&snap)
                            .map_err(|e| fail("snapshot", e))?
                        {
                            image
                                .unprotect_snapshot(&snap)
                                .map_err(|e| fail("unprotect", e))?;
                        }
                        match image.remove_snapshot(&snap) {
                            Ok(()) | Err(moor_rbd::Error::NotFound { .. }) => {}
                            Err(e) => return Err(fail("remove", e)),
                        }
                    }
                }
                Err(moor_rbd::Error::NotFound { .. }) => {}
                Err(e) => return Err(fail("open", e)),
            }
            reg.remove_snapshot(ssuffix)?;
        }
        Ok(())
    }

    /// Cuts every member's snapshot, once it is sure none is in use (see the module doc), and
    /// writes the members' records.
    fn cut_members(
        &self,
        s: &Session,
        pool: &Pool,
        loc: &Location,
        group_suffix: &str,
        rec: &GroupRecord,
    ) -> Result<()> {
        let reg = Registry::new(pool);
        for vsuffix in &rec.volume_suffixes {
            let id = VolumeId {
                location: loc.clone(),
                suffix: vsuffix.clone(),
            };
            if let Some(p) = reg
                .volume(vsuffix)?
                .and_then(|v| v.publications.first().cloned())
            {
                return Err(Error::GroupRefused(format!(
                    "volume {id} is published at node {:?}: rbd group snapshots are cut only \
                     while no member is in use (unpublish them first)",
                    p.node_id
                )));
            }
            let image_name = id.image();
            let watchers = pool
                .open_image_read_only(&image_name)
                .and_then(|i| i.watchers())
                .map_err(|e| self.fail(s, format!("watchers of {image_name}"), e))?;
            if let Some(w) = watchers.first() {
                return Err(Error::GroupRefused(format!(
                    "image {image_name} is open by client {} at {}: rbd group snapshots are \
                     cut only while no member is in use",
                    w.client_id, w.address
                )));
            }
        }
        let mut images = Vec::with_capacity(rec.volume_suffixes.len());
        for vsuffix in &rec.volume_suffixes {
            let image_name = VolumeId::image_of(vsuffix);
            images.push(
                pool.open_image(&image_name)
                    .map_err(|e| self.fail(s, format!("open {image_name}"), e))?,
            );
        }
        for (image, ssuffix) in images.iter().zip(&rec.snapshot_suffixes) {
            let snap = member_id(loc, ssuffix).snap_name();
            image
                .create_snapshot(&snap)
                .map_err(|e| self.fail(s, format!("snapshot {}@{snap}", image.name()), e))?;
        }
        // Then each is protected (to be cloned), its size and image id read, its record written.
        let reg = Registry::new(pool);
        for ((image, vsuffix), ssuffix) in images
            .iter()
            .zip(&rec.volume_suffixes)
            .zip(&rec.snapshot_suffixes)
        {
            let snap = member_id(loc, ssuffix).snap_name();
            let image_name = image.name();
            let fail = |what: &str, e| self.fail(s, format!("{what} {image_name}@{snap}"), e);
            let size = protect_and_size(image, &snap, fail)?;
            let member = SnapshotRecord {
                version: FORMAT_VERSION,
                name: format!("{}/{image_name}", rec.name),
                state: SnapshotState::Ready,
                source_volume_id: VolumeId {
                    location: loc.clone(),
                    suffix: vsuffix.clone(),
                }
                .to_string(),
                volume_suffix: vsuffix.clone(),
                image_id: image.id().map_err(|e| fail("id of", e))?,
                size_bytes: size,
                created_secs: rec.created_secs,
                created_nanos: rec.created_nanos,
                group_suffix: Some(group_suffix.to_string()),
            };
            reg.put_snapshot(ssuffix, &member)?;
        }
        Ok(())
    }

    pub(super) fn create_group_impl(&self, req: &NewGroupSnapshot) -> Result<GroupSnapshot> {
        let mut vids = Vec::with_capacity(req.source_volume_ids.len());
        for raw in &req.source_volume_ids {
            vids.push(
                VolumeId::parse(raw)
                    .ok_or_else(|| Error::VolumeNotFound(trunc(raw).to_string()))?,
            );
        }
        let Some(first) = vids.first() else {
            return Err(Error::invalid(
                "source_volume_ids",
                "must name at least one volume",
            ));
        };
        let loc = first.location.clone();
        if let Some(other) = vids.iter().find(|v| v.location != loc) {
            return Err(Error::GroupRefused(format!(
                "volumes {first} and {other} are in different pools: the members of an rbd \
                 group snapshot are in one pool"
            )));
        }
        Self::check_snapshot_parameters(&req.parameters, first)?;
        let name_key = format!("rbd-group-name:{}", req.name);
        let _claim = self.inflight.claim(&[&name_key], &[])?;
        let s = self.session(&loc.cluster)?;
        let pool = self
            .open_pool(&s, &loc.pool)?
            .ok_or_else(|| Error::VolumeNotFound(first.to_string()))?;
        let reg = Registry::new(&pool);
        let wanted: BTreeSet<&str> = vids.iter().map(|v| v.suffix.as_str()).collect();

        let mut resumed: Option<(String, Option<GroupRecord>)> = None;
        if let Some(gsuffix) = reg.group_named(&req.name)? {
            let gid = GroupId {
                location: loc.clone(),
                suffix: gsuffix.clone(),
            };
            match reg.group(&gsuffix)? {
                Some(rec)
                    if rec
                        .volume_suffixes
                        .iter()
                        .map(String::as_str)
                        .collect::<BTreeSet<_>>()
                        != wanted =>
                {
                    return Err(Error::GroupSnapshotExists {
                        name: req.name.clone(),
                        id: gid.to_string(),
                        reason: format!(
                            "it was cut from volumes {}",
                            rec.volume_suffixes
                                .iter()
                                .map(|v| VolumeId::image_of(v))
                                .collect::<Vec<_>>()
                                .join(", ")
                        ),
                    });
                }
                Some(rec) if rec.state == GroupState::Ready => {
                    return self.group_of(&reg, &gid, &rec);
                }
                Some(rec) if rec.state == GroupState::Creating => {
                    resumed = Some((gsuffix, Some(rec)));
                }
                Some(_) => reg.unname_group(&req.name, &gsuffix)?,
                None => resumed = Some((gsuffix, None)),
            }
        }

        let keys: Vec<String> = vids.iter().map(volume_key).collect();
        let key_refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        let _sources = self.inflight.claim(&[], &key_refs)?;
        for v in &vids {
            reg.volume(&v.suffix)?
                .filter(|r| r.state == VolumeState::Ready)
                .ok_or_else(|| Error::VolumeNotFound(v.to_string()))?;
        }
        let (gsuffix, mut rec) = match resumed {
            Some((gsuffix, Some(rec))) => {
                self.undo_members(&s, &pool, &loc, &rec)?;
                info!(group = %req.name, "finishing a group snapshot cut short: cutting it again");
                (gsuffix, rec)
            }
            other => {
                let gsuffix = match other {
                    Some((g, None)) => g,
                    _ => {
                        let g = random_suffix()?;
                        reg.name_group(&req.name, &g)?;
                        g
                    }
                };
                let mut snapshot_suffixes = Vec::with_capacity(vids.len());
                for _ in &vids {
                    snapshot_suffixes.push(random_suffix()?);
                }
                let (created_secs, created_nanos) = SnapshotRecord::time_fields(SystemTime::now());
                let rec = GroupRecord {
                    version: FORMAT_VERSION,
                    name: req.name.clone(),
                    state: GroupState::Creating,
                    volume_suffixes: vids.iter().map(|v| v.suffix.clone()).collect(),
                    snapshot_suffixes,
                    created_secs,
                    created_nanos,
                };
                reg.put_group(&gsuffix, &rec)?;
                (gsuffix, rec)
            }
        };
        let gid = GroupId {
            location: loc.clone(),
            suffix: gsuffix.clone(),
        };
        let (created_secs, created_nanos) = SnapshotRecord::time_fields(SystemTime::now());
        rec.created_secs = created_secs;
        rec.created_nanos = created_nanos;
        if let Err(e) = self.cut_members(&s, &pool, &loc, &gsuffix, &rec) {
            // Nothing was handed out: what was cut goes, and the records with it (kept, for
            // the retry to finish, when that fails too).
            match self.undo_members(&s, &pool, &loc, &rec) {
                Ok(()) => {
                    reg.remove_group(&gsuffix)?;
                    reg.unname_group(&req.name, &gsuffix)?;
                }
                Err(undo) => {
                    warn!(group = %gid, error = %undo, "cannot undo a group snapshot cut short; its retry will");
                }
            }
            return Err(e);
        }
        rec.state = GroupState::Ready;
        reg.put_group(&gsuffix, &rec)?;
        info!(group = %gid, members = rec.snapshot_suffixes.len(), "group snapshot cut");
        self.group_of(&reg, &gid, &rec)
    }

    /// The group's pool and record, ready; NOT_FOUND otherwise.
    fn ready_group(&self, raw: &str) -> Result<(GroupId, Session, Pool, GroupRecord)> {
        let not_found = || Error::GroupSnapshotNotFound(trunc(raw).to_string());
        let gid = GroupId::parse(raw).ok_or_else(not_found)?;
        let s = self.session(&gid.location.cluster)?;
        let pool = self
            .open_pool(&s, &gid.location.pool)?
            .ok_or_else(not_found)?;
        let rec = Registry::new(&pool)
            .group(&gid.suffix)?
            .filter(|r| r.state == GroupState::Ready)
            .ok_or_else(not_found)?;
        Ok((gid, s, pool, rec))
    }

    fn members_of(gid: &GroupId, rec: &GroupRecord) -> Vec<String> {
        rec.snapshot_suffixes
            .iter()
            .map(|s| member_id(&gid.location, s).to_string())
            .collect()
    }

    pub(super) fn get_group_impl(&self, req: &GroupSnapshotRef) -> Result<GroupSnapshot> {
        let (gid, _, pool, rec) = self.ready_group(&req.id)?;
        req.check_members(&Self::members_of(&gid, &rec))?;
        self.group_of(&Registry::new(&pool), &gid, &rec)
    }

    pub(super) fn delete_group_impl(&self, req: &GroupSnapshotRef) -> Result<()> {
        let Some(gid) = GroupId::parse(&req.id) else {
            return Ok(());
        };
        let _claim = self.inflight.claim(&[&group_key(&gid)], &[])?;
        let s = self.session(&gid.location.cluster)?;
        let Some(pool) = self.open_pool(&s, &gid.location.pool)? else {
            return Ok(());
        };
        let reg = Registry::new(&pool);
        let Some(mut rec) = reg.group(&gid.suffix)? else {
            return Ok(());
        };
        req.check_members(&Self::members_of(&gid, &rec))?;
        if rec.state == GroupState::Creating {
            // Never finished: its snapshots (if any) were never handed out.
            self.undo_members(&s, &pool, &gid.location, &rec)?;
        }
        if rec.state != GroupState::Deleting {
            rec.state = GroupState::Deleting;
            reg.put_group(&gid.suffix, &rec)?;
        }
        for member in Self::members_of(&gid, &rec) {
            self.delete_snapshot_impl(&member)?;
        }
        reg.unname_group(&rec.name, &gid.suffix)?;
        reg.remove_group(&gid.suffix)?;
        info!(group = %gid, "group snapshot deleted");
        Ok(())
    }
}
