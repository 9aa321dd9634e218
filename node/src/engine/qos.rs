//! A volume's QoS limits on the node: at NodePublishVolume, a throttling rule for the
//! volume's block device in the cgroup of the pod it is published to; at NodeUnpublishVolume,
//! the rule taken out again if the pod's cgroup is still there (it dies with the pod).
//!
//! The limits come from the controller (`publish_context`, else the `volume_context` of
//! creation: see `validate`). The pod is the one kubelet names (`csi.storage.k8s.io/pod.uid`,
//! with `podInfoOnMount`), else the one of the target path (`pods/<uid>/volumes/...`,
//! `volumeDevices/publish/<pv>/<uid>`). Its cgroup is found where kubelet makes it, under the
//! cgroup root moor-node sees (`--cgroup-root`): cgroup v2 (`io.max`) or v1 blkio
//! (`blkio.throttle.*_device`), kubelet's cgroupfs or systemd driver.
//!
//! A limit that cannot be applied (no pod, no cgroup, no io controller, a file that cannot be
//! written) leaves the publication working: a warning, the metric `moor_qos_total` and the
//! volume's health entry `QosNotApplied` say so. A limit the kernel refuses (EINVAL) fails the
//! publication with INVALID_ARGUMENT, since it is the limit itself that is wrong.
//!
//! An unpublish looks for a rule to take out (the hierarchy, then the pod's cgroup under each
//! of kubelet's layouts: about 0.3 ms, docs/performance.md) unless this process made the
//! publication itself without limits ([`QosKnown`]). That knowledge is in memory, not in the
//! journal: what a restart or a crash forgets falls back to the search, which is right for any
//! publication, while a journal field would either be written on every record (which the last
//! release refuses to read: a downgrade would stop) or only for limits (and then read the
//! last release's limited publications as unlimited, leaving their rules behind).

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use moor_runtime::contract::{QOS_LIMITS_FIELD, QosLimits};
use tracing::{debug, info, warn};

use super::stats::{Condition, Health};
use super::{Engine, Publish, Unpublish};
use crate::error::{Error, Result};
use crate::sys::Os;

/// The health entry of a publication whose limits are not in force.
pub const QOS_NOT_APPLIED: &str = "QosNotApplied";

/// What became of a publication's limits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum QosOutcome {
    /// The volume has no limit: nothing was written.
    Unlimited,
    /// The rule is in the pod's cgroup, in this directory.
    Applied(PathBuf),
    /// Not applied: why (a metric label) and what, for humans.
    NotApplied {
        /// `no_pod`, `no_cgroupfs`, `no_io_controller`, `no_pod_cgroup`, `not_written`,
        /// `not_held`.
        reason: &'static str,
        /// What happened.
        message: String,
    },
}

impl QosOutcome {
    /// The metric's label.
    pub fn label(&self) -> &'static str {
        match self {
            QosOutcome::Unlimited => "unlimited",
            QosOutcome::Applied(_) => "applied",
            QosOutcome::NotApplied { reason, .. } => reason,
        }
    }
}

/// A cgroup hierarchy that throttles block I/O.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Hierarchy {
    /// cgroup v2 with the io controller, mounted here.
    V2(PathBuf),
    /// cgroup v1's blkio controller, mounted here.
    V1(PathBuf),
}

/// cgroup v1's four throttling files, in [`QosLimits`]' order.
const V1_FILES: [&str; 4] = [
    "blkio.throttle.read_bps_device",
    "blkio.throttle.write_bps_device",
    "blkio.throttle.read_iops_device",
    "blkio.throttle.write_iops_device",
];
/// cgroup v2's keys of `io.max`, in [`QosLimits`]' order.
const V2_KEYS: [&str; 4] = ["rbps", "wbps", "riops", "wiops"];
/// cgroup v2's file.
const V2_FILE: &str = "io.max";

fn not_applied(reason: &'static str, message: String) -> QosOutcome {
    QosOutcome::NotApplied { reason, message }
}

