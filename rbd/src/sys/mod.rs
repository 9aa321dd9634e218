//! The only unsafe code of the crate: librados and librbd loaded at run time ([`api`]), and
//! owning handles over their cluster, pool and image handles whose methods make each call safe
//! to use: arguments are NUL-terminated strings and buffers owned here, what the libraries
//! allocate is copied out and handed back to their cleanup functions, and a handle outlives
//! nothing it was made from (an image keeps its pool alive, a pool its cluster).
//!
//! A failed call comes back as a [`Failure`]: the function's name and the errno it returned.
//! What a failure means for the caller is decided above this module.
//!
//! One file, over the usual length: the unsafe code of the crate is kept in one place to be
//! read as one, next to the function table it calls through.

mod api;
mod diff;
mod registry;
mod types;

use std::ffi::{CStr, c_char, c_int};
use std::ptr;
use std::sync::Arc;

pub(crate) use api::{Api, LoadError, RADOS_LIBRARY, RBD_LIBRARY, api};
use types::*;

use crate::info::{
    ClusterUsage, ImageInfo, ImageSpec, LinkedImage, LockMode, Parent, PoolUsage, SnapInfo,
    TrashEntry, Watcher,
};

/// A call that returned an error: the function and the (positive) errno.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Failure {
    pub call: &'static str,
    pub errno: i32,
}

type Result<T> = std::result::Result<T, Failure>;

fn check(call: &'static str, ret: c_int) -> Result<c_int> {
    if ret < 0 {
        Err(Failure { call, errno: -ret })
    } else {
        Ok(ret)
    }
}

/// How many times a list call is retried when the list grew between sizing and filling.
const LIST_ATTEMPTS: usize = 8;

/// Copies a C string out.
///
/// # Safety
/// `p` is null or points to a NUL-terminated string that stays valid during this call.
unsafe fn string_at(p: *const c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: `p` is non-null and, by the caller's promise, a valid NUL-terminated string.
    let s = unsafe { CStr::from_ptr(p) };
    s.to_string_lossy().into_owned()
}

/// A list call of the `(buffer, *count)` kind: fills `buffer` and sets `*count`, or sets
/// `*count` to the needed size and returns -ERANGE. `read` copies entries out (it is given only
/// the entries the call filled), `cleanup` frees what the library allocated in them.
fn list<T: Default, U>(
    call: &'static str,
    mut fill: impl FnMut(*mut T, *mut usize) -> c_int,
    read: impl Fn(&T) -> U,
    cleanup: impl FnOnce(*mut T, usize),
) -> Result<Vec<U>> {
    let mut capacity = 16;
    for _ in 0..LIST_ATTEMPTS {
        let mut buffer: Vec<T> = (0..capacity).map(|_| T::default()).collect();
        let mut count = capacity;
        let ret = fill(buffer.as_mut_ptr(), &mut count);
        if ret == -libc::ERANGE {
            capacity = count.max(capacity * 2);
            continue;
        }
        check(call, ret)?;
        let count = count.min(capacity);
        let out = buffer[..count].iter().map(&read).collect();
        cleanup(buffer.as_mut_ptr(), count);
        return Ok(out);
    }
    Err(Failure {
        call,
        errno: libc::ERANGE,
    })
}

/// A progress callback that reports nothing; 0 lets the operation go on.
extern "C" fn no_progress(_offset: u64, _total: u64, _arg: *mut std::ffi::c_void) -> c_int {
    0
}

/// librbd's version: (major, minor, extra); librbd 1.12 is Ceph 14 (Nautilus).
pub(crate) fn rbd_version(api: &Api) -> (i32, i32, i32) {
    let (mut major, mut minor, mut extra) = (0, 0, 0);
    // SAFETY: three valid out-pointers to ints.
    unsafe { (api.rbd_version)(&mut major, &mut minor, &mut extra) };
    (major, minor, extra)
}

/// A librados cluster handle; shut down when dropped (after every pool made from it, which
/// keep it alive).
pub(crate) struct Rados {
    api: &'static Api,
    handle: RadosT,
}

// SAFETY: a librados cluster handle is not tied to the thread that made it.
unsafe impl Send for Rados {}
// SAFETY: librados serialises concurrent calls on one cluster handle internally; the handle's
// configuration is set only before it is shared (`conf_set` before `connect`, by the owner).
unsafe impl Sync for Rados {}

impl std::fmt::Debug for Rados {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Rados")
    }
}

