//! Prometheus metrics both daemons keep: a small process-global registry of the gRPC calls they
//! serve, the metric families a daemon builds its own metrics from, and their text exposition
//! (format 0.0.4).
//!
//! Every gRPC call is counted by method and gRPC code through the [`Metered`] service wrapper;
//! a daemon that measures more keeps its own [`Family`]s and renders them after
//! [`Registry::render_grpc`].
//!
//! Recording is lock-light: a sample takes a read lock on its family's map and bumps atomics;
//! the write lock is taken only the first time a label set is seen. Only method names and gRPC
//! codes become labels here: never a request's fields, so no secret or volume context can reach
//! a scrape.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{OnceLock, RwLock};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

/// Upper bounds (seconds) of the latency buckets, shared by every histogram: from a
/// sub-millisecond publish to a ten-minute mkfs.
pub const BUCKETS: [f64; 18] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    60.0, 120.0, 600.0,
];

/// A histogram of durations, lock-free.
#[derive(Debug, Default)]
pub struct Histogram {
    /// Per bucket (not cumulative) counts; the last slot is above the largest bound.
    buckets: [AtomicU64; BUCKETS.len() + 1],
    count: AtomicU64,
    sum_nanos: AtomicU64,
}

impl Histogram {
    fn observe(&self, d: Duration) {
        let secs = d.as_secs_f64();
        let slot = BUCKETS
            .iter()
            .position(|b| secs <= *b)
            .unwrap_or(BUCKETS.len());
        if let Some(b) = self.buckets.get(slot) {
            b.fetch_add(1, Ordering::Relaxed);
        }
        let nanos = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        self.sum_nanos.fetch_add(nanos, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
    }
}

/// A metric family: one value per label set. A counter is a `Family<AtomicU64>`, a histogram
/// a `Family<Histogram>`.
#[derive(Debug)]
pub struct Family<V> {
    name: &'static str,
    help: &'static str,
    labels: &'static [&'static str],
    values: RwLock<BTreeMap<Vec<String>, V>>,
}

impl<V: Default> Family<V> {
    /// A family without samples: its name, help text and label names.
    pub const fn new(
        name: &'static str,
        help: &'static str,
        labels: &'static [&'static str],
    ) -> Self {
        Self {
            name,
            help,
            labels,
            values: RwLock::new(BTreeMap::new()),
        }
    }

    /// Runs `f` on the value of this label set, creating it on first use.
    fn with(&self, label_values: &[&str], f: impl FnOnce(&V)) {
        {
            let map = self.values.read().unwrap_or_else(|p| p.into_inner());
            let found = map.iter().find(|(k, _)| {
                k.iter()
                    .map(String::as_str)
                    .eq(label_values.iter().copied())
            });
            if let Some((_, v)) = found {
                f(v);
                return;
            }
        }
        let key: Vec<String> = label_values.iter().map(|s| (*s).to_string()).collect();
        let mut map = self.values.write().unwrap_or_else(|p| p.into_inner());
        f(map.entry(key).or_default());
    }

    fn header(&self, out: &mut String, kind: &str) {
        let _ = writeln!(out, "# HELP {} {}", self.name, self.help);
        let _ = writeln!(out, "# TYPE {} {kind}", self.name);
    }

    /// `{a="x",b="y"}` (with `extra` appended), or nothing when there are no labels.
    fn label_text(&self, values: &[String], extra: Option<(&str, &str)>) -> String {
        let mut pairs: Vec<String> = self
            .labels
            .iter()
            .zip(values)
            .map(|(k, v)| format!("{k}=\"{}\"", escape(v)))
            .collect();
        if let Some((k, v)) = extra {
            pairs.push(format!("{k}=\"{}\"", escape(v)));
        }
        if pairs.is_empty() {
            String::new()
        } else {
            format!("{{{}}}", pairs.join(","))
        }
    }
}

impl Family<AtomicU64> {
    /// Adds one to the counter of this label set.
    pub fn inc(&self, label_values: &[&str]) {
        self.with(label_values, |v| {
            v.fetch_add(1, Ordering::Relaxed);
        });
    }

