//! The Node service's request validator: the first byte picks an RPC, the rest is decoded as
//! that RPC's protobuf request; whatever decodes is validated without a panic, and a request
//! that passes names only clean paths under the kubelet dir.
#![no_main]

use std::path::Path;

use libfuzzer_sys::fuzz_target;
use moor_node::validate;
use moor_proto::csi::v1 as csi;
use prost::Message;

const KUBELET: &str = "/var/lib/kubelet";

/// A path a validated request may hold: below the kubelet dir, with no `..` component.
fn check(p: &Path) {
    assert!(p.starts_with(KUBELET) && p != Path::new(KUBELET), "{p:?}");
    assert!(
        p.components().all(|c| matches!(
            c,
            std::path::Component::RootDir | std::path::Component::Normal(_)
        )),
        "{p:?}"
    );
}

fuzz_target!(|data: &[u8]| {
    let Some((&which, msg)) = data.split_first() else {
        return;
    };
    let dir = Path::new(KUBELET);
    match which % 6 {
        0 => {
            if let Ok(r) = csi::NodeStageVolumeRequest::decode(msg)
                && let Ok(v) = validate::stage(&r, dir)
            {
                check(&v.staging);
            }
        }
        1 => {
            if let Ok(r) = csi::NodeUnstageVolumeRequest::decode(msg)
                && let Ok(v) = validate::unstage(&r, dir)
            {
                check(&v.staging);
            }
        }
        2 => {
            if let Ok(r) = csi::NodePublishVolumeRequest::decode(msg)
                && let Ok(v) = validate::publish(&r, dir)
            {
                check(&v.staging);
                check(&v.target);
                assert!(!v.target.starts_with(&v.staging) && !v.staging.starts_with(&v.target));
            }
        }
        3 => {
            if let Ok(r) = csi::NodeUnpublishVolumeRequest::decode(msg)
                && let Ok(v) = validate::unpublish(&r, dir)
            {
                check(&v.target);
            }
        }
        4 => {
            if let Ok(r) = csi::NodeGetVolumeStatsRequest::decode(msg)
                && let Ok(v) = validate::stats(&r, dir)
            {
                check(&v.path);
            }
        }
        _ => {
            if let Ok(r) = csi::NodeExpandVolumeRequest::decode(msg) {
                match validate::expand(&r, dir) {
                    Ok(v) => {
                        check(&v.path);
                        if let Some(s) = &v.staging {
                            check(s);
                        }
                    }
                    Err(e) => {
                        let _ = e.to_string();
                    }
                }
            }
        }
    }
});
