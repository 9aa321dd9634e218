//! The Controller service's error rows, RPC by RPC, over the embedded backend on a temporary
//! data dir with the fake attacher.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use csi::controller_server::Controller as _;
use csi::volume_capability::{AccessMode, AccessType, BlockVolume, MountVolume, access_mode::Mode};
use moor_proto::csi::v1 as csi;
use tonic::{Code, Request, Status};

use super::ControllerService;
use crate::embedded::attach::Attacher as _;
use crate::embedded::fake::{FakeAttacher, FakeFailure};
use crate::embedded::testdir::TestDir;
use crate::embedded::{BACKING_FILE_KEY, Config, DEVICE_PATH_KEY, EmbeddedBackend};

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

    fn open(dir: TestDir, fake: Arc<FakeAttacher>, node: &str) -> Self {
        let (backend, _) = EmbeddedBackend::open(
            Config {
                data_dir: dir.path().join("data"),
                node_id: node.into(),
                topology_key: KEY.into(),
            },
            Arc::clone(&fake),
        )
        .unwrap();
        let backend = Arc::new(backend);
        Self {
            svc: ControllerService::new(Arc::clone(&backend)),
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

    fn volume_path(&self, id: &str) -> std::path::PathBuf {
        self.backend.layout().volumes.join(format!("{id}.img"))
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

// ---------------------------------------------------------------- CreateVolume

#[tokio::test]
async fn create_volume_required_fields() {
    let fx = Fx::new("svc-create-fields");
    let mut r = create_req("", GIB);
    assert_invalid(fx.svc.create_volume(Request::new(r.clone())).await, "name");
    r.name = "pvc-a".into();
    r.volume_capabilities.clear();
    assert_invalid(
        fx.svc.create_volume(Request::new(r.clone())).await,
        "volume_capabilities",
    );
    r.volume_capabilities = vec![csi::VolumeCapability {
        access_mode: None,
        access_type: Some(AccessType::Block(BlockVolume {})),
    }];
    assert_invalid(
        fx.svc.create_volume(Request::new(r.clone())).await,
        "volume_capabilities",
    );
    r.volume_capabilities = vec![cap(Mode::MultiNodeMultiWriter, true)];
    assert_invalid(
        fx.svc.create_volume(Request::new(r.clone())).await,
        "volume_capabilities",
    );
    r.volume_capabilities = vec![fs_cap("ntfs")];
    assert_invalid(
        fx.svc.create_volume(Request::new(r.clone())).await,
        "volume_capabilities",
    );
    r.volume_capabilities = vec![mount_cap()];
    r.capacity_range = Some(csi::CapacityRange {
        required_bytes: -1,
        limit_bytes: 0,
    });
    assert_invalid(
        fx.svc.create_volume(Request::new(r.clone())).await,
        "capacity_range",
    );
    r.capacity_range = None;
    r.mutable_parameters.insert("iops".into(), "5".into());
    assert_invalid(
        fx.svc.create_volume(Request::new(r.clone())).await,
        "mutable_parameters",
    );
    r.mutable_parameters.clear();
    r.name = "bad\u{7}name".into();
    assert_invalid(fx.svc.create_volume(Request::new(r)).await, "name");
    assert!(fx.fake.devices().is_empty());
}

#[tokio::test]
async fn create_volume_parameters() {
    let fx = Fx::new("svc-create-params");
    let with = |pairs: &[(&str, &str)]| {
        let mut r = create_req("pvc-p", MIB);
        for (k, v) in pairs {
            r.parameters.insert((*k).into(), (*v).into());
        }
        r
    };
    for bad in [
        vec![("type", "gp3")],
        vec![("fsType", "ntfs")],
        vec![("fsType", "xfs"), ("csi.storage.k8s.io/fstype", "ext4")],
    ] {
        assert_invalid(
            fx.svc.create_volume(Request::new(with(&bad))).await,
            "parameters",
        );
    }
    let ok = with(&[
        ("csi.storage.k8s.io/fstype", "xfs"),
        ("csi.storage.k8s.io/pvc/name", "claim"),
        ("csi.storage.k8s.io/pvc/namespace", "default"),
    ]);
    let v = fx.created(ok).await;
    assert_eq!(
        v.volume_context.get("fsType").map(String::as_str),
        Some("xfs")
    );
    // The same volume, asked for with the other spelling of the same parameter.
    let again = with(&[("fsType", "xfs")]);
    let v2 = fx.created(again).await;
    assert_eq!(v2.volume_id, v.volume_id);
    // A capability for another filesystem than the parameter names.
    let mut clash = with(&[("fsType", "xfs")]);
    clash.name = "pvc-q".into();
    clash.volume_capabilities = vec![fs_cap("ext4")];
    assert_invalid(
        fx.svc.create_volume(Request::new(clash)).await,
        "volume_capabilities",
    );
}

#[tokio::test]
async fn create_volume_sizes() {
    let fx = Fx::new("svc-create-sizes");
    let v = fx.create("pvc-default", 0).await;
    assert_eq!(v.capacity_bytes, GIB);
    assert!(v.volume_id.starts_with("vol-") && v.volume_id.len() == 20);
    let meta = std::fs::metadata(fx.volume_path(&v.volume_id)).unwrap();
    assert_eq!(meta.len() as i64, GIB);
    use std::os::unix::fs::MetadataExt as _;
    assert_eq!(meta.blocks(), 0, "a new volume is all hole");
    let v = fx.create("pvc-round", MIB + 1).await;
    assert_eq!(v.capacity_bytes, 2 * MIB);
    assert_eq!(
        v.accessible_topology,
        vec![topo(NODE)],
        "the single node segment"
    );
    let range = |required_bytes, limit_bytes| {
        let mut r = create_req("pvc-range", 0);
        r.capacity_range = Some(csi::CapacityRange {
            required_bytes,
            limit_bytes,
        });
        r
    };
    let v = fx.created(range(0, 10 * MIB)).await;
    assert_eq!(v.capacity_bytes, 10 * MIB);
    for (req, lim) in [(0, 1000), (2 * MIB, MIB), (1000, 1000), (i64::MAX, 0)] {
        let mut r = range(req, lim);
        r.name = format!("pvc-oor-{req}-{lim}");
        assert_code(
            fx.svc.create_volume(Request::new(r)).await,
            Code::OutOfRange,
        );
    }
}

#[tokio::test]
async fn create_volume_is_idempotent_by_name() {
    let fx = Fx::new("svc-create-idem");
    let a = fx.create("pvc-1", 10 * MIB).await;
    let b = fx.create("pvc-1", 10 * MIB).await;
    assert_eq!(a, b);
    // A range the existing volume satisfies is the same volume too.
    let c = fx.create("pvc-1", 5 * MIB).await;
    assert_eq!(c.volume_id, a.volume_id);
    let s = assert_code(
        fx.svc
            .create_volume(Request::new(create_req("pvc-1", 20 * MIB)))
            .await,
        Code::AlreadyExists,
    );
    assert!(s.message().contains(&a.volume_id));
    let mut r = create_req("pvc-1", 10 * MIB);
    r.parameters.insert("fsType".into(), "xfs".into());
    assert_code(
        fx.svc.create_volume(Request::new(r)).await,
        Code::AlreadyExists,
    );
    let mut r = create_req("pvc-1", 10 * MIB);
    r.volume_content_source = Some(csi::VolumeContentSource {
        r#type: Some(csi::volume_content_source::Type::Volume(
            csi::volume_content_source::VolumeSource {
                volume_id: a.volume_id.clone(),
            },
        )),
    });
    assert_code(
        fx.svc.create_volume(Request::new(r)).await,
        Code::AlreadyExists,
    );
    let mut r = create_req("pvc-1", 10 * MIB);
    r.accessibility_requirements = Some(csi::TopologyRequirement {
        requisite: vec![topo("node-2")],
        preferred: vec![],
    });
    assert_code(
        fx.svc.create_volume(Request::new(r)).await,
        Code::AlreadyExists,
    );
    let list = fx
        .svc
        .list_volumes(Request::new(csi::ListVolumesRequest::default()))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(list.entries.len(), 1);
}

#[tokio::test]
async fn create_volume_topology() {
    let fx = Fx::new("svc-create-topo");
    let mut r = create_req("pvc-t", MIB);
    r.accessibility_requirements = Some(csi::TopologyRequirement {
        requisite: vec![topo("node-2")],
        preferred: vec![topo("node-2")],
    });
    assert_code(
        fx.svc.create_volume(Request::new(r.clone())).await,
        Code::ResourceExhausted,
    );
    r.accessibility_requirements = Some(csi::TopologyRequirement {
        requisite: vec![topo("node-2"), topo(NODE)],
        preferred: vec![topo("node-2")],
    });
    let v = fx.created(r.clone()).await;
    assert_eq!(v.accessible_topology, vec![topo(NODE)]);
    // Preferred alone binds nothing.
    r.name = "pvc-t2".into();
    r.accessibility_requirements = Some(csi::TopologyRequirement {
        requisite: vec![],
        preferred: vec![topo("node-2")],
    });
    assert!(fx.svc.create_volume(Request::new(r.clone())).await.is_ok());
    // One requisite topology per node of a large cluster, ours among them.
    r.name = "pvc-t-many".into();
    let mut many: Vec<_> = (0..999).map(|i| topo(&format!("node-x{i}"))).collect();
    many.insert(500, topo(NODE));
    r.accessibility_requirements = Some(csi::TopologyRequirement {
        preferred: many.clone(),
        requisite: many,
    });
    let v = fx.created(r.clone()).await;
    assert_eq!(v.accessible_topology, vec![topo(NODE)]);
    r.name = "pvc-t3".into();
    r.accessibility_requirements = Some(csi::TopologyRequirement::default());
    assert_invalid(
        fx.svc.create_volume(Request::new(r)).await,
        "accessibility_requirements",
    );
}

#[tokio::test]
async fn create_volume_from_sources() {
    use std::os::unix::fs::FileExt as _;
    let fx = Fx::new("svc-create-src");
    let src = fx.create("pvc-src", 4 * MIB).await;
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(fx.volume_path(&src.volume_id))
        .unwrap();
    f.write_all_at(b"moor data", 3 * MIB as u64).unwrap();
    drop(f);
    let snap = fx.snapshot("snap-1", &src.volume_id).await.unwrap();
    assert!(snap.ready_to_use);
    assert_eq!(snap.size_bytes, 4 * MIB);
    let from = |name: &str, ty: csi::volume_content_source::Type, bytes| {
        let mut r = create_req(name, bytes);
        r.volume_content_source = Some(csi::VolumeContentSource { r#type: Some(ty) });
        r
    };
    let snap_src = |id: &str| {
        csi::volume_content_source::Type::Snapshot(csi::volume_content_source::SnapshotSource {
            snapshot_id: id.into(),
        })
    };
    let vol_src = |id: &str| {
        csi::volume_content_source::Type::Volume(csi::volume_content_source::VolumeSource {
            volume_id: id.into(),
        })
    };
    // Smaller than the source: the source's size. Larger: grown.
    let restored = fx
        .created(from("pvc-r", snap_src(&snap.snapshot_id), MIB))
        .await;
    assert_eq!(restored.capacity_bytes, 4 * MIB);
    assert!(restored.content_source.is_some());
    let clone = fx
        .created(from("pvc-c", vol_src(&src.volume_id), 8 * MIB))
        .await;
    assert_eq!(clone.capacity_bytes, 8 * MIB);
    for id in [&restored.volume_id, &clone.volume_id] {
        let f = std::fs::File::open(fx.volume_path(id)).unwrap();
        let mut b = [0u8; 9];
        f.read_exact_at(&mut b, 3 * MIB as u64).unwrap();
        assert_eq!(&b, b"moor data");
    }
    for missing in [
        snap_src("snap-00000000000000ff"),
        snap_src("some-snapshot"),
        vol_src("vol-00000000000000ff"),
        vol_src("../../etc/passwd"),
    ] {
        assert_code(
            fx.svc
                .create_volume(Request::new(from("pvc-missing", missing, MIB)))
                .await,
            Code::NotFound,
        );
    }
    // A limit below the source's size cannot be honoured.
    let mut r = from("pvc-small", snap_src(&snap.snapshot_id), 0);
    r.capacity_range = Some(csi::CapacityRange {
        required_bytes: 0,
        limit_bytes: 2 * MIB,
    });
    assert_code(
        fx.svc.create_volume(Request::new(r)).await,
        Code::OutOfRange,
    );
    assert_invalid(
        fx.svc
            .create_volume(Request::new(from("pvc-e", snap_src(""), MIB)))
            .await,
        "volume_content_source",
    );
}

// ---------------------------------------------------------------- DeleteVolume

#[tokio::test]
async fn delete_volume_rows() {
    let fx = Fx::new("svc-delete");
    assert_invalid(
        fx.svc
            .delete_volume(Request::new(csi::DeleteVolumeRequest::default()))
            .await,
        "volume_id",
    );
    for unknown in ["vol-00000000000000aa", "not-ours", "../../../etc"] {
        fx.svc
            .delete_volume(Request::new(csi::DeleteVolumeRequest {
                volume_id: unknown.into(),
                ..Default::default()
            }))
            .await
            .unwrap();
    }
    let v = fx.create("pvc-d", MIB).await;
    fx.publish(&v.volume_id).await.unwrap();
    let del = csi::DeleteVolumeRequest {
        volume_id: v.volume_id.clone(),
        ..Default::default()
    };
    let s = assert_code(
        fx.svc.delete_volume(Request::new(del.clone())).await,
        Code::FailedPrecondition,
    );
    assert!(s.message().contains(NODE));
    assert!(fx.volume_path(&v.volume_id).exists());
    // Unpublished, but the device is still held open by someone: still in use.
    let (dev, _) = fx.fake.devices().pop().unwrap();
    fx.fake.hold_open(&dev);
    fx.svc
        .controller_unpublish_volume(Request::new(csi::ControllerUnpublishVolumeRequest {
            volume_id: v.volume_id.clone(),
            ..Default::default()
        }))
        .await
        .unwrap();
    assert_code(
        fx.svc.delete_volume(Request::new(del.clone())).await,
        Code::FailedPrecondition,
    );
    fx.fake.remove(&dev);
    fx.svc
        .delete_volume(Request::new(del.clone()))
        .await
        .unwrap();
    assert!(!fx.volume_path(&v.volume_id).exists());
    fx.svc.delete_volume(Request::new(del)).await.unwrap();
    assert_code(
        fx.svc
            .controller_get_volume(Request::new(csi::ControllerGetVolumeRequest {
                volume_id: v.volume_id,
            }))
            .await,
        Code::NotFound,
    );
}

// ---------------------------------------------------------------- ControllerPublishVolume

#[tokio::test]
async fn publish_rows() {
    let fx = Fx::new("svc-publish");
    let v = fx.create("pvc-pub", MIB).await;
    let id = v.volume_id.as_str();
    let mut r = publish_req("", NODE);
    assert_invalid(
        fx.svc
            .controller_publish_volume(Request::new(r.clone()))
            .await,
        "volume_id",
    );
    r.volume_id = id.into();
    r.node_id.clear();
    assert_invalid(
        fx.svc
            .controller_publish_volume(Request::new(r.clone()))
            .await,
        "node_id",
    );
    r.node_id = NODE.into();
    r.volume_capability = None;
    assert_invalid(
        fx.svc
            .controller_publish_volume(Request::new(r.clone()))
            .await,
        "volume_capability",
    );
    r.volume_capability = Some(cap(Mode::MultiNodeReaderOnly, false));
    assert_invalid(
        fx.svc
            .controller_publish_volume(Request::new(r.clone()))
            .await,
        "volume_capability",
    );
    for missing in ["vol-00000000000000aa", "pvc-pub", "vol-/../../x"] {
        assert_code(fx.publish(missing).await, Code::NotFound);
    }
    assert_code(
        fx.svc
            .controller_publish_volume(Request::new(publish_req(id, "node-9")))
            .await,
        Code::NotFound,
    );
    assert!(fx.fake.devices().is_empty());

    let ctx = fx.publish(id).await.unwrap();
    let dev = &ctx[DEVICE_PATH_KEY];
    let backing = &ctx[BACKING_FILE_KEY];
    assert!(Path::new(backing).is_absolute());
    assert_eq!(Path::new(backing), fx.volume_path(id));
    assert_eq!(fx.fake.devices(), vec![(dev.into(), backing.into())]);
    assert_eq!(fx.fake.is_read_only(Path::new(dev)), Some(false));
    // Idempotent: the same context, no second device.
    assert_eq!(fx.publish(id).await.unwrap(), ctx);
    assert_eq!(fx.fake.devices().len(), 1);
    let mut ro = publish_req(id, NODE);
    ro.readonly = true;
    assert_code(
        fx.svc.controller_publish_volume(Request::new(ro)).await,
        Code::AlreadyExists,
    );
    // A volume_context that contradicts the volume's.
    let mut ctx_req = publish_req(id, NODE);
    ctx_req.volume_context.insert("fsType".into(), "xfs".into());
    // The volume has no fsType in its context: extra keys are tolerated.
    assert!(
        fx.svc
            .controller_publish_volume(Request::new(ctx_req))
            .await
            .is_ok()
    );

    // A volume_context that contradicts the volume's own.
    let mut r = create_req("pvc-ctx", MIB);
    r.parameters.insert("fsType".into(), "ext4".into());
    let with_ctx = fx.created(r).await;
    let mut bad_ctx = publish_req(&with_ctx.volume_id, NODE);
    bad_ctx.volume_context.insert("fsType".into(), "xfs".into());
    assert_invalid(
        fx.svc
            .controller_publish_volume(Request::new(bad_ctx))
            .await,
        "volume_context",
    );
    let mut good_ctx = publish_req(&with_ctx.volume_id, NODE);
    good_ctx.volume_context = with_ctx.volume_context.clone();
    assert!(
        fx.svc
            .controller_publish_volume(Request::new(good_ctx))
            .await
            .is_ok()
    );
    assert_eq!(fx.fake.devices().len(), 2);
    fx.svc
        .controller_unpublish_volume(Request::new(csi::ControllerUnpublishVolumeRequest {
            volume_id: with_ctx.volume_id,
            ..Default::default()
        }))
        .await
        .unwrap();

    // The device vanished behind our back: publishing again attaches anew.
    fx.fake.remove(Path::new(dev));
    let ctx2 = fx.publish(id).await.unwrap();
    assert_eq!(fx.fake.devices().len(), 1);
    assert_eq!(ctx2[BACKING_FILE_KEY], *backing);

    // Published at a node this controller no longer serves (restarted with another id).
    let fx = fx.reopen_as("node-2");
    let s = assert_code(
        fx.svc
            .controller_publish_volume(Request::new(publish_req(id, "node-2")))
            .await,
        Code::FailedPrecondition,
    );
    assert!(s.message().contains(NODE), "{}", s.message());
}

#[tokio::test]
async fn publish_failures_leave_nothing_published() {
    let fx = Fx::new("svc-publish-fail");
    let v = fx.create("pvc-f", MIB).await;
    for (failure, code) in [
        (FakeFailure::NoFreeDevice, Code::ResourceExhausted),
        (FakeFailure::Busy, Code::Unavailable),
        (FakeFailure::Io, Code::Internal),
    ] {
        fx.fake.fail_next_attach(failure);
        assert_code(fx.publish(&v.volume_id).await, code);
        let got = fx
            .svc
            .controller_get_volume(Request::new(csi::ControllerGetVolumeRequest {
                volume_id: v.volume_id.clone(),
            }))
            .await
            .unwrap()
            .into_inner();
        assert!(got.status.unwrap().published_node_ids.is_empty());
    }
    assert!(fx.fake.devices().is_empty());
    assert!(fx.publish(&v.volume_id).await.is_ok());
}

#[tokio::test]
async fn publish_readonly_attaches_read_only() {
    let fx = Fx::new("svc-publish-ro");
    let v = fx.create("pvc-ro", MIB).await;
    let mut r = publish_req(&v.volume_id, NODE);
    r.readonly = true;
    let ctx = fx
        .svc
        .controller_publish_volume(Request::new(r))
        .await
        .unwrap()
        .into_inner()
        .publish_context;
    assert_eq!(
        fx.fake.is_read_only(Path::new(&ctx[DEVICE_PATH_KEY])),
        Some(true)
    );
    assert_code(fx.publish(&v.volume_id).await, Code::AlreadyExists);
}

// ---------------------------------------------------------------- ControllerUnpublishVolume

#[tokio::test]
async fn unpublish_rows() {
    let fx = Fx::new("svc-unpublish");
    let unpub = |id: &str, node: &str| csi::ControllerUnpublishVolumeRequest {
        volume_id: id.into(),
        node_id: node.into(),
        ..Default::default()
    };
    assert_invalid(
        fx.svc
            .controller_unpublish_volume(Request::new(unpub("", NODE)))
            .await,
        "volume_id",
    );
    for unknown in ["vol-00000000000000aa", "whatever"] {
        fx.svc
            .controller_unpublish_volume(Request::new(unpub(unknown, NODE)))
            .await
            .unwrap();
    }
    let v = fx.create("pvc-u", MIB).await;
    fx.svc
        .controller_unpublish_volume(Request::new(unpub(&v.volume_id, NODE)))
        .await
        .unwrap();
    fx.publish(&v.volume_id).await.unwrap();
    // Another node: not published there, nothing to do.
    fx.svc
        .controller_unpublish_volume(Request::new(unpub(&v.volume_id, "node-7")))
        .await
        .unwrap();
    assert_eq!(fx.fake.devices().len(), 1);
    // No node: every node.
    fx.svc
        .controller_unpublish_volume(Request::new(unpub(&v.volume_id, "")))
        .await
        .unwrap();
    assert!(fx.fake.devices().is_empty());
    fx.svc
        .controller_unpublish_volume(Request::new(unpub(&v.volume_id, NODE)))
        .await
        .unwrap();
    // A device number reused by someone else is never detached.
    fx.publish(&v.volume_id).await.unwrap();
    let (dev, _) = fx.fake.devices().pop().unwrap();
    let other = fx.dir.path().join("someone-elses.img");
    std::fs::write(&other, b"x").unwrap();
    fx.fake.rebind(&dev, &other).unwrap();
    fx.svc
        .controller_unpublish_volume(Request::new(unpub(&v.volume_id, NODE)))
        .await
        .unwrap();
    assert_eq!(fx.fake.devices(), vec![(dev, other)]);
}

// ---------------------------------------------------------------- ValidateVolumeCapabilities

#[tokio::test]
async fn validate_capabilities_rows() {
    let fx = Fx::new("svc-validate");
    let mut r = create_req("pvc-v", MIB);
    r.parameters.insert("fsType".into(), "ext4".into());
    let v = fx.created(r).await;
    let req = |id: &str, caps: Vec<csi::VolumeCapability>| csi::ValidateVolumeCapabilitiesRequest {
        volume_id: id.into(),
        volume_capabilities: caps,
        ..Default::default()
    };
    assert_invalid(
        fx.svc
            .validate_volume_capabilities(Request::new(req("", vec![mount_cap()])))
            .await,
        "volume_id",
    );
    assert_invalid(
        fx.svc
            .validate_volume_capabilities(Request::new(req(&v.volume_id, vec![])))
            .await,
        "volume_capabilities",
    );
    assert_code(
        fx.svc
            .validate_volume_capabilities(Request::new(req(
                "vol-00000000000000aa",
                vec![mount_cap()],
            )))
            .await,
        Code::NotFound,
    );
    let ok = fx
        .svc
        .validate_volume_capabilities(Request::new(req(
            &v.volume_id,
            vec![
                mount_cap(),
                cap(Mode::SingleNodeMultiWriter, true),
                fs_cap("ext4"),
            ],
        )))
        .await
        .unwrap()
        .into_inner();
    let confirmed = ok.confirmed.unwrap();
    assert_eq!(confirmed.volume_capabilities.len(), 3);
    for unsupported in [cap(Mode::MultiNodeMultiWriter, true), fs_cap("xfs")] {
        let r = fx
            .svc
            .validate_volume_capabilities(Request::new(req(&v.volume_id, vec![unsupported])))
            .await
            .unwrap()
            .into_inner();
        assert!(r.confirmed.is_none());
        assert!(!r.message.is_empty());
    }
    let mut with_params = req(&v.volume_id, vec![mount_cap()]);
    with_params
        .parameters
        .insert("fsType".into(), "btrfs".into());
    let r = fx
        .svc
        .validate_volume_capabilities(Request::new(with_params.clone()))
        .await
        .unwrap()
        .into_inner();
    assert!(r.confirmed.is_none());
    with_params.parameters.insert("bogus".into(), "1".into());
    assert_invalid(
        fx.svc
            .validate_volume_capabilities(Request::new(with_params))
            .await,
        "parameters",
    );
    let mut with_ctx = req(&v.volume_id, vec![mount_cap()]);
    with_ctx.volume_context = v.volume_context.clone();
    let r = fx
        .svc
        .validate_volume_capabilities(Request::new(with_ctx.clone()))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.confirmed.unwrap().volume_context, v.volume_context);
    with_ctx.volume_context.insert("other".into(), "x".into());
    let r = fx
        .svc
        .validate_volume_capabilities(Request::new(with_ctx))
        .await
        .unwrap()
        .into_inner();
    assert!(r.confirmed.is_none());
}

// ---------------------------------------------------------------- ListVolumes

#[tokio::test]
async fn list_volumes_pages() {
    let fx = Fx::new("svc-list");
    let mut ids = Vec::new();
    for i in 0..5 {
        ids.push(fx.create(&format!("pvc-{i}"), MIB).await.volume_id);
    }
    ids.sort();
    fx.publish(&ids[1]).await.unwrap();
    let list = |max_entries, starting_token: &str| csi::ListVolumesRequest {
        max_entries,
        starting_token: starting_token.into(),
    };
    let mut seen = Vec::new();
    let mut token = String::new();
    loop {
        let page = fx
            .svc
            .list_volumes(Request::new(list(2, &token)))
            .await
            .unwrap()
            .into_inner();
        assert!(page.entries.len() <= 2);
        for e in &page.entries {
            let vol = e.volume.as_ref().unwrap();
            let status = e.status.as_ref().unwrap();
            let published = vol.volume_id == ids[1];
            assert_eq!(status.published_node_ids.len(), usize::from(published));
            assert!(!status.volume_condition.as_ref().unwrap().abnormal);
            seen.push(vol.volume_id.clone());
        }
        if page.next_token.is_empty() {
            break;
        }
        token = page.next_token;
    }
    assert_eq!(seen, ids);
    // The token names the next volume; deleting it does not invalidate the token.
    let first = fx
        .svc
        .list_volumes(Request::new(list(2, "")))
        .await
        .unwrap()
        .into_inner();
    let token = first.next_token;
    assert_eq!(token, ids[2]);
    fx.svc
        .delete_volume(Request::new(csi::DeleteVolumeRequest {
            volume_id: ids[2].clone(),
            ..Default::default()
        }))
        .await
        .unwrap();
    let next = fx
        .svc
        .list_volumes(Request::new(list(2, &token)))
        .await
        .unwrap()
        .into_inner();
    let got: Vec<_> = next
        .entries
        .iter()
        .map(|e| e.volume.as_ref().unwrap().volume_id.clone())
        .collect();
    assert_eq!(got, ids[3..5]);
    for bad in ["garbage", "vol-zz", "snap-0000000000000000"] {
        assert_code(
            fx.svc.list_volumes(Request::new(list(1, bad))).await,
            Code::Aborted,
        );
    }
    assert_invalid(
        fx.svc.list_volumes(Request::new(list(-1, ""))).await,
        "max_entries",
    );
    let all = fx
        .svc
        .list_volumes(Request::new(list(0, "")))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(all.entries.len(), 4);
    assert!(all.next_token.is_empty());
}

// ---------------------------------------------------------------- GetCapacity

#[tokio::test]
async fn get_capacity_rows() {
    let fx = Fx::new("svc-capacity");
    let get = |req| async { fx.svc.get_capacity(Request::new(req)).await };
    let all = get(csi::GetCapacityRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert!(all.available_capacity > 0);
    let here = get(csi::GetCapacityRequest {
        accessible_topology: Some(topo(NODE)),
        volume_capabilities: vec![mount_cap()],
        ..Default::default()
    })
    .await
    .unwrap()
    .into_inner();
    assert!(here.available_capacity > 0);
    assert_eq!(here.maximum_volume_size, Some(1 << 60));
    assert_eq!(here.minimum_volume_size, Some(MIB));
    // The advertised bounds are the real ones.
    for (name, required, limit, ok) in [
        ("pvc-cap-min", 0, MIB, true),
        ("pvc-cap-below-min", 0, MIB - 1, false),
        ("pvc-cap-max-plus", (1 << 60) + 1, 0, false),
    ] {
        let mut r = create_req(name, 0);
        r.capacity_range = Some(csi::CapacityRange {
            required_bytes: required,
            limit_bytes: limit,
        });
        let got = fx.svc.create_volume(Request::new(r)).await;
        if ok {
            assert_eq!(
                got.unwrap().into_inner().volume.unwrap().capacity_bytes,
                MIB
            );
        } else {
            assert_code(got, Code::OutOfRange);
        }
    }
    for zero in [
        csi::GetCapacityRequest {
            accessible_topology: Some(topo("node-2")),
            ..Default::default()
        },
        csi::GetCapacityRequest {
            volume_capabilities: vec![cap(Mode::MultiNodeMultiWriter, true)],
            ..Default::default()
        },
    ] {
        let none = get(zero).await.unwrap().into_inner();
        assert_eq!(none.available_capacity, 0);
        assert_eq!(none.maximum_volume_size, None);
        assert_eq!(none.minimum_volume_size, None);
    }
    let mut bad = csi::GetCapacityRequest::default();
    bad.parameters.insert("replicas".into(), "3".into());
    assert_invalid(get(bad).await, "parameters");
}

// ---------------------------------------------------------------- ControllerGetCapabilities

#[tokio::test]
async fn controller_capabilities() {
    use csi::controller_service_capability::{Type, rpc};
    let fx = Fx::new("svc-caps");
    let caps = fx
        .svc
        .controller_get_capabilities(Request::new(csi::ControllerGetCapabilitiesRequest {}))
        .await
        .unwrap()
        .into_inner()
        .capabilities;
    let types: Vec<rpc::Type> = caps
        .iter()
        .filter_map(|c| match &c.r#type {
            Some(Type::Rpc(r)) => rpc::Type::try_from(r.r#type).ok(),
            None => None,
        })
        .collect();
    assert_eq!(types.len(), 12);
    for t in [
        rpc::Type::CreateDeleteVolume,
        rpc::Type::PublishUnpublishVolume,
        rpc::Type::ListVolumes,
        rpc::Type::GetCapacity,
        rpc::Type::CreateDeleteSnapshot,
        rpc::Type::ListSnapshots,
        rpc::Type::CloneVolume,
        rpc::Type::ExpandVolume,
        rpc::Type::ListVolumesPublishedNodes,
        rpc::Type::VolumeCondition,
        rpc::Type::GetVolume,
        rpc::Type::SingleNodeMultiWriter,
    ] {
        assert!(types.contains(&t), "{t:?}");
    }
    assert!(!types.contains(&rpc::Type::ModifyVolume));
    assert!(!types.contains(&rpc::Type::PublishReadonly));
}

// ---------------------------------------------------------------- ControllerGetVolume

#[tokio::test]
async fn get_volume_condition() {
    let fx = Fx::new("svc-get");
    let get = |id: &str| {
        let req = csi::ControllerGetVolumeRequest {
            volume_id: id.into(),
        };
        async { fx.svc.controller_get_volume(Request::new(req)).await }
    };
    assert_invalid(get("").await, "volume_id");
    assert_code(get("vol-00000000000000aa").await, Code::NotFound);
    assert_code(get("foreign").await, Code::NotFound);
    let v = fx.create("pvc-g", MIB).await;
    let status = |r: csi::ControllerGetVolumeResponse| r.status.unwrap();
    let s = status(get(&v.volume_id).await.unwrap().into_inner());
    assert!(s.published_node_ids.is_empty());
    assert!(!s.volume_condition.unwrap().abnormal);
    let ctx = fx.publish(&v.volume_id).await.unwrap();
    let s = status(get(&v.volume_id).await.unwrap().into_inner());
    assert_eq!(s.published_node_ids, vec![NODE.to_string()]);
    assert!(!s.volume_condition.unwrap().abnormal);
    fx.fake.remove(Path::new(&ctx[DEVICE_PATH_KEY]));
    let c = status(get(&v.volume_id).await.unwrap().into_inner())
        .volume_condition
        .unwrap();
    assert!(c.abnormal);
    assert!(c.message.contains("gone"), "{}", c.message);
    std::fs::remove_file(fx.volume_path(&v.volume_id)).unwrap();
    let c = status(get(&v.volume_id).await.unwrap().into_inner())
        .volume_condition
        .unwrap();
    assert!(c.abnormal);
    assert!(c.message.contains("missing"), "{}", c.message);
}

// ---------------------------------------------------------------- Snapshots

#[tokio::test]
async fn create_snapshot_rows() {
    let fx = Fx::new("svc-snap");
    let v = fx.create("pvc-s", 2 * MIB).await;
    let w = fx.create("pvc-w", 2 * MIB).await;
    assert_invalid(fx.snapshot("", &v.volume_id).await, "name");
    assert_invalid(fx.snapshot("s1", "").await, "source_volume_id");
    assert_code(
        fx.snapshot("s1", "vol-00000000000000aa").await,
        Code::NotFound,
    );
    assert_code(fx.snapshot("s1", "nope").await, Code::NotFound);
    let a = fx.snapshot("s1", &v.volume_id).await.unwrap();
    assert!(a.snapshot_id.starts_with("snap-"));
    assert!(a.ready_to_use);
    assert!(a.creation_time.is_some());
    assert_eq!(a.source_volume_id, v.volume_id);
    assert_eq!(fx.snapshot("s1", &v.volume_id).await.unwrap(), a);
    assert_code(fx.snapshot("s1", &w.volume_id).await, Code::AlreadyExists);
    let mut bad = csi::CreateSnapshotRequest {
        source_volume_id: v.volume_id.clone(),
        name: "s2".into(),
        ..Default::default()
    };
    bad.parameters.insert("retention".into(), "7d".into());
    assert_invalid(
        fx.svc.create_snapshot(Request::new(bad.clone())).await,
        "parameters",
    );
    bad.parameters.clear();
    bad.parameters.insert(
        "csi.storage.k8s.io/volumesnapshot/name".into(),
        "snap".into(),
    );
    assert!(fx.svc.create_snapshot(Request::new(bad)).await.is_ok());
    // A snapshot of a published volume flushes its device first.
    fx.publish(&w.volume_id).await.unwrap();
    let before = fx.fake.flushes();
    fx.snapshot("s3", &w.volume_id).await.unwrap();
    assert_eq!(fx.fake.flushes(), before + 1);
    // Snapshots outlive their volume.
    fx.svc
        .delete_volume(Request::new(csi::DeleteVolumeRequest {
            volume_id: v.volume_id.clone(),
            ..Default::default()
        }))
        .await
        .unwrap();
    let got = fx
        .svc
        .get_snapshot(Request::new(csi::GetSnapshotRequest {
            snapshot_id: a.snapshot_id.clone(),
            ..Default::default()
        }))
        .await
        .unwrap()
        .into_inner()
        .snapshot
        .unwrap();
    assert_eq!(got, a);
}

#[tokio::test]
async fn delete_and_get_snapshot_rows() {
    let fx = Fx::new("svc-snap-del");
    let del = |id: &str| csi::DeleteSnapshotRequest {
        snapshot_id: id.into(),
        ..Default::default()
    };
    let get = |id: &str| csi::GetSnapshotRequest {
        snapshot_id: id.into(),
        ..Default::default()
    };
    assert_invalid(
        fx.svc.delete_snapshot(Request::new(del(""))).await,
        "snapshot_id",
    );
    assert_invalid(
        fx.svc.get_snapshot(Request::new(get(""))).await,
        "snapshot_id",
    );
    for unknown in ["snap-00000000000000aa", "x/../y"] {
        fx.svc
            .delete_snapshot(Request::new(del(unknown)))
            .await
            .unwrap();
        assert_code(
            fx.svc.get_snapshot(Request::new(get(unknown))).await,
            Code::NotFound,
        );
    }
    let v = fx.create("pvc-x", MIB).await;
    let s = fx.snapshot("s", &v.volume_id).await.unwrap();
    let file = fx
        .backend
        .layout()
        .snapshots
        .join(format!("{}.img", s.snapshot_id));
    assert!(file.exists());
    fx.svc
        .delete_snapshot(Request::new(del(&s.snapshot_id)))
        .await
        .unwrap();
    assert!(!file.exists());
    fx.svc
        .delete_snapshot(Request::new(del(&s.snapshot_id)))
        .await
        .unwrap();
    assert_code(
        fx.svc.get_snapshot(Request::new(get(&s.snapshot_id))).await,
        Code::NotFound,
    );
}

#[tokio::test]
async fn list_snapshots_filters_and_pages() {
    let fx = Fx::new("svc-snap-list");
    let a = fx.create("pvc-a", MIB).await.volume_id;
    let b = fx.create("pvc-b", MIB).await.volume_id;
    let mut of_a = Vec::new();
    for i in 0..3 {
        of_a.push(fx.snapshot(&format!("a{i}"), &a).await.unwrap().snapshot_id);
    }
    let of_b = fx.snapshot("b0", &b).await.unwrap().snapshot_id;
    of_a.sort();
    let list = |req: csi::ListSnapshotsRequest| async {
        fx.svc
            .list_snapshots(Request::new(req))
            .await
            .map(|r| r.into_inner())
    };
    let ids = |r: &csi::ListSnapshotsResponse| -> Vec<String> {
        r.entries
            .iter()
            .map(|e| e.snapshot.as_ref().unwrap().snapshot_id.clone())
            .collect()
    };
    let all = list(Default::default()).await.unwrap();
    assert_eq!(all.entries.len(), 4);
    let by_source = list(csi::ListSnapshotsRequest {
        source_volume_id: a.clone(),
        ..Default::default()
    })
    .await
    .unwrap();
    assert_eq!(ids(&by_source), of_a);
    let one = list(csi::ListSnapshotsRequest {
        snapshot_id: of_b.clone(),
        ..Default::default()
    })
    .await
    .unwrap();
    assert_eq!(ids(&one), vec![of_b.clone()]);
    for nothing in [
        csi::ListSnapshotsRequest {
            snapshot_id: "snap-00000000000000aa".into(),
            ..Default::default()
        },
        csi::ListSnapshotsRequest {
            snapshot_id: "not-ours".into(),
            ..Default::default()
        },
        csi::ListSnapshotsRequest {
            snapshot_id: of_b.clone(),
            source_volume_id: a.clone(),
            ..Default::default()
        },
        csi::ListSnapshotsRequest {
            source_volume_id: "vol-00000000000000aa".into(),
            ..Default::default()
        },
    ] {
        assert!(list(nothing).await.unwrap().entries.is_empty());
    }
    let mut got = Vec::new();
    let mut token = String::new();
    loop {
        let page = list(csi::ListSnapshotsRequest {
            source_volume_id: a.clone(),
            max_entries: 2,
            starting_token: token.clone(),
            ..Default::default()
        })
        .await
        .unwrap();
        got.extend(ids(&page));
        if page.next_token.is_empty() {
            break;
        }
        token = page.next_token;
    }
    assert_eq!(got, of_a);
    assert_code(
        list(csi::ListSnapshotsRequest {
            starting_token: "bogus".into(),
            ..Default::default()
        })
        .await,
        Code::Aborted,
    );
    assert_invalid(
        list(csi::ListSnapshotsRequest {
            max_entries: -5,
            ..Default::default()
        })
        .await,
        "max_entries",
    );
}

// ---------------------------------------------------------------- ControllerExpandVolume

#[tokio::test]
async fn expand_rows() {
    let fx = Fx::new("svc-expand");
    let v = fx.create("pvc-e", 4 * MIB).await;
    let req = |id: &str, required_bytes, limit_bytes, cap: Option<csi::VolumeCapability>| {
        csi::ControllerExpandVolumeRequest {
            volume_id: id.into(),
            capacity_range: Some(csi::CapacityRange {
                required_bytes,
                limit_bytes,
            }),
            volume_capability: cap,
            ..Default::default()
        }
    };
    let expand = |r| async { fx.svc.controller_expand_volume(Request::new(r)).await };
    assert_invalid(expand(req("", MIB, 0, None)).await, "volume_id");
    let mut no_range = req(&v.volume_id, MIB, 0, None);
    no_range.capacity_range = None;
    assert_invalid(expand(no_range).await, "capacity_range");
    assert_code(
        expand(req("vol-00000000000000aa", 8 * MIB, 0, None)).await,
        Code::NotFound,
    );
    assert_code(expand(req("alien", 8 * MIB, 0, None)).await, Code::NotFound);
    assert_invalid(
        expand(req(
            &v.volume_id,
            8 * MIB,
            0,
            Some(cap(Mode::MultiNodeMultiWriter, true)),
        ))
        .await,
        "volume_capability",
    );
    let r = expand(req(&v.volume_id, 8 * MIB - 5, 0, None))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.capacity_bytes, 8 * MIB);
    assert!(
        r.node_expansion_required,
        "no capability: maybe a filesystem"
    );
    assert_eq!(
        std::fs::metadata(fx.volume_path(&v.volume_id))
            .unwrap()
            .len() as i64,
        8 * MIB
    );
    // Never shrinks; smaller asks are already satisfied.
    let r = expand(req(
        &v.volume_id,
        2 * MIB,
        0,
        Some(cap(Mode::SingleNodeWriter, true)),
    ))
    .await
    .unwrap()
    .into_inner();
    assert_eq!(r.capacity_bytes, 8 * MIB);
    assert!(
        !r.node_expansion_required,
        "block volumes need no node step"
    );
    assert_code(
        expand(req(&v.volume_id, 2 * MIB, 4 * MIB, None)).await,
        Code::OutOfRange,
    );
    assert_code(
        expand(req(&v.volume_id, 16 * MIB, 12 * MIB, None)).await,
        Code::OutOfRange,
    );
    let r = expand(req(&v.volume_id, 16 * MIB, 0, Some(mount_cap())))
        .await
        .unwrap()
        .into_inner();
    assert!(r.node_expansion_required);
    // Published: the device is told its new size.
    let ctx = fx.publish(&v.volume_id).await.unwrap();
    let dev = Path::new(&ctx[DEVICE_PATH_KEY]).to_path_buf();
    expand(req(&v.volume_id, 32 * MIB, 0, None)).await.unwrap();
    assert_eq!(fx.fake.size_refreshes(&dev), 1);
    let got = fx
        .svc
        .controller_get_volume(Request::new(csi::ControllerGetVolumeRequest {
            volume_id: v.volume_id.clone(),
        }))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(got.volume.unwrap().capacity_bytes, 32 * MIB);
}

// ---------------------------------------------------------------- ControllerModifyVolume

#[tokio::test]
async fn modify_volume_is_unimplemented() {
    let fx = Fx::new("svc-modify");
    assert_code(
        fx.svc
            .controller_modify_volume(Request::new(csi::ControllerModifyVolumeRequest {
                volume_id: "vol-00000000000000aa".into(),
                ..Default::default()
            }))
            .await,
        Code::Unimplemented,
    );
}

// ---------------------------------------------------------------- Concurrency

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_publishes_of_many_volumes() {
    let fx = Arc::new(Fx::new("svc-concurrent"));
    let mut ids = Vec::new();
    for i in 0..8 {
        ids.push(fx.create(&format!("pvc-{i}"), MIB).await.volume_id);
    }
    let tasks: Vec<_> = ids
        .iter()
        .map(|id| {
            let fx = Arc::clone(&fx);
            let id = id.clone();
            tokio::spawn(async move { fx.publish(&id).await })
        })
        .collect();
    let mut devices = Vec::new();
    for t in tasks {
        devices.push(t.await.unwrap().unwrap()[DEVICE_PATH_KEY].clone());
    }
    devices.sort();
    devices.dedup();
    assert_eq!(devices.len(), 8);
    assert_eq!(fx.fake.devices().len(), 8);
    assert!(fx.fake.list().unwrap().iter().all(|a| !a.deleted));
}
