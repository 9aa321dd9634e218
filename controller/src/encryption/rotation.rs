//! The controller's half of a key rotation (docs/encryption.md, "Rotation"): what a volume's
//! record holds of its data key, and how a rotation changes it. The record is the truth for
//! the wrapped data key; the node changes the LUKS key slot in between (`engine::rotate`).
//!
//! A DEK rotation, in order, each step a write of the record the next one needs:
//!
//! 1. [`begin`]: the new data key made, wrapped by the volume's KEK and written into the
//!    record as **pending**, before the node changes any slot (a rotation begun again returns
//!    the same pending key: it may already be in the header);
//! 2. the node rotates the slot from `current` to `pending` and verifies it (not here);
//! 3. [`promote`]: once the node answered, `pending` becomes `current`.
//!
//! At every instant the header opens with `current` or `pending` (the node's order sees to
//! it), and every stage is given both (the publish_context), so a volume staged at any
//! instant opens, on any node. A KEK rotation ([`rewrap`]) wraps both again under a new KEK,
//! touching no header: each wrapped key names the KEK that wrapped it (`v1:<kek id>:...`), so
//! a KEK rotation cut short resumes at the next record; it wraps again the key each snapshot
//! record carries too, so that a restore opens once the old KEK is retired.
//!
//! Where the record lives is the backend's, through the [`Backend`] trait (the embedded
//! backend's record file; an RBD volume's image metadata, `rbd::keys`); what it holds and the
//! order of its steps are decided here, once, for both.

use moor_runtime::keys::source::KeySource;
use moor_runtime::keys::{KeyError, WrappedDek};
use serde::{Deserialize, Serialize};

use moor_runtime::contract::ENCRYPTED_DEK_KEY;

use crate::backend::{Backend, PageRequest, Parameters, SnapshotFilter};
use crate::error::{Error, Result, trunc};

/// The wrapped data keys of an encrypted volume's record (not secret: each is wrapped).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecordKeys {
    /// The key that opens the volume's slot once no rotation is in progress.
    pub current: String,
    /// The key a rotation in progress moves the slot to; `None` when none is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pending: Option<String>,
    /// How many rotations the record has finished (a scheduled rotation's guard: see
    /// [`begin`]).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub rotations: u64,
    /// When `current` became the volume's key, in seconds since the Unix epoch: the last
    /// promotion, or the start of its rotation schedule ([`schedule_started`]); `None` for a
    /// record that has seen neither.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub current_since: Option<u64>,
    /// A rotation schedule set on the volume's PersistentVolume or PersistentVolumeClaim
    /// (`moor.csi.io/key-rotation-schedule`, copied here by `kube::apply_rotation_schedules`),
    /// over its class's `keyRotationSchedule`; `None`: the class's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub schedule: Option<String>,
}

#[allow(clippy::trivially_copy_pass_by_ref)] // serde's skip_serializing_if takes a reference
fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// Now, in seconds since the Unix epoch.
#[must_use]
pub fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

impl RecordKeys {
    /// The keys of a record that has seen no rotation: the volume context's.
    #[must_use]
    pub fn of_context(wrapped: &str) -> Self {
        Self {
            current: wrapped.to_owned(),
            pending: None,
            rotations: 0,
            current_since: None,
            schedule: None,
        }
    }

    /// The KEK ids that wrap them, `current`'s first.
    pub fn kek_ids(&self) -> Result<Vec<String>> {
        self.all()
            .map(|t| decode(t).map(|w| w.kek_id().to_owned()))
            .collect()
    }

    fn all(&self) -> impl Iterator<Item = &String> {
        std::iter::once(&self.current).chain(self.pending.as_ref())
    }
}

fn decode(text: &str) -> Result<WrappedDek> {
    WrappedDek::decode(text).map_err(|e| Error::Internal(format!("a volume record: {e}")))
}

/// A key source's refusal of a volume's key, as the controller answers it: a key server that
/// cannot be reached UNAVAILABLE, any other refusal (another KEK, a wrong one) FAILED_PRECONDITION;
/// never a key byte.
fn refused(volume: &str, what: &str) -> impl FnOnce(KeyError) -> Error {
    let (volume, what) = (trunc(volume).to_string(), what.to_owned());
    move |e| match e {
        KeyError::Unavailable(m) => Error::Unavailable(format!("volume {volume:?}: {m}")),
        e => Error::FailedPrecondition(format!("volume {volume:?}: {what}: {e}")),
    }
}

