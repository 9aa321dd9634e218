//! Finding a volume's block device by its identity, through udev.
//!
//! A controller attaches a volume and says in publish_context how the node can recognise it:
//! the file behind a loop device (the embedded backend), or a disk's serial number or WWN (a
//! cloud). The device path it may also name is only a hint: device names are handed out by the
//! kernel in attach order, loop numbers are reused, and a by-id link can be stale. So the node
//! looks at what a device *is* before it formats or mounts it, and when the device is not there
//! yet it waits for the kernel or udev to announce it, up to a deadline.
//!
//! The pure part (what an identity is, how a device's facts are compared with it) is here and
//! unit-tested; the udev part ([`find_with_udev`], [`identify_with_udev`]) is what the real
//! [`Os`](crate::sys::Os) calls.

use std::ffi::OsStr;
use std::fmt;
use std::os::unix::ffi::OsStrExt as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::sys::loopinfo;

/// How long NodeStageVolume waits for a device to appear, unless configured otherwise.
pub const DEFAULT_DISCOVERY_DEADLINE: Duration = Duration::from_secs(60);

/// The control socket systemd-udevd listens on while it runs.
pub const UDEV_CONTROL_SOCKET: &str = "/run/udev/control";

/// udev properties holding a disk's serial number.
const SERIAL_PROPERTIES: [&str; 2] = ["ID_SERIAL", "ID_SERIAL_SHORT"];
/// sysfs attributes holding a disk's serial number (virtio-blk, NVMe, some SCSI).
const SERIAL_ATTRIBUTES: [&str; 2] = ["serial", "device/serial"];
/// udev properties holding a disk's World Wide Name.
const WWN_PROPERTIES: [&str; 2] = ["ID_WWN", "ID_WWN_WITH_EXTENSION"];
/// sysfs attributes holding a disk's World Wide Name (NVMe, SCSI).
const WWN_ATTRIBUTES: [&str; 2] = ["wwid", "device/wwid"];
/// The sysfs attribute naming a loop device's backing file.
const LOOP_BACKING_ATTRIBUTE: &str = "loop/backing_file";
/// What the kernel appends to a backing file's path once the file has been unlinked.
const DELETED_SUFFIX: &str = " (deleted)";

/// What a volume's device must be, as the controller said in publish_context. Every field
/// given must match; an identity with no field set cannot be checked.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeviceIdentity {
    /// The file a loop device must be backed by.
    pub backing_file: Option<PathBuf>,
    /// The disk's serial number (udev `ID_SERIAL`/`ID_SERIAL_SHORT`, or sysfs `serial`).
    pub serial: Option<String>,
    /// The disk's World Wide Name (udev `ID_WWN`, or sysfs `wwid`).
    pub wwn: Option<String>,
}

impl DeviceIdentity {
    /// Whether nothing identifies the device.
    pub fn is_empty(&self) -> bool {
        self.backing_file.is_none() && self.serial.is_none() && self.wwn.is_none()
    }
}

impl fmt::Display for DeviceIdentity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut parts = Vec::new();
        if let Some(b) = &self.backing_file {
            parts.push(format!("backing file {}", b.display()));
        }
        if let Some(s) = &self.serial {
            parts.push(format!("serial {s:?}"));
        }
        if let Some(w) = &self.wwn {
            parts.push(format!("WWN {w:?}"));
        }
        if parts.is_empty() {
            f.write_str("no identity")
        } else {
            f.write_str(&parts.join(", "))
        }
    }
}

/// The file behind a loop device, as sysfs names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackingFile {
    /// Its path.
    pub path: PathBuf,
    /// Whether the file has been unlinked since it was attached (the kernel says so).
    pub deleted: bool,
}

