//! The lab of the kernel RBD client: guests of the VM lab (`.ci/vm`), each a node on the Ceph
//! test cluster's bridge running moor-node with `--rbd-attacher kernel`, and moor-controller's
//! RBD backend on the host; with the calls Kubernetes makes of them, for the tests
//! (`lab/tests/vm_rbd.rs`) and the bench (`bench/benches/vm_rbd.rs`).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use csi::controller_client::ControllerClient;
use csi::node_client::NodeClient;
use moor_proto::csi::v1 as csi;
use moor_runtime::contract::RBD_IMAGE_KEY;
use tonic::transport::Channel;

use crate::ceph::{Ceph, World, publish};
use crate::vm::{Vm, VmOptions};
use moor_privileged::requests::{unpublish_req, unstage_req};

pub const MIB: u64 = 1 << 20;
/// moor-node's socket in a guest.
pub const SOCKET: &str = "/run/moor-csi.sock";

/// A test's world: the cluster, the controller on the host, and one guest per node.
#[derive(Debug)]
pub struct Lab {
    /// The cluster, the controller and the nodes' dirs.
    pub world: World,
    /// The guests, one per node.
    pub vms: Vec<Vm>,
    /// The host part of the cluster's /24 (`10.251.77`).
    pub net: String,
}

impl Lab {
    /// The lab with `nodes` guests at `<net>.<first_host + i>`, booted side by side, or None
    /// (the reason printed).
    pub fn new(test: &str, nodes: usize, first_host: u8) -> Option<Self> {
        Self::with_qemu_opts(test, nodes, first_host, |_, _| Vec::new())
    }

    /// [`new`](Self::new) with systemd-udevd running in each guest (no other lab guest has
    /// one: see [`VmOptions::udev`]), for what moor finds through udev.
    pub fn with_udev(test: &str, nodes: usize, first_host: u8) -> Option<Self> {
        if !crate::vm::available(test) {
            return None;
        }
        Self::boot_on(test, nodes, first_host, "1G", None, true, |_, _| Vec::new())
    }

    /// [`new`](Self::new) with more QEMU arguments for guest `i`, `qemu_opts(i, world)` (disks
    /// attached at boot, say), the guests booted side by side.
    pub fn with_qemu_opts(
        test: &str,
        nodes: usize,
        first_host: u8,
        qemu_opts: impl Fn(usize, &World) -> Vec<String>,
    ) -> Option<Self> {
        Self::boot(test, nodes, first_host, "1G", qemu_opts)
    }

    /// [`new`](Self::new) with `memory` (QEMU's `-m`, `4G`) for each guest: a storm of
    /// processes that each load librados (`rbd map`) needs more than the default 1 GiB.
    pub fn with_memory(test: &str, nodes: usize, first_host: u8, memory: &str) -> Option<Self> {
        Self::boot(test, nodes, first_host, memory, |_, _| Vec::new())
    }

    /// One node, booted on the lab's kernel `package` (`MOOR_VM_KERNEL_PACKAGE=<package> .ci/vm
    /// setup`: Debian's 6.12, with ublk_drv), with `ublk_drv` loaded beside `rbd`; or None (the
    /// reason printed).
    pub fn with_kernel(test: &str, first_host: u8, package: &str) -> Option<Self> {
        if !crate::vm::available_kernel(test, package) {
            return None;
        }
        let lab = Self::boot_on(test, 1, first_host, "1G", Some(package), false, |_, _| {
            Vec::new()
        })?;
        lab.vms[0].sh("modprobe -a ublk_drv loop && test -c /dev/ublk-control");
        Some(lab)
    }

    fn boot(
        test: &str,
        nodes: usize,
        first_host: u8,
        memory: &str,
        qemu_opts: impl Fn(usize, &World) -> Vec<String>,
    ) -> Option<Self> {
        if !crate::vm::available(test) {
            return None;
        }
        Self::boot_on(test, nodes, first_host, memory, None, false, qemu_opts)
    }

    fn boot_on(
        test: &str,
        nodes: usize,
        first_host: u8,
        memory: &str,
        kernel: Option<&str>,
        udev: bool,
        qemu_opts: impl Fn(usize, &World) -> Vec<String>,
    ) -> Option<Self> {
        let ceph = Ceph::from_env(test)?;
        let Some((bridge, net)) = ceph.bridge.clone() else {
            eprintln!("{test}: skipped: the cluster has no bridge for guests to join");
            return None;
        };
        let world = World::new(test, ceph, nodes);
        let opts: Vec<VmOptions> = (0..nodes)
            .map(|i| {
                let n = &world.nodes[i];
                VmOptions {
                    name: n.name.clone(),
                    bridge: bridge.clone(),
                    ip: format!("{net}.{}", first_host as usize + i),
                    rwdirs: vec![n.state.clone(), n.kubelet.clone()],
                    dir: world.sb.root.join("vm"),
                    memory: memory.into(),
                    hotplug: 2,
                    qemu_opts: qemu_opts(i, &world),
                    append: Vec::new(),
                    udev,
                }
            })
            .collect();
        let vms = match kernel {
            None => Vm::boot_all(opts),
            Some(k) => opts.into_iter().map(|o| Vm::boot_kernel(o, k)).collect(),
        };
        let lab = Self { world, vms, net };
        for vm in &lab.vms {
            vm.sh("modprobe rbd && test -e /sys/bus/rbd/add_single_major");
        }
        Some(lab)
    }