    /// The counter in the text format.
    pub fn render(&self, out: &mut String) {
        self.header(out, "counter");
        let map = self.values.read().unwrap_or_else(|p| p.into_inner());
        for (k, v) in map.iter() {
            let _ = writeln!(
                out,
                "{}{} {}",
                self.name,
                self.label_text(k, None),
                v.load(Ordering::Relaxed)
            );
        }
    }
}

impl Family<Histogram> {
    /// Adds a duration to the histogram of this label set.
    pub fn observe(&self, label_values: &[&str], d: Duration) {
        self.with(label_values, |h| h.observe(d));
    }

    /// The histogram in the text format.
    pub fn render(&self, out: &mut String) {
        self.header(out, "histogram");
        let map = self.values.read().unwrap_or_else(|p| p.into_inner());
        for (k, h) in map.iter() {
            let mut cumulative = 0u64;
            for (i, bound) in BUCKETS.iter().enumerate() {
                cumulative += h.buckets.get(i).map_or(0, |b| b.load(Ordering::Relaxed));
                let le = format_float(*bound);
                let _ = writeln!(
                    out,
                    "{}_bucket{} {cumulative}",
                    self.name,
                    self.label_text(k, Some(("le", &le)))
                );
            }
            let count = h.count.load(Ordering::Relaxed);
            let _ = writeln!(
                out,
                "{}_bucket{} {count}",
                self.name,
                self.label_text(k, Some(("le", "+Inf")))
            );
            let sum = h.sum_nanos.load(Ordering::Relaxed) as f64 / 1e9;
            let labels = self.label_text(k, None);
            let _ = writeln!(out, "{}_sum{labels} {}", self.name, format_float(sum));
            let _ = writeln!(out, "{}_count{labels} {count}", self.name);
        }
    }
}

/// Escapes a label value: backslash, double quote and newline.
fn escape(v: &str) -> String {
    let mut s = String::with_capacity(v.len());
    for c in v.chars() {
        match c {
            '\\' => s.push_str("\\\\"),
            '"' => s.push_str("\\\""),
            '\n' => s.push_str("\\n"),
            c => s.push(c),
        }
    }
    s
}

/// A float as Prometheus reads it (shortest form that round-trips).
fn format_float(v: f64) -> String {
    if v.is_infinite() {
        if v > 0.0 { "+Inf" } else { "-Inf" }.to_string()
    } else {
        format!("{v}")
    }
}

/// A gauge without labels, in the text format.
pub fn render_gauge(out: &mut String, name: &str, help: &str, value: u64) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} gauge");
    let _ = writeln!(out, "{name} {value}");
}

/// How long a connection may wait after its accept before the server takes it up (a longer
/// wait is logged: the daemon's runtime was busy or blocked).
pub const SLOW_TAKE_UP: Duration = Duration::from_secs(1);
/// How long a connection may stay open without a call (a longer one is logged at its first call,
/// or at its close: its client connected, then waited).
pub const IDLE_CONNECTION: Duration = Duration::from_secs(10);

/// The gRPC calls a daemon served, and how long its connections waited.
#[derive(Debug)]
pub struct Registry {
    grpc_requests: Family<AtomicU64>,
    grpc_duration: Family<Histogram>,
    connection_wait: Family<Histogram>,
    closed_without_call: Family<AtomicU64>,
}

impl Default for Registry {
    fn default() -> Self {
        Self::new()
    }
}

impl Registry {
    /// An empty registry.
    pub const fn new() -> Self {
        Self {
            grpc_requests: Family::new(
                "moor_grpc_requests_total",
                "gRPC calls served, by method and gRPC code.",
                &["method", "code"],
            ),
            grpc_duration: Family::new(
                "moor_grpc_request_duration_seconds",
                "Time to answer a gRPC call, by method and gRPC code.",
                &["method", "code"],
            ),
            connection_wait: Family::new(
                "moor_grpc_connection_wait_seconds",
                "Time from a connection's accept until the server took it up (until=\"served\": \
                 the daemon's own delay) and until its first call reached a handler \
                 (until=\"first_call\": the client's wait and the daemon's).",
                &["until"],
            ),
            closed_without_call: Family::new(
                "moor_grpc_connections_closed_without_call_total",
                "Connections closed without a call after more than 10 s open: clients that \
                 connected and never called.",
                &[],
            ),
        }
    }

    /// Counts how long a connection waited after its accept until `until` (`served`,
    /// `first_call`).
    pub fn observe_connection_wait(&self, until: &str, d: Duration) {
        self.connection_wait.observe(&[until], d);
    }

