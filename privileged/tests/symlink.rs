//! Symlink attacks on the real `moor-node` (run as root).
//!
//! A pod that can write below the kubelet dir can plant symlinks in the paths kubelet hands to
//! moor. These tests swap components of staging and target paths for symlinks to a directory
//! outside the kubelet dir, before a call and while calls run (a thread exchanging a component
//! with a symlink in a loop), and check that nothing outside the kubelet dir is ever mounted
//! on, created or removed: the outside tree and the sandbox's mount table are compared with
//! what they were before.

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use csi::node_client::NodeClient;
use csi::volume_capability::{AccessMode, AccessType, MountVolume, access_mode::Mode};
use moor_privileged::Sandbox;
use moor_privileged::client::{Daemon, connect};
use moor_privileged::requests::{unpublish_req, unstage_req};
use moor_proto::csi::v1 as csi;
use rustix::fs::{CWD, RenameFlags};

const MIB: u64 = 1 << 20;
const PV: &str = "pv";

/// Every entry below `root` with its kind.
fn tree(root: &Path) -> BTreeSet<(PathBuf, &'static str)> {
    let mut out = BTreeSet::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            let p = e.path();
            let kind = match e.file_type() {
                Ok(t) if t.is_dir() => {
                    stack.push(p.clone());
                    "dir"
                }
                Ok(t) if t.is_symlink() => "symlink",
                _ => "file",
            };
            out.insert((p, kind));
        }
    }
    out
}

