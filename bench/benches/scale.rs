//! Publish in a crowded mount namespace (run as root: `cargo bench --bench scale`): issue 7's
//! group 5. The namespace is the sandbox's private one, shared by the daemon; it gets one tmpfs
//! with 100, then 1,000, then 10,000 bind mounts on it (all detached at the end, also when a
//! bench panics).
//!
//! Group `scale`, at each size `n`, its raw reference first:
//! * `raw/<n>`: mount(MS_BIND) + umount2 of a directory, by syscall;
//! * `grpc/<n>`: NodePublishVolume + NodeUnpublishVolume through gRPC on the real daemon.

use std::time::Duration;

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use moor_bench::{Budget, Crowd, MIB, Node, mount_count};

const SIZES: [usize; 3] = [100, 1_000, 10_000];

fn scale(c: &mut Criterion) {
    let mut node = Node::start("bench-scale");
    let (staging, target) = node.staged_volume("vol-scale", 64 * MIB);
    let raw_src = node.sb.root.join("raw-src");
    let raw_dst = node.sb.root.join("raw-dst");
    std::fs::create_dir_all(&raw_src).expect("dir");
    std::fs::create_dir_all(&raw_dst).expect("dir");
    // Declared after the node, so dropped (detached) before the node's sandbox.
    let mut crowd = Crowd::new(node.sb.root.join("crowd")).expect("crowd tmpfs");

    let budget = Budget::new(50, Duration::from_secs(1), Duration::from_secs(3));
    let mut g = c.benchmark_group("scale");
    g.sample_size(budget.samples)
        .warm_up_time(budget.warm_up)
        .measurement_time(budget.measurement);
    for n in SIZES {
        crowd.grow_to(n).expect("bind mounts");
        println!(
            "scale: {} bind mounts added, {} mounts in the namespace",
            crowd.binds(),
            mount_count()
        );
        g.bench_with_input(BenchmarkId::new("raw", n), &n, |b, _| {
            b.iter(|| {
                rustix::mount::mount_bind(raw_src.as_path(), raw_dst.as_path()).expect("bind");
                rustix::mount::unmount(raw_dst.as_path(), rustix::mount::UnmountFlags::empty())
                    .expect("umount");
            })
        });
        g.bench_with_input(BenchmarkId::new("grpc", n), &n, |b, _| {
            b.iter(|| node.publish_unpublish("vol-scale", &staging, &target))
        });
    }
    g.finish();
    drop(crowd);
    node.unstage("vol-scale", &staging);
}

criterion_group!(benches, scale);
criterion_main!(benches);
