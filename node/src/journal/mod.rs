//! The node journal: what moor intends and has done, per volume, in `--state-dir`.
//!
//! An append-only log, `journal.log`: one line per change, `moor-journal v1 <crc32c hex>
//! <json>\n`, the whole new record of one volume. Replaying the log keeps the newest line of
//! each volume; a damaged line fails its checksum and is reported, never trusted. One change
//! costs one `write(2)`; the log is compacted (temp file, rename over the log) when it has
//! grown well past the live records.
//!
//! Durability follows the lifetime of what a record describes. Mounts do not survive a reboot,
//! so a record of a mount only has to survive the death of the process, which the page cache
//! gives as soon as `write(2)` returns. A record that guards data across reboots (a mkfs in
//! progress) is `fdatasync`ed before the mkfs starts; `--journal-fsync` syncs every line.
//! Durable lines written at once share their syncs (a group commit, [`Journal::put`]); after
//! a failed sync the journal refuses every change until moor-node restarts.
//! A compaction is fsynced (temp file, then the dir after the rename) only while such a record
//! is live, or with `--journal-fsync`: otherwise a power loss can cost at most records of
//! mounts the reboot has undone anyway, and the hot path does not wait for the disk.
//!
//! After each sync, [`SYNCED_FILE`] marks how much of the log is durable ([`SyncedMark`]): at
//! start, damage after that point is an append a power cut tore (unsynced pages reach the disk
//! in any order, so it can lie in the middle of the unsynced part), dropped from the torn line
//! on like a torn tail; damage inside it is damage.

use std::collections::{BTreeMap, HashMap};
use std::fs::{File, OpenOptions};
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};

use serde::{Deserialize, Serialize};

use crate::sys::MountAttrs;

/// The journal's format, the version every line's header names. A moor-node reads a log of
/// its own version and refuses, before it changes anything, a log holding a line of a newer
/// one, or a whole line (its checksum holds) whose record it does not understand: a field or a
/// value only a newer moor-node writes (every record refuses unknown fields). A downgrade
/// therefore either reads the journal as it is or stops with the reason, never drops what it
/// cannot read. A change an older moor-node must not read (a new field, a new phase) needs no
/// new version to be refused; a new version is for a line that is no longer this format.
pub const FORMAT_VERSION: u32 = 1;
const MAGIC: &str = "moor-journal v1 ";
/// What every version's header starts with.
const MAGIC_STEM: &str = "moor-journal v";

/// Journal failures.
#[derive(Debug, thiserror::Error)]
pub enum JournalError {
    /// The state dir cannot be created or read.
    #[error("state dir {path}: {source}")]
    Dir {
        /// The dir.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A record could not be written.
    #[error("writing {path}: {source}")]
    Write {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The log was written by a newer moor-node: a line this one cannot read, though it is
    /// whole. Nothing was changed on disk.
    #[error(
        "{path} line {line}: {error}. This moor-node (journal format v{FORMAT_VERSION}) changed \
         nothing and will not start on it: run the moor-node that wrote it, or a newer one"
    )]
    Newer {
        /// The log.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// What the line is.
        error: DecodeError,
    },
}

/// Why a record file could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// The header is missing or wrong.
    #[error("not a moor journal record")]
    BadMagic,
    /// The checksum field is malformed.
    #[error("malformed checksum")]
    BadChecksumField,
    /// No newline at the end: the write was cut short.
    #[error("truncated record")]
    Truncated,
    /// The checksum does not match the body.
    #[error("checksum mismatch")]
    ChecksumMismatch,
    /// The line is whole (its checksum holds) but its record is not one this moor-node knows:
    /// written by a newer one.
    #[error("a record this moor-node does not understand, written by a newer one: {0}")]
    NotUnderstood(String),
    /// The line's header names a newer format than this moor-node's.
    #[error("journal format v{0}, newer than this moor-node's v{FORMAT_VERSION}")]
    NewerFormat(u32),
}

impl DecodeError {
    /// Whether the line is whole but only a newer moor-node can read it.
    pub fn is_newer(&self) -> bool {
        matches!(self, Self::NotUnderstood(_) | Self::NewerFormat(_))
    }
}

/// How far along an operation is. A record is written with the in-progress phase before the
/// mount table changes, and with `Done` after.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Phase {
    /// About to change the mount table.
    InProgress,
    /// mkfs is running on the device: only such a device may be formatted again.
    Formatting,
    /// Done and confirmed.
    Done,
}

/// How a volume is accessed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub enum AccessRecord {
    /// A filesystem.
    Mount {
        /// Filesystem type.
        fs_type: String,
        /// Filesystem options given at stage.
        fs_options: Vec<String>,
        /// Mount group gid, if any.
        group: Option<u32>,
    },
    /// A raw block device.
    Block,
}

