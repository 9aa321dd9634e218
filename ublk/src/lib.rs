//! moor-ublk: an RBD image served as a Linux userspace block device (ublk, `/dev/ublkbN`)
//! through librbd (moor-rbd), by a server process that can die and be replaced without the
//! device's users seeing an error: the device is made with ublk's user recovery (Linux 6.0+,
//! `UBLK_F_USER_RECOVERY` with `_REISSUE`), so when its server dies the driver holds the
//! device's requests (it quiesces the device) and a new server process takes the device over
//! (`START_USER_RECOVERY`, its queue fetched, `END_USER_RECOVERY`); the requests the dead
//! server held are issued again to the new one.
//!
//! One queue, whose thread owns the ring (fetches and commits), and a pool of workers that
//! serve the requests with librbd's synchronous calls on the one image, as many at once as
//! there are requests (up to [`DEPTH`]); no discard. See docs/upgrade.md.
//!
//! The unsafe code is in one module, `sys`: the driver's commands over io_uring, and the
//! mappings of the queue's descriptors and buffers.

#![deny(unsafe_code)]

#[allow(unsafe_code)]
mod sys;

use std::io;
use std::sync::{Mutex, mpsc};
use std::time::{Duration, Instant};

pub use sys::DevInfo;
use sys::{Control, Fetched, Queue};

/// Requests in flight per device.
pub const DEPTH: u16 = 64;
/// The largest request (bytes).
pub const MAX_IO: u32 = 512 << 10;

/// Workers serving a queue's requests: one a tag, so every request the driver sends is
/// served at once (a worker waits in librbd, not on the CPU).
pub const WORKERS: usize = DEPTH as usize;

/// What serves the requests of a device: an image's bytes. Its calls are made from several
/// threads at once (`Sync`), one call per request in flight.
pub trait Backend: Send + Sync + 'static {
    fn read(&self, offset: u64, buf: &mut [u8]) -> io::Result<()>;
    fn write(&self, offset: u64, data: &[u8]) -> io::Result<()>;
    fn flush(&self) -> io::Result<()>;
}

/// An RBD image through librbd.
#[derive(Debug)]
pub struct Rbd(pub moor_rbd::Image);

fn rbd_error(e: moor_rbd::Error) -> io::Error {
    match e.errno() {
        Some(n) if n > 0 => io::Error::from_raw_os_error(n),
        _ => io::Error::other(e.to_string()),
    }
}

impl Backend for Rbd {
    fn read(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        // librbd reads into the request's buffer itself (no copy).
        let n = self.0.read_into(offset, buf).map_err(rbd_error)?;
        // Past the image's end (or a short read): zeroes.
        buf[n..].fill(0);
        Ok(())
    }
    fn write(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        self.0.write(offset, data).map_err(rbd_error)
    }
    fn flush(&self) -> io::Result<()> {
        self.0.flush().map_err(rbd_error)
    }
}

/// A request the server holds: what it asks, and its buffer.
trait Held: Send + 'static {
    fn op(&self) -> u8;
    fn offset(&self) -> u64;
    fn len(&self) -> usize;
    fn buffer(&mut self) -> &mut [u8];
}

/// The driver's side of a queue, as the serving loop sees it (the real one is [`Queue`]).
trait Driver {
    type Req: Held;
    /// The next request, a wake (something was sent on the completions' channel), or the end.
    fn next(&mut self) -> io::Result<Next<Self::Req>>;
    /// Answers a request: bytes done, or -errno.
    fn commit(&mut self, req: Self::Req, result: i32) -> io::Result<()>;
    /// What a worker calls once it sent a completion: makes `next` return.
    fn waker(&self) -> Box<dyn Fn() + Send + Sync>;
}

enum Next<R> {
    Request(R),
    Woken,
    Aborted,
}

impl Held for sys::Request {
    fn op(&self) -> u8 {
        self.op
    }
    fn offset(&self) -> u64 {
        self.offset
    }
    fn len(&self) -> usize {
        self.len
    }
    fn buffer(&mut self) -> &mut [u8] {
        sys::Request::buffer(self)
    }
}

