//! moor-rbd against a live cluster: the one `.ci/ceph-cluster up DIR` brings up (its `DIR/env`
//! sets MOOR_CEPH_CONF, MOOR_CEPH_KEYRING, MOOR_CEPH_USER and MOOR_CEPH_POOL). Without them
//! each test prints "skipped: no Ceph cluster" and passes; with them, a cluster that does not
//! answer is a failure.
//!
//! One file, over the usual length: every operation of the crate against one live cluster,
//! sharing its connection set-up.

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use moor_rbd::testing::TestCluster;
use moor_rbd::{
    Auth, Cluster, ConnectOptions, ControlFlow, Ensured, Error, Features, ImageOptions, LockMode,
    Pool, Secret, Shrink,
};

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
        Cluster::connect(&self.options()).expect("connect to the test cluster")
    }

    fn pool(&self) -> Pool {
        self.connect().pool(&self.pool).expect("open the test pool")
    }
}

/// Image names of this test run: unique per process and call.
fn name(what: &str) -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    format!(
        "t{}-{}-{what}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// Removes a test's images however the test ends: children before parents (register parents
/// first), snapshots unprotected and removed, trashed images of these names purged.
struct Cleanup {
    pool: Pool,
    images: Vec<String>,
}

impl Cleanup {
    fn new(pool: &Pool) -> Cleanup {
        Cleanup {
            pool: pool.clone(),
            images: Vec::new(),
        }
    }

    fn add(&mut self, image: &str) -> String {
        self.images.push(image.to_owned());
        image.to_owned()
    }
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        for image in self.images.iter().rev() {
            if let Ok(open) = self.pool.open_image(image) {
                let _ = open.release_lock();
                for snap in open.snapshots().unwrap_or_default() {
                    let _ = open.unprotect_snapshot(&snap.name);
                    let _ = open.remove_snapshot(&snap.name);
                }
            }
            let _ = self.pool.remove_image(image);
        }
        for entry in self.pool.trash_list().unwrap_or_default() {
            if self.images.contains(&entry.name) {
                let _ = self.pool.trash_remove(&entry.id, true);
            }
        }
    }
}

fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1000.0)
}

#[test]
fn connects_with_a_key_or_a_keyring_and_finds_pools() {
    let Some(env) = Env::get() else {
        return;
    };
    let started = Instant::now();
    let by_key = env.connect();
    eprintln!("timing: connect {}", ms(started.elapsed()));
    assert_eq!(by_key.user(), env.user);
    assert!(by_key.pool_id(&env.pool).unwrap() > 0);

    let by_keyring = Cluster::connect(&ConnectOptions::new(
        &env.mon_host,
        &env.user,
        Auth::Keyring(env.keyring.clone()),
    ))
    .unwrap();
    by_keyring.pool(&env.pool).unwrap();

    let e = by_key.pool("no-such-pool").unwrap_err();
    assert!(
        matches!(
            e,
            Error::NotFound {
                call: "rados_ioctx_create",
                ..
            }
        ),
        "{e:?}"
    );
    assert_eq!(e.errno(), Some(libc::ENOENT));
    assert!(matches!(
        by_key.pool_id("no-such-pool"),
        Err(Error::NotFound { .. })
    ));
    let usage = by_key.usage().unwrap();
    assert!(
        usage.total_bytes > 0 && usage.available_bytes <= usage.total_bytes,
        "{usage:?}"
    );
}

#[test]
fn a_wrong_key_is_refused_and_never_shown() {
    let Some(env) = Env::get() else {
        return;
    };
    // A well-formed cephx key that is not the user's.
    let wrong = "AQBcVdNm8nV7JRAAm0vIYSlZ0yq3xQ0qkQ6y5A==";
    let options = ConnectOptions::new(&env.mon_host, &env.user, Auth::Key(Secret::new(wrong)))
        .timeout(Duration::from_secs(60));
    let e = Cluster::connect(&options).unwrap_err();
    eprintln!("wrong key: {e}");
    assert!(
        matches!(
            e,
            Error::PermissionDenied {
                call: "rados_connect",
                ..
            }
        ),
        "{e:?}"
    );
    let shown = format!("{e} {e:?} {options:?}");
    assert!(
        !shown.contains(wrong) && !shown.contains(env.key_text()),
        "{shown}"
    );
}

