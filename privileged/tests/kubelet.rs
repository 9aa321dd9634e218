//! The real `moor-node` (and `moor-controller`) as a cluster uses them (run as root).
//!
//! A harness plays kubelet: its plugin watcher finds the registration socket moor-node serves
//! in the plugin registration dir, registers the driver (GetInfo, NotifyRegistrationStatus),
//! dials the CSI endpoint moor-node names, and drives the Node RPCs with kubelet's own path
//! layout under a temporary kubelet dir: what kubelet creates itself (the per-volume dirs and
//! their `vol_data.json`), and what it leaves to the driver (`globalmount`, `mount`, the block
//! publish file). moor-node is SIGKILLed between calls and during one, and kubelet retries.
//!
//! One file, over the usual length: the kubelet harness and the scenarios it plays belong
//! together; a scenario reads as kubelet's calls in order.
//! The HTTP endpoint of both binaries is checked over real TCP on 127.0.0.1.

use std::collections::HashMap;
use std::os::unix::fs::{FileTypeExt as _, MetadataExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use csi::identity_client::IdentityClient;
use csi::node_client::NodeClient;
use csi::volume_capability::{AccessMode, AccessType, BlockVolume, MountVolume, access_mode::Mode};
use moor_privileged::client::{
    DEADLINE, Daemon, connect, http_address, http_get, unpublish_and_unstage, wait_for_log,
};
use moor_privileged::pathgrpc::{CallError, PathClient};
use moor_privileged::requests::{unpublish_req, unstage_req};
use moor_privileged::{Sandbox, is_block_device, is_mount_point};
use moor_proto::csi::v1 as csi;
use moor_proto::registration::v1 as reg;
use tonic::transport::Channel;

const MIB: u64 = 1 << 20;
const DRIVER: &str = "moor.csi.io";
const GET_INFO: &str = "/pluginregistration.Registration/GetInfo";
const NOTIFY: &str = "/pluginregistration.Registration/NotifyRegistrationStatus";

/// kubelet's NotifyRegistrationStatus, on the connection GetInfo went over.
fn notify(
    client: &mut PathClient,
    registered: bool,
    error: &str,
) -> Result<reg::RegistrationStatusResponse, CallError> {
    client.unary(
        NOTIFY,
        &reg::RegistrationStatus {
            plugin_registered: registered,
            error: error.into(),
        },
    )
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("rt")
}

/// A 64-hex-digit directory name derived from the volume handle, shaped like the sha256 hex
/// kubelet uses (moor does not look inside the name).
fn handle_dir(handle: &str) -> String {
    (0u8..4)
        .map(|i| {
            let mut h: u64 = 0xcbf2_9ce4_8422_2325;
            for b in std::iter::once(i).chain(handle.bytes()) {
                h ^= u64::from(b);
                h = h.wrapping_mul(0x0000_0100_0000_01b3);
            }
            format!("{h:016x}")
        })
        .collect()
}

/// The kubelet the tests play: its dirs and its habits.
struct Kubelet<'a> {
    sb: &'a Sandbox,
    /// kubelet's plugin registration dir (plugins_registry).
    registry: PathBuf,
}

/// What the plugin watcher learnt from a registration.
struct Registered {
    info: reg::PluginInfo,
    node: NodeClient<Channel>,
}

impl<'a> Kubelet<'a> {
    fn new(sb: &'a Sandbox) -> Self {
        let registry = sb.k("plugins_registry");
        std::fs::create_dir_all(&registry).expect("plugins_registry");
        Self { sb, registry }
    }

    /// Where the node plugin's CSI socket lives (the DaemonSet's socket dir).
    fn csi_socket(&self) -> PathBuf {
        let p = self.sb.k(&format!("plugins/{DRIVER}/csi.sock"));
        std::fs::create_dir_all(p.parent().expect("parent")).expect("socket dir");
        p
    }

