//! The C types of librados.h and librbd.h (Ceph 15 and later) that the calls here exchange.

use std::ffi::{c_char, c_int, c_void};
use std::ptr;

pub(crate) type RadosT = *mut c_void;
pub(crate) type RadosIoctxT = *mut c_void;
pub(crate) type RbdImageT = *mut c_void;
pub(crate) type RbdImageOptionsT = *mut c_void;
/// `librbd_progress_fn_t`. librbd calls it unconditionally: never pass a null one.
pub(crate) type ProgressFn = unsafe extern "C" fn(u64, u64, *mut c_void) -> c_int;
/// The callback of `rbd_diff_iterate2`: (offset, length, exists, argument); a nonzero return
/// stops the iteration, which then returns it.
pub(crate) type DiffFn = unsafe extern "C" fn(u64, usize, c_int, *mut c_void) -> c_int;

/// `RBD_IMAGE_OPTION_*`.
pub(crate) const RBD_IMAGE_OPTION_FEATURES: c_int = 1;
pub(crate) const RBD_IMAGE_OPTION_ORDER: c_int = 2;
pub(crate) const RBD_IMAGE_OPTION_DATA_POOL: c_int = 10;

/// `RBD_LOCK_MODE_EXCLUSIVE`, `RBD_LOCK_MODE_SHARED`.
pub(crate) const RBD_LOCK_MODE_EXCLUSIVE: c_int = 0;
pub(crate) const RBD_LOCK_MODE_SHARED: c_int = 1;

/// `RBD_SNAP_CREATE_SKIP_QUIESCE`: no quiesce notification to the image's clients (krbd
/// answers them with EOPNOTSUPP); writes are still held while the snapshot is cut.
pub(crate) const RBD_SNAP_CREATE_SKIP_QUIESCE: u32 = 1;

/// `RBD_SNAP_NAMESPACE_TYPE_GROUP`.
pub(crate) const RBD_SNAP_NAMESPACE_TYPE_GROUP: c_int = 1;

/// `rbd_snap_group_namespace_t`.
#[repr(C)]
#[derive(Debug)]
pub(crate) struct RbdSnapGroupNamespace {
    pub group_pool: i64,
    pub group_name: *mut c_char,
    pub group_snap_name: *mut c_char,
}

impl Default for RbdSnapGroupNamespace {
    fn default() -> Self {
        Self {
            group_pool: 0,
            group_name: ptr::null_mut(),
            group_snap_name: ptr::null_mut(),
        }
    }
}

/// `struct rados_pool_stat_t`.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct RadosPoolStat {
    pub num_bytes: u64,
    pub num_kb: u64,
    pub num_objects: u64,
    pub num_object_clones: u64,
    pub num_object_copies: u64,
    pub num_objects_missing_on_primary: u64,
    pub num_objects_unfound: u64,
    pub num_objects_degraded: u64,
    pub num_rd: u64,
    pub num_rd_kb: u64,
    pub num_wr: u64,
    pub num_wr_kb: u64,
    pub num_user_bytes: u64,
    pub compressed_bytes_orig: u64,
    pub compressed_bytes: u64,
    pub compressed_bytes_alloc: u64,
}

/// `struct rados_cluster_stat_t`.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct RadosClusterStat {
    pub kb: u64,
    pub kb_used: u64,
    pub kb_avail: u64,
    pub num_objects: u64,
}

/// `rbd_image_spec_t`.
#[repr(C)]
#[derive(Debug)]
pub(crate) struct RbdImageSpec {
    pub id: *mut c_char,
    pub name: *mut c_char,
}

impl Default for RbdImageSpec {
    fn default() -> Self {
        Self {
            id: ptr::null_mut(),
            name: ptr::null_mut(),
        }
    }
}

/// `rbd_linked_image_spec_t`.
#[repr(C)]
#[derive(Debug)]
pub(crate) struct RbdLinkedImageSpec {
    pub pool_id: i64,
    pub pool_name: *mut c_char,
    pub pool_namespace: *mut c_char,
    pub image_id: *mut c_char,
    pub image_name: *mut c_char,
    pub trash: bool,
}

impl Default for RbdLinkedImageSpec {
    fn default() -> Self {
        Self {
            pool_id: 0,
            pool_name: ptr::null_mut(),
            pool_namespace: ptr::null_mut(),
            image_id: ptr::null_mut(),
            image_name: ptr::null_mut(),
            trash: false,
        }
    }
}

/// `rbd_snap_spec_t`.
#[repr(C)]
#[derive(Debug)]
pub(crate) struct RbdSnapSpec {
    pub id: u64,
    pub namespace_type: c_int,
    pub name: *mut c_char,
}

impl Default for RbdSnapSpec {
    fn default() -> Self {
        Self {
            id: 0,
            namespace_type: 0,
            name: ptr::null_mut(),
        }
    }
}

/// `rbd_snap_info_t`.
#[repr(C)]
#[derive(Debug)]
pub(crate) struct RbdSnapInfo {
    pub id: u64,
    pub size: u64,
    pub name: *const c_char,
}

impl Default for RbdSnapInfo {
    fn default() -> Self {
        Self {
            id: 0,
            size: 0,
            name: ptr::null(),
        }
    }
}

/// `rbd_image_info_t`.
#[repr(C)]
#[derive(Debug)]
pub(crate) struct RbdImageInfo {
    pub size: u64,
    pub obj_size: u64,
    pub num_objs: u64,
    pub order: c_int,
    pub block_name_prefix: [c_char; 24],
    pub parent_pool: i64,
    pub parent_name: [c_char; 96],
}

impl Default for RbdImageInfo {
    fn default() -> Self {
        Self {
            size: 0,
            obj_size: 0,
            num_objs: 0,
            order: 0,
            block_name_prefix: [0; 24],
            parent_pool: 0,
            parent_name: [0; 96],
        }
    }
}

/// `rbd_trash_image_info_t`.
#[repr(C)]
#[derive(Debug)]
pub(crate) struct RbdTrashImageInfo {
    pub id: *mut c_char,
    pub name: *mut c_char,
    pub source: c_int,
    pub deletion_time: libc::time_t,
    pub deferment_end_time: libc::time_t,
}

impl Default for RbdTrashImageInfo {
    fn default() -> Self {
        Self {
            id: ptr::null_mut(),
            name: ptr::null_mut(),
            source: 0,
            deletion_time: 0,
            deferment_end_time: 0,
        }
    }
}

/// `rbd_image_watcher_t`.
#[repr(C)]
#[derive(Debug)]
pub(crate) struct RbdImageWatcher {
    pub addr: *mut c_char,
    pub id: i64,
    pub cookie: u64,
}

impl Default for RbdImageWatcher {
    fn default() -> Self {
        Self {
            addr: ptr::null_mut(),
            id: 0,
            cookie: 0,
        }
    }
}
