//! moor-ublk: an RBD image served through librbd as a ublk device (`/dev/ublkbN`), which a new
//! server process takes over after the old one died (ublk's user recovery, Linux 6.0+): the
//! attacher whose mappings survive an upgrade of moor-node without the kernel client (issue
//! 38; docs/upgrade.md).
//!
//! A map starts `moor-ublk add` for the one image, a child of moor-node in a session of its
//! own (moor-ublk calls setsid: a signal to moor-node's process group does not reach it), its
//! output in `<state-dir>/ublk/<name>.log`. It prints the device's number once it serves it;
//! the attacher keeps what a new moor-node needs to take the device over in
//! `<state-dir>/ublk/<name>.json` (the device number, the user, the monitors) and the key in
//! `<state-dir>/ublk/.<name>.key` (0600, in a 0700 dir under the state dir, which is root's),
//! both until the unmap: a recovery connects to the cluster again, and kubelet gives the
//! stage's secrets only to NodeStageVolume. The device's number is also in the journal's
//! mapping record, as its device (`/dev/ublkbN`, stable across recoveries).
//!
//! When the server dies (a rolling update kills moor-node's container, and the servers in its
//! cgroup with it) the driver quiesces the device: its requests wait, the filesystem on it stays
//! mounted. [`Attacher::recover`], which reconciliation calls for each journaled mapping in use
//! (the start's pass, before moor-node answers kubelet, and every pass after), asks the driver
//! (`moor-ublk info`) and, for a quiesced device, starts `moor-ublk recover`: the requests the
//! dead server held are issued again to the new one.
//!
//! An unmap refuses a device that is mounted or claimed (an exclusive open fails), then deletes
//! it (`moor-ublk delete`): its server ends, and is waited for. What this attacher does not do
//! yet: read-only mappings and resizing (moor-ublk has neither), and a device the driver made
//! but no `.json` names (a crash between the driver's ADD_DEV and the server's first line) is
//! left for the node's reboot.

use std::io::{BufRead as _, BufReader, Write as _};
use std::os::unix::fs::{DirBuilderExt as _, OpenOptionsExt as _};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use rustix::fs::{Mode, OFlags};
use rustix::process::Pid;
use serde::{Deserialize, Serialize};
use tracing::{info, warn};

use super::fuse::{dir_name, parse_dir_name};
use super::{AttachError, Attacher, Deadlines, ImageSpec, MapRequest, Mapping};
use crate::sys::discovery::DeviceIdentity;
use crate::sys::linux::find_program;

/// The dir under the state dir where the servers' records are.
pub const DIR: &str = "ublk";
/// The program.
pub const PROGRAM: &str = "moor-ublk";
/// The driver's control device: the kernel has ublk when it is there.
pub const CONTROL: &str = "/dev/ublk-control";
/// How long `moor-ublk info` or `delete` may take (the driver answers at once).
const TOOL_DEADLINE: Duration = Duration::from_secs(10);

/// What a new moor-node needs to take an image's device over, beside the key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Served {
    /// The device's number (`/dev/ublkbN`), once the server said it.
    dev: Option<u32>,
    /// The Ceph user.
    user: String,
    /// The monitors, as the publish context named them.
    monitors: String,
    /// The server's client (`client.N`, as it said), which the next server fences when this
    /// one died holding the image's lock.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    client: Option<String>,
}

/// The driver's view of a device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DevState {
    /// The driver has no such device (a reboot, a delete).
    Gone,
    /// Served.
    Live,
    /// Its server died; its requests wait for a new one.
    Quiesced,
    /// Anything else the driver says.
    Other(String),
}

impl DevState {
    /// `moor-ublk info`'s line: `dev N state S ...`.
    fn parse(line: &str) -> Option<Self> {
        let mut words = line.split_whitespace();
        while let Some(w) = words.next() {
            if w == "state" {
                return Some(match words.next()? {
                    "gone" => DevState::Gone,
                    "live" => DevState::Live,
                    "quiesced" => DevState::Quiesced,
                    other => DevState::Other(other.to_string()),
                });
            }
        }
        None
    }
}

