//! A data key rotation of an open encrypted volume (docs/encryption.md, "Rotation"), online,
//! in ceph-csi's order, which never leaves the LUKS header without a slot that opens with a
//! key the journal holds wrapped:
//!
//! 1. `CopyOld`: the old key copied into the spare slot ([`SLOT_SPARE`]);
//! 2. `KillOld`: the volume's slot ([`SLOT_VOLUME`]) emptied, cryptsetup proving first that
//!    the old key opens another slot (the spare);
//! 3. `AddNew`: the new key written into the volume's slot, opened by the old key;
//! 4. `Record`: the new wrapped key made the mapping's in the journal;
//! 5. `Verify`: the recorded key read back, unwrapped and tried on the volume's slot alone;
//! 6. `KillSpare`: the spare slot emptied, cryptsetup proving first that the new key opens
//!    another slot (the volume's).
//!
//! A `tpm2` volume's slots take passphrases, each data key combined with the node's TPM half
//! ([`NodeHalf`]): the half is asked of the TPM once per call, before any step, and both keys
//! combined with it; the journal never holds it.
//!
//! Both keys are journaled wrapped, to survive a power cut, before the first step, and the
//! step before each. A rotation cut short (an error, a crash, a restart) resumes forward at
//! the next call with the same keys: where it stands is read from the header itself (which
//! slot opens with which key), never taken on the journal's word, so a step that ran but
//! was not journaled as done is not run twice. Keys reach cryptsetup on its standard input
//! only: for `luksAddKey` the opening key and the new key one after the other, each 32 bytes
//! (`--keyfile-size`, `--new-keyfile-size`, the new key file `/dev/stdin`).

use std::path::Path;

use moor_runtime::keys::tpm2::{KMS_TPM2, NodeHalf};
use moor_runtime::keys::{Dek, KEY_LEN, KeyError, WrappedDek};
use tracing::info;

use super::crypt::{CRYPTSETUP_DEADLINE, EXIT_WRONG_KEY, cryptsetup, pbkdf_args};
use super::{Encryption, Engine, RotateDek};
use crate::crash_points;
use crate::error::{Error, Result};
use crate::journal::{Durability, RotationRecord, RotationStep, VolumeRecord};
use crate::sys::{Os, ToolError, ToolRun};

/// The key slot of a volume moor formatted: its one key lives here before and after a
/// rotation.
pub const SLOT_VOLUME: u32 = 0;

/// The slot that holds the old key while the volume's slot changes.
pub const SLOT_SPARE: u32 = 1;

/// cryptsetup's exit code for a key slot that is not active or is full.
const EXIT_SLOT: i32 = 1;

/// What a rotation did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RotateReport {
    /// The steps run by this call, in order (a resumed rotation runs only what was left).
    pub ran: Vec<RotationStep>,
    /// The id of the key-encryption key the new data key is wrapped by.
    pub kek_id: String,
}

/// Which of the two keys a slot opens with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Holds {
    Old,
    New,
    /// Neither: empty, or a key moor does not hold.
    Neither,
}

