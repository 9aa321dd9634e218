//! Whether the kernel has SELinux: only then do the `context=` mount options mean anything (a
//! kernel without it refuses them).

use std::sync::OnceLock;

/// Whether `filesystems` (the text of `/proc/filesystems`) lists `selinuxfs`, which the kernel
/// registers only when SELinux is enabled.
pub fn lists_selinuxfs(filesystems: &str) -> bool {
    filesystems
        .lines()
        .any(|l| l.split_whitespace().last() == Some("selinuxfs"))
}

/// Whether this node's kernel has SELinux, read once.
pub fn in_kernel() -> bool {
    static FOUND: OnceLock<bool> = OnceLock::new();
    *FOUND.get_or_init(|| {
        std::fs::read_to_string("/proc/filesystems").is_ok_and(|t| lists_selinuxfs(&t))
            || std::path::Path::new("/sys/fs/selinux/enforce").exists()
    })
}

/// Whether the loaded policy knows `label`: selinuxfs's `context` node takes a label and the
/// kernel refuses one its policy does not know (EINVAL), as a mount with it would be refused.
/// True where that cannot be asked (no selinuxfs mounted here, or no right to ask).
pub fn label_known(label: &str) -> bool {
    use std::io::Write as _;
    let Ok(mut node) = std::fs::OpenOptions::new()
        .write(true)
        .open("/sys/fs/selinux/context")
    else {
        return true;
    };
    match node.write_all(label.as_bytes()) {
        Ok(()) => true,
        Err(e) => e.raw_os_error() != Some(rustix::io::Errno::INVAL.raw_os_error()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn selinuxfs_in_proc_filesystems_means_selinux() {
        assert!(lists_selinuxfs("nodev\tsysfs\nnodev\tselinuxfs\n\text4\n"));
        assert!(!lists_selinuxfs(
            "nodev\tsysfs\n\text4\nnodev\tselinuxfsx\n"
        ));
        assert!(!lists_selinuxfs(""));
    }
}
