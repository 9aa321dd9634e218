//! The rows of the measured benches (`storm`, `restart`, `tails`, `io`, `vm_rbd_storm`,
//! `vm_crypt`, `cluster_pods`, `vm_rbd_io`, `journal`), made
//! from their sizes: the results `moor_bench::storm` writes, under the ids the benches give
//! them.

use std::sync::OnceLock;

use super::{Kind, Ratio, Row, Target};

/// The benches that are measured runs, not criterion's: they take no filter.
pub const BENCHES: [&str; 9] = [
    "storm",
    "restart",
    "tails",
    "io",
    "vm_rbd_storm",
    "vm_crypt",
    "cluster_pods",
    "vm_rbd_io",
    "journal",
];

/// A string that lives as long as the program (the rows are made once).
fn leak(s: String) -> &'static str {
    Box::leak(s.into_boxed_str())
}

fn row(
    group: &'static str,
    label: String,
    id: String,
    reference: Option<String>,
    kind: Kind,
    target: Target,
    bench: &'static str,
) -> Row {
    Row {
        group,
        label: leak(label),
        id: leak(id),
        reference: reference.map(leak),
        kind,
        target,
        bench,
        ratio: Ratio::Medians,
    }
}

/// The CSI name of a call's short name.
fn rpc(call: &str) -> &'static str {
    match call {
        "stage" => "NodeStageVolume",
        "publish" => "NodePublishVolume",
        "unpublish" => "NodeUnpublishVolume",
        "unstage" => "NodeUnstageVolume",
        _ => "NodeGetCapabilities",
    }
}

/// p50, p99 (against p50, held to `p99_target`) and max (against p50) of `call` in `prefix`.
fn tail_rows(
    out: &mut Vec<Row>,
    group: &'static str,
    bench: &'static str,
    what: &str,
    prefix: &str,
    call: &str,
    p99_target: Target,
) {
    let p50 = format!("{prefix}/{call}-p50");
    out.push(row(
        group,
        format!("{what}: {} p50", rpc(call)),
        p50.clone(),
        None,
        Kind::Time,
        Target::Unset,
        bench,
    ));
    out.push(row(
        group,
        format!("{what}: {} p99, against p50", rpc(call)),
        format!("{prefix}/{call}-p99"),
        Some(p50.clone()),
        Kind::Time,
        p99_target,
        bench,
    ));
    out.push(row(
        group,
        format!("{what}: {} max, against p50", rpc(call)),
        format!("{prefix}/{call}-max"),
        Some(p50),
        Kind::Time,
        Target::Unset,
        bench,
    ));
}

