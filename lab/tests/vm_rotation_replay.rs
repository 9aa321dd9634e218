//! The block-level crash replay of an encrypted volume's whole life, through a data key
//! rotation (issue 40, point 4; docs/encryption.md, "Rotation"): in a guest of the VM lab,
//! whose Debian kernel has dm-crypt and dm-log-writes, an encrypted volume of
//! moor-controller's embedded backend is staged by moor-node from a linear device over a
//! `log-writes` device over a blank file, which records every write the volume takes (the LUKS
//! header's and the filesystem's through the mapping), in order, with their flushes, from the
//! first. The recorded life: first stage (luksFormat, mkfs), numbered lines written and each
//! fsynced, an online expansion (the linear device grown, NodeExpandVolume: `cryptsetup
//! resize`, then resize2fs), a data key rotation as `moorctl rotate-key --controller` runs it
//! (the controller's `BeginVolumeKeyRotation`, moor-node's `RotateVolumeKey` of the open
//! volume, `FinishVolumeKeyRotation`), more lines fsynced, unstage, a stage again with the
//! record's new key, one more line fsynced, unstage. The log is then replayed on the host
//! (`moor_lab::logwrites`) to its flush and FUA writes (a point with no write since the one
//! before leaves the same device and is replayed once), and each state is checked in the
//! guest:
//!
//! * which of the old and the new data key open a slot of its LUKS header: before the first
//!   stage ends, either may be missing (nothing was synced yet); then the old only; during the
//!   rotation, its order (old copied to the spare slot, the volume's slot emptied, the new key
//!   written, recorded, verified, the spare emptied) allows the old only, then both, then the
//!   new only, never going back and never neither; the new only after it;
//! * **a fresh moor-node with an empty journal stages it** (another node, or this one after
//!   its journal is lost), given what the controller's record held at that instant in the
//!   publish_context (`encryptedDEK`, and `encryptedDEKPending` between Begin and Finish):
//!   after the first stage it must open the volume (trying the keys in its order), mount it
//!   without formatting anything, and every line synced before that point is there; during
//!   the first stage it formats only a device that is still blank (all zeros: nothing was
//!   ever synced to it), and a device holding part of a LUKS header or of a filesystem is
//!   either opened (complete) or refused, never formatted again. Then it unpublishes and
//!   unstages, and nothing is left: no mount under the kubelet dir, no dm-crypt mapping.
//!
//! Quick mode by default (a spread sample of the states: `MOOR_ROTATION_REPLAY_SAMPLES`, 6
//! unless set, 0 for all); `MOOR_ROTATION_REPLAY=soak` replays every state. Skipped, with the
//! reason, without the VM lab.

use std::collections::HashMap;
use std::path::Path;
use std::time::Instant;

use moor_lab::ceph::{ext4, publish};
use moor_lab::krbd_lab::start_node_in;
use moor_lab::logwrites::Log;
use moor_lab::vm::{Bridge, Vm};
use moor_privileged::requests::{unpublish_req, unstage_req};
use moor_privileged::{Sandbox, runtime};
use moor_proto::csi::v1 as csi;
use moor_proto::csi::v1::node_client::NodeClient;
use moor_proto::keys::v1::controller_keys_client::ControllerKeysClient;
use moor_proto::keys::v1::node_keys_client::NodeKeysClient;
use moor_proto::keys::v1::{
    BeginVolumeKeyRotationRequest, FinishVolumeKeyRotationRequest, RotateVolumeKeyRequest,
};
use moor_runtime::contract::{DEVICE_PATH_KEY, ENCRYPTED_DEK_KEY, ENCRYPTED_DEK_PENDING_KEY};
use moor_runtime::keys::{Dek, Kek, WrappedDek, secret_entries};
use tonic::transport::Channel;

