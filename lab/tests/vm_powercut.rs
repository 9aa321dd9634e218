//! Real power cuts: guests of the VM lab whose disks are files on the host, cut off at a
//! random instant while moor-node works, then booted again on the same files.
//!
//! Each guest has a state disk (ext4, made once; moor-node's state dir is on it) and four
//! volume disks attached at boot as virtio disks with serials, which NodeStageVolume finds by
//! `deviceSerial` alone. The kubelet dir is a host dir shared into the guest, so it survives a
//! cut as a node's root disk does. A round: a pod-like writer in the guest appends sequence
//! numbers to a file on volume 0 (published for good), `fsync`ing each, and after each fsync
//! returns it notes the number in a host dir (a note a cut loses only under-counts); meanwhile
//! the host, as kubelet, stages, publishes, unpublishes and unstages the other volumes. At a
//! random instant the guest's QEMU is SIGKILLed. It boots again on the same disk files, the
//! state disk is mounted (ext4 recovers its journal), moor-node starts (reconciliation runs),
//! and kubelet's calls are replayed: stage and publish of every volume kubelet wants
//! published, unpublish and unstage of the others, each retried until it succeeds. Then:
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
use moor_privileged::requests::{cap, unpublish_req, unstage_req};
use moor_privileged::runtime;
use moor_proto::csi::v1 as csi;
use moor_runtime::contract::DEVICE_SERIAL_KEY;
use tonic::transport::Channel;

type Node = csi::node_client::NodeClient<Channel>;

const MIB: u64 = 1 << 20;
const GUESTS: usize = 2;
const VOLUMES: usize = 4;
/// The volume the pod writes to; published in every round.
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

fn serial(v: usize) -> String {
    format!("pc-vol-{v}")
}

