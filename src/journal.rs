//! The node journal: what moor intends and has done, per volume, in `--state-dir`.
//!
//! One file per volume (`volumes/<name>.rec`), each a single line:
//! `moor-journal v1 <crc32c hex> <json>\n`. A file is replaced atomically (write a temp file,
//! rename over, and for records that must outlive a power loss fsync the file and the dir), so
//! a reader sees the old or the new record, never a mix; a truncated or garbled file fails its
//! checksum and is reported, never trusted.
//!
//! Durability follows the lifetime of what a record describes. Mounts do not survive a reboot,
//! so a record of a mount only has to survive the death of the process, which the page cache
//! gives after `rename`. A record that guards data across reboots (a mkfs in progress) is
//! fsynced.

use std::collections::{BTreeMap, HashMap};
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard, PoisonError};

use serde::{Deserialize, Serialize};

use crate::sys::MountAttrs;

const MAGIC: &str = "moor-journal v1 ";

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
    /// A record could not be removed.
    #[error("removing {path}: {source}")]
    Remove {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
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
    /// The body is not a valid record.
    #[error("malformed record: {0}")]
    Json(String),
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
}

/// A published volume at one target.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PublishRecord {
    /// Whether it is a block volume.
    pub block: bool,
    /// Per-mount attributes (read-only among them).
    pub attrs: MountAttrs,
    /// Access mode (CSI enum value).
    pub access_mode: i32,
    /// Phase.
    pub phase: Phase,
}

/// Everything moor knows of one volume on this node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeRecord {
    /// CSI volume id.
    pub volume_id: String,
    /// The staging, if any.
    pub stage: Option<StageRecord>,
    /// Publications by target path.
    pub publishes: BTreeMap<PathBuf, PublishRecord>,
}

impl VolumeRecord {
    /// An empty record for `volume_id`.
    pub fn new(volume_id: &str) -> Self {
        Self {
            volume_id: volume_id.to_string(),
            stage: None,
            publishes: BTreeMap::new(),
        }
    }

