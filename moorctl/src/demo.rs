//! `moorctl demo`: starts moor-controller (embedded backend) and moor-node in a temporary dir
//! and walks a whole volume life as Kubernetes would, printing each step and how long it took.
//!
//! Everything it makes is undone in reverse order, also when a step fails or on SIGINT/SIGTERM:
//! the first signal lets the running step finish and then cleans up; a second one abandons the
//! running step at once. Each undo is recorded before its call is made, so a call cut short is
//! undone too. The whole demo runs in a private mount namespace, so no mount can reach the
//! host; loop devices, the only global things it makes, are checked for afterwards.

use std::collections::HashMap;
use std::future::Future;
use std::io::{IsTerminal as _, Write as _};
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicI32, AtomicU32, Ordering};
use std::time::{Duration, Instant};

use csi::controller_client::ControllerClient;
use csi::node_client::NodeClient;
use csi::volume_capability::{AccessMode, AccessType, BlockVolume, MountVolume, access_mode::Mode};
use moor_proto::csi::v1 as csi;
use tokio::signal::unix::{SignalKind, signal};
use tonic::transport::Channel;

use crate::cli::{DemoArgs, Output};
use crate::client::connect_path;
use crate::error::{CliError, code_name};

const GIB: i64 = 1 << 30;
const NODE: &str = "demo-node";
const HELLO: &str = "hello from moor\n";
/// What an empty log tail reads as.
const NOTHING: &str = "(its log says nothing)";

/// A step that failed, and why.
#[derive(Debug, Clone)]
struct Failure {
    step: String,
    reason: String,
    /// Stopped by a signal rather than by an error.
    interrupted: bool,
}

/// Signals received so far.
#[derive(Debug, Default)]
struct Interrupts {
    count: AtomicU32,
    last: AtomicI32,
}

impl Interrupts {
    fn count(&self) -> u32 {
        self.count.load(Ordering::SeqCst)
    }

    fn name(&self) -> &'static str {
        if self.last.load(Ordering::SeqCst) == libc::SIGTERM {
            "SIGTERM"
        } else {
            "SIGINT"
        }
    }
}

/// How steps are shown.
#[derive(Debug)]
struct Ui {
    /// A spinner is drawn on stderr only when it is a terminal.
    spinner: bool,
    interrupts: Arc<Interrupts>,
}

impl Ui {
    /// Runs one step: a spinner with the elapsed time while it runs, then `ok`/`FAIL`, its
    /// name and its duration. With `cancellable`, a second signal abandons it.
    async fn step<T>(
        &self,
        name: &str,
        cancellable: bool,
        fut: impl Future<Output = Result<T, String>>,
    ) -> Result<T, Failure> {
        if cancellable && self.interrupts.count() > 0 {
            let reason = format!("interrupted by {} before this step", self.interrupts.name());
            println!("  STOP  {name}\n        {reason}");
            return Err(Failure {
                step: name.to_string(),
                reason,
                interrupted: true,
            });
        }
        let start = Instant::now();
        let mut fut = std::pin::pin!(fut);
        let mut frame = 0usize;
        let r = loop {
            tokio::select! {
                r = &mut fut => break r,
                () = tokio::time::sleep(Duration::from_millis(100)) => {
                    if cancellable && self.interrupts.count() > 1 {
                        break Err(format!(
                            "abandoned on a second {}", self.interrupts.name()
                        ));
                    }
                    if self.spinner {
                        let frames = ['|', '/', '-', '\\'];
                        let note = if self.interrupts.count() > 0 {
                            " (interrupted: finishing this step, then cleaning up)"
                        } else {
                            ""
                        };
                        eprint!(
                            "\r\x1b[2K  {} {name} {:.1}s{note}",
                            frames.get(frame % 4).copied().unwrap_or('|'),
                            start.elapsed().as_secs_f64()
                        );
                        let _ = std::io::stderr().flush();
                        frame += 1;
                    }
                }
            }
        };
        if self.spinner && frame > 0 {
            eprint!("\r\x1b[2K");
            let _ = std::io::stderr().flush();
        }
        let ms = start.elapsed().as_secs_f64() * 1000.0;
        match &r {
            Ok(_) => println!("  ok    {name:<62} {ms:>9.1} ms"),
            Err(e) => println!(
                "  FAIL  {name:<62} {ms:>9.1} ms\n        {}",
                e.trim_end().replace('\n', "\n        ")
            ),
        }
        let interrupted = cancellable && self.interrupts.count() > 1;
        r.map_err(|reason| Failure {
            step: name.to_string(),
            reason,
            interrupted,
        })
    }
}

