//! Volumes on every node (run as root, after `cargo build --bins`): two nodes on this host,
//! each with its node-local moor-controller (`--node-local`, its data dir on a filesystem of
//! its own) and its moor-node (`--local-controller`), called as csi-provisioner
//! `--node-deployment` and the kubelet call them: no ControllerPublishVolume, no
//! ControllerExpandVolume from a CO.
//!
//! What it shows: volumes are made on the node asked for and nowhere else, GetCapacity goes
//! down as volumes take space (a thick one all of its size, its blocks allocated), a node that
//! is full refuses with RESOURCE_EXHAUSTED and keeps nothing of the refused volume, a volume
//! grows through NodeExpandVolume alone, a group snapshot of a volume in use is cut on its
//! node, a restore lands on the snapshot's node and is refused on the other, and a controller
//! restarted in a new mount namespace (a replaced container) leaves the node able to stage its
//! volumes again.

use std::collections::HashMap;
use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use csi::controller_client::ControllerClient;
use csi::group_controller_client::GroupControllerClient;
use csi::node_client::NodeClient;
use csi::volume_capability::access_mode::Mode;
use moor_privileged::client::{Daemon, binary, connect, spawn_guarded};
use moor_privileged::requests::{unpublish_req, unstage_req};
use moor_privileged::{Sandbox, fs_cap, is_mount_point};
use moor_proto::csi::v1 as csi;
use tonic::transport::Channel;
use tonic::{Code, Status};

const MIB: i64 = 1 << 20;
const DRIVER: &str = "local.moor.csi.io";
const KEY: &str = "topology.local.moor.csi.io/node";
const PATTERN: &[u8] = b"moor on every node: the bytes a pod wrote on its node";

/// One node: its controller and its node plugin, with their dirs.
struct Node {
    id: &'static str,
    ctl: ControllerClient<Channel>,
    groups: GroupControllerClient<Channel>,
    node: NodeClient<Channel>,
    /// The node plugin's view of the controller socket's Node service (NodeGetInfo).
    ctl_node: NodeClient<Channel>,
    data: PathBuf,
    kubelet: PathBuf,
    daemons: Vec<Daemon>,
}

fn segment(id: &str) -> csi::Topology {
    csi::Topology {
        segments: HashMap::from([(KEY.to_string(), id.to_string())]),
    }
}

fn xfs() -> csi::VolumeCapability {
    fs_cap("xfs", Mode::SingleNodeWriter)
}

/// The dirs of node `id` in the sandbox, its data dir on an ext4 of its own of `fs_bytes`.
fn node_dirs(sb: &Sandbox, id: &str, fs_bytes: u64) -> (PathBuf, PathBuf, PathBuf) {
    let base = sb.root.join(id);
    let (data, kubelet, state) = (base.join("data"), base.join("kubelet"), base.join("state"));
    for d in [&data, &kubelet, &state] {
        std::fs::create_dir_all(d).expect("node dir");
    }
    let dev = sb.loop_device(&format!("{id}-data.img"), fs_bytes);
    moor_privileged::run("mkfs.ext4", &["-q", "-F", dev.to_str().expect("utf-8")]);
    rustix::mount::mount(
        dev.as_path(),
        data.as_path(),
        "ext4",
        rustix::mount::MountFlags::empty(),
        None,
    )
    .expect("mount the node's data filesystem");
    (data, kubelet, state)
}

fn controller_args(id: &str, data: &Path) -> Vec<String> {
    [
        "--node-id",
        id,
        "--node-local",
        "--driver-name",
        DRIVER,
        "--thin-overcommit",
        "1",
        "--data-dir",
        data.to_str().expect("utf-8"),
    ]
    .map(String::from)
    .to_vec()
}

impl Node {
    async fn start(sb: &Sandbox, id: &'static str, fs_bytes: u64) -> Self {
        let (data, kubelet, state) = node_dirs(sb, id, fs_bytes);
        let ctl_sock = sb.root.join(format!("{id}-controller.sock"));
        let node_sock = sb.root.join(format!("{id}-node.sock"));
        let controller =
            Daemon::start_program("moor-controller", &ctl_sock, &controller_args(id, &data)).await;
        let node = Self::start_node(id, &node_sock, &ctl_sock, &kubelet, &state).await;
        Self::connect(id, [controller, node], data, kubelet).await
    }

