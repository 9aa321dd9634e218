//! publish_context parsing: a NodeStageVolume whose other fields are valid, with a
//! publish_context built from the input, is accepted or refused without a panic; an accepted
//! one names a clean device under /dev, if it names one (it may give the device's identity
//! alone).
#![no_main]

use std::collections::HashMap;
use std::path::{Component, Path};

use csi::volume_capability::{AccessMode, AccessType, MountVolume, access_mode::Mode};
use libfuzzer_sys::fuzz_target;
use moor_node::validate;
use moor_proto::csi::v1 as csi;

fuzz_target!(|data: &[u8]| {
    // Entries are `key=value` lines; a key without `=` gets an empty value.
    let text = String::from_utf8_lossy(data);
    let publish_context: HashMap<String, String> = text
        .split('\n')
        .map(|line| match line.split_once('=') {
            Some((k, v)) => (k.to_string(), v.to_string()),
            None => (line.to_string(), String::new()),
        })
        .collect();
    let req = csi::NodeStageVolumeRequest {
        volume_id: "vol-1".into(),
        publish_context,
        staging_target_path: "/var/lib/kubelet/plugins/moor/staging/vol-1".into(),
        volume_capability: Some(csi::VolumeCapability {
            access_mode: Some(AccessMode {
                mode: Mode::SingleNodeWriter as i32,
            }),
            access_type: Some(AccessType::Mount(MountVolume::default())),
        }),
        ..Default::default()
    };
    if let Ok(v) = validate::stage(&req, Path::new("/var/lib/kubelet"))
        && let Some(device) = &v.device
    {
        assert!(device.starts_with("/dev"), "{device:?}");
        assert!(
            device
                .components()
                .all(|c| matches!(c, Component::RootDir | Component::Normal(_))),
            "{device:?}"
        );
    }
});
