//! The cost of encryption (issue 40, point 5): in one guest of the VM lab (`.ci/vm`, Debian's
//! kernel with dm-crypt under QEMU/TCG, one vCPU), in one run, an encrypted volume of the
//! embedded backend against the same-size volume unencrypted, side by side: each round makes a
//! fresh pair (moor-controller on the host, a loop device of each file in the guest, moor-node
//! in the guest) and takes turns, the order flipped every round, at
//!
//! * the first stage (luksFormat + open + mkfs + mount against mkfs + mount),
//! * the unstage (unmount + close against unmount) and a later stage (open + mount against
//!   mount), each NodeStageVolume's and NodeUnstageVolume's `micros` from moor-node's log;
//! * throughput through the published volume: fio in the guest (the host's, which the guest
//!   sees), direct I/O, 1 MiB sequential write and read, 4 KiB random read and write; without
//!   fio, dd with direct I/O for the sequential pair only.
//!
//! Each is printed as the medians and the median of the rounds' ratios encrypted/unencrypted.
//! Beside it: the PBKDF's share of an open (`cryptsetup open --test-passphrase`, the key slot's
//! PBKDF and nothing else, against a whole open and close) for moor's default (`pbkdf2`, 1000
//! iterations) and for `argon2id` as moor formats it (4 iterations, 64 MiB), with the memory
//! its key slot records;
//! and what TCG does to the cipher: the guest's CPU flags and `cryptsetup benchmark` in the
//! guest and on the host. Results go under `target/criterion/vm_crypt/` for `bench-report`.
//!
//! Run as root with the lab set up (`.ci/vm setup`), after `cargo build --release --bins`:
//! `cargo bench -p moor-bench --bench vm_crypt`. Skipped, with the reason, otherwise. 5 rounds
//! of 256 MiB volumes, 8 s per throughput run; `MOOR_BENCH_QUICK=1`: 3 rounds of 128 MiB, 3 s.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use moor_bench::storm::{nearest_rank, write_result};
use moor_lab::ceph::{ext4, publish};
use moor_lab::krbd_lab::start_node_in;
use moor_lab::vm::{Bridge, Vm};
use moor_privileged::client::Daemon;
use moor_privileged::requests::{unpublish_req, unstage_req};
use moor_privileged::{Sandbox, runtime};
use moor_proto::csi::v1 as csi;
use moor_proto::csi::v1::controller_client::ControllerClient;
use moor_proto::csi::v1::node_client::NodeClient;
use moor_runtime::contract::{BACKING_FILE_KEY, DEVICE_PATH_KEY};
use moor_runtime::keys::secret_entries;
use tonic::transport::Channel;

const MIB: i64 = 1 << 20;
/// The bench's KEK (a bench's: it guards nothing).
const KEK: [u8; 32] = [0x42; 32];
/// How long one run in the guest (fio, the PBKDF's rounds, a benchmark) may take.
const RUN_DEADLINE: Duration = Duration::from_secs(1800);
/// How long moor-node may take to log a call it answered.
const LOG_DEADLINE: Duration = Duration::from_secs(60);
/// The guest's node id.
const NODE: &str = "node-c";

/// The throughput runs: name, fio's `rw`, block size.
const IO: [(&str, &str, &str); 4] = [
    ("seq-write-1m", "write", "1M"),
    ("seq-read-1m", "read", "1M"),
    ("rand-read-4k", "randread", "4k"),
    ("rand-write-4k", "randwrite", "4k"),
];

fn secrets() -> HashMap<String, String> {
    secret_entries("bench-kek", &KEK).into_iter().collect()
}

/// A volume of the pair, made by the controller, bound to a loop device in the guest.
struct Volume {
    id: String,
    encrypted: bool,
    context: HashMap<String, String>,
    file: String,
    dev: String,
    staging: PathBuf,
    target: PathBuf,
}

