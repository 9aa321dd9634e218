use super::*;
use crate::authority::encode_integer as integer;

type Fields = Vec<(Vec<u8>, Vec<u8>)>;

fn decode(d: &mut Decoder, block: &[u8]) -> Result<Fields, HpackError> {
    let mut fields = Vec::new();
    d.decode(block, |n, v| fields.push((n.to_vec(), v.to_vec())))?;
    Ok(fields)
}

fn reference(d: &mut loona_hpack::Decoder<'_>, block: &[u8]) -> Fields {
    d.decode(block)
        .expect("the reference decoder takes the block")
}

fn fields(list: &[(&str, &str)]) -> Fields {
    list.iter()
        .map(|(n, v)| (n.as_bytes().to_vec(), v.as_bytes().to_vec()))
        .collect()
}

/// The canonical code of each symbol, from the code lengths alone.
fn codes() -> Vec<(u32, u8)> {
    let mut order: Vec<usize> = (0..HUFFMAN_LENGTHS.len()).collect();
    order.sort_by_key(|&s| (HUFFMAN_LENGTHS[s], s));
    let mut codes = vec![(0u32, 0u8); HUFFMAN_LENGTHS.len()];
    let mut code = 0u32;
    let mut prev = HUFFMAN_LENGTHS[order[0]];
    for (i, &s) in order.iter().enumerate() {
        let len = HUFFMAN_LENGTHS[s];
        if i > 0 {
            code = (code + 1) << (len - prev);
        }
        prev = len;
        codes[s] = (code, len);
    }
    codes
}

fn huffman_encode(s: &[u8]) -> Vec<u8> {
    let codes = codes();
    let mut out = Vec::new();
    let (mut acc, mut bits) = (0u64, 0u32);
    for &b in s {
        let (code, len) = codes[usize::from(b)];
        acc = (acc << len) | u64::from(code);
        bits += u32::from(len);
        while bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
        }
    }
    if bits > 0 {
        // Padding: EOS's first bits, all ones.
        out.push(((acc << (8 - bits)) as u8) | ((1u8 << (8 - bits)) - 1));
    }
    out
}

fn string(out: &mut Vec<u8>, s: &[u8], huffman: bool) {
    if huffman {
        let coded = huffman_encode(s);
        integer(out, 0x80, 7, coded.len());
        out.extend_from_slice(&coded);
    } else {
        crate::authority::encode_string(out, s);
    }
}

