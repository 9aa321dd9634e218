//! The kernel's RBD client, driven through sysfs (`Documentation/ABI/testing/sysfs-bus-rbd`),
//! with no tool run.
//!
//! * map: one `write(2)` of `<mon_addrs> <options> <pool> <image>` to
//!   `/sys/bus/rbd/add_single_major` (or `add` when the module has no single major); the
//!   options are `name=<user>,secret=<key>`, then `ro` for a read-only mapping, or
//!   `exclusive` for a read-write one when the volume's StorageClass sets `exclusiveLock`
//!   (publish_context `rbdExclusiveLock`), and `mount_timeout` set to the map deadline. The
//!   kernel answers when the device exists: `/sys/bus/rbd/devices/<id>/` and `/dev/rbd<id>`.
//!   `exclusive` makes the map take the image's exclusive lock and keep it (no cooperative
//!   hand-over): while one node has the image mapped read-write, any other client's write
//!   fails with EROFS instead of taking the lock away, so the image is never written by two
//!   nodes even if the CO's single-writer publication were bypassed. Its price, measured on
//!   a real kernel: librbd's resize needs the lock too, so the controller cannot grow such an
//!   image while it is mapped. Without it the kernel hands the lock over on request, as
//!   librbd does, and the image grows online.
//! * monitors: the kernel client speaks one messenger protocol per map, msgr1 (port 6789)
//!   unless `ms_mode` asks for msgr2 (port 3300), and takes IP addresses only. Monitors
//!   named by their msgr2 address (`ip:3300` or `v2:ip`, as `ceph mon dump` shows first) are
//!   mapped with `ms_mode=prefer-crc`; by `ip:6789`, `v1:ip` or another port, with msgr1; a
//!   bare address takes 6789. Host names are resolved here. A list that mixes the two
//!   protocols is refused with INVALID_ARGUMENT before anything is written: a map over the
//!   wrong protocol would hang until its deadline.
//! * find: `/sys/bus/rbd/devices/*/{pool,name,current_snap}` (the image's head, `-`, outside
//!   any pool namespace), with `major`, `minor` and the block device's `ro`; `name` first, and
//!   another image's mapping no further (a storm's lookups stay one read per mapping);
//! * unmap: `<id>` written to `remove_single_major` (or `remove`); EBUSY while anything holds
//!   the device open.
//!
//! A sysfs write blocks in the kernel while it talks to the cluster and cannot be cancelled:
//! it runs on a thread of its own, and the caller gets DEADLINE_EXCEEDED at the deadline while
//! the write goes on. Until it ends, another map or unmap of that image is refused
//! ([`AttachError::InFlight`]), so a retry can never map the image a second time. The request
//! holds the key: it is built in a buffer zeroed after the write, and never logged or quoted.

use std::collections::HashSet;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use super::{AttachError, Attacher, Deadlines, ImageSpec, MapRequest, Mapping, Secret};
use crate::sys::discovery::DeviceIdentity;

/// The attacher's name, as `--rbd-attacher` and the journal say it.
pub const KIND: &str = "kernel";
/// Where the kernel's RBD client shows itself.
pub const SYSFS: &str = "/sys/bus/rbd";
/// Where device nodes are.
pub const DEV: &str = "/dev";
/// How long an unmap retries a device that is busy (a probe's brief open) before it says so.
const UNMAP_BUSY_WINDOW: Duration = Duration::from_secs(3);
/// The `current_snap` of a mapping of the image itself.
const HEAD: &str = "-";

/// The kernel attacher.
#[derive(Debug)]
pub struct KernelAttacher {
    sysfs: PathBuf,
    dev: PathBuf,
    deadlines: Deadlines,
    /// Images with a sysfs write past its deadline, still blocked in the kernel.
    in_flight: Arc<Mutex<HashSet<ImageSpec>>>,
}

/// One mapping as sysfs shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Entry {
    id: u32,
    pool: String,
    name: String,
    rdev: (u32, u32),
    read_only: bool,
}

