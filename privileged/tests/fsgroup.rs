//! volume_mount_group (the pod's fsGroup) on real ext4 volumes (run as root).
//!
//! A volume that already holds files (an earlier pod's data, a restored snapshot), all owned by
//! root with modes 0644/0755, is staged and published with a group: afterwards every entry has
//! the group and the mode kubelet would have given it, symlinks and what they point to are left
//! alone, and a mount inside the volume is not entered. A root that already has the group is
//! taken as a finished walk.

use std::collections::{BTreeMap, HashMap};
use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use csi::volume_capability::{AccessMode, AccessType, MountVolume, access_mode::Mode};
use moor_node::engine::{Engine, EngineConfig};
use moor_node::journal::Journal;
use moor_node::service::{NodeService, PluginInfo};
use moor_node::sys::linux::Linux;
use moor_node::sys::ownership::MAX_DEPTH;
use moor_node::sys::{Os as _, OwnershipError};
use moor_privileged::Sandbox;
use moor_proto::csi::v1 as csi;
use moor_proto::csi::v1::node_server::Node as _;
use rustix::mount::{MountFlags, UnmountFlags};

const MIB: u64 = 1 << 20;
const GROUP: u32 = 2345;

struct TestNode {
    svc: NodeService<Linux>,
    os: Arc<Linux>,
}

fn node(sb: &Sandbox) -> TestNode {
    let os = Arc::new(Linux::new(&sb.kubelet).expect("os"));
    let (journal, _) = Journal::open(&sb.state, false).expect("journal");
    let cfg = EngineConfig {
        kubelet_dir: sb.kubelet.clone(),
        ..EngineConfig::default()
    };
    let engine = Arc::new(Engine::new(Arc::clone(&os), Arc::new(journal), cfg));
    let info = PluginInfo {
        driver_name: "moor.csi.io".into(),
        node_id: "n1".into(),
        max_volumes: 0,
        topology_key: "topology.moor.csi.io/node".into(),
        state_dir: sb.state.clone(),
    };
    TestNode {
        svc: NodeService::new(engine, info),
        os,
    }
}

fn cap(group: Option<u32>) -> csi::VolumeCapability {
    csi::VolumeCapability {
        access_mode: Some(AccessMode {
            mode: Mode::SingleNodeWriter as i32,
        }),
        access_type: Some(AccessType::Mount(MountVolume {
            fs_type: "ext4".into(),
            mount_flags: vec![],
            volume_mount_group: group.map(|g| g.to_string()).unwrap_or_default(),
        })),
    }
}

impl TestNode {
    fn stage(&self, dev: &Path, staging: &Path, group: Option<u32>) {
        let req = csi::NodeStageVolumeRequest {
            volume_id: "vol".into(),
            publish_context: HashMap::from([("devicePath".into(), dev.display().to_string())]),
            staging_target_path: staging.display().to_string(),
            volume_capability: Some(cap(group)),
            secrets: HashMap::new(),
            volume_context: HashMap::new(),
        };
        moor_privileged::runtime()
            .block_on(self.svc.node_stage_volume(tonic::Request::new(req)))
            .expect("stage");
    }

    fn unstage(&self, staging: &Path) {
        let req = moor_privileged::requests::unstage_req("vol", staging);
        moor_privileged::runtime()
            .block_on(self.svc.node_unstage_volume(tonic::Request::new(req)))
            .expect("unstage");
    }

    fn publish(&self, staging: &Path, target: &Path, group: Option<u32>) {
        let mut req = moor_privileged::requests::publish_req("vol", staging, target);
        req.volume_capability = Some(cap(group));
        moor_privileged::runtime()
            .block_on(self.svc.node_publish_volume(tonic::Request::new(req)))
            .expect("publish");
    }

    fn unpublish(&self, target: &Path) {
        let req = moor_privileged::requests::unpublish_req("vol", target);
        moor_privileged::runtime()
            .block_on(self.svc.node_unpublish_volume(tonic::Request::new(req)))
            .expect("unpublish");
    }
}