/// The ublk attacher.
#[derive(Debug)]
pub struct UblkAttacher {
    root: PathBuf,
    program: PathBuf,
    dev: PathBuf,
    sys_block: PathBuf,
    deadlines: Deadlines,
}

impl UblkAttacher {
    /// The attacher, keeping its records under `root`, serving with `program`; None when the
    /// kernel has no ublk (no `/dev/ublk-control`) or the program is not installed.
    pub fn new(root: &Path, program: &str, deadlines: Deadlines) -> Option<Self> {
        if !Path::new(CONTROL).exists() {
            return None;
        }
        Self::with_paths(
            root,
            program,
            Path::new("/dev"),
            Path::new("/sys/block"),
            deadlines,
        )
    }

    /// The attacher with the device dir and sysfs's block dir elsewhere (for the tests).
    pub fn with_paths(
        root: &Path,
        program: &str,
        dev: &Path,
        sys_block: &Path,
        deadlines: Deadlines,
    ) -> Option<Self> {
        Some(Self {
            root: root.to_path_buf(),
            program: find_program(program)?,
            dev: dev.to_path_buf(),
            sys_block: sys_block.to_path_buf(),
            deadlines,
        })
    }

    fn failed(image: &ImageSpec, step: &'static str, reason: impl Into<String>) -> AttachError {
        AttachError::Failed {
            step,
            image: image.to_string(),
            reason: reason.into(),
        }
    }

    /// The image's record, key and log files.
    fn paths(&self, image: &ImageSpec) -> Result<(PathBuf, PathBuf, PathBuf), AttachError> {
        let name = dir_name(image)?;
        Ok((
            self.root.join(format!("{name}.json")),
            self.root.join(format!(".{name}.key")),
            self.root.join(format!("{name}.log")),
        ))
    }

    fn read_served(&self, image: &ImageSpec) -> Result<Option<Served>, AttachError> {
        let (record, _, _) = self.paths(image)?;
        match std::fs::read(&record) {
            Ok(bytes) => serde_json::from_slice(&bytes)
                .map(Some)
                .map_err(|e| Self::failed(image, "map", format!("{}: {e}", record.display()))),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(Self::failed(
                image,
                "map",
                format!("{}: {e}", record.display()),
            )),
        }
    }