    async fn start_node(
        id: &str,
        node_sock: &Path,
        ctl_sock: &Path,
        kubelet: &Path,
        state: &Path,
    ) -> Daemon {
        Daemon::start(
            node_sock,
            &[
                "--node-id",
                id,
                "--driver-name",
                DRIVER,
                "--state-dir",
                state.to_str().expect("utf-8"),
                "--kubelet-dir",
                kubelet.to_str().expect("utf-8"),
                "--local-controller",
                &format!("unix://{}", ctl_sock.display()),
            ],
        )
        .await
    }

    async fn connect(
        id: &'static str,
        daemons: [Daemon; 2],
        data: PathBuf,
        kubelet: PathBuf,
    ) -> Self {
        let ctl = connect(&daemons[0].socket)
            .await
            .expect("controller socket");
        let node = connect(&daemons[1].socket).await.expect("node socket");
        Self {
            id,
            ctl: ControllerClient::new(ctl.clone()),
            groups: GroupControllerClient::new(ctl.clone()),
            ctl_node: NodeClient::new(ctl),
            node: NodeClient::new(node),
            data,
            kubelet,
            daemons: daemons.into(),
        }
    }

    /// GetCapacity for this node's segment: (available, maximum volume size).
    async fn capacity(&mut self, thick: bool) -> (i64, i64) {
        let mut parameters = HashMap::new();
        if thick {
            parameters.insert("provisioning".to_string(), "thick".to_string());
        }
        let c = self
            .ctl
            .get_capacity(csi::GetCapacityRequest {
                volume_capabilities: vec![xfs()],
                parameters,
                accessible_topology: Some(segment(self.id)),
            })
            .await
            .expect("GetCapacity")
            .into_inner();
        (
            c.available_capacity,
            c.maximum_volume_size.expect("a maximum volume size"),
        )
    }

    /// CreateVolume as the provisioner of node `on` sends it (requisite: that node).
    async fn create(
        &mut self,
        name: &str,
        bytes: i64,
        thick: bool,
        on: &str,
        source: Option<csi::VolumeContentSource>,
    ) -> Result<csi::Volume, Status> {
        let mut parameters = HashMap::new();
        if thick {
            parameters.insert("provisioning".to_string(), "thick".to_string());
        }
        self.ctl
            .create_volume(csi::CreateVolumeRequest {
                name: name.into(),
                capacity_range: Some(csi::CapacityRange {
                    required_bytes: bytes,
                    limit_bytes: 0,
                }),
                volume_capabilities: vec![xfs()],
                parameters,
                accessibility_requirements: Some(csi::TopologyRequirement {
                    requisite: vec![segment(on)],
                    preferred: vec![segment(on)],
                }),
                volume_content_source: source,
                ..Default::default()
            })
            .await
            .map(|r| r.into_inner().volume.expect("a volume"))
    }

    async fn delete(&mut self, id: &str) {
        self.ctl
            .delete_volume(csi::DeleteVolumeRequest {
                volume_id: id.into(),
                ..Default::default()
            })
            .await
            .expect("DeleteVolume");
    }

    fn staging(&self, pv: &str) -> PathBuf {
        let p = self.kubelet.join(format!(
            "plugins/kubernetes.io/csi/{DRIVER}/{pv}-hash/globalmount"
        ));
        std::fs::create_dir_all(p.parent().expect("parent")).expect("staging parent");
        p
    }

    fn target(&self, pv: &str) -> PathBuf {
        let p = self
            .kubelet
            .join(format!("pods/pod-1/volumes/kubernetes.io~csi/{pv}/mount"));
        std::fs::create_dir_all(p.parent().expect("parent")).expect("target parent");
        p
    }

    /// NodeStageVolume as the kubelet sends it for a volume nobody attached.
    async fn stage(&mut self, vol: &str, pv: &str) -> Result<PathBuf, Status> {
        let staging = self.staging(pv);
        self.node
            .node_stage_volume(csi::NodeStageVolumeRequest {
                volume_id: vol.into(),
                publish_context: HashMap::new(),
                staging_target_path: staging.display().to_string(),
                volume_capability: Some(xfs()),
                ..Default::default()
            })
            .await
            .map(|_| staging)
    }

