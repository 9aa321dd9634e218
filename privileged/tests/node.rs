//! The node engine on real loop devices, real mkfs and real mounts, each test in its own
//! private mount namespace (run as root).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use csi::volume_capability::{AccessMode, AccessType, BlockVolume, MountVolume, access_mode::Mode};
use moor_node::engine::{Engine, EngineConfig};
use moor_node::journal::Journal;
use moor_node::service::{NodeService, PluginInfo};
use moor_node::sys::linux::Linux;
use moor_privileged::client::DEADLINE;
use moor_privileged::{Sandbox, is_mount_point, read_at, write_at};
use moor_proto::csi::v1 as csi;
use moor_proto::csi::v1::node_server::Node as _;
use tonic::{Code, Request};

const MIB: u64 = 1 << 20;

struct TestNode {
    svc: NodeService<Linux>,
    engine: Arc<Engine<Linux>>,
}

fn node(sb: &Sandbox) -> TestNode {
    let os = Arc::new(Linux::new(&sb.kubelet).expect("os"));
    let (journal, _) = Journal::open(&sb.state, false).expect("journal");
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
        state_dir: sb.state.clone(),
    };
    TestNode {
        svc: NodeService::new(Arc::clone(&engine), info),
        engine,
    }
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

fn cap(fs: &str, mode: Mode) -> csi::VolumeCapability {
    csi::VolumeCapability {
        access_mode: Some(AccessMode { mode: mode as i32 }),
        access_type: Some(AccessType::Mount(MountVolume {
            fs_type: fs.into(),
            mount_flags: vec![],
            volume_mount_group: String::new(),
        })),
    }
}

fn block() -> csi::VolumeCapability {
    csi::VolumeCapability {
        access_mode: Some(AccessMode {
            mode: Mode::SingleNodeWriter as i32,
        }),
        access_type: Some(AccessType::Block(BlockVolume {})),
    }
}

fn stage_req(
    vol: &str,
    dev: &Path,
    staging: &Path,
    c: csi::VolumeCapability,
) -> csi::NodeStageVolumeRequest {
    csi::NodeStageVolumeRequest {
        volume_id: vol.into(),
        publish_context: HashMap::from([("devicePath".into(), dev.display().to_string())]),
        staging_target_path: staging.display().to_string(),
        volume_capability: Some(c),
        secrets: HashMap::new(),
        volume_context: HashMap::new(),
    }
}

fn publish_req(
    vol: &str,
    staging: &Path,
    target: &Path,
    c: csi::VolumeCapability,
    readonly: bool,
) -> csi::NodePublishVolumeRequest {
    csi::NodePublishVolumeRequest {
        volume_id: vol.into(),
        publish_context: HashMap::new(),
        staging_target_path: staging.display().to_string(),
        target_path: target.display().to_string(),
        volume_capability: Some(c),
        readonly,
        secrets: HashMap::new(),
        volume_context: HashMap::new(),
    }
}

