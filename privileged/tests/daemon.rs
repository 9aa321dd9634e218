//! The real `moor-node` binary on a temporary socket, driven through a tonic client for a whole
//! volume life, then stopped with SIGTERM (run as root).

use std::collections::HashMap;

use csi::identity_client::IdentityClient;
use csi::node_client::NodeClient;
use csi::volume_capability::{AccessMode, AccessType, MountVolume, access_mode::Mode};
use moor_privileged::client::{DEADLINE, Daemon, connect, unpublish_and_unstage, wait_for_log};
use moor_privileged::requests::unstage_req;
use moor_privileged::{Sandbox, is_mount_point, processes_mentioning};
use moor_proto::csi::v1 as csi;
use tonic::Code;

const MIB: u64 = 1 << 20;

#[test]
fn moor_node_serves_a_whole_volume_life_and_stops_cleanly() {
    let sb = Sandbox::new("daemon");
    let dev = sb.loop_device("d.img", 256 * MIB);
    let socket = sb.root.join("csi.sock");
    // A stale socket file from a previous run is replaced.
    drop(std::os::unix::net::UnixListener::bind(&socket).expect("stale socket"));
    assert!(socket.exists());
    let staging = sb.staging("pv");
    let target = sb.target("pod", "pv");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("rt");
    let mut daemon = rt.block_on(Daemon::start(
        &socket,
        &sb.node_args("node-a", &["--max-volumes", "16"]),
    ));
    let mode = std::fs::metadata(&socket)
        .map(|m| std::os::unix::fs::PermissionsExt::mode(&m.permissions()));
    assert_eq!(mode.expect("socket") & 0o777, 0o660);

    rt.block_on(async {
        let channel = connect(&socket).await.expect("connect");
        let mut id = IdentityClient::new(channel.clone());
        let mut node = NodeClient::new(channel);
        let info = id
            .get_plugin_info(csi::GetPluginInfoRequest {})
            .await
            .expect("info")
            .into_inner();
        assert_eq!(info.name, "moor.csi.io");
        assert!(!info.vendor_version.is_empty());
        let probe = id
            .probe(csi::ProbeRequest {})
            .await
            .expect("probe")
            .into_inner();
        assert_eq!(probe.ready, Some(true));
        let ni = node
            .node_get_info(csi::NodeGetInfoRequest {})
            .await
            .expect("node info")
            .into_inner();
        assert_eq!(
            (ni.node_id.as_str(), ni.max_volumes_per_node),
            ("node-a", 16)
        );

        let cap = csi::VolumeCapability {
            access_mode: Some(AccessMode {
                mode: Mode::SingleNodeWriter as i32,
            }),
            access_type: Some(AccessType::Mount(MountVolume {
                fs_type: "ext4".into(),
                mount_flags: vec!["noatime".into()],
                volume_mount_group: String::new(),
            })),
        };
        let stage = csi::NodeStageVolumeRequest {
            volume_id: "vol-d".into(),
            publish_context: HashMap::from([("devicePath".into(), dev.display().to_string())]),
            staging_target_path: staging.display().to_string(),
            volume_capability: Some(cap.clone()),
            secrets: HashMap::new(),
            volume_context: HashMap::new(),
        };
        node.node_stage_volume(stage.clone()).await.expect("stage");
        node.node_stage_volume(stage).await.expect("stage retry");
        let publish = csi::NodePublishVolumeRequest {
            volume_id: "vol-d".into(),
            publish_context: HashMap::new(),
            staging_target_path: staging.display().to_string(),
            target_path: target.display().to_string(),
            volume_capability: Some(cap),
            readonly: false,
            secrets: HashMap::new(),
            volume_context: HashMap::new(),
        };
        node.node_publish_volume(publish.clone())
            .await
            .expect("publish");
        node.node_publish_volume(publish)
            .await
            .expect("publish retry");
        std::fs::write(target.join("file"), b"through the daemon").expect("write");
        let stats = node
            .node_get_volume_stats(csi::NodeGetVolumeStatsRequest {
                volume_id: "vol-d".into(),
                volume_path: target.display().to_string(),
                staging_target_path: String::new(),
            })
            .await
            .expect("stats")
            .into_inner();
        assert!(stats.usage[0].used > 0);
        let bad = node
            .node_publish_volume(csi::NodePublishVolumeRequest::default())
            .await
            .expect_err("empty request");
        assert_eq!(bad.code(), Code::InvalidArgument);
        unpublish_and_unstage(&mut node, "vol-d", &staging, &target).await;
    });
    assert!(!is_mount_point(&staging) && !target.exists());
    drop(rt); // closes the client's connections
    let status = daemon.terminate();
    assert!(
        status.success(),
        "SIGTERM must end moor-node with 0: {status:?}"
    );
    assert!(!socket.exists(), "the socket is removed on shutdown");
    assert!(sb.mounts().is_empty());
}

