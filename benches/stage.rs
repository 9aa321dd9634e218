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
//!   `handoff-<fs>`: the raw work run by the hand-off thread, answered to a caller that slept
//!   through it, as for group 4.
//!   `floor-<fs>`: what a plugin that never formats a device with data on it must add to the
//!   raw work, measured on its own: the blank proof (moor's probe of the first and last MiB,
//!   read past the page cache), the intent to format made durable (a journal-sized record
//!   written and fdatasync'd in the state dir) and one bare gRPC round trip.

use std::os::unix::fs::FileExt as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use criterion::measurement::WallTime;
use criterion::{BenchmarkGroup, Criterion, SamplingMode, criterion_group, criterion_main};
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
        let worker = Handoff::start();
        g.bench_function(format!("handoff-{fs}"), |b| {
            b.iter(|| {
                worker.run(mount_job(handoff.0.clone(), handoff.1.clone(), fs));
                worker.run(unmount_job(handoff.1.clone()));
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

/// A job for the hand-off thread: Err says what failed.
type Job = Box<dyn FnOnce() -> Result<(), String> + Send>;

/// A thread of its own that runs a job when told, polling for the order (so that no wake-up
/// is on the way in) and waking the caller, who sleeps meanwhile, when done: the raw work as a
/// server that keeps reading its sockets while the work blocks has to run it.
struct Handoff {
    state: Arc<AtomicU8>,
    job: Arc<Mutex<Option<Job>>>,
    failure: Arc<Mutex<String>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Handoff {
    const IDLE: u8 = 0;
    const WORK: u8 = 1;
    const FAILED: u8 = 2;
    const QUIT: u8 = 3;

    /// Starts the thread; it answers the thread calling this.
    fn start() -> Self {
        let state = Arc::new(AtomicU8::new(Self::IDLE));
        let job: Arc<Mutex<Option<Job>>> = Arc::default();
        let failure: Arc<Mutex<String>> = Arc::default();
        let caller = std::thread::current();
        let (shared, next_job, failed) =
            (Arc::clone(&state), Arc::clone(&job), Arc::clone(&failure));
        let thread = std::thread::spawn(move || {
            loop {
                match shared.load(Ordering::Acquire) {
                    Self::WORK => {}
                    Self::QUIT => return,
                    _ => {
                        std::hint::spin_loop();
                        continue;
                    }
                }
                let taken = next_job.lock().map(|mut j| j.take()).unwrap_or(None);
                let done = taken.map_or_else(|| Err("no job".to_string()), |job| job());
                let next = match done {
                    Ok(()) => Self::IDLE,
                    Err(why) => {
                        if let Ok(mut f) = failed.lock() {
                            *f = why;
                        }
                        Self::FAILED
                    }
                };
                shared.store(next, Ordering::Release);
                caller.unpark();
            }
        });
        Self {
            state,
            job,
            failure,
            thread: Some(thread),
        }
    }

    /// Has the thread run `job`, sleeping until it is done.
    fn run(&self, job: impl FnOnce() -> Result<(), String> + Send + 'static) {
        *self.job.lock().expect("job slot") = Some(Box::new(job));
        self.state.store(Self::WORK, Ordering::Release);
        loop {
            match self.state.load(Ordering::Acquire) {
                Self::IDLE => return,
                Self::FAILED => panic!(
                    "hand-off: {}",
                    self.failure.lock().map(|f| f.clone()).unwrap_or_default()
                ),
                _ => std::thread::park(),
            }
        }
    }
}

impl Drop for Handoff {
    fn drop(&mut self) {
        self.state.store(Self::QUIT, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// mount(2) of `dev` with the data moor passes for `fs`, as a hand-off job.
fn mount_job(dev: PathBuf, dir: PathBuf, fs: &'static str) -> impl FnOnce() -> Result<(), String> {
    move || {
        rustix::mount::mount(
            dev.as_path(),
            dir.as_path(),
            fs,
            MountFlags::empty(),
            mount_data(fs),
        )
        .map_err(|e| format!("mount {}: {e}", dev.display()))
    }
}

/// umount2 of `dir`, as a hand-off job.
fn unmount_job(dir: PathBuf) -> impl FnOnce() -> Result<(), String> {
    move || {
        rustix::mount::unmount(dir.as_path(), UnmountFlags::empty())
            .map_err(|e| format!("umount {}: {e}", dir.display()))
    }
}

/// moor's mkfs command for `fs` on `dev`, run to completion.
fn mkfs(fs: &str, dev: &Path) -> Result<(), String> {
    let out = mkfs_command(fs, dev)
        .output()
        .map_err(|e| format!("mkfs.{fs}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "mkfs.{fs}: {}",
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

/// moor's mkfs command for `fs` on `dev`, then mount(2) of it on `dir`, as a job.
fn mkfs_and_mount(
    fs: &'static str,
    dev: &Path,
    dir: &Path,
) -> impl FnOnce() -> Result<(), String> + Send + 'static {
    let (dev, dir) = (dev.to_path_buf(), dir.to_path_buf());
    move || {
        mkfs(fs, &dev)?;
        mount_job(dev, dir, fs)()
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

/// Benchmark `name` in `g`: the time `run` reports for each fresh blank device made by
/// `fresh` (made and released outside the timing).
fn bench_fresh(
    g: &mut BenchmarkGroup<'_, WallTime>,
    name: String,
    fresh: impl Fn() -> BlankDevice,
    mut run: impl FnMut(&Path) -> Duration,
) {
    g.bench_function(name, |b| {
        b.iter_custom(|iters| {
            (0..iters)
                .map(|_| {
                    let blank = fresh();
                    run(&blank.dev)
                })
                .sum()
        })
    });
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
        bench_fresh(
            &mut g,
            format!("raw-{fs}"),
            || fresh(fs),
            |dev| {
                let job = mkfs_and_mount(fs, dev, &staging);
                timed_mount(&staging, || job().expect("mkfs + mount"))
            },
        );
        // The same on the hand-off thread, answered to this one, which slept through it.
        let worker = Handoff::start();
        bench_fresh(
            &mut g,
            format!("handoff-{fs}"),
            || fresh(fs),
            |dev| {
                let job = mkfs_and_mount(fs, dev, &staging);
                timed_mount(&staging, || worker.run(job))
            },
        );
        drop(worker);
        bench_fresh(
            &mut g,
            format!("floor-{fs}"),
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
        );
        bench_fresh(
            &mut g,
            format!("grpc-{fs}"),
            || fresh(fs),
            |dev| {
                let start = Instant::now();
                node.stage(&vol, dev, &staging, fs);
                let took = start.elapsed();
                node.unstage(&vol, &staging);
                took
            },
        );
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