impl TestNode {
    async fn stage(
        &self,
        vol: &str,
        dev: &Path,
        staging: &Path,
        c: csi::VolumeCapability,
    ) -> Result<(), tonic::Status> {
        self.svc
            .node_stage_volume(Request::new(stage_req(vol, dev, staging, c)))
            .await
            .map(drop)
    }
    async fn unstage(&self, vol: &str, staging: &Path) -> Result<(), tonic::Status> {
        let r = csi::NodeUnstageVolumeRequest {
            volume_id: vol.into(),
            staging_target_path: staging.display().to_string(),
        };
        self.svc
            .node_unstage_volume(Request::new(r))
            .await
            .map(drop)
    }
    async fn publish(
        &self,
        vol: &str,
        staging: &Path,
        target: &Path,
        c: csi::VolumeCapability,
        ro: bool,
    ) -> Result<(), tonic::Status> {
        self.svc
            .node_publish_volume(Request::new(publish_req(vol, staging, target, c, ro)))
            .await
            .map(drop)
    }
    async fn unpublish(&self, vol: &str, target: &Path) -> Result<(), tonic::Status> {
        let r = csi::NodeUnpublishVolumeRequest {
            volume_id: vol.into(),
            target_path: target.display().to_string(),
        };
        self.svc
            .node_unpublish_volume(Request::new(r))
            .await
            .map(drop)
    }
    async fn stats(
        &self,
        vol: &str,
        path: &Path,
    ) -> Result<csi::NodeGetVolumeStatsResponse, tonic::Status> {
        let r = csi::NodeGetVolumeStatsRequest {
            volume_id: vol.into(),
            volume_path: path.display().to_string(),
            staging_target_path: String::new(),
        };
        self.svc
            .node_get_volume_stats(Request::new(r))
            .await
            .map(|r| r.into_inner())
    }
    async fn expand(
        &self,
        vol: &str,
        path: &Path,
        staging: &Path,
        required: u64,
    ) -> Result<i64, tonic::Status> {
        let r = csi::NodeExpandVolumeRequest {
            volume_id: vol.into(),
            volume_path: path.display().to_string(),
            capacity_range: Some(csi::CapacityRange {
                required_bytes: required as i64,
                limit_bytes: 0,
            }),
            staging_target_path: staging.display().to_string(),
            volume_capability: None,
            secrets: HashMap::new(),
        };
        self.svc
            .node_expand_volume(Request::new(r))
            .await
            .map(|r| r.into_inner().capacity_bytes)
    }
}

fn fs_of(path: &Path) -> String {
    let table = std::fs::read("/proc/thread-self/mountinfo").expect("mountinfo");
    moor_node::sys::mountinfo::parse(&table)
        .expect("parse")
        .into_iter()
        .rev()
        .find(|m| m.mount_point == path)
        .map(|m| m.fs_type)
        .unwrap_or_default()
}

fn probe(dev: &Path) -> moor_node::superblock::Content {
    let size = std::fs::File::open(dev)
        .and_then(|mut f| std::io::Seek::seek(&mut f, std::io::SeekFrom::End(0)))
        .expect("size");
    let head = read_at(dev, 0, moor_node::superblock::HEAD_LEN.min(size as usize));
    let tail_len = moor_node::superblock::TAIL_LEN.min(size as usize);
    let tail = read_at(dev, size - tail_len as u64, tail_len);
    moor_node::superblock::probe(&head, &tail, size)
}

#[test]
fn blank_devices_are_formatted_and_mounted_for_each_filesystem() {
    let sb = Sandbox::new("format");
    let n = node(&sb);
    rt().block_on(async {
        for (i, fs) in ["ext4", "xfs", "btrfs"].iter().enumerate() {
            let dev = sb.loop_device(&format!("{fs}.img"), 512 * MIB);
            let staging = sb.staging(&format!("pv{i}"));
            n.stage(
                &format!("vol-{fs}"),
                &dev,
                &staging,
                cap(fs, Mode::SingleNodeWriter),
            )
            .await
            .expect(fs);
            assert!(is_mount_point(&staging), "{fs} staged");
            assert_eq!(fs_of(&staging), *fs);
            std::fs::write(staging.join("hello"), b"world").expect("write");
            n.unstage(&format!("vol-{fs}"), &staging)
                .await
                .expect("unstage");
            assert!(!is_mount_point(&staging));
        }
    });
}

#[test]
fn unstage_and_stage_again_keeps_the_data() {
    let sb = Sandbox::new("restage");
    let n = node(&sb);
    let dev = sb.loop_device("v.img", 256 * MIB);
    let staging = sb.staging("pv");
    rt().block_on(async {
        n.stage("vol", &dev, &staging, cap("ext4", Mode::SingleNodeWriter))
            .await
            .expect("stage");
        std::fs::write(staging.join("data"), b"precious").expect("write");
        // Idempotent repeat while staged.
        n.stage("vol", &dev, &staging, cap("ext4", Mode::SingleNodeWriter))
            .await
            .expect("repeat");
        n.unstage("vol", &staging).await.expect("unstage");
        n.unstage("vol", &staging).await.expect("unstage again");
        n.stage("vol", &dev, &staging, cap("ext4", Mode::SingleNodeWriter))
            .await
            .expect("stage again");
        assert_eq!(
            std::fs::read(staging.join("data")).expect("read"),
            b"precious"
        );
        n.unstage("vol", &staging).await.expect("unstage");
    });
}