/// Step 1 of a DEK rotation of `volume`: the record's keys with a pending key, made now and
/// wrapped by `kek`, unless a rotation is pending already (then they are returned as they
/// are, after `kek` is proven to unwrap both: the node may have written the pending key into
/// a slot). `kek` must unwrap the current key: the node's rotation opens the old slot with it.
/// With `if_rotations` (a scheduled rotation's guard), a record that has finished another
/// number of rotations and has none pending is returned as it is: a rotation ran since the
/// scheduler read it, and one due is not run twice.
pub fn begin(
    keys: &RecordKeys,
    kek: &KeySource,
    volume: &str,
    if_rotations: Option<u64>,
) -> Result<RecordKeys> {
    for text in keys.all() {
        kek.unwrap(&decode(text)?, volume).map_err(refused(
            volume,
            "the secrets' key does not unwrap its data key",
        ))?;
    }
    if keys.pending.is_some() || if_rotations.is_some_and(|n| n != keys.rotations) {
        return Ok(keys.clone());
    }
    Ok(RecordKeys {
        pending: Some(super::new_wrapped_dek(kek, volume)?),
        ..keys.clone()
    })
}

/// Step 3: `new`, the pending key the node has rotated the volume's slot to and verified,
/// made the current one. Already current (a promotion run again): unchanged. Any other key:
/// FAILED_PRECONDITION, the record untouched (a pending key is promoted only once the node
/// has proven it, and only the one the record holds). A promotion counts a rotation and
/// makes `now` (seconds since the Unix epoch) the time the key became current.
pub fn promote(keys: &RecordKeys, new: &str, volume: &str, now: u64) -> Result<RecordKeys> {
    if keys.pending.as_deref() == Some(new) {
        return Ok(RecordKeys {
            current: new.to_owned(),
            pending: None,
            rotations: keys.rotations.saturating_add(1),
            current_since: Some(now),
            schedule: keys.schedule.clone(),
        });
    }
    if keys.current == new && keys.pending.is_none() {
        return Ok(keys.clone());
    }
    Err(Error::FailedPrecondition(format!(
        "volume {:?}: the key to promote is not the record's pending data key{}; nothing was \
         changed",
        trunc(volume),
        if keys.pending.is_none() {
            " (no rotation is pending)"
        } else {
            ""
        }
    )))
}

/// A KEK rotation's step for one record: `current` and `pending` wrapped again under `new`
/// (each unwrapped by `old`, wrapped by `new`, and proven to unwrap under `new` to the same
/// key: `moor_runtime::keys::rewrap`'s rule). A key already under `new` is kept after `new`
/// proves it, so a rotation run again does nothing twice. The keys and whether they changed.
pub fn rewrap(
    keys: &RecordKeys,
    volume: &str,
    old: &KeySource,
    new: &KeySource,
) -> Result<(RecordKeys, bool)> {
    let one = |text: &String| -> Result<String> {
        let wrapped = decode(text)?;
        if wrapped.kek_id() == new.kek_id() {
            new.unwrap(&wrapped, volume)
                .map_err(refused(volume, "the new key does not unwrap its data key"))?;
            return Ok(text.clone());
        }
        let dek = old
            .unwrap(&wrapped, volume)
            .map_err(refused(volume, "the old key does not unwrap its data key"))?;
        let again = super::wrap_for(&dek, new, volume)?;
        let back = new.unwrap(&decode(&again)?, volume).map_err(refused(
            volume,
            "the new key does not unwrap what it wrapped",
        ))?;
        if back.expose() != dek.expose() {
            return Err(Error::Internal(format!(
                "volume {:?}: the data key wrapped again does not unwrap to itself",
                trunc(volume)
            )));
        }
        Ok(again)
    };
    let after = RecordKeys {
        current: one(&keys.current)?,
        pending: keys.pending.as_ref().map(one).transpose()?,
        ..keys.clone()
    };
    let changed = after != *keys;
    Ok((after, changed))
}

