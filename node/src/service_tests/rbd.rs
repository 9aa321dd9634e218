//! RBD volumes through the gRPC service layer, on the fake OS and the fake attacher: the map
//! before the stage and the unmap after the unstage, their journal records, what a failure
//! of each step leaves, and the reconciliation of what a crash cut short.

use std::sync::Arc;

use super::*;
use crate::attach::fake::{AttachCall, Failure, FakeAttacher, image_file};
use crate::attach::journal::MappingRecord;
use crate::attach::{Attacher as _, ImageSpec};
use crate::journal::{Boot, Durability, Phase};
use crate::reconcile::{Action, Reconciler};
use moor_runtime::contract::{
    RBD_IMAGE_KEY as IMAGE_KEY, RBD_MONITORS_KEY as MONITORS_KEY, RBD_POOL_KEY as POOL_KEY,
    RBD_USER_ID_SECRET as USER_ID_KEY, RBD_USER_KEY_SECRET as USER_KEY_KEY,
};

const KEY: &str = "AQBkQkNnAAAAABAAbm9vcmtleW5vb3JrZXlub29yaw==";
const BLOCK_TARGET: &str =
    "/var/lib/kubelet/plugins/kubernetes.io/csi/volumeDevices/publish/pv1/p1";

pub(crate) struct Rbd {
    pub(crate) h: Harness,
    pub(crate) attacher: Arc<FakeAttacher>,
}

pub(crate) fn rbd_harness() -> Rbd {
    rbd_harness_in(&Boot::default())
}

/// [`rbd_harness`] in boot `boot`.
fn rbd_harness_in(boot: &Boot) -> Rbd {
    let mut h = harness();
    let attacher = Arc::new(FakeAttacher::new(Arc::clone(&h.os), GIB));
    let journal = Arc::clone(h.engine.journal());
    let cfg = EngineConfig {
        boot: boot.clone(),
        ..h.engine.config().clone()
    };
    let engine = Arc::new(
        Engine::new(Arc::clone(&h.os), journal, cfg).with_attacher(Some(
            Arc::clone(&attacher) as Arc<dyn crate::attach::Attacher>
        )),
    );
    h.svc = NodeService::new(Arc::clone(&engine), h.info.clone());
    h.engine = engine;
    Rbd { h, attacher }
}

/// The image the harness's RBD volume maps.
pub(crate) fn image() -> ImageSpec {
    ImageSpec {
        cluster_id: None,
        pool: "moor".into(),
        image: "csi-vol-1".into(),
    }
}

/// NodeStageVolume of `volume`, mapping [`image`], at STAGING.
pub(crate) fn rbd_stage(volume: &str, cap: csi::VolumeCapability) -> csi::NodeStageVolumeRequest {
    csi::NodeStageVolumeRequest {
        volume_id: volume.into(),
        publish_context: HashMap::from([
            (POOL_KEY.into(), "moor".into()),
            (IMAGE_KEY.into(), "csi-vol-1".into()),
            (MONITORS_KEY.into(), "10.0.0.1:6789".into()),
        ]),
        staging_target_path: STAGING.into(),
        volume_capability: Some(cap),
        secrets: HashMap::from([
            (USER_ID_KEY.into(), "moor".into()),
            (USER_KEY_KEY.into(), KEY.into()),
        ]),
        volume_context: HashMap::new(),
    }
}

/// [`kubelet_call`] for the harness's RBD volume (its stage maps [`image`]).
pub(crate) async fn rbd_kubelet_call<O: crate::sys::Os>(
    svc: &NodeService<O>,
    call: KubeletCall,
) -> Result<(), tonic::Status> {
    match call {
        KubeletCall::Stage => svc
            .node_stage_volume(Request::new(rbd_stage("vol-1", ext4())))
            .await
            .map(drop),
        other => kubelet_call(svc, other).await,
    }
}

