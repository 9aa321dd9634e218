//! Offline checks of moor's Kubernetes manifests under `deploy/`.
//!
//! - [`yaml`]: a strict YAML loader (no duplicate keys, no YAML 1.1/1.2 ambiguities);
//! - [`schema`]: validation of every object against the Kubernetes OpenAPI schemas;
//! - [`kustomize`]: the few kustomize features the overlays use (resources, JSON 6902 patches);
//! - [`flags`]: the command-line flags of moor's binaries, read from their clap sources;
//! - [`checks`]: cross-object checks (socket paths, mounts, RBAC, probes, flags);
//! - [`containerfile`]: what the container build file installs and builds.

pub mod checks;
pub mod containerfile;
pub mod flags;
pub mod kustomize;
pub mod schema;
pub mod yaml;

use std::path::{Path, PathBuf};

/// The repository root (the workspace holding this crate).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map_or_else(|| PathBuf::from(".."), Path::to_path_buf)
}

/// The `deploy/` directory.
pub fn deploy_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Environment variable naming the OpenAPI schema directory when `shared/` is elsewhere.
pub const OPENAPI_ENV: &str = "MOOR_K8S_OPENAPI";

/// Where the Kubernetes OpenAPI documents are: `shared/k8s-openapi` beside the repository,
/// else the directory named by [`OPENAPI_ENV`].
///
/// # Errors
/// When neither exists: the manifests cannot be validated, and the caller must fail.
pub fn openapi_dir() -> Result<PathBuf, String> {
    let beside = Path::new(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../shared/k8s-openapi"
    ));
    if beside.is_dir() {
        return Ok(beside.to_path_buf());
    }
    match std::env::var_os(OPENAPI_ENV) {
        Some(dir) if Path::new(&dir).is_dir() => Ok(PathBuf::from(dir)),
        Some(dir) => Err(format!(
            "{OPENAPI_ENV}={} is not a directory; the Kubernetes OpenAPI schemas are needed to \
             validate deploy/",
            Path::new(&dir).display()
        )),
        None => Err(format!(
            "the Kubernetes OpenAPI schemas are not at {} and {OPENAPI_ENV} is not set: point it \
             at a directory of OpenAPI v3 documents (shared/k8s-openapi) to validate deploy/",
            beside.display()
        )),
    }
}
