//! Whether `e2fsck -p` would pass an ext2/3/4 filesystem as clean without checking it: its
//! shortcut (e2fsprogs' `check_if_skip`, reached after the opening checks and
//! `check_super_block`), decided from the filesystem's metadata alone.
//!
//! e2fsck in preen mode opens the filesystem (the superblock's checksum, the group
//! descriptors'), checks its journal's superblock, replays a journal that needs it, checks the
//! superblock's fields and every group descriptor, releases orphan inodes, and only then asks
//! whether a full check is due: an error recorded or the state not clean, the first backup
//! superblock's features or size differing from the primary's, the mount count or the check
//! interval reached. When none of that found anything, it prints "clean" and exits 0 having
//! read nothing but the superblock, the group descriptors, the journal inode and superblock and
//! the first backup superblock; moor reads those same bytes and answers [`Verdict::Clean`] only
//! when each of those steps would find nothing to do. Anything else, and anything this module
//! does not model (features it does not know, a meta_bg layout, MMP, bigalloc, a journal
//! whose extents are not all in its inode), is [`Verdict::Check`]: e2fsck runs, as before.
//!
//! What it assumes of e2fsck's configuration: none (no `/etc/e2fsck.conf` changing
//! `broken_system_clock` or the time fudge of a day), and not running on battery (where
//! e2fsck would defer a due check: moor checks). Pure, no I/O of its own: what lies past the
//! bytes handed in is asked of `read`. Never panics on any input.

use super::{EXT_MAGIC, EXT_SB, le16, le32};

/// The answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// `e2fsck -p` would print "clean" and exit 0 without checking anything further.
    Clean,
    /// Run e2fsck: why (a short phrase, for the log).
    Check(&'static str),
}

/// Reads `len` bytes at byte offset `offset` of the device; None when it cannot.
pub type Read<'a> = &'a mut dyn FnMut(u64, usize) -> Option<Vec<u8>>;

/// The day e2fsck allows a clock to be behind the filesystem's times (its `time_fudge`).
const TIME_FUDGE: i64 = 86_400;

// Feature bits (the superblock's compat, incompat and ro_compat words).
const COMPAT_HAS_JOURNAL: u32 = 0x4;
/// The compat features modelled: dir_prealloc, imagic_inodes, has_journal, ext_attr,
/// resize_inode, dir_index, orphan_file.
const COMPAT_KNOWN: u32 = 0x1 | 0x2 | COMPAT_HAS_JOURNAL | 0x8 | 0x10 | 0x20 | COMPAT_ORPHAN_FILE;
const COMPAT_ORPHAN_FILE: u32 = 0x1000;
const COMPAT_DIR_INDEX: u32 = 0x20;
const INCOMPAT_RECOVER: u32 = 0x4;
const INCOMPAT_EXTENTS: u32 = 0x40;
const INCOMPAT_64BIT: u32 = 0x80;
const INCOMPAT_CSUM_SEED: u32 = 0x2000;
/// The incompat features modelled: filetype, recover (refused below), extents, 64bit,
/// flex_bg, csum_seed, large_dir.
const INCOMPAT_KNOWN: u32 = 0x2
    | INCOMPAT_RECOVER
    | INCOMPAT_EXTENTS
    | INCOMPAT_64BIT
    | 0x200
    | INCOMPAT_CSUM_SEED
    | 0x4000;
const RO_COMPAT_SPARSE_SUPER: u32 = 0x1;
const RO_COMPAT_LARGE_FILE: u32 = 0x2;
const RO_COMPAT_GDT_CSUM: u32 = 0x10;
const RO_COMPAT_DIR_NLINK: u32 = 0x20;
const RO_COMPAT_METADATA_CSUM: u32 = 0x400;
const RO_COMPAT_ORPHAN_PRESENT: u32 = 0x10000;
/// The ro_compat features modelled: sparse_super, large_file, huge_file, gdt_csum, dir_nlink,
/// extra_isize, metadata_csum.
const RO_COMPAT_KNOWN: u32 = RO_COMPAT_SPARSE_SUPER
    | RO_COMPAT_LARGE_FILE
    | 0x8
    | RO_COMPAT_GDT_CSUM
    | RO_COMPAT_DIR_NLINK
    | 0x40
    | RO_COMPAT_METADATA_CSUM;
