//! RBD volumes on a real Ceph cluster (run as root): `moor-node --rbd-attacher fuse` maps
//! images with rbd-fuse and a loop device, stages, publishes, unstages and unmaps them, and
//! survives being killed at any step of a map, a first or a later stage, an unstage or an
//! unmap.
//!
//! The cluster is the one `.ci/ceph-cluster up` prints the environment of (`MOOR_CEPH_CONF`,
//! `MOOR_CEPH_KEYRING`, `MOOR_CEPH_USER`, `MOOR_CEPH_POOL`, `MOOR_CEPH_MON_HOST`); `.ci/test`
//! brings one up. Without it every test says it is skipped and passes. Each test makes its
//! own images and removes them; whatever a failed test leaves (loop devices, rbd-fuse, mounts)
//! is removed when it ends.

use std::os::unix::fs::FileExt as _;
use std::os::unix::process::CommandExt as _;
use std::path::Path;
use std::time::{Duration, Instant};

use csi::controller_client::ControllerClient;
use csi::node_client::NodeClient;
use csi::volume_capability::access_mode::Mode;
use moor_lab::ceph::{Ceph, World, block, ext4, ms, publish};
use moor_node::crash_points;
use moor_node::sys::loopdev;
use moor_privileged::client::{DEADLINE, Daemon, connect};
use moor_privileged::requests::{unpublish_req, unstage_req};
use moor_privileged::{fs_cap, mount_depth, runtime};
use moor_proto::csi::v1 as csi;
use moor_runtime::contract::RBD_USER_KEY_SECRET as USER_KEY_KEY;
use tonic::transport::Channel;

const MIB: u64 = 1 << 20;
const MARKER: &[u8] = b"written through rbd-fuse before the unmap";
/// The test build of moor-node with crash points (see privileged/tests/crash.rs).
const CRASH_NODE: &str = "moor-node-crash-points";

#[test]
fn a_filesystem_keeps_its_data_through_unmap_and_remap() {
    let Some(ceph) = Ceph::from_env("a_filesystem_keeps_its_data_through_unmap_and_remap") else {
        return;
    };
    let mut w = World::new("rbd-fs", ceph, 1);
    let image = w.image("fs", 256);
    let staging = w.staging(0, "pv");
    let target = w.target(0, "pv");
    let rt = runtime();
    rt.block_on(async {
        let mut node = w.start(0, "moor-node", &[]).await;
        let t = Instant::now();
        node.node_stage_volume(w.stage_req("vol", &image, &staging, ext4()))
            .await
            .expect("first stage (map, mkfs, mount)");
        let first_stage = t.elapsed();
        assert_eq!(
            w.leftovers(0),
            (1, 1, 1),
            "one rbd-fuse, one loop device, one mount"
        );
        // The device is the loop device over the image file, with direct I/O.
        let (l, file) = loopdev::bound_under(&w.nodes[0].state.join("rbd"))
            .pop()
            .expect("loop");
        assert_eq!(
            file.file_name().and_then(|f| f.to_str()),
            Some(image.as_str())
        );
        let sys = format!(
            "/sys/block/{}/loop/dio",
            l.path
                .file_name()
                .and_then(|f| f.to_str())
                .unwrap_or_default()
        );
        assert_eq!(std::fs::read_to_string(sys).expect("dio").trim(), "1");
        node.node_publish_volume(publish("vol", &staging, &target, ext4()))
            .await
            .expect("publish");
        let f = std::fs::File::create(target.join("marker")).expect("create");
        f.write_all_at(MARKER, 0).expect("write");
        f.sync_all().expect("fsync");
        drop(f);
        node.node_unpublish_volume(unpublish_req("vol", &target))
            .await
            .expect("unpublish");
        let t = Instant::now();
        node.node_unstage_volume(unstage_req("vol", &staging))
            .await
            .expect("unstage (unmount, unmap)");
        let unstage = t.elapsed();
        assert_eq!(w.leftovers(0), (0, 0, 0), "nothing of the mapping left");
        assert!(
            !w.nodes[0]
                .state
                .join("rbd")
                .read_dir()
                .is_ok_and(|mut d| d.next().is_some())
        );
        assert_eq!(w.ceph.watchers(&image), 0, "rbd-fuse closed the image");

        let t = Instant::now();
        node.node_stage_volume(w.stage_req("vol", &image, &staging, ext4()))
            .await
            .expect("second stage (map, mount)");
        let second_stage = t.elapsed();
        node.node_publish_volume(publish("vol", &staging, &target, ext4()))
            .await
            .expect("publish again");
        assert_eq!(
            std::fs::read(target.join("marker")).expect("marker"),
            MARKER,
            "the data is intact"
        );
        node.node_unpublish_volume(unpublish_req("vol", &target))
            .await
            .expect("unpublish");
        node.node_unstage_volume(unstage_req("vol", &staging))
            .await
            .expect("unstage");
        assert_eq!(w.leftovers(0), (0, 0, 0));
        let maps = w.logged_ms(0, "mapped RBD image");
        let unmaps = w.logged_ms(0, "unmapped RBD image");
        eprintln!(
            "rbd-fuse: first stage {} (map, mkfs.ext4 of 256 MiB, mount), second stage {}, \
             unstage {}; map {maps:?} ms, unmap {unmaps:?} ms",
            ms(first_stage),
            ms(second_stage),
            ms(unstage)
        );
        assert_eq!((maps.len(), unmaps.len()), (2, 2), "{}", w.log(0));
    });
}

