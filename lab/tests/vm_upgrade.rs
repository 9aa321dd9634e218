//! An upgrade of moor-node with live volumes on every attacher the guest has (issue 38, point
//! 1; docs/upgrade.md): in one guest of the VM lab on Debian's 6.12 kernel (ublk_drv and rbd),
//! an embedded volume (a loop device over a file), an RBD volume mapped by the kernel client
//! and one served by moor-ublk, each staged and published by moor-node and written by a
//! process appending and fsyncing a record at a time. A node runs one attacher, so two
//! moor-nodes serve them (`--rbd-attacher kernel`, with the embedded volume, and `ublk`), both
//! in one cgroup, the pod's. The upgrade is what a DaemonSet's rolling update does: SIGTERM to
//! each moor-node, then the cgroup killed (`cgroup.kill`: the ublk servers, moor-node's
//! children, die with it); then a second copy of the binary starts on the same state dirs.
//! The writers see no I/O or fsync error and every acknowledged record is there afterwards;
//! the new moor-nodes answer NodeGetVolumeStats, unpublish and unstage for all three, and
//! nothing is left (ublk devices, servers, kernel mappings).
//!
//! Quick by default (a few records either side of the upgrade); `MOOR_VM_UPGRADE_FULL=1` writes
//! more. Skipped, with the reason, without the lab's second kernel (`MOOR_VM_KERNEL_PACKAGE=<pkg>
//! .ci/vm setup`; `MOOR_VM_UBLK_KERNEL` names another) or a cluster on a bridge
//! (`.ci/ceph-cluster up`). Needs `cargo build -p moor-node -p moor-ublk -p moor-controller`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use csi::node_client::NodeClient;
use moor_lab::ceph::{World, ext4, publish};
use moor_lab::krbd_lab::*;
use moor_lab::vm::{acked, assert_writer_clean, fsync_writer};
use moor_privileged::requests::{unpublish_req, unstage_req};
use moor_privileged::runtime;
use moor_proto::csi::v1 as csi;
use moor_runtime::contract::{BACKING_FILE_KEY, DEVICE_PATH_KEY};
use tonic::transport::Channel;

/// Debian's 6.12 from bookworm-backports: ublk_drv and rbd as modules.
const KERNEL: &str = "linux-image-6.12.57+deb12-amd64";
/// How long a step in the guest may take (TCG on a loaded two-core machine is slow).
const DEADLINE: Duration = Duration::from_secs(600);
/// The pod's cgroup in the guest.
const POD: &str = "/sys/fs/cgroup/moor-node-pod";
/// The new binary: a copy of moor-node beside it.
const UPGRADED: &str = "moor-node-upgraded";

fn kernel() -> String {
    std::env::var("MOOR_VM_UBLK_KERNEL").unwrap_or_else(|_| KERNEL.to_string())
}

/// Records each writer acknowledges before the upgrade, and after it.
fn records() -> usize {
    if std::env::var_os("MOOR_VM_UPGRADE_FULL").is_some() {
        50
    } else {
        8
    }
}

/// One of the two moor-nodes: its attacher, socket, state dir (a guest path the host shares)
/// and log.
struct Plugin {
    attacher: &'static str,
    socket: &'static str,
    state: PathBuf,
    log: PathBuf,
}

