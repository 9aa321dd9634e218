//! `moor-controller`: the moor CSI controller plugin daemon.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use moor_controller::args::Args;
use moor_controller::embedded::attach::LoopAttacher;
use moor_controller::embedded::{Config, EmbeddedBackend, Overcommit, Policy};
use moor_controller::identity::IdentityService;
use moor_controller::node_info::NodeInfoService;
use moor_controller::rbd::{self, RbdBackend};
use moor_controller::select::Backends;
use moor_controller::service::ControllerService;
use moor_proto::csi::v1::controller_server::ControllerServer;
use moor_proto::csi::v1::group_controller_server::GroupControllerServer;
use moor_proto::csi::v1::identity_server::IdentityServer;
use moor_proto::csi::v1::node_server::NodeServer;
use moor_proto::csi::v1::snapshot_metadata_server::SnapshotMetadataServer;
use moor_proto::keys::v1::controller_keys_server::ControllerKeysServer;
use moor_runtime::metrics::Metered;
use moor_runtime::{daemon, http, instance, server};
use tracing::{info, warn};

/// What the HTTP endpoint reports for the controller.
struct ControllerStatus<B: moor_controller::Backend> {
    backend: Arc<B>,
}

impl<B: moor_controller::Backend> http::Status for ControllerStatus<B> {
    fn health(&self) -> Result<(), String> {
        self.backend.probe().map_err(|e| e.to_string())
    }

    fn metrics(&self) -> String {
        let mut out = moor_runtime::metrics::render_grpc();
        out.push_str(&self.backend.metrics());
        out
    }
}

/// Checks a DNS-label-like string: 1 to `max` characters of `[a-z0-9.-]`, beginning and ending
/// with an alphanumeric character.
fn label_ok(s: &str, max: usize) -> bool {
    let ok_char = |c: char| c.is_ascii_digit() || c.is_ascii_lowercase() || c == '-' || c == '.';
    !s.is_empty()
        && s.len() <= max
        && s.chars().all(ok_char)
        && s.starts_with(|c: char| c.is_ascii_alphanumeric())
        && s.ends_with(|c: char| c.is_ascii_alphanumeric())
}

/// The driver name must make a valid topology key prefix ("topology.<name>", at most 63
/// characters, lower case). The node id is the node's (kubelet's node name, up to 253
/// characters), within the spec's limit for node ids; its topology value is made from it.
fn check_names(driver: &str, node: &str) -> Result<(), String> {
    if !label_ok(&format!("topology.{driver}"), 63) {
        return Err(format!(
            "--driver-name {driver:?}: must be lower-case alphanumerics, '-' and '.', at most 54 \
             characters (it prefixes the topology key)"
        ));
    }
    if let Some(why) = moor_runtime::limits::id_problem(node, moor_runtime::limits::MAX_NODE_ID_LEN)
    {
        return Err(format!("--node-id {why}"));
    }
    Ok(())
}

/// The RBD backend, when the command line asks for it.
fn rbd_backend(
    args: &Args,
) -> Result<Option<Box<dyn moor_controller::Backend>>, Box<dyn std::error::Error>> {
    if !args.rbd && args.rbd_clusters.is_none() {
        return Ok(None);
    }
    let clusters = match &args.rbd_clusters {
        Some(p) => rbd::clusters::Clusters::load(p)?,
        None => rbd::clusters::Clusters::empty(),
    };
    let mut config = rbd::Config::new(clusters);
    if !args.rbd_nodes.is_empty() {
        config.nodes = Some(args.rbd_nodes.iter().cloned().collect());
    }
    config.fence_expiry = Duration::from_secs(args.rbd_fence_expiry);
    info!(clusters = config.clusters.len(), "rbd backend enabled");
    Ok(Some(Box::new(RbdBackend::new(config))))
}

/// How often a node-local controller looks for snapshot contents to label with its node
/// (`--mark-snapshot-contents`): a group snapshot waits at most this long for its node.
const MARK_INTERVAL: Duration = Duration::from_secs(2);

fn main() -> ExitCode {
    let args = Args::parse();
    daemon::init_logging(args.log_format);
    daemon::forbid_core_dumps();
    daemon::run("moor-controller", run(args))
}