#[test]
fn a_block_volume_keeps_its_bytes_through_unmap_and_remap() {
    let Some(ceph) = Ceph::from_env("a_block_volume_keeps_its_bytes_through_unmap_and_remap")
    else {
        return;
    };
    let mut w = World::new("rbd-block", ceph, 1);
    let image = w.image("block", 64);
    let staging = w.staging(0, "pv");
    let target = w.block_target(0, "pv");
    let cap = || block(Mode::SingleNodeWriter);
    let rt = runtime();
    rt.block_on(async {
        let mut node = w.start(0, "moor-node", &[]).await;
        for round in 0..2 {
            node.node_stage_volume(w.stage_req("vol", &image, &staging, cap()))
                .await
                .expect("stage");
            node.node_publish_volume(publish("vol", &staging, &target, cap()))
                .await
                .expect("publish");
            let dev = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(&target)
                .expect("open the published device");
            if round == 0 {
                dev.write_all_at(MARKER, 3 * MIB).expect("write");
                dev.sync_all().expect("fsync");
            } else {
                let mut got = vec![0u8; MARKER.len()];
                dev.read_exact_at(&mut got, 3 * MIB).expect("read");
                assert_eq!(got, MARKER, "the bytes are intact");
            }
            drop(dev);
            node.node_unpublish_volume(unpublish_req("vol", &target))
                .await
                .expect("unpublish");
            node.node_unstage_volume(unstage_req("vol", &staging))
                .await
                .expect("unstage");
            assert_eq!(w.leftovers(0), (0, 0, 0), "round {round}");
        }
    });
}

#[test]
fn a_reader_only_image_is_mapped_read_only_on_two_nodes() {
    let Some(ceph) = Ceph::from_env("a_reader_only_image_is_mapped_read_only_on_two_nodes") else {
        return;
    };
    let mut w = World::new("rbd-ro", ceph, 2);
    let image = w.image("ro", 128);
    let rt = runtime();
    rt.block_on(async {
        // Written once, read-write, on node 0.
        let mut a = w.start(0, "moor-node", &[]).await;
        let staging = w.staging(0, "pv");
        let target = w.target(0, "pv");
        a.node_stage_volume(w.stage_req("vol", &image, &staging, ext4()))
            .await
            .expect("stage rw");
        a.node_publish_volume(publish("vol", &staging, &target, ext4()))
            .await
            .expect("publish rw");
        std::fs::write(target.join("marker"), MARKER).expect("write");
        a.node_unpublish_volume(unpublish_req("vol", &target))
            .await
            .expect("unpublish");
        a.node_unstage_volume(unstage_req("vol", &staging))
            .await
            .expect("unstage");

        // Then read-only on both nodes at once.
        let ro = || fs_cap("ext4", Mode::MultiNodeReaderOnly);
        let mut b = w.start(1, "moor-node", &[]).await;
        let stagings = [w.staging(0, "pv"), w.staging(1, "pv")];
        for (i, node) in [&mut a, &mut b].into_iter().enumerate() {
            node.node_stage_volume(w.stage_req("vol", &image, &stagings[i], ro()))
                .await
                .unwrap_or_else(|e| panic!("stage read-only on node {i}: {e:?}"));
        }
        for (i, s) in stagings.iter().enumerate() {
            assert_eq!(w.leftovers(i), (1, 1, 1), "node {i}");
            let (l, _) = loopdev::bound_under(&w.nodes[i].state.join("rbd"))
                .pop()
                .expect("loop");
            assert!(l.read_only, "node {i}: the loop device is read-only");
            assert_eq!(std::fs::read(s.join("marker")).expect("read"), MARKER);
            let e = std::fs::write(s.join("other"), b"x").expect_err("read-only");
            assert_eq!(e.raw_os_error(), Some(libc::EROFS), "node {i}: {e}");
        }
        for (i, node) in [&mut a, &mut b].into_iter().enumerate() {
            node.node_unstage_volume(unstage_req("vol", &stagings[i]))
                .await
                .unwrap_or_else(|e| panic!("unstage on node {i}: {e:?}"));
            assert_eq!(w.leftovers(i), (0, 0, 0), "node {i}");
        }
    });
}

