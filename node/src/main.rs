//! `moor-node`: the moor CSI node plugin daemon.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use moor_node::args::Args;
use moor_node::engine::{Engine, EngineConfig};
use moor_node::journal::{Boot, Journal};
use moor_node::local_controller::GrpcLocalController;
use moor_node::metrics::MeteredOs;
use moor_node::reconcile::Reconciler;
use moor_node::registration::{self, Progress, Refusal, RegistrationService};
use moor_node::service::{IdentityService, NodeService, OPTIONAL_TOOLS, PluginInfo, readiness};
use moor_node::sys::Os;
use moor_node::sys::linux::Linux;
use moor_proto::csi::v1::{identity_server::IdentityServer, node_server::NodeServer};
use moor_proto::registration::v1::registration_server::RegistrationServer;
use moor_runtime::metrics::Metered;
use moor_runtime::{daemon, http, instance, server};
use tokio::sync::watch;
use tracing::{info, warn};

/// How long a call to the controller on this node may take (an attach flushes and binds, a
/// thick volume's growth reserves its space): below kubelet's own deadline for the RPC.
const LOCAL_CONTROLLER_TIMEOUT: Duration = Duration::from_secs(100);

/// What the HTTP endpoint reports for the node.
struct NodeStatus<O: Os> {
    os: Arc<O>,
    state_dir: PathBuf,
    engine: Arc<Engine<O>>,
    /// With built-in registration: how far kubelet got.
    registration: Option<Arc<Progress>>,
}

impl<O: Os> http::Status for NodeStatus<O> {
    fn health(&self) -> Result<(), String> {
        readiness(self.os.as_ref(), &self.state_dir).map_or(Ok(()), Err)?;
        self.registration.as_ref().map_or(Ok(()), |r| r.health())
    }

