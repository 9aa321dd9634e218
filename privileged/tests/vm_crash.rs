//! Block-level crash consistency on a real kernel: in a guest of the VM lab, moor-node's state
//! dir is an ext4 filesystem and a volume's device is a second region of one device-mapper
//! `log-writes` device, which records every write both take, in the order they completed, with
//! their flushes. After one volume life (first stage with mkfs, publish, a pod's write +
//! fsync, unpublish, unstage, stage again), the log is replayed on the host
//! (`moor_privileged::logwrites`) to rebuild the device as a power cut could have left it: at
//! every flush and FUA write, and at a sample of points between them with some of the writes
//! since the last flush dropped. Each state is booted as a node after a power cut: ext4
//! recovers the state dir, moor-node starts (reconciliation runs), and kubelet's retries stage
//! and publish the volume again. Every state must keep what the pod synced, never format a
//! device that held the volume's filesystem, and leave a journal moor-node reads.
//!
//! Runs beside the Ceph test cluster (the guest's agent reaches the host over its bridge);
//! skipped, with the reason, without it or without the lab. `MOOR_VM_CRASH_SAMPLES` sets how
//! many points between flushes are sampled (default 12; a soak run takes more).

use std::collections::HashMap;
use std::path::Path;
use std::time::Instant;

use moor_privileged::ceph::publish;
use moor_privileged::krbd_lab::Lab;
use moor_privileged::logwrites::Log;
use moor_privileged::requests::{cap, unpublish_req, unstage_req};
use moor_privileged::runtime;
use moor_proto::csi::v1 as csi;
use moor_runtime::contract::DEVICE_PATH_KEY;

const MIB: u64 = 1 << 20;
/// The state dir's filesystem: the first 32 MiB of the logged device.
const STATE_MIB: u64 = 32;
/// The volume: the next 128 MiB.
const VOLUME_MIB: u64 = 128;
const VOL: &str = "vol-crash";
const SYNCED: &str = "synced by the pod";

/// Makes the two regions of `image` (a guest path of the shared dir) the devices
/// `/dev/mapper/lwstate` and `lwvol`, over a `log-writes` device logging to `log` when given.
fn devices(lab: &Lab, image: &Path, log: Option<&Path>) {
    let mut script = format!(
        "set -e; modprobe loop; modprobe dm-log-writes; B=$(losetup -f --show {})\n",
        image.display()
    );
    let under = match log {
        Some(log) => {
            script += &format!(
                "L=$(losetup -f --show {}); dmsetup create lw --table \"0 {} log-writes $B $L\"\n",
                log.display(),
                (STATE_MIB + VOLUME_MIB) * 2048
            );
            "/dev/mapper/lw".to_string()
        }
        None => "$B".to_string(),
    };
    script += &format!(
        "dmsetup create lwstate --table \"0 {} linear {under} 0\"\n\
         dmsetup create lwvol --table \"0 {} linear {under} {}\"\n",
        STATE_MIB * 2048,
        VOLUME_MIB * 2048,
        STATE_MIB * 2048
    );
    lab.vms[0].sh(&script);
}

/// Removes what [`devices`] made, after unmounting whatever is on them (the state dir, the
/// volume's mounts under the kubelet dir).
fn teardown(lab: &Lab) {
    let kubelet = lab.world.nodes[0].kubelet.display().to_string();
    let out = lab.vms[0].exec(&[
        "sh",
        "-c",
        &format!(
            "pkill -KILL -x moor-node; while pgrep -x moor-node >/dev/null; do sleep 0.1; done; \
             for m in $(findmnt -rn -o TARGET | grep -E '^({kubelet}|/run/state)(/|$)' | sort -r); \
             do umount \"$m\"; done; \
             for d in lwvol lwstate lw; do \
             if dmsetup info $d >/dev/null 2>&1; then dmsetup remove --retry $d || exit 1; fi; \
             done; losetup -D"
        ),
    ]);
    assert!(
        out.ok(),
        "teardown in the guest: {}{}",
        out.stdout,
        out.stderr
    );
}

