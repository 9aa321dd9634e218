//! Disks as a cloud attaches them, on a real kernel: virtio disks with a serial number,
//! hot-plugged into a guest of the VM lab through QEMU's monitor (`blockdev-add`, `device_add`)
//! and unplugged (`device_del`) while moor-node runs, as EBS or GCE PD attach disks to a VM.
//! NodeStageVolume names a disk only by its `deviceSerial` and finds it through udev; it waits
//! for a disk that arrives late, refuses a path whose serial is another's, and a disk pulled
//! from under a mounted volume makes that volume abnormal and touches no other.
//!
//! The guest's agent reaches the host over the Ceph test cluster's bridge, so this runs beside
//! that cluster (skipped, with the reason, without it or without the lab).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use moor_lab::ceph::{ext4, publish};
use moor_lab::krbd_lab::Lab;
use moor_privileged::requests::{unpublish_req, unstage_req};
use moor_privileged::runtime;
use moor_proto::csi::v1 as csi;
use moor_proto::csi::v1::node_client::NodeClient;
use moor_runtime::contract::{DEVICE_PATH_KEY, DEVICE_SERIAL_KEY, DEVICE_WWN_KEY};
use serde_json::json;
use tonic::transport::Channel;

const MIB: u64 = 1 << 20;

/// A disk image on the host, given to guest 0's QEMU as block node `id` (not plugged yet).
fn add_image(lab: &Lab, id: &str) {
    let file = lab.world.sb.root.join(format!("{id}.img"));
    let f = std::fs::File::create(&file).expect("disk file");
    f.set_len(128 * MIB).expect("disk size");
    let added = lab.vms[0].qmp(json!({
        "execute": "blockdev-add",
        "arguments": {
            "node-name": id,
            "driver": "raw",
            "file": {"driver": "file", "filename": file.display().to_string()},
        },
    }));
    assert!(added.get("return").is_some(), "blockdev-add {id}: {added}");
}

/// A disk image on the host, hot-plugged into guest 0 as a virtio disk with `serial`, into
/// the PCIe root port `bus`.
fn plug(lab: &Lab, id: &str, serial: &str, bus: &str) {
    add_image(lab, id);
    let plugged = lab.vms[0].qmp(json!({
        "execute": "device_add",
        "arguments": {
            "driver": "virtio-blk-pci", "id": id, "drive": id, "serial": serial, "bus": bus,
        },
    }));
    assert!(
        plugged.get("return").is_some(),
        "device_add {id}: {plugged}"
    );
}

/// A disk image on the host, hot-plugged into guest 0 as a SCSI disk (`scsi-hd`) with World
/// Wide Name `wwn` on the virtio-scsi controller `scsi0`.
fn plug_scsi(lab: &Lab, id: &str, wwn: u64) {
    add_image(lab, id);
    let plugged = lab.vms[0].qmp(json!({
        "execute": "device_add",
        "arguments": {
            "driver": "scsi-hd", "id": id, "drive": id, "bus": "scsi0.0", "wwn": wwn,
            "serial": id,
        },
    }));
    assert!(
        plugged.get("return").is_some(),
        "device_add {id}: {plugged}"
    );
}

/// The guest's SCSI disk whose WWN is `wwn`, as sysfs shows it (`naa.<hex>`).
fn scsi_disk_of(lab: &Lab, wwn: u64) -> Option<String> {
    lab.vms[0]
        .sh(&format!(
            "for d in /sys/block/sd*; do [ \"$(cat $d/device/wwid 2>/dev/null)\" = naa.{wwn:x} ] && \
             echo /dev/${{d##*/}}; done; true"
        ))
        .lines()
        .next()
        .map(str::to_string)
}

