//! Real power cuts during a data key rotation (issue 40, point 4: "power cuts during a
//! rotation lose nothing"; docs/encryption.md, "Rotation").
//!
//! A guest of the VM lab whose disks are files on the host, as in `vm_powercut.rs`: a state
//! disk (ext4, moor-node's state dir and journal on it) and the encrypted volume's own file of
//! moor-controller's embedded backend (on the host), attached as a virtio disk with a serial,
//! which NodeStageVolume finds by `deviceSerial`. moor-node stages the volume (LUKS2 made at
//! the first stage) and publishes it; a pod-like writer in the guest appends numbered lines
//! to a file on it, `fsync`ing each, and notes each synced number in a host file. A data key
//! rotation runs as `moorctl rotate-key --controller` runs it: `BeginVolumeKeyRotation` on the
//! controller (the pending key in its record), `RotateVolumeKey` on the node (the slot steps,
//! each journaled), `FinishVolumeKeyRotation`. moor-node (the `crash-points` build) is
//! started with `MOOR_TEST_HOLD_AT=<point>`: the rotation stops at that step (its intent
//! journaled, the step not begun) and says so on moor-node's log, and the host then cuts the
//! power: the guest's QEMU is SIGKILLed at exactly that step. Each point of
//! `crash_points::ROTATE_POINTS` is cut in turn (the step before each slot change, and after
//! the last one, before the node answers and the controller finishes), one rotation each.
//!
//! After the cut the guest boots again on the same files, and:
//! * before anything opens it, at least one of the old and new keys opens a slot of the
//!   volume's LUKS header (which, is counted);
//! * moor-node starts on its journal (ext4 recovered the state disk); the volume stages and
//!   publishes, as kubelet calls them after a reboot, with the controller's publish_context
//!   (the record's keys at the cut: the old key current, the new one pending);
//! * the rotation is finished forward (run again: Begin answers the same pending key, the
//!   node resumes from what the header holds, Finish promotes), and the controller's record
//!   then names the new key alone;
//! * the header then has one key slot, which that key opens and the other key does not;
//! * every line the writer noted as synced, in every round's file, is there, in order;
//! * moor-node logged no error and found no damage in its journal.
//!
//! The next rotation (from the key just made current) is the next cut's. The guest's memory is
//! lost at a cut (page cache, moor-node, writes not yet handed to the disks); the disks'
//! files keep whatever reached QEMU (`cache=unsafe`, the host's page cache survives a QEMU
//! kill), as in `vm_powercut.rs`.
//!
//! Modes: `MOOR_VM_POWERCUT_ROTATION_QUICK=1` (the test command's) cuts at two of the steps
//! where the two keys coexist in the header (before `Record` and before `KillSpare`), once;
//! otherwise every point, `MOOR_VM_POWERCUT_ROTATION_ROUNDS` rounds of them (default 1; a
//! soak: more); `MOOR_VM_POWERCUT_ROTATION_POINTS=rotate.add_new,...` cuts at the points named
//! only. Skipped, with the reason, without the VM lab.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use moor_lab::ceph::{ext4, publish};
use moor_lab::krbd_lab::{SOCKET, start_node_in};
use moor_lab::vm::{Bridge, Vm};
use moor_node::crash_points::{HELD, HOLD_ENV, ROTATE_POINTS};
use moor_privileged::{Sandbox, runtime};
use moor_proto::csi::v1 as csi;
use moor_proto::csi::v1::controller_client::ControllerClient;
use moor_proto::csi::v1::node_client::NodeClient;
use moor_proto::keys::v1::controller_keys_client::ControllerKeysClient;
use moor_proto::keys::v1::node_keys_client::NodeKeysClient;
use moor_proto::keys::v1::{
    BeginVolumeKeyRotationRequest, FinishVolumeKeyRotationRequest, RotateVolumeKeyRequest,
    VolumeKeys,
};
use moor_runtime::contract::DEVICE_SERIAL_KEY;
use moor_runtime::keys::{Dek, Kek, WrappedDek, secret_entries};
use tonic::transport::Channel;

