//! The mount table parser: any bytes parse to mounts or to an error naming the line, never a
//! panic; every parsed mount's fields are usable.
#![no_main]

use libfuzzer_sys::fuzz_target;
use moor_node::sys::mountinfo;

fuzz_target!(|data: &[u8]| {
    if let Ok(mounts) = mountinfo::parse(data) {
        for m in &mounts {
            let _ = m.is_read_only();
            let _ = m.dev();
        }
    }
    for line in data.split(|b| *b == b'\n') {
        let _ = mountinfo::parse_line(line);
        let _ = mountinfo::unescape(line);
    }
});
