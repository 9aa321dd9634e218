//! Pool metadata (key-value pairs kept in the pool's `rbd_info` object), images opened by id,
//! the image lock's lockers, image I/O, and the client's instance id: the calls behind moor's
//! records, its fencing and the tests that check a fenced client cannot write.

use std::ffi::{CStr, c_char, c_int};
use std::ptr;
use std::sync::Arc;

use super::{Failure, Ioctx, LIST_ATTEMPTS, Rados, RbdImage, Result, check};

/// The NUL-terminated strings packed into the first `len` bytes of `buffer`.
fn split_nul(buffer: &[c_char], len: usize) -> Vec<String> {
    let bytes: Vec<u8> = buffer[..len.min(buffer.len())]
        .iter()
        .map(|&c| c as u8)
        .collect();
    if bytes.is_empty() {
        return Vec::new();
    }
    let mut out: Vec<String> = bytes
        .split(|&b| b == 0)
        .map(|s| String::from_utf8_lossy(s).into_owned())
        .collect();
    // The last string's NUL leaves an empty piece after it.
    if bytes.last() == Some(&0) {
        out.pop();
    }
    out
}

/// A negative `ssize_t` return as a failure, a count otherwise.
fn check_count(call: &'static str, ret: isize) -> Result<usize> {
    if ret < 0 {
        Err(Failure {
            call,
            errno: i32::try_from(-ret).unwrap_or(libc::EIO),
        })
    } else {
        Ok(ret.unsigned_abs())
    }
}

/// A metadata value got by `get` (`rbd_pool_metadata_get` or `rbd_metadata_get`: a key's
/// value into a buffer of `*size` bytes, `-ERANGE` and the size it needs when too small):
/// None when the key is not set.
fn metadata_get(
    call: &'static str,
    mut get: impl FnMut(*mut c_char, *mut usize) -> c_int,
) -> Result<Option<String>> {
    let mut len = 512usize;
    for _ in 0..LIST_ATTEMPTS {
        let mut buffer = vec![0 as c_char; len];
        let mut size = len;
        let ret = get(buffer.as_mut_ptr(), &mut size);
        if ret == -libc::ENOENT {
            return Ok(None);
        }
        if ret == -libc::ERANGE {
            len = size.max(len * 2);
            continue;
        }
        check(call, ret)?;
        return Ok(split_nul(&buffer, size.min(len))
            .into_iter()
            .next()
            .or(Some(String::new())));
    }
    Err(Failure {
        call,
        errno: libc::ERANGE,
    })
}

impl RbdImage {
    /// `rbd_metadata_get`: the image's metadata value of `key`, or None when it is not set.
    pub(crate) fn metadata_get(&self, key: &CStr) -> Result<Option<String>> {
        metadata_get("rbd_metadata_get", |buffer, size| {
            // SAFETY: an open image, a NUL-terminated key, a writable buffer of `*size` bytes
            // and the size's address.
            unsafe { (self.api().rbd_metadata_get)(self.handle, key.as_ptr(), buffer, size) }
        })
    }
}

/// An image lock's lockers, as `rbd_list_lockers` reports them.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) struct RawLockers {
    pub exclusive: bool,
    pub tag: String,
    /// (client, cookie, address) of each locker.
    pub lockers: Vec<(String, String, String)>,
}

impl Rados {
    /// This client's instance id: the global id other clients see it as (`client.N`).
    pub(crate) fn instance_id(&self) -> u64 {
        // SAFETY: a live, connected handle.
        unsafe { (self.api.rados_get_instance_id)(self.handle) }
    }

    /// Waits until this client has the cluster's latest OSD map.
    pub(crate) fn wait_for_latest_osdmap(&self) -> Result<()> {
        // SAFETY: a live, connected handle.
        let ret = unsafe { (self.api.rados_wait_for_latest_osdmap)(self.handle) };
        check("rados_wait_for_latest_osdmap", ret).map(drop)
    }
}

impl Ioctx {
    /// `rbd_pool_metadata_get`: the value, or None when the key is not set.
    pub(crate) fn pool_metadata_get(&self, key: &CStr) -> Result<Option<String>> {
        metadata_get("rbd_pool_metadata_get", |buffer, size| {
            // SAFETY: a live I/O context, a NUL-terminated key, a writable buffer of `*size`
            // bytes and the size's address.
            unsafe { (self.api().rbd_pool_metadata_get)(self.handle, key.as_ptr(), buffer, size) }
        })
    }