impl Volume {
    fn kind(&self) -> &'static str {
        if self.encrypted { "encrypted" } else { "plain" }
    }

    fn stage_req(&self) -> csi::NodeStageVolumeRequest {
        csi::NodeStageVolumeRequest {
            volume_id: self.id.clone(),
            publish_context: HashMap::from([
                (DEVICE_PATH_KEY.into(), self.dev.clone()),
                (BACKING_FILE_KEY.into(), self.file.clone()),
            ]),
            staging_target_path: self.staging.display().to_string(),
            volume_capability: Some(ext4()),
            secrets: if self.encrypted {
                secrets()
            } else {
                HashMap::new()
            },
            volume_context: self.context.clone(),
        }
    }
}

/// CreateVolume (encrypted or not) of `mib`, its file found by a publish to the node (then
/// unpublished: the guest binds it), and a loop device of it in the guest.
async fn create(
    ctl: &mut ControllerClient<Channel>,
    sb: &Sandbox,
    vm: &Vm,
    name: &str,
    encrypted: bool,
    mib: i64,
) -> Volume {
    let parameters = if encrypted {
        HashMap::from([
            ("encrypted".into(), "true".into()),
            ("kmsID".into(), "secret".into()),
        ])
    } else {
        HashMap::new()
    };
    let v = ctl
        .create_volume(csi::CreateVolumeRequest {
            name: name.into(),
            capacity_range: Some(csi::CapacityRange {
                required_bytes: mib * MIB,
                limit_bytes: 0,
            }),
            volume_capabilities: vec![ext4()],
            parameters,
            secrets: if encrypted { secrets() } else { HashMap::new() },
            ..Default::default()
        })
        .await
        .expect("CreateVolume")
        .into_inner()
        .volume
        .expect("a volume");
    let file = moor_lab::vm::embedded_volume_file(ctl, &v, NODE, ext4()).await;
    let dev = vm
        .sh(&format!("losetup -f --show {file}"))
        .trim()
        .to_string();
    Volume {
        staging: sb.staging(name),
        target: sb.target("pod-bench", name),
        id: v.volume_id,
        encrypted,
        context: v.volume_context,
        file,
        dev,
    }
}

