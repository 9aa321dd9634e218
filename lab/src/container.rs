//! moor's image run as its pods run: the OCI archive `.ci/image` builds, unpacked once per test
//! process, and containers started from it with an OCI runtime (runc, else crun) from the
//! runtime configuration the rendered manifests give ([`moor_deploy::oci`]).
//!
//! Each container's root is an overlay of the unpacked image with a fresh upper dir, as a
//! container (re)started by kubelet gets a fresh writable layer. The runtime's state lives in
//! the test's dir. A [`Container`] is killed and deleted, and its root unmounted, when it
//! drops, also after a failure.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use serde_json::Value;

/// The environment variable naming the image archive (default: `target/image/moor-<version>.oci.tar`,
/// where `.ci/image` writes it); set and empty, there is none (`.ci/test` when it cannot be
/// built, so that an older archive is not tested).
pub const IMAGE_ENV: &str = "MOOR_IMAGE";
/// The environment variable naming the OCI runtime (default: `runc`, containerd's, else
/// `crun`, on PATH; crun 1.8 refuses a host whose cgroups are hybrid, as this kind of machine's
/// are).
pub const RUNTIME_ENV: &str = "MOOR_OCI_RUNTIME";

/// The unpacked image.
#[derive(Debug)]
pub struct Image {
    /// The archive it came from.
    pub archive: PathBuf,
    /// Its root filesystem, every layer applied (read-only to the tests: the overlays' lower).
    pub rootfs: PathBuf,
    /// The image config (`config` of the OCI image configuration: `Env`, `Entrypoint`, ...).
    pub config: Value,
    /// The manifest's digest (`sha256:...`).
    pub manifest: String,
}

/// The workspace's target dir: `CARGO_TARGET_DIR` (relative to the workspace), else `target`.
fn target_dir() -> PathBuf {
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map_or_else(|| PathBuf::from(".."), Path::to_path_buf);
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(t) => workspace.join(t),
        None => workspace.join("target"),
    }
}

/// Where the image archive is.
pub fn archive_path() -> PathBuf {
    std::env::var_os(IMAGE_ENV).map_or_else(
        || {
            target_dir()
                .join("image")
                .join(format!("moor-{}.oci.tar", env!("CARGO_PKG_VERSION")))
        },
        PathBuf::from,
    )
}

/// The OCI runtime to run containers with, or why there is none.
///
/// # Errors
/// When none is installed.
pub fn runtime() -> Result<String, String> {
    let candidates = match std::env::var(RUNTIME_ENV) {
        Ok(r) if !r.is_empty() => vec![r],
        _ => vec!["runc".to_owned(), "crun".to_owned()],
    };
    candidates
        .into_iter()
        .find(|r| {
            Command::new(r)
                .arg("--version")
                .output()
                .is_ok_and(|o| o.status.success())
        })
        .ok_or_else(|| format!("no OCI runtime (runc or crun, or {RUNTIME_ENV}) is installed"))
}

/// The image, unpacked once per process; or why it cannot be had (no archive).
///
/// # Errors
/// When there is no archive. A malformed archive panics: it is a finding, not a skip.
pub fn image() -> Result<&'static Image, String> {
    static IMAGE: OnceLock<Result<Image, String>> = OnceLock::new();
    IMAGE
        .get_or_init(|| {
            if std::env::var_os(IMAGE_ENV).is_some_and(|v| v.is_empty()) {
                return Err(format!("no image ({IMAGE_ENV} is empty)"));
            }
            let archive = archive_path();
            if !archive.is_file() {
                return Err(format!(
                    "no image at {} (bash .ci/image builds it; {IMAGE_ENV} names another)",
                    archive.display()
                ));
            }
            Ok(unpack(&archive))
        })
        .as_ref()
        .map_err(Clone::clone)
}