/// A staged volume.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StageRecord {
    /// staging_target_path.
    pub path: PathBuf,
    /// Device path used.
    pub device: PathBuf,
    /// Device number at stage time.
    pub rdev: (u32, u32),
    /// Access type and its settings.
    pub access: AccessRecord,
    /// Per-mount attributes of the staging mount.
    pub attrs: MountAttrs,
    /// Access mode (CSI enum value).
    pub access_mode: i32,
    /// Phase.
    pub phase: Phase,
    /// The UUID moor gave the filesystem it made on the device (recorded durably before mkfs
    /// starts): a filesystem with this UUID on the device is moor's own, finished mkfs, never
    /// to be formatted again. None for a filesystem moor did not make.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fs_uuid: Option<String>,
    /// The boot the record was written in ([`Boot`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub boot: Option<String>,
}

/// A published volume at one target.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PublishRecord {
    /// Whether it is a block volume.
    pub block: bool,
    /// Per-mount attributes (read-only among them).
    pub attrs: MountAttrs,
    /// Access mode (CSI enum value).
    pub access_mode: i32,
    /// Phase.
    pub phase: Phase,
    /// The boot the record was written in ([`Boot`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub boot: Option<String>,
}

/// The node's boot, as the kernel names it (`/proc/sys/kernel/random/boot_id`, a new random
/// UUID at every boot), stamped on every record of a mount or a mapping: the things a reboot
/// ends. Such a record is written to outlive the process, not a power cut (docs/durability.md),
/// so after a reboot the journal may hold an older state than kubelet was told: a publication
/// or a staging it has ended since. A record from an earlier boot whose path is not mounted
/// now is a memory, not a claim: nothing is held by it. A record without a boot (written
/// before moor kept one), or any record where the boot cannot be read, is this boot's.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Boot(Option<String>);

impl Boot {
    /// The boot `id` (None: unknown).
    pub fn new(id: Option<String>) -> Self {
        Self(id.filter(|s| !s.is_empty()))
    }

    /// The stamp a record written now carries.
    pub fn stamp(&self) -> Option<String> {
        self.0.clone()
    }

    /// Whether a record stamped `written` was written in an earlier boot than this one: both
    /// known, and different; or stamped [`Boot::ENDED`].
    pub fn is_earlier(&self, written: Option<&str>) -> bool {
        written == Some(Self::ENDED)
            || matches!((&self.0, written), (Some(now), Some(then)) if now != then)
    }

    /// The stamp of a staging kubelet ended while its record guarded a mkfs moor had begun
    /// and not finished (its NodeUnstageVolume after the stage failed): no boot's, so a
    /// memory in every boot, which holds nothing (no place, no path), while the record still
    /// lets kubelet's next stage resume that mkfs on the device the request proves. Never a
    /// boot id (those are UUIDs).
    pub const ENDED: &'static str = "ended";
}

/// Everything moor knows of one volume on this node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VolumeRecord {
    /// CSI volume id.
    pub volume_id: String,
    /// The staging, if any.
    pub stage: Option<StageRecord>,
    /// Publications by target path.
    pub publishes: BTreeMap<PathBuf, PublishRecord>,
    /// The RBD image mapped for the volume, if any (`attach`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mapping: Option<crate::attach::journal::MappingRecord>,
    /// The dm-crypt mapping of an encrypted volume, if any (`engine::crypt`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub crypt: Option<CryptRecord>,
}

/// An encrypted volume's dm-crypt mapping (docs/encryption.md), as the journal keeps it:
/// written `InProgress` before `cryptsetup luksFormat` or `open`, `Done` after the open, set
/// back to `InProgress` before the close and dropped after it. Like an RBD mapping it lasts no
/// longer than the boot, so it needs to outlive only the process; but while `fresh` (moor's
/// own luksFormat made the LUKS volume and its filesystem is not made yet) it guards data as
/// a `Formatting` stage does, and is written to survive a power cut. No key in the clear is
/// ever in it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CryptRecord {
    /// The mapping's name (`/dev/mapper/<name>`).
    pub name: String,
    /// The LUKS device under it, as the stage found it.
    pub device: PathBuf,
    /// Its number.
    pub rdev: (u32, u32),
    /// The volume's data key, wrapped (`v1:<kek id>:<base64>`: not secret, as the volume
    /// context holds it), for NodeExpandVolume's `cryptsetup resize`, which needs the key and
    /// has no volume context.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wrapped_dek: Option<String>,
    /// The UUID of the LUKS header moor's luksFormat wrote, while `fresh`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub luks_uuid: Option<String>,
    /// moor formatted the LUKS volume and has not yet made its filesystem: the mapping's
    /// content (noise: zeros decrypt to it) is formatted whatever it holds.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub fresh: bool,
    /// `InProgress` while a format, an open or a close runs; `Done` once open.
    pub phase: Phase,
    /// The boot it was written in.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub boot: Option<String>,
    /// A rotation of the data key in progress (`engine::rotate`), written to survive a power
    /// cut before each of its steps.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rotation: Option<RotationRecord>,
    /// A data key rotation finished here: `wrapped_dek` is the key the header takes, no longer
    /// the volume context's. The record is kept (closed) across an unstage, so that the next
    /// stage on this node opens with it, until the controller's record gives the node the
    /// rotated key (docs/encryption.md, "Rotation").
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub rotated: bool,
    /// The volume's key source (its `kmsID`), for NodeExpandVolume, which has no volume
    /// context: a `tpm2` volume's key is the unwrapped DEK combined with this node's TPM.
    /// None in a record written before it was kept (the source is then told by the
    /// node-expand secret: a KMIP server's fields, or a Secret's KEK).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kms_id: Option<String>,
    /// The PCRs a `tpm2` volume's node half is sealed to, for NodeExpandVolume.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tpm2_pcrs: Option<String>,
}

