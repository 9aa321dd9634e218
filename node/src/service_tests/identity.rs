//! NodeGetCapabilities, NodeGetInfo and Probe readiness.

use super::*;

#[tokio::test]
async fn capabilities_and_info() {
    use csi::node_service_capability::{Type, rpc};
    let h = harness();
    let caps = h
        .svc
        .node_get_capabilities(Request::new(csi::NodeGetCapabilitiesRequest {}))
        .await
        .expect("caps")
        .into_inner();
    let got: Vec<i32> = caps
        .capabilities
        .iter()
        .filter_map(|c| match &c.r#type {
            Some(Type::Rpc(r)) => Some(r.r#type),
            _ => None,
        })
        .collect();
    for want in [
        rpc::Type::StageUnstageVolume,
        rpc::Type::GetVolumeStats,
        rpc::Type::ExpandVolume,
        rpc::Type::VolumeCondition,
        rpc::Type::SingleNodeMultiWriter,
        rpc::Type::VolumeMountGroup,
    ] {
        assert!(got.contains(&(want as i32)), "{want:?}");
    }
    // CSI 1.13's health capabilities only when asked for (--health-capabilities): clients of
    // older specs refuse or crash on values they do not know.
    let health = [rpc::Type::GetVolumeHealth, rpc::Type::GetStorageHealth].map(|t| t as i32);
    assert!(got.iter().all(|t| !health.contains(t)), "{got:?}");
    let asked = NodeService::new(Arc::clone(&h.engine), h.info.clone())
        .with_health_capabilities()
        .node_get_capabilities(Request::new(csi::NodeGetCapabilitiesRequest {}))
        .await
        .expect("caps")
        .into_inner()
        .capabilities;
    for want in health {
        assert!(
            asked
                .iter()
                .any(|c| matches!(&c.r#type, Some(Type::Rpc(r)) if r.r#type == want)),
            "{want}"
        );
    }
    let info = h
        .svc
        .node_get_info(Request::new(csi::NodeGetInfoRequest {}))
        .await
        .expect("info")
        .into_inner();
    assert_eq!(info.node_id, "node-1");
    let topo = info.accessible_topology.expect("topology");
    assert_eq!(
        topo.segments
            .get("topology.moor.csi.io/node")
            .map(String::as_str),
        Some("node-1")
    );
}

#[test]
fn probe_is_not_ready_without_a_required_tool_or_a_usable_state_dir() {
    let h = harness();
    assert_eq!(crate::service::readiness(h.os.as_ref(), &h.state), None);
    h.os.remove_program("mkfs.ext4");
    let reason = crate::service::readiness(h.os.as_ref(), &h.state).expect("not ready");
    assert!(reason.contains("mkfs.ext4"), "{reason}");
    let os = FakeOs::new();
    let reason =
        crate::service::readiness(&os, Path::new("/nonexistent/moor-state")).expect("not ready");
    assert!(reason.contains("state dir"), "{reason}");
}

#[tokio::test]
async fn probe_answers_failed_precondition_when_a_required_tool_is_missing() {
    use csi::identity_server::Identity as _;
    let h = harness();
    let identity = crate::service::IdentityService::new(h.info.clone(), Arc::clone(&h.os));
    let r = identity
        .probe(Request::new(csi::ProbeRequest {}))
        .await
        .expect("healthy");
    assert_eq!(r.into_inner().ready, Some(true));
    h.os.remove_program("resize2fs");
    let e = identity
        .probe(Request::new(csi::ProbeRequest {}))
        .await
        .expect_err("a missing required dependency");
    assert_eq!(e.code(), Code::FailedPrecondition);
    assert!(e.message().contains("resize2fs"), "{}", e.message());
    // The same capabilities as the controller's, whichever services this instance serves.
    let caps = identity
        .get_plugin_capabilities(Request::new(csi::GetPluginCapabilitiesRequest {}))
        .await
        .expect("capabilities")
        .into_inner()
        .capabilities;
    assert_eq!(caps, moor_runtime::contract::plugin_capabilities());
    assert_eq!(caps.len(), 4);
}

#[tokio::test]
async fn plugin_info_names_the_node_and_its_state_dir() {
    use csi::identity_server::Identity as _;
    let h = harness();
    let identity = crate::service::IdentityService::new(h.info.clone(), Arc::clone(&h.os));
    let info = identity
        .get_plugin_info(Request::new(csi::GetPluginInfoRequest {}))
        .await
        .expect("info")
        .into_inner();
    assert_eq!(info.name, h.info.driver_name);
    assert_eq!(
        info.manifest,
        HashMap::from([
            ("component".to_string(), "node".to_string()),
            (
                "state_dir".to_string(),
                h.info.state_dir.display().to_string()
            ),
        ])
    );
}

#[test]
fn the_tools_probe_checks_are_programs_moor_node_runs() {
    let programs = crate::service::programs();
    let listed = crate::service::REQUIRED_TOOLS
        .iter()
        .chain(crate::service::OPTIONAL_TOOLS.iter());
    for tool in listed {
        assert!(programs.iter().any(|p| p == tool), "{tool}: {programs:?}");
    }
    assert!(programs.iter().any(|p| p == "rbd-fuse"), "{programs:?}");
}
