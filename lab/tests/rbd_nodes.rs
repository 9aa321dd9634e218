//! RBD volumes that move between nodes (run as root, against the cluster `.ci/ceph-cluster up`
//! brings up with its bridge): two simulated nodes, each a moor-node in a network namespace of
//! its own (so the cluster sees two hosts), and one moor-controller with the RBD backend,
//! driven as Kubernetes drives them: CreateVolume, ControllerPublishVolume to a node, that
//! node's NodeStage and NodePublish; then the way back, or a force-detach from a node that
//! died.
//!
//! Without a cluster, or with one that has no bridge, every test says it is skipped and
//! passes. Whatever a test makes is removed when it ends, also after a failure.

use std::collections::HashMap;
use std::io::Write as _;
use std::path::Path;
use std::time::{Duration, Instant};

use csi::controller_client::ControllerClient;
use csi::node_client::NodeClient;
use moor_lab::ceph::{Ceph, World, ext4, ms, publish};
use moor_privileged::requests::{unpublish_req, unstage_req};
use moor_privileged::{mount_depth, runtime};
use moor_proto::csi::v1 as csi;
use moor_runtime::contract::RBD_IMAGE_KEY;
use tonic::transport::Channel;

const MIB: u64 = 1 << 20;
const MARKER: &[u8] = b"written and synced on node A";

/// A volume the controller made, with what its nodes are told about it.
struct Volume {
    id: String,
    context: HashMap<String, String>,
}

async fn create(w: &mut World, ctl: &mut ControllerClient<Channel>, name: &str) -> Volume {
    let v = ctl
        .create_volume(csi::CreateVolumeRequest {
            name: format!("{name}-{}", std::process::id()),
            capacity_range: Some(csi::CapacityRange {
                required_bytes: (256 * MIB) as i64,
                limit_bytes: 0,
            }),
            volume_capabilities: vec![ext4()],
            parameters: w.parameters(),
            secrets: w.secrets(),
            ..Default::default()
        })
        .await
        .expect("CreateVolume")
        .into_inner()
        .volume
        .expect("a volume");
    Volume {
        id: v.volume_id,
        context: v.volume_context,
    }
}

/// ControllerPublishVolume of `v` at node `i`: the publish context, or the status.
async fn attach(
    w: &World,
    ctl: &mut ControllerClient<Channel>,
    v: &Volume,
    i: usize,
) -> Result<HashMap<String, String>, tonic::Status> {
    ctl.controller_publish_volume(csi::ControllerPublishVolumeRequest {
        volume_id: v.id.clone(),
        node_id: w.nodes[i].name.clone(),
        volume_capability: Some(ext4()),
        readonly: false,
        secrets: w.secrets(),
        volume_context: v.context.clone(),
    })
    .await
    .map(|r| r.into_inner().publish_context)
}

async fn detach(w: &World, ctl: &mut ControllerClient<Channel>, v: &Volume, i: usize) {
    ctl.controller_unpublish_volume(csi::ControllerUnpublishVolumeRequest {
        volume_id: v.id.clone(),
        node_id: w.nodes[i].name.clone(),
        secrets: w.secrets(),
    })
    .await
    .unwrap_or_else(|e| panic!("ControllerUnpublishVolume at node {i}: {e:?}"));
}

/// kubelet's NodeStageVolume and NodePublishVolume on node `i` for a publish context.
async fn mount(
    w: &World,
    node: &mut NodeClient<Channel>,
    v: &Volume,
    ctx: &HashMap<String, String>,
    i: usize,
) {
    let staging = w.staging(i, "pv");
    node.node_stage_volume(csi::NodeStageVolumeRequest {
        volume_id: v.id.clone(),
        publish_context: ctx.clone(),
        staging_target_path: staging.display().to_string(),
        volume_capability: Some(ext4()),
        secrets: w.secrets(),
        volume_context: v.context.clone(),
    })
    .await
    .unwrap_or_else(|e| panic!("NodeStageVolume on node {i}: {e:?}"));
    node.node_publish_volume(publish(&v.id, &staging, &w.target(i, "pv"), ext4()))
        .await
        .unwrap_or_else(|e| panic!("NodePublishVolume on node {i}: {e:?}"));
}

