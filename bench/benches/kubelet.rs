//! moor as kubelet calls it, against the reference driver and the true floor, all in one run
//! (run as root: `cargo bench --bench kubelet`). Everything happens in a private mount
//! namespace and is cleaned up, also when a bench panics.
//!
//! The client is a bare HTTP/2 one ([`PathClient`]), as kubelet's grpc-go sends the socket
//! path as the `:authority`. "Kubelet-like" calls each dial a connection of their own and
//! close it after, with NodeGetCapabilities first (on its own connection) before a stage, an
//! unstage and a publish ([`Kubelet`]).
//!
//! Group `kubelet`:
//! * `raw-dir`: mkdir + mount(MS_BIND) + umount2 + rmdir by syscall: the kernel's share of a
//!   publish+unpublish, which the spec has the plugin do;
//! * `null-open`, `null-fresh`: one NodeGetCapabilities on moor-node, on an open connection
//!   and on a fresh one (dial, HTTP/2 set-up, the call, close);
//! * `pair-open`: NodePublishVolume + NodeUnpublishVolume on one open connection;
//! * `safe-floor`: the same pair's system calls replayed raw in the bench's process, on a
//!   staging mount of its own ([`SafeFloor`]: the symlink-safe resolutions, the checks that a
//!   path is a mount, the journal's records and log lines moor-node writes, the bind by
//!   `open_tree` + `move_mount`, the unmount through the parent's descriptor, the removal),
//!   and two `null-open` calls: the least a plugin making moor's safety checks could do;
//! * `pair-kubelet`: the same pair as kubelet makes it (three fresh connections);
//! * `stage-kubelet`: NodeStageVolume + NodeUnstageVolume of a formatted ext4 loop device as
//!   kubelet makes them (four fresh connections);
//! * `hostpath-null-fresh`, `hostpath-pair-kubelet`, `hostpath-stage-kubelet`: the same on
//!   the reference driver, kubernetes-csi's `hostpathplugin` (skipped when it is absent).
//!
//! Group `kubelet-paired`, the ratios the targets are held to, each side run in turn:
//! * `pair-open`: `pair-open` against the floor: `raw-dir` plus two `null-open` calls;
//! * `pair-safe`: `pair-open` against the safe floor: what moor's own code adds above the
//!   system calls its safety needs;
//! * `safe-floor`: the safe floor against the floor: what those calls cost;
//! * `hostpath-pair`: hostpathplugin's kubelet-like pair against moor's;
//! * `hostpath-stage`: hostpathplugin's kubelet-like stage+unstage against moor's.
//!
//! Group `kubelet-baseline`, to bisect (run only with `MOOR_BENCH_BASELINE` set to another
//! build of moor-node, an older commit's `target/release/moor-node`):
//! * `pair-open`: this build's `pair-open` against the same pair on that build, started beside
//!   it in the same sandbox with a volume of its own, each side run in turn.

use std::path::Path;
use std::time::Duration;

use criterion::{Criterion, criterion_group, criterion_main};
use moor_bench::safe_floor::{self, Call, SafeFloor};
use moor_bench::storm::hostpathplugin;
use moor_bench::{
    self, Budget, MIB, Node, mkfs, paired, publish_req, stage_req, timed, unpublish_req,
    unstage_req,
};
use moor_privileged::kubelet_calls::{Kubelet, fresh_call, method};
use moor_privileged::pathgrpc::PathClient;
use moor_privileged::requests::cap;
use moor_proto::csi::v1 as csi;

/// A pair on one open connection.
fn pair_open(
    c: &mut PathClient,
    pubr: &csi::NodePublishVolumeRequest,
    unp: &csi::NodeUnpublishVolumeRequest,
) {
    c.unary::<_, csi::NodePublishVolumeResponse>(method::PUBLISH, pubr)
        .expect("NodePublishVolume");
    c.unary::<_, csi::NodeUnpublishVolumeResponse>(method::UNPUBLISH, unp)
        .expect("NodeUnpublishVolume");
}