/// A gRPC error as a sentence with its code.
fn status(rpc: &'static str) -> impl FnOnce(tonic::Status) -> String {
    move |s| format!("{rpc} failed: {}: {}", code_name(s.code()), s.message())
}

/// One of the daemons, in its own process group (so a terminal's Ctrl-C reaches only moorctl,
/// which then stops it in order), logging to a file in the demo dir.
#[derive(Debug)]
struct Daemon {
    name: &'static str,
    child: Child,
    log: PathBuf,
}

impl Daemon {
    fn spawn(
        bin: &Path,
        name: &'static str,
        socket: &Path,
        args: &[&str],
        dir: &Path,
    ) -> Result<Self, String> {
        let log = dir.join(format!("{name}.log"));
        let out = std::fs::File::create(&log).map_err(|e| format!("{}: {e}", log.display()))?;
        let err = out
            .try_clone()
            .map_err(|e| format!("{}: {e}", log.display()))?;
        let mut cmd = Command::new(bin);
        crate::sys::terminate_with_parent(&mut cmd);
        let child = cmd
            .arg("--endpoint")
            .arg(format!("unix://{}", socket.display()))
            .args(args)
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .process_group(0)
            .spawn()
            .map_err(|e| format!("cannot start {}: {e}", bin.display()))?;
        Ok(Self { name, child, log })
    }