async fn unmount(w: &World, node: &mut NodeClient<Channel>, v: &Volume, i: usize) {
    node.node_unpublish_volume(unpublish_req(&v.id, &w.target(i, "pv")))
        .await
        .unwrap_or_else(|e| panic!("NodeUnpublishVolume on node {i}: {e:?}"));
    node.node_unstage_volume(unstage_req(&v.id, &w.staging(i, "pv")))
        .await
        .unwrap_or_else(|e| panic!("NodeUnstageVolume on node {i}: {e:?}"));
}

fn write_synced(path: &Path, data: &[u8]) -> std::io::Result<()> {
    let mut f = std::fs::File::create(path)?;
    f.write_all(data)?;
    f.sync_all()
}

fn addr(w: &World, i: usize) -> String {
    w.nodes[i]
        .net
        .as_ref()
        .expect("a node of its own")
        .1
        .clone()
}

#[test]
fn a_volume_moves_between_nodes_with_its_data() {
    let name = "a_volume_moves_between_nodes_with_its_data";
    let Some(ceph) = Ceph::from_env(name) else {
        return;
    };
    let Some(mut w) = World::networked("rbd-move", ceph, 2) else {
        return;
    };
    let rt = runtime();
    rt.block_on(async {
        let mut ctl = w.start_controller(&[]).await;
        let v = create(&mut w, &mut ctl, "move").await;
        let mut a = w.start(0, "moor-node", &[]).await;
        let mut b = w.start(1, "moor-node", &[]).await;
        let ctx = attach(&w, &mut ctl, &v, 0).await.expect("publish at A");
        w.images.push(ctx[RBD_IMAGE_KEY].clone());
        mount(&w, &mut a, &v, &ctx, 0).await;
        let target_a = w.target(0, "pv");
        write_synced(&target_a.join("marker"), MARKER).expect("write on A");
        // The image is open from node A's address, and only from there.
        assert_eq!(
            w.ceph.watcher_hosts(&ctx[RBD_IMAGE_KEY]),
            vec![addr(&w, 0)],
            "node A's client, with node A's address"
        );

        // A single-node writer is never attached at two nodes.
        let e = attach(&w, &mut ctl, &v, 1)
            .await
            .expect_err("a second writer node is refused");
        assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e:?}");

        // The move: A lets go, the controller detaches it (nothing to fence), B takes it.
        let t = Instant::now();
        unmount(&w, &mut a, &v, 0).await;
        assert_eq!(
            w.leftovers(0),
            (0, 0, 0),
            "nothing of the mapping left on A"
        );
        detach(&w, &mut ctl, &v, 0).await;
        let ctx_b = attach(&w, &mut ctl, &v, 1).await.expect("publish at B");
        mount(&w, &mut b, &v, &ctx_b, 1).await;
        let moved = t.elapsed();
        let target_b = w.target(1, "pv");
        assert_eq!(
            std::fs::read(target_b.join("marker")).expect("marker on B"),
            MARKER,
            "the data moved with the volume"
        );
        assert_eq!(
            w.ceph.watcher_hosts(&ctx_b[RBD_IMAGE_KEY]),
            vec![addr(&w, 1)]
        );
        assert!(
            !w.controller_log().contains("fencing"),
            "a clean move fences no one: {}",
            w.controller_log()
        );
        write_synced(&target_b.join("from-b"), b"B").expect("B writes");

        unmount(&w, &mut b, &v, 1).await;
        detach(&w, &mut ctl, &v, 1).await;
        assert_eq!(w.leftovers(1), (0, 0, 0));
        ctl.delete_volume(csi::DeleteVolumeRequest {
            volume_id: v.id.clone(),
            secrets: w.secrets(),
        })
        .await
        .expect("DeleteVolume");
        eprintln!(
            "move A -> B (NodeUnpublish + NodeUnstage on A, ControllerUnpublish, \
             ControllerPublish, NodeStage + NodePublish on B): {}; maps on A {:?} ms, \
             on B {:?} ms",
            ms(moved),
            w.logged_ms(0, "mapped RBD image"),
            w.logged_ms(1, "mapped RBD image"),
        );
    });
}

