//! The mount engine: the CSI Node semantics, over an [`Os`] and the [`Journal`].
//!
//! Every operation takes the volume's guard (a second call on the same volume gets ABORTED),
//! writes its intent to the journal before it changes the mount table and confirms it after,
//! and decides "is this mounted, and is it ours" by statx on the one path involved (mount
//! root attribute and the kernel's unique mount id), never by reading the whole mount table.
//!
//! One operation to a file: `stage` (NodeStageVolume, NodeUnstageVolume), `publish`
//! (NodePublishVolume, NodeUnpublishVolume), `stats` (NodeGetVolumeStats) and `expand`
//! (NodeExpandVolume); `device` finds, holds and reads the volume's device, `format`
//! makes and checks the filesystem of a stage, `mapped` maps an RBD image before its
//! stage and unmaps it after its unstage, and `reboot` tells the records a power cut left
//! from before a reboot (memories) from those that hold something (claims). Here is what they
//! share: the engine, its settings, the journal record, unmounting.

mod crypt;
mod device;
mod expand;
mod format;
mod health;
mod mapped;
mod publish;
mod qos;
mod reboot;
mod request;
mod rotate;
mod stage;
mod stats;

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use crate::attach::Attacher;
use crate::error::{Error, Result};
use crate::journal::{Boot, Journal, VolumeRecord};
use crate::superblock;
use crate::sys::discovery::DEFAULT_DISCOVERY_DEADLINE;
use crate::sys::{BufPool, Held, MountPoint, MountState, Os};
use crate::volume_lock::VolumeLocks;

pub use crypt::{CRYPTSETUP, mapping_name};
pub use format::FsckOutcome;
pub use health::{StorageCondition, StorageTrouble};
pub use mapped::{STALL_BYTES, stalled};
pub use qos::{QOS_NOT_APPLIED, QosOutcome, is_pod_uid, pod_uid_of_target};
pub use reboot::VolumeCounts;
pub use request::{
    Access, Capability, Encryption, Expand, ExpandKey, HealthQuery, NodeTpm, Publish, RotateDek,
    Stage, Stats, Unpublish, Unstage,
};
pub use rotate::{RotateReport, SLOT_SPARE, SLOT_VOLUME};
pub use stage::{GROW_MIN, StageReport};
pub use stats::{Condition, Health, VolumeStats};

/// How many stacked mounts an unmount peels off before giving up.
const MAX_STACKED: usize = 16;
/// Retries of an unmount that fails with EBUSY (2 ms doubling: about half a second in all).
const UNMOUNT_BUSY_RETRIES: u32 = 8;
/// The access mode of a record adopted from the mount table (the journal had lost it): the
/// next request's capability is taken as the volume's.
pub const ADOPTED_MODE: i32 = 0;

/// Engine settings.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// The kubelet dir; every path lies below it.
    pub kubelet_dir: PathBuf,
    /// Most volumes staged at once (0: no limit).
    pub max_volumes: u64,
    /// Deadline for mkfs.
    pub mkfs_deadline: Duration,
    /// Deadline for resize tools.
    pub resize_deadline: Duration,
    /// How long NodeStageVolume waits for the volume's device to appear.
    pub discovery_deadline: Duration,
    /// Run e2fsck before every read-write mount of an ext filesystem, also when its metadata
    /// shows e2fsck would pass it as clean without checking it.
    pub e2fsck_always: bool,
    /// The node's boot, stamped on the records of mounts and mappings (unknown: every record
    /// is taken as this boot's).
    pub boot: Boot,
    /// Where the cgroup hierarchies are mounted (the host's, as moor-node sees them), for a
    /// volume's QoS limits in its pod's cgroup.
    pub cgroup_root: PathBuf,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            kubelet_dir: PathBuf::from("/var/lib/kubelet"),
            max_volumes: 0,
            mkfs_deadline: Duration::from_secs(600),
            resize_deadline: Duration::from_secs(600),
            discovery_deadline: DEFAULT_DISCOVERY_DEADLINE,
            e2fsck_always: false,
            boot: Boot::default(),
            cgroup_root: PathBuf::from("/sys/fs/cgroup"),
        }
    }
}

