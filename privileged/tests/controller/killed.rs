//! A controller killed with SIGKILL in the middle of its work loses nothing: run as a child
//! process of this test binary, killed, and started again on the same data dir.

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use moor_controller::embedded::attach::{Attacher as _, LoopAttacher};
use moor_controller::embedded::{Config, EmbeddedBackend};
use moor_privileged::client::DEADLINE;
use moor_runtime::contract::{BACKING_FILE_KEY, DEVICE_PATH_KEY};

use crate::fixture::*;

/// Env var that turns [`controller_child_process`] into a controller serving that dir.
const CHILD_DIR_ENV: &str = "MOOR_CONTROLLER_TEST_CHILD_DIR";

/// Not a test of its own: when [`CHILD_DIR_ENV`] is set (by
/// [`killed_controller_loses_nothing`], which runs this test binary again as a child), it is a
/// controller process serving `<dir>/csi.sock` on `<dir>/data` until it is killed.
#[test]
fn controller_child_process() {
    use moor_controller::identity::IdentityService;
    use moor_controller::service::ControllerService;
    use moor_proto::csi::v1 as csi;
    let Ok(dir) = std::env::var(CHILD_DIR_ENV) else {
        return;
    };
    let dir = PathBuf::from(dir);
    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    runtime.block_on(async move {
        let (backend, report) = EmbeddedBackend::open(
            Config {
                data_dir: dir.join("data"),
                node_id: NODE.into(),
                topology_key: "topology.moor.csi.io/node".into(),
            },
            LoopAttacher::new(),
        )
        .expect("open backend");
        eprintln!("child controller: {report:?}");
        let backend = Arc::new(backend);
        let socket = dir.join("csi.sock");
        let listener = moor_runtime::server::bind_unix(&socket).expect("bind");
        let router = tonic::transport::Server::builder()
            .add_service(csi::identity_server::IdentityServer::new(
                IdentityService::new("moor.csi.io", Arc::clone(&backend)),
            ))
            .add_service(csi::controller_server::ControllerServer::new(
                ControllerService::new(backend),
            ));
        moor_runtime::server::serve(
            router,
            listener,
            &socket,
            std::future::pending(),
            Duration::from_secs(1),
        )
        .await
        .expect("serve");
    });
}

/// A controller child process, killed (SIGKILL) on drop if still running.
struct Child(moor_runtime::child::Guarded);

impl Child {
    async fn start(dir: &Path) -> (Self, tonic::transport::Channel) {
        let socket = dir.join("csi.sock");
        let _ = fs::remove_file(&socket);
        let mut child = moor_privileged::client::spawn_guarded(
            std::process::Command::new(std::env::current_exe().expect("test binary"))
                .args(["--exact", "killed::controller_child_process", "--nocapture"])
                .env(CHILD_DIR_ENV, dir)
                .stdin(std::process::Stdio::null())
                .stdout(std::process::Stdio::null()),
        );
        let channel = moor_runtime::client::wait_answering(&socket, DEADLINE, || {
            moor_runtime::client::exited(&mut child)
        })
        .await
        .unwrap_or_else(|e| panic!("the child controller: {e}"));
        (Self(child), channel)
    }

