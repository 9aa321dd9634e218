//! Snapshots and clones on a filesystem that can share extents (XFS with reflinks).

use std::fs::{self, File, OpenOptions};
use std::path::PathBuf;

use moor_controller::backend::{Backend as _, ContentSource, NewSnapshot, Parameters};
use moor_controller::embedded::attach::{Attacher as _, LoopAttacher};
use moor_controller::embedded::{Config, EmbeddedBackend};
use moor_runtime::contract::DEVICE_PATH_KEY;

use crate::fixture::*;

/// An XFS filesystem (with reflinks) on a loop device, mounted in this thread's private mount
/// namespace. Drop unmounts it and releases the device; the device is also marked to go away
/// on last close at once, so even a killed test leaves nothing behind.
pub(crate) struct ReflinkFs {
    pub(crate) dir: PathBuf,
    pub(crate) mnt: PathBuf,
    _held: File,
}

impl ReflinkFs {
    pub(crate) fn new(tag: &str) -> Self {
        Self::sized(tag, 512 * MIB)
    }

    /// An XFS filesystem of `bytes` (a sparse image: only what is written takes space).
    pub(crate) fn sized(tag: &str, bytes: u64) -> Self {
        moor_privileged::require_root();
        moor_runtime::sys::mount_namespace::enter_private_mount_namespace()
            .expect("private mount namespace");
        let dir = temp_dir(tag);
        let image = dir.join("xfs.img");
        File::create(&image)
            .and_then(|f| f.set_len(bytes))
            .expect("image");
        moor_privileged::run(
            "mkfs.xfs",
            &["-q", "-m", "reflink=1", image.to_str().expect("utf-8 path")],
        );
        let attacher = LoopAttacher::new();
        let device = attacher.attach(&image, false).expect("attach image");
        let held = File::open(&device).expect("hold device");
        let file = moor_controller::embedded::attach::FileId::of_path(&image).expect("stat");
        // Detach now: the kernel finishes it when the mount and `held` are gone.
        attacher.detach(&device, file).expect("mark autoclear");
        let mnt = dir.join("mnt");
        fs::create_dir_all(&mnt).expect("mount point");
        rustix::mount::mount(
            device.as_path(),
            mnt.as_path(),
            "xfs",
            rustix::mount::MountFlags::empty(),
            None,
        )
        .expect("mount xfs");
        Self {
            dir,
            mnt,
            _held: held,
        }
    }
}

impl Drop for ReflinkFs {
    fn drop(&mut self) {
        // Loop devices of volumes kept on this filesystem first, then the filesystem.
        let attacher = LoopAttacher::new();
        if let Ok(list) = attacher.list(&self.mnt) {
            for a in list {
                let _ = attacher.detach(&a.device, a.file);
            }
        }
        let _ = rustix::mount::unmount(self.mnt.as_path(), rustix::mount::UnmountFlags::DETACH);
        let _ = fs::remove_dir_all(&self.dir);
    }
}

#[test]
fn snapshots_and_clones_are_reflinked_where_the_filesystem_can() {
    use moor_controller::embedded::copy::{CopyMethod, copy_sparse};
    let xfs = ReflinkFs::new("reflink");
    // The copy routine itself takes the reflink path here.
    let a = xfs.mnt.join("a");
    fs::write(&a, vec![9u8; 1 << 20]).expect("write a");
    let dst = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(xfs.mnt.join("b"))
        .expect("create b");
    let method = copy_sparse(&File::open(&a).expect("open a"), &dst, 2 * MIB).expect("copy");
    assert_eq!(method, CopyMethod::Reflink);
    assert_eq!(dst.metadata().expect("stat b").len(), 2 * MIB);
    drop(dst);

    // And the backend: a snapshot of 32 MiB of data costs (almost) no space.
    let (backend, _) = EmbeddedBackend::open(
        Config {
            data_dir: xfs.mnt.join("data"),
            node_id: NODE.into(),
            topology_key: "topology.moor.csi.io/node".into(),
        },
        LoopAttacher::new(),
    )
    .expect("open backend");
    let id = backend
        .create_volume(&new_volume("pvc-x", 64 * MIB, None))
        .expect("create")
        .id;
    let dev = backend.publish_volume(&publish_req(&id)).expect("publish")[DEVICE_PATH_KEY].clone();
    let data: Vec<(u64, Vec<u8>)> = (0..32u64)
        .map(|i| (i * MIB, vec![(i as u8).wrapping_add(1); MIB as usize]))
        .collect();
    write_through(&dev, &data);
    let free = || {
        let st = rustix::fs::statvfs(xfs.mnt.as_path()).expect("statvfs");
        st.f_bavail * st.f_frsize
    };
    // Let the data reach the file before measuring.
    File::open(&dev)
        .and_then(|f| f.sync_all())
        .expect("flush device");
    let before = free();
    let snap = backend
        .create_snapshot(&NewSnapshot {
            name: "s".into(),
            source_volume_id: id.clone(),
            parameters: Parameters::new(),
        })
        .expect("snapshot");
    let used = before.saturating_sub(free());
    assert!(used < 4 * MIB, "a reflinked snapshot used {used} bytes");
    let restored = backend
        .create_volume(&new_volume(
            "pvc-y",
            64 * MIB,
            Some(ContentSource::Snapshot(snap.id.clone())),
        ))
        .expect("restore");
    let rdev = backend
        .publish_volume(&publish_req(&restored.id))
        .expect("publish restored")[DEVICE_PATH_KEY]
        .clone();
    read_back(&rdev, &data);
    for v in [&id, &restored.id] {
        backend.unpublish_volume(v, None).expect("unpublish");
    }
    assert!(wait_unbound(&dev, &xfs.dir) && wait_unbound(&rdev, &xfs.dir));
}
