//! Every socket of both daemons answers whatever HTTP/2 `:authority` a Unix-socket client sends
//! (run as root): the socket path, as grpc-go sends it when its target is the bare path
//! (kubelet's plugin watcher dials the registration socket so); the path percent-encoded, as
//! gRPC core sends it; an empty one; `localhost`. Each is also named again by its HPACK index
//! on a second call over the same connection, as grpc-go does.

use std::path::Path;

use moor_privileged::Sandbox;
use moor_privileged::client::Daemon;
use moor_privileged::pathgrpc::PathClient;
use moor_proto::csi::v1 as csi;
use moor_proto::registration::v1 as reg;

const GET_PLUGIN_INFO: &str = "/csi.v1.Identity/GetPluginInfo";
const PROBE: &str = "/csi.v1.Identity/Probe";
const GET_INFO: &str = "/pluginregistration.Registration/GetInfo";

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("rt")
}

/// The authorities clients send over a Unix socket at `socket`.
fn authorities(socket: &Path) -> Vec<Vec<u8>> {
    let path = socket.display().to_string();
    vec![
        path.clone().into_bytes(),
        path.replace('/', "%2F").into_bytes(),
        Vec::new(),
        b"localhost".to_vec(),
    ]
}

/// Two CSI Identity calls on one connection per authority, each answered.
fn identity_answers_any_authority(socket: &Path, component: &str) {
    for authority in authorities(socket) {
        let shown = String::from_utf8_lossy(&authority).into_owned();
        let mut c = PathClient::dial_with_authority(socket, &authority).expect("dial");
        let info: csi::GetPluginInfoResponse = c
            .unary(GET_PLUGIN_INFO, &csi::GetPluginInfoRequest {})
            .unwrap_or_else(|e| panic!("GetPluginInfo with :authority {shown:?}: {e}"));
        assert_eq!(info.name, "moor.csi.io");
        assert_eq!(
            info.manifest.get("component").map(String::as_str),
            Some(component)
        );
        let _: csi::ProbeResponse = c
            .unary(PROBE, &csi::ProbeRequest {})
            .unwrap_or_else(|e| panic!("Probe with :authority {shown:?} (indexed): {e}"));
    }
}

#[test]
fn moor_node_sockets_answer_any_authority() {
    let sb = Sandbox::new("authority-node");
    let socket = sb.root.join("csi.sock");
    let registry = sb.k("plugins_registry");
    let reg_socket = registry.join("moor.csi.io-reg.sock");
    let registry_arg = registry.display().to_string();
    let rt = runtime();
    let mut daemon = rt.block_on(Daemon::start(
        &socket,
        &sb.node_args("node-a", &["--registration-dir", &registry_arg]),
    ));
    // The registration socket is bound after the CSI socket.
    rt.block_on(daemon.wait_answering_at(&reg_socket));

    identity_answers_any_authority(&socket, "node");
    for authority in authorities(&reg_socket) {
        let shown = String::from_utf8_lossy(&authority).into_owned();
        let mut c = PathClient::dial_with_authority(&reg_socket, &authority).expect("dial");
        for _ in 0..2 {
            let info: reg::PluginInfo = c
                .unary(GET_INFO, &reg::InfoRequest {})
                .unwrap_or_else(|e| panic!("GetInfo with :authority {shown:?}: {e}"));
            assert_eq!(
                (info.r#type.as_str(), info.name.as_str()),
                ("CSIPlugin", "moor.csi.io")
            );
        }
    }
    drop(rt);
    assert!(daemon.terminate().success());
}

#[test]
fn moor_controller_socket_answers_any_authority() {
    let sb = Sandbox::new("authority-controller");
    let socket = sb.root.join("controller.sock");
    let data = sb.data.join("controller").display().to_string();
    let rt = runtime();
    let mut daemon = rt.block_on(Daemon::start_program(
        "moor-controller",
        &socket,
        &["--node-id", "node-c", "--data-dir", &data],
    ));
    identity_answers_any_authority(&socket, "controller");
    drop(rt);
    assert!(daemon.terminate().success());
}
