//! The CSI secrets moorctl passes with the calls that carry them (`--secrets FILE`), as the
//! CSI sidecars pass a StorageClass's secrets: read from a file so that no key shows in the
//! process list, and never printed (`Debug` shows how many there are).

use std::collections::HashMap;
use std::fmt;
use std::path::Path;

use crate::error::CliError;

/// The secrets, by name.
#[derive(Clone, Default)]
pub struct Secrets(HashMap<String, String>);

impl fmt::Debug for Secrets {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Not even the names: a misplaced key could be one.
        f.debug_struct("Secrets")
            .field("count", &self.0.len())
            .finish_non_exhaustive()
    }
}

impl Secrets {
    /// Reads `path`: a JSON object of strings, or KEY=VALUE lines (blank lines and lines
    /// starting with `#` skipped; the value is everything after the first `=`, unquoted).
    pub fn load(path: &Path) -> Result<Self, CliError> {
        let fail = |reason: String| CliError::Secrets {
            path: path.to_path_buf(),
            reason,
        };
        let text = std::fs::read_to_string(path).map_err(|e| fail(e.to_string()))?;
        Self::parse(&text).map_err(fail)
    }

    pub(crate) fn parse(text: &str) -> Result<Self, String> {
        if text.trim_start().starts_with('{') {
            // serde_json's errors name a line and column, never the text.
            return serde_json::from_str::<HashMap<String, String>>(text)
                .map(Self)
                .map_err(|e| format!("not a JSON object of strings: {e}"));
        }
        let mut out = HashMap::new();
        for (n, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            // The line is never quoted: it may hold a key.
            // A bare base64 key splits at its padding: "AQB...=" + "=" is no KEY=VALUE.
            let (k, v) = line
                .split_once('=')
                .filter(|(k, v)| !k.trim().is_empty() && !v.trim().chars().all(|c| c == '='))
                .ok_or_else(|| format!("line {} is not KEY=VALUE", n + 1))?;
            out.insert(k.trim().to_string(), v.trim().to_string());
        }
        Ok(Self(out))
    }

    /// The secrets as a request's field.
    pub fn to_map(&self) -> HashMap<String, String> {
        self.0.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: &str = "AQBkZXNlY3JldGtleXRoYXRpc25vdHNob3du==";

    #[test]
    fn lines_and_json_read_the_same() {
        let lines = Secrets::parse(&format!(
            "# the moor client\nuserID = moor\n\nuserKey={KEY}\n"
        ))
        .unwrap();
        let json = Secrets::parse(&format!(r#"{{"userID": "moor", "userKey": "{KEY}"}}"#)).unwrap();
        assert_eq!(lines.to_map(), json.to_map());
        assert_eq!(lines.to_map()["userKey"], KEY, "the '=' of base64 stay");
    }

    #[test]
    fn a_key_is_never_shown() {
        let s = Secrets::parse(&format!("userID=moor\nuserKey={KEY}\n")).unwrap();
        assert!(!format!("{s:?}").contains(KEY));
        // A malformed line is named by its number, not quoted.
        let e = Secrets::parse(&format!("userID=moor\n{KEY}\n")).unwrap_err();
        assert!(e.contains("line 2") && !e.contains("AQBk"), "{e}");
        let e = Secrets::parse(&format!(r#"{{"userKey": {KEY}}}"#)).unwrap_err();
        assert!(!e.contains("AQBk"), "{e}");
    }
}
