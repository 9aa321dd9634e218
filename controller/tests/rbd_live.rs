//! The RBD backend against a live cluster: the one `.ci/ceph-cluster up DIR` brings up (its
//! `DIR/env` sets MOOR_CEPH_CONF, MOOR_CEPH_KEYRING, MOOR_CEPH_USER and MOOR_CEPH_POOL).
//! Without them each test prints "skipped: no Ceph cluster" and passes; with them, a cluster
//! that does not answer is a failure.
//!
//! Every test makes its own volumes (names unique to the run) and removes them, with their
//! snapshots, publications and any blocklist entry, however it ends.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use moor_controller::backend::{
    AccessMode, AccessType, Backend, Capability, CapacityQuery, CapacityRange, ContentSource,
    ExpandRequest, NewSnapshot, NewVolume, PageRequest, Parameters, PublishRequest, SnapshotFilter,
};
use moor_controller::error::Error;
use moor_controller::rbd::clusters::Clusters;
use moor_controller::rbd::ids::{SnapshotId, VolumeId};
use moor_controller::rbd::{self, RbdBackend};
use moor_controller::secrets::{self, Secrets};
use moor_controller::service::ControllerService;
use moor_proto::csi::v1 as csi;
use moor_rbd::{Auth, Cluster, ConnectOptions, Pool, Secret};
use tonic::Code;

const MIB: u64 = 1 << 20;
const CLUSTER_ID: &str = "live";

/// Where the test cluster is.
struct Env {
    mon_host: String,
    user: String,
    keyring: PathBuf,
    key: String,
    pool: String,
}

impl Env {
    fn get() -> Option<Env> {
        let conf = PathBuf::from(std::env::var_os("MOOR_CEPH_CONF")?);
        let keyring = PathBuf::from(std::env::var_os("MOOR_CEPH_KEYRING")?);
        let conf_text = std::fs::read_to_string(&conf)
            .unwrap_or_else(|e| panic!("MOOR_CEPH_CONF={}: {e}", conf.display()));
        let mon_host = conf_text
            .lines()
            .filter_map(|l| l.split_once('='))
            .find(|(k, _)| matches!(k.trim(), "mon host" | "mon_host"))
            .map(|(_, v)| v.trim().to_owned())
            .unwrap_or_else(|| panic!("no mon host in {}", conf.display()));
        let user = std::env::var("MOOR_CEPH_USER").unwrap_or_else(|_| "moor".into());
        let text = std::fs::read_to_string(&keyring)
            .unwrap_or_else(|e| panic!("MOOR_CEPH_KEYRING={}: {e}", keyring.display()));
        let key = text
            .lines()
            .filter_map(|l| l.trim().strip_prefix("key"))
            .filter_map(|l| l.trim().strip_prefix('='))
            .map(|k| k.trim().to_string())
            .next()
            .unwrap_or_else(|| panic!("no key in {}", keyring.display()));
        let pool = std::env::var("MOOR_CEPH_POOL").unwrap_or_else(|_| "moor".into());
        Some(Env {
            mon_host,
            user,
            keyring,
            key,
            pool,
        })
    }

    /// The backend, with the cluster in its list as "live"; with the controller's own
    /// credentials (the keyring) when `own` is set.
    fn backend(&self, own: bool) -> RbdBackend {
        let mut entry = serde_json::json!({
            "clusterID": CLUSTER_ID,
            "monitors": [self.mon_host],
        });
        if own {
            entry["user"] = self.user.clone().into();
            entry["keyring"] = self.keyring.display().to_string().into();
        }
        let clusters = Clusters::from_json(&serde_json::json!([entry]).to_string()).unwrap();
        let mut config = rbd::Config::new(clusters);
        // Clients fenced by the tests are let go soon, should the cleanup not remove them.
        config.fence_expiry = Duration::from_secs(600);
        RbdBackend::new(config)
    }

    /// The CSI secrets a StorageClass would give.
    fn secrets(&self) -> Secrets {
        Secrets::from_pairs([("userID", self.user.as_str()), ("userKey", &self.key)])
    }

    fn params(&self) -> Parameters {
        Parameters::from([
            ("backend".to_string(), "rbd".to_string()),
            ("clusterID".to_string(), CLUSTER_ID.to_string()),
            ("pool".to_string(), self.pool.clone()),
        ])
    }

    /// A connection of its own: a "node" or an observer.
    fn client(&self) -> Cluster {
        let options = ConnectOptions::new(
            &self.mon_host,
            &self.user,
            Auth::Key(Secret::new(self.key.clone())),
        )
        .option("rbd_cache", "false");
        Cluster::connect(&options).expect("connect to the test cluster")
    }

    /// The cluster's administrator, when its keyring is next to ceph.conf (`.ci/ceph-cluster`).
    fn admin(&self) -> Option<Cluster> {
        let conf = PathBuf::from(std::env::var_os("MOOR_CEPH_CONF")?);
        let keyring = conf.parent()?.join("ceph.client.admin.keyring");
        keyring.exists().then_some(())?;
        let options = ConnectOptions::new(&self.mon_host, "admin", Auth::Keyring(keyring));
        Cluster::connect(&options).ok()
    }

    fn pool(&self) -> Pool {
        self.client().pool(&self.pool).unwrap()
    }
}

macro_rules! cluster_or_skip {
    () => {
        match Env::get() {
            Some(env) => env,
            None => {
                eprintln!(
                    "skipped: no Ceph cluster (MOOR_CEPH_CONF and MOOR_CEPH_KEYRING unset; \
                     `.ci/ceph-cluster up DIR` then `. DIR/env`)"
                );
                return;
            }
        }
    };
}

