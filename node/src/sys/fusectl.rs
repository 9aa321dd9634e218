//! The FUSE control filesystem (`fusectl`): how many requests a FUSE connection has waiting
//! for its daemon.
//!
//! moor mounts it for itself, never in the node's tree: a detached mount (`fsopen`,
//! `fsmount`) read through its fd, so nothing shows in any mount table and a container without
//! `/sys/fs/fuse/connections` reads it too. The kernel names each connection's dir after the
//! device of the FUSE mount's superblock, which mountinfo gives as `major:minor`.
//!
//! Reading a connection's `waiting` asks nothing of its daemon: a daemon that hangs cannot
//! stall the reader.

use std::io;
use std::os::fd::OwnedFd;

use rustix::fs::{Mode, OFlags};
use rustix::mount::{FsMountFlags, FsOpenFlags, MountAttrFlags};

/// A private mount of the FUSE control filesystem.
#[derive(Debug)]
pub struct FuseControl {
    root: OwnedFd,
}

impl FuseControl {
    /// Mounts the control filesystem, detached (needs CAP_SYS_ADMIN).
    pub fn open() -> io::Result<Self> {
        let fs = rustix::mount::fsopen("fusectl", FsOpenFlags::FSOPEN_CLOEXEC)?;
        rustix::mount::fsconfig_create(&fs)?;
        let root =
            rustix::mount::fsmount(&fs, FsMountFlags::FSMOUNT_CLOEXEC, MountAttrFlags::empty())?;
        Ok(Self { root })
    }

    /// The requests waiting for an answer on the connection of the FUSE mount whose
    /// superblock is device `dev` (mountinfo's `major:minor`); NotFound when no such
    /// connection is alive (its daemon died and the last request was answered).
    pub fn waiting(&self, dev: (u32, u32)) -> io::Result<u64> {
        let name = format!("{}/waiting", connection_name(dev));
        let fd = rustix::fs::openat(
            &self.root,
            name.as_str(),
            OFlags::RDONLY | OFlags::CLOEXEC,
            Mode::empty(),
        )?;
        let mut buf = [0u8; 32];
        let n = rustix::io::read(&fd, &mut buf)?;
        std::str::from_utf8(&buf[..n])
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "fusectl waiting"))
    }
}

/// The name of a connection's dir: the kernel's own encoding of the superblock's device
/// (major in the bits above 20), printed in decimal.
fn connection_name(dev: (u32, u32)) -> String {
    ((u64::from(dev.0) << 20) | u64::from(dev.1)).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_connection_is_named_by_the_kernels_device_number() {
        // FUSE mounts take anonymous devices: major 0, the dir is the minor.
        assert_eq!(connection_name((0, 57)), "57");
        assert_eq!(connection_name((0, 1234)), "1234");
        assert_eq!(connection_name((1, 2)), "1048578");
    }
}