impl Rados {
    /// `rados_create2` for cluster "ceph" and entity `name` ("client.ID").
    pub(crate) fn create(api: &'static Api, name: &CStr) -> Result<Rados> {
        let mut handle = ptr::null_mut();
        // SAFETY: a valid out-pointer, two NUL-terminated strings that outlive the call, no flags.
        let ret = unsafe { (api.rados_create2)(&mut handle, c"ceph".as_ptr(), name.as_ptr(), 0) };
        check("rados_create2", ret)?;
        Ok(Rados { api, handle })
    }

    pub(crate) fn conf_set(&self, option: &CStr, value: &CStr) -> Result<()> {
        // SAFETY: a live handle and two NUL-terminated strings; librados copies the value.
        let ret =
            unsafe { (self.api.rados_conf_set)(self.handle, option.as_ptr(), value.as_ptr()) };
        check("rados_conf_set", ret).map(drop)
    }

    pub(crate) fn connect(&self) -> Result<()> {
        // SAFETY: a live, configured, not yet connected handle.
        let ret = unsafe { (self.api.rados_connect)(self.handle) };
        check("rados_connect", ret).map(drop)
    }

    pub(crate) fn cluster_stat(&self) -> Result<ClusterUsage> {
        let mut stat = RadosClusterStat::default();
        // SAFETY: a live, connected handle and a valid out-pointer of the header's struct.
        let ret = unsafe { (self.api.rados_cluster_stat)(self.handle, &mut stat) };
        check("rados_cluster_stat", ret)?;
        Ok(ClusterUsage {
            total_bytes: stat.kb.saturating_mul(1024),
            used_bytes: stat.kb_used.saturating_mul(1024),
            available_bytes: stat.kb_avail.saturating_mul(1024),
            objects: stat.num_objects,
        })
    }

    /// The pool's id, or ENOENT.
    pub(crate) fn pool_lookup(&self, name: &CStr) -> Result<i64> {
        // SAFETY: a live, connected handle and a NUL-terminated name.
        let ret = unsafe { (self.api.rados_pool_lookup)(self.handle, name.as_ptr()) };
        if ret < 0 {
            Err(Failure {
                call: "rados_pool_lookup",
                errno: i32::try_from(-ret).unwrap_or(0),
            })
        } else {
            Ok(ret)
        }
    }

    /// A monitor command (JSON); its output, or the failure and the monitor's status text.
    pub(crate) fn mon_command(
        &self,
        command: &CStr,
    ) -> std::result::Result<Vec<u8>, (Failure, String)> {
        let mut commands = [command.as_ptr()];
        let (mut out, mut out_len) = (ptr::null_mut::<c_char>(), 0usize);
        let (mut status, mut status_len) = (ptr::null_mut::<c_char>(), 0usize);
        // SAFETY: a live handle; one NUL-terminated command in an array that outlives the call;
        // no input buffer; valid out-pointers for the two buffers librados allocates.
        let ret = unsafe {
            (self.api.rados_mon_command)(
                self.handle,
                commands.as_mut_ptr(),
                1,
                ptr::null(),
                0,
                &mut out,
                &mut out_len,
                &mut status,
                &mut status_len,
            )
        };
        let output = self.take_buffer(out, out_len);
        let status = String::from_utf8_lossy(&self.take_buffer(status, status_len)).into_owned();
        if ret < 0 {
            Err((
                Failure {
                    call: "rados_mon_command",
                    errno: -ret,
                },
                status,
            ))
        } else {
            Ok(output)
        }
    }

    /// Copies out and frees a buffer librados allocated (null when it allocated none).
    fn take_buffer(&self, buffer: *mut c_char, len: usize) -> Vec<u8> {
        if buffer.is_null() {
            return Vec::new();
        }
        // SAFETY: librados allocated `buffer` with `len` bytes for this caller.
        let bytes = unsafe { std::slice::from_raw_parts(buffer.cast::<u8>(), len) }.to_vec();
        // SAFETY: the buffer came from librados, is freed once, and is not used after.
        unsafe { (self.api.rados_buffer_free)(buffer) };
        bytes
    }
}

impl Drop for Rados {
    fn drop(&mut self) {
        // SAFETY: the handle came from rados_create2 and is shut down once; every pool made from
        // it holds an `Arc<Rados>`, so none is open any more.
        unsafe { (self.api.rados_shutdown)(self.handle) };
    }
}

/// A librados I/O context on one pool; destroyed when dropped (after every image opened in
/// it, which keep it alive).
pub(crate) struct Ioctx {
    rados: Arc<Rados>,
    handle: RadosIoctxT,
}

