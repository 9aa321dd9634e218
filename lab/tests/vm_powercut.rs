//! Real power cuts: guests of the VM lab whose disks are files on the host, cut off at a
//! random instant while moor-node works, then booted again on the same files.
//!
//! Each guest has a state disk (ext4, made once; moor-node's state dir is on it) and four
//! volume disks attached at boot as virtio disks with serials, which NodeStageVolume finds by
//! `deviceSerial` alone. The kubelet dir is a host dir shared into the guest, so it survives a
//! cut as a node's root disk does. A round: a pod-like writer in the guest appends sequence
//! numbers to a file on volume 0 (published for good), `fsync`ing each, and after each fsync
//! returns it notes the number in a host dir (a note a cut loses only under-counts); meanwhile
//! the host, as kubelet, stages, publishes, unpublishes and unstages the other volumes, and
//! moves a published one to another pod (the pod replaced: unpublished at its target, published
//! at the new pod's, staged all along). Every volume is SINGLE_NODE_WRITER, and moor-node takes
//! three volumes (`--max-volumes`), which kubelet never exceeds. At a random instant the
//! guest's QEMU is SIGKILLed. It boots again on the same disk files, the state disk is mounted
//! (ext4 recovers its journal), moor-node starts (reconciliation runs), and kubelet's calls are
//! replayed as kubelet makes them after a reboot: unpublish and unstage of what a call left
//! uncertain (in flight at the cut) and kubelet no longer wants, then stage and publish of
//! every volume it wants, at its pod's target, each retried until it succeeds. A publication
//! or a staging whose end was answered before the cut gets no call: kubelet is done with it,
//! though the cut may have taken moor-node's record of its end (which then comes back as a
//! memory, holding nothing: docs/durability.md). Then:
//! every sequence number the writer noted is in its file, in order (each round's file, all
//! of them, every round); no volume was formatted twice (moor-node's log over all boots, and
//! the filesystem UUID on the host's disk file, which never changes once made); each staging
//! path and each target is mounted exactly once, from its own disk, and nothing else is
//! mounted under the kubelet dir; the pod's writes went to the volume, never to the kubelet
//! dir under it; moor-node's log has no error and finds no damage in its journal (appends a
//! cut tore after the last fdatasync, cut short or zeros where ext4 had grown the file's size
//! before writing its page, are where the log ends, not damage). That boot is the next
//! round's node.
//!
//! What a QEMU kill models: the guest's memory is lost (its page cache, moor-node, the
//! writes it had not yet handed to its disks), as in a power cut. What it does not: the disks
//! are QEMU's files on the host (`cache=unsafe`: the guest sees a volatile write cache and
//! flushes it, QEMU leaves the writes to the host's page cache), and the host's page cache
//! survives a QEMU kill, so every write that reached QEMU, flushed or not, is kept. A disk
//! losing its unflushed writes is what `vm_crash.rs` covers (dm-log-writes replay).
//!
//! The rounds run on two guests side by side. `MOOR_VM_POWERCUT_ROUNDS` sets the rounds in
//! all (default 20; a soak run takes more), `MOOR_VM_POWERCUT_SEED` replays a run's seed (the
//! cut instants and kubelet's choices; the guests' timing is not replayed). Runs beside the Ceph
//! test cluster (the guests' agents reach the host over its bridge); skipped, with the reason,
//! without it or without the lab.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use moor_lab::ceph::publish;
use moor_lab::krbd_lab::{Lab, formats_in, start_node_in};
use moor_lab::vm::{Rng, Vm};
use moor_privileged::requests::{unpublish_req, unstage_req};
use moor_privileged::runtime;
use moor_proto::csi::v1 as csi;
use moor_proto::csi::v1::volume_capability::access_mode::Mode;
use moor_runtime::contract::DEVICE_SERIAL_KEY;
use tonic::transport::Channel;

type Node = csi::node_client::NodeClient<Channel>;

const MIB: u64 = 1 << 20;
const GUESTS: usize = 2;
const VOLUMES: usize = 4;
/// moor-node's `--max-volumes`: the pod's volume and two others.
const MAX_VOLUMES: usize = 3;
/// The pods a volume may be published for, each at a target of its own.
const PODS: usize = 2;
/// The volume the pod writes to; published in every round, for pod 0.
const POD: usize = 0;
const DISK_MIB: u64 = 64;
const STATE_SERIAL: &str = "pc-state";
/// The latest cut, after the writer's first fsync of the round.
const MAX_CUT_MS: u64 = 4000;
/// How long a kubelet call may keep failing before the test gives up.
const CONVERGE: Duration = Duration::from_secs(300);