fn run_ok(cmd: &mut Command) -> Output {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn read_json(path: &Path) -> Value {
    let text = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_slice(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// A blob of the layout, its digest checked.
fn blob(layout: &Path, descriptor: &Value) -> PathBuf {
    let digest = descriptor["digest"]
        .as_str()
        .expect("a descriptor's digest");
    let hex = digest.strip_prefix("sha256:").expect("a sha256 digest");
    let path = layout.join("blobs/sha256").join(hex);
    let size = std::fs::metadata(&path)
        .unwrap_or_else(|e| panic!("blob {digest}: {e}"))
        .len();
    assert_eq!(
        Some(size),
        descriptor["size"].as_u64(),
        "blob {digest}: size"
    );
    let sum = run_ok(Command::new("sha256sum").arg(&path));
    let sum = String::from_utf8_lossy(&sum.stdout);
    assert_eq!(
        sum.split_whitespace().next(),
        Some(hex),
        "blob {digest}: content"
    );
    path
}

/// Unpacks the archive's image tagged with the workspace version under the archive's dir
/// (`unpacked/<manifest digest>`, kept for the next run; older ones are removed).
fn unpack(archive: &Path) -> Image {
    let dir = archive.parent().expect("archive dir").join("unpacked");
    let work = dir.join(format!("tmp-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&work);
    let layout = work.join("layout");
    std::fs::create_dir_all(&layout).expect("unpack dir");
    run_ok(
        Command::new("tar")
            .arg("-xf")
            .arg(archive)
            .arg("-C")
            .arg(&layout),
    );
    assert_eq!(
        read_json(&layout.join("oci-layout"))["imageLayoutVersion"],
        "1.0.0"
    );
    let index = read_json(&layout.join("index.json"));
    let version = env!("CARGO_PKG_VERSION");
    let descriptor = index["manifests"]
        .as_array()
        .and_then(|ms| {
            ms.iter().find(|m| {
                m["annotations"]["org.opencontainers.image.ref.name"].as_str() == Some(version)
            })
        })
        .unwrap_or_else(|| panic!("{}: no image tagged {version}: {index}", archive.display()))
        .clone();
    let manifest_digest = descriptor["digest"].as_str().expect("digest").to_owned();
    let manifest = read_json(&blob(&layout, &descriptor));
    let config = read_json(&blob(&layout, &manifest["config"]));
    let rootfs = dir.join(manifest_digest.trim_start_matches("sha256:"));
    if !rootfs.is_dir() {
        let fresh = work.join("rootfs");
        std::fs::create_dir_all(&fresh).expect("rootfs");
        let layers = manifest["layers"].as_array().expect("layers");
        assert_eq!(
            config["rootfs"]["diff_ids"].as_array().map(Vec::len),
            Some(layers.len()),
            "a diff id per layer"
        );
        for layer in layers {
            assert_eq!(
                layer["mediaType"],
                "application/vnd.oci.image.layer.v1.tar+gzip"
            );
            run_ok(
                Command::new("tar")
                    .args(["-xzf"])
                    .arg(blob(&layout, layer))
                    .arg("-C")
                    .arg(&fresh)
                    .args(["--numeric-owner", "--same-permissions"]),
            );
        }
        // Older images' roots go.
        for e in std::fs::read_dir(&dir).expect("unpacked").flatten() {
            if e.path() != work {
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
        std::fs::rename(&fresh, &rootfs).expect("rootfs in place");
    }
    let _ = std::fs::remove_dir_all(&work);
    Image {
        archive: archive.to_path_buf(),
        rootfs,
        config: config["config"].clone(),
        manifest: manifest_digest,
    }
}

/// A running container; killed and deleted, its root unmounted, on drop.
#[derive(Debug)]
pub struct Container {
    runtime: String,
    /// The runtime's state dir (its `--root`).
    state: PathBuf,
    /// The container's id.
    pub id: String,
    /// The runtime's foreground `run`, the container's parent.
    child: Child,
    /// The container's root (an overlay mount).
    rootfs: PathBuf,
    /// The container's output.
    pub log: PathBuf,
}

impl Container {
    /// Starts container `id` from `config` (an OCI runtime configuration, whose root is set
    /// here), with its bundle, root and state under `dir`, and returns at once: it may not
    /// serve yet.
    pub fn start(runtime: &str, image: &Image, dir: &Path, id: &str, mut config: Value) -> Self {
        let bundle = dir.join(id);
        let _ = std::fs::remove_dir_all(&bundle);
        let (upper, work, rootfs) = (
            bundle.join("upper"),
            bundle.join("work"),
            bundle.join("rootfs"),
        );
        for d in [&upper, &work, &rootfs] {
            std::fs::create_dir_all(d).expect("bundle dirs");
        }
        let options = std::ffi::CString::new(format!(
            "lowerdir={},upperdir={},workdir={}",
            image.rootfs.display(),
            upper.display(),
            work.display()
        ))
        .expect("overlay options");
        rustix::mount::mount(
            "overlay",
            &rootfs,
            "overlay",
            rustix::mount::MountFlags::empty(),
            options.as_c_str(),
        )
        .expect("the container's root: an overlay of the image");
        config["root"] = serde_json::json!({"path": rootfs, "readonly": false});
        std::fs::write(
            bundle.join("config.json"),
            serde_json::to_vec_pretty(&config).expect("config"),
        )
        .expect("config.json");
        let state = dir.join("runtime-state");
        std::fs::create_dir_all(&state).expect("runtime state dir");
        let log = dir.join(format!("{id}.log"));
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .expect("log");
        let err = out.try_clone().expect("log");
        let child = Command::new(runtime)
            .arg("--root")
            .arg(&state)
            .arg("run")
            .arg("--bundle")
            .arg(&bundle)
            .arg(id)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .unwrap_or_else(|e| panic!("{runtime} run: {e}"));
        Self {
            runtime: runtime.to_owned(),
            state,
            id: id.to_owned(),
            child,
            rootfs,
            log,
        }
    }

    fn runtime_cmd(&self) -> Command {
        let mut c = Command::new(&self.runtime);
        c.arg("--root").arg(&self.state);
        c
    }

    /// What the container has printed.
    pub fn output(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Panics (with the container's output) if it has exited.
    pub fn assert_running(&mut self) {
        if let Ok(Some(status)) = self.child.try_wait() {
            panic!(
                "container {} exited ({status}):\n{}",
                self.id,
                self.output()
            );
        }
    }

    /// Waits until `ready` says the container serves (it returns None), at most `deadline`;
    /// panics with what `ready` said last and the container's output, or if it exits first.
    pub fn wait_until(
        &mut self,
        what: &str,
        deadline: Duration,
        ready: impl Fn() -> Option<String>,
    ) {
        let start = Instant::now();
        loop {
            let Some(why) = ready() else { return };
            self.assert_running();
            assert!(
                start.elapsed() < deadline,
                "container {}: {what} not within {deadline:?} ({why}); its output:\n{}",
                self.id,
                self.output()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Runs `args` in the container (`<runtime> exec`).
    pub fn exec(&self, args: &[&str]) -> Output {
        self.runtime_cmd()
            .arg("exec")
            .arg(&self.id)
            .args(args)
            .stdin(Stdio::null())
            .output()
            .unwrap_or_else(|e| panic!("{} exec: {e}", self.runtime))
    }

    /// Kills the container (SIGKILL, as a crash or kubelet's kill does) and waits for the
    /// runtime to see it gone; its root is unmounted.
    pub fn kill(mut self) -> ExitStatus {
        self.stop()
    }

    fn stop(&mut self) -> ExitStatus {
        let _ = self.runtime_cmd().args(["kill", &self.id, "KILL"]).output();
        let start = Instant::now();
        let status = loop {
            match self.child.try_wait() {
                Ok(Some(s)) => break s,
                Ok(None) if start.elapsed() < Duration::from_secs(30) => {
                    std::thread::sleep(Duration::from_millis(20));
                }
                _ => {
                    // The runtime did not end the container: end the runtime.
                    let _ = self.child.kill();
                    break self.child.wait().expect("wait the runtime");
                }
            }
        };
        let _ = self
            .runtime_cmd()
            .args(["delete", "--force", &self.id])
            .output();
        let _ = rustix::mount::unmount(&self.rootfs, rustix::mount::UnmountFlags::DETACH);
        status
    }

    /// Whether the runtime still lists the container.
    pub fn listed(&self) -> bool {
        let out = self.runtime_cmd().arg("list").output().map(|o| o.stdout);
        String::from_utf8_lossy(&out.unwrap_or_default())
            .lines()
            .any(|l| l.split_whitespace().next() == Some(self.id.as_str()))
    }
}

impl Drop for Container {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) || self.listed() {
            self.stop();
        } else {
            let _ = rustix::mount::unmount(&self.rootfs, rustix::mount::UnmountFlags::DETACH);
        }
    }
}
