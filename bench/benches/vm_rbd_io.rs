//! I/O through a published RBD volume against librbd's own `rbd bench` (issue 41, point 2's
//! RBD half): in one guest of the VM lab (`.ci/vm`, QEMU/TCG, one vCPU) on the Ceph test
//! cluster's bridge, fio (Debian's: the host's, which the guest sees) with O_DIRECT through
//! volumes moor-node staged and published as kubelet asks (a file on the ext4 of a mount
//! volume, and the raw block access type), against `rbd bench` (librbd in the same guest) on an
//! image of the same size, in the same rounds: 4 KiB random read and write at queue depth 1 and
//! 32, 1 MiB sequential read and write, and the writes again with an fsync after each.
//!
//! Both attach paths moor has for a kernel with them: the kernel client (`--rbd-attacher
//! kernel`) and the userspace one (`--rbd-attacher ublk`: moor-ublk, ublk over librbd), two
//! moor-nodes in the guest. ublk needs the lab's second kernel (Debian's 6.12 from
//! bookworm-backports, `MOOR_VM_KERNEL_PACKAGE=linux-image-6.12.57+deb12-amd64 .ci/vm setup`,
//! as `lab/tests/vm_ublk.rs`); without it the guest boots the lab's default kernel and only
//! the kernel client is measured (said on stderr).
//!
//! `rbd bench` has no fsync, and with librbd's default cache (`rbd_cache_policy`
//! writearound) its writes are acknowledged before the OSDs have them, up to
//! `rbd_cache_max_dirty` (it flushes once, at its end, inside its time): its writes are run
//! twice, with the default cache and with `--rbd_cache=false` (each write acknowledged once the
//! OSDs have it durably, as the kernel client's, and as a write followed by an fsync). A fio
//! write job is set against the latter; a job that fsyncs after every write against the same
//! job without the fsync, cache off. `rbd bench` runs a byte count, not a time: each of its runs
//! is sized from the last measured rate of its job to take about as long as fio's.
//!
//! Without moor, in the same guest and rounds (issue 41's floor of a kernel-client volume):
//! `plain-block`, an image of the volumes' size mapped by plain `rbd map` (the messenger's mode
//! moor's map takes, nothing else), and `plain-ext4`, another formatted by plain `mkfs.ext4`
//! and mounted by plain `mount`, fio on them as on moor's; moor's kernel sides against them
//! should be ~1.0×, and they against `rbd bench` are the kernel client's and ext4's own share.
//! And `librbd-fio`: fio's rbd engine (librbd, cache off) on `rbd bench`'s image, librbd
//! writing fresh data each I/O as the kernel client does (`rbd bench` writes one buffer over
//! and over, whose crc32c Ceph's bufferlist keeps, so its messenger checksums the data once;
//! a TCG guest checksums a MiB in ~8 ms). `MOOR_VM_RBD_IO_NO_UBLK=1`: no moor-ublk sides.
//!
//! Each round runs every job on every side, the order of the sides rotated each round; the
//! median of the rounds is written as time per I/O (ns; 1 s over the IOPS) under
//! `vm_rbd_io/<job>/{rbd-bench,rbd-bench-nocache,kernel-ext4,kernel-block,ublk-ext4,ublk-block,
//! plain-ext4,plain-block,librbd-fio}` for
//! `bench-report`.
//!
//! Run as root beside a cluster (`.ci/ceph-cluster up DIR`, then `. DIR/env`) with the lab set
//! up, after `cargo build --release -p moor-node -p moor-controller -p moor-ublk`: `cargo bench
//! -p moor-bench --bench vm_rbd_io`. Skipped, with the reason, without the lab, the cluster or
//! fio. 256 MiB volumes (small for TCG: a prefill and mkfs stay short), fio's file 128 MiB;
//! 3 rounds of 4 s a job; `MOOR_BENCH_QUICK=1`: 1 round of 1 s a job.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use moor_bench::storm::{nearest_rank, selected, write_result};
use moor_bench::{FIO_JOBS, FioJob};
use moor_lab::ceph::{block, ext4};
use moor_lab::krbd_lab::{
    Lab, Launch, Volume, attach, create_sized, delete, detach, mount, start_node_as, target,
    unmount,
};
use moor_privileged::runtime;
use moor_proto::csi::v1::controller_client::ControllerClient;
use moor_proto::csi::v1::node_client::NodeClient;
use moor_proto::csi::v1::volume_capability::access_mode::Mode;
use tonic::transport::Channel;

