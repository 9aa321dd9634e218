//! NodeStageVolume and NodeUnstageVolume.
//!
//! A stage runs as named steps: the journal's record checked, the device found and held
//! (`device.rs`), the staging dir readied, the format decided and made and an existing
//! filesystem checked (`format.rs`), the mount, and what follows it (group, growth, the
//! confirmation).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use moor_proto::csi::v1::volume_capability::access_mode::Mode;
use moor_runtime::contract::Filesystem;
use tracing::{info, warn};

use super::{ADOPTED_MODE, Access, Capability, Engine, FsckOutcome, Stage, Unstage};
use crate::crash_points;
use crate::error::{Error, Result};
use crate::filesystem;
use crate::journal::{AccessRecord, Boot, Durability, Phase, StageRecord, VolumeRecord};
use crate::mount_options::MountOptions;
use crate::superblock::Content;
use crate::sys::{FsMount, HeldDevice, MountAttrs, MountPoint, MountState, Os};
use crate::{fsgroup, selinux};

/// What a stage did, for the service's metrics and logs: filled as the steps run, so it also
/// tells what a stage that failed did before it failed.
#[derive(Debug, Clone, Copy, Default)]
pub struct StageReport {
    /// Whether the device was formatted.
    pub formatted: bool,
    /// How long mkfs took.
    pub mkfs: Option<Duration>,
    /// How long the mount took.
    pub mount: Option<Duration>,
    /// Whether the filesystem was grown to its device's size (a volume restored or cloned
    /// into a larger one, or grown on the controller while it was not staged).
    pub grown: bool,
    /// The check of an existing filesystem before its read-write mount, if one ran.
    pub fsck: Option<(Filesystem, FsckOutcome)>,
}

/// A filesystem at least this much smaller than its device is grown when it is staged. Less is
/// what a tool leaves by design (resize2fs drops a last block group too small to hold its own
/// metadata), and growing would change nothing.
pub const GROW_MIN: u64 = 16 << 20;

fn access_record(access: &Access) -> AccessRecord {
    match access {
        Access::Mount { fs, options, group } => AccessRecord::Mount {
            fs_type: fs.name().to_string(),
            fs_options: options.fs_options.clone(),
            group: *group,
        },
        Access::Block { .. } => AccessRecord::Block,
    }
}

/// The per-mount attributes a volume is staged with: a reader-only mode stages it read-only.
fn stage_attrs(cap: &Capability) -> MountAttrs {
    let mut attrs = cap.access.attrs();
    if cap.is_reader_only() {
        attrs.read_only = true;
    }
    attrs
}

/// The filesystem UUID the journal recorded for the volume, while the device shows it.
fn recorded_uuid(record: &VolumeRecord, content: &Content) -> Option<String> {
    match (&record.stage, content) {
        (Some(s), Content::Filesystem { uuid: Some(u), .. })
            if s.fs_uuid.as_deref() == Some(u.as_str()) =>
        {
            Some(u.clone())
        }
        _ => None,
    }
}

/// A NodeStageVolume request with its device found and held: what the steps of a stage work
/// on.
pub(super) struct Staging<'a> {
    pub(super) req: &'a Stage,
    /// The device's path: the request's hint, or where the search found the device.
    pub(super) path: PathBuf,
    /// The device, held from the identity check to the mount.
    pub(super) dev: HeldDevice,
    /// The per-mount attributes the volume is staged with.
    pub(super) attrs: MountAttrs,
    /// The boot its records are written in.
    pub(super) boot: Option<String>,
    /// The device is the mapping of a LUKS volume moor formatted whose filesystem is not made
    /// yet: what it holds (noise: zeros decrypt to it) is formatted.
    pub(super) fresh_luks: bool,
}

impl Staging<'_> {
    /// The journal's record of this stage in `phase`.
    pub(super) fn record(&self, phase: Phase, fs_uuid: Option<String>) -> StageRecord {
        StageRecord {
            path: self.req.staging.clone(),
            device: self.path.clone(),
            rdev: self.dev.rdev,
            access: access_record(&self.req.cap.access),
            attrs: self.attrs,
            access_mode: self.req.cap.mode as i32,
            phase,
            fs_uuid,
            boot: self.boot.clone(),
        }
    }

    /// Whether `mp` is a mount of the held device. A filesystem whose mounts have a device
    /// number of their own (btrfs gives its mounts an anonymous one): nothing to compare.
    fn is_mount_of_device(&self, mp: &MountPoint) -> bool {
        mp.dev == self.dev.rdev
            || matches!(&self.req.cap.access, Access::Mount { fs, .. }
                if !filesystem::ops(*fs).mount_shows_device())
    }
}

