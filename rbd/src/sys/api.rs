//! librados and librbd, opened with dlopen on first use, and the table of their functions.
//!
//! Nothing links against Ceph: a binary built with this crate runs on a machine without Ceph's
//! libraries, and only the first use of the RBD backend reports that they are missing.

use std::ffi::{CString, c_char, c_int, c_void};
use std::sync::OnceLock;

use libloading::Library;

use super::types::*;

/// The sonames this crate opens (Debian packages librados2 and librbd1; Ceph 15 or later:
/// `rbd_group_snap_create2` came with Octopus).
pub(crate) const RADOS_LIBRARY: &str = "librados.so.2";
pub(crate) const RBD_LIBRARY: &str = "librbd.so.1";

/// Why the libraries could not be used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum LoadError {
    /// dlopen failed: the library is not installed (or not loadable).
    Missing { library: String, reason: String },
    /// The library lacks a function this crate calls: it is older than Ceph 15.
    Symbol {
        library: String,
        symbol: &'static str,
    },
}

macro_rules! api {
    ($(
        $lib:ident {
            $( fn $name:ident ( $( $arg:ty ),* ) $( -> $ret:ty )?; )*
        }
    )*) => {
        /// The functions of librados and librbd this crate calls, resolved once.
        pub(crate) struct Api {
            $($( pub(crate) $name: unsafe extern "C" fn( $( $arg ),* ) $( -> $ret )?, )*)*
            // The libraries stay loaded while the table lives (for the process, for the table
            // in `api()`), so the function pointers above stay valid.
            _rbd: Library,
            _rados: Library,
        }

        impl Api {
            /// Opens the two libraries by these file names and resolves every function.
            pub(crate) fn load_from(rados_file: &str, rbd_file: &str) -> Result<Api, LoadError> {
                // librbd first: it depends on librados, so when it loads, librados does too,
                // and a failure leaves nothing half-loaded.
                let rbd = open(rbd_file)?;
                let rados = open(rados_file)?;
                $($(
                    let (lib, file) = if stringify!($lib) == "rbd" {
                        (&rbd, rbd_file)
                    } else {
                        (&rados, rados_file)
                    };
                    let $name = resolve::<unsafe extern "C" fn( $( $arg ),* ) $( -> $ret )?>(
                        lib,
                        file,
                        stringify!($name),
                    )?;
                )*)*
                Ok(Api { $($( $name, )*)* _rbd: rbd, _rados: rados })
            }
        }
    };
}

