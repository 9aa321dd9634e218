//! A device that fails under a mounted volume, on a real kernel: in a guest of the VM lab, a
//! volume's device is a device-mapper device whose table is switched, while the volume is
//! staged and a pod-like writer appends and fsyncs, from `linear` to `flakey` (writes dropped
//! silently, then every I/O failing) and back to `linear`, beside a second, healthy volume.
//! moor-node reports the failing volume abnormal (ext4 aborted its journal and went read-only)
//! for as long as its filesystem is failing, never formats either device, never touches the
//! healthy volume; after unpublish and unstage, the next stage's `e2fsck -p` repairs it and what
//! the pod fsynced before the failure is there.
//!
//! Runs beside the Ceph test cluster (the guest's agent reaches the host over its bridge);
//! skipped, with the reason, without it or without the lab.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use moor_lab::ceph::publish;
use moor_lab::krbd_lab::Lab;
use moor_privileged::requests::{cap, unpublish_req, unstage_req};
use moor_privileged::runtime;
use moor_proto::csi::v1 as csi;
use moor_proto::csi::v1::node_client::NodeClient;
use moor_runtime::contract::DEVICE_PATH_KEY;
use tonic::transport::Channel;

const MIB: u64 = 1 << 20;
const SECTORS: u64 = 128 * MIB / 512;
/// The volume whose device fails, and the healthy one beside it.
const FAILING: &str = "vol-flakey";
const HEALTHY: &str = "vol-healthy";
const SYNCED: &str = "fsynced before the failure";

fn stage_req(lab: &Lab, vol: &str) -> csi::NodeStageVolumeRequest {
    csi::NodeStageVolumeRequest {
        volume_id: vol.into(),
        publish_context: HashMap::from([(DEVICE_PATH_KEY.into(), format!("/dev/mapper/{vol}"))]),
        staging_target_path: lab.world.staging(0, vol).display().to_string(),
        volume_capability: Some(cap("ext4")),
        ..Default::default()
    }
}

fn file(lab: &Lab, vol: &str, name: &str) -> String {
    lab.world.target(0, vol).join(name).display().to_string()
}

/// Loads `table` into device `vol` (suspended without freezing its filesystem, which a
/// failing device could not finish).
fn switch(lab: &Lab, vol: &str, table: &str) {
    lab.vms[0].sh(&format!(
        "dmsetup suspend --nolockfs {vol} && dmsetup reload {vol} --table '{table}' && \
         dmsetup resume {vol}"
    ));
}

async fn condition(node: &mut NodeClient<Channel>, lab: &Lab, vol: &str) -> csi::VolumeCondition {
    node.node_get_volume_stats(csi::NodeGetVolumeStatsRequest {
        volume_id: vol.into(),
        volume_path: lab.world.target(0, vol).display().to_string(),
        staging_target_path: String::new(),
    })
    .await
    .expect("NodeGetVolumeStats")
    .into_inner()
    .volume_condition
    .expect("a condition")
}

/// Removes the devices, after unmounting whatever is on them; also when the test failed.
fn teardown(lab: &Lab) {
    let kubelet = lab.world.nodes[0].kubelet.display().to_string();
    let out = lab.vms[0].exec(&[
        "sh",
        "-c",
        &format!(
            "pkill -KILL -f pod-[w]riter; pkill -KILL -x moor-node; \
             while pgrep -x moor-node >/dev/null; do sleep 0.1; done; \
             for m in $(findmnt -rn -o TARGET | grep -E '^{kubelet}(/|$)' | sort -r); \
             do umount \"$m\"; done; \
             for d in {FAILING} {HEALTHY}; do \
             if dmsetup info $d >/dev/null 2>&1; then dmsetup remove --retry $d || exit 1; fi; \
             done; losetup -D"
        ),
    ]);
    assert!(
        out.ok(),
        "teardown in the guest: {}{}",
        out.stdout,
        out.stderr
    );
}

