//! Mount option parsing: any list of flags for any filesystem parses or is refused, never a
//! panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use moor_node::mount_options;
use moor_runtime::contract::Filesystem;

const FILESYSTEMS: [Filesystem; 5] = [
    Filesystem::Ext2,
    Filesystem::Ext3,
    Filesystem::Ext4,
    Filesystem::Xfs,
    Filesystem::Btrfs,
];

fuzz_target!(|data: &[u8]| {
    let Some((&selector, rest)) = data.split_first() else {
        return;
    };
    let fs = FILESYSTEMS[usize::from(selector) % FILESYSTEMS.len()];
    // One flag per line; a flag may itself hold commas.
    let flags: Vec<String> = rest
        .split(|b| *b == b'\n')
        .map(|f| String::from_utf8_lossy(f).into_owned())
        .collect();
    if let Err(e) = mount_options::parse(&flags, fs) {
        let _ = e.to_string();
    }
});
