//! The ublk driver's interface (`include/uapi/linux/ublk_cmd.h`, Linux 6.0+; the ioctl-encoded
//! commands, 6.4+): control commands on `/dev/ublk-control` and a queue's I/O commands on
//! `/dev/ublkcN`, both as io_uring `URING_CMD`s, and the queue's request descriptors, mapped
//! read-only from `/dev/ublkcN`. All of the crate's unsafe code is here.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd as _;
use std::ptr::NonNull;
use std::sync::Arc;

use io_uring::{IoUring, cqueue, opcode, squeue, types};

/// The control device.
pub const CONTROL: &str = "/dev/ublk-control";

/// A request's operations (`UBLK_IO_OP_*`).
pub const OP_READ: u8 = 0;
pub const OP_WRITE: u8 = 1;
pub const OP_FLUSH: u8 = 2;

/// The device's states (`UBLK_S_DEV_*`).
pub const STATE_DEAD: u16 = 0;
pub const STATE_LIVE: u16 = 1;
pub const STATE_QUIESCED: u16 = 2;

/// Features asked for at ADD_DEV: a new server may take over a device whose server died
/// (USER_RECOVERY), and the requests the dead one held are issued again to the new one
/// (REISSUE: a block write may be written twice, never failed); commands ioctl-encoded.
const F_USER_RECOVERY: u64 = 1 << 3;
const F_USER_RECOVERY_REISSUE: u64 = 1 << 4;
const F_CMD_IOCTL_ENCODE: u64 = 1 << 6;
pub const FLAGS: u64 = F_USER_RECOVERY | F_USER_RECOVERY_REISSUE | F_CMD_IOCTL_ENCODE;

/// A driver's answer to a fetch when the queue is going away (`UBLK_IO_RES_ABORT`).
const IO_RES_ABORT: i32 = -libc::ENODEV;
/// The descriptors of queue `q` are mapped from offset `q * 4096 * size_of::<IoDesc>()` of
/// `/dev/ublkcN` (4096: the driver's largest queue depth): queue 0's, the only one, from 0.
const PARAM_TYPE_BASIC: u32 = 1;
/// The device has a volatile cache: the block layer sends flushes (fsync reaches librbd).
const ATTR_VOLATILE_CACHE: u32 = 1 << 2;

/// `_IOWR('u', nr, size)`.
const fn iowr(nr: u32, size: usize) -> u32 {
    (3 << 30) | ((size as u32) << 16) | ((b'u' as u32) << 8) | nr
}
const CTRL_SIZE: usize = std::mem::size_of::<CtrlCmd>();
const IO_SIZE: usize = std::mem::size_of::<IoCmd>();
const CMD_GET_DEV_INFO: u32 = iowr(0x02, CTRL_SIZE);
const CMD_ADD_DEV: u32 = iowr(0x04, CTRL_SIZE);
const CMD_DEL_DEV: u32 = iowr(0x05, CTRL_SIZE);
const CMD_START_DEV: u32 = iowr(0x06, CTRL_SIZE);
const CMD_STOP_DEV: u32 = iowr(0x07, CTRL_SIZE);
const CMD_SET_PARAMS: u32 = iowr(0x08, CTRL_SIZE);
const CMD_START_USER_RECOVERY: u32 = iowr(0x10, CTRL_SIZE);
const CMD_END_USER_RECOVERY: u32 = iowr(0x11, CTRL_SIZE);
const IO_FETCH_REQ: u32 = iowr(0x20, IO_SIZE);
const IO_COMMIT_AND_FETCH_REQ: u32 = iowr(0x21, IO_SIZE);

/// `struct ublksrv_ctrl_cmd`.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
struct CtrlCmd {
    dev_id: u32,
    queue_id: u16,
    len: u16,
    addr: u64,
    data: u64,
    dev_path_len: u16,
    pad: u16,
    reserved: u32,
}

/// `struct ublksrv_ctrl_dev_info`.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct DevInfo {
    pub nr_hw_queues: u16,
    pub queue_depth: u16,
    pub state: u16,
    pad0: u16,
    pub max_io_buf_bytes: u32,
    pub dev_id: u32,
    pub ublksrv_pid: i32,
    pad1: u32,
    pub flags: u64,
    ublksrv_flags: u64,
    owner_uid: u32,
    owner_gid: u32,
    reserved1: u64,
    reserved2: u64,
}

/// `struct ublk_params` with its basic part only.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
struct Params {
    len: u32,
    types: u32,
    attrs: u32,
    logical_bs_shift: u8,
    physical_bs_shift: u8,
    io_opt_shift: u8,
    io_min_shift: u8,
    max_sectors: u32,
    chunk_sectors: u32,
    dev_sectors: u64,
    virt_boundary_mask: u64,
}

