//! moorctl's one syscall that needs `unsafe` (its private mount namespace is
//! [`moor_runtime::sys::mount_namespace`]).

/// Makes the child that `cmd` starts receive SIGTERM when this process dies, so a daemon the
/// demo started never outlives it, not even when moorctl itself is killed with SIGKILL.
pub fn terminate_with_parent(cmd: &mut std::process::Command) {
    use std::os::unix::process::CommandExt as _;
    // SAFETY: the closure runs in the child between fork and exec, and makes only one
    // async-signal-safe system call (prctl), touching no lock and allocating nothing.
    unsafe {
        cmd.pre_exec(|| {
            rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::TERM))
                .map_err(std::io::Error::from)
        });
    }
}
