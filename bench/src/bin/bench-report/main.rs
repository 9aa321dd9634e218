//! Prints the performance tables (docs/performance.md) from the results of `cargo bench`, one
//! table per bench: the medians in `target/criterion/<group>/<bench>/new/estimates.json`
//! (criterion's, or a measured run's written in the same form), each with its reference and
//! ratio, the target set for it and whether it holds, and the daemon's memory from
//! `target/criterion/memory.txt`. The rows of the measured benches (storms, restart, tails)
//! are made in `measured.rs`.
//!
//!     bench-report [--criterion DIR] [--note TEXT] [--update FILE]
//!
//! `--update FILE` replaces the text between the lines `<!-- bench-table:begin -->` and
//! `<!-- bench-table:end -->` of FILE (docs/performance.md) with the table instead of printing it.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

const BEGIN: &str = "<!-- bench-table:begin -->";
const END: &str = "<!-- bench-table:end -->";

mod measured;

/// What a row is held to.
#[derive(Debug, Clone, Copy)]
enum Target {
    /// The reference itself, or no target.
    Unset,
    /// The ratio must be at most this.
    AtMost(f64),
    /// The ratio must be at least this.
    AtLeast(f64),
    /// The median itself must be at most this many nanoseconds.
    Within(f64),
}

impl Target {
    fn text(self) -> String {
        match self {
            Target::Unset => "—".into(),
            Target::AtMost(x) => format!("≤ {x}×"),
            Target::AtLeast(x) => format!("≥ {x}×"),
            Target::Within(ns) => format!("≤ {}", duration(ns)),
        }
    }

    /// Whether it holds for a row of median `value` and ratio `ratio`.
    fn holds(self, value: Option<f64>, ratio: Option<f64>) -> &'static str {
        let verdict = match (self, value, ratio) {
            (Target::AtMost(x), _, Some(r)) => r <= x,
            (Target::AtLeast(x), _, Some(r)) => r >= x,
            (Target::Within(ns), Some(v), _) => v <= ns,
            _ => return "",
        };
        if verdict { "yes" } else { "**no**" }
    }
}

/// How a row's numbers compare.
#[derive(Debug, Clone, Copy)]
enum Kind {
    /// Median time; ratio is this time over the reference's.
    Time,
    /// Throughput of `n` publish+unpublish pairs per iteration; ratio is the reference's
    /// throughput over this one (the same as the ratio of times per pair).
    Ops(u32),
    /// Throughput of `n` pairs per iteration against the reference's `m`; ratio is this
    /// throughput over the reference's (scaling: higher is better).
    Scaling(u32, u32),
}

/// One row of the table.
#[derive(Debug)]
struct Row {
    group: &'static str,
    label: &'static str,
    id: &'static str,
    reference: Option<&'static str>,
    kind: Kind,
    target: Target,
    bench: &'static str,
    /// Where the ratio comes from.
    ratio: Ratio,
}

