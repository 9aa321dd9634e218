//! The real `moorctl` binary against real daemons (run as root after `cargo build --bins`):
//! CSI round trips, `status` verdicts made for real (a healthy volume, a target unmounted behind
//! moor's back, a loop device detached behind its back, a dead FUSE mount), exit codes, help,
//! completion, and the demo end to end, also interrupted, leaving nothing behind.
//!
//! One file, over the usual length: each test drives the one `moorctl` binary against one
//! shared world of real daemons; the world's setup is most of the file.

use std::io::{BufRead as _, BufReader};
use std::os::fd::AsRawFd as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use moor_privileged::client::{DEADLINE, Daemon, binary, spawn_guarded};
use moor_privileged::{
    LoopSweep, Sandbox, loops_under, mounts_under, no_loops_under, processes_mentioning,
};
use serde_json::Value;

const MIB: u64 = 1 << 20;
const NODE: &str = "node-m";

/// Runs moorctl with `args`; stdin closed, output captured.
fn moorctl(args: &[&str]) -> Output {
    let bin = binary("moorctl");
    assert!(
        bin.exists(),
        "{} is not built (cargo build --bins)",
        bin.display()
    );
    Command::new(bin)
        .args(args)
        .env_remove("CSI_ENDPOINT")
        .stdin(Stdio::null())
        .output()
        .expect("run moorctl")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Runs moorctl and expects exit 0; returns stdout.
fn ok(args: &[&str]) -> String {
    let out = moorctl(args);
    assert!(
        out.status.success(),
        "moorctl {args:?} failed ({}): {}{}",
        out.status,
        text(&out.stdout),
        text(&out.stderr)
    );
    text(&out.stdout)
}

/// Runs moorctl with `--output json` and expects exit 0.
fn json(args: &[&str]) -> Value {
    let mut all = args.to_vec();
    all.extend(["--output", "json"]);
    let out = ok(&all);
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("moorctl {args:?}: {e}: {out}"))
}

/// A sandbox with moor-controller and moor-node running in it. Fields drop in order: the
/// daemons stop, then the sweep, then the sandbox's own cleanup.
struct World {
    daemons: Vec<Daemon>,
    _sweep: LoopSweep,
    sb: Sandbox,
    node_ep: String,
    ctl_ep: String,
}

impl World {
    fn new(name: &str, with_controller: bool) -> Self {
        let sb = Sandbox::new(name);
        let sweep = LoopSweep(sb.root.clone());
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("rt");
        let node_sock = sb.root.join("node.sock");
        let ctl_sock = sb.root.join("ctl.sock");
        let data = sb.data.join("controller").display().to_string();
        let mut daemons = vec![rt.block_on(Daemon::start(&node_sock, &sb.node_args(NODE, &[])))];
        if with_controller {
            daemons.push(rt.block_on(Daemon::start_program(
                "moor-controller",
                &ctl_sock,
                &["--node-id", NODE, "--data-dir", &data],
            )));
        }
        Self {
            daemons,
            _sweep: sweep,
            node_ep: format!("unix://{}", node_sock.display()),
            ctl_ep: node_sock_plain(&ctl_sock),
            sb,
        }
    }

    /// moorctl against the node socket.
    fn node(&self, args: &[&str]) -> Vec<String> {
        let mut v = vec!["--endpoint".to_string(), self.node_ep.clone()];
        v.extend(args.iter().map(|s| (*s).to_string()));
        v
    }

    /// moorctl against the controller socket.
    fn ctl(&self, args: &[&str]) -> Vec<String> {
        let mut v = vec!["--endpoint".to_string(), self.ctl_ep.clone()];
        v.extend(args.iter().map(|s| (*s).to_string()));
        v
    }

    fn status(&self) -> (Option<i32>, Value, String) {
        let state = self.sb.state.display().to_string();
        let out = moorctl(&["status", "--state-dir", &state, "--output", "json"]);
        let v: Value = serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|e| panic!("status json: {e}: {}", text(&out.stdout)));
        let table = moorctl(&["status", "--state-dir", &state]);
        assert_eq!(table.status.code(), out.status.code());
        (out.status.code(), v, text(&table.stdout))
    }
}

