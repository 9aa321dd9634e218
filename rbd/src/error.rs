//! The crate's errors: each names the librados/librbd call that failed and its errno; the
//! cases a caller acts on (not found, exists, has snapshots, has clones, busy, lock held, …)
//! are variants of their own.

use std::fmt;

use crate::sys::{Failure, LoadError};

/// An errno returned by librados or librbd (positive).
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Errno(pub i32);

impl Errno {
    /// The symbolic name of the errnos Ceph returns most, or None.
    pub fn name(self) -> Option<&'static str> {
        Some(match self.0 {
            libc::EPERM => "EPERM",
            libc::ENOENT => "ENOENT",
            libc::EIO => "EIO",
            libc::EAGAIN => "EAGAIN",
            libc::EACCES => "EACCES",
            libc::EBUSY => "EBUSY",
            libc::EEXIST => "EEXIST",
            libc::EXDEV => "EXDEV",
            libc::EINVAL => "EINVAL",
            libc::EFBIG => "EFBIG",
            libc::ENOSPC => "ENOSPC",
            libc::EROFS => "EROFS",
            libc::EMLINK => "EMLINK",
            libc::ERANGE => "ERANGE",
            libc::ENOSYS => "ENOSYS",
            libc::ENOTEMPTY => "ENOTEMPTY",
            libc::ENOTSUP => "EOPNOTSUPP",
            libc::ETIMEDOUT => "ETIMEDOUT",
            // Also what Ceph returns to a client that has been blocklisted.
            libc::ESHUTDOWN => "ESHUTDOWN",
            libc::ENOTCONN => "ENOTCONN",
            libc::EDQUOT => "EDQUOT",
            _ => return None,
        })
    }
}

impl fmt::Display for Errno {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let text = std::io::Error::from_raw_os_error(self.0).to_string();
        // io::Error adds " (os error N)"; keep the text alone.
        let text = text.split(" (os error").next().unwrap_or(&text).to_owned();
        match self.name() {
            Some(name) => write!(f, "{name}: {text}"),
            None => write!(f, "errno {}: {text}", self.0),
        }
    }
}

impl fmt::Debug for Errno {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Errno({} {})", self.0, self.name().unwrap_or("?"))
    }
}

/// Everything this crate can fail with.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// librados or librbd cannot be loaded.
    #[error(
        "librbd not installed: {library} cannot be loaded ({reason}); the RBD backend needs \
         Ceph's client libraries (Debian and Ubuntu: apt install librbd1 librados2)"
    )]
    NotInstalled { library: String, reason: String },
    /// The installed library lacks a function this crate calls.
    #[error("{library} is too old: it has no {symbol} (Ceph 15 Octopus or later is needed)")]
    TooOld {
        library: String,
        symbol: &'static str,
    },
    /// A name or option given to this crate cannot be passed to Ceph.
    #[error("invalid {what}: {reason}")]
    Invalid { what: &'static str, reason: String },
    /// The cluster refused the credentials or the user lacks a capability.
    #[error("{call}: permission denied for {subject} ({errno})")]
    PermissionDenied {
        call: &'static str,
        subject: String,
        errno: Errno,
    },
    /// The cluster did not answer in time.
    #[error("{call}: timed out on {subject} ({errno})")]
    TimedOut {
        call: &'static str,
        subject: String,
        errno: Errno,
    },
    /// The pool, image or snapshot does not exist.
    #[error("{call}: {subject} not found ({errno})")]
    NotFound {
        call: &'static str,
        subject: String,
        errno: Errno,
    },
    /// An image or snapshot of this name exists.
    #[error("{call}: {subject} already exists ({errno})")]
    AlreadyExists {
        call: &'static str,
        subject: String,
        errno: Errno,
    },
    /// An image of this name exists with other properties than asked for.
    #[error("image {image} already exists with {existing}, not {requested}")]
    Conflict {
        image: String,
        existing: String,
        requested: String,
    },
    /// The image cannot be removed: it has snapshots (none of them cloned).
    #[error("{call}: image {image} has snapshots ({errno})")]
    HasSnapshots {
        call: &'static str,
        image: String,
        errno: Errno,
    },
    /// The image cannot be removed, or the snapshot unprotected: clones depend on it.
    #[error("{call}: {subject} has clones: {} ({errno})", clones.join(", "))]
    HasClones {
        call: &'static str,
        subject: String,
        clones: Vec<String>,
        errno: Errno,
    },
    /// The image is open elsewhere (watchers) or an operation on it is in progress.
    #[error(
        "{call}: image {image} is busy (watchers: {}) ({errno})",
        watchers_text(watchers)
    )]
    Busy {
        call: &'static str,
        image: String,
        watchers: Vec<String>,
        errno: Errno,
    },
    /// The snapshot is protected and cannot be removed.
    #[error("{call}: snapshot {snapshot} is protected ({errno})")]
    SnapshotProtected {
        call: &'static str,
        snapshot: String,
        errno: Errno,
    },
    /// Another client holds the image's exclusive lock.
    #[error("{call}: the lock of image {image} is held by another client ({errno})")]
    LockHeld {
        call: &'static str,
        image: String,
        errno: Errno,
    },
    /// A resize would shrink the image and shrinking was not allowed.
    #[error("image {image}: refusing to shrink from {current} to {requested} bytes")]
    WouldShrink {
        image: String,
        current: u64,
        requested: u64,
    },
    /// The pool is full or over its quota.
    #[error("{call}: no space in {subject} ({errno})")]
    NoSpace {
        call: &'static str,
        subject: String,
        errno: Errno,
    },
    /// A monitor command failed or answered something unreadable.
    #[error("monitor command {command}: {detail}")]
    MonCommand { command: String, detail: String },
    /// Any other failed call.
    #[error("{call} on {subject} failed: {errno}")]
    Call {
        call: &'static str,
        subject: String,
        errno: Errno,
    },
}

