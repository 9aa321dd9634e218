//! The fixture every test here works in (a data dir and a backend on it, undone on drop), and
//! what the tests look at the kernel with: loop devices through sysfs, data through the device.

use std::fs::{self, File, OpenOptions};
use std::os::unix::fs::FileExt as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use moor_controller::backend::{
    AccessMode, AccessType, Backend as _, Capability, CapacityRange, ContentSource, NewVolume,
    Parameters, PublishContext, PublishRequest,
};
use moor_controller::embedded::attach::{Attacher as _, LoopAttacher};
use moor_controller::embedded::reconcile::Report;
use moor_controller::embedded::{Config, EmbeddedBackend};
use moor_privileged::client::DEADLINE;

pub(crate) const MIB: u64 = 1 << 20;
pub(crate) const NODE: &str = "node-1";

pub(crate) type Backend = EmbeddedBackend<LoopAttacher>;

pub(crate) static COUNTER: AtomicU32 = AtomicU32::new(0);

/// A data dir under the temp dir and a backend on it; on drop, every loop device bound to a
/// file under the dir is detached and the dir removed.
pub(crate) struct Fixture {
    pub(crate) backend: Option<Arc<Backend>>,
    pub(crate) dir: PathBuf,
}

impl Fixture {
    /// A fresh dir and a backend on it (panics unless root, as the whole suite does).
    pub(crate) fn new(tag: &str) -> Self {
        moor_privileged::require_root();
        let dir = temp_dir(tag);
        let mut fx = Self { backend: None, dir };
        let report = fx.start();
        assert!(report.is_clean(), "{report:?}");
        fx
    }

    /// Opens a backend on the fixture's dir.
    ///
    /// The data dir's lock is a flock, which belongs to the open file, and a child that another
    /// test of this binary is spawning holds a copy of every fd until it execs (close-on-exec
    /// closes them only then). So right after a backend is dropped its lock can still be held
    /// for that moment: a lock still busy is retried for a while before it counts as a failure.
    pub(crate) fn start(&mut self) -> Report {
        let start = Instant::now();
        let (backend, report) = loop {
            let opened = EmbeddedBackend::open(
                Config {
                    data_dir: self.dir.join("data"),
                    node_id: NODE.into(),
                    topology_key: "topology.moor.csi.io/node".into(),
                },
                LoopAttacher::new(),
            );
            match opened {
                Err(moor_controller::Error::Unavailable(_)) if start.elapsed() < DEADLINE => {
                    std::thread::sleep(Duration::from_millis(5));
                }
                other => break other.expect("open backend"),
            }
        };
        self.backend = Some(Arc::new(backend));
        report
    }

    /// Stops the backend (as a crash would: nothing is undone) and starts another.
    pub(crate) fn restart(&mut self) -> Report {
        self.backend = None;
        self.start()
    }

    pub(crate) fn b(&self) -> &Backend {
        self.backend.as_deref().expect("backend running")
    }

    pub(crate) fn create(&self, name: &str, bytes: u64) -> String {
        self.b()
            .create_volume(&new_volume(name, bytes, None))
            .expect("create volume")
            .id
    }

    pub(crate) fn publish(&self, id: &str) -> PublishContext {
        self.b().publish_volume(&publish_req(id)).expect("publish")
    }

    pub(crate) fn unpublish(&self, id: &str) {
        self.b()
            .unpublish_volume(id, Some(NODE))
            .expect("unpublish");
    }

    /// Loop devices bound to files under this fixture's dir, per sysfs.
    pub(crate) fn devices(&self) -> Vec<(PathBuf, String)> {
        loop_devices()
            .into_iter()
            .filter(|(_, backing)| backing.starts_with(self.dir.to_str().unwrap_or("/nonexistent")))
            .collect()
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        self.backend = None;
        let attacher = LoopAttacher::new();
        if let Ok(list) = attacher.list(&self.dir) {
            for a in list {
                let _ = attacher.detach(&a.device, a.file);
            }
        }
        let _ = fs::remove_dir_all(&self.dir);
    }
}

/// A fresh, canonical directory under the system temp dir.
pub(crate) fn temp_dir(tag: &str) -> PathBuf {
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!(
        "moor-priv-controller-{tag}-{}-{n}",
        std::process::id()
    ));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).expect("create test dir");
    fs::canonicalize(&dir).expect("resolve test dir")
}

/// Every bound loop device and its backing file, from sysfs.
pub(crate) fn loop_devices() -> Vec<(PathBuf, String)> {
    let mut out = Vec::new();
    let Ok(entries) = fs::read_dir("/sys/block") else {
        return out;
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if !name.starts_with("loop") {
            continue;
        }
        if let Ok(b) = fs::read_to_string(e.path().join("loop/backing_file")) {
            out.push((PathBuf::from("/dev").join(&name), b.trim_end().to_string()));
        }
    }
    out.sort();
    out
}

pub(crate) fn sys_name(dev: &str) -> String {
    Path::new(dev)
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or_default()
        .to_string()
}

/// The backing file sysfs reports for `dev`, if bound.
pub(crate) fn sysfs_backing(dev: &str) -> Option<String> {
    fs::read_to_string(format!("/sys/block/{}/loop/backing_file", sys_name(dev)))
        .ok()
        .map(|s| s.trim_end().to_string())
}