    fn kill(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Detaches every loop device bound to a file under `dir`, then removes `dir`.
struct DirGuard(PathBuf);

impl Drop for DirGuard {
    fn drop(&mut self) {
        let attacher = LoopAttacher::new();
        if let Ok(list) = attacher.list(&self.0) {
            for a in list {
                let _ = attacher.detach(&a.device, a.file);
            }
        }
        let _ = fs::remove_dir_all(&self.0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_controller_loses_nothing() {
    use csi::controller_client::ControllerClient;
    use moor_proto::csi::v1 as csi;
    moor_privileged::require_root();
    let guard = DirGuard(temp_dir("sigkill"));
    let dir = guard.0.clone();
    let ours = |dir: &Path| -> Vec<(PathBuf, String)> {
        loop_devices()
            .into_iter()
            .filter(|(_, b)| b.starts_with(dir.to_str().unwrap_or("/nonexistent")))
            .collect()
    };
    let cap = csi::VolumeCapability {
        access_mode: Some(csi::volume_capability::AccessMode {
            mode: csi::volume_capability::access_mode::Mode::SingleNodeWriter as i32,
        }),
        access_type: Some(csi::volume_capability::AccessType::Block(
            csi::volume_capability::BlockVolume {},
        )),
    };
    let create = |name: &str| csi::CreateVolumeRequest {
        name: name.into(),
        capacity_range: Some(csi::CapacityRange {
            required_bytes: 4 << 20,
            limit_bytes: 0,
        }),
        volume_capabilities: vec![cap.clone()],
        ..Default::default()
    };
    let publish = |id: &str| csi::ControllerPublishVolumeRequest {
        volume_id: id.into(),
        node_id: NODE.into(),
        volume_capability: Some(cap.clone()),
        ..Default::default()
    };

    let (mut child, ch) = Child::start(&dir).await;
    let mut c = ControllerClient::new(ch);
    let a = c
        .create_volume(create("pvc-a"))
        .await
        .expect("create a")
        .into_inner()
        .volume
        .expect("a");
    let b = c
        .create_volume(create("pvc-b"))
        .await
        .expect("create b")
        .into_inner()
        .volume
        .expect("b");
    let ctx = c
        .controller_publish_volume(publish(&a.volume_id))
        .await
        .expect("publish a")
        .into_inner()
        .publish_context;
    write_through(&ctx[DEVICE_PATH_KEY], &pattern(7)[..1]);
    child.kill();
    // The attach outlived the controller.
    assert_eq!(
        sysfs_backing(&ctx[DEVICE_PATH_KEY]).as_deref(),
        Some(ctx[BACKING_FILE_KEY].as_str())
    );

    let (mut child, ch) = Child::start(&dir).await;
    let mut c = ControllerClient::new(ch);
    let list = c
        .list_volumes(csi::ListVolumesRequest::default())
        .await
        .expect("list")
        .into_inner();
    assert_eq!(list.entries.len(), 2, "no volume lost");
    for e in &list.entries {
        let id = &e.volume.as_ref().expect("volume").volume_id;
        let nodes = &e.status.as_ref().expect("status").published_node_ids;
        assert_eq!(*nodes == vec![NODE.to_string()], *id == a.volume_id);
    }
    let again = c
        .controller_publish_volume(publish(&a.volume_id))
        .await
        .expect("publish a again")
        .into_inner()
        .publish_context;
    assert_eq!(again, ctx, "the same attach, recovered");
    assert_eq!(ours(&dir).len(), 1, "no device leaked");
    read_back(&ctx[DEVICE_PATH_KEY], &pattern(7)[..1]);
    let ctx_b = c
        .controller_publish_volume(publish(&b.volume_id))
        .await
        .expect("publish b")
        .into_inner()
        .publish_context;
    child.kill();

    let (mut child, ch) = Child::start(&dir).await;
    let mut c = ControllerClient::new(ch);
    assert_eq!(ours(&dir).len(), 2);
    for id in [&a.volume_id, &b.volume_id] {
        c.controller_unpublish_volume(csi::ControllerUnpublishVolumeRequest {
            volume_id: id.clone(),
            node_id: NODE.into(),
            ..Default::default()
        })
        .await
        .expect("unpublish");
        c.delete_volume(csi::DeleteVolumeRequest {
            volume_id: id.clone(),
            ..Default::default()
        })
        .await
        .expect("delete");
    }
    child.kill();
    assert!(wait_unbound(&ctx[DEVICE_PATH_KEY], &dir));
    assert!(wait_unbound(&ctx_b[DEVICE_PATH_KEY], &dir));
    assert!(ours(&dir).is_empty());
}
