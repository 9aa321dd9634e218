//! Calls at a path that is not the volume's: nothing is touched, and another volume's mounts are never reached.

use super::*;

#[tokio::test]
async fn stats_and_expand_at_a_path_no_volume_can_be_at_are_not_found() {
    let h = harness();
    staged(&h).await;
    h.svc
        .node_publish_volume(Request::new(publish_req(ext4(), false)))
        .await
        .expect("publish");
    h.os.clear_calls();
    // Relative (csi-sanity's "some/path"), not clean, or outside the kubelet dir: the volume
    // cannot be there, whether or not it exists elsewhere on the node.
    let nowhere = [
        "some/path".to_string(),
        "pods/p1/volumes/kubernetes.io~csi/pv1/mount".to_string(),
        format!("{TARGET}/."),
        format!("{K}/pods/../pods/p1/volumes/kubernetes.io~csi/pv1/mount"),
        format!("{K}//pods/p1"),
        "/tmp/x".to_string(),
        "/".to_string(),
        K.to_string(),
    ];
    for volume in ["vol-1", "vol-unknown"] {
        for p in &nowhere {
            let mut r = stats_req(p);
            r.volume_id = volume.into();
            let e = h
                .svc
                .node_get_volume_stats(Request::new(r))
                .await
                .expect_err("nowhere");
            assert_eq!(e.code(), Code::NotFound, "stats {volume} {p:?}: {e:?}");
            assert!(e.message().contains("volume_path"), "{}", e.message());
            let mut r = expand_req(p, 0);
            r.volume_id = volume.into();
            let e = h
                .svc
                .node_expand_volume(Request::new(r))
                .await
                .expect_err("nowhere");
            assert_eq!(e.code(), Code::NotFound, "expand {volume} {p:?}: {e:?}");
            assert!(e.message().contains("volume_path"), "{}", e.message());
        }
    }
    assert!(mutating_calls(&h).is_empty(), "{:?}", mutating_calls(&h));
    // A missing or malformed field stays INVALID_ARGUMENT, also beside such a path.
    for p in ["", "a\0b"] {
        assert_eq!(
            code(h.svc.node_get_volume_stats(Request::new(stats_req(p)))).await,
            Code::InvalidArgument,
            "{p:?}"
        );
        assert_eq!(
            code(h.svc.node_expand_volume(Request::new(expand_req(p, 0)))).await,
            Code::InvalidArgument,
            "{p:?}"
        );
    }
    let mut r = stats_req("some/path");
    r.volume_id = String::new();
    assert_eq!(
        code(h.svc.node_get_volume_stats(Request::new(r))).await,
        Code::InvalidArgument
    );
    assert_eq!(
        code(
            h.svc
                .node_expand_volume(Request::new(expand_req("some/path", -1)))
        )
        .await,
        Code::InvalidArgument
    );
    // The volume is still where it is, and answers there.
    h.svc
        .node_get_volume_stats(Request::new(stats_req(TARGET)))
        .await
        .expect("stats at the real path");
}

#[tokio::test]
async fn unstage_at_a_path_the_volume_is_not_staged_at_is_ok_and_touches_nothing() {
    let h = harness();
    staged(&h).await;
    h.os.clear_calls();
    let mut r = unstage_req();
    r.staging_target_path = format!("{K}/plugins/kubernetes.io/csi/moor.csi.io/other/globalmount");
    h.svc
        .node_unstage_volume(Request::new(r))
        .await
        .expect("the spec's answer: OK");
    assert!(mutating_calls(&h).is_empty(), "{:?}", mutating_calls(&h));
    assert_eq!(h.os.mount_depth(STAGING), 1);
    assert!(
        h.engine
            .journal()
            .get("vol-1")
            .is_some_and(|r| r.stage.is_some())
    );
}

#[tokio::test]
async fn calls_for_another_volume_never_reach_this_ones_mounts() {
    let h = harness();
    staged(&h).await;
    h.svc
        .node_publish_volume(Request::new(publish_req(ext4(), false)))
        .await
        .expect("publish");
    h.os.clear_calls();
    // vol-2 has no record: its calls name vol-1's paths.
    for p in [TARGET, STAGING] {
        let mut r = stats_req(p);
        r.volume_id = "vol-2".into();
        assert_eq!(
            code(h.svc.node_get_volume_stats(Request::new(r))).await,
            Code::NotFound,
            "{p}"
        );
    }
    let mut r = unpublish_req(TARGET);
    r.volume_id = "vol-2".into();
    h.svc
        .node_unpublish_volume(Request::new(r))
        .await
        .expect("nothing of vol-2's there: OK");
    let mut r = unstage_req();
    r.volume_id = "vol-2".into();
    h.svc
        .node_unstage_volume(Request::new(r))
        .await
        .expect("nothing of vol-2's there: OK");
    assert!(mutating_calls(&h).is_empty(), "{:?}", mutating_calls(&h));
    assert_eq!(h.os.mount_depth(TARGET), 1);
    assert_eq!(h.os.mount_depth(STAGING), 1);
}
