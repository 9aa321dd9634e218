//! An open image: size, resize, snapshots, clones' parent and children, flatten, and the
//! exclusive lock.

use crate::error::{Errno, Error, Result};
use crate::features::Features;
use crate::info::{ImageInfo, LinkedImage, LockMode, LockOwners, Parent, SnapInfo, Watcher};
use crate::pool::{Pool, image_name};
use crate::sys::{Failure, RbdImage};

/// An open image; closed when dropped (or by [`Image::close`], which reports a failure).
#[derive(Debug)]
pub struct Image {
    pub(crate) raw: RbdImage,
    pool: Pool,
    name: String,
    snapshot: Option<String>,
}

/// Whether [`Image::resize`] may make the image smaller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shrink {
    /// Refuse with [`Error::WouldShrink`] (data past the new end would be lost).
    Refuse,
    /// Allow it.
    Allow,
}

impl Image {
    pub(crate) fn new(raw: RbdImage, pool: Pool, name: String, snapshot: Option<String>) -> Image {
        Image {
            raw,
            pool,
            name,
            snapshot,
        }
    }

    /// The same image, now open at snapshot `snapshot` (the raw handle was set to it).
    pub(crate) fn at(self, snapshot: String) -> Image {
        Image {
            snapshot: Some(snapshot),
            ..self
        }
    }

    /// The image's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The snapshot it is open at, if any.
    pub fn snapshot(&self) -> Option<&str> {
        self.snapshot.as_deref()
    }

    /// "pool/name" or "pool/name@snapshot".
    pub fn spec(&self) -> String {
        match &self.snapshot {
            Some(s) => format!("{}/{}@{s}", self.pool.name(), self.name),
            None => format!("{}/{}", self.pool.name(), self.name),
        }
    }

    fn err(&self, f: Failure) -> Error {
        Error::from_failure(f, format!("image {}", self.spec()))
    }

    fn snap_err(&self, f: Failure, snapshot: &str) -> Error {
        Error::from_failure(
            f,
            format!("snapshot {}/{}@{snapshot}", self.pool.name(), self.name),
        )
    }

    /// Size, object size and count.
    pub fn info(&self) -> Result<ImageInfo> {
        self.raw.stat().map_err(|f| self.err(f))
    }

    /// Size in bytes.
    pub fn size(&self) -> Result<u64> {
        Ok(self.info()?.size)
    }

    /// The image's features.
    pub fn features(&self) -> Result<Features> {
        self.raw
            .features()
            .map(Features::from_bits)
            .map_err(|f| self.err(f))
    }

    /// The image's id.
    pub fn id(&self) -> Result<String> {
        self.raw.id().map_err(|f| self.err(f))
    }

    /// The image's metadata value of `key`; None when it is not set.
    pub fn metadata(&self, key: &str) -> Result<Option<String>> {
        let c_key = crate::metadata::c_text("image metadata key", key)?;
        self.raw.metadata_get(&c_key).map_err(|f| self.err(f))
    }

    /// Sets the image's metadata `key` to `value`, or removes it (None). librbd takes a
    /// `conf_<option>` key as the image's own setting of that option for every client that
    /// opens it after (librbd, rbd-fuse, rbd-nbd; not the kernel client).
    pub fn set_metadata(&self, key: &str, value: Option<&str>) -> Result<()> {
        let c_key = crate::metadata::c_text("image metadata key", key)?;
        match value {
            Some(v) => {
                let c_value = crate::metadata::c_text("image metadata value", v)?;
                self.raw.metadata_set(&c_key, &c_value)
            }
            None => self.raw.metadata_remove(&c_key),
        }
        .map_err(|f| self.err(f))
    }

    /// Resizes to `size` bytes; growing is always allowed, shrinking only with
    /// [`Shrink::Allow`].
    pub fn resize(&self, size: u64, shrink: Shrink) -> Result<()> {
        let current = self.size()?;
        if size < current && shrink == Shrink::Refuse {
            return Err(Error::WouldShrink {
                image: self.spec(),
                current,
                requested: size,
            });
        }
        self.raw
            .resize(size, shrink == Shrink::Allow)
            .map_err(|f| self.err(f))
    }

    /// Copies the parent's data into this clone and detaches it from the parent.
    pub fn flatten(&self) -> Result<()> {
        self.raw.flatten().map_err(|f| self.err(f))
    }

    /// The parent this image was cloned from; None for an image that is not a clone (or no
    /// longer one, after a flatten).
    pub fn parent(&self) -> Result<Option<Parent>> {
        self.raw.parent().map_err(|f| self.err(f))
    }

