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
//! the client's compression state, an `:authority` the server would refuse becomes
//! [`REPLACEMENT`], and the block is encoded again without compression state (every field a
//! literal that is never indexed), so the server's HPACK state never depends on the client's.
//! Every other frame, and everything the server sends, passes through untouched. A stream that
//! does not open with the HTTP/2 connection preface is passed through as it is (the server
//! refuses it). A header block that is malformed (bad padding, HPACK it cannot decode,
//! interleaved frames, too large) ends the connection with an error, as the server would.

use std::borrow::Cow;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

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
        reason: String,
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
    decoder: loona_hpack::Decoder<'static>,
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
        let mut decoder = loona_hpack::Decoder::new();
        decoder.set_max_allowed_table_size(TABLE_SIZE);
        Self {
            input: Vec::new(),
            output: Vec::new(),
            stage: Stage::Preface,
            block: None,
            decoder,
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
        let mut fields: Vec<(Vec<u8>, Vec<u8>)> = Vec::new();
        let mut size = 0usize;
        self.decoder
            .decode_with_cb(
                &block.fragment,
                |name: Cow<'_, [u8]>, value: Cow<'_, [u8]>| {
                    size = size.saturating_add(name.len() + value.len() + 32);
                    if size <= MAX_HEADER_LIST {
                        fields.push((name.into_owned(), value.into_owned()));
                    }
                },
            )
            .map_err(|e| Malformed::Hpack {
                stream: block.stream,
                reason: e.to_string(),
            })?;
        if size > MAX_HEADER_LIST {
            return Err(Malformed::BlockTooLarge(block.stream));
        }
        let mut encoded = Vec::with_capacity(block.fragment.len() + 64);
        for (name, value) in &fields {
            let value = if name.as_slice() == b":authority" && !acceptable(value) {
                self.replaced = Some(value.clone());
                REPLACEMENT
            } else {
                value.as_slice()
            };
            encode_field(&mut encoded, name, value);
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

impl<S: tonic::transport::server::Connected> tonic::transport::server::Connected
    for AuthorityFix<S>
{
    type ConnectInfo = S::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.inner.connect_info()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PATH: &[u8] = b"/var/lib/kubelet/plugins_registry/moor.csi.io-reg.sock";

    fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
        let mut f = Vec::new();
        frame_header(&mut f, payload.len(), kind, flags, stream);
        f.extend_from_slice(payload);
        f
    }

    /// A request header block as grpc-go encodes its first one: `:authority` a literal with
    /// incremental indexing (it becomes dynamic entry 62), the rest literals.
    fn first_request_block(authority: &[u8]) -> Vec<u8> {
        let mut b = vec![0x83, 0x86]; // :method POST, :scheme http
        encode_integer(&mut b, 0x00, 4, 4); // :path, literal name index 4
        encode_string(&mut b, b"/pluginregistration.Registration/GetInfo");
        b.push(0x41); // :authority, incremental indexing, name index 1
        encode_string(&mut b, authority);
        encode_integer(&mut b, 0x00, 4, 31); // content-type
        encode_string(&mut b, b"application/grpc");
        b.push(0x00);
        encode_string(&mut b, b"te");
        encode_string(&mut b, b"trailers");
        b
    }

    /// A later request on the same connection: `:authority` is dynamic entry 62.
    fn next_request_block() -> Vec<u8> {
        let mut b = vec![0x83, 0x86];
        encode_integer(&mut b, 0x00, 4, 4);
        encode_string(
            &mut b,
            b"/pluginregistration.Registration/NotifyRegistrationStatus",
        );
        b.push(0x80 | 62);
        b
    }

    struct Frame {
        kind: u8,
        flags: u8,
        stream: u32,
        payload: Vec<u8>,
    }

    fn frames(mut bytes: &[u8]) -> Vec<Frame> {
        assert_eq!(
            bytes.get(..24),
            Some(&PREFACE[..]),
            "the preface goes first"
        );
        bytes = &bytes[24..];
        let mut out = Vec::new();
        while !bytes.is_empty() {
            let len = (usize::from(bytes[0]) << 16)
                | (usize::from(bytes[1]) << 8)
                | usize::from(bytes[2]);
            out.push(Frame {
                kind: bytes[3],
                flags: bytes[4],
                stream: u32::from_be_bytes([bytes[5], bytes[6], bytes[7], bytes[8]]),
                payload: bytes[9..9 + len].to_vec(),
            });
            bytes = &bytes[9 + len..];
        }
        out
    }

    /// The header lists the server decodes from the rewritten frames, with the frame sizes.
    fn server_view(out: &[u8]) -> Vec<Vec<(String, String)>> {
        let mut dec = loona_hpack::Decoder::new();
        let mut lists = Vec::new();
        let mut block: Vec<u8> = Vec::new();
        for f in frames(out) {
            if f.kind == HEADERS || f.kind == CONTINUATION {
                assert!(f.payload.len() <= MAX_FRAME);
                let (_, frag) = if f.kind == HEADERS {
                    split_headers_payload(f.flags, &f.payload).expect("well formed")
                } else {
                    (None, &f.payload[..])
                };
                block.extend_from_slice(frag);
                if f.flags & END_HEADERS != 0 {
                    let list = dec.decode(&block).expect("the server decodes it");
                    lists.push(
                        list.into_iter()
                            .map(|(n, v)| {
                                (String::from_utf8(n).unwrap(), String::from_utf8(v).unwrap())
                            })
                            .collect(),
                    );
                    block.clear();
                }
            }
        }
        lists
    }

    fn authority_of(list: &[(String, String)]) -> Option<&str> {
        list.iter()
            .find(|(n, _)| n == ":authority")
            .map(|(_, v)| v.as_str())
    }

    fn rewrite_all(input: &[u8]) -> Result<Vec<u8>, Malformed> {
        let mut r = Rewriter::new();
        r.feed(input)?;
        Ok(std::mem::take(r.output()))
    }

    #[test]
    fn the_server_refuses_what_unix_socket_clients_send() {
        for refused in [PATH, b"%2Fvar%2Flib%2Fx.sock".as_slice(), b"", b"a b"] {
            assert!(
                !acceptable(refused),
                "{:?}",
                String::from_utf8_lossy(refused)
            );
        }
        for taken in [
            b"localhost".as_slice(),
            b"moor.invalid",
            b"127.0.0.1:9",
            b"[::1]:1",
        ] {
            assert!(acceptable(taken), "{:?}", String::from_utf8_lossy(taken));
        }
        assert!(acceptable(REPLACEMENT));
    }

    #[test]
    fn a_path_authority_becomes_localhost_and_the_rest_is_kept() {
        let settings = frame(0x4, 0, 0, &[0, 3, 0, 0, 0, 100]);
        let data = frame(0x0, END_STREAM, 1, &[0, 0, 0, 0, 0]);
        let data3 = frame(0x0, END_STREAM, 3, &[0, 0, 0, 0, 2, 8, 1]);
        let mut input = PREFACE.to_vec();
        input.extend(&settings);
        input.extend(frame(HEADERS, END_HEADERS, 1, &first_request_block(PATH)));
        input.extend(&data);
        // The second request names the authority by its dynamic table index.
        input.extend(frame(HEADERS, END_HEADERS, 3, &next_request_block()));
        input.extend(&data3);
        let out = rewrite_all(&input).unwrap();
        let lists = server_view(&out);
        assert_eq!(lists.len(), 2);
        assert_eq!(authority_of(&lists[0]), Some("localhost"));
        assert_eq!(authority_of(&lists[1]), Some("localhost"));
        let names: Vec<&str> = lists[0].iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            [
                ":method",
                ":scheme",
                ":path",
                ":authority",
                "content-type",
                "te"
            ]
        );
        assert_eq!(lists[0][2].1, "/pluginregistration.Registration/GetInfo");
        assert_eq!(lists[0][4].1, "application/grpc");
        assert_eq!(
            lists[1][2].1,
            "/pluginregistration.Registration/NotifyRegistrationStatus"
        );
        // Every other frame goes through byte for byte, in order.
        let fs = frames(&out);
        let kinds: Vec<(u8, u32)> = fs.iter().map(|f| (f.kind, f.stream)).collect();
        assert_eq!(kinds, [(4, 0), (HEADERS, 1), (0, 1), (HEADERS, 3), (0, 3)]);
        assert_eq!(frame(fs[0].kind, fs[0].flags, 0, &fs[0].payload), settings);
        assert_eq!(frame(fs[2].kind, fs[2].flags, 1, &fs[2].payload), data);
        assert_eq!(frame(fs[4].kind, fs[4].flags, 3, &fs[4].payload), data3);
        // Fed a byte at a time, the output is the same.
        let mut r = Rewriter::new();
        for b in &input {
            r.feed(std::slice::from_ref(b)).unwrap();
        }
        assert_eq!(*r.output(), out);
    }

    #[test]
    fn an_authority_the_server_takes_is_kept() {
        let mut input = PREFACE.to_vec();
        input.extend(frame(
            HEADERS,
            END_HEADERS | END_STREAM,
            1,
            &first_request_block(b"moor.invalid"),
        ));
        let lists = server_view(&rewrite_all(&input).unwrap());
        assert_eq!(authority_of(&lists[0]), Some("moor.invalid"));
        // No :authority at all stays so.
        let mut input = PREFACE.to_vec();
        input.extend(frame(HEADERS, END_HEADERS, 1, &[0x83, 0x86, 0x84]));
        let lists = server_view(&rewrite_all(&input).unwrap());
        assert_eq!(authority_of(&lists[0]), None);
        assert_eq!(lists[0].len(), 3);
    }

    #[test]
    fn padding_priority_and_continuations_are_understood() {
        let block = first_request_block(b"");
        let (a, b) = block.split_at(10);
        let mut payload = vec![3u8]; // pad length
        payload.extend([0x80, 0, 0, 0, 16]); // exclusive dependency on 0, weight 16
        payload.extend(a);
        payload.extend([0, 0, 0]);
        let mut input = PREFACE.to_vec();
        input.extend(frame(HEADERS, PADDED | PRIORITY | END_STREAM, 5, &payload));
        input.extend(frame(CONTINUATION, END_HEADERS, 5, b));
        let out = rewrite_all(&input).unwrap();
        let fs = frames(&out);
        assert_eq!(fs.len(), 1);
        assert_eq!(fs[0].flags, PRIORITY | END_STREAM | END_HEADERS);
        assert_eq!(fs[0].payload[..5], [0x80, 0, 0, 0, 16]);
        assert_eq!(authority_of(&server_view(&out)[0]), Some("localhost"));
    }

    #[test]
    fn a_large_block_goes_out_in_frames_the_server_takes() {
        let mut block = first_request_block(PATH);
        for i in 0..400 {
            block.push(0x00);
            encode_string(&mut block, format!("x-big-{i}").as_bytes());
            encode_string(&mut block, &[b'v'; 100]);
        }
        let mut input = PREFACE.to_vec();
        let (a, rest) = block.split_at(MAX_FRAME);
        let (b, c) = rest.split_at(MAX_FRAME);
        input.extend(frame(HEADERS, 0, 1, a));
        input.extend(frame(CONTINUATION, 0, 1, b));
        input.extend(frame(CONTINUATION, END_HEADERS, 1, c));
        let out = rewrite_all(&input).unwrap();
        let fs = frames(&out);
        assert!(fs.len() >= 3);
        assert_eq!(fs[0].kind, HEADERS);
        assert!(fs[1..].iter().all(|f| f.kind == CONTINUATION));
        assert!(
            fs.iter()
                .enumerate()
                .all(|(i, f)| (f.flags & END_HEADERS != 0) == (i == fs.len() - 1))
        );
        let lists = server_view(&out);
        assert_eq!(lists[0].len(), 6 + 400);
        assert_eq!(authority_of(&lists[0]), Some("localhost"));
    }

    #[test]
    fn not_http2_passes_through() {
        let input = b"GET / HTTP/1.1\r\nHost: /x\r\n\r\n";
        assert_eq!(rewrite_all(input).unwrap(), input);
    }

    #[test]
    fn malformed_header_blocks_are_refused() {
        let with = |frames_in: &[Vec<u8>]| {
            let mut input = PREFACE.to_vec();
            for f in frames_in {
                input.extend(f);
            }
            rewrite_all(&input).expect_err("refused")
        };
        let block = first_request_block(PATH);
        assert_eq!(
            with(&[frame(HEADERS, 0, 1, &block), frame(0x0, 0, 1, b"x"),]),
            Malformed::Interleaved {
                kind: 0,
                stream: 1,
                open: 1
            }
        );
        assert_eq!(
            with(&[
                frame(HEADERS, 0, 1, &block),
                frame(CONTINUATION, END_HEADERS, 3, &[])
            ]),
            Malformed::Interleaved {
                kind: CONTINUATION,
                stream: 3,
                open: 1
            }
        );
        assert_eq!(
            with(&[frame(CONTINUATION, END_HEADERS, 1, &block)]),
            Malformed::StrayContinuation(1)
        );
        assert_eq!(
            with(&[frame(HEADERS, END_HEADERS | PADDED, 1, &[200, 0x83])]),
            Malformed::Padding(1)
        );
        assert_eq!(
            with(&[frame(HEADERS, END_HEADERS | PRIORITY, 1, &[0, 0])]),
            Malformed::Padding(1)
        );
        assert_eq!(
            with(&[frame(HEADERS, END_HEADERS, 1, &vec![0; MAX_FRAME + 1])]),
            Malformed::FrameTooLarge(MAX_FRAME + 1)
        );
        // Index 70: nothing in the dynamic table.
        assert!(matches!(
            with(&[frame(HEADERS, END_HEADERS, 1, &[0x80 | 70])]),
            Malformed::Hpack { stream: 1, .. }
        ));
        // A table larger than the server allows.
        assert!(matches!(
            with(&[frame(HEADERS, END_HEADERS, 1, &[0x3f, 0xe1, 0x3f, 0x83])]),
            Malformed::Hpack { stream: 1, .. }
        ));
        // A small block that decodes to a huge list (a 4 KB entry named again and again).
        let mut bomb = vec![0x40];
        encode_string(&mut bomb, b"x");
        encode_string(&mut bomb, &[b'v'; 4000]);
        let mut input = PREFACE.to_vec();
        input.extend(frame(HEADERS, END_HEADERS, 1, &bomb));
        let mut r = Rewriter::new();
        r.feed(&input).unwrap();
        assert_eq!(
            r.feed(&frame(HEADERS, END_HEADERS, 3, &vec![0x80 | 62; 300]))
                .expect_err("too large"),
            Malformed::BlockTooLarge(3)
        );
    }
}