/// `struct ublksrv_io_desc`: one request, as the driver describes it.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
struct IoDesc {
    op_flags: u32,
    nr_sectors: u32,
    start_sector: u64,
    addr: u64,
}

/// `struct ublksrv_io_cmd`.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
struct IoCmd {
    q_id: u16,
    tag: u16,
    result: i32,
    addr: u64,
}

fn bytes<T: Copy, const N: usize>(v: &T) -> [u8; N] {
    let mut out = [0u8; N];
    let size = std::mem::size_of::<T>();
    assert!(size <= N, "a command of {size} bytes in {N}");
    // SAFETY: T is a plain #[repr(C)] struct of integers (Copy, no padding the driver reads
    // as meaningful); its `size` bytes are read from a valid reference into a buffer at
    // least as large, and the two do not overlap.
    unsafe { std::ptr::copy_nonoverlapping(v as *const T as *const u8, out.as_mut_ptr(), size) };
    out
}

/// A control command of device `dev_id` whose data is `buf` (the driver reads and may write
/// it: the caller keeps it until the command's answer).
fn buffer_cmd<T>(dev_id: u32, buf: &mut T) -> CtrlCmd {
    CtrlCmd {
        dev_id,
        queue_id: u16::MAX,
        len: std::mem::size_of::<T>() as u16,
        addr: buf as *mut T as u64,
        ..CtrlCmd::default()
    }
}

/// setsid(2); its one failure (EPERM: this process leads a group already) leaves it as it is.
pub fn setsid() {
    // SAFETY: setsid takes no arguments and touches no memory of this process.
    let _ = unsafe { libc::setsid() };
}

/// The control device with a ring of its own (128-byte entries: a control command is 32 bytes
/// in the entry's 80 of command space).
pub struct Control {
    file: File,
    ring: IoUring<squeue::Entry128, cqueue::Entry>,
}

impl std::fmt::Debug for Control {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Control").finish_non_exhaustive()
    }
}

impl Control {
    pub fn open() -> io::Result<Self> {
        let file = OpenOptions::new().read(true).write(true).open(CONTROL)?;
        let ring = IoUring::builder().build(4)?;
        Ok(Self { file, ring })
    }

    /// Sends one command and waits for its answer (the driver's result, >= 0).
    fn send(&mut self, op: u32, cmd: CtrlCmd) -> io::Result<i32> {
        let entry = opcode::UringCmd80::new(types::Fd(self.file.as_raw_fd()), op)
            .cmd(bytes(&cmd))
            .build()
            .user_data(op as u64);
        // SAFETY: the command's buffers (`cmd.addr`) are the caller's, alive until this
        // function returns, and it returns only once the driver answered (the completion
        // below): nothing the kernel reads or writes is freed before.
        unsafe { self.ring.submission().push(&entry) }
            .map_err(|_| io::Error::other("the control ring is full"))?;
        self.ring.submit_and_wait(1)?;
        let cqe = self
            .ring
            .completion()
            .next()
            .ok_or_else(|| io::Error::other("no completion for a control command"))?;
        let res = cqe.result();
        if res < 0 {
            Err(io::Error::from_raw_os_error(-res))
        } else {
            Ok(res)
        }
    }

    /// ADD_DEV: a new device (`dev_id` None: the driver picks the number), one queue of
    /// `depth` requests of at most `max_io` bytes, recoverable.
    pub fn add(&mut self, dev_id: Option<u32>, depth: u16, max_io: u32) -> io::Result<DevInfo> {
        let id = dev_id.unwrap_or(u32::MAX);
        let mut info = DevInfo {
            nr_hw_queues: 1,
            queue_depth: depth,
            max_io_buf_bytes: max_io,
            dev_id: id,
            flags: FLAGS,
            ..DevInfo::default()
        };
        self.send(CMD_ADD_DEV, buffer_cmd(id, &mut info))?;
        Ok(info)
    }

    /// GET_DEV_INFO of device `dev_id`.
    pub fn info(&mut self, dev_id: u32) -> io::Result<DevInfo> {
        let mut info = DevInfo::default();
        self.send(CMD_GET_DEV_INFO, buffer_cmd(dev_id, &mut info))?;
        Ok(info)
    }

