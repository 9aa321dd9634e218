//! NodeStageVolume finding its device by identity on real loop devices, with systemd-udevd
//! running and without it (run as root).
//!
//! The tests share the node's udev state (a test starts udevd), so they run one at a time.

use std::collections::HashMap;
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use csi::volume_capability::{AccessMode, AccessType, BlockVolume, MountVolume, access_mode::Mode};
use moor_node::engine::{Engine, EngineConfig};
use moor_node::journal::Journal;
use moor_node::service::{NodeService, PluginInfo};
use moor_node::sys::discovery::{UDEV_CONTROL_SOCKET, udevd_running};
use moor_node::sys::linux::Linux;
use moor_node::sys::loopinfo;
use moor_privileged::client::DEADLINE;
use moor_privileged::{Sandbox, is_mount_point, loops_under, no_loops_under, read_at};
use moor_proto::csi::v1 as csi;
use moor_proto::csi::v1::node_server::Node as _;
use tonic::{Code, Request};

const MIB: u64 = 1 << 20;
/// NETLINK_KOBJECT_UEVENT, the protocol of both the kernel's and udevd's event sockets.
const NETLINK_KOBJECT_UEVENT: u32 = 15;

/// One of these tests at a time on the host, not only in this process: whether systemd-udevd
/// runs, and what it does to /dev, is the host's, and another checkout's test run (another
/// engineer's, CI's) starts and stops udevd too. An exclusive flock on a file every run
/// opens, held until the guard drops (also when the test fails); it also orders this
/// process's threads, as each takes the lock through an open of its own.
fn one_at_a_time() -> std::fs::File {
    let path = std::env::temp_dir().join("moor-discovery-tests.lock");
    let lock = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    rustix::fs::flock(&lock, rustix::fs::FlockOperation::LockExclusive)
        .unwrap_or_else(|e| panic!("flock {}: {e}", path.display()));
    lock
}

/// Whether the test can run with these events: without udevd only if none runs on the host.
fn possible(events: Events) -> bool {
    if events == Events::Kernel && udevd_running() {
        eprintln!("skipped: systemd-udevd runs on this host, kernel events cannot be tested alone");
        return false;
    }
    true
}

/// Where events come from during a test.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Events {
    /// No udevd: the kernel's uevents.
    Kernel,
    /// systemd-udevd runs for the test.
    Udev,
}

/// systemd-udevd, started for one test, in its own process group; stopped (the whole group)
/// and waited for when dropped, and what it changed on the node undone: its run dir removed if
/// the test made it, the links it made under /dev removed, and the owners and modes it gave
/// device nodes (its `static_node` rules) restored.
struct Udevd {
    child: Child,
    made_run_dir: bool,
    dev_before: DevState,
}

/// Directories of /dev where udevd makes links.
const UDEV_LINK_DIRS: [&str; 3] = ["/dev/disk", "/dev/block", "/dev/char"];

/// What udevd may change in /dev: the owner and mode of the nodes directly in it, and every
/// path below its link dirs.
struct DevState {
    nodes: HashMap<PathBuf, (u32, u32, u32)>,
    links: std::collections::BTreeSet<PathBuf>,
}

impl DevState {
    fn read() -> Self {
        use std::os::unix::fs::{FileTypeExt as _, MetadataExt as _};
        let mut nodes = HashMap::new();
        for e in std::fs::read_dir("/dev").into_iter().flatten().flatten() {
            if let Ok(m) = std::fs::symlink_metadata(e.path())
                && (m.file_type().is_char_device() || m.file_type().is_block_device())
            {
                nodes.insert(e.path(), (m.mode() & 0o7777, m.uid(), m.gid()));
            }
        }
        let mut links = std::collections::BTreeSet::new();
        for dir in UDEV_LINK_DIRS {
            walk(Path::new(dir), &mut links);
        }
        Self { nodes, links }
    }

    /// Undoes what changed since `self` was read.
    fn restore(&self) {
        let now = Self::read();
        for (path, (mode, uid, gid)) in &self.nodes {
            if now.nodes.get(path) != Some(&(*mode, *uid, *gid)) {
                let _ = std::os::unix::fs::chown(path, Some(*uid), Some(*gid));
                let _ = std::fs::set_permissions(
                    path,
                    std::os::unix::fs::PermissionsExt::from_mode(*mode),
                );
            }
        }
        // Deepest first, so a dir goes after what it holds.
        for path in now.links.iter().rev() {
            if !self.links.contains(path) {
                let _ = std::fs::remove_file(path).or_else(|_| std::fs::remove_dir(path));
            }
        }
    }
}