const TEST: &str = "vm_powercut_rotation";
const MIB: u64 = 1 << 20;
const KEK: [u8; 32] = [0x42; 32];
const NODE: &str = "node-c";
const STATE_SERIAL: &str = "pcr-state";
const VOLUME_SERIAL: &str = "pcr-vol";
/// moor-node's state dir, on the state disk.
const STATE_DIR: &str = "/run/state/moor";
/// The crash-points build of moor-node (`.ci/test` builds it).
const CRASH_NODE: &str = "moor-node-crash-points";
/// The quick mode's cuts: where the old key (spare slot) and the new key (volume's slot) are
/// both in the header, the first (the new key written, not yet recorded) and the last (recorded
/// and verified, the old slot about to go). `rotate.verify`, between them, leaves the same
/// header; the full mode cuts there too.
const BOTH_KEYS: &[&str] = &["rotate.record", "rotate.kill_spare"];
/// How long a step that waits for the guest may take (TCG on a loaded machine is slow).
const DEADLINE: Duration = Duration::from_secs(300);

fn secrets() -> HashMap<String, String> {
    secret_entries("lab-kek", &KEK).into_iter().collect()
}

/// The QEMU arguments: the state disk (an empty ext4, made here) and the volume's file, each a
/// virtio disk with its serial.
fn disks(state: &Path, volume: &str) -> Vec<String> {
    std::fs::File::create(state)
        .and_then(|f| f.set_len(64 * MIB))
        .expect("the state disk's file");
    let out = std::process::Command::new("mkfs.ext4")
        .args(["-q", "-F"])
        .arg(state)
        .output()
        .expect("mkfs.ext4");
    assert!(out.status.success(), "mkfs.ext4 of the state disk: {out:?}");
    let mut opts = Vec::new();
    for (k, (file, serial)) in [
        (state.display().to_string(), STATE_SERIAL),
        (volume.to_string(), VOLUME_SERIAL),
    ]
    .into_iter()
    .enumerate()
    {
        opts.push("-drive".into());
        opts.push(format!(
            "file={file},if=none,id=pcr{k},format=raw,cache=unsafe"
        ));
        opts.push("-device".into());
        opts.push(format!("virtio-blk-pci,drive=pcr{k},serial={serial}"));
    }
    opts
}

/// What a cut found in the header before anything opened it.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Opens {
    old: bool,
    new: bool,
}

/// The test's world: the controller, the guest and what it knows of them.
struct World<'a> {
    sb: &'a Sandbox,
    vm: &'a mut Vm,
    ctl: ControllerClient<Channel>,
    keys: ControllerKeysClient<Channel>,
    volume: csi::Volume,
    kek: Kek,
    staging: PathBuf,
    target: PathBuf,
    log: PathBuf,
    /// Where this moor-node's log starts in the log file.
    log_from: usize,
    /// Per rotation, the last line its writer noted as synced.
    synced: Vec<u64>,
}