    async fn stage_and_publish(&mut self, vol: &str, pv: &str) -> (PathBuf, PathBuf) {
        let staging = self.stage(vol, pv).await.expect("NodeStageVolume");
        let target = self.target(pv);
        self.node
            .node_publish_volume(csi::NodePublishVolumeRequest {
                volume_id: vol.into(),
                staging_target_path: staging.display().to_string(),
                target_path: target.display().to_string(),
                volume_capability: Some(xfs()),
                ..Default::default()
            })
            .await
            .expect("NodePublishVolume");
        assert!(is_mount_point(&target));
        (staging, target)
    }

    async fn unpublish_and_unstage(&mut self, vol: &str, staging: &Path, target: &Path) {
        self.node
            .node_unpublish_volume(unpublish_req(vol, target))
            .await
            .expect("NodeUnpublishVolume");
        self.node
            .node_unstage_volume(unstage_req(vol, staging))
            .await
            .expect("NodeUnstageVolume");
    }

    /// The names in the data dir's volumes and tmp dirs.
    fn data_files(&self) -> Vec<String> {
        ["volumes", "tmp"]
            .iter()
            .flat_map(|d| std::fs::read_dir(self.data.join(d)).into_iter().flatten())
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect()
    }

    /// Loop devices bound to volume files of this node's data dir.
    fn devices(&self) -> Vec<PathBuf> {
        volume_devices(&self.data)
    }
}

/// Loop devices bound to volume files of the data dir `data`, by the files' identity (the
/// kernel may name a file through a mount this test cannot see).
fn volume_devices(data: &Path) -> Vec<PathBuf> {
    use moor_node::sys::loopinfo::{backing_inode, file_inode};
    let files: Vec<_> = std::fs::read_dir(data.join("volumes"))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| file_inode(&e.path()).ok())
        .collect();
    let mut out: Vec<PathBuf> = std::fs::read_dir("/sys/block")
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.path().join("loop/backing_file").exists())
        .map(|e| Path::new("/dev").join(e.file_name()))
        .filter(|d| backing_inode(d).is_ok_and(|b| files.contains(&b)))
        .collect();
    out.sort();
    out
}

/// On drop, also when a test fails: the loop devices of the volumes of these data dirs are
/// released (the kernel finishes when their mounts go with the sandbox), so that nothing of
/// a test outlives it.
struct Release(Vec<PathBuf>);

impl Drop for Release {
    fn drop(&mut self) {
        for data in &self.0 {
            for dev in volume_devices(data) {
                let _ = Command::new("losetup").arg("-d").arg(&dev).status();
            }
        }
    }
}

/// The bytes a volume's file holds.
fn held(node: &Node, id: &str) -> i64 {
    let bare = id.split('@').next().expect("an id");
    let m = std::fs::metadata(node.data.join(format!("volumes/{bare}.img"))).expect("stat");
    i64::try_from(m.blocks() * 512).expect("size")
}

fn snapshot_source(id: &str) -> csi::VolumeContentSource {
    csi::VolumeContentSource {
        r#type: Some(csi::volume_content_source::Type::Snapshot(
            csi::volume_content_source::SnapshotSource {
                snapshot_id: id.into(),
            },
        )),
    }
}

fn statvfs_bytes(path: &Path) -> u64 {
    let st = rustix::fs::statvfs(path).expect("statvfs");
    st.f_blocks * st.f_frsize
}

#[track_caller]
fn refused<T: std::fmt::Debug>(r: Result<T, Status>, code: Code) -> Status {
    match r {
        Ok(v) => panic!("expected {code:?}, got {v:?}"),
        Err(s) => {
            assert_eq!(s.code(), code, "{}", s.message());
            s
        }
    }
}