/// A name unique to this run.
fn name(what: &str) -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    format!(
        "pvc-{}-{}-{what}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

fn cap(mode: AccessMode) -> Capability {
    Capability {
        access: AccessType::Mount { fs_type: None },
        mode,
    }
}

fn new_volume(env: &Env, name: &str, size: u64, source: Option<ContentSource>) -> NewVolume {
    NewVolume {
        name: name.to_string(),
        capacity: Some(CapacityRange {
            required: size,
            limit: 0,
        }),
        capabilities: vec![cap(AccessMode::SingleNodeWriter)],
        parameters: env.params(),
        source,
        accessibility: None,
    }
}

fn publish(id: &str, node: &str, mode: AccessMode, readonly: bool) -> PublishRequest {
    PublishRequest {
        volume_id: id.to_string(),
        node_id: node.to_string(),
        capability: cap(mode),
        readonly,
        context: Parameters::new(),
    }
}

/// Removes what a test made, however it ends: publications, snapshots, then volumes (the
/// last made first), and blocklist entries it caused.
struct Cleanup<'a> {
    env: &'a Env,
    backend: &'a RbdBackend,
    volumes: Vec<String>,
    snapshots: Vec<String>,
    fenced: Vec<String>,
}

impl<'a> Cleanup<'a> {
    fn new(env: &'a Env, backend: &'a RbdBackend) -> Self {
        Self {
            env,
            backend,
            volumes: Vec::new(),
            snapshots: Vec::new(),
            fenced: Vec::new(),
        }
    }

    fn volume(&mut self, id: &str) -> String {
        self.volumes.push(id.to_string());
        id.to_string()
    }

    fn snapshot(&mut self, id: &str) -> String {
        self.snapshots.push(id.to_string());
        id.to_string()
    }
}

impl Drop for Cleanup<'_> {
    fn drop(&mut self) {
        secrets::scope(self.env.secrets(), || {
            for v in &self.volumes {
                let _ = self.backend.unpublish_volume(v, None);
            }
            for s in self.snapshots.iter().rev() {
                let _ = self.backend.delete_snapshot(s);
            }
            for v in self.volumes.iter().rev() {
                if let Err(e) = self.backend.delete_volume(v) {
                    eprintln!("cleanup: delete {v}: {e}");
                }
            }
        });
        // Lifting a fence takes the administrator (the rbd profile may only add entries): the
        // test cluster's admin keyring is next to its ceph.conf.
        if !self.fenced.is_empty()
            && let Some(admin) = self.env.admin()
        {
            for a in &self.fenced {
                if let Err(e) = admin.blocklist_remove(a) {
                    eprintln!("cleanup: blocklist rm {a}: {e}");
                }
            }
        }
    }
}

fn image_names(env: &Env) -> BTreeSet<String> {
    env.pool()
        .images()
        .unwrap()
        .into_iter()
        .map(|i| i.name)
        .collect()
}

fn metadata_keys(env: &Env) -> BTreeSet<String> {
    env.pool()
        .metadata_list("moor.", None, 0)
        .unwrap()
        .into_iter()
        .map(|(k, _)| k)
        .collect()
}

fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1000.0)
}

#[test]
fn create_is_idempotent_by_name_and_delete_removes_everything() {
    let env = cluster_or_skip!();
    let b = env.backend(false);
    let mut cleanup = Cleanup::new(&env, &b);
    secrets::scope(env.secrets(), || {
        let n = name("create");
        let v = b
            .create_volume(&new_volume(&env, &n, 64 * MIB, None))
            .unwrap();
        cleanup.volume(&v.id);
        let id = VolumeId::parse(&v.id).expect("an rbd volume id");
        assert!(v.id.len() <= 128, "{}", v.id);
        assert_eq!(id.location.pool, env.pool);
        assert_eq!(v.capacity_bytes, 64 * MIB);
        assert_eq!(v.context["pool"], env.pool);
        assert_eq!(v.context["imageName"], id.image());
        assert_eq!(v.context["clusterID"], CLUSTER_ID);
        assert!(
            v.topology.is_empty(),
            "an image is reachable from every node"
        );

        let open = env.pool().open_image_read_only(&id.image()).unwrap();
        assert_eq!(open.size().unwrap(), 64 * MIB);
        assert_eq!(open.features().unwrap(), moor_rbd::Features::MOOR_DEFAULT);
        drop(open);

        // Same name and request: the same volume.
        let again = b
            .create_volume(&new_volume(&env, &n, 64 * MIB, None))
            .unwrap();
        assert_eq!(again, v);
        // Same name, another size: ALREADY_EXISTS.
        let e = b
            .create_volume(&new_volume(&env, &n, 128 * MIB, None))
            .unwrap_err();
        assert!(matches!(e, Error::VolumeExists { .. }), "{e}");
        // Same name, other parameters.
        let mut other = new_volume(&env, &n, 64 * MIB, None);
        other
            .parameters
            .insert("imageFeatures".into(), "layering".into());
        let e = b.create_volume(&other).unwrap_err();
        assert!(matches!(e, Error::VolumeExists { .. }), "{e}");

        let status = b.get_volume(&v.id).unwrap();
        assert_eq!(status.volume, v);
        assert!(!status.condition.abnormal, "{:?}", status.condition);

        b.delete_volume(&v.id).unwrap();
        assert!(
            !image_names(&env).contains(&id.image()),
            "the image is removed"
        );
        assert!(
            !metadata_keys(&env)
                .iter()
                .any(|k| k.contains(&id.suffix) || k.ends_with(&n)),
            "its records are removed"
        );
        assert!(matches!(b.get_volume(&v.id), Err(Error::VolumeNotFound(_))));
        // Deleting again, or something that never existed, is success.
        b.delete_volume(&v.id).unwrap();
        b.delete_volume("rbd/live/moor/moor-vol-000000000000000000000000")
            .unwrap();
        b.delete_volume("rbd/nosuchcluster/moor/moor-vol-000000000000000000000000")
            .unwrap_err();
        // A new volume of the old name gets a new id.
        let v2 = b
            .create_volume(&new_volume(&env, &n, 64 * MIB, None))
            .unwrap();
        cleanup.volume(&v2.id);
        assert_ne!(v2.id, v.id);
    });
}

