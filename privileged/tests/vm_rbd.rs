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
use csi::node_client::NodeClient;
use csi::volume_capability::access_mode::Mode;
use moor_privileged::ceph::{Ceph, World, block, ext4, ms, publish};
use moor_privileged::requests::{unpublish_req, unstage_req};
use moor_privileged::runtime;
use moor_privileged::vm::{Vm, VmOptions};
use moor_proto::csi::v1 as csi;
use moor_runtime::contract::{RBD_IMAGE_KEY, RBD_MONITORS_KEY};
use tonic::transport::Channel;

const MIB: u64 = 1 << 20;
/// moor-node's socket in a guest.
const SOCKET: &str = "/run/moor-csi.sock";

/// A test's world: the cluster, the controller on the host, and one guest per node.
struct Lab {
    world: World,
    vms: Vec<Vm>,
    /// The host part of the cluster's /24 (`10.251.77`).
    net: String,
}

impl Lab {
    /// The lab with `nodes` guests at `<net>.<first_host + i>`, or None (the reason printed).
    fn new(test: &str, nodes: usize, first_host: u8) -> Option<Self> {
        if !moor_privileged::vm::available(test) {
            return None;
        }
        let ceph = Ceph::from_env(test)?;
        let Some((bridge, net)) = ceph.bridge.clone() else {
            eprintln!("{test}: skipped: the cluster has no bridge for guests to join");
            return None;
        };
        let world = World::new(test, ceph, nodes);
        let vms = (0..nodes)
            .map(|i| {
                let n = &world.nodes[i];
                Vm::boot(VmOptions {
                    name: n.name.clone(),
                    bridge: bridge.clone(),
                    ip: format!("{net}.{}", first_host as usize + i),
                    rwdirs: vec![n.state.clone(), n.kubelet.clone()],
                    dir: world.sb.root.join("vm"),
                    memory: "1G".into(),
                })
            })
            .collect();
        let lab = Self { world, vms, net };
        for vm in &lab.vms {
            vm.sh("modprobe rbd && test -e /sys/bus/rbd/add_single_major");
        }
        Some(lab)
    }

