//! I/O through a published local volume against the disk under it (run as root, with fio:
//! `cargo bench --bench io`): fio in a file of an ext4 volume on a loop device, staged and
//! published by moor-node as kubelet asks, against fio in a file of the same size on the
//! filesystem that holds the volume's backing file (this machine's disk), side by side in one
//! run: 4 KiB random reads and writes at queue depth 1 and 32, 1 MiB sequential reads and
//! writes, and the writes again with an fsync after each. Every fio run uses O_DIRECT.
//!
//! The volumes' loop devices ([`BINDINGS`]): buffered, as moor's local controller bound one
//! before it took direct I/O (the backing file's page cache under it, 512-byte blocks, a
//! sparse file), measured twice: as it comes (`loop`: whatever of the file the host has
//! cached) and cold (`loop-cold`: the backing file written back and dropped from the host's
//! page cache before each run, so what is read comes from the disk); and with the loop
//! driver's direct I/O (`LO_FLAGS_DIRECT_IO`; `loop-dio` is how the local controller's
//! `LoopAttacher` binds one now), on a sparse and on a preallocated backing file
//! (`fallocate`, with the device's discards off, as a thick volume is) and with 512-byte and
//! 4 KiB logical blocks (`LOOP_CONFIGURE`'s block size), each alone and together. Every
//! device's sysfs (`loop/dio`, `queue/logical_block_size`) is checked to be what its row
//! says. In each round the disk and every volume run each job in turn, the backing file
//! written back after each run (outside the timing, so that no run's writeback lands in the
//! next one's); `ROUNDS` rounds, the median of each is written as time per I/O (ns; 1 s over
//! fio's IOPS), with the least and the most of the rounds as its range, under
//! `io/<job>/<binding>`, which `bench-report` sets against `io/<job>/disk`. The host's load
//! average is printed with each job: the machine is shared.
//!
//! The floor of a loop binding, measured in the same rounds without moor ([`FLOORS`]): fio on
//! a loop device bound as `loop-dio` with no filesystem inside (`raw-dio`: the loop driver
//! alone, its 512 MiB written once first so that no read is of a hole), and in a file of
//! plain ext4 on such a device (`plain-dio`: `mkfs.ext4 -q` with its defaults and mount(2),
//! as a user would by hand). `bench-report` sets each against the disk, and `loop-dio`
//! against `plain-dio`: what moor adds to a loop binding, apart from the loop driver and the
//! filesystem inside.
//!
//! A measured run, not criterion's iterations; skipped, with a line saying so, without fio.
//! `MOOR_BENCH_QUICK=1`: one round of one second per job.

use std::num::NonZeroU64;
use std::path::{Path, PathBuf};
use std::process::Command;

use moor_bench::storm::{selected, write_result_within};
use moor_bench::{
    FIO_JOBS, FioJob, Node, publish_req, quick, stage_req, unpublish_req, unstage_req,
};
use moor_privileged::kubelet_calls::Kubelet;

/// fio's jobs.
const JOBS: [FioJob; 8] = FIO_JOBS;

/// How a volume's loop device is bound: id (`io/<job>/<id>`), the loop driver's direct I/O,
/// the logical block size, the backing file preallocated, and dropped from the host's page
/// cache before each run (`cold`, a buffered device: `loop-cold` is the `loop` volume itself).
struct Binding {
    id: &'static str,
    direct_io: bool,
    block_size: u32,
    preallocate: bool,
    cold: bool,
}

const fn binding(
    id: &'static str,
    direct_io: bool,
    block_size: u32,
    preallocate: bool,
    cold: bool,
) -> Binding {
    Binding {
        id,
        direct_io,
        block_size,
        preallocate,
        cold,
    }
}

/// The bindings measured against the disk, in the order each round runs them.
const BINDINGS: [Binding; 6] = [
    binding("loop-cold", false, 512, false, true),
    binding("loop", false, 512, false, false),
    binding("loop-dio", true, 512, false, false),
    binding("loop-dio-4k", true, 4096, false, false),
    binding("loop-dio-prealloc", true, 512, true, false),
    binding("loop-dio-4k-prealloc", true, 4096, true, false),
];

/// The floors measured beside the bindings, without moor, each on a loop device bound as
/// `loop-dio` (direct I/O, 512-byte blocks, a sparse file): (id, a filesystem inside).
const FLOORS: [(&str, bool); 2] = [("raw-dio", false), ("plain-dio", true)];

/// The file fio works in, and the volume's size.
const FILE_MIB: u64 = 512;
const VOLUME: u64 = 1 << 30;