/// Debian's 6.12 from bookworm-backports: ublk_drv and rbd as modules.
const KERNEL: &str = "linux-image-6.12.57+deb12-amd64";
/// The guest's address on the cluster's /24.
const HOST: u8 = 95;
/// The volumes' and the reference image's size.
const VOLUME_MIB: u64 = 256;
/// The file fio works in on an ext4 volume.
const FILE_MIB: u64 = 128;
/// How long one run in the guest (fio, rbd bench, a prefill) may take.
const RUN_DEADLINE: Duration = Duration::from_secs(1800);

/// Set (to anything): the kernel client's sides and the references only, no moor-ublk.
const NO_UBLK: &str = "MOOR_VM_RBD_IO_NO_UBLK";

/// fio's jobs.
const JOBS: [FioJob; 8] = FIO_JOBS;

/// The side of `rbd bench` with librbd's cache off (`--rbd_cache=false`): every write acked
/// once the OSD has it, as the kernel client's and as a write followed by an fsync.
const NO_CACHE: &str = "rbd-bench-nocache";

/// The job whose `rbd bench` is the reference of `job`: itself, or the same job without the
/// fsync (librbd's writes are durable when acknowledged).
fn reference_job(job: &str) -> &str {
    job.strip_suffix("-fsync").unwrap_or(job)
}

/// One way moor-node reaches the image: its attacher, socket, state dir and log.
struct Plugin {
    attacher: &'static str,
    socket: &'static str,
    state: PathBuf,
    log: PathBuf,
}

/// Where fio works: a volume moor-node staged and published, or an image mapped (and for
/// ext4 formatted and mounted) without moor.
struct Published {
    /// `<attacher>-ext4`, `<attacher>-block`, `plain-ext4`, `plain-block` or `librbd-fio`.
    side: String,
    /// The file (ext4) or the block device; for fio's rbd engine, the image.
    file: String,
    /// fio's `--size`.
    mib: u64,
    /// Who made it, and so who undoes it.
    by: MadeBy,
}

/// Who made a side's device.
enum MadeBy {
    /// moor-node (an index of the plugins), as kubelet asks.
    Moor { volume: Volume, plugin: usize },
    /// Plain `rbd map` of `image` to `dev`, and for ext4 plain `mkfs.ext4` and `mount` at
    /// `mountpoint`.
    Plain {
        image: String,
        dev: String,
        mountpoint: Option<String>,
    },
    /// Nobody: fio's rbd engine (librbd, its cache off) on the reference image, `rbd`'s
    /// options (conf, user, keyring, pool) given.
    Librbd {
        conf: String,
        keyring: String,
        user: String,
        pool: String,
    },
}

/// fio through librbd (its rbd engine, `--rbd_cache=false`) on `rbd bench`'s image: librbd
/// writing fresh data each I/O, as the kernel client does (`rbd bench` writes one buffer
/// over and over, whose crc32c Ceph's bufferlist keeps: the messenger checksums it once).
const LIBRBD_FIO: &str = "librbd-fio";

/// The sides without moor: what a kernel-client volume can reach at most.
const PLAIN: &str = "plain";

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[nearest_rank(v.len(), 0.5)]
}

fn main() {
    if !selected("vm_rbd_io") {
        return;
    }
    let test = "vm-rbd-io";
    let (rounds, secs) = if moor_bench::quick() { (1, 1) } else { (3, 4) };
    let ublk_bin = moor_privileged::client::binary("moor-ublk");
    let no_ublk = std::env::var_os(NO_UBLK).is_some();
    let (mut lab, ublk) = match Lab::with_kernel(test, HOST, KERNEL) {
        Some(lab) if no_ublk => {
            eprintln!("{test}: {NO_UBLK} is set: the kernel client only");
            (lab, false)
        }
        Some(lab) if ublk_bin.exists() => (lab, true),
        Some(lab) => {
            eprintln!(
                "{test}: {} is not built: the kernel client only",
                ublk_bin.display()
            );
            (lab, false)
        }
        None => {
            let Some(lab) = Lab::new(test, 1, HOST) else {
                return;
            };
            eprintln!("{test}: no guest on {KERNEL} (ublk): the kernel client only");
            (lab, false)
        }
    };
    if !lab.vms[0].exec(&["sh", "-c", "command -v fio"]).ok() {
        println!("{test}: skipped: no fio in the guest (apt-get install fio on the host)");
        return;
    }
    let state = lab.world.nodes[0].state.clone();
    let mut plugins = vec![Plugin {
        attacher: "kernel",
        socket: "/run/moor-kernel.sock",
        state: state.join("kernel"),
        log: state.join("kernel.log"),
    }];
    if ublk {
        plugins.push(Plugin {
            attacher: "ublk",
            socket: "/run/moor-ublk.sock",
            state: state.join("ublk"),
            log: state.join("ublk.log"),
        });
    }
    let rt = runtime();
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let ctl = rt.block_on(lab.world.start_controller(&[]));
        rt.block_on(run(&lab, ctl, &plugins, rounds, secs))
    }));
    match result {
        Ok(times) => report(&times, &plugins, rounds, secs),
        Err(e) => {
            for p in &plugins {
                eprintln!(
                    "{test}: moor-node ({}):\n{}",
                    p.attacher,
                    std::fs::read_to_string(&p.log).unwrap_or_default()
                );
            }
            std::panic::resume_unwind(e);
        }
    }
    drop(lab);
}

