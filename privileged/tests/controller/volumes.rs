//! A volume's life on real loop devices: attach and detach, read-only, snapshots, restores and
//! clones carrying the data, growing while attached, a restart with a volume attached, and
//! concurrent attaches.

use std::collections::BTreeSet;
use std::fs::{self, File, OpenOptions};
use std::os::unix::fs::{FileExt as _, FileTypeExt as _, MetadataExt as _};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Barrier};

use moor_controller::backend::{
    Backend as _, CapacityRange, ContentSource, ExpandRequest, NewSnapshot, Parameters,
    PublishContext,
};
use moor_controller::embedded::attach::{Attacher as _, LoopAttacher};
use moor_controller::embedded::records::{Publication, RecordStore};
use moor_runtime::contract::{BACKING_FILE_KEY, DEVICE_PATH_KEY};

use crate::fixture::*;

#[test]
fn attach_and_detach() {
    let fx = Fixture::new("attach");
    let id = fx.create("pvc-attach", 16 * MIB);
    let ctx = fx.publish(&id);
    let dev = ctx[DEVICE_PATH_KEY].clone();
    let backing = ctx[BACKING_FILE_KEY].clone();
    assert!(
        fs::metadata(&dev)
            .expect("device node")
            .file_type()
            .is_block_device(),
        "{dev} is a block device"
    );
    assert!(Path::new(&backing).is_absolute());
    assert_eq!(sysfs_backing(&dev).as_deref(), Some(backing.as_str()));
    assert_eq!(
        sysfs_flag(&dev, "loop/autoclear"),
        "0",
        "the attach must outlive us"
    );
    assert_eq!(sysfs_flag(&dev, "ro"), "0");
    // Direct I/O wherever the kernel gives a file there direct I/O (on CI's disk it does; on a
    // filesystem without it, or a disk of larger logical blocks, it does not).
    let kernel_gives = kernel_gives_direct_io(&fx.dir);
    assert_eq!(
        sysfs_flag(&dev, "loop/dio"),
        if kernel_gives { "1" } else { "0" },
        "{dev}: the loop driver's direct I/O (losetup --direct-io=on gets it there: {kernel_gives})"
    );
    assert_eq!(device_size(&dev), 16 * MIB);
    // Idempotent: the same device.
    assert_eq!(fx.publish(&id), ctx);
    assert_eq!(fx.devices().len(), 1);
    let status = fx.b().get_volume(&id).expect("get volume");
    assert_eq!(status.published_nodes, vec![NODE.to_string()]);
    assert!(!status.condition.abnormal, "{:?}", status.condition);
    // Deleting an attached volume is refused.
    let e = fx.b().delete_volume(&id).unwrap_err();
    assert_eq!(e.code(), tonic::Code::FailedPrecondition);
    fx.unpublish(&id);
    assert!(
        wait_unbound(&dev, &fx.dir),
        "{dev} still bound after unpublish"
    );
    assert!(fx.devices().is_empty());
    fx.unpublish(&id);
    delete_when_unbound(fx.b(), &id);
    assert!(!Path::new(&backing).exists());
}

/// A ramfs mounted in this thread's own mount namespace, its bound loop devices detached and
/// it unmounted on drop (also when the test fails).
struct Ramfs {
    dir: PathBuf,
    bound: Vec<(PathBuf, moor_controller::embedded::attach::FileId)>,
}

impl Drop for Ramfs {
    fn drop(&mut self) {
        let attacher = LoopAttacher::new();
        for (dev, file) in &self.bound {
            let _ = attacher.detach(dev, *file);
            let _ = wait_unbound(&dev.display().to_string(), &self.dir);
        }
        let _ = rustix::mount::unmount(self.dir.as_path(), rustix::mount::UnmountFlags::DETACH);
        let _ = fs::remove_dir_all(&self.dir);
    }
}

