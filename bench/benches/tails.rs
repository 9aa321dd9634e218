//! Latency tails under concurrent clients (run as root: `cargo bench --bench tails`): 1, 8 and
//! 64 clients, each with a volume of its own (a formatted ext4 loop device), each cycling
//! through NodeStageVolume, NodePublishVolume, NodeUnpublishVolume and NodeUnstageVolume as
//! kubelet makes them (fresh connections, NodeGetCapabilities first). Everything happens in a
//! private mount namespace and is cleaned up, also when it panics.
//!
//! A measured run, every call's time recorded; results for C = 1, 8, 64:
//! * `tails/raw-c<C>/<call>-{p50,p99,max}`: the reference, C threads doing each call's
//!   syscalls on their own device (mkdir + mount(2); mkdir + bind; umount2 + rmdir;
//!   umount2 + rmdir);
//! * `tails/moor-c<C>/<call>-{p50,p99,max}`: moor-node's calls.
//!
//! `MOOR_BENCH_QUICK=1` runs fewer cycles. A filter given to `cargo bench` runs it only when the
//! filter contains `tails`.

use std::time::Instant;

use moor_bench::storm::{Latencies, Volume, fleet, make_dir, run_threads, selected, write_tails};
use moor_bench::{Node, publish_req, quick, stage_req, unpublish_req, unstage_req};
use moor_privileged::kubelet_calls::{Call, Kubelet};
use rustix::mount::{MountFlags, UnmountFlags};

const CLIENTS: [usize; 3] = [1, 8, 64];
const SIZE: u64 = 16 << 20;

/// Cycles per client: about 400 of each call at every concurrency (at least 10 per client).
fn cycles(clients: usize) -> usize {
    let total = if quick() { 40 } else { 400 };
    (total / clients).max(if quick() { 2 } else { 10 })
}

/// Runs `f` and records its time as `call`.
fn step(
    l: &mut Latencies,
    call: Call,
    f: impl FnOnce() -> Result<(), rustix::io::Errno>,
) -> Result<(), String> {
    let start = Instant::now();
    f().map_err(|e| format!("{}: {e}", call.name()))?;
    l.record(call, start.elapsed());
    Ok(())
}

fn raw_cycle(v: &Volume, l: &mut Latencies) -> Result<(), String> {
    step(l, Call::Stage, || {
        make_dir(&v.staging)?;
        rustix::mount::mount(&v.dev, &v.staging, "ext4", MountFlags::empty(), None)
    })?;
    step(l, Call::Publish, || {
        make_dir(&v.target)?;
        rustix::mount::mount_bind(&v.staging, &v.target)
    })?;
    step(l, Call::Unpublish, || {
        rustix::mount::unmount(&v.target, UnmountFlags::empty())?;
        rustix::fs::rmdir(&v.target)
    })?;
    step(l, Call::Unstage, || {
        rustix::mount::unmount(&v.staging, UnmountFlags::empty())?;
        rustix::fs::rmdir(&v.staging)
    })
}

fn moor_cycle(k: &Kubelet, v: &Volume, l: &mut Latencies) -> Result<(), String> {
    let (caps, t) = k.stage(&stage_req(&v.id, &v.dev, &v.staging, "ext4"))?;
    l.record(Call::Capabilities, caps);
    l.record(Call::Stage, t);
    let (caps, t) = k.publish(&publish_req(&v.id, &v.staging, &v.target))?;
    l.record(Call::Capabilities, caps);
    l.record(Call::Publish, t);
    l.record(
        Call::Unpublish,
        k.unpublish(&unpublish_req(&v.id, &v.target))?,
    );
    let (caps, t) = k.unstage(&unstage_req(&v.id, &v.staging))?;
    l.record(Call::Capabilities, caps);
    l.record(Call::Unstage, t);
    Ok(())
}

fn main() {
    if !selected("tails") {
        return;
    }
    let most = CLIENTS.iter().copied().max().unwrap_or(1);
    let node = Node::start("bench-tails");
    node.sb.data_in_memory();
    let volumes = fleet(&node.sb, "vol-t", most, SIZE);
    let k = Kubelet::new(node.socket());
    for c in CLIENTS {
        let rounds = cycles(c);
        let (_, l) = run_threads(c, |t, l| {
            (0..rounds).try_for_each(|_| raw_cycle(&volumes[t], l))
        });
        write_tails(&format!("tails/raw-c{c}"), &l);
        let (took, l) = run_threads(c, |t, l| {
            (0..rounds).try_for_each(|_| moor_cycle(&k, &volumes[t], l))
        });
        println!("tails/moor-c{c}: {} cycles in {took:.2?}", c * rounds);
        write_tails(&format!("tails/moor-c{c}"), &l);
    }
    drop(node);
}
