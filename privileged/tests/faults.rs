//! Faults other than a killed process, on real loop devices, mkfs and mounts (run as root):
//! a reader-only stage of a blank device, damaged filesystems, a power cut after every step of
//! a volume's life, and a daemon out of file descriptors.

use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use csi::volume_capability::access_mode::Mode;
use moor_node::engine::{Engine, EngineConfig};
use moor_node::journal::{self, Journal};
use moor_node::reconcile::Reconciler;
use moor_node::service::{NodeService, PluginInfo};
use moor_node::sys::linux::Linux;
use moor_privileged::client::{DEADLINE, Daemon, connect};
use moor_privileged::requests::{publish_req, unpublish_req, unstage_req};
use moor_privileged::{Sandbox, fs_cap, is_mount_point, run};
use moor_proto::csi::v1 as csi;
use moor_proto::csi::v1::node_server::Node as _;
use tonic::{Code, Request};

const MIB: u64 = 1 << 20;

fn node(sb: &Sandbox, state: &Path) -> (NodeService<Linux>, Arc<Engine<Linux>>) {
    let os = Arc::new(Linux::new(&sb.kubelet).expect("os"));
    let (journal, _) = Journal::open(state, false).expect("journal");
    let cfg = EngineConfig {
        kubelet_dir: sb.kubelet.clone(),
        ..EngineConfig::default()
    };
    let engine = Arc::new(Engine::new(os, Arc::new(journal), cfg));
    let info = PluginInfo {
        driver_name: "moor.csi.io".into(),
        node_id: "n1".into(),
        max_volumes: 0,
        topology_key: "topology.moor.csi.io/node".into(),
        state_dir: state.to_path_buf(),
    };
    (NodeService::new(Arc::clone(&engine), info), engine)
}

fn stage_req(dev: &Path, staging: &Path, fs: &str, mode: Mode) -> csi::NodeStageVolumeRequest {
    let mut r = moor_privileged::requests::stage_req("vol", dev, staging, fs);
    r.volume_capability = Some(fs_cap(fs, mode));
    r
}

fn rt() -> tokio::runtime::Runtime {
    moor_privileged::runtime()
}

fn all_zero(dev: &Path) -> bool {
    let bytes = std::fs::read(dev).expect("read the device");
    bytes.iter().all(|&b| b == 0)
}

#[test]
fn a_reader_only_stage_of_a_blank_device_leaves_it_all_zeros() {
    let sb = Sandbox::new("reader-blank");
    let dev = sb.loop_device("vol.img", 64 * MIB);
    let staging = sb.staging("pv");
    let (svc, engine) = node(&sb, &sb.state);
    rt().block_on(async {
        for mode in [Mode::SingleNodeReaderOnly, Mode::MultiNodeReaderOnly] {
            let s = svc
                .node_stage_volume(Request::new(stage_req(&dev, &staging, "ext4", mode)))
                .await
                .expect_err("a reader never formats");
            assert_eq!(s.code(), Code::FailedPrecondition, "{mode:?}");
            assert!(s.message().contains(mode.as_str_name()), "{}", s.message());
            assert!(!is_mount_point(&staging));
            assert!(engine.journal().get("vol").is_none());
        }
    });
    assert!(all_zero(&dev), "the device must stay all zeros");
}

/// A field of the ext superblock as `dumpe2fs -h` prints it ("Filesystem state", ...).
fn dumpe2fs(dev: &Path, field: &str) -> String {
    let out = Command::new("dumpe2fs")
        .arg("-h")
        .arg(dev)
        .output()
        .expect("dumpe2fs");
    let prefix = format!("{field}:");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|l| l.strip_prefix(prefix.as_str()))
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

fn dumpe2fs_state(dev: &Path) -> String {
    dumpe2fs(dev, "Filesystem state")
}

#[test]
fn an_ext4_marked_with_errors_is_repaired_before_it_is_mounted() {
    let sb = Sandbox::new("fsck-errors");
    let dev = sb.loop_device("vol.img", 64 * MIB);
    let d = dev.display().to_string();
    run("mkfs.ext4", &["-q", &d]);
    run("debugfs", &["-w", "-R", "ssv state 2", &d]);
    assert_eq!(dumpe2fs_state(&dev), "not clean with errors");
    let staging = sb.staging("pv");
    let (svc, _) = node(&sb, &sb.state);
    rt().block_on(async {
        svc.node_stage_volume(Request::new(stage_req(
            &dev,
            &staging,
            "ext4",
            Mode::SingleNodeWriter,
        )))
        .await
        .expect("stage");
        assert!(is_mount_point(&staging));
        svc.node_unstage_volume(Request::new(unstage_req("vol", &staging)))
            .await
            .expect("unstage");
    });
    assert_eq!(dumpe2fs_state(&dev), "clean");
}

