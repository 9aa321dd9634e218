//! Ceph RBD volumes on simulated nodes, for the tests that run against the cluster
//! `.ci/ceph-cluster up` prints the environment of (`MOOR_CEPH_CONF`, `MOOR_CEPH_KEYRING`,
//! `MOOR_CEPH_USER`, `MOOR_CEPH_POOL`, `MOOR_CEPH_MON_HOST`, and with the cluster's bridge
//! `MOOR_CEPH_BRIDGE`, `MOOR_CEPH_NET`).
//!
//! A [`World`] is a sandbox (the test's own mount namespace) with one moor-node per simulated
//! node, each with its own state and kubelet dirs; [`World::networked`] also gives each node a
//! network namespace of its own (a veth on the cluster's bridge, an address of its own), so
//! that the cluster sees the nodes as different hosts, as fencing does. Everything a world
//! made (daemons, rbd-fuse, loop devices, mounts, network namespaces, images) is removed when
//! it drops, also after a failure.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use moor_node::sys::loopdev;
use moor_proto::csi::v1 as csi;
use moor_proto::csi::v1::node_client::NodeClient;
use moor_proto::csi::v1::volume_capability::access_mode::Mode;
use moor_proto::csi::v1::volume_capability::{AccessMode, AccessType, BlockVolume};
use moor_runtime::contract::{
    RBD_IMAGE_KEY as IMAGE_KEY, RBD_MONITORS_KEY as MONITORS_KEY, RBD_POOL_KEY as POOL_KEY,
    RBD_USER_ID_SECRET as USER_ID_KEY, RBD_USER_KEY_SECRET as USER_KEY_KEY,
};
use tonic::transport::Channel;

use moor_privileged::client::{Daemon, connect};

/// The clusterID the controller's cluster list gives the cluster.
pub const CLUSTER_ID: &str = "test";
use moor_privileged::{Sandbox, fs_cap, processes_mentioning};

/// The cluster the environment names.
#[derive(Debug, Clone)]
pub struct Ceph {
    /// The cluster's ceph.conf.
    pub conf: String,
    /// The keyring of the client moor's volumes use.
    pub keyring: String,
    /// That client's name (without `client.`).
    pub user: String,
    /// The pool.
    pub pool: String,
    /// The monitors, as publish contexts name them.
    pub mons: String,
    /// The client's key.
    pub key: String,
    /// The bridge the cluster listens on, and its /24's first three octets, when it has one.
    pub bridge: Option<(String, String)>,
}

impl Ceph {
    /// The cluster, or None (with the reason printed) when the environment names none.
    pub fn from_env(test: &str) -> Option<Self> {
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
            keyring,
            bridge: var("MOOR_CEPH_BRIDGE").zip(var("MOOR_CEPH_NET")),
            user: var("MOOR_CEPH_USER").unwrap_or_else(|| "moor".into()),
            pool: var("MOOR_CEPH_POOL").unwrap_or_else(|| "moor".into()),
            mons: var("MOOR_CEPH_MON_HOST").unwrap_or_else(|| "127.0.0.1:3300".into()),
            key,
        })
    }

    /// Runs `rbd` on the pool as the test user; its stdout.
    pub fn rbd(&self, args: &[&str]) -> Result<String, String> {
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

    /// Makes an image of `size_mib` MiB (after removing one of that name).
    pub fn create(&self, image: &str, size_mib: u64) {
        let _ = self.rbd(&["rm", "--no-progress", image]);
        self.rbd(&["create", "--size", &format!("{size_mib}M"), image])
            .unwrap_or_else(|e| panic!("rbd create {image}: {e}"));
    }

    /// The cluster's blocklist, as `ceph osd blocklist ls` shows it (as the admin).
    pub fn blocklist(&self) -> String {
        let out = Command::new("timeout")
            .args(["120", "ceph", "-c", &self.conf, "-n", "client.admin"])
            .args(["osd", "blocklist", "ls"])
            .output()
            .expect("ceph osd blocklist ls");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// The addresses of the clients that have `image` open, as `rbd status` shows them.
    pub fn watcher_hosts(&self, image: &str) -> Vec<String> {
        self.rbd(&["status", image])
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.trim_start().strip_prefix("watcher="))
            .filter_map(|a| a.split(':').next().map(str::to_string))
            .collect()
    }

    /// Who has the image open (its watchers), as `rbd status` says.
    pub fn watchers(&self, image: &str) -> usize {
        self.rbd(&["status", image])
            .unwrap_or_default()
            .lines()
            .filter(|l| l.trim_start().starts_with("watcher="))
            .count()
    }
}

