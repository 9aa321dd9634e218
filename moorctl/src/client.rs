//! The gRPC connection to a CSI socket.

use std::path::{Path, PathBuf};
use std::time::Duration;

use tonic::transport::{Channel, Endpoint};

use crate::error::CliError;

/// Turns `unix:///path`, `unix:/path` or `/path` into the socket's path.
pub fn socket_path(endpoint: &str) -> Result<PathBuf, CliError> {
    let path = endpoint
        .strip_prefix("unix://")
        .or_else(|| endpoint.strip_prefix("unix:"))
        .unwrap_or(endpoint);
    if !path.starts_with('/') {
        return Err(CliError::Endpoint(endpoint.to_string()));
    }
    Ok(PathBuf::from(path))
}

/// Connects to the socket of `endpoint`, waiting at most `timeout`.
pub async fn connect(endpoint: &str, timeout: Duration) -> Result<Channel, CliError> {
    let socket = socket_path(endpoint)?;
    connect_path(&socket, timeout)
        .await
        .map_err(|reason| CliError::Connect {
            endpoint: endpoint.to_string(),
            reason,
        })
}

/// Waits until the socket of `endpoint` answers a call, up to `deadline`: a daemon that is
/// starting (the socket may not exist yet). With `pid`, only while that process runs.
pub async fn wait(
    endpoint: &str,
    deadline: Duration,
    pid: Option<u32>,
) -> Result<Channel, CliError> {
    let socket = socket_path(endpoint)?;
    moor_runtime::client::wait_answering(&socket, deadline, || pid.and_then(exited))
        .await
        .map_err(|e| CliError::Connect {
            endpoint: endpoint.to_string(),
            reason: e.to_string(),
        })
}

/// Why process `pid` will not answer: it is gone, or has exited and awaits its parent's wait.
fn exited(pid: u32) -> Option<String> {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // "pid (comm) state ...": the command may hold anything but the last ')'.
        Ok(stat) => stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with(['Z', 'X']))
            .then(|| format!("process {pid} exited")),
        Err(_) => Some(format!("process {pid} is gone")),
    }
}

/// Connects to a socket path; the error is a sentence.
pub async fn connect_path(socket: &Path, timeout: Duration) -> Result<Channel, String> {
    let endpoint = Endpoint::from_static("http://moor.invalid").timeout(timeout);
    let connecting = moor_runtime::client::connect_endpoint(endpoint, socket);
    match tokio::time::timeout(timeout, connecting).await {
        Ok(Ok(channel)) => Ok(channel),
        Ok(Err(e)) => Err(error_chain(&e)),
        Err(_) => Err(format!("no answer within {} s", timeout.as_secs())),
    }
}

/// An error and its sources, joined with ": ", each once.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut cur: Option<&dyn std::error::Error> = Some(e);
    while let Some(err) = cur {
        let text = err.to_string();
        if !parts.iter().any(|p| p.contains(&text)) {
            parts.push(text);
        }
        cur = err.source();
    }
    parts.join(": ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints() {
        assert_eq!(
            socket_path("unix:///csi/csi.sock").ok(),
            Some(PathBuf::from("/csi/csi.sock"))
        );
        assert_eq!(
            socket_path("unix:/csi/csi.sock").ok(),
            Some(PathBuf::from("/csi/csi.sock"))
        );
        assert_eq!(
            socket_path("/run/moor.sock").ok(),
            Some(PathBuf::from("/run/moor.sock"))
        );
        assert!(matches!(
            socket_path("tcp://10.0.0.1:9000"),
            Err(CliError::Endpoint(_))
        ));
        assert!(socket_path("unix://relative").is_err());
    }

    #[tokio::test]
    async fn a_missing_socket_is_a_connect_error() {
        let e = connect("unix:///nonexistent/moorctl.sock", Duration::from_secs(5))
            .await
            .expect_err("nothing listens there");
        assert_eq!(e.exit_code(), 3);
        let text = e.to_string();
        assert!(
            text.starts_with("cannot connect to unix:///nonexistent/moorctl.sock: "),
            "{text}"
        );
        assert!(text.contains("No such file or directory"), "{text}");
    }
}