/// What e2fsck leaves out when it compares the primary superblock with a backup.
const INCOMPAT_BACKUP_IGNORE: u32 = INCOMPAT_EXTENTS | INCOMPAT_RECOVER;
const RO_COMPAT_BACKUP_IGNORE: u32 =
    RO_COMPAT_LARGE_FILE | RO_COMPAT_DIR_NLINK | RO_COMPAT_ORPHAN_PRESENT;

// s_state and s_flags bits.
const STATE_VALID: u16 = 0x1;
const STATE_ERROR: u16 = 0x2;
const FLAGS_HASH_SIGNED_OR_UNSIGNED: u32 = 0x1 | 0x2;
const FLAGS_TEST_FILESYS: u32 = 0x4;

// Group descriptor flags.
const BG_INODE_UNINIT: u16 = 0x1;
const BG_BLOCK_UNINIT: u16 = 0x2;

/// The superblock's fields this module reads, at their offsets in the 1024-byte superblock.
struct Super<'a> {
    raw: &'a [u8],
}

impl Super<'_> {
    fn u16(&self, off: usize) -> u16 {
        le16(self.raw, off).unwrap_or(0)
    }
    fn u32(&self, off: usize) -> u32 {
        le32(self.raw, off).unwrap_or(0)
    }
    fn byte(&self, off: usize) -> u8 {
        self.raw.get(off).copied().unwrap_or(0)
    }
    /// A 32-bit field and its high half elsewhere (with 64bit; zero without).
    fn wide(&self, lo: usize, hi: usize, has_hi: bool) -> u64 {
        u64::from(self.u32(lo))
            | if has_hi {
                u64::from(self.u32(hi)) << 32
            } else {
                0
            }
    }
    /// A timestamp: 32 bits and 8 high bits in a byte of their own.
    fn time(&self, lo: usize, hi: usize) -> i64 {
        i64::from(self.u32(lo)) | (i64::from(self.byte(hi)) << 32)
    }
}

/// The filesystem's shape, from its superblock.
struct Geometry {
    block_size: u64,
    blocks: u64,
    first_data_block: u64,
    blocks_per_group: u64,
    inodes_per_group: u64,
    inode_size: u64,
    groups: u64,
    desc_size: usize,
    incompat: u32,
    ro_compat: u32,
    csum_seed: u32,
    uuid: [u8; 16],
}

impl Geometry {
    fn metadata_csum(&self) -> bool {
        self.ro_compat & RO_COMPAT_METADATA_CSUM != 0
    }
    fn gdt_csum(&self) -> bool {
        self.ro_compat & RO_COMPAT_GDT_CSUM != 0
    }
    fn has_64bit(&self) -> bool {
        self.incompat & INCOMPAT_64BIT != 0
    }
    fn inode_table_blocks(&self) -> u64 {
        (self.inodes_per_group * self.inode_size).div_ceil(self.block_size)
    }
}

/// Whether `e2fsck -p` would pass the filesystem whose first bytes are `head` (the superblock
/// at 1024, and as much after it as was read) as clean, at wall-clock time `now` (seconds
/// since the epoch). What lies past `head` (group descriptors beyond it, the journal inode and
/// superblock, the first backup superblock) is read through `read`.
pub fn e2fsck_would_skip(head: &[u8], now: i64, read: Read<'_>) -> Verdict {
    match decide(head, now, read) {
        Ok(()) => Verdict::Clean,
        Err(why) => Verdict::Check(why),
    }
}

