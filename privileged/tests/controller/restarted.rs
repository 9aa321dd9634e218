//! A controller started again in a new mount namespace, as a restarted container is: the
//! devices its predecessor attached through a mount that is gone since are still its own, and
//! a group snapshot of volumes in use right after the restart is one instant.
//!
//! The kernel names a loop device's file through the mount it was opened by. A controller in
//! a container opens volume files through its bind mount of the data dir; when the container
//! goes, that mount is detached and sysfs names the file `/volumes/<id>.img`, no longer under
//! the data dir. A controller that took only paths under its data dir as its own lost every
//! publication at its next start ("publication corrected: not published"), and then cut group
//! snapshots of those volumes without freezing them (logged `frozen=0` while both were mounted
//! read-write).

use std::fs;
use std::path::{Path, PathBuf};
use std::time::Instant;

use moor_controller::backend::{Backend as _, GroupSnapshotRef};
use moor_controller::embedded::attach::{Attacher as _, FileId, LoopAttacher};
use moor_controller::embedded::{Config, EmbeddedBackend};
use moor_privileged::client::DEADLINE;
use moor_runtime::contract::DEVICE_PATH_KEY;

use crate::fixture::*;
use crate::groups::{Mounts, Writer, group, open_log, restored_records, two_volumes};

/// Group snapshots cut after the restart, each checked for write order.
const GROUPS: usize = 8;

/// The test's dir, and the loop devices bound to the volume files of its data dir, released
/// on drop (also when the test fails): a device named through a mount that is gone is found by
/// the identity of the file it serves, not by its path.
struct Cleanup {
    dir: PathBuf,
    devices: Vec<PathBuf>,
    /// Files the devices may serve besides those under `real/volumes` (deleted since).
    files: Vec<FileId>,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        let attacher = LoopAttacher::new();
        let mut files: Vec<FileId> = fs::read_dir(self.dir.join("real/volumes"))
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| FileId::of_path(&e.path()).ok())
            .collect();
        files.extend(&self.files);
        for dev in &self.devices {
            for f in &files {
                let _ = attacher.detach(dev, *f);
            }
        }
        let _ = fs::remove_dir_all(&self.dir);
    }
}

/// The host of the test (as root, in a mount namespace of its own): a dir with the data dir
/// `real` and the paths containers mount it at (`view`, `moved`), undone on drop.
fn host(tag: &str) -> (Cleanup, PathBuf) {
    moor_privileged::require_root();
    moor_runtime::sys::mount_namespace::enter_private_mount_namespace()
        .expect("private mount namespace");
    let dir = temp_dir(tag);
    for d in ["real", "view", "moved"] {
        fs::create_dir_all(dir.join(d)).expect("dir");
    }
    let cleanup = Cleanup {
        dir: dir.clone(),
        devices: Vec::new(),
        files: Vec::new(),
    };
    (cleanup, dir)
}

/// A new mount namespace for this thread (a container's), with the data dir `real` mounted at
/// `view`, as the container runtime bind-mounts a hostPath.
fn enter_container(real: &Path, view: &Path) {
    moor_runtime::sys::mount_namespace::enter_private_mount_namespace()
        .expect("private mount namespace");
    rustix::mount::mount_bind(real, view).expect("bind the data dir");
}

fn controller(view: &Path) -> (Backend, moor_controller::embedded::reconcile::Report) {
    EmbeddedBackend::open(
        Config {
            data_dir: view.to_path_buf(),
            node_id: NODE.into(),
            topology_key: "topology.moor.csi.io/node".into(),
        },
        LoopAttacher::new(),
    )
    .expect("open backend")
}

/// Runs `f` on a thread of its own and returns what it returns (its panic, if it panics).
fn on_thread<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    std::thread::spawn(f)
        .join()
        .unwrap_or_else(|p| std::panic::resume_unwind(p))
}

