//! The Controller, GroupController and SnapshotMetadata services' request validator: the first byte picks an RPC, the rest is
//! decoded as that RPC's protobuf request; whatever decodes is validated without a panic, and
//! every refusal renders as a message.
#![no_main]

use libfuzzer_sys::fuzz_target;
use moor_controller::validate;
use moor_proto::csi::v1 as csi;
use prost::Message;

/// Decodes `msg` as `M` and validates it with `f`; a refusal must render.
fn run<M: Message + Default, T, E: std::fmt::Display>(
    msg: &[u8],
    f: impl FnOnce(&M) -> Result<T, E>,
) {
    if let Ok(req) = M::decode(msg)
        && let Err(e) = f(&req)
    {
        let _ = e.to_string();
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&which, msg)) = data.split_first() else {
        return;
    };
    match which % 18 {
        0 => run::<csi::CreateVolumeRequest, _, _>(msg, validate::create_volume),
        1 => run::<csi::DeleteVolumeRequest, _, _>(msg, validate::delete_volume),
        2 => run::<csi::ControllerPublishVolumeRequest, _, _>(msg, validate::publish),
        3 => run::<csi::ControllerUnpublishVolumeRequest, _, _>(msg, validate::unpublish),
        4 => run::<csi::ValidateVolumeCapabilitiesRequest, _, _>(
            msg,
            validate::validate_capabilities,
        ),
        5 => run::<csi::ListVolumesRequest, _, _>(msg, validate::list_volumes),
        6 => run::<csi::GetCapacityRequest, _, _>(msg, validate::get_capacity),
        7 => run::<csi::ControllerExpandVolumeRequest, _, _>(msg, validate::expand),
        8 => run::<csi::ControllerGetVolumeRequest, _, _>(msg, validate::get_volume),
        9 => run::<csi::CreateSnapshotRequest, _, _>(msg, validate::create_snapshot),
        10 => run::<csi::DeleteSnapshotRequest, _, _>(msg, validate::delete_snapshot),
        11 => run::<csi::ListSnapshotsRequest, _, _>(msg, validate::list_snapshots),
        12 => run::<csi::GetSnapshotRequest, _, _>(msg, validate::get_snapshot),
        13 => {
            run::<csi::CreateVolumeGroupSnapshotRequest, _, _>(msg, validate::create_group_snapshot)
        }
        14 => run::<csi::GetVolumeGroupSnapshotRequest, _, _>(msg, validate::get_group_snapshot),
        15 => {
            run::<csi::DeleteVolumeGroupSnapshotRequest, _, _>(msg, validate::delete_group_snapshot)
        }
        16 => run::<csi::GetMetadataAllocatedRequest, _, _>(msg, validate::metadata_allocated),
        _ => run::<csi::GetMetadataDeltaRequest, _, _>(msg, validate::metadata_delta),
    }
});
