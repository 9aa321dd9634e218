//! GetMetadataAllocated and GetMetadataDelta: their error rows, the stream's shape (fixed-length
//! tuples, max_results, starting_offset), and the blocks they name.

use csi::snapshot_metadata_server::SnapshotMetadata as _;
use tokio_stream::StreamExt as _;

use super::*;

const BLOCK: i64 = 4096;

impl Fx {
    async fn allocated(
        &self,
        id: &str,
        start: i64,
        max: i32,
    ) -> Result<Vec<csi::GetMetadataAllocatedResponse>, Status> {
        let stream = self
            .svc
            .get_metadata_allocated(Request::new(csi::GetMetadataAllocatedRequest {
                snapshot_id: id.into(),
                starting_offset: start,
                max_results: max,
                ..Default::default()
            }))
            .await?
            .into_inner();
        stream.collect::<Result<Vec<_>, Status>>().await
    }

    async fn delta(
        &self,
        base: &str,
        target: &str,
        start: i64,
        max: i32,
    ) -> Result<Vec<csi::GetMetadataDeltaResponse>, Status> {
        let stream = self
            .svc
            .get_metadata_delta(Request::new(csi::GetMetadataDeltaRequest {
                base_snapshot_id: base.into(),
                target_snapshot_id: target.into(),
                starting_offset: start,
                max_results: max,
                ..Default::default()
            }))
            .await?
            .into_inner();
        stream.collect::<Result<Vec<_>, Status>>().await
    }
}

/// The tuples of a stream, checked for the spec's shape: one type (FIXED_LENGTH), one
/// capacity, fixed sizes, ascending and apart, at most `max` per message.
fn tuples(msgs: &[(i32, i64, Vec<csi::BlockMetadata>)], capacity: i64, max: usize) -> Vec<i64> {
    let mut out = Vec::new();
    let mut end = -1;
    for (kind, cap, blocks) in msgs {
        assert_eq!(*kind, csi::BlockMetadataType::FixedLength as i32);
        assert_eq!(*cap, capacity);
        assert!(blocks.len() <= max, "{} tuples > {max}", blocks.len());
        for b in blocks {
            assert_eq!(b.size_bytes, BLOCK);
            assert!(b.byte_offset >= end, "{} overlaps {end}", b.byte_offset);
            end = b.byte_offset + b.size_bytes;
            out.push(b.byte_offset);
        }
    }
    out
}

fn of_allocated(
    m: Vec<csi::GetMetadataAllocatedResponse>,
) -> Vec<(i32, i64, Vec<csi::BlockMetadata>)> {
    m.into_iter()
        .map(|r| {
            (
                r.block_metadata_type,
                r.volume_capacity_bytes,
                r.block_metadata,
            )
        })
        .collect()
}

fn of_delta(m: Vec<csi::GetMetadataDeltaResponse>) -> Vec<(i32, i64, Vec<csi::BlockMetadata>)> {
    m.into_iter()
        .map(|r| {
            (
                r.block_metadata_type,
                r.volume_capacity_bytes,
                r.block_metadata,
            )
        })
        .collect()
}

