//! The controller's embedded backend on real loop devices (run as root:
//! `cargo test -p moor-privileged --test controller`).
//!
//! Every test works in its own directory under the system temp dir and cleans up after itself
//! even when it fails: [`Fixture`]'s drop detaches every loop device bound to a file under that
//! directory and removes it. Loop devices are checked through sysfs, independently of the code
//! under test.

use std::collections::BTreeSet;
use std::fs::{self, File, OpenOptions};
use std::os::unix::fs::{FileExt as _, FileTypeExt as _, MetadataExt as _};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use moor_controller::backend::{
    AccessMode, AccessType, Backend as _, Capability, CapacityRange, ContentSource, ExpandRequest,
    NewSnapshot, NewVolume, Parameters, PublishContext, PublishRequest,
};
use moor_controller::embedded::attach::{Attacher as _, LoopAttacher};
use moor_controller::embedded::reconcile::Report;
use moor_controller::embedded::records::{Publication, RecordStore};
use moor_controller::embedded::{Config, EmbeddedBackend};
use moor_runtime::contract::{BACKING_FILE_KEY, DEVICE_PATH_KEY};

const MIB: u64 = 1 << 20;
const NODE: &str = "node-1";

type Backend = EmbeddedBackend<LoopAttacher>;

static COUNTER: AtomicU32 = AtomicU32::new(0);

/// A data dir under the temp dir and a backend on it; on drop, every loop device bound to a
/// file under the dir is detached and the dir removed.
struct Fixture {
    backend: Option<Arc<Backend>>,
    dir: PathBuf,
}

impl Fixture {
    /// A fresh dir and a backend on it (panics unless root, as the whole suite does).
    fn new(tag: &str) -> Self {
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
    fn start(&mut self) -> Report {
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
                Err(moor_controller::Error::Unavailable(_))
                    if start.elapsed() < Duration::from_secs(10) =>
                {
                    std::thread::sleep(Duration::from_millis(5));
                }
                other => break other.expect("open backend"),
            }
        };
        self.backend = Some(Arc::new(backend));
        report
    }

    /// Stops the backend (as a crash would: nothing is undone) and starts another.
    fn restart(&mut self) -> Report {
        self.backend = None;
        self.start()
    }

    fn b(&self) -> &Backend {
        self.backend.as_deref().expect("backend running")
    }

    fn create(&self, name: &str, bytes: u64) -> String {
        self.b()
            .create_volume(&new_volume(name, bytes, None))
            .expect("create volume")
            .id
    }

    fn publish(&self, id: &str) -> PublishContext {
        self.b().publish_volume(&publish_req(id)).expect("publish")
    }

    fn unpublish(&self, id: &str) {
        self.b()
            .unpublish_volume(id, Some(NODE))
            .expect("unpublish");
    }

    /// Loop devices bound to files under this fixture's dir, per sysfs.
    fn devices(&self) -> Vec<(PathBuf, String)> {
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
        if let Ok(list) = attacher.list() {
            for a in list {
                if a.backing.starts_with(&self.dir) {
                    let _ = attacher.detach(&a.device, a.file);
                }
            }
        }
        let _ = fs::remove_dir_all(&self.dir);
    }
}

