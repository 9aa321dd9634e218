//! Many calls at once.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_publishes_of_many_volumes() {
    let fx = Arc::new(Fx::new("svc-concurrent"));
    let mut ids = Vec::new();
    for i in 0..8 {
        ids.push(fx.create(&format!("pvc-{i}"), MIB).await.volume_id);
    }
    let tasks: Vec<_> = ids
        .iter()
        .map(|id| {
            let fx = Arc::clone(&fx);
            let id = id.clone();
            tokio::spawn(async move { fx.publish(&id).await })
        })
        .collect();
    let mut devices = Vec::new();
    for t in tasks {
        devices.push(t.await.unwrap().unwrap()[DEVICE_PATH_KEY].clone());
    }
    devices.sort();
    devices.dedup();
    assert_eq!(devices.len(), 8);
    assert_eq!(fx.fake.devices().len(), 8);
    assert!(
        fx.fake
            .list(std::path::Path::new("/"))
            .unwrap()
            .iter()
            .all(|a| !a.deleted)
    );
}