/// Where kubelet makes the cgroup of pod `uid`, below a hierarchy's root: its cgroupfs driver
/// (`kubepods[/burstable|/besteffort]/pod<uid>`) and its systemd driver
/// (`kubepods.slice[/kubepods-<qos>.slice]/kubepods[-<qos>]-pod<uid with _>.slice`).
fn pod_dirs(uid: &str) -> Vec<PathBuf> {
    let u = uid.replace('-', "_");
    let mut dirs = vec![PathBuf::from(format!("kubepods/pod{uid}"))];
    for qos in ["burstable", "besteffort"] {
        dirs.push(PathBuf::from(format!("kubepods/{qos}/pod{uid}")));
    }
    dirs.push(PathBuf::from(format!(
        "kubepods.slice/kubepods-pod{u}.slice"
    )));
    for qos in ["burstable", "besteffort"] {
        dirs.push(PathBuf::from(format!(
            "kubepods.slice/kubepods-{qos}.slice/kubepods-{qos}-pod{u}.slice"
        )));
    }
    dirs
}

/// The pod UID in a kubelet target path: `pods/<uid>/volumes/...` (a mount) or
/// `plugins/kubernetes.io/csi/volumeDevices/publish/<pv>/<uid>` (a block volume).
pub fn pod_uid_of_target(kubelet_dir: &Path, target: &Path) -> Option<String> {
    let rel = target.strip_prefix(kubelet_dir).ok()?;
    let parts: Vec<&str> = rel.iter().map(|c| c.to_str()).collect::<Option<_>>()?;
    let uid = match parts.as_slice() {
        ["pods", uid, "volumes", ..] => *uid,
        [
            "plugins",
            "kubernetes.io",
            "csi",
            "volumeDevices",
            "publish",
            _pv,
            uid,
        ] => *uid,
        _ => return None,
    };
    is_pod_uid(uid).then(|| uid.to_string())
}

/// Whether `s` can be a pod's UID (and so a part of a cgroup's name): letters, digits and
/// dashes, 1 to 64 of them.
pub fn is_pod_uid(s: &str) -> bool {
    !s.is_empty() && s.len() <= 64 && s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
}

/// The limits one control file's text holds for device `dev`. v2 (`io.max`): lines
/// `MAJ:MIN rbps=.. wbps=.. riops=.. wiops=..`, `max` for none; v1: lines `MAJ:MIN N`, the
/// device absent for none (`v1_slot` says which limit the file holds).
fn held(
    text: &str,
    dev: (u32, u32),
    v1_slot: Option<usize>,
) -> std::result::Result<QosLimits, String> {
    let mut limits: QosLimits = [None; 4];
    let want = format!("{}:{}", dev.0, dev.1);
    for line in text.lines() {
        let mut words = line.split_whitespace();
        if words.next() != Some(want.as_str()) {
            continue;
        }
        match v1_slot {
            Some(slot) => {
                let n = words
                    .next()
                    .and_then(|w| w.parse::<u64>().ok())
                    .ok_or_else(|| format!("unreadable line {line:?}"))?;
                if let Some(s) = limits.get_mut(slot) {
                    *s = Some(n);
                }
            }
            None => {
                for word in words {
                    let Some((key, value)) = word.split_once('=') else {
                        return Err(format!("unreadable line {line:?}"));
                    };
                    let Some(slot) = V2_KEYS.iter().position(|k| *k == key) else {
                        continue; // another key of io.max's (a latency target): not ours
                    };
                    let v = match value {
                        "max" => None,
                        n => Some(
                            n.parse::<u64>()
                                .map_err(|_| format!("unreadable line {line:?}"))?,
                        ),
                    };
                    if let Some(s) = limits.get_mut(slot) {
                        *s = v;
                    }
                }
            }
        }
    }
    Ok(limits)
}