#[test]
fn xfs_staged_as_ext4_fails_and_keeps_its_data() {
    let sb = Sandbox::new("wrongfs");
    let n = node(&sb);
    let dev = sb.loop_device("x.img", 512 * MIB);
    moor_privileged::run(
        "mkfs.xfs",
        &["-q", "-L", "keepme", &dev.display().to_string()],
    );
    let before = read_at(&dev, 0, 64 * 1024);
    let staging = sb.staging("pv");
    rt().block_on(async {
        let err = n
            .stage("vol", &dev, &staging, cap("ext4", Mode::SingleNodeWriter))
            .await
            .expect_err("must refuse");
        assert_eq!(err.code(), Code::FailedPrecondition);
        assert!(err.message().contains("xfs"), "{}", err.message());
    });
    assert!(!is_mount_point(&staging));
    assert_eq!(
        read_at(&dev, 0, 64 * 1024),
        before,
        "the device must be untouched"
    );
    assert!(matches!(
        probe(&dev),
        moor_node::superblock::Content::Filesystem {
            fs: moor_runtime::contract::Filesystem::Xfs,
            ..
        }
    ));
}

#[test]
fn devices_with_partition_tables_are_never_formatted() {
    let sb = Sandbox::new("ptable");
    let n = node(&sb);
    // A protective MBR plus a GPT header, and a classic MBR with one Linux partition.
    let gpt = sb.loop_device("gpt.img", 64 * MIB);
    let mut mbr_sector = vec![0u8; 512];
    mbr_sector[446 + 4] = 0xEE;
    mbr_sector[446 + 8] = 1;
    mbr_sector[446 + 12..446 + 16].copy_from_slice(&((64 * MIB / 512 - 1) as u32).to_le_bytes());
    mbr_sector[510] = 0x55;
    mbr_sector[511] = 0xAA;
    write_at(&gpt, 0, &mbr_sector);
    write_at(&gpt, 512, b"EFI PART\x00\x00\x01\x00\x5c\x00\x00\x00");
    let mbr = sb.loop_device("mbr.img", 64 * MIB);
    let mut sector = vec![0u8; 512];
    sector[446 + 4] = 0x83;
    sector[446 + 8..446 + 12].copy_from_slice(&2048u32.to_le_bytes());
    sector[446 + 12..446 + 16].copy_from_slice(&4096u32.to_le_bytes());
    sector[510] = 0x55;
    sector[511] = 0xAA;
    write_at(&mbr, 0, &sector);
    // Unknown data in the middle of the first MiB.
    let junk = sb.loop_device("junk.img", 64 * MIB);
    write_at(&junk, 300_000, b"not a filesystem");
    rt().block_on(async {
        for (i, dev) in [&gpt, &mbr, &junk].into_iter().enumerate() {
            let before = read_at(dev, 0, MIB as usize);
            let staging = sb.staging(&format!("pv{i}"));
            let err = n
                .stage(
                    &format!("v{i}"),
                    dev,
                    &staging,
                    cap("ext4", Mode::SingleNodeWriter),
                )
                .await
                .expect_err("must refuse");
            assert_eq!(err.code(), Code::FailedPrecondition, "{}", err.message());
            assert_eq!(
                read_at(dev, 0, MIB as usize),
                before,
                "device {i} untouched"
            );
            assert!(!is_mount_point(&staging));
        }
    });
}

