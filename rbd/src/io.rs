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

    /// Makes what was written reach the cluster (librbd may cache writes).
    pub fn flush(&self) -> Result<()> {
        self.raw
            .flush()
            .map_err(|f| Error::from_failure(f, format!("image {}", self.spec())))
    }
}