/// The decision, each refusal with its reason.
fn decide(head: &[u8], now: i64, read: Read<'_>) -> Result<(), &'static str> {
    let raw = head
        .get(EXT_SB..EXT_SB + 1024)
        .ok_or("no whole superblock")?;
    let sb = Super { raw };
    if sb.u16(0x38) != EXT_MAGIC {
        return Err("no ext superblock");
    }
    let (compat, incompat, ro_compat) = (sb.u32(0x5C), sb.u32(0x60), sb.u32(0x64));
    if incompat & INCOMPAT_RECOVER != 0 {
        return Err("the journal needs recovery");
    }
    if ro_compat & RO_COMPAT_ORPHAN_PRESENT != 0 || sb.u32(0xE8) != 0 {
        return Err("orphan inodes to release");
    }
    if compat & !COMPAT_KNOWN != 0
        || incompat & !INCOMPAT_KNOWN != 0
        || ro_compat & !RO_COMPAT_KNOWN != 0
    {
        return Err("a feature the shortcut does not model");
    }
    if sb.u32(0x4C) != 1 {
        return Err("not a dynamic-revision superblock");
    }
    let state = sb.u16(0x3A);
    if state & STATE_ERROR != 0 {
        return Err("errors recorded");
    }
    if state & STATE_VALID == 0 {
        return Err("not cleanly unmounted");
    }
    let metadata_csum = ro_compat & RO_COMPAT_METADATA_CSUM != 0;
    if metadata_csum {
        if sb.byte(0x175) != 1 {
            return Err("an unknown checksum type");
        }
        if crc32c(!0, raw.get(..0x3FC).unwrap_or_default()) != sb.u32(0x3FC) {
            return Err("the superblock's checksum is wrong");
        }
        if ro_compat & RO_COMPAT_GDT_CSUM != 0 {
            return Err("both metadata_csum and gdt_csum");
        }
    } else if incompat & INCOMPAT_CSUM_SEED != 0 {
        return Err("csum_seed without metadata_csum");
    }
    let g = geometry(&sb, incompat, ro_compat)?;
    check_fields(&sb, &g, now)?;
    let gdt = group_descriptors(head, &g, read)?;
    check_groups(&gdt, &g)?;
    check_journal(&sb, &g, compat, &gdt, read)?;
    if compat & COMPAT_ORPHAN_FILE != 0 && sb.u32(0x280) == 0 {
        return Err("orphan_file without its inode");
    }
    check_backup(&sb, &g, read)?;
    check_due(&sb, now)
}

/// The shape, with the range checks of e2fsck's `check_super_block` and of opening the
/// filesystem; a shape they refuse is checked.
fn geometry(sb: &Super<'_>, incompat: u32, ro_compat: u32) -> Result<Geometry, &'static str> {
    let log = sb.u32(0x18);
    if log > 6 || sb.u32(0x1C) != log {
        return Err("a block or cluster size the shortcut does not model");
    }
    let block_size = 1024u64 << log;
    let has_64bit = incompat & INCOMPAT_64BIT != 0;
    let blocks = sb.wide(0x04, 0x150, has_64bit);
    let first_data_block = u64::from(sb.u32(0x14));
    let blocks_per_group = u64::from(sb.u32(0x20));
    let inodes_per_group = u64::from(sb.u32(0x28));
    let inode_size = u64::from(sb.u16(0x58));
    let desc_size = if has_64bit {
        usize::from(sb.u16(0xFE))
    } else {
        32
    };
    let max_blocks = if has_64bit {
        (1 << 48) - 1
    } else {
        u64::from(u32::MAX)
    };
    let fine = blocks >= 1
        && blocks <= max_blocks
        && first_data_block == u64::from(log == 0)
        && first_data_block < blocks
        && blocks_per_group == 8 * block_size
        && u64::from(sb.u32(0x24)) == blocks_per_group
        && inode_size >= 128
        && inode_size <= block_size
        && inode_size.is_power_of_two()
        && inodes_per_group >= block_size / inode_size
        && inodes_per_group <= (block_size / inode_size) * (blocks_per_group - 4)
        && inodes_per_group <= 8 * block_size
        && (desc_size == 32 || (has_64bit && desc_size >= 64))
        && desc_size.is_power_of_two()
        && desc_size <= 1024
        && u64::from(sb.u16(0xCE)) <= block_size / 4;
    if !fine {
        return Err("superblock fields out of range");
    }
    let groups = (blocks - first_data_block).div_ceil(blocks_per_group);
    if u64::from(sb.u32(0x00)) != groups * inodes_per_group {
        return Err("the inode count disagrees with the groups");
    }
    let csum_seed = if incompat & INCOMPAT_CSUM_SEED != 0 {
        sb.u32(0x270)
    } else {
        crc32c(!0, sb.raw.get(0x68..0x78).unwrap_or_default())
    };
    Ok(Geometry {
        block_size,
        blocks,
        first_data_block,
        blocks_per_group,
        inodes_per_group,
        inode_size,
        groups,
        desc_size,
        incompat,
        ro_compat,
        csum_seed,
        uuid: sb
            .raw
            .get(0x68..0x78)
            .and_then(|u| u.try_into().ok())
            .unwrap_or_default(),
    })
}

/// The rest of `check_super_block`'s superblock checks that repair in preen (a repair makes
/// e2fsck check the whole filesystem).
fn check_fields(sb: &Super<'_>, g: &Geometry, now: i64) -> Result<(), &'static str> {
    let reserved = sb.wide(0x08, 0x154, g.has_64bit());
    if reserved > g.blocks / 2 {
        return Err("too many reserved blocks");
    }
    let first_ino = u64::from(sb.u32(0x54));
    if first_ino < 11 || first_ino > u64::from(sb.u32(0x00)) {
        return Err("first_ino out of range");
    }
    if g.inode_size > 128 {
        let max = g.inode_size - 128;
        for off in [0x15C, 0x15E] {
            let v = u64::from(sb.u16(off));
            if v != 0 && (v < 4 || v > max || v % 4 != 0) {
                return Err("extra inode size out of range");
            }
        }
    }
    if g.has_64bit() && g.incompat & INCOMPAT_EXTENTS == 0 {
        return Err("64bit without extents");
    }
    if sb
        .raw
        .get(0x68..0x78)
        .is_none_or(|u| u.iter().all(|&b| b == 0))
    {
        return Err("no UUID");
    }
    let flags = sb.u32(0x160);
    if flags & FLAGS_TEST_FILESYS != 0 {
        return Err("the test_fs flag");
    }
    if sb.u32(0x5C) & COMPAT_DIR_INDEX != 0 && flags & FLAGS_HASH_SIGNED_OR_UNSIGNED == 0 {
        return Err("no directory hash hint");
    }
    if sb.u16(0x48) == 1 {
        return Err("a Hurd filesystem");
    }
    if sb.u32(0x44) != 0 && sb.u32(0x40) == 0 {
        return Err("never checked");
    }
    // With a check interval, a last mount or write ahead of the clock is repaired (within
    // the day's fudge too, as a problem of its own).
    if sb.u32(0x44) != 0 && (sb.time(0x2C, 0x275) > now || sb.time(0x30, 0x274) > now) {
        return Err("a last mount or write in the future");
    }
    Ok(())
}

/// Every group descriptor's bytes, `desc_size` each, from the block after the superblock's.
fn group_descriptors(head: &[u8], g: &Geometry, read: Read<'_>) -> Result<Vec<u8>, &'static str> {
    let start = (g.first_data_block + 1) * g.block_size;
    let len = usize::try_from(g.groups)
        .ok()
        .and_then(|n| n.checked_mul(g.desc_size))
        .ok_or("too many groups")?;
    let from = usize::try_from(start).map_err(|_| "too many groups")?;
    if let Some(bytes) = head.get(from..from.saturating_add(len)) {
        return Ok(bytes.to_vec());
    }
    read(start, len)
        .filter(|b| b.len() == len)
        .ok_or("the group descriptors cannot be read")
}

/// One group descriptor's fields.
struct Desc<'a> {
    raw: &'a [u8],
    wide: bool,
}

impl Desc<'_> {
    fn u16(&self, off: usize) -> u16 {
        le16(self.raw, off).unwrap_or(0)
    }
    fn pair32(&self, lo: usize, hi: usize) -> u64 {
        let low = u64::from(le32(self.raw, lo).unwrap_or(0));
        let high = if self.wide {
            u64::from(le32(self.raw, hi).unwrap_or(0))
        } else {
            0
        };
        low | high << 32
    }
    fn pair16(&self, lo: usize, hi: usize) -> u64 {
        let low = u64::from(self.u16(lo));
        let high = if self.wide {
            u64::from(self.u16(hi))
        } else {
            0
        };
        low | high << 16
    }
}

/// `check_super_block`'s loop over the groups: the bitmaps and inode table inside the
/// filesystem (inside their group without flex_bg), counts within a group, each descriptor's
/// checksum, the uninit flags only with checksums and never BLOCK_UNINIT on the last group.
fn check_groups(gdt: &[u8], g: &Geometry) -> Result<(), &'static str> {
    let csum = g.metadata_csum() || g.gdt_csum();
    let flex = g.incompat & 0x200 != 0;
    let wide = g.has_64bit() && g.desc_size >= 64;
    let mut ranges: Vec<(u64, u64)> = Vec::new();
    for (i, raw) in gdt.chunks_exact(g.desc_size).enumerate() {
        let group = i as u64;
        let d = Desc { raw, wide };
        let (first, last) = if flex {
            (g.first_data_block, g.blocks - 1)
        } else {
            let first = g.first_data_block + group * g.blocks_per_group;
            (first, (first + g.blocks_per_group - 1).min(g.blocks - 1))
        };
        let bb = d.pair32(0x00, 0x20);
        let ib = d.pair32(0x04, 0x24);
        let it = d.pair32(0x08, 0x28);
        let it_end = it.saturating_add(g.inode_table_blocks() - 1);
        if bb < first || bb > last || ib < first || ib > last || it < first || it_end > last {
            return Err("a bitmap or inode table outside its group");
        }
        ranges.extend([(bb, bb), (ib, ib), (it, it_end)]);
        let free_blocks = d.pair16(0x0C, 0x2C);
        let free_inodes = d.pair16(0x0E, 0x2E);
        let dirs = d.pair16(0x10, 0x30);
        let unused = d.pair16(0x1C, 0x32);
        if free_blocks > g.blocks_per_group
            || free_inodes > g.inodes_per_group
            || dirs > g.inodes_per_group
        {
            return Err("a group's counts out of range");
        }
        if desc_checksum(g, i as u32, raw).is_some_and(|c| c != d.u16(0x1E)) {
            return Err("a group descriptor's checksum is wrong");
        }
        let flags = d.u16(0x12);
        if !csum && (flags & (BG_BLOCK_UNINIT | BG_INODE_UNINIT) != 0 || unused != 0) {
            return Err("uninit flags without checksums");
        }
        if group == g.groups - 1 && flags & BG_BLOCK_UNINIT != 0 {
            return Err("the last group's block bitmap uninitialised");
        }
        if csum && (unused > free_inodes || unused > g.inodes_per_group) {
            return Err("a group's unused inodes out of range");
        }
    }
    // Opening the filesystem (ext2fs_check_desc) refuses metadata blocks that overlap.
    ranges.sort_unstable();
    if ranges.windows(2).any(|w| w[0].1 >= w[1].0) {
        return Err("group metadata overlaps");
    }
    Ok(())
}

/// A group descriptor's checksum as the filesystem computes it: crc32c's low half with
/// metadata_csum, crc16 with gdt_csum; None without either (nothing to verify).
fn desc_checksum(g: &Geometry, group: u32, raw: &[u8]) -> Option<u16> {
    let group = group.to_le_bytes();
    let (before, after) = (
        raw.get(..0x1E).unwrap_or_default(),
        raw.get(0x20..).unwrap_or_default(),
    );
    if g.metadata_csum() {
        let c = crc32c(g.csum_seed, &group);
        let c = crc32c(crc32c(crc32c(c, before), &[0, 0]), after);
        return Some((c & 0xFFFF) as u16);
    }
    if g.gdt_csum() {
        let c = crc16(crc16(crc16(0xFFFF, &g.uuid), &group), before);
        // The bytes past the checksum count only for 64-byte descriptors (64bit).
        let rest = if g.has_64bit() { after } else { &[] };
        return Some(crc16(c, rest));
    }
    None
}

/// Inode 8, the journal: its superblock unpinned (nothing to replay, no error recorded), its
/// inode sound, its blocks in the inode and matching the superblock's backup of them. A
/// filesystem without a journal names none.
fn check_journal(
    sb: &Super<'_>,
    g: &Geometry,
    compat: u32,
    gdt: &[u8],
    read: Read<'_>,
) -> Result<(), &'static str> {
    let external = sb
        .raw
        .get(0xD0..0xE0)
        .is_some_and(|u| u.iter().any(|&b| b != 0));
    if compat & COMPAT_HAS_JOURNAL == 0 {
        return if sb.u32(0xE0) == 0 && sb.u32(0xE4) == 0 && !external {
            Ok(())
        } else {
            Err("journal fields without a journal")
        };
    }
    if sb.u32(0xE0) != 8 || sb.u32(0xE4) != 0 || external {
        return Err("a journal other than inode 8");
    }
    let wide = g.has_64bit() && g.desc_size >= 64;
    let first = Desc {
        raw: gdt.get(..g.desc_size).ok_or("no group 0")?,
        wide,
    };
    let table = first.pair32(0x08, 0x28);
    let at = table
        .saturating_mul(g.block_size)
        .saturating_add(7 * g.inode_size);
    let isize = usize::try_from(g.inode_size).map_err(|_| "inode size")?;
    let inode = read(at, isize)
        .filter(|b| b.len() == isize)
        .ok_or("the journal inode cannot be read")?;
    let blocks = journal_inode(sb, g, &inode, read)?;
    let jsb = read(blocks.0.saturating_mul(g.block_size), 1024)
        .filter(|b| b.len() == 1024)
        .ok_or("the journal superblock cannot be read")?;
    journal_superblock(&jsb, g, blocks.1)
}