/// Step 1 over a backend: the volume's record read, a pending key made (or the pending one
/// kept) and written, durably, before this answers: the keys to give the node. `if_rotations`:
/// [`begin`]'s guard.
pub fn begin_on<B: Backend + ?Sized>(
    b: &B,
    volume: &str,
    kek: &KeySource,
    if_rotations: Option<u64>,
) -> Result<RecordKeys> {
    let before = b.volume_keys(volume)?;
    let after = begin(&before, kek, volume, if_rotations)?;
    b.write_volume_keys(volume, &before, &after)?;
    Ok(after)
}

/// Step 3 over a backend: `new` promoted in the volume's record, durably.
pub fn promote_on<B: Backend + ?Sized>(b: &B, volume: &str, new: &str) -> Result<RecordKeys> {
    let before = b.volume_keys(volume)?;
    let after = promote(&before, new, volume, unix_now())?;
    b.write_volume_keys(volume, &before, &after)?;
    Ok(after)
}

/// The keys of a volume whose rotation schedule starts: `keys` with `now` as the time its
/// current key became current, when the record has none yet (unchanged otherwise).
#[must_use]
pub fn schedule_started(keys: &RecordKeys, now: u64) -> RecordKeys {
    RecordKeys {
        current_since: keys.current_since.or(Some(now)),
        ..keys.clone()
    }
}

/// The keys of `volume` for its rotation scheduler, and its schedule (the record's override,
/// else `class_schedule`): [`schedule_started`] written, durably, when it has a schedule and
/// the record has no time yet.
pub fn keys_for_schedule<B: Backend + ?Sized>(
    b: &B,
    volume: &str,
    class_schedule: Option<&str>,
) -> Result<(RecordKeys, Option<String>)> {
    let keys = keys_with_clock(b, volume, class_schedule)?;
    let schedule = keys
        .schedule
        .clone()
        .or_else(|| class_schedule.map(str::to_owned));
    Ok((keys, schedule))
}

fn keys_with_clock<B: Backend + ?Sized>(
    b: &B,
    volume: &str,
    class_schedule: Option<&str>,
) -> Result<RecordKeys> {
    // Another call may write the record between the read and the write (a scheduler's Begin,
    // an operator's look): the write then fails, and is tried again on the record as it is.
    let mut attempts = 3;
    loop {
        let before = b.volume_keys(volume)?;
        let scheduled = before.schedule.is_some() || class_schedule.is_some();
        if !scheduled || before.current_since.is_some() {
            return Ok(before);
        }
        let after = schedule_started(&before, unix_now());
        match b.write_volume_keys(volume, &before, &after) {
            Ok(()) => return Ok(after),
            Err(e) if attempts == 1 => return Err(e),
            Err(_) => attempts -= 1,
        }
    }
}

/// What a KEK rotation over every record did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KekRotation {
    /// The volumes and snapshots whose records it wrote, their keys now under the new KEK.
    pub rewrapped: Vec<String>,
    /// The volumes and snapshots already under the new KEK (a rotation run again, or resumed).
    pub unchanged: Vec<String>,
    /// The volumes and snapshots under neither KEK, left alone: their KEK ids.
    pub other_keks: Vec<(String, Vec<String>)>,
}

impl KekRotation {
    /// One record's step: `before` (the keys of the volume or snapshot `id`, wrapped for the
    /// volume `bound`) rewrapped under `new` ([`rewrap`]) and written by `write` when they
    /// changed; a record under another KEK left alone.
    fn step(
        &mut self,
        id: String,
        bound: &str,
        before: &RecordKeys,
        (old, new): (&KeySource, &KeySource),
        write: impl FnOnce(&RecordKeys) -> Result<()>,
    ) -> Result<()> {
        let ids = before.kek_ids()?;
        if ids.iter().any(|i| i != old.kek_id() && i != new.kek_id()) {
            self.other_keks.push((id, ids));
            return Ok(());
        }
        let (after, changed) = rewrap(before, bound, old, new)?;
        if changed {
            write(&after)?;
            self.rewrapped.push(id);
        } else {
            self.unchanged.push(id);
        }
        Ok(())
    }
}

