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

use moor_privileged::ceph::{ext4, publish};
use moor_privileged::krbd_lab::Lab;
use moor_privileged::requests::{unpublish_req, unstage_req};
use moor_privileged::runtime;
use moor_proto::csi::v1 as csi;
use moor_runtime::contract::{DEVICE_PATH_KEY, DEVICE_SERIAL_KEY};
use serde_json::json;

const MIB: u64 = 1 << 20;

/// A disk image on the host, hot-plugged into guest 0 as a virtio disk with `serial`, into
/// the PCIe root port `bus`.
fn plug(lab: &Lab, id: &str, serial: &str, bus: &str) {
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

/// Unplugs disk `id` from guest 0 and waits until the guest has let it go.
fn unplug(lab: &Lab, id: &str, serial: &str) {
    let a = lab.vms[0].qmp(json!({"execute": "device_del", "arguments": {"id": id}}));
    assert!(a.get("return").is_some(), "device_del {id}: {a}");
    let start = Instant::now();
    while disk_of(lab, serial).is_some() {
        assert!(
            start.elapsed() < Duration::from_secs(300),
            "the guest kept disk {serial} for 300 s after device_del"
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
    let Some(mut lab) = Lab::new(test, 1, 100) else {
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

        // A disk that arrives while NodeStageVolume waits for it: the call is in flight (a
        // second one for the volume is ABORTED), then the disk is attached, and the first
        // call finishes on it.
        let req_b = stage_req(&lab, "vol-b", &[(DEVICE_SERIAL_KEY, "moor-b")]);
        let mut waiting = node.clone();
        let late = tokio::spawn({
            let req = req_b.clone();
            async move { waiting.node_stage_volume(req).await }
        });
        let start = Instant::now();
        loop {
            tokio::task::yield_now().await;
            match node.node_stage_volume(req_b.clone()).await {
                Err(e) if e.code() == tonic::Code::Aborted => break,
                other => {
                    assert!(
                        start.elapsed() < Duration::from_secs(60),
                        "the first stage of vol-b was never seen in flight: {other:?}"
                    );
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
        plug(&lab, "disk-b", "moor-b", "hp1");
        late.await
            .expect("the stage's task")
            .expect("a stage that waited for its disk");
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
        unplug(&lab, "disk-b", "moor-b");
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
        unplug(&lab, "disk-a", "moor-a");
    });
    lab.vms.clear();
}
