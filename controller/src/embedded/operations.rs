//! The embedded backend's [`Backend`] operations: volumes, publications, snapshots.

use std::fs::{self, File, OpenOptions};
use std::os::unix::fs::MetadataExt as _;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::SystemTime;

use moor_runtime::contract::ENCRYPTED_DEK_KEY;
use tracing::{info, warn};

use super::attach::{AttachError, Attacher, Detach, FileId};
use super::ids::{Inward, SnapshotId, VolumeId};
use super::records::{Publication, SnapshotRecord, VolumeRecord};
use super::{
    EmbeddedBackend, Found, GRANULARITY, POLICY, THICK, THIN, check_capability, copy, is_thick,
    no_parameters, parse_parameters, records, size_error, snapshot_key, space, volume_key,
};
use crate::backend::{
    self, Backend, Capability, Capacity, CapacityQuery, ExpandRequest, GroupSnapshot,
    GroupSnapshotRef, MetadataSink, NewGroupSnapshot, NewSnapshot, NewVolume, Page, PageRequest,
    Parameters, PublishContext, PublishRequest, Qos, SizePolicy, Snapshot, SnapshotFilter, Volume,
    VolumeStatus,
};
use crate::encryption::rotation::RecordKeys;
use crate::error::{Error, Result, trunc};

impl<A: Attacher> Backend for EmbeddedBackend<A> {
    fn parse_parameters(&self, raw: &Parameters) -> Result<Parameters> {
        parse_parameters(raw)
    }

    fn check_capability(&self, cap: &Capability, parameters: &Parameters) -> Result<(), String> {
        check_capability(cap, parameters)
    }

    fn probe(&self) -> Result<()> {
        static PROBES: AtomicU64 = AtomicU64::new(0);
        let probe = self
            .layout
            .tmp
            .join(format!(".probe-{}", PROBES.fetch_add(1, Ordering::Relaxed)));
        fs::write(&probe, b"ok")
            .and_then(|()| fs::remove_file(&probe))
            .map_err(|e| {
                Error::NotReady(format!(
                    "data dir {} is not writable: {e}",
                    self.layout.root.display()
                ))
            })?;
        self.attacher
            .check()
            .map_err(|e| Error::NotReady(format!("loop devices are not usable: {e}")))
    }

    fn metrics(&self) -> String {
        self.space_metrics()
    }

