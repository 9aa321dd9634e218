//! A per-volume guard: one operation per volume at a time. A second call on a volume with an
//! operation in flight gets ABORTED at once (the spec's "operation pending for volume"), so
//! calls on other volumes never wait behind it.

use std::collections::HashSet;
use std::sync::{Arc, Mutex, PoisonError};

use crate::error::Error;

/// The set of volumes with an operation in flight.
#[derive(Debug, Default, Clone)]
pub struct VolumeLocks {
    busy: Arc<Mutex<HashSet<String>>>,
}

/// Held while an operation runs on a volume; released on drop, also on panic.
#[derive(Debug)]
pub struct VolumeGuard {
    busy: Arc<Mutex<HashSet<String>>>,
    volume_id: String,
}

impl VolumeLocks {
    /// Takes the volume, or fails with [`Error::OperationPending`].
    pub fn try_lock(&self, volume_id: &str) -> Result<VolumeGuard, Error> {
        let mut busy = self.busy.lock().unwrap_or_else(PoisonError::into_inner);
        if !busy.insert(volume_id.to_string()) {
            return Err(Error::OperationPending(volume_id.to_string()));
        }
        Ok(VolumeGuard {
            busy: Arc::clone(&self.busy),
            volume_id: volume_id.to_string(),
        })
    }

    /// How many operations are in flight.
    pub fn in_flight(&self) -> usize {
        self.busy
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }
}

impl Drop for VolumeGuard {
    fn drop(&mut self) {
        self.busy
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&self.volume_id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn second_lock_on_same_volume_is_aborted_until_release() {
        let locks = VolumeLocks::default();
        let g = locks.try_lock("a").unwrap();
        assert!(matches!(
            locks.try_lock("a"),
            Err(Error::OperationPending(_))
        ));
        let _other = locks.try_lock("b").unwrap();
        drop(g);
        assert!(locks.try_lock("a").is_ok());
    }

    #[test]
    fn released_on_panic() {
        let locks = VolumeLocks::default();
        let l2 = locks.clone();
        let r = std::thread::spawn(move || {
            let _g = l2.try_lock("a").unwrap();
            panic!("boom");
        })
        .join();
        assert!(r.is_err());
        assert_eq!(locks.in_flight(), 0);
    }
}
