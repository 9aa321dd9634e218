//! kubelet's `vol_data.json`, read when reconciliation adopts a mount the journal lost: any
//! bytes give a volume handle or nothing, never a panic; a handle is never empty.
#![no_main]

use libfuzzer_sys::fuzz_target;
use moor_node::reconcile::parse_vol_data;

fuzz_target!(|data: &[u8]| {
    if let Some(handle) = parse_vol_data(data, "moor.csi.io") {
        assert!(!handle.is_empty());
    }
});
