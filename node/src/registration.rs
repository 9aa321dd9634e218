//! Built-in kubelet plugin registration (pluginregistration v1), so the node-driver-registrar
//! sidecar is optional.
//!
//! kubelet's plugin watcher notices `<driver-name>-reg.sock` in its plugin registration dir,
//! calls GetInfo (type `CSIPlugin`, the driver name, the CSI socket path kubelet must dial, and
//! the CSI versions), validates the answer, then calls NotifyRegistrationStatus. When kubelet
//! reports a failed registration, moor-node logs it and stops with a failure exit code, so the
//! pod restarts and registration is tried afresh; it begins to stop only once kubelet has the
//! answer to that call ([`Refusal::answered`]). Removing the socket (on shutdown) makes kubelet
//! deregister the plugin.
//!
//! Until kubelet has confirmed the registration, [`Progress`] says how far it got: moor-node
//! logs that it waits (ever less often, see [`log_while_waiting`]), `/metrics` has
//! `moor_registration_registered 0`, and once the deadline has passed `/healthz` reports not
//! ready, so a node plugin kubelet never registers is restarted rather than left serving
//! nobody.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use moor_proto::registration::v1 as reg;
use moor_runtime::server::Connection;
use tokio::sync::watch;
use tonic::{Request, Response, Status};
use tracing::{error, info, warn};

/// The plugin type kubelet's CSI plugin handler registers.
pub const PLUGIN_TYPE: &str = "CSIPlugin";

/// The CSI versions announced to kubelet (kubelet's CSI plugin takes the highest 1.x it knows).
pub const SUPPORTED_VERSIONS: [&str; 1] = ["1.0.0"];

/// Registration setup errors.
#[derive(Debug, thiserror::Error)]
pub enum RegistrationError {
    /// The driver name cannot name a socket file.
    #[error("driver name {0:?} cannot name the registration socket (empty, '/' or NUL)")]
    DriverName(String),
}

/// Where the registration socket goes: `<dir>/<driver-name>-reg.sock`.
pub fn socket_path(dir: &Path, driver_name: &str) -> Result<PathBuf, RegistrationError> {
    if driver_name.is_empty()
        || driver_name.contains(['/', '\0'])
        || driver_name == "."
        || driver_name == ".."
    {
        return Err(RegistrationError::DriverName(driver_name.to_string()));
    }
    Ok(dir.join(format!("{driver_name}-reg.sock")))
}

/// kubelet's refusal of the registration (NotifyRegistrationStatus, not registered).
#[derive(Debug, Clone)]
pub struct Refusal {
    /// kubelet's reason.
    pub why: String,
    /// The connection the call came on (None for a call that did not come over a socket).
    connection: Option<Connection>,
}

impl Refusal {
    /// Resolves once kubelet has the answer to the call that refused the registration, so that
    /// moor-node's stop (which tells every connection to go) cannot overtake that answer: kubelet
    /// closes its connection once the call is answered, and a closed connection has delivered
    /// what was sent on it. At most `bound` later, for a client that keeps its connection open
    /// (false then); the graceful stop still sends the answer before closing the connection.
    pub async fn answered(&self, bound: Duration) -> bool {
        match &self.connection {
            Some(c) => tokio::time::timeout(bound, c.closed()).await.is_ok(),
            None => true,
        }
    }
}

/// How far kubelet got with registering the plugin.
#[derive(Debug)]
pub struct Progress {
    started: Instant,
    deadline: Option<Duration>,
    asked: AtomicBool,
    registered: AtomicBool,
}

impl Progress {
    /// Nothing yet, counting from now; past `deadline` (None: never) an unregistered plugin is
    /// not healthy.
    pub fn new(deadline: Option<Duration>) -> Self {
        Self {
            started: Instant::now(),
            deadline,
            asked: AtomicBool::new(false),
            registered: AtomicBool::new(false),
        }
    }

    /// Whether kubelet has confirmed the registration (NotifyRegistrationStatus, registered).
    pub fn registered(&self) -> bool {
        self.registered.load(Ordering::Relaxed)
    }

    /// Whether kubelet has asked GetInfo.
    pub fn asked(&self) -> bool {
        self.asked.load(Ordering::Relaxed)
    }

