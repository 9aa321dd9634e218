//! `rbd_diff_iterate2`: the extents of an image (at the snapshot it is open at) that differ
//! from an older snapshot of it, or that hold data at all. librbd calls back into Rust for each
//! extent, one at a time and in order, possibly on a thread of its own while the calling thread
//! waits in the call; the callback is a trampoline that runs a Rust closure (`Send`, for that
//! thread) and never lets a panic cross into C.

use std::ffi::{CStr, c_int, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::ptr;

use super::{RbdImage, Result, check};

/// What the closure answers for one extent: go on, or stop.
pub(crate) type Step = std::ops::ControlFlow<()>;

/// The closure and what stopped it.
struct Walk<'a> {
    each: &'a mut (dyn FnMut(u64, u64, bool) -> Step + Send),
    /// The closure stopped the walk (librbd may still deliver extents it had in hand: they
    /// are not passed on).
    stopped: bool,
    panicked: bool,
}

/// A value librbd passes back to stop: not an errno it uses (ECANCELED).
const STOPPED: c_int = -libc::ECANCELED;

unsafe extern "C" fn trampoline(offset: u64, len: usize, exists: c_int, arg: *mut c_void) -> c_int {
    // SAFETY: `arg` is the `Walk` that `diff_iterate` passed, alive for the whole of the
    // rbd_diff_iterate2 call; librbd calls back one extent at a time (its ordered throttle)
    // while the caller waits in that call, so no other reference to it is in use meanwhile.
    let walk = unsafe { &mut *arg.cast::<Walk<'_>>() };
    if walk.stopped {
        return STOPPED;
    }
    walk.stopped = true;
    match catch_unwind(AssertUnwindSafe(|| {
        (walk.each)(offset, len as u64, exists != 0)
    })) {
        Ok(Step::Continue(())) => {
            walk.stopped = false;
            0
        }
        Ok(Step::Break(())) => STOPPED,
        Err(_) => {
            walk.panicked = true;
            STOPPED
        }
    }
}

impl RbdImage {
    /// Calls `each(offset, length, exists)` for the extents of `[offset, offset + len)` that
    /// changed since `from` (None: that hold data), in order; `exists` is false for an extent
    /// that was discarded. The parent's data counts when `include_parent`. Returns whether the
    /// closure stopped the walk.
    pub(crate) fn diff_iterate(
        &self,
        from: Option<&CStr>,
        offset: u64,
        len: u64,
        include_parent: bool,
        each: &mut (dyn FnMut(u64, u64, bool) -> Step + Send),
    ) -> Result<bool> {
        let mut walk = Walk {
            each,
            stopped: false,
            panicked: false,
        };
        // SAFETY: an open image; `from` is NUL-terminated or null; the callback is the
        // trampoline above and its argument the `walk` that outlives the call.
        let ret = unsafe {
            (self.api().rbd_diff_iterate2)(
                self.handle,
                from.map_or(ptr::null(), CStr::as_ptr),
                offset,
                len,
                u8::from(include_parent),
                0,
                trampoline,
                ptr::from_mut(&mut walk).cast::<c_void>(),
            )
        };
        if walk.panicked {
            std::panic::resume_unwind(Box::new("the diff callback panicked"));
        }
        if walk.stopped {
            return Ok(true);
        }
        check("rbd_diff_iterate2", ret).map(|_| false)
    }
}
