//! Block-level crash consistency on a real kernel: in a guest of the VM lab, moor-node's state
//! dir is an ext4 filesystem and a volume's device is a second region of one device-mapper
//! `log-writes` device, which records every write both take, in the order they completed, with
//! their flushes. The recorded life: first stage with mkfs, publish, a pod's write + fsync,
//! the device grown and NodeExpandVolume, calls on other volumes until moor-node compacts its
//! journal, unpublish, unstage, stage again. The log is then replayed on the host
//! (`moor_lab::logwrites`) to rebuild the device as a power cut could have left it: at
//! every flush and FUA write, and at a sample of points between them with some of the writes
//! since the last flush dropped. Each state is booted as a node after a power cut: ext4
//! recovers the state dir, moor-node starts (reconciliation runs), and kubelet's retries
//! stage, publish and expand the volume again. Every state must keep what the pod synced,
//! never format a device that held the volume's filesystem, and leave a journal moor-node
//! reads. The states are checked in two guests at once; a state whose device is the same as
//! the one before it (no write since) is counted once.
//!
//! Runs beside the Ceph test cluster (the guests' agents reach the host over its bridge);
//! skipped, with the reason, without it or without the lab. `MOOR_VM_CRASH_SAMPLES` sets how
//! many points between flushes are sampled (default 12; a soak run takes more);
//! `MOOR_VM_CRASH_FLUSHES=N` checks N of the flush/FUA points instead of every one (unset or
//! `all`: every one; the test command's quick mode takes 24): the first at or after each step
//! of the life (formatted, synced, expanded, compacted, ended) and the rest drawn;
//! `MOOR_VM_CRASH_SEED` replays a run's draws (by default a new seed each run, printed).

use std::collections::HashMap;
use std::path::Path;
use std::time::{Duration, Instant};

use moor_lab::ceph::{block, publish};
use moor_lab::krbd_lab::{Lab, start_node_in};
use moor_lab::logwrites::Log;
use moor_lab::vm::Rng;
use moor_privileged::requests::{cap, unpublish_req, unstage_req};
use moor_privileged::runtime;
use moor_proto::csi::v1 as csi;
use moor_runtime::contract::DEVICE_PATH_KEY;

const MIB: u64 = 1 << 20;
/// The state dir's filesystem: the first 32 MiB of the logged device.
const STATE_MIB: u64 = 32;
/// The volume's region: the next 128 MiB, of which its device first has 96 MiB.
const VOLUME_MIB: u64 = 128;
const FIRST_MIB: u64 = 96;
const VOL: &str = "vol-crash";
const SYNCED: &str = "synced by the pod";
/// The other volumes, block volumes on loop devices of the guest's memory.
const OTHERS: usize = 3;
/// Guests checking states at once.
const CHECKERS: usize = 2;
/// The journal in the guest.
const JOURNAL: &str = "/run/state/moor/journal.log";
/// moor-node, copied into each checking guest's memory.
const NODE: &str = "/run/bin/moor-node";

/// Makes the two regions of `image` (a guest path of the shared dir) the devices
/// `/dev/mapper/lwstate` and `lwvol` (`vol_mib` of its region) in guest `g`, over a
/// `log-writes` device logging to `log` when given.
fn devices(lab: &Lab, g: usize, image: &Path, log: Option<&Path>, vol_mib: u64) {
    let mut script = format!(
        "set -e; export DM_DISABLE_UDEV=1; modprobe loop; modprobe dm-log-writes; \
         B=$(losetup -f --show {})\n",
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
        vol_mib * 2048,
        STATE_MIB * 2048
    );
    lab.vms[g].sh(&script);
}

