//! rbd-fuse and a loop device: an RBD image as a block device on a kernel without the RBD
//! client.
//!
//! A map starts `rbd-fuse` for the one image, mounted on a dir of moor's own
//! (`<state-dir>/rbd/<pool>+<image>`, or `<cluster>+<pool>+<image>`, each part escaped),
//! where the image shows as a file; then binds a loop device with direct I/O to that file
//! (`sys::loopdev`). The file is the device's identity: the engine checks the loop device's
//! backing file as it does for the embedded backend's files.
//!
//! rbd-fuse is started like a tool, with the map deadline: the process moor starts (which
//! dies with moor) exits once the image is mounted, leaving the daemon that serves it in a
//! session of its own, so mounted volumes outlive a restart of moor-node. moor finds that
//! daemon again by its command line, which names the mount dir, and never by a pid it kept.
//! The key reaches rbd-fuse in a file only root can read, removed as soon as the image shows.
//!
//! An unmap unbinds the loop device (refused while anything holds it), unmounts the FUSE
//! mount and waits for rbd-fuse to close the image. At the unmap deadline (a node cut off
//! from the cluster never gets its answers) rbd-fuse is killed, which aborts its FUSE
//! connection and fails whatever waited on it, and the mount is detached lazily: nothing is
//! left behind, not even a process. [`Attacher::abort`] does the same for an unmount of the
//! volume's filesystem that hangs on rbd-fuse.
//!
//! A device still held after the staging mount is gone (a container's copy of the mount in a
//! mount namespace of its own, which kubelet's unmount does not reach) refuses the unmap, with
//! one exception: when that holder waits on requests rbd-fuse does not answer (the loop device
//! has requests in flight and completes none for [`STALL`], as sysfs counts them: a node its
//! cluster fenced, whose librbd keeps the writes, or one cut off from it) and no mount in
//! moor's and kubelet's view holds the device, rbd-fuse is killed, its requests fail, the
//! holder lets go and the unmap ends.
//!
//! Nothing here reads through the FUSE mount while finding or unmapping: a daemon that hangs
//! can stall only the map that waits for it, within its deadline.

use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::io::Write as _;

use std::os::unix::fs::{DirBuilderExt as _, OpenOptionsExt as _};
use std::path::{Path, PathBuf};

use std::time::{Duration, Instant};

use rustix::process::Pid;

use super::{AttachError, Attacher, Deadlines, ImageSpec, MapRequest, Mapping, redact};
use crate::crash_points;
use crate::sys::discovery::DeviceIdentity;
use crate::sys::linux::{find_program, run_with_deadline};
use crate::sys::loopdev::{self, DetachError, LoopDevice};
use crate::sys::{ToolError, ToolRun, mount_table};

mod names;
mod process;

pub use self::names::{dir_name, parse_dir_name};
use self::process::{bounded, daemons, kill, wait_gone, with_deadline, written};

/// The dir under the state dir where images are mounted.
pub const DIR: &str = "rbd";
/// The program.
pub const PROGRAM: &str = "rbd-fuse";
/// How long a killed rbd-fuse may take to be gone.
const KILL_GRACE: Duration = Duration::from_secs(5);
/// How long an unbound loop device may take to let go of its file.
const UNBIND_SETTLE: Duration = Duration::from_secs(2);
/// The longest rbd-fuse may go without answering a request it has, while something holds an
/// unstaged volume's device, before it is taken for stopped (fenced or cut off) and killed;
/// half the unmap deadline when that is shorter.
const STALL: Duration = Duration::from_secs(10);
/// The longest name a dir may have.
const NAME_MAX: usize = 255;

/// The FUSE attacher.
#[derive(Debug)]
pub struct FuseAttacher {
    root: PathBuf,
    program: PathBuf,
    deadlines: Deadlines,
}

/// What is on the node of one image's mapping.
#[derive(Debug, Default)]
struct Found {
    /// The FUSE mount is there.
    mounted: bool,
    /// rbd-fuse processes serving the mount dir.
    daemons: Vec<Pid>,
    /// Loop devices bound to the image file.
    loops: Vec<LoopDevice>,
}

