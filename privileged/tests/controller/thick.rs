//! A thick volume keeps every block of its file through a real life: attached by the backend,
//! staged by moor-node (its mkfs, its mount), written, its files deleted, fstrim run on the
//! mount. The loop driver turns a discard, and a write-zeroes that may unmap, into a hole
//! punched in the backing file: a hole is space the reservation no longer holds. A thin
//! volume, staged the same way afterwards, gives its space back on fstrim, as it should.

use std::fs::{File, OpenOptions};
use std::io::Write as _;
use std::os::unix::fs::MetadataExt as _;
use std::path::Path;
use std::process::Command;

use moor_controller::backend::Backend as _;
use moor_privileged::Sandbox;
use moor_privileged::requests::{stage_req, unstage_req};
use moor_proto::csi::v1::node_server::Node as _;
use moor_runtime::contract::{BACKING_FILE_KEY, DEVICE_PATH_KEY};

use crate::fixture::*;

/// Large enough for mkfs.xfs (300 MiB at least).
const SIZE: u64 = 320 * MIB;

/// Bytes allocated to `path` (st_blocks × 512).
fn allocated(path: &str) -> u64 {
    std::fs::metadata(path).expect("stat backing file").blocks() * 512
}

/// Asserts that all of `path`'s `SIZE` bytes are allocated (st_blocks also counts the
/// filesystem's own blocks for the file, such as an extent tree's: at least, not exactly).
fn assert_whole(path: &str, when: &str) {
    let got = allocated(path);
    assert!(
        got >= SIZE,
        "{path}, {when}: {got} of {SIZE} bytes allocated (a thick volume holds all of them)"
    );
}

/// Runs `program args`, its outcome only logged: with the fix, the device refuses discards, so
/// these fail ("not supported"), which is the point.
fn try_run(program: &str, args: &[&str]) {
    let out = Command::new(program).args(args).output();
    eprintln!("{program} {args:?}: {out:?}");
}

/// Writes `mib` MiB of data in a file under `dir`, makes it durable, deletes it, and syncs.
fn write_and_delete(dir: &Path, mib: u64) {
    let path = dir.join("data");
    let mut f = File::create(&path).expect("create a file on the volume");
    let chunk = vec![0x5au8; MIB as usize];
    for _ in 0..mib {
        f.write_all(&chunk).expect("write on the volume");
    }
    f.sync_all().expect("fsync on the volume");
    drop(f);
    std::fs::remove_file(&path).expect("delete the file");
    rustix::fs::sync();
}

/// Stages `dev` as `fs` through moor-node's service, runs `during` on the mount, unstages.
fn staged(sb: &Sandbox, vol: &str, dev: &Path, fs: &str, during: impl FnOnce(&Path)) {
    let svc = sb.node_service();
    let staging = sb.staging(vol);
    moor_privileged::runtime().block_on(async {
        svc.node_stage_volume(tonic::Request::new(stage_req(vol, dev, &staging, fs)))
            .await
            .expect("stage");
    });
    during(&staging);
    moor_privileged::runtime().block_on(async {
        svc.node_unstage_volume(tonic::Request::new(unstage_req(vol, &staging)))
            .await
            .expect("unstage");
    });
}