/// The `n`th (from 1) line of moor-node's log that answered `rpc` for `volume` OK, waited
/// for: its JSON.
fn logged(log: &Path, rpc: &str, volume: &str, n: usize) -> serde_json::Value {
    let start = Instant::now();
    loop {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        let hit = text
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|v| v["rpc"] == rpc && v["volume"] == volume && v["message"] == "ok")
            .nth(n - 1);
        if let Some(v) = hit {
            return v;
        }
        assert!(
            start.elapsed() < LOG_DEADLINE,
            "moor-node did not log answer {n} of {rpc} for {volume} within {LOG_DEADLINE:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The ms of the `n`th OK answer of `rpc` for `volume`, on moor-node's clock.
fn call_ms(log: &Path, rpc: &str, volume: &str, n: usize) -> f64 {
    logged(log, rpc, volume, n)["micros"]
        .as_f64()
        .expect("micros")
        / 1e3
}

/// The mkfs and mount ms of the first stage of `volume`, from moor-node's log.
fn format_steps(log: &Path, volume: &str) -> (f64, f64) {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    text.lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find(|v| v["volume"] == volume && v["message"] == "formatted blank device")
        .map(|v| {
            (
                v["mkfs_ms"].as_f64().unwrap_or(0.0),
                v["mount_ms"].as_f64().unwrap_or(0.0),
            )
        })
        .expect("the first stage's mkfs in moor-node's log")
}

/// Runs `script` (bash) in the guest (`Vm::run_script`, within [`RUN_DEADLINE`]).
fn guest_run(vm: &Vm, out: &Path, script: &str) -> String {
    vm.run_script(out, script, RUN_DEADLINE)
}

/// One throughput run through `v`'s published filesystem: bytes/s and I/Os per second.
fn throughput(
    vm: &Vm,
    out: &Path,
    v: &Volume,
    fio: bool,
    io: usize,
    mib: i64,
    secs: u64,
) -> (f64, f64) {
    let (name, rw, bs) = IO[io];
    let file = v.target.join("bench.dat");
    let file = file.display();
    let size = mib / 2;
    if fio {
        let json = out.with_extension(format!("{}-{name}-{}.json", v.kind(), v.id));
        guest_run(
            vm,
            out,
            &format!(
                "fio --name={name} --filename={file} --size={size}M --bs={bs} --rw={rw} \
                 --direct=1 --ioengine=psync --runtime={secs} --time_based \
                 --output-format=json --output={} || echo fail fio {name}",
                json.display()
            ),
        );
        let text = std::fs::read_to_string(&json).expect("fio's output");
        let start = text.find('{').expect("fio's JSON");
        let v: serde_json::Value = serde_json::from_str(&text[start..]).expect("fio's JSON");
        let dir = if rw.contains("read") { "read" } else { "write" };
        let job = &v["jobs"][0][dir];
        (
            job["bw_bytes"].as_f64().expect("bw_bytes"),
            job["iops"].as_f64().expect("iops"),
        )
    } else {
        // dd, direct I/O, sequential only.
        let (dd, bytes) = match rw {
            "write" => (
                format!("dd if=/dev/zero of={file} bs=1M count={size} oflag=direct conv=fsync"),
                size as f64 * MIB as f64,
            ),
            "read" => (
                format!("dd if={file} of=/dev/null bs=1M iflag=direct"),
                size as f64 * MIB as f64,
            ),
            _ => return (f64::NAN, f64::NAN),
        };
        let text = guest_run(
            vm,
            out,
            &format!(
                "t0=$EPOCHREALTIME; {dd} status=none || echo fail dd; t1=$EPOCHREALTIME; \
                 echo took $t0 $t1"
            ),
        );
        let l = text
            .lines()
            .find(|l| l.starts_with("took "))
            .expect("dd's times");
        let t: Vec<f64> = l
            .split_whitespace()
            .skip(1)
            .map(|x| x.parse().expect("a time"))
            .collect();
        let s = t[1] - t[0];
        (bytes / s, bytes / MIB as f64 / s)
    }
}

/// What a round measured of one volume.
#[derive(Debug, Default, Clone)]
struct Sample {
    first_stage: f64,
    mkfs: f64,
    unstage: f64,
    stage: f64,
    bw: [f64; 4],
    iops: [f64; 4],
}

fn median(mut v: Vec<f64>) -> f64 {
    v.retain(|x| x.is_finite());
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    v[nearest_rank(v.len(), 0.5)]
}

fn main() {
    let quick = moor_bench::quick();
    let (rounds, mib, secs) = if quick { (3, 128, 3) } else { (5, 256, 8) };
    let test = "vm_crypt";
    if !moor_lab::vm::available(test) {
        return;
    }
    let sb = Sandbox::new("vm-crypt");
    let bridge = Bridge::new("mcst", 252);
    let vm = Vm::boot_for_dm_crypt("moor-crypt-cost", &bridge, &sb, "2G");
    let log = sb.state.join("node.log");
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let out = sb.state.join("run.out");
        environment(&vm, &out);
        pbkdf(&vm, &sb, &out);
        runtime().block_on(pairs(&sb, &vm, &log, rounds, mib, secs))
    }));
    vm.clear_volumes(&sb.kubelet);
    match result {
        Ok(samples) => report(&samples, rounds, mib, secs),
        Err(e) => {
            eprintln!(
                "{test}: moor-node's log:\n{}",
                std::fs::read_to_string(&log).unwrap_or_default()
            );
            std::panic::resume_unwind(e);
        }
    }
}