    /// Writes the image's record (durably: a new moor-node reads it after a crash).
    fn write_served(&self, image: &ImageSpec, served: &Served) -> Result<(), AttachError> {
        let (record, _, _) = self.paths(image)?;
        let io = |e: std::io::Error| {
            Self::failed(image, "map", format!("writing {}: {e}", record.display()))
        };
        let tmp = record.with_extension("json.tmp");
        let bytes =
            serde_json::to_vec(served).map_err(|e| Self::failed(image, "map", e.to_string()))?;
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)
            .map_err(io)?;
        f.write_all(&bytes)
            .and_then(|()| f.sync_all())
            .map_err(io)?;
        std::fs::rename(&tmp, &record).map_err(io)?;
        std::fs::File::open(&self.root)
            .and_then(|d| d.sync_all())
            .map_err(io)
    }

    fn block_device(&self, dev: u32) -> PathBuf {
        self.dev.join(format!("ublkb{dev}"))
    }

    /// The device's number, from sysfs (`/sys/block/ublkbN/dev`).
    fn rdev(&self, dev: u32) -> Option<(u32, u32)> {
        let text = std::fs::read_to_string(self.sys_block.join(format!("ublkb{dev}/dev"))).ok()?;
        let (major, minor) = text.trim().split_once(':')?;
        Some((major.parse().ok()?, minor.parse().ok()?))
    }

    /// Runs `moor-ublk <args>` to its end, within [`TOOL_DEADLINE`]; what it printed.
    fn tool(
        &self,
        image: &ImageSpec,
        step: &'static str,
        args: &[String],
    ) -> Result<String, AttachError> {
        let mut cmd = Command::new(&self.program);
        cmd.args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let child = cmd
            .spawn()
            .map_err(|e| Self::failed(image, step, format!("{}: {e}", self.program.display())))?;
        let pid = child.id();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(child.wait_with_output());
        });
        match rx.recv_timeout(TOOL_DEADLINE) {
            Ok(Ok(out)) if out.status.success() => {
                Ok(String::from_utf8_lossy(&out.stdout).into_owned())
            }
            Ok(Ok(out)) => Err(Self::failed(
                image,
                step,
                format!(
                    "{} {} ({}): {}",
                    PROGRAM,
                    args.first().map_or("", String::as_str),
                    out.status,
                    String::from_utf8_lossy(&out.stderr).trim()
                ),
            )),
            Ok(Err(e)) => Err(Self::failed(image, step, e.to_string())),
            Err(_) => {
                kill(pid);
                Err(AttachError::Timeout {
                    step,
                    image: image.to_string(),
                    deadline: TOOL_DEADLINE,
                })
            }
        }
    }

    /// The driver's view of device `dev`.
    pub fn state(&self, image: &ImageSpec, dev: u32) -> Result<DevState, AttachError> {
        let out = self.tool(
            image,
            "map",
            &["info".into(), "--dev".into(), dev.to_string()],
        )?;
        DevState::parse(&out).ok_or_else(|| {
            Self::failed(
                image,
                "map",
                format!("{PROGRAM} info said {:?}", out.trim()),
            )
        })
    }

    fn mapping(&self, dev: u32, rdev: (u32, u32)) -> Mapping {
        Mapping {
            device: self.block_device(dev),
            rdev,
            identity: DeviceIdentity::default(),
            read_only: false,
        }
    }

    /// Starts a server, `moor-ublk <step> ...` for the image, with its key in `key`; waits
    /// (up to `deadline`) for its `dev N /dev/ublkbN client.C` line; the device's number and the
    /// server's client.
    fn serve(
        &self,
        image: &ImageSpec,
        step: &'static str,
        lead: &[String],
        served: &Served,
        deadline: Instant,
    ) -> Result<(u32, Option<String>), AttachError> {
        let (_, key, log) = self.paths(image)?;
        let io = |what: &str, e: std::io::Error| Self::failed(image, step, format!("{what}: {e}"));
        let log_file = std::fs::OpenOptions::new()
            .append(true)
            .create(true)
            .mode(0o600)
            .open(&log)
            .map_err(|e| io(&format!("opening {}", log.display()), e))?;
        let mut args: Vec<String> = lead.to_vec();
        args.extend([
            "--mon-host".into(),
            served.monitors.clone(),
            "--user".into(),
            served.user.clone(),
            "--keyfile".into(),
            key.display().to_string(),
            "--pool".into(),
            image.pool.clone(),
            "--image".into(),
            image.image.clone(),
        ]);
        let mut child = Command::new(&self.program)
            .args(&args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(log_file)
            .spawn()
            .map_err(|e| io(&self.program.display().to_string(), e))?;
        let pid = child.id();
        let stdout = child.stdout.take();
        // The server's first line, read on a thread of its own (bounded by the deadline).
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            if let Some(out) = stdout {
                let _ = BufReader::new(out).read_line(&mut line);
            }
            let _ = tx.send(line);
        });
        // Reaped when it ends (moor-node is its parent while it lives), and its end logged.
        let what = image.to_string();
        std::thread::spawn(move || {
            if let Ok(status) = child.wait() {
                info!(image = what, pid, %status, "moor-ublk server ended");
            }
        });
        let left = deadline.saturating_duration_since(Instant::now());
        let line = match rx.recv_timeout(left) {
            Ok(line) => line,
            Err(_) => {
                kill(pid);
                return Err(AttachError::Timeout {
                    step,
                    image: image.to_string(),
                    deadline: self.deadlines.map,
                });
            }
        };
        let mut words = line
            .strip_prefix("dev ")
            .unwrap_or_default()
            .split_whitespace();
        let dev = words.next().and_then(|n| n.parse::<u32>().ok());
        let client = words.nth(1).map(str::to_string);
        match dev {
            Some(dev) => {
                info!(image = %image, dev, pid, step, client, "moor-ublk serves the image");
                Ok((dev, client))
            }
            None => {
                kill(pid);
                let said = std::fs::read_to_string(&log).unwrap_or_default();
                let last = said.lines().last().unwrap_or_default().to_string();
                Err(if last.contains("No such file or directory") {
                    AttachError::NotFound(image.to_string())
                } else {
                    Self::failed(image, step, format!("{PROGRAM} {step}: {last}"))
                })
            }
        }
    }

    /// Waits until the block device's node shows (udev or devtmpfs makes it), up to `deadline`.
    fn wait_device(
        &self,
        image: &ImageSpec,
        dev: u32,
        deadline: Instant,
    ) -> Result<(u32, u32), AttachError> {
        loop {
            if let Some(rdev) = self.rdev(dev).filter(|_| self.block_device(dev).exists()) {
                return Ok(rdev);
            }
            if Instant::now() >= deadline {
                return Err(AttachError::Timeout {
                    step: "map",
                    image: image.to_string(),
                    deadline: self.deadlines.map,
                });
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Removes every trace of the image's mapping: its device (refused while mounted or
    /// claimed) and with it its server, then its files.
    fn teardown(&self, image: &ImageSpec) -> Result<(), AttachError> {
        let (record, key, log) = self.paths(image)?;
        if let Some(dev) = self.read_served(image)?.and_then(|s| s.dev)
            && self.state(image, dev)? != DevState::Gone
        {
            let node = self.block_device(dev);
            // An exclusive open fails while the device is mounted or claimed.
            if let Err(rustix::io::Errno::BUSY) = rustix::fs::open(
                &node,
                OFlags::RDONLY | OFlags::CLOEXEC | OFlags::EXCL | OFlags::NONBLOCK,
                Mode::empty(),
            ) {
                return Err(AttachError::Busy {
                    image: image.to_string(),
                    what: node.display().to_string(),
                });
            }
            self.tool(
                image,
                "unmap",
                &["delete".into(), "--dev".into(), dev.to_string()],
            )?;
            info!(image = %image, dev, "ublk device deleted");
        }
        for f in [&record, &key, &log] {
            match std::fs::remove_file(f) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => {
                    return Err(Self::failed(
                        image,
                        "unmap",
                        format!("removing {}: {e}", f.display()),
                    ));
                }
            }
        }
        Ok(())
    }
}

/// SIGKILL to a child that has not ended (the pid is still the child's: its reaper thread has
/// not waited for it yet, or it is gone and the signal finds nothing).
fn kill(pid: u32) {
    if let Some(pid) = i32::try_from(pid).ok().and_then(Pid::from_raw)
        && let Ok(fd) = rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::empty())
    {
        let _ = rustix::process::pidfd_send_signal(&fd, rustix::process::Signal::KILL);
    }
}

