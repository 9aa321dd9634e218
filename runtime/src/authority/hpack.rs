//! HPACK (RFC 7541) decoding of the header blocks a client sends, with the client's dynamic
//! table: the rewriter's one need of it.
//!
//! Its rules are the server's (h2's) where RFC 7541 leaves a choice, so that a block this
//! decoder takes is one the server would have taken: a dynamic table size update only before
//! the block's first field and never above what the server announced, an integer of at most
//! five octets. Huffman-coded strings are decoded against the canonical code, whose tables are
//! built once, at compile time, from the code lengths: no string allocates more than its
//! output.

use std::collections::VecDeque;

/// Why a header block does not decode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum HpackError {
    /// The block ends inside a representation.
    #[error("the block ends inside a field")]
    Truncated,
    /// An integer of more than five octets.
    #[error("an integer too large")]
    IntegerOverflow,
    /// An index that names no entry (0, or past the dynamic table's end).
    #[error("index {0} names no table entry")]
    BadIndex(usize),
    /// A dynamic table size update after a field, or above what the server allows.
    #[error("a dynamic table size update of {0} where none is allowed")]
    SizeUpdate(usize),
    /// A Huffman-coded string with EOS in it, more than 7 bits of padding, or padding that is
    /// not EOS's first bits.
    #[error("a Huffman-coded string that is malformed")]
    Huffman,
}

/// The static table (RFC 7541 Appendix A): index 1 is the first entry.
const STATIC: [(&[u8], &[u8]); 61] = [
    (b":authority", b""),
    (b":method", b"GET"),
    (b":method", b"POST"),
    (b":path", b"/"),
    (b":path", b"/index.html"),
    (b":scheme", b"http"),
    (b":scheme", b"https"),
    (b":status", b"200"),
    (b":status", b"204"),
    (b":status", b"206"),
    (b":status", b"304"),
    (b":status", b"400"),
    (b":status", b"404"),
    (b":status", b"500"),
    (b"accept-charset", b""),
    (b"accept-encoding", b"gzip, deflate"),
    (b"accept-language", b""),
    (b"accept-ranges", b""),
    (b"accept", b""),
    (b"access-control-allow-origin", b""),
    (b"age", b""),
    (b"allow", b""),
    (b"authorization", b""),
    (b"cache-control", b""),
    (b"content-disposition", b""),
    (b"content-encoding", b""),
    (b"content-language", b""),
    (b"content-length", b""),
    (b"content-location", b""),
    (b"content-range", b""),
    (b"content-type", b""),
    (b"cookie", b""),
    (b"date", b""),
    (b"etag", b""),
    (b"expect", b""),
    (b"expires", b""),
    (b"from", b""),
    (b"host", b""),
    (b"if-match", b""),
    (b"if-modified-since", b""),
    (b"if-none-match", b""),
    (b"if-range", b""),
    (b"if-unmodified-since", b""),
    (b"last-modified", b""),
    (b"link", b""),
    (b"location", b""),
    (b"max-forwards", b""),
    (b"proxy-authenticate", b""),
    (b"proxy-authorization", b""),
    (b"range", b""),
    (b"referer", b""),
    (b"refresh", b""),
    (b"retry-after", b""),
    (b"server", b""),
    (b"set-cookie", b""),
    (b"strict-transport-security", b""),
    (b"transfer-encoding", b""),
    (b"user-agent", b""),
    (b"vary", b""),
    (b"via", b""),
    (b"www-authenticate", b""),
];

/// The Huffman code's length in bits for each symbol, 0 to 255 and EOS (256) (RFC 7541
/// Appendix B). The code is canonical: codes of one length are consecutive in symbol order,
/// and each length's first code follows the last of the shorter ones.
#[rustfmt::skip]
const HUFFMAN_LENGTHS: [u8; 257] = [
    13, 23, 28, 28, 28, 28, 28, 28, 28, 24, 30, 28, 28, 30, 28, 28,
    28, 28, 28, 28, 28, 28, 30, 28, 28, 28, 28, 28, 28, 28, 28, 28,
    6, 10, 10, 12, 13, 6, 8, 11, 10, 10, 8, 11, 8, 6, 6, 6,
    5, 5, 5, 6, 6, 6, 6, 6, 6, 6, 7, 8, 15, 6, 12, 10,
    13, 6, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7,
    7, 7, 7, 7, 7, 7, 7, 7, 8, 7, 8, 13, 19, 13, 14, 6,
    15, 5, 6, 5, 6, 5, 6, 6, 6, 5, 7, 7, 6, 6, 6, 5,
    6, 7, 6, 5, 5, 6, 7, 7, 7, 7, 7, 15, 11, 14, 13, 28,
    20, 22, 20, 20, 22, 22, 22, 23, 22, 23, 23, 23, 23, 23, 24, 23,
    24, 24, 22, 23, 24, 23, 23, 23, 23, 21, 22, 23, 22, 23, 23, 24,
    22, 21, 20, 22, 22, 23, 23, 21, 23, 22, 22, 24, 21, 22, 23, 23,
    21, 21, 22, 21, 23, 22, 23, 23, 20, 22, 22, 22, 23, 22, 22, 23,
    26, 26, 20, 19, 22, 23, 22, 25, 26, 26, 26, 27, 27, 26, 24, 25,
    19, 21, 26, 27, 27, 26, 27, 24, 21, 21, 26, 26, 28, 27, 27, 27,
    20, 24, 20, 21, 22, 21, 21, 23, 22, 22, 25, 25, 24, 24, 26, 23,
    26, 27, 26, 26, 27, 27, 27, 27, 27, 28, 27, 27, 27, 27, 27, 26,
    30,
];

