//! A node's boot and teardown storms (run as root: `cargo bench --bench storm`): N volumes,
//! each on a loop device of its own already formatted, staged and published as kubelet does
//! after a node boots (every call on a fresh connection, NodeGetCapabilities first, the
//! volumes' operations in parallel), then unpublished and unstaged, by 1 and by 8 clients.
//! Everything happens in a private mount namespace and is cleaned up, also when it panics.
//!
//! A measured run, not criterion's iterations: each storm runs once per configuration, from
//! its first call to its last answer, and every call's time is recorded. Results (written
//! where criterion writes, see `moor_bench::storm`), for N = 100 and 500 and C = 1, 8:
//! * `storm/raw-boot-<N>/c<C>`, `storm/raw-teardown-<N>/c<C>`: the reference, the same mounts
//!   by syscall on C threads (mkdir + mount(2) of the device, mkdir + bind; umount2 + rmdir
//!   of both);
//! * `storm/boot-<N>-c<C>/total`, `storm/teardown-<N>-c<C>/total`: moor-node's storm;
//! * `storm/boot-<N>-c<C>/<call>-{p50,p99,max}`: each call's tail in it;
//! * `storm/boot-<N>-c<C>-e2fsck/total`: the same boot storm on a second moor-node, started
//!   with `--e2fsck-always`: e2fsck exec'd before every stage, as moor did before it decided
//!   e2fsck's clean shortcut itself (the code before, measured in the same run);
//! * `storm/bare-boot-<N>-c<C>/total` and `storm/bare-boot-<N>-c<C>-e2fsck/total`: the floor
//!   of that ratio, the same boot storm on `bare-node --kubelet` (kubelet's calls, each doing
//!   nothing but its syscalls), without and with `e2fsck -p` exec'd before each mount. Their ratio is the
//!   most that leaving the exec out can gain a plugin that does nothing else: no probe, no
//!   check, no journal.
//!
//! As kubelet does, each volume's boot makes its staging dir before NodeStageVolume, and its
//! teardown removes it after NodeUnstageVolume (the raw storms do the same by syscall). The
//! kubelet dir is a tmpfs, as the loop devices' files are: on the host's ext4 every new dir
//! skips the inodes deleted in the last minutes, and a run of this bench makes and removes
//! thousands, so each storm would pay for the ones before it.
//!
//! `MOOR_BENCH_QUICK=1` runs N = 100 only. A filter given to `cargo bench` runs it only when
//! the filter contains `storm`.

use std::time::Duration;

use moor_bench::storm::{
    Latencies, Volume, fleet, make_dir, nanos, run_clients, selected, write_result, write_tails,
};
use moor_bench::{Node, publish_req, quick, stage_req, unpublish_req, unstage_req};
use moor_privileged::kubelet_calls::{Call, Kubelet};
use rustix::mount::{MountFlags, UnmountFlags};

const CLIENTS: [usize; 2] = [1, 8];
const SIZE: u64 = 16 << 20;

fn raw_boot(v: &Volume) -> Result<(), String> {
    let err = |what: &str, e: rustix::io::Errno| format!("{what} {}: {e}", v.id);
    make_dir(&v.staging).map_err(|e| err("mkdir", e))?;
    rustix::mount::mount(&v.dev, &v.staging, "ext4", MountFlags::empty(), None)
        .map_err(|e| err("mount", e))?;
    make_dir(&v.target).map_err(|e| err("mkdir", e))?;
    rustix::mount::mount_bind(&v.staging, &v.target).map_err(|e| err("bind", e))
}

fn raw_teardown(v: &Volume) -> Result<(), String> {
    let err = |what: &str, e: rustix::io::Errno| format!("{what} {}: {e}", v.id);
    rustix::mount::unmount(&v.target, UnmountFlags::empty()).map_err(|e| err("umount", e))?;
    rustix::fs::rmdir(&v.target).map_err(|e| err("rmdir", e))?;
    rustix::mount::unmount(&v.staging, UnmountFlags::empty()).map_err(|e| err("umount", e))?;
    rustix::fs::rmdir(&v.staging).map_err(|e| err("rmdir", e))
}

