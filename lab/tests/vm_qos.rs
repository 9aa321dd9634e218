//! A volume's QoS limits on cgroup v2, on the lab's Debian kernel: cgroup2 mounted in the
//! guest with the io controller enabled down to a pod's cgroup made as kubelet's cgroupfs
//! driver makes it (`kubepods/burstable/pod<uid>`), and for each kind of device moor-node
//! limits there: a local volume on a loop device, and a kernel-RBD volume (moor-controller's
//! RBD backend on the host, its QoS set by ControllerModifyVolume as a VolumeAttributesClass
//! sets it, `qosLimits` in ControllerPublishVolume's publish_context, the image mapped by
//! moor-node with `--rbd-attacher kernel` in the guest), each staged and published for that
//! pod by moor-node in the guest: `io.max` holding the rule for the device's MAJ:MIN, direct
//! I/O from a process in that cgroup counted in its `io.stat` on that device, and the rule
//! gone after the unpublish. (This machine's own cgroups are v1, and its kernel has no rbd:
//! `privileged/tests/qos.rs` proves blkio there on loop devices.) Then, in the same guest, user
//! namespaces on the lab's kernel: a runtime's idmapped mounts of moor's published ext4, xfs
//! and btrfs volumes (`moor_privileged::idmap`, which `privileged/tests/node.rs` runs on this
//! machine).
//!
//! The guest's agent reaches the host over the Ceph test cluster's bridge, so this runs beside
//! that cluster, which the RBD volume lives on (skipped, with the reason, without it or
//! without the lab).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use csi::node_client::NodeClient;

use moor_lab::ceph::{ext4, publish};
use moor_lab::krbd_lab::{self, Lab};
use moor_lab::vm::Vm;
use moor_privileged::requests::{unpublish_req, unstage_req};
use moor_privileged::{kubelets_part, runtime};
use moor_proto::csi::v1 as csi;
use moor_runtime::contract::{DEVICE_PATH_KEY, QOS_LIMITS_KEY};
use tonic::transport::Channel;

const UID: &str = "9e8d7c6b-5a49-4382-a1b0-c9d8e7f6a5b4";

/// The line of device `rdev` (`MAJ:MIN`) in the cgroup file `file` of guest `vm`, if any.
fn line_of(vm: &Vm, file: &str, rdev: &str) -> Option<String> {
    vm.read(file)
        .lines()
        .find(|l| l.starts_with(&format!("{rdev} ")))
        .map(str::to_string)
}

/// Direct I/O of a process of the pod's cgroup `pod` on the volume's file `file` (2 MiB
/// written, then read), and the cgroup's `io.stat` counting both on device `rdev`.
fn pods_direct_io_is_counted(vm: &Vm, pod: &str, file: &str, rdev: &str) {
    vm.sh(&format!(
        "sh -c 'echo $$ > {pod}/cgroup.procs && \
         dd if=/dev/zero of={file} bs=64k count=32 oflag=direct status=none && \
         dd if={file} of=/dev/null bs=64k iflag=direct status=none'"
    ));
    let stat = format!("{pod}/io.stat");
    let line = line_of(vm, &stat, rdev)
        .unwrap_or_else(|| panic!("no line of {rdev} in io.stat: {}", vm.read(&stat)));
    let count = |key: &str| -> u64 {
        line.split_whitespace()
            .find_map(|kv| kv.strip_prefix(&format!("{key}=")))
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("no {key} in {line}"))
    };
    assert!(count("wbytes") >= 2 << 20, "written, counted: {line}");
    assert!(count("rbytes") >= 2 << 20, "read, counted: {line}");
    eprintln!(
        "vm-qos: {pod}: io.max {:?}, io.stat {line:?}",
        line_of(vm, &format!("{pod}/io.max"), rdev)
    );
}

/// The pod's direct I/O on published volume `vol`'s file counted on its device `rdev`, then
/// the volume unpublished at `target` and its rule gone from the pod's `io.max`.
async fn counted_then_unpublished(
    vm: &Vm,
    node: &mut NodeClient<Channel>,
    pod: &str,
    vol: &str,
    target: &Path,
    rdev: &str,
) {
    let file = target.join("data").display().to_string();
    pods_direct_io_is_counted(vm, pod, &file, rdev);
    node.node_unpublish_volume(unpublish_req(vol, target))
        .await
        .unwrap_or_else(|e| panic!("unpublish of {vol}: {e:?}"));
    let io_max = format!("{pod}/io.max");
    assert_eq!(
        line_of(vm, &io_max, rdev),
        None,
        "the rule of {vol}'s device after the unpublish: {}",
        vm.read(&io_max)
    );
}

