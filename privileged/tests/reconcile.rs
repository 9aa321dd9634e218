//! Reconciliation for real (run as root): corrupted mounts made with a FUSE mount whose server
//! died (ENOTCONN), a truncated and a garbage journal rebuilt from the mount table and
//! kubelet's `vol_data.json`, and a pass over a namespace with 10,000 mounts.

use std::collections::HashMap;
use std::os::fd::AsRawFd as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use csi::node_client::NodeClient;
use csi::volume_capability::access_mode::Mode;
use moor_node::engine::{Engine, EngineConfig};
use moor_node::journal::{self, Journal};
use moor_node::reconcile::{Action, Reconciler};
use moor_node::sys::linux::Linux;
use moor_privileged::client::{DEADLINE, Daemon, connect};
use moor_privileged::requests::{unpublish_req, unstage_req};
use moor_privileged::{Sandbox, fs_cap, is_mount_point, mount_depth, runtime};
use moor_proto::csi::v1 as csi;
use tonic::transport::Channel;

const MIB: u64 = 1 << 20;

fn cap() -> csi::VolumeCapability {
    fs_cap("ext4", Mode::SingleNodeWriter)
}

/// Mounts a FUSE filesystem on `target` and closes its device at once: the server is dead
/// and every access gives ENOTCONN.
fn dead_fuse(target: &Path) {
    let dev = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/fuse")
        .expect("/dev/fuse");
    let data = std::ffi::CString::new(format!(
        "fd={},rootmode=40000,user_id=0,group_id=0",
        dev.as_raw_fd()
    ))
    .expect("options");
    rustix::mount::mount(
        "moor-dead",
        target,
        "fuse",
        rustix::mount::MountFlags::empty(),
        data.as_c_str(),
    )
    .expect("mount fuse");
    drop(dev);
    let err = std::fs::metadata(target.join("x")).expect_err("dead fuse");
    assert_eq!(err.raw_os_error(), Some(libc::ENOTCONN), "{err}");
}

struct Node {
    sb: Sandbox,
    socket: PathBuf,
    dev: PathBuf,
    staging: PathBuf,
    target: PathBuf,
    daemon: Option<Daemon>,
}

impl Node {
    fn new(name: &str) -> Self {
        let sb = Sandbox::new(name);
        let dev = sb.loop_device("v.img", 128 * MIB);
        let socket = sb.root.join("csi.sock");
        let staging = sb.staging("pv");
        let target = sb.target("pod", "pv");
        Self {
            sb,
            socket,
            dev,
            staging,
            target,
            daemon: None,
        }
    }

    /// (Re)starts the daemon; it reconciles at start, and not again.
    async fn start(&mut self) -> NodeClient<Channel> {
        self.start_with_interval(0).await
    }

    /// (Re)starts the daemon with a periodic reconciliation every `secs` seconds (0: none).
    /// Only the phases that wait for the periodic pass run with it: a pass holds each volume's
    /// lock for a moment, and a call that meets it gets ABORTED (kubelet retries those), and
    /// it would clean up damage a test means to show the calls meeting.
    async fn start_with_interval(&mut self, secs: u32) -> NodeClient<Channel> {
        if let Some(mut d) = self.daemon.take() {
            d.stop().await;
        }
        let interval = secs.to_string();
        self.daemon = Some(
            Daemon::start(
                &self.socket,
                &self.sb.node_args("n", &["--reconcile-interval", &interval]),
            )
            .await,
        );
        NodeClient::new(connect(&self.socket).await.expect("connect"))
    }

    async fn stage(&self, node: &mut NodeClient<Channel>) -> Result<(), tonic::Status> {
        node.node_stage_volume(csi::NodeStageVolumeRequest {
            volume_id: "vol".into(),
            publish_context: HashMap::from([("devicePath".into(), self.dev.display().to_string())]),
            staging_target_path: self.staging.display().to_string(),
            volume_capability: Some(cap()),
            ..Default::default()
        })
        .await
        .map(drop)
    }

