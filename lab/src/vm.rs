//! Guests of the VM lab (`.ci/vm`): a real Debian kernel under QEMU, driven from the test on
//! the host through the guest's agent (`vm-agent`, over the guest's NIC on the Ceph test
//! cluster's bridge) and QEMU's monitor (pause, resume, kill).
//!
//! A [`Vm`] is booted by [`Vm::boot`], which returns once its agent answers; it is killed, with
//! its QEMU, when it drops, also when the test fails.

use std::io::{BufRead as _, BufReader, Write as _};
use std::net::TcpStream;
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use hyper_util::rt::TokioIo;
use tokio::io::{AsyncBufReadExt as _, AsyncWriteExt as _};
use tonic::transport::{Channel, Endpoint};

/// The port the agent listens on in the guest.
pub const AGENT_PORT: u16 = 7000;
/// How long a guest may take to boot and answer: TCG on a loaded two-core machine is slow.
pub const BOOT_DEADLINE: Duration = Duration::from_secs(600);
/// How long the agent may take to answer one request (a program it runs to its end).
pub const REQUEST_DEADLINE: Duration = Duration::from_secs(900);

/// The lab's script.
pub fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../.ci/vm")
}

/// Whether the lab can boot a guest here; prints why `test` is skipped when not. The lab is
/// set up by the test command (`.ci/vm setup`); a test never installs it. `MOOR_VM_LAB=off`
/// skips every guest: the test command's `cargo test --workspace` sets it, as it runs the
/// lab's tests in blocks of their own (with their quick modes), not twice.
pub fn available(test: &str) -> bool {
    check(test, None)
}

/// Whether the lab can boot the second kernel of Debian's package `package` (set up by
/// `MOOR_VM_KERNEL_PACKAGE=<package> .ci/vm setup`); prints why `test` is skipped when not.
pub fn available_kernel(test: &str, package: &str) -> bool {
    check(test, Some(package))
}

fn check(test: &str, package: Option<&str>) -> bool {
    if std::env::var("MOOR_VM_LAB").is_ok_and(|v| v == "off") {
        eprintln!(
            "{test}: skipped: MOOR_VM_LAB=off (the test command runs the VM lab's tests in \
             blocks of their own)"
        );
        return false;
    }
    let mut cmd = Command::new("bash");
    cmd.arg(script()).arg("check");
    if let Some(p) = package {
        cmd.env(KERNEL_PACKAGE_ENV, p);
    }
    match cmd.output() {
        Ok(o) if o.status.success() => true,
        Ok(o) => {
            eprintln!(
                "{test}: skipped: the VM lab cannot run here{}: {}",
                package
                    .map(|p| format!(" with the kernel {p}"))
                    .unwrap_or_default(),
                String::from_utf8_lossy(&o.stderr).trim()
            );
            false
        }
        Err(e) => {
            eprintln!("{test}: skipped: the VM lab's script cannot run: {e}");
            false
        }
    }
}

/// What names the lab's second kernel to `.ci/vm`.
const KERNEL_PACKAGE_ENV: &str = "MOOR_VM_KERNEL_PACKAGE";

/// A Linux bridge of a test's own, with the host's address (`.1`) on a /24, for a guest that
/// needs no Ceph cluster's bridge; removed when dropped.
#[derive(Debug)]
pub struct Bridge {
    /// The bridge's name (`<tag><pid>`).
    pub name: String,
    /// Its /24, without the last octet (`10.<second>.<n>`).
    pub net: String,
}

impl Bridge {
    /// A bridge named `tag` (at most 4 characters) and this process's id, on
    /// `10.<second>.<20 + pid % 200>.0/24`.
    pub fn new(tag: &str, second: u8) -> Self {
        let pid = std::process::id();
        let b = Self {
            name: format!("{tag}{}", pid % 100_000),
            net: format!("10.{second}.{}", 20 + pid % 200),
        };
        let ip = |args: &[&str]| {
            let out = Command::new("ip").args(args).output().expect("ip");
            assert!(out.status.success(), "ip {args:?}: {out:?}");
        };
        let _ = Command::new("ip").args(["link", "del", &b.name]).output();
        ip(&["link", "add", &b.name, "type", "bridge"]);
        ip(&["addr", "add", &format!("{}.1/24", b.net), "dev", &b.name]);
        ip(&["link", "set", &b.name, "up"]);
        b
    }
}

