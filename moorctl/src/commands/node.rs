//! The Node service's commands: stage, unstage, mount, unmount, stats.

use std::collections::HashMap;
use std::time::Duration;

use moor_proto::csi::v1 as csi;
use moor_runtime::contract::DEVICE_PATH_KEY;
use serde_json::json;

use super::{Clients, capability, condition_json, condition_text, req};
use crate::cli;
use crate::error::CliError;
use crate::output::{Human, Report, Table, human_bytes};

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
                secrets: c.secrets.to_map(),
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
                secrets: c.secrets.to_map(),
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
