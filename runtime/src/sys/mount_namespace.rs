//! The harness's one syscall that needs `unsafe`.

/// Moves the calling thread into a new mount namespace whose mounts are all private, so
/// nothing a test mounts is seen outside it, and everything goes when the thread ends.
pub fn enter_private_mount_namespace() -> std::io::Result<()> {
    use rustix::thread::UnshareFlags;
    // SAFETY: only the filesystem attributes and the mount namespace are unshared; the file
    // descriptor table stays shared, so no thread can observe descriptors it cannot use.
    unsafe { rustix::thread::unshare_unsafe(UnshareFlags::FS | UnshareFlags::NEWNS) }?;
    rustix::mount::mount_change(
        "/",
        rustix::mount::MountPropagationFlags::PRIVATE | rustix::mount::MountPropagationFlags::REC,
    )?;
    Ok(())
}