    async fn publish(&self, node: &mut NodeClient<Channel>) -> Result<(), tonic::Status> {
        node.node_publish_volume(csi::NodePublishVolumeRequest {
            volume_id: "vol".into(),
            staging_target_path: self.staging.display().to_string(),
            target_path: self.target.display().to_string(),
            volume_capability: Some(cap()),
            ..Default::default()
        })
        .await
        .map(drop)
    }

    async fn unpublish(&self, node: &mut NodeClient<Channel>) -> Result<(), tonic::Status> {
        node.node_unpublish_volume(unpublish_req("vol", &self.target))
            .await
            .map(drop)
    }

    async fn unstage(&self, node: &mut NodeClient<Channel>) -> Result<(), tonic::Status> {
        node.node_unstage_volume(unstage_req("vol", &self.staging))
            .await
            .map(drop)
    }

    async fn condition(&self, node: &mut NodeClient<Channel>, path: &Path) -> csi::VolumeCondition {
        node.node_get_volume_stats(csi::NodeGetVolumeStatsRequest {
            volume_id: "vol".into(),
            volume_path: path.display().to_string(),
            staging_target_path: String::new(),
        })
        .await
        .expect("stats")
        .into_inner()
        .volume_condition
        .expect("condition")
    }

    /// kubelet's `vol_data.json` beside the staging and target dirs.
    fn write_vol_data(&self) {
        let data = br#"{"driverName":"moor.csi.io","volumeHandle":"vol","specVolID":"pv"}"#;
        for dir in [&self.staging, &self.target] {
            let parent = dir.parent().expect("parent");
            std::fs::write(parent.join("vol_data.json"), data).expect("vol_data.json");
        }
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        if let Some(mut d) = self.daemon.take() {
            d.terminate();
        }
    }
}