#[test]
fn a_file_that_cannot_take_direct_io_is_bound_buffered() {
    moor_runtime::sys::mount_namespace::enter_private_mount_namespace()
        .expect("a private mount namespace");
    let mut ramfs = Ramfs {
        dir: temp_dir("ramfs"),
        bound: Vec::new(),
    };
    rustix::mount::mount(
        "moor-test",
        ramfs.dir.as_path(),
        "ramfs",
        rustix::mount::MountFlags::empty(),
        None,
    )
    .expect("mount a ramfs");
    let file = ramfs.dir.join("pvc-ramfs.img");
    File::create(&file)
        .and_then(|f| f.set_len(16 * MIB))
        .expect("the backing file");
    assert!(
        rustix::fs::open(
            &file,
            rustix::fs::OFlags::RDONLY | rustix::fs::OFlags::DIRECT,
            rustix::fs::Mode::empty()
        )
        .is_err(),
        "ramfs takes O_DIRECT here: the test proves nothing"
    );
    let attacher = LoopAttacher::new();
    let dev = attacher
        .attach(&file, false)
        .expect("a file without direct I/O is still attached");
    ramfs.bound.push((
        dev.clone(),
        moor_controller::embedded::attach::FileId::of_path(&file).expect("stat"),
    ));
    let dev = dev.display().to_string();
    assert_eq!(sysfs_backing(&dev).as_deref(), file.to_str());
    assert_eq!(sysfs_flag(&dev, "loop/dio"), "0", "{dev}: buffered");
    let blocks = pattern(7);
    write_through(&dev, &blocks);
    read_back(&dev, &blocks);
}

#[test]
fn read_only_attach() {
    let fx = Fixture::new("readonly");
    let id = fx.create("pvc-ro", 4 * MIB);
    let mut req = publish_req(&id);
    req.readonly = true;
    let ctx = fx.b().publish_volume(&req).expect("publish read-only");
    let dev = &ctx[DEVICE_PATH_KEY];
    assert_eq!(sysfs_flag(dev, "ro"), "1");
    assert!(
        OpenOptions::new().write(true).open(dev).is_err() || {
            // Some kernels let the open succeed and refuse the write.
            let f = OpenOptions::new().write(true).open(dev).expect("open");
            f.write_all_at(b"x", 0).and_then(|()| f.sync_all()).is_err()
        }
    );
    fx.unpublish(&id);
    assert!(wait_unbound(dev, &fx.dir));
}

#[test]
fn snapshot_restore_and_clone_carry_the_data() {
    let fx = Fixture::new("snapshot");
    let src = fx.create("pvc-src", 32 * MIB);
    let src_dev = fx.publish(&src)[DEVICE_PATH_KEY].clone();
    let data = pattern(1);
    write_through(&src_dev, &data);
    let snap = fx
        .b()
        .create_snapshot(&NewSnapshot {
            name: "snap-1".into(),
            source_volume_id: src.clone(),
            parameters: Parameters::new(),
        })
        .expect("snapshot");
    assert!(snap.ready_to_use);
    assert_eq!(snap.size_bytes, 32 * MIB);
    let snap_file = fx.b().layout().snapshots.join(format!("{}.img", snap.id));
    let meta = fs::metadata(&snap_file).expect("snapshot file");
    assert_eq!(meta.len(), 32 * MIB);
    assert!(
        meta.blocks() * 512 < 8 * MIB,
        "the snapshot kept the holes ({} blocks)",
        meta.blocks()
    );
    // Writes after the snapshot do not reach it.
    write_through(&src_dev, &pattern(2));

    let restored = fx
        .b()
        .create_volume(&new_volume(
            "pvc-restored",
            64 * MIB,
            Some(ContentSource::Snapshot(snap.id.clone())),
        ))
        .expect("restore");
    assert_eq!(restored.capacity_bytes, 64 * MIB);
    let restored_dev = fx.publish(&restored.id)[DEVICE_PATH_KEY].clone();
    assert_eq!(device_size(&restored_dev), 64 * MIB);
    read_back(&restored_dev, &data);

    let clone = fx
        .b()
        .create_volume(&new_volume(
            "pvc-clone",
            MIB,
            Some(ContentSource::Volume(src.clone())),
        ))
        .expect("clone");
    assert_eq!(clone.capacity_bytes, 32 * MIB, "at least the source's size");
    let clone_dev = fx.publish(&clone.id)[DEVICE_PATH_KEY].clone();
    read_back(&clone_dev, &pattern(2));

    for id in [&src, &restored.id, &clone.id] {
        fx.unpublish(id);
        delete_when_unbound(fx.b(), id);
    }
    // Snapshots outlive their source.
    let again = fx
        .b()
        .create_volume(&new_volume(
            "pvc-again",
            32 * MIB,
            Some(ContentSource::Snapshot(snap.id.clone())),
        ))
        .expect("restore after the source is gone");
    let dev = fx.publish(&again.id)[DEVICE_PATH_KEY].clone();
    read_back(&dev, &data);
    fx.unpublish(&again.id);
    fx.b().delete_snapshot(&snap.id).expect("delete snapshot");
    assert!(!snap_file.exists());
    for d in [&src_dev, &restored_dev, &clone_dev, &dev] {
        assert!(wait_unbound(d, &fx.dir));
    }
    assert!(fx.devices().is_empty());
}