/// NodeGetCapabilities on an open connection.
fn null_open(c: &mut PathClient) {
    c.unary::<_, csi::NodeGetCapabilitiesResponse>(
        method::CAPABILITIES,
        &csi::NodeGetCapabilitiesRequest {},
    )
    .expect("NodeGetCapabilities");
}

/// A kubelet-like publish+unpublish.
fn pair_kubelet(
    k: &Kubelet,
    pubr: &csi::NodePublishVolumeRequest,
    unp: &csi::NodeUnpublishVolumeRequest,
) {
    k.publish(pubr).expect("publish");
    k.unpublish(unp).expect("unpublish");
}

/// A kubelet-like stage+unstage.
fn stage_kubelet(
    k: &Kubelet,
    st: &csi::NodeStageVolumeRequest,
    un: &csi::NodeUnstageVolumeRequest,
) {
    k.stage(st).expect("stage");
    k.unstage(un).expect("unstage");
}

/// The reference driver in the sandbox, with a volume of its own: its client, publish and
/// stage requests.
struct Hostpath {
    _plugin: moor_bench::Plugin,
    k: Kubelet,
    publish: csi::NodePublishVolumeRequest,
    unpublish: csi::NodeUnpublishVolumeRequest,
    stage: csi::NodeStageVolumeRequest,
    unstage: csi::NodeUnstageVolumeRequest,
}

fn hostpath(node: &Node, program: &Path) -> Hostpath {
    let plugin = node.start_hostpath(program);
    let socket = plugin.socket().to_path_buf();
    let created: csi::CreateVolumeResponse = fresh_call(
        &socket,
        method::CREATE_VOLUME,
        &csi::CreateVolumeRequest {
            name: "bench-hostpath".into(),
            capacity_range: Some(csi::CapacityRange {
                required_bytes: MIB as i64,
                limit_bytes: 0,
            }),
            volume_capabilities: vec![cap("ext4")],
            ..Default::default()
        },
    )
    .expect("hostpathplugin CreateVolume");
    let id = created.volume.expect("a volume").volume_id;
    let staging = node.sb.staging("pv-hostpath");
    std::fs::create_dir_all(&staging).expect("staging dir");
    let target = node.sb.target("pod-hostpath", "pv-hostpath");
    let k = Kubelet::new(&socket);
    let stage = stage_req(&id, Path::new("/dev/null"), &staging, "ext4");
    let unstage = unstage_req(&id, &staging);
    k.stage(&stage).expect("hostpathplugin NodeStageVolume");
    Hostpath {
        _plugin: plugin,
        publish: publish_req(&id, &staging, &target),
        unpublish: unpublish_req(&id, &target),
        stage,
        unstage,
        k,
    }
}

