//! Staging a loop device against the raw mount(2) of the same device, measured in the same run
//! (run as root: `cargo bench --bench stage`). Everything happens in a private mount namespace
//! and is cleaned up, also when a bench panics. The loop devices are backed by files on a
//! tmpfs, so what is compared is the work of mounting, not the host disk's flush latency
//! (the same for both sides, and the noisiest part of the machine).
//!
//! * Group `stage` (issue 7's group 4): an already formatted ext4 and xfs device.
//!   `raw-<fs>`: mount(2) + umount2; `engine-<fs>`: the engine's stage + unstage in this
//!   process, without gRPC; `grpc-<fs>`: NodeStageVolume + NodeUnstageVolume.
//! * Group `first-stage` (7): the first stage of a blank 10 GiB volume (a fresh sparse file on
//!   a fresh loop device each iteration, set up and torn down outside the timing).
//!   `raw-<fs>`: moor's mkfs command + mount(2); `grpc-<fs>`: NodeStageVolume, which probes,
//!   formats and mounts. The unmount (umount2 / NodeUnstageVolume) is not timed.

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
    // The engine alone, in this process, on its own state dir (the same volume and device: the
    // daemon has it unstaged whenever the engine stages it, and the other way round).
    let engine = bench::engine(&node.sb, "state-engine");
    for fs in FILESYSTEMS {
        // xfs needs 300 MiB at least.
        let dev = node.sb.loop_device(&format!("stage-{fs}.img"), 512 * MIB);
        let staging = node.sb.staging(&format!("pv-stage-{fs}"));
        let vol = format!("vol-stage-{fs}");
        // Formatted once, by moor itself, then unstaged: the benches mount a formatted device.
        node.stage(&vol, &dev, &staging, fs);
        node.unstage(&vol, &staging);
        std::fs::create_dir_all(&staging).expect("staging dir");
        g.bench_function(format!("raw-{fs}"), |b| {
            b.iter(|| {
                rustix::mount::mount(
                    dev.as_path(),
                    staging.as_path(),
                    fs,
                    MountFlags::empty(),
                    mount_data(fs),
                )
                .expect("mount");
                rustix::mount::unmount(staging.as_path(), UnmountFlags::empty()).expect("umount");
            })
        });
        let stage =
            validate::stage(&stage_req(&vol, &dev, &staging, fs), &node.sb.kubelet).expect("valid");
        let unstage =
            validate::unstage(&unstage_req(&vol, &staging), &node.sb.kubelet).expect("valid");
        g.bench_function(format!("engine-{fs}"), |b| {
            b.iter(|| {
                engine.stage(&stage).expect("engine stage");
                engine.unstage(&unstage).expect("engine unstage");
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

/// Group 7: the first stage of a blank 10 GiB device.
fn first_stage(node: &mut Node, c: &mut Criterion) {
    let budget = Budget::new(10, Duration::from_secs(1), Duration::from_secs(6));
    let mut g = c.benchmark_group("first-stage");
    g.sample_size(budget.samples)
        .warm_up_time(budget.warm_up)
        .measurement_time(budget.measurement)
        .sampling_mode(SamplingMode::Flat);
    let data = node.sb.data.clone();
    let fresh = move |fs: &str| BlankDevice::new(data.join(format!("first-{fs}.img")), 10 * GIB);
    for fs in FILESYSTEMS {
        let staging = node.sb.staging(&format!("pv-first-{fs}"));
        let vol = format!("vol-first-{fs}");
        g.bench_function(format!("raw-{fs}"), |b| {
            b.iter_custom(|iters| {
                let mut timed = Duration::ZERO;
                for _ in 0..iters {
                    let blank = fresh(fs);
                    std::fs::create_dir_all(&staging).expect("staging dir");
                    let start = Instant::now();
                    let out = mkfs_command(fs, &blank.dev).output().expect("mkfs");
                    assert!(
                        out.status.success(),
                        "mkfs.{fs}: {}",
                        String::from_utf8_lossy(&out.stderr)
                    );
                    rustix::mount::mount(
                        blank.dev.as_path(),
                        staging.as_path(),
                        fs,
                        MountFlags::empty(),
                        mount_data(fs),
                    )
                    .expect("mount");
                    timed += start.elapsed();
                    rustix::mount::unmount(staging.as_path(), UnmountFlags::empty())
                        .expect("umount");
                }
                timed
            })
        });
        g.bench_function(format!("grpc-{fs}"), |b| {
            b.iter_custom(|iters| {
                let mut timed = Duration::ZERO;
                for _ in 0..iters {
                    let blank = fresh(fs);
                    let start = Instant::now();
                    node.stage(&vol, &blank.dev, &staging, fs);
                    timed += start.elapsed();
                    node.unstage(&vol, &staging);
                }
                timed
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
