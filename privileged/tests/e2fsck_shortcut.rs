//! moor's answer to "would `e2fsck -p` pass this ext filesystem as clean without checking it?"
//! (`superblock::ext_clean`, which lets a stage leave e2fsck's exec out) against e2fsck's own,
//! on a corpus of images made here with mkfs, tune2fs, debugfs and real mounts (run as root):
//! clean ones of each kind, and one for each reason e2fsck has to look further (a state or error
//! flag, a journal to replay, orphans, a broken checksum, a due count or interval, a backup
//! superblock that differs, ...). e2fsck's answer is `e2fsck -p`'s run on the image after moor
//! has read it: exit 0 with its one "clean" line and nothing else. (`e2fsck -p -n` is refused by
//! e2fsck itself: -p and -n exclude each other.) Every image is asserted twice: moor agrees with
//! e2fsck, and the image is what it was made to be (so the corpus keeps both kinds).

use std::fs::File;
use std::os::unix::fs::FileExt as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{SystemTime, UNIX_EPOCH};

use moor_node::superblock::ext_clean::{Verdict, e2fsck_would_skip};
use moor_node::superblock::{QUICK_LEN, ext_clean::crc32c};
use moor_privileged::{Sandbox, run};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

fn now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}

/// moor's answer for the image at `path`, reading it as the stage does: the probe's first
/// bytes, then what the decision asks for.
fn moor_says(path: &Path) -> Verdict {
    let f = File::open(path).expect("image");
    let mut head = vec![0u8; QUICK_LEN];
    let n = f.read_at(&mut head, 0).expect("read head");
    head.truncate(n);
    let mut read = |offset: u64, len: usize| -> Option<Vec<u8>> {
        let mut buf = vec![0u8; len];
        f.read_exact_at(&mut buf, offset).ok()?;
        Some(buf)
    };
    e2fsck_would_skip(&head, now(), &mut read)
}

/// e2fsck's answer: whether `e2fsck -p` passed the image as clean without a check (exit 0,
/// its one line "…: clean, …" and nothing more), and what it said.
fn e2fsck_says(path: &Path) -> (bool, String) {
    let out = Command::new("e2fsck")
        .arg("-p")
        .arg(path)
        .output()
        .expect("e2fsck");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let lines: Vec<&str> = stdout.lines().collect();
    let prefix = format!("{}: clean, ", path.display());
    let clean = out.status.code() == Some(0)
        && stderr.trim().is_empty()
        && lines.len() == 1
        && lines[0].starts_with(&prefix);
    (
        clean,
        format!("exit {:?}: {stdout}{stderr}", out.status.code()),
    )
}

/// A sparse image of `size` bytes made by `mkfs` with `args`.
fn mkfs(sb: &Sandbox, name: &str, size: u64, program: &str, args: &[&str]) -> PathBuf {
    let path = sb.data.join(name);
    File::create(&path)
        .and_then(|f| f.set_len(size))
        .expect("image file");
    let mut all = vec!["-q", "-F"];
    all.extend_from_slice(args);
    let p = path.display().to_string();
    all.push(&p);
    run(program, &all);
    path
}

fn debugfs(path: &Path, request: &str) {
    let out = Command::new("debugfs")
        .args(["-w", "-R", request])
        .arg(path)
        .output()
        .expect("debugfs");
    assert!(out.status.success(), "debugfs {request}: {out:?}");
}

fn tune2fs(path: &Path, args: &[&str]) {
    let p = path.display().to_string();
    let mut all = args.to_vec();
    all.push(&p);
    run("tune2fs", &all);
}

/// Writes `bytes` at `offset` of the image, behind every tool's back.
fn poke(path: &Path, offset: u64, bytes: &[u8]) {
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .expect("image");
    f.write_all_at(bytes, offset).expect("poke");
}

fn peek(path: &Path, offset: u64, len: usize) -> Vec<u8> {
    let f = File::open(path).expect("image");
    let mut buf = vec![0u8; len];
    f.read_exact_at(&mut buf, offset).expect("peek");
    buf
}

/// Attaches the image as a loop device, mounts it on a dir of the sandbox, runs `inside` with
/// the mount point, and unmounts it (the sandbox's namespace goes with the test).
fn mounted(sb: &Sandbox, path: &Path, inside: impl FnOnce(&Path)) {
    let out = Command::new("losetup")
        .args(["--find", "--show"])
        .arg(path)
        .output()
        .expect("losetup");
    assert!(out.status.success(), "losetup: {out:?}");
    let dev = String::from_utf8_lossy(&out.stdout).trim().to_string();
    // Held open and its detach asked for at once: the kernel then detaches the busy device
    // when its last user goes, also when this test fails half-way.
    let held = File::open(&dev).expect("open loop device");
    let _ = Command::new("losetup").args(["-d", &dev]).status();
    let mnt = sb.root.join(format!(
        "mnt-{}",
        path.file_name().unwrap_or_default().display()
    ));
    std::fs::create_dir_all(&mnt).expect("mount point");
    let m = mnt.display().to_string();
    let mount = Command::new("mount").args([&dev, &m]).status();
    let mounted_ok = mount.is_ok_and(|s| s.success());
    if mounted_ok {
        inside(&mnt);
        run("umount", &[&m]);
    }
    drop(held);
    assert!(mounted_ok, "mount {dev} {m}");
}