/// Where a row's ratio comes from.
#[derive(Debug, Clone, Copy)]
enum Ratio {
    /// The row's median over its reference's, each from a bench of its own.
    Medians,
    /// The median of a paired bench (`<group>-paired/<name>`), which ran the row's subject
    /// and its raw reference turn by turn in each sample.
    Paired(&'static str),
    /// One paired ratio over another with the same raw reference: the row's subject against a
    /// floor that was paired with that reference too.
    PairedOver(&'static str, &'static str),
}

const fn row(
    group: &'static str,
    label: &'static str,
    id: &'static str,
    reference: Option<&'static str>,
    kind: Kind,
    target: Target,
    bench: &'static str,
) -> Row {
    Row {
        group,
        label,
        id,
        reference,
        kind,
        target,
        bench,
        ratio: Ratio::Medians,
    }
}

/// A row whose ratio is `ratio` (paired), not its median over its reference's.
const fn paired(r: Row, ratio: Ratio) -> Row {
    Row { ratio, ..r }
}

use Kind::{Ops, Scaling, Time};
use Ratio::{Paired, PairedOver};
use Target::{AtLeast, AtMost, Unset as NoTarget};

#[rustfmt::skip]
const ROWS: &[Row] = &[
    row("1", "raw mount(MS_BIND)+umount2 of a directory", "publish/raw", None, Time, NoTarget, "mount"),
    row("1", "raw mkdir+bind+umount2+rmdir (the target made and removed, as the spec has it)", "publish/raw-dir", Some("publish/raw"), Time, NoTarget, "mount"),
    row("2", "engine publish+unpublish, no gRPC", "publish/engine", Some("publish/raw"), Time, NoTarget, "mount"),
    row("2", "engine publish+unpublish against raw with mkdir+rmdir", "publish/engine", Some("publish/raw-dir"), Time, NoTarget, "mount"),
    row("3", "gRPC round trips alone: two NodeGetCapabilities", "publish/grpc-null", Some("publish/raw"), Time, NoTarget, "mount"),
    paired(row("3", "gRPC NodePublish+NodeUnpublish, real daemon", "publish/grpc", Some("publish/raw"), Time, AtMost(3.0), "mount"), Paired("publish-paired/grpc")),
    paired(row("3", "its floor: the same pair on bare-node, a gRPC server that only makes the dir, binds, unmounts and removes it", "publish/bare", Some("publish/raw"), Time, AtMost(3.0), "mount"), Paired("publish-paired/bare")),
    paired(row("3", "gRPC NodePublish+NodeUnpublish against that floor", "publish/grpc", Some("publish/bare"), Time, NoTarget, "mount"), PairedOver("publish-paired/grpc", "publish-paired/bare")),
    row("4", "raw mount(2)+umount2, formatted ext4 loop device", "stage/raw-ext4", None, Time, NoTarget, "stage"),
    row("4", "engine stage+unstage, formatted ext4, no gRPC", "stage/engine-ext4", Some("stage/raw-ext4"), Time, NoTarget, "stage"),
    row("4", "NodeStage+NodeUnstage on bare-node (only the mount(2) and umount2, served over gRPC)", "stage/bare-ext4", Some("stage/raw-ext4"), Time, NoTarget, "stage"),
    paired(row("4", "gRPC NodeStage+NodeUnstage, formatted ext4", "stage/grpc-ext4", Some("stage/raw-ext4"), Time, AtMost(1.2), "stage"), Paired("stage-paired/grpc-ext4")),
    paired(row("4", "its floor: bare-node's pair plus the superblock probe", "stage/bare-ext4+stage/probe-ext4", Some("stage/raw-ext4"), Time, AtMost(1.2), "stage"), Paired("stage-paired/floor-ext4")),
    paired(row("4", "gRPC NodeStage+NodeUnstage, ext4, against that floor", "stage/grpc-ext4", Some("stage/bare-ext4+stage/probe-ext4"), Time, NoTarget, "stage"), PairedOver("stage-paired/grpc-ext4", "stage-paired/floor-ext4")),
    paired(row("4", "its safe floor: bare-node's pair plus the probe and the check a read-write stage of a clean ext4 makes (e2fsck's clean shortcut)", "stage/bare-ext4+stage/shortcut-ext4", Some("stage/raw-ext4"), Time, NoTarget, "stage"), Paired("stage-paired/safe-floor-ext4")),
    paired(row("4", "gRPC NodeStage+NodeUnstage, ext4, against that safe floor", "stage/grpc-ext4", Some("stage/bare-ext4+stage/shortcut-ext4"), Time, NoTarget, "stage"), PairedOver("stage-paired/grpc-ext4", "stage-paired/safe-floor-ext4")),
    paired(row("4", "gRPC NodeStage+NodeUnstage, formatted ext4, held to issue 41's target (its floor above)", "stage/grpc-ext4", Some("stage/raw-ext4"), Time, AtMost(1.5), "stage"), Paired("stage-paired/grpc-ext4")),
    row("4", "e2fsck -p of the clean ext4 (what moor exec'd before every read-write stage)", "stage/fsck-ext4", Some("stage/raw-ext4"), Time, NoTarget, "stage"),
    row("4", "the superblock probe and e2fsck's clean shortcut decided from its bytes (what a stage of a clean ext4 does now in place of probe + e2fsck)", "stage/shortcut-ext4", Some("stage/raw-ext4"), Time, NoTarget, "stage"),
    row("4", "raw mount(2)+umount2, formatted xfs loop device", "stage/raw-xfs", None, Time, NoTarget, "stage"),
    row("4", "engine stage+unstage, formatted xfs, no gRPC", "stage/engine-xfs", Some("stage/raw-xfs"), Time, NoTarget, "stage"),
    row("4", "NodeStage+NodeUnstage on bare-node (only the mount(2) and umount2, served over gRPC)", "stage/bare-xfs", Some("stage/raw-xfs"), Time, NoTarget, "stage"),
    paired(row("4", "gRPC NodeStage+NodeUnstage, formatted xfs", "stage/grpc-xfs", Some("stage/raw-xfs"), Time, AtMost(1.2), "stage"), Paired("stage-paired/grpc-xfs")),
    paired(row("4", "its floor: bare-node's pair plus the superblock probe", "stage/bare-xfs+stage/probe-xfs", Some("stage/raw-xfs"), Time, AtMost(1.2), "stage"), Paired("stage-paired/floor-xfs")),
    paired(row("4", "gRPC NodeStage+NodeUnstage, xfs, against that floor", "stage/grpc-xfs", Some("stage/bare-xfs+stage/probe-xfs"), Time, NoTarget, "stage"), PairedOver("stage-paired/grpc-xfs", "stage-paired/floor-xfs")),
    row("5", "raw bind+umount2, 100 other mounts", "scale/raw/100", None, Time, NoTarget, "scale"),
    row("5", "gRPC publish+unpublish, 100 other mounts", "scale/grpc/100", Some("scale/raw/100"), Time, NoTarget, "scale"),
    row("5", "raw bind+umount2, 1,000 other mounts", "scale/raw/1000", None, Time, NoTarget, "scale"),
    row("5", "gRPC publish+unpublish, 1,000 other mounts", "scale/grpc/1000", Some("scale/raw/1000"), Time, NoTarget, "scale"),
    row("5", "raw bind+umount2, 10,000 other mounts", "scale/raw/10000", None, Time, NoTarget, "scale"),
    row("5", "gRPC publish+unpublish, 10,000 other mounts", "scale/grpc/10000", Some("scale/raw/10000"), Time, NoTarget, "scale"),
    row("5", "gRPC at 10,000 mounts against gRPC at 100", "scale/grpc/10000", Some("scale/grpc/100"), Time, AtMost(1.2), "scale"),
    row("6", "raw bind+umount2, 1 thread", "concurrency/raw/1", None, Ops(1), NoTarget, "concurrency"),
    row("6", "gRPC publish+unpublish, 1 client", "concurrency/grpc/1", Some("concurrency/raw/1"), Ops(1), NoTarget, "concurrency"),
    row("6", "raw bind+umount2, 8 threads", "concurrency/raw/8", None, Ops(8), NoTarget, "concurrency"),
    row("6", "gRPC publish+unpublish, 8 clients", "concurrency/grpc/8", Some("concurrency/raw/8"), Ops(8), NoTarget, "concurrency"),
    row("6", "raw bind+umount2, 64 threads", "concurrency/raw/64", None, Ops(64), NoTarget, "concurrency"),
    row("6", "gRPC publish+unpublish, 64 clients", "concurrency/grpc/64", Some("concurrency/raw/64"), Ops(64), NoTarget, "concurrency"),
    row("6", "gRPC throughput, 8 clients against 1", "concurrency/grpc/8", Some("concurrency/grpc/1"), Scaling(8, 1), AtLeast(1.5), "concurrency"),
    row("7", "mkfs + mount(2), blank 10 GiB ext4", "first-stage/raw-ext4", None, Time, NoTarget, "stage"),
    row("7", "NodeStage on bare-node (the same mkfs + mount(2), served over gRPC)", "first-stage/bare-ext4", Some("first-stage/raw-ext4"), Time, NoTarget, "stage"),
    paired(row("7", "gRPC NodeStage, blank 10 GiB ext4", "first-stage/grpc-ext4", Some("first-stage/raw-ext4"), Time, AtMost(1.1), "stage"), Paired("first-stage-paired/grpc-ext4")),
    paired(row("7", "its floor: bare-node's stage plus the blank proof and the durable intent", "first-stage/bare-ext4+first-stage/proof-ext4", Some("first-stage/raw-ext4"), Time, AtMost(1.1), "stage"), Paired("first-stage-paired/floor-ext4")),
    paired(row("7", "gRPC NodeStage, ext4, against that floor", "first-stage/grpc-ext4", Some("first-stage/bare-ext4+first-stage/proof-ext4"), Time, NoTarget, "stage"), PairedOver("first-stage-paired/grpc-ext4", "first-stage-paired/floor-ext4")),
    row("7", "mkfs + mount(2), blank 10 GiB xfs", "first-stage/raw-xfs", None, Time, NoTarget, "stage"),
    row("7", "NodeStage on bare-node (the same mkfs + mount(2), served over gRPC)", "first-stage/bare-xfs", Some("first-stage/raw-xfs"), Time, NoTarget, "stage"),
    paired(row("7", "gRPC NodeStage, blank 10 GiB xfs", "first-stage/grpc-xfs", Some("first-stage/raw-xfs"), Time, AtMost(1.1), "stage"), Paired("first-stage-paired/grpc-xfs")),
    paired(row("7", "its floor: bare-node's stage plus the blank proof and the durable intent", "first-stage/bare-xfs+first-stage/proof-xfs", Some("first-stage/raw-xfs"), Time, AtMost(1.1), "stage"), Paired("first-stage-paired/floor-xfs")),
    paired(row("7", "gRPC NodeStage, xfs, against that floor", "first-stage/grpc-xfs", Some("first-stage/bare-xfs+first-stage/proof-xfs"), Time, NoTarget, "stage"), PairedOver("first-stage-paired/grpc-xfs", "first-stage-paired/floor-xfs")),
    row("K", "raw mkdir+bind+umount2+rmdir: the kernel's share of a publish+unpublish", "kubelet/raw-dir", None, Time, NoTarget, "kubelet"),
    row("K", "NodeGetCapabilities on an open connection", "kubelet/null-open", None, Time, NoTarget, "kubelet"),
    row("K", "NodeGetCapabilities on a fresh connection (dial, HTTP/2 set-up, call, close)", "kubelet/null-fresh", Some("kubelet/null-open"), Time, NoTarget, "kubelet"),
    row("K", "NodePublish+NodeUnpublish on one open connection", "kubelet/pair-open", Some("kubelet/raw-dir"), Time, NoTarget, "kubelet"),
    paired(row("K", "the same against its floor: mkdir+bind+umount2+rmdir and two null calls on an open connection", "kubelet/pair-open", Some("kubelet/raw-dir+kubelet/null-open+kubelet/null-open"), Time, AtMost(1.3), "kubelet"), Paired("kubelet-paired/pair-open")),
    paired(row("K", "safe floor: the pair's system calls replayed raw (symlink-safe resolutions, mount checks, journal records and log lines, open_tree + move_mount, umount2, unlinkat) and two null calls, against the floor: what safety costs", "kubelet/safe-floor", Some("kubelet/raw-dir+kubelet/null-open+kubelet/null-open"), Time, NoTarget, "kubelet"), Paired("kubelet-paired/safe-floor")),
    paired(row("K", "NodePublish+NodeUnpublish on one open connection against the safe floor: moor's own code", "kubelet/pair-open", Some("kubelet/safe-floor"), Time, AtMost(1.3), "kubelet"), Paired("kubelet-paired/pair-safe")),
    row("K", "kubelet-like NodePublish+NodeUnpublish (NodeGetCapabilities first, every call on a fresh connection)", "kubelet/pair-kubelet", Some("kubelet/pair-open"), Time, NoTarget, "kubelet"),
    row("K", "kubelet-like NodeStage+NodeUnstage, formatted ext4 loop device", "kubelet/stage-kubelet", None, Time, NoTarget, "kubelet"),
    row("K", "hostpathplugin: NodeGetCapabilities on a fresh connection", "kubelet/hostpath-null-fresh", Some("kubelet/null-fresh"), Time, NoTarget, "kubelet"),
    paired(row("K", "hostpathplugin: kubelet-like NodePublish+NodeUnpublish, against moor's", "kubelet/hostpath-pair-kubelet", Some("kubelet/pair-kubelet"), Time, AtLeast(50.0), "kubelet"), Paired("kubelet-paired/hostpath-pair")),
    paired(row("K", "hostpathplugin: kubelet-like NodeStage+NodeUnstage (it mounts nothing at stage), against moor's", "kubelet/hostpath-stage-kubelet", Some("kubelet/stage-kubelet"), Time, NoTarget, "kubelet"), Paired("kubelet-paired/hostpath-stage")),
    row("m", "the machine: a blocked thread run after a send, sent at once", "wake/busy", None, Time, NoTarget, "wake"),
    row("m", "the machine: the same after both threads slept 3 ms, as a plugin's do through a mount", "wake/slept-3ms", Some("wake/busy"), Time, NoTarget, "wake"),
];

/// The number after `"key":` in `text`.
fn number_after(text: &str, key: &str) -> Option<f64> {
    let quoted = format!("\"{key}\"");
    let rest = &text[text.find(&quoted)? + quoted.len()..];
    let rest = rest.trim_start().strip_prefix(':')?.trim_start();
    let end = rest
        .find(|c: char| !(c.is_ascii_digit() || matches!(c, '.' | '-' | '+' | 'e' | 'E')))
        .unwrap_or(rest.len());
    rest[..end].parse().ok()
}

/// The median, in nanoseconds, from a criterion `estimates.json`.
fn median_ns(json: &str) -> Option<f64> {
    number_after(&json[json.find("\"median\"")?..], "point_estimate")
}

/// The median's interval (criterion's 95% confidence interval, bootstrapped from the
/// samples), from an `estimates.json`; the median alone (no spread) when the file has none,
/// as a measured run's single result.
fn median_interval(json: &str) -> Option<(f64, f64)> {
    let point = median_ns(json)?;
    let median = &json[json.find("\"median\"")?..];
    // The median's own object: its interval comes before its point estimate.
    let own = &median[..median.find("\"point_estimate\"").unwrap_or(0)];
    match (
        number_after(own, "lower_bound"),
        number_after(own, "upper_bound"),
    ) {
        (Some(lo), Some(hi)) if lo <= point && point <= hi => Some((lo, hi)),
        _ => Some((point, point)),
    }
}

/// The median of benchmark `id`; for `a+b`, the sum of their medians (a floor made of parts).
fn median(dir: &Path, id: &str) -> Option<f64> {
    interval(dir, id).map(|(_, point, _)| point)
}

/// The median of benchmark `id` within its interval: (low, median, high); for `a+b`, the sums.
fn interval(dir: &Path, id: &str) -> Option<(f64, f64, f64)> {
    id.split('+')
        .map(|part| {
            let text = std::fs::read_to_string(dir.join(part).join("new/estimates.json")).ok()?;
            let (lo, hi) = median_interval(&text)?;
            Some((lo, median_ns(&text)?, hi))
        })
        .try_fold((0.0, 0.0, 0.0), |(a, b, c), x| {
            x.map(|(lo, m, hi)| (a + lo, b + m, c + hi))
        })
}

/// The range a ratio `f(a, b)` takes over the intervals of `a` and `b` (each its ends).
fn ratio_range(a: (f64, f64, f64), b: (f64, f64, f64), f: impl Fn(f64, f64) -> f64) -> (f64, f64) {
    let ends = [f(a.0, b.0), f(a.0, b.2), f(a.2, b.0), f(a.2, b.2)];
    ends.iter()
        .fold((f64::MAX, f64::MIN), |(lo, hi), &x| (lo.min(x), hi.max(x)))
}

/// Whether a ratio whose range is `range` is noise against `bound`: the range holds it, so the
/// run cannot tell the ratio from it.
fn straddles(range: (f64, f64), bound: f64) -> bool {
    range.0 <= bound && bound <= range.1 && range.0 < range.1
}

/// Three significant digits in the best unit.
fn duration(ns: f64) -> String {
    let (v, unit) = if ns >= 1e9 {
        (ns / 1e9, "s")
    } else if ns >= 1e6 {
        (ns / 1e6, "ms")
    } else if ns >= 1e3 {
        (ns / 1e3, "µs")
    } else {
        (ns, "ns")
    };
    format!("{} {unit}", sig3(v))
}

fn sig3(v: f64) -> String {
    if v >= 100.0 {
        format!("{v:.0}")
    } else if v >= 10.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

/// Pairs per second for `n` pairs per iteration of `ns`.
fn ops(n: u32, ns: f64) -> f64 {
    f64::from(n) * 1e9 / ns
}

fn value(kind: Kind, ns: f64) -> String {
    match kind {
        Time => duration(ns),
        Ops(n) | Scaling(n, _) => format!("{} ops/s", sig3(ops(n, ns))),
    }
}

fn reference_value(kind: Kind, ns: f64) -> String {
    match kind {
        Time => duration(ns),
        Ops(n) => format!("{} ops/s", sig3(ops(n, ns))),
        Scaling(_, m) => format!("{} ops/s", sig3(ops(m, ns))),
    }
}

fn ratio(kind: Kind, ns: f64, ref_ns: f64) -> f64 {
    match kind {
        Time | Ops(_) => ns / ref_ns,
        Scaling(n, m) => ops(n, ns) / ops(m, ref_ns),
    }
}

/// `key value` lines of memory.txt, in KiB.
fn memory_kib(text: &str, key: &str) -> Option<u64> {
    text.lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|v| v.trim().parse().ok())
}

/// The command that runs a row's benchmark, and its reference if it has one (a regex with
/// `[^/]+` where the two ids differ: no `|`, which a markdown table cell cannot hold); for a
/// paired ratio, the row's whole group and its paired group.
fn reproduce(r: &Row) -> String {
    if measured::BENCHES.contains(&r.bench) {
        // A measured run takes no filter: the whole bench.
        return format!("cargo bench --bench {}", r.bench);
    }
    if !matches!(r.ratio, Ratio::Medians) {
        // The row's group and its paired group.
        return format!(
            "cargo bench --bench {} -- '^{}(-paired)?/'",
            r.bench,
            group_of(r.id)
        );
    }
    match r.reference {
        Some(reference) => {
            let pattern: Vec<&str> =
                r.id.split('/')
                    .zip(reference.split('/'))
                    .map(|(a, b)| if a == b { a } else { "[^/]+" })
                    .collect();
            format!(
                "cargo bench --bench {} -- '^{}$'",
                r.bench,
                pattern.join("/")
            )
        }
        None => format!("cargo bench --bench {} -- --exact {}", r.bench, r.id),
    }
}

/// The criterion group of a benchmark id (`stage` of `stage/raw-ext4`).
fn group_of(id: &str) -> &str {
    id.split('/').next().unwrap_or(id)
}

/// Every row: the criterion benches' ([`ROWS`]), then the measured benches'.
fn rows() -> Vec<&'static Row> {
    ROWS.iter().chain(measured::rows()).collect()
}