#[test]
fn credentials_come_from_the_secrets_or_the_cluster_list() {
    let env = cluster_or_skip!();
    let b = env.backend(false);
    let n = name("creds");
    // No secrets, no credentials of the controller's own: INVALID_ARGUMENT on secrets.
    let e = b
        .create_volume(&new_volume(&env, &n, 16 * MIB, None))
        .unwrap_err();
    assert!(
        matches!(
            e,
            Error::InvalidArgument {
                field: "secrets",
                ..
            }
        ),
        "{e}"
    );
    // A wrong key is refused, and never shown.
    let wrong = Secrets::from_pairs([
        ("userID", env.user.as_str()),
        ("userKey", "AQBwrongwrongwrongwrongwrongwrongwrongw=="),
    ]);
    let e = secrets::scope(wrong, || {
        b.create_volume(&new_volume(&env, &n, 16 * MIB, None))
    })
    .unwrap_err();
    assert!(!format!("{e} {e:?}").contains("AQBwrong"), "{e}");
    // The controller's own credentials, from its cluster list, serve requests without
    // secrets (ListVolumes, GetCapacity, ControllerGetVolume carry none).
    let own = env.backend(true);
    let mut cleanup = Cleanup::new(&env, &own);
    let v = own
        .create_volume(&new_volume(&env, &n, 16 * MIB, None))
        .unwrap();
    cleanup.volume(&v.id);
    assert_eq!(own.get_volume(&v.id).unwrap().volume.id, v.id);
    let listed = own.list_volumes(&PageRequest::default()).unwrap();
    assert!(listed.entries.iter().any(|s| s.volume.id == v.id));
    let c = own
        .capacity(&CapacityQuery {
            parameters: own.parse_parameters(&env.params()).unwrap(),
            topology: None,
        })
        .unwrap();
    assert!(c.available > 0, "{c:?}");
}

#[test]
fn expand_grows_the_image_and_never_shrinks_it() {
    let env = cluster_or_skip!();
    let b = env.backend(false);
    let mut cleanup = Cleanup::new(&env, &b);
    secrets::scope(env.secrets(), || {
        let v = b
            .create_volume(&new_volume(&env, &name("expand"), 32 * MIB, None))
            .unwrap();
        cleanup.volume(&v.id);
        let image = VolumeId::parse(&v.id).unwrap().image();
        let expand = |required, limit| ExpandRequest {
            volume_id: v.id.clone(),
            capacity: CapacityRange { required, limit },
            capability: None,
        };
        assert_eq!(b.expand_volume(&expand(48 * MIB + 1, 0)).unwrap(), 49 * MIB);
        let size = env
            .pool()
            .open_image_read_only(&image)
            .unwrap()
            .size()
            .unwrap();
        assert_eq!(size, 49 * MIB);
        assert_eq!(b.get_volume(&v.id).unwrap().volume.capacity_bytes, 49 * MIB);
        // Smaller: the volume stays as it is.
        assert_eq!(b.expand_volume(&expand(16 * MIB, 0)).unwrap(), 49 * MIB);
        let e = b.expand_volume(&expand(16 * MIB, 32 * MIB)).unwrap_err();
        assert!(matches!(e, Error::OutOfRange(_)), "{e}");
        let mut missing = expand(64 * MIB, 0);
        missing.volume_id = "rbd/live/moor/moor-vol-000000000000000000000000".into();
        assert!(matches!(
            b.expand_volume(&missing),
            Err(Error::VolumeNotFound(_))
        ));
        // GetCapacity: the pool's.
        let c = b
            .capacity(&CapacityQuery {
                parameters: b.parse_parameters(&env.params()).unwrap(),
                topology: None,
            })
            .unwrap();
        let pool_avail = env.pool().capacity().unwrap().available_bytes;
        assert!(c.available > 0);
        // The pool's figure moves a little as other tests write: same order of magnitude.
        assert!(c.available / 2 < pool_avail && pool_avail / 2 < c.available);
    });
}

fn write(env: &Env, image: &str, offset: u64, data: &[u8]) {
    let open = env.pool().open_image(image).unwrap();
    open.write(offset, data).unwrap();
    open.flush().unwrap();
}

fn read(env: &Env, image: &str, offset: u64, len: usize) -> Vec<u8> {
    env.pool()
        .open_image_read_only(image)
        .unwrap()
        .read(offset, len)
        .unwrap()
}

