//! Crash points for the crash-safety tests.
//!
//! When `moor-node` starts with `MOOR_TEST_CRASH_AT=<point>` in its environment, it kills
//! itself with SIGKILL the first time it reaches `<point>`: the test harness uses this to cut
//! every operation at every step, then restarts the daemon and replays kubelet's retry. Only
//! the binary reads the variable ([`arm_from_env`]); the library alone never crashes. An
//! unarmed point costs one atomic load.

use std::sync::OnceLock;

/// The environment variable naming the point to crash at.
pub const ENV: &str = "MOOR_TEST_CRASH_AT";

static ARMED: OnceLock<String> = OnceLock::new();

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

/// Arms the point named by [`ENV`], if set. Returns it.
pub fn arm_from_env() -> Option<&'static str> {
    let point = std::env::var(ENV).ok().filter(|p| !p.is_empty())?;
    Some(ARMED.get_or_init(|| point).as_str())
}

/// A crash point: dies here if armed for `name`.
pub fn point(name: &str) {
    if ARMED.get().is_some_and(|p| p == name) {
        let _ =
            rustix::process::kill_process(rustix::process::getpid(), rustix::process::Signal::KILL);
    }
}
