//! The journal log reader: any bytes replay to records and problems, never a panic; every
//! record it keeps is non-empty and re-encodes to a line the reader takes back as the same.
#![no_main]

use libfuzzer_sys::fuzz_target;
use moor_node::journal;

fuzz_target!(|data: &[u8]| {
    let replayed = journal::replay(data);
    assert!(replayed.problems.len() <= replayed.lines);
    let mut again = Vec::new();
    for (id, record) in &replayed.records {
        assert_eq!(id, &record.volume_id);
        assert!(
            !record.is_empty(),
            "an empty record is a deletion, never kept"
        );
        again.extend(journal::encode(record));
    }
    let second = journal::replay(&again);
    assert!(second.problems.is_empty());
    assert_eq!(
        second.records, replayed.records,
        "a compacted log replays the same"
    );
});