const TEST: &str = "vm_rotation_replay";
const MIB: u64 = 1 << 20;
const KEK: [u8; 32] = [0x42; 32];
/// The volume's device at its first stage, and after the expansion.
const FIRST_MIB: u64 = 96;
const GROWN_MIB: u64 = 128;
/// Lines synced before the rotation, after it, and after the stage again.
const BEFORE: u64 = 3;
const AFTER: u64 = 3;
const LAST: u64 = 1;
/// The log-writes device over the volume's file, and the volume's device over it (a linear
/// device, grown by a reload: the log-writes device keeps its size and its log).
const LW: &str = "lw";
const LWVOL: &str = "/dev/mapper/lwvol";
const FILE: &str = "lines.txt";
/// The volume's staging and publish paths, at the recording and at each state.
const PV: &str = "pv-rr";
const POD: &str = "pod-rr";

fn secrets() -> HashMap<String, String> {
    secret_entries("lab-kek", &KEK).into_iter().collect()
}

/// What a checked state showed: which keys open a slot of its header.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Opens {
    old: bool,
    new: bool,
}

/// The volume's keys, wrapped as the controller's record holds them and unwrapped.
struct Keys {
    old_text: String,
    new_text: String,
    old: Dek,
    new: Dek,
}

/// Where the recorded life stood, by the log's marks.
#[derive(Debug, Clone, Copy)]
struct Marks {
    staged: usize,
    before: usize,
    grow: usize,
    begun: usize,
    rotated: usize,
    finished: usize,
    after: usize,
    last: usize,
    end: usize,
}

impl Marks {
    /// The lines synced before `point`.
    fn lines(&self, point: usize) -> u64 {
        if point > self.last {
            BEFORE + AFTER + LAST
        } else if point > self.after {
            BEFORE + AFTER
        } else if point > self.before {
            BEFORE
        } else {
            0
        }
    }

    /// The controller's record at `point`, as ControllerPublishVolume gives it: the current
    /// key, and the pending key between Begin and Finish.
    fn published(&self, point: usize, keys: &Keys) -> Vec<(&'static str, String)> {
        if point < self.begun {
            vec![(ENCRYPTED_DEK_KEY, keys.old_text.clone())]
        } else if point < self.finished {
            vec![
                (ENCRYPTED_DEK_KEY, keys.old_text.clone()),
                (ENCRYPTED_DEK_PENDING_KEY, keys.new_text.clone()),
            ]
        } else {
            vec![(ENCRYPTED_DEK_KEY, keys.new_text.clone())]
        }
    }
}

#[test]
fn a_crash_at_every_flush_of_an_encrypted_volumes_life_and_rotation_stages_with_its_data() {
    let soak = std::env::var("MOOR_ROTATION_REPLAY").as_deref() == Ok("soak");
    if !moor_lab::vm::available(TEST) {
        return;
    }
    let sb = Sandbox::new("vm-rotreplay");
    let bridge = Bridge::new("mrrp", 247);
    let vm = Vm::boot_for_dm_crypt(TEST, &bridge, &sb, "1G");
    let node_log = sb.state.join("node.log");
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        runtime().block_on(replay(&sb, &vm, &node_log, soak));
    }));
    vm.clear_volumes(&sb.kubelet);
    vm.exec(&[
        "sh",
        "-c",
        "export DM_DISABLE_UDEV=1; umount /run/rr 2>/dev/null; \
         for d in lwvol lw; do dmsetup remove --retry $d 2>/dev/null; done; losetup -D; true",
    ]);
    if let Err(e) = result {
        eprintln!(
            "{TEST}: moor-node's log:\n{}",
            std::fs::read_to_string(&node_log).unwrap_or_default()
        );
        std::panic::resume_unwind(e);
    }
}

/// `n` of `from`, spread evenly, its first and last among them.
fn spread(from: &[usize], n: usize) -> Vec<usize> {
    match n.min(from.len()) {
        0 => Vec::new(),
        1 => vec![from[from.len() - 1]],
        n => (0..n)
            .map(|k| from[k * (from.len() - 1) / (n - 1)])
            .collect(),
    }
}

