//! RBD volumes on a real Ceph cluster (run as root): `moor-node --rbd-attacher fuse` maps
//! images with rbd-fuse and a loop device, stages, publishes, unstages and unmaps them, and
//! survives being killed in the middle of a map or an unmap.
//!
//! The cluster is the one `.ci/ceph-cluster up` prints the environment of (`MOOR_CEPH_CONF`,
//! `MOOR_CEPH_KEYRING`, `MOOR_CEPH_USER`, `MOOR_CEPH_POOL`, `MOOR_CEPH_MON_HOST`); `.ci/test`
//! brings one up. Without it every test says it is skipped and passes. Each test makes its
//! own images and removes them; whatever a failed test leaves (loop devices, rbd-fuse, mounts)
//! is removed when it ends.

use std::collections::HashMap;
use std::os::unix::fs::FileExt as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use csi::node_client::NodeClient;
use csi::volume_capability::access_mode::Mode;
use csi::volume_capability::{AccessMode, AccessType, BlockVolume};
use moor_node::crash_points;
use moor_node::sys::loopdev;
use moor_privileged::client::{Daemon, connect};
use moor_privileged::requests::{unpublish_req, unstage_req};
use moor_privileged::{Sandbox, fs_cap, mount_depth, processes_mentioning, runtime};
use moor_proto::csi::v1 as csi;
use moor_runtime::contract::{
    RBD_IMAGE_KEY as IMAGE_KEY, RBD_MONITORS_KEY as MONITORS_KEY, RBD_POOL_KEY as POOL_KEY,
    RBD_USER_ID_SECRET as USER_ID_KEY, RBD_USER_KEY_SECRET as USER_KEY_KEY,
};
use tonic::transport::Channel;

const MIB: u64 = 1 << 20;
const MARKER: &[u8] = b"written through rbd-fuse before the unmap";
/// The test build of moor-node with crash points (see privileged/tests/crash.rs).
const CRASH_NODE: &str = "moor-node-crash-points";

/// The cluster the environment names.
#[derive(Debug, Clone)]
struct Ceph {
    conf: String,
    user: String,
    pool: String,
    mons: String,
    key: String,
}

impl Ceph {
    /// The cluster, or None (with the reason printed) when the environment names none.
    fn from_env(test: &str) -> Option<Self> {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        let (Some(conf), Some(keyring)) = (var("MOOR_CEPH_CONF"), var("MOOR_CEPH_KEYRING")) else {
            eprintln!(
                "{test}: skipped: no Ceph cluster (MOOR_CEPH_CONF and MOOR_CEPH_KEYRING are \
                 unset; .ci/ceph-cluster up DIR prints them, and .ci/test brings one up)"
            );
            return None;
        };
        let text = std::fs::read_to_string(&keyring).expect("keyring");
        let key = text
            .lines()
            .find_map(|l| {
                let (k, v) = l.split_once('=')?;
                (k.trim() == "key").then(|| v.trim().to_string())
            })
            .expect("a key in the keyring");
        moor_privileged::require_root();
        Some(Self {
            conf,
            user: var("MOOR_CEPH_USER").unwrap_or_else(|| "moor".into()),
            pool: var("MOOR_CEPH_POOL").unwrap_or_else(|| "moor".into()),
            mons: var("MOOR_CEPH_MON_HOST").unwrap_or_else(|| "127.0.0.1:3300".into()),
            key,
        })
    }

    /// Runs `rbd` on the pool as the test user; its stdout.
    fn rbd(&self, args: &[&str]) -> Result<String, String> {
        let out = Command::new("timeout")
            .args([
                "120", "rbd", "-c", &self.conf, "--id", &self.user, "-p", &self.pool,
            ])
            .args(args)
            .output()
            .map_err(|e| e.to_string())?;
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).into_owned())
        } else {
            Err(String::from_utf8_lossy(&out.stderr).into_owned())
        }
    }

    fn create(&self, image: &str, size_mib: u64) {
        let _ = self.rbd(&["rm", "--no-progress", image]);
        self.rbd(&["create", "--size", &format!("{size_mib}M"), image])
            .unwrap_or_else(|e| panic!("rbd create {image}: {e}"));
    }

    /// Who has the image open (its watchers), as `rbd status` says.
    fn watchers(&self, image: &str) -> usize {
        self.rbd(&["status", image])
            .unwrap_or_default()
            .lines()
            .filter(|l| l.trim_start().starts_with("watcher="))
            .count()
    }
}