/// The journal inode's checks; its first block and its length in blocks.
fn journal_inode(
    sb: &Super<'_>,
    g: &Geometry,
    inode: &[u8],
    read: Read<'_>,
) -> Result<(u64, u64), &'static str> {
    let u16_at = |off| le16(inode, off).unwrap_or(0);
    let u32_at = |off| le32(inode, off).unwrap_or(0);
    if u16_at(0x00) & 0xF000 != 0x8000 || u16_at(0x1A) == 0 {
        return Err("the journal inode is not a file");
    }
    if g.metadata_csum() && !inode_checksum_ok(g, 8, inode) {
        return Err("the journal inode's checksum is wrong");
    }
    let size = u64::from(u32_at(0x04)) | u64::from(u32_at(0x6C)) << 32;
    let len = size / g.block_size;
    if len < 1024 {
        return Err("the journal is too small");
    }
    // The superblock's backup of the journal inode's block map and size.
    if sb.byte(0xFD) == 1 {
        let same_blocks = (0..15).all(|k| sb.u32(0x10C + 4 * k) == u32_at(0x28 + 4 * k));
        if !same_blocks
            || sb.u32(0x10C + 4 * 15) != u32_at(0x6C)
            || sb.u32(0x10C + 4 * 16) != u32_at(0x04)
        {
            return Err("the journal's backup differs from its inode");
        }
    }
    let start = if u32_at(0x20) & 0x8_0000 != 0 {
        extent_start(g, inode.get(0x28..0x64).unwrap_or_default(), read)?
    } else {
        // Block map (ext3): the first direct pointer is the journal's first block.
        u64::from(u32_at(0x28))
    };
    if start < g.first_data_block || start >= g.blocks {
        return Err("the journal's first block outside the filesystem");
    }
    Ok((start, len))
}

