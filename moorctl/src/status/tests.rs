//! The verdicts of `status` from made-up findings (judging is pure), where the state dir comes
//! from, and the report.

use super::*;
use crate::cli::Output;

const DEV: (u32, u32) = (7, 3);

fn mounted(dev: (u32, u32)) -> LivePath {
    LivePath::Mounted {
        dev,
        rdev: None,
        source_rdev: None,
        fs_type: "xfs".into(),
    }
}

#[test]
fn a_mount_from_the_recorded_device_is_healthy() {
    assert_eq!(
        judge_path("staged", Phase::Done, false, Some(DEV), &mounted(DEV)),
        (Verdict::Healthy, None)
    );
}

#[test]
fn a_missing_mount_or_another_device_is_drift() {
    let (v, why) = judge_path(
        "published",
        Phase::Done,
        false,
        Some(DEV),
        &LivePath::NotMounted,
    );
    assert_eq!(v, Verdict::Drifted);
    assert_eq!(
        why.as_deref(),
        Some("recorded as published but nothing is mounted there")
    );
    let (v, why) = judge_path("staged", Phase::Done, false, Some(DEV), &mounted((8, 1)));
    assert_eq!(v, Verdict::Drifted);
    assert_eq!(
        why.as_deref(),
        Some("mounted from device 8:1, but the journal recorded 7:3")
    );
    let (v, _) = judge_path("staged", Phase::InProgress, false, Some(DEV), &mounted(DEV));
    assert_eq!(v, Verdict::Drifted);
}

#[test]
fn btrfs_is_matched_by_its_source_device() {
    let live = LivePath::Mounted {
        dev: (0, 52),
        rdev: None,
        source_rdev: Some(DEV),
        fs_type: "btrfs".into(),
    };
    assert_eq!(
        judge_path("staged", Phase::Done, false, Some(DEV), &live).0,
        Verdict::Healthy
    );
    assert_eq!(live_text(&live), "mounted btrfs from 7:3");
}

#[test]
fn a_block_publish_is_matched_by_the_device_node() {
    let node = LivePath::Mounted {
        dev: (0, 5),
        rdev: Some(DEV),
        source_rdev: None,
        fs_type: "devtmpfs".into(),
    };
    assert_eq!(
        judge_path("published", Phase::Done, true, Some(DEV), &node).0,
        Verdict::Healthy
    );
    assert_eq!(live_text(&node), "device node 7:3");
    assert_eq!(
        judge_path("published", Phase::Done, true, Some(DEV), &mounted(DEV)).0,
        Verdict::Drifted
    );
}

#[test]
fn a_broken_mount_is_corrupted() {
    let (v, why) = judge_path(
        "published",
        Phase::Done,
        false,
        Some(DEV),
        &LivePath::Broken(libc::ENOTCONN),
    );
    assert_eq!(v, Verdict::Corrupted);
    let why = why.unwrap_or_default();
    assert!(why.starts_with("the mount fails with ENOTCONN"), "{why}");
}

#[test]
fn device_verdicts() {
    let p = Path::new("/dev/loop3");
    assert_eq!(
        judge_device(p, DEV, &LiveDevice::Present { backing: None }).0,
        Verdict::Healthy
    );
    // A detached loop device opens and reads as 0 bytes: not gone, unknown.
    let (v, live, why) = judge_device(p, DEV, &LiveDevice::Detached);
    assert_eq!((v, live.as_str()), (Verdict::Unknown, "detached"));
    assert_eq!(
        why.as_deref(),
        Some("loop device /dev/loop3 has been detached: no backing file")
    );
    assert_eq!(
        judge_device(p, DEV, &LiveDevice::Missing).0,
        Verdict::DeviceGone
    );
    let (_, _, why) = judge_device(p, DEV, &LiveDevice::Other((7, 9)));
    assert_eq!(
        why.as_deref(),
        Some("/dev/loop3 is now device 7:9, not the recorded 7:3")
    );
}