    /// Waits until the socket answers, or the daemon dies.
    async fn wait_ready(&mut self, socket: &Path) -> Result<Channel, String> {
        let start = Instant::now();
        loop {
            if let Ok(Some(st)) = self.child.try_wait() {
                return Err(format!(
                    "{} exited at start ({st}): {}",
                    self.name,
                    self.log_tail(5, false)
                ));
            }
            if let Ok(c) = connect_path(socket, Duration::from_secs(2)).await {
                return Ok(c);
            }
            if start.elapsed() > Duration::from_secs(30) {
                return Err(format!(
                    "{} did not answer on {} within 30 s",
                    self.name,
                    socket.display()
                ));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// SIGTERM, then up to 30 s for it to exit, then SIGKILL.
    async fn stop(&mut self) -> Result<(), String> {
        if let Ok(Some(st)) = self.child.try_wait() {
            return Err(format!("{} had already exited ({st})", self.name));
        }
        if let Some(pid) = rustix::process::Pid::from_raw(self.child.id() as i32) {
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
        }
        let start = Instant::now();
        loop {
            match self.child.try_wait() {
                Ok(Some(st)) if st.success() => return Ok(()),
                Ok(Some(st)) => return Err(format!("{} exited with {st}", self.name)),
                Ok(None) if start.elapsed() > Duration::from_secs(30) => {
                    let _ = self.child.kill();
                    let _ = self.child.wait();
                    return Err(format!("{} did not stop within 30 s: killed", self.name));
                }
                Ok(None) => tokio::time::sleep(Duration::from_millis(20)).await,
                Err(e) => return Err(format!("waiting for {}: {e}", self.name)),
            }
        }
    }

    /// The last `n` lines of its log (only warnings and errors with `problems`), on one line.
    fn log_tail(&self, n: usize, problems: bool) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text
            .lines()
            .filter(|l| !problems || l.contains("WARN") || l.contains("ERROR"))
            .collect();
        let tail = lines
            .get(lines.len().saturating_sub(n)..)
            .unwrap_or_default();
        if tail.is_empty() {
            NOTHING.into()
        } else {
            tail.join(" | ")
        }
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// A volume the demo asked for: its request, so an interrupted create can be repeated
/// (CreateVolume is idempotent by name) to learn the id to delete.
#[derive(Debug, Clone)]
struct MadeVolume {
    request: csi::CreateVolumeRequest,
    id: Option<String>,
}

/// What the demo asked for, recorded before each call, undone in reverse.
#[derive(Debug, Default)]
struct Made {
    volumes: Vec<MadeVolume>,
    snapshots: Vec<(csi::CreateSnapshotRequest, Option<String>)>,
    attached: Vec<String>,
    staged: Vec<(String, PathBuf)>,
    published: Vec<(String, PathBuf)>,
}

impl Made {
    /// A volume's name, for people, or its id if it is not one the demo made.
    fn label<'a>(&'a self, id: &'a str) -> &'a str {
        self.volumes
            .iter()
            .find(|v| v.id.as_deref() == Some(id))
            .map_or(id, |v| v.request.name.as_str())
    }
}

/// The demo's state.
#[derive(Debug)]
struct Demo {
    ctl: ControllerClient<Channel>,
    node: NodeClient<Channel>,
    kubelet: PathBuf,
    state_dir: PathBuf,
    root: PathBuf,
    fs: String,
    made: Made,
}

fn mount_cap(fs: &str) -> csi::VolumeCapability {
    csi::VolumeCapability {
        access_mode: Some(AccessMode {
            mode: Mode::SingleNodeWriter as i32,
        }),
        access_type: Some(AccessType::Mount(MountVolume {
            fs_type: fs.into(),
            ..Default::default()
        })),
    }
}

fn block_cap() -> csi::VolumeCapability {
    csi::VolumeCapability {
        access_mode: Some(AccessMode {
            mode: Mode::SingleNodeWriter as i32,
        }),
        access_type: Some(AccessType::Block(BlockVolume {})),
    }
}

fn io(what: &Path) -> impl FnOnce(std::io::Error) -> String + '_ {
    move |e| format!("{}: {e}", what.display())
}

impl Demo {
    async fn create(&mut self, request: csi::CreateVolumeRequest) -> Result<String, String> {
        let index = self.made.volumes.len();
        self.made.volumes.push(MadeVolume {
            request: request.clone(),
            id: None,
        });
        let id = self
            .ctl
            .create_volume(request)
            .await
            .map_err(status("CreateVolume"))?
            .into_inner()
            .volume
            .map(|v| v.volume_id)
            .ok_or("CreateVolume answered without a volume")?;
        if let Some(m) = self.made.volumes.get_mut(index) {
            m.id = Some(id.clone());
        }
        Ok(id)
    }

    async fn attach(
        &mut self,
        vol: &str,
        cap: csi::VolumeCapability,
    ) -> Result<HashMap<String, String>, String> {
        self.made.attached.push(vol.into());
        let r = self
            .ctl
            .controller_publish_volume(csi::ControllerPublishVolumeRequest {
                volume_id: vol.into(),
                node_id: NODE.into(),
                volume_capability: Some(cap),
                ..Default::default()
            })
            .await
            .map_err(status("ControllerPublishVolume"))?;
        Ok(r.into_inner().publish_context)
    }

    async fn stage(
        &mut self,
        vol: &str,
        ctx: HashMap<String, String>,
        cap: csi::VolumeCapability,
        staging: &Path,
    ) -> Result<(), String> {
        if let Some(parent) = staging.parent() {
            std::fs::create_dir_all(parent).map_err(io(parent))?;
        }
        self.made.staged.push((vol.into(), staging.into()));
        self.node
            .node_stage_volume(csi::NodeStageVolumeRequest {
                volume_id: vol.into(),
                publish_context: ctx,
                staging_target_path: staging.display().to_string(),
                volume_capability: Some(cap),
                ..Default::default()
            })
            .await
            .map_err(status("NodeStageVolume"))?;
        Ok(())
    }

    async fn publish(
        &mut self,
        vol: &str,
        cap: csi::VolumeCapability,
        staging: &Path,
        target: &Path,
    ) -> Result<(), String> {
        if let Some(parent) = target.parent() {
            std::fs::create_dir_all(parent).map_err(io(parent))?;
        }
        self.made.published.push((vol.into(), target.into()));
        self.node
            .node_publish_volume(csi::NodePublishVolumeRequest {
                volume_id: vol.into(),
                staging_target_path: staging.display().to_string(),
                target_path: target.display().to_string(),
                volume_capability: Some(cap),
                ..Default::default()
            })
            .await
            .map_err(status("NodePublishVolume"))?;
        Ok(())
    }

    async fn snapshot(&mut self, vol: &str, name: &str) -> Result<String, String> {
        let request = csi::CreateSnapshotRequest {
            source_volume_id: vol.into(),
            name: name.into(),
            ..Default::default()
        };
        let index = self.made.snapshots.len();
        self.made.snapshots.push((request.clone(), None));
        let id = self
            .ctl
            .create_snapshot(request)
            .await
            .map_err(status("CreateSnapshot"))?
            .into_inner()
            .snapshot
            .map(|s| s.snapshot_id)
            .ok_or("CreateSnapshot answered without a snapshot")?;
        if let Some(s) = self.made.snapshots.get_mut(index) {
            s.1 = Some(id.clone());
        }
        Ok(id)
    }

    fn paths(&self, pv: &str) -> (PathBuf, PathBuf) {
        (
            self.kubelet.join(format!(
                "plugins/kubernetes.io/csi/moor.csi.io/{pv}/globalmount"
            )),
            self.kubelet.join(format!(
                "pods/demo-pod/volumes/kubernetes.io~csi/{pv}/mount"
            )),
        )
    }

    fn volume_request(
        name: &str,
        bytes: i64,
        cap: csi::VolumeCapability,
        src: Option<csi::VolumeContentSource>,
    ) -> csi::CreateVolumeRequest {
        csi::CreateVolumeRequest {
            name: name.into(),
            capacity_range: Some(csi::CapacityRange {
                required_bytes: bytes,
                limit_bytes: 0,
            }),
            volume_capabilities: vec![cap],
            volume_content_source: src,
            ..Default::default()
        }
    }

    /// The volume life, up to the point where everything is in use.
    async fn walk(&mut self, ui: &Ui) -> Result<(), Failure> {
        let fs = self.fs.clone();
        let vol = ui
            .step(
                "CreateVolume demo (1 GiB sparse file)",
                true,
                self.create(Self::volume_request("demo", GIB, mount_cap(&fs), None)),
            )
            .await?;
        let ctx = ui
            .step(
                "ControllerPublishVolume demo (attach as a loop device)",
                true,
                self.attach(&vol, mount_cap(&fs)),
            )
            .await?;
        println!(
            "        publish_context: {}",
            crate::output::key_values(&ctx)
        );
        let (staging, target) = self.paths("pv-demo");
        ui.step(
            &format!("NodeStageVolume demo (probe: blank, mkfs.{fs}, mount)"),
            true,
            self.stage(&vol, ctx, mount_cap(&fs), &staging),
        )
        .await?;
        ui.step(
            "NodePublishVolume demo (bind mount into the pod)",
            true,
            self.publish(&vol, mount_cap(&fs), &staging, &target),
        )
        .await?;
        ui.step("write hello.txt in the pod's volume", true, async {
            let file = target.join("hello.txt");
            std::fs::write(&file, HELLO).map_err(io(&file))?;
            rustix::fs::sync();
            Ok(())
        })
        .await?;
        let (state_dir, root) = (self.state_dir.clone(), self.root.clone());
        let table = ui
            .step(
                "moorctl status (journal against the mount table)",
                true,
                async {
                    let (report, unhealthy) = crate::status::status(&state_dir, Some(&root))
                        .map_err(|e| e.to_string())?;
                    match unhealthy {
                        Some(summary) => {
                            Err(format!("{summary}\n{}", report.render(Output::Table)))
                        }
                        None => Ok(report.render(Output::Table)),
                    }
                },
            )
            .await?;
        for line in table.lines() {
            println!("        {line}");
        }
        let snap = ui
            .step(
                "CreateSnapshot demo-snap (reflink or sparse copy)",
                true,
                self.snapshot(&vol, "demo-snap"),
            )
            .await?;
        let src = csi::VolumeContentSource {
            r#type: Some(csi::volume_content_source::Type::Snapshot(
                csi::volume_content_source::SnapshotSource { snapshot_id: snap },
            )),
        };
        let restored = ui
            .step(
                "CreateVolume demo-restored from the snapshot",
                true,
                self.create(Self::volume_request(
                    "demo-restored",
                    GIB,
                    mount_cap(&fs),
                    Some(src),
                )),
            )
            .await?;
        let ctx2 = ui
            .step(
                "ControllerPublishVolume demo-restored",
                true,
                self.attach(&restored, mount_cap(&fs)),
            )
            .await?;
        let (staging2, target2) = self.paths("pv-restored");
        ui.step(
            "NodeStageVolume demo-restored (holds data: no mkfs)",
            true,
            self.stage(&restored, ctx2, mount_cap(&fs), &staging2),
        )
        .await?;
        ui.step(
            "NodePublishVolume demo-restored",
            true,
            self.publish(&restored, mount_cap(&fs), &staging2, &target2),
        )
        .await?;
        ui.step(
            "read hello.txt back from the restored volume",
            true,
            async {
                let file = target2.join("hello.txt");
                let got = std::fs::read_to_string(&file).map_err(io(&file))?;
                if got == HELLO {
                    Ok(())
                } else {
                    Err(format!("read back {got:?}, wrote {HELLO:?}"))
                }
            },
        )
        .await?;
        let mut ctl = self.ctl.clone();
        let grow = vol.clone();
        let cap = mount_cap(&fs);
        ui.step("ControllerExpandVolume demo to 2 GiB", true, async move {
            ctl.controller_expand_volume(csi::ControllerExpandVolumeRequest {
                volume_id: grow,
                capacity_range: Some(csi::CapacityRange {
                    required_bytes: 2 * GIB,
                    limit_bytes: 0,
                }),
                volume_capability: Some(cap),
                ..Default::default()
            })
            .await
            .map(drop)
            .map_err(status("ControllerExpandVolume"))
        })
        .await?;
        let mut node = self.node.clone();
        let (grow, t, s) = (vol.clone(), target.clone(), staging.clone());
        let size = ui
            .step(
                &format!("NodeExpandVolume demo online (grow {fs} while mounted)"),
                true,
                async move {
                    node.node_expand_volume(csi::NodeExpandVolumeRequest {
                        volume_id: grow,
                        volume_path: t.display().to_string(),
                        capacity_range: Some(csi::CapacityRange {
                            required_bytes: 2 * GIB,
                            limit_bytes: 0,
                        }),
                        staging_target_path: s.display().to_string(),
                        ..Default::default()
                    })
                    .await
                    .map_err(status("NodeExpandVolume"))?;
                    let v =
                        rustix::fs::statvfs(t.as_path()).map_err(|e| format!("statvfs: {e}"))?;
                    Ok(v.f_blocks.saturating_mul(v.f_frsize))
                },
            )
            .await?;
        println!(
            "        the filesystem is now {}",
            crate::output::human_bytes(i64::try_from(size).unwrap_or(i64::MAX))
        );
        let blk = ui
            .step(
                "CreateVolume demo-block (64 MiB, raw block)",
                true,
                self.create(Self::volume_request(
                    "demo-block",
                    64 << 20,
                    block_cap(),
                    None,
                )),
            )
            .await?;
        let ctx3 = ui
            .step(
                "ControllerPublishVolume demo-block",
                true,
                self.attach(&blk, block_cap()),
            )
            .await?;
        let staging3 = self
            .kubelet
            .join("plugins/kubernetes.io/csi/volumeDevices/staging/pv-block");
        let target3 = self
            .kubelet
            .join("plugins/kubernetes.io/csi/volumeDevices/publish/pv-block/demo-pod");
        ui.step(
            "NodeStageVolume demo-block (device checked, nothing mounted)",
            true,
            self.stage(&blk, ctx3, block_cap(), &staging3),
        )
        .await?;
        ui.step(
            "NodePublishVolume demo-block (the device node on a file)",
            true,
            self.publish(&blk, block_cap(), &staging3, &target3),
        )
        .await?;
        ui.step(
            "write and read 4 KiB through the block device",
            true,
            async {
                use std::os::unix::fs::FileExt as _;
                let f = std::fs::OpenOptions::new()
                    .read(true)
                    .write(true)
                    .open(&target3)
                    .map_err(io(&target3))?;
                let data = [0x5Au8; 4096];
                f.write_all_at(&data, 1 << 20).map_err(io(&target3))?;
                f.sync_all().map_err(io(&target3))?;
                let mut back = [0u8; 4096];
                f.read_exact_at(&mut back, 1 << 20).map_err(io(&target3))?;
                if back == data {
                    Ok(())
                } else {
                    Err("the block device gave back other data".into())
                }
            },
        )
        .await?;
        Ok(())
    }

    /// Undoes everything recorded, in reverse, as Kubernetes would on deletion: unpublish,
    /// unstage, detach, delete. Goes on past errors; returns the first.
    async fn teardown(&mut self, ui: &Ui) -> Result<(), Failure> {
        let made = std::mem::take(&mut self.made);
        let mut first: Option<Failure> = None;
        let mut keep = |r: Result<(), Failure>| {
            if let Err(f) = r {
                first.get_or_insert(f);
            }
        };
        for (vol, target) in made.published.iter().rev() {
            let mut node = self.node.clone();
            let req = csi::NodeUnpublishVolumeRequest {
                volume_id: vol.clone(),
                target_path: target.display().to_string(),
            };
            keep(
                ui.step(
                    &format!("NodeUnpublishVolume {}", made.label(vol)),
                    false,
                    async move {
                        node.node_unpublish_volume(req)
                            .await
                            .map(drop)
                            .map_err(status("NodeUnpublishVolume"))
                    },
                )
                .await,
            );
        }
        for (vol, staging) in made.staged.iter().rev() {
            let mut node = self.node.clone();
            let req = csi::NodeUnstageVolumeRequest {
                volume_id: vol.clone(),
                staging_target_path: staging.display().to_string(),
            };
            keep(
                ui.step(
                    &format!("NodeUnstageVolume {}", made.label(vol)),
                    false,
                    async move {
                        node.node_unstage_volume(req)
                            .await
                            .map(drop)
                            .map_err(status("NodeUnstageVolume"))
                    },
                )
                .await,
            );
        }
        for vol in made.attached.iter().rev() {
            let mut ctl = self.ctl.clone();
            let req = csi::ControllerUnpublishVolumeRequest {
                volume_id: vol.clone(),
                node_id: NODE.into(),
                ..Default::default()
            };
            keep(
                ui.step(
                    &format!("ControllerUnpublishVolume {} (detach)", made.label(vol)),
                    false,
                    async move {
                        ctl.controller_unpublish_volume(req)
                            .await
                            .map(drop)
                            .map_err(status("ControllerUnpublishVolume"))
                    },
                )
                .await,
            );
        }
        for (req, id) in made.snapshots.iter().rev() {
            let mut ctl = self.ctl.clone();
            let (req, id) = (req.clone(), id.clone());
            keep(
                ui.step(&format!("DeleteSnapshot {}", req.name), false, async move {
                    let id = match id {
                        Some(id) => id,
                        // Cut short: ask again (idempotent by name) to learn the id.
                        None => match ctl.create_snapshot(req).await {
                            Ok(r) => r
                                .into_inner()
                                .snapshot
                                .map(|s| s.snapshot_id)
                                .unwrap_or_default(),
                            Err(_) => return Ok(()),
                        },
                    };
                    ctl.delete_snapshot(csi::DeleteSnapshotRequest {
                        snapshot_id: id,
                        ..Default::default()
                    })
                    .await
                    .map(drop)
                    .map_err(status("DeleteSnapshot"))
                })
                .await,
            );
        }
        for v in made.volumes.iter().rev() {
            let mut ctl = self.ctl.clone();
            let v = v.clone();
            keep(
                ui.step(
                    &format!("DeleteVolume {}", v.request.name),
                    false,
                    async move {
                        let id = match v.id {
                            Some(id) => id,
                            None => match ctl.create_volume(v.request).await {
                                Ok(r) => r
                                    .into_inner()
                                    .volume
                                    .map(|v| v.volume_id)
                                    .unwrap_or_default(),
                                Err(_) => return Ok(()),
                            },
                        };
                        ctl.delete_volume(csi::DeleteVolumeRequest {
                            volume_id: id,
                            ..Default::default()
                        })
                        .await
                        .map(drop)
                        .map_err(status("DeleteVolume"))
                    },
                )
                .await,
            );
        }
        first.map_or(Ok(()), Err)
    }
}

/// Where moor-node and moor-controller are: `--bin-dir`, else next to moorctl.
fn binaries(args: &DemoArgs) -> Result<(PathBuf, PathBuf), CliError> {
    let dir = match &args.bin_dir {
        Some(d) => d.clone(),
        None => std::env::current_exe()
            .ok()
            .and_then(|e| e.parent().map(Path::to_path_buf))
            .ok_or_else(|| {
                CliError::Local("cannot tell where moorctl is; pass --bin-dir".into())
            })?,
    };
    let node = dir.join("moor-node");
    let ctl = dir.join("moor-controller");
    for b in [&node, &ctl] {
        if !b.is_file() {
            return Err(CliError::Local(format!(
                "{} is missing: build it with `cargo build --release --bins` (or pass --bin-dir)",
                b.display()
            )));
        }
    }
    Ok((node, ctl))
}

/// Mount points at or below `root`, deepest first.
fn mounts_below(root: &Path) -> Vec<PathBuf> {
    let table = std::fs::read("/proc/self/mountinfo").unwrap_or_default();
    let mut found: Vec<PathBuf> = moor_node::sys::mountinfo::parse(&table)
        .unwrap_or_default()
        .into_iter()
        .map(|m| m.mount_point)
        .filter(|p| p.starts_with(root))
        .collect();
    found.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    found
}

/// Loop devices whose backing file lies below `root`.
pub fn loops_below(root: &Path) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let Ok(entries) = std::fs::read_dir("/sys/block") else {
        return found;
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if !name.starts_with("loop") {
            continue;
        }
        if let Ok(b) = std::fs::read_to_string(e.path().join("loop/backing_file"))
            && Path::new(b.trim_end_matches('\n').trim_end_matches(" (deleted)")).starts_with(root)
        {
            found.push(PathBuf::from("/dev").join(name));
        }
    }
    found
}