// SAFETY: an I/O context is not tied to the thread that made it.
unsafe impl Send for Ioctx {}
// SAFETY: librados allows concurrent operations on one I/O context; what it does not allow
// concurrently (changing the context's snapshot, namespace or locator) this crate never does.
unsafe impl Sync for Ioctx {}

impl std::fmt::Debug for Ioctx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Ioctx")
    }
}

/// Options for `rbd_create4` and `rbd_clone3`.
pub(crate) struct ImageOpts {
    api: &'static Api,
    handle: RbdImageOptionsT,
}

impl ImageOpts {
    pub(crate) fn new(api: &'static Api) -> ImageOpts {
        let mut handle = ptr::null_mut();
        // SAFETY: a valid out-pointer; the options are destroyed in Drop.
        unsafe { (api.rbd_image_options_create)(&mut handle) };
        ImageOpts { api, handle }
    }

    pub(crate) fn features(&mut self, features: u64) -> Result<()> {
        self.set_u64(RBD_IMAGE_OPTION_FEATURES, features)
    }

    pub(crate) fn order(&mut self, order: u8) -> Result<()> {
        self.set_u64(RBD_IMAGE_OPTION_ORDER, u64::from(order))
    }

    pub(crate) fn data_pool(&mut self, pool: &CStr) -> Result<()> {
        // SAFETY: live options and a NUL-terminated value, which librbd copies.
        let ret = unsafe {
            (self.api.rbd_image_options_set_string)(
                self.handle,
                RBD_IMAGE_OPTION_DATA_POOL,
                pool.as_ptr(),
            )
        };
        check("rbd_image_options_set_string", ret).map(drop)
    }

    fn set_u64(&mut self, option: c_int, value: u64) -> Result<()> {
        // SAFETY: live options and an option number from librbd.h that takes a uint64.
        let ret = unsafe { (self.api.rbd_image_options_set_uint64)(self.handle, option, value) };
        check("rbd_image_options_set_uint64", ret).map(drop)
    }
}

impl Drop for ImageOpts {
    fn drop(&mut self) {
        // SAFETY: the options came from rbd_image_options_create and are destroyed once.
        unsafe { (self.api.rbd_image_options_destroy)(self.handle) };
    }
}

impl Ioctx {
    pub(crate) fn create(rados: &Arc<Rados>, pool: &CStr) -> Result<Ioctx> {
        let mut handle = ptr::null_mut();
        // SAFETY: a live, connected cluster handle, a NUL-terminated pool name, an out-pointer.
        let ret =
            unsafe { (rados.api.rados_ioctx_create)(rados.handle, pool.as_ptr(), &mut handle) };
        check("rados_ioctx_create", ret)?;
        Ok(Ioctx {
            rados: Arc::clone(rados),
            handle,
        })
    }

