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
