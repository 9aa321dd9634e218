//! Fault injection at the OS seam: a whole volume life plus reconciliation passes, with the k-th
//! OS call failing, for every k and each errno a busy or broken node gives. After each: no
//! device with data is formatted, no healthy mount is detached, the failed call answers a code
//! that tells kubelet to retry (never NOT_FOUND or ALREADY_EXISTS, which would make it act on a
//! lie), and kubelet's retry brings the mount table to what it should be.

use std::path::Path;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tonic::Code;

use crate::engine::{Engine, EngineConfig};
use crate::journal::Journal;
use crate::reconcile::Reconciler;
use crate::service::NodeService;
use crate::service_tests::{DEV, K, KubeletCall, STAGING, TARGET, kubelet_call};
use crate::sys::discovery::{DeviceIdentity, DiscoveryError, EventSource, FoundDevice, Verdict};
use crate::sys::fake::FakeOs;
use crate::sys::mount_table::MountEntry;
use crate::sys::{
    BindMount, BlockDevice, FsMount, FsUsage, GroupReport, Held, HeldDevice, MountState, Os,
    OwnershipError, SysError, SysResult, ToolError, ToolRun,
};

pub(crate) const ERRNOS: [i32; 8] = [
    libc::EIO,
    libc::EMFILE,
    libc::ENOMEM,
    libc::EINTR,
    libc::EBUSY,
    libc::ENOSPC,
    libc::ETIMEDOUT,
    libc::EAGAIN,
];

/// The fake OS, with its `fail_at`-th call (counting from 1) failing with `errno`, and what the
/// suite watches for recorded.
pub(crate) struct Faulty {
    pub(crate) inner: Arc<FakeOs>,
    pub(crate) calls: AtomicUsize,
    fail_at: usize,
    errno: i32,
    /// Problems seen: a format of a device with data, a lazy detach.
    violations: Mutex<Vec<String>>,
}

impl Faulty {
    /// `inner`, with its `fail_at`-th call failing with `errno` (never, for 0).
    pub(crate) fn new(inner: Arc<FakeOs>, fail_at: usize, errno: i32) -> Self {
        Self {
            inner,
            calls: AtomicUsize::new(0),
            fail_at,
            errno,
            violations: Mutex::new(Vec::new()),
        }
    }

    /// The problems seen so far.
    pub(crate) fn violations(&self) -> Vec<String> {
        self.violations
            .lock()
            .map(|v| v.clone())
            .unwrap_or_default()
    }

    fn tick(&self, what: &str, path: &Path) -> SysResult<()> {
        let n = self.calls.fetch_add(1, Ordering::SeqCst) + 1;
        if n == self.fail_at {
            return Err(SysError::new(
                "injected",
                path,
                std::io::Error::from_raw_os_error(self.errno),
            )
            .with_detail(what));
        }
        Ok(())
    }

    fn violation(&self, what: String) {
        self.violations
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(what);
    }
}

