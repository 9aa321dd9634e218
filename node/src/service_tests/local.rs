//! A node-local volume (`--local-controller`): the controller on the node attaches it when it
//! is staged and nothing names its device, releases it once it is unstaged, grows it before
//! its filesystem grows, and adds what it knows to the volume's condition.

use std::sync::Mutex;

use tonic::Status;

use super::*;
use crate::local_controller::LocalController;

/// What the node asked of the controller, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Asked {
    Attach(String, String),
    Detach(String, String),
    Expand(String, i64),
    Condition(String),
}

/// The controller on the node: attaching means handing out DEV; growing means resizing it.
#[derive(Debug)]
struct FakeLocal {
    os: Arc<FakeOs>,
    asked: Mutex<Vec<Asked>>,
    fail_attach: Mutex<Option<Status>>,
    abnormal: Mutex<Option<String>>,
}

impl FakeLocal {
    fn new(os: Arc<FakeOs>) -> Arc<Self> {
        Arc::new(Self {
            os,
            asked: Mutex::new(Vec::new()),
            fail_attach: Mutex::new(None),
            abnormal: Mutex::new(None),
        })
    }

    fn asked(&self) -> Vec<Asked> {
        self.asked.lock().unwrap().clone()
    }
}

#[tonic::async_trait]
impl LocalController for FakeLocal {
    async fn attach(
        &self,
        volume_id: &str,
        node_id: &str,
        capability: Option<csi::VolumeCapability>,
        _context: HashMap<String, String>,
    ) -> Result<HashMap<String, String>, Status> {
        assert!(capability.is_some(), "the capability goes with the attach");
        self.asked
            .lock()
            .unwrap()
            .push(Asked::Attach(volume_id.into(), node_id.into()));
        if let Some(e) = self.fail_attach.lock().unwrap().take() {
            return Err(e);
        }
        Ok(HashMap::from([("devicePath".into(), DEV.into())]))
    }

    async fn detach(&self, volume_id: &str, node_id: &str) -> Result<(), Status> {
        self.asked
            .lock()
            .unwrap()
            .push(Asked::Detach(volume_id.into(), node_id.into()));
        Ok(())
    }

    async fn expand(
        &self,
        volume_id: &str,
        required: i64,
        _limit: i64,
        _capability: Option<csi::VolumeCapability>,
    ) -> Result<i64, Status> {
        self.asked
            .lock()
            .unwrap()
            .push(Asked::Expand(volume_id.into(), required));
        self.os.resize_device(DEV, required as u64);
        Ok(required)
    }

    async fn condition(&self, volume_id: &str) -> Result<Option<csi::VolumeCondition>, Status> {
        self.asked
            .lock()
            .unwrap()
            .push(Asked::Condition(volume_id.into()));
        Ok(self
            .abnormal
            .lock()
            .unwrap()
            .clone()
            .map(|message| csi::VolumeCondition {
                abnormal: true,
                message,
            }))
    }
}

fn local_harness() -> (Harness, Arc<FakeLocal>) {
    let mut h = harness();
    let local = FakeLocal::new(Arc::clone(&h.os));
    h.svc = NodeService::new(Arc::clone(&h.engine), h.info.clone())
        .with_local_controller(Arc::clone(&local) as Arc<dyn LocalController>);
    (h, local)
}

/// A stage of a node-local volume: no device in publish_context (no CO attached it).
fn local_stage_req() -> csi::NodeStageVolumeRequest {
    let mut r = stage_req(ext4());
    r.publish_context.clear();
    r
}

#[tokio::test]
async fn the_controller_on_the_node_attaches_at_stage_and_releases_at_unstage() {
    let (h, local) = local_harness();
    h.svc
        .node_stage_volume(Request::new(local_stage_req()))
        .await
        .expect("stage");
    assert_eq!(h.os.mount_depth(STAGING), 1);
    assert_eq!(
        local.asked(),
        vec![Asked::Attach("vol-1".into(), "node-1".into())]
    );
    // Retried (kubelet does): attached again, which the controller answers with the same
    // device; still one mount.
    h.svc
        .node_stage_volume(Request::new(local_stage_req()))
        .await
        .expect("stage again");
    assert_eq!(h.os.mount_depth(STAGING), 1);
    h.svc
        .node_unstage_volume(Request::new(unstage_req()))
        .await
        .expect("unstage");
    assert_eq!(h.os.mount_depth(STAGING), 0);
    assert_eq!(
        local.asked().last(),
        Some(&Asked::Detach("vol-1".into(), "node-1".into()))
    );
    // An unstage retried after it all went: released again, which is success.
    h.svc
        .node_unstage_volume(Request::new(unstage_req()))
        .await
        .expect("unstage again");
    assert_eq!(
        local
            .asked()
            .iter()
            .filter(|a| matches!(a, Asked::Detach(..)))
            .count(),
        2
    );
}

