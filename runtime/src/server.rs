//! Serving gRPC on a Unix socket, with graceful shutdown.

use std::future::Future;
use std::io;
use std::os::unix::fs::{FileTypeExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};
use std::time::Instant;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::UnixListener;
use tokio::sync::watch;
use tokio_stream::StreamExt as _;
use tokio_stream::wrappers::UnixListenerStream;

use crate::authority::AuthorityFix;
use crate::metrics::{IDLE_CONNECTION, SLOW_TAKE_UP};

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

/// What is at a socket path.
enum AtPath {
    Nothing,
    /// A socket nothing accepts on: left by a daemon that is gone.
    Stale,
    /// A socket something accepts on.
    Live,
    NotASocket,
}

fn at_path(path: &Path) -> AtPath {
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_socket() => {
            if answers(path) {
                AtPath::Live
            } else {
                AtPath::Stale
            }
        }
        Ok(_) => AtPath::NotASocket,
        Err(_) => AtPath::Nothing,
    }
}

/// Binds a Unix socket at `path`, listening before the path names it: the socket is bound and
/// listens under a temporary name in the same dir (a dot file, which kubelet's plugin watcher
/// ignores), then is renamed into place, so whoever sees the file can connect (between bind(2)
/// and listen(2) a socket file refuses connections). A stale socket (one nothing accepts on)
/// is replaced in that one rename, a live one never; the mode is 0660.
pub fn bind_unix(path: &Path) -> Result<UnixListener, ServeError> {
    let sock_err = |step, source| ServeError::Socket {
        step,
        path: path.to_path_buf(),
        source,
    };
    match at_path(path) {
        AtPath::Live => return Err(ServeError::InUse(path.to_path_buf())),
        AtPath::NotASocket => return Err(ServeError::NotASocket(path.to_path_buf())),
        AtPath::Nothing | AtPath::Stale => {}
    }
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("/"),
    };
    std::fs::create_dir_all(dir).map_err(|e| sock_err("create socket dir", e))?;
    static TEMP: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let temp = dir.join(format!(
        ".{:x}-{:x}",
        std::process::id(),
        TEMP.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    ));
    let temp_err = |step, source| ServeError::Socket {
        step,
        path: temp.clone(),
        source,
    };
    // One a process with this pid left when it was killed between its bind and its rename.
    if let AtPath::Stale = at_path(&temp) {
        std::fs::remove_file(&temp).map_err(|e| temp_err("remove stale temporary socket", e))?;
    }
    // No window in which the socket has a looser mode than 0660: bind under a umask that
    // already gives it that mode, then set it explicitly as well.
    let old = rustix::process::umask(rustix::fs::Mode::from_raw_mode(0o117));
    // bind(2) and listen(2).
    let bound = UnixListener::bind(&temp);
    rustix::process::umask(old);
    let listener = bound.map_err(|e| temp_err("bind", e))?;
    let placed = std::fs::set_permissions(&temp, std::fs::Permissions::from_mode(0o660))
        .map_err(|e| temp_err("chmod", e))
        .and_then(|()| rename_into_place(&temp, path));
    if placed.is_err() {
        let _ = std::fs::remove_file(&temp);
    }
    placed.map(|()| listener)
}

/// Renames the listening socket at `temp` to `path`: where nothing is, without replacing what
/// another process put there meanwhile; over a stale socket, in one step; never over a live
/// one or something else.
fn rename_into_place(temp: &Path, path: &Path) -> Result<(), ServeError> {
    let sock_err = |step, source: rustix::io::Errno| ServeError::Socket {
        step,
        path: path.to_path_buf(),
        source: source.into(),
    };
    let cwd = rustix::fs::CWD;
    // Twice at most: a socket that appears between the look and the rename is looked at again.
    for _ in 0..2 {
        match at_path(path) {
            AtPath::Live => return Err(ServeError::InUse(path.to_path_buf())),
            AtPath::NotASocket => return Err(ServeError::NotASocket(path.to_path_buf())),
            AtPath::Stale => {
                return rustix::fs::renameat(cwd, temp, cwd, path)
                    .map_err(|e| sock_err("rename over the stale socket", e));
            }
            AtPath::Nothing => {
                match rustix::fs::renameat_with(
                    cwd,
                    temp,
                    cwd,
                    path,
                    rustix::fs::RenameFlags::NOREPLACE,
                ) {
                    Ok(()) => return Ok(()),
                    Err(rustix::io::Errno::EXIST) => {}
                    // A filesystem without RENAME_NOREPLACE: nothing was there a moment ago.
                    Err(rustix::io::Errno::INVAL) => {
                        return rustix::fs::renameat(cwd, temp, cwd, path)
                            .map_err(|e| sock_err("rename into place", e));
                    }
                    Err(e) => return Err(sock_err("rename into place", e)),
                }
            }
        }
    }
    Err(ServeError::InUse(path.to_path_buf()))
}

