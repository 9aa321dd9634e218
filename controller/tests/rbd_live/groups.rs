//! Volume group snapshots and snapshot metadata on RBD: idle members cut in turn, members in
//! use cut at one instant (write-order consistency while another client writes, through an
//! RBD group and copies), members restored and deleted alone, a create cut short finished by
//! its retry, and the blocks a delta names.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64};

use moor_controller::backend::{CollectedBlocks, GroupSnapshot, NewGroupSnapshot};
use moor_controller::rbd::ids::{GroupId, random_suffix};
use moor_controller::rbd::records::{GroupRecord, GroupState, Registry};

use super::*;

/// Record slots in each log (at the start of each image).
const SLOTS: u64 = 256;
const RECORD: usize = 4096;

fn fill_record(buf: &mut [u8], i: u64) {
    buf[..8].copy_from_slice(&i.to_le_bytes());
    buf[8..].fill((i % 251) as u8 + 1);
}

/// The newest record in a log read whole (0: none); every slot holds a whole record or none.
fn newest_in(data: &[u8], what: &str) -> u64 {
    let mut expect = vec![0u8; RECORD];
    let mut newest = 0;
    for (slot, block) in data.chunks(RECORD).enumerate() {
        let i = u64::from_le_bytes(block[..8].try_into().unwrap());
        if i == 0 {
            assert!(block.iter().all(|&b| b == 0), "{what}: slot {slot} torn");
            continue;
        }
        assert_eq!(i % SLOTS, slot as u64, "{what}: record {i} in slot {slot}");
        fill_record(&mut expect, i);
        assert_eq!(block, &expect[..], "{what}: record {i} torn");
        newest = newest.max(i);
    }
    newest
}

