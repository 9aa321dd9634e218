//! Several pods on one volume, for real (run as root): moor-node as a daemon, a loop device,
//! each pod's target and a subPath of it bound into the pod as kubelet binds one.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use csi::node_client::NodeClient;
use csi::volume_capability::access_mode::Mode;
use moor_privileged::client::{Daemon, connect, wait_for_log};
use moor_privileged::requests::unpublish_req;
use moor_privileged::{Sandbox, fs_cap, mount_depth, runtime};
use moor_proto::csi::v1 as csi;
use tonic::transport::Channel;

const MIB: u64 = 1 << 20;
const VOL: &str = "vol-shared";
const PODS: [&str; 2] = ["pod-a", "pod-b"];

fn cap() -> csi::VolumeCapability {
    fs_cap("ext4", Mode::SingleNodeMultiWriter)
}

/// A pod of the volume: its target, and the subPath kubelet binds from the target's `sub`
/// into the pod (`volume-subpaths/<pv>/<container>/0`).
struct Pod {
    target: PathBuf,
    subpath: PathBuf,
    /// Files it wrote through its subPath, and what.
    wrote: Vec<(String, Vec<u8>)>,
}

/// moor-node as a daemon on the sandbox, its log in `log`, and a client of it.
async fn start(sb: &Sandbox, socket: &Path, log: &Path) -> (Daemon, NodeClient<Channel>) {
    let mut d = Daemon::spawn_logged(
        "moor-node",
        socket,
        &sb.node_args("n", &["--reconcile-interval", "0"]),
        log,
    );
    d.wait_answering().await;
    let node = NodeClient::new(connect(socket).await.expect("connect"));
    (d, node)
}

/// kubelet's stage of volume `vol` on `dev` at `at`.
fn stage_req(vol: &str, dev: &Path, at: &Path) -> csi::NodeStageVolumeRequest {
    csi::NodeStageVolumeRequest {
        volume_id: vol.into(),
        publish_context: [("devicePath".to_string(), dev.display().to_string())].into(),
        staging_target_path: at.display().to_string(),
        volume_capability: Some(cap()),
        ..Default::default()
    }
}

async fn publish(node: &mut NodeClient<Channel>, staging: &Path, pod: &Pod) {
    node.node_publish_volume(csi::NodePublishVolumeRequest {
        volume_id: VOL.into(),
        staging_target_path: staging.display().to_string(),
        target_path: pod.target.display().to_string(),
        volume_capability: Some(cap()),
        ..Default::default()
    })
    .await
    .expect("publish");
    // kubelet's subPath: the dir in the volume, bound into the pod.
    let sub = pod.target.join(pod_name(pod)).join("sub");
    std::fs::create_dir_all(&sub).expect("subPath dir");
    std::fs::create_dir_all(&pod.subpath).expect("subPath mount point");
    rustix::mount::mount_bind(&sub, &pod.subpath).expect("bind the subPath");
}

async fn unpublish(node: &mut NodeClient<Channel>, pod: &Pod) {
    // kubelet's teardown: the subPath first, then the volume.
    rustix::mount::unmount(&pod.subpath, rustix::mount::UnmountFlags::empty())
        .expect("unmount the subPath");
    node.node_unpublish_volume(unpublish_req(VOL, &pod.target))
        .await
        .expect("unpublish");
}

fn pod_name(pod: &Pod) -> String {
    pod.subpath
        .ancestors()
        .find_map(|a| {
            let n = a.file_name()?.to_str()?;
            PODS.contains(&n).then(|| n.to_string())
        })
        .unwrap_or_default()
}

/// Writes (and fsyncs) the pod's next file through its subPath.
fn write(pod: &mut Pod, step: usize) {
    use std::io::Write as _;
    let name = format!("step-{step}");
    let data = format!("{} at step {step}", pod_name(pod)).into_bytes();
    let mut f = std::fs::File::create(pod.subpath.join(&name)).expect("create");
    f.write_all(&data).expect("write");
    f.sync_all().expect("fsync");
    pod.wrote.push((name, data));
}

/// Every file every pod wrote is there, read through the staging mount moor keeps.
fn all_there(staging: &Path, pods: &[Pod], when: &str) {
    for pod in pods {
        for (name, data) in &pod.wrote {
            let at = staging.join(pod_name(pod)).join("sub").join(name);
            assert_eq!(
                std::fs::read(&at).ok().as_deref(),
                Some(data.as_slice()),
                "{when}: {} lost",
                at.display()
            );
        }
    }
}

/// The targets the journal has published for the volume.
fn journaled(state: &Path) -> BTreeSet<PathBuf> {
    let (records, problems) = moor_node::journal::read_state(state).expect("journal");
    assert!(problems.is_empty(), "{problems:?}");
    records
        .into_iter()
        .filter(|r| r.volume_id == VOL)
        .flat_map(|r| r.publishes.into_keys())
        .collect()
}

