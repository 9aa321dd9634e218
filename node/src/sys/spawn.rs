//! Starting a tool (mkfs, resize2fs, xfs_growfs) the way `posix_spawn` does, without `fork`,
//! and with the one thing `posix_spawn` cannot do: the child gets SIGKILL when the spawning
//! thread dies (`PR_SET_PDEATHSIG`), so a tool never outlives a killed daemon and races the
//! restarted one's retry.
//!
//! Why not `fork` (what `std::process::Command` falls back to once a `pre_exec` hook is set):
//! a fork copies the daemon's page tables and write-protects every private page of the
//! daemon, and each page the daemon then writes takes a copy-on-write fault. On this machine
//! that is about 0.4 ms for the fork and 1.3 µs per page touched after it, more than a
//! millisecond per mkfs. The child here shares the daemon's memory (`CLONE_VM`) on a stack of
//! its own, while the spawning thread sleeps until it has exec'd (`CLONE_VFORK`); the kernel
//! hands back a pidfd (`CLONE_PIDFD`) to wait on and to signal without pid reuse races.
//!
//! Between clone and exec the child runs only async-signal-safe libc calls, allocates
//! nothing, and writes to shared memory only the errno of a failed exec. Every signal is
//! blocked in the spawning thread across the clone, so no daemon signal handler can run on the
//! child's stack; the child sets caught signals back to their defaults (and SIGPIPE, which the
//! Rust runtime ignores) before it restores the mask and execs.

use std::ffi::{CString, OsStr, c_char, c_int, c_void};
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt as _;
use std::path::Path;
use std::sync::atomic::{AtomicI32, Ordering};

/// The child's stack: plenty for the few libc calls it makes before exec.
const STACK_LEN: usize = 64 * 1024;
/// An inaccessible page below the stack, so an overflow faults instead of writing the heap.
const GUARD_LEN: usize = 4096;
/// The highest signal number on Linux (`_NSIG - 1`).
const MAX_SIGNAL: c_int = 64;
/// The exit status of a child whose exec failed (as the shell reports a missing command).
const EXEC_FAILED: c_int = 127;

/// A started child: its pid, and a pidfd that refers to it alone.
#[derive(Debug)]
pub struct Spawned {
    /// The child's pid.
    pub pid: rustix::process::Pid,
    /// A pidfd for the child (close-on-exec).
    pub pidfd: OwnedFd,
}

/// What the child reads, and the one thing it writes back.
struct ChildArgs {
    /// The program, an absolute path.
    path: *const c_char,
    /// NULL-terminated argument vector.
    argv: *const *const c_char,
    /// NULL-terminated environment.
    envp: *const *const c_char,
    /// What becomes the child's stdin, stdout and stderr (each at least 3, so no `dup2`
    /// overwrites a descriptor a later one still needs).
    stdio: [c_int; 3],
    /// The spawning process, to notice a parent that died before the death signal was armed.
    parent: libc::pid_t,
    /// The spawning thread's signal mask, restored in the child just before exec.
    mask: libc::sigset_t,
    /// The errno of a failed exec; 0 while none.
    errno: AtomicI32,
}

