//! The machine itself: how long a thread that was blocked takes to run once it is woken
//! (`cargo bench --bench wake`; needs no root). No target is held to these; they explain the
//! floors of the others. A plugin's answer reaches a caller that slept through the mount behind
//! it, and a server that never stalls unrelated calls hands the work to another thread and
//! back; each hand-off wakes a thread that was blocked. On a machine whose idle vCPUs are slow
//! to wake, that costs far more than the syscalls around it.
//!
//! Group `wake`: one thread sends the time to a second, blocked on a channel, which answers
//! with how long after the send it ran. The value of a sample is the median of its rounds.
//! * `busy`: the next send comes at once: the woken thread was blocked only for the round trip;
//! * `slept-3ms`: the sender sleeps 3 ms first, about an xfs mount, so both threads were idle
//!   as long as a plugin's are while a mount runs.

use std::sync::mpsc;
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use moor_bench::Budget;

/// The median time from a send to the blocked receiver running, over `iters` rounds with
/// `idle` slept before each send, times `iters` (criterion divides by it).
fn wake_latency(iters: u64, idle: Duration) -> Duration {
    let (to, from_main) = mpsc::channel::<Instant>();
    let (to_main, back) = mpsc::channel::<Duration>();
    let woken = std::thread::spawn(move || {
        for sent in from_main {
            if to_main.send(sent.elapsed()).is_err() {
                break;
            }
        }
    });
    let mut rounds = Vec::new();
    for _ in 0..iters {
        if !idle.is_zero() {
            std::thread::sleep(idle);
        }
        to.send(Instant::now()).expect("the woken thread is alive");
        let took = back.recv().expect("the woken thread answers");
        rounds.push(took.as_secs_f64());
    }
    drop(to);
    woken.join().expect("the woken thread ends");
    let n = u32::try_from(iters).unwrap_or(u32::MAX);
    Duration::from_secs_f64(moor_bench::median(&mut rounds)) * n
}

fn wake(c: &mut Criterion) {
    let budget = Budget::new(30, Duration::from_millis(500), Duration::from_secs(4));
    let mut g = moor_bench::flat_group(c, "wake", budget);
    g.bench_function("busy", |b| {
        b.iter_custom(|iters| wake_latency(iters, Duration::ZERO))
    });
    g.bench_function("slept-3ms", |b| {
        b.iter_custom(|iters| wake_latency(iters, Duration::from_millis(3)))
    });
    g.finish();
}

criterion_group!(benches, wake);
criterion_main!(benches);