/// A fresh, canonical directory under the system temp dir.
fn temp_dir(tag: &str) -> PathBuf {
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
fn loop_devices() -> Vec<(PathBuf, String)> {
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

fn sys_name(dev: &str) -> String {
    Path::new(dev)
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or_default()
        .to_string()
}

/// The backing file sysfs reports for `dev`, if bound.
fn sysfs_backing(dev: &str) -> Option<String> {
    fs::read_to_string(format!("/sys/block/{}/loop/backing_file", sys_name(dev)))
        .ok()
        .map(|s| s.trim_end().to_string())
}

fn sysfs_flag(dev: &str, flag: &str) -> String {
    fs::read_to_string(format!("/sys/block/{}/{flag}", sys_name(dev)))
        .unwrap_or_default()
        .trim()
        .to_string()
}

/// The device's size in bytes, from sysfs (512-byte sectors).
fn device_size(dev: &str) -> u64 {
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
fn wait_unbound(dev: &str, dir: &Path) -> bool {
    let ours = |b: &str| Path::new(b).starts_with(dir);
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(5) {
        if !sysfs_backing(dev).is_some_and(|b| ours(&b)) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    false
}

fn block_cap() -> Capability {
    Capability {
        access: AccessType::Block,
        mode: AccessMode::SingleNodeWriter,
    }
}

fn new_volume(name: &str, bytes: u64, source: Option<ContentSource>) -> NewVolume {
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

fn publish_req(id: &str) -> PublishRequest {
    PublishRequest {
        volume_id: id.into(),
        node_id: NODE.into(),
        capability: block_cap(),
        readonly: false,
        context: Parameters::new(),
    }
}

/// Distinct 4 KiB blocks at a few offsets.
fn pattern(seed: u8) -> Vec<(u64, Vec<u8>)> {
    [0, 5 * MIB + 4096, 15 * MIB]
        .iter()
        .enumerate()
        .map(|(i, off)| {
            let byte = seed.wrapping_mul(31).wrapping_add(i as u8 + 1);
            (*off, vec![byte; 4096])
        })
        .collect()
}

fn write_through(dev: &str, blocks: &[(u64, Vec<u8>)]) {
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

fn read_back(dev: &str, blocks: &[(u64, Vec<u8>)]) {
    let f = File::open(dev).expect("open device for reading");
    for (off, data) in blocks {
        let mut buf = vec![0u8; data.len()];
        f.read_exact_at(&mut buf, *off)
            .expect("read through the device");
        assert!(buf == *data, "data at {off} differs on {dev}");
    }
}

#[test]
fn attach_and_detach() {
    let fx = Fixture::new("attach");
    let id = fx.create("pvc-attach", 16 * MIB);
    let ctx = fx.publish(&id);
    let dev = ctx[DEVICE_PATH_KEY].clone();
    let backing = ctx[BACKING_FILE_KEY].clone();
    assert!(
        fs::metadata(&dev)
            .expect("device node")
            .file_type()
            .is_block_device(),
        "{dev} is a block device"
    );
    assert!(Path::new(&backing).is_absolute());
    assert_eq!(sysfs_backing(&dev).as_deref(), Some(backing.as_str()));
    assert_eq!(
        sysfs_flag(&dev, "loop/autoclear"),
        "0",
        "the attach must outlive us"
    );
    assert_eq!(sysfs_flag(&dev, "ro"), "0");
    assert_eq!(device_size(&dev), 16 * MIB);
    // Idempotent: the same device.
    assert_eq!(fx.publish(&id), ctx);
    assert_eq!(fx.devices().len(), 1);
    let status = fx.b().get_volume(&id).expect("get volume");
    assert_eq!(status.published_nodes, vec![NODE.to_string()]);
    assert!(!status.condition.abnormal, "{:?}", status.condition);
    // Deleting an attached volume is refused.
    let e = fx.b().delete_volume(&id).unwrap_err();
    assert_eq!(e.code(), tonic::Code::FailedPrecondition);
    fx.unpublish(&id);
    assert!(
        wait_unbound(&dev, &fx.dir),
        "{dev} still bound after unpublish"
    );
    assert!(fx.devices().is_empty());
    fx.unpublish(&id);
    fx.b().delete_volume(&id).expect("delete");
    assert!(!Path::new(&backing).exists());
}

#[test]
fn read_only_attach() {
    let fx = Fixture::new("readonly");
    let id = fx.create("pvc-ro", 4 * MIB);
    let mut req = publish_req(&id);
    req.readonly = true;
    let ctx = fx.b().publish_volume(&req).expect("publish read-only");
    let dev = &ctx[DEVICE_PATH_KEY];
    assert_eq!(sysfs_flag(dev, "ro"), "1");
    assert!(
        OpenOptions::new().write(true).open(dev).is_err() || {
            // Some kernels let the open succeed and refuse the write.
            let f = OpenOptions::new().write(true).open(dev).expect("open");
            f.write_all_at(b"x", 0).and_then(|()| f.sync_all()).is_err()
        }
    );
    fx.unpublish(&id);
    assert!(wait_unbound(dev, &fx.dir));
}

#[test]
fn snapshot_restore_and_clone_carry_the_data() {
    let fx = Fixture::new("snapshot");
    let src = fx.create("pvc-src", 32 * MIB);
    let src_dev = fx.publish(&src)[DEVICE_PATH_KEY].clone();
    let data = pattern(1);
    write_through(&src_dev, &data);
    let snap = fx
        .b()
        .create_snapshot(&NewSnapshot {
            name: "snap-1".into(),
            source_volume_id: src.clone(),
            parameters: Parameters::new(),
        })
        .expect("snapshot");
    assert!(snap.ready_to_use);
    assert_eq!(snap.size_bytes, 32 * MIB);
    let snap_file = fx.b().layout().snapshots.join(format!("{}.img", snap.id));
    let meta = fs::metadata(&snap_file).expect("snapshot file");
    assert_eq!(meta.len(), 32 * MIB);
    assert!(
        meta.blocks() * 512 < 8 * MIB,
        "the snapshot kept the holes ({} blocks)",
        meta.blocks()
    );
    // Writes after the snapshot do not reach it.
    write_through(&src_dev, &pattern(2));

    let restored = fx
        .b()
        .create_volume(&new_volume(
            "pvc-restored",
            64 * MIB,
            Some(ContentSource::Snapshot(snap.id.clone())),
        ))
        .expect("restore");
    assert_eq!(restored.capacity_bytes, 64 * MIB);
    let restored_dev = fx.publish(&restored.id)[DEVICE_PATH_KEY].clone();
    assert_eq!(device_size(&restored_dev), 64 * MIB);
    read_back(&restored_dev, &data);

    let clone = fx
        .b()
        .create_volume(&new_volume(
            "pvc-clone",
            MIB,
            Some(ContentSource::Volume(src.clone())),
        ))
        .expect("clone");
    assert_eq!(clone.capacity_bytes, 32 * MIB, "at least the source's size");
    let clone_dev = fx.publish(&clone.id)[DEVICE_PATH_KEY].clone();
    read_back(&clone_dev, &pattern(2));

    for id in [&src, &restored.id, &clone.id] {
        fx.unpublish(id);
        fx.b().delete_volume(id).expect("delete");
    }
    // Snapshots outlive their source.
    let again = fx
        .b()
        .create_volume(&new_volume(
            "pvc-again",
            32 * MIB,
            Some(ContentSource::Snapshot(snap.id.clone())),
        ))
        .expect("restore after the source is gone");
    let dev = fx.publish(&again.id)[DEVICE_PATH_KEY].clone();
    read_back(&dev, &data);
    fx.unpublish(&again.id);
    fx.b().delete_snapshot(&snap.id).expect("delete snapshot");
    assert!(!snap_file.exists());
    for d in [&src_dev, &restored_dev, &clone_dev, &dev] {
        assert!(wait_unbound(d, &fx.dir));
    }
    assert!(fx.devices().is_empty());
}

#[test]
fn expand_grows_the_attached_device() {
    let fx = Fixture::new("expand");
    let id = fx.create("pvc-grow", 8 * MIB);
    let dev = fx.publish(&id)[DEVICE_PATH_KEY].clone();
    write_through(&dev, &pattern(3)[..1]);
    assert_eq!(device_size(&dev), 8 * MIB);
    let size = fx
        .b()
        .expand_volume(&ExpandRequest {
            volume_id: id.clone(),
            capacity: CapacityRange {
                required: 20 * MIB,
                limit: 0,
            },
            capability: Some(block_cap()),
        })
        .expect("expand");
    assert_eq!(size, 20 * MIB);
    assert_eq!(device_size(&dev), 20 * MIB);
    // The kernel's own view through the device node agrees.
    let f = File::open(&dev).expect("open device");
    let end = rustix::fs::seek(&f, rustix::fs::SeekFrom::End(0)).expect("seek");
    assert_eq!(end, 20 * MIB);
    drop(f);
    read_back(&dev, &pattern(3)[..1]);
    // Idempotent, never shrinks.
    let size = fx
        .b()
        .expand_volume(&ExpandRequest {
            volume_id: id.clone(),
            capacity: CapacityRange {
                required: 10 * MIB,
                limit: 0,
            },
            capability: None,
        })
        .expect("expand smaller");
    assert_eq!(size, 20 * MIB);
    assert_eq!(device_size(&dev), 20 * MIB);
    fx.unpublish(&id);
    assert!(wait_unbound(&dev, &fx.dir));
}

#[test]
fn restart_with_an_attached_volume() {
    let mut fx = Fixture::new("restart");
    let a = fx.create("pvc-a", 4 * MIB);
    let b = fx.create("pvc-b", 4 * MIB);
    let ctx = fx.publish(&a);
    let dev = ctx[DEVICE_PATH_KEY].clone();
    write_through(&dev, &pattern(4)[..1]);
    let before = fx.devices();

    // A clean restart: nothing to do, nothing lost, nothing leaked.
    let report = fx.restart();
    assert!(report.is_clean(), "{report:?}");
    assert_eq!(report.volumes, 2);
    assert_eq!(fx.devices(), before);
    assert_eq!(fx.publish(&a), ctx, "the attach survived, the record too");
    assert_eq!(fx.devices().len(), 1);

    // A device the records do not know (a publish that died before recording, on a volume
    // the records say is not published): detached at start.
    let b_file = fx.b().layout().volumes.join(format!("{b}.img"));
    let attacher = LoopAttacher::new();
    let stray = attacher.attach(&b_file, false).expect("stray attach");
    let stray = stray.display().to_string();
    let report = fx.restart();
    assert_eq!(report.detached.len(), 1, "{report:?}");
    assert!(wait_unbound(&stray, &fx.dir));
    assert_eq!(fx.devices().len(), 1);

    // A publish that died after recording its intent and attaching: adopted.
    let (store, loaded) = RecordStore::open(&fx.b().layout().records).expect("records");
    let mut record = loaded.volumes.get(&b).cloned().expect("record of b");
    record.publication = Some(Publication {
        node_id: NODE.into(),
        readonly: false,
        device: None,
    });
    store.put_volume(&record).expect("write intent");
    let adopted = attacher.attach(&b_file, false).expect("attach");
    let report = fx.restart();
    assert_eq!(report.adopted.len(), 1, "{report:?}");
    assert_eq!(report.adopted[0].1, adopted);
    let ctx_b = fx.publish(&b);
    assert_eq!(PathBuf::from(&ctx_b[DEVICE_PATH_KEY]), adopted);
    assert_eq!(fx.devices().len(), 2);

    // A device lost behind the controller's back (a reboot, an operator's losetup -d): the
    // record is corrected and publishing attaches again.
    let file_a =
        moor_controller::embedded::attach::FileId::of_path(Path::new(&ctx[BACKING_FILE_KEY]))
            .expect("stat");
    attacher
        .detach(Path::new(&dev), file_a)
        .expect("detach behind its back");
    assert!(wait_unbound(&dev, &fx.dir));
    let report = fx.restart();
    assert_eq!(report.corrected.len(), 1, "{report:?}");
    assert!(fx.b().get_volume(&a).expect("a").published_nodes.is_empty());
    let new_dev = fx.publish(&a)[DEVICE_PATH_KEY].clone();
    read_back(&new_dev, &pattern(4)[..1]);

    fx.unpublish(&a);
    fx.unpublish(&b);
    assert!(wait_unbound(&new_dev, &fx.dir));
    assert!(wait_unbound(&ctx_b[DEVICE_PATH_KEY], &fx.dir));
    assert!(fx.devices().is_empty());
}

#[test]
fn eight_concurrent_attaches() {
    let fx = Fixture::new("concurrent");
    let ids: Vec<String> = (0..8)
        .map(|i| fx.create(&format!("pvc-{i}"), 2 * MIB))
        .collect();
    let backend = Arc::clone(fx.backend.as_ref().expect("backend"));
    let barrier = Arc::new(Barrier::new(ids.len()));
    let threads: Vec<_> = ids
        .iter()
        .cloned()
        .map(|id| {
            let backend = Arc::clone(&backend);
            let barrier = Arc::clone(&barrier);
            std::thread::spawn(move || {
                barrier.wait();
                backend.publish_volume(&publish_req(&id))
            })
        })
        .collect();
    let contexts: Vec<PublishContext> = threads
        .into_iter()
        .map(|t| t.join().expect("thread").expect("publish"))
        .collect();
    let devices: BTreeSet<&String> = contexts.iter().map(|c| &c[DEVICE_PATH_KEY]).collect();
    assert_eq!(devices.len(), 8, "eight distinct devices");
    eprintln!(
        "attach races lost to concurrent attaches (and retried): {}",
        backend.attacher().races_lost()
    );
    for c in &contexts {
        assert_eq!(
            sysfs_backing(&c[DEVICE_PATH_KEY]).as_deref(),
            Some(c[BACKING_FILE_KEY].as_str()),
            "each device backs its own volume"
        );
    }
    assert_eq!(fx.devices().len(), 8);
    let threads: Vec<_> = ids
        .iter()
        .cloned()
        .map(|id| {
            let backend = Arc::clone(&backend);
            std::thread::spawn(move || backend.unpublish_volume(&id, Some(NODE)))
        })
        .collect();
    for t in threads {
        t.join().expect("thread").expect("unpublish");
    }
    for d in devices {
        assert!(wait_unbound(d, &fx.dir), "{d} still bound");
    }
    assert!(fx.devices().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_publish_context_over_a_socket() {
    use csi::volume_capability::{AccessMode as CsiMode, AccessType as CsiType, MountVolume};
    use moor_controller::identity::IdentityService;
    use moor_controller::service::ControllerService;
    use moor_proto::csi::v1 as csi;

    let fx = Fixture::new("grpc");
    let backend = Arc::clone(fx.backend.as_ref().expect("backend"));
    let socket = fx.dir.join("csi.sock");
    let listener = moor_runtime::server::bind_unix(&socket).expect("bind");
    let router = tonic::transport::Server::builder()
        .add_service(csi::identity_server::IdentityServer::new(
            IdentityService::new("moor.csi.io", Arc::clone(&backend)),
        ))
        .add_service(csi::controller_server::ControllerServer::new(
            ControllerService::new(Arc::clone(&backend)),
        ));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let path = socket.clone();
    let server = tokio::spawn(async move {
        moor_runtime::server::serve(
            router,
            listener,
            &path,
            async {
                let _ = stopped.await;
            },
            Duration::from_secs(5),
        )
        .await
    });
    let connect_to = socket.clone();
    let channel = tonic::transport::Endpoint::try_from("http://localhost")
        .expect("endpoint")
        .connect_with_connector(tower::service_fn(move |_: tonic::transport::Uri| {
            let p = connect_to.clone();
            async move {
                let s = tokio::net::UnixStream::connect(p).await?;
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(s))
            }
        }))
        .await
        .expect("connect");
    let mut c = csi::controller_client::ControllerClient::new(channel);
    let cap = csi::VolumeCapability {
        access_mode: Some(CsiMode {
            mode: csi::volume_capability::access_mode::Mode::SingleNodeWriter as i32,
        }),
        access_type: Some(CsiType::Mount(MountVolume::default())),
    };
    let vol = c
        .create_volume(csi::CreateVolumeRequest {
            name: "pvc-grpc".into(),
            capacity_range: Some(csi::CapacityRange {
                required_bytes: 8 << 20,
                limit_bytes: 0,
            }),
            volume_capabilities: vec![cap.clone()],
            ..Default::default()
        })
        .await
        .expect("create")
        .into_inner()
        .volume
        .expect("volume");
    let ctx = c
        .controller_publish_volume(csi::ControllerPublishVolumeRequest {
            volume_id: vol.volume_id.clone(),
            node_id: NODE.into(),
            volume_capability: Some(cap.clone()),
            ..Default::default()
        })
        .await
        .expect("publish")
        .into_inner()
        .publish_context;
    // What the node checks before it trusts the device.
    assert_eq!(
        sysfs_backing(&ctx[DEVICE_PATH_KEY]).as_deref(),
        Some(ctx[BACKING_FILE_KEY].as_str())
    );
    let grown = c
        .controller_expand_volume(csi::ControllerExpandVolumeRequest {
            volume_id: vol.volume_id.clone(),
            capacity_range: Some(csi::CapacityRange {
                required_bytes: 16 << 20,
                limit_bytes: 0,
            }),
            volume_capability: Some(cap),
            ..Default::default()
        })
        .await
        .expect("expand")
        .into_inner();
    assert!(grown.node_expansion_required);
    assert_eq!(device_size(&ctx[DEVICE_PATH_KEY]), 16 * MIB);
    c.controller_unpublish_volume(csi::ControllerUnpublishVolumeRequest {
        volume_id: vol.volume_id.clone(),
        node_id: NODE.into(),
        ..Default::default()
    })
    .await
    .expect("unpublish");
    c.delete_volume(csi::DeleteVolumeRequest {
        volume_id: vol.volume_id,
        ..Default::default()
    })
    .await
    .expect("delete");
    assert!(wait_unbound(&ctx[DEVICE_PATH_KEY], &fx.dir));
    let _ = stop.send(());
    server.await.expect("join").expect("serve");
    assert!(!socket.exists());
}

/// An XFS filesystem (with reflinks) on a loop device, mounted in this thread's private mount
/// namespace. Drop unmounts it and releases the device; the device is also marked to go away
/// on last close at once, so even a killed test leaves nothing behind.
struct ReflinkFs {
    dir: PathBuf,
    mnt: PathBuf,
    _held: File,
}

impl ReflinkFs {
    fn new(tag: &str) -> Self {
        moor_privileged::require_root();
        moor_runtime::sys::mount_namespace::enter_private_mount_namespace()
            .expect("private mount namespace");
        let dir = temp_dir(tag);
        let image = dir.join("xfs.img");
        File::create(&image)
            .and_then(|f| f.set_len(512 * MIB))
            .expect("image");
        moor_privileged::run(
            "mkfs.xfs",
            &["-q", "-m", "reflink=1", image.to_str().expect("utf-8 path")],
        );
        let attacher = LoopAttacher::new();
        let device = attacher.attach(&image, false).expect("attach image");
        let held = File::open(&device).expect("hold device");
        let file = moor_controller::embedded::attach::FileId::of_path(&image).expect("stat");
        // Detach now: the kernel finishes it when the mount and `held` are gone.
        attacher.detach(&device, file).expect("mark autoclear");
        let mnt = dir.join("mnt");
        fs::create_dir_all(&mnt).expect("mount point");
        rustix::mount::mount(
            device.as_path(),
            mnt.as_path(),
            "xfs",
            rustix::mount::MountFlags::empty(),
            None,
        )
        .expect("mount xfs");
        Self {
            dir,
            mnt,
            _held: held,
        }
    }
}

impl Drop for ReflinkFs {
    fn drop(&mut self) {
        // Loop devices of volumes kept on this filesystem first, then the filesystem.
        let attacher = LoopAttacher::new();
        if let Ok(list) = attacher.list() {
            for a in list {
                if a.backing.starts_with(&self.mnt) {
                    let _ = attacher.detach(&a.device, a.file);
                }
            }
        }
        let _ = rustix::mount::unmount(self.mnt.as_path(), rustix::mount::UnmountFlags::DETACH);
        let _ = fs::remove_dir_all(&self.dir);
    }
}

#[test]
fn snapshots_and_clones_are_reflinked_where_the_filesystem_can() {
    use moor_controller::embedded::copy::{CopyMethod, copy_sparse};
    let xfs = ReflinkFs::new("reflink");
    // The copy routine itself takes the reflink path here.
    let a = xfs.mnt.join("a");
    fs::write(&a, vec![9u8; 1 << 20]).expect("write a");
    let dst = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(xfs.mnt.join("b"))
        .expect("create b");
    let method = copy_sparse(&File::open(&a).expect("open a"), &dst, 2 * MIB).expect("copy");
    assert_eq!(method, CopyMethod::Reflink);
    assert_eq!(dst.metadata().expect("stat b").len(), 2 * MIB);
    drop(dst);

    // And the backend: a snapshot of 32 MiB of data costs (almost) no space.
    let (backend, _) = EmbeddedBackend::open(
        Config {
            data_dir: xfs.mnt.join("data"),
            node_id: NODE.into(),
            topology_key: "topology.moor.csi.io/node".into(),
        },
        LoopAttacher::new(),
    )
    .expect("open backend");
    let id = backend
        .create_volume(&new_volume("pvc-x", 64 * MIB, None))
        .expect("create")
        .id;
    let dev = backend.publish_volume(&publish_req(&id)).expect("publish")[DEVICE_PATH_KEY].clone();
    let data: Vec<(u64, Vec<u8>)> = (0..32u64)
        .map(|i| (i * MIB, vec![(i as u8).wrapping_add(1); MIB as usize]))
        .collect();
    write_through(&dev, &data);
    let free = || {
        let st = rustix::fs::statvfs(xfs.mnt.as_path()).expect("statvfs");
        st.f_bavail * st.f_frsize
    };
    // Let the data reach the file before measuring.
    File::open(&dev)
        .and_then(|f| f.sync_all())
        .expect("flush device");
    let before = free();
    let snap = backend
        .create_snapshot(&NewSnapshot {
            name: "s".into(),
            source_volume_id: id.clone(),
            parameters: Parameters::new(),
        })
        .expect("snapshot");
    let used = before.saturating_sub(free());
    assert!(used < 4 * MIB, "a reflinked snapshot used {used} bytes");
    let restored = backend
        .create_volume(&new_volume(
            "pvc-y",
            64 * MIB,
            Some(ContentSource::Snapshot(snap.id.clone())),
        ))
        .expect("restore");
    let rdev = backend
        .publish_volume(&publish_req(&restored.id))
        .expect("publish restored")[DEVICE_PATH_KEY]
        .clone();
    read_back(&rdev, &data);
    for v in [&id, &restored.id] {
        backend.unpublish_volume(v, None).expect("unpublish");
    }
    assert!(wait_unbound(&dev, &xfs.dir) && wait_unbound(&rdev, &xfs.dir));
}

/// Env var that turns [`controller_child_process`] into a controller serving that dir.
const CHILD_DIR_ENV: &str = "MOOR_CONTROLLER_TEST_CHILD_DIR";

/// Not a test of its own: when [`CHILD_DIR_ENV`] is set (by
/// [`killed_controller_loses_nothing`], which runs this test binary again as a child), it is a
/// controller process serving `<dir>/csi.sock` on `<dir>/data` until it is killed.
#[test]
fn controller_child_process() {
    use moor_controller::identity::IdentityService;
    use moor_controller::service::ControllerService;
    use moor_proto::csi::v1 as csi;
    let Ok(dir) = std::env::var(CHILD_DIR_ENV) else {
        return;
    };
    let dir = PathBuf::from(dir);
    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    runtime.block_on(async move {
        let (backend, report) = EmbeddedBackend::open(
            Config {
                data_dir: dir.join("data"),
                node_id: NODE.into(),
                topology_key: "topology.moor.csi.io/node".into(),
            },
            LoopAttacher::new(),
        )
        .expect("open backend");
        eprintln!("child controller: {report:?}");
        let backend = Arc::new(backend);
        let socket = dir.join("csi.sock");
        let listener = moor_runtime::server::bind_unix(&socket).expect("bind");
        let router = tonic::transport::Server::builder()
            .add_service(csi::identity_server::IdentityServer::new(
                IdentityService::new("moor.csi.io", Arc::clone(&backend)),
            ))
            .add_service(csi::controller_server::ControllerServer::new(
                ControllerService::new(backend),
            ));
        moor_runtime::server::serve(
            router,
            listener,
            &socket,
            std::future::pending(),
            Duration::from_secs(1),
        )
        .await
        .expect("serve");
    });
}

/// A controller child process, killed (SIGKILL) on drop if still running.
struct Child(std::process::Child);

impl Child {
    async fn start(dir: &Path) -> (Self, tonic::transport::Channel) {
        let socket = dir.join("csi.sock");
        let _ = fs::remove_file(&socket);
        let child = std::process::Command::new(std::env::current_exe().expect("test binary"))
            .args(["--exact", "controller_child_process", "--nocapture"])
            .env(CHILD_DIR_ENV, dir)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .spawn()
            .expect("spawn child controller");
        let child = Self(child);
        let start = Instant::now();
        loop {
            if let Ok(ch) = moor_privileged::client::connect(&socket).await {
                return (child, ch);
            }
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "the child controller did not come up"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    fn kill(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Drop for Child {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Detaches every loop device bound to a file under `dir`, then removes `dir`.
struct DirGuard(PathBuf);

impl Drop for DirGuard {
    fn drop(&mut self) {
        let attacher = LoopAttacher::new();
        if let Ok(list) = attacher.list() {
            for a in list {
                if a.backing.starts_with(&self.0) {
                    let _ = attacher.detach(&a.device, a.file);
                }
            }
        }
        let _ = fs::remove_dir_all(&self.0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_controller_loses_nothing() {
    use csi::controller_client::ControllerClient;
    use moor_proto::csi::v1 as csi;
    moor_privileged::require_root();
    let guard = DirGuard(temp_dir("sigkill"));
    let dir = guard.0.clone();
    let ours = |dir: &Path| -> Vec<(PathBuf, String)> {
        loop_devices()
            .into_iter()
            .filter(|(_, b)| b.starts_with(dir.to_str().unwrap_or("/nonexistent")))
            .collect()
    };
    let cap = csi::VolumeCapability {
        access_mode: Some(csi::volume_capability::AccessMode {
            mode: csi::volume_capability::access_mode::Mode::SingleNodeWriter as i32,
        }),
        access_type: Some(csi::volume_capability::AccessType::Block(
            csi::volume_capability::BlockVolume {},
        )),
    };
    let create = |name: &str| csi::CreateVolumeRequest {
        name: name.into(),
        capacity_range: Some(csi::CapacityRange {
            required_bytes: 4 << 20,
            limit_bytes: 0,
        }),
        volume_capabilities: vec![cap.clone()],
        ..Default::default()
    };
    let publish = |id: &str| csi::ControllerPublishVolumeRequest {
        volume_id: id.into(),
        node_id: NODE.into(),
        volume_capability: Some(cap.clone()),
        ..Default::default()
    };

    let (mut child, ch) = Child::start(&dir).await;
    let mut c = ControllerClient::new(ch);
    let a = c
        .create_volume(create("pvc-a"))
        .await
        .expect("create a")
        .into_inner()
        .volume
        .expect("a");
    let b = c
        .create_volume(create("pvc-b"))
        .await
        .expect("create b")
        .into_inner()
        .volume
        .expect("b");
    let ctx = c
        .controller_publish_volume(publish(&a.volume_id))
        .await
        .expect("publish a")
        .into_inner()
        .publish_context;
    write_through(&ctx[DEVICE_PATH_KEY], &pattern(7)[..1]);
    child.kill();
    // The attach outlived the controller.
    assert_eq!(
        sysfs_backing(&ctx[DEVICE_PATH_KEY]).as_deref(),
        Some(ctx[BACKING_FILE_KEY].as_str())
    );

    let (mut child, ch) = Child::start(&dir).await;
    let mut c = ControllerClient::new(ch);
    let list = c
        .list_volumes(csi::ListVolumesRequest::default())
        .await
        .expect("list")
        .into_inner();
    assert_eq!(list.entries.len(), 2, "no volume lost");
    for e in &list.entries {
        let id = &e.volume.as_ref().expect("volume").volume_id;
        let nodes = &e.status.as_ref().expect("status").published_node_ids;
        assert_eq!(*nodes == vec![NODE.to_string()], *id == a.volume_id);
    }
    let again = c
        .controller_publish_volume(publish(&a.volume_id))
        .await
        .expect("publish a again")
        .into_inner()
        .publish_context;
    assert_eq!(again, ctx, "the same attach, recovered");
    assert_eq!(ours(&dir).len(), 1, "no device leaked");
    read_back(&ctx[DEVICE_PATH_KEY], &pattern(7)[..1]);
    let ctx_b = c
        .controller_publish_volume(publish(&b.volume_id))
        .await
        .expect("publish b")
        .into_inner()
        .publish_context;
    child.kill();

    let (mut child, ch) = Child::start(&dir).await;
    let mut c = ControllerClient::new(ch);
    assert_eq!(ours(&dir).len(), 2);
    for id in [&a.volume_id, &b.volume_id] {
        c.controller_unpublish_volume(csi::ControllerUnpublishVolumeRequest {
            volume_id: id.clone(),
            node_id: NODE.into(),
            ..Default::default()
        })
        .await
        .expect("unpublish");
        c.delete_volume(csi::DeleteVolumeRequest {
            volume_id: id.clone(),
            ..Default::default()
        })
        .await
        .expect("delete");
    }
    child.kill();
    assert!(wait_unbound(&ctx[DEVICE_PATH_KEY], &dir));
    assert!(wait_unbound(&ctx_b[DEVICE_PATH_KEY], &dir));
    assert!(ours(&dir).is_empty());
}
