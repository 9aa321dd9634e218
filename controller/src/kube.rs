//! Marking a node's snapshot contents for the csi-snapshotter beside a node-local controller
//! (`--mark-snapshot-contents`).
//!
//! In the every-node install each node runs csi-snapshotter `--node-deployment`, which takes
//! only the snapshot contents labelled `snapshot.storage.kubernetes.io/managed-by: <its
//! node>`, for VolumeSnapshotContents and VolumeGroupSnapshotContents alike. The
//! snapshot-controller (external-snapshotter v8.6.0, `--enable-distributed-snapshotting`)
//! sets that label on the VolumeSnapshotContents it makes, never on a
//! VolumeGroupSnapshotContent, nor on a content made by hand: those would wait for ever, no
//! node's snapshotter seeing them. So the node-local controller asks the API server, every few
//! seconds, for the contents of its driver without the label, and labels those whose first
//! member (its volume or snapshot id, which names its node: `vol-<hex>@<node>`) lives on its
//! own node. A group whose other members live on other nodes is labelled too: its node's
//! snapshotter then asks for it and the controller refuses it (FAILED_PRECONDITION, "volume
//! ... lives on node ...: a group snapshot is cut on one node"), an error the snapshotter
//! writes into the group's status, where the user sees it.
//!
//! csi-snapshotter v8.6.0 `--node-deployment` also reads VolumeGroupSnapshotClasses through
//! that label selector (its class informer is the contents' one): a node's snapshotter sees
//! only the classes labelled with its node. So each node publishes, for every class of the
//! driver without the label (`moor-local`), a copy of its own (`moor-local-<node>`, labelled
//! with the node), and a VolumeGroupSnapshot names its node's class. A group content whose
//! class is a node's copy is labelled with that node, whatever its members: they are checked
//! there.
//!
//! The API server is reached as a pod reaches it (`KUBERNETES_SERVICE_HOST` and `_PORT`, the
//! pod's service account token and CA); the pod's service account needs `list` and `patch` on
//! both kinds of content, which the csi-snapshotter beside it has already, and `list` and
//! `create` on VolumeGroupSnapshotClasses.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, ServerName};
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tracing::{info, warn};

/// The label csi-snapshotter `--node-deployment` selects its contents by.
pub const MANAGED_BY: &str = "snapshot.storage.kubernetes.io/managed-by";

/// Where a pod finds its service account's token and the cluster's CA.
const SERVICE_ACCOUNT: &str = "/var/run/secrets/kubernetes.io/serviceaccount";

/// A largest answer read: a list of contents is small; anything larger is not the API server.
const MAX_ANSWER: u64 = 64 << 20;

/// One kind of snapshot content: its collection's path and where its members' ids are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// VolumeSnapshotContent: `spec.source.volumeHandle` or `.snapshotHandle`.
    Snapshot,
    /// VolumeGroupSnapshotContent: `spec.source.volumeHandles` or `.groupSnapshotHandles`.
    Group,
}

impl Kind {
    /// Both kinds.
    pub const ALL: [Kind; 2] = [Kind::Snapshot, Kind::Group];

    /// The collection's path under the API server.
    pub fn path(self) -> &'static str {
        match self {
            Kind::Snapshot => "/apis/snapshot.storage.k8s.io/v1/volumesnapshotcontents",
            Kind::Group => "/apis/groupsnapshot.storage.k8s.io/v1/volumegroupsnapshotcontents",
        }
    }

    /// For logs.
    pub fn name(self) -> &'static str {
        match self {
            Kind::Snapshot => "VolumeSnapshotContent",
            Kind::Group => "VolumeGroupSnapshotContent",
        }
    }

    /// The first id the content's source names (a volume, a snapshot, a group snapshot).
    fn first_id(self, source: &Value) -> Option<&str> {
        match self {
            Kind::Snapshot => source
                .get("volumeHandle")
                .or_else(|| source.get("snapshotHandle"))?
                .as_str(),
            Kind::Group => {
                let handles = source.get("volumeHandles").and_then(Value::as_array);
                match handles.and_then(|h| h.first()) {
                    Some(first) => first.as_str(),
                    None => source
                        .get("groupSnapshotHandles")?
                        .get("volumeGroupSnapshotHandle")?
                        .as_str(),
                }
            }
        }
    }
}

