//! moor-ublk: an RBD image served as a Linux userspace block device (ublk, `/dev/ublkbN`)
//! through librbd (moor-rbd), by a server process that can die and be replaced without the
//! device's users seeing an error: the device is made with ublk's user recovery (Linux 6.0+,
//! `UBLK_F_USER_RECOVERY` with `_REISSUE`), so when its server dies the driver holds the
//! device's requests (it quiesces the device) and a new server process takes the device over
//! (`START_USER_RECOVERY`, its queue fetched, `END_USER_RECOVERY`); the requests the dead
//! server held are issued again to the new one.
//!
//! A spike (issue 38): one queue, and a request served at a time with librbd's synchronous
//! calls; no discard. See docs/upgrade.md.
//!
//! The unsafe code is in one module, `sys`: the driver's commands over io_uring, and the
//! mappings of the queue's descriptors and buffers.

#![deny(unsafe_code)]

#[allow(unsafe_code)]
mod sys;

use std::io;
use std::time::{Duration, Instant};

pub use sys::DevInfo;
use sys::{Control, Fetched, Queue};

/// Requests in flight per device.
pub const DEPTH: u16 = 64;
/// The largest request (bytes).
pub const MAX_IO: u32 = 512 << 10;

/// What serves the requests of a device: an image's bytes.
pub trait Backend: Send + 'static {
    fn read(&mut self, offset: u64, buf: &mut [u8]) -> io::Result<()>;
    fn write(&mut self, offset: u64, data: &[u8]) -> io::Result<()>;
    fn flush(&mut self) -> io::Result<()>;
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
    fn read(&mut self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        let data = self.0.read(offset, buf.len()).map_err(rbd_error)?;
        let n = data.len().min(buf.len());
        buf[..n].copy_from_slice(&data[..n]);
        // Past the image's end (or a short read): zeroes.
        buf[n..].fill(0);
        Ok(())
    }
    fn write(&mut self, offset: u64, data: &[u8]) -> io::Result<()> {
        self.0.write(offset, data).map_err(rbd_error)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.0.flush().map_err(rbd_error)
    }
}

/// Serves the queue until the device goes away: each request to the backend, its result
/// committed. A backend's error is the request's (-errno), never the server's end.
fn serve(mut queue: Queue, backend: &mut dyn Backend) -> io::Result<()> {
    loop {
        let req = match queue.next()? {
            Fetched::Aborted => return Ok(()),
            Fetched::Request(r) => r,
        };
        let buf = queue.buffer(&req);
        let done = match req.op {
            sys::OP_READ => backend.read(req.offset, buf).map(|()| req.len as i32),
            sys::OP_WRITE => backend.write(req.offset, buf).map(|()| req.len as i32),
            sys::OP_FLUSH => backend.flush().map(|()| 0),
            _ => Err(io::Error::from_raw_os_error(libc::EOPNOTSUPP)),
        };
        let result = done.unwrap_or_else(|e| {
            eprintln!(
                "moor-ublk: op {} at {} ({} bytes): {e}",
                req.op, req.offset, req.len
            );
            -e.raw_os_error().unwrap_or(libc::EIO)
        });
        queue.commit(&req, result)?;
    }
}

/// Starts the thread that opens device `dev_id`'s queue, fetches its requests and serves
/// them; returns once the fetches were sent (or the queue could not be opened).
fn spawn_queue(
    dev_id: u32,
    mut backend: Box<dyn Backend>,
) -> io::Result<std::thread::JoinHandle<io::Result<()>>> {
    let (tx, rx) = std::sync::mpsc::channel();
    let handle = std::thread::Builder::new()
        .name(format!("ublk{dev_id}-q0"))
        .spawn(move || {
            // The driver takes the task that fetched as the queue's: it serves it too.
            let queue = match Queue::open(dev_id, DEPTH, MAX_IO) {
                Ok(q) => {
                    let _ = tx.send(Ok(()));
                    q
                }
                Err(e) => {
                    let _ = tx.send(Err(e));
                    return Ok(());
                }
            };
            serve(queue, backend.as_mut())
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