/// Starts `program` (an absolute path) with `args` and exactly the environment `env`
/// (`KEY=value` entries), its stdin, stdout and stderr duplicated from `stdio`. The child dies
/// with the calling thread. An exec failure (no such file, not executable) is returned as
/// that error, the failed child already reaped.
pub fn spawn(
    program: &Path,
    args: &[impl AsRef<OsStr>],
    env: &[impl AsRef<OsStr>],
    stdio: [BorrowedFd<'_>; 3],
) -> io::Result<Spawned> {
    let cstring = |s: &OsStr| {
        CString::new(s.as_bytes()).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))
    };
    let path = cstring(program.as_os_str())?;
    let mut argv_owned = vec![path.clone()];
    for a in args {
        argv_owned.push(cstring(a.as_ref())?);
    }
    let env_owned = env
        .iter()
        .map(|e| cstring(e.as_ref()))
        .collect::<io::Result<Vec<_>>>()?;
    let argv = null_terminated(&argv_owned);
    let envp = null_terminated(&env_owned);
    // The child's descriptors must not sit at 0..=2, or one dup2 could clobber the source of
    // the next: duplicate any low one upwards first (close-on-exec, dropped after the spawn).
    let mut raised = Vec::new();
    let mut fds = [0 as c_int; 3];
    for (slot, fd) in fds.iter_mut().zip(stdio) {
        *slot = if fd.as_raw_fd() < 3 {
            let high = rustix::io::fcntl_dupfd_cloexec(fd, 3)?;
            let raw = high.as_raw_fd();
            raised.push(high);
            raw
        } else {
            fd.as_raw_fd()
        };
    }

    let stack = Stack::new()?;
    let mut child = ChildArgs {
        path: path.as_ptr(),
        argv: argv.as_ptr(),
        envp: envp.as_ptr(),
        stdio: fds,
        parent: rustix::process::getpid().as_raw_nonzero().get(),
        mask: empty_sigset(),
        errno: AtomicI32::new(0),
    };
    let blocked = BlockedSignals::new(&mut child.mask)?;
    let mut pidfd: c_int = -1;
    let flags = libc::CLONE_VM | libc::CLONE_VFORK | libc::CLONE_PIDFD | libc::SIGCHLD;
    // SAFETY: `child_main` is an `extern "C"` function that only makes async-signal-safe
    // calls and never returns into Rust code of the parent; `stack.top()` is the 16-byte
    // aligned end of a live, writable mapping of STACK_LEN bytes that outlives the call (with
    // CLONE_VFORK this thread sleeps until the child has exec'd or exited, after which the
    // child no longer uses the stack); `child` and everything its pointers reach (`path`,
    // `argv`, `envp` and their strings) live on this frame until after the call; `pidfd` is a
    // writable c_int for CLONE_PIDFD's parent_tid argument.
    let pid = unsafe {
        libc::clone(
            child_main,
            stack.top(),
            flags,
            std::ptr::from_mut(&mut child).cast::<c_void>(),
            std::ptr::from_mut(&mut pidfd),
        )
    };
    let clone_err = io::Error::last_os_error();
    drop(blocked);
    drop(stack);
    drop(raised);
    if pid < 0 {
        return Err(clone_err);
    }
    // SAFETY: the kernel stored a new pidfd at `pidfd` for the successful clone; nothing else
    // owns it.
    let pidfd = unsafe { OwnedFd::from_raw_fd(pidfd) };
    let pid = rustix::process::Pid::from_raw(pid)
        .ok_or_else(|| io::Error::other("clone returned pid 0 in the parent"))?;
    let spawned = Spawned { pid, pidfd };
    // The child is past exec or has exited (CLONE_VFORK); it stored errno if exec failed.
    let errno = child.errno.load(Ordering::Acquire);
    if errno != 0 {
        let _ = wait(&spawned);
        return Err(io::Error::from_raw_os_error(errno));
    }
    Ok(spawned)
}

/// Waits for the child to exit and returns its status (reaping it).
pub fn wait(child: &Spawned) -> io::Result<rustix::process::WaitIdStatus> {
    loop {
        match rustix::process::waitid(
            rustix::process::WaitId::PidFd(std::os::fd::AsFd::as_fd(&child.pidfd)),
            rustix::process::WaitIdOptions::EXITED,
        ) {
            Ok(Some(status)) => return Ok(status),
            Ok(None) => return Err(io::Error::other("waitid returned no status")),
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
}

/// Sends SIGKILL to the child (through its pidfd: never to a reused pid).
pub fn kill(child: &Spawned) -> io::Result<()> {
    rustix::process::pidfd_send_signal(&child.pidfd, rustix::process::Signal::KILL)
        .map_err(io::Error::from)
}

/// How a reaped child ended, worded like the shell: `exit status: N` or `signal: N`.
pub fn describe(status: &rustix::process::WaitIdStatus) -> String {
    if let Some(code) = status.exit_status() {
        format!("exit status: {code}")
    } else if let Some(sig) = status.terminating_signal() {
        format!("signal: {sig}")
    } else {
        "ended".to_owned()
    }
}

/// Pointers to `strings`, then NULL.
fn null_terminated(strings: &[CString]) -> Vec<*const c_char> {
    strings
        .iter()
        .map(|s| s.as_ptr())
        .chain(std::iter::once(std::ptr::null()))
        .collect()
}

/// An empty signal set.
fn empty_sigset() -> libc::sigset_t {
    let mut set = std::mem::MaybeUninit::<libc::sigset_t>::uninit();
    // SAFETY: sigemptyset initialises the whole set it is given, a valid writable sigset_t.
    unsafe { libc::sigemptyset(set.as_mut_ptr()) };
    // SAFETY: initialised just above.
    unsafe { set.assume_init() }
}

/// Every signal blocked in this thread while alive; the old mask is restored on drop.
struct BlockedSignals {
    old: libc::sigset_t,
}

impl BlockedSignals {
    /// Blocks every signal, glibc's internal ones included (hence the raw syscall: the libc
    /// wrappers leave those two open); also stores the previous mask in `old_out`, for the
    /// child.
    fn new(old_out: &mut libc::sigset_t) -> io::Result<Self> {
        let all: u64 = !0;
        let mut old = empty_sigset();
        // SAFETY: rt_sigprocmask reads a kernel sigset of the size passed (8 bytes, 64
        // signals) from `all` and writes as many bytes into `old`, a larger libc sigset_t;
        // it changes only the calling thread's mask.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_rt_sigprocmask,
                libc::SIG_SETMASK,
                std::ptr::from_ref(&all),
                std::ptr::from_mut(&mut old),
                std::mem::size_of::<u64>(),
            )
        };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        *old_out = old;
        Ok(Self { old })
    }
}