fn mark(lab: &Lab, name: &str) {
    lab.vms[0].sh(&format!("sync; dmsetup message lw 0 mark {name}"));
}

fn stage_req(lab: &Lab) -> csi::NodeStageVolumeRequest {
    csi::NodeStageVolumeRequest {
        volume_id: VOL.into(),
        publish_context: HashMap::from([(DEVICE_PATH_KEY.into(), "/dev/mapper/lwvol".into())]),
        staging_target_path: lab.world.staging(0, VOL).display().to_string(),
        volume_capability: Some(cap("ext4")),
        ..Default::default()
    }
}

fn publish_req(lab: &Lab) -> csi::NodePublishVolumeRequest {
    publish(
        VOL,
        &lab.world.staging(0, VOL),
        &lab.world.target(0, VOL),
        cap("ext4"),
    )
}

/// A small deterministic generator (the sample points and what is dropped at each).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

#[test]
fn every_state_a_power_cut_can_leave_keeps_what_the_pod_synced() {
    let test = "vm-crash";
    let Some(lab) = Lab::new(test, 1, 110) else {
        return;
    };
    let dir = lab.world.nodes[0].state.clone();
    let base = dir.join("base.img");
    let log = dir.join("log.img");
    std::fs::File::create(&base)
        .and_then(|f| f.set_len((STATE_MIB + VOLUME_MIB) * MIB))
        .expect("base image");
    std::fs::File::create(&log)
        .and_then(|f| f.set_len(1024 * MIB))
        .expect("log");
    let node_log = dir.join("life.log");
    runtime().block_on(async {
        // The life, recorded.
        devices(&lab, &base, Some(&log));
        lab.vms[0].sh(
            "mkfs.ext4 -q /dev/mapper/lwstate && mkdir -p /run/state && \
             mount /dev/mapper/lwstate /run/state && mkdir /run/state/moor",
        );
        mark(&lab, "base");
        let state = Path::new("/run/state/moor");
        let mut node = lab
            .start_node_at(0, "moor-node", &[], state, &node_log)
            .await;
        node.node_stage_volume(stage_req(&lab))
            .await
            .expect("first stage");
        mark(&lab, "formatted");
        node.node_publish_volume(publish_req(&lab))
            .await
            .expect("publish");
        let file = lab.world.target(0, VOL).join("data").display().to_string();
        lab.vms[0].sh(&format!(
            "printf '{SYNCED}' | dd of={file} conv=fsync status=none"
        ));
        mark(&lab, "pod-synced");
        let target = lab.world.target(0, VOL);
        let staging = lab.world.staging(0, VOL);
        node.node_unpublish_volume(unpublish_req(VOL, &target))
            .await
            .expect("unpublish");
        node.node_unstage_volume(unstage_req(VOL, &staging))
            .await
            .expect("unstage");
        node.node_stage_volume(stage_req(&lab))
            .await
            .expect("stage again");
        node.node_publish_volume(publish_req(&lab))
            .await
            .expect("publish again");
        assert_eq!(lab.vms[0].read(&file), SYNCED);
        node.node_unpublish_volume(unpublish_req(VOL, &target))
            .await
            .expect("unpublish");
        node.node_unstage_volume(unstage_req(VOL, &staging))
            .await
            .expect("unstage");
        mark(&lab, "end");
        drop(node);
        teardown(&lab);

        // The states.
        let log = Log::open(&log).expect("the log");
        let at = |name: &str| log.mark(name).unwrap_or_else(|| panic!("no mark {name}"));
        let (formatted, synced) = (at("formatted"), at("pod-synced"));
        let end = at("end");
        let mut points: Vec<(usize, u64)> = log
            .entries
            .iter()
            .filter(|e| e.index <= end && e.is_durable_point())
            .map(|e| (e.index, 0))
            .collect();
        let flushes = points.len();
        let samples: usize = std::env::var("MOOR_VM_CRASH_SAMPLES")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(12);
        let seed: u64 = std::env::var("MOOR_VM_CRASH_SEED")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0x6d6f_6f72);
        eprintln!(
            "{test}: {} log entries, {flushes} flush/FUA points; {samples} samples between \
             them (seed {seed}; MOOR_VM_CRASH_SEED replays it)",
            log.entries.len()
        );
        let mut rng = Rng(seed | 1);
        for _ in 0..samples {
            let i = (rng.next() % end as u64) as usize;
            points.push((i, rng.next() | 1));
        }
        points.sort();
        let cursor = dir.join("cursor.img");
        let cursor_file = std::fs::File::create(&cursor).expect("cursor");
        cursor_file
            .set_len((STATE_MIB + VOLUME_MIB) * MIB)
            .expect("cursor size");
        let mut applied = 0usize; // entries [0, applied) are on the cursor
        let started = Instant::now();
        for (n, (point, drop_seed)) in points.iter().copied().enumerate() {
            // The cursor: everything up to the last durable point at or before `point`.
            let durable = log.entries[..=point]
                .iter()
                .rev()
                .find(|e| e.is_durable_point())
                .map_or(0, |e| e.index + 1);
            while applied < durable {
                log.apply(&log.entries[applied], &cursor_file)
                    .expect("replay");
                applied += 1;
            }
            let work = dir.join(format!("state-{n}.img"));
            std::fs::copy(&cursor, &work).expect("copy of the cursor");
            // Between flushes: the writes since the last one, some of them lost.
            let mut dropped = 0;
            if drop_seed != 0 {
                let w = std::fs::OpenOptions::new()
                    .write(true)
                    .open(&work)
                    .expect("work");
                let mut r = Rng(drop_seed);
                for e in &log.entries[durable..=point] {
                    if r.next().is_multiple_of(3) {
                        dropped += 1;
                    } else {
                        log.apply(e, &w).expect("replay");
                    }
                }
            }
            check_state(&lab, &work, point, formatted, synced, n, dropped).await;
            let _ = std::fs::remove_file(&work);
        }
        eprintln!(
            "{test}: {} states checked ({flushes} at flushes, {samples} between), in {:.0} s",
            points.len(),
            started.elapsed().as_secs_f64()
        );
    });
}