/// The physical block of logical block 0 of a file mapped by extents, from the tree's root
/// (`root`, the inode's 60 bytes of block map): down the first index of each level, to the
/// first extent of the leaf, which must start at logical block 0.
fn extent_start(g: &Geometry, root: &[u8], read: Read<'_>) -> Result<u64, &'static str> {
    let mut node = root.to_vec();
    // A tree is at most 5 levels deep.
    for _ in 0..6 {
        let u16_at = |off| le16(&node, off).unwrap_or(0);
        let u32_at = |off| le32(&node, off).unwrap_or(0);
        if u16_at(0) != 0xF30A || u16_at(2) == 0 || u32_at(12) != 0 {
            return Err("the journal's extent tree");
        }
        if u16_at(6) == 0 {
            if u16_at(16) == 0 || u16_at(16) > 32768 {
                return Err("the journal's first extent");
            }
            return Ok(u64::from(u16_at(18)) << 32 | u64::from(u32_at(20)));
        }
        let leaf = u64::from(u16_at(20)) << 32 | u64::from(u32_at(16));
        if leaf < g.first_data_block || leaf >= g.blocks {
            return Err("the journal's extent tree outside the filesystem");
        }
        let len = usize::try_from(g.block_size).map_err(|_| "block size")?;
        node = read(leaf.saturating_mul(g.block_size), len)
            .filter(|b| b.len() == len)
            .ok_or("the journal's extent tree cannot be read")?;
    }
    Err("the journal's extent tree too deep")
}

/// The journal superblock (big-endian): a v2 journal of this block size, nothing to replay, no
/// error recorded, only features e2fsck knows, its checksum right.
fn journal_superblock(jsb: &[u8], g: &Geometry, len: u64) -> Result<(), &'static str> {
    let be = |off: usize| super::be32(jsb, off).unwrap_or(0);
    if be(0x00) != 0xC03B_3998 || !matches!(be(0x04), 3 | 4) {
        return Err("no journal superblock");
    }
    if u64::from(be(0x0C)) != g.block_size
        || u64::from(be(0x10)) > len
        || be(0x14) == 0
        || be(0x14) >= be(0x10)
    {
        return Err("the journal superblock's geometry");
    }
    if be(0x1C) != 0 {
        return Err("the journal has transactions to replay");
    }
    if be(0x20) != 0 {
        return Err("the journal recorded an error");
    }
    if be(0x04) == 4 {
        let (compat, incompat, ro) = (be(0x24), be(0x28), be(0x2C));
        // revoke, 64bit, async_commit, csum v2, csum v3; no fast commits.
        if compat != 0 || incompat & !0x1F != 0 || ro != 0 {
            return Err("journal features the shortcut does not model");
        }
        if be(0x40) > 1 {
            return Err("journal users of an internal journal");
        }
        if incompat & (0x8 | 0x10) != 0 {
            let mut copy = jsb.to_vec();
            if let Some(c) = copy.get_mut(0xFC..0x100) {
                c.fill(0);
            }
            if jsb.get(0x50) != Some(&4) || crc32c(!0, &copy) != be(0xFC) {
                return Err("the journal superblock's checksum is wrong");
            }
        }
    }
    Ok(())
}