impl BackingFile {
    /// Parses the contents of sysfs `loop/backing_file`.
    pub fn parse(raw: &[u8]) -> Option<Self> {
        let raw = raw.strip_suffix(b"\n").unwrap_or(raw);
        if raw.is_empty() {
            return None;
        }
        let (raw, deleted) = match raw.strip_suffix(DELETED_SUFFIX.as_bytes()) {
            Some(r) => (r, true),
            None => (raw, false),
        };
        Some(Self {
            path: PathBuf::from(OsStr::from_bytes(raw)),
            deleted,
        })
    }
}

/// What a block device says about itself.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeviceFacts {
    /// For a bound loop device, its backing file.
    pub backing_file: Option<BackingFile>,
    /// Serial numbers, from udev properties and sysfs.
    pub serials: Vec<String>,
    /// World Wide Names, from udev properties and sysfs.
    pub wwns: Vec<String>,
}

impl fmt::Display for DeviceFacts {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut parts = Vec::new();
        if let Some(b) = &self.backing_file {
            let deleted = if b.deleted { " (deleted)" } else { "" };
            parts.push(format!("backed by {}{deleted}", b.path.display()));
        }
        if let Some(s) = self.serials.first() {
            parts.push(format!("serial {s:?}"));
        }
        if let Some(w) = self.wwns.first() {
            parts.push(format!("WWN {w:?}"));
        }
        if parts.is_empty() {
            f.write_str("a device with no identity")
        } else {
            f.write_str(&parts.join(", "))
        }
    }
}

/// How a device compares with the identity sought.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// It is the volume's device.
    Match,
    /// It carries none of the identity sought (an unbound loop device, a disk whose serial
    /// udev has not read yet): not the volume's device, but not another volume's either.
    Unknown,
    /// It is something else: what it is instead.
    Other(String),
}

/// Trims a serial number as udev and sysfs pad it.
pub fn normalize_serial(raw: &str) -> String {
    raw.trim().to_string()
}

/// Puts a WWN in one form: lower case, without udev's `0x` or the NVMe/SCSI `naa.`, `eui.`,
/// `t10.` prefixes.
pub fn normalize_wwn(raw: &str) -> String {
    let w = raw.trim().to_ascii_lowercase();
    for prefix in ["0x", "naa.", "eui.", "t10."] {
        if let Some(rest) = w.strip_prefix(prefix) {
            return rest.to_string();
        }
    }
    w
}

/// Compares a device's facts with the identity sought. Paths are compared as given: callers
/// on a real system pass canonical paths.
pub fn verdict(want: &DeviceIdentity, got: &DeviceFacts) -> Verdict {
    let mut matched = 0;
    let mut unknown = 0;
    if let Some(want_file) = &want.backing_file {
        match &got.backing_file {
            None => unknown += 1,
            // The volume's file is the one at the path now; an unlinked file never is.
            Some(b) if b.deleted || &b.path != want_file => return Verdict::Other(got.to_string()),
            Some(_) => matched += 1,
        }
    }
    if let Some(want_serial) = &want.serial {
        let want_serial = normalize_serial(want_serial);
        if got.serials.is_empty() {
            unknown += 1;
        } else if got
            .serials
            .iter()
            .any(|s| normalize_serial(s) == want_serial)
        {
            matched += 1;
        } else {
            return Verdict::Other(got.to_string());
        }
    }
    if let Some(want_wwn) = &want.wwn {
        let want_wwn = normalize_wwn(want_wwn);
        if got.wwns.is_empty() {
            unknown += 1;
        } else if got.wwns.iter().any(|w| normalize_wwn(w) == want_wwn) {
            matched += 1;
        } else {
            return Verdict::Other(got.to_string());
        }
    }
    if matched > 0 && unknown == 0 {
        Verdict::Match
    } else {
        Verdict::Unknown
    }
}

/// A device found by identity.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FoundDevice {
    /// Its device node.
    pub path: PathBuf,
    /// Its device number (major, minor).
    pub rdev: (u32, u32),
}

/// Where block device events come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventSource {
    /// systemd-udevd's monitor socket (events after udev has processed them).
    Udev,
    /// The kernel's uevent netlink source (no udevd on this node).
    Kernel,
}

