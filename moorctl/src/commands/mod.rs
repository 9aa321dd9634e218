//! The commands that are one or a few CSI calls: each builds a request from the command line,
//! makes the call and turns the answer into a [`Report`]: [`identity`]'s `info` and `probe`,
//! [`controller`]'s volumes, snapshots and attachments, [`node`]'s stages, mounts and stats.

mod controller;
mod identity;
mod keys;
mod node;

pub use self::controller::{publish, snapshot, unpublish, volume};
pub use self::identity::{info, probe};
pub use self::keys::{key_unwrap, rotate_kek, rotate_key};
pub use self::node::{mount, stage, stats, unmount, unstage};

use std::time::Duration;

use csi::controller_client::ControllerClient;
use csi::identity_client::IdentityClient;
use csi::node_client::NodeClient;
use csi::volume_capability::{AccessMode, AccessType, BlockVolume, MountVolume, access_mode};
use moor_proto::csi::v1 as csi;
use serde_json::{Value, json};
use tonic::transport::Channel;

use crate::cli::{self, CapabilityArgs};
use crate::secrets::Secrets;

/// Clients of the three CSI services on one connection.
#[derive(Debug, Clone)]
pub struct Clients {
    identity: IdentityClient<Channel>,
    controller: ControllerClient<Channel>,
    node: NodeClient<Channel>,
    /// moor's own key calls on the node (`moor.keys.v1`).
    keys: moor_proto::keys::v1::node_keys_client::NodeKeysClient<Channel>,
    /// moor's own key calls on the controller (`moor.keys.v1`).
    controller_keys: moor_proto::keys::v1::controller_keys_client::ControllerKeysClient<Channel>,
    /// What the calls that carry secrets are given.
    secrets: Secrets,
}

impl Clients {
    /// Clients on `channel`, whose calls carry `secrets`.
    pub fn new(channel: Channel, secrets: Secrets) -> Self {
        Self {
            identity: IdentityClient::new(channel.clone()),
            controller: ControllerClient::new(channel.clone()),
            node: NodeClient::new(channel.clone()),
            keys: moor_proto::keys::v1::node_keys_client::NodeKeysClient::new(channel.clone()),
            controller_keys:
                moor_proto::keys::v1::controller_keys_client::ControllerKeysClient::new(channel),
            secrets,
        }
    }
}

/// A request with the call deadline set.
fn req<T>(msg: T, timeout: Duration) -> tonic::Request<T> {
    let mut r = tonic::Request::new(msg);
    r.set_timeout(timeout);
    r
}

/// The CSI capability the arguments describe.
pub fn capability(args: &CapabilityArgs) -> csi::VolumeCapability {
    use access_mode::Mode;
    let mode = match args.access_mode {
        cli::AccessMode::SingleNodeWriter => Mode::SingleNodeWriter,
        cli::AccessMode::SingleNodeReaderOnly => Mode::SingleNodeReaderOnly,
        cli::AccessMode::MultiNodeReaderOnly => Mode::MultiNodeReaderOnly,
        cli::AccessMode::MultiNodeSingleWriter => Mode::MultiNodeSingleWriter,
        cli::AccessMode::MultiNodeMultiWriter => Mode::MultiNodeMultiWriter,
        cli::AccessMode::SingleNodeSingleWriter => Mode::SingleNodeSingleWriter,
        cli::AccessMode::SingleNodeMultiWriter => Mode::SingleNodeMultiWriter,
    };
    let access_type = if args.block {
        AccessType::Block(BlockVolume {})
    } else {
        AccessType::Mount(MountVolume {
            fs_type: args.fs_type.clone(),
            mount_flags: args.mount_flags.clone(),
            volume_mount_group: String::new(),
        })
    };
    csi::VolumeCapability {
        access_mode: Some(AccessMode { mode: mode as i32 }),
        access_type: Some(access_type),
    }
}

fn condition_text(c: Option<&csi::VolumeCondition>) -> String {
    match c {
        Some(c) if c.abnormal => format!("abnormal: {}", c.message),
        Some(c) if c.message.is_empty() => "normal".into(),
        Some(c) => format!("normal: {}", c.message),
        None => "-".into(),
    }
}

fn condition_json(c: Option<&csi::VolumeCondition>) -> Value {
    c.map_or(
        Value::Null,
        |c| json!({ "abnormal": c.abnormal, "message": c.message }),
    )
}

fn list_text(items: &[String]) -> String {
    if items.is_empty() {
        "-".into()
    } else {
        items.join(", ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capabilities_from_arguments() {
        let args = CapabilityArgs {
            block: false,
            fs_type: "xfs".into(),
            mount_flags: vec!["noatime".into()],
            access_mode: cli::AccessMode::SingleNodeReaderOnly,
        };
        let cap = capability(&args);
        assert_eq!(
            cap.access_mode.map(|m| m.mode),
            Some(access_mode::Mode::SingleNodeReaderOnly as i32)
        );
        assert!(matches!(
            cap.access_type,
            Some(AccessType::Mount(ref m)) if m.fs_type == "xfs" && m.mount_flags == ["noatime"]
        ));
        let block = capability(&CapabilityArgs {
            block: true,
            ..args
        });
        assert!(matches!(block.access_type, Some(AccessType::Block(_))));
    }

    #[test]
    fn conditions_read_plainly() {
        assert_eq!(condition_text(None), "-");
        assert_eq!(
            condition_text(Some(&csi::VolumeCondition {
                abnormal: true,
                message: "device /dev/loop3 is gone".into()
            })),
            "abnormal: device /dev/loop3 is gone"
        );
    }
}
