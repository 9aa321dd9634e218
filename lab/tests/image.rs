//! moor's image run as its pods run (run as root after `bash .ci/image`; skipped without the
//! image or an OCI runtime). Each daemon runs in a container started by runc (or crun) from
//! the OCI runtime configuration its rendered manifest gives ([`moor_deploy::oci`]): moor-node
//! from the builtin-registration overlay's DaemonSet (privileged, host network, the kubelet
//! dir Bidirectional, /dev, /sys, /run/udev, the socket, registration and state dirs as host
//! paths), moor-controller from the Deployment (privileged, /dev, its data dir, its socket in
//! an emptyDir). The host paths are the test's dirs: every /var/lib/kubelet of the manifest is
//! moved to the test's kubelet dir, inside the container and out (as for a distribution that
//! keeps it elsewhere), the controller's data dir likewise (the same path inside and out, as
//! the manifest wants); the state dir maps on the host side only. The test plays kubelet and
//! the sidecars from the host, whose mount namespace is the test's own. With a Ceph cluster in
//! the environment (`.ci/test`'s Ceph block), an RBD volume goes through the controller's RBD
//! backend and rbd-fuse in the node container, also across a restart of that container.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use moor_deploy::oci::{self, Host, PodNetwork};
use moor_lab::container::{self, Container, Image};
use moor_privileged::kubelet_calls::{Kubelet, fresh_call};
use moor_privileged::pathgrpc::PathClient;
use moor_privileged::requests::{unpublish_req, unstage_req};
use moor_privileged::{Sandbox, client, fs_cap, is_mount_point};
use moor_proto::csi::v1 as csi;
use moor_proto::csi::v1::volume_capability::access_mode::Mode;
use moor_proto::registration::v1 as reg;
use serde_json::Value;

const NODE: &str = "image-node";
const DRIVER: &str = "moor.csi.io";
const MIB: i64 = 1 << 20;
/// How long a daemon may take to answer after its container starts.
const START: Duration = Duration::from_secs(60);

const CREATE: &str = "/csi.v1.Controller/CreateVolume";
const DELETE: &str = "/csi.v1.Controller/DeleteVolume";
const ATTACH: &str = "/csi.v1.Controller/ControllerPublishVolume";
const DETACH: &str = "/csi.v1.Controller/ControllerUnpublishVolume";
const EXPAND: &str = "/csi.v1.Controller/ControllerExpandVolume";
const PROBE: &str = "/csi.v1.Identity/Probe";
const NODE_EXPAND: &str = "/csi.v1.Node/NodeExpandVolume";
const NODE_STATS: &str = "/csi.v1.Node/NodeGetVolumeStats";
const NODE_INFO: &str = "/csi.v1.Node/NodeGetInfo";
const GET_INFO: &str = "/pluginregistration.Registration/GetInfo";
const NOTIFY: &str = "/pluginregistration.Registration/NotifyRegistrationStatus";

/// How each program moor-node runs is asked, harmlessly, who it is: its arguments and what
/// its answer must say.
const VERSION_ARGS: &[(&str, &[&str], &str)] = &[
    ("mkfs.ext2", &["-V"], "mke2fs 1."),
    ("mkfs.ext3", &["-V"], "mke2fs 1."),
    ("mkfs.ext4", &["-V"], "mke2fs 1."),
    ("e2fsck", &["-V"], "e2fsck 1."),
    // Without arguments it prints its version with its usage (and exits 1).
    ("resize2fs", &[], "resize2fs 1."),
    ("mkfs.xfs", &["-V"], "mkfs.xfs version"),
    ("xfs_growfs", &["-V"], "xfs_growfs version"),
    (
        "mkfs.btrfs",
        &["--version"],
        "mkfs.btrfs, part of btrfs-progs",
    ),
    ("btrfs", &["--version"], "btrfs-progs v"),
    ("rbd-fuse", &["--version"], "ceph version"),
    ("cryptsetup", &["--version"], "cryptsetup 2."),
];