impl Found {
    fn is_empty(&self) -> bool {
        !self.mounted && self.daemons.is_empty() && self.loops.is_empty()
    }
}

impl FuseAttacher {
    /// The attacher, mounting images under `root` with `program`; None when the program is
    /// not installed or the kernel has no FUSE.
    pub fn new(root: &Path, program: &str, deadlines: Deadlines) -> Option<Self> {
        let program = find_program(program)?;
        Path::new("/dev/fuse").exists().then(|| Self {
            root: root.to_path_buf(),
            program,
            deadlines,
        })
    }

    fn paths(&self, image: &ImageSpec) -> Result<(PathBuf, PathBuf, PathBuf), AttachError> {
        let name = dir_name(image)?;
        let dir = self.root.join(&name);
        let file = dir.join(&image.image);
        let key = self.root.join(format!(".{name}.key"));
        Ok((dir, file, key))
    }

    /// What of the image's mapping is on the node, without touching the FUSE mount.
    fn look(&self, dir: &Path, file: &Path) -> Found {
        let mounted = mount_table::read()
            .map(|(t, _)| t.iter().any(|m| m.mount_point == dir))
            .unwrap_or(false);
        Found {
            mounted,
            daemons: daemons(dir),
            loops: loopdev::bound_under(file)
                .into_iter()
                .filter(|(_, f)| f == file)
                .map(|(l, _)| l)
                .collect(),
        }
    }

    fn failed(image: &ImageSpec, step: &'static str, reason: impl Into<String>) -> AttachError {
        AttachError::Failed {
            step,
            image: image.to_string(),
            reason: reason.into(),
        }
    }

    /// Starts rbd-fuse for the image on `dir` and waits for the image file to show.
    fn start(
        &self,
        req: &MapRequest<'_>,
        (dir, file, key): (&Path, &Path, &Path),
        deadline: Instant,
    ) -> Result<(), AttachError> {
        let image = req.image;
        let io = |what: &str, e: std::io::Error| Self::failed(image, "map", format!("{what}: {e}"));
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(|e| io(&format!("creating {}", dir.display()), e))?;
        let _ = std::fs::remove_file(key);
        let written = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(key)
            .and_then(|mut f| {
                f.write_all(req.credentials.key.expose().as_bytes())?;
                f.write_all(b"\n")
            });
        // However this goes, the key file goes too.
        let _key_file = RemoveOnDrop(key.to_path_buf());
        written.map_err(|e| io("writing the key file", e))?;
        let left = deadline.saturating_duration_since(Instant::now());
        let mut args: Vec<String> = vec![
            dir.display().to_string(),
            "-p".into(),
            image.pool.clone(),
            "-r".into(),
            image.image.clone(),
            "--id".into(),
            req.credentials.user.clone(),
            "--keyfile".into(),
            key.display().to_string(),
            "--mon_host".into(),
            req.monitors.to_string(),
            "-c".into(),
            "/dev/null".into(),
            "--client_mount_timeout".into(),
            left.as_secs().max(1).to_string(),
            "-o".into(),
            "fsname=moor-rbd".into(),
        ];
        if req.read_only {
            args.extend(["-o".into(), "ro".into()]);
        }
        let run = ToolRun {
            program: self.program.display().to_string(),
            args,
            deadline: left,
        };
        match run_with_deadline(&run) {
            Ok(()) => {}
            Err(ToolError::Timeout { .. }) => {
                return Err(AttachError::Timeout {
                    step: "map",
                    image: image.to_string(),
                    deadline: self.deadlines.map,
                });
            }
            Err(ToolError::Failed { stderr, status, .. }) => {
                return Err(Self::failed(
                    image,
                    "map",
                    format!(
                        "rbd-fuse ({status}): {}",
                        redact(&stderr, &req.credentials.key)
                    ),
                ));
            }
            Err(e) => return Err(Self::failed(image, "map", e.to_string())),
        }
        // The mount is up; the daemon connects to the cluster when first asked. The first
        // look at the file waits for that (on a thread: a daemon that hangs is killed).
        let probe = file.to_path_buf();
        match with_deadline(deadline, move || std::fs::metadata(&probe)) {
            Some(Ok(m)) if m.is_file() => Ok(()),
            Some(Ok(_)) => Err(Self::failed(
                image,
                "map",
                "the image does not show as a file",
            )),
            Some(Err(e)) if e.kind() == std::io::ErrorKind::NotFound => {
                Err(AttachError::NotFound(image.to_string()))
            }
            Some(Err(e)) => Err(Self::failed(
                image,
                "map",
                format!("rbd-fuse did not serve the image: {e}"),
            )),
            None => Err(AttachError::Timeout {
                step: "map",
                image: image.to_string(),
                deadline: self.deadlines.map,
            }),
        }
    }

