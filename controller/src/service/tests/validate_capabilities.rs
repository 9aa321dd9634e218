//! ValidateVolumeCapabilities.

use super::*;

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
