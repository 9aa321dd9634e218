//! moor-rbd's pool metadata, images by id, lockers, blocklist and image I/O against a live
//! cluster (`.ci/ceph-cluster up DIR`, then `. DIR/env`). Without one, each test prints
//! "skipped: no Ceph cluster" and passes.

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use moor_rbd::testing::TestCluster;
use moor_rbd::{Cluster, Error, ImageOptions, Pool};

const MIB: u64 = 1 << 20;

/// The test cluster, with the connections these tests make.
struct Env(TestCluster);

impl std::ops::Deref for Env {
    type Target = TestCluster;

    fn deref(&self) -> &TestCluster {
        &self.0
    }
}

impl Env {
    fn get() -> Option<Env> {
        TestCluster::from_env().map(Env)
    }

    fn connect(&self) -> Cluster {
        Cluster::connect(&self.options().option("rbd_cache", "false")).unwrap()
    }

    fn pool(&self) -> Pool {
        self.connect().pool(&self.pool).unwrap()
    }

    /// The administrator (removing a blocklist entry takes it), when its keyring is there.
    fn admin(&self) -> Option<Cluster> {
        Cluster::connect(&self.admin_options()?).ok()
    }
}

fn name(what: &str) -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    format!(
        "r{}-{}-{what}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

#[test]
fn pool_metadata_is_a_key_value_store_listed_by_prefix_in_pages() {
    let Some(env) = Env::get() else {
        return;
    };
    let pool = env.pool();
    let prefix = format!("test.{}.", name("meta"));
    assert_eq!(
        pool.metadata_get(&format!("{prefix}missing")).unwrap(),
        None
    );
    // More keys than one internal page of the listing (256).
    let keys: Vec<String> = (0..300).map(|i| format!("{prefix}{i:04}")).collect();
    for (i, k) in keys.iter().enumerate() {
        pool.metadata_set(k, &format!("{{\"n\":{i}}}")).unwrap();
    }
    pool.metadata_set(&format!("{prefix}empty"), "").unwrap();
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        assert_eq!(
            pool.metadata_get(&keys[7]).unwrap().as_deref(),
            Some("{\"n\":7}")
        );
        assert_eq!(
            pool.metadata_get(&format!("{prefix}empty"))
                .unwrap()
                .as_deref(),
            Some("")
        );
        let all = pool.metadata_list(&prefix, None, 0).unwrap();
        assert_eq!(all.len(), 301);
        assert_eq!(all[299], (keys[299].clone(), "{\"n\":299}".to_string()));
        let page = pool.metadata_list(&prefix, Some(&keys[9]), 5).unwrap();
        let names: Vec<&str> = page.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(
            names,
            keys[10..15].iter().map(String::as_str).collect::<Vec<_>>()
        );
        // Keys of other prefixes are not listed.
        assert!(
            pool.metadata_list(&format!("{prefix}02"), None, 0)
                .unwrap()
                .iter()
                .all(|(k, _)| k.starts_with(&format!("{prefix}02")))
        );
        // Configuration overrides are refused before reaching the cluster.
        assert!(matches!(
            pool.metadata_set("conf_rbd_cache", "false"),
            Err(Error::Invalid { .. })
        ));
    }));
    for k in keys.iter().chain([&format!("{prefix}empty")]) {
        assert!(pool.metadata_remove(k).unwrap());
    }
    assert!(!pool.metadata_remove(&keys[0]).unwrap(), "already removed");
    if let Err(panic) = result {
        std::panic::resume_unwind(panic);
    }
}

#[test]
fn an_image_in_the_trash_opens_by_id_with_its_snapshots() {
    let Some(env) = Env::get() else {
        return;
    };
    let pool = env.pool();
    let image = name("byid");
    pool.create_image(&image, &ImageOptions::new(4 * MIB))
        .unwrap();
    let open = pool.open_image(&image).unwrap();
    let id = open.id().unwrap();
    open.write(0, b"kept in the trash").unwrap();
    open.create_snapshot("s").unwrap();
    drop(open);
    pool.trash_move(&image, Duration::ZERO).unwrap();
    assert!(matches!(
        pool.open_image_read_only(&image),
        Err(Error::NotFound { .. })
    ));
    let by_id = pool.open_image_by_id(&id).unwrap();
    assert_eq!(by_id.read(0, 17).unwrap(), b"kept in the trash");
    assert_eq!(by_id.snapshots().unwrap().len(), 1);
    by_id.remove_snapshot("s").unwrap();
    drop(by_id);
    assert!(pool.open_snapshot_by_id(&id, "s").is_err());
    pool.trash_remove(&id, true).unwrap();
    assert!(matches!(
        pool.open_image_by_id_read_only(&id),
        Err(Error::NotFound { .. })
    ));
}

#[test]
fn a_blocklisted_client_cannot_write_and_its_lock_can_be_broken() {
    let Some(env) = Env::get() else {
        return;
    };
    let pool = env.pool();
    let image = name("fence");
    pool.create_image(&image, &ImageOptions::new(4 * MIB))
        .unwrap();
    let holder = env.connect();
    let held = holder.pool(&env.pool).unwrap().open_image(&image).unwrap();
    held.acquire_exclusive_lock().unwrap();
    held.write(0, b"before").unwrap();

    let observer = env.connect();
    let seen = observer
        .pool(&env.pool)
        .unwrap()
        .open_image_read_only(&image)
        .unwrap();
    let lockers = seen.lockers().unwrap();
    assert!(lockers.exclusive);
    assert_eq!(lockers.lockers.len(), 1, "{lockers:?}");
    let locker = lockers.lockers[0].clone();
    assert_eq!(locker.client, format!("client.{}", holder.instance_id()));
    assert!(locker.cookie.starts_with("auto "), "{locker:?}");
    let watcher = seen
        .watchers()
        .unwrap()
        .into_iter()
        .find(|w| u64::try_from(w.client_id).ok() == Some(holder.instance_id()))
        .unwrap();
    assert_eq!(watcher.address, locker.address);

    observer
        .blocklist_add(&locker.address, Duration::from_secs(600))
        .unwrap();
    // Breaking the lock is a request with the new map: the OSD has it from then on (with one
    // OSD, every object's), and refuses the holder.
    seen.break_lock(&locker).unwrap();
    assert!(seen.lockers().unwrap().lockers.is_empty());
    let e = held.write(0, b"after").unwrap_err();
    assert_eq!(e.errno(), Some(libc::ESHUTDOWN), "{e}");
    assert!(matches!(
        seen.break_lock(&locker),
        Err(Error::NotFound { .. })
    ));
    drop(seen);

    // Another client takes the image; the fenced write never landed.
    let next = observer
        .pool(&env.pool)
        .unwrap()
        .open_image(&image)
        .unwrap();
    next.acquire_exclusive_lock().unwrap();
    assert_eq!(next.read(0, 6).unwrap(), b"before");
    next.release_lock().unwrap();
    drop(next);
    drop(held);
    drop(holder);
    if let Some(admin) = env.admin() {
        admin.blocklist_remove(&locker.address).unwrap();
    }
    // The rbd profile may add entries, not remove them.
    assert!(observer.blocklist_remove(&locker.address).is_err() || env.admin().is_none());
    pool.remove_image(&image).unwrap();
}
