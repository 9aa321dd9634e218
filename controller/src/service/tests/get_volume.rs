//! ControllerGetVolume.

use super::*;

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