/// fio's IOPS for one job on `file` (the reads' or the writes' as the job does).
fn fio(file: &Path, job: &FioJob, seconds: u32) -> f64 {
    let (name, rw, bs, depth, fsync) = *job;
    let mut cmd = Command::new("fio");
    cmd.args([
        &format!("--name={name}"),
        &format!("--filename={}", file.display()),
        &format!("--rw={rw}"),
        &format!("--bs={bs}"),
        &format!("--iodepth={depth}"),
        &format!("--size={FILE_MIB}M"),
        &format!("--runtime={seconds}"),
        "--time_based",
        "--direct=1",
        "--ioengine=libaio",
        "--output-format=json",
    ]);
    if fsync {
        cmd.arg("--fsync=1");
    }
    let out = cmd.output().expect("fio");
    assert!(out.status.success(), "fio {name}: {out:?}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("fio's json");
    let side = if rw.contains("read") { "read" } else { "write" };
    v["jobs"][0][side]["iops"].as_f64().expect("iops")
}

/// The median of `v` with its least and most.
fn spread(mut v: Vec<f64>) -> (f64, f64, f64) {
    v.sort_by(f64::total_cmp);
    (v[0], v[v.len() / 2], v[v.len() - 1])
}

/// A loop device's sysfs attribute (`loop/dio`, `queue/logical_block_size`, ...).
fn sysfs(dev: &Path, attr: &str) -> String {
    let name = dev.file_name().expect("device name").to_string_lossy();
    let path = format!("/sys/block/{name}/{attr}");
    std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{path}: {e}"))
        .trim()
        .to_string()
}

/// Writes `file`'s dirty pages back to the disk and, when `drop` is asked, drops its pages
/// from the host's page cache (a buffered loop device then reads the disk again).
fn write_back(file: &Path, drop: bool) {
    let f = std::fs::File::open(file).expect("open the backing file");
    rustix::fs::fdatasync(&f).expect("fdatasync the backing file");
    if drop {
        rustix::fs::fadvise(&f, 0, None::<NonZeroU64>, rustix::fs::Advice::DontNeed)
            .expect("fadvise DONTNEED");
    }
}

/// The loop devices whose discards the bench turned off, removed when it ends (after the
/// sandbox has unbound them, also when it fails): a device keeps that setting across bindings,
/// so left behind it would stop the next user's thin volume from giving space back, as the
/// local controller's `LoopAttacher` removes such a device for the same reason.
#[derive(Default)]
struct DiscardsOff(Vec<u32>);

impl Drop for DiscardsOff {
    fn drop(&mut self) {
        let Ok(control) = std::fs::File::options()
            .read(true)
            .write(true)
            .open("/dev/loop-control")
        else {
            println!(
                "io: cannot open /dev/loop-control; loop{:?} keep their discards off",
                self.0
            );
            return;
        };
        for &n in &self.0 {
            // The kernel unbinds a device on its last close; until then (and while udev looks
            // at it) removing it is EBUSY.
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
            loop {
                match moor_runtime::sys::loopdev::remove(&control, n) {
                    Ok(()) => break,
                    Err(e)
                        if e.raw_os_error() == Some(libc::EBUSY)
                            && std::time::Instant::now() < deadline =>
                    {
                        std::thread::sleep(std::time::Duration::from_millis(20));
                    }
                    Err(e) => {
                        println!(
                            "io: loop{n} keeps its discards off: not removed within 30 s of \
                             its release: {e}"
                        );
                        break;
                    }
                }
            }
        }
    }
}

/// The host's load average over the last minute.
fn load() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .split_whitespace()
        .next()
        .unwrap_or("?")
        .to_string()
}