impl Driver for Queue {
    type Req = sys::Request;
    fn next(&mut self) -> io::Result<Next<sys::Request>> {
        Ok(match Queue::next(self)? {
            Fetched::Request(r) => Next::Request(r),
            Fetched::Woken => Next::Woken,
            Fetched::Aborted => Next::Aborted,
        })
    }
    fn commit(&mut self, req: sys::Request, result: i32) -> io::Result<()> {
        Queue::commit(self, req, result)
    }
    fn waker(&self) -> Box<dyn Fn() + Send + Sync> {
        let waker = Queue::waker(self);
        Box::new(move || waker.wake())
    }
}

/// Serves one request with the backend: its result, bytes done or -errno. A backend's error
/// is the request's, never the server's end.
fn serve_one(backend: &dyn Backend, req: &mut impl Held) -> i32 {
    let (op, offset, len) = (req.op(), req.offset(), req.len());
    let done = match op {
        sys::OP_READ => backend.read(offset, req.buffer()).map(|()| len as i32),
        sys::OP_WRITE => backend.write(offset, req.buffer()).map(|()| len as i32),
        sys::OP_FLUSH => backend.flush().map(|()| 0),
        _ => Err(io::Error::from_raw_os_error(libc::EOPNOTSUPP)),
    };
    done.unwrap_or_else(|e| {
        eprintln!("moor-ublk: op {op} at {offset} ({len} bytes): {e}");
        -e.raw_os_error().unwrap_or(libc::EIO)
    })
}

/// Serves the queue until the device goes away: the queue's thread (this one) fetches the
/// requests and hands each to the first idle one of `workers` threads, which serves it with
/// the backend and sends it back with its result; this thread commits it. A request is
/// committed only once its backend call returned, so a flush, served when it arrives, follows
/// every write acknowledged before it (librbd's flush covers the writes that returned).
/// When the device goes away the requests being served are waited for (their buffers are the
/// queue's) and not committed.
fn serve<D: Driver>(driver: &mut D, backend: &dyn Backend, workers: usize) -> io::Result<()> {
    let wake = driver.waker();
    let (done_tx, done_rx) = mpsc::channel::<(D::Req, i32)>();
    let (job_tx, job_rx) = mpsc::channel::<D::Req>();
    let job_rx = Mutex::new(job_rx);
    std::thread::scope(|scope| {
        // Moved in: dropped as this closure returns.
        let job_tx = job_tx;
        for _ in 0..workers.max(1) {
            let (job_rx, done_tx, wake) = (&job_rx, done_tx.clone(), &wake);
            scope.spawn(move || {
                loop {
                    // The lock is held only while waiting for a job, not while serving one.
                    let job = job_rx.lock().map(|rx| rx.recv());
                    let Ok(Ok(mut req)) = job else { return };
                    let result = serve_one(backend, &mut req);
                    if done_tx.send((req, result)).is_err() {
                        return;
                    }
                    wake();
                }
            });
        }
        // The workers end once `job_tx` is dropped (as this closure returns, before the scope
        // joins them), each after the request it serves.
        let mut in_flight = 0usize;
        let mut ending = false;
        loop {
            while let Ok((req, result)) = done_rx.try_recv() {
                in_flight -= 1;
                if !ending {
                    driver.commit(req, result)?;
                }
            }
            if ending && in_flight == 0 {
                return Ok(());
            }
            match driver.next()? {
                Next::Request(req) if !ending => {
                    job_tx
                        .send(req)
                        .map_err(|_| io::Error::other("the queue's workers ended"))?;
                    in_flight += 1;
                }
                Next::Request(_) | Next::Woken => {}
                Next::Aborted => ending = true,
            }
        }
    })
}

/// Starts the thread that opens device `dev_id`'s queue, fetches its requests and serves
/// them; returns once the fetches were sent (or the queue could not be opened).
fn spawn_queue(
    dev_id: u32,
    backend: Box<dyn Backend>,
) -> io::Result<std::thread::JoinHandle<io::Result<()>>> {
    let (tx, rx) = std::sync::mpsc::channel();
    let handle = std::thread::Builder::new()
        .name(format!("ublk{dev_id}-q0"))
        .spawn(move || {
            // The driver takes the task that fetched as the queue's: it serves it too.
            let mut queue = match Queue::open(dev_id, DEPTH, MAX_IO) {
                Ok(q) => {
                    let _ = tx.send(Ok(()));
                    q
                }
                Err(e) => {
                    let _ = tx.send(Err(e));
                    return Ok(());
                }
            };
            serve(&mut queue, backend.as_ref(), WORKERS)
        })?;
    rx.recv()
        .map_err(|_| io::Error::other("the queue's thread ended"))??;
    Ok(handle)
}

