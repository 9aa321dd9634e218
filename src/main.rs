//! `moor-node`: the moor CSI node plugin daemon.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use moor_node::engine::{Engine, EngineConfig};
use moor_node::journal::Journal;
use moor_node::metrics::{Metered, MeteredOs};
use moor_node::reconcile::Reconciler;
use moor_node::registration::{self, Progress, RegistrationService};
use moor_node::service::{IdentityService, NodeService, OPTIONAL_TOOLS, PluginInfo, readiness};
use moor_node::sys::Os;
use moor_node::sys::linux::Linux;
use moor_node::{daemon, http, instance, server};
use moor_proto::csi::v1::{identity_server::IdentityServer, node_server::NodeServer};
use moor_proto::registration::v1::registration_server::RegistrationServer;
use tokio::sync::watch;
use tracing::{info, warn};

/// moor-node: the CSI node plugin. Serves the CSI Identity and Node services to kubelet on a
/// Unix socket, and stages and publishes volumes by direct mount syscalls.
#[derive(Debug, Parser)]
#[command(name = "moor-node", version, about, long_about = None)]
struct Args {
    /// gRPC endpoint kubelet connects to.
    #[arg(long, default_value = "unix:///csi/csi.sock", env = "CSI_ENDPOINT")]
    endpoint: String,
    /// This node's id, as the controller knows it (usually the Kubernetes node name).
    #[arg(long, env = "NODE_ID")]
    node_id: String,
    /// CSI driver name.
    #[arg(long, default_value = "moor.csi.io")]
    driver_name: String,
    /// Where moor keeps its own records (the node journal). One moor-node per state dir.
    #[arg(long, default_value = "/var/lib/moor")]
    state_dir: PathBuf,
    /// While another moor-node holds the state dir, how long to wait for it to exit before
    /// giving up, in seconds (a hand-over in a rolling update).
    #[arg(long, default_value_t = 30)]
    instance_wait: u64,
    /// kubelet's root dir: every staging and target path must lie under it.
    #[arg(long, default_value = "/var/lib/kubelet")]
    kubelet_dir: PathBuf,
    /// Most volumes this node takes (reported as max_volumes_per_node; 0: no limit).
    #[arg(long, default_value_t = 0)]
    max_volumes: u64,
    /// Log format.
    #[arg(long, value_enum, default_value_t = daemon::LogFormat::Text)]
    log_format: daemon::LogFormat,
    /// fsync every journal write (default: only those that must outlive a power loss).
    #[arg(long)]
    journal_fsync: bool,
    /// Deadline for mkfs and resize tools, in seconds.
    #[arg(long, default_value_t = 600)]
    tool_timeout: u64,
    /// On SIGTERM, how long in-flight calls may take to finish, in seconds.
    #[arg(long, default_value_t = 20)]
    shutdown_grace: u64,
    /// Seconds between reconciliation passes (the journal against the live mount table); one
    /// pass always runs at start. 0: only at start.
    #[arg(long, default_value_t = 60)]
    reconcile_interval: u64,
    /// How long NodeStageVolume waits, in seconds, for a volume's device to appear (found by
    /// its identity through udev) before answering DEADLINE_EXCEEDED.
    #[arg(long, env = "MOOR_DEVICE_WAIT", default_value_t = 60)]
    device_wait: u64,
    /// kubelet's plugin registration dir (e.g. /var/lib/kubelet/plugins_registry): serve
    /// kubelet's registration API on <driver-name>-reg.sock there. Default: off (use the
    /// node-driver-registrar sidecar).
    #[arg(long)]
    registration_dir: Option<PathBuf>,
    /// With --registration-dir: once this many seconds have passed without kubelet
    /// registering the plugin, /healthz reports not ready (so the liveness probe restarts
    /// it). 0: never.
    #[arg(long, default_value_t = 120)]
    registration_timeout: u64,
    /// The CSI socket's path on the host, as kubelet must dial it, when it differs from the
    /// --endpoint path this container sees (default: the --endpoint path).
    #[arg(long)]
    kubelet_registration_path: Option<String>,
    /// Serve /healthz and /metrics over HTTP on host:port (":port" binds 127.0.0.1).
    /// Default: off.
    #[arg(long)]
    http_endpoint: Option<String>,
}

