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
use moor_lab::ceph::{World, block, ext4, ms};
use moor_lab::krbd_lab::*;
use moor_lab::vm::Vm;
use moor_privileged::requests::{unpublish_req, unstage_req};
use moor_privileged::runtime;
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

/// Record slots at the start of each volume of the group test, and a record's size.
const SLOTS: u64 = 256;
const RECORD: usize = 4096;

/// What the guest's kernel logged of its RBD client and block I/O.
const KERNEL_LOG: &str = "dmesg | grep -E 'rbd[0-9]*:|libceph|I/O error|blk_update'; true";

/// The guest's writer of the group test (python3, there wherever the VM lab is: its
/// virtme-ng needs it): records of RECORD bytes with direct I/O in SLOTS slots of two block
/// devices (argv 1, 2), record i to the first and, once written, to the second; the last
/// record written to both in a file (argv 3); a record whose two writes took over a second
/// logged; until a file (argv 4) exists.
const WRITER: &str = r#"
import mmap, os, sys, time
a, b, count, stop = sys.argv[1:5]
fds = [(os.open(a, os.O_WRONLY | os.O_DIRECT), "A"), (os.open(b, os.O_WRONLY | os.O_DIRECT), "B")]
buf = mmap.mmap(-1, 4096)
i, slowest = 0, 0.0
while not os.path.exists(stop):
    i += 1
    line = b"%d\n" % i
    buf[:] = (line * (4096 // len(line) + 1))[:4096]
    t = time.monotonic()
    for fd, name in fds:
        try:
            n = os.pwrite(fd, buf, (i % 256) * 4096)
        except OSError as e:
            print(f"write {i} to {name} failed: {e}", flush=True)
            sys.exit(1)
        if n != 4096:
            print(f"write {i} to {name} failed: {n} bytes written", flush=True)
            sys.exit(1)
    t = time.monotonic() - t
    slowest = max(slowest, t)
    if t > 1:
        print(f"record {i} waited {int(t * 1000)} ms", flush=True)
    with open(count, "w") as f:
        f.write(str(i))
print(f"stopped after {i}, slowest {int(slowest * 1000)} ms", flush=True)
"#;

/// Record `i` as the guest's writer makes it: its number's line repeated, cut at RECORD bytes.
fn record(i: u64) -> Vec<u8> {
    format!("{i}\n")
        .into_bytes()
        .into_iter()
        .cycle()
        .take(RECORD)
        .collect()
}

/// The newest record in a log (its first SLOTS * RECORD bytes; 0: none); every slot holds a
/// whole record of its own or nothing.
fn newest_record(log: &[u8], what: &str) -> u64 {
    let mut newest = 0;
    for (slot, block) in log.chunks(RECORD).take(SLOTS as usize).enumerate() {
        if block.iter().all(|&b| b == 0) {
            continue;
        }
        let first = block.split(|&b| b == b'\n').next().unwrap_or_default();
        let i: u64 = std::str::from_utf8(first)
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("{what}: slot {slot} holds no record"));
        assert_eq!(i % SLOTS, slot as u64, "{what}: record {i} in slot {slot}");
        assert!(block == record(i), "{what}: record {i} torn");
        newest = newest.max(i);
    }
    newest
}

/// Group snapshots of two block volumes the kernel's RBD client holds mapped (as moor-node
/// maps: the image's lock handed over on request) while a writer in the guest writes numbered
/// records with direct I/O, each to the first volume and, once written, to the second: librbd
/// takes both locks from the kernel and holds its writes while it cuts; the writes wait, none
/// fails, the kernel logs no I/O error, and every group restores to one instant of the writer
/// (the second volume's newest record is the first's or the one before it, none torn).
#[test]
fn group_snapshots_of_volumes_the_kernel_writes_are_one_instant() {
    use csi::group_controller_client::GroupControllerClient;
    use moor_controller::rbd::ids::VolumeId;

    let test = "vm-krbd-group";
    let started = Instant::now();
    let Some(mut lab) = Lab::new(test, 1, 65) else {
        return;
    };
    eprintln!("{test}: guest booted: {}", ms(started.elapsed()));
    runtime().block_on(async {
        let mut ctl = lab.world.start_controller(&[]).await;
        let mut node = lab.start_node(0, "moor-node", &[]).await;
        let socket = lab
            .world
            .controller
            .as_ref()
            .expect("controller")
            .socket
            .clone();
        let mut groups = GroupControllerClient::new(
            moor_privileged::client::connect(&socket)
                .await
                .expect("connect to the controller"),
        );
        let w = &lab.world;
        let mut vols = Vec::new();
        for name in ["vmgrpa", "vmgrpb"] {
            let mut v = create(w, &mut ctl, name, block(Mode::SingleNodeWriter)).await;
            let ctx = attach(w, &mut ctl, &mut v, 0).await.expect("publish");
            mount(w, &mut node, &v, &ctx, 0).await.expect("stage");
            vols.push(v);
        }
        let (a, b) = (
            w.block_target(0, &vols[0].id).display().to_string(),
            w.block_target(0, &vols[1].id).display().to_string(),
        );
        let count = "/run/grp.count";
        let log = "/run/grp.log";
        lab.vms[0].spawn(
            &[
                "/usr/bin/python3",
                "-c",
                WRITER,
                &a,
                &b,
                count,
                "/run/grp.stop",
            ],
            log,
        );
        let vm = &lab.vms[0];
        let written = || vm.read(count).trim().parse::<u64>().unwrap_or(0);
        let wait_for = |n: u64| async move {
            let want = written() + n;
            wait_until(
                &format!("the guest's writer to reach record {want}"),
                Duration::from_secs(300),
                || written() >= want || vm.read(log).contains("failed"),
            )
            .await
        };
        wait_for(10).await;
        let ids: Vec<String> = vols.iter().map(|v| v.id.clone()).collect();
        let mut cut = Vec::new();
        for n in 0..3 {
            wait_for(10).await;
            let before = written();
            let t = Instant::now();
            let g = groups
                .create_volume_group_snapshot(csi::CreateVolumeGroupSnapshotRequest {
                    name: format!("vmgrp{n}-{}", std::process::id()),
                    source_volume_ids: ids.clone(),
                    secrets: w.secrets(),
                    ..Default::default()
                })
                .await
                .unwrap_or_else(|e| {
                    panic!(
                        "group snapshot {n} of volumes the kernel writes: {e:?}; the writer: {}; \
                         the kernel: {}",
                        vm.read(log),
                        vm.sh(KERNEL_LOG)
                    )
                })
                .into_inner()
                .group_snapshot
                .expect("a group snapshot");
            eprintln!(
                "{test}: group snapshot {n} of 2 volumes the kernel writes: {} (the writer at \
                 record {before}, then {})",
                ms(t.elapsed()),
                written()
            );
            assert_eq!(g.snapshots.len(), 2, "{g:?}");
            cut.push(g);
        }
        wait_for(10).await;
        vm.sh("touch /run/grp.stop");
        wait_until(
            "the guest's writer to stop",
            Duration::from_secs(120),
            || {
                let l = vm.read(log);
                l.contains("stopped") || l.contains("failed")
            },
        )
        .await;
        let writer = vm.read(log);
        let kernel = vm.sh(KERNEL_LOG);
        eprintln!("{test}: the writer: {writer}{test}: the kernel: {kernel}");
        assert!(!writer.contains("failed"), "a write failed: {writer}");
        // "error requesting lock: -16" is not among them: the kernel asked for the lock while
        // librbd held it for the cut, was told EBUSY, and retries (its writes wait meanwhile).
        for bad in [
            "I/O error",
            "result -",
            "will not release",
            "failed to acquire",
            "blocklisted",
        ] {
            assert!(
                !kernel.contains(bad),
                "the kernel logged {bad:?} for its rbd devices: {kernel}"
            );
        }

        // Every group restores, each member to a volume of its own, read on the host.
        let image_file = w.sb.root.join("restored");
        let mut restored = Vec::new();
        for (n, g) in cut.iter().enumerate() {
            let mut newest = Vec::new();
            for (m, member) in g.snapshots.iter().enumerate() {
                assert_eq!(member.source_volume_id, ids[m], "{g:?}");
                let r = ctl
                    .create_volume(csi::CreateVolumeRequest {
                        name: format!("vmgrp{n}-{m}-{}", std::process::id()),
                        capacity_range: Some(csi::CapacityRange {
                            required_bytes: (256 * MIB) as i64,
                            limit_bytes: 0,
                        }),
                        volume_capabilities: vec![block(Mode::SingleNodeWriter)],
                        parameters: w.parameters(),
                        secrets: w.secrets(),
                        volume_content_source: Some(csi::VolumeContentSource {
                            r#type: Some(csi::volume_content_source::Type::Snapshot(
                                csi::volume_content_source::SnapshotSource {
                                    snapshot_id: member.snapshot_id.clone(),
                                },
                            )),
                        }),
                        ..Default::default()
                    })
                    .await
                    .expect("CreateVolume from a member")
                    .into_inner()
                    .volume
                    .expect("a volume");
                let image = VolumeId::parse(&r.volume_id)
                    .expect("an rbd volume id")
                    .image();
                let _ = std::fs::remove_file(&image_file);
                w.ceph
                    .rbd(&[
                        "export",
                        "--no-progress",
                        &image,
                        &image_file.display().to_string(),
                    ])
                    .unwrap_or_else(|e| panic!("rbd export {image}: {e}"));
                let data = std::fs::read(&image_file).expect("the exported image");
                newest.push(newest_record(&data, &format!("group {n}, member {m}")));
                restored.push(r.volume_id);
            }
            eprintln!(
                "{test}: group {n}: newest record of A {}, of B {}",
                newest[0], newest[1]
            );
            assert!(newest[0] > 0, "group {n}: nothing written yet");
            assert!(
                newest[1] == newest[0] || newest[1] + 1 == newest[0],
                "group {n}: not one instant of the writer (A's newest record {}, B's {})",
                newest[0],
                newest[1]
            );
        }
        let _ = std::fs::remove_file(&image_file);

        for id in &restored {
            ctl.delete_volume(csi::DeleteVolumeRequest {
                volume_id: id.clone(),
                secrets: w.secrets(),
            })
            .await
            .unwrap_or_else(|e| panic!("DeleteVolume {id}: {e:?}"));
        }
        for g in &cut {
            groups
                .delete_volume_group_snapshot(csi::DeleteVolumeGroupSnapshotRequest {
                    group_snapshot_id: g.group_snapshot_id.clone(),
                    snapshot_ids: g.snapshots.iter().map(|s| s.snapshot_id.clone()).collect(),
                    secrets: w.secrets(),
                })
                .await
                .unwrap_or_else(|e| panic!("DeleteVolumeGroupSnapshot: {e:?}"));
        }
        for v in &vols {
            unmount(&lab, &mut node, v, 0).await;
            detach(w, &mut ctl, v, 0).await;
            delete(w, &mut ctl, v).await;
        }
        assert!(lab.mappings(0).is_empty(), "{:?}", lab.mappings(0));
    });
    lab.vms.clear();
    eprintln!("{test}: whole test: {}", ms(started.elapsed()));
}

