//! A pool: its images (create, list, remove, clone, trash) and its capacity.

use std::ffi::CString;
use std::sync::Arc;
use std::time::Duration;

use crate::cluster::mon_command;
use crate::error::{Errno, Error, Result};
use crate::features::{Features, ImageOptions};
use crate::image::Image;
use crate::info::{ImageSpec, PoolCapacity, TrashEntry};
use crate::sys::{Failure, ImageOpts, Ioctx, RbdImage};

/// An open pool. Cheap to clone (the I/O context is shared).
#[derive(Debug, Clone)]
pub struct Pool {
    pub(crate) ioctx: Arc<Ioctx>,
    name: String,
}

/// One page of a pool's images, in name order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImagePage {
    /// The images of this page.
    pub images: Vec<ImageSpec>,
    /// The name to start the next page after; None on the last page.
    pub next: Option<String>,
}

/// What [`Pool::ensure_image`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ensured {
    /// The image was created.
    Created,
    /// An image of that name, size and features was already there.
    Existed,
}

/// The page of `images` (sorted by name) after `after`, of at most `max` (all when 0).
fn page(images: Vec<ImageSpec>, after: Option<&str>, max: usize) -> ImagePage {
    let mut rest: Vec<ImageSpec> = images
        .into_iter()
        .filter(|spec| after.is_none_or(|after| spec.name.as_str() > after))
        .collect();
    if max == 0 || rest.len() <= max {
        return ImagePage {
            images: rest,
            next: None,
        };
    }
    rest.truncate(max);
    let next = rest.last().map(|spec| spec.name.clone());
    ImagePage { images: rest, next }
}

pub(crate) fn image_name(name: &str) -> Result<CString> {
    if name.is_empty() {
        return Err(Error::Invalid {
            what: "name",
            reason: "it is empty".into(),
        });
    }
    CString::new(name).map_err(|_| Error::Invalid {
        what: "name",
        reason: format!("{name:?} contains a NUL byte"),
    })
}

impl Pool {
    pub(crate) fn new(ioctx: Arc<Ioctx>, name: String) -> Pool {
        Pool { ioctx, name }
    }