    /// Counts a connection closed without a call after [`IDLE_CONNECTION`].
    pub fn count_closed_without_call(&self) {
        self.closed_without_call.inc(&[]);
    }

    /// Counts one gRPC call.
    pub fn observe_rpc(&self, method: &str, code: &str, d: Duration) {
        self.grpc_requests.inc(&[method, code]);
        self.grpc_duration.observe(&[method, code], d);
    }

    /// The gRPC families, in the text format.
    pub fn render_grpc(&self, out: &mut String) {
        self.grpc_requests.render(out);
        self.grpc_duration.render(out);
        self.connection_wait.render(out);
        self.closed_without_call.render(out);
    }
}

/// The process's registry.
pub fn registry() -> &'static Registry {
    static REGISTRY: OnceLock<Registry> = OnceLock::new();
    REGISTRY.get_or_init(Registry::new)
}

/// The gRPC families of the process registry: the controller's whole scrape, the start of the
/// node's.
pub fn render_grpc() -> String {
    let mut out = String::new();
    registry().render_grpc(&mut out);
    out
}

/// The name of a gRPC code as Prometheus gRPC metrics usually spell it ("OK", "NotFound").
pub fn code_name(code: tonic::Code) -> &'static str {
    use tonic::Code as C;
    match code {
        C::Ok => "OK",
        C::Cancelled => "Canceled",
        C::Unknown => "Unknown",
        C::InvalidArgument => "InvalidArgument",
        C::DeadlineExceeded => "DeadlineExceeded",
        C::NotFound => "NotFound",
        C::AlreadyExists => "AlreadyExists",
        C::PermissionDenied => "PermissionDenied",
        C::ResourceExhausted => "ResourceExhausted",
        C::FailedPrecondition => "FailedPrecondition",
        C::Aborted => "Aborted",
        C::OutOfRange => "OutOfRange",
        C::Unimplemented => "Unimplemented",
        C::Internal => "Internal",
        C::Unavailable => "Unavailable",
        C::DataLoss => "DataLoss",
        C::Unauthenticated => "Unauthenticated",
    }
}

/// The gRPC code of a response: its `grpc-status` header (tonic answers an error of a unary
/// call with a trailers-only response, the status in the headers), else OK (a unary call that
/// succeeds carries status 0 in its trailers).
fn response_code(headers: &http::HeaderMap) -> tonic::Code {
    headers
        .get("grpc-status")
        .and_then(|v| v.to_str().ok())
        .and_then(|s| s.parse::<i32>().ok())
        .map_or(tonic::Code::Ok, tonic::Code::from_i32)
}

/// The method label of a request path `/package.Service/Method`; only a well-formed method
/// name of reasonable length is kept, so a client cannot grow the label set with garbage.
fn method_of(path: &str) -> &str {
    let method = path.rsplit('/').next().unwrap_or("");
    if !method.is_empty() && method.len() <= 64 && method.bytes().all(|b| b.is_ascii_alphanumeric())
    {
        method
    } else {
        "unknown"
    }
}

/// A gRPC service counted in `moor_grpc_requests_total` and timed in
/// `moor_grpc_request_duration_seconds`: wrap each service given to the tonic router.
#[derive(Debug, Clone)]
pub struct Metered<S> {
    inner: S,
}

impl<S> Metered<S> {
    /// Wraps `inner`.
    pub fn new(inner: S) -> Self {
        Self { inner }
    }
}

impl<S: tonic::server::NamedService> tonic::server::NamedService for Metered<S> {
    const NAME: &'static str = S::NAME;
}

impl<S, B> tower::Service<http::Request<B>> for Metered<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<tonic::body::Body>>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let method = method_of(req.uri().path()).to_string();
        let start = Instant::now();
        if let Some(c) = req.extensions().get::<crate::server::Connection>() {
            c.first_call(&method);
        }
        let in_flight = InFlightCall::enter();
        let fut = self.inner.call(req);
        Box::pin(async move {
            let r = fut.await;
            r.map(|resp| {
                let code = response_code(resp.headers());
                // An unknown method answers UNIMPLEMENTED: one label for all of them.
                let method = if code == tonic::Code::Unimplemented {
                    "unknown"
                } else {
                    &method
                };
                registry().observe_rpc(method, code_name(code), start.elapsed());
                // The call stays in flight until the server has taken its whole answer, not
                // only until the handler returned.
                resp.map(|body| tonic::body::Body::new(CountedBody::new(body, in_flight)))
            })
        })
    }
}

