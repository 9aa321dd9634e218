//! ControllerGetCapabilities.

use super::*;

#[tokio::test]
async fn controller_capabilities() {
    use csi::controller_service_capability::{Type, rpc};
    let fx = Fx::new("svc-caps");
    let caps = fx
        .svc
        .controller_get_capabilities(Request::new(csi::ControllerGetCapabilitiesRequest {}))
        .await
        .unwrap()
        .into_inner()
        .capabilities;
    let types: Vec<rpc::Type> = caps
        .iter()
        .filter_map(|c| match &c.r#type {
            Some(Type::Rpc(r)) => rpc::Type::try_from(r.r#type).ok(),
            None => None,
        })
        .collect();
    assert_eq!(types.len(), 12);
    for t in [
        rpc::Type::CreateDeleteVolume,
        rpc::Type::PublishUnpublishVolume,
        rpc::Type::ListVolumes,
        rpc::Type::GetCapacity,
        rpc::Type::CreateDeleteSnapshot,
        rpc::Type::ListSnapshots,
        rpc::Type::CloneVolume,
        rpc::Type::ExpandVolume,
        rpc::Type::ListVolumesPublishedNodes,
        rpc::Type::VolumeCondition,
        rpc::Type::GetVolume,
        rpc::Type::SingleNodeMultiWriter,
    ] {
        assert!(types.contains(&t), "{t:?}");
    }
    assert!(!types.contains(&rpc::Type::ModifyVolume));
    assert!(!types.contains(&rpc::Type::PublishReadonly));
}
