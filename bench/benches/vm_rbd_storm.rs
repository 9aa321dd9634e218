//! A storm of maps (issue 41, point 3): in one guest of the VM lab (`.ci/vm`, Debian's kernel
//! under QEMU/TCG, one vCPU) on the Ceph test cluster, N fresh RBD images staged at once on
//! one node, each a first stage (map + probe + mkfs + mount):
//!
//! * moor: N NodeStageVolume calls at once to moor-node (`--rbd-attacher kernel`);
//! * ceph-csi's way: N jobs at once in the guest, each what ceph-csi's node server execs for a
//!   first stage (`internal/rbd/rbd_attach.go` and `nodeserver.go`): `rbd device list` (is the
//!   image mapped already?), `rbd --id U -m MONS --keyfile=F map POOL/IMAGE --device-type krbd
//!   --options noudev` (the `ceph-common` CLI), `blkid -p` (its `GetDiskFormat`), `mkfs.ext4
//!   -m0 -Enodiscard,assume_storage_prezeroed=1` (its options where mke2fs has that one, as
//!   the guest's does), then mount-utils' `FormatAndMount`: `blkid -p` again and `mount`;
//! * the floor: the same jobs with the map done as moor does it, one write of the request to
//!   `/sys/bus/rbd/add_single_major`, no probe, and moor's mkfs options (moor cannot prove a
//!   fresh image reads zeros, so it does not take `assume_storage_prezeroed`);
//! * udev: whether the guest runs systemd-udevd, and one `rbd map` timed with the CLI's
//!   default (it waits for udev to announce the device) and with `--options noudev`;
//! * the kernel's map path alone: the N sysfs writes at once, and one after another.
//!
//! Each storm's total (first start to last end, on the guest's clock: moor's from its log,
//! each call's end and `micros`) and its per-volume p50, p99 and max; each step's median and
//! max. moor runs between the two shell storms, every storm on images of its own, and every
//! storm is torn down before the next starts. Results go under `target/criterion/vm_rbd_storm/`
//! for `bench-report`.
//!
//! Run as root beside a cluster (`.ci/ceph-cluster up DIR`, then `. DIR/env`) with the lab set
//! up (`.ci/vm setup`), after `cargo build --release --bins`: `cargo bench -p moor-bench
//! --bench vm_rbd_storm`. Skipped, with the reason, otherwise. 100 volumes;
//! `MOOR_BENCH_QUICK=1`: 10; `MOOR_STORM_VOLUMES=N`: N. Images of 64 MiB (TCG makes a mkfs
//! slow: the storm measures maps, mkfs and mounts, not the image's size).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use moor_bench::storm::write_result;
use moor_lab::ceph::ext4;
use moor_lab::krbd_lab::{Lab, Volume, attach, create_sized, delete, detach, stage_req};
use moor_privileged::requests::unstage_req;
use moor_privileged::runtime;

/// Each image's size.
const IMAGE_MIB: u64 = 64;
/// How long a storm in the guest may take before the bench gives up on it.
const STORM_DEADLINE: Duration = Duration::from_secs(3600);
/// mkfs.ext4 as ceph-csi runs it where mke2fs takes `assume_storage_prezeroed` (e2fsprogs
/// 1.47, the guest's): `getMkfsArgs` in its `nodeserver.go`.
const MKFS_CEPH_CSI: &str = "mkfs.ext4 -m0 -Enodiscard,assume_storage_prezeroed=1";
/// mkfs.ext4 as moor runs it (`node/src/filesystem/ext.rs`, without its `-U`).
const MKFS_MOOR: &str = "mkfs.ext4 -q -E lazy_itable_init=1,lazy_journal_init=1,nodiscard";
/// How long one `rbd map` of the udev check may take.
const UDEV_MAP_DEADLINE_S: u32 = 900;

/// One volume's times in a storm, in ms on the guest's clock: its start, its end, and its steps.
#[derive(Debug, Clone, Default)]
struct Job {
    start: f64,
    end: f64,
    steps: Vec<(&'static str, f64)>,
}

/// A storm's jobs.
#[derive(Debug, Default)]
struct Storm {
    jobs: Vec<Job>,
}

impl Storm {
    fn total(&self) -> f64 {
        let first = self.jobs.iter().map(|j| j.start).fold(f64::MAX, f64::min);
        let last = self.jobs.iter().map(|j| j.end).fold(f64::MIN, f64::max);
        last - first
    }

    fn per_volume(&self) -> Vec<f64> {
        let mut v: Vec<f64> = self.jobs.iter().map(|j| j.end - j.start).collect();
        v.sort_by(f64::total_cmp);
        v
    }