/// The controller endpoint given as a plain path (both forms must work).
fn node_sock_plain(p: &Path) -> String {
    p.display().to_string()
}

fn strs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

fn verdict_of<'a>(status: &'a Value, volume: &str) -> &'a str {
    status["volumes"]
        .as_array()
        .and_then(|vs| vs.iter().find(|v| v["volume_id"] == volume))
        .and_then(|v| v["verdict"].as_str())
        .unwrap_or_else(|| panic!("no {volume} in {status:#}"))
}

/// `probe --wait`: what the test command's scripts wait for a daemon with.
#[test]
fn probe_waits_until_a_starting_daemon_answers_and_no_longer_than_it_lives() {
    let sb = Sandbox::new("moorctl-wait");
    let socket = sb.root.join("node.sock");
    let ep = format!("unix://{}", socket.display());
    let out = moorctl(&["--endpoint", &ep, "probe", "--wait", "1"]);
    assert_eq!(out.status.code(), Some(3), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains(&format!(
            "nothing answered a call on {} within 1s",
            socket.display()
        )),
        "{}",
        text(&out.stderr)
    );
    // A daemon that is gone ends the wait at once, not after the 120 s.
    let mut gone = spawn_guarded(&mut Command::new("true"));
    let pid = gone.id().to_string();
    let start = std::time::Instant::now();
    let out = moorctl(&[
        "--endpoint",
        &ep,
        "probe",
        "--wait",
        "120",
        "--wait-pid",
        &pid,
    ]);
    assert!(
        start.elapsed() < std::time::Duration::from_secs(60),
        "waited {:?} for a process that had exited",
        start.elapsed()
    );
    assert_eq!(out.status.code(), Some(3));
    assert!(
        text(&out.stderr).contains(&format!("process {pid} exited before it answered")),
        "{}",
        text(&out.stderr)
    );
    let _ = gone.wait();
    // moorctl started beside the daemon answers once the daemon does.
    let mut waiting = spawn_guarded(
        Command::new(binary("moorctl"))
            .args(["--endpoint", &ep, "probe", "--wait", "120"])
            .stdin(Stdio::null())
            .stdout(Stdio::piped()),
    );
    let rt = moor_privileged::runtime();
    let mut node = rt.block_on(Daemon::start(&socket, &sb.node_args(NODE, &[])));
    let status = waiting.wait().expect("wait");
    let mut said = String::new();
    if let Some(mut o) = waiting.stdout.take() {
        let _ = std::io::Read::read_to_string(&mut o, &mut said);
    }
    assert!(status.success(), "{status}: {said}");
    assert!(said.contains("the plugin is ready"), "{said}");
    drop(rt);
    assert!(node.terminate().success());
}

