//! I/O through a published local volume against the disk under it (run as root, with fio:
//! `cargo bench --bench io`): fio in a file of an ext4 volume on a loop device, staged and
//! published by moor-node as kubelet asks, against fio in a file of the same size on the
//! filesystem that holds the volume's backing file (this machine's disk), side by side in one
//! run: 4 KiB random reads and writes at queue depth 1 and 32, 1 MiB sequential reads and
//! writes, and the writes again with an fsync after each. Every fio run uses O_DIRECT.
//!
//! Two loop devices: as moor's local controller binds one (`LoopAttacher`: buffered, the
//! backing file's page cache under it, 512-byte blocks), and the same with the loop driver's
//! direct I/O (`LO_FLAGS_DIRECT_IO`). The three runs of each job alternate, `ROUNDS` times;
//! the median of each is written as time per I/O (ns; 1 s over fio's IOPS) under
//! `io/<job>/{disk,loop,loop-dio}`, which `bench-report` sets against the disk's.
//!
//! A measured run, not criterion's iterations; skipped, with a line saying so, without fio.
//! `MOOR_BENCH_QUICK=1`: one round of one second per job.

use std::path::Path;
use std::process::Command;

use moor_bench::storm::{selected, write_result};
use moor_bench::{
    FIO_JOBS, FioJob, Node, publish_req, quick, stage_req, unpublish_req, unstage_req,
};
use moor_privileged::kubelet_calls::Kubelet;

/// fio's jobs.
const JOBS: [FioJob; 8] = FIO_JOBS;

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

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
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
    let node = Node::start("bench-io");
    let k = Kubelet::new(node.socket());
    // The disk: a directory on the filesystem that holds the sandbox's backing files.
    let disk = node.sb.data.join("disk-file");
    let mut volumes = Vec::new();
    for (id, dio) in [("loop", false), ("loop-dio", true)] {
        let dev = node.sb.loop_device(&format!("{id}.img"), VOLUME);
        if dio {
            let fd = std::fs::File::open(&dev).expect("open loop device");
            moor_runtime::sys::loopdev::set_direct_io(&fd, true).expect("LOOP_SET_DIRECT_IO");
        }
        let (staging, target) = (node.sb.staging(id), node.sb.target("pod-io", id));
        k.stage(&stage_req(id, &dev, &staging, "ext4"))
            .expect("stage");
        k.publish(&publish_req(id, &staging, &target))
            .expect("publish");
        volumes.push((id, staging, target));
    }
    for job in &JOBS {
        let mut times: Vec<Vec<f64>> = vec![Vec::new(); 3];
        for _ in 0..rounds {
            let files = [
                disk.clone(),
                volumes[0].2.join("fio-file"),
                volumes[1].2.join("fio-file"),
            ];
            for (i, file) in files.iter().enumerate() {
                times[i].push(1e9 / fio(file, job, seconds));
            }
        }
        let [d, l, ld] = [0, 1, 2].map(|i| median(times[i].clone()));
        println!(
            "io/{}: disk {:.1} µs, loop {:.1} µs ({:.0}% of the disk's IOPS), loop with direct \
             I/O {:.1} µs ({:.0}%)",
            job.0,
            d / 1e3,
            l / 1e3,
            100.0 * d / l,
            ld / 1e3,
            100.0 * d / ld
        );
        write_result(&format!("io/{}/disk", job.0), d);
        write_result(&format!("io/{}/loop", job.0), l);
        write_result(&format!("io/{}/loop-dio", job.0), ld);
    }
    for (id, staging, target) in &volumes {
        k.unpublish(&unpublish_req(id, target)).expect("unpublish");
        k.unstage(&unstage_req(id, staging)).expect("unstage");
    }
    drop(node);
}