    fn api(&self) -> &'static Api {
        self.rados.api
    }

    pub(crate) fn rados(&self) -> &Arc<Rados> {
        &self.rados
    }

    pub(crate) fn pool_stat(&self) -> Result<PoolUsage> {
        let mut stat = RadosPoolStat::default();
        // SAFETY: a live I/O context and a valid out-pointer of the header's struct.
        let ret = unsafe { (self.api().rados_ioctx_pool_stat)(self.handle, &mut stat) };
        check("rados_ioctx_pool_stat", ret)?;
        Ok(PoolUsage {
            used_bytes: stat.num_bytes,
            objects: stat.num_objects,
        })
    }

    pub(crate) fn rbd_create(&self, name: &CStr, size: u64, opts: &ImageOpts) -> Result<()> {
        // SAFETY: a live I/O context, a NUL-terminated name and live options.
        let ret =
            unsafe { (self.api().rbd_create4)(self.handle, name.as_ptr(), size, opts.handle) };
        check("rbd_create4", ret).map(drop)
    }

    pub(crate) fn rbd_clone(
        &self,
        parent: &CStr,
        snapshot: &CStr,
        child_pool: &Ioctx,
        child: &CStr,
        opts: &ImageOpts,
    ) -> Result<()> {
        // SAFETY: two live I/O contexts, three NUL-terminated names and live options.
        let ret = unsafe {
            (self.api().rbd_clone3)(
                self.handle,
                parent.as_ptr(),
                snapshot.as_ptr(),
                child_pool.handle,
                child.as_ptr(),
                opts.handle,
            )
        };
        check("rbd_clone3", ret).map(drop)
    }

    pub(crate) fn rbd_remove(&self, name: &CStr) -> Result<()> {
        // SAFETY: a live I/O context and a NUL-terminated name.
        let ret = unsafe { (self.api().rbd_remove)(self.handle, name.as_ptr()) };
        check("rbd_remove", ret).map(drop)
    }

    pub(crate) fn rbd_list(&self) -> Result<Vec<ImageSpec>> {
        let api = self.api();
        list(
            "rbd_list2",
            // SAFETY: a live I/O context, a buffer of `*count` entries and the count's address.
            |buffer, count| unsafe { (api.rbd_list2)(self.handle, buffer, count) },
            |spec: &RbdImageSpec| ImageSpec {
                // SAFETY: librbd filled the entry with strings it owns until the cleanup.
                id: unsafe { string_at(spec.id) },
                // SAFETY: as above.
                name: unsafe { string_at(spec.name) },
            },
            // SAFETY: the `count` entries librbd filled, freed once.
            |buffer, count| unsafe { (api.rbd_image_spec_list_cleanup)(buffer, count) },
        )
    }

    pub(crate) fn trash_move(&self, name: &CStr, delay_seconds: u64) -> Result<()> {
        // SAFETY: a live I/O context and a NUL-terminated name.
        let ret = unsafe { (self.api().rbd_trash_move)(self.handle, name.as_ptr(), delay_seconds) };
        check("rbd_trash_move", ret).map(drop)
    }

    pub(crate) fn trash_list(&self) -> Result<Vec<TrashEntry>> {
        let api = self.api();
        list(
            "rbd_trash_list",
            // SAFETY: a live I/O context, a buffer of `*count` entries and the count's address.
            |buffer, count| unsafe { (api.rbd_trash_list)(self.handle, buffer, count) },
            |entry: &RbdTrashImageInfo| TrashEntry {
                // SAFETY: librbd filled the entry with strings it owns until the cleanup.
                id: unsafe { string_at(entry.id) },
                // SAFETY: as above.
                name: unsafe { string_at(entry.name) },
                // time_t is narrower than i64 on some targets.
                #[allow(clippy::unnecessary_cast)]
                deferred_until: entry.deferment_end_time as i64,
            },
            // SAFETY: the `count` entries librbd filled, freed once.
            |buffer, count| unsafe { (api.rbd_trash_list_cleanup)(buffer, count) },
        )
    }

    pub(crate) fn group_create(&self, group: &CStr) -> Result<()> {
        // SAFETY: a live I/O context and a NUL-terminated name.
        let ret = unsafe { (self.api().rbd_group_create)(self.handle, group.as_ptr()) };
        check("rbd_group_create", ret).map(drop)
    }

    pub(crate) fn group_remove(&self, group: &CStr) -> Result<()> {
        // SAFETY: a live I/O context and a NUL-terminated name.
        let ret = unsafe { (self.api().rbd_group_remove)(self.handle, group.as_ptr()) };
        check("rbd_group_remove", ret).map(drop)
    }

    /// Adds the image `image` of `image_pool` to the group.
    pub(crate) fn group_image_add(
        &self,
        group: &CStr,
        image_pool: &Ioctx,
        image: &CStr,
    ) -> Result<()> {
        // SAFETY: two live I/O contexts and two NUL-terminated names.
        let ret = unsafe {
            (self.api().rbd_group_image_add)(
                self.handle,
                group.as_ptr(),
                image_pool.handle,
                image.as_ptr(),
            )
        };
        check("rbd_group_image_add", ret).map(drop)
    }

    /// Cuts a snapshot of every image of the group at one instant, without quiescing their
    /// clients (crash-consistent).
    pub(crate) fn group_snap_create(&self, group: &CStr, snap: &CStr) -> Result<()> {
        // SAFETY: a live I/O context, two NUL-terminated names and a flag from librbd.h.
        let ret = unsafe {
            (self.api().rbd_group_snap_create2)(
                self.handle,
                group.as_ptr(),
                snap.as_ptr(),
                RBD_SNAP_CREATE_SKIP_QUIESCE,
            )
        };
        check("rbd_group_snap_create2", ret).map(drop)
    }

    pub(crate) fn trash_remove(&self, id: &CStr, force: bool) -> Result<()> {
        // SAFETY: a live I/O context and a NUL-terminated id.
        let ret = unsafe { (self.api().rbd_trash_remove)(self.handle, id.as_ptr(), force) };
        check("rbd_trash_remove", ret).map(drop)
    }
}

impl Drop for Ioctx {
    fn drop(&mut self) {
        // SAFETY: the context came from rados_ioctx_create and is destroyed once; every image
        // opened in it holds an `Arc<Ioctx>`, so none is open any more.
        unsafe { (self.api().rados_ioctx_destroy)(self.handle) };
    }
}

