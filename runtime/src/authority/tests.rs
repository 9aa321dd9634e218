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
        let len =
            (usize::from(bytes[0]) << 16) | (usize::from(bytes[1]) << 8) | usize::from(bytes[2]);
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
    assert_eq!(
        with(&[frame(HEADERS, END_HEADERS, 1, &[0x80 | 70])]),
        Malformed::Hpack {
            stream: 1,
            reason: hpack::HpackError::BadIndex(70)
        }
    );
    // A table larger than the server allows.
    assert_eq!(
        with(&[frame(HEADERS, END_HEADERS, 1, &[0x3f, 0xe1, 0x3f, 0x83])]),
        Malformed::Hpack {
            stream: 1,
            reason: hpack::HpackError::SizeUpdate(8192)
        }
    );
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