#[test]
fn a_device_that_fails_under_a_mounted_volume() {
    let test = "vm-flakey";
    let started = Instant::now();
    let Some(lab) = Lab::new(test, 1, 106) else {
        return;
    };
    let booted = started.elapsed();
    let dir = lab.world.nodes[0].state.clone();
    let mut script = String::from("set -e; modprobe loop; modprobe dm-flakey\n");
    for vol in [FAILING, HEALTHY] {
        let image = dir.join(format!("{vol}.img"));
        std::fs::File::create(&image)
            .and_then(|f| f.set_len(128 * MIB))
            .expect("image");
        script += &format!(
            "B=$(losetup -f --show {}); echo $B > {}/{vol}.loop; \
             dmsetup create {vol} --table \"0 {SECTORS} linear $B 0\"\n",
            image.display(),
            dir.display()
        );
    }
    lab.vms[0].sh(&script);
    let backing = lab.vms[0]
        .read(&format!("{}/{FAILING}.loop", dir.display()))
        .trim()
        .to_string();
    let linear = format!("0 {SECTORS} linear {backing} 0");
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        runtime().block_on(life(&lab, &backing, &linear));
    }));
    teardown(&lab);
    if let Err(e) = result {
        eprintln!("{test}: moor-node's log:\n{}", lab.log(0));
        std::panic::resume_unwind(e);
    }
    eprintln!(
        "{test}: {:.1} s in all, {:.1} s of it the guest's boot",
        started.elapsed().as_secs_f64(),
        booted.as_secs_f64()
    );
}