impl Drop for Bridge {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["link", "del", &self.name])
            .output();
    }
}

/// How a guest is booted.
#[derive(Debug, Clone)]
pub struct VmOptions {
    /// Its hostname (and the name in its files).
    pub name: String,
    /// The bridge its NIC is on.
    pub bridge: String,
    /// Its address on that bridge (without the prefix; a /24).
    pub ip: String,
    /// Host dirs it may write, at the same paths.
    pub rwdirs: Vec<PathBuf>,
    /// Where its console log, monitor socket and pid file go.
    pub dir: PathBuf,
    /// Guest memory.
    pub memory: String,
    /// Empty PCIe root ports (`hp0`...) for disks hot-plugged through QMP.
    pub hotplug: usize,
    /// More QEMU arguments, each passed whole (`-drive`, `-device`: disks attached at boot).
    pub qemu_opts: Vec<String>,
    /// More kernel command-line arguments (the LSM list that turns SELinux on).
    pub append: Vec<String>,
    /// Whether systemd-udevd runs in the guest (`.ci/vm run --no-udev` when not): only a test
    /// of what moor finds through udev needs it, and its coldplug is about half of a boot
    /// under TCG. Without it the guest's device nodes are devtmpfs's, moor-node finds disks
    /// through sysfs and the kernel's events, device-mapper makes its own nodes, and the
    /// console log holds the guest kernel's messages too.
    pub udev: bool,
}

/// A running guest.
#[derive(Debug)]
pub struct Vm {
    /// How it was booted.
    pub opts: VmOptions,
    child: Option<Child>,
    boots: u32,
    /// The second kernel's package it boots, or None: the lab's default kernel.
    kernel: Option<String>,
}

/// What a program run in the guest did.
#[derive(Debug, Clone)]
pub struct Output {
    /// Its exit code (None: killed by a signal, or it could not start).
    pub code: Option<i32>,
    /// Its stdout.
    pub stdout: String,
    /// Its stderr.
    pub stderr: String,
}

impl Output {
    /// Whether it exited 0.
    pub fn ok(&self) -> bool {
        self.code == Some(0)
    }
}

/// The file behind an embedded-backend volume, for a guest to bind to a loop device of its
/// own: asked of the controller by a ControllerPublishVolume to `node` (its publish context
/// names the file), then detached again on the host by a ControllerUnpublishVolume.
pub async fn embedded_volume_file(
    ctl: &mut moor_proto::csi::v1::controller_client::ControllerClient<tonic::transport::Channel>,
    volume: &moor_proto::csi::v1::Volume,
    node: &str,
    capability: moor_proto::csi::v1::VolumeCapability,
) -> String {
    use moor_proto::csi::v1 as csi;
    let published = ctl
        .controller_publish_volume(csi::ControllerPublishVolumeRequest {
            volume_id: volume.volume_id.clone(),
            node_id: node.into(),
            volume_capability: Some(capability),
            volume_context: volume.volume_context.clone(),
            ..Default::default()
        })
        .await
        .expect("ControllerPublishVolume")
        .into_inner();
    let file = published.publish_context[moor_runtime::contract::BACKING_FILE_KEY].clone();
    ctl.controller_unpublish_volume(csi::ControllerUnpublishVolumeRequest {
        volume_id: volume.volume_id.clone(),
        node_id: node.into(),
        ..Default::default()
    })
    .await
    .expect("ControllerUnpublishVolume");
    file
}

