//! The measured runs of the benches that criterion's iteration model does not fit: storms of
//! calls over many volumes at once (a node's boot, its teardown, kubelet's restart) and the
//! latency tails of concurrent clients. Each is run once per configuration, timed from its
//! first call to its last answer, with every call's own time recorded; the results are
//! written where criterion writes its own (`<criterion dir>/<id>/new/estimates.json`, the
//! value as the median), so `bench-report` reads them as it reads criterion's.
//!
//! Here too everything cleans up on drop: the volumes' loop devices and mounts go with the
//! sandbox.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use crate::{criterion_dir, mkfs};
use moor_privileged::Sandbox;
use moor_privileged::kubelet_calls::Call;

/// Every call's time of a run, by call.
#[derive(Debug, Default, Clone)]
pub struct Latencies {
    by_call: BTreeMap<Call, Vec<Duration>>,
}

impl Latencies {
    /// Records one call's time.
    pub fn record(&mut self, call: Call, took: Duration) {
        self.by_call.entry(call).or_default().push(took);
    }

    /// Adds another run's records.
    pub fn merge(&mut self, other: Latencies) {
        for (call, mut v) in other.by_call {
            self.by_call.entry(call).or_default().append(&mut v);
        }
    }

    /// How many calls of `call` were recorded.
    pub fn count(&self, call: Call) -> usize {
        self.by_call.get(&call).map_or(0, Vec::len)
    }

    /// The `q` quantile (0 to 1) of `call`'s times, nearest rank; None without records.
    pub fn quantile(&self, call: Call, q: f64) -> Option<Duration> {
        let mut v = self.by_call.get(&call)?.clone();
        if v.is_empty() {
            return None;
        }
        v.sort_unstable();
        Some(v[nearest_rank(v.len(), q)])
    }
}

/// The index of the `q` quantile in a sorted list of `n` values (nearest rank).
pub fn nearest_rank(n: usize, q: f64) -> usize {
    let rank = (q.clamp(0.0, 1.0) * n as f64).ceil() as usize;
    rank.clamp(1, n.max(1)) - 1
}

/// Writes `value` (nanoseconds, or any number a row reads) as the result `id` (`group/bench`),
/// in criterion's form: `<criterion dir>/<id>/new/estimates.json` with it as the median.
pub fn write_result(id: &str, value: f64) {
    write_result_within(id, (value, value, value));
}

/// [`write_result`] of a median `(low, median, high)` with the range it moved in (the least
/// and the most of a measured run's rounds), which `bench-report` reads as the median's
/// interval: a ratio whose range holds 1 or its target is marked as noise.
pub fn write_result_within(id: &str, (low, value, high): (f64, f64, f64)) {
    let dir = criterion_dir().join(id).join("new");
    std::fs::create_dir_all(&dir).expect("result dir");
    let json = format!(
        "{{\"median\":{{\"confidence_interval\":{{\"confidence_level\":1.0,\"lower_bound\":{low},\
         \"upper_bound\":{high}}},\"point_estimate\":{value},\"standard_error\":0.0}}}}\n"
    );
    std::fs::write(dir.join("estimates.json"), json).expect("write the result");
}

/// Writes the p50, p99 and max of each call `latencies` holds as `<prefix>/<call>-p50` etc.,
/// and prints them.
pub fn write_tails(prefix: &str, latencies: &Latencies) {
    for call in Call::ALL {
        if latencies.count(call) == 0 {
            continue;
        }
        let mut line = format!("{prefix}/{}:", call.name());
        for (name, q) in [("p50", 0.5), ("p99", 0.99), ("max", 1.0)] {
            if let Some(d) = latencies.quantile(call, q) {
                write_result(&format!("{prefix}/{}-{name}", call.name()), nanos(d));
                line.push_str(&format!(" {name} {d:.2?}"));
            }
        }
        println!("{line} ({} calls)", latencies.count(call));
    }
}

/// Whether a measured bench named `name` runs under this command line: `cargo bench` passes
/// its filters on (criterion's benches take them as regexes); a measured bench runs when
/// none is given or one names it. `--list` lists nothing.
pub fn selected(name: &str) -> bool {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.iter().any(|a| a == "--list") {
        return false;
    }
    let filters: Vec<&String> = args.iter().filter(|a| !a.starts_with('-')).collect();
    filters.is_empty() || filters.iter().any(|f| f.contains(name))
}

/// mkdir of `dir` (mode 0750), which may be there already (a plugin's unstage may leave
/// kubelet's staging dir).
pub fn make_dir(dir: &Path) -> Result<(), rustix::io::Errno> {
    match rustix::fs::mkdir(dir, rustix::fs::Mode::from_raw_mode(0o750)) {
        Err(rustix::io::Errno::EXIST) => Ok(()),
        other => other,
    }
}

/// A duration in nanoseconds.
pub fn nanos(d: Duration) -> f64 {
    d.as_secs_f64() * 1e9
}