#[test]
fn dead_fuse_mounts_are_cleaned_by_unpublish_unstage_and_reconciliation() {
    let mut n = Node::new("fuse");
    let rt = runtime();
    rt.block_on(async {
        let mut node = n.start().await;
        n.stage(&mut node).await.expect("stage");
        n.publish(&mut node).await.expect("publish");

        // A dead FUSE mount over the target: unpublish peels it and moor's bind.
        dead_fuse(&n.target);
        assert!(n.condition(&mut node, &n.target).await.abnormal);
        n.unpublish(&mut node)
            .await
            .expect("unpublish a corrupted target");
        assert_eq!(mount_depth(&n.target), 0);
        assert!(!n.target.exists());

        // Over the target again, and found by the periodic pass, which detaches it and
        // leaves moor's bind beneath alone.
        n.publish(&mut node).await.expect("publish");
        std::fs::write(n.target.join("f"), b"kept").expect("write");
        let mut node = n.start_with_interval(1).await;
        dead_fuse(&n.target);
        let deadline = Instant::now() + DEADLINE;
        while mount_depth(&n.target) > 1 {
            assert!(
                Instant::now() < deadline,
                "the periodic reconciliation did not clean the target within {DEADLINE:?}"
            );
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        assert_eq!(std::fs::read(n.target.join("f")).expect("read"), b"kept");
        assert!(!n.condition(&mut node, &n.target).await.abnormal);

        // A dead FUSE over the staging path: unstage cleans it.
        let mut node = n.start().await;
        n.unpublish(&mut node).await.expect("unpublish");
        dead_fuse(&n.staging);
        n.unstage(&mut node)
            .await
            .expect("unstage a corrupted staging path");
        assert_eq!(mount_depth(&n.staging), 0);
    });
    assert!(n.sb.mounts().is_empty(), "{:?}", n.sb.mounts());
}

#[test]
fn a_corrupted_target_found_at_start_is_detached_and_reported_until_kubelet_acts() {
    let mut n = Node::new("fuse-start");
    let rt = runtime();
    rt.block_on(async {
        let mut node = n.start().await;
        n.stage(&mut node).await.expect("stage");
        n.publish(&mut node).await.expect("publish");
        if let Some(mut d) = n.daemon.take() {
            d.stop().await;
        }
        // The bind itself goes, and a dead FUSE takes its place.
        rustix::mount::unmount(&n.target, rustix::mount::UnmountFlags::empty()).expect("umount");
        dead_fuse(&n.target);
        let mut node = n.start().await;
        assert_eq!(
            mount_depth(&n.target),
            0,
            "the corrupted mount is detached at start"
        );
        let c = n.condition(&mut node, &n.target).await;
        assert!(c.abnormal, "{c:?}");
        // kubelet's answer: unpublish, unstage; both succeed and leave nothing.
        n.unpublish(&mut node).await.expect("unpublish");
        n.unstage(&mut node).await.expect("unstage");
    });
    assert!(n.sb.mounts().is_empty(), "{:?}", n.sb.mounts());
}

async fn rebuilt_after(n: &mut Node, damage: impl Fn(&Path), kept_aside: bool) {
    let mut node = n.start().await;
    n.stage(&mut node).await.expect("stage");
    n.publish(&mut node).await.expect("publish");
    std::fs::write(n.target.join("data"), b"survives").expect("write");
    n.write_vol_data();
    if let Some(mut d) = n.daemon.take() {
        d.stop().await;
    }
    damage(&n.sb.state.join(journal::LOG_FILE));
    let mut node = n.start().await;
    // Damage is kept aside; an append cut short is not damage, the log just ends before it.
    assert_eq!(
        n.sb.state.join(journal::CORRUPT_FILE).exists(),
        kept_aside,
        "damaged log kept aside"
    );
    let (records, problems) = journal::read_state(&n.sb.state).expect("read");
    assert!(problems.is_empty(), "rewritten log is clean: {problems:?}");
    let r = records
        .iter()
        .find(|r| r.volume_id == "vol")
        .expect("rebuilt record");
    assert!(
        r.stage.is_some() && r.publishes.contains_key(&n.target),
        "{r:?}"
    );
    assert!(!n.condition(&mut node, &n.target).await.abnormal);
    // kubelet's retries and its teardown all work on the rebuilt record.
    n.stage(&mut node).await.expect("stage retry");
    n.publish(&mut node).await.expect("publish retry");
    assert_eq!(mount_depth(&n.target), 1, "no second mount stacked");
    assert_eq!(
        std::fs::read(n.target.join("data")).expect("read"),
        b"survives"
    );
    n.unpublish(&mut node).await.expect("unpublish");
    n.unstage(&mut node).await.expect("unstage");
    assert!(!is_mount_point(&n.staging));
}

#[test]
fn a_garbage_journal_is_rebuilt_from_the_mount_table() {
    let mut n = Node::new("journal-garbage");
    let rt = runtime();
    rt.block_on(rebuilt_after(
        &mut n,
        |log| {
            std::fs::write(
                log,
                b"\x00\xffnot a journal at all\nmoor-journal v1 zzzz {}\n",
            )
            .expect("garbage");
        },
        true,
    ));
    assert!(n.sb.mounts().is_empty(), "{:?}", n.sb.mounts());
}

#[test]
fn a_truncated_journal_is_rebuilt_from_the_mount_table() {
    let mut n = Node::new("journal-truncated");
    let rt = runtime();
    rt.block_on(rebuilt_after(
        &mut n,
        |log| {
            let bytes = std::fs::read(log).expect("log");
            // Cut inside the only record: nothing of it is readable.
            std::fs::write(log, &bytes[..bytes.len() / 2]).expect("truncate");
        },
        false,
    ));
    assert!(n.sb.mounts().is_empty(), "{:?}", n.sb.mounts());
}

#[test]
fn a_pass_over_ten_thousand_mounts() {
    const MOUNTS: usize = 10_000;
    let mut n = Node::new("many-mounts");
    let rt = runtime();
    rt.block_on(async {
        let mut node = n.start().await;
        n.stage(&mut node).await.expect("stage");
        n.publish(&mut node).await.expect("publish");
        if let Some(mut d) = n.daemon.take() {
            d.stop().await;
        }
    });
    // Half the mounts elsewhere on the node, half in pods' CSI volume dirs of other drivers.
    let many = n.sb.root.join("many");
    std::fs::create_dir_all(&many).expect("dir");
    rustix::mount::mount(
        "tmpfs",
        &many,
        "tmpfs",
        rustix::mount::MountFlags::empty(),
        None,
    )
    .expect("tmpfs");
    let src = many.join("src");
    std::fs::create_dir(&src).expect("src");
    for i in 0..MOUNTS {
        let dir = if i % 2 == 0 {
            many.join(format!("m{i}"))
        } else {
            n.sb.k(&format!("pods/p{i}/volumes/kubernetes.io~csi/pv{i}/mount"))
        };
        std::fs::create_dir_all(&dir).expect("mount dir");
        rustix::mount::mount_bind(&src, &dir).expect("bind");
    }
    let (journal, _) = Journal::open(&n.sb.state, false).expect("journal");
    let os = Arc::new(Linux::new(&n.sb.kubelet).expect("os"));
    let cfg = EngineConfig {
        kubelet_dir: n.sb.kubelet.clone(),
        ..EngineConfig::default()
    };
    let engine = Arc::new(Engine::new(os, Arc::new(journal), cfg));
    let reconciler = Reconciler::new(engine, "moor.csi.io");
    let mut times = Vec::new();
    for _ in 0..5 {
        let start = Instant::now();
        let actions = reconciler.run().expect("pass");
        times.push(start.elapsed());
        assert!(
            actions
                .iter()
                .all(|a| !matches!(a, Action::Adopted { .. } | Action::Unstacked { .. })),
            "{actions:?}"
        );
    }
    times.sort();
    eprintln!(
        "reconcile pass with {} mounts in the namespace: median {:?} (min {:?}, max {:?})",
        MOUNTS,
        times[times.len() / 2],
        times[0],
        times[times.len() - 1]
    );
    let start = Instant::now();
    let table = moor_node::sys::mount_table::read().expect("table").0;
    let statmount_time = start.elapsed();
    let start = Instant::now();
    let info = moor_node::sys::mount_table::read_from_mountinfo().expect("mountinfo");
    eprintln!(
        "mount table of {} mounts: listmount+statmount {statmount_time:?}, mountinfo {:?}",
        table.len(),
        start.elapsed()
    );
    assert_eq!(table.len(), info.len());
    assert!(table.len() > MOUNTS);
    // Nothing of moor's was touched.
    assert_eq!(mount_depth(&n.target), 1);
    assert_eq!(mount_depth(&n.staging), 1);
    let _ = rustix::mount::unmount(&many, rustix::mount::UnmountFlags::DETACH);
    for i in (1..MOUNTS).step_by(2) {
        let dir =
            n.sb.k(&format!("pods/p{i}/volumes/kubernetes.io~csi/pv{i}/mount"));
        let _ = rustix::mount::unmount(&dir, rustix::mount::UnmountFlags::DETACH);
    }
    rt.block_on(async {
        let mut node = n.start().await;
        n.unpublish(&mut node).await.expect("unpublish");
        n.unstage(&mut node).await.expect("unstage");
    });
    assert!(n.sb.mounts().is_empty(), "{:?}", n.sb.mounts().len());
}

/// Issue 38, point 4, mounts kubelet forgot (kubernetes#121937: kubelet restarted, or the node
/// rebooted, and lost the volume's `vol_data.json`, so it never tears the mounts down by
/// itself). moor-node reports them (a log line, the reconcile metric, `moorctl status`), never
/// unmounts them (a pod may use them), and answers the unstage kubelet's fallback sends for a
/// global mount it finds (KEP-6058): for the volume it staged, refused while a pod's target is
/// mounted and done once it is not; for a directory it never staged, OK when nothing is there,
/// and refused, touching nothing, while what is mounted there is mounted for a pod.
#[test]
fn mounts_kubelet_forgot_are_reported_kept_and_unstaged_by_kubelets_fallback() {
    let mut n = Node::new("kubelet-forgot");
    let log = n.sb.root.join("node.log");
    let rt = runtime();
    rt.block_on(async {
        let mut node = n.start().await;
        n.stage(&mut node).await.expect("stage");
        n.publish(&mut node).await.expect("publish");
        n.write_vol_data();
        std::fs::write(n.target.join("data"), b"the pod's").expect("write");
        if let Some(mut d) = n.daemon.take() {
            d.stop().await;
        }
        // kubelet lost what names the mounts.
        for dir in [&n.staging, &n.target] {
            let file = dir.parent().expect("parent").join("vol_data.json");
            std::fs::remove_file(file).expect("lose vol_data.json");
        }
        let mut args = n.sb.node_args("n", &["--reconcile-interval", "0"]);
        args.extend(["--http-endpoint".to_string(), "127.0.0.1:0".to_string()]);
        let mut d = Daemon::spawn_logged("moor-node", &n.socket, &args, &log);
        d.wait_answering().await;
        let text = moor_privileged::client::wait_for_log(&log, "kubelet no longer knows", &mut d);
        for path in [&n.staging, &n.target] {
            assert!(
                text.lines().any(|l| l.contains("kubelet no longer knows")
                    && l.contains(&path.display().to_string())),
                "no log line for {}: {text}",
                path.display()
            );
        }
        let addr = moor_privileged::client::http_address(&log, &mut d);
        let metrics = moor_privileged::client::http_get(&addr, "/metrics").expect("/metrics");
        assert!(
            metrics
                .body
                .lines()
                .any(|l| l.starts_with("moor_reconcile_actions_total")
                    && l.contains("kubelet_forgot")
                    && l.ends_with(" 2")),
            "{}",
            metrics.body
        );
        // Left mounted, the pod's data there.
        assert_eq!(mount_depth(&n.staging), 1);
        assert_eq!(mount_depth(&n.target), 1);
        assert_eq!(
            std::fs::read(n.target.join("data")).expect("read"),
            b"the pod's"
        );
        let status = std::process::Command::new(moor_privileged::client::binary("moorctl"))
            .args(["status", "--state-dir"])
            .arg(&n.sb.state)
            .output()
            .expect("moorctl status");
        let said = String::from_utf8_lossy(&status.stdout);
        assert!(
            status.status.code() == Some(4) && said.matches("kubelet-forgot").count() >= 2,
            "moorctl status ({}): {said}",
            status.status
        );

        let mut node = NodeClient::new(connect(&n.socket).await.expect("connect"));
        // kubelet's fallback for the global mount it found: refused while the pod's target
        // is mounted, done once the pod is gone.
        let refused = n
            .unstage(&mut node)
            .await
            .expect_err("a pod's target is mounted");
        assert_eq!(
            refused.code(),
            tonic::Code::FailedPrecondition,
            "{refused:?}"
        );
        assert_eq!(mount_depth(&n.staging), 1);
        n.unpublish(&mut node).await.expect("unpublish");
        n.unstage(&mut node).await.expect("the fallback's unstage");
        assert_eq!(mount_depth(&n.staging), 0);

        // A directory moor never staged, named by kubelet's fallback with a volume moor does
        // not know: nothing there, OK.
        let never = n.sb.staging("never");
        std::fs::create_dir_all(&never).expect("dir");
        node.node_unstage_volume(unstage_req("vol-never", &never))
            .await
            .expect("an unstage of nothing");
        // Something mounted there (not moor's, no record) and mounted for a pod: refused,
        // and nothing touched.
        rustix::mount::mount(
            "tmpfs",
            &never,
            "tmpfs",
            rustix::mount::MountFlags::empty(),
            None,
        )
        .expect("tmpfs");
        let pod = n.sb.target("pod-never", "pv-never");
        std::fs::create_dir_all(&pod).expect("pod dir");
        rustix::mount::mount_bind(&never, &pod).expect("bind for a pod");
        let refused = node
            .node_unstage_volume(unstage_req("vol-never", &never))
            .await
            .expect_err("mounted for a pod");
        assert_eq!(
            refused.code(),
            tonic::Code::FailedPrecondition,
            "{refused:?}"
        );
        assert_eq!((mount_depth(&never), mount_depth(&pod)), (1, 1));
        for m in [&pod, &never] {
            rustix::mount::unmount(m.as_path(), rustix::mount::UnmountFlags::empty())
                .expect("unmount");
        }
        d.stop().await;
    });
    assert!(n.sb.mounts().is_empty(), "{:?}", n.sb.mounts());
}
