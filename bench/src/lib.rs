//! Shared pieces of the criterion benches in `bench/benches/`: a real `moor-node` in a sandbox with a
//! client on it, the CSI requests the benches send, fresh blank loop devices, a crowd of extra
//! mounts, the daemon's memory, and each group's time budget.
//!
//! Everything here cleans up on drop, also when a bench panics: the daemon is stopped, extra
//! mounts are detached, loop devices are released and their backing files removed.

pub mod safe_floor;
pub mod storm;

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use csi::node_client::NodeClient;
use moor_proto::csi::v1 as csi;
use tonic::transport::Channel;

use moor_node::engine::{Engine, EngineConfig};
use moor_node::journal::Journal;
use moor_node::sys::linux::Linux;

use moor_privileged::Sandbox;
use moor_privileged::client::{DEADLINE, Daemon, binary, connect};
pub use moor_privileged::requests::{cap, publish_req, stage_req, unpublish_req, unstage_req};

/// One mebibyte.
pub const MIB: u64 = 1 << 20;
/// One gibibyte.
pub const GIB: u64 = 1 << 30;

/// Whether `MOOR_BENCH_QUICK` asks for a fast smoke run (set and neither empty nor `0`).
pub fn quick() -> bool {
    std::env::var_os("MOOR_BENCH_QUICK").is_some_and(|v| !v.is_empty() && v != "0")
}

/// One fio job of the I/O benches: name, `rw`, block size, queue depth, fsync after every write.
pub type FioJob = (&'static str, &'static str, &'static str, u32, bool);

/// fio's jobs of the I/O benches (`io`, `vm_rbd_io`): 4 KiB random read and write at queue
/// depth 1 and 32, 1 MiB sequential read and write, and the writes again with an fsync after
/// each.
pub const FIO_JOBS: [FioJob; 8] = [
    ("randread-4k-qd1", "randread", "4k", 1, false),
    ("randread-4k-qd32", "randread", "4k", 32, false),
    ("randwrite-4k-qd1", "randwrite", "4k", 1, false),
    ("randwrite-4k-qd32", "randwrite", "4k", 32, false),
    ("read-1m", "read", "1m", 1, false),
    ("write-1m", "write", "1m", 1, false),
    ("randwrite-4k-qd1-fsync", "randwrite", "4k", 1, true),
    ("write-1m-fsync", "write", "1m", 1, true),
];

/// How long one criterion group may take: its sample count, warm-up and measurement time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Budget {
    /// Samples per benchmark (criterion's minimum is 10).
    pub samples: usize,
    /// Warm-up time per benchmark.
    pub warm_up: Duration,
    /// Measurement time per benchmark.
    pub measurement: Duration,
}

impl Budget {
    /// A budget for a full run, cut to 10 samples, 0.2 s warm-up and 0.5 s measurement when
    /// [`quick`] is set.
    pub fn new(samples: usize, warm_up: Duration, measurement: Duration) -> Self {
        let full = Self {
            samples: samples.max(10),
            warm_up,
            measurement,
        };
        if quick() {
            Self {
                samples: 10,
                warm_up: full.warm_up.min(Duration::from_millis(200)),
                measurement: full.measurement.min(Duration::from_millis(500)),
            }
        } else {
            full
        }
    }
}

/// moor's engine in this process, on the sandbox's kubelet dir and its own state dir
/// `<sandbox>/<state>`: the node's work without gRPC and without the daemon.
pub fn engine(sb: &Sandbox, state: &str) -> Engine<Linux> {
    let os = Arc::new(Linux::new(&sb.kubelet).expect("os"));
    let (journal, _) = Journal::open(&sb.root.join(state), false).expect("journal");
    let cfg = EngineConfig {
        kubelet_dir: sb.kubelet.clone(),
        ..EngineConfig::default()
    };
    Engine::new(os, Arc::new(journal), cfg)
}

/// Connects a Node client to `socket` on the calling task's runtime (a tonic channel lives on
/// the runtime that made it, so each runtime needs its own).
pub async fn node_client(socket: &Path) -> NodeClient<Channel> {
    NodeClient::new(connect(socket).await.expect("connect to moor-node"))
}