    /// `rbd_pool_metadata_set`.
    pub(crate) fn pool_metadata_set(&self, key: &CStr, value: &CStr) -> Result<()> {
        // SAFETY: a live I/O context and two NUL-terminated strings, which librbd copies.
        let ret = unsafe {
            (self.api().rbd_pool_metadata_set)(self.handle, key.as_ptr(), value.as_ptr())
        };
        check("rbd_pool_metadata_set", ret).map(drop)
    }

    /// `rbd_pool_metadata_remove`: whether the key was set.
    pub(crate) fn pool_metadata_remove(&self, key: &CStr) -> Result<bool> {
        // SAFETY: a live I/O context and a NUL-terminated key.
        let ret = unsafe { (self.api().rbd_pool_metadata_remove)(self.handle, key.as_ptr()) };
        if ret == -libc::ENOENT {
            return Ok(false);
        }
        check("rbd_pool_metadata_remove", ret).map(|_| true)
    }

    /// `rbd_pool_metadata_list`: up to `max` pairs (0: all) whose keys sort after `after`.
    pub(crate) fn pool_metadata_list(
        &self,
        after: &CStr,
        max: u64,
    ) -> Result<Vec<(String, String)>> {
        let (mut keys_len, mut values_len) = (4096usize, 16384usize);
        for _ in 0..LIST_ATTEMPTS {
            let mut keys = vec![0 as c_char; keys_len];
            let mut values = vec![0 as c_char; values_len];
            let (mut k, mut v) = (keys_len, values_len);
            // SAFETY: a live I/O context, a NUL-terminated start key, two writable buffers of
            // `k` and `v` bytes and their sizes' addresses.
            let ret = unsafe {
                (self.api().rbd_pool_metadata_list)(
                    self.handle,
                    after.as_ptr(),
                    max,
                    keys.as_mut_ptr(),
                    &mut k,
                    values.as_mut_ptr(),
                    &mut v,
                )
            };
            if ret == -libc::ENOENT {
                return Ok(Vec::new());
            }
            if ret == -libc::ERANGE {
                keys_len = k.max(keys_len * 2);
                values_len = v.max(values_len * 2);
                continue;
            }
            check("rbd_pool_metadata_list", ret)?;
            let keys = split_nul(&keys, k.min(keys_len));
            let mut values = split_nul(&values, v.min(values_len));
            values.resize(keys.len(), String::new());
            return Ok(keys.into_iter().zip(values).collect());
        }
        Err(Failure {
            call: "rbd_pool_metadata_list",
            errno: libc::ERANGE,
        })
    }
}

impl RbdImage {
    /// `rbd_open_by_id` (or `rbd_open_by_id_read_only`): an image by its id, also while it
    /// is in the trash.
    pub(crate) fn open_by_id(
        ioctx: &Arc<Ioctx>,
        id: &CStr,
        snapshot: Option<&CStr>,
        read_only: bool,
    ) -> Result<RbdImage> {
        let api = ioctx.api();
        let snap = snapshot.map_or(ptr::null(), CStr::as_ptr);
        let mut handle = ptr::null_mut();
        let (call, ret) = if read_only {
            // SAFETY: a live I/O context, a NUL-terminated id, a NUL-terminated snapshot name
            // or null (the head), and an out-pointer.
            let ret = unsafe {
                (api.rbd_open_by_id_read_only)(ioctx.handle, id.as_ptr(), &mut handle, snap)
            };
            ("rbd_open_by_id_read_only", ret)
        } else {
            // SAFETY: as above.
            let ret = unsafe { (api.rbd_open_by_id)(ioctx.handle, id.as_ptr(), &mut handle, snap) };
            ("rbd_open_by_id", ret)
        };
        check(call, ret)?;
        Ok(RbdImage {
            ioctx: Arc::clone(ioctx),
            handle,
        })
    }

