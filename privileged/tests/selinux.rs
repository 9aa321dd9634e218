//! SELinux mount labels on the real kernel (run as root): kubelet's `context="..."` flag.
//!
//! On a kernel without SELinux, a labelled stage is refused before the device is touched (the
//! kernel would refuse the option only after mkfs). On a kernel with SELinux, the label reaches
//! the filesystem mount and a publish with another label is refused.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use csi::volume_capability::{AccessMode, AccessType, MountVolume, access_mode::Mode};
use moor_node::engine::{Engine, EngineConfig};
use moor_node::journal::Journal;
use moor_node::service::{NodeService, PluginInfo};
use moor_node::superblock::Content;
use moor_node::sys::Os as _;
use moor_node::sys::linux::Linux;
use moor_privileged::{Sandbox, is_mount_point, read_at};
use moor_proto::csi::v1 as csi;
use moor_proto::csi::v1::node_server::Node as _;
use tonic::Code;

const MIB: u64 = 1 << 20;
const LABEL: &str = r#"context="system_u:object_r:container_file_t:s0:c15,c25""#;
const OTHER: &str = r#"context="system_u:object_r:container_file_t:s0:c7,c8""#;

fn node(sb: &Sandbox) -> (NodeService<Linux>, Arc<Linux>) {
    let os = Arc::new(Linux::new(&sb.kubelet).expect("os"));
    let (journal, _) = Journal::open(&sb.state, false).expect("journal");
    let cfg = EngineConfig {
        kubelet_dir: sb.kubelet.clone(),
        ..EngineConfig::default()
    };
    let engine = Arc::new(Engine::new(Arc::clone(&os), Arc::new(journal), cfg));
    let info = PluginInfo {
        driver_name: "moor.csi.io".into(),
        node_id: "n1".into(),
        max_volumes: 0,
        topology_key: "topology.moor.csi.io/node".into(),
        state_dir: sb.state.clone(),
    };
    (NodeService::new(engine, info), os)
}

fn cap(flags: &[&str]) -> csi::VolumeCapability {
    csi::VolumeCapability {
        access_mode: Some(AccessMode {
            mode: Mode::SingleNodeSingleWriter as i32,
        }),
        access_type: Some(AccessType::Mount(MountVolume {
            fs_type: "ext4".into(),
            mount_flags: flags.iter().map(|f| (*f).to_string()).collect(),
            volume_mount_group: String::new(),
        })),
    }
}

fn stage(
    svc: &NodeService<Linux>,
    dev: &Path,
    staging: &Path,
    flags: &[&str],
) -> Result<(), tonic::Status> {
    let req = csi::NodeStageVolumeRequest {
        volume_id: "vol".into(),
        publish_context: HashMap::from([("devicePath".into(), dev.display().to_string())]),
        staging_target_path: staging.display().to_string(),
        volume_capability: Some(cap(flags)),
        secrets: HashMap::new(),
        volume_context: HashMap::new(),
    };
    moor_privileged::runtime()
        .block_on(svc.node_stage_volume(tonic::Request::new(req)))
        .map(drop)
}

fn publish(
    svc: &NodeService<Linux>,
    staging: &Path,
    target: &Path,
    flags: &[&str],
) -> Result<(), tonic::Status> {
    let mut req = moor_privileged::requests::publish_req("vol", staging, target);
    req.volume_capability = Some(cap(flags));
    moor_privileged::runtime()
        .block_on(svc.node_publish_volume(tonic::Request::new(req)))
        .map(drop)
}

/// The superblock options of the mount at `path`, as the kernel shows them.
fn super_options(path: &Path) -> String {
    let table = std::fs::read_to_string("/proc/thread-self/mountinfo").expect("mountinfo");
    table
        .lines()
        .filter(|l| l.split(' ').nth(4) == Some(&path.display().to_string()))
        .filter_map(|l| l.rsplit(' ').next())
        .next_back()
        .unwrap_or_default()
        .to_string()
}

fn is_blank(dev: &Path) -> bool {
    let head = read_at(dev, 0, moor_node::superblock::HEAD_LEN);
    let size = 64 * MIB;
    let tail_len = moor_node::superblock::TAIL_LEN;
    let tail = read_at(dev, size - tail_len as u64, tail_len);
    moor_node::superblock::probe(&head, &tail, size).is_blank()
}

#[test]
fn a_label_is_refused_without_selinux_and_mounted_with_it() {
    let sb = Sandbox::new("selinux");
    let (svc, os) = node(&sb);
    let dev = sb.loop_device("v.img", 64 * MIB);
    let staging = sb.staging("pv");
    let target = sb.target("pod", "pv");
    if !os.selinux() {
        let e = stage(&svc, &dev, &staging, &[LABEL]).unwrap_err();
        assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
        assert!(e.message().contains("kernel has none"), "{}", e.message());
        // Refused before anything: the blank device was not formatted, nothing is mounted.
        assert!(is_blank(&dev), "the device was written");
        assert!(!is_mount_point(&staging));
        // Without a label, the same volume stages as ever.
        stage(&svc, &dev, &staging, &[]).expect("stage without a label");
        assert!(matches!(
            moor_node::superblock::probe(&read_at(&dev, 0, 4096), &[], 64 * MIB),
            Content::Filesystem { .. }
        ));
        let e = publish(&svc, &staging, &target, &[LABEL]).unwrap_err();
        assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
        assert!(!is_mount_point(&target));
        return;
    }
    // A kernel with SELinux: the label is the filesystem's.
    stage(&svc, &dev, &staging, &[LABEL]).expect("labelled stage");
    let opts = super_options(&staging);
    assert!(
        opts.contains("system_u:object_r:container_file_t:s0:c15,c25"),
        "{opts}"
    );
    publish(&svc, &staging, &target, &[LABEL]).expect("publish with the label");
    assert!(is_mount_point(&target));
    let other = sb.target("pod2", "pv");
    let e = publish(&svc, &staging, &other, &[OTHER]).unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    assert!(!is_mount_point(&other));
}