#[test]
fn every_node_holds_its_own_volumes_placed_by_capacity() {
    let sb = Sandbox::new("local-nodes");
    let _release = Release(vec![sb.root.join("n1/data"), sb.root.join("n2/data")]);
    let rt = moor_privileged::runtime();
    let nodes = rt.block_on(async {
        let mut one = Node::start(&sb, "n1", 2 << 30).await;
        let mut two = Node::start(&sb, "n2", 1 << 30).await;

        // The provisioner of a node reads the node from the controller's socket, the kubelet
        // from the node's: the same node, the same segment.
        for n in [&mut one, &mut two] {
            let from_node = n
                .node
                .node_get_info(csi::NodeGetInfoRequest {})
                .await
                .expect("NodeGetInfo")
                .into_inner();
            let from_ctl = n
                .ctl_node
                .node_get_info(csi::NodeGetInfoRequest {})
                .await
                .expect("NodeGetInfo from the controller")
                .into_inner();
            assert_eq!(from_node.node_id, from_ctl.node_id);
            assert_eq!(from_node.accessible_topology, from_ctl.accessible_topology);
            assert_eq!(from_node.accessible_topology, Some(segment(n.id)));
        }

        // Placed where asked, and only there.
        let (thin0, _) = one.capacity(false).await;
        let (thick0, _) = one.capacity(true).await;
        let v = one
            .create("pvc-a", 512 * MIB, false, "n1", None)
            .await
            .expect("a thin volume on n1");
        assert!(v.volume_id.ends_with("@n1"), "{}", v.volume_id);
        assert_eq!(v.accessible_topology, vec![segment("n1")]);
        let e = refused(
            one.create("pvc-x", MIB, false, "n2", None).await,
            Code::ResourceExhausted,
        );
        assert!(e.message().contains("accessibility_requirements"), "{e:?}");
        let other = one
            .ctl
            .get_capacity(csi::GetCapacityRequest {
                accessible_topology: Some(segment("n2")),
                ..Default::default()
            })
            .await
            .expect("GetCapacity")
            .into_inner();
        assert_eq!(other.available_capacity, 0, "n1 offers nothing on n2");

        // A thin volume takes its size from what thin volumes are offered (ratio 1), and
        // from what a thick one may take: both go down by it.
        let (thin1, _) = one.capacity(false).await;
        let (thick1, _) = one.capacity(true).await;
        eprintln!("n1 thin {thin0} -> {thin1}, thick {thick0} -> {thick1}");
        assert!(
            (thin0 - thin1 - 512 * MIB).abs() < 16 * MIB,
            "{thin0} -> {thin1}"
        );
        assert!(
            (thick0 - thick1 - 512 * MIB).abs() < 16 * MIB,
            "{thick0} -> {thick1}"
        );
        assert!(
            held(&one, &v.volume_id) < MIB,
            "a thin volume holds nothing yet"
        );
        // A thick one holds all of its space from the start.
        let t = one
            .create("pvc-thick", 64 * MIB, true, "n1", None)
            .await
            .expect("a thick volume on n1");
        assert!(
            held(&one, &t.volume_id) >= 64 * MIB,
            "{}",
            held(&one, &t.volume_id)
        );
        let (thick2, _) = one.capacity(true).await;
        assert!(thick1 - thick2 >= 64 * MIB, "{thick1} -> {thick2}");

        // Staged by the kubelet: the controller on the node attaches it (nobody else does).
        let (staging, target) = one.stage_and_publish(&v.volume_id, "pv-a").await;
        assert_eq!(one.devices().len(), 1, "{:?}", one.devices());
        std::fs::write(target.join("data"), PATTERN).expect("write");
        rustix::fs::sync();

        // Cut on its node, with the volume in use.
        let g = one
            .groups
            .create_volume_group_snapshot(csi::CreateVolumeGroupSnapshotRequest {
                name: "group-a".into(),
                source_volume_ids: vec![v.volume_id.clone(), t.volume_id.clone()],
                ..Default::default()
            })
            .await
            .expect("a group snapshot of a volume in use")
            .into_inner()
            .group_snapshot
            .expect("a group");
        assert!(g.group_snapshot_id.ends_with("@n1"));
        let e = refused(
            two.groups
                .create_volume_group_snapshot(csi::CreateVolumeGroupSnapshotRequest {
                    name: "group-b".into(),
                    source_volume_ids: vec![v.volume_id.clone()],
                    ..Default::default()
                })
                .await,
            Code::FailedPrecondition,
        );
        assert!(e.message().contains("n1"), "{e:?}");

        // A restore lands on the snapshot's node; on the other it is refused.
        let s = one
            .ctl
            .create_snapshot(csi::CreateSnapshotRequest {
                source_volume_id: v.volume_id.clone(),
                name: "snap-a".into(),
                ..Default::default()
            })
            .await
            .expect("CreateSnapshot")
            .into_inner()
            .snapshot
            .expect("a snapshot");
        let e = refused(
            two.create(
                "pvc-r",
                512 * MIB,
                false,
                "n2",
                Some(snapshot_source(&s.snapshot_id)),
            )
            .await,
            Code::ResourceExhausted,
        );
        assert!(e.message().contains("lives on node \"n1\""), "{e:?}");
        assert!(two.data_files().is_empty(), "{:?}", two.data_files());
        let r = one
            .create(
                "pvc-r",
                512 * MIB,
                false,
                "n1",
                Some(snapshot_source(&s.snapshot_id)),
            )
            .await
            .expect("a restore on n1");
        let (rstaging, rtarget) = one.stage_and_publish(&r.volume_id, "pv-r").await;
        assert_eq!(
            std::fs::read(rtarget.join("data")).expect("read restored"),
            PATTERN
        );
        one.unpublish_and_unstage(&r.volume_id, &rstaging, &rtarget)
            .await;

        // Grown by NodeExpandVolume alone (csi-resizer's trivial resizer calls no controller).
        let before = statvfs_bytes(&target);
        one.node
            .node_expand_volume(csi::NodeExpandVolumeRequest {
                volume_id: v.volume_id.clone(),
                volume_path: target.display().to_string(),
                capacity_range: Some(csi::CapacityRange {
                    required_bytes: 768 * MIB,
                    limit_bytes: 0,
                }),
                staging_target_path: staging.display().to_string(),
                volume_capability: Some(xfs()),
                ..Default::default()
            })
            .await
            .expect("NodeExpandVolume");
        let after = statvfs_bytes(&target);
        assert!(after > before + 200 * 1024 * 1024, "{before} -> {after}");
        let status = one
            .ctl
            .controller_get_volume(csi::ControllerGetVolumeRequest {
                volume_id: v.volume_id.clone(),
            })
            .await
            .expect("ControllerGetVolume")
            .into_inner();
        assert_eq!(
            status.volume.expect("volume").capacity_bytes,
            768 * MIB,
            "the controller knows the new size"
        );
        assert_eq!(
            std::fs::read(target.join("data")).expect("read after growth"),
            PATTERN
        );
        one.unpublish_and_unstage(&v.volume_id, &staging, &target)
            .await;
        assert!(one.devices().is_empty(), "{:?}", one.devices());

        // A full node: what does not fit is refused, and nothing of it is left.
        let (_, thin_max) = two.capacity(false).await;
        let (_, thick_max) = two.capacity(true).await;
        eprintln!("n2 offers thin {thin_max}, thick {thick_max}");
        for (name, bytes, thick) in [
            ("pvc-big-thin", thin_max + 64 * MIB, false),
            ("pvc-big-thick", thick_max + MIB, true),
        ] {
            let e = refused(
                two.create(name, bytes, thick, "n2", None).await,
                Code::ResourceExhausted,
            );
            eprintln!("{name}: {}", e.message());
            assert!(two.data_files().is_empty(), "{:?}", two.data_files());
        }
        let all = two
            .create("pvc-all", thick_max, true, "n2", None)
            .await
            .expect("as much as offered");
        let (thin_left, thin_left_max) = two.capacity(false).await;
        assert!(
            thin_left < MIB && thin_left_max == 0,
            "{thin_left} {thin_left_max}"
        );
        refused(
            two.create("pvc-one-more", MIB, false, "n2", None).await,
            Code::ResourceExhausted,
        );
        assert_eq!(two.data_files().len(), 1, "{:?}", two.data_files());
        two.delete(&all.volume_id).await;
        let (_, back) = two.capacity(true).await;
        assert!(back >= thick_max - 4 * MIB, "{back} vs {thick_max}");

        // Everything goes.
        one.groups
            .delete_volume_group_snapshot(csi::DeleteVolumeGroupSnapshotRequest {
                group_snapshot_id: g.group_snapshot_id.clone(),
                ..Default::default()
            })
            .await
            .expect("DeleteVolumeGroupSnapshot");
        one.ctl
            .delete_snapshot(csi::DeleteSnapshotRequest {
                snapshot_id: s.snapshot_id.clone(),
                ..Default::default()
            })
            .await
            .expect("DeleteSnapshot");
        for id in [&r.volume_id, &t.volume_id, &v.volume_id] {
            one.delete(id).await;
        }
        assert!(one.data_files().is_empty(), "{:?}", one.data_files());
        [one, two]
    });
    stop(rt, nodes);
}

