//! A hostile client against the real `moor-node` and `moor-controller` binaries (run as root).
//!
//! For every RPC of both services, requests with missing, empty, oversized and malformed fields
//! get the code the CSI spec names, and leave nothing behind: the sandbox's files (kubelet dir,
//! state dir, data dir) and its mount table are the same after each call as before it, no loop
//! device is bound to a file of the sandbox, and the daemon still answers. (Undecodable
//! protobuf is answered by tonic's codec before any handler runs.)
//!
//! One file, over the usual length: one table of hostile requests per RPC, driven by one
//! harness that checks the sandbox is unchanged after each.

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use csi::controller_client::ControllerClient;
use csi::identity_client::IdentityClient;
use csi::node_client::NodeClient;
use csi::volume_capability::{AccessMode, AccessType, BlockVolume, MountVolume, access_mode::Mode};
use moor_privileged::Sandbox;
use moor_privileged::client::{Daemon, connect};
use moor_proto::csi::v1 as csi;
use tonic::Code;

/// Every file and directory below `root`, with its kind.
fn tree(root: &Path) -> BTreeSet<(PathBuf, &'static str)> {
    let mut out = BTreeSet::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for e in entries.flatten() {
            let p = e.path();
            let kind = match e.file_type() {
                Ok(t) if t.is_dir() => {
                    stack.push(p.clone());
                    "dir"
                }
                Ok(t) if t.is_symlink() => "symlink",
                _ => "file",
            };
            out.insert((p, kind));
        }
    }
    out
}

/// Loop devices whose backing file lies under `root` (from sysfs).
fn loops_under(root: &Path) -> Vec<String> {
    let mut found = Vec::new();
    for e in std::fs::read_dir("/sys/block")
        .into_iter()
        .flatten()
        .flatten()
    {
        let backing = e.path().join("loop/backing_file");
        if let Ok(file) = std::fs::read_to_string(&backing)
            && Path::new(file.trim()).starts_with(root)
        {
            found.push(e.file_name().to_string_lossy().into_owned());
        }
    }
    found
}