    /// `rbd_list_lockers`: the lockers of the image's lock (the exclusive-lock feature's
    /// managed lock among them).
    pub(crate) fn list_lockers(&self) -> Result<RawLockers> {
        let api = self.api();
        let mut sizes = [64usize, 256, 256, 256];
        for _ in 0..LIST_ATTEMPTS {
            let mut bufs: [Vec<c_char>; 4] = sizes.map(|n| vec![0 as c_char; n]);
            let mut lens = sizes;
            let mut exclusive: c_int = 0;
            let [tag, clients, cookies, addrs] = &mut bufs;
            let [tag_len, clients_len, cookies_len, addrs_len] = &mut lens;
            // SAFETY: an open image, a valid out-pointer for the mode, four writable buffers of
            // the sizes given with them, and those sizes' addresses.
            let ret = unsafe {
                (api.rbd_list_lockers)(
                    self.handle,
                    &mut exclusive,
                    tag.as_mut_ptr(),
                    tag_len,
                    clients.as_mut_ptr(),
                    clients_len,
                    cookies.as_mut_ptr(),
                    cookies_len,
                    addrs.as_mut_ptr(),
                    addrs_len,
                )
            };
            if ret == -(libc::ERANGE as isize) {
                for (size, need) in sizes.iter_mut().zip(lens) {
                    *size = need.max(*size * 2);
                }
                continue;
            }
            let count = check_count("rbd_list_lockers", ret)?;
            let tag = split_nul(tag, lens[0])
                .into_iter()
                .next()
                .unwrap_or_default();
            let clients = split_nul(clients, lens[1]);
            let cookies = split_nul(cookies, lens[2]);
            let addrs = split_nul(addrs, lens[3]);
            let lockers = (0..count)
                .map(|i| {
                    (
                        clients.get(i).cloned().unwrap_or_default(),
                        cookies.get(i).cloned().unwrap_or_default(),
                        addrs.get(i).cloned().unwrap_or_default(),
                    )
                })
                .collect();
            return Ok(RawLockers {
                exclusive: exclusive != 0,
                tag,
                lockers,
            });
        }
        Err(Failure {
            call: "rbd_list_lockers",
            errno: libc::ERANGE,
        })
    }

    /// `rbd_break_lock`: removes the lock `client` holds with `cookie`.
    pub(crate) fn break_lock(&self, client: &CStr, cookie: &CStr) -> Result<()> {
        // SAFETY: an open image and two NUL-terminated strings.
        let ret =
            unsafe { (self.api().rbd_break_lock)(self.handle, client.as_ptr(), cookie.as_ptr()) };
        check("rbd_break_lock", ret).map(drop)
    }

    /// `rbd_write`: writes all of `data` at `offset`.
    pub(crate) fn write(&self, offset: u64, data: &[u8]) -> Result<()> {
        // SAFETY: an open image and a readable buffer of `data.len()` bytes.
        let ret = unsafe {
            (self.api().rbd_write)(
                self.handle,
                offset,
                data.len(),
                data.as_ptr().cast::<c_char>(),
            )
        };
        let written = check_count("rbd_write", ret)?;
        if written != data.len() {
            return Err(Failure {
                call: "rbd_write",
                errno: libc::EIO,
            });
        }
        Ok(())
    }

    /// `rbd_read`: up to `len` bytes at `offset`.
    pub(crate) fn read(&self, offset: u64, len: usize) -> Result<Vec<u8>> {
        let mut buffer = vec![0u8; len];
        let read = self.read_into(offset, &mut buffer)?;
        buffer.truncate(read);
        Ok(buffer)
    }

    /// `rbd_read` into `buffer`: the bytes read (fewer than asked past the image's end).
    pub(crate) fn read_into(&self, offset: u64, buffer: &mut [u8]) -> Result<usize> {
        // SAFETY: an open image and a writable buffer of `buffer.len()` bytes, borrowed
        // mutably for the call (librbd writes into it only until the call returns).
        let ret = unsafe {
            (self.api().rbd_read)(
                self.handle,
                offset,
                buffer.len(),
                buffer.as_mut_ptr().cast::<c_char>(),
            )
        };
        let read = check_count("rbd_read", ret)?;
        Ok(read.min(buffer.len()))
    }

    /// `rbd_flush`: what was written reaches the cluster.
    pub(crate) fn flush(&self) -> Result<()> {
        // SAFETY: an open image.
        let ret = unsafe { (self.api().rbd_flush)(self.handle) };
        check("rbd_flush", ret).map(drop)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn buf(bytes: &[u8]) -> Vec<c_char> {
        bytes.iter().map(|&b| b as c_char).collect()
    }

    #[test]
    fn nul_separated_strings_are_split() {
        let b = buf(b"a\0bc\0\0d\0junk");
        assert_eq!(split_nul(&b, 8), ["a", "bc", "", "d"]);
        assert_eq!(split_nul(&b, 0), Vec::<String>::new());
        assert_eq!(split_nul(&buf(b"x"), 1), ["x"]);
    }
}
