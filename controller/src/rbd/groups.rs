//! Volume group snapshots of the RBD backend: one ordinary RBD snapshot (user namespace,
//! protected) per member, so that each restores as a clone, is deleted on its own, and is a
//! base for GetMetadataDelta with librbd 16 (which can neither clone nor diff from a snapshot
//! in a group namespace).
//!
//! Two ways to cut one instant:
//! * No member in use (none published, no client with a member image open; the backend holds
//!   the members' claims, so none is published meanwhile): one RBD snapshot of each member
//!   image in turn, nothing can write between them.
//! * Members in use: a transient RBD group (named like the group snapshot id's last part)
//!   with the members in it, and `rbd_group_snap_create2` (librbd holds every member's
//!   writers while it cuts, they wait and do not fail; clients are not asked to quiesce, so
//!   krbd clients work: the result is crash-consistent). Each member, opened at its snapshot
//!   in the group namespace, is copied (only its non-zero data) into an image of its own
//!   (`moor-copy-<member suffix>`), whose ordinary snapshot is the member; then the group
//!   snapshot and the group go. The copy is the cost: each member's data is read and written
//!   once.
//!
//! The group's record is in the pool of its members (all must be in one pool), with the
//! snapshot records. A create writes the name index, then the group record (`creating`, with
//! the members' suffixes), cuts, protects, writes the members' records, then `ready`. A create
//! cut short is finished by its retry: what the earlier attempt made (member snapshots, copies
//! and their snapshots, the transient group, its snapshot) is removed (it may be of another
//! instant) and all is cut again. Group snapshots of overlapping volumes are serialized by an
//! exclusive claim per member (an image is in one RBD group at a time).

use std::collections::BTreeSet;
use std::time::SystemTime;

use moor_rbd::Pool;
use tracing::{info, warn};

use super::ids::{
    COPY_IMAGE_PREFIX, GROUP_PREFIX, GroupId, Location, SnapshotId, VolumeId, random_suffix,
};
use super::parameters::EXCLUSIVE_LOCK_KEY;
use super::records::{
    FORMAT_VERSION, GroupRecord, GroupState, Registry, SnapshotRecord, SnapshotState, VolumeState,
};
use super::snapshots::{protect_and_size, snapshot_of};
use super::volumes::volume_key;
use super::{RbdBackend, Session};
use crate::backend::{GroupSnapshot, GroupSnapshotRef, NewGroupSnapshot, Parameters};
use crate::error::{Error, Result, trunc};

fn group_key(id: &GroupId) -> String {
    format!("rbd-group:{id}")
}

/// The transient RBD group that cuts the group snapshot of this suffix while its volumes are in
/// use, and the one snapshot it ever has.
fn rbd_group(group_suffix: &str) -> String {
    format!("{GROUP_PREFIX}{group_suffix}")
}
const RBD_GROUP_SNAP: &str = "moor-cut";

/// The image a member snapshot of this suffix is copied into (members in use).
fn copy_image(snapshot_suffix: &str) -> String {
    format!("{COPY_IMAGE_PREFIX}{snapshot_suffix}")
}