impl World<'_> {
    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// This moor-node's part of the log.
    fn this_boot(&self) -> String {
        self.log_text()
            .get(self.log_from..)
            .unwrap_or_default()
            .to_string()
    }

    fn note(&self, round: usize) -> PathBuf {
        self.sb.state.join(format!("synced-{round}"))
    }

    fn lines_file(&self, round: usize) -> String {
        self.target
            .join(format!("lines-{round}"))
            .display()
            .to_string()
    }

    /// The last number the writer of `round` noted (its last whole line).
    fn noted(&self, round: usize) -> u64 {
        let text = std::fs::read_to_string(self.note(round)).unwrap_or_default();
        text.split_terminator('\n')
            .rfind(|l| !l.is_empty())
            .filter(|_| text.ends_with('\n'))
            .and_then(|l| l.parse().ok())
            .unwrap_or(0)
    }

    /// The volume's disk in the guest, found by its serial.
    fn device(&self) -> String {
        self.vm
            .sh(&format!(
                "for d in /sys/block/vd*; do [ \"$(cat $d/serial)\" = {VOLUME_SERIAL} ] && \
                 echo /dev/${{d##*/}}; done; true"
            ))
            .trim()
            .to_string()
    }

    /// After a boot: the modules (moor-node's kernel RBD attacher wants rbd loaded), the state
    /// disk mounted (ext4 recovers its journal).
    fn mount_state(&self) {
        self.vm.sh(&format!(
            "modprobe -a loop ext4 rbd dm_crypt && for d in /sys/block/vd*; do \
             [ \"$(cat $d/serial)\" = {STATE_SERIAL} ] && dev=/dev/${{d##*/}}; done; \
             mkdir -p /run/state && mount \"$dev\" /run/state && mkdir -p {STATE_DIR}"
        ));
    }

    /// moor-node (the crash-points build) started on the state disk, held at `hold` if given;
    /// a moor-node already running is killed first (a process death between rotations: the
    /// volume stays staged and published).
    async fn start_node(&mut self, hold: Option<&str>) -> NodeClient<Channel> {
        // `[m]`: the pattern does not match this shell's own command line.
        let pattern = format!("[{}]{}", &CRASH_NODE[..1], &CRASH_NODE[1..]);
        self.vm.sh(&format!(
            "pkill -KILL -f '{pattern}'; while pgrep -f '{pattern}' >/dev/null; do \
             sleep 0.1; done; true"
        ));
        self.log_from = self.log_text().len();
        let env = hold.map(|p| format!("{HOLD_ENV}={p}"));
        let env: Vec<&str> = env.iter().map(String::as_str).collect();
        start_node_in(
            self.vm,
            NODE,
            &self.sb.kubelet,
            CRASH_NODE,
            &env,
            Path::new(STATE_DIR),
            &self.log,
        )
        .await
    }

    /// The controller record's keys, as ControllerPublishVolume gives them to a stage.
    async fn record_keys(&mut self) -> HashMap<String, String> {
        moor_lab::vm::embedded_record_keys(&mut self.ctl, &self.volume, NODE, ext4()).await
    }

    /// kubelet's stage and publish after a reboot, each retried until it succeeds: the
    /// publish_context the controller's record gives now, the disk by its serial.
    async fn stage_and_publish(&mut self, node: &mut NodeClient<Channel>, what: &str) {
        let mut publish_context = self.record_keys().await;
        publish_context.insert(DEVICE_SERIAL_KEY.into(), VOLUME_SERIAL.into());
        let stage = csi::NodeStageVolumeRequest {
            volume_id: self.volume.volume_id.clone(),
            publish_context,
            staging_target_path: self.staging.display().to_string(),
            volume_capability: Some(ext4()),
            secrets: secrets(),
            volume_context: self.volume.volume_context.clone(),
        };
        let published = publish(&self.volume.volume_id, &self.staging, &self.target, ext4());
        let start = Instant::now();
        loop {
            let r = match node.node_stage_volume(stage.clone()).await {
                Ok(_) => node.node_publish_volume(published.clone()).await.map(drop),
                Err(e) => Err(e),
            };
            let Err(e) = r else { return };
            assert!(
                start.elapsed() < DEADLINE,
                "{what}: the stage and publish did not succeed within {DEADLINE:?}: {e:?}\n{}",
                self.this_boot()
            );
            eprintln!("{TEST}: {what}: stage and publish: {e:?}; retried");
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    fn unwrap(&self, text: &str) -> Dek {
        self.kek
            .unwrap(
                &WrappedDek::decode(text).expect("a wrapped key"),
                &self.volume.volume_id,
            )
            .expect("the KEK unwraps the record's key")
    }

    /// Whether `key` opens a slot of the LUKS header on `dev` in the guest (the key as octal
    /// escapes on cryptsetup's stdin: it reaches no file or log).
    fn opens(&self, dev: &str, key: &Dek) -> bool {
        let escaped: String = key.expose().iter().map(|b| format!("\\{b:03o}")).collect();
        self.vm
            .sh(&format!(
                "printf '{escaped}' | cryptsetup open --test-passphrase --key-file=- {dev}; \
                 echo rc=$?"
            ))
            .contains("rc=0")
    }

    /// A rotation's three steps run to their end (a rotation cut short resumes), as `moorctl
    /// rotate-key --controller` runs them; the node's steps.
    async fn rotate(&mut self, node: &VolumeKeys, what: &str) -> Vec<String> {
        let begun = self.begin().await;
        assert_eq!(
            (&begun.current_wrapped_dek, &begun.pending_wrapped_dek),
            (&node.current_wrapped_dek, &node.pending_wrapped_dek),
            "{what}: Begin run again answers the rotation the record holds"
        );
        let mut keys = NodeKeysClient::new(self.vm.channel(SOCKET).await.expect("node socket"));
        let steps = keys
            .rotate_volume_key(rotate_req(&self.volume.volume_id, &begun))
            .await
            .unwrap_or_else(|e| panic!("{what}: the resumed RotateVolumeKey: {e:?}"))
            .into_inner()
            .steps;
        self.keys
            .finish_volume_key_rotation(FinishVolumeKeyRotationRequest {
                volume_id: self.volume.volume_id.clone(),
                new_wrapped_dek: begun.pending_wrapped_dek.clone(),
            })
            .await
            .unwrap_or_else(|e| panic!("{what}: FinishVolumeKeyRotation: {e:?}"));
        steps
    }

    async fn begin(&mut self) -> VolumeKeys {
        self.keys
            .begin_volume_key_rotation(BeginVolumeKeyRotationRequest {
                volume_id: self.volume.volume_id.clone(),
                secrets: secrets(),
                if_rotations: None,
            })
            .await
            .expect("BeginVolumeKeyRotation")
            .into_inner()
    }

    /// The writer of `round`: each number appended and fsynced, then noted on the host.
    fn start_writer(&mut self, round: usize) {
        let script = format!(
            "i=0; while i=$((i+1)); echo line-$i | dd of={} oflag=append conv=notrunc,fsync \
             status=none; do echo $i >> {}; done",
            self.lines_file(round),
            self.note(round).display()
        );
        self.synced.push(0);
        self.vm.spawn(
            &["sh", "-c", &script],
            &self
                .sb
                .state
                .join(format!("writer-{round}.log"))
                .display()
                .to_string(),
        );
    }

    /// Waits until the writer of `round` noted `n` lines.
    async fn wait_noted(&self, round: usize, n: u64) {
        let start = Instant::now();
        while self.noted(round) < n {
            assert!(
                start.elapsed() < DEADLINE,
                "the writer of rotation {round} did not sync {n} lines within {DEADLINE:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// What must hold after a cut's rotation was finished: the record names one key, the
    /// header opens with it alone (one slot), every synced line is there, no error. Returns
    /// the lines checked.
    async fn check(&mut self, what: &str) -> u64 {
        let record = self.record_keys().await;
        assert_eq!(
            record.get("encryptedDEKPending"),
            None,
            "{what}: the rotation ended: no pending key in the record"
        );
        let current = self.unwrap(&record["encryptedDEK"]);
        let dev = self.device();
        let slots = self.vm.sh(&format!(
            "cryptsetup luksDump {dev} | grep -c ': luks2$'; true"
        ));
        assert_eq!(slots.trim(), "1", "{what}: one key slot in the header");
        assert!(
            self.opens(&dev, &current),
            "{what}: the record's current key opens the header"
        );
        let mut lines = 0;
        for (round, &synced) in self.synced.iter().enumerate() {
            let text = self.vm.read(&self.lines_file(round));
            let got: Vec<&str> = text.lines().collect();
            for k in 1..=synced {
                assert_eq!(
                    got.get(k as usize - 1).copied(),
                    Some(format!("line-{k}").as_str()),
                    "{what}: rotation {round}'s writer synced 1..={synced}, but line {k} of \
                     its file is not line-{k} ({} lines)",
                    got.len()
                );
            }
            lines += synced;
        }
        let boot = self.this_boot();
        let errors: Vec<&str> = boot
            .lines()
            .filter(|l| l.contains("\"level\":\"ERROR\"") || l.contains("journal line unreadable"))
            .collect();
        assert!(errors.is_empty(), "{what}: moor-node: {errors:#?}");
        lines
    }
}

fn rotate_req(volume: &str, keys: &VolumeKeys) -> RotateVolumeKeyRequest {
    RotateVolumeKeyRequest {
        volume_id: volume.into(),
        old_wrapped_dek: keys.current_wrapped_dek.clone(),
        new_wrapped_dek: keys.pending_wrapped_dek.clone(),
        luks_pbkdf: keys.luks_pbkdf.clone(),
        secrets: secrets(),
    }
}

#[test]
fn power_cuts_at_each_step_of_a_data_key_rotation_lose_nothing() {
    if !moor_lab::vm::available(TEST) {
        return;
    }
    let quick = std::env::var("MOOR_VM_POWERCUT_ROTATION_QUICK").as_deref() == Ok("1");
    let rounds: usize = std::env::var("MOOR_VM_POWERCUT_ROTATION_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    // The points named (a comma-separated list), to replay one cut.
    let named = std::env::var("MOOR_VM_POWERCUT_ROTATION_POINTS").unwrap_or_default();
    let named: Vec<&str> = ROTATE_POINTS
        .iter()
        .copied()
        .filter(|p| named.split(',').any(|n| n.trim() == *p))
        .collect();
    let (cuts, mode): (Vec<&str>, String) = if !named.is_empty() {
        (named, "the points named".into())
    } else if quick {
        (
            BOTH_KEYS.to_vec(),
            "quick: where both keys are in the header".into(),
        )
    } else {
        (
            (0..rounds)
                .flat_map(|_| ROTATE_POINTS.iter().copied())
                .collect(),
            format!("{rounds} rounds of every step"),
        )
    };
    eprintln!("{TEST}: {} cuts ({mode}): {cuts:?}", cuts.len());
    let started = Instant::now();
    let sb = Sandbox::new("vm-pcrot");
    let rt = runtime();
    let (mut controller, mut ctl) = rt.block_on(moor_lab::vm::start_embedded_controller(&sb, NODE));
    let volume = rt.block_on(moor_lab::vm::create_encrypted_volume(
        &mut ctl,
        "pvc-powercut-rotation",
        96,
        secrets(),
    ));
    let file = rt.block_on(moor_lab::vm::embedded_volume_file(
        &mut ctl,
        &volume,
        NODE,
        ext4(),
    ));
    let bridge = Bridge::new("mpcr", 243);
    let mut vm = Vm::boot_for_dm_crypt_with(
        "moor-pcrot",
        &bridge,
        &sb,
        "1G",
        disks(&sb.data.join("state.img"), &file),
    );
    let keys = rt.block_on(async {
        ControllerKeysClient::new(
            moor_runtime::client::connect(&sb.root.join("controller.sock"))
                .await
                .expect("the controller's socket"),
        )
    });
    let log = sb.state.join("node.log");
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let mut w = World {
            sb: &sb,
            vm: &mut vm,
            ctl,
            keys,
            staging: sb.staging("pv-pcr"),
            target: sb.target("pod-pcr", "pv-pcr"),
            volume,
            kek: Kek::new("lab-kek", &KEK).expect("kek"),
            log: log.clone(),
            log_from: 0,
            synced: Vec::new(),
        };
        rt.block_on(cuts_in_turn(&mut w, &cuts));
    }));
    vm.clear_volumes(&sb.kubelet);
    vm.exec(&["sh", "-c", "umount /run/state 2>/dev/null; true"]);
    rt.block_on(controller.stop());
    if let Err(e) = result {
        eprintln!(
            "{TEST}: moor-node's log:\n{}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        std::panic::resume_unwind(e);
    }
    eprintln!(
        "{TEST}: {} power cuts in {:.0} s",
        cuts.len(),
        started.elapsed().as_secs_f64()
    );
}

async fn cuts_in_turn(w: &mut World<'_>, cuts: &[&str]) {
    // The first boot: the volume made LUKS2 and ext4 at its first stage, published.
    w.mount_state();
    let mut node = w.start_node(None).await;
    w.stage_and_publish(&mut node, "the first stage").await;
    let mut seen = (0, 0, 0);
    let mut lines = 0;
    for (round, &point) in cuts.iter().enumerate() {
        let started = Instant::now();
        let what = format!("cut {round} at {point}");
        let node = w.start_node(Some(point)).await;
        drop(node);
        w.start_writer(round);
        w.wait_noted(round, 3).await;
        // The rotation, held at `point` on the node.
        let begun = w.begin().await;
        assert!(
            !begun.pending_wrapped_dek.is_empty(),
            "{what}: Begin: {begun:?}"
        );
        let (old, new) = (
            w.unwrap(&begun.current_wrapped_dek),
            w.unwrap(&begun.pending_wrapped_dek),
        );
        let channel = w.vm.channel(SOCKET).await.expect("node socket");
        let req = rotate_req(&w.volume.volume_id, &begun);
        let call =
            tokio::spawn(async move { NodeKeysClient::new(channel).rotate_volume_key(req).await });
        let held = format!("{HELD} {point}");
        let wait = Instant::now();
        while !w.this_boot().contains(&held) {
            if call.is_finished() {
                let r = call.await.expect("the rotation's task");
                panic!(
                    "{what}: the rotation ended before it reached {point}: {r:?}\n{}",
                    w.this_boot()
                );
            }
            assert!(
                wait.elapsed() < DEADLINE,
                "{what}: moor-node did not reach {point} within {DEADLINE:?}\n{}",
                w.this_boot()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        // The cut, at that step. What the writer noted is final once QEMU is dead.
        w.vm.kill();
        call.abort();
        let synced = w.noted(round);
        *w.synced.last_mut().expect("this round") = synced;
        w.vm.reboot();
        w.mount_state();
        let dev = w.device();
        let at_cut = Opens {
            old: w.opens(&dev, &old),
            new: w.opens(&dev, &new),
        };
        assert!(
            at_cut.old || at_cut.new,
            "{what}: neither the old nor the new key opens the header after the cut"
        );
        match (at_cut.old, at_cut.new) {
            (true, false) => seen.0 += 1,
            (true, true) => seen.1 += 1,
            _ => seen.2 += 1,
        }
        // The record at the cut: the old key current, the new one pending.
        let record = w.record_keys().await;
        assert_eq!(
            (
                record.get("encryptedDEK"),
                record.get("encryptedDEKPending")
            ),
            (
                Some(&begun.current_wrapped_dek),
                Some(&begun.pending_wrapped_dek)
            ),
            "{what}: the controller's record at the cut"
        );
        let mut node = w.start_node(None).await;
        w.stage_and_publish(&mut node, &what).await;
        let resumed = w.rotate(&begun, &what).await;
        let dev = w.device();
        assert!(
            !w.opens(&dev, &old),
            "{what}: the old key still opens the header after the rotation ended"
        );
        assert!(
            w.opens(&dev, &new),
            "{what}: the new key does not open the header after the rotation ended"
        );
        lines = w.check(&what).await;
        eprintln!(
            "{TEST}: {what}: the header at the cut opened with {at_cut:?}; synced {synced}; \
             resumed {resumed:?}; {lines} synced lines checked in {} files; {:.0} s",
            w.synced.len(),
            started.elapsed().as_secs_f64()
        );
    }
    eprintln!(
        "{TEST}: {} cuts: the header opened with the old key only at {}, both at {}, the new \
         only at {}, neither at none; {lines} synced lines all there",
        cuts.len(),
        seen.0,
        seen.1,
        seen.2
    );
}