/// What TCG does to the cipher: the guest's CPU's AES flags, and `cryptsetup benchmark` of
/// moor's cipher in the guest and on the host.
fn environment(vm: &Vm, out: &Path) {
    let flags = vm.sh(
        "grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\\n' | grep -E '^(aes|vaes|pclmulqdq|avx2)$' | tr '\\n' ' '; \
         echo; grep -m1 'model name' /proc/cpuinfo",
    );
    println!("the guest's CPU: {}", flags.trim().replace('\n', "; "));
    let bench = "cryptsetup benchmark --cipher aes-xts-plain64 --key-size 512 2>&1 | tail -n 2";
    let guest = guest_run(vm, out, &format!("{bench} || echo fail benchmark"));
    println!(
        "cryptsetup benchmark, aes-xts 512b, in the guest (TCG):\n{}",
        guest.replace("run-done\n", "")
    );
    let on_host = |line: &str| {
        std::process::Command::new("sh")
            .args(["-c", line])
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_else(|e| format!("cannot run: {e}"))
    };
    println!(
        "the same on the host (its kernel may lack AF_ALG, which the benchmark needs):\n{}",
        on_host(bench)
    );
    // The same user-space AES-XTS on both sides (the host has no AF_ALG to compare the
    // kernel's): what the emulation costs the cipher's instructions.
    let openssl =
        "openssl speed -elapsed -seconds 2 -bytes 4096 -evp aes-256-xts 2>/dev/null | tail -n 1";
    let guest = guest_run(vm, out, openssl);
    println!(
        "openssl speed, AES-256-XTS on 4 KiB (1000s of bytes/s): guest {}, host {}",
        guest.replace("run-done", "").trim(),
        on_host(openssl).trim()
    );
}

/// The PBKDF's share of an open: a scratch LUKS2 device formatted as moor formats it, with
/// each PBKDF moor takes; `--test-passphrase` (the PBKDF and the key slot) against a whole
/// open and close; the memory the key slot records.
fn pbkdf(vm: &Vm, sb: &Sandbox, out: &Path) {
    let dir = sb.data.join("pbkdf").display().to_string();
    // As moor formats them (`engine::crypt`'s fixed costs); a few opens each: TCG is slow.
    let n = 3;
    let text = guest_run(
        vm,
        out,
        &format!(
            "mkdir -p {dir}; f={dir}/luks.img; truncate -s 64M $f; d=$(losetup -f --show $f) || echo fail losetup; \
             k={dir}/key; head -c 32 /dev/urandom > $k; \
             for kdf in pbkdf2:1000 argon2id:4:65536; do IFS=: read p it m <<< \"$kdf\"; \
               t0=$EPOCHREALTIME; cryptsetup luksFormat --batch-mode --type luks2 --cipher aes-xts-plain64 \
                 --key-size 512 --sector-size 4096 --pbkdf $p --pbkdf-force-iterations $it \
                 ${{m:+--pbkdf-memory $m}} --key-file=$k $d \
                 || echo fail luksFormat $p; t1=$EPOCHREALTIME; \
               mem=$(cryptsetup luksDump $d | awk '/Memory:/ {{print $2; exit}}'); \
               echo format $p $it ${{mem:-0}} $t0 $t1; \
               for i in $(seq {n}); do t0=$EPOCHREALTIME; cryptsetup open --test-passphrase --key-file=$k $d \
                 || echo fail test-passphrase $p; t1=$EPOCHREALTIME; \
                 cryptsetup open --type luks2 --key-file=$k $d bench-kdf || echo fail open $p; t2=$EPOCHREALTIME; \
                 cryptsetup close bench-kdf || echo fail close; t3=$EPOCHREALTIME; \
                 echo open $p $t0 $t1 $t2 $t3; done; \
             done; losetup -d $d; rm -f $f $k"
        ),
    );
    println!(
        "\nthe PBKDF's share of an open (a scratch 64 MiB LUKS2 device in the guest, {n} opens each):\n"
    );
    println!(
        "| PBKDF as moor formats it | key slot's memory | luksFormat | the PBKDF (--test-passphrase) | open | close | PBKDF / open |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- |");
    for l in text.lines().filter(|l| l.starts_with("format ")) {
        let f: Vec<&str> = l.split_whitespace().collect();
        let (p, it, mem) = (f[1], f[2], f[3]);
        let format_ms =
            (f[5].parse::<f64>().unwrap_or(0.0) - f[4].parse::<f64>().unwrap_or(0.0)) * 1e3;
        let opens: Vec<Vec<f64>> = text
            .lines()
            .filter(|l| l.starts_with(&format!("open {p} ")))
            .map(|l| {
                l.split_whitespace()
                    .skip(2)
                    .map(|x| x.parse().expect("a time"))
                    .collect()
            })
            .collect();
        let kdf = median(opens.iter().map(|t| (t[1] - t[0]) * 1e3).collect());
        let open = median(opens.iter().map(|t| (t[2] - t[1]) * 1e3).collect());
        let close = median(opens.iter().map(|t| (t[3] - t[2]) * 1e3).collect());
        let mem = if mem == "0" {
            "none".to_string()
        } else {
            format!("{} MiB", mem.parse::<f64>().unwrap_or(0.0) / 1024.0)
        };
        println!(
            "| {p}, {it} iterations | {mem} | {format_ms:.0} ms | {kdf:.0} ms | {open:.0} ms | {close:.0} ms | {:.0}% |",
            kdf / open * 100.0
        );
        write_result(&format!("vm_crypt/pbkdf-{p}/test-passphrase"), kdf * 1e6);
        write_result(&format!("vm_crypt/pbkdf-{p}/open"), open * 1e6);
    }
}