/// Mount points of the sandbox outside its kubelet dir.
fn mounts_outside_kubelet(sb: &Sandbox) -> Vec<PathBuf> {
    sb.mounts()
        .into_iter()
        .filter(|m| !m.starts_with(&sb.kubelet))
        .collect()
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

/// A started moor-node on the sandbox, a runtime, and the staged volume.
struct World {
    rt: tokio::runtime::Runtime,
    daemon: Daemon,
    staging: PathBuf,
    outside: PathBuf,
}

fn start(sb: &Sandbox) -> World {
    let dev = sb.loop_device("s.img", 64 * MIB);
    let socket = sb.root.join("csi.sock");
    let staging = sb.staging(PV);
    // A tree outside the kubelet dir shaped like kubelet's, so that a followed symlink would
    // find every directory it expects there.
    let outside = sb.root.join("outside");
    for rel in [
        "pods/evil/volumes/kubernetes.io~csi/pv/mount",
        "plugins/kubernetes.io/csi/moor.csi.io/pv-hash/globalmount",
        "pv/mount",
        "volumes/kubernetes.io~csi/pv/mount",
        "kubernetes.io~csi/pv/mount",
        "mount",
    ] {
        std::fs::create_dir_all(outside.join(rel)).expect("outside tree");
    }
    std::fs::write(outside.join("mount/precious"), b"keep").expect("outside file");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("rt");
    let daemon = rt.block_on(Daemon::start(&socket, &sb.node_args("node-s", &[])));
    rt.block_on(async {
        let mut node = NodeClient::new(connect(&socket).await.expect("connect"));
        node.node_stage_volume(csi::NodeStageVolumeRequest {
            volume_id: "vol-s".into(),
            publish_context: HashMap::from([("devicePath".into(), dev.display().to_string())]),
            staging_target_path: staging.display().to_string(),
            volume_capability: Some(cap()),
            secrets: HashMap::new(),
            volume_context: HashMap::new(),
        })
        .await
        .expect("stage");
    });
    World {
        rt,
        daemon,
        staging,
        outside,
    }
}

impl World {
    fn node(&self) -> NodeClient<tonic::transport::Channel> {
        self.rt.block_on(async {
            NodeClient::new(connect(&self.daemon.socket).await.expect("connect"))
        })
    }

    fn publish(&self, target: &Path) -> Result<(), tonic::Status> {
        let mut node = self.node();
        self.rt
            .block_on(node.node_publish_volume(csi::NodePublishVolumeRequest {
                volume_id: "vol-s".into(),
                publish_context: HashMap::new(),
                staging_target_path: self.staging.display().to_string(),
                target_path: target.display().to_string(),
                volume_capability: Some(cap()),
                readonly: false,
                secrets: HashMap::new(),
                volume_context: HashMap::new(),
            }))
            .map(|_| ())
    }

    fn unpublish(&self, target: &Path) -> Result<(), tonic::Status> {
        let mut node = self.node();
        self.rt
            .block_on(node.node_unpublish_volume(unpublish_req("vol-s", target)))
            .map(|_| ())
    }

    fn unstage_at(&self, staging: &Path) -> Result<(), tonic::Status> {
        let mut node = self.node();
        self.rt
            .block_on(node.node_unstage_volume(unstage_req("vol-other", staging)))
            .map(|_| ())
    }

    fn finish(mut self) {
        let mut node = self.node();
        self.rt
            .block_on(node.node_unstage_volume(unstage_req("vol-s", &self.staging)))
            .expect("unstage");
        drop(node);
        drop(self.rt);
        assert!(self.daemon.terminate().success());
    }
}

#[test]
fn symlinked_components_never_lead_moor_outside_the_kubelet_dir() {
    let sb = Sandbox::new("symlink-before");
    let w = start(&sb);
    let before = tree(&w.outside);
    let target_rel = ["pods", "evil", "volumes", "kubernetes.io~csi", PV, "mount"];
    // Swap each component of the target path in turn for a symlink to the outside tree's
    // matching directory (absolute and relative links alike), then publish and unpublish.
    for depth in 1..=target_rel.len() {
        for relative in [false, true] {
            let pods = sb.k("pods");
            let _ = std::fs::remove_dir_all(&pods);
            let link = sb.kubelet.join(target_rel[..depth].join("/"));
            std::fs::create_dir_all(link.parent().expect("parent")).expect("parents");
            let dest = w.outside.join(target_rel[..depth].join("/"));
            let dest = if relative {
                // Enough `..` to climb out of the kubelet dir from the link's parent.
                let up = "../".repeat(depth - 1);
                PathBuf::from(format!("{up}../outside/{}", target_rel[..depth].join("/")))
            } else {
                dest
            };
            std::os::unix::fs::symlink(&dest, &link).expect("plant symlink");
            let target = sb.kubelet.join(target_rel.join("/"));
            let published = w.publish(&target);
            assert!(
                published.is_err(),
                "publish through a symlink at depth {depth} succeeded"
            );
            let _ = w.unpublish(&target);
            assert_eq!(
                tree(&w.outside),
                before,
                "depth {depth}: the outside dir changed"
            );
            assert!(mounts_outside_kubelet(&sb).is_empty());
            // A symlinked parent is left alone; a symlink at the target itself is an entry
            // of the kubelet dir that unpublish may remove (never what it points to).
            assert!(
                depth == target_rel.len()
                    || std::fs::symlink_metadata(&link)
                        .map(|m| m.file_type().is_symlink())
                        .unwrap_or(false),
                "the planted symlink was replaced or removed"
            );
        }
    }
    // The staging path likewise: a symlinked plugin dir leads nowhere outside.
    let plugin = sb.k("plugins/kubernetes.io/csi/moor.csi.io/evil-hash");
    std::os::unix::fs::symlink(
        w.outside
            .join("plugins/kubernetes.io/csi/moor.csi.io/pv-hash"),
        &plugin,
    )
    .expect("plant");
    let _ = w.unstage_at(&plugin.join("globalmount"));
    let _ = std::fs::remove_dir_all(sb.k("pods"));
    std::fs::create_dir_all(sb.k("pods/ok/volumes/kubernetes.io~csi/pv")).expect("dirs");
    // A publish whose staging path runs through the symlink is refused.
    let mut node = w.node();
    let r = w.rt.block_on(
        node.node_publish_volume(csi::NodePublishVolumeRequest {
            volume_id: "vol-s".into(),
            publish_context: HashMap::new(),
            staging_target_path: plugin.join("globalmount").display().to_string(),
            target_path: sb
                .k("pods/ok/volumes/kubernetes.io~csi/pv/mount")
                .display()
                .to_string(),
            volume_capability: Some(cap()),
            readonly: false,
            secrets: HashMap::new(),
            volume_context: HashMap::new(),
        }),
    );
    assert!(
        r.is_err(),
        "publish from a symlinked staging path succeeded"
    );
    drop(node);
    assert_eq!(tree(&w.outside), before);
    assert!(mounts_outside_kubelet(&sb).is_empty());
    w.finish();
    assert!(sb.mounts().is_empty(), "{:?}", sb.mounts());
}

#[test]
fn a_component_flipping_between_dir_and_symlink_never_leads_moor_outside() {
    let sb = Sandbox::new("symlink-race");
    let w = start(&sb);
    let before = tree(&w.outside);
    // pods/race is exchanged, atomically and over and over, with a symlink to the outside
    // tree's pods/evil, which has the same shape.
    let real = sb.k("pods/race");
    std::fs::create_dir_all(real.join("volumes/kubernetes.io~csi/pv")).expect("real dirs");
    let spare = sb.k("pods/race-link");
    std::os::unix::fs::symlink(w.outside.join("pods/evil"), &spare).expect("link");
    let stop = Arc::new(AtomicBool::new(false));
    let flipper = {
        let (stop, real, spare) = (Arc::clone(&stop), real.clone(), spare.clone());
        std::thread::spawn(move || {
            let mut flips = 0u64;
            while !stop.load(Ordering::Relaxed) {
                rustix::fs::renameat_with(CWD, &real, CWD, &spare, RenameFlags::EXCHANGE)
                    .expect("exchange");
                flips += 1;
            }
            // Leave the real directory in place.
            if std::fs::symlink_metadata(&real)
                .map(|m| m.file_type().is_symlink())
                .unwrap_or(false)
            {
                rustix::fs::renameat_with(CWD, &real, CWD, &spare, RenameFlags::EXCHANGE)
                    .expect("exchange back");
            }
            flips
        })
    };
    let target = real.join("volumes/kubernetes.io~csi/pv/mount");
    let (mut ok, mut refused) = (0, 0);
    for _ in 0..300 {
        match w.publish(&target) {
            Ok(()) => ok += 1,
            Err(_) => refused += 1,
        }
        let _ = w.unpublish(&target);
        assert!(
            mounts_outside_kubelet(&sb).is_empty(),
            "a mount appeared outside the kubelet dir: {:?}",
            mounts_outside_kubelet(&sb)
        );
    }
    stop.store(true, Ordering::Relaxed);
    let flips = flipper.join().expect("flipper");
    assert!(flips > 0);
    assert!(ok + refused == 300);
    // Clean up what succeeded: the final unpublish with the real dir in place.
    w.unpublish(&target).expect("final unpublish");
    assert_eq!(tree(&w.outside), before, "the outside dir changed");
    assert!(mounts_outside_kubelet(&sb).is_empty());
    assert!(!target.exists(), "target left behind");
    w.finish();
    assert!(sb.mounts().is_empty(), "{:?}", sb.mounts());
}
