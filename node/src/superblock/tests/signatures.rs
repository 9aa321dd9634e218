//! LUKS, swap, partition tables, unknown data and several signatures at once.

use super::*;

#[test]
fn luks1_and_luks2() {
    for version in [1u16, 2] {
        let mut h = head();
        put(&mut h, 0, LUKS_MAGIC);
        put(&mut h, 6, &version.to_be_bytes());
        put(&mut h, LUKS_UUID, UUID_TEXT.as_bytes());
        if version == 2 {
            put(&mut h, 0x4000, LUKS2_SECONDARY_MAGIC);
            put(&mut h, 0x4006, &2u16.to_be_bytes());
            put(&mut h, 0x4000 + LUKS_UUID, UUID_TEXT.as_bytes());
        }
        let uuid = Some(UUID_TEXT.to_owned());
        assert_eq!(probe(&h, &tail(), SIZE), Content::Luks { version, uuid });
        assert_eq!(probe_quick(&h), None);
    }
}

#[test]
fn luks2_secondary_header_alone() {
    for off in [0x4000, 0x8000, 0x10000, 0x20000, 0x40000, 0x80000] {
        let mut h = head();
        put(&mut h, off, LUKS2_SECONDARY_MAGIC);
        put(&mut h, off + 6, &2u16.to_be_bytes());
        assert_eq!(
            probe(&h, &tail(), SIZE),
            Content::Luks {
                version: 2,
                uuid: None
            },
            "{off:#x}"
        );
    }
}

#[test]
fn swap_at_every_page_size() {
    for page in SWAP_PAGE_SIZES {
        for magic in [
            &b"SWAPSPACE2"[..],
            b"SWAP-SPACE",
            b"S1SUSPEND",
            b"LINHIB0001",
        ] {
            let mut h = head();
            put(&mut h, page - 10, magic);
            assert_eq!(probe(&h, &tail(), SIZE), Content::Swap, "page {page}");
        }
    }
}

#[test]
fn mbr() {
    let mut h = head();
    put(&mut h, 0, &[0xfa, 0x31, 0xc0]); // boot code
    put_mbr_entry(&mut h, 0, 0x83, 2048, 4096);
    put(&mut h, MBR_ENTRIES, &[0x80]);
    assert_eq!(
        probe(&h, &tail(), SIZE),
        Content::PartitionTable(PartitionTable::Mbr)
    );
    assert_eq!(probe_quick(&h), None);
}

#[test]
fn boot_signature_without_partitions_is_unknown() {
    let mut h = head();
    put(&mut h, 510, &[0x55, 0xAA]);
    assert_eq!(probe(&h, &tail(), SIZE), Content::Unknown { offset: 510 });

    let mut h = head();
    put_mbr_entry(&mut h, 1, 0x83, 2048, 4096);
    put(&mut h, MBR_ENTRIES, &[0x7f]); // invalid boot flag
    assert_eq!(probe(&h, &tail(), SIZE), Content::Unknown { offset: 446 });
}

#[test]
fn gpt_primary_512_and_4k() {
    for sector in [512usize, 4096] {
        let mut h = head();
        put_mbr_entry(&mut h, 0, MBR_TYPE_GPT_PROTECTIVE, 1, u32::MAX);
        put(&mut h, sector, GPT_MAGIC);
        let mut t = tail();
        let backup = TAIL_LEN - sector;
        put(&mut t, backup, GPT_MAGIC);
        assert_eq!(
            probe(&h, &t, SIZE),
            Content::PartitionTable(PartitionTable::Gpt)
        );
        // Without the protective MBR or the backup, it is still a GPT.
        let mut h = head();
        put(&mut h, sector, GPT_MAGIC);
        assert_eq!(
            probe(&h, &tail(), SIZE),
            Content::PartitionTable(PartitionTable::Gpt)
        );
    }
}

#[test]
fn protective_mbr_alone_is_gpt() {
    let mut h = head();
    put_mbr_entry(&mut h, 0, MBR_TYPE_GPT_PROTECTIVE, 1, 1000);
    assert_eq!(
        probe(&h, &tail(), SIZE),
        Content::PartitionTable(PartitionTable::Gpt)
    );
}

#[test]
fn hybrid_mbr_with_gpt_is_gpt() {
    let mut h = head();
    put_mbr_entry(&mut h, 0, MBR_TYPE_GPT_PROTECTIVE, 1, 2047);
    put_mbr_entry(&mut h, 1, 0x0c, 2048, 4096);
    put(&mut h, 512, GPT_MAGIC);
    assert_eq!(
        probe(&h, &tail(), SIZE),
        Content::PartitionTable(PartitionTable::Gpt)
    );
}

#[test]
fn gpt_backup_only_in_tail() {
    for sector in [512usize, 4096] {
        let mut t = tail();
        put(&mut t, TAIL_LEN - sector, GPT_MAGIC);
        assert_eq!(
            probe(&head(), &t, SIZE),
            Content::PartitionTable(PartitionTable::Gpt)
        );
    }
}

#[test]
fn gpt_backup_on_small_device_found_in_head() {
    // A 64 KiB device: the head window is the whole device and the tail is empty.
    let size = 64 * 1024;
    let mut h = vec![0; size];
    put(&mut h, size - 512, GPT_MAGIC);
    assert_eq!(
        probe(&h, &[], size as u64),
        Content::PartitionTable(PartitionTable::Gpt)
    );
    assert_eq!(
        probe(&h, &h, size as u64),
        Content::PartitionTable(PartitionTable::Gpt)
    );
}

