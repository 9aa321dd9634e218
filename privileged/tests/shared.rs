//! Several pods on one volume, for real (run as root): moor-node as a daemon, a loop device,
//! each pod's target and a subPath of it bound into the pod as kubelet binds one.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

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
        let mut d = Daemon::spawn_logged(
            "moor-node",
            &socket,
            &sb.node_args("n", &["--reconcile-interval", "0"]),
            &log,
        );
        d.wait_answering().await;
        let mut node = NodeClient::new(connect(&socket).await.expect("connect"));
        node.node_stage_volume(csi::NodeStageVolumeRequest {
            volume_id: VOL.into(),
            publish_context: [("devicePath".to_string(), dev.display().to_string())].into(),
            staging_target_path: staging.display().to_string(),
            volume_capability: Some(cap()),
            ..Default::default()
        })
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
