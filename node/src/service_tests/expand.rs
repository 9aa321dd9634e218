//! NodeExpandVolume: growing with the filesystem's tool, the error rows, limits.

use super::*;

#[tokio::test]
async fn expand_grows_the_filesystem_with_its_tool() {
    let h = harness();
    h.svc
        .node_stage_volume(Request::new(stage_req(mount_cap(
            "xfs",
            &[],
            Mode::SingleNodeWriter,
        ))))
        .await
        .expect("stage");
    h.os.resize_device(DEV, 2 * GIB);
    let r = h
        .svc
        .node_expand_volume(Request::new(expand_req(STAGING, 2 * GIB as i64)))
        .await
        .expect("expand");
    assert_eq!(r.into_inner().capacity_bytes, 2 * GIB as i64);
    assert!(
        h.os.calls()
            .contains(&Call::Tool("xfs_growfs".into(), vec![STAGING.into()]))
    );
}

#[tokio::test]
async fn expand_error_rows() {
    let h = harness();
    assert_eq!(
        code(
            h.svc
                .node_expand_volume(Request::new(expand_req(STAGING, 0)))
        )
        .await,
        Code::NotFound
    );
    staged(&h).await;
    // Unsupported capacity: the device is smaller than asked.
    assert_eq!(
        code(
            h.svc
                .node_expand_volume(Request::new(expand_req(STAGING, 2 * GIB as i64)))
        )
        .await,
        Code::OutOfRange
    );
    assert_eq!(
        code(h.svc.node_expand_volume(Request::new(expand_req("", 0)))).await,
        Code::InvalidArgument
    );
    assert_eq!(
        code(
            h.svc
                .node_expand_volume(Request::new(expand_req(STAGING, -1)))
        )
        .await,
        Code::InvalidArgument
    );
    // Exceeds capabilities: a block capability for a filesystem volume.
    let mut r = expand_req(STAGING, 0);
    r.volume_capability = Some(block_cap());
    assert_eq!(
        code(h.svc.node_expand_volume(Request::new(r))).await,
        Code::InvalidArgument
    );
}

#[tokio::test]
async fn expand_past_limit_bytes_is_out_of_range_and_grows_nothing() {
    let h = harness();
    staged(&h).await;
    h.os.resize_device(DEV, 2 * GIB);
    h.os.clear_calls();
    let mut r = expand_req(STAGING, GIB as i64);
    r.capacity_range = Some(csi::CapacityRange {
        required_bytes: GIB as i64,
        limit_bytes: GIB as i64,
    });
    assert_eq!(
        code(h.svc.node_expand_volume(Request::new(r))).await,
        Code::OutOfRange
    );
    assert_eq!(tool_calls(&h), vec![]);
}

#[tokio::test]
async fn block_expand_needs_no_tool() {
    let h = harness();
    h.svc
        .node_stage_volume(Request::new(stage_req(block_cap())))
        .await
        .expect("stage");
    h.os.resize_device(DEV, 3 * GIB);
    let r = h
        .svc
        .node_expand_volume(Request::new(expand_req(STAGING, 0)))
        .await
        .expect("expand");
    assert_eq!(r.into_inner().capacity_bytes, 3 * GIB as i64);
    assert_eq!(count(&h.os.calls(), |c| matches!(c, Call::Tool(..))), 0);
}