/// Starts `p`'s moor-node in the guest, moor-ublk on its PATH.
async fn start(lab: &Lab, p: &Plugin) -> NodeClient<Channel> {
    let bin = moor_privileged::client::binary("moor-node");
    let dir = bin
        .parent()
        .expect("the binaries' dir")
        .display()
        .to_string();
    let path = format!("PATH={dir}:/usr/sbin:/usr/bin:/sbin:/bin");
    let launch = Launch {
        program: "moor-node",
        attacher: p.attacher,
        socket: p.socket,
        wrap: &[],
        env: &[&path],
    };
    std::fs::create_dir_all(&p.state).expect("the state dir");
    let n = &lab.world.nodes[0];
    start_node_as(&lab.vms[0], &n.name, &n.kubelet, &launch, &p.state, &p.log).await
}

/// The rounds: the volumes made, staged and published, the reference image made and both
/// prefilled; every job on every side each round; then everything undone. Each side's times
/// per I/O (ns) by job.
async fn run(
    lab: &Lab,
    mut ctl: ControllerClient<Channel>,
    plugins: &[Plugin],
    rounds: usize,
    secs: u64,
) -> HashMap<(String, String), Vec<f64>> {
    let w = &lab.world;
    let vm = &lab.vms[0];
    let out = w.nodes[0].state.join("run");
    let mut nodes = Vec::new();
    for p in plugins {
        nodes.push(start(lab, p).await);
    }
    let mut published: Vec<Published> = Vec::new();
    for (i, p) in plugins.iter().enumerate() {
        for (kind, cap) in [("ext4", ext4()), ("block", block(Mode::SingleNodeWriter))] {
            let side = format!("{}-{kind}", p.attacher);
            let mut v = create_sized(w, &mut ctl, &format!("io-{side}"), cap, VOLUME_MIB).await;
            let ctx = attach(w, &mut ctl, &mut v, 0)
                .await
                .unwrap_or_else(|e| panic!("ControllerPublishVolume ({side}): {e:?}"));
            mount(w, &mut nodes[i], &v, &ctx, 0)
                .await
                .unwrap_or_else(|e| panic!("stage + publish ({side}): {e:?}"));
            let t = target(w, &v, 0).display().to_string();
            let (file, mib) = if kind == "ext4" {
                (format!("{t}/fio-file"), FILE_MIB)
            } else {
                (t, VOLUME_MIB)
            };
            prefill(vm, &out, &side, &file, mib);
            published.push(Published {
                side,
                file,
                mib,
                by: MadeBy::Moor {
                    volume: v,
                    plugin: i,
                },
            });
        }
    }
    let ceph = &w.ceph;
    let rbd = format!(
        "rbd -c {} --id {} --keyring {} -p {}",
        ceph.conf, ceph.user, ceph.keyring, ceph.pool
    );
    for kind in ["ext4", "block"] {
        let p = plain(lab, &out, &rbd, kind);
        prefill(vm, &out, &p.side, &p.file, p.mib);
        published.push(p);
    }
    let image = format!("vm-rbd-io-ref-{}", std::process::id());
    ceph.create(&image, VOLUME_MIB);
    vm.run_script(
        &out,
        &format!(
            "{rbd} bench --io-type write --io-size 4M --io-threads 4 --io-pattern seq \
             --io-total {VOLUME_MIB}M {image} >/dev/null || echo fail prefill {image}"
        ),
        RUN_DEADLINE,
    );

    published.push(Published {
        side: LIBRBD_FIO.into(),
        file: image.clone(),
        mib: VOLUME_MIB,
        by: MadeBy::Librbd {
            conf: ceph.conf.clone(),
            keyring: ceph.keyring.clone(),
            user: ceph.user.clone(),
            pool: ceph.pool.clone(),
        },
    });
    let mut sides: Vec<String> = published.iter().map(|p| p.side.clone()).collect();
    sides.push("rbd-bench".into());
    sides.push(NO_CACHE.into());
    let mut times: HashMap<(String, String), Vec<f64>> = HashMap::new();
    // The last rate of each job (I/Os per second), which sizes rbd bench's runs.
    let mut rate: HashMap<&str, f64> = HashMap::new();
    for round in 0..rounds {
        let mut order = sides.clone();
        order.rotate_left(round % sides.len());
        for job in &JOBS {
            for side in &order {
                let iops = if side == "rbd-bench" || side == NO_CACHE {
                    let cache = side == "rbd-bench";
                    // The fsync'd jobs' references are their jobs' without; the cache only
                    // changes the writes.
                    if job.0 != reference_job(job.0) || (!cache && !job.1.contains("write")) {
                        continue;
                    }
                    let rbd = if cache {
                        rbd.clone()
                    } else {
                        format!("{rbd} --rbd_cache=false")
                    };
                    rbd_bench(vm, &out, &rbd, &image, job, secs, rate.get(job.0).copied())
                } else {
                    let p = published.iter().find(|p| &p.side == side).expect("a side");
                    fio(vm, &out, p, job, secs)
                };
                rate.insert(job.0, iops);
                eprintln!("vm_rbd_io: round {round}: {} {side}: {iops:.0} IOPS", job.0);
                times
                    .entry((job.0.to_string(), side.clone()))
                    .or_default()
                    .push(1e9 / iops);
            }
        }
    }

    for p in &published {
        match &p.by {
            MadeBy::Moor { volume, plugin } => {
                unmount(lab, &mut nodes[*plugin], volume, 0).await;
                detach(w, &mut ctl, volume, 0).await;
                delete(w, &mut ctl, volume).await;
            }
            MadeBy::Plain {
                image,
                dev,
                mountpoint,
            } => {
                let umount = mountpoint
                    .as_ref()
                    .map(|m| format!("umount {m} || echo fail umount {m}\n"))
                    .unwrap_or_default();
                vm.run_script(
                    &out,
                    &format!("{umount}{rbd} unmap {dev} || echo fail unmap {dev}"),
                    RUN_DEADLINE,
                );
                let _ = ceph.rbd(&["rm", "--no-progress", image]);
            }
            MadeBy::Librbd { .. } => {}
        }
    }
    let _ = ceph.rbd(&["rm", "--no-progress", &image]);
    drop(nodes);
    times
}