/// The longest code.
const MAX_CODE_LEN: usize = 30;
/// The end-of-string symbol, an error inside a string.
const EOS: u16 = 256;

/// The canonical code's decoding tables: how many codes each length has, and the symbols in
/// code order (by length, then symbol).
struct Canonical {
    count: [u16; MAX_CODE_LEN + 1],
    symbols: [u16; 257],
}

const fn canonical() -> Canonical {
    let mut count = [0u16; MAX_CODE_LEN + 1];
    let mut s = 0;
    while s < HUFFMAN_LENGTHS.len() {
        count[HUFFMAN_LENGTHS[s] as usize] += 1;
        s += 1;
    }
    // Where each length's symbols start in `symbols`.
    let mut next = [0u16; MAX_CODE_LEN + 1];
    let mut len = 1;
    while len < MAX_CODE_LEN {
        next[len + 1] = next[len] + count[len];
        len += 1;
    }
    let mut symbols = [0u16; 257];
    let mut s = 0;
    while s < HUFFMAN_LENGTHS.len() {
        let len = HUFFMAN_LENGTHS[s] as usize;
        symbols[next[len] as usize] = s as u16;
        next[len] += 1;
        s += 1;
    }
    Canonical { count, symbols }
}

const CODE: Canonical = canonical();

/// Appends the Huffman-coded `input`'s octets to `out`.
pub fn huffman_decode(input: &[u8], out: &mut Vec<u8>) -> Result<(), HpackError> {
    // The bits of a code read so far, their number, and the first code of that length with
    // the index of its symbol (canonical decoding, one bit at a time).
    let mut code: u32 = 0;
    let mut len = 0usize;
    let mut first: u32 = 0;
    let mut index: u32 = 0;
    for &byte in input {
        for shift in (0..8).rev() {
            code |= u32::from(byte >> shift) & 1;
            len += 1;
            let count = u32::from(CODE.count[len]);
            if code < first + count {
                let symbol = CODE
                    .symbols
                    .get((index + code - first) as usize)
                    .copied()
                    .ok_or(HpackError::Huffman)?;
                if symbol == EOS {
                    return Err(HpackError::Huffman);
                }
                out.push(symbol as u8);
                (code, len, first, index) = (0, 0, 0, 0);
                continue;
            }
            if len == MAX_CODE_LEN {
                return Err(HpackError::Huffman);
            }
            index += count;
            first = (first + count) << 1;
            code <<= 1;
        }
    }
    // What is left is padding: at most 7 bits, all ones (EOS's first bits). `code` holds the
    // bits read, shifted once more.
    if len > 7 || (len > 0 && code >> 1 != (1 << len) - 1) {
        return Err(HpackError::Huffman);
    }
    Ok(())
}

/// The HPACK cost of an entry: its octets and 32.
fn entry_size(name: &[u8], value: &[u8]) -> usize {
    name.len() + value.len() + 32
}

/// A dynamic table entry: a name and a value.
type Entry = (Box<[u8]>, Box<[u8]>);

/// A header block decoder that keeps the client's dynamic table across blocks.
#[derive(Debug, Clone)]
pub struct Decoder {
    /// The dynamic table, newest first (index 62 is its front).
    table: VecDeque<Entry>,
    /// Its size in HPACK's terms.
    size: usize,
    /// Its largest size now.
    max: usize,
    /// The largest size the server allows a client to set.
    allowed: usize,
}

/// A block being read.
struct Reader<'a> {
    rest: &'a [u8],
}

