//! Volume group snapshots of volumes in use, and snapshot metadata, on real loop devices and
//! filesystems: the group is write-order consistent while a workload writes, each member
//! restores alone, and the metadata names exactly the blocks written.

use std::fs::{self, File, OpenOptions};
use std::os::unix::fs::{FileExt as _, OpenOptionsExt as _};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use moor_controller::backend::{
    Backend as _, CollectedBlocks, ContentSource, GroupSnapshot, GroupSnapshotRef,
    NewGroupSnapshot, NewSnapshot, Parameters,
};
use moor_controller::embedded::attach::LoopAttacher;
use moor_controller::embedded::{Config, EmbeddedBackend};
use moor_runtime::contract::DEVICE_PATH_KEY;

use crate::fixture::*;
use crate::reflink::ReflinkFs;

fn backend_on(dir: &Path) -> Backend {
    EmbeddedBackend::open(
        Config {
            data_dir: dir.join("data"),
            node_id: NODE.into(),
            topology_key: "topology.moor.csi.io/node".into(),
        },
        LoopAttacher::new(),
    )
    .expect("open backend")
    .0
}

/// Filesystems mounted by a test, unmounted (lazily) on drop, also when it fails.
#[derive(Default)]
pub(crate) struct Mounts(Vec<PathBuf>);

impl Mounts {
    /// Makes an ext4 filesystem on `dev` and mounts it at `at`.
    pub(crate) fn ext4(&mut self, dev: &str, at: &Path) {
        moor_privileged::run("mkfs.ext4", &["-q", "-F", dev]);
        self.mount(dev, at);
    }

    pub(crate) fn mount(&mut self, dev: &str, at: &Path) {
        fs::create_dir_all(at).expect("mount point");
        rustix::mount::mount(
            Path::new(dev),
            at,
            "ext4",
            rustix::mount::MountFlags::empty(),
            None,
        )
        .expect("mount ext4");
        self.0.push(at.to_path_buf());
    }

    pub(crate) fn unmount(&mut self, at: &Path) {
        moor_privileged::unmount_when_free(at);
        self.0.retain(|m| m != at);
    }
}

impl Drop for Mounts {
    fn drop(&mut self) {
        for m in self.0.drain(..).rev() {
            let _ = rustix::mount::unmount(m.as_path(), rustix::mount::UnmountFlags::DETACH);
        }
    }
}

/// Record slots in each log: the writer goes round them.
const SLOTS: u64 = 1024;
/// A record fills one block, written with O_DIRECT in one piece.
const RECORD: usize = 4096;