impl<O: Os> Engine<O> {
    /// NodeStageVolume: the volume's device found and held, its filesystem made if the device
    /// is blank, checked, mounted on the staging dir, given to its group and grown to its
    /// device, each step written to the journal before it changes the node.
    /// `report` tells what it did, also when it fails.
    pub fn stage(&self, req: &Stage, report: &mut StageReport) -> Result<()> {
        let _guard = self.locks.try_lock(&req.volume_id)?;
        let r = self.stage_held(req, report);
        self.note_stage(&req.volume_id, &r, report);
        r
    }

    /// [`stage`](Self::stage), with the volume's guard already held.
    pub(super) fn stage_held(&self, req: &Stage, report: &mut StageReport) -> Result<()> {
        selinux::require_support(&*self.os, &req.cap.access)?;
        let mut record = self.record(&req.volume_id);
        self.check_stage_record(&record, req)?;
        let (path, dev) = self.resolve_device(req)?;
        // An encrypted volume: the rest of the stage uses its open mapping.
        let (path, dev, fresh_luks, opened_here) = match &req.encryption {
            Some(enc) => {
                let opened = self.open_encrypted(&mut record, req, enc, (&path, &dev))?;
                (opened.path, opened.dev, opened.fresh, opened.here)
            }
            None => (path, dev, false, false),
        };
        let staged = self.stage_on(&mut record, req, (path, dev, fresh_luks), report);
        match staged {
            // Nothing half-done: a mapping this call opened is closed again (the device it
            // held is released by then).
            Err(e) if opened_here => Err(self.close_after_failed_stage(&req.volume_id, e)),
            other => other,
        }
    }

    /// The steps of [`stage_held`](Self::stage_held) on the volume's device, or its open
    /// mapping, held: released when they return.
    fn stage_on(
        &self,
        record: &mut VolumeRecord,
        req: &Stage,
        (path, dev, fresh_luks): (PathBuf, HeldDevice, bool),
        report: &mut StageReport,
    ) -> Result<()> {
        let st = Staging {
            req,
            path,
            dev,
            attrs: stage_attrs(&req.cap),
            boot: self.boot().stamp(),
            fresh_luks,
        };
        let interrupted = self.check_recorded_device(record, &st)?;
        if self.prepare_staging_dir(record, &st)? {
            return self.restage(record, &st, report);
        }
        let Access::Mount { fs, options, .. } = &req.cap.access else {
            // Block: the device is verified; nothing is mounted at stage.
            self.confirm_stage(record, &st, None)?;
            return Ok(());
        };

        let mut ext_head = None;
        let mut content = self.probe_device_keeping(&st.dev.handle, st.dev.size, &mut ext_head)?;
        // The recorded UUID stays only while the device shows it.
        let mut fs_uuid = recorded_uuid(record, &content);
        if st.must_format(&content, interrupted)? {
            let force = interrupted || st.fresh_luks;
            let (uuid, took) = self.format(record, &st, *fs, force)?;
            report.mkfs = Some(took);
            report.formatted = true;
            fs_uuid = Some(uuid);
            content = self.probe_device(&st.dev.handle, st.dev.size)?;
        }
        self.check_found(record, &content, *fs, &st.path)?;
        if !report.formatted && !st.attrs.read_only {
            self.check_fs(&req.volume_id, *fs, &st.dev, ext_head.as_deref(), report)?;
        }

        record.stage = Some(st.record(Phase::InProgress, fs_uuid.clone()));
        // The LUKS volume holds its filesystem now: never formatted again.
        if let Some(c) = record.crypt.as_mut() {
            c.fresh = false;
            c.luks_uuid = None;
        }
        // After a mkfs, durable before the first mount: from the mount on the device holds
        // data, and the record that let mkfs run must never be the newest one a power cut
        // leaves.
        let durability = if report.formatted {
            Durability::Power
        } else {
            Durability::Process
        };
        self.journal.put(record, durability)?;
        report.mount = Some(self.mount_staged(record, &st, *fs, options)?);
        report.grown = self.finish_stage(record, &st, &content, fs_uuid)?;
        Ok(())
    }