/// A data key rotation of an open LUKS volume (docs/encryption.md, "Rotation"): both keys,
/// wrapped (never in the clear), and the step about to run. Written `Durability::Power`
/// before each step, so that whatever a crash leaves in the LUKS header, the journal holds a
/// wrapped key that opens it; dropped once the old key's slot is gone.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RotationRecord {
    /// The data key being replaced, wrapped.
    pub old_wrapped: String,
    /// The data key replacing it, wrapped.
    pub new_wrapped: String,
    /// The step about to run, or running.
    pub step: RotationStep,
}

/// The steps of a data key rotation, in their order. The volume's key slot is slot 0 and the
/// spare is slot 1; at every step some slot opens with a key the record holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub enum RotationStep {
    /// The old key copied into the spare slot (`luksAddKey`).
    CopyOld,
    /// The volume's slot emptied (`luksKillSlot`; the spare still opens with the old key).
    KillOld,
    /// The new key written into the volume's slot (`luksAddKey`, opened by the spare).
    AddNew,
    /// The new wrapped key made the mapping's (`CryptRecord::wrapped_dek`).
    Record,
    /// The recorded key read back, unwrapped and tried on the volume's slot alone
    /// (`open --test-passphrase --key-slot 0`).
    Verify,
    /// The spare slot, the old key, removed (`luksKillSlot`, proven by the new key).
    KillSpare,
}

impl VolumeRecord {
    /// An empty record for `volume_id`.
    pub fn new(volume_id: &str) -> Self {
        Self {
            volume_id: volume_id.to_string(),
            stage: None,
            publishes: BTreeMap::new(),
            mapping: None,
            crypt: None,
        }
    }

    /// Whether the record guards data across a reboot: a mkfs in progress, which only moor
    /// may resume (the device is no longer blank, nor yet a filesystem).
    pub fn guards_data(&self) -> bool {
        self.stage
            .as_ref()
            .is_some_and(|s| s.phase == Phase::Formatting)
            || self.crypt.as_ref().is_some_and(|c| c.fresh)
    }

    /// Whether the record says nothing (and can be deleted).
    pub fn is_empty(&self) -> bool {
        self.stage.is_none()
            && self.publishes.is_empty()
            && self.mapping.is_none()
            && self.crypt.is_none()
    }
}

/// How hard a write must try to be durable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Durability {
    /// Survives the death of the process (atomic rename).
    Process,
    /// Survives a power loss (fsync of file and dir).
    Power,
}

/// CRC-32C of `data` (see [`moor_runtime::crc32c`]).
pub fn crc32c(data: &[u8]) -> u32 {
    !moor_runtime::crc32c::extend(!0, data)
}

/// Encodes a record as its file content.
pub fn encode(record: &VolumeRecord) -> Vec<u8> {
    let mut json = Vec::with_capacity(512);
    if serde_json::to_writer(&mut json, record).is_err() {
        json.clear();
    }
    let mut out = Vec::with_capacity(json.len() + 32);
    out.extend_from_slice(MAGIC.as_bytes());
    out.extend_from_slice(format!("{:08x} ", crc32c(&json)).as_bytes());
    out.extend_from_slice(&json);
    out.push(b'\n');
    out
}

