//! Volumes: create (empty, or a clone of a snapshot or of a volume), delete, expand, get.

use moor_rbd::{Ensured, ImageOptions, Pool, Shrink};
use tracing::info;

use super::ids::{CLONE_SOURCE_PREFIX, ClusterRef, Location, SnapshotId, VolumeId, random_suffix};
use super::keys::DEK_PENDING_METADATA_KEY;
use super::parameters::{self, DATA_POOL_KEY, IMAGE_NAME_KEY, features_of};
use super::reap::Disposal;
use super::records::{FORMAT_VERSION, Registry, SnapshotState, VolumeRecord, VolumeState};
use super::{POLICY, RbdBackend, Session};
use crate::backend::{
    self, ContentSource, ExpandRequest, NewVolume, Parameters, Qos, SizePolicy, Volume,
    VolumeCondition, VolumeStatus,
};
use crate::embedded::FS_TYPE_KEY;
use crate::error::{Error, Result, trunc};
use crate::inflight::Claim;
use moor_runtime::contract::ENCRYPTED_DEK_KEY;

/// The image metadata keys of [`Qos::limits`], in its order: librbd's per-image QoS options.
const QOS_OPTIONS: [&str; 4] = [
    "conf_rbd_qos_read_bps_limit",
    "conf_rbd_qos_write_bps_limit",
    "conf_rbd_qos_read_iops_limit",
    "conf_rbd_qos_write_iops_limit",
];

/// The in-flight key of a volume.
pub(super) fn volume_key(id: &VolumeId) -> String {
    format!("rbd-volume:{id}")
}

/// The in-flight key of a snapshot.
pub(super) fn snapshot_key(id: &SnapshotId) -> String {
    format!("rbd-snapshot:{id}")
}

/// A volume as the CO sees it.
pub(super) fn volume_of(id: &VolumeId, rec: &VolumeRecord) -> Volume {
    Volume {
        id: id.to_string(),
        name: rec.name.clone(),
        capacity_bytes: rec.capacity_bytes,
        parameters: rec.parameters.clone(),
        context: rec.context.clone(),
        source: rec.source.clone(),
        // An RBD image can be mapped from any node that reaches the cluster.
        topology: Vec::new(),
    }
}

/// The volume context: what the node needs besides the publish context.
fn context_of(params: &Parameters, loc: &Location, image: &str) -> Parameters {
    let mut ctx = Parameters::new();
    match &loc.cluster {
        ClusterRef::Id(id) => ctx.insert(parameters::CLUSTER_ID_KEY.into(), id.clone()),
        ClusterRef::Monitors(m) => ctx.insert(parameters::MONITORS_KEY.into(), m.clone()),
    };
    ctx.insert(parameters::POOL_KEY.into(), loc.pool.clone());
    ctx.insert(IMAGE_NAME_KEY.into(), image.to_string());
    if let Some(fs) = params.get(FS_TYPE_KEY) {
        ctx.insert(FS_TYPE_KEY.into(), fs.clone());
    }
    // An encrypted volume's: how the node opens it (its wrapped data key comes after).
    ctx.extend(crate::encryption::encryption_parameters(params));
    ctx
}

/// The image metadata key of an encrypted volume's wrapped data key (docs/encryption.md):
/// with the image, where it goes when the pool is mirrored, exported or backed up.
pub const DEK_METADATA_KEY: &str = "moor.csi.io/encryptedDEK";

/// Where a new volume's data comes from, resolved.
struct CloneSource {
    /// The parent image's pool.
    pool: Pool,
    /// The parent image.
    image: String,
    /// Its snapshot to clone (made by the clone, for a volume source).
    snapshot: String,
    /// Whether the snapshot is made here (a volume source).
    make_snapshot: bool,
    /// The size of the data.
    size: u64,
}