    fn create_volume(&self, req: &NewVolume) -> Result<Volume> {
        // An encrypted volume's parameters (checked by the service) are kept as they are.
        let (_, params) = crate::encryption::parse_with(&req.parameters, parse_parameters)?;
        for cap in &req.capabilities {
            check_capability(cap, &params).map_err(|r| Error::invalid("volume_capabilities", r))?;
        }
        let name_key = format!("volume-name:{}", req.name);
        let _claim = self.inflight.claim(&[&name_key], &[])?;
        let existing = self
            .state()
            .volumes
            .values()
            .find(|v| v.name == req.name)
            .cloned();
        if let Some(existing) = existing {
            self.check_same_volume(&existing, req, &params)?;
            return Ok(self.volume_of(&existing));
        }
        if let Some(acc) = &req.accessibility
            && !backend::topology_allows(acc, &self.segment)
        {
            return Err(Error::TopologyUnsatisfiable(format!(
                "volumes are accessible from {:?} only, and no requisite topology includes it",
                self.segment
            )));
        }
        let (_source_claim, source) = match &req.source {
            Some(src) => {
                let (c, s) = self.resolve_source(src)?;
                (Some(c), Some(s))
            }
            None => (None, None),
        };
        let floor = source.as_ref().map_or(0, |s| s.size);
        let size = backend::choose_size(req.capacity.as_ref(), &POLICY, floor)?;
        let thick = is_thick(&params);
        let id = self.new_volume_id()?;
        let target = self.layout.volume_file(&id);
        // What the new volume takes: a thick one all of its size, a thin one a claim on it.
        let claim = if thick {
            space::Claim {
                allocates: size,
                unbacked: 0,
            }
        } else {
            space::Claim {
                allocates: 0,
                unbacked: size,
            }
        };
        let what = format!(
            "a {} volume of {size} bytes",
            if thick { THICK } else { THIN }
        );
        // Pending until the record is saved (a thin volume's file counts from then on), or
        // the create fails and its file is gone.
        let mut reservation = self.reserve(claim, &what)?;
        match &source {
            None => {
                self.write_data_file(&id.data_file(), &target, |file| {
                    if thick {
                        Self::no_cow(file);
                    }
                    file.set_len(size)
                        .map_err(|e| size_error(&target, size, e))?;
                    if thick {
                        Self::reserve_range(file, &target, 0, size)?;
                    }
                    Ok(())
                })?;
            }
            Some(src) => {
                // The copy's cost is known once it is made: admitted before as if it took
                // nothing, and checked again once made (the copy is undone if the data dir
                // can no longer keep its promises).
                self.write_data_file(&id.data_file(), &target, |file| {
                    if let Some(dev) = &src.device {
                        self.flush_device(dev, &src.path)?;
                    }
                    if thick {
                        Self::no_cow(file);
                    }
                    let from = File::open(&src.path)
                        .map_err(|e| Error::io("open source", &src.path, e))?;
                    let sharing = if thick || src.thick {
                        copy::Sharing::Private
                    } else {
                        copy::Sharing::Allowed
                    };
                    let method = copy::copy(&from, file, size, sharing)?;
                    info!(volume = %id, source = %src.path.display(), ?method, "copied");
                    let unbacked = if thick {
                        Self::reserve_range(file, &target, 0, size)?;
                        0
                    } else {
                        let holds = file
                            .metadata()
                            .map_err(|e| Error::io("stat", &target, e))?
                            .blocks()
                            .saturating_mul(512);
                        size.saturating_sub(holds)
                    };
                    reservation.settle(
                        self,
                        space::Claim {
                            allocates: 0,
                            unbacked,
                        },
                        &what,
                    )
                })?;
            }
        }
        let rec = VolumeRecord {
            version: records::FORMAT_VERSION,
            id: id.to_string(),
            name: req.name.clone(),
            capacity_bytes: size,
            created_bytes: size,
            parameters: params.clone(),
            context: params,
            source: req.source.clone(),
            publication: None,
            qos: Qos::default(),
            keys: None,
        };
        if let Err(e) = self.save_volume(&rec) {
            let _ = Self::remove_data_file(&target);
            return Err(e);
        }
        drop(reservation);
        info!(volume = %id, name = %req.name, size, "created");
        Ok(self.volume_of(&rec))
    }

    fn serves_encryption(&self) -> bool {
        true
    }

    fn record_wrapped_dek(&self, volume_id: &str, wrapped: &str) -> Result<Volume> {
        let id = self.volume_here(volume_id)?;
        let _claim = self.inflight.claim(&[&volume_key(&id)], &[])?;
        let mut rec = self
            .volume_record(&id)
            .ok_or_else(|| Error::VolumeNotFound(trunc(volume_id).to_string()))?;
        if !rec.context.contains_key(ENCRYPTED_DEK_KEY) {
            rec.context
                .insert(ENCRYPTED_DEK_KEY.to_owned(), wrapped.to_owned());
            self.save_volume(&rec)?;
            info!(volume = %id, "its wrapped data key recorded");
        }
        Ok(self.volume_of(&rec))
    }

    fn volume_keys(&self, volume_id: &str) -> Result<RecordKeys> {
        let id = self.volume_here(volume_id)?;
        let rec = self
            .volume_record(&id)
            .ok_or_else(|| Error::VolumeNotFound(trunc(volume_id).to_string()))?;
        Self::keys_of(&rec).ok_or_else(|| {
            Error::FailedPrecondition(format!("volume {id}: not encrypted, it has no data key"))
        })
    }

    fn write_volume_keys(
        &self,
        volume_id: &str,
        before: &RecordKeys,
        after: &RecordKeys,
    ) -> Result<()> {
        let id = self.volume_here(volume_id)?;
        let _claim = self.inflight.claim(&[&volume_key(&id)], &[])?;
        let mut rec = self
            .volume_record(&id)
            .ok_or_else(|| Error::VolumeNotFound(trunc(volume_id).to_string()))?;
        if Self::keys_of(&rec).as_ref() != Some(before) {
            return Err(Error::OperationPending(format!(
                "volume {id}: its data keys changed since they were read; run the rotation again"
            )));
        }
        if before == after {
            return Ok(());
        }
        rec.keys = Some(after.clone());
        self.save_volume(&rec)?;
        info!(volume = %id, pending = after.pending.is_some(), "its data keys recorded");
        Ok(())
    }

