//! `moorctl`: the operator's command line for moor. It talks to a node's or the controller's
//! CSI socket, reports what a node has staged and published next to the live mount table
//! (`status`), and runs the one-command demo (`demo`). Exit codes are listed in `--help`.

mod cli;
mod client;
mod commands;
mod demo;
mod error;
mod output;
mod status;
mod sys;

use std::process::ExitCode;
use std::time::Duration;

use clap::{CommandFactory as _, Parser as _};

use crate::cli::{Cli, Command};
use crate::commands::Clients;
use crate::error::CliError;

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(&cli) {
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

fn run(cli: &Cli) -> Result<(), CliError> {
    let timeout = Duration::from_secs(cli.timeout.max(1));
    match &cli.command {
        Command::Completion(a) => {
            let mut cmd = Cli::command();
            clap_complete::generate(a.shell, &mut cmd, "moorctl", &mut std::io::stdout());
            Ok(())
        }
        Command::Status(a) => {
            let (report, unhealthy) = status::status(&a.state_dir, None)?;
            report.print(cli.output)?;
            match unhealthy {
                Some(summary) => Err(CliError::Unhealthy(summary)),
                None => Ok(()),
            }
        }
        Command::Demo(a) => demo::run(a),
        command => {
            let rt = runtime()?;
            let report = rt.block_on(async {
                let channel = client::connect(&cli.endpoint, timeout).await?;
                let mut c = Clients::new(channel);
                match command {
                    Command::Info => commands::info(&mut c, timeout).await,
                    Command::Probe => commands::probe(&mut c, timeout).await,
                    Command::Volume(v) => commands::volume(&mut c, v, timeout).await,
                    Command::Snapshot(s) => commands::snapshot(&mut c, s, timeout).await,
                    Command::Publish(a) => commands::publish(&mut c, a, timeout).await,
                    Command::Unpublish(a) => commands::unpublish(&mut c, a, timeout).await,
                    Command::Stage(a) => commands::stage(&mut c, a, timeout).await,
                    Command::Unstage(a) => commands::unstage(&mut c, a, timeout).await,
                    Command::Mount(a) => commands::mount(&mut c, a, timeout).await,
                    Command::Unmount(a) => commands::unmount(&mut c, a, timeout).await,
                    Command::Stats(a) => commands::stats(&mut c, a, timeout).await,
                    Command::Completion(_) | Command::Status(_) | Command::Demo(_) => {
                        Err(CliError::Local("handled above".into()))
                    }
                }
            })?;
            report.print(cli.output)?;
            Ok(())
        }
    }
}