#[tokio::test]
async fn nothing_is_attached_for_a_stage_that_cannot_go_on() {
    let (h, local) = local_harness();
    // A device named already (a CO attached it): the controller is not asked.
    staged(&h).await;
    assert!(local.asked().is_empty());
    // A request that fails its own checks attaches nothing.
    let mut bad = local_stage_req();
    bad.staging_target_path = "/elsewhere/globalmount".into();
    assert_eq!(
        code(h.svc.node_stage_volume(Request::new(bad))).await,
        Code::InvalidArgument
    );
    assert!(local.asked().is_empty());
    // The controller's refusal is the stage's answer, and nothing is mounted.
    let (h, local) = local_harness();
    *local.fail_attach.lock().unwrap() = Some(Status::not_found("volume vol-1 does not exist"));
    assert_eq!(
        code(h.svc.node_stage_volume(Request::new(local_stage_req()))).await,
        Code::NotFound
    );
    assert_eq!(h.os.mount_depth(STAGING), 0);
}

#[tokio::test]
async fn a_stage_that_fails_after_the_attach_releases_the_device() {
    // The mount fails (a final error: the kubelet will send no NodeUnstageVolume): the device
    // the controller attached for it is released, or the volume could never be deleted.
    let (h, local) = local_harness();
    h.os.fail_next("mount_fs", libc::EIO);
    assert_ne!(
        code(h.svc.node_stage_volume(Request::new(local_stage_req()))).await,
        Code::Ok
    );
    assert_eq!(h.os.mount_depth(STAGING), 0);
    assert_eq!(
        local.asked(),
        vec![
            Asked::Attach("vol-1".into(), "node-1".into()),
            Asked::Detach("vol-1".into(), "node-1".into())
        ]
    );
    // Staged, then a stage that fails (another filesystem asked): the staged volume keeps its
    // device.
    let (h, local) = local_harness();
    h.svc
        .node_stage_volume(Request::new(local_stage_req()))
        .await
        .expect("stage");
    let mut other = local_stage_req();
    other.volume_capability = Some(mount_cap("xfs", &[], Mode::SingleNodeWriter));
    assert_ne!(
        code(h.svc.node_stage_volume(Request::new(other))).await,
        Code::Ok
    );
    assert_eq!(h.os.mount_depth(STAGING), 1);
    assert!(
        !local.asked().iter().any(|a| matches!(a, Asked::Detach(..))),
        "{:?}",
        local.asked()
    );
}

#[tokio::test]
async fn a_node_local_volume_grows_where_it_lives_then_its_filesystem() {
    let (h, local) = local_harness();
    h.svc
        .node_stage_volume(Request::new(local_stage_req()))
        .await
        .expect("stage");
    h.os.clear_calls();
    let r = h
        .svc
        .node_expand_volume(Request::new(expand_req(STAGING, 2 * GIB as i64)))
        .await
        .expect("expand");
    assert_eq!(r.into_inner().capacity_bytes, 2 * GIB as i64);
    assert_eq!(
        local.asked().last(),
        Some(&Asked::Expand("vol-1".into(), 2 * GIB as i64))
    );
    assert!(
        h.os.calls()
            .iter()
            .any(|c| matches!(c, Call::Tool(p, _) if p == "resize2fs")),
        "{:?}",
        h.os.calls()
    );
}

#[tokio::test]
async fn the_controllers_view_joins_the_volumes_condition() {
    let (h, local) = local_harness();
    h.svc
        .node_stage_volume(Request::new(local_stage_req()))
        .await
        .expect("stage");
    let condition = || async {
        h.svc
            .node_get_volume_stats(Request::new(stats_req(STAGING)))
            .await
            .expect("stats")
            .into_inner()
            .volume_condition
            .expect("condition")
    };
    assert!(!condition().await.abnormal);
    *local.abnormal.lock().unwrap() = Some("the data dir has 1 MiB free".into());
    let c = condition().await;
    assert!(c.abnormal && c.message.contains("1 MiB free"), "{c:?}");
    assert!(local.asked().contains(&Asked::Condition("vol-1".into())));
}