/// An inode's metadata_csum checksum (crc32c of its number, its generation and its bytes with
/// the checksum fields as zeros), against the stored low half and, where it fits, high half.
fn inode_checksum_ok(g: &Geometry, ino: u32, inode: &[u8]) -> bool {
    let (Some(lo), Some(gen_)) = (le16(inode, 0x7C), inode.get(0x64..0x68)) else {
        return false;
    };
    let mut c = crc32c(crc32c(g.csum_seed, &ino.to_le_bytes()), gen_);
    c = crc32c(c, inode.get(..0x7C).unwrap_or_default());
    c = crc32c(c, &[0, 0]);
    c = crc32c(c, inode.get(0x7E..128).unwrap_or_default());
    let mut stored = u32::from(lo);
    let mut mask = 0xFFFF;
    if inode.len() > 128 {
        c = crc32c(c, inode.get(128..0x82).unwrap_or_default());
        let extra = le16(inode, 0x80).unwrap_or(0);
        let hi_fits = 128 + usize::from(extra) >= 0x84;
        let rest = if hi_fits {
            c = crc32c(c, &[0, 0]);
            stored |= u32::from(le16(inode, 0x82).unwrap_or(0)) << 16;
            mask = u32::MAX;
            0x84
        } else {
            0x82
        };
        c = crc32c(c, inode.get(rest..).unwrap_or_default());
    }
    c & mask == stored
}

