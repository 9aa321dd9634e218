//! RBD groups: a snapshot of several images at one instant (`rbd_group_snap_create2`), and
//! what reads it: an image opened at its member of a group snapshot, copied into an image of
//! its own.

use crate::error::{Error, Result};
use crate::image::Image;
use crate::pool::{Pool, image_name};
use crate::sys::ImageOpts;

/// The run of zeroes [`Image::copy_to`] leaves unwritten.
const SPARSE: usize = 4096;

impl Pool {
    fn group_subject(&self, group: &str) -> String {
        format!("group {}/{group}", self.name())
    }

    /// Creates an (empty) group; [`Error::AlreadyExists`] when one of that name exists.
    pub fn create_group(&self, group: &str) -> Result<()> {
        self.ioctx
            .group_create(&image_name(group)?)
            .map_err(|f| Error::from_failure(f, self.group_subject(group)))
    }

    /// Removes a group, with its snapshots (and its images' snapshots of them); its images
    /// stay, out of the group.
    pub fn remove_group(&self, group: &str) -> Result<()> {
        self.ioctx
            .group_remove(&image_name(group)?)
            .map_err(|f| Error::from_failure(f, self.group_subject(group)))
    }

    /// Adds an image of this pool to a group of this pool; [`Error::AlreadyExists`] when it
    /// is in a group (an image is in one group at a time).
    pub fn add_to_group(&self, group: &str, image: &str) -> Result<()> {
        self.ioctx
            .group_image_add(&image_name(group)?, &self.ioctx, &image_name(image)?)
            .map_err(|f| {
                Error::from_failure(f, format!("{}, image {image}", self.group_subject(group)))
            })
    }

    /// Cuts a snapshot of every image of the group at one instant: librbd takes each image's
    /// exclusive lock and holds its writes (its clients wait, they do not fail) until all are
    /// cut. The clients are not asked to quiesce: the snapshot is crash-consistent.
    pub fn create_group_snapshot(&self, group: &str, snapshot: &str) -> Result<()> {
        self.ioctx
            .group_snap_create(&image_name(group)?, &image_name(snapshot)?)
            .map_err(|f| {
                Error::from_failure(f, format!("{}@{snapshot}", self.group_subject(group)))
            })
    }

    /// Opens `image` read-only at its snapshot of the group snapshot `group@snapshot` (a
    /// group of this pool); None when it has none.
    pub fn open_group_snapshot(
        &self,
        image: &str,
        group: &str,
        snapshot: &str,
    ) -> Result<Option<Image>> {
        let open = self.open_image_read_only(image)?;
        let subject = |s: &str| format!("snapshot {}/{image}@{s}", self.name());
        for snap in open.snapshots()? {
            let names = open
                .raw
                .snap_group(snap.id)
                .map_err(|f| Error::from_failure(f, subject(&snap.name)))?;
            if names.is_some_and(|(g, s)| g == group && s == snapshot) {
                open.raw
                    .snap_set_by_id(snap.id)
                    .map_err(|f| Error::from_failure(f, subject(&snap.name)))?;
                return Ok(Some(open.at(snap.name)));
            }
        }
        Ok(None)
    }
}

impl Image {
    /// Copies the image as open (at its snapshot, or its head), without its other snapshots,
    /// into a new image `name` of `dest`, with this image's features, order and size; only
    /// what is not zero is written. [`Error::AlreadyExists`] when `name` exists.
    pub fn copy_to(&self, dest: &Pool, name: &str) -> Result<()> {
        let opts = ImageOpts::new(crate::sys::api()?);
        let c_name = image_name(name)?;
        self.raw
            .copy(&dest.ioctx, &c_name, &opts, SPARSE)
            .map_err(|f| {
                let subject = match f.errno {
                    libc::EEXIST => format!("image {}/{name}", dest.name()),
                    _ => format!("copy of {} to {}/{name}", self.spec(), dest.name()),
                };
                Error::from_failure(f, subject)
            })
    }
}