#[test]
fn an_ext4_that_preen_mode_cannot_repair_is_refused_and_not_mounted() {
    let sb = Sandbox::new("fsck-refused");
    let dev = sb.loop_device("vol.img", 64 * MIB);
    let d = dev.display().to_string();
    run("mkfs.ext4", &["-q", &d]);
    // The root inode cleared: e2fsck -p stops and asks for a person.
    run("debugfs", &["-w", "-R", "ssv state 2", &d]);
    run("debugfs", &["-w", "-R", "clri <2>", &d]);
    let staging = sb.staging("pv");
    let (svc, engine) = node(&sb, &sb.state);
    rt().block_on(async {
        let s = svc
            .node_stage_volume(Request::new(stage_req(
                &dev,
                &staging,
                "ext4",
                Mode::SingleNodeWriter,
            )))
            .await
            .expect_err("refused");
        assert_eq!(s.code(), Code::FailedPrecondition);
        assert!(
            s.message().contains("Root inode is not a directory"),
            "e2fsck's words in the answer: {}",
            s.message()
        );
        assert!(!is_mount_point(&staging));
        assert!(engine.journal().get("vol").is_none());
    });
}

const MARKER: &[u8] = b"written and fsynced before the power cut";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    Stage,
    Publish,
    Write,
    Unpublish,
    Unstage,
}

async fn step(svc: &NodeService<Linux>, step: Step, dev: &Path, staging: &Path, target: &Path) {
    let r = match step {
        Step::Stage => svc
            .node_stage_volume(Request::new(stage_req(
                dev,
                staging,
                "ext4",
                Mode::SingleNodeWriter,
            )))
            .await
            .map(drop),
        Step::Publish => {
            let mut r = publish_req("vol", staging, target);
            r.volume_capability = Some(fs_cap("ext4", Mode::SingleNodeWriter));
            svc.node_publish_volume(Request::new(r)).await.map(drop)
        }
        Step::Write => {
            use std::io::Write as _;
            let mut f = std::fs::File::create(target.join("marker")).expect("create");
            f.write_all(MARKER).expect("write");
            f.sync_all().expect("fsync");
            Ok(())
        }
        Step::Unpublish => svc
            .node_unpublish_volume(Request::new(unpublish_req("vol", target)))
            .await
            .map(drop),
        Step::Unstage => svc
            .node_unstage_volume(Request::new(unstage_req("vol", staging)))
            .await
            .map(drop),
    };
    r.unwrap_or_else(|e| panic!("{step:?}: {e:?}"));
}

fn fs_uuid(dev: &Path) -> String {
    dumpe2fs(dev, "Filesystem UUID")
}