/// The pod's target path of volume `pv` on node 0, as kubelet names it.
fn pods_target(lab: &Lab, pv: &str) -> PathBuf {
    kubelets_part(
        lab.world.nodes[0]
            .kubelet
            .join(format!("pods/{UID}/volumes/kubernetes.io~csi/{pv}/mount")),
    )
}

#[test]
fn a_pods_cgroup_v2_holds_its_volumes_io_max_and_counts_its_direct_io() {
    let test = "vm-qos";
    let Some(mut lab) = Lab::new(test, 1, 125) else {
        return;
    };
    // cgroup v2 with the io controller down to the pod's cgroup.
    let pod = format!("/sys/fs/cgroup/kubepods/burstable/pod{UID}");
    let io_max = format!("{pod}/io.max");
    lab.vms[0].sh(&format!(
        "set -e; [ \"$(stat -f -c %T /sys/fs/cgroup)\" = cgroup2fs ] || \
         mount -t cgroup2 none /sys/fs/cgroup; \
         echo +io > /sys/fs/cgroup/cgroup.subtree_control; \
         mkdir -p /sys/fs/cgroup/kubepods/burstable; \
         echo +io > /sys/fs/cgroup/kubepods/cgroup.subtree_control; \
         echo +io > /sys/fs/cgroup/kubepods/burstable/cgroup.subtree_control; \
         mkdir -p {pod}; test -e {io_max}"
    ));
    let dev = lab.vms[0]
        .sh("modprobe loop; truncate -s 64M /run/moor-qos.img && losetup -f --show /run/moor-qos.img")
        .trim()
        .to_string();
    let rdev = lab.vms[0]
        .sh(&format!(
            "echo $((0x$(stat -c %t {dev}))):$((0x$(stat -c %T {dev})))"
        ))
        .trim()
        .to_string();
    runtime().block_on(async {
        let mut ctl = lab.world.start_controller(&[]).await;
        let vm = &lab.vms[0];
        let mut node = lab.start_node(0, "moor-node", &[]).await;
        let w = &lab.world;

        // A local volume on a loop device, the limits in the publish context as the
        // controller's ControllerPublishVolume gives them.
        let staging = w.staging(0, "vol-qos");
        let target = pods_target(&lab, "vol-qos");
        node.node_stage_volume(csi::NodeStageVolumeRequest {
            volume_id: "vol-qos".into(),
            publish_context: HashMap::from([(DEVICE_PATH_KEY.into(), dev.clone())]),
            staging_target_path: staging.display().to_string(),
            volume_capability: Some(ext4()),
            ..Default::default()
        })
        .await
        .expect("stage");
        let mut req = publish("vol-qos", &staging, &target, ext4());
        req.publish_context.insert(
            QOS_LIMITS_KEY.into(),
            "readBytesPerSecond=8388608,writeBytesPerSecond=4194304,writeIOPS=2000".into(),
        );
        req.volume_context
            .insert("csi.storage.k8s.io/pod.uid".into(), UID.into());
        node.node_publish_volume(req).await.expect("publish");
        assert_eq!(
            line_of(vm, &io_max, &rdev),
            Some(format!(
                "{rdev} rbps=8388608 wbps=4194304 riops=max wiops=2000"
            )),
            "io.max of the pod's cgroup for the loop device: {}",
            vm.read(&io_max)
        );
        counted_then_unpublished(vm, &mut node, &pod, "vol-qos", &target, &rdev).await;
        node.node_unstage_volume(unstage_req("vol-qos", &staging))
            .await
            .expect("unstage");

        // A kernel-RBD volume: its VolumeAttributesClass's limits set by
        // ControllerModifyVolume, given to the node by ControllerPublishVolume, applied by
        // moor-node to the rbd device it maps.
        let mut v = krbd_lab::create_sized(w, &mut ctl, "qos", ext4(), 64).await;
        ctl.controller_modify_volume(csi::ControllerModifyVolumeRequest {
            volume_id: v.id.clone(),
            secrets: w.secrets(),
            mutable_parameters: HashMap::from([
                ("writeBytesPerSecond".into(), "2097152".into()),
                ("readIOPS".into(), "500".into()),
            ]),
        })
        .await
        .expect("ControllerModifyVolume");
        let ctx = krbd_lab::attach(w, &mut ctl, &mut v, 0)
            .await
            .expect("ControllerPublishVolume");
        assert_eq!(
            ctx.get(QOS_LIMITS_KEY).map(String::as_str),
            Some("writeBytesPerSecond=2097152,readIOPS=500"),
            "the volume's limits in the publish context: {ctx:?}"
        );
        let staging = w.staging(0, &v.id);
        let target = pods_target(&lab, "pv-krbd-qos");
        node.node_stage_volume(krbd_lab::stage_req(w, &v, &ctx, 0))
            .await
            .expect("stage of the RBD volume");
        // The rbd device the kernel mapped the image to, and its number.
        let mapped = vm.sh(&format!(
            "for d in /sys/bus/rbd/devices/*; do [ \"$(cat $d/name)\" = {} ] && \
             cat /sys/block/rbd${{d##*/}}/dev; done; true",
            v.image
        ));
        let rbd = mapped.trim().to_string();
        let major = vm.sh("awk '$2 == \"rbd\" {print $1}' /proc/devices");
        assert!(
            rbd.split_once(':')
                .is_some_and(|(maj, _)| maj == major.trim()),
            "image {} mapped to one rbd device (rbd's major {major:?}): {mapped:?}",
            v.image
        );
        let mut req = publish(&v.id, &staging, &target, ext4());
        req.publish_context = ctx.clone();
        req.volume_context = v.context.clone();
        req.volume_context
            .insert("csi.storage.k8s.io/pod.uid".into(), UID.into());
        node.node_publish_volume(req)
            .await
            .expect("publish of the RBD volume");
        assert_eq!(
            line_of(vm, &io_max, &rbd),
            Some(format!("{rbd} rbps=max wbps=2097152 riops=500 wiops=max")),
            "io.max of the pod's cgroup for the rbd device: {}\n{}",
            vm.read(&io_max),
            lab.log(0)
        );
        counted_then_unpublished(vm, &mut node, &pod, &v.id, &target, &rbd).await;
        node.node_unstage_volume(unstage_req(&v.id, &staging))
            .await
            .expect("unstage of the RBD volume");
        assert!(
            lab.mappings(0).is_empty(),
            "unmapped: {:?}",
            lab.mappings(0)
        );
        krbd_lab::detach(w, &mut ctl, &v, 0).await;
        krbd_lab::delete(w, &mut ctl, &v).await;
    });
    lab.vms[0].sh(&format!(
        "losetup -d {dev}; rm -f /run/moor-qos.img; rmdir {pod}; true"
    ));

    // User namespaces on this kernel, in the same guest: this test binary runs the
    // privileged test's idmapped mounts (ext4, xfs, btrfs) there.
    let exe = std::env::current_exe().expect("this test binary");
    let out = lab.vms[0].sh(&format!(
        "modprobe -a xfs btrfs; mkdir -p /run/moor-idmap && TMPDIR=/run/moor-idmap {} \
         --ignored --exact in_the_guest_a_runtime_idmaps_every_filesystem --test-threads=1 2>&1; \
         rm -rf /run/moor-idmap",
        exe.display()
    ));
    assert!(
        out.contains("1 passed"),
        "the idmapped mounts in the guest: {out}"
    );
}

/// What the test above runs inside the guest: the idmapped mounts of a runtime on each
/// filesystem moor mounts (on this machine's kernel, `privileged/tests/node.rs` runs it).
#[test]
#[ignore = "run inside a VM lab guest by a_pods_cgroup_v2_holds_its_volumes_io_max_..."]
fn in_the_guest_a_runtime_idmaps_every_filesystem() {
    moor_privileged::require_root();
    for fs in ["ext4", "xfs", "btrfs"] {
        moor_privileged::idmap::a_runtime_idmaps_a_published_volume(fs);
    }
}