/// The keys of an encrypted volume's controller record (`encryptedDEK`, and
/// `encryptedDEKPending` while a rotation runs) as its ControllerPublishVolume to `node`
/// gives them to a stage; the host's loop device that call attaches is detached again (a
/// guest binds the file, or has it as a disk).
pub async fn embedded_record_keys(
    ctl: &mut moor_proto::csi::v1::controller_client::ControllerClient<tonic::transport::Channel>,
    volume: &moor_proto::csi::v1::Volume,
    node: &str,
    capability: moor_proto::csi::v1::VolumeCapability,
) -> std::collections::HashMap<String, String> {
    use moor_proto::csi::v1 as csi;
    let req = csi::ControllerPublishVolumeRequest {
        volume_id: volume.volume_id.clone(),
        node_id: node.into(),
        volume_capability: Some(capability),
        volume_context: volume.volume_context.clone(),
        ..Default::default()
    };
    let context = ctl
        .controller_publish_volume(req)
        .await
        .expect("ControllerPublishVolume")
        .into_inner()
        .publish_context;
    let detach = csi::ControllerUnpublishVolumeRequest {
        volume_id: volume.volume_id.clone(),
        node_id: node.into(),
        ..Default::default()
    };
    ctl.controller_unpublish_volume(detach)
        .await
        .expect("ControllerUnpublishVolume");
    context
        .into_iter()
        .filter(|(k, _)| k.starts_with("encryptedDEK"))
        .collect()
}

/// An encrypted ext4 volume of `mib` MiB (the `secret` key source, its KEK in `secrets`),
/// made by the controller `ctl`.
pub async fn create_encrypted_volume(
    ctl: &mut moor_proto::csi::v1::controller_client::ControllerClient<tonic::transport::Channel>,
    name: &str,
    mib: i64,
    secrets: std::collections::HashMap<String, String>,
) -> moor_proto::csi::v1::Volume {
    use moor_proto::csi::v1 as csi;
    let parameters = [("encrypted", "true"), ("kmsID", "secret")];
    let req = csi::CreateVolumeRequest {
        name: name.into(),
        capacity_range: Some(csi::CapacityRange {
            required_bytes: mib << 20,
            limit_bytes: 0,
        }),
        volume_capabilities: vec![crate::ceph::ext4()],
        parameters: parameters
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        secrets,
        ..Default::default()
    };
    ctl.create_volume(req)
        .await
        .unwrap_or_else(|e| panic!("CreateVolume of encrypted {name}: {e:?}"))
        .into_inner()
        .volume
        .unwrap_or_else(|| panic!("CreateVolume of {name} answered no volume"))
}

/// moor-controller on the host as node `node`'s, its embedded backend in `sandbox`'s data
/// dir, and a client of it (for the guests' encrypted volumes).
pub async fn start_embedded_controller(
    sandbox: &moor_privileged::Sandbox,
    node: &str,
) -> (
    moor_privileged::client::Daemon,
    moor_proto::csi::v1::controller_client::ControllerClient<Channel>,
) {
    let data = sandbox.data.join("controller").display().to_string();
    let socket = sandbox.root.join("controller.sock");
    let daemon = moor_privileged::client::Daemon::start_program(
        "moor-controller",
        &socket,
        &["--node-id", node, "--data-dir", data.as_str()],
    )
    .await;
    let client = moor_proto::csi::v1::controller_client::ControllerClient::new(
        moor_runtime::client::connect(&socket)
            .await
            .expect("the controller's socket"),
    );
    (daemon, client)
}

impl Vm {
    /// A guest for encrypted volumes: named `name`, on `bridge` at `.2`, writing `sandbox`'s
    /// state, kubelet and data dirs, with `memory`; dm-crypt (a module of the guest's kernel,
    /// which the lab copies) loaded and its target checked.
    pub fn boot_for_dm_crypt(
        name: &str,
        bridge: &Bridge,
        sandbox: &moor_privileged::Sandbox,
        memory: &str,
    ) -> Self {
        Self::boot_for_dm_crypt_with(name, bridge, sandbox, memory, Vec::new())
    }