fn kubelet(c: &mut Criterion) {
    let mut node = Node::start("bench-kubelet");
    node.sb.data_in_memory();
    let (staging, target) = node.staged_volume("vol-k", 64 * MIB);
    let socket = node.socket().to_path_buf();
    let k = Kubelet::new(&socket);
    let mut open = PathClient::dial(&socket).expect("dial moor-node");
    let mut open_floor = PathClient::dial(&socket).expect("dial moor-node");
    let pubr = publish_req("vol-k", &staging, &target);
    let unp = unpublish_req("vol-k", &target);

    // A formatted device for the stage pairs, staged and unstaged by each iteration.
    let dev = node.sb.loop_device("vol-s.img", 64 * MIB);
    mkfs("ext4", &dev).expect("mkfs");
    let st_staging = node.sb.staging("vol-s");
    let st = stage_req("vol-s", &dev, &st_staging, "ext4");
    let un = unstage_req("vol-s", &st_staging);

    let hp = hostpathplugin().map(|p| hostpath(&node, &p));

    // The safe floor: an ext4 loop device of the bench's own mounted at a staging path beside
    // moor's, and what moor-node writes for one pair, learnt from one.
    let safe_dev = node.sb.loop_device("vol-safe.img", 64 * MIB);
    mkfs("ext4", &safe_dev).expect("mkfs");
    let safe_staging = node.sb.staging("vol-safe");
    std::fs::create_dir_all(&safe_staging).expect("staging dir");
    rustix::mount::mount(
        safe_dev.as_path(),
        safe_staging.as_path(),
        "ext4",
        rustix::mount::MountFlags::empty(),
        None,
    )
    .expect("mount the safe floor's staging");
    let moor_log = node.sb.root.join("moor-node.log");
    let writes = safe_floor::learn(
        &node.sb.state.join(moor_node::journal::LOG_FILE),
        &moor_log,
        |call| match call {
            Call::Publish => {
                open.unary::<_, csi::NodePublishVolumeResponse>(method::PUBLISH, &pubr)
                    .expect("NodePublishVolume");
            }
            Call::Unpublish => {
                open.unary::<_, csi::NodeUnpublishVolumeResponse>(method::UNPUBLISH, &unp)
                    .expect("NodeUnpublishVolume");
            }
        },
    );
    let mut safe = SafeFloor::new(
        &node.sb.kubelet,
        &safe_staging,
        &node.sb.target("pod-safe", "vol-safe"),
        writes,
        &node.sb.state,
        &node.sb.root.join("safe-floor.log"),
    );
    let mut open_safe = PathClient::dial(&socket).expect("dial moor-node");
    let mut safe_floor = |c: &mut PathClient| {
        safe.publish();
        null_open(c);
        safe.unpublish();
        null_open(c);
    };

    let raw_src = node.sb.root.join("raw-src");
    std::fs::create_dir_all(&raw_src).expect("dir");
    let raw_dir = node.sb.root.join("raw-dir");
    let raw = || {
        std::fs::create_dir(&raw_dir).expect("mkdir");
        rustix::mount::mount_bind(raw_src.as_path(), raw_dir.as_path()).expect("bind");
        rustix::mount::unmount(raw_dir.as_path(), rustix::mount::UnmountFlags::empty())
            .expect("umount");
        std::fs::remove_dir(&raw_dir).expect("rmdir");
    };

    let budget = Budget::new(50, Duration::from_secs(1), Duration::from_secs(4));
    let mut g = c.benchmark_group("kubelet");
    g.sample_size(budget.samples)
        .warm_up_time(budget.warm_up)
        .measurement_time(budget.measurement);
    g.bench_function("raw-dir", |b| b.iter(raw));
    g.bench_function("null-open", |b| b.iter(|| null_open(&mut open)));
    g.bench_function("null-fresh", |b| {
        b.iter(|| k.capabilities().expect("capabilities"))
    });
    g.bench_function("pair-open", |b| {
        b.iter(|| pair_open(&mut open, &pubr, &unp))
    });
    g.bench_function("safe-floor", |b| b.iter(|| safe_floor(&mut open_safe)));
    g.bench_function("pair-kubelet", |b| b.iter(|| pair_kubelet(&k, &pubr, &unp)));
    g.bench_function("stage-kubelet", |b| b.iter(|| stage_kubelet(&k, &st, &un)));
    if let Some(hp) = &hp {
        g.bench_function("hostpath-null-fresh", |b| {
            b.iter(|| hp.k.capabilities().expect("capabilities"))
        });
        g.bench_function("hostpath-pair-kubelet", |b| {
            b.iter(|| pair_kubelet(&hp.k, &hp.publish, &hp.unpublish))
        });
        g.bench_function("hostpath-stage-kubelet", |b| {
            b.iter(|| stage_kubelet(&hp.k, &hp.stage, &hp.unstage))
        });
    }
    g.finish();
    if let Some(hp) = &hp {
        // Its stage bench left the volume unstaged; it publishes only a staged one.
        hp.k.stage(&hp.stage)
            .expect("hostpathplugin NodeStageVolume");
    }

    // The floor: the kernel's share and two null calls.
    let mut floor = || {
        raw();
        null_open(&mut open_floor);
        null_open(&mut open_floor);
    };
    let paired_budget = Budget::new(20, Duration::from_secs(1), Duration::from_secs(5));
    let mut pc = moor_bench::paired_criterion();
    let mut pg = moor_bench::flat_group(&mut pc, "kubelet-paired", paired_budget);
    pg.bench_function("pair-open", |b| {
        b.iter_custom(|iters| {
            paired(
                iters,
                || timed(&mut floor),
                || timed(|| pair_open(&mut open, &pubr, &unp)),
            )
        })
    });
    pg.bench_function("pair-safe", |b| {
        b.iter_custom(|iters| {
            paired(
                iters,
                || timed(|| safe_floor(&mut open_safe)),
                || timed(|| pair_open(&mut open, &pubr, &unp)),
            )
        })
    });
    pg.bench_function("safe-floor", |b| {
        b.iter_custom(|iters| {
            paired(
                iters,
                || timed(&mut floor),
                || timed(|| safe_floor(&mut open_safe)),
            )
        })
    });
    if let Some(hp) = &hp {
        pg.bench_function("hostpath-pair", |b| {
            b.iter_custom(|iters| {
                paired(
                    iters,
                    || timed(|| pair_kubelet(&k, &pubr, &unp)),
                    || timed(|| pair_kubelet(&hp.k, &hp.publish, &hp.unpublish)),
                )
            })
        });
        // Last: each round leaves the reference driver's volume unstaged.
        pg.bench_function("hostpath-stage", |b| {
            b.iter_custom(|iters| {
                paired(
                    iters,
                    || timed(|| stage_kubelet(&k, &st, &un)),
                    || timed(|| stage_kubelet(&hp.k, &hp.stage, &hp.unstage)),
                )
            })
        });
    }
    pg.finish();
    if let Some(program) = std::env::var_os("MOOR_BENCH_BASELINE") {
        baseline(
            &node,
            Path::new(&program),
            &mut open,
            &pubr,
            &unp,
            paired_budget,
        );
    }
    drop(open);
    drop(open_floor);
    drop(open_safe);
    drop(safe);
    node.unstage("vol-k", &staging);
}

