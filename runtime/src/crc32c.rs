//! CRC-32C (Castagnoli), eight bytes per step: the node journal's record checksum, and the
//! checksums ext4 and its journal keep of their metadata (which the node verifies before it
//! leaves e2fsck out).

/// CRC-32C (Castagnoli) tables for slicing-by-8, computed at compile time: `CRC_TABLES[0]` is
/// the byte-at-a-time table, `CRC_TABLES[k][b]` the CRC of byte `b` followed by `k` zero bytes.
const CRC_TABLES: [[u32; 256]; 8] = {
    let mut tables = [[0u32; 256]; 8];
    let mut i = 0;
    while i < 256 {
        let mut c = i as u32;
        let mut k = 0;
        while k < 8 {
            c = if c & 1 != 0 {
                0x82F6_3B78 ^ (c >> 1)
            } else {
                c >> 1
            };
            k += 1;
        }
        tables[0][i] = c;
        i += 1;
    }
    let mut t = 1;
    while t < 8 {
        let mut i = 0;
        while i < 256 {
            let prev = tables[t - 1][i];
            tables[t][i] = (prev >> 8) ^ tables[0][(prev & 0xFF) as usize];
            i += 1;
        }
        t += 1;
    }
    tables
};

/// One table lookup (the index is masked to a byte, so it is always in range).
fn crc_lookup(table: usize, index: u32) -> u32 {
    CRC_TABLES[table & 7][(index & 0xFF) as usize]
}

/// The CRC of `data` continued from `crc`, without the final inversion: ext4 and jbd2 store
/// it so (seeded with `!0` or a checksum seed); a plain CRC-32C is `!extend(!0, data)`.
#[must_use]
pub fn extend(mut crc: u32, data: &[u8]) -> u32 {
    let mut words = data.chunks_exact(8);
    for w in words.by_ref() {
        let lo = u32::from_le_bytes([w[0], w[1], w[2], w[3]]) ^ crc;
        let hi = u32::from_le_bytes([w[4], w[5], w[6], w[7]]);
        crc = crc_lookup(7, lo)
            ^ crc_lookup(6, lo >> 8)
            ^ crc_lookup(5, lo >> 16)
            ^ crc_lookup(4, lo >> 24)
            ^ crc_lookup(3, hi)
            ^ crc_lookup(2, hi >> 8)
            ^ crc_lookup(1, hi >> 16)
            ^ crc_lookup(0, hi >> 24);
    }
    for &b in words.remainder() {
        crc = crc_lookup(0, crc ^ u32::from(b)) ^ (crc >> 8);
    }
    crc
}