    /// The journal's record against the request: a volume staged elsewhere, or with another
    /// capability, is refused, and a new volume past the node's limit. A staging recorded
    /// before a reboot and not mounted since is no staging: this one replaces it.
    fn check_stage_record(&self, record: &VolumeRecord, req: &Stage) -> Result<()> {
        let Some(st) = record.stage.as_ref().filter(|s| !self.stage_is_memory(s)) else {
            if self.cfg.max_volumes > 0 && self.staged_claims() >= self.cfg.max_volumes {
                return Err(Error::TooManyVolumes(self.cfg.max_volumes));
            }
            if let Some(memory) = &record.stage {
                info!(
                    volume = req.volume_id,
                    path = %memory.path.display(),
                    "a staging recorded before the node rebooted is not mounted: this stage \
                     replaces it"
                );
            }
            return Ok(());
        };
        if st.path != req.staging {
            return Err(Error::FailedPrecondition(format!(
                "volume {:?} is already staged at {}",
                req.volume_id,
                st.path.display()
            )));
        }
        if st.access_mode != ADOPTED_MODE
            && (st.access != access_record(&req.cap.access)
                || st.attrs != stage_attrs(&req.cap)
                || st.access_mode != req.cap.mode as i32)
        {
            return Err(Error::Incompatible {
                volume: req.volume_id.clone(),
                what: "staged",
                reason: "the volume capability differs from the one it was staged with".into(),
            });
        }
        Ok(())
    }

    /// The held device against the journal's record: a volume staged from another device is
    /// refused. Whether moor's own mkfs was cut short on this device.
    fn check_recorded_device(&self, record: &VolumeRecord, st: &Staging<'_>) -> Result<bool> {
        let (req, dev) = (st.req, &st.dev);
        if let Some(s) = &record.stage
            && s.rdev != dev.rdev
            && s.phase == Phase::Done
            && !self.renumbered(s, st)?
        {
            return Err(Error::FailedPrecondition(format!(
                "volume {:?} was staged from device {}:{}, but {} is now {}:{}",
                req.volume_id,
                s.rdev.0,
                s.rdev.1,
                st.path.display(),
                dev.rdev.0,
                dev.rdev.1
            )));
        }
        // moor's own mkfs that a crash cut short, on this very device: an identity the request
        // carries proves it (resolve_device checked it); without one, only the same device
        // number does, and a number alone cannot tell a reused loop device from this one.
        let interrupted = record
            .stage
            .as_ref()
            .filter(|s| s.phase == Phase::Formatting);
        if let Some(s) = interrupted
            && req.identity.is_empty()
            && s.rdev != dev.rdev
        {
            return Err(Error::FailedPrecondition(format!(
                "volume {:?}: moor was formatting device {}:{} ({}) when it was interrupted, \
                 but {} is now {}:{}; refusing to use it",
                req.volume_id,
                s.rdev.0,
                s.rdev.1,
                s.device.display(),
                st.path.display(),
                dev.rdev.0,
                dev.rdev.1
            )));
        }
        Ok(interrupted.is_some())
    }

    /// Whether the device `st` holds is the recorded stage's, renumbered: a reboot (a power
    /// cut) hands out device numbers afresh, so a volume staged from 253:2 may come back as
    /// 253:1 at the same path. It is the volume's own device when nothing is mounted on the
    /// staging path any more (the record is one a reboot left) and either the request names
    /// the device by an identity (a serial, a WWN, a backing file, an RBD image: the device
    /// was found and checked by it) or the device carries the filesystem moor made for the
    /// volume, by the UUID it chose at mkfs. Anything else at a path alone (a filesystem moor
    /// did not make, another UUID, a blank device) stays refused: the path may name another
    /// disk now.
    fn renumbered(&self, s: &StageRecord, st: &Staging<'_>) -> Result<bool> {
        if matches!(
            self.os.mount_state(&st.req.staging)?,
            MountState::Mounted(_)
        ) {
            return Ok(false);
        }
        if !st.req.identity.is_empty() {
            warn!(
                volume = st.req.volume_id,
                from = ?s.rdev,
                to = ?st.dev.rdev,
                "the volume's device was renumbered (a reboot): its identity names it"
            );
            return Ok(true);
        }
        let Some(want) = s.fs_uuid.as_deref() else {
            return Ok(false);
        };
        let same = matches!(
            self.probe_device(&st.dev.handle, st.dev.size)?,
            Content::Filesystem { uuid: Some(u), .. } if u == want
        );
        if same {
            warn!(
                volume = st.req.volume_id,
                from = ?s.rdev,
                to = ?st.dev.rdev,
                uuid = want,
                "the volume's device was renumbered (a reboot): it carries the volume's filesystem"
            );
        }
        Ok(same)
    }

