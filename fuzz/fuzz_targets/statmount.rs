//! The `struct statmount` decoder: any buffer decodes to a mount or an error, never a panic
//! or a read outside the buffer.
#![no_main]

use libfuzzer_sys::fuzz_target;
use moor_node::sys::mount_table::{HEADER_LEN, parse_statmount};

fuzz_target!(|data: &[u8]| {
    // Most inputs are shorter than the header: pad them so the string area is reached too.
    let mut buf = data.to_vec();
    if buf.len() < HEADER_LEN + 64 {
        buf.resize(HEADER_LEN + 64, 0);
    }
    if let Ok(m) = parse_statmount(&buf) {
        assert!(m.mount_point.as_os_str().len() < buf.len());
    }
    let _ = parse_statmount(data);
});