/// Every path below `dir`, and `dir` itself if it exists (symlinks not followed).
fn walk(dir: &Path, out: &mut std::collections::BTreeSet<PathBuf>) {
    let Ok(m) = std::fs::symlink_metadata(dir) else {
        return;
    };
    out.insert(dir.to_path_buf());
    if m.is_dir() {
        for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            walk(&e.path(), out);
        }
    }
}

impl Udevd {
    /// Starts systemd-udevd, unless one runs on this host already (then it is used).
    fn start() -> Option<Self> {
        if udevd_running() {
            return None;
        }
        let program = [
            "/lib/systemd/systemd-udevd",
            "/usr/lib/systemd/systemd-udevd",
        ]
        .into_iter()
        .find(|p| Path::new(p).exists())
        .expect("systemd-udevd is installed (package udev)");
        let made_run_dir = !Path::new("/run/udev").exists();
        let dev_before = DevState::read();
        let mut cmd = Command::new(program);
        cmd.stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0);
        // Not left running on the host if the test process is killed: it stops its workers
        // on SIGTERM.
        moor_runtime::sys::parent_death::die_with_parent(&mut cmd, rustix::process::Signal::TERM);
        let child = cmd.spawn().expect("start systemd-udevd");
        let mut udevd = Self {
            child,
            made_run_dir,
            dev_before,
        };
        // Wait for its control socket to accept connections (a condition, not a time).
        let start = std::time::Instant::now();
        while start.elapsed() < DEADLINE {
            if udevd_running() {
                return Some(udevd);
            }
            if let Ok(Some(status)) = udevd.child.try_wait() {
                panic!("systemd-udevd exited at start: {status}");
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        panic!("systemd-udevd did not open {UDEV_CONTROL_SOCKET} within {DEADLINE:?}");
    }
}

impl Drop for Udevd {
    fn drop(&mut self) {
        let pid = rustix::process::Pid::from_child(&self.child);
        // Its workers share its process group: stop them all.
        let _ = rustix::process::kill_process_group(pid, rustix::process::Signal::TERM);
        let _ = self.child.wait();
        let _ = rustix::process::kill_process_group(pid, rustix::process::Signal::KILL);
        if self.made_run_dir {
            let _ = std::fs::remove_dir_all("/run/udev");
        }
        self.dev_before.restore();
    }
}

/// A loop device this test attached itself; detached when dropped (if still in use, the
/// kernel clears it when its last user goes).
struct Attached(PathBuf);

impl Drop for Attached {
    fn drop(&mut self) {
        let _ = Command::new("losetup").arg("-d").arg(&self.0).status();
    }
}

/// Attaches `file` to the first free loop device, or to `dev`.
fn attach(file: &Path, dev: Option<&Path>) -> Option<Attached> {
    let mut cmd = Command::new("losetup");
    match dev {
        Some(d) => cmd.arg(d).arg(file),
        None => cmd.args(["--find", "--show"]).arg(file),
    };
    let out = cmd.output().expect("losetup");
    if !out.status.success() {
        return None;
    }
    Some(Attached(match dev {
        Some(d) => d.to_path_buf(),
        None => PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()),
    }))
}

fn sparse_file(sb: &Sandbox, name: &str, size: u64) -> PathBuf {
    let p = sb.data.join(name);
    let f = std::fs::File::create(&p).expect("backing file");
    f.set_len(size).expect("size");
    p
}

/// Whether this process has a bound uevent netlink socket (a udev or kernel monitor).
fn watching_uevents() -> bool {
    let table = std::fs::read_to_string("/proc/net/netlink").unwrap_or_default();
    let inodes: Vec<String> = table
        .lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let proto: u32 = f.get(1)?.parse().ok()?;
            (proto == NETLINK_KOBJECT_UEVENT).then(|| f.get(9).map(|s| (*s).to_string()))?
        })
        .collect();
    let Ok(fds) = std::fs::read_dir("/proc/self/fd") else {
        return false;
    };
    fds.flatten().any(|e| {
        std::fs::read_link(e.path()).is_ok_and(|l| {
            let l = l.to_string_lossy();
            inodes.iter().any(|i| l == format!("socket:[{i}]"))
        })
    })
}

struct TestNode {
    svc: NodeService<Linux>,
    engine: Arc<Engine<Linux>>,
}