/// A client of its own (as a node would be) writing records to two images: each to the first,
/// then, once written, to the second. Stopped on drop.
struct Writer {
    stop: Arc<AtomicBool>,
    written: Arc<AtomicU64>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Writer {
    fn start(env: &Env, first: &str, second: &str) -> Self {
        let client = env.client();
        let pool = client.pool(&env.pool).unwrap();
        let (a, b) = (
            pool.open_image(first).unwrap(),
            pool.open_image(second).unwrap(),
        );
        let stop = Arc::new(AtomicBool::new(false));
        let written = Arc::new(AtomicU64::new(0));
        let (s, w) = (Arc::clone(&stop), Arc::clone(&written));
        let thread = std::thread::spawn(move || {
            let _client = client;
            let mut buf = vec![0u8; RECORD];
            let mut i = 1;
            while !s.load(Ordering::Relaxed) {
                fill_record(&mut buf, i);
                let at = (i % SLOTS) * RECORD as u64;
                if let Err(e) = a.write(at, &buf) {
                    panic!("write {i} to the first: {e}")
                }
                if let Err(e) = b.write(at, &buf) {
                    panic!("write {i} to the second: {e}")
                }
                w.store(i, Ordering::Release);
                i += 1;
            }
        });
        Self {
            stop,
            written,
            thread: Some(thread),
        }
    }

    fn wait_for(&self, n: u64) {
        let want = self.written.load(Ordering::Acquire) + n;
        let start = Instant::now();
        while self.written.load(Ordering::Acquire) < want {
            assert!(
                start.elapsed() < Duration::from_secs(120),
                "the writer did not write {n} records within 120 s"
            );
            std::thread::yield_now();
        }
    }
}

impl Writer {
    /// Stops it; fails if a write failed.
    fn finish(mut self) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            assert!(t.join().is_ok(), "the writer failed (see its panic above)");
        }
        self.written.load(Ordering::Acquire)
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn group(b: &RbdBackend, name: &str, volumes: &[String]) -> Result<GroupSnapshot, Error> {
    b.create_group_snapshot(&NewGroupSnapshot {
        name: name.to_string(),
        source_volume_ids: volumes.to_vec(),
        parameters: Parameters::new(),
    })
}

/// Two volumes of 16 MiB: their ids and their images' names.
fn two_volumes(
    env: &Env,
    b: &RbdBackend,
    cleanup: &mut Cleanup<'_>,
    prefix: &str,
) -> (Vec<String>, Vec<String>) {
    let vols: Vec<String> = (0..2)
        .map(|i| {
            let v = b
                .create_volume(&new_volume(
                    env,
                    &name(&format!("{prefix}{i}")),
                    16 * MIB,
                    None,
                ))
                .unwrap();
            cleanup.volume(&v.id)
        })
        .collect();
    let images = vols
        .iter()
        .map(|v| VolumeId::parse(v).unwrap().image())
        .collect();
    (vols, images)
}

/// The log at the start of a member snapshot.
fn log_of(env: &Env, member: &moor_controller::backend::Snapshot) -> Vec<u8> {
    let snap = SnapshotId::parse(&member.id).unwrap().snap_name();
    let image = VolumeId::parse(&member.source_volume_id).unwrap().image();
    env.pool()
        .open_snapshot(&image, &snap)
        .unwrap()
        .read(0, SLOTS as usize * RECORD)
        .unwrap()
}

/// Members not in use are cut in turn (no copy): each member holds the writer's last
/// records, the same on both; members restore alone; Get checks the members; Delete removes
/// them.
#[test]
fn group_snapshots_of_idle_volumes_are_cut_in_turn() {
    let Some(env) = Env::get() else {
        return;
    };
    let b = env.backend(false);
    let mut cleanup = Cleanup::new(&env, &b);
    secrets::scope(env.secrets(), || {
        let (vols, images) = two_volumes(&env, &b, &mut cleanup, "g");
        let writer = Writer::start(&env, &images[0], &images[1]);
        writer.wait_for(20);
        writer.finish();
        let keys_before = metadata_keys(&env);

        let mut groups = Vec::new();
        let mut names = Vec::new();
        for n in 0..2 {
            names.push(name(&format!("group{n}")));
            let started = Instant::now();
            let g = group(&b, &names[n], &vols).unwrap();
            eprintln!(
                "timing: group snapshot of 2 idle images {}",
                ms(started.elapsed())
            );
            cleanup.group(&g.id);
            assert!(GroupId::parse(&g.id).is_some(), "{}", g.id);
            let names = image_names(&env);
            for m in &g.snapshots {
                let copy = format!("moor-copy-{}", SnapshotId::parse(&m.id).unwrap().suffix);
                assert!(!names.contains(&copy), "idle members are not copied");
            }
            assert_eq!(g.snapshots.len(), 2);
            assert!(
                g.snapshots
                    .iter()
                    .all(|s| s.group_snapshot_id.as_deref() == Some(g.id.as_str()))
            );
            groups.push(g);
        }
        for g in &groups {
            let first = newest_in(&log_of(&env, &g.snapshots[0]), "first");
            let second = newest_in(&log_of(&env, &g.snapshots[1]), "second");
            assert!(
                first > 0 && first == second,
                "{}: {first} vs {second}",
                g.id
            );
        }
        let keys = metadata_keys(&env);
        assert!(
            keys.len() > keys_before.len(),
            "the records are in the pool's metadata"
        );

        // A member restores on its own, with its data.
        let member = &groups[1].snapshots[1];
        let restored = b
            .create_volume(&new_volume(
                &env,
                &name("restored"),
                16 * MIB,
                Some(ContentSource::Snapshot(member.id.clone())),
            ))
            .unwrap();
        cleanup.volume(&restored.id);
        let data = env
            .pool()
            .open_image_read_only(&VolumeId::parse(&restored.id).unwrap().image())
            .unwrap()
            .read(0, SLOTS as usize * RECORD)
            .unwrap();
        assert_eq!(data, log_of(&env, member));
        // Listed with its group; Get checks the members; the same name is idempotent.
        let listed = b
            .list_snapshots(
                &SnapshotFilter {
                    snapshot_id: Some(member.id.clone()),
                    source_volume_id: None,
                },
                &PageRequest::default(),
            )
            .unwrap();
        assert_eq!(
            listed.entries[0].group_snapshot_id,
            member.group_snapshot_id
        );
        let g = &groups[1];
        let ids: Vec<String> = g.snapshots.iter().map(|s| s.id.clone()).collect();
        let got = b
            .get_group_snapshot(&GroupSnapshotRef {
                id: g.id.clone(),
                snapshot_ids: ids.iter().rev().cloned().collect(),
            })
            .unwrap();
        assert_eq!(&got, g);
        let e = b
            .get_group_snapshot(&GroupSnapshotRef {
                id: g.id.clone(),
                snapshot_ids: ids[..1].to_vec(),
            })
            .unwrap_err();
        assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
        let other = b
            .create_volume(&new_volume(&env, &name("other"), 16 * MIB, None))
            .unwrap();
        cleanup.volume(&other.id);
        let again = group(&b, &names[1], &[vols[1].clone(), vols[0].clone()]).unwrap();
        assert_eq!(again, groups[1]);
        let e = group(&b, &names[1], &[vols[0].clone(), other.id.clone()]).unwrap_err();
        assert!(matches!(e, Error::GroupSnapshotExists { .. }), "{e}");
        // Deleting a group deletes its members (one deleted alone first is fine).
        b.delete_snapshot(&groups[0].snapshots[0].id).unwrap();
        b.delete_group_snapshot(&GroupSnapshotRef {
            id: groups[0].id.clone(),
            snapshot_ids: groups[0].snapshots.iter().map(|s| s.id.clone()).collect(),
        })
        .unwrap();
        let e = b
            .get_group_snapshot(&GroupSnapshotRef {
                id: groups[0].id.clone(),
                snapshot_ids: Vec::new(),
            })
            .unwrap_err();
        assert!(matches!(e, Error::GroupSnapshotNotFound(_)), "{e}");
        let keys = metadata_keys(&env);
        let suffix = GroupId::parse(&groups[0].id).unwrap().suffix;
        assert!(!keys.iter().any(|k| k.contains(&suffix)), "{keys:?}");
    });
}

/// The log of a volume (its image read with librbd).
fn log_of_volume(env: &Env, id: &str) -> Vec<u8> {
    env.pool()
        .open_image_read_only(&VolumeId::parse(id).unwrap().image())
        .unwrap()
        .read(0, SLOTS as usize * RECORD)
        .unwrap()
}

/// The offsets of the blocks of `block` bytes that differ between two logs.
fn differing(a: &[u8], b: &[u8], block: u64) -> Vec<u64> {
    a.chunks(block as usize)
        .zip(b.chunks(block as usize))
        .enumerate()
        .filter(|(_, (x, y))| x != y)
        .map(|(i, _)| i as u64 * block)
        .collect()
}

/// Members in use (one published, both written by another client, as a node would) are cut
/// at one instant through an RBD group: the writer never fails, and in every group the second
/// volume's newest record is no newer than the first's, none torn. Each member (a snapshot of a
/// copy) restores alone, is a delta base and target against the volume's own snapshots, is
/// deleted alone (kept while a clone needs it, its copy removed after); Delete removes the
/// rest; nothing of the RBD group stays.
#[test]
fn group_snapshots_of_volumes_in_use_are_one_instant() {
    let Some(env) = Env::get() else {
        return;
    };
    let b = env.backend(false);
    let mut cleanup = Cleanup::new(&env, &b);
    secrets::scope(env.secrets(), || {
        let (vols, images) = two_volumes(&env, &b, &mut cleanup, "u");
        b.publish_volume(&publish(
            &vols[1],
            "node-u",
            AccessMode::SingleNodeWriter,
            false,
        ))
        .unwrap();
        let writer = Writer::start(&env, &images[0], &images[1]);
        writer.wait_for(20);
        // An ordinary snapshot of the first volume, a delta base for its members.
        let plain = b
            .create_snapshot(&NewSnapshot {
                name: name("u-plain"),
                source_volume_id: vols[0].clone(),
                parameters: Parameters::new(),
            })
            .unwrap();
        cleanup.snapshot(&plain.id);
        let mut groups = Vec::new();
        for n in 0..3 {
            writer.wait_for(20);
            let started = Instant::now();
            let g = group(&b, &name(&format!("busy{n}")), &vols).unwrap();
            eprintln!(
                "timing: group snapshot of 2 images in use {}",
                ms(started.elapsed())
            );
            cleanup.group(&g.id);
            assert_eq!(g.snapshots.len(), 2);
            groups.push(g);
        }
        writer.wait_for(20);
        let written = writer.finish();
        eprintln!("the writer wrote {written} records, none failed");
        let copy_of = |id: &str| format!("moor-copy-{}", SnapshotId::parse(id).unwrap().suffix);
        let names = image_names(&env);
        for m in groups.iter().flat_map(|g| &g.snapshots) {
            assert!(names.contains(&copy_of(&m.id)), "one copy per member");
        }

        let mut restored = Vec::new();
        for (n, g) in groups.iter().enumerate() {
            let mut logs = Vec::new();
            for (m, member) in g.snapshots.iter().enumerate() {
                assert_eq!(member.group_snapshot_id.as_deref(), Some(g.id.as_str()));
                assert_eq!(member.source_volume_id, vols[m]);
                let v = b
                    .create_volume(&new_volume(
                        &env,
                        &name(&format!("u-r{n}-{m}")),
                        16 * MIB,
                        Some(ContentSource::Snapshot(member.id.clone())),
                    ))
                    .unwrap();
                cleanup.volume(&v.id);
                logs.push(log_of_volume(&env, &v.id));
                restored.push(v.id);
            }
            let first = newest_in(&logs[0], "first");
            let second = newest_in(&logs[1], "second");
            eprintln!("group {n}: first volume's newest record {first}, second's {second}");
            assert!(first > 0, "group {n}: nothing written yet");
            assert!(
                second <= first,
                "group {n}: record {second} of the second volume without its predecessor on the \
                 first (newest {first})"
            );
        }

        // Metadata: allocated covers every record of a member; deltas between two members
        // (two copies), and between the volume's own snapshot and a member, name exactly the
        // blocks that differ.
        let log0 = log_of_volume(&env, &restored[0]);
        let log2 = log_of_volume(&env, &restored[2]);
        let mut allocated = CollectedBlocks::default();
        b.snapshot_allocated(&groups[0].snapshots[0].id, 0, &mut allocated)
            .unwrap();
        let have = allocated.offsets();
        for (slot, rec) in log0.chunks(RECORD).enumerate() {
            if rec.iter().any(|&x| x != 0) {
                let at = (slot * RECORD) as u64 / allocated.block_size * allocated.block_size;
                assert!(have.binary_search(&at).is_ok(), "slot {slot} not allocated");
            }
        }
        let mut delta = CollectedBlocks::default();
        b.snapshot_delta(
            &groups[0].snapshots[0].id,
            &groups[1].snapshots[0].id,
            0,
            &mut delta,
        )
        .unwrap();
        assert_eq!(delta.offsets(), differing(&log0, &log2, delta.block_size));
        assert!(!delta.offsets().is_empty(), "the writer wrote in between");
        let plain_log = env
            .pool()
            .open_snapshot(
                &images[0],
                &SnapshotId::parse(&plain.id).unwrap().snap_name(),
            )
            .unwrap()
            .read(0, SLOTS as usize * RECORD)
            .unwrap();
        let mut delta = CollectedBlocks::default();
        b.snapshot_delta(&plain.id, &groups[0].snapshots[0].id, 0, &mut delta)
            .unwrap();
        assert_eq!(
            delta.offsets(),
            differing(&plain_log, &log0, delta.block_size)
        );
        let e = b
            .snapshot_delta(
                &groups[1].snapshots[0].id,
                &groups[0].snapshots[0].id,
                0,
                &mut CollectedBlocks::default(),
            )
            .unwrap_err();
        assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
        let e = b
            .snapshot_delta(
                &groups[0].snapshots[0].id,
                &groups[0].snapshots[1].id,
                0,
                &mut CollectedBlocks::default(),
            )
            .unwrap_err();
        assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");

        // A member deleted alone: kept for its clone, its copy removed with the clone.
        let member = &groups[2].snapshots[0];
        let copy = copy_of(&member.id);
        b.delete_snapshot(&member.id).unwrap();
        assert!(image_names(&env).contains(&copy), "kept for its clone");
        let e = b.get_snapshot(&member.id).unwrap_err();
        assert!(matches!(e, Error::SnapshotNotFound(_)), "{e}");
        b.delete_volume(&restored[4]).unwrap();
        assert!(
            !image_names(&env).contains(&copy),
            "removed after its clone"
        );
        // A member without clones goes at once.
        let lone = &groups[2].snapshots[1];
        let copy = copy_of(&lone.id);
        b.delete_volume(&restored[5]).unwrap();
        b.delete_snapshot(&lone.id).unwrap();
        assert!(!image_names(&env).contains(&copy));
        // Deleting groups removes their copies (and those kept for clones after them).
        for r in &restored[..4] {
            b.delete_volume(r).unwrap();
        }
        for g in &groups {
            b.delete_group_snapshot(&GroupSnapshotRef {
                id: g.id.clone(),
                snapshot_ids: Vec::new(),
            })
            .unwrap();
        }
        let names = image_names(&env);
        for m in groups.iter().flat_map(|g| &g.snapshots) {
            assert!(!names.contains(&copy_of(&m.id)), "a copy left");
        }
        // No member is left in an RBD group: another group of them is cut.
        let writer = Writer::start(&env, &images[0], &images[1]);
        writer.wait_for(5);
        let g = group(&b, &name("busy-again"), &vols).unwrap();
        cleanup.group(&g.id);
        writer.finish();
    });
}

/// A member whose lock a client keeps (as a node mapping with `exclusiveLock: "true"` does)
/// cannot have its writes held: FAILED_PRECONDITION, nothing left behind, that client's
/// writes never fail.
#[test]
fn a_group_of_a_member_whose_lock_is_kept_is_refused() {
    let Some(env) = Env::get() else {
        return;
    };
    let b = env.backend(false);
    let mut cleanup = Cleanup::new(&env, &b);
    secrets::scope(env.secrets(), || {
        let (vols, images) = two_volumes(&env, &b, &mut cleanup, "k");
        let client = env.client();
        let held = client
            .pool(&env.pool)
            .unwrap()
            .open_image(&images[0])
            .unwrap();
        held.acquire_exclusive_lock().unwrap();
        let refused = name("kept");
        let started = Instant::now();
        let e = group(&b, &refused, &vols).unwrap_err();
        eprintln!("refused in {}: {e}", ms(started.elapsed()));
        assert!(matches!(e, Error::GroupRefused(_)), "{e}");
        held.write(0, b"still writes").unwrap();
        let keys = metadata_keys(&env);
        assert!(!keys.contains(&format!("moor.gname.{refused}")), "{keys:?}");
        drop(held);
        // Nothing of the RBD group is left: the members are cut together again.
        b.publish_volume(&publish(
            &vols[0],
            "node-k",
            AccessMode::SingleNodeWriter,
            false,
        ))
        .unwrap();
        let g = group(&b, &name("kept-after"), &vols).unwrap();
        cleanup.group(&g.id);
        // A published volume whose node maps it keeping the lock is refused before anything.
        let mut req = new_volume(&env, &name("k-excl"), 16 * MIB, None);
        req.parameters
            .insert("exclusiveLock".to_string(), "true".to_string());
        let excl = b.create_volume(&req).unwrap();
        cleanup.volume(&excl.id);
        b.publish_volume(&publish(
            &excl.id,
            "node-k",
            AccessMode::SingleNodeWriter,
            false,
        ))
        .unwrap();
        let e = group(&b, &name("kept-excl"), &[vols[1].clone(), excl.id.clone()]).unwrap_err();
        assert!(matches!(e, Error::GroupRefused(_)), "{e}");
        assert!(e.to_string().contains("exclusiveLock=true"), "{e}");
    });
}

/// What a crash in the middle of a create of members in use leaves (the group record
/// `creating`, the RBD group with its snapshot, a member's copy and snapshot of another
/// instant) is finished by the retry: every member cut again, at one instant.
#[test]
fn a_group_create_of_volumes_in_use_cut_short_is_finished_by_its_retry() {
    let Some(env) = Env::get() else {
        return;
    };
    let b = env.backend(false);
    let mut cleanup = Cleanup::new(&env, &b);
    secrets::scope(env.secrets(), || {
        let vols: Vec<VolumeId> = (0..2)
            .map(|i| {
                let v = b
                    .create_volume(&new_volume(&env, &name(&format!("ru{i}")), 8 * MIB, None))
                    .unwrap();
                VolumeId::parse(&cleanup.volume(&v.id)).unwrap()
            })
            .collect();
        b.publish_volume(&publish(
            &vols[0].to_string(),
            "node-ru",
            AccessMode::SingleNodeWriter,
            false,
        ))
        .unwrap();
        let gname = name("cut-short-busy");
        let pool = env.pool();
        let reg = Registry::new(&pool);
        let (gsuffix, member_suffixes) = creating_group(&reg, &gname, &vols);
        let gid = GroupId {
            location: vols[0].location.clone(),
            suffix: gsuffix.clone(),
        };
        cleanup.group(&gid.to_string());
        // Before the crash: the RBD group, its snapshot, the first member's copy and its
        // snapshot, with the data of then.
        let first = pool.open_image(&vols[0].image()).unwrap();
        first.write(0, b"old").unwrap();
        first.flush().unwrap();
        let rbd_group = format!("moor-group-{gsuffix}");
        pool.create_group(&rbd_group).unwrap();
        for v in &vols {
            pool.add_to_group(&rbd_group, &v.image()).unwrap();
        }
        pool.create_group_snapshot(&rbd_group, "moor-cut").unwrap();
        let copy = format!("moor-copy-{}", member_suffixes[0]);
        pool.open_group_snapshot(&vols[0].image(), &rbd_group, "moor-cut")
            .unwrap()
            .unwrap()
            .copy_to(&pool, &copy)
            .unwrap();
        let stale = SnapshotId {
            location: vols[0].location.clone(),
            suffix: member_suffixes[0].clone(),
        };
        pool.open_image(&copy)
            .unwrap()
            .create_snapshot(&stale.snap_name())
            .unwrap();
        first.write(0, b"new").unwrap();
        first.flush().unwrap();

        let ids: Vec<String> = vols.iter().map(ToString::to_string).collect();
        let g = group(&b, &gname, &ids).unwrap();
        assert_eq!(g.id, gid.to_string());
        assert_eq!(g.snapshots[0].id, stale.to_string());
        let data = pool
            .open_snapshot(&copy, &stale.snap_name())
            .unwrap()
            .read(0, 3)
            .unwrap();
        assert_eq!(
            data, b"new",
            "the member copied before the crash was cut again"
        );
        assert_eq!(
            reg.group(&gsuffix).unwrap().unwrap().state,
            GroupState::Ready
        );
        // The RBD group is gone (its name is free), the members out of it.
        pool.create_group(&rbd_group).unwrap();
        pool.remove_group(&rbd_group).unwrap();
        drop(first);
    });
}

/// What a crash in the middle of a create leaves (the group record `creating`, a member's RBD
/// snapshot cut at another instant) is finished by the retry: every member cut again, at one
/// instant.
#[test]
fn a_group_create_cut_short_is_finished_by_its_retry() {
    let Some(env) = Env::get() else {
        return;
    };
    let b = env.backend(false);
    let mut cleanup = Cleanup::new(&env, &b);
    secrets::scope(env.secrets(), || {
        let vols: Vec<VolumeId> = (0..2)
            .map(|i| {
                let v = b
                    .create_volume(&new_volume(&env, &name(&format!("r{i}")), 8 * MIB, None))
                    .unwrap();
                VolumeId::parse(&cleanup.volume(&v.id)).unwrap()
            })
            .collect();
        let gname = name("cut-short");
        let pool = env.pool();
        let reg = Registry::new(&pool);
        let (gsuffix, member_suffixes) = creating_group(&reg, &gname, &vols);
        cleanup.group(
            &GroupId {
                location: vols[0].location.clone(),
                suffix: gsuffix.clone(),
            }
            .to_string(),
        );
        // The first member was cut before the crash, with the data of then.
        let first = pool.open_image(&vols[0].image()).unwrap();
        first.write(0, b"old").unwrap();
        let stale = SnapshotId {
            location: vols[0].location.clone(),
            suffix: member_suffixes[0].clone(),
        };
        first.create_snapshot(&stale.snap_name()).unwrap();
        first.write(0, b"new").unwrap();
        first.flush().unwrap();
        drop(first);

        let ids: Vec<String> = vols.iter().map(ToString::to_string).collect();
        let g = group(&b, &gname, &ids).unwrap();
        assert_eq!(
            g.id,
            GroupId {
                location: vols[0].location.clone(),
                suffix: gsuffix.clone()
            }
            .to_string()
        );
        assert_eq!(g.snapshots.len(), 2);
        assert_eq!(g.snapshots[0].id, stale.to_string());
        let data = pool
            .open_snapshot(&vols[0].image(), &stale.snap_name())
            .unwrap()
            .read(0, 3)
            .unwrap();
        assert_eq!(
            data, b"new",
            "the member cut before the crash was cut again"
        );
        assert_eq!(
            reg.group(&gsuffix).unwrap().unwrap().state,
            GroupState::Ready
        );
    });
}

fn touched(writes: &[(u64, usize)], block: u64) -> Vec<u64> {
    let mut out: Vec<u64> = writes
        .iter()
        .flat_map(|&(at, len)| (at / block..(at + len as u64).div_ceil(block)).map(|b| b * block))
        .collect();
    out.sort_unstable();
    out.dedup();
    out
}

/// The delta between two snapshots names exactly the blocks written between them, and
/// allocated covers everything written; errors as the spec names them.
#[test]
fn snapshot_metadata_names_exactly_the_written_blocks() {
    let Some(env) = Env::get() else {
        return;
    };
    let b = env.backend(false);
    let mut cleanup = Cleanup::new(&env, &b);
    secrets::scope(env.secrets(), || {
        let v = b
            .create_volume(&new_volume(&env, &name("meta"), 64 * MIB, None))
            .unwrap();
        let image = VolumeId::parse(&cleanup.volume(&v.id)).unwrap().image();
        let open = env.pool().open_image(&image).unwrap();
        let first: Vec<(u64, usize)> = vec![(0, 8192), (MIB + 100, 300), (10 * MIB, 3 << 20)];
        for &(at, len) in &first {
            open.write(at, &vec![1u8; len]).unwrap();
        }
        open.flush().unwrap();
        let mut snap = |n: &str| {
            let s = b
                .create_snapshot(&NewSnapshot {
                    name: name(n),
                    source_volume_id: v.id.clone(),
                    parameters: Parameters::new(),
                })
                .unwrap();
            cleanup.snapshot(&s.id)
        };
        let base = snap("base");
        let second: Vec<(u64, usize)> = vec![
            (4096 + 10, 20),
            (11 * MIB, 64 * 1024),
            (30 * MIB + 4000, 200),
        ];
        for &(at, len) in &second {
            open.write(at, &vec![2u8; len]).unwrap();
        }
        open.flush().unwrap();
        drop(open);
        let target = snap("target");

        let mut delta = CollectedBlocks::default();
        let started = Instant::now();
        b.snapshot_delta(&base, &target, 0, &mut delta).unwrap();
        eprintln!("timing: delta of 64 MiB {}", ms(started.elapsed()));
        assert_eq!(delta.capacity_bytes, 64 * MIB);
        assert_eq!(delta.offsets(), touched(&second, delta.block_size));
        let mut later = CollectedBlocks::default();
        b.snapshot_delta(&base, &target, 11 * MIB, &mut later)
            .unwrap();
        assert_eq!(
            later.offsets(),
            touched(&second, later.block_size)
                .into_iter()
                .filter(|&o| o >= 11 * MIB)
                .collect::<Vec<_>>()
        );
        let mut allocated = CollectedBlocks::default();
        b.snapshot_allocated(&target, 0, &mut allocated).unwrap();
        let have = allocated.offsets();
        for block in touched(&first, allocated.block_size)
            .into_iter()
            .chain(touched(&second, allocated.block_size))
        {
            assert!(
                have.binary_search(&block).is_ok(),
                "block {block} not allocated"
            );
        }
        // The base after the target, snapshots of two volumes, a missing one, past the end.
        let e = b
            .snapshot_delta(&target, &base, 0, &mut CollectedBlocks::default())
            .unwrap_err();
        assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
        let w = b
            .create_volume(&new_volume(&env, &name("meta-other"), 8 * MIB, None))
            .unwrap();
        cleanup.volume(&w.id);
        let other = b
            .create_snapshot(&NewSnapshot {
                name: name("other"),
                source_volume_id: w.id.clone(),
                parameters: Parameters::new(),
            })
            .unwrap();
        cleanup.snapshot(&other.id);
        let e = b
            .snapshot_delta(&base, &other.id, 0, &mut CollectedBlocks::default())
            .unwrap_err();
        assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
        let missing = SnapshotId {
            location: SnapshotId::parse(&base).unwrap().location,
            suffix: random_suffix().unwrap(),
        }
        .to_string();
        let e = b
            .snapshot_allocated(&missing, 0, &mut CollectedBlocks::default())
            .unwrap_err();
        assert!(matches!(e, Error::SnapshotNotFound(_)), "{e}");
    });
}

/// The cost of a group snapshot of 2 and 8 volumes of 64 MiB holding 8 MiB each, idle and in
/// use (published), and the delta's speed on a 1 GiB volume with 1% of its blocks changed.
#[test]
#[ignore = "a measurement: cargo test -p moor-controller --test rbd_live -- --ignored rbd_group_cost"]
fn rbd_group_cost() {
    let Some(env) = Env::get() else {
        return;
    };
    let b = env.backend(false);
    let mut cleanup = Cleanup::new(&env, &b);
    secrets::scope(env.secrets(), || {
        for n in [2usize, 8] {
            let vols: Vec<String> = (0..n)
                .map(|i| {
                    let v = b
                        .create_volume(&new_volume(
                            &env,
                            &name(&format!("c{n}-{i}")),
                            64 * MIB,
                            None,
                        ))
                        .unwrap();
                    cleanup.volume(&v.id)
                })
                .collect();
            // 8 MiB of data in each.
            for v in &vols {
                let open = env
                    .pool()
                    .open_image(&VolumeId::parse(v).unwrap().image())
                    .unwrap();
                open.write(0, &vec![0x5au8; 8 << 20]).unwrap();
                open.flush().unwrap();
            }
            for in_use in [false, true] {
                if in_use {
                    for v in &vols {
                        b.publish_volume(&publish(
                            v,
                            "node-c",
                            AccessMode::SingleNodeWriter,
                            false,
                        ))
                        .unwrap();
                    }
                }
                let mut took = Vec::new();
                for k in 0..3 {
                    let started = Instant::now();
                    let g = group(&b, &name(&format!("cost{n}-{in_use}-{k}")), &vols).unwrap();
                    took.push(started.elapsed());
                    cleanup.group(&g.id);
                }
                took.sort();
                eprintln!(
                    "rbd group snapshot of {n} volumes (in use: {in_use}): median of 3 {}",
                    ms(took[1])
                );
            }
        }
        let v = b
            .create_volume(&new_volume(&env, &name("speed"), 1 << 30, None))
            .unwrap();
        let image = VolumeId::parse(&cleanup.volume(&v.id)).unwrap().image();
        let open = env.pool().open_image(&image).unwrap();
        let chunk = vec![0x5au8; 4 << 20];
        for i in 0..256u64 {
            open.write(i * (4 << 20), &chunk).unwrap();
        }
        open.flush().unwrap();
        let snap = |n: &str| {
            b.create_snapshot(&NewSnapshot {
                name: name(n),
                source_volume_id: v.id.clone(),
                parameters: Parameters::new(),
            })
            .unwrap()
            .id
        };
        let base = snap("speed-base");
        for i in 0..2621u64 {
            open.write((i * 100 + 7) * 4096, &[0xa5u8; 4096]).unwrap();
        }
        open.flush().unwrap();
        drop(open);
        let target = snap("speed-target");
        let mut delta = CollectedBlocks::default();
        let started = Instant::now();
        b.snapshot_delta(&base, &target, 0, &mut delta).unwrap();
        let took = started.elapsed();
        assert_eq!(delta.offsets().len(), 2621);
        let mut allocated = CollectedBlocks::default();
        let started = Instant::now();
        b.snapshot_allocated(&target, 0, &mut allocated).unwrap();
        eprintln!(
            "rbd: delta of 1 GiB with 1% changed {}; allocated {}",
            ms(took),
            ms(started.elapsed())
        );
        cleanup.snapshot(&base);
        cleanup.snapshot(&target);
    });
}

/// Leaves the records of a group create cut short, as a controller killed in the middle of it
/// does: the group named, its record `creating` with two member suffixes (returned with the
/// group's).
fn creating_group(reg: &Registry<'_>, gname: &str, vols: &[VolumeId]) -> (String, Vec<String>) {
    let gsuffix = random_suffix().unwrap();
    let member_suffixes = vec![random_suffix().unwrap(), random_suffix().unwrap()];
    reg.name_group(gname, &gsuffix).unwrap();
    reg.put_group(
        &gsuffix,
        &GroupRecord {
            version: 1,
            name: gname.to_string(),
            state: GroupState::Creating,
            volume_suffixes: vols.iter().map(|v| v.suffix.clone()).collect(),
            snapshot_suffixes: member_suffixes.clone(),
            created_secs: 0,
            created_nanos: 0,
        },
    )
    .unwrap();
    (gsuffix, member_suffixes)
}