    /// [`boot_for_dm_crypt`](Self::boot_for_dm_crypt) with more QEMU arguments (a TPM).
    pub fn boot_for_dm_crypt_with(
        name: &str,
        bridge: &Bridge,
        sandbox: &moor_privileged::Sandbox,
        memory: &str,
        qemu_opts: Vec<String>,
    ) -> Self {
        let vm = Self::boot(VmOptions {
            name: name.into(),
            bridge: bridge.name.clone(),
            ip: format!("{}.2", bridge.net),
            rwdirs: vec![
                sandbox.state.clone(),
                sandbox.kubelet.clone(),
                sandbox.data.clone(),
            ],
            dir: sandbox.root.join("vm"),
            memory: memory.into(),
            hotplug: 0,
            qemu_opts,
            append: Vec::new(),
            udev: false,
        });
        vm.sh("modprobe -a loop ext4 rbd dm_crypt && dmsetup targets | grep -qw crypt");
        vm
    }

    /// Whatever a test left: moor-node killed, nothing mounted under `kubelet`, no dm-crypt
    /// mapping open, no loop device bound, in the guest.
    pub fn clear_volumes(&self, kubelet: &Path) {
        let kubelet = kubelet.display().to_string();
        self.exec(&[
            "sh",
            "-c",
            &format!(
                "pkill -KILL -x moor-node; while pgrep -x moor-node >/dev/null; do sleep 0.1; done; \
                 for m in $(findmnt -rn -o TARGET | grep -E '^{kubelet}(/|$)' | sort -r); \
                 do umount \"$m\"; done; \
                 for d in $(dmsetup ls --target crypt | awk '{{print $1}}'); do cryptsetup close $d; done; \
                 losetup -D"
            ),
        ]);
    }

    /// Boots a guest running the agent and waits until the agent answers.
    pub fn boot(opts: VmOptions) -> Self {
        let mut vm = Self::launch(opts, None);
        vm.wait_booted();
        vm
    }

    /// [`boot`](Self::boot) on the lab's second kernel of Debian's package `package` (see
    /// [`available_kernel`]), also when it boots again.
    pub fn boot_kernel(opts: VmOptions, package: &str) -> Self {
        let mut vm = Self::launch(opts, Some(package.to_string()));
        vm.wait_booted();
        vm
    }

    /// Boots guests side by side (their QEMUs started at once, then each waited for): each
    /// returned once its agent answers.
    pub fn boot_all(opts: Vec<VmOptions>) -> Vec<Self> {
        let mut vms: Vec<Self> = opts.into_iter().map(|o| Self::launch(o, None)).collect();
        for vm in &mut vms {
            vm.wait_booted();
        }
        vms
    }

    fn launch(opts: VmOptions, kernel: Option<String>) -> Self {
        std::fs::create_dir_all(&opts.dir).expect("the guest's dir");
        let mut vm = Self {
            opts,
            child: None,
            boots: 0,
            kernel,
        };
        vm.spawn_qemu();
        vm
    }

    fn console(&self) -> PathBuf {
        self.opts
            .dir
            .join(format!("{}-console-{}.log", self.opts.name, self.boots))
    }

    /// The QEMU monitor's socket.
    pub fn qmp_socket(&self) -> PathBuf {
        self.opts.dir.join(format!("{}.qmp", self.opts.name))
    }

    fn pidfile(&self) -> PathBuf {
        self.opts.dir.join(format!("{}.pid", self.opts.name))
    }

    fn start(&mut self) {
        self.spawn_qemu();
        self.wait_booted();
    }

