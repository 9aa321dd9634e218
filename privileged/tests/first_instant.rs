//! A client that dials as grpc-go does (the connection preface, an empty SETTINGS, then its
//! call) at the instant a daemon's socket appears, the rename that puts it in place as
//! inotify reports it, is answered: the CSI sockets of moor-node and moor-controller, and
//! moor-node's registration socket, which kubelet's plugin watcher dials as soon as it sees
//! it. The daemon may still be starting then (the accept loop runs a moment after the rename):
//! the connection waits in the socket's backlog and is served, never dropped or left unread
//! (issue 34 suspected this path; the cause was csi-sanity's own). Run as root.

use std::collections::HashSet;
use std::path::Path;
use std::time::Instant;

use moor_privileged::Sandbox;
use moor_privileged::client::{DEADLINE, Daemon};
use moor_privileged::pathgrpc::PathClient;
use moor_proto::csi::v1 as csi;
use moor_proto::registration::v1 as reg;
use rustix::fs::inotify;

/// Watches `dirs` for names arriving (created or renamed in), and keeps every name it saw
/// (one read can bring several).
struct Arrivals(rustix::fd::OwnedFd, std::cell::RefCell<HashSet<Vec<u8>>>);

impl Arrivals {
    fn watch(dirs: &[&Path]) -> Self {
        let fd = inotify::init(inotify::CreateFlags::NONBLOCK | inotify::CreateFlags::CLOEXEC)
            .expect("inotify");
        for d in dirs {
            std::fs::create_dir_all(d).expect("watched dir");
            inotify::add_watch(
                &fd,
                *d,
                inotify::WatchFlags::CREATE | inotify::WatchFlags::MOVED_TO,
            )
            .expect("inotify watch");
        }
        Self(fd, std::cell::RefCell::new(HashSet::new()))
    }

    /// Returns as soon as a file named `name` has arrived in a watched dir; panics after
    /// [`DEADLINE`] (or once `daemon` exited).
    fn wait_for(&self, name: &str, daemon: &mut Daemon, log: &Path) {
        let log = || std::fs::read_to_string(log).unwrap_or_default();
        let start = Instant::now();
        let mut buf = [std::mem::MaybeUninit::uninit(); 4096];
        loop {
            let mut events = inotify::Reader::new(&self.0, &mut buf);
            loop {
                match events.next() {
                    Ok(e) => {
                        if let Some(n) = e.file_name() {
                            self.1.borrow_mut().insert(n.to_bytes().to_vec());
                        }
                    }
                    Err(rustix::io::Errno::AGAIN) => break,
                    Err(e) => panic!("inotify: {e}"),
                }
            }
            if self.1.borrow().contains(name.as_bytes()) {
                return;
            }
            if let Some(why) = moor_runtime::client::exited(&mut daemon.child) {
                panic!(
                    "the daemon {why} before {name} appeared; its log:\n{}",
                    log()
                );
            }
            assert!(
                start.elapsed() < DEADLINE,
                "{name} did not appear within {DEADLINE:?}; the daemon's log:\n{}",
                log()
            );
            // Readable again once an event comes: wait for it, not for a time.
            let mut poll = [rustix::event::PollFd::new(
                &self.0,
                rustix::event::PollFlags::IN,
            )];
            let _ = rustix::event::poll(
                &mut poll,
                Some(&rustix::event::Timespec {
                    tv_sec: 1,
                    tv_nsec: 0,
                }),
            );
        }
    }
}

/// Dials `socket` the instant it appears and calls Identity's Probe.
fn probe_at_first_instant(socket: &Path) {
    let mut c = PathClient::dial_with_authority(socket, b"localhost").expect("dial");
    let _: csi::ProbeResponse = c
        .unary("/csi.v1.Identity/Probe", &csi::ProbeRequest {})
        .unwrap_or_else(|e| panic!("Probe on {} at its first instant: {e}", socket.display()));
}

#[test]
fn moor_node_answers_at_the_first_instant_of_each_socket() {
    let sb = Sandbox::new("first-instant-node");
    let dir = sb.root.join("csi");
    let registry = sb.k("plugins_registry");
    let socket = dir.join("csi.sock");
    let arrivals = Arrivals::watch(&[&dir, &registry]);
    let registry_arg = registry.display().to_string();
    let log = sb.root.join("node.log");
    let mut node = Daemon::spawn_logged(
        "moor-node",
        &socket,
        &sb.node_args("node-a", &["--registration-dir", &registry_arg]),
        &log,
    );
    arrivals.wait_for("csi.sock", &mut node, &log);
    probe_at_first_instant(&socket);
    // The registration socket comes last; kubelet's plugin watcher dials it on sight.
    let reg_name = "moor.csi.io-reg.sock";
    arrivals.wait_for(reg_name, &mut node, &log);
    let mut c = PathClient::dial(&registry.join(reg_name)).expect("dial the registration socket");
    let info: reg::PluginInfo = c
        .unary(
            "/pluginregistration.Registration/GetInfo",
            &reg::InfoRequest {},
        )
        .unwrap_or_else(|e| panic!("GetInfo at the registration socket's first instant: {e}"));
    assert_eq!(info.name, "moor.csi.io");
}

#[test]
fn moor_controller_answers_at_the_first_instant_of_its_socket() {
    let sb = Sandbox::new("first-instant-controller");
    let dir = sb.root.join("controller");
    let socket = dir.join("csi.sock");
    let arrivals = Arrivals::watch(&[&dir]);
    let data = sb.data.join("controller").display().to_string();
    let log = sb.root.join("controller.log");
    let mut controller = Daemon::spawn_logged(
        "moor-controller",
        &socket,
        &["--node-id", "node-a", "--data-dir", data.as_str()],
        &log,
    );
    arrivals.wait_for("csi.sock", &mut controller, &log);
    probe_at_first_instant(&socket);
}