    /// The registration sockets in the registry dir.
    fn reg_sockets(&self) -> Vec<PathBuf> {
        let mut found: Vec<PathBuf> = std::fs::read_dir(&self.registry)
            .expect("read plugins_registry")
            .filter_map(Result::ok)
            .filter(|e| e.file_type().is_ok_and(|t| t.is_socket()))
            .map(|e| e.path())
            .filter(|p| p.to_string_lossy().ends_with("-reg.sock"))
            .collect();
        found.sort();
        found
    }

    /// The plugin watcher: waits for a registration socket that answers, asks GetInfo, and
    /// returns what it says with the still-unanswered connection (the caller notifies). It
    /// dials as kubelet's does: grpc-go with the bare socket path as its target, so the path
    /// is the HTTP/2 `:authority`.
    async fn discover(&self) -> (PathBuf, PathClient, reg::PluginInfo) {
        let start = Instant::now();
        let mut last = String::from("no socket yet");
        loop {
            for sock in self.reg_sockets() {
                match PathClient::dial(&sock) {
                    Ok(mut client) => {
                        match client.unary::<_, reg::PluginInfo>(GET_INFO, &reg::InfoRequest {}) {
                            Ok(info) => return (sock, client, info),
                            Err(e) => last = format!("GetInfo: {e}"),
                        }
                    }
                    Err(e) => last = format!("dial: {e}"),
                }
            }
            assert!(
                start.elapsed() < DEADLINE,
                "no registration socket answered in {} ({last})",
                self.registry.display()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Discovers and registers the plugin as kubelet does: validate GetInfo, dial the endpoint
    /// it names, NodeGetInfo, then NotifyRegistrationStatus(true).
    async fn register(&self) -> Registered {
        let (sock, mut client, info) = self.discover().await;
        assert_eq!(
            sock.file_name().unwrap(),
            format!("{DRIVER}-reg.sock").as_str()
        );
        assert_eq!(info.r#type, "CSIPlugin");
        assert_eq!(info.name, DRIVER);
        // kubelet's CSI plugin takes the highest 1.x version it knows.
        assert!(
            info.supported_versions.iter().any(|v| v.starts_with("1.")),
            "{:?}",
            info.supported_versions
        );
        let mut node = NodeClient::new(
            connect(Path::new(&info.endpoint))
                .await
                .expect("dial the endpoint GetInfo names"),
        );
        let ni = node
            .node_get_info(csi::NodeGetInfoRequest {})
            .await
            .expect("NodeGetInfo")
            .into_inner();
        assert_eq!(ni.node_id, "node-k");
        notify(&mut client, true, "").expect("notify");
        Registered { info, node }
    }

    /// kubelet's MountDevice: `plugins/kubernetes.io/csi/<driver>/<sha256>/globalmount`;
    /// kubelet makes `globalmount` itself (MkdirAll) and writes vol_data.json beside it.
    fn stage_path(&self, handle: &str) -> PathBuf {
        let dir = self.sb.k(&format!(
            "plugins/kubernetes.io/csi/{DRIVER}/{}",
            handle_dir(handle)
        ));
        let globalmount = dir.join("globalmount");
        std::fs::create_dir_all(&globalmount).expect("kubelet's globalmount");
        std::fs::write(dir.join("vol_data.json"), b"{}").expect("vol_data.json");
        globalmount
    }

    /// kubelet's SetUp: `pods/<uid>/volumes/kubernetes.io~csi/<pv>/mount`; kubelet makes the
    /// `<pv>` dir and its vol_data.json, the driver makes `mount`.
    fn publish_path(&self, pod: &str, pv: &str) -> PathBuf {
        let dir = self
            .sb
            .k(&format!("pods/{pod}/volumes/kubernetes.io~csi/{pv}"));
        std::fs::create_dir_all(&dir).expect("kubelet's pod volume dir");
        std::fs::write(dir.join("vol_data.json"), b"{}").expect("vol_data.json");
        dir.join("mount")
    }

    /// After a successful unpublish or unstage kubelet removes the path if the driver left
    /// it (an empty dir, never a mount), its vol_data.json and the dir holding them.
    fn clean_up(&self, path: &Path) {
        assert!(!is_mount_point(path), "{} is still mounted", path.display());
        if path.exists() {
            std::fs::remove_dir(path).expect("kubelet removes the empty mount dir");
        }
        let dir = path.parent().expect("parent");
        let _ = std::fs::remove_file(dir.join("vol_data.json"));
        std::fs::remove_dir(dir).expect("kubelet removes the volume dir, empty by now");
    }

    /// Block staging: `plugins/kubernetes.io/csi/volumeDevices/staging/<pv>`, made by kubelet.
    fn block_stage_path(&self, pv: &str) -> PathBuf {
        let p = self.sb.k(&format!(
            "plugins/kubernetes.io/csi/volumeDevices/staging/{pv}"
        ));
        std::fs::create_dir_all(&p).expect("kubelet makes the block staging dir");
        p
    }

    /// Block publish: `plugins/kubernetes.io/csi/volumeDevices/publish/<pv>/<pod uid>`; kubelet
    /// makes the parent, the driver the file.
    fn block_publish_path(&self, pv: &str, pod: &str) -> PathBuf {
        let dir = self.sb.k(&format!(
            "plugins/kubernetes.io/csi/volumeDevices/publish/{pv}"
        ));
        std::fs::create_dir_all(&dir).expect("kubelet makes the block publish dir");
        dir.join(pod)
    }
}

fn mount_cap() -> csi::VolumeCapability {
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

fn block_cap() -> csi::VolumeCapability {
    csi::VolumeCapability {
        access_mode: Some(AccessMode {
            mode: Mode::SingleNodeWriter as i32,
        }),
        access_type: Some(AccessType::Block(BlockVolume {})),
    }
}

fn stage_req(
    id: &str,
    dev: &Path,
    staging: &Path,
    cap: csi::VolumeCapability,
) -> csi::NodeStageVolumeRequest {
    csi::NodeStageVolumeRequest {
        volume_id: id.into(),
        publish_context: HashMap::from([("devicePath".into(), dev.display().to_string())]),
        staging_target_path: staging.display().to_string(),
        volume_capability: Some(cap),
        secrets: HashMap::new(),
        volume_context: HashMap::new(),
    }
}

fn publish_req(
    id: &str,
    staging: &Path,
    target: &Path,
    cap: csi::VolumeCapability,
) -> csi::NodePublishVolumeRequest {
    csi::NodePublishVolumeRequest {
        volume_id: id.into(),
        publish_context: HashMap::new(),
        staging_target_path: staging.display().to_string(),
        target_path: target.display().to_string(),
        volume_capability: Some(cap),
        readonly: false,
        secrets: HashMap::new(),
        volume_context: HashMap::new(),
    }
}

fn node_args(sb: &Sandbox, k: &Kubelet<'_>, extra: &[&str]) -> Vec<String> {
    let registry = k.registry.display().to_string();
    let mut a = vec![
        "--driver-name",
        DRIVER,
        "--registration-dir",
        &registry,
        "--shutdown-grace",
        "5",
    ];
    a.extend_from_slice(extra);
    sb.node_args("node-k", &a)
}

async fn start_node(socket: &Path, args: &[String]) -> Daemon {
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    Daemon::start(socket, &args).await
}

/// SIGKILL, as an OOM kill or a node agent would.
fn kill(d: &mut Daemon) {
    let _ = d.child.kill();
    let _ = d.child.wait();
}

fn mounts_at(sb: &Sandbox, p: &Path) -> usize {
    sb.mounts().iter().filter(|m| *m == p).count()
}

#[test]
fn kubelet_registers_moor_node_and_drives_volumes_across_restarts() {
    let sb = Sandbox::new("kubelet");
    let dev = sb.loop_device("fs.img", 256 * MIB);
    let bdev = sb.loop_device("block.img", 64 * MIB);
    let k = Kubelet::new(&sb);
    let socket = k.csi_socket();
    let args = node_args(&sb, &k, &[]);
    let rt = runtime();
    let mut daemon = rt.block_on(start_node(&socket, &args));
    let reg_socket = k.registry.join(format!("{DRIVER}-reg.sock"));

    rt.block_on(async {
        let Registered { info, mut node } = k.register().await;
        // Without --kubelet-registration-path the endpoint is the --endpoint socket's path.
        assert_eq!(info.endpoint, socket.display().to_string());
        let mode = std::fs::metadata(&reg_socket)
            .expect("reg socket")
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o660);

        // --- a filesystem volume, in kubelet's layout ---
        let staging = k.stage_path("vol-k");
        let stage = stage_req("vol-k", &dev, &staging, mount_cap());
        node.node_stage_volume(stage.clone()).await.expect("stage");
        assert!(is_mount_point(&staging));
        let target = k.publish_path("0b6f6d2c-4a3e-4c59-9a0e-5f4e0a1d2c3b", "pv-k");
        assert!(!target.exists(), "kubelet leaves mount to the driver");
        let publish = publish_req("vol-k", &staging, &target, mount_cap());

        // moor-node dies while kubelet's NodePublishVolume is in flight; kubelet sees an
        // error (or the answer, if the call won the race) and retries after the restart.
        let in_flight = {
            let mut node = node.clone();
            let publish = publish.clone();
            tokio::spawn(async move { node.node_publish_volume(publish).await })
        };
        tokio::time::sleep(Duration::from_millis(1)).await;
        kill(&mut daemon);
        let first = in_flight.await.expect("join");
        if let Err(s) = &first {
            eprintln!(
                "in-flight publish ended with {:?}: {}",
                s.code(),
                s.message()
            );
        }
        daemon = start_node(&socket, &args).await;
        let Registered { mut node, .. } = k.register().await;
        node.node_publish_volume(publish.clone())
            .await
            .expect("kubelet's retry of the in-flight publish");
        assert!(is_mount_point(&target));
        assert_eq!(
            mounts_at(&sb, &target),
            1,
            "one mount at the target, not two"
        );
        std::fs::write(target.join("data"), b"through kubelet's paths").expect("write");
        // A retry of the publish that already succeeded is a no-op.
        node.node_publish_volume(publish)
            .await
            .expect("publish again");
        assert_eq!(mounts_at(&sb, &target), 1);

        // Killed between calls: the next call after the restart finds everything in place.
        kill(&mut daemon);
        daemon = start_node(&socket, &args).await;
        let Registered { mut node, .. } = k.register().await;
        node.node_stage_volume(stage)
            .await
            .expect("stage retry after restart");
        assert_eq!(mounts_at(&sb, &staging), 1);
        assert_eq!(
            std::fs::read(staging.join("data")).expect("read through the staging mount"),
            b"through kubelet's paths"
        );
        let unpublish = csi::NodeUnpublishVolumeRequest {
            volume_id: "vol-k".into(),
            target_path: target.display().to_string(),
        };
        node.node_unpublish_volume(unpublish.clone())
            .await
            .expect("unpublish");
        assert!(!target.exists(), "the driver removes the target");
        k.clean_up(&target);
        // kubelet retries an unpublish whose answer it lost: still success.
        node.node_unpublish_volume(unpublish)
            .await
            .expect("unpublish retry");
        let unstage = csi::NodeUnstageVolumeRequest {
            volume_id: "vol-k".into(),
            staging_target_path: staging.display().to_string(),
        };
        node.node_unstage_volume(unstage.clone())
            .await
            .expect("unstage");
        assert!(!is_mount_point(&staging));
        kill(&mut daemon);
        daemon = start_node(&socket, &args).await;
        let Registered { mut node, .. } = k.register().await;
        node.node_unstage_volume(unstage)
            .await
            .expect("unstage retry after restart");
        k.clean_up(&staging);

        // --- a block volume, in kubelet's volumeDevices layout ---
        let bstaging = k.block_stage_path("pv-b");
        node.node_stage_volume(stage_req("vol-b", &bdev, &bstaging, block_cap()))
            .await
            .expect("block stage");
        let btarget = k.block_publish_path("pv-b", "7d1b2e3f-0000-4000-8000-000000000001");
        assert!(
            !btarget.exists(),
            "kubelet leaves the publish file to the driver"
        );
        node.node_publish_volume(publish_req("vol-b", &bstaging, &btarget, block_cap()))
            .await
            .expect("block publish");
        assert!(is_block_device(&btarget));
        assert_eq!(
            std::fs::metadata(&btarget).expect("target").rdev(),
            std::fs::metadata(&bdev).expect("device").rdev()
        );
        kill(&mut daemon);
        daemon = start_node(&socket, &args).await;
        let Registered { mut node, .. } = k.register().await;
        node.node_unpublish_volume(unpublish_req("vol-b", &btarget))
            .await
            .expect("block unpublish after restart");
        assert!(!btarget.exists());
        node.node_unstage_volume(unstage_req("vol-b", &bstaging))
            .await
            .expect("block unstage");
        // kubelet removes the block staging dir itself (RemoveAll) after NodeUnstageVolume.
        let _ = std::fs::remove_dir_all(&bstaging);
    });
    drop(rt); // closes the harness's connections
    assert!(reg_socket.exists());
    let status = daemon.terminate();
    assert!(
        status.success(),
        "SIGTERM ends moor-node with 0: {status:?}"
    );
    assert!(
        !reg_socket.exists(),
        "the registration socket is removed on SIGTERM"
    );
    assert!(!socket.exists(), "the CSI socket is removed on SIGTERM");
    assert!(sb.mounts().is_empty(), "{:?}", sb.mounts());
}

#[test]
fn a_refused_registration_stops_moor_node_with_a_failure() {
    let sb = Sandbox::new("kubelet-refused");
    let k = Kubelet::new(&sb);
    let socket = k.csi_socket();
    // As in the DaemonSet: the container sees the socket elsewhere than the host does.
    let host_path = "/var/lib/kubelet/plugins/moor.csi.io/csi.sock";
    let args = node_args(
        &sb,
        &k,
        &[
            "--kubelet-registration-path",
            &format!("unix://{host_path}"),
        ],
    );
    let rt = runtime();
    let mut daemon = rt.block_on(start_node(&socket, &args));
    let reg_socket = k.registry.join(format!("{DRIVER}-reg.sock"));
    rt.block_on(async {
        let (_, mut client, info) = k.discover().await;
        assert_eq!(info.endpoint, host_path);
        notify(&mut client, false, "plugin version not supported")
            .expect("the notification is answered before moor-node stops");
        // moor-node begins to stop only once kubelet has that answer, which it shows by
        // closing the connection (kubelet's plugin watcher does after its last call): until
        // then the connection is served as before, with no GOAWAY ahead of an answer.
        let again: reg::PluginInfo = client
            .unary(GET_INFO, &reg::InfoRequest {})
            .expect("moor-node does not stop while kubelet's connection is open");
        assert_eq!(again.endpoint, host_path);
        assert!(
            matches!(daemon.child.try_wait(), Ok(None)),
            "moor-node does not stop while kubelet's connection is open"
        );
    });
    drop(rt);
    let status = daemon.wait_exit("a refused registration");
    assert!(
        !status.success(),
        "a refused registration ends moor-node with a failure: {status:?}"
    );
    assert!(status.code().is_some(), "an exit, not a crash: {status:?}");
    assert!(!reg_socket.exists(), "the registration socket is removed");
    assert!(!socket.exists(), "the CSI socket is removed");
}

#[test]
fn a_refusal_on_a_connection_kubelet_keeps_open_stops_moor_node_after_the_grace() {
    let sb = Sandbox::new("kubelet-refused-open");
    let k = Kubelet::new(&sb);
    let socket = k.csi_socket();
    let registry = k.registry.display().to_string();
    let args = sb.node_args(
        "node-k",
        &[
            "--driver-name",
            DRIVER,
            "--registration-dir",
            &registry,
            "--shutdown-grace",
            "1",
        ],
    );
    let rt = runtime();
    let mut daemon = rt.block_on(start_node(&socket, &args));
    // The connection stays open until moor-node has gone (a client that never closes it).
    let _client = rt.block_on(async {
        let (_, mut client, _) = k.discover().await;
        notify(&mut client, false, "refused").expect("answered");
        client
    });
    drop(rt);
    // After --shutdown-grace for kubelet to take the answer, and as much for the graceful stop.
    let status = daemon.wait_exit("a refusal on a connection kept open");
    assert!(!status.success() && status.code().is_some(), "{status:?}");
    assert!(!socket.exists(), "the CSI socket is removed");
}

/// Waits for the HTTP endpoint to answer (it is bound before the gRPC server serves, but
/// the tests must not rely on ordering they do not see).
fn wait_http(addr: &str) {
    let start = Instant::now();
    while http_get(addr, "/healthz").is_err() {
        assert!(
            start.elapsed() < DEADLINE,
            "{addr} did not answer GET /healthz within {DEADLINE:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Starts `program` with `--http-endpoint 127.0.0.1:0` and `args`, its log in the sandbox;
/// returns it once it answers, with the address its HTTP endpoint was given.
fn start_with_http(
    sb: &Sandbox,
    program: &str,
    socket: &Path,
    args: &[String],
) -> (Daemon, String) {
    let log = sb.root.join(format!("{program}.log"));
    let mut all = args.to_vec();
    all.extend(["--http-endpoint".to_string(), "127.0.0.1:0".to_string()]);
    let mut daemon = Daemon::spawn_logged(program, socket, &all, &log);
    runtime().block_on(daemon.wait_answering());
    let addr = http_address(&log, &mut daemon);
    wait_http(&addr);
    (daemon, addr)
}

fn metric_line<'a>(text: &'a str, prefix: &str) -> Option<&'a str> {
    text.lines().find(|l| l.starts_with(prefix))
}

#[test]
fn moor_node_health_and_metrics_over_http() {
    let sb = Sandbox::new("node-http");
    let dev = sb.loop_device("m.img", 256 * MIB);
    let k = Kubelet::new(&sb);
    let socket = k.csi_socket();
    let args = node_args(&sb, &k, &[]);
    let (mut daemon, addr) = start_with_http(&sb, "moor-node", &socket, &args);
    let rt = runtime();
    let health = http_get(&addr, "/healthz").expect("healthz");
    assert_eq!((health.status, health.body.as_str()), (200, "ok\n"));

    let staging = k.stage_path("vol-m");
    let target = k.publish_path("pod-m", "pv-m");
    rt.block_on(async {
        let mut node = NodeClient::new(connect(&socket).await.expect("connect"));
        let mut stage = stage_req("vol-m", &dev, &staging, mount_cap());
        stage.secrets = HashMap::from([("password".into(), "hunter2-do-not-leak".into())]);
        node.node_stage_volume(stage).await.expect("stage");
        node.node_publish_volume(publish_req("vol-m", &staging, &target, mount_cap()))
            .await
            .expect("publish");
        let bad = node
            .node_publish_volume(csi::NodePublishVolumeRequest::default())
            .await
            .expect_err("empty request");
        assert_eq!(bad.code(), tonic::Code::InvalidArgument);
    });

    let m = http_get(&addr, "/metrics").expect("metrics");
    assert_eq!(m.status, 200);
    assert_eq!(
        m.header("content-type"),
        Some("text/plain; version=0.0.4; charset=utf-8")
    );
    let text = m.body.as_str();
    for want in [
        "# TYPE moor_grpc_requests_total counter",
        r#"moor_grpc_requests_total{method="NodeStageVolume",code="OK"} 1"#,
        r#"moor_grpc_requests_total{method="NodePublishVolume",code="OK"} 1"#,
        r#"moor_grpc_requests_total{method="NodePublishVolume",code="InvalidArgument"} 1"#,
        r#"moor_grpc_request_duration_seconds_count{method="NodeStageVolume",code="OK"} 1"#,
        r#"moor_mkfs_duration_seconds_count{fs_type="ext4",result="ok"} 1"#,
        r#"moor_mount_duration_seconds_count{kind="filesystem",result="ok"} 1"#,
        r#"moor_mount_duration_seconds_count{kind="bind",result="ok"} 1"#,
        "# TYPE moor_reconcile_actions_total counter",
        "moor_volumes_staged 1",
        "moor_volumes_published 1",
    ] {
        assert!(text.lines().any(|l| l == want), "{want:?} not in:\n{text}");
    }
    assert!(
        metric_line(
            text,
            r#"moor_grpc_request_duration_seconds_bucket{method="NodeStageVolume",code="OK",le="+Inf"}"#
        )
        .is_some()
    );
    assert!(!text.contains("hunter2"), "a secret reached the metrics");
    assert!(!text.contains("vol-m"), "volume ids are not labels");
    assert_eq!(http_get(&addr, "/nope").expect("404").status, 404);

    rt.block_on(async {
        let mut node = NodeClient::new(connect(&socket).await.expect("connect"));
        unpublish_and_unstage(&mut node, "vol-m", &staging, &target).await;
    });
    let m = http_get(&addr, "/metrics").expect("metrics").body;
    assert!(m.lines().any(|l| l == "moor_volumes_staged 0"), "{m}");
    assert!(m.lines().any(|l| l == "moor_volumes_published 0"), "{m}");
    assert!(
        m.lines()
            .any(|l| l.starts_with("moor_unmount_duration_seconds_count{result=\"ok\"} ")),
        "{m}"
    );

    // Not ready when the state dir is unusable, as Probe would say; ready again once it is.
    let aside = sb.root.join("state-aside");
    std::fs::rename(&sb.state, &aside).expect("move the state dir away");
    let sick = http_get(&addr, "/healthz").expect("healthz");
    assert_eq!(sick.status, 503, "{}", sick.body);
    assert!(sick.body.contains("not writable"), "{}", sick.body);
    rt.block_on(async {
        let mut id = IdentityClient::new(connect(&socket).await.expect("connect"));
        let e = id
            .probe(csi::ProbeRequest {})
            .await
            .expect_err("Probe and /healthz agree");
        assert_eq!(e.code(), tonic::Code::FailedPrecondition);
        assert!(e.message().contains("not writable"), "{}", e.message());
    });
    std::fs::rename(&aside, &sb.state).expect("move the state dir back");
    assert_eq!(http_get(&addr, "/healthz").expect("healthz").status, 200);

    drop(rt);
    assert!(daemon.terminate().success());
    assert!(
        std::net::TcpStream::connect(&addr).is_err(),
        "the HTTP endpoint stops with the gRPC server"
    );
    assert!(sb.mounts().is_empty());
}

/// Until kubelet registers the plugin, moor-node says it waits: `moor_registration_registered`
/// is 0, and past --registration-timeout /healthz is not ready and the log says why. Once
/// kubelet has registered it (over a connection that sends the socket path as :authority, as
/// kubelet's does), both are well.
#[test]
fn registration_not_done_in_time_is_reported() {
    let sb = Sandbox::new("kubelet-late");
    let k = Kubelet::new(&sb);
    let socket = k.csi_socket();
    let args = node_args(&sb, &k, &["--registration-timeout", "1"]);
    let log = sb.root.join("moor-node.log");
    let (mut daemon, addr) = start_with_http(&sb, "moor-node", &socket, &args);
    let rt = runtime();
    let gauge = |addr: &str| {
        let m = http_get(addr, "/metrics").expect("metrics").body;
        metric_line(&m, "moor_registration_registered ")
            .unwrap_or_else(|| panic!("no registration gauge in:\n{m}"))
            .to_string()
    };
    assert_eq!(gauge(&addr), "moor_registration_registered 0");

    let text = wait_for_log(&log, "not registered with kubelet after 1 s", &mut daemon);
    assert!(
        text.contains("kubelet has not called GetInfo on the registration socket"),
        "{text}"
    );
    assert!(text.contains("/healthz reports not ready"), "{text}");
    let sick = http_get(&addr, "/healthz").expect("healthz");
    assert_eq!(sick.status, 503, "{}", sick.body);
    assert!(
        sick.body
            .contains("not registered with kubelet after 1 s: kubelet has not called GetInfo"),
        "{}",
        sick.body
    );
    assert_eq!(gauge(&addr), "moor_registration_registered 0");

    rt.block_on(async {
        k.register().await;
    });
    wait_for_log(&log, "registered with kubelet", &mut daemon);
    assert_eq!(gauge(&addr), "moor_registration_registered 1");
    let well = http_get(&addr, "/healthz").expect("healthz");
    assert_eq!((well.status, well.body.as_str()), (200, "ok\n"));
    drop(rt);
    assert!(daemon.terminate().success());
}

#[test]
fn moor_controller_health_and_metrics_over_http() {
    let sb = Sandbox::new("controller-http");
    let socket = sb.root.join("controller.sock");
    let data = sb.data.join("controller");
    let args = [
        "--node-id".to_string(),
        "node-c".to_string(),
        "--data-dir".to_string(),
        data.display().to_string(),
    ];
    let (mut daemon, addr) = start_with_http(&sb, "moor-controller", &socket, &args);
    let rt = runtime();
    assert_eq!(http_get(&addr, "/healthz").expect("healthz").status, 200);
    rt.block_on(async {
        let channel = connect(&socket).await.expect("connect");
        let mut id = IdentityClient::new(channel.clone());
        id.get_plugin_info(csi::GetPluginInfoRequest {})
            .await
            .expect("info");
        let mut ctl = csi::controller_client::ControllerClient::new(channel);
        let bad = ctl
            .create_volume(csi::CreateVolumeRequest::default())
            .await
            .expect_err("no name");
        assert_eq!(bad.code(), tonic::Code::InvalidArgument);
    });
    let m = http_get(&addr, "/metrics").expect("metrics");
    assert_eq!(m.status, 200);
    for want in [
        "# TYPE moor_grpc_request_duration_seconds histogram",
        r#"moor_grpc_requests_total{method="GetPluginInfo",code="OK"} 1"#,
        r#"moor_grpc_requests_total{method="CreateVolume",code="InvalidArgument"} 1"#,
    ] {
        assert!(
            m.body.lines().any(|l| l == want),
            "{want:?} not in:\n{}",
            m.body
        );
    }
    assert!(
        !m.body.contains("moor_mount_duration_seconds"),
        "node metrics are the node's"
    );

    // Not ready when the data dir cannot be written, as Probe would say.
    let tmp = data.join("tmp");
    let aside = data.join("tmp-aside");
    std::fs::rename(&tmp, &aside).expect("move tmp away");
    let sick = http_get(&addr, "/healthz").expect("healthz");
    assert_eq!(sick.status, 503, "{}", sick.body);
    std::fs::rename(&aside, &tmp).expect("move tmp back");
    assert_eq!(http_get(&addr, "/healthz").expect("healthz").status, 200);

    drop(rt);
    assert!(daemon.terminate().success());
    assert!(std::net::TcpStream::connect(&addr).is_err());
}
