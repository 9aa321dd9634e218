//! Images and snapshots kept after the CO deleted them, removed when nothing depends on them.
//!
//! With clone format 1 a clone needs its parent snapshot, protected, and the parent image by
//! name: neither can go while clones exist, and an image in the trash can no longer be cloned
//! from by name. So a volume deleted while it has snapshots or clones is *retained*: hidden
//! from the CO (its record says `retained`, its name is free again), its image kept; a CSI
//! snapshot deleted while volumes were cloned from it likewise. Deleting the last clone (or
//! the last snapshot) walks up the chain and removes what was only kept for it. Nothing here
//! ever fails a delete the CO asked for: what cannot be removed yet stays, and is tried again
//! on the next delete that concerns it.

use moor_rbd::{Parent, Pool};
use tracing::{info, warn};

use super::ids::{CLONE_SOURCE_PREFIX, COPY_IMAGE_PREFIX, SNAPSHOT_PREFIX, VOLUME_IMAGE_PREFIX};
use super::records::{Registry, SnapshotState, VolumeState};
use super::{RbdBackend, Session};
use crate::error::{Error, Result};

/// What became of an image.
#[derive(Debug)]
pub(super) enum Disposal {
    /// It is gone (or was never there); its parent, if it was a clone.
    Removed(Option<Parent>),
    /// It stays, for the reason given.
    Retained(String),
}

impl RbdBackend {
    /// Whether a snapshot of `image` is only kept for clones, and has none left: a volume's
    /// clone source, or a CSI snapshot the CO deleted. Snapshots that are not moor's are
    /// never touched.
    fn reapable(&self, s: &Session, pool: &Pool, image: &str, snap: &str) -> Result<bool> {
        let reg = Registry::new(pool);
        if let Some(suffix) = snap.strip_prefix(SNAPSHOT_PREFIX) {
            let live = reg
                .snapshot(suffix)?
                .is_some_and(|r| r.state != SnapshotState::Retained);
            if live {
                return Ok(false);
            }
        } else if !snap.starts_with(CLONE_SOURCE_PREFIX) {
            return Ok(false);
        }
        let children = pool
            .open_snapshot(image, snap)
            .and_then(|at| at.children())
            .map_err(|e| self.fail(s, format!("clones of {image}@{snap}"), e))?;
        Ok(children.is_empty())
    }

    /// Unprotects and removes a snapshot (and its record, for a CSI snapshot).
    fn remove_snapshot(&self, s: &Session, pool: &Pool, image: &str, snap: &str) -> Result<()> {
        let open = match pool.open_image(image) {
            Ok(i) => i,
            Err(moor_rbd::Error::NotFound { .. }) => return Ok(()),
            Err(e) => return Err(self.fail(s, format!("open {image}"), e)),
        };
        let fail = |what: &str, e| self.fail(s, format!("{what} {image}@{snap}"), e);
        match open.is_snapshot_protected(snap) {
            Ok(true) => open
                .unprotect_snapshot(snap)
                .map_err(|e| fail("unprotect", e))?,
            Ok(false) => {}
            Err(moor_rbd::Error::NotFound { .. }) => return Ok(()),
            Err(e) => return Err(fail("snapshot", e)),
        }
        match open.remove_snapshot(snap) {
            Ok(()) | Err(moor_rbd::Error::NotFound { .. }) => {}
            Err(e) => return Err(fail("remove", e)),
        }
        if let Some(suffix) = snap.strip_prefix(SNAPSHOT_PREFIX) {
            Registry::new(pool).remove_snapshot(suffix)?;
        }
        info!(pool = pool.name(), image, snap, "snapshot removed");
        Ok(())
    }