#[test]
fn a_power_cut_after_any_step_keeps_the_data_on_a_real_device() {
    // The volume's life runs once; after each step the journal's states a power cut can leave
    // are kept. Then each is booted on the device as the life left it (every filesystem moor
    // made and everything fsynced is on it): mounts gone, reconciliation, kubelet's stage and
    // publish. The filesystem is never made again and the data is there.
    let sb = Sandbox::new("power-cut");
    let dev = sb.loop_device("vol.img", 256 * MIB);
    let staging = sb.staging("pv");
    let target = sb.target("pod", "pv");
    let life = [
        Step::Stage,
        Step::Publish,
        Step::Write,
        Step::Unpublish,
        Step::Unstage,
        Step::Stage,
        Step::Publish,
    ];
    let mut states: Vec<(String, Vec<u8>)> = Vec::new();
    let (svc, engine) = node(&sb, &sb.state);
    rt().block_on(async {
        for (i, s) in life.iter().enumerate() {
            step(&svc, *s, &dev, &staging, &target).await;
            let log = std::fs::read(sb.state.join(journal::LOG_FILE)).expect("log");
            let synced = engine.journal().durable_len() as usize;
            let mut cut = synced.min(log.len());
            states.push((format!("after {s:?} #{i}, synced"), log[..cut].to_vec()));
            while let Some(nl) = log[cut..].iter().position(|&b| b == b'\n') {
                cut += nl + 1;
                states.push((
                    format!("after {s:?} #{i}, to byte {cut}"),
                    log[..cut].to_vec(),
                ));
            }
        }
        step(&svc, Step::Unpublish, &dev, &staging, &target).await;
        step(&svc, Step::Unstage, &dev, &staging, &target).await;
    });
    drop((svc, engine));
    let uuid = fs_uuid(&dev);
    assert!(!uuid.is_empty());
    let written_at = life.iter().position(|s| *s == Step::Write).unwrap_or(0);
    for (n, (name, log)) in states.iter().enumerate() {
        let state = sb.root.join(format!("state-{n}"));
        std::fs::create_dir_all(&state).expect("state dir");
        std::fs::write(state.join(journal::LOG_FILE), log).expect("log");
        let (svc, engine) = node(&sb, &state);
        rt().block_on(async {
            Reconciler::new(Arc::clone(&engine), "moor.csi.io")
                .run()
                .unwrap_or_else(|e| panic!("{name}: reconcile: {e}"));
            step(&svc, Step::Stage, &dev, &staging, &target).await;
            step(&svc, Step::Publish, &dev, &staging, &target).await;
            assert_eq!(fs_uuid(&dev), uuid, "{name}: the filesystem was made again");
            assert_eq!(
                std::fs::read(target.join("marker")).ok().as_deref(),
                Some(MARKER),
                "{name}: the data"
            );
            step(&svc, Step::Unpublish, &dev, &staging, &target).await;
            step(&svc, Step::Unstage, &dev, &staging, &target).await;
        });
        assert!(!is_mount_point(&staging), "{name}");
    }
    eprintln!(
        "power-cut states booted on a real device: {} (data written at step {written_at})",
        states.len()
    );
    assert!(sb.mounts().is_empty(), "{:?}", sb.mounts());
}

/// How many reconciliation passes the daemon's `log` tells of: each ends with one line.
fn passes(log: &Path) -> usize {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter(|l| {
            [
                "reconciled the journal with the mount table",
                "reconciliation failed",
                "reconciliation pass panicked",
            ]
            .iter()
            .any(|m| l.contains(m))
        })
        .count()
}