impl RbdBackend {
    /// Checks that a request for an existing volume of the same name asks for what it is.
    fn check_same_volume(
        &self,
        id: &VolumeId,
        existing: &VolumeRecord,
        req: &NewVolume,
        params: &Parameters,
    ) -> Result<()> {
        let differs = |reason: String| Error::VolumeExists {
            name: req.name.clone(),
            id: id.to_string(),
            reason,
        };
        if &existing.parameters != params {
            return Err(differs(format!(
                "parameters differ (it was created with {:?})",
                existing.parameters
            )));
        }
        if existing.source != req.source {
            return Err(differs("volume_content_source differs".into()));
        }
        if let Some(r) = &req.capacity
            && !r.allows(existing.capacity_bytes)
            && !r.allows(existing.created_bytes)
        {
            return Err(differs(format!(
                "it holds {} bytes, outside capacity_range (required {}, limit {})",
                existing.capacity_bytes, r.required, r.limit
            )));
        }
        Ok(())
    }

    /// Resolves a content source in the destination's cluster, claiming it shared.
    fn resolve_source<'a>(
        &'a self,
        s: &Session,
        dest: &Location,
        src: &ContentSource,
    ) -> Result<(Claim<'a>, CloneSource)> {
        match src {
            ContentSource::Snapshot(raw) => {
                let not_found = || Error::SourceNotFound {
                    kind: "snapshot",
                    id: trunc(raw).to_string(),
                };
                let sid = SnapshotId::parse(raw).ok_or_else(not_found)?;
                if sid.location.cluster != dest.cluster {
                    return Err(Error::invalid(
                        "volume_content_source",
                        format!("snapshot {sid} is in another cluster than the new volume"),
                    ));
                }
                let claim = self.inflight.claim(&[], &[&snapshot_key(&sid)])?;
                let pool = self
                    .open_pool(s, &sid.location.pool)?
                    .ok_or_else(not_found)?;
                let rec = Registry::new(&pool)
                    .snapshot(&sid.suffix)?
                    .filter(|r| r.state == SnapshotState::Ready)
                    .ok_or_else(not_found)?;
                Ok((
                    claim,
                    CloneSource {
                        pool,
                        image: rec.image_name(),
                        snapshot: sid.snap_name(),
                        make_snapshot: false,
                        size: rec.size_bytes,
                    },
                ))
            }
            ContentSource::Volume(raw) => {
                let not_found = || Error::SourceNotFound {
                    kind: "volume",
                    id: trunc(raw).to_string(),
                };
                let vid = VolumeId::parse(raw).ok_or_else(not_found)?;
                if vid.location.cluster != dest.cluster {
                    return Err(Error::invalid(
                        "volume_content_source",
                        format!("volume {vid} is in another cluster than the new volume"),
                    ));
                }
                let claim = self.inflight.claim(&[], &[&volume_key(&vid)])?;
                let pool = self
                    .open_pool(s, &vid.location.pool)?
                    .ok_or_else(not_found)?;
                let rec = Registry::new(&pool)
                    .volume(&vid.suffix)?
                    .filter(|r| r.state == VolumeState::Ready)
                    .ok_or_else(not_found)?;
                Ok((
                    claim,
                    CloneSource {
                        pool,
                        image: vid.image(),
                        // Named for the clone: set when the clone's suffix is known.
                        snapshot: String::new(),
                        make_snapshot: true,
                        size: rec.capacity_bytes,
                    },
                ))
            }
        }
    }

    /// Clones `src` as `image` in `pool` (idempotent: a clone of the same parent that is
    /// already there is taken), then grows it to `size`.
    fn clone_into(
        &self,
        s: &Session,
        src: &CloneSource,
        pool: &Pool,
        image: &str,
        params: &Parameters,
        size: u64,
    ) -> Result<()> {
        let fail = |what: String, e| self.fail(s, what, e);
        if src.make_snapshot {
            let parent = src
                .pool
                .open_image(&src.image)
                .map_err(|e| fail(format!("open {}", src.image), e))?;
            match parent.create_snapshot(&src.snapshot) {
                Ok(()) | Err(moor_rbd::Error::AlreadyExists { .. }) => {}
                Err(e) => return Err(fail(format!("snapshot {}", src.image), e)),
            }
        }
        let parent_at = || {
            src.pool
                .open_image(&src.image)
                .map_err(|e| fail(format!("open {}", src.image), e))
        };
        {
            let parent = parent_at()?;
            // Clone format 1 clones protected snapshots only.
            if !parent
                .is_snapshot_protected(&src.snapshot)
                .map_err(|e| fail(format!("snapshot {}@{}", src.image, src.snapshot), e))?
            {
                parent
                    .protect_snapshot(&src.snapshot)
                    .map_err(|e| fail(format!("protect {}@{}", src.image, src.snapshot), e))?;
            }
        }
        match src
            .pool
            .clone_image(&src.image, &src.snapshot, pool, image, features_of(params))
        {
            Ok(()) => {}
            Err(moor_rbd::Error::AlreadyExists { .. }) => {
                // A retry of a create that was interrupted: the clone must be of this parent.
                let child = pool
                    .open_image_read_only(image)
                    .map_err(|e| fail(format!("open {image}"), e))?;
                let parent = child
                    .parent()
                    .map_err(|e| fail(format!("parent of {image}"), e))?;
                if !parent.is_some_and(|p| p.image.image == src.image && p.snapshot == src.snapshot)
                {
                    return Err(Error::Internal(format!(
                        "image {}/{image} exists and is not a clone of {}@{}",
                        pool.name(),
                        src.image,
                        src.snapshot
                    )));
                }
            }
            Err(e) => return Err(fail(format!("clone {}@{}", src.image, src.snapshot), e)),
        }
        let child = pool
            .open_image(image)
            .map_err(|e| fail(format!("open {image}"), e))?;
        let now = child
            .size()
            .map_err(|e| fail(format!("size of {image}"), e))?;
        if now < size {
            child
                .resize(size, Shrink::Refuse)
                .map_err(|e| fail(format!("grow {image}"), e))?;
        }
        Ok(())
    }

    pub(super) fn create_volume_impl(&self, req: &NewVolume) -> Result<Volume> {
        let (encryption, params) = crate::encryption::parse_with(&req.parameters, |rest| {
            parameters::parse_parameters(rest, self.clusters())
        })?;
        // A key split with a node's TPM opens on that node only; an RBD volume moves between
        // nodes.
        if let Some(e) = &encryption
            && e.kms_id == moor_runtime::keys::source::KMS_TPM2
        {
            return Err(Error::invalid(
                "parameters",
                format!(
                    "{}={:?}: a key split with a node's TPM opens the volume on that node only, \
                     and an RBD volume moves between nodes; use \"secret\" or \"kmip\"",
                    crate::encryption::KMS_ID_KEY,
                    e.kms_id
                ),
            ));
        }
        for cap in &req.capabilities {
            parameters::check_capability(cap, &params)
                .map_err(|r| Error::invalid("volume_capabilities", r))?;
        }
        let loc = parameters::require_location(&params)?;
        let name_key = format!("rbd-volume-name:{}", req.name);
        let _claim = self.inflight.claim(&[&name_key], &[])?;
        let s = self.session(&loc.cluster)?;
        let pool = self.open_pool(&s, &loc.pool)?.ok_or_else(|| {
            Error::invalid(
                "parameters",
                format!("pool {:?} does not exist in {}", loc.pool, loc.cluster),
            )
        })?;
        let reg = Registry::new(&pool);

        // The volume of this name, if one was made (or begun) before.
        let mut resumed = None;
        if let Some(suffix) = reg.volume_named(&req.name)? {
            let id = VolumeId {
                location: loc.clone(),
                suffix: suffix.clone(),
            };
            match reg.volume(&suffix)? {
                Some(rec) if rec.state == VolumeState::Ready => {
                    self.check_same_volume(&id, &rec, req, &params)?;
                    return Ok(volume_of(&id, &rec));
                }
                Some(rec) if rec.state == VolumeState::Creating => {
                    self.check_same_volume(&id, &rec, req, &params)?;
                    resumed = Some((suffix, Some(rec)));
                }
                // An older volume of this name on its way out: the name is free again.
                Some(_) => reg.unname_volume(&req.name, &suffix)?,
                // Named, and stopped before its record was written.
                None => resumed = Some((suffix, None)),
            }
        }
        // The source and the size are settled before anything is written: a request that
        // fails here leaves nothing behind.
        let (_source_claim, mut source) = match &req.source {
            Some(src) => {
                let (c, s_) = self.resolve_source(&s, &loc, src)?;
                (Some(c), Some(s_))
            }
            None => (None, None),
        };
        let size = match &resumed {
            Some((_, Some(rec))) => rec.created_bytes,
            _ => {
                let floor = source.as_ref().map_or(0, |s| s.size);
                backend::choose_size(req.capacity.as_ref(), &POLICY, floor)?
            }
        };
        let (suffix, rec) = match resumed {
            Some(r) => r,
            None => {
                let suffix = random_suffix()?;
                reg.name_volume(&req.name, &suffix)?;
                (suffix, None)
            }
        };
        let id = VolumeId {
            location: loc.clone(),
            suffix: suffix.clone(),
        };
        let image = id.image();
        if let Some(src) = source.as_mut()
            && src.make_snapshot
        {
            src.snapshot = format!("{CLONE_SOURCE_PREFIX}{suffix}");
        }
        let mut rec = match rec {
            Some(rec) => rec,
            None => {
                let rec = VolumeRecord {
                    version: FORMAT_VERSION,
                    name: req.name.clone(),
                    state: VolumeState::Creating,
                    parameters: params.clone(),
                    context: context_of(&params, &loc, &image),
                    source: req.source.clone(),
                    created_bytes: size,
                    capacity_bytes: size,
                    publications: Vec::new(),
                    fencings: Vec::new(),
                    qos: crate::backend::Qos::default(),
                };
                reg.put_volume(&suffix, &rec)?;
                rec
            }
        };
        match &source {
            None => {
                let mut opts = ImageOptions::new(size).features(features_of(&params));
                if let Some(dp) = params.get(DATA_POOL_KEY) {
                    opts = opts.data_pool(dp.clone());
                }
                match pool.ensure_image(&image, &opts) {
                    Ok(Ensured::Created | Ensured::Existed) => {}
                    Err(e) => return Err(self.fail(&s, format!("create image {image}"), e)),
                }
            }
            Some(src) => self.clone_into(&s, src, &pool, &image, &params, size)?,
        }
        rec.state = VolumeState::Ready;
        reg.put_volume(&suffix, &rec)?;
        info!(volume = %id, name = %req.name, size, "created");
        Ok(volume_of(&id, &rec))
    }

    /// Keeps an encrypted volume's wrapped data key: in its image's metadata
    /// ([`DEK_METADATA_KEY`]) first, then in its record and volume context; once (a volume
    /// whose record has one keeps it). A clone's metadata, copied from its parent's, is
    /// overwritten, and its parent's pending key (a rotation's, `super::keys`) removed.
    pub(super) fn record_wrapped_dek_impl(&self, raw: &str, wrapped: &str) -> Result<Volume> {
        let not_found = || Error::VolumeNotFound(trunc(raw).to_string());
        let id = VolumeId::parse(raw).ok_or_else(not_found)?;
        let _claim = self.inflight.claim(&[&volume_key(&id)], &[])?;
        let (id, s, pool, mut rec) = self.ready_volume(&id.to_string())?;
        if !rec.context.contains_key(ENCRYPTED_DEK_KEY) {
            let image_name = id.image();
            let image = pool
                .open_image(&image_name)
                .map_err(|e| self.fail(&s, format!("open {image_name}"), e))?;
            image
                .set_metadata(DEK_METADATA_KEY, Some(wrapped))
                .map_err(|e| self.fail(&s, format!("set {DEK_METADATA_KEY} of {image_name}"), e))?;
            // A clone's metadata is its parent's: a pending key there is the parent's.
            image
                .set_metadata(DEK_PENDING_METADATA_KEY, None)
                .map_err(|e| {
                    self.fail(
                        &s,
                        format!("remove {DEK_PENDING_METADATA_KEY} of {image_name}"),
                        e,
                    )
                })?;
            rec.context
                .insert(ENCRYPTED_DEK_KEY.to_owned(), wrapped.to_owned());
            Registry::new(&pool).put_volume(&id.suffix, &rec)?;
            info!(volume = %id, "its wrapped data key recorded");
        }
        Ok(volume_of(&id, &rec))
    }

    pub(super) fn delete_volume_impl(&self, raw: &str) -> Result<()> {
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
            // No record: what is left of a delete that removed it (the image goes first, so
            // normally nothing).
            if let Disposal::Removed(parent) = self.dispose_image(&s, &pool, &id.image())? {
                self.reap_parent(&s, parent);
            }
            return Ok(());
        };
        if rec.state == VolumeState::Retained {
            // Deleted before; its image waits for its snapshots and clones. Remove it if they
            // went meanwhile and nothing removed it then.
            return self.reap_volume(&s, &pool, &id.suffix);
        }
        if let Some(p) = rec.publications.first() {
            return Err(Error::VolumeInUse {
                volume: id.to_string(),
                reason: format!(
                    "it is published at node {:?}; ControllerUnpublishVolume it first",
                    p.node_id
                ),
            });
        }
        if rec.state != VolumeState::Deleting {
            rec.state = VolumeState::Deleting;
            reg.put_volume(&id.suffix, &rec)?;
        }
        reg.unname_volume(&rec.name, &id.suffix)?;
        match self.dispose_image(&s, &pool, &id.image())? {
            Disposal::Removed(parent) => {
                reg.remove_volume(&id.suffix)?;
                info!(volume = %id, "deleted");
                self.reap_parent(&s, parent);
            }
            Disposal::Retained(why) => {
                rec.state = VolumeState::Retained;
                reg.put_volume(&id.suffix, &rec)?;
                info!(volume = %id, why, "deleted; image kept for its snapshots and clones");
            }
        }
        Ok(())
    }

    /// The volume of `raw` and its record, ready; NOT_FOUND otherwise.
    pub(super) fn ready_volume(
        &self,
        raw: &str,
    ) -> Result<(VolumeId, Session, Pool, VolumeRecord)> {
        let not_found = || Error::VolumeNotFound(trunc(raw).to_string());
        let id = VolumeId::parse(raw).ok_or_else(not_found)?;
        let s = self.session(&id.location.cluster)?;
        let pool = self
            .open_pool(&s, &id.location.pool)?
            .ok_or_else(not_found)?;
        let rec = Registry::new(&pool)
            .volume(&id.suffix)?
            .filter(|r| r.state == VolumeState::Ready)
            .ok_or_else(not_found)?;
        Ok((id, s, pool, rec))
    }

    /// ControllerModifyVolume: the QoS limits as the image's own librbd settings (image
    /// metadata `conf_rbd_qos_*`), which every librbd client that opens the image after
    /// honours (the rbd-fuse attacher; a mapping made before takes them at its next map). The
    /// kernel client ignores them.
    pub(super) fn modify_impl(&self, raw: &str, qos: &Qos) -> Result<()> {
        let not_found = || Error::VolumeNotFound(trunc(raw).to_string());
        let id = VolumeId::parse(raw).ok_or_else(not_found)?;
        let _claim = self.inflight.claim(&[&volume_key(&id)], &[])?;
        let (id, s, pool, mut rec) = self.ready_volume(&id.to_string())?;
        let image_name = id.image();
        let image = pool
            .open_image(&image_name)
            .map_err(|e| self.fail(&s, format!("open {image_name}"), e))?;
        for ((_, limit), option) in qos.limits().into_iter().zip(QOS_OPTIONS) {
            let value = limit.map(|n| n.to_string());
            image
                .set_metadata(option, value.as_deref())
                .map_err(|e| self.fail(&s, format!("set {option} of {image_name}"), e))?;
        }
        // For the node, whose kernel client ignores librbd's settings: its next publish.
        if rec.qos != *qos {
            rec.qos = *qos;
            Registry::new(&pool).put_volume(&id.suffix, &rec)?;
        }
        Ok(())
    }

    pub(super) fn expand_impl(&self, req: &ExpandRequest) -> Result<u64> {
        let not_found = || Error::VolumeNotFound(trunc(&req.volume_id).to_string());
        let id = VolumeId::parse(&req.volume_id).ok_or_else(not_found)?;
        let _claim = self.inflight.claim(&[&volume_key(&id)], &[])?;
        let (id, s, pool, mut rec) = self.ready_volume(&id.to_string())?;
        if let Some(cap) = &req.capability {
            parameters::check_capability(cap, &rec.parameters)
                .map_err(|r| Error::invalid("volume_capability", r))?;
        }
        let r = req.capacity;
        if r.limit > 0 && r.required > r.limit {
            return Err(Error::OutOfRange(format!(
                "required_bytes {} is larger than limit_bytes {}",
                r.required, r.limit
            )));
        }
        let image_name = id.image();
        // Opened for writing: librbd hands the resize to the client holding the image's lock
        // (the node that maps it), so an image in use grows in place.
        let image = pool
            .open_image(&image_name)
            .map_err(|e| self.fail(&s, format!("open {image_name}"), e))?;
        let current = image
            .size()
            .map_err(|e| self.fail(&s, format!("size of {image_name}"), e))?;
        let size = if r.required <= current {
            if r.limit > 0 && current > r.limit {
                return Err(Error::OutOfRange(format!(
                    "the volume holds {current} bytes, more than limit_bytes {}; volumes never \
                     shrink",
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
            image.resize(size, Shrink::Refuse).map_err(|e| {
                // The lock is held by a node that mapped the image with exclusiveLock, and
                // never hands it over: such a volume grows while it is not mapped.
                if e.errno() == Some(libc::EROFS)
                    && rec.parameters.contains_key(parameters::EXCLUSIVE_LOCK_KEY)
                {
                    Error::FailedPrecondition(format!(
                        "volume {id} cannot grow while a node maps it: its StorageClass sets \
                         {}=true, so the node holds the image's lock; it grows once its pods \
                         stop (offline expansion)",
                        parameters::EXCLUSIVE_LOCK_KEY
                    ))
                } else {
                    self.fail(&s, format!("grow {image_name}"), e)
                }
            })?;
            size
        };
        drop(image);
        if rec.capacity_bytes != size {
            let from = rec.capacity_bytes;
            rec.capacity_bytes = size;
            Registry::new(&pool).put_volume(&id.suffix, &rec)?;
            info!(volume = %id, from, to = size, "expanded");
        }
        Ok(size)
    }

    /// A volume's condition: its image is there.
    pub(super) fn condition(&self, s: &Session, pool: &Pool, id: &VolumeId) -> VolumeCondition {
        match pool.open_image_read_only(&id.image()) {
            Ok(_) => VolumeCondition {
                abnormal: false,
                message: "volume is healthy".into(),
            },
            Err(moor_rbd::Error::NotFound { .. }) => VolumeCondition {
                abnormal: true,
                message: format!("image {}/{} is missing", pool.name(), id.image()),
            },
            Err(e) => VolumeCondition {
                abnormal: true,
                message: self.fail(s, "open image", e).to_string(),
            },
        }
    }

    pub(super) fn get_volume_impl(&self, raw: &str) -> Result<VolumeStatus> {
        let (id, s, pool, rec) = self.ready_volume(raw)?;
        Ok(VolumeStatus {
            volume: volume_of(&id, &rec),
            published_nodes: rec.publications.iter().map(|p| p.node_id.clone()).collect(),
            condition: self.condition(&s, &pool, &id),
        })
    }
}
