//! The attach step: a Ceph RBD image made a block device on this node before it is staged,
//! and unmade after it is unstaged.
//!
//! An [`Attacher`] maps, finds and unmaps images; which one a node uses is chosen at start
//! (`--rbd-attacher`):
//! * [`kernel::KernelAttacher`], the kernel's RBD client, through sysfs
//!   (`/sys/bus/rbd/add_single_major`): for production nodes;
//! * [`ublk::UblkAttacher`], moor-ublk serving the image through librbd as a ublk device
//!   that a new server takes over after the old one died: for kernels without the RBD client
//!   but with ublk (Linux 6.0+), whose mappings survive an upgrade of moor-node;
//! * [`fuse::FuseAttacher`], `rbd-fuse` showing the image as a file, and a loop device with
//!   direct I/O over it: for kernels without either.
//!
//! An image is known by its pool and name (and the cluster the controller names), never by
//! the device number it happens to get: that is how a mapping is found again after a restart,
//! and how the same image is never mapped twice. The engine journals each mapping like a
//! mount (`engine::mapped`); the request's keys and secrets are read in [`request`].

pub mod fake;
pub mod fuse;
pub mod journal;
pub mod kernel;
pub mod request;
pub mod ublk;

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use crate::sys::discovery::DeviceIdentity;

/// An RBD image, as the node names it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ImageSpec {
    /// The controller's name for the cluster (publish_context `rbdClusterID`), if it gave one.
    pub cluster_id: Option<String>,
    /// The pool.
    pub pool: String,
    /// The image.
    pub image: String,
}

impl fmt::Display for ImageSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.cluster_id {
            Some(c) => write!(f, "{c}:{}/{}", self.pool, self.image),
            None => write!(f, "{}/{}", self.pool, self.image),
        }
    }
}

/// A cephx key: never printed, zeroed when dropped.
pub struct Secret(Vec<u8>);

impl Secret {
    /// A secret holding `text`.
    pub fn new(text: &str) -> Self {
        Self(text.as_bytes().to_vec())
    }

    /// A secret holding `bytes` (a request that carries a key).
    pub fn from_bytes(bytes: Vec<u8>) -> Self {
        Self(bytes)
    }

    /// The key's text (checked to be base64 when it was read, so always UTF-8).
    pub fn expose(&self) -> &str {
        std::str::from_utf8(&self.0).unwrap_or_default()
    }

    /// The bytes.
    pub fn expose_bytes(&self) -> &[u8] {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

impl Drop for Secret {
    fn drop(&mut self) {
        self.0.fill(0);
        std::hint::black_box(&self.0);
    }
}

/// The Ceph user an image is mapped as (NodeStageVolume's secrets `userID`, `userKey`).
#[derive(Debug)]
pub struct Credentials {
    /// The user, without `client.`.
    pub user: String,
    /// Its key.
    pub key: Secret,
}

/// What a map needs.
#[derive(Debug)]
pub struct MapRequest<'a> {
    /// The image.
    pub image: &'a ImageSpec,
    /// The monitors' addresses, comma-separated (publish_context `rbdMonitors`).
    pub monitors: &'a str,
    /// Who maps it.
    pub credentials: &'a Credentials,
    /// Map it read-only.
    pub read_only: bool,
    /// Map it read-write with the exclusive lock held, never handed over (the kernel
    /// client's `exclusive`); otherwise the lock passes to whoever asks, as librbd's does.
    pub exclusive: bool,
}

/// A live mapping: the image as a block device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mapping {
    /// The device node.
    pub device: PathBuf,
    /// Its number.
    pub rdev: (u32, u32),
    /// What the engine checks the held device against (the FUSE attacher: the loop device's
    /// backing file; the kernel attacher checks its own sysfs instead, see
    /// [`Attacher::verify`]).
    pub identity: DeviceIdentity,
    /// Whether it is mapped read-only.
    pub read_only: bool,
}

/// Why an attach step failed.
#[derive(Debug, thiserror::Error)]
pub enum AttachError {
    /// The node has no attacher (or not the one a mapping was made with).
    #[error("{0}")]
    Unavailable(String),
    /// The image is not in the pool.
    #[error("RBD image {0} does not exist")]
    NotFound(String),
    /// A step ran past its deadline.
    #[error("{step} of RBD image {image} did not finish within {deadline:?}")]
    Timeout {
        /// The step: "map" or "unmap".
        step: &'static str,
        /// The image.
        image: String,
        /// The deadline.
        deadline: Duration,
    },
    /// An earlier map or unmap of the image, past its deadline, is still running.
    #[error("an earlier {step} of RBD image {image} is still running; retry later")]
    InFlight {
        /// The step.
        step: &'static str,
        /// The image.
        image: String,
    },
    /// The image's device is in use (mounted, claimed or open) and cannot be unmapped.
    #[error("RBD image {image}: {what} is in use; not unmapped")]
    Busy {
        /// The image.
        image: String,
        /// What is in use.
        what: String,
    },
    /// The image's mapping is not what moor makes (a snapshot, a namespace), or names what
    /// cannot be a file name.
    #[error("RBD image {image}: {reason}")]
    Unsupported {
        /// The image.
        image: String,
        /// Why.
        reason: String,
    },
    /// The request cannot be mapped as given (monitors the client cannot reach as named).
    #[error("RBD image {image}: {reason}")]
    Invalid {
        /// The image.
        image: String,
        /// Why.
        reason: String,
    },
    /// The client or the kernel refused (authentication, monitors, a tool's failure); the
    /// text never holds the key.
    #[error("{step} of RBD image {image} failed: {reason}")]
    Failed {
        /// The step.
        step: &'static str,
        /// The image.
        image: String,
        /// What was said.
        reason: String,
    },
}