impl Attacher for UblkAttacher {
    fn kind(&self) -> &'static str {
        "ublk"
    }

    fn deadlines(&self) -> Deadlines {
        self.deadlines
    }

    fn find(&self, image: &ImageSpec) -> Result<Option<Mapping>, AttachError> {
        let Some(dev) = self.read_served(image)?.and_then(|s| s.dev) else {
            return Ok(None);
        };
        // Without asking the driver (never blocks): the device is there while sysfs shows it.
        Ok(self.rdev(dev).map(|rdev| self.mapping(dev, rdev)))
    }

    fn map(&self, req: &MapRequest<'_>) -> Result<Mapping, AttachError> {
        let image = req.image;
        let deadline = Instant::now() + self.deadlines.map;
        if req.read_only {
            return Err(AttachError::Unsupported {
                image: image.to_string(),
                reason: "the ublk attacher serves images read-write only".into(),
            });
        }
        if let Some(m) = self.find(image)? {
            self.recover(image)?;
            return Ok(m);
        }
        // What a crash or a dead device left: gone first, so the image is never served twice.
        self.teardown(image)?;
        let (_, key, _) = self.paths(image)?;
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&self.root)
            .map_err(|e| {
                Self::failed(
                    image,
                    "map",
                    format!("creating {}: {e}", self.root.display()),
                )
            })?;
        let mut served = Served {
            dev: None,
            user: req.credentials.user.clone(),
            monitors: req.monitors.to_string(),
            client: None,
        };
        let made = (|| {
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .custom_flags(libc::O_NOFOLLOW)
                .open(&key)
                .map_err(|e| Self::failed(image, "map", format!("writing the key file: {e}")))?;
            f.write_all(req.credentials.key.expose().as_bytes())
                .and_then(|()| f.sync_all())
                .map_err(|e| Self::failed(image, "map", format!("writing the key file: {e}")))?;
            self.write_served(image, &served)?;
            let (dev, client) = self.serve(image, "map", &["add".into()], &served, deadline)?;
            served.dev = Some(dev);
            served.client = client;
            self.write_served(image, &served)?;
            let rdev = self.wait_device(image, dev, deadline)?;
            Ok(self.mapping(dev, rdev))
        })();
        if made.is_err() {
            let _ = self.teardown(image);
        }
        made
    }

    fn unmap(&self, image: &ImageSpec) -> Result<(), AttachError> {
        self.teardown(image)
    }

    fn verify(&self, image: &ImageSpec, rdev: (u32, u32)) -> Result<(), AttachError> {
        let dev = self.read_served(image)?.and_then(|s| s.dev);
        match dev.and_then(|d| self.rdev(d)) {
            Some(r) if r == rdev => Ok(()),
            _ => Err(Self::failed(
                image,
                "map",
                format!(
                    "device {}:{} is not the image's ublk device",
                    rdev.0, rdev.1
                ),
            )),
        }
    }

    fn refresh(&self, image: &ImageSpec) -> Result<(), AttachError> {
        Err(AttachError::Unsupported {
            image: image.to_string(),
            reason: "the ublk attacher cannot resize a served device yet; unstage and stage \
                     the volume again to see its new size"
                .into(),
        })
    }

    fn list(&self) -> Result<Vec<(ImageSpec, Option<PathBuf>)>, AttachError> {
        let mut found = Vec::new();
        if let Ok(entries) = std::fs::read_dir(&self.root) {
            for e in entries.flatten() {
                let name = e.file_name();
                let Some(spec) = name
                    .to_str()
                    .and_then(|n| n.strip_suffix(".json"))
                    .and_then(parse_dir_name)
                else {
                    continue;
                };
                let device = self
                    .read_served(&spec)
                    .ok()
                    .flatten()
                    .and_then(|s| s.dev)
                    .map(|d| self.block_device(d));
                found.push((spec, device));
            }
        }
        found.sort();
        Ok(found)
    }

    fn owns_all_listed(&self) -> bool {
        true
    }

    fn in_flight(&self, _image: &ImageSpec) -> bool {
        false
    }

    fn activity(&self, _image: &ImageSpec) -> Option<u64> {
        None
    }

    fn abort(&self, _image: &ImageSpec) {
        // A dead server does not fail the device's requests: they wait for the next one.
    }

    fn recover(&self, image: &ImageSpec) -> Result<bool, AttachError> {
        let Some(served) = self.read_served(image)? else {
            return Ok(false);
        };
        let Some(dev) = served.dev else {
            return Ok(false);
        };
        match self.state(image, dev)? {
            DevState::Quiesced => {}
            DevState::Live | DevState::Gone => return Ok(false),
            DevState::Other(s) => {
                warn!(image = %image, dev, state = s, "ublk device neither live nor quiesced");
                return Ok(false);
            }
        }
        let deadline = Instant::now() + self.deadlines.map;
        let mut lead = vec![
            "recover".to_string(),
            "--dev".into(),
            dev.to_string(),
            "--deadline".into(),
            self.deadlines.map.as_secs().max(1).to_string(),
        ];
        // The dead server's client, fenced so that the new one takes the lock at once.
        if let Some(c) = &served.client {
            lead.extend(["--fence".into(), c.clone()]);
        }
        let (again, client) = self.serve(image, "recover", &lead, &served, deadline)?;
        if again != dev {
            return Err(Self::failed(
                image,
                "recover",
                format!("{PROGRAM} recovered device {again}, not {dev}"),
            ));
        }
        self.write_served(image, &Served { client, ..served })?;
        Ok(true)
    }
}

#[cfg(test)]
#[path = "ublk_tests.rs"]
mod tests;