impl Env {
    /// The real key's text, only to check it is never shown.
    fn key_text(&self) -> &'static str {
        let text = std::fs::read_to_string(&self.keyring).unwrap();
        let key = text
            .lines()
            .find_map(|l| l.trim().strip_prefix("key = "))
            .unwrap()
            .to_owned();
        Box::leak(key.into_boxed_str())
    }
}

#[test]
fn no_monitor_is_an_error_within_the_timeout() {
    if moor_rbd::load().is_err() {
        eprintln!("skipped: librbd not installed");
        return;
    }
    let key = Secret::new("AQBcVdNm8nV7JRAAm0vIYSlZ0yq3xQ0qkQ6y5A==");
    let options =
        ConnectOptions::new("127.0.0.1:1", "moor", Auth::Key(key)).timeout(Duration::from_secs(1));
    let e = Cluster::connect(&options).unwrap_err();
    eprintln!("no monitor: {e}");
    assert!(
        matches!(
            e,
            Error::TimedOut {
                call: "rados_connect",
                ..
            }
        ),
        "{e:?}"
    );
}

#[test]
fn create_is_idempotent_by_name() {
    let Some(env) = Env::get() else {
        return;
    };
    let pool = env.pool();
    let mut cleanup = Cleanup::new(&pool);
    let image = cleanup.add(&name("idem"));
    let options = ImageOptions::new(64 * MIB);

    assert_eq!(
        pool.ensure_image(&image, &options).unwrap(),
        Ensured::Created
    );
    assert_eq!(
        pool.ensure_image(&image, &options).unwrap(),
        Ensured::Existed
    );
    let e = pool.create_image(&image, &options).unwrap_err();
    assert!(
        matches!(
            e,
            Error::AlreadyExists {
                call: "rbd_create4",
                ..
            }
        ),
        "{e:?}"
    );
    let e = pool
        .ensure_image(&image, &ImageOptions::new(128 * MIB))
        .unwrap_err();
    assert!(matches!(e, Error::Conflict { .. }), "{e:?}");
    let e = pool
        .ensure_image(&image, &options.clone().features(Features::LAYERING))
        .unwrap_err();
    assert!(matches!(e, Error::Conflict { .. }), "{e:?}");

    let open = pool.open_image(&image).unwrap();
    assert_eq!(open.size().unwrap(), 64 * MIB);
    assert_eq!(open.features().unwrap(), Features::MOOR_DEFAULT);
    assert_eq!(open.info().unwrap().object_size, 4 * MIB);
    assert!(!open.id().unwrap().is_empty());

    // Other features and object sizes are passed through.
    let other = cleanup.add(&name("feat"));
    let all =
        Features::from_names("layering,exclusive-lock,object-map,fast-diff,deep-flatten").unwrap();
    pool.create_image(&other, &ImageOptions::new(8 * MIB).features(all).order(20))
        .unwrap();
    let open = pool.open_image(&other).unwrap();
    assert_eq!(open.features().unwrap(), all);
    assert_eq!(open.info().unwrap().order, 20);
}

#[test]
fn a_missing_image_is_not_found_naming_the_call() {
    let Some(env) = Env::get() else {
        return;
    };
    let pool = env.pool();
    let e = pool.open_image("no-such-image").unwrap_err();
    assert!(
        matches!(
            e,
            Error::NotFound {
                call: "rbd_open",
                ..
            }
        ),
        "{e:?}"
    );
    assert!(
        e.to_string()
            .contains(&format!("image {}/no-such-image", env.pool)),
        "{e}"
    );
    let e = pool.remove_image("no-such-image").unwrap_err();
    assert!(
        matches!(
            e,
            Error::NotFound {
                call: "rbd_remove",
                ..
            }
        ),
        "{e:?}"
    );
}