/// A snapshot record's step of a KEK rotation, for [`Backend::write_snapshot_key`]: its
/// `encryption` given the wrapped key `after` if it carries `before` (whether that changed
/// it: `after` already there is no change); ABORTED, nothing changed, when it carries
/// another (a call changed it since it was read), FAILED_PRECONDITION for a snapshot in the
/// clear.
pub fn swap_snapshot_key(
    encryption: &mut Parameters,
    snapshot: &str,
    before: &str,
    after: &str,
) -> Result<bool> {
    match encryption.get(ENCRYPTED_DEK_KEY).map(String::as_str) {
        None => Err(Error::FailedPrecondition(format!(
            "snapshot {:?}: not of an encrypted volume, it has no data key",
            trunc(snapshot)
        ))),
        Some(k) if k == after => Ok(false),
        Some(k) if k == before => {
            encryption.insert(ENCRYPTED_DEK_KEY.to_owned(), after.to_owned());
            Ok(true)
        }
        Some(_) => Err(Error::OperationPending(format!(
            "snapshot {:?}: its data key changed since it was read; run the rotation again",
            trunc(snapshot)
        ))),
    }
}

/// Every snapshot of `b` that carries an encrypted volume's wrapped data key: its id, the
/// volume the key is wrapped for (its source) and the key.
fn encrypted_snapshots<B: Backend + ?Sized>(b: &B) -> Result<Vec<(String, String, String)>> {
    let mut out = Vec::new();
    let mut page = PageRequest::default();
    loop {
        let listed = b.list_snapshots(&SnapshotFilter::default(), &page)?;
        out.extend(listed.entries.into_iter().filter_map(|s| {
            let wrapped = s.encryption.get(ENCRYPTED_DEK_KEY)?.clone();
            Some((s.id, s.source_volume_id, wrapped))
        }));
        match listed.next_token {
            Some(t) => page.starting_token = Some(t),
            None => return Ok(out),
        }
    }
}

/// A KEK rotation over every encrypted volume of `b`, then every snapshot of one: each
/// record whose keys `old` or `new` wrap is rewrapped under `new` ([`rewrap`]) and written,
/// one record at a time, so a rotation cut short (a crash, an error) is resumed by running
/// it again: the records done are under `new` and are left as they are. A snapshot's key,
/// wrapped for its source volume, is rewrapped for that volume, so that a restore after the
/// old KEK is retired still opens (the snapshot outlives its source's record). A record
/// under another KEK is left alone and reported. The first error stops it (the records
/// before it are done).
pub fn rotate_kek_on<B: Backend + ?Sized>(
    b: &B,
    old: &KeySource,
    new: &KeySource,
) -> Result<KekRotation> {
    let mut done = KekRotation::default();
    for volume in b.encrypted_volume_ids()? {
        let before = b.volume_keys(&volume)?;
        done.step(volume.clone(), &volume, &before, (old, new), |after| {
            b.write_volume_keys(&volume, &before, after)
        })?;
    }
    for (snapshot, source, wrapped) in encrypted_snapshots(b)? {
        let before = RecordKeys::of_context(&wrapped);
        done.step(snapshot.clone(), &source, &before, (old, new), |after| {
            b.write_snapshot_key(&snapshot, &wrapped, &after.current)
        })?;
    }
    Ok(done)
}

/// Sets the annotation's schedule of `volume` (`None`: none, its class's applies), durably;
/// whether the record changed. A schedule that is not a period: INVALID_ARGUMENT, nothing
/// written.
pub fn set_schedule_on<B: Backend + ?Sized>(
    b: &B,
    volume: &str,
    schedule: Option<&str>,
) -> Result<bool> {
    if let Some(s) = schedule {
        moor_runtime::keys::schedule::period(s).map_err(|why| {
            Error::invalid("schedule", format!("{:?}: {why}", crate::error::trunc(s)))
        })?;
    }
    let before = b.volume_keys(volume)?;
    if before.schedule.as_deref() == schedule {
        return Ok(false);
    }
    let after = RecordKeys {
        schedule: schedule.map(str::to_owned),
        ..before.clone()
    };
    b.write_volume_keys(volume, &before, &after)?;
    Ok(true)
}

#[cfg(test)]
#[path = "rotation_tests.rs"]
mod tests;