async fn run(args: Args) -> Result<(), Box<dyn std::error::Error>> {
    check_names(&args.driver_name, &args.node_id)?;
    let socket = server::parse_endpoint(&args.endpoint)?;
    // Before anything else touches the data dir or a socket: one moor-controller per data dir.
    std::os::unix::fs::DirBuilderExt::mode(std::fs::DirBuilder::new().recursive(true), 0o700)
        .create(&args.data_dir)
        .map_err(|e| format!("data dir {}: {e}", args.data_dir.display()))?;
    moor_controller::backend::check_data_dir(&args.data_dir)?;
    let instance = instance::acquire(
        &args.data_dir,
        "moor-controller",
        Duration::from_secs(args.instance_wait),
    )
    .await?;
    // A cluster list that does not read stops the start before anything is opened.
    let rbd = rbd_backend(&args)?;
    if args.node_local && (args.no_embedded || rbd.is_some()) {
        return Err(
            "--node-local serves the embedded backend only: not with --no-embedded, \
                    --rbd or --rbd-clusters"
                .into(),
        );
    }
    // The API server is named by the pod's environment: outside a pod, the start stops here.
    let api = match args.mark_snapshot_contents {
        true => Some(
            moor_controller::kube::InCluster::from_env()
                .map_err(|e| format!("--mark-snapshot-contents: {e}"))?,
        ),
        false => None,
    };
    let schedules_api = match args.key_rotation_annotations {
        true => Some(
            moor_controller::kube::InCluster::from_env()
                .map_err(|e| format!("--key-rotation-annotations: {e}"))?,
        ),
        false => None,
    };
    let overcommit = match args.thin_overcommit {
        Some(r) => Overcommit::ratio(r).map_err(|e| format!("--thin-overcommit {e}"))?,
        None => Overcommit::UNLIMITED,
    };
    let embedded: Option<Box<dyn moor_controller::Backend>> = if args.no_embedded {
        None
    } else {
        let config = Config {
            data_dir: args.data_dir.clone(),
            node_id: args.node_id.clone(),
            topology_key: moor_runtime::contract::node_topology_key(&args.driver_name),
        };
        let (backend, report) =
            tokio::task::spawn_blocking(move || EmbeddedBackend::open(config, LoopAttacher::new()))
                .await??;
        let backend = backend.with_policy(Policy {
            overcommit,
            node_local: args.node_local,
        });
        for a in &report.set_aside {
            warn!(file = %a.path.display(), reason = %a.reason, "record unreadable; set aside, its data kept");
        }
        for p in &report.problems {
            warn!(problem = %p, "reconciliation");
        }
        info!(
            volumes = report.volumes,
            snapshots = report.snapshots,
            adopted = report.adopted.len(),
            detached = report.detached.len(),
            corrected = report.corrected.len(),
            orphans_removed = report.orphans_removed.len(),
            "records reconciled with this host's loop devices"
        );
        info!(thin_overcommit = %overcommit, "space policy");
        Some(Box::new(backend))
    };
    if embedded.is_none() && rbd.is_none() {
        return Err(
            "--no-embedded and no RBD backend (--rbd or --rbd-clusters): nothing to serve".into(),
        );
    }
    let backend = Arc::new(Backends::new(embedded, rbd));
    if let Err(e) = moor_controller::Backend::probe(backend.as_ref()) {
        warn!(error = %e, "not ready");
    }
    let identity = IdentityService::new(args.driver_name.clone(), Arc::clone(&backend))
        .announce_snapshot_metadata(args.snapshot_metadata);
    let controller = ControllerService::new(Arc::clone(&backend)).node_local(args.node_local);
    let group_controller = ControllerService::new(Arc::clone(&backend));
    let snapshot_metadata = ControllerService::new(Arc::clone(&backend));
    let controller_keys = ControllerService::new(Arc::clone(&backend));
    let listener = server::bind_unix(&socket)?;
    let http_listener = match &args.http_endpoint {
        Some(e) => Some(http::bind(e).await?),
        None => None,
    };
    info!(
        endpoint = %socket.display(),
        driver = args.driver_name,
        node = args.node_id,
        data_dir = %args.data_dir.display(),
        node_local = args.node_local,
        mark_snapshot_contents = args.mark_snapshot_contents,
        version = env!("CARGO_PKG_VERSION"),
        "moor-controller serving"
    );
    // A node-local controller tells the sidecars beside it which node it serves.
    let node_info = args.node_local.then(|| {
        Metered::new(NodeServer::new(NodeInfoService::new(
            args.node_id.clone(),
            moor_runtime::contract::node_topology_key(&args.driver_name),
        )))
    });
    let router = tonic::transport::Server::builder()
        .add_service(Metered::new(IdentityServer::new(identity)))
        .add_service(Metered::new(ControllerServer::new(controller)))
        .add_service(Metered::new(GroupControllerServer::new(group_controller)))
        .add_service(Metered::new(SnapshotMetadataServer::new(snapshot_metadata)))
        .add_service(Metered::new(ControllerKeysServer::new(controller_keys)))
        .add_optional_service(node_info);
    let (stop_tx, mut stop_rx) = tokio::sync::watch::channel(false);
    let mut stop_rx2 = stop_tx.subscribe();
    let mut stop_rx3 = stop_tx.subscribe();
    let grpc = async {
        let r = server::serve(
            router,
            listener,
            &socket,
            server::termination(),
            Duration::from_secs(args.shutdown_grace),
        )
        .await;
        stop_tx.send_replace(true);
        r
    };
    let web = async {
        if let Some(l) = http_listener {
            let status = Arc::new(ControllerStatus {
                backend: Arc::clone(&backend),
            });
            http::serve(l, status, async {
                let _ = stop_rx.wait_for(|s| *s).await;
            })
            .await;
        }
    };
    let marker = async {
        if let Some(api) = api {
            moor_controller::kube::mark_contents(
                api,
                args.driver_name.clone(),
                args.node_id.clone(),
                MARK_INTERVAL,
                async {
                    let _ = stop_rx2.wait_for(|s| *s).await;
                },
            )
            .await;
        }
    };
    let schedules = async {
        if let Some(api) = schedules_api {
            moor_controller::kube::apply_rotation_schedules(
                api,
                Arc::clone(&backend),
                args.driver_name.clone(),
                MARK_INTERVAL,
                async {
                    let _ = stop_rx3.wait_for(|s| *s).await;
                },
            )
            .await;
        }
    };
    let (grpc, (), (), ()) = tokio::join!(grpc, web, marker, schedules);
    grpc?;
    info!("moor-controller stopped cleanly");
    drop(instance);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        assert!(check_names("moor.csi.io", "node-1").is_ok());
        assert!(check_names("moor.csi.io", "Node_1.example").is_ok());
        assert!(check_names("Moor.csi.io", "n").is_err());
        assert!(check_names(&"a".repeat(60), "n").is_err());
        assert!(check_names("moor.csi.io", "").is_err());
        // Any node name kubelet may have: the topology value is made from it.
        assert!(check_names("moor.csi.io", "-n").is_ok());
        assert!(check_names("moor.csi.io", &"n".repeat(192)).is_ok());
        assert!(check_names("moor.csi.io", &"n".repeat(193)).is_err());
        assert!(check_names("moor.csi.io", "a\nb").is_err());
    }
}