    fn encrypted_volume_ids(&self) -> Result<Vec<String>> {
        let st = self.state();
        Ok(st
            .volumes
            .values()
            .filter(|r| Self::keys_of(r).is_some())
            .map(|r| self.show(&r.id))
            .collect())
    }

    fn write_snapshot_key(&self, snapshot_id: &str, before: &str, after: &str) -> Result<()> {
        let id = self.snapshot_here(snapshot_id)?;
        let _claim = self.inflight.claim(&[&snapshot_key(&id)], &[])?;
        let mut rec = self
            .state()
            .snapshots
            .get(id.as_str())
            .cloned()
            .ok_or_else(|| Error::SnapshotNotFound(trunc(snapshot_id).to_string()))?;
        if crate::encryption::rotation::swap_snapshot_key(
            &mut rec.encryption,
            snapshot_id,
            before,
            after,
        )? {
            self.store.put_snapshot(&rec)?;
            self.state().snapshots.insert(rec.id.clone(), rec);
            info!(snapshot = %id, "its wrapped data key recorded");
        }
        Ok(())
    }

    fn delete_volume(&self, volume_id: &str) -> Result<()> {
        let Some(id) = self.to_delete("volume", volume_id, self.find_volume(volume_id))? else {
            return Ok(());
        };
        let _claim = self.inflight.claim(&[&volume_key(&id)], &[])?;
        let rec = self.volume_record(&id);
        if let Some(p) = rec.as_ref().and_then(|r| r.publication.as_ref()) {
            return Err(Error::VolumeInUse {
                volume: id.to_string(),
                reason: format!(
                    "it is published at node {:?}{}; ControllerUnpublishVolume it first",
                    p.node_id,
                    p.device
                        .as_ref()
                        .map(|d| format!(" as {d}"))
                        .unwrap_or_default()
                ),
            });
        }
        let path = self.layout.volume_file(&id);
        if let Ok(file) = FileId::of_path(&path)
            && let Some(a) = self
                .attacher
                .list(&self.layout.root)?
                .into_iter()
                .find(|a| a.file == file)
        {
            return Err(Error::VolumeInUse {
                volume: id.to_string(),
                reason: format!(
                    "loop device {} is still bound to it (held open by someone)",
                    a.device.display()
                ),
            });
        }
        if rec.is_some() {
            self.store.remove_volume(&id)?;
            self.state().volumes.remove(id.as_str());
        }
        self.state().protected.remove(id.as_str());
        Self::remove_data_file(&path)?;
        info!(volume = %id, "deleted");
        Ok(())
    }

    fn publish_volume(&self, req: &PublishRequest) -> Result<PublishContext> {
        let not_found = || Error::VolumeNotFound(trunc(&req.volume_id).to_string());
        let id = self.volume_here(&req.volume_id)?;
        if req.node_id != self.node_id {
            return Err(Error::NodeNotFound {
                node: trunc(&req.node_id).to_string(),
                serves: self.node_id.clone(),
            });
        }
        let _claim = self.inflight.claim(&[&volume_key(&id)], &[])?;
        let rec = self.volume_record(&id).ok_or_else(not_found)?;
        check_capability(&req.capability, &rec.parameters)
            .map_err(|r| Error::invalid("volume_capability", r))?;
        for (k, v) in &req.context {
            if rec.context.get(k).is_some_and(|mine| mine != v) {
                return Err(Error::invalid(
                    "volume_context",
                    format!("{k:?} does not match the volume's context"),
                ));
            }
        }
        let path = self.layout.volume_file(&id);
        let file = FileId::of_path(&path).map_err(|e| Error::io("stat backing file", &path, e))?;
        if let Some(p) = &rec.publication {
            if p.node_id != req.node_id {
                return Err(Error::PublishedElsewhere {
                    volume: id.to_string(),
                    node: p.node_id.clone(),
                });
            }
            if p.readonly != req.readonly {
                return Err(Error::PublishedIncompatible {
                    volume: id.to_string(),
                    node: p.node_id.clone(),
                    reason: format!("it is published with readonly={}", p.readonly),
                });
            }
            if let Some(dev) = &p.device {
                if self.attacher.backing_of(Path::new(dev))? == Some(file) {
                    return Ok(Self::publish_context(dev, &path, &rec));
                }
                warn!(volume = %id, device = %dev, "recorded device no longer backs the volume; attaching again");
            }
            let mut cleared = rec.clone();
            cleared.publication = None;
            return self.attach_and_record(&cleared, req, &path);
        }
        self.attach_and_record(&rec, req, &path)
    }

