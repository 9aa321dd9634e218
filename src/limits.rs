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