#[test]
fn resize_grows_and_shrinks_only_when_allowed() {
    let Some(env) = Env::get() else {
        return;
    };
    let pool = env.pool();
    let mut cleanup = Cleanup::new(&pool);
    let image = cleanup.add(&name("resize"));
    pool.create_image(&image, &ImageOptions::new(64 * MIB))
        .unwrap();
    let open = pool.open_image(&image).unwrap();
    open.resize(256 * MIB, Shrink::Refuse).unwrap();
    assert_eq!(open.size().unwrap(), 256 * MIB);
    // Seen from another client too.
    assert_eq!(
        env.pool()
            .open_image_read_only(&image)
            .unwrap()
            .size()
            .unwrap(),
        256 * MIB
    );

    let e = open.resize(128 * MIB, Shrink::Refuse).unwrap_err();
    assert!(
        matches!(e, Error::WouldShrink { current, requested, .. }
        if current == 256 * MIB && requested == 128 * MIB),
        "{e:?}"
    );
    assert_eq!(open.size().unwrap(), 256 * MIB);
    open.resize(128 * MIB, Shrink::Allow).unwrap();
    assert_eq!(open.size().unwrap(), 128 * MIB);
}

#[test]
fn images_are_listed_in_pages_by_name() {
    let Some(env) = Env::get() else {
        return;
    };
    let pool = env.pool();
    let mut cleanup = Cleanup::new(&pool);
    let prefix = name("list");
    let mine: Vec<String> = (0..5)
        .map(|i| cleanup.add(&format!("{prefix}-{i}")))
        .collect();
    for image in &mine {
        pool.create_image(image, &ImageOptions::new(MIB)).unwrap();
    }
    let mut seen = Vec::new();
    let mut after: Option<String> = None;
    let mut pages = 0;
    loop {
        let page = pool.list_images(after.as_deref(), 2).unwrap();
        assert!(page.images.len() <= 2);
        seen.extend(page.images.into_iter().map(|s| s.name));
        pages += 1;
        match page.next {
            Some(next) => after = Some(next),
            None => break,
        }
        assert!(pages < 10_000, "paging does not end");
    }
    let mut sorted = seen.clone();
    sorted.sort();
    sorted.dedup();
    assert_eq!(seen, sorted, "pages are in name order without repeats");
    let listed: Vec<&String> = seen.iter().filter(|n| n.starts_with(&prefix)).collect();
    assert_eq!(listed, mine.iter().collect::<Vec<_>>());
    assert!(pages >= 3, "5 images in pages of 2");
    // Each listed image carries its id.
    let all = pool.images().unwrap();
    let first = all.iter().find(|s| s.name == mine[0]).unwrap();
    assert_eq!(
        first.id,
        pool.open_image_read_only(&mine[0]).unwrap().id().unwrap()
    );
}