    /// Starts the lab's script, which boots the guest. Its parent-death signal is this
    /// thread's: the guest goes when the thread that booted it ends.
    fn spawn_qemu(&mut self) {
        self.boots += 1;
        let agent = moor_privileged::client::binary("vm-agent");
        assert!(agent.exists(), "{} is not built", agent.display());
        let console = std::fs::File::create(self.console()).expect("console log");
        let mut cmd = Command::new("bash");
        cmd.arg(script())
            .arg("run")
            .args(["--name", &self.opts.name])
            .args(["--net", &self.opts.bridge])
            .args(["--ip", &format!("{}/24", self.opts.ip)])
            .args(["--memory", &self.opts.memory])
            .args(["--hotplug", &self.opts.hotplug.to_string()])
            .args((!self.opts.udev).then_some("--no-udev"))
            .arg("--qmp")
            .arg(self.qmp_socket())
            .arg("--pidfile")
            .arg(self.pidfile());
        for d in &self.opts.rwdirs {
            cmd.arg("--rwdir").arg(d);
        }
        for o in &self.opts.qemu_opts {
            cmd.arg("--qemu-opt").arg(o);
        }
        for a in &self.opts.append {
            cmd.arg("--append").arg(a);
        }
        if let Some(p) = &self.kernel {
            cmd.env(KERNEL_PACKAGE_ENV, p);
        }
        // If the test dies without dropping the guest (killed), the script is told, and its
        // trap takes QEMU with it.
        moor_runtime::sys::parent_death::die_with_parent(&mut cmd, rustix::process::Signal::TERM);
        cmd.arg("--").arg(format!(
            "exec {} --listen {}:{AGENT_PORT}",
            agent.display(),
            self.opts.ip
        ));
        let child = cmd
            .stdin(Stdio::null())
            .stdout(console.try_clone().expect("console log"))
            .stderr(console)
            // Its own group: a kill of the group takes the script, virtme-ng and QEMU.
            .process_group(0)
            .spawn()
            .expect("spawn .ci/vm run");
        self.child = Some(child);
    }

    /// Waits until the agent of the guest [`spawn_qemu`](Self::spawn_qemu) started answers.
    fn wait_booted(&mut self) {
        let start = Instant::now();
        let booted = loop {
            if self.ping() {
                break start.elapsed();
            }
            if let Some(Ok(Some(status))) = self.child.as_mut().map(Child::try_wait) {
                panic!(
                    "guest {} ended ({status}) before its agent answered; its console:\n{}",
                    self.opts.name,
                    self.console_text()
                );
            }
            assert!(
                start.elapsed() < BOOT_DEADLINE,
                "guest {}'s agent at {}:{AGENT_PORT} did not answer within {BOOT_DEADLINE:?} \
                 of the boot; its console:\n{}",
                self.opts.name,
                self.opts.ip,
                self.console_text()
            );
            std::thread::sleep(Duration::from_millis(250));
        };
        eprintln!(
            "guest {} (boot {}) answered {:.1} s after QEMU started",
            self.opts.name,
            self.boots,
            booted.as_secs_f64()
        );
    }

    /// The console's output so far.
    pub fn console_text(&self) -> String {
        std::fs::read_to_string(self.console()).unwrap_or_default()
    }

    fn ping(&self) -> bool {
        self.request(&serde_json::json!({"op": "ping"}), Duration::from_secs(2))
            .is_ok_and(|v| v["ok"] == true)
    }

    fn request(
        &self,
        req: &serde_json::Value,
        connect_timeout: Duration,
    ) -> std::io::Result<serde_json::Value> {
        let addr = format!("{}:{AGENT_PORT}", self.opts.ip)
            .parse()
            .map_err(std::io::Error::other)?;
        let mut conn = TcpStream::connect_timeout(&addr, connect_timeout)?;
        // A guest that dies under a request never answers: fail then rather than hang.
        conn.set_read_timeout(Some(REQUEST_DEADLINE))?;
        writeln!(conn, "{req}")?;
        let mut line = String::new();
        BufReader::new(conn).read_line(&mut line)?;
        serde_json::from_str(&line).map_err(std::io::Error::other)
    }

    /// Runs `argv` in the guest to its end.
    pub fn exec(&self, argv: &[&str]) -> Output {
        let v = self
            .request(
                &serde_json::json!({"op": "exec", "argv": argv}),
                Duration::from_secs(30),
            )
            .unwrap_or_else(|e| panic!("exec {argv:?} in guest {}: {e}", self.opts.name));
        Output {
            code: v["code"].as_i64().map(|c| c as i32),
            stdout: v["stdout"].as_str().unwrap_or_default().to_string(),
            stderr: v["stderr"].as_str().unwrap_or_default().to_string(),
        }
    }

