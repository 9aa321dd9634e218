//! Snapshot metadata of the RBD backend, from librbd's diff iteration (`rbd_diff_iterate2`) on
//! the image opened at the snapshot: its extents that hold data (allocated, the parent's
//! included for a clone), or that changed since an older snapshot of the same image (delta).
//! Extents are widened to whole 4 KiB blocks. librbd reports an object created since the base
//! from its start, so the delta reads the changed extents in both snapshots and names only the
//! blocks that differ: exactly the blocks written (or discarded) between the two. A member of a
//! group snapshot cut while its volumes were in use is a snapshot of a copy of its volume (see
//! `groups.rs`): between it and another snapshot of the same volume, librbd has no diff, so
//! the extents that hold data in either are read in both and compared block by block.

use std::ops::ControlFlow;

use super::RbdBackend;
use super::ids::SnapshotId;
use super::records::SnapshotRecord;
use crate::backend::{BlockRanges, MetadataSink};
use crate::error::{Error, Result};

/// The block size of every range reported.
pub const BLOCK: u64 = 4096;

fn floor(n: u64) -> u64 {
    n / BLOCK * BLOCK
}

fn ceil(n: u64) -> u64 {
    n.div_ceil(BLOCK).saturating_mul(BLOCK)
}

/// How much of each snapshot is read at a time when comparing.
const CHUNK: u64 = 1 << 20;

impl RbdBackend {
    /// Walks the snapshot `target` (its record `rec`) from `start`: the extents that hold data
    /// (allocated, `base` None), or the blocks that differ from `base` (delta: librbd's
    /// changed extents, which for an object new since `base` span the whole object up to the
    /// write, are read in both snapshots and compared block by block).
    fn walk(
        &self,
        target: &SnapshotId,
        rec: &SnapshotRecord,
        base: Option<(&SnapshotId, &SnapshotRecord)>,
        start: u64,
        sink: &mut dyn MetadataSink,
    ) -> Result<()> {
        let not_found = || Error::SnapshotNotFound(target.to_string());
        sink.begin(rec.size_bytes, BLOCK)?;
        let s = self.session(&target.location.cluster)?;
        let pool = self
            .open_pool(&s, &target.location.pool)?
            .ok_or_else(not_found)?;
        let open = |sid: &SnapshotId, image_id: &str| match pool
            .open_snapshot_by_id(image_id, &sid.snap_name())
        {
            Ok(i) => Ok(i),
            Err(moor_rbd::Error::NotFound { .. }) => Err(Error::SnapshotNotFound(sid.to_string())),
            Err(e) => Err(self.fail(&s, format!("open {image_id}@{}", sid.snap_name()), e)),
        };
        let image = open(target, &rec.image_id)?;
        let from = floor(start);
        let len = rec.size_bytes.saturating_sub(from);
        let mut extents: Vec<(u64, u64)> = Vec::new();
        // The extents changed since `since` (or holding data, None) of `image`.
        let mut walk = |image: &moor_rbd::Image, since: Option<String>| {
            image
                .diff(
                    since.as_deref(),
                    from,
                    len,
                    &mut |offset, length, exists| {
                        if since.is_some() || exists {
                            extents.push((floor(offset), ceil(offset + length)));
                        }
                        ControlFlow::Continue(())
                    },
                )
                .map_err(|e| self.fail(&s, format!("diff {}", image.spec()), e))
        };
        let older = match base {
            None => None,
            Some((bid, brec)) if brec.image_id == rec.image_id => {
                walk(&image, Some(bid.snap_name()))?;
                Some(open(bid, &rec.image_id)?)
            }
            Some((bid, brec)) => {
                // Two images (a copy's snapshot and another of the same volume): whatever
                // holds data in either may differ.
                let older = open(bid, &brec.image_id)?;
                walk(&image, None)?;
                walk(&older, None)?;
                Some(older)
            }
        };
        if base.is_none() {
            walk(&image, None)?;
        }
        extents.sort_unstable();
        let extents = extents
            .into_iter()
            .fold(Vec::<(u64, u64)>::new(), |mut m, (s, e)| {
                match m.last_mut() {
                    Some((_, last)) if s <= *last => *last = (*last).max(e),
                    _ => m.push((s, e)),
                }
                m
            });
        let mut out = BlockRanges::new(sink);
        let Some(older) = older else {
            for (s, e) in extents {
                out.push(s, e)?;
            }
            return out.finish();
        };
        let read = |image: &moor_rbd::Image, at: u64, len: u64| {
            let mut data = image
                .read(at, usize::try_from(len).unwrap_or(usize::MAX))
                .map_err(|e| self.fail(&s, format!("read {}", rec.image_id), e))?;
            // Past the end of a smaller, older snapshot: zeroes.
            data.resize(usize::try_from(len).unwrap_or(usize::MAX), 0);
            Ok::<_, Error>(data)
        };
        for (s, e) in extents {
            let mut at = s;
            while at < e {
                let n = (e - at).min(CHUNK);
                let (new, old) = (read(&image, at, n)?, read(&older, at, n)?);
                for (i, (x, y)) in new
                    .chunks(BLOCK as usize)
                    .zip(old.chunks(BLOCK as usize))
                    .enumerate()
                {
                    if x != y {
                        let b = at + i as u64 * BLOCK;
                        out.push(b, b + BLOCK)?;
                    }
                }
                at += n;
            }
        }
        out.finish()
    }

    pub(super) fn allocated_impl(
        &self,
        raw: &str,
        start: u64,
        sink: &mut dyn MetadataSink,
    ) -> Result<()> {
        let (sid, _, rec) = self.ready_snapshot(raw)?;
        self.walk(&sid, &rec, None, start, sink)
    }

    pub(super) fn delta_impl(
        &self,
        base: &str,
        target: &str,
        start: u64,
        sink: &mut dyn MetadataSink,
    ) -> Result<()> {
        let (bid, s, brec) = self.ready_snapshot(base)?;
        let (tid, _, trec) = self.ready_snapshot(target)?;
        if bid.location != tid.location || brec.volume_suffix != trec.volume_suffix {
            return Err(Error::invalid(
                "target_snapshot_id",
                format!(
                    "snapshot {tid} is of volume {}, the base snapshot {bid} of volume {}",
                    trec.source_volume_id, brec.source_volume_id
                ),
            ));
        }
        if brec.image_id != trec.image_id {
            // One of them of a copy of the volume: the older is the one cut first.
            if brec.created_at() > trec.created_at() {
                return Err(Error::invalid(
                    "base_snapshot_id",
                    format!("snapshot {bid} was cut after {tid}: the base must be the older one"),
                ));
            }
            return self.walk(&tid, &trec, Some((&bid, &brec)), start, sink);
        }
        // librbd diffs from an older snapshot only.
        let pool = self
            .open_pool(&s, &tid.location.pool)?
            .ok_or_else(|| Error::SnapshotNotFound(tid.to_string()))?;
        let snaps = pool
            .open_snapshot_by_id(&trec.image_id, &tid.snap_name())
            .and_then(|i| i.snapshots())
            .map_err(|e| self.fail(&s, format!("snapshots of {}", trec.image_id), e))?;
        let id_of = |name: String| snaps.iter().find(|x| x.name == name).map(|x| x.id);
        if let (Some(b), Some(t)) = (id_of(bid.snap_name()), id_of(tid.snap_name()))
            && b > t
        {
            return Err(Error::invalid(
                "base_snapshot_id",
                format!("snapshot {bid} was cut after {tid}: the base must be the older one"),
            ));
        }
        self.walk(&tid, &trec, Some((&bid, &brec)), start, sink)
    }
}
