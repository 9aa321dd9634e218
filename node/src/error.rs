//! The node's errors and their one mapping to gRPC status codes.
//!
//! Every condition the CSI spec names has its own variant and its own code; only failures of
//! the OS or of tools that the spec does not name become INTERNAL.

use tonic::{Code, Status};

use crate::attach::AttachError;
use crate::journal::JournalError;
use crate::mount_options::OptionError;
use crate::sys::discovery::DiscoveryError;
use crate::sys::{OwnershipError, SysError, ToolError};

/// Everything a Node or Identity RPC can fail with.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A request field is missing or malformed.
    #[error("{field}: {reason}")]
    InvalidArgument {
        /// The field, as the proto names it.
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// A mount option was refused.
    #[error("volume_capability.mount.mount_flags: {0}")]
    MountOption(#[from] OptionError),
    /// Another operation on the same volume is in flight.
    #[error("an operation on volume {0:?} is already in progress; retry later")]
    OperationPending(String),
    /// The volume (its device, or the path it should be at) does not exist.
    #[error("volume {volume:?} not found: {reason}")]
    VolumeNotFound {
        /// The volume id.
        volume: String,
        /// What was looked for.
        reason: String,
    },
    /// The volume is already staged/published at that path, incompatibly with this request.
    #[error("volume {volume:?} is already {what} with different arguments: {reason}")]
    Incompatible {
        /// The volume id.
        volume: String,
        /// "staged" or "published".
        what: &'static str,
        /// What differs.
        reason: String,
    },
    /// The request asks for something the volume or the node cannot do.
    #[error("{0}")]
    FailedPrecondition(String),
    /// The device holds data that is not the requested filesystem: never formatted.
    #[error("device {device} holds {content}; refusing to format or mount it as {fs_type}")]
    DeviceNotBlank {
        /// The device.
        device: String,
        /// What the probe found.
        content: String,
        /// What was asked for.
        fs_type: String,
    },
    /// Requested capacity cannot be satisfied.
    #[error("{0}")]
    OutOfRange(String),
    /// The node has as many volumes as it may.
    #[error("the node already has {0} volumes staged, the most it takes")]
    TooManyVolumes(u64),
    /// The plugin cannot serve now (e.g. a required tool is missing).
    #[error("{0}")]
    Unavailable(String),
    /// A tool ran past its deadline.
    #[error(transparent)]
    ToolTimeout(ToolError),
    /// An unmount ran past its deadline; it goes on in the kernel.
    #[error(
        "the unmount of {} did not finish within {deadline:?}: the filesystem is still writing \
         back to a device that does not answer (its cluster unreachable?); it goes on, and a \
         retry finishes the unstage once it ends",
        path.display()
    )]
    UnmountTimeout {
        /// The mount point.
        path: std::path::PathBuf,
        /// The deadline.
        deadline: std::time::Duration,
    },
    /// The OS refused an operation the spec has no code for.
    #[error(transparent)]
    Sys(#[from] SysError),
    /// A tool failed.
    #[error(transparent)]
    Tool(ToolError),
    /// The node's own records could not be written.
    #[error("node journal: {0}")]
    Journal(#[from] JournalError),
    /// Giving the volume to the pod's group (volume_mount_group) ran past its deadline, or met
    /// a tree it cannot walk. (Its OS failures are [`Error::Sys`].)
    #[error(transparent)]
    Ownership(OwnershipError),
    /// The volume's device could not be found by its identity.
    #[error(transparent)]
    Discovery(#[from] DiscoveryError),
    /// An RBD image could not be mapped or unmapped.
    #[error(transparent)]
    Attach(#[from] AttachError),
    /// A step failed, and undoing what came before it failed too: the answer is the first
    /// cause (its code, its words first), the cleanup's failure named beside it.
    #[error("{first} (undoing what it had done failed too: {cleanup})")]
    CleanupFailed { first: Box<Error>, cleanup: String },
}

impl From<ToolError> for Error {
    fn from(e: ToolError) -> Self {
        match e {
            ToolError::Timeout { .. } => Error::ToolTimeout(e),
            e => Error::Tool(e),
        }
    }
}

impl From<OwnershipError> for Error {
    fn from(e: OwnershipError) -> Self {
        match e {
            OwnershipError::Sys(e) => Error::Sys(e),
            e => Error::Ownership(e),
        }
    }
}

impl Error {
    /// A missing or malformed field.
    pub fn invalid(field: &'static str, reason: impl Into<String>) -> Self {
        Error::InvalidArgument {
            field,
            reason: reason.into(),
        }
    }

    /// The gRPC code for this error.
    pub fn code(&self) -> Code {
        match self {
            Error::InvalidArgument { .. } | Error::MountOption(_) => Code::InvalidArgument,
            Error::OperationPending(_) => Code::Aborted,
            Error::VolumeNotFound { .. } => Code::NotFound,
            Error::Incompatible { .. } => Code::AlreadyExists,
            Error::FailedPrecondition(_) | Error::DeviceNotBlank { .. } => Code::FailedPrecondition,
            Error::OutOfRange(_) => Code::OutOfRange,
            Error::TooManyVolumes(_) => Code::ResourceExhausted,
            Error::Unavailable(_) => Code::Unavailable,
            Error::ToolTimeout(_) | Error::UnmountTimeout { .. } => Code::DeadlineExceeded,
            // A symlink in a path below the kubelet dir, or a path that leads out of it: the
            // node's state is not what the call needs, not a fault of moor's.
            Error::Sys(e) if matches!(e.errno(), Some(libc::ELOOP | libc::EXDEV)) => {
                Code::FailedPrecondition
            }
            Error::Sys(_) | Error::Tool(_) | Error::Journal(_) => Code::Internal,
            Error::Ownership(e) => match e {
                OwnershipError::Deadline { .. } => Code::DeadlineExceeded,
                OwnershipError::TooDeep { .. } => Code::FailedPrecondition,
                OwnershipError::Sys(_) => Code::Internal,
            },
            Error::Discovery(e) => match e {
                DiscoveryError::Deadline { .. } => Code::DeadlineExceeded,
                DiscoveryError::NoEventSource { .. } | DiscoveryError::Enumerate(_) => {
                    Code::Unavailable
                }
                DiscoveryError::NotPresent { .. } => Code::NotFound,
                DiscoveryError::Poll(_) => Code::Internal,
            },
            Error::Attach(e) => e.code(),
            Error::CleanupFailed { first, .. } => first.code(),
        }
    }

    /// `self`, the first cause, with the failure of the cleanup after it (`what`, `cleanup`)
    /// logged beside it and named in its message; its code stays the first cause's.
    pub fn with_cleanup_failure(
        self,
        volume: &str,
        what: &str,
        cleanup: &dyn std::fmt::Display,
    ) -> Self {
        tracing::warn!(volume, error = %self, cleanup = what, cleanup_error = %cleanup,
            "a cleanup after a failure failed too; answering the first cause");
        Error::CleanupFailed {
            first: Box::new(self),
            cleanup: format!("{what}: {cleanup}"),
        }
    }
}

impl From<Error> for Status {
    fn from(e: Error) -> Self {
        Status::new(e.code(), e.to_string())
    }
}

/// Result of an engine operation.
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_follow_the_spec_names() {
        assert_eq!(
            Error::invalid("volume_id", "missing").code(),
            Code::InvalidArgument
        );
        assert_eq!(Error::OperationPending("v".into()).code(), Code::Aborted);
        let s: Status = Error::Incompatible {
            volume: "v".into(),
            what: "published",
            reason: "read-only differs".into(),
        }
        .into();
        assert_eq!(s.code(), Code::AlreadyExists);
        assert!(s.message().contains("read-only differs"));
    }

    #[test]
    fn a_group_walk_maps_like_the_rest() {
        let deadline: Error = OwnershipError::Deadline {
            path: "/k/v".into(),
            gid: 5,
            deadline: std::time::Duration::from_secs(1),
            entries: 3,
        }
        .into();
        assert_eq!(deadline.code(), Code::DeadlineExceeded);
        let deep: Error = OwnershipError::TooDeep {
            path: "/k/v".into(),
        }
        .into();
        assert_eq!(deep.code(), Code::FailedPrecondition);
        // An OS failure is one like any other: a symlink in the path is the node's state.
        let sys = SysError::new(
            "open",
            std::path::Path::new("/k/v"),
            std::io::Error::from_raw_os_error(libc::ELOOP),
        );
        let e: Error = OwnershipError::Sys(sys).into();
        assert!(matches!(e, Error::Sys(_)));
        assert_eq!(e.code(), Code::FailedPrecondition);
    }
}
