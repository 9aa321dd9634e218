//! Scheduled data key rotation (docs/encryption.md, "Scheduled rotation"): a volume whose
//! class says `keyRotationSchedule` has its data key rotated, when due, by the node where it
//! is staged, since only that node can change its LUKS key slot online. Each pass asks the
//! controller (moor's own `ControllerKeys` calls) about every encrypted volume open here, one
//! at a time, and runs what `moorctl rotate-key --controller` runs for a due one: the pending
//! key written into the controller's record (`BeginVolumeKeyRotation`), the slot steps
//! journaled here ([`Engine::rotate_dek`]), the pending key promoted
//! (`FinishVolumeKeyRotation`).
//!
//! Nothing of the schedule is kept here: the controller's record holds when the current key
//! became current and how many rotations it has finished, written durably with each step. A
//! restart anywhere therefore neither skips a rotation (the record's time does not move until
//! the promotion) nor doubles one (a pending rotation is resumed with its pending key, and
//! `Begin` is guarded by the count the pass read: a rotation finished since begins nothing).
//!
//! The key-encryption key's source comes from a directory holding its fields, one file each
//! (the `secret` source's `kek`, `kekID`, or a KMIP server's `KMIP_ENDPOINT` and the rest: a
//! Kubernetes Secret mounted as a volume), read at each rotation, never logged; a log line names the volume, the steps and the counts only.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use moor_proto::keys::v1 as keys;
use moor_proto::keys::v1::controller_keys_client::ControllerKeysClient;
use moor_runtime::keys::WrappedDek;
use moor_runtime::keys::source::KeySource;
use tonic::transport::{Channel, Endpoint};
use tracing::{info, warn};

use crate::engine::{Engine, NodeTpm, RotateDek};
use crate::journal::Phase;
use crate::sys::Os;

/// What a pass did with one volume.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Its class has no schedule.
    Unscheduled,
    /// Not due until this time (seconds since the Unix epoch).
    NotDue(u64),
    /// Rotated now (or a rotation cut short finished); the next is due at this time.
    Rotated(u64),
}

/// The scheduler of one node.
#[derive(Debug)]
pub struct KeySchedule<O: Os> {
    engine: Arc<Engine<O>>,
    controller: PathBuf,
    secrets_dir: PathBuf,
    timeout: Duration,
    /// This node's TPM, for a `tpm2` volume's node half.
    tpm: NodeTpm,
}

/// Now, in seconds since the Unix epoch.
fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// A failed call, as a pass logs it: the call, its code and message (no key: the controller
/// and the engine name none).
fn failed(call: &'static str) -> impl FnOnce(tonic::Status) -> String {
    move |s| format!("{call}: {:?}: {}", s.code(), s.message())
}

/// The `secret` source's fields in `dir`, one file each (dot files, a Secret volume's own, are
/// skipped); a field's value is the file's text without its trailing newline.
pub fn read_secrets(dir: &Path) -> Result<HashMap<String, String>, String> {
    let entries =
        std::fs::read_dir(dir).map_err(|e| format!("the secrets {}: {e}", dir.display()))?;
    let mut out = HashMap::new();
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with('.') || !entry.path().is_file() {
            continue;
        }
        // The error names the file, never its content.
        let text = std::fs::read_to_string(entry.path())
            .map_err(|e| format!("the secret {name:?} in {}: {e}", dir.display()))?;
        out.insert(name, text.trim_end_matches(['\n', '\r']).to_owned());
    }
    Ok(out)
}

