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