/// An open librbd image; closed when dropped or by [`RbdImage::close`].
pub(crate) struct RbdImage {
    ioctx: Arc<Ioctx>,
    handle: RbdImageT,
}

// SAFETY: an open image is not tied to the thread that opened it.
unsafe impl Send for RbdImage {}
// SAFETY: librbd guards an open image's state with the image's own locks (ImageCtx's
// owner_lock, image_lock, ...), and its synchronous I/O calls are its asynchronous ones plus a
// wait on a condition of the caller's (librbd/api/Io.cc: `rbd_read` is `aio_read` then
// `C_SaferCond::wait`), which QEMU's and rbd-nbd's servers make on one image from several
// threads at once. Every method here takes `&self` and passes only buffers the caller owns;
// `close` takes the image by value, so it cannot race another call.
unsafe impl Sync for RbdImage {}

impl std::fmt::Debug for RbdImage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RbdImage")
    }
}

impl RbdImage {
    /// `rbd_open` (or `rbd_open_read_only`), at the head or at a snapshot.
    pub(crate) fn open(
        ioctx: &Arc<Ioctx>,
        name: &CStr,
        snapshot: Option<&CStr>,
        read_only: bool,
    ) -> Result<RbdImage> {
        let api = ioctx.api();
        let snap = snapshot.map_or(ptr::null(), CStr::as_ptr);
        let mut handle = ptr::null_mut();
        let (call, ret) = if read_only {
            // SAFETY: a live I/O context, a NUL-terminated name, a NUL-terminated snapshot name
            // or null (the head), and an out-pointer.
            let ret =
                unsafe { (api.rbd_open_read_only)(ioctx.handle, name.as_ptr(), &mut handle, snap) };
            ("rbd_open_read_only", ret)
        } else {
            // SAFETY: as above.
            let ret = unsafe { (api.rbd_open)(ioctx.handle, name.as_ptr(), &mut handle, snap) };
            ("rbd_open", ret)
        };
        check(call, ret)?;
        Ok(RbdImage {
            ioctx: Arc::clone(ioctx),
            handle,
        })
    }