/// Decodes a record file's content. Never panics.
pub fn decode(bytes: &[u8]) -> Result<VolumeRecord, DecodeError> {
    let Some(rest) = bytes.strip_prefix(MAGIC.as_bytes()) else {
        return Err(newer_format(bytes).map_or(DecodeError::BadMagic, DecodeError::NewerFormat));
    };
    let body = rest.strip_suffix(b"\n").ok_or(DecodeError::Truncated)?;
    let (crc_hex, json) = body
        .split_at_checked(8)
        .ok_or(DecodeError::BadChecksumField)?;
    let json = json
        .strip_prefix(b" ")
        .ok_or(DecodeError::BadChecksumField)?;
    let crc_text = std::str::from_utf8(crc_hex).map_err(|_| DecodeError::BadChecksumField)?;
    let crc = u32::from_str_radix(crc_text, 16).map_err(|_| DecodeError::BadChecksumField)?;
    if crc32c(json) != crc {
        return Err(DecodeError::ChecksumMismatch);
    }
    serde_json::from_slice(json).map_err(|e| DecodeError::NotUnderstood(e.to_string()))
}

/// The version a whole line's header names, when it is a newer one than this code's.
fn newer_format(line: &[u8]) -> Option<u32> {
    let rest = line.strip_prefix(MAGIC_STEM.as_bytes())?;
    line.ends_with(b"\n").then_some(())?;
    let digits = rest.iter().take_while(|b| b.is_ascii_digit()).count();
    (rest.get(digits) == Some(&b' ')).then_some(())?;
    let version: u32 = std::str::from_utf8(&rest[..digits]).ok()?.parse().ok()?;
    (version > FORMAT_VERSION).then_some(version)
}

/// The log's file name in the state dir.
pub const LOG_FILE: &str = "journal.log";
/// Where an unreadable log is kept for inspection when it is rebuilt.
pub const CORRUPT_FILE: &str = "journal.log.corrupt";

/// The side file holding how much of the log is durable ([`SyncedMark`]).
pub const SYNCED_FILE: &str = "journal.log.synced";
const SYNCED_MAGIC: &str = "moor-journal-synced v1 ";

/// How much of the log is durable, kept beside it in [`SYNCED_FILE`]: the log's length at its
/// last sync, and the CRC-32C of its bytes up to there. Written, and `fdatasync`ed, after each
/// sync of the log returned; fixed-width, overwritten in place, itself checksummed. It proves
/// itself against the log it is read with: it counts only when the log's first `len` bytes have
/// that checksum, which a torn mark, a mark of an earlier log (a compaction renamed a new one
/// over it) or damage inside the durable part all fail. A mark that does not count says
/// nothing, and every damaged line is damage, as before there was a mark.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SyncedMark {
    /// Bytes of the log up to its last sync.
    pub len: u64,
    /// CRC-32C of those bytes.
    pub crc: u32,
}

impl SyncedMark {
    /// The mark's file content (always the same length).
    pub fn encode(&self) -> Vec<u8> {
        let body = format!("{:016x} {:08x}", self.len, self.crc);
        format!("{SYNCED_MAGIC}{:08x} {body}\n", crc32c(body.as_bytes())).into_bytes()
    }

    /// A mark file's content, or None when it is not a whole mark. Never panics.
    pub fn decode(bytes: &[u8]) -> Option<Self> {
        let text = std::str::from_utf8(bytes).ok()?;
        let line = text.strip_prefix(SYNCED_MAGIC)?.strip_suffix('\n')?;
        let (crc, body) = line.split_once(' ')?;
        (u32::from_str_radix(crc, 16).ok()? == crc32c(body.as_bytes())).then_some(())?;
        let (len, prefix_crc) = body.split_once(' ')?;
        Some(Self {
            len: u64::from_str_radix(len, 16).ok()?,
            crc: u32::from_str_radix(prefix_crc, 16).ok()?,
        })
    }

    /// How many bytes at the start of `log` this mark proves durable, if it counts for `log`.
    pub fn durable_in(&self, log: &[u8]) -> Option<usize> {
        let len = usize::try_from(self.len).ok()?;
        (crc32c(log.get(..len)?) == self.crc).then_some(len)
    }
}

/// Writes the mark of a log durable up to `len` bytes whose checksum is `crc`, `fdatasync`ed
/// when `sync`. In place, the same length every time: a power cut during the write leaves the
/// old mark, the new, or one that fails its own checksum and says nothing.
fn write_mark(dir: &Path, mark: SyncedMark, sync: bool) -> std::io::Result<()> {
    use std::os::unix::fs::FileExt as _;
    let f = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .open(dir.join(SYNCED_FILE))?;
    f.write_all_at(&mark.encode(), 0)?;
    if sync {
        f.sync_data()?;
    }
    Ok(())
}

/// Compact once this many lines have been appended beyond four per live record.
const COMPACT_SLACK: usize = 1024;

/// A line of the log that could not be used.
#[derive(Debug, Clone)]
pub struct LoadProblem {
    /// The log file.
    pub path: PathBuf,
    /// 1-based line number (0: the file as a whole).
    pub line: usize,
    /// Why.
    pub error: DecodeError,
}

