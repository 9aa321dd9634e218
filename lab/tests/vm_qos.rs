//! A volume's QoS limits on cgroup v2, on the lab's Debian kernel: cgroup2 mounted in the
//! guest with the io controller enabled down to a pod's cgroup made as kubelet's cgroupfs
//! driver makes it (`kubepods/burstable/pod<uid>`), a local volume on a loop device staged and
//! published for that pod by moor-node in the guest, `io.max` holding the rule for the loop
//! device, direct I/O from a process in that cgroup counted in its `io.stat` on that device,
//! and the rule gone after the unpublish. (This machine's own cgroups are v1:
//! `privileged/tests/qos.rs` proves blkio there.) Then, in the same guest, user namespaces on
//! the lab's kernel: a runtime's idmapped mounts of moor's published ext4, xfs and btrfs
//! volumes (`moor_privileged::idmap`, which `privileged/tests/node.rs` runs on this machine).
//!
//! The guest's agent reaches the host over the Ceph test cluster's bridge, so this runs beside
//! that cluster (skipped, with the reason, without it or without the lab).

use std::collections::HashMap;

use moor_lab::ceph::{ext4, publish};
use moor_lab::krbd_lab::Lab;
use moor_privileged::requests::{unpublish_req, unstage_req};
use moor_privileged::{kubelets_part, runtime};
use moor_proto::csi::v1 as csi;
use moor_runtime::contract::{DEVICE_PATH_KEY, QOS_LIMITS_KEY};

const UID: &str = "9e8d7c6b-5a49-4382-a1b0-c9d8e7f6a5b4";

#[test]
fn a_pods_cgroup_v2_holds_its_volumes_io_max_and_counts_its_direct_io() {
    let test = "vm-qos";
    let Some(lab) = Lab::new(test, 1, 125) else {
        return;
    };
    let vm = &lab.vms[0];
    // cgroup v2 with the io controller down to the pod's cgroup.
    let pod = format!("/sys/fs/cgroup/kubepods/burstable/pod{UID}");
    vm.sh(&format!(
        "set -e; [ \"$(stat -f -c %T /sys/fs/cgroup)\" = cgroup2fs ] || \
         mount -t cgroup2 none /sys/fs/cgroup; \
         echo +io > /sys/fs/cgroup/cgroup.subtree_control; \
         mkdir -p /sys/fs/cgroup/kubepods/burstable; \
         echo +io > /sys/fs/cgroup/kubepods/cgroup.subtree_control; \
         echo +io > /sys/fs/cgroup/kubepods/burstable/cgroup.subtree_control; \
         mkdir -p {pod}; test -e {pod}/io.max"
    ));
    let dev = vm
        .sh("modprobe loop; truncate -s 64M /run/moor-qos.img && losetup -f --show /run/moor-qos.img")
        .trim()
        .to_string();
    let rdev = vm
        .sh(&format!(
            "echo $((0x$(stat -c %t {dev}))):$((0x$(stat -c %T {dev})))"
        ))
        .trim()
        .to_string();
    runtime().block_on(async {
        let mut node = lab.start_node(0, "moor-node", &[]).await;
        let w = &lab.world;
        let staging = w.staging(0, "vol-qos");
        let target = kubelets_part(w.nodes[0].kubelet.join(format!(
            "pods/{UID}/volumes/kubernetes.io~csi/vol-qos/mount"
        )));
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

        let io_max = vm.read(&format!("{pod}/io.max"));
        assert_eq!(
            io_max.trim(),
            format!("{rdev} rbps=8388608 wbps=4194304 riops=max wiops=2000"),
            "io.max of the pod's cgroup"
        );

        // Direct I/O from a process of the pod's cgroup, counted there on the loop device.
        let file = target.join("data").display().to_string();
        vm.sh(&format!(
            "sh -c 'echo $$ > {pod}/cgroup.procs && \
             dd if=/dev/zero of={file} bs=64k count=32 oflag=direct status=none && \
             dd if={file} of=/dev/null bs=64k iflag=direct status=none'"
        ));
        let stat = vm.read(&format!("{pod}/io.stat"));
        let line = stat
            .lines()
            .find(|l| l.starts_with(&format!("{rdev} ")))
            .unwrap_or_else(|| panic!("no line of {rdev} in io.stat: {stat}"));
        let count = |key: &str| -> u64 {
            line.split_whitespace()
                .find_map(|kv| kv.strip_prefix(&format!("{key}=")))
                .and_then(|n| n.parse().ok())
                .unwrap_or_else(|| panic!("no {key} in {line}"))
        };
        assert!(count("wbytes") >= 2 << 20, "written, counted: {line}");
        assert!(count("rbytes") >= 2 << 20, "read, counted: {line}");

        node.node_unpublish_volume(unpublish_req("vol-qos", &target))
            .await
            .expect("unpublish");
        let io_max = vm.read(&format!("{pod}/io.max"));
        assert!(
            !io_max.lines().any(|l| l.starts_with(&format!("{rdev} "))),
            "the rule after the unpublish: {io_max}"
        );
        node.node_unstage_volume(unstage_req("vol-qos", &staging))
            .await
            .expect("unstage");
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