/// What the pod writes on the encrypted volume: a line no filesystem or LUKS metadata holds.
const ENCRYPTED_PATTERN: &str = "MOOR-RBD-ENCRYPTED-PLAINTEXT-8d2e71";

#[test]
fn an_encrypted_volume_on_the_kernel_client() {
    let test = "vm-krbd-encrypted";
    let Some(mut lab) = Lab::new(test, 1, 64) else {
        return;
    };
    lab.vms[0].sh("modprobe dm_crypt && dmsetup targets | grep -qw crypt");
    runtime().block_on(async {
        let mut ctl = lab.world.start_controller(&[]).await;
        let mut node = lab.start_node(0, "moor-node", &[]).await;
        let w = &lab.world;
        // The class's secrets: the cluster user's, and the key source's KEK.
        let mut secrets = w.secrets();
        secrets.extend(moor_runtime::keys::secret_entries("lab-kek", &[0x42; 32]));
        let mut parameters = w.parameters();
        parameters.insert("encrypted".into(), "true".into());
        parameters.insert("kmsID".into(), "secret".into());
        let made = ctl
            .create_volume(csi::CreateVolumeRequest {
                name: format!("vmenc-{}", std::process::id()),
                capacity_range: Some(csi::CapacityRange {
                    required_bytes: (128 * MIB) as i64,
                    limit_bytes: 0,
                }),
                volume_capabilities: vec![ext4()],
                parameters,
                secrets: secrets.clone(),
                ..Default::default()
            })
            .await
            .expect("CreateVolume of an encrypted RBD class")
            .into_inner()
            .volume
            .expect("a volume");
        let mut v = Volume {
            id: made.volume_id,
            image: String::new(),
            context: made.volume_context,
            cap: ext4(),
        };
        let wrapped = v
            .context
            .get("encryptedDEK")
            .cloned()
            .expect("a wrapped key");
        let ctx = attach(w, &mut ctl, &mut v, 0).await.expect("publish");
        // The wrapped key goes with the image: in its metadata.
        let meta = w
            .ceph
            .rbd(&["image-meta", "get", &v.image, "moor.csi.io/encryptedDEK"])
            .expect("rbd image-meta get");
        assert_eq!(meta.trim(), wrapped);
        let stage = |v: &Volume| {
            let mut r = stage_req(w, v, &ctx, 0);
            r.secrets = secrets.clone();
            r
        };
        let crypt_mappings = || {
            lab.vms[0]
                .sh("dmsetup ls --target crypt 2>/dev/null | awk '$1 ~ /^moor-/ {print $1}'; true")
                .lines()
                .map(str::to_string)
                .collect::<Vec<_>>()
        };
        let staging = w.staging(0, &v.id);
        let open_and_publish = |node: &mut csi::node_client::NodeClient<Channel>, v: &Volume| {
            let req = stage(v);
            let publish_req =
                moor_lab::ceph::publish(&v.id, &staging, &target(w, v, 0), v.cap.clone());
            let mut node = node.clone();
            async move {
                node.node_stage_volume(req)
                    .await
                    .expect("stage the encrypted volume");
                node.node_publish_volume(publish_req)
                    .await
                    .expect("publish");
            }
        };
        open_and_publish(&mut node, &v).await;
        // One mapping, named for the volume (a hash of its id, which holds '/').
        let open = crypt_mappings();
        assert!(open.len() == 1 && open[0].starts_with("moor-"), "{open:?}");
        pod_write(&lab, &v, 0, ENCRYPTED_PATTERN);
        unmount(&lab, &mut node, &v, 0).await;
        assert!(
            crypt_mappings().is_empty(),
            "closed: {:?}",
            crypt_mappings()
        );
        assert!(
            lab.mappings(0).is_empty(),
            "unmapped: {:?}",
            lab.mappings(0)
        );

        // The image, read by Ceph's own client: LUKS, and not a byte of the pod's data.
        let exported = w.sb.root.join("encrypted-export.img");
        let exported_text = exported.display().to_string();
        w.ceph
            .rbd(&["export", &v.image, &exported_text])
            .expect("rbd export");
        let bytes = std::fs::read(&exported).expect("the exported image");
        std::fs::remove_file(&exported).expect("remove the export");
        assert_eq!(&bytes[..6], b"LUKS\xba\xbe", "a LUKS header");
        let plain = bytes
            .windows(ENCRYPTED_PATTERN.len())
            .filter(|b| *b == ENCRYPTED_PATTERN.as_bytes())
            .count();
        assert_eq!(plain, 0, "no plaintext on the image");
        drop(bytes);

        // Staged again: opened with its key, the data there, nothing formatted again.
        open_and_publish(&mut node, &v).await;
        assert_eq!(pod_read(&lab, &v, 0), ENCRYPTED_PATTERN);
        let formats = lab
            .log(0)
            .lines()
            .filter(|l| l.contains("formatted as LUKS2"))
            .count();
        assert_eq!(formats, 1, "one luksFormat: {}", lab.log(0));
        unmount(&lab, &mut node, &v, 0).await;
        assert!(crypt_mappings().is_empty(), "{:?}", crypt_mappings());

        // A snapshot of it; the KEK rotated (every image's keys and every snapshot's record,
        // through moor's ControllerKeys) and the old one retired: the snapshot restores with
        // the new KEK alone, and the restore stages on dm-crypt with it alone, the data there.
        let pid = std::process::id();
        let snap = ctl
            .create_snapshot(csi::CreateSnapshotRequest {
                source_volume_id: v.id.clone(),
                name: format!("vmenc-snap-{pid}"),
                secrets: w.secrets(),
                parameters: HashMap::new(),
            })
            .await
            .expect("a snapshot of the encrypted volume")
            .into_inner()
            .snapshot
            .expect("a snapshot");
        let controller = w
            .controller
            .as_ref()
            .expect("the controller")
            .socket
            .clone();
        let mut keys = moor_proto::keys::v1::controller_keys_client::ControllerKeysClient::new(
            moor_privileged::client::connect(&controller)
                .await
                .expect("the controller's socket"),
        );
        let new_kek = moor_runtime::keys::secret_entries("lab-kek-2", &[0x44; 32]);
        let report = keys
            .rotate_key_encryption_key(moor_proto::keys::v1::RotateKeyEncryptionKeyRequest {
                kms_id: String::new(),
                old_secrets: moor_runtime::keys::secret_entries("lab-kek", &[0x42; 32])
                    .into_iter()
                    .collect(),
                new_secrets: new_kek.clone().into_iter().collect(),
            })
            .await
            .expect("RotateKeyEncryptionKey over the RBD backend")
            .into_inner();
        assert!(
            report.rewrapped.contains(&v.id) && report.rewrapped.contains(&snap.snapshot_id),
            "{report:?}"
        );
        let rewrapped = w
            .ceph
            .rbd(&["image-meta", "get", &v.image, "moor.csi.io/encryptedDEK"])
            .expect("rbd image-meta get");
        assert!(rewrapped.trim().starts_with("v1:lab-kek-2:"), "{rewrapped}");
        let mut new_secrets = w.secrets();
        new_secrets.extend(new_kek);
        let mut parameters = w.parameters();
        parameters.insert("encrypted".into(), "true".into());
        parameters.insert("kmsID".into(), "secret".into());
        let made = ctl
            .create_volume(csi::CreateVolumeRequest {
                name: format!("vmenc-restore-{pid}"),
                capacity_range: Some(csi::CapacityRange {
                    required_bytes: (128 * MIB) as i64,
                    limit_bytes: 0,
                }),
                volume_capabilities: vec![ext4()],
                parameters,
                secrets: new_secrets.clone(),
                volume_content_source: Some(csi::VolumeContentSource {
                    r#type: Some(csi::volume_content_source::Type::Snapshot(
                        csi::volume_content_source::SnapshotSource {
                            snapshot_id: snap.snapshot_id.clone(),
                        },
                    )),
                }),
                ..Default::default()
            })
            .await
            .expect("a restore with the new KEK alone")
            .into_inner()
            .volume
            .expect("a volume");
        let mut r = Volume {
            id: made.volume_id,
            image: String::new(),
            context: made.volume_context,
            cap: ext4(),
        };
        let r_ctx = attach(w, &mut ctl, &mut r, 0)
            .await
            .expect("publish the restore");
        let mut req = stage_req(w, &r, &r_ctx, 0);
        req.secrets = new_secrets.clone();
        node.node_stage_volume(req)
            .await
            .expect("stage the restore with the new KEK alone");
        node.node_publish_volume(moor_lab::ceph::publish(
            &r.id,
            &w.staging(0, &r.id),
            &target(w, &r, 0),
            r.cap.clone(),
        ))
        .await
        .expect("publish the restore");
        assert_eq!(
            pod_read(&lab, &r, 0),
            ENCRYPTED_PATTERN,
            "the snapshot's data"
        );
        unmount(&lab, &mut node, &r, 0).await;
        detach(w, &mut ctl, &r, 0).await;
        delete(w, &mut ctl, &r).await;

        detach(w, &mut ctl, &v, 0).await;
        delete(w, &mut ctl, &v).await;
        ctl.delete_snapshot(csi::DeleteSnapshotRequest {
            snapshot_id: snap.snapshot_id.clone(),
            secrets: w.secrets(),
        })
        .await
        .expect("DeleteSnapshot");
    });
}
