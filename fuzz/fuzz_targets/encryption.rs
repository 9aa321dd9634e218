//! An encrypted volume's texts: StorageClass parameters as `key=value` lines are split into
//! the encryption and the rest or refused, and an accepted encryption's explicit parameters
//! split back to it; the whole input as a wrapped data key decodes or is refused, a decoded
//! one encodes back to what decodes the same, and unwrapping it never panics; the input's
//! lines as CSI secrets give a KEK or a refusal.
#![no_main]

use libfuzzer_sys::fuzz_target;
use moor_controller::backend::Parameters;
use moor_controller::encryption;
use moor_runtime::keys::{Kek, WrappedDek, kek_from_secret};

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let pairs: Vec<(String, String)> = text
        .split('\n')
        .map(|line| match line.split_once('=') {
            Some((k, v)) => (k.to_string(), v.to_string()),
            None => (line.to_string(), String::new()),
        })
        .collect();
    let params: Parameters = pairs.iter().cloned().collect();
    if let Ok((Some(e), rest)) = encryption::split(&params) {
        let taken = e.parameters();
        assert!(rest.keys().all(|k| !taken.contains_key(k)), "{rest:?}");
        let (again, _) = encryption::split(&taken).expect("its own parameters");
        assert_eq!(again, Some(e));
    }
    if let Ok(wrapped) = WrappedDek::decode(&text) {
        let round = WrappedDek::decode(&wrapped.encode()).expect("its own text");
        assert_eq!(round, wrapped);
        let kek = Kek::new(wrapped.kek_id(), &[7; 32]).expect("a kek");
        let _ = kek.unwrap(&wrapped, "vol-1");
    }
    let _ = kek_from_secret(|k| {
        pairs
            .iter()
            .find(|(key, _)| key == k)
            .map(|(_, v)| v.as_str())
    });
});