/// A LUKS2 volume made by cryptsetup with 2 MiB of metadata, whose first 2 MiB (the primary
/// header and its JSON) were then wiped: cryptsetup still opens it from its secondary header,
/// so stage must refuse it, though its first and last MiB are all zeros.
#[test]
fn a_luks2_device_whose_start_was_wiped_is_never_formatted() {
    let Some(cryptsetup) = ["/usr/sbin/cryptsetup", "/sbin/cryptsetup"]
        .into_iter()
        .find(|p| Path::new(p).is_file())
    else {
        eprintln!("skipped: cryptsetup is not installed");
        return;
    };
    let sb = Sandbox::new("luks-wiped");
    let n = node(&sb);
    let dev = sb.loop_device("luks.img", 64 * MIB);
    let mut child = std::process::Command::new(cryptsetup)
        .args([
            "luksFormat",
            "--batch-mode",
            "--key-file=-",
            "--type",
            "luks2",
        ])
        .args(["--pbkdf", "pbkdf2", "--pbkdf-force-iterations", "1000"])
        .args(["--luks2-metadata-size", "2M"])
        .arg(&dev)
        .stdin(std::process::Stdio::piped())
        .spawn()
        .expect("cryptsetup");
    std::io::Write::write_all(&mut child.stdin.take().expect("stdin"), b"a passphrase")
        .expect("passphrase");
    assert!(child.wait().expect("cryptsetup").success(), "luksFormat");
    write_at(&dev, 0, &vec![0; 2 * MIB as usize]);
    let secondary = read_at(&dev, 2 * MIB, MIB as usize);
    assert_eq!(&secondary[..6], b"SKUL\xba\xbe");
    rt().block_on(async {
        let staging = sb.staging("pv");
        let err = n
            .stage("v", &dev, &staging, cap("ext4", Mode::SingleNodeWriter))
            .await
            .expect_err("must refuse");
        assert_eq!(err.code(), Code::FailedPrecondition, "{}", err.message());
        assert!(err.message().contains("LUKS2"), "{}", err.message());
        assert!(!is_mount_point(&staging));
    });
    assert_eq!(
        read_at(&dev, 0, 2 * MIB as usize),
        vec![0; 2 * MIB as usize]
    );
    assert_eq!(
        read_at(&dev, 2 * MIB, MIB as usize),
        secondary,
        "header untouched"
    );
}

#[test]
fn rw_and_ro_publish_are_enforced_by_the_kernel() {
    let sb = Sandbox::new("publish");
    let n = node(&sb);
    let dev = sb.loop_device("v.img", 256 * MIB);
    let staging = sb.staging("pv");
    let rw = sb.target("pod-a", "pv");
    let ro = sb.target("pod-b", "pv");
    let c = cap("ext4", Mode::SingleNodeMultiWriter);
    rt().block_on(async {
        n.stage("vol", &dev, &staging, c.clone())
            .await
            .expect("stage");
        n.publish("vol", &staging, &rw, c.clone(), false)
            .await
            .expect("rw publish");
        n.publish("vol", &staging, &rw, c.clone(), false)
            .await
            .expect("idempotent");
        n.publish("vol", &staging, &ro, c.clone(), true)
            .await
            .expect("ro publish");
        let other = n
            .publish("vol", &staging, &rw, c.clone(), true)
            .await
            .expect_err("other args");
        assert_eq!(other.code(), Code::AlreadyExists);
        std::fs::write(rw.join("f"), b"through rw").expect("write rw");
        assert_eq!(std::fs::read(ro.join("f")).expect("read ro"), b"through rw");
        let e = std::fs::write(ro.join("g"), b"x").expect_err("ro must refuse writes");
        assert_eq!(e.raw_os_error(), Some(libc::EROFS));
        // Unstage while published: FAILED_PRECONDITION, and the mounts stay.
        let e = n
            .unstage("vol", &staging)
            .await
            .expect_err("still published");
        assert_eq!(e.code(), Code::FailedPrecondition);
        assert!(is_mount_point(&rw) && is_mount_point(&staging));
        for t in [&rw, &ro] {
            n.unpublish("vol", t).await.expect("unpublish");
            n.unpublish("vol", t).await.expect("unpublish again");
            assert!(!t.exists(), "the SP removes the target");
        }
        n.unstage("vol", &staging).await.expect("unstage");
    });
    assert!(sb.mounts().is_empty(), "{:?}", sb.mounts());
}

