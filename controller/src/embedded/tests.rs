//! The embedded backend across restarts and crashes, with the fake attacher: whatever point a
//! controller dies at, start-up loses no volume and leaks no device.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::attach::{Attacher as _, FileId};
use super::fake::FakeAttacher;
use super::ids::VolumeId;
use super::reconcile::Report;
use super::records::{Publication, RecordStore};
use super::testdir::TestDir;
use super::*;
use crate::backend::{AccessMode, AccessType, Backend as _, Capability, NewSnapshot};

const MIB: u64 = 1 << 20;
const NODE: &str = "node-1";

type Fake = Arc<FakeAttacher>;

fn open(dir: &Path, fake: &Fake) -> (EmbeddedBackend<Fake>, Report) {
    EmbeddedBackend::open(
        Config {
            data_dir: dir.join("data"),
            node_id: NODE.into(),
            topology_key: "topology.moor.csi.io/node".into(),
        },
        Arc::clone(fake),
    )
    .unwrap()
}

fn new_volume(name: &str, bytes: u64) -> NewVolume {
    NewVolume {
        name: name.into(),
        capacity: Some(crate::backend::CapacityRange {
            required: bytes,
            limit: 0,
        }),
        capabilities: vec![Capability {
            access: AccessType::Block,
            mode: AccessMode::SingleNodeWriter,
        }],
        parameters: Parameters::new(),
        source: None,
        accessibility: None,
    }
}

fn publish_req(id: &str) -> PublishRequest {
    PublishRequest {
        volume_id: id.into(),
        node_id: NODE.into(),
        capability: Capability {
            access: AccessType::Block,
            mode: AccessMode::SingleNodeWriter,
        },
        readonly: false,
        context: Parameters::new(),
    }
}

fn records(b: &EmbeddedBackend<Fake>) -> RecordStore {
    RecordStore::open(&b.layout().records).unwrap().0
}

fn volume_record(b: &EmbeddedBackend<Fake>, id: &str) -> VolumeRecord {
    b.state().volumes.get(id).cloned().unwrap()
}

#[test]
fn restart_keeps_everything() {
    let dir = TestDir::new("emb-restart");
    let fake: Fake = Arc::new(FakeAttacher::new());
    let (b, report) = open(dir.path(), &fake);
    assert!(report.is_clean(), "{report:?}");
    let v = b.create_volume(&new_volume("pvc-1", 3 * MIB)).unwrap();
    let w = b.create_volume(&new_volume("pvc-2", MIB)).unwrap();
    let ctx = b.publish_volume(&publish_req(&v.id)).unwrap();
    let s = b
        .create_snapshot(&NewSnapshot {
            name: "s".into(),
            source_volume_id: w.id.clone(),
            parameters: Parameters::new(),
        })
        .unwrap();
    drop(b);
    let (b, report) = open(dir.path(), &fake);
    assert!(report.is_clean(), "{report:?}");
    assert_eq!(report.volumes, 2);
    assert_eq!(report.snapshots, 1);
    let got = b.get_volume(&v.id).unwrap();
    assert_eq!(got.volume, v);
    assert_eq!(got.published_nodes, vec![NODE.to_string()]);
    assert!(!got.condition.abnormal);
    // Publishing again is idempotent: the device survived the restart.
    assert_eq!(b.publish_volume(&publish_req(&v.id)).unwrap(), ctx);
    assert_eq!(fake.devices().len(), 1);
    assert_eq!(b.get_snapshot(&s.id).unwrap(), s);
    // The same name still means the same volume.
    assert_eq!(b.create_volume(&new_volume("pvc-2", MIB)).unwrap(), w);
}

#[test]
fn one_backend_per_data_dir() {
    let dir = TestDir::new("emb-lock");
    let fake: Fake = Arc::new(FakeAttacher::new());
    let (b, _) = open(dir.path(), &fake);
    let second = EmbeddedBackend::open(
        Config {
            data_dir: dir.path().join("data"),
            node_id: NODE.into(),
            topology_key: "k".into(),
        },
        Arc::clone(&fake),
    );
    assert!(matches!(second, Err(Error::Unavailable(_))));
    drop(b);
    let _ = open(dir.path(), &fake);
}