impl KernelAttacher {
    /// The attacher over sysfs dir `sysfs` (`/sys/bus/rbd`) and device dir `dev` (`/dev`);
    /// None when the kernel has no RBD client there.
    pub fn new(
        sysfs: impl AsRef<Path>,
        dev: impl AsRef<Path>,
        deadlines: Deadlines,
    ) -> Option<Self> {
        let sysfs = sysfs.as_ref().to_path_buf();
        let has = ["add_single_major", "add"]
            .iter()
            .any(|f| sysfs.join(f).exists());
        has.then(|| Self {
            sysfs,
            dev: dev.as_ref().to_path_buf(),
            deadlines,
            in_flight: Arc::default(),
        })
    }

    /// The control file `name` (`add`, `remove`): its single-major variant when present.
    fn control(&self, name: &str) -> PathBuf {
        let single = self.sysfs.join(format!("{name}_single_major"));
        if single.exists() {
            single
        } else {
            self.sysfs.join(name)
        }
    }

    /// Every mapping of the image's head outside pool namespaces, by id.
    fn entries(&self) -> Vec<Entry> {
        self.entries_of(None)
    }

    /// The mappings of `image`'s head outside pool namespaces, by id.
    fn matching(&self, image: &ImageSpec) -> Vec<Entry> {
        self.entries_of(Some(image))
    }

    /// The mappings of an image's head outside pool namespaces, of `image` only when given,
    /// by id. For one image, a mapping's `name` is read first, its `pool` only when the name
    /// is the image's, and the rest of its attributes only when both are: a lookup among N
    /// mappings reads about N small files, not 7N (a stage looks its image up four times:
    /// find, the map's before and after, verify; a storm of N maps read 28N² of them).
    fn entries_of(&self, image: Option<&ImageSpec>) -> Vec<Entry> {
        let Ok(dir) = std::fs::read_dir(self.sysfs.join("devices")) else {
            return Vec::new();
        };
        let mut found: Vec<Entry> = dir
            .flatten()
            .filter_map(|e| {
                let id: u32 = e.file_name().to_str()?.parse().ok()?;
                let path = e.path();
                let read = |f: &str| {
                    std::fs::read_to_string(path.join(f))
                        .ok()
                        .map(|s| s.trim_end_matches('\n').to_string())
                };
                let name = read("name")?;
                if image.is_some_and(|i| i.image != name) {
                    return None;
                }
                let pool = read("pool")?;
                if image.is_some_and(|i| i.pool != pool)
                    || read("current_snap")? != HEAD
                    || read("pool_ns").is_some_and(|n| !n.is_empty())
                {
                    return None;
                }
                let rdev = (read("major")?.parse().ok()?, read("minor")?.parse().ok()?);
                let read_only = read(&format!("block/rbd{id}/ro")).is_some_and(|r| r == "1");
                Some(Entry {
                    id,
                    pool,
                    name,
                    rdev,
                    read_only,
                })
            })
            .collect();
        found.sort_by_key(|e| e.id);
        found
    }

    fn mapping(&self, e: &Entry) -> Mapping {
        Mapping {
            device: self.dev.join(format!("rbd{}", e.id)),
            rdev: e.rdev,
            identity: DeviceIdentity::default(),
            read_only: e.read_only,
        }
    }

    /// Writes `request` to `file` on a thread of its own; the write's outcome, or None at the
    /// deadline (the write goes on, and the image stays in flight until it ends).
    fn write(
        &self,
        file: PathBuf,
        request: Secret,
        image: &ImageSpec,
        step: &'static str,
        deadline: Duration,
    ) -> Result<io::Result<()>, AttachError> {
        {
            let mut busy = self
                .in_flight
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            if !busy.insert(image.clone()) {
                return Err(AttachError::InFlight {
                    step,
                    image: image.to_string(),
                });
            }
        }
        let (tx, rx) = mpsc::channel();
        let in_flight = Arc::clone(&self.in_flight);
        let key = image.clone();
        let spawned = std::thread::Builder::new()
            .name("moor-rbd-sysfs".into())
            .spawn(move || {
                let outcome = write_once(&file, request.expose_bytes());
                drop(request);
                in_flight
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .remove(&key);
                let _ = tx.send(outcome);
            });
        if let Err(e) = spawned {
            self.in_flight
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .remove(image);
            return Ok(Err(e));
        }
        match rx.recv_timeout(deadline) {
            Ok(outcome) => Ok(outcome),
            Err(RecvTimeoutError::Timeout) => Err(AttachError::Timeout {
                step,
                image: image.to_string(),
                deadline,
            }),
            Err(RecvTimeoutError::Disconnected) => Ok(Err(io::Error::other(
                "the sysfs writer ended without an answer",
            ))),
        }
    }
}

