//! ListVolumes.

use super::*;

#[tokio::test]
async fn list_volumes_pages() {
    let fx = Fx::new("svc-list");
    let mut ids = Vec::new();
    for i in 0..5 {
        ids.push(fx.create(&format!("pvc-{i}"), MIB).await.volume_id);
    }
    ids.sort();
    fx.publish(&ids[1]).await.unwrap();
    let list = |max_entries, starting_token: &str| csi::ListVolumesRequest {
        max_entries,
        starting_token: starting_token.into(),
    };
    let mut seen = Vec::new();
    let mut token = String::new();
    loop {
        let page = fx
            .svc
            .list_volumes(Request::new(list(2, &token)))
            .await
            .unwrap()
            .into_inner();
        assert!(page.entries.len() <= 2);
        for e in &page.entries {
            let vol = e.volume.as_ref().unwrap();
            let status = e.status.as_ref().unwrap();
            let published = vol.volume_id == ids[1];
            assert_eq!(status.published_node_ids.len(), usize::from(published));
            assert!(!status.volume_condition.as_ref().unwrap().abnormal);
            seen.push(vol.volume_id.clone());
        }
        if page.next_token.is_empty() {
            break;
        }
        token = page.next_token;
    }
    assert_eq!(seen, ids);
    // The token names the next volume; deleting it does not invalidate the token.
    let first = fx
        .svc
        .list_volumes(Request::new(list(2, "")))
        .await
        .unwrap()
        .into_inner();
    let token = first.next_token;
    assert_eq!(token, ids[2]);
    fx.svc
        .delete_volume(Request::new(csi::DeleteVolumeRequest {
            volume_id: ids[2].clone(),
            ..Default::default()
        }))
        .await
        .unwrap();
    let next = fx
        .svc
        .list_volumes(Request::new(list(2, &token)))
        .await
        .unwrap()
        .into_inner();
    let got: Vec<_> = next
        .entries
        .iter()
        .map(|e| e.volume.as_ref().unwrap().volume_id.clone())
        .collect();
    assert_eq!(got, ids[3..5]);
    for bad in ["garbage", "vol-zz", "snap-0000000000000000"] {
        assert_code(
            fx.svc.list_volumes(Request::new(list(1, bad))).await,
            Code::Aborted,
        );
    }
    assert_invalid(
        fx.svc.list_volumes(Request::new(list(-1, ""))).await,
        "max_entries",
    );
    let all = fx
        .svc
        .list_volumes(Request::new(list(0, "")))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(all.entries.len(), 4);
    assert!(all.next_token.is_empty());
}
