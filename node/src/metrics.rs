//! The node's Prometheus metrics, rendered after the gRPC families both daemons keep
//! ([`moor_runtime::metrics`]).
//!
//! What the node measures besides its gRPC calls:
//! * mounts, unmounts, mkfs and resize tools, through the [`MeteredOs`] decorator of the [`Os`]
//!   trait;
//! * filesystem checks, by filesystem and outcome;
//! * reconcile actions, through [`record_reconcile_action`];
//! * volumes staged and published, computed at scrape time from the node journal (what a
//!   reboot ended is not counted, whatever the journal remembers of it);
//! * with the built-in registration, whether kubelet has registered the plugin.
//!
//! Only filesystem and tool names, outcomes and action names become labels: never a request's
//! fields, so no secret or volume context can reach a scrape.

use std::path::Path;
use std::sync::OnceLock;
use std::sync::atomic::AtomicU64;
use std::time::Instant;

use moor_runtime::metrics::{Family, Histogram, render_gauge};

use crate::engine::VolumeCounts;

use crate::sys::{
    BindMount, BlockDevice, FsMount, FsUsage, Held, HeldDevice, MountState, Os, SysResult,
    ToolError, ToolRun,
};

/// Every metric of the node's own.
#[derive(Debug)]
pub struct Registry {
    mount_duration: Family<Histogram>,
    unmount_duration: Family<Histogram>,
    mkfs_duration: Family<Histogram>,
    resize_duration: Family<Histogram>,
    reconcile_actions: Family<AtomicU64>,
    fsck_checks: Family<AtomicU64>,
    qos_outcomes: Family<AtomicU64>,
    key_rotations: Family<AtomicU64>,
    key_rotation_next_due: AtomicU64,
}

impl Registry {
    /// An empty registry (the process has one, [`registry`]).
    const fn new() -> Self {
        Self {
            mount_duration: Family::new(
                "moor_mount_duration_seconds",
                "Time to mount: a device's filesystem (kind=filesystem) or a bind mount (kind=bind).",
                &["kind", "result"],
            ),
            unmount_duration: Family::new(
                "moor_unmount_duration_seconds",
                "Time to unmount one mount.",
                &["result"],
            ),
            mkfs_duration: Family::new(
                "moor_mkfs_duration_seconds",
                "Time mkfs took, by filesystem.",
                &["fs_type", "result"],
            ),
            resize_duration: Family::new(
                "moor_resize_duration_seconds",
                "Time a filesystem grow took, by tool.",
                &["tool", "result"],
            ),
            reconcile_actions: Family::new(
                "moor_reconcile_actions_total",
                "Actions the node's reconciliation of its journal with the mounts took.",
                &["action"],
            ),
            fsck_checks: Family::new(
                "moor_fsck_total",
                "Filesystem checks before a read-write mount, by filesystem and outcome (skipped: its metadata shows e2fsck -p would pass it clean without checking it, clean, corrected, refused: errors left that need a person, failed: the check itself did not run through).",
                &["fs_type", "outcome"],
            ),
            qos_outcomes: Family::new(
                "moor_qos_total",
                "Publications by what became of the volume's QoS limits in the pod's cgroup (unlimited: none to apply, applied, or why not: no_pod, no_cgroupfs, no_io_controller, no_pod_cgroup, not_written, not_held).",
                &["outcome"],
            ),
            key_rotations: Family::new(
                "moor_key_rotations_total",
                "Data key rotations run by a volume's keyRotationSchedule on this node, by result (done, failed: retried at the next pass).",
                &["result"],
            ),
            key_rotation_next_due: AtomicU64::new(0),
        }
    }

    /// Counts one scheduled data key rotation by its result.
    pub fn key_rotation(&self, result: &str) {
        self.key_rotations.inc(&[result]);
    }

    /// The time the next scheduled data key rotation of a volume open here is due, in seconds
    /// since the Unix epoch (0: none is scheduled).
    pub fn set_key_rotation_next_due(&self, unix: u64) {
        self.key_rotation_next_due
            .store(unix, std::sync::atomic::Ordering::Relaxed);
    }

    /// Counts one filesystem check and its outcome.
    pub fn fsck_outcome(&self, fs_type: &str, outcome: &str) {
        self.fsck_checks.inc(&[fs_type, outcome]);
    }

