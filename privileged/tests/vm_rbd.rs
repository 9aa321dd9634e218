//! The kernel's RBD client for real: moor-node with `--rbd-attacher kernel` in guests of the VM
//! lab (`.ci/vm`: Debian's own kernel, with the `rbd` module this machine's kernel lacks, under
//! QEMU), each guest a node on the Ceph test cluster's bridge; moor-controller's RBD backend on
//! the host creates and publishes the volumes, as the external-provisioner and -attacher would;
//! the test calls each guest's moor-node as kubelet does, through the guest's agent.
//!
//! Skipped, with the reason, without the lab (`.ci/vm setup`) or a cluster on a bridge
//! (`.ci/ceph-cluster up`). Whatever a test makes goes when it ends, also after a failure: the
//! guests are killed with their QEMU, the host's mounts and dirs with the sandbox, the images.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use csi::controller_client::ControllerClient;
use csi::volume_capability::access_mode::Mode;
use moor_privileged::ceph::{World, block, ext4, ms};
use moor_privileged::krbd_lab::*;
use moor_privileged::requests::{unpublish_req, unstage_req};
use moor_privileged::runtime;
use moor_privileged::vm::Vm;
use moor_proto::csi::v1 as csi;
use moor_runtime::contract::RBD_MONITORS_KEY;
use tonic::transport::Channel;

fn with_monitors(ctx: &HashMap<String, String>, mons: &str) -> HashMap<String, String> {
    let mut c = ctx.clone();
    c.insert(RBD_MONITORS_KEY.into(), mons.into());
    c
}

/// ControllerExpandVolume of `v` to `bytes`, as the external-resizer asks.
async fn controller_expand(
    w: &World,
    ctl: &mut ControllerClient<Channel>,
    v: &Volume,
    bytes: u64,
) -> Result<tonic::Response<csi::ControllerExpandVolumeResponse>, tonic::Status> {
    ctl.controller_expand_volume(csi::ControllerExpandVolumeRequest {
        volume_id: v.id.clone(),
        capacity_range: Some(csi::CapacityRange {
            required_bytes: bytes as i64,
            limit_bytes: 0,
        }),
        secrets: w.secrets(),
        volume_capability: Some(v.cap.clone()),
    })
    .await
}