impl Os for Faulty {
    fn mount_state(&self, path: &Path) -> SysResult<MountState> {
        self.tick("mount_state", path)?;
        self.inner.mount_state(path)
    }
    fn mount_table(&self) -> SysResult<Vec<MountEntry>> {
        self.tick("mount_table", Path::new("/proc/self/mountinfo"))?;
        self.inner.mount_table()
    }
    fn mount_fs(&self, m: &FsMount) -> SysResult<()> {
        self.tick("mount_fs", &m.target)?;
        self.inner.mount_fs(m)
    }
    fn mount_state_held(&self, path: &Path) -> SysResult<(MountState, Option<Held>)> {
        self.tick("mount_state", path)?;
        self.inner.mount_state_held(path)
    }
    fn make_dir_held(&self, path: &Path) -> SysResult<Held> {
        self.tick("make_dir", path)?;
        self.inner.make_dir_held(path)
    }
    fn bind_held(
        &self,
        b: &BindMount,
        source: Option<&Held>,
        parent: Option<&Held>,
    ) -> SysResult<()> {
        self.tick("bind", &b.target)?;
        self.inner.bind_held(b, source, parent)
    }
    fn hold_parent(&self, path: &Path) -> SysResult<Option<Held>> {
        self.tick("hold_parent", path)?;
        self.inner.hold_parent(path)
    }
    fn mount_state_in(&self, path: &Path, parent: &Held) -> SysResult<MountState> {
        self.tick("mount_state", path)?;
        self.inner.mount_state_in(path, parent)
    }
    fn unmount_held(&self, target: &Path, detach: bool, parent: Option<&Held>) -> SysResult<()> {
        self.tick("unmount", target)?;
        if detach {
            self.violation(format!("lazy detach of {}", target.display()));
        }
        self.inner.unmount_held(target, detach, parent)
    }
    fn make_dir(&self, path: &Path) -> SysResult<()> {
        self.tick("make_dir", path)?;
        self.inner.make_dir(path)
    }
    fn make_file(&self, path: &Path) -> SysResult<()> {
        self.tick("make_file", path)?;
        self.inner.make_file(path)
    }
    fn remove_held(&self, path: &Path, parent: Option<&Held>) -> SysResult<()> {
        self.tick("remove", path)?;
        self.inner.remove_held(path, parent)
    }
    fn block_device(&self, path: &Path) -> SysResult<BlockDevice> {
        self.tick("block_device", path)?;
        self.inner.block_device(path)
    }
    fn hold_device(&self, path: &Path) -> SysResult<HeldDevice> {
        self.tick("hold_device", path)?;
        self.inner.hold_device(path)
    }
    fn check_unclaimed(&self, dev: &HeldDevice) -> SysResult<()> {
        self.tick("check_unclaimed", &dev.handle)?;
        self.inner.check_unclaimed(dev)
    }
    fn read_device(&self, path: &Path, offset: u64, buf: &mut [u8]) -> SysResult<usize> {
        self.tick("read_device", path)?;
        self.inner.read_device(path, offset, buf)
    }
    fn fs_usage(&self, path: &Path) -> SysResult<FsUsage> {
        self.tick("fs_usage", path)?;
        self.inner.fs_usage(path)
    }
    fn fs_errors(&self, dev: (u32, u32)) -> SysResult<Option<u64>> {
        self.tick("fs_errors", Path::new("/sys/fs/ext4"))?;
        self.inner.fs_errors(dev)
    }
    fn backing_store(&self, dev: (u32, u32)) -> SysResult<Option<crate::sys::BackingStore>> {
        self.inner.backing_store(dev)
    }
    fn devices_under(&self, dev: (u32, u32)) -> SysResult<Vec<(u32, u32)>> {
        self.tick("devices_under", Path::new("/sys/dev/block"))?;
        self.inner.devices_under(dev)
    }
    fn share_with_group(
        &self,
        path: &Path,
        gid: u32,
        deadline: Duration,
    ) -> Result<GroupReport, OwnershipError> {
        self.tick("share_with_group", path)?;
        self.inner.share_with_group(path, gid, deadline)
    }
    fn selinux(&self) -> bool {
        self.inner.selinux()
    }
    fn selinux_label_known(&self, label: &str) -> bool {
        self.inner.selinux_label_known(label)
    }
    fn read_cgroup(&self, path: &Path) -> SysResult<String> {
        self.inner.read_cgroup(path)
    }
    fn write_cgroup(&self, path: &Path, line: &str) -> SysResult<()> {
        self.tick("write_cgroup", path)?;
        self.inner.write_cgroup(path, line)
    }
    fn run_tool(&self, run: &ToolRun) -> Result<(), ToolError> {
        self.tick("run_tool", Path::new(&run.program))
            .map_err(|e| ToolError::Spawn {
                program: run.program.clone(),
                source: e.source,
            })?;
        // mkfs's device is its last argument.
        let device = run.args.last().map(String::as_str).unwrap_or_default();
        if run.program.starts_with("mkfs") && !self.inner.device_data(device).is_empty() {
            self.violation(format!("{} over a device with data", run.program));
        }
        self.inner.run_tool(run)
    }
    fn run_tool_with_key(&self, run: &ToolRun, key: &[u8]) -> Result<(), ToolError> {
        self.tick("run_tool", Path::new(&run.program))
            .map_err(|e| ToolError::Spawn {
                program: run.program.clone(),
                source: e.source,
            })?;
        self.inner.run_tool_with_key(run, key)
    }
    fn has_program(&self, program: &str) -> bool {
        self.inner.has_program(program)
    }
    fn identify(&self, rdev: (u32, u32), want: &DeviceIdentity) -> Verdict {
        if self.tick("identify", Path::new("")).is_err() {
            return Verdict::Unknown;
        }
        self.inner.identify(rdev, want)
    }
    fn find_device(
        &self,
        want: &DeviceIdentity,
        wait: Duration,
    ) -> Result<FoundDevice, DiscoveryError> {
        self.tick("find_device", Path::new(""))
            .map_err(|e| DiscoveryError::NoEventSource {
                source_kind: EventSource::Kernel,
                source: e.source,
            })?;
        self.inner.find_device(want, wait)
    }
}

/// A step of the life: one of kubelet's calls, or a reconciliation pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    Kubelet(KubeletCall),
    Reconcile,
}