/// Stops the nodes' daemons, their connections closed first (a daemon waits for its
/// connections to end, up to its shutdown grace): the runtime that runs them goes before.
fn stop<const N: usize>(rt: tokio::runtime::Runtime, nodes: [Node; N]) {
    let daemons: Vec<Daemon> = nodes.into_iter().flat_map(|n| n.daemons).collect();
    drop(rt);
    for mut d in daemons {
        assert!(d.terminate().success());
    }
}

/// The controller of a node runs in a mount namespace of its own (a container) with its data
/// dir bind-mounted there, and the host's mounts reaching it as the kubelet dir's do with
/// HostToContainer propagation (slave: a mount or unmount of the host's shows inside, none of
/// the container's outside); `unshare` starts it so.
async fn controller_in_a_container(real: &Path, view: &Path, socket: &Path) -> Daemon {
    let _ = std::fs::remove_file(socket);
    let args = controller_args("n1", view);
    let script = format!(
        "mount --bind {} {} && exec \"$0\" \"$@\"",
        real.display(),
        view.display()
    );
    let child = spawn_guarded(
        Command::new("unshare")
            .args(["--mount", "--propagation", "slave", "sh", "-c", &script])
            .arg(binary("moor-controller"))
            .arg("--endpoint")
            .arg(format!("unix://{}", socket.display()))
            .args(&args)
            .stdin(Stdio::null()),
    );
    let mut d = Daemon {
        child,
        socket: socket.to_path_buf(),
    };
    d.wait_answering().await;
    d
}