    /// Readies the staging dir, which the CO creates (its absence is tolerated): a corrupted
    /// mount on it is detached. Whether the volume's own mount is on it already; a mount of
    /// anything else is refused.
    fn prepare_staging_dir(&self, record: &VolumeRecord, st: &Staging<'_>) -> Result<bool> {
        let req = st.req;
        match self.os.mount_state(&req.staging)? {
            MountState::Mounted(mp) => {
                let ours = record
                    .stage
                    .as_ref()
                    .is_some_and(|s| s.phase != Phase::Formatting)
                    && st.is_mount_of_device(&mp);
                if ours && !req.cap.access.is_block() {
                    return Ok(true);
                }
                return Err(Error::Incompatible {
                    volume: req.volume_id.clone(),
                    what: "staged",
                    reason: format!("something else is mounted on {}", req.staging.display()),
                });
            }
            MountState::Corrupted { .. } => self.os.unmount(&req.staging, true)?,
            MountState::Absent => self.os.make_dir(&req.staging)?,
            MountState::NotMounted { is_dir: false } => {
                return Err(Error::FailedPrecondition(format!(
                    "staging_target_path {} is not a directory",
                    req.staging.display()
                )));
            }
            MountState::NotMounted { is_dir: true } => {}
        }
        Ok(false)
    }

    /// Already staged (a retry, or a crash after the mount): confirm. A crash may have come
    /// before the filesystem was grown to its device (and the restart's reconciliation
    /// confirmed the mount): grow it now. (A mounted xfs writes its grown superblock back
    /// lazily; the tool then finds nothing to do.)
    fn restage(
        &self,
        record: &mut VolumeRecord,
        st: &Staging<'_>,
        report: &mut StageReport,
    ) -> Result<()> {
        let (req, dev) = (st.req, &st.dev);
        if !st.attrs.read_only {
            let content = self.probe_device(&dev.handle, dev.size)?;
            report.grown = self.grow_to_device(&content, (&dev.handle, dev.size), &req.staging)?;
            // ... or before the volume was given to its group.
            if let Access::Mount {
                group: Some(gid), ..
            } = &req.cap.access
            {
                fsgroup::apply(self, &req.volume_id, &req.staging, *gid)?;
            }
        }
        let fs_uuid = record.stage.as_ref().and_then(|s| s.fs_uuid.clone());
        self.confirm_stage(record, st, fs_uuid)?;
        Ok(())
    }

    /// Mounts the filesystem `fs` on the staging dir; a failed mount drops the record. How long
    /// the mount took.
    fn mount_staged(
        &self,
        record: &mut VolumeRecord,
        st: &Staging<'_>,
        fs: Filesystem,
        options: &MountOptions,
    ) -> Result<Duration> {
        crash_points::point("stage.mounting");
        let start = Instant::now();
        let mounted = self.os.mount_fs(&FsMount {
            device: st.dev.node.clone(),
            target: st.req.staging.clone(),
            fs_type: fs.name().to_string(),
            attrs: st.attrs,
            options: options.fs_options.clone(),
            sb_read_only: st.req.cap.mode == Mode::MultiNodeReaderOnly,
        });
        if let Err(e) = mounted {
            record.stage = None;
            let first = Error::from(e);
            return Err(match self.journal.put(record, Durability::Process) {
                Ok(()) => first,
                // The intent stays: nothing was mounted, which reconciliation and the retry
                // tell apart from a mount.
                Err(j) => {
                    first.with_cleanup_failure(&st.req.volume_id, "dropping the stage record", &j)
                }
            });
        }
        let took = start.elapsed();
        crash_points::point("stage.mounted");
        Ok(took)
    }

