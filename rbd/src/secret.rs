//! A cephx key that never shows in Debug or Display output, and is overwritten in memory
//! when dropped (best effort: librados keeps its own copy while connected).

use std::fmt;

/// A cephx secret key (the base64 text of a keyring's `key = …`).
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    /// Wraps a key; surrounding whitespace (a trailing newline from a file) is dropped.
    pub fn new(key: impl Into<String>) -> Secret {
        let key = key.into();
        let trimmed = key.trim();
        if trimmed.len() == key.len() {
            return Secret(key);
        }
        let kept = trimmed.to_owned();
        wipe(key);
        Secret(kept)
    }

    /// The key from a keyring file's text: the `key = …` line of section `[client.USER]`, or
    /// of the only section when there is one. None when there is no such key.
    pub fn from_keyring(text: &str, user: &str) -> Option<Secret> {
        let wanted = format!("[client.{user}]");
        let mut sections = 0;
        let mut in_wanted = false;
        let mut only_key = None;
        for line in text.lines().map(str::trim) {
            if line.starts_with('[') {
                sections += 1;
                in_wanted = line == wanted;
                continue;
            }
            let Some((name, value)) = line.split_once('=') else {
                continue;
            };
            if name.trim() != "key" {
                continue;
            }
            if in_wanted {
                return Some(Secret::new(value.trim()));
            }
            only_key.get_or_insert_with(|| Secret::new(value.trim()));
        }
        if sections <= 1 { only_key } else { None }
    }

    /// The key itself, for handing to librados.
    pub(crate) fn expose(&self) -> &str {
        &self.0
    }

    /// Whether the key is empty.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

impl fmt::Display for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("<redacted>")
    }
}

impl Drop for Secret {
    fn drop(&mut self) {
        wipe(std::mem::take(&mut self.0));
    }
}

/// Overwrites a string's bytes before it is freed (black_box keeps the writes from being
/// removed as dead stores).
fn wipe(s: String) {
    let mut bytes = s.into_bytes();
    bytes.fill(0);
    std::hint::black_box(&bytes);
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: &str = "AQBcVdNm8nV7JRAAm0vIYSlZ0yq3xQ0qkQ6y5A==";

    #[test]
    fn the_key_never_shows_in_debug_or_display() {
        let s = Secret::new(KEY);
        assert_eq!(format!("{s:?}"), "Secret(<redacted>)");
        assert_eq!(format!("{s}"), "<redacted>");
        assert!(!format!("{s:#?}").contains("AQB"));
        assert_eq!(s.expose(), KEY);
    }

    #[test]
    fn keys_are_trimmed() {
        assert_eq!(Secret::new(format!("{KEY}\n")).expose(), KEY);
    }

    #[test]
    fn the_key_of_the_users_section_is_read_from_a_keyring() {
        let one = format!("[client.moor]\n\tkey = {KEY}\n\tcaps mon = \"profile rbd\"\n");
        assert_eq!(Secret::from_keyring(&one, "moor").unwrap().expose(), KEY);
        // A keyring of one section is that user's, whatever its name.
        assert_eq!(Secret::from_keyring(&one, "other").unwrap().expose(), KEY);
        let two = format!("[client.admin]\nkey = AAAA\n[client.moor]\nkey = {KEY}\n");
        assert_eq!(Secret::from_keyring(&two, "moor").unwrap().expose(), KEY);
        assert_eq!(
            Secret::from_keyring(&two, "admin").unwrap().expose(),
            "AAAA"
        );
        assert!(Secret::from_keyring(&two, "nobody").is_none());
        assert!(Secret::from_keyring("[client.moor]\n", "moor").is_none());
    }
}