impl Hierarchy {
    /// The file whose presence shows a cgroup of this hierarchy that can throttle.
    fn probe(&self) -> &'static str {
        match self {
            Hierarchy::V2(_) => V2_FILE,
            Hierarchy::V1(_) => V1_FILES[0],
        }
    }

    fn root(&self) -> &Path {
        match self {
            Hierarchy::V2(p) | Hierarchy::V1(p) => p,
        }
    }

    /// The writes that give device `dev` the limits `limits` (none: no rule), as (file, line).
    fn writes(&self, dev: (u32, u32), limits: &QosLimits) -> Vec<(&'static str, String)> {
        let (major, minor) = dev;
        match self {
            Hierarchy::V2(_) => {
                let words: Vec<String> = V2_KEYS
                    .iter()
                    .zip(limits)
                    .map(|(k, v)| match v {
                        Some(n) => format!("{k}={n}"),
                        None => format!("{k}=max"),
                    })
                    .collect();
                vec![(V2_FILE, format!("{major}:{minor} {}", words.join(" ")))]
            }
            // v1 takes 0 as "no rule".
            Hierarchy::V1(_) => V1_FILES
                .iter()
                .zip(limits)
                .map(|(f, v)| (*f, format!("{major}:{minor} {}", v.unwrap_or(0))))
                .collect(),
        }
    }
}

/// The throttling hierarchy under `root`: cgroup v2 when the root is one (with the io
/// controller, or why not), else v1's blkio at `root/blkio`.
fn hierarchy<O: Os + ?Sized>(os: &O, root: &Path) -> std::result::Result<Hierarchy, QosOutcome> {
    match os.read_cgroup(&root.join("cgroup.controllers")) {
        Ok(text) if text.split_whitespace().any(|c| c == "io") => {
            return Ok(Hierarchy::V2(root.to_path_buf()));
        }
        Ok(text) => {
            return Err(not_applied(
                "no_io_controller",
                format!(
                    "the cgroup v2 hierarchy at {} has no io controller (it has: {})",
                    root.display(),
                    text.trim()
                ),
            ));
        }
        Err(e) if e.is_not_found() => {}
        Err(e) => return Err(not_applied("no_cgroupfs", e.to_string())),
    }
    let blkio = root.join("blkio");
    match os.read_cgroup(&blkio.join(V1_FILES[0])) {
        Ok(_) => Ok(Hierarchy::V1(blkio)),
        Err(e) => Err(not_applied(
            "no_cgroupfs",
            format!(
                "no cgroup v2 hierarchy with the io controller nor a v1 blkio one at {}: {e}",
                root.display()
            ),
        )),
    }
}

/// Each publication's limits not in force, for NodeGetVolumeHealth: (volume, target) to the
/// condition. In memory: a restart forgets it, and the next publish tells again.
#[derive(Debug, Default)]
pub(super) struct QosNotes(std::sync::Mutex<BTreeMap<(String, PathBuf), Condition>>);

impl QosNotes {
    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<(String, PathBuf), Condition>> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The conditions of a volume's publications.
    pub(super) fn of(&self, volume_id: &str) -> Vec<Condition> {
        self.lock()
            .iter()
            .filter(|((v, _), _)| v == volume_id)
            .map(|(_, c)| c.clone())
            .collect()
    }
}

/// What this process knows of each publication's limits, (volume, target) to whether it set
/// any: an unpublish searches the pod's cgroup for a rule unless the publication is known
/// here to have set none. Unknown (never published by this process, or published before a
/// restart or a crash) is searched, as is one that set limits. A publication that set limits
/// once stays limited here until its unpublish, whatever a later call for it says.
#[derive(Debug, Default)]
pub(super) struct QosKnown(std::sync::Mutex<HashMap<(String, PathBuf), bool>>);

impl QosKnown {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<(String, PathBuf), bool>> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A publication about to set limits: known limited.
    fn limited(&self, key: (String, PathBuf)) {
        self.lock().insert(key, true);
    }