api! {
    rados {
        fn rados_create2(*mut RadosT, *const c_char, *const c_char, u64) -> c_int;
        fn rados_conf_set(RadosT, *const c_char, *const c_char) -> c_int;
        fn rados_connect(RadosT) -> c_int;
        fn rados_shutdown(RadosT);
        fn rados_cluster_stat(RadosT, *mut RadosClusterStat) -> c_int;
        fn rados_pool_lookup(RadosT, *const c_char) -> i64;
        fn rados_mon_command(
            RadosT,
            *mut *const c_char,
            usize,
            *const c_char,
            usize,
            *mut *mut c_char,
            *mut usize,
            *mut *mut c_char,
            *mut usize
        ) -> c_int;
        fn rados_buffer_free(*mut c_char);
        fn rados_ioctx_create(RadosT, *const c_char, *mut RadosIoctxT) -> c_int;
        fn rados_ioctx_destroy(RadosIoctxT);
        fn rados_ioctx_pool_stat(RadosIoctxT, *mut RadosPoolStat) -> c_int;
        fn rados_get_instance_id(RadosT) -> u64;
        fn rados_wait_for_latest_osdmap(RadosT) -> c_int;
    }
    rbd {
        fn rbd_version(*mut c_int, *mut c_int, *mut c_int);
        fn rbd_image_options_create(*mut RbdImageOptionsT);
        fn rbd_image_options_destroy(RbdImageOptionsT);
        fn rbd_image_options_set_uint64(RbdImageOptionsT, c_int, u64) -> c_int;
        fn rbd_image_options_set_string(RbdImageOptionsT, c_int, *const c_char) -> c_int;
        fn rbd_create4(RadosIoctxT, *const c_char, u64, RbdImageOptionsT) -> c_int;
        fn rbd_clone3(
            RadosIoctxT,
            *const c_char,
            *const c_char,
            RadosIoctxT,
            *const c_char,
            RbdImageOptionsT
        ) -> c_int;
        fn rbd_remove(RadosIoctxT, *const c_char) -> c_int;
        fn rbd_list2(RadosIoctxT, *mut RbdImageSpec, *mut usize) -> c_int;
        fn rbd_image_spec_list_cleanup(*mut RbdImageSpec, usize);
        fn rbd_trash_move(RadosIoctxT, *const c_char, u64) -> c_int;
        fn rbd_trash_list(RadosIoctxT, *mut RbdTrashImageInfo, *mut usize) -> c_int;
        fn rbd_trash_list_cleanup(*mut RbdTrashImageInfo, usize);
        fn rbd_trash_remove(RadosIoctxT, *const c_char, bool) -> c_int;
        fn rbd_open(RadosIoctxT, *const c_char, *mut RbdImageT, *const c_char) -> c_int;
        fn rbd_open_read_only(RadosIoctxT, *const c_char, *mut RbdImageT, *const c_char) -> c_int;
        fn rbd_close(RbdImageT) -> c_int;
        fn rbd_stat(RbdImageT, *mut RbdImageInfo, usize) -> c_int;
        fn rbd_get_features(RbdImageT, *mut u64) -> c_int;
        fn rbd_get_id(RbdImageT, *mut c_char, usize) -> c_int;
        fn rbd_resize2(RbdImageT, u64, bool, ProgressFn, *mut c_void) -> c_int;
        fn rbd_metadata_set(RbdImageT, *const c_char, *const c_char) -> c_int;
        fn rbd_metadata_remove(RbdImageT, *const c_char) -> c_int;
        fn rbd_metadata_get(RbdImageT, *const c_char, *mut c_char, *mut usize) -> c_int;
        fn rbd_flatten(RbdImageT) -> c_int;
        fn rbd_get_parent(RbdImageT, *mut RbdLinkedImageSpec, *mut RbdSnapSpec) -> c_int;
        fn rbd_linked_image_spec_cleanup(*mut RbdLinkedImageSpec);
        fn rbd_linked_image_spec_list_cleanup(*mut RbdLinkedImageSpec, usize);
        fn rbd_snap_spec_cleanup(*mut RbdSnapSpec);
        fn rbd_list_children3(RbdImageT, *mut RbdLinkedImageSpec, *mut usize) -> c_int;
        fn rbd_snap_create(RbdImageT, *const c_char) -> c_int;
        fn rbd_snap_remove(RbdImageT, *const c_char) -> c_int;
        fn rbd_snap_list(RbdImageT, *mut RbdSnapInfo, *mut c_int) -> c_int;
        fn rbd_snap_list_end(*mut RbdSnapInfo);
        fn rbd_snap_protect(RbdImageT, *const c_char) -> c_int;
        fn rbd_snap_unprotect(RbdImageT, *const c_char) -> c_int;
        fn rbd_snap_is_protected(RbdImageT, *const c_char, *mut c_int) -> c_int;
        fn rbd_watchers_list(RbdImageT, *mut RbdImageWatcher, *mut usize) -> c_int;
        fn rbd_watchers_list_cleanup(*mut RbdImageWatcher, usize);
        fn rbd_lock_acquire(RbdImageT, c_int) -> c_int;
        fn rbd_lock_release(RbdImageT) -> c_int;
        fn rbd_lock_get_owners(RbdImageT, *mut c_int, *mut *mut c_char, *mut usize) -> c_int;
        fn rbd_lock_get_owners_cleanup(*mut *mut c_char, usize);
        fn rbd_is_exclusive_lock_owner(RbdImageT, *mut c_int) -> c_int;
        fn rbd_open_by_id(RadosIoctxT, *const c_char, *mut RbdImageT, *const c_char) -> c_int;
        fn rbd_open_by_id_read_only(
            RadosIoctxT,
            *const c_char,
            *mut RbdImageT,
            *const c_char
        ) -> c_int;
        fn rbd_pool_metadata_get(RadosIoctxT, *const c_char, *mut c_char, *mut usize) -> c_int;
        fn rbd_pool_metadata_set(RadosIoctxT, *const c_char, *const c_char) -> c_int;
        fn rbd_pool_metadata_remove(RadosIoctxT, *const c_char) -> c_int;
        fn rbd_pool_metadata_list(
            RadosIoctxT,
            *const c_char,
            u64,
            *mut c_char,
            *mut usize,
            *mut c_char,
            *mut usize
        ) -> c_int;
        fn rbd_list_lockers(
            RbdImageT,
            *mut c_int,
            *mut c_char,
            *mut usize,
            *mut c_char,
            *mut usize,
            *mut c_char,
            *mut usize,
            *mut c_char,
            *mut usize
        ) -> isize;
        fn rbd_break_lock(RbdImageT, *const c_char, *const c_char) -> c_int;
        fn rbd_write(RbdImageT, u64, usize, *const c_char) -> isize;
        fn rbd_read(RbdImageT, u64, usize, *mut c_char) -> isize;
        fn rbd_flush(RbdImageT) -> c_int;
        fn rbd_group_create(RadosIoctxT, *const c_char) -> c_int;
        fn rbd_group_remove(RadosIoctxT, *const c_char) -> c_int;
        fn rbd_group_image_add(RadosIoctxT, *const c_char, RadosIoctxT, *const c_char) -> c_int;
        fn rbd_group_snap_create2(RadosIoctxT, *const c_char, *const c_char, u32) -> c_int;
        fn rbd_snap_get_namespace_type(RbdImageT, u64, *mut c_int) -> c_int;
        fn rbd_snap_get_group_namespace(RbdImageT, u64, *mut RbdSnapGroupNamespace, usize) -> c_int;
        fn rbd_snap_group_namespace_cleanup(*mut RbdSnapGroupNamespace, usize) -> c_int;
        fn rbd_snap_set_by_id(RbdImageT, u64) -> c_int;
        fn rbd_copy4(RbdImageT, RadosIoctxT, *const c_char, RbdImageOptionsT, usize) -> c_int;
        fn rbd_diff_iterate2(
            RbdImageT,
            *const c_char,
            u64,
            u64,
            u8,
            c_int,
            DiffFn,
            *mut c_void
        ) -> c_int;
    }
}