#[tokio::test]
async fn allocated_rows_and_paging() {
    let fx = Fx::new("svc-meta-alloc");
    let v = fx.create("pvc-m", 4 * MIB).await;
    let written = [0u64, 5 * 4096, 5 * 4096 + 100, 2 << 20, (4 << 20) - 1];
    for at in written {
        fx.write_at(&v.volume_id, at, &[9]);
    }
    let s = fx.snapshot("s", &v.volume_id).await.unwrap();
    assert_invalid(fx.allocated("", 0, 0).await, "snapshot_id");
    assert_code(
        fx.allocated("snap-00000000000000aa", 0, 0).await,
        Code::NotFound,
    );
    assert_code(fx.allocated("nope", 0, 0).await, Code::NotFound);
    assert_code(fx.allocated(&s.snapshot_id, -1, 0).await, Code::OutOfRange);
    assert_code(
        fx.allocated(&s.snapshot_id, 4 * MIB + 1, 0).await,
        Code::OutOfRange,
    );
    assert_invalid(fx.allocated(&s.snapshot_id, 0, -1).await, "max_results");

    let all = tuples(
        &of_allocated(fx.allocated(&s.snapshot_id, 0, 0).await.unwrap()),
        4 * MIB,
        1024,
    );
    for at in written {
        let at = at as i64;
        assert!(
            all.iter().any(|&o| o <= at && at < o + BLOCK),
            "{at} not allocated: {all:?}"
        );
    }
    // Two tuples a message, and a restart from the middle of a block keeps that block.
    let paged = of_allocated(fx.allocated(&s.snapshot_id, 0, 2).await.unwrap());
    assert!(paged.len() >= all.len() / 2);
    assert_eq!(tuples(&paged, 4 * MIB, 2), all);
    let from = 5 * 4096 + 10;
    let rest = tuples(
        &of_allocated(fx.allocated(&s.snapshot_id, from, 0).await.unwrap()),
        4 * MIB,
        1024,
    );
    assert_eq!(rest[0], 5 * 4096);
    assert_eq!(
        rest,
        all.iter()
            .copied()
            .filter(|&o| o + BLOCK > from)
            .collect::<Vec<_>>()
    );
    // At the very end: one message with the capacity, no tuple.
    let end = of_allocated(fx.allocated(&s.snapshot_id, 4 * MIB, 0).await.unwrap());
    assert_eq!(end.len(), 1);
    assert!(tuples(&end, 4 * MIB, 1024).is_empty());
}

#[tokio::test]
async fn delta_rows_and_blocks() {
    let fx = Fx::new("svc-meta-delta");
    let v = fx.create("pvc-d", 4 * MIB).await;
    let w = fx.create("pvc-w", 4 * MIB).await;
    fx.write_at(&v.volume_id, 0, &[1u8; 64 * 1024]);
    let base = fx.snapshot("base", &v.volume_id).await.unwrap();
    fx.write_at(&v.volume_id, 3 * 4096 + 17, b"changed");
    fx.write_at(&v.volume_id, 8 * 4096, &[1u8; 4096]); // the same bytes: no change
    fx.write_at(&v.volume_id, 3 << 20, &[2u8; 2 * 4096]);
    let target = fx.snapshot("target", &v.volume_id).await.unwrap();
    let other = fx.snapshot("other", &w.volume_id).await.unwrap();

    assert_invalid(
        fx.delta("", &target.snapshot_id, 0, 0).await,
        "base_snapshot_id",
    );
    assert_invalid(
        fx.delta(&base.snapshot_id, "", 0, 0).await,
        "target_snapshot_id",
    );
    assert_code(
        fx.delta("snap-00000000000000aa", &target.snapshot_id, 0, 0)
            .await,
        Code::NotFound,
    );
    assert_code(
        fx.delta(&base.snapshot_id, "snap-00000000000000aa", 0, 0)
            .await,
        Code::NotFound,
    );
    assert_invalid(
        fx.delta(&base.snapshot_id, &other.snapshot_id, 0, 0).await,
        "target_snapshot_id",
    );
    assert_code(
        fx.delta(&base.snapshot_id, &target.snapshot_id, 5 * MIB, 0)
            .await,
        Code::OutOfRange,
    );

    let want = vec![3 * 4096, 3 * MIB, 3 * MIB + BLOCK];
    let got = of_delta(
        fx.delta(&base.snapshot_id, &target.snapshot_id, 0, 1)
            .await
            .unwrap(),
    );
    assert_eq!(got.len(), 3);
    assert_eq!(tuples(&got, 4 * MIB, 1), want);
    let later = of_delta(
        fx.delta(&base.snapshot_id, &target.snapshot_id, 3 * 4096 + 4096, 0)
            .await
            .unwrap(),
    );
    assert_eq!(tuples(&later, 4 * MIB, 1024), want[1..]);
    // Nothing changed between a snapshot and itself.
    let same = of_delta(
        fx.delta(&base.snapshot_id, &base.snapshot_id, 0, 0)
            .await
            .unwrap(),
    );
    assert!(tuples(&same, 4 * MIB, 1024).is_empty());
}