#[test]
fn moorctl_drives_a_whole_volume_life_against_real_daemons() {
    let w = World::new("moorctl-life", true);

    // info on each socket: identity, then the service that socket serves.
    let ci = json(&strs(&w.ctl(&["info"])));
    assert_eq!(ci["name"], "moor.csi.io");
    assert_eq!(ci["ready"], true);
    let caps = ci["controller"]["capabilities"].to_string();
    assert!(caps.contains("CREATE_DELETE_VOLUME"), "{caps}");
    assert!(ci.get("node").is_none(), "{ci:#}");
    let ni = json(&strs(&w.node(&["info"])));
    assert_eq!(ni["node"]["node_id"], NODE);
    assert!(
        ni["node"]["capabilities"]
            .to_string()
            .contains("STAGE_UNSTAGE_VOLUME")
    );
    let table = ok(&strs(&w.node(&["info"])));
    assert!(table.contains("node id") && table.contains(NODE), "{table}");
    assert_eq!(ok(&strs(&w.node(&["probe"]))), "the plugin is ready\n");

    // Controller: create, list, get, attach.
    let v = json(&strs(&w.ctl(&[
        "volume",
        "create",
        "life",
        "--size",
        "300MiB",
        "--fs-type",
        "xfs",
    ])));
    let id = v["volume_id"].as_str().expect("volume id").to_string();
    assert_eq!(v["capacity_bytes"], 300 * MIB);
    let list = json(&strs(&w.ctl(&["volume", "list"])));
    assert_eq!(list.as_array().map(Vec::len), Some(1), "{list:#}");
    assert_eq!(list[0]["volume_id"], id.as_str());
    let listed = ok(&strs(&w.ctl(&["volume", "list"])));
    assert!(
        listed.starts_with("VOLUME") && listed.contains(&id) && listed.contains("300 MiB"),
        "{listed}"
    );
    let got = json(&strs(&w.ctl(&["volume", "get", &id])));
    assert_eq!(got["volume_id"], id.as_str());
    let ctx = json(&strs(&w.ctl(&[
        "publish",
        &id,
        "--node",
        NODE,
        "--fs-type",
        "xfs",
    ])));
    let dev = ctx["publish_context"]["devicePath"]
        .as_str()
        .expect("devicePath")
        .to_string();
    let backing = ctx["publish_context"]["backingFile"]
        .as_str()
        .expect("backingFile")
        .to_string();
    assert!(dev.starts_with("/dev/loop"), "{dev}");

    // Node: kubelet's calls by hand.
    let staging = w.sb.staging("life");
    let target = w.sb.target("pod", "life");
    let (st, tg) = (staging.display().to_string(), target.display().to_string());
    let out = ok(&strs(&w.node(&[
        "stage",
        &id,
        "--staging",
        &st,
        "--context",
        &format!("devicePath={dev}"),
        "--context",
        &format!("backingFile={backing}"),
        "--fs-type",
        "xfs",
    ])));
    assert_eq!(out, format!("volume {id} is staged at {st}\n"));
    ok(&strs(&w.node(&[
        "mount",
        &id,
        "--staging",
        &st,
        "--target",
        &tg,
        "--fs-type",
        "xfs",
    ])));
    assert!(moor_privileged::is_mount_point(&target));
    std::fs::write(target.join("f"), b"via moorctl").expect("write");
    let stats = json(&strs(&w.node(&["stats", &id, "--path", &tg])));
    assert_eq!(stats["condition"]["abnormal"], false, "{stats:#}");
    assert_eq!(stats["usage"][0]["unit"], "BYTES");
    assert!(stats["usage"][0]["total"].as_i64().unwrap_or(0) > 0);
    let (code, status, table) = w.status();
    assert_eq!(code, Some(0), "{table}");
    assert_eq!(verdict_of(&status, &id), "healthy");
    assert!(table.contains("healthy") && table.contains(&tg), "{table}");
    // The node's endpoint alone finds its records: moor-node names its state dir.
    let by_endpoint = json(&strs(&w.node(&["status"])));
    assert_eq!(by_endpoint["state_dir"], w.sb.state.display().to_string());
    assert_eq!(by_endpoint["volumes"], status["volumes"]);
    // The controller's endpoint names none: a usage error that says so.
    let out = moorctl(&strs(&w.ctl(&["status"])));
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr)
            .contains("does not name a node's state dir (GetPluginInfo: component \"controller\")"),
        "{}",
        text(&out.stderr)
    );

    // Snapshots and expansion.
    let snap = json(&strs(&w.ctl(&[
        "snapshot",
        "create",
        "life-snap",
        "--volume",
        &id,
    ])));
    let sid = snap["snapshot_id"]
        .as_str()
        .expect("snapshot id")
        .to_string();
    let snaps = json(&strs(&w.ctl(&["snapshot", "list", "--volume", &id])));
    assert_eq!(snaps[0]["snapshot_id"], sid.as_str());
    ok(&strs(&w.ctl(&["snapshot", "delete", &sid])));
    assert_eq!(
        json(&strs(&w.ctl(&["snapshot", "list"]))),
        Value::Array(vec![])
    );
    let grown = json(&strs(&w.ctl(&[
        "volume",
        "expand",
        &id,
        "--size",
        "400MiB",
        "--fs-type",
        "xfs",
    ])));
    assert_eq!(grown["capacity_bytes"], 400 * MIB);

    // A call the driver refuses: exit 1, a sentence with the gRPC code name.
    let out = moorctl(&strs(&w.ctl(&["volume", "get", "vol-nonexistent"])));
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert!(
        err.starts_with("moorctl: ControllerGetVolume failed: NOT_FOUND: "),
        "{err}"
    );
    let out = moorctl(&strs(&w.ctl(&["volume", "delete", &id])));
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("DeleteVolume failed: FAILED_PRECONDITION: "),
        "{}",
        text(&out.stderr)
    );

    // Undo, as kubelet and the attacher would.
    assert_eq!(
        ok(&strs(&w.node(&["unmount", &id, "--target", &tg]))),
        format!("volume {id} is unmounted from {tg}\n")
    );
    ok(&strs(&w.node(&["unstage", &id, "--staging", &st])));
    assert!(mounts_under(&w.sb.root).is_empty());
    // The device holds xfs now: staging it as ext4 is refused, and the error says so.
    let out = moorctl(&strs(&w.node(&[
        "stage",
        &id,
        "--staging",
        &st,
        "--device",
        &dev,
        "--fs-type",
        "ext4",
    ])));
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.starts_with(&format!(
            "moorctl: NodeStageVolume failed: FAILED_PRECONDITION: device {dev} holds an xfs filesystem"
        )),
        "{err}"
    );
    assert!(mounts_under(&w.sb.root).is_empty());
    ok(&strs(&w.ctl(&["unpublish", &id, "--node", NODE])));
    ok(&strs(&w.ctl(&["volume", "delete", &id])));
    assert_eq!(
        json(&strs(&w.ctl(&["volume", "list"]))),
        Value::Array(vec![])
    );
    assert!(no_loops_under(&w.sb.root), "{:?}", loops_under(&w.sb.root));
    let (code, status, _) = w.status();
    assert_eq!((code, &status["volumes"]), (Some(0), &Value::Array(vec![])));
    drop(w.daemons);
}