    /// The steps after the mount ([`after_mount`](Self::after_mount)), then the stage
    /// confirmed. Whether the filesystem grew.
    fn finish_stage(
        &self,
        record: &mut VolumeRecord,
        st: &Staging<'_>,
        content: &Content,
        fs_uuid: Option<String>,
    ) -> Result<bool> {
        match self.after_mount(st, content) {
            Ok(grown) => {
                self.confirm_stage(record, st, fs_uuid)?;
                crash_points::point("stage.done");
                Ok(grown)
            }
            Err(e) => {
                // Leave nothing half-done. A mount that cannot be undone keeps its record (the
                // intent): the retry or reconciliation finishes or rolls back the stage, as
                // after a crash at this point.
                if let Err(u) = self.os.unmount(&st.req.staging, false) {
                    return Err(e.with_cleanup_failure(
                        &st.req.volume_id,
                        "unmounting the staging path",
                        &u,
                    ));
                }
                record.stage = None;
                match self.journal.put(record, Durability::Process) {
                    Ok(()) => Err(e),
                    Err(j) => Err(e.with_cleanup_failure(
                        &st.req.volume_id,
                        "dropping the stage record",
                        &j,
                    )),
                }
            }
        }
    }

    /// After the mount: the staging dir must be a mount of the device; then a read-write
    /// volume goes to its group and its filesystem grows to its device. Whether it grew.
    fn after_mount(&self, st: &Staging<'_>, content: &Content) -> Result<bool> {
        let (req, dev) = (st.req, &st.dev);
        match self.os.mount_state(&req.staging)? {
            MountState::Mounted(mp) if st.is_mount_of_device(&mp) => {}
            other => {
                return Err(Error::FailedPrecondition(format!(
                    "{} is not a mount of device {}:{} after mounting it: {other:?}",
                    req.staging.display(),
                    dev.rdev.0,
                    dev.rdev.1
                )));
            }
        }
        if st.attrs.read_only {
            return Ok(false);
        }
        if let Access::Mount {
            group: Some(gid), ..
        } = &req.cap.access
        {
            fsgroup::apply(self, &req.volume_id, &req.staging, *gid)?;
        }
        self.grow_to_device(content, (&dev.handle, dev.size), &req.staging)
    }

    /// Records the stage done, unless the journal already says so (a retry that found it all
    /// done: kubelet re-drives every stage when it restarts).
    fn confirm_stage(
        &self,
        record: &mut VolumeRecord,
        st: &Staging<'_>,
        fs_uuid: Option<String>,
    ) -> Result<()> {
        let done = st.record(Phase::Done, fs_uuid);
        if record.stage.as_ref() == Some(&done) {
            return Ok(());
        }
        record.stage = Some(done);
        self.journal.put(record, Durability::Process)?;
        Ok(())
    }

    /// NodeUnstageVolume: the staging mount goes, then the RBD image the volume mapped.
    pub fn unstage(&self, req: &Unstage) -> Result<()> {
        let _guard = self.locks.try_lock(&req.volume_id)?;
        let watch = self.watch_unstage(&req.volume_id);
        self.unstage_held(req)?;
        drop(watch);
        // The filesystem is gone: then its encrypted volume's mapping.
        self.close_unstaged(&req.volume_id)?;
        self.forget_stage_failure(&req.volume_id);
        self.unmap_unstaged(&req.volume_id)
    }

