//! moorctl's failures, each rendered as one sentence and mapped to a documented exit code.

use std::path::PathBuf;

/// Everything that can make moorctl fail.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// The endpoint is not a Unix socket path.
    #[error(
        "{0:?} is not a Unix socket endpoint: give unix:///path/to/csi.sock or an absolute path"
    )]
    Endpoint(String),
    /// Nothing answers on the socket.
    #[error("cannot connect to {endpoint}: {reason}")]
    Connect {
        /// The endpoint.
        endpoint: String,
        /// Why, as a sentence.
        reason: String,
    },
    /// The driver answered with a gRPC error.
    #[error("{rpc} failed: {}: {}", code_name(.status.code()), message(.status))]
    Rpc {
        /// The RPC's name.
        rpc: &'static str,
        /// The status it returned.
        status: tonic::Status,
    },
    /// The driver gave an answer that lacks what the spec requires.
    #[error("{rpc} answered without {what}")]
    Incomplete {
        /// The RPC's name.
        rpc: &'static str,
        /// What was missing.
        what: &'static str,
    },
    /// The node journal cannot be read.
    #[error("cannot read moor's journal: {0}")]
    Journal(#[from] moor_node::journal::JournalError),
    /// The mount table cannot be read or parsed.
    #[error("cannot read the mount table {path}: {reason}")]
    MountTable {
        /// The file.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// The endpoint answered, but not as a moor-node that names its state dir.
    #[error(
        "{endpoint} does not name a node's state dir (GetPluginInfo: component {component}): \
         give a moor-node's --endpoint, or --state-dir"
    )]
    NotANode {
        /// The endpoint.
        endpoint: String,
        /// The component its manifest names.
        component: String,
    },
    /// `status` found volumes that are not healthy.
    #[error("{0}")]
    Unhealthy(String),
    /// A demo step failed (it has cleaned up by the time this is reported).
    #[error("the demo failed at step \"{step}\": {reason}")]
    Demo {
        /// The step.
        step: String,
        /// Why.
        reason: String,
    },
    /// The secrets file cannot be read or is malformed (never quoted: it holds keys).
    #[error("cannot read the secrets file {path}: {reason}")]
    Secrets {
        /// The file.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// Arguments that contradict each other.
    #[error("{0}")]
    Usage(String),
    /// Something the command needs on this machine is missing.
    #[error("{0}")]
    Local(String),
    /// Writing the answer failed.
    #[error("cannot write the output: {0}")]
    Write(#[from] std::io::Error),
}

impl CliError {
    /// The process exit code for this failure (see `--help`).
    pub fn exit_code(&self) -> u8 {
        match self {
            Self::Rpc { .. } | Self::Incomplete { .. } => 1,
            Self::Endpoint(_) | Self::NotANode { .. } | Self::Secrets { .. } | Self::Usage(_) => 2,
            Self::Connect { .. } => 3,
            Self::Unhealthy(_) => 4,
            Self::Journal(_)
            | Self::MountTable { .. }
            | Self::Demo { .. }
            | Self::Local(_)
            | Self::Write(_) => 5,
        }
    }

    /// A failed call to `rpc`.
    pub fn rpc(rpc: &'static str) -> impl FnOnce(tonic::Status) -> Self {
        move |status| Self::Rpc { rpc, status }
    }
}

/// A status's message, or a note that it had none.
fn message(status: &tonic::Status) -> String {
    if status.message().is_empty() {
        "(no message)".to_string()
    } else {
        status.message().to_string()
    }
}

/// The gRPC code's canonical name, as the CSI spec writes it.
pub fn code_name(code: tonic::Code) -> &'static str {
    use tonic::Code;
    match code {
        Code::Ok => "OK",
        Code::Cancelled => "CANCELLED",
        Code::Unknown => "UNKNOWN",
        Code::InvalidArgument => "INVALID_ARGUMENT",
        Code::DeadlineExceeded => "DEADLINE_EXCEEDED",
        Code::NotFound => "NOT_FOUND",
        Code::AlreadyExists => "ALREADY_EXISTS",
        Code::PermissionDenied => "PERMISSION_DENIED",
        Code::ResourceExhausted => "RESOURCE_EXHAUSTED",
        Code::FailedPrecondition => "FAILED_PRECONDITION",
        Code::Aborted => "ABORTED",
        Code::OutOfRange => "OUT_OF_RANGE",
        Code::Unimplemented => "UNIMPLEMENTED",
        Code::Internal => "INTERNAL",
        Code::Unavailable => "UNAVAILABLE",
        Code::DataLoss => "DATA_LOSS",
        Code::Unauthenticated => "UNAUTHENTICATED",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_grpc_error_reads_as_a_sentence_with_the_code_name() {
        let e = CliError::Rpc {
            rpc: "NodeStageVolume",
            status: tonic::Status::failed_precondition("device /dev/loop3 is not blank: xfs"),
        };
        assert_eq!(
            e.to_string(),
            "NodeStageVolume failed: FAILED_PRECONDITION: device /dev/loop3 is not blank: xfs"
        );
        assert_eq!(e.exit_code(), 1);
        let empty = CliError::Rpc {
            rpc: "Probe",
            status: tonic::Status::new(tonic::Code::Unavailable, ""),
        };
        assert_eq!(empty.to_string(), "Probe failed: UNAVAILABLE: (no message)");
    }

    #[test]
    fn exit_codes_follow_the_documented_table() {
        let connect = CliError::Connect {
            endpoint: "unix:///csi/csi.sock".into(),
            reason: "No such file or directory".into(),
        };
        assert_eq!(connect.exit_code(), 3);
        assert_eq!(
            connect.to_string(),
            "cannot connect to unix:///csi/csi.sock: No such file or directory"
        );
        assert_eq!(CliError::Endpoint("tcp://x".into()).exit_code(), 2);
        assert_eq!(
            CliError::Unhealthy("1 volume drifted".into()).exit_code(),
            4
        );
        let demo = CliError::Demo {
            step: "NodeStageVolume".into(),
            reason: "boom".into(),
        };
        assert_eq!(demo.exit_code(), 5);
        assert_eq!(
            demo.to_string(),
            "the demo failed at step \"NodeStageVolume\": boom"
        );
        for (code, name) in [
            (1, "  1  the driver answered"),
            (3, "  3  cannot connect"),
            (4, "  4  status"),
        ] {
            assert!(crate::cli::EXIT_CODES.contains(name), "{code}");
        }
    }

    #[test]
    fn every_code_has_its_spec_name() {
        assert_eq!(code_name(tonic::Code::NotFound), "NOT_FOUND");
        assert_eq!(
            code_name(tonic::Code::ResourceExhausted),
            "RESOURCE_EXHAUSTED"
        );
        assert_eq!(code_name(tonic::Code::Aborted), "ABORTED");
    }
}
