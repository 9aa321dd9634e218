//! A pod with `hostUsers: false` (user namespaces, GA in Kubernetes 1.36) as its container
//! runtime sees moor's volume: the runtime clones the target moor published (open_tree),
//! idmaps the clone to the pod's user namespace (mount_setattr with MOUNT_ATTR_IDMAP) and
//! attaches it where the container sees it. Run on this machine's kernel
//! (`tests/node.rs`) and in the VM lab's guests (`lab/tests/vm_qos.rs`), on the kernel there.

use std::os::fd::AsRawFd as _;
use std::os::unix::fs::MetadataExt as _;
use std::path::Path;

use moor_node::sys::raw::{MOUNT_ATTR_IDMAP, MountAttr, mount_setattr_fd};
use moor_proto::csi::v1 as csi;
use moor_proto::csi::v1::node_server::Node as _;
use rustix::mount::{MoveMountFlags, OpenTreeFlags};
use tonic::Request;

use crate::client::DEADLINE;
use crate::requests::{stage_req, unpublish_req, unstage_req};
use crate::{Sandbox, fs_cap, runtime};

/// Container ids 0..65536 of the pod's user namespace are host ids BASE..BASE+65536.
const BASE: u32 = 100_000;
/// The pod's fsGroup.
const GROUP: u32 = 2000;
const MIB: u64 = 1 << 20;

/// Runs `args` as host user `uid` and group `gid` (no supplementary groups); whether it
/// succeeded.
pub fn as_user(uid: u32, gid: u32, args: &[&str]) -> bool {
    std::process::Command::new("setpriv")
        .args([
            &format!("--reuid={uid}"),
            &format!("--regid={gid}"),
            "--clear-groups",
        ])
        .args(args)
        .status()
        .expect("setpriv")
        .success()
}

