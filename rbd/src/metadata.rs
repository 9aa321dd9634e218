//! Pool metadata: key-value pairs kept in the pool's `rbd_info` object (librbd's pool
//! metadata, where `rbd config pool` keeps its `conf_` overrides). Any other key is free for
//! an application's records: writing one needs no image open and no image lock.

use std::ffi::CString;

use crate::error::{Error, Result};
use crate::pool::Pool;

pub(crate) fn c_text(what: &'static str, value: &str) -> Result<CString> {
    CString::new(value).map_err(|_| Error::Invalid {
        what,
        reason: format!("{value:?} contains a NUL byte"),
    })
}

/// Keys this crate refuses to write: librbd reads `conf_` keys as configuration overrides.
fn check_key(key: &str) -> Result<CString> {
    if key.is_empty() || key.starts_with("conf_") {
        return Err(Error::Invalid {
            what: "pool metadata key",
            reason: format!("{key:?} is empty or a configuration override (conf_...)"),
        });
    }
    c_text("pool metadata key", key)
}

impl Pool {
    fn metadata_subject(&self) -> String {
        format!("metadata of pool {}", self.name())
    }

    /// The value of a pool metadata key; None when it is not set.
    pub fn metadata_get(&self, key: &str) -> Result<Option<String>> {
        let c_key = check_key(key)?;
        self.ioctx
            .pool_metadata_get(&c_key)
            .map_err(|f| Error::from_failure(f, self.metadata_subject()))
    }

    /// The pool's own setting of librbd's `option` (`rbd config pool set`: the metadata key
    /// `conf_<option>`), which librbd sets over a client's for every image of the pool it
    /// opens; None when the pool has none. Read only: this crate never writes such keys.
    pub fn config_override(&self, option: &str) -> Result<Option<String>> {
        let c_key = c_text("pool metadata key", &format!("conf_{option}"))?;
        self.ioctx
            .pool_metadata_get(&c_key)
            .map_err(|f| Error::from_failure(f, self.metadata_subject()))
    }

    /// Sets a pool metadata key (replacing its value whole: one atomic write).
    pub fn metadata_set(&self, key: &str, value: &str) -> Result<()> {
        let c_key = check_key(key)?;
        let c_value = c_text("pool metadata value", value)?;
        self.ioctx
            .pool_metadata_set(&c_key, &c_value)
            .map_err(|f| Error::from_failure(f, self.metadata_subject()))
    }

    /// Removes a pool metadata key; whether it was set.
    pub fn metadata_remove(&self, key: &str) -> Result<bool> {
        let c_key = check_key(key)?;
        self.ioctx
            .pool_metadata_remove(&c_key)
            .map_err(|f| Error::from_failure(f, self.metadata_subject()))
    }

    /// Up to `max` pairs (all when 0) whose keys start with `prefix` and sort after `after`
    /// (from the first such key when None), in key order.
    pub fn metadata_list(
        &self,
        prefix: &str,
        after: Option<&str>,
        max: usize,
    ) -> Result<Vec<(String, String)>> {
        // Keys sort as bytes: every key with the prefix sorts after the prefix itself.
        let start = match after {
            Some(a) if a > prefix => a,
            _ => prefix,
        };
        let c_start = c_text("pool metadata key", start)?;
        let mut out = Vec::new();
        let mut from = c_start;
        // Pages of a bounded size, so a pool with many keys of other prefixes is not read
        // whole when only a few are wanted.
        const CHUNK: u64 = 256;
        loop {
            let page = self
                .ioctx
                .pool_metadata_list(&from, CHUNK)
                .map_err(|f| Error::from_failure(f, self.metadata_subject()))?;
            let full = page.len() as u64 == CHUNK;
            let last = page.last().map(|(k, _)| k.clone());
            for (key, value) in page {
                if !key.starts_with(prefix) {
                    return Ok(out);
                }
                out.push((key, value));
                if max > 0 && out.len() == max {
                    return Ok(out);
                }
            }
            match last {
                Some(last) if full => from = c_text("pool metadata key", &last)?,
                _ => return Ok(out),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn configuration_overrides_and_nul_bytes_are_refused() {
        assert!(check_key("conf_rbd_cache").is_err());
        assert!(check_key("").is_err());
        assert!(check_key("a\0b").is_err());
        assert!(check_key("moor.vol.x").is_ok());
    }
}