/// Writes `side`'s `file` whole once before it is read: an RBD object never written reads as
/// zeros without a trip to the disk under the OSD. fio lays out a file itself; a device it does
/// not.
fn prefill(vm: &moor_lab::vm::Vm, out: &Path, side: &str, file: &str, mib: u64) {
    let fill = format!(
        "fio --name=fill --filename={file} --rw=write --bs=4m --size={mib}M --direct=1 \
         --ioengine=libaio --iodepth=4 >/dev/null || echo fail prefill {side}"
    );
    vm.run_script(out, &fill, RUN_DEADLINE);
}

/// The side `plain-<kind>`: an image of the volumes' size made on the host, mapped in the
/// guest by plain `rbd map` (the CLI's default options: no moor, no ceph-csi), and for ext4
/// formatted by plain `mkfs.ext4` and mounted by plain `mount`.
fn plain(lab: &Lab, out: &Path, rbd: &str, kind: &str) -> Published {
    let side = format!("{PLAIN}-{kind}");
    let ceph = &lab.world.ceph;
    let image = format!("vm-rbd-io-{side}-{}", std::process::id());
    ceph.create(&image, VOLUME_MIB);
    // The messenger's mode moor's map takes for these monitors (msgr2's crc mode for a
    // cluster on 3300), so that the two differ in nothing but moor.
    let mode = moor_node::attach::kernel::kernel_monitors(&ceph.mons)
        .expect("the cluster's monitors")
        .ms_mode
        .map(|m| format!(" -o ms_mode={m}"))
        .unwrap_or_default();
    let text = lab.vms[0].run_script(
        out,
        &format!("dev=$({rbd} map{mode} {image}) || echo fail map {image}\necho dev=$dev"),
        RUN_DEADLINE,
    );
    let dev = text
        .lines()
        .find_map(|l| l.strip_prefix("dev="))
        .filter(|d| d.starts_with("/dev/rbd"))
        .unwrap_or_else(|| panic!("rbd map {image}: {text}"))
        .to_string();
    if kind == "block" {
        return Published {
            side,
            file: dev.clone(),
            mib: VOLUME_MIB,
            by: MadeBy::Plain {
                image,
                dev,
                mountpoint: None,
            },
        };
    }
    let mnt = lab.world.nodes[0].state.join(&side).display().to_string();
    lab.vms[0].run_script(
        out,
        &format!(
            "mkfs.ext4 -q {dev} || echo fail mkfs {dev}\nmkdir -p {mnt}\n\
             mount {dev} {mnt} || echo fail mount {dev}"
        ),
        RUN_DEADLINE,
    );
    Published {
        file: format!("{mnt}/fio-file"),
        side,
        mib: FILE_MIB,
        by: MadeBy::Plain {
            image,
            dev,
            mountpoint: Some(mnt),
        },
    }
}