/// What the HTTP endpoint reports for the node.
struct NodeStatus<O: Os> {
    os: Arc<O>,
    state_dir: PathBuf,
    journal: Arc<Journal>,
    /// With built-in registration: how far kubelet got.
    registration: Option<Arc<Progress>>,
}

impl<O: Os> http::Status for NodeStatus<O> {
    fn health(&self) -> Result<(), String> {
        readiness(self.os.as_ref(), &self.state_dir).map_or(Ok(()), Err)?;
        self.registration.as_ref().map_or(Ok(()), |r| r.health())
    }

    fn metrics(&self) -> String {
        let mut out = moor_node::metrics::render_node(&self.journal);
        if let Some(r) = &self.registration {
            moor_node::metrics::render_registration(&mut out, r.registered());
        }
        out
    }
}

/// Resolves once `stop` is set (or its sender is gone).
async fn stopped(mut stop: watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await;
}

fn main() -> ExitCode {
    let args = Args::parse();
    daemon::init_logging(args.log_format);
    daemon::run("moor-node", run(args))
}

async fn run(args: Args) -> Result<(), Box<dyn std::error::Error>> {
    if let Some(why) =
        moor_node::limits::id_problem(&args.node_id, moor_node::limits::MAX_NODE_ID_LEN)
    {
        return Err(format!("--node-id {why}").into());
    }
    if let Some(point) = moor_node::crash_points::arm_from_env() {
        warn!(
            point,
            "crash point armed (tests only): this process kills itself there"
        );
    }
    let socket = server::parse_endpoint(&args.endpoint)?;
    let state_dir = std::path::absolute(&args.state_dir)
        .map_err(|e| format!("state dir {}: {e}", args.state_dir.display()))?;
    std::fs::create_dir_all(&state_dir)
        .map_err(|e| format!("state dir {}: {e}", state_dir.display()))?;
    // Before anything else touches the state dir or a socket: one moor-node per state dir.
    let instance = instance::acquire(
        &state_dir,
        "moor-node",
        Duration::from_secs(args.instance_wait),
    )
    .await?;
    let registration = match &args.registration_dir {
        Some(dir) => {
            let reg_socket = registration::socket_path(dir, &args.driver_name)?;
            // The same limits as any Unix socket path.
            server::parse_endpoint(&reg_socket.display().to_string())?;
            let kubelet_path = match &args.kubelet_registration_path {
                Some(p) => server::parse_endpoint(p)?,
                None => socket.clone(),
            };
            Some((reg_socket, kubelet_path))
        }
        None => None,
    };
    let os = Arc::new(MeteredOs::new(Linux::new(&args.kubelet_dir)?));
    let (journal, problems) = Journal::open(&state_dir, args.journal_fsync)?;
    for p in &problems {
        warn!(file = %p.path.display(), line = p.line, error = %p.error,
            "journal line unreadable; log kept as journal.log.corrupt, rebuilding from the mount table");
    }
    let journal = Arc::new(journal);
    for tool in OPTIONAL_TOOLS {
        if !os.has_program(tool) {
            warn!(
                tool,
                "tool not found; volumes that need it will fail to stage or grow"
            );
        }
    }
    if let Some(reason) = readiness(os.as_ref(), &state_dir) {
        warn!(reason, "not ready");
    }
    let info = PluginInfo {
        driver_name: args.driver_name.clone(),
        node_id: args.node_id.clone(),
        max_volumes: args.max_volumes,
        topology_key: format!("topology.{}/node", args.driver_name),
        state_dir: state_dir.clone(),
    };
    let cfg = EngineConfig {
        kubelet_dir: args.kubelet_dir.clone(),
        max_volumes: args.max_volumes,
        mkfs_deadline: Duration::from_secs(args.tool_timeout),
        resize_deadline: Duration::from_secs(args.tool_timeout),
        discovery_deadline: Duration::from_secs(args.device_wait),
    };
    let engine = Arc::new(Engine::new(Arc::clone(&os), Arc::clone(&journal), cfg));
    // Before serving: finish or roll back what a crash cut short, clean what is corrupted.
    let reconciler = Arc::new(Reconciler::new(Arc::clone(&engine), &args.driver_name));
    reconciler.pass(true).await;
    let periodic = (args.reconcile_interval > 0).then(|| {
        Arc::clone(&reconciler).spawn_periodic(Duration::from_secs(args.reconcile_interval))
    });
    let identity = IdentityService::new(info.clone(), Arc::clone(&os));
    let node = NodeService::new(engine, info);
    let http_listener = match &args.http_endpoint {
        Some(e) => Some(http::bind(e).await?),
        None => None,
    };
    let listener = server::bind_unix(&socket)?;
    info!(
        endpoint = %socket.display(),
        driver = args.driver_name,
        node = args.node_id,
        version = env!("CARGO_PKG_VERSION"),
        "moor-node serving"
    );
    let router = tonic::transport::Server::builder()
        .add_service(Metered::new(IdentityServer::new(identity)))
        .add_service(Metered::new(NodeServer::new(node)));

    // One stop for every server: SIGTERM/SIGINT, or kubelet refusing the registration.
    let (stop_tx, stop_rx) = watch::channel(false);
    let stop_tx = Arc::new(stop_tx);
    let (failed_tx, failed_rx) = watch::channel(None::<String>);
    {
        let stop_tx = Arc::clone(&stop_tx);
        let mut failed = failed_rx.clone();
        tokio::spawn(async move {
            tokio::select! {
                () = server::termination() => {}
                Ok(_) = failed.wait_for(Option::is_some) => {}
            }
            stop_tx.send_replace(true);
        });
    }
    // The registration socket comes last: kubelet may dial the CSI socket as soon as it sees it.
    let mut progress = None;
    let reg = match registration {
        Some((reg_socket, kubelet_path)) => {
            let deadline = (args.registration_timeout > 0)
                .then(|| Duration::from_secs(args.registration_timeout));
            let p = Arc::new(Progress::new(deadline));
            let service = RegistrationService::new(
                args.driver_name.clone(),
                kubelet_path.display().to_string(),
                failed_tx.clone(),
                Arc::clone(&p),
            );
            let reg_listener = server::bind_unix(&reg_socket).inspect_err(|_| {
                let _ = std::fs::remove_file(&socket);
            })?;
            info!(socket = %reg_socket.display(), csi_endpoint = %kubelet_path.display(), "serving kubelet plugin registration");
            tokio::spawn(registration::log_while_waiting(
                Arc::clone(&p),
                reg_socket.clone(),
            ));
            progress = Some(p);
            let router = tonic::transport::Server::builder()
                .add_service(Metered::new(RegistrationServer::new(service)));
            Some((router, reg_listener, reg_socket))
        }
        None => None,
    };
    let status = NodeStatus {
        os: Arc::clone(&os),
        state_dir: state_dir.clone(),
        journal,
        registration: progress,
    };
    let grace = Duration::from_secs(args.shutdown_grace);
    let grpc = async {
        let r = server::serve(router, listener, &socket, stopped(stop_rx.clone()), grace).await;
        stop_tx.send_replace(true);
        r
    };
    let reg = async {
        match reg {
            Some((router, reg_listener, reg_socket)) => {
                let r = server::serve(
                    router,
                    reg_listener,
                    &reg_socket,
                    stopped(stop_rx.clone()),
                    grace,
                )
                .await;
                stop_tx.send_replace(true);
                r
            }
            None => Ok(()),
        }
    };
    let web = async {
        if let Some(l) = http_listener {
            http::serve(l, Arc::new(status), stopped(stop_rx.clone())).await;
        }
    };
    let (grpc, reg, ()) = tokio::join!(grpc, reg, web);
    drop(failed_tx);
    if let Some(why) = failed_rx.borrow().clone() {
        return Err(format!("kubelet refused the registration: {why}").into());
    }
    if let Some(task) = periodic {
        task.abort();
    }
    grpc?;
    reg?;
    info!("moor-node stopped cleanly");
    drop(instance);
    Ok(())
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