    /// A publication without limits on a target that held none this process does not know of
    /// (`fresh`): known unlimited, unless it was known limited.
    fn unlimited(&self, key: (String, PathBuf), fresh: bool) {
        let mut known = self.lock();
        if fresh {
            known.entry(key).or_insert(false);
        }
    }

    /// Forgets an ended publication: whether it is known to have set no limits.
    fn take_unlimited(&self, key: &(String, PathBuf)) -> bool {
        self.lock().remove(key) == Some(false)
    }
}

impl<O: Os> Engine<O> {
    /// The cgroup of pod `uid` that can throttle, in the hierarchy under the cgroup root.
    fn pod_cgroup(&self, uid: &str) -> std::result::Result<(Hierarchy, PathBuf), QosOutcome> {
        let h = hierarchy(&*self.os, &self.cfg.cgroup_root)?;
        for dir in pod_dirs(uid) {
            let dir = h.root().join(dir);
            match self.os.read_cgroup(&dir.join(h.probe())) {
                Ok(_) => return Ok((h, dir)),
                Err(e) if e.is_not_found() => {}
                Err(e) => return Err(not_applied("no_pod_cgroup", e.to_string())),
            }
        }
        Err(not_applied(
            "no_pod_cgroup",
            format!(
                "no cgroup of pod {uid} with {} under {} (kubelet's cgroupfs and systemd \
                 layouts; with cgroup v2, its parent must enable the io controller)",
                h.probe(),
                h.root().display()
            ),
        ))
    }

    /// The pod a publication is for: kubelet's word, else its target path's.
    fn pod_of(&self, pod_uid: Option<&str>, target: &Path) -> Option<String> {
        pod_uid
            .map(str::to_string)
            .or_else(|| pod_uid_of_target(&self.cfg.kubelet_dir, target))
    }

    /// Writes device `dev`'s rule with `limits` in the pod's cgroup and reads it back.
    fn write_rule(
        &self,
        h: &Hierarchy,
        dir: &Path,
        dev: (u32, u32),
        limits: &QosLimits,
    ) -> Result<std::result::Result<(), QosOutcome>> {
        if matches!(h, Hierarchy::V1(_)) && limits.contains(&Some(0)) {
            return Err(Error::invalid(
                QOS_LIMITS_FIELD,
                "a limit of 0 cannot be set with cgroup v1's blkio, which takes 0 as no limit",
            ));
        }
        for (slot, (file, line)) in h.writes(dev, limits).into_iter().enumerate() {
            let path = dir.join(file);
            if let Err(e) = self.os.write_cgroup(&path, &line) {
                if e.errno() == Some(libc::EINVAL) {
                    return Err(Error::invalid(
                        QOS_LIMITS_FIELD,
                        format!("the kernel refuses {line:?} in {}: {e}", path.display()),
                    ));
                }
                return Ok(Err(not_applied("not_written", e.to_string())));
            }
            let v1_slot = matches!(h, Hierarchy::V1(_)).then_some(slot);
            let now = match self.os.read_cgroup(&path) {
                Ok(text) => held(&text, dev, v1_slot),
                Err(e) => Err(e.to_string()),
            };
            let wanted: QosLimits = match v1_slot {
                Some(s) => {
                    let mut w = [None; 4];
                    if let (Some(w), Some(l)) = (w.get_mut(s), limits.get(s)) {
                        *w = *l;
                    }
                    w
                }
                None => *limits,
            };
            match now {
                Ok(now) if now == wanted => {}
                Ok(now) => {
                    return Ok(Err(not_applied(
                        "not_held",
                        format!(
                            "{} holds {now:?} for {}:{} after {line:?} was written",
                            path.display(),
                            dev.0,
                            dev.1
                        ),
                    )));
                }
                Err(why) => {
                    return Ok(Err(not_applied(
                        "not_held",
                        format!("reading {} back: {why}", path.display()),
                    )));
                }
            }
        }
        Ok(Ok(()))
    }