#[test]
fn a_dead_node_is_fenced_before_its_volume_moves_and_its_late_writes_fail() {
    let name = "a_dead_node_is_fenced_before_its_volume_moves_and_its_late_writes_fail";
    let Some(ceph) = Ceph::from_env(name) else {
        return;
    };
    let Some(mut w) = World::networked("rbd-fence", ceph, 2) else {
        return;
    };
    let rt = runtime();
    rt.block_on(async {
        // Entries that outlive the test by little.
        let mut ctl = w.start_controller(&["--rbd-fence-expiry", "600"]).await;
        let v = create(&mut w, &mut ctl, "fence").await;
        let mut a = w.start(0, "moor-node", &[]).await;
        let mut b = w.start(1, "moor-node", &[]).await;
        let ctx = attach(&w, &mut ctl, &v, 0).await.expect("publish at A");
        let image = ctx[RBD_IMAGE_KEY].clone();
        w.images.push(image.clone());
        mount(&w, &mut a, &v, &ctx, 0).await;
        let target_a = w.target(0, "pv");
        write_synced(&target_a.join("marker"), MARKER).expect("write on A");

        // Node A dies: its moor-node is killed; what it mapped (rbd-fuse, the loop device,
        // the mounts) lives on, as on a node cut off from the API server.
        let mut d = w.nodes[0].daemon.take().expect("node A's daemon");
        d.child.kill().expect("kill node A");
        d.child.wait().expect("reap node A");
        drop(a);
        assert_eq!(w.leftovers(0), (1, 1, 1), "node A still holds the image");
        assert_eq!(w.ceph.watcher_hosts(&image), vec![addr(&w, 0)]);

        // Until A is detached, B cannot have the volume.
        let e = attach(&w, &mut ctl, &v, 1)
            .await
            .expect_err("A still holds the volume");
        assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e:?}");

        // The force-detach: A still holds the image, so its client is fenced first.
        let t = Instant::now();
        detach(&w, &mut ctl, &v, 0).await;
        let fenced = t.elapsed();
        let log = w.controller_log();
        assert!(log.contains("fencing"), "{log}");
        let listed = w.ceph.blocklist();
        assert!(
            listed.contains(&format!("{}:", addr(&w, 0))),
            "node A's client is on the blocklist: {listed}"
        );

        let t = Instant::now();
        let ctx_b = attach(&w, &mut ctl, &v, 1).await.expect("publish at B");
        mount(&w, &mut b, &v, &ctx_b, 1).await;
        let took_over = t.elapsed();
        let target_b = w.target(1, "pv");
        assert_eq!(
            std::fs::read(target_b.join("marker")).expect("marker on B"),
            MARKER,
            "what A synced before it died is on B"
        );

        // A's late write never reaches the image: the fenced client's requests are refused,
        // so the write-back fails where A's filesystem syncs it.
        let late = write_synced(&target_a.join("late"), b"written by A after the fence");
        assert!(late.is_err(), "a fenced node's write must fail");
        write_synced(&target_b.join("from-b"), b"B").expect("B writes");
        unmount(&w, &mut b, &v, 1).await;
        // Remapped, B's view has its own file and none of A's.
        mount(&w, &mut b, &v, &ctx_b, 1).await;
        assert!(target_b.join("from-b").exists());
        assert!(
            !target_b.join("late").exists(),
            "A's late write reached the image"
        );
        unmount(&w, &mut b, &v, 1).await;
        detach(&w, &mut ctl, &v, 1).await;
        assert_eq!(w.leftovers(1), (0, 0, 0));
        assert_eq!(mount_depth(&w.staging(1, "pv")), 0);
        eprintln!(
            "fence: the force-detach that blocklists node A {}; B's publish + stage + \
             publish after it {}; A's late write failed with {:?}",
            ms(fenced),
            ms(took_over),
            late.err().map(|e| e.to_string()),
        );
        // The image goes with the world; Ceph drops the dead client's watch in its time.
        let _ = tokio::time::timeout(
            Duration::from_secs(30),
            ctl.delete_volume(csi::DeleteVolumeRequest {
                volume_id: v.id.clone(),
                secrets: w.secrets(),
            }),
        )
        .await;
    });
}
