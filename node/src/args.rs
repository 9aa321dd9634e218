//! moor-node's command line.

use std::path::PathBuf;

use clap::Parser;

use moor_runtime::daemon;

/// moor-node: the CSI node plugin. Serves the CSI Identity and Node services to kubelet on a
/// Unix socket, and stages and publishes volumes by direct mount syscalls.
#[derive(Debug, Parser)]
#[command(name = "moor-node", version, about, long_about = None)]
pub struct Args {
    /// gRPC endpoint kubelet connects to.
    #[arg(long, default_value = "unix:///csi/csi.sock", env = "CSI_ENDPOINT")]
    pub endpoint: String,
    /// This node's id, as the controller knows it (usually the Kubernetes node name).
    #[arg(long, env = "NODE_ID")]
    pub node_id: String,
    /// CSI driver name.
    #[arg(long, default_value = "moor.csi.io")]
    pub driver_name: String,
    /// Where moor keeps its own records (the node journal). One moor-node per state dir.
    #[arg(long, default_value = "/var/lib/moor")]
    pub state_dir: PathBuf,
    /// While another moor-node holds the state dir, how long to wait for it to exit before
    /// giving up, in seconds (a hand-over in a rolling update).
    #[arg(long, default_value_t = 30)]
    pub instance_wait: u64,
    /// kubelet's root dir: every staging and target path must lie under it.
    #[arg(long, default_value = "/var/lib/kubelet")]
    pub kubelet_dir: PathBuf,
    /// Where the host's cgroup hierarchies are mounted, as moor-node sees them: a volume's QoS
    /// limits go in its pod's cgroup there (cgroup v2 `io.max`, or v1 blkio).
    #[arg(long, default_value = "/sys/fs/cgroup")]
    pub cgroup_root: PathBuf,
    /// Most volumes this node takes (reported as max_volumes_per_node; 0: no limit).
    #[arg(long, env = "MOOR_MAX_VOLUMES", default_value_t = 0)]
    pub max_volumes: u64,
    /// Announce CSI 1.13's GET_VOLUME_HEALTH and GET_STORAGE_HEALTH (the calls are served
    /// either way): for a CO of CSI 1.13. Off by default: clients of older specs refuse or
    /// crash on capabilities they do not know (csi-sanity v5, csi-resizer v1.13).
    #[arg(long)]
    pub health_capabilities: bool,
    /// Log format.
    #[arg(long, value_enum, default_value_t = daemon::LogFormat::Text)]
    pub log_format: daemon::LogFormat,
    /// fsync every journal write (default: only those that must outlive a power loss).
    #[arg(long)]
    pub journal_fsync: bool,
    /// Run `e2fsck -p` before every read-write mount of an ext2/3/4 filesystem, also when its
    /// metadata shows that e2fsck would pass it as clean without checking it (by default that
    /// exec is left out: the answer is e2fsck's, decided from the same bytes).
    #[arg(long)]
    pub e2fsck_always: bool,
    /// Deadline for mkfs and resize tools, in seconds.
    #[arg(long, default_value_t = 600)]
    pub tool_timeout: u64,
    /// On SIGTERM, how long in-flight calls may take to finish, in seconds.
    #[arg(long, default_value_t = 20)]
    pub shutdown_grace: u64,
    /// Seconds between reconciliation passes (the journal against the live mount table); one
    /// pass always runs at start. 0: only at start.
    #[arg(long, default_value_t = 60)]
    pub reconcile_interval: u64,
    /// How long NodeStageVolume waits, in seconds, for a volume's device to appear (found by
    /// its identity through udev) before answering DEADLINE_EXCEEDED.
    #[arg(long, env = "MOOR_DEVICE_WAIT", default_value_t = 60)]
    pub device_wait: u64,
    /// kubelet's plugin registration dir (e.g. /var/lib/kubelet/plugins_registry): serve
    /// kubelet's registration API on <driver-name>-reg.sock there. Default: off (use the
    /// node-driver-registrar sidecar).
    #[arg(long)]
    pub registration_dir: Option<PathBuf>,
    /// With --registration-dir: once this many seconds have passed without kubelet
    /// registering the plugin, /healthz reports not ready (so the liveness probe restarts
    /// it). 0: never.
    #[arg(long, default_value_t = 120)]
    pub registration_timeout: u64,
    /// The CSI socket's path on the host, as kubelet must dial it, when it differs from the
    /// --endpoint path this container sees (default: the --endpoint path).
    #[arg(long)]
    pub kubelet_registration_path: Option<String>,
    /// Serve /healthz and /metrics over HTTP on host:port (":port" binds 127.0.0.1).
    /// Default: off.
    #[arg(long)]
    pub http_endpoint: Option<String>,
    /// How this node maps Ceph RBD images: `kernel` (the kernel's RBD client, through sysfs),
    /// `ublk` (moor-ublk: librbd behind a ublk device that the next moor-node takes over, for
    /// kernels without the RBD client but with ublk), `fuse` (rbd-fuse and a loop device, for
    /// kernels without either), `auto` (the kernel client when the rbd module is loaded, else
    /// ublk when /dev/ublk-control is there and moor-ublk installed, else rbd-fuse when
    /// installed, else none) or `none`.
    #[arg(long, value_enum, default_value_t = crate::attach::Choice::Auto)]
    pub rbd_attacher: crate::attach::Choice,
    /// The socket of the controller on this node (`unix:///path`), for node-local volumes
    /// (`moor-controller --node-local` beside this moor-node, the every-node install): the
    /// volumes this driver stages are attached, detached and grown by it, and their condition
    /// joins its view. Default: none (a CO attaches and grows volumes).
    #[arg(long, value_name = "ENDPOINT")]
    pub local_controller: Option<String>,
    /// A directory holding the key source's fields, one file each (`kek`, `kekID`, or a KMIP
    /// client's `KMIP_ENDPOINT` and the rest: a Kubernetes Secret mounted as a volume): with
    /// it, the encrypted volumes staged here whose
    /// class says `keyRotationSchedule` have their data key rotated when due, through the
    /// controller at `--key-rotation-controller` (docs/encryption.md, "Scheduled rotation").
    /// Default: none (rotation only by `moorctl rotate-key`).
    #[arg(long, value_name = "DIR")]
    pub key_rotation_secrets: Option<PathBuf>,
    /// The controller a scheduled rotation asks (`unix:///path`): its records hold the keys and
    /// the schedules. Default: `--local-controller`'s.
    #[arg(long, value_name = "ENDPOINT")]
    pub key_rotation_controller: Option<String>,
    /// How often, in seconds, the encrypted volumes staged here are checked for a rotation due.
    #[arg(long, default_value_t = 300)]
    pub key_rotation_interval: u64,
    /// Deadline for mapping an RBD image, in seconds.
    #[arg(long, default_value_t = 60)]
    pub rbd_map_timeout: u64,
    /// Deadline for unmapping an RBD image, in seconds (past it, rbd-fuse is killed and its
    /// mount detached); also how long rbd-fuse may go without answering while the volume's
    /// filesystem is unmounted.
    #[arg(long, default_value_t = 30)]
    pub rbd_unmap_timeout: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registration_and_http_are_off_by_default() {
        let a = Args::try_parse_from(["moor-node", "--node-id", "n"]).unwrap();
        assert_eq!((a.instance_wait, a.registration_timeout), (30, 120));
        assert_eq!(
            (
                a.registration_dir,
                a.kubelet_registration_path,
                a.http_endpoint
            ),
            (None, None, None)
        );
        let a = Args::try_parse_from([
            "moor-node",
            "--node-id",
            "n",
            "--registration-dir",
            "/var/lib/kubelet/plugins_registry",
            "--kubelet-registration-path",
            "/var/lib/kubelet/plugins/moor.csi.io/csi.sock",
            "--http-endpoint",
            ":9809",
        ])
        .unwrap();
        assert_eq!(
            a.registration_dir.as_deref(),
            Some(std::path::Path::new("/var/lib/kubelet/plugins_registry"))
        );
        assert_eq!(
            a.kubelet_registration_path.as_deref(),
            Some("/var/lib/kubelet/plugins/moor.csi.io/csi.sock")
        );
        assert_eq!(a.http_endpoint.as_deref(), Some(":9809"));
    }
}
