//! Built-in kubelet plugin registration (pluginregistration v1), so the node-driver-registrar
//! sidecar is optional.
//!
//! kubelet's plugin watcher notices `<driver-name>-reg.sock` in its plugin registration dir,
//! calls GetInfo (type `CSIPlugin`, the driver name, the CSI socket path kubelet must dial, and
//! the CSI versions), validates the answer, then calls NotifyRegistrationStatus. When kubelet
//! reports a failed registration, moor-node logs it and stops with a failure exit code, so the
//! pod restarts and registration is tried afresh. Removing the socket (on shutdown) makes
//! kubelet deregister the plugin.

use std::path::{Path, PathBuf};

use moor_proto::registration::v1 as reg;
use tokio::sync::watch;
use tonic::{Request, Response, Status};
use tracing::{error, info};

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

/// The Registration service.
#[derive(Debug)]
pub struct RegistrationService {
    driver_name: String,
    endpoint: String,
    failed: watch::Sender<Option<String>>,
}

impl RegistrationService {
    /// The service for `driver_name`, announcing `endpoint` (the CSI socket's path as kubelet
    /// sees it). A failed registration is published on `failed`.
    pub fn new(
        driver_name: impl Into<String>,
        endpoint: impl Into<String>,
        failed: watch::Sender<Option<String>>,
    ) -> Self {
        Self {
            driver_name: driver_name.into(),
            endpoint: endpoint.into(),
            failed,
        }
    }
}

#[tonic::async_trait]
impl reg::registration_server::Registration for RegistrationService {
    async fn get_info(
        &self,
        _: Request<reg::InfoRequest>,
    ) -> Result<Response<reg::PluginInfo>, Status> {
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
        let status = request.into_inner();
        if status.plugin_registered {
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
            self.failed.send_replace(Some(why));
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
        let s = RegistrationService::new("moor.csi.io", "/var/lib/kubelet/plugins/m/csi.sock", tx);
        let info = s
            .get_info(Request::new(reg::InfoRequest {}))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(info.r#type, "CSIPlugin");
        assert_eq!(info.name, "moor.csi.io");
        assert_eq!(info.endpoint, "/var/lib/kubelet/plugins/m/csi.sock");
        assert_eq!(info.supported_versions, vec!["1.0.0".to_string()]);
    }

    #[tokio::test]
    async fn a_refused_registration_is_reported_and_a_success_is_not() {
        let (tx, rx) = watch::channel(None);
        let s = RegistrationService::new("moor.csi.io", "/csi.sock", tx);
        s.notify_registration_status(Request::new(reg::RegistrationStatus {
            plugin_registered: true,
            error: String::new(),
        }))
        .await
        .unwrap();
        assert_eq!(*rx.borrow(), None);
        s.notify_registration_status(Request::new(reg::RegistrationStatus {
            plugin_registered: false,
            error: "version 0.9 not supported".into(),
        }))
        .await
        .unwrap();
        assert_eq!(rx.borrow().as_deref(), Some("version 0.9 not supported"));
        s.notify_registration_status(Request::new(reg::RegistrationStatus {
            plugin_registered: false,
            error: String::new(),
        }))
        .await
        .unwrap();
        assert_eq!(rx.borrow().as_deref(), Some("kubelet gave no reason"));
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
