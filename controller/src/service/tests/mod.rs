//! The Controller service's error rows, RPC by RPC (one file each), over the embedded backend
//! on a temporary data dir with the fake attacher; the harness is here.

mod concurrency;
mod create_volume;
mod delete_volume;
mod expand_volume;
mod get_capabilities;
mod get_capacity;
mod get_volume;
mod groups;
mod list_volumes;
mod metadata;
mod modify_volume;
mod node_local;
mod provisioning;
mod publish;
mod snapshots;
mod unpublish;
mod validate_capabilities;

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use csi::controller_server::Controller as _;
use csi::volume_capability::{AccessMode, AccessType, BlockVolume, MountVolume, access_mode::Mode};
use moor_proto::csi::v1 as csi;
use moor_runtime::contract::{BACKING_FILE_KEY, DEVICE_PATH_KEY};
use tonic::{Code, Request, Status};

use super::ControllerService;
use crate::embedded::attach::Attacher as _;
use crate::embedded::fake::{FakeAttacher, FakeFailure};
use crate::embedded::testdir::TestDir;
use crate::embedded::{Config, EmbeddedBackend, Policy};

const MIB: i64 = 1 << 20;
const GIB: i64 = 1 << 30;
const NODE: &str = "node-1";
const KEY: &str = "topology.moor.csi.io/node";

type Backend = EmbeddedBackend<Arc<FakeAttacher>>;

struct Fx {
    // Dropped last: the backend holds the data dir's lock.
    svc: ControllerService<Backend>,
    backend: Arc<Backend>,
    fake: Arc<FakeAttacher>,
    dir: TestDir,
}

impl Fx {
    fn new(tag: &str) -> Self {
        let dir = TestDir::new(tag);
        let fake = Arc::new(FakeAttacher::new());
        Self::open(dir, fake, NODE)
    }

    /// A backend serving its data dir with `policy`.
    fn with_policy(tag: &str, policy: Policy) -> Self {
        Self::open_with(
            TestDir::new(tag),
            Arc::new(FakeAttacher::new()),
            NODE,
            policy,
        )
    }

    fn open(dir: TestDir, fake: Arc<FakeAttacher>, node: &str) -> Self {
        Self::open_with(dir, fake, node, Policy::default())
    }

    fn open_with(dir: TestDir, fake: Arc<FakeAttacher>, node: &str, policy: Policy) -> Self {
        let node_local = policy.node_local;
        let (backend, _) = EmbeddedBackend::open(
            Config {
                data_dir: dir.path().join("data"),
                node_id: node.into(),
                topology_key: KEY.into(),
            },
            Arc::clone(&fake),
        )
        .unwrap();
        let backend = Arc::new(backend.with_policy(policy));
        Self {
            svc: ControllerService::new(Arc::clone(&backend)).node_local(node_local),
            backend,
            fake,
            dir,
        }
    }

    /// Restarts the backend on the same data dir, as another node.
    fn reopen_as(self, node: &str) -> Self {
        let Fx {
            svc,
            backend,
            fake,
            dir,
        } = self;
        drop(svc);
        drop(backend);
        Self::open(dir, fake, node)
    }

    /// A volume's data file (named by the bare id, without a node-local id's `@<node>`).
    fn volume_path(&self, id: &str) -> std::path::PathBuf {
        let bare = id.split('@').next().unwrap_or(id);
        self.backend.layout().volumes.join(format!("{bare}.img"))
    }

    /// Writes into a volume's file, as a workload would through its device.
    fn write_at(&self, volume: &str, offset: u64, data: &[u8]) {
        use std::os::unix::fs::FileExt as _;
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(self.volume_path(volume))
            .unwrap();
        f.write_all_at(data, offset).unwrap();
    }

    async fn create(&self, name: &str, bytes: i64) -> csi::Volume {
        self.created(create_req(name, bytes)).await
    }

    /// The volume CreateVolume answers `r` with; panics on an error.
    async fn created(&self, r: csi::CreateVolumeRequest) -> csi::Volume {
        self.svc
            .create_volume(Request::new(r))
            .await
            .unwrap()
            .into_inner()
            .volume
            .unwrap()
    }