/// What must not change across a refused call.
#[derive(Debug, PartialEq, Eq)]
struct World {
    files: BTreeSet<(PathBuf, &'static str)>,
    mounts: Vec<PathBuf>,
    loops: Vec<String>,
}

fn world(sb: &Sandbox) -> World {
    World {
        files: tree(&sb.root),
        mounts: sb.mounts(),
        loops: loops_under(&sb.root),
    }
}

fn mount_cap(fs_type: &str, flags: &[&str], mode: Mode) -> csi::VolumeCapability {
    csi::VolumeCapability {
        access_mode: Some(AccessMode { mode: mode as i32 }),
        access_type: Some(AccessType::Mount(MountVolume {
            fs_type: fs_type.into(),
            mount_flags: flags.iter().map(|f| f.to_string()).collect(),
            volume_mount_group: String::new(),
        })),
    }
}

fn block_cap() -> csi::VolumeCapability {
    csi::VolumeCapability {
        access_mode: Some(AccessMode {
            mode: Mode::SingleNodeWriter as i32,
        }),
        access_type: Some(AccessType::Block(BlockVolume {})),
    }
}

fn big_map() -> HashMap<String, String> {
    HashMap::from([("k".to_string(), "v".repeat(5000))])
}

/// Runs `call`, checks its code, and that the world did not change.
macro_rules! refused {
    ($sb:expr, $what:expr, $code:expr, $call:expr) => {{
        let before = world($sb);
        let got = $call.await.map(|_| ()).map_err(|s: tonic::Status| s.code());
        assert_eq!(got, Err($code), "{}", $what);
        assert_eq!(world($sb), before, "{} left something behind", $what);
    }};
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("rt")
}

#[test]
fn node_refuses_hostile_requests_and_leaves_nothing_behind() {
    let sb = Sandbox::new("hostile-node");
    let dev = sb.loop_device("h.img", 64 << 20);
    let socket = sb.root.join("csi.sock");
    let staging = sb.staging("pv");
    let target = sb.target("pod", "pv");
    let outside = sb.root.join("outside");
    std::fs::create_dir_all(&outside).expect("outside");
    let rt = runtime();
    let kubelet = sb.kubelet.display().to_string();
    let daemon = rt.block_on(Daemon::start(&socket, &sb.node_args("node-h", &[])));
    let s = |p: &Path| p.display().to_string();
    let k = |rel: &str| format!("{kubelet}/{rel}");
    let dev_ctx = HashMap::from([("devicePath".to_string(), s(&dev))]);
    let good_stage = csi::NodeStageVolumeRequest {
        volume_id: "vol-h".into(),
        publish_context: dev_ctx.clone(),
        staging_target_path: s(&staging),
        volume_capability: Some(mount_cap("ext4", &[], Mode::SingleNodeWriter)),
        secrets: HashMap::new(),
        volume_context: HashMap::new(),
    };
    let good_publish = csi::NodePublishVolumeRequest {
        volume_id: "vol-h".into(),
        publish_context: HashMap::new(),
        staging_target_path: s(&staging),
        target_path: s(&target),
        volume_capability: Some(mount_cap("ext4", &[], Mode::SingleNodeWriter)),
        readonly: false,
        secrets: HashMap::new(),
        volume_context: HashMap::new(),
    };
    // Paths no request may name: each is refused before anything is touched.
    let bad_paths: Vec<String> = vec![
        String::new(),
        "relative/path".into(),
        k("a/../../../etc"),
        k("a/./b"),
        k("a//b"),
        format!("{}/", k("a")),
        k("a\0b"),
        s(&outside.join("x")),
        "/etc".into(),
        kubelet.clone(),
        format!("{kubelet}-sibling/x"),
        k(&"long/".repeat(1000)),
    ];
    let bad_ids: Vec<String> = vec![String::new(), "x".repeat(129), "a\0b".into(), "a\nb".into()];
    let inv = Code::InvalidArgument;

    rt.block_on(async {
        let channel = connect(&socket).await.expect("connect");
        let mut node = NodeClient::new(channel.clone());

        // Empty requests, RPC by RPC.
        refused!(
            &sb,
            "empty stage",
            inv,
            node.node_stage_volume(csi::NodeStageVolumeRequest::default())
        );
        refused!(
            &sb,
            "empty unstage",
            inv,
            node.node_unstage_volume(csi::NodeUnstageVolumeRequest::default())
        );
        refused!(
            &sb,
            "empty publish",
            inv,
            node.node_publish_volume(csi::NodePublishVolumeRequest::default())
        );
        refused!(
            &sb,
            "empty unpublish",
            inv,
            node.node_unpublish_volume(csi::NodeUnpublishVolumeRequest::default())
        );
        refused!(
            &sb,
            "empty stats",
            inv,
            node.node_get_volume_stats(csi::NodeGetVolumeStatsRequest::default())
        );
        refused!(
            &sb,
            "empty expand",
            inv,
            node.node_expand_volume(csi::NodeExpandVolumeRequest::default())
        );

        for id in &bad_ids {
            let what = format!("volume_id {:?}", id.get(..20).unwrap_or(id));
            let mut r = good_stage.clone();
            r.volume_id = id.clone();
            refused!(&sb, format!("stage {what}"), inv, node.node_stage_volume(r));
            let mut r = good_publish.clone();
            r.volume_id = id.clone();
            refused!(
                &sb,
                format!("publish {what}"),
                inv,
                node.node_publish_volume(r)
            );
            refused!(
                &sb,
                format!("unstage {what}"),
                inv,
                node.node_unstage_volume(csi::NodeUnstageVolumeRequest {
                    volume_id: id.clone(),
                    staging_target_path: s(&staging),
                })
            );
            refused!(
                &sb,
                format!("unpublish {what}"),
                inv,
                node.node_unpublish_volume(csi::NodeUnpublishVolumeRequest {
                    volume_id: id.clone(),
                    target_path: s(&target),
                })
            );
            refused!(
                &sb,
                format!("stats {what}"),
                inv,
                node.node_get_volume_stats(csi::NodeGetVolumeStatsRequest {
                    volume_id: id.clone(),
                    volume_path: s(&target),
                    staging_target_path: String::new(),
                })
            );
            refused!(
                &sb,
                format!("expand {what}"),
                inv,
                node.node_expand_volume(csi::NodeExpandVolumeRequest {
                    volume_id: id.clone(),
                    volume_path: s(&target),
                    ..Default::default()
                })
            );
        }

        for p in &bad_paths {
            let what = format!("path {:?}", p.get(..60).unwrap_or(p));
            // Stats and expand name where the volume is: a well-formed path no volume can be
            // at is the spec's "volume not found"; a string that is no path is INVALID_ARGUMENT.
            let nowhere = if p.is_empty() || p.contains('\0') || p.len() > 4096 {
                inv
            } else {
                Code::NotFound
            };
            let mut r = good_stage.clone();
            r.staging_target_path = p.clone();
            refused!(&sb, format!("stage {what}"), inv, node.node_stage_volume(r));
            if !p.is_empty() {
                let mut r = good_publish.clone();
                r.staging_target_path = p.clone();
                refused!(
                    &sb,
                    format!("publish staging {what}"),
                    inv,
                    node.node_publish_volume(r)
                );
            }
            let mut r = good_publish.clone();
            r.target_path = p.clone();
            refused!(
                &sb,
                format!("publish target {what}"),
                inv,
                node.node_publish_volume(r)
            );
            refused!(
                &sb,
                format!("unstage {what}"),
                inv,
                node.node_unstage_volume(csi::NodeUnstageVolumeRequest {
                    volume_id: "vol-h".into(),
                    staging_target_path: p.clone(),
                })
            );
            refused!(
                &sb,
                format!("unpublish {what}"),
                inv,
                node.node_unpublish_volume(csi::NodeUnpublishVolumeRequest {
                    volume_id: "vol-h".into(),
                    target_path: p.clone(),
                })
            );
            refused!(
                &sb,
                format!("stats {what}"),
                nowhere,
                node.node_get_volume_stats(csi::NodeGetVolumeStatsRequest {
                    volume_id: "vol-h".into(),
                    volume_path: p.clone(),
                    staging_target_path: String::new(),
                })
            );
            refused!(
                &sb,
                format!("expand {what}"),
                nowhere,
                node.node_expand_volume(csi::NodeExpandVolumeRequest {
                    volume_id: "vol-h".into(),
                    volume_path: p.clone(),
                    ..Default::default()
                })
            );
        }

        // Capabilities: missing parts, unknown modes, unsupported filesystems, flags that
        // would change what is mounted.
        let mut caps: Vec<(String, Option<csi::VolumeCapability>)> = vec![
            ("no capability".into(), None),
            (
                "no access mode".into(),
                Some(csi::VolumeCapability {
                    access_mode: None,
                    access_type: Some(AccessType::Block(BlockVolume {})),
                }),
            ),
            (
                "no access type".into(),
                Some(csi::VolumeCapability {
                    access_mode: Some(AccessMode {
                        mode: Mode::SingleNodeWriter as i32,
                    }),
                    access_type: None,
                }),
            ),
            (
                "mode 0".into(),
                Some(csi::VolumeCapability {
                    access_mode: Some(AccessMode { mode: 0 }),
                    access_type: Some(AccessType::Block(BlockVolume {})),
                }),
            ),
            (
                "mode 99".into(),
                Some(csi::VolumeCapability {
                    access_mode: Some(AccessMode { mode: 99 }),
                    access_type: Some(AccessType::Block(BlockVolume {})),
                }),
            ),
            (
                "group not numeric".into(),
                Some(csi::VolumeCapability {
                    access_mode: Some(AccessMode {
                        mode: Mode::SingleNodeWriter as i32,
                    }),
                    access_type: Some(AccessType::Mount(MountVolume {
                        fs_type: "ext4".into(),
                        mount_flags: vec![],
                        volume_mount_group: "wheel".into(),
                    })),
                }),
            ),
        ];
        for fs in ["vfat", "nfs", "EXT4", "ext4\0", "proc", &"x".repeat(200)] {
            caps.push((
                format!("fs_type {:?}", fs.get(..10).unwrap_or(fs)),
                Some(mount_cap(fs, &[], Mode::SingleNodeWriter)),
            ));
        }
        let many: Vec<String> = (0..100).map(|_| "noatime".to_string()).collect();
        let many: Vec<&str> = many.iter().map(String::as_str).collect();
        for flags in [
            vec!["bind"],
            vec!["rbind"],
            vec!["remount"],
            vec!["shared"],
            vec!["loop"],
            vec!["errors=panic"],
            vec!["noatime,bind"],
            vec!["data=journal\0"],
            // An SELinux label with its closing quote missing, or a quote in its key.
            vec!["context=\"system_u:object_r:etc_t:s0,bind"],
            vec!["\"context\"=system_u:object_r:etc_t:s0"],
            vec!["x-unknown"],
            vec!["ro", "rw"],
            many,
        ] {
            caps.push((
                format!("mount_flags {:?}", flags.first()),
                Some(mount_cap("ext4", &flags, Mode::SingleNodeWriter)),
            ));
        }
        for (what, cap) in &caps {
            let mut r = good_stage.clone();
            r.volume_capability = cap.clone();
            refused!(&sb, format!("stage {what}"), inv, node.node_stage_volume(r));
            let mut r = good_publish.clone();
            r.volume_capability = cap.clone();
            refused!(
                &sb,
                format!("publish {what}"),
                inv,
                node.node_publish_volume(r)
            );
        }

        // publish_context: the device must be named, clean, and under /dev.
        for ctx in [
            HashMap::new(),
            HashMap::from([("devicePath".to_string(), String::new())]),
            HashMap::from([("devicePath".to_string(), "/etc/passwd".to_string())]),
            HashMap::from([("devicePath".to_string(), "/dev/../etc/shadow".to_string())]),
            HashMap::from([("devicePath".to_string(), "dev/loop0".to_string())]),
            HashMap::from([("devicePath".to_string(), s(&sb.data.join("h.img")))]),
            HashMap::from([("devicePath".to_string(), format!("{}\0", s(&dev)))]),
            big_map(),
        ] {
            let mut r = good_stage.clone();
            r.publish_context = ctx.clone();
            refused!(
                &sb,
                format!("stage publish_context {:?}", ctx.keys().collect::<Vec<_>>()),
                inv,
                node.node_stage_volume(r)
            );
        }
        // Oversized maps.
        let mut r = good_stage.clone();
        r.volume_context = big_map();
        refused!(
            &sb,
            "stage volume_context 5000 bytes",
            inv,
            node.node_stage_volume(r)
        );
        let mut r = good_stage.clone();
        r.secrets = big_map();
        refused!(
            &sb,
            "stage secrets 5000 bytes",
            inv,
            node.node_stage_volume(r)
        );
        let mut r = good_publish.clone();
        r.volume_context = big_map();
        refused!(
            &sb,
            "publish volume_context 5000 bytes",
            inv,
            node.node_publish_volume(r)
        );
        let mut r = good_publish.clone();
        r.secrets = big_map();
        refused!(
            &sb,
            "publish secrets 5000 bytes",
            inv,
            node.node_publish_volume(r)
        );

        // Publish: staging not set is the spec's FAILED_PRECONDITION; overlapping paths and
        // a target equal to the staging path are refused.
        let mut r = good_publish.clone();
        r.staging_target_path = String::new();
        refused!(
            &sb,
            "publish without staging",
            Code::FailedPrecondition,
            node.node_publish_volume(r)
        );
        let mut r = good_publish.clone();
        r.target_path = s(&staging);
        refused!(
            &sb,
            "publish target == staging",
            inv,
            node.node_publish_volume(r)
        );
        let mut r = good_publish.clone();
        r.target_path = s(&staging.join("below"));
        refused!(
            &sb,
            "publish target below staging",
            inv,
            node.node_publish_volume(r)
        );

        // Expand: negative or contradictory capacity.
        for (req_b, lim_b) in [(-1, 0), (0, -1), (10, 5)] {
            refused!(
                &sb,
                format!("expand capacity ({req_b}, {lim_b})"),
                inv,
                node.node_expand_volume(csi::NodeExpandVolumeRequest {
                    volume_id: "vol-h".into(),
                    volume_path: s(&target),
                    capacity_range: Some(csi::CapacityRange {
                        required_bytes: req_b,
                        limit_bytes: lim_b
                    }),
                    ..Default::default()
                })
            );
        }

        // A well-formed stage of a block capability is not refused for its shape: the
        // validation above is not simply refusing everything. (Undone right after.)
        let mut r = good_stage.clone();
        r.volume_capability = Some(block_cap());
        node.node_stage_volume(r)
            .await
            .expect("well-formed block stage");
        node.node_unstage_volume(csi::NodeUnstageVolumeRequest {
            volume_id: "vol-h".into(),
            staging_target_path: s(&staging),
        })
        .await
        .expect("unstage");

        // A message far beyond any limit.
        let mut r = good_stage.clone();
        r.volume_id = "v".repeat(8 << 20);
        let before = world(&sb);
        assert!(node.node_stage_volume(r).await.is_err());
        assert_eq!(world(&sb), before);

        // Still serving.
        let mut id = IdentityClient::new(channel.clone());
        assert_eq!(
            id.probe(csi::ProbeRequest {})
                .await
                .expect("probe")
                .into_inner()
                .ready,
            Some(true)
        );
    });
    drop(rt);
    let mut daemon = daemon;
    assert!(daemon.terminate().success());
    assert!(sb.mounts().is_empty());
    let _ = outside;
}

#[test]
fn controller_refuses_hostile_requests_and_leaves_nothing_behind() {
    let sb = Sandbox::new("hostile-controller");
    let socket = sb.root.join("ctl.sock");
    let data = sb.data.join("controller");
    let rt = runtime();
    let data_arg = data.display().to_string();
    let daemon = rt.block_on(Daemon::start_program(
        "moor-controller",
        &socket,
        &["--node-id", "node-h", "--data-dir", &data_arg],
    ));
    let inv = Code::InvalidArgument;
    let cap = mount_cap("ext4", &[], Mode::SingleNodeWriter);
    let good_create = csi::CreateVolumeRequest {
        name: "pvc-h".into(),
        capacity_range: Some(csi::CapacityRange {
            required_bytes: 16 << 20,
            limit_bytes: 0,
        }),
        volume_capabilities: vec![cap.clone()],
        ..Default::default()
    };
    let bad_ids: Vec<String> = vec![String::new(), "x".repeat(129), "a\0b".into(), "a\nb".into()];

    rt.block_on(async {
        let channel = connect(&socket).await.expect("connect");
        let mut c = ControllerClient::new(channel.clone());

        refused!(
            &sb,
            "empty create",
            inv,
            c.create_volume(csi::CreateVolumeRequest::default())
        );
        refused!(
            &sb,
            "empty delete",
            inv,
            c.delete_volume(csi::DeleteVolumeRequest::default())
        );
        refused!(
            &sb,
            "empty publish",
            inv,
            c.controller_publish_volume(csi::ControllerPublishVolumeRequest::default())
        );
        refused!(
            &sb,
            "empty unpublish",
            inv,
            c.controller_unpublish_volume(csi::ControllerUnpublishVolumeRequest::default())
        );
        refused!(
            &sb,
            "empty validate",
            inv,
            c.validate_volume_capabilities(csi::ValidateVolumeCapabilitiesRequest::default())
        );
        refused!(
            &sb,
            "empty expand",
            inv,
            c.controller_expand_volume(csi::ControllerExpandVolumeRequest::default())
        );
        refused!(
            &sb,
            "empty get volume",
            inv,
            c.controller_get_volume(csi::ControllerGetVolumeRequest::default())
        );
        refused!(
            &sb,
            "empty create snapshot",
            inv,
            c.create_snapshot(csi::CreateSnapshotRequest::default())
        );
        refused!(
            &sb,
            "empty delete snapshot",
            inv,
            c.delete_snapshot(csi::DeleteSnapshotRequest::default())
        );
        refused!(
            &sb,
            "empty get snapshot",
            inv,
            c.get_snapshot(csi::GetSnapshotRequest::default())
        );

        // Names and ids: empty, oversized, control characters; ids that try to walk out of
        // the data dir are at worst NOT_FOUND, never a file touched outside.
        for id in &bad_ids {
            let what = format!("{:?}", id.get(..20).unwrap_or(id));
            // The spec allows line feeds in names; it bans most other control characters.
            let name: String = if id.contains('\n') {
                "a\u{1}b".into()
            } else {
                id.clone()
            };
            let mut r = good_create.clone();
            // The spec allows line feeds in names; it bans most other control characters.
            r.name = name.clone();
            refused!(&sb, format!("create name {what}"), inv, c.create_volume(r));
            refused!(
                &sb,
                format!("delete {what}"),
                inv,
                c.delete_volume(csi::DeleteVolumeRequest {
                    volume_id: id.clone(),
                    ..Default::default()
                })
            );
            refused!(
                &sb,
                format!("publish volume {what}"),
                inv,
                c.controller_publish_volume(csi::ControllerPublishVolumeRequest {
                    volume_id: id.clone(),
                    node_id: "node-h".into(),
                    volume_capability: Some(cap.clone()),
                    ..Default::default()
                })
            );
            // Node ids may be up to 192 bytes long.
            let node = if id.len() > 128 {
                "x".repeat(193)
            } else {
                id.clone()
            };
            refused!(
                &sb,
                format!("publish node {what}"),
                inv,
                c.controller_publish_volume(csi::ControllerPublishVolumeRequest {
                    volume_id: "v".into(),
                    node_id: node,
                    volume_capability: Some(cap.clone()),
                    ..Default::default()
                })
            );
            refused!(
                &sb,
                format!("unpublish {what}"),
                inv,
                c.controller_unpublish_volume(csi::ControllerUnpublishVolumeRequest {
                    volume_id: id.clone(),
                    ..Default::default()
                })
            );
            refused!(
                &sb,
                format!("validate {what}"),
                inv,
                c.validate_volume_capabilities(csi::ValidateVolumeCapabilitiesRequest {
                    volume_id: id.clone(),
                    volume_capabilities: vec![cap.clone()],
                    ..Default::default()
                })
            );
            refused!(
                &sb,
                format!("expand {what}"),
                inv,
                c.controller_expand_volume(csi::ControllerExpandVolumeRequest {
                    volume_id: id.clone(),
                    capacity_range: Some(csi::CapacityRange {
                        required_bytes: 1 << 30,
                        limit_bytes: 0
                    }),
                    ..Default::default()
                })
            );
            refused!(
                &sb,
                format!("get volume {what}"),
                inv,
                c.controller_get_volume(csi::ControllerGetVolumeRequest {
                    volume_id: id.clone()
                })
            );
            refused!(
                &sb,
                format!("snapshot name {what}"),
                inv,
                c.create_snapshot(csi::CreateSnapshotRequest {
                    source_volume_id: "v".into(),
                    name: name.clone(),
                    ..Default::default()
                })
            );
            refused!(
                &sb,
                format!("snapshot source {what}"),
                inv,
                c.create_snapshot(csi::CreateSnapshotRequest {
                    source_volume_id: id.clone(),
                    name: "snap".into(),
                    ..Default::default()
                })
            );
            refused!(
                &sb,
                format!("delete snapshot {what}"),
                inv,
                c.delete_snapshot(csi::DeleteSnapshotRequest {
                    snapshot_id: id.clone(),
                    ..Default::default()
                })
            );
            refused!(
                &sb,
                format!("get snapshot {what}"),
                inv,
                c.get_snapshot(csi::GetSnapshotRequest {
                    snapshot_id: id.clone(),
                    ..Default::default()
                })
            );
        }
        for id in ["../../../../etc/passwd", "..", ".", "/etc/passwd", "a/b"] {
            let before = world(&sb);
            let got = c
                .controller_get_volume(csi::ControllerGetVolumeRequest {
                    volume_id: id.into(),
                })
                .await;
            assert!(
                matches!(
                    got.map_err(|s| s.code()),
                    Err(Code::NotFound | Code::InvalidArgument)
                ),
                "get volume {id:?}"
            );
            let got = c
                .delete_volume(csi::DeleteVolumeRequest {
                    volume_id: id.into(),
                    ..Default::default()
                })
                .await;
            // Deleting an unknown id succeeds (idempotence) or is refused; either way, nothing
            // outside (or inside) the data dir is removed.
            let _ = got;
            let got = c
                .delete_snapshot(csi::DeleteSnapshotRequest {
                    snapshot_id: id.into(),
                    ..Default::default()
                })
                .await;
            let _ = got;
            assert_eq!(world(&sb), before, "id {id:?} touched something");
        }

        // Capabilities and capacities.
        let mut r = good_create.clone();
        r.volume_capabilities = vec![];
        refused!(&sb, "create without capabilities", inv, c.create_volume(r));
        let mut r = good_create.clone();
        r.volume_capabilities = vec![csi::VolumeCapability {
            access_mode: None,
            access_type: Some(AccessType::Block(BlockVolume {})),
        }];
        refused!(&sb, "create without access mode", inv, c.create_volume(r));
        let mut r = good_create.clone();
        r.volume_capabilities = vec![csi::VolumeCapability {
            access_mode: Some(AccessMode { mode: 99 }),
            access_type: Some(AccessType::Block(BlockVolume {})),
        }];
        refused!(&sb, "create with mode 99", inv, c.create_volume(r));
        let mut r = good_create.clone();
        r.volume_capabilities = vec![cap.clone(); 100];
        refused!(&sb, "create with 100 capabilities", inv, c.create_volume(r));
        for (req_b, lim_b) in [(-1, 0), (0, -1), (0, 0)] {
            let mut r = good_create.clone();
            r.capacity_range = Some(csi::CapacityRange {
                required_bytes: req_b,
                limit_bytes: lim_b,
            });
            refused!(
                &sb,
                format!("create capacity ({req_b}, {lim_b})"),
                inv,
                c.create_volume(r)
            );
        }
        for (what, field) in [("parameters", 0), ("secrets", 1), ("mutable_parameters", 2)] {
            let mut r = good_create.clone();
            match field {
                0 => r.parameters = big_map(),
                1 => r.secrets = big_map(),
                _ => r.mutable_parameters = big_map(),
            }
            refused!(
                &sb,
                format!("create {what} 5000 bytes"),
                inv,
                c.create_volume(r)
            );
        }
        let mut r = good_create.clone();
        r.volume_content_source = Some(csi::VolumeContentSource { r#type: None });
        refused!(
            &sb,
            "create with empty content source",
            inv,
            c.create_volume(r)
        );
        let mut r = good_create.clone();
        r.accessibility_requirements = Some(csi::TopologyRequirement::default());
        refused!(&sb, "create with empty topology", inv, c.create_volume(r));
        refused!(
            &sb,
            "list volumes negative max",
            inv,
            c.list_volumes(csi::ListVolumesRequest {
                max_entries: -1,
                starting_token: String::new()
            })
        );
        refused!(
            &sb,
            "list snapshots negative max",
            inv,
            c.list_snapshots(csi::ListSnapshotsRequest {
                max_entries: -1,
                ..Default::default()
            })
        );
        refused!(
            &sb,
            "list volumes long token",
            Code::Aborted,
            c.list_volumes(csi::ListVolumesRequest {
                max_entries: 0,
                starting_token: "t".repeat(200)
            })
        );
        refused!(
            &sb,
            "get capacity bad mode",
            inv,
            c.get_capacity(csi::GetCapacityRequest {
                volume_capabilities: vec![csi::VolumeCapability {
                    access_mode: Some(AccessMode { mode: 99 }),
                    access_type: Some(AccessType::Block(BlockVolume {}))
                }],
                ..Default::default()
            })
        );
        refused!(
            &sb,
            "expand without capacity",
            inv,
            c.controller_expand_volume(csi::ControllerExpandVolumeRequest {
                volume_id: "v".into(),
                ..Default::default()
            })
        );

        let mut id = IdentityClient::new(channel.clone());
        id.probe(csi::ProbeRequest {}).await.expect("still serving");
    });
    drop(rt);
    let mut daemon = daemon;
    assert!(daemon.terminate().success());
}
