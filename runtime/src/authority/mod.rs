//! Any `:authority` a Unix-socket client sends is served.
//!
//! Over a Unix socket the HTTP/2 `:authority` names nothing, and clients fill it as they
//! please: grpc-go dialing a bare socket path (kubelet's plugin watcher does, for the
//! registration socket) sends the path, `/var/lib/kubelet/plugins_registry/...`; gRPC core
//! sends the path percent-encoded; others send `localhost` or nothing. The HTTP/2 server under
//! tonic (h2) parses `:authority` as a URI authority and answers one it cannot parse with
//! `RST_STREAM(PROTOCOL_ERROR)` before the request reaches any service, and it has no setting to
//! accept it.
//!
//! [`AuthorityFix`] sits between the socket and the server and rewrites the request headers the
//! client sends: each header block (a HEADERS frame and its CONTINUATIONs) is HPACK-decoded with
//! the client's compression state ([`hpack`], which reads by the server's rules), an `:authority` the server would refuse becomes
//! [`REPLACEMENT`], and the block is encoded again without compression state (every field a
//! literal that is never indexed), so the server's HPACK state never depends on the client's.
//! Every other frame, and everything the server sends, passes through untouched. A stream that
//! does not open with the HTTP/2 connection preface is passed through as it is (the server
//! refuses it). A header block that is malformed (bad padding, HPACK it cannot decode,
//! interleaved frames, too large) ends the connection with an error, as the server would.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

pub mod hpack;

/// The `:authority` put in place of one the server would refuse.
pub const REPLACEMENT: &[u8] = b"localhost";

/// The HTTP/2 client connection preface.
const PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// A frame header's length.
const FRAME_HEADER: usize = 9;
/// Frame types and flags (RFC 9113 section 6).
const HEADERS: u8 = 0x1;
const CONTINUATION: u8 = 0x9;
const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const PADDED: u8 = 0x8;
const PRIORITY: u8 = 0x20;
/// The largest frame every HTTP/2 peer accepts (SETTINGS_MAX_FRAME_SIZE's initial value; the
/// server announces no larger one): the largest header frame read, and written.
const MAX_FRAME: usize = 16_384;
/// The largest header block (all its fragments) taken.
const MAX_BLOCK: usize = 1 << 20;
/// The largest decoded header list taken (HPACK sizes: name, value and 32 per field).
const MAX_HEADER_LIST: usize = 1 << 20;
/// The HPACK dynamic table size clients may use: SETTINGS_HEADER_TABLE_SIZE's initial value;
/// the server announces no other.
const TABLE_SIZE: usize = 4096;
/// How much is read from the socket at once.
const READ_CHUNK: usize = 16 * 1024;

/// Why a client's header block was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum Malformed {
    /// A header frame larger than the server accepts.
    #[error("header frame of {0} bytes (at most {MAX_FRAME})")]
    FrameTooLarge(usize),
    /// Padding or priority fields that do not fit the frame.
    #[error("header frame on stream {0} with malformed padding or priority")]
    Padding(u32),
    /// A frame other than the CONTINUATION of an unfinished header block.
    #[error("frame of type {kind:#x} on stream {stream} inside the header block of stream {open}")]
    Interleaved {
        /// The frame's type.
        kind: u8,
        /// Its stream.
        stream: u32,
        /// The stream whose header block is open.
        open: u32,
    },
    /// A CONTINUATION with no header block open.
    #[error("CONTINUATION on stream {0} outside a header block")]
    StrayContinuation(u32),
    /// A header block larger than [`MAX_BLOCK`] or decoding to more than [`MAX_HEADER_LIST`].
    #[error("header block on stream {0} too large")]
    BlockTooLarge(u32),
    /// HPACK that cannot be decoded.
    #[error("header block on stream {stream}: {reason}")]
    Hpack {
        /// The stream.
        stream: u32,
        /// The decoder's reason.
        reason: hpack::HpackError,
    },
}