/// One `write(2)` of all of `bytes` (sysfs takes a request in one write).
fn write_once(file: &Path, bytes: &[u8]) -> io::Result<()> {
    use rustix::fs::{Mode, OFlags};
    let fd = rustix::fs::open(file, OFlags::WRONLY | OFlags::CLOEXEC, Mode::empty())?;
    loop {
        match rustix::io::write(&fd, bytes) {
            Ok(n) if n == bytes.len() => return Ok(()),
            Ok(n) => {
                return Err(io::Error::other(format!(
                    "short write to {} ({n} of {} bytes)",
                    file.display(),
                    bytes.len()
                )));
            }
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
}

/// The monitors as the kernel client takes them: `ip:port` (`[ip6]:port`), comma-separated,
/// and the `ms_mode` option they need (None: msgr1, the kernel's default).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelMonitors {
    /// The addresses.
    pub addrs: String,
    /// `ms_mode`'s value, for monitors that speak msgr2 only on the ports given.
    pub ms_mode: Option<&'static str>,
}

/// The monitor port of msgr2.
const MSGR2_PORT: u16 = 3300;
/// The monitor port of msgr1.
const MSGR1_PORT: u16 = 6789;

/// Reads a publish context's monitor list (`host[:port]`, `[ip6][:port]`, each optionally
/// `v1:`/`v2:`) for the kernel client; the reason when it cannot be mapped as given.
pub fn kernel_monitors(list: &str) -> Result<KernelMonitors, String> {
    use std::net::{IpAddr, SocketAddr, ToSocketAddrs as _};
    let mut v1 = false;
    let mut v2 = false;
    let mut found = Vec::new();
    for raw in list.split(',').map(str::trim) {
        let (proto, rest) = match (raw.strip_prefix("v2:"), raw.strip_prefix("v1:")) {
            (Some(r), _) => (Some(2), r),
            (_, Some(r)) => (Some(1), r),
            _ => (None, raw),
        };
        let (host, port) = if let Some(inner) = rest.strip_prefix('[') {
            let (h, after) = inner
                .split_once(']')
                .ok_or_else(|| format!("monitor {raw:?}: '[' without ']'"))?;
            (h, after.strip_prefix(':'))
        } else {
            match rest.rsplit_once(':') {
                Some((h, p)) if !h.contains(':') => (h, Some(p)),
                _ => (rest, None),
            }
        };
        let port: Option<u16> = port
            .map(|p| {
                p.parse()
                    .map_err(|_| format!("monitor {raw:?}: bad port {p:?}"))
            })
            .transpose()?;
        match proto.or(port.map(|p| if p == MSGR2_PORT { 2 } else { 1 })) {
            Some(2) => v2 = true,
            Some(_) => v1 = true,
            None => {}
        }
        if host.is_empty() {
            return Err(format!("monitor {raw:?} names no host"));
        }
        let ip: IpAddr = match host.parse() {
            Ok(ip) => ip,
            Err(_) => (host, 0)
                .to_socket_addrs()
                .map_err(|e| format!("monitor {host:?} does not resolve: {e}"))?
                .next()
                .map(|a| a.ip())
                .ok_or_else(|| format!("monitor {host:?} resolves to no address"))?,
        };
        found.push((ip, port));
    }
    if v1 && v2 {
        return Err(format!(
            "the monitors {list:?} mix msgr2 (port {MSGR2_PORT}, v2:) and msgr1 (port \
             {MSGR1_PORT}, v1:) addresses; the kernel's RBD client speaks one of them per map: \
             name every monitor by its {MSGR2_PORT} address, or every one by its {MSGR1_PORT} one"
        ));
    }
    let default = if v2 { MSGR2_PORT } else { MSGR1_PORT };
    let addrs: Vec<String> = found
        .into_iter()
        .map(|(ip, port)| SocketAddr::new(ip, port.unwrap_or(default)).to_string())
        .collect();
    Ok(KernelMonitors {
        addrs: addrs.join(","),
        ms_mode: v2.then_some("prefer-crc"),
    })
}

/// The request `add` takes: `<mon_addrs> name=<user>,secret=<key>[,ro|,exclusive],
/// [ms_mode=<mode>,]mount_timeout=<s> <pool> <image>`, in a buffer zeroed when dropped.
pub fn add_request(req: &MapRequest<'_>, monitors: &KernelMonitors, deadline: Duration) -> Secret {
    let mut out = Vec::with_capacity(256);
    out.extend_from_slice(monitors.addrs.as_bytes());
    out.extend_from_slice(b" name=");
    out.extend_from_slice(req.credentials.user.as_bytes());
    out.extend_from_slice(b",secret=");
    out.extend_from_slice(req.credentials.key.expose().as_bytes());
    if req.read_only {
        out.extend_from_slice(b",ro");
    } else if req.exclusive {
        out.extend_from_slice(b",exclusive");
    }
    if let Some(mode) = monitors.ms_mode {
        out.extend_from_slice(b",ms_mode=");
        out.extend_from_slice(mode.as_bytes());
    }
    out.extend_from_slice(format!(",mount_timeout={}", deadline.as_secs().max(1)).as_bytes());
    out.push(b' ');
    out.extend_from_slice(req.image.pool.as_bytes());
    out.push(b' ');
    out.extend_from_slice(req.image.image.as_bytes());
    Secret::from_bytes(out)
}

/// What a failed sysfs write of `step` means.
fn write_error(step: &'static str, image: &ImageSpec, e: &io::Error) -> AttachError {
    let image = image.to_string();
    match e.raw_os_error() {
        Some(libc::ENOENT) if step == "map" => AttachError::NotFound(image),
        Some(libc::EBUSY) if step == "unmap" => AttachError::Busy {
            image,
            what: "its kernel device".into(),
        },
        // A map takes the image's exclusive lock; when a dead client holds it (a node that
        // crashed or rebooted without unmapping), the kernel breaks the lock by blocklisting
        // that client first, which a user without `mon 'profile rbd'` may not do.
        Some(libc::EACCES | libc::EPERM) if step == "map" => AttachError::Failed {
            step,
            image,
            reason: format!(
                "{e} (the user's key or capabilities were refused: a map blocklists the \
                 client that died holding the image's lock, as a node that crashed or \
                 rebooted without unmapping, and that needs the user's mon 'profile rbd')"
            ),
        },
        Some(libc::EACCES | libc::EPERM) => AttachError::Failed {
            step,
            image,
            reason: format!("{e} (the user's key or capabilities were refused)"),
        },
        _ => AttachError::Failed {
            step,
            image,
            reason: e.to_string(),
        },
    }
}

impl Attacher for KernelAttacher {
    fn kind(&self) -> &'static str {
        KIND
    }

    fn deadlines(&self) -> Deadlines {
        self.deadlines
    }

    fn find(&self, image: &ImageSpec) -> Result<Option<Mapping>, AttachError> {
        Ok(self.matching(image).first().map(|e| self.mapping(e)))
    }

    fn map(&self, req: &MapRequest<'_>) -> Result<Mapping, AttachError> {
        let image = req.image;
        let monitors = kernel_monitors(req.monitors).map_err(|reason| AttachError::Invalid {
            image: image.to_string(),
            reason,
        })?;
        // The image's mappings before the write: the one the write makes is not among them
        // (another image's mapping whose id is freed and taken by this one meanwhile is no
        // matter, and reading only this image's keeps the lookup one file per mapping).
        let before: HashSet<u32> = self.matching(image).iter().map(|e| e.id).collect();
        let deadline = self.deadlines.map;
        let request = add_request(req, &monitors, deadline);
        let start = std::time::Instant::now();
        self.write(self.control("add"), request, image, "map", deadline)?
            .map_err(|e| write_error("map", image, &e))?;
        // The device the write made: a match that was not there before. The kernel shows it
        // before the write returns; one that shows later is waited for, up to the deadline.
        let made = loop {
            if let Some(e) = self
                .matching(image)
                .into_iter()
                .find(|e| !before.contains(&e.id))
            {
                break e;
            }
            if start.elapsed() >= deadline {
                return Err(AttachError::Failed {
                    step: "map",
                    image: image.to_string(),
                    reason: "the kernel took the request but shows no new device for the image"
                        .into(),
                });
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        let mut mapping = self.mapping(&made);
        mapping.read_only |= req.read_only;
        Ok(mapping)
    }

    fn unmap(&self, image: &ImageSpec) -> Result<(), AttachError> {
        for e in self.matching(image) {
            // EBUSY right after the volume's last unmount is most often a passer-by: udev
            // probes a block device that was closed after a write (its inotify watch), and
            // blkid holds it open for a few milliseconds. Retried within a short window; a
            // device that stays open (mounted, claimed, used) is Busy after it.
            let start = std::time::Instant::now();
            let mut pause = Duration::from_millis(10);
            loop {
                let request = Secret::from_bytes(e.id.to_string().into_bytes());
                match self.write(
                    self.control("remove"),
                    request,
                    image,
                    "unmap",
                    self.deadlines.unmap,
                )? {
                    Ok(()) => break,
                    // Gone meanwhile.
                    Err(err) if err.raw_os_error() == Some(libc::ENOENT) => break,
                    Err(err)
                        if err.raw_os_error() == Some(libc::EBUSY)
                            && start.elapsed() + pause < UNMAP_BUSY_WINDOW =>
                    {
                        std::thread::sleep(pause);
                        pause = (pause * 2).min(Duration::from_millis(200));
                    }
                    Err(err) => return Err(write_error("unmap", image, &err)),
                }
            }
        }
        Ok(())
    }

    fn verify(&self, image: &ImageSpec, rdev: (u32, u32)) -> Result<(), AttachError> {
        if self.matching(image).iter().any(|e| e.rdev == rdev) {
            return Ok(());
        }
        Err(AttachError::Failed {
            step: "map",
            image: image.to_string(),
            reason: format!(
                "device {}:{} is not a kernel mapping of the image",
                rdev.0, rdev.1
            ),
        })
    }

    fn refresh(&self, image: &ImageSpec) -> Result<(), AttachError> {
        for e in self.matching(image) {
            let file = self.sysfs.join(format!("devices/{}/refresh", e.id));
            write_once(&file, b"1").map_err(|err| write_error("refresh", image, &err))?;
        }
        Ok(())
    }

    fn list(&self) -> Result<Vec<(ImageSpec, Option<PathBuf>)>, AttachError> {
        Ok(self
            .entries()
            .iter()
            .map(|e| {
                (
                    ImageSpec {
                        cluster_id: None,
                        pool: e.pool.clone(),
                        image: e.name.clone(),
                    },
                    Some(self.mapping(e).device),
                )
            })
            .collect())
    }

    fn owns_all_listed(&self) -> bool {
        false
    }

    fn in_flight(&self, image: &ImageSpec) -> bool {
        self.in_flight
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .contains(image)
    }

    fn activity(&self, _image: &ImageSpec) -> Option<u64> {
        None
    }

    fn abort(&self, _image: &ImageSpec) {}
}

#[cfg(test)]
#[path = "kernel_tests.rs"]
mod tests;