/// What tells the socket at `path` from another put there later: its device and inode.
fn identity(path: &Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt as _;
    std::fs::symlink_metadata(path)
        .ok()
        .map(|m| (m.dev(), m.ino()))
}

/// What a handler can know of the connection its call came on: every request carries it in
/// its extensions (`request.extensions().get::<Connection>()`).
#[derive(Debug, Clone)]
pub struct Connection {
    open: watch::Receiver<()>,
    accepted: Instant,
    called: Arc<AtomicBool>,
}

impl Connection {
    /// Resolves once the connection is closed, by the client or by the server.
    pub async fn closed(&self) {
        let mut open = self.open.clone();
        // Nothing is sent: `changed` returns only once the connection's sender is dropped.
        while open.changed().await.is_ok() {}
    }

    /// When the connection was accepted.
    pub fn accepted(&self) -> Instant {
        self.accepted
    }

    /// A connection accepted at `accepted`, for tests.
    #[cfg(test)]
    pub(crate) fn accepted_at(accepted: Instant) -> Self {
        Tracked::accepted_at((), accepted).info.clone()
    }

    /// Called as a call of `method` reaches its handler: the connection's first call counts
    /// how long after the accept it came, and says so in the log when it came after
    /// [`IDLE_CONNECTION`] (its client connected, then waited before calling).
    pub fn first_call(&self, method: &str) {
        if self.called.swap(true, Ordering::Relaxed) {
            return;
        }
        let waited = self.accepted.elapsed();
        crate::metrics::registry().observe_connection_wait("first_call", waited);
        if waited > IDLE_CONNECTION {
            tracing::info!(
                ?waited,
                method,
                "the first call on a connection came long after its accept: the client \
                 connected, then waited before calling"
            );
        }
    }
}

/// An accepted connection that tells its [`Connection`] when it is closed (dropped), counts
/// how long after its accept the server took it up, and says when it closes without a call
/// after [`IDLE_CONNECTION`].
struct Tracked<S> {
    inner: S,
    _open: watch::Sender<()>,
    info: Connection,
    taken_up: bool,
}

impl<S> Tracked<S> {
    fn new(inner: S) -> Self {
        Self::accepted_at(inner, Instant::now())
    }

    fn accepted_at(inner: S, accepted: Instant) -> Self {
        let (open, rx) = watch::channel(());
        Self {
            inner,
            _open: open,
            info: Connection {
                open: rx,
                accepted,
                called: Arc::new(AtomicBool::new(false)),
            },
            taken_up: false,
        }
    }

    /// At the server's first read or write of the connection: how long it waited.
    fn take_up(&mut self) {
        if self.taken_up {
            return;
        }
        self.taken_up = true;
        let waited = self.info.accepted.elapsed();
        crate::metrics::registry().observe_connection_wait("served", waited);
        if waited > SLOW_TAKE_UP {
            tracing::warn!(
                ?waited,
                "a connection waited long after its accept before the server took it up: the \
                 daemon's runtime was busy or blocked"
            );
        }
    }
}

