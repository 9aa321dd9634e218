//! Offline checks of moor's Kubernetes manifests under `deploy/`.
//!
//! - [`yaml`]: a strict YAML loader (no duplicate keys, no YAML 1.1/1.2 ambiguities);
//! - [`schema`]: validation of every object against the Kubernetes OpenAPI schemas;
//! - [`kubectl`]: rendering with `kubectl kustomize` when kubectl is there, else with
//!   [`kustomize`], deploy's own renderer of the few kustomize features the overlays use
//!   (resources, JSON 6902 patches), held to kubectl's output by a test;
//! - [`openapi`]: the Kubernetes OpenAPI documents kept in `deploy/openapi/`, and their trimming;
//! - [`flags`]: the command-line flags of moor's binaries, read from their clap commands;
//! - [`checks`]: cross-object checks (socket paths, mounts, RBAC, probes, flags);
//! - [`containerfile`]: what the container build file installs and builds;
//! - [`oci`]: a container's OCI runtime configuration, made from its pod spec as a CRI
//!   runtime makes it (the image test runs moor's containers with it).

pub mod checks;
pub mod containerfile;
pub mod flags;
pub mod kubectl;
pub mod kustomize;
pub mod oci;
pub mod openapi;
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

/// Where the Kubernetes OpenAPI documents the manifests are checked against are: kept in the
/// repository ([`openapi::kept_dir`], `deploy/openapi/`).
pub fn openapi_dir() -> PathBuf {
    openapi::kept_dir()
}

/// The image the manifests must run moor's binaries from: `moor:<workspace version>`.
pub fn moor_image() -> String {
    format!("moor:{}", env!("CARGO_PKG_VERSION"))
}

/// The schema of `snapshot.storage.k8s.io/v1` VolumeSnapshotClass, a custom resource the
/// Kubernetes documents do not have: written by hand from the external-snapshotter v8 CRD.
pub fn volume_snapshot_class_schema() -> serde_json::Value {
    snapshot_class_schema("snapshot.storage.k8s.io", "VolumeSnapshotClass")
}

/// The schema of `groupsnapshot.storage.k8s.io/v1` VolumeGroupSnapshotClass (external-snapshotter
/// v8.6 CRD, written by hand): the same fields as a VolumeSnapshotClass.
pub fn volume_group_snapshot_class_schema() -> serde_json::Value {
    snapshot_class_schema("groupsnapshot.storage.k8s.io", "VolumeGroupSnapshotClass")
}

fn snapshot_class_schema(group: &str, kind: &str) -> serde_json::Value {
    serde_json::json!({
        "type": "object",
        "required": ["driver", "deletionPolicy"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {
                "$ref": "#/components/schemas/io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"
            },
            "driver": {"type": "string"},
            "deletionPolicy": {"type": "string", "enum": ["Delete", "Retain"]},
            "parameters": {"type": "object", "additionalProperties": {"type": "string"}}
        },
        "x-kubernetes-group-version-kind": [
            {"group": group, "version": "v1", "kind": kind}
        ]
    })
}

/// The Kubernetes schemas ([`openapi_dir`]) plus the hand-written VolumeSnapshotClass,
/// VolumeGroupSnapshotClass and the
/// fields of later releases the manifests use ([`schema::LATER_FIELDS`]).
///
/// # Errors
/// When the schemas cannot be found or read.
pub fn load_schemas() -> Result<schema::Schemas, String> {
    let mut s = schema::Schemas::load(&openapi_dir())?;
    for (name, property, release, type_name) in schema::LATER_FIELDS {
        s.add_field(name, property, release, type_name)?;
    }
    s.add(
        "io.k8s.storage.snapshot.v1.VolumeSnapshotClass",
        volume_snapshot_class_schema(),
    )?;
    s.add(
        "io.k8s.storage.groupsnapshot.v1.VolumeGroupSnapshotClass",
        volume_group_snapshot_class_schema(),
    )?;
    Ok(s)
}

/// Reads a file of the repository.
///
/// # Errors
/// When it cannot be read.
pub fn read_repo_file(rel: &str) -> Result<String, String> {
    let path = repo_root().join(rel);
    std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))
}