/// A CSI node plugin process serving on a Unix socket, with a client on a current-thread
/// runtime: moor-node in a [`Node`], or `bare-node` (the benches' floor) started by
/// [`Node::start_bare`]. Dropping it stops the process (SIGTERM, then waits).
#[derive(Debug)]
pub struct Plugin {
    /// A client on `rt`.
    pub client: NodeClient<Channel>,
    /// The plugin's process.
    pub daemon: Daemon,
    /// The runtime `client` lives on.
    pub rt: tokio::runtime::Runtime,
}

impl Plugin {
    /// Starts `program` with `args` (the socket's `--endpoint` is added), its stderr in `log`,
    /// and connects to `socket` once it answers. The process shares the calling thread's mount
    /// namespace.
    fn start(program: &Path, socket: PathBuf, args: &[&std::ffi::OsStr], log: &Path) -> Self {
        assert!(
            program.exists(),
            "{} is not built (cargo build --bins)",
            program.display()
        );
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("tokio runtime");
        // Dies with the bench even when the bench is killed (its cleanup then never runs): the
        // bench's main thread starts it and lives as long as the run.
        let child = moor_privileged::client::spawn_guarded(
            Command::new(program)
                .arg("--endpoint")
                .arg(format!("unix://{}", socket.display()))
                .args(args)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(File::create(log).expect("plugin log")),
        );
        let mut daemon = Daemon { child, socket };
        let client = rt.block_on(async {
            let channel = {
                let child = &mut daemon.child;
                moor_runtime::client::wait_answering(&daemon.socket, DEADLINE, || {
                    moor_runtime::client::exited(child)
                })
                .await
            };
            match channel {
                Ok(ch) => NodeClient::new(ch),
                Err(e) => panic!(
                    "{}: {e}: {}",
                    program.display(),
                    std::fs::read_to_string(log).unwrap_or_default()
                ),
            }
        });
        Self { client, daemon, rt }
    }

    /// The plugin's process id.
    pub fn pid(&self) -> u32 {
        self.daemon.child.id()
    }

    /// The plugin's socket.
    pub fn socket(&self) -> &Path {
        &self.daemon.socket
    }

    /// NodeStageVolume of `req`; panics on error.
    pub fn stage_request(&mut self, req: csi::NodeStageVolumeRequest) {
        self.rt
            .block_on(self.client.node_stage_volume(req))
            .expect("NodeStageVolume");
    }

    /// NodeStageVolume of `dev` as `fs` on `staging`; panics on error.
    pub fn stage(&mut self, vol: &str, dev: &Path, staging: &Path, fs: &str) {
        self.stage_request(stage_req(vol, dev, staging, fs));
    }

    /// NodeUnstageVolume; panics on error.
    pub fn unstage(&mut self, vol: &str, staging: &Path) {
        self.rt
            .block_on(self.client.node_unstage_volume(unstage_req(vol, staging)))
            .expect("NodeUnstageVolume");
    }

    /// NodePublishVolume then NodeUnpublishVolume; panics on error.
    pub fn publish_unpublish(&mut self, vol: &str, staging: &Path, target: &Path) {
        let client = &mut self.client;
        self.rt.block_on(async {
            client
                .node_publish_volume(publish_req(vol, staging, target))
                .await
                .expect("NodePublishVolume");
            client
                .node_unpublish_volume(unpublish_req(vol, target))
                .await
                .expect("NodeUnpublishVolume");
        });
    }

    /// `n` NodeGetCapabilities calls: the gRPC round trips of `n` CSI calls with no work
    /// behind them.
    pub fn null_calls(&mut self, n: usize) {
        let client = &mut self.client;
        self.rt.block_on(async {
            for _ in 0..n {
                client
                    .node_get_capabilities(csi::NodeGetCapabilitiesRequest {})
                    .await
                    .expect("NodeGetCapabilities");
            }
        });
    }
}

impl Drop for Plugin {
    fn drop(&mut self) {
        // On the runtime that holds the client's connection, so that it answers the plugin's
        // graceful stop and the plugin stops at once.
        let daemon = &mut self.daemon;
        let _ = self.rt.block_on(daemon.stop());
    }
}

/// A real `moor-node` in its own sandbox (private mount namespace of the calling thread, which
/// the daemon shares), with a client: a [`Plugin`], which it derefs to.
///
/// Dropping it stops the daemon, then the sandbox detaches every mount below it and releases
/// its loop devices.
#[derive(Debug)]
pub struct Node {
    /// The daemon and its client.
    pub plugin: Plugin,
    /// The sandbox: kubelet dir, state dir, loop devices.
    pub sb: Sandbox,
}

