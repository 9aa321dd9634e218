//! Mount throughput against the raw-syscall limit, measured in the same run (run as root:
//! `cargo bench`). Everything happens in a private mount namespace and is cleaned up.
//!
//! Groups, each with its raw reference first so results read as ratios:
//! * `publish`: mount(MS_BIND) + umount2 of a directory; the engine's publish + unpublish
//!   without gRPC; NodePublishVolume + NodeUnpublishVolume through gRPC on the real daemon.
//! * `stage`: mount(2) + umount2 of an ext4 and an xfs loop device; NodeStageVolume +
//!   NodeUnstageVolume of the same, already formatted, device through gRPC.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use criterion::{Criterion, criterion_group, criterion_main};
use csi::node_client::NodeClient;
use csi::volume_capability::{AccessMode, AccessType, MountVolume, access_mode::Mode};
use moor_node::engine::{Engine, EngineConfig};
use moor_node::journal::Journal;
use moor_node::sys::linux::Linux;
use moor_node::validate;
use moor_privileged::Sandbox;
use moor_privileged::client::{Daemon, connect};
use moor_proto::csi::v1 as csi;

const MIB: u64 = 1 << 20;

fn cap(fs: &str) -> csi::VolumeCapability {
    csi::VolumeCapability {
        access_mode: Some(AccessMode {
            mode: Mode::SingleNodeMultiWriter as i32,
        }),
        access_type: Some(AccessType::Mount(MountVolume {
            fs_type: fs.into(),
            mount_flags: vec![],
            volume_mount_group: String::new(),
        })),
    }
}

fn stage_req(vol: &str, dev: &Path, staging: &Path, fs: &str) -> csi::NodeStageVolumeRequest {
    csi::NodeStageVolumeRequest {
        volume_id: vol.into(),
        publish_context: HashMap::from([("devicePath".into(), dev.display().to_string())]),
        staging_target_path: staging.display().to_string(),
        volume_capability: Some(cap(fs)),
        secrets: HashMap::new(),
        volume_context: HashMap::new(),
    }
}

fn publish_req(vol: &str, staging: &Path, target: &Path) -> csi::NodePublishVolumeRequest {
    csi::NodePublishVolumeRequest {
        volume_id: vol.into(),
        publish_context: HashMap::new(),
        staging_target_path: staging.display().to_string(),
        target_path: target.display().to_string(),
        volume_capability: Some(cap("ext4")),
        readonly: false,
        secrets: HashMap::new(),
        volume_context: HashMap::new(),
    }
}

fn unpublish_req(vol: &str, target: &Path) -> csi::NodeUnpublishVolumeRequest {
    csi::NodeUnpublishVolumeRequest {
        volume_id: vol.into(),
        target_path: target.display().to_string(),
    }
}

fn unstage_req(vol: &str, staging: &Path) -> csi::NodeUnstageVolumeRequest {
    csi::NodeUnstageVolumeRequest {
        volume_id: vol.into(),
        staging_target_path: staging.display().to_string(),
    }
}