    /// Runs a shell command line in the guest; its output, or a panic naming what failed.
    pub fn sh(&self, line: &str) -> String {
        let o = self.exec(&["sh", "-c", line]);
        assert!(
            o.ok(),
            "in guest {}: `{line}` failed ({:?}): {}{}",
            self.opts.name,
            o.code,
            o.stdout,
            o.stderr
        );
        o.stdout
    }

    /// Starts `argv` in the guest's background, its output appended to `log` (a guest path).
    pub fn spawn(&self, argv: &[&str], log: &str) -> u32 {
        let v = self
            .request(
                &serde_json::json!({"op": "spawn", "argv": argv, "log": log}),
                Duration::from_secs(30),
            )
            .unwrap_or_else(|e| panic!("spawn {argv:?} in guest {}: {e}", self.opts.name));
        v["pid"]
            .as_u64()
            .unwrap_or_else(|| panic!("spawn {argv:?} in guest {}: {v}", self.opts.name))
            as u32
    }

    /// Runs `script` (bash) in the guest's background, its output in a file of its own beside
    /// `out` (a host path the guest writes through a shared dir), and waits until it prints
    /// `run-done`, at most `deadline`: its output, or a panic with it when a line starts with
    /// `fail`. For runs longer than [`exec`](Self::exec)'s 30 s (fio, a benchmark).
    pub fn run_script(&self, out: &Path, script: &str, deadline: Duration) -> String {
        // A file of its own each run: a file the host removed and the guest then opens again
        // can fail with ENOENT through the guest's cached view of the shared dir.
        static RUNS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = RUNS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let out = &out.with_extension(format!("{n}.out"));
        self.spawn(
            &["bash", "-c", &format!("{script}\necho run-done")],
            &out.display().to_string(),
        );
        let start = Instant::now();
        loop {
            let text = std::fs::read_to_string(out).unwrap_or_default();
            if text.lines().any(|l| l == "run-done") {
                if let Some(l) = text.lines().find(|l| l.starts_with("fail")) {
                    panic!("in guest {}: {l}\n{text}", self.opts.name);
                }
                return text;
            }
            assert!(
                start.elapsed() < deadline,
                "the run in guest {} did not end within {deadline:?}: {text}",
                self.opts.name
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// A gRPC channel to the Unix socket `socket` in the guest.
    pub async fn channel(&self, socket: &str) -> Result<Channel, tonic::transport::Error> {
        let addr = format!("{}:{AGENT_PORT}", self.opts.ip);
        let socket = socket.to_string();
        Endpoint::from_static("http://moor.invalid")
            .connect_with_connector(tower::service_fn(move |_| {
                let addr = addr.clone();
                let socket = socket.clone();
                async move {
                    let mut conn = tokio::net::TcpStream::connect(addr).await?;
                    let req = serde_json::json!({"op": "connect", "socket": socket});
                    conn.write_all(format!("{req}\n").as_bytes()).await?;
                    // The answer's line, read a byte at a time: what follows is the socket's.
                    let mut reader = tokio::io::BufReader::with_capacity(1, conn);
                    let mut line = String::new();
                    reader.read_line(&mut line).await?;
                    if !line.contains("\"ok\":true") {
                        return Err(std::io::Error::other(format!(
                            "the agent did not connect to {socket}: {line}"
                        )));
                    }
                    Ok::<_, std::io::Error>(TokioIo::new(reader.into_inner()))
                }
            }))
            .await
    }

    /// Sends one QMP command (`{"execute": ...}`) to QEMU; its answer.
    pub fn qmp(&self, command: serde_json::Value) -> serde_json::Value {
        let mut conn = std::os::unix::net::UnixStream::connect(self.qmp_socket())
            .unwrap_or_else(|e| panic!("QMP of guest {}: {e}", self.opts.name));
        conn.set_read_timeout(Some(Duration::from_secs(120)))
            .expect("QMP timeout");
        let mut reader = BufReader::new(conn.try_clone().expect("QMP"));
        let mut answer = |conn: &mut std::os::unix::net::UnixStream,
                          msg: Option<&serde_json::Value>| {
            if let Some(m) = msg {
                writeln!(conn, "{m}").expect("QMP write");
            }
            loop {
                let mut line = String::new();
                reader.read_line(&mut line).expect("QMP read");
                let v: serde_json::Value = serde_json::from_str(&line).expect("QMP json");
                // Events come between; the greeting and answers are what is waited for.
                if v.get("event").is_none() {
                    return v;
                }
            }
        };
        answer(&mut conn, None);
        answer(
            &mut conn,
            Some(&serde_json::json!({"execute": "qmp_capabilities"})),
        );
        answer(&mut conn, Some(&command))
    }

    /// Freezes the guest (QMP `stop`): a node that stopped answering, its state kept.
    pub fn pause(&self) {
        let a = self.qmp(serde_json::json!({"execute": "stop"}));
        assert!(a.get("return").is_some(), "QMP stop: {a}");
    }

    /// Lets a paused guest run again (QMP `cont`).
    pub fn resume(&self) {
        let a = self.qmp(serde_json::json!({"execute": "cont"}));
        assert!(a.get("return").is_some(), "QMP cont: {a}");
    }

    /// Cuts the guest off at once: its QEMU is SIGKILLed (a power cut, as far as the guest's
    /// disks and the cluster can tell), and waited for.
    pub fn kill(&mut self) {
        if let Some(pid) = std::fs::read_to_string(self.pidfile())
            .ok()
            .and_then(|p| p.trim().parse::<i32>().ok())
            .and_then(rustix::process::Pid::from_raw)
        {
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
        }
        // Its pid is no one's now: a later kill must not find it (and hit a process that
        // reused it).
        let _ = std::fs::remove_file(self.pidfile());
        if let Some(mut child) = self.child.take() {
            if let Some(pgid) = rustix::process::Pid::from_raw(child.id() as i32) {
                let _ = rustix::process::kill_process_group(pgid, rustix::process::Signal::KILL);
            }
            let _ = child.wait();
        }
    }

    /// Kills the guest and boots it again with the same options and files: a node's reboot.
    pub fn reboot(&mut self) {
        self.kill();
        self.start();
    }

    /// Reads a guest file whole (through `cat`).
    pub fn read(&self, path: &str) -> String {
        let o = self.exec(&["cat", path]);
        if o.ok() { o.stdout } else { String::new() }
    }
}

impl Drop for Vm {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A guest's shell line that appends a record to `data` and fsyncs it (fdatasync) at a time,
/// acknowledging each in its output (`acked N`, kept outside the volume) only once the fsync
/// succeeded; an error is said (`ERROR write|fsync N`) and ends it. It says `started` first and
/// `stopped` once `stop` shows.
pub fn fsync_writer(data: &Path, stop: &Path) -> String {
    format!(
        "echo started $$; i=0; while [ ! -e {stop} ]; do \
         printf 'record %08d\\n' $i >> {data} || {{ echo ERROR write $i; exit 1; }}; \
         sync -d {data} || {{ echo ERROR fsync $i; exit 1; }}; \
         echo acked $i; i=$((i+1)); done; echo stopped",
        stop = stop.display(),
        data = data.display()
    )
}

/// The records an [`fsync_writer`] acknowledged, by its output `log`.
pub fn acked(log: &str) -> Vec<u64> {
    log.lines()
        .filter_map(|l| l.strip_prefix("acked "))
        .filter_map(|n| n.trim().parse().ok())
        .collect()
}

/// Asserts that an [`fsync_writer`]'s output `log` says no error and one process throughout;
/// `what` names the writer.
pub fn assert_writer_clean(log: &str, what: &str) {
    assert!(
        !log.contains("ERROR"),
        "{what} saw an I/O error: {}",
        log.lines()
            .filter(|l| !l.starts_with("acked"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    assert_eq!(
        log.lines().filter(|l| l.starts_with("started")).count(),
        1,
        "{what}: one writer process throughout"
    );
}

/// A small deterministic generator (xorshift) for the lab's seeded choices: a seed printed by
/// a test replays its choices.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// The generator of `seed` (any value; 0 is made odd).
    pub fn new(seed: u64) -> Self {
        Self(seed | 1)
    }

    /// The next value.
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// A value in `0..n` (n > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
}
