//! An RBD image served without the kernel client by a process that is killed and replaced
//! while a filesystem on it is written and fsynced: moor-ublk (ublk with user recovery, through
//! librbd) in a guest of the VM lab on Debian's 6.12 kernel from bookworm-backports (the lab's
//! second kernel: this machine's kernel and the lab's default one have no ublk_drv). What a
//! node plugin's upgrade needs (issue 38, point 1; docs/upgrade.md).
//!
//! Skipped, with the reason, without the lab's second kernel (`MOOR_VM_KERNEL_PACKAGE=<pkg>
//! .ci/vm setup`) or a cluster on a bridge (`.ci/ceph-cluster up`). `MOOR_VM_UBLK_KERNEL`
//! names another kernel package. Whatever the test makes goes when it ends, also after a
//! failure: the guest with its QEMU, the sandbox, the image.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use moor_lab::ceph::{Ceph, World};
use moor_lab::vm::{self, Vm, VmOptions, acked};

/// Debian's 6.12 from bookworm-backports: ublk_drv and rbd as modules.
const KERNEL: &str = "linux-image-6.12.57+deb12-amd64";
/// How long a step in the guest may take (TCG on a loaded two-core machine is slow).
const DEADLINE: Duration = Duration::from_secs(300);

fn kernel() -> String {
    std::env::var("MOOR_VM_UBLK_KERNEL").unwrap_or_else(|_| KERNEL.to_string())
}

/// The guest on the second kernel, the world (sandbox, cluster, images), and the paths the
/// guest writes (under the sandbox, shared with it). The guest goes first when it drops (its
/// devices, mounts and servers with it), then the world (the images).
struct Lab {
    vm: Vm,
    world: World,
    dir: PathBuf,
    ublk: PathBuf,
}

impl Lab {
    fn new(test: &str, host: u8) -> Option<Self> {
        if !vm::available_kernel(test, &kernel()) {
            return None;
        }
        let ceph = Ceph::from_env(test)?;
        let Some((bridge, net)) = ceph.bridge.clone() else {
            eprintln!("{test}: skipped: the cluster has no bridge for guests to join");
            return None;
        };
        let ublk = moor_privileged::client::binary("moor-ublk");
        assert!(
            ublk.exists(),
            "{} is not built (cargo build -p moor-ublk)",
            ublk.display()
        );
        let world = World::new(test, ceph, 1);
        let dir = world.sb.root.join("guest");
        std::fs::create_dir_all(&dir).expect("the guest's dir");
        let vm = Vm::boot_kernel(
            VmOptions {
                name: test.to_string(),
                bridge,
                ip: format!("{net}.{host}"),
                rwdirs: vec![dir.clone()],
                dir: world.sb.root.join("vm"),
                memory: "1G".into(),
                hotplug: 0,
                qemu_opts: Vec::new(),
                append: Vec::new(),
                udev: false,
            },
            &kernel(),
        );
        vm.sh("modprobe ublk_drv && test -c /dev/ublk-control");
        Some(Self {
            vm,
            world,
            dir,
            ublk,
        })
    }

    fn path(&self, name: &str) -> String {
        self.dir.join(name).display().to_string()
    }