fn vol(v: usize) -> String {
    format!("vol-{v}")
}

/// Every volume's capability: ext4, one read-write target.
fn snw() -> csi::VolumeCapability {
    moor_privileged::fs_cap("ext4", Mode::SingleNodeWriter)
}

fn serial(v: usize) -> String {
    format!("pc-vol-{v}")
}

/// The QEMU arguments of a guest: its disks, made as files under `dir` (the state disk an
/// empty ext4).
fn disks(dir: &Path) -> Vec<String> {
    std::fs::create_dir_all(dir).expect("disks dir");
    let mut opts = Vec::new();
    let serials = std::iter::once(STATE_SERIAL.to_string()).chain((0..VOLUMES).map(serial));
    for (k, s) in serials.enumerate() {
        let file = dir.join(format!("{s}.img"));
        std::fs::File::create(&file)
            .and_then(|f| f.set_len(DISK_MIB * MIB))
            .expect("disk file");
        if k == 0 {
            let out = std::process::Command::new("mkfs.ext4")
                .args(["-q", "-F"])
                .arg(&file)
                .output()
                .expect("mkfs.ext4");
            assert!(out.status.success(), "mkfs.ext4 of the state disk: {out:?}");
        }
        opts.push("-drive".into());
        opts.push(format!(
            "file={},if=none,id=pcd{k},format=raw,cache=unsafe",
            file.display()
        ));
        opts.push("-device".into());
        opts.push(format!("virtio-blk-pci,drive=pcd{k},serial={s}"));
    }
    opts
}

/// What kubelet believes of a volume on the node: a stage or publish in flight counts as done
/// (kubelet treats an uncertain mount as mounted), an unpublish or unstage only once answered.
#[derive(Debug, Clone, Copy, Default)]
struct Actual {
    staged: bool,
    /// The pod it is published for.
    published: Option<usize>,
}

/// kubelet's state of the world: what it wants of each volume (the pod it is published for;
/// None: unstaged), noted before its calls, and what it believes is there.
#[derive(Debug, Clone)]
struct Kube {
    wanted: Vec<Option<usize>>,
    actual: Vec<Actual>,
}

/// What kubelet does next to a volume.
#[derive(Debug, Clone, Copy)]
enum Plan {
    /// Stage it and publish it for a pod.
    Mount(usize),
    /// The pod replaced: unpublished for one, published for the other.
    Move(usize, usize),
    /// Unpublish it for its pod and unstage it.
    Unmount(usize),
}

/// A guest and what the test knows of it.
struct Guest {
    g: usize,
    vm: Vm,
    name: String,
    /// A host dir it writes through: moor-node's log, the writer's notes.
    notes: PathBuf,
    kubelet: PathBuf,
    staging: Vec<PathBuf>,
    /// Each volume's target for each pod.
    target: Vec<[PathBuf; PODS]>,
    disks: Vec<PathBuf>,
    kube: Arc<Mutex<Kube>>,
    /// Per round, the last sequence number the writer noted as fsynced.
    synced: Vec<u64>,
    /// Each volume's filesystem UUID once made.
    uuids: Vec<Option<String>>,
    /// Where this boot's moor-node log starts in the log file.
    log_from: usize,
    /// Journal lines a cut tore, over all boots.
    torn: usize,
    /// Records of a publication, and of a staging, whose end kubelet was answered before a
    /// cut and which came back after it (moor-node's log at start), over all boots.
    ghosts: [usize; 2],
}

impl Guest {
    fn log(&self) -> String {
        std::fs::read_to_string(self.notes.join("node.log")).unwrap_or_default()
    }

    fn stage(&self, v: usize) -> csi::NodeStageVolumeRequest {
        csi::NodeStageVolumeRequest {
            volume_id: vol(v),
            publish_context: HashMap::from([(DEVICE_SERIAL_KEY.into(), serial(v))]),
            staging_target_path: self.staging[v].display().to_string(),
            volume_capability: Some(snw()),
            ..Default::default()
        }
    }

