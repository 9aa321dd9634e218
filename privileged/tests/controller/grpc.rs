//! The controller's gRPC services over a real Unix socket: the publish context reaches a client.

use std::sync::Arc;
use std::time::Duration;

use moor_runtime::contract::{BACKING_FILE_KEY, DEVICE_PATH_KEY};

use crate::fixture::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_publish_context_over_a_socket() {
    use csi::volume_capability::{AccessMode as CsiMode, AccessType as CsiType, MountVolume};
    use moor_controller::identity::IdentityService;
    use moor_controller::service::ControllerService;
    use moor_proto::csi::v1 as csi;

    let fx = Fixture::new("grpc");
    let backend = Arc::clone(fx.backend.as_ref().expect("backend"));
    let socket = fx.dir.join("csi.sock");
    let listener = moor_runtime::server::bind_unix(&socket).expect("bind");
    let router = tonic::transport::Server::builder()
        .add_service(csi::identity_server::IdentityServer::new(
            IdentityService::new("moor.csi.io", Arc::clone(&backend)),
        ))
        .add_service(csi::controller_server::ControllerServer::new(
            ControllerService::new(Arc::clone(&backend)),
        ));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let path = socket.clone();
    let server = tokio::spawn(async move {
        moor_runtime::server::serve(
            router,
            listener,
            &path,
            async {
                let _ = stopped.await;
            },
            Duration::from_secs(5),
        )
        .await
    });
    let channel = moor_runtime::client::connect(&socket)
        .await
        .expect("connect");
    let mut c = csi::controller_client::ControllerClient::new(channel);
    let cap = csi::VolumeCapability {
        access_mode: Some(CsiMode {
            mode: csi::volume_capability::access_mode::Mode::SingleNodeWriter as i32,
        }),
        access_type: Some(CsiType::Mount(MountVolume::default())),
    };
    let vol = c
        .create_volume(csi::CreateVolumeRequest {
            name: "pvc-grpc".into(),
            capacity_range: Some(csi::CapacityRange {
                required_bytes: 8 << 20,
                limit_bytes: 0,
            }),
            volume_capabilities: vec![cap.clone()],
            ..Default::default()
        })
        .await
        .expect("create")
        .into_inner()
        .volume
        .expect("volume");
    let ctx = c
        .controller_publish_volume(csi::ControllerPublishVolumeRequest {
            volume_id: vol.volume_id.clone(),
            node_id: NODE.into(),
            volume_capability: Some(cap.clone()),
            ..Default::default()
        })
        .await
        .expect("publish")
        .into_inner()
        .publish_context;
    // What the node checks before it trusts the device.
    assert_eq!(
        sysfs_backing(&ctx[DEVICE_PATH_KEY]).as_deref(),
        Some(ctx[BACKING_FILE_KEY].as_str())
    );
    let grown = c
        .controller_expand_volume(csi::ControllerExpandVolumeRequest {
            volume_id: vol.volume_id.clone(),
            capacity_range: Some(csi::CapacityRange {
                required_bytes: 16 << 20,
                limit_bytes: 0,
            }),
            volume_capability: Some(cap),
            ..Default::default()
        })
        .await
        .expect("expand")
        .into_inner();
    assert!(grown.node_expansion_required);
    assert_eq!(device_size(&ctx[DEVICE_PATH_KEY]), 16 * MIB);
    c.controller_unpublish_volume(csi::ControllerUnpublishVolumeRequest {
        volume_id: vol.volume_id.clone(),
        node_id: NODE.into(),
        ..Default::default()
    })
    .await
    .expect("unpublish");
    c.delete_volume(csi::DeleteVolumeRequest {
        volume_id: vol.volume_id,
        ..Default::default()
    })
    .await
    .expect("delete");
    assert!(wait_unbound(&ctx[DEVICE_PATH_KEY], &fx.dir));
    let _ = stop.send(());
    server.await.expect("join").expect("serve");
    assert!(!socket.exists());
}