/// A volume's life, with what is mounted after each step (staging, target).
const LIFE: [(Step, (usize, usize)); 13] = [
    (Step::Kubelet(KubeletCall::Stage), (1, 0)),
    (Step::Kubelet(KubeletCall::Publish), (1, 1)),
    (Step::Kubelet(KubeletCall::Stats), (1, 1)),
    (Step::Kubelet(KubeletCall::Expand), (1, 1)),
    (Step::Reconcile, (1, 1)),
    (Step::Kubelet(KubeletCall::Unpublish), (1, 0)),
    (Step::Kubelet(KubeletCall::Unstage), (0, 0)),
    (Step::Kubelet(KubeletCall::Stage), (1, 0)),
    (Step::Kubelet(KubeletCall::Publish), (1, 1)),
    (Step::Reconcile, (1, 1)),
    (Step::Kubelet(KubeletCall::Stats), (1, 1)),
    (Step::Kubelet(KubeletCall::Unpublish), (1, 0)),
    (Step::Kubelet(KubeletCall::Unstage), (0, 0)),
];

struct World {
    os: Arc<Faulty>,
    engine: Arc<Engine<Faulty>>,
    svc: NodeService<Faulty>,
    state: std::path::PathBuf,
}

impl Drop for World {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.state);
    }
}

fn world(fail_at: usize, errno: i32) -> World {
    let inner = Arc::new(FakeOs::new());
    inner.add_dir(Path::new(STAGING).parent().unwrap_or(Path::new("/")));
    inner.add_dir(Path::new(TARGET).parent().unwrap_or(Path::new("/")));
    inner.add_device(DEV, (7, 7), 1 << 30);
    let os = Arc::new(Faulty::new(inner, fail_at, errno));
    let state = crate::service_tests::scratch_root().join(format!(
        "moor-faults-{}-{fail_at}-{errno}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&state);
    let (journal, _) = Journal::open(&state, false).expect("journal");
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

impl World {
    /// One step; its gRPC code (OK for a reconciliation pass that logged its failure).
    async fn step(&self, step: Step) -> Result<(), tonic::Status> {
        match step {
            Step::Kubelet(call) => kubelet_call(&self.svc, call).await,
            Step::Reconcile => {
                let _ = Reconciler::new(Arc::clone(&self.engine), "moor.csi.io").run();
                Ok(())
            }
        }
    }

    fn depth(&self) -> (usize, usize) {
        (
            self.os.inner.mount_depth(STAGING),
            self.os.inner.mount_depth(TARGET),
        )
    }
}

/// Codes that tell kubelet "it did not work this time": it retries.
pub(crate) fn retryable(code: Code) -> bool {
    matches!(
        code,
        Code::Internal
            | Code::Unavailable
            | Code::Aborted
            | Code::DeadlineExceeded
            | Code::FailedPrecondition
    )
}

#[tokio::test]
async fn every_failing_os_call_of_a_volume_life_is_survived() {
    // A clean life first: how many OS calls it makes.
    let clean = world(0, 0);
    for (step, want) in LIFE {
        clean.step(step).await.expect("clean life");
        assert_eq!(clean.depth(), want, "clean {step:?}");
    }
    let total = clean.os.calls.load(Ordering::SeqCst);
    assert!(total > 40, "a life makes {total} OS calls");
    let mut runs = 0;
    for errno in ERRNOS {
        for k in 1..=total {
            runs += 1;
            let w = world(k, errno);
            let name = |step: Step| {
                format!(
                    "call {k} failing with {}, in {step:?}",
                    std::io::Error::from_raw_os_error(errno)
                )
            };
            for (step, want) in LIFE {
                let before = w.depth();
                if let Err(s) = w.step(step).await {
                    assert!(
                        retryable(s.code()),
                        "{}: answered {:?}: {}",
                        name(step),
                        s.code(),
                        s.message()
                    );
                    // Nothing was taken away that the failed call was not asked to take.
                    let after = w.depth();
                    assert!(
                        after.0 >= before.0.min(want.0) && after.1 >= before.1.min(want.1),
                        "{}: mounts went from {before:?} to {after:?}",
                        name(step)
                    );
                    // kubelet's retry.
                    w.step(step)
                        .await
                        .unwrap_or_else(|e| panic!("{}: the retry: {e:?}", name(step)));
                }
                assert_eq!(w.depth(), want, "{}", name(step));
            }
            let violations = w.os.violations();
            assert!(
                violations.is_empty(),
                "call {k}, errno {errno}: {violations:?}"
            );
            assert!(
                w.engine.journal().get("vol-1").is_none(),
                "call {k}, errno {errno}: the journal still holds the volume"
            );
        }
    }
    eprintln!(
        "faults injected: {runs} ({total} OS calls x {} errnos)",
        ERRNOS.len()
    );
}