/// Whether the server (h2) takes `value` as an `:authority`.
pub fn acceptable(value: &[u8]) -> bool {
    http::uri::Authority::try_from(value).is_ok()
}

/// Where the reader of the client's bytes is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    /// Matching the connection preface.
    Preface,
    /// At a frame header.
    Frames,
    /// Inside a frame passed through: this many payload bytes to go.
    Payload(usize),
    /// Not HTTP/2 with prior knowledge: everything passes through.
    Raw,
}

/// A header block being gathered.
#[derive(Debug)]
struct Block {
    stream: u32,
    end_stream: bool,
    priority: Option<[u8; 5]>,
    fragment: Vec<u8>,
}

/// The client-to-server byte stream's rewriter: bytes go in with [`Rewriter::feed`], rewritten
/// bytes come out of [`Rewriter::output`].
pub struct Rewriter {
    input: Vec<u8>,
    output: Vec<u8>,
    stage: Stage,
    block: Option<Block>,
    decoder: hpack::Decoder,
    replaced: Option<Vec<u8>>,
}

impl std::fmt::Debug for Rewriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rewriter")
            .field("stage", &self.stage)
            .field("buffered", &self.input.len())
            .field("ready", &self.output.len())
            .field("block", &self.block)
            .finish_non_exhaustive()
    }
}

impl Default for Rewriter {
    fn default() -> Self {
        Self::new()
    }
}

impl Rewriter {
    /// A rewriter at the start of a connection.
    pub fn new() -> Self {
        Self {
            input: Vec::new(),
            output: Vec::new(),
            stage: Stage::Preface,
            block: None,
            decoder: hpack::Decoder::new(TABLE_SIZE),
            replaced: None,
        }
    }

    /// Takes bytes the client sent and rewrites what can be.
    pub fn feed(&mut self, bytes: &[u8]) -> Result<(), Malformed> {
        self.input.extend_from_slice(bytes);
        self.process()
    }

    /// The rewritten bytes ready for the server; the caller drains what it takes.
    pub fn output(&mut self) -> &mut Vec<u8> {
        &mut self.output
    }

    /// The last `:authority` replaced, once (for a log line).
    pub fn take_replaced(&mut self) -> Option<Vec<u8>> {
        self.replaced.take()
    }

    fn process(&mut self) -> Result<(), Malformed> {
        let mut at = 0;
        let r = self.process_from(&mut at);
        self.input.drain(..at);
        r
    }

