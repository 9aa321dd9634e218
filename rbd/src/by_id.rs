//! Images opened by id: an image's id stays the same for its whole life, also while it is in
//! the trash, where it has no name to open it by.

use crate::error::{Error, Result};
use crate::image::Image;
use crate::pool::{Pool, image_name};
use crate::sys::RbdImage;

impl Pool {
    /// Opens an image by id for reading and writing (also an image in the trash).
    pub fn open_image_by_id(&self, id: &str) -> Result<Image> {
        self.open_by_id(id, None, false)
    }

    /// Opens an image by id read-only (no watch is registered).
    pub fn open_image_by_id_read_only(&self, id: &str) -> Result<Image> {
        self.open_by_id(id, None, true)
    }

    /// Opens an image by id, read-only, at one of its snapshots.
    pub fn open_snapshot_by_id(&self, id: &str, snapshot: &str) -> Result<Image> {
        self.open_by_id(id, Some(snapshot), true)
    }

    fn open_by_id(&self, id: &str, snapshot: Option<&str>, read_only: bool) -> Result<Image> {
        let c_id = image_name(id)?;
        let c_snap = snapshot.map(image_name).transpose()?;
        // The image is named by its id here: its name is not needed to work on it.
        let shown = format!("id:{id}");
        let subject = match snapshot {
            Some(s) => format!("snapshot {}/{shown}@{s}", self.name()),
            None => format!("image {}/{shown}", self.name()),
        };
        let raw = RbdImage::open_by_id(&self.ioctx, &c_id, c_snap.as_deref(), read_only)
            .map_err(|f| Error::from_failure(f, subject))?;
        Ok(Image::new(
            raw,
            self.clone(),
            shown,
            snapshot.map(str::to_owned),
        ))
    }
}