/// One simulated node: a moor-node with its own state and kubelet dirs.
struct Node {
    name: String,
    state: PathBuf,
    kubelet: PathBuf,
    socket: PathBuf,
    log: PathBuf,
    daemon: Option<Daemon>,
}

/// A test's world: a sandbox (its own mount namespace), the nodes, the images; all of it
/// removed when dropped, also after a failure.
struct World {
    sb: Sandbox,
    ceph: Ceph,
    nodes: Vec<Node>,
    images: Vec<String>,
    /// More moor-node arguments.
    extra: Vec<String>,
}

impl World {
    fn new(name: &str, ceph: Ceph, nodes: usize) -> Self {
        let sb = Sandbox::new(name);
        let nodes = (0..nodes)
            .map(|i| {
                let (state, kubelet) = if i == 0 {
                    (sb.state.clone(), sb.kubelet.clone())
                } else {
                    (
                        sb.root.join(format!("state-{i}")),
                        sb.root.join(format!("kubelet-{i}")),
                    )
                };
                std::fs::create_dir_all(&state).expect("state dir");
                std::fs::create_dir_all(&kubelet).expect("kubelet dir");
                Node {
                    name: format!("node-{i}"),
                    state,
                    kubelet,
                    socket: sb.root.join(format!("csi-{i}.sock")),
                    log: sb.root.join(format!("node-{i}.log")),
                    daemon: None,
                }
            })
            .collect();
        Self {
            sb,
            ceph,
            nodes,
            images: Vec::new(),
            extra: Vec::new(),
        }
    }

    fn image(&mut self, name: &str, size_mib: u64) -> String {
        let image = format!("{name}-{}", std::process::id());
        self.ceph.create(&image, size_mib);
        self.images.push(image.clone());
        image
    }

    /// (Re)starts node `i`'s moor-node (`program`, with `env`), and connects to it.
    async fn start(
        &mut self,
        i: usize,
        program: &str,
        env: &[(&str, &str)],
    ) -> NodeClient<Channel> {
        let extra = self.extra.clone();
        let n = &mut self.nodes[i];
        if let Some(mut d) = n.daemon.take() {
            let _ = d.child.kill();
            let _ = d.child.wait();
        }
        let args: Vec<String> = [
            "--node-id",
            &n.name,
            "--state-dir",
            &n.state.display().to_string(),
            "--kubelet-dir",
            &n.kubelet.display().to_string(),
            "--rbd-attacher",
            "fuse",
            "--log-format",
            "json",
            "--reconcile-interval",
            "0",
        ]
        .iter()
        .map(|s| (*s).to_string())
        .chain(extra)
        .collect();
        let bin = moor_privileged::client::binary(program);
        assert!(bin.exists(), "{} is not built", bin.display());
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&n.log)
            .expect("log");
        let child = Command::new(bin)
            .arg("--endpoint")
            .arg(format!("unix://{}", n.socket.display()))
            .args(&args)
            .envs(env.iter().copied())
            .stdin(std::process::Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn moor-node");
        let mut d = Daemon {
            child,
            socket: n.socket.clone(),
        };
        d.wait_answering().await;
        n.daemon = Some(d);
        NodeClient::new(connect(&n.socket).await.expect("connect"))
    }

    fn staging(&self, i: usize, pv: &str) -> PathBuf {
        let p = self.nodes[i].kubelet.join(format!(
            "plugins/kubernetes.io/csi/moor.csi.io/{pv}/globalmount"
        ));
        std::fs::create_dir_all(p.parent().expect("parent")).expect("staging parent");
        p
    }

    fn target(&self, i: usize, pv: &str) -> PathBuf {
        let p = self.nodes[i]
            .kubelet
            .join(format!("pods/pod/volumes/kubernetes.io~csi/{pv}/mount"));
        std::fs::create_dir_all(p.parent().expect("parent")).expect("target parent");
        p
    }

    fn block_target(&self, i: usize, pv: &str) -> PathBuf {
        let p = self.nodes[i].kubelet.join(format!(
            "plugins/kubernetes.io/csi/volumeDevices/publish/{pv}/pod"
        ));
        std::fs::create_dir_all(p.parent().expect("parent")).expect("target parent");
        p
    }