impl<O: Os> Engine<O> {
    /// Rotates the data key of the staged encrypted volume `req.volume_id` from
    /// `req.old_wrapped` to `req.new_wrapped`, or resumes such a rotation. Errors:
    /// INVALID_ARGUMENT for the same key twice or a bad PBKDF; FAILED_PRECONDITION for a volume
    /// not open here, a key the KEK does not unwrap, an old key no slot takes (nothing is
    /// touched), another rotation journaled in progress, or a spare slot holding a key moor
    /// does not know.
    pub fn rotate_dek(&self, req: &RotateDek) -> Result<RotateReport> {
        let _guard = self.locks.try_lock(&req.volume_id)?;
        let volume = req.volume_id.as_str();
        if req.pbkdf.is_empty()
            || req.pbkdf.starts_with('-')
            || !req.pbkdf.bytes().all(|b| b.is_ascii_alphanumeric())
        {
            return Err(Error::invalid("pbkdf", "must be a plain word"));
        }
        let mut record = self.record(volume);
        let Some(crypt) = record.crypt.clone().filter(|c| !c.fresh) else {
            return Err(Error::FailedPrecondition(format!(
                "volume {volume:?} has no open encrypted mapping on this node: its data key \
                 is rotated where it is staged"
            )));
        };
        let (old_text, new_text) = (req.old_wrapped.encode(), req.new_wrapped.encode());
        if let Some(r) = &crypt.rotation
            && (r.old_wrapped != old_text || r.new_wrapped != new_text)
        {
            return Err(Error::FailedPrecondition(format!(
                "volume {volume:?}: another rotation of its data key is in progress (to a key \
                 wrapped by {:?}); run it again with the keys the controller's record holds \
                 as current and pending to finish it first",
                moor_runtime::keys::WrappedDek::decode(&r.new_wrapped)
                    .map(|w| w.kek_id().to_owned())
                    .unwrap_or_default()
            )));
        }
        let unwrap = |w| {
            req.kek
                .unwrap(w, volume)
                .map_err(|e| Error::FailedPrecondition(format!("{e}; nothing was rotated")))
        };
        // A `tpm2` volume's slots take each key combined with this node's half: the TPM is
        // asked once (under the volume's PCR policy) for both keys and every step of the call,
        // again at a resumed call; the journal holds only the wrapped keys.
        let half = self.node_half(volume, &crypt, req)?;
        let passphrase = |w| {
            let dek = unwrap(w)?;
            match &half {
                Some(h) => h
                    .combine(&dek)
                    .map_err(|e| Error::FailedPrecondition(format!("{e}; nothing was rotated"))),
                None => Ok(dek),
            }
        };
        let old = passphrase(&req.old_wrapped)?;
        let new = passphrase(&req.new_wrapped)?;
        if old.expose() == new.expose() {
            return Err(Error::invalid(
                "new_wrapped",
                format!("volume {volume:?}: the new data key is the old one"),
            ));
        }
        let device = crypt.device.clone();
        let holds = |slot| self.slot_holds(&device, slot, &old, &new);
        let (vol, spare) = (holds(SLOT_VOLUME)?, holds(SLOT_SPARE)?);
        let first = match (vol, spare) {
            (Holds::Old, Holds::Neither) => RotationStep::CopyOld,
            (Holds::Old, Holds::Old) => RotationStep::KillOld,
            (Holds::Neither, Holds::Old) => RotationStep::AddNew,
            (Holds::New, Holds::Old) => RotationStep::Record,
            (Holds::New, Holds::Neither) => RotationStep::Record,
            _ => {
                return Err(Error::FailedPrecondition(format!(
                    "volume {volume:?}: neither its slot {SLOT_VOLUME} nor its spare slot \
                     {SLOT_SPARE} on {} opens with the old data key (the key {:?} unwraps) as \
                     a rotation leaves them: a wrong old key, or slots moor did not write; \
                     nothing was changed",
                    device.display(),
                    req.kek.kek_id()
                )));
            }
        };
        let mut ran = Vec::new();
        let steps = [
            RotationStep::CopyOld,
            RotationStep::KillOld,
            RotationStep::AddNew,
            RotationStep::Record,
            RotationStep::Verify,
            RotationStep::KillSpare,
        ];
        for step in steps.into_iter().filter(|s| *s >= first) {
            // The intent, durable before the header or the record changes.
            let c = record.crypt.get_or_insert_with(|| crypt.clone());
            c.rotation = Some(RotationRecord {
                old_wrapped: old_text.clone(),
                new_wrapped: new_text.clone(),
                step,
            });
            self.journal.put(&record, Durability::Power)?;
            crash_points::point(rotate_point(step));
            match step {
                RotationStep::CopyOld => self.add_key(&device, SLOT_SPARE, &old, &old, req)?,
                RotationStep::KillOld => self.kill_slot(&device, SLOT_VOLUME, &old)?,
                RotationStep::AddNew => self.add_key(&device, SLOT_VOLUME, &old, &new, req)?,
                RotationStep::Record => {
                    if let Some(c) = record.crypt.as_mut() {
                        c.wrapped_dek = Some(new_text.clone());
                    }
                    self.journal.put(&record, Durability::Power)?;
                }
                RotationStep::Verify => {
                    self.verify_recorded(volume, &device, req, half.as_ref())?;
                }
                RotationStep::KillSpare => {
                    if self.test_key(&device, SLOT_SPARE, &old)? {
                        self.kill_slot(&device, SLOT_SPARE, &new)?;
                    }
                }
            }
            ran.push(step);
        }
        if let Some(c) = record.crypt.as_mut() {
            c.rotation = None;
            c.rotated = true;
        }
        self.journal.put(&record, Durability::Power)?;
        crash_points::point("rotate.done");
        info!(
            volume,
            kek = req.kek.kek_id(),
            steps = ran.len(),
            "the volume's data key is rotated"
        );
        Ok(RotateReport {
            ran,
            kek_id: req.kek.kek_id().to_owned(),
        })
    }

    /// Which key `slot` of the LUKS device at `device` opens with.
    fn slot_holds(&self, device: &Path, slot: u32, old: &Dek, new: &Dek) -> Result<Holds> {
        Ok(if self.test_key(device, slot, old)? {
            Holds::Old
        } else if self.test_key(device, slot, new)? {
            Holds::New
        } else {
            Holds::Neither
        })
    }