/// kubelet's NodeStageVolume or NodeUnstageVolume, as the crash rounds send them.
async fn call(
    w: &World,
    node: &mut NodeClient<Channel>,
    stage: bool,
    image: &str,
    staging: &Path,
) -> Result<(), tonic::Status> {
    if stage {
        node.node_stage_volume(w.stage_req("vol", image, staging, ext4()))
            .await
            .map(drop)
    } else {
        node.node_unstage_volume(unstage_req("vol", staging))
            .await
            .map(drop)
    }
}

/// The machine after a stage (`staged`) or an unstage succeeded: one rbd-fuse, one loop
/// device, one FUSE mount and the staging mount holding the marker, or nothing at all.
fn check(w: &World, staging: &Path, staged: bool, round: &str) {
    let want = if staged { (1, 1, 1) } else { (0, 0, 0) };
    assert_eq!(
        w.leftovers(0),
        want,
        "{round}: rbd-fuse, loop devices, FUSE mounts"
    );
    assert_eq!(
        mount_depth(staging),
        usize::from(staged),
        "{round}: staging mounts"
    );
    if staged {
        assert_eq!(
            std::fs::read(staging.join("marker")).expect("marker"),
            MARKER,
            "{round}: the data is intact"
        );
    }
}

#[test]
fn a_kill_at_any_step_of_a_map_stage_unstage_or_unmap_is_converged_by_the_retry() {
    let Some(ceph) = Ceph::from_env(
        "a_kill_at_any_step_of_a_map_stage_unstage_or_unmap_is_converged_by_the_retry",
    ) else {
        return;
    };
    let mut w = World::new("rbd-crash", ceph, 1);
    let image = w.image("crash", 128);
    let staging = w.staging(0, "pv");
    let rt = runtime();
    rt.block_on(async {
        // The first stage formats; the marker is written on the staged filesystem.
        let mut node = w.start(0, CRASH_NODE, &[]).await;
        call(&w, &mut node, true, &image, &staging)
            .await
            .expect("first stage");
        std::fs::write(staging.join("marker"), MARKER).expect("marker");
        rustix::fs::sync();
        call(&w, &mut node, false, &image, &staging)
            .await
            .expect("first unstage");
        check(&w, &staging, false, "first");

        // Every point of a map and an unmap, and the points of a stage and an unstage of an
        // image that is formatted already (stage.growing needs a grown image, and the
        // formatting points a blank one: below).
        let points = crash_points::MAP_POINTS.iter().chain(&[
            "stage.mounting",
            "stage.mounted",
            "stage.done",
            "unstage.unmounting",
            "unstage.unmounted",
            "unstage.done",
        ]);
        for point in points {
            let point = *point;
            let stage = point.starts_with("map.") || point.starts_with("stage.");
            if !stage {
                // An unmap follows a stage.
                let mut node = w.start(0, CRASH_NODE, &[]).await;
                call(&w, &mut node, true, &image, &staging)
                    .await
                    .unwrap_or_else(|e| panic!("{point}: stage: {e:?}"));
            }
            let mut node = w.start(0, CRASH_NODE, &[(crash_points::ENV, point)]).await;
            let first = call(&w, &mut node, stage, &image, &staging).await;
            assert!(
                first.is_err(),
                "{point}: the call should have been cut short"
            );
            let status = w.nodes[0]
                .daemon
                .as_mut()
                .map(|d| d.child.wait().expect("wait"));
            assert!(status.is_some_and(|s| !s.success()), "{point}: killed");
            // Restarted: the reconciliation at start undoes what the kill cut short (nothing
            // is staged: whatever is mapped goes, and the record with it); then kubelet's
            // retry.
            let undone = |w: &World| {
                w.log(0)
                    .matches("RBD image mapped with nothing staged on it; unmapped")
                    .count()
            };
            let before = undone(&w);
            let mut node = w.start(0, CRASH_NODE, &[]).await;
            // A kill in a map or an unmap leaves a mapping with nothing staged on it; one in
            // a stage or an unstage, a mount whose record says what to do with it.
            if point.starts_with("map.") || point.starts_with("unmap.") {
                assert_eq!(
                    undone(&w),
                    before + 1,
                    "{point}: reconciled at start\n{}",
                    w.log(0)
                );
            }
            call(&w, &mut node, stage, &image, &staging)
                .await
                .unwrap_or_else(|e| panic!("{point}: kubelet's retry: {e:?}\n{}", w.log(0)));
            check(&w, &staging, stage, point);
            if stage {
                call(&w, &mut node, false, &image, &staging)
                    .await
                    .unwrap_or_else(|e| panic!("{point}: unstage: {e:?}"));
                check(&w, &staging, false, point);
            }
        }

        // A first stage killed while it formats a blank image, or just after: the retry
        // finishes it (one mkfs: what is written after it survives the next stage).
        for (i, point) in ["stage.formatting", "stage.formatted"]
            .into_iter()
            .enumerate()
        {
            let blank = w.image(&format!("crash-fmt{i}"), 64);
            let mut node = w.start(0, CRASH_NODE, &[(crash_points::ENV, point)]).await;
            let first = call(&w, &mut node, true, &blank, &staging).await;
            assert!(
                first.is_err(),
                "{point}: the call should have been cut short"
            );
            let _ = w.nodes[0].daemon.as_mut().map(|d| d.child.wait());
            let mut node = w.start(0, CRASH_NODE, &[]).await;
            call(&w, &mut node, true, &blank, &staging)
                .await
                .unwrap_or_else(|e| panic!("{point}: kubelet's retry: {e:?}\n{}", w.log(0)));
            assert_eq!(w.leftovers(0), (1, 1, 1), "{point}");
            assert_eq!(mount_depth(&staging), 1, "{point}");
            std::fs::write(staging.join("marker"), MARKER).expect("marker");
            rustix::fs::sync();
            call(&w, &mut node, false, &blank, &staging)
                .await
                .unwrap_or_else(|e| panic!("{point}: unstage: {e:?}"));
            call(&w, &mut node, true, &blank, &staging)
                .await
                .unwrap_or_else(|e| panic!("{point}: stage again: {e:?}"));
            check(&w, &staging, true, point);
            call(&w, &mut node, false, &blank, &staging)
                .await
                .unwrap_or_else(|e| panic!("{point}: last unstage: {e:?}"));
            check(&w, &staging, false, point);
        }

        // Kills at random instants of a stage and of an unstage.
        let mut seed: u64 = 0x7262_646e;
        for round in 0..6 {
            let stage = round % 2 == 0;
            let mut node = w.start(0, CRASH_NODE, &[]).await;
            seed = seed
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            let delay = Duration::from_millis((seed >> 33) % 1500);
            let pid = w.nodes[0].daemon.as_ref().map(|d| d.child.id());
            let killer = std::thread::spawn(move || {
                std::thread::sleep(delay);
                if let Some(pid) = pid.and_then(|p| rustix::process::Pid::from_raw(p as i32)) {
                    let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
                }
            });
            let _ = call(&w, &mut node, stage, &image, &staging).await;
            killer.join().expect("killer");
            let _ = w.nodes[0].daemon.as_mut().map(|d| d.child.wait());
            let name = format!(
                "random #{round} ({}, kill after {delay:?})",
                if stage { "stage" } else { "unstage" }
            );
            let mut node = w.start(0, CRASH_NODE, &[]).await;
            call(&w, &mut node, stage, &image, &staging)
                .await
                .unwrap_or_else(|e| panic!("{name}: kubelet's retry: {e:?}\n{}", w.log(0)));
            check(&w, &staging, stage, &name);
        }
        let mut node = w.start(0, CRASH_NODE, &[]).await;
        call(&w, &mut node, false, &image, &staging)
            .await
            .expect("last unstage");
        check(&w, &staging, false, "last");
    });
}

