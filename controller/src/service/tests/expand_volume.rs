//! ControllerExpandVolume.

use super::*;

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