impl<'a> Reader<'a> {
    fn byte(&mut self) -> Result<u8, HpackError> {
        let (&b, rest) = self.rest.split_first().ok_or(HpackError::Truncated)?;
        self.rest = rest;
        Ok(b)
    }

    /// An integer with an `n`-bit prefix (RFC 7541 5.1), at most five octets (as the server
    /// reads one).
    fn integer(&mut self, n: u32) -> Result<usize, HpackError> {
        let max = (1usize << n) - 1;
        let mut value = usize::from(self.byte()?) & max;
        if value < max {
            return Ok(value);
        }
        for shift in [0, 7, 14, 21] {
            let b = self.byte()?;
            value += usize::from(b & 0x7f) << shift;
            if b & 0x80 == 0 {
                return Ok(value);
            }
        }
        Err(HpackError::IntegerOverflow)
    }

    /// A string literal (RFC 7541 5.2): its raw octets, or decoded into `buf`.
    fn string<'b>(&mut self, buf: &'b mut Vec<u8>) -> Result<&'b [u8], HpackError>
    where
        'a: 'b,
    {
        let huffman = self.rest.first().is_some_and(|b| b & 0x80 != 0);
        let len = self.integer(7)?;
        if len > self.rest.len() {
            return Err(HpackError::Truncated);
        }
        let (raw, rest) = self.rest.split_at(len);
        self.rest = rest;
        if huffman {
            buf.clear();
            huffman_decode(raw, buf)?;
            Ok(buf.as_slice())
        } else {
            Ok(raw)
        }
    }
}

impl Decoder {
    /// A decoder at the start of a connection, for a server that allows a dynamic table of
    /// `allowed` octets (its SETTINGS_HEADER_TABLE_SIZE).
    pub fn new(allowed: usize) -> Self {
        Self {
            table: VecDeque::new(),
            size: 0,
            max: allowed,
            allowed,
        }
    }

    /// The entry at `index` (1-based, static then dynamic).
    fn entry(&self, index: usize) -> Result<(&[u8], &[u8]), HpackError> {
        if let Some(&(name, value)) = index.checked_sub(1).and_then(|i| STATIC.get(i)) {
            return Ok((name, value));
        }
        index
            .checked_sub(STATIC.len() + 1)
            .and_then(|i| self.table.get(i))
            .map(|(n, v)| (&n[..], &v[..]))
            .ok_or(HpackError::BadIndex(index))
    }

    fn evict_to(&mut self, limit: usize) {
        while self.size > limit {
            let Some((n, v)) = self.table.pop_back() else {
                self.size = 0;
                return;
            };
            self.size -= entry_size(&n, &v);
        }
    }

    /// Adds an entry (RFC 7541 4.4): one larger than the table empties it.
    fn insert(&mut self, name: &[u8], value: &[u8]) {
        let size = entry_size(name, value);
        if size > self.max {
            self.table.clear();
            self.size = 0;
            return;
        }
        self.evict_to(self.max - size);
        self.table.push_front((name.into(), value.into()));
        self.size += size;
    }

    /// Decodes one whole header block, handing each field to `field` in order. On an error the
    /// table may hold part of the block's entries: the connection ends then.
    pub fn decode(
        &mut self,
        block: &[u8],
        mut field: impl FnMut(&[u8], &[u8]),
    ) -> Result<(), HpackError> {
        let mut r = Reader { rest: block };
        let mut name_buf = Vec::new();
        let mut value_buf = Vec::new();
        let mut fields_seen = false;
        while let Some(&first) = r.rest.first() {
            if first & 0x80 != 0 {
                // Indexed field.
                let index = r.integer(7)?;
                let (name, value) = self.entry(index)?;
                field(name, value);
            } else if first & 0xe0 == 0x20 {
                // Dynamic table size update.
                let size = r.integer(5)?;
                if fields_seen || size > self.allowed {
                    return Err(HpackError::SizeUpdate(size));
                }
                self.max = size;
                self.evict_to(size);
                continue;
            } else {
                // A literal: with incremental indexing (01), without (0000) or never (0001).
                let indexing = first & 0x40 != 0;
                let index = r.integer(if indexing { 6 } else { 4 })?;
                let name: &[u8] = if index == 0 {
                    r.string(&mut name_buf)?
                } else {
                    let (name, _) = self.entry(index)?;
                    name_buf.clear();
                    name_buf.extend_from_slice(name);
                    &name_buf
                };
                let value = r.string(&mut value_buf)?;
                field(name, value);
                if indexing {
                    self.insert(name, value);
                }
            }
            fields_seen = true;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