/// e2fsck's `check_backup_super_block`: the first backup superblock (group 1's) with the same
/// features, size and UUID as the primary. A filesystem of one group has none.
fn check_backup(sb: &Super<'_>, g: &Geometry, read: Read<'_>) -> Result<(), &'static str> {
    if g.groups < 2 {
        return Ok(());
    }
    let at = (g.first_data_block + g.blocks_per_group) * g.block_size;
    let raw = read(at, 1024)
        .filter(|b| b.len() == 1024)
        .ok_or("the backup superblock cannot be read")?;
    let b = Super { raw: &raw };
    let sane = b.u16(0x38) == EXT_MAGIC
        && b.u32(0x4C) <= 1
        && b.u32(0x18) <= 6
        && (b.u32(0x4C) == 0 || b.u16(0x58) >= 128);
    if !sane {
        return Err("the first backup superblock is not one");
    }
    let same = b.u32(0x5C) == sb.u32(0x5C)
        && b.u32(0x60) & !INCOMPAT_BACKUP_IGNORE == sb.u32(0x60) & !INCOMPAT_BACKUP_IGNORE
        && b.u32(0x64) & !RO_COMPAT_BACKUP_IGNORE == sb.u32(0x64) & !RO_COMPAT_BACKUP_IGNORE
        && b.u32(0x04) == sb.u32(0x04)
        && b.u32(0x150) == sb.u32(0x150)
        && b.u32(0x00) == sb.u32(0x00)
        && b.raw.get(0x68..0x78) == sb.raw.get(0x68..0x78);
    if same {
        Ok(())
    } else {
        Err("the primary superblock differs from its backup")
    }
}