    /// Whether `slot` opens with `key` (`open --test-passphrase --key-slot`): cryptsetup's
    /// exit 2 (another key) and 1 (an empty slot) are no.
    fn test_key(&self, device: &Path, slot: u32, key: &Dek) -> Result<bool> {
        let test = cryptsetup(
            vec![
                "open".into(),
                "--test-passphrase".into(),
                "--key-slot".into(),
                slot.to_string(),
                "--key-file=-".into(),
                "--keyfile-size".into(),
                KEY_LEN.to_string(),
                device.display().to_string(),
            ],
            CRYPTSETUP_DEADLINE,
        );
        match self.os.run_tool_with_key(&test, key.expose()) {
            Ok(()) => Ok(true),
            Err(ToolError::Failed {
                code: Some(EXIT_WRONG_KEY | EXIT_SLOT),
                ..
            }) => Ok(false),
            Err(e) => Err(e.into()),
        }
    }

    /// `luksAddKey` of `new` into `slot`, opened by `opening`: both keys on standard input,
    /// one after the other.
    fn add_key(
        &self,
        device: &Path,
        slot: u32,
        opening: &Dek,
        new: &Dek,
        req: &RotateDek,
    ) -> Result<()> {
        let mut args: Vec<String> = vec![
            "luksAddKey".into(),
            "--new-key-slot".into(),
            slot.to_string(),
            "--key-file=-".into(),
            "--keyfile-size".into(),
            KEY_LEN.to_string(),
            "--new-keyfile-size".into(),
            KEY_LEN.to_string(),
        ];
        args.extend(pbkdf_args(&req.pbkdf));
        args.extend([device.display().to_string(), "/dev/stdin".into()]);
        let keys = moor_runtime::keys::key_pair(opening, new);
        let add = cryptsetup(args, CRYPTSETUP_DEADLINE);
        self.os
            .run_tool_with_key(&add, &keys)
            .map_err(|e| self.slot_error(e, device, slot))
    }

    /// `luksKillSlot` of `slot`, which cryptsetup does only once `remaining` opens another
    /// slot (never `--batch-mode`: it would kill without that proof).
    fn kill_slot(&self, device: &Path, slot: u32, remaining: &Dek) -> Result<()> {
        let kill = cryptsetup(
            vec![
                "luksKillSlot".into(),
                "--key-file=-".into(),
                "--keyfile-size".into(),
                KEY_LEN.to_string(),
                device.display().to_string(),
                slot.to_string(),
            ],
            CRYPTSETUP_DEADLINE,
        );
        self.os
            .run_tool_with_key(&kill, remaining.expose())
            .map_err(|e| self.slot_error(e, device, slot))
    }

    /// A `tpm2` volume's node half from the request's TPM, its key sealed to the PCRs the
    /// mapping's record keeps; None for another source. A TPM that does not answer is
    /// UNAVAILABLE, one that refuses (another TPM, a PCR policy not met) FAILED_PRECONDITION:
    /// either before any step.
    fn node_half(
        &self,
        volume: &str,
        crypt: &crate::journal::CryptRecord,
        req: &RotateDek,
    ) -> Result<Option<NodeHalf>> {
        if crypt.kms_id.as_deref() != Some(KMS_TPM2) {
            return Ok(None);
        }
        NodeHalf::of(&*req.tpm.0, crypt.tpm2_pcrs.as_deref(), volume)
            .map(Some)
            .map_err(|e| match e {
                KeyError::Unavailable(m) => Error::Unavailable(format!("{m}; nothing was rotated")),
                e => Error::FailedPrecondition(format!(
                    "volume {volume:?}: this node's TPM half: {e}; nothing was rotated"
                )),
            })
    }

    /// The journal's wrapped key read back, unwrapped (for `tpm2`, combined with the node
    /// `half`) and tried on the volume's slot alone.
    fn verify_recorded(
        &self,
        volume: &str,
        device: &Path,
        req: &RotateDek,
        half: Option<&NodeHalf>,
    ) -> Result<()> {
        let recorded = self
            .record(volume)
            .crypt
            .and_then(|c| c.wrapped_dek)
            .ok_or_else(|| {
                Error::FailedPrecondition(format!(
                    "volume {volume:?}: the recorded data key is gone"
                ))
            })?;
        let wrapped = moor_runtime::keys::WrappedDek::decode(&recorded)
            .map_err(|e| Error::FailedPrecondition(format!("volume {volume:?}: {e}")))?;
        let read_back =
            |e| Error::FailedPrecondition(format!("{e}, read back after it was recorded"));
        let mut key = req.kek.unwrap(&wrapped, volume).map_err(read_back)?;
        if let Some(h) = half {
            key = h.combine(&key).map_err(read_back)?;
        }
        if self.test_key(device, SLOT_VOLUME, &key)? {
            Ok(())
        } else {
            Err(Error::FailedPrecondition(format!(
                "volume {volume:?}: the recorded data key does not open slot {SLOT_VOLUME} of \
                 {}; the old key's slot is kept",
                device.display()
            )))
        }
    }

