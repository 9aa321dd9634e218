//! The power-cut model: after every step of a volume's life, every state of the journal a power
//! cut can leave (what was synced, plus each in-order prefix of the lines written after the
//! last sync) is restarted from on a node whose mounts are gone (a reboot), and kubelet's calls
//! after the reboot are replayed. The data the pod wrote survives every state, and the device
//! is formatted once in its whole life.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use moor_proto::csi::v1 as csi;
use moor_proto::csi::v1::node_server::Node as _;
use moor_proto::csi::v1::volume_capability::access_mode::Mode;
use tonic::{Code, Request};

use crate::engine::{Engine, EngineConfig};
use crate::journal::{self, Boot, Journal, Phase};
use crate::reconcile::Reconciler;
use crate::service::NodeService;
use crate::service_tests::{
    DEV, K, KubeletCall, STAGING, TARGET, ext4, kubelet_call, mount_cap, publish_req, stage_req,
    stats_req, unpublish_req,
};
use crate::sys::fake::{Call, FakeOs};

pub(crate) const GIB: u64 = 1 << 30;
/// Where the pod's data sits on the device (past the windows the blank proof reads).
pub(crate) const DATA_AT: u64 = 300 << 20;
/// What the pod writes there.
pub(crate) const DATA: &[u8] = b"written and fsynced by the pod";

/// A step of a volume's life, as kubelet and the pod take it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Step {
    Stage,
    Publish,
    Write,
    Expand,
    Unpublish,
    Unstage,
}

/// One node: a fake OS and a journal in a state dir of its own.
struct World {
    os: Arc<FakeOs>,
    engine: Arc<Engine<FakeOs>>,
    svc: NodeService<FakeOs>,
    state: std::path::PathBuf,
}

impl Drop for World {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.state);
    }
}