/// Removes whatever the teardown left: mounts (detached), loop devices, the dir.
/// Returns what it had to remove.
fn sweep(root: &Path) -> Vec<String> {
    let mut left = Vec::new();
    for m in mounts_below(root) {
        let _ = rustix::mount::unmount(m.as_path(), rustix::mount::UnmountFlags::DETACH);
        left.push(format!("mount {}", m.display()));
    }
    // A detached loop device is freed when its last user (udev's probe, say) closes it.
    let start = Instant::now();
    while !loops_below(root).is_empty() && start.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(20));
    }
    for dev in loops_below(root) {
        let _ = Command::new("losetup")
            .arg("-d")
            .arg(&dev)
            .stderr(Stdio::null())
            .status();
        left.push(format!("loop device {}", dev.display()));
    }
    if let Err(e) = std::fs::remove_dir_all(root)
        && e.kind() != std::io::ErrorKind::NotFound
    {
        left.push(format!("{} ({e})", root.display()));
    }
    left
}

/// `moorctl demo`.
pub fn run(args: &DemoArgs) -> Result<(), CliError> {
    if !rustix::process::geteuid().is_root() {
        return Err(CliError::Local(
            "moorctl demo needs root: it attaches loop devices and mounts filesystems".into(),
        ));
    }
    let (node_bin, ctl_bin) = binaries(args)?;
    // Before any thread exists: everything mounted from here on stays in this namespace.
    moor_runtime::sys::mount_namespace::enter_private_mount_namespace()
        .map_err(|e| CliError::Local(format!("cannot make a private mount namespace: {e}")))?;
    let root = std::env::temp_dir().join(format!("moor-demo-{}", std::process::id()));
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| CliError::Local(format!("cannot start the async runtime: {e}")))?;
    let outcome = rt.block_on(demo(args, &root, &node_bin, &ctl_bin));
    drop(rt);
    let left = sweep(&root);
    let outcome = match outcome {
        Ok(()) if !left.is_empty() => Err(Failure {
            step: "final check".into(),
            reason: format!("the teardown left {} behind (removed now)", left.join(", ")),
            interrupted: false,
        }),
        other => other,
    };
    match outcome {
        Ok(()) => {
            println!("\nmoor demo finished: every step passed, and everything it made is gone.");
            Ok(())
        }
        Err(f) => {
            println!(
                "\nmoor demo failed at step \"{}\"; everything it made has been removed.",
                f.step
            );
            Err(CliError::Demo {
                step: f.step,
                reason: f.reason,
            })
        }
    }
}