#[test]
fn crash_after_attach_before_record_is_adopted() {
    let dir = TestDir::new("emb-adopt");
    let fake: Fake = Arc::new(FakeAttacher::new());
    let (b, _) = open(dir.path(), &fake);
    let v = b.create_volume(&new_volume("pvc-1", MIB)).unwrap();
    // What a publish leaves when it dies between its attach and its final record: the intent
    // on record, the device bound.
    let mut rec = volume_record(&b, &v.id);
    rec.publication = Some(Publication {
        node_id: NODE.into(),
        readonly: false,
        device: None,
    });
    records(&b).put_volume(&rec).unwrap();
    let path = b.layout().volume_file(&VolumeId::parse(&v.id).unwrap());
    let dev = fake.bind(&path).unwrap();
    drop(b);
    let (b, report) = open(dir.path(), &fake);
    assert_eq!(report.adopted, vec![(v.id.clone(), dev.clone())]);
    assert!(report.detached.is_empty());
    let rec = volume_record(&b, &v.id);
    assert_eq!(
        rec.publication.unwrap().device.as_deref(),
        Some(dev.to_str().unwrap())
    );
    // The adoption was written down: a second restart is clean.
    drop(b);
    let (b, report) = open(dir.path(), &fake);
    assert!(report.is_clean(), "{report:?}");
    let ctx = b.publish_volume(&publish_req(&v.id)).unwrap();
    assert_eq!(ctx[DEVICE_PATH_KEY], dev.display().to_string());
    assert_eq!(fake.devices().len(), 1);
}

#[test]
fn crash_after_intent_before_attach_is_corrected() {
    let dir = TestDir::new("emb-intent");
    let fake: Fake = Arc::new(FakeAttacher::new());
    let (b, _) = open(dir.path(), &fake);
    let v = b.create_volume(&new_volume("pvc-1", MIB)).unwrap();
    let mut rec = volume_record(&b, &v.id);
    rec.publication = Some(Publication {
        node_id: NODE.into(),
        readonly: false,
        device: None,
    });
    records(&b).put_volume(&rec).unwrap();
    drop(b);
    let (b, report) = open(dir.path(), &fake);
    assert_eq!(report.corrected.len(), 1);
    assert!(b.get_volume(&v.id).unwrap().published_nodes.is_empty());
}

#[test]
fn leaked_devices_are_detached() {
    let dir = TestDir::new("emb-leak");
    let fake: Fake = Arc::new(FakeAttacher::new());
    let (b, _) = open(dir.path(), &fake);
    let v = b.create_volume(&new_volume("pvc-1", MIB)).unwrap();
    let w = b.create_volume(&new_volume("pvc-2", MIB)).unwrap();
    b.publish_volume(&publish_req(&w.id)).unwrap();
    let layout = b.layout().clone();
    let vpath = layout.volume_file(&VolumeId::parse(&v.id).unwrap());
    let wpath = layout.volume_file(&VolumeId::parse(&w.id).unwrap());
    // A device for a volume that is not published (an unpublish that died after its record
    // but before... or any stray attach), a second device for a published one, and a device
    // for a file of ours that has no record.
    let stray = fake.bind(&vpath).unwrap();
    let second = fake.bind(&wpath).unwrap();
    let orphan = layout.volumes.join("vol-00000000000000ee.img");
    std::fs::write(&orphan, b"x").unwrap();
    let orphan_dev = fake.bind(&orphan).unwrap();
    // Someone else's device is never touched.
    let foreign = dir.path().join("not-ours.img");
    std::fs::write(&foreign, b"x").unwrap();
    let foreign_dev = fake.bind(&foreign).unwrap();
    drop(b);
    let (b, report) = open(dir.path(), &fake);
    let mut detached: Vec<PathBuf> = report.detached.iter().map(|d| d.0.clone()).collect();
    detached.sort();
    let mut expected = vec![stray, second, orphan_dev];
    expected.sort();
    assert_eq!(detached, expected);
    assert_eq!(report.orphans_removed, vec![orphan.clone()]);
    assert!(!orphan.exists());
    let left: Vec<PathBuf> = fake.devices().into_iter().map(|d| d.0).collect();
    assert_eq!(left.len(), 2);
    assert!(left.contains(&foreign_dev));
    assert_eq!(b.get_volume(&w.id).unwrap().published_nodes.len(), 1);
}

#[test]
fn devices_of_deleted_files_are_detached() {
    let dir = TestDir::new("emb-deleted");
    let fake: Fake = Arc::new(FakeAttacher::new());
    let (b, _) = open(dir.path(), &fake);
    let v = b.create_volume(&new_volume("pvc-1", MIB)).unwrap();
    let path = b.layout().volume_file(&VolumeId::parse(&v.id).unwrap());
    let dev = fake.bind(&path).unwrap();
    // The volume's file replaced by another inode: the device backs a deleted file.
    std::fs::remove_file(&path).unwrap();
    std::fs::write(&path, b"new").unwrap();
    drop(b);
    let (_b, report) = open(dir.path(), &fake);
    assert_eq!(report.detached.len(), 1);
    assert_eq!(report.detached[0].0, dev);
    assert!(fake.devices().is_empty());
}