/// Nothing half-done with the image's mapping: it is mapped exactly when `mapped`, never
/// twice, and the journal records that mapping (done, on its device, under the volume's stage)
/// and no other.
pub(crate) fn check_mapping<O: crate::sys::Os>(
    engine: &Engine<O>,
    attacher: &FakeAttacher,
    name: &str,
    mapped: bool,
) {
    assert_eq!(attacher.doubles(), 0, "{name}: mapped twice");
    let live = attacher.mapping_of(&image());
    assert_eq!(
        attacher.mapped(),
        if mapped { vec![image()] } else { Vec::new() },
        "{name}: what is mapped"
    );
    let recorded: Vec<_> = engine
        .journal()
        .all()
        .into_iter()
        .filter_map(|r| r.mapping.map(|m| (r.volume_id, r.stage, m)))
        .collect();
    match (&live, recorded.as_slice()) {
        (None, []) => {}
        (Some(live), [(volume, stage, m)]) => {
            assert_eq!((volume.as_str(), m.spec()), ("vol-1", image()), "{name}");
            assert_eq!(m.phase, Phase::Done, "{name}: {m:?}");
            assert_eq!(
                (m.device.as_ref(), m.rdev),
                (Some(&live.device), Some(live.rdev)),
                "{name}: {m:?}"
            );
            let st = stage.as_ref().expect("a mapped volume is staged");
            assert_eq!((&st.device, st.rdev), (&live.device, live.rdev), "{name}");
        }
        (live, recorded) => {
            panic!("{name}: mapped {live:?}, while the journal records {recorded:?}")
        }
    }
}

async fn stage(r: &Rbd, cap: csi::VolumeCapability) -> Result<(), tonic::Status> {
    r.h.svc
        .node_stage_volume(Request::new(rbd_stage("vol-1", cap)))
        .await
        .map(drop)
}

async fn unstage(r: &Rbd) -> Result<(), tonic::Status> {
    r.h.svc
        .node_unstage_volume(Request::new(unstage_req()))
        .await
        .map(drop)
}

fn mapping(r: &Rbd) -> Option<MappingRecord> {
    r.h.engine.journal().get("vol-1").and_then(|v| v.mapping)
}

fn maps(r: &Rbd) -> usize {
    count_attach(r, |c| matches!(c, AttachCall::Map(..)))
}

fn unmaps(r: &Rbd) -> usize {
    count_attach(r, |c| matches!(c, AttachCall::Unmap(..)))
}

fn count_attach(r: &Rbd, pred: impl Fn(&AttachCall) -> bool) -> usize {
    r.attacher.calls().iter().filter(|c| pred(c)).count()
}

fn reconcile(r: &Rbd) -> Vec<Action> {
    Reconciler::new(Arc::clone(&r.h.engine), "moor.csi.io")
        .run()
        .expect("reconcile")
}

#[tokio::test]
async fn a_stage_maps_then_stages_and_an_unstage_unstages_then_unmaps() {
    let r = rbd_harness();
    stage(&r, ext4()).await.expect("stage");
    assert_eq!(r.attacher.calls(), vec![AttachCall::Map(image(), false)]);
    let m = mapping(&r).expect("mapping recorded");
    assert_eq!(m.phase, Phase::Done);
    assert_eq!((m.pool.as_str(), m.image.as_str()), ("moor", "csi-vol-1"));
    let device = m.device.clone().expect("device");
    let staged = r.h.engine.journal().get("vol-1").and_then(|v| v.stage);
    assert_eq!(staged.map(|s| s.device), Some(device.clone()));
    assert_eq!(r.h.os.mount_depth(STAGING), 1);
    assert_eq!(mkfs_calls(&r.h), 1);
    // The journal never holds the key.
    let log = std::fs::read_to_string(r.h.state.join("journal.log")).unwrap();
    assert!(!log.contains(KEY) && log.contains("csi-vol-1"), "{log}");

    // The unmap comes after the unmount: the fake refuses to unmap a mounted device.
    unstage(&r).await.expect("unstage");
    assert_eq!(r.h.os.mount_depth(STAGING), 0);
    assert_eq!(unmaps(&r), 1);
    assert!(r.attacher.mapped().is_empty());
    assert!(!r.h.os.exists(&device));
    assert!(r.h.engine.journal().get("vol-1").is_none());

    // Staged again: mapped again (another device), and the filesystem is the one made the
    // first time.
    stage(&r, ext4()).await.expect("restage");
    assert_eq!(maps(&r), 2);
    assert_eq!(mkfs_calls(&r.h), 1, "formatted once");
    assert_ne!(mapping(&r).and_then(|m| m.device), Some(device));
}

