//! Probes: the port is declared and served in the pod; on the host network every HTTP endpoint
//! binds loopback and the probe targets 127.0.0.1.

use std::collections::BTreeMap;

use serde_json::Value;

use super::pods::Pod;
use super::{Context, arg_value, array, moor_binary, strs};

/// Where an HTTP endpoint flag makes a container listen: (host, port). A moor binary binds
/// `--http-endpoint=:port` to loopback; the sidecars (Go) bind every interface.
fn listens(c: &Value, ctx: &Context) -> Vec<(String, u16)> {
    let args = strs(c.get("args"));
    let mut out = Vec::new();
    if let Some(ep) = arg_value(&args, "http-endpoint")
        && let Some((host, port)) = ep.rsplit_once(':')
        && let Ok(port) = port.parse()
    {
        let host = if host.is_empty() && moor_binary(c, ctx).is_some() {
            "127.0.0.1"
        } else {
            host.trim_matches(['[', ']'])
        };
        out.push((host.to_owned(), port));
    }
    if let Some(port) = arg_value(&args, "health-port").and_then(|p| p.parse().ok()) {
        out.push((String::new(), port));
    }
    out
}

fn is_loopback(host: &str) -> bool {
    matches!(host, "127.0.0.1" | "localhost" | "::1")
}

pub(super) fn probes(pod: &Pod<'_>, ctx: &Context, p: &mut Vec<String>) {
    let mut servers: BTreeMap<u16, (String, &str)> = BTreeMap::new();
    for c in pod.containers {
        let cname = c.get("name").and_then(Value::as_str).unwrap_or("?");
        for (host, port) in listens(c, ctx) {
            if pod.host_network() && !is_loopback(&host) {
                p.push(format!(
                    "container {cname} listens on every interface of the node (hostNetwork) at \
                     port {port}: bind 127.0.0.1"
                ));
            }
            if let Some((_, other)) = servers.insert(port, (host, cname)) {
                p.push(format!(
                    "containers {other} and {cname} both listen on port {port}"
                ));
            }
        }
    }
    for c in pod.containers {
        let cname = c.get("name").and_then(Value::as_str).unwrap_or("?");
        for kind in ["livenessProbe", "readinessProbe", "startupProbe"] {
            let Some(get) = c.get(kind).and_then(|pr| pr.get("httpGet")) else {
                continue;
            };
            let port = match get.get("port") {
                Some(Value::String(pname)) => array(c.get("ports"))
                    .iter()
                    .find(|pt| pt.get("name").and_then(Value::as_str) == Some(pname))
                    .and_then(|pt| pt.get("containerPort")?.as_u64()),
                Some(v) => v.as_u64(),
                None => None,
            };
            let Some(port) = port.and_then(|n| u16::try_from(n).ok()) else {
                p.push(format!(
                    "container {cname}: {kind} port is not declared in its ports"
                ));
                continue;
            };
            let probe_host = get.get("host").and_then(Value::as_str);
            match servers.get(&port) {
                None => p.push(format!(
                    "container {cname}: {kind} probes port {port}, which nothing in the pod serves"
                )),
                Some((host, _)) if is_loopback(host) => {
                    if !pod.host_network() {
                        p.push(format!(
                            "container {cname}: {kind}: port {port} is bound to loopback in the \
                             pod's own network namespace, which the kubelet cannot reach"
                        ));
                    } else if probe_host.is_none_or(|h| !is_loopback(h)) {
                        p.push(format!(
                            "container {cname}: {kind}: port {port} is bound to {host}: probe \
                             host must be 127.0.0.1"
                        ));
                    }
                }
                Some(_) => {
                    if probe_host.is_some() {
                        p.push(format!(
                            "container {cname}: {kind}: leave httpGet.host unset (the pod IP)"
                        ));
                    }
                }
            }
        }
    }
}