/// kubelet's boot of one volume: the staging dir made (kubelet's MountDevice makes it before
/// NodeStageVolume), stage, then publish; with `e2fsck` (bare-node only) `e2fsck -p` before the
/// mount.
fn boot(k: &Kubelet, v: &Volume, e2fsck: bool, l: &mut Latencies) -> Result<(), String> {
    make_dir(&v.staging).map_err(|e| format!("mkdir {}: {e}", v.id))?;
    let mut req = stage_req(&v.id, &v.dev, &v.staging, "ext4");
    if e2fsck {
        req.volume_context.insert("e2fsck".into(), "true".into());
    }
    let (caps, stage) = k.stage(&req)?;
    l.record(Call::Capabilities, caps);
    l.record(Call::Stage, stage);
    let (caps, publish) = k.publish(&publish_req(&v.id, &v.staging, &v.target))?;
    l.record(Call::Capabilities, caps);
    l.record(Call::Publish, publish);
    Ok(())
}

/// kubelet's teardown of one volume: unpublish, unstage, then the staging dir removed (as
/// kubelet's UnmountDevice removes it).
fn teardown(k: &Kubelet, v: &Volume, l: &mut Latencies) -> Result<(), String> {
    l.record(
        Call::Unpublish,
        k.unpublish(&unpublish_req(&v.id, &v.target))?,
    );
    let (caps, unstage) = k.unstage(&unstage_req(&v.id, &v.staging))?;
    l.record(Call::Capabilities, caps);
    l.record(Call::Unstage, unstage);
    rustix::fs::rmdir(&v.staging).map_err(|e| format!("rmdir {}: {e}", v.id))
}

fn report(id: &str, n: usize, took: Duration, l: &Latencies) {
    println!(
        "{id}: {n} volumes in {took:.2?} ({:.0} volumes/s)",
        n as f64 / took.as_secs_f64()
    );
    write_result(&format!("{id}/total"), nanos(took));
    write_tails(id, l);
}

fn main() {
    if !selected("storm") {
        return;
    }
    let sizes: &[usize] = if quick() { &[100] } else { &[100, 500] };
    for &n in sizes {
        let node = Node::start_prepared(&format!("bench-storm-{n}"), |sb| {
            sb.data_in_memory();
            sb.kubelet_in_memory();
        });
        let volumes = fleet(&node.sb, &format!("vol-s{n}"), n, SIZE);
        let k = Kubelet::new(node.socket());
        let before = node.start_second("e2fsck", &["--e2fsck-always"]);
        let k_before = Kubelet::new(before.socket());
        let bare = node.start_bare_with(
            std::path::Path::new(env!("CARGO_BIN_EXE_bare-node")),
            &["--kubelet"],
        );
        let k_bare = Kubelet::new(bare.socket());
        for c in CLIENTS {
            let (took, _) = run_clients(c, n, |i, _| raw_boot(&volumes[i]));
            println!("storm/raw-boot-{n}/c{c}: {took:.2?}");
            write_result(&format!("storm/raw-boot-{n}/c{c}"), nanos(took));
            let (took, _) = run_clients(c, n, |i, _| raw_teardown(&volumes[i]));
            println!("storm/raw-teardown-{n}/c{c}: {took:.2?}");
            write_result(&format!("storm/raw-teardown-{n}/c{c}"), nanos(took));

            let (took, l) = run_clients(c, n, |i, l| boot(&k, &volumes[i], false, l));
            report(&format!("storm/boot-{n}-c{c}"), n, took, &l);
            let (took, l) = run_clients(c, n, |i, l| teardown(&k, &volumes[i], l));
            report(&format!("storm/teardown-{n}-c{c}"), n, took, &l);

            let (took, l) = run_clients(c, n, |i, l| boot(&k_before, &volumes[i], false, l));
            report(&format!("storm/boot-{n}-c{c}-e2fsck"), n, took, &l);
            let (took, l) = run_clients(c, n, |i, l| teardown(&k_before, &volumes[i], l));
            report(&format!("storm/teardown-{n}-c{c}-e2fsck"), n, took, &l);

            for (e2fsck, suffix) in [(false, ""), (true, "-e2fsck")] {
                let (took, l) = run_clients(c, n, |i, l| boot(&k_bare, &volumes[i], e2fsck, l));
                report(&format!("storm/bare-boot-{n}-c{c}{suffix}"), n, took, &l);
                let (took, _) = run_clients(c, n, |i, l| teardown(&k_bare, &volumes[i], l));
                println!("storm/bare-teardown-{n}-c{c}{suffix}: {took:.2?}");
            }
        }
        drop(bare);
        drop(before);
        drop(node);
    }
}
