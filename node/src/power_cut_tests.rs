//! The power-cut model: after every step of a volume's life, every state of the journal a power
//! cut can leave (what was synced, plus each in-order prefix of the lines written after the
//! last sync) is restarted from on a node whose mounts are gone (a reboot), and kubelet's calls
//! after the reboot are replayed. The data the pod wrote survives every state, and the device
//! is formatted once in its whole life.

use std::path::Path;
use std::sync::Arc;

use crate::engine::{Engine, EngineConfig};
use crate::journal::{self, Journal, Phase};
use crate::reconcile::Reconciler;
use crate::service::NodeService;
use crate::service_tests::{DEV, K, KubeletCall, STAGING, TARGET, kubelet_call};
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

/// A node whose journal log holds `log`, with DEV of `size` bytes holding `data`, and no mounts.
fn boot(name: &str, log: &[u8], size: u64, data: &[(u64, Vec<u8>)]) -> World {
    let state = state_dir(name);
    std::fs::create_dir_all(&state).expect("state dir");
    std::fs::write(state.join(journal::LOG_FILE), log).expect("log");
    let os = Arc::new(FakeOs::new());
    os.add_dir(Path::new(STAGING).parent().unwrap_or(Path::new("/")));
    os.add_dir(Path::new(TARGET).parent().unwrap_or(Path::new("/")));
    os.add_device(DEV, (7, 7), size);
    for (offset, bytes) in data {
        os.write_device(DEV, *offset, bytes);
    }
    let (journal, problems) = Journal::open(&state, false).expect("journal");
    assert!(problems.is_empty(), "{name}: {problems:?}");
    let cfg = EngineConfig {
        kubelet_dir: K.into(),
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
    let node = boot("life", b"", size, &[]);
    let mut states = 0;
    for (i, step) in life.iter().enumerate() {
        node.run(*step, &mut size).await;
        let log = std::fs::read(node.state.join(journal::LOG_FILE)).expect("log");
        let synced = usize::try_from(node.engine.journal().durable_len()).expect("len");
        let data = node.os.device_data(DEV);
        let written = life.get(..=i).is_some_and(|s| s.contains(&Step::Write));
        for (j, state) in power_cut_states(&log, synced).into_iter().enumerate() {
            states += 1;
            let name = format!("after {step:?} #{i}, state {j}");
            // What replaying the state says of the volume: never "formatting" once mkfs has
            // finished (only that record lets a later call format a device with data).
            let replayed = journal::replay(state);
            let newest = replayed.records.get("vol-1").and_then(|r| r.stage.as_ref());
            assert!(
                newest.is_none_or(|s| s.phase != Phase::Formatting),
                "{name}: the newest durable record says formatting: {newest:?}"
            );
            // The reboot: no mounts, the journal as the power cut left it, the device as it
            // was (the pod's data was fsynced). Reconciliation, then kubelet stages and
            // publishes the volume for its pod again.
            let after = boot(&format!("cut-{i}-{j}"), state, size, &data);
            Reconciler::new(Arc::clone(&after.engine), "moor.csi.io")
                .run()
                .unwrap_or_else(|e| panic!("{name}: reconcile: {e}"));
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
    eprintln!("power-cut states replayed: {states}");
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