/// Removes what [`devices`] made in guest `g`, after unmounting whatever is on them (the
/// state dir, the volumes' mounts under the kubelet dir).
fn teardown(lab: &Lab, g: usize) {
    let kubelet = lab.world.nodes[0].kubelet.display().to_string();
    let out = lab.vms[g].exec(&[
        "sh",
        "-c",
        &format!(
            "export DM_DISABLE_UDEV=1; pkill -KILL -x moor-node; while pgrep -x moor-node >/dev/null; do sleep 0.1; done; \
             for m in $(findmnt -rn -o TARGET | grep -E '^({kubelet}|/run/state)(/|$)' | sort -r); \
             do umount \"$m\"; done; \
             for d in lwvol lwstate lw; do \
             if dmsetup info $d >/dev/null 2>&1; then dmsetup remove --retry $d || exit 1; fi; \
             done; losetup -D"
        ),
    ]);
    assert!(
        out.ok(),
        "teardown in guest {g}: {}{}",
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

/// kubelet's NodeExpandVolume of the published volume, to its device's size.
fn expand_req(lab: &Lab) -> csi::NodeExpandVolumeRequest {
    csi::NodeExpandVolumeRequest {
        volume_id: VOL.into(),
        volume_path: lab.world.target(0, VOL).display().to_string(),
        staging_target_path: lab.world.staging(0, VOL).display().to_string(),
        capacity_range: Some(csi::CapacityRange {
            required_bytes: (VOLUME_MIB * MIB) as i64,
            limit_bytes: 0,
        }),
        volume_capability: Some(cap("ext4")),
        secrets: HashMap::new(),
    }
}

/// The size of the filesystem published in guest `g`, in MiB.
fn fs_mib(lab: &Lab, g: usize) -> u64 {
    let target = lab.world.target(0, VOL).display().to_string();
    let out = lab.vms[g].sh(&format!("stat -f -c '%b %S' {target}"));
    let mut it = out
        .split_whitespace()
        .map(|v| v.parse::<u64>().expect("stat -f"));
    let (blocks, size) = (it.next().expect("blocks"), it.next().expect("size"));
    blocks * size / MIB
}

/// Where the life stood, by the log's marks.
#[derive(Clone, Copy)]
struct Marks {
    formatted: usize,
    synced: usize,
}

/// A state to check: the log replayed to entry `point`, with the writes after the last
/// durable point dropped by `drop_seed` (0: a durable point, nothing after it).
#[derive(Clone, Copy)]
struct Point {
    n: usize,
    point: usize,
    drop_seed: u64,
}

#[test]
fn every_state_a_power_cut_can_leave_keeps_what_the_pod_synced() {
    let test = "vm-crash";
    let Some(lab) = Lab::new(test, CHECKERS, 110) else {
        return;
    };
    let dir = lab.world.nodes[0].state.clone();
    let base = dir.join("base.img");
    let log = dir.join("log.img");
    std::fs::File::create(&base)
        .and_then(|f| f.set_len((STATE_MIB + VOLUME_MIB) * MIB))
        .expect("base image");
    std::fs::File::create(&log)
        .and_then(|f| f.set_len(2048 * MIB))
        .expect("log");
    let recorded = Instant::now();
    runtime().block_on(record(&lab, test, &base, &log));
    eprintln!(
        "{test}: the life recorded in {:.0} s",
        recorded.elapsed().as_secs_f64()
    );

    // The states.
    let log = Log::open(&log).expect("the log");
    let at = |name: &str| log.mark(name).unwrap_or_else(|| panic!("no mark {name}"));
    let marks = Marks {
        formatted: at("formatted"),
        synced: at("pod-synced"),
    };
    let end = at("end");
    let mut points: Vec<(usize, u64)> = log
        .entries
        .iter()
        .filter(|e| e.index <= end && e.is_durable_point())
        .map(|e| (e.index, 0))
        .collect();
    let samples: usize = std::env::var("MOOR_VM_CRASH_SAMPLES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(12);
    let seed: u64 = std::env::var("MOOR_VM_CRASH_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64)
        });
    let mut rng = Rng::new(seed);
    let all_flushes = points.len();
    if let Some(n) = std::env::var("MOOR_VM_CRASH_FLUSHES")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
    {
        let steps = ["formatted", "pod-synced", "expanded", "compacted", "end"];
        points = flush_sample(&points, steps.map(at), n, &mut rng);
    }
    let flushes = points.len();
    eprintln!(
        "{test}: {} log entries, {flushes} of its {all_flushes} flush/FUA points; {samples} \
         samples between them (seed {seed}; MOOR_VM_CRASH_SEED={seed} replays it)",
        log.entries.len()
    );
    for _ in 0..samples {
        let i = (rng.next_u64() % end as u64) as usize;
        points.push((i, rng.next_u64() | 1));
    }
    points.sort();
    // A durable point with no write since the one before leaves the same device: counted
    // once.
    let mut last_durable: Option<usize> = None;
    let mut same = 0;
    let mut states = Vec::new();
    for (n, (point, drop_seed)) in points.iter().copied().enumerate() {
        if drop_seed == 0 {
            if let Some(prev) = last_durable
                && log.entries[prev + 1..=point]
                    .iter()
                    .all(|e| e.nr_sectors == 0)
            {
                same += 1;
                continue;
            }
            last_durable = Some(point);
        }
        states.push(Point {
            n,
            point,
            drop_seed,
        });
    }
    eprintln!(
        "{test}: {} states to boot ({same} durable points leave the device of the one before)",
        states.len()
    );
    let started = Instant::now();
    std::thread::scope(|s| {
        for g in 0..CHECKERS {
            let (lab, log, states) = (&lab, &log, &states);
            s.spawn(move || {
                let mine: Vec<Point> = states.iter().copied().skip(g).step_by(CHECKERS).collect();
                check_states(lab, g, log, &mine, marks);
            });
        }
    });
    eprintln!(
        "{test}: {} states checked ({flushes} flush/FUA points, {same} of them the same device \
         as the one before; {samples} between), in {:.0} s on {CHECKERS} guests",
        states.len(),
        started.elapsed().as_secs_f64()
    );
}

/// `n` of the durable `points` (log index, 0), in log order: for each of `steps` (log
/// indexes), the first point at or after it, then points drawn by `rng` until there are `n`.
fn flush_sample(
    points: &[(usize, u64)],
    steps: [usize; 5],
    n: usize,
    rng: &mut Rng,
) -> Vec<(usize, u64)> {
    let mut keep = std::collections::BTreeSet::new();
    for step in steps {
        if let Some(k) = points.iter().position(|&(i, _)| i >= step) {
            keep.insert(k);
        }
    }
    while keep.len() < n.min(points.len()) {
        keep.insert(rng.below(points.len() as u64) as usize);
    }
    keep.into_iter().map(|k| points[k]).collect()
}

/// The life, recorded in guest 0 on the log-writes device over `base`, logging to `log`.
async fn record(lab: &Lab, test: &str, base: &Path, log: &Path) {
    devices(lab, 0, base, Some(log), FIRST_MIB);
    lab.vms[0].sh(
        "mkfs.ext4 -q /dev/mapper/lwstate && mkdir -p /run/state && \
         mount /dev/mapper/lwstate /run/state && mkdir /run/state/moor",
    );
    mark(lab, "base");
    let state = Path::new("/run/state/moor");
    let node_log = lab.world.nodes[0].state.join("life.log");
    let mut node = lab
        .start_node_at(0, "moor-node", &[], state, &node_log)
        .await;
    node.node_stage_volume(stage_req(lab))
        .await
        .expect("first stage");
    mark(lab, "formatted");
    node.node_publish_volume(publish_req(lab))
        .await
        .expect("publish");
    let file = lab.world.target(0, VOL).join("data").display().to_string();
    lab.vms[0].sh(&format!(
        "printf '{SYNCED}' | dd of={file} conv=fsync status=none"
    ));
    mark(lab, "pod-synced");

    // The device grows (as a controller's expansion grows a cloud disk) and kubelet asks
    // the node to grow the filesystem, online.
    lab.vms[0].sh(&format!(
        "dmsetup suspend lwvol && dmsetup reload lwvol --table \"0 {} linear /dev/mapper/lw {}\" \
         && dmsetup resume lwvol",
        VOLUME_MIB * 2048,
        STATE_MIB * 2048
    ));
    node.node_expand_volume(expand_req(lab))
        .await
        .expect("NodeExpandVolume");
    let grown = fs_mib(lab, 0);
    assert!(
        grown > FIRST_MIB,
        "the filesystem has {grown} MiB after NodeExpandVolume to {VOLUME_MIB} MiB"
    );
    mark(lab, "expanded");

    // Other volumes come and go until moor-node rewrites its journal (a compaction: a new
    // file renamed over the log).
    let calls = others_until_compaction(lab, &mut node).await;
    eprintln!("{test}: the journal was compacted after {calls} calls on other volumes");
    mark(lab, "compacted");

    let target = lab.world.target(0, VOL);
    let staging = lab.world.staging(0, VOL);
    unmount(&mut node, &target, &staging).await;
    node.node_stage_volume(stage_req(lab))
        .await
        .expect("stage again");
    node.node_publish_volume(publish_req(lab))
        .await
        .expect("publish again");
    assert_eq!(lab.vms[0].read(&file), SYNCED);
    unmount(&mut node, &target, &staging).await;
    mark(lab, "end");
    drop(node);
    let text = std::fs::read_to_string(&node_log).unwrap_or_default();
    assert_eq!(
        text.matches("formatted blank device").count(),
        1,
        "the life formats the volume once: {text}"
    );
    teardown(lab, 0);
    lab.vms[0].sh("losetup -D; rm -f /run/others-*.img");
}

/// kubelet's unpublish and unstage of the volume.
async fn unmount(
    node: &mut csi::node_client::NodeClient<tonic::transport::Channel>,
    target: &Path,
    staging: &Path,
) {
    node.node_unpublish_volume(unpublish_req(VOL, target))
        .await
        .expect("unpublish");
    node.node_unstage_volume(unstage_req(VOL, staging))
        .await
        .expect("unstage");
}

/// Stages, publishes, unpublishes and unstages block volumes on loop devices in guest 0
/// (files in its memory, off the logged device) until the journal file is replaced;
/// returns how many calls that took.
async fn others_until_compaction(
    lab: &Lab,
    node: &mut csi::node_client::NodeClient<tonic::transport::Channel>,
) -> usize {
    let w = &lab.world;
    let devs: Vec<String> = (0..OTHERS)
        .map(|k| {
            lab.vms[0]
                .sh(&format!(
                    "truncate -s 4M /run/others-{k}.img && losetup -f --show /run/others-{k}.img"
                ))
                .trim()
                .to_string()
        })
        .collect();
    let inode = || lab.vms[0].sh(&format!("stat -c %i {JOURNAL}"));
    let first = inode();
    let mut calls = 0;
    let start = Instant::now();
    while inode() == first {
        assert!(
            start.elapsed() < Duration::from_secs(900),
            "the journal was not compacted after {calls} calls on other volumes in 900 s"
        );
        for (k, dev) in devs.iter().enumerate() {
            let vol = format!("vol-other-{k}");
            let staging = w.staging(0, &vol);
            let target = w.block_target(0, &vol);
            let cap = block(csi::volume_capability::access_mode::Mode::SingleNodeWriter);
            let stage = csi::NodeStageVolumeRequest {
                volume_id: vol.clone(),
                publish_context: HashMap::from([(DEVICE_PATH_KEY.into(), dev.clone())]),
                staging_target_path: staging.display().to_string(),
                volume_capability: Some(cap.clone()),
                ..Default::default()
            };
            node.node_stage_volume(stage).await.expect("stage other");
            node.node_publish_volume(publish(&vol, &staging, &target, cap))
                .await
                .expect("publish other");
            node.node_unpublish_volume(unpublish_req(&vol, &target))
                .await
                .expect("unpublish other");
            node.node_unstage_volume(unstage_req(&vol, &staging))
                .await
                .expect("unstage other");
            calls += 4;
        }
    }
    calls
}

/// Checks `states` in guest `g`: each rebuilt from the log on a cursor of its own.
fn check_states(lab: &Lab, g: usize, log: &Log, states: &[Point], marks: Marks) {
    let dir = lab.world.nodes[g].state.clone();
    let cursor = dir.join("cursor.img");
    let cursor_file = std::fs::File::create(&cursor).expect("cursor");
    cursor_file
        .set_len((STATE_MIB + VOLUME_MIB) * MIB)
        .expect("cursor size");
    let mut applied = 0usize; // entries [0, applied) are on the cursor
    let rt = runtime();
    // moor-node from the guest's memory: read from the host's shared files at every start,
    // its debug build costs seconds under TCG.
    // No udev in a checking guest: moor-node is given the device's path, and device-mapper
    // makes its nodes itself (DM_DISABLE_UDEV) without udev, which would probe every device
    // each state makes and removes (seconds under TCG).
    lab.vms[g].sh(&format!(
        "mkdir -p /run/bin && cp {} {NODE} && {{ udevadm control --exit || true; }}",
        moor_privileged::client::binary("moor-node").display()
    ));
    for p in states {
        // The cursor: everything up to the last durable point at or before `point`.
        let durable = log.entries[..=p.point]
            .iter()
            .rev()
            .find(|e| e.is_durable_point())
            .map_or(0, |e| e.index + 1);
        while applied < durable {
            log.apply(&log.entries[applied], &cursor_file)
                .expect("replay");
            applied += 1;
        }
        let work = dir.join(format!("state-{}.img", p.n));
        std::fs::copy(&cursor, &work).expect("copy of the cursor");
        // Between flushes: the writes since the last one, some of them lost.
        let mut dropped = 0;
        if p.drop_seed != 0 {
            let w = std::fs::OpenOptions::new()
                .write(true)
                .open(&work)
                .expect("work");
            let mut r = Rng::new(p.drop_seed);
            for e in &log.entries[durable..=p.point] {
                if r.next_u64().is_multiple_of(3) {
                    dropped += 1;
                } else {
                    log.apply(e, &w).expect("replay");
                }
            }
        }
        rt.block_on(check_state(lab, g, &work, *p, marks, dropped));
        let _ = std::fs::remove_file(&work);
    }
}

/// Boots the state in `image` as a node after a power cut, in guest `g`.
async fn check_state(lab: &Lab, g: usize, image: &Path, p: Point, marks: Marks, dropped: usize) {
    let what = format!(
        "state {} (log entry {}, {dropped} unflushed writes dropped)",
        p.n, p.point
    );
    let t0 = Instant::now();
    devices(lab, g, image, None, VOLUME_MIB);
    // ext4's own recovery; a state dir made before the cut may not exist yet. The guest
    // stands in for node 0: its kubelet dir is node 0's, in the guest's memory (the dirs
    // kubelet makes for the volume are made again).
    let staging = lab.world.staging(0, VOL);
    let target = lab.world.target(0, VOL);
    lab.vms[g].sh(&format!(
        "mkdir -p /run/state && {{ mount /dev/mapper/lwstate /run/state || \
         {{ mkfs.ext4 -q /dev/mapper/lwstate && mount /dev/mapper/lwstate /run/state; }}; }} && \
         mkdir -p /run/state/moor && mount -t tmpfs kubelet {} && mkdir -p {} {}",
        lab.world.nodes[0].kubelet.display(),
        staging.parent().expect("staging's parent").display(),
        target.parent().expect("target's parent").display()
    ));
    let t1 = Instant::now();
    let node_log = lab.world.nodes[g].state.join(format!("state-{}.log", p.n));
    let n = &lab.world.nodes[0];
    let mut node = start_node_in(
        &lab.vms[g],
        &n.name,
        &n.kubelet,
        NODE,
        &[],
        Path::new("/run/state/moor"),
        &node_log,
    )
    .await;
    let text = || std::fs::read_to_string(&node_log).unwrap_or_default();
    let t2 = Instant::now();
    // kubelet's retries of what it had asked: stage, publish, and (the volume's device is
    // bigger than its filesystem) expand.
    let stage = node.node_stage_volume(stage_req(lab)).await;
    let publish = match &stage {
        Ok(_) => node.node_publish_volume(publish_req(lab)).await.map(drop),
        Err(e) => Err(e.clone()),
    };
    let expand = match &publish {
        Ok(()) => node.node_expand_volume(expand_req(lab)).await.map(drop),
        Err(e) => Err(e.clone()),
    };
    let size = if expand.is_ok() { fs_mib(lab, g) } else { 0 };
    let formats = text().matches("formatted blank device").count();
    let file = lab.world.target(0, VOL).join("data").display().to_string();
    let data = lab.vms[g].read(&file);
    drop(node);
    let t3 = Instant::now();
    teardown(lab, g);
    if p.n < 8 {
        eprintln!(
            "vm-crash: {what} in guest {g}: devices and recovery {:.1} s, moor-node's start \
             {:.1} s, kubelet's calls {:.1} s, teardown {:.1} s",
            (t1 - t0).as_secs_f64(),
            (t2 - t1).as_secs_f64(),
            (t3 - t2).as_secs_f64(),
            t3.elapsed().as_secs_f64()
        );
    }
    let log = text();
    assert!(
        !log.contains("\"level\":\"ERROR\"") && !log.contains("corrupt"),
        "{what}: moor-node could not read its journal: {log}"
    );
    if p.point > marks.formatted {
        stage.unwrap_or_else(|e| panic!("{what}: kubelet's stage: {e:?}\n{log}"));
        publish.unwrap_or_else(|e| panic!("{what}: kubelet's publish: {e:?}\n{log}"));
        expand.unwrap_or_else(|e| panic!("{what}: kubelet's expand: {e:?}\n{log}"));
        assert!(
            size > FIRST_MIB,
            "{what}: the filesystem has {size} MiB after NodeExpandVolume"
        );
        assert_eq!(formats, 0, "{what}: formatted the volume again\n{log}");
    }
    if p.point > marks.synced {
        assert_eq!(data, SYNCED, "{what}: what the pod synced is gone\n{log}");
    }
}