fn hex(s: &str) -> Vec<u8> {
    let s: String = s.split_whitespace().collect();
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

#[test]
fn the_code_is_canonical_and_complete() {
    // Kraft's sum is exactly 1: every string of bits starts with a code.
    let sum: u64 = HUFFMAN_LENGTHS
        .iter()
        .map(|&l| 1u64 << (MAX_CODE_LEN - usize::from(l)))
        .sum();
    assert_eq!(sum, 1 << MAX_CODE_LEN);
    // EOS is thirty ones, the last code.
    assert_eq!(codes()[256], ((1 << 30) - 1, 30));
    // Codes the RFC lists: '0' 00000, ' ' 010100, 'a' 00011, 255 11111111111111111111101110.
    assert_eq!(codes()[usize::from(b'0')], (0, 5));
    assert_eq!(codes()[usize::from(b' ')], (0x14, 6));
    assert_eq!(codes()[usize::from(b'a')], (0x3, 5));
    assert_eq!(codes()[255], (0x3ff_ffee, 26));
}

/// RFC 7541 Appendix C.4: three requests with Huffman-coded strings on one connection.
#[test]
fn the_rfc_requests_decode() {
    let blocks = [
        hex("8286 8441 8cf1 e3c2 e5f2 3a6b a0ab 90f4 ff"),
        hex("8286 84be 5886 a8eb 1064 9cbf"),
        hex("8287 85bf 4088 25a8 49e9 5ba9 7d7f 8925 a849 e95b b8e8 b4bf"),
    ];
    let expected = [
        fields(&[
            (":method", "GET"),
            (":scheme", "http"),
            (":path", "/"),
            (":authority", "www.example.com"),
        ]),
        fields(&[
            (":method", "GET"),
            (":scheme", "http"),
            (":path", "/"),
            (":authority", "www.example.com"),
            ("cache-control", "no-cache"),
        ]),
        fields(&[
            (":method", "GET"),
            (":scheme", "https"),
            (":path", "/index.html"),
            (":authority", "www.example.com"),
            ("custom-key", "custom-value"),
        ]),
    ];
    let mut d = Decoder::new(4096);
    let mut r = loona_hpack::Decoder::new();
    for (block, want) in blocks.iter().zip(&expected) {
        assert_eq!(&decode(&mut d, block).unwrap(), want);
        assert_eq!(&reference(&mut r, block), want);
    }
    // The dynamic table the RFC shows after the third: three entries, 164 octets.
    assert_eq!(d.size, 164);
    assert_eq!(d.table.len(), 3);
    assert_eq!(&*d.table[0].0, b"custom-key");
}

#[test]
fn every_octet_goes_through_huffman() {
    let all: Vec<u8> = (0..=255).collect();
    let mut out = Vec::new();
    huffman_decode(&huffman_encode(&all), &mut out).unwrap();
    assert_eq!(out, all);
    // The reference agrees on the code.
    let mut block = vec![0x00];
    string(&mut block, b"x", false);
    string(&mut block, &all, true);
    assert_eq!(
        reference(&mut loona_hpack::Decoder::new(), &block),
        vec![(b"x".to_vec(), all)]
    );
}

#[test]
fn malformed_huffman_is_refused() {
    let ok = |bytes: &[u8]| {
        let mut out = Vec::new();
        huffman_decode(bytes, &mut out).map(|()| out)
    };
    // 'a' (00011) and three bits of padding, all ones.
    assert_eq!(ok(&[0x1f]), Ok(b"a".to_vec()));
    assert_eq!(ok(&[]), Ok(Vec::new()));
    // Padding that is not EOS's first bits.
    assert_eq!(ok(&[0x1a]), Err(HpackError::Huffman));
    // Eleven bits of padding (more than 7).
    assert_eq!(ok(&[0x1f, 0xff]), Err(HpackError::Huffman));
    // A whole byte of padding alone.
    assert_eq!(ok(&[0xff]), Err(HpackError::Huffman));
    // EOS inside the string.
    assert_eq!(ok(&[0xff, 0xff, 0xff, 0xff]), Err(HpackError::Huffman));
}

#[test]
fn malformed_blocks_are_refused() {
    let err = |block: &[u8]| decode(&mut Decoder::new(4096), block).unwrap_err();
    assert_eq!(err(&[0x80]), HpackError::BadIndex(0));
    assert_eq!(err(&[0x80 | 62]), HpackError::BadIndex(62));
    let mut literal = Vec::new();
    integer(&mut literal, 0x40, 6, 63);
    assert_eq!(err(&literal), HpackError::BadIndex(63));
    // A string longer than the block.
    assert_eq!(err(&[0x00, 0x05, b'a']), HpackError::Truncated);
    assert_eq!(err(&[0x00]), HpackError::Truncated);
    assert_eq!(err(&[0xff]), HpackError::Truncated);
    // An integer of six octets.
    assert_eq!(
        err(&[0xff, 0xff, 0xff, 0xff, 0xff, 0x01]),
        HpackError::IntegerOverflow
    );
    // A size update after a field, and one above what the server allows.
    assert_eq!(err(&[0x82, 0x20]), HpackError::SizeUpdate(0));
    let mut above = Vec::new();
    integer(&mut above, 0x20, 5, 4097);
    assert_eq!(err(&above), HpackError::SizeUpdate(4097));
    // Two at the block's start are allowed (RFC 7541 4.2).
    let mut two = Vec::new();
    integer(&mut two, 0x20, 5, 0);
    integer(&mut two, 0x20, 5, 4096);
    two.push(0x82);
    assert_eq!(
        decode(&mut Decoder::new(4096), &two).unwrap(),
        fields(&[(":method", "GET")])
    );
}

#[test]
fn the_table_evicts_oldest_first_and_keeps_a_name_it_evicts() {
    let mut d = Decoder::new(4096);
    // A table of 80 octets: two entries of 37 fit, a third evicts the first.
    let mut block = Vec::new();
    integer(&mut block, 0x20, 5, 80);
    for (n, v) in [("name", "1"), ("name", "2")] {
        block.push(0x40);
        string(&mut block, n.as_bytes(), false);
        string(&mut block, v.as_bytes(), true);
    }
    decode(&mut d, &block).unwrap();
    assert_eq!(d.size, 74);
    // A literal that names entry 63 (the oldest) and whose insertion evicts it.
    let mut block = Vec::new();
    integer(&mut block, 0x40, 6, 63);
    string(&mut block, b"3", false);
    block.push(0x80 | 62);
    block.push(0x80 | 63);
    assert_eq!(
        decode(&mut d, &block).unwrap(),
        fields(&[("name", "3"), ("name", "3"), ("name", "2")])
    );
    assert_eq!(d.size, 74);
    assert_eq!(decode(&mut d, &[0x80 | 64]), Err(HpackError::BadIndex(64)));
    // An entry larger than the table empties it.
    let mut block = vec![0x40];
    string(&mut block, b"big", false);
    string(&mut block, &[b'v'; 60], false);
    decode(&mut d, &block).unwrap();
    assert_eq!((d.size, d.table.len()), (0, 0));
    assert_eq!(decode(&mut d, &[0x80 | 62]), Err(HpackError::BadIndex(62)));
}

/// A small deterministic generator (xorshift64*).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn bytes(&mut self) -> Vec<u8> {
        let len = match self.below(4) {
            0 => 0,
            1 => self.below(8),
            2 => self.below(40),
            _ => self.below(200),
        };
        let printable = self.below(2) == 0;
        (0..len)
            .map(|_| {
                if printable {
                    b"abcdefghijklmnopqrstuvwxyz0123456789-/._:"[self.below(41)]
                } else {
                    self.next() as u8
                }
            })
            .collect()
    }
}