/// One node, one kernel: a filesystem volume's whole life with its monitors named three ways
/// (msgr2's `ip:3300` as `ceph mon dump` shows first, msgr1's `ip:6789` as most docs write,
/// and a bare address), its exclusive lock seen from the cluster and a second writer refused,
/// growth, stats, a mixed monitor list refused at once; a block volume's life; moor-node
/// killed at each crash point of map and unmap, and the volume converging.
#[test]
fn the_kernel_client_on_one_node() {
    let test = "vm-krbd-one";
    let Some(mut lab) = Lab::new(test, 1, 60) else {
        return;
    };
    let host = format!("{}.1", lab.net);
    runtime().block_on(async {
        let mut ctl = lab.world.start_controller(&[]).await;
        let mut node = lab.start_node(0, "moor-node", &[]).await;
        let w = &lab.world;

        // A filesystem volume, published by the controller to the guest's node.
        let mut v = create(w, &mut ctl, "vmfs", ext4()).await;
        let ctx = attach(w, &mut ctl, &mut v, 0).await.expect("publish");
        assert!(
            ctx[RBD_MONITORS_KEY].ends_with(":3300"),
            "the cluster's monitors as the controller names them: {ctx:?}"
        );

        // A list the kernel cannot take as given: refused before anything is mapped.
        let mixed = with_monitors(&ctx, &format!("{host}:3300,{host}:6789"));
        let e = node
            .node_stage_volume(stage_req(w, &v, &mixed, 0))
            .await
            .expect_err("a mixed monitor list");
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
        assert!(e.message().contains("msgr2"), "{e:?}");
        assert!(
            lab.mappings(0).is_empty(),
            "nothing mapped: {:?}",
            lab.mappings(0)
        );

        // msgr2 (the controller's own context): first stage, mkfs, a pod's write.
        let first = mount(w, &mut node, &v, &ctx, 0)
            .await
            .expect("first stage (msgr2)");
        eprintln!("{test}: first stage with mkfs over msgr2: {}", ms(first));
        assert_eq!(
            lab.mappings(0),
            vec![format!("{}/{}", w.ceph.pool, v.image)]
        );
        pod_write(&lab, &v, 0, "written on a real kernel");
        // The cluster sees the guest as the image's client.
        assert_eq!(
            w.ceph.watcher_hosts(&v.image),
            vec![format!("{}.60", lab.net)]
        );
        unmount(&lab, &mut node, &v, 0).await;
        assert!(
            lab.mappings(0).is_empty(),
            "unstage unmaps: {:?}",
            lab.mappings(0)
        );

        // msgr1, as most docs write the monitors: the data is there, nothing is formatted.
        let v1 = with_monitors(&ctx, &format!("{host}:6789"));
        let again = mount(w, &mut node, &v, &v1, 0)
            .await
            .expect("stage (msgr1)");
        eprintln!(
            "{test}: stage of a formatted image over msgr1: {}",
            ms(again)
        );
        assert_eq!(pod_read(&lab, &v, 0), "written on a real kernel");
        assert_eq!(lab.formats(0, &v.id), 1, "formatted once: {}", lab.log(0));

        // Growth: the controller grows the image, the node the device and the filesystem.
        controller_expand(w, &mut ctl, &v, 512 * MIB)
            .await
            .expect("ControllerExpandVolume");
        node.node_expand_volume(csi::NodeExpandVolumeRequest {
            volume_id: v.id.clone(),
            volume_path: w.target(0, &v.id).display().to_string(),
            capacity_range: Some(csi::CapacityRange {
                required_bytes: (512 * MIB) as i64,
                limit_bytes: 0,
            }),
            staging_target_path: w.staging(0, &v.id).display().to_string(),
            volume_capability: Some(v.cap.clone()),
            secrets: w.secrets(),
        })
        .await
        .expect("NodeExpandVolume");
        let stats = node
            .node_get_volume_stats(csi::NodeGetVolumeStatsRequest {
                volume_id: v.id.clone(),
                volume_path: w.target(0, &v.id).display().to_string(),
                staging_target_path: String::new(),
            })
            .await
            .expect("NodeGetVolumeStats")
            .into_inner();
        let total = stats
            .usage
            .iter()
            .find(|u| u.unit == csi::volume_usage::Unit::Bytes as i32)
            .map(|u| u.total)
            .unwrap_or_default();
        assert!(total > (400 * MIB) as i64, "grown filesystem: {stats:?}");
        assert!(
            !stats.volume_condition.as_ref().is_some_and(|c| c.abnormal),
            "{stats:?}"
        );
        unmount(&lab, &mut node, &v, 0).await;

        // A bare address (msgr1's default port).
        let bare = with_monitors(&ctx, &host);
        mount(w, &mut node, &v, &bare, 0)
            .await
            .expect("stage (bare address)");
        assert_eq!(pod_read(&lab, &v, 0), "written on a real kernel");
        unmount(&lab, &mut node, &v, 0).await;
        assert!(lab.mappings(0).is_empty(), "{:?}", lab.mappings(0));

        // moor-node killed at each crash point of map and unmap: the next call converges,
        // the image is mapped once at most, and the data stays.
        for point in [
            "map.mapping",
            "map.mapped",
            "unmap.unmapping",
            "unmap.unmapped",
        ] {
            let unstaging = point.starts_with("unmap");
            if unstaging {
                mount(w, &mut node, &v, &ctx, 0)
                    .await
                    .expect("stage before unmap");
            }
            drop(node);
            lab.kill_node(0);
            let env = format!("MOOR_TEST_CRASH_AT={point}");
            let mut crashing = lab.start_node(0, "moor-node-crash-points", &[&env]).await;
            let outcome = if unstaging {
                crashing
                    .node_unpublish_volume(unpublish_req(&v.id, &w.target(0, &v.id)))
                    .await
                    .expect("unpublish");
                crashing
                    .node_unstage_volume(unstage_req(&v.id, &w.staging(0, &v.id)))
                    .await
                    .map(drop)
            } else {
                crashing
                    .node_stage_volume(stage_req(w, &v, &ctx, 0))
                    .await
                    .map(drop)
            };
            assert!(outcome.is_err(), "{point}: moor-node died in the call");
            drop(crashing);
            lab.kill_node(0);
            node = lab.start_node(0, "moor-node", &[]).await;
            if unstaging {
                node.node_unstage_volume(unstage_req(&v.id, &w.staging(0, &v.id)))
                    .await
                    .unwrap_or_else(|e| panic!("{point}: kubelet's retry of the unstage: {e:?}"));
                assert!(lab.mappings(0).is_empty(), "{point}: {:?}", lab.mappings(0));
            } else {
                mount(w, &mut node, &v, &ctx, 0)
                    .await
                    .unwrap_or_else(|e| panic!("{point}: kubelet's retry of the stage: {e:?}"));
                assert_eq!(lab.mappings(0).len(), 1, "{point}: {:?}", lab.mappings(0));
                assert_eq!(pod_read(&lab, &v, 0), "written on a real kernel", "{point}");
                unmount(&lab, &mut node, &v, 0).await;
            }
        }
        assert_eq!(
            lab.formats(0, &v.id),
            1,
            "formatted once in the whole life: {}",
            lab.log(0)
        );

        // A volume of a StorageClass with exclusiveLock: the map holds the image's lock, a
        // second writer (another client: librbd on the host) is refused, and the controller
        // refuses to grow it while it is mapped, saying why.
        let mut x = create_with(w, &mut ctl, "vmexcl", ext4(), &[("exclusiveLock", "true")]).await;
        let xctx = attach(w, &mut ctl, &mut x, 0)
            .await
            .expect("publish exclusive");
        assert_eq!(
            xctx.get("rbdExclusiveLock").map(String::as_str),
            Some("true")
        );
        mount(w, &mut node, &x, &xctx, 0)
            .await
            .expect("stage exclusive");
        pod_write(&lab, &x, 0, "held");
        let locks = w.ceph.rbd(&["lock", "ls", &x.image]).expect("rbd lock ls");
        assert!(
            locks.contains("auto"),
            "the exclusive lock is held: {locks}"
        );
        let second = w.ceph.rbd(&[
            "bench",
            "--io-type",
            "write",
            "--io-size",
            "4096",
            "--io-total",
            "4096",
            &x.image,
        ]);
        let refused = second.expect_err("a second writer wrote");
        assert!(refused.contains("Read-only file system"), "{refused}");
        let grow = controller_expand(w, &mut ctl, &x, 512 * MIB)
            .await
            .expect_err("an exclusively mapped image grew");
        assert_eq!(grow.code(), tonic::Code::FailedPrecondition, "{grow:?}");
        assert!(grow.message().contains("exclusiveLock"), "{grow:?}");
        unmount(&lab, &mut node, &x, 0).await;
        assert_eq!(lab.vms[0].read(&pod_file(w, &x, 0)), "", "unpublished");
        mount(w, &mut node, &x, &xctx, 0)
            .await
            .expect("stage exclusive again");
        assert_eq!(pod_read(&lab, &x, 0), "held");
        unmount(&lab, &mut node, &x, 0).await;
        detach(w, &mut ctl, &x, 0).await;

        // A block volume: 1 MiB written through the published device, read after a restage.
        let mut b = create(w, &mut ctl, "vmblk", block(Mode::SingleNodeWriter)).await;
        let bctx = attach(w, &mut ctl, &mut b, 0).await.expect("publish block");
        mount(w, &mut node, &b, &bctx, 0)
            .await
            .expect("stage block");
        let dev = w.block_target(0, &b.id).display().to_string();
        let sum = lab.vms[0].sh(&format!(
            "head -c 1048576 /dev/urandom > /run/blk && dd if=/run/blk of={dev} bs=1M \
             oflag=direct conv=fsync status=none && sha256sum < /run/blk"
        ));
        unmount(&lab, &mut node, &b, 0).await;
        mount(w, &mut node, &b, &bctx, 0)
            .await
            .expect("stage block again");
        let back = lab.vms[0].sh(&format!(
            "dd if={dev} bs=1M count=1 iflag=direct status=none | sha256sum"
        ));
        assert_eq!(back, sum, "the block volume's data round-trips");
        unmount(&lab, &mut node, &b, 0).await;
        assert!(lab.mappings(0).is_empty(), "{:?}", lab.mappings(0));
        detach(w, &mut ctl, &b, 0).await;
        detach(w, &mut ctl, &v, 0).await;
        for vol in [&v, &b, &x] {
            delete(w, &mut ctl, vol).await;
        }
    });
    lab.vms.clear();
}

