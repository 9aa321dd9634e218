//! The `--http-endpoint` server: `/healthz` and `/metrics`, HTTP/1.1 on TCP.
//!
//! A deliberately small responder: one request per connection (`Connection: close`), GET or
//! HEAD only, a request head of at most 8 KiB read within a deadline. That is all a kubelet
//! probe and a Prometheus scrape need.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};
use tracing::{debug, info, warn};

/// The largest request head read.
const MAX_HEAD: usize = 8 * 1024;
/// How long a client may take to send its request head.
const READ_DEADLINE: Duration = Duration::from_secs(10);
/// How long a client may take to take the answer.
const WRITE_DEADLINE: Duration = Duration::from_secs(30);

/// What the HTTP endpoint reports: health and metrics of one binary.
pub trait Status: Send + Sync + 'static {
    /// Ok when the plugin's Probe would say ready; why not otherwise. May block.
    fn health(&self) -> Result<(), String>;
    /// The Prometheus text exposition. May block.
    fn metrics(&self) -> String;
}

/// HTTP endpoint errors.
#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    /// The address is not `host:port` or `:port`.
    #[error("http endpoint {0:?} must be host:port or :port (e.g. 127.0.0.1:9809)")]
    Endpoint(String),
    /// Binding failed.
    #[error("bind http endpoint {address}: {source}")]
    Bind {
        /// The address.
        address: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

/// Turns `--http-endpoint` into an address to bind: `:port` means loopback
/// (`127.0.0.1:port`), an explicit host (name, IPv4, or `[IPv6]`) is kept.
pub fn parse_http_endpoint(endpoint: &str) -> Result<String, HttpError> {
    let bad = || HttpError::Endpoint(endpoint.to_string());
    let (host, port) = endpoint.rsplit_once(':').ok_or_else(bad)?;
    let port: u16 = port.parse().map_err(|_| bad())?;
    if host.is_empty() {
        return Ok(format!("127.0.0.1:{port}"));
    }
    if let Some(v6) = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
        v6.parse::<std::net::Ipv6Addr>().map_err(|_| bad())?;
        return Ok(endpoint.to_string());
    }
    let host_ok = host
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'-');
    if !host_ok || host.contains("://") {
        return Err(bad());
    }
    Ok(format!("{host}:{port}"))
}

/// Binds the HTTP endpoint.
pub async fn bind(endpoint: &str) -> Result<TcpListener, HttpError> {
    let address = parse_http_endpoint(endpoint)?;
    TcpListener::bind(&address)
        .await
        .map_err(|source| HttpError::Bind { address, source })
}

/// Serves `/healthz` and `/metrics` on `listener` until `shutdown` resolves.
pub async fn serve(
    listener: TcpListener,
    status: Arc<dyn Status>,
    shutdown: impl Future<Output = ()>,
) {
    if let Ok(a) = listener.local_addr() {
        info!(address = %a, "http endpoint serving /healthz and /metrics");
    }
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    let status = Arc::clone(&status);
                    tokio::spawn(async move {
                        if let Err(e) = answer(stream, status).await {
                            debug!(%peer, error = %e, "http connection");
                        }
                    });
                }
                Err(e) => {
                    warn!(error = %e, "http accept");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            },
        }
    }
    info!("http endpoint stopped");
}

/// A response: status line, content type, body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reply {
    /// Status code.
    pub code: u16,
    /// Content-Type.
    pub content_type: &'static str,
    /// Body.
    pub body: String,
}

const TEXT: &str = "text/plain; charset=utf-8";
/// The Prometheus text exposition's content type.
pub const METRICS_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

fn reason(code: u16) -> &'static str {
    match code {
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        503 => "Service Unavailable",
        _ => "",
    }
}

fn reply(code: u16, content_type: &'static str, body: impl Into<String>) -> Reply {
    Reply {
        code,
        content_type,
        body: body.into(),
    }
}

/// The request line of a head: method and path (without a query), or None if malformed.
pub fn request_line(head: &[u8]) -> Option<(&str, &str)> {
    let line_end = head.windows(2).position(|w| w == b"\r\n")?;
    let line = std::str::from_utf8(head.get(..line_end)?).ok()?;
    let mut parts = line.split(' ');
    let (method, target, version) = (parts.next()?, parts.next()?, parts.next()?);
    if parts.next().is_some() || !version.starts_with("HTTP/1.") {
        return None;
    }
    let path = target.split('?').next().unwrap_or(target);
    Some((method, path))
}

/// Routes a request (the blocking parts, health and metrics, run on the blocking pool).
async fn route(method: &str, path: &str, status: Arc<dyn Status>) -> Reply {
    if path != "/healthz" && path != "/metrics" {
        return reply(404, TEXT, "not found\n");
    }
    if method != "GET" && method != "HEAD" {
        return reply(405, TEXT, "method not allowed\n");
    }
    let metrics = path == "/metrics";
    let done = tokio::task::spawn_blocking(move || {
        if metrics {
            reply(200, METRICS_CONTENT_TYPE, status.metrics())
        } else {
            match status.health() {
                Ok(()) => reply(200, TEXT, "ok\n"),
                Err(why) => reply(503, TEXT, format!("not ready: {why}\n")),
            }
        }
    })
    .await;
    done.unwrap_or_else(|_| reply(500, TEXT, "internal error\n"))
}