/// The image and the runtime, or None (the reason printed) when either is missing.
fn prerequisites(test: &str) -> Option<(&'static Image, String)> {
    moor_privileged::require_root();
    let found = container::image().and_then(|i| container::runtime().map(|r| (i, r)));
    match found {
        Ok(f) => Some(f),
        Err(why) => {
            eprintln!("{test}: skipped: {why}");
            None
        }
    }
}

/// The workload of `kind` as the overlay renders it.
fn workload(overlay: &str, kind: &str) -> Value {
    let dir = moor_deploy::deploy_dir().join("overlays").join(overlay);
    let res = moor_deploy::kubectl::render(&dir)
        .unwrap_or_else(|e| panic!("{} does not render: {}", dir.display(), e.join("\n")));
    res.into_iter()
        .map(|r| r.doc)
        .find(|d| d["kind"] == kind)
        .unwrap_or_else(|| panic!("{overlay}: no {kind}"))
}

/// Replaces the `--flag=...` argument of a runtime configuration's process.
fn set_arg(config: &mut Value, flag: &str, value: &str) {
    let args = config["process"]["args"].as_array_mut().expect("args");
    let prefix = format!("{flag}=");
    let at = args
        .iter()
        .position(|a| a.as_str().is_some_and(|a| a.starts_with(&prefix)))
        .unwrap_or_else(|| panic!("no {flag} in {args:?}"));
    args[at] = Value::String(format!("{prefix}{value}"));
}

/// The test's pods: its sandbox, the two workloads with their dirs moved into it.
struct Pods {
    sb: Sandbox,
    image: &'static Image,
    runtime: String,
    node: Value,
    controller: Value,
    /// Where the controller's data dir is, inside its container and out.
    data: PathBuf,
    /// moor-node's /healthz and /metrics (host network: a free port of the host's).
    /// The node's HTTP endpoint, as its last start logged it (the kernel picks the port).
    node_http: std::sync::Mutex<String>,
    started: AtomicU32,
}

impl Pods {
    fn new(name: &str, image: &'static Image, runtime: String) -> Self {
        let sb = Sandbox::new(name);
        // kubelet's dir must be a shared mount for a Bidirectional volume (kubelet refuses
        // one that is not): a bind of itself, made shared, in the test's namespace.
        rustix::mount::mount_bind(&sb.kubelet, &sb.kubelet).expect("bind the kubelet dir");
        rustix::mount::mount_change(&sb.kubelet, rustix::mount::MountPropagationFlags::SHARED)
            .expect("make the kubelet dir shared");
        // kubelet makes its plugin registration dir (the DaemonSet's type: Directory).
        std::fs::create_dir_all(sb.k("plugins_registry")).expect("plugins_registry");
        let data = sb.root.join("controller-data");
        let kubelet = sb.kubelet.display().to_string();
        let mut node = workload("builtin-registration", "DaemonSet");
        oci::relocate(&mut node, "/var/lib/kubelet", &kubelet);
        let mut controller = workload("registrar", "Deployment");
        oci::relocate(
            &mut controller,
            "/var/lib/moor-controller",
            &data.display().to_string(),
        );
        // The controller sees the kubelet's mounts (HostToContainer), to freeze group members.
        oci::relocate(&mut controller, "/var/lib/kubelet", &kubelet);
        Self {
            node_http: std::sync::Mutex::new(String::new()),
            sb,
            image,
            runtime,
            node,
            controller,
            data,
            started: AtomicU32::new(0),
        }
    }

    /// Where a hostPath of the manifests is here: the test's dirs for what the test owns, the
    /// host's own /dev and /sys (and /run/udev, when the host has udev).
    fn host_path(&self, path: &str) -> PathBuf {
        let p = Path::new(path);
        if p.starts_with(&self.sb.kubelet) || p.starts_with(&self.data) {
            return p.to_path_buf();
        }
        match path {
            "/var/lib/moor" => self.sb.state.clone(),
            "/dev" | "/sys" | "/sys/fs/cgroup" => p.to_path_buf(),
            "/run/udev" if p.is_dir() => p.to_path_buf(),
            "/run/udev" => self.sb.root.join("run-udev"),
            other => panic!("a hostPath the test does not expect: {other} (map it in image.rs)"),
        }
    }