/// The node each of the driver's per-node VolumeGroupSnapshotClasses is for (class name ->
/// node), from a list answer of classes: those labelled [`MANAGED_BY`].
pub fn class_nodes(classes: &Value, driver: &str) -> HashMap<String, String> {
    items(classes)
        .filter(|c| c.get("driver").and_then(Value::as_str) == Some(driver))
        .filter_map(|c| {
            let name = c.pointer("/metadata/name")?.as_str()?;
            let node = c.pointer("/metadata/labels")?.get(MANAGED_BY)?.as_str()?;
            Some((name.to_owned(), node.to_owned()))
        })
        .collect()
}

/// The driver's VolumeGroupSnapshotClasses that no node has (no [`MANAGED_BY`]), as the
/// copies node `node` must publish: `<name>-<node>`, labelled with the node, the same driver,
/// deletion policy and parameters. Those that exist already (in `classes`) are left out.
pub fn class_copies(classes: &Value, driver: &str, node: &str) -> Vec<Value> {
    let existing: Vec<&str> = items(classes)
        .filter_map(|c| c.pointer("/metadata/name")?.as_str())
        .collect();
    items(classes)
        .filter(|c| c.get("driver").and_then(Value::as_str) == Some(driver))
        .filter(|c| {
            c.pointer("/metadata/labels")
                .and_then(|l| l.get(MANAGED_BY))
                .is_none()
        })
        .filter_map(|c| {
            let name = format!("{}-{node}", c.pointer("/metadata/name")?.as_str()?);
            if existing.contains(&name.as_str()) {
                return None;
            }
            let mut copy = serde_json::json!({
                "apiVersion": "groupsnapshot.storage.k8s.io/v1",
                "kind": "VolumeGroupSnapshotClass",
                "metadata": { "name": name, "labels": { MANAGED_BY: node } },
                "driver": driver,
                "deletionPolicy": c.get("deletionPolicy").cloned().unwrap_or(Value::Null),
            });
            if let Some(p) = c.get("parameters") {
                copy["parameters"] = p.clone();
            }
            Some(copy)
        })
        .collect()
}

fn items(list: &Value) -> impl Iterator<Item = &Value> {
    list.get("items")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
}

/// The names, in a list answer of `kind`, of the contents of `driver` without [`MANAGED_BY`]
/// that are node `node`'s: a group content whose class is a per-node class (`classes`, from
/// [`class_nodes`]) is that class's node's (the only snapshotter that sees the class);
/// any other content is the node's its first member's id names (it ends `@<node>`).
pub fn ours(
    kind: Kind,
    list: &Value,
    classes: &HashMap<String, String>,
    driver: &str,
    node: &str,
) -> Vec<String> {
    items(list)
        .filter(|item| item.pointer("/spec/driver").and_then(Value::as_str) == Some(driver))
        .filter(|item| {
            item.pointer("/metadata/labels")
                .and_then(|l| l.get(MANAGED_BY))
                .is_none()
        })
        .filter(|item| {
            let class = item
                .pointer("/spec/volumeGroupSnapshotClassName")
                .and_then(Value::as_str)
                .filter(|_| kind == Kind::Group)
                .and_then(|c| classes.get(c));
            let owner = match class {
                Some(n) => Some(n.as_str()),
                None => item
                    .pointer("/spec/source")
                    .and_then(|s| kind.first_id(s))
                    .and_then(|id| id.rsplit_once('@'))
                    .map(|(_, n)| n),
            };
            owner == Some(node)
        })
        .filter_map(|item| item.pointer("/metadata/name").and_then(Value::as_str))
        .map(str::to_owned)
        .collect()
}

/// The merge patch that labels a content with its node.
pub fn label_patch(node: &str) -> Value {
    serde_json::json!({ "metadata": { "labels": { MANAGED_BY: node } } })
}

