//! The start-up both daemons share: their log format flag, logging to stderr, and the
//! multi-thread runtime that runs them, with the process's exit code.

use std::future::Future;
use std::io::IsTerminal;
use std::process::ExitCode;

use tracing::{error, info, warn};

/// Log output format.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

/// Logs to stderr in `format`, filtered by `RUST_LOG` (default `info`).
pub fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    // Colours only for a person at a terminal: a log collector gets plain text.
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().flatten_event(true).init(),
    }
}

/// The worker threads a daemon's runtime gets unless told: `TOKIO_WORKER_THREADS`, else one
/// per CPU.
pub fn default_workers() -> usize {
    std::env::var("TOKIO_WORKER_THREADS")
        .ok()
        .and_then(|v| v.parse().ok())
        .or_else(|| std::thread::available_parallelism().ok().map(usize::from))
        .unwrap_or(1)
}

/// Runs `daemon` as a task on a multi-thread runtime of `workers` worker threads, not on the
/// calling thread: the server it starts accepts its connections on a worker, which then runs
/// the connection's task itself, where a server on the thread that blocks on the runtime has
/// to wake a worker for every connection it accepts. Its error is logged as why `name`
/// stopped.
pub fn run_on_workers<F>(name: &str, workers: usize, daemon: F) -> ExitCode
where
    F: Future<Output = Result<(), Box<dyn std::error::Error + Send + Sync>>> + Send + 'static,
{
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers.max(1))
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            error!(error = %e, "cannot start the async runtime");
            return ExitCode::FAILURE;
        }
    };
    let outcome = runtime.block_on(async {
        tokio::spawn(daemon)
            .await
            .unwrap_or_else(|e| Err(format!("the daemon's task ended: {e}").into()))
    });
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            error!(error = %e, "{name} stopped");
            ExitCode::FAILURE
        }
    }
}

/// No core dump of this daemon, which may hold keys ([`crate::sys::core_dumps`]): called
/// once at start, after the logging, before anything is served. Said in the log either way.
pub fn forbid_core_dumps() {
    match crate::sys::core_dumps::forbid() {
        Ok(()) => info!(
            "core dumps off (PR_SET_DUMPABLE 0): no image of this process's memory, where keys pass, is written"
        ),
        Err(e) => warn!(error = %e, "core dumps could not be turned off (PR_SET_DUMPABLE)"),
    }
}

/// Runs `daemon` on a multi-thread runtime; its error is logged as why `name` stopped.
pub fn run(
    name: &str,
    daemon: impl Future<Output = Result<(), Box<dyn std::error::Error>>>,
) -> ExitCode {
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
    match runtime.block_on(daemon) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            error!(error = %e, "{name} stopped");
            ExitCode::FAILURE
        }
    }
}
