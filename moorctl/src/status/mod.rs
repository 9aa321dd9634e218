//! `moorctl status`: moor's journal side by side with the live mount table and the devices.
//!
//! The journal is read without changing it; the mount table is read once, from
//! `/proc/self/mountinfo`; each recorded path is looked at with one `statx` (mount root, mount
//! id) and each device with one `stat` and, for a loop device, its sysfs `backing_file`.
//! Judging is pure ([`judge_path`], [`judge_device`]) so it is unit-tested without a kernel.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use moor_node::attach::journal::MappingRecord;
use moor_node::journal::{AccessRecord, Boot, Phase, VolumeRecord};
use moor_node::sys::Presence;
use moor_node::sys::mountinfo::MountInfo;
use moor_proto::csi::v1 as csi;
use moor_proto::csi::v1::identity_client::IdentityClient;
use rustix::fs::{AtFlags, FileType, StatxAttributes, StatxFlags};
use serde::Serialize;
use serde_json::json;

use crate::error::CliError;
use crate::output::{Human, Report, Table};

/// The loop driver's block major.
const LOOP_MAJOR: u32 = 7;

/// How a volume (or one of its paths) stands, from best to worst.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Verdict {
    /// The journal and the system agree.
    Healthy,
    /// Recorded before the node's last reboot, and nothing of it is mounted (or mapped) now: a
    /// memory of a mount the reboot ended (a power cut may have taken the record of its end),
    /// which moor-node holds nothing by (docs/durability.md). Not a fault.
    Remembered,
    /// Mounted as recorded, but kubelet no longer knows the mount: the `vol_data.json` it
    /// keeps beside it is gone (kubelet restarted or the node rebooted and lost it,
    /// kubernetes#121937). moor-node leaves it mounted (a pod may use it); kubelet's unpublish
    /// or unstage of the path, or an operator's, ends it.
    KubeletForgot,
    /// They disagree: a recorded mount is missing or from another device, or a phase is still
    /// in progress.
    Drifted,
    /// The recorded device could not be checked (an error that does not say it is gone, or a
    /// size of 0, as a detached loop device reads): moor reports it and never acts on it.
    Unknown,
    /// A recorded path fails with an error that means a broken mount (ENOTCONN, ESTALE, EIO...).
    Corrupted,
    /// The recorded device is gone, detached, or now another device.
    DeviceGone,
}

impl Verdict {
    /// The verdict's name as printed.
    pub fn name(self) -> &'static str {
        match self {
            Self::Healthy => "healthy",
            Self::Remembered => "remembered",
            Self::KubeletForgot => "kubelet-forgot",
            Self::Drifted => "drifted",
            Self::Unknown => "unknown",
            Self::Corrupted => "corrupted",
            Self::DeviceGone => "device-gone",
        }
    }
}

/// What is at a recorded path now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LivePath {
    /// Nothing there.
    Absent,
    /// Something there, not a mount point.
    NotMounted,
    /// A mount point.
    Mounted {
        /// st_dev of the files on it.
        dev: (u32, u32),
        /// For a block device node: its rdev.
        rdev: Option<(u32, u32)>,
        /// The device behind the filesystem when st_dev is anonymous (btrfs): the rdev of the
        /// mount table's source.
        source_rdev: Option<(u32, u32)>,
        /// Filesystem type, from the mount table.
        fs_type: String,
    },
    /// The path fails with this errno, one that means a broken mount.
    Broken(i32),
    /// Another error.
    Unreadable(String),
}

/// What the recorded device is now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LiveDevice {
    /// The node is there with the recorded number; for a loop device, its backing file.
    Present {
        /// The loop backing file, if it is a loop device.
        backing: Option<String>,
    },
    /// No such node.
    Missing,
    /// The node is another device now.
    Other((u32, u32)),
    /// Not a block device.
    NotBlock,
    /// A loop device with nothing attached.
    Detached,
    /// A loop device whose backing file was deleted.
    BackingDeleted(String),
    /// Cannot be looked at.
    Unreadable(String),
}