impl AttachError {
    /// The gRPC code: a deadline is DEADLINE_EXCEEDED, a missing image NOT_FOUND, a request
    /// that cannot be mapped as given INVALID_ARGUMENT, a step
    /// still running ABORTED (the spec's "operation pending"), what the node cannot do or
    /// holds FAILED_PRECONDITION, the rest INTERNAL. kubelet retries them all.
    pub fn code(&self) -> tonic::Code {
        use tonic::Code;
        match self {
            AttachError::Timeout { .. } => Code::DeadlineExceeded,
            AttachError::NotFound(_) => Code::NotFound,
            AttachError::Invalid { .. } => Code::InvalidArgument,
            AttachError::InFlight { .. } => Code::Aborted,
            AttachError::Unavailable(_)
            | AttachError::Busy { .. }
            | AttachError::Unsupported { .. } => Code::FailedPrecondition,
            AttachError::Failed { .. } => Code::Internal,
        }
    }

    /// Whether the image may be mapped after this failure (a map past its deadline may still
    /// finish): its record must stay.
    pub fn may_have_mapped(&self) -> bool {
        matches!(
            self,
            AttachError::Timeout { .. } | AttachError::InFlight { .. }
        )
    }
}

/// How long a monitor may take to accept a connection before the cluster is reported away.
pub const MONITOR_PROBE_DEADLINE: Duration = Duration::from_secs(2);

/// Connects to each monitor of `monitors` in turn until one accepts; the reasons when none
/// does within `deadline` each.
pub fn probe_monitors(monitors: &str, deadline: Duration) -> Result<(), String> {
    let addrs = kernel::kernel_monitors(monitors)?;
    let mut why = Vec::new();
    for addr in addrs.addrs.split(',') {
        let parsed: std::net::SocketAddr = match addr.parse() {
            Ok(a) => a,
            Err(e) => {
                why.push(format!("{addr}: {e}"));
                continue;
            }
        };
        match std::net::TcpStream::connect_timeout(&parsed, deadline) {
            Ok(_) => return Ok(()),
            Err(e) => why.push(format!("{addr}: {e}")),
        }
    }
    Err(format!(
        "no monitor of the volume's Ceph cluster answers ({})",
        why.join("; ")
    ))
}

/// Maps and unmaps RBD images on this node.
pub trait Attacher: Send + Sync + fmt::Debug + 'static {
    /// Its name, as `--rbd-attacher` and the journal say it: "kernel", "ublk" or "fuse".
    fn kind(&self) -> &'static str;

    /// Its deadlines.
    fn deadlines(&self) -> Deadlines;

    /// The image's live mapping on this node, if there is one. Never blocks on the cluster.
    fn find(&self, image: &ImageSpec) -> Result<Option<Mapping>, AttachError>;

    /// Maps the image, within the attacher's map deadline. Whatever a failed map left is
    /// cleaned up, except after a deadline ([`AttachError::may_have_mapped`]).
    fn map(&self, req: &MapRequest<'_>) -> Result<Mapping, AttachError>;

    /// Unmaps the image, within the attacher's unmap deadline; an image that is not mapped
    /// is done. A device in use is [`AttachError::Busy`] and stays mapped.
    fn unmap(&self, image: &ImageSpec) -> Result<(), AttachError>;

    /// Confirms that the held device `rdev` is the image's mapping.
    fn verify(&self, image: &ImageSpec, rdev: (u32, u32)) -> Result<(), AttachError>;

    /// Makes the device show the image's current size (after it grew on the controller).
    fn refresh(&self, image: &ImageSpec) -> Result<(), AttachError>;

    /// Every mapping this attacher sees on the node, with its device.
    fn list(&self) -> Result<Vec<(ImageSpec, Option<PathBuf>)>, AttachError>;

    /// Whether every mapping [`list`](Self::list) shows is moor's (made under moor's state
    /// dir), so that one no record names may be unmapped. The kernel's mappings may be
    /// anyone's.
    fn owns_all_listed(&self) -> bool;

    /// Whether a map or unmap of the image, past its deadline, is still running.
    fn in_flight(&self, image: &ImageSpec) -> bool;

    /// A count that grows while the mapping's server answers (rbd-fuse's bytes written), to
    /// tell a slow one from one that hangs; None when there is no such count (the kernel).
    fn activity(&self, image: &ImageSpec) -> Option<u64>;

    /// Fails whatever waits on the mapping's server, which has stopped answering (rbd-fuse
    /// killed: its FUSE connection aborts), so a hung unmount or unmap ends. The kernel client
    /// has nothing of the kind.
    fn abort(&self, image: &ImageSpec);

    /// Brings the image's mapping back to life when its server died and a new one can take its
    /// device over (ublk's user recovery); whether it did. The device, its number and what is
    /// mounted on it stay. The kernel client and rbd-fuse have nothing of the kind.
    fn recover(&self, image: &ImageSpec) -> Result<bool, AttachError> {
        let _ = image;
        Ok(false)
    }

    /// Whether the image's cluster answers: one of `monitors` (as the publish context names
    /// them) takes a TCP connection within [`MONITOR_PROBE_DEADLINE`]; why not, otherwise.
    /// What NodeGetVolumeStats reports as the volume's condition: a kernel mapping whose
    /// cluster is away shows nothing else until its I/O hangs.
    fn cluster_answers(&self, monitors: &str) -> Result<(), String> {
        probe_monitors(monitors, MONITOR_PROBE_DEADLINE)
    }
}