    fn process_from(&mut self, at: &mut usize) -> Result<(), Malformed> {
        loop {
            let rest = self.input.get(*at..).unwrap_or_default();
            match self.stage {
                Stage::Raw => {
                    self.output.extend_from_slice(rest);
                    *at = self.input.len();
                    return Ok(());
                }
                Stage::Preface => {
                    let n = rest.len().min(PREFACE.len());
                    if rest.get(..n) != PREFACE.get(..n) {
                        self.stage = Stage::Raw;
                        continue;
                    }
                    if n < PREFACE.len() {
                        return Ok(());
                    }
                    self.output.extend_from_slice(PREFACE);
                    *at += n;
                    self.stage = Stage::Frames;
                }
                Stage::Payload(left) => {
                    if rest.is_empty() {
                        return Ok(());
                    }
                    let n = rest.len().min(left);
                    self.output
                        .extend_from_slice(rest.get(..n).unwrap_or_default());
                    *at += n;
                    self.stage = if n == left {
                        Stage::Frames
                    } else {
                        Stage::Payload(left - n)
                    };
                }
                Stage::Frames => {
                    let Some(head) = rest.get(..FRAME_HEADER) else {
                        return Ok(());
                    };
                    let len = (usize::from(head[0]) << 16)
                        | (usize::from(head[1]) << 8)
                        | usize::from(head[2]);
                    let (kind, flags) = (head[3], head[4]);
                    let stream =
                        u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff;
                    if let Some(open) = &self.block
                        && (kind != CONTINUATION || stream != open.stream)
                    {
                        return Err(Malformed::Interleaved {
                            kind,
                            stream,
                            open: open.stream,
                        });
                    }
                    if kind != HEADERS && kind != CONTINUATION {
                        self.output.extend_from_slice(head);
                        *at += FRAME_HEADER;
                        self.stage = Stage::Payload(len);
                        continue;
                    }
                    if len > MAX_FRAME {
                        return Err(Malformed::FrameTooLarge(len));
                    }
                    let Some(payload) = rest.get(FRAME_HEADER..FRAME_HEADER + len) else {
                        return Ok(());
                    };
                    if kind == HEADERS {
                        let (priority, fragment) = split_headers_payload(flags, payload)
                            .ok_or(Malformed::Padding(stream))?;
                        self.block = Some(Block {
                            stream,
                            end_stream: flags & END_STREAM != 0,
                            priority,
                            fragment: fragment.to_vec(),
                        });
                    } else {
                        let block = self
                            .block
                            .as_mut()
                            .ok_or(Malformed::StrayContinuation(stream))?;
                        if block.fragment.len() + payload.len() > MAX_BLOCK {
                            return Err(Malformed::BlockTooLarge(stream));
                        }
                        block.fragment.extend_from_slice(payload);
                    }
                    *at += FRAME_HEADER + len;
                    if flags & END_HEADERS != 0
                        && let Some(block) = self.block.take()
                    {
                        self.rewrite(block)?;
                    }
                }
            }
        }
    }

    /// Decodes a whole header block, replaces a refused `:authority`, writes it out again.
    fn rewrite(&mut self, block: Block) -> Result<(), Malformed> {
        let mut encoded = Vec::with_capacity(block.fragment.len() + 64);
        let mut size = 0usize;
        let replaced = &mut self.replaced;
        self.decoder
            .decode(&block.fragment, |name, value| {
                size = size.saturating_add(name.len() + value.len() + 32);
                if size > MAX_HEADER_LIST {
                    return;
                }
                let value = if name == b":authority" && !acceptable(value) {
                    *replaced = Some(value.to_vec());
                    REPLACEMENT
                } else {
                    value
                };
                encode_field(&mut encoded, name, value);
            })
            .map_err(|reason| Malformed::Hpack {
                stream: block.stream,
                reason,
            })?;
        if size > MAX_HEADER_LIST {
            return Err(Malformed::BlockTooLarge(block.stream));
        }
        write_header_frames(&mut self.output, &block, &encoded);
        Ok(())
    }
}

/// A HEADERS payload without its padding: the priority fields, if flagged, and the fragment.
fn split_headers_payload(flags: u8, payload: &[u8]) -> Option<(Option<[u8; 5]>, &[u8])> {
    let mut body = payload;
    let mut pad = 0usize;
    if flags & PADDED != 0 {
        let (&n, rest) = body.split_first()?;
        pad = usize::from(n);
        body = rest;
    }
    let mut priority = None;
    if flags & PRIORITY != 0 {
        let (fields, rest) = body.split_first_chunk::<5>()?;
        priority = Some(*fields);
        body = rest;
    }
    let end = body.len().checked_sub(pad)?;
    Some((priority, body.get(..end)?))
}

/// An HPACK integer with an `n`-bit prefix after the `first` byte's high bits.
fn encode_integer(out: &mut Vec<u8>, first: u8, n: u32, value: usize) {
    let max = (1usize << n) - 1;
    if value < max {
        out.push(first | value as u8);
        return;
    }
    out.push(first | max as u8);
    let mut rest = value - max;
    while rest >= 128 {
        out.push((rest % 128) as u8 | 0x80);
        rest /= 128;
    }
    out.push(rest as u8);
}

