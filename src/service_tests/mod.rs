//! The Node RPCs through the gRPC service layer, on the fake OS: every row of the spec's error
//! tables, idempotency, and what is (and is not) done to the node.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use csi::volume_capability::{AccessMode, AccessType, BlockVolume, MountVolume, access_mode::Mode};
use moor_proto::csi::v1 as csi;
use moor_proto::csi::v1::node_server::Node;
use tonic::{Code, Request};

use crate::engine::{Engine, EngineConfig};
use crate::journal::Journal;
use crate::service::{NodeService, PluginInfo};
use crate::sys::Os as _;
use crate::sys::fake::{Call, FakeOs, superblock};

pub(crate) const K: &str = "/var/lib/kubelet";
pub(crate) const DEV: &str = "/dev/loop7";
pub(crate) const STAGING: &str =
    "/var/lib/kubelet/plugins/kubernetes.io/csi/moor.csi.io/abc/globalmount";
pub(crate) const TARGET: &str = "/var/lib/kubelet/pods/p1/volumes/kubernetes.io~csi/pv1/mount";
const GIB: u64 = 1 << 30;

pub(crate) struct Harness {
    pub(crate) os: Arc<FakeOs>,
    pub(crate) svc: NodeService<FakeOs>,
    pub(crate) engine: Arc<Engine<FakeOs>>,
    pub(crate) state: PathBuf,
    pub(crate) info: PluginInfo,
}

impl Drop for Harness {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.state);
    }
}

