//! The commands that are one or a few CSI calls: each builds a request from the command line,
//! makes the call and turns the answer into a [`Report`].

use std::collections::HashMap;
use std::time::Duration;

use csi::controller_client::ControllerClient;
use csi::identity_client::IdentityClient;
use csi::node_client::NodeClient;
use csi::volume_capability::{AccessMode, AccessType, BlockVolume, MountVolume, access_mode};
use moor_proto::csi::v1 as csi;
use moor_runtime::contract::DEVICE_PATH_KEY;
use serde_json::{Value, json};
use tonic::transport::Channel;

use crate::cli::{self, CapabilityArgs, SnapshotCommand, VolumeCommand};
use crate::error::CliError;
use crate::output::{Human, Report, Table, human_bytes, key_values};

/// Clients of the three CSI services on one connection.
#[derive(Debug, Clone)]
pub struct Clients {
    identity: IdentityClient<Channel>,
    controller: ControllerClient<Channel>,
    node: NodeClient<Channel>,
}

impl Clients {
    /// Clients on `channel`.
    pub fn new(channel: Channel) -> Self {
        Self {
            identity: IdentityClient::new(channel.clone()),
            controller: ControllerClient::new(channel.clone()),
            node: NodeClient::new(channel),
        }
    }
}

/// A request with the call deadline set.
fn req<T>(msg: T, timeout: Duration) -> tonic::Request<T> {
    let mut r = tonic::Request::new(msg);
    r.set_timeout(timeout);
    r
}

/// The CSI capability the arguments describe.
pub fn capability(args: &CapabilityArgs) -> csi::VolumeCapability {
    use access_mode::Mode;
    let mode = match args.access_mode {
        cli::AccessMode::SingleNodeWriter => Mode::SingleNodeWriter,
        cli::AccessMode::SingleNodeReaderOnly => Mode::SingleNodeReaderOnly,
        cli::AccessMode::MultiNodeReaderOnly => Mode::MultiNodeReaderOnly,
        cli::AccessMode::MultiNodeSingleWriter => Mode::MultiNodeSingleWriter,
        cli::AccessMode::MultiNodeMultiWriter => Mode::MultiNodeMultiWriter,
        cli::AccessMode::SingleNodeSingleWriter => Mode::SingleNodeSingleWriter,
        cli::AccessMode::SingleNodeMultiWriter => Mode::SingleNodeMultiWriter,
    };
    let access_type = if args.block {
        AccessType::Block(BlockVolume {})
    } else {
        AccessType::Mount(MountVolume {
            fs_type: args.fs_type.clone(),
            mount_flags: args.mount_flags.clone(),
            volume_mount_group: String::new(),
        })
    };
    csi::VolumeCapability {
        access_mode: Some(AccessMode { mode: mode as i32 }),
        access_type: Some(access_type),
    }
}