#[tokio::test]
async fn a_repeated_stage_reuses_the_mapping_and_never_maps_twice() {
    let r = rbd_harness();
    stage(&r, ext4()).await.expect("stage");
    stage(&r, ext4()).await.expect("repeat");
    assert_eq!(maps(&r), 1);
    assert_eq!(r.attacher.doubles(), 0);
    // A mapping the journal lost (made by a run that crashed before recording it): found
    // and reused.
    let r = rbd_harness();
    let live = r.attacher.map_unrecorded(&image(), false);
    stage(&r, ext4()).await.expect("stage");
    assert_eq!(maps(&r), 0);
    assert_eq!(mapping(&r).and_then(|m| m.device), Some(live.device));
}

#[tokio::test]
async fn a_stage_that_fails_after_the_map_unmaps() {
    let r = rbd_harness();
    r.h.os.fail_tool("mkfs.ext4", 1);
    let e = stage(&r, ext4()).await.expect_err("mkfs fails");
    assert_eq!(e.code(), Code::Internal);
    assert_eq!(maps(&r), 1);
    assert_eq!(unmaps(&r), 1);
    assert!(r.attacher.mapped().is_empty());
    // The Formatting intent a failed mkfs leaves guards the device; the mapping goes.
    assert_eq!(mapping(&r), None);
    // The retry maps and stages.
    stage(&r, ext4()).await.expect("retry");
    assert_eq!(r.h.os.mount_depth(STAGING), 1);

    // A stage that fails on a staged volume (another capability) leaves it mapped.
    let xfs = mount_cap("xfs", &[], Mode::SingleNodeWriter);
    let e = stage(&r, xfs).await.expect_err("incompatible");
    assert_eq!(e.code(), Code::AlreadyExists);
    assert_eq!(r.attacher.mapped(), vec![image()]);
    assert_eq!(r.h.os.mount_depth(STAGING), 1);
}

#[tokio::test]
async fn a_map_that_fails_leaves_no_record_and_one_past_its_deadline_is_reused() {
    let r = rbd_harness();
    r.attacher.fail_next_map(Failure::Fail);
    assert_eq!(stage(&r, ext4()).await.unwrap_err().code(), Code::Internal);
    assert!(r.h.engine.journal().get("vol-1").is_none());
    r.attacher.fail_next_map(Failure::NotFound);
    assert_eq!(stage(&r, ext4()).await.unwrap_err().code(), Code::NotFound);
    assert!(r.h.engine.journal().get("vol-1").is_none());

    // Past its deadline, the map finished anyway: its intent stays, and kubelet's retry
    // finds the mapping instead of making a second.
    r.attacher.fail_next_map(Failure::Timeout);
    let e = stage(&r, ext4()).await.unwrap_err();
    assert_eq!(e.code(), Code::DeadlineExceeded);
    assert_eq!(mapping(&r).map(|m| m.phase), Some(Phase::InProgress));
    stage(&r, ext4()).await.expect("retry");
    assert_eq!(maps(&r), 3);
    assert_eq!(r.attacher.doubles(), 0);
    assert_eq!(mapping(&r).map(|m| m.phase), Some(Phase::Done));
    assert_eq!(r.h.os.mount_depth(STAGING), 1);
}

