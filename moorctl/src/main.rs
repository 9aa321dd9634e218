//! `moorctl`: the operator's command line for moor. It talks to a node's or the controller's
//! CSI socket, reports what a node has staged and published next to the live mount table
//! (`status`), and runs the one-command demo (`demo`). Exit codes are listed in `--help`.

mod cli;
mod client;
mod commands;
mod demo;
mod error;
mod output;
mod secrets;
mod status;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::parser::ValueSource;
use clap::{CommandFactory as _, FromArgMatches as _};

use crate::cli::{Cli, Command, DEFAULT_STATE_DIR, ProbeArgs};
use crate::commands::Clients;
use crate::error::CliError;
use crate::secrets::Secrets;

fn main() -> ExitCode {
    let matches = Cli::command().get_matches();
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    // Whether --endpoint (or CSI_ENDPOINT) was given, rather than its default taken.
    let endpoint_given = matches.value_source("endpoint") != Some(ValueSource::DefaultValue);
    match run(&cli, endpoint_given) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("moorctl: {e}");
            ExitCode::from(e.exit_code())
        }
    }
}

fn runtime() -> Result<tokio::runtime::Runtime, CliError> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| CliError::Local(format!("cannot start the async runtime: {e}")))
}

/// The state dir `status` reads: `--state-dir`, else the one the moor-node at the endpoint
/// reports. When the endpoint was not given and nothing answers on the default one, the
/// default state dir.
fn status_dir(
    cli: &Cli,
    given: Option<&PathBuf>,
    endpoint_given: bool,
    timeout: Duration,
) -> Result<PathBuf, CliError> {
    if let Some(dir) = given {
        return Ok(dir.clone());
    }
    match runtime()?.block_on(status::state_dir_of(&cli.endpoint, timeout)) {
        Ok(dir) => Ok(dir),
        Err(CliError::Connect { .. }) if !endpoint_given => {
            eprintln!(
                "moorctl: no moor-node answers on {}; reading {DEFAULT_STATE_DIR}",
                cli.endpoint
            );
            Ok(PathBuf::from(DEFAULT_STATE_DIR))
        }
        Err(CliError::Connect { endpoint, reason }) => Err(CliError::Connect {
            endpoint,
            reason: format!("{reason} (--state-dir reads a stopped node's journal)"),
        }),
        Err(e) => Err(e),
    }
}

fn run(cli: &Cli, endpoint_given: bool) -> Result<(), CliError> {
    let timeout = Duration::from_secs(cli.timeout.max(1));
    match &cli.command {
        Command::Completion(a) => {
            let mut cmd = Cli::command();
            clap_complete::generate(a.shell, &mut cmd, "moorctl", &mut std::io::stdout());
            Ok(())
        }
        Command::Status(a) => {
            let state_dir = status_dir(cli, a.state_dir.as_ref(), endpoint_given, timeout)?;
            let (report, unhealthy) = status::status(&state_dir, None)?;
            report.print(cli.output)?;
            match unhealthy {
                Some(summary) => Err(CliError::Unhealthy(summary)),
                None => Ok(()),
            }
        }
        Command::Demo(a) => demo::run(a),
        Command::Key(cli::KeyCommand::Unwrap(a)) => {
            let secrets = match &cli.secrets {
                Some(path) => Secrets::load(path)?,
                None => Secrets::default(),
            };
            let stdout = std::io::stdout();
            commands::key_unwrap(a, &secrets, std::os::fd::AsFd::as_fd(&stdout))
        }
        command => {
            let rt = runtime()?;
            let report = rt.block_on(async {
                let secrets = match &cli.secrets {
                    Some(path) => Secrets::load(path)?,
                    None => Secrets::default(),
                };
                let channel = match command {
                    Command::Probe(ProbeArgs {
                        wait: Some(wait),
                        wait_pid,
                    }) => {
                        client::wait(&cli.endpoint, Duration::from_secs(*wait), *wait_pid).await?
                    }
                    _ => client::connect(&cli.endpoint, timeout).await?,
                };
                let mut c = Clients::new(channel, secrets);
                match command {
                    Command::Info => commands::info(&mut c, timeout).await,
                    Command::Probe(_) => commands::probe(&mut c, timeout).await,
                    Command::Volume(v) => commands::volume(&mut c, v, timeout).await,
                    Command::Snapshot(s) => commands::snapshot(&mut c, s, timeout).await,
                    Command::Publish(a) => commands::publish(&mut c, a, timeout).await,
                    Command::Unpublish(a) => commands::unpublish(&mut c, a, timeout).await,
                    Command::Stage(a) => commands::stage(&mut c, a, timeout).await,
                    Command::Unstage(a) => commands::unstage(&mut c, a, timeout).await,
                    Command::Mount(a) => commands::mount(&mut c, a, timeout).await,
                    Command::Unmount(a) => commands::unmount(&mut c, a, timeout).await,
                    Command::Stats(a) => commands::stats(&mut c, a, timeout).await,
                    Command::RotateKey(a) => commands::rotate_key(&mut c, a, timeout).await,
                    Command::RotateKek(a) => commands::rotate_kek(&mut c, a, timeout).await,
                    Command::Completion(_)
                    | Command::Status(_)
                    | Command::Demo(_)
                    | Command::Key(_) => Err(CliError::Local("handled above".into())),
                }
            })?;
            report.print(cli.output)?;
            Ok(())
        }
    }
}