/// A device being served: its number, and the thread serving it.
#[derive(Debug)]
pub struct Served {
    pub dev_id: u32,
    thread: std::thread::JoinHandle<io::Result<()>>,
}

impl Served {
    /// `/dev/ublkbN`.
    pub fn block_device(&self) -> String {
        format!("/dev/ublkb{}", self.dev_id)
    }

    /// Serves until the device is stopped or deleted.
    pub fn wait(self) -> io::Result<()> {
        self.thread
            .join()
            .map_err(|_| io::Error::other("the queue's thread panicked"))?
    }
}

/// Adds a new, recoverable device of `size` bytes served by `backend`.
pub fn add(size: u64, backend: Box<dyn Backend>) -> io::Result<Served> {
    let mut ctrl = Control::open()?;
    let info = ctrl.add(None, DEPTH, MAX_IO)?;
    let dev_id = info.dev_id;
    let started = (|| {
        ctrl.set_params(dev_id, size, MAX_IO)?;
        let thread = spawn_queue(dev_id, backend)?;
        ctrl.start(dev_id)?;
        Ok(thread)
    })();
    match started {
        Ok(thread) => Ok(Served { dev_id, thread }),
        Err(e) => {
            let _ = ctrl.delete(dev_id);
            Err(e)
        }
    }
}

/// Takes device `dev_id` over after its server died: waits (up to `deadline`) until the driver
/// has quiesced it, then serves it with `backend`.
pub fn recover(dev_id: u32, backend: Box<dyn Backend>, deadline: Duration) -> io::Result<Served> {
    let mut ctrl = Control::open()?;
    let start = Instant::now();
    loop {
        match ctrl.start_recovery(dev_id) {
            Ok(()) => break,
            // The dead server's files are not closed yet, or the device is not quiesced.
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) && start.elapsed() < deadline => {
                std::thread::sleep(Duration::from_millis(100));
            }
            Err(e) => {
                return Err(io::Error::new(
                    e.kind(),
                    format!("START_USER_RECOVERY of ublk device {dev_id}: {e}"),
                ));
            }
        }
    }
    let thread = spawn_queue(dev_id, backend)?;
    ctrl.end_recovery(dev_id)?;
    Ok(Served { dev_id, thread })
}

/// The driver's view of device `dev_id`.
pub fn info(dev_id: u32) -> io::Result<DevInfo> {
    Control::open()?.info(dev_id)
}

/// Puts this process in a session of its own (a server outlives the session and process group
/// of whoever started it: a signal to those does not reach it). A process that leads its group
/// already (started so on purpose) stays where it is.
pub fn own_session() {
    sys::setsid();
}

/// The names of a device's states.
pub fn state_name(state: u16) -> &'static str {
    match state {
        sys::STATE_DEAD => "dead",
        sys::STATE_LIVE => "live",
        sys::STATE_QUIESCED => "quiesced",
        _ => "failing I/O",
    }
}