/// One simulated node: a moor-node with its own state and kubelet dirs.
#[derive(Debug)]
pub struct Node {
    /// Its node id.
    pub name: String,
    /// moor-node's state dir.
    pub state: PathBuf,
    /// Its kubelet dir.
    pub kubelet: PathBuf,
    /// moor-node's socket.
    pub socket: PathBuf,
    /// moor-node's log (JSON lines).
    pub log: PathBuf,
    /// The running moor-node.
    pub daemon: Option<Daemon>,
    /// Its network namespace (a name under /run/netns) and its address there, when it has one.
    pub net: Option<(String, String)>,
}

/// A test's world: a sandbox (its own mount namespace), the nodes, the images; all of it
/// removed when dropped, also after a failure.
#[derive(Debug)]
pub struct World {
    /// The sandbox: the test's mount namespace and dirs.
    pub sb: Sandbox,
    /// The cluster.
    pub ceph: Ceph,
    /// The simulated nodes.
    pub nodes: Vec<Node>,
    /// The images to remove at the end.
    pub images: Vec<String>,
    /// More moor-node arguments.
    pub extra: Vec<String>,
    /// moor-controller with the RBD backend, once started.
    pub controller: Option<Daemon>,
}

impl World {
    /// A world of `nodes` nodes that share the test's network namespace.
    pub fn new(name: &str, ceph: Ceph, nodes: usize) -> Self {
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
                    net: None,
                }
            })
            .collect();
        Self {
            sb,
            ceph,
            nodes,
            images: Vec::new(),
            extra: Vec::new(),
            controller: None,
        }
    }

    /// A world of `nodes` nodes, each in a network namespace of its own with a veth on the
    /// cluster's bridge and an address of its own; None (with the reason printed) when the
    /// cluster has no bridge.
    pub fn networked(name: &str, ceph: Ceph, nodes: usize) -> Option<Self> {
        let Some((bridge, net)) = ceph.bridge.clone() else {
            eprintln!(
                "{name}: skipped: the cluster listens on 127.0.0.1 (MOOR_CEPH_BRIDGE is unset: \
                 .ci/ceph-cluster could not make its bridge), so nodes cannot be hosts of their own"
            );
            return None;
        };
        static SEQ: AtomicU32 = AtomicU32::new(0);
        let seq = SEQ.fetch_add(1, Ordering::Relaxed);
        let pid = std::process::id();
        let mut w = Self::new(name, ceph, nodes);
        for (i, n) in w.nodes.iter_mut().enumerate() {
            let ns = format!("moor-{pid}-{seq}-{i}");
            // A machine without network namespaces (or without `ip`) cannot simulate nodes.
            if let Err(why) = netns_add(&ns) {
                eprintln!("{name}: skipped: no network namespace for a simulated node ({why})");
                return None;
            }
            // At most 15 bytes: "mv", the pid in hex (at most 6), the sequence, the node.
            let veth = format!("mv{pid:x}{}{i}", seq % 100);
            let host = 10 + (seq as usize * 4 + i) % 240;
            let addr = format!("{net}.{host}");
            // Recorded before the veth exists, so that the drop removes the namespace (and
            // with it the veth pair) whatever fails next.
            n.net = Some((ns.clone(), addr.clone()));
            on_bridge(&ns, &veth, &bridge, &addr);
        }
        Some(w)
    }

    /// Starts moor-controller with the RBD backend only, on this cluster (its own
    /// credentials in its cluster list, clusterID `test`), in the test's network namespace.
    pub async fn start_controller(
        &mut self,
        args: &[&str],
    ) -> moor_proto::csi::v1::controller_client::ControllerClient<Channel> {
        let dir = self.sb.root.join("controller");
        std::fs::create_dir_all(&dir).expect("controller dir");
        let clusters = dir.join("clusters.json");
        std::fs::write(
            &clusters,
            serde_json::json!([{
                "clusterID": CLUSTER_ID,
                "monitors": [self.ceph.mons],
                "user": self.ceph.user,
                "keyring": self.ceph.keyring,
            }])
            .to_string(),
        )
        .expect("clusters.json");
        let socket = dir.join("controller.sock");
        let mut all: Vec<String> = [
            "--node-id",
            "controller",
            "--data-dir",
            &dir.join("data").display().to_string(),
            "--no-embedded",
            "--rbd-clusters",
            &clusters.display().to_string(),
            "--log-format",
            "json",
        ]
        .iter()
        .map(|s| (*s).to_string())
        .collect();
        all.extend(args.iter().map(|s| (*s).to_string()));
        let log = std::fs::File::create(dir.join("controller.log")).expect("log");
        let child = moor_privileged::client::spawn_guarded(
            Command::new(moor_privileged::client::binary("moor-controller"))
                .arg("--endpoint")
                .arg(format!("unix://{}", socket.display()))
                .args(&all)
                .stdin(std::process::Stdio::null())
                .stderr(log),
        );
        let mut d = Daemon { child, socket };
        d.wait_answering().await;
        let channel = connect(&d.socket).await.expect("connect");
        self.controller = Some(d);
        moor_proto::csi::v1::controller_client::ControllerClient::new(channel)
    }

    /// The controller's log.
    pub fn controller_log(&self) -> String {
        std::fs::read_to_string(self.sb.root.join("controller/controller.log")).unwrap_or_default()
    }

    /// The StorageClass parameters of an RBD volume on this cluster.
    pub fn parameters(&self) -> HashMap<String, String> {
        HashMap::from([
            ("backend".into(), "rbd".into()),
            ("clusterID".into(), CLUSTER_ID.into()),
            ("pool".into(), self.ceph.pool.clone()),
        ])
    }

    /// The CSI secrets of this cluster's client, as the sidecars pass them.
    pub fn secrets(&self) -> HashMap<String, String> {
        HashMap::from([
            (USER_ID_KEY.into(), self.ceph.user.clone()),
            (USER_KEY_KEY.into(), self.ceph.key.clone()),
        ])
    }

    /// Makes an image for this test (removed at the end), named after `name`.
    pub fn image(&mut self, name: &str, size_mib: u64) -> String {
        let image = format!("{name}-{}", std::process::id());
        self.ceph.create(&image, size_mib);
        self.images.push(image.clone());
        image
    }

    /// (Re)starts node `i`'s moor-node (`program`, with `env`), and connects to it.
    pub async fn start(
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
        let mut cmd = match &n.net {
            // nsenter enters the network namespace only: the node keeps the test's mount
            // namespace, where its mounts can be seen.
            Some((ns, _)) => {
                let mut c = Command::new("nsenter");
                c.arg(format!("--net=/run/netns/{ns}")).arg("--").arg(bin);
                c
            }
            None => Command::new(bin),
        };
        let child = moor_privileged::client::spawn_guarded(
            cmd.arg("--endpoint")
                .arg(format!("unix://{}", n.socket.display()))
                .args(&args)
                .envs(env.iter().copied())
                .stdin(std::process::Stdio::null())
                .stderr(log),
        );
        let mut d = Daemon {
            child,
            socket: n.socket.clone(),
        };
        d.wait_answering().await;
        n.daemon = Some(d);
        NodeClient::new(connect(&n.socket).await.expect("connect"))
    }

    pub fn staging(&self, i: usize, pv: &str) -> PathBuf {
        let p = self.nodes[i].kubelet.join(format!(
            "plugins/kubernetes.io/csi/moor.csi.io/{pv}/globalmount"
        ));
        moor_privileged::kubelets_part(p)
    }

    pub fn target(&self, i: usize, pv: &str) -> PathBuf {
        let p = self.nodes[i]
            .kubelet
            .join(format!("pods/pod/volumes/kubernetes.io~csi/{pv}/mount"));
        moor_privileged::kubelets_part(p)
    }

    pub fn block_target(&self, i: usize, pv: &str) -> PathBuf {
        let p = self.nodes[i].kubelet.join(format!(
            "plugins/kubernetes.io/csi/volumeDevices/publish/{pv}/pod"
        ));
        moor_privileged::kubelets_part(p)
    }

    pub fn stage_req(
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
    pub fn leftovers(&self, i: usize) -> (usize, usize, usize) {
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

    pub fn log(&self, i: usize) -> String {
        std::fs::read_to_string(&self.nodes[i].log).unwrap_or_default()
    }

    /// The milliseconds of every log line whose message is `msg` (the engine logs them in
    /// `ms`).
    pub fn logged_ms(&self, i: usize, msg: &str) -> Vec<f64> {
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

/// Makes the network namespace `ns` (`ip netns add`); Err(why) on a machine without network
/// namespaces or without `ip`.
fn netns_add(ns: &str) -> Result<(), String> {
    match Command::new("ip").args(["netns", "add", ns]).output() {
        Ok(out) if out.status.success() => Ok(()),
        Ok(out) => Err(format!(
            "ip netns add: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )),
        Err(e) => Err(format!("ip netns add: {e}")),
    }
}

/// Puts the namespace `ns` on `bridge`: a veth pair (`veth` on the bridge, `eth0` in `ns`),
/// `addr`/24 on `eth0`, both ends and `ns`'s loopback up.
fn on_bridge(ns: &str, veth: &str, bridge: &str, addr: &str) {
    moor_privileged::run(
        "ip",
        &[
            "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns,
        ],
    );
    moor_privileged::run("ip", &["link", "set", veth, "master", bridge, "up"]);
    let cidr = format!("{addr}/24");
    moor_privileged::run("ip", &["-n", ns, "addr", "add", &cidr, "dev", "eth0"]);
    moor_privileged::run("ip", &["-n", ns, "link", "set", "eth0", "up"]);
    moor_privileged::run("ip", &["-n", ns, "link", "set", "lo", "up"]);
}

/// A network namespace of its own on the cluster's bridge, with an address there: a host of
/// the cluster's network, as a pod with a network of its own is one of its cluster's. Removed
/// (with its veth pair) when dropped, once nothing runs in it.
#[derive(Debug)]
pub struct BridgeNetns {
    /// Its name under /run/netns.
    pub name: String,
    /// Its address on the bridge.
    pub addr: String,
}

impl BridgeNetns {
    /// A namespace for `tag` (a short word) on the bridge of `ceph`, at host `host` of the
    /// bridge's /24. Err(why) when the cluster has no bridge (it listens on 127.0.0.1) or the
    /// machine cannot make the namespace.
    pub fn new(ceph: &Ceph, tag: &str, host: u8) -> Result<Self, String> {
        let Some((bridge, net)) = ceph.bridge.clone() else {
            return Err(
                "the cluster listens on 127.0.0.1 (MOOR_CEPH_BRIDGE is unset: .ci/ceph-cluster \
                 could not make its bridge)"
                    .to_string(),
            );
        };
        let pid = std::process::id();
        let name = format!("moor-{pid}-{tag}");
        netns_add(&name)?;
        let ns = Self {
            name,
            addr: format!("{net}.{host}"),
        };
        // At most 15 bytes: "mv", the pid in hex (at most 6), the host.
        let veth = format!("mv{pid:x}h{host}");
        on_bridge(&ns.name, &veth, &bridge, &ns.addr);
        Ok(ns)
    }

    /// Its path, for a process or a container to join.
    pub fn path(&self) -> PathBuf {
        Path::new("/run/netns").join(&self.name)
    }
}

impl Drop for BridgeNetns {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .status();
    }
}

impl Drop for World {
    fn drop(&mut self) {
        for d in self
            .nodes
            .iter_mut()
            .filter_map(|n| n.daemon.take())
            .chain(self.controller.take())
        {
            let mut d = d;
            let _ = d.child.kill();
            let _ = d.child.wait();
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
        // The namespaces go once nothing runs in them (their veths with them).
        for (ns, _) in self.nodes.iter().filter_map(|n| n.net.as_ref()) {
            let _ = Command::new("ip").args(["netns", "del", ns]).status();
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

pub fn ext4() -> csi::VolumeCapability {
    fs_cap("ext4", Mode::SingleNodeWriter)
}

pub fn block(mode: Mode) -> csi::VolumeCapability {
    csi::VolumeCapability {
        access_mode: Some(AccessMode { mode: mode as i32 }),
        access_type: Some(AccessType::Block(BlockVolume {})),
    }
}

pub fn publish(
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

/// The publish_context ControllerPublishVolume answers `req` with; the volume is unpublished
/// at that node again (with the request's secrets) before this returns.
pub async fn published_context(
    ctl: &mut moor_proto::csi::v1::controller_client::ControllerClient<Channel>,
    req: csi::ControllerPublishVolumeRequest,
) -> HashMap<String, String> {
    let unpublish = csi::ControllerUnpublishVolumeRequest {
        volume_id: req.volume_id.clone(),
        node_id: req.node_id.clone(),
        secrets: req.secrets.clone(),
    };
    let ctx = ctl
        .controller_publish_volume(req)
        .await
        .expect("ControllerPublishVolume")
        .into_inner()
        .publish_context;
    ctl.controller_unpublish_volume(unpublish)
        .await
        .expect("ControllerUnpublishVolume");
    ctx
}

pub fn ms(d: Duration) -> String {
    format!("{:.0} ms", d.as_secs_f64() * 1e3)
}