    /// The connection flags of moor-ublk for `image`.
    fn image_args(&self, image: &str) -> Vec<String> {
        let c = &self.world.ceph;
        [
            "--mon-host",
            &c.mons,
            "--user",
            &c.user,
            "--keyring",
            &c.keyring,
            "--pool",
            &c.pool,
            "--image",
            image,
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    }

    /// Starts `moor-ublk <args>` in the guest, logging to `log`; its pid and the device
    /// number it serves, once it serves it.
    fn serve(&self, args: &[String], log: &str) -> (u32, u32) {
        let mut argv = vec![self.ublk.display().to_string()];
        argv.extend(args.iter().cloned());
        let argv: Vec<&str> = argv.iter().map(String::as_str).collect();
        let pid = self.vm.spawn(&argv, &self.path(log));
        let text = wait_for(&self.dir.join(log), "the server's `dev N` line", |t| {
            t.lines().any(|l| l.starts_with("dev "))
        });
        let dev = text
            .lines()
            .find_map(|l| l.strip_prefix("dev "))
            .and_then(|l| l.split_whitespace().next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("no device number in {text:?}"));
        (pid, dev)
    }

    /// The driver's view of device `dev`: `dev N state S pid P flags F`.
    fn info(&self, dev: u32) -> String {
        self.vm
            .sh(&format!("{} info --dev {dev}", self.ublk.display()))
    }
}

/// Waits until `check` holds for the text of `path` (a file the guest writes); returns it.
fn wait_for(path: &Path, what: &str, check: impl Fn(&str) -> bool) -> String {
    let start = Instant::now();
    loop {
        let text = std::fs::read_to_string(path).unwrap_or_default();
        if check(&text) {
            return text;
        }
        assert!(
            start.elapsed() < DEADLINE,
            "waited {DEADLINE:?} for {what} in {}: {text}",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// A filesystem on /dev/ublkbN written and fsynced in a loop by one process; the server
/// SIGKILLed mid-stream; a new server process recovers the device (START_USER_RECOVERY,
/// END_USER_RECOVERY). The writer sees no I/O error, goes on, and every record it fsynced is
/// on the image, read back through a third server after the filesystem was unmounted.
#[test]
fn a_new_server_takes_the_device_over() {
    let test = "vm-ublk-recover";
    let Some(mut lab) = Lab::new(test, 63) else {
        return;
    };
    let image = lab.world.image("ublk", 256);
    let args = lab.image_args(&image);
    let add: Vec<String> = ["add".to_string()]
        .into_iter()
        .chain(args.clone())
        .collect();
    let (first, dev) = lab.serve(&add, "server-1.log");
    let info = lab.info(dev);
    assert!(info.contains("state live"), "{info}");
    assert!(info.contains(&format!("pid {first}")), "{info}");

    let mnt = lab.path("mnt");
    // The filesystem leaves the image's last 56 MiB to the write below.
    lab.vm.sh(&format!(
        "mkfs.ext4 -q /dev/ublkb{dev} 200M && mkdir -p {mnt} && mount /dev/ublkb{dev} {mnt}"
    ));
    // The writer: a record appended and fsynced (fdatasync) at a time, each acknowledged in
    // its log (outside the device) only once the fsync succeeded; an error is logged and
    // ends it. It stops when told (a file).
    let stop = lab.path("stop");
    let writer = vm::fsync_writer(&Path::new(&mnt).join("data"), Path::new(&stop));
    lab.vm
        .spawn(&["sh", "-c", &writer], &lab.path("writer.log"));
    let wlog = lab.dir.join("writer.log");
    wait_for(&wlog, "20 records fsynced", |t| acked(t).len() >= 20);

    // The server dies as a container's processes do when it is killed.
    lab.vm.sh(&format!("kill -KILL {first}"));
    let at_kill = acked(&std::fs::read_to_string(&wlog).unwrap_or_default()).len();
    let start = Instant::now();
    loop {
        let info = lab.info(dev);
        if info.contains("state quiesced") {
            break;
        }
        assert!(
            start.elapsed() < DEADLINE,
            "the driver did not quiesce device {dev} after its server died: {info}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }

    // A new process takes the device over; the writer goes on.
    let recover: Vec<String> = ["recover".to_string(), "--dev".into(), dev.to_string()]
        .into_iter()
        .chain(args.clone())
        .collect();
    let (second, again) = lab.serve(&recover, "server-2.log");
    let recovered = start.elapsed();
    assert_eq!(again, dev, "the same device");
    let info = lab.info(dev);
    assert!(
        info.contains("state live") && info.contains(&format!("pid {second}")),
        "{info}"
    );
    wait_for(&wlog, "a record fsynced after the recovery", |t| {
        acked(t).len() > at_kill || t.contains("ERROR")
    });
    let resumed = start.elapsed();
    // (A writer that saw an error has ended: that is said below.)
    wait_for(&wlog, "20 more records fsynced after the recovery", |t| {
        acked(t).len() >= at_kill + 20 || t.contains("ERROR")
    });
    std::fs::write(&stop, "").expect("tell the writer to stop");
    let log = wait_for(&wlog, "the writer's end", |t| {
        t.contains("stopped") || t.contains("ERROR")
    });
    vm::assert_writer_clean(&log, "the writer");
    let records = acked(&log);
    assert_eq!(
        records,
        (0..records.len() as u64).collect::<Vec<_>>(),
        "every record acknowledged once, in order"
    );
    let console = lab.vm.console_text();
    assert!(
        !console.contains("I/O error") && !console.contains("EXT4-fs error"),
        "the guest's kernel logged errors: {console}"
    );

    // A write acknowledged and never flushed survives its server's death: the second server
    // (which has seen the writer's flushes) killed as soon as an O_DIRECT write past the
    // filesystem returns, a third takes the device over. With librbd's cache on, that write
    // would be in the dead server's memory only.
    let pattern = lab.path("pattern");
    lab.vm.sh(&format!(
        "umount {mnt} && head -c 1048576 /dev/urandom > {pattern} && \
         dd if={pattern} of=/dev/ublkb{dev} bs=1M count=1 seek=224 oflag=direct status=none && \
         kill -KILL {second}"
    ));
    let start = Instant::now();
    while !lab.info(dev).contains("state quiesced") {
        assert!(
            start.elapsed() < DEADLINE,
            "the driver did not quiesce device {dev} after its second server died"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let (_, again) = lab.serve(&recover, "server-2b.log");
    assert_eq!(again, dev, "the same device");

    // Everything fsynced is on the image: the device deleted (its server ends), then read
    // back through a new device of the same image.
    lab.vm
        .sh(&format!("{} delete --dev {dev}", lab.ublk.display()));
    let (_, third) = lab.serve(&add, "server-3.log");
    let unflushed = lab.vm.sh(&format!(
        "if dd if=/dev/ublkb{third} bs=1M count=1 skip=224 iflag=direct status=none | \
         cmp -s - {pattern}; then echo same; else echo differs; fi"
    ));
    assert!(
        unflushed.contains("same"),
        "the write acknowledged before its server was killed is not on the image: {unflushed}"
    );
    let data = lab.vm.sh(&format!(
        "mount -o ro /dev/ublkb{third} {mnt} && cat {mnt}/data && umount {mnt}"
    ));
    let lines: Vec<&str> = data.lines().collect();
    assert!(
        lines.len() >= records.len(),
        "{} records on the image, {} fsynced",
        lines.len(),
        records.len()
    );
    for (i, l) in lines.iter().enumerate() {
        assert_eq!(*l, format!("record {i:08}"), "record {i} on the image");
    }
    eprintln!(
        "{test}: {} records fsynced, {at_kill} before the server was killed, none lost, no error; \
         from the kill: the device served again after {}, the writer's next fsync done after {} \
         (not asserted: the guest is emulated)",
        records.len(),
        moor_lab::ceph::ms(recovered),
        moor_lab::ceph::ms(resumed)
    );
    lab.vm
        .sh(&format!("{} delete --dev {third}", lab.ublk.display()));
}

/// fio's jobs: a name, and its arguments. Sequential writes first: they fill the range that
/// the reads then read (an unwritten RBD extent reads as zeroes without asking an OSD).
const JOBS: [(&str, &str); 4] = [
    ("1M write", "--rw=write --bs=1M --iodepth=4"),
    ("1M read", "--rw=read --bs=1M --iodepth=4"),
    ("4k randwrite", "--rw=randwrite --bs=4k --iodepth=16"),
    ("4k randread", "--rw=randread --bs=4k --iodepth=16"),
];

/// fio `job` on `dev` in the guest (direct I/O, 20 s): (MiB/s, IOPS).
fn fio(vm: &Vm, dev: &str, job: &str) -> (f64, f64) {
    let out = vm.sh(&format!(
        "fio --name=m --filename={dev} --direct=1 --ioengine=libaio --size=192M --runtime=20 \
         --time_based --output-format=json {job}"
    ));
    let v: serde_json::Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
    let j = &v["jobs"][0];
    let side = if job.contains("write") {
        "write"
    } else {
        "read"
    };
    let bw = j[side]["bw_bytes"].as_f64().unwrap_or(0.0) / (1 << 20) as f64;
    let iops = j[side]["iops"].as_f64().unwrap_or(0.0);
    (bw, iops)
}

/// Not a check: I/O through ublk + librbd (moor-ublk), rbd-fuse + a loop device with direct
/// I/O (moor-node's `fuse` attacher), and the kernel client, in the same guest and run, each
/// on an image of its own; prints a table. Run with `--ignored --nocapture`.
#[test]
#[ignore = "a measurement (minutes of fio in a TCG guest), not a check: run it with --ignored"]
fn io_through_ublk_rbd_fuse_and_the_kernel_client() {
    let test = "vm-ublk-measure";
    let Some(mut lab) = Lab::new(test, 64) else {
        return;
    };
    let c = lab.world.ceph.clone();
    let host = c.mons.split(':').next().expect("a monitor").to_string();
    let images: Vec<String> = ["ublk", "fuse", "krbd"]
        .iter()
        .map(|n| lab.world.image(&format!("m{n}"), 512))
        .collect();
    let add: Vec<String> = ["add".to_string()]
        .into_iter()
        .chain(lab.image_args(&images[0]))
        .collect();
    let (_, dev) = lab.serve(&add, "server.log");
    let fuse_dir = lab.path("fuse");
    let loopdev = lab.vm.sh(&format!(
        "modprobe loop && mkdir -p {fuse_dir} && rbd-fuse {fuse_dir} -p {} -r {} --id {} --keyring {} \
         --mon_host {} -c /dev/null && for i in $(seq 1 300); do \
         [ -e {fuse_dir}/{1} ] && break; sleep 0.2; done && \
         losetup --direct-io=on --sector-size 512 -f --show {fuse_dir}/{1}",
        c.pool, images[1], c.user, c.keyring, c.mons
    ));
    let krbd = lab.vm.sh(&format!(
        "modprobe rbd && rbd device map --id {} --keyring {} -m {host}:6789 {}/{}",
        c.user, c.keyring, c.pool, images[2]
    ));
    let devices = [
        ("ublk + librbd", format!("/dev/ublkb{dev}")),
        ("rbd-fuse + loop", loopdev.trim().to_string()),
        ("kernel client", krbd.trim().to_string()),
    ];
    eprintln!(
        "{test}: | job | {} |",
        devices.iter().map(|d| d.0).collect::<Vec<_>>().join(" | ")
    );
    for (name, job) in JOBS {
        let cells: Vec<String> = devices
            .iter()
            .map(|(_, d)| {
                let (bw, iops) = fio(&lab.vm, d, job);
                format!("{bw:.1} MiB/s, {iops:.0} IOPS")
            })
            .collect();
        eprintln!("{test}: | {name} | {} |", cells.join(" | "));
    }
    lab.vm.sh(&format!(
        "rbd device unmap {} ; losetup -d {} ; umount {fuse_dir} ; {} delete --dev {dev}",
        devices[2].1,
        devices[1].1,
        lab.ublk.display()
    ));
}
