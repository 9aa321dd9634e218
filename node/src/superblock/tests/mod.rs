//! The superblock probe's tests: the filesystems here, the other signatures in
//! `signatures`, robustness against any input in `robustness`, real images made by mkfs in
//! `mkfs` and real LUKS headers made by cryptsetup in `luks`.

mod ext_clean;
mod luks;
mod mkfs;
mod robustness;
mod signatures;

use super::*;

/// Writes `bytes` at `off`, growing `buf` if needed.
pub(super) fn put(buf: &mut Vec<u8>, off: usize, bytes: &[u8]) {
    if buf.len() < off + bytes.len() {
        buf.resize(off + bytes.len(), 0);
    }
    buf[off..off + bytes.len()].copy_from_slice(bytes);
}

pub(super) const UUID: [u8; 16] = [
    0x12, 0x34, 0x56, 0x78, 0x9a, 0xbc, 0xde, 0xf0, 0x01, 0x23, 0x45, 0x67, 0x89, 0xab, 0xcd, 0xef,
];
pub(super) const UUID_TEXT: &str = "12345678-9abc-def0-0123-456789abcdef";

#[test]
fn first_nonzero_finds_every_position() {
    for len in [0usize, 1, 63, 64, 65, 200, 511, 512, 513, 1100, 4096] {
        assert_eq!(first_nonzero(&vec![0; len]), None, "len {len}");
        for at in (0..len.min(1100)).chain(len.saturating_sub(600)..len) {
            let mut buf = vec![0u8; len];
            buf[at] = 0x80;
            if at + 1 < len {
                buf[at + 1] = 1;
            }
            assert_eq!(first_nonzero(&buf), Some(at), "len {len} at {at}");
        }
    }
}

/// A zeroed head window of `HEAD_LEN` bytes.
pub(super) fn head() -> Vec<u8> {
    vec![0; HEAD_LEN]
}

/// A zeroed tail window of `TAIL_LEN` bytes.
pub(super) fn tail() -> Vec<u8> {
    vec![0; TAIL_LEN]
}

pub(super) const SIZE: u64 = 1 << 30;

pub(super) fn put_ext(buf: &mut Vec<u8>, compat: u32, incompat: u32, ro_compat: u32, label: &[u8]) {
    put(buf, EXT_SB + 0x38, &EXT_MAGIC.to_le_bytes());
    put(buf, EXT_SB + 0x5C, &compat.to_le_bytes());
    put(buf, EXT_SB + 0x60, &incompat.to_le_bytes());
    put(buf, EXT_SB + 0x64, &ro_compat.to_le_bytes());
    put(buf, EXT_SB + 0x68, &UUID);
    put(buf, EXT_SB + 0x78, label);
}

pub(super) fn put_xfs(buf: &mut Vec<u8>, label: &[u8]) {
    put(buf, 0, b"XFSB");
    put(buf, 4, &4096u32.to_be_bytes());
    put(buf, 32, &UUID);
    put(buf, 108, label);
}

pub(super) fn put_btrfs(buf: &mut Vec<u8>, label: &[u8]) {
    put(buf, BTRFS_SB + 0x20, &UUID);
    put(buf, BTRFS_SB + 0x40, b"_BHRfS_M");
    put(buf, BTRFS_SB + 0x12b, label);
}

pub(super) fn put_mbr_entry(buf: &mut Vec<u8>, index: usize, kind: u8, start: u32, sectors: u32) {
    let off = MBR_ENTRIES + index * MBR_ENTRY_LEN;
    put(buf, off + 4, &[kind]);
    put(buf, off + 8, &start.to_le_bytes());
    put(buf, off + 12, &sectors.to_le_bytes());
    put(buf, 510, &[0x55, 0xAA]);
}

pub(super) fn fs(fs: Filesystem, uuid: Option<&str>, label: Option<&str>) -> Content {
    Content::Filesystem {
        fs,
        uuid: uuid.map(str::to_owned),
        label: label.map(str::to_owned),
        size: None,
    }
}

/// The size the probe reads from a head window.
pub(super) fn size_of(head: &[u8]) -> Option<u64> {
    match probe(head, &tail(), SIZE) {
        Content::Filesystem { size, .. } => size,
        other => panic!("not a filesystem: {other:?}"),
    }
}