    /// The host's path of the controller's socket (in its emptyDir).
    fn controller_socket(&self) -> PathBuf {
        self.sb.root.join("empty-dir-socket-dir/csi.sock")
    }

    /// The host's path of moor-node's CSI socket (in the socket dir, below the kubelet dir).
    fn node_socket(&self) -> PathBuf {
        self.sb.k(&format!("plugins/{DRIVER}/csi.sock"))
    }

    fn config(&self, workload: &Value, name: &str, network: PodNetwork) -> Value {
        let env: Vec<String> = self.image.config["Env"]
            .as_array()
            .map(|e| {
                e.iter()
                    .filter_map(|v| v.as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default();
        let host_path = |p: &str| self.host_path(p);
        let root = self.sb.root.clone();
        let empty_dir = |v: &str| {
            let d = root.join(format!("empty-dir-{v}"));
            std::fs::create_dir_all(&d).expect("emptyDir");
            d
        };
        let n = self.started.fetch_add(1, Ordering::Relaxed);
        let cgroup = format!("/moor-test/{}-{n}", std::process::id());
        let caps = oci::current_capabilities().expect("this process's capabilities");
        let host = Host {
            rootfs: &self.image.rootfs,
            image_env: &env,
            fields: &[("spec.nodeName", NODE)],
            host_path: &host_path,
            empty_dir: &empty_dir,
            pod_network: network,
            cgroups_path: &cgroup,
            capabilities: &caps,
        };
        oci::runtime_config(workload, name, &host).unwrap_or_else(|e| panic!("{name}: {e}"))
    }

    fn id(&self, what: &str) -> String {
        format!(
            "moor-{}-{}-{what}",
            std::process::id(),
            self.started.load(Ordering::Relaxed)
        )
    }

    /// Starts moor-node's container and waits until it answers kubelet's first call.
    fn start_node(&self) -> Container {
        let mut config = self.config(&self.node, "moor-node", PodNetwork::Own);
        set_arg(&mut config, "--http-endpoint", "127.0.0.1:0");
        let id = self.id("node");
        let mut c = Container::start(&self.runtime, self.image, &self.sb.root, &id, config);
        let socket = self.node_socket();
        c.wait_until("moor-node answering NodeGetCapabilities", START, || {
            Kubelet::new(&socket).capabilities().err()
        });
        let log = c.log.clone();
        let logged =
            move || client::logged_http_address(&std::fs::read_to_string(&log).unwrap_or_default());
        let address = logged.clone();
        c.wait_until("moor-node logging its http endpoint", START, move || {
            logged()
                .is_none()
                .then(|| "no \"http endpoint serving\" line yet".to_string())
        });
        let address = address().expect("the http endpoint's address");
        *self.node_http.lock().unwrap_or_else(|e| e.into_inner()) = address;
        c
    }

    /// The node's HTTP endpoint.
    fn node_http(&self) -> String {
        self.node_http
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Starts moor-controller's container (with `extra` arguments, and its http endpoint at
    /// `http`, else the manifests') and waits until Probe says it is ready.
    fn start_controller(
        &self,
        extra: &[&str],
        network: PodNetwork,
        http: Option<&str>,
    ) -> Container {
        let mut config = self.config(&self.controller, "moor-controller", network);
        if let Some(endpoint) = http {
            set_arg(&mut config, "--http-endpoint", endpoint);
        }
        let args = config["process"]["args"].as_array_mut().expect("args");
        args.extend(extra.iter().map(|a| Value::String((*a).to_owned())));
        let id = self.id("controller");
        let mut c = Container::start(&self.runtime, self.image, &self.sb.root, &id, config);
        let socket = self.controller_socket();
        c.wait_until(
            "moor-controller ready (Probe)",
            START,
            || match fresh_call::<_, csi::ProbeResponse>(&socket, PROBE, &csi::ProbeRequest {}) {
                Ok(r) if r.ready != Some(false) => None,
                Ok(r) => Some(format!("{r:?}")),
                Err(e) => Some(e.to_string()),
            },
        );
        c
    }

    /// kubelet's staging path of a volume.
    fn staging(&self, pv: &str) -> PathBuf {
        let p = moor_privileged::kubelets_part(self.sb.k(&format!(
            "plugins/kubernetes.io/csi/{DRIVER}/{pv}-hash/globalmount"
        )));
        std::fs::create_dir_all(&p).expect("kubelet's globalmount");
        p
    }

    /// kubelet's publish path of a volume for a pod (kubelet makes the dir above it).
    fn target(&self, pv: &str) -> PathBuf {
        let dir = self
            .sb
            .k(&format!("pods/pod-{pv}/volumes/kubernetes.io~csi/{pv}"));
        std::fs::create_dir_all(&dir).expect("kubelet's pod volume dir");
        moor_privileged::kubelets_part(dir.join("mount"))
    }

    fn controller<Req: prost::Message, Resp: prost::Message + Default>(
        &self,
        method: &str,
        req: &Req,
    ) -> Resp {
        fresh_call(&self.controller_socket(), method, req)
            .unwrap_or_else(|e| panic!("{method}: {e}"))
    }
}

impl Drop for Pods {
    /// After a failure: the volumes' mounts go, then the loop devices the controller left
    /// bound to files of its data dir. They are found by inode: once the controller's
    /// container is gone, sysfs names their files relative to its detached data dir mount.
    fn drop(&mut self) {
        use moor_node::sys::loopinfo::{backing_inode, file_inode};
        for m in self.sb.mounts() {
            let _ = rustix::mount::unmount(m.as_path(), rustix::mount::UnmountFlags::DETACH);
        }
        let mut files = Vec::new();
        let mut dirs = vec![self.data.clone()];
        while let Some(d) = dirs.pop() {
            for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
                match e.file_type() {
                    Ok(t) if t.is_dir() => dirs.push(e.path()),
                    Ok(_) => files.extend(file_inode(&e.path()).ok()),
                    Err(_) => {}
                }
            }
        }
        for e in std::fs::read_dir("/sys/block")
            .into_iter()
            .flatten()
            .flatten()
        {
            let dev = Path::new("/dev").join(e.file_name());
            if e.file_name().to_string_lossy().starts_with("loop")
                && backing_inode(&dev).is_ok_and(|b| files.contains(&b))
            {
                let _ = moor_node::sys::loopdev::detach(&dev);
            }
        }
    }
}

/// The embedded volume's filesystem: XFS, whose online growth (xfs_growfs) runs in a container
/// on this kind of machine; ext4's (resize2fs) needs CAP_SYS_RESOURCE, which it lacks, in a
/// container or not. The RBD volume's: ext4 (an XFS must be 300 MB at least).
const XFS: &str = "xfs";
const EXT4: &str = "ext4";

fn cap(fs: &str) -> csi::VolumeCapability {
    fs_cap(fs, Mode::SingleNodeWriter)
}

fn stage_req(
    vol: &str,
    fs: &str,
    context: HashMap<String, String>,
    staging: &Path,
    secrets: HashMap<String, String>,
) -> csi::NodeStageVolumeRequest {
    csi::NodeStageVolumeRequest {
        volume_id: vol.into(),
        publish_context: context,
        staging_target_path: staging.display().to_string(),
        volume_capability: Some(cap(fs)),
        secrets,
        volume_context: HashMap::new(),
    }
}

fn publish_req(
    vol: &str,
    fs: &str,
    staging: &Path,
    target: &Path,
) -> csi::NodePublishVolumeRequest {
    csi::NodePublishVolumeRequest {
        volume_id: vol.into(),
        staging_target_path: staging.display().to_string(),
        target_path: target.display().to_string(),
        volume_capability: Some(cap(fs)),
        ..Default::default()
    }
}

/// The attacher's ControllerPublishVolume to the node, then kubelet's stage and publish, each
/// mount seen on the host.
fn attach_and_stage(
    pods: &Pods,
    vol: &str,
    fs: &str,
    (staging, target): (&Path, &Path),
    secrets: &HashMap<String, String>,
) {
    let attached: csi::ControllerPublishVolumeResponse = pods.controller(
        ATTACH,
        &csi::ControllerPublishVolumeRequest {
            volume_id: vol.into(),
            node_id: NODE.into(),
            volume_capability: Some(cap(fs)),
            secrets: secrets.clone(),
            ..Default::default()
        },
    );
    let kubelet = Kubelet::new(&pods.node_socket());
    let req = stage_req(vol, fs, attached.publish_context, staging, secrets.clone());
    kubelet.stage(&req).expect("stage");
    assert!(
        is_mount_point(staging),
        "the staging mount reaches the host"
    );
    kubelet
        .publish(&publish_req(vol, fs, staging, target))
        .expect("publish");
    assert!(is_mount_point(target), "the target mount reaches the host");
}

/// kubelet's teardown of a volume (unpublish, unstage), each mount gone from the host and the
/// journal empty after it, then the attacher's ControllerUnpublishVolume.
fn unstage_and_detach(
    pods: &Pods,
    vol: &str,
    (staging, target): (&Path, &Path),
    secrets: &HashMap<String, String>,
) {
    let kubelet = Kubelet::new(&pods.node_socket());
    kubelet
        .unpublish(&unpublish_req(vol, target))
        .expect("unpublish");
    assert!(!is_mount_point(target), "the target is gone from the host");
    kubelet
        .unstage(&unstage_req(vol, staging))
        .expect("unstage");
    assert!(
        !is_mount_point(staging),
        "the staging mount is gone from the host"
    );
    assert!(
        journaled(&pods.sb.state, vol).is_none(),
        "nothing journaled"
    );
    let _: csi::ControllerUnpublishVolumeResponse = pods.controller(
        DETACH,
        &csi::ControllerUnpublishVolumeRequest {
            volume_id: vol.into(),
            node_id: NODE.into(),
            secrets: secrets.clone(),
        },
    );
}

/// Runs its closure when dropped: the RBD volume's deletion, also after a failure.
struct OnDrop<F: FnMut()>(F);

impl<F: FnMut()> Drop for OnDrop<F> {
    fn drop(&mut self) {
        (self.0)();
    }
}

/// kubelet's plugin watcher: GetInfo on the registration socket moor-node made in the
/// registration dir, the CSI endpoint it names dialed on the host, then the registration
/// confirmed.
fn register(pods: &Pods) {
    let reg_socket = pods.sb.k(&format!("plugins_registry/{DRIVER}-reg.sock"));
    let mut client = PathClient::dial(&reg_socket)
        .unwrap_or_else(|e| panic!("the registration socket {}: {e}", reg_socket.display()));
    let info: reg::PluginInfo = client
        .unary(GET_INFO, &reg::InfoRequest {})
        .expect("GetInfo");
    assert_eq!(
        (info.r#type.as_str(), info.name.as_str()),
        ("CSIPlugin", DRIVER)
    );
    assert_eq!(
        Path::new(&info.endpoint),
        pods.node_socket(),
        "the endpoint announced is the CSI socket's path on the host"
    );
    let ni: csi::NodeGetInfoResponse = fresh_call(
        Path::new(&info.endpoint),
        NODE_INFO,
        &csi::NodeGetInfoRequest {},
    )
    .expect("NodeGetInfo on the announced endpoint");
    assert_eq!(ni.node_id, NODE);
    let status = reg::RegistrationStatus {
        plugin_registered: true,
        error: String::new(),
    };
    let _: reg::RegistrationStatusResponse = client.unary(NOTIFY, &status).expect("notify");
}

/// Every program moor-node runs answers in its container.
fn every_tool_runs(node: &Container) {
    for program in moor_node::service::programs() {
        let (_, args, says) = VERSION_ARGS
            .iter()
            .find(|(p, ..)| *p == program)
            .unwrap_or_else(|| {
                panic!("how is {program} asked its version? add it to VERSION_ARGS")
            });
        let mut argv = vec![program.as_str()];
        argv.extend(args.iter());
        let out = node.exec(&argv);
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            text.contains(says),
            "{program} in the image ({}): {text}",
            out.status
        );
    }
}

/// The staged and published records of the volume in the node's journal.
fn journaled(state: &Path, vol: &str) -> Option<moor_node::journal::VolumeRecord> {
    let (records, problems) = moor_node::journal::read_state(state).expect("read the journal");
    assert!(problems.is_empty(), "{problems:?}");
    records.into_iter().find(|r| r.volume_id == vol)
}

fn bytes_of(target: &Path) -> u64 {
    let st = rustix::fs::statvfs(target).expect("statvfs");
    st.f_blocks * st.f_frsize
}

#[test]
fn a_volume_life_through_the_containers_survives_a_restart_of_the_node_container() {
    let Some((image, runtime)) = prerequisites("image") else {
        return;
    };
    // The image has no entrypoint of its own: the manifests set the command.
    assert!(image.config.get("Entrypoint").is_none_or(Value::is_null));
    assert!(image.config.get("Cmd").is_none_or(Value::is_null));
    let pods = Pods::new("image", image, runtime);
    // With --rbd the controller's Probe loads librados and librbd: ready means the image has
    // them. The embedded backend serves the volumes here.
    let controller = pods.start_controller(&["--rbd"], PodNetwork::Own, None);
    let node = pods.start_node();
    register(&pods);
    let healthz = client::http_get(&pods.node_http(), "/healthz").expect("/healthz");
    assert_eq!(healthz.status, 200, "{}", healthz.body);
    every_tool_runs(&node);

    let v: csi::CreateVolumeResponse = pods.controller(
        CREATE,
        &csi::CreateVolumeRequest {
            name: "pv-image".into(),
            capacity_range: Some(csi::CapacityRange {
                required_bytes: 320 * MIB,
                limit_bytes: 0,
            }),
            volume_capabilities: vec![cap(XFS)],
            ..Default::default()
        },
    );
    let vol = v.volume.expect("a volume").volume_id;
    let (staging, target) = (pods.staging("pv-image"), pods.target("pv-image"));
    attach_and_stage(&pods, &vol, XFS, (&staging, &target), &HashMap::new());
    std::fs::write(target.join("hello"), b"from the host").expect("write on the host");
    let seen = node.exec(&["cat", &target.join("hello").display().to_string()]);
    assert_eq!(
        seen.stdout, b"from the host",
        "the node container sees the same volume"
    );
    let before = journaled(&pods.sb.state, &vol).expect("journaled");
    assert!(
        before.stage.is_some() && before.publishes.len() == 1,
        "{before:?}"
    );
    // An operator asks the node what it holds with moorctl in the node container (`kubectl
    // exec ... -c moor-node -- moorctl status`): its defaults are the container's socket and
    // state dir.
    let status = node.exec(&["moorctl", "status", "-o", "json"]);
    let report = String::from_utf8_lossy(&status.stdout);
    assert!(
        status.status.success()
            && report.contains(&vol)
            && report.contains(&target.display().to_string()),
        "moorctl status in the node container ({}): {report}{}",
        status.status,
        String::from_utf8_lossy(&status.stderr)
    );

    // The node container is killed and started again (kubelet's restart of a crashed one):
    // the mounts stay on the host, the journal stays, and the new container serves them.
    let status = node.kill();
    assert!(!status.success(), "killed: {status}");
    assert!(
        is_mount_point(&staging) && is_mount_point(&target),
        "mounts outlive the container"
    );
    assert_eq!(
        std::fs::read(target.join("hello")).expect("read"),
        b"from the host"
    );
    let node = pods.start_node();
    register(&pods);
    let stats: csi::NodeGetVolumeStatsResponse = fresh_call(
        &pods.node_socket(),
        NODE_STATS,
        &csi::NodeGetVolumeStatsRequest {
            volume_id: vol.clone(),
            volume_path: target.display().to_string(),
            staging_target_path: staging.display().to_string(),
        },
    )
    .expect("NodeGetVolumeStats after the restart");
    assert!(
        stats.volume_condition.as_ref().is_none_or(|c| !c.abnormal),
        "{stats:?}"
    );
    assert_eq!(
        journaled(&pods.sb.state, &vol).as_ref(),
        Some(&before),
        "the journal after the restart's reconciliation"
    );
    assert!(is_mount_point(&staging) && is_mount_point(&target));

    // Growing runs xfs_growfs in the container.
    let small = bytes_of(&target);
    let _: csi::ControllerExpandVolumeResponse = pods.controller(
        EXPAND,
        &csi::ControllerExpandVolumeRequest {
            volume_id: vol.clone(),
            capacity_range: Some(csi::CapacityRange {
                required_bytes: 448 * MIB,
                limit_bytes: 0,
            }),
            volume_capability: Some(cap(XFS)),
            ..Default::default()
        },
    );
    let _: csi::NodeExpandVolumeResponse = fresh_call(
        &pods.node_socket(),
        NODE_EXPAND,
        &csi::NodeExpandVolumeRequest {
            volume_id: vol.clone(),
            volume_path: target.display().to_string(),
            capacity_range: Some(csi::CapacityRange {
                required_bytes: 448 * MIB,
                limit_bytes: 0,
            }),
            staging_target_path: staging.display().to_string(),
            volume_capability: Some(cap(XFS)),
            ..Default::default()
        },
    )
    .expect("NodeExpandVolume");
    assert!(
        bytes_of(&target) > small + 96 * MIB as u64,
        "grown: {small} -> {}",
        bytes_of(&target)
    );

    unstage_and_detach(&pods, &vol, (&staging, &target), &HashMap::new());
    let _: csi::DeleteVolumeResponse = pods.controller(
        DELETE,
        &csi::DeleteVolumeRequest {
            volume_id: vol,
            ..Default::default()
        },
    );
    assert!(
        moor_node::sys::loopdev::bound_under(&pods.data).is_empty(),
        "no loop device left"
    );
    drop(node);
    drop(controller);
}

#[test]
fn the_rbd_backend_and_the_fuse_attacher_in_the_containers() {
    let Some((image, runtime)) = prerequisites("image rbd") else {
        return;
    };
    let Some(ceph) = moor_lab::ceph::Ceph::from_env("image rbd") else {
        return;
    };
    let pods = Pods::new("image-rbd", image, runtime);
    // The Deployment's pod has a network of its own, from which it reaches the cluster: here a
    // network namespace of its own on the cluster's bridge. Its http endpoint is the
    // manifests' (0.0.0.0:9809), which no other process of this host can hold there. Without a
    // bridge (a cluster on 127.0.0.1) the controller shares the host's network, on a port the
    // kernel picks: no test depends on a port of the host being free.
    let netns = moor_lab::ceph::BridgeNetns::new(&ceph, "ctl", 250)
        .inspect_err(|why| eprintln!("image rbd: the controller on the host's network: {why}"))
        .ok();
    let (network, http) = match &netns {
        Some(ns) => (PodNetwork::Join(ns.path()), None),
        None => (
            PodNetwork::Join(PathBuf::from(format!(
                "/proc/{}/ns/net",
                std::process::id()
            ))),
            Some("127.0.0.1:0"),
        ),
    };
    let _controller = pods.start_controller(&["--rbd"], network, http);
    // In an Option, to be replaced by a new container while the undo below still runs after it.
    let mut node = Some(pods.start_node());
    let secrets = HashMap::from([
        ("userID".to_owned(), ceph.user.clone()),
        ("userKey".to_owned(), ceph.key.clone()),
    ]);
    let v: csi::CreateVolumeResponse = pods.controller(
        CREATE,
        &csi::CreateVolumeRequest {
            name: format!("pv-image-rbd-{}", std::process::id()),
            capacity_range: Some(csi::CapacityRange {
                required_bytes: 64 * MIB,
                limit_bytes: 0,
            }),
            volume_capabilities: vec![cap(EXT4)],
            parameters: HashMap::from([
                ("backend".to_owned(), "rbd".to_owned()),
                ("monitors".to_owned(), ceph.mons.clone()),
                ("pool".to_owned(), ceph.pool.clone()),
            ]),
            secrets: secrets.clone(),
            ..Default::default()
        },
    );
    let vol = v.volume.expect("a volume").volume_id;
    let kubelet = Kubelet::new(&pods.node_socket());
    let (staging, target) = (pods.staging("pv-rbd"), pods.target("pv-rbd"));
    // Undone at the end whatever happens, while both containers still run (dropped before
    // them): unpublished, unstaged (rbd-fuse unmapped), detached and deleted. Each step is
    // idempotent: after a passing test they find nothing to do.
    let _undo = OnDrop(|| {
        let ctl = pods.controller_socket();
        let steps = [
            kubelet.unpublish(&unpublish_req(&vol, &target)).err(),
            kubelet.unstage(&unstage_req(&vol, &staging)).err(),
            fresh_call::<_, csi::ControllerUnpublishVolumeResponse>(
                &ctl,
                DETACH,
                &csi::ControllerUnpublishVolumeRequest {
                    volume_id: vol.clone(),
                    node_id: NODE.into(),
                    secrets: secrets.clone(),
                },
            )
            .err()
            .map(|e| e.to_string()),
            fresh_call::<_, csi::DeleteVolumeResponse>(
                &ctl,
                DELETE,
                &csi::DeleteVolumeRequest {
                    volume_id: vol.clone(),
                    secrets: secrets.clone(),
                },
            )
            .err()
            .map(|e| e.to_string()),
        ];
        for e in steps.into_iter().flatten() {
            eprintln!("image rbd: undoing {vol}: {e}");
        }
        for dev in dead_mapping_loops(&vol) {
            let _ = moor_node::sys::loopdev::detach(&dev);
        }
    });
    // rbd-fuse maps the image in the node container.
    attach_and_stage(&pods, &vol, EXT4, (&staging, &target), &secrets);
    std::fs::write(target.join("hello"), b"through rbd-fuse").expect("write on the host");
    let mounts = |c: &Option<Container>| {
        let c = c.as_ref().expect("the node container");
        String::from_utf8_lossy(&c.exec(&["cat", "/proc/self/mountinfo"]).stdout).into_owned()
    };
    assert!(
        mounts(&node).contains("moor-rbd"),
        "rbd-fuse's mount in the node container"
    );
    unstage_and_detach(&pods, &vol, (&staging, &target), &secrets);
    assert!(
        !mounts(&node).contains("moor-rbd"),
        "unmapped: rbd-fuse's mount is gone"
    );

    // Staged again, then the node container killed and started again: rbd-fuse dies with
    // its container (docs/ceph.md), which the new moor-node finds at its start; kubelet's
    // teardown of the volume still succeeds.
    attach_and_stage(&pods, &vol, EXT4, (&staging, &target), &secrets);
    node.take().map(Container::kill);
    node = Some(pods.start_node());
    let log = node.as_ref().map(Container::output).unwrap_or_default();
    assert!(
        log.contains("the volume's RBD mapping is gone"),
        "the restarted moor-node sees the mapping gone: {log}"
    );
    unstage_and_detach(&pods, &vol, (&staging, &target), &secrets);
    for dev in dead_mapping_loops(&vol) {
        eprintln!(
            "image rbd: after the restart, unstaging left {} bound to the dead rbd-fuse's \
             image file (a moor-node in a new container does not find it)",
            dev.display()
        );
    }
}

/// The loop devices bound to the image file of the RBD volume `vol` on an rbd-fuse mount that
/// died with its container: sysfs names the file from that mount's root, `/<image>`.
fn dead_mapping_loops(vol: &str) -> Vec<PathBuf> {
    let image = vol.rsplit('/').next().unwrap_or(vol);
    let mut found = Vec::new();
    for e in std::fs::read_dir("/sys/block")
        .into_iter()
        .flatten()
        .flatten()
    {
        let backing = std::fs::read_to_string(e.path().join("loop/backing_file"));
        if backing.is_ok_and(|b| b.trim_end() == format!("/{image}")) {
            found.push(Path::new("/dev").join(e.file_name()));
        }
    }
    found
}