fn watchers_text(watchers: &[String]) -> String {
    if watchers.is_empty() {
        "none listed".to_owned()
    } else {
        watchers.join(", ")
    }
}

/// The crate's result.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// The failed call's errno, when a call failed.
    pub fn errno(&self) -> Option<i32> {
        match self {
            Error::PermissionDenied { errno, .. }
            | Error::TimedOut { errno, .. }
            | Error::NotFound { errno, .. }
            | Error::AlreadyExists { errno, .. }
            | Error::HasSnapshots { errno, .. }
            | Error::HasClones { errno, .. }
            | Error::Busy { errno, .. }
            | Error::SnapshotProtected { errno, .. }
            | Error::LockHeld { errno, .. }
            | Error::NoSpace { errno, .. }
            | Error::Call { errno, .. } => Some(errno.0),
            _ => None,
        }
    }

    /// The librados/librbd function that failed, when one did.
    pub fn call(&self) -> Option<&'static str> {
        match self {
            Error::PermissionDenied { call, .. }
            | Error::TimedOut { call, .. }
            | Error::NotFound { call, .. }
            | Error::AlreadyExists { call, .. }
            | Error::HasSnapshots { call, .. }
            | Error::HasClones { call, .. }
            | Error::Busy { call, .. }
            | Error::SnapshotProtected { call, .. }
            | Error::LockHeld { call, .. }
            | Error::NoSpace { call, .. }
            | Error::Call { call, .. } => Some(call),
            _ => None,
        }
    }

    /// The general meaning of a failed call on `subject` (e.g. "image moor/vol-1"): what the
    /// errno means whatever the call. Calls whose errnos mean more (remove, unprotect, lock)
    /// refine it where they are made.
    pub(crate) fn from_failure(failure: Failure, subject: impl Into<String>) -> Error {
        let Failure { call, errno } = failure;
        let subject = subject.into();
        let errno_ = Errno(errno);
        match errno {
            libc::ENOENT => Error::NotFound {
                call,
                subject,
                errno: errno_,
            },
            libc::EEXIST => Error::AlreadyExists {
                call,
                subject,
                errno: errno_,
            },
            libc::EACCES | libc::EPERM => Error::PermissionDenied {
                call,
                subject,
                errno: errno_,
            },
            libc::ETIMEDOUT => Error::TimedOut {
                call,
                subject,
                errno: errno_,
            },
            libc::ENOSPC | libc::EDQUOT => Error::NoSpace {
                call,
                subject,
                errno: errno_,
            },
            _ => Error::Call {
                call,
                subject,
                errno: errno_,
            },
        }
    }
}