    /// What is still missing, or None once registered.
    pub fn missing(&self) -> Option<&'static str> {
        if self.registered() {
            None
        } else if self.asked() {
            Some("kubelet called GetInfo but has not confirmed the registration")
        } else {
            Some("kubelet has not called GetInfo on the registration socket")
        }
    }

    /// Why the plugin is not healthy at `now`: not registered past the deadline.
    pub fn overdue_at(&self, now: Instant) -> Option<String> {
        let deadline = self.deadline?;
        let missing = self.missing()?;
        (now.saturating_duration_since(self.started) >= deadline).then(|| {
            format!(
                "not registered with kubelet after {} s: {missing}",
                deadline.as_secs()
            )
        })
    }

    /// Ok unless not registered past the deadline.
    pub fn health(&self) -> Result<(), String> {
        self.overdue_at(Instant::now()).map_or(Ok(()), Err)
    }
}

/// How long after the `n`th waiting log line (0: the start) the next comes: 15 s, doubling up
/// to 5 min; never later than the deadline, which is logged when it passes.
pub fn next_log_after(n: u32, waited: Duration, deadline: Option<Duration>) -> Duration {
    let step = Duration::from_secs(15)
        .saturating_mul(1 << n.min(5))
        .min(Duration::from_secs(300));
    match deadline {
        Some(d) if waited < d => step.min(d - waited),
        _ => step,
    }
}

/// Logs, ever less often, that the plugin waits for kubelet to register it, naming the
/// registration socket and what kubelet has done so far; says so when the deadline passes.
/// Returns once registered.
pub async fn log_while_waiting(progress: Arc<Progress>, socket: PathBuf) {
    let mut n = 0;
    let mut deadline_told = false;
    loop {
        let wait = next_log_after(n, progress.started.elapsed(), progress.deadline);
        tokio::time::sleep(wait).await;
        n += 1;
        let Some(missing) = progress.missing() else {
            return;
        };
        let waited_s = progress.started.elapsed().as_secs();
        match progress.overdue_at(Instant::now()) {
            Some(why) if !deadline_told => {
                deadline_told = true;
                error!(socket = %socket.display(), waited_s, "{why}; /healthz reports not ready");
            }
            _ => warn!(
                socket = %socket.display(),
                waited_s,
                "waiting for kubelet to register the plugin: {missing} (is --registration-dir \
                 kubelet's plugins_registry?)"
            ),
        }
    }
}

/// The Registration service.
#[derive(Debug)]
pub struct RegistrationService {
    driver_name: String,
    endpoint: String,
    failed: watch::Sender<Option<Refusal>>,
    progress: Arc<Progress>,
}

impl RegistrationService {
    /// The service for `driver_name`, announcing `endpoint` (the CSI socket's path as kubelet
    /// sees it). A failed registration is published on `failed`; how far kubelet got, on
    /// `progress`.
    pub fn new(
        driver_name: impl Into<String>,
        endpoint: impl Into<String>,
        failed: watch::Sender<Option<Refusal>>,
        progress: Arc<Progress>,
    ) -> Self {
        Self {
            driver_name: driver_name.into(),
            endpoint: endpoint.into(),
            failed,
            progress,
        }
    }
}

#[tonic::async_trait]
impl reg::registration_server::Registration for RegistrationService {
    async fn get_info(
        &self,
        _: Request<reg::InfoRequest>,
    ) -> Result<Response<reg::PluginInfo>, Status> {
        if !self.progress.asked.swap(true, Ordering::Relaxed) {
            info!(
                driver = self.driver_name,
                endpoint = self.endpoint,
                "kubelet asked for the plugin's info (GetInfo)"
            );
        }
        Ok(Response::new(reg::PluginInfo {
            r#type: PLUGIN_TYPE.to_string(),
            name: self.driver_name.clone(),
            endpoint: self.endpoint.clone(),
            supported_versions: SUPPORTED_VERSIONS
                .iter()
                .map(|v| (*v).to_string())
                .collect(),
        }))
    }