#[test]
fn sizes_from_the_superblocks() {
    // ext4: 4 KiB blocks (log 2); the high half counts only with 64BIT.
    let mut h = head();
    put_ext(&mut h, 0x4, 0x40 | 0x200, 0, b"");
    put(&mut h, EXT_SB + 0x04, &262_144u32.to_le_bytes());
    put(&mut h, EXT_SB + 0x18, &2u32.to_le_bytes());
    put(&mut h, EXT_SB + 0x150, &1u32.to_le_bytes());
    assert_eq!(size_of(&h), Some(1 << 30));
    put_ext(&mut h, 0x4, 0x40 | 0x200 | EXT_INCOMPAT_64BIT, 0, b"");
    assert_eq!(size_of(&h), Some((1 << 30) + (1 << 44)));
    // A block size past 64 KiB is not a real one.
    put(&mut h, EXT_SB + 0x18, &7u32.to_le_bytes());
    assert_eq!(size_of(&h), None);
    // xfs: dblocks times a power-of-two block size.
    let mut h = head();
    put_xfs(&mut h, b"");
    assert_eq!(size_of(&h), None, "no data blocks");
    put(&mut h, 8, &131_072u64.to_be_bytes());
    assert_eq!(size_of(&h), Some(512 << 20));
    put(&mut h, 4, &3000u32.to_be_bytes());
    assert_eq!(size_of(&h), None);
    put(&mut h, 4, &65_536u32.to_be_bytes());
    put(&mut h, 8, &u64::MAX.to_be_bytes());
    assert_eq!(size_of(&h), None, "an overflow");
    // btrfs: total_bytes.
    let mut h = head();
    put_btrfs(&mut h, b"");
    assert_eq!(size_of(&h), None);
    put(&mut h, BTRFS_SB + 0x70, &(3u64 << 30).to_le_bytes());
    assert_eq!(size_of(&h), Some(3 << 30));
}

pub(super) fn ambiguous(names: &[&str]) -> Content {
    Content::Ambiguous(names.iter().map(|s| (*s).to_owned()).collect())
}

#[test]
fn blank_device() {
    assert_eq!(probe(&head(), &tail(), SIZE), Content::Blank);
    assert!(probe(&head(), &tail(), SIZE).is_blank());
}

#[test]
fn empty_device_is_blank() {
    assert_eq!(probe(&[], &[], 0), Content::Blank);
    assert_eq!(probe(&[0; 10], &[0; 10], 10), Content::Blank);
}

#[test]
fn ext2_ext3_ext4_are_told_apart() {
    let cases = [
        (0x38, 0x2, 0x3, Filesystem::Ext2),
        (0x3c, 0x2, 0x3, Filesystem::Ext3),
        (0x3c, 0x2 | 0x40, 0x3, Filesystem::Ext4), // extents
        (0x3c, 0x2 | 0x80, 0x3, Filesystem::Ext4), // 64bit
        (0x3c, 0x2 | 0x200, 0x3, Filesystem::Ext4), // flex_bg
        (0x3c, 0x2 | 0x100, 0x3, Filesystem::Ext4), // mmp
        (0x3c, 0x2 | 0x8000, 0x3, Filesystem::Ext4), // inline_data
        (0x3c, 0x2, 0x3 | 0x8, Filesystem::Ext4),  // huge_file
        (0x3c, 0x2, 0x3 | 0x10, Filesystem::Ext4), // gdt_csum
        (0x3c, 0x2, 0x3 | 0x20, Filesystem::Ext4), // dir_nlink
        (0x3c, 0x2, 0x3 | 0x40, Filesystem::Ext4), // extra_isize
        (0x3c, 0x2, 0x3 | 0x400, Filesystem::Ext4), // metadata_csum
        (0x38, 0x2 | 0x40, 0x3, Filesystem::Ext4), // extents without journal
        (0x3c, 0x2 | 0x4 | 0x10, 0x7, Filesystem::Ext3), // recover, meta_bg, btree_dir
    ];
    for (compat, incompat, ro_compat, expected) in cases {
        let mut h = head();
        put_ext(&mut h, compat, incompat, ro_compat, b"data\0\0");
        assert_eq!(
            probe(&h, &tail(), SIZE),
            fs(expected, Some(UUID_TEXT), Some("data")),
            "compat {compat:#x} incompat {incompat:#x} ro_compat {ro_compat:#x}"
        );
    }
}

#[test]
fn ext_label_of_full_length_and_none() {
    let mut h = head();
    put_ext(&mut h, 0x3c, 0x2c2, 0x7b, b"0123456789abcdefXXXX");
    // Bytes past the 16-byte label field belong to other fields; put them back to zero.
    put(&mut h, EXT_SB + 0x88, &[0; 4]);
    assert_eq!(
        probe(&h, &tail(), SIZE),
        fs(Filesystem::Ext4, Some(UUID_TEXT), Some("0123456789abcdef"))
    );

    let mut h = head();
    put(&mut h, EXT_SB + 0x38, &EXT_MAGIC.to_le_bytes());
    assert_eq!(probe(&h, &tail(), SIZE), fs(Filesystem::Ext2, None, None));
}

