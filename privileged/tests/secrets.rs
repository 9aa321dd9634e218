//! Secrets never reach the logs (run as root).
//!
//! The real `moor-node` and `moor-controller` run with every log level enabled (`RUST_LOG=trace`,
//! which includes the gRPC stack's own logging) and their stderr captured; calls that succeed
//! and calls that fail all carry `secrets` with a unique marker in keys and values. The marker
//! must appear nowhere in the captured output.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use csi::controller_client::ControllerClient;
use csi::node_client::NodeClient;
use csi::volume_capability::{AccessMode, AccessType, MountVolume, access_mode::Mode};
use moor_privileged::Sandbox;
use moor_privileged::client::{DEADLINE, binary, connect, spawn_guarded, unpublish_and_unstage};
use moor_proto::csi::v1 as csi;
use moor_runtime::child::Guarded;

const MARKER: &str = "zq-secret-marker-5e9b1";

fn secrets() -> HashMap<String, String> {
    HashMap::from([
        ("password".to_string(), format!("pw-{MARKER}")),
        (format!("key-{MARKER}"), "value".to_string()),
    ])
}

/// A daemon whose output goes to a file; killed on drop if still running.
struct Logged {
    child: Guarded,
    log: PathBuf,
}

impl Logged {
    async fn start(
        program: &str,
        socket: &Path,
        log: PathBuf,
        args: &[impl AsRef<std::ffi::OsStr>],
    ) -> Self {
        let file = std::fs::File::create(&log).expect("log file");
        let mut child = spawn_guarded(
            Command::new(binary(program))
                .arg("--endpoint")
                .arg(format!("unix://{}", socket.display()))
                .args(args)
                .env("RUST_LOG", "trace")
                .stdin(Stdio::null())
                .stdout(file.try_clone().expect("dup"))
                .stderr(file),
        );
        if let Err(e) = moor_runtime::client::wait_answering(socket, DEADLINE, || {
            moor_runtime::client::exited(&mut child)
        })
        .await
        {
            panic!("{program}: {e}");
        }
        Self { child, log }
    }

    /// Stops the daemon (SIGTERM) and returns everything it logged.
    fn stop(mut self) -> String {
        let _ = rustix::process::kill_process(self.child.pid(), rustix::process::Signal::TERM);
        let _ = self.child.wait();
        String::from_utf8_lossy(&std::fs::read(&self.log).expect("read log")).into_owned()
    }
}

