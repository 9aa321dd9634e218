//! ControllerModifyVolume (VolumeAttributesClass): QoS limits set, replaced and kept; a key
//! that cannot change is INVALID_ARGUMENT naming it.

use super::*;
use crate::backend::Qos;

fn modify(id: &str, params: &[(&str, &str)]) -> csi::ControllerModifyVolumeRequest {
    csi::ControllerModifyVolumeRequest {
        volume_id: id.into(),
        mutable_parameters: params
            .iter()
            .map(|(k, v)| ((*k).to_string(), (*v).to_string()))
            .collect(),
        ..Default::default()
    }
}

impl Fx {
    fn qos(&self, id: &str) -> Qos {
        self.backend.qos_of(id).expect("a volume")
    }
}

#[tokio::test]
async fn modify_sets_replaces_and_refuses_naming_the_key() {
    let fx = Fx::new("svc-modify");
    let caps = fx
        .svc
        .controller_get_capabilities(Request::new(csi::ControllerGetCapabilitiesRequest {}))
        .await
        .unwrap()
        .into_inner();
    assert!(caps.capabilities.iter().any(|c| matches!(
        &c.r#type,
        Some(csi::controller_service_capability::Type::Rpc(r))
            if r.r#type == csi::controller_service_capability::rpc::Type::ModifyVolume as i32
    )));
    let v = fx.create("pvc-m", 4 * MIB).await;
    let call = |r| async { fx.svc.controller_modify_volume(Request::new(r)).await };
    // The spec's rows: no id, an id of nothing.
    assert_invalid(call(modify("", &[("writeIOPS", "10")])).await, "volume_id");
    assert_code(
        call(modify("non-existing-volume-id", &[("writeIOPS", "10")])).await,
        Code::NotFound,
    );
    // Set, then replaced whole (a claim that moves to another class takes its parameters).
    call(modify(
        &v.volume_id,
        &[("writeIOPS", "100"), ("readBytesPerSecond", "1048576")],
    ))
    .await
    .expect("modify");
    assert_eq!(
        fx.qos(&v.volume_id),
        Qos {
            write_iops: Some(100),
            read_bps: Some(1 << 20),
            ..Qos::default()
        }
    );
    call(modify(&v.volume_id, &[("writeBytesPerSecond", "2048")]))
        .await
        .expect("modify again");
    assert_eq!(
        fx.qos(&v.volume_id),
        Qos {
            write_bps: Some(2048),
            ..Qos::default()
        }
    );
    // What cannot change, and what moor does not know, are refused naming the key; nothing
    // changes.
    let s = assert_code(
        call(modify(&v.volume_id, &[("provisioning", "thick")])).await,
        Code::InvalidArgument,
    );
    assert!(
        s.message().contains("provisioning") && s.message().contains("cannot change"),
        "{}",
        s.message()
    );
    let s = assert_code(
        call(modify(&v.volume_id, &[("XXX_FakeKey", "XXX_FakeValue")])).await,
        Code::InvalidArgument,
    );
    assert!(s.message().contains("XXX_FakeKey"), "{}", s.message());
    let s = assert_code(
        call(modify(&v.volume_id, &[("writeIOPS", "fast")])).await,
        Code::InvalidArgument,
    );
    assert!(s.message().contains("writeIOPS"), "{}", s.message());
    assert_eq!(fx.qos(&v.volume_id).write_bps, Some(2048));
    // Kept on disk: a restarted backend has them.
    let fx = fx.reopen_as(NODE);
    assert_eq!(fx.qos(&v.volume_id).write_bps, Some(2048));
}

#[tokio::test]
async fn create_with_a_class_keeps_its_limits_and_refuses_a_bad_one_creating_nothing() {
    let fx = Fx::new("svc-modify-create");
    let mut r = create_req("pvc-vac", 4 * MIB);
    r.mutable_parameters = [("readIOPS".to_string(), "50".to_string())].into();
    let v = fx.created(r).await;
    assert_eq!(fx.qos(&v.volume_id).read_iops, Some(50));
    let mut bad = create_req("pvc-vac-bad", 4 * MIB);
    bad.mutable_parameters = [("XXX_FakeKey".to_string(), "XXX_FakeValue".to_string())].into();
    assert_invalid(
        fx.svc.create_volume(Request::new(bad)).await,
        "mutable_parameters",
    );
    let listed = fx
        .svc
        .list_volumes(Request::new(csi::ListVolumesRequest::default()))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(listed.entries.len(), 1, "nothing made of the refused one");
}
