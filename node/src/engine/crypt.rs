//! An encrypted volume's dm-crypt mapping (docs/encryption.md): its LUKS2 volume made by
//! `cryptsetup luksFormat` on a device proven blank, opened at stage to
//! `/dev/mapper/<mapping_name>` (the device the rest of the stage uses), closed at unstage
//! after the filesystem, and resized before the filesystem grows. The data key reaches
//! cryptsetup on its standard input only ([`Os::run_tool_with_key`]); the journal keeps the
//! mapping ([`CryptRecord`]), never a key.
//!
//! Each step is resumable: a mapping found open (a retry, a restart, a crash between the open
//! and the mount) is used as it is; a close that finds none (a crash between the unmount and
//! the close was followed by one) is done; a LUKS volume moor formatted whose filesystem was
//! not made yet (`fresh`, written to survive a power cut before luksFormat) gets it made
//! whatever its mapping holds, as an interrupted mkfs does.

use std::path::{Path, PathBuf};
use std::time::Duration;

use tracing::{info, warn};

use super::{Encryption, Engine, ExpandKey, Stage};
use crate::crash_points;
use crate::error::{Error, Result};
use crate::journal::{Boot, CryptRecord, Durability, Phase, VolumeRecord};
use crate::superblock::{self, Content};
use crate::sys::{self, HeldDevice, Os, ToolError, ToolRun};

/// cryptsetup's program name.
pub const CRYPTSETUP: &str = "cryptsetup";

/// Where device-mapper's named devices appear.
const MAPPER_DIR: &str = "/dev/mapper";

/// How long an open, a close or a resize may take (a luksFormat takes the mkfs deadline).
pub(super) const CRYPTSETUP_DEADLINE: Duration = Duration::from_secs(120);

/// The key slot's PBKDF cost, fixed (no benchmark at luksFormat: the passphrase is a random
/// 256-bit data key, not a password): pbkdf2's iterations (cryptsetup's minimum), and
/// argon2's iterations and memory in KiB. Without `--pbkdf-memory` cryptsetup gives an argon2
/// slot its default, 1 GiB or half the node's memory, needed again at every open: measured
/// 943 MiB and 35 s an open in the VM lab (docs/performance.md, "The cost of encryption").
const PBKDF2_ITERATIONS: &str = "1000";
const ARGON2_ITERATIONS: &str = "4";
const ARGON2_MEMORY_KIB: &str = "65536";

/// cryptsetup's arguments that set the key slot's PBKDF `pbkdf` and its fixed cost.
pub(super) fn pbkdf_args(pbkdf: &str) -> Vec<String> {
    let mut args = vec!["--pbkdf".to_owned(), pbkdf.to_owned()];
    if pbkdf == "pbkdf2" {
        args.extend(["--pbkdf-force-iterations".into(), PBKDF2_ITERATIONS.into()]);
    } else {
        args.extend([
            "--pbkdf-force-iterations".into(),
            ARGON2_ITERATIONS.into(),
            "--pbkdf-memory".into(),
            ARGON2_MEMORY_KIB.into(),
        ]);
    }
    args
}

/// cryptsetup's exit code when no key slot opens with the key given.
pub(super) const EXIT_WRONG_KEY: i32 = 2;

/// cryptsetup's exit code for a device that is not there or not active.
const EXIT_NO_DEVICE: i32 = 4;

/// The name of a volume's mapping: `moor-<volume id>` when the id is a short plain word,
/// else `moor-` and 32 hex digits of the id's hash (a dm name is at most 127 bytes of a
/// restricted set; two hashes of different seeds make a collision between two volumes of one
/// node practically impossible).
#[must_use]
pub fn mapping_name(volume_id: &str) -> String {
    let plain = volume_id.len() <= 96
        && !volume_id.is_empty()
        && volume_id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
    if plain {
        return format!("moor-{volume_id}");
    }
    let hash = |seed: u64| {
        volume_id.bytes().fold(seed, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
        })
    };
    format!(
        "moor-{:016x}{:016x}",
        hash(0xcbf2_9ce4_8422_2325),
        hash(0x8422_2325_cbf2_9ce4)
    )
}

/// The path of the mapping named `name`.
fn mapper_path(name: &str) -> PathBuf {
    Path::new(MAPPER_DIR).join(name)
}