    /// A slot step's failure: a wrong key or a slot in the way is FAILED_PRECONDITION.
    fn slot_error(&self, e: ToolError, device: &Path, slot: u32) -> Error {
        match e {
            ToolError::Failed {
                code: Some(code @ (EXIT_WRONG_KEY | EXIT_SLOT)),
                ..
            } => Error::FailedPrecondition(format!(
                "key slot {slot} of {}: cryptsetup refused ({}); the journal keeps the \
                 rotation, which the same call resumes",
                device.display(),
                if code == EXIT_WRONG_KEY {
                    "no other slot opens with the key given"
                } else {
                    "the slot is full or empty"
                }
            )),
            other => other.into(),
        }
    }
}

/// The crash point before `step`.
fn rotate_point(step: RotationStep) -> &'static str {
    match step {
        RotationStep::CopyOld => "rotate.copy_old",
        RotationStep::KillOld => "rotate.kill_old",
        RotationStep::AddNew => "rotate.add_new",
        RotationStep::Record => "rotate.record",
        RotationStep::Verify => "rotate.verify",
        RotationStep::KillSpare => "rotate.kill_spare",
    }
}

impl<O: Os> Engine<O> {
    /// Runs `open` (a `cryptsetup open` reading its key on stdin) with the request's data
    /// key, and when no slot takes it, with the other keys the stage was given (the
    /// controller's pending key, the volume context's) and those the journal keeps of a
    /// rotation cut short or finished here, in that order, each unwrapped by the request's
    /// key-encryption key (for `tpm2`, combined with the stage's node half): a volume staged
    /// at any instant of a rotation opens with whichever key its header holds. The
    /// wrapped key that opened it when it was not the request's; the request's failure when
    /// none did.
    pub(super) fn open_with_journaled_keys(
        &self,
        record: &VolumeRecord,
        enc: &Encryption,
        volume: &str,
        open: &ToolRun,
    ) -> std::result::Result<Option<String>, ToolError> {
        let first = match self.os.run_tool_with_key(open, enc.key.expose()) {
            Ok(()) => return Ok(None),
            Err(e) => e,
        };
        if !matches!(
            first,
            ToolError::Failed {
                code: Some(EXIT_WRONG_KEY),
                ..
            }
        ) {
            return Err(first);
        }
        let given = enc.wrapped.encode();
        let crypt = record.crypt.as_ref();
        let rotated = crypt
            .filter(|c| c.rotated)
            .and_then(|c| c.wrapped_dek.clone());
        let published = enc.others.iter().map(WrappedDek::encode);
        let journaled: Vec<String> = published
            .chain(
                crypt
                    .and_then(|c| c.rotation.as_ref())
                    .map(|r| vec![r.new_wrapped.clone(), r.old_wrapped.clone()])
                    .unwrap_or_default(),
            )
            .chain(rotated)
            .collect();
        let mut tried = vec![given];
        for text in journaled {
            if tried.contains(&text) {
                continue;
            }
            tried.push(text.clone());
            let key = WrappedDek::decode(&text)
                .and_then(|w| enc.kek.unwrap(&w, volume))
                .and_then(|dek| match &enc.node_half {
                    Some(h) => h.combine(&dek),
                    None => Ok(dek),
                });
            let Ok(key) = key else {
                continue;
            };
            match self.os.run_tool_with_key(open, key.expose()) {
                Ok(()) => {
                    info!(
                        volume,
                        "opened with another key the stage was given or the journal keeps \
                         (a data key rotation)"
                    );
                    return Ok(Some(text));
                }
                Err(ToolError::Failed {
                    code: Some(EXIT_WRONG_KEY),
                    ..
                }) => {}
                Err(e) => return Err(e),
            }
        }
        Err(first)
    }

    /// After an open with a journaled key of a rotation (`by`): the mapping's record names
    /// that key, the one its header takes, for NodeExpandVolume.
    pub(super) fn record_opened_by(
        &self,
        record: &mut VolumeRecord,
        by: Option<String>,
    ) -> Result<()> {
        if let (Some(by), Some(c)) = (by, record.crypt.as_mut()) {
            c.wrapped_dek = Some(by);
            self.journal.put(record, Durability::Power)?;
        }
        Ok(())
    }
}
