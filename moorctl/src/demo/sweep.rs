//! What the teardown may have left behind, found and removed: mounts below the demo dir, loop
//! devices backed by files there, the dir itself.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Mount points at or below `root`, deepest first.
pub(super) fn mounts_below(root: &Path) -> Vec<PathBuf> {
    let table = std::fs::read("/proc/self/mountinfo").unwrap_or_default();
    let mut found: Vec<PathBuf> = moor_node::sys::mountinfo::parse(&table)
        .unwrap_or_default()
        .into_iter()
        .map(|m| m.mount_point)
        .filter(|p| p.starts_with(root))
        .collect();
    found.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    found
}

/// Loop devices whose backing file lies below `root`.
pub fn loops_below(root: &Path) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let Ok(entries) = std::fs::read_dir("/sys/block") else {
        return found;
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if !name.starts_with("loop") {
            continue;
        }
        if let Ok(b) = std::fs::read_to_string(e.path().join("loop/backing_file"))
            && Path::new(b.trim_end_matches('\n').trim_end_matches(" (deleted)")).starts_with(root)
        {
            found.push(PathBuf::from("/dev").join(name));
        }
    }
    found
}

/// Removes whatever the teardown left: mounts (detached), loop devices, the dir.
/// Returns what it had to remove.
pub(super) fn sweep(root: &Path) -> Vec<String> {
    let mut left = Vec::new();
    for m in mounts_below(root) {
        let _ = rustix::mount::unmount(m.as_path(), rustix::mount::UnmountFlags::DETACH);
        left.push(format!("mount {}", m.display()));
    }
    // A detached loop device is freed when its last user (udev's probe, say) closes it: a
    // moment, longer on a busy machine.
    let start = Instant::now();
    while !loops_below(root).is_empty() && start.elapsed() < Duration::from_secs(60) {
        std::thread::sleep(Duration::from_millis(20));
    }
    for dev in loops_below(root) {
        let _ = Command::new("losetup")
            .arg("-d")
            .arg(&dev)
            .stderr(Stdio::null())
            .status();
        left.push(format!("loop device {}", dev.display()));
    }
    if let Err(e) = std::fs::remove_dir_all(root)
        && e.kind() != std::io::ErrorKind::NotFound
    {
        left.push(format!("{} ({e})", root.display()));
    }
    left
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nothing_is_found_below_a_fresh_dir() {
        let dir = std::env::temp_dir().join(format!("moorctl-unit-{}", std::process::id()));
        assert!(mounts_below(&dir).is_empty());
        assert!(loops_below(&dir).is_empty());
        assert!(sweep(&dir).is_empty());
    }
}