pub(crate) fn state_dir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("moor-power-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// The boot id of a node's life up to the power cut, and of its boot after the cut (the
/// kernel's `boot_id`, new at every boot).
pub(crate) const BEFORE: &str = "2f0c6a51-0d7e-4d8e-9a47-1b7f5c0e3a01";
pub(crate) const AFTER: &str = "8b3e9d24-6c1f-4a52-b0e8-5d9a7c2f4e02";

/// A node in boot `boot` whose journal log holds `log`, with DEV of `size` bytes holding
/// `data`, and no mounts.
fn boot(name: &str, boot: &str, log: &[u8], size: u64, data: &[(u64, Vec<u8>)]) -> World {
    boot_with(name, boot, log, size, data, 0)
}

/// [`boot`] with the journal's mark of what is synced as the cut left it beside the log.
fn boot_marked(name: &str, log: &[u8], mark: &[u8], size: u64, data: &[(u64, Vec<u8>)]) -> World {
    boot_in(name, AFTER, log, Some(mark), size, data, 0)
}

/// [`boot`] with `--max-volumes` at `max_volumes`, and DEV2 (blank) beside DEV.
fn boot_with(
    name: &str,
    boot: &str,
    log: &[u8],
    size: u64,
    data: &[(u64, Vec<u8>)],
    max_volumes: u64,
) -> World {
    boot_in(name, boot, log, None, size, data, max_volumes)
}

/// [`boot_with`], with the journal's `mark` of what is synced beside the log, if any.
fn boot_in(
    name: &str,
    boot: &str,
    log: &[u8],
    mark: Option<&[u8]>,
    size: u64,
    data: &[(u64, Vec<u8>)],
    max_volumes: u64,
) -> World {
    let state = state_dir(name);
    std::fs::create_dir_all(&state).expect("state dir");
    std::fs::write(state.join(journal::LOG_FILE), log).expect("log");
    if let Some(mark) = mark {
        std::fs::write(state.join(journal::SYNCED_FILE), mark).expect("mark");
    }
    let os = Arc::new(FakeOs::new());
    os.add_dir(Path::new(STAGING).parent().unwrap_or(Path::new("/")));
    os.add_dir(Path::new(TARGET).parent().unwrap_or(Path::new("/")));
    os.add_dir(Path::new(STAGING2).parent().unwrap_or(Path::new("/")));
    os.add_dir(Path::new(TARGET2).parent().unwrap_or(Path::new("/")));
    os.add_device(DEV, (7, 7), size);
    os.add_device(DEV2, (7, 8), GIB);
    for (offset, bytes) in data {
        os.write_device(DEV, *offset, bytes);
    }
    let (journal, problems) = Journal::open(&state, false).expect("journal");
    assert!(problems.is_empty(), "{name}: {problems:?}");
    let cfg = EngineConfig {
        kubelet_dir: K.into(),
        max_volumes,
        boot: Boot::new(Some(boot.into())),
        ..EngineConfig::default()
    };
    let engine = Arc::new(Engine::new(Arc::clone(&os), Arc::new(journal), cfg));
    let svc = NodeService::new(
        Arc::clone(&engine),
        crate::service_tests::harness().info.clone(),
    );
    World {
        os,
        engine,
        svc,
        state,
    }
}

pub(crate) fn mkfs_runs(os: &FakeOs) -> usize {
    os.calls()
        .iter()
        .filter(|c| matches!(c, Call::Tool(p, _) if p.starts_with("mkfs")))
        .count()
}

fn data_intact(os: &FakeOs) -> bool {
    os.device_data(DEV)
        .iter()
        .any(|(o, b)| *o == DATA_AT && b == DATA)
}

impl World {
    async fn run(&self, step: Step, size: &mut u64) {
        let call = match step {
            Step::Write => {
                self.os.write_device(DEV, DATA_AT, DATA);
                return;
            }
            Step::Expand => {
                *size += GIB;
                self.os.resize_device(DEV, *size);
                KubeletCall::Expand
            }
            Step::Stage => KubeletCall::Stage,
            Step::Publish => KubeletCall::Publish,
            Step::Unpublish => KubeletCall::Unpublish,
            Step::Unstage => KubeletCall::Unstage,
        };
        kubelet_call(&self.svc, call)
            .await
            .unwrap_or_else(|e| panic!("{step:?}: {e:?}"));
    }
}

/// The states a power cut can leave of a log whose first `synced` bytes are on disk: the
/// synced prefix, and each in-order prefix of the lines after it, whole or cut in the middle
/// of its last line (a filesystem keeps an unsynced append up to any block: the block-level
/// replay on a real kernel, `lab/tests/vm_crash.rs`, found a log ending mid-line).
/// The states a power cut can leave when it writes the unsynced pages back out of order: the
/// whole log with one line after the first `synced` bytes torn in its middle (a hole of
/// zeros, as the VM lab's real cut left it), and every line after it whole.
pub(crate) fn torn_middle_states(log: &[u8], synced: usize) -> Vec<Vec<u8>> {
    let mut starts = vec![synced];
    for (i, b) in log.iter().enumerate().skip(synced) {
        if *b == b'\n' {
            starts.push(i + 1);
        }
    }
    starts
        .windows(2)
        .filter(|w| w[1] < log.len())
        .map(|w| {
            let mut torn = log.to_vec();
            let middle = w[0] + (w[1] - w[0]) / 2;
            if let Some(hole) = torn.get_mut(middle.saturating_sub(8)..middle) {
                hole.fill(0);
            }
            torn
        })
        .collect()
}

pub(crate) fn power_cut_states(log: &[u8], synced: usize) -> Vec<&[u8]> {
    let mut states = vec![log.get(..synced).unwrap_or(log)];
    let mut start = synced;
    for (i, b) in log.iter().enumerate().skip(synced) {
        if *b == b'\n' {
            let middle = start + (i + 1 - start) / 2;
            if middle > start && middle < i + 1 {
                states.push(log.get(..middle).unwrap_or(log));
            }
            start = i + 1;
            states.push(log.get(..start).unwrap_or(log));
        }
    }
    debug_assert!(start == log.len() || synced >= log.len());
    states
}

/// A volume's life: stage, publish, write, grow, unpublish, unstage, and again.
pub(crate) const LIFE: [Step; 10] = [
    Step::Stage,
    Step::Publish,
    Step::Write,
    Step::Expand,
    Step::Unpublish,
    Step::Unstage,
    Step::Stage,
    Step::Publish,
    Step::Unpublish,
    Step::Unstage,
];

#[tokio::test]
async fn every_state_a_power_cut_leaves_keeps_the_data_and_formats_once() {
    let life = LIFE;
    let mut size = GIB;
    let node = boot("life", BEFORE, b"", size, &[]);
    let (mut states, mut torn_states) = (0, 0);
    for (i, step) in life.iter().enumerate() {
        node.run(*step, &mut size).await;
        let log = std::fs::read(node.state.join(journal::LOG_FILE)).expect("log");
        let synced = usize::try_from(node.engine.journal().durable_len()).expect("len");
        let mark = std::fs::read(node.state.join(journal::SYNCED_FILE)).expect("mark");
        let data = node.os.device_data(DEV);
        let written = life.get(..=i).is_some_and(|s| s.contains(&Step::Write));
        let in_order = power_cut_states(&log, synced)
            .into_iter()
            .map(<[u8]>::to_vec);
        let torn = torn_middle_states(&log, synced);
        torn_states += torn.len();
        for (j, state) in in_order.chain(torn).enumerate() {
            let state = state.as_slice();
            states += 1;
            let name = format!("after {step:?} #{i}, state {j}");
            // What replaying the state says of the volume: never "formatting" once mkfs has
            // finished (only that record lets a later call format a device with data).
            let durable = journal::SyncedMark::decode(&mark).and_then(|m| m.durable_in(state));
            let replayed = journal::replay_after_sync(state, durable);
            let newest = replayed.records.get("vol-1").and_then(|r| r.stage.as_ref());
            assert!(
                newest.is_none_or(|s| s.phase != Phase::Formatting),
                "{name}: the newest durable record says formatting: {newest:?}"
            );
            // The reboot: no mounts, the journal as the power cut left it, the device as it
            // was (the pod's data was fsynced). Reconciliation, then kubelet stages and
            // publishes the volume for its pod again.
            let after = boot_marked(&format!("cut-{i}-{j}"), state, &mark, size, &data);
            Reconciler::new(Arc::clone(&after.engine), "moor.csi.io")
                .run()
                .unwrap_or_else(|e| panic!("{name}: reconcile: {e}"));
            // The reboot ended every mount: until kubelet stages the volume again, nothing of
            // it is reported, whatever the journal remembers.
            for path in [STAGING, TARGET] {
                assert_eq!(
                    after.stats_code("vol-1", path).await,
                    Code::NotFound,
                    "{name}: stats at {path}"
                );
            }
            let mut s = size;
            after.run(Step::Stage, &mut s).await;
            after.run(Step::Publish, &mut s).await;
            assert_eq!(mkfs_runs(&after.os), 0, "{name}: formatted again");
            assert_eq!(data_intact(&after.os), written, "{name}: the pod's data");
            assert_eq!(after.os.mount_depth(STAGING), 1, "{name}");
            assert_eq!(after.os.mount_depth(TARGET), 1, "{name}");
            // And the volume's life goes on from there.
            after.run(Step::Unpublish, &mut s).await;
            after.run(Step::Unstage, &mut s).await;
            assert_eq!(after.os.mount_depth(STAGING), 0, "{name}");
        }
    }
    assert_eq!(mkfs_runs(&node.os), 1, "one mkfs in the whole life");
    assert!(data_intact(&node.os));
    assert!(torn_states > 0, "no unsynced line was torn in the middle");
    eprintln!("power-cut states replayed: {states} ({torn_states} torn in the middle)");
}

#[test]
fn the_states_of_a_log_are_its_synced_prefix_and_each_later_line_whole_or_cut() {
    let log = b"a\nbb\nccc\n";
    assert_eq!(
        power_cut_states(log, 2),
        vec![
            &b"a\n"[..],
            &b"a\nb"[..],
            &b"a\nbb\n"[..],
            &b"a\nbb\ncc"[..],
            &b"a\nbb\nccc\n"[..]
        ]
    );
    assert_eq!(power_cut_states(log, 9), vec![&b"a\nbb\nccc\n"[..]]);
    assert_eq!(power_cut_states(log, 0).len(), 7);
}

/// Another pod's target of the volume, and another volume with its device and staging path.
const TARGET2: &str = "/var/lib/kubelet/pods/p2/volumes/kubernetes.io~csi/pv1/mount";
const DEV2: &str = "/dev/loop8";
const STAGING2: &str = "/var/lib/kubelet/plugins/kubernetes.io/csi/moor.csi.io/def/globalmount";

/// The log a node (taking `max_volumes`) wrote through `steps` of the volume's life, how much
/// of it is synced, and the device's data at the end.
async fn lived(
    name: &str,
    steps: &[Step],
    max_volumes: u64,
) -> (Vec<u8>, usize, Vec<(u64, Vec<u8>)>) {
    let node = boot_with(name, BEFORE, b"", GIB, &[], max_volumes);
    let mut size = GIB;
    for step in steps {
        node.run(*step, &mut size).await;
    }
    let log = std::fs::read(node.state.join(journal::LOG_FILE)).expect("log");
    let synced = usize::try_from(node.engine.journal().durable_len()).expect("len");
    (log, synced, node.os.device_data(DEV))
}

/// The node booted after the cut on the journal `state` (a GiB DEV holding `data`), taking
/// `max_volumes`; `reconciled`: with the pass moor-node runs at start before it serves, else
/// straight to kubelet's calls (which must hold to the same rules by themselves).
fn rebooted(
    name: &str,
    state: &[u8],
    data: &[(u64, Vec<u8>)],
    max_volumes: u64,
    reconciled: bool,
) -> World {
    let after = boot_with(
        &format!("{name}-{reconciled}"),
        AFTER,
        state,
        GIB,
        data,
        max_volumes,
    );
    if reconciled {
        Reconciler::new(Arc::clone(&after.engine), "moor.csi.io")
            .run()
            .unwrap_or_else(|e| panic!("{name}: reconcile: {e}"));
    }
    after
}

impl World {
    async fn stage_as(&self, cap: csi::VolumeCapability) -> Result<(), tonic::Status> {
        self.svc
            .node_stage_volume(Request::new(stage_req(cap)))
            .await
            .map(drop)
    }

    async fn publish_at(&self, target: &str, cap: csi::VolumeCapability) -> Result<(), Code> {
        let mut req = publish_req(cap, false);
        req.target_path = target.into();
        self.svc
            .node_publish_volume(Request::new(req))
            .await
            .map(drop)
            .map_err(|e| e.code())
    }

    async fn stats_code(&self, volume: &str, path: &str) -> Code {
        let mut req = stats_req(path);
        req.volume_id = volume.into();
        match self.svc.node_get_volume_stats(Request::new(req)).await {
            Ok(_) => Code::Ok,
            Err(e) => e.code(),
        }
    }

    /// NodeStageVolume of the other volume, vol-2, on DEV2 at STAGING2.
    async fn stage_other(&self) -> Result<(), Code> {
        let mut req = stage_req(ext4());
        req.volume_id = "vol-2".into();
        req.staging_target_path = STAGING2.into();
        req.publish_context = HashMap::from([("devicePath".into(), DEV2.into())]);
        self.svc
            .node_stage_volume(Request::new(req))
            .await
            .map(drop)
            .map_err(|e| e.code())
    }
}

/// The life: a single-writer volume published for a pod, the pod deleted (its
/// unpublish answered OK), the node's power cut before the journal's next sync. After the
/// reboot the pod that replaced it asks for the volume at its own target: kubelet stages the
/// volume again and publishes it there. Whatever the cut left of the log, the new target is
/// served (the ended publication was a memory, not a claim), NodeGetVolumeStats does not
/// report the ended one, and nothing formats or loses the data. With a reconciliation before
/// kubelet's calls (as moor-node starts) and without one (the calls' own rule).
#[tokio::test]
async fn a_publication_ended_before_a_power_cut_blocks_no_other_target_after_it() {
    let mut states = 0;
    for mode in [Mode::SingleNodeWriter, Mode::SingleNodeSingleWriter] {
        let cap = || mount_cap("ext4", &[], mode);
        let node = boot_with(&format!("ended-publish-{mode:?}"), BEFORE, b"", GIB, &[], 0);
        node.stage_as(cap()).await.expect("stage");
        node.publish_at(TARGET, cap()).await.expect("publish");
        node.os.write_device(DEV, DATA_AT, DATA);
        node.svc
            .node_unpublish_volume(Request::new(unpublish_req(TARGET)))
            .await
            .expect("unpublish");
        let log = std::fs::read(node.state.join(journal::LOG_FILE)).expect("log");
        let synced = usize::try_from(node.engine.journal().durable_len()).expect("len");
        let data = node.os.device_data(DEV);
        for (j, state) in power_cut_states(&log, synced).into_iter().enumerate() {
            for reconciled in [true, false] {
                states += 1;
                let name = format!("{mode:?}, state {j}, reconciled first: {reconciled}");
                let after = rebooted(&format!("ended-{mode:?}-{j}"), state, &data, 0, reconciled);
                after
                    .stage_as(cap())
                    .await
                    .unwrap_or_else(|e| panic!("{name}: stage: {e:?}"));
                assert_eq!(
                    after.publish_at(TARGET2, cap()).await,
                    Ok(()),
                    "{name}: the new pod's target"
                );
                assert_eq!(after.os.mount_depth(TARGET2), 1, "{name}");
                assert_eq!(after.os.mount_depth(TARGET), 0, "{name}");
                assert_eq!(
                    after.stats_code("vol-1", TARGET).await,
                    Code::NotFound,
                    "{name}: stats of the ended publication"
                );
                assert_eq!(mkfs_runs(&after.os), 0, "{name}: formatted again");
                assert!(data_intact(&after.os), "{name}: the pod's data");
                // The one target now held: a second one is refused again.
                assert_eq!(
                    after.publish_at(TARGET, cap()).await,
                    Err(Code::FailedPrecondition),
                    "{name}: a second target beside the new pod's"
                );
            }
        }
    }
    eprintln!("power-cut states of an ended publication replayed: {states}");
}

/// The same for a staging, on a node that takes one volume (`--max-volumes 1`): the volume
/// staged, published, unpublished and unstaged (answered OK), the power cut. After the reboot
/// another volume is staged: never RESOURCE_EXHAUSTED for the volume the node no longer holds,
/// and NodeGetVolumeStats does not report it. And a staging kubelet still holds when the power
/// is cut (its life cut after the stage) is staged again after the reboot, as kubelet does
/// for its pods still on the node, and then holds the node's one place.
#[tokio::test]
async fn a_staging_ended_before_a_power_cut_takes_no_place_after_it() {
    let mut states = 0;
    let lives: [&[Step]; 2] = [
        &[
            Step::Stage,
            Step::Publish,
            Step::Write,
            Step::Unpublish,
            Step::Unstage,
        ],
        &[Step::Stage, Step::Publish, Step::Write],
    ];
    for (l, life) in lives.iter().enumerate() {
        let ended = life.last() == Some(&Step::Unstage);
        let (log, synced, data) = lived(&format!("staging-{l}"), life, 1).await;
        for (j, state) in power_cut_states(&log, synced).into_iter().enumerate() {
            for reconciled in [true, false] {
                states += 1;
                let name = format!("life {l}, state {j}, reconciled first: {reconciled}");
                let after = rebooted(&format!("staging-{l}-{j}"), state, &data, 1, reconciled);
                if ended {
                    assert_eq!(
                        after.stats_code("vol-1", STAGING).await,
                        Code::NotFound,
                        "{name}: stats of the ended staging"
                    );
                    assert_eq!(after.stage_other().await, Ok(()), "{name}: another volume");
                    assert_eq!(after.os.mount_depth(STAGING2), 1, "{name}");
                    assert_eq!(after.os.mount_depth(STAGING), 0, "{name}");
                } else {
                    let mut s = GIB;
                    after.run(Step::Stage, &mut s).await;
                    after.run(Step::Publish, &mut s).await;
                    assert_eq!(after.os.mount_depth(TARGET), 1, "{name}");
                    assert_eq!(
                        after.stage_other().await,
                        Err(Code::ResourceExhausted),
                        "{name}: a second volume beside the one staged again"
                    );
                }
                // vol-2's blank device is formatted for it; vol-1's never again.
                assert_eq!(
                    mkfs_runs(&after.os),
                    usize::from(ended),
                    "{name}: formatted again"
                );
                assert!(data_intact(&after.os), "{name}: the pod's data");
            }
        }
    }
    eprintln!("power-cut states of an ended staging replayed: {states}");
}