#[test]
fn snapshot_protect_clone_flatten_and_removal_refusals() {
    let Some(env) = Env::get() else {
        return;
    };
    let pool = env.pool();
    let mut cleanup = Cleanup::new(&pool);
    let parent = cleanup.add(&name("parent"));
    let child = cleanup.add(&name("child"));
    pool.create_image(&parent, &ImageOptions::new(32 * MIB))
        .unwrap();
    let open = pool.open_image(&parent).unwrap();

    open.create_snapshot("s1").unwrap();
    let e = open.create_snapshot("s1").unwrap_err();
    assert!(
        matches!(
            e,
            Error::AlreadyExists {
                call: "rbd_snap_create",
                ..
            }
        ),
        "{e:?}"
    );
    let snaps = open.snapshots().unwrap();
    assert_eq!(
        snaps
            .iter()
            .map(|s| (s.name.as_str(), s.size))
            .collect::<Vec<_>>(),
        [("s1", 32 * MIB)]
    );
    assert!(!open.is_snapshot_protected("s1").unwrap());
    open.protect_snapshot("s1").unwrap();
    assert!(open.is_snapshot_protected("s1").unwrap());
    let e = open.remove_snapshot("s1").unwrap_err();
    assert!(
        matches!(
            e,
            Error::SnapshotProtected {
                call: "rbd_snap_remove",
                ..
            }
        ),
        "{e:?}"
    );

    let started = Instant::now();
    pool.clone_image(&parent, "s1", &pool, &child, Features::MOOR_DEFAULT)
        .unwrap();
    eprintln!("timing: clone {}", ms(started.elapsed()));
    let cloned = pool.open_image(&child).unwrap();
    assert_eq!(cloned.size().unwrap(), 32 * MIB);
    let of = cloned.parent().unwrap().expect("a clone has a parent");
    assert_eq!(
        (
            of.image.pool.as_str(),
            of.image.image.as_str(),
            of.snapshot.as_str()
        ),
        (env.pool.as_str(), parent.as_str(), "s1")
    );
    let children = open.children().unwrap();
    assert_eq!(
        children
            .iter()
            .map(|c| c.image.as_str())
            .collect::<Vec<_>>(),
        [child.as_str()]
    );
    assert_eq!(
        pool.open_snapshot(&parent, "s1")
            .unwrap()
            .children()
            .unwrap()
            .len(),
        1
    );

    // While the clone depends on it, the parent cannot go, and says why.
    let e = pool.remove_image(&parent).unwrap_err();
    match &e {
        Error::HasClones {
            call: "rbd_remove",
            clones,
            ..
        } => {
            assert_eq!(clones, &[format!("{}/{child}", env.pool)]);
        }
        other => panic!("expected HasClones, got {other:?}"),
    }
    assert!(e.to_string().contains("has clones"), "{e}");
    let e = open.unprotect_snapshot("s1").unwrap_err();
    assert!(
        matches!(
            e,
            Error::HasClones {
                call: "rbd_snap_unprotect",
                ..
            }
        ),
        "{e:?}"
    );

    // Flattened, the clone stands alone.
    cloned.flatten().unwrap();
    assert_eq!(cloned.parent().unwrap(), None);
    assert!(open.children().unwrap().is_empty());
    open.unprotect_snapshot("s1").unwrap();

    // Only the snapshot is left in the way.
    let e = pool.remove_image(&parent).unwrap_err();
    assert!(
        matches!(
            e,
            Error::HasSnapshots {
                call: "rbd_remove",
                ..
            }
        ),
        "{e:?}"
    );
    assert!(e.to_string().contains("has snapshots"), "{e}");
    open.remove_snapshot("s1").unwrap();
    assert!(open.snapshots().unwrap().is_empty());
    open.close().unwrap();
    pool.remove_image(&parent).unwrap();
    assert!(matches!(
        pool.open_image(&parent),
        Err(Error::NotFound { .. })
    ));
    // The flattened clone lives on.
    assert_eq!(pool.open_image(&child).unwrap().size().unwrap(), 32 * MIB);
}

#[test]
fn an_image_open_elsewhere_is_busy_to_remove() {
    let Some(env) = Env::get() else {
        return;
    };
    let pool = env.pool();
    let mut cleanup = Cleanup::new(&pool);
    let image = cleanup.add(&name("busy"));
    pool.create_image(&image, &ImageOptions::new(MIB)).unwrap();
    let elsewhere = env.pool().open_image(&image).unwrap();
    let watchers = pool
        .open_image_read_only(&image)
        .unwrap()
        .watchers()
        .unwrap();
    assert_eq!(watchers.len(), 1, "{watchers:?}");

    let e = pool.remove_image(&image).unwrap_err();
    match &e {
        Error::Busy {
            call: "rbd_remove",
            watchers,
            ..
        } => assert_eq!(watchers.len(), 1),
        other => panic!("expected Busy, got {other:?}"),
    }
    assert!(e.to_string().contains("busy (watchers: "), "{e}");
    elsewhere.close().unwrap();
    pool.remove_image(&image).unwrap();
}

