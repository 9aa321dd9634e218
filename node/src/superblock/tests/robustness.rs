//! No panic on any input, and the quick probe agreeing with the full one.

use super::*;

/// An image with every signature this module knows, so that each prefix cuts one of them.
fn everything() -> Vec<u8> {
    let mut h = head();
    put_xfs(&mut h, b"x");
    put_mbr_entry(&mut h, 0, 0x83, 1, 100);
    put(&mut h, 512, GPT_MAGIC);
    put_ext(&mut h, 0x3c, 0x2c2, 0x7b, b"e");
    put(&mut h, 4086, b"SWAPSPACE2");
    put(&mut h, 4096, GPT_MAGIC);
    put(&mut h, 0x4000, LUKS2_SECONDARY_MAGIC);
    put(&mut h, 0x4006, &2u16.to_be_bytes());
    put_btrfs(&mut h, b"b");
    h
}

/// [`everything`] with a LUKS1 primary header in place of the XFS superblock.
fn everything_luks() -> Vec<u8> {
    let mut h = everything();
    put(&mut h, 0, LUKS_MAGIC);
    put(&mut h, 6, &1u16.to_be_bytes());
    h
}

#[test]
fn truncated_buffers_never_panic() {
    let sizes = [
        0,
        1,
        511,
        512,
        1024,
        2048,
        4096,
        HEAD_LEN as u64,
        SIZE,
        u64::MAX,
    ];
    for full in [everything(), everything_luks()] {
        for len in 0..=2048 {
            let cut = &full[..len];
            let _ = probe_quick(cut);
            for size in sizes {
                let _ = probe(cut, cut, size);
                let _ = probe(cut, &full, size);
                let _ = probe(&full, cut, size);
            }
            let _ = probe(cut, &[], len as u64);
        }
    }
    assert_eq!(
        probe(&everything(), &[], SIZE),
        ambiguous(&["ext4", "xfs", "btrfs", "luks2", "swap", "gpt"])
    );
    assert_eq!(
        probe(&everything_luks(), &[], SIZE),
        ambiguous(&["ext4", "btrfs", "luks1", "swap", "gpt"])
    );
}

/// A small deterministic xorshift generator, so the test needs no dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

#[test]
fn random_mutations_never_panic_and_quick_agrees_with_full() {
    let base = everything();
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    for _ in 0..300 {
        let len = (rng.next() % (QUICK_LEN as u64 + 8)) as usize;
        let mut buf = base[..len].to_vec();
        for _ in 0..(rng.next() % 64) {
            if buf.is_empty() {
                break;
            }
            let i = (rng.next() % buf.len() as u64) as usize;
            buf[i] = if rng.next().is_multiple_of(2) {
                0
            } else {
                rng.next() as u8
            };
        }
        let size = rng.next() % (2 * len as u64 + 1);
        let full = probe(&buf, &buf, size);
        if let Some(quick) = probe_quick(&buf) {
            // With no tail, the full probe must agree with a quick answer.
            assert_eq!(probe(&buf, &[], len as u64 + 1_000_000), quick);
            assert!(matches!(quick, Content::Filesystem { .. }));
        }
        let _ = full.describe();
    }
}