    fn stage_req(
        &self,
        vol: &str,
        image: &str,
        staging: &Path,
        cap: csi::VolumeCapability,
    ) -> csi::NodeStageVolumeRequest {
        csi::NodeStageVolumeRequest {
            volume_id: vol.into(),
            publish_context: HashMap::from([
                (POOL_KEY.into(), self.ceph.pool.clone()),
                (IMAGE_KEY.into(), image.into()),
                (MONITORS_KEY.into(), self.ceph.mons.clone()),
            ]),
            staging_target_path: staging.display().to_string(),
            volume_capability: Some(cap),
            secrets: HashMap::from([
                (USER_ID_KEY.into(), self.ceph.user.clone()),
                (USER_KEY_KEY.into(), self.ceph.key.clone()),
            ]),
            volume_context: HashMap::new(),
        }
    }

    /// What of node `i`'s mappings is on the machine: rbd-fuse processes, loop devices bound
    /// to its image files, FUSE mounts.
    fn leftovers(&self, i: usize) -> (usize, usize, usize) {
        let rbd_dir = self.nodes[i].state.join("rbd");
        let daemons = processes_mentioning(&rbd_dir.display().to_string())
            .iter()
            .filter(|c| c.contains("rbd-fuse"))
            .count();
        let loops = loopdev::bound_under(&rbd_dir).len();
        let mounts = self
            .sb
            .mounts()
            .iter()
            .filter(|m| m.starts_with(&rbd_dir))
            .count();
        (daemons, loops, mounts)
    }

    fn log(&self, i: usize) -> String {
        std::fs::read_to_string(&self.nodes[i].log).unwrap_or_default()
    }

    /// The milliseconds of every log line whose message is `msg` (the engine logs them in
    /// `ms`).
    fn logged_ms(&self, i: usize, msg: &str) -> Vec<f64> {
        self.log(i)
            .lines()
            .filter_map(|l| {
                let v: serde_json::Value = serde_json::from_str(l).ok()?;
                (v.get("message")? == msg)
                    .then(|| v.get("ms").and_then(serde_json::Value::as_f64))
                    .flatten()
            })
            .collect()
    }
}

impl Drop for World {
    fn drop(&mut self) {
        for n in &mut self.nodes {
            if let Some(mut d) = n.daemon.take() {
                let _ = d.child.kill();
                let _ = d.child.wait();
            }
        }
        // What is mounted of the volumes goes first (it holds the loop devices), then the
        // loop devices, then rbd-fuse and its mounts.
        for m in self.sb.mounts() {
            if !m.starts_with(self.sb.root.join("state")) {
                let _ = rustix::mount::unmount(m.as_path(), rustix::mount::UnmountFlags::DETACH);
            }
        }
        for n in &self.nodes {
            let rbd_dir = n.state.join("rbd");
            for (l, _) in loopdev::bound_under(&rbd_dir) {
                let _ = loopdev::detach(&l.path);
            }
        }
        for n in &self.nodes {
            let needle = n.state.join("rbd").display().to_string();
            for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
                let Ok(cmd) = std::fs::read(e.path().join("cmdline")) else {
                    continue;
                };
                if String::from_utf8_lossy(&cmd).contains(&needle)
                    && let Some(pid) = e
                        .file_name()
                        .to_str()
                        .and_then(|p| p.parse().ok())
                        .and_then(rustix::process::Pid::from_raw)
                {
                    let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
                }
            }
        }
        for m in self.sb.mounts() {
            let _ = rustix::mount::unmount(m.as_path(), rustix::mount::UnmountFlags::DETACH);
        }
        for image in &self.images {
            // Its watchers (a killed rbd-fuse's) time out on the cluster's side first.
            for _ in 0..60 {
                if self.ceph.rbd(&["rm", "--no-progress", image]).is_ok() {
                    break;
                }
                std::thread::sleep(Duration::from_secs(1));
            }
        }
    }
}

fn ext4() -> csi::VolumeCapability {
    fs_cap("ext4", Mode::SingleNodeWriter)
}

fn block(mode: Mode) -> csi::VolumeCapability {
    csi::VolumeCapability {
        access_mode: Some(AccessMode { mode: mode as i32 }),
        access_type: Some(AccessType::Block(BlockVolume {})),
    }
}

fn publish(
    vol: &str,
    staging: &Path,
    target: &Path,
    cap: csi::VolumeCapability,
) -> csi::NodePublishVolumeRequest {
    csi::NodePublishVolumeRequest {
        volume_id: vol.into(),
        staging_target_path: staging.display().to_string(),
        target_path: target.display().to_string(),
        volume_capability: Some(cap),
        ..Default::default()
    }
}