fn storm_rows(out: &mut Vec<Row>) {
    for n in [100u32, 500] {
        for (storm, calls, held) in [
            ("boot", ["stage", "publish"], true),
            ("teardown", ["unpublish", "unstage"], false),
        ] {
            for c in [1, 8] {
                let raw = format!("storm/raw-{storm}-{n}/c{c}");
                let what = format!(
                    "{storm} storm, {n} volumes, {c} client{}",
                    if c == 1 { "" } else { "s" }
                );
                out.push(row(
                    "B",
                    format!("raw syscalls of a {what}"),
                    raw.clone(),
                    None,
                    Kind::Time,
                    Target::Unset,
                    "storm",
                ));
                out.push(row(
                    "B",
                    format!("{what}: first call to last answer"),
                    format!("storm/{storm}-{n}-c{c}/total"),
                    Some(raw),
                    Kind::Time,
                    Target::Unset,
                    "storm",
                ));
            }
            if held {
                for c in [1, 8] {
                    out.push(row(
                        "B",
                        format!(
                            "boot storm, {n} volumes, {c} client{}, e2fsck exec'd on every stage \
                             (`--e2fsck-always`, the code before): how much faster moor is",
                            if c == 1 { "" } else { "s" }
                        ),
                        format!("storm/boot-{n}-c{c}-e2fsck/total"),
                        Some(format!("storm/boot-{n}-c{c}/total")),
                        Kind::Time,
                        if n == 500 {
                            Target::AtLeast(2.0)
                        } else {
                            Target::Unset
                        },
                        "storm",
                    ));
                    let clients = if c == 1 { "" } else { "s" };
                    out.push(row(
                        "B",
                        format!(
                            "its floor: the boot storm of {n} volumes, {c} client{clients}, on \
                             bare-node with e2fsck -p exec'd before each mount, against without \
                             (the most leaving the exec out gains a plugin that does nothing \
                             else)"
                        ),
                        format!("storm/bare-boot-{n}-c{c}-e2fsck/total"),
                        Some(format!("storm/bare-boot-{n}-c{c}/total")),
                        Kind::Time,
                        Target::Unset,
                        "storm",
                    ));
                    out.push(row(
                        "B",
                        format!(
                            "boot storm, {n} volumes, {c} client{clients}: moor against bare-node \
                             (what moor's probe, check, journal and checks add)"
                        ),
                        format!("storm/boot-{n}-c{c}/total"),
                        Some(format!("storm/bare-boot-{n}-c{c}/total")),
                        Kind::Time,
                        Target::Unset,
                        "storm",
                    ));
                }
            }
            out.push(row(
                "B",
                format!("{storm} storm, {n} volumes: throughput (volumes/s), 8 clients against 1"),
                format!("storm/{storm}-{n}-c8/total"),
                Some(format!("storm/{storm}-{n}-c1/total")),
                Kind::Scaling(n, n),
                if held {
                    Target::AtLeast(1.5)
                } else {
                    Target::Unset
                },
                "storm",
            ));
            for c in [1, 8] {
                for call in calls {
                    let what = format!("{storm} {n}, {c} client{}", if c == 1 { "" } else { "s" });
                    let target = if held {
                        Target::AtMost(10.0)
                    } else {
                        Target::Unset
                    };
                    tail_rows(
                        out,
                        "B",
                        "storm",
                        &what,
                        &format!("storm/{storm}-{n}-c{c}"),
                        call,
                        target,
                    );
                }
            }
        }
    }
}

/// fio's jobs in the `io` bench.
const IO_JOBS: [&str; 8] = [
    "randread-4k-qd1",
    "randread-4k-qd32",
    "randwrite-4k-qd1",
    "randwrite-4k-qd32",
    "read-1m",
    "write-1m",
    "randwrite-4k-qd1-fsync",
    "write-1m-fsync",
];

/// Time per I/O through a published local volume against the disk's: at most 1.11× of it is
/// at least 90% of the disk's IOPS.
fn io_rows(out: &mut Vec<Row>) {
    for job in IO_JOBS {
        let disk = format!("io/{job}/disk");
        out.push(row(
            "I",
            format!(
                "fio {job}: time per I/O on the disk (a file beside the volume's backing file)"
            ),
            disk.clone(),
            None,
            Kind::Time,
            Target::Unset,
            "io",
        ));
        for (dev, what) in [
            (
                "loop",
                "a buffered loop device, as the local controller bound it before direct I/O \
                 (the host's page cache as it comes)",
            ),
            (
                "loop-cold",
                "that loop device, its backing file dropped from the host's page cache before \
                 each run",
            ),
            (
                "loop-dio",
                "a loop device with direct I/O (LO_FLAGS_DIRECT_IO), as the local controller \
                 binds it",
            ),
            (
                "loop-dio-4k",
                "a loop device with direct I/O and 4 KiB logical blocks",
            ),
            (
                "loop-dio-prealloc",
                "a loop device with direct I/O on a preallocated (thick) backing file",
            ),
            (
                "loop-dio-4k-prealloc",
                "a loop device with direct I/O and 4 KiB logical blocks on a preallocated \
                 (thick) backing file",
            ),
        ] {
            out.push(row(
                "I",
                format!("fio {job}: through a published volume on {what}"),
                format!("io/{job}/{dev}"),
                Some(disk.clone()),
                Kind::Time,
                Target::AtMost(1.11),
                "io",
            ));
        }
        // The floor of a loop binding, no moor: the loop driver alone, and plain ext4 on it.
        for (floor, what) in [
            (
                "raw-dio",
                "the loop device alone with direct I/O (no filesystem inside, no moor): the \
                 loop driver's share",
            ),
            (
                "plain-dio",
                "plain ext4 (mkfs.ext4 + mount(2), no moor) on a loop device with direct I/O",
            ),
        ] {
            out.push(row(
                "I",
                format!("fio {job}: on {what}"),
                format!("io/{job}/{floor}"),
                Some(disk.clone()),
                Kind::Time,
                Target::Unset,
                "io",
            ));
        }
        out.push(row(
            "I",
            format!(
                "fio {job}: through a published volume on a loop device with direct I/O, vs \
                 plain ext4 on the same binding"
            ),
            format!("io/{job}/loop-dio"),
            Some(format!("io/{job}/plain-dio")),
            Kind::Time,
            Target::AtMost(1.11),
            "io",
        ));
    }
}