#[test]
fn block_publish_reads_back_what_was_written_through_the_device() {
    let sb = Sandbox::new("block");
    let n = node(&sb);
    let dev = sb.loop_device("b.img", 64 * MIB);
    write_at(&dev, 5 * MIB, b"written through the device");
    let staging = sb.k("plugins/kubernetes.io/csi/volumeDevices/staging/pv");
    std::fs::create_dir_all(&staging).expect("kubelet makes the staging dir");
    let target = sb.block_target("pod", "pv");
    rt().block_on(async {
        n.stage("vol", &dev, &staging, block())
            .await
            .expect("stage");
        assert!(!is_mount_point(&staging), "block stage mounts nothing");
        n.publish("vol", &staging, &target, block(), false)
            .await
            .expect("publish");
        n.publish("vol", &staging, &target, block(), false)
            .await
            .expect("idempotent");
        assert!(moor_privileged::is_block_device(&target));
        assert_eq!(read_at(&target, 5 * MIB, 26), b"written through the device");
        write_at(&target, 7 * MIB, b"and back");
        assert_eq!(read_at(&dev, 7 * MIB, 8), b"and back");
        let st = n.stats("vol", &target).await.expect("stats");
        assert_eq!(st.usage[0].total, (64 * MIB) as i64);
        n.unpublish("vol", &target).await.expect("unpublish");
        assert!(!target.exists());
        n.unstage("vol", &staging).await.expect("unstage");
    });
}