async fn demo(
    args: &DemoArgs,
    root: &Path,
    node_bin: &Path,
    ctl_bin: &Path,
) -> Result<(), Failure> {
    let interrupts = Arc::new(Interrupts::default());
    for kind in [SignalKind::interrupt(), SignalKind::terminate()] {
        let mut s = signal(kind).map_err(|e| Failure {
            step: "set up".into(),
            reason: format!("cannot handle signals: {e}"),
            interrupted: false,
        })?;
        let i = Arc::clone(&interrupts);
        tokio::spawn(async move {
            while s.recv().await.is_some() {
                i.last.store(kind.as_raw_value(), Ordering::SeqCst);
                i.count.fetch_add(1, Ordering::SeqCst);
            }
        });
    }
    let ui = Ui {
        spinner: std::io::stderr().is_terminal(),
        interrupts,
    };
    let kubelet = root.join("kubelet");
    let state = root.join("node-state");
    let data = root.join("controller-data");
    for d in [&kubelet, &state, &data] {
        std::fs::create_dir_all(d).map_err(|e| Failure {
            step: "set up".into(),
            reason: format!("{}: {e}", d.display()),
            interrupted: false,
        })?;
    }
    println!(
        "moor demo in {}: moor-controller (embedded backend) and moor-node, {} volumes",
        root.display(),
        args.fs_type
    );
    let (ks, ss, ds) = (
        kubelet.display().to_string(),
        state.display().to_string(),
        data.display().to_string(),
    );
    let ctl_sock = root.join("controller.sock");
    let node_sock = root.join("node.sock");
    let mut daemons: Vec<Daemon> = Vec::new();
    let started = async {
        let mut ctl = Daemon::spawn(
            ctl_bin,
            "moor-controller",
            &ctl_sock,
            &["--node-id", NODE, "--data-dir", &ds],
            root,
        )?;
        let c = ctl.wait_ready(&ctl_sock).await;
        daemons.push(ctl);
        let c = c?;
        let mut node = Daemon::spawn(
            node_bin,
            "moor-node",
            &node_sock,
            &["--node-id", NODE, "--state-dir", &ss, "--kubelet-dir", &ks],
            root,
        )?;
        let n = node.wait_ready(&node_sock).await;
        daemons.push(node);
        Ok((c, n?))
    };
    let started = ui
        .step("start moor-controller and moor-node", true, started)
        .await;
    let result = match started {
        Ok((c, n)) => {
            let mut d = Demo {
                ctl: ControllerClient::new(c),
                node: NodeClient::new(n),
                kubelet,
                state_dir: state,
                root: root.to_path_buf(),
                fs: args.fs_type.clone(),
                made: Made::default(),
            };
            let walked = d.walk(&ui).await;
            if walked.as_ref().is_err_and(|f| !f.interrupted) {
                for dm in &daemons {
                    let tail = dm.log_tail(3, true);
                    if tail != NOTHING {
                        println!("        {} log: {tail}", dm.name);
                    }
                }
            }
            println!("teardown:");
            let torn = d.teardown(&ui).await;
            walked.and(torn)
        }
        Err(f) => Err(f),
    };
    let mut stopped = Ok(());
    for mut dm in daemons.into_iter().rev() {
        let name = format!("stop {} (SIGTERM)", dm.name);
        let r = ui.step(&name, false, dm.stop()).await;
        if stopped.is_ok() {
            stopped = r;
        }
    }
    result.and(stopped)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nothing_is_found_below_a_fresh_dir() {
        let dir = std::env::temp_dir().join(format!("moorctl-unit-{}", std::process::id()));
        assert!(mounts_below(&dir).is_empty());
        assert!(loops_below(&dir).is_empty());
        assert!(sweep(&dir).is_empty());
    }

    #[test]
    fn grpc_errors_in_steps_name_the_code() {
        let f = status("NodeStageVolume")(tonic::Status::failed_precondition("not blank"));
        assert_eq!(f, "NodeStageVolume failed: FAILED_PRECONDITION: not blank");
    }

    #[test]
    fn interrupts_name_their_signal() {
        let i = Interrupts::default();
        assert_eq!(i.count(), 0);
        i.last.store(libc::SIGTERM, Ordering::SeqCst);
        assert_eq!(i.name(), "SIGTERM");
        i.last.store(libc::SIGINT, Ordering::SeqCst);
        assert_eq!(i.name(), "SIGINT");
    }
}