#[test]
fn snapshots_restore_and_clones_keep_their_data_and_deletes_wait_for_dependents() {
    let env = cluster_or_skip!();
    let b = env.backend(false);
    let mut cleanup = Cleanup::new(&env, &b);
    secrets::scope(env.secrets(), || {
        let a = b
            .create_volume(&new_volume(&env, &name("origin"), 32 * MIB, None))
            .unwrap();
        cleanup.volume(&a.id);
        let a_image = VolumeId::parse(&a.id).unwrap().image();
        write(&env, &a_image, 4096, b"before the snapshot");

        let sname = name("snap");
        let started = Instant::now();
        let s = b
            .create_snapshot(&NewSnapshot {
                name: sname.clone(),
                source_volume_id: a.id.clone(),
                parameters: Parameters::new(),
            })
            .unwrap();
        eprintln!("timing: snapshot {}", ms(started.elapsed()));
        cleanup.snapshot(&s.id);
        assert!(SnapshotId::parse(&s.id).is_some(), "{}", s.id);
        assert_eq!(s.source_volume_id, a.id);
        assert_eq!(s.size_bytes, 32 * MIB);
        assert!(s.ready_to_use);
        // Idempotent by name; the same name from another volume is ALREADY_EXISTS.
        let again = b
            .create_snapshot(&NewSnapshot {
                name: sname.clone(),
                source_volume_id: a.id.clone(),
                parameters: Parameters::new(),
            })
            .unwrap();
        assert_eq!(again, s);
        let other = b
            .create_volume(&new_volume(&env, &name("other"), 16 * MIB, None))
            .unwrap();
        cleanup.volume(&other.id);
        let e = b
            .create_snapshot(&NewSnapshot {
                name: sname.clone(),
                source_volume_id: other.id.clone(),
                parameters: Parameters::new(),
            })
            .unwrap_err();
        assert!(matches!(e, Error::SnapshotExists { .. }), "{e}");
        let e = b
            .create_snapshot(&NewSnapshot {
                name: name("badparam"),
                source_volume_id: a.id.clone(),
                parameters: Parameters::from([("pool".into(), "elsewhere".into())]),
            })
            .unwrap_err();
        assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
        // After the snapshot, the volume changes; the snapshot does not.
        write(&env, &a_image, 4096, b"after  the snapshot");

        // ListSnapshots: by id, by source, and all.
        let by_id = b
            .list_snapshots(
                &SnapshotFilter {
                    snapshot_id: Some(s.id.clone()),
                    source_volume_id: None,
                },
                &PageRequest::default(),
            )
            .unwrap();
        assert_eq!(by_id.entries, vec![s.clone()]);
        let by_source = b
            .list_snapshots(
                &SnapshotFilter {
                    snapshot_id: None,
                    source_volume_id: Some(a.id.clone()),
                },
                &PageRequest::default(),
            )
            .unwrap();
        assert_eq!(by_source.entries, vec![s.clone()]);
        let none = b
            .list_snapshots(
                &SnapshotFilter {
                    snapshot_id: None,
                    source_volume_id: Some(other.id.clone()),
                },
                &PageRequest::default(),
            )
            .unwrap();
        assert!(none.entries.is_empty());
        let all = b
            .list_snapshots(&SnapshotFilter::default(), &PageRequest::default())
            .unwrap();
        assert!(all.entries.contains(&s));
        assert_eq!(b.get_snapshot(&s.id).unwrap(), s);

        // A volume from the snapshot, bigger than it: the snapshot's data.
        let started = Instant::now();
        let restored = b
            .create_volume(&new_volume(
                &env,
                &name("restored"),
                48 * MIB,
                Some(ContentSource::Snapshot(s.id.clone())),
            ))
            .unwrap();
        eprintln!("timing: clone from a snapshot {}", ms(started.elapsed()));
        cleanup.volume(&restored.id);
        assert_eq!(restored.capacity_bytes, 48 * MIB);
        assert_eq!(restored.source, Some(ContentSource::Snapshot(s.id.clone())));
        let r_image = VolumeId::parse(&restored.id).unwrap().image();
        assert_eq!(read(&env, &r_image, 4096, 19), b"before the snapshot");
        assert_eq!(
            env.pool()
                .open_image_read_only(&r_image)
                .unwrap()
                .size()
                .unwrap(),
            48 * MIB
        );
        // Smaller than the snapshot: OUT_OF_RANGE.
        let mut small = new_volume(
            &env,
            &name("small"),
            16 * MIB,
            Some(ContentSource::Snapshot(s.id.clone())),
        );
        small.capacity = Some(CapacityRange {
            required: 16 * MIB,
            limit: 16 * MIB,
        });
        assert!(matches!(b.create_volume(&small), Err(Error::OutOfRange(_))));
        assert!(
            !metadata_keys(&env).iter().any(|k| k.ends_with(&small.name)),
            "a failed create leaves no record"
        );
        // A snapshot that does not exist: NOT_FOUND.
        let e = b
            .create_volume(&new_volume(
                &env,
                &name("nosnap"),
                16 * MIB,
                Some(ContentSource::Snapshot(
                    "rbd/live/moor/moor-snap-000000000000000000000000".into(),
                )),
            ))
            .unwrap_err();
        assert!(matches!(e, Error::SourceNotFound { .. }), "{e}");
        assert!(!metadata_keys(&env).iter().any(|k| k.contains("-nosnap")));

        // A clone of the volume itself: its data now.
        let started = Instant::now();
        let cloned = b
            .create_volume(&new_volume(
                &env,
                &name("cloned"),
                32 * MIB,
                Some(ContentSource::Volume(a.id.clone())),
            ))
            .unwrap();
        eprintln!("timing: clone from a volume {}", ms(started.elapsed()));
        cleanup.volume(&cloned.id);
        let c_image = VolumeId::parse(&cloned.id).unwrap().image();
        assert_eq!(read(&env, &c_image, 4096, 19), b"after  the snapshot");
        // Writing the clone leaves its source alone.
        write(&env, &c_image, 4096, b"written in the clone");
        assert_eq!(read(&env, &a_image, 4096, 19), b"after  the snapshot");

        // Delete the origin while a snapshot and a clone depend on it: success, the volume is
        // gone for the CO, its image stays for them.
        b.delete_volume(&a.id).unwrap();
        assert!(matches!(b.get_volume(&a.id), Err(Error::VolumeNotFound(_))));
        let listed = b.list_volumes(&PageRequest::default()).unwrap();
        assert!(!listed.entries.iter().any(|v| v.volume.id == a.id));
        assert!(
            image_names(&env).contains(&a_image),
            "kept for its dependents"
        );
        // Deleting it again is still success.
        b.delete_volume(&a.id).unwrap();
        // Its snapshot still restores.
        let late = b
            .create_volume(&new_volume(
                &env,
                &name("late"),
                32 * MIB,
                Some(ContentSource::Snapshot(s.id.clone())),
            ))
            .unwrap();
        cleanup.volume(&late.id);
        assert_eq!(
            read(&env, &VolumeId::parse(&late.id).unwrap().image(), 4096, 19),
            b"before the snapshot"
        );

        // Delete the snapshot while volumes are cloned from it: success, gone for the CO.
        b.delete_snapshot(&s.id).unwrap();
        assert!(matches!(
            b.get_snapshot(&s.id),
            Err(Error::SnapshotNotFound(_))
        ));
        b.delete_snapshot(&s.id).unwrap();

        // Remove the dependents one by one: the origin's image goes with the last.
        let started = Instant::now();
        b.delete_volume(&restored.id).unwrap();
        eprintln!("timing: delete a clone {}", ms(started.elapsed()));
        b.delete_volume(&late.id).unwrap();
        assert!(
            image_names(&env).contains(&a_image),
            "the volume clone remains"
        );
        b.delete_volume(&cloned.id).unwrap();
        let images = image_names(&env);
        for gone in [&a_image, &r_image, &c_image] {
            assert!(!images.contains(gone), "{gone} is removed");
        }
        let keys = metadata_keys(&env);
        for id in [&a.id, &restored.id, &cloned.id, &late.id] {
            let suffix = VolumeId::parse(id).unwrap().suffix;
            assert!(
                !keys.iter().any(|k| k.contains(&suffix)),
                "records of {id} remain"
            );
        }
        let ssuffix = SnapshotId::parse(&s.id).unwrap().suffix;
        assert!(!keys.iter().any(|k| k.contains(&ssuffix)));
    });
}

