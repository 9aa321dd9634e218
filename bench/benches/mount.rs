//! Publish against the raw-syscall limit, measured in the same run (run as root:
//! `cargo bench --bench mount`). Everything happens in a private mount namespace and is
//! cleaned up, also when a bench panics.
//!
//! Group `publish`, its raw reference first so results read as ratios:
//! * `raw`: mount(MS_BIND) + umount2 of a directory, by syscall (issue 7's group 1);
//! * `raw-dir`: the same with the target made before and removed after (mkdir, rmdir), which
//!   the spec has the plugin do: the kernel's share of a publish+unpublish;
//! * `engine`: the engine's publish + unpublish of a staged ext4 volume, without gRPC (2);
//! * `grpc-null`: two NodeGetCapabilities calls on the real daemon: the gRPC round trips of a
//!   pair with no work behind them;
//! * `bare`: NodePublishVolume + NodeUnpublishVolume through gRPC on `bare-node`, a server that
//!   does nothing but the mkdir, bind, umount2 and rmdir: what any plugin that speaks gRPC
//!   pays for a pair, group 3's floor;
//! * `grpc`: NodePublishVolume + NodeUnpublishVolume through gRPC on the real daemon (3).
//!
//! Group `publish-paired`: the ratios the targets are held to, each measured turn by turn with
//! `raw` in the same sample ([`moor_bench::Paired`]): `grpc` and `bare` against `raw`.

use std::path::Path;
use std::time::Duration;

use criterion::{Criterion, criterion_group, criterion_main};
use moor_bench::{
    self, Budget, MIB, Node, paired, publish_req, stage_req, timed, unpublish_req, unstage_req,
};
use moor_node::validate;

fn publish(c: &mut Criterion) {
    let mut node = Node::start("bench-publish");
    let (staging, target) = node.staged_volume("vol-pub", 64 * MIB);

    let budget = Budget::new(100, Duration::from_secs(2), Duration::from_secs(5));
    let mut g = c.benchmark_group("publish");
    g.sample_size(budget.samples)
        .warm_up_time(budget.warm_up)
        .measurement_time(budget.measurement);

    let raw_src = node.sb.root.join("raw-src");
    let raw_dst = node.sb.root.join("raw-dst");
    std::fs::create_dir_all(&raw_src).expect("dir");
    std::fs::create_dir_all(&raw_dst).expect("dir");
    let raw = || {
        rustix::mount::mount_bind(raw_src.as_path(), raw_dst.as_path()).expect("bind");
        rustix::mount::unmount(raw_dst.as_path(), rustix::mount::UnmountFlags::empty())
            .expect("umount");
    };
    g.bench_function("raw", |b| b.iter(raw));

    // The same, with the target made before and removed after, as the spec has the plugin do
    // (mkdir + bind + umount2 + rmdir): the kernel's share of a publish+unpublish pair.
    let raw_dir = node.sb.root.join("raw-dir");
    g.bench_function("raw-dir", |b| {
        b.iter(|| {
            std::fs::create_dir(&raw_dir).expect("mkdir");
            rustix::mount::mount_bind(raw_src.as_path(), raw_dir.as_path()).expect("bind");
            rustix::mount::unmount(raw_dir.as_path(), rustix::mount::UnmountFlags::empty())
                .expect("umount");
            std::fs::remove_dir(&raw_dir).expect("rmdir");
        })
    });

    // The engine alone, in this process, on its own state dir and volume.
    let sb = &node.sb;
    let engine = moor_bench::engine(sb, "state-engine");
    let dev2 = sb.loop_device("eng.img", 64 * MIB);
    let staging2 = sb.staging("pv-eng");
    let st = validate::stage(&stage_req("vol-eng", &dev2, &staging2, "ext4"), &sb.kubelet)
        .expect("valid");
    engine
        .stage(&st, &mut Default::default())
        .expect("engine stage");
    let target2 = sb.target("pod-eng", "pv-eng");
    let pub2 = validate::publish(&publish_req("vol-eng", &staging2, &target2), &sb.kubelet)
        .expect("valid");
    let unpub2 =
        validate::unpublish(&unpublish_req("vol-eng", &target2), &sb.kubelet).expect("valid");
    g.bench_function("engine", |b| {
        b.iter(|| {
            engine.publish(&pub2).expect("publish");
            engine.unpublish(&unpub2).expect("unpublish");
        })
    });
    let st2 = validate::unstage(&unstage_req("vol-eng", &staging2), &sb.kubelet).expect("valid");
    engine.unstage(&st2).expect("engine unstage");

    g.bench_function("grpc-null", |b| b.iter(|| node.null_calls(2)));
    let mut bare = node.start_bare(Path::new(env!("CARGO_BIN_EXE_bare-node")));
    let bare_target = node.sb.target("pod-bare", "vol-pub");
    g.bench_function("bare", |b| {
        b.iter(|| bare.publish_unpublish("vol-pub", &staging, &bare_target))
    });
    g.bench_function("grpc", |b| {
        b.iter(|| node.publish_unpublish("vol-pub", &staging, &target))
    });
    g.finish();

    // The ratios the targets are held to, each side run in turn with the raw reference.
    let mut pc = moor_bench::paired_criterion();
    let mut pg = moor_bench::flat_group(&mut pc, "publish-paired", budget);
    pg.bench_function("grpc", |b| {
        b.iter_custom(|iters| {
            paired(
                iters,
                || timed(raw),
                || timed(|| node.publish_unpublish("vol-pub", &staging, &target)),
            )
        })
    });
    pg.bench_function("bare", |b| {
        b.iter_custom(|iters| {
            paired(
                iters,
                || timed(raw),
                || timed(|| bare.publish_unpublish("vol-pub", &staging, &bare_target)),
            )
        })
    });
    pg.finish();
    drop(bare);
    node.unstage("vol-pub", &staging);
}

criterion_group!(benches, publish);
criterion_main!(benches);