#[test]
fn records_naming_lost_devices_are_corrected() {
    let dir = TestDir::new("emb-lost");
    let fake: Fake = Arc::new(FakeAttacher::new());
    let (b, _) = open(dir.path(), &fake);
    let v = b.create_volume(&new_volume("pvc-1", MIB)).unwrap();
    let w = b.create_volume(&new_volume("pvc-2", MIB)).unwrap();
    let cv = b.publish_volume(&publish_req(&v.id)).unwrap();
    let cw = b.publish_volume(&publish_req(&w.id)).unwrap();
    drop(b);
    // A reboot took one device; the other's number now serves someone else.
    fake.remove(Path::new(&cv[DEVICE_PATH_KEY]));
    let other = dir.path().join("other.img");
    std::fs::write(&other, b"x").unwrap();
    fake.rebind(Path::new(&cw[DEVICE_PATH_KEY]), &other)
        .unwrap();
    let (b, report) = open(dir.path(), &fake);
    assert_eq!(report.corrected.len(), 2, "{report:?}");
    assert!(report.detached.is_empty(), "someone else's device stays");
    for id in [&v.id, &w.id] {
        assert!(b.get_volume(id).unwrap().published_nodes.is_empty());
    }
    assert_eq!(fake.devices().len(), 1);
    // Publishing again attaches anew.
    let again = b.publish_volume(&publish_req(&v.id)).unwrap();
    assert_eq!(fake.devices().len(), 2);
    assert!(!b.get_volume(&v.id).unwrap().condition.abnormal);
    assert_eq!(again[BACKING_FILE_KEY], cv[BACKING_FILE_KEY]);
}

#[test]
fn orphans_and_unfinished_copies_are_removed_but_set_aside_data_is_kept() {
    let dir = TestDir::new("emb-orphans");
    let fake: Fake = Arc::new(FakeAttacher::new());
    let (b, _) = open(dir.path(), &fake);
    let v = b.create_volume(&new_volume("pvc-1", MIB)).unwrap();
    let keep = b.create_volume(&new_volume("pvc-keep", MIB)).unwrap();
    let layout = b.layout().clone();
    drop(b);
    let tmp = layout.tmp.join("vol-00000000000000dd.img");
    std::fs::write(&tmp, b"half a copy").unwrap();
    let orphan_snap = layout.snapshots.join("snap-00000000000000dd.img");
    std::fs::write(&orphan_snap, b"x").unwrap();
    let unrelated = layout.volumes.join("README");
    std::fs::write(&unrelated, b"operator notes").unwrap();
    // A record torn by hand: its volume's data must survive.
    let rec = layout.records.join(format!("volumes/{}.json", keep.id));
    std::fs::write(&rec, b"{ not json").unwrap();
    let (b, report) = open(dir.path(), &fake);
    assert!(!tmp.exists());
    assert!(!orphan_snap.exists());
    assert!(unrelated.exists());
    assert_eq!(report.orphans_removed, vec![orphan_snap]);
    assert_eq!(report.set_aside.len(), 1);
    let keep_file = layout.volume_file(&VolumeId::parse(&keep.id).unwrap());
    assert!(keep_file.exists());
    assert!(b.get_volume(&v.id).is_ok());
    assert!(matches!(
        b.get_volume(&keep.id),
        Err(Error::VolumeNotFound(_))
    ));
    // Still protected at the next start.
    drop(b);
    let (b, _) = open(dir.path(), &fake);
    assert!(keep_file.exists());
    // An explicit delete of that id removes the data.
    b.delete_volume(&keep.id).unwrap();
    assert!(!keep_file.exists());
}

#[test]
fn sizes_follow_the_files() {
    let dir = TestDir::new("emb-sizes");
    let fake: Fake = Arc::new(FakeAttacher::new());
    let (b, _) = open(dir.path(), &fake);
    let v = b.create_volume(&new_volume("pvc-1", MIB)).unwrap();
    let path = b.layout().volume_file(&VolumeId::parse(&v.id).unwrap());
    drop(b);
    // A crash between growing the file and recording it.
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(5 * MIB)
        .unwrap();
    let (b, report) = open(dir.path(), &fake);
    assert_eq!(report.resized, vec![(v.id.clone(), 5 * MIB)]);
    assert_eq!(b.get_volume(&v.id).unwrap().volume.capacity_bytes, 5 * MIB);
    std::fs::remove_file(&path).unwrap();
    drop(b);
    let (b, report) = open(dir.path(), &fake);
    assert_eq!(report.missing_data, vec![v.id.clone()]);
    assert!(b.get_volume(&v.id).unwrap().condition.abnormal);
    b.delete_volume(&v.id).unwrap();
    assert!(b.get_volume(&v.id).is_err());
}

