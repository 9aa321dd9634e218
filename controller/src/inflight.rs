//! Operations in flight, per object: a second operation that conflicts with a running one is
//! answered ABORTED ("operation pending"), as the CSI spec allows, instead of racing it.
//!
//! A key is claimed exclusively (the operation changes the object) or shared (it only reads
//! it, e.g. a volume being copied into a snapshot). Exclusive conflicts with everything;
//! shared conflicts only with exclusive. Claims are released when the [`Claim`] is dropped.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard};

use crate::error::{Error, Result};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Hold {
    Exclusive,
    Shared(usize),
}

/// The set of keys held by running operations.
#[derive(Debug, Default)]
pub struct InFlight {
    held: Mutex<HashMap<String, Hold>>,
}

/// Keys held by one operation; dropping it releases them.
#[derive(Debug)]
#[must_use = "the claim is released when dropped"]
pub struct Claim<'a> {
    set: &'a InFlight,
    keys: Vec<(String, bool)>,
}

impl InFlight {
    /// An empty set.
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<String, Hold>> {
        // A panic while holding this lock cannot leave the map half-updated in a way that
        // matters more than refusing every later request would.
        self.held.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Claims every key of `exclusive` exclusively and every key of `shared` shared, all or
    /// none. [`Error::OperationPending`] names the first key that is taken.
    pub fn claim(&self, exclusive: &[&str], shared: &[&str]) -> Result<Claim<'_>> {
        let mut held = self.lock();
        for key in exclusive {
            if held.contains_key(*key) || shared.contains(key) {
                return Err(Error::OperationPending((*key).to_string()));
            }
        }
        for key in shared {
            if held.get(*key) == Some(&Hold::Exclusive) {
                return Err(Error::OperationPending((*key).to_string()));
            }
        }
        let mut keys = Vec::with_capacity(exclusive.len() + shared.len());
        for key in exclusive {
            if keys.iter().any(|(k, _)| k == key) {
                continue;
            }
            held.insert((*key).to_string(), Hold::Exclusive);
            keys.push(((*key).to_string(), true));
        }
        for key in shared {
            if keys.iter().any(|(k, _)| k == key) {
                continue;
            }
            let hold = held.entry((*key).to_string()).or_insert(Hold::Shared(0));
            if let Hold::Shared(n) = hold {
                *n += 1;
            }
            keys.push(((*key).to_string(), false));
        }
        Ok(Claim { set: self, keys })
    }

    /// Whether `key` is held by any operation.
    pub fn is_held(&self, key: &str) -> bool {
        self.lock().contains_key(key)
    }
}

impl Drop for Claim<'_> {
    fn drop(&mut self) {
        let mut held = self.set.lock();
        for (key, exclusive) in self.keys.drain(..) {
            if exclusive {
                held.remove(&key);
                continue;
            }
            if let Some(Hold::Shared(n)) = held.get_mut(&key) {
                *n = n.saturating_sub(1);
                if *n == 0 {
                    held.remove(&key);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exclusive_excludes_everything() {
        let f = InFlight::new();
        let c = f.claim(&["a"], &[]).unwrap();
        assert!(matches!(
            f.claim(&["a"], &[]),
            Err(Error::OperationPending(k)) if k == "a"
        ));
        assert!(f.claim(&[], &["a"]).is_err());
        assert!(f.claim(&["b"], &[]).is_ok());
        drop(c);
        assert!(!f.is_held("a"));
        assert!(f.claim(&["a"], &[]).is_ok());
    }

    #[test]
    fn shared_is_shared() {
        let f = InFlight::new();
        let a = f.claim(&[], &["v"]).unwrap();
        let b = f.claim(&["s"], &["v"]).unwrap();
        assert!(f.claim(&["v"], &[]).is_err());
        drop(a);
        assert!(f.claim(&["v"], &[]).is_err());
        drop(b);
        assert!(!f.is_held("v"));
        assert!(!f.is_held("s"));
        assert!(f.claim(&["v"], &[]).is_ok());
    }

    #[test]
    fn all_or_nothing() {
        let f = InFlight::new();
        let _x = f.claim(&["x"], &[]).unwrap();
        assert!(f.claim(&["y", "x"], &[]).is_err());
        assert!(!f.is_held("y"));
        assert!(f.claim(&["k"], &["k"]).is_err());
        assert!(!f.is_held("k"));
    }
}
