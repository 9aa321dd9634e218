//! Crash points for the crash-safety tests.
//!
//! Built with the `crash-points` cargo feature (the tests' build; never a release), a
//! `moor-node` started with `MOOR_TEST_CRASH_AT=<point>` in its environment kills itself with
//! SIGKILL the first time it reaches `<point>`: the test harness uses this to cut every
//! operation at every step, then restarts the daemon and replays kubelet's retry. Only the
//! binary reads the variable ([`arm_from_env`]); the library alone never crashes. Without the
//! feature a point is nothing and the variable is ignored; with it, an unarmed point costs
//! one atomic load.
//!
//! `MOOR_TEST_HOLD_AT=<point>` ([`HOLD_ENV`], [`arm_hold_from_env`]) holds instead: the
//! thread that reaches `<point>` says so on standard error ([`HELD`] and the point's name)
//! and waits there for ever, the rest of the process serving on. The VM lab's power cuts use
//! it: the host sees the line and kills the guest's QEMU while the operation stands exactly
//! at that step, everything before it done (and what it made durable, durable), nothing after
//! it begun.

#[cfg(feature = "crash-points")]
use std::sync::OnceLock;

/// The environment variable naming the point to crash at.
pub const ENV: &str = "MOOR_TEST_CRASH_AT";

/// The environment variable naming the point to hold at.
pub const HOLD_ENV: &str = "MOOR_TEST_HOLD_AT";

/// What a thread held at a point writes on standard error, followed by the point's name.
pub const HELD: &str = "moor-node held at crash point";

#[cfg(feature = "crash-points")]
static ARMED: OnceLock<String> = OnceLock::new();

#[cfg(feature = "crash-points")]
static HOLD: OnceLock<String> = OnceLock::new();

/// Every crash point, in the order the operations reach them.
pub const POINTS: &[&str] = &[
    "stage.formatting",
    "stage.formatted",
    "stage.mounting",
    "stage.mounted",
    "stage.growing",
    "stage.done",
    "publish.binding",
    "publish.bound",
    "publish.done",
    "expand.resizing",
    "expand.resized",
    "unpublish.unmounting",
    "unpublish.unmounted",
    "unpublish.removed",
    "unpublish.done",
    "unstage.unmounting",
    "unstage.unmounted",
    "unstage.done",
];

/// The crash points of an RBD volume's map and unmap (`engine::mapped`, `attach::fuse`), in
/// the order a stage and an unstage reach them.
pub const MAP_POINTS: &[&str] = &[
    "map.mapping",
    "map.attaching",
    "map.mapped",
    "unmap.unmapping",
    "unmap.unmapped",
];

/// The crash points of an encrypted volume's mapping (`engine::crypt`), in the order a stage
/// and an unstage reach them (only the VM lab has dm-crypt to reach them).
pub const CRYPT_POINTS: &[&str] = &[
    "stage.luks_formatting",
    "stage.opening",
    "stage.opened",
    "unstage.closing",
    "unstage.closed",
];

/// The crash points of a data key rotation (`engine::rotate`), in the order it reaches them:
/// before each step, with its intent journaled, and after the last.
pub const ROTATE_POINTS: &[&str] = &[
    "rotate.copy_old",
    "rotate.kill_old",
    "rotate.add_new",
    "rotate.record",
    "rotate.verify",
    "rotate.kill_spare",
    "rotate.done",
];

/// Arms the point named by [`ENV`], if set. Returns it.
#[cfg(feature = "crash-points")]
pub fn arm_from_env() -> Option<&'static str> {
    let point = std::env::var(ENV).ok().filter(|p| !p.is_empty())?;
    Some(ARMED.get_or_init(|| point).as_str())
}

/// Without the `crash-points` feature nothing is armed, whatever the environment says.
#[cfg(not(feature = "crash-points"))]
pub fn arm_from_env() -> Option<&'static str> {
    None
}

/// Arms the point named by [`HOLD_ENV`] to hold at, if set. Returns it.
#[cfg(feature = "crash-points")]
pub fn arm_hold_from_env() -> Option<&'static str> {
    let point = std::env::var(HOLD_ENV).ok().filter(|p| !p.is_empty())?;
    Some(HOLD.get_or_init(|| point).as_str())
}

/// Without the `crash-points` feature nothing holds, whatever the environment says.
#[cfg(not(feature = "crash-points"))]
pub fn arm_hold_from_env() -> Option<&'static str> {
    None
}

/// A crash point: dies here if armed for `name`; holds here for ever if armed to hold.
#[cfg(feature = "crash-points")]
pub fn point(name: &str) {
    if ARMED.get().is_some_and(|p| p == name) {
        let _ =
            rustix::process::kill_process(rustix::process::getpid(), rustix::process::Signal::KILL);
    }
    if HOLD.get().is_some_and(|p| p == name) {
        use std::io::Write as _;
        // One write of the whole line (standard error is unbuffered): the host reads it whole.
        let _ = std::io::stderr().write_all(format!("{HELD} {name}\n").as_bytes());
        loop {
            std::thread::park();
        }
    }
}

/// A crash point: nothing, without the `crash-points` feature.
#[cfg(not(feature = "crash-points"))]
#[inline(always)]
pub fn point(_name: &str) {}