/// This build's pair on one open connection against the same pair on `program`, another
/// build of moor-node (group `kubelet-baseline`).
fn baseline(
    node: &Node,
    program: &Path,
    open: &mut PathClient,
    pubr: &csi::NodePublishVolumeRequest,
    unp: &csi::NodeUnpublishVolumeRequest,
    budget: Budget,
) {
    let mut base = node.start_second_program("baseline", program, &[]);
    let dev = node.sb.loop_device("vol-b.img", 64 * MIB);
    let staging = node.sb.staging("vol-b");
    let target = node.sb.target("pod-vol-b", "vol-b");
    base.stage("vol-b", &dev, &staging, "ext4");
    let mut base_open = PathClient::dial(base.socket()).expect("dial the baseline");
    let (base_pub, base_unp) = (
        publish_req("vol-b", &staging, &target),
        unpublish_req("vol-b", &target),
    );
    let mut pc = moor_bench::paired_criterion();
    let mut pg = moor_bench::flat_group(&mut pc, "kubelet-baseline", budget);
    pg.bench_function("pair-open", |b| {
        b.iter_custom(|iters| {
            paired(
                iters,
                || timed(|| pair_open(&mut base_open, &base_pub, &base_unp)),
                || timed(|| pair_open(open, pubr, unp)),
            )
        })
    });
    pg.finish();
    drop(base_open);
    base.unstage("vol-b", &staging);
}

criterion_group!(benches, kubelet);
criterion_main!(benches);