#[test]
fn list_volumes_pages_by_id() {
    let env = cluster_or_skip!();
    let b = env.backend(false);
    let mut cleanup = Cleanup::new(&env, &b);
    secrets::scope(env.secrets(), || {
        let mut mine = BTreeSet::new();
        for i in 0..5 {
            let v = b
                .create_volume(&new_volume(&env, &name(&format!("page{i}")), 8 * MIB, None))
                .unwrap();
            mine.insert(cleanup.volume(&v.id));
        }
        let mut seen = Vec::new();
        let mut token = None;
        for round in 0.. {
            assert!(round < 10_000, "the pages do not end");
            let page = b
                .list_volumes(&PageRequest {
                    max_entries: 2,
                    starting_token: token.clone(),
                })
                .unwrap();
            assert!(page.entries.len() <= 2);
            seen.extend(page.entries.iter().map(|s| s.volume.id.clone()));
            match page.next_token {
                Some(t) => token = Some(t),
                None => break,
            }
        }
        let seen_set: BTreeSet<String> = seen.iter().cloned().collect();
        assert_eq!(seen_set.len(), seen.len(), "no volume twice: {seen:?}");
        assert!(mine.is_subset(&seen_set), "{mine:?} in {seen:?}");
        let e = b
            .list_volumes(&PageRequest {
                max_entries: 2,
                starting_token: Some("not-a-token".into()),
            })
            .unwrap_err();
        assert!(matches!(e, Error::InvalidToken { .. }), "{e}");
    });
}

