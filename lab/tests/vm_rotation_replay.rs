//! The block-level crash replay through a data key rotation (issue 40, point 4;
//! docs/encryption.md, "Rotation"): in a guest of the VM lab, whose Debian kernel has
//! dm-crypt and dm-log-writes, an encrypted volume of moor-controller's embedded backend is
//! staged by moor-node from a `log-writes` device over its file, which records every write
//! the volume takes (the LUKS header's and the filesystem's through the mapping), in order,
//! with their flushes. The recorded life: first stage (luksFormat, mkfs), numbered lines
//! written and fsynced, a data key rotation of the open volume (moor-node's
//! `RotateVolumeKey`), more lines fsynced, unstage. The log is then replayed on the host
//! (`moor_lab::logwrites`) to every flush and FUA write after the first stage (or a sample of
//! them: `MOOR_ROTATION_REPLAY_SAMPLES`), and each state is checked in the guest:
//!
//! * which of the old and the new data key open a slot of its LUKS header: the old only
//!   before the rotation; during it, the rotation's order (old copied to the spare slot, the
//!   volume's slot emptied, the new key written, recorded, verified, the spare emptied)
//!   allows the old only, then both, then the new only, never going back and never
//!   neither; the new only after it;
//! * the volume opens with a key that opens it, its filesystem mounts (ext4's recovery) and
//!   holds every line synced before that point.
//!
//! Runs only with `MOOR_ROTATION_REPLAY=1` (a long run under TCG); skipped, with the reason,
//! without it or without the VM lab.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use moor_lab::ceph::{ext4, publish};
use moor_lab::krbd_lab::start_node_in;
use moor_lab::logwrites::Log;
use moor_lab::vm::{Bridge, Vm};
use moor_privileged::requests::{unpublish_req, unstage_req};
use moor_privileged::{Sandbox, runtime};
use moor_proto::csi::v1 as csi;
use moor_proto::keys::v1::RotateVolumeKeyRequest;
use moor_proto::keys::v1::node_keys_client::NodeKeysClient;
use moor_runtime::contract::DEVICE_PATH_KEY;
use moor_runtime::keys::{Dek, Kek, WrappedDek, secret_entries};

const TEST: &str = "vm_rotation_replay";
const MIB: i64 = 1 << 20;
const KEK: [u8; 32] = [0x42; 32];
/// Lines synced before the rotation, and after it.
const BEFORE: u64 = 3;
const AFTER: u64 = 3;
/// The volume's device in the guest: the log-writes device over its file.
const LW: &str = "/dev/mapper/lw";
const FILE: &str = "lines.txt";

fn secrets() -> HashMap<String, String> {
    secret_entries("lab-kek", &KEK).into_iter().collect()
}

/// What a checked state showed.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Opens {
    old: bool,
    new: bool,
}

#[test]
fn a_crash_at_every_flush_of_a_rotation_leaves_one_key_and_the_synced_lines() {
    if std::env::var("MOOR_ROTATION_REPLAY").as_deref() != Ok("1") {
        eprintln!(
            "{TEST}: skipped: MOOR_ROTATION_REPLAY=1 is not set (a long run under TCG; \
             docs/encryption.md gives the command)"
        );
        return;
    }
    if !moor_lab::vm::available(TEST) {
        return;
    }
    let sb = Sandbox::new("vm-rotreplay");
    let bridge = Bridge::new("mrrp", 247);
    let vm = Vm::boot_for_dm_crypt(TEST, &bridge, &sb, "1G");
    let node_log = sb.state.join("node.log");
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        runtime().block_on(replay(&sb, &vm, &node_log));
    }));
    vm.clear_volumes(&sb.kubelet);
    vm.exec(&[
        "sh",
        "-c",
        "export DM_DISABLE_UDEV=1; umount /run/rr 2>/dev/null; cryptsetup close rr 2>/dev/null; \
         dmsetup remove --retry lw 2>/dev/null; losetup -D; true",
    ]);
    if let Err(e) = result {
        eprintln!(
            "{TEST}: moor-node's log:\n{}",
            std::fs::read_to_string(&node_log).unwrap_or_default()
        );
        std::panic::resume_unwind(e);
    }
}