/// Unplugs disk `id` from guest 0 and waits until the guest has let it go (`gone`).
fn unplug(lab: &Lab, id: &str, gone: impl Fn() -> bool) {
    let a = lab.vms[0].qmp(json!({"execute": "device_del", "arguments": {"id": id}}));
    assert!(a.get("return").is_some(), "device_del {id}: {a}");
    let start = Instant::now();
    while !gone() {
        assert!(
            start.elapsed() < Duration::from_secs(300),
            "the guest kept disk {id} for 300 s after device_del"
        );
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// The guest's block device with `serial`, as sysfs shows it.
fn disk_of(lab: &Lab, serial: &str) -> Option<String> {
    lab.vms[0]
        .sh(&format!(
            "for d in /sys/block/vd*; do [ \"$(cat $d/serial 2>/dev/null)\" = {serial} ] && \
             echo /dev/${{d##*/}}; done; true"
        ))
        .lines()
        .next()
        .map(str::to_string)
}

/// A stage whose disk arrives while it waits: the same NodeStageVolume twice at once (the
/// one the node takes first waits for the disk, the other is ABORTED: which is which is the
/// server's choice), then `plug`, then the waiting call must finish on the disk.
async fn stage_a_late_disk(
    node: &NodeClient<Channel>,
    req: csi::NodeStageVolumeRequest,
    plug: impl FnOnce(),
) {
    let call = |req: csi::NodeStageVolumeRequest| {
        let mut node = node.clone();
        tokio::spawn(async move { node.node_stage_volume(req).await })
    };
    let mut first = call(req.clone());
    let mut second = call(req);
    let (done, waiting) = tokio::select! {
        r = &mut first => (r, second),
        r = &mut second => (r, first),
    };
    match done.expect("a stage's task") {
        Err(e) if e.code() == tonic::Code::Aborted => {}
        other => panic!("one of two stages of a volume at once is ABORTED: {other:?}"),
    }
    plug();
    waiting
        .await
        .expect("the stage's task")
        .expect("a stage that waited for its disk");
}

fn stage_req(lab: &Lab, vol: &str, ctx: &[(&str, &str)]) -> csi::NodeStageVolumeRequest {
    csi::NodeStageVolumeRequest {
        volume_id: vol.into(),
        publish_context: ctx
            .iter()
            .map(|(k, v)| ((*k).to_string(), (*v).to_string()))
            .collect::<HashMap<_, _>>(),
        staging_target_path: lab.world.staging(0, vol).display().to_string(),
        volume_capability: Some(ext4()),
        ..Default::default()
    }
}

fn condition(
    stats: Result<tonic::Response<csi::NodeGetVolumeStatsResponse>, tonic::Status>,
) -> csi::VolumeCondition {
    stats
        .expect("NodeGetVolumeStats")
        .into_inner()
        .volume_condition
        .expect("a condition")
}

#[test]
fn disks_attached_and_pulled_as_a_cloud_does() {
    let test = "vm-disks";
    let Some(mut lab) = Lab::with_udev(test, 1, 100) else {
        return;
    };
    runtime().block_on(async {
        let mut node = lab
            .start_node(0, "moor-node", &["MOOR_DEVICE_WAIT=120"])
            .await;
        let w = &lab.world;
        // A disk attached before the call: found by its serial alone, formatted, mounted.
        plug(&lab, "disk-a", "moor-a", "hp0");
        node.node_stage_volume(stage_req(&lab, "vol-a", &[(DEVICE_SERIAL_KEY, "moor-a")]))
            .await
            .expect("stage by serial");
        node.node_publish_volume(publish(
            "vol-a",
            &w.staging(0, "vol-a"),
            &w.target(0, "vol-a"),
            ext4(),
        ))
        .await
        .expect("publish a");
        let file_a = w.target(0, "vol-a").join("data").display().to_string();
        lab.vms[0].sh(&format!(
            "printf 'on disk a' | dd of={file_a} conv=fsync status=none"
        ));

        // A disk that arrives while NodeStageVolume waits for it: of two calls at once, one is
        // ABORTED while the other waits; then the disk is attached, and the waiting call
        // finishes on it.
        let req_b = stage_req(&lab, "vol-b", &[(DEVICE_SERIAL_KEY, "moor-b")]);
        stage_a_late_disk(&node, req_b, || plug(&lab, "disk-b", "moor-b", "hp1")).await;
        let dev_b = disk_of(&lab, "moor-b").expect("disk b in the guest");

        // A path whose disk is another's: disk a's node named for a volume whose serial is
        // not there. Refused, and disk a is untouched.
        let dev_a = disk_of(&lab, "moor-a").expect("disk a in the guest");
        let wrong = node
            .node_stage_volume(stage_req(
                &lab,
                "vol-c",
                &[(DEVICE_PATH_KEY, &dev_a), (DEVICE_SERIAL_KEY, "moor-c")],
            ))
            .await
            .expect_err("a path whose serial is another's");
        eprintln!(
            "{test}: a path whose serial is another's: {:?}",
            wrong.code()
        );
        assert_eq!(lab.vms[0].read(&file_a), "on disk a");

        // Disk b pulled from under its mounted volume: abnormal; vol-a is healthy.
        unplug(&lab, "disk-b", || disk_of(&lab, "moor-b").is_none());
        let stats = |vol: &str| csi::NodeGetVolumeStatsRequest {
            volume_id: vol.into(),
            volume_path: w.staging(0, vol).display().to_string(),
            staging_target_path: String::new(),
        };
        let b = condition(node.node_get_volume_stats(stats("vol-b")).await);
        assert!(b.abnormal, "a pulled disk: {b:?}");
        eprintln!(
            "{test}: the condition of a volume whose disk was pulled: {}",
            b.message
        );
        let a = condition(node.node_get_volume_stats(stats("vol-a")).await);
        assert!(!a.abnormal, "the other volume: {a:?}");
        assert_eq!(lab.vms[0].read(&file_a), "on disk a");
        // Its unstage converges (kubelet retries what fails).
        let start = Instant::now();
        while let Err(e) = node
            .node_unstage_volume(unstage_req("vol-b", &w.staging(0, "vol-b")))
            .await
        {
            assert!(
                start.elapsed() < Duration::from_secs(300),
                "the unstage of a pulled disk's volume did not converge: {e:?}"
            );
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        let mounted = lab.vms[0].sh("cat /proc/self/mountinfo");
        assert!(!mounted.contains(&dev_b), "{mounted}");
        assert!(!mounted.contains("vol-b"), "{mounted}");

        node.node_unpublish_volume(unpublish_req("vol-a", &w.target(0, "vol-a")))
            .await
            .expect("unpublish a");
        node.node_unstage_volume(unstage_req("vol-a", &w.staging(0, "vol-a")))
            .await
            .expect("unstage a");
        unplug(&lab, "disk-a", || disk_of(&lab, "moor-a").is_none());
    });
    lab.vms.clear();
}

/// The WWNs of the disks of the WWN test, and one no disk has.
const WWN_W: u64 = 0x5000_c500_a1b2_c3d4;
const WWN_X: u64 = 0x5000_c500_a1b2_c3d5;
const WWN_NONE: u64 = 0x5000_c500_a1b2_c3d6;

/// The same for SCSI disks named by their World Wide Name alone (`deviceWWN`), as a cloud
/// whose disks carry one names them: a virtio-scsi controller hot-plugged into a free root
/// port, `scsi-hd` disks with a `wwn` hot-plugged on it. Runs in a guest of its own, beside
/// the serial test.
#[test]
fn disks_named_by_their_wwn() {
    let test = "vm-disks-wwn";
    let started = Instant::now();
    let Some(mut lab) = Lab::with_udev(test, 1, 105) else {
        return;
    };
    let hba = lab.vms[0].qmp(json!({
        "execute": "device_add",
        "arguments": {"driver": "virtio-scsi-pci", "id": "scsi0", "bus": "hp0"},
    }));
    assert!(
        hba.get("return").is_some(),
        "device_add virtio-scsi-pci: {hba}"
    );
    runtime().block_on(async {
        let mut node = lab
            .start_node(0, "moor-node", &["MOOR_DEVICE_WAIT=120"])
            .await;
        let w = &lab.world;
        let wwn = |n: u64| format!("{n:#x}");
        plug_scsi(&lab, "disk-w", WWN_W);
        node.node_stage_volume(stage_req(&lab, "vol-w", &[(DEVICE_WWN_KEY, &wwn(WWN_W))]))
            .await
            .expect("stage by WWN");
        let dev_w = scsi_disk_of(&lab, WWN_W).expect("disk w in the guest");
        eprintln!(
            "{test}: what the guest's udev and sysfs say of {dev_w}: {}",
            lab.vms[0].sh(&format!(
                "udevadm info -q property -n {dev_w} | grep WWN; cat /sys/block/{}/device/wwid; true",
                dev_w.trim_start_matches("/dev/")
            ))
        );
        node.node_publish_volume(publish(
            "vol-w",
            &w.staging(0, "vol-w"),
            &w.target(0, "vol-w"),
            ext4(),
        ))
        .await
        .expect("publish w");
        let file_w = w.target(0, "vol-w").join("data").display().to_string();
        lab.vms[0].sh(&format!(
            "printf 'on disk w' | dd of={file_w} conv=fsync status=none"
        ));

        // A disk that arrives while the stage waits for it.
        let req_x = stage_req(&lab, "vol-x", &[(DEVICE_WWN_KEY, &wwn(WWN_X))]);
        stage_a_late_disk(&node, req_x, || plug_scsi(&lab, "disk-x", WWN_X)).await;

        // A path whose WWN is another's: refused, disk w untouched.
        let wrong = node
            .node_stage_volume(stage_req(
                &lab,
                "vol-y",
                &[(DEVICE_PATH_KEY, &dev_w), (DEVICE_WWN_KEY, &wwn(WWN_NONE))],
            ))
            .await
            .expect_err("a path whose WWN is another's");
        eprintln!("{test}: a path whose WWN is another's: {wrong:?}");
        assert_eq!(wrong.code(), tonic::Code::FailedPrecondition, "{wrong:?}");
        assert_eq!(lab.vms[0].read(&file_w), "on disk w");

        // Disk x pulled from under its staged volume: abnormal, vol-w healthy, the unstage
        // converges.
        unplug(&lab, "disk-x", || scsi_disk_of(&lab, WWN_X).is_none());
        let stats = |vol: &str| csi::NodeGetVolumeStatsRequest {
            volume_id: vol.into(),
            volume_path: w.staging(0, vol).display().to_string(),
            staging_target_path: String::new(),
        };
        let x = condition(node.node_get_volume_stats(stats("vol-x")).await);
        assert!(x.abnormal, "a pulled disk: {x:?}");
        let a = condition(node.node_get_volume_stats(stats("vol-w")).await);
        assert!(!a.abnormal, "the other volume: {a:?}");
        let start = Instant::now();
        while let Err(e) = node
            .node_unstage_volume(unstage_req("vol-x", &w.staging(0, "vol-x")))
            .await
        {
            assert!(
                start.elapsed() < Duration::from_secs(300),
                "the unstage of a pulled disk's volume did not converge: {e:?}"
            );
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        assert_eq!(lab.vms[0].read(&file_w), "on disk w");
        node.node_unpublish_volume(unpublish_req("vol-w", &w.target(0, "vol-w")))
            .await
            .expect("unpublish w");
        node.node_unstage_volume(unstage_req("vol-w", &w.staging(0, "vol-w")))
            .await
            .expect("unstage w");
        unplug(&lab, "disk-w", || scsi_disk_of(&lab, WWN_W).is_none());
    });
    lab.vms.clear();
    eprintln!("{test}: {:.1} s", started.elapsed().as_secs_f64());
}
