//! The journal log reader: any bytes replay to records and problems, never a panic; every
//! record it keeps is non-empty and re-encodes to a line the reader takes back as the same,
//! wherever the synced part of the log is said to end. Any bytes as the mark of what is synced
//! decode to a mark that encodes back to itself, or to none.
#![no_main]

use libfuzzer_sys::fuzz_target;
use moor_node::journal;

fuzz_target!(|input: &[u8]| {
    // The first two bytes: where the synced part ends (none with fewer).
    let (durable, data) = match input {
        [a, b, rest @ ..] => (Some(usize::from(u16::from_le_bytes([*a, *b]))), rest),
        _ => (None, input),
    };
    if let Some(mark) = journal::SyncedMark::decode(input) {
        assert_eq!(journal::SyncedMark::decode(&mark.encode()), Some(mark));
    }
    let replayed = journal::replay_after_sync(data, durable);
    assert!(replayed.problems.len() <= replayed.lines);
    assert!(replayed.torn_tail <= data.len());
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
