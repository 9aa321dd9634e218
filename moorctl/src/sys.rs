//! moorctl's one syscall that needs `unsafe`.

/// Moves the calling process into a new mount namespace whose mounts are all private, so
/// nothing mounted from here on (by this process or its children) is seen outside it, and
/// every such mount goes when the last process in the namespace exits. Call it while the
/// process has a single thread.
pub fn enter_private_mount_namespace() -> std::io::Result<()> {
    use rustix::thread::UnshareFlags;
    // SAFETY: only the mount namespace (and with it the filesystem attributes) is unshared;
    // the file descriptor table stays shared, so no descriptor changes under anyone's feet.
    unsafe { rustix::thread::unshare_unsafe(UnshareFlags::FS | UnshareFlags::NEWNS) }?;
    rustix::mount::mount_change(
        "/",
        rustix::mount::MountPropagationFlags::PRIVATE | rustix::mount::MountPropagationFlags::REC,
    )?;
    Ok(())
}

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