/// One table row of `r`. A ratio whose range (over the 95% intervals of the medians it is
/// made of) holds 1 or the row's target is marked as noise: that run cannot tell them apart.
fn table_row(dir: &Path, r: &Row) -> String {
    let this = median(dir, r.id);
    let reference = r.reference.map(|id| (id, median(dir, id)));
    let median_text = this.map_or("not run".into(), |ns| value(r.kind, ns));
    let ref_text = match reference {
        None => "—".to_string(),
        Some((_, Some(ref_ns))) => reference_value(r.kind, ref_ns),
        Some((id, None)) => format!("`{id}` not run"),
    };
    let over = |a: &str, b: &str, f: &dyn Fn(f64, f64) -> f64| {
        interval(dir, a)
            .zip(interval(dir, b))
            .map(|(a, b)| (f(a.1, b.1), ratio_range(a, b, f)))
    };
    let measured = match (r.ratio, r.reference) {
        (_, None) => None,
        (Ratio::Medians, Some(reference)) => {
            over(r.id, reference, &|a, b| ratio(r.kind, a, b)).map(|m| (m, ""))
        }
        (Paired(id), _) => interval(dir, id).map(|(lo, m, hi)| ((m, (lo, hi)), " (paired)")),
        (PairedOver(a, b), _) => over(a, b, &|a, b| a / b).map(|m| (m, " (paired)")),
    };
    let bound = match r.target {
        AtMost(x) | AtLeast(x) => Some(x),
        _ => None,
    };
    let ratio_text = match (r.reference, measured) {
        (None, _) => "reference".to_string(),
        (Some(_), Some(((x, range), how))) => {
            let noise = straddles(range, 1.0) || bound.is_some_and(|b| straddles(range, b));
            if noise {
                format!(
                    "{}×{how}, noise ({}–{}×)",
                    sig3(x),
                    sig3(range.0),
                    sig3(range.1)
                )
            } else {
                format!("{}×{how}", sig3(x))
            }
        }
        (Some(_), None) => "—".to_string(),
    };
    let mut holds = r
        .target
        .holds(this, measured.map(|((x, _), _)| x))
        .to_string();
    if let (Some(((_, range), _)), Some(b)) = (measured, bound)
        && straddles(range, b)
    {
        holds.push_str(", within noise");
    }
    format!(
        "| {} | {} | {median_text} | {ref_text} | {ratio_text} | {} | {holds} | `{}` |\n",
        r.group,
        r.label,
        r.target.text(),
        reproduce(r),
    )
}

