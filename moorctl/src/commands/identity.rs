//! `info` and `probe`: the Identity service, then whichever of the node and controller services
//! answers.

use std::time::Duration;

use moor_proto::csi::v1 as csi;
use serde_json::json;

use super::{Clients, list_text, req};
use crate::error::CliError;
use crate::output::{Report, Table, key_values};

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