#[test]
fn conflicting_operations_are_aborted() {
    let dir = TestDir::new("emb-aborted");
    let fake: Fake = Arc::new(FakeAttacher::new());
    let (b, _) = open(dir.path(), &fake);
    let v = b.create_volume(&new_volume("pvc-1", MIB)).unwrap();
    let vid = VolumeId::parse(&v.id).unwrap();
    {
        let _busy = b.inflight.claim(&[&volume_key(&vid)], &[]).unwrap();
        for r in [
            b.delete_volume(&v.id),
            b.publish_volume(&publish_req(&v.id)).map(drop),
            b.unpublish_volume(&v.id, None),
        ] {
            assert!(matches!(r, Err(Error::OperationPending(_))), "{r:?}");
        }
        let snap = b.create_snapshot(&NewSnapshot {
            name: "s".into(),
            source_volume_id: v.id.clone(),
            parameters: Parameters::new(),
        });
        assert!(matches!(snap, Err(Error::OperationPending(_))));
    }
    {
        let _creating = b.inflight.claim(&["volume-name:pvc-2"], &[]).unwrap();
        assert!(matches!(
            b.create_volume(&new_volume("pvc-2", MIB)),
            Err(Error::OperationPending(_))
        ));
    }
    {
        // Being copied from (shared) blocks deletion but not another copy.
        let _reading = b.inflight.claim(&[], &[&volume_key(&vid)]).unwrap();
        assert!(matches!(
            b.delete_volume(&v.id),
            Err(Error::OperationPending(_))
        ));
        assert!(
            b.create_snapshot(&NewSnapshot {
                name: "s".into(),
                source_volume_id: v.id.clone(),
                parameters: Parameters::new(),
            })
            .is_ok()
        );
    }
    b.delete_volume(&v.id).unwrap();
}

#[test]
fn probe_reports_missing_loop_support() {
    let dir = TestDir::new("emb-probe");
    let fake: Fake = Arc::new(FakeAttacher::new());
    let (b, _) = open(dir.path(), &fake);
    assert!(b.probe().is_ok());
    fake.set_unavailable(true);
    let e = b.probe().unwrap_err();
    assert_eq!(e.code(), tonic::Code::FailedPrecondition);
}

#[test]
fn data_files_are_named_by_validated_ids_only() {
    let dir = TestDir::new("emb-paths");
    let fake: Fake = Arc::new(FakeAttacher::new());
    let (b, _) = open(dir.path(), &fake);
    let victim = dir.path().join("victim");
    std::fs::write(&victim, b"keep me").unwrap();
    for evil in [
        "../victim",
        "vol-../../victim",
        "/etc/passwd",
        "vol-0000000000000000/../../../victim",
    ] {
        b.delete_volume(evil).unwrap();
        b.delete_snapshot(evil).unwrap();
        assert!(matches!(
            b.publish_volume(&publish_req(evil)),
            Err(Error::VolumeNotFound(_))
        ));
    }
    assert_eq!(std::fs::read(&victim).unwrap(), b"keep me");
}

#[test]
fn clone_of_a_published_volume_flushes_and_copies() {
    use std::os::unix::fs::FileExt as _;
    let dir = TestDir::new("emb-clone");
    let fake: Fake = Arc::new(FakeAttacher::new());
    let (b, _) = open(dir.path(), &fake);
    let v = b.create_volume(&new_volume("pvc-1", 2 * MIB)).unwrap();
    b.publish_volume(&publish_req(&v.id)).unwrap();
    let path = b.layout().volume_file(&VolumeId::parse(&v.id).unwrap());
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .write_all_at(b"abc", MIB)
        .unwrap();
    let mut req = new_volume("pvc-clone", 0);
    req.capacity = None;
    req.source = Some(ContentSource::Volume(v.id.clone()));
    let c = b.create_volume(&req).unwrap();
    assert_eq!(
        c.capacity_bytes, DEFAULT_SIZE,
        "the default exceeds the source"
    );
    assert_eq!(fake.flushes(), 1);
    let cpath = b.layout().volume_file(&VolumeId::parse(&c.id).unwrap());
    let mut buf = [0u8; 3];
    std::fs::File::open(&cpath)
        .unwrap()
        .read_exact_at(&mut buf, MIB)
        .unwrap();
    assert_eq!(&buf, b"abc");
    assert_ne!(
        FileId::of_path(&cpath).unwrap(),
        FileId::of_path(&path).unwrap()
    );
    assert!(b.layout().tmp.read_dir().unwrap().next().is_none());
    assert!(fake.list(Path::new("/")).unwrap().len() == 1);
}

