//! The VM lab's agent: runs in a guest of `.ci/vm` and lets a test on the host drive it over
//! TCP (the guest's NIC on the Ceph test cluster's bridge). One request per connection, a line
//! of JSON:
//!
//! * `{"op":"ping"}`: `{"ok":true}`, once the guest is up;
//! * `{"op":"exec","argv":[...],"env":{...}}`: runs the program to its end;
//!   `{"code":N|null,"stdout":"...","stderr":"..."}`;
//! * `{"op":"spawn","argv":[...],"env":{...},"log":"/path"}`: starts it in the background,
//!   its stdout and stderr appended to `log`; `{"pid":N}`;
//! * `{"op":"connect","socket":"/path"}`: `{"ok":true}`, then the connection carries bytes to
//!   and from that Unix socket (a gRPC channel to a daemon in the guest).
//!
//! Test equipment only: it serves anyone who reaches the guest's address, as root.

use std::collections::HashMap;
use std::io::{BufRead as _, BufReader, Write as _};
use std::net::{TcpListener, TcpStream};
use std::os::unix::net::UnixStream;
use std::process::{Command, Stdio};

fn main() {
    let mut args = std::env::args().skip(1);
    let listen = match (args.next().as_deref(), args.next()) {
        (Some("--listen"), Some(addr)) => addr,
        _ => {
            eprintln!("usage: vm-agent --listen ADDR:PORT");
            std::process::exit(2);
        }
    };
    let listener = TcpListener::bind(&listen).unwrap_or_else(|e| {
        eprintln!("vm-agent: bind {listen}: {e}");
        std::process::exit(1);
    });
    eprintln!("vm-agent: serving on {listen}");
    for conn in listener.incoming().flatten() {
        std::thread::spawn(move || {
            if let Err(e) = serve(conn) {
                eprintln!("vm-agent: {e}");
            }
        });
    }
}

fn strings(v: &serde_json::Value) -> Vec<String> {
    v.as_array()
        .into_iter()
        .flatten()
        .filter_map(|s| s.as_str().map(str::to_string))
        .collect()
}

fn env(v: &serde_json::Value) -> HashMap<String, String> {
    v.as_object()
        .into_iter()
        .flatten()
        .filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_string())))
        .collect()
}

fn command(req: &serde_json::Value) -> std::io::Result<Command> {
    let argv = strings(&req["argv"]);
    let Some((program, rest)) = argv.split_first() else {
        return Err(std::io::Error::other("argv is empty"));
    };
    let mut cmd = Command::new(program);
    cmd.args(rest).envs(env(&req["env"])).stdin(Stdio::null());
    Ok(cmd)
}

fn serve(conn: TcpStream) -> std::io::Result<()> {
    let mut reader = BufReader::new(conn.try_clone()?);
    let mut line = String::new();
    reader.read_line(&mut line)?;
    let req: serde_json::Value = serde_json::from_str(&line).map_err(std::io::Error::other)?;
    let mut out = conn.try_clone()?;
    let answer = match req["op"].as_str().unwrap_or_default() {
        "ping" => serde_json::json!({"ok": true}),
        "exec" => match command(&req).and_then(|mut c| c.output()) {
            Ok(o) => serde_json::json!({
                "code": o.status.code(),
                "stdout": String::from_utf8_lossy(&o.stdout),
                "stderr": String::from_utf8_lossy(&o.stderr),
            }),
            Err(e) => serde_json::json!({"code": null, "stdout": "", "stderr": e.to_string()}),
        },
        "spawn" => {
            let log = req["log"].as_str().unwrap_or("/dev/null");
            let spawned = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(log)
                .and_then(|f| Ok((f.try_clone()?, f)))
                .and_then(|(a, b)| command(&req)?.stdout(a).stderr(b).spawn());
            match spawned {
                Ok(mut child) => {
                    let pid = child.id();
                    // Reaped when it ends, so that a killed daemon leaves no zombie behind.
                    std::thread::spawn(move || child.wait());
                    serde_json::json!({"pid": pid})
                }
                Err(e) => serde_json::json!({"error": e.to_string()}),
            }
        }
        "connect" => {
            let socket = req["socket"].as_str().unwrap_or_default();
            let unix = match UnixStream::connect(socket) {
                Ok(u) => u,
                Err(e) => {
                    writeln!(out, "{}", serde_json::json!({"error": e.to_string()}))?;
                    return Ok(());
                }
            };
            writeln!(out, "{}", serde_json::json!({"ok": true}))?;
            // What the reader has buffered past the request line belongs to the socket.
            let buffered = reader.buffer().to_vec();
            let mut to_unix = unix.try_clone()?;
            to_unix.write_all(&buffered)?;
            let mut from_unix = unix;
            let mut to_tcp = out;
            let back = std::thread::spawn(move || {
                let _ = std::io::copy(&mut from_unix, &mut to_tcp);
                let _ = to_tcp.shutdown(std::net::Shutdown::Write);
            });
            let mut rest = reader.into_inner();
            let _ = std::io::copy(&mut rest, &mut to_unix);
            let _ = to_unix.shutdown(std::net::Shutdown::Write);
            let _ = back.join();
            return Ok(());
        }
        other => serde_json::json!({"error": format!("unknown op {other:?}")}),
    };
    writeln!(out, "{answer}")?;
    Ok(())
}
