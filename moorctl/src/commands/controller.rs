//! The Controller service's commands: volumes, snapshots, attaching to and detaching from a
//! node.

use std::time::Duration;

use moor_proto::csi::v1 as csi;
use serde_json::{Value, json};

use super::{Clients, capability, condition_json, condition_text, list_text, req};
use crate::cli::{self, SnapshotCommand, VolumeCommand};
use crate::error::CliError;
use crate::output::{Human, Report, Table, human_bytes, key_values};

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
                        secrets: c.secrets.to_map(),
                        name: a.name.clone(),
                        capacity_range: Some(range(a.size)),
                        volume_capabilities: vec![capability(&a.cap)],
                        parameters: a
                            .parameters()
                            .map_err(CliError::Usage)?
                            .into_iter()
                            .collect(),
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
                        secrets: c.secrets.to_map(),
                        volume_id: a.id.clone(),
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
                        secrets: c.secrets.to_map(),
                        volume_id: a.id.clone(),
                        capacity_range: Some(range(a.size)),
                        volume_capability: Some(capability(&a.cap)),
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
                        secrets: c.secrets.to_map(),
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
                        secrets: c.secrets.to_map(),
                        snapshot_id: a.id.clone(),
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
                            secrets: c.secrets.to_map(),
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
                secrets: c.secrets.to_map(),
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
                secrets: c.secrets.to_map(),
                volume_id: a.volume.clone(),
                node_id: a.node.clone(),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sources_and_counts_read_plainly() {
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