    /// Counts one publication by what became of its QoS limits.
    pub fn qos_outcome(&self, outcome: &str) {
        self.qos_outcomes.inc(&[outcome]);
    }

    /// Counts one reconcile action.
    pub fn reconcile_action(&self, action: &str) {
        self.reconcile_actions.inc(&[action]);
    }

    /// The node's families (mounts, tools, reconciliation) and the volume gauges.
    pub fn render_node(&self, out: &mut String, volumes: VolumeCounts) {
        self.mount_duration.render(out);
        self.unmount_duration.render(out);
        self.mkfs_duration.render(out);
        self.resize_duration.render(out);
        self.reconcile_actions.render(out);
        self.fsck_checks.render(out);
        self.qos_outcomes.render(out);
        self.key_rotations.render(out);
        render_gauge(
            out,
            "moor_key_rotation_next_due_seconds",
            "When the next scheduled data key rotation of a volume open on this node is due, in seconds since the Unix epoch, as the last pass found (0: none scheduled).",
            self.key_rotation_next_due
                .load(std::sync::atomic::Ordering::Relaxed),
        );
        render_gauge(
            out,
            "moor_volumes_staged",
            "Volumes staged on this node, as the node journal records them (but for a staging a reboot ended).",
            volumes.staged,
        );
        render_gauge(
            out,
            "moor_volumes_published",
            "Publications (bind mounts into pods) on this node, as the node journal records them (but for one a reboot ended).",
            volumes.published,
        );
    }
}

/// The process's registry of the node's own metrics.
pub fn registry() -> &'static Registry {
    static REGISTRY: OnceLock<Registry> = OnceLock::new();
    REGISTRY.get_or_init(Registry::new)
}

/// Counts one action of the node's reconciliation (`moor_reconcile_actions_total{action}`).
pub fn record_reconcile_action(action: &str) {
    registry().reconcile_action(action);
}

/// The node's scrape: the gRPC families, the node's own, and the volume counts (the engine's
/// `volume_counts`).
pub fn render_node(volumes: VolumeCounts) -> String {
    let mut out = String::new();
    moor_runtime::metrics::registry().render_grpc(&mut out);
    registry().render_node(&mut out, volumes);
    out
}

/// The built-in registration's gauge: 1 once kubelet has confirmed the registration.
pub fn render_registration(out: &mut String, registered: bool) {
    render_gauge(
        out,
        "moor_registration_registered",
        "1 once kubelet has registered the plugin (built-in registration), 0 until then.",
        u64::from(registered),
    );
}

fn result_label<T, E>(r: &Result<T, E>) -> &'static str {
    if r.is_ok() { "ok" } else { "error" }
}

/// What a tool run is, for metrics: mkfs of a filesystem, or a resize by a tool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolKind<'a> {
    /// `mkfs.<fs>`.
    Mkfs(&'a str),
    /// `resize2fs`, `xfs_growfs` or `btrfs` (filesystem resize).
    Resize(&'a str),
    /// Anything else (not measured).
    Other,
}

/// Classifies a tool run by its program's file name.
pub fn classify_tool(program: &str) -> ToolKind<'_> {
    let name = Path::new(program)
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or(program);
    match name {
        "resize2fs" | "xfs_growfs" | "btrfs" => ToolKind::Resize(name),
        _ => match name.strip_prefix("mkfs.") {
            Some(fs) if !fs.is_empty() && fs.len() <= 16 => ToolKind::Mkfs(fs),
            _ => ToolKind::Other,
        },
    }
}

/// An [`Os`] that times mounts, unmounts and tool runs into the process registry and
/// otherwise delegates to `O`.
#[derive(Debug)]
pub struct MeteredOs<O: Os> {
    inner: O,
}

impl<O: Os> MeteredOs<O> {
    /// Wraps `inner`.
    pub fn new(inner: O) -> Self {
        Self { inner }
    }

    /// The wrapped OS.
    pub fn inner(&self) -> &O {
        &self.inner
    }
}

impl<O: Os> Os for MeteredOs<O> {
    fn mount_state(&self, path: &Path) -> SysResult<MountState> {
        self.inner.mount_state(path)
    }

    fn mount_table(&self) -> SysResult<Vec<crate::sys::mount_table::MountEntry>> {
        self.inner.mount_table()
    }

    // Every change of the mount table moor makes is logged here, where they all pass: a
    // mount, a bind, an unmount, each with its path (the journal says whose it is).