/// fio's IOPS for `job` on `p` (the reads' or the writes' as the job does).
fn fio(vm: &moor_lab::vm::Vm, out: &Path, p: &Published, job: &FioJob, secs: u64) -> f64 {
    let (name, rw, bs, depth, fsync) = *job;
    let json = out.with_extension(format!("{}-{name}.json", p.side));
    let fsync = if fsync { " --fsync=1" } else { "" };
    let target = match &p.by {
        MadeBy::Librbd {
            conf,
            keyring,
            user,
            pool,
        } => format!(
            "env CEPH_CONF={conf} CEPH_ARGS='--keyring {keyring} --rbd_cache=false' fio \
             --ioengine=rbd --clientname={user} --pool={pool} --rbdname={}",
            p.file
        ),
        _ => format!("fio --filename={} --direct=1 --ioengine=libaio", p.file),
    };
    vm.run_script(
        out,
        &format!(
            "{target} --name={name} --rw={rw} --bs={bs} --iodepth={depth} \
             --size={}M --runtime={secs} --time_based{fsync} \
             --output-format=json --output={} || echo fail fio {name} {}",
            p.mib,
            json.display(),
            p.side
        ),
        RUN_DEADLINE,
    );
    let text = std::fs::read_to_string(&json).expect("fio's output");
    let start = text.find('{').expect("fio's JSON");
    let v: serde_json::Value = serde_json::from_str(&text[start..]).expect("fio's JSON");
    let dir = if rw.contains("read") { "read" } else { "write" };
    v["jobs"][0][dir]["iops"].as_f64().expect("iops")
}

/// `rbd bench`'s IOPS for `job` on `image`: its run sized to about `secs` at the job's last
/// rate `rate` (a fixed small count before there is one).
fn rbd_bench(
    vm: &moor_lab::vm::Vm,
    out: &Path,
    rbd: &str,
    image: &str,
    job: &FioJob,
    secs: u64,
    rate: Option<f64>,
) -> f64 {
    let (name, rw, bs, depth, _) = *job;
    let kib: u64 = if bs == "4k" { 4 } else { 1024 };
    // At least 64 I/Os, and twice the queue's depth.
    let ios = rate
        .map_or(64.0, |r| r * secs as f64)
        .max(64.0)
        .max(2.0 * depth as f64) as u64;
    let io_type = if rw.contains("read") { "read" } else { "write" };
    let pattern = if rw.starts_with("rand") {
        "rand"
    } else {
        "seq"
    };
    let text = vm.run_script(
        out,
        &format!(
            "{rbd} bench --io-type {io_type} --io-size {kib}K --io-threads {depth} \
             --io-pattern {pattern} --io-total {}K {image} 2>&1 || echo fail rbd bench {name}",
            ios * kib
        ),
        RUN_DEADLINE,
    );
    // Its last line: `elapsed: 4   ops: 1024   ops/sec: 251.3   bytes/sec: ...`.
    let line = text
        .lines()
        .rfind(|l| l.trim_start().starts_with("elapsed:"))
        .unwrap_or_else(|| panic!("no summary in rbd bench's output: {text}"));
    let words: Vec<&str> = line.split_whitespace().collect();
    let at = words
        .iter()
        .position(|w| *w == "ops/sec:")
        .unwrap_or_else(|| panic!("no ops/sec in {line:?}"));
    words[at + 1]
        .parse()
        .unwrap_or_else(|e| panic!("ops/sec in {line:?}: {e}"))
}

