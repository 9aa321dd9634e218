//! Crash safety (run as root): `moor-node` is killed with SIGKILL at every step of every
//! operation, restarted, and kubelet's retry of the call that was cut short is replayed. After
//! every round: the retry succeeds, the mount table is exactly what it should be (one mount on
//! each path that should have one, none elsewhere), the data written in the first round is
//! intact (so the device was never formatted again), and nothing leaks.

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Duration;

use csi::node_client::NodeClient;
use csi::volume_capability::access_mode::Mode;
use moor_node::crash_points;
use moor_privileged::client::{Daemon, connect};
use moor_privileged::requests::{unpublish_req, unstage_req};
use moor_privileged::{Sandbox, fs_cap, mount_depth, runtime};
use moor_proto::csi::v1 as csi;
use tonic::transport::Channel;

const MIB: u64 = 1 << 20;
/// Rounds per crash point for the steady-state operations.
const REPEATS: usize = 12;
/// Rounds per crash point of a first stage (each needs a fresh blank device).
const FORMAT_REPEATS: usize = 4;
const MARKER: &[u8] = b"written before any crash";
/// The test build of moor-node, with the `crash-points` feature (`.ci/test` builds it:
/// `cargo build -p moor-node --bin moor-node --features crash-points`, copied to this name).
const CRASH_NODE: &str = "moor-node-crash-points";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    Stage,
    Publish,
    Expand,
    Unpublish,
    Unstage,
}

const CYCLE: [Op; 5] = [
    Op::Stage,
    Op::Publish,
    Op::Expand,
    Op::Unpublish,
    Op::Unstage,
];

fn op_of(point: &str) -> Op {
    match point.split('.').next() {
        Some("stage") => Op::Stage,
        Some("publish") => Op::Publish,
        Some("expand") => Op::Expand,
        Some("unpublish") => Op::Unpublish,
        _ => Op::Unstage,
    }
}

struct World {
    sb: Sandbox,
    socket: PathBuf,
    dev: PathBuf,
    image: String,
    size: u64,
    staging: PathBuf,
    target: PathBuf,
    daemon: Option<Daemon>,
    /// What the filesystem keeps of its device for itself, once measured.
    fs_overhead: Option<u64>,
}

fn cap() -> csi::VolumeCapability {
    fs_cap("xfs", Mode::SingleNodeWriter)
}

impl World {
    fn new(name: &str) -> Self {
        let sb = Sandbox::new(name);
        let image = "vol.img".to_string();
        let size = 512 * MIB;
        let dev = sb.loop_device(&image, size);
        let socket = sb.root.join("csi.sock");
        let staging = sb.staging("pv");
        let target = sb.target("pod", "pv");
        Self {
            sb,
            socket,
            dev,
            image,
            size,
            staging,
            target,
            daemon: None,
            fs_overhead: None,
        }
    }

    async fn start(&mut self, crash_at: Option<&str>) -> NodeClient<Channel> {
        if let Some(mut d) = self.daemon.take() {
            let _ = d.child.kill();
            let _ = d.child.wait();
        }
        let env: Vec<(&str, &str)> = crash_at
            .map(|p| (crash_points::ENV, p))
            .into_iter()
            .collect();
        let d = Daemon::start_program_env(
            CRASH_NODE,
            &self.socket,
            &self.sb.node_args("crash-node", &["--log-format", "json"]),
            &env,
        )
        .await;
        self.daemon = Some(d);
        NodeClient::new(connect(&self.socket).await.expect("connect"))
    }

    /// Waits for the daemon to have died (it kills itself at the crash point).
    fn reap(&mut self) {
        let mut d = self.daemon.take().expect("daemon");
        let status = d.child.wait().expect("wait");
        assert!(!status.success(), "the daemon should have been killed");
    }