    /// Applies the publication's limits to device `dev` in its pod's cgroup. Err only for a
    /// limit the kernel refuses. `fresh`: the target holds no publication of the volume's
    /// record (one this process may not have made).
    pub(super) fn apply_qos(
        &self,
        req: &Publish,
        dev: (u32, u32),
        fresh: bool,
    ) -> Result<QosOutcome> {
        let key = (req.volume_id.clone(), req.target.clone());
        if req.limits == [None; 4] {
            self.qos_notes.lock().remove(&key);
            self.qos_known.unlimited(key, fresh);
            return Ok(QosOutcome::Unlimited);
        }
        // Before any rule is written: an unpublish must look for it.
        self.qos_known.limited(key.clone());
        let outcome = match self.pod_of(req.pod_uid.as_deref(), &req.target) {
            None => not_applied(
                "no_pod",
                format!(
                    "no pod UID: kubelet gave none (podInfoOnMount) and {} is not a pod's path",
                    req.target.display()
                ),
            ),
            Some(uid) => match self.pod_cgroup(&uid) {
                Err(o) => o,
                Ok((h, dir)) => match self.write_rule(&h, &dir, dev, &req.limits)? {
                    Ok(()) => QosOutcome::Applied(dir),
                    Err(o) => o,
                },
            },
        };
        match &outcome {
            QosOutcome::NotApplied { message, .. } => {
                warn!(volume = req.volume_id, target = %req.target.display(), %message,
                    "the volume's QoS limits are not applied on this node");
                self.qos_notes.lock().insert(
                    key,
                    Condition::trouble(
                        Health::Degraded,
                        QOS_NOT_APPLIED,
                        format!(
                            "the QoS limits of the publication at {} are not applied: {message}",
                            req.target.display()
                        ),
                    ),
                );
            }
            QosOutcome::Applied(dir) => {
                info!(volume = req.volume_id, cgroup = %dir.display(), dev = ?dev,
                    "QoS limits applied");
                self.qos_notes.lock().remove(&key);
            }
            QosOutcome::Unlimited => {}
        }
        Ok(outcome)
    }

    /// Takes device `dev`'s rule out of the cgroup of the pod of an ended publication, if
    /// that cgroup is still there (it dies with the pod), unless this process made the
    /// publication without limits ([`QosKnown`]). Never fails the unpublish.
    pub(super) fn remove_qos(&self, req: &Unpublish, dev: Option<(u32, u32)>) {
        let key = (req.volume_id.clone(), req.target.clone());
        self.qos_notes.lock().remove(&key);
        if self.qos_known.take_unlimited(&key) {
            return;
        }
        let (Some(dev), Some(uid)) = (dev, pod_uid_of_target(&self.cfg.kubelet_dir, &req.target))
        else {
            return;
        };
        let Ok((h, dir)) = self.pod_cgroup(&uid) else {
            return;
        };
        let text = match self.os.read_cgroup(&dir.join(h.probe())) {
            Ok(t) => t,
            Err(_) => return,
        };
        let prefix = format!("{}:{} ", dev.0, dev.1);
        let mut any = text.lines().any(|l| l.starts_with(&prefix));
        if let Hierarchy::V1(_) = h {
            any |= V1_FILES.iter().skip(1).any(|f| {
                self.os
                    .read_cgroup(&dir.join(f))
                    .is_ok_and(|t| t.lines().any(|l| l.starts_with(&prefix)))
            });
        }
        if !any {
            return;
        }
        for (file, line) in h.writes(dev, &[None; 4]) {
            let path = dir.join(file);
            match self.os.write_cgroup(&path, &line) {
                Ok(()) => {
                    debug!(volume = req.volume_id, path = %path.display(), "QoS rule removed")
                }
                Err(e) => warn!(volume = req.volume_id, error = %e,
                    "cannot remove the volume's QoS rule from its pod's cgroup"),
            }
        }
    }
}

#[cfg(test)]
#[path = "qos_tests.rs"]
mod tests;