#[test]
fn stats_report_usage_and_a_vanished_mount() {
    let sb = Sandbox::new("stats");
    let n = node(&sb);
    let dev = sb.loop_device("s.img", 512 * MIB);
    let staging = sb.staging("pv");
    let target = sb.target("pod", "pv");
    let c = cap("xfs", Mode::SingleNodeWriter);
    rt().block_on(async {
        n.stage("vol", &dev, &staging, c.clone())
            .await
            .expect("stage");
        n.publish("vol", &staging, &target, c.clone(), false)
            .await
            .expect("publish");
        std::fs::write(target.join("f"), vec![7u8; 8 * MIB as usize]).expect("write");
        let st = n.stats("vol", &target).await.expect("stats");
        let bytes = &st.usage[0];
        assert!(
            bytes.total > (400 * MIB) as i64 && bytes.used >= (8 * MIB) as i64,
            "{bytes:?}"
        );
        assert!(st.usage[1].total > 0, "inodes");
        assert!(!st.volume_condition.expect("condition").abnormal);
        // Unmounted behind moor's back.
        // A tool forked by a concurrent test holds copies of open descriptors for an instant
        // (longer on a busy machine).
        let start = std::time::Instant::now();
        while let Err(e) =
            rustix::mount::unmount(target.as_path(), rustix::mount::UnmountFlags::empty())
        {
            assert!(
                e == rustix::io::Errno::BUSY && start.elapsed() < DEADLINE,
                "umount: {e:?} (after {:?})",
                start.elapsed()
            );
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        let st = n.stats("vol", &target).await.expect("stats");
        assert!(st.volume_condition.expect("condition").abnormal);
        let missing = sb.target("nobody", "pv");
        assert_eq!(
            n.stats("vol", &missing).await.expect_err("unknown").code(),
            Code::NotFound
        );
        n.unpublish("vol", &target).await.expect("unpublish");
        n.unstage("vol", &staging).await.expect("unstage");
    });
}

fn grow_and_expand(fs: &str) -> Result<(u64, u64), tonic::Status> {
    let sb = Sandbox::new(&format!("expand-{fs}"));
    let n = node(&sb);
    let dev = sb.loop_device("e.img", 512 * MIB);
    let staging = sb.staging("pv");
    let target = sb.target("pod", "pv");
    let c = cap(fs, Mode::SingleNodeWriter);
    rt().block_on(async {
        n.stage("vol", &dev, &staging, c.clone())
            .await
            .expect("stage");
        n.publish("vol", &staging, &target, c.clone(), false)
            .await
            .expect("publish");
        let before = rustix::fs::statvfs(target.as_path()).expect("statvfs");
        let before = before.f_blocks * before.f_frsize;
        sb.grow_loop(&dev, "e.img", 1024 * MIB);
        // More than the device holds: it has not grown yet, UNAVAILABLE (kubelet retries; an
        // OUT_OF_RANGE would be infeasible to it).
        let e = n
            .expand("vol", &target, &staging, 2048 * MIB)
            .await
            .expect_err("too big");
        assert_eq!(e.code(), Code::Unavailable);
        let result = n.expand("vol", &target, &staging, 1024 * MIB).await;
        let after = rustix::fs::statvfs(target.as_path()).expect("statvfs");
        let after = after.f_blocks * after.f_frsize;
        n.unpublish("vol", &target).await.expect("unpublish");
        n.unstage("vol", &staging).await.expect("unstage");
        result.map(|cap| {
            assert_eq!(cap as u64, 1024 * MIB);
            (before, after)
        })
    })
}

#[test]
fn online_expand_of_xfs_and_btrfs_grows_the_filesystem() {
    for fs in ["xfs", "btrfs"] {
        let (before, after) = grow_and_expand(fs).unwrap_or_else(|e| panic!("{fs}: {e:?}"));
        assert!(after > before + 400 * MIB, "{fs}: {before} -> {after}");
    }
}

#[test]
fn online_expand_of_ext4_grows_or_says_clearly_why_not() {
    match grow_and_expand("ext4") {
        Ok((before, after)) => assert!(after > before + 400 * MIB),
        // Without CAP_SYS_RESOURCE the kernel refuses an online ext4 resize.
        Err(e) => assert!(e.message().contains("resize2fs"), "{e:?}"),
    }
}

/// Stages a `fs` volume on a 512 MiB device and unstages it, grows the device to 1 GiB (as a
/// restore into a larger volume, or a controller expansion while unstaged, leaves it) and
/// stages it again: the filesystem's size after that stage, or the stage's error.
fn grow_at_stage(fs: &str) -> Result<u64, tonic::Status> {
    let sb = Sandbox::new(&format!("stage-grow-{fs}"));
    let n = node(&sb);
    let dev = sb.loop_device("g.img", 512 * MIB);
    let staging = sb.staging("pv");
    let c = cap(fs, Mode::SingleNodeWriter);
    rt().block_on(async {
        n.stage("vol", &dev, &staging, c.clone())
            .await
            .expect("first stage");
        n.unstage("vol", &staging).await.expect("unstage");
        sb.grow_loop(&dev, "g.img", 1024 * MIB);
        let staged = n.stage("vol", &dev, &staging, c.clone()).await;
        if let Err(e) = staged {
            assert!(
                !is_mount_point(&staging),
                "{fs}: a failed stage leaves no mount"
            );
            assert!(
                n.engine.journal().get("vol").is_none(),
                "{fs}: nor a record"
            );
            return Err(e);
        }
        let vfs = rustix::fs::statvfs(staging.as_path()).expect("statvfs");
        n.unstage("vol", &staging).await.expect("unstage");
        Ok(vfs.f_blocks * vfs.f_frsize)
    })
}

#[test]
fn a_filesystem_smaller_than_its_device_is_grown_at_stage() {
    for fs in ["xfs", "btrfs"] {
        let size = grow_at_stage(fs).unwrap_or_else(|e| panic!("{fs}: {e:?}"));
        assert!(size > 900 * MIB, "{fs}: {size} bytes after stage");
    }
    match grow_at_stage("ext4") {
        Ok(size) => assert!(size > 900 * MIB, "ext4: {size} bytes after stage"),
        // Without CAP_SYS_RESOURCE the kernel refuses an online ext4 resize.
        Err(e) => assert!(
            e.code() == Code::Internal && e.message().contains("resize2fs"),
            "{e:?}"
        ),
    }
}

#[test]
fn two_concurrent_calls_on_one_volume_give_one_aborted() {
    let sb = Sandbox::new("concurrent");
    let n = Arc::new(node(&sb));
    let dev = sb.loop_device("c.img", 2048 * MIB);
    let staging = sb.staging("pv");
    let (tx, rx) = std::sync::mpsc::channel();
    let (n2, dev2, staging2) = (Arc::clone(&n), dev.clone(), staging.clone());
    rt().block_on(async move {
        // The first call formats a 2 GiB device; the second arrives while it holds the volume.
        let first = tokio::spawn(async move {
            let r = n2
                .stage("vol", &dev2, &staging2, cap("xfs", Mode::SingleNodeWriter))
                .await;
            let _ = tx.send(());
            r
        });
        while n.engine.locks().in_flight() == 0 && rx.try_recv().is_err() {
            tokio::task::yield_now().await;
        }
        let second = n
            .stage("vol", &dev, &staging, cap("xfs", Mode::SingleNodeWriter))
            .await;
        let first = first.await.expect("join");
        first.expect("first call succeeds");
        assert_eq!(
            second.expect_err("second call is refused").code(),
            Code::Aborted
        );
        n.unstage("vol", &staging).await.expect("unstage");
    });
}

#[test]
fn corrupted_staging_mount_is_cleaned_on_unstage() {
    // A tmpfs over the staging path stands in for "something else is mounted there".
    let sb = Sandbox::new("foreign");
    let n = node(&sb);
    let dev = sb.loop_device("f.img", 128 * MIB);
    let staging = sb.staging("pv");
    std::fs::create_dir_all(&staging).expect("dir");
    rustix::mount::mount(
        "tmpfs",
        staging.as_path(),
        "tmpfs",
        rustix::mount::MountFlags::empty(),
        None,
    )
    .expect("tmpfs");
    rt().block_on(async {
        let e = n
            .stage("vol", &dev, &staging, cap("ext4", Mode::SingleNodeWriter))
            .await
            .expect_err("occupied");
        assert_eq!(e.code(), Code::AlreadyExists, "{}", e.message());
    });
    assert_eq!(
        fs_of(&staging),
        "tmpfs",
        "a mount that is not moor's is not touched"
    );
    assert!(matches!(probe(&dev), moor_node::superblock::Content::Blank));
}

#[test]
fn nothing_is_left_in_the_sandbox_after_a_lifecycle() {
    let sb = Sandbox::new("clean");
    let n = node(&sb);
    let dev = sb.loop_device("c.img", 128 * MIB);
    let staging = sb.staging("pv");
    let target = sb.target("pod", "pv");
    let c = cap("ext4", Mode::SingleNodeWriter);
    rt().block_on(async {
        n.stage("vol", &dev, &staging, c.clone())
            .await
            .expect("stage");
        n.publish("vol", &staging, &target, c.clone(), false)
            .await
            .expect("publish");
        n.unpublish("vol", &target).await.expect("unpublish");
        n.unstage("vol", &staging).await.expect("unstage");
    });
    assert!(sb.mounts().is_empty());
    assert!(n.engine.journal().all().is_empty());
    let (records, problems) = moor_node::journal::read_state(&sb.state).expect("journal");
    assert!(
        records.is_empty() && problems.is_empty(),
        "{records:?} {problems:?}"
    );
    let left: Vec<PathBuf> = std::fs::read_dir(&sb.state)
        .expect("state")
        .map(|e| e.expect("entry").path())
        .filter(|p| {
            // The log, and the mark of how much of it is durable, are the journal itself.
            let kept = [
                moor_node::journal::LOG_FILE,
                moor_node::journal::SYNCED_FILE,
            ];
            !kept
                .iter()
                .any(|k| p.file_name() == Some(std::ffi::OsStr::new(k)))
        })
        .collect();
    assert!(left.is_empty(), "{left:?}");
}

/// A pod with `hostUsers: false` (user namespaces, GA in Kubernetes 1.36): its container runtime
/// clones the target moor published (open_tree), idmaps the clone to the pod's user namespace
/// (mount_setattr with MOUNT_ATTR_IDMAP) and attaches it where the container sees it. Every
/// filesystem moor mounts must take that, and the pod's fsGroup, which moor gave the volume
/// through VOLUME_MOUNT_GROUP, must still let the pod's users write.
#[test]
fn a_runtime_idmaps_every_filesystems_published_volume_and_the_fs_group_still_holds() {
    moor_privileged::require_root();
    for fs in ["ext4", "xfs", "btrfs"] {
        moor_privileged::idmap::a_runtime_idmaps_a_published_volume(fs);
    }
}