#[test]
fn a_volume_is_published_at_one_writer_node_or_many_readers() {
    let env = cluster_or_skip!();
    let b = env.backend(false);
    let mut cleanup = Cleanup::new(&env, &b);
    secrets::scope(env.secrets(), || {
        let v = b
            .create_volume(&new_volume(&env, &name("publish"), 8 * MIB, None))
            .unwrap();
        cleanup.volume(&v.id);
        let id = VolumeId::parse(&v.id).unwrap();
        let started = Instant::now();
        let ctx = b
            .publish_volume(&publish(
                &v.id,
                "node-a",
                AccessMode::SingleNodeWriter,
                false,
            ))
            .unwrap();
        eprintln!("timing: publish {}", ms(started.elapsed()));
        assert_eq!(ctx["rbdPool"], env.pool);
        assert_eq!(ctx["rbdImage"], id.image());
        assert_eq!(ctx["rbdMonitors"], env.mon_host);
        assert_eq!(ctx["rbdClusterID"], CLUSTER_ID);
        assert_eq!(ctx["rbdReadOnly"], "false");
        // Idempotent at the same node.
        assert_eq!(
            b.publish_volume(&publish(
                &v.id,
                "node-a",
                AccessMode::SingleNodeWriter,
                false
            ))
            .unwrap(),
            ctx
        );
        // The same node read-only: ALREADY_EXISTS.
        let e = b
            .publish_volume(&publish(
                &v.id,
                "node-a",
                AccessMode::SingleNodeWriter,
                true,
            ))
            .unwrap_err();
        assert!(matches!(e, Error::PublishedIncompatible { .. }), "{e}");
        // A second node: FAILED_PRECONDITION, however it asks.
        for mode in [
            AccessMode::SingleNodeWriter,
            AccessMode::MultiNodeReaderOnly,
        ] {
            let e = b
                .publish_volume(&publish(&v.id, "node-b", mode, false))
                .unwrap_err();
            assert!(matches!(e, Error::PublishedElsewhere { .. }), "{e}");
            assert_eq!(e.code(), Code::FailedPrecondition);
        }
        assert_eq!(
            b.get_volume(&v.id).unwrap().published_nodes,
            vec!["node-a".to_string()]
        );
        // Not deletable while published.
        assert!(matches!(
            b.delete_volume(&v.id),
            Err(Error::VolumeInUse { .. })
        ));
        // The publication survives the controller: a new backend sees it.
        let restarted = env.backend(false);
        let e = restarted
            .publish_volume(&publish(
                &v.id,
                "node-b",
                AccessMode::SingleNodeWriter,
                false,
            ))
            .unwrap_err();
        assert!(matches!(e, Error::PublishedElsewhere { .. }), "{e}");
        // Unpublished at node-a (nothing held it: no fencing), node-b may have it.
        let started = Instant::now();
        b.unpublish_volume(&v.id, Some("node-a")).unwrap();
        eprintln!("timing: unpublish {}", ms(started.elapsed()));
        b.unpublish_volume(&v.id, Some("node-a")).unwrap();
        b.publish_volume(&publish(
            &v.id,
            "node-b",
            AccessMode::SingleNodeWriter,
            false,
        ))
        .unwrap();
        b.unpublish_volume(&v.id, None).unwrap();
        assert!(b.get_volume(&v.id).unwrap().published_nodes.is_empty());

        // Many readers.
        let mut nodes = Vec::new();
        for n in ["r1", "r2", "r3"] {
            let ctx = b
                .publish_volume(&publish(&v.id, n, AccessMode::MultiNodeReaderOnly, false))
                .unwrap();
            assert_eq!(ctx["rbdReadOnly"], "true");
            nodes.push(n.to_string());
        }
        assert_eq!(b.get_volume(&v.id).unwrap().published_nodes, nodes);
        // No writer while readers have it.
        let e = b
            .publish_volume(&publish(&v.id, "w", AccessMode::SingleNodeWriter, false))
            .unwrap_err();
        assert!(matches!(e, Error::PublishedElsewhere { .. }), "{e}");
        b.unpublish_volume(&v.id, Some("r2")).unwrap();
        assert_eq!(
            b.get_volume(&v.id).unwrap().published_nodes,
            vec!["r1".to_string(), "r3".to_string()]
        );
        b.unpublish_volume(&v.id, None).unwrap();
        // Modes an image cannot serve are refused.
        let e = b
            .publish_volume(&publish(
                &v.id,
                "x",
                AccessMode::MultiNodeMultiWriter,
                false,
            ))
            .unwrap_err();
        assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
        // Unknown volumes.
        let e = b
            .publish_volume(&publish(
                "rbd/live/moor/moor-vol-000000000000000000000000",
                "n",
                AccessMode::SingleNodeWriter,
                false,
            ))
            .unwrap_err();
        assert!(matches!(e, Error::VolumeNotFound(_)), "{e}");
        b.unpublish_volume("rbd/live/moor/moor-vol-000000000000000000000000", None)
            .unwrap();
    });
}