#[test]
fn an_rbd_fuse_that_died_is_replaced_by_the_next_stage() {
    let Some(ceph) = Ceph::from_env("an_rbd_fuse_that_died_is_replaced_by_the_next_stage") else {
        return;
    };
    let mut w = World::new("rbd-died", ceph, 1);
    let image = w.image("died", 64);
    let staging = w.staging(0, "pv");
    let cap = || block(Mode::SingleNodeWriter);
    let rt = runtime();
    rt.block_on(async {
        let mut node = w.start(0, "moor-node", &[]).await;
        node.node_stage_volume(w.stage_req("vol", &image, &staging, cap()))
            .await
            .expect("stage");
        let (old, _) = loopdev::bound_under(&w.nodes[0].state.join("rbd"))
            .pop()
            .expect("loop");
        moor_privileged::write_at(&old.path, MIB, MARKER);
        // rbd-fuse dies: the loop device reads a dead FUSE file.
        let dir = w.nodes[0].state.join("rbd").display().to_string();
        for e in std::fs::read_dir("/proc").expect("/proc").flatten() {
            let cmd = std::fs::read(e.path().join("cmdline")).unwrap_or_default();
            if String::from_utf8_lossy(&cmd).starts_with("/usr/bin/rbd-fuse\0")
                && String::from_utf8_lossy(&cmd).contains(&dir)
                && let Some(pid) = e
                    .file_name()
                    .to_str()
                    .and_then(|p| p.parse().ok())
                    .and_then(rustix::process::Pid::from_raw)
            {
                rustix::process::kill_process(pid, rustix::process::Signal::KILL).expect("kill");
            }
        }
        let start = Instant::now();
        while w.leftovers(0).0 != 0 && start.elapsed() < DEADLINE {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(
            w.leftovers(0),
            (0, 1, 1),
            "a dead mapping: its loop and mount remain"
        );
        // A loop device over a dead FUSE file cannot be inspected (its status answers
        // ENOTCONN, or never, while the FUSE server hangs): the embedded backend looks only at
        // devices bound to files under its data dir, and serves beside it without opening it.
        let data = w.sb.data.join("embedded").display().to_string();
        let socket = w.sb.root.join("embedded.sock");
        let mut ctl = Daemon::start_program(
            "moor-controller",
            &socket,
            &["--node-id", "node-0", "--data-dir", data.as_str()],
        )
        .await;
        let mut client = ControllerClient::new(connect(&socket).await.expect("connect"));
        client
            .list_volumes(csi::ListVolumesRequest::default())
            .await
            .expect("the embedded backend serves beside a dead mapping");
        assert!(ctl.stop().await.success());
        // kubelet stages it again: what is left of the dead mapping goes, and the image is
        // mapped afresh, once, with its bytes.
        let t = Instant::now();
        node.node_stage_volume(w.stage_req("vol", &image, &staging, cap()))
            .await
            .unwrap_or_else(|e| panic!("stage again: {e:?}\n{}", w.log(0)));
        eprintln!(
            "stage after rbd-fuse died: {} (the new rbd-fuse waits for Ceph to break the dead one's lock)",
            ms(t.elapsed())
        );
        assert_eq!(w.leftovers(0), (1, 1, 1));
        let (new, _) = loopdev::bound_under(&w.nodes[0].state.join("rbd"))
            .pop()
            .expect("loop");
        assert_eq!(
            moor_privileged::read_at(&new.path, MIB, MARKER.len()),
            MARKER,
            "the bytes are intact"
        );
        node.node_unstage_volume(unstage_req("vol", &staging))
            .await
            .expect("unstage");
        assert_eq!(w.leftovers(0), (0, 0, 0));
    });
}

#[test]
fn a_key_the_cluster_refuses_is_never_shown_and_leaves_nothing() {
    let Some(ceph) = Ceph::from_env("a_key_the_cluster_refuses_is_never_shown_and_leaves_nothing")
    else {
        return;
    };
    let mut w = World::new("rbd-badkey", ceph, 1);
    let image = w.image("badkey", 64);
    let staging = w.staging(0, "pv");
    let rt = runtime();
    rt.block_on(async {
        let mut node = w.start(0, "moor-node", &[]).await;
        // base64 that is no cephx key (rbd-fuse quotes such a key in its error), and the
        // right user with another user's key.
        for bad in [
            "AQBbadbadbadbadbadbadbadbadbadbadbadbaw==",
            "AQCj2YpkAAAAABAAq3hU4qUwh+5EgPZ1vXuLkQ==",
        ] {
            let mut req = w.stage_req("vol", &image, &staging, ext4());
            req.secrets.insert(USER_KEY_KEY.into(), bad.into());
            let e = node.node_stage_volume(req).await.expect_err("refused");
            assert_eq!(e.code(), tonic::Code::Internal, "{e:?}");
            assert!(!e.message().contains(bad), "{}", e.message());
            assert_eq!(w.leftovers(0), (0, 0, 0), "{bad}");
            assert!(
                !w.nodes[0]
                    .state
                    .join("rbd")
                    .read_dir()
                    .is_ok_and(|mut d| d.next().is_some()),
                "no mount dir and no key file left"
            );
            assert_eq!(mount_depth(&staging), 0);
        }
        // The good key works, and appears nowhere in the log.
        node.node_stage_volume(w.stage_req("vol", &image, &staging, ext4()))
            .await
            .expect("stage");
        node.node_unstage_volume(unstage_req("vol", &staging))
            .await
            .expect("unstage");
        let log = w.log(0);
        assert!(!log.contains(&w.ceph.key), "{log}");
        assert!(!log.contains("AQBbad"), "{log}");
    });
}

/// The rbd-fuse processes serving node `i`'s images.
fn rbd_fuse_pids(w: &World, i: usize) -> Vec<rustix::process::Pid> {
    let dir = w.nodes[i].state.join("rbd").display().to_string();
    std::fs::read_dir("/proc")
        .expect("/proc")
        .flatten()
        .filter_map(|e| {
            let cmd = std::fs::read(e.path().join("cmdline")).ok()?;
            let text = String::from_utf8_lossy(&cmd);
            (text.contains("rbd-fuse\0") && text.contains(&dir))
                .then(|| e.file_name().to_str()?.parse().ok())
                .flatten()
                .and_then(rustix::process::Pid::from_raw)
        })
        .collect()
}

#[test]
fn an_rbd_fuse_that_hangs_is_killed_at_the_unmap_deadline() {
    let Some(ceph) = Ceph::from_env("an_rbd_fuse_that_hangs_is_killed_at_the_unmap_deadline")
    else {
        return;
    };
    let mut w = World::new("rbd-hang", ceph, 1);
    w.extra = vec!["--rbd-unmap-timeout".into(), "3".into()];
    let image = w.image("hang", 64);
    let staging = w.staging(0, "pv");
    let target = w.target(0, "pv");
    let rt = runtime();
    rt.block_on(async {
        let mut node = w.start(0, "moor-node", &[]).await;
        node.node_stage_volume(w.stage_req("vol", &image, &staging, ext4()))
            .await
            .expect("stage");
        node.node_publish_volume(publish("vol", &staging, &target, ext4()))
            .await
            .expect("publish");
        std::fs::write(target.join("marker"), MARKER).expect("write");
        rustix::fs::sync();
        node.node_unpublish_volume(unpublish_req("vol", &target))
            .await
            .expect("unpublish");
        // rbd-fuse stops answering (as on a node cut off from the cluster).
        let pids = rbd_fuse_pids(&w, 0);
        assert_eq!(pids.len(), 1);
        for p in &pids {
            rustix::process::kill_process(*p, rustix::process::Signal::STOP).expect("stop");
        }
        let t = Instant::now();
        // Bounded so that a broken moor-node fails the test instead of hanging it: the
        // stopped rbd-fuse is killed then, which lets the hung unmount end.
        let unstaged = tokio::time::timeout(
            Duration::from_secs(120),
            node.node_unstage_volume(unstage_req("vol", &staging)),
        )
        .await;
        let Ok(unstaged) = unstaged else {
            for p in rbd_fuse_pids(&w, 0) {
                let _ = rustix::process::kill_process(p, rustix::process::Signal::KILL);
            }
            panic!("the unstage hung on the stopped rbd-fuse\n{}", w.log(0));
        };
        unstaged.unwrap_or_else(|e| panic!("unstage: {e:?}\n{}", w.log(0)));
        eprintln!("unstage with a hung rbd-fuse: {}", ms(t.elapsed()));
        assert_eq!(w.leftovers(0), (0, 0, 0), "killed, unbound, unmounted");
        assert!(rbd_fuse_pids(&w, 0).is_empty());
        // The data was on the cluster before rbd-fuse hung: the next stage finds it.
        node.node_stage_volume(w.stage_req("vol", &image, &staging, ext4()))
            .await
            .expect("stage again");
        assert_eq!(
            std::fs::read(staging.join("marker")).expect("marker"),
            MARKER
        );
        node.node_unstage_volume(unstage_req("vol", &staging))
            .await
            .expect("unstage");
        assert_eq!(w.leftovers(0), (0, 0, 0));
    });
}

/// A process holding a node's volume in a mount namespace of its own (a container's copy
/// of the mount, which kubelet's unmount does not reach), appending a numbered line to
/// `held` and fsyncing it, again and again; exits 3 when a sync fails. Killed and waited for
/// when dropped; after [`Holder::stop_fuse`] the node's rbd-fuse is killed too, so that the
/// holder can die.
struct Holder<'a> {
    w: &'a World,
    child: std::process::Child,
    file: std::path::PathBuf,
    fuse_stopped: bool,
}