    /// (Re)starts node `i`'s moor-node in its guest (`program`, with `env`) and connects.
    pub async fn start_node(&self, i: usize, program: &str, env: &[&str]) -> NodeClient<Channel> {
        let n = &self.world.nodes[i];
        self.start_node_at(i, program, env, &n.state, &n.state.join("node.log"))
            .await
    }

    /// [`start_node`](Self::start_node) with its state dir at `state` (a guest path) and its
    /// log appended to `log` (a host path the guest writes through a shared dir).
    pub async fn start_node_at(
        &self,
        i: usize,
        program: &str,
        env: &[&str],
        state: &std::path::Path,
        log: &std::path::Path,
    ) -> NodeClient<Channel> {
        let n = &self.world.nodes[i];
        start_node_in(&self.vms[i], &n.name, &n.kubelet, program, env, state, log).await
    }

    /// Kills node `i`'s moor-node (SIGKILL) and waits until it is gone.
    pub fn kill_node(&self, i: usize) {
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

    pub fn log(&self, i: usize) -> String {
        std::fs::read_to_string(self.world.nodes[i].state.join("node.log")).unwrap_or_default()
    }

    /// The kernel's RBD mappings in guest `i`: (pool/name) per device.
    pub fn mappings(&self, i: usize) -> Vec<String> {
        self.vms[i]
            .sh("for d in /sys/bus/rbd/devices/*; do [ -e \"$d/name\" ] && \
                 echo \"$(cat $d/pool)/$(cat $d/name)\"; done; true")
            .lines()
            .map(str::to_string)
            .collect()
    }

    /// How many times moor-node in guest `i` has formatted volume `vol`'s device, by its log.
    pub fn formats(&self, i: usize, vol: &str) -> usize {
        formats_in(&self.log(i), vol)
    }
}

/// How many times moor-node formatted volume `vol`'s device, by its log `log`.
pub fn formats_in(log: &str, vol: &str) -> usize {
    log.lines()
        .filter(|l| l.contains("formatted blank device") && l.contains(vol))
        .count()
}

/// Starts moor-node (`program`, with `env`) in guest `vm` as node `node_id` with the kubelet
/// dir `kubelet`, its state dir at `state` (a guest path) and its log appended to `log` (a
/// host path the guest writes through a shared dir), and connects once it answers.
pub async fn start_node_in(
    vm: &Vm,
    node_id: &str,
    kubelet: &std::path::Path,
    program: &str,
    env: &[&str],
    state: &std::path::Path,
    log: &std::path::Path,
) -> NodeClient<Channel> {
    let launch = Launch {
        program,
        attacher: "kernel",
        socket: SOCKET,
        wrap: &[],
        env,
    };
    start_node_as(vm, node_id, kubelet, &launch, state, log).await
}

/// How [`start_node_as`] starts moor-node.
#[derive(Debug, Clone, Copy)]
pub struct Launch<'a> {
    /// The binary (a name [`moor_privileged::client::binary`] finds).
    pub program: &'a str,
    /// `--rbd-attacher`.
    pub attacher: &'a str,
    /// The socket it serves on, in the guest.
    pub socket: &'a str,
    /// A command moor-node runs under (its words before `env`), e.g. a shell that moves
    /// itself into a cgroup and execs the rest.
    pub wrap: &'a [&'a str],
    /// `NAME=value` words for its environment.
    pub env: &'a [&'a str],
}