    /// SET_PARAMS: `size` bytes of 512-byte logical and 4 KiB physical blocks, requests of at
    /// most `max_io` bytes, a volatile cache (flushes are sent).
    pub fn set_params(&mut self, dev_id: u32, size: u64, max_io: u32) -> io::Result<()> {
        let mut params = Params {
            len: std::mem::size_of::<Params>() as u32,
            types: PARAM_TYPE_BASIC,
            attrs: ATTR_VOLATILE_CACHE,
            logical_bs_shift: 9,
            physical_bs_shift: 12,
            io_opt_shift: 12,
            io_min_shift: 9,
            max_sectors: max_io >> 9,
            dev_sectors: size >> 9,
            ..Params::default()
        };
        self.send(CMD_SET_PARAMS, buffer_cmd(dev_id, &mut params))
            .map(drop)
    }

    fn simple(&mut self, op: u32, dev_id: u32, data: u64) -> io::Result<()> {
        let cmd = CtrlCmd {
            dev_id,
            queue_id: u16::MAX,
            data,
            ..CtrlCmd::default()
        };
        self.send(op, cmd).map(drop)
    }

    /// START_DEV: returns once every request of the queues was fetched and `/dev/ublkbN`
    /// was added (whose partition scan reads through the queues: they must be served).
    pub fn start(&mut self, dev_id: u32) -> io::Result<()> {
        self.simple(CMD_START_DEV, dev_id, std::process::id() as u64)
    }

    /// START_USER_RECOVERY: EBUSY until the dead server's files are closed and the device is
    /// quiesced.
    pub fn start_recovery(&mut self, dev_id: u32) -> io::Result<()> {
        self.simple(CMD_START_USER_RECOVERY, dev_id, 0)
    }

    /// END_USER_RECOVERY: this process serves the device; returns once its queues fetched.
    pub fn end_recovery(&mut self, dev_id: u32) -> io::Result<()> {
        self.simple(CMD_END_USER_RECOVERY, dev_id, std::process::id() as u64)
    }

    pub fn stop(&mut self, dev_id: u32) -> io::Result<()> {
        self.simple(CMD_STOP_DEV, dev_id, 0)
    }

    pub fn delete(&mut self, dev_id: u32) -> io::Result<()> {
        self.simple(CMD_DEL_DEV, dev_id, 0)
    }
}

/// One request fetched from a queue, held by the server until [`Queue::commit`] takes it
/// back: it may be served on any thread (it is `Send`), its buffer reached only through it.
/// Not `Clone`: one value a fetched tag, so a tag's buffer has one user at a time.
pub struct Request {
    pub tag: u16,
    pub op: u8,
    pub offset: u64,
    pub len: usize,
    buffers: Arc<Mapping>,
    max_io: usize,
}

impl std::fmt::Debug for Request {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Request")
            .field("tag", &self.tag)
            .field("op", &self.op)
            .field("offset", &self.offset)
            .field("len", &self.len)
            .finish_non_exhaustive()
    }
}

impl Request {
    /// The request's buffer: a write's data, or where a read's goes.
    pub fn buffer(&mut self) -> &mut [u8] {
        let len = self.len.min(self.max_io);
        // In bounds: tag < depth (checked when fetched), the buffers are depth * max_io bytes.
        let at = self
            .buffers
            .ptr
            .as_ptr()
            .wrapping_add(self.tag as usize * self.max_io);
        // SAFETY: tag's buffer is `max_io` bytes inside the mapping, which this request keeps
        // alive (the Arc). While the server holds the tag no command of the ring names it, so
        // the kernel does not touch it; the only value that reaches it is this request (one a
        // fetch, not Clone), and the slice borrows it mutably: nothing aliases it until the
        // request is given back to `commit`.
        unsafe { std::slice::from_raw_parts_mut(at, len) }
    }
}

/// What a queue's next completion was.
#[derive(Debug)]
pub enum Fetched {
    /// A request to serve, then [`Queue::commit`].
    Request(Request),
    /// The queue's waker was woken (a request served elsewhere may be ready to commit).
    Woken,
    /// The device is going away (stopped, or deleted): the queue's commands are done.
    Aborted,
}

/// An eventfd another thread writes to wake the queue's thread, whose ring polls it.
#[derive(Debug)]
pub struct Waker {
    fd: std::os::fd::OwnedFd,
}

impl Waker {
    fn new() -> io::Result<Self> {
        // SAFETY: eventfd takes an initial count and flags, and touches no memory of ours.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` is a new descriptor that nothing else owns.
        let fd = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
        Ok(Self { fd })
    }

