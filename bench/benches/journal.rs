//! The node journal in a storm of first stages (no root needed: `cargo bench --bench
//! journal`): N records written to survive a power cut (`Durability::Power`, as every first
//! stage writes one before its mkfs and one after), put at once from N threads, against the
//! same N puts one after another from one thread, each waiting for its own `fdatasync`: what
//! every put of a storm waited for when the journal synced under its lock, which a group
//! commit now shares. The state dir is beside the criterion dir (this machine's disk, not a
//! tmpfs). The rounds alternate the two; the median of each is written as the storm's time
//! under `journal/` for `bench-report` (group J), with the rounds' least and most as its range.
//!
//! 100 records (`MOOR_BENCH_QUICK=1`: 20), 7 rounds (quick: 3).

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use moor_bench::storm::{selected, write_result_within};
use moor_bench::{criterion_dir, quick};
use moor_node::journal::{Durability, Journal, Phase, PublishRecord, VolumeRecord};
use moor_node::sys::MountAttrs;

fn record(i: usize, round: usize) -> VolumeRecord {
    let mut r = VolumeRecord::new(&format!("vol-{i}"));
    r.publishes.insert(
        format!("/var/lib/kubelet/pods/p{round}-{i}/volumes/v/mount").into(),
        PublishRecord {
            block: false,
            attrs: MountAttrs::default(),
            access_mode: 7,
            phase: Phase::Done,
            boot: None,
        },
    );
    r
}

/// N durable puts at once, from N threads; the time from the first start to the last return.
fn at_once(journal: &Arc<Journal>, n: usize, round: usize) -> Duration {
    let start = Arc::new(std::sync::Barrier::new(n + 1));
    let threads: Vec<_> = (0..n)
        .map(|i| {
            let (journal, start) = (Arc::clone(journal), Arc::clone(&start));
            std::thread::spawn(move || {
                start.wait();
                journal
                    .put(&record(i, round), Durability::Power)
                    .expect("a durable put");
            })
        })
        .collect();
    let t = Instant::now();
    start.wait();
    for t in threads {
        t.join().expect("a putting thread");
    }
    t.elapsed()
}

/// The same N durable puts one after another.
fn in_turn(journal: &Journal, n: usize, round: usize) -> Duration {
    let t = Instant::now();
    for i in 0..n {
        journal
            .put(&record(i, round), Durability::Power)
            .expect("a durable put");
    }
    t.elapsed()
}

fn open(dir: &Path) -> Arc<Journal> {
    let _ = std::fs::remove_dir_all(dir);
    Arc::new(Journal::open(dir, false).expect("open the journal").0)
}

fn main() {
    if !selected("journal") {
        return;
    }
    let (n, rounds) = if quick() { (20, 3) } else { (100, 7) };
    let dir = criterion_dir().with_file_name("journal-bench");
    let (mut together, mut alone) = (Vec::new(), Vec::new());
    for round in 0..rounds {
        let j = open(&dir);
        together.push(at_once(&j, n, round).as_secs_f64() * 1e9);
        drop(j);
        let j = open(&dir);
        alone.push(in_turn(&j, n, round).as_secs_f64() * 1e9);
    }
    let _ = std::fs::remove_dir_all(&dir);
    for (name, v) in [("at-once", &mut together), ("in-turn", &mut alone)] {
        v.sort_by(f64::total_cmp);
        let (lo, m, hi) = (v[0], v[v.len() / 2], v[v.len() - 1]);
        write_result_within(&format!("journal/{name}-{n}"), (lo, m, hi));
        println!(
            "journal/{name}-{n}: {:.1} ms ({:.1}-{:.1} ms over {rounds} rounds)",
            m / 1e6,
            lo / 1e6,
            hi / 1e6
        );
    }
}