fn benches(c: &mut Criterion) {
    let sb = Sandbox::new("bench");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("rt");
    let socket = sb.root.join("csi.sock");
    let (state, kubelet) = (
        sb.state.display().to_string(),
        sb.kubelet.display().to_string(),
    );
    let mut daemon = rt.block_on(Daemon::start(
        &socket,
        &[
            "--node-id",
            "bench",
            "--state-dir",
            &state,
            "--kubelet-dir",
            &kubelet,
        ],
    ));
    let mut node = rt.block_on(async { NodeClient::new(connect(&socket).await.expect("connect")) });

    // One staged ext4 volume to publish from, through the daemon.
    let dev = sb.loop_device("pub.img", 256 * MIB);
    let staging = sb.staging("pv-pub");
    rt.block_on(node.node_stage_volume(stage_req("vol-pub", &dev, &staging, "ext4")))
        .expect("stage");

    let mut g = c.benchmark_group("publish");
    let raw_src = sb.root.join("raw-src");
    let raw_dst = sb.root.join("raw-dst");
    std::fs::create_dir_all(&raw_src).expect("dir");
    std::fs::create_dir_all(&raw_dst).expect("dir");
    g.bench_function("raw mount(MS_BIND)+umount2", |b| {
        b.iter(|| {
            rustix::mount::mount_bind(raw_src.as_path(), raw_dst.as_path()).expect("bind");
            rustix::mount::unmount(raw_dst.as_path(), rustix::mount::UnmountFlags::empty())
                .expect("umount");
        })
    });

    // The engine alone, in this process, on its own state dir and volume.
    let state2 = sb.root.join("state-engine");
    let os = Arc::new(Linux::new(&sb.kubelet).expect("os"));
    let (journal, _) = Journal::open(&state2, false).expect("journal");
    let cfg = EngineConfig {
        kubelet_dir: sb.kubelet.clone(),
        ..EngineConfig::default()
    };
    let engine = Engine::new(os, Arc::new(journal), cfg);
    let dev2 = sb.loop_device("eng.img", 256 * MIB);
    let staging2 = sb.staging("pv-eng");
    let st = validate::stage(&stage_req("vol-eng", &dev2, &staging2, "ext4"), &sb.kubelet)
        .expect("valid");
    engine.stage(&st).expect("engine stage");
    let target2 = sb.target("pod-eng", "pv-eng");
    let pub2 = validate::publish(&publish_req("vol-eng", &staging2, &target2), &sb.kubelet)
        .expect("valid");
    let unpub2 =
        validate::unpublish(&unpublish_req("vol-eng", &target2), &sb.kubelet).expect("valid");
    g.bench_function("engine publish+unpublish", |b| {
        b.iter(|| {
            engine.publish(&pub2).expect("publish");
            engine.unpublish(&unpub2).expect("unpublish");
        })
    });

    let target = sb.target("pod", "pv-pub");
    g.bench_function("grpc NodePublish+NodeUnpublish", |b| {
        b.iter(|| {
            rt.block_on(async {
                node.node_publish_volume(publish_req("vol-pub", &staging, &target))
                    .await
                    .expect("publish");
                node.node_unpublish_volume(unpublish_req("vol-pub", &target))
                    .await
                    .expect("unpublish");
            })
        })
    });
    g.finish();
    let st2 = validate::unstage(&unstage_req("vol-eng", &staging2), &sb.kubelet).expect("valid");
    engine.unstage(&st2).expect("engine unstage");
    rt.block_on(node.node_unstage_volume(unstage_req("vol-pub", &staging)))
        .expect("unstage");

    let mut g = c.benchmark_group("stage");
    g.sample_size(30);
    for fs in ["ext4", "xfs"] {
        let dev = sb.loop_device(&format!("stage-{fs}.img"), 512 * MIB);
        let staging = sb.staging(&format!("pv-stage-{fs}"));
        let vol = format!("vol-stage-{fs}");
        // Formatted once, by moor itself, then unstaged: the benches mount a formatted device.
        rt.block_on(node.node_stage_volume(stage_req(&vol, &dev, &staging, fs)))
            .expect("stage");
        rt.block_on(node.node_unstage_volume(unstage_req(&vol, &staging)))
            .expect("unstage");
        let data = if fs == "xfs" { Some(c"nouuid") } else { None };
        g.bench_function(format!("raw mount(2)+umount2 {fs}"), |b| {
            b.iter(|| {
                rustix::mount::mount(
                    dev.as_path(),
                    staging.as_path(),
                    fs,
                    rustix::mount::MountFlags::empty(),
                    data,
                )
                .expect("mount");
                rustix::mount::unmount(staging.as_path(), rustix::mount::UnmountFlags::empty())
                    .expect("umount");
            })
        });
        g.bench_function(format!("grpc NodeStage+NodeUnstage {fs}"), |b| {
            b.iter(|| {
                rt.block_on(async {
                    node.node_stage_volume(stage_req(&vol, &dev, &staging, fs))
                        .await
                        .expect("stage");
                    node.node_unstage_volume(unstage_req(&vol, &staging))
                        .await
                        .expect("unstage");
                })
            })
        });
    }
    g.finish();
    drop(node);
    drop(rt);
    let _ = daemon.terminate();
}

criterion_group!(mount, benches);
criterion_main!(mount);