impl std::ops::Deref for Node {
    type Target = Plugin;
    fn deref(&self) -> &Plugin {
        &self.plugin
    }
}

impl std::ops::DerefMut for Node {
    fn deref_mut(&mut self) -> &mut Plugin {
        &mut self.plugin
    }
}

/// A bench's moor-node arguments: its state and kubelet dirs, a short grace at stop.
fn node_args<'a>(state: &'a Path, kubelet: &'a Path) -> Vec<&'a std::ffi::OsStr> {
    vec![
        "--node-id".as_ref(),
        "bench".as_ref(),
        "--shutdown-grace".as_ref(),
        "2".as_ref(),
        "--state-dir".as_ref(),
        state.as_os_str(),
        "--kubelet-dir".as_ref(),
        kubelet.as_os_str(),
    ]
}

impl Node {
    /// Enters a sandbox named `name` and starts `moor-node` in it, its log in
    /// `<sandbox>/moor-node.log` (at its default level, so the daemon does its usual work).
    pub fn start(name: &str) -> Self {
        Self::start_prepared(name, |_| {})
    }

    /// [`start`](Self::start), with `prepare` run on the sandbox before the daemon starts (a
    /// tmpfs on its kubelet dir, which the daemon holds from its start).
    pub fn start_prepared(name: &str, prepare: impl FnOnce(&Sandbox)) -> Self {
        let sb = Sandbox::new(name);
        prepare(&sb);
        let args = node_args(&sb.state, &sb.kubelet);
        let plugin = Plugin::start(
            &binary("moor-node"),
            sb.root.join("csi.sock"),
            &args,
            &sb.root.join("moor-node.log"),
        );
        Self { plugin, sb }
    }

    /// Starts a second `moor-node` in this sandbox, with a state dir and socket of its own
    /// (named by `tag`) and `extra` arguments: the same code otherwise configured, beside the
    /// first on the same kubelet dir (one of them at a time holds a volume).
    pub fn start_second(&self, tag: &str, extra: &[&str]) -> Plugin {
        self.start_second_program(tag, &binary("moor-node"), extra)
    }

    /// [`start_second`](Self::start_second) of another build of moor-node, `program` (an
    /// older commit's, to bisect with a paired bench).
    pub fn start_second_program(&self, tag: &str, program: &Path, extra: &[&str]) -> Plugin {
        let state = self.sb.root.join(format!("state-{tag}"));
        std::fs::create_dir_all(&state).expect("second state dir");
        let mut args = node_args(&state, &self.sb.kubelet);
        args.extend(extra.iter().map(|a| std::ffi::OsStr::new(*a)));
        Plugin::start(
            program,
            self.sb.root.join(format!("csi-{tag}.sock")),
            &args,
            &self.sb.root.join(format!("moor-node-{tag}.log")),
        )
    }

    /// Starts `program`, the `bare-node` binary (the bench's `CARGO_BIN_EXE_bare-node`), in
    /// this sandbox on a socket of its own: the least a plugin that speaks gRPC can be.
    pub fn start_bare(&self, program: &Path) -> Plugin {
        self.start_bare_with(program, &[])
    }

    /// [`start_bare`](Self::start_bare) with more arguments (`--kubelet`: every connection
    /// through the `:authority` fix, for clients that call as kubelet does).
    pub fn start_bare_with(&self, program: &Path, args: &[&str]) -> Plugin {
        let args: Vec<&std::ffi::OsStr> = args.iter().map(std::ffi::OsStr::new).collect();
        Plugin::start(
            program,
            self.sb.root.join("bare.sock"),
            &args,
            &self.sb.root.join("bare-node.log"),
        )
    }

    /// Starts the reference driver `hostpathplugin` (at `program`) in this sandbox on a socket
    /// of its own, its state in `<sandbox>/hostpath`.
    pub fn start_hostpath(&self, program: &Path) -> Plugin {
        let state = self.sb.root.join("hostpath");
        std::fs::create_dir_all(&state).expect("hostpath state dir");
        let state_arg = format!("--statedir={}", state.display());
        Plugin::start(
            program,
            self.sb.root.join("hostpath.sock"),
            &[
                "--nodeid=bench".as_ref(),
                "--drivername=hostpath.csi.k8s.io".as_ref(),
                state_arg.as_ref(),
            ],
            &self.sb.root.join("hostpath.log"),
        )
    }