#[test]
fn trashed_images_are_gone_by_name_and_removed_by_id() {
    let Some(env) = Env::get() else {
        return;
    };
    let pool = env.pool();
    let mut cleanup = Cleanup::new(&pool);
    let image = cleanup.add(&name("trash"));
    pool.create_image(&image, &ImageOptions::new(MIB)).unwrap();
    let id = pool.open_image_read_only(&image).unwrap().id().unwrap();

    pool.trash_move(&image, Duration::from_secs(3600)).unwrap();
    assert!(matches!(
        pool.open_image(&image),
        Err(Error::NotFound { .. })
    ));
    assert!(pool.images().unwrap().iter().all(|s| s.name != image));
    let entry = pool
        .trash_list()
        .unwrap()
        .into_iter()
        .find(|e| e.name == image)
        .unwrap();
    assert_eq!(entry.id, id);
    assert!(entry.deferred_until > 0);

    // Not before its delay, unless forced.
    let e = pool.trash_remove(&id, false).unwrap_err();
    assert!(
        matches!(
            e,
            Error::PermissionDenied {
                call: "rbd_trash_remove",
                ..
            }
        ),
        "{e:?}"
    );
    pool.trash_remove(&id, true).unwrap();
    assert!(pool.trash_list().unwrap().iter().all(|e| e.id != id));

    // With no delay, no force needed.
    let again = cleanup.add(&name("trash0"));
    pool.create_image(&again, &ImageOptions::new(MIB)).unwrap();
    pool.trash_move(&again, Duration::ZERO).unwrap();
    let entry = pool
        .trash_list()
        .unwrap()
        .into_iter()
        .find(|e| e.name == again)
        .unwrap();
    pool.trash_remove(&entry.id, false).unwrap();
}

#[test]
fn an_exclusive_lock_held_by_one_client_fails_anothers_acquire_at_once() {
    let Some(env) = Env::get() else {
        return;
    };
    let (a, b) = (env.pool(), env.pool());
    let mut cleanup = Cleanup::new(&a);
    let image = cleanup.add(&name("lock"));
    a.create_image(&image, &ImageOptions::new(MIB)).unwrap();

    let at_a = a.open_image(&image).unwrap();
    let at_b = b.open_image(&image).unwrap();
    assert_eq!(at_a.lock_owners().unwrap().owners, Vec::<String>::new());
    at_a.acquire_exclusive_lock().unwrap();
    assert!(at_a.is_lock_owner().unwrap());
    let owners = at_b.lock_owners().unwrap();
    assert_eq!(owners.mode, LockMode::Exclusive);
    assert_eq!(owners.owners.len(), 1, "{owners:?}");

    let started = Instant::now();
    let e = at_b.acquire_exclusive_lock().unwrap_err();
    eprintln!("timing: refused lock acquire {}", ms(started.elapsed()));
    assert!(
        matches!(
            e,
            Error::LockHeld {
                call: "rbd_lock_acquire",
                ..
            }
        ),
        "{e:?}"
    );
    assert!(!at_b.is_lock_owner().unwrap());
    assert!(at_a.is_lock_owner().unwrap(), "the holder keeps the lock");

    at_a.release_lock().unwrap();
    assert!(!at_a.is_lock_owner().unwrap());
    at_b.acquire_exclusive_lock().unwrap();
    assert!(at_b.is_lock_owner().unwrap());
    let now = at_a.lock_owners().unwrap();
    assert_eq!(now.owners.len(), 1);
    assert_ne!(now.owners, owners.owners, "the lock changed hands");
    let e = at_a.acquire_exclusive_lock().unwrap_err();
    assert!(matches!(e, Error::LockHeld { .. }), "{e:?}");
}

#[test]
fn diff_walks_the_extents_written_since_a_snapshot_or_at_all() {
    let Some(env) = Env::get() else {
        return;
    };
    let pool = env.pool();
    let mut cleanup = Cleanup::new(&pool);
    let image = cleanup.add(&name("diff"));
    pool.create_image(&image, &ImageOptions::new(16 * MIB))
        .unwrap();
    let open = pool.open_image(&image).unwrap();
    open.write(0, &[1u8; 8192]).unwrap();
    open.write(5 * MIB, &[2u8; 4096]).unwrap();
    open.flush().unwrap();
    open.create_snapshot("s").unwrap();
    open.write(4096, &[3u8; 4096]).unwrap();
    open.flush().unwrap();

    let walk = |from: Option<&str>, at: &moor_rbd::Image| {
        let mut seen = Vec::new();
        let stopped = at
            .diff(from, 0, 16 * MIB, &mut |offset, len, exists| {
                seen.push((offset, len, exists));
                ControlFlow::Continue(())
            })
            .unwrap();
        assert!(!stopped);
        seen
    };
    let covers = |seen: &[(u64, u64, bool)], at: u64| {
        seen.iter().any(|&(o, l, e)| e && o <= at && at < o + l)
    };
    // Everything written, at the head.
    let all = walk(None, &open);
    for at in [0, 4096, 5 * MIB] {
        assert!(covers(&all, at), "{at} not in {all:?}");
    }
    assert!(!covers(&all, 9 * MIB), "{all:?}");
    // Since the snapshot: the one block rewritten, not the block written before it.
    let since = walk(Some("s"), &open);
    assert!(covers(&since, 4096), "{since:?}");
    assert!(!covers(&since, 5 * MIB), "{since:?}");
    // The snapshot itself, opened at it, holds what was written before it.
    let at_snap = pool.open_snapshot(&image, "s").unwrap();
    assert!(covers(&walk(None, &at_snap), 5 * MIB));
    // The closure can stop the walk.
    let mut n = 0;
    let stopped = open
        .diff(None, 0, 16 * MIB, &mut |_, _, _| {
            n += 1;
            ControlFlow::Break(())
        })
        .unwrap();
    assert!(stopped);
    assert_eq!(n, 1);
    // A snapshot that does not exist names the call.
    let e = open.diff(Some("nope"), 0, MIB, &mut |_, _, _| {
        ControlFlow::Continue(())
    });
    assert!(e.is_err());
    drop(at_snap);
    drop(open);
}