    fn unpublish_volume(&self, volume_id: &str, node_id: Option<&str>) -> Result<()> {
        // A volume of another node is not published here.
        let Found::Here(id) = self.find_volume(volume_id) else {
            return Ok(());
        };
        let _claim = self.inflight.claim(&[&volume_key(&id)], &[])?;
        let Some(rec) = self.volume_record(&id) else {
            return Ok(());
        };
        let Some(p) = &rec.publication else {
            return Ok(());
        };
        if node_id.is_some_and(|n| n != p.node_id) {
            return Ok(());
        }
        let path = self.layout.volume_file(&id);
        match (&p.device, FileId::of_path(&path)) {
            (Some(dev), Ok(file)) => {
                let r = self.attacher.detach(Path::new(dev), file)?;
                match r {
                    Detach::Done | Detach::AlreadyGone => {}
                    Detach::Deferred => warn!(
                        volume = %id, device = %dev,
                        "device still open elsewhere; the kernel detaches it on last close"
                    ),
                    Detach::NotOurs => warn!(
                        volume = %id, device = %dev,
                        "device now backs another file; left alone"
                    ),
                }
                info!(volume = %id, device = %dev, result = ?r, "detached");
            }
            (None, Ok(_)) => self.detach_all(&path)?,
            (_, Err(e)) => {
                warn!(volume = %id, error = %e, "backing file missing; nothing to detach")
            }
        }
        let mut done = rec.clone();
        done.publication = None;
        self.save_volume(&done)
    }

    fn get_volume(&self, volume_id: &str) -> Result<VolumeStatus> {
        let not_found = || Error::VolumeNotFound(trunc(volume_id).to_string());
        let id = self.volume_here(volume_id)?;
        let rec = self.volume_record(&id).ok_or_else(not_found)?;
        Ok(self.status_of(&id, &rec))
    }

    fn list_volumes(&self, page: &PageRequest) -> Result<Page<VolumeStatus>> {
        if let Some(t) = &page.starting_token
            && VolumeId::parse(t).is_none()
        {
            return Err(Error::InvalidToken {
                token: trunc(t).to_string(),
                reason: "not a token this controller hands out".into(),
            });
        }
        let page = {
            let st = self.state();
            backend::page_after(
                &st.volumes,
                page.starting_token.as_deref(),
                page.max_entries,
            )
        };
        let entries = page
            .entries
            .iter()
            .filter_map(|rec| VolumeId::parse(&rec.id).map(|id| self.status_of(&id, rec)))
            .collect();
        Ok(Page {
            entries,
            next_token: page.next_token,
        })
    }

    fn capacity(&self, query: &CapacityQuery) -> Result<Capacity> {
        if let Some(t) = &query.topology
            && !backend::segment_within(t, &self.segment)
        {
            return Ok(Capacity::default());
        }
        let s = self.space()?;
        let oc = self.policy.overcommit;
        // What CreateVolume admits now with these parameters (see `space`).
        let (available, largest) = if is_thick(&query.parameters) {
            let a = space::thick_available(&s, oc);
            (a, a)
        } else {
            match space::thin_available(&s, oc) {
                Some(a) => (a, a),
                // Thin volumes without limit: any size is made, what is free is what can be
                // written.
                None => (s.free, POLICY.max),
            }
        };
        Ok(Capacity {
            available,
            // choose_size's bounds under POLICY: sizes round up to GRANULARITY, so the largest
            // volume is a whole number of it, and a limit_bytes below it fits no volume. A
            // topology this backend does not serve returns early above with neither set, as no
            // size fits.
            maximum_volume_size: Some((largest / GRANULARITY * GRANULARITY).min(POLICY.max)),
            minimum_volume_size: Some(POLICY.granularity),
        })
    }

