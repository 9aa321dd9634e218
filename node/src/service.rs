//! The CSI Identity and Node gRPC services, over the [`Engine`].
//!
//! Slow operations (stage, unstage, expand: mkfs, mount of a filesystem, resize) may block in
//! the kernel for long: they run with the runtime told they block (see [`blocking`]). Publish,
//! unpublish and stats are a handful of syscalls and run in place. A panic anywhere in a
//! handler is caught and answered with INTERNAL; the daemon stays up.

use std::collections::HashMap;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use moor_proto::csi::v1 as csi;
use moor_runtime::keys::tpm2::Tpm;
use tonic::{Request, Response, Status};
use tracing::{info, warn};

use crate::engine::{Condition, Engine, Health, NodeTpm, StageReport, StorageTrouble, VolumeStats};
use crate::error::Error;
use crate::local_controller::LocalController;
use crate::sys::Os;
use crate::validate;

/// The plugin's identity and node facts.
#[derive(Debug, Clone)]
pub struct PluginInfo {
    /// CSI driver name.
    pub driver_name: String,
    /// This node's id.
    pub node_id: String,
    /// max_volumes_per_node (0: not reported).
    pub max_volumes: u64,
    /// Topology key for the per-node segment.
    pub topology_key: String,
    /// The state dir (checked by Probe).
    pub state_dir: PathBuf,
}

/// The GetPluginInfo manifest key naming the node's state dir (where `moorctl status` finds
/// the journal).
pub const MANIFEST_STATE_DIR: &str = "state_dir";

/// Tools the node needs for its default filesystem; Probe is not ready without them.
pub const REQUIRED_TOOLS: [&str; 2] = ["mkfs.ext4", "resize2fs"];
/// Tools for the other filesystems and for encrypted volumes; their absence is logged.
pub const OPTIONAL_TOOLS: [&str; 4] = ["mkfs.xfs", "xfs_growfs", "mkfs.btrfs", "cryptsetup"];

/// Every program moor-node may run: the filesystems' tools ([`crate::filesystem::programs`]),
/// the FUSE attacher's ([`crate::attach::fuse::PROGRAM`]) and cryptsetup, for encrypted
/// volumes. The image must hold them all.
#[must_use]
pub fn programs() -> Vec<String> {
    let mut out = crate::filesystem::programs();
    out.push(crate::attach::fuse::PROGRAM.to_owned());
    out.push(crate::engine::CRYPTSETUP.to_owned());
    out
}

/// Why the plugin is not ready, or None when it is.
pub fn readiness<O: Os>(os: &O, state_dir: &std::path::Path) -> Option<String> {
    let missing: Vec<_> = REQUIRED_TOOLS
        .iter()
        .filter(|t| !os.has_program(t))
        .collect();
    if !missing.is_empty() {
        return Some(format!("required tools missing: {missing:?}"));
    }
    let probe = state_dir.join(".probe");
    if let Err(e) = std::fs::write(&probe, b"ok").and_then(|()| std::fs::remove_file(&probe)) {
        return Some(format!(
            "state dir {} is not writable: {e}",
            state_dir.display()
        ));
    }
    None
}

/// Runs `f`, which may block in the kernel (mount, mkfs), without stalling the server; a
/// panic becomes INTERNAL.
pub(crate) async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, Error> + Send + 'static,
) -> Result<T, Status> {
    // On a multi-thread runtime (the daemon's): on this worker, with the runtime told it
    // blocks, so its core (its queue of tasks) moves to another thread, which goes on serving.
    // Running in place without telling is not safe even while another worker is free:
    // - the free worker may sleep without the I/O driver, which this one took when it woke
    //   for the call, and then nobody reads the sockets until the call returns;
    // - the task this worker queued last (its LIFO slot) cannot be taken by another worker,
    //   and it may be the connection kubelet sends all its calls on.
    // Either way every other call, Probe included, would wait behind a mkfs. The price is a
    // thread wake when the call returns. Elsewhere (tests): on the blocking pool.
    let multi_thread = tokio::runtime::Handle::try_current()
        .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread);
    let outcome = if multi_thread {
        std::panic::catch_unwind(AssertUnwindSafe(|| tokio::task::block_in_place(f)))
            .map_err(|_| ())
    } else {
        tokio::task::spawn_blocking(f).await.map_err(|_| ())
    };
    match outcome {
        Ok(r) => r.map_err(Status::from),
        Err(()) => {
            warn!("handler panicked");
            Err(Status::internal(
                "internal error: the operation panicked; see the node log",
            ))
        }
    }
}