fn node(sb: &Sandbox, deadline: Duration) -> TestNode {
    let os = Arc::new(Linux::new(&sb.kubelet).expect("os"));
    let (journal, _) = Journal::open(&sb.state, false).expect("journal");
    let cfg = EngineConfig {
        kubelet_dir: sb.kubelet.clone(),
        discovery_deadline: deadline,
        ..EngineConfig::default()
    };
    let engine = Arc::new(Engine::new(os, Arc::new(journal), cfg));
    let info = PluginInfo {
        driver_name: "moor.csi.io".into(),
        node_id: "n1".into(),
        max_volumes: 0,
        topology_key: "topology.moor.csi.io/node".into(),
        state_dir: sb.state.clone(),
    };
    TestNode {
        svc: NodeService::new(Arc::clone(&engine), info),
        engine,
    }
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

fn ext4() -> csi::VolumeCapability {
    csi::VolumeCapability {
        access_mode: Some(AccessMode {
            mode: Mode::SingleNodeWriter as i32,
        }),
        access_type: Some(AccessType::Mount(MountVolume {
            fs_type: "ext4".into(),
            mount_flags: vec![],
            volume_mount_group: String::new(),
        })),
    }
}

fn block() -> csi::VolumeCapability {
    csi::VolumeCapability {
        access_mode: Some(AccessMode {
            mode: Mode::SingleNodeWriter as i32,
        }),
        access_type: Some(AccessType::Block(BlockVolume {})),
    }
}

fn stage_req(
    vol: &str,
    ctx: &[(&str, &Path)],
    staging: &Path,
    cap: csi::VolumeCapability,
) -> csi::NodeStageVolumeRequest {
    csi::NodeStageVolumeRequest {
        volume_id: vol.into(),
        publish_context: ctx
            .iter()
            .map(|(k, v)| ((*k).to_string(), v.display().to_string()))
            .collect(),
        staging_target_path: staging.display().to_string(),
        volume_capability: Some(cap),
        secrets: HashMap::new(),
        volume_context: HashMap::new(),
    }
}

impl TestNode {
    async fn stage(&self, req: csi::NodeStageVolumeRequest) -> Result<(), tonic::Status> {
        self.svc
            .node_stage_volume(Request::new(req))
            .await
            .map(drop)
    }

    async fn unstage(&self, vol: &str, staging: &Path) {
        self.svc
            .node_unstage_volume(Request::new(csi::NodeUnstageVolumeRequest {
                volume_id: vol.into(),
                staging_target_path: staging.display().to_string(),
            }))
            .await
            .expect("unstage");
    }

    fn staged_device(&self, vol: &str) -> Option<PathBuf> {
        self.engine
            .journal()
            .get(vol)
            .and_then(|r| r.stage)
            .map(|s| s.device)
    }
}

/// NodeStageVolume starts before the volume's loop device exists; another thread attaches it
/// once stage is watching for events. Stage must find it and use it.
fn a_device_attached_while_stage_waits_is_found(events: Events) {
    let _one = one_at_a_time();
    let sb = Sandbox::new("disc-late");
    if !possible(events) {
        return;
    }
    let _udevd = (events == Events::Udev).then(Udevd::start);
    assert_eq!(udevd_running(), events == Events::Udev);
    let n = node(&sb, Duration::from_secs(60));
    let file = sparse_file(&sb, "late.img", 64 * MIB);
    let staging = sb.staging("pv-late");

    let attacher = {
        let file = file.clone();
        std::thread::spawn(move || {
            // Attach only once stage is subscribed (its event socket is bound).
            let start = std::time::Instant::now();
            while start.elapsed() < DEADLINE {
                if watching_uevents() {
                    return attach(&file, None);
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            None
        })
    };
    let staged = rt().block_on(n.stage(stage_req(
        "vol-late",
        &[("backingFile", &file)],
        &staging,
        block(),
    )));
    let attached = attacher
        .join()
        .expect("attacher thread")
        .expect("attached the device while stage waited");
    staged.expect("stage finds the device that appeared");
    assert_eq!(n.staged_device("vol-late").as_deref(), Some(&*attached.0));
    rt().block_on(n.unstage("vol-late", &staging));
    drop(attached);
}

/// A loop number the volume once had now serves another file; a file of the volume's name
/// that was unlinked and recreated is not the volume either. Neither is formatted or mounted.
fn a_reused_device_number_is_refused(events: Events) {
    let _one = one_at_a_time();
    let sb = Sandbox::new("disc-reuse");
    if !possible(events) {
        return;
    }
    let _udevd = (events == Events::Udev).then(Udevd::start);
    assert_eq!(udevd_running(), events == Events::Udev);
    let n = node(&sb, Duration::from_secs(60));
    let vol_a = sparse_file(&sb, "vol-a.img", 64 * MIB);
    let vol_b = sparse_file(&sb, "vol-b.img", 64 * MIB);
    let staging = sb.staging("pv-a");

    // Attach A, detach it, and give its number to B (another test may take the number in
    // between: then try again). A detach is done once the device's last user (udev's probe,
    // say) closes it: until then A is still bound, and would be found.
    let (reused, dev) = (0..20)
        .find_map(|_| {
            let a = attach(&vol_a, None)?;
            let dev = a.0.clone();
            drop(a);
            assert!(
                no_loops_under(&vol_a),
                "vol-a.img still bound: {:?}",
                loops_under(&vol_a)
            );
            attach(&vol_b, Some(&dev)).map(|b| (b, dev))
        })
        .expect("reattach a loop number to another file");
    let err = rt()
        .block_on(n.stage(stage_req(
            "vol-a",
            &[("devicePath", &dev), ("backingFile", &vol_a)],
            &staging,
            ext4(),
        )))
        .expect_err("another volume's device");
    assert_eq!(err.code(), Code::FailedPrecondition, "{}", err.message());
    assert!(
        err.message().contains("vol-a.img") && err.message().contains("vol-b.img"),
        "{}",
        err.message()
    );
    assert!(!is_mount_point(&staging));
    assert!(
        read_at(&dev, 0, 256 * 1024).iter().all(|b| *b == 0),
        "the device was written"
    );
    drop(reused);

    // The volume's file unlinked and recreated under its name while still attached.
    let old = attach(&vol_a, None).expect("attach");
    std::fs::remove_file(&vol_a).expect("unlink");
    let vol_a = sparse_file(&sb, "vol-a.img", 64 * MIB);
    let err = rt()
        .block_on(n.stage(stage_req(
            "vol-a",
            &[("devicePath", &old.0), ("backingFile", &vol_a)],
            &staging,
            ext4(),
        )))
        .expect_err("the unlinked file's device");
    assert_eq!(err.code(), Code::FailedPrecondition, "{}", err.message());
    assert!(err.message().contains("(deleted)"), "{}", err.message());
    assert!(!is_mount_point(&staging));
    assert!(read_at(&old.0, 0, 256 * 1024).iter().all(|b| *b == 0));
    drop(old);
}

#[test]
fn kernel_events_find_a_device_attached_while_stage_waits() {
    a_device_attached_while_stage_waits_is_found(Events::Kernel);
}

#[test]
fn udev_events_find_a_device_attached_while_stage_waits() {
    a_device_attached_while_stage_waits_is_found(Events::Udev);
}

#[test]
fn kernel_events_reused_device_number_is_refused() {
    a_reused_device_number_is_refused(Events::Kernel);
}

#[test]
fn udev_events_reused_device_number_is_refused() {
    a_reused_device_number_is_refused(Events::Udev);
}

#[test]
fn a_device_already_attached_is_found_by_identity_alone() {
    let _one = one_at_a_time();
    let sb = Sandbox::new("disc-present");
    let n = node(&sb, Duration::from_secs(60));
    let file = sparse_file(&sb, "present.img", 64 * MIB);
    let dev = attach(&file, None).expect("attach");
    let staging = sb.staging("pv-present");
    rt().block_on(n.stage(stage_req(
        "vol-present",
        &[("backingFile", &file)],
        &staging,
        ext4(),
    )))
    .expect("stage by identity");
    assert!(is_mount_point(&staging));
    assert_eq!(n.staged_device("vol-present").as_deref(), Some(&*dev.0));
    rt().block_on(n.unstage("vol-present", &staging));
    drop(dev);
}

#[test]
fn a_device_that_never_appears_is_deadline_exceeded() {
    let _one = one_at_a_time();
    let sb = Sandbox::new("disc-never");
    let n = node(&sb, Duration::from_secs(2));
    let file = sparse_file(&sb, "never.img", 64 * MIB);
    let staging = sb.staging("pv-never");
    let err = rt()
        .block_on(n.stage(stage_req(
            "vol-never",
            &[("backingFile", &file)],
            &staging,
            ext4(),
        )))
        .expect_err("never attached");
    assert_eq!(err.code(), Code::DeadlineExceeded, "{}", err.message());
    assert!(err.message().contains("never.img"), "{}", err.message());
    assert!(!is_mount_point(&staging));
}

#[test]
fn a_loop_device_reports_the_inode_it_reads() {
    let _one = one_at_a_time();
    let sb = Sandbox::new("disc-inode");
    let a = sparse_file(&sb, "ino-a.img", 16 * MIB);
    let b = sparse_file(&sb, "ino-b.img", 16 * MIB);
    let dev = attach(&a, None).expect("attach");
    let got = loopinfo::backing_inode(&dev.0).expect("LOOP_GET_STATUS64");
    assert_eq!(got, loopinfo::file_inode(&a).expect("stat"));
    assert_ne!(got, loopinfo::file_inode(&b).expect("stat"));
    drop(dev);
}
