//! A child that dies with the thread that started it: `PR_SET_PDEATHSIG`, set in the child
//! before it execs.

use rustix::process::Signal;

/// Makes the child `cmd` starts receive `signal` when the thread that starts it ends: with its
/// process (also when that process is killed with SIGKILL, when nothing of it runs to clean
/// up), or alone. A child whose parent process is already gone when it sets this (the parent
/// died between fork and prctl) does not start.
pub fn die_with_parent(cmd: &mut std::process::Command, signal: Signal) {
    use std::os::unix::process::CommandExt as _;
    let parent = rustix::process::getpid();
    // SAFETY: the closure runs in the child between fork and exec, and makes only
    // async-signal-safe system calls (prctl, getppid), touching no lock and allocating nothing
    // (an error from an errno does not allocate).
    unsafe {
        cmd.pre_exec(move || {
            rustix::process::set_parent_process_death_signal(Some(signal))?;
            if rustix::process::getppid() != Some(parent) {
                return Err(rustix::io::Errno::SRCH.into());
            }
            Ok(())
        });
    }
}
