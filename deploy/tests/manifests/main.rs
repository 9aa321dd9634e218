//! Every manifest under deploy/, rendered by `kubectl kustomize` (by deploy's own renderer
//! without kubectl), validated strictly against the Kubernetes API schemas and checked across
//! objects; and the validator's own negative cases.

mod broken;
mod own_renderer;
mod rendered;
mod validator;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock, PoisonError};

use moor_deploy::checks::{self, Context};
use moor_deploy::kustomize::{self, Resource, meta};
use moor_deploy::schema::Schemas;
use moor_deploy::{deploy_dir, yaml};
use serde_json::{Value, json};

fn schemas() -> &'static Schemas {
    static S: OnceLock<Schemas> = OnceLock::new();
    S.get_or_init(|| moor_deploy::load_schemas().unwrap_or_else(|e| panic!("{e}")))
}

/// The binaries' flags with the coming ones.
fn ctx() -> &'static Context {
    static C: OnceLock<Context> = OnceLock::new();
    C.get_or_init(|| {
        let (ctx, notes) = moor_deploy::context(true).unwrap_or_else(|e| panic!("{e}"));
        for n in notes {
            eprintln!("note: {n}");
        }
        ctx
    })
}

/// The kustomization in `dir`, rendered once per test process (kubectl is slow to start).
fn render(dir: &Path) -> Vec<Resource> {
    static RENDERED: Mutex<BTreeMap<PathBuf, Vec<Resource>>> = Mutex::new(BTreeMap::new());
    let mut rendered = RENDERED.lock().unwrap_or_else(PoisonError::into_inner);
    rendered
        .entry(dir.to_owned())
        .or_insert_with(|| {
            moor_deploy::kubectl::render(dir).unwrap_or_else(|errors| {
                panic!("{} does not render:\n{}", dir.display(), errors.join("\n"))
            })
        })
        .clone()
}

fn problems(res: &[Resource], ctx: &Context) -> Vec<String> {
    let mut p = moor_deploy::validate_set(schemas(), res);
    p.extend(checks::check_all(res, ctx));
    p
}

fn base() -> Vec<Resource> {
    render(&deploy_dir().join("base"))
}

fn find<'a>(res: &'a [Resource], kind: &str, name: &str) -> &'a Value {
    res.iter()
        .map(|r| &r.doc)
        .find(|d| d["kind"] == kind && meta(d, "name") == Some(name))
        .unwrap_or_else(|| panic!("no {kind} {name}"))
}

fn find_mut<'a>(res: &'a mut [Resource], kind: &str, name: &str) -> &'a mut Value {
    res.iter_mut()
        .map(|r| &mut r.doc)
        .find(|d| d["kind"] == kind && meta(d, "name") == Some(name))
        .unwrap_or_else(|| panic!("no {kind} {name}"))
}

fn container<'a>(workload: &'a Value, name: &str) -> &'a Value {
    workload["spec"]["template"]["spec"]["containers"]
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["name"] == name))
        .unwrap_or_else(|| panic!("no container {name}"))
}

fn container_mut<'a>(workload: &'a mut Value, name: &str) -> &'a mut Value {
    workload["spec"]["template"]["spec"]["containers"]
        .as_array_mut()
        .and_then(|cs| cs.iter_mut().find(|c| c["name"] == name))
        .unwrap_or_else(|| panic!("no container {name}"))
}