/// A thread writing numbered records to two logs, each record to the first log and then, once
/// that write returned, to the second, with direct I/O (a write returns once the device has
/// it), round a ring of [`SLOTS`]. Stopped and joined on drop.
pub(crate) struct Writer {
    stop: Arc<AtomicBool>,
    written: Arc<AtomicU64>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// Record `i` (numbered from 1: a zero block is an empty slot).
fn fill_record(buf: &mut [u8], i: u64) {
    buf[..8].copy_from_slice(&i.to_le_bytes());
    buf[8..].fill((i % 251) as u8 + 1);
}

impl Writer {
    pub(crate) fn start(first: File, second: File) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let written = Arc::new(AtomicU64::new(0));
        let (s, w) = (Arc::clone(&stop), Arc::clone(&written));
        let thread = std::thread::spawn(move || {
            // O_DIRECT wants an aligned buffer.
            let mut storage = vec![0u8; 2 * RECORD];
            let off = storage.as_ptr().align_offset(RECORD);
            let buf = &mut storage[off..off + RECORD];
            let mut i = 1;
            while !s.load(Ordering::Relaxed) {
                fill_record(buf, i);
                let at = (i % SLOTS) * RECORD as u64;
                first.write_all_at(buf, at).expect("write first");
                second.write_all_at(buf, at).expect("write second");
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

    fn written(&self) -> u64 {
        self.written.load(Ordering::Acquire)
    }

    /// Waits until `n` more records are written (the writer is alive and making progress).
    pub(crate) fn wait_for(&self, n: u64) {
        let want = self.written() + n;
        let start = Instant::now();
        while self.written() < want {
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "the writer did not write {n} records within 60 s"
            );
            std::thread::yield_now();
        }
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

/// Creates a log of [`SLOTS`] empty records, durably, and opens it for direct I/O.
pub(crate) fn open_log(path: &Path) -> File {
    fs::write(path, vec![0u8; SLOTS as usize * RECORD]).expect("create log");
    File::open(path)
        .and_then(|f| f.sync_all())
        .expect("sync log");
    OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .expect("open log")
}

/// The newest record a log holds (0: none). Every slot holds a whole record or nothing, and
/// the records are the newest one and those just before it, without a gap.
pub(crate) fn newest_in(path: &Path) -> u64 {
    let data = fs::read(path).expect("read log");
    assert_eq!(data.len(), SLOTS as usize * RECORD, "{}", path.display());
    let mut expect = vec![0u8; RECORD];
    let mut found = Vec::new();
    for (slot, block) in data.chunks(RECORD).enumerate() {
        let i = u64::from_le_bytes(block[..8].try_into().expect("8 bytes"));
        if i == 0 {
            assert!(
                block.iter().all(|&b| b == 0),
                "{}: slot {slot} torn",
                path.display()
            );
            continue;
        }
        assert_eq!(
            i % SLOTS,
            slot as u64,
            "{}: record {i} in slot {slot}",
            path.display()
        );
        fill_record(&mut expect, i);
        assert_eq!(block, &expect[..], "{}: record {i} torn", path.display());
        found.push(i);
    }
    let newest = found.iter().copied().max().unwrap_or(0);
    // The ring holds the newest SLOTS records (or all of them, from 1, before it wrapped).
    let oldest = newest.saturating_sub(SLOTS - 1).max(1);
    found.sort_unstable();
    let want: Vec<u64> = if newest == 0 {
        Vec::new()
    } else {
        (oldest..=newest).collect()
    };
    assert_eq!(found, want, "{}: a record is missing", path.display());
    newest
}

pub(crate) fn group(b: &Backend, name: &str, volumes: &[String]) -> (GroupSnapshot, Duration) {
    let start = Instant::now();
    let g = b
        .create_group_snapshot(&NewGroupSnapshot {
            name: name.into(),
            source_volume_ids: volumes.to_vec(),
            parameters: Parameters::new(),
        })
        .expect("group snapshot");
    (g, start.elapsed())
}

/// The records in the log of a member snapshot: restored as a volume of its own, attached,
/// mounted, read, and removed again.
pub(crate) fn restored_records(b: &Backend, snapshot: &str, mounts: &mut Mounts, at: &Path) -> u64 {
    let v = b
        .create_volume(&new_volume(
            &format!("restore-{snapshot}"),
            64 * MIB,
            Some(ContentSource::Snapshot(snapshot.into())),
        ))
        .expect("restore member")
        .id;
    let dev = b.publish_volume(&publish_req(&v)).expect("publish")[DEVICE_PATH_KEY].clone();
    mounts.mount(&dev, at);
    let n = newest_in(&at.join("log"));
    mounts.unmount(at);
    b.unpublish_volume(&v, None).expect("unpublish restored");
    delete_when_unbound(b, &v);
    n
}

/// Two volumes of 64 MiB, `pvc-0` and `pvc-1`.
pub(crate) fn two_volumes(b: &Backend) -> Vec<String> {
    (0..2)
        .map(|i| {
            b.create_volume(&new_volume(&format!("pvc-{i}"), 64 * MIB, None))
                .expect("create")
                .id
        })
        .collect()
}

/// Group snapshots the consistency test takes.
const GROUPS: usize = 16;

/// The crash-consistency proof: while a workload writes numbered records to a log on each of
/// two mounted volumes (each record on the first before it is written on the second), group
/// snapshots are taken; in every one, the second volume holds no record the first lacks.
/// Without the freeze around the clones (each member cloned in turn while writes go on) the
/// second member's clone, cut later, holds records the first one's lacks, and this fails:
/// a record pair takes tens of microseconds, the time between two clones far more.
#[test]
fn group_snapshots_of_volumes_in_use_are_write_order_consistent() {
    let fx = Fixture::new("groups-consistent");
    let b = fx.b();
    let mut mounts = Mounts::default();
    let vols = two_volumes(b);
    let mut logs = Vec::new();
    for (i, v) in vols.iter().enumerate() {
        let dev = b.publish_volume(&publish_req(v)).expect("publish")[DEVICE_PATH_KEY].clone();
        let at = fx.dir.join(format!("m{i}"));
        mounts.ext4(&dev, &at);
        logs.push(open_log(&at.join("log")));
    }
    let second = logs.pop().expect("second log");
    let first = logs.pop().expect("first log");
    let writer = Writer::start(first, second);
    let mut groups = Vec::new();
    for n in 0..GROUPS {
        writer.wait_for(50);
        let (g, took) = group(b, &format!("g{n}"), &vols);
        eprintln!("group snapshot {n} of 2 volumes in use: {took:?}");
        groups.push(g);
    }
    writer.wait_for(50);
    drop(writer);
    for i in 0..2 {
        mounts.unmount(&fx.dir.join(format!("m{i}")));
    }

    let mut seen = Vec::new();
    for g in &groups {
        assert_eq!(g.snapshots.len(), 2);
        let at = fx.dir.join("restored");
        let first = restored_records(b, &g.snapshots[0].id, &mut mounts, &at);
        let second = restored_records(b, &g.snapshots[1].id, &mut mounts, &at);
        eprintln!(
            "{}: newest record {first} on the first log, {second} on the second",
            g.id
        );
        assert!(
            second <= first,
            "{}: the second volume holds record {second} and the first only up to {first}",
            g.id
        );
        // One write in flight at most: the first log is ahead by one record or none.
        assert!(first - second <= 1, "{}: {first} vs {second}", g.id);
        seen.push(first);
    }
    // The workload was writing all along: every group saw more than the one before.
    assert!(seen.windows(2).all(|w| w[0] < w[1]), "{seen:?}");
    for g in &groups {
        b.delete_group_snapshot(&GroupSnapshotRef {
            id: g.id.clone(),
            snapshot_ids: Vec::new(),
        })
        .expect("delete group");
    }
    for v in &vols {
        b.unpublish_volume(v, None).expect("unpublish");
        delete_when_unbound(b, v);
    }
    assert!(
        fs::read_dir(fx.dir.join("data/snapshots"))
            .expect("snapshots dir")
            .next()
            .is_none()
    );
}

/// A raw block volume in use cannot be held still: the group is refused, and nothing is
/// left frozen or cloned.
#[test]
fn a_group_with_a_raw_block_member_in_use_is_refused() {
    let fx = Fixture::new("groups-raw");
    let a = fx.create("pvc-a", 16 * MIB);
    let c = fx.create("pvc-c", 16 * MIB);
    fx.publish(&a);
    let e = fx
        .b()
        .create_group_snapshot(&NewGroupSnapshot {
            name: "g".into(),
            source_volume_ids: vec![a.clone(), c.clone()],
            parameters: Parameters::new(),
        })
        .expect_err("refused");
    assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e}");
    assert!(
        !fx.dir.join("data/records/freezing.json").exists(),
        "the freeze record was left"
    );
    fx.unpublish(&a);
    let g = fx
        .b()
        .create_group_snapshot(&NewGroupSnapshot {
            name: "g".into(),
            source_volume_ids: vec![a, c],
            parameters: Parameters::new(),
        })
        .expect("not in use: cut");
    assert_eq!(g.snapshots.len(), 2);
}

/// Thaws a filesystem on drop (a test that fails while one is frozen leaves it usable).
struct ThawOnDrop(PathBuf);

impl Drop for ThawOnDrop {
    fn drop(&mut self) {
        if let Ok(root) = File::open(&self.0) {
            let _ = moor_runtime::sys::fsctl::thaw(&root);
        }
    }
}

/// A controller killed while a group snapshot held a member's filesystem frozen leaves the
/// record of it: the next start thaws it, and writes go through again.
#[test]
fn filesystems_a_killed_group_snapshot_left_frozen_are_thawed_at_start() {
    let mut fx = Fixture::new("groups-thaw");
    moor_runtime::sys::mount_namespace::enter_private_mount_namespace()
        .expect("private mount namespace");
    let a = fx.create("pvc-a", 16 * MIB);
    let dev = fx.publish(&a)[DEVICE_PATH_KEY].clone();
    let mut mounts = Mounts::default();
    let at = fx.dir.join("m");
    mounts.ext4(&dev, &at);
    let _thaw = ThawOnDrop(at.clone());
    let record = fx.dir.join("data/records/freezing.json");
    fs::write(
        &record,
        serde_json::json!({"mounts": [at.display().to_string()]}).to_string(),
    )
    .expect("write the freeze record");
    moor_runtime::sys::fsctl::freeze(File::open(&at).expect("open mount")).expect("FIFREEZE");

    let report = fx.restart();
    assert_eq!(report.thawed, vec![at.clone()], "{report:?}");
    assert!(!record.exists(), "the freeze record is removed");
    // Not frozen any more: a thaw is refused (EINVAL), and a write goes through.
    let e = moor_runtime::sys::fsctl::thaw(File::open(&at).expect("open mount"))
        .expect_err("not frozen");
    assert_eq!(e.raw_os_error(), Some(libc::EINVAL));
    fs::write(at.join("after"), b"written").expect("write after the thaw");
    // A later start has nothing to do.
    assert!(fx.restart().is_clean());
    mounts.unmount(&at);
    fx.unpublish(&a);
}

/// The cost of a group snapshot of `n` volumes, mounted and idle, on a reflink data dir.
#[test]
#[ignore = "a measurement: cargo test -p moor-privileged --test controller -- --ignored group_cost"]
fn group_cost() {
    let xfs = ReflinkFs::sized("groups-cost", 4 << 30);
    let b = backend_on(&xfs.mnt);
    let mut mounts = Mounts::default();
    for n in [2usize, 8] {
        let vols: Vec<String> = (0..n)
            .map(|i| {
                b.create_volume(&new_volume(&format!("cost-{n}-{i}"), 256 * MIB, None))
                    .expect("create")
                    .id
            })
            .collect();
        let unused: Vec<Duration> = (0..5)
            .map(|k| group(&b, &format!("idle-{n}-{k}"), &vols).1)
            .collect();
        for (i, v) in vols.iter().enumerate() {
            let dev = b.publish_volume(&publish_req(v)).expect("publish")[DEVICE_PATH_KEY].clone();
            let at = xfs.dir.join(format!("c{n}-{i}"));
            mounts.ext4(&dev, &at);
            fs::write(at.join("data"), vec![7u8; 8 << 20]).expect("write data");
        }
        let mounted: Vec<Duration> = (0..5)
            .map(|k| group(&b, &format!("mounted-{n}-{k}"), &vols).1)
            .collect();
        let median = |mut v: Vec<Duration>| {
            v.sort();
            v[v.len() / 2]
        };
        eprintln!(
            "group snapshot of {n} volumes: not attached {:?}, mounted (frozen) {:?} (median of 5)",
            median(unused),
            median(mounted)
        );
    }
}

fn snapshot(b: &Backend, name: &str, volume: &str) -> String {
    b.create_snapshot(&NewSnapshot {
        name: name.into(),
        source_volume_id: volume.into(),
        parameters: Parameters::new(),
    })
    .expect("snapshot")
    .id
}

/// Writes `data` at each offset through the device, and flushes it.
fn write_blocks(dev: &str, writes: &[(u64, Vec<u8>)]) {
    let f = OpenOptions::new()
        .write(true)
        .open(dev)
        .expect("open device");
    for (at, data) in writes {
        f.write_all_at(data, *at).expect("write device");
    }
    f.sync_all().expect("flush device");
}

/// The blocks (of `block` bytes) that `writes` touch.
fn touched(writes: &[(u64, Vec<u8>)], block: u64) -> Vec<u64> {
    let mut out: Vec<u64> = writes
        .iter()
        .flat_map(|(at, d)| (at / block..(at + d.len() as u64).div_ceil(block)).map(|b| b * block))
        .collect();
    out.sort_unstable();
    out.dedup();
    out
}

fn check_metadata(b: &Backend, dir: &Path) {
    let v = b
        .create_volume(&new_volume("pvc-meta", 64 * MIB, None))
        .expect("create")
        .id;
    let dev = b.publish_volume(&publish_req(&v)).expect("publish")[DEVICE_PATH_KEY].clone();
    let first = vec![
        (0, vec![1u8; 8192]),
        (MIB + 100, vec![2u8; 300]),
        (10 * MIB, vec![3u8; 3 * MIB as usize]),
        (64 * MIB - 4096, vec![4u8; 4096]),
    ];
    write_blocks(&dev, &first);
    let base = snapshot(b, "base", &v);
    let second = vec![
        (4096 + 10, vec![5u8; 20]),
        (11 * MIB, vec![6u8; 64 * 1024]),
        (30 * MIB + 4000, vec![7u8; 200]),
    ];
    write_blocks(&dev, &second);
    let target = snapshot(b, "target", &v);

    let mut delta = CollectedBlocks::default();
    b.snapshot_delta(&base, &target, 0, &mut delta)
        .expect("delta");
    assert_eq!(delta.capacity_bytes, 64 * MIB);
    assert_eq!(delta.offsets(), touched(&second, delta.block_size));
    let mut allocated = CollectedBlocks::default();
    b.snapshot_allocated(&target, 0, &mut allocated)
        .expect("allocated");
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
    b.unpublish_volume(&v, None).expect("unpublish");
    assert!(wait_unbound(&dev, dir));
}

/// The delta names exactly the blocks written between two snapshots, and allocated covers
/// all that was written: on a filesystem with reflinks (shared extents skipped unread) and
/// on one without (the data compared).
#[test]
fn snapshot_metadata_names_exactly_the_written_blocks() {
    let xfs = ReflinkFs::new("metadata-reflink");
    check_metadata(&backend_on(&xfs.mnt), &xfs.mnt);
    let fx = Fixture::new("metadata-plain");
    check_metadata(fx.b(), &fx.dir);
}

/// The delta's speed on a 1 GiB volume with 1% of its blocks changed.
#[test]
#[ignore = "a measurement: cargo test -p moor-privileged --test controller -- --ignored delta_speed"]
fn delta_speed() {
    let xfs = ReflinkFs::sized("metadata-speed", 8 << 30);
    let on_xfs = backend_on(&xfs.mnt);
    let fx = Fixture::new("metadata-speed-plain");
    for (what, b, dir) in [
        ("xfs, reflinks", &on_xfs, xfs.mnt.clone()),
        ("ext4, copies", fx.b(), fx.dir.clone()),
    ] {
        let v = b
            .create_volume(&new_volume("pvc-speed", 1 << 30, None))
            .expect("create")
            .id;
        let dev = b.publish_volume(&publish_req(&v)).expect("publish")[DEVICE_PATH_KEY].clone();
        let chunk = vec![0x5au8; 4 << 20];
        let full: Vec<(u64, Vec<u8>)> = (0..256u64)
            .map(|i| (i * (4 << 20), chunk.clone()))
            .collect();
        write_blocks(&dev, &full);
        let base = snapshot(b, "base", &v);
        // 1% of the 262144 blocks, spread out.
        let changed: Vec<(u64, Vec<u8>)> = (0..2621u64)
            .map(|i| ((i * 100 + 7) * 4096, vec![0xa5u8; 4096]))
            .collect();
        write_blocks(&dev, &changed);
        let target = snapshot(b, "target", &v);
        let mut delta = CollectedBlocks::default();
        let start = Instant::now();
        b.snapshot_delta(&base, &target, 0, &mut delta)
            .expect("delta");
        let took = start.elapsed();
        assert_eq!(delta.offsets().len(), 2621);
        let mut allocated = CollectedBlocks::default();
        let start = Instant::now();
        b.snapshot_allocated(&target, 0, &mut allocated)
            .expect("allocated");
        eprintln!(
            "{what}: delta of 1 GiB with 1% changed {took:?}; allocated {:?}",
            start.elapsed()
        );
        b.unpublish_volume(&v, None).expect("unpublish");
        assert!(wait_unbound(&dev, &dir));
    }
}
