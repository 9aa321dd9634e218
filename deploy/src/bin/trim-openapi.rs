//! Writes `deploy/openapi/`: Kubernetes' published OpenAPI v3 documents trimmed to the kinds
//! the manifests use (`moor_deploy::openapi::KINDS`) and what those refer to.
//!
//!     cargo run -p moor-deploy --bin trim-openapi -- <dir of the full documents> [<out dir>]
//!
//! The full documents are Kubernetes' `api/openapi-spec/v3/*.json` (or a cluster's
//! `/openapi/v3/...`), under their file names there.

use std::path::PathBuf;
use std::process::ExitCode;

fn main() -> ExitCode {
    let mut args = std::env::args_os().skip(1);
    let Some(from) = args.next().map(PathBuf::from) else {
        eprintln!("usage: trim-openapi <dir of the full OpenAPI v3 documents> [<out dir>]");
        return ExitCode::from(2);
    };
    let to = args
        .next()
        .map_or_else(moor_deploy::openapi::kept_dir, PathBuf::from);
    match moor_deploy::openapi::trim_dir(&from, &to) {
        Ok(report) => {
            for t in report {
                println!("{}: {} of {} schemas", t.file, t.after, t.before);
            }
            println!("written to {}", to.display());
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("trim-openapi: {e}");
            ExitCode::FAILURE
        }
    }
}