    async fn call(&mut self, node: &mut NodeClient<Channel>, op: Op) -> Result<(), tonic::Status> {
        match op {
            Op::Stage => node
                .node_stage_volume(csi::NodeStageVolumeRequest {
                    volume_id: "vol".into(),
                    publish_context: HashMap::from([(
                        "devicePath".into(),
                        self.dev.display().to_string(),
                    )]),
                    staging_target_path: self.staging.display().to_string(),
                    volume_capability: Some(cap()),
                    ..Default::default()
                })
                .await
                .map(drop),
            Op::Publish => node
                .node_publish_volume(csi::NodePublishVolumeRequest {
                    volume_id: "vol".into(),
                    staging_target_path: self.staging.display().to_string(),
                    target_path: self.target.display().to_string(),
                    volume_capability: Some(cap()),
                    ..Default::default()
                })
                .await
                .map(drop),
            Op::Expand => node
                .node_expand_volume(csi::NodeExpandVolumeRequest {
                    volume_id: "vol".into(),
                    volume_path: self.target.display().to_string(),
                    staging_target_path: self.staging.display().to_string(),
                    volume_capability: Some(cap()),
                    ..Default::default()
                })
                .await
                .map(drop),
            Op::Unpublish => node
                .node_unpublish_volume(unpublish_req("vol", &self.target))
                .await
                .map(drop),
            Op::Unstage => node
                .node_unstage_volume(unstage_req("vol", &self.staging))
                .await
                .map(drop),
        }
    }

    /// The mount table and the data are what `op` having succeeded means.
    fn check_after(&mut self, op: Op, round: &str) {
        let (staged, published) = match op {
            Op::Stage | Op::Unpublish => (1, 0),
            Op::Publish | Op::Expand => (1, 1),
            Op::Unstage => (0, 0),
        };
        assert_eq!(
            mount_depth(&self.staging),
            staged,
            "{round}: staging mounts"
        );
        assert_eq!(
            mount_depth(&self.target),
            published,
            "{round}: target mounts"
        );
        if published == 1 {
            let data = std::fs::read(self.target.join("marker")).expect("marker");
            assert_eq!(data, MARKER, "{round}: data intact");
        }
        if op == Op::Unpublish {
            assert!(!self.target.exists(), "{round}: target removed");
        }
        if matches!(op, Op::Stage | Op::Expand) {
            // The filesystem fills its device, less what it keeps for itself (the xfs log),
            // measured after the first stage, which formats the whole device.
            let vfs = rustix::fs::statvfs(&self.staging).expect("statvfs");
            let short = self.size - vfs.f_blocks * vfs.f_frsize;
            let overhead = *self.fs_overhead.get_or_insert(short);
            assert!(
                short <= overhead + MIB,
                "{round}: the filesystem was not grown to its device: {short} bytes short, \
                 {overhead} after mkfs"
            );
        }
    }

    /// One cycle of kubelet's calls with the daemon armed to die at `point`.
    async fn cycle(&mut self, point: Option<&str>, round: &str) {
        let armed = point.map(op_of);
        let mut node = self.start(point).await;
        for op in CYCLE {
            // The device grows before each stage (the filesystem is then grown at stage, as for
            // a restore into a larger volume) and before each expansion.
            if matches!(op, Op::Stage | Op::Expand) {
                self.size += 16 * MIB;
                self.sb.grow_loop(&self.dev, &self.image, self.size);
            }
            let first = self.call(&mut node, op).await;
            if Some(op) == armed {
                assert!(first.is_err(), "{round}: {op:?} should have been cut short");
                self.reap();
                node = self.start(None).await;
                self.call(&mut node, op)
                    .await
                    .unwrap_or_else(|e| panic!("{round}: kubelet's retry of {op:?}: {e:?}"));
            } else {
                first.unwrap_or_else(|e| panic!("{round}: {op:?}: {e:?}"));
            }
            if op == Op::Publish && !self.target.join("marker").exists() {
                std::fs::write(self.target.join("marker"), MARKER).expect("write marker");
            }
            self.check_after(op, round);
        }
    }
}

impl Drop for World {
    fn drop(&mut self) {
        if let Some(mut d) = self.daemon.take() {
            let _ = d.child.kill();
            let _ = d.child.wait();
        }
    }
}

#[test]
fn every_step_of_every_operation_survives_a_kill() {
    let mut w = World::new("crash-steps");
    let rt = runtime();
    rt.block_on(async {
        // The first cycle formats the device and writes the marker.
        w.cycle(None, "first").await;
        let points: Vec<&str> = crash_points::POINTS
            .iter()
            .copied()
            .filter(|p| !p.starts_with("stage.format"))
            .collect();
        let mut rounds = 0;
        for rep in 0..REPEATS {
            for point in &points {
                w.cycle(Some(point), &format!("{point} #{rep}")).await;
                rounds += 1;
            }
        }
        eprintln!("crash rounds survived: {rounds}");
    });
    assert!(w.sb.mounts().is_empty(), "{:?}", w.sb.mounts());
}

