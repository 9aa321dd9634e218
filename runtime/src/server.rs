//! Serving gRPC on a Unix socket, with graceful shutdown.

use std::future::Future;
use std::os::unix::fs::{FileTypeExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};

use tokio::net::UnixListener;
use tokio_stream::StreamExt as _;
use tokio_stream::wrappers::UnixListenerStream;

use crate::authority::AuthorityFix;

/// Endpoint and socket errors.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The endpoint is not a unix:// address.
    #[error("endpoint {0:?} must be unix:///absolute/path")]
    Endpoint(String),
    /// Something that is not a socket is in the way.
    #[error("{0} exists and is not a socket; refusing to replace it")]
    NotASocket(PathBuf),
    /// A live socket is in the way: another process serves there.
    #[error("another process serves on {0}; refusing to replace its socket")]
    InUse(PathBuf),
    /// A socket step failed.
    #[error("{step} {path}: {source}")]
    Socket {
        /// The step.
        step: &'static str,
        /// The socket path.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The gRPC server failed.
    #[error("grpc server: {0}")]
    Transport(#[from] tonic::transport::Error),
}

/// Parses `unix:///path`, `unix:/path` or a bare absolute path.
pub fn parse_endpoint(endpoint: &str) -> Result<PathBuf, ServeError> {
    let path = endpoint
        .strip_prefix("unix://")
        .or_else(|| endpoint.strip_prefix("unix:"))
        .unwrap_or(endpoint);
    if !path.starts_with('/') || path.len() > 107 {
        return Err(ServeError::Endpoint(endpoint.to_string()));
    }
    Ok(PathBuf::from(path))
}

/// Whether something accepts connections on the socket at `path` (without waiting: a full
/// backlog counts as live).
fn answers(path: &Path) -> bool {
    use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};
    let Ok(addr) = SocketAddrUnix::new(path) else {
        return false;
    };
    let Ok(sock) = rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::STREAM,
        SocketFlags::NONBLOCK | SocketFlags::CLOEXEC,
        None,
    ) else {
        return false;
    };
    match rustix::net::connect(&sock, &addr) {
        Ok(()) => true,
        Err(e) => e == rustix::io::Errno::AGAIN || e == rustix::io::Errno::INPROGRESS,
    }
}

/// Binds a Unix socket at `path`: a stale socket (one nothing accepts on) is replaced, a live
/// one is not; the mode is 0660.
pub fn bind_unix(path: &Path) -> Result<UnixListener, ServeError> {
    let sock_err = |step, source| ServeError::Socket {
        step,
        path: path.to_path_buf(),
        source,
    };
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_socket() => {
            if answers(path) {
                return Err(ServeError::InUse(path.to_path_buf()));
            }
            std::fs::remove_file(path).map_err(|e| sock_err("remove stale socket", e))?;
        }
        Ok(_) => return Err(ServeError::NotASocket(path.to_path_buf())),
        Err(_) => {}
    }
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).map_err(|e| sock_err("create socket dir", e))?;
    }
    // No window in which the socket has a looser mode than 0660: bind under a umask that
    // already gives it that mode, then set it explicitly as well.
    let old = rustix::process::umask(rustix::fs::Mode::from_raw_mode(0o117));
    let bound = UnixListener::bind(path);
    rustix::process::umask(old);
    let listener = bound.map_err(|e| sock_err("bind", e))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o660))
        .map_err(|e| sock_err("chmod", e))?;
    Ok(listener)
}

/// Serves `router` on the socket until `shutdown` resolves, lets in-flight calls finish for
/// up to `grace` (a client that never closes its connection cannot hold the process), then
/// removes the socket.
pub async fn serve(
    router: tonic::transport::server::Router,
    listener: UnixListener,
    path: &Path,
    shutdown: impl Future<Output = ()>,
    grace: std::time::Duration,
) -> Result<(), ServeError> {
    let stopping = std::sync::Arc::new(tokio::sync::Notify::new());
    let notify = std::sync::Arc::clone(&stopping);
    let signal = async move {
        shutdown.await;
        notify.notify_one();
    };
    // Every connection through AuthorityFix: clients such as kubelet's plugin watcher send an
    // :authority the HTTP/2 server would refuse (see crate::authority).
    let incoming = UnixListenerStream::new(listener).map(|c| c.map(AuthorityFix::new));
    let serving = router.serve_with_incoming_shutdown(incoming, signal);
    let result = tokio::select! {
        r = serving => r.map_err(ServeError::from),
        drained = async {
            stopping.notified().await;
            // Clients such as kubelet keep their connections open for good: once no call is in
            // flight there is nothing left to wait for.
            // A call counts until the server has taken all of its answer (the response body
            // is dropped), which then still has to go from the connection's buffer to the
            // socket: stop only once no call has been in flight for a short linger.
            let deadline = tokio::time::Instant::now() + grace;
            let linger = std::time::Duration::from_millis(100);
            let mut idle_since = None;
            loop {
                let now = tokio::time::Instant::now();
                if crate::metrics::calls_in_flight() > 0 {
                    idle_since = None;
                } else if idle_since.is_some_and(|t| now >= t + linger) {
                    return true;
                } else if idle_since.is_none() {
                    idle_since = Some(now);
                }
                if now >= deadline {
                    return false;
                }
                tokio::time::sleep(std::time::Duration::from_millis(5)).await;
            }
        } => {
            if drained {
                tracing::info!("no call in flight: stopping");
            } else {
                tracing::warn!(?grace, "in-flight calls outlived the grace period");
            }
            Ok(())
        }
    };
    let _ = std::fs::remove_file(path);
    result
}

/// Resolves on SIGTERM or SIGINT.
pub async fn termination() {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        // Without signal handlers the process is stopped the hard way; never resolve early.
        std::future::pending::<()>().await;
        return;
    };
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM: finishing in-flight calls"),
        _ = int.recv() => tracing::info!("SIGINT: finishing in-flight calls"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints() {
        assert_eq!(
            parse_endpoint("unix:///csi/csi.sock").unwrap(),
            PathBuf::from("/csi/csi.sock")
        );
        assert_eq!(
            parse_endpoint("unix:/csi/csi.sock").unwrap(),
            PathBuf::from("/csi/csi.sock")
        );
        assert_eq!(
            parse_endpoint("/csi/csi.sock").unwrap(),
            PathBuf::from("/csi/csi.sock")
        );
        assert!(parse_endpoint("tcp://0.0.0.0:10000").is_err());
        assert!(parse_endpoint("unix://relative").is_err());
    }

    #[tokio::test]
    async fn a_stale_socket_is_replaced_and_a_live_one_is_not() {
        let dir = std::env::temp_dir().join(format!("moor-bind-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("s.sock");
        // Bound, then closed: nothing accepts there any more.
        drop(std::os::unix::net::UnixListener::bind(&path).unwrap());
        assert!(!answers(&path));
        let live = bind_unix(&path).expect("the stale socket is replaced");
        assert!(answers(&path));
        match bind_unix(&path) {
            Err(ServeError::InUse(p)) => assert_eq!(p, path),
            other => panic!("a live socket must not be replaced: {other:?}"),
        }
        // The first listener still has its socket.
        let client = tokio::net::UnixStream::connect(&path)
            .await
            .expect("still served");
        let (_accepted, _) = live.accept().await.expect("accepted by the first");
        drop(client);
        std::fs::write(dir.join("file"), b"").unwrap();
        assert!(matches!(
            bind_unix(&dir.join("file")),
            Err(ServeError::NotASocket(_))
        ));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
