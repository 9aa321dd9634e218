//! ControllerPublishVolume.

use super::*;

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