impl std::fmt::Debug for Api {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Api(librados, librbd)")
    }
}

fn open(file: &str) -> Result<Library, LoadError> {
    let flags = libloading::os::unix::RTLD_NOW | libloading::os::unix::RTLD_LOCAL;
    // SAFETY: opening librados or librbd runs their initialisers (C++ static constructors),
    // which need nothing from the caller; the library is never closed while a pointer from it
    // is in use (see `Api`).
    let opened = unsafe { libloading::os::unix::Library::open(Some(file), flags) };
    opened.map(Library::from).map_err(|e| LoadError::Missing {
        library: file.to_owned(),
        reason: chain(&e),
    })
}

/// An error and its sources ("dlopen failed: libx.so: cannot open shared object file: ...").
fn chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

fn resolve<T: Copy>(lib: &Library, file: &str, name: &'static str) -> Result<T, LoadError> {
    let symbol = CString::new(name).expect("a function name has no NUL byte");
    // SAFETY: `T` is the function-pointer type of `name` as librados.h / librbd.h declare it
    // (the table above is written from those headers), and the pointer copied out is used
    // only through `Api`, which owns `lib`, so it never outlives the library.
    let found = unsafe { lib.get::<T>(symbol.as_bytes_with_nul()) };
    found.map(|s| *s).map_err(|_| LoadError::Symbol {
        library: file.to_owned(),
        symbol: name,
    })
}

/// The process's table, loaded on first use; a failure is remembered (installing Ceph's
/// libraries takes a restart of the process).
pub(crate) fn api() -> Result<&'static Api, LoadError> {
    static API: OnceLock<Result<Api, LoadError>> = OnceLock::new();
    API.get_or_init(|| Api::load_from(RADOS_LIBRARY, RBD_LIBRARY))
        .as_ref()
        .map_err(Clone::clone)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_library_is_named_and_nothing_is_resolved() {
        let Err(e) = Api::load_from("librados-not-here.so.2", "librbd-not-here.so.1") else {
            panic!("loaded libraries that do not exist");
        };
        let LoadError::Missing { library, reason } = &e else {
            panic!("{e:?}")
        };
        assert_eq!(library, "librbd-not-here.so.1");
        assert!(reason.contains("librbd-not-here.so.1"), "{reason}");
        let text = crate::Error::from(e).to_string();
        assert!(
            text.starts_with("librbd not installed: librbd-not-here.so.1"),
            "{text}"
        );
    }

    #[test]
    fn a_library_without_cephs_functions_is_too_old_naming_the_function() {
        // libc loads but has none of the functions.
        let Err(e) = Api::load_from("libc.so.6", "libc.so.6") else {
            panic!("libc is not librbd")
        };
        assert_eq!(
            e,
            LoadError::Symbol {
                library: "libc.so.6".into(),
                symbol: "rados_create2"
            }
        );
    }

    #[test]
    fn the_installed_libraries_load_when_present() {
        match Api::load_from(RADOS_LIBRARY, RBD_LIBRARY) {
            Ok(api) => {
                let (major, minor, _) = crate::sys::rbd_version(&api);
                assert!((major, minor) >= (1, 12), "librbd {major}.{minor}");
            }
            Err(LoadError::Missing { .. }) => eprintln!("skipped: {RBD_LIBRARY} not installed"),
            Err(e) => panic!("{e:?}"),
        }
    }
}