/// A node that reboots with the volume staged and published (its QEMU killed, booted again on
/// the same state and kubelet dirs): the kernel's mapping is gone; moor-node's reconciliation
/// and kubelet's retries bring the volume back with what the pod synced, never formatting it.
/// Then the cluster stops answering: the volume's condition says so, an unstage answers by its
/// deadline (the unmount goes on in the kernel, retries are ABORTED), and once the cluster is
/// back kubelet's retries finish it with nothing lost, not even what the pod did not sync.
#[test]
fn a_rebooted_node_and_a_cluster_that_stops_answering() {
    let test = "vm-krbd-reboot";
    let Some(mut lab) = Lab::new(test, 1, 70) else {
        return;
    };
    runtime().block_on(async {
        let mut ctl = lab.world.start_controller(&[]).await;
        let mut node = lab.start_node(0, "moor-node", &[]).await;
        let mut v = create(&lab.world, &mut ctl, "vmreboot", ext4()).await;
        let ctx = attach(&lab.world, &mut ctl, &mut v, 0)
            .await
            .expect("publish");
        mount(&lab.world, &mut node, &v, &ctx, 0)
            .await
            .expect("stage");
        pod_write(&lab, &v, 0, "synced before the reboot");
        drop(node);

        lab.vms[0].reboot();
        lab.vms[0].sh("modprobe rbd");
        assert!(lab.mappings(0).is_empty(), "a reboot drops every mapping");
        let mut node = lab.start_node(0, "moor-node", &[]).await;
        let w = &lab.world;
        // kubelet, after the node's reboot, stages and publishes the pod's volume again.
        mount(w, &mut node, &v, &ctx, 0)
            .await
            .expect("stage after the reboot");
        assert_eq!(pod_read(&lab, &v, 0), "synced before the reboot");
        assert_eq!(lab.mappings(0).len(), 1, "{:?}", lab.mappings(0));
        assert_eq!(lab.formats(0, &v.id), 1, "formatted once: {}", lab.log(0));

        // The cluster stops answering (the guest drops its packets to the monitors and OSDs):
        // the volume's condition says so; a pod's last write is still in the page cache.
        pod_write(&lab, &v, 0, "synced before the cut");
        let late = w.target(0, &v.id).join("late").display().to_string();
        lab.vms[0].sh(&format!("printf 'not synced' > {late}"));
        let host = format!("{}.1", lab.net);
        lab.vms[0].sh(&format!(
            "nft add table inet cut && nft add chain inet cut out \
             '{{ type filter hook output priority 0 ; }}' && nft add rule inet cut out ip daddr \
             {host} tcp dport '{{ 3300, 6789, 6800-7300 }}' drop"
        ));
        let stats_req = csi::NodeGetVolumeStatsRequest {
            volume_id: v.id.clone(),
            volume_path: w.target(0, &v.id).display().to_string(),
            staging_target_path: String::new(),
        };
        let stats = node
            .node_get_volume_stats(stats_req.clone())
            .await
            .expect("NodeGetVolumeStats")
            .into_inner();
        let condition = stats.volume_condition.expect("a condition");
        assert!(condition.abnormal, "{condition:?}");
        assert!(condition.message.contains("no monitor"), "{condition:?}");
        eprintln!(
            "{test}: the condition while the cluster is away: {}",
            condition.message
        );
        node.node_unpublish_volume(unpublish_req(&v.id, &w.target(0, &v.id)))
            .await
            .expect("unpublish while the cluster is away");
        // The unmount writes the page cache back, and the cluster does not answer: the call
        // answers by its deadline instead of hanging, and the unmount goes on.
        let cut = Instant::now();
        let e = node
            .node_unstage_volume(unstage_req(&v.id, &w.staging(0, &v.id)))
            .await
            .expect_err("an unstage while the cluster is away");
        eprintln!(
            "{test}: unstage while the cluster is away answered {:?} after {}",
            e.code(),
            ms(cut.elapsed())
        );
        assert_eq!(e.code(), tonic::Code::DeadlineExceeded, "{e:?}");
        let again = node
            .node_unstage_volume(unstage_req(&v.id, &w.staging(0, &v.id)))
            .await
            .expect_err("a retry while the unmount goes on");
        assert_eq!(again.code(), tonic::Code::Aborted, "{again:?}");
        // The cluster is back: kubelet's retries finish the unstage, and nothing was lost.
        lab.vms[0].sh("nft delete table inet cut");
        let back = Instant::now();
        loop {
            match node
                .node_unstage_volume(unstage_req(&v.id, &w.staging(0, &v.id)))
                .await
            {
                Ok(_) => break,
                Err(e)
                    if matches!(
                        e.code(),
                        tonic::Code::Aborted | tonic::Code::DeadlineExceeded
                    ) =>
                {
                    assert!(
                        back.elapsed() < Duration::from_secs(600),
                        "the unstage did not finish within 600 s of the cluster's return: {e:?}"
                    );
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
                Err(e) => panic!("unstage after the cluster came back: {e:?}"),
            }
        }
        eprintln!(
            "{test}: the unstage finished {} after the cluster came back",
            ms(back.elapsed())
        );
        assert!(lab.mappings(0).is_empty(), "{:?}", lab.mappings(0));
        mount(w, &mut node, &v, &ctx, 0)
            .await
            .expect("stage after the cut");
        assert_eq!(pod_read(&lab, &v, 0), "synced before the cut");
        assert_eq!(
            lab.vms[0].read(&late),
            "not synced",
            "written back once the cluster was back"
        );
        unmount(&lab, &mut node, &v, 0).await;
        assert!(lab.mappings(0).is_empty(), "{:?}", lab.mappings(0));
        detach(w, &mut ctl, &v, 0).await;
        delete(w, &mut ctl, &v).await;
    });
    lab.vms.clear();
}

/// Waits until `check` holds, up to `deadline`; panics naming `what` after it.
async fn wait_until(what: &str, deadline: Duration, mut check: impl FnMut() -> bool) {
    let start = Instant::now();
    while !check() {
        assert!(start.elapsed() < deadline, "waited {deadline:?} for {what}");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Two nodes, two kernels: a volume moves from A to B with its data. Then A is cut off (its
/// QEMU paused) while it holds the volume and a writer appends synced lines; the controller's
/// unpublish fences A, B stages and writes; A, resumed, fails its late writes and none of them
/// reaches the image. Then A is killed outright while it holds the volume, and the volume moves.
#[test]
fn a_volume_moves_between_two_kernels_and_a_cut_off_node_is_fenced() {
    let test = "vm-krbd-two";
    let Some(mut lab) = Lab::new(test, 2, 80) else {
        return;
    };
    let net = lab.net.clone();
    let ip = move |i: usize| format!("{net}.{}", 80 + i);
    runtime().block_on(async {
        let mut ctl = lab.world.start_controller(&[]).await;
        let mut a = lab.start_node(0, "moor-node", &[]).await;
        let mut b = lab.start_node(1, "moor-node", &[]).await;
        let w = &lab.world;
        let mut v = create(w, &mut ctl, "vmmove", ext4()).await;

        // A clean move.
        let ctx = attach(w, &mut ctl, &mut v, 0).await.expect("publish at A");
        mount(w, &mut a, &v, &ctx, 0).await.expect("stage at A");
        pod_write(&lab, &v, 0, "from A");
        unmount(&lab, &mut a, &v, 0).await;
        detach(w, &mut ctl, &v, 0).await;
        let ctx = attach(w, &mut ctl, &mut v, 1).await.expect("publish at B");
        let moved = Instant::now();
        mount(w, &mut b, &v, &ctx, 1).await.expect("stage at B");
        eprintln!(
            "{test}: stage + publish at B after the move: {}",
            ms(moved.elapsed())
        );
        assert_eq!(pod_read(&lab, &v, 1), "from A");
        unmount(&lab, &mut b, &v, 1).await;
        detach(w, &mut ctl, &v, 1).await;

        // A cut off while it writes.
        let ctx = attach(w, &mut ctl, &mut v, 0)
            .await
            .expect("publish at A again");
        mount(w, &mut a, &v, &ctx, 0)
            .await
            .expect("stage at A again");
        let seq = w.target(0, &v.id).join("seq").display().to_string();
        let writer_log = "/run/writer.log";
        lab.vms[0].spawn(
            &[
                "sh",
                "-c",
                &format!(
                    "i=0; while :; do i=$((i+1)); echo $i | dd of={seq} oflag=append \
                     conv=notrunc,fsync status=none || echo \"write $i failed\"; done"
                ),
            ],
            writer_log,
        );
        let lines = |vm: &Vm, path: &str| vm.read(path).lines().count();
        wait_until(
            "A's writer to sync 3 lines",
            Duration::from_secs(300),
            || lines(&lab.vms[0], &seq) >= 3,
        )
        .await;
        lab.vms[0].pause();
        let fenced = Instant::now();
        detach(w, &mut ctl, &v, 0).await;
        eprintln!(
            "{test}: the force-detach that fences A: {}",
            ms(fenced.elapsed())
        );
        let blocklist = w.ceph.blocklist();
        assert!(
            blocklist.contains(&format!("{}:", ip(0))),
            "A is blocklisted: {blocklist}"
        );
        let ctx = attach(w, &mut ctl, &mut v, 1)
            .await
            .expect("publish at B after the fence");
        mount(w, &mut b, &v, &ctx, 1)
            .await
            .expect("stage at B after the fence");
        let seq_b = w.target(1, &v.id).join("seq").display().to_string();
        let seen = lab.vms[1].read(&seq_b);
        assert!(seen.lines().count() >= 3, "B sees what A synced: {seen:?}");
        lab.vms[0].resume();
        wait_until("A's late writes to fail", Duration::from_secs(300), || {
            lab.vms[0].read(writer_log).contains("failed")
        })
        .await;
        unmount(&lab, &mut b, &v, 1).await;
        mount(w, &mut b, &v, &ctx, 1)
            .await
            .expect("stage at B again");
        assert_eq!(
            lab.vms[1].read(&seq_b),
            seen,
            "nothing of A's reached the image after the fence"
        );
        unmount(&lab, &mut b, &v, 1).await;
        detach(w, &mut ctl, &v, 1).await;

        // A killed outright while it holds the volume (after a reboot that clears its fenced
        // client).
        drop(a);
        lab.vms[0].reboot();
        lab.vms[0].sh("modprobe rbd");
        let mut a = lab.start_node(0, "moor-node", &[]).await;
        let ctx = attach(w, &mut ctl, &mut v, 0)
            .await
            .expect("publish at A after its reboot");
        mount(w, &mut a, &v, &ctx, 0)
            .await
            .expect("stage at A after its reboot");
        pod_write(&lab, &v, 0, "synced before A died");
        drop(a);
        lab.vms[0].kill();
        detach(w, &mut ctl, &v, 0).await;
        let ctx = attach(w, &mut ctl, &mut v, 1)
            .await
            .expect("publish at B after A died");
        mount(w, &mut b, &v, &ctx, 1)
            .await
            .expect("stage at B after A died");
        assert_eq!(pod_read(&lab, &v, 1), "synced before A died");
        unmount(&lab, &mut b, &v, 1).await;
        detach(w, &mut ctl, &v, 1).await;
        delete(w, &mut ctl, &v).await;
    });
    lab.vms.clear();
}