#[tokio::test]
async fn a_failed_unmap_keeps_its_record_and_is_retried_by_kubelet_or_reconciliation() {
    let r = rbd_harness();
    stage(&r, ext4()).await.expect("stage");
    r.attacher.fail_next_unmap(Failure::Busy);
    let e = unstage(&r).await.expect_err("busy");
    assert_eq!(e.code(), Code::FailedPrecondition);
    // Unstaged, still mapped, and the record says so.
    assert_eq!(r.h.os.mount_depth(STAGING), 0);
    let rec = r.h.engine.journal().get("vol-1").expect("record");
    assert!(rec.stage.is_none());
    assert_eq!(rec.mapping.map(|m| m.phase), Some(Phase::InProgress));
    assert_eq!(r.attacher.mapped(), vec![image()]);
    // kubelet's retry.
    unstage(&r).await.expect("retry");
    assert_eq!(unmaps(&r), 2);
    assert!(r.attacher.mapped().is_empty());
    assert!(r.h.engine.journal().get("vol-1").is_none());

    // Or, without a retry, the next reconciliation pass (a light one will do).
    stage(&r, ext4()).await.expect("stage");
    r.attacher.fail_next_unmap(Failure::Timeout);
    assert_eq!(
        unstage(&r).await.unwrap_err().code(),
        Code::DeadlineExceeded
    );
    let actions = Reconciler::new(Arc::clone(&r.h.engine), "moor.csi.io")
        .run_light()
        .expect("reconcile");
    assert!(
        actions.contains(&Action::Unmapped {
            volume: Some("vol-1".into()),
            image: image().to_string()
        }),
        "{actions:?}"
    );
    assert!(r.attacher.mapped().is_empty());
    assert!(r.h.engine.journal().get("vol-1").is_none());
}

#[tokio::test]
async fn a_block_volume_is_mapped_published_and_unmapped() {
    let r = rbd_harness();
    let block = || csi::VolumeCapability {
        access_mode: Some(AccessMode {
            mode: Mode::SingleNodeWriter as i32,
        }),
        access_type: Some(AccessType::Block(BlockVolume {})),
    };
    stage(&r, block()).await.expect("stage");
    let device = mapping(&r).and_then(|m| m.device).expect("mapped");
    assert_eq!(mkfs_calls(&r.h), 0);
    let mut p = publish_req(block(), false);
    p.target_path = BLOCK_TARGET.into();
    r.h.svc
        .node_publish_volume(Request::new(p))
        .await
        .expect("publish");
    // Still published: the unstage is refused and nothing is unmapped.
    assert_eq!(
        unstage(&r).await.unwrap_err().code(),
        Code::FailedPrecondition
    );
    assert_eq!(unmaps(&r), 0);
    r.h.svc
        .node_unpublish_volume(Request::new(unpublish_req(BLOCK_TARGET)))
        .await
        .expect("unpublish");
    unstage(&r).await.expect("unstage");
    assert_eq!(unmaps(&r), 1);
    assert!(!r.h.os.exists(&device));
}

#[tokio::test]
async fn a_reader_only_volume_is_mapped_read_only_and_never_formatted() {
    let r = rbd_harness();
    let ro = mount_cap("ext4", &[], Mode::MultiNodeReaderOnly);
    // Blank: refused (a reader never formats), and unmapped.
    let e = stage(&r, ro.clone()).await.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition);
    assert_eq!(
        r.attacher.calls().first(),
        Some(&AttachCall::Map(image(), true))
    );
    assert!(r.attacher.mapped().is_empty());
    // Written once read-write, then read-only: the read-write mapping is replaced.
    stage(&r, ext4()).await.expect("rw");
    r.h.svc
        .node_unstage_volume(Request::new(unstage_req()))
        .await
        .expect("unstage");
    r.attacher.map_unrecorded(&image(), false);
    stage(&r, ro).await.expect("ro");
    assert_eq!(
        r.attacher.calls().last(),
        Some(&AttachCall::Map(image(), true))
    );
    assert!(mapping(&r).is_some_and(|m| m.read_only));
    let m = r.h.os.calls().into_iter().rev().find_map(|c| match c {
        Call::MountFs(m) => Some(m),
        _ => None,
    });
    let m = m.expect("mounted");
    assert!(m.attrs.read_only && m.sb_read_only, "{m:?}");
}