/// An ext4 loop device, formatted, with `fill` run on it mounted at a scratch dir.
fn volume(sb: &Sandbox, size: u64, fill: impl FnOnce(&Path)) -> PathBuf {
    let dev = sb.loop_device("v.img", size);
    moor_privileged::run("mkfs.ext4", &["-q", &dev.display().to_string()]);
    let at = sb.root.join("fill");
    std::fs::create_dir_all(&at).expect("fill dir");
    rustix::mount::mount(
        dev.as_path(),
        at.as_path(),
        "ext4",
        MountFlags::empty(),
        c"",
    )
    .expect("mount to fill");
    fill(&at);
    rustix::mount::unmount(at.as_path(), UnmountFlags::empty()).expect("unmount after fill");
    dev
}

fn chown_root(path: &Path, mode: u32) {
    std::os::unix::fs::lchown(path, Some(0), Some(0)).expect("chown");
    if !path.is_symlink() {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).expect("chmod");
    }
}

/// An earlier pod's data, every entry root's: dirs 0755 (one 0700), files 0644 (one 0600, two
/// setuid), symlinks out of the volume and within it, a FIFO.
fn earlier_pods_data(root: &Path, outside: &Path) {
    let dirs = [("a", 0o755), ("a/b", 0o700), ("a/b/c", 0o755)];
    for (d, mode) in dirs {
        std::fs::create_dir(root.join(d)).expect("mkdir");
        chown_root(&root.join(d), mode);
    }
    let files = [
        ("top.txt", 0o644),
        ("a/file.txt", 0o644),
        ("a/b/secret", 0o600),
        ("a/b/c/deep.txt", 0o644),
        ("a/tool", 0o4755),
        // Already group-writable: only the chown changes it (and clears its setuid bit).
        ("a/tool2", 0o4775),
    ];
    for (f, mode) in files {
        std::fs::write(root.join(f), f).expect("write");
        chown_root(&root.join(f), mode);
    }
    rustix::fs::mknodat(
        rustix::fs::CWD,
        root.join("a/pipe").as_path(),
        rustix::fs::FileType::Fifo,
        rustix::fs::Mode::from_raw_mode(0o644),
        0,
    )
    .expect("mkfifo");
    chown_root(&root.join("a/pipe"), 0o644);
    std::os::unix::fs::symlink(outside.join("file"), root.join("link-out")).expect("symlink");
    std::os::unix::fs::symlink(outside, root.join("a/dir-out")).expect("symlink");
    std::os::unix::fs::symlink("top.txt", root.join("link-in")).expect("symlink");
    for l in ["link-out", "a/dir-out", "link-in"] {
        chown_root(&root.join(l), 0);
    }
    chown_root(root, 0o755);
    chown_root(&root.join("lost+found"), 0o700);
}

/// A dir outside the volume with a file, both root's: what the symlinks point to.
fn outside(sb: &Sandbox) -> PathBuf {
    let dir = sb.data.join("outside");
    std::fs::create_dir_all(&dir).expect("outside");
    std::fs::write(dir.join("file"), b"host").expect("outside file");
    chown_root(&dir, 0o755);
    chown_root(&dir.join("file"), 0o644);
    dir
}

/// Every entry below `root` (and `root` itself as ""): path -> (gid, mode, kind).
fn tree(root: &Path) -> BTreeMap<String, (u32, u32, char)> {
    let mut out = BTreeMap::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(p) = stack.pop() {
        let m = std::fs::symlink_metadata(&p).expect("lstat");
        let kind = if m.is_symlink() {
            'l'
        } else if m.is_dir() {
            stack.extend(
                std::fs::read_dir(&p)
                    .expect("read_dir")
                    .map(|e| e.expect("entry").path()),
            );
            'd'
        } else {
            'f'
        };
        let rel = p.strip_prefix(root).expect("below").display().to_string();
        out.insert(rel, (m.gid(), m.mode() & 0o7777, kind));
    }
    out
}

/// What kubelet's SetVolumeOwnership makes of an entry: the group; files +0660; directories
/// +2770; a symlink's own group only.
fn kubelets(
    before: &BTreeMap<String, (u32, u32, char)>,
    gid: u32,
) -> BTreeMap<String, (u32, u32, char)> {
    before
        .iter()
        .map(|(p, &(_, mode, kind))| {
            let mode = match kind {
                'd' => mode | 0o2770,
                'f' => mode | 0o660,
                _ => mode,
            };
            (p.clone(), (gid, mode, kind))
        })
        .collect()
}