/// The daemon's memory rows (the `concurrency` bench writes them).
fn memory_rows(dir: &Path) -> String {
    let mut out = String::new();
    let mem = std::fs::read_to_string(dir.join("memory.txt")).unwrap_or_default();
    for (label, key, limit) in [
        (
            "moor-node resident memory, idle after start (VmRSS)",
            "idle_rss_kib",
            15u64,
        ),
        (
            "moor-node peak resident memory under 64 clients (VmHWM)",
            "peak_hwm_kib",
            30,
        ),
    ] {
        let (v, holds) = match memory_kib(&mem, key) {
            Some(kib) => (
                format!("{:.1} MiB", kib as f64 / 1024.0),
                if kib < limit * 1024 { "yes" } else { "**no**" },
            ),
            None => ("not run".into(), ""),
        };
        let _ = writeln!(
            out,
            "| mem | {label} | {v} | — | — | < {limit} MiB | {holds} | `cargo bench --bench concurrency` |"
        );
    }
    out
}

/// One table per bench, in the order the benches first appear among the rows, each under a
/// line with the command that runs the whole bench.
fn table(dir: &Path, note: Option<&str>) -> String {
    let mut out = String::new();
    if let Some(note) = note {
        let _ = writeln!(out, "{note}\n");
    }
    let rows = rows();
    let mut benches: Vec<&str> = Vec::new();
    for r in &rows {
        if !benches.contains(&r.bench) {
            benches.push(r.bench);
        }
    }
    for (i, bench) in benches.iter().enumerate() {
        if i > 0 {
            out.push('\n');
        }
        let _ = writeln!(out, "**`{bench}`**: `cargo bench --bench {bench}`\n");
        out.push_str(
            "| # | bench | median | reference | ratio | target | holds | reproduce |\n\
             | --- | --- | --- | --- | --- | --- | --- | --- |\n",
        );
        for r in rows.iter().filter(|r| r.bench == *bench) {
            out.push_str(&table_row(dir, r));
        }
        if *bench == "concurrency" {
            out.push_str(&memory_rows(dir));
        }
    }
    out
}