    /// The unmount of [`unstage`](Self::unstage), with the volume's guard held.
    fn unstage_held(&self, req: &Unstage) -> Result<()> {
        let mut record = self.record(&req.volume_id);
        // Not staged at that path: the spec's answer is OK, and nothing is touched. A path
        // another volume holds is that volume's, whatever the CO names.
        let elsewhere = match &record.stage {
            Some(st) => st.path != req.staging,
            None => self.held_by_another(&req.volume_id, &req.staging),
        };
        if elsewhere {
            warn!(
                volume = req.volume_id,
                path = %req.staging.display(),
                "unstage of a path the volume is not staged at: nothing to do"
            );
            return Ok(());
        }
        // Refuse while a publication is really there; forget the ones that are gone.
        let mut still = Vec::new();
        for target in record.publishes.keys() {
            match self.os.mount_state(target)? {
                MountState::Mounted(_) | MountState::Corrupted { .. } => still.push(target.clone()),
                MountState::Absent | MountState::NotMounted { .. } => {}
            }
        }
        if !still.is_empty() {
            return Err(Error::FailedPrecondition(format!(
                "volume {:?} is still published at {}; unpublish it first",
                req.volume_id,
                still
                    .iter()
                    .map(|p| p.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        }
        if record.stage.is_none() {
            self.refuse_unstage_under_pods(req)?;
        }
        record.publishes.clear();
        if let Some(st) = record
            .stage
            .as_mut()
            .filter(|s| s.phase == Phase::Formatting)
        {
            // A mkfs moor began and did not finish (nothing is mounted: the mount comes after
            // the record that follows mkfs). The staging ends; the knowledge that the device
            // holds moor's partial mkfs stays, as durably as it was written, so the next stage
            // resumes it instead of refusing the unknown data for ever.
            if st.boot.as_deref() != Some(Boot::ENDED) {
                st.boot = Some(Boot::ENDED.to_string());
                self.journal.put(&record, Durability::Power)?;
                info!(
                    volume = req.volume_id,
                    path = %req.staging.display(),
                    "unstaged while moor's mkfs was unfinished: its intent is kept, and the \
                     next stage resumes it"
                );
            }
            return Ok(());
        }
        if let Some(st) = record.stage.as_mut() {
            st.phase = Phase::InProgress;
            self.journal.put(&record, Durability::Process)?;
        }
        crash_points::point("unstage.unmounting");
        let staged_dev = record.stage.as_ref().map(|s| s.rdev);
        let is_block = matches!(
            record.stage.as_ref().map(|s| &s.access),
            Some(AccessRecord::Block)
        );
        if !is_block {
            // A kernel mapping's filesystem writes back over the network and the kernel has
            // no way to abort it: its unmount answers by the unmap deadline, whatever the
            // cluster does. (rbd-fuse's is watched instead, and rbd-fuse killed when it stops
            // answering: `watch_unstage`, which needs the unmount waited for.)
            let deadline = record
                .mapping
                .as_ref()
                .filter(|m| m.attacher == crate::attach::kernel::KIND)
                .and(self.attacher.as_ref())
                .map(|a| a.deadlines().unmap);
            // Without a record the CO's word stands: its staging path for this volume.
            self.unmount_all_within(
                &req.staging,
                |mp| staged_dev.is_none_or(|d| mp.dev == d || mp.rdev.is_none()),
                deadline,
            )?;
        }
        crash_points::point("unstage.unmounted");
        record.stage = None;
        self.journal.put(&record, Durability::Process)?;
        crash_points::point("unstage.done");
        Ok(())
    }

    /// An unstage without a record (a journal lost, or kubelet's fallback for a global mount
    /// it found without its `vol_data.json`, KEP-6058) has no publications to refuse by: the
    /// mount table stands in for them. While the filesystem mounted at the staging path is
    /// also mounted under kubelet's pods dir (a pod's target), the unstage is refused as one
    /// with a record would be: a running pod may use it.
    fn refuse_unstage_under_pods(&self, req: &Unstage) -> Result<()> {
        let MountState::Mounted(mp) = self.os.mount_state(&req.staging)? else {
            return Ok(());
        };
        let pods = self.config().kubelet_dir.join("pods");
        let users: Vec<String> = self
            .os
            .mount_table()?
            .into_iter()
            .filter(|m| m.dev == mp.dev && m.mount_point.starts_with(&pods))
            .map(|m| m.mount_point.display().to_string())
            .collect();
        if users.is_empty() {
            return Ok(());
        }
        Err(Error::FailedPrecondition(format!(
            "{} holds a filesystem that is still mounted for a pod at {}; unpublish it first \
             (moor has no record of this staging: the mount table says so)",
            req.staging.display(),
            users.join(", ")
        )))
    }

    /// Grows the filesystem `content` found on `device` (of `device_size` bytes), mounted at
    /// `mount_point`, when its superblock gives it [`GROW_MIN`] or more less than the device:
    /// the spec has a volume made from a smaller snapshot or volume present its full size.
    /// Whether it grew it.
    fn grow_to_device(
        &self,
        content: &Content,
        (device, device_size): (&Path, u64),
        mount_point: &Path,
    ) -> Result<bool> {
        let Content::Filesystem {
            fs,
            size: Some(size),
            ..
        } = content
        else {
            return Ok(false);
        };
        if device_size < size.saturating_add(GROW_MIN) {
            return Ok(false);
        }
        crash_points::point("stage.growing");
        self.grow_fs(*fs, device, mount_point)?;
        Ok(true)
    }
}
