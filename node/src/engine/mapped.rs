//! An RBD volume's NodeStageVolume and NodeUnstageVolume: the image mapped before the stage,
//! unmapped after the unstage; and the mappings' part of reconciliation.
//!
//! A map is journaled like a mount: the intent (`InProgress`, with the pool and image) before
//! the attacher runs, the device after (`Done`); an unmap sets the record back to
//! `InProgress` first and drops it once the image is unmapped, so a failed or cut-short unmap
//! is retried (by kubelet's next NodeUnstageVolume, or the next reconciliation) and the
//! record never claims less than is mapped. Before mapping, the attacher is asked for the
//! image's live mapping, which is reused: an image is never mapped twice. Once mapped, the
//! stage runs on the mapped device, held and checked to be the image's, as any other.

use std::path::PathBuf;
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use tracing::{info, warn};

use super::{Access, Engine, Stage, StageReport};
use crate::attach::journal::MappingRecord;
use crate::attach::request::RbdStage;
use crate::attach::{AttachError, Attacher, ImageSpec, MapRequest, Mapping};
use crate::crash_points;
use crate::error::{Error, Result};
use crate::journal::{Durability, Phase, VolumeRecord};
use crate::reconcile::Action;
use crate::sys::{HeldDevice, MountState, Os};

/// Less than this written by a mapping's server over a whole unmap deadline is no answer
/// (an idle rbd-fuse writes a few bytes a minute to wake its own threads).
pub const STALL_BYTES: u64 = 1024;

/// Whether a server whose activity went from `before` to `now` over one deadline has stopped
/// answering. Without a count there is no telling: never.
pub fn stalled(before: Option<u64>, now: Option<u64>) -> bool {
    match (before, now) {
        (Some(b), Some(n)) => n.saturating_sub(b) < STALL_BYTES,
        _ => false,
    }
}

/// Watches an unmount of an RBD volume's filesystem, which flushes through the mapping:
/// once the mapping's server has not answered for a whole unmap deadline (a node cut off from
/// the cluster), the mapping is aborted, which fails the flush, so the unmount ends instead of
/// hanging for ever. What the server had not written by then could not reach the cluster
/// anyway. Stops when dropped.
#[derive(Debug)]
pub(crate) struct StallWatch {
    stop: Option<mpsc::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl StallWatch {
    fn start(attacher: Arc<dyn Attacher>, image: ImageSpec, volume: String) -> Option<Self> {
        let period = attacher.deadlines().unmap.max(Duration::from_millis(10));
        let (stop, stopped) = mpsc::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("moor-rbd-watch".into())
            .spawn(move || {
                let mut before = attacher.activity(&image);
                while let Err(mpsc::RecvTimeoutError::Timeout) = stopped.recv_timeout(period) {
                    let now = attacher.activity(&image);
                    if stalled(before, now) {
                        warn!(volume, image = %image, deadline = ?period,
                            "the RBD mapping's server has not answered for the whole unmap deadline; aborting it so the unmount ends");
                        attacher.abort(&image);
                        return;
                    }
                    before = now;
                }
            })
            .ok()?;
        Some(Self {
            stop: Some(stop),
            thread: Some(thread),
        })
    }
}

impl Drop for StallWatch {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// An image's key in the volume lock set (a volume id never holds a NUL).
fn image_lock(image: &ImageSpec) -> String {
    format!("\0rbd\0{image}")
}

/// Whether `a` and `b` name the same image; a cluster id only one of them knows (the kernel's
/// sysfs has none) does not tell them apart.
fn same_image(a: &ImageSpec, b: &ImageSpec) -> bool {
    a.pool == b.pool
        && a.image == b.image
        && (a.cluster_id == b.cluster_id || a.cluster_id.is_none() || b.cluster_id.is_none())
}

impl<O: Os> Engine<O> {
    /// The attacher, which must be the one the recorded mapping `m` was made with.
    fn attacher_for(&self, m: Option<&MappingRecord>) -> Result<&Arc<dyn Attacher>> {
        let Some(a) = &self.attacher else {
            return Err(AttachError::Unavailable(
                "this node maps no RBD images: start moor-node with --rbd-attacher kernel or \
                 fuse (auto found neither the kernel's RBD client nor rbd-fuse)"
                    .into(),
            )
            .into());
        };
        if let Some(m) = m
            && m.attacher != a.kind()
        {
            return Err(AttachError::Unavailable(format!(
                "RBD image {} was mapped by the {} attacher, and this node runs the {} attacher",
                m.spec(),
                m.attacher,
                a.kind()
            ))
            .into());
        }
        Ok(a)
    }