#[test]
fn moor_node_restarted_keeps_its_volumes() {
    let sb = Sandbox::new("restart");
    let dev = sb.loop_device("r.img", 128 * MIB);
    let socket = sb.root.join("csi.sock");
    let staging = sb.staging("pv");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("rt");
    let args = sb.node_args("node-a", &[]);
    let cap = csi::VolumeCapability {
        access_mode: Some(AccessMode {
            mode: Mode::SingleNodeWriter as i32,
        }),
        access_type: Some(AccessType::Mount(MountVolume::default())),
    };
    let stage = csi::NodeStageVolumeRequest {
        volume_id: "vol-r".into(),
        publish_context: HashMap::from([("devicePath".into(), dev.display().to_string())]),
        staging_target_path: staging.display().to_string(),
        volume_capability: Some(cap),
        secrets: HashMap::new(),
        volume_context: HashMap::new(),
    };
    let mut first = rt.block_on(Daemon::start(&socket, &args));
    rt.block_on(async {
        let mut node = NodeClient::new(connect(&socket).await.expect("connect"));
        node.node_stage_volume(stage.clone()).await.expect("stage");
    });
    // Killed hard, as an OOM kill would.
    let _ = first.child.kill();
    let _ = first.child.wait();
    std::fs::write(staging.join("kept"), b"1").expect("write");
    let mut second = rt.block_on(Daemon::start(&socket, &args));
    rt.block_on(async {
        let mut node = NodeClient::new(connect(&socket).await.expect("connect"));
        // kubelet's retry after the restart succeeds and does not mount a second time.
        node.node_stage_volume(stage)
            .await
            .expect("stage retry after restart");
        assert_eq!(sb.mounts().iter().filter(|m| **m == staging).count(), 1);
        assert!(staging.join("kept").exists());
        node.node_unstage_volume(unstage_req("vol-r", &staging))
            .await
            .expect("unstage");
    });
    drop(rt);
    assert!(second.terminate().success());
}

#[test]
fn moor_node_help_and_version() {
    let bin = moor_privileged::client::binary("moor-node");
    let help = std::process::Command::new(&bin)
        .arg("--help")
        .output()
        .expect("run");
    assert!(help.status.success());
    let text = String::from_utf8_lossy(&help.stdout);
    for flag in [
        "--endpoint",
        "--node-id",
        "--driver-name",
        "--state-dir",
        "--kubelet-dir",
        "--max-volumes",
        "--log-format",
    ] {
        assert!(text.contains(flag), "--help lacks {flag}");
    }
    let version = std::process::Command::new(&bin)
        .arg("--version")
        .output()
        .expect("run");
    assert!(version.status.success());
    assert!(String::from_utf8_lossy(&version.stdout).contains(env!("CARGO_PKG_VERSION")));
    // A bad endpoint is refused with a clear error and a non-zero exit.
    let bad = std::process::Command::new(&bin)
        .args(["--node-id", "n", "--endpoint", "tcp://0.0.0.0:1"])
        .output()
        .expect("run");
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("unix://"));
}