/// One line of the verdict: a path or the device of a volume.
#[derive(Debug, Clone, Serialize)]
pub struct Check {
    /// `mapping`, `device`, `staging` or `publish`.
    pub role: &'static str,
    /// The path.
    pub path: PathBuf,
    /// What the journal says.
    pub journal: String,
    /// What is there.
    pub live: String,
    /// The verdict on this line.
    pub verdict: Verdict,
    /// Why, when not healthy.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// One volume's verdict.
#[derive(Debug, Clone, Serialize)]
pub struct VolumeStatus {
    /// CSI volume id.
    pub volume_id: String,
    /// The worst verdict of its checks.
    pub verdict: Verdict,
    /// Every check.
    pub checks: Vec<Check>,
}

fn dev_text(d: (u32, u32)) -> String {
    format!("{}:{}", d.0, d.1)
}

fn errno_text(errno: i32) -> String {
    let name = match errno {
        libc::ENOTCONN => "ENOTCONN",
        libc::ESTALE => "ESTALE",
        libc::EIO => "EIO",
        libc::EHOSTDOWN => "EHOSTDOWN",
        libc::ENXIO => "ENXIO",
        libc::ENODEV => "ENODEV",
        _ => "errno",
    };
    format!(
        "{name} ({})",
        std::io::Error::from_raw_os_error(errno)
            .to_string()
            .split(" (os error")
            .next()
            .unwrap_or_default()
    )
}

/// What a live path reads as in the LIVE column.
pub fn live_text(live: &LivePath) -> String {
    match live {
        LivePath::Absent => "absent".into(),
        LivePath::NotMounted => "not mounted".into(),
        LivePath::Mounted { rdev: Some(r), .. } => format!("device node {}", dev_text(*r)),
        LivePath::Mounted {
            dev,
            source_rdev,
            fs_type,
            ..
        } => match source_rdev {
            Some(s) if s != dev => format!("mounted {fs_type} from {}", dev_text(*s)),
            _ => format!("mounted {fs_type} from {}", dev_text(*dev)),
        },
        LivePath::Broken(e) => format!("broken: {}", errno_text(*e)),
        LivePath::Unreadable(e) => format!("unreadable: {e}"),
    }
}

/// Judges one recorded path. `block` is whether a block device node is expected there (a
/// block publish); `rdev` is the device recorded at stage.
pub fn judge_path(
    what: &str,
    phase: Phase,
    block: bool,
    rdev: Option<(u32, u32)>,
    live: &LivePath,
) -> (Verdict, Option<String>) {
    match live {
        LivePath::Broken(e) => {
            return (
                Verdict::Corrupted,
                Some(format!("the mount fails with {}", errno_text(*e))),
            );
        }
        LivePath::Unreadable(e) => {
            return (Verdict::Drifted, Some(format!("cannot look at it: {e}")));
        }
        _ => {}
    }
    if phase != Phase::Done {
        return (
            Verdict::Drifted,
            Some(format!(
                "the journal says {what} is still {}: moor-node died or is working on it",
                match phase {
                    Phase::Formatting => "formatting",
                    _ => "in progress",
                }
            )),
        );
    }
    match live {
        LivePath::Absent | LivePath::NotMounted => (
            Verdict::Drifted,
            Some(format!(
                "recorded as {what} but nothing is mounted there{}",
                if *live == LivePath::Absent {
                    " (the path is gone)"
                } else {
                    ""
                }
            )),
        ),
        LivePath::Mounted {
            dev,
            rdev: live_rdev,
            source_rdev,
            ..
        } => {
            let Some(want) = rdev else {
                return (Verdict::Healthy, None);
            };
            let got = if block {
                *live_rdev
            } else if *dev == want || live_rdev.is_some() {
                Some(*dev)
            } else {
                source_rdev.or(Some(*dev))
            };
            if got == Some(want) {
                (Verdict::Healthy, None)
            } else if block && live_rdev.is_none() {
                (
                    Verdict::Drifted,
                    Some("a filesystem is mounted where a block device node was published".into()),
                )
            } else {
                (
                    Verdict::Drifted,
                    Some(format!(
                        "mounted from device {}, but the journal recorded {}",
                        got.map_or_else(|| "?".into(), dev_text),
                        dev_text(want)
                    )),
                )
            }
        }
        LivePath::Broken(_) | LivePath::Unreadable(_) => (Verdict::Drifted, None),
    }
}

/// Judges the recorded device.
pub fn judge_device(
    device: &Path,
    rdev: (u32, u32),
    live: &LiveDevice,
) -> (Verdict, String, Option<String>) {
    let dev = device.display();
    match live {
        LiveDevice::Present { backing: Some(b) } => (
            Verdict::Healthy,
            format!("{} backed by {b}", dev_text(rdev)),
            None,
        ),
        LiveDevice::Present { backing: None } => (Verdict::Healthy, dev_text(rdev), None),
        LiveDevice::Missing => (
            Verdict::DeviceGone,
            "absent".into(),
            Some(format!("device {dev} no longer exists")),
        ),
        LiveDevice::Other(now) => (
            Verdict::DeviceGone,
            dev_text(*now),
            Some(format!(
                "{dev} is now device {}, not the recorded {}",
                dev_text(*now),
                dev_text(rdev)
            )),
        ),
        LiveDevice::NotBlock => (
            Verdict::Unknown,
            "not a block device".into(),
            Some(format!("{dev} is no longer a block device")),
        ),
        LiveDevice::Detached => (
            Verdict::Unknown,
            "detached".into(),
            Some(format!(
                "loop device {dev} has been detached: no backing file"
            )),
        ),
        LiveDevice::BackingDeleted(b) => (
            Verdict::Drifted,
            format!("backed by {b}"),
            Some(format!("the backing file of {dev} has been deleted")),
        ),
        LiveDevice::Unreadable(e) => (
            Verdict::Unknown,
            "unreadable".into(),
            Some(format!("{dev} cannot be checked: {e}")),
        ),
    }
}

/// The mount table, by mount id.
#[derive(Debug, Default)]
pub struct MountTable {
    by_id: HashMap<u64, MountInfo>,
}

impl MountTable {
    /// Reads and parses `/proc/self/mountinfo` once.
    pub fn read() -> Result<Self, CliError> {
        let path = PathBuf::from("/proc/self/mountinfo");
        let bytes = std::fs::read(&path).map_err(|e| CliError::MountTable {
            path: path.clone(),
            reason: e.to_string(),
        })?;
        let entries =
            moor_node::sys::mountinfo::parse(&bytes).map_err(|e| CliError::MountTable {
                path,
                reason: e.to_string(),
            })?;
        Ok(Self {
            by_id: entries.into_iter().map(|m| (m.mount_id, m)).collect(),
        })
    }
}

/// Looks at one path: one statx, then the mount table by mount id.
pub fn look_at_path(path: &Path, table: &MountTable) -> LivePath {
    let stx = match rustix::fs::statx(
        rustix::fs::CWD,
        path,
        AtFlags::SYMLINK_NOFOLLOW,
        StatxFlags::TYPE | StatxFlags::MNT_ID,
    ) {
        Ok(s) => s,
        Err(rustix::io::Errno::NOENT) => return LivePath::Absent,
        Err(e) if moor_node::sys::is_corruption_errno(e.raw_os_error()) => {
            return LivePath::Broken(e.raw_os_error());
        }
        Err(e) => return LivePath::Unreadable(std::io::Error::from(e).to_string()),
    };
    let mount_root = stx
        .stx_attributes_mask
        .contains(StatxAttributes::MOUNT_ROOT)
        && stx.stx_attributes.contains(StatxAttributes::MOUNT_ROOT);
    if !mount_root {
        return LivePath::NotMounted;
    }
    let dev = (stx.stx_dev_major, stx.stx_dev_minor);
    let is_block = FileType::from_raw_mode(stx.stx_mode.into()) == FileType::BlockDevice;
    let rdev = is_block.then_some((stx.stx_rdev_major, stx.stx_rdev_minor));
    let entry = table.by_id.get(&stx.stx_mnt_id);
    let fs_type = entry.map_or_else(|| "?".to_string(), |m| m.fs_type.clone());
    // An anonymous st_dev (major 0, as btrfs gives) says nothing of the device: take the
    // mount table's source instead.
    let source_rdev = entry
        .filter(|m| dev.0 == 0 && m.source.starts_with("/dev/"))
        .and_then(|m| rustix::fs::stat(m.source.as_str()).ok())
        .map(|st| (rustix::fs::major(st.st_rdev), rustix::fs::minor(st.st_rdev)));
    LivePath::Mounted {
        dev,
        rdev,
        source_rdev,
        fs_type,
    }
}

/// Looks at the recorded device node, gone or not as moor-node decides it
/// ([`moor_node::sys::presence_of`]), with what a loop device says of its file.
pub fn look_at_device(device: &Path, rdev: (u32, u32)) -> LiveDevice {
    let opened = moor_node::sys::linux::block_device(device);
    let now = opened.as_ref().ok().map(|d| d.rdev);
    let not_block = opened
        .as_ref()
        .is_err_and(|e| e.errno() == Some(libc::ENOTBLK));
    let loop_file = || {
        let sys = format!("/sys/dev/block/{}:{}/loop/backing_file", rdev.0, rdev.1);
        match std::fs::read_to_string(&sys) {
            Ok(b) => Ok(b.trim_end_matches('\n').to_string()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(LiveDevice::Detached),
            Err(e) => Err(LiveDevice::Unreadable(e.to_string())),
        }
    };
    match moor_node::sys::presence_of(device, rdev, opened) {
        Presence::Gone(_) => match now {
            Some(other) => LiveDevice::Other(other),
            None => LiveDevice::Missing,
        },
        Presence::Unknown(_) if not_block => LiveDevice::NotBlock,
        Presence::Unknown(why) => match (rdev.0 == LOOP_MAJOR).then(loop_file) {
            Some(Err(detail)) => detail,
            _ => LiveDevice::Unreadable(why),
        },
        Presence::Present(_) if rdev.0 != LOOP_MAJOR => LiveDevice::Present { backing: None },
        Presence::Present(_) => match loop_file() {
            Ok(b) if b.ends_with(" (deleted)") => LiveDevice::BackingDeleted(b),
            Ok(b) => LiveDevice::Present { backing: Some(b) },
            Err(detail) => detail,
        },
    }
}

fn phase_text(phase: Phase, done: &str) -> String {
    match phase {
        Phase::Done => done.to_string(),
        Phase::InProgress => format!("{done} (in progress)"),
        Phase::Formatting => "formatting".into(),
    }
}

/// Judges an RBD volume's mapping: what the journal says of it, and the verdict on its device
/// (`live`, looked at when the record names one). A map or an unmap in progress is drift.
pub fn judge_mapping(m: &MappingRecord, live: Option<&LiveDevice>) -> Check {
    let mut journal = format!("rbd {} ({})", m.spec(), m.attacher);
    if m.read_only {
        journal.push_str(", read-only");
    }
    let journal = phase_text(m.phase, &format!("mapped {journal}"));
    let path = m
        .device
        .clone()
        .unwrap_or_else(|| PathBuf::from(m.spec().to_string()));
    let (verdict, live, reason) = match (m.phase, &m.device, m.rdev, live) {
        (Phase::Done, Some(device), Some(rdev), Some(live)) => judge_device(device, rdev, live),
        (Phase::Done, ..) => (
            Verdict::Drifted,
            "-".into(),
            Some("the mapping's device is not recorded".into()),
        ),
        _ => (
            Verdict::Drifted,
            "-".into(),
            Some(format!(
                "a map or an unmap of RBD image {} is in progress",
                m.spec()
            )),
        ),
    };
    Check {
        role: "mapping",
        path,
        journal,
        live,
        verdict,
        reason,
    }
}

/// Whether a record written in boot `written` and at a path that is `live` is a memory in boot
/// `boot`: written in an earlier boot, and nothing mounted there now (a record of a mapping, or
/// of a block volume's stage, which mounts nothing: `live` None).
pub fn is_memory(boot: &Boot, written: Option<&str>, live: Option<&LivePath>) -> bool {
    boot.is_earlier(written)
        && live.is_none_or(|l| matches!(l, LivePath::Absent | LivePath::NotMounted))
}

/// The line of a memory ([`is_memory`]): what the journal remembers, nothing judged.
fn remembered(role: &'static str, path: &Path, journal: String, live: String) -> Check {
    Check {
        role,
        path: path.to_path_buf(),
        journal: format!("{journal}, before the reboot"),
        live,
        verdict: Verdict::Remembered,
        reason: Some(
            "recorded before the node rebooted, and nothing of it is there now: moor-node \
             holds nothing by it (kubelet makes it again, or had ended it)"
                .into(),
        ),
    }
}

/// Checks one volume's record against the system, in boot `boot`.
pub fn check_volume(rec: &VolumeRecord, table: &MountTable, boot: &Boot) -> VolumeStatus {
    let mut checks = Vec::new();
    if let Some(m) = &rec.mapping {
        if is_memory(boot, m.boot.as_deref(), None) {
            let journal = format!("mapped rbd {} ({})", m.spec(), m.attacher);
            let path = m
                .device
                .clone()
                .unwrap_or_else(|| PathBuf::from(m.spec().to_string()));
            checks.push(remembered("mapping", &path, journal, "-".into()));
        } else {
            let live = match (&m.device, m.rdev) {
                (Some(d), Some(r)) if m.phase == Phase::Done => Some(look_at_device(d, r)),
                _ => None,
            };
            checks.push(judge_mapping(m, live.as_ref()));
        }
    }
    let rdev = rec.stage.as_ref().map(|s| s.rdev);
    let stage_live = rec
        .stage
        .as_ref()
        .filter(|s| !matches!(s.access, AccessRecord::Block))
        .map(|s| look_at_path(&s.path, table));
    if let Some(s) = rec
        .stage
        .as_ref()
        .filter(|s| is_memory(boot, s.boot.as_deref(), stage_live.as_ref()))
    {
        // Its device's number is the earlier boot's: not looked at.
        checks.push(Check {
            reason: None,
            ..remembered("device", &s.device, dev_text(s.rdev), "-".into())
        });
        checks.push(remembered(
            "staging",
            &s.path,
            phase_text(s.phase, "staged"),
            stage_live.as_ref().map_or_else(|| "-".into(), live_text),
        ));
    } else if let Some(s) = &rec.stage {
        let (verdict, live, reason) =
            judge_device(&s.device, s.rdev, &look_at_device(&s.device, s.rdev));
        checks.push(Check {
            role: "device",
            path: s.device.clone(),
            journal: dev_text(s.rdev),
            live,
            verdict,
            reason,
        });
        let block = matches!(s.access, AccessRecord::Block);
        if block {
            // Staging a block volume mounts nothing; only the phase can be off.
            let (verdict, reason) = if s.phase == Phase::Done {
                (Verdict::Healthy, None)
            } else {
                judge_path("staged", s.phase, false, None, &LivePath::NotMounted)
            };
            checks.push(Check {
                role: "staging",
                path: s.path.clone(),
                journal: phase_text(s.phase, "staged (block)"),
                live: "-".into(),
                verdict,
                reason,
            });
        } else {
            let live = stage_live.unwrap_or_else(|| look_at_path(&s.path, table));
            let (verdict, reason) = judge_path("staged", s.phase, false, Some(s.rdev), &live);
            let fs = match &s.access {
                AccessRecord::Mount { fs_type, .. } => fs_type.as_str(),
                AccessRecord::Block => "block",
            };
            checks.push(Check {
                role: "staging",
                path: s.path.clone(),
                journal: phase_text(s.phase, &format!("mounted {fs}")),
                live: live_text(&live),
                verdict,
                reason,
            });
        }
    }
    for (target, p) in &rec.publishes {
        let live = look_at_path(target, table);
        if is_memory(boot, p.boot.as_deref(), Some(&live)) {
            let journal = phase_text(p.phase, "published");
            checks.push(remembered("publish", target, journal, live_text(&live)));
            continue;
        }
        let (verdict, reason) = judge_path("published", p.phase, p.block, rdev, &live);
        checks.push(Check {
            role: "publish",
            path: target.clone(),
            journal: phase_text(
                p.phase,
                if p.block {
                    "published (block)"
                } else {
                    "published"
                },
            ),
            live: live_text(&live),
            verdict,
            reason,
        });
    }
    for c in &mut checks {
        if c.verdict == Verdict::Healthy
            && matches!(c.role, "staging" | "publish")
            && moor_node::reconcile::kubelet_forgot(&c.path)
        {
            c.verdict = Verdict::KubeletForgot;
            c.reason = Some(
                "mounted as recorded, but kubelet's vol_data.json beside it is gone: kubelet \
                 no longer knows this mount; moor-node leaves it mounted (a pod may use it)"
                    .into(),
            );
        }
    }
    let verdict = checks
        .iter()
        .map(|c| c.verdict)
        .max()
        .unwrap_or(Verdict::Healthy);
    VolumeStatus {
        volume_id: rec.volume_id.clone(),
        verdict,
        checks,
    }
}

/// A journal record that could not be read.
#[derive(Debug, Clone, Serialize)]
pub struct Problem {
    /// The file.
    pub path: PathBuf,
    /// 1-based line of the journal log (0: the file as a whole).
    pub line: usize,
    /// Why.
    pub error: String,
}

/// The whole status, as a report; `Err(Unhealthy)` carries it when anything is off.
pub fn render(
    state_dir: &Path,
    volumes: &[VolumeStatus],
    problems: &[Problem],
) -> (Report, Option<String>) {
    let mut table = Table::new(&["VOLUME", "VERDICT", "WHAT", "PATH", "JOURNAL", "LIVE"]);
    let mut notes = String::new();
    for v in volumes {
        for (i, c) in v.checks.iter().enumerate() {
            table.row(vec![
                if i == 0 {
                    v.volume_id.clone()
                } else {
                    String::new()
                },
                if i == 0 {
                    v.verdict.name().into()
                } else {
                    String::new()
                },
                c.role.into(),
                c.path.display().to_string(),
                c.journal.clone(),
                c.live.clone(),
            ]);
            if let Some(r) = &c.reason {
                notes.push_str(&format!(
                    "{}: {} ({} {})\n",
                    v.volume_id,
                    r,
                    c.role,
                    c.path.display()
                ));
            }
        }
    }
    for p in problems {
        notes.push_str(&format!(
            "unreadable journal record {}:{}: {}\n",
            p.path.display(),
            p.line,
            p.error
        ));
    }
    let mut counts: Vec<String> = Vec::new();
    for verdict in [
        Verdict::Healthy,
        Verdict::Remembered,
        Verdict::KubeletForgot,
        Verdict::Drifted,
        Verdict::Unknown,
        Verdict::Corrupted,
        Verdict::DeviceGone,
    ] {
        let n = volumes.iter().filter(|v| v.verdict == verdict).count();
        if n > 0 {
            counts.push(format!("{n} {}", verdict.name()));
        }
    }
    let summary = format!(
        "{} volume{} in {}{}{}",
        volumes.len(),
        if volumes.len() == 1 { "" } else { "s" },
        state_dir.display(),
        if counts.is_empty() {
            String::new()
        } else {
            format!(": {}", counts.join(", "))
        },
        if problems.is_empty() {
            String::new()
        } else {
            format!(
                "; {} unreadable journal record{}",
                problems.len(),
                if problems.len() == 1 { "" } else { "s" }
            )
        }
    );
    notes.push_str(&summary);
    // What a reboot ended is no fault.
    let healthy = problems.is_empty() && volumes.iter().all(|v| v.verdict <= Verdict::Remembered);
    let human = if volumes.is_empty() {
        Human::Text(notes)
    } else {
        Human::Table(table, notes)
    };
    let report = Report {
        human,
        json: json!({
            "state_dir": state_dir,
            "healthy": healthy,
            "volumes": volumes,
            "journal_problems": problems,
        }),
    };
    (report, (!healthy).then_some(summary))
}

/// The state dir a GetPluginInfo manifest names (a moor-node's), or why there is none.
pub fn state_dir_in(
    manifest: &HashMap<String, String>,
    endpoint: &str,
) -> Result<PathBuf, CliError> {
    match manifest.get(moor_node::service::MANIFEST_STATE_DIR) {
        Some(dir) if dir.starts_with('/') => Ok(PathBuf::from(dir)),
        _ => Err(CliError::NotANode {
            endpoint: endpoint.to_string(),
            component: manifest
                .get("component")
                .map_or_else(|| "unknown".to_string(), |c| format!("{c:?}")),
        }),
    }
}

/// The state dir of the moor-node at `endpoint`, as its GetPluginInfo says.
pub async fn state_dir_of(endpoint: &str, timeout: Duration) -> Result<PathBuf, CliError> {
    let channel = crate::client::connect(endpoint, timeout).await?;
    let mut request = tonic::Request::new(csi::GetPluginInfoRequest {});
    request.set_timeout(timeout);
    let info = IdentityClient::new(channel)
        .get_plugin_info(request)
        .await
        .map_err(CliError::rpc("GetPluginInfo"))?
        .into_inner();
    state_dir_in(&info.manifest, endpoint)
}

/// `moorctl status`: reads the journal and the mount table once, checks every volume. With
/// `shown_below`, paths under that dir are printed relative to it.
pub fn status(
    state_dir: &Path,
    shown_below: Option<&Path>,
) -> Result<(Report, Option<String>), CliError> {
    let (records, problems) = moor_node::journal::read_state(state_dir)?;
    let table = MountTable::read()?;
    let boot = Boot::new(moor_node::sys::linux::boot_id());
    let volumes: Vec<VolumeStatus> = records
        .iter()
        .filter(|r| !r.is_empty())
        .map(|r| check_volume(r, &table, &boot))
        .map(|mut v| {
            for c in &mut v.checks {
                if let Some(rel) = shown_below.and_then(|b| c.path.strip_prefix(b).ok()) {
                    c.path = rel.to_path_buf();
                }
            }
            v
        })
        .collect();
    let problems: Vec<Problem> = problems
        .into_iter()
        .map(|p| Problem {
            path: p.path,
            line: p.line,
            error: p.error.to_string(),
        })
        .collect();
    let shown = shown_below
        .and_then(|b| state_dir.strip_prefix(b).ok())
        .unwrap_or(state_dir);
    Ok(render(shown, &volumes, &problems))
}

#[cfg(test)]
mod tests;