    /// The clones of this image: of the snapshot it is open at, or of each of its snapshots.
    pub fn children(&self) -> Result<Vec<LinkedImage>> {
        if self.snapshot.is_some() {
            return self.raw.children().map_err(|f| self.err(f));
        }
        let mut children = Vec::new();
        for snap in self.snapshots()? {
            let at = self.pool.open_snapshot(&self.name, &snap.name)?;
            children.extend(at.raw.children().map_err(|f| at.err(f))?);
        }
        Ok(children)
    }

    /// Clients that have the image open (read-write).
    pub fn watchers(&self) -> Result<Vec<Watcher>> {
        self.raw.watchers().map_err(|f| self.err(f))
    }

    /// Takes a snapshot; [`Error::AlreadyExists`] when one of that name exists.
    pub fn create_snapshot(&self, snapshot: &str) -> Result<()> {
        let c_snap = image_name(snapshot)?;
        self.raw
            .snap_create(&c_snap)
            .map_err(|f| self.snap_err(f, snapshot))
    }

    /// The image's snapshots, oldest first.
    pub fn snapshots(&self) -> Result<Vec<SnapInfo>> {
        let mut snaps = self.raw.snap_list().map_err(|f| self.err(f))?;
        snaps.sort_by_key(|s| s.id);
        Ok(snaps)
    }

    /// Protects a snapshot from removal (needed to clone it, clone format 1).
    pub fn protect_snapshot(&self, snapshot: &str) -> Result<()> {
        let c_snap = image_name(snapshot)?;
        self.raw
            .snap_protect(&c_snap)
            .map_err(|f| self.snap_err(f, snapshot))
    }

    /// Unprotects a snapshot; [`Error::HasClones`] while clones of it exist.
    pub fn unprotect_snapshot(&self, snapshot: &str) -> Result<()> {
        let c_snap = image_name(snapshot)?;
        self.raw.snap_unprotect(&c_snap).map_err(|f| {
            if f.errno == libc::EBUSY {
                let clones = self
                    .pool
                    .open_snapshot(&self.name, snapshot)
                    .and_then(|at| at.children())
                    .map(|cs| {
                        cs.iter()
                            .map(|c| format!("{}/{}", c.pool, c.image))
                            .collect()
                    })
                    .unwrap_or_default();
                Error::HasClones {
                    call: f.call,
                    subject: format!("snapshot {}/{}@{snapshot}", self.pool.name(), self.name),
                    clones,
                    errno: Errno(f.errno),
                }
            } else {
                self.snap_err(f, snapshot)
            }
        })
    }

    /// Whether a snapshot is protected.
    pub fn is_snapshot_protected(&self, snapshot: &str) -> Result<bool> {
        let c_snap = image_name(snapshot)?;
        self.raw
            .snap_is_protected(&c_snap)
            .map_err(|f| self.snap_err(f, snapshot))
    }

    /// Removes a snapshot; [`Error::SnapshotProtected`] while it is protected.
    pub fn remove_snapshot(&self, snapshot: &str) -> Result<()> {
        let c_snap = image_name(snapshot)?;
        self.raw.snap_remove(&c_snap).map_err(|f| {
            if f.errno == libc::EBUSY {
                Error::SnapshotProtected {
                    call: f.call,
                    snapshot: format!("{}/{}@{snapshot}", self.pool.name(), self.name),
                    errno: Errno(f.errno),
                }
            } else {
                self.snap_err(f, snapshot)
            }
        })
    }

    /// Takes the image's exclusive lock (feature exclusive-lock) and keeps it: other clients'
    /// requests for it are refused until [`Image::release_lock`] or close. Fails at once with
    /// [`Error::LockHeld`] when another client holds it this way.
    pub fn acquire_exclusive_lock(&self) -> Result<()> {
        self.raw
            .lock_acquire(LockMode::Exclusive)
            .map_err(|f| match f.errno {
                libc::EROFS | libc::EBUSY => Error::LockHeld {
                    call: f.call,
                    image: self.spec(),
                    errno: Errno(f.errno),
                },
                _ => self.err(f),
            })
    }

    /// Releases the lock this client holds.
    pub fn release_lock(&self) -> Result<()> {
        self.raw.lock_release().map_err(|f| self.err(f))
    }

    /// Whether this client holds the exclusive lock.
    pub fn is_lock_owner(&self) -> Result<bool> {
        self.raw.is_lock_owner().map_err(|f| self.err(f))
    }

    /// Who holds the image's lock.
    pub fn lock_owners(&self) -> Result<LockOwners> {
        let (mode, owners) = self.raw.lock_owners().map_err(|f| self.err(f))?;
        Ok(LockOwners { mode, owners })
    }

    /// Closes the image (releasing its lock, if held), reporting a failure.
    pub fn close(self) -> Result<()> {
        let spec = self.spec();
        self.raw
            .close()
            .map_err(|f| Error::from_failure(f, format!("image {spec}")))
    }
}