/// Issue 38, point 7, nothing emptied without a trace (topolvm #1035: a volume shared by pods
/// was found empty after pods were deleted and made again, with nothing in the plugin's logs
/// to say what had happened). Two pods publish one volume, each with a subPath bound into it,
/// and are unpublished and published again in every order while the others write: every file
/// any pod synced stays; every mount change moor makes is a line of its log naming the path,
/// and the journal's publications are exactly the pods' mounted targets after each step.
#[test]
fn pods_sharing_a_volume_come_and_go_in_every_order_and_nothing_is_lost() {
    let sb = Sandbox::new("shared");
    let dev = sb.loop_device("shared.img", 128 * MIB);
    let socket = sb.root.join("csi.sock");
    let log = sb.root.join("node.log");
    let staging = sb.staging("pv-shared");
    let mut pods: Vec<Pod> = PODS
        .iter()
        .map(|p| Pod {
            target: sb.target(p, "pv-shared"),
            subpath: sb.k(&format!("pods/{p}/volume-subpaths/pv-shared/app/0")),
            wrote: Vec::new(),
        })
        .collect();
    // Every order of two pods' unpublish and publish again: (pod, publish?) steps.
    let orders: [&[(usize, bool)]; 4] = [
        &[(0, false), (0, true)],
        &[(0, false), (1, false), (0, true), (1, true)],
        &[(0, false), (1, false), (1, true), (0, true)],
        &[(1, false), (0, false), (1, true), (0, true)],
    ];
    runtime().block_on(async {
        let (mut d, mut node) = start(&sb, &socket, &log).await;
        node.node_stage_volume(stage_req(VOL, &dev, &staging))
            .await
            .expect("stage");
        for pod in &pods {
            publish(&mut node, &staging, pod).await;
        }
        let mut published = [true, true];
        let mut step = 0;
        for order in orders {
            for &(i, up) in order {
                if up {
                    publish(&mut node, &staging, &pods[i]).await;
                } else {
                    unpublish(&mut node, &pods[i]).await;
                }
                published[i] = up;
                step += 1;
                for (j, pod) in pods.iter_mut().enumerate() {
                    if published[j] {
                        write(pod, step);
                    }
                }
                let when = format!("step {step} (pod {i} {})", if up { "up" } else { "down" });
                all_there(&staging, &pods, &when);
                let mounted: BTreeSet<PathBuf> = pods
                    .iter()
                    .zip(published)
                    .filter(|(_, up)| *up)
                    .map(|(p, _)| p.target.clone())
                    .collect();
                assert_eq!(journaled(&sb.state), mounted, "{when}: the journal");
                for (pod, up) in pods.iter().zip(published) {
                    assert_eq!(mount_depth(&pod.target), usize::from(up), "{when}");
                }
            }
        }
        // Each publish and unpublish of a target is a line of moor-node's log naming it:
        // the first publish and once per step of each order.
        let text = wait_for_log(&log, "mount change", &mut d);
        for pod in &pods {
            let target = pod.target.display().to_string();
            let count = |what: &str| {
                text.lines()
                    .filter(|l| l.contains(what) && l.contains(&format!("path={target}")))
                    .count()
            };
            let downs = orders
                .iter()
                .flat_map(|o| o.iter())
                .filter(|(i, up)| PODS[*i] == pod_name(pod) && !*up)
                .count();
            assert_eq!(count("mount change: bound"), downs + 1, "{target}: {text}");
            assert_eq!(count("mount change: unmounted"), downs, "{target}: {text}");
        }
        assert_eq!(
            text.lines()
                .filter(|l| l.contains("mount change: mounted")
                    && l.contains(&format!("path={}", staging.display())))
                .count(),
            1,
            "the staging mount: {text}"
        );
        for pod in &pods {
            unpublish(&mut node, pod).await;
        }
        node.node_unstage_volume(moor_privileged::requests::unstage_req(VOL, &staging))
            .await
            .expect("unstage");
        d.stop().await;
    });
    assert!(sb.mounts().is_empty(), "{:?}", sb.mounts());
}

/// A pod's writer: appends numbered records to a file on its target, fsyncing each, until
/// stopped; returns how many it synced, or the first error.
fn writer(file: PathBuf, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<Result<u64, String>> {
    std::thread::spawn(move || {
        use std::io::Write as _;
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&file)
            .map_err(|e| format!("open {}: {e}", file.display()))?;
        let mut n = 0u64;
        while !stop.load(Ordering::Relaxed) {
            f.write_all(format!("{n}\n").as_bytes())
                .and_then(|()| f.sync_data())
                .map_err(|e| format!("record {n} to {}: {e}", file.display()))?;
            n += 1;
        }
        Ok(n)
    })
}