/// Boots the state in `image` (the log replayed to entry `point`) as a node after a power cut.
async fn check_state(
    lab: &Lab,
    image: &Path,
    point: usize,
    formatted: usize,
    synced: usize,
    n: usize,
    dropped: usize,
) {
    let what = format!("state {n} (log entry {point}, {dropped} unflushed writes dropped)");
    devices(lab, image, None);
    // ext4's own recovery; a state dir made before the cut may not exist yet.
    lab.vms[0].sh(
        "mkdir -p /run/state && { mount /dev/mapper/lwstate /run/state || \
         { mkfs.ext4 -q /dev/mapper/lwstate && mount /dev/mapper/lwstate /run/state; }; } && \
         mkdir -p /run/state/moor",
    );
    let node_log = lab.world.nodes[0].state.join(format!("state-{n}.log"));
    let mut node = lab
        .start_node_at(0, "moor-node", &[], Path::new("/run/state/moor"), &node_log)
        .await;
    let text = || std::fs::read_to_string(&node_log).unwrap_or_default();
    let stage = node.node_stage_volume(stage_req(lab)).await;
    let publish = match &stage {
        Ok(_) => node.node_publish_volume(publish_req(lab)).await.map(drop),
        Err(e) => Err(e.clone()),
    };
    let formats = text().matches("formatted blank device").count();
    let file = lab.world.target(0, VOL).join("data").display().to_string();
    let data = lab.vms[0].read(&file);
    drop(node);
    teardown(lab);
    let log = text();
    assert!(
        !log.contains("\"level\":\"ERROR\"") && !log.contains("corrupt"),
        "{what}: moor-node could not read its journal: {log}"
    );
    if point > formatted {
        stage.unwrap_or_else(|e| panic!("{what}: kubelet's stage: {e:?}\n{log}"));
        publish.unwrap_or_else(|e| panic!("{what}: kubelet's publish: {e:?}\n{log}"));
        assert_eq!(formats, 0, "{what}: formatted the volume again\n{log}");
    }
    if point > synced {
        assert_eq!(data, SYNCED, "{what}: what the pod synced is gone\n{log}");
    }
}
