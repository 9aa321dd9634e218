//! The CSI `secrets` of the request being served, for a backend that needs them.
//!
//! The CO passes credentials with most Controller RPCs (the StorageClass's provisioner,
//! controller-publish and controller-expand secrets in Kubernetes). The [`Backend`] trait
//! speaks typed requests without them, so the service makes the request's secrets current for
//! the duration of the backend call ([`scope`]) and a backend that needs them reads them with
//! [`current`]. They live on the blocking thread that runs the call, never outlive it, and
//! never appear in `Debug` output, a log line or an error.
//!
//! [`Backend`]: crate::backend::Backend

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::fmt;

/// A request's secrets: key → value. `Debug` shows the keys only.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Secrets(BTreeMap<String, String>);

impl Secrets {
    /// No secrets.
    pub fn none() -> Self {
        Self::default()
    }

    /// The secrets of a request.
    pub fn from_map(map: &HashMap<String, String>) -> Self {
        Self(map.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
    }

    /// From pairs (tests, and callers that build requests themselves).
    pub fn from_pairs<K: Into<String>, V: Into<String>>(
        pairs: impl IntoIterator<Item = (K, V)>,
    ) -> Self {
        Self(
            pairs
                .into_iter()
                .map(|(k, v)| (k.into(), v.into()))
                .collect(),
        )
    }

    /// The value of `key`, if set and not empty.
    pub fn get(&self, key: &str) -> Option<&str> {
        self.0
            .get(key)
            .map(String::as_str)
            .filter(|v| !v.is_empty())
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl fmt::Debug for Secrets {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_set()
            .entries(self.0.keys().map(|k| format!("{k}=<redacted>")))
            .finish()
    }
}

impl Drop for Secrets {
    fn drop(&mut self) {
        // Best effort: overwrite the values before their memory is freed.
        for value in self.0.values_mut() {
            let mut bytes = std::mem::take(value).into_bytes();
            bytes.fill(0);
            std::hint::black_box(&bytes);
        }
    }
}

thread_local! {
    static CURRENT: RefCell<Option<Secrets>> = const { RefCell::new(None) };
}

/// Restores the secrets that were current before a [`scope`], also when the call panics.
struct Restore(Option<Secrets>);

impl Drop for Restore {
    fn drop(&mut self) {
        let previous = self.0.take();
        CURRENT.with(|c| *c.borrow_mut() = previous);
    }
}

/// Runs `f` with `secrets` as the current request's secrets (on this thread).
pub fn scope<T>(secrets: Secrets, f: impl FnOnce() -> T) -> T {
    let previous = CURRENT.with(|c| c.borrow_mut().replace(secrets));
    let _restore = Restore(previous);
    f()
}

/// The current request's secrets (none outside a [`scope`]).
pub fn current() -> Secrets {
    CURRENT.with(|c| c.borrow().clone().unwrap_or_default())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_are_current_only_inside_their_scope() {
        assert!(current().is_empty());
        let s = Secrets::from_pairs([("userID", "moor"), ("userKey", "AQB-secret")]);
        let seen = scope(s, || {
            let inner = scope(Secrets::from_pairs([("adminID", "a")]), || {
                current().get("adminID").map(str::to_owned)
            });
            assert_eq!(inner.as_deref(), Some("a"));
            current().get("userID").map(str::to_owned)
        });
        assert_eq!(seen.as_deref(), Some("moor"));
        assert!(current().is_empty());
    }

    #[test]
    fn a_panic_inside_a_scope_does_not_leave_the_secrets_behind() {
        let r = std::panic::catch_unwind(|| {
            scope(Secrets::from_pairs([("userKey", "k")]), || panic!("boom"))
        });
        assert!(r.is_err());
        assert!(current().is_empty());
    }

    #[test]
    fn values_never_show_in_debug() {
        let s = Secrets::from_pairs([("userKey", "AQB-very-secret"), ("empty", "")]);
        let shown = format!("{s:?}");
        assert!(!shown.contains("AQB"), "{shown}");
        assert!(shown.contains("userKey=<redacted>"), "{shown}");
        assert_eq!(s.get("empty"), None);
    }
}
