//! GetCapacity.

use super::*;

#[tokio::test]
async fn get_capacity_rows() {
    let fx = Fx::new("svc-capacity");
    let get = |req| async { fx.svc.get_capacity(Request::new(req)).await };
    let all = get(csi::GetCapacityRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert!(all.available_capacity > 0);
    let here = get(csi::GetCapacityRequest {
        accessible_topology: Some(topo(NODE)),
        volume_capabilities: vec![mount_cap()],
        ..Default::default()
    })
    .await
    .unwrap()
    .into_inner();
    assert!(here.available_capacity > 0);
    assert_eq!(here.maximum_volume_size, Some(1 << 60));
    assert_eq!(here.minimum_volume_size, Some(MIB));
    // The advertised bounds are the real ones.
    for (name, required, limit, ok) in [
        ("pvc-cap-min", 0, MIB, true),
        ("pvc-cap-below-min", 0, MIB - 1, false),
        ("pvc-cap-max-plus", (1 << 60) + 1, 0, false),
    ] {
        let mut r = create_req(name, 0);
        r.capacity_range = Some(csi::CapacityRange {
            required_bytes: required,
            limit_bytes: limit,
        });
        let got = fx.svc.create_volume(Request::new(r)).await;
        if ok {
            assert_eq!(
                got.unwrap().into_inner().volume.unwrap().capacity_bytes,
                MIB
            );
        } else {
            assert_code(got, Code::OutOfRange);
        }
    }
    for zero in [
        csi::GetCapacityRequest {
            accessible_topology: Some(topo("node-2")),
            ..Default::default()
        },
        csi::GetCapacityRequest {
            volume_capabilities: vec![cap(Mode::MultiNodeMultiWriter, true)],
            ..Default::default()
        },
    ] {
        let none = get(zero).await.unwrap().into_inner();
        assert_eq!(none.available_capacity, 0);
        assert_eq!(none.maximum_volume_size, None);
        assert_eq!(none.minimum_volume_size, None);
    }
    let mut bad = csi::GetCapacityRequest::default();
    bad.parameters.insert("replicas".into(), "3".into());
    assert_invalid(get(bad).await, "parameters");
}
