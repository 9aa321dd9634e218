//! A gRPC client that dials a Unix socket as grpc-go does when its target is the bare socket
//! path (kubelet's plugin watcher dials the registration socket so): the path goes out as the
//! HTTP/2 `:authority`. Built from raw HTTP/2 frames, since a Rust HTTP/2 client only sends an
//! authority that parses as one.
//!
//! As grpc-go's encoder does, the first request sends `:authority` as a literal that enters
//! the HPACK dynamic table, later requests on the connection name it by its index. Unary calls
//! only, one at a time.

use std::io::{Read as _, Write as _};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const DATA: u8 = 0x0;
const HEADERS: u8 = 0x1;
const RST_STREAM: u8 = 0x3;
const SETTINGS: u8 = 0x4;
const PING: u8 = 0x6;
const GOAWAY: u8 = 0x7;
const WINDOW_UPDATE: u8 = 0x8;
const CONTINUATION: u8 = 0x9;
const END_STREAM: u8 = 0x1;
const ACK: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const PADDED: u8 = 0x8;
const PRIORITY: u8 = 0x20;
/// How much DATA the connection takes before it gives the server that much window back (a
/// quarter of HTTP/2's initial window, as grpc-go does): without it, a long-lived connection
/// stalls once the server has sent 64 KiB of answers.
const WINDOW_RETURN: u32 = 16_384;

/// HTTP/2's PROTOCOL_ERROR code, which a server that refuses the request's headers resets the
/// stream with.
pub const PROTOCOL_ERROR: u32 = 0x1;

/// Why a call failed.
#[derive(Debug)]
pub enum CallError {
    /// The socket failed.
    Io(std::io::Error),
    /// The server reset the stream with this HTTP/2 error code.
    Reset(u32),
    /// The server ended the connection with this HTTP/2 error code.
    GoAway(u32),
    /// The server answered with a gRPC error.
    Status {
        /// The gRPC code.
        code: i32,
        /// Its message.
        message: String,
    },
    /// The answer is not what gRPC over HTTP/2 looks like.
    Protocol(String),
}

impl std::fmt::Display for CallError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Io(e) => write!(f, "socket: {e}"),
            Self::Reset(code) => write!(f, "stream reset with HTTP/2 error code {code}"),
            Self::GoAway(code) => write!(f, "connection ended with HTTP/2 error code {code}"),
            Self::Status { code, message } => write!(f, "gRPC status {code}: {message}"),
            Self::Protocol(why) => write!(f, "not a gRPC answer: {why}"),
        }
    }
}

impl std::error::Error for CallError {}

impl From<std::io::Error> for CallError {
    fn from(e: std::io::Error) -> Self {
        Self::Io(e)
    }
}

/// A connection to a gRPC server on a Unix socket, with a chosen `:authority`.
pub struct PathClient {
    stream: UnixStream,
    authority: Vec<u8>,
    authority_indexed: bool,
    next_stream: u32,
    decoder: loona_hpack::Decoder<'static>,
    /// DATA taken since the connection's window was last given back.
    unreturned: u32,
}

impl std::fmt::Debug for PathClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PathClient")
            .field("authority", &String::from_utf8_lossy(&self.authority))
            .field("next_stream", &self.next_stream)
            .finish_non_exhaustive()
    }
}

fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = payload.len();
    let mut f = vec![(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags];
    f.extend_from_slice(&stream.to_be_bytes());
    f.extend_from_slice(payload);
    f
}