/// A response body that counts its call as in flight until the server drops it, which it does
/// once it has sent every frame (or the client reset the stream). An answer without a body (an
/// error, all in its headers) is taken as the handler returns.
struct CountedBody {
    inner: tonic::body::Body,
    _call: InFlightCall,
}

impl CountedBody {
    fn new(inner: tonic::body::Body, call: InFlightCall) -> Self {
        Self { inner, _call: call }
    }
}

impl http_body::Body for CountedBody {
    type Data = <tonic::body::Body as http_body::Body>::Data;
    type Error = <tonic::body::Body as http_body::Body>::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.get_mut().inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

static IN_FLIGHT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Counts a call as in flight until dropped (also when its future is dropped unfinished).
struct InFlightCall;

impl InFlightCall {
    fn enter() -> Self {
        IN_FLIGHT.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Self
    }
}

impl Drop for InFlightCall {
    fn drop(&mut self) {
        IN_FLIGHT.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}

/// gRPC calls in flight through [`Metered`] services in this process.
pub fn calls_in_flight() -> usize {
    IN_FLIGHT.load(std::sync::atomic::Ordering::SeqCst)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lines(text: &str) -> Vec<&str> {
        text.lines().collect()
    }

    /// A service answering every request with a body of one frame.
    struct Answer;

    impl tower::Service<http::Request<()>> for Answer {
        type Response = http::Response<tonic::body::Body>;
        type Error = std::convert::Infallible;
        type Future = std::future::Ready<Result<Self::Response, Self::Error>>;

        fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
            Poll::Ready(Ok(()))
        }

        fn call(&mut self, _: http::Request<()>) -> Self::Future {
            let body = tonic::body::Body::new(String::from("answer"));
            std::future::ready(Ok(http::Response::new(body)))
        }
    }

    /// Held by every test that calls through [`Metered`]: the count of calls in flight is the
    /// process's, and the tests of a binary run at once.
    static METERED: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

    #[tokio::test]
    async fn a_call_is_in_flight_until_the_server_has_taken_its_answer() {
        use tower::Service as _;
        let _alone = METERED.lock().await;
        let before = calls_in_flight();
        let mut svc = Metered::new(Answer);
        let call = svc.call(http::Request::new(()));
        assert_eq!(calls_in_flight(), before + 1, "counted from the call on");
        let mut body = call.await.unwrap().into_body();
        assert_eq!(
            calls_in_flight(),
            before + 1,
            "the handler returned, the answer is unsent"
        );
        let mut frames = 0;
        while let Some(frame) =
            std::future::poll_fn(|cx| http_body::Body::poll_frame(Pin::new(&mut body), cx)).await
        {
            assert!(frame.is_ok());
            frames += 1;
        }
        assert_eq!(frames, 1);
        assert_eq!(calls_in_flight(), before + 1, "still held by the server");
        drop(body);
        assert_eq!(
            calls_in_flight(),
            before,
            "done once the server drops the answer"
        );
    }

    #[tokio::test]
    async fn a_connections_first_call_is_counted_where_it_is_answered() {
        use tower::Service as _;
        let _alone = METERED.lock().await;
        let long = || {
            let text = render_grpc();
            let bucket = |le: &str| {
                let line = format!(
                    "moor_grpc_connection_wait_seconds_bucket{{until=\"first_call\",le=\"{le}\"}} "
                );
                text.lines()
                    .find_map(|l| l.strip_prefix(line.as_str()))
                    .and_then(|v| v.parse::<u64>().ok())
                    .unwrap_or(0)
            };
            bucket("600") - bucket("120")
        };
        let before = long();
        let connection =
            crate::server::Connection::accepted_at(Instant::now() - Duration::from_secs(300));
        let mut svc = Metered::new(Answer);
        for _ in 0..2 {
            let mut req = http::Request::new(());
            req.extensions_mut().insert(connection.clone());
            drop(svc.call(req).await.unwrap());
        }
        assert_eq!(
            long(),
            before + 1,
            "the first call of the connection, 300 s after its accept"
        );
    }

