//! The power-cut model over an RBD volume's life (`power_cut_tests` for the plain one): after
//! every step (the stage maps, formats and mounts; the unstage unmounts and unmaps), every
//! state of the journal a power cut can leave is restarted from on a node where nothing is
//! mounted and nothing is mapped (a reboot ends every rbd-fuse, loop device and kernel
//! mapping; the image and what the pod fsynced to it stay in the cluster). Reconciliation
//! runs, then kubelet's stage and publish, and then its unpublish and unstage. Throughout:
//! reconciliation maps nothing and leaves no record of a mapping that nothing uses; the stage
//! maps the image once, on a device the journal names, never a second time; the data is
//! intact and the image is formatted once in its whole life; the unstage unmaps it and the
//! journal forgets it. Each state is replayed twice: with the devices numbered as before the
//! reboot, and shifted by one (so a record's old device number may or may not be the new
//! mapping's).

use std::path::Path;
use std::sync::Arc;

use moor_proto::csi::v1::node_server::Node as _;
use tonic::{Code, Request};

use crate::attach::Attacher;
use crate::attach::fake::{AttachCall, FakeAttacher};
use crate::engine::{Engine, EngineConfig};
use crate::journal::{self, Boot, Journal, Phase};
use crate::power_cut_tests::{
    AFTER, BEFORE, DATA, DATA_AT, GIB, LIFE, Step, mkfs_runs, power_cut_states, state_dir,
};
use crate::reconcile::Reconciler;
use crate::service::NodeService;
use crate::service_tests::rbd::{check_mapping, image, rbd_kubelet_call};
use crate::service_tests::{K, KubeletCall, STAGING, TARGET, stats_req};
use crate::sys::fake::FakeOs;

/// One node: a fake OS, the fake attacher over it, and a journal in a state dir of its own.
struct Node {
    os: Arc<FakeOs>,
    attacher: Arc<FakeAttacher>,
    engine: Arc<Engine<FakeOs>>,
    svc: NodeService<FakeOs>,
    state: std::path::PathBuf,
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.state);
    }
}

/// A node just booted (boot id `boot`): its journal log holds `log`, nothing is mounted or
/// mapped, and the image is `size` bytes holding `data`; its devices are numbered from `skip`
/// on.
fn boot(
    name: &str,
    boot: &str,
    log: &[u8],
    size: u64,
    data: Vec<(u64, Vec<u8>)>,
    skip: u32,
) -> Node {
    let state = state_dir(&format!("rbd-{name}"));
    std::fs::create_dir_all(&state).expect("state dir");
    std::fs::write(state.join(journal::LOG_FILE), log).expect("log");
    let os = Arc::new(FakeOs::new());
    os.add_dir(Path::new(STAGING).parent().unwrap_or(Path::new("/")));
    os.add_dir(Path::new(TARGET).parent().unwrap_or(Path::new("/")));
    let attacher = Arc::new(FakeAttacher::new(Arc::clone(&os), GIB));
    attacher.grow(&image(), size);
    attacher.restore(&image(), data);
    attacher.skip_devices(skip);
    let (journal, problems) = Journal::open(&state, false).expect("journal");
    assert!(problems.is_empty(), "{name}: {problems:?}");
    let cfg = EngineConfig {
        kubelet_dir: K.into(),
        boot: Boot::new(Some(boot.into())),
        ..EngineConfig::default()
    };
    let engine = Arc::new(
        Engine::new(Arc::clone(&os), Arc::new(journal), cfg)
            .with_attacher(Some(Arc::clone(&attacher) as Arc<dyn Attacher>)),
    );
    let svc = NodeService::new(
        Arc::clone(&engine),
        crate::service_tests::harness().info.clone(),
    );
    Node {
        os,
        attacher,
        engine,
        svc,
        state,
    }
}

fn maps(a: &FakeAttacher) -> usize {
    a.calls()
        .iter()
        .filter(|c| matches!(c, AttachCall::Map(..)))
        .count()
}

impl Node {
    async fn run(&self, step: Step, size: &mut u64) {
        let call = match step {
            Step::Write => {
                let m = self.attacher.mapping_of(&image()).expect("mapped");
                self.os.write_device(&m.device, DATA_AT, DATA);
                return;
            }
            Step::Expand => {
                // The controller grows the image; the node's expansion refreshes the device.
                *size += GIB;
                self.attacher.grow(&image(), *size);
                KubeletCall::Expand
            }
            Step::Stage => KubeletCall::Stage,
            Step::Publish => KubeletCall::Publish,
            Step::Unpublish => KubeletCall::Unpublish,
            Step::Unstage => KubeletCall::Unstage,
        };
        rbd_kubelet_call(&self.svc, call)
            .await
            .unwrap_or_else(|e| panic!("{step:?}: {e:?}"));
    }