    /// A staged ext4 volume `vol` on a fresh loop device of `size` bytes (formatted by the
    /// daemon, as a blank device is), and a publish target for it. Returns (staging, target).
    pub fn staged_volume(&mut self, vol: &str, size: u64) -> (PathBuf, PathBuf) {
        let dev = self.sb.loop_device(&format!("{vol}.img"), size);
        let staging = self.sb.staging(vol);
        let target = self.sb.target(&format!("pod-{vol}"), vol);
        self.stage(vol, &dev, &staging, "ext4");
        (staging, target)
    }
}

/// A fresh blank loop device on its own sparse backing file. Dropping it closes the device,
/// which the kernel then detaches (it is marked autoclear), and removes the backing file.
#[derive(Debug)]
pub struct BlankDevice {
    /// The loop device.
    pub dev: PathBuf,
    file: PathBuf,
    held: Option<File>,
}

impl BlankDevice {
    /// Makes `file` a sparse file of `size` bytes and attaches it to a free loop device.
    pub fn new(file: PathBuf, size: u64) -> Self {
        File::create(&file)
            .and_then(|f| f.set_len(size))
            .expect("sparse backing file");
        let out = Command::new("losetup")
            .args(["--find", "--show", "--direct-io=off"])
            .arg(&file)
            .output()
            .expect("losetup");
        if !out.status.success() {
            let _ = std::fs::remove_file(&file);
            panic!("losetup: {}", String::from_utf8_lossy(&out.stderr));
        }
        let dev = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        let held = File::open(&dev);
        // Held open, the detach request only marks the device autoclear: it goes when the last
        // user does, even if this process is killed. Not held, it is detached at once.
        let _ = Command::new("losetup").arg("-d").arg(&dev).status();
        let held = match held {
            Ok(f) => f,
            Err(e) => {
                let _ = std::fs::remove_file(&file);
                panic!("open {}: {e}", dev.display());
            }
        };
        Self {
            dev,
            file,
            held: Some(held),
        }
    }
}

impl Drop for BlankDevice {
    fn drop(&mut self) {
        self.held.take();
        let _ = std::fs::remove_file(&self.file);
    }
}

/// Extra mounts that crowd the mount namespace: one tmpfs holding a source dir bind-mounted
/// onto sibling dirs. Dropping it detaches the tmpfs and with it every bind below.
#[derive(Debug)]
pub struct Crowd {
    root: PathBuf,
    source: PathBuf,
    binds: usize,
}

impl Crowd {
    /// Mounts a tmpfs on `root` (made if missing).
    pub fn new(root: PathBuf) -> std::io::Result<Self> {
        std::fs::create_dir_all(&root)?;
        rustix::mount::mount(
            "moor-crowd",
            root.as_path(),
            "tmpfs",
            rustix::mount::MountFlags::empty(),
            None,
        )?;
        let crowd = Self {
            source: root.join("source"),
            root,
            binds: 0,
        };
        std::fs::create_dir(&crowd.source)?;
        Ok(crowd)
    }

    /// Adds bind mounts until there are `binds` of them.
    pub fn grow_to(&mut self, binds: usize) -> std::io::Result<()> {
        while self.binds < binds {
            let dir = self.root.join(format!("m{}", self.binds));
            std::fs::create_dir(&dir)?;
            rustix::mount::mount_bind(self.source.as_path(), dir.as_path())?;
            self.binds += 1;
        }
        Ok(())
    }

    /// How many bind mounts it holds.
    pub fn binds(&self) -> usize {
        self.binds
    }
}

impl Drop for Crowd {
    fn drop(&mut self) {
        let _ = rustix::mount::unmount(self.root.as_path(), rustix::mount::UnmountFlags::DETACH);
    }
}

/// The number of mounts the calling thread's mount namespace holds.
pub fn mount_count() -> usize {
    std::fs::read("/proc/thread-self/mountinfo")
        .map(|t| t.iter().filter(|&&b| b == b'\n').count())
        .unwrap_or(0)
}