    /// The limits are kept with the volume and said in its condition's message; this backend
    /// has no I/O path of its own to enforce them on (the loop device is the node's).
    fn modify_volume(&self, volume_id: &str, qos: &Qos) -> Result<()> {
        let id = self.volume_here(volume_id)?;
        let _claim = self.inflight.claim(&[&volume_key(&id)], &[])?;
        let mut rec = self
            .volume_record(&id)
            .ok_or_else(|| Error::VolumeNotFound(trunc(volume_id).to_string()))?;
        if rec.qos != *qos {
            rec.qos = *qos;
            self.save_volume(&rec)?;
            info!(volume = %id, ?qos, "modified");
        }
        Ok(())
    }

    fn expand_volume(&self, req: &ExpandRequest) -> Result<u64> {
        let not_found = || Error::VolumeNotFound(trunc(&req.volume_id).to_string());
        let id = self.volume_here(&req.volume_id)?;
        let _claim = self.inflight.claim(&[&volume_key(&id)], &[])?;
        let rec = self.volume_record(&id).ok_or_else(not_found)?;
        if let Some(cap) = &req.capability {
            check_capability(cap, &rec.parameters)
                .map_err(|r| Error::invalid("volume_capability", r))?;
        }
        let r = req.capacity;
        if r.limit > 0 && r.required > r.limit {
            return Err(Error::OutOfRange(format!(
                "required_bytes {} is larger than limit_bytes {}",
                r.required, r.limit
            )));
        }
        let path = self.layout.volume_file(&id);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .map_err(|e| Error::io("open", &path, e))?;
        let current = file
            .metadata()
            .map_err(|e| Error::io("stat", &path, e))?
            .len();
        let size = if r.required <= current {
            if r.limit > 0 && current > r.limit {
                return Err(Error::OutOfRange(format!(
                    "the volume holds {current} bytes, more than limit_bytes {}; volumes never shrink",
                    r.limit
                )));
            }
            current
        } else {
            let size = backend::choose_size(
                Some(&r),
                &SizePolicy {
                    default: current,
                    ..POLICY
                },
                current,
            )?;
            let thick = is_thick(&rec.parameters);
            let grow = size - current;
            let pending = self.lock_space();
            self.admit_with(
                &pending,
                if thick {
                    space::Claim {
                        allocates: grow,
                        unbacked: 0,
                    }
                } else {
                    space::Claim {
                        allocates: 0,
                        unbacked: grow,
                    }
                },
                &format!("growing volume {id} by {grow} bytes"),
            )?;
            file.set_len(size).map_err(|e| size_error(&path, size, e))?;
            if thick && let Err(e) = Self::reserve_range(&file, &path, current, grow) {
                // Back to the size it had: what was reserved past it goes with it.
                if let Err(undo) = file.set_len(current) {
                    warn!(volume = %id, error = %undo, "cannot shrink back after a failed reserve");
                }
                return Err(e);
            }
            file.sync_all().map_err(|e| Error::io("fsync", &path, e))?;
            size
        };
        if let Some(Publication {
            device: Some(dev), ..
        }) = &rec.publication
        {
            let fid = FileId::of(&file).map_err(|e| Error::io("stat", &path, e))?;
            match self.attacher.refresh_size(Path::new(dev), fid) {
                Ok(()) => {}
                Err(AttachError::NotOurs(_)) => {
                    warn!(volume = %id, device = %dev, "device no longer backs the volume; not resized");
                }
                Err(e) => return Err(e.into()),
            }
        }
        if rec.capacity_bytes != size {
            let mut grown = rec.clone();
            grown.capacity_bytes = size;
            self.save_volume(&grown)?;
            info!(volume = %id, from = rec.capacity_bytes, to = size, "expanded");
        }
        Ok(size)
    }