async fn replay(sb: &Sandbox, vm: &Vm, node_log: &Path, soak: bool) {
    let started = Instant::now();
    // The volume, made by the controller on the host: its volume context and its record's
    // keys (the guest's device is a file of the test's own, blank, so that the log holds
    // every write from the first).
    let (mut controller, mut ctl) = moor_lab::vm::start_embedded_controller(sb, "node-c").await;
    let v = ctl
        .create_volume(csi::CreateVolumeRequest {
            name: "pvc-rotation-replay".into(),
            capacity_range: Some(csi::CapacityRange {
                required_bytes: (FIRST_MIB * MIB) as i64,
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
    let file = sb.data.join("volume.img");
    std::fs::File::create(&file)
        .and_then(|f| f.set_len(GROWN_MIB * MIB))
        .expect("the volume's file");
    let log_file = sb.data.join("rotation.log");
    std::fs::File::create(&log_file)
        .and_then(|f| f.set_len(1024 * MIB))
        .expect("the log's file");
    let keys_ctl = ControllerKeysClient::new(
        moor_runtime::client::connect(&sb.root.join("controller.sock"))
            .await
            .expect("the controller's socket"),
    );
    let keys = record(sb, vm, node_log, &v, &file, &log_file, keys_ctl).await;
    controller.stop().await;
    let recorded = started.elapsed();

    // The states.
    let log = Log::open(&log_file).expect("the log");
    let at = |name: &str| log.mark(name).unwrap_or_else(|| panic!("no mark {name}"));
    let m = Marks {
        staged: at("staged"),
        before: at("before"),
        grow: at("grow"),
        begun: at("rotation-begun"),
        rotated: at("rotated"),
        finished: at("finished"),
        after: at("after"),
        last: at("last"),
        end: at("end"),
    };
    let durable: Vec<usize> = log
        .entries
        .iter()
        .filter(|e| e.index <= m.end && e.is_durable_point())
        .map(|e| e.index)
        .collect();
    // A durable point with no write since the one before leaves the same device: once.
    let mut all = Vec::new();
    let mut prev = None;
    for &p in &durable {
        let wrote = log.entries[prev.map_or(0, |q: usize| q + 1)..=p]
            .iter()
            .any(|e| e.nr_sectors > 0);
        if prev.is_none() || wrote {
            all.push(p);
        }
        prev = Some(p);
    }
    let samples: usize = if soak {
        0
    } else {
        std::env::var("MOOR_ROTATION_REPLAY_SAMPLES")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(6)
    };
    // Every state, or `samples` of them spread evenly (the first and last of each part
    // among them): a third the first stage's, a third the rotation's, the rest the life's
    // other steps.
    let points: Vec<usize> = if samples == 0 || samples >= all.len() {
        all.clone()
    } else {
        let first: Vec<usize> = all.iter().copied().filter(|&i| i < m.staged).collect();
        let rot: Vec<usize> = all
            .iter()
            .copied()
            .filter(|&i| i > m.begun && i < m.rotated)
            .collect();
        let rest: Vec<usize> = all
            .iter()
            .copied()
            .filter(|&i| i > m.staged && !(i > m.begun && i < m.rotated))
            .collect();
        let n_first = first.len().min(samples / 3);
        let n_rot = rot.len().min(samples / 3);
        let mut p = spread(&first, n_first);
        p.extend(spread(&rot, n_rot));
        p.extend(spread(&rest, samples - n_first - n_rot));
        p.sort();
        p
    };
    let first_stage = all.iter().filter(|&&i| i < m.staged).count();
    let in_rotation = all
        .iter()
        .filter(|&&i| i > m.begun && i < m.rotated)
        .count();
    eprintln!(
        "{TEST}: the life recorded in {:.0} s: {} log entries; {} flush/FUA points, {} states \
         (the others leave the device of the one before), {first_stage} of them during the \
         first stage and {in_rotation} during the rotation; replaying {} ({})",
        recorded.as_secs_f64(),
        log.entries.len(),
        durable.len(),
        all.len(),
        points.len(),
        if soak {
            "soak: every state"
        } else {
            "quick: MOOR_ROTATION_REPLAY=soak for all"
        }
    );

    let cursor = sb.data.join("cursor.img");
    let cursor_file = std::fs::File::create(&cursor).expect("cursor");
    cursor_file.set_len(GROWN_MIB * MIB).expect("cursor size");
    let work = sb.data.join("state.img");
    let mut applied = 0usize;
    let mut t = Tally::default();
    let mut last = Opens {
        old: true,
        new: false,
    };
    let replayed = Instant::now();
    for (n, &point) in points.iter().enumerate() {
        let state_started = Instant::now();
        while applied <= point {
            log.apply(&log.entries[applied], &cursor_file)
                .expect("replay");
            applied += 1;
        }
        std::fs::copy(&cursor, &work).expect("copy of the cursor");
        let what = format!("the state at log entry {point}");
        let size = if point < m.grow { FIRST_MIB } else { GROWN_MIB } * MIB;
        let blank = is_blank(&work, size);
        let dev = vm
            .sh(&format!(
                "losetup -f --show --sizelimit {size} {}",
                work.display()
            ))
            .trim()
            .to_string();
        let opens = if blank {
            Opens::default()
        } else {
            which_keys(vm, &dev, &keys, &what)
        };
        let staged = stage_state(sb, vm, n, &dev, &v, &m.published(point, &keys), &what).await;
        vm.sh(&format!("losetup -d {dev}"));
        t.stages += 1;
        t.left_open += usize::from(staged.left_open);
        eprintln!(
            "{TEST}: {what}: checked in {:.1} s",
            state_started.elapsed().as_secs_f64()
        );
        if point < m.staged {
            // The first stage, cut short: nothing was synced yet.
            match (&staged.result, blank) {
                (Ok(_), true) => {
                    assert!(
                        staged.formatted,
                        "{what}: a blank device staged unformatted"
                    );
                    t.blank += 1;
                }
                (Ok(_), false) => {
                    assert!(
                        !staged.formatted,
                        "{what}: a device holding part of the volume was formatted again"
                    );
                    t.opened_early += 1;
                }
                (Err(code), false) => {
                    assert!(
                        !staged.formatted,
                        "{what}: formatted, then failed: {code:?}"
                    );
                    *t.refused.entry(format!("{code:?}")).or_default() += 1;
                }
                (Err(code), true) => panic!("{what}: a blank device refused: {code:?}"),
            }
            last = Opens {
                old: true,
                new: false,
            };
            continue;
        }
        assert!(!blank, "{what}: blank after the first stage");
        let got = staged
            .result
            .as_ref()
            .unwrap_or_else(|code| panic!("{what}: the stage of an empty journal: {code:?}"));
        assert!(!staged.formatted, "{what}: formatted again");
        let lines = m.lines(point);
        let want: Vec<String> = (1..=lines).map(|i| format!("line-{i}")).collect();
        assert!(
            got.len() >= want.len() && got[..want.len()] == want[..],
            "{what}: the {lines} lines synced before it: {got:?}"
        );
        t.opened += 1;
        match (opens.old, opens.new) {
            (true, true) => t.both += 1,
            (true, false) => t.old += 1,
            (false, true) => t.new += 1,
            (false, false) => panic!("{what}: neither key opens the volume"),
        }
        if point < m.begun {
            let want = Opens {
                old: true,
                new: false,
            };
            assert_eq!(opens, want, "{what}: before the rotation, the old key only");
        } else if point > m.rotated {
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
    let _ = std::fs::remove_file(&file);
    eprintln!(
        "{TEST}: {} states replayed and staged by a fresh moor-node in {:.0} s ({:.0} s in all): \
         during the first stage {} blank (formatted), {} opened, refused {:?}; after it {} \
         opened with their synced lines: {} by the old key only, {} by both, {} by the new key \
         only, none by neither; {} refused stages left the mapping open until NodeUnstageVolume",
        points.len(),
        replayed.elapsed().as_secs_f64(),
        started.elapsed().as_secs_f64(),
        t.blank,
        t.opened_early,
        t.refused,
        t.opened,
        t.old,
        t.both,
        t.new,
        t.left_open
    );
    assert_eq!(t.stages, points.len());
}

/// The states' counts.
#[derive(Debug, Default)]
struct Tally {
    stages: usize,
    blank: usize,
    opened_early: usize,
    refused: std::collections::BTreeMap<String, usize>,
    left_open: usize,
    opened: usize,
    old: usize,
    both: usize,
    new: usize,
}

/// Whether the first `size` bytes of `image` are all zeros.
fn is_blank(image: &Path, size: u64) -> bool {
    use std::io::Read as _;
    let mut f = std::fs::File::open(image).expect("the state's image");
    let mut buf = vec![0u8; MIB as usize];
    let mut left = size;
    while left > 0 {
        let n = f.read(&mut buf).expect("read the state");
        if n == 0 {
            break;
        }
        if buf[..n].iter().any(|&b| b != 0) {
            return false;
        }
        left = left.saturating_sub(n as u64);
    }
    true
}

/// What the stage of a state by a fresh moor-node did.
struct Staged {
    /// The lines of the volume's file, or the stage's error code.
    result: Result<Vec<String>, tonic::Code>,
    /// Whether it formatted anything (luksFormat or mkfs), by its log.
    formatted: bool,
    /// Whether a refused stage left the volume's dm-crypt mapping open (for the retry to
    /// use; NodeUnstageVolume closes it).
    left_open: bool,
}

/// The state on guest device `dev` staged by a fresh moor-node with an empty journal (its
/// own state dir), given the volume context and `published` as the controller's
/// publish_context; published, its lines read, unpublished and unstaged; the node stopped,
/// and nothing left mounted or open.
async fn stage_state(
    sb: &Sandbox,
    vm: &Vm,
    n: usize,
    dev: &str,
    v: &csi::Volume,
    published: &[(&'static str, String)],
    what: &str,
) -> Staged {
    let state = sb.state.join(format!("replay-{n}"));
    std::fs::create_dir_all(&state).expect("state dir");
    let log = sb.state.join(format!("replay-{n}.log"));
    let mut node = start_node_in(vm, "node-c", &sb.kubelet, "moor-node", &[], &state, &log).await;
    let staging = sb.staging(PV);
    let target = sb.target(POD, PV);
    let mut publish_context: HashMap<String, String> = published
        .iter()
        .map(|(k, v)| ((*k).to_string(), v.clone()))
        .collect();
    publish_context.insert(DEVICE_PATH_KEY.into(), dev.into());
    let stage = csi::NodeStageVolumeRequest {
        volume_id: v.volume_id.clone(),
        publish_context,
        staging_target_path: staging.display().to_string(),
        volume_capability: Some(ext4()),
        secrets: secrets(),
        volume_context: v.volume_context.clone(),
    };
    let mut left_open = false;
    let result = match node.node_stage_volume(stage).await {
        Ok(_) => {
            node.node_publish_volume(publish(&v.volume_id, &staging, &target, ext4()))
                .await
                .unwrap_or_else(|e| panic!("{what}: publish: {e:?}"));
            let lines = vm.sh(&format!(
                "cat {} 2>/dev/null; true",
                target.join(FILE).display()
            ));
            take_down(&mut node, v, &staging, &target, what).await;
            Ok(lines.lines().map(str::to_string).collect())
        }
        Err(e) => {
            eprintln!("{TEST}: {what}: the stage refused: {e:?}");
            // What kubelet does when the pod goes: NodeUnstageVolume, which must clean up
            // what the refused stage left.
            left_open = !crypt_mappings(vm).is_empty();
            node.node_unstage_volume(unstage_req(&v.volume_id, &staging))
                .await
                .unwrap_or_else(|e| panic!("{what}: unstage after the refused stage: {e:?}"));
            Err(e.code())
        }
    };
    vm.sh("pkill -KILL -x moor-node; while pgrep -x moor-node >/dev/null; do sleep 0.1; done");
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    let formatted = text.contains("formatted as LUKS2") || text.contains("formatted blank device");
    let kubelet = sb.kubelet.display().to_string();
    let mounts = vm.sh(&format!(
        "findmnt -rn -o TARGET | grep -E '^{kubelet}/'; true"
    ));
    let mappings = crypt_mappings(vm);
    assert!(
        mounts.trim().is_empty() && mappings.is_empty(),
        "{what}: left after its unstage: mounts {mounts:?}, mappings {mappings:?}"
    );
    let _ = std::fs::remove_dir_all(&state);
    let _ = std::fs::remove_file(&log);
    Staged {
        result,
        formatted,
        left_open,
    }
}

/// The dm-crypt mappings open in the guest.
fn crypt_mappings(vm: &Vm) -> String {
    vm.sh("dmsetup ls --target crypt | grep -v 'No devices found'; true")
        .trim()
        .to_string()
}

async fn take_down(
    node: &mut NodeClient<Channel>,
    v: &csi::Volume,
    staging: &Path,
    target: &Path,
    what: &str,
) {
    node.node_unpublish_volume(unpublish_req(&v.volume_id, target))
        .await
        .unwrap_or_else(|e| panic!("{what}: unpublish: {e:?}"));
    node.node_unstage_volume(unstage_req(&v.volume_id, staging))
        .await
        .unwrap_or_else(|e| panic!("{what}: unstage: {e:?}"));
}

/// The life, recorded in the guest on the log-writes device over `file`; the keys.
async fn record(
    sb: &Sandbox,
    vm: &Vm,
    node_log: &Path,
    v: &csi::Volume,
    file: &Path,
    log_file: &Path,
    mut keys_ctl: ControllerKeysClient<Channel>,
) -> Keys {
    vm.sh(&format!(
        "set -e; export DM_DISABLE_UDEV=1; modprobe dm-log-writes; \
         B=$(losetup -f --show {}); L=$(losetup -f --show {}); \
         dmsetup create {LW} --table \"0 $(blockdev --getsz $B) log-writes $B $L\"; \
         dmsetup create lwvol --table \"0 {} linear /dev/mapper/{LW} 0\"",
        file.display(),
        log_file.display(),
        FIRST_MIB * 2048
    ));
    // No `sync` before a mark: what is durable at a mark is what the calls before it made
    // durable themselves (a stage, an fsync, a rotation's header writes).
    let mark = |name: &str| vm.sh(&format!("dmsetup message {LW} 0 mark {name}"));
    let staging = sb.staging(PV);
    let target = sb.target(POD, PV);
    let kek = Kek::new("lab-kek", &KEK).expect("kek");
    let unwrap = |text: &str| {
        kek.unwrap(&WrappedDek::decode(text).expect("decode"), &v.volume_id)
            .expect("unwrap")
    };
    let old_text = v.volume_context[ENCRYPTED_DEK_KEY].clone();
    let stage = |key: &str| csi::NodeStageVolumeRequest {
        volume_id: v.volume_id.clone(),
        publish_context: HashMap::from([
            (DEVICE_PATH_KEY.into(), LWVOL.into()),
            (ENCRYPTED_DEK_KEY.into(), key.into()),
        ]),
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
    node.node_stage_volume(stage(&old_text))
        .await
        .expect("first stage");
    mark("staged");
    node.node_publish_volume(publish(&v.volume_id, &staging, &target, ext4()))
        .await
        .expect("publish");
    let lines = target.join(FILE).display().to_string();
    let write = |from: u64, to: u64| {
        vm.sh(&format!(
            "for i in $(seq {from} {to}); do echo line-$i | dd of={lines} oflag=append \
             conv=notrunc,fsync status=none; done"
        ))
    };
    write(1, BEFORE);
    mark("before");

    // Online expansion: the device grows (a reload of the linear device), then
    // NodeExpandVolume grows the LUKS mapping and the filesystem.
    mark("grow");
    vm.sh(&format!(
        "export DM_DISABLE_UDEV=1; dmsetup suspend lwvol && dmsetup reload lwvol --table \
         \"0 {} linear /dev/mapper/{LW} 0\" && dmsetup resume lwvol",
        GROWN_MIB * 2048
    ));
    node.node_expand_volume(csi::NodeExpandVolumeRequest {
        volume_id: v.volume_id.clone(),
        volume_path: target.display().to_string(),
        staging_target_path: staging.display().to_string(),
        capacity_range: Some(csi::CapacityRange {
            required_bytes: (GROWN_MIB * MIB) as i64,
            limit_bytes: 0,
        }),
        volume_capability: Some(ext4()),
        secrets: secrets(),
    })
    .await
    .expect("NodeExpandVolume");
    let fs_mib: u64 = vm
        .sh(&format!(
            "df -m --output=size {} | tail -1",
            target.display()
        ))
        .trim()
        .parse()
        .expect("df");
    assert!(
        fs_mib > FIRST_MIB,
        "the filesystem has {fs_mib} MiB after NodeExpandVolume to {GROWN_MIB} MiB"
    );
    mark("expanded");

    // The rotation as `moorctl rotate-key --controller` runs it.
    let begun = keys_ctl
        .begin_volume_key_rotation(BeginVolumeKeyRotationRequest {
            volume_id: v.volume_id.clone(),
            secrets: secrets(),
            if_rotations: None,
        })
        .await
        .expect("BeginVolumeKeyRotation")
        .into_inner();
    assert_eq!(begun.current_wrapped_dek, old_text);
    mark("rotation-begun");
    let channel = vm.channel(moor_lab::krbd_lab::SOCKET).await;
    let answer = NodeKeysClient::new(channel.expect("the node's socket"))
        .rotate_volume_key(RotateVolumeKeyRequest {
            volume_id: v.volume_id.clone(),
            old_wrapped_dek: old_text.clone(),
            new_wrapped_dek: begun.pending_wrapped_dek.clone(),
            luks_pbkdf: begun.luks_pbkdf.clone(),
            secrets: secrets(),
        })
        .await
        .expect("RotateVolumeKey")
        .into_inner();
    assert_eq!(answer.steps.len(), 6, "{:?}", answer.steps);
    mark("rotated");
    keys_ctl
        .finish_volume_key_rotation(FinishVolumeKeyRotationRequest {
            volume_id: v.volume_id.clone(),
            new_wrapped_dek: begun.pending_wrapped_dek.clone(),
        })
        .await
        .expect("FinishVolumeKeyRotation");
    mark("finished");
    write(BEFORE + 1, BEFORE + AFTER);
    mark("after");
    take_down(&mut node, v, &staging, &target, "the recorded life").await;
    mark("unstaged");
    // Staged again, given the record's key.
    node.node_stage_volume(stage(&begun.pending_wrapped_dek))
        .await
        .expect("stage again");
    node.node_publish_volume(publish(&v.volume_id, &staging, &target, ext4()))
        .await
        .expect("publish again");
    write(BEFORE + AFTER + 1, BEFORE + AFTER + LAST);
    mark("last");
    take_down(&mut node, v, &staging, &target, "the recorded life").await;
    mark("end");
    drop(node);
    vm.sh(&format!(
        "export DM_DISABLE_UDEV=1; pkill -KILL -x moor-node; \
         while pgrep -x moor-node >/dev/null; do sleep 0.1; done; \
         dmsetup remove --retry lwvol && dmsetup remove --retry {LW} && losetup -D"
    ));
    Keys {
        old: unwrap(&old_text),
        new: unwrap(&begun.pending_wrapped_dek),
        old_text,
        new_text: begun.pending_wrapped_dek,
    }
}

/// `key` as a printf argument (octal escapes: it never reaches a file or a log).
fn escaped(key: &Dek) -> String {
    key.expose().iter().map(|b| format!("\\{b:03o}")).collect()
}

/// Which of the keys open a slot of the LUKS header on guest device `dev`.
fn which_keys(vm: &Vm, dev: &str, keys: &Keys, what: &str) -> Opens {
    let opens = |key: &Dek| {
        vm.sh(&format!(
            "printf '{}' | cryptsetup open --test-passphrase --key-file=- {dev} 2>/dev/null; \
             echo rc=$?",
            escaped(key)
        ))
        .contains("rc=0")
    };
    let o = Opens {
        old: opens(&keys.old),
        new: opens(&keys.new),
    };
    eprintln!("{TEST}: {what}: {o:?}");
    o
}
