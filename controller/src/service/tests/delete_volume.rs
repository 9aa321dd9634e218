//! DeleteVolume.

use super::*;

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
