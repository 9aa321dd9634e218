//! csi-sanity, run as moor's runs of it run it (`.ci/csi-sanity`), passes even when its
//! connection turns READY before csi-sanity looks at it (issue 34).
//!
//! csi-test's `utils.Connect` (v5) dials without blocking, reads the channel's state, then
//! waits for a change from the state it read before it checks for READY. On a busy machine the
//! thread running it can be off the CPU between the dial and that read while the dial and the
//! HTTP/2 handshake complete on another: it then waits on a READY channel for a change that
//! never comes, a minute, and the suite's first spec fails with "Connection timed out" while
//! the daemon, idle, has answered the handshake in milliseconds.
//!
//! This test makes that happen on purpose rather than by load: gdb (non-stop, so only that
//! thread stops) holds the thread running `Connect` at the instruction after its dial returns
//! for up to HOLD_BOUND, or until the channel has turned READY, then lets it go. With one Go
//! processor (`.ci/csi-sanity`) nothing of the connection runs while that thread is held; but
//! a thread held that long is preempted as soon as it runs again (the runtime asked for it
//! while it was held), so the handshake may still win the race, as it can on a real machine
//! whose thread was off the CPU past the runtime's preemption tick. The spec's second attempt
//! (`--ginkgo.flake-attempts=2`) connects anew. Either way csi-sanity must pass its spec;
//! without both defences it fails with "Connection timed out". Garbage collection is off in
//! csi-sanity here: a collection's stop of the world would wait for the held thread and stop
//! the connection's goroutines too, which is not what a thread off the CPU does to a process.
//!
//! Needs the csi-sanity binary (as `.ci/sanity` finds it; skipped without one) and gdb
//! (`.ci/deps` installs it). Run as root.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use moor_privileged::Sandbox;
use moor_privileged::client::{DEADLINE, Daemon, spawn_guarded};
use moor_privileged::gosym::GoBinary;

/// csi-test's connect, the grpc-go dial it makes and where a channel's state changes.
const CONNECT: &str = "github.com/kubernetes-csi/csi-test/v5/utils.Connect";
const DIAL: &str = "google.golang.org/grpc.DialContext";
const UPDATE_STATE: &str = "google.golang.org/grpc.(*connectivityStateManager).updateState";

/// How long the hold may wait for the channel to turn READY: generous for a busy machine, where
/// an unfixed csi-sanity gets there in milliseconds; a fixed one never does while held.
const HOLD_BOUND: Duration = Duration::from_secs(20);

/// gdb's script (Python): follows the wrapper's exec of csi-sanity, holds the thread that
/// returns from the dial, arms a breakpoint on the channel's state turning READY
/// (`updateState`'s state argument, in RBX under Go's register ABI, is 2), follows that call
/// to its return, then lets the held thread go.
const HOLD_SCRIPT: &str = r#"
import gdb, os, threading

HOLD_AT = int(os.environ["MOOR_HOLD_AT"], 0)
READY_AT = int(os.environ["MOOR_READY_AT"], 0)
BOUND = float(os.environ["MOOR_HOLD_BOUND"])
st = {"execd": False, "held": None, "released": False, "bps": {}}

def log(m):
    print("hold: " + m, flush=True)

def go_on(num):
    gdb.execute("thread %d" % num, to_string=True)
    gdb.execute("continue &", to_string=True)

def drop(name):
    b = st["bps"].pop(name, None)
    if b is not None and b.is_valid():
        b.delete()

def release(why):
    if st["released"] or st["held"] is None:
        return
    st["released"] = True
    for name in list(st["bps"]):
        drop(name)
    log("released the thread running Connect: " + why)
    go_on(st["held"])

def armed():
    for b in gdb.breakpoints() or ():
        b.delete()
    st["bps"]["hold"] = gdb.Breakpoint("*%#x" % HOLD_AT)
    ready = gdb.Breakpoint("*%#x" % READY_AT)
    ready.condition = "$rbx == 2"
    st["bps"]["ready"] = ready

def on_stop(ev):
    t = ev.inferior_thread or gdb.selected_thread()
    num = t.num
    if not st["execd"]:
        st["execd"] = True
        gdb.post_event(lambda: (armed(), go_on(num)))
        return
    hit = [n for n, b in st["bps"].items() if isinstance(ev, gdb.BreakpointEvent) and b in ev.breakpoints]
    if "hold" in hit and st["held"] is None:
        st["held"] = num
        log("holding the thread running Connect (thread %d) after its dial returned" % num)
        threading.Timer(BOUND, lambda: gdb.post_event(lambda: release("the channel did not turn READY while it was held"))).start()
        return
    if "ready" in hit and st["held"] is not None and not st["released"]:
        ret = int(gdb.parse_and_eval("*(unsigned long *)$rsp"))
        def follow():
            b = gdb.Breakpoint("*%#x" % ret)
            b.thread = num
            st["bps"]["done"] = b
            go_on(num)
        gdb.post_event(follow)
        return
    if "done" in hit:
        def ready():
            log("the channel turned READY while the thread running Connect was held")
            drop("done")
            release("the channel is READY")
            go_on(num)
        gdb.post_event(ready)
        return
    if "ready" in hit:
        log("the channel turned READY before the hold")
    gdb.post_event(lambda: go_on(num))