/// Runs `work` for items `0..items` on `clients` threads, each taking the next item as it is
/// done with its last (kubelet's operations on distinct volumes run in parallel); every
/// thread records into its own [`Latencies`]. Returns the time from the start to the last
/// answer, and the records. Panics with the first failure, after every thread stopped.
pub fn run_clients(
    clients: usize,
    items: usize,
    work: impl Fn(usize, &mut Latencies) -> Result<(), String> + Sync,
) -> (Duration, Latencies) {
    let next = AtomicUsize::new(0);
    let failed: Mutex<Option<String>> = Mutex::new(None);
    let all = Mutex::new(Latencies::default());
    let start = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..clients.max(1) {
            s.spawn(|| {
                let mut mine = Latencies::default();
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= items || failed.lock().is_ok_and(|f| f.is_some()) {
                        break;
                    }
                    if let Err(e) = work(i, &mut mine) {
                        if let Ok(mut f) = failed.lock() {
                            f.get_or_insert(format!("item {i}: {e}"));
                        }
                        break;
                    }
                }
                if let Ok(mut a) = all.lock() {
                    a.merge(mine);
                }
            });
        }
    });
    let took = start.elapsed();
    if let Some(e) = failed.into_inner().ok().flatten() {
        panic!("{e}");
    }
    (took, all.into_inner().unwrap_or_default())
}

/// Runs `work(thread)` on `threads` threads at once (each with a volume of its own, say),
/// every thread recording into its own [`Latencies`]; the clock starts when all are ready.
/// Returns the time to the last one's end, and the records. Panics with the first failure.
pub fn run_threads(
    threads: usize,
    work: impl Fn(usize, &mut Latencies) -> Result<(), String> + Sync,
) -> (Duration, Latencies) {
    let ready = std::sync::Barrier::new(threads + 1);
    let failed: Mutex<Option<String>> = Mutex::new(None);
    let all = Mutex::new(Latencies::default());
    let took = std::thread::scope(|s| {
        for t in 0..threads {
            let (ready, failed, all, work) = (&ready, &failed, &all, &work);
            s.spawn(move || {
                let mut mine = Latencies::default();
                ready.wait();
                if let Err(e) = work(t, &mut mine)
                    && let Ok(mut f) = failed.lock()
                {
                    f.get_or_insert(format!("thread {t}: {e}"));
                }
                if let Ok(mut a) = all.lock() {
                    a.merge(mine);
                }
            });
        }
        ready.wait();
        let start = Instant::now();
        // The scope joins every thread before it returns; the time is taken after that.
        start
    })
    .elapsed();
    if let Some(e) = failed.into_inner().ok().flatten() {
        panic!("{e}");
    }
    (took, all.into_inner().unwrap_or_default())
}

/// One volume of a [`fleet`]: its formatted device, kubelet's staging path and a pod's target.
#[derive(Debug, Clone)]
pub struct Volume {
    /// The volume id.
    pub id: String,
    /// Its loop device.
    pub dev: PathBuf,
    /// kubelet's staging path.
    pub staging: PathBuf,
    /// A pod's publish target.
    pub target: PathBuf,
}

/// `n` volumes on loop devices of their own (sparse files in the sandbox's data dir, which
/// the caller may put in memory first), each already formatted as ext4 by moor's mkfs
/// command, as a node's volumes are when it boots. The devices go with the sandbox.
pub fn fleet(sb: &Sandbox, prefix: &str, n: usize, size: u64) -> Vec<Volume> {
    let volumes: Vec<Volume> = (0..n)
        .map(|i| {
            let id = format!("{prefix}-{i}");
            Volume {
                dev: sb.loop_device(&format!("{id}.img"), size),
                staging: sb.staging(&id),
                target: sb.target(&format!("pod-{id}"), &id),
                id,
            }
        })
        .collect();
    let (took, _) = run_clients(2, n, |i, _| mkfs("ext4", &volumes[i].dev));
    println!("{n} ext4 loop devices made and formatted, mkfs in {took:.2?}");
    volumes
}

/// The reference driver, `hostpathplugin`: `$HOSTPATHPLUGIN`, else on `PATH`, else in
/// `../shared/tools` beside the repository. None (with a line saying so) when absent.
pub fn hostpathplugin() -> Option<PathBuf> {
    let candidates = std::env::var_os("HOSTPATHPLUGIN")
        .map(PathBuf::from)
        .into_iter()
        .chain(
            std::env::var_os("PATH")
                .into_iter()
                .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
                .map(|d| d.join("hostpathplugin")),
        )
        .chain(std::iter::once(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/tools/hostpathplugin"),
        ));
    for c in candidates {
        if c.is_file() {
            return Some(c);
        }
    }
    println!(
        "hostpathplugin not found ($HOSTPATHPLUGIN, PATH, ../shared/tools): its benches are skipped"
    );
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_quantiles() {
        assert_eq!(nearest_rank(100, 0.5), 49);
        assert_eq!(nearest_rank(100, 0.99), 98);
        assert_eq!(nearest_rank(100, 1.0), 99);
        assert_eq!(nearest_rank(1, 0.99), 0);
        assert_eq!(nearest_rank(0, 0.5), 0);
    }

    #[test]
    fn quantiles_of_the_records() {
        let mut l = Latencies::default();
        for us in 1..=100 {
            l.record(Call::Stage, Duration::from_micros(us));
        }
        assert_eq!(
            l.quantile(Call::Stage, 0.5),
            Some(Duration::from_micros(50))
        );
        assert_eq!(
            l.quantile(Call::Stage, 0.99),
            Some(Duration::from_micros(99))
        );
        assert_eq!(
            l.quantile(Call::Stage, 1.0),
            Some(Duration::from_micros(100))
        );
        assert_eq!(l.quantile(Call::Publish, 0.5), None);
    }
}
