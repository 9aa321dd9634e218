//! ControllerUnpublishVolume.

use super::*;

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