#[test]
fn expand_grows_the_attached_device() {
    let fx = Fixture::new("expand");
    let id = fx.create("pvc-grow", 8 * MIB);
    let dev = fx.publish(&id)[DEVICE_PATH_KEY].clone();
    write_through(&dev, &pattern(3)[..1]);
    assert_eq!(device_size(&dev), 8 * MIB);
    let size = fx
        .b()
        .expand_volume(&ExpandRequest {
            volume_id: id.clone(),
            capacity: CapacityRange {
                required: 20 * MIB,
                limit: 0,
            },
            capability: Some(block_cap()),
        })
        .expect("expand");
    assert_eq!(size, 20 * MIB);
    assert_eq!(device_size(&dev), 20 * MIB);
    // The kernel's own view through the device node agrees.
    let f = File::open(&dev).expect("open device");
    let end = rustix::fs::seek(&f, rustix::fs::SeekFrom::End(0)).expect("seek");
    assert_eq!(end, 20 * MIB);
    drop(f);
    read_back(&dev, &pattern(3)[..1]);
    // Idempotent, never shrinks.
    let size = fx
        .b()
        .expand_volume(&ExpandRequest {
            volume_id: id.clone(),
            capacity: CapacityRange {
                required: 10 * MIB,
                limit: 0,
            },
            capability: None,
        })
        .expect("expand smaller");
    assert_eq!(size, 20 * MIB);
    assert_eq!(device_size(&dev), 20 * MIB);
    fx.unpublish(&id);
    assert!(wait_unbound(&dev, &fx.dir));
}

