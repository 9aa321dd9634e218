//! One daemon per state dir: an exclusive `flock` on `<dir>/instance.lock`, taken before the
//! daemon touches anything else there or binds a socket, and held for the process's life.
//!
//! A second daemon started on the same dir (a rolling update that starts the new pod before the
//! old one is gone, or an operator's mistake) waits for the lock up to a deadline, so a
//! hand-over works: the old one exits, the new one goes on. Past the deadline it stops with an
//! error naming the dir and the holder's pid, which the holder writes into the lock file.
//! The lock is the open file's: the kernel drops it when the holder dies, however it dies, and
//! the descriptor is close-on-exec, so no child moor runs keeps it once it has started.

use std::fs::{File, OpenOptions};
use std::io::{Read as _, Seek as _, Write as _};
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use rustix::fs::{FlockOperation, flock};
use tracing::info;

/// The lock file's name in the state dir.
pub const LOCK_FILE: &str = "instance.lock";

/// How often a held lock is tried again.
const RETRY: Duration = Duration::from_millis(100);

/// Lock errors.
#[derive(Debug, thiserror::Error)]
pub enum InstanceError {
    /// The lock file cannot be opened or locked.
    #[error("{step} {path}: {source}")]
    Lock {
        /// The step.
        step: &'static str,
        /// The lock file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// Another instance held the dir for the whole wait.
    #[error(
        "another {program} ({holder}) holds {dir}: one instance per dir; waited {waited_s} s \
         for it to exit (--instance-wait)",
        holder = holder.map_or_else(|| "pid unknown".to_string(), |p| format!("pid {p}")),
        dir = dir.display()
    )]
    Held {
        /// The daemon's name.
        program: &'static str,
        /// The dir.
        dir: PathBuf,
        /// The holder's pid, when it wrote it.
        holder: Option<u32>,
        /// How long this one waited.
        waited_s: u64,
    },
}

/// The held lock; dropping it (or exiting) releases it.
#[derive(Debug)]
pub struct InstanceLock {
    _file: File,
    path: PathBuf,
}

impl InstanceLock {
    /// The lock file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// The pid the holder wrote in the lock file, if any.
fn holder_pid(file: &mut File) -> Option<u32> {
    let mut text = String::new();
    file.rewind().ok()?;
    file.read_to_string(&mut text).ok()?;
    text.trim().parse().ok()
}

/// Takes the lock of `dir` (which must exist) for `program`, waiting up to `wait` while
/// another process holds it.
pub async fn acquire(
    dir: &Path,
    program: &'static str,
    wait: Duration,
) -> Result<InstanceLock, InstanceError> {
    let path = dir.join(LOCK_FILE);
    let err = |step, source| InstanceError::Lock {
        step,
        path: path.clone(),
        source,
    };
    // std opens with O_CLOEXEC: the lock's descriptor does not outlive an exec.
    let mut file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o644)
        .open(&path)
        .map_err(|e| err("open", e))?;
    let start = Instant::now();
    let mut told = false;
    loop {
        match flock(&file, FlockOperation::NonBlockingLockExclusive) {
            Ok(()) => break,
            Err(rustix::io::Errno::WOULDBLOCK | rustix::io::Errno::INTR) => {}
            Err(e) => return Err(err("lock", e.into())),
        }
        let holder = holder_pid(&mut file);
        let waited = start.elapsed();
        if waited >= wait {
            return Err(InstanceError::Held {
                program,
                dir: dir.to_path_buf(),
                holder,
                waited_s: waited.as_secs(),
            });
        }
        if !told {
            told = true;
            info!(
                dir = %dir.display(),
                holder = ?holder,
                wait_s = wait.as_secs(),
                "another {program} holds this dir; waiting for it to exit"
            );
        }
        tokio::time::sleep(RETRY.min(wait - waited)).await;
    }
    // Ours now: say who holds it.
    file.set_len(0).map_err(|e| err("truncate", e))?;
    file.rewind().map_err(|e| err("rewind", e))?;
    writeln!(file, "{}", std::process::id()).map_err(|e| err("write pid to", e))?;
    Ok(InstanceLock { _file: file, path })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("moor-instance-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[tokio::test]
    async fn one_holder_at_a_time_and_the_next_takes_over() {
        let dir = temp_dir("one");
        let first = acquire(&dir, "moor-node", Duration::ZERO).await.unwrap();
        assert_eq!(
            std::fs::read_to_string(first.path()).unwrap(),
            format!("{}\n", std::process::id())
        );
        // A child does not inherit the lock's descriptor.
        let fds = std::process::Command::new("sh")
            .args(["-c", "for f in /proc/self/fd/*; do readlink \"$f\"; done"])
            .output()
            .unwrap();
        let fds = String::from_utf8_lossy(&fds.stdout);
        assert!(fds.contains("/dev/") || fds.contains("pipe:"), "{fds}");
        assert!(!fds.contains(LOCK_FILE), "{fds}");
        // Each open of the file is its own lock: a second holder in this process is refused
        // as another process would be, and named.
        let e = acquire(&dir, "moor-node", Duration::ZERO)
            .await
            .expect_err("held");
        let text = e.to_string();
        assert!(
            text.starts_with(&format!(
                "another moor-node (pid {}) holds {}",
                std::process::id(),
                dir.display()
            )),
            "{text}"
        );
        assert!(text.contains("--instance-wait"), "{text}");
        // A waiter gets the lock once the holder lets go.
        let waiter = tokio::spawn({
            let dir = dir.clone();
            async move { acquire(&dir, "moor-node", Duration::from_secs(60)).await }
        });
        tokio::task::yield_now().await;
        drop(first);
        let second = waiter.await.unwrap().expect("taken over");
        drop(second);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[tokio::test]
    async fn a_dir_that_cannot_hold_the_lock_is_an_error() {
        let e = acquire(Path::new("/nonexistent/moor"), "moor-node", Duration::ZERO)
            .await
            .expect_err("no dir");
        assert!(
            e.to_string()
                .starts_with("open /nonexistent/moor/instance.lock:"),
            "{e}"
        );
    }
}
