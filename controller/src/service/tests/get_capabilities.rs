//! ControllerGetCapabilities.

use super::*;

#[tokio::test]
async fn controller_capabilities() {
    use csi::controller_service_capability::rpc;
    let fx = Fx::new("svc-caps");
    let types = announced(&fx).await;
    assert_eq!(types.len(), 13);
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
        rpc::Type::ModifyVolume,
    ] {
        assert!(types.contains(&t), "{t:?}");
    }
    assert!(!types.contains(&rpc::Type::PublishReadonly));
}