#[test]
fn restart_with_an_attached_volume() {
    let mut fx = Fixture::new("restart");
    let a = fx.create("pvc-a", 4 * MIB);
    let b = fx.create("pvc-b", 4 * MIB);
    let ctx = fx.publish(&a);
    let dev = ctx[DEVICE_PATH_KEY].clone();
    write_through(&dev, &pattern(4)[..1]);
    let before = fx.devices();

    // A clean restart: nothing to do, nothing lost, nothing leaked.
    let report = fx.restart();
    assert!(report.is_clean(), "{report:?}");
    assert_eq!(report.volumes, 2);
    assert_eq!(fx.devices(), before);
    assert_eq!(fx.publish(&a), ctx, "the attach survived, the record too");
    assert_eq!(fx.devices().len(), 1);

    // A device the records do not know (a publish that died before recording, on a volume
    // the records say is not published): detached at start.
    let b_file = fx.b().layout().volumes.join(format!("{b}.img"));
    let attacher = LoopAttacher::new();
    let stray = attacher.attach(&b_file, false).expect("stray attach");
    let stray = stray.display().to_string();
    let report = fx.restart();
    assert_eq!(report.detached.len(), 1, "{report:?}");
    assert!(wait_unbound(&stray, &fx.dir));
    assert_eq!(fx.devices().len(), 1);

    // A publish that died after recording its intent and attaching: adopted.
    let (store, loaded) = RecordStore::open(&fx.b().layout().records).expect("records");
    let mut record = loaded.volumes.get(&b).cloned().expect("record of b");
    record.publication = Some(Publication {
        node_id: NODE.into(),
        readonly: false,
        device: None,
    });
    store.put_volume(&record).expect("write intent");
    let adopted = attacher.attach(&b_file, false).expect("attach");
    let report = fx.restart();
    assert_eq!(report.adopted.len(), 1, "{report:?}");
    assert_eq!(report.adopted[0].1, adopted);
    let ctx_b = fx.publish(&b);
    assert_eq!(PathBuf::from(&ctx_b[DEVICE_PATH_KEY]), adopted);
    assert_eq!(fx.devices().len(), 2);

    // A device lost behind the controller's back (a reboot, an operator's losetup -d): the
    // record is corrected and publishing attaches again.
    let file_a =
        moor_controller::embedded::attach::FileId::of_path(Path::new(&ctx[BACKING_FILE_KEY]))
            .expect("stat");
    attacher
        .detach(Path::new(&dev), file_a)
        .expect("detach behind its back");
    assert!(wait_unbound(&dev, &fx.dir));
    let report = fx.restart();
    assert_eq!(report.corrected.len(), 1, "{report:?}");
    assert!(fx.b().get_volume(&a).expect("a").published_nodes.is_empty());
    let new_dev = fx.publish(&a)[DEVICE_PATH_KEY].clone();
    read_back(&new_dev, &pattern(4)[..1]);

    fx.unpublish(&a);
    fx.unpublish(&b);
    assert!(wait_unbound(&new_dev, &fx.dir));
    assert!(wait_unbound(&ctx_b[DEVICE_PATH_KEY], &fx.dir));
    assert!(fx.devices().is_empty());
}

#[test]
fn eight_concurrent_attaches() {
    let fx = Fixture::new("concurrent");
    let ids: Vec<String> = (0..8)
        .map(|i| fx.create(&format!("pvc-{i}"), 2 * MIB))
        .collect();
    let backend = Arc::clone(fx.backend.as_ref().expect("backend"));
    let barrier = Arc::new(Barrier::new(ids.len()));
    let threads: Vec<_> = ids
        .iter()
        .cloned()
        .map(|id| {
            let backend = Arc::clone(&backend);
            let barrier = Arc::clone(&barrier);
            std::thread::spawn(move || {
                barrier.wait();
                backend.publish_volume(&publish_req(&id))
            })
        })
        .collect();
    let contexts: Vec<PublishContext> = threads
        .into_iter()
        .map(|t| t.join().expect("thread").expect("publish"))
        .collect();
    let devices: BTreeSet<&String> = contexts.iter().map(|c| &c[DEVICE_PATH_KEY]).collect();
    assert_eq!(devices.len(), 8, "eight distinct devices");
    eprintln!(
        "attach races lost to concurrent attaches (and retried): {}",
        backend.attacher().races_lost()
    );
    for c in &contexts {
        assert_eq!(
            sysfs_backing(&c[DEVICE_PATH_KEY]).as_deref(),
            Some(c[BACKING_FILE_KEY].as_str()),
            "each device backs its own volume"
        );
    }
    assert_eq!(fx.devices().len(), 8);
    let threads: Vec<_> = ids
        .iter()
        .cloned()
        .map(|id| {
            let backend = Arc::clone(&backend);
            std::thread::spawn(move || backend.unpublish_volume(&id, Some(NODE)))
        })
        .collect();
    for t in threads {
        t.join().expect("thread").expect("unpublish");
    }
    for d in devices {
        assert!(wait_unbound(d, &fx.dir), "{d} still bound");
    }
    assert!(fx.devices().is_empty());
}
