//! A child process that does not outlive its owner: how moorctl's demo and the tests start the
//! daemons, so that none is left serving when they end, however they end.

use std::process::{Child, Command};

use rustix::process::Signal;

/// A running child, killed (SIGKILL) and reaped when dropped if it still runs: when its owner
/// is done with it, returns early, or panics (the drop runs as the panic unwinds). If its owner
/// cannot drop it (the process is killed), the child gets `on_parent_death` (see
/// [`crate::sys::parent_death`]); it gets it too when the thread that started it ends, so a
/// test's daemons go with the test's thread.
#[derive(Debug)]
pub struct Guarded {
    child: Child,
}

impl Guarded {
    /// Starts `cmd` (its stdio as set on it).
    pub fn spawn(cmd: &mut Command, on_parent_death: Signal) -> std::io::Result<Self> {
        crate::sys::parent_death::die_with_parent(cmd, on_parent_death);
        cmd.spawn().map(|child| Self { child })
    }

    /// Its pid.
    pub fn pid(&self) -> rustix::process::Pid {
        rustix::process::Pid::from_child(&self.child)
    }
}

impl std::ops::Deref for Guarded {
    type Target = Child;

    fn deref(&self) -> &Child {
        &self.child
    }
}

impl std::ops::DerefMut for Guarded {
    fn deref_mut(&mut self) -> &mut Child {
        &mut self.child
    }
}

impl Drop for Guarded {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn alive(pid: rustix::process::Pid) -> bool {
        // A zombie (exited, not reaped) counts as gone.
        std::fs::read_to_string(format!("/proc/{}/stat", pid.as_raw_nonzero())).is_ok_and(|s| {
            !s.rsplit(')')
                .next()
                .unwrap_or("")
                .trim_start()
                .starts_with('Z')
        })
    }

    #[test]
    fn a_child_goes_when_dropped_and_when_the_thread_that_started_it_ends() {
        let mut sleep = Command::new("sleep");
        sleep.arg("600");
        let dropped = Guarded::spawn(&mut sleep, Signal::KILL).expect("spawn");
        let pid = dropped.pid();
        assert!(alive(pid));
        drop(dropped);
        assert!(!alive(pid), "killed and reaped on drop");

        // Started on a thread that ends without dropping it (as when the process is killed,
        // only quicker to show): the kernel kills it.
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut sleep = Command::new("sleep");
            sleep.arg("600");
            let g = Guarded::spawn(&mut sleep, Signal::KILL).expect("spawn");
            tx.send(g.pid()).unwrap();
            std::mem::forget(g);
        })
        .join()
        .unwrap();
        let orphan = rx.recv().unwrap();
        let start = std::time::Instant::now();
        // The kernel's signal takes effect at once; the child is reaped by init (or it is
        // this process's zombie): wait for either, bounded.
        while alive(orphan) {
            assert!(
                start.elapsed() < std::time::Duration::from_secs(60),
                "the child outlived the thread that started it"
            );
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    }
}
