//! gRPC clients over a Unix socket, and a handle on a real `moor-node` process.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use moor_proto::csi::v1 as csi;
use moor_runtime::child::Guarded;
pub use moor_runtime::client::connect;
use tonic::transport::Channel;

use crate::requests::{unpublish_req, unstage_req};

/// How long a daemon a test starts may take to answer its first call, a log line to come, or
/// a daemon to exit once told to: a bound on a hang, generous for a machine that is busy (a
/// deadline here does not measure speed).
pub const DEADLINE: Duration = Duration::from_secs(120);

/// Starts `cmd` as a test's daemon: killed when dropped (also when the test panics), and by
/// the kernel when the test's thread or process ends.
pub fn spawn_guarded(cmd: &mut Command) -> Guarded {
    Guarded::spawn(cmd, rustix::process::Signal::KILL)
        .unwrap_or_else(|e| panic!("spawn {cmd:?}: {e}"))
}

/// kubelet's teardown of a mount volume: NodeUnpublishVolume of `target`, then
/// NodeUnstageVolume of `staging`; panics on an error.
pub async fn unpublish_and_unstage(
    node: &mut csi::node_client::NodeClient<Channel>,
    vol: &str,
    staging: &Path,
    target: &Path,
) {
    node.node_unpublish_volume(unpublish_req(vol, target))
        .await
        .expect("unpublish");
    node.node_unstage_volume(unstage_req(vol, staging))
        .await
        .expect("unstage");
}

/// A running `moor-node` or `moor-controller`: killed when dropped, or by the kernel when the
/// test's thread ends.
#[derive(Debug)]
pub struct Daemon {
    /// The process.
    pub child: Guarded,
    /// Its socket.
    pub socket: PathBuf,
}

/// The path of a binary built by cargo for this workspace: next to the running executable
/// (a binary in `target/<profile>/`) or one level up (a test in `target/<profile>/deps/`).
pub fn binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("current exe");
    let dir = exe.parent().expect("exe dir");
    let here = dir.join(name);
    if here.exists() {
        here
    } else {
        dir.parent().unwrap_or(dir).join(name)
    }
}

/// What tells one socket at `path` from another bound there later: its inode and change time.
fn socket_identity(path: &Path) -> Option<(u64, i64, i64)> {
    use std::os::unix::fs::MetadataExt as _;
    std::fs::symlink_metadata(path)
        .ok()
        .map(|m| (m.ino(), m.ctime(), m.ctime_nsec()))
}

impl Daemon {
    /// Starts `moor-node` with these args and waits until its socket answers.
    pub async fn start(socket: &Path, args: &[impl AsRef<OsStr>]) -> Self {
        Self::start_program("moor-node", socket, args).await
    }

    /// Starts `program` (moor-node or moor-controller) and waits until its socket answers.
    pub async fn start_program(program: &str, socket: &Path, args: &[impl AsRef<OsStr>]) -> Self {
        Self::start_program_env(program, socket, args, &[]).await
    }