fn thick_life(fs: &str) {
    // Not `Fixture::new`, which wants a clean start-up: a shared host may hold another user's
    // loop device of a deleted `volumes/vol-*.img`, which the start-up reports; none of this
    // test's business.
    moor_privileged::require_root();
    let mut fx = Fixture {
        backend: None,
        dir: temp_dir(&format!("thick-{fs}")),
    };
    let report = fx.start();
    eprintln!("start-up: {report:?}");
    // Declared after the fixture: dropped (its mounts undone) before the devices are detached.
    let sb = Sandbox::new(&format!("thick-{fs}"));
    let mut req = new_volume(&format!("pvc-thick-{fs}"), SIZE, None);
    req.parameters
        .insert("provisioning".to_string(), "thick".to_string());
    let id = fx.b().create_volume(&req).expect("a thick volume").id;

    // A hole as a device punched it before this was fixed: the attach fills it again.
    let path = fx.dir.join("data/volumes").join(format!("{id}.img"));
    let path = path.display().to_string();
    let f = OpenOptions::new().write(true).open(&path).expect("open");
    rustix::fs::fallocate(
        &f,
        rustix::fs::FallocateFlags::PUNCH_HOLE | rustix::fs::FallocateFlags::KEEP_SIZE,
        4 * MIB,
        MIB,
    )
    .expect("punch a hole");
    drop(f);
    assert!(allocated(&path) < SIZE, "{path}: the hole punched");

    let ctx = fx.publish(&id);
    let dev = ctx[DEVICE_PATH_KEY].clone();
    let backing = ctx[BACKING_FILE_KEY].clone();
    assert_eq!(path, backing);
    assert_whole(&backing, "attached (its holes filled again)");

    // Straight through the device: a discard, and a write-zeroes that may unmap.
    try_run("blkdiscard", &["-o", "0", "-l", "1048576", &dev]);
    try_run(
        "fallocate",
        &["--punch-hole", "-o", "1048576", "-l", "1048576", &dev],
    );
    // moor-node's mkfs and mount; data written and deleted; fstrim on the mount.
    staged(&sb, &format!("pv-thick-{fs}"), Path::new(&dev), fs, |mnt| {
        write_and_delete(mnt, 64);
        try_run("fstrim", &["-v", &mnt.display().to_string()]);
        assert_whole(&backing, &format!("{fs} staged, written, deleted, trimmed"));
    });
    assert_whole(&backing, &format!("{fs} unstaged"));
    assert_eq!(
        sysfs_flag(&dev, "queue/discard_max_bytes"),
        "0",
        "{dev} serves a thick volume: it must take no discards"
    );
    fx.unpublish(&id);
    assert!(
        wait_unbound(&dev, &fx.dir),
        "{dev} still bound after unpublish"
    );

    // A thin volume after it (most likely on the same device number, the lowest free one):
    // its device takes discards again, and fstrim gives its deleted data's space back.
    let thin = fx.create(&format!("pvc-thin-{fs}"), SIZE);
    let ctx = fx.publish(&thin);
    let dev = ctx[DEVICE_PATH_KEY].clone();
    let backing = ctx[BACKING_FILE_KEY].clone();
    assert_ne!(
        sysfs_flag(&dev, "queue/discard_max_bytes"),
        "0",
        "{dev} serves a thin volume: it must take discards (a device a thick volume left \
         is not handed on with its discards off)"
    );
    staged(&sb, &format!("pv-thin-{fs}"), Path::new(&dev), fs, |mnt| {
        write_and_delete(mnt, 64);
        let before = allocated(&backing);
        // xfs frees a deleted file's blocks in the background (inode GC): trimmed again
        // until the space is back.
        let start = std::time::Instant::now();
        loop {
            try_run("fstrim", &["-v", &mnt.display().to_string()]);
            let after = allocated(&backing);
            if after + 32 * MIB <= before {
                eprintln!("thin {fs}: {before} -> {after} bytes allocated by fstrim");
                break;
            }
            assert!(
                start.elapsed() < moor_privileged::client::DEADLINE,
                "{backing} ({fs}): waited for fstrim on a thin volume to give deleted data's \
                 space back: {before} -> {after}"
            );
            std::thread::sleep(std::time::Duration::from_millis(200));
        }
    });
    fx.unpublish(&thin);
}

#[test]
fn a_thick_ext4_volume_keeps_its_blocks_through_mkfs_writes_deletes_and_fstrim() {
    thick_life("ext4");
}

#[test]
fn a_thick_xfs_volume_keeps_its_blocks_through_mkfs_writes_deletes_and_fstrim() {
    thick_life("xfs");
}