    /// NodeStageVolume of an RBD volume: the image mapped (or its mapping reused), then
    /// staged on the mapped device. A stage that fails leaving nothing mounted unmaps it.
    /// `report` tells what the stage did, also when it fails.
    pub fn stage_mapped(
        &self,
        req: &Stage,
        rbd: &RbdStage,
        report: &mut StageReport,
    ) -> Result<()> {
        let _guard = self.locks.try_lock(&req.volume_id)?;
        let r = self.map_and_stage(req, rbd, report);
        self.note_stage(&req.volume_id, &r, report);
        r
    }

    /// [`stage_mapped`](Self::stage_mapped), with the volume's guard held.
    fn map_and_stage(&self, req: &Stage, rbd: &RbdStage, report: &mut StageReport) -> Result<()> {
        let attacher = Arc::clone(self.attacher_for(None)?);
        let image = &rbd.image;
        let _image = self.locks.try_lock(&image_lock(image))?;
        let mut record = self.record(&req.volume_id);
        self.check_image_owner(&record, image)?;
        let was_mapped = record.mapping.as_ref().is_some_and(|m| m.spec() == *image);
        let read_only = req.cap.is_reader_only() || rbd.read_only;
        let mapping = self.ensure_mapped(&mut record, &attacher, rbd, read_only)?;
        if was_mapped {
            self.rebind_stage(&mut record, &mapping)?;
        }
        let mut on_device = req.clone();
        on_device.device = Some(mapping.device.clone());
        on_device.identity = mapping.identity.clone();
        if rbd.read_only {
            // Published read-only: the stage is too (and never formats).
            match &mut on_device.cap.access {
                Access::Mount { options, .. } => options.attrs.read_only = true,
                Access::Block { attrs } => attrs.read_only = true,
            }
        }
        let staged = self
            .hold_mapped(&req.volume_id, attacher.as_ref(), image, &mapping)
            .and_then(|_held| self.stage_held(&on_device, report));
        if let Err(e) = &staged {
            let mut now = self.record(&req.volume_id);
            // Nothing mounted, or only the intent of a mkfs that failed (which a later
            // stage resumes on the image's next mapping).
            let unused = now
                .stage
                .as_ref()
                .is_none_or(|s| s.phase == Phase::Formatting)
                && now.publishes.is_empty();
            if unused
                && now.mapping.is_some()
                && let Err(u) = self.unmap_record(&mut now, attacher.as_ref())
            {
                warn!(volume = req.volume_id, image = %image, error = %u, stage_error = %e,
                    "unmapping after a failed stage; the next unstage or reconciliation retries");
            }
        }
        staged
    }

    /// A volume maps one image, and an image is mapped for one volume. A mapping recorded
    /// before a reboot is gone with it: it holds no image.
    fn check_image_owner(&self, record: &VolumeRecord, image: &ImageSpec) -> Result<()> {
        let live = |m: &&MappingRecord| !self.boot().is_earlier(m.boot.as_deref());
        if let Some(m) = record.mapping.as_ref().filter(live)
            && !same_image(&m.spec(), image)
        {
            return Err(Error::FailedPrecondition(format!(
                "volume {:?} has RBD image {} mapped on this node, not {image}",
                record.volume_id,
                m.spec()
            )));
        }
        let other = self.journal.all().into_iter().find(|r| {
            r.volume_id != record.volume_id
                && r.mapping
                    .as_ref()
                    .filter(live)
                    .is_some_and(|m| same_image(&m.spec(), image))
        });
        if let Some(r) = other {
            return Err(Error::FailedPrecondition(format!(
                "RBD image {image} is mapped on this node for volume {:?}",
                r.volume_id
            )));
        }
        Ok(())
    }