/// A process's resident memory, from `/proc/<pid>/status`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Memory {
    /// VmRSS: resident now, KiB.
    pub rss_kib: u64,
    /// VmHWM: the peak resident set since start or the last [`reset_peak`], KiB.
    pub hwm_kib: u64,
}

/// Reads VmRSS and VmHWM of `pid`.
pub fn memory(pid: u32) -> std::io::Result<Memory> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let field = |name: &str| -> std::io::Result<u64> {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
            .ok_or_else(|| std::io::Error::other(format!("no {name} in /proc/{pid}/status")))
    };
    Ok(Memory {
        rss_kib: field("VmRSS:")?,
        hwm_kib: field("VmHWM:")?,
    })
}

/// Resets the peak resident set (VmHWM) of `pid` to its current resident set.
pub fn reset_peak(pid: u32) -> std::io::Result<()> {
    std::fs::write(format!("/proc/{pid}/clear_refs"), "5")
}

/// KiB as MiB.
pub fn mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}

/// Where criterion writes its results: `$CRITERION_HOME`, else `$CARGO_TARGET_DIR/criterion`,
/// else `criterion` in the target dir holding the running executable (`target/<profile>/` or
/// `target/<profile>/deps/`).
pub fn criterion_dir() -> PathBuf {
    if let Some(home) = std::env::var_os("CRITERION_HOME") {
        return PathBuf::from(home);
    }
    if let Some(target) = std::env::var_os("CARGO_TARGET_DIR") {
        return PathBuf::from(target).join("criterion");
    }
    let exe = std::env::current_exe().unwrap_or_default();
    let mut dir = exe.parent().unwrap_or(Path::new(".")).to_path_buf();
    if dir.ends_with("deps") {
        dir.pop();
    }
    dir.pop();
    dir.join("criterion")
}

/// Prints the daemon's memory and writes it to `memory.txt` in [`criterion_dir`]: the line
/// printed, then `idle_rss_kib <n>` and, if measured, `peak_hwm_kib <n>`.
pub fn report_memory(idle: Memory, peak: Option<Memory>) -> std::io::Result<PathBuf> {
    let line = match peak {
        Some(p) => format!(
            "moor-node RSS idle: {:.1} MiB, peak under 64 clients: {:.1} MiB",
            mib(idle.rss_kib),
            mib(p.hwm_kib)
        ),
        None => format!(
            "moor-node RSS idle: {:.1} MiB, peak under 64 clients: not measured",
            mib(idle.rss_kib)
        ),
    };
    println!("{line}");
    let mut text = format!("{line}\nidle_rss_kib {}\n", idle.rss_kib);
    if let Some(p) = peak {
        text.push_str(&format!("peak_hwm_kib {}\n", p.hwm_kib));
    }
    let dir = criterion_dir();
    std::fs::create_dir_all(&dir)?;
    let path = dir.join("memory.txt");
    std::fs::write(&path, text)?;
    Ok(path)
}

/// The mkfs command moor runs for a blank device (the same program and arguments as the
/// engine's, without the force flag).
pub fn mkfs_command(fs: &str, dev: &Path) -> Command {
    let mut cmd = Command::new(format!("mkfs.{fs}"));
    match fs {
        "ext2" | "ext3" | "ext4" => cmd.args([
            "-q",
            "-E",
            "lazy_itable_init=1,lazy_journal_init=1,nodiscard",
        ]),
        _ => cmd.args(["-q", "-K"]),
    };
    cmd.arg(dev).stdin(Stdio::null());
    cmd
}