    fn create_snapshot(&self, req: &NewSnapshot) -> Result<Snapshot> {
        no_parameters(&req.parameters, "snapshot")?;
        let name_key = format!("snapshot-name:{}", req.name);
        let _claim = self.inflight.claim(&[&name_key], &[])?;
        let existing = self
            .state()
            .snapshots
            .values()
            .find(|s| s.group_snapshot_id.is_none() && s.name == req.name)
            .cloned();
        if let Some(existing) = existing {
            let source = self.show(&existing.source_volume_id);
            if source != req.source_volume_id {
                return Err(Error::SnapshotExists {
                    name: req.name.clone(),
                    id: self.show(&existing.id),
                    reason: format!("it was cut from volume {source}"),
                });
            }
            return Ok(self.snapshot_of(&existing));
        }
        let not_found = || Error::VolumeNotFound(trunc(&req.source_volume_id).to_string());
        let vid = self.volume_here(&req.source_volume_id)?;
        let _source = self.inflight.claim(&[], &[&volume_key(&vid)])?;
        let vrec = self.volume_record(&vid).ok_or_else(not_found)?;
        let src_path = self.layout.volume_file(&vid);
        if let Some(dev) = vrec.publication.as_ref().and_then(|p| p.device.as_ref()) {
            self.flush_device(Path::new(dev), &src_path)?;
        }
        let src = File::open(&src_path).map_err(|e| Error::io("open", &src_path, e))?;
        let size = src
            .metadata()
            .map_err(|e| Error::io("stat", &src_path, e))?
            .len();
        let sid = self.new_snapshot_id()?;
        let target = self.layout.snapshot_file(&sid);
        let created = SystemTime::now();
        let sharing = if is_thick(&vrec.parameters) {
            copy::Sharing::Private
        } else {
            copy::Sharing::Allowed
        };
        self.write_data_file(&sid.data_file(), &target, |dst| {
            let method = copy::copy(&src, dst, size, sharing)?;
            info!(snapshot = %sid, volume = %vid, ?method, "copied");
            // A snapshot holds what it copied: it must not eat the space thin volumes are
            // promised.
            self.admit(
                space::Claim::default(),
                &format!("a snapshot of volume {vid}"),
            )
        })?;
        let (created_secs, created_nanos) = SnapshotRecord::time_fields(created);
        let rec = SnapshotRecord {
            version: records::FORMAT_VERSION,
            id: sid.to_string(),
            name: req.name.clone(),
            source_volume_id: vid.to_string(),
            size_bytes: size,
            created_secs,
            created_nanos,
            group_snapshot_id: None,
            encryption: crate::encryption::with_record_key(
                crate::encryption::of_volume(&vrec.parameters, &vrec.context),
                vrec.keys.as_ref(),
                &vrec.id,
            )?,
        };
        if let Err(e) = self.store.put_snapshot(&rec) {
            let _ = Self::remove_data_file(&target);
            return Err(e.into());
        }
        self.state().snapshots.insert(rec.id.clone(), rec.clone());
        info!(snapshot = %sid, volume = %vid, size, "snapshot cut");
        Ok(self.snapshot_of(&rec))
    }

    fn delete_snapshot(&self, snapshot_id: &str) -> Result<()> {
        let Some(id) = self.to_delete("snapshot", snapshot_id, self.find_snapshot(snapshot_id))?
        else {
            return Ok(());
        };
        let _claim = self.inflight.claim(&[&snapshot_key(&id)], &[])?;
        let known = self.state().snapshots.contains_key(id.as_str());
        if known {
            self.store.remove_snapshot(&id)?;
            self.state().snapshots.remove(id.as_str());
        }
        self.state().protected.remove(id.as_str());
        Self::remove_data_file(&self.layout.snapshot_file(&id))?;
        if known {
            info!(snapshot = %id, "deleted");
        }
        Ok(())
    }

    fn get_snapshot(&self, snapshot_id: &str) -> Result<Snapshot> {
        let not_found = || Error::SnapshotNotFound(trunc(snapshot_id).to_string());
        let id = self.snapshot_here(snapshot_id)?;
        let rec = self.state().snapshots.get(id.as_str()).cloned();
        rec.map(|r| self.snapshot_of(&r)).ok_or_else(not_found)
    }

