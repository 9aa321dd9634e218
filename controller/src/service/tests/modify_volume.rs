//! ControllerModifyVolume.

use super::*;

#[tokio::test]
async fn modify_volume_is_unimplemented() {
    let fx = Fx::new("svc-modify");
    assert_code(
        fx.svc
            .controller_modify_volume(Request::new(csi::ControllerModifyVolumeRequest {
                volume_id: "vol-00000000000000aa".into(),
                ..Default::default()
            }))
            .await,
        Code::Unimplemented,
    );
}