#[test]
fn the_state_dir_comes_from_a_node_manifest() {
    let node = HashMap::from([
        ("component".to_string(), "node".to_string()),
        ("state_dir".to_string(), "/var/lib/moor-a".to_string()),
    ]);
    assert_eq!(
        state_dir_in(&node, "unix:///csi/csi.sock").unwrap(),
        PathBuf::from("/var/lib/moor-a")
    );
    let controller = HashMap::from([("component".to_string(), "controller".to_string())]);
    let e = state_dir_in(&controller, "/ctl.sock").expect_err("no state dir");
    assert_eq!(e.exit_code(), 2);
    assert_eq!(
        e.to_string(),
        "/ctl.sock does not name a node's state dir (GetPluginInfo: component \"controller\"): \
         give a moor-node's --endpoint, or --state-dir"
    );
    let relative = HashMap::from([("state_dir".to_string(), "moor".to_string())]);
    assert!(state_dir_in(&relative, "/x.sock").is_err());
    assert!(state_dir_in(&HashMap::new(), "/x.sock").is_err());
}

#[test]
fn verdicts_order_from_best_to_worst() {
    assert!(Verdict::Healthy < Verdict::Drifted);
    assert!(Verdict::Drifted < Verdict::Corrupted);
    assert!(Verdict::Corrupted < Verdict::DeviceGone);
}

#[test]
fn the_report_has_a_table_notes_and_json() {
    let vols = vec![
        VolumeStatus {
            volume_id: "vol-a".into(),
            verdict: Verdict::Healthy,
            checks: vec![Check {
                role: "device",
                path: "/dev/loop3".into(),
                journal: "7:3".into(),
                live: "7:3".into(),
                verdict: Verdict::Healthy,
                reason: None,
            }],
        },
        VolumeStatus {
            volume_id: "vol-b".into(),
            verdict: Verdict::Drifted,
            checks: vec![Check {
                role: "publish",
                path: "/k/t".into(),
                journal: "published".into(),
                live: "not mounted".into(),
                verdict: Verdict::Drifted,
                reason: Some("recorded as published but nothing is mounted there".into()),
            }],
        },
    ];
    let problems = vec![Problem {
        path: "/s/journal.log".into(),
        line: 3,
        error: "checksum mismatch".into(),
    }];
    let (report, unhealthy) = render(Path::new("/s"), &vols, &problems);
    let text = report.render(Output::Table);
    assert_eq!(
        text,
        "VOLUME  VERDICT  WHAT     PATH        JOURNAL    LIVE\n\
         vol-a   healthy  device   /dev/loop3  7:3        7:3\n\
         vol-b   drifted  publish  /k/t        published  not mounted\n\
         vol-b: recorded as published but nothing is mounted there (publish /k/t)\n\
         unreadable journal record /s/journal.log:3: checksum mismatch\n\
         2 volumes in /s: 1 healthy, 1 drifted; 1 unreadable journal record\n"
    );
    assert_eq!(
        unhealthy.as_deref(),
        Some("2 volumes in /s: 1 healthy, 1 drifted; 1 unreadable journal record")
    );
    assert_eq!(report.json["healthy"], false);
    assert_eq!(report.json["volumes"][1]["verdict"], "drifted");
    assert_eq!(report.json["volumes"][0]["checks"][0]["role"], "device");
    assert_eq!(
        report.json["journal_problems"][0]["error"],
        "checksum mismatch"
    );

    let (ok, none) = render(Path::new("/s"), &vols[..1], &[]);
    assert!(none.is_none());
    assert_eq!(ok.json["healthy"], true);
}