#[test]
fn unpublishing_a_node_that_still_holds_the_image_fences_it() {
    let env = cluster_or_skip!();
    let b = env.backend(false);
    let mut cleanup = Cleanup::new(&env, &b);
    let v = secrets::scope(env.secrets(), || {
        b.create_volume(&new_volume(&env, &name("fence"), 8 * MIB, None))
            .unwrap()
    });
    cleanup.volume(&v.id);
    let image = VolumeId::parse(&v.id).unwrap().image();
    secrets::scope(env.secrets(), || {
        b.publish_volume(&publish(
            &v.id,
            "node-a",
            AccessMode::SingleNodeWriter,
            false,
        ))
        .unwrap();
    });

    // Node A maps the image: a client of its own holds it open, takes the lock, writes.
    let node_a = env.client();
    let at_a = node_a.pool(&env.pool).unwrap().open_image(&image).unwrap();
    at_a.acquire_exclusive_lock().unwrap();
    at_a.write(0, b"written by node A").unwrap();
    at_a.flush().unwrap();
    let a_address = at_a
        .watchers()
        .unwrap()
        .into_iter()
        .find(|w| u64::try_from(w.client_id).ok() == Some(node_a.instance_id()))
        .expect("node A watches the image")
        .address;
    cleanup.fenced.push(a_address.clone());

    // Node A dies holding it; the CO force-detaches (ControllerUnpublishVolume at node A).
    let started = Instant::now();
    secrets::scope(env.secrets(), || b.unpublish_volume(&v.id, Some("node-a"))).unwrap();
    eprintln!("timing: unpublish with fencing {}", ms(started.elapsed()));

    // Node A's late writes fail: it is blocklisted.
    let e = at_a.write(4096, b"late write from A").unwrap_err();
    assert_eq!(e.errno(), Some(libc::ESHUTDOWN), "{e}");
    // The fencing is recorded with the volume.
    let rec = moor_controller::rbd::records::Registry::new(&env.pool())
        .volume(&VolumeId::parse(&v.id).unwrap().suffix)
        .unwrap()
        .unwrap();
    assert_eq!(rec.fencings.len(), 1, "{:?}", rec.fencings);
    assert_eq!(rec.fencings[0].node_id, "node-a");
    assert_eq!(rec.fencings[0].addresses, vec![a_address.clone()]);

    // Node B gets the volume, takes the lock at once, and sees A's data but not the late
    // write. Then it goes the same way, mapped but idle (it watches the image, holds no
    // lock): fenced too, its first write after the force-detach fails.
    secrets::scope(env.secrets(), || {
        b.publish_volume(&publish(
            &v.id,
            "node-b",
            AccessMode::SingleNodeWriter,
            false,
        ))
        .unwrap();
    });
    let node_b = env.client();
    let at_b = node_b.pool(&env.pool).unwrap().open_image(&image).unwrap();
    at_b.acquire_exclusive_lock().unwrap();
    assert_eq!(at_b.read(0, 17).unwrap(), b"written by node A");
    assert_eq!(at_b.read(4096, 17).unwrap(), vec![0u8; 17]);
    at_b.write(4096, b"written by node B").unwrap();
    at_b.flush().unwrap();
    at_b.release_lock().unwrap();
    drop(at_b);
    let idle = node_b.pool(&env.pool).unwrap().open_image(&image).unwrap();
    assert_eq!(idle.read(4096, 17).unwrap(), b"written by node B");
    let b_address = idle
        .watchers()
        .unwrap()
        .into_iter()
        .find(|w| u64::try_from(w.client_id).ok() == Some(node_b.instance_id()))
        .expect("node B watches the image")
        .address;
    cleanup.fenced.push(b_address.clone());
    secrets::scope(env.secrets(), || b.unpublish_volume(&v.id, Some("node-b"))).unwrap();
    let e = idle.write(0, b"late write from B").unwrap_err();
    assert_eq!(e.errno(), Some(libc::ESHUTDOWN), "{e}");
    drop(idle);
    drop(at_a);
    drop(node_a);
    let observer = env.client();
    let at = observer
        .pool(&env.pool)
        .unwrap()
        .open_image(&image)
        .unwrap();
    assert_eq!(at.read(0, 17).unwrap(), b"written by node A");
}

#[test]
fn a_clean_unpublish_fences_no_one() {
    let env = cluster_or_skip!();
    let b = env.backend(false);
    let mut cleanup = Cleanup::new(&env, &b);
    secrets::scope(env.secrets(), || {
        let v = b
            .create_volume(&new_volume(&env, &name("clean"), 8 * MIB, None))
            .unwrap();
        cleanup.volume(&v.id);
        let image = VolumeId::parse(&v.id).unwrap().image();
        b.publish_volume(&publish(
            &v.id,
            "node-a",
            AccessMode::SingleNodeWriter,
            false,
        ))
        .unwrap();
        let node = env.client();
        {
            // Mapped, written, unmapped before the CO unpublishes.
            let at = node.pool(&env.pool).unwrap().open_image(&image).unwrap();
            at.acquire_exclusive_lock().unwrap();
            at.write(0, b"data").unwrap();
            at.close().unwrap();
        }
        b.unpublish_volume(&v.id, Some("node-a")).unwrap();
        let rec = moor_controller::rbd::records::Registry::new(&env.pool())
            .volume(&VolumeId::parse(&v.id).unwrap().suffix)
            .unwrap()
            .unwrap();
        assert!(rec.fencings.is_empty(), "{:?}", rec.fencings);
        // The node's client can still write (it was not blocklisted).
        let at = node.pool(&env.pool).unwrap().open_image(&image).unwrap();
        at.write(0, b"more").unwrap();
        at.flush().unwrap();
    });
}

/// Through the gRPC service: the request's secrets reach the backend, and the codes are the
/// spec's.
#[tokio::test]
async fn the_service_passes_each_requests_secrets_to_the_backend() {
    use csi::controller_server::Controller;
    use csi::volume_capability::{AccessMode as CsiMode, AccessType as CsiType, MountVolume};
    let env = cluster_or_skip!();
    let svc = ControllerService::new(std::sync::Arc::new(env.backend(false)));
    let secrets: HashMap<String, String> = HashMap::from([
        ("userID".to_string(), env.user.clone()),
        ("userKey".to_string(), env.key.clone()),
    ]);
    let params: HashMap<String, String> = env.params().into_iter().collect();
    let req = |secrets: HashMap<String, String>| csi::CreateVolumeRequest {
        name: name("grpc"),
        capacity_range: Some(csi::CapacityRange {
            required_bytes: (8 * MIB) as i64,
            limit_bytes: 0,
        }),
        volume_capabilities: vec![csi::VolumeCapability {
            access_mode: Some(CsiMode {
                mode: csi::volume_capability::access_mode::Mode::SingleNodeWriter as i32,
            }),
            access_type: Some(CsiType::Mount(MountVolume::default())),
        }],
        parameters: params.clone(),
        secrets,
        ..Default::default()
    };
    let e = svc
        .create_volume(tonic::Request::new(req(HashMap::new())))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains("secrets"), "{}", e.message());
    let v = svc
        .create_volume(tonic::Request::new(req(secrets.clone())))
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap();
    assert!(v.volume_id.starts_with("rbd/live/"), "{}", v.volume_id);
    // A controller that never had credentials for the cluster cannot delete without them.
    let fresh = ControllerService::new(std::sync::Arc::new(env.backend(false)));
    let e = fresh
        .delete_volume(tonic::Request::new(csi::DeleteVolumeRequest {
            volume_id: v.volume_id.clone(),
            secrets: HashMap::new(),
        }))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    svc.delete_volume(tonic::Request::new(csi::DeleteVolumeRequest {
        volume_id: v.volume_id.clone(),
        secrets,
    }))
    .await
    .unwrap();
}