    /// (Re)starts node `i`'s moor-node in its guest (`program`, with `env`) and connects.
    async fn start_node(&self, i: usize, program: &str, env: &[&str]) -> NodeClient<Channel> {
        let n = &self.world.nodes[i];
        let vm = &self.vms[i];
        let bin = moor_privileged::client::binary(program);
        let log = n.state.join("node.log");
        let mut argv: Vec<String> = vec!["env".into()];
        argv.extend(env.iter().map(|s| (*s).to_string()));
        argv.extend(
            [
                bin.display().to_string().as_str(),
                "--endpoint",
                &format!("unix://{SOCKET}"),
                "--node-id",
                &n.name,
                "--state-dir",
                &n.state.display().to_string(),
                "--kubelet-dir",
                &n.kubelet.display().to_string(),
                "--rbd-attacher",
                "kernel",
                "--rbd-map-timeout",
                "120",
                "--instance-wait",
                "0",
                "--log-format",
                "json",
            ]
            .map(str::to_string),
        );
        let argv: Vec<&str> = argv.iter().map(String::as_str).collect();
        let pid = vm.spawn(&argv, &log.display().to_string());
        let start = Instant::now();
        loop {
            if let Ok(ch) = vm.channel(SOCKET).await {
                let mut node = NodeClient::new(ch);
                if node.node_get_info(csi::NodeGetInfoRequest {}).await.is_ok() {
                    return node;
                }
            }
            let alive = vm.exec(&["kill", "-0", &pid.to_string()]).ok();
            assert!(
                alive,
                "moor-node in guest {} exited before it answered: {}",
                n.name,
                self.log(i)
            );
            assert!(
                start.elapsed() < Duration::from_secs(300),
                "moor-node in guest {} did not answer NodeGetInfo within 300 s: {}",
                n.name,
                self.log(i)
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Kills node `i`'s moor-node (SIGKILL) and waits until it is gone.
    fn kill_node(&self, i: usize) {
        self.vms[i].exec(&["pkill", "-KILL", "-x", "moor-node"]);
        self.vms[i].exec(&["pkill", "-KILL", "-f", "moor-node-crash-points"]);
        let start = Instant::now();
        while self.vms[i].exec(&["pgrep", "-f", "moor-node"]).ok() {
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "moor-node did not die"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn log(&self, i: usize) -> String {
        std::fs::read_to_string(self.world.nodes[i].state.join("node.log")).unwrap_or_default()
    }

    /// The kernel's RBD mappings in guest `i`: (pool/name) per device.
    fn mappings(&self, i: usize) -> Vec<String> {
        self.vms[i]
            .sh("for d in /sys/bus/rbd/devices/*; do [ -e \"$d/name\" ] && \
                 echo \"$(cat $d/pool)/$(cat $d/name)\"; done; true")
            .lines()
            .map(str::to_string)
            .collect()
    }

    /// How many times moor-node in guest `i` has formatted volume `vol`'s device, by its log.
    fn formats(&self, i: usize, vol: &str) -> usize {
        self.log(i)
            .lines()
            .filter(|l| l.contains("formatted blank device") && l.contains(vol))
            .count()
    }
}

/// A volume the controller made.
struct Volume {
    id: String,
    image: String,
    context: HashMap<String, String>,
    cap: csi::VolumeCapability,
}

async fn create(
    w: &World,
    ctl: &mut ControllerClient<Channel>,
    name: &str,
    cap: csi::VolumeCapability,
) -> Volume {
    create_with(w, ctl, name, cap, &[]).await
}

/// A volume of the StorageClass's parameters and `extra` ones.
async fn create_with(
    w: &World,
    ctl: &mut ControllerClient<Channel>,
    name: &str,
    cap: csi::VolumeCapability,
    extra: &[(&str, &str)],
) -> Volume {
    let mut parameters = w.parameters();
    parameters.extend(
        extra
            .iter()
            .map(|(k, v)| ((*k).to_string(), (*v).to_string())),
    );
    let v = ctl
        .create_volume(csi::CreateVolumeRequest {
            name: format!("{name}-{}", std::process::id()),
            capacity_range: Some(csi::CapacityRange {
                required_bytes: (256 * MIB) as i64,
                limit_bytes: 0,
            }),
            volume_capabilities: vec![cap.clone()],
            parameters,
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
        image: String::new(),
        context: v.volume_context,
        cap,
    }
}

/// ControllerPublishVolume of `v` at node `i`: its publish context (the image is noted).
async fn attach(
    w: &World,
    ctl: &mut ControllerClient<Channel>,
    v: &mut Volume,
    i: usize,
) -> Result<HashMap<String, String>, tonic::Status> {
    let ctx = ctl
        .controller_publish_volume(csi::ControllerPublishVolumeRequest {
            volume_id: v.id.clone(),
            node_id: w.nodes[i].name.clone(),
            volume_capability: Some(v.cap.clone()),
            readonly: false,
            secrets: w.secrets(),
            volume_context: v.context.clone(),
        })
        .await?
        .into_inner()
        .publish_context;
    v.image = ctx.get(RBD_IMAGE_KEY).cloned().unwrap_or_default();
    Ok(ctx)
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

fn stage_req(
    w: &World,
    v: &Volume,
    ctx: &HashMap<String, String>,
    i: usize,
) -> csi::NodeStageVolumeRequest {
    csi::NodeStageVolumeRequest {
        volume_id: v.id.clone(),
        publish_context: ctx.clone(),
        staging_target_path: w.staging(i, &v.id).display().to_string(),
        volume_capability: Some(v.cap.clone()),
        secrets: w.secrets(),
        volume_context: v.context.clone(),
    }
}

fn is_block(v: &Volume) -> bool {
    matches!(
        v.cap.access_type,
        Some(csi::volume_capability::AccessType::Block(_))
    )
}

fn target(w: &World, v: &Volume, i: usize) -> std::path::PathBuf {
    if is_block(v) {
        w.block_target(i, &v.id)
    } else {
        w.target(i, &v.id)
    }
}

/// kubelet's NodeStageVolume and NodePublishVolume on node `i`.
async fn mount(
    w: &World,
    node: &mut NodeClient<Channel>,
    v: &Volume,
    ctx: &HashMap<String, String>,
    i: usize,
) -> Result<Duration, tonic::Status> {
    let start = Instant::now();
    node.node_stage_volume(stage_req(w, v, ctx, i)).await?;
    let staged = start.elapsed();
    node.node_publish_volume(publish(
        &v.id,
        &w.staging(i, &v.id),
        &target(w, v, i),
        v.cap.clone(),
    ))
    .await?;
    Ok(staged)
}

/// kubelet's NodeUnpublishVolume and NodeUnstageVolume on node `i`; on a failure, what in
/// the guest holds the volume.
async fn unmount(lab: &Lab, node: &mut NodeClient<Channel>, v: &Volume, i: usize) {
    let w = &lab.world;
    let why = |e: tonic::Status| {
        let holders = lab.vms[i].exec(&[
            "sh",
            "-c",
            "grep -E 'rbd|kubelet' /proc/self/mountinfo; ls -l /proc/[0-9]*/fd 2>/dev/null | \
             grep rbd; ls /sys/block/*/holders/",
        ]);
        format!("{e:?}; in the guest: {}{}", holders.stdout, lab.log(i))
    };
    node.node_unpublish_volume(unpublish_req(&v.id, &target(w, v, i)))
        .await
        .unwrap_or_else(|e| panic!("NodeUnpublishVolume on node {i}: {}", why(e)));
    node.node_unstage_volume(unstage_req(&v.id, &w.staging(i, &v.id)))
        .await
        .unwrap_or_else(|e| panic!("NodeUnstageVolume on node {i}: {}", why(e)));
}

/// The pod's file on a mount volume published on node `i`.
fn pod_file(w: &World, v: &Volume, i: usize) -> String {
    w.target(i, &v.id).join("data").display().to_string()
}

/// A pod's write + fsync of `text` to its file (in the guest: the host sees the 9p dir, not
/// the guest's mount on it).
fn pod_write(lab: &Lab, v: &Volume, i: usize, text: &str) {
    let file = pod_file(&lab.world, v, i);
    lab.vms[i].sh(&format!(
        "printf %s '{text}' | dd of={file} conv=fsync status=none"
    ));
}

fn pod_read(lab: &Lab, v: &Volume, i: usize) -> String {
    lab.vms[i].read(&pod_file(&lab.world, v, i))
}

/// The addresses of the clients that have `image` open, as `rbd status` shows them.
fn watcher_hosts(w: &World, image: &str) -> Vec<String> {
    w.ceph
        .rbd(&["status", image])
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.trim_start().strip_prefix("watcher="))
        .filter_map(|a| a.split(':').next().map(str::to_string))
        .collect()
}

fn with_monitors(ctx: &HashMap<String, String>, mons: &str) -> HashMap<String, String> {
    let mut c = ctx.clone();
    c.insert(RBD_MONITORS_KEY.into(), mons.into());
    c
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
        assert_eq!(watcher_hosts(w, &v.image), vec![format!("{}.60", lab.net)]);
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
        ctl.controller_expand_volume(csi::ControllerExpandVolumeRequest {
            volume_id: v.id.clone(),
            capacity_range: Some(csi::CapacityRange {
                required_bytes: (512 * MIB) as i64,
                limit_bytes: 0,
            }),
            secrets: w.secrets(),
            volume_capability: Some(v.cap.clone()),
        })
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
        let grow = ctl
            .controller_expand_volume(csi::ControllerExpandVolumeRequest {
                volume_id: x.id.clone(),
                capacity_range: Some(csi::CapacityRange {
                    required_bytes: (512 * MIB) as i64,
                    limit_bytes: 0,
                }),
                secrets: w.secrets(),
                volume_capability: Some(x.cap.clone()),
            })
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
            ctl.delete_volume(csi::DeleteVolumeRequest {
                volume_id: vol.id.clone(),
                secrets: w.secrets(),
            })
            .await
            .expect("DeleteVolume");
        }
    });
    lab.vms.clear();
}

/// A node that reboots with the volume staged and published (its QEMU killed, booted again on
/// the same state and kubelet dirs): the kernel's mapping is gone; moor-node's reconciliation
/// and kubelet's retries bring the volume back with what the pod synced, never formatting it.
#[test]
fn a_rebooted_node_gets_its_volume_back() {
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
        unmount(&lab, &mut node, &v, 0).await;
        assert!(lab.mappings(0).is_empty(), "{:?}", lab.mappings(0));
        detach(w, &mut ctl, &v, 0).await;
        ctl.delete_volume(csi::DeleteVolumeRequest {
            volume_id: v.id.clone(),
            secrets: w.secrets(),
        })
        .await
        .expect("DeleteVolume");
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
        ctl.delete_volume(csi::DeleteVolumeRequest {
            volume_id: v.id.clone(),
            secrets: w.secrets(),
        })
        .await
        .expect("DeleteVolume");
    });
    lab.vms.clear();
}
