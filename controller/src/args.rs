//! moor-controller's command line.

use std::path::PathBuf;

use clap::Parser;
use moor_runtime::daemon;

/// moor-controller: the CSI controller plugin. Serves the CSI Identity and Controller services
/// on a Unix socket; its embedded backend keeps volumes as sparse files under --data-dir and
/// attaches them to this host as loop devices.
#[derive(Debug, Parser)]
#[command(name = "moor-controller", version, about, long_about = None)]
pub struct Args {
    /// gRPC endpoint the CO's sidecars connect to.
    #[arg(long, default_value = "unix:///csi/csi.sock", env = "CSI_ENDPOINT")]
    pub endpoint: String,
    /// CSI driver name.
    #[arg(long, default_value = "moor.csi.io")]
    pub driver_name: String,
    /// The node the embedded backend attaches volumes to (this host's node id).
    #[arg(long, env = "NODE_ID")]
    pub node_id: String,
    /// Where the embedded backend keeps volumes, snapshots and its records. One
    /// moor-controller per data dir.
    #[arg(long, default_value = "/var/lib/moor/controller")]
    pub data_dir: PathBuf,
    /// How far thin volumes (the default `provisioning`) may overcommit the data dir: what
    /// they may still claim (their sizes minus what they hold) is kept at most this many times
    /// what its filesystem has free. 1: never more than it (every thin volume can be written
    /// whole); 2: the free space backs half of it. A volume, growth or snapshot that would
    /// break it is refused (RESOURCE_EXHAUSTED). Thick volumes hold all their space from the
    /// start. Default: thin volumes without limit.
    #[arg(long, value_name = "RATIO")]
    pub thin_overcommit: Option<f64>,
    /// While another moor-controller holds the data dir, how long to wait for it to exit
    /// before giving up, in seconds (a hand-over in a rolling update).
    #[arg(long, default_value_t = 30)]
    pub instance_wait: u64,
    /// Log format.
    #[arg(long, value_enum, default_value_t = daemon::LogFormat::Text)]
    pub log_format: daemon::LogFormat,
    /// On SIGTERM or SIGINT, how long in-flight calls may take to finish, in seconds.
    #[arg(long, default_value_t = 20)]
    pub shutdown_grace: u64,
    /// Serve /healthz and /metrics over HTTP on host:port (":port" binds 127.0.0.1).
    /// Default: off.
    #[arg(long)]
    pub http_endpoint: Option<String>,
    /// Announce SNAPSHOT_METADATA_SERVICE, for the external-snapshot-metadata sidecar (the
    /// SnapshotMetadata service is served either way). Off by default: csi-sanity v5.3.1 fails
    /// a plugin that announces it.
    #[arg(long)]
    pub snapshot_metadata: bool,
    /// Serve this node's volumes only, as each node's controller in the every-node install
    /// (beside the node's moor-node, whose --local-controller is this controller's socket):
    /// ids name the node, the CO never attaches or grows volumes through the controller
    /// (PUBLISH_UNPUBLISH_VOLUME and EXPAND_VOLUME are not announced: moor-node asks for
    /// them on the node), and the Node service answers NodeGetInfo and NodeGetCapabilities
    /// for the sidecars beside it (csi-provisioner --node-deployment, csi-resizer). Only with
    /// the embedded backend.
    #[arg(long)]
    pub node_local: bool,
    /// With --node-local, in a pod: label this node's VolumeGroupSnapshotContents (and the
    /// VolumeSnapshotContents the snapshot-controller left unlabelled, such as those made by
    /// hand) `snapshot.storage.kubernetes.io/managed-by: <node>`, so that the csi-snapshotter
    /// `--node-deployment` beside it cuts them (the snapshot-controller labels neither). Needs
    /// `list` and `patch` on both kinds of content.
    #[arg(long, requires = "node_local")]
    pub mark_snapshot_contents: bool,
    /// In a pod: copy the `moor.csi.io/key-rotation-schedule` annotation of this driver's
    /// PersistentVolumes and of their claims into their encrypted volumes' records, where the
    /// node's scheduled rotation reads it over the class's `keyRotationSchedule`
    /// (docs/encryption.md, "Scheduled rotation"). Needs `list` on PersistentVolumes and
    /// PersistentVolumeClaims.
    #[arg(long)]
    pub key_rotation_annotations: bool,
    /// Do not serve the embedded backend (no volumes on this host's loop devices).
    #[arg(long)]
    pub no_embedded: bool,
    /// Serve the RBD backend: StorageClasses with `backend: rbd` get RBD images of an existing
    /// Ceph cluster (named by `monitors`, or by `clusterID` with --rbd-clusters).
    #[arg(long)]
    pub rbd: bool,
    /// The RBD backend's cluster list: a JSON file in ceph-csi's config.json format, with the
    /// controller's own credentials optionally. Implies --rbd.
    #[arg(long, env = "MOOR_RBD_CLUSTERS")]
    pub rbd_clusters: Option<PathBuf>,
    /// The nodes the RBD backend publishes volumes at, comma-separated; others are NOT_FOUND.
    /// Default: any node the CO names.
    #[arg(long, value_delimiter = ',')]
    pub rbd_nodes: Vec<String>,
    /// How long a client fenced by a force-detach stays blocklisted, in seconds.
    #[arg(long, default_value_t = 7 * 24 * 3600)]
    pub rbd_fence_expiry: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn args_parse() {
        let a = Args::try_parse_from([
            "moor-controller",
            "--endpoint",
            "unix:///tmp/x.sock",
            "--node-id",
            "n1",
            "--data-dir",
            "/tmp/d",
            "--log-format",
            "json",
        ])
        .unwrap();
        assert_eq!(a.driver_name, "moor.csi.io");
        assert_eq!(a.node_id, "n1");
        assert_eq!(a.http_endpoint, None, "off by default");
        assert_eq!(a.thin_overcommit, None, "no limit by default");
        assert_eq!(a.instance_wait, 30);
        let a = Args::try_parse_from([
            "moor-controller",
            "--node-id",
            "n1",
            "--http-endpoint",
            "0.0.0.0:9809",
        ])
        .unwrap();
        assert_eq!(a.http_endpoint.as_deref(), Some("0.0.0.0:9809"));
        assert!(Args::try_parse_from(["moor-controller", "--log-format", "xml"]).is_err());
    }
}