    /// The image's mapping: the live one the attacher finds, or a new one, journaled.
    fn ensure_mapped(
        &self,
        record: &mut VolumeRecord,
        attacher: &Arc<dyn Attacher>,
        rbd: &RbdStage,
        read_only: bool,
    ) -> Result<Mapping> {
        let image = &rbd.image;
        if let Some(found) = attacher.find(image)? {
            if found.read_only == read_only {
                self.record_mapped(record, attacher.kind(), image, &found, Some(&rbd.monitors))?;
                return Ok(found);
            }
            if record.stage.is_some() {
                return Err(Error::Incompatible {
                    volume: record.volume_id.clone(),
                    what: "staged",
                    reason: format!(
                        "RBD image {image} is mapped {} on this node",
                        if found.read_only {
                            "read-only"
                        } else {
                            "read-write"
                        }
                    ),
                });
            }
            // Mapped in the other mode and not staged: mapped again in this one.
            record.mapping = Some(MappingRecord::intent(
                attacher.kind(),
                image,
                found.read_only,
                self.boot(),
            ));
            self.unmap_record(record, attacher.as_ref())?;
        }
        record.mapping = Some(MappingRecord {
            monitors: Some(rbd.monitors.clone()),
            ..MappingRecord::intent(attacher.kind(), image, read_only, self.boot())
        });
        self.journal.put(record, Durability::Process)?;
        crash_points::point("map.mapping");
        let start = Instant::now();
        let mapped = attacher.map(&MapRequest {
            image,
            monitors: &rbd.monitors,
            credentials: &rbd.credentials,
            read_only,
            exclusive: rbd.exclusive && !read_only,
        });
        let mapping = match mapped {
            Ok(m) => m,
            Err(e) => {
                // A map past its deadline may still finish: its intent stays, for the next
                // stage (which finds and reuses it) or the reconciliation (which unmaps it).
                if !e.may_have_mapped() {
                    record.mapping = None;
                    self.journal.put(record, Durability::Process)?;
                }
                return Err(e.into());
            }
        };
        crash_points::point("map.mapped");
        info!(
            volume = record.volume_id,
            image = %image,
            device = %mapping.device.display(),
            attacher = attacher.kind(),
            read_only,
            ms = start.elapsed().as_secs_f64() * 1e3,
            "mapped RBD image"
        );
        self.record_mapped(
            record,
            attacher.kind(),
            image,
            &mapping,
            Some(&rbd.monitors),
        )?;
        Ok(mapping)
    }

    /// Records `mapping` of `image` done, through `monitors` (None: those of the record it
    /// replaces); written only when it changes the record.
    fn record_mapped(
        &self,
        record: &mut VolumeRecord,
        kind: &str,
        image: &ImageSpec,
        mapping: &Mapping,
        monitors: Option<&str>,
    ) -> Result<()> {
        let monitors = monitors
            .map(str::to_string)
            .or_else(|| record.mapping.as_ref().and_then(|m| m.monitors.clone()));
        let done = MappingRecord {
            device: Some(mapping.device.clone()),
            rdev: Some(mapping.rdev),
            phase: Phase::Done,
            monitors,
            ..MappingRecord::intent(kind, image, mapping.read_only, self.boot())
        };
        if record.mapping.as_ref() != Some(&done) {
            record.mapping = Some(done);
            self.journal.put(record, Durability::Process)?;
        }
        Ok(())
    }