fn ms(d: Duration) -> String {
    format!("{:.0} ms", d.as_secs_f64() * 1e3)
}

#[test]
fn a_filesystem_keeps_its_data_through_unmap_and_remap() {
    let Some(ceph) = Ceph::from_env("a_filesystem_keeps_its_data_through_unmap_and_remap") else {
        return;
    };
    let mut w = World::new("rbd-fs", ceph, 1);
    let image = w.image("fs", 256);
    let staging = w.staging(0, "pv");
    let target = w.target(0, "pv");
    let rt = runtime();
    rt.block_on(async {
        let mut node = w.start(0, "moor-node", &[]).await;
        let t = Instant::now();
        node.node_stage_volume(w.stage_req("vol", &image, &staging, ext4()))
            .await
            .expect("first stage (map, mkfs, mount)");
        let first_stage = t.elapsed();
        assert_eq!(
            w.leftovers(0),
            (1, 1, 1),
            "one rbd-fuse, one loop device, one mount"
        );
        // The device is the loop device over the image file, with direct I/O.
        let (l, file) = loopdev::bound_under(&w.nodes[0].state.join("rbd"))
            .pop()
            .expect("loop");
        assert_eq!(
            file.file_name().and_then(|f| f.to_str()),
            Some(image.as_str())
        );
        let sys = format!(
            "/sys/block/{}/loop/dio",
            l.path
                .file_name()
                .and_then(|f| f.to_str())
                .unwrap_or_default()
        );
        assert_eq!(std::fs::read_to_string(sys).expect("dio").trim(), "1");
        node.node_publish_volume(publish("vol", &staging, &target, ext4()))
            .await
            .expect("publish");
        let f = std::fs::File::create(target.join("marker")).expect("create");
        f.write_all_at(MARKER, 0).expect("write");
        f.sync_all().expect("fsync");
        drop(f);
        node.node_unpublish_volume(unpublish_req("vol", &target))
            .await
            .expect("unpublish");
        let t = Instant::now();
        node.node_unstage_volume(unstage_req("vol", &staging))
            .await
            .expect("unstage (unmount, unmap)");
        let unstage = t.elapsed();
        assert_eq!(w.leftovers(0), (0, 0, 0), "nothing of the mapping left");
        assert!(
            !w.nodes[0]
                .state
                .join("rbd")
                .read_dir()
                .is_ok_and(|mut d| d.next().is_some())
        );
        assert_eq!(w.ceph.watchers(&image), 0, "rbd-fuse closed the image");

        let t = Instant::now();
        node.node_stage_volume(w.stage_req("vol", &image, &staging, ext4()))
            .await
            .expect("second stage (map, mount)");
        let second_stage = t.elapsed();
        node.node_publish_volume(publish("vol", &staging, &target, ext4()))
            .await
            .expect("publish again");
        assert_eq!(
            std::fs::read(target.join("marker")).expect("marker"),
            MARKER,
            "the data is intact"
        );
        node.node_unpublish_volume(unpublish_req("vol", &target))
            .await
            .expect("unpublish");
        node.node_unstage_volume(unstage_req("vol", &staging))
            .await
            .expect("unstage");
        assert_eq!(w.leftovers(0), (0, 0, 0));
        let maps = w.logged_ms(0, "mapped RBD image");
        let unmaps = w.logged_ms(0, "unmapped RBD image");
        eprintln!(
            "rbd-fuse: first stage {} (map, mkfs.ext4 of 256 MiB, mount), second stage {}, \
             unstage {}; map {maps:?} ms, unmap {unmaps:?} ms",
            ms(first_stage),
            ms(second_stage),
            ms(unstage)
        );
        assert_eq!((maps.len(), unmaps.len()), (2, 2), "{}", w.log(0));
    });
}