/// Issue 38, point 5 (linstor-csi #385: a filesystem check ran on a device that was mounted,
/// and corrupted it): one volume published for two pods that append and fsync without pause,
/// while kubelet stages it again (as after its restart), stages another volume naming the
/// same device (a second PV on it), and grows it (the device, then NodeExpandVolume online).
/// Nothing checks or formats the mounted device (moor-node says it did not check it), every
/// pod keeps writing without an error, and every record it synced is there.
#[test]
fn pods_keep_writing_while_the_volume_is_staged_again_shared_and_grown() {
    let sb = Sandbox::new("shared-busy");
    let dev = sb.loop_device("busy.img", 512 * MIB);
    let socket = sb.root.join("csi.sock");
    let log = sb.root.join("node.log");
    let staging = sb.staging("pv-busy");
    let targets: Vec<PathBuf> = PODS.iter().map(|p| sb.target(p, "pv-busy")).collect();
    // Each pod's file, through its own target (the same filesystem).
    let files: Vec<PathBuf> = targets
        .iter()
        .zip(PODS)
        .map(|(t, p)| t.join(format!("{p}.log")))
        .collect();
    runtime().block_on(async {
        let (mut d, mut node) = start(&sb, &socket, &log).await;
        node.node_stage_volume(stage_req(VOL, &dev, &staging))
            .await
            .expect("stage");
        for t in &targets {
            node.node_publish_volume(csi::NodePublishVolumeRequest {
                volume_id: VOL.into(),
                staging_target_path: staging.display().to_string(),
                target_path: t.display().to_string(),
                volume_capability: Some(cap()),
                ..Default::default()
            })
            .await
            .expect("publish");
        }
        let stop = Arc::new(AtomicBool::new(false));
        let writers: Vec<_> = files
            .iter()
            .map(|f| writer(f.clone(), Arc::clone(&stop)))
            .collect();
        let wrote = |t: &Path| std::fs::read_to_string(t).map_or(0, |s| s.lines().count());
        let busy = || files.iter().all(|f| wrote(f) > 0);
        let start = std::time::Instant::now();
        while !busy() {
            assert!(
                start.elapsed() < moor_privileged::client::DEADLINE,
                "the pods never wrote"
            );
            std::thread::sleep(std::time::Duration::from_millis(5));
        }

        // kubelet, restarted, stages the volume again.
        node.node_stage_volume(stage_req(VOL, &dev, &staging))
            .await
            .expect("stage again");
        // A second volume naming the same device: whatever the answer, no check of it.
        let other = sb.staging("pv-other");
        let _ = node
            .node_stage_volume(stage_req("vol-other", &dev, &other))
            .await;
        let text = wait_for_log(&log, "its filesystem is not checked", &mut d);
        assert!(!text.contains("repaired the filesystem"), "{text}");
        if mount_depth(&other) > 0 {
            node.node_unstage_volume(moor_privileged::requests::unstage_req("vol-other", &other))
                .await
                .expect("unstage the other");
        }
        // Grown while the pods write.
        sb.grow_loop(&dev, "busy.img", 640 * MIB);
        let expanded = node
            .node_expand_volume(csi::NodeExpandVolumeRequest {
                volume_id: VOL.into(),
                volume_path: targets[0].display().to_string(),
                capacity_range: Some(csi::CapacityRange {
                    required_bytes: (640 * MIB) as i64,
                    limit_bytes: 0,
                }),
                staging_target_path: staging.display().to_string(),
                volume_capability: Some(cap()),
                ..Default::default()
            })
            .await;
        match expanded {
            Ok(_) => {}
            // Without CAP_SYS_RESOURCE the kernel refuses an online ext4 resize (as on this
            // machine's test sandbox): the pods must keep working all the same.
            Err(e) if e.message().contains("resize2fs") => {
                eprintln!("online ext4 growth refused here: {}", e.message());
            }
            Err(e) => panic!("expand: {e:?}"),
        }
        let before: Vec<usize> = files.iter().map(|f| wrote(f)).collect();
        let start = std::time::Instant::now();
        while files.iter().zip(&before).any(|(f, b)| wrote(f) <= *b) {
            assert!(
                start.elapsed() < moor_privileged::client::DEADLINE,
                "a pod stopped writing after the expansion"
            );
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        stop.store(true, Ordering::Relaxed);
        for (t, w) in files.iter().zip(writers) {
            let synced = w
                .join()
                .expect("writer")
                .unwrap_or_else(|e| panic!("a pod's write failed: {e}"));
            let text = std::fs::read_to_string(t).expect("read");
            let lines: Vec<&str> = text.lines().collect();
            assert!(
                lines.len() as u64 >= synced,
                "{}: {} of {synced}",
                t.display(),
                lines.len()
            );
            for (i, l) in lines.iter().enumerate() {
                assert_eq!(*l, i.to_string(), "{} record {i}", t.display());
            }
            eprintln!("{}: {synced} records synced and there", t.display());
        }
        for t in &targets {
            node.node_unpublish_volume(unpublish_req(VOL, t))
                .await
                .expect("unpublish");
        }
        node.node_unstage_volume(moor_privileged::requests::unstage_req(VOL, &staging))
            .await
            .expect("unstage");
        d.stop().await;
    });
    assert!(sb.mounts().is_empty(), "{:?}", sb.mounts());
}