/// A copy of the image taken while it is mounted and written to, as a power cut leaves a disk:
/// `inside` runs on the mount point, then the file system's journal is forced to disk
/// (syncfs) and the image copied before the unmount.
/// What `inside` returns (an open file, say) is held until the copy is taken.
fn crashed<T>(sb: &Sandbox, path: &Path, copy: &str, inside: impl FnOnce(&Path) -> T) -> PathBuf {
    let to = sb.data.join(copy);
    mounted(sb, path, |mnt| {
        let held = inside(mnt);
        let dir = File::open(mnt).expect("mount point");
        rustix::fs::syncfs(&dir).expect("syncfs");
        std::fs::copy(path, &to).expect("copy while mounted");
        drop(held);
    });
    to
}

/// Offset of the primary superblock and of group descriptor `group` for 4 KiB blocks.
const SB: u64 = 1024;
fn gd(group: u64, desc_size: u64) -> u64 {
    4096 + group * desc_size
}

/// Recomputes a metadata_csum superblock's checksum after a poke, so that only the field the
/// case is about is wrong.
fn fix_sb_checksum(path: &Path) {
    let sb = peek(path, SB, 1024);
    let c = crc32c(!0, &sb[..0x3FC]);
    poke(path, SB + 0x3FC, &c.to_le_bytes());
}

