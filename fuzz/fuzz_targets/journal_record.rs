//! Journal record decoding: any bytes decode to a record or an error, never a panic, and a
//! decoded record encodes to bytes that decode to the same record.
#![no_main]

use libfuzzer_sys::fuzz_target;
use moor_node::journal;

fuzz_target!(|data: &[u8]| {
    if let Ok(record) = journal::decode(data) {
        let again = journal::decode(&journal::encode(&record));
        assert_eq!(again.ok(), Some(record), "encode/decode round trip");
    }
});