    /// The image was mapped again (after a reboot, or an rbd-fuse that died) on another
    /// device: the stage record names the image's new device, while nothing is mounted on
    /// the staging path. The image is the volume's identity; the device number was only the
    /// mapping's.
    fn rebind_stage(&self, record: &mut VolumeRecord, mapping: &Mapping) -> Result<()> {
        let Some(st) = record.stage.as_mut() else {
            return Ok(());
        };
        if st.device == mapping.device && st.rdev == mapping.rdev {
            return Ok(());
        }
        if matches!(self.os.mount_state(&st.path)?, MountState::Mounted(_)) {
            return Ok(());
        }
        info!(
            volume = record.volume_id,
            from = %st.device.display(),
            to = %mapping.device.display(),
            "the volume's RBD image is mapped on a new device; its stage record follows"
        );
        st.device = mapping.device.clone();
        st.rdev = mapping.rdev;
        // A record of a mkfs in progress is rewritten as durably as it was first written.
        let durability = if record.guards_data() {
            Durability::Power
        } else {
            Durability::Process
        };
        self.journal.put(record, durability)?;
        Ok(())
    }

    /// Opens the mapped device and holds it for the stage, once it proves to be the image's:
    /// its number is the mapping's, and the attacher recognizes it.
    fn hold_mapped(
        &self,
        volume_id: &str,
        attacher: &dyn Attacher,
        image: &ImageSpec,
        mapping: &Mapping,
    ) -> Result<HeldDevice> {
        let held = self.os.hold_device(&mapping.device).map_err(|e| {
            if e.errno().is_some_and(crate::sys::is_gone_errno) {
                Error::VolumeNotFound {
                    volume: volume_id.to_string(),
                    reason: format!(
                        "the mapping of RBD image {image} ({}) vanished",
                        mapping.device.display()
                    ),
                }
            } else {
                Error::Sys(e)
            }
        })?;
        if held.rdev != mapping.rdev {
            return Err(Error::FailedPrecondition(format!(
                "{} is device {}:{}, not the mapping of RBD image {image} ({}:{})",
                mapping.device.display(),
                held.rdev.0,
                held.rdev.1,
                mapping.rdev.0,
                mapping.rdev.1
            )));
        }
        attacher.verify(image, held.rdev)?;
        Ok(held)
    }

    /// A watch over the unstage of a mapped volume (see [`StallWatch`]); None for any other.
    pub(crate) fn watch_unstage(&self, volume_id: &str) -> Option<StallWatch> {
        let m = self.record(volume_id).mapping?;
        let attacher = Arc::clone(self.attacher_for(Some(&m)).ok()?);
        StallWatch::start(attacher, m.spec(), volume_id.to_string())
    }

    /// After an unstage: the volume's image unmapped, unless it is still staged (at another
    /// path) or maps nothing.
    pub(super) fn unmap_unstaged(&self, volume_id: &str) -> Result<()> {
        let mut record = self.record(volume_id);
        // A staging kubelet ended with moor's mkfs unfinished keeps its record (the intent),
        // and holds no mapping: the next stage maps the image again.
        let staged = record
            .stage
            .as_ref()
            .is_some_and(|s| s.boot.as_deref() != Some(crate::journal::Boot::ENDED));
        if staged || record.mapping.is_none() {
            return Ok(());
        }
        let attacher = Arc::clone(self.attacher_for(record.mapping.as_ref())?);
        let image = record
            .mapping
            .as_ref()
            .map(MappingRecord::spec)
            .ok_or_else(|| Error::FailedPrecondition("no mapping".into()))?;
        let _image = self.locks.try_lock(&image_lock(&image))?;
        self.unmap_record(&mut record, attacher.as_ref())
    }

    /// Unmaps the record's image: the record set in progress first, dropped once unmapped;
    /// after a failure it stays in progress, for a retry.
    fn unmap_record(&self, record: &mut VolumeRecord, attacher: &dyn Attacher) -> Result<()> {
        let Some(mut m) = record.mapping.clone() else {
            return Ok(());
        };
        let image = m.spec();
        if m.phase != Phase::InProgress {
            m.phase = Phase::InProgress;
            record.mapping = Some(m);
            self.journal.put(record, Durability::Process)?;
        }
        crash_points::point("unmap.unmapping");
        let start = Instant::now();
        attacher.unmap(&image)?;
        crash_points::point("unmap.unmapped");
        info!(
            volume = record.volume_id,
            image = %image,
            ms = start.elapsed().as_secs_f64() * 1e3,
            "unmapped RBD image"
        );
        record.mapping = None;
        self.journal.put(record, Durability::Process)?;
        Ok(())
    }