/// The rounds: a fresh pair each, taking turns at every step, the order flipped each round.
async fn pairs(
    sb: &Sandbox,
    vm: &Vm,
    log: &Path,
    rounds: usize,
    mib: i64,
    secs: u64,
) -> Vec<(Sample, Sample)> {
    let data = sb.data.join("controller").display().to_string();
    let csocket = sb.root.join("controller.sock");
    let mut controller = Daemon::start_program(
        "moor-controller",
        &csocket,
        &["--node-id", NODE, "--data-dir", data.as_str()],
    )
    .await;
    let mut ctl = ControllerClient::new(
        moor_runtime::client::connect(&csocket)
            .await
            .expect("the controller's socket"),
    );
    let mut node: NodeClient<Channel> =
        start_node_in(vm, NODE, &sb.kubelet, "moor-node", &[], &sb.state, log).await;
    let fio = vm.exec(&["sh", "-c", "command -v fio"]).ok();
    if !fio {
        eprintln!("vm_crypt: no fio in the guest: dd with direct I/O, sequential only");
    }
    let out = sb.state.join("run.out");
    let mut samples = Vec::new();
    for round in 0..rounds {
        let enc = create(&mut ctl, sb, vm, &format!("pv-enc-{round}"), true, mib).await;
        let plain = create(&mut ctl, sb, vm, &format!("pv-plain-{round}"), false, mib).await;
        let order: [&Volume; 2] = if round % 2 == 0 {
            [&enc, &plain]
        } else {
            [&plain, &enc]
        };
        let mut s: HashMap<bool, Sample> = HashMap::new();
        for v in order {
            node.node_stage_volume(v.stage_req())
                .await
                .unwrap_or_else(|e| panic!("first stage of {}: {e:?}", v.id));
            let x = s.entry(v.encrypted).or_default();
            x.first_stage = call_ms(log, "NodeStageVolume", &v.id, 1);
            x.mkfs = format_steps(log, &v.id).0;
        }
        for v in order {
            node.node_publish_volume(publish(&v.id, &v.staging, &v.target, ext4()))
                .await
                .unwrap_or_else(|e| panic!("publish {}: {e:?}", v.id));
        }
        for io in 0..IO.len() {
            for v in order {
                let (bw, iops) = throughput(vm, &out, v, fio, io, mib, secs);
                let x = s.entry(v.encrypted).or_default();
                x.bw[io] = bw;
                x.iops[io] = iops;
            }
        }
        for v in order {
            node.node_unpublish_volume(unpublish_req(&v.id, &v.target))
                .await
                .unwrap_or_else(|e| panic!("unpublish {}: {e:?}", v.id));
        }
        for v in order {
            node.node_unstage_volume(unstage_req(&v.id, &v.staging))
                .await
                .unwrap_or_else(|e| panic!("unstage {}: {e:?}", v.id));
            s.entry(v.encrypted).or_default().unstage = call_ms(log, "NodeUnstageVolume", &v.id, 1);
        }
        for v in order {
            node.node_stage_volume(v.stage_req())
                .await
                .unwrap_or_else(|e| panic!("later stage of {}: {e:?}", v.id));
            s.entry(v.encrypted).or_default().stage = call_ms(log, "NodeStageVolume", &v.id, 2);
        }
        for v in order {
            node.node_unstage_volume(unstage_req(&v.id, &v.staging))
                .await
                .unwrap_or_else(|e| panic!("unstage {}: {e:?}", v.id));
            vm.sh(&format!("losetup -d {}", v.dev));
            ctl.delete_volume(csi::DeleteVolumeRequest {
                volume_id: v.id.clone(),
                ..Default::default()
            })
            .await
            .unwrap_or_else(|e| panic!("DeleteVolume {}: {e:?}", v.id));
        }
        let e = s.remove(&true).unwrap_or_default();
        let p = s.remove(&false).unwrap_or_default();
        eprintln!(
            "vm_crypt: round {round}: first stage {:.0}/{:.0} ms, stage {:.0}/{:.0} ms, \
             unstage {:.0}/{:.0} ms, seq write {:.1}/{:.1} MiB/s (encrypted/plain)",
            e.first_stage,
            p.first_stage,
            e.stage,
            p.stage,
            e.unstage,
            p.unstage,
            e.bw[0] / MIB as f64,
            p.bw[0] / MIB as f64
        );
        samples.push((e, p));
    }
    drop(node);
    controller.stop().await;
    samples
}