#[test]
fn a_controller_restarted_in_a_new_mount_namespace_keeps_its_devices_and_freezes_them() {
    let (mut cleanup, dir) = host("restarted");
    let (real, view) = (dir.join("real"), dir.join("view"));

    // The first controller, in its container: two volumes, attached for a pod.
    let (r, v) = (real.clone(), view.clone());
    let (vols, devices) = on_thread(move || {
        enter_container(&r, &v);
        let (b, report) = controller(&v);
        assert!(report.is_clean(), "{report:?}");
        let vols = two_volumes(&b);
        let devices: Vec<String> = vols
            .iter()
            .map(|id| b.publish_volume(&publish_req(id)).expect("publish")[DEVICE_PATH_KEY].clone())
            .collect();
        (vols, devices)
        // The thread ends: its mount namespace goes, and the bind mount the devices' files
        // were opened through is detached.
    });
    cleanup.devices = devices.iter().map(PathBuf::from).collect();

    // The container is gone: the kernel names the files from the detached mount's root.
    let start = Instant::now();
    for dev in &devices {
        loop {
            let named = sysfs_backing(dev).unwrap_or_default();
            if named.starts_with("/volumes/vol-") {
                eprintln!("{dev} now names its file {named}");
                break;
            }
            assert!(
                start.elapsed() < DEADLINE,
                "{dev} still names {named:?} {DEADLINE:?} after its controller's mount \
                 namespace ended; waited for /volumes/vol-*"
            );
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    }

    // The pod's kubelet stages and mounts them on the host.
    let mut mounts = Mounts::default();
    let points: Vec<PathBuf> = (0..2).map(|i| dir.join(format!("m{i}"))).collect();
    for (dev, at) in devices.iter().zip(&points) {
        mounts.ext4(dev, at);
    }

    // The restarted controller, in a new container that sees the host's mounts (the kubelet
    // dir with HostToContainer propagation).
    let (r, v, d) = (real.clone(), view.clone(), dir.clone());
    let (vols2, devices2) = (vols.clone(), devices.clone());
    on_thread(move || {
        enter_container(&r, &v);
        let (b, report) = controller(&v);
        eprintln!("after the restart: {report:?}");
        // Group snapshots of the two volumes in use, right after the restart: each must be
        // one instant (the controller freezes both filesystems while it clones).
        let logs: Vec<_> = points.iter().map(|p| open_log(&p.join("log"))).collect();
        let mut logs = logs.into_iter();
        let writer = Writer::start(
            logs.next().expect("first log"),
            logs.next().expect("second log"),
        );
        let mut groups = Vec::new();
        for n in 0..GROUPS {
            writer.wait_for(50);
            groups.push(group(&b, &format!("g{n}"), &vols2).0);
        }
        drop(writer);
        let mut restored = Mounts::default();
        for g in &groups {
            let at = d.join("restored");
            let first = restored_records(&b, &g.snapshots[0].id, &mut restored, &at);
            let second = restored_records(&b, &g.snapshots[1].id, &mut restored, &at);
            eprintln!(
                "{}: newest record {first} on the first log, {second} on the second",
                g.id
            );
            assert!(
                second <= first && first - second <= 1,
                "{} is not one instant: record {second} on the second volume, {first} on the \
                 first",
                g.id
            );
            b.delete_group_snapshot(&GroupSnapshotRef {
                id: g.id.clone(),
                snapshot_ids: Vec::new(),
            })
            .expect("delete group");
        }
        // And the controller knows why: the devices are still the volumes' publications.
        for (id, dev) in vols2.iter().zip(&devices2) {
            let status = b.get_volume(id).expect("get volume");
            assert_eq!(
                status.published_nodes,
                vec![NODE.to_string()],
                "{id} on {dev}: {report:?}"
            );
            assert!(!status.condition.abnormal, "{id}: {:?}", status.condition);
        }
        assert!(report.corrected.is_empty(), "{report:?}");
        assert!(report.detached.is_empty(), "{report:?}");
    });
    drop(mounts);
    // Both volumes stayed attached through the restart, on the devices they had.
    for dev in &devices {
        assert!(
            sysfs_backing(dev).is_some_and(|b| b.starts_with("/volumes/vol-")),
            "{dev}"
        );
    }
}

/// The loop devices whose file sysfs names as the volume `id`'s, deleted or not.
fn bound_to(id: &str) -> Vec<PathBuf> {
    loop_devices()
        .into_iter()
        .filter(|(_, b)| b.contains(&format!("volumes/{id}.img")))
        .map(|(d, _)| d)
        .collect()
}

/// Issue 38, point 8 (found running moor's image under a real kubelet, Kubernetes 1.28.7 with
/// containerd): with a volume attached as /dev/loop0 the controller pod was deleted; the new
/// one logged "publication corrected: not published ... loop device /dev/loop0 is gone or
/// bound to another file", the detach then left /dev/loop0 bound, DeleteVolume removed the
/// file under it (`losetup` on the host: `/volumes/vol-….img (deleted)`), and the same file
/// was attached a second time. Here the new controller starts while its predecessor's
/// container (mount namespace) still lives, with the data dir at another path in it (a rollout
/// that moved the mount): the kernel names the file by its path in the old container, which
/// is not under the new data dir and does not end like it. The device is still the volume's,
/// by the device and inode of its file: the attach retried gets it back, the detach unbinds
/// it, and the delete leaves no device behind.
#[test]
fn a_restarted_controller_keeps_detaches_and_deletes_what_it_attached_named_from_a_live_namespace()
{
    let (mut cleanup, dir) = host("restarted-teardown");
    let (real, view, moved) = (dir.join("real"), dir.join("view"), dir.join("moved"));

    // The first controller, in its container: a volume attached for a pod. The container's
    // mount namespace lives on after the controller let go of its data dir.
    let (attached_tx, attached) = std::sync::mpsc::channel();
    let (end_tx, end) = std::sync::mpsc::channel::<()>();
    let (r, v) = (real.clone(), view.clone());
    let first = std::thread::spawn(move || {
        enter_container(&r, &v);
        let (b, report) = controller(&v);
        assert!(report.is_clean(), "{report:?}");
        let id = b
            .create_volume(&new_volume("pvc-t", 64 * MIB, None))
            .expect("create")
            .id;
        let dev = b.publish_volume(&publish_req(&id)).expect("publish")[DEVICE_PATH_KEY].clone();
        drop(b);
        attached_tx.send((id, dev)).expect("send");
        let _ = end.recv();
    });
    let (id, dev) = attached
        .recv_timeout(DEADLINE)
        .expect("the first controller attached a volume");
    cleanup.devices.push(PathBuf::from(&dev));
    let file = real.join("volumes").join(format!("{id}.img"));
    cleanup
        .files
        .push(FileId::of_path(&file).expect("the volume's file"));
    let named = sysfs_backing(&dev).unwrap_or_default();
    assert!(
        named
            == view
                .join("volumes")
                .join(format!("{id}.img"))
                .display()
                .to_string(),
        "{dev} names {named:?}: its file through the first container's mount"
    );

    // The new controller, in a new container that mounts the data dir elsewhere.
    let (r, m) = (real.clone(), moved.clone());
    let (id2, dev2) = (id.clone(), dev.clone());
    let seen = on_thread(move || {
        enter_container(&r, &m);
        let (b, report) = controller(&m);
        assert!(
            report.corrected.is_empty() && report.detached.is_empty(),
            "the restart lost or detached the attachment: {report:?}"
        );
        assert_eq!(
            b.get_volume(&id2).expect("get volume").published_nodes,
            vec![NODE.to_string()]
        );
        // The external-attacher retries the attach it was waiting for: the same device.
        let again = b.publish_volume(&publish_req(&id2)).expect("publish again");
        assert_eq!(again[DEVICE_PATH_KEY], dev2, "attached a second time");
        let seen = bound_to(&id2);
        b.unpublish_volume(&id2, Some(NODE)).expect("unpublish");
        delete_when_unbound(&b, &id2);
        seen
    });
    assert_eq!(seen, vec![PathBuf::from(&dev)], "one device for the volume");
    end_tx.send(()).expect("end the first container");
    first.join().expect("the first container's thread");
    // Detached and deleted: no device serves the volume's file, deleted or not.
    let start = Instant::now();
    while !bound_to(&id).is_empty() {
        assert!(
            start.elapsed() < DEADLINE,
            "{:?} still bound to the volume's file {DEADLINE:?} after DeleteVolume answered: {:?}",
            bound_to(&id),
            loop_devices()
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    assert!(!file.exists(), "deleted");
}

/// Another install on the same filesystem (the every-node controller beside the one-node one on
/// a node, or another test's) leaked a device whose volume file it then unlinked, through a
/// mount that is gone: sysfs names it `/volumes/vol-<id>.img (deleted)`, exactly as one of this
/// controller's own would be named, and nothing under this data dir can be compared with it.
/// A controller that starts leaves it alone: it is not provably its own. (It detached such a
/// device at every start, and so every test of this binary failed on a machine where another
/// install had leaked one.)
#[test]
fn a_device_of_another_installs_unlinked_volume_file_is_left_alone() {
    let (mut cleanup, dir) = host("foreign");
    let (other, view) = (dir.join("real"), dir.join("view"));

    // The other install, in its container: a volume attached for a pod.
    let (o, v) = (other.clone(), view.clone());
    let (vol, device) = on_thread(move || {
        enter_container(&o, &v);
        let (b, _) = controller(&v);
        let vol = two_volumes(&b).remove(0);
        let device =
            b.publish_volume(&publish_req(&vol)).expect("publish")[DEVICE_PATH_KEY].clone();
        (vol, device)
    });
    cleanup.devices = vec![PathBuf::from(&device)];
    // Its container is gone, and its volume file is unlinked under the device.
    let file = other.join("volumes").join(format!("{vol}.img"));
    cleanup
        .files
        .push(FileId::of_path(&file).expect("the other install's file"));
    fs::remove_file(&file).expect("unlink the other install's file");
    let start = Instant::now();
    loop {
        let named = sysfs_backing(&device).unwrap_or_default();
        if named.starts_with("/volumes/vol-") && named.ends_with(" (deleted)") {
            eprintln!("{device} names its file {named}");
            break;
        }
        assert!(
            start.elapsed() < DEADLINE,
            "{device} names {named:?} {DEADLINE:?} after its install's container ended and \
             its file was unlinked; waited for /volumes/vol-*.img (deleted)"
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }

    // This install, with a data dir of its own on the same filesystem.
    let mine = dir.join("mine");
    fs::create_dir_all(&mine).expect("dir");
    let report = on_thread(move || controller(&mine).1);
    assert!(
        report.detached.is_empty(),
        "another install's device was detached: {report:?}"
    );
    assert!(report.is_clean(), "{report:?}");
    assert!(
        sysfs_backing(&device).is_some_and(|b| b.ends_with(" (deleted)")),
        "{device} is no longer bound to the other install's file"
    );
}