    fn publish(&self, v: usize, pod: usize) -> csi::NodePublishVolumeRequest {
        publish(&vol(v), &self.staging[v], &self.target[v][pod], snw())
    }

    fn unpublish(&self, v: usize, pod: usize) -> csi::NodeUnpublishVolumeRequest {
        unpublish_req(&vol(v), &self.target[v][pod])
    }

    fn record(&self, round: usize) -> PathBuf {
        self.notes.join(format!("synced-{round}"))
    }

    /// The last number the writer of `round` noted (its last whole line).
    fn noted(&self, round: usize) -> u64 {
        let text = std::fs::read_to_string(self.record(round)).unwrap_or_default();
        text.split_terminator('\n')
            .rfind(|l| !l.is_empty())
            .filter(|_| text.ends_with('\n'))
            .and_then(|l| l.parse().ok())
            .unwrap_or(0)
    }

    fn seq_file(&self, round: usize) -> String {
        self.target[POD][0]
            .join(format!("seq-{round}"))
            .display()
            .to_string()
    }

    /// After a boot: mounts the state disk and starts moor-node on it (whose kernel RBD
    /// attacher wants the module loaded).
    async fn start_node(&mut self) -> Node {
        self.vm.sh(&format!(
            "modprobe rbd && for d in /sys/block/vd*; do [ \"$(cat $d/serial)\" = {STATE_SERIAL} ] && \
             dev=/dev/${{d##*/}}; done; mkdir -p /run/state && mount \"$dev\" /run/state && \
             mkdir -p /run/state/moor"
        ));
        self.log_from = self.log().len();
        start_node_in(
            &self.vm,
            &self.name,
            &self.kubelet,
            "moor-node",
            &[
                "MOOR_DEVICE_WAIT=60",
                &format!("MOOR_MAX_VOLUMES={MAX_VOLUMES}"),
            ],
            Path::new("/run/state/moor"),
            &self.notes.join("node.log"),
        )
        .await
    }

    /// kubelet after the node's reboot: what a call left uncertain and kubelet no longer wants
    /// unpublished and unstaged, then every volume it wants staged and published for its pod,
    /// each call retried until it succeeds. What kubelet had been answered done gets no call.
    async fn converge(&self, node: &mut Node) {
        let Kube { wanted, actual } = self.kube.lock().expect("kube").clone();
        for (v, (want, was)) in wanted.iter().zip(&actual).enumerate() {
            if let Some(q) = was.published.filter(|q| *want != Some(*q)) {
                retry(self, "NodeUnpublishVolume", v, || {
                    let mut n = node.clone();
                    let r = self.unpublish(v, q);
                    async move { n.node_unpublish_volume(r).await.map(drop) }
                })
                .await;
            }
            if want.is_none() && was.staged {
                retry(self, "NodeUnstageVolume", v, || {
                    let mut n = node.clone();
                    let r = unstage_req(&vol(v), &self.staging[v]);
                    async move { n.node_unstage_volume(r).await.map(drop) }
                })
                .await;
            }
        }
        for (v, want) in wanted.iter().enumerate() {
            let Some(pod) = *want else { continue };
            retry(self, "NodeStageVolume", v, || {
                let mut n = node.clone();
                let r = self.stage(v);
                async move { n.node_stage_volume(r).await.map(drop) }
            })
            .await;
            retry(self, "NodePublishVolume", v, || {
                let mut n = node.clone();
                let r = self.publish(v, pod);
                async move { n.node_publish_volume(r).await.map(drop) }
            })
            .await;
        }
        let mut k = self.kube.lock().expect("kube");
        k.actual = wanted
            .iter()
            .map(|w| Actual {
                staged: w.is_some(),
                published: *w,
            })
            .collect();
    }

    /// Records moor-node found at start (this boot's log) of a publication, and of a staging,
    /// that kubelet had been answered ended before the cut (`actual`): what the cut took back
    /// in time.
    fn ghosts(&self, actual: &[Actual]) -> [usize; 2] {
        let log = self.log();
        let boot = log.get(self.log_from..).unwrap_or_default();
        let of = |l: &str, v: usize| l.contains(&format!("\"volume\":\"{}\"", vol(v)));
        let mut found = [0, 0];
        for l in boot.lines() {
            for (v, a) in actual.iter().enumerate() {
                if l.contains("forgotten") && of(l, v) {
                    found[0] += (0..PODS)
                        .filter(|&p| a.published != Some(p))
                        .filter(|&p| l.contains(&self.target[v][p].display().to_string()))
                        .count();
                }
                if l.contains("staged before the node rebooted") && of(l, v) && !a.staged {
                    found[1] += 1;
                }
            }
        }
        found
    }