/// The node engine.
#[derive(Debug)]
pub struct Engine<O: Os> {
    os: Arc<O>,
    journal: Arc<Journal>,
    locks: VolumeLocks,
    cfg: EngineConfig,
    /// The buffer a device probe reads its windows into, kept between probes.
    probe_bufs: BufPool,
    /// What maps RBD images, when the node has one (`mapped`).
    attacher: Option<Arc<dyn Attacher>>,
    /// Mount points whose unmount ran past its deadline and is still blocked in the kernel.
    unmounting: Arc<Mutex<HashSet<PathBuf>>>,
    /// Each volume's last failed stage, for NodeGetVolumeHealth (`health`).
    stage_failures: health::StageFailures,
    /// Each publication whose QoS limits are not in force (`qos`).
    qos_notes: qos::QosNotes,
    /// Each publication this process knows to have set limits or none (`qos`).
    qos_known: qos::QosKnown,
}

impl<O: Os> Engine<O> {
    /// Builds an engine.
    pub fn new(os: Arc<O>, journal: Arc<Journal>, cfg: EngineConfig) -> Self {
        Self {
            os,
            journal,
            locks: VolumeLocks::default(),
            cfg,
            probe_bufs: BufPool::new(superblock::HEAD_LEN + superblock::TAIL_LEN, 1),
            attacher: None,
            unmounting: Arc::default(),
            stage_failures: health::StageFailures::default(),
            qos_notes: qos::QosNotes::default(),
            qos_known: qos::QosKnown::default(),
        }
    }

    /// The engine, mapping RBD images with `attacher`.
    #[must_use]
    pub fn with_attacher(mut self, attacher: Option<Arc<dyn Attacher>>) -> Self {
        self.attacher = attacher;
        self
    }

    /// The settings.
    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    /// The OS layer.
    pub fn os(&self) -> &Arc<O> {
        &self.os
    }

    /// The journal.
    pub fn journal(&self) -> &Arc<Journal> {
        &self.journal
    }

    /// The per-volume guards.
    pub fn locks(&self) -> &VolumeLocks {
        &self.locks
    }

    fn record(&self, volume_id: &str) -> VolumeRecord {
        self.journal
            .get(volume_id)
            .unwrap_or_else(|| VolumeRecord::new(volume_id))
    }

    /// Unmounts everything stacked on `path` that `is_ours` accepts, and a corrupted mount,
    /// each unmount within `deadline` when one is given (a filesystem on a network device,
    /// whose unmount writes back and waits for its cluster: see
    /// [`unmount_within`](Self::unmount_within)).
    pub(crate) fn unmount_all_within(
        &self,
        path: &Path,
        is_ours: impl Fn(&MountPoint) -> bool,
        deadline: Option<Duration>,
    ) -> Result<()> {
        let parent = self.os.hold_parent(path)?.map(Arc::new);
        self.unmount_all_in(path, parent.as_ref(), is_ours, deadline)
    }

    /// [`unmount_all_within`](Self::unmount_all_within) of `path`'s last component in the
    /// directory `parent` holds (see [`Held`]): each check and each unmount looks the name up
    /// in that one directory, resolved once, so a directory renamed into the path between a
    /// check and its unmount is not what is unmounted. No parent: nothing is at the path.
    pub(crate) fn unmount_all_in(
        &self,
        path: &Path,
        parent: Option<&Arc<Held>>,
        is_ours: impl Fn(&MountPoint) -> bool,
        deadline: Option<Duration>,
    ) -> Result<()> {
        self.refuse_pending_unmount(path)?;
        let Some(parent) = parent else {
            return Ok(());
        };
        for _ in 0..MAX_STACKED {
            match self.os.mount_state_in(path, parent)? {
                MountState::Mounted(mp) if is_ours(&mp) => match deadline {
                    Some(d) => self.unmount_within(path, parent, d)?,
                    None => self.unmount_busy_retry(path, parent)?,
                },
                MountState::Corrupted { .. } => self.os.unmount_held(path, true, Some(parent))?,
                MountState::Mounted(_) | MountState::Absent | MountState::NotMounted { .. } => {
                    return Ok(());
                }
            }
        }
        Err(Error::FailedPrecondition(format!(
            "{} still has mounts after {MAX_STACKED} unmounts",
            path.display()
        )))
    }