    #[test]
    fn counters_and_histograms_in_text_format() {
        let r = Registry::new();
        r.observe_rpc("NodeStageVolume", "OK", Duration::from_millis(3));
        r.observe_rpc("NodeStageVolume", "OK", Duration::from_millis(30));
        r.observe_rpc(
            "NodeStageVolume",
            "InvalidArgument",
            Duration::from_micros(100),
        );
        let mut out = String::new();
        r.render_grpc(&mut out);
        let l = lines(&out);
        assert!(l.contains(&"# TYPE moor_grpc_requests_total counter"));
        assert!(l.contains(&"# TYPE moor_grpc_request_duration_seconds histogram"));
        assert!(
            l.iter()
                .any(|x| x.starts_with("# HELP moor_grpc_requests_total "))
        );
        assert!(l.contains(&r#"moor_grpc_requests_total{method="NodeStageVolume",code="OK"} 2"#));
        assert!(l.contains(
            &r#"moor_grpc_requests_total{method="NodeStageVolume",code="InvalidArgument"} 1"#
        ));
        // Buckets are cumulative: 3 ms is above 0.0025 and within 0.005; 30 ms within 0.05.
        let b = |le: &str| {
            format!(
                r#"moor_grpc_request_duration_seconds_bucket{{method="NodeStageVolume",code="OK",le="{le}"}}"#
            )
        };
        assert!(l.contains(&format!("{} 0", b("0.0025")).as_str()));
        assert!(l.contains(&format!("{} 1", b("0.005")).as_str()));
        assert!(l.contains(&format!("{} 1", b("0.025")).as_str()));
        assert!(l.contains(&format!("{} 2", b("0.05")).as_str()));
        assert!(l.contains(&format!("{} 2", b("+Inf")).as_str()));
        assert!(l.contains(
            &r#"moor_grpc_request_duration_seconds_count{method="NodeStageVolume",code="OK"} 2"#
        ));
        assert!(l.contains(
            &r#"moor_grpc_request_duration_seconds_sum{method="NodeStageVolume",code="OK"} 0.033"#
        ));
        // Every sample line is `name{labels} value` with a numeric value.
        for line in l.iter().filter(|x| !x.starts_with('#')) {
            let value = line.rsplit(' ').next().unwrap();
            assert!(value.parse::<f64>().is_ok(), "{line}");
        }
        assert!(out.ends_with('\n'));
    }

    #[test]
    fn label_values_are_escaped() {
        let f: Family<AtomicU64> = Family::new("moor_test_total", "A test counter.", &["action"]);
        f.inc(&["a\"b\\c\nd"]);
        let mut out = String::new();
        f.render(&mut out);
        assert!(out.contains(r#"moor_test_total{action="a\"b\\c\nd"} 1"#));
    }

    #[test]
    fn gauges_and_families_without_samples_say_what_they_are() {
        let f: Family<Histogram> = Family::new("moor_test_seconds", "A test histogram.", &["x"]);
        let mut out = String::new();
        f.render(&mut out);
        render_gauge(&mut out, "moor_test_gauge", "A test gauge.", 7);
        assert_eq!(
            lines(&out),
            [
                "# HELP moor_test_seconds A test histogram.",
                "# TYPE moor_test_seconds histogram",
                "# HELP moor_test_gauge A test gauge.",
                "# TYPE moor_test_gauge gauge",
                "moor_test_gauge 7",
            ]
        );
    }

    #[test]
    fn methods_and_codes() {
        assert_eq!(method_of("/csi.v1.Node/NodeStageVolume"), "NodeStageVolume");
        assert_eq!(method_of("/csi.v1.Node/"), "unknown");
        assert_eq!(method_of("/x/a-b"), "unknown");
        assert_eq!(method_of(&format!("/x/{}", "a".repeat(65))), "unknown");
        let mut h = http::HeaderMap::new();
        assert_eq!(response_code(&h), tonic::Code::Ok);
        h.insert("grpc-status", http::HeaderValue::from_static("3"));
        assert_eq!(response_code(&h), tonic::Code::InvalidArgument);
        assert_eq!(code_name(tonic::Code::Ok), "OK");
        assert_eq!(
            code_name(tonic::Code::FailedPrecondition),
            "FailedPrecondition"
        );
    }
}