    /// What must hold after kubelet's calls converged, with what was checked.
    fn check(&mut self, what: &str) -> String {
        let log = self.log();
        let wanted = self.kube.lock().expect("kube").wanted.clone();
        // Every fsynced number, in order, in each round's file.
        let mut numbers = 0;
        for (round, &synced) in self.synced.iter().enumerate() {
            let text = self.vm.read(&self.seq_file(round));
            let lines: Vec<&str> = text.lines().collect();
            for k in 1..=synced {
                assert_eq!(
                    lines.get(k as usize - 1).copied(),
                    Some(k.to_string().as_str()),
                    "{what}: round {round}'s writer fsynced 1..={synced}, but line {k} of its \
                     file is not {k} ({} lines)\n{log}",
                    lines.len()
                );
            }
            numbers += synced;
        }
        // The pod's writes went to the volume: nothing of them in the dir under its mount.
        let under: Vec<_> = std::fs::read_dir(&self.target[POD][0])
            .map(|d| d.filter_map(Result::ok).map(|e| e.file_name()).collect())
            .unwrap_or_default();
        assert!(
            under.is_empty(),
            "{what}: the pod wrote into the kubelet dir under its mount: {under:?}"
        );
        // Formatted once in the whole life: by moor-node's log, and by the UUID on the disk.
        for (v, published) in wanted.iter().map(Option::is_some).enumerate() {
            let formats = formats_in(&log, &vol(v));
            assert!(
                formats <= 1,
                "{what}: {} formatted {formats} times\n{log}",
                vol(v)
            );
            let out = std::process::Command::new("blkid")
                .args(["-p", "-s", "UUID", "-o", "value"])
                .arg(&self.disks[v])
                .output()
                .expect("blkid");
            let uuid = String::from_utf8_lossy(&out.stdout).trim().to_string();
            match &self.uuids[v] {
                Some(was) => assert_eq!(
                    &uuid,
                    was,
                    "{what}: {}'s filesystem was made again\n{log}",
                    vol(v)
                ),
                None if !uuid.is_empty() => self.uuids[v] = Some(uuid),
                None => assert!(
                    !published,
                    "{what}: {} is published with no filesystem",
                    vol(v)
                ),
            }
        }
        // Each wanted mount exactly once, from its own disk; nothing else under the kubelet dir.
        let devs: HashMap<String, String> = self
            .vm
            .sh("for d in /sys/block/vd*; do echo \"$(cat $d/serial) $(cat $d/dev)\"; done")
            .lines()
            .filter_map(|l| l.split_once(' '))
            .map(|(s, d)| (s.to_string(), d.to_string()))
            .collect();
        let mountinfo = self.vm.read("/proc/self/mountinfo");
        let mounts: Vec<(&str, &str)> = mountinfo
            .lines()
            .filter_map(|l| {
                let f: Vec<&str> = l.split(' ').collect();
                Some((*f.get(4)?, *f.get(2)?))
            })
            .collect();
        let at = |p: &Path| -> Vec<&str> {
            let p = p.display().to_string();
            mounts
                .iter()
                .filter(|(m, _)| *m == p)
                .map(|(_, d)| *d)
                .collect()
        };
        let state = at(Path::new("/run/state"));
        assert_eq!(
            state,
            [devs[STATE_SERIAL].as_str()],
            "{what}: the state disk's mounts"
        );
        let kubelet = self.kubelet.display().to_string();
        let under_kubelet = mounts
            .iter()
            .filter(|(m, _)| m.starts_with(&format!("{kubelet}/")))
            .count();
        let mut expected = 0;
        for (v, pod) in wanted.iter().enumerate() {
            let disk = vec![devs[&serial(v)].as_str()];
            let paths = std::iter::once((&self.staging[v], pod.is_some()))
                .chain((0..PODS).map(|p| (&self.target[v][p], *pod == Some(p))));
            for (p, mounted) in paths {
                let want = if mounted { disk.clone() } else { Vec::new() };
                assert_eq!(
                    at(p),
                    want,
                    "{what}: the mounts at {} ({} is {})\n{mountinfo}",
                    p.display(),
                    vol(v),
                    pod.map_or_else(|| "unstaged".into(), |p| format!("published for pod {p}"))
                );
                expected += want.len();
            }
        }
        assert_eq!(
            under_kubelet, expected,
            "{what}: mounts under the kubelet dir that no volume wants\n{mountinfo}"
        );
        // A journal moor-node reads, and no error in this boot. A cut may leave the lines
        // appended since the last fdatasync cut short, or as zeros (ext4 writes a file's size
        // and its pages back apart): moor-node's log ends before them, and says so at INFO
        // (its records were never meant to outlive a power cut: the checks above catch it if
        // one was). A line it must set aside as damage is a finding.
        let boot = log.get(self.log_from..).unwrap_or_default();
        let errors: Vec<&str> = boot
            .lines()
            .filter(|l| l.contains("\"level\":\"ERROR\""))
            .collect();
        assert!(errors.is_empty(), "{what}: moor-node failed: {errors:#?}");
        let unreadable: Vec<&str> = boot
            .lines()
            .filter(|l| l.contains("journal line unreadable"))
            .collect();
        // What was set aside, from the line before the first damaged one on (as od shows it).
        let first = unreadable
            .iter()
            .filter_map(|l| l.split("\"line\":").nth(1))
            .filter_map(|l| l.split(|c: char| !c.is_ascii_digit()).next())
            .filter_map(|n| n.parse::<usize>().ok())
            .min()
            .unwrap_or(1);
        assert!(
            unreadable.is_empty(),
            "{what}: moor-node found its journal damaged: {unreadable:#?}\n{}",
            self.vm.sh(&format!(
                "sed -n '{},$p' /run/state/moor/journal.log.corrupt | od -A d -c; \
                 wc -lc < /run/state/moor/journal.log.corrupt",
                first.saturating_sub(1).max(1)
            ))
        );
        self.torn += boot
            .lines()
            .filter(|l| l.contains("the journal ended in bytes no record reads from"))
            .count();
        format!(
            "{numbers} fsynced numbers in {} files, formats {:?}, {expected} mounts, \
             {} journals that ended in a torn append, {} ended publications and {} ended \
             stagings back after a cut so far",
            self.synced.len(),
            (0..VOLUMES)
                .map(|v| formats_in(&log, &vol(v)))
                .collect::<Vec<_>>(),
            self.torn,
            self.ghosts[0],
            self.ghosts[1]
        )
    }
}

