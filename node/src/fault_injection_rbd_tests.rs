//! Fault injection over an RBD volume's life (`fault_injection_tests` for the plain one): the
//! k-th OS call failing with each errno of that suite, and the k-th call of the attacher's own
//! steps (find, map, unmap, verify, refresh, list) failing, running past its deadline, or
//! finding the device busy, for every k. After each: no device with data is formatted, no
//! lazy detach, the failed call answers a code kubelet retries, and kubelet's retry brings the
//! node to what it should be, with nothing half-done: the image mapped exactly when the volume
//! is staged, once, on the device the journal records (no mapping leaked, no record of one
//! that is gone), and never a second mapping of it.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use crate::attach::Attacher;
use crate::attach::fake::{Failure, FakeAttacher};
use crate::engine::{Engine, EngineConfig};
use crate::fault_injection_tests::{ERRNOS, Faulty, retryable};
use crate::journal::Journal;
use crate::reconcile::Reconciler;
use crate::service::NodeService;
use crate::service_tests::rbd::{check_mapping, image, rbd_kubelet_call};
use crate::service_tests::{K, KubeletCall, STAGING, TARGET};
use crate::sys::Os as _;
use crate::sys::fake::FakeOs;

const GIB: u64 = 1 << 30;

/// A step of the life: one of kubelet's calls, or a reconciliation pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    Kubelet(KubeletCall),
    Reconcile,
}

/// What the node holds after a step: mounts on the staging path and the target, and whether
/// the image is mapped.
type Want = (usize, usize, bool);

/// An RBD volume's life (its image grown on the controller before the expansion; staged
/// again while staged, as a restarted kubelet does).
const LIFE: [(Step, Want); 14] = [
    (Step::Kubelet(KubeletCall::Stage), (1, 0, true)),
    (Step::Kubelet(KubeletCall::Publish), (1, 1, true)),
    (Step::Kubelet(KubeletCall::Stats), (1, 1, true)),
    (Step::Kubelet(KubeletCall::Expand), (1, 1, true)),
    (Step::Reconcile, (1, 1, true)),
    (Step::Kubelet(KubeletCall::Stage), (1, 1, true)),
    (Step::Kubelet(KubeletCall::Unpublish), (1, 0, true)),
    (Step::Kubelet(KubeletCall::Unstage), (0, 0, false)),
    (Step::Kubelet(KubeletCall::Stage), (1, 0, true)),
    (Step::Kubelet(KubeletCall::Publish), (1, 1, true)),
    (Step::Reconcile, (1, 1, true)),
    (Step::Kubelet(KubeletCall::Stats), (1, 1, true)),
    (Step::Kubelet(KubeletCall::Unpublish), (1, 0, true)),
    (Step::Kubelet(KubeletCall::Unstage), (0, 0, false)),
];

/// The faults: the k-th OS call failing with an errno, or the k-th attacher step failing.
#[derive(Debug, Clone, Copy)]
enum Fault {
    None,
    Os(usize, i32),
    Attacher(usize, Failure),
}

struct World {
    os: Arc<Faulty>,
    attacher: Arc<FakeAttacher>,
    engine: Arc<Engine<Faulty>>,
    svc: NodeService<Faulty>,
    state: std::path::PathBuf,
}

impl Drop for World {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.state);
    }
}

