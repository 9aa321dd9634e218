//! Staging a loop device against the raw mount(2) of the same device, measured in the same run
//! (run as root: `cargo bench --bench stage`). Everything happens in a private mount namespace
//! and is cleaned up, also when a bench panics. The loop devices are backed by files on a
//! tmpfs, so what is compared is the work of mounting, not the host disk's flush latency
//! (the same for both sides, and the noisiest part of the machine).
//!
//! * Group `stage` (issue 7's group 4): an already formatted ext4 and xfs device.
//!   `raw-<fs>`: mount(2) + umount2; `engine-<fs>`: the engine's stage + unstage in this
//!   process, without gRPC; `probe-<fs>`: the engine's superblock probe of the device alone
//!   (what a stage that mounts only what it can identify adds); `fsck-ext4`: e2fsck in preen
//!   mode on the clean ext4 (what the check before a read-write mount added);
//!   `shortcut-ext4`: the same answer decided in-process from the probe's bytes and the few
//!   blocks of metadata past them (what a stage of a clean ext4 now does instead); `bare-<fs>`: NodeStageVolume +
//!   NodeUnstageVolume on `bare-node`, a gRPC server that does nothing but the mount(2) and
//!   umount2 (what any plugin that speaks gRPC pays, wake-ups included); `grpc-<fs>`:
//!   NodeStageVolume + NodeUnstageVolume on moor-node.
//! * Group `first-stage` (7): the first stage of a blank 10 GiB volume (a fresh sparse file on
//!   a fresh loop device each iteration, set up and torn down outside the timing).
//!   `raw-<fs>`: moor's mkfs command + mount(2); `grpc-<fs>`: NodeStageVolume, which probes,
//!   formats and mounts. The unmount (umount2 / NodeUnstageVolume) is not timed.
//!   `bare-<fs>`: NodeStageVolume on `bare-node`, told to run the same mkfs before its mount.
//!   `proof-<fs>`: what a plugin that never formats a device with data on it adds, measured on
//!   its own: the blank proof (moor's probe of the first and last MiB, read past the page
//!   cache) and the intent to format made durable (a journal-sized record written and
//!   fdatasync'd in the state dir).
//! * Groups `stage-paired` and `first-stage-paired`: the ratios the targets are held to, each
//!   measured turn by turn with `raw-<fs>` in the same sample ([`moor_bench::Paired`]), so that a
//!   machine whose speed drifts between benches cannot tilt them: `grpc-<fs>` (moor's pair or
//!   first stage) and `floor-<fs>` (`bare-<fs>` with the probe, or with the blank proof and
//!   the durable intent) against `raw-<fs>`; for ext4's stage also `safe-floor-ext4`,
//!   `bare-ext4` with the probe and the check a read-write stage of a clean ext4 makes
//!   (e2fsck's clean shortcut, as `shortcut-ext4`).

use std::os::unix::fs::FileExt as _;
use std::path::Path;
use std::time::{Duration, Instant};

use criterion::measurement::WallTime;
use criterion::{BenchmarkGroup, Criterion, criterion_group, criterion_main};
use moor_bench::{
    self, BlankDevice, Budget, GIB, MIB, Node, Paired, Plugin, mkfs, mount_data, paired, stage_req,
    timed, unstage_req,
};
use moor_node::validate;
use rustix::mount::{MountFlags, UnmountFlags};

const FILESYSTEMS: [&str; 2] = ["ext4", "xfs"];