#[test]
fn ext_external_journal_is_not_a_filesystem() {
    let mut h = head();
    put_ext(&mut h, 0, 0x8, 0, b"");
    assert_eq!(probe(&h, &tail(), SIZE), Content::Unknown { offset: 1080 });
    assert_eq!(probe_quick(&h), None);
}

#[test]
fn xfs() {
    let mut h = head();
    put_xfs(&mut h, b"scratch");
    let expected = fs(Filesystem::Xfs, Some(UUID_TEXT), Some("scratch"));
    assert_eq!(probe(&h, &tail(), SIZE), expected);
    assert_eq!(probe_quick(&h), Some(expected));
}

#[test]
fn xfs_full_length_label() {
    let mut h = head();
    put_xfs(&mut h, b"twelve_chars");
    let label = probe(&h, &tail(), SIZE);
    assert_eq!(
        label,
        fs(Filesystem::Xfs, Some(UUID_TEXT), Some("twelve_chars"))
    );
}

#[test]
fn btrfs() {
    let mut h = head();
    put_btrfs(&mut h, "données".as_bytes());
    let expected = fs(Filesystem::Btrfs, Some(UUID_TEXT), Some("données"));
    assert_eq!(probe(&h, &tail(), SIZE), expected);
    assert_eq!(probe_quick(&h[..QUICK_LEN]), Some(expected));
}

#[test]
fn non_utf8_label_is_decoded_lossily() {
    let mut h = head();
    put_btrfs(&mut h, b"a\xffb");
    let Content::Filesystem { label, .. } = probe(&h, &tail(), SIZE) else {
        panic!("not a filesystem");
    };
    assert_eq!(label.as_deref(), Some("a\u{fffd}b"));
}

#[test]
fn quick_probe_ignores_bytes_past_quick_len() {
    let mut h = head();
    put_ext(&mut h, 0x3c, 0x2c2, 0x7b, b"q");
    put(&mut h, 0x80000, LUKS2_SECONDARY_MAGIC);
    put(&mut h, 0x80006, &2u16.to_be_bytes());
    assert_eq!(
        probe_quick(&h),
        Some(fs(Filesystem::Ext4, Some(UUID_TEXT), Some("q")))
    );
    assert_eq!(probe(&h, &tail(), SIZE), ambiguous(&["ext4", "luks2"]));
    assert_eq!(probe_quick(&[]), None);
    assert_eq!(probe_quick(&head()), None);
}

#[test]
fn names_round_trip() {
    for fs in Filesystem::ALL {
        assert_eq!(Filesystem::from_name(fs.name()), Some(fs));
    }
    assert_eq!(Filesystem::from_name("ext4"), Some(Filesystem::Ext4));
    assert_eq!(Filesystem::from_name("vfat"), None);
    assert_eq!(Filesystem::from_name(""), None);
    assert_eq!(Filesystem::from_name("XFS"), None);
}

#[test]
fn describe() {
    let xfs = fs(Filesystem::Xfs, Some(UUID_TEXT), Some("a \"b\""));
    assert_eq!(
        xfs.describe(),
        format!("an xfs filesystem (uuid {UUID_TEXT}, label \"a \\\"b\\\"\")")
    );
    assert_eq!(
        fs(Filesystem::Btrfs, None, None).describe(),
        "a btrfs filesystem"
    );
    assert_eq!(
        fs(Filesystem::Ext4, None, Some("l")).describe(),
        "an ext4 filesystem (label \"l\")"
    );
    let gpt = Content::PartitionTable(PartitionTable::Gpt);
    assert_eq!(gpt.describe(), "a GPT partition table");
    let mbr = Content::PartitionTable(PartitionTable::Mbr);
    assert_eq!(mbr.describe(), "an MBR partition table");
    assert_eq!(
        Content::Unknown { offset: 4096 }.describe(),
        "unknown data at offset 4096"
    );
    assert_eq!(
        Content::Luks {
            version: 2,
            uuid: None
        }
        .describe(),
        "a LUKS2 encrypted volume"
    );
    assert_eq!(
        Content::Luks {
            version: 1,
            uuid: Some(UUID_TEXT.to_owned())
        }
        .describe(),
        format!("a LUKS1 encrypted volume (uuid {UUID_TEXT})")
    );
    assert_eq!(Content::Swap.describe(), "a swap area");
    assert_eq!(Content::Blank.describe(), "a blank device (all zeros)");
    assert_eq!(
        ambiguous(&["ext4", "xfs"]).describe(),
        "several conflicting signatures (ext4, xfs)"
    );
    assert!(!Content::Swap.is_blank());
}
