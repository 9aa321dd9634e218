//! Reading and writing an image's data through librbd (what a client that maps the image
//! does; moor's controller uses it only in tests, to show that a fenced client cannot write).

use crate::error::{Error, Result};
use crate::image::Image;

impl Image {
    /// Writes `data` at `offset`.
    pub fn write(&self, offset: u64, data: &[u8]) -> Result<()> {
        self.raw
            .write(offset, data)
            .map_err(|f| Error::from_failure(f, format!("image {}", self.spec())))
    }

    /// Reads up to `len` bytes at `offset`.
    pub fn read(&self, offset: u64, len: usize) -> Result<Vec<u8>> {
        self.raw
            .read(offset, len)
            .map_err(|f| Error::from_failure(f, format!("image {}", self.spec())))
    }

    /// Reads into `buffer` at `offset`: the number of bytes read (fewer than its length past
    /// the image's end). Calls on one image may be made from several threads at once.
    pub fn read_into(&self, offset: u64, buffer: &mut [u8]) -> Result<usize> {
        self.raw
            .read_into(offset, buffer)
            .map_err(|f| Error::from_failure(f, format!("image {}", self.spec())))
    }

    /// Makes what was written reach the cluster (librbd may cache writes).
    pub fn flush(&self) -> Result<()> {
        self.raw
            .flush()
            .map_err(|f| Error::from_failure(f, format!("image {}", self.spec())))
    }
}

/// What a diff walk's closure answers for one extent: go on, or stop.
pub use std::ops::ControlFlow;

impl Image {
    /// Walks the extents of `[offset, offset + len)` of the image, as open (at a snapshot, or
    /// its head), that changed since its snapshot `from`, or that hold data when `from` is
    /// None (with the parent's data, for a clone): `each(offset, length, exists)` in order,
    /// `exists` false for an extent discarded since `from`. Returns whether `each` stopped
    /// the walk (with [`ControlFlow::Break`]). librbd may call `each` on a thread of its own
    /// (one extent at a time, in order), hence `Send`.
    pub fn diff(
        &self,
        from: Option<&str>,
        offset: u64,
        len: u64,
        each: &mut (dyn FnMut(u64, u64, bool) -> ControlFlow<()> + Send),
    ) -> Result<bool> {
        let from = from.map(crate::pool::image_name).transpose()?;
        self.raw
            .diff_iterate(from.as_deref(), offset, len, true, each)
            .map_err(|f| Error::from_failure(f, format!("image {}", self.spec())))
    }
}