#[test]
fn a_volume_of_root_owned_data_is_given_to_the_pods_group_as_kubelet_would() {
    let sb = Sandbox::new("fsgroup");
    let outside = outside(&sb);
    let outside_before = tree(&outside);
    let mut before = BTreeMap::new();
    let dev = volume(&sb, 64 * MIB, |root| {
        earlier_pods_data(root, &outside);
        before = tree(root);
    });
    assert!(before.values().all(|&(gid, ..)| gid == 0), "{before:?}");
    let n = node(&sb);
    let staging = sb.staging("pv");
    let target = sb.target("pod", "pv");
    n.stage(&dev, &staging, Some(GROUP));
    n.publish(&staging, &target, Some(GROUP));
    let after = tree(&target);
    assert_eq!(after, kubelets(&before, GROUP));
    // Spelled out for the entries that matter most.
    assert_eq!(after[""], (GROUP, 0o2775, 'd'));
    assert_eq!(after["a/b"], (GROUP, 0o2770, 'd'));
    assert_eq!(after["a/b/secret"], (GROUP, 0o660, 'f'));
    assert_eq!(after["a/tool"], (GROUP, 0o4775, 'f'));
    assert_eq!(after["a/tool2"], (GROUP, 0o4775, 'f'));
    assert_eq!(after["link-out"], (GROUP, 0o777, 'l'));
    // Symlinks point where they did, and what they point to outside is untouched.
    assert_eq!(
        std::fs::read_link(target.join("link-out")).expect("readlink"),
        outside.join("file")
    );
    assert_eq!(tree(&outside), outside_before);
    // The pod's group can write, and what it makes stays the group's.
    std::fs::write(target.join("a/b/c/new"), b"x").expect("write");
    assert_eq!(
        std::fs::metadata(target.join("a/b/c/new"))
            .expect("stat")
            .gid(),
        GROUP
    );
    n.unpublish(&target);
    n.unstage(&staging);
}

#[test]
fn a_mount_inside_the_volume_is_not_entered() {
    let sb = Sandbox::new("fsgroup-xdev");
    let outside = outside(&sb);
    let dev = volume(&sb, 64 * MIB, |root| earlier_pods_data(root, &outside));
    let n = node(&sb);
    let staging = sb.staging("pv");
    let target = sb.target("pod", "pv");
    n.stage(&dev, &staging, Some(GROUP));
    // Something mounted inside the staged filesystem, then a publish with another group.
    let inner = staging.join("a/inner");
    std::fs::create_dir(&inner).expect("mkdir");
    rustix::mount::mount(
        "moor-test",
        inner.as_path(),
        "tmpfs",
        MountFlags::empty(),
        c"mode=0755",
    )
    .expect("tmpfs");
    std::fs::write(inner.join("theirs"), b"x").expect("write");
    chown_root(&inner.join("theirs"), 0o644);
    let inner_before = tree(&inner);
    n.publish(&staging, &target, Some(3000));
    assert_eq!(tree(&inner), inner_before);
    let after = tree(&target);
    assert_eq!(after["a/file.txt"], (3000, 0o664, 'f'));
    assert_eq!(after[""], (3000, 0o2775, 'd'));
    rustix::mount::unmount(inner.as_path(), UnmountFlags::empty()).expect("unmount tmpfs");
    n.unpublish(&target);
    n.unstage(&staging);
}

