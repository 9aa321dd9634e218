//! A data key rotation (`engine::rotate`, docs/encryption.md "Rotation") against the real
//! cryptsetup on a real loop device: the key slot steps need no device-mapper (this host has
//! none), so what the fake's cryptsetup models is checked here against the tool itself: both
//! keys of `luksAddKey` read one after the other from one stdin, `luksKillSlot` refusing
//! unless another slot takes the key given, `open --test-passphrase --key-slot` telling the
//! slots apart; and a rotation resumed from each state a crash can leave the header in, made
//! by hand with cryptsetup, ending with the new key alone in slot 0; and `moorctl rotate-key`
//! against a real moor-node (run after `cargo build --bins`), through its socket's
//! `moor.keys.v1` service. The mapping itself (and a rotation under a writer, the crash
//! replay, power cuts) needs dm-crypt: the VM lab.

use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;

use moor_node::engine::{Engine, EngineConfig, RotateDek};
use moor_node::journal::{CryptRecord, Durability, Journal, Phase, RotationStep, VolumeRecord};
use moor_node::sys::linux::Linux;
use moor_privileged::Sandbox;
use moor_runtime::keys::{Dek, Kek};

const VOL: &str = "vol-rot";

/// `cryptsetup args...` with `input` on its stdin; its exit code.
fn cryptsetup(args: &[&str], input: &[u8]) -> i32 {
    let mut child = Command::new("cryptsetup")
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("cryptsetup");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(input)
        .expect("key");
    child.wait().expect("wait").code().unwrap_or(-1)
}

/// Whether `slot` of the header on `dev` opens with `key`.
fn opens(dev: &Path, slot: u32, key: &Dek) -> bool {
    let d = dev.display().to_string();
    let s = slot.to_string();
    cryptsetup(
        &[
            "open",
            "--test-passphrase",
            "--key-slot",
            &s,
            "--key-file=-",
            &d,
        ],
        key.expose(),
    ) == 0
}

/// Which of slots 0 to 3 open with which key.
fn slots(dev: &Path, old: &Dek, new: &Dek) -> Vec<(u32, &'static str)> {
    (0..4)
        .filter_map(|s| {
            if opens(dev, s, old) {
                Some((s, "old"))
            } else if opens(dev, s, new) {
                Some((s, "new"))
            } else {
                None
            }
        })
        .collect()
}

/// `luksAddKey` of `new` into `slot` opened by `opening`, by hand.
fn add(dev: &Path, slot: u32, opening: &Dek, new: &Dek) {
    let (d, s) = (dev.display().to_string(), slot.to_string());
    let both = moor_runtime::keys::key_pair(opening, new);
    let code = cryptsetup(
        &[
            "luksAddKey",
            "--new-key-slot",
            &s,
            "--key-file=-",
            "--keyfile-size",
            "32",
            "--new-keyfile-size",
            "32",
            "--pbkdf",
            "pbkdf2",
            "--pbkdf-force-iterations",
            "1000",
            &d,
            "/dev/stdin",
        ],
        &both,
    );
    assert_eq!(code, 0, "luksAddKey into slot {slot}");
}

/// `luksKillSlot` of `slot`, proven by `remaining`, by hand.
fn kill(dev: &Path, slot: u32, remaining: &Dek) {
    let (d, s) = (dev.display().to_string(), slot.to_string());
    let code = cryptsetup(
        &[
            "luksKillSlot",
            "--key-file=-",
            "--keyfile-size",
            "32",
            &d,
            &s,
        ],
        remaining.expose(),
    );
    assert_eq!(code, 0, "luksKillSlot {slot}");
}

/// A LUKS2 volume on a fresh loop device, its slot 0 opened by a new key, as moor formats it;
/// the journal's record of its mapping; the engine; the request rotating to a new key.
struct World {
    _sb: Sandbox,
    dev: std::path::PathBuf,
    engine: Engine<Linux>,
    old: Dek,
    new: Dek,
    req: RotateDek,
}