/// `check_if_skip`'s last two questions: mounted as often as allowed, or the check interval
/// gone by (or the last check in the future, past the fudge).
fn check_due(sb: &Super<'_>, now: i64) -> Result<(), &'static str> {
    let max = sb.u16(0x36) as i16;
    if max > 0 && sb.u16(0x34) >= max as u16 {
        return Err("mounted as often as allowed without a check");
    }
    let interval = i64::from(sb.u32(0x44));
    if interval != 0 {
        let mut last = sb.time(0x40, 0x277);
        if last > now {
            last -= TIME_FUDGE;
        }
        if now < last {
            return Err("last checked in the future");
        }
        if now - last >= interval {
            return Err("the check interval has gone by");
        }
    }
    Ok(())
}

/// CRC-32C continued from `crc`, no final inversion: the form ext4 and jbd2 store.
#[must_use]
pub fn crc32c(crc: u32, bytes: &[u8]) -> u32 {
    moor_runtime::crc32c::extend(crc, bytes)
}

/// CRC-16 (polynomial 0x8005, reflected), continuing from `crc`: gdt_csum's.
fn crc16(mut crc: u16, bytes: &[u8]) -> u16 {
    for &b in bytes {
        crc = CRC16[((crc ^ u16::from(b)) & 0xFF) as usize] ^ (crc >> 8);
    }
    crc
}

const CRC16: [u16; 256] = {
    let mut t = [0u16; 256];
    let mut i = 0;
    while i < 256 {
        let mut c = i as u16;
        let mut k = 0;
        while k < 8 {
            c = if c & 1 != 0 {
                (c >> 1) ^ 0xA001
            } else {
                c >> 1
            };
            k += 1;
        }
        t[i] = c;
        i += 1;
    }
    t
};