#[tokio::test]
async fn an_image_maps_for_one_volume_and_a_node_without_attacher_maps_none() {
    let r = rbd_harness();
    stage(&r, ext4()).await.expect("stage");
    let mut other = rbd_stage("vol-2", ext4());
    other.staging_target_path = format!("{STAGING}2");
    let e =
        r.h.svc
            .node_stage_volume(Request::new(other))
            .await
            .unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition);
    assert!(e.message().contains("vol-1"), "{}", e.message());
    assert_eq!(maps(&r), 1);

    let plain = harness();
    let e = plain
        .svc
        .node_stage_volume(Request::new(rbd_stage("vol-1", ext4())))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition);
    assert!(e.message().contains("--rbd-attacher"), "{}", e.message());
    assert!(plain.h_journal_is_empty());

    // Without credentials: INVALID_ARGUMENT, before anything is touched.
    let mut no_secrets = rbd_stage("vol-3", ext4());
    no_secrets.secrets.clear();
    let e =
        r.h.svc
            .node_stage_volume(Request::new(no_secrets))
            .await
            .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    assert_eq!(maps(&r), 1);
}

impl Harness {
    fn h_journal_is_empty(&self) -> bool {
        self.engine.journal().all().is_empty()
    }
}

#[tokio::test]
async fn reconciliation_finishes_or_undoes_a_map_a_crash_cut_short() {
    // The intent only (killed before the attacher ran): undone.
    let r = rbd_harness();
    let mut rec = crate::journal::VolumeRecord::new("vol-1");
    rec.mapping = Some(MappingRecord::intent(
        "fuse",
        &image(),
        false,
        &Boot::default(),
    ));
    r.h.engine.journal().put(&rec, Durability::Process).unwrap();
    let actions = reconcile(&r);
    assert!(
        matches!(&actions[..], [Action::Unmapped { .. }]),
        "{actions:?}"
    );
    assert!(r.h.engine.journal().get("vol-1").is_none());

    // Mapped, killed before the record said so and before any stage: unmapped.
    r.attacher.map_unrecorded(&image(), false);
    r.h.engine.journal().put(&rec, Durability::Process).unwrap();
    let actions = reconcile(&r);
    assert!(
        matches!(&actions[..], [Action::Unmapped { .. }]),
        "{actions:?}"
    );
    assert!(r.attacher.mapped().is_empty());
    assert!(r.h.engine.journal().get("vol-1").is_none());

    // Mapped and staged, the mapping's confirmation lost: confirmed.
    stage(&r, ext4()).await.expect("stage");
    let mut rec = r.h.engine.journal().get("vol-1").unwrap();
    let done = rec.mapping.clone().unwrap();
    rec.mapping = Some(MappingRecord {
        monitors: done.monitors.clone(),
        ..MappingRecord::intent("fuse", &image(), false, &Boot::default())
    });
    r.h.engine.journal().put(&rec, Durability::Process).unwrap();
    let actions = reconcile(&r);
    assert!(
        actions.iter().any(
            |a| matches!(a, Action::Confirmed { path, .. } if Some(path) == done.device.as_ref())
        ),
        "{actions:?}"
    );
    assert_eq!(mapping(&r), Some(done));
    assert_eq!(r.attacher.mapped(), vec![image()]);
    assert_eq!(r.h.os.mount_depth(STAGING), 1);
}