/// The QEMU arguments of a guest: its disks, made as files under `dir` (the state disk an
/// empty ext4).
fn disks(dir: &Path) -> Vec<String> {
    std::fs::create_dir_all(dir).expect("disks dir");
    // A CPU without SVM: udev has no kvm module to load, a boot takes some 4 s less under TCG.
    let mut opts = vec!["-cpu".to_string(), "qemu64,svm=off".to_string()];
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

/// A guest and what the test knows of it.
struct Guest {
    g: usize,
    vm: Vm,
    name: String,
    /// A host dir it writes through: moor-node's log, the writer's notes.
    notes: PathBuf,
    kubelet: PathBuf,
    staging: Vec<PathBuf>,
    target: Vec<PathBuf>,
    disks: Vec<PathBuf>,
    /// What kubelet wants of each volume: published (else unstaged).
    wanted: Arc<Mutex<Vec<bool>>>,
    /// Per round, the last sequence number the writer noted as fsynced.
    synced: Vec<u64>,
    /// Each volume's filesystem UUID once made.
    uuids: Vec<Option<String>>,
    /// Where this boot's moor-node log starts in the log file.
    log_from: usize,
    /// Journal lines a cut tore, over all boots.
    torn: usize,
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
            volume_capability: Some(cap("ext4")),
            ..Default::default()
        }
    }

    fn publish(&self, v: usize) -> csi::NodePublishVolumeRequest {
        publish(&vol(v), &self.staging[v], &self.target[v], cap("ext4"))
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
        self.target[POD]
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
            &["MOOR_DEVICE_WAIT=60"],
            Path::new("/run/state/moor"),
            &self.notes.join("node.log"),
        )
        .await
    }

    /// kubelet after the node's reboot: every volume brought to what it wants, each call
    /// retried until it succeeds.
    async fn converge(&self, node: &mut Node) {
        let wanted = self.wanted.lock().expect("wanted").clone();
        for (v, published) in wanted.into_iter().enumerate() {
            if published {
                retry(self, "NodeStageVolume", v, || {
                    let mut n = node.clone();
                    let r = self.stage(v);
                    async move { n.node_stage_volume(r).await.map(drop) }
                })
                .await;
                retry(self, "NodePublishVolume", v, || {
                    let mut n = node.clone();
                    let r = self.publish(v);
                    async move { n.node_publish_volume(r).await.map(drop) }
                })
                .await;
            } else {
                retry(self, "NodeUnpublishVolume", v, || {
                    let mut n = node.clone();
                    let r = unpublish_req(&vol(v), &self.target[v]);
                    async move { n.node_unpublish_volume(r).await.map(drop) }
                })
                .await;
                retry(self, "NodeUnstageVolume", v, || {
                    let mut n = node.clone();
                    let r = unstage_req(&vol(v), &self.staging[v]);
                    async move { n.node_unstage_volume(r).await.map(drop) }
                })
                .await;
            }
        }
    }

    /// What must hold after kubelet's calls converged, with what was checked.
    fn check(&mut self, what: &str) -> String {
        let log = self.log();
        let wanted = self.wanted.lock().expect("wanted").clone();
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
        let under: Vec<_> = std::fs::read_dir(&self.target[POD])
            .map(|d| d.filter_map(Result::ok).map(|e| e.file_name()).collect())
            .unwrap_or_default();
        assert!(
            under.is_empty(),
            "{what}: the pod wrote into the kubelet dir under its mount: {under:?}"
        );
        // Formatted once in the whole life: by moor-node's log, and by the UUID on the disk.
        for (v, &published) in wanted.iter().enumerate() {
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
        for (v, &published) in wanted.iter().enumerate() {
            let want: Vec<&str> = if published {
                vec![devs[&serial(v)].as_str()]
            } else {
                vec![]
            };
            for p in [&self.staging[v], &self.target[v]] {
                assert_eq!(
                    at(p),
                    want,
                    "{what}: the mounts at {} ({} is {})\n{mountinfo}",
                    p.display(),
                    vol(v),
                    if published { "published" } else { "unstaged" }
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
        assert!(
            unreadable.is_empty(),
            "{what}: moor-node found its journal damaged: {unreadable:#?}\n{}",
            self.vm.sh(
                "od -A d -c /run/state/moor/journal.log.corrupt | tail -n 12; \
                 wc -lc < /run/state/moor/journal.log.corrupt"
            )
        );
        self.torn += boot
            .lines()
            .filter(|l| l.contains("the journal ended in bytes no record reads from"))
            .count();
        format!(
            "{numbers} fsynced numbers in {} files, formats {:?}, {expected} mounts, \
             {} journals that ended in a torn append so far",
            self.synced.len(),
            (0..VOLUMES)
                .map(|v| formats_in(&log, &vol(v)))
                .collect::<Vec<_>>(),
            self.torn
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
    loop {
        let left = CONVERGE.saturating_sub(start.elapsed());
        let e = match tokio::time::timeout(left, call()).await {
            Ok(Ok(())) => return,
            Ok(Err(e)) => format!("{e:?}"),
            Err(_) => "no answer".to_string(),
        };
        assert!(
            start.elapsed() < CONVERGE,
            "guest {}: kubelet's {name} of {} did not succeed within {CONVERGE:?}: {e}\n{}",
            guest.g,
            vol(v),
            guest.log()
        );
        eprintln!("guest {}: {name} of {}: {e}; retried", guest.g, vol(v));
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// kubelet's work on the volumes other than the pod's, until it is cut off: one at a time,
/// a published volume unpublished and unstaged, an unstaged one staged and published. What
/// it wants is noted before its calls, as kubelet's desired state is.
async fn kubelet(
    mut node: Node,
    wanted: Arc<Mutex<Vec<bool>>>,
    calls: Vec<Calls>,
    mut rng: Rng,
) -> Result<(), String> {
    loop {
        let v = 1 + rng.below(VOLUMES as u64 - 1) as usize;
        let publish = {
            let mut w = wanted.lock().expect("wanted");
            w[v] = !w[v];
            w[v]
        };
        let c = calls[v].clone();
        let r = if publish {
            match node.node_stage_volume(c.stage).await {
                Ok(_) => node.node_publish_volume(c.publish).await.map(drop),
                Err(e) => Err(e),
            }
        } else {
            match node.node_unpublish_volume(c.unpublish).await {
                Ok(_) => node.node_unstage_volume(c.unstage).await.map(drop),
                Err(e) => Err(e),
            }
        };
        r.map_err(|e| format!("{}: {e:?}", vol(v)))?;
    }
}

/// kubelet's four calls of a volume.
#[derive(Clone)]
struct Calls {
    stage: csi::NodeStageVolumeRequest,
    publish: csi::NodePublishVolumeRequest,
    unpublish: csi::NodeUnpublishVolumeRequest,
    unstage: csi::NodeUnstageVolumeRequest,
}

impl Guest {
    fn calls(&self, v: usize) -> Calls {
        Calls {
            stage: self.stage(v),
            publish: self.publish(v),
            unpublish: unpublish_req(&vol(v), &self.target[v]),
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
                Arc::clone(&self.wanted),
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
            let wanted = self.wanted.lock().expect("wanted").clone();
            node = self.start_node().await;
            self.converge(&mut node).await;
            let lines = self.vm.read(&self.seq_file(k)).lines().count();
            let checked = self.check(&what);
            eprintln!(
                "{what}: last fsynced {synced} ({lines} lines in the file); kubelet wanted \
                 published {wanted:?}; checked: {checked}; {:.0} s",
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
                target: (0..VOLUMES).map(|v| lab.world.target(g, &vol(v))).collect(),
                disks: (0..VOLUMES)
                    .map(|v| dir.join(format!("{}.img", serial(v))))
                    .collect(),
                wanted: Arc::new(Mutex::new((0..VOLUMES).map(|v| v == POD).collect())),
                synced: Vec::new(),
                uuids: vec![None; VOLUMES],
                log_from: 0,
                torn: 0,
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