/// Why a call to the API server failed.
#[derive(Debug, thiserror::Error)]
pub enum KubeError {
    /// Not in a pod, or the pod's service account is not mounted.
    #[error("not in a pod that may reach the API server: {0}")]
    Environment(String),
    /// The connection, TLS or HTTP.
    #[error("{0}")]
    Transport(String),
    /// The API server answered with an error status.
    #[error("{method} {path}: HTTP {status}: {body}")]
    Status {
        /// The request's method.
        method: &'static str,
        /// Its path.
        path: String,
        /// The status code.
        status: u16,
        /// The answer's body, shortened.
        body: String,
    },
}

/// The API server as a pod reaches it.
#[derive(Debug, Clone)]
pub struct InCluster {
    host: String,
    port: u16,
    token: PathBuf,
    tls: Arc<rustls::ClientConfig>,
}

impl InCluster {
    /// From the pod's environment and its service account's files.
    pub fn from_env() -> Result<Self, KubeError> {
        let var = |n: &str| {
            std::env::var(n).map_err(|_| KubeError::Environment(format!("{n} is not set")))
        };
        let host = var("KUBERNETES_SERVICE_HOST")?;
        let port = var("KUBERNETES_SERVICE_PORT")?
            .parse()
            .map_err(|e| KubeError::Environment(format!("KUBERNETES_SERVICE_PORT: {e}")))?;
        let dir = Path::new(SERVICE_ACCOUNT);
        Self::new(host, port, &dir.join("ca.crt"), dir.join("token"))
    }

    /// The API server at `host:port`, whose certificate the PEM file `ca` signed, called with
    /// the bearer token in `token` (read at each call: a projected token is renewed).
    pub fn new(host: String, port: u16, ca: &Path, token: PathBuf) -> Result<Self, KubeError> {
        let mut roots = rustls::RootCertStore::empty();
        let certs = CertificateDer::pem_file_iter(ca)
            .map_err(|e| KubeError::Environment(format!("{}: {e}", ca.display())))?;
        for cert in certs {
            let cert =
                cert.map_err(|e| KubeError::Environment(format!("{}: {e}", ca.display())))?;
            roots
                .add(cert)
                .map_err(|e| KubeError::Environment(format!("{}: {e}", ca.display())))?;
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let tls = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| KubeError::Environment(format!("TLS: {e}")))?
            .with_root_certificates(roots)
            .with_no_client_auth();
        Ok(Self {
            host,
            port,
            token,
            tls: Arc::new(tls),
        })
    }

    /// One request (HTTP/1.0: one connection, the answer whole, never chunked); the body of a
    /// 2xx answer as JSON.
    pub async fn call(
        &self,
        method: &'static str,
        path: &str,
        body: Option<(&str, &Value)>,
    ) -> Result<Value, KubeError> {
        let t = |what: &str, e: &dyn std::fmt::Display| {
            KubeError::Transport(format!("{method} {path}: {what}: {e}"))
        };
        let token = std::fs::read_to_string(&self.token)
            .map_err(|e| KubeError::Environment(format!("{}: {e}", self.token.display())))?;
        let server = ServerName::try_from(self.host.clone()).map_err(|e| t("server name", &e))?;
        let tcp = tokio::net::TcpStream::connect((self.host.as_str(), self.port))
            .await
            .map_err(|e| t("connect", &e))?;
        let mut tls = tokio_rustls::TlsConnector::from(Arc::clone(&self.tls))
            .connect(server, tcp)
            .await
            .map_err(|e| t("TLS", &e))?;
        let payload = body.map(|(_, v)| v.to_string()).unwrap_or_default();
        let mut head = format!(
            "{method} {path} HTTP/1.0\r\nHost: {}:{}\r\nAuthorization: Bearer {}\r\n\
             Accept: application/json\r\nUser-Agent: moor-controller\r\n",
            self.host,
            self.port,
            token.trim()
        );
        if let Some((content_type, _)) = body {
            head.push_str(&format!(
                "Content-Type: {content_type}\r\nContent-Length: {}\r\n",
                payload.len()
            ));
        }
        head.push_str("\r\n");
        tls.write_all(head.as_bytes())
            .await
            .map_err(|e| t("write", &e))?;
        tls.write_all(payload.as_bytes())
            .await
            .map_err(|e| t("write", &e))?;
        tls.flush().await.map_err(|e| t("write", &e))?;
        let mut answer = Vec::new();
        // The server closes after its answer; a peer that closes without TLS's close_notify
        // still gave the whole answer (HTTP/1.0 ends with the connection).
        match (&mut tls).take(MAX_ANSWER).read_to_end(&mut answer).await {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof && !answer.is_empty() => {}
            Err(e) => return Err(t("read", &e)),
        }
        let (status, body) = parse_answer(&answer).map_err(|e| t("answer", &e))?;
        if !(200..300).contains(&status) {
            let mut body = String::from_utf8_lossy(body).into_owned();
            body.truncate(500);
            return Err(KubeError::Status {
                method,
                path: path.to_owned(),
                status,
                body,
            });
        }
        serde_json::from_slice(body).map_err(|e| t("JSON", &e))
    }
}