fn cap() -> csi::VolumeCapability {
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

#[test]
fn node_logs_never_contain_secrets() {
    let sb = Sandbox::new("secrets-node");
    let dev = sb.loop_device("s.img", 64 << 20);
    let socket = sb.root.join("csi.sock");
    let staging = sb.staging("pv");
    let target = sb.target("pod", "pv");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("rt");
    let daemon = rt.block_on(Logged::start(
        "moor-node",
        &socket,
        sb.root.join("node.log"),
        &sb.node_args("node-s", &[]),
    ));
    rt.block_on(async {
        let mut node = NodeClient::new(connect(&socket).await.expect("connect"));
        let stage = csi::NodeStageVolumeRequest {
            volume_id: "vol-s".into(),
            publish_context: HashMap::from([("devicePath".into(), dev.display().to_string())]),
            staging_target_path: staging.display().to_string(),
            volume_capability: Some(cap()),
            secrets: secrets(),
            volume_context: HashMap::new(),
        };
        // Refused calls carrying secrets.
        let mut bad = stage.clone();
        bad.staging_target_path = "/etc".into();
        assert!(node.node_stage_volume(bad).await.is_err());
        let mut bad = stage.clone();
        bad.secrets
            .insert("big".into(), format!("{MARKER}{}", "x".repeat(5000)));
        assert!(node.node_stage_volume(bad).await.is_err());
        // Calls that succeed.
        node.node_stage_volume(stage).await.expect("stage");
        let publish = csi::NodePublishVolumeRequest {
            volume_id: "vol-s".into(),
            publish_context: HashMap::new(),
            staging_target_path: staging.display().to_string(),
            target_path: target.display().to_string(),
            volume_capability: Some(cap()),
            readonly: false,
            secrets: secrets(),
            volume_context: HashMap::new(),
        };
        node.node_publish_volume(publish).await.expect("publish");
        let _ = node
            .node_expand_volume(csi::NodeExpandVolumeRequest {
                volume_id: "vol-s".into(),
                volume_path: target.display().to_string(),
                secrets: secrets(),
                ..Default::default()
            })
            .await;
        unpublish_and_unstage(&mut node, "vol-s", &staging, &target).await;
    });
    drop(rt);
    let log = daemon.stop();
    assert!(
        log.contains("NodeStageVolume") && log.contains("NodePublishVolume"),
        "the log did not capture the calls:\n{log}"
    );
    assert!(
        !log.contains(MARKER),
        "a secret reached the node log:\n{}",
        log.lines()
            .filter(|l| l.contains(MARKER))
            .collect::<Vec<_>>()
            .join("\n")
    );
    assert!(sb.mounts().is_empty());
}

#[test]
fn controller_logs_never_contain_secrets() {
    let sb = Sandbox::new("secrets-controller");
    let socket = sb.root.join("ctl.sock");
    let data = sb.data.join("controller").display().to_string();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("rt");
    let daemon = rt.block_on(Logged::start(
        "moor-controller",
        &socket,
        sb.root.join("controller.log"),
        &["--node-id", "node-s", "--data-dir", &data],
    ));
    rt.block_on(async {
        let mut c = ControllerClient::new(connect(&socket).await.expect("connect"));
        let create = csi::CreateVolumeRequest {
            name: "pvc-s".into(),
            capacity_range: Some(csi::CapacityRange {
                required_bytes: 16 << 20,
                limit_bytes: 0,
            }),
            volume_capabilities: vec![cap()],
            secrets: secrets(),
            ..Default::default()
        };
        let mut bad = create.clone();
        bad.name = String::new();
        assert!(c.create_volume(bad).await.is_err());
        let mut bad = create.clone();
        bad.secrets
            .insert("big".into(), format!("{MARKER}{}", "x".repeat(5000)));
        assert!(c.create_volume(bad).await.is_err());
        let vol = c
            .create_volume(create)
            .await
            .expect("create")
            .into_inner()
            .volume
            .expect("volume");
        let _ = c
            .controller_publish_volume(csi::ControllerPublishVolumeRequest {
                volume_id: "no-such-volume".into(),
                node_id: "node-s".into(),
                volume_capability: Some(cap()),
                secrets: secrets(),
                ..Default::default()
            })
            .await;
        let _ = c
            .validate_volume_capabilities(csi::ValidateVolumeCapabilitiesRequest {
                volume_id: vol.volume_id.clone(),
                volume_capabilities: vec![cap()],
                secrets: secrets(),
                ..Default::default()
            })
            .await;
        let _ = c
            .create_snapshot(csi::CreateSnapshotRequest {
                source_volume_id: "no-such-volume".into(),
                name: "snap".into(),
                secrets: secrets(),
                ..Default::default()
            })
            .await;
        c.delete_volume(csi::DeleteVolumeRequest {
            volume_id: vol.volume_id,
            secrets: secrets(),
        })
        .await
        .expect("delete");
    });
    drop(rt);
    let log = daemon.stop();
    assert!(
        log.contains("CreateVolume") && log.contains("DeleteVolume"),
        "the log did not capture the calls:\n{log}"
    );
    assert!(
        !log.contains(MARKER),
        "a secret reached the controller log:\n{}",
        log.lines()
            .filter(|l| l.contains(MARKER))
            .collect::<Vec<_>>()
            .join("\n")
    );
}
