//! No core dump of a daemon that holds keys: `PR_SET_DUMPABLE` off (docs/encryption.md,
//! "Threat model"). A crash then leaves no image of the process's memory, where a data key
//! may be between its unwrap and its zeroing, and only a process with `CAP_SYS_PTRACE` may
//! read the process's memory through `/proc`. It holds for the process's life: set once at
//! start, before any key is unwrapped; the children it execs (cryptsetup, mkfs) are
//! dumpable again as exec makes them, and are given keys on their stdin only.

use rustix::process::{DumpableBehavior, dumpable_behavior, set_dumpable_behavior};

/// Makes this process not dumpable, and reads it back: an error when the kernel refused or
/// the process is dumpable still.
pub fn forbid() -> std::io::Result<()> {
    set_dumpable_behavior(DumpableBehavior::NotDumpable)?;
    match dumpable_behavior()? {
        DumpableBehavior::NotDumpable => Ok(()),
        other => Err(std::io::Error::other(format!(
            "PR_SET_DUMPABLE 0 set, but the process reads {other:?}"
        ))),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_process_is_not_dumpable_after_forbid() {
        super::forbid().expect("forbid core dumps");
        assert_eq!(
            rustix::process::dumpable_behavior().expect("PR_GET_DUMPABLE"),
            rustix::process::DumpableBehavior::NotDumpable
        );
    }
}