    fn api(&self) -> &'static Api {
        self.ioctx.api()
    }

    /// Closes the image, reporting a failure (Drop closes too, and ignores it).
    pub(crate) fn close(mut self) -> Result<()> {
        let handle = std::mem::replace(&mut self.handle, ptr::null_mut());
        // SAFETY: the image came from rbd_open and is closed once: Drop skips a null handle.
        let ret = unsafe { (self.api().rbd_close)(handle) };
        check("rbd_close", ret).map(drop)
    }

    pub(crate) fn stat(&self) -> Result<ImageInfo> {
        let mut info = RbdImageInfo::default();
        let size = std::mem::size_of::<RbdImageInfo>();
        // SAFETY: an open image, a valid out-pointer and its size.
        let ret = unsafe { (self.api().rbd_stat)(self.handle, &mut info, size) };
        check("rbd_stat", ret)?;
        Ok(ImageInfo {
            size: info.size,
            object_size: info.obj_size,
            objects: info.num_objs,
            order: u8::try_from(info.order).unwrap_or(0),
        })
    }

    pub(crate) fn features(&self) -> Result<u64> {
        let mut features = 0;
        // SAFETY: an open image and a valid out-pointer.
        let ret = unsafe { (self.api().rbd_get_features)(self.handle, &mut features) };
        check("rbd_get_features", ret)?;
        Ok(features)
    }

    pub(crate) fn id(&self) -> Result<String> {
        let mut len = 64;
        for _ in 0..LIST_ATTEMPTS {
            let mut buffer = vec![0 as c_char; len];
            // SAFETY: an open image and a writable buffer of `len` bytes.
            let ret = unsafe { (self.api().rbd_get_id)(self.handle, buffer.as_mut_ptr(), len) };
            if ret == -libc::ERANGE {
                len *= 4;
                continue;
            }
            check("rbd_get_id", ret)?;
            // librbd wrote a NUL-terminated id into the buffer.
            let bytes: Vec<u8> = buffer
                .iter()
                .take_while(|&&c| c != 0)
                .map(|&c| c as u8)
                .collect();
            return Ok(String::from_utf8_lossy(&bytes).into_owned());
        }
        Err(Failure {
            call: "rbd_get_id",
            errno: libc::ERANGE,
        })
    }

    /// `rbd_metadata_set`: an image's metadata key (librbd reads `conf_*` keys as the image's
    /// own configuration, its QoS limits among them).
    pub(crate) fn metadata_set(&self, key: &CStr, value: &CStr) -> Result<()> {
        // SAFETY: an open image and two NUL-terminated strings, which librbd copies.
        let ret =
            unsafe { (self.api().rbd_metadata_set)(self.handle, key.as_ptr(), value.as_ptr()) };
        check("rbd_metadata_set", ret).map(drop)
    }

    /// `rbd_metadata_remove`; a key that is not set is success.
    pub(crate) fn metadata_remove(&self, key: &CStr) -> Result<()> {
        // SAFETY: an open image and a NUL-terminated key.
        let ret = unsafe { (self.api().rbd_metadata_remove)(self.handle, key.as_ptr()) };
        if ret == -libc::ENOENT {
            return Ok(());
        }
        check("rbd_metadata_remove", ret).map(drop)
    }

    pub(crate) fn resize(&self, size: u64, allow_shrink: bool) -> Result<()> {
        // SAFETY: an open image; a progress callback that ignores its arguments (librbd calls
        // it without checking for null).
        let ret = unsafe {
            (self.api().rbd_resize2)(
                self.handle,
                size,
                allow_shrink,
                no_progress,
                ptr::null_mut(),
            )
        };
        check("rbd_resize2", ret).map(drop)
    }

    pub(crate) fn flatten(&self) -> Result<()> {
        // SAFETY: an open image.
        let ret = unsafe { (self.api().rbd_flatten)(self.handle) };
        check("rbd_flatten", ret).map(drop)
    }

    /// The image's parent, or None (librbd: ENOENT).
    pub(crate) fn parent(&self) -> Result<Option<Parent>> {
        let mut image = RbdLinkedImageSpec::default();
        let mut snap = RbdSnapSpec::default();
        // SAFETY: an open image and two valid out-pointers.
        let ret = unsafe { (self.api().rbd_get_parent)(self.handle, &mut image, &mut snap) };
        if ret == -libc::ENOENT {
            return Ok(None);
        }
        check("rbd_get_parent", ret)?;
        let parent = Parent {
            // SAFETY: librbd filled the spec with strings it owns until the cleanup below.
            image: unsafe { linked_image(&image) },
            // SAFETY: librbd filled the spec with a string it owns until the cleanup below.
            snapshot: unsafe { string_at(snap.name) },
            snapshot_id: snap.id,
        };
        // SAFETY: the spec librbd filled, freed once.
        unsafe { (self.api().rbd_linked_image_spec_cleanup)(&mut image) };
        // SAFETY: as above.
        unsafe { (self.api().rbd_snap_spec_cleanup)(&mut snap) };
        Ok(Some(parent))
    }

    /// The clones of this image: of the snapshot it is open at, or of all its snapshots when
    /// open at the head.
    pub(crate) fn children(&self) -> Result<Vec<LinkedImage>> {
        let api = self.api();
        list(
            "rbd_list_children3",
            // SAFETY: an open image, a buffer of `*count` entries and the count's address.
            |buffer, count| unsafe { (api.rbd_list_children3)(self.handle, buffer, count) },
            // SAFETY: librbd filled the entry with strings it owns until the cleanup.
            |spec| unsafe { linked_image(spec) },
            // SAFETY: the `count` entries librbd filled, freed once.
            |buffer, count| unsafe { (api.rbd_linked_image_spec_list_cleanup)(buffer, count) },
        )
    }

    pub(crate) fn snap_create(&self, name: &CStr) -> Result<()> {
        // SAFETY: an open image and a NUL-terminated name.
        let ret = unsafe { (self.api().rbd_snap_create)(self.handle, name.as_ptr()) };
        check("rbd_snap_create", ret).map(drop)
    }

    pub(crate) fn snap_remove(&self, name: &CStr) -> Result<()> {
        // SAFETY: an open image and a NUL-terminated name.
        let ret = unsafe { (self.api().rbd_snap_remove)(self.handle, name.as_ptr()) };
        check("rbd_snap_remove", ret).map(drop)
    }

    pub(crate) fn snap_protect(&self, name: &CStr) -> Result<()> {
        // SAFETY: an open image and a NUL-terminated name.
        let ret = unsafe { (self.api().rbd_snap_protect)(self.handle, name.as_ptr()) };
        check("rbd_snap_protect", ret).map(drop)
    }

    pub(crate) fn snap_unprotect(&self, name: &CStr) -> Result<()> {
        // SAFETY: an open image and a NUL-terminated name.
        let ret = unsafe { (self.api().rbd_snap_unprotect)(self.handle, name.as_ptr()) };
        check("rbd_snap_unprotect", ret).map(drop)
    }

    pub(crate) fn snap_is_protected(&self, name: &CStr) -> Result<bool> {
        let mut protected = 0;
        // SAFETY: an open image, a NUL-terminated name and a valid out-pointer.
        let ret = unsafe {
            (self.api().rbd_snap_is_protected)(self.handle, name.as_ptr(), &mut protected)
        };
        check("rbd_snap_is_protected", ret)?;
        Ok(protected != 0)
    }

    pub(crate) fn snap_list(&self) -> Result<Vec<SnapInfo>> {
        let api = self.api();
        // rbd_snap_list counts in an int, returns the number of snapshots, and needs room for
        // one more entry (its terminator, which rbd_snap_list_end stops at).
        let mut capacity: c_int = 16;
        for _ in 0..LIST_ATTEMPTS {
            let mut buffer: Vec<RbdSnapInfo> =
                (0..capacity).map(|_| RbdSnapInfo::default()).collect();
            let mut count = capacity;
            // SAFETY: an open image, a buffer of `count` entries and the count's address.
            let ret = unsafe { (api.rbd_snap_list)(self.handle, buffer.as_mut_ptr(), &mut count) };
            if ret == -libc::ERANGE {
                capacity = count.max(capacity.saturating_mul(2));
                continue;
            }
            let filled = usize::try_from(check("rbd_snap_list", ret)?).unwrap_or(0);
            let filled = filled.min(buffer.len().saturating_sub(1));
            let snaps = buffer[..filled]
                .iter()
                .map(|s| SnapInfo {
                    id: s.id,
                    size: s.size,
                    // SAFETY: librbd filled the entry with a string it owns until the end call.
                    name: unsafe { string_at(s.name) },
                })
                .collect();
            if filled > 0 {
                // SAFETY: the entries librbd filled (terminated by an entry with a null name),
                // freed once.
                unsafe { (api.rbd_snap_list_end)(buffer.as_mut_ptr()) };
            }
            return Ok(snaps);
        }
        Err(Failure {
            call: "rbd_snap_list",
            errno: libc::ERANGE,
        })
    }

    /// The group and group snapshot names of snapshot `id`, if it is in a group namespace.
    pub(crate) fn snap_group(&self, id: u64) -> Result<Option<(String, String)>> {
        let api = self.api();
        let mut kind: c_int = 0;
        // SAFETY: an open image and a valid out-pointer.
        let ret = unsafe { (api.rbd_snap_get_namespace_type)(self.handle, id, &mut kind) };
        check("rbd_snap_get_namespace_type", ret)?;
        if kind != RBD_SNAP_NAMESPACE_TYPE_GROUP {
            return Ok(None);
        }
        let mut ns = RbdSnapGroupNamespace::default();
        let size = std::mem::size_of::<RbdSnapGroupNamespace>();
        // SAFETY: an open image, a valid out-pointer of the header's struct and its size.
        let ret = unsafe { (api.rbd_snap_get_group_namespace)(self.handle, id, &mut ns, size) };
        check("rbd_snap_get_group_namespace", ret)?;
        // SAFETY: librbd filled the struct with strings it owns until the cleanup below.
        let group = unsafe { string_at(ns.group_name) };
        // SAFETY: as above.
        let snap = unsafe { string_at(ns.group_snap_name) };
        // SAFETY: the struct librbd filled, freed once.
        unsafe { (api.rbd_snap_group_namespace_cleanup)(&mut ns, size) };
        Ok(Some((group, snap)))
    }

    /// Reads at snapshot `id` (of any namespace) from now on.
    pub(crate) fn snap_set_by_id(&self, id: u64) -> Result<()> {
        // SAFETY: an open image; librbd checks the id.
        let ret = unsafe { (self.api().rbd_snap_set_by_id)(self.handle, id) };
        check("rbd_snap_set_by_id", ret).map(drop)
    }

    /// Copies the image as open (its head or a snapshot, without the other snapshots) into a
    /// new image `name` of `dest`, writing only what is not zero (in `sparse`-byte runs).
    pub(crate) fn copy(
        &self,
        dest: &Ioctx,
        name: &CStr,
        opts: &ImageOpts,
        sparse: usize,
    ) -> Result<()> {
        // SAFETY: an open image, a live I/O context, a NUL-terminated name and live options.
        let ret = unsafe {
            (self.api().rbd_copy4)(self.handle, dest.handle, name.as_ptr(), opts.handle, sparse)
        };
        check("rbd_copy4", ret).map(drop)
    }

    pub(crate) fn watchers(&self) -> Result<Vec<Watcher>> {
        let api = self.api();
        list(
            "rbd_watchers_list",
            // SAFETY: an open image, a buffer of `*count` entries and the count's address.
            |buffer, count| unsafe { (api.rbd_watchers_list)(self.handle, buffer, count) },
            |w: &RbdImageWatcher| Watcher {
                // SAFETY: librbd filled the entry with a string it owns until the cleanup.
                address: unsafe { string_at(w.addr) },
                client_id: w.id,
                cookie: w.cookie,
            },
            // SAFETY: the `count` entries librbd filled, freed once.
            |buffer, count| unsafe { (api.rbd_watchers_list_cleanup)(buffer, count) },
        )
    }

    pub(crate) fn lock_acquire(&self, mode: LockMode) -> Result<()> {
        let mode = match mode {
            LockMode::Exclusive => RBD_LOCK_MODE_EXCLUSIVE,
            LockMode::Shared => RBD_LOCK_MODE_SHARED,
        };
        // SAFETY: an open image and a lock mode from librbd.h.
        let ret = unsafe { (self.api().rbd_lock_acquire)(self.handle, mode) };
        check("rbd_lock_acquire", ret).map(drop)
    }

    pub(crate) fn lock_release(&self) -> Result<()> {
        // SAFETY: an open image.
        let ret = unsafe { (self.api().rbd_lock_release)(self.handle) };
        check("rbd_lock_release", ret).map(drop)
    }

    pub(crate) fn is_lock_owner(&self) -> Result<bool> {
        let mut owner = 0;
        // SAFETY: an open image and a valid out-pointer.
        let ret = unsafe { (self.api().rbd_is_exclusive_lock_owner)(self.handle, &mut owner) };
        check("rbd_is_exclusive_lock_owner", ret)?;
        Ok(owner != 0)
    }

    /// The lock's mode and owners; no owners (librbd: ENOENT) is an empty list.
    pub(crate) fn lock_owners(&self) -> Result<(LockMode, Vec<String>)> {
        let api = self.api();
        let mut capacity = 4;
        for _ in 0..LIST_ATTEMPTS {
            let mut owners: Vec<*mut c_char> = vec![ptr::null_mut(); capacity];
            let mut count = capacity;
            let mut mode: c_int = RBD_LOCK_MODE_EXCLUSIVE;
            // SAFETY: an open image, a valid out-pointer for the mode, a buffer of `count`
            // string pointers and the count's address.
            let ret = unsafe {
                (api.rbd_lock_get_owners)(self.handle, &mut mode, owners.as_mut_ptr(), &mut count)
            };
            if ret == -libc::ENOENT {
                return Ok((LockMode::Exclusive, Vec::new()));
            }
            if ret == -libc::ERANGE {
                capacity = count.max(capacity * 2);
                continue;
            }
            check("rbd_lock_get_owners", ret)?;
            let count = count.min(capacity);
            let names = owners[..count]
                .iter()
                // SAFETY: librbd filled the entries with strings it owns until the cleanup.
                .map(|&p| unsafe { string_at(p) })
                .collect();
            // SAFETY: the `count` strings librbd allocated, freed once.
            unsafe { (api.rbd_lock_get_owners_cleanup)(owners.as_mut_ptr(), count) };
            let mode = if mode == RBD_LOCK_MODE_SHARED {
                LockMode::Shared
            } else {
                LockMode::Exclusive
            };
            return Ok((mode, names));
        }
        Err(Failure {
            call: "rbd_lock_get_owners",
            errno: libc::ERANGE,
        })
    }
}

impl Drop for RbdImage {
    fn drop(&mut self) {
        if self.handle.is_null() {
            return;
        }
        // SAFETY: the image came from rbd_open and is closed once (`close` nulls the handle).
        unsafe { (self.api().rbd_close)(self.handle) };
    }
}

/// Copies a linked-image spec out.
///
/// # Safety
/// Every string pointer of `spec` is null or a NUL-terminated string valid during this call.
unsafe fn linked_image(spec: &RbdLinkedImageSpec) -> LinkedImage {
    LinkedImage {
        pool_id: spec.pool_id,
        // SAFETY: the caller's promise.
        pool: unsafe { string_at(spec.pool_name) },
        // SAFETY: as above.
        namespace: unsafe { string_at(spec.pool_namespace) },
        // SAFETY: as above.
        image: unsafe { string_at(spec.image_name) },
        // SAFETY: as above.
        image_id: unsafe { string_at(spec.image_id) },
        in_trash: spec.trash,
    }
}
