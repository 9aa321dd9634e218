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

use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;

use moor_node::engine::{Engine, EngineConfig, RotateDek};
use moor_node::journal::{CryptRecord, Durability, Journal, Phase, RotationStep, VolumeRecord};
use moor_node::sys::linux::Linux;
use moor_privileged::Sandbox;
use moor_runtime::keys::{Dek, Kek};

const VOL: &str = "vol-rot";

/// Whether `slot` of the header on `dev` opens with `key`.
fn opens(dev: &Path, slot: u32, key: &Dek) -> bool {
    moor_privileged::luks::slot_opens(dev, slot, key.expose())
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
    moor_privileged::luks::add_key(dev, slot, opening.expose(), new.expose());
}

/// `luksKillSlot` of `slot`, proven by `remaining`, by hand.
fn kill(dev: &Path, slot: u32, remaining: &Dek) {
    moor_privileged::luks::kill_slot(dev, slot, remaining.expose());
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
    luks_format(&dev, &old);
    let kek = Arc::new(Kek::new("kek-1", &[9; 32]).expect("kek"));
    let old_wrapped = old.wrap(&kek, VOL).expect("wrap");
    let journal = mapping_open(&sb.state, VOL, &dev, &old_wrapped.encode(), false);
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
        kek: Arc::new(moor_runtime::keys::source::KeySource::Secret(
            Kek::new("kek-1", &[9; 32]).expect("kek"),
        )),
        pbkdf: "pbkdf2".to_owned(),
        tpm: moor_node::engine::NodeTpm::from_env(),
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

/// `dev` made LUKS2 by cryptsetup itself with `key` in slot 0.
fn luks_format(dev: &Path, key: &Dek) {
    moor_privileged::luks::format_device(dev, key.expose());
}

/// The node journal in `state` with `volume`'s mapping open on `dev` by `wrapped`, as a stage
/// leaves it (this host has no device-mapper to open one).
fn mapping_open(state: &Path, volume: &str, dev: &Path, wrapped: &str, rotated: bool) -> Journal {
    let (journal, _) = Journal::open(state, false).expect("journal");
    let mut record = VolumeRecord::new(volume);
    record.crypt = Some(CryptRecord {
        name: format!("moor-{volume}"),
        device: dev.to_path_buf(),
        rdev: (0, 0),
        wrapped_dek: Some(wrapped.to_owned()),
        luks_uuid: None,
        fresh: false,
        phase: Phase::Done,
        boot: None,
        rotation: None,
        rotated,
        kms_id: Some("secret".into()),
        tpm2_pcrs: None,
    });
    journal.put(&record, Durability::Power).expect("record");
    journal
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

/// The secrets file moorctl reads for the KEK `id` of `byte`s, under the sandbox.
fn kek_file(sb: &Sandbox, id: &str, byte: u8) -> std::path::PathBuf {
    let path = sb.root.join(format!("{id}.env"));
    let lines: String = moor_runtime::keys::secret_entries(id, &[byte; 32])
        .iter()
        .map(|(k, v)| format!("{k}={v}\n"))
        .collect();
    std::fs::write(&path, lines).expect("secrets file");
    path
}

/// moorctl with `args`; its JSON answer, or the test fails with what it said.
fn moorctl_json(args: &[&str]) -> serde_json::Value {
    let out = Command::new(moor_privileged::client::binary("moorctl"))
        .args(["--output", "json"])
        .args(args)
        .env_remove("CSI_ENDPOINT")
        .stdin(Stdio::null())
        .output()
        .expect("moorctl");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    );
    assert!(out.status.success(), "moorctl {args:?}: {stdout}{stderr}");
    serde_json::from_str(&stdout).expect("json")
}

/// A data key rotation owned by the controller (docs/encryption.md, "Rotation"): a real
/// moor-controller makes an encrypted volume and attaches it, its LUKS header is made with the
/// key its record holds (what the first stage does; this host has no device-mapper to open a
/// mapping, so the node's journal is given the open mapping's record by hand, as above),
/// `moorctl rotate-key --controller` runs the pending key, the node's slot steps against a
/// real moor-node and the promotion; then the volume is published again, as for a pod on
/// another node, and the publish_context gives the new key, which opens the header where the
/// volume context's old key no longer does. `moorctl rotate-kek` then rewraps the record under
/// a new KEK, the header untouched, and the next publish gives a key the new KEK unwraps to the
/// same data key.
#[test]
fn a_volume_rotated_through_the_controller_is_published_with_the_key_its_header_takes() {
    use csi::controller_client::ControllerClient;
    use moor_privileged::client::{Daemon, connect};
    use moor_proto::csi::v1 as csi;
    let sb = Sandbox::new("rotate-controller");
    let _sweep = moor_privileged::LoopSweep(sb.root.clone());
    let rt = moor_privileged::runtime();
    let (mut controller, cap) = controller_n1(&sb, &rt);
    let (ctl_sock, node_sock) = (sb.root.join("controller.sock"), sb.root.join("node.sock"));
    let kek1 = Kek::new("kek-1", &[9; 32]).expect("kek");
    let mut ctl =
        rt.block_on(async { ControllerClient::new(connect(&ctl_sock).await.expect("socket")) });
    let volume = create_encrypted(&rt, &mut ctl, "pvc-rotated", "secret", &cap);
    let id = volume.volume_id.clone();
    // ControllerPublishVolume at n1 (attached until `unpublish`): its publish_context.
    let publish = |ctl: &mut Ctl| publish_n1(&rt, ctl, &volume, &cap);
    let unpublish = |ctl: &mut Ctl| {
        rt.block_on(
            ctl.controller_unpublish_volume(csi::ControllerUnpublishVolumeRequest {
                volume_id: id.clone(),
                node_id: "n1".into(),
                ..Default::default()
            }),
        )
        .expect("ControllerUnpublishVolume");
    };
    let first = publish(&mut ctl);
    let context_key = volume.volume_context["encryptedDEK"].clone();
    assert_eq!(first.get("encryptedDEK"), Some(&context_key));
    assert_eq!(first.get("encryptedDEKPending"), None);
    let decode = |t: &str| moor_runtime::keys::WrappedDek::decode(t).expect("decode");
    let old = kek1.unwrap(&decode(&context_key), &id).expect("unwrap");
    // Attached for the node, made LUKS with the record's key (as the first stage does).
    let attached = first;
    let dev = std::path::PathBuf::from(&attached["devicePath"]);
    luks_format(&dev, &old);
    // Node A: the volume's mapping open on the device, as its stage leaves it; `rotated` so
    // that the daemon's start pass keeps it (see the moorctl test above).
    drop(mapping_open(&sb.state, &id, &dev, &context_key, true));
    let mut node = rt.block_on(Daemon::start(&node_sock, &sb.node_args("n1", &[])));
    let secrets1 = kek_file(&sb, "kek-1", 9);
    let (node_ep, ctl_ep) = (
        format!("unix://{}", node_sock.display()),
        format!("unix://{}", ctl_sock.display()),
    );
    let s1 = secrets1.display().to_string();
    let rotate_args = [
        "--endpoint",
        node_ep.as_str(),
        "--secrets",
        &s1,
        "rotate-key",
        &id,
        "--controller",
        &ctl_ep,
    ];
    // An operator's run cut short after its first step (a crash of moorctl): the record
    // holds the pending key, every publish gives both keys, and the next run resumes with
    // that very key.
    let mut keys = rt.block_on(async {
        moor_proto::keys::v1::controller_keys_client::ControllerKeysClient::new(
            connect(&ctl_sock).await.expect("socket"),
        )
    });
    let begun = rt
        .block_on(
            keys.begin_volume_key_rotation(moor_proto::keys::v1::BeginVolumeKeyRotationRequest {
                volume_id: id.clone(),
                secrets: moor_runtime::keys::secret_entries("kek-1", &[9; 32])
                    .into_iter()
                    .collect(),
                if_rotations: None,
            }),
        )
        .expect("BeginVolumeKeyRotation")
        .into_inner();
    assert_eq!(begun.current_wrapped_dek, context_key);
    let answer = moorctl_json(&rotate_args);
    assert_eq!(
        answer["steps"].as_array().map(Vec::len),
        Some(6),
        "{answer}"
    );
    let new_text = answer["encryptedDEK"].as_str().expect("new key").to_owned();
    assert_eq!(
        new_text, begun.pending_wrapped_dek,
        "resumed with the pending key"
    );
    assert_ne!(new_text, context_key);
    let new = kek1.unwrap(&decode(&new_text), &id).expect("unwrap");
    assert_eq!(slots(&dev, &old, &new), [(0, "new")]);
    // Run again: the record holds no pending key, so this is a second rotation, from the
    // record's current key; it too ends with the record and the header agreeing.
    let again = moorctl_json(&rotate_args);
    let newer_text = again["encryptedDEK"]
        .as_str()
        .expect("newer key")
        .to_owned();
    let newer = kek1.unwrap(&decode(&newer_text), &id).expect("unwrap");
    assert_eq!(slots(&dev, &new, &newer), [(0, "new")]);
    rt.block_on(node.stop());
    unpublish(&mut ctl);
    // Published again (a pod on another node): the record's key, which the header takes; the
    // volume context's, which any node would be given without the record, opens no slot.
    let moved = publish(&mut ctl);
    assert_eq!(moved.get("encryptedDEK"), Some(&newer_text));
    assert_eq!(moved.get("encryptedDEKPending"), None);
    let dev = std::path::PathBuf::from(&moved["devicePath"]);
    assert!(opens(&dev, 0, &newer));
    assert!(
        !(0..4).any(|s| opens(&dev, s, &old)),
        "the context's key opens nothing"
    );
    unpublish(&mut ctl);
    // The KEK rotated over the records: the header untouched, the record under kek-2.
    let secrets2 = kek_file(&sb, "kek-2", 10);
    let s2 = secrets2.display().to_string();
    let kek_args = [
        "--endpoint",
        ctl_ep.as_str(),
        "--secrets",
        &s1,
        "rotate-kek",
        "--new-secrets",
        &s2,
    ];
    let rotated = moorctl_json(&kek_args);
    assert_eq!(rotated["rewrapped"], serde_json::json!([id]), "{rotated}");
    let under_2 = publish(&mut ctl);
    let kek2 = Kek::new("kek-2", &[10; 32]).expect("kek");
    let key = kek2
        .unwrap(&decode(&under_2["encryptedDEK"]), &id)
        .expect("the new KEK unwraps the record's key");
    assert_eq!(key.expose(), newer.expose(), "the same data key");
    assert!(opens(
        &std::path::PathBuf::from(&under_2["devicePath"]),
        0,
        &key
    ));
    unpublish(&mut ctl);
    let resumed = moorctl_json(&kek_args);
    assert_eq!(resumed["unchanged"], serde_json::json!([id]), "{resumed}");
    rt.block_on(controller.stop());
}

/// Scheduled rotation (docs/encryption.md, "Scheduled rotation"), through a real
/// moor-controller and a real moor-node started with `--key-rotation-secrets`: three
/// encrypted volumes attached to the node, their LUKS headers made with their records' keys
/// and their mappings open in the node's journal (by hand, as above: no device-mapper here).
/// `often` (`keyRotationSchedule: 1s`) is rotated at every pass; `weekly` (`@weekly`) has a
/// rotation begun at the controller before the node starts, as a scheduler killed after
/// its first step leaves it, and the node finishes it with that very key, once; `never` (no
/// schedule) is never rotated. Then the node restarts and `often` goes on rotating, `weekly`
/// is not rotated again, and every header opens with its record's current key alone.
#[test]
fn a_scheduled_rotation_runs_when_due_resumes_after_a_restart_and_spares_the_rest() {
    use csi::controller_client::ControllerClient;
    use moor_privileged::client::{Daemon, connect};
    use moor_proto::csi::v1 as csi;
    use moor_proto::keys::v1 as keys;
    let sb = Sandbox::new("rotate-schedule");
    let _sweep = moor_privileged::LoopSweep(sb.root.clone());
    let rt = moor_privileged::runtime();
    let (mut controller, cap) = controller_n1(&sb, &rt);
    let (ctl_sock, node_sock) = (sb.root.join("controller.sock"), sb.root.join("node.sock"));
    let kek = Kek::new("kek-1", &[9; 32]).expect("kek");
    let secrets: std::collections::HashMap<String, String> =
        moor_runtime::keys::secret_entries("kek-1", &[9; 32])
            .into_iter()
            .collect();
    let mut ctl =
        rt.block_on(async { ControllerClient::new(connect(&ctl_sock).await.expect("socket")) });
    let mut ck = rt.block_on(async {
        keys::controller_keys_client::ControllerKeysClient::new(
            connect(&ctl_sock).await.expect("socket"),
        )
    });
    let decode = |t: &str| moor_runtime::keys::WrappedDek::decode(t).expect("decode");
    // Each volume made, attached at n1, made LUKS with its record's key, open in the journal.
    let mut made = Vec::new();
    for (name, schedule) in [
        ("often", Some("1s")),
        ("weekly", Some("@weekly")),
        ("never", None),
    ] {
        let more: Vec<(&str, &str)> = schedule
            .map(|s| ("keyRotationSchedule", s))
            .into_iter()
            .collect();
        let volume = rt
            .block_on(
                ctl.create_volume(moor_privileged::requests::encrypted_create_req(
                    &format!("pvc-{name}"),
                    32 << 20,
                    "secret",
                    &more,
                    &secrets,
                )),
            )
            .expect("CreateVolume")
            .into_inner()
            .volume
            .expect("volume");
        let id = volume.volume_id.clone();
        let published = rt
            .block_on(
                ctl.controller_publish_volume(csi::ControllerPublishVolumeRequest {
                    volume_id: id.clone(),
                    node_id: "n1".into(),
                    volume_capability: Some(cap.clone()),
                    volume_context: volume.volume_context.clone(),
                    ..Default::default()
                }),
            )
            .expect("ControllerPublishVolume")
            .into_inner()
            .publish_context;
        let context_key = volume.volume_context["encryptedDEK"].clone();
        let old = kek.unwrap(&decode(&context_key), &id).expect("unwrap");
        let dev = std::path::PathBuf::from(&published["devicePath"]);
        luks_format(&dev, &old);
        drop(mapping_open(&sb.state, &id, &dev, &context_key, true));
        made.push((id, dev, context_key));
    }
    let [
        (often, often_dev, _),
        (weekly, weekly_dev, _),
        (never, never_dev, never_key),
    ] = <[_; 3]>::try_from(made).expect("three");
    // `weekly`: a rotation begun at the controller, cut short before the node's steps.
    let begun = rt
        .block_on(
            ck.begin_volume_key_rotation(keys::BeginVolumeKeyRotationRequest {
                volume_id: weekly.clone(),
                secrets: secrets.clone(),
                if_rotations: None,
            }),
        )
        .expect("BeginVolumeKeyRotation")
        .into_inner();
    let secrets_dir = sb.root.join("kek-secret");
    std::fs::create_dir(&secrets_dir).expect("secrets dir");
    for (k, v) in &secrets {
        std::fs::write(secrets_dir.join(k), format!("{v}\n")).expect("secret file");
    }
    let ctl_ep = format!("unix://{}", ctl_sock.display());
    let node_args = sb.node_args(
        "n1",
        &[
            "--key-rotation-secrets",
            &secrets_dir.display().to_string(),
            "--key-rotation-controller",
            &ctl_ep,
            "--key-rotation-interval",
            "1",
        ],
    );
    // The node's scheduler calls the controller on the same volumes meanwhile; a call that
    // meets one of its calls in flight is ABORTED (the controller's per-volume guard), and a
    // client retries it, as the scheduler does.
    let mut get = |id: &str| {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        loop {
            match rt.block_on(
                ck.get_volume_key_rotation(keys::GetVolumeKeyRotationRequest {
                    volume_id: id.to_owned(),
                }),
            ) {
                Ok(r) => break r.into_inner(),
                Err(e)
                    if e.code() == tonic::Code::Aborted && std::time::Instant::now() < deadline =>
                {
                    std::thread::sleep(std::time::Duration::from_millis(50));
                }
                Err(e) => {
                    panic!("GetVolumeKeyRotation of {id} (retried while ABORTED for 60 s): {e:?}")
                }
            }
        }
    };
    let mut node = rt.block_on(Daemon::start(&node_sock, &node_args));
    wait_rotations(&mut get, &often, 2);
    rt.block_on(node.stop());
    // Restarted: the schedule goes on from the record, nothing journaled here is needed.
    let before_restart = get(&often).rotations;
    let log = sb.root.join("node-restarted.log");
    let mut logged_args = node_args.clone();
    logged_args.extend(["--http-endpoint".to_owned(), "127.0.0.1:0".to_owned()]);
    let mut node = Daemon::spawn_logged("moor-node", &node_sock, &logged_args, &log);
    rt.block_on(node.wait_answering());
    wait_rotations(&mut get, &often, before_restart + 2);
    // Counted, the next due time said, and no key in the log (the KEK's text, the keys'
    // wrapped texts are not secret).
    let addr = moor_privileged::client::http_address(&log, &mut node);
    let metrics = moor_privileged::client::http_get(&addr, "/metrics").expect("/metrics");
    let value = |prefix: &str| {
        metrics
            .body
            .lines()
            .find(|l| l.starts_with(prefix))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or_else(|| panic!("no {prefix} in {}", metrics.body))
    };
    assert!(value("moor_key_rotations_total{result=\"done\"}") >= 2);
    assert!(value("moor_key_rotation_next_due_seconds ") > 0);
    rt.block_on(node.stop());
    let text = std::fs::read_to_string(&log).expect("the node's log");
    assert!(text.contains("data key rotated by its schedule"), "{text}");
    assert!(!text.contains(&secrets_kek()), "the KEK in the log");
    // Stopped between passes, the record's key alone in slot 0; stopped within one (a rotation
    // begun), the header opens with the record's current or pending key (the node's order).
    let k = get(&often);
    let current = kek
        .unwrap(&decode(&k.current_wrapped_dek), &often)
        .expect("unwrap");
    if k.pending_wrapped_dek.is_empty() {
        assert!(
            opens(&often_dev, 0, &current),
            "often: the record's key opens slot 0"
        );
        assert!(
            !(1..4).any(|s| opens(&often_dev, s, &current)),
            "often: its key alone, in slot 0"
        );
    } else {
        let pending = kek
            .unwrap(&decode(&k.pending_wrapped_dek), &often)
            .expect("unwrap");
        assert!(
            !slots(&often_dev, &current, &pending).is_empty(),
            "often: opens"
        );
    }
    assert!(k.current_since_unix > 0);
    // `weekly`: its cut-short rotation finished with the key begun, and only that one (two
    // passes at least ran after it: `often` rotated twice since).
    let w = get(&weekly);
    assert_eq!(w.rotations, 1, "weekly: resumed once, not rotated again");
    assert_eq!(w.current_wrapped_dek, begun.pending_wrapped_dek);
    assert!(w.pending_wrapped_dek.is_empty());
    let new = kek
        .unwrap(&decode(&w.current_wrapped_dek), &weekly)
        .expect("unwrap");
    let old = kek
        .unwrap(&decode(&begun.current_wrapped_dek), &weekly)
        .expect("unwrap");
    assert_eq!(slots(&weekly_dev, &old, &new), [(0, "new")]);
    // `never`: untouched, and its record's clock never started.
    let n = get(&never);
    assert_eq!(n.rotation_schedule, "");
    assert_eq!((n.rotations, n.current_since_unix), (0, 0));
    assert_eq!(n.current_wrapped_dek, never_key);
    let key = kek.unwrap(&decode(&never_key), &never).expect("unwrap");
    assert!(
        opens(&never_dev, 0, &key),
        "never: its first key still opens it"
    );
    rt.block_on(controller.stop());
}

/// Waits until `volume`'s record (read by `get`) has finished `n` rotations; its keys then.
fn wait_rotations(
    get: &mut impl FnMut(&str) -> moor_proto::keys::v1::VolumeKeys,
    volume: &str,
    n: u64,
) -> moor_proto::keys::v1::VolumeKeys {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(300);
    loop {
        let k = get(volume);
        if k.rotations >= n {
            return k;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "volume {volume}: waited 300 s for {n} scheduled rotations of its data key, the \
             controller's record has {}",
            k.rotations
        );
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
}

/// A real moor-controller serving node `n1` from `sb` (its socket `controller.sock`), and the
/// capability the volumes are attached with (a block volume, written to by no one).
/// A client of the controller's CSI service.
type Ctl = moor_proto::csi::v1::controller_client::ControllerClient<tonic::transport::Channel>;

/// CreateVolume at the controller of a 64 MiB encrypted volume `name` of the key source
/// `kms`, its cluster KEK kek-1's.
fn create_encrypted(
    rt: &tokio::runtime::Runtime,
    ctl: &mut Ctl,
    name: &str,
    kms: &str,
    cap: &moor_proto::csi::v1::VolumeCapability,
) -> moor_proto::csi::v1::Volume {
    use moor_proto::csi::v1 as csi;
    rt.block_on(
        ctl.create_volume(csi::CreateVolumeRequest {
            name: name.into(),
            capacity_range: Some(csi::CapacityRange {
                required_bytes: 64 << 20,
                limit_bytes: 0,
            }),
            volume_capabilities: vec![cap.clone()],
            parameters: [("encrypted", "true"), ("kmsID", kms)]
                .into_iter()
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .collect(),
            secrets: moor_runtime::keys::secret_entries("kek-1", &[9; 32])
                .into_iter()
                .collect(),
            ..Default::default()
        }),
    )
    .expect("CreateVolume")
    .into_inner()
    .volume
    .expect("volume")
}

/// ControllerPublishVolume of `volume` at n1: its publish_context.
fn publish_n1(
    rt: &tokio::runtime::Runtime,
    ctl: &mut Ctl,
    volume: &moor_proto::csi::v1::Volume,
    cap: &moor_proto::csi::v1::VolumeCapability,
) -> std::collections::HashMap<String, String> {
    rt.block_on(ctl.controller_publish_volume(
        moor_proto::csi::v1::ControllerPublishVolumeRequest {
            volume_id: volume.volume_id.clone(),
            node_id: "n1".into(),
            volume_capability: Some(cap.clone()),
            volume_context: volume.volume_context.clone(),
            ..Default::default()
        },
    ))
    .expect("ControllerPublishVolume")
    .into_inner()
    .publish_context
}

fn controller_n1(
    sb: &Sandbox,
    rt: &tokio::runtime::Runtime,
) -> (
    moor_privileged::client::Daemon,
    moor_proto::csi::v1::VolumeCapability,
) {
    let ctl_data = sb.data.join("controller").display().to_string();
    let controller = rt.block_on(moor_privileged::client::Daemon::start_program(
        "moor-controller",
        &sb.root.join("controller.sock"),
        &["--node-id", "n1", "--data-dir", &ctl_data],
    ));
    let cap = moor_privileged::requests::block_cap();
    (controller, cap)
}

/// A TPM in the test: a keyed function of the message (any TPM's HMAC is as opaque to moor).
struct TestTpm;

impl moor_runtime::keys::tpm2::Tpm for TestTpm {
    fn hmac(
        &self,
        message: &[u8],
    ) -> moor_runtime::keys::Result<moor_runtime::keys::tpm2::Zeroizing<Vec<u8>>> {
        let mut out = vec![0x5a_u8; 32];
        for (i, b) in message.iter().enumerate() {
            out[i % 32] = out[i % 32].wrapping_mul(31).wrapping_add(*b);
        }
        Ok(moor_runtime::keys::tpm2::Zeroizing::new(out))
    }
}

/// The controller's half of a `tpm2` volume's data key rotation through a real
/// moor-controller: CreateVolume with `kmsID: tpm2`, its LUKS header made with the record's
/// key combined with the node's half; BeginVolumeKeyRotation (refused before tpm2 rotation
/// was built) writes a pending key the cluster KEK unwraps; the node's slot steps (the engine,
/// in the test: this host has no device-mapper for a moor-node's stage) take it combined with
/// the same half; FinishVolumeKeyRotation promotes it, and the next publish gives the key
/// whose combination alone opens the header.
#[test]
fn a_tpm2_volume_rotated_through_a_real_controller_is_published_with_its_new_key() {
    use csi::controller_client::ControllerClient;
    use moor_privileged::client::connect;
    use moor_proto::csi::v1 as csi;
    use moor_proto::keys::v1 as keys;
    use moor_runtime::keys::tpm2::NodeHalf;
    let sb = Sandbox::new("rotate-tpm2-controller");
    let _sweep = moor_privileged::LoopSweep(sb.root.clone());
    let rt = moor_privileged::runtime();
    let (mut controller, cap) = controller_n1(&sb, &rt);
    let ctl_sock = sb.root.join("controller.sock");
    let kek1 = Kek::new("kek-1", &[9; 32]).expect("kek");
    let secrets: std::collections::HashMap<String, String> =
        moor_runtime::keys::secret_entries("kek-1", &[9; 32])
            .into_iter()
            .collect();
    let mut ctl =
        rt.block_on(async { ControllerClient::new(connect(&ctl_sock).await.expect("socket")) });
    let volume = create_encrypted(&rt, &mut ctl, "pvc-tpm2-rotated", "tpm2", &cap);
    let id = volume.volume_id.clone();
    let publish = |ctl: &mut Ctl| publish_n1(&rt, ctl, &volume, &cap);
    let decode = |t: &str| moor_runtime::keys::WrappedDek::decode(t).expect("decode");
    let tpm: Arc<dyn moor_runtime::keys::tpm2::Tpm> = Arc::new(TestTpm);
    let combined = |text: &str| {
        let dek = kek1.unwrap(&decode(text), &id).expect("unwrap");
        NodeHalf::of(&*tpm, None, &id)
            .and_then(|h| h.combine(&dek))
            .expect("combined")
    };
    let first = publish(&mut ctl);
    let context_key = volume.volume_context["encryptedDEK"].clone();
    let dev = std::path::PathBuf::from(&first["devicePath"]);
    let old = combined(&context_key);
    luks_format(&dev, &old);
    let mut ck = rt.block_on(async {
        keys::controller_keys_client::ControllerKeysClient::new(
            connect(&ctl_sock).await.expect("socket"),
        )
    });
    let begun = rt
        .block_on(
            ck.begin_volume_key_rotation(keys::BeginVolumeKeyRotationRequest {
                volume_id: id.clone(),
                secrets: secrets.clone(),
                if_rotations: None,
            }),
        )
        .expect("BeginVolumeKeyRotation of a tpm2 volume")
        .into_inner();
    assert_eq!(begun.current_wrapped_dek, context_key);
    let new = combined(&begun.pending_wrapped_dek);
    // The node's slot steps, on the mapping's record as its stage leaves it.
    let journal = mapping_open(&sb.state, &id, &dev, &context_key, false);
    let mut record = journal.get(&id).expect("record");
    record.crypt.as_mut().expect("crypt").kms_id = Some("tpm2".into());
    journal.put(&record, Durability::Power).expect("record");
    let os = Arc::new(Linux::new(&sb.kubelet).expect("os"));
    let cfg = EngineConfig {
        kubelet_dir: sb.kubelet.clone(),
        ..EngineConfig::default()
    };
    let engine = Engine::new(os, Arc::new(journal), cfg);
    engine
        .rotate_dek(&RotateDek {
            volume_id: id.clone(),
            kek: Arc::new(moor_runtime::keys::source::KeySource::Secret(
                Kek::new("kek-1", &[9; 32]).expect("kek"),
            )),
            old_wrapped: decode(&context_key),
            new_wrapped: decode(&begun.pending_wrapped_dek),
            pbkdf: "pbkdf2".to_owned(),
            tpm: moor_node::engine::NodeTpm(Arc::clone(&tpm)),
        })
        .expect("the node's slot steps");
    assert_eq!(slots(&dev, &old, &new), [(0, "new")]);
    let done = rt
        .block_on(
            ck.finish_volume_key_rotation(keys::FinishVolumeKeyRotationRequest {
                volume_id: id.clone(),
                new_wrapped_dek: begun.pending_wrapped_dek.clone(),
            }),
        )
        .expect("FinishVolumeKeyRotation")
        .into_inner();
    assert_eq!(done.current_wrapped_dek, begun.pending_wrapped_dek);
    assert!(done.pending_wrapped_dek.is_empty());
    rt.block_on(
        ctl.controller_unpublish_volume(csi::ControllerUnpublishVolumeRequest {
            volume_id: id.clone(),
            node_id: "n1".into(),
            ..Default::default()
        }),
    )
    .expect("ControllerUnpublishVolume");
    let again = publish(&mut ctl);
    assert_eq!(again.get("encryptedDEK"), Some(&begun.pending_wrapped_dek));
    let dev = std::path::PathBuf::from(&again["devicePath"]);
    assert!(opens(&dev, 0, &combined(&begun.pending_wrapped_dek)));
    assert!(
        !(0..4).any(|s| opens(&dev, s, &old)),
        "the old key opens nothing"
    );
    rt.block_on(
        ctl.controller_unpublish_volume(csi::ControllerUnpublishVolumeRequest {
            volume_id: id.clone(),
            node_id: "n1".into(),
            ..Default::default()
        }),
    )
    .expect("ControllerUnpublishVolume");
    rt.block_on(controller.stop());
}