/// Runs moor's mkfs command for `fs` on `dev` to completion; Err says why it failed.
pub fn mkfs(fs: &str, dev: &Path) -> Result<(), String> {
    let out = mkfs_command(fs, dev)
        .output()
        .map_err(|e| format!("mkfs.{fs}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "mkfs.{fs} {}: {}",
            dev.display(),
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

/// The mount data moor always passes for `fs` (xfs gets `nouuid`).
pub fn mount_data(fs: &str) -> Option<&'static std::ffi::CStr> {
    (fs == "xfs").then_some(c"nouuid")
}

/// A criterion measurement whose value is a ratio of times: a subject against its reference,
/// run interleaved in the same sample (see [`paired`]). On a machine whose speed drifts from
/// one minute to the next, two benches run one after the other can each see another machine;
/// a pair measured turn by turn sees the same one.
#[derive(Debug, Default, Clone, Copy)]
pub struct Paired;

impl criterion::measurement::Measurement for Paired {
    type Intermediate = ();
    type Value = f64;

    fn start(&self) {}

    fn end(&self, (): ()) -> f64 {
        // Only `iter_custom` with [`paired`] gives a meaningful value.
        0.0
    }

    fn add(&self, v1: &f64, v2: &f64) -> f64 {
        v1 + v2
    }

    fn zero(&self) -> f64 {
        0.0
    }

    fn to_f64(&self, value: &f64) -> f64 {
        *value
    }

    fn formatter(&self) -> &dyn criterion::measurement::ValueFormatter {
        &RatioFormat
    }
}

/// Prints a [`Paired`] value as a ratio.
#[derive(Debug)]
struct RatioFormat;

impl criterion::measurement::ValueFormatter for RatioFormat {
    fn scale_values(&self, _typical: f64, _values: &mut [f64]) -> &'static str {
        "×"
    }

    fn scale_throughputs(
        &self,
        _typical: f64,
        _throughput: &criterion::Throughput,
        _values: &mut [f64],
    ) -> &'static str {
        "×"
    }

    fn scale_for_machines(&self, _values: &mut [f64]) -> &'static str {
        "ratio"
    }
}

/// A criterion group named `name` with `budget`, sampled flat (every sample runs the same
/// number of iterations: right for benches whose iterations take milliseconds, and for
/// [`Paired`] ones, whose value is already a per-round ratio).
pub fn flat_group<'a, M: criterion::measurement::Measurement>(
    c: &'a mut criterion::Criterion<M>,
    name: &str,
    budget: Budget,
) -> criterion::BenchmarkGroup<'a, M> {
    let mut g = c.benchmark_group(name);
    g.sample_size(budget.samples)
        .warm_up_time(budget.warm_up)
        .measurement_time(budget.measurement)
        .sampling_mode(criterion::SamplingMode::Flat);
    g
}

/// The value of `iters` rounds of a [`Paired`] bench: each round runs `reference` and `subject`
/// once, in turn (which goes first alternates), each returning the time its timed part took.
/// The value is the median of the rounds' ratios (subject over reference), times `iters`:
/// criterion divides by the rounds, so each sample reads as its median ratio. A stall of the
/// machine (a vCPU the host takes away for a while) hits a round or two of a sample, whose
/// ratios the median then leaves out, where a ratio of sums would carry it.
pub fn paired(
    iters: u64,
    mut reference: impl FnMut() -> Duration,
    mut subject: impl FnMut() -> Duration,
) -> f64 {
    let mut ratios: Vec<f64> = (0..iters)
        .map(|i| {
            let (r, s) = if i % 2 == 0 {
                let r = reference();
                (r, subject())
            } else {
                let s = subject();
                (reference(), s)
            };
            s.as_secs_f64() / r.as_secs_f64().max(1e-12)
        })
        .collect();
    median(&mut ratios) * iters as f64
}

/// The median of `values` (the mean of the middle two for an even count; 0 for none).
pub fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    match values.len() {
        0 => 0.0,
        n if n % 2 == 1 => values[n / 2],
        n => (values[n / 2 - 1] + values[n / 2]) / 2.0,
    }
}

/// How long `f` takes.
pub fn timed(f: impl FnOnce()) -> Duration {
    let start = Instant::now();
    f();
    start.elapsed()
}

/// A [`Paired`] criterion, configured from the bench's command line as criterion's own is.
pub fn paired_criterion() -> criterion::Criterion<Paired> {
    criterion::Criterion::default()
        .with_measurement(Paired)
        .configure_from_args()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_takes_the_middle() {
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut [4.0, 1.0, 2.0, 3.0]), 2.5);
        assert_eq!(median(&mut []), 0.0);
    }

    #[test]
    fn a_paired_value_is_the_median_round_ratio_times_the_rounds() {
        // The subject takes twice the reference, except in one round the machine stalled.
        let mut round = 0;
        let value = paired(
            5,
            || Duration::from_micros(100),
            || {
                round += 1;
                Duration::from_micros(if round == 3 { 50_000 } else { 200 })
            },
        );
        assert!((value / 5.0 - 2.0).abs() < 1e-9, "{value}");
    }
}