/// Runs `call` until it succeeds, as kubelet retries, within [`CONVERGE`].
async fn retry<F, Fut>(guest: &Guest, name: &str, v: usize, call: F)
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<(), tonic::Status>>,
{
    let start = Instant::now();
    let mut last = String::new();
    loop {
        let left = CONVERGE.saturating_sub(start.elapsed());
        let e = match tokio::time::timeout(left, call()).await {
            Ok(Ok(())) => return,
            Ok(Err(e)) => format!("{e:?}"),
            // The deadline cut this attempt short: the answers before it say why.
            Err(_) if !last.is_empty() => format!("no answer in time; before that, {last}"),
            Err(_) => "no answer".to_string(),
        };
        assert!(
            start.elapsed() < CONVERGE,
            "guest {}: kubelet's {name} of {} did not succeed within {CONVERGE:?}: {e}\n{}",
            guest.g,
            vol(v),
            guest.log()
        );
        last.clone_from(&e);
        eprintln!("guest {}: {name} of {}: {e}; retried", guest.g, vol(v));
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// kubelet's work on the volumes other than the pod's, until it is cut off: one at a time, an
/// unstaged volume staged and published for a pod (while the node has room), a published one
/// moved to the other pod, or unpublished and unstaged. What it wants is noted before its
/// calls, as kubelet's desired state is, and what it believes is there as [`Actual`] says.
async fn kubelet(
    mut node: Node,
    kube: Arc<Mutex<Kube>>,
    calls: Vec<Calls>,
    mut rng: Rng,
) -> Result<(), String> {
    let set = |v: usize, f: &dyn Fn(&mut Actual)| f(&mut kube.lock().expect("kube").actual[v]);
    loop {
        let (v, plan) = {
            let mut k = kube.lock().expect("kube");
            let staged = k.wanted.iter().filter(|w| w.is_some()).count();
            let choices: Vec<usize> = (1..VOLUMES)
                .filter(|&v| staged < MAX_VOLUMES || k.wanted[v].is_some())
                .collect();
            let v = choices[rng.below(choices.len() as u64) as usize];
            let plan = match k.wanted[v] {
                None => Plan::Mount(rng.below(PODS as u64) as usize),
                Some(p) if rng.below(2) == 0 => Plan::Move(p, (p + 1) % PODS),
                Some(p) => Plan::Unmount(p),
            };
            k.wanted[v] = match plan {
                Plan::Mount(p) | Plan::Move(_, p) => Some(p),
                Plan::Unmount(_) => None,
            };
            (v, plan)
        };
        let c = calls[v].clone();
        let fail = |e: tonic::Status| format!("{} ({plan:?}): {e:?}", vol(v));
        if let Plan::Move(p, _) | Plan::Unmount(p) = plan {
            node.node_unpublish_volume(c.unpublish[p].clone())
                .await
                .map_err(fail)?;
            set(v, &|a| a.published = None);
        }
        match plan {
            Plan::Mount(p) => {
                set(v, &|a| a.staged = true);
                node.node_stage_volume(c.stage).await.map_err(fail)?;
                set(v, &|a| a.published = Some(p));
                node.node_publish_volume(c.publish[p].clone())
                    .await
                    .map_err(fail)?;
            }
            Plan::Move(_, p) => {
                set(v, &|a| a.published = Some(p));
                node.node_publish_volume(c.publish[p].clone())
                    .await
                    .map_err(fail)?;
            }
            Plan::Unmount(_) => {
                node.node_unstage_volume(c.unstage).await.map_err(fail)?;
                set(v, &|a| a.staged = false);
            }
        }
    }
}

/// kubelet's calls of a volume, for each pod.
#[derive(Clone)]
struct Calls {
    stage: csi::NodeStageVolumeRequest,
    publish: [csi::NodePublishVolumeRequest; PODS],
    unpublish: [csi::NodeUnpublishVolumeRequest; PODS],
    unstage: csi::NodeUnstageVolumeRequest,
}

impl Guest {
    fn calls(&self, v: usize) -> Calls {
        Calls {
            stage: self.stage(v),
            publish: std::array::from_fn(|p| self.publish(v, p)),
            unpublish: std::array::from_fn(|p| self.unpublish(v, p)),
            unstage: unstage_req(&vol(v), &self.staging[v]),
        }
    }

    /// The rounds of this guest, each ended by a cut; `failed` stops them when the other
    /// guest's failed.
    async fn rounds(&mut self, first: usize, rounds: usize, seed: u64, failed: &AtomicBool) {
        let g = self.g;
        let mut rng = Rng::new(seed ^ (g as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15));
        let mut node = self.start_node().await;
        self.converge(&mut node).await;
        let checked = self.check(&format!("guest {g}, first boot"));
        eprintln!("guest {g}: first boot: {checked}");
        for round in first..first + rounds {
            if failed.load(Ordering::Relaxed) {
                return;
            }
            let started = Instant::now();
            let k = round - first;
            let cut_ms = rng.below(MAX_CUT_MS);
            let what = format!("guest {g}, round {round} (seed {seed}, cut {cut_ms} ms)");
            // The pod: each number appended and fsynced, then noted.
            let script = format!(
                "i=0; while i=$((i+1)); echo $i | dd of={} oflag=append conv=notrunc,fsync \
                 status=none; do echo $i >> {}; done",
                self.seq_file(k),
                self.record(k).display()
            );
            self.synced.push(0);
            self.vm.spawn(
                &["sh", "-c", &script],
                &self
                    .notes
                    .join(format!("writer-{round}.log"))
                    .display()
                    .to_string(),
            );
            let calls: Vec<Calls> = (0..VOLUMES).map(|v| self.calls(v)).collect();
            let work = tokio::spawn(kubelet(
                node.clone(),
                Arc::clone(&self.kube),
                calls,
                Rng::new(rng.next_u64()),
            ));
            let wait = Instant::now();
            while self.noted(k) == 0 {
                assert!(
                    wait.elapsed() < Duration::from_secs(120),
                    "{what}: the writer fsynced nothing within 120 s: {}",
                    std::fs::read_to_string(self.notes.join(format!("writer-{round}.log")))
                        .unwrap_or_default()
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            // The cut, at the round's instant (its input, not a wait for anything).
            tokio::time::sleep(Duration::from_millis(cut_ms)).await;
            if work.is_finished() {
                let r = work.await.expect("kubelet's task");
                panic!(
                    "{what}: a kubelet call failed before the cut: {r:?}\n{}",
                    self.log()
                );
            }
            work.abort();
            drop(node);
            self.vm.reboot();
            let synced = self.noted(k);
            *self.synced.last_mut().expect("this round") = synced;
            let Kube { wanted, actual } = self.kube.lock().expect("kube").clone();
            node = self.start_node().await;
            let ghosts = self.ghosts(&actual);
            self.ghosts[0] += ghosts[0];
            self.ghosts[1] += ghosts[1];
            self.converge(&mut node).await;
            let lines = self.vm.read(&self.seq_file(k)).lines().count();
            let checked = self.check(&what);
            eprintln!(
                "{what}: last fsynced {synced} ({lines} lines in the file); kubelet wanted \
                 published for pods {wanted:?}, believed {actual:?}; ended before the cut and \
                 back after it: {} publications, {} stagings; checked: {checked}; {:.0} s",
                ghosts[0],
                ghosts[1],
                started.elapsed().as_secs_f64()
            );
        }
    }
}

/// Sets `failed` when the thread it lives on panics.
struct OnPanic<'a>(&'a AtomicBool);

impl Drop for OnPanic<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.store(true, Ordering::Relaxed);
        }
    }
}