impl fmt::Display for EventSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            EventSource::Udev => "udev",
            EventSource::Kernel => "kernel uevent",
        })
    }
}

/// Why a device could not be found.
#[derive(Debug, thiserror::Error)]
pub enum DiscoveryError {
    /// Nothing with the identity is attached now (a search that was not to wait).
    #[error("no block device with {identity} is attached to this node")]
    NotPresent {
        /// The identity sought.
        identity: String,
    },
    /// The deadline passed before the device appeared.
    #[error(
        "no block device with {identity} appeared within {waited:?} (watching {source_kind} events); is the volume attached to this node?"
    )]
    Deadline {
        /// The identity sought.
        identity: String,
        /// How long the search waited.
        waited: Duration,
        /// Which events it watched.
        source_kind: EventSource,
    },
    /// No event source could be opened, so the device cannot be waited for.
    #[error("cannot watch for block devices ({source_kind} monitor): {source}")]
    NoEventSource {
        /// Which source failed.
        source_kind: EventSource,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// Listing the block devices failed.
    #[error("cannot enumerate block devices: {0}")]
    Enumerate(#[source] std::io::Error),
    /// Waiting on the monitor failed.
    #[error("waiting for block device events: {0}")]
    Poll(#[source] std::io::Error),
}

/// Whether systemd-udevd is running: its control socket accepts a connection.
pub fn udevd_running() -> bool {
    use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};
    let Ok(sock) = rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        SocketFlags::CLOEXEC,
        None,
    ) else {
        return false;
    };
    let Ok(addr) = SocketAddrUnix::new(UDEV_CONTROL_SOCKET) else {
        return false;
    };
    rustix::net::connect(&sock, &addr).is_ok()
}

fn canonical(path: &Path) -> PathBuf {
    std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf())
}

/// The identity with its backing file path made canonical (as sysfs names files).
fn canonical_identity(want: &DeviceIdentity) -> DeviceIdentity {
    DeviceIdentity {
        backing_file: want.backing_file.as_deref().map(canonical),
        ..want.clone()
    }
}

fn text(v: Option<&OsStr>) -> Option<String> {
    let s = v?.to_str()?.trim();
    (!s.is_empty()).then(|| s.to_string())
}

/// Reads what a udev device says about itself; None for anything but a whole block disk
/// with a device node (partitions inherit their disk's serial and must not match it).
fn facts_of(dev: &udev::Device) -> Option<(FoundDevice, DeviceFacts)> {
    if dev.subsystem() != Some(OsStr::new("block")) || dev.devtype() != Some(OsStr::new("disk")) {
        return None;
    }
    let path = dev.devnode()?.to_path_buf();
    let num = dev.devnum()?;
    let rdev = (rustix::fs::major(num), rustix::fs::minor(num));
    let mut facts = DeviceFacts {
        backing_file: dev
            .attribute_value(LOOP_BACKING_ATTRIBUTE)
            .and_then(|v| BackingFile::parse(v.as_bytes()))
            .map(|b| BackingFile {
                path: if b.deleted {
                    b.path.clone()
                } else {
                    canonical(&b.path)
                },
                deleted: b.deleted,
            }),
        ..DeviceFacts::default()
    };
    for p in SERIAL_PROPERTIES {
        facts.serials.extend(text(dev.property_value(p)));
    }
    for a in SERIAL_ATTRIBUTES {
        facts.serials.extend(text(dev.attribute_value(a)));
    }
    for p in WWN_PROPERTIES {
        facts.wwns.extend(text(dev.property_value(p)));
    }
    for a in WWN_ATTRIBUTES {
        facts.wwns.extend(text(dev.attribute_value(a)));
    }
    Some((FoundDevice { path, rdev }, facts))
}

