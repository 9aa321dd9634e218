//! The harness for moor's tests that need root.
//!
//! Each test calls [`Sandbox::new`], which moves the test's thread into its own private mount
//! namespace and makes a temporary kubelet dir, state dir and data dir. Loop devices made with
//! [`Sandbox::loop_device`] are detached, mounts below the sandbox are lazily unmounted and
//! the files removed when the sandbox drops, also when the test fails: nothing outlives a test.

use std::os::unix::fs::FileTypeExt as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

pub mod client;
pub mod gosym;
pub mod idmap;
pub mod kubelet_calls;
pub mod luks;
pub mod pathgrpc;
pub mod requests;

/// A test's private world.
#[derive(Debug)]
pub struct Sandbox {
    /// Root of everything the test makes.
    pub root: PathBuf,
    /// The kubelet dir.
    pub kubelet: PathBuf,
    /// moor-node's state dir.
    pub state: PathBuf,
    /// Where backing files live.
    pub data: PathBuf,
    loops: std::sync::Mutex<Vec<(PathBuf, std::fs::File)>>,
}

/// Panics unless running as root (these tests need it).
pub fn require_root() {
    assert!(
        rustix::process::geteuid().is_root(),
        "the privileged tests need root (run them as root, as CI does)"
    );
}

/// A tmpfs on `dir` in the sandbox's mount namespace, with `data` as its options.
fn tmpfs_on(dir: &Path, data: &std::ffi::CStr) {
    rustix::mount::mount(
        "moor-bench",
        dir,
        "tmpfs",
        rustix::mount::MountFlags::NOSUID | rustix::mount::MountFlags::NODEV,
        data,
    )
    .unwrap_or_else(|e| panic!("tmpfs on {}: {e}", dir.display()));
}