    /// Starts `program` with extra environment variables and waits until its socket answers.
    pub async fn start_program_env(
        program: &str,
        socket: &Path,
        args: &[impl AsRef<OsStr>],
        env: &[(&str, &str)],
    ) -> Self {
        let bin = binary(program);
        assert!(
            bin.exists(),
            "{} is not built (cargo build --bins)",
            bin.display()
        );
        // A socket a killed daemon left can still answer for a moment: a child it was starting
        // when it died holds a copy of its descriptors until that child's exec closes them.
        // Only a socket bound after this point is the new daemon's.
        let stale = socket_identity(socket);
        let child = spawn_guarded(
            Command::new(bin)
                .arg("--endpoint")
                .arg(format!("unix://{}", socket.display()))
                .args(args)
                .envs(env.iter().copied())
                .stdin(Stdio::null()),
        );
        let mut d = Self {
            child,
            socket: socket.to_path_buf(),
        };
        if stale.is_some() {
            let start = Instant::now();
            while socket_identity(socket) == stale {
                if let Some(why) = moor_runtime::client::exited(&mut d.child) {
                    panic!("{program}: {why} before it replaced {}", socket.display());
                }
                assert!(
                    start.elapsed() < DEADLINE,
                    "{program} did not bind {} within {DEADLINE:?}",
                    socket.display()
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        d.wait_answering().await;
        d
    }

    /// Starts `program` with `--endpoint` at `socket` and `args`, its stderr in `log`, and
    /// returns at once: it may not serve yet (see [`Daemon::wait_answering`]).
    pub fn spawn_logged(
        program: &str,
        socket: &Path,
        args: &[impl AsRef<OsStr>],
        log: &Path,
    ) -> Self {
        let bin = binary(program);
        assert!(
            bin.exists(),
            "{} is not built (cargo build --bins)",
            bin.display()
        );
        let child = spawn_guarded(
            Command::new(bin)
                .arg("--endpoint")
                .arg(format!("unix://{}", socket.display()))
                .args(args)
                .stdin(Stdio::null())
                .stderr(std::fs::File::create(log).expect("log file")),
        );
        Self {
            child,
            socket: socket.to_path_buf(),
        }
    }

    /// Waits until a call on the socket is answered; panics if the process exits first (or
    /// after [`DEADLINE`]).
    pub async fn wait_answering(&mut self) {
        let socket = self.socket.clone();
        self.wait_answering_at(&socket).await;
    }

    /// Waits until a call on another socket it serves (moor-node's registration socket) is
    /// answered; panics if the process exits first (or after [`DEADLINE`]).
    pub async fn wait_answering_at(&mut self, socket: &Path) {
        let child = &mut self.child;
        if let Err(e) = moor_runtime::client::wait_answering(socket, DEADLINE, || {
            moor_runtime::client::exited(child)
        })
        .await
        {
            panic!("{e}");
        }
    }

    /// The exit status once the process has exited; panics once it has run on for
    /// [`DEADLINE`] since `since` (after `why`).
    fn exited_within(&mut self, since: Instant, why: &str) -> Option<std::process::ExitStatus> {
        let status = self.child.try_wait().expect("wait");
        assert!(
            status.is_some() || since.elapsed() < DEADLINE,
            "the daemon of {} still runs {DEADLINE:?} after {why}",
            self.socket.display()
        );
        status
    }

    /// Waits for the process to exit by itself (after `why`), up to [`DEADLINE`].
    pub fn wait_exit(&mut self, why: &str) -> std::process::ExitStatus {
        let start = Instant::now();
        loop {
            if let Some(status) = self.exited_within(start, why) {
                return status;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Sends SIGTERM and waits for the exit status, up to [`DEADLINE`]. The daemon stops once
    /// every connection to it has closed (or after its grace period): a test that still holds
    /// a client's connection on a runtime it does not run drops that runtime first, or calls
    /// [`Daemon::stop`] on it.
    pub fn terminate(&mut self) -> std::process::ExitStatus {
        let _ = rustix::process::kill_process(self.child.pid(), rustix::process::Signal::TERM);
        self.wait_exit("SIGTERM")
    }

    /// [`Daemon::terminate`] from within the test's runtime, which runs on meanwhile: the
    /// test's open connections answer the daemon's graceful stop (HTTP/2's GOAWAY and PING),
    /// so they close at once.
    pub async fn stop(&mut self) -> std::process::ExitStatus {
        let _ = rustix::process::kill_process(self.child.pid(), rustix::process::Signal::TERM);
        let start = Instant::now();
        loop {
            if let Some(status) = self.exited_within(start, "SIGTERM") {
                return status;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// Waits until `log` has a line containing `needle`; panics if `daemon` exits first (or after
/// [`DEADLINE`]).
pub fn wait_for_log(log: &Path, needle: &str, daemon: &mut Daemon) -> String {
    let start = Instant::now();
    loop {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        if text.contains(needle) {
            return text;
        }
        if let Ok(Some(status)) = daemon.child.try_wait() {
            panic!("exited ({status}) before logging {needle:?}: {text}");
        }
        assert!(
            start.elapsed() < DEADLINE,
            "no {needle:?} within {DEADLINE:?} in: {text}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The address the HTTP endpoint of `daemon` (started with `--http-endpoint 127.0.0.1:0`, its
/// log in `log`) was given by the kernel, read from the line it logs once it serves: a port
/// picked by the test and bound later could be taken by anyone in between.
pub fn http_address(log: &Path, daemon: &mut Daemon) -> String {
    let text = wait_for_log(log, "http endpoint serving", daemon);
    logged_http_address(&text)
        .unwrap_or_else(|| panic!("no address in the http endpoint's log line: {text}"))
}

/// The address in the last "http endpoint serving" line of a daemon's log `text`, if any.
pub fn logged_http_address(text: &str) -> Option<String> {
    text.lines()
        .rev()
        .find(|l| l.contains("http endpoint serving"))
        .and_then(|l| l.split("address").nth(1))
        .map(|rest| {
            rest.trim_start_matches(['=', '"', ':'])
                .split(|c: char| c == '"' || c.is_whitespace())
                .next()
                .unwrap_or_default()
                .to_string()
        })
        .filter(|a| a.parse::<std::net::SocketAddr>().is_ok())
}

/// An HTTP response as the tests see it.
#[derive(Debug, Clone)]
pub struct HttpResponse {
    /// Status code.
    pub status: u16,
    /// Headers, names lower-cased.
    pub headers: Vec<(String, String)>,
    /// Body.
    pub body: String,
}

impl HttpResponse {
    /// The first header of that (lower-case) name.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

/// `GET path` over HTTP/1.1 on a fresh TCP connection to `addr`, read to the end.
pub fn http_get(addr: &str, path: &str) -> std::io::Result<HttpResponse> {
    use std::io::{Read as _, Write as _};
    let mut s = std::net::TcpStream::connect(addr)?;
    s.set_read_timeout(Some(Duration::from_secs(30)))?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw)?;
    let text = String::from_utf8_lossy(&raw).into_owned();
    let bad = || std::io::Error::other(format!("malformed response: {text:?}"));
    let (head, body) = text.split_once("\r\n\r\n").ok_or_else(bad)?;
    let mut lines = head.split("\r\n");
    let status = lines
        .next()
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|c| c.parse().ok())
        .ok_or_else(bad)?;
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    Ok(HttpResponse {
        status,
        headers,
        body: body.to_string(),
    })
}