#[test]
fn gpt_magic_not_at_end_is_unknown() {
    let mut t = tail();
    put(&mut t, TAIL_LEN - 1024, GPT_MAGIC);
    let offset = SIZE - 1024;
    assert_eq!(probe(&head(), &t, SIZE), Content::Unknown { offset });
}

#[test]
fn unknown_byte_in_middle_of_head() {
    let mut h = head();
    h[HEAD_LEN / 2] = 7;
    h[HEAD_LEN / 2 + 100] = 9;
    let offset = (HEAD_LEN / 2) as u64;
    assert_eq!(probe(&h, &tail(), SIZE), Content::Unknown { offset });
    assert_eq!(probe_quick(&h), None);
}

#[test]
fn unknown_byte_in_tail_is_absolute() {
    let mut t = tail();
    t[12345] = 1;
    let offset = SIZE - TAIL_LEN as u64 + 12345;
    assert_eq!(probe(&head(), &t, SIZE), Content::Unknown { offset });
}

#[test]
fn unknown_byte_on_small_device_with_overlapping_windows() {
    let mut dev = vec![0u8; 3000];
    dev[2999] = 1;
    assert_eq!(probe(&dev, &dev, 3000), Content::Unknown { offset: 2999 });
    assert_eq!(
        probe(&dev[..0], &dev, 3000),
        Content::Unknown { offset: 2999 }
    );
}

#[test]
fn ambiguous_ext4_and_xfs() {
    let mut h = head();
    put_xfs(&mut h, b"x");
    put_ext(&mut h, 0x3c, 0x2c2, 0x7b, b"e");
    assert_eq!(probe(&h, &tail(), SIZE), ambiguous(&["ext4", "xfs"]));
    assert_eq!(probe_quick(&h), None);
}

#[test]
fn ambiguous_filesystem_and_other_signatures() {
    let mut h = head();
    put_ext(&mut h, 0x3c, 0x2c2, 0x7b, b"e");
    put_mbr_entry(&mut h, 0, 0x83, 2048, 4096);
    assert_eq!(probe(&h, &tail(), SIZE), ambiguous(&["ext4", "mbr"]));

    let mut h = head();
    put_btrfs(&mut h, b"b");
    put(&mut h, 4086, b"SWAPSPACE2");
    assert_eq!(probe(&h, &tail(), SIZE), ambiguous(&["btrfs", "swap"]));
    assert_eq!(probe_quick(&h), None);

    let mut h = head();
    put_ext(&mut h, 0x3c, 0x2, 0x3, b"");
    let mut t = tail();
    put(&mut t, TAIL_LEN - 512, GPT_MAGIC);
    assert_eq!(probe(&h, &t, SIZE), ambiguous(&["ext3", "gpt"]));

    let mut h = head();
    put(&mut h, 0, LUKS_MAGIC);
    put(&mut h, 6, &1u16.to_be_bytes());
    put_btrfs(&mut h, b"");
    assert_eq!(probe(&h, &tail(), SIZE), ambiguous(&["btrfs", "luks1"]));
}

#[test]
fn filesystem_with_empty_boot_sector_signature_is_the_filesystem() {
    // A bootloader in the ext boot block: 0x55AA but no partition entries.
    let mut h = head();
    put(&mut h, 0, &[0xeb, 0x63, 0x90]);
    put(&mut h, 510, &[0x55, 0xAA]);
    put_ext(&mut h, 0x3c, 0x2c2, 0x7b, b"boot");
    let expected = fs(Filesystem::Ext4, Some(UUID_TEXT), Some("boot"));
    assert_eq!(probe(&h, &tail(), SIZE), expected);
}

#[test]
fn far_luks2_secondary_headers_unblank_a_blank_device() {
    let zero = [0u8; FAR_LEN];
    let all_zero: Vec<(u64, &[u8])> = FAR_OFFSETS.iter().map(|&at| (at, &zero[..])).collect();
    assert_eq!(confirm_blank(&all_zero), Content::Blank);
    assert_eq!(confirm_blank(&[]), Content::Blank);
    for (i, &at) in FAR_OFFSETS.iter().enumerate() {
        let mut block = zero.to_vec();
        put(&mut block, 0, LUKS2_SECONDARY_MAGIC);
        put(&mut block, 6, &2u16.to_be_bytes());
        put(&mut block, LUKS_UUID, UUID_TEXT.as_bytes());
        let mut far = all_zero.clone();
        far[i] = (at, &block);
        let want = Content::Luks {
            version: 2,
            uuid: Some(UUID_TEXT.to_owned()),
        };
        assert_eq!(confirm_blank(&far), want, "{at:#x}");
        let mut other = zero.to_vec();
        other[100] = 7;
        far[i] = (at, &other);
        assert_eq!(
            confirm_blank(&far),
            Content::Unknown { offset: at + 100 },
            "{at:#x}"
        );
    }
    // A short read is looked at as far as it goes.
    assert_eq!(
        confirm_blank(&[(FAR_OFFSETS[0], &LUKS2_SECONDARY_MAGIC[..4])]),
        Content::Unknown {
            offset: FAR_OFFSETS[0]
        }
    );
}