    fn mount_fs(&self, m: &FsMount) -> SysResult<()> {
        let start = Instant::now();
        let r = self.inner.mount_fs(m);
        registry()
            .mount_duration
            .observe(&["filesystem", result_label(&r)], start.elapsed());
        if r.is_ok() {
            tracing::info!(device = %m.device.display(), path = %m.target.display(),
                fs = m.fs_type, read_only = m.attrs.read_only, "mount change: mounted");
        }
        r
    }

    fn mount_state_held(&self, path: &Path) -> SysResult<(MountState, Option<Held>)> {
        self.inner.mount_state_held(path)
    }

    fn make_dir_held(&self, path: &Path) -> SysResult<Held> {
        self.inner.make_dir_held(path)
    }

    fn bind_held(
        &self,
        b: &BindMount,
        source: Option<&Held>,
        parent: Option<&Held>,
    ) -> SysResult<()> {
        let start = Instant::now();
        let r = self.inner.bind_held(b, source, parent);
        registry()
            .mount_duration
            .observe(&["bind", result_label(&r)], start.elapsed());
        if r.is_ok() {
            tracing::info!(source = %b.source.display(), path = %b.target.display(),
                read_only = b.attrs.read_only, "mount change: bound");
        }
        r
    }

    fn hold_parent(&self, path: &Path) -> SysResult<Option<Held>> {
        self.inner.hold_parent(path)
    }

    fn mount_state_in(&self, path: &Path, parent: &Held) -> SysResult<MountState> {
        self.inner.mount_state_in(path, parent)
    }

    fn unmount_held(&self, target: &Path, detach: bool, parent: Option<&Held>) -> SysResult<()> {
        let start = Instant::now();
        let r = self.inner.unmount_held(target, detach, parent);
        registry()
            .unmount_duration
            .observe(&[result_label(&r)], start.elapsed());
        if r.is_ok() {
            tracing::info!(path = %target.display(), detach, "mount change: unmounted");
        }
        r
    }

    fn make_dir(&self, path: &Path) -> SysResult<()> {
        self.inner.make_dir(path)
    }

    fn make_file(&self, path: &Path) -> SysResult<()> {
        self.inner.make_file(path)
    }

    fn remove_held(&self, path: &Path, parent: Option<&Held>) -> SysResult<()> {
        self.inner.remove_held(path, parent)
    }

    fn block_device(&self, path: &Path) -> SysResult<BlockDevice> {
        self.inner.block_device(path)
    }

    fn hold_device(&self, path: &Path) -> SysResult<HeldDevice> {
        self.inner.hold_device(path)
    }

    fn check_unclaimed(&self, dev: &HeldDevice) -> SysResult<()> {
        self.inner.check_unclaimed(dev)
    }

    fn read_device(&self, path: &Path, offset: u64, buf: &mut [u8]) -> SysResult<usize> {
        self.inner.read_device(path, offset, buf)
    }

    fn fs_usage(&self, path: &Path) -> SysResult<FsUsage> {
        self.inner.fs_usage(path)
    }

    fn fs_errors(&self, dev: (u32, u32)) -> SysResult<Option<u64>> {
        self.inner.fs_errors(dev)
    }

    fn backing_store(&self, dev: (u32, u32)) -> SysResult<Option<crate::sys::BackingStore>> {
        self.inner.backing_store(dev)
    }

    fn devices_under(&self, dev: (u32, u32)) -> SysResult<Vec<(u32, u32)>> {
        self.inner.devices_under(dev)
    }

    fn share_with_group(
        &self,
        path: &Path,
        gid: u32,
        deadline: std::time::Duration,
    ) -> Result<crate::sys::GroupReport, crate::sys::OwnershipError> {
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
        self.inner.write_cgroup(path, line)
    }

    fn run_tool(&self, run: &ToolRun) -> Result<(), ToolError> {
        let start = Instant::now();
        let r = self.inner.run_tool(run);
        let d = start.elapsed();
        match classify_tool(&run.program) {
            ToolKind::Mkfs(fs) => registry().mkfs_duration.observe(&[fs, result_label(&r)], d),
            ToolKind::Resize(tool) => registry()
                .resize_duration
                .observe(&[tool, result_label(&r)], d),
            ToolKind::Other => {}
        }
        r
    }

    fn run_tool_with_key(&self, run: &ToolRun, key: &[u8]) -> Result<(), ToolError> {
        self.inner.run_tool_with_key(run, key)
    }