    fn list_snapshots(
        &self,
        filter: &SnapshotFilter,
        page: &PageRequest,
    ) -> Result<Page<Snapshot>> {
        if let Some(t) = &page.starting_token
            && SnapshotId::parse(t).is_none()
        {
            return Err(Error::InvalidToken {
                token: trunc(t).to_string(),
                reason: "not a token this controller hands out".into(),
            });
        }
        // The filters name ids as the outside sees them: one of another node matches nothing.
        let bare = |raw: &Option<String>, parse: fn(&str) -> Option<String>| match raw {
            None => Ok(None),
            Some(r) => match self.scope.inward(r) {
                Inward::Here(b) if parse(b).is_some() => Ok(Some(b.to_string())),
                _ => Err(()),
            },
        };
        let (Ok(snapshot_id), Ok(source_volume_id)) = (
            bare(&filter.snapshot_id, |b| {
                SnapshotId::parse(b).map(|i| i.to_string())
            }),
            bare(&filter.source_volume_id, |b| {
                VolumeId::parse(b).map(|i| i.to_string())
            }),
        ) else {
            return Ok(Page {
                entries: Vec::new(),
                next_token: None,
            });
        };
        let page = {
            let st = self.state();
            let matching = st.snapshots.iter().filter(|(id, rec)| {
                snapshot_id.as_ref().is_none_or(|s| s == *id)
                    && source_volume_id
                        .as_ref()
                        .is_none_or(|v| *v == rec.source_volume_id)
            });
            backend::page_after(matching, page.starting_token.as_deref(), page.max_entries)
        };
        Ok(Page {
            entries: page.entries.iter().map(|r| self.snapshot_of(r)).collect(),
            next_token: page.next_token,
        })
    }

    fn create_group_snapshot(&self, req: &NewGroupSnapshot) -> Result<GroupSnapshot> {
        self.create_group(req)
    }

    fn delete_group_snapshot(&self, req: &GroupSnapshotRef) -> Result<()> {
        self.delete_group(req)
    }

    fn get_group_snapshot(&self, req: &GroupSnapshotRef) -> Result<GroupSnapshot> {
        self.get_group(req)
    }

    fn snapshot_allocated(
        &self,
        snapshot_id: &str,
        start: u64,
        sink: &mut dyn MetadataSink,
    ) -> Result<()> {
        let (rec, path, file) = self.open_snapshot(snapshot_id)?;
        super::metadata::allocated(&file, &path, rec.size_bytes, start, sink)
    }

    fn snapshot_delta(
        &self,
        base_snapshot_id: &str,
        target_snapshot_id: &str,
        start: u64,
        sink: &mut dyn MetadataSink,
    ) -> Result<()> {
        let (base, base_path, base_file) = self.open_snapshot(base_snapshot_id)?;
        let (target, target_path, target_file) = self.open_snapshot(target_snapshot_id)?;
        if base.source_volume_id != target.source_volume_id {
            return Err(Error::invalid(
                "target_snapshot_id",
                format!(
                    "snapshot {} is of volume {}, the base snapshot {} of volume {}",
                    self.show(&target.id),
                    self.show(&target.source_volume_id),
                    self.show(&base.id),
                    self.show(&base.source_volume_id)
                ),
            ));
        }
        let pair = super::metadata::Pair {
            base: (&base_file, &base_path),
            target: (&target_file, &target_path),
        };
        super::metadata::delta(&pair, target.size_bytes, start, sink)
    }
}

impl<A: Attacher> EmbeddedBackend<A> {
    /// A snapshot's record and its data file, open (a delete meanwhile does not disturb a
    /// reader); NOT_FOUND for one that does not exist.
    fn open_snapshot(&self, raw: &str) -> Result<(SnapshotRecord, std::path::PathBuf, File)> {
        let not_found = || Error::SnapshotNotFound(trunc(raw).to_string());
        let id = self.snapshot_here(raw)?;
        let rec = self
            .state()
            .snapshots
            .get(id.as_str())
            .cloned()
            .ok_or_else(not_found)?;
        let path = self.layout.snapshot_file(&id);
        let file = File::open(&path).map_err(|e| Error::io("open", &path, e))?;
        Ok((rec, path, file))
    }
}