/// Device numbers as `major:minor`, comma-separated; "none" for none.
fn describe_numbers(numbers: &[(u32, u32)]) -> String {
    if numbers.is_empty() {
        return "none".to_owned();
    }
    numbers
        .iter()
        .map(|(a, b)| format!("{a}:{b}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// A cryptsetup run.
pub(super) fn cryptsetup(args: Vec<String>, deadline: Duration) -> ToolRun {
    ToolRun {
        program: CRYPTSETUP.to_owned(),
        args,
        deadline,
    }
}

/// What an encrypted stage found and opened: the mapping, held, and whether the LUKS volume
/// is moor's fresh one (its filesystem made whatever the mapping holds).
pub(super) struct Opened {
    /// The mapping's kernel node (`/dev/dm-<n>`): `/dev/mapper/<name>` is a symlink, and a
    /// block volume's bind of a symlink would give the pod the link, not the device.
    pub(super) path: PathBuf,
    /// The mapping, held.
    pub(super) dev: HeldDevice,
    /// moor formatted the LUKS volume and has not made its filesystem yet.
    pub(super) fresh: bool,
    /// This call opened the mapping (it was not found open): a stage that fails after it
    /// closes it again ([`Engine::close_after_failed_stage`]).
    pub(super) here: bool,
}

impl<O: Os> Engine<O> {
    /// Opens the encrypted volume of `req` on the held device `dev` (at `path`): made LUKS2
    /// first when the device is blank; a LUKS volume opened with the request's key; anything
    /// else refused untouched (a volume is never encrypted in place). The mapping, held.
    pub(super) fn open_encrypted(
        &self,
        record: &mut VolumeRecord,
        req: &Stage,
        enc: &Encryption,
        (path, dev): (&Path, &HeldDevice),
    ) -> Result<Opened> {
        let name = mapping_name(&req.volume_id);
        let mapper = mapper_path(&name);
        let recorded_fresh = record
            .crypt
            .as_ref()
            .filter(|c| c.fresh && c.rdev == dev.rdev)
            .and_then(|c| c.luks_uuid.clone());
        // Open already: a retry, a restart, a crash between the open and the mount. Used only
        // when it sits on this volume's device: a mapping of the name on another device (a
        // device the volume had before, another volume's under a colliding name) is refused.
        if self.os.block_device(&mapper).is_ok() {
            let held = self.os.hold_device(&mapper).map_err(Error::Sys)?;
            let under = self.os.devices_under(held.rdev).map_err(Error::Sys)?;
            if under != [dev.rdev] {
                return Err(Error::FailedPrecondition(format!(
                    "volume {:?}: the mapping {name} is open, but on device {} and not on the \
                     volume's device {} ({}:{}); it was not used and nothing was touched \
                     (unstage the volume, or close the mapping, and stage again)",
                    req.volume_id,
                    describe_numbers(&under),
                    path.display(),
                    dev.rdev.0,
                    dev.rdev.1
                )));
            }
            let fresh = recorded_fresh.is_some();
            self.record_crypt(
                record,
                (&name, enc),
                (path, dev),
                recorded_fresh,
                Phase::Done,
            )?;
            info!(
                volume = req.volume_id,
                mapping = name,
                "the volume's mapping is open: used"
            );
            return Ok(Opened {
                path: held.node.clone(),
                dev: held,
                fresh,
                here: false,
            });
        }
        let content = self.probe_device(&dev.handle, dev.size)?;
        let fresh_uuid = match &content {
            c if c.is_blank() => Some(self.luks_format(record, req, enc, (path, dev), None)?),
            // moor's own luksFormat, cut short (its header unfinished): made again.
            Content::Unknown { .. } if recorded_fresh.is_some() => {
                Some(self.luks_format(record, req, enc, (path, dev), recorded_fresh)?)
            }
            Content::Luks { uuid, .. } => {
                let own = recorded_fresh.filter(|r| uuid.as_ref() == Some(r));
                if !self.luks_without_key_slot(&dev.handle, dev.size)? {
                    own
                } else if own.is_some() {
                    // moor's own luksFormat, cut before its key slot was written: made again.
                    Some(self.luks_format(record, req, enc, (path, dev), own)?)
                } else {
                    return Err(Error::FailedPrecondition(format!(
                        "volume {:?}: the LUKS2 header on device {} has no key slot: a \
                         luksFormat cut short before its first key slot was written (nothing \
                         was ever stored on the volume), and no key can open it; it is not \
                         formatted again, since it is not blank. Delete and re-create the \
                         volume, or, after checking that the device is this volume's and holds \
                         nothing, wipe its header (wipefs -a) and stage again; nothing was \
                         touched",
                        req.volume_id,
                        path.display()
                    )));
                }
            }
            other => {
                return Err(Error::FailedPrecondition(format!(
                    "volume {:?} is encrypted, but device {} holds {} in the clear: a volume \
                     is never encrypted in place; nothing was touched",
                    req.volume_id,
                    path.display(),
                    other.describe()
                )));
            }
        };
        let fresh = fresh_uuid.is_some();
        self.record_crypt(
            record,
            (&name, enc),
            (path, dev),
            fresh_uuid.clone(),
            Phase::InProgress,
        )?;
        crash_points::point("stage.opening");
        let open = cryptsetup(
            vec![
                "open".into(),
                "--type".into(),
                "luks2".into(),
                "--key-file=-".into(),
                dev.node.display().to_string(),
                name.clone(),
            ],
            CRYPTSETUP_DEADLINE,
        );
        let opened = self.open_with_journaled_keys(record, enc, &req.volume_id, &open);
        let opened_by = match opened {
            Ok(by) => by,
            Err(e) => {
                if !fresh
                    && record
                        .crypt
                        .as_ref()
                        .is_none_or(|c| c.rotation.is_none() && !c.rotated)
                {
                    record.crypt = None;
                    self.journal.put(record, Durability::Process)?;
                }
                return Err(match e {
                    ToolError::Failed {
                        code: Some(EXIT_WRONG_KEY),
                        ..
                    } => Error::FailedPrecondition(format!(
                        "the key {:?} does not open volume {:?}: no key slot of the LUKS header on \
                     {} takes the data key it unwraps (the volume was made under another key, \
                     or its device is another volume's); nothing was opened",
                        enc.kek_id,
                        req.volume_id,
                        path.display()
                    )),
                    other => other.into(),
                });
            }
        };
        crash_points::point("stage.opened");
        let finish = || -> Result<HeldDevice> {
            let held = self.os.hold_device(&mapper).map_err(Error::Sys)?;
            self.record_crypt(record, (&name, enc), (path, dev), fresh_uuid, Phase::Done)?;
            self.record_opened_by(record, opened_by)?;
            Ok(held)
        };
        let held = match finish() {
            Ok(held) => held,
            Err(e) => return Err(self.close_after_failed_stage(&req.volume_id, e)),
        };
        info!(
            volume = req.volume_id,
            mapping = name,
            fresh,
            "the volume's mapping is open"
        );
        Ok(Opened {
            path: held.node.clone(),
            dev: held,
            fresh,
            here: true,
        })
    }

    /// Whether the LUKS2 header on `device` (of `size` bytes) has no key slot: every copy of
    /// it that reads whole (the primary, a secondary) lists none in its JSON area, and at
    /// least one does. `cryptsetup luksFormat` writes the header before its first key slot: a
    /// luksFormat cut there leaves a header no key can ever open. `false` for a LUKS1 header
    /// or copies that do not read whole (cryptsetup's open then says what it finds).
    fn luks_without_key_slot(&self, device: &Path, size: u64) -> Result<bool> {
        let mut slots = Vec::new();
        let binary = superblock::LUKS2_BINARY_HEADER;
        for at in superblock::luks2_header_offsets() {
            if at.saturating_add(binary as u64) > size {
                break;
            }
            // Aligned: read from the device itself, past its page cache (as the probe reads).
            let mut block = sys::AlignedBuf::zeroed(binary);
            let n = self.os.read_device(device, at, block.as_mut_slice())?;
            let read = block.as_slice().get(..n).unwrap_or_default();
            let Some(len) = superblock::luks2_header_size(read, at) else {
                continue;
            };
            if at.saturating_add(len as u64) > size {
                continue;
            }
            let mut header = sys::AlignedBuf::zeroed(len);
            let n = self.os.read_device(device, at, header.as_mut_slice())?;
            slots.extend(superblock::luks2_key_slots(
                header.as_slice().get(..n).unwrap_or_default(),
            ));
        }
        Ok(!slots.is_empty() && slots.iter().all(|&n| n == 0))
    }

    /// After a stage that opened the volume's mapping in this call failed (the opened device
    /// holds unknown data, or mkfs, the mount or a later step failed): the mapping closed
    /// again, journaled as an unstage's close is ([`close_mapping`](Self::close_mapping)),
    /// since kubelet sends no NodeUnstageVolume after a final error. The first error, with
    /// the close's when it fails too. Left open, for the retry or reconciliation, when the
    /// journal still holds a stage (a mount that could not be undone); a fresh LUKS volume's
    /// mkfs cut short has its `Formatting` record of the mapping dropped first (the next open
    /// numbers the mapping anew; its fresh record makes the next stage format it).
    pub(super) fn close_after_failed_stage(&self, volume_id: &str, e: Error) -> Error {
        let mut record = self.record(volume_id);
        let fresh = record.crypt.as_ref().is_some_and(|c| c.fresh);
        let formatting = record
            .stage
            .as_ref()
            .is_some_and(|s| s.phase == Phase::Formatting);
        if fresh && formatting {
            record.stage = None;
            if let Err(j) = self.journal.put(&record, Durability::Power) {
                return e.with_cleanup_failure(volume_id, "dropping the mkfs record", &j);
            }
        }
        if record.stage.is_some() {
            return e;
        }
        match self.close_mapping(&mut record) {
            Ok(()) => {
                info!(
                    volume = volume_id,
                    "the stage failed: the mapping it opened is closed again"
                );
                e
            }
            Err(c) => e.with_cleanup_failure(volume_id, "closing the mapping it opened", &c),
        }
    }

    /// `cryptsetup luksFormat` of the held device, with the intent durable first (a fresh
    /// LUKS volume's record guards it across a power cut). `again`: the UUID of moor's own
    /// luksFormat that was cut short. The LUKS UUID.
    fn luks_format(
        &self,
        record: &mut VolumeRecord,
        req: &Stage,
        enc: &Encryption,
        (path, dev): (&Path, &HeldDevice),
        again: Option<String>,
    ) -> Result<String> {
        if req.cap.is_reader_only() || req.cap.access.attrs().read_only {
            return Err(Error::FailedPrecondition(format!(
                "volume {:?}: device {} is blank and the volume is staged read-only; a \
                 read-only stage never formats: stage it once read-write to create it",
                req.volume_id,
                path.display()
            )));
        }
        self.os.check_unclaimed(dev).map_err(|e| {
            if e.errno() == Some(libc::EBUSY) {
                Error::FailedPrecondition(format!(
                    "volume {:?}: device {} is in use (mounted or claimed); refusing to \
                     format it",
                    req.volume_id,
                    path.display()
                ))
            } else {
                Error::Sys(e)
            }
        })?;
        let uuid = match again {
            Some(u) => u,
            None => sys::random_uuid().map_err(Error::Sys)?,
        };
        let name = mapping_name(&req.volume_id);
        record.crypt = Some(CryptRecord {
            name,
            device: path.to_path_buf(),
            rdev: dev.rdev,
            wrapped_dek: Some(enc.wrapped.encode()),
            luks_uuid: Some(uuid.clone()),
            fresh: true,
            phase: Phase::InProgress,
            boot: self.boot().stamp(),
            rotation: None,
            rotated: false,
            kms_id: Some(enc.kms_id.clone()),
            tpm2_pcrs: enc.tpm2_pcrs.clone(),
        });
        self.journal.put(record, Durability::Power)?;
        crash_points::point("stage.luks_formatting");
        let mut args: Vec<String> = vec![
            "luksFormat".into(),
            "--batch-mode".into(),
            "--type".into(),
            "luks2".into(),
            "--uuid".into(),
            uuid.clone(),
            "--cipher".into(),
            enc.cipher.clone(),
            "--key-size".into(),
            enc.key_size.to_string(),
            "--sector-size".into(),
            enc.sector_size.to_string(),
        ];
        args.extend(pbkdf_args(&enc.pbkdf));
        args.extend(["--key-file=-".into(), dev.node.display().to_string()]);
        let format = cryptsetup(args, self.cfg.mkfs_deadline);
        self.os.run_tool_with_key(&format, enc.key.expose())?;
        info!(volume = req.volume_id, device = %path.display(), "formatted as LUKS2");
        Ok(uuid)
    }

    /// Writes the mapping's record, unless it says so already.
    fn record_crypt(
        &self,
        record: &mut VolumeRecord,
        (name, enc): (&str, &Encryption),
        (path, dev): (&Path, &HeldDevice),
        fresh_uuid: Option<String>,
        phase: Phase,
    ) -> Result<()> {
        let fresh = fresh_uuid.is_some();
        // The key the journal already names for this device stays: after a data key
        // rotation it is the one the header takes, whatever the volume context still says.
        let wrapped_dek = record
            .crypt
            .as_ref()
            .filter(|c| c.rotated || (c.rdev == dev.rdev && c.device == path))
            .and_then(|c| c.wrapped_dek.clone())
            .unwrap_or_else(|| enc.wrapped.encode());
        let want = CryptRecord {
            name: name.to_owned(),
            device: path.to_path_buf(),
            rdev: dev.rdev,
            wrapped_dek: Some(wrapped_dek),
            luks_uuid: fresh_uuid,
            fresh,
            phase,
            boot: self.boot().stamp(),
            rotation: record.crypt.as_ref().and_then(|c| c.rotation.clone()),
            rotated: record.crypt.as_ref().is_some_and(|c| c.rotated),
            kms_id: Some(enc.kms_id.clone()),
            tpm2_pcrs: enc.tpm2_pcrs.clone(),
        };
        if record.crypt.as_ref() == Some(&want) {
            return Ok(());
        }
        record.crypt = Some(want);
        let durability = if fresh {
            Durability::Power
        } else {
            Durability::Process
        };
        self.journal.put(record, durability)?;
        Ok(())
    }

    /// After an unstage: the volume's mapping closed (the filesystem is gone from it) and its
    /// record dropped; nothing when the volume is still staged. A mapping of the volume's name
    /// without a record (a journal lost) is closed too. A fresh LUKS volume's record stays,
    /// closed: its filesystem is still to be made by the next stage.
    pub(super) fn close_unstaged(&self, volume_id: &str) -> Result<()> {
        let mut record = self.record(volume_id);
        let staged = record
            .stage
            .as_ref()
            .is_some_and(|s| s.boot.as_deref() != Some(Boot::ENDED));
        if staged {
            return Ok(());
        }
        self.close_mapping(&mut record)
    }

    /// Reconciliation's part for an encrypted volume (a full pass, under the volume's lock,
    /// after its mounts and before the RBD mapping under it): a mapping whose stage is gone
    /// (no staging but a memory of one, no publication) and that nothing uses (no mount of
    /// it or bind of its node in `table`, no holder: an exclusive open succeeds) is closed
    /// and its record dropped, as the unstage would have; one in use is reported and left.
    /// A record whose mapping is not open (a crash after the close) is dropped the same way.
    pub(crate) fn reconcile_crypt(
        &self,
        record: &VolumeRecord,
        table: &[sys::mount_table::MountEntry],
        actions: &mut Vec<crate::reconcile::Action>,
    ) {
        use crate::reconcile::Action;
        let Some(c) = record.crypt.as_ref() else {
            return;
        };
        let claims = self.claims(record.clone());
        if claims.stage.is_some() || !claims.publishes.is_empty() {
            return;
        }
        let volume = record.volume_id.clone();
        let mapping = c.name.clone();
        let failed = |error: String| Action::Failed {
            volume: volume.clone(),
            path: mapper_path(&mapping),
            error,
        };
        let open = match self.os.hold_device(&mapper_path(&mapping)) {
            Ok(held) => {
                let node_name = held.node.file_name().map(|n| Path::new("/").join(n));
                let mounted = table.iter().any(|m| {
                    m.dev == held.rdev
                        || (node_name.as_deref() == Some(m.root.as_path())
                            && m.fs_type == "devtmpfs")
                });
                let held_by = self.os.check_unclaimed(&held).err();
                if mounted || held_by.as_ref().and_then(sys::SysError::errno) == Some(libc::EBUSY) {
                    actions.push(Action::CryptInUse { volume, mapping });
                    return;
                }
                if let Some(e) = held_by {
                    actions.push(failed(e.to_string()));
                    return;
                }
                true
            }
            Err(e) if e.is_not_found() => false,
            Err(e) => {
                actions.push(failed(e.to_string()));
                return;
            }
        };
        let mut record = record.clone();
        match self.close_mapping(&mut record) {
            Ok(()) if open => actions.push(Action::CryptClosed { volume, mapping }),
            Ok(()) => {}
            Err(e) => actions.push(failed(e.to_string())),
        }
    }

    /// The volume's mapping closed if open and its record dropped (a fresh one kept, closed).
    fn close_mapping(&self, record: &mut VolumeRecord) -> Result<()> {
        let volume_id = record.volume_id.clone();
        let volume_id = volume_id.as_str();
        let name = record
            .crypt
            .as_ref()
            .map_or_else(|| mapping_name(volume_id), |c| c.name.clone());
        let open = self.os.block_device(&mapper_path(&name)).is_ok();
        if record.crypt.is_none() && !open {
            return Ok(());
        }
        if open {
            if let Some(c) = record.crypt.as_mut()
                && c.phase != Phase::InProgress
            {
                c.phase = Phase::InProgress;
                self.journal.put(record, Durability::Process)?;
            }
            crash_points::point("unstage.closing");
            let close = cryptsetup(vec!["close".into(), name.clone()], CRYPTSETUP_DEADLINE);
            match self.os.run_tool(&close) {
                Ok(()) => info!(volume = volume_id, mapping = name, "the mapping is closed"),
                // Gone since it was looked at: what the close was for.
                Err(ToolError::Failed {
                    code: Some(EXIT_NO_DEVICE),
                    ..
                }) => warn!(volume = volume_id, mapping = name, "the mapping was gone"),
                Err(e) => return Err(e.into()),
            }
            crash_points::point("unstage.closed");
        }
        match record.crypt.as_mut() {
            Some(c) if c.fresh && c.phase != Phase::InProgress => {
                c.phase = Phase::InProgress;
                self.journal.put(record, Durability::Power)?;
            }
            Some(c) if c.fresh => {}
            // A data key rotation cut short, or finished here: its keys stay journaled for the
            // next stage and the rotation's next call (`engine::rotate`).
            Some(c) if c.rotation.is_some() || c.rotated => {}
            Some(_) => {
                record.crypt = None;
                self.journal.put(record, Durability::Process)?;
            }
            None => {}
        }
        Ok(())
    }

    /// Before an encrypted volume's filesystem grows: its mapping grown to the device under it
    /// (`cryptsetup resize`, which needs the key: `key`, got by the service as the stage gets
    /// it, from the wrapped data key the journal keeps, by the key source it names, with the
    /// node-expand secret). Nothing for a volume without a mapping.
    pub(super) fn resize_mapping(&self, volume_id: &str, key: Option<&ExpandKey>) -> Result<()> {
        let Some(c) = self.record(volume_id).crypt else {
            return Ok(());
        };
        let Some(key) = key else {
            return Err(Error::invalid(
                "secrets",
                format!(
                    "volume {volume_id:?} is encrypted: its mapping grows only with its key, \
                     which the node-expand secret (csi.storage.k8s.io/node-expand-secret-name) \
                     unwraps"
                ),
            ));
        };
        if c.wrapped_dek.as_deref() != Some(key.wrapped.as_str()) {
            // A data key rotation (or a new stage) changed the mapping's key since the
            // service read it: the key in hand may open no slot.
            warn!(
                volume = volume_id,
                "the mapping's key changed while NodeExpandVolume ran (a data key rotation): \
                 nothing resized, the call is to be retried"
            );
            return Err(Error::OperationPending(volume_id.to_owned()));
        }
        let resize = cryptsetup(
            vec!["resize".into(), "--key-file=-".into(), c.name.clone()],
            CRYPTSETUP_DEADLINE,
        );
        match self.os.run_tool_with_key(&resize, key.key.expose()) {
            Ok(()) => {}
            Err(ToolError::Failed {
                code: Some(EXIT_WRONG_KEY),
                ..
            }) => {
                return Err(Error::FailedPrecondition(format!(
                    "the key {:?} does not open volume {volume_id:?}: no key slot of its LUKS \
                     header takes it (for a tpm2 volume: this node's TPM is not the one that \
                     made it); nothing was resized",
                    key.kek_id
                )));
            }
            Err(e) => return Err(e.into()),
        }
        info!(
            volume = volume_id,
            mapping = c.name,
            "the mapping is resized to its device"
        );
        Ok(())
    }
}