/// Runs `f` in place; a panic becomes INTERNAL.
fn inline<T>(f: impl FnOnce() -> Result<T, Error>) -> Result<T, Status> {
    match std::panic::catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r.map_err(Status::from),
        Err(_) => {
            warn!("handler panicked");
            Err(Status::internal(
                "internal error: the operation panicked; see the node log",
            ))
        }
    }
}

/// Logs one RPC's outcome.
fn log_outcome<T>(rpc: &str, volume: &str, start: Instant, r: &Result<T, Status>) {
    let us = start.elapsed().as_micros() as u64;
    match r {
        Ok(_) => info!(rpc, volume, micros = us, "ok"),
        Err(s) => {
            warn!(rpc, volume, micros = us, code = ?s.code(), message = s.message(), "failed")
        }
    }
}

pub(crate) async fn traced<T>(
    rpc: &'static str,
    volume: String,
    fut: impl Future<Output = Result<T, Status>>,
) -> Result<Response<T>, Status> {
    let start = Instant::now();
    let r = fut.await;
    log_outcome(rpc, &volume, start, &r);
    r.map(Response::new)
}

/// The Identity service.
#[derive(Debug)]
pub struct IdentityService<O: Os> {
    info: PluginInfo,
    os: Arc<O>,
}

impl<O: Os> IdentityService<O> {
    /// Builds the service.
    pub fn new(info: PluginInfo, os: Arc<O>) -> Self {
        Self { info, os }
    }
}

#[tonic::async_trait]
impl<O: Os> csi::identity_server::Identity for IdentityService<O> {
    async fn get_plugin_info(
        &self,
        _: Request<csi::GetPluginInfoRequest>,
    ) -> Result<Response<csi::GetPluginInfoResponse>, Status> {
        Ok(Response::new(csi::GetPluginInfoResponse {
            name: self.info.driver_name.clone(),
            vendor_version: env!("CARGO_PKG_VERSION").to_string(),
            manifest: HashMap::from([
                ("component".to_string(), "node".to_string()),
                (
                    MANIFEST_STATE_DIR.to_string(),
                    self.info.state_dir.display().to_string(),
                ),
            ]),
        }))
    }

    async fn get_plugin_capabilities(
        &self,
        _: Request<csi::GetPluginCapabilitiesRequest>,
    ) -> Result<Response<csi::GetPluginCapabilitiesResponse>, Status> {
        Ok(Response::new(csi::GetPluginCapabilitiesResponse {
            capabilities: moor_runtime::contract::plugin_capabilities(),
        }))
    }

    async fn probe(
        &self,
        _: Request<csi::ProbeRequest>,
    ) -> Result<Response<csi::ProbeResponse>, Status> {
        // Unhealthy is an error (a missing required dependency: FAILED_PRECONDITION);
        // `ready: false` is only for a plugin still starting, which this one never is once it
        // serves.
        match readiness(self.os.as_ref(), &self.info.state_dir) {
            None => Ok(Response::new(csi::ProbeResponse { ready: Some(true) })),
            Some(reason) => {
                warn!(reason, "probe: not healthy");
                Err(Status::failed_precondition(reason))
            }
        }
    }
}

/// The Node service.
#[derive(Debug)]
pub struct NodeService<O: Os> {
    engine: Arc<Engine<O>>,
    info: PluginInfo,
    /// The controller on this node, for node-local volumes (see [`crate::local_controller`]).
    local: Option<Arc<dyn LocalController>>,
    /// Whether NodeGetCapabilities announces CSI 1.13's health calls.
    health_capabilities: bool,
    /// This node's TPM, for the node half of `tpm2` volumes: one for the process, so that
    /// its calls take turns (`Tpm2Tools` holds one conversation at a time).
    tpm: NodeTpm,
}

impl<O: Os> NodeService<O> {
    /// Builds the service.
    pub fn new(engine: Arc<Engine<O>>, info: PluginInfo) -> Self {
        Self {
            engine,
            info,
            local: None,
            health_capabilities: false,
            tpm: NodeTpm::from_env(),
        }
    }

    /// The node half of `tpm2` volumes from `tpm` rather than the TPM moor-node finds
    /// ([`moor_runtime::keys::tpm2::Tpm2Tools::from_env`]).
    #[must_use]
    pub fn with_tpm(mut self, tpm: Arc<dyn Tpm>) -> Self {
        self.tpm = NodeTpm(tpm);
        self
    }