#[test]
fn moor_and_e2fsck_agree_on_every_image() {
    let sb = Sandbox::new("e2fsck-shortcut");
    sb.data_in_memory();
    // 4 KiB blocks (mke2fs would choose 1 KiB for a "small" filesystem of this size): three
    // groups, the first backup superblock at block 32768.
    let ext4 = |name: &str| mkfs(&sb, name, 300 * MIB, "mkfs.ext4", &["-b", "4096"]);
    // (image, what it is, whether e2fsck -p should pass it clean)
    let mut corpus: Vec<(PathBuf, &str, bool)> = Vec::new();

    corpus.push((ext4("fresh"), "a fresh ext4 (metadata_csum)", true));
    let used = ext4("used");
    mounted(&sb, &used, |m| {
        for i in 0..50 {
            std::fs::write(m.join(format!("f{i}")), vec![7u8; 100_000]).expect("write");
        }
        std::fs::create_dir_all(m.join("d/e")).expect("mkdir");
    });
    corpus.push((used.clone(), "an ext4 written to and unmounted", true));
    corpus.push((
        mkfs(&sb, "ext4-1k", 64 * MIB, "mkfs.ext4", &["-b", "1024"]),
        "an ext4 of 1 KiB blocks",
        true,
    ));
    corpus.push((
        mkfs(&sb, "ext3", 300 * MIB, "mkfs.ext3", &["-b", "4096"]),
        "an ext3 (journal in block map)",
        true,
    ));
    corpus.push((
        mkfs(&sb, "ext2", 300 * MIB, "mkfs.ext2", &["-b", "4096"]),
        "an ext2",
        true,
    ));
    corpus.push((
        mkfs(
            &sb,
            "gdt-csum",
            300 * MIB,
            "mkfs.ext4",
            &["-b", "4096", "-O", "^metadata_csum,uninit_bg"],
        ),
        "an ext4 with gdt_csum (crc16)",
        true,
    ));
    corpus.push((
        mkfs(
            &sb,
            "no-csum",
            300 * MIB,
            "mkfs.ext4",
            &["-b", "4096", "-O", "^metadata_csum"],
        ),
        "an ext4 without group checksums",
        true,
    ));
    corpus.push((
        mkfs(&sb, "big", 160 * GIB, "mkfs.ext4", &[]),
        "an ext4 of 160 GiB (descriptors past the probe's bytes)",
        true,
    ));
    let orphan_file = ext4("orphan-file");
    tune2fs(&orphan_file, &["-O", "orphan_file"]);
    corpus.push((
        orphan_file.clone(),
        "an ext4 with an empty orphan file",
        true,
    ));

    // The state and error flags.
    let img = ext4("not-clean");
    debugfs(&img, "ssv state 0");
    corpus.push((img, "state not clean", false));
    let img = ext4("errors");
    debugfs(&img, "ssv state 3");
    corpus.push((img, "errors recorded", false));
    let img = ext4("needs-recovery");
    debugfs(&img, "feature needs_recovery");
    corpus.push((img, "needs_recovery set", false));

    // A journal to replay and orphans, as a power cut leaves them.
    let base = ext4("crash-base");
    let img = crashed(&sb, &base, "crash-journal", |m| {
        std::fs::write(m.join("data"), vec![1u8; 1 << 20]).expect("write");
    });
    corpus.push((
        img,
        "a journal to replay (image taken while mounted)",
        false,
    ));
    let base = ext4("orphan-base");
    let img = crashed(&sb, &base, "crash-orphan", |m| {
        let p = m.join("gone");
        let f = File::create(&p).expect("create");
        f.write_all_at(&[1u8; 4096], 0).expect("write");
        std::fs::remove_file(&p).expect("unlink");
        f
    });
    corpus.push((
        img,
        "an open unlinked file (image taken while mounted)",
        false,
    ));
    let img = ext4("orphan-list");
    debugfs(&img, "ssv last_orphan 12");
    corpus.push((img, "an orphan list (s_last_orphan)", false));
    let img = sb.data.join("orphan-present");
    std::fs::copy(&orphan_file, &img).expect("copy");
    debugfs(&img, "feature orphan_present");
    corpus.push((img, "orphan_file with orphan_present", false));

    // Checksums.
    let img = ext4("sb-csum");
    let label = peek(&img, SB + 0x78, 1);
    poke(&img, SB + 0x78, &[label[0] ^ 0x20]);
    corpus.push((img, "the superblock's checksum broken", false));
    let img = ext4("gd-csum");
    let flags = peek(&img, gd(1, 64) + 0x12, 1);
    poke(&img, gd(1, 64) + 0x12, &[flags[0] ^ 0x04]);
    corpus.push((img, "a group descriptor's checksum broken (crc32c)", false));
    let img = mkfs(
        &sb,
        "gd-crc16",
        300 * MIB,
        "mkfs.ext4",
        &["-b", "4096", "-O", "^metadata_csum,uninit_bg"],
    );
    let flags = peek(&img, gd(1, 64) + 0x12, 1);
    poke(&img, gd(1, 64) + 0x12, &[flags[0] ^ 0x04]);
    corpus.push((img, "a group descriptor's checksum broken (crc16)", false));
    let img = ext4("gd-range");
    poke(&img, gd(2, 64) + 0x0C, &[0xFF, 0xFF]);
    corpus.push((img, "a group's free count past its size", false));

    // Due by count and by time.
    let img = ext4("count-due");
    tune2fs(&img, &["-c", "5", "-C", "5"]);
    corpus.push((img, "mounted as often as allowed", false));
    let img = ext4("count-near");
    tune2fs(&img, &["-c", "5", "-C", "4"]);
    corpus.push((img, "one mount before the count is due", true));
    let img = ext4("interval-due");
    tune2fs(&img, &["-i", "1d", "-T", "20200101"]);
    corpus.push((img, "the check interval gone by", false));
    let img = ext4("interval-near");
    tune2fs(&img, &["-i", "30d", "-T", "now"]);
    corpus.push((img, "the check interval not gone by", true));
    let img = ext4("checked-future");
    let future = now() + 3 * 86_400;
    debugfs(&img, "ssv checkinterval 86400");
    debugfs(&img, &format!("ssv lastcheck {future}"));
    corpus.push((img, "last checked three days ahead", false));
    let img = ext4("mounted-future");
    debugfs(&img, &format!("ssv mtime {future}"));
    corpus.push((
        img,
        "last mounted three days ahead, no check interval",
        true,
    ));
    let img = ext4("mounted-future-interval");
    tune2fs(&img, &["-i", "30d", "-T", "now"]);
    debugfs(&img, &format!("ssv mtime {future}"));
    corpus.push((
        img,
        "last mounted three days ahead, with a check interval",
        false,
    ));

    // What else the opening and check_super_block look at.
    let img = ext4("backup-differs");
    let backup = 32768 * 4096;
    let uuid = peek(&img, backup + 0x68, 1);
    poke(&img, backup + 0x68, &[uuid[0] ^ 0xFF]);
    corpus.push((img, "the first backup superblock's UUID differs", false));
    let img = ext4("journal-errno");
    let start = journal_start(&img);
    poke(&img, start * 4096 + 0x20, &(-5i32).to_be_bytes());
    corpus.push((img, "the journal recorded an error", false));
    let img = ext4("journal-start");
    let start = journal_start(&img);
    poke(&img, start * 4096 + 0x1C, &1u32.to_be_bytes());
    corpus.push((img, "the journal pinned without needs_recovery", false));
    let img = ext4("test-fs");
    debugfs(&img, "ssv flags 0x6");
    corpus.push((img, "the test_fs flag", false));
    let img = ext4("no-hash-hint");
    poke(&img, SB + 0x160, &0u32.to_le_bytes());
    fix_sb_checksum(&img);
    corpus.push((img, "no directory hash hint", false));
    let img = ext4("no-uuid");
    tune2fs(&img, &["-O", "^metadata_csum"]);
    poke(&img, SB + 0x68, &[0u8; 16]);
    corpus.push((img, "no UUID", false));

    let mut wrong = Vec::new();
    for (path, what, clean) in &corpus {
        let moor = moor_says(path);
        let (e2fsck, said) = e2fsck_says(path);
        let line = format!("{what}: moor {moor:?}, e2fsck -p {said}");
        eprintln!("{line}");
        if (moor == Verdict::Clean) != e2fsck || e2fsck != *clean {
            wrong.push(line);
        }
    }
    assert!(
        wrong.is_empty(),
        "moor and e2fsck disagree, or an image is not what it was made to be:\n{}",
        wrong.join("\n")
    );
}