/// A node's controller replaced (its container's mount namespace gone with it): the node
/// stages its volume again, on the device it had, although the kernel now names the device's
/// file through the mount that is gone (`/volumes/<id>.img`).
#[test]
fn the_node_stages_again_after_its_controllers_container_is_replaced() {
    let sb = Sandbox::new("local-replaced");
    let _release = Release(vec![sb.root.join("n1/data")]);
    let rt = moor_privileged::runtime();
    let node = rt.block_on(async {
        let (real, kubelet, state) = node_dirs(&sb, "n1", 1 << 30);
        // The kubelet dir is a shared mount, as on a host: what the node mounts and unmounts
        // there reaches the controller's container. (Were it private, the container would
        // keep every volume staged after it started mounted for ever.)
        rustix::mount::mount_bind(&kubelet, &kubelet).expect("bind the kubelet dir");
        rustix::mount::mount_change(&kubelet, rustix::mount::MountPropagationFlags::SHARED)
            .expect("make it shared");
        let view = sb.root.join("n1/view");
        std::fs::create_dir_all(&view).expect("view");
        let ctl_sock = sb.root.join("n1-controller.sock");
        let node_sock = sb.root.join("n1-node.sock");
        let controller = controller_in_a_container(&real, &view, &ctl_sock).await;
        let node = Node::start_node("n1", &node_sock, &ctl_sock, &kubelet, &state).await;
        let mut n = Node::connect("n1", [controller, node], real.clone(), kubelet).await;
        let v = n
            .create("pvc-a", 512 * MIB, false, "n1", None)
            .await
            .expect("a volume");
        let (staging, target) = n.stage_and_publish(&v.volume_id, "pv-a").await;
        std::fs::write(target.join("data"), PATTERN).expect("write");
        let devices = n.devices();
        assert_eq!(devices.len(), 1, "{devices:?}");

        // The container goes, and another takes its place.
        assert!(n.daemons[0].stop().await.success());
        n.daemons[0] = controller_in_a_container(&real, &view, &ctl_sock).await;
        let dev = &devices[0];
        let named = std::fs::read_to_string(format!(
            "/sys/block/{}/loop/backing_file",
            dev.file_name().and_then(|f| f.to_str()).expect("name")
        ))
        .expect("sysfs");
        assert!(named.starts_with("/volumes/vol-"), "{named}");
        n.ctl = ControllerClient::new(connect(&ctl_sock).await.expect("controller socket"));

        // The kubelet stages it again (as it does after a restart of its own): the same
        // device, still the volume's.
        n.stage(&v.volume_id, "pv-a")
            .await
            .expect("NodeStageVolume again after the controller was replaced");
        assert_eq!(n.devices(), devices);
        let status = n
            .ctl
            .controller_get_volume(csi::ControllerGetVolumeRequest {
                volume_id: v.volume_id.clone(),
            })
            .await
            .expect("ControllerGetVolume")
            .into_inner()
            .status
            .expect("status");
        assert_eq!(status.published_node_ids, vec!["n1".to_string()]);
        assert_eq!(std::fs::read(target.join("data")).expect("read"), PATTERN);
        n.unpublish_and_unstage(&v.volume_id, &staging, &target)
            .await;
        assert!(n.devices().is_empty(), "{:?}", n.devices());
        n.delete(&v.volume_id).await;
        n
    });
    stop(rt, [node]);
}