impl Drop for BlockedSignals {
    fn drop(&mut self) {
        // SAFETY: restores the mask saved by `new` (8 bytes read from a valid sigset_t); a
        // NULL old-set is allowed.
        unsafe {
            libc::syscall(
                libc::SYS_rt_sigprocmask,
                libc::SIG_SETMASK,
                std::ptr::from_ref(&self.old),
                std::ptr::null_mut::<libc::sigset_t>(),
                std::mem::size_of::<u64>(),
            )
        };
    }
}

/// A private anonymous mapping for the child's stack, with a guard page below it.
struct Stack {
    base: *mut c_void,
}

impl Stack {
    fn new() -> io::Result<Self> {
        // SAFETY: a fresh anonymous mapping at an address of the kernel's choosing; it aliases
        // nothing.
        let base = unsafe {
            rustix::mm::mmap_anonymous(
                std::ptr::null_mut(),
                GUARD_LEN + STACK_LEN,
                rustix::mm::ProtFlags::READ | rustix::mm::ProtFlags::WRITE,
                rustix::mm::MapFlags::PRIVATE | rustix::mm::MapFlags::STACK,
            )
        }?;
        let stack = Self { base };
        // SAFETY: the first GUARD_LEN bytes are inside the mapping just made, page aligned,
        // and nothing uses them.
        unsafe { rustix::mm::mprotect(base, GUARD_LEN, rustix::mm::MprotectFlags::empty()) }?;
        Ok(stack)
    }

    /// The (exclusive) top of the stack, where a downward-growing stack starts.
    fn top(&self) -> *mut c_void {
        self.base.wrapping_byte_add(GUARD_LEN + STACK_LEN)
    }
}

impl Drop for Stack {
    fn drop(&mut self) {
        // SAFETY: `base` is the start of the mapping of this length made in `new`, no longer
        // in use (the child exec'd or exited before clone returned).
        let _ = unsafe { rustix::mm::munmap(self.base, GUARD_LEN + STACK_LEN) };
    }
}

/// The child, from clone to exec: on its own stack, in the daemon's memory, with every
/// signal blocked.
extern "C" fn child_main(arg: *mut c_void) -> c_int {
    // SAFETY: `arg` is the `ChildArgs` on the spawning thread's frame, which sleeps in clone
    // (CLONE_VFORK) until this child execs or exits, so the value is alive and not accessed
    // concurrently; the child only reads it, and writes `errno` through an atomic.
    let args = unsafe { &*arg.cast::<ChildArgs>() };
    for sig in 1..=MAX_SIGNAL {
        if sig == libc::SIGKILL || sig == libc::SIGSTOP {
            continue;
        }
        // SAFETY: an all-zero sigaction is a valid value (SIG_DFL, empty mask, no flags).
        let mut old: libc::sigaction = unsafe { std::mem::zeroed() };
        // SAFETY: reading the disposition into a valid sigaction; the child has its own copy
        // of the handler table (no CLONE_SIGHAND), so nothing here affects the daemon.
        if unsafe { libc::sigaction(sig, std::ptr::null(), &mut old) } != 0 {
            continue; // e.g. the signals glibc reserves for itself
        }
        let caught = old.sa_sigaction != libc::SIG_DFL && old.sa_sigaction != libc::SIG_IGN;
        if caught || sig == libc::SIGPIPE {
            // SAFETY: as above; an all-zero sigaction is SIG_DFL.
            let default: libc::sigaction = unsafe { std::mem::zeroed() };
            // SAFETY: setting this child's own disposition to the default.
            unsafe { libc::sigaction(sig, &default, std::ptr::null_mut()) };
        }
    }
    // SAFETY: prctl(PR_SET_PDEATHSIG) takes the signal as an unsigned long and affects only
    // the calling (child) process.
    let armed = unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong) };
    // SAFETY: getppid has no preconditions.
    if armed != 0 || unsafe { libc::getppid() } != args.parent {
        fail(args);
    }
    for (target, &source) in (0..).zip(args.stdio.iter()) {
        // SAFETY: `source` is an open descriptor (at least 3, held open by the parent for
        // the whole spawn) and `target` is 0, 1 or 2; dup2 clears close-on-exec on target.
        if unsafe { libc::dup2(source, target) } < 0 {
            fail(args);
        }
    }
    // SAFETY: `args.mask` is the spawning thread's valid, initialised signal mask.
    unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &args.mask, std::ptr::null_mut()) };
    // SAFETY: `path`, `argv` and `envp` point to NUL-terminated strings and NULL-terminated
    // arrays kept alive by the sleeping parent.
    unsafe { libc::execve(args.path, args.argv, args.envp) };
    fail(args)
}