/// What a log holds once replayed: the newest record of each volume.
#[derive(Debug, Default)]
pub struct Replay {
    /// Live records by volume id (a volume whose newest line is empty is gone).
    pub records: BTreeMap<String, VolumeRecord>,
    /// Lines that could not be used, by 1-based line number.
    pub problems: Vec<(usize, DecodeError)>,
    /// Lines read.
    pub lines: usize,
    /// Bytes after the last readable line, none of which reads: appends cut short (a crash or
    /// power cut before they were synced, or a write still in flight), which never returned
    /// to their callers. Not damage: the log ends before them.
    pub torn_tail: usize,
    /// The first line only a newer moor-node can read ([`DecodeError::is_newer`]), wherever
    /// it is: the log is not this moor-node's to use.
    pub newer: Option<(usize, DecodeError)>,
}

/// Replays a log's bytes: each complete line is a record and the newest line of a volume wins.
/// A damaged line is reported and skipped (the volume keeps its previous record). What follows
/// the last readable line, when none of it reads (an unterminated line, or lines of zeros or of
/// a torn page: what a crash or power cut leaves of appends that were never synced), is an
/// append cut short, which the log ends before ([`Replay::torn_tail`]). A log with no readable
/// line at all is damage, but for an unterminated end. Never panics.
pub fn replay(bytes: &[u8]) -> Replay {
    replay_after_sync(bytes, None)
}

/// [`replay`] of a log whose first `durable` bytes are known to be on disk (a [`SyncedMark`]
/// that counts for it). Damage that lies wholly after them is a tear, not damage: a power cut
/// writes unsynced pages back in any order, so an append in the middle of the unsynced part
/// can come back torn while later ones read. The log then ends before the first damaged line
/// after the durable part: that line and every one after it, readable or not, are the torn
/// tail ([`Replay::torn_tail`]), which leaves the durable part and an in-order prefix of the
/// appends after it, a state a power cut may leave anyway. Damage inside the durable part
/// cannot be a tear (the mark would not count), and a whole line only a newer moor-node reads
/// is never torn: it is refused wherever it is ([`Replay::newer`]). Never panics.
pub fn replay_after_sync(bytes: &[u8], durable: Option<usize>) -> Replay {
    let mut out = Replay::default();
    // Where each line starts.
    let mut starts = Vec::new();
    let mut rest = bytes;
    // Where the last readable line ends, and how many lines were read up to it.
    let (mut good_end, mut good_lines) = (0, 0);
    while !rest.is_empty() {
        let (line, next) = match rest.iter().position(|&b| b == b'\n') {
            Some(i) => rest.split_at(i + 1),
            None => break,
        };
        out.lines += 1;
        starts.push(bytes.len() - rest.len());
        rest = next;
        match decode(line) {
            Ok(r) if r.is_empty() => {
                out.records.remove(&r.volume_id);
            }
            Ok(r) => {
                out.records.insert(r.volume_id.clone(), r);
            }
            Err(e) => {
                if e.is_newer() && out.newer.is_none() {
                    out.newer = Some((out.lines, e.clone()));
                }
                out.problems.push((out.lines, e));
                continue;
            }
        }
        good_end = bytes.len() - rest.len();
        good_lines = out.lines;
    }
    let torn_after_sync = durable.and_then(|durable| {
        out.problems
            .iter()
            .filter(|(_, e)| !e.is_newer())
            .filter_map(|(line, _)| starts.get(line - 1).copied())
            .find(|start| *start >= durable)
    });
    if let Some(start) = torn_after_sync {
        let mut torn = replay(bytes.get(..start).unwrap_or_default());
        torn.torn_tail = bytes.len() - start;
        torn.newer = out.newer;
        return torn;
    }
    if good_lines == 0 {
        // Nothing reads: whole lines that do not are damage; only an unterminated end is torn.
        out.torn_tail = rest.len();
        return out;
    }
    out.problems.retain(|(line, _)| *line <= good_lines);
    out.lines = good_lines;
    out.torn_tail = bytes.len() - good_end;
    out
}

/// Reads the journal of `state_dir` without changing anything on disk (for `moorctl status`
/// while the daemon runs). A log a newer moor-node wrote is [`JournalError::Newer`].
pub fn read_state(state_dir: &Path) -> Result<(Vec<VolumeRecord>, Vec<LoadProblem>), JournalError> {
    let path = state_dir.join(LOG_FILE);
    let bytes = match std::fs::read(&path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok((Vec::new(), Vec::new())),
        Err(source) => return Err(JournalError::Dir { path, source }),
    };
    let replayed = replay_after_sync(&bytes, durable_part(state_dir, &bytes));
    refuse_newer(&path, &replayed)?;
    let problems = replayed
        .problems
        .into_iter()
        .map(|(line, error)| LoadProblem {
            path: path.clone(),
            line,
            error,
        })
        .collect();
    Ok((replayed.records.into_values().collect(), problems))
}