def on_exit(ev):
    log("csi-sanity exited with %s" % getattr(ev, "exit_code", "?"))
    gdb.post_event(lambda: gdb.execute("quit"))

gdb.events.stop.connect(on_stop)
gdb.events.exited.connect(on_exit)
gdb.execute("set pagination off")
gdb.execute("set confirm off")
gdb.execute("set non-stop on")
gdb.execute("handle all nostop noprint pass")
gdb.execute("catch exec")
gdb.execute("run &")
"#;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the workspace")
        .to_path_buf()
}

/// The csi-sanity binary `.ci/csi-sanity` runs, or None when there is none.
fn sanity_binary() -> Option<PathBuf> {
    let out = Command::new("bash")
        .arg(repo().join(".ci/csi-sanity"))
        .arg("--which")
        .output()
        .expect("run .ci/csi-sanity --which");
    let path = String::from_utf8_lossy(&out.stdout).trim().to_string();
    (out.status.success() && !path.is_empty()).then(|| PathBuf::from(path))
}

#[test]
fn connect_survives_a_connection_ready_before_it_looks() {
    let sb = Sandbox::new("sanity-connect");
    let Some(sanity) = sanity_binary() else {
        eprintln!(
            "skipped: no csi-sanity binary (set CSI_SANITY, put it on PATH, or at ../shared/tools/csi-sanity)"
        );
        return;
    };
    let go = GoBinary::load(&sanity).unwrap_or_else(|e| panic!("csi-sanity: {e}"));
    let holds = go.returns_from_calls(CONNECT, DIAL);
    let Some(ready_at) = go.function(UPDATE_STATE).map(|r| r.start) else {
        panic!("{}: no {UPDATE_STATE}", sanity.display());
    };
    let [hold_at] = holds.as_slice() else {
        eprintln!(
            "skipped: {}'s {CONNECT} makes {} calls to {DIAL}, not the one this test holds after",
            sanity.display(),
            holds.len()
        );
        return;
    };
    let gdb_there = Command::new("gdb")
        .arg("--version")
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    assert!(gdb_there, "gdb is not installed (.ci/deps installs it)");

    let rt = moor_privileged::runtime();
    let socket = sb.root.join("controller.sock");
    let data = sb.data.join("controller").display().to_string();
    let _controller = rt.block_on(Daemon::start_program(
        "moor-controller",
        &socket,
        &["--node-id", "node-a", "--data-dir", data.as_str()],
    ));

    let script = sb.root.join("hold.py");
    std::fs::write(&script, HOLD_SCRIPT).expect("write the gdb script");
    let log = sb.root.join("gdb.log");
    let out = std::fs::File::create(&log).expect("gdb log");
    let mut gdb = spawn_guarded(
        Command::new("gdb")
            .args(["-q", "-nx", "-x"])
            .arg(&script)
            .arg("--args")
            .arg("bash")
            .arg(repo().join(".ci/csi-sanity"))
            .arg(format!("--csi.endpoint=unix://{}", socket.display()))
            .arg(format!(
                "--csi.stagingdir={}",
                sb.root.join("staging").display()
            ))
            .arg(format!(
                "--csi.mountdir={}",
                sb.root.join("mount").display()
            ))
            .arg("--ginkgo.no-color")
            .arg("--ginkgo.focus=Identity Service GetPluginInfo")
            .env("CSI_SANITY", &sanity)
            .env("GOGC", "off")
            .env("MOOR_HOLD_AT", format!("{hold_at:#x}"))
            .env("MOOR_READY_AT", format!("{ready_at:#x}"))
            .env("MOOR_HOLD_BOUND", HOLD_BOUND.as_secs().to_string())
            // gdb ends at the end of its input: it is held open until gdb quits.
            .stdin(Stdio::piped())
            .stdout(out.try_clone().expect("log"))
            .stderr(out),
    );
    let mut input = gdb.stdin.take().expect("gdb's stdin");
    // csi-sanity's Connect gives up after a minute, and a second attempt may follow; the hold
    // ends after HOLD_BOUND.
    let bound = DEADLINE + HOLD_BOUND + Duration::from_secs(60);
    let start = Instant::now();
    while gdb.try_wait().expect("wait for gdb").is_none() {
        assert!(
            start.elapsed() < bound,
            "csi-sanity under gdb did not finish within {bound:?}; its output:\n{}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let _ = input.flush();
    drop(input);
    let text = std::fs::read_to_string(&log).expect("gdb log");
    let holds: Vec<&str> = text.lines().filter(|l| l.starts_with("hold: ")).collect();
    assert!(
        holds
            .iter()
            .any(|l| l.contains("holding the thread running Connect")),
        "the thread running Connect was never held, so this run shows nothing; output:\n{text}"
    );
    assert!(
        text.contains("1 Passed | 0 Failed"),
        "csi-sanity did not connect once its connection was READY before Connect looked \
         (issue 34; .ci/csi-sanity must run it with one Go processor and a second attempt):\n{}\n\noutput:\n{text}",
        holds.join("\n")
    );
}