async fn life(lab: &Lab, backing: &str, linear: &str) {
    let test = "vm-flakey";
    let w = &lab.world;
    let vm = &lab.vms[0];
    let mut node = lab.start_node(0, "moor-node", &[]).await;
    for vol in [FAILING, HEALTHY] {
        node.node_stage_volume(stage_req(lab, vol))
            .await
            .unwrap_or_else(|e| panic!("stage {vol}: {e:?}"));
        node.node_publish_volume(publish(
            vol,
            &w.staging(0, vol),
            &w.target(0, vol),
            cap("ext4"),
        ))
        .await
        .unwrap_or_else(|e| panic!("publish {vol}: {e:?}"));
        vm.sh(&format!(
            "printf %s '{SYNCED}' | dd of={} conv=fsync status=none",
            file(lab, vol, "synced")
        ));
        let c = condition(&mut node, lab, vol).await;
        assert!(!c.abnormal, "{vol} before the failure: {c:?}");
    }

    let healthy_mounts = || -> Vec<String> {
        vm.sh("cat /proc/self/mountinfo")
            .lines()
            .filter(|l| l.contains(HEALTHY))
            .map(str::to_string)
            .collect()
    };
    let before = healthy_mounts();
    assert_eq!(
        before.len(),
        2,
        "the healthy volume's two mounts: {before:?}"
    );

    // A pod appends and fsyncs a sequence number a line, and keeps going through errors.
    let log = file(lab, FAILING, "seq");
    let writer = vm.spawn(
        &[
            "sh",
            "-c",
            &format!(
                "i=0; while :; do i=$((i+1)); \
                 echo $i | dd of={log} oflag=append conv=notrunc,fsync status=none || sleep 0.2; \
                 done"
            ),
            "pod-writer",
        ],
        "/dev/null",
    );
    let lines = || vm.read(&log).lines().count();
    let wait_for = |what: &str, ok: &dyn Fn() -> bool| {
        let start = Instant::now();
        while !ok() {
            assert!(
                start.elapsed() < Duration::from_secs(120),
                "{test}: waited 120 s for {what}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    };
    wait_for("the pod's first writes", &|| lines() >= 5);

    // Writes silently dropped for a while: nothing the kernel can see.
    switch(
        lab,
        FAILING,
        &format!("0 {SECTORS} flakey {backing} 0 0 1 1 drop_writes"),
    );
    let at = lines();
    wait_for("the pod's writes while they were dropped", &|| {
        lines() >= at + 5
    });
    // Then every I/O fails: the pod's fsync fails, ext4 aborts its journal.
    switch(lab, FAILING, &format!("0 {SECTORS} flakey {backing} 0 0 1"));
    let start = Instant::now();
    let failing = loop {
        let c = condition(&mut node, lab, FAILING).await;
        if c.abnormal {
            break c;
        }
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "{test}: the volume was not abnormal within 120 s of its device failing: {c:?}"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    eprintln!(
        "{test}: abnormal {:.1} s after every I/O began to fail: {}",
        start.elapsed().as_secs_f64(),
        failing.message
    );
    let healthy = condition(&mut node, lab, HEALTHY).await;
    assert!(!healthy.abnormal, "the healthy volume: {healthy:?}");

    // Healthy again below: the filesystem stays failed until it is checked.
    switch(lab, FAILING, linear);
    vm.exec(&["kill", "-KILL", &writer.to_string()]);
    let after = condition(&mut node, lab, FAILING).await;
    assert!(
        after.abnormal,
        "a filesystem that failed, its device healthy again: {after:?}"
    );
    eprintln!("{test}: its device healthy again: {}", after.message);
    eprintln!(
        "{test}: in the guest: {}",
        vm.exec(&[
            "sh",
            "-c",
            "dmesg | grep -iE 'ext4|jbd2|I/O error' | tail -8; \
             for f in /sys/fs/ext4/dm-*/errors_count; do echo $f $(cat $f); done"
        ])
        .stdout
    );
    let healthy = condition(&mut node, lab, HEALTHY).await;
    assert!(!healthy.abnormal, "the healthy volume: {healthy:?}");
    assert_eq!(vm.read(&file(lab, HEALTHY, "synced")), SYNCED);

    // kubelet unpublishes, unstages and stages again: e2fsck -p at the stage.
    node.node_unpublish_volume(unpublish_req(FAILING, &w.target(0, FAILING)))
        .await
        .expect("unpublish the failed volume");
    node.node_unstage_volume(unstage_req(FAILING, &w.staging(0, FAILING)))
        .await
        .expect("unstage the failed volume");
    // What the failed filesystem recorded on its device once the device was healthy again.
    let superblock = || {
        vm.sh(&format!(
            "dumpe2fs -h /dev/mapper/{FAILING} 2>/dev/null | grep -E '^(Filesystem state|FS Error)'"
        ))
    };
    let recorded = superblock();
    eprintln!("{test}: the superblock after the unstage: {recorded}");
    assert!(
        recorded.contains("with errors") && recorded.contains("FS Error count"),
        "the errors recorded on the device: {recorded}"
    );
    let logged = lab.log(0).lines().count();
    node.node_stage_volume(stage_req(lab, FAILING))
        .await
        .unwrap_or_else(|e| panic!("the stage after the failure: {e:?}\n{}", lab.log(0)));
    // e2fsck -p checked the whole filesystem and cleared the errors before the mount.
    let checked = superblock();
    eprintln!(
        "{test}: the superblock after the stage: {checked}; the stage logged: {:#?}",
        lab.log(0).lines().skip(logged).collect::<Vec<_>>()
    );
    assert!(
        !checked.contains("with errors") && !checked.contains("FS Error count"),
        "the stage's check: {checked}"
    );
    node.node_publish_volume(publish(
        FAILING,
        &w.staging(0, FAILING),
        &w.target(0, FAILING),
        cap("ext4"),
    ))
    .await
    .expect("publish after the failure");
    assert_eq!(vm.read(&file(lab, FAILING, "synced")), SYNCED);
    let c = condition(&mut node, lab, FAILING).await;
    assert!(!c.abnormal, "checked and mounted again: {c:?}");
    let healthy = condition(&mut node, lab, HEALTHY).await;
    assert!(!healthy.abnormal, "the healthy volume: {healthy:?}");

    // Each device formatted once in its life, and the healthy volume's mounts untouched.
    for vol in [FAILING, HEALTHY] {
        assert_eq!(
            lab.formats(0, vol),
            1,
            "{vol} formatted once:\n{}",
            lab.log(0)
        );
    }
    assert_eq!(healthy_mounts(), before, "the healthy volume's mounts");
    for vol in [FAILING, HEALTHY] {
        node.node_unpublish_volume(unpublish_req(vol, &w.target(0, vol)))
            .await
            .unwrap_or_else(|e| panic!("unpublish {vol}: {e:?}"));
        node.node_unstage_volume(unstage_req(vol, &w.staging(0, vol)))
            .await
            .unwrap_or_else(|e| panic!("unstage {vol}: {e:?}"));
    }
}