    /// Removes an image unless snapshots that something still needs keep it (those kept only
    /// for clones that are gone are removed first). An image open elsewhere is in use.
    pub(super) fn dispose_image(&self, s: &Session, pool: &Pool, image: &str) -> Result<Disposal> {
        let fail = |what: &str, e| self.fail(s, format!("{what} {}/{image}", pool.name()), e);
        let (parent, snaps) = match pool.open_image_read_only(image) {
            Ok(open) => (
                open.parent().map_err(|e| fail("parent of", e))?,
                open.snapshots().map_err(|e| fail("snapshots of", e))?,
            ),
            Err(moor_rbd::Error::NotFound { .. }) => return Ok(Disposal::Removed(None)),
            Err(e) => return Err(fail("open", e)),
        };
        let mut kept = Vec::new();
        for snap in snaps {
            if self.reapable(s, pool, image, &snap.name)? {
                self.remove_snapshot(s, pool, image, &snap.name)?;
            } else {
                kept.push(snap.name);
            }
        }
        if !kept.is_empty() {
            return Ok(Disposal::Retained(format!("snapshots {}", kept.join(", "))));
        }
        match pool.remove_image(image) {
            Ok(()) | Err(moor_rbd::Error::NotFound { .. }) => Ok(Disposal::Removed(parent)),
            Err(moor_rbd::Error::Busy { watchers, .. }) => Err(Error::VolumeInUse {
                volume: format!("{}/{image}", pool.name()),
                reason: format!(
                    "the image is open by {}; unmap it first",
                    if watchers.is_empty() {
                        "another client".to_string()
                    } else {
                        watchers.join(", ")
                    }
                ),
            }),
            // Snapshots appeared meanwhile.
            Err(moor_rbd::Error::HasSnapshots { .. } | moor_rbd::Error::HasClones { .. }) => {
                Ok(Disposal::Retained("snapshots appeared".into()))
            }
            Err(e) => Err(fail("remove", e)),
        }
    }

    /// Removes a retained volume whose image nothing needs any more, then walks up.
    pub(super) fn reap_volume(&self, s: &Session, pool: &Pool, suffix: &str) -> Result<()> {
        let reg = Registry::new(pool);
        let retained = reg
            .volume(suffix)?
            .is_some_and(|r| r.state == VolumeState::Retained);
        if !retained {
            return Ok(());
        }
        let image = format!("{VOLUME_IMAGE_PREFIX}{suffix}");
        if let Disposal::Removed(parent) = self.dispose_image(s, pool, &image)? {
            reg.remove_volume(suffix)?;
            info!(pool = pool.name(), image, "retained volume removed");
            self.reap_parent(s, parent);
        }
        Ok(())
    }

    /// After a clone went: removes its parent snapshot if it was only kept for clones, and
    /// the parent image if it was only kept for that snapshot, up the chain. Failures are
    /// logged: the delete that got here has succeeded.
    pub(super) fn reap_parent(&self, s: &Session, parent: Option<Parent>) {
        let mut next = parent;
        while let Some(p) = next.take() {
            match self.reap_step(s, &p) {
                Ok(up) => next = up,
                Err(e) => {
                    warn!(
                        image = %format!("{}/{}", p.image.pool, p.image.image),
                        snapshot = p.snapshot,
                        error = %e,
                        "cannot remove what was kept for a clone yet; the next delete tries again"
                    );
                }
            }
        }
    }

    fn reap_step(&self, s: &Session, p: &Parent) -> Result<Option<Parent>> {
        if p.image.in_trash || !p.image.namespace.is_empty() {
            return Ok(None);
        }
        let Some(pool) = self.open_pool(s, &p.image.pool)? else {
            return Ok(None);
        };
        let image = &p.image.image;
        if !self.reapable(s, &pool, image, &p.snapshot)? {
            return Ok(None);
        }
        self.remove_snapshot(s, &pool, image, &p.snapshot)?;
        if image.starts_with(COPY_IMAGE_PREFIX) {
            // A group member's copy of its volume, kept for that snapshot alone.
            self.dispose_image(s, &pool, image)?;
            return Ok(None);
        }
        let Some(suffix) = image.strip_prefix(VOLUME_IMAGE_PREFIX) else {
            return Ok(None);
        };
        let reg = Registry::new(&pool);
        if !reg
            .volume(suffix)?
            .is_some_and(|r| r.state == VolumeState::Retained)
        {
            return Ok(None);
        }
        match self.dispose_image(s, &pool, image)? {
            Disposal::Removed(up) => {
                reg.remove_volume(suffix)?;
                info!(pool = pool.name(), image, "retained volume removed");
                Ok(up)
            }
            Disposal::Retained(_) => Ok(None),
        }
    }
}