/// Time per I/O through a published RBD volume in the VM lab against `rbd bench`'s (librbd)
/// in the same guest and rounds: at most 1.11× of it is at least 90% of its IOPS. Writes are
/// set against `rbd bench` with librbd's cache off (its default cache acks a write before the
/// OSDs have it), the fsync'd jobs against the job without the fsync (`rbd bench` has none).
fn rbd_io_rows(out: &mut Vec<Row>) {
    for job in IO_JOBS {
        let base = job.trim_end_matches("-fsync");
        let cached = format!("vm_rbd_io/{base}/rbd-bench");
        // A write's reference: librbd with its cache off, each write acked once durable.
        let reference = if job.contains("write") {
            format!("vm_rbd_io/{base}/rbd-bench-nocache")
        } else {
            cached.clone()
        };
        if job == base {
            out.push(row(
                "V",
                format!("TCG guest: rbd bench (librbd) as fio's {job}, time per I/O"),
                cached.clone(),
                None,
                Kind::Time,
                Target::Unset,
                "vm_rbd_io",
            ));
            if reference != cached {
                out.push(row(
                    "V",
                    "TCG guest: the same, librbd's cache off (--rbd_cache=false)".to_string(),
                    reference.clone(),
                    Some(cached.clone()),
                    Kind::Time,
                    Target::Unset,
                    "vm_rbd_io",
                ));
            }
        }
        for (side, what) in [
            ("kernel-ext4", "a file on ext4, the kernel client"),
            ("kernel-block", "the raw block volume, the kernel client"),
            ("ublk-ext4", "a file on ext4, ublk + librbd (moor-ublk)"),
            (
                "ublk-block",
                "the raw block volume, ublk + librbd (moor-ublk)",
            ),
        ] {
            out.push(row(
                "V",
                format!("TCG guest: fio {job} on {what}, against rbd bench"),
                format!("vm_rbd_io/{job}/{side}"),
                Some(reference.clone()),
                Kind::Time,
                Target::AtMost(1.11),
                "vm_rbd_io",
            ));
        }
        // librbd writing fresh data each I/O (fio's rbd engine, cache off): what `rbd bench`,
        // whose one buffer's crc32c is computed once, leaves out.
        out.push(row(
            "V",
            format!(
                "TCG guest: fio {job} through librbd (fio's rbd engine, cache off), against rbd \
                 bench"
            ),
            format!("vm_rbd_io/{job}/librbd-fio"),
            Some(reference.clone()),
            Kind::Time,
            Target::Unset,
            "vm_rbd_io",
        ));
        // The floor of a kernel-client volume: the same job on plain `rbd map` (and plain
        // mkfs.ext4 + mount), no moor. Against rbd bench it is the kernel client's (and
        // ext4's) own share, no target; moor's kernel sides against it, at most 1.11×.
        for (kind, what) in [
            ("ext4", "a file on ext4"),
            ("block", "the raw block device"),
        ] {
            let plain = format!("vm_rbd_io/{job}/plain-{kind}");
            out.push(row(
                "V",
                format!(
                    "TCG guest: fio {job} on {what}, plain rbd map (no moor), against rbd bench"
                ),
                plain.clone(),
                Some(reference.clone()),
                Kind::Time,
                Target::Unset,
                "vm_rbd_io",
            ));
            out.push(row(
                "V",
                format!(
                    "TCG guest: fio {job} on {what}, the kernel client through moor, vs the \
                     plain kernel client"
                ),
                format!("vm_rbd_io/{job}/kernel-{kind}"),
                Some(plain),
                Kind::Time,
                Target::AtMost(1.11),
                "vm_rbd_io",
            ));
        }
    }
}

