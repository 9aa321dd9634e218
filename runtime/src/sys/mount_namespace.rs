//! Entering a private mount namespace: where moorctl's demo and the privileged tests mount, so
//! that nothing they mount is seen outside.

/// Moves the calling thread into a new mount namespace whose mounts are all private, so
/// nothing mounted from here on (by this thread, or by the children it starts) is seen outside
/// it, and every such mount goes when the last thread or process in the namespace is gone.
/// Called while a process has a single thread, it moves the whole process.
pub fn enter_private_mount_namespace() -> std::io::Result<()> {
    use rustix::thread::UnshareFlags;
    // SAFETY: only the mount namespace (and with it the filesystem attributes) is unshared;
    // the file descriptor table stays shared, so no thread can observe descriptors it cannot
    // use.
    unsafe { rustix::thread::unshare_unsafe(UnshareFlags::FS | UnshareFlags::NEWNS) }?;
    rustix::mount::mount_change(
        "/",
        rustix::mount::MountPropagationFlags::PRIVATE | rustix::mount::MountPropagationFlags::REC,
    )?;
    Ok(())
}