#[tokio::test]
async fn a_mapping_whose_stage_reconciliation_rolls_back_is_unmapped() {
    let r = rbd_harness();
    stage(&r, ext4()).await.expect("stage");
    // An unstage killed after its unmount, before its record said so: the stage is rolled
    // back, and then the mapping nothing is staged on goes with its record.
    let mut rec = r.h.engine.journal().get("vol-1").expect("record");
    if let Some(st) = rec.stage.as_mut() {
        st.phase = Phase::InProgress;
    }
    r.h.engine.journal().put(&rec, Durability::Process).unwrap();
    r.h.os.force_unmount(STAGING);
    let actions = reconcile(&r);
    let unmapped = Action::Unmapped {
        volume: Some("vol-1".into()),
        image: image().to_string(),
    };
    assert!(
        actions
            .iter()
            .any(|a| matches!(a, Action::RolledBack { .. }))
            && actions.contains(&unmapped),
        "{actions:?}"
    );
    assert!(r.attacher.mapped().is_empty());
    assert!(r.h.engine.journal().get("vol-1").is_none());

    // A light pass too unmaps a confirmed mapping nothing uses.
    stage(&r, ext4()).await.expect("stage");
    r.h.os.force_unmount(STAGING);
    let mut rec = r.h.engine.journal().get("vol-1").expect("record");
    rec.stage = None;
    r.h.engine.journal().put(&rec, Durability::Process).unwrap();
    let actions = Reconciler::new(Arc::clone(&r.h.engine), "moor.csi.io")
        .run_light()
        .expect("reconcile");
    assert_eq!(actions, vec![unmapped]);
    assert!(r.attacher.mapped().is_empty());
    assert!(r.h.engine.journal().get("vol-1").is_none());
}

#[tokio::test]
async fn an_orphaned_mapping_is_unmapped_unless_moor_cannot_tell_it_is_its_own() {
    let r = rbd_harness();
    r.attacher.map_unrecorded(&image(), false);
    let actions = reconcile(&r);
    assert_eq!(
        actions,
        vec![Action::Unmapped {
            volume: None,
            image: image().to_string()
        }]
    );
    assert!(r.attacher.mapped().is_empty());

    let r = rbd_harness();
    r.attacher.disown_listed();
    r.attacher.map_unrecorded(&image(), false);
    let actions = reconcile(&r);
    assert!(
        matches!(&actions[..], [Action::ForeignMapping { .. }]),
        "{actions:?}"
    );
    assert_eq!(r.attacher.mapped(), vec![image()]);

    // A mapping whose record was lost while its stage record was not: adopted back.
    let r = rbd_harness();
    stage(&r, ext4()).await.expect("stage");
    let mut rec = r.h.engine.journal().get("vol-1").unwrap();
    let lost = rec.mapping.take();
    r.h.engine.journal().put(&rec, Durability::Process).unwrap();
    let actions = reconcile(&r);
    assert!(
        actions.iter().any(|a| matches!(a, Action::Adopted { .. })),
        "{actions:?}"
    );
    // The monitors were the lost record's alone: the next stage names them again.
    assert_eq!(
        mapping(&r),
        lost.map(|m| MappingRecord {
            monitors: None,
            ..m
        })
    );
    assert_eq!(unmaps(&r), 0);
}