fn integer(out: &mut Vec<u8>, first: u8, prefix_bits: u32, value: usize) {
    let max = (1usize << prefix_bits) - 1;
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

fn string(out: &mut Vec<u8>, s: &[u8]) {
    integer(out, 0, 7, s.len());
    out.extend_from_slice(s);
}

/// `%XX` escapes in a grpc-message decoded.
fn percent_decoded(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = b
            .get(i + 1..i + 3)
            .and_then(|h| std::str::from_utf8(h).ok())
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        match (b[i], hex) {
            (b'%', Some(v)) => {
                out.push(v);
                i += 3;
            }
            (c, _) => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

impl PathClient {
    /// Dials `socket` as grpc-go does with the bare path as its target: the path is the
    /// `:authority`.
    pub fn dial(socket: &Path) -> Result<Self, CallError> {
        Self::dial_with_authority(socket, socket.as_os_str().as_encoded_bytes())
    }

    /// Dials `socket` sending `authority` as the `:authority` (empty: an empty one).
    pub fn dial_with_authority(socket: &Path, authority: &[u8]) -> Result<Self, CallError> {
        let mut stream = UnixStream::connect(socket)?;
        // A bound on a server that never answers: a hang becomes a failure.
        stream.set_read_timeout(Some(Duration::from_secs(60)))?;
        let mut hello = PREFACE.to_vec();
        hello.extend(frame(SETTINGS, 0, 0, &[]));
        stream.write_all(&hello)?;
        Ok(Self {
            stream,
            authority: authority.to_vec(),
            authority_indexed: false,
            next_stream: 1,
            decoder: loona_hpack::Decoder::new(),
            unreturned: 0,
        })
    }

    /// Calls the unary method at `path` (`/package.Service/Method`).
    pub fn unary<Req: prost::Message, Resp: prost::Message + Default>(
        &mut self,
        path: &str,
        request: &Req,
    ) -> Result<Resp, CallError> {
        let id = self.next_stream;
        self.next_stream += 2;
        let mut block = vec![0x83, 0x86]; // :method POST, :scheme http (static table)
        integer(&mut block, 0x00, 4, 4); // :path, a literal with the static name
        string(&mut block, path.as_bytes());
        if self.authority_indexed {
            block.push(0x80 | 62); // the first (and only) dynamic table entry
        } else {
            block.push(0x41); // :authority, a literal entering the dynamic table
            string(&mut block, &self.authority);
            self.authority_indexed = true;
        }
        integer(&mut block, 0x00, 4, 31); // content-type
        string(&mut block, b"application/grpc");
        block.push(0x00);
        string(&mut block, b"te");
        string(&mut block, b"trailers");
        let message = request.encode_to_vec();
        let mut body = vec![0u8];
        body.extend_from_slice(&(message.len() as u32).to_be_bytes());
        body.extend_from_slice(&message);
        let mut out = frame(HEADERS, END_HEADERS, id, &block);
        out.extend(frame(DATA, END_STREAM, id, &body));
        self.stream.write_all(&out)?;
        let (fields, data) = self.answer(id)?;
        let field = |name: &str| {
            fields
                .iter()
                .rev()
                .find(|(n, _)| n == name)
                .map(|(_, v)| v.as_str())
        };
        let code: i32 = field("grpc-status")
            .ok_or_else(|| CallError::Protocol(format!("no grpc-status in {fields:?}")))?
            .parse()
            .map_err(|_| CallError::Protocol(format!("grpc-status in {fields:?}")))?;
        if code != 0 {
            return Err(CallError::Status {
                code,
                message: percent_decoded(field("grpc-message").unwrap_or_default()),
            });
        }
        let payload = data
            .get(5..)
            .ok_or_else(|| CallError::Protocol(format!("{} bytes of message", data.len())))?;
        Resp::decode(payload).map_err(|e| CallError::Protocol(e.to_string()))
    }

    /// Counts `len` bytes of DATA against the connection's window, and gives the window back
    /// once enough was taken.
    fn take_data(&mut self, len: usize) -> Result<(), CallError> {
        self.unreturned += u32::try_from(len).unwrap_or(u32::MAX);
        if self.unreturned >= WINDOW_RETURN {
            let increment = std::mem::take(&mut self.unreturned);
            self.stream
                .write_all(&frame(WINDOW_UPDATE, 0, 0, &increment.to_be_bytes()))?;
        }
        Ok(())
    }

    fn read_frame(&mut self) -> Result<(u8, u8, u32, Vec<u8>), CallError> {
        let mut head = [0u8; 9];
        self.stream.read_exact(&mut head)?;
        let len = (usize::from(head[0]) << 16) | (usize::from(head[1]) << 8) | usize::from(head[2]);
        let stream = u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff;
        let mut payload = vec![0u8; len];
        self.stream.read_exact(&mut payload)?;
        Ok((head[3], head[4], stream, payload))
    }

    /// Reads until stream `id` ends: every header field it got, and its DATA.
    #[allow(clippy::type_complexity)]
    fn answer(&mut self, id: u32) -> Result<(Vec<(String, String)>, Vec<u8>), CallError> {
        let mut fields = Vec::new();
        let mut data = Vec::new();
        let mut block: Vec<u8> = Vec::new();
        let mut ends_stream = false;
        loop {
            let (kind, flags, stream, payload) = self.read_frame()?;
            match kind {
                SETTINGS if flags & ACK == 0 => {
                    self.stream.write_all(&frame(SETTINGS, ACK, 0, &[]))?;
                }
                PING if flags & ACK == 0 => {
                    self.stream.write_all(&frame(PING, ACK, 0, &payload))?;
                }
                GOAWAY => {
                    let code = payload
                        .get(4..8)
                        .map_or(0, |c| u32::from_be_bytes([c[0], c[1], c[2], c[3]]));
                    return Err(CallError::GoAway(code));
                }
                RST_STREAM if stream == id => {
                    let code = payload
                        .get(..4)
                        .map_or(0, |c| u32::from_be_bytes([c[0], c[1], c[2], c[3]]));
                    return Err(CallError::Reset(code));
                }
                DATA => {
                    self.take_data(payload.len())?;
                    if stream != id {
                        continue;
                    }
                    data.extend_from_slice(&payload);
                    if flags & END_STREAM != 0 {
                        return Ok((fields, data));
                    }
                }
                HEADERS | CONTINUATION => {
                    let mut fragment = payload.as_slice();
                    if kind == HEADERS {
                        ends_stream = flags & END_STREAM != 0;
                        let mut pad = 0;
                        if flags & PADDED != 0 {
                            pad = usize::from(fragment.first().copied().unwrap_or(0));
                            fragment = fragment.get(1..).unwrap_or_default();
                        }
                        if flags & PRIORITY != 0 {
                            fragment = fragment.get(5..).unwrap_or_default();
                        }
                        fragment = fragment
                            .get(..fragment.len().saturating_sub(pad))
                            .unwrap_or_default();
                    }
                    block.extend_from_slice(fragment);
                    if flags & END_HEADERS != 0 {
                        let list = self
                            .decoder
                            .decode(&block)
                            .map_err(|e| CallError::Protocol(format!("HPACK: {e}")))?;
                        block.clear();
                        if stream == id {
                            fields.extend(list.into_iter().map(|(n, v)| {
                                (
                                    String::from_utf8_lossy(&n).into_owned(),
                                    String::from_utf8_lossy(&v).into_owned(),
                                )
                            }));
                            if ends_stream {
                                return Ok((fields, data));
                            }
                        }
                    }
                }
                _ => {}
            }
        }
    }
}