    /// This node's TPM as the service asks it: the other services that ask it (a data key
    /// rotation's) share it, so that their calls take turns with the stages'.
    #[must_use]
    pub fn tpm(&self) -> NodeTpm {
        self.tpm.clone()
    }

    /// Announces CSI 1.13's GET_VOLUME_HEALTH and GET_STORAGE_HEALTH in NodeGetCapabilities
    /// (the calls are served either way): `--health-capabilities`.
    #[must_use]
    pub fn with_health_capabilities(mut self) -> Self {
        self.health_capabilities = true;
        self
    }

    /// Serves node-local volumes, whose controller on this node is `local`.
    pub fn with_local_controller(mut self, local: Arc<dyn LocalController>) -> Self {
        self.local = Some(local);
        self
    }

    fn kubelet_dir(&self) -> PathBuf {
        self.engine.config().kubelet_dir.clone()
    }
}

#[tonic::async_trait]
impl<O: Os> csi::node_server::Node for NodeService<O> {
    async fn node_stage_volume(
        &self,
        request: Request<csi::NodeStageVolumeRequest>,
    ) -> Result<Response<csi::NodeStageVolumeResponse>, Status> {
        let mut req = request.into_inner();
        let engine = Arc::clone(&self.engine);
        let dir = self.kubelet_dir();
        let local = self.local.clone();
        let node_id = self.info.node_id.clone();
        let tpm = Arc::clone(&self.tpm.0);
        traced("NodeStageVolume", req.volume_id.clone(), async move {
            // A node-local volume: the controller on this node attaches it, as a CO's attach
            // would have, once the rest of the request holds.
            let mut attached_here = false;
            if let Some(local) = &local
                && !crate::local_controller::names_a_device(&req.publish_context)
            {
                attached_here = true;
                validate::stage_but_device(&req, &dir)?;
                let ctx = local
                    .attach(
                        &req.volume_id,
                        &node_id,
                        req.volume_capability.clone(),
                        req.volume_context.clone(),
                    )
                    .await?;
                req.publish_context.extend(ctx);
            }
            // A key source that asks a server or the TPM (kmip, tpm2) blocks while it
            // unwraps: off the server's thread, as mount and mkfs are.
            let v = if validate::asks_a_key_source(&req.volume_context) {
                let (req, dir) = (req.clone(), dir.clone());
                blocking(move || validate::stage_with_tpm(&req, &dir, &*tpm)).await?
            } else {
                validate::stage_with_tpm(&req, &dir, &*tpm)?
            };
            let rbd = crate::attach::request::stage(&req)?;
            let journal = Arc::clone(engine.journal());
            let (staged, report) = blocking(move || {
                let mut report = StageReport::default();
                let staged = match &rbd {
                    Some(rbd) => engine.stage_mapped(&v, rbd, &mut report),
                    None => engine.stage(&v, &mut report),
                };
                Ok((staged, report))
            })
            .await?;
            if let Some((fs, outcome)) = report.fsck {
                crate::metrics::registry().fsck_outcome(fs.name(), outcome.name());
            }
            if let Err(e) = staged {
                let e = Status::from(e);
                // A node-local volume this call attached and the failure left unstaged: nothing
                // uses its device, and the kubelet sends no NodeUnstageVolume after a final
                // error, so it is released here (else its volume could never be deleted). Not
                // after ABORTED: another call on the volume holds it, and may be staging it.
                let still_staged = journal
                    .get(&req.volume_id)
                    .is_some_and(|r| r.stage.is_some());
                if attached_here
                    && !still_staged
                    && e.code() != tonic::Code::Aborted
                    && let Some(local) = &local
                    && let Err(d) = local.detach(&req.volume_id, &node_id).await
                {
                    warn!(volume = req.volume_id, error = %d.message(), "releasing the device of a failed stage");
                }
                return Err(e);
            }
            if report.formatted {
                let ms = |d: Option<Duration>| d.map_or(0.0, |d| d.as_secs_f64() * 1e3);
                info!(volume = req.volume_id, mkfs = ?report.mkfs, mkfs_ms = ms(report.mkfs),
                    mount_ms = ms(report.mount), "formatted blank device");
            }
            if report.grown {
                info!(volume = req.volume_id, "grew the filesystem to its device");
            }
            Ok(csi::NodeStageVolumeResponse {})
        })
        .await
    }