    /// Why the volume's RBD cluster is away, for its condition: a finished mapping whose
    /// monitors do not answer. None when it answers, or the volume maps nothing.
    pub(super) fn cluster_away(&self, record: Option<&VolumeRecord>) -> Option<String> {
        let m = record?.mapping.as_ref()?;
        let monitors = m.monitors.as_deref().filter(|_| m.phase == Phase::Done)?;
        self.attacher.as_ref()?.cluster_answers(monitors).err()
    }

    /// Before NodeExpandVolume grows a filesystem: the mapped device takes the image's new
    /// size.
    pub(super) fn refresh_mapping(&self, volume_id: &str) -> Result<()> {
        let Some(m) = self.record(volume_id).mapping else {
            return Ok(());
        };
        if m.phase == Phase::Done {
            self.attacher_for(Some(&m))?.refresh(&m.spec())?;
        }
        Ok(())
    }

    /// The mappings the attacher shows, for [`reconcile_orphans`](Self::reconcile_orphans):
    /// read before the journal is, so a map that starts meanwhile is already recorded.
    pub(crate) fn listed_mappings(&self) -> Vec<(ImageSpec, Option<PathBuf>)> {
        self.attacher
            .as_ref()
            .and_then(|a| a.list().ok())
            .unwrap_or_default()
    }

    /// The mapping's part of reconciliation, for one volume under its lock, after its mounts'
    /// (a stage they rolled back no longer holds the mapping). A map or unmap a crash cut
    /// short is finished (the image is mapped and the volume staged: confirmed) or undone
    /// (nothing staged: unmapped, record dropped); a mapping nothing is staged on is unmapped
    /// (its record cleared, also when a reboot took the mapping already); a full pass also
    /// reports a mapping in use that is gone (the next stage maps it again).
    pub(crate) fn reconcile_mapping(
        &self,
        record: &mut VolumeRecord,
        full: bool,
        actions: &mut Vec<Action>,
    ) {
        let Some(m) = record.mapping.clone() else {
            return;
        };
        let volume = record.volume_id.clone();
        let claims = self.claims(record.clone());
        if self.boot().is_earlier(m.boot.as_deref())
            && claims.stage.is_none()
            && claims.publishes.is_empty()
        {
            // A mapping a reboot ended, under nothing that holds it now: kept with the memory of
            // its staging (the next stage maps the image again and the staging follows it),
            // else forgotten. What is mapped now was not this record's.
            if record.stage.is_none() {
                record.mapping = None;
                match self.journal.put(record, Durability::Process) {
                    Ok(()) => actions.push(Action::Forgotten {
                        volume,
                        path: PathBuf::from(m.spec().to_string()),
                    }),
                    Err(e) => actions.push(Action::Failed {
                        volume,
                        path: PathBuf::from(m.spec().to_string()),
                        error: e.to_string(),
                    }),
                }
            }
            return;
        }
        let in_use = record.stage.is_some() || !record.publishes.is_empty();
        let image = m.spec();
        let failed = |error: String| Action::Failed {
            volume: volume.clone(),
            path: PathBuf::from(image.to_string()),
            error,
        };
        let attacher = match self.attacher_for(Some(&m)) {
            Ok(a) => Arc::clone(a),
            Err(e) => {
                if m.phase == Phase::Done && !full && in_use {
                    return;
                }
                actions.push(failed(e.to_string()));
                return;
            }
        };
        // A confirmed mapping in use whose server died (moor-node's upgrade took it) is taken
        // over by a new one, in every pass: the start's, before kubelet is answered, and the
        // periodic ones (an old moor-node's servers may end after this one started).
        if m.phase == Phase::Done && in_use {
            match attacher.recover(&image) {
                Ok(true) => actions.push(Action::Recovered {
                    volume: volume.clone(),
                    image: image.to_string(),
                }),
                Ok(false) => {}
                Err(e) => actions.push(failed(e.to_string())),
            }
        }
        // A light pass leaves a confirmed mapping in use alone otherwise.
        if m.phase == Phase::Done && !full && in_use {
            return;
        }
        if attacher.in_flight(&image) {
            return;
        }
        let found = match attacher.find(&image) {
            Ok(f) => f,
            Err(e) => {
                actions.push(failed(e.to_string()));
                return;
            }
        };
        match found {
            Some(f) if in_use => {
                let before = record.mapping.clone();
                if let Err(e) = self.record_mapped(record, attacher.kind(), &image, &f, None) {
                    actions.push(failed(e.to_string()));
                } else if before != record.mapping {
                    actions.push(Action::Confirmed {
                        volume,
                        path: f.device,
                    });
                }
            }
            None if in_use => actions.push(Action::MappingLost {
                volume,
                image: image.to_string(),
            }),
            _ => match self.unmap_record(record, attacher.as_ref()) {
                Ok(()) => actions.push(Action::Unmapped {
                    volume: Some(volume),
                    image: image.to_string(),
                }),
                Err(e) => actions.push(failed(e.to_string())),
            },
        }
    }