pub(crate) fn sysfs_flag(dev: &str, flag: &str) -> String {
    fs::read_to_string(format!("/sys/block/{}/{flag}", sys_name(dev)))
        .unwrap_or_default()
        .trim()
        .to_string()
}

/// Whether the loop driver gives a file in `dir` direct I/O, asked independently of the code
/// under test: a device bound by `losetup --direct-io=on` to a small file there, its sysfs
/// `loop/dio` read, the device and the file removed (a device left by a failure is under
/// `dir`, which the fixture's drop detaches).
pub(crate) fn kernel_gives_direct_io(dir: &Path) -> bool {
    let file = dir.join("direct-io-probe.img");
    File::create(&file)
        .and_then(|f| f.set_len(MIB))
        .expect("the probe's file");
    let out = std::process::Command::new("losetup")
        .args(["--find", "--show", "--direct-io=on"])
        .arg(&file)
        .output()
        .expect("losetup");
    assert!(out.status.success(), "losetup: {out:?}");
    let dev = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let dio = sysfs_flag(&dev, "loop/dio") == "1";
    let detached = std::process::Command::new("losetup")
        .arg("-d")
        .arg(&dev)
        .status()
        .expect("losetup -d");
    assert!(detached.success(), "losetup -d {dev}");
    assert!(wait_unbound(&dev, dir), "{dev} still bound");
    let _ = fs::remove_file(&file);
    dio
}

/// The device's size in bytes, from sysfs (512-byte sectors).
pub(crate) fn device_size(dev: &str) -> u64 {
    let sectors: u64 = fs::read_to_string(format!("/sys/block/{}/size", sys_name(dev)))
        .expect("read size")
        .trim()
        .parse()
        .expect("parse size");
    sectors * 512
}

/// Waits until `dev` no longer serves a file under `dir` (the kernel finishes a detach on last
/// close). A device freed by this test may at once be bound again by a concurrent one: the
/// kernel hands out the lowest free number, so "unbound" alone is not what to wait for.
pub(crate) fn wait_unbound(dev: &str, dir: &Path) -> bool {
    let ours = |b: &str| Path::new(b).starts_with(dir);
    let start = Instant::now();
    while start.elapsed() < DEADLINE {
        if !sysfs_backing(dev).is_some_and(|b| ours(&b)) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    false
}

/// Deletes volume `id` once its loop device is free. After an unpublish, the device stays
/// bound (autoclear) while anyone holds it open, and a child another test of this process
/// forks holds a copy of every descriptor from its fork until its exec: for that moment the
/// delete is refused as in use (FAILED_PRECONDITION, which the CO retries). That refusal is
/// waited out until [`DEADLINE`]; any other error, or one still refused then, panics.
pub(crate) fn delete_when_unbound(b: &Backend, id: &str) {
    let start = Instant::now();
    loop {
        match b.delete_volume(id) {
            Ok(()) => return,
            Err(moor_controller::error::Error::VolumeInUse { reason, .. })
                if reason.contains("still bound") && start.elapsed() < DEADLINE =>
            {
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(e) => panic!("delete {id} (waited up to {DEADLINE:?} for its device): {e:?}"),
        }
    }
}

pub(crate) fn block_cap() -> Capability {
    Capability {
        access: AccessType::Block,
        mode: AccessMode::SingleNodeWriter,
    }
}

pub(crate) fn new_volume(name: &str, bytes: u64, source: Option<ContentSource>) -> NewVolume {
    NewVolume {
        name: name.into(),
        capacity: Some(CapacityRange {
            required: bytes,
            limit: 0,
        }),
        capabilities: vec![block_cap()],
        parameters: Parameters::new(),
        source,
        accessibility: None,
    }
}

pub(crate) fn publish_req(id: &str) -> PublishRequest {
    PublishRequest {
        volume_id: id.into(),
        node_id: NODE.into(),
        capability: block_cap(),
        readonly: false,
        context: Parameters::new(),
    }
}

/// Distinct 4 KiB blocks at a few offsets.
pub(crate) fn pattern(seed: u8) -> Vec<(u64, Vec<u8>)> {
    [0, 5 * MIB + 4096, 15 * MIB]
        .iter()
        .enumerate()
        .map(|(i, off)| {
            let byte = seed.wrapping_mul(31).wrapping_add(i as u8 + 1);
            (*off, vec![byte; 4096])
        })
        .collect()
}

pub(crate) fn write_through(dev: &str, blocks: &[(u64, Vec<u8>)]) {
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .open(dev)
        .expect("open device for writing");
    for (off, data) in blocks {
        f.write_all_at(data, *off)
            .expect("write through the device");
    }
    // No fsync here: the controller must flush an attached source before copying it.
}

pub(crate) fn read_back(dev: &str, blocks: &[(u64, Vec<u8>)]) {
    let f = File::open(dev).expect("open device for reading");
    for (off, data) in blocks {
        let mut buf = vec![0u8; data.len()];
        f.read_exact_at(&mut buf, *off)
            .expect("read through the device");
        assert!(buf == *data, "data at {off} differs on {dev}");
    }
}