    async fn node_unstage_volume(
        &self,
        request: Request<csi::NodeUnstageVolumeRequest>,
    ) -> Result<Response<csi::NodeUnstageVolumeResponse>, Status> {
        let req = request.into_inner();
        let engine = Arc::clone(&self.engine);
        let dir = self.kubelet_dir();
        let local = self.local.clone();
        let node_id = self.info.node_id.clone();
        traced("NodeUnstageVolume", req.volume_id.clone(), async move {
            let v = validate::unstage(&req, &dir)?;
            blocking(move || engine.unstage(&v)).await?;
            // Unmounted: the controller on this node releases the device it attached (a
            // volume it did not attach is success).
            if let Some(local) = &local {
                local.detach(&req.volume_id, &node_id).await?;
            }
            Ok(csi::NodeUnstageVolumeResponse {})
        })
        .await
    }

    async fn node_publish_volume(
        &self,
        request: Request<csi::NodePublishVolumeRequest>,
    ) -> Result<Response<csi::NodePublishVolumeResponse>, Status> {
        let req = request.into_inner();
        let dir = self.kubelet_dir();
        traced("NodePublishVolume", req.volume_id.clone(), async {
            let v = validate::publish(&req, &dir)?;
            let qos = inline(|| self.engine.publish_report(&v))?;
            crate::metrics::registry().qos_outcome(qos.label());
            Ok(csi::NodePublishVolumeResponse {})
        })
        .await
    }

    async fn node_unpublish_volume(
        &self,
        request: Request<csi::NodeUnpublishVolumeRequest>,
    ) -> Result<Response<csi::NodeUnpublishVolumeResponse>, Status> {
        let req = request.into_inner();
        let dir = self.kubelet_dir();
        traced("NodeUnpublishVolume", req.volume_id.clone(), async {
            let v = validate::unpublish(&req, &dir)?;
            inline(|| self.engine.unpublish(&v))?;
            Ok(csi::NodeUnpublishVolumeResponse {})
        })
        .await
    }

    async fn node_get_volume_stats(
        &self,
        request: Request<csi::NodeGetVolumeStatsRequest>,
    ) -> Result<Response<csi::NodeGetVolumeStatsResponse>, Status> {
        let req = request.into_inner();
        let dir = self.kubelet_dir();
        let v = validate::stats(&req, &dir)?;
        let (stats, mut condition) = inline(|| self.engine.stats(&v))?;
        // The controller on this node knows what the node cannot see: whether the data dir
        // can still back what a thin volume may write. Its silence changes nothing here.
        if let Some(local) = &self.local
            && !condition.abnormal
        {
            match local.condition(&req.volume_id).await {
                Ok(Some(c)) if c.abnormal => {
                    condition.abnormal = true;
                    condition.message = c.message;
                }
                Ok(_) => {}
                Err(e) => {
                    warn!(volume = req.volume_id, error = %e.message(), "the controller on this node did not say the volume's condition")
                }
            }
        }
        use csi::volume_usage::Unit;
        let i = |x: u64| i64::try_from(x).unwrap_or(i64::MAX);
        let usage = match stats {
            VolumeStats::Filesystem(u) => vec![
                csi::VolumeUsage {
                    available: i(u.available_bytes),
                    total: i(u.total_bytes),
                    used: i(u.used_bytes),
                    unit: Unit::Bytes as i32,
                },
                csi::VolumeUsage {
                    available: i(u.free_inodes),
                    total: i(u.total_inodes),
                    used: i(u.used_inodes),
                    unit: Unit::Inodes as i32,
                },
            ],
            VolumeStats::Block(size) => {
                vec![csi::VolumeUsage {
                    available: 0,
                    total: i(size),
                    used: 0,
                    unit: Unit::Bytes as i32,
                }]
            }
            VolumeStats::Unavailable => vec![],
        };
        Ok(Response::new(csi::NodeGetVolumeStatsResponse {
            usage,
            volume_condition: Some(csi::VolumeCondition {
                abnormal: condition.abnormal,
                message: condition.message,
            }),
        }))
    }