impl<O: Os + 'static> KeySchedule<O> {
    /// The scheduler of `engine`'s volumes, asking the controller at `endpoint` (`unix:///path`
    /// or a path) with each call taking up to `timeout`, the KEK read from `secrets_dir`.
    pub fn new(
        engine: Arc<Engine<O>>,
        endpoint: &str,
        secrets_dir: PathBuf,
        timeout: Duration,
    ) -> Result<Self, String> {
        let controller = moor_runtime::server::parse_endpoint(endpoint)
            .map_err(|e| format!("--key-rotation-controller {endpoint}: {e}"))?;
        Ok(Self {
            engine,
            controller,
            secrets_dir,
            timeout,
            tpm: NodeTpm::from_env(),
        })
    }

    /// A `tpm2` volume's node half asked of `tpm` (the node service's, so that their calls
    /// take turns) rather than of the TPM moor-node finds.
    #[must_use]
    pub fn with_tpm(mut self, tpm: NodeTpm) -> Self {
        self.tpm = tpm;
        self
    }

    /// The encrypted volumes open on this node (every key source), by id: what
    /// [`Engine::rotate_dek`] takes (a mapping opened, not one being formatted), on a device
    /// still there.
    pub fn candidates(&self) -> Vec<String> {
        let mut ids: Vec<String> = self
            .engine
            .journal()
            .all()
            .into_iter()
            .filter(|r| {
                r.crypt
                    .as_ref()
                    .is_some_and(|c| !c.fresh && c.phase == Phase::Done && c.device.exists())
            })
            .map(|r| r.volume_id)
            .collect();
        ids.sort();
        ids
    }

    async fn client(&self) -> Result<ControllerKeysClient<Channel>, String> {
        let endpoint = Endpoint::from_static("http://moor.invalid").timeout(self.timeout);
        let channel = moor_runtime::client::connect_endpoint(endpoint, &self.controller)
            .await
            .map_err(|e| {
                format!(
                    "the controller ({}) does not answer: {e}",
                    self.controller.display()
                )
            })?;
        Ok(ControllerKeysClient::new(channel))
    }

    /// One volume: asked about, and rotated when due or when a rotation of it is pending.
    pub async fn one(&self, volume: &str) -> Result<Outcome, String> {
        let mut ck = self.client().await?;
        let k = ck
            .get_volume_key_rotation(keys::GetVolumeKeyRotationRequest {
                volume_id: volume.to_owned(),
            })
            .await
            .map_err(failed("GetVolumeKeyRotation"))?
            .into_inner();
        if k.rotation_schedule.is_empty() {
            return Ok(Outcome::Unscheduled);
        }
        let period = moor_runtime::keys::schedule::period(&k.rotation_schedule)
            .map_err(|why| format!("its keyRotationSchedule: {why}"))?
            .as_secs();
        let due = |since: u64| since.saturating_add(period);
        if k.pending_wrapped_dek.is_empty() && unix_now() < due(k.current_since_unix) {
            return Ok(Outcome::NotDue(due(k.current_since_unix)));
        }
        let secrets = read_secrets(&self.secrets_dir)?;
        let begun = ck
            .begin_volume_key_rotation(keys::BeginVolumeKeyRotationRequest {
                volume_id: volume.to_owned(),
                secrets: secrets.clone(),
                if_rotations: Some(k.rotations),
            })
            .await
            .map_err(failed("BeginVolumeKeyRotation"))?
            .into_inner();
        if begun.pending_wrapped_dek.is_empty() {
            // A rotation finished since the record was read (another run): not doubled.
            return Ok(Outcome::NotDue(due(begun.current_since_unix)));
        }
        let decode = |field: &str, text: &str| {
            WrappedDek::decode(text).map_err(|e| format!("the record's {field}: {e}"))
        };
        let kek = KeySource::for_rotation(|k| secrets.get(k).map(String::as_str))
            .map_err(|e| format!("the secrets {}: {e}", self.secrets_dir.display()))?;
        let req = RotateDek {
            volume_id: volume.to_owned(),
            kek: Arc::new(kek),
            old_wrapped: decode("current key", &begun.current_wrapped_dek)?,
            new_wrapped: decode("pending key", &begun.pending_wrapped_dek)?,
            pbkdf: begun.luks_pbkdf.clone(),
            tpm: self.tpm.clone(),
        };
        let engine = Arc::clone(&self.engine);
        let report = tokio::task::spawn_blocking(move || engine.rotate_dek(&req))
            .await
            .map_err(|e| format!("the rotation's task: {e}"))?
            .map_err(|e| format!("RotateVolumeKey: {e}"))?;
        let done = ck
            .finish_volume_key_rotation(keys::FinishVolumeKeyRotationRequest {
                volume_id: volume.to_owned(),
                new_wrapped_dek: begun.pending_wrapped_dek,
            })
            .await
            .map_err(failed("FinishVolumeKeyRotation"))?
            .into_inner();
        info!(
            volume,
            steps = ?report.ran,
            kek_id = report.kek_id,
            rotations = done.rotations,
            "data key rotated by its schedule"
        );
        Ok(Outcome::Rotated(due(done.current_since_unix)))
    }

    /// One pass over the volumes open here, one at a time; counted in the node's metrics
    /// (`moor_key_rotations_total`, `moor_key_rotation_next_due_seconds`). What each volume
    /// came to, by id (a failure as its message, logged too).
    pub async fn pass(&self) -> Vec<(String, Result<Outcome, String>)> {
        let mut done = Vec::new();
        let mut next_due: Option<u64> = None;
        for volume in self.candidates() {
            let outcome = self.one(&volume).await;
            let metrics = crate::metrics::registry();
            match &outcome {
                Ok(Outcome::Rotated(due)) => {
                    metrics.key_rotation("done");
                    next_due = Some(next_due.map_or(*due, |d| d.min(*due)));
                }
                Ok(Outcome::NotDue(due)) => next_due = Some(next_due.map_or(*due, |d| d.min(*due))),
                Ok(Outcome::Unscheduled) => {}
                Err(e) => {
                    metrics.key_rotation("failed");
                    warn!(volume, error = %e, "scheduled data key rotation failed; the next pass retries");
                }
            }
            done.push((volume, outcome));
        }
        crate::metrics::registry().set_key_rotation_next_due(next_due.unwrap_or(0));
        done
    }

    /// Runs a pass every `every`, the first at once.
    pub fn spawn_periodic(self: Arc<Self>, every: Duration) -> tokio::task::JoinHandle<()> {
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                self.pass().await;
            }
        })
    }
}