/// For a loop device that matches by its backing file's name: whether it reads the very file
/// now at that path, by inode, so the identity does not rest on the name the kernel renders
/// alone (a file recreated under the volume's name is another volume's data, whatever the name
/// says). When the filesystem reports another device for the path than for the open file
/// (overlay filesystems), the inode numbers are not comparable and the name decides.
fn confirm_inode(found: &FoundDevice, want: &DeviceIdentity) -> Verdict {
    let Some(want_file) = &want.backing_file else {
        return Verdict::Match;
    };
    match (
        loopinfo::backing_inode(&found.path),
        loopinfo::file_inode(want_file),
    ) {
        (Ok(got), Ok(now)) if got.dev == now.dev && got.ino != now.ino => Verdict::Other(format!(
            "backed by an earlier file named {} (inode {}; the file there now is inode {})",
            want_file.display(),
            got.ino,
            now.ino
        )),
        _ => Verdict::Match,
    }
}

/// Whether sysfs names `named` as the end of `wanted`: the file is named through a mount
/// that is gone. The kernel names a loop device's file through the mount it was opened by; a
/// controller in a container opens volume files through its bind mount of the data dir, and
/// once that container is gone (a restart, a rolling update) the mount is detached and the
/// file is named from the mount's own root: `/volumes/<id>.img` for
/// `/var/lib/moor-controller/volumes/<id>.img`. At least the file and its dir must be named.
pub fn names_the_end_of(named: &Path, wanted: &Path) -> bool {
    let Ok(tail) = named.strip_prefix("/") else {
        return false;
    };
    let Ok(whole) = wanted.strip_prefix("/") else {
        return false;
    };
    let tail: Vec<_> = tail.iter().collect();
    let whole: Vec<_> = whole.iter().collect();
    tail.len() >= 2 && tail.len() < whole.len() && whole.ends_with(&tail)
}

/// For a loop device whose file sysfs names by the end of the wanted path
/// ([`names_the_end_of`]): its facts with the wanted path, when the name the device keeps
/// from its attach (`lo_file_name`, as the controller gave it: its first 63 bytes) is the
/// wanted path; None otherwise.
fn named_through_a_gone_mount(
    found: &FoundDevice,
    facts: &DeviceFacts,
    want: &DeviceIdentity,
) -> Option<DeviceFacts> {
    let wanted = want.backing_file.as_ref()?;
    let named = facts.backing_file.as_ref().filter(|b| !b.deleted)?;
    if !names_the_end_of(&named.path, wanted) {
        return None;
    }
    let kept = loopinfo::attached_name(&found.path).ok()?;
    let wanted_bytes = wanted.as_os_str().as_bytes();
    let stored = &wanted_bytes[..wanted_bytes
        .len()
        .min(moor_runtime::sys::loopdev::LO_NAME_SIZE - 1)];
    (kept == stored).then(|| DeviceFacts {
        backing_file: Some(BackingFile {
            path: wanted.clone(),
            deleted: false,
        }),
        ..facts.clone()
    })
}

/// The full check of a real device: its facts, then (for a loop device) its backing inode.
fn check(found: &FoundDevice, facts: &DeviceFacts, want: &DeviceIdentity) -> Verdict {
    match verdict(want, facts) {
        Verdict::Match => confirm_inode(found, want),
        Verdict::Other(why) => match named_through_a_gone_mount(found, facts, want) {
            Some(renamed) if verdict(want, &renamed) == Verdict::Match => {
                confirm_inode(found, want)
            }
            _ => Verdict::Other(why),
        },
        other => other,
    }
}

/// Compares the block device `rdev` with `want`, through udev and sysfs.
pub fn identify_with_udev(rdev: (u32, u32), want: &DeviceIdentity) -> Verdict {
    let num = rustix::fs::makedev(rdev.0, rdev.1);
    let Ok(dev) = udev::Device::from_devnum(udev::DeviceType::Block, num) else {
        return Verdict::Unknown;
    };
    match facts_of(&dev) {
        Some((found, facts)) => check(&found, &facts, &canonical_identity(want)),
        None => Verdict::Other("not a whole block disk".into()),
    }
}