/// Stages held in the kernel as long as anything can hold them (here: in a mkfs that waits to
/// be released) never take the server's last worker: with more of them than the daemon has
/// workers, Identity and Node calls are still answered, and the stages finish once released.
#[test]
fn stages_stuck_in_mkfs_leave_the_server_answering() {
    use std::os::unix::fs::PermissionsExt as _;

    let sb = Sandbox::new("stuck");
    let tools = sb.root.join("tools");
    std::fs::create_dir_all(&tools).expect("tools dir");
    let release = sb.root.join("release");
    let mkfs = tools.join("mkfs.ext4");
    std::fs::write(
        &mkfs,
        format!(
            "#!/bin/sh\nwhile [ ! -e '{}' ]; do sleep 0.05; done\nexit 1\n",
            release.display()
        ),
    )
    .expect("fake mkfs");
    std::fs::set_permissions(&mkfs, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let path = format!(
        "{}:{}",
        tools.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let devs: Vec<_> = (0..3)
        .map(|i| sb.loop_device(&format!("s{i}.img"), 64 * MIB))
        .collect();
    let socket = sb.root.join("csi.sock");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("rt");
    rt.block_on(async {
        let mut daemon = Daemon::start_program_env(
            "moor-node",
            &socket,
            &sb.node_args("n", &[]),
            &[("PATH", &path)],
        )
        .await;
        let mut stages = Vec::new();
        for (i, dev) in devs.iter().enumerate() {
            let mut node = NodeClient::new(connect(&socket).await.expect("connect"));
            let req = moor_privileged::requests::stage_req(
                &format!("vol-{i}"),
                dev,
                &sb.staging(&format!("pv-{i}")),
                "ext4",
            );
            stages.push(tokio::spawn(
                async move { node.node_stage_volume(req).await },
            ));
        }
        let needle = mkfs.display().to_string();
        let start = std::time::Instant::now();
        while processes_mentioning(&needle).len() < devs.len() {
            assert!(
                start.elapsed() < DEADLINE,
                "the three stages never reached mkfs within {DEADLINE:?} (as when the server stalls)"
            );
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }

        // Three calls held in the kernel's hands, more than the daemon's workers: it answers.
        // (A server with no worker left would never answer: the bound turns a hang into a
        // failure.)
        let answered = tokio::time::timeout(DEADLINE, async {
            let channel = connect(&socket).await.expect("connect");
            let probe = IdentityClient::new(channel.clone())
                .probe(csi::ProbeRequest {})
                .await
                .expect("probe")
                .into_inner();
            assert_eq!(probe.ready, Some(true));
            NodeClient::new(channel)
                .node_get_capabilities(csi::NodeGetCapabilitiesRequest {})
                .await
                .expect("capabilities");
        })
        .await;
        if answered.is_err() {
            let _ = std::fs::write(&release, b"");
            panic!("the server did not answer within {DEADLINE:?} while stages were stuck in mkfs");
        }
        assert!(
            stages.iter().all(|s| !s.is_finished()),
            "a stage finished before its mkfs was released"
        );

        std::fs::write(&release, b"").expect("release");
        for s in stages {
            let status = s.await.expect("task").expect_err("the fake mkfs fails");
            assert!(status.message().contains("mkfs"), "{status:?}");
        }
        assert!(daemon.stop().await.success());
    });
    assert!(processes_mentioning(&mkfs.display().to_string()).is_empty());
}

/// What tells one socket from another bound at the same path later.
fn inode(path: &std::path::Path) -> u64 {
    std::os::unix::fs::MetadataExt::ino(&std::fs::symlink_metadata(path).expect("socket"))
}

/// A second moor-node on the same state dir (a rolling update that starts the new pod first)
/// neither serves nor touches the journal while the first lives; once the first exits it takes
/// over and serves, with the first's records.
#[test]
fn a_second_moor_node_on_the_state_dir_waits_and_takes_over() {
    let sb = Sandbox::new("instance-takeover");
    let dev = sb.loop_device("t.img", 64 * MIB);
    let first_socket = sb.root.join("first.sock");
    let second_socket = sb.root.join("second.sock");
    let staging = sb.staging("pv");
    let rt = moor_privileged::runtime();
    let mut first = rt.block_on(Daemon::start(&first_socket, &sb.node_args("node-a", &[])));
    let stage = moor_privileged::requests::stage_req("vol-t", &dev, &staging, "ext4");
    rt.block_on(async {
        let mut node = NodeClient::new(connect(&first_socket).await.expect("connect"));
        node.node_stage_volume(stage.clone()).await.expect("stage");
    });
    let journal = sb.state.join("journal.log");
    let journal_before = std::fs::read(&journal).expect("journal");
    let lock = sb.state.join("instance.lock");
    assert_eq!(
        std::fs::read_to_string(&lock).expect("lock file").trim(),
        first.child.id().to_string()
    );

    let log = sb.root.join("second.log");
    let mut second = Daemon::spawn_logged(
        "moor-node",
        &second_socket,
        &sb.node_args("node-a", &["--instance-wait", "600"]),
        &log,
    );
    let text = wait_for_log(&log, "holds this dir; waiting for it to exit", &mut second);
    assert!(text.contains(&first.child.id().to_string()), "{text}");
    // Waiting: no socket, no journal write, no reconciliation; the first serves on.
    assert!(!second_socket.exists(), "{text}");
    assert!(!text.contains("reconciled"), "{text}");
    assert_eq!(std::fs::read(&journal).expect("journal"), journal_before);
    rt.block_on(async {
        let mut id = IdentityClient::new(connect(&first_socket).await.expect("connect"));
        id.probe(csi::ProbeRequest {})
            .await
            .expect("the first serves");
    });

    assert!(rt.block_on(first.stop()).success());
    rt.block_on(async {
        second.wait_answering().await;
        let mut node = NodeClient::new(connect(&second_socket).await.expect("connect"));
        // The first's records are the second's: a retried stage is a no-op, unstage works.
        node.node_stage_volume(stage).await.expect("stage retry");
        assert_eq!(sb.mounts().iter().filter(|m| **m == staging).count(), 1);
        node.node_unstage_volume(unstage_req("vol-t", &staging))
            .await
            .expect("unstage");
    });
    assert_eq!(
        std::fs::read_to_string(&lock).expect("lock file").trim(),
        second.child.id().to_string()
    );
    drop(rt);
    assert!(second.terminate().success());
    assert!(sb.mounts().is_empty());
}

/// Past --instance-wait a second instance gives up with an error naming the dir and the
/// holder, and leaves the first's socket alone; moor-controller alike on its data dir.
#[test]
fn a_second_instance_that_waits_too_long_exits_naming_the_holder() {
    let sb = Sandbox::new("instance-refused");
    let socket = sb.root.join("csi.sock");
    let rt = moor_privileged::runtime();
    let mut first = rt.block_on(Daemon::start(&socket, &sb.node_args("node-a", &[])));
    let before = inode(&socket);
    let log = sb.root.join("second.log");
    let mut second = Daemon::spawn_logged(
        "moor-node",
        &socket,
        &sb.node_args("node-a", &["--instance-wait", "0"]),
        &log,
    );
    let status = second.child.wait().expect("wait");
    let text = std::fs::read_to_string(&log).expect("log");
    assert!(
        !status.success() && status.code().is_some(),
        "{status:?}: {text}"
    );
    let want = format!(
        "another moor-node (pid {}) holds {}",
        first.child.id(),
        sb.state.display()
    );
    assert!(text.contains(&want), "{want:?} not in: {text}");
    assert_eq!(inode(&socket), before, "the first's socket is left alone");
    rt.block_on(async {
        let mut id = IdentityClient::new(connect(&socket).await.expect("connect"));
        id.probe(csi::ProbeRequest {})
            .await
            .expect("the first serves");
    });
    assert!(rt.block_on(first.stop()).success());

    let data = sb.data.join("controller").display().to_string();
    let csocket = sb.root.join("controller.sock");
    let args = ["--node-id", "node-c", "--data-dir", data.as_str()];
    let mut controller = rt.block_on(Daemon::start_program("moor-controller", &csocket, &args));
    let before = inode(&csocket);
    let log = sb.root.join("controller2.log");
    let mut args2 = args.to_vec();
    args2.extend(["--instance-wait", "0"]);
    let mut second = Daemon::spawn_logged("moor-controller", &csocket, &args2, &log);
    let status = second.child.wait().expect("wait");
    let text = std::fs::read_to_string(&log).expect("log");
    assert!(
        !status.success() && status.code().is_some(),
        "{status:?}: {text}"
    );
    let want = format!(
        "another moor-controller (pid {}) holds {data}",
        controller.child.id()
    );
    assert!(text.contains(&want), "{want:?} not in: {text}");
    assert_eq!(inode(&csocket), before);
    drop(rt);
    assert!(controller.terminate().success());
}

/// Both daemons hold keys at times (a data key between its unwrap and its zeroing): each turns
/// its core dumps off at start (PR_SET_DUMPABLE 0, read back), and says so, before it serves.
#[test]
fn moor_node_and_moor_controller_turn_core_dumps_off_before_they_serve() {
    let sb = Sandbox::new("no-core-dumps");
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let said = "core dumps off (PR_SET_DUMPABLE 0)";

    let node_log = sb.root.join("node.log");
    let node_sock = sb.root.join("node.sock");
    let mut node = Daemon::spawn_logged(
        "moor-node",
        &node_sock,
        &sb.node_args("node-a", &[]),
        &node_log,
    );
    rt.block_on(node.wait_answering());
    let text = std::fs::read_to_string(&node_log).expect("the node's log");
    assert!(
        text.contains(said),
        "{said:?} not in moor-node's log: {text}"
    );

    let data = sb.data.join("controller").display().to_string();
    let ctl_log = sb.root.join("controller.log");
    let ctl_sock = sb.root.join("controller.sock");
    let args: Vec<String> = ["--node-id", "node-c", "--data-dir", data.as_str()]
        .iter()
        .map(|s| (*s).to_owned())
        .collect();
    let mut controller = Daemon::spawn_logged("moor-controller", &ctl_sock, &args, &ctl_log);
    rt.block_on(controller.wait_answering());
    let text = std::fs::read_to_string(&ctl_log).expect("the controller's log");
    assert!(
        text.contains(said),
        "{said:?} not in moor-controller's log: {text}"
    );
    drop(rt);
    assert!(node.terminate().success());
    assert!(controller.terminate().success());
}