/// The first block of the journal of a 4 KiB-block image, as debugfs maps it.
fn journal_start(path: &Path) -> u64 {
    let out = Command::new("debugfs")
        .args(["-R", "bmap <8> 0"])
        .arg(path)
        .output()
        .expect("debugfs");
    String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .expect("journal block")
}

/// How many stages of an ext4 ended with `outcome` (`moor_fsck_total`), in this process.
fn fsck_count(outcome: &str) -> u64 {
    let text = moor_node::metrics::render_node(moor_node::engine::VolumeCounts::default());
    let want = format!("moor_fsck_total{{fs_type=\"ext4\",outcome=\"{outcome}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(want.as_str()))
        .map_or(0, |n| n.trim().parse().expect("a count"))
}

/// Through the node service, on loop devices: a stage of a clean ext4 leaves e2fsck out (the
/// outcome "skipped"), and its unstage leaves it clean for the next; a stage of one that is
/// not clean runs e2fsck (which repairs it) before the mount.
#[test]
fn a_stage_runs_e2fsck_only_when_e2fsck_would_look_further() {
    use moor_privileged::is_mount_point;
    use moor_privileged::requests::{stage_req, unstage_req};
    use moor_proto::csi::v1::node_server::Node as _;

    let sb = Sandbox::new("e2fsck-stage");
    sb.data_in_memory();
    let svc = sb.node_service();
    let staging = sb.staging("pv");
    let dev = sb.loop_device("vol.img", 300 * MIB);
    let d = dev.display().to_string();
    run("mkfs.ext4", &["-q", "-b", "4096", &d]);
    let stage_and_unstage = || {
        moor_privileged::runtime().block_on(async {
            svc.node_stage_volume(tonic::Request::new(stage_req(
                "vol", &dev, &staging, "ext4",
            )))
            .await
            .expect("stage");
            assert!(is_mount_point(&staging));
            svc.node_unstage_volume(tonic::Request::new(unstage_req("vol", &staging)))
                .await
                .expect("unstage");
        });
    };
    let (skipped, clean, corrected) = (
        fsck_count("skipped"),
        fsck_count("clean"),
        fsck_count("corrected"),
    );
    stage_and_unstage();
    stage_and_unstage();
    assert_eq!(fsck_count("skipped"), skipped + 2, "a clean ext4, twice");
    assert_eq!(
        fsck_count("clean") + fsck_count("corrected"),
        clean + corrected
    );

    debugfs(&dev, "ssv state 0");
    stage_and_unstage();
    assert_eq!(fsck_count("skipped"), skipped + 2, "not clean: e2fsck runs");
    assert_eq!(
        fsck_count("clean") + fsck_count("corrected"),
        clean + corrected + 1
    );
    let (e2fsck_clean, said) = e2fsck_says(&dev);
    assert!(e2fsck_clean, "e2fsck's run left it clean: {said}");

    // --e2fsck-always: e2fsck runs on the clean filesystem too.
    let state = sb.root.join("state-always");
    std::fs::create_dir_all(&state).expect("state dir");
    let always = sb.node_service_with(&state, |cfg| cfg.e2fsck_always = true);
    moor_privileged::runtime().block_on(async {
        always
            .node_stage_volume(tonic::Request::new(stage_req(
                "vol", &dev, &staging, "ext4",
            )))
            .await
            .expect("stage");
        always
            .node_unstage_volume(tonic::Request::new(unstage_req("vol", &staging)))
            .await
            .expect("unstage");
    });
    assert_eq!(
        fsck_count("skipped"),
        skipped + 2,
        "--e2fsck-always never skips"
    );
    assert_eq!(
        fsck_count("clean") + fsck_count("corrected"),
        clean + corrected + 2
    );
}