fn default_dir() -> PathBuf {
    if let Some(home) = std::env::var_os("CRITERION_HOME") {
        return PathBuf::from(home);
    }
    if let Some(target) = std::env::var_os("CARGO_TARGET_DIR") {
        return PathBuf::from(target).join("criterion");
    }
    // This binary lives in target/<profile>/.
    match std::env::current_exe() {
        Ok(exe) => exe
            .parent()
            .and_then(Path::parent)
            .map_or_else(|| PathBuf::from("target"), Path::to_path_buf)
            .join("criterion"),
        Err(_) => PathBuf::from("target/criterion"),
    }
}

fn update(file: &Path, table: &str) -> Result<(), String> {
    let text = std::fs::read_to_string(file).map_err(|e| format!("{}: {e}", file.display()))?;
    let (Some(b), Some(e)) = (text.find(BEGIN), text.find(END)) else {
        return Err(format!("{} has no {BEGIN} ... {END} lines", file.display()));
    };
    if e < b {
        return Err(format!("{END} comes before {BEGIN} in {}", file.display()));
    }
    let new = format!("{}{BEGIN}\n{table}{}", &text[..b], &text[e..]);
    std::fs::write(file, new).map_err(|e| format!("{}: {e}", file.display()))
}

fn main() -> ExitCode {
    let mut args = std::env::args().skip(1);
    let (mut dir, mut note, mut file) = (default_dir(), None, None);
    while let Some(a) = args.next() {
        match (a.as_str(), args.next()) {
            ("--criterion", Some(v)) => dir = PathBuf::from(v),
            ("--note", Some(v)) => note = Some(v),
            ("--update", Some(v)) => file = Some(PathBuf::from(v)),
            _ => {
                eprintln!("usage: bench-report [--criterion DIR] [--note TEXT] [--update FILE]");
                return ExitCode::from(2);
            }
        }
    }
    let table = table(&dir, note.as_deref());
    match file {
        None => {
            print!("{table}");
            ExitCode::SUCCESS
        }
        Some(f) => match update(&f, &table) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("bench-report: {e}");
                ExitCode::FAILURE
            }
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_median_not_the_mean() {
        let json = r#"{"mean":{"confidence_interval":{"confidence_level":0.95,"lower_bound":1.0,"upper_bound":3.0},"point_estimate":2.0,"standard_error":0.1},"median":{"confidence_interval":{"confidence_level":0.95,"lower_bound":4.0,"upper_bound":6.0},"point_estimate":5.5e3,"standard_error":0.2}}"#;
        assert_eq!(median_ns(json), Some(5500.0));
        assert_eq!(median_ns("{}"), None);
    }

    #[test]
    fn formats_in_the_best_unit() {
        assert_eq!(duration(26_200.0), "26.2 µs");
        assert_eq!(duration(1_270_000.0), "1.27 ms");
        assert_eq!(duration(312_400_000.0), "312 ms");
        assert_eq!(duration(2.5e9), "2.50 s");
    }

    #[test]
    fn scaling_compares_throughput() {
        // 8 pairs in 4 ms against 1 pair in 1 ms: 2000 ops/s against 1000.
        assert!((ratio(Scaling(8, 1), 4e6, 1e6) - 2.0).abs() < 1e-9);
        assert!((ratio(Ops(8), 4e6, 2e6) - 2.0).abs() < 1e-9);
    }

    #[test]
    fn reproduce_runs_the_reference_too() {
        let r = ROWS.iter().find(|r| r.id == "scale/grpc/100").expect("row");
        assert_eq!(
            reproduce(r),
            "cargo bench --bench scale -- '^scale/[^/]+/100$'"
        );
        assert_eq!(
            reproduce(&ROWS[0]),
            "cargo bench --bench mount -- --exact publish/raw"
        );
    }

    /// Writes criterion estimates with these medians under a fresh dir.
    fn estimates(name: &str, medians: &[(&str, f64)]) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("bench-report-{name}-{}", std::process::id()));
        for (id, ns) in medians {
            let d = dir.join(id).join("new");
            std::fs::create_dir_all(&d).expect("dir");
            let json = format!(r#"{{"median":{{"point_estimate":{ns}}}}}"#);
            std::fs::write(d.join("estimates.json"), json).expect("write");
        }
        dir
    }

    /// The tables of the estimates under `dir`, which is then removed.
    fn table_of(dir: &Path) -> String {
        let text = table(dir, None);
        let _ = std::fs::remove_dir_all(dir);
        text
    }

    /// The table's row whose text holds `label`.
    fn line_of(text: &str, label: &str) -> String {
        text.lines()
            .find(|l| l.contains(label))
            .unwrap_or_else(|| panic!("no row {label:?} in\n{text}"))
            .to_string()
    }

    #[test]
    fn a_sum_id_adds_medians() {
        let dir = estimates("sum", &[("g/a", 100.0), ("g/b", 250.5)]);
        let sum = median(&dir, "g/a+g/b");
        let missing = median(&dir, "g/a+g/c");
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(sum, Some(350.5));
        assert_eq!(missing, None);
    }

    #[test]
    fn a_target_is_held_to_the_paired_ratio_not_the_medians() {
        // Medians 3.0 ms against 1.0 ms would say 3×; the paired benches say 1.1× and 1.05×.
        let dir = estimates(
            "paired",
            &[
                ("stage/raw-xfs", 1e6),
                ("stage/grpc-xfs", 3e6),
                ("stage/bare-xfs", 2e6),
                ("stage/probe-xfs", 5e4),
                ("stage-paired/grpc-xfs", 1.1),
                ("stage-paired/floor-xfs", 1.05),
            ],
        );
        let text = table_of(&dir);
        let line = |label: &str| line_of(&text, label);
        let moor = line("| gRPC NodeStage+NodeUnstage, formatted xfs |");
        assert!(
            moor.contains("| 3.00 ms | 1.00 ms | 1.10× (paired) | ≤ 1.2× | yes |"),
            "{moor}"
        );
        let floor = line("| 4 | its floor: bare-node's pair plus the superblock probe | 2.05 ms");
        assert!(
            floor.contains("| 1.05× (paired) | ≤ 1.2× | yes |"),
            "{floor}"
        );
        let over = line("| gRPC NodeStage+NodeUnstage, xfs, against that floor |");
        assert!(over.contains("| 1.05× (paired) |"), "{over}");
        assert!(
            over.ends_with("| `cargo bench --bench stage -- '^stage(-paired)?/'` |"),
            "{over}"
        );
        // Not run: no ratio, no verdict.
        let ext4 = line("| gRPC NodeStage+NodeUnstage, formatted ext4 |");
        assert!(
            ext4.contains("| not run | `stage/raw-ext4` not run | — | ≤ 1.2× |  |"),
            "{ext4}"
        );
    }

    #[test]
    fn reads_the_medians_interval() {
        let json = r#"{"mean":{"confidence_interval":{"confidence_level":0.95,"lower_bound":1.0,"upper_bound":3.0},"point_estimate":2.0,"standard_error":0.1},"median":{"confidence_interval":{"confidence_level":0.95,"lower_bound":4.0,"upper_bound":6.0},"point_estimate":5.5,"standard_error":0.2},"median_abs_dev":{"confidence_interval":{"confidence_level":0.95,"lower_bound":0.1,"upper_bound":0.3},"point_estimate":0.2,"standard_error":0.1}}"#;
        assert_eq!(median_interval(json), Some((4.0, 6.0)));
        // None given (a measured run's single result): no spread.
        assert_eq!(
            median_interval(r#"{"median":{"point_estimate":7.0}}"#),
            Some((7.0, 7.0))
        );
    }

    /// Writes criterion estimates with these medians and intervals under a fresh dir.
    fn estimates_within(name: &str, medians: &[(&str, f64, f64, f64)]) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("bench-report-{name}-{}", std::process::id()));
        for (id, lo, ns, hi) in medians {
            let d = dir.join(id).join("new");
            std::fs::create_dir_all(&d).expect("dir");
            let json = format!(
                r#"{{"median":{{"confidence_interval":{{"confidence_level":0.95,"lower_bound":{lo},"upper_bound":{hi}}},"point_estimate":{ns}}}}}"#
            );
            std::fs::write(d.join("estimates.json"), json).expect("write");
        }
        dir
    }

    #[test]
    fn a_ratio_its_intervals_cannot_tell_from_one_or_its_target_is_marked_noise() {
        let dir = estimates_within(
            "noise",
            &[
                // The engine's stage "faster" than the mount it holds: 0.90×, 0.75–1.06×.
                ("stage/raw-ext4", 5.5e6, 6e6, 6.4e6),
                ("stage/engine-ext4", 4.8e6, 5.4e6, 5.8e6),
                // 1.25× paired, its interval holding the target 1.2.
                ("stage/grpc-ext4", 4e6, 4.3e6, 4.6e6),
                ("stage-paired/grpc-ext4", 1.15, 1.25, 1.4),
                // xfs: 1.10× within 1.08–1.12: clear of 1 and of 1.2.
                ("stage/raw-xfs", 2.2e7, 2.3e7, 2.4e7),
                ("stage/grpc-xfs", 1.4e7, 1.45e7, 1.5e7),
                ("stage-paired/grpc-xfs", 1.08, 1.1, 1.12),
            ],
        );
        let text = table_of(&dir);
        let line = |label: &str| line_of(&text, label);
        let engine = line("| engine stage+unstage, formatted ext4, no gRPC |");
        assert!(engine.contains("| 0.90×, noise (0.75–1.05×) |"), "{engine}");
        let grpc = line("| gRPC NodeStage+NodeUnstage, formatted ext4 |");
        assert!(
            grpc.contains("| 1.25× (paired), noise (1.15–1.40×) | ≤ 1.2× | **no**, within noise |"),
            "{grpc}"
        );
        let xfs = line("| gRPC NodeStage+NodeUnstage, formatted xfs |");
        assert!(xfs.contains("| 1.10× (paired) | ≤ 1.2× | yes |"), "{xfs}");
    }

    #[test]
    fn update_replaces_between_the_markers_only() {
        let dir = std::env::temp_dir().join(format!("bench-report-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let f = dir.join("README.md");
        std::fs::write(&f, format!("a\n{BEGIN}\nold\n{END}\nb\n")).expect("write");
        update(&f, "new\n").expect("update");
        let got = std::fs::read_to_string(&f).expect("read");
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(got, format!("a\n{BEGIN}\nnew\n{END}\nb\n"));
    }
}