    fn step(&self, name: &str) -> Vec<f64> {
        let mut v: Vec<f64> = self
            .jobs
            .iter()
            .flat_map(|j| {
                j.steps
                    .iter()
                    .filter(|(s, _)| *s == name)
                    .map(|(_, ms)| *ms)
            })
            .collect();
        v.sort_by(f64::total_cmp);
        v
    }
}

/// The `q` quantile of sorted `v` (nearest rank).
fn quantile(v: &[f64], q: f64) -> f64 {
    v[moor_bench::storm::nearest_rank(v.len(), q)]
}

/// Milliseconds since the day began of a log line's RFC 3339 `timestamp` (a storm does not
/// run across midnight UTC).
fn day_ms(timestamp: &str) -> Option<f64> {
    let time = timestamp.split_once('T')?.1.trim_end_matches('Z');
    let mut parts = time.split(':');
    let h: f64 = parts.next()?.parse().ok()?;
    let m: f64 = parts.next()?.parse().ok()?;
    let s: f64 = parts.next()?.parse().ok()?;
    Some(((h * 60.0 + m) * 60.0 + s) * 1e3)
}

/// moor's storm as its log tells it: each listed volume's NodeStageVolume (its end and
/// `micros`), its map, mkfs and mount.
fn moor_storm(log: &str, volumes: &[String]) -> Storm {
    let mut jobs: HashMap<&str, Job> = HashMap::new();
    for v in log
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
    {
        let Some(vol) = v["volume"].as_str() else {
            continue;
        };
        let Some(id) = volumes.iter().find(|x| x.as_str() == vol) else {
            continue;
        };
        let job = jobs.entry(id.as_str()).or_default();
        match v["message"].as_str() {
            Some("ok") if v["rpc"] == "NodeStageVolume" => {
                let end = v["timestamp"].as_str().and_then(day_ms).expect("timestamp");
                job.end = end;
                job.start = end - v["micros"].as_f64().expect("micros") / 1e3;
            }
            Some("mapped RBD image") => job.steps.push(("map", v["ms"].as_f64().unwrap_or(0.0))),
            Some("formatted blank device") => {
                job.steps
                    .push(("mkfs", v["mkfs_ms"].as_f64().unwrap_or(0.0)));
                job.steps
                    .push(("mount", v["mount_ms"].as_f64().unwrap_or(0.0)));
            }
            _ => {}
        }
    }
    assert_eq!(
        jobs.values().filter(|j| j.end > 0.0).count(),
        volumes.len(),
        "moor's log lacks a NodeStageVolume of some volume"
    );
    let mut out = Storm::default();
    for mut j in jobs.into_values() {
        let named: f64 = j.steps.iter().map(|(_, ms)| ms).sum();
        j.steps.push(("rest", (j.end - j.start) - named));
        out.jobs.push(j);
    }
    out
}

/// Runs `script` (bash) in the guest in the background, its output in `out` (a host path the
/// guest writes), and waits until it prints `storm-done`; its output.
fn guest_storm(lab: &Lab, out: &std::path::Path, script: &str) -> String {
    let _ = std::fs::remove_file(out);
    lab.vms[0].spawn(
        &["bash", "-c", &format!("{script}\necho storm-done")],
        &out.display().to_string(),
    );
    let start = Instant::now();
    loop {
        let text = std::fs::read_to_string(out).unwrap_or_default();
        if text.lines().any(|l| l == "storm-done") {
            return text;
        }
        assert!(
            start.elapsed() < STORM_DEADLINE,
            "the guest's storm did not end within {STORM_DEADLINE:?}: {text}"
        );
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// The jobs a shell storm printed: `vol <i> <t0> <name> <t1> <name> <t2> ...` (bash's
/// EPOCHREALTIME, seconds); a failure line fails the bench.
fn shell_storm(text: &str, n: usize) -> Storm {
    if let Some(l) = text.lines().find(|l| l.starts_with("fail")) {
        panic!("a job of the storm failed: {l}\n{text}");
    }
    let mut out = Storm::default();
    for l in text.lines().filter(|l| l.starts_with("vol ")) {
        let f: Vec<&str> = l.split_whitespace().collect();
        let t = |i: usize| f[i].parse::<f64>().expect("a time") * 1e3;
        let mut job = Job {
            start: t(2),
            ..Default::default()
        };
        let mut prev = job.start;
        let mut i = 3;
        while i + 1 < f.len() {
            let name: &'static str = match f[i] {
                "list" => "list",
                "map" => "map",
                "probe" => "probe",
                "mkfs" => "mkfs",
                _ => "mount",
            };
            let at = t(i + 1);
            job.steps.push((name, at - prev));
            prev = at;
            i += 2;
        }
        job.end = prev;
        out.jobs.push(job);
    }
    assert_eq!(out.jobs.len(), n, "the storm's jobs: {text}");
    out
}

/// A bash loop that runs `one <i>` for i in 0..n, all at once (`&`), or one after another.
fn all(n: usize, parallel: bool) -> String {
    let amp = if parallel { "&" } else { ";" };
    format!("for i in $(seq 0 {}); do one $i {amp} done; wait", n - 1)
}

fn main() {
    let quick = moor_bench::quick();
    let n: usize = std::env::var("MOOR_STORM_VOLUMES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(if quick { 10 } else { 100 });
    let Some(mut lab) = Lab::with_memory("vm-rbd-storm", 1, 93, "4G") else {
        return;
    };
    let tag = std::process::id();
    let out = lab.world.nodes[0].state.join("storm.out");
    let ceph = lab.world.ceph.clone();
    // ceph-csi's command line: the user, the monitors and a file holding the key, no conf.
    let keyfile = lab.world.nodes[0].state.join("storm.key");
    std::fs::write(&keyfile, &ceph.key).expect("the key file");
    let rbd = format!(
        "rbd --id {} -m {} --keyfile={}",
        ceph.user,
        ceph.mons,
        keyfile.display()
    );
    let map = |image: &str, options: &str| {
        format!(
            "{rbd} map {}/{image} --device-type krbd{options}",
            ceph.pool
        )
    };
    let unmap = |image: &str| {
        format!(
            "rbd unmap --device-type krbd --options noudev {}/{image}",
            ceph.pool
        )
    };
    // The kernel's request, as moor writes it (the cluster's monitors speak msgr2 on 3300).
    let kernel = moor_node::attach::kernel::kernel_monitors(&ceph.mons).expect("monitors");
    let request = format!(
        "{} name={},secret={}{},mount_timeout=120 {}",
        kernel.addrs,
        ceph.user,
        ceph.key,
        kernel
            .ms_mode
            .map(|m| format!(",ms_mode={m}"))
            .unwrap_or_default(),
        ceph.pool
    );
    let images = |prefix: &str| {
        for i in 0..n {
            ceph.rbd(&[
                "create",
                "--size",
                &format!("{IMAGE_MIB}M"),
                &format!("{prefix}-{tag}-{i}"),
            ])
            .unwrap_or_else(|e| panic!("rbd create: {e}"));
        }
    };
    let remove = |prefix: &str| {
        for i in 0..n {
            let _ = ceph.rbd(&["rm", "--no-progress", &format!("{prefix}-{tag}-{i}")]);
        }
    };
    let mut storms: Vec<(&str, Storm)> = Vec::new();

    // udev: does the guest run it, and what does the CLI's wait for it cost one map?
    let udev = udev_check(&lab, &out, &ceph, tag, &map, &unmap);

    // ceph-csi's way.
    images("ref");
    let probe = "blkid -p -s TYPE -s PTTYPE -o export $dev >/dev/null";
    let text = guest_storm(
        &lab,
        &out,
        &format!(
            "one() {{ d=/run/storm-ref/$1; mkdir -p $d; t0=$EPOCHREALTIME; \
             rbd device list --format=json --device-type krbd >/dev/null || {{ echo fail $1 list; return; }}; \
             t1=$EPOCHREALTIME; \
             dev=$({}) || {{ echo fail $1 map; return; }}; t2=$EPOCHREALTIME; \
             {probe}; t3=$EPOCHREALTIME; \
             {MKFS_CEPH_CSI} $dev >/dev/null 2>&1 || {{ echo fail $1 mkfs; return; }}; t4=$EPOCHREALTIME; \
             {probe}; mount -t ext4 -o _netdev,defaults $dev $d || {{ echo fail $1 mount; return; }}; \
             t5=$EPOCHREALTIME; \
             echo vol $1 $t0 list $t1 map $t2 probe $t3 mkfs $t4 mount $t5; }}\n{}",
            map(&format!("ref-{tag}-$1"), " --options noudev"),
            all(n, true)
        ),
    );
    storms.push(("ref", shell_storm(&text, n)));
    guest_storm(
        &lab,
        &out,
        &format!(
            "one() {{ umount /run/storm-ref/$1 && {} || echo fail $1 teardown; }}\n{}",
            unmap(&format!("ref-{tag}-$1")),
            all(n, true)
        ),
    );
    remove("ref");

    // moor.
    runtime().block_on(async {
        let mut ctl = lab.world.start_controller(&[]).await;
        let node = lab.start_node(0, "moor-node", &[]).await;
        let w = &lab.world;
        let mut vols: Vec<(Volume, HashMap<String, String>)> = Vec::new();
        for i in 0..n {
            let mut v = create_sized(w, &mut ctl, &format!("storm-{i}"), ext4(), IMAGE_MIB).await;
            let ctx = attach(w, &mut ctl, &mut v, 0).await.expect("publish");
            vols.push((v, ctx));
        }
        let mut set = tokio::task::JoinSet::new();
        let start = Instant::now();
        for (v, ctx) in &vols {
            let mut node = node.clone();
            let req = stage_req(w, v, ctx, 0);
            set.spawn(async move { node.node_stage_volume(req).await.map(|_| ()) });
        }
        while let Some(r) = set.join_next().await {
            r.expect("a stage task").expect("NodeStageVolume");
        }
        println!(
            "moor: {n} NodeStageVolume at once answered in {:.0} ms (the host's clock, with the \
             agent's hop)",
            start.elapsed().as_secs_f64() * 1e3
        );
        let ids: Vec<String> = vols.iter().map(|(v, _)| v.id.clone()).collect();
        storms.push(("moor", moor_storm(&lab.log(0), &ids)));
        for (v, _) in &vols {
            let mut node = node.clone();
            let req = unstage_req(&v.id, &w.staging(0, &v.id));
            set.spawn(async move { node.node_unstage_volume(req).await.map(|_| ()) });
        }
        while let Some(r) = set.join_next().await {
            r.expect("an unstage task").expect("NodeUnstageVolume");
        }
        for (v, _) in &vols {
            detach(w, &mut ctl, v, 0).await;
            delete(w, &mut ctl, v).await;
        }
        drop(node);
    });

    // The floor: the map as moor does it (one sysfs write), mkfs and mount, no probe.
    images("floor");
    let find = format!(
        "f=$(grep -lxs floor-{tag}-$1 /sys/bus/rbd/devices/*/name | head -n1); f=${{f%/name}}; \
         id=${{f##*/}}"
    );
    let text = guest_storm(
        &lab,
        &out,
        &format!(
            "one() {{ d=/run/storm-floor/$1; mkdir -p $d; t0=$EPOCHREALTIME; \
             echo '{request} floor-{tag}-'$1 > /sys/bus/rbd/add_single_major || {{ echo fail $1 map; return; }}; \
             {find}; dev=/dev/rbd$id; t1=$EPOCHREALTIME; \
             {MKFS_MOOR} $dev || {{ echo fail $1 mkfs; return; }}; t2=$EPOCHREALTIME; \
             mount -t ext4 $dev $d || {{ echo fail $1 mount; return; }}; t3=$EPOCHREALTIME; \
             echo vol $1 $t0 map $t1 mkfs $t2 mount $t3; }}\n{}",
            all(n, true)
        ),
    );
    storms.push(("floor", shell_storm(&text, n)));
    let unmap = |dir: bool| {
        format!(
            // EBUSY while udev's probe of the closed device holds it: retried, as moor does.
            "one() {{ {}{find}; n=0; until echo $id > /sys/bus/rbd/remove_single_major; do \
             n=$((n+1)); [ $n -lt 50 ] || {{ echo fail $1 teardown; return; }}; sleep 0.1; done; }}\n{}",
            if dir {
                "umount /run/storm-floor/$1; "
            } else {
                ""
            },
            all(n, true)
        )
    };
    guest_storm(&lab, &out, &unmap(true));

    // The kernel's map path alone: the sysfs writes at once, then one after another.
    for (name, parallel) in [("maps", true), ("maps-serial", false)] {
        let text = guest_storm(
            &lab,
            &out,
            &format!(
                "one() {{ t0=$EPOCHREALTIME; \
                 echo '{request} floor-{tag}-'$1 > /sys/bus/rbd/add_single_major || {{ echo fail $1 map; return; }}; \
                 t1=$EPOCHREALTIME; echo vol $1 $t0 map $t1; }}\n{}",
                all(n, parallel)
            ),
        );
        storms.push((name, shell_storm(&text, n)));
        guest_storm(&lab, &out, &unmap(false));
    }
    remove("floor");
    lab.vms.clear();

    report(n, &storms, &udev);
}

/// What the udev check found: whether systemd-udevd runs in the guest, and one `rbd map`'s
/// time (ms) with the CLI's default and with `--options noudev`.
struct Udev {
    running: String,
    map_ms: f64,
    noudev_ms: f64,
}

/// Maps one fresh image with the CLI's default (which waits for udev's events of the new
/// device), then another with `--options noudev`, one at a time in the quiet guest.
fn udev_check(
    lab: &Lab,
    out: &std::path::Path,
    ceph: &moor_lab::ceph::Ceph,
    tag: u32,
    map: &dyn Fn(&str, &str) -> String,
    unmap: &dyn Fn(&str) -> String,
) -> Udev {
    let running = lab.vms[0]
        .sh("if pgrep -x systemd-udevd >/dev/null; then echo 'systemd-udevd running'; else echo 'no udev daemon'; fi")
        .trim()
        .to_string();
    let mut ms = [0.0; 2];
    for (i, options) in ["", " --options noudev"].into_iter().enumerate() {
        let image = format!("udev-{tag}-{i}");
        ceph.rbd(&["create", "--size", &format!("{IMAGE_MIB}M"), &image])
            .unwrap_or_else(|e| panic!("rbd create: {e}"));
        let text = guest_storm(
            lab,
            out,
            &format!(
                "t0=$EPOCHREALTIME; timeout {UDEV_MAP_DEADLINE_S} {} >/dev/null || echo fail map; \
                 t1=$EPOCHREALTIME; {} || echo fail unmap; echo vol 0 $t0 map $t1",
                map(&image, options),
                unmap(&image)
            ),
        );
        ms[i] = shell_storm(&text, 1).total();
        let _ = ceph.rbd(&["rm", "--no-progress", &image]);
    }
    println!(
        "udev in the guest: {running}; one rbd map: {:.0} ms waiting for udev, {:.0} ms with \
         --options noudev",
        ms[0], ms[1]
    );
    Udev {
        running,
        map_ms: ms[0],
        noudev_ms: ms[1],
    }
}

/// Prints the storms' table and writes their results.
fn report(n: usize, storms: &[(&str, Storm)], udev: &Udev) {
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!(
        "\nvm_rbd_storm: {n} fresh {IMAGE_MIB} MiB images staged at once in a TCG guest (one \
         vCPU), ms on the guest's clock; the host's load average: {}\n",
        load.split_whitespace()
            .take(3)
            .collect::<Vec<_>>()
            .join(" ")
    );
    println!(
        "udev: {}; one rbd map {:.0} ms, with noudev {:.0} ms\n",
        udev.running, udev.map_ms, udev.noudev_ms
    );
    write_result("vm_rbd_storm/udev/map", udev.map_ms * 1e6);
    write_result("vm_rbd_storm/udev/map-noudev", udev.noudev_ms * 1e6);
    println!("| storm | total | p50 | p99 | max | max / p50 | steps: median (max) |");
    println!("| --- | --- | --- | --- | --- | --- | --- |");
    let reference = storms
        .iter()
        .find(|(name, _)| *name == "ref")
        .map(|(_, s)| s.total());
    for (name, storm) in storms {
        let per = storm.per_volume();
        let (total, p50, p99, max) = (
            storm.total(),
            quantile(&per, 0.5),
            quantile(&per, 0.99),
            quantile(&per, 1.0),
        );
        let steps: Vec<String> = ["list", "map", "probe", "mkfs", "mount", "rest"]
            .iter()
            .filter_map(|s| {
                let v = storm.step(s);
                (!v.is_empty())
                    .then(|| format!("{s} {:.0} ({:.0})", quantile(&v, 0.5), quantile(&v, 1.0)))
            })
            .collect();
        println!(
            "| {name} | {total:.0} | {p50:.0} | {p99:.0} | {max:.0} | {:.1}× | {} |",
            max / p50,
            steps.join(", ")
        );
        let id = format!("vm_rbd_storm/{name}-{n}");
        for (q, v) in [("total", total), ("p50", p50), ("p99", p99), ("max", max)] {
            write_result(&format!("{id}/{q}"), v * 1e6);
        }
        for s in ["map", "mkfs", "mount"] {
            let v = storm.step(s);
            if !v.is_empty() {
                write_result(&format!("{id}/{s}-p50"), quantile(&v, 0.5) * 1e6);
                write_result(&format!("{id}/{s}-max"), quantile(&v, 1.0) * 1e6);
            }
        }
    }
    if let Some(r) = reference {
        for (name, storm) in storms.iter().filter(|(n, _)| *n != "ref") {
            println!("{name}: {:.2}× ceph-csi's way in total", storm.total() / r);
        }
    }
}
