//! The CSI spec's limits on request fields, checked the same way by the node and the
//! controller. Each check says why a value is refused, or nothing; the caller names the field
//! and turns the reason into its own INVALID_ARGUMENT.

use std::collections::HashMap;

/// Longest id or name: the spec's general limit for strings.
pub const MAX_STRING_LEN: usize = 128;
/// Longest node id: the spec raises the general limit to 192 bytes for node ids.
pub const MAX_NODE_ID_LEN: usize = 192;
/// Most bytes in all keys and values of one map: the spec's 4 KiB for maps.
pub const MAX_MAP_BYTES: usize = 4096;
/// Longest stretch of user input quoted in an error.
pub const QUOTE_LEN: usize = 64;

/// Why `raw` is not an acceptable id of at most `max` bytes: unset, too long, or holding a
/// control character (a NUL, a line break, an escape: nothing an id needs and much a log or a
/// path should never see).
#[must_use]
pub fn id_problem(raw: &str, max: usize) -> Option<String> {
    if raw.is_empty() {
        Some("must be set".into())
    } else if raw.len() > max {
        Some(format!("longer than {max} bytes"))
    } else if raw.chars().any(char::is_control) {
        Some("contains control characters".into())
    } else {
        None
    }
}

/// Why `map` is refused: its keys and values add up to more than [`MAX_MAP_BYTES`]. The
/// contents are never quoted (a map may hold secrets).
#[must_use]
pub fn map_problem(map: &HashMap<String, String>) -> Option<String> {
    let bytes: usize = map.iter().map(|(k, v)| k.len() + v.len()).sum();
    (bytes > MAX_MAP_BYTES).then(|| format!("larger than {MAX_MAP_BYTES} bytes"))
}

/// Longest topology segment value: a Kubernetes label value's 63 characters, as the spec has
/// it.
pub const MAX_TOPOLOGY_VALUE_LEN: usize = 63;

/// Whether `s` may be a topology segment value: 1 to 63 characters, alphanumerics and `-_.`,
/// beginning and ending with an alphanumeric.
#[must_use]
pub fn is_topology_value(s: &str) -> bool {
    let edge = |c: Option<char>| c.is_some_and(|c| c.is_ascii_alphanumeric());
    s.len() <= MAX_TOPOLOGY_VALUE_LEN
        && edge(s.chars().next())
        && edge(s.chars().last())
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

/// This node's topology segment value for `node_id`, which the node and the controller must
/// compute alike: the id itself when it is a valid value; otherwise (a Kubernetes node name
/// may be 253 characters long) its start, with characters a value cannot hold made `-`,
/// followed by a hash of the whole id, so that distinct ids keep distinct values.
#[must_use]
pub fn topology_value(node_id: &str) -> String {
    if is_topology_value(node_id) {
        return node_id.to_string();
    }
    // FNV-1a, 64 bits: stable across builds and platforms.
    let hash = node_id.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    let keep = MAX_TOPOLOGY_VALUE_LEN - 17;
    let start: String = node_id
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.') {
                c
            } else {
                '-'
            }
        })
        .take(keep)
        .collect();
    let start = start.trim_matches(|c: char| !c.is_ascii_alphanumeric());
    if start.is_empty() {
        format!("{hash:016x}")
    } else {
        format!("{start}-{hash:016x}")
    }
}

/// The start of `s`, at most [`QUOTE_LEN`] bytes cut at a character boundary: user input as
/// an error quotes it.
#[must_use]
pub fn trunc(s: &str) -> &str {
    let mut end = s.len().min(QUOTE_LEN);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s.get(..end).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn topology_values_are_valid_label_values() {
        for id in ["node-1", "ip-10-0-0-1.ec2.internal", "a", "N_1"] {
            assert_eq!(topology_value(id), id);
        }
        let long = format!("{}.example.com", "n".repeat(200));
        let other = format!("{}.example.org", "n".repeat(200));
        for id in [
            long.as_str(),
            other.as_str(),
            "node-",
            "-node",
            "é",
            "a b",
            "--",
        ] {
            let v = topology_value(id);
            assert!(is_topology_value(&v), "{id:?} -> {v:?}");
            assert_eq!(v, topology_value(id), "stable");
        }
        assert_ne!(topology_value(&long), topology_value(&other));
        assert!(topology_value(&long).starts_with("nnnn"));
        assert_eq!(topology_value("a b").len(), "a-b-".len() + 16);
        assert!(!is_topology_value(""));
        assert!(!is_topology_value(&"x".repeat(64)));
        assert!(is_topology_value(&"x".repeat(63)));
    }

    #[test]
    fn ids() {
        assert_eq!(id_problem("pvc-1", MAX_STRING_LEN), None);
        assert_eq!(id_problem("", 8).as_deref(), Some("must be set"));
        assert_eq!(
            id_problem(&"x".repeat(9), 8).as_deref(),
            Some("longer than 8 bytes")
        );
        assert_eq!(id_problem(&"x".repeat(8), 8), None);
        for bad in ["a\0b", "a\nb", "a\u{1b}b", "a\u{85}b", "a\u{7f}"] {
            assert_eq!(
                id_problem(bad, 8).as_deref(),
                Some("contains control characters"),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn maps() {
        let mut m = HashMap::new();
        m.insert("k".repeat(2000), "v".repeat(2096));
        assert_eq!(map_problem(&m), None);
        m.insert("x".into(), String::new());
        assert_eq!(map_problem(&m).as_deref(), Some("larger than 4096 bytes"));
    }

    #[test]
    fn trunc_respects_char_boundaries() {
        let s = "é".repeat(40);
        assert!(trunc(&s).len() <= QUOTE_LEN);
        assert!(s.starts_with(trunc(&s)));
        assert_eq!(trunc("abc"), "abc");
    }
}