fn restart_rows(out: &mut Vec<Row>) {
    for n in [100u32, 1000] {
        let null = format!("restart/null-{n}");
        out.push(row(
            "R",
            format!(
                "floor: {} NodeGetCapabilities on fresh connections, 8 clients",
                4 * n
            ),
            null.clone(),
            None,
            Kind::Time,
            Target::Unset,
            "restart",
        ));
        out.push(row(
            "R",
            format!("re-drive of {n} staged and published volumes (NodeStage+NodePublish of each, kubelet-like), 8 clients"),
            format!("restart/redrive-{n}/total"),
            Some(null),
            Kind::Time,
            if n == 1000 { Target::Within(1e9) } else { Target::Unset },
            "restart",
        ));
        for call in ["stage", "publish"] {
            tail_rows(
                out,
                "R",
                "restart",
                &format!("re-drive {n}"),
                &format!("restart/redrive-{n}"),
                call,
                Target::Unset,
            );
        }
    }
}

fn tails_rows(out: &mut Vec<Row>) {
    for c in [1, 8, 64] {
        let clients = format!("{c} client{}", if c == 1 { "" } else { "s" });
        for call in ["stage", "publish", "unpublish", "unstage"] {
            for q in ["p50", "p99", "max"] {
                out.push(row(
                    "T",
                    format!(
                        "{}, {clients}: {q} (reference: its syscalls on {c} thread{})",
                        rpc(call),
                        if c == 1 { "" } else { "s" }
                    ),
                    format!("tails/moor-c{c}/{call}-{q}"),
                    Some(format!("tails/raw-c{c}/{call}-{q}")),
                    Kind::Time,
                    Target::Unset,
                    "tails",
                ));
            }
        }
        for q in ["p50", "p99", "max"] {
            out.push(row(
                "T",
                format!("NodeGetCapabilities on a fresh connection, {clients}: {q} (reference: alone, `kubelet`'s median)"),
                format!("tails/moor-c{c}/capabilities-{q}"),
                Some("kubelet/null-fresh".into()),
                Kind::Time,
                Target::Unset,
                "tails",
            ));
        }
    }
}

