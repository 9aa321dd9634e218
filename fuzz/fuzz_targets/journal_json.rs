//! Journal record bodies: the input is the JSON of a line whose checksum is made right, so the
//! fuzzer gets past the CRC to the record decoding itself. Any body decodes or is refused,
//! never a panic, and a decoded record round-trips.
#![no_main]

use libfuzzer_sys::fuzz_target;
use moor_node::journal;

fuzz_target!(|body: &[u8]| {
    let mut line = format!("moor-journal v1 {:08x} ", journal::crc32c(body)).into_bytes();
    line.extend_from_slice(body);
    line.push(b'\n');
    if let Ok(record) = journal::decode(&line) {
        let again = journal::decode(&journal::encode(&record));
        assert_eq!(again.ok(), Some(record), "encode/decode round trip");
    }
});