/// Waits until the daemon's `log` tells of `n` reconciliation passes (up to [`DEADLINE`]).
async fn wait_for_passes(log: &Path, n: usize, d: &mut Daemon) {
    let start = std::time::Instant::now();
    while passes(log) < n {
        assert!(
            matches!(d.child.try_wait(), Ok(None)),
            "the daemon died: {}",
            std::fs::read_to_string(log).unwrap_or_default()
        );
        assert!(
            start.elapsed() < DEADLINE,
            "{} of {n} reconciliation passes within {DEADLINE:?}",
            passes(log)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[test]
fn a_daemon_out_of_file_descriptors_keeps_every_mount() {
    let sb = Sandbox::new("nofile");
    let dev = sb.loop_device("vol.img", 64 * MIB);
    let staging = sb.staging("pv");
    let target = sb.target("pod", "pv");
    let socket = sb.root.join("csi.sock");
    let log = sb.root.join("node.log");
    rt().block_on(async {
        let mut d = Daemon::spawn_logged(
            "moor-node",
            &socket,
            &sb.node_args("nofile", &["--reconcile-interval", "1"]),
            &log,
        );
        d.wait_answering().await;
        let mut client =
            csi::node_client::NodeClient::new(connect(&socket).await.expect("connect"));
        client
            .node_stage_volume(stage_req(&dev, &staging, "ext4", Mode::SingleNodeWriter))
            .await
            .expect("stage");
        let mut p = publish_req("vol", &staging, &target);
        p.volume_capability = Some(fs_cap("ext4", Mode::SingleNodeWriter));
        client.node_publish_volume(p).await.expect("publish");
        // Leave the daemon no descriptor to spare: its limit at what it has open now, then
        // connections until it cannot accept more.
        let pid = rustix::process::Pid::from_raw(d.child.id() as i32).expect("pid");
        let open = std::fs::read_dir(format!("/proc/{}/fd", d.child.id()))
            .expect("fds")
            .count() as u64;
        // (The soft limit only: raising a hard limit back takes CAP_SYS_RESOURCE.)
        let own = rustix::process::getrlimit(rustix::process::Resource::Nofile);
        let limit = rustix::process::Rlimit {
            current: Some(open + 2),
            maximum: own.maximum,
        };
        let limit_before =
            rustix::process::prlimit(Some(pid), rustix::process::Resource::Nofile, limit)
                .expect("prlimit");
        let mut hogs = Vec::new();
        for _ in 0..8 {
            if let Ok(s) = std::os::unix::net::UnixStream::connect(&socket) {
                hogs.push(s);
            }
        }
        // Several reconciliation passes and stats calls (on a connection made before).
        let before = passes(&log);
        wait_for_passes(&log, before + 3, &mut d).await;
        let _ = client
            .node_get_volume_stats(csi::NodeGetVolumeStatsRequest {
                volume_id: "vol".into(),
                volume_path: target.display().to_string(),
                staging_target_path: String::new(),
            })
            .await;
        assert!(is_mount_point(&staging), "the staging mount was detached");
        assert!(is_mount_point(&target), "the publication was detached");
        drop(hogs);
        rustix::process::prlimit(Some(pid), rustix::process::Resource::Nofile, limit_before)
            .expect("prlimit back");
        // Passes with descriptors to spare again.
        let back = passes(&log);
        wait_for_passes(&log, back + 2, &mut d).await;
        assert!(is_mount_point(&staging) && is_mount_point(&target));
        assert!(matches!(d.child.try_wait(), Ok(None)), "the daemon lives");
        let mut client =
            csi::node_client::NodeClient::new(connect(&socket).await.expect("connect again"));
        client
            .node_unpublish_volume(unpublish_req("vol", &target))
            .await
            .expect("unpublish");
        client
            .node_unstage_volume(unstage_req("vol", &staging))
            .await
            .expect("unstage");
        d.stop().await;
    });
    assert!(sb.mounts().is_empty(), "{:?}", sb.mounts());
}

#[test]
fn a_held_device_stays_the_device_that_was_checked() {
    use moor_node::sys::Os as _;
    let sb = Sandbox::new("held");
    let dev = sb.loop_device("first.img", 16 * MIB);
    moor_privileged::write_at(&dev, MIB, b"the volume's own bytes");
    let os = Linux::new(&sb.kubelet).expect("os");
    let held = os.hold_device(&dev).expect("hold");
    assert_eq!(held.node, dev, "the kernel's node of the device");
    // The loop device is asked to let go of its file and take another: while moor holds it,
    // the kernel keeps it bound to the first.
    let other = sb.data.join("second.img");
    std::fs::File::create(&other)
        .and_then(|f| f.set_len(16 * MIB))
        .expect("second file");
    let _ = Command::new("losetup").arg("-d").arg(&dev).status();
    let rebound = Command::new("losetup")
        .arg(&dev)
        .arg(&other)
        .output()
        .expect("losetup");
    assert!(
        !rebound.status.success(),
        "a held loop device must not take another file"
    );
    let mut buf = vec![0u8; 4096];
    let n = os
        .read_device(&held.handle, MIB, &mut buf)
        .expect("read through the handle");
    assert_eq!(&buf[..22.min(n)], b"the volume's own bytes");
}

#[test]
fn a_blank_device_another_holder_claims_is_not_formatted() {
    use std::os::unix::fs::OpenOptionsExt as _;
    let sb = Sandbox::new("claimed");
    let dev = sb.loop_device("vol.img", 64 * MIB);
    let staging = sb.staging("pv");
    // Someone else holds the device exclusively (a mkfs of its own, a device-mapper table).
    let claim = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_EXCL)
        .open(&dev)
        .expect("exclusive open");
    let (svc, engine) = node(&sb, &sb.state);
    rt().block_on(async {
        let s = svc
            .node_stage_volume(Request::new(stage_req(
                &dev,
                &staging,
                "ext4",
                Mode::SingleNodeWriter,
            )))
            .await
            .expect_err("in use");
        assert_eq!(s.code(), Code::FailedPrecondition, "{}", s.message());
        assert!(s.message().contains("in use"), "{}", s.message());
        assert!(engine.journal().get("vol").is_none());
    });
    drop(claim);
    assert!(all_zero(&dev));
}
