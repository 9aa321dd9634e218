//! The demo's daemons: moor-controller and moor-node as child processes, each in its own
//! process group and logging to a file in the demo dir.

use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use moor_runtime::child::Guarded;
use tonic::transport::Channel;

use super::NOTHING;

/// How long a daemon may take to answer its first call: a bound on a hang, generous for a
/// machine that is busy.
const READY_DEADLINE: Duration = Duration::from_secs(120);

/// One of the daemons, in its own process group (so a terminal's Ctrl-C reaches only moorctl,
/// which then stops it in order), logging to a file in the demo dir. It cannot outlive moorctl:
/// killed when dropped, and sent SIGTERM by the kernel if moorctl dies (even of SIGKILL).
#[derive(Debug)]
pub(super) struct Daemon {
    pub(super) name: &'static str,
    pub(super) child: Guarded,
    pub(super) log: PathBuf,
}

impl Daemon {
    pub(super) fn spawn(
        bin: &Path,
        name: &'static str,
        socket: &Path,
        args: &[&str],
        dir: &Path,
    ) -> Result<Self, String> {
        let log = dir.join(format!("{name}.log"));
        let out = std::fs::File::create(&log).map_err(|e| format!("{}: {e}", log.display()))?;
        let err = out
            .try_clone()
            .map_err(|e| format!("{}: {e}", log.display()))?;
        let mut cmd = Command::new(bin);
        cmd.arg("--endpoint")
            .arg(format!("unix://{}", socket.display()))
            .args(args)
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .process_group(0);
        let child = Guarded::spawn(&mut cmd, rustix::process::Signal::TERM)
            .map_err(|e| format!("cannot start {}: {e}", bin.display()))?;
        Ok(Self { name, child, log })
    }

    /// Waits until the daemon answers a call on its socket, or dies.
    pub(super) async fn wait_ready(&mut self, socket: &Path) -> Result<Channel, String> {
        let mut exit = None;
        let child = &mut self.child;
        let ready = moor_runtime::client::wait_answering(socket, READY_DEADLINE, || {
            let status = child.try_wait().ok().flatten()?;
            exit = Some(status);
            Some(format!("it exited ({status})"))
        })
        .await;
        match (ready, exit) {
            (Ok(c), _) => Ok(c),
            (Err(_), Some(status)) => Err(format!(
                "{} exited at start ({status}): {}",
                self.name,
                self.log_tail(5, false)
            )),
            (Err(e), None) => Err(format!("{}: {e}", self.name)),
        }
    }

    /// SIGTERM, then up to 60 s for it to exit, then SIGKILL.
    pub(super) async fn stop(&mut self) -> Result<(), String> {
        if let Ok(Some(st)) = self.child.try_wait() {
            return Err(format!("{} had already exited ({st})", self.name));
        }
        let _ = rustix::process::kill_process(self.child.pid(), rustix::process::Signal::TERM);
        let start = Instant::now();
        loop {
            match self.child.try_wait() {
                Ok(Some(st)) if st.success() => return Ok(()),
                Ok(Some(st)) => return Err(format!("{} exited with {st}", self.name)),
                Ok(None) if start.elapsed() > Duration::from_secs(60) => {
                    let _ = self.child.kill();
                    let _ = self.child.wait();
                    return Err(format!("{} did not stop within 60 s: killed", self.name));
                }
                Ok(None) => tokio::time::sleep(Duration::from_millis(20)).await,
                Err(e) => return Err(format!("waiting for {}: {e}", self.name)),
            }
        }
    }

    /// The last `n` lines of its log (only warnings and errors with `problems`), on one line.
    pub(super) fn log_tail(&self, n: usize, problems: bool) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text
            .lines()
            .filter(|l| !problems || l.contains("WARN") || l.contains("ERROR"))
            .collect();
        let tail = lines
            .get(lines.len().saturating_sub(n)..)
            .unwrap_or_default();
        if tail.is_empty() {
            NOTHING.into()
        } else {
            tail.join(" | ")
        }
    }
}
