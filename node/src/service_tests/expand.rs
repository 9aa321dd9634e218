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
    // The device is smaller than asked: it has not seen the controller's growth yet.
    assert_eq!(
        code(
            h.svc
                .node_expand_volume(Request::new(expand_req(STAGING, 2 * GIB as i64)))
        )
        .await,
        Code::Unavailable
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

/// What kubelet and csi-resizer take as infeasible.
fn infeasible(code: Code) -> bool {
    moor_runtime::contract::INFEASIBLE_EXPANSION.contains(&code)
}

#[tokio::test]
async fn every_expand_error_says_infeasible_or_retry_and_a_retry_or_a_smaller_ask_recovers() {
    let h = harness();
    staged(&h).await;
    let expand = |r: csi::NodeExpandVolumeRequest| async {
        code(h.svc.node_expand_volume(Request::new(r))).await
    };
    let with = |f: &dyn Fn(&mut csi::NodeExpandVolumeRequest)| {
        let mut r = expand_req(STAGING, 2 * GIB as i64);
        f(&mut r);
        r
    };
    // (what, the request, its code): the request's own faults and a volume that is not here
    // are infeasible; what the node or time can change is retried.
    let rows: Vec<(&str, csi::NodeExpandVolumeRequest, Code)> = vec![
        (
            "unknown volume",
            with(&|r| r.volume_id = "vol-9".into()),
            Code::NotFound,
        ),
        (
            "no volume path",
            with(&|r| r.volume_path.clear()),
            Code::InvalidArgument,
        ),
        (
            "negative size",
            with(&|r| r.capacity_range.as_mut().unwrap().required_bytes = -1),
            Code::InvalidArgument,
        ),
        (
            "another staging path",
            with(&|r| r.staging_target_path = format!("{K}/plugins/x/globalmount")),
            Code::InvalidArgument,
        ),
        (
            "a block capability for a filesystem",
            with(&|r| r.volume_capability = Some(block_cap())),
            Code::InvalidArgument,
        ),
        (
            "the device has not grown yet",
            expand_req(STAGING, 2 * GIB as i64),
            Code::Unavailable,
        ),
    ];
    for (what, r, want) in rows {
        assert_eq!(expand(r).await, want, "{what}");
    }
    // The controller's growth reaches the device: the same call, retried, works.
    h.os.resize_device(DEV, 2 * GIB);
    assert_eq!(expand(expand_req(STAGING, 2 * GIB as i64)).await, Code::Ok);
    // A limit below what the volume holds: infeasible, nothing grown; the user's smaller ask
    // after it works on the same volume.
    h.os.resize_device(DEV, 4 * GIB);
    let over = with(&|r| {
        r.capacity_range = Some(csi::CapacityRange {
            required_bytes: 3 * GIB as i64,
            limit_bytes: 3 * GIB as i64,
        })
    });
    let c = expand(over).await;
    assert!(infeasible(c), "{c:?}");
    assert_eq!(expand(expand_req(STAGING, 4 * GIB as i64)).await, Code::Ok);
    // The grow tool fails: retried, and the retry works.
    h.os.resize_device(DEV, 5 * GIB);
    h.os.fail_tool("resize2fs", 1);
    let c = expand(expand_req(STAGING, 5 * GIB as i64)).await;
    assert!(!infeasible(c), "{c:?}");
    assert_eq!(expand(expand_req(STAGING, 5 * GIB as i64)).await, Code::Ok);
    // Staged read-only: FAILED_PRECONDITION, which kubelet retries (offline).
    let h = harness();
    for (offset, bytes) in superblock("ext4") {
        h.os.write_device(DEV, offset, &bytes);
    }
    let ro = stage_req(mount_cap("ext4", &[], Mode::SingleNodeReaderOnly));
    h.svc
        .node_stage_volume(Request::new(ro))
        .await
        .expect("stage read-only");
    h.os.resize_device(DEV, 2 * GIB);
    let c = code(
        h.svc
            .node_expand_volume(Request::new(expand_req(STAGING, 2 * GIB as i64))),
    )
    .await;
    assert_eq!(c, Code::FailedPrecondition);
}