impl Sandbox {
    /// Enters a private mount namespace on this thread and makes the sandbox dirs.
    pub fn new(name: &str) -> Self {
        require_root();
        moor_runtime::sys::mount_namespace::enter_private_mount_namespace()
            .expect("private mount namespace");
        static N: AtomicU32 = AtomicU32::new(0);
        let root = std::env::temp_dir().join(format!(
            "moor-priv-{name}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&root);
        let kubelet = root.join("kubelet");
        let state = root.join("state");
        let data = root.join("data");
        for d in [&kubelet, &state, &data] {
            std::fs::create_dir_all(d).expect("sandbox dir");
        }
        Self {
            root,
            kubelet,
            state,
            data,
            loops: std::sync::Mutex::new(Vec::new()),
        }
    }

    /// The node service of an engine in this process on the sandbox's kubelet and state
    /// dirs, with the engine's defaults otherwise.
    pub fn node_service(&self) -> moor_node::service::NodeService<moor_node::sys::linux::Linux> {
        self.node_service_with(&self.state, |_| {})
    }

    /// [`node_service`](Self::node_service) on the state dir `state`, its engine's settings
    /// changed by `config` first.
    pub fn node_service_with(
        &self,
        state: &Path,
        config: impl FnOnce(&mut moor_node::engine::EngineConfig),
    ) -> moor_node::service::NodeService<moor_node::sys::linux::Linux> {
        use std::sync::Arc;
        let os = Arc::new(moor_node::sys::linux::Linux::new(&self.kubelet).expect("os"));
        let (journal, _) = moor_node::journal::Journal::open(state, false).expect("journal");
        let mut cfg = moor_node::engine::EngineConfig {
            kubelet_dir: self.kubelet.clone(),
            ..moor_node::engine::EngineConfig::default()
        };
        config(&mut cfg);
        let engine = moor_node::engine::Engine::new(os, Arc::new(journal), cfg);
        let info = moor_node::service::PluginInfo {
            driver_name: "moor.csi.io".into(),
            node_id: "n1".into(),
            max_volumes: 0,
            topology_key: "topology.moor.csi.io/node".into(),
            state_dir: state.to_path_buf(),
        };
        moor_node::service::NodeService::new(Arc::new(engine), info)
    }

    /// moor-node's arguments for this sandbox: `--node-id node_id`, its state and kubelet
    /// dirs, then `extra`.
    pub fn node_args(&self, node_id: &str, extra: &[&str]) -> Vec<String> {
        let mut args = vec![
            "--node-id".to_string(),
            node_id.to_string(),
            "--state-dir".to_string(),
            self.state.display().to_string(),
            "--kubelet-dir".to_string(),
            self.kubelet.display().to_string(),
        ];
        args.extend(extra.iter().map(|a| (*a).to_string()));
        args
    }

    /// Puts the data dir on a tmpfs, so the loop devices made after this are backed by memory:
    /// a device flush (an ext4 or xfs unmount, mkfs) then ends in RAM instead of on this
    /// machine's disk, whose latency is the same for every caller but swings widely. The
    /// benches of mounting a device use it; the tmpfs goes when the sandbox drops.
    pub fn data_in_memory(&self) {
        tmpfs_on(&self.data, c"mode=0700");
    }

    /// A tmpfs on the kubelet dir, before any daemon starts on it: dirs made and removed there
    /// (staging dirs, targets) then cost the same from one run to the next, where on the host's
    /// ext4 every new inode skips those deleted in the last minutes (a storm bench makes and
    /// removes thousands). The tmpfs goes when the sandbox drops.
    pub fn kubelet_in_memory(&self) {
        tmpfs_on(&self.kubelet, c"mode=0750");
    }

    /// A sparse backing file of `size` bytes attached as a loop device; returns the device.
    pub fn loop_device(&self, name: &str, size: u64) -> PathBuf {
        self.loop_device_bound(name, size, false, &["--direct-io=off"])
    }

    /// A backing file of `size` bytes, sparse or (`preallocate`) allocated with fallocate as
    /// a thick volume's is, attached as a loop device with losetup's `binding` options
    /// (`--direct-io=on`, `--sector-size=4096`, ...); returns the device.
    pub fn loop_device_bound(
        &self,
        name: &str,
        size: u64,
        preallocate: bool,
        binding: &[&str],
    ) -> PathBuf {
        let file = self.data.join(name);
        let f = std::fs::File::create(&file).expect("backing file");
        f.set_len(size).expect("sparse size");
        if preallocate {
            rustix::fs::fallocate(&f, rustix::fs::FallocateFlags::empty(), 0, size)
                .expect("fallocate the backing file");
        }
        drop(f);
        let out = Command::new("losetup")
            .args(["--find", "--show"])
            .args(binding)
            .arg(&file)
            .output()
            .expect("losetup");
        assert!(
            out.status.success(),
            "losetup: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let dev = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        // Hold the device open and ask for its detach now: the kernel marks a busy loop device
        // autoclear, so it goes when the last user does, even if this process is killed.
        let held = std::fs::File::open(&dev).expect("open loop device");
        let _ = Command::new("losetup").arg("-d").arg(&dev).status();
        self.loops
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push((dev.clone(), held));
        dev
    }

    /// Grows the backing file of `dev` and tells the loop driver.
    pub fn grow_loop(&self, dev: &Path, name: &str, size: u64) {
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(self.data.join(name))
            .expect("open");
        f.set_len(size).expect("grow");
        let st = Command::new("losetup")
            .arg("--set-capacity")
            .arg(dev)
            .status()
            .expect("losetup");
        assert!(st.success());
    }

    /// A path below the kubelet dir.
    pub fn k(&self, rel: &str) -> PathBuf {
        self.kubelet.join(rel)
    }

    /// kubelet's staging path for a volume, with its parent and `vol_data.json` made
    /// (kubelet's part).
    pub fn staging(&self, pv: &str) -> PathBuf {
        kubelets_part(self.k(&format!(
            "plugins/kubernetes.io/csi/moor.csi.io/{pv}-hash/globalmount"
        )))
    }

    /// kubelet's publish target for a mount volume, with its parent and `vol_data.json` made.
    pub fn target(&self, pod: &str, pv: &str) -> PathBuf {
        kubelets_part(self.k(&format!("pods/{pod}/volumes/kubernetes.io~csi/{pv}/mount")))
    }

    /// kubelet's publish target for a block volume, with its parent and `vol_data.json` made.
    pub fn block_target(&self, pod: &str, pv: &str) -> PathBuf {
        kubelets_part(self.k(&format!(
            "plugins/kubernetes.io/csi/volumeDevices/publish/{pv}/{pod}"
        )))
    }

    /// Mount points below the sandbox, deepest first, as this thread sees them.
    pub fn mounts(&self) -> Vec<PathBuf> {
        let table = std::fs::read("/proc/thread-self/mountinfo").unwrap_or_default();
        let mut found: Vec<PathBuf> = moor_node::sys::mountinfo::parse(&table)
            .unwrap_or_default()
            .into_iter()
            .map(|m| m.mount_point)
            .filter(|p| p.starts_with(&self.root))
            .collect();
        found.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
        found
    }
}

impl Drop for Sandbox {
    fn drop(&mut self) {
        for m in self.mounts() {
            let _ = rustix::mount::unmount(m.as_path(), rustix::mount::UnmountFlags::DETACH);
        }
        // Closing the held descriptors releases the (autoclear) loop devices.
        self.loops
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clear();
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

/// What kubelet makes before it calls the plugin with `path`: its parent dir, and the
/// `vol_data.json` it keeps for the mount (moor-node reports a mount whose file kubelet lost).
/// The file names the driver and no volume handle (which a test that needs reconciliation to
/// adopt a mount writes itself): nothing is adopted by it.
pub fn kubelets_part(path: PathBuf) -> PathBuf {
    std::fs::create_dir_all(path.parent().expect("parent")).expect("kubelet's dir");
    if let Some(file) = moor_node::reconcile::vol_data_by_shape(&path) {
        std::fs::create_dir_all(file.parent().expect("parent")).expect("vol_data dir");
        if !file.exists() {
            std::fs::write(&file, br#"{"driverName":"moor.csi.io"}"#).expect("vol_data.json");
        }
    }
    path
}

/// Loop devices (`/dev/loopN`) whose backing file lies under `root`, read from sysfs.
pub fn loops_under(root: &Path) -> Vec<PathBuf> {
    let mut found = Vec::new();
    for e in std::fs::read_dir("/sys/block")
        .into_iter()
        .flatten()
        .flatten()
    {
        if let Ok(b) = std::fs::read_to_string(e.path().join("loop/backing_file"))
            && Path::new(b.trim_end().trim_end_matches(" (deleted)")).starts_with(root)
        {
            found.push(Path::new("/dev").join(e.file_name()));
        }
    }
    found
}

/// Waits until no loop device is backed by a file under `root` (a detached device is freed
/// once its last user, udev's probe say, closes it: longer on a busy machine), up to
/// [`client::DEADLINE`]; whether none is.
pub fn no_loops_under(root: &Path) -> bool {
    let start = std::time::Instant::now();
    while !loops_under(root).is_empty() {
        if start.elapsed() > client::DEADLINE {
            return false;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    true
}

/// Mount points under `root` in this thread's mount namespace.
pub fn mounts_under(root: &Path) -> Vec<PathBuf> {
    let table = std::fs::read("/proc/thread-self/mountinfo").expect("mountinfo");
    moor_node::sys::mountinfo::parse(&table)
        .expect("parse mountinfo")
        .into_iter()
        .map(|m| m.mount_point)
        .filter(|p| p.starts_with(root))
        .collect()
}

/// On drop: unmounts (lazily, deepest first) everything under its dir in this thread's mount
/// namespace, then detaches every loop device backed by a file under it (those a daemon
/// attached, or the test with losetup): what a failed test leaves.
#[derive(Debug)]
pub struct LoopSweep(pub PathBuf);

impl Drop for LoopSweep {
    fn drop(&mut self) {
        let mut mounts = mounts_under(&self.0);
        mounts.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
        for m in mounts {
            let _ = rustix::mount::unmount(m.as_path(), rustix::mount::UnmountFlags::DETACH);
        }
        for dev in loops_under(&self.0) {
            let _ = Command::new("losetup").arg("-d").arg(&dev).status();
        }
    }
}

/// The command lines (NULs as spaces) of the running processes that mention `needle`.
pub fn processes_mentioning(needle: &str) -> Vec<String> {
    let mut found = Vec::new();
    for e in std::fs::read_dir("/proc").expect("/proc").flatten() {
        if let Ok(cmd) = std::fs::read(e.path().join("cmdline"))
            && String::from_utf8_lossy(&cmd).contains(needle)
        {
            found.push(String::from_utf8_lossy(&cmd).replace('\0', " "));
        }
    }
    found
}

/// Writes `data` at `offset` of a block device (or file).
pub fn write_at(dev: &Path, offset: u64, data: &[u8]) {
    use std::os::unix::fs::FileExt as _;
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(dev)
        .expect("open for write");
    f.write_all_at(data, offset).expect("write");
    f.sync_all().expect("sync");
}

/// Reads `len` bytes at `offset`.
pub fn read_at(dev: &Path, offset: u64, len: usize) -> Vec<u8> {
    use std::os::unix::fs::FileExt as _;
    let f = std::fs::File::open(dev).expect("open for read");
    let mut buf = vec![0u8; len];
    f.read_exact_at(&mut buf, offset).expect("read");
    buf
}

/// Whether `path` is a block device.
pub fn is_block_device(path: &Path) -> bool {
    std::fs::metadata(path)
        .map(|m| m.file_type().is_block_device())
        .unwrap_or(false)
}

/// Whether the file at `path` is the root of a mount.
pub fn is_mount_point(path: &Path) -> bool {
    rustix::fs::statx(
        rustix::fs::CWD,
        path,
        rustix::fs::AtFlags::SYMLINK_NOFOLLOW,
        rustix::fs::StatxFlags::TYPE,
    )
    .map(|s| {
        s.stx_attributes
            .contains(rustix::fs::StatxAttributes::MOUNT_ROOT)
    })
    .unwrap_or(false)
}

/// Runs a program and asserts it succeeded.
/// Unmounts `at` (not lazily) once nothing holds it: a child another test of this process
/// forks holds a copy of every descriptor, also of files open in the mount, from its fork
/// until its exec closes them (close-on-exec), so the mount can be busy for that moment.
/// EBUSY is waited out until [`client::DEADLINE`]; any other error, or a mount still busy
/// then, panics with what it waited for.
pub fn unmount_when_free(at: &Path) {
    let deadline = std::time::Instant::now() + client::DEADLINE;
    loop {
        match rustix::mount::unmount(at, rustix::mount::UnmountFlags::empty()) {
            Ok(()) => return,
            Err(rustix::io::Errno::BUSY) if std::time::Instant::now() < deadline => {
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            Err(e) => panic!(
                "unmount {} (waited up to {:?} for it to be free): {e}",
                at.display(),
                client::DEADLINE
            ),
        }
    }
}

pub fn run(program: &str, args: &[&str]) {
    let out = Command::new(program).args(args).output().expect(program);
    assert!(
        out.status.success(),
        "{program} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// How many mounts sit on `path` in this thread's mount namespace (stacked ones count).
pub fn mount_depth(path: &Path) -> usize {
    let table = std::fs::read("/proc/thread-self/mountinfo").unwrap_or_default();
    moor_node::sys::mountinfo::parse(&table)
        .unwrap_or_default()
        .iter()
        .filter(|m| m.mount_point == path)
        .count()
}

/// A current-thread tokio runtime: daemons it starts inherit this thread's mount namespace.
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime")
}

/// A mount volume capability for `fs` with access `mode`.
pub fn fs_cap(
    fs: &str,
    mode: moor_proto::csi::v1::volume_capability::access_mode::Mode,
) -> moor_proto::csi::v1::VolumeCapability {
    use moor_proto::csi::v1::volume_capability::{AccessMode, AccessType, MountVolume};
    moor_proto::csi::v1::VolumeCapability {
        access_mode: Some(AccessMode { mode: mode as i32 }),
        access_type: Some(AccessType::Mount(MountVolume {
            fs_type: fs.into(),
            mount_flags: vec![],
            volume_mount_group: String::new(),
        })),
    }
}