/// How much of the log `bytes` of `state_dir` its last sync made durable, when the mark beside
/// it says so (None: no mark, or one that does not count for this log).
fn durable_part(state_dir: &Path, bytes: &[u8]) -> Option<usize> {
    let mark = std::fs::read(state_dir.join(SYNCED_FILE)).ok()?;
    SyncedMark::decode(&mark)?.durable_in(bytes)
}

/// [`JournalError::Newer`] when the replayed log holds a line only a newer moor-node reads.
fn refuse_newer(path: &Path, replayed: &Replay) -> Result<(), JournalError> {
    match &replayed.newer {
        Some((line, error)) => Err(JournalError::Newer {
            path: path.to_path_buf(),
            line: *line,
            error: error.clone(),
        }),
        None => Ok(()),
    }
}

#[derive(Debug)]
struct State {
    records: HashMap<String, VolumeRecord>,
    /// Shared with a sync running without the lock ([`Journal::sync_through`]).
    log: Arc<File>,
    /// Bytes of the log known to be whole lines.
    len: u64,
    /// Bytes of the log known to be on disk (up to the last sync).
    synced: u64,
    /// The CRC-32C of the log's `len` bytes, as [`moor_runtime::crc32c::extend`] carries it
    /// (inverted).
    crc: u32,
    /// Lines in the log.
    lines: usize,
    /// A `put` is syncing the log, without the lock: the others that need a sync wait for it
    /// ([`Journal::sync_through`]).
    syncing: bool,
    /// `put`s between their append and the end of the sync they need (the one syncing
    /// included): while any is, the log is not compacted, so the length each waits for stays
    /// a length of this file.
    sync_waiters: usize,
    /// Why a sync of the log failed, if one did: every later `put` fails with it. After a
    /// failed `fdatasync` the kernel may have dropped the pages it could not write and a later
    /// sync can succeed without them, so nothing written before can be called durable again
    /// until moor-node restarts and reads the log back.
    broken: Option<String>,
    /// Tests: the next sync fails with EIO.
    #[cfg(test)]
    fail_sync: bool,
    /// Tests: the next sync waits, without the lock, for a message on this.
    #[cfg(test)]
    sync_gate: Option<std::sync::mpsc::Receiver<()>>,
    /// Tests: syncs of the log `put` has run.
    #[cfg(test)]
    syncs: usize,
    /// Tests: how many more `put`s succeed before one fails (with EIO), once.
    #[cfg(test)]
    fail_after: Option<usize>,
}

/// The journal: records in memory, mirrored to an append-only log in the state dir.
///
/// Every change of a volume appends that volume's whole new record as one line, with one
/// `write(2)`, before `put` returns; a record that must outlive a power loss is also
/// `fdatasync`ed. When the log holds many more lines than live records it is compacted: the
/// live records are written to a temp file, fsynced, renamed over the log, and the dir
/// fsynced, so a crash at any instant leaves either the old or the new log, whole.
#[derive(Debug)]
pub struct Journal {
    dir: PathBuf,
    fsync_all: bool,
    state: Mutex<State>,
    /// Signalled when a sync of the log ends ([`State::syncing`] cleared).
    synced_cv: Condvar,
    /// Bytes of an append cut short that the log ended in when it was opened.
    torn_tail: usize,
}