#[tokio::test]
async fn a_lost_mapping_is_reported_and_mapped_again_by_the_next_stage() {
    let r = rbd_harness();
    stage(&r, ext4()).await.expect("stage");
    let old = mapping(&r).and_then(|m| m.device).unwrap();
    // A reboot: the mounts and the mapping are gone; the journal is not.
    r.h.os.force_unmount(STAGING);
    r.attacher.lose(&image());
    let actions = reconcile(&r);
    assert!(
        actions
            .iter()
            .any(|a| matches!(a, Action::MappingLost { .. })),
        "{actions:?}"
    );
    assert_eq!(maps(&r), 1);
    // kubelet stages it again: mapped again, on another device, with the same filesystem.
    stage(&r, ext4()).await.expect("restage");
    assert_eq!(maps(&r), 2);
    let new = mapping(&r).and_then(|m| m.device).unwrap();
    assert_ne!(new, old);
    let st =
        r.h.engine
            .journal()
            .get("vol-1")
            .and_then(|v| v.stage)
            .unwrap();
    assert_eq!(st.device, new);
    assert_eq!(st.phase, Phase::Done);
    assert_eq!(mkfs_calls(&r.h), 1);
    assert_eq!(r.h.os.mount_depth(STAGING), 1);
    assert_eq!(r.attacher.doubles(), 0);
    assert!(
        r.attacher
            .find(&image())
            .unwrap()
            .is_some_and(|m| m.identity.backing_file == Some(image_file(&image())))
    );
}

#[test]
fn a_server_that_wrote_almost_nothing_for_a_whole_deadline_has_stalled() {
    use crate::engine::{STALL_BYTES, stalled};
    assert!(stalled(Some(100), Some(100)));
    assert!(
        stalled(Some(100), Some(100 + STALL_BYTES - 1)),
        "an idle rbd-fuse's noise"
    );
    assert!(!stalled(Some(100), Some(100 + STALL_BYTES)));
    // No count (the kernel client, or no rbd-fuse left): never taken for stalled.
    assert!(!stalled(None, Some(5)));
    assert!(!stalled(Some(5), None));
}

