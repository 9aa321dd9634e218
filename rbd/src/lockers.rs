//! Who holds an image's lock, and breaking it: the exclusive-lock feature keeps its lock as a
//! RADOS lock on the image's header, with the holder's client name, a cookie and its address.
//! Breaking it is what lets another client take the image from one that was fenced.

use std::ffi::CString;

use crate::error::{Error, Result};
use crate::image::Image;

/// One holder of an image's lock.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Locker {
    /// The client, "client.N".
    pub client: String,
    /// The lock instance's cookie ("auto N" for the exclusive-lock feature's lock).
    pub cookie: String,
    /// The client's address, "IP:PORT/NONCE": what fencing blocklists.
    pub address: String,
}

/// The holders of an image's lock.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Lockers {
    /// Whether the lock is exclusive.
    pub exclusive: bool,
    /// The lock's tag ("internal" for the exclusive-lock feature's lock).
    pub tag: String,
    /// The holders; empty when the lock is free.
    pub lockers: Vec<Locker>,
}

fn c_text(what: &'static str, value: &str) -> Result<CString> {
    CString::new(value).map_err(|_| Error::Invalid {
        what,
        reason: format!("{value:?} contains a NUL byte"),
    })
}

impl Image {
    /// The holders of the image's lock, with their addresses.
    pub fn lockers(&self) -> Result<Lockers> {
        let raw = self
            .raw
            .list_lockers()
            .map_err(|f| Error::from_failure(f, format!("image {}", self.spec())))?;
        Ok(Lockers {
            exclusive: raw.exclusive,
            tag: raw.tag,
            lockers: raw
                .lockers
                .into_iter()
                .map(|(client, cookie, address)| Locker {
                    client,
                    cookie,
                    address,
                })
                .collect(),
        })
    }

    /// Breaks the lock `locker` holds; [`Error::NotFound`] when it no longer holds it.
    pub fn break_lock(&self, locker: &Locker) -> Result<()> {
        let client = c_text("locker client", &locker.client)?;
        let cookie = c_text("locker cookie", &locker.cookie)?;
        self.raw
            .break_lock(&client, &cookie)
            .map_err(|f| Error::from_failure(f, format!("lock of image {}", self.spec())))
    }
}
