//! `moor-node`: the moor CSI node plugin daemon.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::{Parser, ValueEnum};
use moor_node::engine::{Engine, EngineConfig};
use moor_node::journal::Journal;
use moor_node::server;
use moor_node::service::{IdentityService, NodeService, OPTIONAL_TOOLS, PluginInfo, readiness};
use moor_node::sys::Os as _;
use moor_node::sys::linux::Linux;
use moor_proto::csi::v1::{identity_server::IdentityServer, node_server::NodeServer};
use tracing::{error, info, warn};

/// Log output format.
#[derive(Debug, Clone, Copy, ValueEnum)]
enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

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
    /// Where moor keeps its own records (the node journal).
    #[arg(long, default_value = "/var/lib/moor")]
    state_dir: PathBuf,
    /// kubelet's root dir: every staging and target path must lie under it.
    #[arg(long, default_value = "/var/lib/kubelet")]
    kubelet_dir: PathBuf,
    /// Most volumes this node takes (reported as max_volumes_per_node; 0: no limit).
    #[arg(long, default_value_t = 0)]
    max_volumes: u64,
    /// Log format.
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    /// fsync every journal write (default: only those that must outlive a power loss).
    #[arg(long)]
    journal_fsync: bool,
    /// Deadline for mkfs and resize tools, in seconds.
    #[arg(long, default_value_t = 600)]
    tool_timeout: u64,
    /// On SIGTERM, how long in-flight calls may take to finish, in seconds.
    #[arg(long, default_value_t = 20)]
    shutdown_grace: u64,
}

fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().flatten_event(true).init(),
    }
}

fn main() -> ExitCode {
    let args = Args::parse();
    init_logging(args.log_format);
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            error!(error = %e, "cannot start the async runtime");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(args)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            error!(error = %e, "moor-node stopped");
            ExitCode::FAILURE
        }
    }
}

async fn run(args: Args) -> Result<(), Box<dyn std::error::Error>> {
    if args.node_id.is_empty() {
        return Err("--node-id must not be empty".into());
    }
    let socket = server::parse_endpoint(&args.endpoint)?;
    std::fs::create_dir_all(&args.state_dir)
        .map_err(|e| format!("state dir {}: {e}", args.state_dir.display()))?;
    let os = Arc::new(Linux::new(&args.kubelet_dir)?);
    let (journal, problems) = Journal::open(&args.state_dir, args.journal_fsync)?;
    for p in &problems {
        warn!(file = %p.path.display(), error = %p.error, "journal record unreadable; set aside");
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
    if let Some(reason) = readiness(os.as_ref(), &args.state_dir) {
        warn!(reason, "not ready");
    }
    let info = PluginInfo {
        driver_name: args.driver_name.clone(),
        node_id: args.node_id.clone(),
        max_volumes: args.max_volumes,
        topology_key: format!("topology.{}/node", args.driver_name),
        state_dir: args.state_dir.clone(),
    };
    let cfg = EngineConfig {
        kubelet_dir: args.kubelet_dir.clone(),
        max_volumes: args.max_volumes,
        mkfs_deadline: Duration::from_secs(args.tool_timeout),
        resize_deadline: Duration::from_secs(args.tool_timeout),
        ..EngineConfig::default()
    };
    let engine = Arc::new(Engine::new(Arc::clone(&os), journal, cfg));
    let identity = IdentityService::new(info.clone(), Arc::clone(&os));
    let node = NodeService::new(engine, info);
    let listener = server::bind_unix(&socket)?;
    info!(
        endpoint = %socket.display(),
        driver = args.driver_name,
        node = args.node_id,
        version = env!("CARGO_PKG_VERSION"),
        "moor-node serving"
    );
    let router = tonic::transport::Server::builder()
        .add_service(IdentityServer::new(identity))
        .add_service(NodeServer::new(node));
    server::serve(
        router,
        listener,
        &socket,
        server::termination(),
        Duration::from_secs(args.shutdown_grace),
    )
    .await?;
    info!("moor-node stopped cleanly");
    Ok(())
}