/// Stops and deletes device `dev_id` (its server's queue ends).
pub fn delete(dev_id: u32) -> io::Result<()> {
    let mut ctrl = Control::open()?;
    // Not started, or already stopped: deleting is what matters.
    let _ = ctrl.stop(dev_id);
    ctrl.delete(dev_id)
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;
    use std::sync::{Arc, Condvar};

    use super::*;

    /// How long a test waits for a condition before it says what it waited for.
    const DEADLINE: Duration = Duration::from_secs(30);

    struct FakeReq {
        tag: u16,
        op: u8,
        offset: u64,
        buf: Vec<u8>,
    }

    impl Held for FakeReq {
        fn op(&self) -> u8 {
            self.op
        }
        fn offset(&self) -> u64 {
            self.offset
        }
        fn len(&self) -> usize {
            self.buf.len()
        }
        fn buffer(&mut self) -> &mut [u8] {
            &mut self.buf
        }
    }

    /// A driver that hands out `pending` (all at once, as the block layer does at depth 32),
    /// records the commits, and ends the queue once every request was committed.
    struct FakeDriver {
        pending: VecDeque<FakeReq>,
        /// Handed out once every request before was committed (as a flush the block layer
        /// sends after the writes it covers completed).
        later: VecDeque<FakeReq>,
        total: usize,
        committed: Vec<(FakeReq, i32)>,
        woken: Arc<(Mutex<bool>, Condvar)>,
        /// Says Aborted once every request was handed out, with some still in flight.
        abort_early: bool,
    }

    impl FakeDriver {
        fn new(reqs: Vec<FakeReq>) -> Self {
            Self {
                total: reqs.len(),
                pending: reqs.into(),
                later: VecDeque::new(),
                committed: Vec::new(),
                woken: Arc::new((Mutex::new(false), Condvar::new())),
                abort_early: false,
            }
        }
    }

    impl Driver for FakeDriver {
        type Req = FakeReq;
        fn next(&mut self) -> io::Result<Next<FakeReq>> {
            if let Some(r) = self.pending.pop_front() {
                return Ok(Next::Request(r));
            }
            if self.committed.len() == self.total && !self.later.is_empty() {
                self.total += self.later.len();
                self.pending = std::mem::take(&mut self.later);
                return self.next();
            }
            if self.committed.len() == self.total || std::mem::take(&mut self.abort_early) {
                return Ok(Next::Aborted);
            }
            let (flag, cv) = &*self.woken;
            let start = Instant::now();
            let mut woken = flag.lock().unwrap();
            while !*woken {
                let left = DEADLINE
                    .checked_sub(start.elapsed())
                    .ok_or_else(|| io::Error::other("no worker woke the queue in 30 s"))?;
                woken = cv.wait_timeout(woken, left).unwrap().0;
            }
            *woken = false;
            Ok(Next::Woken)
        }
        fn commit(&mut self, req: FakeReq, result: i32) -> io::Result<()> {
            self.committed.push((req, result));
            Ok(())
        }
        fn waker(&self) -> Box<dyn Fn() + Send + Sync> {
            let woken = Arc::clone(&self.woken);
            Box::new(move || {
                *woken.0.lock().unwrap() = true;
                woken.1.notify_one();
            })
        }
    }

    fn read(tag: u16, offset: u64) -> FakeReq {
        FakeReq {
            tag,
            op: sys::OP_READ,
            offset,
            buf: vec![0; 4096],
        }
    }

    /// Reads that return only once `want` of them are in flight at once (a condition: after
    /// the deadline every read fails, and the test with it); writes fail with EIO at offset 0.
    struct Gate {
        want: usize,
        state: Mutex<GateState>,
        cv: Condvar,
    }

    #[derive(Default)]
    struct GateState {
        in_flight: usize,
        most: usize,
        gave_up: bool,
    }

    impl Gate {
        fn new(want: usize) -> Self {
            Self {
                want,
                state: Mutex::default(),
                cv: Condvar::new(),
            }
        }
    }

    impl Backend for Gate {
        fn read(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
            let start = Instant::now();
            let mut s = self.state.lock().unwrap();
            s.in_flight += 1;
            s.most = s.most.max(s.in_flight);
            self.cv.notify_all();
            while s.most < self.want && !s.gave_up {
                match DEADLINE.checked_sub(start.elapsed()) {
                    Some(left) => s = self.cv.wait_timeout(s, left).unwrap().0,
                    None => s.gave_up = true,
                }
            }
            s.in_flight -= 1;
            if s.most < self.want {
                self.cv.notify_all();
                return Err(io::Error::from_raw_os_error(libc::ETIMEDOUT));
            }
            buf.fill((offset >> 12) as u8);
            Ok(())
        }
        fn write(&self, offset: u64, _: &[u8]) -> io::Result<()> {
            if offset == 0 {
                return Err(io::Error::from_raw_os_error(libc::EIO));
            }
            Ok(())
        }
        fn flush(&self) -> io::Result<()> {
            Ok(())
        }
    }

    /// Depth 32 is depth 32: the 32 reads the driver hands out are all in the backend at once
    /// (each waits until all are), and each is committed with its own data. Served one at a
    /// time, the first read would wait alone until the deadline and fail.
    #[test]
    fn requests_are_served_at_once() {
        let n = 32;
        let mut driver = FakeDriver::new((0..n).map(|t| read(t, u64::from(t) << 12)).collect());
        let gate = Gate::new(n as usize);
        serve(&mut driver, &gate, WORKERS).unwrap();
        let most = gate.state.lock().unwrap().most;
        assert_eq!(most, n as usize, "reads in flight at once");
        assert_eq!(driver.committed.len(), n as usize);
        for (req, result) in &driver.committed {
            assert_eq!(*result, 4096, "tag {}", req.tag);
            assert!(
                req.buf.iter().all(|&b| b == req.tag as u8),
                "tag {}",
                req.tag
            );
        }
    }

    /// Notes each write as it returns, and which had returned when the flush was called.
    #[derive(Default)]
    struct Recorder {
        returned: Mutex<Vec<u64>>,
        flushed_over: Mutex<Option<Vec<u64>>>,
    }

    impl Backend for Recorder {
        fn read(&self, _: u64, _: &mut [u8]) -> io::Result<()> {
            Ok(())
        }
        fn write(&self, offset: u64, _: &[u8]) -> io::Result<()> {
            self.returned.lock().unwrap().push(offset);
            Ok(())
        }
        fn flush(&self) -> io::Result<()> {
            *self.flushed_over.lock().unwrap() = Some(self.returned.lock().unwrap().clone());
            Ok(())
        }
    }

    /// A flush the driver sends after writes were acknowledged reaches the backend after
    /// those writes returned from it: a write is acknowledged only once the backend is done.
    #[test]
    fn a_flush_covers_the_writes_acknowledged_before_it() {
        let writes: Vec<FakeReq> = (0..16)
            .map(|t| FakeReq {
                tag: t,
                op: sys::OP_WRITE,
                offset: u64::from(t) << 12,
                buf: vec![7; 4096],
            })
            .collect();
        let mut driver = FakeDriver::new(writes);
        driver.later.push_back(FakeReq {
            tag: 16,
            op: sys::OP_FLUSH,
            offset: 0,
            buf: Vec::new(),
        });
        let backend = Recorder::default();
        serve(&mut driver, &backend, WORKERS).unwrap();
        let acked: Vec<u64> = driver
            .committed
            .iter()
            .filter(|(r, res)| r.op == sys::OP_WRITE && *res == 4096)
            .map(|(r, _)| r.offset)
            .collect();
        assert_eq!(acked.len(), 16, "every write acknowledged");
        let mut over = backend
            .flushed_over
            .lock()
            .unwrap()
            .clone()
            .expect("a flush");
        over.sort();
        let mut acked = acked;
        acked.sort();
        assert_eq!(over, acked, "the writes the flush came after");
        let flush = driver.committed.last().unwrap();
        assert_eq!((flush.0.op, flush.1), (sys::OP_FLUSH, 0));
    }

    /// When the queue goes away with requests in the backend, the server waits for them
    /// (their buffers are the queue's) and commits none of them.
    #[test]
    fn the_end_waits_for_the_requests_in_flight() {
        let n = 8;
        let mut driver = FakeDriver::new((0..n).map(|t| read(t, u64::from(t) << 12)).collect());
        driver.abort_early = true;
        let gate = Gate::new(n as usize);
        serve(&mut driver, &gate, WORKERS).unwrap();
        let s = gate.state.lock().unwrap();
        assert_eq!((s.most, s.in_flight), (n as usize, 0));
        assert!(driver.committed.is_empty(), "committed after the end");
    }

    /// A backend's error is its request's -errno; the other requests are served and the
    /// server goes on; an unknown op is -EOPNOTSUPP.
    #[test]
    fn a_backend_error_is_the_requests() {
        let write = |tag, offset| FakeReq {
            tag,
            op: sys::OP_WRITE,
            offset,
            buf: vec![1; 512],
        };
        let mut driver = FakeDriver::new(vec![
            write(0, 0),
            write(1, 4096),
            FakeReq {
                tag: 2,
                op: 9,
                offset: 0,
                buf: Vec::new(),
            },
        ]);
        serve(&mut driver, &Gate::new(0), 4).unwrap();
        let mut results: Vec<(u16, i32)> = driver
            .committed
            .iter()
            .map(|(r, res)| (r.tag, *res))
            .collect();
        results.sort();
        assert_eq!(results, [(0, -libc::EIO), (1, 512), (2, -libc::EOPNOTSUPP)]);
    }
}