/// The status code and the body of an HTTP answer.
fn parse_answer(answer: &[u8]) -> Result<(u16, &[u8]), String> {
    let end = answer
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or("no end of the header")?;
    let head = std::str::from_utf8(&answer[..end]).map_err(|e| e.to_string())?;
    let status = head
        .lines()
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| format!("no status in {:?}", head.lines().next()))?;
    Ok((status, &answer[end + 4..]))
}

/// Labels, every `interval`, the contents of `driver` that live on `node` and carry no
/// [`MANAGED_BY`] (see the module's doc). Runs until `stop` resolves; failures are logged and
/// tried again at the next round.
pub async fn mark_contents(
    api: InCluster,
    driver: String,
    node: String,
    interval: Duration,
    stop: impl std::future::Future<Output = ()>,
) {
    rounds(
        interval,
        "snapshot contents not marked with their node; retrying",
        stop,
        || mark_once(&api, &driver, &node),
    )
    .await;
}

/// `round` every `interval` until `stop` resolves; a failure logged as `failed`, once per
/// change, not every round (an API server down for an hour is one line).
async fn rounds<F, R>(
    interval: Duration,
    failed: &'static str,
    stop: impl std::future::Future<Output = ()>,
    mut round: F,
) where
    F: FnMut() -> R,
    R: std::future::Future<Output = Result<(), KubeError>>,
{
    let rounds = async {
        let mut last_error = String::new();
        loop {
            let error = match round().await {
                Ok(()) => String::new(),
                Err(e) => e.to_string(),
            };
            if error != last_error && !error.is_empty() {
                warn!(error = %error, "{failed}");
            }
            last_error = error;
            tokio::time::sleep(interval).await;
        }
    };
    tokio::select! {
        () = rounds => {}
        () = stop => {}
    }
}