/// Prints the table (medians and the median of the paired ratios) and writes the results.
fn report(samples: &[(Sample, Sample)], rounds: usize, mib: i64, secs: u64) {
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!(
        "\nvm_crypt: an encrypted volume against the same unencrypted one, {rounds} paired rounds \
         of {mib} MiB ext4 volumes in a TCG guest (one vCPU), the order flipped each round; \
         throughput {secs} s a run, direct I/O; the host's load average: {}\n",
        load.split_whitespace()
            .take(3)
            .collect::<Vec<_>>()
            .join(" ")
    );
    println!(
        "| what | encrypted | unencrypted | encrypted / unencrypted (median of the rounds' ratios) |"
    );
    println!("| --- | --- | --- | --- |");
    let time = |name: &str, what: &str, f: fn(&Sample) -> f64| {
        let e = median(samples.iter().map(|(e, _)| f(e)).collect());
        let p = median(samples.iter().map(|(_, p)| f(p)).collect());
        let r = median(samples.iter().map(|(e, p)| f(e) / f(p)).collect());
        println!("| {what} | {e:.0} ms | {p:.0} ms | {r:.2}× |");
        write_result(&format!("vm_crypt/encrypted/{name}"), e * 1e6);
        write_result(&format!("vm_crypt/plain/{name}"), p * 1e6);
    };
    time(
        "first-stage",
        "first stage (NodeStageVolume: luksFormat + open + mkfs + mount, against mkfs + mount)",
        |s| s.first_stage,
    );
    time(
        "mkfs",
        "its mkfs.ext4 (on the mapping, against on the loop device)",
        |s| s.mkfs,
    );
    time(
        "stage",
        "a later stage (NodeStageVolume: open + mount, against mount)",
        |s| s.stage,
    );
    time(
        "unstage",
        "unstage (NodeUnstageVolume: unmount + close, against unmount)",
        |s| s.unstage,
    );
    for (i, (name, _, _)) in IO.iter().enumerate() {
        let e_bw = median(samples.iter().map(|(e, _)| e.bw[i]).collect());
        if !e_bw.is_finite() {
            continue;
        }
        let p_bw = median(samples.iter().map(|(_, p)| p.bw[i]).collect());
        let e_io = median(samples.iter().map(|(e, _)| e.iops[i]).collect());
        let p_io = median(samples.iter().map(|(_, p)| p.iops[i]).collect());
        let r = median(samples.iter().map(|(e, p)| e.bw[i] / p.bw[i]).collect());
        println!(
            "| {name} | {:.1} MiB/s ({e_io:.0} IOPS) | {:.1} MiB/s ({p_io:.0} IOPS) | {r:.2}× |",
            e_bw / MIB as f64,
            p_bw / MIB as f64
        );
        // As time per GiB, so that bench-report's ratio of times is the slowdown.
        write_result(
            &format!("vm_crypt/encrypted/{name}-per-gib"),
            1e9 * (1u64 << 30) as f64 / e_bw,
        );
        write_result(
            &format!("vm_crypt/plain/{name}-per-gib"),
            1e9 * (1u64 << 30) as f64 / p_bw,
        );
    }
}