/// `info`: identity first; then whichever of the node and controller services answers.
pub async fn info(c: &mut Clients, t: Duration) -> Result<Report, CliError> {
    let plugin = c
        .identity
        .get_plugin_info(req(csi::GetPluginInfoRequest {}, t))
        .await
        .map_err(CliError::rpc("GetPluginInfo"))?
        .into_inner();
    let caps = c
        .identity
        .get_plugin_capabilities(req(csi::GetPluginCapabilitiesRequest {}, t))
        .await
        .map_err(CliError::rpc("GetPluginCapabilities"))?
        .into_inner();
    // An unhealthy plugin answers Probe with an error: shown as not ready, with the reason.
    let (ready, not_ready) = match c.identity.probe(req(csi::ProbeRequest {}, t)).await {
        Ok(r) => (r.into_inner().ready, None),
        Err(s) if s.code() == tonic::Code::FailedPrecondition => {
            (Some(false), Some(s.message().to_string()))
        }
        Err(s) => return Err(CliError::rpc("Probe")(s)),
    };
    let plugin_caps: Vec<String> = caps
        .capabilities
        .iter()
        .filter_map(|cap| cap.r#type.as_ref())
        .map(plugin_capability_name)
        .collect();
    let serves_controller = caps.capabilities.iter().any(|cap| {
        matches!(
            cap.r#type,
            Some(csi::plugin_capability::Type::Service(ref s))
                if s.r#type == csi::plugin_capability::service::Type::ControllerService as i32
        )
    });

    let mut table = Table::new(&["FIELD", "VALUE"]);
    table.row(vec!["driver".into(), plugin.name.clone()]);
    table.row(vec!["version".into(), plugin.vendor_version.clone()]);
    let ready_cell = match &not_ready {
        Some(why) => format!("no: {why}"),
        None => ready_text(ready).into(),
    };
    table.row(vec!["ready".into(), ready_cell]);
    table.row(vec!["plugin capabilities".into(), list_text(&plugin_caps)]);
    let mut json = json!({
        "name": plugin.name,
        "vendor_version": plugin.vendor_version,
        "manifest": plugin.manifest,
        "ready": ready,
        "plugin_capabilities": plugin_caps,
    });
    if let Some(why) = not_ready {
        json["not_ready"] = json!(why);
    }

    // A node socket serves Node; the controller's serves Controller. Ask both, keep what
    // answers; UNIMPLEMENTED means "not this service".
    match c
        .node
        .node_get_info(req(csi::NodeGetInfoRequest {}, t))
        .await
    {
        Ok(ni) => {
            let ni = ni.into_inner();
            let node_caps = c
                .node
                .node_get_capabilities(req(csi::NodeGetCapabilitiesRequest {}, t))
                .await
                .map_err(CliError::rpc("NodeGetCapabilities"))?
                .into_inner();
            let names: Vec<String> = node_caps
                .capabilities
                .iter()
                .filter_map(|c| c.r#type.as_ref())
                .map(|csi::node_service_capability::Type::Rpc(r)| {
                    csi::node_service_capability::rpc::Type::try_from(r.r#type).map_or_else(
                        |_| format!("UNKNOWN({})", r.r#type),
                        |x| x.as_str_name().to_string(),
                    )
                })
                .collect();
            let topology = ni
                .accessible_topology
                .as_ref()
                .map(|t| key_values(&t.segments))
                .unwrap_or_else(|| "-".into());
            table.row(vec!["node id".into(), ni.node_id.clone()]);
            table.row(vec![
                "max volumes".into(),
                if ni.max_volumes_per_node == 0 {
                    "no limit".into()
                } else {
                    ni.max_volumes_per_node.to_string()
                },
            ]);
            table.row(vec!["topology".into(), topology.clone()]);
            table.row(vec!["node capabilities".into(), list_text(&names)]);
            json["node"] = json!({
                "node_id": ni.node_id,
                "max_volumes_per_node": ni.max_volumes_per_node,
                "topology": ni.accessible_topology.map(|t| t.segments),
                "capabilities": names,
            });
        }
        Err(s) if s.code() == tonic::Code::Unimplemented => {}
        Err(s) => return Err(CliError::rpc("NodeGetInfo")(s)),
    }
    // Every instance advertises the controller service; the node's socket does not serve it.
    let controller = if serves_controller {
        match c
            .controller
            .controller_get_capabilities(req(csi::ControllerGetCapabilitiesRequest {}, t))
            .await
        {
            Ok(caps) => Some(caps.into_inner()),
            Err(s) if s.code() == tonic::Code::Unimplemented => None,
            Err(s) => return Err(CliError::rpc("ControllerGetCapabilities")(s)),
        }
    } else {
        None
    };
    if let Some(caps) = controller {
        let names: Vec<String> = caps
            .capabilities
            .iter()
            .filter_map(|c| c.r#type.as_ref())
            .map(|csi::controller_service_capability::Type::Rpc(r)| {
                csi::controller_service_capability::rpc::Type::try_from(r.r#type).map_or_else(
                    |_| format!("UNKNOWN({})", r.r#type),
                    |x| x.as_str_name().to_string(),
                )
            })
            .collect();
        table.row(vec!["controller capabilities".into(), list_text(&names)]);
        json["controller"] = json!({ "capabilities": names });
    }
    Ok(Report::table(table, json))
}

fn ready_text(ready: Option<bool>) -> &'static str {
    match ready {
        Some(true) => "yes",
        Some(false) => "no",
        None => "not said",
    }
}

fn list_text(items: &[String]) -> String {
    if items.is_empty() {
        "-".into()
    } else {
        items.join(", ")
    }
}

fn plugin_capability_name(t: &csi::plugin_capability::Type) -> String {
    use csi::plugin_capability::Type;
    match t {
        Type::Service(s) => csi::plugin_capability::service::Type::try_from(s.r#type).map_or_else(
            |_| format!("UNKNOWN({})", s.r#type),
            |x| x.as_str_name().into(),
        ),
        Type::VolumeExpansion(v) => format!(
            "VOLUME_EXPANSION_{}",
            csi::plugin_capability::volume_expansion::Type::try_from(v.r#type).map_or_else(
                |_| format!("UNKNOWN({})", v.r#type),
                |x| x.as_str_name().into()
            )
        ),
    }
}

/// `probe`.
pub async fn probe(c: &mut Clients, t: Duration) -> Result<Report, CliError> {
    let ready = c
        .identity
        .probe(req(csi::ProbeRequest {}, t))
        .await
        .map_err(CliError::rpc("Probe"))?
        .into_inner()
        .ready;
    let text = match ready {
        Some(false) => "the plugin answers but is not ready",
        _ => "the plugin is ready",
    };
    Ok(Report::text(text, json!({ "ready": ready })))
}

fn source_text(src: Option<&csi::VolumeContentSource>) -> String {
    use csi::volume_content_source::Type;
    match src.and_then(|s| s.r#type.as_ref()) {
        Some(Type::Snapshot(s)) => format!("snapshot {}", s.snapshot_id),
        Some(Type::Volume(v)) => format!("volume {}", v.volume_id),
        None => "-".into(),
    }
}

fn volume_json(v: &csi::Volume) -> Value {
    json!({
        "volume_id": v.volume_id,
        "capacity_bytes": v.capacity_bytes,
        "volume_context": v.volume_context,
        "content_source": source_text(v.content_source.as_ref()),
        "accessible_topology": v.accessible_topology.iter().map(|t| &t.segments).collect::<Vec<_>>(),
    })
}

fn condition_text(c: Option<&csi::VolumeCondition>) -> String {
    match c {
        Some(c) if c.abnormal => format!("abnormal: {}", c.message),
        Some(c) if c.message.is_empty() => "normal".into(),
        Some(c) => format!("normal: {}", c.message),
        None => "-".into(),
    }
}

fn condition_json(c: Option<&csi::VolumeCondition>) -> Value {
    c.map_or(
        Value::Null,
        |c| json!({ "abnormal": c.abnormal, "message": c.message }),
    )
}

/// `volume ...`.
pub async fn volume(c: &mut Clients, cmd: &VolumeCommand, t: Duration) -> Result<Report, CliError> {
    match cmd {
        VolumeCommand::Create(a) => {
            use csi::volume_content_source::{SnapshotSource, Type, VolumeSource};
            let source = match (&a.from_snapshot, &a.from_volume) {
                (Some(s), _) => Some(Type::Snapshot(SnapshotSource {
                    snapshot_id: s.clone(),
                })),
                (None, Some(v)) => Some(Type::Volume(VolumeSource {
                    volume_id: v.clone(),
                })),
                (None, None) => None,
            };
            let v = c
                .controller
                .create_volume(req(
                    csi::CreateVolumeRequest {
                        name: a.name.clone(),
                        capacity_range: Some(range(a.size)),
                        volume_capabilities: vec![capability(&a.cap)],
                        parameters: a.params.iter().cloned().collect(),
                        volume_content_source: source
                            .map(|s| csi::VolumeContentSource { r#type: Some(s) }),
                        ..Default::default()
                    },
                    t,
                ))
                .await
                .map_err(CliError::rpc("CreateVolume"))?
                .into_inner()
                .volume
                .ok_or(CliError::Incomplete {
                    rpc: "CreateVolume",
                    what: "a volume",
                })?;
            Ok(Report::text(
                format!(
                    "volume {} created ({}{})",
                    v.volume_id,
                    human_bytes(v.capacity_bytes),
                    match source_text(v.content_source.as_ref()).as_str() {
                        "-" => String::new(),
                        s => format!(", from {s}"),
                    }
                ),
                volume_json(&v),
            ))
        }
        VolumeCommand::Delete(a) => {
            c.controller
                .delete_volume(req(
                    csi::DeleteVolumeRequest {
                        volume_id: a.id.clone(),
                        ..Default::default()
                    },
                    t,
                ))
                .await
                .map_err(CliError::rpc("DeleteVolume"))?;
            Ok(Report::text(
                format!("volume {} deleted", a.id),
                json!({ "deleted": a.id }),
            ))
        }
        VolumeCommand::List => {
            let mut entries = Vec::new();
            let mut token = String::new();
            loop {
                let page = c
                    .controller
                    .list_volumes(req(
                        csi::ListVolumesRequest {
                            max_entries: 0,
                            starting_token: token.clone(),
                        },
                        t,
                    ))
                    .await
                    .map_err(CliError::rpc("ListVolumes"))?
                    .into_inner();
                entries.extend(page.entries);
                if page.next_token.is_empty() || page.next_token == token {
                    break;
                }
                token = page.next_token;
            }
            let mut table = Table::new(&["VOLUME", "SIZE", "SOURCE", "PUBLISHED ON", "CONDITION"]);
            let mut json = Vec::new();
            for e in &entries {
                let Some(v) = &e.volume else { continue };
                let nodes = e
                    .status
                    .as_ref()
                    .map(|s| s.published_node_ids.clone())
                    .unwrap_or_default();
                let cond = e.status.as_ref().and_then(|s| s.volume_condition.as_ref());
                table.row(vec![
                    v.volume_id.clone(),
                    human_bytes(v.capacity_bytes),
                    source_text(v.content_source.as_ref()),
                    list_text(&nodes),
                    condition_text(cond),
                ]);
                let mut j = volume_json(v);
                j["published_node_ids"] = json!(nodes);
                j["condition"] = condition_json(cond);
                json.push(j);
            }
            let n = table.rows.len();
            Ok(Report {
                human: Human::Table(table, count_text(n, "volume")),
                json: Value::Array(json),
            })
        }
        VolumeCommand::Get(a) => {
            let r = c
                .controller
                .controller_get_volume(req(
                    csi::ControllerGetVolumeRequest {
                        volume_id: a.id.clone(),
                    },
                    t,
                ))
                .await
                .map_err(CliError::rpc("ControllerGetVolume"))?
                .into_inner();
            let v = r.volume.ok_or(CliError::Incomplete {
                rpc: "ControllerGetVolume",
                what: "a volume",
            })?;
            let nodes = r
                .status
                .as_ref()
                .map(|s| s.published_node_ids.clone())
                .unwrap_or_default();
            let cond = r.status.as_ref().and_then(|s| s.volume_condition.as_ref());
            let mut table = Table::new(&["FIELD", "VALUE"]);
            table.row(vec!["volume".into(), v.volume_id.clone()]);
            table.row(vec![
                "size".into(),
                format!(
                    "{} ({} bytes)",
                    human_bytes(v.capacity_bytes),
                    v.capacity_bytes
                ),
            ]);
            table.row(vec![
                "source".into(),
                source_text(v.content_source.as_ref()),
            ]);
            table.row(vec!["context".into(), key_values(&v.volume_context)]);
            table.row(vec!["published on".into(), list_text(&nodes)]);
            table.row(vec!["condition".into(), condition_text(cond)]);
            let mut j = volume_json(&v);
            j["published_node_ids"] = json!(nodes);
            j["condition"] = condition_json(cond);
            Ok(Report::table(table, j))
        }
        VolumeCommand::Expand(a) => {
            let r = c
                .controller
                .controller_expand_volume(req(
                    csi::ControllerExpandVolumeRequest {
                        volume_id: a.id.clone(),
                        capacity_range: Some(range(a.size)),
                        volume_capability: Some(capability(&a.cap)),
                        ..Default::default()
                    },
                    t,
                ))
                .await
                .map_err(CliError::rpc("ControllerExpandVolume"))?
                .into_inner();
            let node = if r.node_expansion_required {
                "; the node must grow the filesystem (NodeExpandVolume)"
            } else {
                ""
            };
            Ok(Report::text(
                format!(
                    "volume {} is now {}{node}",
                    a.id,
                    human_bytes(r.capacity_bytes)
                ),
                json!({
                    "volume_id": a.id,
                    "capacity_bytes": r.capacity_bytes,
                    "node_expansion_required": r.node_expansion_required,
                }),
            ))
        }
    }
}

fn count_text(n: usize, what: &str) -> String {
    if n == 1 {
        format!("1 {what}")
    } else {
        format!("{n} {what}s")
    }
}

fn range(bytes: u64) -> csi::CapacityRange {
    csi::CapacityRange {
        required_bytes: i64::try_from(bytes).unwrap_or(i64::MAX),
        limit_bytes: 0,
    }
}

fn snapshot_json(s: &csi::Snapshot) -> Value {
    json!({
        "snapshot_id": s.snapshot_id,
        "source_volume_id": s.source_volume_id,
        "size_bytes": s.size_bytes,
        "ready_to_use": s.ready_to_use,
        "creation_time": s.creation_time.as_ref().map(|t| t.seconds),
    })
}

/// `snapshot ...`.
pub async fn snapshot(
    c: &mut Clients,
    cmd: &SnapshotCommand,
    t: Duration,
) -> Result<Report, CliError> {
    match cmd {
        SnapshotCommand::Create(a) => {
            let s = c
                .controller
                .create_snapshot(req(
                    csi::CreateSnapshotRequest {
                        source_volume_id: a.volume.clone(),
                        name: a.name.clone(),
                        ..Default::default()
                    },
                    t,
                ))
                .await
                .map_err(CliError::rpc("CreateSnapshot"))?
                .into_inner()
                .snapshot
                .ok_or(CliError::Incomplete {
                    rpc: "CreateSnapshot",
                    what: "a snapshot",
                })?;
            Ok(Report::text(
                format!(
                    "snapshot {} of volume {} created ({}{})",
                    s.snapshot_id,
                    s.source_volume_id,
                    human_bytes(s.size_bytes),
                    if s.ready_to_use {
                        ", ready"
                    } else {
                        ", not ready yet"
                    }
                ),
                snapshot_json(&s),
            ))
        }
        SnapshotCommand::Delete(a) => {
            c.controller
                .delete_snapshot(req(
                    csi::DeleteSnapshotRequest {
                        snapshot_id: a.id.clone(),
                        ..Default::default()
                    },
                    t,
                ))
                .await
                .map_err(CliError::rpc("DeleteSnapshot"))?;
            Ok(Report::text(
                format!("snapshot {} deleted", a.id),
                json!({ "deleted": a.id }),
            ))
        }
        SnapshotCommand::List(a) => {
            let mut all = Vec::new();
            let mut token = String::new();
            loop {
                let page = c
                    .controller
                    .list_snapshots(req(
                        csi::ListSnapshotsRequest {
                            source_volume_id: a.volume.clone().unwrap_or_default(),
                            starting_token: token.clone(),
                            ..Default::default()
                        },
                        t,
                    ))
                    .await
                    .map_err(CliError::rpc("ListSnapshots"))?
                    .into_inner();
                all.extend(page.entries.into_iter().filter_map(|e| e.snapshot));
                if page.next_token.is_empty() || page.next_token == token {
                    break;
                }
                token = page.next_token;
            }
            let mut table = Table::new(&["SNAPSHOT", "VOLUME", "SIZE", "READY"]);
            for s in &all {
                table.row(vec![
                    s.snapshot_id.clone(),
                    s.source_volume_id.clone(),
                    human_bytes(s.size_bytes),
                    if s.ready_to_use { "yes" } else { "no" }.into(),
                ]);
            }
            Ok(Report {
                human: Human::Table(table, count_text(all.len(), "snapshot")),
                json: Value::Array(all.iter().map(snapshot_json).collect()),
            })
        }
    }
}

/// `publish` (ControllerPublishVolume).
pub async fn publish(
    c: &mut Clients,
    a: &cli::PublishArgs,
    t: Duration,
) -> Result<Report, CliError> {
    let r = c
        .controller
        .controller_publish_volume(req(
            csi::ControllerPublishVolumeRequest {
                volume_id: a.volume.clone(),
                node_id: a.node.clone(),
                volume_capability: Some(capability(&a.cap)),
                readonly: a.readonly,
                ..Default::default()
            },
            t,
        ))
        .await
        .map_err(CliError::rpc("ControllerPublishVolume"))?
        .into_inner();
    let mut table = Table::new(&["PUBLISH CONTEXT", "VALUE"]);
    let mut pairs: Vec<_> = r.publish_context.iter().collect();
    pairs.sort();
    for (k, v) in pairs {
        table.row(vec![k.clone(), v.clone()]);
    }
    Ok(Report {
        human: Human::Table(
            table,
            format!(
                "volume {} is attached to node {}; pass the context to `moorctl stage` with --context KEY=VALUE",
                a.volume, a.node
            ),
        ),
        json: json!({ "publish_context": r.publish_context }),
    })
}

/// `unpublish` (ControllerUnpublishVolume).
pub async fn unpublish(
    c: &mut Clients,
    a: &cli::UnpublishArgs,
    t: Duration,
) -> Result<Report, CliError> {
    c.controller
        .controller_unpublish_volume(req(
            csi::ControllerUnpublishVolumeRequest {
                volume_id: a.volume.clone(),
                node_id: a.node.clone(),
                ..Default::default()
            },
            t,
        ))
        .await
        .map_err(CliError::rpc("ControllerUnpublishVolume"))?;
    Ok(Report::text(
        format!("volume {} is detached from node {}", a.volume, a.node),
        json!({ "volume_id": a.volume, "node_id": a.node, "detached": true }),
    ))
}

/// `stage` (NodeStageVolume).
pub async fn stage(c: &mut Clients, a: &cli::StageArgs, t: Duration) -> Result<Report, CliError> {
    let mut context: HashMap<String, String> = a.context.iter().cloned().collect();
    if let Some(d) = &a.device {
        context.insert(DEVICE_PATH_KEY.into(), d.clone());
    }
    let staging = a.staging.display().to_string();
    c.node
        .node_stage_volume(req(
            csi::NodeStageVolumeRequest {
                volume_id: a.volume.clone(),
                publish_context: context,
                staging_target_path: staging.clone(),
                volume_capability: Some(capability(&a.cap)),
                ..Default::default()
            },
            t,
        ))
        .await
        .map_err(CliError::rpc("NodeStageVolume"))?;
    Ok(Report::text(
        format!("volume {} is staged at {staging}", a.volume),
        json!({ "volume_id": a.volume, "staging_target_path": staging, "staged": true }),
    ))
}

/// `unstage` (NodeUnstageVolume).
pub async fn unstage(
    c: &mut Clients,
    a: &cli::UnstageArgs,
    t: Duration,
) -> Result<Report, CliError> {
    let staging = a.staging.display().to_string();
    c.node
        .node_unstage_volume(req(
            csi::NodeUnstageVolumeRequest {
                volume_id: a.volume.clone(),
                staging_target_path: staging.clone(),
            },
            t,
        ))
        .await
        .map_err(CliError::rpc("NodeUnstageVolume"))?;
    Ok(Report::text(
        format!("volume {} is unstaged from {staging}", a.volume),
        json!({ "volume_id": a.volume, "staging_target_path": staging, "staged": false }),
    ))
}

/// `mount` (NodePublishVolume).
pub async fn mount(c: &mut Clients, a: &cli::MountArgs, t: Duration) -> Result<Report, CliError> {
    let target = a.target.display().to_string();
    c.node
        .node_publish_volume(req(
            csi::NodePublishVolumeRequest {
                volume_id: a.volume.clone(),
                staging_target_path: a.staging.display().to_string(),
                target_path: target.clone(),
                volume_capability: Some(capability(&a.cap)),
                readonly: a.readonly,
                ..Default::default()
            },
            t,
        ))
        .await
        .map_err(CliError::rpc("NodePublishVolume"))?;
    Ok(Report::text(
        format!(
            "volume {} is mounted at {target}{}",
            a.volume,
            if a.readonly { " (read-only)" } else { "" }
        ),
        json!({ "volume_id": a.volume, "target_path": target, "published": true }),
    ))
}

/// `unmount` (NodeUnpublishVolume).
pub async fn unmount(
    c: &mut Clients,
    a: &cli::UnmountArgs,
    t: Duration,
) -> Result<Report, CliError> {
    let target = a.target.display().to_string();
    c.node
        .node_unpublish_volume(req(
            csi::NodeUnpublishVolumeRequest {
                volume_id: a.volume.clone(),
                target_path: target.clone(),
            },
            t,
        ))
        .await
        .map_err(CliError::rpc("NodeUnpublishVolume"))?;
    Ok(Report::text(
        format!("volume {} is unmounted from {target}", a.volume),
        json!({ "volume_id": a.volume, "target_path": target, "published": false }),
    ))
}

/// `stats` (NodeGetVolumeStats).
pub async fn stats(c: &mut Clients, a: &cli::StatsArgs, t: Duration) -> Result<Report, CliError> {
    let r = c
        .node
        .node_get_volume_stats(req(
            csi::NodeGetVolumeStatsRequest {
                volume_id: a.volume.clone(),
                volume_path: a.path.display().to_string(),
                staging_target_path: a
                    .staging
                    .as_ref()
                    .map(|p| p.display().to_string())
                    .unwrap_or_default(),
            },
            t,
        ))
        .await
        .map_err(CliError::rpc("NodeGetVolumeStats"))?
        .into_inner();
    let mut table = Table::new(&["UNIT", "TOTAL", "USED", "AVAILABLE"]);
    let mut usage = Vec::new();
    for u in &r.usage {
        let unit = csi::volume_usage::Unit::try_from(u.unit).map_or_else(
            |_| format!("UNKNOWN({})", u.unit),
            |x| x.as_str_name().into(),
        );
        let fmt = |n: i64| {
            if u.unit == csi::volume_usage::Unit::Bytes as i32 {
                human_bytes(n)
            } else {
                n.to_string()
            }
        };
        table.row(vec![
            unit.clone(),
            fmt(u.total),
            fmt(u.used),
            fmt(u.available),
        ]);
        usage.push(json!({
            "unit": unit, "total": u.total, "used": u.used, "available": u.available,
        }));
    }
    let cond = r.volume_condition.as_ref();
    Ok(Report {
        human: Human::Table(table, format!("condition: {}", condition_text(cond))),
        json: json!({ "usage": usage, "condition": condition_json(cond) }),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capabilities_from_arguments() {
        let args = CapabilityArgs {
            block: false,
            fs_type: "xfs".into(),
            mount_flags: vec!["noatime".into()],
            access_mode: cli::AccessMode::SingleNodeReaderOnly,
        };
        let cap = capability(&args);
        assert_eq!(
            cap.access_mode.map(|m| m.mode),
            Some(access_mode::Mode::SingleNodeReaderOnly as i32)
        );
        assert!(matches!(
            cap.access_type,
            Some(AccessType::Mount(ref m)) if m.fs_type == "xfs" && m.mount_flags == ["noatime"]
        ));
        let block = capability(&CapabilityArgs {
            block: true,
            ..args
        });
        assert!(matches!(block.access_type, Some(AccessType::Block(_))));
    }

    #[test]
    fn conditions_and_sources_read_plainly() {
        assert_eq!(condition_text(None), "-");
        assert_eq!(
            condition_text(Some(&csi::VolumeCondition {
                abnormal: true,
                message: "device /dev/loop3 is gone".into()
            })),
            "abnormal: device /dev/loop3 is gone"
        );
        let src = csi::VolumeContentSource {
            r#type: Some(csi::volume_content_source::Type::Snapshot(
                csi::volume_content_source::SnapshotSource {
                    snapshot_id: "snap-1".into(),
                },
            )),
        };
        assert_eq!(source_text(Some(&src)), "snapshot snap-1");
        assert_eq!(count_text(1, "volume"), "1 volume");
        assert_eq!(count_text(0, "volume"), "0 volumes");
    }
}
