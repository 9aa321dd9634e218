//! A per-volume guard: one operation per volume at a time. A second call on a volume with a
//! call in flight gets ABORTED at once (the spec's "operation pending for volume"), so calls on
//! other volumes never wait behind it. moor's own background work (reconciliation) takes a
//! volume only when it is free and never waits; a call that finds the volume held by it waits
//! for it (it holds a volume for milliseconds) instead of failing kubelet's call for work
//! kubelet never asked for.

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

use crate::error::Error;

/// How long a call waits for background work to let its volume go before it is ABORTED like
/// any other collision.
const BACKGROUND_WAIT: Duration = Duration::from_secs(10);

/// Who holds a volume.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Holder {
    /// A CSI call.
    Call,
    /// moor's own background work (reconciliation).
    Background,
}

#[derive(Debug, Default)]
struct Busy {
    held: HashMap<String, Holder>,
    /// Calls waiting for background work to let a volume go.
    waiting: usize,
    /// How many releases woke the waiters.
    #[cfg(test)]
    wakes: usize,
}

/// The set of volumes with an operation in flight.
#[derive(Debug, Default, Clone)]
pub struct VolumeLocks {
    busy: Arc<(Mutex<Busy>, Condvar)>,
}

/// Held while an operation runs on a volume; released on drop, also on panic.
#[derive(Debug)]
pub struct VolumeGuard {
    busy: Arc<(Mutex<Busy>, Condvar)>,
    volume_id: String,
}

impl VolumeLocks {
    fn state(&self) -> std::sync::MutexGuard<'_, Busy> {
        self.busy.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn guard(&self, volume_id: &str) -> VolumeGuard {
        VolumeGuard {
            busy: Arc::clone(&self.busy),
            volume_id: volume_id.to_string(),
        }
    }

    /// Takes the volume for a call, or fails with [`Error::OperationPending`] when another
    /// call holds it. Background work holding it is waited out (up to [`BACKGROUND_WAIT`]).
    pub fn try_lock(&self, volume_id: &str) -> Result<VolumeGuard, Error> {
        let deadline = Instant::now() + BACKGROUND_WAIT;
        let mut busy = self.state();
        loop {
            match busy.held.get(volume_id) {
                None => break,
                Some(Holder::Background) if Instant::now() < deadline => {
                    busy.waiting += 1;
                    let left = deadline.saturating_duration_since(Instant::now());
                    busy = self
                        .busy
                        .1
                        .wait_timeout(busy, left)
                        .unwrap_or_else(PoisonError::into_inner)
                        .0;
                    busy.waiting -= 1;
                }
                Some(_) => return Err(Error::OperationPending(volume_id.to_string())),
            }
        }
        busy.held.insert(volume_id.to_string(), Holder::Call);
        Ok(self.guard(volume_id))
    }

    /// Takes the volume for background work if it is free; never waits.
    pub fn try_lock_background(&self, volume_id: &str) -> Result<VolumeGuard, Error> {
        let mut busy = self.state();
        if busy.held.contains_key(volume_id) {
            return Err(Error::OperationPending(volume_id.to_string()));
        }
        busy.held.insert(volume_id.to_string(), Holder::Background);
        Ok(self.guard(volume_id))
    }

    /// How many operations are in flight.
    pub fn in_flight(&self) -> usize {
        self.state().held.len()
    }

    /// How many calls wait for background work to let their volume go.
    pub fn waiting(&self) -> usize {
        self.state().waiting
    }

    #[cfg(test)]
    fn wakes(&self) -> usize {
        self.state().wakes
    }
}

impl Drop for VolumeGuard {
    fn drop(&mut self) {
        let (busy, released) = &*self.busy;
        let mut state = busy.lock().unwrap_or_else(PoisonError::into_inner);
        state.held.remove(&self.volume_id);
        // Only a call waiting for background work sleeps on `released`, and it counts itself
        // in `waiting` under this lock before it sleeps: with nobody counted, a wake would be
        // a system call (a futex wake) for no one, on every call's release.
        let wake = state.waiting > 0;
        #[cfg(test)]
        {
            state.wakes += usize::from(wake);
        }
        drop(state);
        if wake {
            released.notify_all();
        }
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

    /// A call on `volume` on a thread of its own, once it waits for the background work that
    /// holds the volume.
    fn a_call_waiting(
        locks: &VolumeLocks,
        volume: &'static str,
    ) -> std::thread::JoinHandle<Result<(), Error>> {
        let l2 = locks.clone();
        let call = std::thread::spawn(move || l2.try_lock(volume).map(drop));
        let start = Instant::now();
        while locks.waiting() == 0 {
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "waited 30 s for the call to wait for the background work"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        call
    }

    #[test]
    fn a_call_waits_for_background_work_and_a_call_never_does() {
        let locks = VolumeLocks::default();
        let background = locks.try_lock_background("a").unwrap();
        // Background work never takes what a call or other background work holds.
        assert!(locks.try_lock_background("a").is_err());
        let call = a_call_waiting(&locks, "a");
        drop(background);
        assert!(call.join().unwrap().is_ok(), "the call got the volume");
        let held = locks.try_lock("a").unwrap();
        assert!(matches!(
            locks.try_lock("a"),
            Err(Error::OperationPending(_))
        ));
        assert!(locks.try_lock_background("a").is_err());
        drop(held);
        assert_eq!(locks.in_flight(), 0);
    }

    #[test]
    fn a_release_wakes_only_when_a_call_waits() {
        let locks = VolumeLocks::default();
        drop(locks.try_lock("a").unwrap());
        drop(locks.try_lock_background("a").unwrap());
        assert_eq!(locks.wakes(), 0, "releases with nobody waiting woke");
        let background = locks.try_lock_background("a").unwrap();
        let call = a_call_waiting(&locks, "a");
        drop(background);
        assert!(call.join().unwrap().is_ok(), "the call got the volume");
        assert_eq!(
            locks.wakes(),
            1,
            "the release the call waited for woke it, once"
        );
    }
}