    async fn notify_registration_status(
        &self,
        request: Request<reg::RegistrationStatus>,
    ) -> Result<Response<reg::RegistrationStatusResponse>, Status> {
        let connection = request.extensions().get::<Connection>().cloned();
        let status = request.into_inner();
        if status.plugin_registered {
            self.progress.registered.store(true, Ordering::Relaxed);
            info!(
                driver = self.driver_name,
                endpoint = self.endpoint,
                "registered with kubelet"
            );
        } else {
            let why = if status.error.is_empty() {
                "kubelet gave no reason".to_string()
            } else {
                status.error
            };
            error!(
                driver = self.driver_name,
                error = why,
                "kubelet refused the registration; stopping so the pod restarts"
            );
            self.failed.send_replace(Some(Refusal { why, connection }));
        }
        Ok(Response::new(reg::RegistrationStatusResponse {}))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use reg::registration_server::Registration as _;

    #[tokio::test]
    async fn get_info_names_the_driver_socket_and_versions() {
        let (tx, _rx) = watch::channel(None);
        let progress = Arc::new(Progress::new(None));
        let s = RegistrationService::new(
            "moor.csi.io",
            "/var/lib/kubelet/plugins/m/csi.sock",
            tx,
            Arc::clone(&progress),
        );
        assert!(!progress.asked());
        let info = s
            .get_info(Request::new(reg::InfoRequest {}))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(info.r#type, "CSIPlugin");
        assert_eq!(info.name, "moor.csi.io");
        assert_eq!(info.endpoint, "/var/lib/kubelet/plugins/m/csi.sock");
        assert_eq!(info.supported_versions, vec!["1.0.0".to_string()]);
        assert!(progress.asked() && !progress.registered());
    }

    #[tokio::test]
    async fn a_refused_registration_is_reported_and_a_success_is_not() {
        let (tx, rx) = watch::channel(None);
        let progress = Arc::new(Progress::new(None));
        let s = RegistrationService::new("moor.csi.io", "/csi.sock", tx, Arc::clone(&progress));
        s.notify_registration_status(Request::new(reg::RegistrationStatus {
            plugin_registered: true,
            error: String::new(),
        }))
        .await
        .unwrap();
        assert!(rx.borrow().is_none());
        assert!(progress.registered());
        s.notify_registration_status(Request::new(reg::RegistrationStatus {
            plugin_registered: false,
            error: "version 0.9 not supported".into(),
        }))
        .await
        .unwrap();
        let why =
            |rx: &watch::Receiver<Option<Refusal>>| rx.borrow().as_ref().map(|r| r.why.clone());
        assert_eq!(why(&rx).as_deref(), Some("version 0.9 not supported"));
        s.notify_registration_status(Request::new(reg::RegistrationStatus {
            plugin_registered: false,
            error: String::new(),
        }))
        .await
        .unwrap();
        assert_eq!(why(&rx).as_deref(), Some("kubelet gave no reason"));
    }

    #[tokio::test]
    async fn unregistered_past_the_deadline_is_not_healthy() {
        let (tx, _rx) = watch::channel(None);
        let progress = Arc::new(Progress::new(Some(Duration::from_secs(120))));
        let s = RegistrationService::new("moor.csi.io", "/csi.sock", tx, Arc::clone(&progress));
        let start = progress.started;
        let later = start + Duration::from_secs(120);
        assert_eq!(progress.overdue_at(start + Duration::from_secs(119)), None);
        let why = progress.overdue_at(later).expect("overdue");
        assert!(why.contains("after 120 s"), "{why}");
        assert!(why.contains("has not called GetInfo"), "{why}");
        s.get_info(Request::new(reg::InfoRequest {})).await.unwrap();
        let why = progress.overdue_at(later).expect("still overdue");
        assert!(
            why.contains("called GetInfo but has not confirmed"),
            "{why}"
        );
        // A refusal does not register.
        s.notify_registration_status(Request::new(reg::RegistrationStatus {
            plugin_registered: false,
            error: "no".into(),
        }))
        .await
        .unwrap();
        assert!(progress.overdue_at(later).is_some());
        s.notify_registration_status(Request::new(reg::RegistrationStatus {
            plugin_registered: true,
            error: String::new(),
        }))
        .await
        .unwrap();
        assert_eq!(progress.overdue_at(later), None);
        assert_eq!(progress.missing(), None);
        // No deadline: never unhealthy.
        let never = Progress::new(None);
        assert_eq!(never.overdue_at(later + Duration::from_secs(1 << 20)), None);
    }

    #[test]
    fn waiting_is_logged_ever_less_often_and_when_the_deadline_passes() {
        let s = Duration::from_secs;
        let none: Vec<u64> = (0..8)
            .map(|n| next_log_after(n, s(0), None).as_secs())
            .collect();
        assert_eq!(none, [15, 30, 60, 120, 240, 300, 300, 300]);
        // Never past the deadline: the line that says it passed comes on time.
        assert_eq!(next_log_after(2, s(100), Some(s(120))), s(20));
        assert_eq!(next_log_after(0, s(0), Some(s(1))), s(1));
        assert_eq!(next_log_after(3, s(130), Some(s(120))), s(120));
    }

    #[test]
    fn socket_name() {
        assert_eq!(
            socket_path(
                Path::new("/var/lib/kubelet/plugins_registry"),
                "moor.csi.io"
            )
            .unwrap(),
            PathBuf::from("/var/lib/kubelet/plugins_registry/moor.csi.io-reg.sock")
        );
        for bad in ["", "a/b", "../x", "a\0b", ".."] {
            assert!(socket_path(Path::new("/r"), bad).is_err(), "{bad:?}");
        }
    }
}