    /// Removes every trace of the image's mapping, within `deadline`.
    fn teardown(&self, image: &ImageSpec, deadline: Instant) -> Result<(), AttachError> {
        let (dir, file, key) = self.paths(image)?;
        let found = self.look(&dir, &file);
        let _ = std::fs::remove_file(&key);
        // Unbinding flushes the device into the file: a step that waits on rbd-fuse.
        let kill_daemons = || kill(&daemons(&dir));
        for l in &found.loops {
            match self.unbind(image, l, deadline) {
                Err(AttachError::Busy { .. })
                    if !mounted_here(l) && Self::stalled(l, stall_window(deadline)) =>
                {
                    // The device's holder (a mount left in another mount namespace, a
                    // process with it open) waits on requests rbd-fuse never answers: a
                    // node its cluster fenced, or one cut off from it. It would hold the
                    // device forever; rbd-fuse is killed, which fails those requests, and
                    // the holder lets go. The staging mount is gone: kubelet has ended the
                    // volume's use on this node, and no mount moor or kubelet can see
                    // holds the device.
                    tracing::warn!(
                        image = %image,
                        device = %l.path.display(),
                        "the device's holder waits on rbd-fuse, which answers nothing; \
                         killing rbd-fuse so that its requests fail"
                    );
                    kill(&found.daemons);
                    let until = deadline.max(Instant::now() + KILL_GRACE);
                    loop {
                        match self.unbind(image, l, until) {
                            Err(AttachError::Busy { .. }) if Instant::now() < until => {
                                std::thread::sleep(Duration::from_millis(50));
                            }
                            other => break other?,
                        }
                    }
                }
                other => other?,
            }
        }
        if found.mounted {
            let target = dir.clone();
            let unmounted = bounded(deadline, kill_daemons, move || {
                rustix::mount::unmount(&target, rustix::mount::UnmountFlags::empty())
            });
            match unmounted {
                Some(Ok(()) | Err(rustix::io::Errno::INVAL | rustix::io::Errno::NOENT)) | None => {}
                Some(Err(rustix::io::Errno::BUSY)) => {
                    return Err(AttachError::Busy {
                        image: image.to_string(),
                        what: format!("the image file {}", file.display()),
                    });
                }
                Some(Err(e)) => {
                    return Err(Self::failed(
                        image,
                        "unmap",
                        format!("unmounting {}: {e}", dir.display()),
                    ));
                }
            }
        }
        // rbd-fuse closes the image and exits; past the deadline it is killed (which aborts
        // its FUSE connection) and the mount detached. One without a mount serves nothing
        // (an rbd-fuse still starting when a crash came): killed at once.
        let daemons = if found.daemons.is_empty() {
            daemons(&dir)
        } else {
            found.daemons
        };
        let wait_until = if found.mounted {
            deadline
        } else {
            Instant::now()
        };
        if !wait_gone(&daemons, wait_until) {
            kill(&daemons);
            let _ = rustix::mount::unmount(&dir, rustix::mount::UnmountFlags::DETACH);
            if !wait_gone(&daemons, Instant::now() + KILL_GRACE) {
                return Err(AttachError::Timeout {
                    step: "unmap",
                    image: image.to_string(),
                    deadline: self.deadlines.unmap,
                });
            }
        }
        let still_mounted = mount_table::read()
            .map(|(t, _)| t.iter().any(|m| m.mount_point == dir))
            .unwrap_or(false);
        if still_mounted {
            let _ = rustix::mount::unmount(&dir, rustix::mount::UnmountFlags::DETACH);
        }
        match std::fs::remove_dir(&dir) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(Self::failed(
                image,
                "unmap",
                format!("removing {}: {e}", dir.display()),
            )),
        }
    }

    /// Unbinds loop device `l` of the image's file, within `deadline` (past it rbd-fuse is
    /// killed): Busy while anything holds the device.
    fn unbind(
        &self,
        image: &ImageSpec,
        l: &LoopDevice,
        deadline: Instant,
    ) -> Result<(), AttachError> {
        let (dir, file, _) = self.paths(image)?;
        let busy = || AttachError::Busy {
            image: image.to_string(),
            what: l.path.display().to_string(),
        };
        let path = l.path.clone();
        match bounded(
            deadline,
            || kill(&daemons(&dir)),
            move || loopdev::detach(&path),
        ) {
            Some(Ok(())) => {}
            None => {
                return Err(AttachError::Timeout {
                    step: "unmap",
                    image: image.to_string(),
                    deadline: self.deadlines.unmap,
                });
            }
            Some(Err(DetachError::Busy(_))) => return Err(busy()),
            Some(Err(e)) => return Err(Self::failed(image, "unmap", e.to_string())),
        }
        // The kernel finishes an unbinding after the last close, on a worker of its own; a
        // loop device another process still holds open is only marked to go when it is
        // closed: still in use.
        let bound = || {
            loopdev::bound_under(&file)
                .iter()
                .any(|(b, f)| *f == file && b.path == l.path)
        };
        let settle = Instant::now() + UNBIND_SETTLE;
        while bound() && Instant::now() < settle {
            std::thread::sleep(Duration::from_millis(5));
        }
        if bound() { Err(busy()) } else { Ok(()) }
    }

    /// Whether rbd-fuse has stopped answering loop device `l`: requests in flight on the
    /// device and none completed from now until `until`. False as soon as nothing is in
    /// flight or a request completes, and when sysfs does not show the device's I/O.
    fn stalled(l: &LoopDevice, until: Instant) -> bool {
        let Some(first) = loopdev::io_progress(l.rdev) else {
            return false;
        };
        loop {
            match loopdev::io_progress(l.rdev) {
                Some(now) if now.in_flight > 0 && now.completed == first.completed => {}
                _ => return false,
            }
            if Instant::now() >= until {
                return true;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn mapping(&self, file: &Path, l: &LoopDevice) -> Mapping {
        Mapping {
            device: l.path.clone(),
            rdev: l.rdev,
            identity: DeviceIdentity {
                backing_file: Some(file.to_path_buf()),
                ..DeviceIdentity::default()
            },
            read_only: l.read_only,
        }
    }
}

/// How long to watch rbd-fuse for an answer: [`STALL`], or half of what is left to `deadline`.
fn stall_window(deadline: Instant) -> Instant {
    let now = Instant::now();
    now + STALL.min(deadline.saturating_duration_since(now) / 2)
}

/// Whether a filesystem on loop device `l` is mounted in this mount namespace (moor's and
/// kubelet's view of the node).
fn mounted_here(l: &LoopDevice) -> bool {
    mount_table::read().map_or(true, |(t, _)| t.iter().any(|m| m.dev == l.rdev))
}

/// Removes a file when dropped.
struct RemoveOnDrop(PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

impl Attacher for FuseAttacher {
    fn kind(&self) -> &'static str {
        "fuse"
    }

    fn deadlines(&self) -> Deadlines {
        self.deadlines
    }

    fn find(&self, image: &ImageSpec) -> Result<Option<Mapping>, AttachError> {
        let (dir, file, _) = self.paths(image)?;
        let found = self.look(&dir, &file);
        Ok(match found.loops.as_slice() {
            [l] if found.mounted && !found.daemons.is_empty() => Some(self.mapping(&file, l)),
            _ => None,
        })
    }

    fn map(&self, req: &MapRequest<'_>) -> Result<Mapping, AttachError> {
        let start = Instant::now();
        let deadline = start + self.deadlines.map;
        let image = req.image;
        let (dir, file, key) = self.paths(image)?;
        let found = self.look(&dir, &file);
        if let [l] = found.loops.as_slice()
            && found.mounted
            && !found.daemons.is_empty()
            && l.read_only == req.read_only
        {
            return Ok(self.mapping(&file, l));
        }
        // A part of a mapping (a crash cut a map or an unmap short, or rbd-fuse died): gone
        // first, so the image is never mapped twice.
        if !found.is_empty() || dir.exists() {
            self.teardown(image, start + self.deadlines.unmap)?;
        }
        let made = self
            .start(req, (&dir, &file, &key), deadline)
            .and_then(|()| {
                crash_points::point("map.attaching");
                loopdev::attach(&file, req.read_only)
                    .map(|l| self.mapping(&file, &l))
                    .map_err(|e| Self::failed(image, "map", format!("binding a loop device: {e}")))
            });
        if made.is_err() {
            // Whatever it was, nothing of it stays: a map past its deadline included.
            let _ = self.teardown(image, Instant::now() + self.deadlines.unmap);
        }
        made
    }

    fn unmap(&self, image: &ImageSpec) -> Result<(), AttachError> {
        self.teardown(image, Instant::now() + self.deadlines.unmap)
    }

    fn verify(&self, image: &ImageSpec, rdev: (u32, u32)) -> Result<(), AttachError> {
        let (_, file, _) = self.paths(image)?;
        if loopdev::bound_under(&file)
            .iter()
            .any(|(l, f)| *f == file && l.rdev == rdev)
        {
            return Ok(());
        }
        Err(Self::failed(
            image,
            "map",
            format!(
                "device {}:{} is not bound to {}",
                rdev.0,
                rdev.1,
                file.display()
            ),
        ))
    }

    fn refresh(&self, image: &ImageSpec) -> Result<(), AttachError> {
        let (_, file, _) = self.paths(image)?;
        for (l, f) in loopdev::bound_under(&file) {
            if f == file {
                loopdev::set_capacity(&l.path).map_err(|e| {
                    Self::failed(image, "refresh", format!("{}: {e}", l.path.display()))
                })?;
            }
        }
        Ok(())
    }

    fn list(&self) -> Result<Vec<(ImageSpec, Option<PathBuf>)>, AttachError> {
        let mut found: BTreeMap<ImageSpec, Option<PathBuf>> = BTreeMap::new();
        if let Ok(entries) = std::fs::read_dir(&self.root) {
            for e in entries.flatten() {
                let name = e.file_name();
                if let Some(spec) = name
                    .to_str()
                    .filter(|n| !n.starts_with('.'))
                    .and_then(parse_dir_name)
                {
                    found.entry(spec).or_default();
                }
            }
        }
        for (l, file) in loopdev::bound_under(&self.root) {
            let spec = file
                .parent()
                .filter(|d| d.parent() == Some(self.root.as_path()))
                .and_then(Path::file_name)
                .and_then(OsStr::to_str)
                .and_then(parse_dir_name);
            if let Some(spec) = spec {
                found.insert(spec, Some(l.path));
            }
        }
        if let Ok((table, _)) = mount_table::read() {
            for m in table {
                if m.mount_point.parent() == Some(self.root.as_path())
                    && let Some(spec) = m
                        .mount_point
                        .file_name()
                        .and_then(OsStr::to_str)
                        .and_then(parse_dir_name)
                {
                    found.entry(spec).or_default();
                }
            }
        }
        Ok(found.into_iter().collect())
    }

    fn owns_all_listed(&self) -> bool {
        true
    }

    fn activity(&self, image: &ImageSpec) -> Option<u64> {
        let (dir, _, _) = self.paths(image).ok()?;
        let pids = daemons(&dir);
        (!pids.is_empty()).then(|| written(&pids))
    }

    fn abort(&self, image: &ImageSpec) {
        if let Ok((dir, _, _)) = self.paths(image) {
            kill(&daemons(&dir));
        }
    }

    fn in_flight(&self, _image: &ImageSpec) -> bool {
        // Every step ends by its deadline (rbd-fuse is killed past it).
        false
    }
}
