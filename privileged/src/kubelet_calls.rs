//! CSI Node calls made the way kubelet makes them: every call on a connection of its own,
//! dialed for it and closed after it (kubelet's CSI client dials the plugin's socket for each
//! operation), and NodeGetCapabilities asked first, on its own connection, where kubelet asks
//! it: before a stage, an unstage and a publish (its attacher and mounter check that the
//! plugin stages). The connection is a [`PathClient`], which sends the socket path as the
//! `:authority`, as grpc-go does for kubelet.
//!
//! Each call returns how long it took, dial included: what kubelet waits.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use moor_proto::csi::v1 as csi;

use crate::pathgrpc::{CallError, PathClient};

/// The gRPC method paths of the CSI calls the benches make.
pub mod method {
    /// NodeGetCapabilities.
    pub const CAPABILITIES: &str = "/csi.v1.Node/NodeGetCapabilities";
    /// NodeStageVolume.
    pub const STAGE: &str = "/csi.v1.Node/NodeStageVolume";
    /// NodeUnstageVolume.
    pub const UNSTAGE: &str = "/csi.v1.Node/NodeUnstageVolume";
    /// NodePublishVolume.
    pub const PUBLISH: &str = "/csi.v1.Node/NodePublishVolume";
    /// NodeUnpublishVolume.
    pub const UNPUBLISH: &str = "/csi.v1.Node/NodeUnpublishVolume";
    /// Controller CreateVolume (the reference driver's volumes must exist before a publish).
    pub const CREATE_VOLUME: &str = "/csi.v1.Controller/CreateVolume";
}

/// A CSI Node call kubelet makes, for the per-call records of the storm benches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Call {
    /// NodeGetCapabilities.
    Capabilities,
    /// NodeStageVolume.
    Stage,
    /// NodePublishVolume.
    Publish,
    /// NodeUnpublishVolume.
    Unpublish,
    /// NodeUnstageVolume.
    Unstage,
}

impl Call {
    /// Every call, in the order of a volume's life.
    pub const ALL: [Call; 5] = [
        Call::Capabilities,
        Call::Stage,
        Call::Publish,
        Call::Unpublish,
        Call::Unstage,
    ];

    /// The short name the benches' result ids use.
    pub fn name(self) -> &'static str {
        match self {
            Call::Capabilities => "capabilities",
            Call::Stage => "stage",
            Call::Publish => "publish",
            Call::Unpublish => "unpublish",
            Call::Unstage => "unstage",
        }
    }
}

/// One unary call on a connection dialed for it and closed after it.
pub fn fresh_call<Req: prost::Message, Resp: prost::Message + Default>(
    socket: &Path,
    method: &str,
    req: &Req,
) -> Result<Resp, CallError> {
    PathClient::dial(socket)?.unary(method, req)
}

/// kubelet's client of one plugin socket.
#[derive(Debug, Clone)]
pub struct Kubelet {
    socket: PathBuf,
}

/// A call's outcome: how long it took, or why it failed (with the call, for the message).
pub type Timed = Result<Duration, String>;

impl Kubelet {
    /// A client of the plugin serving on `socket`.
    pub fn new(socket: &Path) -> Self {
        Self {
            socket: socket.to_path_buf(),
        }
    }

    /// The plugin's socket.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    fn timed<Req: prost::Message, Resp: prost::Message + Default>(
        &self,
        method: &str,
        req: &Req,
    ) -> Timed {
        let start = Instant::now();
        fresh_call::<Req, Resp>(&self.socket, method, req).map_err(|e| format!("{method}: {e}"))?;
        Ok(start.elapsed())
    }

    /// NodeGetCapabilities on a fresh connection.
    pub fn capabilities(&self) -> Timed {
        self.timed::<_, csi::NodeGetCapabilitiesResponse>(
            method::CAPABILITIES,
            &csi::NodeGetCapabilitiesRequest {},
        )
    }

    /// NodeStageVolume (after NodeGetCapabilities): the two calls' times.
    pub fn stage(&self, req: &csi::NodeStageVolumeRequest) -> Result<(Duration, Duration), String> {
        let caps = self.capabilities()?;
        let call = self.timed::<_, csi::NodeStageVolumeResponse>(method::STAGE, req)?;
        Ok((caps, call))
    }

    /// NodeUnstageVolume (after NodeGetCapabilities): the two calls' times.
    pub fn unstage(
        &self,
        req: &csi::NodeUnstageVolumeRequest,
    ) -> Result<(Duration, Duration), String> {
        let caps = self.capabilities()?;
        let call = self.timed::<_, csi::NodeUnstageVolumeResponse>(method::UNSTAGE, req)?;
        Ok((caps, call))
    }

    /// NodePublishVolume (after NodeGetCapabilities): the two calls' times.
    pub fn publish(
        &self,
        req: &csi::NodePublishVolumeRequest,
    ) -> Result<(Duration, Duration), String> {
        let caps = self.capabilities()?;
        let call = self.timed::<_, csi::NodePublishVolumeResponse>(method::PUBLISH, req)?;
        Ok((caps, call))
    }

    /// NodeUnpublishVolume (kubelet asks nothing first).
    pub fn unpublish(&self, req: &csi::NodeUnpublishVolumeRequest) -> Timed {
        self.timed::<_, csi::NodeUnpublishVolumeResponse>(method::UNPUBLISH, req)
    }
}
