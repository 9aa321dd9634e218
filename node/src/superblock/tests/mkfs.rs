//! Real images made by mkfs, when the tools exist on this machine.

use super::super::*;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Deletes the image file when dropped, whatever happens in the test.
pub(super) struct TempImage(pub(super) PathBuf);

impl TempImage {
    pub(super) fn new(tag: &str, size: u64) -> Self {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let name = format!("moor-probe-{}-{tag}-{n}.img", std::process::id());
        let path = std::env::temp_dir().join(name);
        let image = TempImage(path);
        let file = File::create(&image.0).expect("create image");
        file.set_len(size).expect("size image");
        image
    }
}

impl Drop for TempImage {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// The path of an mkfs tool, or `None` (after saying so) if it is not installed.
pub(super) fn tool(name: &str) -> Option<PathBuf> {
    let found = ["/usr/sbin", "/sbin", "/usr/bin", "/bin"]
        .iter()
        .map(|dir| Path::new(dir).join(name))
        .find(|p| p.is_file());
    if found.is_none() {
        eprintln!("skipping: {name} is not installed");
    }
    found
}

/// Reads the head and tail windows of an image, as the node plugin would.
pub(super) fn windows(path: &Path) -> (Vec<u8>, Vec<u8>, u64) {
    let mut file = File::open(path).expect("open image");
    let size = file.metadata().expect("stat image").len();
    let mut head = vec![0; HEAD_LEN.min(size as usize)];
    file.read_exact(&mut head).expect("read head");
    let tail_len = TAIL_LEN.min(size as usize);
    let mut tail = vec![0; tail_len];
    file.seek(SeekFrom::Start(size - tail_len as u64))
        .expect("seek");
    file.read_exact(&mut tail).expect("read tail");
    (head, tail, size)
}

const UUID: &str = "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0";

fn check(tool_name: &str, size_mib: u64, args: &[&str], expected: Filesystem) {
    let Some(mkfs) = tool(tool_name) else {
        return;
    };
    let image = TempImage::new(tool_name, size_mib << 20);
    let out = Command::new(&mkfs)
        .args(args)
        .arg(&image.0)
        .output()
        .expect("run mkfs");
    assert!(
        out.status.success(),
        "{tool_name} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (head, tail, size) = windows(&image.0);
    let want = Content::Filesystem {
        fs: expected,
        uuid: Some(UUID.to_owned()),
        label: Some("moor-test".to_owned()),
        // Each tool formats the whole image.
        size: Some(size_mib << 20),
    };
    assert_eq!(probe(&head, &tail, size), want);
    assert_eq!(probe_quick(&head[..QUICK_LEN]), Some(want));
}

#[test]
fn real_ext2() {
    check(
        "mkfs.ext2",
        64,
        &["-q", "-F", "-L", "moor-test", "-U", UUID],
        Filesystem::Ext2,
    );
}

#[test]
fn real_ext3() {
    check(
        "mkfs.ext3",
        64,
        &["-q", "-F", "-L", "moor-test", "-U", UUID],
        Filesystem::Ext3,
    );
}

#[test]
fn real_ext4() {
    check(
        "mkfs.ext4",
        64,
        &["-q", "-F", "-L", "moor-test", "-U", UUID],
        Filesystem::Ext4,
    );
}

#[test]
fn real_xfs() {
    let uuid = format!("uuid={UUID}");
    let args = ["-q", "-f", "-L", "moor-test", "-m", &uuid];
    check("mkfs.xfs", 300, &args, Filesystem::Xfs);
}

#[test]
fn an_xfs_whose_mkfs_has_not_finished_is_unknown_data() {
    let Some(mkfs) = tool("mkfs.xfs") else {
        return;
    };
    let image = TempImage::new("xfs-inprogress", 300 << 20);
    let st = Command::new(&mkfs)
        .args(["-q", "-f"])
        .arg(&image.0)
        .status()
        .expect("mkfs.xfs");
    assert!(st.success());
    let (head, tail, size) = windows(&image.0);
    assert!(matches!(
        probe(&head, &tail, size),
        Content::Filesystem {
            fs: Filesystem::Xfs,
            ..
        }
    ));
    // mkfs.xfs sets sb_inprogress first and clears it last.
    let st = Command::new("xfs_db")
        .args(["-x", "-c", "sb 0", "-c", "write inprogress 1"])
        .arg(&image.0)
        .output()
        .expect("xfs_db");
    assert!(st.status.success());
    let (head, tail, size) = windows(&image.0);
    assert_eq!(probe(&head, &tail, size), Content::Unknown { offset: 0 });
    assert_eq!(probe_quick(&head), None);
}

#[test]
fn real_btrfs() {
    let args = ["-q", "-f", "-L", "moor-test", "-U", UUID];
    check("mkfs.btrfs", 300, &args, Filesystem::Btrfs);
}
