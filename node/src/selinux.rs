//! SELinux labels on mounts: with `seLinuxMount: true` on the CSIDriver, kubelet asks for the
//! pod's label with a `context="..."` mount flag at NodeStageVolume and NodePublishVolume.
//!
//! The label is a property of the superblock: the stage's filesystem mount gets it, and a
//! publish, a bind mount of that filesystem, can only have the same. A node whose kernel has no
//! SELinux cannot label a mount at all, and one whose policy does not know a label cannot mount
//! with it: both are refused before the device is touched.

use crate::engine::ADOPTED_MODE;
use crate::engine::Access;
use crate::error::{Error, Result};
use crate::journal::{AccessRecord, StageRecord};
use crate::mount_options;
use crate::sys::Os;

/// Refuses SELinux options on a node whose kernel has no SELinux (FAILED_PRECONDITION).
pub fn require_support<O: Os + ?Sized>(os: &O, access: &Access) -> Result<()> {
    let Access::Mount { options, .. } = access else {
        return Ok(());
    };
    match options.selinux().first() {
        Some(label) if !os.selinux() => Err(Error::FailedPrecondition(format!(
            "mount option {label:?} needs SELinux, and this node's kernel has none"
        ))),
        _ => Ok(()),
    }?;
    // A label the node's policy does not know fails the mount (EINVAL), after a blank device
    // was formatted: refused first. (Kubelet takes the pod's file type from the runtime's
    // `lxc_contexts`; Debian's reference policy names `container_file_t` there and has no
    // such type.)
    for opt in options.selinux() {
        let label = opt.split_once('=').map_or(opt, |(_, v)| v);
        if !os.selinux_label_known(label) {
            return Err(Error::FailedPrecondition(format!(
                "mount option {opt:?}: this node's SELinux policy does not know the label"
            )));
        }
    }
    Ok(())
}

/// NodePublishVolume: the labels asked for must be the ones the volume was staged with. A
/// target already published with the stage's labels answers ALREADY_EXISTS; a new one
/// FAILED_PRECONDITION (the staged filesystem cannot carry other labels).
pub fn check_publish(
    volume_id: &str,
    access: &Access,
    stage: &StageRecord,
    published_here: bool,
) -> Result<()> {
    let (Access::Mount { options, .. }, AccessRecord::Mount { fs_options, .. }) =
        (access, &stage.access)
    else {
        return Ok(());
    };
    // A stage adopted from the mount table has no record of its options.
    if stage.access_mode == ADOPTED_MODE {
        return Ok(());
    }
    let wanted = options.selinux();
    let staged = mount_options::selinux_options(fs_options);
    if wanted == staged {
        return Ok(());
    }
    let describe = |labels: &[&str]| {
        if labels.is_empty() {
            "no SELinux label".to_string()
        } else {
            labels.join(", ")
        }
    };
    let reason = format!(
        "the volume is staged with {}, and its publish asks for {}: a bind mount has its \
         filesystem's labels",
        describe(&staged),
        describe(&wanted)
    );
    if published_here {
        Err(Error::Incompatible {
            volume: volume_id.to_string(),
            what: "published",
            reason,
        })
    } else {
        Err(Error::FailedPrecondition(format!(
            "volume {volume_id:?}: {reason}"
        )))
    }
}