/// Not a check: the costs the report quotes, printed (run with --nocapture).
#[test]
fn timings() {
    let env = cluster_or_skip!();
    let b = env.backend(false);
    let mut cleanup = Cleanup::new(&env, &b);
    secrets::scope(env.secrets(), || {
        let rounds: u32 = 5;
        let mut t: BTreeMap<&str, Duration> = BTreeMap::new();
        for i in 0..rounds {
            let started = Instant::now();
            let v = b
                .create_volume(&new_volume(&env, &name(&format!("t{i}")), 1 << 30, None))
                .unwrap();
            *t.entry("create 1 GiB").or_default() += started.elapsed();
            cleanup.volume(&v.id);
            let started = Instant::now();
            b.publish_volume(&publish(&v.id, "n", AccessMode::SingleNodeWriter, false))
                .unwrap();
            *t.entry("publish").or_default() += started.elapsed();
            let started = Instant::now();
            b.unpublish_volume(&v.id, None).unwrap();
            *t.entry("unpublish").or_default() += started.elapsed();
            let started = Instant::now();
            let s = b
                .create_snapshot(&NewSnapshot {
                    name: name("ts"),
                    source_volume_id: v.id.clone(),
                    parameters: Parameters::new(),
                })
                .unwrap();
            *t.entry("snapshot").or_default() += started.elapsed();
            cleanup.snapshot(&s.id);
            let started = Instant::now();
            let c = b
                .create_volume(&new_volume(
                    &env,
                    &name("tc"),
                    1 << 30,
                    Some(ContentSource::Snapshot(s.id.clone())),
                ))
                .unwrap();
            *t.entry("clone from snapshot").or_default() += started.elapsed();
            let started = Instant::now();
            b.delete_volume(&c.id).unwrap();
            *t.entry("delete clone").or_default() += started.elapsed();
            let started = Instant::now();
            b.delete_snapshot(&s.id).unwrap();
            *t.entry("delete snapshot").or_default() += started.elapsed();
            let started = Instant::now();
            b.delete_volume(&v.id).unwrap();
            *t.entry("delete 1 GiB").or_default() += started.elapsed();
        }
        for (what, total) in t {
            eprintln!("timing: {what} {} (mean of {rounds})", ms(total / rounds));
        }
    });
}

/// A CreateVolume or DeleteVolume interrupted at any step (the controller killed, the cluster
/// out of reach) leaves records its retry finishes: each state is set up here as a crash
/// would leave it.
#[test]
fn an_interrupted_create_or_delete_is_finished_by_its_retry() {
    use moor_controller::rbd::records::{Registry, VolumeState};
    let env = cluster_or_skip!();
    let b = env.backend(false);
    let mut cleanup = Cleanup::new(&env, &b);
    let pool = env.pool();
    let reg = Registry::new(&pool);
    secrets::scope(env.secrets(), || {
        // Killed after the name index was written, before the record.
        let n = name("after-index");
        let suffix = moor_controller::rbd::ids::random_suffix().unwrap();
        reg.name_volume(&n, &suffix).unwrap();
        let v = b
            .create_volume(&new_volume(&env, &n, 8 * MIB, None))
            .unwrap();
        cleanup.volume(&v.id);
        assert_eq!(
            VolumeId::parse(&v.id).unwrap().suffix,
            suffix,
            "the named id is used"
        );
        assert!(image_names(&env).contains(&VolumeId::parse(&v.id).unwrap().image()));

        // Killed after the image was made, before the record said ready.
        let n = name("before-ready");
        let v = b
            .create_volume(&new_volume(&env, &n, 8 * MIB, None))
            .unwrap();
        cleanup.volume(&v.id);
        let id = VolumeId::parse(&v.id).unwrap();
        let mut rec = reg.volume(&id.suffix).unwrap().unwrap();
        rec.state = VolumeState::Creating;
        reg.put_volume(&id.suffix, &rec).unwrap();
        assert!(matches!(b.get_volume(&v.id), Err(Error::VolumeNotFound(_))));
        let again = b
            .create_volume(&new_volume(&env, &n, 8 * MIB, None))
            .unwrap();
        assert_eq!(again.id, v.id);
        assert_eq!(
            reg.volume(&id.suffix).unwrap().unwrap().state,
            VolumeState::Ready
        );

        // Killed in a delete, after its name was freed, before the image went.
        rec.state = VolumeState::Deleting;
        reg.put_volume(&id.suffix, &rec).unwrap();
        reg.unname_volume(&n, &id.suffix).unwrap();
        b.delete_volume(&v.id).unwrap();
        assert!(!image_names(&env).contains(&id.image()));
        assert!(reg.volume(&id.suffix).unwrap().is_none());
        // The name makes a new volume now.
        let fresh = b
            .create_volume(&new_volume(&env, &n, 8 * MIB, None))
            .unwrap();
        cleanup.volume(&fresh.id);
        assert_ne!(fresh.id, v.id);
    });
}