impl Journal {
    /// Opens (creating) the log in `state_dir` and replays it. Damaged lines are reported;
    /// the damaged file is kept as `journal.log.corrupt` and the log rewritten from what could
    /// be read, so reconciliation can rebuild the rest from the mount table. An unterminated
    /// last line is no damage but an append a crash or power cut left half on disk (its call
    /// never returned): the log is rewritten without it ([`torn_tail`](Self::torn_tail)); so
    /// is the unsynced part from a torn line on, when [`SYNCED_FILE`] proves where the synced
    /// part ends ([`replay_after_sync`]).
    pub fn open(
        state_dir: &Path,
        fsync_all: bool,
    ) -> Result<(Self, Vec<LoadProblem>), JournalError> {
        let dir_err = |source| JournalError::Dir {
            path: state_dir.to_path_buf(),
            source,
        };
        std::fs::create_dir_all(state_dir).map_err(dir_err)?;
        let path = state_dir.join(LOG_FILE);
        let bytes = match std::fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(source) => return Err(JournalError::Dir { path, source }),
        };
        let replayed = replay_after_sync(&bytes, durable_part(state_dir, &bytes));
        // Before anything is written: a newer moor-node's log is neither set aside nor
        // rewritten.
        refuse_newer(&path, &replayed)?;
        let problems: Vec<LoadProblem> = replayed
            .problems
            .iter()
            .map(|(line, error)| LoadProblem {
                path: path.clone(),
                line: *line,
                error: error.clone(),
            })
            .collect();
        if !problems.is_empty() {
            let aside = state_dir.join(CORRUPT_FILE);
            std::fs::write(&aside, &bytes).map_err(|source| JournalError::Write {
                path: aside,
                source,
            })?;
        }
        let records: HashMap<String, VolumeRecord> = replayed.records.into_iter().collect();
        let (log, len, lines, crc) = write_compacted(state_dir, &records, true)?;
        // The rewritten log is durable: its mark, then the dir (the mark may be new).
        let marked = write_mark(state_dir, SyncedMark { len, crc: !crc }, true)
            .and_then(|()| File::open(state_dir)?.sync_all());
        marked.map_err(|source| JournalError::Write {
            path: state_dir.join(SYNCED_FILE),
            source,
        })?;
        Ok((
            Self {
                dir: state_dir.to_path_buf(),
                fsync_all,
                state: Mutex::new(State {
                    records,
                    log: Arc::new(log),
                    len,
                    synced: len,
                    crc,
                    lines,
                    syncing: false,
                    sync_waiters: 0,
                    broken: None,
                    #[cfg(test)]
                    fail_sync: false,
                    #[cfg(test)]
                    sync_gate: None,
                    #[cfg(test)]
                    syncs: 0,
                    #[cfg(test)]
                    fail_after: None,
                }),
                synced_cv: Condvar::new(),
                torn_tail: replayed.torn_tail,
            },
            problems,
        ))
    }

    /// Bytes of the append cut short that the log ended in when it was opened (0: none).
    pub fn torn_tail(&self) -> usize {
        self.torn_tail
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The record of a volume.
    pub fn get(&self, volume_id: &str) -> Option<VolumeRecord> {
        self.lock().records.get(volume_id).cloned()
    }

    /// Every record.
    pub fn all(&self) -> Vec<VolumeRecord> {
        self.lock().records.values().cloned().collect()
    }

    /// Tests: the `put` after the next `after` ones fails with EIO (nothing written), once.
    #[cfg(test)]
    pub(crate) fn fail_put_after(&self, after: usize) {
        self.lock().fail_after = Some(after);
    }

    /// Tests: the next sync of the log fails with EIO (after the line is written).
    #[cfg(test)]
    pub(crate) fn fail_next_sync(&self) {
        self.lock().fail_sync = true;
    }

    /// How many bytes at the start of `journal.log` are known to be on disk: what a power cut
    /// cannot take (the lines after them may reach the disk, in order, or not). For the
    /// power-cut model of the tests.
    pub fn durable_len(&self) -> u64 {
        self.lock().synced
    }

    /// Records a volume's new state (an empty record forgets the volume), durably as asked,
    /// then updates memory. On failure memory is unchanged, and so is the log unless the
    /// failure was the sync after the line was written: then the line may be on disk, and the
    /// journal refuses every later change ([`State::broken`]).
    ///
    /// Concurrent `put`s that must be durable share their syncs (a group commit): the line is
    /// appended under the lock, the `fdatasync` runs without it, and one sync covers every line
    /// written before it started, so a storm of first stages waits for a few syncs, not one
    /// each in turn behind a lock. The caller holds the volume's guard, so no other `put` of
    /// the same volume runs meanwhile.
    pub fn put(&self, record: &VolumeRecord, durability: Durability) -> Result<(), JournalError> {
        let line = encode(record);
        let mut st = self.lock();
        if let Some(why) = &st.broken {
            return Err(self.broken_error(why));
        }
        #[cfg(test)]
        if let Some(n) = st.fail_after.take() {
            if n == 0 {
                return Err(JournalError::Write {
                    path: self.dir.join(LOG_FILE),
                    source: std::io::Error::from_raw_os_error(libc::EIO),
                });
            }
            st.fail_after = Some(n - 1);
        }
        let sync = self.fsync_all || durability == Durability::Power;
        if let Err(source) = (&*st.log).write_all(&line) {
            // Cut a partial line off so the next append starts on a line of its own.
            let len = st.len;
            let _ = st.log.set_len(len);
            return Err(JournalError::Write {
                path: self.dir.join(LOG_FILE),
                source,
            });
        }
        st.len += line.len() as u64;
        st.crc = moor_runtime::crc32c::extend(st.crc, &line);
        st.lines += 1;
        if sync {
            let through = st.len;
            st.sync_waiters += 1;
            let (guard, synced) = self.sync_through(st, through);
            st = guard;
            st.sync_waiters -= 1;
            synced?;
        }
        if record.is_empty() {
            st.records.remove(&record.volume_id);
        } else {
            st.records.insert(record.volume_id.clone(), record.clone());
        }
        if st.lines > st.records.len() * 4 + COMPACT_SLACK && st.sync_waiters == 0 {
            // A failed compaction leaves the old log, which is still whole: carry on with it.
            let durable = self.fsync_all || st.records.values().any(VolumeRecord::guards_data);
            if let Ok((log, len, lines, crc)) = write_compacted(&self.dir, &st.records, durable) {
                st.log = Arc::new(log);
                st.len = len;
                st.crc = crc;
                st.lines = lines;
                // Unsynced, the new log may reach the disk empty, or with any prefix of its
                // lines. Its mark, written after the rename: until it lands, the old mark
                // fails against the new log and says nothing.
                st.synced = if durable { len } else { 0 };
                let mark = if durable {
                    st.mark()
                } else {
                    SyncedMark {
                        len: 0,
                        crc: crc32c(b""),
                    }
                };
                let _ = write_mark(&self.dir, mark, durable);
            }
        }
        Ok(())
    }

    /// Returns once the log is on disk through byte `through`: at once if a sync already took
    /// it there; after the sync running now, if that one covers it; else this call syncs,
    /// without the lock, everything written so far. The lock is given back either way.
    fn sync_through<'a>(
        &'a self,
        mut st: MutexGuard<'a, State>,
        through: u64,
    ) -> (MutexGuard<'a, State>, Result<(), JournalError>) {
        loop {
            if let Some(why) = &st.broken {
                let e = self.broken_error(why);
                return (st, Err(e));
            }
            if st.synced >= through {
                return (st, Ok(()));
            }
            if !st.syncing {
                break;
            }
            st = self
                .synced_cv
                .wait(st)
                .unwrap_or_else(PoisonError::into_inner);
        }
        st.syncing = true;
        let (len, mark) = (
            st.len,
            SyncedMark {
                len: st.len,
                crc: !st.crc,
            },
        );
        #[cfg(test)]
        let (fail, gate) = {
            st.syncs += 1;
            (std::mem::take(&mut st.fail_sync), st.sync_gate.take())
        };
        #[cfg(not(test))]
        let fail = false;
        let log = Arc::clone(&st.log);
        drop(st);
        #[cfg(test)]
        if let Some(gate) = gate {
            let _ = gate.recv();
        }
        let synced = if fail {
            Err(std::io::Error::from_raw_os_error(libc::EIO))
        } else {
            log.sync_data()
        };
        // The records are durable whether or not their mark is: a mark left behind only
        // counts less of the log as durable, and one that fails says nothing.
        if synced.is_ok() {
            let _ = write_mark(&self.dir, mark, true);
        }
        let mut st = self.lock();
        st.syncing = false;
        let outcome = match synced {
            Ok(()) => {
                st.synced = st.synced.max(len);
                Ok(())
            }
            Err(source) => {
                st.broken = Some(source.to_string());
                Err(JournalError::Write {
                    path: self.dir.join(LOG_FILE),
                    source,
                })
            }
        };
        self.synced_cv.notify_all();
        (st, outcome)
    }

    /// The error of a `put` after a sync of the log failed.
    fn broken_error(&self, why: &str) -> JournalError {
        JournalError::Write {
            path: self.dir.join(LOG_FILE),
            source: std::io::Error::other(format!(
                "an earlier sync of the journal failed ({why}): nothing written since can be \
                 called durable, so no change is recorded until moor-node restarts and reads \
                 the journal back"
            )),
        }
    }
}