/// The storm of maps in the VM lab (issue 41, point 3): moor's N first stages at once against
/// ceph-csi's way and the floor, in one guest in the same run.
fn map_storm_rows(out: &mut Vec<Row>) {
    for n in [10u32, 25, 100] {
        let id = |storm: &str, what: &str| format!("vm_rbd_storm/{storm}-{n}/{what}");
        let storm = format!("{n} fresh RBD images staged at once in a TCG guest");
        let r = |label: String, id: String, reference: Option<String>, target: Target| {
            row(
                "M",
                label,
                id,
                reference,
                Kind::Time,
                target,
                "vm_rbd_storm",
            )
        };
        out.push(r(
            format!("{storm}: ceph-csi's way (rbd device list, rbd map --options noudev, blkid, mkfs.ext4 with assume_storage_prezeroed, blkid, mount per volume), first start to last end"),
            id("ref", "total"),
            None,
            Target::Unset,
        ));
        out.push(r(
            format!("{storm}: moor, NodeStageVolume each (map, probe, mkfs, mount), against ceph-csi's way (≥ 5× faster)"),
            id("moor", "total"),
            Some(id("ref", "total")),
            Target::AtMost(0.2),
        ));
        out.push(r(
            format!("{storm}: the floor, a sysfs write, moor's mkfs.ext4 and mount per volume, against ceph-csi's way"),
            id("floor", "total"),
            Some(id("ref", "total")),
            Target::AtMost(0.2),
        ));
        out.push(r(
            format!("{storm}: moor against that floor"),
            id("moor", "total"),
            Some(id("floor", "total")),
            Target::Unset,
        ));
        for (storm_id, who, target) in [
            ("moor", "moor", Target::AtMost(10.0)),
            ("ref", "ceph-csi's way", Target::Unset),
            ("floor", "the floor", Target::Unset),
        ] {
            out.push(r(
                format!("storm of {n}, {who}: a volume's p50"),
                id(storm_id, "p50"),
                None,
                Target::Unset,
            ));
            out.push(r(
                format!("storm of {n}, {who}: a volume's p99, against p50"),
                id(storm_id, "p99"),
                Some(id(storm_id, "p50")),
                Target::Unset,
            ));
            out.push(r(
                format!("storm of {n}, {who}: a volume's max, against p50"),
                id(storm_id, "max"),
                Some(id(storm_id, "p50")),
                target,
            ));
        }
        for step in ["map", "mkfs", "mount"] {
            out.push(r(
                format!("storm of {n}, the floor: its {step} step's median"),
                id("floor", &format!("{step}-p50")),
                None,
                Target::Unset,
            ));
            out.push(r(
                format!("storm of {n}, moor: its {step} step's median, against the floor's"),
                id("moor", &format!("{step}-p50")),
                Some(id("floor", &format!("{step}-p50"))),
                Target::Unset,
            ));
        }
        out.push(r(
            format!(
                "the kernel's map path: {n} sysfs writes to add_single_major one after another"
            ),
            id("maps-serial", "total"),
            None,
            Target::Unset,
        ));
        out.push(r(
            format!("the kernel's map path: {n} sysfs writes at once, against one after another"),
            id("maps", "total"),
            Some(id("maps-serial", "total")),
            Target::Unset,
        ));
    }
    out.push(row(
        "M",
        "udev in the guest: one `rbd map` with the CLI's default (waits for udev's events)".into(),
        "vm_rbd_storm/udev/map".into(),
        None,
        Kind::Time,
        Target::Unset,
        "vm_rbd_storm",
    ));
    out.push(row(
        "M",
        "udev in the guest: one `rbd map --options noudev` (ceph-csi's), against the default"
            .into(),
        "vm_rbd_storm/udev/map-noudev".into(),
        Some("vm_rbd_storm/udev/map".into()),
        Kind::Time,
        Target::Unset,
        "vm_rbd_storm",
    ));
}

/// A hundred pods on a real Kubernetes (issue 41, point 4): N claims and N pods at once on one
/// node, moor's local volumes against kubernetes-csi's hostpathplugin in the same run.
fn pod_rows(out: &mut Vec<Row>) {
    for n in [10u32, 100] {
        let id = |who: &str, what: &str| format!("cluster_pods/{who}-{n}/{what}");
        let r = |label: String, id: String, reference: Option<String>, target: Target| {
            row(
                "P",
                label,
                id,
                reference,
                Kind::Time,
                target,
                "cluster_pods",
            )
        };
        let what = format!("{n} claims and {n} pods created at once on one node");
        out.push(r(
            format!("{what}, hostpathplugin: creation to every pod Running"),
            id("hostpath", "total"),
            None,
            Target::Unset,
        ));
        out.push(r(
            format!("{what}, moor's local volumes: creation to every pod Running, against hostpathplugin's (no slower)"),
            id("moor", "total"),
            Some(id("hostpath", "total")),
            Target::AtMost(1.0),
        ));
        for q in ["p50", "p99"] {
            out.push(r(
                format!("{n} pods, hostpathplugin: a pod's {q}"),
                id("hostpath", q),
                None,
                Target::Unset,
            ));
            out.push(r(
                format!("{n} pods, moor: a pod's {q}, against hostpathplugin's"),
                id("moor", q),
                Some(id("hostpath", q)),
                Target::Unset,
            ));
        }
        out.push(r(
            format!("{n} pods, moor: the sum of the pods' times to Running"),
            id("moor", "pods-sum"),
            None,
            Target::Unset,
        ));
        out.push(r(
            format!("{n} pods, moor: every call moor-node and moor-controller answered meanwhile (their /metrics), against the pods' times (≤ 5%)"),
            id("moor", "calls"),
            Some(id("moor", "pods-sum")),
            Target::AtMost(0.05),
        ));
    }
}