impl<'a> Holder<'a> {
    fn start(w: &'a World, staging: &Path) -> Self {
        let file = staging.join("held");
        let script = format!(
            "i=0; while :; do i=$((i + 1)); echo $i >> {f} || exit 2; sync {f} || exit 3; done",
            f = file.display()
        );
        let child = std::process::Command::new("unshare")
            .args(["--mount", "--propagation", "private", "sh", "-c", &script])
            .process_group(0)
            .spawn()
            .expect("unshare");
        let h = Self {
            w,
            child,
            file,
            fuse_stopped: false,
        };
        h.wait_lines(5, "the holder to write and sync 5 lines");
        h
    }

    /// Stops the node's rbd-fuse (SIGSTOP): it answers nothing, as on a node its cluster
    /// fenced.
    fn stop_fuse(&mut self) {
        self.fuse_stopped = true;
        let pids = rbd_fuse_pids(self.w, 0);
        assert_eq!(pids.len(), 1);
        for p in &pids {
            rustix::process::kill_process(*p, rustix::process::Signal::STOP).expect("stop");
        }
    }

    /// The lines the holder has written, as this mount namespace reads them.
    fn lines(&self) -> usize {
        std::fs::read_to_string(&self.file)
            .map(|t| t.lines().count())
            .unwrap_or(0)
    }