    /// Wakes the queue's thread (adds one to the count; never blocks).
    pub fn wake(&self) {
        let one: u64 = 1;
        // SAFETY: writes the 8 bytes of a live u64 to our eventfd. Its one failure, EAGAIN
        // (the count at its maximum), leaves the poll ready: the wake is not lost.
        let _ = unsafe {
            libc::write(
                self.fd.as_raw_fd(),
                (&one as *const u64).cast::<libc::c_void>(),
                8,
            )
        };
    }

    /// Resets the count to zero (EAGAIN when it was already zero: nothing to take).
    fn take(&self) {
        let mut count: u64 = 0;
        // SAFETY: reads 8 bytes into a live u64 from our non-blocking eventfd.
        let _ = unsafe {
            libc::read(
                self.fd.as_raw_fd(),
                (&mut count as *mut u64).cast::<libc::c_void>(),
                8,
            )
        };
    }
}

/// A region of memory mapped with mmap, unmapped on drop.
struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is plain memory, not tied to a thread. Its bytes are reached only
// through the queue (the descriptors, read-only) and through a held request's buffer (one
// value a tag, see `Request::buffer`): sharing the pointer among threads shares no bytes.
unsafe impl Send for Mapping {}
// SAFETY: as above; `&Mapping` gives no access to the bytes by itself.
unsafe impl Sync for Mapping {}

impl Mapping {
    fn map(len: usize, prot: i32, flags: i32, fd: i32, offset: i64) -> io::Result<Self> {
        // SAFETY: a new mapping (no address asked for), of `len` bytes, that no Rust object
        // aliases; it is unmapped only when this value drops.
        let ptr = unsafe { libc::mmap(std::ptr::null_mut(), len, prot, flags, fd, offset) };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let ptr = NonNull::new(ptr as *mut u8).ok_or_else(|| io::Error::other("mmap gave null"))?;
        Ok(Self { ptr, len })
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: the mapping is this value's own, made by `map` with this length; no slice
        // into it outlives the value (a slice borrows a request, which holds the mapping's
        // Arc; the descriptors' reads are copies).
        unsafe { libc::munmap(self.ptr.as_ptr() as *mut libc::c_void, self.len) };
    }
}

/// Queue 0 of a device: `/dev/ublkcN`, the descriptors the driver writes, one buffer per
/// request tag, and a ring on which every tag has a fetch (or commit-and-fetch) pending while
/// the server does not hold it, and a poll of the waker's eventfd.
pub struct Queue {
    ring: IoUring,
    // Kept open while the ring's commands refer to it.
    cdev: File,
    descs: Mapping,
    // Shared with the requests held (the last one out unmaps it).
    buffers: Arc<Mapping>,
    waker: Arc<Waker>,
    depth: u16,
    max_io: usize,
}

/// The user data of the waker's poll (a tag's is the tag, < 4096).
const WAKER: u64 = u64::MAX;

impl std::fmt::Debug for Queue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Queue")
            .field("depth", &self.depth)
            .finish_non_exhaustive()
    }
}

// SAFETY: the mappings are owned by the queue, which one thread at a time uses (it is moved
// to the thread that serves it); nothing else refers to them.
unsafe impl Send for Queue {}

fn page_round(n: usize) -> usize {
    let page = 4096;
    n.div_ceil(page) * page
}

impl Queue {
    /// Opens device `dev_id`'s char device, maps its descriptors and the buffers, and sends a
    /// fetch for every tag.
    pub fn open(dev_id: u32, depth: u16, max_io: u32) -> io::Result<Self> {
        let path = format!("/dev/ublkc{dev_id}");
        let cdev = OpenOptions::new().read(true).write(true).open(&path)?;
        let descs_len = page_round(depth as usize * std::mem::size_of::<IoDesc>());
        let descs = Mapping::map(
            descs_len,
            libc::PROT_READ,
            libc::MAP_SHARED | libc::MAP_POPULATE,
            cdev.as_raw_fd(),
            0,
        )?;
        let max_io = max_io as usize;
        let buffers = Mapping::map(
            depth as usize * max_io,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )?;
        let ring = IoUring::new(depth as u32 * 2)?;
        let mut q = Self {
            ring,
            cdev,
            descs,
            buffers: Arc::new(buffers),
            waker: Arc::new(Waker::new()?),
            depth,
            max_io,
        };
        for tag in 0..depth {
            q.push(IO_FETCH_REQ, tag, -1)?;
        }
        q.poll_waker()?;
        q.ring.submit()?;
        Ok(q)
    }

    /// What wakes this queue's thread from another.
    pub fn waker(&self) -> Arc<Waker> {
        Arc::clone(&self.waker)
    }