/// Looks through the block devices present now for one with `want`.
fn scan(want: &DeviceIdentity) -> Result<Option<FoundDevice>, DiscoveryError> {
    let mut en = udev::Enumerator::new().map_err(DiscoveryError::Enumerate)?;
    en.match_subsystem("block")
        .map_err(DiscoveryError::Enumerate)?;
    let devices = en.scan_devices().map_err(DiscoveryError::Enumerate)?;
    for dev in devices {
        if let Some((found, facts)) = facts_of(&dev)
            && check(&found, &facts, want) == Verdict::Match
        {
            return Ok(Some(found));
        }
    }
    Ok(None)
}

/// Opens the monitor for block device events from `source`.
fn subscribe(source: EventSource) -> Result<udev::MonitorSocket, DiscoveryError> {
    let err = |e| DiscoveryError::NoEventSource {
        source_kind: source,
        source: e,
    };
    let builder = match source {
        EventSource::Udev => udev::MonitorBuilder::new(),
        EventSource::Kernel => udev::MonitorBuilder::new_kernel(),
    }
    .map_err(err)?;
    builder
        .match_subsystem("block")
        .map_err(err)?
        .listen()
        .map_err(err)
}

/// Finds the block device with identity `want`, waiting up to `wait` for it to appear.
///
/// The monitor is subscribed before the devices present are enumerated, so a device that
/// appears in between is not missed. The wait blocks in poll(2) on the monitor with the time
/// left; each add or change event of a block disk is checked against `want`. Events come from
/// systemd-udevd when it runs, else straight from the kernel.
pub fn find_with_udev(
    want: &DeviceIdentity,
    wait: Duration,
) -> Result<FoundDevice, DiscoveryError> {
    let want = canonical_identity(want);
    let start = Instant::now();
    let source = if udevd_running() {
        EventSource::Udev
    } else {
        EventSource::Kernel
    };
    let monitor = if wait.is_zero() {
        None
    } else {
        Some(subscribe(source)?)
    };
    if let Some(found) = scan(&want)? {
        return Ok(found);
    }
    let Some(monitor) = monitor else {
        return Err(DiscoveryError::NotPresent {
            identity: want.to_string(),
        });
    };
    let deadline = start + wait;
    loop {
        let now = Instant::now();
        if now >= deadline {
            return Err(DiscoveryError::Deadline {
                identity: want.to_string(),
                waited: wait,
                source_kind: source,
            });
        }
        let left = deadline - now;
        let timeout = rustix::fs::Timespec {
            tv_sec: i64::try_from(left.as_secs()).unwrap_or(i64::MAX),
            tv_nsec: i64::from(left.subsec_nanos()),
        };
        let mut fds = [rustix::event::PollFd::new(
            &monitor,
            rustix::event::PollFlags::IN,
        )];
        match rustix::event::poll(&mut fds, Some(&timeout)) {
            Ok(0) => continue,
            Ok(_) => {}
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(DiscoveryError::Poll(e.into())),
        }
        let mut events = 0;
        for event in monitor.iter() {
            events += 1;
            if !matches!(
                event.event_type(),
                udev::EventType::Add | udev::EventType::Change
            ) {
                continue;
            }
            if let Some((found, facts)) = facts_of(&event.device())
                && check(&found, &facts, &want) == Verdict::Match
            {
                return Ok(found);
            }
        }
        if events == 0 {
            // Readable but nothing parsed: the socket overflowed (ENOBUFS) or an event was
            // dropped. Events may be lost: look again at what is there.
            if let Some(found) = scan(&want)? {
                return Ok(found);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn loop_facts(path: &str, deleted: bool) -> DeviceFacts {
        DeviceFacts {
            backing_file: Some(BackingFile {
                path: path.into(),
                deleted,
            }),
            ..DeviceFacts::default()
        }
    }

    fn by_file(path: &str) -> DeviceIdentity {
        DeviceIdentity {
            backing_file: Some(path.into()),
            ..DeviceIdentity::default()
        }
    }

    #[test]
    fn backing_file_parses_sysfs_text() {
        assert_eq!(
            BackingFile::parse(b"/data/v.img\n"),
            Some(BackingFile {
                path: "/data/v.img".into(),
                deleted: false
            })
        );
        assert_eq!(
            BackingFile::parse(b"/data/v.img (deleted)\n"),
            Some(BackingFile {
                path: "/data/v.img".into(),
                deleted: true
            })
        );
        assert_eq!(BackingFile::parse(b"\n"), None);
        assert_eq!(BackingFile::parse(b""), None);
    }

    #[test]
    fn a_file_named_through_a_gone_mount_is_the_end_of_its_path() {
        let wanted = Path::new("/var/lib/moor-local/data/volumes/vol-0123456789abcdef.img");
        for named in [
            "/volumes/vol-0123456789abcdef.img",
            "/data/volumes/vol-0123456789abcdef.img",
            "/moor-local/data/volumes/vol-0123456789abcdef.img",
        ] {
            assert!(names_the_end_of(Path::new(named), wanted), "{named}");
        }
        for named in [
            "/vol-0123456789abcdef.img",
            "/other/vol-0123456789abcdef.img",
            "/volumes/vol-0123456789abcdee.img",
            "/var/lib/moor-local/data/volumes/vol-0123456789abcdef.img",
            "volumes/vol-0123456789abcdef.img",
            "/x/var/lib/moor-local/data/volumes/vol-0123456789abcdef.img",
        ] {
            assert!(!names_the_end_of(Path::new(named), wanted), "{named}");
        }
    }

    #[test]
    fn a_loop_device_matches_only_its_live_backing_file() {
        let want = by_file("/data/v.img");
        assert_eq!(
            verdict(&want, &loop_facts("/data/v.img", false)),
            Verdict::Match
        );
        assert!(matches!(
            verdict(&want, &loop_facts("/data/other.img", false)),
            Verdict::Other(s) if s.contains("/data/other.img")
        ));
        // The old file was unlinked (and maybe recreated under the same name): not the volume.
        assert!(matches!(
            verdict(&want, &loop_facts("/data/v.img", true)),
            Verdict::Other(s) if s.contains("(deleted)")
        ));
        // An unbound loop device is nobody's.
        assert_eq!(verdict(&want, &DeviceFacts::default()), Verdict::Unknown);
    }

    #[test]
    fn serials_and_wwns_compare_normalized() {
        let want = DeviceIdentity {
            serial: Some("vol-0abc".into()),
            wwn: Some("0x5000C500A1B2C3D4".into()),
            ..DeviceIdentity::default()
        };
        let facts = DeviceFacts {
            backing_file: None,
            serials: vec!["  vol-0abc ".into()],
            wwns: vec!["naa.5000c500a1b2c3d4".into()],
        };
        assert_eq!(verdict(&want, &facts), Verdict::Match);
        let other = DeviceFacts {
            serials: vec!["vol-0def".into()],
            ..facts.clone()
        };
        assert!(matches!(verdict(&want, &other), Verdict::Other(s) if s.contains("vol-0def")));
        // Serial known but WWN not read yet: not proven.
        let partial = DeviceFacts {
            wwns: vec![],
            ..facts
        };
        assert_eq!(verdict(&want, &partial), Verdict::Unknown);
    }

    #[test]
    fn an_empty_identity_matches_nothing() {
        assert_eq!(
            verdict(&DeviceIdentity::default(), &loop_facts("/x", false)),
            Verdict::Unknown
        );
        assert_eq!(DeviceIdentity::default().to_string(), "no identity");
    }

    #[test]
    fn wwn_forms_normalize_alike() {
        assert_eq!(normalize_wwn("0x5000C500"), "5000c500");
        assert_eq!(normalize_wwn("eui.0025385B"), "0025385b");
        assert_eq!(normalize_wwn("5000c500"), "5000c500");
    }
}