async fn read_head(stream: &mut TcpStream) -> Result<Vec<u8>, Reply> {
    let mut head = Vec::with_capacity(512);
    let mut buf = [0u8; 1024];
    loop {
        if head.windows(4).any(|w| w == b"\r\n\r\n") {
            return Ok(head);
        }
        if head.len() >= MAX_HEAD {
            return Err(reply(431, TEXT, "request head too large\n"));
        }
        match stream.read(&mut buf).await {
            Ok(0) | Err(_) => return Err(reply(400, TEXT, "incomplete request\n")),
            Ok(n) => head.extend_from_slice(buf.get(..n).unwrap_or_default()),
        }
    }
}

async fn answer(mut stream: TcpStream, status: Arc<dyn Status>) -> std::io::Result<()> {
    let head = match tokio::time::timeout(READ_DEADLINE, read_head(&mut stream)).await {
        Ok(r) => r,
        Err(_) => return Ok(()),
    };
    let (r, head_only) = match &head {
        Err(r) => (r.clone(), false),
        Ok(head) => match request_line(head) {
            None => (reply(400, TEXT, "bad request\n"), false),
            Some((method, path)) => (route(method, path, status).await, method == "HEAD"),
        },
    };
    let mut out = format!(
        "HTTP/1.1 {} {}\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        r.code,
        reason(r.code),
        r.content_type,
        r.body.len()
    )
    .into_bytes();
    if !head_only {
        out.extend_from_slice(r.body.as_bytes());
    }
    tokio::time::timeout(WRITE_DEADLINE, async {
        stream.write_all(&out).await?;
        stream.shutdown().await
    })
    .await
    .unwrap_or(Ok(()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints() {
        assert_eq!(parse_http_endpoint(":9808").unwrap(), "127.0.0.1:9808");
        assert_eq!(parse_http_endpoint("0.0.0.0:9808").unwrap(), "0.0.0.0:9808");
        assert_eq!(parse_http_endpoint("127.0.0.1:0").unwrap(), "127.0.0.1:0");
        assert_eq!(parse_http_endpoint("localhost:80").unwrap(), "localhost:80");
        assert_eq!(parse_http_endpoint("[::1]:9808").unwrap(), "[::1]:9808");
        for bad in [
            "9808",
            ":",
            ":99999",
            "host:port",
            "[zz]:1",
            "http://x:1",
            "a b:1",
            "",
        ] {
            assert!(parse_http_endpoint(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn request_lines() {
        assert_eq!(
            request_line(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"),
            Some(("GET", "/healthz"))
        );
        assert_eq!(
            request_line(b"GET /metrics?x=1 HTTP/1.0\r\n\r\n"),
            Some(("GET", "/metrics"))
        );
        assert_eq!(request_line(b"GET /healthz\r\n\r\n"), None);
        assert_eq!(request_line(b"GET / HTTP/2 x\r\n\r\n"), None);
        assert_eq!(request_line(b"\xff\xfe\r\n\r\n"), None);
        assert_eq!(request_line(b"no line end"), None);
    }

    struct Fixed(bool);

    impl Status for Fixed {
        fn health(&self) -> Result<(), String> {
            if self.0 {
                Ok(())
            } else {
                Err("state dir gone".into())
            }
        }
        fn metrics(&self) -> String {
            "# TYPE x counter\nx 1\n".into()
        }
    }

    #[tokio::test]
    async fn routes() {
        let ok: Arc<dyn Status> = Arc::new(Fixed(true));
        let sick: Arc<dyn Status> = Arc::new(Fixed(false));
        assert_eq!(route("GET", "/healthz", Arc::clone(&ok)).await.code, 200);
        let r = route("GET", "/healthz", sick).await;
        assert_eq!(r.code, 503);
        assert!(r.body.contains("state dir gone"));
        let m = route("GET", "/metrics", Arc::clone(&ok)).await;
        assert_eq!((m.code, m.content_type), (200, METRICS_CONTENT_TYPE));
        assert_eq!(m.body, "# TYPE x counter\nx 1\n");
        assert_eq!(route("POST", "/metrics", Arc::clone(&ok)).await.code, 405);
        assert_eq!(route("GET", "/", ok).await.code, 404);
    }

    /// Whether a descriptor of this process refers to the socket of inode `ino`.
    fn socket_open(ino: u64) -> bool {
        let want = format!("socket:[{ino}]");
        std::fs::read_dir("/proc/self/fd")
            .unwrap()
            .flatten()
            .any(|e| std::fs::read_link(e.path()).is_ok_and(|l| l.as_os_str() == want.as_str()))
    }

    #[tokio::test]
    async fn serves_over_tcp_and_stops() {
        let listener = bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let ino = rustix::fs::fstat(&listener).unwrap().st_ino;
        assert!(socket_open(ino));
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(serve(listener, Arc::new(Fixed(true)), async {
            let _ = rx.await;
        }));
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n")
            .await
            .unwrap();
        let mut got = String::new();
        s.read_to_string(&mut got).await.unwrap();
        assert!(got.starts_with("HTTP/1.1 200 OK\r\n"), "{got}");
        assert!(got.ends_with("\r\n\r\nok\n"), "{got}");
        let _ = tx.send(());
        server.await.unwrap();
        // The listener is closed. Not shown by binding its port again (any process on the
        // machine may take a free port meanwhile, for a connection of its own) nor by a
        // connect (to a free port it can succeed as a TCP self-connect): no descriptor of
        // this process refers to the listening socket any more.
        assert!(!socket_open(ino), "the listener is still open");
    }
}