/// Mounts a FUSE filesystem at `at` and closes its /dev/fuse descriptor: the connection is
/// aborted and every access to the mount fails with ENOTCONN.
fn dead_fuse_mount(at: &Path) {
    let fuse = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/fuse")
        .expect("open /dev/fuse");
    let opts = std::ffi::CString::new(format!(
        "fd={},rootmode=40000,user_id=0,group_id=0",
        fuse.as_raw_fd()
    ))
    .expect("options");
    rustix::mount::mount(
        "moor-test",
        at,
        "fuse",
        rustix::mount::MountFlags::empty(),
        Some(opts.as_c_str()),
    )
    .expect("mount fuse");
    drop(fuse);
}

/// A loop device on a new file under the sandbox, not held open (so it can be detached at
/// once); the world's sweep detaches it if the test fails.
///
/// Its number is a high one (losetup creates the device): once detached, a device is free
/// for anyone, and the kernel hands out the lowest free number first, so a low one could be
/// bound again by a concurrent test before `moorctl status` looks at it.
fn free_loop_device(w: &World, name: &str, size: u64) -> String {
    let file = w.sb.data.join(name);
    let f = std::fs::File::create(&file).expect("backing file");
    f.set_len(size).expect("size");
    drop(f);
    let mut last = String::new();
    for n in 900..964 {
        let dev = format!("/dev/loop{n}");
        let out = Command::new("losetup")
            .arg(&dev)
            .arg(&file)
            .output()
            .expect("losetup");
        if out.status.success() {
            return dev;
        }
        // Bound already (by another user of this machine): try the next number.
        last = text(&out.stderr);
    }
    panic!("no free loop device among loop900..loop963: {last}");
}