#[test]
fn pool_capacity_reports_what_can_be_written() {
    let Some(env) = Env::get() else {
        return;
    };
    let cluster = env.connect();
    let pool = cluster.pool(&env.pool).unwrap();
    let capacity = pool.capacity().unwrap();
    let raw = cluster.usage().unwrap();
    assert!(capacity.available_bytes > 0, "{capacity:?}");
    assert!(
        capacity.available_bytes <= raw.total_bytes,
        "{capacity:?} {raw:?}"
    );
}

/// Not a check: the costs the README quotes, printed (run with --nocapture).
#[test]
fn timings() {
    let Some(env) = Env::get() else {
        return;
    };
    let rounds = 5;
    let started = Instant::now();
    for _ in 0..rounds {
        drop(env.connect());
    }
    eprintln!(
        "timing: connect {} (mean of {rounds})",
        ms(started.elapsed() / rounds)
    );

    let pool = env.pool();
    let mut cleanup = Cleanup::new(&pool);
    let image = cleanup.add(&name("timing"));
    let (mut creating, mut removing) = (Duration::ZERO, Duration::ZERO);
    for _ in 0..rounds {
        let started = Instant::now();
        pool.create_image(&image, &ImageOptions::new(1 << 30))
            .unwrap();
        creating += started.elapsed();
        let started = Instant::now();
        pool.remove_image(&image).unwrap();
        removing += started.elapsed();
    }
    let (creating, removing) = (ms(creating / rounds), ms(removing / rounds));
    eprintln!("timing: create 1 GiB {creating}, remove it {removing} (means of {rounds})");

    pool.create_image(&image, &ImageOptions::new(1 << 30))
        .unwrap();
    let open = pool.open_image(&image).unwrap();
    open.create_snapshot("s").unwrap();
    open.protect_snapshot("s").unwrap();
    let clone = cleanup.add(&name("timing-clone"));
    let (mut cloning, mut removing) = (Duration::ZERO, Duration::ZERO);
    for _ in 0..rounds {
        let started = Instant::now();
        pool.clone_image(&image, "s", &pool, &clone, Features::MOOR_DEFAULT)
            .unwrap();
        cloning += started.elapsed();
        let started = Instant::now();
        pool.remove_image(&clone).unwrap();
        removing += started.elapsed();
    }
    let (cloning, removing) = (ms(cloning / rounds), ms(removing / rounds));
    eprintln!("timing: clone {cloning}, remove the clone {removing} (means of {rounds})");
}

#[test]
fn without_the_libraries_connecting_says_librbd_is_not_installed() {
    let Err(load_error) = moor_rbd::load() else {
        eprintln!("skipped: librbd is installed");
        return;
    };
    assert!(
        matches!(load_error, Error::NotInstalled { .. }),
        "{load_error:?}"
    );
    let options = ConnectOptions::new("127.0.0.1:3300", "moor", Auth::Key(Secret::new("AQAA")));
    let e = Cluster::connect(&options).unwrap_err();
    assert!(e.to_string().starts_with("librbd not installed: "), "{e}");
    eprintln!("without Ceph: {e}");
}