#[tokio::test]
async fn an_unstage_whose_server_stops_answering_aborts_the_mapping() {
    let r = rbd_harness();
    stage(&r, ext4()).await.expect("stage");
    // A watch that ends before its deadline (the usual unmount) aborts nothing.
    drop(
        r.h.engine
            .watch_unstage("vol-1")
            .expect("a mapped volume is watched"),
    );
    assert_eq!(count_attach(&r, |c| matches!(c, AttachCall::Abort(_))), 0);
    // A server that answers nothing for a whole deadline is aborted.
    r.attacher.set_deadlines(crate::attach::Deadlines {
        map: std::time::Duration::from_secs(60),
        unmap: std::time::Duration::from_millis(20),
    });
    let watch = r.h.engine.watch_unstage("vol-1").expect("watched");
    // The watch's thread aborts once the deadline passes: a bound on a hang, not on its speed.
    let start = std::time::Instant::now();
    while count_attach(&r, |c| matches!(c, AttachCall::Abort(_))) == 0
        && start.elapsed() < std::time::Duration::from_secs(120)
    {
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    drop(watch);
    assert_eq!(
        count_attach(&r, |c| matches!(c, AttachCall::Abort(_))),
        1,
        "aborted once"
    );
    // A volume without a mapping is not watched.
    let plain = harness();
    staged(&plain).await;
    assert!(plain.engine.watch_unstage("vol-1").is_none());
}

#[tokio::test]
async fn a_read_only_publication_is_mapped_and_staged_read_only() {
    let r = rbd_harness();
    stage(&r, ext4()).await.expect("formatted once, read-write");
    unstage(&r).await.expect("unstage");
    let mut req = rbd_stage("vol-1", ext4());
    req.publish_context.insert(
        moor_runtime::contract::RBD_READ_ONLY_KEY.into(),
        "true".into(),
    );
    r.h.svc
        .node_stage_volume(Request::new(req))
        .await
        .expect("stage read-only");
    assert_eq!(
        r.attacher.calls().last(),
        Some(&AttachCall::Map(image(), true))
    );
    let m = r.h.os.calls().into_iter().rev().find_map(|c| match c {
        Call::MountFs(m) => Some(m),
        _ => None,
    });
    assert!(m.expect("mounted").attrs.read_only);
}

/// A mapping recorded before a reboot is gone with it: after the reboot it holds no image (a
/// power cut may have taken the unstage that unmapped it, answered OK), reconciliation drops
/// it without unmapping anything when nothing is staged on it, and keeps it quietly with the
/// memory of its staging (which the volume's next stage replaces).
#[tokio::test]
async fn a_mapping_from_before_a_reboot_holds_no_image() {
    let then = Boot::new(Some("boot-1".into()));
    let r = rbd_harness_in(&Boot::new(Some("boot-2".into())));
    let remembered = |staged: bool| {
        let mut rec = crate::journal::VolumeRecord::new("vol-2");
        rec.mapping = Some(MappingRecord {
            device: Some("/dev/rbd9".into()),
            rdev: Some((251, 9)),
            phase: Phase::Done,
            ..MappingRecord::intent("fuse", &image(), false, &then)
        });
        rec.stage = staged.then(|| crate::journal::StageRecord {
            path: format!("{STAGING}2").into(),
            device: "/dev/rbd9".into(),
            rdev: (251, 9),
            access: crate::journal::AccessRecord::Mount {
                fs_type: "ext4".into(),
                fs_options: Vec::new(),
                group: None,
            },
            attrs: crate::sys::MountAttrs::default(),
            access_mode: Mode::SingleNodeWriter as i32,
            phase: Phase::Done,
            fs_uuid: None,
            boot: then.stamp(),
        });
        r.h.engine.journal().put(&rec, Durability::Process).unwrap();
    };
    remembered(false);
    let actions = reconcile(&r);
    assert!(
        matches!(&actions[..], [Action::Forgotten { volume, .. }] if volume == "vol-2"),
        "{actions:?}"
    );
    assert!(r.h.engine.journal().get("vol-2").is_none());
    assert_eq!(unmaps(&r), 0, "nothing of it was mapped to unmap");
    remembered(true);
    let actions = reconcile(&r);
    assert!(
        matches!(&actions[..], [Action::Remembered { volume, .. }] if volume == "vol-2"),
        "{actions:?}"
    );
    assert!(
        r.h.engine
            .journal()
            .get("vol-2")
            .is_some_and(|v| v.mapping.is_some())
    );
    // Another volume's stage maps the image: nothing holds it.
    stage(&r, ext4()).await.expect("stage");
    assert_eq!(maps(&r), 1);
    assert_eq!(r.h.os.mount_depth(STAGING), 1);
}

#[tokio::test]
async fn a_mapping_whose_server_died_is_taken_over_before_kubelet_is_answered() {
    let r = rbd_harness();
    stage(&r, ext4()).await.expect("stage");
    let before = mapping(&r);
    // moor-node's container ended, and the image's server with it (ublk: the device waits).
    r.attacher.kill_server(&image());
    let actions = reconcile(&r);
    assert!(
        actions.contains(&Action::Recovered {
            volume: "vol-1".into(),
            image: image().to_string(),
        }),
        "{actions:?}"
    );
    assert!(!r.attacher.server_dead(&image()));
    assert_eq!(count_attach(&r, |c| matches!(c, AttachCall::Recover(_))), 1);
    // The same device, the same record; nothing mapped again, nothing unmapped.
    assert_eq!(mapping(&r), before);
    assert_eq!((maps(&r), unmaps(&r)), (1, 0));
    // A server that dies after the start (an old moor-node's, ended after this one started)
    // is taken over by a periodic light pass too; a live one is left alone.
    r.attacher.kill_server(&image());
    let light = Reconciler::new(Arc::clone(&r.h.engine), "moor.csi.io")
        .run_light()
        .expect("light pass");
    assert!(
        light.iter().any(|a| matches!(a, Action::Recovered { .. })),
        "{light:?}"
    );
    assert!(
        reconcile(&r)
            .iter()
            .all(|a| !matches!(a, Action::Recovered { .. }))
    );
    assert_eq!(count_attach(&r, |c| matches!(c, AttachCall::Recover(_))), 2);
    unstage(&r).await.expect("unstage");
    assert!(r.attacher.mapped().is_empty());
}