fn world(name: &str) -> World {
    let sb = Sandbox::new(name);
    let dev = sb.loop_device("luks.img", 64 << 20);
    let old = Dek::generate().expect("old");
    let d = dev.display().to_string();
    let code = cryptsetup(
        &[
            "luksFormat",
            "--batch-mode",
            "--type",
            "luks2",
            "--pbkdf",
            "pbkdf2",
            "--pbkdf-force-iterations",
            "1000",
            "--key-file=-",
            &d,
        ],
        old.expose(),
    );
    assert_eq!(code, 0, "luksFormat");
    let kek = Arc::new(Kek::new("kek-1", &[9; 32]).expect("kek"));
    let old_wrapped = old.wrap(&kek, VOL).expect("wrap");
    let (journal, _) = Journal::open(&sb.state, false).expect("journal");
    let mut record = VolumeRecord::new(VOL);
    record.crypt = Some(CryptRecord {
        name: format!("moor-{VOL}"),
        device: dev.clone(),
        rdev: (0, 0),
        wrapped_dek: Some(old_wrapped.encode()),
        luks_uuid: None,
        fresh: false,
        phase: Phase::Done,
        boot: None,
        rotation: None,
        rotated: false,
        kms_id: Some("secret".into()),
        tpm2_pcrs: None,
    });
    journal.put(&record, Durability::Power).expect("record");
    let os = Arc::new(Linux::new(&sb.kubelet).expect("os"));
    let cfg = EngineConfig {
        kubelet_dir: sb.kubelet.clone(),
        ..EngineConfig::default()
    };
    let engine = Engine::new(os, Arc::new(journal), cfg);
    let new = Dek::generate().expect("new");
    let req = RotateDek {
        volume_id: VOL.to_owned(),
        old_wrapped,
        new_wrapped: new.wrap(&kek, VOL).expect("wrap"),
        kek,
        pbkdf: "pbkdf2".to_owned(),
    };
    World {
        _sb: sb,
        dev,
        engine,
        old,
        new,
        req,
    }
}

/// The new key alone, in slot 0; the journal names it and no rotation.
fn assert_rotated(w: &World) {
    assert_eq!(slots(&w.dev, &w.old, &w.new), [(0, "new")]);
    let c = w
        .engine
        .journal()
        .get(VOL)
        .and_then(|r| r.crypt)
        .expect("record");
    assert_eq!(c.wrapped_dek, Some(w.req.new_wrapped.encode()));
    assert_eq!(c.rotation, None);
}

#[test]
fn a_rotation_on_real_cryptsetup_leaves_the_new_key_alone_in_slot_0() {
    let w = world("rotate");
    let report = w.engine.rotate_dek(&w.req).expect("rotate");
    assert_eq!(report.ran.len(), 6, "{:?}", report.ran);
    assert_rotated(&w);
}

#[test]
fn a_wrong_old_key_is_refused_by_real_cryptsetup_and_nothing_changes() {
    let w = world("rotate-wrong");
    let kek = Kek::new("kek-1", &[9; 32]).expect("kek");
    let stranger = Dek::generate().expect("dek").wrap(&kek, VOL).expect("wrap");
    let wrong = RotateDek {
        old_wrapped: stranger,
        ..w.req.clone()
    };
    let e = w.engine.rotate_dek(&wrong).expect_err("wrong old key");
    assert!(e.to_string().contains("old data key"), "{e}");
    assert_eq!(slots(&w.dev, &w.old, &w.new), [(0, "old")]);
}

#[test]
fn a_rotation_resumes_from_every_state_a_crash_leaves_the_header_in() {
    // The header as each step leaves it, made by hand (the first `n` of the steps), and the
    // step the journal says is next.
    type Step = fn(&World);
    let by_hand: [Step; 4] = [
        |w| add(&w.dev, 1, &w.old, &w.old),
        |w| kill(&w.dev, 0, &w.old),
        |w| add(&w.dev, 0, &w.old, &w.new),
        |w| kill(&w.dev, 1, &w.new),
    ];
    let states = [
        (1, "old copied to the spare", RotationStep::KillOld),
        (2, "the volume's slot emptied", RotationStep::AddNew),
        (
            3,
            "the new key in slot 0, the old in the spare",
            RotationStep::Record,
        ),
        (
            4,
            "the spare removed, not yet journaled",
            RotationStep::KillSpare,
        ),
    ];
    for (n, what, step) in states {
        let w = world("rotate-resume");
        for hand in &by_hand[..n] {
            hand(&w);
        }
        let mut record = w.engine.journal().get(VOL).expect("record");
        if let Some(c) = record.crypt.as_mut() {
            c.rotation = Some(moor_node::journal::RotationRecord {
                old_wrapped: w.req.old_wrapped.encode(),
                new_wrapped: w.req.new_wrapped.encode(),
                step,
            });
        }
        w.engine
            .journal()
            .put(&record, Durability::Power)
            .expect("journal");
        let report = w
            .engine
            .rotate_dek(&w.req)
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        assert_rotated(&w);
        eprintln!("resumed from {what}: ran {:?}", report.ran);
    }
}