/// A volume of filesystem `fs` staged and published with the fsGroup through
/// VOLUME_MOUNT_GROUP, idmapped as a runtime does: the mount is taken, the container's root
/// writes as the host's root on disk, a container user of the fsGroup writes, one outside it
/// cannot. Panics on any failure; cleans up after itself.
pub fn a_runtime_idmaps_a_published_volume(fs: &str) {
    use csi::volume_capability::{AccessType, access_mode::Mode};
    let sb = Sandbox::new(&format!("idmap-{fs}"));
    let svc = sb.node_service();
    let dev = sb.loop_device("v.img", 320 * MIB);
    let staging = sb.staging("pv1");
    let target = sb.target("p1", "pv1");
    let mut c = fs_cap(fs, Mode::SingleNodeWriter);
    if let Some(AccessType::Mount(m)) = &mut c.access_type {
        m.volume_mount_group = GROUP.to_string();
    }
    let rt = runtime();
    let mut stage = stage_req("vol", &dev, &staging, fs);
    stage.volume_capability = Some(c.clone());
    rt.block_on(svc.node_stage_volume(Request::new(stage)))
        .unwrap_or_else(|e| panic!("{fs}: stage: {e}"));
    rt.block_on(
        svc.node_publish_volume(Request::new(csi::NodePublishVolumeRequest {
            volume_id: "vol".into(),
            staging_target_path: staging.display().to_string(),
            target_path: target.display().to_string(),
            volume_capability: Some(c),
            ..Default::default()
        })),
    )
    .unwrap_or_else(|e| panic!("{fs}: publish: {e}"));
    // A process in a new user namespace (as the runtime's pod sandbox), whose ids this process
    // maps (root of the parent namespace may write both maps).
    let holder = crate::client::spawn_guarded(
        std::process::Command::new("unshare")
            .args(["--user", "sleep", "600"])
            .stdin(std::process::Stdio::null()),
    );
    let pid = holder.id();
    let deadline = std::time::Instant::now() + DEADLINE;
    let ns = |p: &str| std::fs::read_link(format!("/proc/{p}/ns/user")).ok();
    while ns(&pid.to_string()) == ns("self") || ns(&pid.to_string()).is_none() {
        assert!(
            std::time::Instant::now() < deadline,
            "{fs}: unshare did not enter a user namespace within {DEADLINE:?}"
        );
        std::thread::yield_now();
    }
    for map in ["uid_map", "gid_map"] {
        std::fs::write(format!("/proc/{pid}/{map}"), format!("0 {BASE} 65536\n"))
            .unwrap_or_else(|e| panic!("{fs}: write {map}: {e}"));
    }
    let userns = std::fs::File::open(format!("/proc/{pid}/ns/user")).expect("userns");
    let tree = rustix::mount::open_tree(
        rustix::fs::CWD,
        target.as_path(),
        OpenTreeFlags::OPEN_TREE_CLONE | OpenTreeFlags::OPEN_TREE_CLOEXEC,
    )
    .expect("open_tree of the target");
    mount_setattr_fd(
        &tree,
        &MountAttr {
            attr_set: MOUNT_ATTR_IDMAP,
            userns_fd: u64::try_from(userns.as_raw_fd()).expect("fd"),
            ..MountAttr::default()
        },
    )
    .unwrap_or_else(|e| panic!("{fs}: an idmapped mount of moor's target is refused: {e}"));
    let seen = sb.root.join("container-view");
    std::fs::create_dir_all(&seen).expect("container view dir");
    rustix::mount::move_mount(
        &tree,
        c"",
        rustix::fs::CWD,
        seen.as_path(),
        MoveMountFlags::MOVE_MOUNT_F_EMPTY_PATH,
    )
    .expect("attach the idmapped mount");
    let meta = |p: &Path| std::fs::metadata(p).expect("stat");
    // The volume's root: the fsGroup's on disk, the container's group through the mount.
    assert_eq!(meta(&target).gid(), GROUP, "{fs}");
    assert_eq!(meta(&seen).gid(), BASE + GROUP, "{fs}");
    // The container's root writes; on disk the file is root's.
    let by_root = seen.join("by-root").display().to_string();
    assert!(
        as_user(BASE, BASE, &["touch", &by_root]),
        "{fs}: container root"
    );
    assert_eq!(meta(&target.join("by-root")).uid(), 0, "{fs}");
    // A container user in the fsGroup writes (the group's, setgid: as kubelet leaves it).
    let by_user = seen.join("by-user").display().to_string();
    assert!(
        as_user(BASE + 1000, BASE + GROUP, &["touch", &by_user]),
        "{fs}: a user of the fsGroup (the volume's root on disk: mode {:o} {}:{}; through the \
         idmapped mount: mode {:o} {}:{})",
        meta(&target).mode(),
        meta(&target).uid(),
        meta(&target).gid(),
        meta(&seen).mode(),
        meta(&seen).uid(),
        meta(&seen).gid()
    );
    let on_disk = meta(&target.join("by-user"));
    assert_eq!((on_disk.uid(), on_disk.gid()), (1000, GROUP), "{fs}");
    // A container user outside the group cannot.
    let by_other = seen.join("by-other").display().to_string();
    assert!(
        !as_user(BASE + 1001, BASE + 1001, &["touch", &by_other]),
        "{fs}: a user outside the fsGroup wrote"
    );
    // The descriptor of the attached mount holds it busy until closed (and a child another
    // test forks holds a copy of it until its exec).
    drop(tree);
    crate::unmount_when_free(&seen);
    drop(holder);
    rt.block_on(svc.node_unpublish_volume(Request::new(unpublish_req("vol", &target))))
        .unwrap_or_else(|e| panic!("{fs}: unpublish: {e}"));
    rt.block_on(svc.node_unstage_volume(Request::new(unstage_req("vol", &staging))))
        .unwrap_or_else(|e| panic!("{fs}: unstage: {e}"));
}