/// Group 4: stage and unstage of a formatted device.
fn stage(node: &mut Node, bare: &mut Plugin, c: &mut Criterion, pc: &mut Criterion<Paired>) {
    let budget = Budget::new(30, Duration::from_secs(1), Duration::from_secs(5));
    let mut g = moor_bench::flat_group(c, "stage", budget);
    let mut pg = moor_bench::flat_group(pc, "stage-paired", budget);
    // The engine alone, in this process, on its own state dir.
    let engine = moor_bench::engine(&node.sb, "state-engine");
    for fs in FILESYSTEMS {
        // Each bench mounts a device of its own, formatted by moor (staged once, then
        // unstaged), and seasoned: a filesystem's mount time drifts with its own history (an
        // xfs mount on this machine takes 3.7 ms on a fresh log, then slows over its first
        // 1,500 cycles to a plateau near 5 ms; ext4's does not drift), so a shared device
        // would favour whichever bench runs first, and a fresh one whichever runs fewest
        // cycles. Seasoned past the drift, every device is measured on its plateau.
        let mut formatted = |name: &str| {
            // xfs needs 300 MiB at least.
            let dev = node
                .sb
                .loop_device(&format!("stage-{name}-{fs}.img"), 512 * MIB);
            let staging = node.sb.staging(&format!("pv-stage-{name}-{fs}"));
            let vol = format!("vol-stage-{name}-{fs}");
            node.stage(&vol, &dev, &staging, fs);
            node.unstage(&vol, &staging);
            season(&dev, &staging, fs);
            (dev, staging, vol)
        };
        let raw = formatted("raw");
        let bare_device = formatted("bare");
        let (engine_dev, engine_staging, engine_vol) = formatted("engine");
        let (dev, staging, vol) = formatted("grpc");
        let raw_pair = || {
            rustix::mount::mount(
                raw.0.as_path(),
                raw.1.as_path(),
                fs,
                MountFlags::empty(),
                mount_data(fs),
            )
            .expect("mount");
            rustix::mount::unmount(raw.1.as_path(), UnmountFlags::empty()).expect("umount");
        };
        g.bench_function(format!("raw-{fs}"), |b| b.iter(raw_pair));
        // The least a plugin that speaks gRPC can do for the pair: the same syscalls, served.
        let (bare_dev, bare_staging, bare_vol) = bare_device;
        let mut bare_pair = || {
            bare.stage(&bare_vol, &bare_dev, &bare_staging, fs);
            bare.unstage(&bare_vol, &bare_staging);
        };
        g.bench_function(format!("bare-{fs}"), |b| b.iter(&mut bare_pair));
        let stage = validate::stage(
            &stage_req(&engine_vol, &engine_dev, &engine_staging, fs),
            &node.sb.kubelet,
        )
        .expect("valid");
        let unstage =
            validate::unstage(&unstage_req(&engine_vol, &engine_staging), &node.sb.kubelet)
                .expect("valid");
        g.bench_function(format!("engine-{fs}"), |b| {
            b.iter(|| {
                engine
                    .stage(&stage, &mut Default::default())
                    .expect("engine stage");
                engine.unstage(&unstage).expect("engine unstage");
            })
        });
        // What a safe stage adds to the raw mount before it: reading the superblocks to
        // make sure the device holds the filesystem asked for (and nothing else).
        g.bench_function(format!("probe-{fs}"), |b| {
            b.iter(|| {
                let content = engine.probe_device(&dev, 512 * MIB).expect("probe");
                assert!(!content.is_blank(), "{content:?}");
            })
        });
        // What checking the filesystem before a read-write mount adds: e2fsck in preen mode
        // on a clean ext4 (xfs and btrfs are not checked).
        if fs == "ext4" {
            g.bench_function(format!("fsck-{fs}"), |b| {
                b.iter(|| {
                    let st = std::process::Command::new("e2fsck")
                        .arg("-p")
                        .arg(&dev)
                        .stdout(std::process::Stdio::null())
                        .status()
                        .expect("e2fsck");
                    assert!(st.success(), "e2fsck -p: {st}");
                })
            });
            // What replaced it for a clean ext4: e2fsck's clean shortcut decided from the
            // superblock, the group descriptors, the journal's inode and superblock and the
            // first backup superblock, read as the stage reads them.
            g.bench_function(format!("shortcut-{fs}"), |b| {
                b.iter(|| assert!(engine.e2fsck_would_skip(&dev, 512 * MIB), "a clean ext4"))
            });
        }
        let mut grpc_pair = || {
            node.stage(&vol, &dev, &staging, fs);
            node.unstage(&vol, &staging);
        };
        g.bench_function(format!("grpc-{fs}"), |b| b.iter(&mut grpc_pair));
        // The ratios the targets are held to, each side run in turn with the raw pair.
        against_raw(&mut pg, format!("grpc-{fs}"), raw_pair, &mut grpc_pair);
        against_raw(&mut pg, format!("floor-{fs}"), raw_pair, || {
            let content = engine.probe_device(&bare_dev, 512 * MIB).expect("probe");
            assert!(!content.is_blank(), "{content:?}");
            bare_pair();
        });
        // For ext4, whose read-write stage checks the filesystem too: the floor with the
        // check as a stage of a clean ext4 makes it (the probe, then e2fsck's clean shortcut
        // from the probe's bytes and the blocks past them).
        if fs == "ext4" {
            against_raw(&mut pg, format!("safe-floor-{fs}"), raw_pair, || {
                assert!(
                    engine.e2fsck_would_skip(&bare_dev, 512 * MIB),
                    "a clean ext4"
                );
                bare_pair();
            });
        }
    }
    g.finish();
    pg.finish();
}

/// A paired bench `name` in `pg`: `side` against `raw`, run in turn in each sample.
fn against_raw(
    pg: &mut BenchmarkGroup<'_, Paired>,
    name: String,
    raw: impl Fn() + Copy,
    mut side: impl FnMut(),
) {
    pg.bench_function(name, |b| {
        b.iter_custom(|iters| paired(iters, || timed(raw), || timed(&mut side)))
    });
}

/// Mounts and unmounts the formatted `dev` on `dir` until its mount time has stopped drifting:
/// 2,000 cycles for xfs (its plateau starts near 1,500), none for ext4 or a quick run.
fn season(dev: &Path, dir: &Path, fs: &str) {
    let cycles = if fs == "xfs" && !moor_bench::quick() {
        2000
    } else {
        0
    };
    std::fs::create_dir_all(dir).expect("staging dir");
    for _ in 0..cycles {
        rustix::mount::mount(dev, dir, fs, MountFlags::empty(), mount_data(fs)).expect("mount");
        rustix::mount::unmount(dir, UnmountFlags::empty()).expect("umount");
    }
}

