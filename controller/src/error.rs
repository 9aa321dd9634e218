//! The controller's errors and their one mapping to gRPC status codes.
//!
//! Every condition the CSI spec names in an error table has its own variant and gets exactly
//! the code the spec gives it; only failures the spec has no row for (the OS refusing, a record
//! that cannot be written) become INTERNAL.

use tonic::{Code, Status};

/// Everything a Controller or Identity RPC can fail with.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A request field is missing, malformed or not supported.
    #[error("{field}: {reason}")]
    InvalidArgument {
        /// The field, as the proto names it.
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// No volume has this id.
    #[error("volume {0:?} does not exist")]
    VolumeNotFound(String),
    /// No snapshot has this id.
    #[error("snapshot {0:?} does not exist")]
    SnapshotNotFound(String),
    /// The content source of a new volume does not exist.
    #[error("volume_content_source: {kind} {id:?} does not exist")]
    SourceNotFound {
        /// "snapshot" or "volume".
        kind: &'static str,
        /// The source's id.
        id: String,
    },
    /// The node is not one this backend can publish to.
    #[error("node {node:?} does not exist: this controller attaches volumes to {serves:?} only")]
    NodeNotFound {
        /// The node asked for.
        node: String,
        /// The node the backend serves.
        serves: String,
    },
    /// The object lives on another node: a node-local controller serves its own node's only.
    #[error("{kind} {id} lives on node {node:?}; this controller serves node {here:?}")]
    OnOtherNode {
        /// "volume", "snapshot" or "group snapshot".
        kind: &'static str,
        /// The id asked for.
        id: String,
        /// The node it names.
        node: String,
        /// The node this controller serves.
        here: String,
    },
    /// A volume with this name exists but does not match the request.
    #[error("a volume named {name:?} already exists ({id}) and is incompatible: {reason}")]
    VolumeExists {
        /// The request's name.
        name: String,
        /// The existing volume.
        id: String,
        /// What differs.
        reason: String,
    },
    /// A snapshot with this name exists but does not match the request.
    #[error("a snapshot named {name:?} already exists ({id}) and is incompatible: {reason}")]
    SnapshotExists {
        /// The request's name.
        name: String,
        /// The existing snapshot.
        id: String,
        /// What differs.
        reason: String,
    },
    /// A group snapshot with this name exists but does not match the request.
    #[error("a group snapshot named {name:?} already exists ({id}) and is incompatible: {reason}")]
    GroupSnapshotExists {
        /// The request's name.
        name: String,
        /// The existing group snapshot.
        id: String,
        /// What differs.
        reason: String,
    },
    /// No group snapshot has this id.
    #[error("group snapshot {0:?} does not exist")]
    GroupSnapshotNotFound(String),
    /// The volumes cannot be snapshotted together.
    #[error("cannot snapshot these volumes together: {0}")]
    GroupRefused(String),
    /// A snapshot metadata request's starting offset lies past the volume.
    #[error("starting_offset: {0}")]
    OffsetOutOfRange(String),
    /// The volume is published at the node already, with arguments that do not match.
    #[error("volume {volume} is already published at node {node:?} and is incompatible: {reason}")]
    PublishedIncompatible {
        /// The volume.
        volume: String,
        /// The node.
        node: String,
        /// What differs.
        reason: String,
    },
    /// The volume is published at another node and cannot be published at two.
    #[error("volume {volume} is already published at node {node:?}; unpublish it there first")]
    PublishedElsewhere {
        /// The volume.
        volume: String,
        /// The node it is published at.
        node: String,
    },
    /// The volume cannot be deleted or changed while something uses it.
    #[error("volume {volume} is in use: {reason}")]
    VolumeInUse {
        /// The volume.
        volume: String,
        /// Who uses it.
        reason: String,
    },
    /// No volume can be provisioned where the accessibility requirements ask.
    #[error("accessibility_requirements: {0}")]
    TopologyUnsatisfiable(String),
    /// The storage is out of space.
    #[error("not enough space: {0}")]
    NoSpace(String),
    /// The node has as many attached volumes as it can take.
    #[error("cannot attach another volume: {0}")]
    TooManyAttachments(String),
    /// Another operation on the same object is in flight.
    #[error("an operation on {0} is already in progress; retry later")]
    OperationPending(String),
    /// A pagination token that this plugin did not hand out, or that no longer means anything.
    #[error("starting_token {token:?} is not valid: {reason}; start again without a token")]
    InvalidToken {
        /// The token, shortened.
        token: String,
        /// Why it was refused.
        reason: String,
    },
    /// The requested capacity cannot be honoured.
    #[error("capacity_range: {0}")]
    OutOfRange(String),
    /// The RPC is not implemented.
    #[error("{0} is not implemented by moor")]
    Unimplemented(&'static str),
    /// The volume's state forbids the operation now (it is in use in a way that blocks it).
    #[error("{0}")]
    FailedPrecondition(String),
    /// The plugin is not healthy or misses a dependency (Probe).
    #[error("not ready: {0}")]
    NotReady(String),
    /// A transient condition; the same call may succeed later.
    #[error("{0}")]
    Unavailable(String),
    /// An I/O step failed in a way the spec has no code for.
    #[error("{step} {path}: {source}")]
    Io {
        /// What was being done.
        step: &'static str,
        /// On what.
        path: String,
        /// Why it failed.
        #[source]
        source: std::io::Error,
    },
    /// The backend failed in a way the spec has no code for.
    #[error("{what}: {source}")]
    Backend {
        /// What was being done.
        what: String,
        /// The backend's own error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// A bug: a handler panicked or an invariant broke.
    #[error("internal error: {0}")]
    Internal(String),
}

impl Error {
    /// A missing or malformed field.
    pub fn invalid(field: &'static str, reason: impl Into<String>) -> Self {
        Error::InvalidArgument {
            field,
            reason: reason.into(),
        }
    }

    /// An I/O failure of `step` on `path`.
    pub fn io(
        step: &'static str,
        path: impl AsRef<std::path::Path>,
        source: std::io::Error,
    ) -> Self {
        Error::Io {
            step,
            path: path.as_ref().display().to_string(),
            source,
        }
    }

    /// A backend failure with its own error type.
    pub fn backend(
        what: impl Into<String>,
        source: impl std::error::Error + Send + Sync + 'static,
    ) -> Self {
        Error::Backend {
            what: what.into(),
            source: Box::new(source),
        }
    }

    /// The gRPC code for this error.
    pub fn code(&self) -> Code {
        match self {
            Error::InvalidArgument { .. } => Code::InvalidArgument,
            Error::VolumeNotFound(_)
            | Error::SnapshotNotFound(_)
            | Error::SourceNotFound { .. }
            | Error::NodeNotFound { .. }
            | Error::OnOtherNode { .. }
            | Error::GroupSnapshotNotFound(_) => Code::NotFound,
            Error::VolumeExists { .. }
            | Error::SnapshotExists { .. }
            | Error::GroupSnapshotExists { .. }
            | Error::PublishedIncompatible { .. } => Code::AlreadyExists,
            Error::PublishedElsewhere { .. }
            | Error::VolumeInUse { .. }
            | Error::NotReady(_)
            | Error::FailedPrecondition(_)
            | Error::GroupRefused(_) => Code::FailedPrecondition,
            Error::TopologyUnsatisfiable(_) | Error::NoSpace(_) | Error::TooManyAttachments(_) => {
                Code::ResourceExhausted
            }
            Error::OperationPending(_) | Error::InvalidToken { .. } => Code::Aborted,
            Error::OutOfRange(_) | Error::OffsetOutOfRange(_) => Code::OutOfRange,
            Error::Unimplemented(_) => Code::Unimplemented,
            Error::Unavailable(_) => Code::Unavailable,
            Error::Io { .. } | Error::Backend { .. } | Error::Internal(_) => Code::Internal,
        }
    }
}

impl From<Error> for Status {
    fn from(e: Error) -> Self {
        // The full chain of causes: the top message alone often hides the errno.
        let mut message = e.to_string();
        let mut source = std::error::Error::source(&e);
        while let Some(s) = source {
            let text = s.to_string();
            if !message.contains(&text) {
                message.push_str(": ");
                message.push_str(&text);
            }
            source = s.source();
        }
        Status::new(e.code(), message)
    }
}

/// Result of a controller operation.
pub type Result<T, E = Error> = std::result::Result<T, E>;

pub use moor_runtime::limits::trunc;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_follow_the_spec_rows() {
        let cases: Vec<(Error, Code)> = vec![
            (Error::invalid("name", "must be set"), Code::InvalidArgument),
            (Error::VolumeNotFound("v".into()), Code::NotFound),
            (
                Error::SourceNotFound {
                    kind: "snapshot",
                    id: "s".into(),
                },
                Code::NotFound,
            ),
            (
                Error::NodeNotFound {
                    node: "a".into(),
                    serves: "b".into(),
                },
                Code::NotFound,
            ),
            (
                Error::VolumeExists {
                    name: "n".into(),
                    id: "v".into(),
                    reason: "size".into(),
                },
                Code::AlreadyExists,
            ),
            (
                Error::PublishedIncompatible {
                    volume: "v".into(),
                    node: "n".into(),
                    reason: "readonly".into(),
                },
                Code::AlreadyExists,
            ),
            (
                Error::PublishedElsewhere {
                    volume: "v".into(),
                    node: "n".into(),
                },
                Code::FailedPrecondition,
            ),
            (
                Error::VolumeInUse {
                    volume: "v".into(),
                    reason: "published".into(),
                },
                Code::FailedPrecondition,
            ),
            (
                Error::TopologyUnsatisfiable("x".into()),
                Code::ResourceExhausted,
            ),
            (Error::NoSpace("x".into()), Code::ResourceExhausted),
            (
                Error::TooManyAttachments("x".into()),
                Code::ResourceExhausted,
            ),
            (Error::OperationPending("v".into()), Code::Aborted),
            (
                Error::InvalidToken {
                    token: "t".into(),
                    reason: "r".into(),
                },
                Code::Aborted,
            ),
            (Error::OutOfRange("x".into()), Code::OutOfRange),
            (Error::OffsetOutOfRange("x".into()), Code::OutOfRange),
            (Error::GroupSnapshotNotFound("g".into()), Code::NotFound),
            (
                Error::OnOtherNode {
                    kind: "volume",
                    id: "v@b".into(),
                    node: "b".into(),
                    here: "a".into(),
                },
                Code::NotFound,
            ),
            (
                Error::GroupSnapshotExists {
                    name: "n".into(),
                    id: "g".into(),
                    reason: "r".into(),
                },
                Code::AlreadyExists,
            ),
            (Error::GroupRefused("x".into()), Code::FailedPrecondition),
            (Error::Unimplemented("X"), Code::Unimplemented),
            (Error::Internal("x".into()), Code::Internal),
        ];
        for (e, code) in cases {
            assert_eq!(e.code(), code, "{e}");
        }
    }

    #[test]
    fn status_carries_the_cause() {
        let e = Error::io(
            "open",
            "/x",
            std::io::Error::from_raw_os_error(libc_enoent()),
        );
        let s: Status = e.into();
        assert_eq!(s.code(), Code::Internal);
        assert!(s.message().contains("open /x"), "{}", s.message());
    }

    fn libc_enoent() -> i32 {
        rustix::io::Errno::NOENT.raw_os_error()
    }
}