fn world(fault: Fault, tag: &str) -> World {
    let inner = Arc::new(FakeOs::new());
    inner.add_dir(Path::new(STAGING).parent().unwrap_or(Path::new("/")));
    inner.add_dir(Path::new(TARGET).parent().unwrap_or(Path::new("/")));
    let attacher = Arc::new(FakeAttacher::new(Arc::clone(&inner), GIB));
    let os = Arc::new(match fault {
        Fault::Os(k, errno) => Faulty::new(inner, k, errno),
        Fault::None | Fault::Attacher(..) => Faulty::new(inner, 0, 0),
    });
    if let Fault::Attacher(k, f) = fault {
        attacher.fail_step(k, f);
    }
    let state = crate::service_tests::scratch_root()
        .join(format!("moor-faults-rbd-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&state);
    let (journal, _) = Journal::open(&state, false).expect("journal");
    let cfg = EngineConfig {
        kubelet_dir: K.into(),
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
    World {
        os,
        attacher,
        engine,
        svc,
        state,
    }
}

impl World {
    /// One step; its gRPC code (OK for a reconciliation pass that logged its failure).
    async fn step(&self, step: Step) -> Result<(), tonic::Status> {
        match step {
            Step::Kubelet(call) => rbd_kubelet_call(&self.svc, call).await,
            Step::Reconcile => {
                let _ = Reconciler::new(Arc::clone(&self.engine), "moor.csi.io").run();
                Ok(())
            }
        }
    }

    fn held(&self) -> Want {
        (
            self.os.inner.mount_depth(STAGING),
            self.os.inner.mount_depth(TARGET),
            !self.attacher.mapped().is_empty(),
        )
    }

    fn check_mapping(&self, name: &str, mapped: bool) {
        check_mapping(&self.engine, &self.attacher, name, mapped);
    }
}

/// Runs the life under `fault`: every failure answers a retryable code, takes away nothing
/// it was not asked to, and kubelet's retry converges.
async fn life(fault: Fault, tag: &str) -> World {
    let w = world(fault, tag);
    for (i, (step, want)) in LIFE.into_iter().enumerate() {
        let name = format!("{fault:?}, step {i} {step:?}");
        if step == Step::Kubelet(KubeletCall::Expand) {
            // The controller grew the image.
            w.attacher.grow(&image(), 2 * GIB);
        }
        let before = w.held();
        if let Err(s) = w.step(step).await {
            assert!(
                retryable(s.code()),
                "{name}: answered {:?}: {}",
                s.code(),
                s.message()
            );
            let after = w.held();
            assert!(
                after.0 >= before.0.min(want.0) && after.1 >= before.1.min(want.1),
                "{name}: mounts went from {before:?} to {after:?}"
            );
            assert_eq!(w.attacher.doubles(), 0, "{name}: mapped twice");
            // kubelet's retry.
            w.step(step)
                .await
                .unwrap_or_else(|e| panic!("{name}: the retry: {e:?}"));
        }
        assert_eq!(w.held(), want, "{name}");
        w.check_mapping(&name, want.2);
        if step == Step::Kubelet(KubeletCall::Expand) {
            let m = w.attacher.mapping_of(&image()).expect("mapped");
            let size = w.os.inner.block_device(&m.device).map(|d| d.size);
            assert_eq!(size.ok(), Some(2 * GIB), "{name}: the device's size");
        }
    }
    let violations = w.os.violations();
    assert!(violations.is_empty(), "{fault:?}: {violations:?}");
    assert!(
        w.engine.journal().get("vol-1").is_none(),
        "{fault:?}: the journal still holds the volume"
    );
    w
}

#[tokio::test]
async fn every_failing_os_call_of_an_rbd_volume_life_is_survived() {
    let clean = life(Fault::None, "clean-os").await;
    let total = clean.os.calls.load(Ordering::SeqCst);
    assert!(total > 40, "a life makes {total} OS calls");
    for errno in ERRNOS {
        for k in 1..=total {
            life(Fault::Os(k, errno), &format!("os-{k}-{errno}")).await;
        }
    }
    eprintln!(
        "faults injected in an RBD volume's life: {} ({total} OS calls x {} errnos)",
        total * ERRNOS.len(),
        ERRNOS.len()
    );
}

#[tokio::test]
async fn every_failing_attach_step_of_an_rbd_volume_life_is_survived() {
    let clean = life(Fault::None, "clean-attach").await;
    let total = clean.attacher.steps();
    assert!(total > 10, "a life makes {total} attacher calls");
    let failures = [Failure::Fail, Failure::Timeout, Failure::Busy];
    for f in failures {
        for k in 1..=total {
            let w = life(Fault::Attacher(k, f), &format!("attach-{k}-{f:?}")).await;
            assert!(
                w.attacher.steps() >= k,
                "{f:?} at {k}: the failure was injected"
            );
        }
    }
    eprintln!(
        "attacher faults injected in an RBD volume's life: {} ({total} steps x {} failures)",
        total * failures.len(),
        failures.len()
    );
}
