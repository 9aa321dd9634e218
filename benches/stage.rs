//! Staging a loop device against the raw mount(2) of the same device, measured in the same run
//! (run as root: `cargo bench --bench stage`). Everything happens in a private mount namespace
//! and is cleaned up, also when a bench panics. The loop devices are backed by files on a
//! tmpfs, so what is compared is the work of mounting, not the host disk's flush latency
//! (the same for both sides, and the noisiest part of the machine).
//!
//! * Group `stage` (issue 7's group 4): an already formatted ext4 and xfs device.
//!   `raw-<fs>`: mount(2) + umount2; `engine-<fs>`: the engine's stage + unstage in this
//!   process, without gRPC; `probe-<fs>`: the engine's superblock probe of the device alone
//!   (part of the floor of a safe stage); `handoff-<fs>`: mount(2) + umount2, each run by a
//!   thread of its own and answered to a caller that slept through it (the wake-up a server
//!   that keeps serving while a mount blocks has to pay, another part of that floor);
//!   `grpc-<fs>`: NodeStageVolume + NodeUnstageVolume.
//! * Group `first-stage` (7): the first stage of a blank 10 GiB volume (a fresh sparse file on
//!   a fresh loop device each iteration, set up and torn down outside the timing).
//!   `raw-<fs>`: moor's mkfs command + mount(2); `grpc-<fs>`: NodeStageVolume, which probes,
//!   formats and mounts. The unmount (umount2 / NodeUnstageVolume) is not timed.
//!   `floor-<fs>`: what a plugin that never formats a device with data on it must add to the
//!   raw work, measured on its own: the blank proof (moor's probe of the first and last MiB,
//!   read past the page cache), the intent to format made durable (a journal-sized record
//!   written and fdatasync'd in the state dir) and one bare gRPC round trip.

use std::os::unix::fs::FileExt as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::{Duration, Instant};

use criterion::{Criterion, SamplingMode, criterion_group, criterion_main};
use moor_node::validate;
use moor_privileged::bench::{
    self, BlankDevice, Budget, GIB, MIB, Node, mkfs_command, mount_data, stage_req, unstage_req,
};
use rustix::mount::{MountFlags, UnmountFlags};

const FILESYSTEMS: [&str; 2] = ["ext4", "xfs"];

/// Group 4: stage and unstage of a formatted device.
fn stage(node: &mut Node, c: &mut Criterion) {
    let budget = Budget::new(30, Duration::from_secs(1), Duration::from_secs(5));
    let mut g = c.benchmark_group("stage");
    g.sample_size(budget.samples)
        .warm_up_time(budget.warm_up)
        .measurement_time(budget.measurement)
        .sampling_mode(SamplingMode::Flat);
    // The engine alone, in this process, on its own state dir.
    let engine = bench::engine(&node.sb, "state-engine");
    for fs in FILESYSTEMS {
        // Each bench mounts a device of its own, formatted by moor (staged once, then
        // unstaged): a filesystem's mount time drifts with its own history (an xfs mount on
        // this machine takes 2.8 ms on a fresh log and about 4 ms after a thousand cycles), so
        // a shared device would favour whichever bench runs first.
        let mut formatted = |name: &str| {
            // xfs needs 300 MiB at least.
            let dev = node
                .sb
                .loop_device(&format!("stage-{name}-{fs}.img"), 512 * MIB);
            let staging = node.sb.staging(&format!("pv-stage-{name}-{fs}"));
            let vol = format!("vol-stage-{name}-{fs}");
            node.stage(&vol, &dev, &staging, fs);
            node.unstage(&vol, &staging);
            (dev, staging, vol)
        };
        let raw = formatted("raw");
        let handoff = formatted("handoff");
        let (engine_dev, engine_staging, engine_vol) = formatted("engine");
        let (dev, staging, vol) = formatted("grpc");
        std::fs::create_dir_all(&raw.1).expect("staging dir");
        g.bench_function(format!("raw-{fs}"), |b| {
            b.iter(|| {
                rustix::mount::mount(
                    raw.0.as_path(),
                    raw.1.as_path(),
                    fs,
                    MountFlags::empty(),
                    mount_data(fs),
                )
                .expect("mount");
                rustix::mount::unmount(raw.1.as_path(), UnmountFlags::empty()).expect("umount");
            })
        });
        // The raw mount as a server that keeps reading its sockets while a mount blocks has to
        // run it: on a thread that did not take the request's wake-up (here one that polls for
        // work), with the answer sent by a thread that slept through the mount and must be
        // woken, once for the mount and once for the umount.
        std::fs::create_dir_all(&handoff.1).expect("staging dir");
        let worker = Handoff::start(handoff.0.clone(), handoff.1.clone(), fs);
        g.bench_function(format!("handoff-{fs}"), |b| {
            b.iter(|| {
                worker.run(Handoff::MOUNT);
                worker.run(Handoff::UNMOUNT);
            })
        });
        drop(worker);
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
                engine.stage(&stage).expect("engine stage");
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
        g.bench_function(format!("grpc-{fs}"), |b| {
            b.iter(|| {
                node.stage(&vol, &dev, &staging, fs);
                node.unstage(&vol, &staging);
            })
        });
    }
    g.finish();
}

