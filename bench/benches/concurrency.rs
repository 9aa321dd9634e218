//! Publish throughput with concurrent clients, and the daemon's memory (run as root:
//! `cargo bench --bench concurrency`): issue 7's group 6. Everything happens in a private mount
//! namespace and is cleaned up, also when a bench panics.
//!
//! Group `concurrency`, throughput in publish+unpublish pairs per second, at 1, 8 and 64
//! clients, its raw reference first:
//! * `raw/<n>`: `n` threads, each doing mount(MS_BIND) + umount2 of its own directory;
//! * `grpc/<n>`: `n` clients, each on its own connection, volume and target, each doing
//!   NodePublishVolume + NodeUnpublishVolume through gRPC on the real daemon.
//!
//! Memory: the daemon's VmRSS idle after start, and its peak (VmHWM, reset just before) while
//! `grpc/64` runs; printed and written to `target/criterion/memory.txt`.

use std::path::PathBuf;
use std::sync::Barrier;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use moor_bench::{
    Budget, MIB, Memory, Node, flat_group, memory, node_client, publish_req, report_memory,
    reset_peak, unpublish_req,
};
use tokio::task::JoinSet;

const CLIENTS: [usize; 3] = [1, 8, 64];

/// One client's volume.
struct Volume {
    id: String,
    staging: PathBuf,
    target: PathBuf,
}

fn concurrency(c: &mut Criterion) {
    let mut node = Node::start("bench-concurrency");
    let pid = node.pid();
    // Idle: started, one client connected, nothing asked yet; let it settle a moment.
    std::thread::sleep(Duration::from_millis(300));
    let idle = memory(pid).expect("daemon memory");

    let most = CLIENTS.iter().copied().max().unwrap_or(1);
    let volumes: Vec<Volume> = (0..most)
        .map(|i| {
            let id = format!("vol-c{i}");
            let (staging, target) = node.staged_volume(&id, 16 * MIB);
            Volume {
                id,
                staging,
                target,
            }
        })
        .collect();
    let raw: Vec<(PathBuf, PathBuf)> = (0..most)
        .map(|i| {
            let (src, dst) = (
                node.sb.root.join(format!("raw-src-{i}")),
                node.sb.root.join(format!("raw-dst-{i}")),
            );
            std::fs::create_dir_all(&src).expect("dir");
            std::fs::create_dir_all(&dst).expect("dir");
            (src, dst)
        })
        .collect();

    // The clients' runtime: two workers, like the machine's two cores.
    let crt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("client runtime");
    let socket = node.socket().to_path_buf();
    let clients = crt.block_on(async {
        let mut v = Vec::with_capacity(most);
        for _ in 0..most {
            v.push(node_client(&socket).await);
        }
        v
    });

    let budget = Budget::new(20, Duration::from_secs(1), Duration::from_secs(4));
    let mut g = flat_group(c, "concurrency", budget);
    let mut peak: Option<Memory> = None;
    for n in CLIENTS {
        g.throughput(Throughput::Elements(n as u64));
        g.bench_with_input(BenchmarkId::new("raw", n), &n, |b, &n| {
            b.iter_custom(|iters| {
                // Threads start in this thread's mount namespace; the clock starts when all
                // of them are ready.
                let ready = Barrier::new(n + 1);
                std::thread::scope(|s| {
                    let handles: Vec<_> = raw
                        .iter()
                        .take(n)
                        .map(|(src, dst)| {
                            let ready = &ready;
                            s.spawn(move || {
                                ready.wait();
                                for _ in 0..iters {
                                    rustix::mount::mount_bind(src.as_path(), dst.as_path())
                                        .expect("bind");
                                    rustix::mount::unmount(
                                        dst.as_path(),
                                        rustix::mount::UnmountFlags::empty(),
                                    )
                                    .expect("umount");
                                }
                            })
                        })
                        .collect();
                    ready.wait();
                    let start = Instant::now();
                    for h in handles {
                        if let Err(e) = h.join() {
                            std::panic::resume_unwind(e);
                        }
                    }
                    start.elapsed()
                })
            })
        });
        if n == most {
            reset_peak(pid).expect("reset the daemon's peak memory");
        }
        let mut ran = false;
        g.bench_with_input(BenchmarkId::new("grpc", n), &n, |b, &n| {
            ran = true;
            b.iter_custom(|iters| {
                crt.block_on(async {
                    let mut set = JoinSet::new();
                    let start = Instant::now();
                    for (client, vol) in clients.iter().zip(&volumes).take(n) {
                        let mut client = client.clone();
                        let (id, staging, target) =
                            (vol.id.clone(), vol.staging.clone(), vol.target.clone());
                        set.spawn(async move {
                            for _ in 0..iters {
                                client
                                    .node_publish_volume(publish_req(&id, &staging, &target))
                                    .await
                                    .expect("NodePublishVolume");
                                client
                                    .node_unpublish_volume(unpublish_req(&id, &target))
                                    .await
                                    .expect("NodeUnpublishVolume");
                            }
                        });
                    }
                    while let Some(done) = set.join_next().await {
                        done.expect("client task");
                    }
                    start.elapsed()
                })
            })
        });
        if n == most && ran {
            peak = Some(memory(pid).expect("daemon memory"));
        }
    }
    g.finish();
    drop(clients);
    drop(crt);
    let path = report_memory(idle, peak).expect("write memory.txt");
    println!("memory written to {}", path.display());
    for v in &volumes {
        node.unstage(&v.id, &v.staging);
    }
}

criterion_group!(benches, concurrency);
criterion_main!(benches);