#[test]
fn a_block_volume_keeps_its_bytes_through_unmap_and_remap() {
    let Some(ceph) = Ceph::from_env("a_block_volume_keeps_its_bytes_through_unmap_and_remap")
    else {
        return;
    };
    let mut w = World::new("rbd-block", ceph, 1);
    let image = w.image("block", 64);
    let staging = w.staging(0, "pv");
    let target = w.block_target(0, "pv");
    let cap = || block(Mode::SingleNodeWriter);
    let rt = runtime();
    rt.block_on(async {
        let mut node = w.start(0, "moor-node", &[]).await;
        for round in 0..2 {
            node.node_stage_volume(w.stage_req("vol", &image, &staging, cap()))
                .await
                .expect("stage");
            node.node_publish_volume(publish("vol", &staging, &target, cap()))
                .await
                .expect("publish");
            let dev = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(&target)
                .expect("open the published device");
            if round == 0 {
                dev.write_all_at(MARKER, 3 * MIB).expect("write");
                dev.sync_all().expect("fsync");
            } else {
                let mut got = vec![0u8; MARKER.len()];
                dev.read_exact_at(&mut got, 3 * MIB).expect("read");
                assert_eq!(got, MARKER, "the bytes are intact");
            }
            drop(dev);
            node.node_unpublish_volume(unpublish_req("vol", &target))
                .await
                .expect("unpublish");
            node.node_unstage_volume(unstage_req("vol", &staging))
                .await
                .expect("unstage");
            assert_eq!(w.leftovers(0), (0, 0, 0), "round {round}");
        }
    });
}

#[test]
fn a_reader_only_image_is_mapped_read_only_on_two_nodes() {
    let Some(ceph) = Ceph::from_env("a_reader_only_image_is_mapped_read_only_on_two_nodes") else {
        return;
    };
    let mut w = World::new("rbd-ro", ceph, 2);
    let image = w.image("ro", 128);
    let rt = runtime();
    rt.block_on(async {
        // Written once, read-write, on node 0.
        let mut a = w.start(0, "moor-node", &[]).await;
        let staging = w.staging(0, "pv");
        let target = w.target(0, "pv");
        a.node_stage_volume(w.stage_req("vol", &image, &staging, ext4()))
            .await
            .expect("stage rw");
        a.node_publish_volume(publish("vol", &staging, &target, ext4()))
            .await
            .expect("publish rw");
        std::fs::write(target.join("marker"), MARKER).expect("write");
        a.node_unpublish_volume(unpublish_req("vol", &target))
            .await
            .expect("unpublish");
        a.node_unstage_volume(unstage_req("vol", &staging))
            .await
            .expect("unstage");

        // Then read-only on both nodes at once.
        let ro = || fs_cap("ext4", Mode::MultiNodeReaderOnly);
        let mut b = w.start(1, "moor-node", &[]).await;
        let stagings = [w.staging(0, "pv"), w.staging(1, "pv")];
        for (i, node) in [&mut a, &mut b].into_iter().enumerate() {
            node.node_stage_volume(w.stage_req("vol", &image, &stagings[i], ro()))
                .await
                .unwrap_or_else(|e| panic!("stage read-only on node {i}: {e:?}"));
        }
        for (i, s) in stagings.iter().enumerate() {
            assert_eq!(w.leftovers(i), (1, 1, 1), "node {i}");
            let (l, _) = loopdev::bound_under(&w.nodes[i].state.join("rbd"))
                .pop()
                .expect("loop");
            assert!(l.read_only, "node {i}: the loop device is read-only");
            assert_eq!(std::fs::read(s.join("marker")).expect("read"), MARKER);
            let e = std::fs::write(s.join("other"), b"x").expect_err("read-only");
            assert_eq!(e.raw_os_error(), Some(libc::EROFS), "node {i}: {e}");
        }
        for (i, node) in [&mut a, &mut b].into_iter().enumerate() {
            node.node_unstage_volume(unstage_req("vol", &stagings[i]))
                .await
                .unwrap_or_else(|e| panic!("unstage on node {i}: {e:?}"));
            assert_eq!(w.leftovers(i), (0, 0, 0), "node {i}");
        }
    });
}

/// kubelet's NodeStageVolume or NodeUnstageVolume, as the crash rounds send them.
async fn call(
    w: &World,
    node: &mut NodeClient<Channel>,
    stage: bool,
    image: &str,
    staging: &Path,
) -> Result<(), tonic::Status> {
    if stage {
        node.node_stage_volume(w.stage_req("vol", image, staging, ext4()))
            .await
            .map(drop)
    } else {
        node.node_unstage_volume(unstage_req("vol", staging))
            .await
            .map(drop)
    }
}