#[test]
fn a_root_that_has_the_group_is_a_finished_walk() {
    let sb = Sandbox::new("fsgroup-root");
    let outside = outside(&sb);
    let dev = volume(&sb, 64 * MIB, |root| earlier_pods_data(root, &outside));
    let n = node(&sb);
    let staging = sb.staging("pv");
    n.stage(&dev, &staging, Some(GROUP));
    // Root writes a file of its own after the walk (the setgid dir gives it the group: take
    // it back).
    let late = staging.join("a/late");
    std::fs::write(&late, b"x").expect("write");
    chown_root(&late, 0o600);
    n.unstage(&staging);
    // Staged again with the same group: the root matches, nothing is walked.
    n.stage(&dev, &staging, Some(GROUP));
    assert_eq!(tree(&staging)["a/late"], (0, 0o600, 'f'));
    n.unstage(&staging);
    // Another group: the root does not match, everything is walked.
    n.stage(&dev, &staging, Some(4000));
    assert_eq!(tree(&staging)["a/late"], (4000, 0o660, 'f'));
    assert!(tree(&staging).values().all(|&(gid, ..)| gid == 4000));
    n.unstage(&staging);
}

#[test]
fn a_walk_stops_at_its_deadline_and_the_next_one_finishes_it() {
    let sb = Sandbox::new("fsgroup-deadline");
    let outside = outside(&sb);
    let dev = volume(&sb, 64 * MIB, |root| earlier_pods_data(root, &outside));
    let n = node(&sb);
    let staging = sb.staging("pv");
    n.stage(&dev, &staging, None);
    let before = tree(&staging);
    match n.os.share_with_group(&staging, GROUP, Duration::ZERO) {
        Err(OwnershipError::Deadline { entries, .. }) => assert_eq!(entries, 0),
        other => panic!("{other:?}"),
    }
    assert_eq!(tree(&staging), before, "nothing done past the deadline");
    let done =
        n.os.share_with_group(&staging, GROUP, Duration::from_secs(600))
            .expect("walk");
    assert!(!done.skipped && done.refused == 0, "{done:?}");
    assert_eq!(done.entries, before.len() as u64);
    assert_eq!(tree(&staging), kubelets(&before, GROUP));
    let again =
        n.os.share_with_group(&staging, GROUP, Duration::ZERO)
            .expect("shortcut");
    assert!(again.skipped, "{again:?}");
    n.unstage(&staging);
}

#[test]
fn a_tree_deeper_than_the_limit_is_refused() {
    let sb = Sandbox::new("fsgroup-deep");
    let dev = volume(&sb, 64 * MIB, |root| {
        let mut p = root.to_path_buf();
        for _ in 0..MAX_DEPTH {
            p.push("d");
            std::fs::create_dir(&p).expect("mkdir");
        }
    });
    let n = node(&sb);
    let staging = sb.staging("pv");
    n.stage(&dev, &staging, None);
    match n
        .os
        .share_with_group(&staging, GROUP, Duration::from_secs(600))
    {
        Err(OwnershipError::TooDeep { path }) => {
            assert_eq!(
                path.components().count() - staging.components().count(),
                MAX_DEPTH
            );
        }
        other => panic!("{other:?}"),
    }
    n.unstage(&staging);
}

/// The time to give a volume of 100,000 files (100 directories of 1,000) to a group, printed;
/// run with `cargo test -p moor-privileged --test fsgroup -- --ignored --nocapture`.
#[test]
#[ignore = "a measurement, not a check: run it by name"]
fn time_to_walk_100000_files() {
    let sb = Sandbox::new("fsgroup-time");
    let dev = volume(&sb, 2048 * MIB, |root| {
        for d in 0..100 {
            let dir = root.join(format!("d{d}"));
            std::fs::create_dir(&dir).expect("mkdir");
            for f in 0..1000 {
                std::fs::write(dir.join(format!("f{f}")), b"").expect("create");
            }
        }
    });
    let n = node(&sb);
    let staging = sb.staging("pv");
    n.stage(&dev, &staging, None);
    let start = Instant::now();
    let walked =
        n.os.share_with_group(&staging, GROUP, Duration::from_secs(600))
            .expect("walk");
    let walk = start.elapsed();
    let start = Instant::now();
    let skipped =
        n.os.share_with_group(&staging, GROUP, Duration::from_secs(600))
            .expect("shortcut");
    let shortcut = start.elapsed();
    println!(
        "walk: {} entries, {} changed, in {walk:?}; root check after it: {shortcut:?} (skipped: {})",
        walked.entries, walked.changed, skipped.skipped
    );
    n.unstage(&staging);
}