#[test]
fn status_verdicts_for_real_drift_corruption_and_a_lost_device() {
    let w = World::new("moorctl-status", false);
    let mut kept: Vec<(String, String, String, bool)> = Vec::new();
    let mut stage_and_mount = |vol: &str, dev: &str, block: bool| -> (String, String) {
        let staging = if block {
            w.sb.k(&format!(
                "plugins/kubernetes.io/csi/volumeDevices/staging/{vol}"
            ))
        } else {
            w.sb.staging(vol)
        };
        std::fs::create_dir_all(staging.parent().expect("parent")).expect("mkdir");
        let target = if block {
            w.sb.block_target("pod", vol)
        } else {
            w.sb.target("pod", vol)
        };
        let (st, tg) = (staging.display().to_string(), target.display().to_string());
        let mut cap = vec!["--fs-type", "ext4"];
        if block {
            cap = vec!["--block"];
        }
        let mut stage = vec!["stage", vol, "--staging", &st, "--device", dev];
        stage.extend(&cap);
        ok(&strs(&w.node(&stage)));
        let mut mount = vec!["mount", vol, "--staging", &st, "--target", &tg];
        mount.extend(&cap);
        ok(&strs(&w.node(&mount)));
        kept.push((vol.to_string(), st.clone(), tg.clone(), block));
        (st, tg)
    };

    let d1 = w.sb.loop_device("healthy.img", 64 * MIB);
    stage_and_mount("vol-healthy", &d1.display().to_string(), false);
    let d2 = w.sb.loop_device("drift.img", 64 * MIB);
    let (_, drift_target) = stage_and_mount("vol-drift", &d2.display().to_string(), false);
    let d3 = w.sb.loop_device("corrupt.img", 64 * MIB);
    let (_, corrupt_target) = stage_and_mount("vol-corrupt", &d3.display().to_string(), false);
    let d4 = free_loop_device(&w, "gone.img", 16 * MIB);
    stage_and_mount("vol-gone", &d4, true);

    let (code, status, _) = w.status();
    assert_eq!(code, Some(0), "{status:#}");
    for v in ["vol-healthy", "vol-drift", "vol-corrupt", "vol-gone"] {
        assert_eq!(verdict_of(&status, v), "healthy", "{status:#}");
    }

    // Behind moor's back: a target unmounted, a dead FUSE mount where a target was, a loop
    // device detached.
    rustix::mount::unmount(drift_target.as_str(), rustix::mount::UnmountFlags::empty())
        .expect("umount2 the target");
    rustix::mount::unmount(
        corrupt_target.as_str(),
        rustix::mount::UnmountFlags::empty(),
    )
    .expect("umount2 the target");
    dead_fuse_mount(Path::new(&corrupt_target));
    let st = Command::new("losetup")
        .arg("-d")
        .arg(&d4)
        .status()
        .expect("losetup -d");
    assert!(st.success());
    // The kernel unbinds on last close: a udev probe may hold the device for a moment.
    let bound = format!(
        "/sys/block/{}/loop/backing_file",
        d4.trim_start_matches("/dev/")
    );
    let start = std::time::Instant::now();
    while Path::new(&bound).exists() && start.elapsed() < DEADLINE {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    assert!(
        !Path::new(&bound).exists(),
        "the loop device is still attached {DEADLINE:?} after its detach"
    );

    let (code, status, table) = w.status();
    assert_eq!(code, Some(4), "{table}");
    assert_eq!(status["healthy"], false);
    assert_eq!(verdict_of(&status, "vol-healthy"), "healthy");
    assert_eq!(verdict_of(&status, "vol-drift"), "drifted");
    assert_eq!(verdict_of(&status, "vol-corrupt"), "corrupted");
    // A detached loop device opens and reads as 0 bytes: unknown, as moor-node sees it (only
    // a device whose path names nothing, or another device, is gone).
    assert_eq!(verdict_of(&status, "vol-gone"), "unknown");
    assert!(
        table.contains(&format!(
            "vol-drift: recorded as published but nothing is mounted there (publish {drift_target})"
        )),
        "{table}"
    );
    assert!(
        table.contains("vol-corrupt: the mount fails with ENOTCONN"),
        "{table}"
    );
    assert!(
        table.contains(&format!(
            "vol-gone: loop device {d4} has been detached: no backing file"
        )),
        "{table}"
    );
    assert!(
        table.contains("4 volumes in")
            && table.contains("1 healthy, 1 drifted, 1 unknown, 1 corrupted"),
        "{table}"
    );
    let out = moorctl(&["status", "--state-dir", &w.sb.state.display().to_string()]);
    assert!(
        text(&out.stderr).starts_with("moorctl: 4 volumes in "),
        "{}",
        text(&out.stderr)
    );

    // moor undoes all of it; the journal is then empty and status healthy.
    for (vol, st, tg, _) in kept.iter().rev() {
        ok(&strs(&w.node(&["unmount", vol, "--target", tg])));
        ok(&strs(&w.node(&["unstage", vol, "--staging", st])));
    }
    let (code, status, _) = w.status();
    assert_eq!(
        (code, &status["volumes"]),
        (Some(0), &Value::Array(vec![])),
        "{status:#}"
    );
    assert!(
        mounts_under(&w.sb.root).is_empty(),
        "{:?}",
        mounts_under(&w.sb.root)
    );
}

#[test]
fn status_reports_an_unreadable_journal_record() {
    moor_privileged::require_root();
    let dir = std::env::temp_dir().join(format!("moorctl-journal-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("mkdir");
    let bad = dir.join(moor_node::journal::LOG_FILE);
    std::fs::write(&bad, b"moor-journal v1 00000000 {}\n").expect("write");
    let out = moorctl(&["status", "--state-dir", &dir.display().to_string()]);
    let json_out = moorctl(&[
        "status",
        "--state-dir",
        &dir.display().to_string(),
        "-o",
        "json",
    ]);
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(out.status.code(), Some(4));
    let stdout = text(&out.stdout);
    assert!(
        stdout.contains(&format!(
            "unreadable journal record {}:1: checksum mismatch",
            bad.display()
        )),
        "{stdout}"
    );
    let v: Value = serde_json::from_slice(&json_out.stdout).expect("json");
    assert_eq!(v["journal_problems"][0]["error"], "checksum mismatch");
    // A state dir that was never used: nothing staged, healthy.
    let out = moorctl(&["status", "--state-dir", "/nonexistent/moor-state"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert!(text(&out.stdout).starts_with("0 volumes in /nonexistent/moor-state"));
}

#[test]
fn exit_codes_help_and_completion() {
    // Nothing listens: exit 3, the endpoint named.
    let out = moorctl(&["--endpoint", "/nonexistent/csi.sock", "probe"]);
    assert_eq!(out.status.code(), Some(3));
    let err = text(&out.stderr);
    assert!(
        err.starts_with("moorctl: cannot connect to /nonexistent/csi.sock: "),
        "{err}"
    );
    // Usage errors: exit 2.
    assert_eq!(
        moorctl(&["volume", "create", "x", "--size", "lots"])
            .status
            .code(),
        Some(2)
    );
    assert_eq!(moorctl(&["no-such-command"]).status.code(), Some(2));
    let out = moorctl(&["--endpoint", "tcp://10.0.0.1:9000", "probe"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("is not a Unix socket endpoint"));

    let commands: &[&[&str]] = &[
        &[],
        &["info"],
        &["probe"],
        &["volume"],
        &["volume", "create"],
        &["volume", "delete"],
        &["volume", "list"],
        &["volume", "get"],
        &["volume", "expand"],
        &["snapshot"],
        &["snapshot", "create"],
        &["snapshot", "delete"],
        &["snapshot", "list"],
        &["publish"],
        &["unpublish"],
        &["stage"],
        &["unstage"],
        &["mount"],
        &["unmount"],
        &["stats"],
        &["status"],
        &["demo"],
        &["completion"],
    ];
    for cmd in commands {
        let mut args = cmd.to_vec();
        args.push("--help");
        let out = moorctl(&args);
        assert!(out.status.success(), "{args:?}");
        let help = text(&out.stdout);
        assert!(help.contains("Usage: moorctl"), "{args:?}: {help}");
        if !matches!(*cmd, ["volume"] | ["snapshot"]) {
            assert!(help.contains("Exit codes:"), "{args:?}: {help}");
        }
    }
    for shell in ["bash", "zsh", "fish", "elvish", "powershell"] {
        let script = ok(&["completion", shell]);
        assert!(script.contains("moorctl") && script.len() > 500, "{shell}");
    }
    assert_eq!(moorctl(&["completion", "tcsh"]).status.code(), Some(2));
}

/// The demo's temp dir, from its first line.
fn demo_dir(first_line: &str) -> PathBuf {
    let rest = first_line
        .strip_prefix("moor demo in ")
        .unwrap_or_else(|| panic!("first line: {first_line}"));
    PathBuf::from(rest.split(':').next().unwrap_or_default())
}

fn host_mounts_under(root: &Path) -> Vec<PathBuf> {
    let table = std::fs::read("/proc/self/mountinfo").expect("mountinfo");
    moor_node::sys::mountinfo::parse(&table)
        .expect("parse")
        .into_iter()
        .map(|m| m.mount_point)
        .filter(|p| p.starts_with(root))
        .collect()
}

#[test]
fn the_demo_walks_a_volume_life_and_leaves_nothing_behind() {
    moor_privileged::require_root();
    let out = moorctl(&["demo"]);
    let stdout = text(&out.stdout);
    let dir = demo_dir(stdout.lines().next().unwrap_or_default());
    assert!(out.status.success(), "{stdout}{}", text(&out.stderr));
    for step in [
        "ok    NodeStageVolume demo (probe: blank, mkfs.xfs, mount)",
        "ok    moorctl status (journal against the mount table)",
        "ok    read hello.txt back from the restored volume",
        "ok    NodeExpandVolume demo online",
        "ok    write and read 4 KiB through the block device",
        "ok    ControllerUnpublishVolume demo-block (detach)",
        "ok    DeleteVolume demo",
        "ok    stop moor-node (SIGTERM)",
    ] {
        assert!(stdout.contains(step), "{step} missing:\n{stdout}");
    }
    assert!(stdout.contains(" ms\n"));
    assert!(stdout.ends_with("every step passed, and everything it made is gone.\n"));
    assert!(!dir.exists(), "{} is left", dir.display());
    assert!(no_loops_under(&dir), "{:?}", loops_under(&dir));
    assert!(host_mounts_under(&dir).is_empty());
}

#[test]
fn an_interrupted_demo_cleans_up_and_says_where_it_stopped() {
    moor_privileged::require_root();
    let mut child = spawn_guarded(
        Command::new(binary("moorctl"))
            .arg("demo")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped()),
    );
    let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
    let first = lines.next().and_then(Result::ok).unwrap_or_default();
    let dir = demo_dir(&first);
    let mut seen = vec![first];
    for line in lines.by_ref() {
        let line = line.unwrap_or_default();
        let published = line.contains("ok    NodePublishVolume demo ");
        seen.push(line);
        if published {
            break;
        }
    }
    let pid = rustix::process::Pid::from_raw(child.id() as i32).expect("pid");
    rustix::process::kill_process(pid, rustix::process::Signal::INT).expect("SIGINT");
    seen.extend(lines.map(Result::unwrap_or_default));
    let status = child.wait().expect("wait");
    let mut stderr = String::new();
    if let Some(mut e) = child.stderr.take() {
        let _ = std::io::Read::read_to_string(&mut e, &mut stderr);
    }
    let all = seen.join("\n");
    assert_eq!(status.code(), Some(5), "{all}\n{stderr}");
    assert!(
        all.contains("interrupted by SIGINT before this step"),
        "{all}"
    );
    assert!(all.contains("ok    NodeUnpublishVolume demo"), "{all}");
    assert!(all.contains("ok    NodeUnstageVolume demo"), "{all}");
    assert!(all.contains("ok    DeleteVolume demo"), "{all}");
    assert!(all.contains("moor demo failed at step"), "{all}");
    assert!(
        stderr.contains("moorctl: the demo failed at step \""),
        "{stderr}"
    );
    assert!(!dir.exists(), "{} is left", dir.display());
    assert!(no_loops_under(&dir), "{:?}", loops_under(&dir));
    assert!(host_mounts_under(&dir).is_empty());
}

#[test]
fn a_failing_demo_step_is_named_with_its_reason_and_cleaned_up() {
    moor_privileged::require_root();
    // A moor-node that dies at start, next to the real moor-controller.
    let bins = std::env::temp_dir().join(format!("moorctl-bins-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&bins);
    std::fs::create_dir_all(&bins).expect("mkdir");
    std::os::unix::fs::symlink(binary("moor-controller"), bins.join("moor-controller"))
        .expect("symlink");
    let fake = bins.join("moor-node");
    std::fs::write(
        &fake,
        "#!/bin/sh\necho 'cannot open the state dir' >&2\nexit 7\n",
    )
    .expect("write");
    std::fs::set_permissions(&fake, std::os::unix::fs::PermissionsExt::from_mode(0o755))
        .expect("chmod");
    let out = moorctl(&["demo", "--bin-dir", &bins.display().to_string()]);
    let _ = std::fs::remove_dir_all(&bins);
    let stdout = text(&out.stdout);
    let stderr = text(&out.stderr);
    let dir = demo_dir(stdout.lines().next().unwrap_or_default());
    assert_eq!(out.status.code(), Some(5), "{stdout}{stderr}");
    assert!(
        stdout.contains("FAIL  start moor-controller and moor-node"),
        "{stdout}"
    );
    assert!(
        stderr.contains(
            "moorctl: the demo failed at step \"start moor-controller and moor-node\": \
             moor-node exited at start (exit status: 7): cannot open the state dir"
        ),
        "{stderr}"
    );
    assert!(
        stdout.contains("ok    stop moor-controller (SIGTERM)"),
        "{stdout}"
    );
    assert!(!dir.exists(), "{} is left", dir.display());
    assert!(no_loops_under(&dir));
}

#[test]
fn a_killed_demo_takes_its_daemons_and_mounts_with_it() {
    moor_privileged::require_root();
    let mut child = spawn_guarded(
        Command::new(binary("moorctl"))
            .arg("demo")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null()),
    );
    let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
    let dir = demo_dir(&lines.next().and_then(Result::ok).unwrap_or_default());
    // The sweep detaches what the killed demo could not (its controller's loop devices).
    let _sweep = LoopSweep(dir.clone());
    for line in lines.by_ref() {
        if line
            .unwrap_or_default()
            .contains("ok    NodePublishVolume demo ")
        {
            break;
        }
    }
    // With the separator: another demo's dir may extend this one's name (moor-demo-12 and
    // moor-demo-123).
    let needle = format!("{}/", dir.display());
    assert_eq!(processes_mentioning(&needle).len(), 2, "both daemons run");
    child.kill().expect("SIGKILL");
    let _ = child.wait();
    drop(lines);
    let start = std::time::Instant::now();
    while !processes_mentioning(&needle).is_empty() && start.elapsed() < DEADLINE {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert!(
        processes_mentioning(&needle).is_empty(),
        "{:?}",
        processes_mentioning(&needle)
    );
    // Its mounts lived in its own namespace, gone with its last process.
    assert!(host_mounts_under(&dir).is_empty());
    let _ = std::fs::remove_dir_all(&dir);
}