/// The machine after a stage (`staged`) or an unstage succeeded: one rbd-fuse, one loop
/// device, one FUSE mount and the staging mount holding the marker, or nothing at all.
fn check(w: &World, staging: &Path, staged: bool, round: &str) {
    let want = if staged { (1, 1, 1) } else { (0, 0, 0) };
    assert_eq!(
        w.leftovers(0),
        want,
        "{round}: rbd-fuse, loop devices, FUSE mounts"
    );
    assert_eq!(
        mount_depth(staging),
        usize::from(staged),
        "{round}: staging mounts"
    );
    if staged {
        assert_eq!(
            std::fs::read(staging.join("marker")).expect("marker"),
            MARKER,
            "{round}: the data is intact"
        );
    }
}

#[test]
fn a_kill_during_a_map_or_an_unmap_is_converged_by_the_retry() {
    let Some(ceph) = Ceph::from_env("a_kill_during_a_map_or_an_unmap_is_converged_by_the_retry")
    else {
        return;
    };
    let mut w = World::new("rbd-crash", ceph, 1);
    let image = w.image("crash", 128);
    let staging = w.staging(0, "pv");
    let rt = runtime();
    rt.block_on(async {
        // The first stage formats; the marker is written on the staged filesystem.
        let mut node = w.start(0, CRASH_NODE, &[]).await;
        call(&w, &mut node, true, &image, &staging)
            .await
            .expect("first stage");
        std::fs::write(staging.join("marker"), MARKER).expect("marker");
        rustix::fs::sync();
        call(&w, &mut node, false, &image, &staging)
            .await
            .expect("first unstage");
        check(&w, &staging, false, "first");

        for point in crash_points::MAP_POINTS {
            let stage = point.starts_with("map.");
            if !stage {
                // An unmap follows a stage.
                let mut node = w.start(0, CRASH_NODE, &[]).await;
                call(&w, &mut node, true, &image, &staging)
                    .await
                    .unwrap_or_else(|e| panic!("{point}: stage: {e:?}"));
            }
            let mut node = w.start(0, CRASH_NODE, &[(crash_points::ENV, point)]).await;
            let first = call(&w, &mut node, stage, &image, &staging).await;
            assert!(
                first.is_err(),
                "{point}: the call should have been cut short"
            );
            let status = w.nodes[0]
                .daemon
                .as_mut()
                .map(|d| d.child.wait().expect("wait"));
            assert!(status.is_some_and(|s| !s.success()), "{point}: killed");
            // Restarted: the reconciliation at start undoes what the kill cut short (nothing
            // is staged: whatever is mapped goes, and the record with it); then kubelet's
            // retry.
            let undone = |w: &World| {
                w.log(0)
                    .matches("RBD image mapped with nothing staged on it; unmapped")
                    .count()
            };
            let before = undone(&w);
            let mut node = w.start(0, CRASH_NODE, &[]).await;
            assert_eq!(
                undone(&w),
                before + 1,
                "{point}: reconciled at start\n{}",
                w.log(0)
            );
            call(&w, &mut node, stage, &image, &staging)
                .await
                .unwrap_or_else(|e| panic!("{point}: kubelet's retry: {e:?}\n{}", w.log(0)));
            check(&w, &staging, stage, point);
            if stage {
                call(&w, &mut node, false, &image, &staging)
                    .await
                    .unwrap_or_else(|e| panic!("{point}: unstage: {e:?}"));
                check(&w, &staging, false, point);
            }
        }

        // Kills at random instants of a stage and of an unstage.
        let mut seed: u64 = 0x7262_646e;
        for round in 0..6 {
            let stage = round % 2 == 0;
            let mut node = w.start(0, CRASH_NODE, &[]).await;
            seed = seed
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            let delay = Duration::from_millis((seed >> 33) % 1500);
            let pid = w.nodes[0].daemon.as_ref().map(|d| d.child.id());
            let killer = std::thread::spawn(move || {
                std::thread::sleep(delay);
                if let Some(pid) = pid.and_then(|p| rustix::process::Pid::from_raw(p as i32)) {
                    let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
                }
            });
            let _ = call(&w, &mut node, stage, &image, &staging).await;
            killer.join().expect("killer");
            let _ = w.nodes[0].daemon.as_mut().map(|d| d.child.wait());
            let name = format!(
                "random #{round} ({}, kill after {delay:?})",
                if stage { "stage" } else { "unstage" }
            );
            let mut node = w.start(0, CRASH_NODE, &[]).await;
            call(&w, &mut node, stage, &image, &staging)
                .await
                .unwrap_or_else(|e| panic!("{name}: kubelet's retry: {e:?}\n{}", w.log(0)));
            check(&w, &staging, stage, &name);
        }
        let mut node = w.start(0, CRASH_NODE, &[]).await;
        call(&w, &mut node, false, &image, &staging)
            .await
            .expect("last unstage");
        check(&w, &staging, false, "last");
    });
}