impl Plugin {
    async fn start(&self, lab: &Lab, program: &str, path: &str) -> NodeClient<Channel> {
        let n = &lab.world.nodes[0];
        let env = [path];
        let wrap = [
            "sh",
            "-c",
            "echo $$ > /sys/fs/cgroup/moor-node-pod/cgroup.procs && exec \"$@\"",
            "sh",
        ];
        let launch = Launch {
            program,
            attacher: self.attacher,
            socket: self.socket,
            wrap: &wrap,
            env: &env,
        };
        std::fs::create_dir_all(&self.state).expect("state dir");
        start_node_as(
            &lab.vms[0],
            &n.name,
            &n.kubelet,
            &launch,
            &self.state,
            &self.log,
        )
        .await
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

/// A volume the test writes: its id, staging and target paths, and its writer's log.
struct Written {
    id: String,
    staging: PathBuf,
    target: PathBuf,
    log: PathBuf,
}

impl Written {
    fn new(w: &World, id: &str, logs: &Path) -> Self {
        Self {
            id: id.to_string(),
            staging: w.staging(0, id),
            target: w.target(0, id),
            log: logs.join(format!("writer-{}.log", id.replace('/', "_"))),
        }
    }

    /// Starts its writer: a record appended and fsynced (fdatasync) at a time, each
    /// acknowledged in its log (outside the volume) only once the fsync succeeded; an error
    /// is logged and ends it. It stops when `stop` shows.
    fn start_writer(&self, lab: &Lab, stop: &Path) {
        let script = fsync_writer(&self.target.join("data"), stop);
        lab.vms[0].spawn(&["sh", "-c", &script], &self.log.display().to_string());
    }

    fn text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn acked(&self) -> Vec<u64> {
        acked(&self.text())
    }

    /// Waits until `check` holds for its log, or it logged an error.
    fn wait(&self, what: &str, check: impl Fn(&str) -> bool) -> String {
        let start = Instant::now();
        loop {
            let text = self.text();
            if check(&text) || text.contains("ERROR") {
                return text;
            }
            assert!(
                start.elapsed() < DEADLINE,
                "waited {DEADLINE:?} for {what} of volume {}: {text}",
                self.id
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

/// Waits until `cmd` in the guest succeeds.
fn wait_guest(lab: &Lab, what: &str, cmd: &str) {
    let start = Instant::now();
    while !lab.vms[0].exec(&["sh", "-c", cmd]).ok() {
        assert!(start.elapsed() < DEADLINE, "waited {DEADLINE:?} for {what}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The moor-ublk processes in the guest that have not exited (pid, parent, state, cgroup,
/// argv), or "". An exited one is left out: a server whose moor-node went before it is
/// reparented to the guest's init, which in a lab guest without udev (virtme-ng's script on
/// the console) reaps no orphan, so it stays a zombie.
fn live_servers(vm: &moor_lab::vm::Vm) -> String {
    vm.sh("ps -C moor-ublk -o pid=,ppid=,stat=,cgroup=,args= | awk '$3 !~ /^Z/' || true")
        .trim()
        .to_string()
}

/// Removes the upgraded binary's copy when dropped.
struct Copy(PathBuf);

impl Drop for Copy {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

#[test]
fn an_upgrade_keeps_every_attachers_volumes_live() {
    let test = "vm-upgrade";
    let Some(mut lab) = Lab::with_kernel(test, 66, &kernel()) else {
        return;
    };
    let node_bin = moor_privileged::client::binary("moor-node");
    let ublk_bin = moor_privileged::client::binary("moor-ublk");
    for b in [&node_bin, &ublk_bin] {
        assert!(b.exists(), "{} is not built", b.display());
    }
    let _copy = Copy(node_bin.with_file_name(UPGRADED));
    std::fs::copy(&node_bin, &_copy.0).expect("a second copy of moor-node");
    let bin_dir = node_bin
        .parent()
        .expect("the binaries' dir")
        .display()
        .to_string();
    let path = format!("PATH={bin_dir}:/usr/sbin:/usr/bin:/sbin:/bin");
    let state = lab.world.nodes[0].state.clone();
    let kernel_node = Plugin {
        attacher: "kernel",
        socket: "/run/moor-kernel.sock",
        state: state.join("kernel"),
        log: state.join("kernel.log"),
    };
    let ublk_node = Plugin {
        attacher: "ublk",
        socket: "/run/moor-ublk.sock",
        state: state.join("ublk"),
        log: state.join("ublk.log"),
    };
    let rt = runtime();
    let mut ctl = rt.block_on(lab.world.start_controller(&[]));
    let lab = lab;
    let vm = &lab.vms[0];
    vm.sh(&format!(
        "grep -q cgroup2 /proc/mounts || mount -t cgroup2 none /sys/fs/cgroup; mkdir -p {POD}"
    ));
    let stop = state.join("stop");
    let n = records();

    rt.block_on(async {
        let mut knode = kernel_node.start(&lab, "moor-node", &path).await;
        let mut unode = ublk_node.start(&lab, "moor-node", &path).await;
        let w = &lab.world;

        // RBD by the kernel client and RBD through moor-ublk.
        let mut vk = create(w, &mut ctl, "upg-krbd", ext4()).await;
        let kctx = attach(w, &mut ctl, &mut vk, 0)
            .await
            .expect("publish (kernel)");
        mount(w, &mut knode, &vk, &kctx, 0)
            .await
            .unwrap_or_else(|e| panic!("stage (kernel): {e:?}: {}", kernel_node.log_text()));
        let mut vu = create(w, &mut ctl, "upg-ublk", ext4()).await;
        let uctx = attach(w, &mut ctl, &mut vu, 0)
            .await
            .expect("publish (ublk)");
        mount(w, &mut unode, &vu, &uctx, 0)
            .await
            .unwrap_or_else(|e| panic!("stage (ublk): {e:?}: {}", ublk_node.log_text()));
        let dev = vm.sh("ls /sys/block | grep '^ublkb' | sed 's/ublkb//'");
        let dev = dev.trim().to_string();
        assert!(!dev.is_empty(), "no ublk device after the stage");
        // Embedded: a loop device over a file, as the embedded controller publishes it.
        let file = state.join("embedded.img");
        let emb_id = format!("upg-emb-{}", std::process::id());
        let loopdev = vm.sh(&format!(
            "truncate -s 64M {f} && losetup -f --show {f}",
            f = file.display()
        ));
        let loopdev = loopdev.trim().to_string();
        let emb = Written::new(w, &emb_id, &state);
        knode
            .node_stage_volume(csi::NodeStageVolumeRequest {
                volume_id: emb_id.clone(),
                publish_context: HashMap::from([
                    (DEVICE_PATH_KEY.into(), loopdev.clone()),
                    (BACKING_FILE_KEY.into(), file.display().to_string()),
                ]),
                staging_target_path: emb.staging.display().to_string(),
                volume_capability: Some(ext4()),
                ..Default::default()
            })
            .await
            .unwrap_or_else(|e| panic!("stage (embedded): {e:?}: {}", kernel_node.log_text()));
        knode
            .node_publish_volume(publish(&emb_id, &emb.staging, &emb.target, ext4()))
            .await
            .expect("publish (embedded)");

        let volumes = [
            (Written::new(w, &vk.id, &state), "kernel"),
            (Written::new(w, &vu.id, &state), "ublk"),
            (emb, "embedded"),
        ];
        for (v, _) in &volumes {
            v.start_writer(&lab, &stop);
        }
        for (v, _) in &volumes {
            v.wait(&format!("{n} records fsynced"), |t| {
                t.lines().filter(|l| l.starts_with("acked")).count() >= n
            });
        }
        let at_kill: Vec<usize> = volumes.iter().map(|(v, _)| v.acked().len()).collect();
        let servers = vm.sh("pgrep -x moor-ublk || true");
        assert!(!servers.trim().is_empty(), "no moor-ublk server runs");
        let in_pod = vm.sh(&format!("cat {POD}/cgroup.procs"));
        for pid in servers.split_whitespace() {
            assert!(
                in_pod.split_whitespace().any(|p| p == pid),
                "the server {pid} is not in the pod's cgroup: {in_pod}"
            );
        }

        // The rolling update: SIGTERM to each moor-node, then the pod's cgroup killed.
        drop((knode, unode));
        let start = Instant::now();
        vm.sh("pkill -TERM -x moor-node; true");
        vm.sh(&format!("echo 1 > {POD}/cgroup.kill"));
        wait_guest(
            &lab,
            "the pod's cgroup to be empty",
            &format!("[ -z \"$(cat {POD}/cgroup.procs)\" ]"),
        );
        assert_eq!(
            live_servers(vm),
            "",
            "a moor-ublk server outlived its pod's cgroup"
        );
        let info = vm.sh(&format!("{} info --dev {dev}", ublk_bin.display()));
        assert!(info.contains("state quiesced"), "{info}");

        // The new moor-nodes, on the same state dirs: the ublk one takes the device over
        // before it answers.
        let mut knode = kernel_node.start(&lab, UPGRADED, &path).await;
        let mut unode = ublk_node.start(&lab, UPGRADED, &path).await;
        let answered = start.elapsed();
        let info = vm.sh(&format!("{} info --dev {dev}", ublk_bin.display()));
        assert!(
            info.contains("state live"),
            "the new moor-node answered before the device was served again: {info}\n{}",
            ublk_node.log_text()
        );
        // What the new server said of the dead one's lock (fenced, or why not).
        if let Ok(logs) = std::fs::read_dir(ublk_node.state.join("ublk")) {
            for l in logs
                .flatten()
                .filter(|e| e.path().extension() == Some("log".as_ref()))
            {
                let text = std::fs::read_to_string(l.path()).unwrap_or_default();
                for line in text.lines().filter(|l| l.contains("fenc")) {
                    eprintln!("{test}: the new server: {line}");
                }
            }
        }
        for ((v, kind), before) in volumes.iter().zip(&at_kill) {
            v.wait("records fsynced after the upgrade", |t| {
                t.lines().filter(|l| l.starts_with("acked")).count() >= before + n
            });
            eprintln!("{test}: {kind}: {before} records before the kill, writing again");
        }
        eprintln!(
            "{test}: the new moor-nodes answered {:.1} s after the kill",
            answered.as_secs_f64()
        );
        std::fs::write(&stop, "").expect("tell the writers to stop");
        for (v, kind) in &volumes {
            let log = v.wait("the writer's end", |t| t.contains("stopped"));
            assert_writer_clean(&log, &format!("the {kind} volume's writer"));
            let data = vm.sh(&format!("cat {}", v.target.join("data").display()));
            for i in v.acked() {
                assert!(
                    data.contains(&format!("record {i:08}")),
                    "the {kind} volume lost acknowledged record {i}"
                );
            }
        }

        // The new moor-nodes answer for every volume, and unstage leaves nothing.
        for (v, kind) in &volumes {
            let node = if *kind == "ublk" {
                &mut unode
            } else {
                &mut knode
            };
            let stats = node
                .node_get_volume_stats(csi::NodeGetVolumeStatsRequest {
                    volume_id: v.id.clone(),
                    volume_path: v.target.display().to_string(),
                    staging_target_path: v.staging.display().to_string(),
                })
                .await
                .unwrap_or_else(|e| panic!("NodeGetVolumeStats ({kind}): {e:?}"))
                .into_inner();
            assert!(
                stats.volume_condition.as_ref().is_none_or(|c| !c.abnormal),
                "{kind}: {stats:?}"
            );
            node.node_unpublish_volume(unpublish_req(&v.id, &v.target))
                .await
                .unwrap_or_else(|e| panic!("NodeUnpublishVolume ({kind}): {e:?}"));
            node.node_unstage_volume(unstage_req(&v.id, &v.staging))
                .await
                .unwrap_or_else(|e| panic!("NodeUnstageVolume ({kind}): {e:?}"));
        }
        assert_eq!(vm.sh("ls /sys/block | grep '^ublkb' || true").trim(), "");
        assert_eq!(live_servers(vm), "", "a moor-ublk server outlived unstage");
        assert!(lab.mappings(0).is_empty(), "{:?}", lab.mappings(0));
        assert_eq!(
            std::fs::read_dir(ublk_node.state.join("ublk"))
                .map(|d| d.count())
                .unwrap_or(0),
            0,
            "the ublk attacher's files are gone"
        );
        vm.sh(&format!("losetup -d {loopdev}"));
        for v in [&vk, &vu] {
            detach(w, &mut ctl, v, 0).await;
            delete(w, &mut ctl, v).await;
        }
    });
    // The new moor-nodes end with their pod.
    lab.vms[0].sh(&format!("echo 1 > {POD}/cgroup.kill"));
}