async fn mark_once(api: &InCluster, driver: &str, node: &str) -> Result<(), KubeError> {
    const CLASSES: &str = "/apis/groupsnapshot.storage.k8s.io/v1/volumegroupsnapshotclasses";
    let classes = api.call("GET", CLASSES, None).await?;
    for copy in class_copies(&classes, driver, node) {
        match api
            .call("POST", CLASSES, Some(("application/json", &copy)))
            .await
        {
            Ok(_) => info!(
                name = copy["metadata"]["name"].as_str().unwrap_or_default(),
                node, "group snapshot class published for this node"
            ),
            // Made since the list: by an earlier run of this node's controller.
            Err(KubeError::Status { status: 409, .. }) => {}
            Err(e) => return Err(e),
        }
    }
    let class_nodes = class_nodes(&classes, driver);
    // Only those without the label: the labelled ones (most) are not sent.
    let selector = format!("?labelSelector=%21{}", MANAGED_BY.replace('/', "%2F"));
    let patch = label_patch(node);
    for kind in Kind::ALL {
        let list = api
            .call("GET", &format!("{}{selector}", kind.path()), None)
            .await?;
        for name in ours(kind, &list, &class_nodes, driver, node) {
            api.call(
                "PATCH",
                &format!("{}/{name}", kind.path()),
                Some(("application/merge-patch+json", &patch)),
            )
            .await?;
            info!(
                kind = kind.name(),
                name, node, "snapshot content marked with its node"
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;

/// The annotation on a PersistentVolume or a PersistentVolumeClaim that sets its volume's data
/// key rotation schedule over its class's `keyRotationSchedule` (the same periods;
/// docs/encryption.md, "Scheduled rotation"); the claim's wins over the volume's, as a user
/// sets it on the claim.
pub const KEY_ROTATION_SCHEDULE_ANNOTATION: &str = "moor.csi.io/key-rotation-schedule";

/// Every volume of `driver` among `pvs` (a PersistentVolume list) by its handle, with the
/// schedule its annotations say: its claim's (found in `pvcs`, a claim list, by the volume's
/// `claimRef`), else its own, else `None`.
pub fn rotation_schedules(
    pvs: &Value,
    pvcs: &Value,
    driver: &str,
) -> std::collections::BTreeMap<String, Option<String>> {
    let annotation = |o: &Value| {
        o["metadata"]["annotations"][KEY_ROTATION_SCHEDULE_ANNOTATION]
            .as_str()
            .map(str::to_owned)
    };
    let claims: HashMap<(&str, &str), &Value> = pvcs["items"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|c| {
            let m = &c["metadata"];
            Some(((m["namespace"].as_str()?, m["name"].as_str()?), c))
        })
        .collect();
    pvs["items"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|pv| pv["spec"]["csi"]["driver"].as_str() == Some(driver))
        .filter_map(|pv| {
            let handle = pv["spec"]["csi"]["volumeHandle"].as_str()?;
            let claim_ref = &pv["spec"]["claimRef"];
            let claim = claim_ref["namespace"]
                .as_str()
                .zip(claim_ref["name"].as_str())
                .and_then(|k| claims.get(&k));
            let schedule = claim.and_then(|c| annotation(c)).or_else(|| annotation(pv));
            Some((handle.to_owned(), schedule))
        })
        .collect()
}

/// Copies the [`KEY_ROTATION_SCHEDULE_ANNOTATION`] of every PersistentVolume of `driver`
/// (or of its claim) into its encrypted volume's record in `backend`, every `interval`, until
/// `stop` resolves: the node's scheduler then asks the record. A volume that is not this
/// controller's, or not encrypted, is left alone; a schedule that is not a period is logged
/// and not copied. Needs `list` on PersistentVolumes and PersistentVolumeClaims.
pub async fn apply_rotation_schedules<B: crate::backend::Backend + ?Sized + 'static>(
    api: InCluster,
    backend: Arc<B>,
    driver: String,
    interval: Duration,
    stop: impl std::future::Future<Output = ()>,
) {
    rounds(
        interval,
        "rotation schedule annotations not read; retrying",
        stop,
        || schedules_once(&api, &backend, &driver),
    )
    .await;
}

async fn schedules_once<B: crate::backend::Backend + ?Sized + 'static>(
    api: &InCluster,
    backend: &Arc<B>,
    driver: &str,
) -> Result<(), KubeError> {
    let pvs = api.call("GET", "/api/v1/persistentvolumes", None).await?;
    let pvcs = api
        .call("GET", "/api/v1/persistentvolumeclaims", None)
        .await?;
    let wanted = rotation_schedules(&pvs, &pvcs, driver);
    let backend = Arc::clone(backend);
    let _ = tokio::task::spawn_blocking(move || {
        for (volume, schedule) in wanted {
            if backend.volume_keys(&volume).is_err() {
                continue;
            }
            match crate::encryption::rotation::set_schedule_on(
                backend.as_ref(),
                &volume,
                schedule.as_deref(),
            ) {
                Ok(true) => info!(volume, ?schedule, "rotation schedule annotation recorded"),
                Ok(false) => {}
                Err(e) => warn!(volume, error = %e, "rotation schedule annotation not recorded"),
            }
        }
    })
    .await;
    Ok(())
}