/// Who writes to a member is what the kernel says, not what the records say: a device bound
/// read-write to a member's file that no record names (one the records lost track of) must be
/// held like any other, so a group it cannot be held for is refused, never cut unheld.
#[test]
fn a_member_written_through_a_device_no_record_names_is_not_cut_unheld() {
    let dir = TestDir::new("emb-group-unrecorded");
    let fake: Fake = Arc::new(FakeAttacher::new());
    let (b, _) = open(dir.path(), &fake);
    let a = b.create_volume(&new_volume("a", MIB)).unwrap().id;
    let c = b.create_volume(&new_volume("c", MIB)).unwrap().id;
    let group = |name: &str| {
        b.create_group_snapshot(&crate::backend::NewGroupSnapshot {
            name: name.into(),
            source_volume_ids: vec![a.clone(), c.clone()],
            parameters: Parameters::new(),
        })
    };
    // Nobody writes: the group is cut.
    group("quiet").expect("a group of idle volumes");
    // A device bound read-write to `c` that no record names: the records say nobody writes.
    let file = b.layout().volume_file(&VolumeId::parse(&c).unwrap());
    let dev = fake.bind(&file).unwrap();
    assert!(volume_record(&b, &c).publication.is_none());
    let e = group("busy").expect_err("a writer that cannot be held");
    assert!(
        matches!(&e, Error::GroupRefused(m) if m.contains(&dev.display().to_string())),
        "{e}"
    );
    assert_eq!(b.state().groups.len(), 1, "only the quiet group was cut");
    assert!(
        std::fs::read_dir(&b.layout().tmp).unwrap().next().is_none(),
        "nothing left of the refused group"
    );
}

/// A new volume's claim counts from its admission, while its file is written and synced
/// without the space lock: a create at the same time goes on (it does not queue behind the
/// first one's disk), and is refused when the two would break the overcommit ratio together.
#[test]
fn a_volume_being_written_holds_its_claim_but_not_the_space_lock() {
    let dir = TestDir::new("emb-claim-pending");
    let fake: Fake = Arc::new(FakeAttacher::new());
    let (b, _) = open(dir.path(), &fake);
    let b = Arc::new(b.with_policy(Policy {
        overcommit: Overcommit::ratio(1.0).unwrap(),
        ..Policy::default()
    }));
    // Three fifths of what a thin volume can have: one fits, two do not.
    let offer = space::thin_available(&b.space().unwrap(), b.policy().overcommit).unwrap();
    let big = offer / 5 * 3 / MIB * MIB;
    let (entered_tx, entered_rx) = std::sync::mpsc::channel();
    let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
    *b.write_hook.lock().unwrap() = Some(WriteHook(Box::new(move || {
        entered_tx.send(()).unwrap();
        // Until the test has seen the second create answered (or gave up on it).
        let _ = go_rx.recv();
    })));
    let first = {
        let b = Arc::clone(&b);
        std::thread::spawn(move || b.create_volume(&new_volume("pvc-first", big)))
    };
    entered_rx
        .recv_timeout(std::time::Duration::from_secs(120))
        .expect("the first create writing its file");
    // While the first file is written: what is offered shrinks by its claim, a second volume as
    // big is refused, a small one is made.
    let (tx, rx) = std::sync::mpsc::channel();
    {
        let b = Arc::clone(&b);
        std::thread::spawn(move || {
            let offered = space::thin_available(&b.space().unwrap(), b.policy().overcommit);
            let big2 = b.create_volume(&new_volume("pvc-second", big));
            let small = b.create_volume(&new_volume("pvc-small", MIB));
            let _ = tx.send((offered, big2, small));
        });
    }
    let answered = rx.recv_timeout(std::time::Duration::from_secs(120));
    go_tx.send(()).unwrap();
    let (offered, big2, small) = answered.expect(
        "the other creates answered while the first file was being written (not queued behind it)",
    );
    assert!(offered.unwrap() < offer - big / 2, "{offered:?} of {offer}");
    assert!(matches!(big2, Err(Error::NoSpace(_))), "{big2:?}");
    small.unwrap();
    first.join().unwrap().unwrap();
    // Made, its claim is measured from its file and no longer pending.
    assert_eq!(*b.lock_space(), space::Pending::default());
    assert!(matches!(
        b.create_volume(&new_volume("pvc-second", big)),
        Err(Error::NoSpace(_))
    ));
}