    async fn node_expand_volume(
        &self,
        request: Request<csi::NodeExpandVolumeRequest>,
    ) -> Result<Response<csi::NodeExpandVolumeResponse>, Status> {
        let req = request.into_inner();
        let engine = Arc::clone(&self.engine);
        let dir = self.kubelet_dir();
        let local = self.local.clone();
        let tpm = Arc::clone(&self.tpm.0);
        traced("NodeExpandVolume", req.volume_id.clone(), async move {
            let mut v = validate::expand(&req, &dir)?;
            // An encrypted volume's key, got as its stage got it, by the source its journal
            // record names (a key server or the TPM blocks: off the server's thread).
            if let Some(crypt) = engine.journal().get(&v.volume_id).and_then(|r| r.crypt) {
                let asks = validate::expand_asks_a_key_source(&crypt, &req.secrets);
                let (id, secrets) = (v.volume_id.clone(), req.secrets.clone());
                let key = move || validate::expand_key(&id, &crypt, &secrets, &*tpm);
                v.key = Some(if asks { blocking(key).await? } else { key()? });
            }
            // A node-local volume grows first where it lives: its file, by the controller on
            // this node (which tells the device); then its filesystem, as any volume's.
            if let Some(local) = &local {
                let (required, limit) = req
                    .capacity_range
                    .as_ref()
                    .map_or((0, 0), |r| (r.required_bytes, r.limit_bytes));
                local
                    .expand(
                        &req.volume_id,
                        required,
                        limit,
                        req.volume_capability.clone(),
                    )
                    .await?;
            }
            let size = blocking(move || engine.expand(&v)).await?;
            Ok(csi::NodeExpandVolumeResponse {
                capacity_bytes: i64::try_from(size).unwrap_or(i64::MAX),
            })
        })
        .await
    }

    async fn node_get_volume_health(
        &self,
        request: Request<csi::NodeGetVolumeHealthRequest>,
    ) -> Result<Response<csi::NodeGetVolumeHealthResponse>, Status> {
        let req = request.into_inner();
        let q = validate::volume_health(&req, &self.kubelet_dir())?;
        let mut conditions = inline(|| self.engine.volume_health(&q))?;
        // The controller on this node says what the node cannot see (see NodeGetVolumeStats).
        if let Some(local) = &self.local
            && let Ok(Some(c)) = local.condition(&req.volume_id).await
            && c.abnormal
        {
            conditions.push(Condition::trouble(
                Health::Degraded,
                "BackingStoreShort",
                c.message,
            ));
        }
        use csi::VolumeHealthErrorType as T;
        let health_statuses = conditions
            .into_iter()
            .map(|c| csi::volume_health::VolumeHealthEntry {
                status: match c.health {
                    Health::Inaccessible => T::Inaccessible,
                    Health::DataLoss => T::DataLoss,
                    Health::Degraded => T::Degraded,
                    Health::Healthy => T::UnknownVolumeHealthType,
                } as i32,
                reason: c.reason.to_string(),
                message: c.message,
            })
            .collect();
        Ok(Response::new(csi::NodeGetVolumeHealthResponse {
            volume_health: Some(csi::VolumeHealth {
                volume_id: q.volume_id,
                health_statuses,
            }),
        }))
    }

    async fn node_get_storage_health(
        &self,
        _: Request<csi::NodeGetStorageHealthRequest>,
    ) -> Result<Response<csi::NodeGetStorageHealthResponse>, Status> {
        let engine = Arc::clone(&self.engine);
        // A Ceph cluster's answer may take its timeout: off the async threads.
        let conditions = blocking(move || Ok(engine.storage_health())).await?;
        use csi::StorageHealthErrorType as T;
        let backend_health = conditions
            .into_iter()
            .map(|c| csi::StorageBackendHealth {
                status: match c.trouble {
                    StorageTrouble::Unreachable => T::StorageUnreachable,
                    StorageTrouble::Degraded => T::StorageDegraded,
                } as i32,
                reason: c.reason.to_string(),
                message: c.message,
                volume_capability: None,
            })
            .collect();
        Ok(Response::new(csi::NodeGetStorageHealthResponse {
            backend_health,
        }))
    }

    async fn node_get_capabilities(
        &self,
        _: Request<csi::NodeGetCapabilitiesRequest>,
    ) -> Result<Response<csi::NodeGetCapabilitiesResponse>, Status> {
        let mut capabilities = moor_runtime::contract::node_capabilities();
        if self.health_capabilities {
            capabilities.extend(moor_runtime::contract::node_health_capabilities());
        }
        Ok(Response::new(csi::NodeGetCapabilitiesResponse {
            capabilities,
        }))
    }

    async fn node_get_info(
        &self,
        _: Request<csi::NodeGetInfoRequest>,
    ) -> Result<Response<csi::NodeGetInfoResponse>, Status> {
        Ok(Response::new(csi::NodeGetInfoResponse {
            node_id: self.info.node_id.clone(),
            max_volumes_per_node: i64::try_from(self.info.max_volumes).unwrap_or(i64::MAX),
            accessible_topology: Some(csi::Topology {
                segments: HashMap::from([(
                    self.info.topology_key.clone(),
                    moor_runtime::limits::topology_value(&self.info.node_id),
                )]),
            }),
        }))
    }
}