fn main() {
    if !selected("io") {
        return;
    }
    if Command::new("fio").arg("--version").output().is_err() {
        println!("io: skipped, fio is not installed (apt-get install fio)");
        return;
    }
    let (rounds, seconds) = if quick() { (1, 1) } else { (3, 3) };
    // Dropped after `node` (its sandbox unbinds the devices first).
    let mut discards_off = DiscardsOff::default();
    let node = Node::start("bench-io");
    let k = Kubelet::new(node.socket());
    // The disk: a directory on the filesystem that holds the sandbox's backing files.
    let disk = node.sb.data.join("disk-file");
    // (volume id, backing file, staging, target) of each device; `loop-cold` shares `loop`'s.
    let mut volumes: Vec<(&str, PathBuf, PathBuf, PathBuf)> = Vec::new();
    for b in BINDINGS.iter().filter(|b| !b.cold) {
        let block = b.block_size.to_string();
        let dio = if b.direct_io { "on" } else { "off" };
        let dev = node.sb.loop_device_bound(
            &format!("{}.img", b.id),
            VOLUME,
            b.preallocate,
            &[&format!("--direct-io={dio}"), "--sector-size", &block],
        );
        if b.preallocate {
            // As the local controller keeps a thick volume's file allocated (`keep_allocated`).
            let name = dev.file_name().expect("device name").to_string_lossy();
            std::fs::write(format!("/sys/block/{name}/queue/discard_max_bytes"), "0")
                .expect("discards off");
            discards_off.0.push(
                name.trim_start_matches("loop")
                    .parse()
                    .expect("a loop device's number"),
            );
        }
        let (seen_dio, seen_block) = (
            sysfs(&dev, "loop/dio"),
            sysfs(&dev, "queue/logical_block_size"),
        );
        println!(
            "io: {} on {}: loop/dio {seen_dio}, logical_block_size {seen_block}, discard_max_bytes {}",
            b.id,
            dev.display(),
            sysfs(&dev, "queue/discard_max_bytes")
        );
        assert_eq!(
            seen_dio,
            if b.direct_io { "1" } else { "0" },
            "{}: loop/dio",
            b.id
        );
        assert_eq!(seen_block, block, "{}: logical block size", b.id);
        let (staging, target) = (node.sb.staging(b.id), node.sb.target("pod-io", b.id));
        k.stage(&stage_req(b.id, &dev, &staging, "ext4"))
            .expect("stage");
        k.publish(&publish_req(b.id, &staging, &target))
            .expect("publish");
        volumes.push((
            b.id,
            node.sb.data.join(format!("{}.img", b.id)),
            staging,
            target,
        ));
    }
    // The floors: (id, backing file, what fio works on, the mount to undo).
    let mut floors: Vec<(&str, PathBuf, PathBuf, Option<PathBuf>)> = Vec::new();
    for (id, filesystem) in FLOORS {
        let dev = node.sb.loop_device_bound(
            &format!("{id}.img"),
            VOLUME,
            false,
            &["--direct-io=on", "--sector-size", "512"],
        );
        assert_eq!(sysfs(&dev, "loop/dio"), "1", "{id}: loop/dio");
        println!("io: {id} on {}: loop/dio 1, no moor", dev.display());
        let backing = node.sb.data.join(format!("{id}.img"));
        if filesystem {
            let out = Command::new("mkfs.ext4")
                .arg("-q")
                .arg(&dev)
                .stdin(std::process::Stdio::null())
                .output()
                .expect("mkfs.ext4");
            assert!(out.status.success(), "mkfs.ext4 {}: {out:?}", dev.display());
            let dir = node.sb.data.join(format!("{id}-mnt"));
            std::fs::create_dir_all(&dir).expect("the plain mount's directory");
            rustix::mount::mount(
                dev.as_path(),
                dir.as_path(),
                "ext4",
                rustix::mount::MountFlags::empty(),
                None,
            )
            .expect("mount the plain ext4");
            floors.push((id, backing, dir.join("fio-file"), Some(dir)));
        } else {
            // Written once, so that the reads read data, as they do in every file fio lays out.
            let out = Command::new("fio")
                .args([
                    "--name=fill",
                    &format!("--filename={}", dev.display()),
                    "--rw=write",
                    "--bs=1M",
                    &format!("--size={FILE_MIB}M"),
                    "--direct=1",
                    "--ioengine=libaio",
                    "--iodepth=8",
                ])
                .output()
                .expect("fio");
            assert!(out.status.success(), "fio fill {}: {out:?}", dev.display());
            floors.push((id, backing, dev, None));
        }
    }
    let volume = |b: &Binding| {
        let id = if b.cold { "loop" } else { b.id };
        volumes
            .iter()
            .find(|v| v.0 == id)
            .expect("the binding's volume")
    };
    for job in &JOBS {
        let load_before = load();
        let mut disk_times = Vec::new();
        let mut times: Vec<Vec<f64>> = vec![Vec::new(); BINDINGS.len()];
        let mut floor_times: Vec<Vec<f64>> = vec![Vec::new(); FLOORS.len()];
        for _ in 0..rounds {
            disk_times.push(1e9 / fio(&disk, job, seconds));
            write_back(&disk, false);
            for (i, (_, backing, file, _)) in floors.iter().enumerate() {
                floor_times[i].push(1e9 / fio(file, job, seconds));
                write_back(backing, false);
            }
            for (i, b) in BINDINGS.iter().enumerate() {
                let (_, backing, _, target) = volume(b);
                if b.cold {
                    write_back(backing, true);
                }
                times[i].push(1e9 / fio(&target.join("fio-file"), job, seconds));
                write_back(backing, false);
            }
        }
        let d = spread(disk_times);
        let mut line = format!("io/{}: disk {:.1} µs", job.0, d.1 / 1e3);
        write_result_within(&format!("io/{}/disk", job.0), d);
        for ((id, ..), t) in floors.iter().zip(floor_times) {
            let t = spread(t);
            line.push_str(&format!(
                ", {id} {:.1} µs ({:.0}%)",
                t.1 / 1e3,
                100.0 * d.1 / t.1
            ));
            write_result_within(&format!("io/{}/{id}", job.0), t);
        }
        for (b, t) in BINDINGS.iter().zip(times) {
            let t = spread(t);
            line.push_str(&format!(
                ", {} {:.1} µs ({:.0}%)",
                b.id,
                t.1 / 1e3,
                100.0 * d.1 / t.1
            ));
            write_result_within(&format!("io/{}/{}", job.0, b.id), t);
        }
        println!(
            "{line} (of the disk's IOPS; load {load_before} to {})",
            load()
        );
    }
    for (id, _, staging, target) in &volumes {
        k.unpublish(&unpublish_req(id, target)).expect("unpublish");
        k.unstage(&unstage_req(id, staging)).expect("unstage");
    }
    for (_, _, _, mounted) in &floors {
        if let Some(dir) = mounted {
            rustix::mount::unmount(dir.as_path(), rustix::mount::UnmountFlags::empty())
                .expect("unmount the plain ext4");
        }
    }
    drop(node);
}
