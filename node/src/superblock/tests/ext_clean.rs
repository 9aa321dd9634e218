//! The e2fsck shortcut on a real image made by mkfs.ext4 (when it is installed): clean as
//! made, and every single byte of its superblock or of a group descriptor changed behind the
//! checksums' back makes it a filesystem e2fsck must check, without a panic. The corpus where
//! e2fsck itself answers is `privileged/tests/e2fsck_shortcut.rs`.

use super::super::ext_clean::{Verdict, e2fsck_would_skip};
use super::super::{EXT_SB, QUICK_LEN};
use std::fs::File;
use std::os::unix::fs::FileExt as _;
use std::process::Command;

/// A 160 MiB ext4 of 4 KiB blocks (two groups: a backup superblock), or None without mkfs.
fn image() -> Option<(tempfile_path::Temp, File)> {
    let mkfs = ["/usr/sbin/mkfs.ext4", "/sbin/mkfs.ext4"]
        .into_iter()
        .find(|p| std::path::Path::new(p).is_file());
    let Some(mkfs) = mkfs else {
        eprintln!("skipping: mkfs.ext4 is not installed");
        return None;
    };
    let path = tempfile_path::Temp::new("ext-clean");
    File::create(&path.0)
        .and_then(|f| f.set_len(160 << 20))
        .expect("image");
    let ok = Command::new(mkfs)
        .args(["-q", "-F", "-b", "4096"])
        .arg(&path.0)
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok, "mkfs.ext4");
    let file = File::open(&path.0).expect("open image");
    Some((path, file))
}

mod tempfile_path {
    /// A file under the temp dir, removed when dropped.
    pub struct Temp(pub std::path::PathBuf);
    impl Temp {
        pub fn new(tag: &str) -> Self {
            Self(std::env::temp_dir().join(format!("moor-{tag}-{}.img", std::process::id())))
        }
    }
    impl Drop for Temp {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }
}

fn verdict(head: &[u8], file: &File) -> Verdict {
    let mut read = |offset: u64, len: usize| -> Option<Vec<u8>> {
        let mut buf = vec![0u8; len];
        file.read_exact_at(&mut buf, offset).ok()?;
        Some(buf)
    };
    e2fsck_would_skip(head, 2_000_000_000, &mut read)
}

#[test]
fn every_changed_byte_of_the_superblock_or_descriptors_asks_for_e2fsck() {
    let Some((_path, file)) = image() else {
        return;
    };
    let mut head = vec![0u8; QUICK_LEN];
    file.read_exact_at(&mut head, 0).expect("head");
    assert_eq!(verdict(&head, &file), Verdict::Clean, "as mkfs made it");
    // The superblock's checksummed bytes (all but the checksum itself), then both group
    // descriptors (64 bytes each at 4096).
    let offsets = (EXT_SB..EXT_SB + 0x3FC).chain(4096..4096 + 128);
    for at in offsets {
        for flip in [0x01u8, 0x80, 0xFF] {
            let mut h = head.clone();
            h[at] ^= flip;
            assert!(
                matches!(verdict(&h, &file), Verdict::Check(_)),
                "byte {at} ^ {flip:#x} passed as clean"
            );
        }
    }
    // Any prefix of the head: no panic, and clean only with the whole superblock and
    // descriptors in it or read.
    for len in (0..8192).step_by(7) {
        let _ = verdict(&head[..len], &file);
    }
}