#[test]
fn moorctl_rotates_a_key_through_a_running_moor_node() {
    use moor_privileged::client::{Daemon, binary};
    let w = world("rotate-moorctl");
    let (sb, dev, engine, old, new_unused) = (w._sb, w.dev, w.engine, w.old, w.new);
    drop(new_unused);
    // The daemon's start pass closes and forgets a mapping record with no stage and nothing
    // open (what a crash after an unstage's close leaves); this host has no device-mapper to
    // open the mapping a staged volume has. It keeps the record of a volume whose key was
    // rotated before (its key is the journal's), which is the volume here.
    let mut record = engine.journal().get(VOL).expect("the world's record");
    record.crypt.as_mut().expect("its mapping record").rotated = true;
    engine
        .journal()
        .put(&record, Durability::Power)
        .expect("record");
    // The daemon takes the state dir: the engine of the world lets go of its journal first.
    drop(engine);
    let secrets = sb.root.join("kek.env");
    let lines: String = moor_runtime::keys::secret_entries("kek-1", &[9; 32])
        .iter()
        .map(|(k, v)| format!("{k}={v}\n"))
        .collect();
    std::fs::write(&secrets, lines).expect("secrets file");
    let rt = moor_privileged::runtime();
    let sock = sb.root.join("node.sock");
    let mut daemon = rt.block_on(Daemon::start(&sock, &sb.node_args("n1", &[])));
    let endpoint = format!("unix://{}", sock.display());
    let old_text = w.req.old_wrapped.encode();
    let run = |extra: &[&str]| {
        let mut args = vec![
            "--endpoint",
            endpoint.as_str(),
            "--secrets",
            secrets.to_str().expect("path"),
            "--output",
            "json",
            "rotate-key",
            VOL,
            "--old-dek",
            old_text.as_str(),
        ];
        args.extend(extra);
        Command::new(binary("moorctl"))
            .args(&args)
            .env_remove("CSI_ENDPOINT")
            .stdin(Stdio::null())
            .output()
            .expect("moorctl")
    };
    let out = run(&[]);
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "moorctl: {stdout}{stderr}");
    let answer: serde_json::Value = serde_json::from_str(&stdout).expect("json");
    let new_text = answer["encryptedDEK"].as_str().expect("new key").to_owned();
    // Printed before the call, on stderr: the operator holds it whatever happens next.
    assert!(stderr.contains(&new_text), "{stderr}");
    assert_eq!(
        answer["steps"].as_array().map(Vec::len),
        Some(6),
        "{answer}"
    );
    let kek = Kek::new("kek-1", &[9; 32]).expect("kek");
    let new = kek
        .unwrap(
            &moor_runtime::keys::WrappedDek::decode(&new_text).expect("decode"),
            VOL,
        )
        .expect("unwrap");
    assert_eq!(slots(&dev, &old, &new), [(0, "new")]);
    // Run again with the same keys: done already; only the journal's steps run, nothing changes.
    let again = run(&["--new-dek", &new_text]);
    assert!(
        again.status.success(),
        "{}",
        String::from_utf8_lossy(&again.stderr)
    );
    assert_eq!(slots(&dev, &old, &new), [(0, "new")]);
    // A key the volume never had as the old one (and a new key made here): refused by the
    // probe with FAILED_PRECONDITION, no key shown, nothing changed.
    let stranger = Dek::generate()
        .expect("dek")
        .wrap(&kek, VOL)
        .expect("wrap")
        .encode();
    let refused = Command::new(binary("moorctl"))
        .args([
            "--endpoint",
            endpoint.as_str(),
            "--secrets",
            secrets.to_str().expect("path"),
            "rotate-key",
            VOL,
            "--old-dek",
            stranger.as_str(),
        ])
        .env_remove("CSI_ENDPOINT")
        .stdin(Stdio::null())
        .output()
        .expect("moorctl");
    assert!(!refused.status.success());
    let told = String::from_utf8_lossy(&refused.stderr).to_lowercase();
    assert!(
        told.contains("precondition") && told.contains("old data key"),
        "{told}"
    );
    assert!(!told.contains(&secrets_kek().to_lowercase()), "{told}");
    assert_eq!(slots(&dev, &old, &new), [(0, "new")]);
    rt.block_on(daemon.stop());
}

/// The base64 KEK the secrets file holds.
fn secrets_kek() -> String {
    moor_runtime::keys::secret_entries("kek-1", &[9; 32])[0]
        .1
        .clone()
}