impl From<LoadError> for Error {
    fn from(e: LoadError) -> Error {
        match e {
            LoadError::Missing { library, reason } => Error::NotInstalled { library, reason },
            LoadError::Symbol { library, symbol } => Error::TooOld { library, symbol },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn failure(call: &'static str, errno: i32) -> Failure {
        Failure { call, errno }
    }

    #[test]
    fn each_errno_maps_to_its_meaning_and_keeps_call_and_errno() {
        let e = Error::from_failure(failure("rbd_open", libc::ENOENT), "image moor/a");
        assert!(matches!(e, Error::NotFound { .. }), "{e:?}");
        assert_eq!(e.call(), Some("rbd_open"));
        assert_eq!(e.errno(), Some(libc::ENOENT));
        assert_eq!(
            e.to_string(),
            "rbd_open: image moor/a not found (ENOENT: No such file or directory)"
        );

        let e = Error::from_failure(failure("rbd_create4", libc::EEXIST), "image moor/a");
        assert!(matches!(e, Error::AlreadyExists { .. }), "{e:?}");
        let e = Error::from_failure(failure("rados_connect", libc::EACCES), "client.moor");
        assert!(matches!(e, Error::PermissionDenied { .. }), "{e:?}");
        let e = Error::from_failure(failure("rados_connect", libc::EPERM), "client.moor");
        assert!(matches!(e, Error::PermissionDenied { .. }), "{e:?}");
        let e = Error::from_failure(failure("rados_connect", libc::ETIMEDOUT), "client.moor");
        assert!(matches!(e, Error::TimedOut { .. }), "{e:?}");
        let e = Error::from_failure(failure("rbd_resize2", libc::EDQUOT), "image moor/a");
        assert!(matches!(e, Error::NoSpace { .. }), "{e:?}");
        let e = Error::from_failure(failure("rbd_flatten", libc::EIO), "image moor/a");
        assert!(matches!(e, Error::Call { .. }), "{e:?}");
        assert_eq!(e.errno(), Some(libc::EIO));
        assert_eq!(
            e.to_string(),
            "rbd_flatten on image moor/a failed: EIO: Input/output error"
        );
    }

    #[test]
    fn errno_display_names_it_or_shows_the_number() {
        assert_eq!(
            Errno(libc::EBUSY).to_string(),
            "EBUSY: Device or resource busy"
        );
        assert_eq!(
            Errno(libc::ENOTEMPTY).to_string(),
            "ENOTEMPTY: Directory not empty"
        );
        assert!(
            Errno(4000).to_string().starts_with("errno 4000: "),
            "{}",
            Errno(4000)
        );
    }

    #[test]
    fn remove_refusals_read_distinctly() {
        let errno = Errno(libc::ENOTEMPTY);
        let snaps = Error::HasSnapshots {
            call: "rbd_remove",
            image: "moor/a".into(),
            errno,
        };
        let clones = Error::HasClones {
            call: "rbd_remove",
            subject: "image moor/a".into(),
            clones: vec!["moor/b".into()],
            errno,
        };
        let busy = Error::Busy {
            call: "rbd_remove",
            image: "moor/a".into(),
            watchers: vec!["127.0.0.1:0/1 (client.4100)".into()],
            errno: Errno(libc::EBUSY),
        };
        assert!(snaps.to_string().contains("has snapshots"), "{snaps}");
        assert!(
            clones.to_string().contains("has clones: moor/b"),
            "{clones}"
        );
        assert!(
            busy.to_string().contains("busy (watchers: 127.0.0.1:0/1"),
            "{busy}"
        );
        for e in [&snaps, &clones, &busy] {
            assert_eq!(e.call(), Some("rbd_remove"));
        }
    }

    #[test]
    fn a_missing_library_says_librbd_is_not_installed() {
        let e = Error::from(LoadError::Missing {
            library: "librbd.so.1".into(),
            reason: "librbd.so.1: cannot open shared object file".into(),
        });
        let text = e.to_string();
        assert!(
            text.starts_with("librbd not installed: librbd.so.1 cannot be loaded"),
            "{text}"
        );
        assert!(text.contains("librbd1 librados2"), "{text}");
        let e = Error::from(LoadError::Symbol {
            library: "librbd.so.1".into(),
            symbol: "rbd_clone3",
        });
        assert!(e.to_string().contains("too old"), "{e}");
    }
}