    /// Whether the record says nothing (and can be deleted).
    pub fn is_empty(&self) -> bool {
        self.stage.is_none() && self.publishes.is_empty()
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

/// CRC-32C (Castagnoli), bitwise table computed at compile time.
const CRC_TABLE: [u32; 256] = {
    let mut table = [0u32; 256];
    let mut i = 0;
    while i < 256 {
        let mut c = i as u32;
        let mut k = 0;
        while k < 8 {
            c = if c & 1 != 0 {
                0x82F6_3B78 ^ (c >> 1)
            } else {
                c >> 1
            };
            k += 1;
        }
        table[i] = c;
        i += 1;
    }
    table
};

/// CRC-32C of `data`.
pub fn crc32c(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in data {
        let idx = ((crc ^ u32::from(b)) & 0xFF) as usize;
        crc = CRC_TABLE.get(idx).copied().unwrap_or(0) ^ (crc >> 8);
    }
    !crc
}

/// Encodes a record as its file content.
pub fn encode(record: &VolumeRecord) -> Vec<u8> {
    let json = serde_json::to_vec(record).unwrap_or_default();
    let mut out = Vec::with_capacity(json.len() + 32);
    out.extend_from_slice(MAGIC.as_bytes());
    out.extend_from_slice(format!("{:08x} ", crc32c(&json)).as_bytes());
    out.extend_from_slice(&json);
    out.push(b'\n');
    out
}

/// Decodes a record file's content. Never panics.
pub fn decode(bytes: &[u8]) -> Result<VolumeRecord, DecodeError> {
    let rest = bytes
        .strip_prefix(MAGIC.as_bytes())
        .ok_or(DecodeError::BadMagic)?;
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
    serde_json::from_slice(json).map_err(|e| DecodeError::Json(e.to_string()))
}

/// The file name for a volume id: hex for ids up to 100 bytes (unambiguous, any bytes), a
/// hash with the length otherwise (the record inside names the id).
pub fn file_name(volume_id: &str) -> String {
    let bytes = volume_id.as_bytes();
    if bytes.len() <= 100 {
        let mut s = String::with_capacity(bytes.len() * 2 + 4);
        for b in bytes {
            s.push_str(&format!("{b:02x}"));
        }
        s.push_str(".rec");
        s
    } else {
        format!(
            "long-{:08x}-{:08x}-{}.rec",
            crc32c(bytes),
            crc32c(&bytes[bytes.len() / 2..]),
            bytes.len()
        )
    }
}

/// A record file that could not be read at start.
#[derive(Debug, Clone)]
pub struct LoadProblem {
    /// The file.
    pub path: PathBuf,
    /// Why.
    pub error: DecodeError,
}

/// Reads the journal of `state_dir` without changing anything on disk (for `moorctl status`
/// while the daemon runs). Unreadable records are reported, not moved aside.
pub fn read_state(state_dir: &Path) -> Result<(Vec<VolumeRecord>, Vec<LoadProblem>), JournalError> {
    let dir = state_dir.join("volumes");
    let dir_err = |source| JournalError::Dir {
        path: dir.clone(),
        source,
    };
    let mut records = Vec::new();
    let mut problems = Vec::new();
    let entries = match std::fs::read_dir(&dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok((records, problems)),
        Err(e) => return Err(dir_err(e)),
    };
    for entry in entries {
        let path = entry.map_err(dir_err)?.path();
        if path.extension().and_then(|e| e.to_str()) != Some("rec") {
            continue;
        }
        match std::fs::read(&path)
            .map_err(|e| DecodeError::Json(e.to_string()))
            .and_then(|b| decode(&b))
        {
            Ok(r) => records.push(r),
            Err(error) => problems.push(LoadProblem { path, error }),
        }
    }
    records.sort_by(|a, b| a.volume_id.cmp(&b.volume_id));
    Ok((records, problems))
}

/// The journal: records in memory, mirrored to files.
#[derive(Debug)]
pub struct Journal {
    dir: PathBuf,
    fsync_all: bool,
    records: Mutex<HashMap<String, VolumeRecord>>,
}

impl Journal {
    /// Opens (creating) `state_dir/volumes` and loads every record. Unreadable files are
    /// moved aside (`*.corrupt`) and reported, so reconciliation can rebuild from the mount
    /// table.
    pub fn open(
        state_dir: &Path,
        fsync_all: bool,
    ) -> Result<(Self, Vec<LoadProblem>), JournalError> {
        let dir = state_dir.join("volumes");
        let dir_err = |source| JournalError::Dir {
            path: dir.clone(),
            source,
        };
        std::fs::create_dir_all(&dir).map_err(dir_err)?;
        let mut records = HashMap::new();
        let mut problems = Vec::new();
        for entry in std::fs::read_dir(&dir).map_err(dir_err)? {
            let path = entry.map_err(dir_err)?.path();
            let name = path
                .file_name()
                .and_then(|n| n.to_str())
                .unwrap_or_default();
            if name.ends_with(".tmp") {
                // A write cut short before its rename: the old record (if any) stands.
                let _ = std::fs::remove_file(&path);
                continue;
            }
            if !name.ends_with(".rec") {
                continue;
            }
            let decoded = std::fs::read(&path)
                .map_err(|e| DecodeError::Json(e.to_string()))
                .and_then(|b| decode(&b));
            match decoded {
                Ok(r) if file_name(&r.volume_id) == name => {
                    records.insert(r.volume_id.clone(), r);
                }
                Ok(_) => problems.push(LoadProblem {
                    path: path.clone(),
                    error: DecodeError::Json("file name does not match its volume id".into()),
                }),
                Err(error) => {
                    let aside = path.with_extension("corrupt");
                    let _ = std::fs::rename(&path, &aside);
                    problems.push(LoadProblem { path: aside, error });
                }
            }
        }
        Ok((
            Self {
                dir,
                fsync_all,
                records: Mutex::new(records),
            },
            problems,
        ))
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<String, VolumeRecord>> {
        self.records.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The record of a volume.
    pub fn get(&self, volume_id: &str) -> Option<VolumeRecord> {
        self.lock().get(volume_id).cloned()
    }

    /// Every record.
    pub fn all(&self) -> Vec<VolumeRecord> {
        self.lock().values().cloned().collect()
    }

    /// How many volumes are staged.
    pub fn staged_count(&self) -> u64 {
        self.lock().values().filter(|r| r.stage.is_some()).count() as u64
    }

    /// Writes a record (or removes it when empty), then updates memory.
    pub fn put(&self, record: &VolumeRecord, durability: Durability) -> Result<(), JournalError> {
        let path = self.dir.join(file_name(&record.volume_id));
        if record.is_empty() {
            match std::fs::remove_file(&path) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(source) => return Err(JournalError::Remove { path, source }),
            }
            self.lock().remove(&record.volume_id);
            return Ok(());
        }
        let sync = self.fsync_all || durability == Durability::Power;
        write_atomic(&self.dir, &path, &encode(record), sync)
            .map_err(|source| JournalError::Write { path, source })?;
        self.lock().insert(record.volume_id.clone(), record.clone());
        Ok(())
    }
}

fn write_atomic(dir: &Path, path: &Path, content: &[u8], sync: bool) -> std::io::Result<()> {
    let tmp = path.with_extension("tmp");
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .open(&tmp)?;
    f.write_all(content)?;
    if sync {
        f.sync_data()?;
    }
    drop(f);
    std::fs::rename(&tmp, path)?;
    if sync {
        std::fs::File::open(dir)?.sync_all()?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> VolumeRecord {
        let mut r = VolumeRecord::new("vol/1 ü");
        r.stage = Some(StageRecord {
            path: "/k/plugins/s".into(),
            device: "/dev/loop3".into(),
            rdev: (7, 3),
            access: AccessRecord::Mount {
                fs_type: "ext4".into(),
                fs_options: vec![],
                group: Some(5),
            },
            attrs: MountAttrs::default(),
            access_mode: 7,
            phase: Phase::Done,
        });
        r.publishes.insert(
            "/k/pods/t".into(),
            PublishRecord {
                block: false,
                attrs: MountAttrs::default(),
                access_mode: 7,
                phase: Phase::Done,
            },
        );
        r
    }

    #[test]
    fn crc32c_known_value() {
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
    }

    #[test]
    fn round_trip() {
        let r = sample();
        assert_eq!(decode(&encode(&r)).unwrap(), r);
    }

    #[test]
    fn truncation_and_garbage_are_detected() {
        let bytes = encode(&sample());
        for cut in 0..bytes.len() {
            assert!(decode(&bytes[..cut]).is_err(), "cut at {cut}");
        }
        let mut flipped = bytes.clone();
        let mid = flipped.len() / 2;
        flipped[mid] ^= 0x01;
        assert!(decode(&flipped).is_err());
        assert_eq!(decode(b"garbage"), Err(DecodeError::BadMagic));
    }

    #[test]
    fn file_names_are_safe_and_distinct() {
        assert_eq!(file_name("a/b"), "612f62.rec");
        let long_a = "a".repeat(128);
        let long_b = format!("{}b", "a".repeat(127));
        assert_ne!(file_name(&long_a), file_name(&long_b));
        assert!(file_name(&long_a).len() < 64);
    }

    #[test]
    fn journal_persists_and_quarantines_corruption() {
        let dir = std::env::temp_dir().join(format!("moor-journal-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        {
            let (j, problems) = Journal::open(&dir, false).unwrap();
            assert!(problems.is_empty());
            j.put(&sample(), Durability::Power).unwrap();
        }
        std::fs::write(
            dir.join("volumes").join(file_name("broken")),
            b"moor-journal v1 zz",
        )
        .unwrap();
        std::fs::write(dir.join("volumes").join("x.tmp"), b"half").unwrap();
        let (j, problems) = Journal::open(&dir, false).unwrap();
        assert_eq!(j.get("vol/1 ü"), Some(sample()));
        assert_eq!(problems.len(), 1);
        assert!(!dir.join("volumes").join("x.tmp").exists());
        let mut empty = sample();
        empty.stage = None;
        empty.publishes.clear();
        j.put(&empty, Durability::Process).unwrap();
        assert!(j.get("vol/1 ü").is_none());
        assert!(!dir.join("volumes").join(file_name("vol/1 ü")).exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