/// Records errno for the parent and ends the child.
fn fail(args: &ChildArgs) -> ! {
    let errno = io::Error::last_os_error()
        .raw_os_error()
        .unwrap_or(libc::EIO);
    args.errno.store(errno.max(1), Ordering::Release);
    // SAFETY: _exit ends only this child (its own thread group), running no atexit handlers
    // or destructors in the memory it shares with the daemon.
    unsafe { libc::_exit(EXEC_FAILED) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read as _;
    use std::os::fd::AsFd as _;

    fn devnull() -> OwnedFd {
        std::fs::File::open("/dev/null").unwrap().into()
    }

    fn sh(script: &str, stderr: BorrowedFd<'_>) -> io::Result<Spawned> {
        let null = devnull();
        spawn(
            Path::new("/bin/sh"),
            &["-c", script],
            &["LC_ALL=C", "MOOR_SPAWN_TEST=yes"],
            [null.as_fd(), null.as_fd(), stderr],
        )
    }

    fn run(script: &str) -> (String, String) {
        let (mut r, w) = std::io::pipe().unwrap();
        let child = sh(script, w.as_fd()).unwrap();
        drop(w);
        let status = wait(&child).unwrap();
        let mut out = String::new();
        r.read_to_string(&mut out).unwrap();
        (describe(&status), out)
    }

    #[test]
    fn runs_with_exactly_the_given_environment_and_stdio() {
        let (status, out) = run("echo \"$MOOR_SPAWN_TEST $LC_ALL ${HOME:-none}\" >&2; \
             read x; echo \"stdin:$?\" >&2; exit 7");
        assert_eq!(status, "exit status: 7");
        // stdin is /dev/null: read fails at once.
        assert_eq!(out, "yes C none\nstdin:1\n");
    }

    #[test]
    fn the_child_has_default_signal_dispositions_and_an_open_mask() {
        // SigIgn and SigBlk are hex masks; SIGPIPE (13) must be neither ignored nor blocked.
        let (status, out) = run("grep -E '^Sig(Ign|Blk)' /proc/self/status >&2");
        assert_eq!(status, "exit status: 0");
        for line in out.lines() {
            let mask = u64::from_str_radix(line.split_whitespace().nth(1).unwrap(), 16).unwrap();
            assert_eq!(mask & (1 << (libc::SIGPIPE - 1)), 0, "{line}");
        }
        assert!(out.contains("SigBlk:\t0000000000000000"), "{out}");
    }

    #[test]
    fn the_spawning_thread_gets_its_signal_mask_back() {
        let blocked = || {
            std::fs::read_to_string("/proc/thread-self/status")
                .unwrap()
                .lines()
                .find(|l| l.starts_with("SigBlk:"))
                .unwrap()
                .to_owned()
        };
        let before = blocked();
        let (status, _) = run("exit 0");
        assert_eq!(status, "exit status: 0");
        assert_eq!(blocked(), before);
    }

    #[test]
    fn a_missing_program_is_an_error_and_leaves_no_child() {
        let null = devnull();
        let err = spawn(
            Path::new("/nonexistent/moor-tool"),
            &[] as &[&str],
            &[] as &[&str],
            [null.as_fd(), null.as_fd(), null.as_fd()],
        )
        .unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::NotFound);
    }

    #[test]
    fn one_descriptor_may_serve_two_of_the_child_stdio() {
        let (mut r, w) = std::io::pipe().unwrap();
        let null = devnull();
        let child = spawn(
            Path::new("/bin/sh"),
            &["-c", "echo to-stderr >&2"],
            &[] as &[&str],
            [w.as_fd(), null.as_fd(), w.as_fd()],
        )
        .unwrap();
        drop(w);
        assert_eq!(describe(&wait(&child).unwrap()), "exit status: 0");
        let mut out = String::new();
        r.read_to_string(&mut out).unwrap();
        assert_eq!(out, "to-stderr\n");
    }

    #[test]
    fn the_child_dies_with_the_spawning_thread() {
        let null = devnull();
        let spawned = std::thread::spawn(move || {
            spawn(
                Path::new("/bin/sleep"),
                &["30"],
                &[] as &[&str],
                [null.as_fd(), null.as_fd(), null.as_fd()],
            )
            .unwrap()
        })
        .join()
        .unwrap();
        let status = wait(&spawned).unwrap();
        assert_eq!(describe(&status), format!("signal: {}", libc::SIGKILL));
    }

    #[test]
    fn kill_ends_the_child() {
        let null = devnull();
        let child = sh("sleep 30", null.as_fd()).unwrap();
        kill(&child).unwrap();
        assert_eq!(
            describe(&wait(&child).unwrap()),
            format!("signal: {}", libc::SIGKILL)
        );
    }
}