    /// Mappings no record names (`listed` before the journal was read): one a stage record
    /// sits on (the journal lost only the mapping) is recorded again; one of moor's own is
    /// unmapped; one moor cannot prove its own (a kernel mapping) is reported and left alone.
    /// `named` are the images the records named when the pass read the journal (their own
    /// reconciliation dealt with them).
    pub(crate) fn reconcile_orphans(
        &self,
        listed: Vec<(ImageSpec, Option<PathBuf>)>,
        named: &[ImageSpec],
        actions: &mut Vec<Action>,
    ) {
        let Some(attacher) = self.attacher.as_ref().map(Arc::clone) else {
            return;
        };
        for (image, device) in listed {
            let records = self.journal.all();
            let recorded = records.iter().any(|r| {
                r.mapping
                    .as_ref()
                    .is_some_and(|m| same_image(&m.spec(), &image))
            });
            if recorded || named.iter().any(|n| same_image(n, &image)) {
                continue;
            }
            let holder = device.as_ref().and_then(|d| {
                records
                    .iter()
                    .find(|r| r.stage.as_ref().is_some_and(|s| &s.device == d))
            });
            if let Some(r) = holder {
                let Ok(_guard) = self.locks.try_lock_background(&r.volume_id) else {
                    actions.push(Action::Busy {
                        volume: r.volume_id.clone(),
                    });
                    continue;
                };
                let mut now = self.record(&r.volume_id);
                if now.mapping.is_some() {
                    continue;
                }
                match attacher.find(&image) {
                    Ok(Some(f)) => {
                        match self.record_mapped(&mut now, attacher.kind(), &image, &f, None) {
                            Ok(()) => actions.push(Action::Adopted {
                                volume: r.volume_id.clone(),
                                path: f.device,
                            }),
                            Err(e) => actions.push(Action::Failed {
                                volume: r.volume_id.clone(),
                                path: PathBuf::from(image.to_string()),
                                error: e.to_string(),
                            }),
                        }
                    }
                    Ok(None) => {}
                    Err(e) => actions.push(Action::Failed {
                        volume: r.volume_id.clone(),
                        path: PathBuf::from(image.to_string()),
                        error: e.to_string(),
                    }),
                }
                continue;
            }
            if !attacher.owns_all_listed() {
                actions.push(Action::ForeignMapping {
                    image: image.to_string(),
                });
                continue;
            }
            let Ok(_image) = self.locks.try_lock_background(&image_lock(&image)) else {
                continue;
            };
            match attacher.unmap(&image) {
                Ok(()) => actions.push(Action::Unmapped {
                    volume: None,
                    image: image.to_string(),
                }),
                Err(e) => actions.push(Action::Failed {
                    volume: String::new(),
                    path: PathBuf::from(image.to_string()),
                    error: e.to_string(),
                }),
            }
        }
    }
}