/// An HPACK string literal, not Huffman-coded.
fn encode_string(out: &mut Vec<u8>, s: &[u8]) {
    encode_integer(out, 0, 7, s.len());
    out.extend_from_slice(s);
}

/// A field as a literal with a literal name, never indexed: it touches no HPACK table.
fn encode_field(out: &mut Vec<u8>, name: &[u8], value: &[u8]) {
    out.push(0x10);
    encode_string(out, name);
    encode_string(out, value);
}

fn frame_header(out: &mut Vec<u8>, len: usize, kind: u8, flags: u8, stream: u32) {
    out.extend_from_slice(&[(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags]);
    out.extend_from_slice(&stream.to_be_bytes());
}

/// A HEADERS frame (with the block's priority fields and END_STREAM), then CONTINUATIONs,
/// none larger than [`MAX_FRAME`].
fn write_header_frames(out: &mut Vec<u8>, block: &Block, encoded: &[u8]) {
    let prio_len = block.priority.map_or(0, |p| p.len());
    let first_room = MAX_FRAME - prio_len;
    let (first, mut rest) = encoded.split_at(encoded.len().min(first_room));
    let mut flags = 0;
    if block.end_stream {
        flags |= END_STREAM;
    }
    if block.priority.is_some() {
        flags |= PRIORITY;
    }
    if rest.is_empty() {
        flags |= END_HEADERS;
    }
    frame_header(out, prio_len + first.len(), HEADERS, flags, block.stream);
    if let Some(p) = block.priority {
        out.extend_from_slice(&p);
    }
    out.extend_from_slice(first);
    while !rest.is_empty() {
        let (chunk, after) = rest.split_at(rest.len().min(MAX_FRAME));
        let flags = if after.is_empty() { END_HEADERS } else { 0 };
        frame_header(out, chunk.len(), CONTINUATION, flags, block.stream);
        out.extend_from_slice(chunk);
        rest = after;
    }
}

/// A connection whose client-sent header blocks pass through a [`Rewriter`]; writes pass
/// through untouched.
#[derive(Debug)]
pub struct AuthorityFix<S> {
    inner: S,
    rewriter: Rewriter,
    /// How much of the rewriter's output the server has taken.
    taken: usize,
    eof: bool,
}

impl<S> AuthorityFix<S> {
    /// Wraps an accepted connection.
    pub fn new(inner: S) -> Self {
        Self {
            inner,
            rewriter: Rewriter::new(),
            taken: 0,
            eof: false,
        }
    }
}

impl<S: tonic::transport::server::Connected> tonic::transport::server::Connected
    for AuthorityFix<S>
{
    type ConnectInfo = S::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.inner.connect_info()
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for AuthorityFix<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        loop {
            let out = this.rewriter.output();
            if this.taken < out.len() {
                let chunk = out.get(this.taken..).unwrap_or_default();
                let n = chunk.len().min(buf.remaining());
                buf.put_slice(chunk.get(..n).unwrap_or_default());
                this.taken += n;
                if this.taken == out.len() {
                    out.clear();
                    this.taken = 0;
                }
                return Poll::Ready(Ok(()));
            }
            if this.eof {
                return Poll::Ready(Ok(()));
            }
            let mut chunk = [0u8; READ_CHUNK];
            let mut read = ReadBuf::new(&mut chunk);
            ready!(Pin::new(&mut this.inner).poll_read(cx, &mut read))?;
            if read.filled().is_empty() {
                this.eof = true;
                continue;
            }
            if let Err(e) = this.rewriter.feed(read.filled()) {
                tracing::warn!(error = %e, "malformed HTTP/2 from a client: closing its connection");
                return Poll::Ready(Err(io::Error::new(io::ErrorKind::InvalidData, e)));
            }
            if let Some(was) = this.rewriter.take_replaced() {
                tracing::debug!(
                    authority = %String::from_utf8_lossy(&was),
                    "a client's :authority replaced (Unix sockets have none)"
                );
            }
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for AuthorityFix<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests;