async fn replay(sb: &Sandbox, vm: &Vm, node_log: &Path) {
    // The volume, made by the controller on the host.
    let (mut controller, mut ctl) = moor_lab::vm::start_embedded_controller(sb, "node-c").await;
    let v = ctl
        .create_volume(csi::CreateVolumeRequest {
            name: "pvc-rotation-replay".into(),
            capacity_range: Some(csi::CapacityRange {
                required_bytes: 96 * MIB,
                limit_bytes: 0,
            }),
            volume_capabilities: vec![ext4()],
            parameters: [("encrypted", "true"), ("kmsID", "secret")]
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .into(),
            secrets: secrets(),
            ..Default::default()
        })
        .await
        .map(|r| r.into_inner().volume)
        .expect("CreateVolume, encrypted")
        .expect("its volume");
    let file = moor_lab::vm::embedded_volume_file(&mut ctl, &v, "node-c", ext4()).await;
    let size = std::fs::metadata(&file).expect("the volume's file").len();
    let log_file = sb.data.join("rotation.log");
    std::fs::File::create(&log_file)
        .and_then(|f| f.set_len(1024 * MIB as u64))
        .expect("the log's file");

    let kek = Kek::new("lab-kek", &KEK).expect("kek");
    let old_text = v.volume_context["encryptedDEK"].clone();
    let old = kek
        .unwrap(
            &WrappedDek::decode(&old_text).expect("decode"),
            &v.volume_id,
        )
        .expect("the old key");
    let new = Dek::generate().expect("dek");

    record(
        sb, vm, node_log, &v, &file, &log_file, &old_text, &new, &kek,
    )
    .await;
    controller.stop().await;

    // The states.
    let log = Log::open(&log_file).expect("the log");
    let at = |name: &str| log.mark(name).unwrap_or_else(|| panic!("no mark {name}"));
    let (staged, before, begun, rotated, after, end) = (
        at("staged"),
        at("before"),
        at("rotation-begun"),
        at("rotated"),
        at("after"),
        at("end"),
    );
    let all: Vec<usize> = log
        .entries
        .iter()
        .filter(|e| e.index > staged && e.index <= end && e.is_durable_point())
        .map(|e| e.index)
        .collect();
    let in_rotation = all.iter().filter(|&&i| i > begun && i < rotated).count();
    let samples: usize = std::env::var("MOOR_ROTATION_REPLAY_SAMPLES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(16);
    // Every point, or `samples` of them spread evenly: two thirds (or all) of them the
    // rotation's own, the rest before and after it.
    let points: Vec<usize> = if samples == 0 || samples >= all.len() {
        all.clone()
    } else {
        let during = |i: &usize| *i > begun && *i < rotated;
        let spread = |from: Vec<usize>, n: usize| -> Vec<usize> {
            (0..n.min(from.len()))
                .map(|k| from[k * from.len() / n.min(from.len())])
                .collect()
        };
        let rot: Vec<usize> = all.iter().copied().filter(during).collect();
        let rest: Vec<usize> = all.iter().copied().filter(|i| !during(i)).collect();
        let take = rot.len().min(samples * 2 / 3);
        let mut p = spread(rot, take);
        p.extend(spread(rest, samples - take));
        p.sort();
        p
    };
    eprintln!(
        "{TEST}: {} log entries; {} flush/FUA points after the first stage, {in_rotation} of \
         them during the rotation; replaying {} (MOOR_ROTATION_REPLAY_SAMPLES=0: all)",
        log.entries.len(),
        all.len(),
        points.len()
    );

    let cursor = sb.data.join("cursor.img");
    let cursor_file = std::fs::File::create(&cursor).expect("cursor");
    cursor_file.set_len(size).expect("cursor size");
    let work = sb.data.join("state.img");
    let mut applied = 0usize;
    let (mut by_old, mut by_new, mut by_both) = (0, 0, 0);
    let mut last = Opens {
        old: true,
        new: false,
    };
    for &point in &points {
        while applied <= point {
            log.apply(&log.entries[applied], &cursor_file)
                .expect("replay");
            applied += 1;
        }
        std::fs::copy(&cursor, &work).expect("copy of the cursor");
        let what = format!("the state at log entry {point}");
        let opens = check_state(vm, &work, &old, &new, &what);
        let lines = if point > after {
            BEFORE + AFTER
        } else if point > before {
            BEFORE
        } else {
            0
        };
        let got = synced_lines(vm, &work, if opens.new { &new } else { &old }, &what);
        let want: Vec<String> = (1..=lines).map(|i| format!("line-{i}")).collect();
        assert!(
            got.len() >= want.len() && got[..want.len()] == want[..],
            "{what}: the {lines} lines synced before it: {got:?}"
        );
        match (opens.old, opens.new) {
            (true, true) => by_both += 1,
            (true, false) => by_old += 1,
            (false, true) => by_new += 1,
            (false, false) => panic!("{what}: neither key opens the volume"),
        }
        if point < begun {
            assert_eq!(opens, last, "{what}: before the rotation, the old key only");
        } else if point > rotated {
            let want = Opens {
                old: false,
                new: true,
            };
            assert_eq!(opens, want, "{what}: after the rotation, the new key only");
        } else {
            // old only -> both -> new only, never back.
            let rank = |o: Opens| match (o.old, o.new) {
                (true, false) => 0,
                (true, true) => 1,
                _ => 2,
            };
            assert!(
                rank(opens) >= rank(last),
                "{what}: {opens:?} after {last:?}: the rotation went back"
            );
        }
        last = opens;
    }
    let _ = std::fs::remove_file(&work);
    let _ = std::fs::remove_file(&cursor);
    let _ = std::fs::remove_file(&log_file);
    eprintln!(
        "{TEST}: {} states replayed: {by_old} opened by the old key only, {by_both} by both, \
         {by_new} by the new key only, none by neither; every one held its synced lines",
        points.len()
    );
}

/// The life, recorded in the guest on the log-writes device over the volume's `file`.
#[allow(clippy::too_many_arguments)]
async fn record(
    sb: &Sandbox,
    vm: &Vm,
    node_log: &Path,
    v: &csi::Volume,
    file: &str,
    log_file: &Path,
    old_text: &str,
    new: &Dek,
    kek: &Kek,
) {
    vm.sh(&format!(
        "set -e; modprobe dm-log-writes; B=$(losetup -f --show {file}); \
         L=$(losetup -f --show {}); \
         dmsetup create lw --table \"0 $(blockdev --getsz $B) log-writes $B $L\"",
        log_file.display()
    ));
    let mark = |name: &str| vm.sh(&format!("sync; dmsetup message lw 0 mark {name}"));
    let staging = sb.staging("pv-rr");
    let target = sb.target("pod-rr", "pv-rr");
    let stage = csi::NodeStageVolumeRequest {
        volume_id: v.volume_id.clone(),
        publish_context: HashMap::from([(DEVICE_PATH_KEY.into(), LW.into())]),
        staging_target_path: staging.display().to_string(),
        volume_capability: Some(ext4()),
        secrets: secrets(),
        volume_context: v.volume_context.clone(),
    };
    let mut node = start_node_in(
        vm,
        "node-c",
        &sb.kubelet,
        "moor-node",
        &[],
        &sb.state,
        node_log,
    )
    .await;
    node.node_stage_volume(stage).await.expect("first stage");
    node.node_publish_volume(publish(&v.volume_id, &staging, &target, ext4()))
        .await
        .expect("publish");
    mark("staged");
    let lines = target.join(FILE).display().to_string();
    let write = |from: u64, to: u64| {
        vm.sh(&format!(
            "for i in $(seq {from} {to}); do echo line-$i | dd of={lines} oflag=append \
             conv=notrunc,fsync status=none; done"
        ))
    };
    write(1, BEFORE);
    mark("before");
    mark("rotation-begun");
    let channel = vm.channel(moor_lab::krbd_lab::SOCKET).await;
    let answer = NodeKeysClient::new(channel.expect("the node's socket"))
        .rotate_volume_key(RotateVolumeKeyRequest {
            volume_id: v.volume_id.clone(),
            old_wrapped_dek: old_text.into(),
            new_wrapped_dek: new.wrap(kek, &v.volume_id).expect("wrap").encode(),
            luks_pbkdf: "pbkdf2".into(),
            secrets: secrets(),
        })
        .await
        .expect("RotateVolumeKey")
        .into_inner();
    assert_eq!(answer.steps.len(), 6, "{:?}", answer.steps);
    mark("rotated");
    write(BEFORE + 1, BEFORE + AFTER);
    mark("after");
    node.node_unpublish_volume(unpublish_req(&v.volume_id, &target))
        .await
        .expect("unpublish");
    node.node_unstage_volume(unstage_req(&v.volume_id, &staging))
        .await
        .expect("unstage");
    mark("end");
    drop(node);
    vm.sh("export DM_DISABLE_UDEV=1; dmsetup remove --retry lw && losetup -D");
}

/// `key` as a printf argument (octal escapes: it never reaches a file or a log).
fn escaped(key: &Dek) -> String {
    key.expose().iter().map(|b| format!("\\{b:03o}")).collect()
}

/// Which of the keys open a slot of the LUKS header in `image`, tried in the guest.
fn check_state(vm: &Vm, image: &Path, old: &Dek, new: &Dek, what: &str) -> Opens {
    let dev = vm
        .sh(&format!("losetup -f --show {}", image.display()))
        .trim()
        .to_string();
    let opens = |key: &Dek| {
        vm.sh(&format!(
            "printf '{}' | cryptsetup open --test-passphrase --key-file=- {dev}; echo rc=$?",
            escaped(key)
        ))
        .contains("rc=0")
    };
    let o = Opens {
        old: opens(old),
        new: opens(new),
    };
    vm.sh(&format!("losetup -d {dev}"));
    eprintln!("{TEST}: {what}: {o:?}");
    o
}

/// The lines of the volume's file in `image`, opened with `key` in the guest.
fn synced_lines(vm: &Vm, image: &Path, key: &Dek, what: &str) -> Vec<String> {
    let dev = vm
        .sh(&format!("losetup -f --show {}", image.display()))
        .trim()
        .to_string();
    let mnt = PathBuf::from("/run/rr");
    let out = vm.exec(&[
        "sh",
        "-c",
        &format!(
            "printf '{}' | cryptsetup open --key-file=- {dev} rr && mkdir -p {m} && \
             mount /dev/mapper/rr {m} && {{ cat {m}/{FILE} 2>/dev/null; true; }}",
            escaped(key),
            m = mnt.display()
        ),
    ]);
    vm.sh(&format!(
        "umount {m} 2>/dev/null; cryptsetup close rr 2>/dev/null; losetup -d {dev}; true",
        m = mnt.display()
    ));
    assert!(
        out.ok(),
        "{what}: open and mount: {}{}",
        out.stdout,
        out.stderr
    );
    out.stdout.lines().map(str::to_string).collect()
}