/// How many dynamic entries a decoder would hold after `block` (a valid prefix of one).
fn dynamic_after(d: &Decoder, block: &[u8]) -> usize {
    let mut shadow = d.clone();
    decode(&mut shadow, block).expect("the block so far decodes");
    shadow.table.len()
}

/// Blocks of every representation, string kind and table size, on connections of many blocks:
/// the reference decoder reads each to the same fields.
#[test]
fn random_connections_decode_as_the_reference_does() {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    for _ in 0..100 {
        let mut d = Decoder::new(4096);
        let mut r = loona_hpack::Decoder::new();
        for _ in 0..8 {
            let mut block = Vec::new();
            if rng.below(4) == 0 {
                let size = [0, 40, 100, 300, 4096][rng.below(5)];
                integer(&mut block, 0x20, 5, size);
            }
            for _ in 0..1 + rng.below(12) {
                // An index into the static table, or the dynamic one as it is at this field.
                let dynamic = dynamic_after(&d, &block);
                let index = if dynamic > 0 && rng.below(3) == 0 {
                    STATIC.len() + 1 + rng.below(dynamic)
                } else {
                    1 + rng.below(STATIC.len())
                };
                let (first, n) = match rng.below(5) {
                    0 => {
                        integer(&mut block, 0x80, 7, index);
                        continue;
                    }
                    1 | 2 => (0x40, 6),
                    3 => (0x00, 4),
                    _ => (0x10, 4),
                };
                if rng.below(2) == 0 {
                    integer(&mut block, first, n, index);
                } else {
                    integer(&mut block, first, n, 0);
                    string(&mut block, &rng.bytes(), rng.below(2) == 0);
                }
                string(&mut block, &rng.bytes(), rng.below(2) == 0);
            }
            let want = reference(&mut r, &block);
            assert_eq!(decode(&mut d, &block).unwrap(), want, "{block:02x?}");
            let size: usize = d.table.iter().map(|(n, v)| entry_size(n, v)).sum();
            assert_eq!(d.size, size);
            assert!(d.size <= d.max);
        }
    }
}
