//! The superblock probe: any head, tail and device size classify without a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use moor_node::superblock;

fuzz_target!(|data: &[u8]| {
    // Layout: 8 bytes of device size, 4 bytes of split point, then head and tail.
    let (size, rest) = data.split_at_checked(8).unwrap_or((&[0; 8], data));
    let device_size = u64::from_le_bytes(size.try_into().unwrap_or([0; 8]));
    let (split, rest) = rest.split_at_checked(4).unwrap_or((&[0; 4], rest));
    let split = u32::from_le_bytes(split.try_into().unwrap_or([0; 4])) as usize;
    let (head, tail) = rest.split_at(split.min(rest.len()));
    let content = superblock::probe(head, tail, device_size);
    let _ = content.describe();
    let _ = content.is_blank();
    // The whole input as a head, with the device exactly as long as it.
    let _ = superblock::probe(data, data, data.len() as u64);
    let _ = superblock::probe(data, &[], device_size);
    if let Some(c) = superblock::probe_quick(data) {
        let _ = c.describe();
    }
    // The far blocks of a blank proof, at any offset.
    let _ = superblock::confirm_blank(&[(device_size, head), (u64::MAX, tail)]).describe();
});
