//! rbd-fuse's processes: found by their command line (never by a pid kept), waited for and
//! killed through pidfds (a signal never reaches a process that took a dead one's pid), and
//! their progress read from `/proc/<pid>/io`; and the threads that bound a step that may wait
//! on them.

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt as _;
use std::path::Path;
use std::sync::mpsc;
use std::time::Instant;

use rustix::process::{Pid, PidfdFlags, Signal};

use super::{KILL_GRACE, PROGRAM};

/// The rbd-fuse processes serving mount dir `dir`: their first argument is `dir`.
pub(super) fn daemons(dir: &Path) -> Vec<Pid> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut found = Vec::new();
    for e in entries.flatten() {
        let Some(pid) = e
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<i32>().ok())
            .and_then(Pid::from_raw)
        else {
            continue;
        };
        let Ok(cmdline) = std::fs::read(e.path().join("cmdline")) else {
            continue;
        };
        let mut args = cmdline.split(|&b| b == 0);
        let program = args.next().map(|a| Path::new(OsStr::from_bytes(a)));
        let first = args.next();
        if program.and_then(Path::file_name) == Some(OsStr::new(PROGRAM))
            && first == Some(dir.as_os_str().as_bytes())
        {
            found.push(pid);
        }
    }
    found
}

/// Waits until every process of `pids` has exited, up to `deadline`; whether they all did.
/// One that is a child of this process is reaped.
pub(super) fn wait_gone(pids: &[Pid], deadline: Instant) -> bool {
    let mut all = true;
    for &pid in pids {
        let fd = match rustix::process::pidfd_open(pid, PidfdFlags::empty()) {
            Ok(fd) => fd,
            Err(_) => continue, // ESRCH: gone already
        };
        let mut exited = false;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let Ok(timeout) = rustix::event::Timespec::try_from(left) else {
                break;
            };
            let mut fds = [rustix::event::PollFd::new(
                &fd,
                rustix::event::PollFlags::IN,
            )];
            match rustix::event::poll(&mut fds, Some(&timeout)) {
                Ok(n) if n > 0 => {
                    exited = true;
                    break;
                }
                Ok(_) => break,
                Err(rustix::io::Errno::INTR) => {}
                Err(_) => break,
            }
        }
        if exited {
            // Reaped here only when it is this process's child (moor-node as PID 1).
            let _ = rustix::process::waitid(
                rustix::process::WaitId::PidFd(std::os::fd::AsFd::as_fd(&fd)),
                rustix::process::WaitIdOptions::EXITED | rustix::process::WaitIdOptions::NOHANG,
            );
        }
        all &= exited;
    }
    all
}

pub(super) fn kill(pids: &[Pid]) {
    for &pid in pids {
        // Through a pidfd: the signal reaches this process, never one that took its pid.
        if let Ok(fd) = rustix::process::pidfd_open(pid, PidfdFlags::empty()) {
            let _ = rustix::process::pidfd_send_signal(&fd, Signal::KILL);
        }
    }
}

/// Runs `f` on a thread of its own; its result, or None at `deadline` (the thread goes on).
pub(super) fn with_deadline<T: Send + 'static>(
    deadline: Instant,
    f: impl FnOnce() -> T + Send + 'static,
) -> Option<T> {
    bounded(deadline, || {}, f)
}

/// Runs `f`, which may wait on rbd-fuse, on a thread of its own, up to `deadline`; past it
/// `abort` runs (it kills rbd-fuse, which fails every request waiting on it) and `f` gets
/// [`KILL_GRACE`] more to end. Its result, or None.
pub(super) fn bounded<T: Send + 'static>(
    deadline: Instant,
    abort: impl FnOnce(),
    f: impl FnOnce() -> T + Send + 'static,
) -> Option<T> {
    let (tx, rx) = mpsc::channel();
    std::thread::Builder::new()
        .name("moor-rbd-fuse".into())
        .spawn(move || {
            let _ = tx.send(f());
        })
        .ok()?;
    match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
        Ok(v) => Some(v),
        Err(mpsc::RecvTimeoutError::Timeout) => {
            abort();
            rx.recv_timeout(KILL_GRACE).ok()
        }
        Err(mpsc::RecvTimeoutError::Disconnected) => None,
    }
}

/// What the rbd-fuse processes `pids` have written so far (`wchar`: mostly their answers to
/// the kernel's FUSE requests).
pub(super) fn written(pids: &[Pid]) -> u64 {
    pids.iter()
        .filter_map(|p| std::fs::read_to_string(format!("/proc/{}/io", p.as_raw_nonzero())).ok())
        .filter_map(|io| {
            io.lines()
                .find_map(|l| l.strip_prefix("wchar:"))
                .and_then(|v| v.trim().parse::<u64>().ok())
        })
        .sum()
}
