//! `moorctl demo`: starts moor-controller (embedded backend) and moor-node in a temporary dir
//! and walks a whole volume life as Kubernetes would, printing each step and how long it took.
//!
//! Everything it makes is undone in reverse order, also when a step fails or on SIGINT/SIGTERM:
//! the first signal lets the running step finish and then cleans up; a second one abandons the
//! running step at once. Each undo is recorded before its call is made, so a call cut short is
//! undone too. The whole demo runs in a private mount namespace, so no mount can reach the
//! host; loop devices, the only global things it makes, are checked for afterwards.

mod daemon;
mod sweep;
mod teardown;
mod ui;
mod volume_life;

use std::io::IsTerminal as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;

use csi::controller_client::ControllerClient;
use csi::node_client::NodeClient;
use moor_proto::csi::v1 as csi;
use tokio::signal::unix::{SignalKind, signal};

use self::daemon::Daemon;
use self::sweep::sweep;
use self::teardown::Made;
use self::ui::{Interrupts, Ui};
use self::volume_life::Demo;
use crate::cli::DemoArgs;
use crate::error::CliError;

const GIB: i64 = 1 << 30;
const NODE: &str = "demo-node";
const HELLO: &str = "hello from moor\n";
/// What an empty log tail reads as.
const NOTHING: &str = "(its log says nothing)";

/// A step that failed, and why.
#[derive(Debug, Clone)]
struct Failure {
    pub(super) step: String,
    pub(super) reason: String,
    /// Stopped by a signal rather than by an error.
    pub(super) interrupted: bool,
}

/// Where moor-node and moor-controller are: `--bin-dir`, else next to moorctl.
fn binaries(args: &DemoArgs) -> Result<(PathBuf, PathBuf), CliError> {
    let dir = match &args.bin_dir {
        Some(d) => d.clone(),
        None => std::env::current_exe()
            .ok()
            .and_then(|e| e.parent().map(Path::to_path_buf))
            .ok_or_else(|| {
                CliError::Local("cannot tell where moorctl is; pass --bin-dir".into())
            })?,
    };
    let node = dir.join("moor-node");
    let ctl = dir.join("moor-controller");
    for b in [&node, &ctl] {
        if !b.is_file() {
            return Err(CliError::Local(format!(
                "{} is missing: build it with `cargo build --release --bins` (or pass --bin-dir)",
                b.display()
            )));
        }
    }
    Ok((node, ctl))
}

/// `moorctl demo`.
pub fn run(args: &DemoArgs) -> Result<(), CliError> {
    if !rustix::process::geteuid().is_root() {
        return Err(CliError::Local(
            "moorctl demo needs root: it attaches loop devices and mounts filesystems".into(),
        ));
    }
    let (node_bin, ctl_bin) = binaries(args)?;
    // Before any thread exists: everything mounted from here on stays in this namespace.
    moor_runtime::sys::mount_namespace::enter_private_mount_namespace()
        .map_err(|e| CliError::Local(format!("cannot make a private mount namespace: {e}")))?;
    let root = std::env::temp_dir().join(format!("moor-demo-{}", std::process::id()));
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| CliError::Local(format!("cannot start the async runtime: {e}")))?;
    let outcome = rt.block_on(demo(args, &root, &node_bin, &ctl_bin));
    drop(rt);
    let left = sweep(&root);
    let outcome = match outcome {
        Ok(()) if !left.is_empty() => Err(Failure {
            step: "final check".into(),
            reason: format!("the teardown left {} behind (removed now)", left.join(", ")),
            interrupted: false,
        }),
        other => other,
    };
    match outcome {
        Ok(()) => {
            println!("\nmoor demo finished: every step passed, and everything it made is gone.");
            Ok(())
        }
        Err(f) => {
            println!(
                "\nmoor demo failed at step \"{}\"; everything it made has been removed.",
                f.step
            );
            Err(CliError::Demo {
                step: f.step,
                reason: f.reason,
            })
        }
    }
}

async fn demo(
    args: &DemoArgs,
    root: &Path,
    node_bin: &Path,
    ctl_bin: &Path,
) -> Result<(), Failure> {
    let interrupts = Arc::new(Interrupts::default());
    for kind in [SignalKind::interrupt(), SignalKind::terminate()] {
        let mut s = signal(kind).map_err(|e| Failure {
            step: "set up".into(),
            reason: format!("cannot handle signals: {e}"),
            interrupted: false,
        })?;
        let i = Arc::clone(&interrupts);
        tokio::spawn(async move {
            while s.recv().await.is_some() {
                i.last.store(kind.as_raw_value(), Ordering::SeqCst);
                i.count.fetch_add(1, Ordering::SeqCst);
            }
        });
    }
    let ui = Ui {
        spinner: std::io::stderr().is_terminal(),
        interrupts,
    };
    let kubelet = root.join("kubelet");
    let state = root.join("node-state");
    let data = root.join("controller-data");
    for d in [&kubelet, &state, &data] {
        std::fs::create_dir_all(d).map_err(|e| Failure {
            step: "set up".into(),
            reason: format!("{}: {e}", d.display()),
            interrupted: false,
        })?;
    }
    println!(
        "moor demo in {}: moor-controller (embedded backend) and moor-node, {} volumes",
        root.display(),
        args.fs_type
    );
    let (ks, ss, ds) = (
        kubelet.display().to_string(),
        state.display().to_string(),
        data.display().to_string(),
    );
    let ctl_sock = root.join("controller.sock");
    let node_sock = root.join("node.sock");
    let mut daemons: Vec<Daemon> = Vec::new();
    let started = async {
        let mut ctl = Daemon::spawn(
            ctl_bin,
            "moor-controller",
            &ctl_sock,
            &["--node-id", NODE, "--data-dir", &ds],
            root,
        )?;
        let c = ctl.wait_ready(&ctl_sock).await;
        daemons.push(ctl);
        let c = c?;
        let mut node = Daemon::spawn(
            node_bin,
            "moor-node",
            &node_sock,
            &["--node-id", NODE, "--state-dir", &ss, "--kubelet-dir", &ks],
            root,
        )?;
        let n = node.wait_ready(&node_sock).await;
        daemons.push(node);
        Ok((c, n?))
    };
    let started = ui
        .step("start moor-controller and moor-node", true, started)
        .await;
    let result = match started {
        Ok((c, n)) => {
            let mut d = Demo {
                ctl: ControllerClient::new(c),
                node: NodeClient::new(n),
                kubelet,
                state_dir: state,
                root: root.to_path_buf(),
                fs: args.fs_type.clone(),
                made: Made::default(),
            };
            let walked = d.walk(&ui).await;
            if walked.as_ref().is_err_and(|f| !f.interrupted) {
                for dm in &daemons {
                    let tail = dm.log_tail(3, true);
                    if tail != NOTHING {
                        println!("        {} log: {tail}", dm.name);
                    }
                }
            }
            println!("teardown:");
            let torn = d.teardown(&ui).await;
            walked.and(torn)
        }
        Err(f) => Err(f),
    };
    let mut stopped = Ok(());
    for mut dm in daemons.into_iter().rev() {
        let name = format!("stop {} (SIGTERM)", dm.name);
        let r = ui.step(&name, false, dm.stop()).await;
        if stopped.is_ok() {
            stopped = r;
        }
    }
    result.and(stopped)
}