/// A thread of its own that mounts and unmounts one device when told, polling for the order
/// (so that no wake-up is on the way in) and waking the caller, who sleeps meanwhile, when done.
struct Handoff {
    order: Arc<AtomicU8>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Handoff {
    const IDLE: u8 = 0;
    const MOUNT: u8 = 1;
    const UNMOUNT: u8 = 2;
    const FAILED: u8 = 3;
    const QUIT: u8 = 4;

    /// Starts the thread; it answers the thread calling this.
    fn start(dev: PathBuf, dir: PathBuf, fs: &'static str) -> Self {
        let order = Arc::new(AtomicU8::new(Self::IDLE));
        let caller = std::thread::current();
        let shared = Arc::clone(&order);
        let thread = std::thread::spawn(move || {
            loop {
                let done = match shared.load(Ordering::Acquire) {
                    Self::MOUNT => rustix::mount::mount(
                        dev.as_path(),
                        dir.as_path(),
                        fs,
                        MountFlags::empty(),
                        mount_data(fs),
                    ),
                    Self::UNMOUNT => rustix::mount::unmount(dir.as_path(), UnmountFlags::empty()),
                    Self::QUIT => return,
                    _ => {
                        std::hint::spin_loop();
                        continue;
                    }
                };
                let next = if done.is_ok() {
                    Self::IDLE
                } else {
                    Self::FAILED
                };
                shared.store(next, Ordering::Release);
                caller.unpark();
            }
        });
        Self {
            order,
            thread: Some(thread),
        }
    }

    /// Has the thread carry out `order`, sleeping until it is done.
    fn run(&self, order: u8) {
        self.order.store(order, Ordering::Release);
        loop {
            match self.order.load(Ordering::Acquire) {
                Self::IDLE => return,
                Self::FAILED => panic!("hand-off: order {order} failed"),
                _ => std::thread::park(),
            }
        }
    }
}

impl Drop for Handoff {
    fn drop(&mut self) {
        self.order.store(Self::QUIT, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The time `run` reports for each of `iters` fresh blank devices made by `fresh` (made and
/// released outside the timing).
fn each_fresh(
    iters: u64,
    fresh: impl Fn() -> BlankDevice,
    mut run: impl FnMut(&Path) -> Duration,
) -> Duration {
    (0..iters)
        .map(|_| {
            let blank = fresh();
            run(&blank.dev)
        })
        .sum()
}

/// Group 7: the first stage of a blank 10 GiB device.
fn first_stage(node: &mut Node, c: &mut Criterion) {
    let budget = Budget::new(10, Duration::from_secs(1), Duration::from_secs(6));
    let mut g = c.benchmark_group("first-stage");
    g.sample_size(budget.samples)
        .warm_up_time(budget.warm_up)
        .measurement_time(budget.measurement)
        .sampling_mode(SamplingMode::Flat);
    let data = node.sb.data.clone();
    let engine = bench::engine(&node.sb, "state-floor");
    // A stand-in for the journal, on the same filesystem as the daemon's.
    let intent = std::fs::File::create(node.sb.state.join("floor-intent")).expect("intent file");
    let fresh = move |fs: &str| BlankDevice::new(data.join(format!("first-{fs}.img")), 10 * GIB);
    for fs in FILESYSTEMS {
        let staging = node.sb.staging(&format!("pv-first-{fs}"));
        let vol = format!("vol-first-{fs}");
        g.bench_function(format!("raw-{fs}"), |b| {
            b.iter_custom(|iters| {
                each_fresh(
                    iters,
                    || fresh(fs),
                    |dev| {
                        std::fs::create_dir_all(&staging).expect("staging dir");
                        let start = Instant::now();
                        let out = mkfs_command(fs, dev).output().expect("mkfs");
                        assert!(
                            out.status.success(),
                            "mkfs.{fs}: {}",
                            String::from_utf8_lossy(&out.stderr)
                        );
                        rustix::mount::mount(
                            dev,
                            staging.as_path(),
                            fs,
                            MountFlags::empty(),
                            mount_data(fs),
                        )
                        .expect("mount");
                        let took = start.elapsed();
                        rustix::mount::unmount(staging.as_path(), UnmountFlags::empty())
                            .expect("umount");
                        took
                    },
                )
            })
        });
        g.bench_function(format!("floor-{fs}"), |b| {
            b.iter_custom(|iters| {
                each_fresh(
                    iters,
                    || fresh(fs),
                    |dev| {
                        let start = Instant::now();
                        let content = engine
                            .probe_device(dev, 10 * GIB)
                            .expect("probe the blank device");
                        intent.write_all_at(&[0x5a; 450], 0).expect("write intent");
                        intent.sync_data().expect("fdatasync intent");
                        node.null_calls(1);
                        let took = start.elapsed();
                        assert!(content.is_blank(), "{content:?}");
                        took
                    },
                )
            })
        });
        g.bench_function(format!("grpc-{fs}"), |b| {
            b.iter_custom(|iters| {
                each_fresh(
                    iters,
                    || fresh(fs),
                    |dev| {
                        let start = Instant::now();
                        node.stage(&vol, dev, &staging, fs);
                        let took = start.elapsed();
                        node.unstage(&vol, &staging);
                        took
                    },
                )
            })
        });
    }
    g.finish();
}

fn benches(c: &mut Criterion) {
    let mut node = Node::start("bench-stage");
    node.sb.data_in_memory();
    stage(&mut node, c);
    first_stage(&mut node, c);
}

criterion_group!(group, benches);
criterion_main!(group);