    fn metrics(&self) -> String {
        let mut out = moor_node::metrics::render_node(self.engine.volume_counts());
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
    daemon::forbid_core_dumps();
    let workers = daemon::default_workers();
    daemon::run_on_workers("moor-node", workers, run(args))
}

async fn run(args: Args) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    if let Some(why) =
        moor_runtime::limits::id_problem(&args.node_id, moor_runtime::limits::MAX_NODE_ID_LEN)
    {
        return Err(format!("--node-id {why}").into());
    }
    if let Some(point) = moor_node::crash_points::arm_from_env() {
        warn!(
            point,
            "crash point armed (tests only): this process kills itself there"
        );
    }
    if let Some(point) = moor_node::crash_points::arm_hold_from_env() {
        warn!(
            point,
            "crash point armed to hold (tests only): the call that reaches it waits there"
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
    if journal.torn_tail() > 0 {
        info!(
            bytes = journal.torn_tail(),
            "the journal ended in bytes no record reads from (appends a crash or power cut cut short before they were synced: its end, or its unsynced part from a torn line on); dropped"
        );
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
        topology_key: moor_runtime::contract::node_topology_key(&args.driver_name),
        state_dir: state_dir.clone(),
    };
    let boot = Boot::new(moor_node::sys::linux::boot_id());
    if boot.stamp().is_none() {
        warn!(
            "the node's boot id cannot be read: records a power cut took back in time are held \
             to as if this boot had written them (docs/durability.md)"
        );
    }
    let cfg = EngineConfig {
        kubelet_dir: args.kubelet_dir.clone(),
        max_volumes: args.max_volumes,
        mkfs_deadline: Duration::from_secs(args.tool_timeout),
        resize_deadline: Duration::from_secs(args.tool_timeout),
        discovery_deadline: Duration::from_secs(args.device_wait),
        e2fsck_always: args.e2fsck_always,
        boot,
        cgroup_root: args.cgroup_root.clone(),
    };
    let attacher = moor_node::attach::choose(
        args.rbd_attacher,
        &state_dir,
        moor_node::attach::Deadlines {
            map: Duration::from_secs(args.rbd_map_timeout),
            unmap: Duration::from_secs(args.rbd_unmap_timeout),
        },
    )?;
    match &attacher {
        Some(a) => info!(
            attacher = a.kind(),
            "RBD images are mapped with this attacher"
        ),
        None => info!("no RBD attacher: RBD volumes cannot be staged on this node"),
    }
    let engine =
        Arc::new(Engine::new(Arc::clone(&os), Arc::clone(&journal), cfg).with_attacher(attacher));
    // Before serving: finish or roll back what a crash cut short, clean what is corrupted.
    let reconciler = Arc::new(Reconciler::new(Arc::clone(&engine), &args.driver_name));
    reconciler.pass(true).await;
    let periodic = (args.reconcile_interval > 0).then(|| {
        Arc::clone(&reconciler).spawn_periodic(Duration::from_secs(args.reconcile_interval))
    });
    // This node's TPM, one for the process: the stages', the expansions' and the rotations'
    // calls take turns.
    let tpm = moor_node::engine::NodeTpm::from_env();
    let key_schedule = match &args.key_rotation_secrets {
        Some(dir) => {
            let endpoint = args
                .key_rotation_controller
                .as_ref()
                .or(args.local_controller.as_ref())
                .ok_or("--key-rotation-secrets needs --key-rotation-controller (or --local-controller)")?;
            let schedule = moor_node::key_schedule::KeySchedule::new(
                Arc::clone(&engine),
                endpoint,
                dir.clone(),
                LOCAL_CONTROLLER_TIMEOUT,
            )?
            .with_tpm(tpm.clone());
            info!(
                controller = endpoint,
                every_secs = args.key_rotation_interval,
                "scheduled data key rotation: on"
            );
            Some(
                Arc::new(schedule)
                    .spawn_periodic(Duration::from_secs(args.key_rotation_interval.max(1))),
            )
        }
        None => None,
    };
    let identity = IdentityService::new(info.clone(), Arc::clone(&os));
    let node = match &args.local_controller {
        Some(endpoint) => {
            let local = GrpcLocalController::new(endpoint, LOCAL_CONTROLLER_TIMEOUT)?;
            info!(
                controller = endpoint,
                "node-local volumes: the controller on this node attaches them"
            );
            NodeService::new(Arc::clone(&engine), info)
                .with_tpm(Arc::clone(&tpm.0))
                .with_local_controller(Arc::new(local))
        }
        None => NodeService::new(Arc::clone(&engine), info).with_tpm(Arc::clone(&tpm.0)),
    };
    let node = if args.health_capabilities {
        node.with_health_capabilities()
    } else {
        node
    };
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
        .add_service(Metered::new(NodeServer::new(node)))
        .add_service(Metered::new(
            moor_proto::keys::v1::node_keys_server::NodeKeysServer::new(
                moor_node::keys_service::KeysService::new(Arc::clone(&engine), tpm),
            ),
        ));

    // One stop for every server: SIGTERM/SIGINT, or kubelet refusing the registration (once
    // kubelet has the answer to that call: the stop would otherwise race it to the client).
    let grace = Duration::from_secs(args.shutdown_grace);
    let (stop_tx, stop_rx) = watch::channel(false);
    let stop_tx = Arc::new(stop_tx);
    let (failed_tx, failed_rx) = watch::channel(None::<Refusal>);
    {
        let stop_tx = Arc::clone(&stop_tx);
        let mut failed = failed_rx.clone();
        let refused = async move {
            let refusal = match failed.wait_for(Option::is_some).await {
                Ok(r) => r.clone(),
                Err(_) => None,
            };
            match refusal {
                Some(r) => {
                    if !r.answered(grace).await {
                        warn!(
                            ?grace,
                            "kubelet kept the connection of its refusal open: stopping anyway"
                        );
                    }
                }
                None => std::future::pending().await,
            }
        };
        tokio::spawn(async move {
            tokio::select! {
                () = server::termination() => {}
                () = refused => {}
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
        engine,
        registration: progress,
    };
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
    if let Some(refusal) = failed_rx.borrow().clone() {
        return Err(format!("kubelet refused the registration: {}", refusal.why).into());
    }
    for task in periodic.into_iter().chain(key_schedule) {
        task.abort();
    }
    grpc?;
    reg?;
    info!("moor-node stopped cleanly");
    drop(instance);
    Ok(())
}