/// [`start_node_in`] as `launch` says.
pub async fn start_node_as(
    vm: &Vm,
    node_id: &str,
    kubelet: &std::path::Path,
    launch: &Launch<'_>,
    state: &std::path::Path,
    log: &std::path::Path,
) -> NodeClient<Channel> {
    let Launch {
        program,
        attacher,
        socket,
        wrap,
        env,
    } = *launch;
    let bin = moor_privileged::client::binary(program);
    let mut argv: Vec<String> = wrap.iter().map(|s| (*s).to_string()).collect();
    argv.push("env".into());
    argv.extend(env.iter().map(|s| (*s).to_string()));
    argv.extend(
        [
            bin.display().to_string().as_str(),
            "--endpoint",
            &format!("unix://{socket}"),
            "--node-id",
            node_id,
            "--state-dir",
            &state.display().to_string(),
            "--kubelet-dir",
            &kubelet.display().to_string(),
            "--rbd-attacher",
            attacher,
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
    let log_text = || std::fs::read_to_string(log).unwrap_or_default();
    let start = Instant::now();
    loop {
        if let Ok(ch) = vm.channel(socket).await {
            let mut node = NodeClient::new(ch);
            if node.node_get_info(csi::NodeGetInfoRequest {}).await.is_ok() {
                return node;
            }
        }
        let alive = vm.exec(&["kill", "-0", &pid.to_string()]).ok();
        assert!(
            alive,
            "moor-node in guest {node_id} exited before it answered: {}",
            log_text()
        );
        assert!(
            start.elapsed() < Duration::from_secs(300),
            "moor-node in guest {node_id} did not answer NodeGetInfo within 300 s: {}",
            log_text()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A volume the controller made.
#[derive(Debug)]
pub struct Volume {
    /// Its id.
    pub id: String,
    /// Its image, once published.
    pub image: String,
    /// Its volume context.
    pub context: HashMap<String, String>,
    /// What it is staged as.
    pub cap: csi::VolumeCapability,
}

pub async fn create(
    w: &World,
    ctl: &mut ControllerClient<Channel>,
    name: &str,
    cap: csi::VolumeCapability,
) -> Volume {
    create_with(w, ctl, name, cap, &[]).await
}

/// A volume of the StorageClass's parameters and `extra` ones.
pub async fn create_with(
    w: &World,
    ctl: &mut ControllerClient<Channel>,
    name: &str,
    cap: csi::VolumeCapability,
    extra: &[(&str, &str)],
) -> Volume {
    create_volume(w, ctl, name, cap, extra, 256).await
}

/// A volume of `mib` MiB.
pub async fn create_sized(
    w: &World,
    ctl: &mut ControllerClient<Channel>,
    name: &str,
    cap: csi::VolumeCapability,
    mib: u64,
) -> Volume {
    create_volume(w, ctl, name, cap, &[], mib).await
}

async fn create_volume(
    w: &World,
    ctl: &mut ControllerClient<Channel>,
    name: &str,
    cap: csi::VolumeCapability,
    extra: &[(&str, &str)],
    mib: u64,
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
                required_bytes: (mib * MIB) as i64,
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
pub async fn attach(
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

/// DeleteVolume of `v`, as the external-provisioner asks once its claim is gone.
pub async fn delete(w: &World, ctl: &mut ControllerClient<Channel>, v: &Volume) {
    ctl.delete_volume(csi::DeleteVolumeRequest {
        volume_id: v.id.clone(),
        secrets: w.secrets(),
    })
    .await
    .unwrap_or_else(|e| panic!("DeleteVolume {}: {e:?}", v.id));
}

/// ControllerUnpublishVolume of `v` at node `i`.
pub async fn detach(w: &World, ctl: &mut ControllerClient<Channel>, v: &Volume, i: usize) {
    ctl.controller_unpublish_volume(csi::ControllerUnpublishVolumeRequest {
        volume_id: v.id.clone(),
        node_id: w.nodes[i].name.clone(),
        secrets: w.secrets(),
    })
    .await
    .unwrap_or_else(|e| panic!("ControllerUnpublishVolume at node {i}: {e:?}"));
}

pub fn stage_req(
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

pub fn is_block(v: &Volume) -> bool {
    matches!(
        v.cap.access_type,
        Some(csi::volume_capability::AccessType::Block(_))
    )
}

pub fn target(w: &World, v: &Volume, i: usize) -> std::path::PathBuf {
    if is_block(v) {
        w.block_target(i, &v.id)
    } else {
        w.target(i, &v.id)
    }
}

/// kubelet's NodeStageVolume and NodePublishVolume on node `i`.
pub async fn mount(
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
pub async fn unmount(lab: &Lab, node: &mut NodeClient<Channel>, v: &Volume, i: usize) {
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
pub fn pod_file(w: &World, v: &Volume, i: usize) -> String {
    w.target(i, &v.id).join("data").display().to_string()
}

/// A pod's write + fsync of `text` to its file (in the guest: the host sees the 9p dir, not
/// the guest's mount on it).
pub fn pod_write(lab: &Lab, v: &Volume, i: usize, text: &str) {
    let file = pod_file(&lab.world, v, i);
    lab.vms[i].sh(&format!(
        "printf %s '{text}' | dd of={file} conv=fsync status=none"
    ));
}

pub fn pod_read(lab: &Lab, v: &Volume, i: usize) -> String {
    lab.vms[i].read(&pod_file(&lab.world, v, i))
}