    /// The pool's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    fn subject(&self, image: &str) -> String {
        format!("image {}/{image}", self.name)
    }

    fn opts(
        &self,
        features: Features,
        order: Option<u8>,
        data_pool: Option<&str>,
    ) -> Result<ImageOpts> {
        let api = crate::sys::api()?;
        let mut opts = ImageOpts::new(api);
        let invalid = |f: Failure| Error::Invalid {
            what: "image options",
            reason: format!("{}: {}", f.call, Errno(f.errno)),
        };
        opts.features(features.bits()).map_err(invalid)?;
        if let Some(order) = order {
            opts.order(order).map_err(invalid)?;
        }
        if let Some(pool) = data_pool {
            opts.data_pool(&image_name(pool)?).map_err(invalid)?;
        }
        Ok(opts)
    }

    /// Creates an image; [`Error::AlreadyExists`] when one of that name exists.
    pub fn create_image(&self, name: &str, options: &ImageOptions) -> Result<()> {
        let c_name = image_name(name)?;
        let opts = self.opts(
            options.features,
            options.order,
            options.data_pool.as_deref(),
        )?;
        self.ioctx
            .rbd_create(&c_name, options.size, &opts)
            .map_err(|f| Error::from_failure(f, self.subject(name)))
    }

    /// Creates an image unless one of that name, size and features exists: the idempotent
    /// create. An image of that name with another size or features is [`Error::Conflict`].
    pub fn ensure_image(&self, name: &str, options: &ImageOptions) -> Result<Ensured> {
        match self.create_image(name, options) {
            Ok(()) => Ok(Ensured::Created),
            Err(Error::AlreadyExists { .. }) => {
                let image = self.open_image_read_only(name)?;
                let size = image.size()?;
                let features = image.features()?;
                if size == options.size && features == options.features {
                    Ok(Ensured::Existed)
                } else {
                    Err(Error::Conflict {
                        image: format!("{}/{name}", self.name),
                        existing: format!("size {size}, features {features}"),
                        requested: format!("size {}, features {}", options.size, options.features),
                    })
                }
            }
            Err(e) => Err(e),
        }
    }

    /// Opens an image for reading and writing.
    pub fn open_image(&self, name: &str) -> Result<Image> {
        self.open(name, None, false)
    }

    /// Opens an image read-only (no watch is registered: it does not count as a watcher).
    pub fn open_image_read_only(&self, name: &str) -> Result<Image> {
        self.open(name, None, true)
    }

    /// Opens an image read-only at one of its snapshots.
    pub fn open_snapshot(&self, name: &str, snapshot: &str) -> Result<Image> {
        self.open(name, Some(snapshot), true)
    }

    fn open(&self, name: &str, snapshot: Option<&str>, read_only: bool) -> Result<Image> {
        let c_name = image_name(name)?;
        let c_snap = snapshot.map(image_name).transpose()?;
        let subject = match snapshot {
            Some(s) => format!("snapshot {}/{name}@{s}", self.name),
            None => self.subject(name),
        };
        let raw = RbdImage::open(&self.ioctx, &c_name, c_snap.as_deref(), read_only)
            .map_err(|f| Error::from_failure(f, subject))?;
        Ok(Image::new(
            raw,
            self.clone(),
            name.to_owned(),
            snapshot.map(str::to_owned),
        ))
    }

    /// Removes an image and its data. Refused, each distinctly, while the image has clones
    /// ([`Error::HasClones`]), snapshots ([`Error::HasSnapshots`]) or is open elsewhere
    /// ([`Error::Busy`]); [`Error::NotFound`] when there is no such image.
    pub fn remove_image(&self, name: &str) -> Result<()> {
        let c_name = image_name(name)?;
        let Err(failure) = self.ioctx.rbd_remove(&c_name) else {
            return Ok(());
        };
        let errno = Errno(failure.errno);
        let call = failure.call;
        match failure.errno {
            libc::ENOTEMPTY => {
                // Snapshots remain. Clones of them are the refusal that needs more than
                // removing snapshots (a flatten), so say so when there are any.
                let clones = self
                    .open_image_read_only(name)
                    .and_then(|image| image.children())
                    .unwrap_or_default();
                if clones.is_empty() {
                    Err(Error::HasSnapshots {
                        call,
                        image: format!("{}/{name}", self.name),
                        errno,
                    })
                } else {
                    Err(Error::HasClones {
                        call,
                        subject: self.subject(name),
                        clones: clones
                            .iter()
                            .map(|c| format!("{}/{}", c.pool, c.image))
                            .collect(),
                        errno,
                    })
                }
            }
            libc::EBUSY => {
                let watchers = self
                    .open_image_read_only(name)
                    .and_then(|image| image.watchers())
                    .map(|ws| {
                        ws.iter()
                            .map(|w| format!("{} (client.{})", w.address, w.client_id))
                            .collect()
                    })
                    .unwrap_or_default();
                Err(Error::Busy {
                    call,
                    image: format!("{}/{name}", self.name),
                    watchers,
                    errno,
                })
            }
            _ => Err(Error::from_failure(failure, self.subject(name))),
        }
    }

    /// Every image of the pool, in name order.
    pub fn images(&self) -> Result<Vec<ImageSpec>> {
        let mut images = self
            .ioctx
            .rbd_list()
            .map_err(|f| Error::from_failure(f, format!("pool {}", self.name)))?;
        images.sort();
        Ok(images)
    }

    /// Up to `max` images (all when 0) whose names sort after `after` (from the first when
    /// None), in name order. librbd lists a pool whole; the page is cut here.
    pub fn list_images(&self, after: Option<&str>, max: usize) -> Result<ImagePage> {
        Ok(page(self.images()?, after, max))
    }

    /// Clones `parent@snapshot` (of this pool) as `child` in `child_pool`, with these
    /// features. The snapshot must be protected (clone format 1) unless the cluster allows
    /// clones of unprotected snapshots (clone format 2).
    pub fn clone_image(
        &self,
        parent: &str,
        snapshot: &str,
        child_pool: &Pool,
        child: &str,
        features: Features,
    ) -> Result<()> {
        let (c_parent, c_snap, c_child) = (
            image_name(parent)?,
            image_name(snapshot)?,
            image_name(child)?,
        );
        let opts = self.opts(features, None, None)?;
        self.ioctx
            .rbd_clone(&c_parent, &c_snap, &child_pool.ioctx, &c_child, &opts)
            .map_err(|f| {
                let subject = match f.errno {
                    libc::EEXIST => child_pool.subject(child),
                    _ => format!("snapshot {}/{parent}@{snapshot}", self.name),
                };
                Error::from_failure(f, subject)
            })
    }

    /// Moves an image to the pool's trash, where it can be neither opened nor removed by name;
    /// before `delay` has passed only a forced [`Pool::trash_remove`] removes it.
    pub fn trash_move(&self, name: &str, delay: Duration) -> Result<()> {
        let c_name = image_name(name)?;
        self.ioctx
            .trash_move(&c_name, delay.as_secs())
            .map_err(|f| Error::from_failure(f, self.subject(name)))
    }

    /// The images in the pool's trash.
    pub fn trash_list(&self) -> Result<Vec<TrashEntry>> {
        self.ioctx
            .trash_list()
            .map_err(|f| Error::from_failure(f, format!("trash of pool {}", self.name)))
    }

    /// Removes an image from the trash for good, by id; `force` also before its delay passed.
    pub fn trash_remove(&self, id: &str, force: bool) -> Result<()> {
        let c_id = image_name(id)?;
        self.ioctx
            .trash_remove(&c_id, force)
            .map_err(|f| Error::from_failure(f, format!("trashed image {}/{id}", self.name)))
    }

    /// What the pool stores and can still take: the monitors' `df` for the available bytes
    /// (after replication and the full ratio), `rados_ioctx_pool_stat` for the rest.
    pub fn capacity(&self) -> Result<PoolCapacity> {
        let usage = self
            .ioctx
            .pool_stat()
            .map_err(|f| Error::from_failure(f, format!("pool {}", self.name)))?;
        let df = mon_command(self.ioctx.rados(), &serde_json::json!({ "prefix": "df" }))?;
        let available = df["pools"]
            .as_array()
            .and_then(|pools| pools.iter().find(|p| p["name"] == self.name.as_str()))
            .and_then(|p| p["stats"]["max_avail"].as_u64())
            .ok_or_else(|| Error::MonCommand {
                command: "df".into(),
                detail: format!("no max_avail for pool {}", self.name),
            })?;
        Ok(PoolCapacity {
            used_bytes: usage.used_bytes,
            objects: usage.objects,
            available_bytes: available,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn specs(names: &[&str]) -> Vec<ImageSpec> {
        names
            .iter()
            .map(|n| ImageSpec {
                name: (*n).into(),
                id: format!("id-{n}"),
            })
            .collect()
    }

    fn names(page: &ImagePage) -> Vec<&str> {
        page.images.iter().map(|s| s.name.as_str()).collect()
    }

    #[test]
    fn pages_follow_each_other_by_name_to_the_end() {
        let all = specs(&["a", "b", "c", "d", "e"]);
        let first = page(all.clone(), None, 2);
        assert_eq!(names(&first), ["a", "b"]);
        assert_eq!(first.next.as_deref(), Some("b"));
        let second = page(all.clone(), first.next.as_deref(), 2);
        assert_eq!(names(&second), ["c", "d"]);
        let third = page(all.clone(), second.next.as_deref(), 2);
        assert_eq!(names(&third), ["e"]);
        assert_eq!(third.next, None);
        // A page that ends exactly at the end has no next.
        assert_eq!(page(all.clone(), Some("c"), 2).next, None);
        // 0 is "all"; a token past the end is an empty last page.
        assert_eq!(names(&page(all.clone(), None, 0)).len(), 5);
        assert_eq!(
            page(all.clone(), Some("z"), 2),
            ImagePage {
                images: vec![],
                next: None
            }
        );
        // A token that is no longer an image (removed meanwhile) still pages by order.
        assert_eq!(names(&page(all, Some("bb"), 1)), ["c"]);
    }

    #[test]
    fn names_with_nul_or_empty_are_refused_before_any_call() {
        assert!(matches!(image_name(""), Err(Error::Invalid { .. })));
        assert!(matches!(image_name("a\0b"), Err(Error::Invalid { .. })));
        assert_eq!(image_name("vol-1").unwrap().as_bytes(), b"vol-1");
    }
}