#[test]
fn an_rbd_mapping_is_judged_by_its_device_and_its_phase() {
    use moor_node::attach::ImageSpec;
    use moor_node::attach::journal::MappingRecord;
    let image = ImageSpec {
        cluster_id: None,
        pool: "moor".into(),
        image: "csi-vol-1".into(),
    };
    let mut m = MappingRecord::intent("fuse", &image, true, &Boot::default());
    let c = judge_mapping(&m, None);
    assert_eq!((c.role, c.verdict), ("mapping", Verdict::Drifted));
    assert!(c.journal.contains("in progress") && c.journal.contains("moor/csi-vol-1"));
    assert!(c.journal.contains("read-only"), "{}", c.journal);
    m.phase = Phase::Done;
    m.device = Some("/dev/loop3".into());
    m.rdev = Some((7, 3));
    let ok = judge_mapping(
        &m,
        Some(&LiveDevice::Present {
            backing: Some("/var/lib/moor/rbd/moor+csi-vol-1/csi-vol-1".into()),
        }),
    );
    assert_eq!(ok.verdict, Verdict::Healthy, "{ok:?}");
    assert_eq!(ok.path, std::path::PathBuf::from("/dev/loop3"));
    let gone = judge_mapping(&m, Some(&LiveDevice::Missing));
    assert_eq!(gone.verdict, Verdict::DeviceGone);
}

/// A record a power cut took back in time: after a reboot, what is not mounted of a record
/// written in the earlier boot is a memory, not drift (moor-node holds nothing by it), and the
/// report stays healthy; the same record in the boot that wrote it is drift.
#[test]
fn what_a_reboot_ended_is_remembered_not_drift() {
    use moor_node::attach::ImageSpec;
    use moor_node::attach::journal::MappingRecord;
    use moor_node::journal::{PublishRecord, StageRecord};
    use moor_node::sys::MountAttrs;
    let dir = std::env::temp_dir().join(format!("moorctl-remembered-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let (then, now) = (
        Boot::new(Some("boot-1".into())),
        Boot::new(Some("boot-2".into())),
    );
    let mut rec = VolumeRecord::new("vol-1");
    rec.stage = Some(StageRecord {
        path: dir.join("globalmount"),
        device: dir.join("no-such-device"),
        rdev: (7, 3),
        access: AccessRecord::Mount {
            fs_type: "ext4".into(),
            fs_options: vec![],
            group: None,
        },
        attrs: MountAttrs::default(),
        access_mode: 1,
        phase: Phase::Done,
        fs_uuid: None,
        boot: then.stamp(),
    });
    rec.publishes.insert(
        dir.join("mount"),
        PublishRecord {
            block: false,
            attrs: MountAttrs::default(),
            access_mode: 1,
            phase: Phase::Done,
            boot: then.stamp(),
        },
    );
    let image = ImageSpec {
        cluster_id: None,
        pool: "moor".into(),
        image: "csi-vol-1".into(),
    };
    rec.mapping = Some(MappingRecord {
        device: Some(dir.join("rbd0")),
        rdev: Some((251, 0)),
        phase: Phase::Done,
        ..MappingRecord::intent("kernel", &image, false, &then)
    });
    let table = MountTable::default();
    let after = check_volume(&rec, &table, &now);
    assert_eq!(after.verdict, Verdict::Remembered, "{after:?}");
    assert!(
        after
            .checks
            .iter()
            .all(|c| c.verdict == Verdict::Remembered),
        "{after:?}"
    );
    assert_eq!(
        after.checks.iter().map(|c| c.role).collect::<Vec<_>>(),
        ["mapping", "device", "staging", "publish"]
    );
    let (report, unhealthy) = render(Path::new("/s"), &[after], &[]);
    assert!(unhealthy.is_none(), "{unhealthy:?}");
    assert_eq!(report.json["healthy"], true);
    assert_eq!(report.json["volumes"][0]["verdict"], "remembered");
    // In the boot that wrote it, the same record is drift: its mounts and device are gone.
    let before = check_volume(&rec, &table, &then);
    assert_eq!(before.verdict, Verdict::DeviceGone, "{before:?}");
    assert!(
        before
            .checks
            .iter()
            .all(|c| c.verdict > Verdict::Remembered),
        "{before:?}"
    );
    // A record without a boot (written before moor kept one) is this boot's.
    let mut unstamped = rec.clone();
    unstamped.publishes.values_mut().for_each(|p| p.boot = None);
    let judged = check_volume(&unstamped, &table, &now);
    assert_eq!(
        judged.checks.last().map(|c| c.verdict),
        Some(Verdict::Drifted),
        "{judged:?}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