/// Prints the table (µs per I/O, each side against rbd bench's) and writes the medians.
fn report(
    times: &HashMap<(String, String), Vec<f64>>,
    plugins: &[Plugin],
    rounds: usize,
    secs: u64,
) {
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let load: Vec<&str> = load.split_whitespace().take(3).collect();
    println!(
        "\nvm_rbd_io: time per I/O (µs), median of {rounds} rounds of {secs} s a job in a TCG \
         guest (one vCPU), {VOLUME_MIB} MiB volumes and image, the sides' order rotated each \
         round; in brackets each against rbd bench's (librbd, the same guest; a write against \
         rbd bench's with the cache off, the fsync'd jobs against the job without fsync); the host's load average: {}\n",
        load.join(" ")
    );
    let sides: Vec<String> = plugins
        .iter()
        .map(|p| p.attacher)
        .chain([PLAIN])
        .flat_map(|a| ["ext4", "block"].map(|k| format!("{a}-{k}")))
        .chain([LIBRBD_FIO.to_string()])
        .collect();
    println!(
        "| job | rbd bench | rbd bench, cache off | {} |",
        sides.join(" | ")
    );
    println!("| --- | --- | --- |{}", " --- |".repeat(sides.len()));
    for job in &JOBS {
        let key = |side: &str, job: &str| (job.to_string(), side.to_string());
        let Some(r) = times.get(&key("rbd-bench", reference_job(job.0))) else {
            continue;
        };
        let r = median(r.clone());
        if job.0 == reference_job(job.0) {
            write_result(&format!("vm_rbd_io/{}/rbd-bench", job.0), r);
        }
        let mut line = format!("| {} | {:.0} |", job.0, r / 1e3);
        // A write's reference: librbd without its cache, each write acked once durable.
        let r = match times.get(&key(NO_CACHE, reference_job(job.0))) {
            Some(t) => {
                let n = median(t.clone());
                if job.0 == reference_job(job.0) {
                    write_result(&format!("vm_rbd_io/{}/{NO_CACHE}", job.0), n);
                }
                line.push_str(&format!(" {:.0} |", n / 1e3));
                n
            }
            None => {
                line.push_str(" — |");
                r
            }
        };
        for side in &sides {
            match times.get(&key(side, job.0)) {
                Some(t) => {
                    let m = median(t.clone());
                    write_result(&format!("vm_rbd_io/{}/{side}", job.0), m);
                    line.push_str(&format!(" {:.0} ({:.2}×) |", m / 1e3, m / r));
                }
                None => line.push_str(" not run |"),
            }
        }
        println!("{line}");
    }
    against_plain(times);
}

/// The second table: moor's kernel-client sides against the same jobs on plain `rbd map` (+
/// plain mkfs and mount), the floor of a kernel-client volume, target ~1.0×.
fn against_plain(times: &HashMap<(String, String), Vec<f64>>) {
    println!(
        "\nvm_rbd_io: the kernel client through moor against the plain kernel client (rbd map, \
         mkfs.ext4, mount; no moor), time per I/O (µs), in brackets moor's against it\n"
    );
    println!("| job | plain, ext4 | kernel, ext4 | plain, block | kernel, block |");
    println!("| --- | --- | --- | --- | --- |");
    for job in &JOBS {
        let med = |side: &str| {
            times
                .get(&(job.0.to_string(), side.to_string()))
                .map(|t| median(t.clone()))
        };
        let mut line = format!("| {} |", job.0);
        for kind in ["ext4", "block"] {
            match (
                med(&format!("{PLAIN}-{kind}")),
                med(&format!("kernel-{kind}")),
            ) {
                (Some(plain), Some(moor)) => line.push_str(&format!(
                    " {:.0} | {:.0} ({:.2}×) |",
                    plain / 1e3,
                    moor / 1e3,
                    moor / plain
                )),
                _ => line.push_str(" not run | not run |"),
            }
        }
        println!("{line}");
    }
}