/// Ignores a NotFound: what was to be removed is not there.
fn gone(r: moor_rbd::Result<()>) -> moor_rbd::Result<()> {
    match r {
        Err(moor_rbd::Error::NotFound { .. }) => Ok(()),
        other => other,
    }
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

    /// Removes the transient RBD group of a group snapshot cut while its volumes were in use,
    /// with its snapshot (the members' snapshots in its namespace) and its members taken out
    /// of it: `rbd_group_remove` does all three. Nothing of it is ever handed out.
    fn remove_rbd_group(&self, s: &Session, pool: &Pool, group_suffix: &str) -> Result<()> {
        let group = rbd_group(group_suffix);
        gone(pool.remove_group(&group))
            .map_err(|e| self.fail(s, format!("remove group {}/{group}", pool.name()), e))
    }

    /// Removes what an earlier, unfinished attempt cut: the transient RBD group, the members'
    /// RBD snapshots (of the volumes, or of their copies, with the copies) and records.
    fn undo_members(
        &self,
        s: &Session,
        pool: &Pool,
        loc: &Location,
        group_suffix: &str,
        rec: &GroupRecord,
    ) -> Result<()> {
        let reg = Registry::new(pool);
        self.remove_rbd_group(s, pool, group_suffix)?;
        for (vsuffix, ssuffix) in rec.volume_suffixes.iter().zip(&rec.snapshot_suffixes) {
            let snap = member_id(loc, ssuffix).snap_name();
            let copy = copy_image(ssuffix);
            for image_name in [VolumeId::image_of(vsuffix), copy.clone()] {
                self.undo_snapshot(s, pool, &image_name, &snap)?;
            }
            gone(pool.remove_image(&copy))
                .map_err(|e| self.fail(s, format!("remove {}/{copy}", pool.name()), e))?;
            reg.remove_snapshot(ssuffix)?;
        }
        Ok(())
    }

    /// Unprotects and removes `image@snap` if it is there.
    fn undo_snapshot(&self, s: &Session, pool: &Pool, image_name: &str, snap: &str) -> Result<()> {
        {
            let fail = |what: &str, e| self.fail(s, format!("{what} {image_name}@{snap}"), e);
            match pool.open_image(image_name) {
                Ok(image) => {
                    let exists = image
                        .snapshots()
                        .map_err(|e| fail("snapshots of", e))?
                        .iter()
                        .any(|x| x.name == snap);
                    if exists {
                        if image
                            .is_snapshot_protected(snap)
                            .map_err(|e| fail("snapshot", e))?
                        {
                            image
                                .unprotect_snapshot(snap)
                                .map_err(|e| fail("unprotect", e))?;
                        }
                        match image.remove_snapshot(snap) {
                            Ok(()) | Err(moor_rbd::Error::NotFound { .. }) => {}
                            Err(e) => return Err(fail("remove", e)),
                        }
                    }
                }
                Err(moor_rbd::Error::NotFound { .. }) => {}
                Err(e) => return Err(fail("open", e)),
            }
        }
        Ok(())
    }

    /// Why a member is in use (published, or open by a client), if one is.
    fn in_use(
        &self,
        s: &Session,
        pool: &Pool,
        loc: &Location,
        rec: &GroupRecord,
    ) -> Result<Option<String>> {
        let reg = Registry::new(pool);
        for vsuffix in &rec.volume_suffixes {
            let id = VolumeId {
                location: loc.clone(),
                suffix: vsuffix.clone(),
            };
            let vrec = reg.volume(vsuffix)?;
            if let Some(p) = vrec.as_ref().and_then(|v| v.publications.first()) {
                if vrec
                    .as_ref()
                    .is_some_and(|v| v.parameters.contains_key(EXCLUSIVE_LOCK_KEY))
                {
                    // Mapped holding its lock, never handed over: librbd cannot hold its writes.
                    return Err(Error::GroupRefused(format!(
                        "volume {id} is published at node {:?} and its StorageClass has \
                         {EXCLUSIVE_LOCK_KEY}=true: the node keeps the image's lock, so its writes \
                         cannot be held for a group snapshot (unpublish it first)",
                        p.node_id
                    )));
                }
                return Ok(Some(format!(
                    "volume {id} is published at node {:?}",
                    p.node_id
                )));
            }
            let image_name = id.image();
            let watchers = pool
                .open_image_read_only(&image_name)
                .and_then(|i| i.watchers())
                .map_err(|e| self.fail(s, format!("watchers of {image_name}"), e))?;
            if let Some(w) = watchers.first() {
                return Ok(Some(format!(
                    "image {image_name} is open by client {} at {}",
                    w.client_id, w.address
                )));
            }
        }
        Ok(None)
    }

    /// Cuts every member's snapshot at one instant and writes the members' records: in turn
    /// when no member is in use, through a transient RBD group and copies otherwise (see the
    /// module doc).
    fn cut_members(
        &self,
        s: &Session,
        pool: &Pool,
        loc: &Location,
        group_suffix: &str,
        rec: &GroupRecord,
    ) -> Result<()> {
        let member =
            |vsuffix: &str, image_id: String, size: u64, copy: Option<String>| SnapshotRecord {
                version: FORMAT_VERSION,
                name: format!("{}/{}", rec.name, VolumeId::image_of(vsuffix)),
                state: SnapshotState::Ready,
                source_volume_id: VolumeId {
                    location: loc.clone(),
                    suffix: vsuffix.to_string(),
                }
                .to_string(),
                volume_suffix: vsuffix.to_string(),
                image_id,
                size_bytes: size,
                created_secs: rec.created_secs,
                created_nanos: rec.created_nanos,
                group_suffix: Some(group_suffix.to_string()),
                copy_image: copy,
                // A group holding an encrypted volume is refused before it is cut.
                encryption: Parameters::new(),
            };
        let reg = Registry::new(pool);
        if let Some(why) = self.in_use(s, pool, loc, rec)? {
            info!(group = %rec.name, why, "members in use: cutting them through an rbd group");
            self.cut_together(s, pool, loc, group_suffix, rec)?;
            for (vsuffix, ssuffix) in rec.volume_suffixes.iter().zip(&rec.snapshot_suffixes) {
                let snap = member_id(loc, ssuffix).snap_name();
                let copy = copy_image(ssuffix);
                let fail = |what: &str, e| self.fail(s, format!("{what} {copy}@{snap}"), e);
                let image = pool.open_image(&copy).map_err(|e| fail("open", e))?;
                let size = protect_and_size(&image, &snap, fail)?;
                let id = image.id().map_err(|e| fail("id of", e))?;
                reg.put_snapshot(ssuffix, &member(vsuffix, id, size, Some(copy)))?;
            }
            return self.remove_rbd_group(s, pool, group_suffix);
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
        for ((image, vsuffix), ssuffix) in images
            .iter()
            .zip(&rec.volume_suffixes)
            .zip(&rec.snapshot_suffixes)
        {
            let snap = member_id(loc, ssuffix).snap_name();
            let image_name = image.name();
            let fail = |what: &str, e| self.fail(s, format!("{what} {image_name}@{snap}"), e);
            let size = protect_and_size(image, &snap, fail)?;
            let id = image.id().map_err(|e| fail("id of", e))?;
            reg.put_snapshot(ssuffix, &member(vsuffix, id, size, None))?;
        }
        Ok(())
    }

    /// Members in use: the transient RBD group, its one snapshot (the instant), and each
    /// member copied at it into its own image with an ordinary snapshot of the member's name.
    fn cut_together(
        &self,
        s: &Session,
        pool: &Pool,
        loc: &Location,
        group_suffix: &str,
        rec: &GroupRecord,
    ) -> Result<()> {
        let group = rbd_group(group_suffix);
        let fail = |what: String, e| self.fail(s, what, e);
        pool.create_group(&group)
            .map_err(|e| fail(format!("create group {}/{group}", pool.name()), e))?;
        for vsuffix in &rec.volume_suffixes {
            let image_name = VolumeId::image_of(vsuffix);
            match pool.add_to_group(&group, &image_name) {
                Ok(()) => {}
                Err(moor_rbd::Error::AlreadyExists { .. }) => {
                    return Err(Error::GroupRefused(format!(
                        "image {image_name} is in another rbd group (left by a group snapshot \
                         whose create was cut short: its retry or DeleteVolumeGroupSnapshot \
                         removes it)"
                    )));
                }
                Err(e) => return Err(fail(format!("add {image_name} to group {group}"), e)),
            }
        }
        let started = std::time::Instant::now();
        match pool.create_group_snapshot(&group, RBD_GROUP_SNAP) {
            Ok(()) => {}
            // A client holds a member's lock and will not hand it over.
            Err(e) if e.errno() == Some(libc::EROFS) => {
                return Err(Error::GroupRefused(format!(
                    "a member's exclusive lock is held by a client that does not release it, so \
                     its writes cannot be held for a group snapshot: {e}"
                )));
            }
            Err(e) => return Err(fail(format!("snapshot group {group}"), e)),
        }
        info!(group = %rec.name, took_ms = started.elapsed().as_millis() as u64, "rbd group snapshot cut");
        for (vsuffix, ssuffix) in rec.volume_suffixes.iter().zip(&rec.snapshot_suffixes) {
            let image_name = VolumeId::image_of(vsuffix);
            let copy = copy_image(ssuffix);
            let at = pool
                .open_group_snapshot(&image_name, &group, RBD_GROUP_SNAP)
                .map_err(|e| fail(format!("open {image_name} at {group}@{RBD_GROUP_SNAP}"), e))?
                .ok_or_else(|| {
                    Error::Internal(format!(
                        "image {image_name} has no snapshot of {group}@{RBD_GROUP_SNAP}"
                    ))
                })?;
            at.copy_to(pool, &copy)
                .map_err(|e| fail(format!("copy {image_name} to {copy}"), e))?;
            let snap = member_id(loc, ssuffix).snap_name();
            pool.open_image(&copy)
                .and_then(|c| c.create_snapshot(&snap))
                .map_err(|e| fail(format!("snapshot {copy}@{snap}"), e))?;
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
        // Exclusive among group snapshots: an image is in one rbd group at a time.
        let member_keys: Vec<String> = vids
            .iter()
            .map(|v| format!("rbd-group-member:{v}"))
            .collect();
        let member_refs: Vec<&str> = member_keys.iter().map(String::as_str).collect();
        let _members = self.inflight.claim(&member_refs, &key_refs)?;
        for v in &vids {
            reg.volume(&v.suffix)?
                .filter(|r| r.state == VolumeState::Ready)
                .ok_or_else(|| Error::VolumeNotFound(v.to_string()))?;
        }
        let (gsuffix, mut rec) = match resumed {
            Some((gsuffix, Some(rec))) => {
                self.undo_members(&s, &pool, &loc, &gsuffix, &rec)?;
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
            match self.undo_members(&s, &pool, &loc, &gsuffix, &rec) {
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
            self.undo_members(&s, &pool, &gid.location, &gid.suffix, &rec)?;
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