    fn data_intact(&self) -> bool {
        self.attacher
            .image_data(&image())
            .iter()
            .any(|(o, b)| *o == DATA_AT && b == DATA)
    }

    fn check_mappings(&self, name: &str, mapped: bool) {
        check_mapping(&self.engine, &self.attacher, name, mapped);
    }
}

/// Reconciliation at start on a node where nothing is mapped: it maps nothing, and a record
/// of a mapping is left only on a volume something still uses (staged or published: kubelet's
/// stage maps it again); a record of a mapping nothing uses is cleared.
fn check_reconciled(node: &Node, name: &str) {
    assert_eq!(maps(&node.attacher), 0, "{name}: reconciliation mapped");
    assert!(node.attacher.mapped().is_empty(), "{name}");
    for r in node.engine.journal().all() {
        if let Some(m) = &r.mapping {
            assert!(
                r.stage.is_some() || !r.publishes.is_empty(),
                "{name}: a record of a mapping nothing uses and the node does not have: {m:?}"
            );
        }
    }
}

#[tokio::test]
async fn every_state_a_power_cut_leaves_of_an_rbd_volume_maps_it_once_and_keeps_its_data() {
    let life = LIFE;
    let mut size = GIB;
    let node = boot("life", BEFORE, b"", size, Vec::new(), 0);
    let mut mapped = false;
    let mut states = 0;
    for (i, step) in life.iter().enumerate() {
        node.run(*step, &mut size).await;
        mapped = match step {
            Step::Stage => true,
            Step::Unstage => false,
            _ => mapped,
        };
        node.check_mappings(&format!("{step:?} #{i}"), mapped);
        let log = std::fs::read(node.state.join(journal::LOG_FILE)).expect("log");
        let synced = usize::try_from(node.engine.journal().durable_len()).expect("len");
        let data = node.attacher.image_data(&image());
        let written = life.get(..=i).is_some_and(|s| s.contains(&Step::Write));
        for (j, state) in power_cut_states(&log, synced).into_iter().enumerate() {
            // Never "formatting" once mkfs has finished: only that record lets a stage format
            // an image that is no longer blank.
            let newest = journal::replay(state)
                .records
                .remove("vol-1")
                .and_then(|r| r.stage);
            assert!(
                newest.as_ref().is_none_or(|s| s.phase != Phase::Formatting),
                "after {step:?} #{i}, state {j}: the newest durable record says formatting: \
                 {newest:?}"
            );
            for skip in [0, 1] {
                states += 1;
                let name = format!("after {step:?} #{i}, state {j}, devices +{skip}");
                let after = boot(
                    &format!("cut-{i}-{j}-{skip}"),
                    AFTER,
                    state,
                    size,
                    data.clone(),
                    skip,
                );
                Reconciler::new(Arc::clone(&after.engine), "moor.csi.io")
                    .run()
                    .unwrap_or_else(|e| panic!("{name}: reconcile: {e}"));
                check_reconciled(&after, &name);
                // The reboot ended every mount and mapping: until kubelet stages the volume
                // again, nothing of it is reported, whatever the journal remembers.
                for path in [STAGING, TARGET] {
                    let stats = after
                        .svc
                        .node_get_volume_stats(Request::new(stats_req(path)))
                        .await;
                    assert_eq!(
                        stats.map(drop).map_err(|e| e.code()),
                        Err(Code::NotFound),
                        "{name}: stats at {path}"
                    );
                }
                let mut s = size;
                after.run(Step::Stage, &mut s).await;
                after.run(Step::Publish, &mut s).await;
                assert_eq!(maps(&after.attacher), 1, "{name}: maps");
                after.check_mappings(&name, true);
                assert_eq!(mkfs_runs(&after.os), 0, "{name}: formatted again");
                assert_eq!(after.data_intact(), written, "{name}: the pod's data");
                assert_eq!(after.os.mount_depth(STAGING), 1, "{name}");
                assert_eq!(after.os.mount_depth(TARGET), 1, "{name}");
                // And the volume's life goes on from there.
                after.run(Step::Unpublish, &mut s).await;
                after.run(Step::Unstage, &mut s).await;
                assert_eq!(after.os.mount_depth(STAGING), 0, "{name}");
                after.check_mappings(&name, false);
                assert!(
                    after.engine.journal().get("vol-1").is_none(),
                    "{name}: the journal still holds the volume"
                );
                assert_eq!(after.data_intact(), written, "{name}: the pod's data");
            }
        }
    }
    assert_eq!(mkfs_runs(&node.os), 1, "one mkfs in the whole life");
    assert!(node.data_intact());
    assert_eq!(maps(&node.attacher), 2, "one map per stage");
    eprintln!("power-cut states of an RBD volume replayed: {states}");
}
