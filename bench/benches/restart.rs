//! kubelet's restart (run as root: `cargo bench --bench restart`): with N volumes staged and
//! published, kubelet reconstructs its state and drives every volume again: NodeStageVolume
//! and NodePublishVolume of each, as it makes them (fresh connections, NodeGetCapabilities
//! first), the volumes in parallel on 8 clients. Every such call finds its work done: the
//! plugin's idempotent path. Everything happens in a private mount namespace and is cleaned
//! up, also when it panics.
//!
//! A measured run: the volumes are staged and published first (untimed), then re-driven three
//! times (once with `MOOR_BENCH_QUICK=1`); results, for N = 100 and 1,000:
//! * `restart/null-<N>`: the floor, as many NodeGetCapabilities calls (four per volume) on
//!   fresh connections, with the same clients: the gRPC and connection cost alone;
//! * `restart/redrive-<N>/total`: the re-drive, the median of the runs;
//! * `restart/redrive-<N>/<call>-{p50,p99,max}`: each call's tail over all runs.
//!
//! The loop devices are backed by sparse files on a tmpfs. `MOOR_BENCH_QUICK=1` runs N = 100
//! only. A filter given to `cargo bench` runs it only when the filter contains `restart`.

use std::time::Duration;

use moor_bench::storm::{
    Latencies, Volume, fleet, nanos, run_clients, selected, write_result, write_tails,
};
use moor_bench::{Node, median, publish_req, quick, stage_req, unpublish_req, unstage_req};
use moor_privileged::kubelet_calls::{Call, Kubelet};

const CLIENTS: usize = 8;
const SIZE: u64 = 16 << 20;

/// kubelet's stage and publish of one volume.
fn drive(k: &Kubelet, v: &Volume, l: &mut Latencies) -> Result<(), String> {
    let (caps, stage) = k.stage(&stage_req(&v.id, &v.dev, &v.staging, "ext4"))?;
    l.record(Call::Capabilities, caps);
    l.record(Call::Stage, stage);
    let (caps, publish) = k.publish(&publish_req(&v.id, &v.staging, &v.target))?;
    l.record(Call::Capabilities, caps);
    l.record(Call::Publish, publish);
    Ok(())
}

fn main() {
    if !selected("restart") {
        return;
    }
    let sizes: &[usize] = if quick() { &[100] } else { &[100, 1000] };
    let runs = if quick() { 1 } else { 3 };
    for &n in sizes {
        let node = Node::start(&format!("bench-restart-{n}"));
        node.sb.data_in_memory();
        let volumes = fleet(&node.sb, &format!("vol-r{n}"), n, SIZE);
        let k = Kubelet::new(node.socket());
        let (took, _) = run_clients(CLIENTS, n, |i, l| drive(&k, &volumes[i], l));
        println!("restart-{n}: {n} volumes staged and published in {took:.2?}");

        let mut floors = Vec::new();
        let mut totals = Vec::new();
        let mut all = Latencies::default();
        for _ in 0..runs {
            let (took, _) = run_clients(CLIENTS, 4 * n, |_, _| k.capabilities().map(drop));
            floors.push(nanos(took));
            let (took, l) = run_clients(CLIENTS, n, |i, l| drive(&k, &volumes[i], l));
            println!("restart/redrive-{n}: {n} volumes in {took:.2?}");
            totals.push(nanos(took));
            all.merge(l);
        }
        let floor = median(&mut floors);
        let total = median(&mut totals);
        println!(
            "restart/redrive-{n}: median {:.2?}, floor ({} null calls) {:.2?}",
            Duration::from_nanos(total as u64),
            4 * n,
            Duration::from_nanos(floor as u64)
        );
        write_result(&format!("restart/null-{n}"), floor);
        write_result(&format!("restart/redrive-{n}/total"), total);
        write_tails(&format!("restart/redrive-{n}"), &all);

        let (took, _) = run_clients(CLIENTS, n, |i, _| {
            let v = &volumes[i];
            k.unpublish(&unpublish_req(&v.id, &v.target))?;
            k.unstage(&unstage_req(&v.id, &v.staging)).map(drop)
        });
        println!("restart-{n}: torn down in {took:.2?}");
        drop(node);
    }
}