    fn has_program(&self, program: &str) -> bool {
        self.inner.has_program(program)
    }

    fn identify(
        &self,
        rdev: (u32, u32),
        want: &crate::sys::discovery::DeviceIdentity,
    ) -> crate::sys::discovery::Verdict {
        self.inner.identify(rdev, want)
    }

    fn find_device(
        &self,
        want: &crate::sys::discovery::DeviceIdentity,
        wait: std::time::Duration,
    ) -> Result<crate::sys::discovery::FoundDevice, crate::sys::discovery::DiscoveryError> {
        self.inner.find_device(want, wait)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn lines(text: &str) -> Vec<&str> {
        text.lines().collect()
    }

    #[test]
    fn the_registration_gauge() {
        let mut out = String::new();
        render_registration(&mut out, false);
        assert_eq!(
            lines(&out),
            [
                "# HELP moor_registration_registered 1 once kubelet has registered the plugin \
                 (built-in registration), 0 until then.",
                "# TYPE moor_registration_registered gauge",
                "moor_registration_registered 0",
            ]
        );
        out.clear();
        render_registration(&mut out, true);
        assert_eq!(lines(&out)[2], "moor_registration_registered 1");
    }

    #[test]
    fn node_families_and_volume_gauges_in_text_format() {
        let r = Registry::new();
        r.reconcile_action("remount");
        r.reconcile_action("remount");
        let mut out = String::new();
        r.render_node(
            &mut out,
            VolumeCounts {
                staged: 2,
                published: 3,
            },
        );
        let l = lines(&out);
        assert!(l.contains(&r#"moor_reconcile_actions_total{action="remount"} 2"#));
        assert!(l.contains(&"# TYPE moor_volumes_staged gauge"));
        assert!(l.contains(&"moor_volumes_staged 2"));
        assert!(l.contains(&"moor_volumes_published 3"));
        // Families without samples still say what they are.
        assert!(l.contains(&"# TYPE moor_mkfs_duration_seconds histogram"));
        assert!(out.ends_with('\n'));
    }

    #[test]
    fn the_node_scrape_has_the_grpc_families_first() {
        let out = render_node(VolumeCounts::default());
        let grpc = out.find("# TYPE moor_grpc_requests_total counter").unwrap();
        let mounts = out
            .find("# TYPE moor_mount_duration_seconds histogram")
            .unwrap();
        assert!(grpc < mounts, "{out}");
        assert!(out.contains("moor_volumes_staged 0"));
    }

    #[test]
    fn reconcile_actions_reach_the_process_registry() {
        record_reconcile_action("test-only-action");
        record_reconcile_action("test-only-action");
        let mut out = String::new();
        registry().render_node(&mut out, VolumeCounts::default());
        assert!(out.contains(r#"moor_reconcile_actions_total{action="test-only-action"} 2"#));
    }

    #[test]
    fn tools_are_classified_by_program() {
        assert_eq!(classify_tool("mkfs.ext4"), ToolKind::Mkfs("ext4"));
        assert_eq!(classify_tool("/usr/sbin/mkfs.xfs"), ToolKind::Mkfs("xfs"));
        assert_eq!(classify_tool("resize2fs"), ToolKind::Resize("resize2fs"));
        assert_eq!(classify_tool("xfs_growfs"), ToolKind::Resize("xfs_growfs"));
        assert_eq!(classify_tool("btrfs"), ToolKind::Resize("btrfs"));
        assert_eq!(classify_tool("mkfs."), ToolKind::Other);
        assert_eq!(classify_tool("blkid"), ToolKind::Other);
    }

    #[test]
    fn metered_os_times_mounts_and_tools() {
        use crate::sys::fake::FakeOs;
        let os = MeteredOs::new(FakeOs::default());
        let _ = os.run_tool(&ToolRun {
            program: "mkfs.metered-test".into(),
            args: vec![],
            deadline: Duration::from_secs(1),
        });
        let _ = os.unmount(Path::new("/nowhere/metered-test"), false);
        let mut out = String::new();
        registry().render_node(&mut out, VolumeCounts::default());
        assert!(
            out.contains(r#"moor_mkfs_duration_seconds_count{fs_type="metered-test",result="#),
            "{out}"
        );
        assert!(out.contains("moor_unmount_duration_seconds_count{result="));
    }
}
