//! The rewriter's HPACK decoder: any bytes as the header blocks of one connection (the first
//! byte picks where they are cut into blocks). It never panics, and a block that both it and
//! the reference decoder (loona-hpack) take decodes to the same fields in both, as long as both
//! took every block before it.
#![no_main]

use libfuzzer_sys::fuzz_target;
use moor_runtime::authority::hpack::Decoder;

fuzz_target!(|data: &[u8]| {
    let Some((&cut, input)) = data.split_first() else {
        return;
    };
    let mut ours = Decoder::new(4096);
    let mut reference = loona_hpack::Decoder::new();
    for block in input.chunks(usize::from(cut).max(1)) {
        let mut fields = Vec::new();
        let mine = ours.decode(block, |n, v| fields.push((n.to_vec(), v.to_vec())));
        let theirs = reference.decode(block);
        match (mine, theirs) {
            (Ok(()), Ok(want)) => assert_eq!(fields, want),
            // Either refused it: the connection would end here.
            _ => return,
        }
    }
});