#[test]
fn fsynced_writes_and_mounts_survive_real_power_cuts() {
    let test = "vm-powercut";
    let rounds: usize = std::env::var("MOOR_VM_POWERCUT_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20);
    let seed: u64 = std::env::var("MOOR_VM_POWERCUT_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64)
        });
    eprintln!(
        "{test}: {rounds} rounds on {GUESTS} guests, seed {seed} \
         (MOOR_VM_POWERCUT_SEED={seed} replays it)"
    );
    let started = Instant::now();
    let Some(mut lab) = Lab::with_qemu_opts(test, GUESTS, 120, |g, w| {
        disks(&w.sb.root.join(format!("disks-{g}")))
    }) else {
        return;
    };
    let failed = AtomicBool::new(false);
    let vms = std::mem::take(&mut lab.vms);
    let mut guests: Vec<Guest> = vms
        .into_iter()
        .enumerate()
        .map(|(g, vm)| {
            let n = &lab.world.nodes[g];
            let dir = lab.world.sb.root.join(format!("disks-{g}"));
            Guest {
                g,
                vm,
                name: n.name.clone(),
                notes: n.state.clone(),
                kubelet: n.kubelet.clone(),
                staging: (0..VOLUMES)
                    .map(|v| lab.world.staging(g, &vol(v)))
                    .collect(),
                target: (0..VOLUMES)
                    .map(|v| {
                        let first = lab.world.target(g, &vol(v));
                        let other = n.kubelet.join(format!(
                            "pods/pod-b/volumes/kubernetes.io~csi/{}/mount",
                            vol(v)
                        ));
                        std::fs::create_dir_all(other.parent().expect("parent"))
                            .expect("target parent");
                        [first, other]
                    })
                    .collect(),
                disks: (0..VOLUMES)
                    .map(|v| dir.join(format!("{}.img", serial(v))))
                    .collect(),
                kube: Arc::new(Mutex::new(Kube {
                    wanted: (0..VOLUMES).map(|v| (v == POD).then_some(0)).collect(),
                    actual: vec![Actual::default(); VOLUMES],
                })),
                synced: Vec::new(),
                uuids: vec![None; VOLUMES],
                log_from: 0,
                torn: 0,
                ghosts: [0, 0],
            }
        })
        .collect();
    std::thread::scope(|s| {
        let mut first = 0;
        for (g, guest) in guests.iter_mut().enumerate() {
            let share = rounds / GUESTS + usize::from(g < rounds % GUESTS);
            let failed = &failed;
            s.spawn(move || {
                let _flag = OnPanic(failed);
                runtime().block_on(guest.rounds(first, share, seed, failed));
            });
            first += share;
        }
    });
    eprintln!(
        "{test}: {rounds} rounds (power cuts) on {GUESTS} guests, seed {seed}, in {:.0} s",
        started.elapsed().as_secs_f64()
    );
}