    /// A one-shot poll of the waker's eventfd (no memory of ours is named).
    fn poll_waker(&mut self) -> io::Result<()> {
        let entry = opcode::PollAdd::new(types::Fd(self.waker.fd.as_raw_fd()), libc::POLLIN as u32)
            .build()
            .user_data(WAKER);
        // SAFETY: a poll names only the eventfd, which the queue keeps open as long as the ring.
        unsafe { self.ring.submission().push(&entry) }
            .map_err(|_| io::Error::other("the queue's ring is full"))
    }

    fn buffer_ptr(&self, tag: u16) -> *mut u8 {
        // In bounds: tag < depth, the buffers are depth * max_io bytes.
        self.buffers
            .ptr
            .as_ptr()
            .wrapping_add(tag as usize * self.max_io)
    }

    fn push(&mut self, op: u32, tag: u16, result: i32) -> io::Result<()> {
        let cmd = IoCmd {
            q_id: 0,
            tag,
            result,
            addr: self.buffer_ptr(tag) as u64,
        };
        let entry = opcode::UringCmd16::new(types::Fd(self.cdev.as_raw_fd()), op)
            .cmd(bytes(&cmd))
            .build()
            .user_data(tag as u64);
        // SAFETY: the command names tag's buffer, which lives in `self.buffers` as long as the
        // queue (and so the ring) does; the server does not touch it until the command's
        // completion hands the tag back.
        unsafe { self.ring.submission().push(&entry) }
            .map_err(|_| io::Error::other("the queue's ring is full"))
    }

    /// Sends the commits pushed so far, then waits for the next request, a wake, or the
    /// queue's end.
    pub fn next(&mut self) -> io::Result<Fetched> {
        if !self.ring.submission().is_empty() {
            self.ring.submit()?;
        }
        loop {
            let next = self.ring.completion().next();
            if let Some(cqe) = next {
                if cqe.user_data() == WAKER {
                    // Taken before the caller looks for what woke it: a wake after this one
                    // completes the next poll.
                    self.waker.take();
                    self.poll_waker()?;
                    return Ok(Fetched::Woken);
                }
                let tag = cqe.user_data() as u16;
                let res = cqe.result();
                if res == IO_RES_ABORT {
                    return Ok(Fetched::Aborted);
                }
                if res < 0 {
                    return Err(io::Error::from_raw_os_error(-res));
                }
                if tag >= self.depth {
                    return Err(io::Error::other(format!("a completion for tag {tag}")));
                }
                // In bounds: tag < depth, and the descriptors are (at least) depth of them.
                let at = (self.descs.ptr.as_ptr() as *const IoDesc).wrapping_add(tag as usize);
                // SAFETY: `at` is tag's descriptor in a read-only shared mapping the queue
                // owns, aligned (the mapping is page-aligned, a descriptor 24 bytes of u32 and
                // u64); the driver wrote it before completing the tag's fetch and does not
                // change it until the tag is committed: a volatile read of a Copy value.
                let desc = unsafe { std::ptr::read_volatile(at) };
                return Ok(Fetched::Request(Request {
                    tag,
                    op: (desc.op_flags & 0xff) as u8,
                    offset: desc.start_sector << 9,
                    len: (desc.nr_sectors as usize) << 9,
                    buffers: Arc::clone(&self.buffers),
                    max_io: self.max_io,
                }));
            }
            match self.ring.submit_and_wait(1) {
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
    }

    /// Answers the request (`result`: bytes done, or -errno) and fetches the tag's next; sent
    /// with the next [`next`](Self::next). Takes the request back: its buffer is the
    /// kernel's again.
    pub fn commit(&mut self, req: Request, result: i32) -> io::Result<()> {
        self.push(IO_COMMIT_AND_FETCH_REQ, req.tag, result)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The driver reads these structs by their C sizes, and decodes the commands' numbers.
    #[test]
    fn the_uapi_layout() {
        assert_eq!(std::mem::size_of::<CtrlCmd>(), 32);
        assert_eq!(std::mem::size_of::<DevInfo>(), 64);
        assert_eq!(std::mem::size_of::<IoDesc>(), 24);
        assert_eq!(std::mem::size_of::<IoCmd>(), 16);
        // The header and the basic parameters.
        assert_eq!(std::mem::size_of::<Params>(), 8 + 32);
        assert_eq!(CMD_ADD_DEV, 0xc020_7504);
        assert_eq!(CMD_START_USER_RECOVERY, 0xc020_7510);
        assert_eq!(CMD_END_USER_RECOVERY, 0xc020_7511);
        assert_eq!(IO_FETCH_REQ, 0xc010_7520);
        assert_eq!(IO_COMMIT_AND_FETCH_REQ, 0xc010_7521);
    }
}
