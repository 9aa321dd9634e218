//! The `:authority` rewriter in front of the gRPC server: any bytes from a client, fed in
//! chunks of a size the first byte picks. It never panics, and every header block it lets
//! through decodes, with no HPACK state of its own, to fields whose `:authority` the server
//! takes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use moor_runtime::authority::{Rewriter, acceptable};

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// The header blocks in the rewritten stream (whole frames only), each decoded afresh.
fn check(out: &[u8]) {
    let Some(mut rest) = out.strip_prefix(PREFACE) else {
        return;
    };
    let mut block = Vec::new();
    while rest.len() >= 9 {
        let len = (usize::from(rest[0]) << 16) | (usize::from(rest[1]) << 8) | usize::from(rest[2]);
        let (kind, flags) = (rest[3], rest[4]);
        let Some(payload) = rest.get(9..9 + len) else {
            return;
        };
        rest = &rest[9 + len..];
        if kind != 0x1 && kind != 0x9 {
            continue;
        }
        let fragment = if kind == 0x1 && flags & 0x20 != 0 {
            &payload[5..]
        } else {
            payload
        };
        assert!(kind != 0x1 || flags & 0x8 == 0, "padding is never written");
        block.extend_from_slice(fragment);
        if flags & 0x4 != 0 {
            let fields = loona_hpack::Decoder::new()
                .decode(&block)
                .expect("a block it writes decodes without HPACK state");
            for (name, value) in fields {
                if name == b":authority" {
                    assert!(acceptable(&value), "{value:?}");
                }
            }
            block.clear();
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&chunk, input)) = data.split_first() else {
        return;
    };
    let mut r = Rewriter::new();
    let mut input = [PREFACE, input].concat();
    if chunk & 0x80 != 0 {
        // Half the runs without the preface: passed through untouched.
        input.drain(..PREFACE.len());
    }
    for piece in input.chunks(usize::from(chunk & 0x7f).max(1)) {
        if r.feed(piece).is_err() {
            break;
        }
    }
    check(r.output());
});