/// The command lines of moor-node and moor-controller, read from their clap commands
/// ([`moor_node::args::Args`], [`moor_controller::args::Args`]), with the
/// [`flags::COMING_FLAGS`] when `coming`.
///
/// Returns them and the notes about coming flags that have landed.
///
/// # Errors
/// When a command has what [`flags::from_command`] refuses, or a coming flag landed with
/// another arity.
pub fn binaries(coming: bool) -> Result<(flags::Cli, flags::Cli, Vec<String>), String> {
    use clap::CommandFactory;
    let mut notes = Vec::new();
    let mut read = |cmd: clap::Command| -> Result<flags::Cli, String> {
        let cli = flags::from_command(&cmd)?;
        if !coming {
            return Ok(cli);
        }
        let (cli, n, errors) = cli.with_coming(flags::COMING_FLAGS);
        notes.extend(n);
        if errors.is_empty() {
            Ok(cli)
        } else {
            Err(errors.join("\n"))
        }
    };
    let node = read(moor_node::args::Args::command())?;
    let controller = read(moor_controller::args::Args::command())?;
    Ok((node, controller, notes))
}

/// The Debian packages moor's image adds to Debian's minimal root, from `deploy/packages`
/// (which `.ci/image` installs): each with what it is there for (its line's comment).
///
/// # Errors
/// When the file cannot be read, or a line has more than one package or none and a comment.
pub fn image_packages() -> Result<Vec<(String, String)>, String> {
    let text = read_repo_file("deploy/packages")?;
    let mut out = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let (words, why) = line.split_once('#').unwrap_or((line, ""));
        let words: Vec<&str> = words.split_whitespace().collect();
        match words[..] {
            [] => {}
            [package] if !why.trim().is_empty() => {
                out.push((package.to_owned(), why.trim().to_owned()));
            }
            _ => {
                return Err(format!(
                    "deploy/packages:{}: one package a line, with a comment saying why",
                    n + 1
                ));
            }
        }
    }
    Ok(out)
}

/// Where the Containerfile installs moor's binaries: the destination of the final stage's COPY
/// of `moor-node`.
///
/// # Errors
/// When the Containerfile cannot be read or has no such COPY.
pub fn install_dir() -> Result<String, String> {
    let stages = containerfile::parse(&read_repo_file("deploy/Containerfile")?)?;
    let last = stages.last().ok_or("deploy/Containerfile: no stage")?;
    last.all("COPY")
        .filter(|c| c.contains("/moor-node"))
        .find_map(|c| c.split_whitespace().last())
        .map(|d| d.trim_end_matches('/').to_owned())
        .ok_or_else(|| "deploy/Containerfile: the final stage copies no moor-node".to_owned())
}

/// Everything [`checks::check_all`] needs, read from the repository.
///
/// # Errors
/// As [`binaries`] and [`install_dir`].
pub fn context(coming: bool) -> Result<(checks::Context, Vec<String>), String> {
    let (node, controller, notes) = binaries(coming)?;
    let ctx = checks::Context {
        node,
        controller,
        moor_image: moor_image(),
        bin_dir: install_dir()?,
    };
    Ok((ctx, notes))
}

/// Validates every object of a rendered set against the schemas: one line per problem, naming
/// the object, its file and the path of the field.
pub fn validate_set(schemas: &schema::Schemas, res: &[kustomize::Resource]) -> Vec<String> {
    res.iter()
        .flat_map(|r| {
            schemas
                .validate_object(&r.doc)
                .into_iter()
                .map(move |p| format!("{} ({}): {p}", r.id(), r.source.display()))
        })
        .collect()
}

/// Every overlay directory under `deploy/overlays` (each holds a kustomization).
///
/// # Errors
/// When the directory cannot be read.
pub fn overlays() -> Result<Vec<PathBuf>, String> {
    let dir = deploy_dir().join("overlays");
    let mut out: Vec<PathBuf> = std::fs::read_dir(&dir)
        .map_err(|e| format!("{}: {e}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_dir())
        .collect();
    out.sort();
    Ok(out)
}