    async fn publish(&self, id: &str) -> Result<HashMap<String, String>, Status> {
        self.svc
            .controller_publish_volume(Request::new(publish_req(id, NODE)))
            .await
            .map(|r| r.into_inner().publish_context)
    }

    async fn snapshot(&self, name: &str, source: &str) -> Result<csi::Snapshot, Status> {
        self.svc
            .create_snapshot(Request::new(csi::CreateSnapshotRequest {
                source_volume_id: source.into(),
                name: name.into(),
                ..Default::default()
            }))
            .await
            .map(|r| r.into_inner().snapshot.unwrap())
    }
}

fn mount_cap() -> csi::VolumeCapability {
    cap(Mode::SingleNodeWriter, false)
}

fn cap(mode: Mode, block: bool) -> csi::VolumeCapability {
    csi::VolumeCapability {
        access_mode: Some(AccessMode { mode: mode as i32 }),
        access_type: Some(if block {
            AccessType::Block(BlockVolume {})
        } else {
            AccessType::Mount(MountVolume::default())
        }),
    }
}

fn fs_cap(fs: &str) -> csi::VolumeCapability {
    csi::VolumeCapability {
        access_mode: Some(AccessMode {
            mode: Mode::SingleNodeWriter as i32,
        }),
        access_type: Some(AccessType::Mount(MountVolume {
            fs_type: fs.into(),
            ..Default::default()
        })),
    }
}

fn create_req(name: &str, bytes: i64) -> csi::CreateVolumeRequest {
    csi::CreateVolumeRequest {
        name: name.into(),
        capacity_range: (bytes > 0).then_some(csi::CapacityRange {
            required_bytes: bytes,
            limit_bytes: 0,
        }),
        volume_capabilities: vec![mount_cap()],
        ..Default::default()
    }
}

/// ControllerExpandVolume of `id` to at least `bytes`.
fn expand_req(id: &str, bytes: i64) -> csi::ControllerExpandVolumeRequest {
    csi::ControllerExpandVolumeRequest {
        volume_id: id.into(),
        capacity_range: Some(csi::CapacityRange {
            required_bytes: bytes,
            limit_bytes: 0,
        }),
        ..Default::default()
    }
}

/// The RPCs ControllerGetCapabilities announces.
async fn announced(fx: &Fx) -> Vec<csi::controller_service_capability::rpc::Type> {
    use csi::controller_service_capability::{Type, rpc};
    fx.svc
        .controller_get_capabilities(Request::new(csi::ControllerGetCapabilitiesRequest {}))
        .await
        .unwrap()
        .into_inner()
        .capabilities
        .iter()
        .filter_map(|c| match &c.r#type {
            Some(Type::Rpc(r)) => rpc::Type::try_from(r.r#type).ok(),
            None => None,
        })
        .collect()
}

fn publish_req(id: &str, node: &str) -> csi::ControllerPublishVolumeRequest {
    csi::ControllerPublishVolumeRequest {
        volume_id: id.into(),
        node_id: node.into(),
        volume_capability: Some(mount_cap()),
        ..Default::default()
    }
}

fn topo(node: &str) -> csi::Topology {
    csi::Topology {
        segments: HashMap::from([(KEY.to_string(), node.to_string())]),
    }
}

#[track_caller]
fn assert_code<T: std::fmt::Debug>(r: Result<T, Status>, code: Code) -> Status {
    match r {
        Ok(v) => panic!("expected {code:?}, got Ok({v:?})"),
        Err(s) => {
            assert_eq!(s.code(), code, "{}", s.message());
            s
        }
    }
}

#[track_caller]
fn assert_invalid<T: std::fmt::Debug>(r: Result<T, Status>, field: &str) {
    let s = assert_code(r, Code::InvalidArgument);
    assert!(
        s.message().contains(field),
        "message {:?} does not name {field}",
        s.message()
    );
}