impl<S> Drop for Tracked<S> {
    fn drop(&mut self) {
        let open_for = self.info.accepted.elapsed();
        if !self.info.called.load(Ordering::Relaxed) && open_for > IDLE_CONNECTION {
            crate::metrics::registry().count_closed_without_call();
            tracing::info!(
                ?open_for,
                served = self.taken_up,
                "a connection closed without a call: its client connected and never called"
            );
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Tracked<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        this.take_up();
        Pin::new(&mut this.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Tracked<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        this.take_up();
        Pin::new(&mut this.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        this.take_up();
        Pin::new(&mut this.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

impl<S> tonic::transport::server::Connected for Tracked<S> {
    type ConnectInfo = Connection;

    fn connect_info(&self) -> Connection {
        self.info.clone()
    }
}

/// Serves `router` on the socket until `shutdown` resolves, then stops gracefully: no new
/// connection is accepted, each open one is told to go (an HTTP/2 GOAWAY), every call in
/// flight finishes and its answer is sent, and each connection closes once it has nothing
/// left to send. Returns when every connection is closed, or after `grace` (a client that
/// never lets its connection go cannot hold the process); then removes the socket, unless
/// another daemon has bound one there since.
pub async fn serve(
    router: tonic::transport::server::Router,
    listener: UnixListener,
    path: &Path,
    shutdown: impl Future<Output = ()>,
    grace: std::time::Duration,
) -> Result<(), ServeError> {
    // The socket this server removes when it stops: not one another daemon bound there since.
    let ours = identity(path);
    let stopping = std::sync::Arc::new(tokio::sync::Notify::new());
    let notify = std::sync::Arc::clone(&stopping);
    let signal = async move {
        shutdown.await;
        notify.notify_one();
    };
    // Every connection through AuthorityFix: clients such as kubelet's plugin watcher send an
    // :authority the HTTP/2 server would refuse (see crate::authority).
    let incoming =
        UnixListenerStream::new(listener).map(|c| c.map(|s| Tracked::new(AuthorityFix::new(s))));
    let serving = router.serve_with_incoming_shutdown(incoming, signal);
    // Not "no call in flight, then a moment for the answers to go out": an answer the server
    // has taken can still wait in the connection's buffer, and the moment is a guess a busy
    // machine can exceed. A connection closes only once it has sent everything.
    let result = tokio::select! {
        r = serving => {
            tracing::info!("every call answered and every connection closed: stopping");
            r.map_err(ServeError::from)
        }
        () = async {
            stopping.notified().await;
            tokio::time::sleep(grace).await;
        } => {
            tracing::warn!(
                ?grace,
                calls_in_flight = crate::metrics::calls_in_flight(),
                "calls still in flight or connections still open after the grace period: stopping anyway"
            );
            Ok(())
        }
    };
    if ours.is_some() && identity(path) == ours {
        let _ = std::fs::remove_file(path);
    }
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

    /// An Identity service whose GetPluginInfo hands the test the connection the call came on.
    struct Handing(tokio::sync::mpsc::UnboundedSender<Option<Connection>>);

    #[tonic::async_trait]
    impl moor_proto::csi::v1::identity_server::Identity for Handing {
        async fn get_plugin_info(
            &self,
            request: tonic::Request<moor_proto::csi::v1::GetPluginInfoRequest>,
        ) -> Result<tonic::Response<moor_proto::csi::v1::GetPluginInfoResponse>, tonic::Status>
        {
            let _ = self
                .0
                .send(request.extensions().get::<Connection>().cloned());
            Ok(tonic::Response::new(Default::default()))
        }

        async fn get_plugin_capabilities(
            &self,
            _: tonic::Request<moor_proto::csi::v1::GetPluginCapabilitiesRequest>,
        ) -> Result<
            tonic::Response<moor_proto::csi::v1::GetPluginCapabilitiesResponse>,
            tonic::Status,
        > {
            Err(tonic::Status::unimplemented("not in this test"))
        }

        async fn probe(
            &self,
            _: tonic::Request<moor_proto::csi::v1::ProbeRequest>,
        ) -> Result<tonic::Response<moor_proto::csi::v1::ProbeResponse>, tonic::Status> {
            Err(tonic::Status::unimplemented("not in this test"))
        }
    }

    #[tokio::test]
    async fn a_call_knows_when_its_connection_closes() {
        use moor_proto::csi::v1::identity_client::IdentityClient;
        use moor_proto::csi::v1::identity_server::IdentityServer;
        let dir = std::env::temp_dir().join(format!("moor-conn-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("s.sock");
        let listener = bind_unix(&path).unwrap();
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let router =
            tonic::transport::Server::builder().add_service(IdentityServer::new(Handing(tx)));
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let served = tokio::spawn({
            let path = path.clone();
            async move {
                serve(
                    router,
                    listener,
                    &path,
                    async {
                        let _ = stopped.await;
                    },
                    std::time::Duration::from_secs(60),
                )
                .await
            }
        });
        // Answered (UNIMPLEMENTED counts) once served.
        let channel =
            crate::client::wait_answering(&path, std::time::Duration::from_secs(60), || None)
                .await
                .expect("answers");
        let mut client = IdentityClient::new(channel);
        client
            .get_plugin_info(moor_proto::csi::v1::GetPluginInfoRequest {})
            .await
            .expect("answered");
        let connection = rx
            .recv()
            .await
            .expect("handed over")
            .expect("the call carries its connection");
        tokio::select! {
            biased;
            () = connection.closed() => panic!("closed while the client holds it"),
            () = std::future::ready(()) => {}
        }
        drop(client);
        tokio::time::timeout(std::time::Duration::from_secs(60), connection.closed())
            .await
            .expect("the server never saw the client close its connection");
        // With no connection left, the stop is immediate: no grace period to wait out.
        stop.send(()).unwrap();
        tokio::time::timeout(std::time::Duration::from_secs(30), served)
            .await
            .expect("the server did not stop with no connection open")
            .unwrap()
            .unwrap();
        assert!(!path.exists(), "the socket is removed");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Observations of `moor_grpc_connection_wait_seconds{until}` between 120 s and 600 s
    /// (no connection of another test waits that long), and the connections closed without a
    /// call.
    fn long_waits(until: &str) -> (u64, u64) {
        let text = crate::metrics::render_grpc();
        let value = |line: String| {
            text.lines()
                .find_map(|l| l.strip_prefix(line.as_str()))
                .and_then(|v| v.trim().parse::<u64>().ok())
                .unwrap_or(0)
        };
        let bucket = |le: &str| {
            value(format!(
                "moor_grpc_connection_wait_seconds_bucket{{until=\"{until}\",le=\"{le}\"}} "
            ))
        };
        (
            bucket("600") - bucket("120"),
            value("moor_grpc_connections_closed_without_call_total ".to_string()),
        )
    }

    #[tokio::test]
    async fn how_long_a_connection_waited_is_counted_and_one_never_called_is_logged() {
        use tokio::io::AsyncWriteExt as _;
        let ago = |secs| Instant::now() - std::time::Duration::from_secs(secs);
        // Taken up by the server (its first write) 200 s after its accept.
        let (served_before, closed_before) = long_waits("served");
        let (ours, _peer) = tokio::io::duplex(64);
        let mut conn = Tracked::accepted_at(ours, ago(200));
        conn.write_all(b"x").await.unwrap();
        conn.write_all(b"y").await.unwrap();
        assert_eq!(
            long_waits("served").0,
            served_before + 1,
            "counted once, at the first write"
        );
        // Its first call, 300 s after the accept: counted once.
        let (first_before, _) = long_waits("first_call");
        let info = conn.info.clone();
        assert_eq!(info.accepted(), conn.info.accepted);
        info.first_call("Probe");
        info.first_call("Probe");
        assert_eq!(long_waits("first_call").0, first_before + 1);
        // A called connection closes quietly, one never called after IDLE_CONNECTION is counted.
        drop(conn);
        assert_eq!(long_waits("served").1, closed_before);
        drop(Tracked::accepted_at((), ago(60)));
        assert!(long_waits("served").1 > closed_before);
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
        assert_eq!(
            entries(&dir),
            ["file", "s.sock"],
            "no temporary socket is left"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    fn entries(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    #[tokio::test]
    async fn the_socket_path_names_a_listening_socket_from_its_first_instant() {
        use rustix::fs::inotify;
        let dir = std::env::temp_dir().join(format!("moor-listen-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("s.sock");
        let watch =
            inotify::init(inotify::CreateFlags::NONBLOCK | inotify::CreateFlags::CLOEXEC).unwrap();
        inotify::add_watch(
            &watch,
            &dir,
            inotify::WatchFlags::CREATE | inotify::WatchFlags::MOVED_TO,
        )
        .unwrap();
        // Where nothing was, then over the stale socket the first one leaves.
        drop(bind_unix(&path).expect("bound"));
        let live = bind_unix(&path).expect("the stale socket is replaced");
        assert!(answers(&path));
        let mut buf = [std::mem::MaybeUninit::uninit(); 4096];
        let mut events = inotify::Reader::new(&watch, &mut buf);
        let mut arrivals = Vec::new();
        loop {
            match events.next() {
                Ok(e) if e.file_name().is_some_and(|n| n.to_bytes() == b"s.sock") => {
                    arrivals.push(e.events());
                }
                Ok(_) => {}
                Err(rustix::io::Errno::AGAIN) => break,
                Err(e) => panic!("inotify: {e}"),
            }
        }
        // Created by bind(2), the name would refuse connections until listen(2): it must
        // arrive only by a rename of a socket that already listens.
        assert_eq!(
            arrivals,
            [inotify::ReadFlags::MOVED_TO, inotify::ReadFlags::MOVED_TO],
            "the path appears by a rename only, never by bind(2)"
        );
        assert_eq!(entries(&dir), ["s.sock"], "no temporary socket is left");
        drop(live);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