    /// ABORTED while an earlier unmount of `path` that went past its deadline still runs.
    fn refuse_pending_unmount(&self, path: &Path) -> Result<()> {
        if self
            .unmounting
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .contains(path)
        {
            return Err(Error::OperationPending(format!(
                "an earlier unmount of {} is still running: the filesystem is writing back to \
                 a device that does not answer; retry later",
                path.display()
            )));
        }
        Ok(())
    }

    /// Unmounts `path` in `parent`, retrying a short while on EBUSY: a tool this daemon just
    /// forked for another volume briefly holds copies of its descriptors, which pin the mount
    /// until it execs. A mount that stays busy (a process really uses it) fails with the error.
    fn unmount_busy_retry(&self, path: &Path, parent: &Held) -> Result<()> {
        unmount_busy_retry(self.os.as_ref(), path, parent).map_err(Error::from)
    }

    /// Unmounts `path` (as [`unmount_busy_retry`](Self::unmount_busy_retry)) on a thread of
    /// its own, and answers by `deadline`: an unmount writes the filesystem's dirty data back
    /// first, and on a network device whose cluster does not answer that waits as long as
    /// the cluster is away (the kernel's RBD client retries forever without
    /// `osd_request_timeout`). Past the deadline the call is DEADLINE_EXCEEDED and the unmount
    /// goes on; until it ends, every unmount of the path is ABORTED (kubelet retries), and
    /// once it has, a retry finds the path unmounted and finishes. Nothing is forced: what
    /// the filesystem holds reaches the device when the cluster is back.
    fn unmount_within(&self, path: &Path, parent: &Arc<Held>, deadline: Duration) -> Result<()> {
        let key = path.to_path_buf();
        if !self
            .unmounting
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(key.clone())
        {
            return Err(Error::OperationPending(format!(
                "an earlier unmount of {} is still running; retry later",
                path.display()
            )));
        }
        let (tx, rx) = mpsc::channel();
        let os = Arc::clone(&self.os);
        let unmounting = Arc::clone(&self.unmounting);
        let parent = Arc::clone(parent);
        let spawned = std::thread::Builder::new()
            .name("moor-unmount".into())
            .spawn(move || {
                let outcome = unmount_busy_retry(os.as_ref(), &key, &parent);
                unmounting
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .remove(&key);
                let _ = tx.send(outcome);
            });
        if let Err(e) = spawned {
            self.unmounting
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .remove(path);
            return Err(Error::Unavailable(format!(
                "cannot start the unmount of {}: {e}",
                path.display()
            )));
        }
        match rx.recv_timeout(deadline) {
            Ok(outcome) => outcome.map_err(Error::from),
            Err(RecvTimeoutError::Timeout) => Err(Error::UnmountTimeout {
                path: path.to_path_buf(),
                deadline,
            }),
            Err(RecvTimeoutError::Disconnected) => Err(Error::Unavailable(format!(
                "the unmount of {} ended without an answer",
                path.display()
            ))),
        }
    }

    /// Whether the journal has a volume other than `volume_id` staged or published at `path`
    /// (a memory of one from before a reboot holds nothing). Without a record of its own at a
    /// path, a volume's call is taken at the CO's word (the journal may be new); this keeps
    /// that word from reaching another volume's mounts.
    fn held_by_another(&self, volume_id: &str, path: &Path) -> bool {
        self.journal.all().iter().any(|r| {
            r.volume_id != volume_id
                && (r
                    .stage
                    .as_ref()
                    .is_some_and(|s| s.path == path && !self.stage_is_memory(s))
                    || r.publishes
                        .get(path)
                        .is_some_and(|p| !self.publish_is_memory(path, p)))
        })
    }
}

/// umount2 of `path`'s last component in the directory `parent` holds, retried a short while
/// on EBUSY (see `Engine::unmount_busy_retry`).
fn unmount_busy_retry<O: Os>(os: &O, path: &Path, parent: &Held) -> crate::sys::SysResult<()> {
    let mut pause = Duration::from_millis(2);
    for attempt in 0.. {
        match os.unmount_held(path, false, Some(parent)) {
            Err(e) if e.errno() == Some(libc::EBUSY) && attempt < UNMOUNT_BUSY_RETRIES => {
                std::thread::sleep(pause);
                pause *= 2;
            }
            other => return other,
        }
    }
    Ok(())
}