/// The cost of encryption in the VM lab (issue 40, point 5): an encrypted volume against the
/// same unencrypted one, paired rounds in one guest; throughput as time per GiB, so that the
/// ratio is the slowdown.
fn crypt_rows(out: &mut Vec<Row>) {
    let r = |label: String, id: String, reference: Option<String>| {
        row(
            "E",
            label,
            id,
            reference,
            Kind::Time,
            Target::Unset,
            "vm_crypt",
        )
    };
    for (name, what) in [
        (
            "first-stage",
            "first stage (luksFormat, open, mkfs, mount against mkfs, mount)",
        ),
        (
            "mkfs",
            "the first stage's mkfs.ext4 (encrypted: on the mapping)",
        ),
        ("stage", "a later stage (open, mount against mount)"),
        ("unstage", "unstage (unmount, close against unmount)"),
        (
            "seq-write-1m-per-gib",
            "1 MiB sequential write, time per GiB",
        ),
        ("seq-read-1m-per-gib", "1 MiB sequential read, time per GiB"),
        ("rand-read-4k-per-gib", "4 KiB random read, time per GiB"),
        ("rand-write-4k-per-gib", "4 KiB random write, time per GiB"),
    ] {
        let plain = format!("vm_crypt/plain/{name}");
        out.push(r(
            format!("TCG guest, unencrypted volume: {what}"),
            plain.clone(),
            None,
        ));
        out.push(r(
            format!("TCG guest, encrypted volume: {what}, against unencrypted"),
            format!("vm_crypt/encrypted/{name}"),
            Some(plain),
        ));
    }
    out.push(r(
        "TCG guest: cryptsetup open of moor's default key slot (pbkdf2, 1000 iterations)".into(),
        "vm_crypt/pbkdf-pbkdf2/open".into(),
        None,
    ));
    out.push(r(
        "TCG guest: its PBKDF alone (--test-passphrase), against the open".into(),
        "vm_crypt/pbkdf-pbkdf2/test-passphrase".into(),
        Some("vm_crypt/pbkdf-pbkdf2/open".into()),
    ));
    out.push(r(
        "TCG guest: cryptsetup open of an argon2id key slot as moor formats it, against pbkdf2's"
            .into(),
        "vm_crypt/pbkdf-argon2id/open".into(),
        Some("vm_crypt/pbkdf-pbkdf2/open".into()),
    ));
}

/// `journal`: durable records put at once against one after another, 100 and the smoke
/// run's 20.
fn journal_rows(out: &mut Vec<Row>) {
    for n in [100, 20] {
        out.push(row(
            "J",
            format!("the journal: {n} durable records put one after another (each waits for its own sync)"),
            format!("journal/in-turn-{n}"),
            None,
            Kind::Time,
            Target::Unset,
            "journal",
        ));
        out.push(row(
            "J",
            format!("the journal: the same {n} put at once from {n} threads (their syncs shared), against one after another"),
            format!("journal/at-once-{n}"),
            Some(format!("journal/in-turn-{n}")),
            Kind::Time,
            Target::Unset,
            "journal",
        ));
    }
}

/// Every measured bench's rows.
pub fn rows() -> &'static [Row] {
    static ROWS: OnceLock<Vec<Row>> = OnceLock::new();
    ROWS.get_or_init(|| {
        let mut out = Vec::new();
        storm_rows(&mut out);
        io_rows(&mut out);
        restart_rows(&mut out);
        tails_rows(&mut out);
        map_storm_rows(&mut out);
        crypt_rows(&mut out);
        pod_rows(&mut out);
        rbd_io_rows(&mut out);
        journal_rows(&mut out);
        out
    })
}