fn harness_with(max_volumes: u64) -> Harness {
    static N: AtomicU32 = AtomicU32::new(0);
    let state = std::env::temp_dir().join(format!(
        "moor-svc-test-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&state);
    let os = Arc::new(FakeOs::new());
    os.add_dir(Path::new(STAGING).parent().unwrap_or(Path::new("/")));
    os.add_dir(Path::new(TARGET).parent().unwrap_or(Path::new("/")));
    os.add_dir(format!(
        "{K}/plugins/kubernetes.io/csi/volumeDevices/publish/pv1"
    ));
    os.add_device(DEV, (7, 7), GIB);
    let (journal, _) = Journal::open(&state, false).expect("journal");
    let cfg = EngineConfig {
        kubelet_dir: K.into(),
        max_volumes,
        ..EngineConfig::default()
    };
    let engine = Arc::new(Engine::new(Arc::clone(&os), Arc::new(journal), cfg));
    let info = PluginInfo {
        driver_name: "moor.csi.io".into(),
        node_id: "node-1".into(),
        max_volumes,
        topology_key: "topology.moor.csi.io/node".into(),
        state_dir: state.clone(),
    };
    let svc = NodeService::new(Arc::clone(&engine), info.clone());
    Harness {
        os,
        svc,
        engine,
        state,
        info,
    }
}

pub(crate) fn harness() -> Harness {
    harness_with(0)
}

fn mount_cap(fs: &str, flags: &[&str], mode: Mode) -> csi::VolumeCapability {
    csi::VolumeCapability {
        access_mode: Some(AccessMode { mode: mode as i32 }),
        access_type: Some(AccessType::Mount(MountVolume {
            fs_type: fs.into(),
            mount_flags: flags.iter().map(|s| (*s).to_string()).collect(),
            volume_mount_group: String::new(),
        })),
    }
}

pub(crate) fn block_cap() -> csi::VolumeCapability {
    csi::VolumeCapability {
        access_mode: Some(AccessMode {
            mode: Mode::SingleNodeWriter as i32,
        }),
        access_type: Some(AccessType::Block(BlockVolume {})),
    }
}

pub(crate) fn stage_req(cap: csi::VolumeCapability) -> csi::NodeStageVolumeRequest {
    csi::NodeStageVolumeRequest {
        volume_id: "vol-1".into(),
        publish_context: HashMap::from([("devicePath".into(), DEV.into())]),
        staging_target_path: STAGING.into(),
        volume_capability: Some(cap),
        secrets: HashMap::new(),
        volume_context: HashMap::new(),
    }
}

pub(crate) fn publish_req(
    cap: csi::VolumeCapability,
    readonly: bool,
) -> csi::NodePublishVolumeRequest {
    csi::NodePublishVolumeRequest {
        volume_id: "vol-1".into(),
        publish_context: HashMap::new(),
        staging_target_path: STAGING.into(),
        target_path: TARGET.into(),
        volume_capability: Some(cap),
        readonly,
        secrets: HashMap::new(),
        volume_context: HashMap::new(),
    }
}

fn unpublish_req(target: &str) -> csi::NodeUnpublishVolumeRequest {
    csi::NodeUnpublishVolumeRequest {
        volume_id: "vol-1".into(),
        target_path: target.into(),
    }
}

fn unstage_req() -> csi::NodeUnstageVolumeRequest {
    csi::NodeUnstageVolumeRequest {
        volume_id: "vol-1".into(),
        staging_target_path: STAGING.into(),
    }
}

pub(crate) fn stats_req(path: &str) -> csi::NodeGetVolumeStatsRequest {
    csi::NodeGetVolumeStatsRequest {
        volume_id: "vol-1".into(),
        volume_path: path.into(),
        staging_target_path: String::new(),
    }
}

pub(crate) fn ext4() -> csi::VolumeCapability {
    mount_cap("ext4", &[], Mode::SingleNodeWriter)
}

async fn code<T>(f: impl std::future::Future<Output = Result<T, tonic::Status>>) -> Code {
    match f.await {
        Ok(_) => Code::Ok,
        Err(s) => s.code(),
    }
}

fn count(calls: &[Call], pred: impl Fn(&Call) -> bool) -> usize {
    calls.iter().filter(|c| pred(c)).count()
}

fn mkfs_calls(h: &Harness) -> usize {
    count(
        &h.os.calls(),
        |c| matches!(c, Call::Tool(p, _) if p.starts_with("mkfs")),
    )
}

pub(crate) async fn staged(h: &Harness) {
    h.svc
        .node_stage_volume(Request::new(stage_req(ext4())))
        .await
        .expect("stage");
}

// ---- NodeStageVolume ----

#[tokio::test]
async fn stage_formats_a_blank_device_once_and_mounts_it() {
    let h = harness();
    staged(&h).await;
    let calls = h.os.calls();
    let mkfs: Vec<_> = calls
        .iter()
        .filter_map(|c| match c {
            Call::Tool(p, a) => Some((p.clone(), a.clone())),
            _ => None,
        })
        .collect();
    assert_eq!(mkfs.len(), 1);
    assert_eq!(mkfs[0].0, "mkfs.ext4");
    assert!(
        mkfs[0].1.iter().any(|a| a.contains("lazy_itable_init=1")),
        "{mkfs:?}"
    );
    assert!(
        mkfs[0].1.iter().any(|a| a.contains("nodiscard")),
        "{mkfs:?}"
    );
    assert_eq!(h.os.mount_depth(STAGING), 1);
    // A repeat is OK and does nothing.
    h.os.clear_calls();
    staged(&h).await;
    assert_eq!(mkfs_calls(&h), 0);
    assert_eq!(h.os.mount_depth(STAGING), 1);
}

#[tokio::test]
async fn stage_xfs_always_mounts_with_nouuid() {
    let h = harness();
    h.svc
        .node_stage_volume(Request::new(stage_req(mount_cap(
            "xfs",
            &["noatime"],
            Mode::SingleNodeWriter,
        ))))
        .await
        .expect("stage");
    let m = h.os.calls().into_iter().find_map(|c| match c {
        Call::MountFs(m) => Some(m),
        _ => None,
    });
    let m = m.expect("mounted");
    assert_eq!(m.fs_type, "xfs");
    assert!(m.options.contains(&"nouuid".to_string()));
    assert_eq!(m.attrs.atime, crate::sys::Atime::None);
}

#[tokio::test]
async fn stage_of_a_device_with_another_filesystem_fails_and_touches_nothing() {
    let h = harness();
    for (offset, bytes) in superblock("xfs") {
        h.os.write_device(DEV, offset, &bytes);
    }
    let r = h
        .svc
        .node_stage_volume(Request::new(stage_req(ext4())))
        .await;
    let s = r.expect_err("must fail");
    assert_eq!(s.code(), Code::FailedPrecondition);
    assert!(s.message().contains("xfs"), "{}", s.message());
    assert_eq!(mkfs_calls(&h), 0);
    assert_eq!(h.os.mount_depth(STAGING), 0);
    assert!(h.engine.journal().get("vol-1").is_none());
}

#[tokio::test]
async fn stage_never_formats_partition_tables_or_unknown_data() {
    for (offset, bytes) in [
        (512u64, b"EFI PART".to_vec()),
        (1_000_000, vec![0xAB]),
        (GIB - 100, vec![1]),
        (0, b"LUKS\xba\xbe\x00\x02".to_vec()),
    ] {
        let h = harness();
        h.os.write_device(DEV, offset, &bytes);
        let c = code(h.svc.node_stage_volume(Request::new(stage_req(ext4())))).await;
        assert_eq!(c, Code::FailedPrecondition, "data at {offset}");
        assert_eq!(mkfs_calls(&h), 0, "data at {offset}");
    }
}

#[test]
fn a_probe_sees_only_its_own_device_through_the_reused_buffer() {
    // The probe's buffer is kept between probes; what one device put in it must never
    // decide what the next one is.
    let h = harness();
    let small = "/dev/loop8";
    let other = "/dev/loop9";
    h.os.add_device(small, (7, 8), 300 * 1024);
    h.os.add_device(other, (7, 9), GIB);
    // A blank device as large as DEV, one smaller than the windows, and one shorter than it
    // is said to be (it shrank since), whose reads come back short.
    for (dev, size) in [(other, GIB), (small, 300 * 1024), (small, GIB)] {
        for (offset, bytes) in [(1_000_000u64, vec![0xAB]), (GIB - 100, vec![1])] {
            h.os.write_device(DEV, offset, &bytes);
            let dirty = h.engine.probe_device(Path::new(DEV), GIB).expect("probe");
            assert!(!dirty.is_blank(), "data at {offset}");
            h.os.write_device(DEV, offset, &vec![0; bytes.len()]);
            let c = h.engine.probe_device(Path::new(dev), size).expect("probe");
            assert!(c.is_blank(), "{dev} ({size}) after data at {offset}: {c:?}");
        }
    }
    // And a formatted device is still known after the blank ones, by its first bytes.
    for (offset, bytes) in superblock("xfs") {
        h.os.write_device(small, offset, &bytes);
    }
    let c = h.engine.probe_device(Path::new(small), 300 * 1024);
    assert!(
        matches!(c, Ok(crate::superblock::Content::Filesystem { .. })),
        "{c:?}"
    );
}

#[tokio::test]
async fn stage_of_an_existing_matching_filesystem_mounts_without_mkfs() {
    let h = harness();
    for (offset, bytes) in superblock("ext4") {
        h.os.write_device(DEV, offset, &bytes);
    }
    staged(&h).await;
    assert_eq!(mkfs_calls(&h), 0);
    assert_eq!(h.os.mount_depth(STAGING), 1);
}

#[tokio::test]
async fn stage_error_rows() {
    let h = harness();
    // Volume does not exist (the device is not on this node): NOT_FOUND.
    let mut r = stage_req(ext4());
    r.publish_context
        .insert("devicePath".into(), "/dev/loop99".into());
    assert_eq!(
        code(h.svc.node_stage_volume(Request::new(r))).await,
        Code::NotFound
    );
    // Missing fields: INVALID_ARGUMENT.
    for mutate in [
        (|r: &mut csi::NodeStageVolumeRequest| r.volume_id.clear()) as fn(&mut _),
        |r| r.staging_target_path.clear(),
        |r| r.volume_capability = None,
        |r| r.publish_context.clear(),
        |r| r.staging_target_path = "/etc/globalmount".into(),
        |r| r.staging_target_path = format!("{K}/plugins/../../../etc"),
        |r| r.staging_target_path = "relative/path".into(),
        |r| r.volume_id = "x".repeat(129),
        |r| r.volume_capability = Some(mount_cap("vfat", &[], Mode::SingleNodeWriter)),
        |r| r.volume_capability = Some(mount_cap("ext4", &["bind"], Mode::SingleNodeWriter)),
        |r| r.volume_capability = Some(mount_cap("ext4", &[], Mode::Unknown)),
        |r| {
            r.publish_context
                .insert("devicePath".into(), "/etc/passwd".into())
                .map(drop)
                .unwrap_or(())
        },
    ] {
        let mut r = stage_req(ext4());
        mutate(&mut r);
        assert_eq!(
            code(h.svc.node_stage_volume(Request::new(r.clone()))).await,
            Code::InvalidArgument,
            "{r:?}"
        );
    }
    assert!(
        h.os.calls()
            .iter()
            .all(|c| !matches!(c, Call::MountFs(_) | Call::Tool(..) | Call::MakeDir(_)))
    );
    // Exceeds capabilities: a multi-node writer on a node-local filesystem.
    let r = stage_req(mount_cap("ext4", &[], Mode::MultiNodeMultiWriter));
    assert_eq!(
        code(h.svc.node_stage_volume(Request::new(r))).await,
        Code::FailedPrecondition
    );
    // Staged, then the same volume and path with another capability: ALREADY_EXISTS.
    staged(&h).await;
    let r = stage_req(mount_cap("ext4", &["noatime"], Mode::SingleNodeWriter));
    assert_eq!(
        code(h.svc.node_stage_volume(Request::new(r))).await,
        Code::AlreadyExists
    );
}

#[tokio::test]
async fn a_device_backed_by_another_file_is_never_used() {
    let h = harness();
    h.os.set_backing_file((7, 7), "/data/volumes/other.img");
    let mut r = stage_req(ext4());
    r.publish_context
        .insert("backingFile".into(), "/data/volumes/vol-1.img".into());
    let s = h
        .svc
        .node_stage_volume(Request::new(r.clone()))
        .await
        .expect_err("refused");
    assert_eq!(s.code(), Code::FailedPrecondition);
    assert!(s.message().contains("other.img"), "{}", s.message());
    assert_eq!(mkfs_calls(&h), 0);
    assert_eq!(h.os.mount_depth(STAGING), 0);
    h.os.set_backing_file((7, 7), "/data/volumes/vol-1.img");
    h.svc
        .node_stage_volume(Request::new(r))
        .await
        .expect("the right device");
}

const VOL_FILE: &str = "/data/volumes/vol-1.img";

/// A stage request that names the volume by its backing file, with `hint` as devicePath.
fn stage_by_file(hint: Option<&str>) -> csi::NodeStageVolumeRequest {
    let mut r = stage_req(ext4());
    r.publish_context.clear();
    r.publish_context
        .insert("backingFile".into(), VOL_FILE.into());
    if let Some(h) = hint {
        r.publish_context.insert("devicePath".into(), h.into());
    }
    r
}

fn find_calls(h: &Harness) -> Vec<std::time::Duration> {
    h.os.calls()
        .into_iter()
        .filter_map(|c| match c {
            Call::FindDevice(_, wait) => Some(wait),
            _ => None,
        })
        .collect()
}

fn staged_device(h: &Harness) -> Option<PathBuf> {
    h.engine
        .journal()
        .get("vol-1")
        .and_then(|r| r.stage)
        .map(|s| s.device)
}

#[tokio::test]
async fn a_matching_device_path_is_used_without_a_search() {
    let h = harness();
    h.os.set_backing_file((7, 7), VOL_FILE);
    h.svc
        .node_stage_volume(Request::new(stage_by_file(Some(DEV))))
        .await
        .expect("staged");
    assert!(find_calls(&h).is_empty());
    assert_eq!(staged_device(&h).as_deref(), Some(Path::new(DEV)));
}

#[tokio::test]
async fn a_device_present_under_another_name_is_found_at_once() {
    let h = harness();
    h.os.add_device("/dev/loop3", (7, 3), GIB);
    h.os.set_backing_file((7, 3), VOL_FILE);
    // No hint at all, then a hint that names a device that is not there.
    h.svc
        .node_stage_volume(Request::new(stage_by_file(None)))
        .await
        .expect("found by identity");
    assert_eq!(staged_device(&h).as_deref(), Some(Path::new("/dev/loop3")));
    let mounts: Vec<_> =
        h.os.calls()
            .into_iter()
            .filter_map(|c| match c {
                Call::MountFs(m) => Some(m.device),
                _ => None,
            })
            .collect();
    assert_eq!(mounts, vec![PathBuf::from("/dev/loop3")]);
    h.svc
        .node_stage_volume(Request::new(stage_by_file(Some("/dev/loop9"))))
        .await
        .expect("a stale hint is only a hint");
    assert_eq!(
        find_calls(&h),
        vec![EngineConfig::default().discovery_deadline; 2]
    );
}

#[tokio::test]
async fn a_device_that_appears_while_stage_waits_is_used() {
    let h = harness();
    h.os.attach_on_event("/dev/loop4", (7, 4), GIB, "/data/volumes/other.img");
    h.os.attach_on_event("/dev/loop5", (7, 5), GIB, VOL_FILE);
    h.svc
        .node_stage_volume(Request::new(stage_by_file(Some("/dev/loop5"))))
        .await
        .expect("found after an event");
    assert_eq!(staged_device(&h).as_deref(), Some(Path::new("/dev/loop5")));
    assert_eq!(mkfs_calls(&h), 1);
    assert_eq!(h.os.mount_depth(STAGING), 1);
}

#[tokio::test]
async fn a_device_that_never_appears_is_deadline_exceeded() {
    let h = harness();
    let s = h
        .svc
        .node_stage_volume(Request::new(stage_by_file(Some("/dev/loop5"))))
        .await
        .expect_err("never appears");
    assert_eq!(s.code(), Code::DeadlineExceeded);
    assert!(s.message().contains(VOL_FILE), "{}", s.message());
    assert_eq!(find_calls(&h).len(), 1);
    assert!(
        h.os.calls()
            .iter()
            .all(|c| !matches!(c, Call::MountFs(_) | Call::Tool(..) | Call::MakeDir(_)))
    );
    assert!(
        h.engine
            .journal()
            .get("vol-1")
            .and_then(|r| r.stage)
            .is_none()
    );
}

#[tokio::test]
async fn no_event_source_is_unavailable() {
    let h = harness();
    h.os.fail_next("find_device", libc::EPERM);
    assert_eq!(
        code(h.svc.node_stage_volume(Request::new(stage_by_file(None)))).await,
        Code::Unavailable
    );
}

#[tokio::test]
async fn a_reused_device_is_refused_naming_both_identities() {
    let h = harness();
    // loop7 was the volume's; its number now serves another file.
    h.os.set_backing_file((7, 7), "/data/volumes/vol-2.img");
    let s = h
        .svc
        .node_stage_volume(Request::new(stage_by_file(Some(DEV))))
        .await
        .expect_err("refused");
    assert_eq!(s.code(), Code::FailedPrecondition);
    assert!(
        s.message().contains(VOL_FILE) && s.message().contains("vol-2.img"),
        "{}",
        s.message()
    );
    // The search for the right device did not wait: the hint is another volume's.
    assert_eq!(find_calls(&h), vec![std::time::Duration::ZERO]);
    assert_eq!(mkfs_calls(&h), 0);
    assert_eq!(h.os.mount_depth(STAGING), 0);
    // Its file unlinked and recreated under the same name: still not the volume.
    h.os.set_backing_file((7, 7), VOL_FILE);
    h.os.set_backing_file_deleted((7, 7));
    let s = h
        .svc
        .node_stage_volume(Request::new(stage_by_file(Some(DEV))))
        .await
        .expect_err("refused");
    assert_eq!(s.code(), Code::FailedPrecondition);
    assert!(s.message().contains("(deleted)"), "{}", s.message());
    assert_eq!(mkfs_calls(&h), 0);
}

#[tokio::test]
async fn a_conflicting_hint_yields_to_the_volume_attached_elsewhere() {
    let h = harness();
    h.os.set_backing_file((7, 7), "/data/volumes/vol-2.img");
    h.os.add_device("/dev/loop3", (7, 3), GIB);
    h.os.set_backing_file((7, 3), VOL_FILE);
    h.svc
        .node_stage_volume(Request::new(stage_by_file(Some(DEV))))
        .await
        .expect("the volume's own device");
    assert_eq!(staged_device(&h).as_deref(), Some(Path::new("/dev/loop3")));
}

#[tokio::test]
async fn a_disk_is_found_by_serial() {
    let h = harness();
    h.os.add_device("/dev/vdb", (252, 16), GIB);
    h.os.set_serial((252, 16), "vol-0abc");
    let mut r = stage_req(block_cap());
    r.publish_context.clear();
    r.publish_context
        .insert("deviceSerial".into(), "vol-0abc".into());
    h.svc
        .node_stage_volume(Request::new(r))
        .await
        .expect("found by serial");
    assert_eq!(staged_device(&h).as_deref(), Some(Path::new("/dev/vdb")));
}

#[tokio::test]
async fn device_identity_keys_are_validated() {
    let h = harness();
    for (key, value) in [
        ("deviceSerial", ""),
        ("deviceSerial", "a\nb"),
        ("deviceWWN", "   "),
        ("backingFile", "relative.img"),
    ] {
        let mut r = stage_req(ext4());
        r.publish_context.insert(key.into(), value.into());
        assert_eq!(
            code(h.svc.node_stage_volume(Request::new(r))).await,
            Code::InvalidArgument,
            "{key}={value:?}"
        );
    }
    let mut r = stage_req(ext4());
    r.publish_context.clear();
    assert_eq!(
        code(h.svc.node_stage_volume(Request::new(r))).await,
        Code::InvalidArgument
    );
    assert!(find_calls(&h).is_empty());
}

#[tokio::test]
async fn stage_with_an_operation_in_flight_is_aborted() {
    let h = harness();
    let guard = h.engine.locks().try_lock("vol-1").expect("lock");
    assert_eq!(
        code(h.svc.node_stage_volume(Request::new(stage_req(ext4())))).await,
        Code::Aborted
    );
    drop(guard);
    staged(&h).await;
}

#[tokio::test]
async fn stage_beyond_max_volumes_is_resource_exhausted() {
    let h = harness_with(1);
    staged(&h).await;
    h.os.add_device("/dev/loop8", (7, 8), GIB);
    let mut r = stage_req(ext4());
    r.volume_id = "vol-2".into();
    r.publish_context
        .insert("devicePath".into(), "/dev/loop8".into());
    r.staging_target_path = format!("{K}/plugins/kubernetes.io/csi/moor.csi.io/abc/g2");
    assert_eq!(
        code(h.svc.node_stage_volume(Request::new(r))).await,
        Code::ResourceExhausted
    );
}

#[tokio::test]
async fn failed_mount_leaves_nothing_behind() {
    let h = harness();
    h.os.fail_next("mount_fs", libc::EINVAL);
    assert_eq!(
        code(h.svc.node_stage_volume(Request::new(stage_req(ext4())))).await,
        Code::Internal
    );
    assert_eq!(h.os.mount_depth(STAGING), 0);
    assert!(h.engine.journal().get("vol-1").is_none());
    // And the retry works, without formatting again.
    h.os.clear_calls();
    staged(&h).await;
    assert_eq!(mkfs_calls(&h), 0);
}

/// Puts on DEV an xfs superblock giving the filesystem `size` bytes (4 KiB blocks).
fn xfs_of_size(h: &Harness, size: u64) {
    let mut sb = vec![0u8; 16];
    sb[..4].copy_from_slice(b"XFSB");
    sb[4..8].copy_from_slice(&4096u32.to_be_bytes());
    sb[8..16].copy_from_slice(&(size / 4096).to_be_bytes());
    h.os.write_device(DEV, 0, &sb);
}

/// NodeStageVolume of DEV as xfs with `mode`.
async fn stage_xfs(h: &Harness, mode: Mode) -> Result<(), tonic::Status> {
    h.svc
        .node_stage_volume(Request::new(stage_req(mount_cap("xfs", &[], mode))))
        .await
        .map(drop)
}

fn tool_calls(h: &Harness) -> Vec<Call> {
    h.os.calls()
        .into_iter()
        .filter(|c| matches!(c, Call::Tool(..)))
        .collect()
}

#[tokio::test]
async fn stage_grows_a_filesystem_smaller_than_its_device() {
    // A volume restored from a 512 MiB snapshot into 1 GiB: the spec has it present 1 GiB.
    let h = harness();
    xfs_of_size(&h, 512 << 20);
    stage_xfs(&h, Mode::SingleNodeWriter).await.expect("stage");
    assert_eq!(
        tool_calls(&h),
        vec![Call::Tool("xfs_growfs".into(), vec![STAGING.into()])]
    );
    // The tool grew it: a retry confirms without growing again.
    xfs_of_size(&h, GIB);
    h.os.clear_calls();
    stage_xfs(&h, Mode::SingleNodeWriter)
        .await
        .expect("stage again");
    assert_eq!(tool_calls(&h), vec![]);
}

#[tokio::test]
async fn stage_leaves_a_filesystem_that_fills_its_device_or_is_read_only() {
    // What a tool leaves unused at the end (less than GROW_MIN) is not grown into.
    let h = harness();
    xfs_of_size(&h, GIB - crate::engine::GROW_MIN + 4096);
    stage_xfs(&h, Mode::SingleNodeWriter).await.expect("stage");
    assert_eq!(tool_calls(&h), vec![]);
    // A volume staged read-only cannot be written, so it is not grown either.
    let h = harness();
    xfs_of_size(&h, 512 << 20);
    stage_xfs(&h, Mode::MultiNodeReaderOnly)
        .await
        .expect("stage read-only");
    assert_eq!(tool_calls(&h), vec![]);
}

#[tokio::test]
async fn stage_whose_growth_fails_leaves_nothing_behind() {
    let h = harness();
    // ext4 of 512 MiB (4 KiB blocks) on the 1 GiB device; resize2fs then fails.
    h.os.write_device(DEV, 1024, &{
        let mut sb = vec![0u8; 0x68];
        sb[0x04..0x08].copy_from_slice(&131_072u32.to_le_bytes());
        sb[0x18..0x1C].copy_from_slice(&2u32.to_le_bytes());
        sb[0x38..0x3A].copy_from_slice(&0xEF53u16.to_le_bytes());
        sb[0x5C] = 0x04;
        sb[0x60] = 0x40;
        sb
    });
    h.os.fail_tool("resize2fs", 1);
    assert_eq!(
        code(h.svc.node_stage_volume(Request::new(stage_req(ext4())))).await,
        Code::Internal
    );
    assert_eq!(
        tool_calls(&h),
        vec![
            Call::Tool("e2fsck".into(), vec!["-p".into(), DEV.into()]),
            Call::Tool("resize2fs".into(), vec![DEV.into()])
        ]
    );
    assert_eq!(h.os.mount_depth(STAGING), 0);
    assert!(h.engine.journal().get("vol-1").is_none());
}

#[tokio::test]
async fn interrupted_mkfs_is_resumed_only_by_moor() {
    let h = harness();
    h.os.set_backing_file((7, 7), "/var/lib/moor/vol-1.img");
    let req = || {
        let mut r = stage_req(ext4());
        r.publish_context
            .insert("backingFile".into(), "/var/lib/moor/vol-1.img".into());
        r
    };
    h.os.fail_next("tool", 1);
    assert_eq!(
        code(h.svc.node_stage_volume(Request::new(req()))).await,
        Code::Internal
    );
    // mkfs left partial data behind; the journal says moor was formatting this device.
    h.os.write_device(DEV, 4096, &[0xFF; 16]);
    h.svc
        .node_stage_volume(Request::new(req()))
        .await
        .expect("resumed");
    let forced = h.os.calls().iter().any(
        |c| matches!(c, Call::Tool(p, a) if p == "mkfs.ext4" && a.contains(&"-F".to_string())),
    );
    assert!(forced, "resumed mkfs must be forced");
}

#[tokio::test]
async fn an_interrupted_mkfs_named_by_path_alone_is_not_resumed_over_data() {
    // The request names the device by path only: the path proves nothing about the unknown
    // data on it now (a loop number reused by another volume reads the same).
    let h = harness();
    h.os.fail_next("tool", 1);
    assert_eq!(
        code(h.svc.node_stage_volume(Request::new(stage_req(ext4())))).await,
        Code::Internal
    );
    h.os.write_device(DEV, 4096, &[0xFF; 16]);
    h.os.clear_calls();
    let s = h
        .svc
        .node_stage_volume(Request::new(stage_req(ext4())))
        .await
        .expect_err("refused");
    assert_eq!(s.code(), Code::FailedPrecondition, "{}", s.message());
    assert_eq!(mkfs_calls(&h), 0);
    // And a path that names another device number now is refused before anything is read.
    h.os.remove_device(DEV);
    h.os.add_device(DEV, (7, 70), GIB);
    h.os.write_device(DEV, 4096, &[0xFF; 16]);
    let s = h
        .svc
        .node_stage_volume(Request::new(stage_req(ext4())))
        .await
        .expect_err("refused");
    assert_eq!(s.code(), Code::FailedPrecondition, "{}", s.message());
    assert!(s.message().contains("7:7"), "{}", s.message());
    assert_eq!(mkfs_calls(&h), 0);
}

#[tokio::test]
async fn a_whole_filesystem_is_never_formatted_whatever_the_journal_says() {
    // The newest durable record says "formatting" (a power cut lost the lines after it), but
    // mkfs finished: the device holds the filesystem with the UUID moor chose.
    let h = harness();
    staged(&h).await;
    let mut record = h.engine.journal().get("vol-1").expect("record");
    let uuid = record
        .stage
        .as_ref()
        .and_then(|s| s.fs_uuid.clone())
        .expect("the UUID moor chose is recorded");
    let mkfs_args = h.os.calls().into_iter().find_map(|c| match c {
        Call::Tool(p, a) if p == "mkfs.ext4" => Some(a),
        _ => None,
    });
    assert!(
        mkfs_args.is_some_and(|a| a.contains(&uuid)),
        "mkfs is given the recorded UUID"
    );
    h.os.force_unmount(STAGING);
    if let Some(st) = record.stage.as_mut() {
        st.phase = crate::journal::Phase::Formatting;
    }
    h.engine
        .journal()
        .put(&record, crate::journal::Durability::Power)
        .expect("put");
    h.os.clear_calls();
    staged(&h).await;
    assert_eq!(mkfs_calls(&h), 0, "{:?}", h.os.calls());
    assert_eq!(h.os.mount_depth(STAGING), 1);
    let after = h.engine.journal().get("vol-1").and_then(|r| r.stage);
    assert_eq!(after.and_then(|s| s.fs_uuid), Some(uuid));
}

#[tokio::test]
async fn reader_only_stages_never_format() {
    for (mode, flags) in [
        (Mode::SingleNodeReaderOnly, &[][..]),
        (Mode::MultiNodeReaderOnly, &[][..]),
        (Mode::SingleNodeWriter, &["ro"][..]),
    ] {
        let h = harness();
        let s = h
            .svc
            .node_stage_volume(Request::new(stage_req(mount_cap("ext4", flags, mode))))
            .await
            .expect_err("refused");
        assert_eq!(s.code(), Code::FailedPrecondition, "{mode:?}");
        assert!(s.message().contains("read-only"), "{}", s.message());
        assert_eq!(mkfs_calls(&h), 0, "{mode:?}");
        assert!(
            !h.os
                .mutations()
                .iter()
                .any(|c| matches!(c, Call::Tool(..) | Call::MountFs(_))),
            "{:?}",
            h.os.mutations()
        );
        assert!(
            h.engine
                .probe_device(Path::new(DEV), GIB)
                .expect("probe")
                .is_blank()
        );
        assert!(h.engine.journal().get("vol-1").is_none());
        // A formatted device is staged read-only as before, unchecked (nothing is written).
        for (offset, bytes) in superblock("ext4") {
            h.os.write_device(DEV, offset, &bytes);
        }
        h.svc
            .node_stage_volume(Request::new(stage_req(mount_cap("ext4", flags, mode))))
            .await
            .expect("stage of a formatted device");
        assert_eq!(tool_calls(&h), vec![], "{mode:?}");
    }
}

#[tokio::test]
async fn an_existing_ext_filesystem_is_checked_before_a_read_write_mount() {
    let preen = || Call::Tool("e2fsck".into(), vec!["-p".into(), DEV.into()]);
    // Clean (0), repaired (1), and the check itself failing (8): mounted.
    for (code_, mounted) in [
        (None, true),
        (Some(1), true),
        (Some(8), true),
        (Some(4), false),
    ] {
        let h = harness();
        for (offset, bytes) in superblock("ext4") {
            h.os.write_device(DEV, offset, &bytes);
        }
        if let Some(c) = code_ {
            h.os.fail_tool("e2fsck", c);
        }
        let r = h
            .svc
            .node_stage_volume(Request::new(stage_req(ext4())))
            .await;
        assert_eq!(tool_calls(&h), vec![preen()], "{code_:?}");
        assert_eq!(h.os.mount_depth(STAGING), usize::from(mounted), "{code_:?}");
        match r {
            Ok(_) => assert!(mounted),
            Err(s) => {
                assert!(!mounted, "{code_:?}: {}", s.message());
                assert_eq!(s.code(), Code::FailedPrecondition);
                assert!(s.message().contains("injected failure"), "{}", s.message());
                assert!(h.engine.journal().get("vol-1").is_none());
            }
        }
    }
    // A filesystem moor has just made, and xfs, are not checked.
    let h = harness();
    staged(&h).await;
    assert!(!h.os.calls().contains(&preen()));
    let h = harness();
    for (offset, bytes) in superblock("xfs") {
        h.os.write_device(DEV, offset, &bytes);
    }
    stage_xfs(&h, Mode::SingleNodeWriter).await.expect("xfs");
    assert_eq!(tool_calls(&h), vec![]);
}

#[tokio::test]
async fn stage_applies_volume_mount_group() {
    let h = harness();
    let mut cap = ext4();
    if let Some(AccessType::Mount(m)) = cap.access_type.as_mut() {
        m.volume_mount_group = "2000".into();
    }
    h.svc
        .node_stage_volume(Request::new(stage_req(cap)))
        .await
        .expect("stage");
    assert!(
        h.os.calls()
            .contains(&Call::ShareWithGroup(STAGING.into(), 2000))
    );
}

#[tokio::test]
async fn block_stage_mounts_nothing() {
    let h = harness();
    h.svc
        .node_stage_volume(Request::new(stage_req(block_cap())))
        .await
        .expect("stage");
    assert_eq!(mkfs_calls(&h), 0);
    assert_eq!(h.os.mount_depth(STAGING), 0);
}

// ---- NodePublishVolume ----

#[tokio::test]
async fn publish_binds_the_staging_mount_and_repeats_are_ok() {
    let h = harness();
    staged(&h).await;
    h.svc
        .node_publish_volume(Request::new(publish_req(ext4(), false)))
        .await
        .expect("publish");
    assert_eq!(h.os.mount_depth(TARGET), 1);
    h.svc
        .node_publish_volume(Request::new(publish_req(ext4(), false)))
        .await
        .expect("repeat");
    assert_eq!(h.os.mount_depth(TARGET), 1, "never stack a second mount");
    // The same target with other arguments: ALREADY_EXISTS.
    assert_eq!(
        code(
            h.svc
                .node_publish_volume(Request::new(publish_req(ext4(), true)))
        )
        .await,
        Code::AlreadyExists
    );
}

#[tokio::test]
async fn readonly_publish_is_a_read_only_bind() {
    let h = harness();
    staged(&h).await;
    h.svc
        .node_publish_volume(Request::new(publish_req(ext4(), true)))
        .await
        .expect("publish");
    let bind = h.os.calls().into_iter().find_map(|c| match c {
        Call::Bind(b) => Some(b),
        _ => None,
    });
    assert!(bind.expect("bind").attrs.read_only);
}

#[tokio::test]
async fn publish_error_rows() {
    let h = harness();
    // Not staged: FAILED_PRECONDITION.
    assert_eq!(
        code(
            h.svc
                .node_publish_volume(Request::new(publish_req(ext4(), false)))
        )
        .await,
        Code::FailedPrecondition
    );
    staged(&h).await;
    // Staging target path not set: FAILED_PRECONDITION.
    let mut r = publish_req(ext4(), false);
    r.staging_target_path.clear();
    assert_eq!(
        code(h.svc.node_publish_volume(Request::new(r))).await,
        Code::FailedPrecondition
    );
    // Missing fields: INVALID_ARGUMENT.
    for mutate in [
        (|r: &mut csi::NodePublishVolumeRequest| r.volume_id.clear()) as fn(&mut _),
        |r| r.target_path.clear(),
        |r| r.volume_capability = None,
        |r| r.target_path = "/etc".into(),
        |r| r.target_path = format!("{K}//pods/x"),
    ] {
        let mut r = publish_req(ext4(), false);
        mutate(&mut r);
        assert_eq!(
            code(h.svc.node_publish_volume(Request::new(r))).await,
            Code::InvalidArgument
        );
    }
    // Access type other than staged: FAILED_PRECONDITION.
    assert_eq!(
        code(
            h.svc
                .node_publish_volume(Request::new(publish_req(block_cap(), false)))
        )
        .await,
        Code::FailedPrecondition
    );
    // Another volume's staging path: FAILED_PRECONDITION.
    let mut r = publish_req(ext4(), false);
    r.staging_target_path = format!("{K}/plugins/other");
    assert_eq!(
        code(h.svc.node_publish_volume(Request::new(r))).await,
        Code::FailedPrecondition
    );
    assert_eq!(h.os.mount_depth(TARGET), 0);
}

#[tokio::test]
async fn block_publish_binds_the_device_node_on_a_file() {
    let h = harness();
    h.svc
        .node_stage_volume(Request::new(stage_req(block_cap())))
        .await
        .expect("stage");
    let target = format!("{K}/plugins/kubernetes.io/csi/volumeDevices/publish/pv1/pod-uid");
    let mut r = publish_req(block_cap(), false);
    r.target_path = target.clone();
    h.svc
        .node_publish_volume(Request::new(r))
        .await
        .expect("publish");
    let calls = h.os.calls();
    assert!(calls.contains(&Call::MakeFile(target.clone().into())));
    assert!(
        calls
            .iter()
            .any(|c| matches!(c, Call::Bind(b) if b.source == Path::new(DEV)))
    );
    h.svc
        .node_unpublish_volume(Request::new(unpublish_req(&target)))
        .await
        .expect("unpublish");
    assert!(!h.os.exists(&target));
}

#[tokio::test]
async fn second_target_follows_the_access_mode_table() {
    let other = format!("{K}/pods/p2/volumes/kubernetes.io~csi/pv1/mount");
    // (mode, first publication read-only, second read-only, answer to the second)
    for (mode, first_ro, second_ro, want) in [
        (
            Mode::SingleNodeWriter,
            false,
            false,
            Code::FailedPrecondition,
        ),
        (Mode::SingleNodeWriter, false, true, Code::Ok),
        (Mode::SingleNodeWriter, true, false, Code::Ok),
        (Mode::SingleNodeWriter, true, true, Code::Ok),
        (
            Mode::SingleNodeSingleWriter,
            false,
            true,
            Code::FailedPrecondition,
        ),
        (
            Mode::SingleNodeSingleWriter,
            false,
            false,
            Code::FailedPrecondition,
        ),
        (
            Mode::SingleNodeReaderOnly,
            true,
            true,
            Code::FailedPrecondition,
        ),
        (Mode::SingleNodeMultiWriter, false, false, Code::Ok),
        (Mode::MultiNodeReaderOnly, true, true, Code::Ok),
    ] {
        let h = harness();
        h.os.add_dir(Path::new(&other).parent().unwrap_or(Path::new("/")));
        // Reader modes never format: the device holds a filesystem already.
        for (offset, bytes) in superblock("ext4") {
            h.os.write_device(DEV, offset, &bytes);
        }
        let cap = mount_cap("ext4", &[], mode);
        h.svc
            .node_stage_volume(Request::new(stage_req(cap.clone())))
            .await
            .expect("stage");
        h.svc
            .node_publish_volume(Request::new(publish_req(cap.clone(), first_ro)))
            .await
            .expect("first");
        let mut r = publish_req(cap, second_ro);
        r.target_path = other.clone();
        assert_eq!(
            code(h.svc.node_publish_volume(Request::new(r))).await,
            want,
            "{mode:?} first ro {first_ro} second ro {second_ro}"
        );
    }
}

// ---- NodeUnpublishVolume / NodeUnstageVolume ----

#[tokio::test]
async fn unpublish_unmounts_removes_and_is_idempotent() {
    let h = harness();
    staged(&h).await;
    h.svc
        .node_publish_volume(Request::new(publish_req(ext4(), false)))
        .await
        .expect("publish");
    for _ in 0..2 {
        h.svc
            .node_unpublish_volume(Request::new(unpublish_req(TARGET)))
            .await
            .expect("unpublish");
        assert_eq!(h.os.mount_depth(TARGET), 0);
        assert!(!h.os.exists(TARGET));
    }
    // A target that never existed is already unpublished.
    h.svc
        .node_unpublish_volume(Request::new(unpublish_req(&format!("{K}/pods/none/mount"))))
        .await
        .expect("never published");
    assert_eq!(
        code(h.svc.node_unpublish_volume(Request::new(unpublish_req("")))).await,
        Code::InvalidArgument
    );
}

#[tokio::test]
async fn corrupted_and_stacked_targets_are_cleaned() {
    let h = harness();
    staged(&h).await;
    h.svc
        .node_publish_volume(Request::new(publish_req(ext4(), false)))
        .await
        .expect("publish");
    h.os.corrupt(TARGET, libc::ENOTCONN);
    h.svc
        .node_unpublish_volume(Request::new(unpublish_req(TARGET)))
        .await
        .expect("unpublish");
    assert!(h.os.calls().contains(&Call::Unmount(TARGET.into(), true)));
    assert!(!h.os.exists(TARGET));
    // Two mounts stacked on one target (someone else's doing) are all peeled off.
    h.svc
        .node_publish_volume(Request::new(publish_req(ext4(), false)))
        .await
        .expect("publish");
    h.engine
        .os()
        .bind(&crate::sys::BindMount {
            source: STAGING.into(),
            target: TARGET.into(),
            attrs: Default::default(),
        })
        .expect("stack");
    h.svc
        .node_unpublish_volume(Request::new(unpublish_req(TARGET)))
        .await
        .expect("unpublish");
    assert_eq!(h.os.mount_depth(TARGET), 0);
}

#[tokio::test]
async fn unstage_while_published_fails_then_succeeds() {
    let h = harness();
    staged(&h).await;
    h.svc
        .node_publish_volume(Request::new(publish_req(ext4(), false)))
        .await
        .expect("publish");
    assert_eq!(
        code(h.svc.node_unstage_volume(Request::new(unstage_req()))).await,
        Code::FailedPrecondition
    );
    assert_eq!(h.os.mount_depth(STAGING), 1);
    h.svc
        .node_unpublish_volume(Request::new(unpublish_req(TARGET)))
        .await
        .expect("unpublish");
    for _ in 0..2 {
        h.svc
            .node_unstage_volume(Request::new(unstage_req()))
            .await
            .expect("unstage");
        assert_eq!(h.os.mount_depth(STAGING), 0);
    }
    assert!(h.engine.journal().get("vol-1").is_none());
    // Stage again: the filesystem is there, no mkfs.
    h.os.clear_calls();
    staged(&h).await;
    assert_eq!(mkfs_calls(&h), 0);
}

#[tokio::test]
async fn unstage_of_a_corrupted_staging_mount_detaches_it() {
    let h = harness();
    staged(&h).await;
    h.os.corrupt(STAGING, libc::EIO);
    h.svc
        .node_unstage_volume(Request::new(unstage_req()))
        .await
        .expect("unstage");
    assert!(h.os.calls().contains(&Call::Unmount(STAGING.into(), true)));
}

// ---- NodeGetVolumeStats ----

#[tokio::test]
async fn stats_report_usage_and_condition() {
    let h = harness();
    staged(&h).await;
    h.svc
        .node_publish_volume(Request::new(publish_req(ext4(), false)))
        .await
        .expect("publish");
    let r = h
        .svc
        .node_get_volume_stats(Request::new(stats_req(TARGET)))
        .await
        .expect("stats")
        .into_inner();
    assert_eq!(r.usage.len(), 2);
    assert_eq!(r.usage[0].total, GIB as i64);
    assert!(!r.volume_condition.expect("condition").abnormal);
    // Unmounted behind moor's back: abnormal, with a message.
    h.os.force_unmount(TARGET);
    let r = h
        .svc
        .node_get_volume_stats(Request::new(stats_req(TARGET)))
        .await
        .expect("stats")
        .into_inner();
    let c = r.volume_condition.expect("condition");
    assert!(c.abnormal && c.message.contains("not mounted"), "{c:?}");
    // Corrupted: abnormal.
    h.os.corrupt(STAGING, libc::ENOTCONN);
    let r = h
        .svc
        .node_get_volume_stats(Request::new(stats_req(STAGING)))
        .await
        .expect("stats")
        .into_inner();
    assert!(r.volume_condition.expect("condition").abnormal);
    // Unknown path: NOT_FOUND. Missing fields: INVALID_ARGUMENT.
    assert_eq!(
        code(
            h.svc
                .node_get_volume_stats(Request::new(stats_req(&format!("{K}/pods/x/mount"))))
        )
        .await,
        Code::NotFound
    );
    assert_eq!(
        code(h.svc.node_get_volume_stats(Request::new(stats_req("")))).await,
        Code::InvalidArgument
    );
}

#[tokio::test]
async fn stats_see_a_vanished_device() {
    let h = harness();
    staged(&h).await;
    h.os.remove_device(DEV);
    let r = h
        .svc
        .node_get_volume_stats(Request::new(stats_req(STAGING)))
        .await
        .expect("stats")
        .into_inner();
    let c = r.volume_condition.expect("condition");
    assert!(c.abnormal && c.message.contains("gone"), "{c:?}");
}

#[tokio::test]
async fn block_stats_report_the_device_size() {
    let h = harness();
    h.svc
        .node_stage_volume(Request::new(stage_req(block_cap())))
        .await
        .expect("stage");
    let r = h
        .svc
        .node_get_volume_stats(Request::new(stats_req(STAGING)))
        .await
        .expect("stats")
        .into_inner();
    assert_eq!(r.usage.len(), 1);
    assert_eq!(r.usage[0].total, GIB as i64);
}

// ---- NodeExpandVolume ----

fn expand_req(path: &str, required: i64) -> csi::NodeExpandVolumeRequest {
    csi::NodeExpandVolumeRequest {
        volume_id: "vol-1".into(),
        volume_path: path.into(),
        capacity_range: Some(csi::CapacityRange {
            required_bytes: required,
            limit_bytes: 0,
        }),
        staging_target_path: STAGING.into(),
        volume_capability: None,
        secrets: HashMap::new(),
    }
}

#[tokio::test]
async fn expand_grows_the_filesystem_with_its_tool() {
    let h = harness();
    h.svc
        .node_stage_volume(Request::new(stage_req(mount_cap(
            "xfs",
            &[],
            Mode::SingleNodeWriter,
        ))))
        .await
        .expect("stage");
    h.os.resize_device(DEV, 2 * GIB);
    let r = h
        .svc
        .node_expand_volume(Request::new(expand_req(STAGING, 2 * GIB as i64)))
        .await
        .expect("expand");
    assert_eq!(r.into_inner().capacity_bytes, 2 * GIB as i64);
    assert!(
        h.os.calls()
            .contains(&Call::Tool("xfs_growfs".into(), vec![STAGING.into()]))
    );
}

#[tokio::test]
async fn expand_error_rows() {
    let h = harness();
    assert_eq!(
        code(
            h.svc
                .node_expand_volume(Request::new(expand_req(STAGING, 0)))
        )
        .await,
        Code::NotFound
    );
    staged(&h).await;
    // Unsupported capacity: the device is smaller than asked.
    assert_eq!(
        code(
            h.svc
                .node_expand_volume(Request::new(expand_req(STAGING, 2 * GIB as i64)))
        )
        .await,
        Code::OutOfRange
    );
    assert_eq!(
        code(h.svc.node_expand_volume(Request::new(expand_req("", 0)))).await,
        Code::InvalidArgument
    );
    assert_eq!(
        code(
            h.svc
                .node_expand_volume(Request::new(expand_req(STAGING, -1)))
        )
        .await,
        Code::InvalidArgument
    );
    // Exceeds capabilities: a block capability for a filesystem volume.
    let mut r = expand_req(STAGING, 0);
    r.volume_capability = Some(block_cap());
    assert_eq!(
        code(h.svc.node_expand_volume(Request::new(r))).await,
        Code::InvalidArgument
    );
}

#[tokio::test]
async fn expand_past_limit_bytes_is_out_of_range_and_grows_nothing() {
    let h = harness();
    staged(&h).await;
    h.os.resize_device(DEV, 2 * GIB);
    h.os.clear_calls();
    let mut r = expand_req(STAGING, GIB as i64);
    r.capacity_range = Some(csi::CapacityRange {
        required_bytes: GIB as i64,
        limit_bytes: GIB as i64,
    });
    assert_eq!(
        code(h.svc.node_expand_volume(Request::new(r))).await,
        Code::OutOfRange
    );
    assert_eq!(tool_calls(&h), vec![]);
}

#[tokio::test]
async fn block_expand_needs_no_tool() {
    let h = harness();
    h.svc
        .node_stage_volume(Request::new(stage_req(block_cap())))
        .await
        .expect("stage");
    h.os.resize_device(DEV, 3 * GIB);
    let r = h
        .svc
        .node_expand_volume(Request::new(expand_req(STAGING, 0)))
        .await
        .expect("expand");
    assert_eq!(r.into_inner().capacity_bytes, 3 * GIB as i64);
    assert_eq!(count(&h.os.calls(), |c| matches!(c, Call::Tool(..))), 0);
}

#[tokio::test]
async fn stats_and_expand_at_a_path_no_volume_can_be_at_are_not_found() {
    let h = harness();
    staged(&h).await;
    h.svc
        .node_publish_volume(Request::new(publish_req(ext4(), false)))
        .await
        .expect("publish");
    h.os.clear_calls();
    // Relative (csi-sanity's "some/path"), not clean, or outside the kubelet dir: the volume
    // cannot be there, whether or not it exists elsewhere on the node.
    let nowhere = [
        "some/path".to_string(),
        "pods/p1/volumes/kubernetes.io~csi/pv1/mount".to_string(),
        format!("{TARGET}/."),
        format!("{K}/pods/../pods/p1/volumes/kubernetes.io~csi/pv1/mount"),
        format!("{K}//pods/p1"),
        "/tmp/x".to_string(),
        "/".to_string(),
        K.to_string(),
    ];
    for volume in ["vol-1", "vol-unknown"] {
        for p in &nowhere {
            let mut r = stats_req(p);
            r.volume_id = volume.into();
            let e = h
                .svc
                .node_get_volume_stats(Request::new(r))
                .await
                .expect_err("nowhere");
            assert_eq!(e.code(), Code::NotFound, "stats {volume} {p:?}: {e:?}");
            assert!(e.message().contains("volume_path"), "{}", e.message());
            let mut r = expand_req(p, 0);
            r.volume_id = volume.into();
            let e = h
                .svc
                .node_expand_volume(Request::new(r))
                .await
                .expect_err("nowhere");
            assert_eq!(e.code(), Code::NotFound, "expand {volume} {p:?}: {e:?}");
            assert!(e.message().contains("volume_path"), "{}", e.message());
        }
    }
    assert!(mutating_calls(&h).is_empty(), "{:?}", mutating_calls(&h));
    // A missing or malformed field stays INVALID_ARGUMENT, also beside such a path.
    for p in ["", "a\0b"] {
        assert_eq!(
            code(h.svc.node_get_volume_stats(Request::new(stats_req(p)))).await,
            Code::InvalidArgument,
            "{p:?}"
        );
        assert_eq!(
            code(h.svc.node_expand_volume(Request::new(expand_req(p, 0)))).await,
            Code::InvalidArgument,
            "{p:?}"
        );
    }
    let mut r = stats_req("some/path");
    r.volume_id = String::new();
    assert_eq!(
        code(h.svc.node_get_volume_stats(Request::new(r))).await,
        Code::InvalidArgument
    );
    assert_eq!(
        code(
            h.svc
                .node_expand_volume(Request::new(expand_req("some/path", -1)))
        )
        .await,
        Code::InvalidArgument
    );
    // The volume is still where it is, and answers there.
    h.svc
        .node_get_volume_stats(Request::new(stats_req(TARGET)))
        .await
        .expect("stats at the real path");
}

// ---- calls naming another volume's path ----

#[tokio::test]
async fn unstage_at_a_path_the_volume_is_not_staged_at_is_ok_and_touches_nothing() {
    let h = harness();
    staged(&h).await;
    h.os.clear_calls();
    let mut r = unstage_req();
    r.staging_target_path = format!("{K}/plugins/kubernetes.io/csi/moor.csi.io/other/globalmount");
    h.svc
        .node_unstage_volume(Request::new(r))
        .await
        .expect("the spec's answer: OK");
    assert!(mutating_calls(&h).is_empty(), "{:?}", mutating_calls(&h));
    assert_eq!(h.os.mount_depth(STAGING), 1);
    assert!(
        h.engine
            .journal()
            .get("vol-1")
            .is_some_and(|r| r.stage.is_some())
    );
}

#[tokio::test]
async fn calls_for_another_volume_never_reach_this_ones_mounts() {
    let h = harness();
    staged(&h).await;
    h.svc
        .node_publish_volume(Request::new(publish_req(ext4(), false)))
        .await
        .expect("publish");
    h.os.clear_calls();
    // vol-2 has no record: its calls name vol-1's paths.
    for p in [TARGET, STAGING] {
        let mut r = stats_req(p);
        r.volume_id = "vol-2".into();
        assert_eq!(
            code(h.svc.node_get_volume_stats(Request::new(r))).await,
            Code::NotFound,
            "{p}"
        );
    }
    let mut r = unpublish_req(TARGET);
    r.volume_id = "vol-2".into();
    h.svc
        .node_unpublish_volume(Request::new(r))
        .await
        .expect("nothing of vol-2's there: OK");
    let mut r = unstage_req();
    r.volume_id = "vol-2".into();
    h.svc
        .node_unstage_volume(Request::new(r))
        .await
        .expect("nothing of vol-2's there: OK");
    assert!(mutating_calls(&h).is_empty(), "{:?}", mutating_calls(&h));
    assert_eq!(h.os.mount_depth(TARGET), 1);
    assert_eq!(h.os.mount_depth(STAGING), 1);
}

// ---- NodeGetCapabilities / NodeGetInfo ----

#[tokio::test]
async fn capabilities_and_info() {
    use csi::node_service_capability::{Type, rpc};
    let h = harness();
    let caps = h
        .svc
        .node_get_capabilities(Request::new(csi::NodeGetCapabilitiesRequest {}))
        .await
        .expect("caps")
        .into_inner();
    let got: Vec<i32> = caps
        .capabilities
        .iter()
        .filter_map(|c| match &c.r#type {
            Some(Type::Rpc(r)) => Some(r.r#type),
            _ => None,
        })
        .collect();
    for want in [
        rpc::Type::StageUnstageVolume,
        rpc::Type::GetVolumeStats,
        rpc::Type::ExpandVolume,
        rpc::Type::VolumeCondition,
        rpc::Type::SingleNodeMultiWriter,
        rpc::Type::VolumeMountGroup,
    ] {
        assert!(got.contains(&(want as i32)), "{want:?}");
    }
    let info = h
        .svc
        .node_get_info(Request::new(csi::NodeGetInfoRequest {}))
        .await
        .expect("info")
        .into_inner();
    assert_eq!(info.node_id, "node-1");
    let topo = info.accessible_topology.expect("topology");
    assert_eq!(
        topo.segments
            .get("topology.moor.csi.io/node")
            .map(String::as_str),
        Some("node-1")
    );
}

// ---- Probe readiness ----

#[test]
fn probe_is_not_ready_without_a_required_tool_or_a_usable_state_dir() {
    let h = harness();
    assert_eq!(crate::service::readiness(h.os.as_ref(), &h.state), None);
    h.os.remove_program("mkfs.ext4");
    let reason = crate::service::readiness(h.os.as_ref(), &h.state).expect("not ready");
    assert!(reason.contains("mkfs.ext4"), "{reason}");
    let os = FakeOs::new();
    let reason =
        crate::service::readiness(&os, Path::new("/nonexistent/moor-state")).expect("not ready");
    assert!(reason.contains("state dir"), "{reason}");
}

#[tokio::test]
async fn probe_answers_failed_precondition_when_a_required_tool_is_missing() {
    use csi::identity_server::Identity as _;
    let h = harness();
    let identity = crate::service::IdentityService::new(h.info.clone(), Arc::clone(&h.os));
    let r = identity
        .probe(Request::new(csi::ProbeRequest {}))
        .await
        .expect("healthy");
    assert_eq!(r.into_inner().ready, Some(true));
    h.os.remove_program("resize2fs");
    let e = identity
        .probe(Request::new(csi::ProbeRequest {}))
        .await
        .expect_err("a missing required dependency");
    assert_eq!(e.code(), Code::FailedPrecondition);
    assert!(e.message().contains("resize2fs"), "{}", e.message());
    // The same capabilities as the controller's, whichever services this instance serves.
    let caps = identity
        .get_plugin_capabilities(Request::new(csi::GetPluginCapabilitiesRequest {}))
        .await
        .expect("capabilities")
        .into_inner()
        .capabilities;
    assert_eq!(caps, crate::service::plugin_capabilities());
    assert_eq!(caps.len(), 3);
}

#[tokio::test]
async fn plugin_info_names_the_node_and_its_state_dir() {
    use csi::identity_server::Identity as _;
    let h = harness();
    let identity = crate::service::IdentityService::new(h.info.clone(), Arc::clone(&h.os));
    let info = identity
        .get_plugin_info(Request::new(csi::GetPluginInfoRequest {}))
        .await
        .expect("info")
        .into_inner();
    assert_eq!(info.name, h.info.driver_name);
    assert_eq!(
        info.manifest,
        HashMap::from([
            ("component".to_string(), "node".to_string()),
            (
                "state_dir".to_string(),
                h.info.state_dir.display().to_string()
            ),
        ])
    );
}

// ---- Hostile input ----

/// A secret value no log line, error or metric may contain.
const SECRET_MARKER: &str = "s3cr3t-m4rk3r-7f1c";

fn secrets() -> HashMap<String, String> {
    HashMap::from([
        ("password".to_string(), SECRET_MARKER.to_string()),
        (SECRET_MARKER.to_string(), "key-is-secret-too".to_string()),
    ])
}

/// Everything the service asked of the OS (the fake records only calls that change it).
fn mutating_calls(h: &Harness) -> Vec<Call> {
    h.os.calls()
}

#[tokio::test]
async fn oversized_secrets_are_refused_naming_the_field_without_quoting_them() {
    let h = harness();
    let big = HashMap::from([(
        "k".to_string(),
        format!("{SECRET_MARKER}{}", "v".repeat(5000)),
    )]);
    let mut stage = stage_req(ext4());
    stage.secrets = big.clone();
    let e = h
        .svc
        .node_stage_volume(Request::new(stage))
        .await
        .expect_err("oversized secrets");
    assert_eq!(e.code(), Code::InvalidArgument);
    assert!(e.message().contains("secrets"), "{}", e.message());
    assert!(!e.message().contains(SECRET_MARKER));
    let mut publish = publish_req(ext4(), false);
    publish.secrets = big.clone();
    let e = h
        .svc
        .node_publish_volume(Request::new(publish))
        .await
        .expect_err("oversized secrets");
    assert_eq!(e.code(), Code::InvalidArgument);
    assert!(!e.message().contains(SECRET_MARKER));
    let mut expand = expand_req(TARGET, 0);
    expand.secrets = big;
    let e = h
        .svc
        .node_expand_volume(Request::new(expand))
        .await
        .expect_err("oversized secrets");
    assert_eq!(e.code(), Code::InvalidArgument);
    assert!(mutating_calls(&h).is_empty(), "{:?}", mutating_calls(&h));
}

#[tokio::test]
async fn errors_never_quote_secrets() {
    let h = harness();
    // Refused for every reason the validator has, each request carrying secrets.
    let mut reqs = Vec::new();
    for (field, value) in [
        ("volume_id", ""),
        ("staging", "relative"),
        ("staging", "/etc/x"),
        ("fs", "vfat"),
        ("flag", "bind"),
        ("device", "/etc/passwd"),
    ] {
        let mut r = stage_req(ext4());
        match field {
            "volume_id" => r.volume_id = value.into(),
            "staging" => r.staging_target_path = value.into(),
            "fs" => r.volume_capability = Some(mount_cap(value, &[], Mode::SingleNodeWriter)),
            "flag" => {
                r.volume_capability = Some(mount_cap("ext4", &[value], Mode::SingleNodeWriter))
            }
            _ => {
                r.publish_context
                    .insert(crate::validate::DEVICE_PATH_KEY.into(), value.into());
            }
        }
        r.secrets = secrets();
        reqs.push(r);
    }
    for r in reqs {
        let e = h
            .svc
            .node_stage_volume(Request::new(r))
            .await
            .expect_err("refused");
        assert_eq!(e.code(), Code::InvalidArgument, "{}", e.message());
        assert!(!e.message().contains(SECRET_MARKER), "{}", e.message());
    }
    let mut p = publish_req(ext4(), false);
    p.target_path = "/etc".into();
    p.secrets = secrets();
    let e = h
        .svc
        .node_publish_volume(Request::new(p))
        .await
        .expect_err("refused");
    assert!(!e.message().contains(SECRET_MARKER));
    // A publish that fails after validation (nothing staged) does not quote them either.
    let mut p = publish_req(ext4(), false);
    p.secrets = secrets();
    let e = h
        .svc
        .node_publish_volume(Request::new(p))
        .await
        .expect_err("not staged");
    assert!(!e.message().contains(SECRET_MARKER), "{}", e.message());
    assert!(mutating_calls(&h).is_empty(), "{:?}", mutating_calls(&h));
}

#[tokio::test]
async fn path_escapes_are_refused_before_the_os_is_touched() {
    let h = harness();
    let escapes = [
        format!("{K}/../../etc"),
        format!("{K}/pods/../../../etc"),
        format!("{K}/pods/./x"),
        format!("{K}//pods"),
        format!("{K}/pods/"),
        format!("{K}/pods\0/x"),
        format!("{K}-other/pods/x"),
        K.to_string(),
        "/".to_string(),
        "pods/x".to_string(),
        format!("{K}/{}", "a/".repeat(2100)),
    ];
    for p in &escapes {
        let mut r = stage_req(ext4());
        r.staging_target_path = p.clone();
        let e = h
            .svc
            .node_stage_volume(Request::new(r))
            .await
            .expect_err("escape");
        assert_eq!(e.code(), Code::InvalidArgument, "{p:?}");
        assert!(
            e.message().contains("staging_target_path"),
            "{}",
            e.message()
        );
        let mut r = publish_req(ext4(), false);
        r.target_path = p.clone();
        let e = h
            .svc
            .node_publish_volume(Request::new(r))
            .await
            .expect_err("escape");
        assert_eq!(e.code(), Code::InvalidArgument, "{p:?}");
        assert!(e.message().contains("target_path"), "{}", e.message());
        let e = h
            .svc
            .node_unpublish_volume(Request::new(unpublish_req(p)))
            .await
            .expect_err("escape");
        assert_eq!(e.code(), Code::InvalidArgument, "{p:?}");
        let mut r = unstage_req();
        r.staging_target_path = p.clone();
        let e = h
            .svc
            .node_unstage_volume(Request::new(r))
            .await
            .expect_err("escape");
        assert_eq!(e.code(), Code::InvalidArgument, "{p:?}");
        // No volume can be staged or published at such a path: NOT_FOUND, unless the string
        // cannot be a path at all.
        let want = if p.contains('\0') || p.len() > 4096 {
            Code::InvalidArgument
        } else {
            Code::NotFound
        };
        let e = h
            .svc
            .node_get_volume_stats(Request::new(stats_req(p)))
            .await
            .expect_err("escape");
        assert_eq!(e.code(), want, "{p:?}");
        let e = h
            .svc
            .node_expand_volume(Request::new(expand_req(p, 0)))
            .await
            .expect_err("escape");
        assert_eq!(e.code(), want, "{p:?}");
    }
    assert!(mutating_calls(&h).is_empty(), "{:?}", mutating_calls(&h));
}
