//! `moorctl key unwrap`, the recovery without moor (docs/encryption.md, "Recovery when the
//! key source is gone"), against the real cryptsetup: no daemon runs. A LUKS2 header is made
//! with the key NodeStageVolume gets for a `secret` volume (`validate::stage_with_tpm`, as
//! its first stage's luksFormat); the key moorctl writes, piped straight into `cryptsetup
//! open --test-passphrase --key-file=-`, opens it; a wrong KEK is an error that writes
//! nothing to standard output and names no key; standard output a terminal (a pty, through
//! `script`) is refused. `--test-passphrase` reads the key slots and needs no
//! device-mapper, which this host's kernel lacks.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use moor_privileged::{Sandbox, luks};
use moor_runtime::keys::source::KeySource;
use moor_runtime::keys::tpm2::Tpm2Tools;
use moor_runtime::keys::{Dek, secret_entries};

const VOL: &str = "vol-u1";

/// The world: a LUKS2 header made with `VOL`'s stage key, `VOL`'s wrapped data key under the
/// KEK `kek-1` of 9s, and that KEK's secrets file.
struct World {
    sb: Sandbox,
    header: PathBuf,
    wrapped: String,
    key: Vec<u8>,
}

fn secrets_file(sb: &Sandbox, name: &str, byte: u8) -> PathBuf {
    let path = sb.root.join(name);
    let lines: String = secret_entries("kek-1", &[byte; 32])
        .iter()
        .map(|(k, v)| format!("{k}={v}\n"))
        .collect();
    std::fs::write(&path, lines).expect("secrets file");
    path
}

fn world(name: &str) -> World {
    let sb = Sandbox::new(name);
    let entries = secret_entries("kek-1", &[9; 32]);
    let get = |k: &str| {
        entries
            .iter()
            .find(|(n, _)| n == k)
            .map(|(_, v)| v.as_str())
    };
    let source = KeySource::from_secrets("secret", get).expect("the Secret's KEK");
    let wrapped = source
        .wrap(&Dek::generate().expect("dek"), VOL)
        .expect("wrap")
        .encode();
    let secrets = entries.iter().cloned().collect();
    let req = luks::encrypted_stage_req(VOL, "secret", &wrapped, &secrets);
    let key = luks::stage_key(&req, &Tpm2Tools::from_env());
    let header = sb.root.join("luks.img");
    luks::luks_format(&header, &key);
    World {
        sb,
        header,
        wrapped,
        key,
    }
}

fn moorctl() -> Command {
    let bin = moor_privileged::client::binary("moorctl");
    assert!(
        bin.exists(),
        "{} is not built (cargo build --bins)",
        bin.display()
    );
    let mut c = Command::new(bin);
    c.env_remove("CSI_ENDPOINT").env_remove("MOOR_SECRETS");
    c
}

fn unwrap_args<'a>(secrets: &'a Path, wrapped: &'a str) -> Vec<String> {
    [
        "--secrets",
        &secrets.display().to_string(),
        "key",
        "unwrap",
        "--volume",
        VOL,
        "--wrapped-dek",
        wrapped,
        "--kms-id",
        "secret",
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect()
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

#[test]
fn the_unwrapped_key_piped_to_cryptsetup_opens_the_volume() {
    let w = world("unwrap-pipe");
    let secrets = secrets_file(&w.sb, "kek.env", 9);
    // moorctl's standard output is cryptsetup's standard input: a pipe, nothing between.
    let mut unwrap = moorctl()
        .args(unwrap_args(&secrets, &w.wrapped))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("moorctl runs");
    let pipe = unwrap.stdout.take().expect("moorctl's stdout");
    let open = Command::new("cryptsetup")
        .args([
            "open",
            "--test-passphrase",
            "--type",
            "luks2",
            "--key-file=-",
        ])
        .arg(&w.header)
        .stdin(Stdio::from(pipe))
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output()
        .expect("cryptsetup runs");
    let unwrapped = unwrap.wait_with_output().expect("moorctl ends");
    assert!(
        unwrapped.status.success(),
        "moorctl key unwrap failed ({}): {}",
        unwrapped.status,
        text(&unwrapped.stderr)
    );
    assert!(
        open.status.success(),
        "cryptsetup open --test-passphrase with moorctl's key failed ({}): {}",
        open.status,
        text(&open.stderr)
    );
    // Exactly the stage's bytes: no newline, no encoding.
    let out = moorctl()
        .args(unwrap_args(&secrets, &w.wrapped))
        .stdin(Stdio::null())
        .output()
        .expect("moorctl runs");
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(out.stdout, w.key, "the bytes the node gives cryptsetup");
}

#[test]
fn a_wrong_kek_is_a_clear_error_and_writes_nothing() {
    let w = world("unwrap-wrong");
    let wrong = secrets_file(&w.sb, "wrong.env", 8);
    let out: Output = moorctl()
        .args(unwrap_args(&wrong, &w.wrapped))
        .stdin(Stdio::null())
        .output()
        .expect("moorctl runs");
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(5), "{err}");
    assert!(
        out.stdout.is_empty(),
        "{} bytes on stdout",
        out.stdout.len()
    );
    assert!(
        err.contains(VOL) && err.contains("does not unwrap"),
        "{err}"
    );
    for (_, kek) in secret_entries("kek-1", &[8; 32])
        .iter()
        .chain(&secret_entries("kek-1", &[9; 32]))
        .filter(|(k, _)| k == "kek")
    {
        assert!(!err.contains(kek.as_str()), "a KEK in the error: {err}");
    }
    // And the right KEK still opens it: the refusal was the KEK's.
    assert!(luks::opens(&w.header, &w.key));
}

#[test]
fn a_terminal_as_standard_output_is_refused() {
    let w = world("unwrap-tty");
    let secrets = secrets_file(&w.sb, "kek.env", 9);
    let line = std::iter::once(
        moor_privileged::client::binary("moorctl")
            .display()
            .to_string(),
    )
    .chain(unwrap_args(&secrets, &w.wrapped))
    .map(|a| format!("'{a}'"))
    .collect::<Vec<_>>()
    .join(" ");
    // `script` runs it with a pty as its terminal: its stdout and stderr both; -e: its exit
    // code is moorctl's.
    let out = Command::new("script")
        .args(["-qec", &line, "/dev/null"])
        .env_remove("CSI_ENDPOINT")
        .env_remove("MOOR_SECRETS")
        .stdin(Stdio::null())
        .output()
        .expect("script runs");
    // What the terminal showed, the key (had it been written) cut out of the failure's
    // message: a test's log is a screen too.
    let key_text = String::from_utf8_lossy(&w.key).into_owned();
    let raw = text(&out.stdout);
    let shown = raw.replace(&key_text, "<the key>");
    assert_eq!(out.status.code(), Some(2), "{shown}{}", text(&out.stderr));
    assert!(shown.contains("standard output is a terminal"), "{shown}");
    assert!(!raw.contains(&key_text), "the key on the terminal: {shown}");
}