#[test]
fn an_rbd_fuse_that_died_is_replaced_by_the_next_stage() {
    let Some(ceph) = Ceph::from_env("an_rbd_fuse_that_died_is_replaced_by_the_next_stage") else {
        return;
    };
    let mut w = World::new("rbd-died", ceph, 1);
    let image = w.image("died", 64);
    let staging = w.staging(0, "pv");
    let cap = || block(Mode::SingleNodeWriter);
    let rt = runtime();
    rt.block_on(async {
        let mut node = w.start(0, "moor-node", &[]).await;
        node.node_stage_volume(w.stage_req("vol", &image, &staging, cap()))
            .await
            .expect("stage");
        let (old, _) = loopdev::bound_under(&w.nodes[0].state.join("rbd"))
            .pop()
            .expect("loop");
        moor_privileged::write_at(&old.path, MIB, MARKER);
        // rbd-fuse dies: the loop device reads a dead FUSE file.
        let dir = w.nodes[0].state.join("rbd").display().to_string();
        for e in std::fs::read_dir("/proc").expect("/proc").flatten() {
            let cmd = std::fs::read(e.path().join("cmdline")).unwrap_or_default();
            if String::from_utf8_lossy(&cmd).starts_with("/usr/bin/rbd-fuse\0")
                && String::from_utf8_lossy(&cmd).contains(&dir)
                && let Some(pid) = e
                    .file_name()
                    .to_str()
                    .and_then(|p| p.parse().ok())
                    .and_then(rustix::process::Pid::from_raw)
            {
                rustix::process::kill_process(pid, rustix::process::Signal::KILL).expect("kill");
            }
        }
        for _ in 0..500 {
            if w.leftovers(0).0 == 0 {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(
            w.leftovers(0),
            (0, 1, 1),
            "a dead mapping: its loop and mount remain"
        );
        // kubelet stages it again: what is left of the dead mapping goes, and the image is
        // mapped afresh, once, with its bytes.
        let t = Instant::now();
        node.node_stage_volume(w.stage_req("vol", &image, &staging, cap()))
            .await
            .unwrap_or_else(|e| panic!("stage again: {e:?}\n{}", w.log(0)));
        eprintln!(
            "stage after rbd-fuse died: {} (the new rbd-fuse waits for Ceph to break the dead one's lock)",
            ms(t.elapsed())
        );
        assert_eq!(w.leftovers(0), (1, 1, 1));
        let (new, _) = loopdev::bound_under(&w.nodes[0].state.join("rbd"))
            .pop()
            .expect("loop");
        assert_eq!(
            moor_privileged::read_at(&new.path, MIB, MARKER.len()),
            MARKER,
            "the bytes are intact"
        );
        node.node_unstage_volume(unstage_req("vol", &staging))
            .await
            .expect("unstage");
        assert_eq!(w.leftovers(0), (0, 0, 0));
    });
}

#[test]
fn a_key_the_cluster_refuses_is_never_shown_and_leaves_nothing() {
    let Some(ceph) = Ceph::from_env("a_key_the_cluster_refuses_is_never_shown_and_leaves_nothing")
    else {
        return;
    };
    let mut w = World::new("rbd-badkey", ceph, 1);
    let image = w.image("badkey", 64);
    let staging = w.staging(0, "pv");
    let rt = runtime();
    rt.block_on(async {
        let mut node = w.start(0, "moor-node", &[]).await;
        // base64 that is no cephx key (rbd-fuse quotes such a key in its error), and the
        // right user with another user's key.
        for bad in [
            "AQBbadbadbadbadbadbadbadbadbadbadbadbaw==",
            "AQCj2YpkAAAAABAAq3hU4qUwh+5EgPZ1vXuLkQ==",
        ] {
            let mut req = w.stage_req("vol", &image, &staging, ext4());
            req.secrets.insert(USER_KEY_KEY.into(), bad.into());
            let e = node.node_stage_volume(req).await.expect_err("refused");
            assert_eq!(e.code(), tonic::Code::Internal, "{e:?}");
            assert!(!e.message().contains(bad), "{}", e.message());
            assert_eq!(w.leftovers(0), (0, 0, 0), "{bad}");
            assert!(
                !w.nodes[0]
                    .state
                    .join("rbd")
                    .read_dir()
                    .is_ok_and(|mut d| d.next().is_some()),
                "no mount dir and no key file left"
            );
            assert_eq!(mount_depth(&staging), 0);
        }
        // The good key works, and appears nowhere in the log.
        node.node_stage_volume(w.stage_req("vol", &image, &staging, ext4()))
            .await
            .expect("stage");
        node.node_unstage_volume(unstage_req("vol", &staging))
            .await
            .expect("unstage");
        let log = w.log(0);
        assert!(!log.contains(&w.ceph.key), "{log}");
        assert!(!log.contains("AQBbad"), "{log}");
    });
}

/// The rbd-fuse processes serving node `i`'s images.
fn rbd_fuse_pids(w: &World, i: usize) -> Vec<rustix::process::Pid> {
    let dir = w.nodes[i].state.join("rbd").display().to_string();
    std::fs::read_dir("/proc")
        .expect("/proc")
        .flatten()
        .filter_map(|e| {
            let cmd = std::fs::read(e.path().join("cmdline")).ok()?;
            let text = String::from_utf8_lossy(&cmd);
            (text.contains("rbd-fuse\0") && text.contains(&dir))
                .then(|| e.file_name().to_str()?.parse().ok())
                .flatten()
                .and_then(rustix::process::Pid::from_raw)
        })
        .collect()
}

#[test]
fn an_rbd_fuse_that_hangs_is_killed_at_the_unmap_deadline() {
    let Some(ceph) = Ceph::from_env("an_rbd_fuse_that_hangs_is_killed_at_the_unmap_deadline")
    else {
        return;
    };
    let mut w = World::new("rbd-hang", ceph, 1);
    w.extra = vec!["--rbd-unmap-timeout".into(), "3".into()];
    let image = w.image("hang", 64);
    let staging = w.staging(0, "pv");
    let target = w.target(0, "pv");
    let rt = runtime();
    rt.block_on(async {
        let mut node = w.start(0, "moor-node", &[]).await;
        node.node_stage_volume(w.stage_req("vol", &image, &staging, ext4()))
            .await
            .expect("stage");
        node.node_publish_volume(publish("vol", &staging, &target, ext4()))
            .await
            .expect("publish");
        std::fs::write(target.join("marker"), MARKER).expect("write");
        rustix::fs::sync();
        node.node_unpublish_volume(unpublish_req("vol", &target))
            .await
            .expect("unpublish");
        // rbd-fuse stops answering (as on a node cut off from the cluster).
        let pids = rbd_fuse_pids(&w, 0);
        assert_eq!(pids.len(), 1);
        for p in &pids {
            rustix::process::kill_process(*p, rustix::process::Signal::STOP).expect("stop");
        }
        let t = Instant::now();
        // Bounded so that a broken moor-node fails the test instead of hanging it: the
        // stopped rbd-fuse is killed then, which lets the hung unmount end.
        let unstaged = tokio::time::timeout(
            Duration::from_secs(120),
            node.node_unstage_volume(unstage_req("vol", &staging)),
        )
        .await;
        let Ok(unstaged) = unstaged else {
            for p in rbd_fuse_pids(&w, 0) {
                let _ = rustix::process::kill_process(p, rustix::process::Signal::KILL);
            }
            panic!("the unstage hung on the stopped rbd-fuse\n{}", w.log(0));
        };
        unstaged.unwrap_or_else(|e| panic!("unstage: {e:?}\n{}", w.log(0)));
        eprintln!("unstage with a hung rbd-fuse: {}", ms(t.elapsed()));
        assert_eq!(w.leftovers(0), (0, 0, 0), "killed, unbound, unmounted");
        assert!(rbd_fuse_pids(&w, 0).is_empty());
        // The data was on the cluster before rbd-fuse hung: the next stage finds it.
        node.node_stage_volume(w.stage_req("vol", &image, &staging, ext4()))
            .await
            .expect("stage again");
        assert_eq!(
            std::fs::read(staging.join("marker")).expect("marker"),
            MARKER
        );
        node.node_unstage_volume(unstage_req("vol", &staging))
            .await
            .expect("unstage");
        assert_eq!(w.leftovers(0), (0, 0, 0));
    });
}
