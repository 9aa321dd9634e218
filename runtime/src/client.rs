//! Dialing a daemon's Unix socket, and waiting for a daemon that is starting to answer.
//!
//! A daemon is ready when it answers a call, not when its socket file exists: a machine that
//! is busy can take long between the two (and before a socket listens, it refuses). Whatever
//! waits for moor-node or moor-controller (moorctl's demo and `probe --wait`, the tests, the
//! benches) waits with [`wait_answering`].

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use hyper_util::rt::TokioIo;
use moor_proto::csi::v1 as csi;
use tonic::transport::{Channel, Endpoint};

/// How long one attempt's call may go unanswered before the next attempt: a socket can name a
/// listener nobody accepts on (one a killed daemon left to a child it was starting).
const ATTEMPT: Duration = Duration::from_secs(10);
/// Between attempts.
const RETRY: Duration = Duration::from_millis(20);

/// Connects a gRPC channel to the Unix socket at `path`: one attempt, no waiting.
pub async fn connect(path: &Path) -> Result<Channel, tonic::transport::Error> {
    connect_endpoint(Endpoint::from_static("http://moor.invalid"), path).await
}

/// [`connect`] with the channel's settings of `endpoint` (a per-call timeout, say); its
/// address is not dialed.
pub async fn connect_endpoint(
    endpoint: Endpoint,
    path: &Path,
) -> Result<Channel, tonic::transport::Error> {
    let path = path.to_path_buf();
    endpoint
        .connect_with_connector(tower::service_fn(move |_| {
            let path = path.clone();
            async move {
                tokio::net::UnixStream::connect(path)
                    .await
                    .map(TokioIo::new)
            }
        }))
        .await
}

/// Why a daemon never answered.
#[derive(Debug, thiserror::Error)]
pub enum NotAnswering {
    /// The deadline passed.
    #[error("nothing answered a call on {} within {deadline:?} (last attempt: {last})", path.display())]
    Deadline {
        /// The socket.
        path: PathBuf,
        /// The deadline.
        deadline: Duration,
        /// How the last attempt failed.
        last: String,
    },
    /// The daemon will never answer: it is gone.
    #[error("{why} before it answered a call on {} (last attempt: {last})", path.display())]
    Gone {
        /// The socket.
        path: PathBuf,
        /// What the caller saw (the process exited, with its status).
        why: String,
        /// How the last attempt failed.
        last: String,
    },
}

/// Waits until a call on `path` is answered, and returns the channel it was answered on: each
/// attempt connects and calls Identity's Probe; any answer counts, an error status too
/// (UNIMPLEMENTED from a socket that serves no Identity, FAILED_PRECONDITION from an unhealthy
/// plugin). A connection refused, a missing socket or a call cut off are "not yet", tried again
/// every 20 ms until `deadline`, a bound on a hang that says what it waited for. `gone` is
/// asked before each attempt: Some(why) (the daemon exited) ends the wait at once.
pub async fn wait_answering(
    path: &Path,
    deadline: Duration,
    mut gone: impl FnMut() -> Option<String>,
) -> Result<Channel, NotAnswering> {
    let start = Instant::now();
    let mut last = String::from("no attempt yet");
    loop {
        if let Some(why) = gone() {
            return Err(NotAnswering::Gone {
                path: path.to_path_buf(),
                why,
                last,
            });
        }
        let left = deadline.saturating_sub(start.elapsed());
        if left.is_zero() {
            return Err(NotAnswering::Deadline {
                path: path.to_path_buf(),
                deadline,
                last,
            });
        }
        match tokio::time::timeout(left.min(ATTEMPT), attempt(path)).await {
            Ok(Ok(channel)) => return Ok(channel),
            Ok(Err(e)) => last = e,
            Err(_) => last = format!("no answer within {:?}", left.min(ATTEMPT)),
        }
        tokio::time::sleep(RETRY.min(deadline.saturating_sub(start.elapsed()))).await;
    }
}

/// One attempt: connect, then Probe.
async fn attempt(path: &Path) -> Result<Channel, String> {
    let channel = connect(path).await.map_err(|e| chain(&e))?;
    let mut identity = csi::identity_client::IdentityClient::new(channel.clone());
    match identity.probe(csi::ProbeRequest {}).await {
        Ok(_) => Ok(channel),
        // An error the server sent (a status it put in its answer) has no source; a call the
        // transport failed (the connection closed under it) has one.
        Err(s) if std::error::Error::source(&s).is_none() => Ok(channel),
        Err(s) => Err(chain(&s)),
    }
}

/// An error and its sources, joined with ": ".
fn chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut cur = e.source();
    while let Some(s) = cur {
        let more = s.to_string();
        if !text.contains(&more) {
            text = format!("{text}: {more}");
        }
        cur = s.source();
    }
    text
}

/// For [`wait_answering`]'s `gone`: Some("it exited (status)") once `child` has exited.
pub fn exited(child: &mut std::process::Child) -> Option<String> {
    match child.try_wait() {
        Ok(Some(status)) => Some(format!("it exited ({status})")),
        Ok(None) => None,
        Err(e) => Some(format!("it cannot be waited for ({e})")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_socket_nobody_serves_is_not_answering_and_says_so() {
        let dir = std::env::temp_dir().join(format!("moor-wait-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("s.sock");
        let e = wait_answering(&path, Duration::from_millis(100), || None)
            .await
            .expect_err("nothing there");
        let text = e.to_string();
        assert!(
            text.starts_with("nothing answered a call on ")
                && text.contains("s.sock within 100ms (last attempt: ")
                && text.contains("No such file"),
            "{text}"
        );
        let mut asked = 0;
        let e = wait_answering(&path, Duration::from_secs(60), || {
            asked += 1;
            (asked > 1).then(|| "it exited (exit status: 1)".to_string())
        })
        .await
        .expect_err("gone");
        assert!(
            e.to_string()
                .starts_with("it exited (exit status: 1) before it answered"),
            "{e}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