/// Which attacher `--rbd-attacher` names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Choice {
    /// The kernel client when the kernel has it, else moor-ublk when the kernel has ublk and
    /// it is installed, else rbd-fuse when it is installed, else none.
    Auto,
    /// The kernel's RBD client (sysfs).
    Kernel,
    /// moor-ublk: a ublk device served through librbd, taken over by the next moor-node.
    Ublk,
    /// rbd-fuse and a loop device.
    Fuse,
    /// No RBD volumes on this node.
    None,
}

/// Deadlines of the attach steps.
#[derive(Debug, Clone, Copy)]
pub struct Deadlines {
    /// For a map.
    pub map: Duration,
    /// For an unmap.
    pub unmap: Duration,
}

/// The attacher `choice` names, for a node whose state dir is `state_dir`; None for
/// [`Choice::None`], or for [`Choice::Auto`] on a node with neither client. A named attacher
/// that cannot work here is an error.
pub fn choose(
    choice: Choice,
    state_dir: &std::path::Path,
    deadlines: Deadlines,
) -> Result<Option<std::sync::Arc<dyn Attacher>>, String> {
    let kernel = || kernel::KernelAttacher::new(kernel::SYSFS, kernel::DEV, deadlines);
    let fuse = || fuse::FuseAttacher::new(&state_dir.join(fuse::DIR), fuse::PROGRAM, deadlines);
    let ublk = || ublk::UblkAttacher::new(&state_dir.join(ublk::DIR), ublk::PROGRAM, deadlines);
    match choice {
        Choice::None => Ok(None),
        Choice::Kernel => kernel()
            .map(|a| Some(std::sync::Arc::new(a) as std::sync::Arc<dyn Attacher>))
            .ok_or_else(|| {
                format!(
                    "--rbd-attacher kernel: the kernel has no RBD client ({} is missing; \
                     modprobe rbd, or use --rbd-attacher fuse)",
                    kernel::SYSFS
                )
            }),
        Choice::Fuse => fuse()
            .map(|a| Some(std::sync::Arc::new(a) as std::sync::Arc<dyn Attacher>))
            .ok_or_else(|| format!("--rbd-attacher fuse: {} is not installed", fuse::PROGRAM)),
        Choice::Ublk => ublk()
            .map(|a| Some(std::sync::Arc::new(a) as std::sync::Arc<dyn Attacher>))
            .ok_or_else(|| {
                format!(
                    "--rbd-attacher ublk: the kernel has no ublk ({} is missing; modprobe \
                     ublk_drv) or {} is not installed",
                    ublk::CONTROL,
                    ublk::PROGRAM
                )
            }),
        Choice::Auto => Ok(kernel()
            .map(|a| std::sync::Arc::new(a) as std::sync::Arc<dyn Attacher>)
            .or_else(|| ublk().map(|a| std::sync::Arc::new(a) as std::sync::Arc<dyn Attacher>))
            .or_else(|| fuse().map(|a| std::sync::Arc::new(a) as std::sync::Arc<dyn Attacher>))),
    }
}

/// Replaces every occurrence of `secret` in `text` (a tool's message may quote the key).
pub fn redact(text: &str, secret: &Secret) -> String {
    let key = secret.expose();
    if key.is_empty() {
        return text.to_string();
    }
    text.replace(key, "<redacted>")
}
