//! The Node RPCs through the gRPC service layer, on the fake OS: every row of the spec's error
//! tables, idempotency, and what is (and is not) done to the node.
//!
//! One file to an RPC (`stage`, `publish`, `stats`, `expand`, `identity`), with the stage's
//! device and filesystem apart (`device`, `format`), and the calls at another volume's paths
//! (`paths`), encrypted volumes (`encryption`), hostile input (`hostile`) and the calls after a reboot against what the journal
//! kept of the boot before (`reboot`) across RPCs; here is the harness they share.

mod device;
mod encryption;
mod encryption_sources;
mod expand;
mod format;
mod health;
mod hostile;
mod identity;
mod local;
mod paths;
mod publish;
mod qos;
pub(crate) mod rbd;
mod reboot;
mod rotation;
mod rotation_tpm2;
mod stage;
mod stats;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use csi::volume_capability::{AccessMode, AccessType, BlockVolume, MountVolume, access_mode::Mode};
use moor_proto::csi::v1 as csi;
use moor_proto::csi::v1::node_server::Node;
use tonic::{Code, Request};

use crate::engine::{Engine, EngineConfig};
use crate::journal::{self, Boot, Journal};
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
    node(max_volumes, &Boot::default(), b"")
}

/// Where the tests on the fake OS keep their journals: a tmpfs (`/dev/shm`) where there is
/// one, else the temp dir. These tests check the engine's calls into the fake, not the disk
/// (the journal's own tests and the power-cut tests keep theirs on a real filesystem), and a
/// real disk's fsyncs were most of their time: the fault injection over every OS call of a
/// volume's life took 34 s on the temp dir and 7 s on the tmpfs.
pub(crate) fn scratch_root() -> std::path::PathBuf {
    let shm = Path::new("/dev/shm");
    let writable = rustix::fs::access(shm, rustix::fs::Access::WRITE_OK).is_ok();
    if shm.is_dir() && writable {
        shm.to_path_buf()
    } else {
        std::env::temp_dir()
    }
}

/// A node in `boot` (taking `max_volumes`) whose journal log holds `log`: nothing mounted, DEV
/// blank.
pub(crate) fn node(max_volumes: u64, boot: &Boot, log: &[u8]) -> Harness {
    static N: AtomicU32 = AtomicU32::new(0);
    let state = scratch_root().join(format!(
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
    std::fs::create_dir_all(&state).expect("state dir");
    std::fs::write(state.join(journal::LOG_FILE), log).expect("log");
    let (journal, _) = Journal::open(&state, false).expect("journal");
    let cfg = EngineConfig {
        kubelet_dir: K.into(),
        max_volumes,
        boot: boot.clone(),
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

pub(crate) fn mount_cap(fs: &str, flags: &[&str], mode: Mode) -> csi::VolumeCapability {
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

pub(crate) fn unpublish_req(target: &str) -> csi::NodeUnpublishVolumeRequest {
    csi::NodeUnpublishVolumeRequest {
        volume_id: "vol-1".into(),
        target_path: target.into(),
    }
}

pub(crate) fn unstage_req() -> csi::NodeUnstageVolumeRequest {
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

/// Asserts that `said` holds each of `words`, in their order: a first cause before the
/// failures of its cleanups.
pub(crate) fn in_order(said: &str, words: &[&str]) {
    let mut from = 0;
    for w in words {
        match said[from..].find(w) {
            Some(at) => from += at + w.len(),
            None => panic!("{w:?} not after the words before it in: {said}"),
        }
    }
}

pub(crate) async fn staged(h: &Harness) {
    h.svc
        .node_stage_volume(Request::new(stage_req(ext4())))
        .await
        .expect("stage");
}

/// Staged, then published read-write at [`TARGET`].
pub(crate) async fn published(h: &Harness) {
    staged(h).await;
    h.svc
        .node_publish_volume(Request::new(publish_req(ext4(), false)))
        .await
        .expect("publish");
}

fn tool_calls(h: &Harness) -> Vec<Call> {
    h.os.calls()
        .into_iter()
        .filter(|c| matches!(c, Call::Tool(..)))
        .collect()
}

/// NodeStageVolume of DEV as xfs with `mode`.
async fn stage_xfs(h: &Harness, mode: Mode) -> Result<(), tonic::Status> {
    h.svc
        .node_stage_volume(Request::new(stage_req(mount_cap("xfs", &[], mode))))
        .await
        .map(drop)
}

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

/// Everything the service asked of the OS (the fake records only calls that change it).
fn mutating_calls(h: &Harness) -> Vec<Call> {
    h.os.calls()
}

/// One of kubelet's calls for the harness's volume (ext4, single-node writer, published at
/// TARGET), as the life-long suites (power cuts, fault injection) replay them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum KubeletCall {
    Stage,
    Publish,
    Stats,
    Expand,
    Unpublish,
    Unstage,
}

/// Makes `call` on `svc`; its answer, without the response.
pub(crate) async fn kubelet_call<O: crate::sys::Os>(
    svc: &NodeService<O>,
    call: KubeletCall,
) -> Result<(), tonic::Status> {
    match call {
        KubeletCall::Stage => svc
            .node_stage_volume(Request::new(stage_req(ext4())))
            .await
            .map(drop),
        KubeletCall::Publish => svc
            .node_publish_volume(Request::new(publish_req(ext4(), false)))
            .await
            .map(drop),
        KubeletCall::Stats => svc
            .node_get_volume_stats(Request::new(stats_req(TARGET)))
            .await
            .map(drop),
        KubeletCall::Expand => svc
            .node_expand_volume(Request::new(csi::NodeExpandVolumeRequest {
                volume_id: "vol-1".into(),
                volume_path: TARGET.into(),
                ..Default::default()
            }))
            .await
            .map(drop),
        KubeletCall::Unpublish => svc
            .node_unpublish_volume(Request::new(unpublish_req(TARGET)))
            .await
            .map(drop),
        KubeletCall::Unstage => svc
            .node_unstage_volume(Request::new(unstage_req()))
            .await
            .map(drop),
    }
}