/// How long `mount` takes to mount something on `dir` (made first if need be), which is then
/// unmounted outside the timing.
fn timed_mount(dir: &Path, mount: impl FnOnce()) -> Duration {
    std::fs::create_dir_all(dir).expect("staging dir");
    let start = Instant::now();
    mount();
    let took = start.elapsed();
    rustix::mount::unmount(dir, UnmountFlags::empty()).expect("umount");
    took
}

/// Benchmark `name` in `g`: the time `run` reports for a fresh blank device (made and
/// released outside the timing).
fn bench_fresh(
    g: &mut BenchmarkGroup<'_, WallTime>,
    name: String,
    (data, fs): (&Path, &str),
    mut run: impl FnMut(&Path) -> Duration,
) {
    g.bench_function(name, |b| {
        b.iter_custom(|iters| (0..iters).map(|_| on_fresh(data, fs, &mut run)).sum())
    });
}

/// The time `run` reports for a fresh blank 10 GiB device for `fs` (a sparse file in `data`
/// on a loop device of its own), made and released outside the timing.
fn on_fresh(data: &Path, fs: &str, run: &mut impl FnMut(&Path) -> Duration) -> Duration {
    let blank = BlankDevice::new(data.join(format!("first-{fs}.img")), 10 * GIB);
    run(&blank.dev)
}

/// Group 7: the first stage of a blank 10 GiB device.
fn first_stage(node: &mut Node, bare: &mut Plugin, c: &mut Criterion, pc: &mut Criterion<Paired>) {
    let budget = Budget::new(10, Duration::from_secs(1), Duration::from_secs(6));
    let mut g = moor_bench::flat_group(c, "first-stage", budget);
    // A paired round is two first stages: more samples than the unpaired benches, so that the
    // median of the ratios is known to within a few percent.
    let paired_budget = Budget::new(30, Duration::from_secs(1), Duration::from_secs(12));
    let mut pg = moor_bench::flat_group(pc, "first-stage-paired", paired_budget);
    let data = node.sb.data.clone();
    let engine = moor_bench::engine(&node.sb, "state-floor");
    // A stand-in for the journal, on the same filesystem as the daemon's.
    let intent = std::fs::File::create(node.sb.state.join("floor-intent")).expect("intent file");
    for fs in FILESYSTEMS {
        let staging = node.sb.staging(&format!("pv-first-{fs}"));
        let vol = format!("vol-first-{fs}");
        let mut raw = |dev: &Path| {
            timed_mount(&staging, || {
                mkfs(fs, dev).expect("mkfs");
                rustix::mount::mount(
                    dev,
                    staging.as_path(),
                    fs,
                    MountFlags::empty(),
                    mount_data(fs),
                )
                .expect("mount");
            })
        };
        let mut bare_stage = |dev: &Path| {
            let mut req = stage_req(&vol, dev, &staging, fs);
            req.volume_context.insert("mkfs".into(), "true".into());
            timed_mount(&staging, || bare.stage_request(req))
        };
        let proof = |dev: &Path| {
            let start = Instant::now();
            let content = engine
                .probe_device(dev, 10 * GIB)
                .expect("probe the blank device");
            intent.write_all_at(&[0x5a; 450], 0).expect("write intent");
            intent.sync_data().expect("fdatasync intent");
            let took = start.elapsed();
            assert!(content.is_blank(), "{content:?}");
            took
        };
        let mut grpc = |dev: &Path| {
            let took = timed(|| node.stage(&vol, dev, &staging, fs));
            node.unstage(&vol, &staging);
            took
        };
        bench_fresh(&mut g, format!("raw-{fs}"), (&data, fs), &mut raw);
        bench_fresh(&mut g, format!("bare-{fs}"), (&data, fs), &mut bare_stage);
        bench_fresh(&mut g, format!("proof-{fs}"), (&data, fs), proof);
        bench_fresh(&mut g, format!("grpc-{fs}"), (&data, fs), &mut grpc);
        pg.bench_function(format!("grpc-{fs}"), |b| {
            b.iter_custom(|iters| {
                paired(
                    iters,
                    || on_fresh(&data, fs, &mut raw),
                    || on_fresh(&data, fs, &mut grpc),
                )
            })
        });
        pg.bench_function(format!("floor-{fs}"), |b| {
            b.iter_custom(|iters| {
                paired(
                    iters,
                    || on_fresh(&data, fs, &mut raw),
                    || on_fresh(&data, fs, &mut |dev| proof(dev) + bare_stage(dev)),
                )
            })
        });
    }
    g.finish();
    pg.finish();
}

fn benches(c: &mut Criterion) {
    let mut node = Node::start("bench-stage");
    node.sb.data_in_memory();
    let mut bare = node.start_bare(Path::new(env!("CARGO_BIN_EXE_bare-node")));
    let mut pc = moor_bench::paired_criterion();
    stage(&mut node, &mut bare, c, &mut pc);
    first_stage(&mut node, &mut bare, c, &mut pc);
}

criterion_group!(group, benches);
criterion_main!(group);