#[test]
fn a_first_stage_cut_short_during_mkfs_formats_only_its_own_device() {
    let sb_name = "crash-format";
    let rt = runtime();
    let mut w = World::new(sb_name);
    rt.block_on(async {
        let mut n = 0;
        for rep in 0..FORMAT_REPEATS {
            for point in ["stage.formatting", "stage.formatted"] {
                // A fresh blank device for each first stage.
                n += 1;
                w.image = format!("blank-{n}.img");
                w.size = 512 * MIB;
                w.fs_overhead = None;
                w.dev = w.sb.loop_device(&w.image, w.size);
                w.staging = w.sb.staging(&format!("pv{n}"));
                w.target = w.sb.target("pod", &format!("pv{n}"));
                w.cycle(Some(point), &format!("{point} #{rep}")).await;
            }
        }
    });
    assert!(w.sb.mounts().is_empty(), "{:?}", w.sb.mounts());
}

/// A tiny deterministic generator for kill instants.
fn next(seed: &mut u64) -> u64 {
    *seed = seed
        .wrapping_mul(6_364_136_223_846_793_005)
        .wrapping_add(1_442_695_040_888_963_407);
    *seed >> 33
}

#[test]
fn kills_at_random_instants_lose_nothing() {
    let mut w = World::new("crash-random");
    let rt = runtime();
    rt.block_on(async {
        w.cycle(None, "first").await;
        let mut seed = 0x6d6f_6f72;
        let mut kills = 0;
        for round in 0..40 {
            let mut node = w.start(None).await;
            for op in CYCLE {
                if op == Op::Expand {
                    w.size += 16 * MIB;
                    w.sb.grow_loop(&w.dev, &w.image, w.size);
                }
                let delay = Duration::from_micros(next(&mut seed) % 12_000);
                let pid = w.daemon.as_ref().map(|d| d.child.id());
                let killer = std::thread::spawn(move || {
                    std::thread::sleep(delay);
                    if let Some(pid) = pid.and_then(|p| rustix::process::Pid::from_raw(p as i32)) {
                        let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
                    }
                });
                let first = w.call(&mut node, op).await;
                killer.join().expect("killer");
                let round_name = format!("random #{round} {op:?} after {delay:?}");
                // Whether or not the call got through before the kill, the daemon is dead now:
                // restart it and replay the call as kubelet does when it saw no answer.
                let _ = w.daemon.as_mut().map(|d| d.child.wait());
                w.daemon = None;
                kills += 1;
                node = w.start(None).await;
                // kubelet retries a call that failed, and may repeat one that succeeded but
                // whose answer it lost.
                let what = if first.is_err() { "retry" } else { "repeat" };
                if let Err(e) = w.call(&mut node, op).await {
                    let daemon = w.daemon.as_mut().map(|d| d.child.try_wait());
                    panic!("{round_name}: {what}: {e:?}; the daemon: {daemon:?}");
                }
                if op == Op::Publish && !w.target.join("marker").exists() {
                    panic!("{round_name}: the data is gone");
                }
                w.check_after(op, &round_name);
            }
        }
        eprintln!("random kills survived: {kills}");
    });
    assert!(w.sb.mounts().is_empty(), "{:?}", w.sb.mounts());
}

#[test]
fn the_release_build_ignores_crash_points() {
    // moor-node as built for a release has no crash points: the variable does nothing.
    let mut w = World::new("crash-release");
    let rt = runtime();
    rt.block_on(async {
        let d = Daemon::start_program_env(
            "moor-node",
            &w.socket,
            &w.sb.node_args("release-node", &["--log-format", "json"]),
            &[(crash_points::ENV, "stage.formatting")],
        )
        .await;
        w.daemon = Some(d);
        let mut node = NodeClient::new(connect(&w.socket).await.expect("connect"));
        w.call(&mut node, Op::Stage).await.expect("stage");
        let alive = w.daemon.as_mut().map(|d| d.child.try_wait());
        assert!(
            matches!(alive, Some(Ok(None))),
            "the daemon must live: {alive:?}"
        );
        w.call(&mut node, Op::Unstage).await.expect("unstage");
    });
    assert!(w.sb.mounts().is_empty(), "{:?}", w.sb.mounts());
}