impl State {
    /// The mark of what the log's last sync made durable.
    fn mark(&self) -> SyncedMark {
        SyncedMark {
            len: self.synced,
            crc: !self.crc,
        }
    }
}

/// Writes `records` as a fresh log: temp file, fsync, rename over the log, fsync the dir.
/// Returns the log opened for appending, its length, line count and checksum (inverted, as
/// [`moor_runtime::crc32c::extend`] carries it).
fn write_compacted(
    dir: &Path,
    records: &HashMap<String, VolumeRecord>,
    durable: bool,
) -> Result<(File, u64, usize, u32), JournalError> {
    let path = dir.join(LOG_FILE);
    let tmp = dir.join("journal.log.tmp");
    let mut sorted: Vec<&VolumeRecord> = records.values().collect();
    sorted.sort_by(|a, b| a.volume_id.cmp(&b.volume_id));
    let mut content = Vec::new();
    for r in &sorted {
        content.extend_from_slice(&encode(r));
    }
    let write = || -> std::io::Result<File> {
        let mut f = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .open(&tmp)?;
        f.write_all(&content)?;
        if durable {
            f.sync_all()?;
        }
        drop(f);
        std::fs::rename(&tmp, &path)?;
        if durable {
            File::open(dir)?.sync_all()?;
        }
        OpenOptions::new().append(true).open(&path)
    };
    let log = write().map_err(|source| JournalError::Write {
        path: path.clone(),
        source,
    })?;
    let crc = moor_runtime::crc32c::extend(!0, &content);
    Ok((log, content.len() as u64, sorted.len(), crc))
}

#[cfg(test)]
mod tests;