    fn wait_lines(&self, n: usize, what: &str) {
        let start = Instant::now();
        while self.lines() < n {
            assert!(start.elapsed() < DEADLINE, "waited {DEADLINE:?} for {what}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Its exit status, once it has exited by itself (within the deadline).
    fn exited(&mut self) -> std::process::ExitStatus {
        let start = Instant::now();
        loop {
            if let Some(s) = self.child.try_wait().expect("wait") {
                return s;
            }
            assert!(
                start.elapsed() < DEADLINE,
                "waited {DEADLINE:?} for the holder to exit"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Holder<'_> {
    /// Kills the holder's every process (its `sync` too) and waits until they are all gone,
    /// which ends its mount namespace.
    fn drop(&mut self) {
        let group = rustix::process::Pid::from_raw(self.child.id() as i32).expect("pid");
        let _ = rustix::process::kill_process_group(group, rustix::process::Signal::KILL);
        if self.fuse_stopped {
            for p in rbd_fuse_pids(self.w, 0) {
                let _ = rustix::process::kill_process(p, rustix::process::Signal::KILL);
            }
        }
        let _ = self.child.wait();
        let start = Instant::now();
        while rustix::process::test_kill_process_group(group).is_ok() && start.elapsed() < DEADLINE
        {
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

/// The world of a holder test: one node, unmaps with a 20 s deadline, an image of 64 MiB and
/// its staging path.
fn holder_world(test: &str, name: &str) -> Option<(World, String, std::path::PathBuf)> {
    let ceph = Ceph::from_env(test)?;
    let mut w = World::new(name, ceph, 1);
    w.extra = vec!["--rbd-unmap-timeout".into(), "20".into()];
    let image = w.image(name, 64);
    let staging = w.staging(0, "pv");
    Some((w, image, staging))
}

/// The requests in flight on the node's loop device (which rbd-fuse serves).
fn in_flight(w: &World) -> u64 {
    let (l, _) = loopdev::bound_under(&w.nodes[0].state.join("rbd"))
        .pop()
        .expect("the loop device");
    loopdev::io_progress(l.rdev)
        .expect("the loop device's stat")
        .in_flight
}

/// A node fenced by its cluster, or cut off from it, comes back: kubelet unstages a volume
/// whose filesystem a container still holds in a mount namespace of its own, its process
/// stuck in an fsync that rbd-fuse never answers (librbd of a blocklisted client keeps its
/// writes). Waiting would hold the volume forever (a VolumeAttachment never released, the
/// CI's dead-node failure): moor sees rbd-fuse answer nothing while requests wait, kills it,
/// the holder's sync fails and it lets go, and the unstage ends with nothing left. What was
/// synced before rbd-fuse stopped is on the image.
#[test]
fn a_holder_stuck_on_an_rbd_fuse_that_answers_nothing_is_let_go_at_unstage() {
    let Some((mut w, image, staging)) = holder_world(
        "a_holder_stuck_on_an_rbd_fuse_that_answers_nothing_is_let_go_at_unstage",
        "rbd-stuck",
    ) else {
        return;
    };
    let rt = runtime();
    rt.block_on(async {
        let mut node = w.start(0, "moor-node", &[]).await;
        node.node_stage_volume(w.stage_req("vol", &image, &staging, ext4()))
            .await
            .expect("stage");
        std::fs::write(staging.join("marker"), MARKER).expect("write");
        rustix::fs::sync();
        let mut holder = Holder::start(&w, &staging);
        holder.stop_fuse();
        let start = Instant::now();
        while in_flight(&w) == 0 {
            assert!(
                start.elapsed() < DEADLINE,
                "waited {DEADLINE:?} for the holder to wait on the stopped rbd-fuse"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        let t = Instant::now();
        let unstaged = tokio::time::timeout(
            Duration::from_secs(120),
            node.node_unstage_volume(unstage_req("vol", &staging)),
        )
        .await
        .unwrap_or_else(|_| panic!("the unstage hung\n{}", w.log(0)));
        unstaged.unwrap_or_else(|e| panic!("unstage: {e:?}\n{}", w.log(0)));
        eprintln!(
            "unstage with a holder stuck on a stopped rbd-fuse: {}",
            ms(t.elapsed())
        );
        assert!(
            w.log(0)
                .contains("killing rbd-fuse so that its requests fail"),
            "{}",
            w.log(0)
        );
        assert_eq!(holder.exited().code(), Some(3), "the holder's sync failed");
        assert_eq!(w.leftovers(0), (0, 0, 0), "killed, unbound, unmounted");
        drop(holder);
        // What was synced before rbd-fuse stopped: the next stage finds it.
        node.node_stage_volume(w.stage_req("vol", &image, &staging, ext4()))
            .await
            .unwrap_or_else(|e| panic!("stage again: {e:?}\n{}", w.log(0)));
        assert_eq!(
            std::fs::read(staging.join("marker")).expect("marker"),
            MARKER
        );
        node.node_unstage_volume(unstage_req("vol", &staging))
            .await
            .expect("unstage");
        assert_eq!(w.leftovers(0), (0, 0, 0));
    });
}

/// The same holder with rbd-fuse answering: a mapping that works is never killed under its
/// user. The unstage is refused (FAILED_PRECONDITION: the device is in use), the holder goes
/// on writing, rbd-fuse lives; once the holder is gone the next unstage ends it all.
#[test]
fn a_holder_of_an_rbd_fuse_that_answers_keeps_it_and_the_unstage_waits() {
    let Some((mut w, image, staging)) = holder_world(
        "a_holder_of_an_rbd_fuse_that_answers_keeps_it_and_the_unstage_waits",
        "rbd-held",
    ) else {
        return;
    };
    let rt = runtime();
    rt.block_on(async {
        let mut node = w.start(0, "moor-node", &[]).await;
        node.node_stage_volume(w.stage_req("vol", &image, &staging, ext4()))
            .await
            .expect("stage");
        let mut holder = Holder::start(&w, &staging);
        let e = node
            .node_unstage_volume(unstage_req("vol", &staging))
            .await
            .expect_err("a device in use is not unmapped");
        assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e:?}");
        assert_eq!(rbd_fuse_pids(&w, 0).len(), 1, "rbd-fuse lives");
        assert!(!w.log(0).contains("killing rbd-fuse"), "{}", w.log(0));
        // The holder's namespace still has the filesystem: it goes on writing and syncing.
        let root = format!("/proc/{}/root", holder.child.id());
        let held = Path::new(&root).join(holder.file.strip_prefix("/").expect("absolute"));
        let count = || {
            std::fs::read_to_string(&held)
                .map(|t| t.lines().count())
                .unwrap_or(0)
        };
        let before = count();
        let start = Instant::now();
        while count() < before + 5 {
            assert!(
                holder.child.try_wait().expect("wait").is_none(),
                "the holder died"
            );
            assert!(
                start.elapsed() < DEADLINE,
                "waited {DEADLINE:?} for the holder to go on writing"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        drop(holder);
        node.node_unstage_volume(unstage_req("vol", &staging))
            .await
            .unwrap_or_else(|e| panic!("unstage once the holder is gone: {e:?}\n{}", w.log(0)));
        assert_eq!(w.leftovers(0), (0, 0, 0));
    });
}

/// moor-ublk serves an image with librbd's cache off (a recoverable server must not hold
/// acknowledged writes in memory): an image whose own configuration turns the cache on, which
/// librbd would set over the server's, is refused before any device is made; the same image
/// with the override saying off goes on to the device (here one that does not exist).
#[test]
fn moor_ublk_refuses_an_image_whose_configuration_turns_the_cache_on() {
    let test = "moor_ublk_refuses_an_image_whose_configuration_turns_the_cache_on";
    let Some(ceph) = Ceph::from_env(test) else {
        return;
    };
    let ublk = moor_privileged::client::binary("moor-ublk");
    assert!(
        ublk.exists(),
        "{} is not built (cargo build -p moor-ublk)",
        ublk.display()
    );
    let mut w = World::new("rbd-ublk-cache", ceph, 1);
    let image = w.image("cache", 64);
    let start_with_override = |value: &str| {
        w.ceph
            .rbd(&["image-meta", "set", &image, "conf_rbd_cache", value])
            .expect("rbd image-meta set");
        // A recovery of a device no driver has (it never serves): the image is opened and
        // checked first.
        let out = std::process::Command::new(&ublk)
            .args(["recover", "--dev", "1048575", "--deadline", "1"])
            .args(["--mon-host", &w.ceph.mons, "--user", &w.ceph.user])
            .args(["--keyring", &w.ceph.keyring, "--pool", &w.ceph.pool])
            .args(["--image", &image])
            .output()
            .expect("run moor-ublk");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (ok, err) = start_with_override("true");
    assert!(!ok, "served with the cache on: {err}");
    assert!(
        err.contains("rbd_cache=\"true\"") && err.contains("the image's configuration"),
        "{err}"
    );
    let (ok, err) = start_with_override("false");
    assert!(
        !ok && err.contains("recover") && !err.contains("rbd_cache="),
        "with the override saying off, only the device was missing: {err}"
    );
}
