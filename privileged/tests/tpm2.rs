//! The `tpm2` source's node half against a real TPM 2.0: swtpm, reached by tpm2-tools through
//! its socket (the TCTI `swtpm:`), as moor-node reaches the kernel's `/dev/tpmrm0` with the
//! same commands. The HMAC key is made in the TPM; the passphrase of a volume is the same at
//! every stage on that TPM, another TPM cannot load the key's blobs, another TPM's own key
//! gives another passphrase, and a TPM gone is `Unavailable`.
//!
//! NodeExpandVolume's key of a `tpm2` volume (`validate::expand_key`) is the key its stage
//! made the LUKS header with, on its own TPM only, proven by the real cryptsetup on a header
//! (`--test-passphrase`); a TPM that hangs (swtpm stopped) is UNAVAILABLE at the deadline.
//!
//! A `tpm2` volume's data key rotation (`Engine::rotate_dek`) on the real cryptsetup, a LUKS2
//! header on a loop device: the slots take each data key combined with swtpm's half, under
//! the volume's PCR policy, resumed from each state a crash leaves.
//!
//! What this does not show (the VM lab's part, `lab/tests/vm_tpm2.rs`): the mapping opened,
//! resized and its filesystem grown, which needs dm-crypt (not in this host's kernel).
//!
//! Needs `swtpm` and tpm2-tools (Debian: `swtpm`, `tpm2-tools`); skipped, saying why,
//! without them. Only the rotation's test needs root (its loop device).

use std::collections::HashMap;
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use moor_node::validate;
use moor_privileged::luks;
use moor_runtime::keys::tpm2::{Tpm2Tools, combine};
use moor_runtime::keys::{Dek, Kek, KeyError, secret_entries};

/// How long swtpm may take to listen.
const LISTEN_DEADLINE: Duration = Duration::from_secs(60);

/// Why the test cannot run, if it cannot.
fn missing_tools() -> Option<String> {
    ["swtpm", "tpm2_createprimary", "tpm2_hmac"]
        .iter()
        .find(|p| Command::new(p).arg("--version").output().is_err())
        .map(|p| format!("no {p} (Debian: swtpm, tpm2-tools)"))
}

/// Two free TCP ports on 127.0.0.1, one after the other: the swtpm TCTI finds the control
/// port at the server port's next.
fn free_ports() -> (u16, u16) {
    let until = Instant::now() + LISTEN_DEADLINE;
    loop {
        let first = TcpListener::bind("127.0.0.1:0").expect("a free port");
        let port = first.local_addr().expect("its address").port();
        if let Some(next) = port.checked_add(1)
            && TcpListener::bind(("127.0.0.1", next)).is_ok()
        {
            return (port, next);
        }
        assert!(Instant::now() < until, "no two free ports in a row");
    }
}

/// One swtpm, its state and moor's key dir: stopped and removed on drop.
struct Swtpm {
    child: Option<Child>,
    root: PathBuf,
    port: u16,
}

impl Drop for Swtpm {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

impl Swtpm {
    fn start(name: &str) -> Self {
        let root = std::env::temp_dir().join(format!("moor-tpm2-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(root.join("state")).expect("state dir");
        let (port, _ctrl) = free_ports();
        let mut tpm = Self {
            child: None,
            root,
            port,
        };
        tpm.run();
        tpm
    }

    /// swtpm started on the state and port, and listening (its control port the next).
    fn run(&mut self) {
        let child = Command::new("swtpm")
            .args(["socket", "--tpm2", "--flags", "startup-clear", "--tpmstate"])
            .arg(format!("dir={}", self.root.join("state").display()))
            .arg("--server")
            .arg(format!("type=tcp,port={},bindaddr=127.0.0.1", self.port))
            .arg("--ctrl")
            .arg(format!(
                "type=tcp,port={},bindaddr=127.0.0.1",
                self.port + 1
            ))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("swtpm starts");
        self.child = Some(child);
        let port = self.port;
        let until = Instant::now() + LISTEN_DEADLINE;
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            if let Some(Ok(Some(status))) = self.child.as_mut().map(Child::try_wait) {
                panic!("swtpm exited ({status}) before it listened on {port}");
            }
            assert!(
                Instant::now() < until,
                "swtpm did not listen on 127.0.0.1:{port} within {LISTEN_DEADLINE:?}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Started again on the same state and port: a reboot of the node, its PCRs reset.
    fn restart(&mut self) {
        self.stop();
        self.run();
    }

    /// PCR `index` of the sha256 bank extended (what a boot measuring something else does).
    fn extend_pcr(&self, index: u8) {
        let out = Command::new("tpm2_pcrextend")
            .arg(format!("{index}:sha256={}", "ab".repeat(32)))
            .env(
                "TPM2TOOLS_TCTI",
                format!("swtpm:host=127.0.0.1,port={}", self.port),
            )
            .output()
            .expect("tpm2_pcrextend runs");
        assert!(
            out.status.success(),
            "tpm2_pcrextend: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// moor's view of this TPM, its key's blobs in `dir`.
    fn tools(&self, dir: &Path) -> Tpm2Tools {
        Tpm2Tools::new(
            dir,
            Some(format!("swtpm:host=127.0.0.1,port={}", self.port)),
        )
    }

    fn key_dir(&self) -> PathBuf {
        self.root.join("moor")
    }

    fn pid(&self) -> rustix::process::Pid {
        rustix::process::Pid::from_child(self.child.as_ref().expect("running"))
    }
}

#[test]
fn a_volume_opens_with_both_halves_on_its_own_tpm_only() {
    if let Some(why) = missing_tools() {
        eprintln!("skipped: {why}");
        return;
    }
    let mut node_a = Swtpm::start("a");
    let node_b = Swtpm::start("b");
    let tpm_a = node_a.tools(&node_a.key_dir());
    tpm_a.ensure_key().expect("node a's key");
    for blob in ["hmac.pub", "hmac.priv"] {
        assert!(node_a.key_dir().join(blob).is_file(), "{blob} written");
    }
    // The blobs hold no HMAC of anything in the clear: the private part is the TPM's to open.
    let kek = Kek::new("cluster-1", &[0x42; 32]).expect("kek");
    let dek = Dek::generate().expect("dek");
    let wrapped = dek.wrap(&kek, "vol-1").expect("wrap");
    let cluster_half = kek.unwrap(&wrapped, "vol-1").expect("unwrap");
    let first = combine(&cluster_half, &tpm_a, "vol-1").expect("node a");
    let again = combine(&cluster_half, &tpm_a, "vol-1").expect("node a again");
    assert_eq!(
        first.expose(),
        again.expose(),
        "the same passphrase at each stage"
    );
    assert_ne!(first.expose(), cluster_half.expose());
    // ensure_key again keeps the key: still the same passphrase.
    tpm_a.ensure_key().expect("kept");
    assert_eq!(
        combine(&cluster_half, &tpm_a, "vol-1")
            .expect("node a")
            .expose(),
        first.expose()
    );

    // Node b with node a's blobs (a copied disk): its TPM refuses to load them.
    let copied = node_b.root.join("copied");
    std::fs::create_dir_all(&copied).expect("dir");
    for blob in ["hmac.pub", "hmac.priv"] {
        std::fs::copy(node_a.key_dir().join(blob), copied.join(blob)).expect("copy");
    }
    let e = combine(&cluster_half, &node_b.tools(&copied), "vol-1").expect_err("other TPM");
    assert!(
        matches!(&e, KeyError::Refused(m) if m.contains("tpm2_load")),
        "{e:?}"
    );

    // Node b with a key of its own: another passphrase, which the volume's key slot refuses.
    let tpm_b = node_b.tools(&node_b.key_dir());
    tpm_b.ensure_key().expect("node b's key");
    let elsewhere = combine(&cluster_half, &tpm_b, "vol-1").expect("node b");
    assert_ne!(elsewhere.expose(), first.expose());

    // Node a's TPM gone: unavailable, no key.
    node_a.stop();
    let e = combine(&cluster_half, &tpm_a, "vol-1").expect_err("TPM gone");
    assert!(matches!(&e, KeyError::Unavailable(_)), "{e:?}");
}

/// The code a node call answers with for `e`.
fn code(e: &moor_node::error::Error) -> tonic::Code {
    e.code()
}

#[test]
fn a_tpm2_volume_grows_with_the_key_its_stage_opened_with_on_its_own_tpm_only() {
    if let Some(why) = missing_tools() {
        eprintln!("skipped: {why}");
        return;
    }
    let mut node_a = Swtpm::start("grow-a");
    let node_b = Swtpm::start("grow-b");
    let tpm_a = node_a.tools(&node_a.key_dir());
    let raw = [0x42; 32];
    let kek = Kek::new("cluster-1", &raw).expect("kek");
    let secrets: HashMap<String, String> = secret_entries("cluster-1", &raw).into_iter().collect();
    let wrapped = Dek::generate()
        .expect("dek")
        .wrap(&kek, "vol-1")
        .expect("wrap")
        .encode();
    // The first stage on node a: its TPM's key made, the LUKS header made with the key.
    let req = luks::encrypted_stage_req("vol-1", "tpm2", &wrapped, &secrets);
    let header = node_a.root.join("luks.img");
    luks::luks_format(&header, &luks::stage_key(&req, &tpm_a));
    let record = luks::crypt_record("vol-1", Some("tpm2"), &wrapped);

    // NodeExpandVolume on node a with the node-expand secret: the key opens the header.
    let key = validate::expand_key("vol-1", &record, &secrets, &tpm_a).expect("expand key");
    assert!(
        luks::opens(&header, key.key.expose()),
        "the expansion's key is the stage's"
    );
    assert_eq!(key.wrapped, wrapped);
    // The cluster half alone (what the expansion took before it combined): no slot.
    let alone = kek
        .unwrap(
            &moor_runtime::keys::WrappedDek::decode(&wrapped).expect("decode"),
            "vol-1",
        )
        .expect("unwrap");
    assert!(!luks::opens(&header, alone.expose()));

    // Node b, whose TPM has a key of its own: a key, which no slot takes.
    let tpm_b = node_b.tools(&node_b.key_dir());
    tpm_b.ensure_key().expect("node b's key");
    let key = validate::expand_key("vol-1", &record, &secrets, &tpm_b).expect("a key");
    assert!(!luks::opens(&header, key.key.expose()));
    // A node whose TPM has no key for moor: FAILED_PRECONDITION, and no key is made.
    let empty = node_b.root.join("no-key");
    let e = validate::expand_key("vol-1", &record, &secrets, &node_b.tools(&empty))
        .expect_err("no key");
    assert_eq!(code(&e), tonic::Code::FailedPrecondition, "{e}");
    assert!(!empty.join("hmac.priv").exists(), "expand made a key");

    // Node a's TPM hangs (swtpm stopped: its socket accepts, nothing answers): each call ends
    // at the deadline, UNAVAILABLE, at the expansion and at a stage alike.
    let hung = node_a
        .tools(&node_a.key_dir())
        .with_deadline(Duration::from_secs(3));
    let pid = node_a.pid();
    rustix::process::kill_process(pid, rustix::process::Signal::STOP).expect("SIGSTOP");
    let e = validate::expand_key("vol-1", &record, &secrets, &hung).expect_err("hung");
    let stage = validate::stage_with_tpm(&req, Path::new(luks::KUBELET), &hung);
    rustix::process::kill_process(pid, rustix::process::Signal::CONT).expect("SIGCONT");
    assert_eq!(code(&e), tonic::Code::Unavailable, "{e}");
    assert!(e.to_string().contains("did not answer within"), "{e}");
    let e = stage.expect_err("hung at stage");
    assert_eq!(code(&e), tonic::Code::Unavailable, "{e}");
    // Answering again: the same key.
    let key = validate::expand_key("vol-1", &record, &secrets, &tpm_a).expect("again");
    assert!(luks::opens(&header, key.key.expose()));

    // Gone: UNAVAILABLE.
    node_a.stop();
    let e = validate::expand_key("vol-1", &record, &secrets, &tpm_a).expect_err("gone");
    assert_eq!(code(&e), tonic::Code::Unavailable, "{e}");
}

#[test]
fn a_key_sealed_to_pcrs_refuses_once_they_change_and_gives_the_same_half_after_a_reboot() {
    if let Some(why) = missing_tools() {
        eprintln!("skipped: {why}");
        return;
    }
    let mut node = Swtpm::start("pcr");
    let sealed = node
        .tools(&node.key_dir())
        .with_pcrs("sha256:7")
        .expect("a selection");
    let other_pcr = node
        .tools(&node.key_dir())
        .with_pcrs("sha256:8")
        .expect("a selection");
    let unsealed = node.tools(&node.key_dir());
    for tpm in [&sealed, &other_pcr, &unsealed] {
        tpm.ensure_key().expect("the node's key");
    }
    assert!(node.key_dir().join("hmac-sha256_7.priv").is_file());
    let kek = Kek::new("cluster-1", &[0x42; 32]).expect("kek");
    let wrapped = Dek::generate()
        .expect("dek")
        .wrap(&kek, "vol-1")
        .expect("wrap");
    let cluster_half = kek.unwrap(&wrapped, "vol-1").expect("unwrap");
    let first = combine(&cluster_half, &sealed, "vol-1").expect("PCRs unchanged");
    let again = combine(&cluster_half, &sealed, "vol-1").expect("PCRs unchanged");
    assert_eq!(
        first.expose(),
        again.expose(),
        "the same half at each stage"
    );
    let by_8 = combine(&cluster_half, &other_pcr, "vol-1").expect("PCR 8");
    assert_ne!(
        by_8.expose(),
        first.expose(),
        "each sealing is a key of its own"
    );

    // PCR 7 changes (another Secure Boot state): the key sealed to it refuses, saying why;
    // the TPM still serves the rest.
    node.extend_pcr(7);
    let e = combine(&cluster_half, &sealed, "vol-1").expect_err("PCR 7 changed");
    assert!(
        matches!(&e, KeyError::Refused(m)
            if m.contains("sealed to the PCRs sha256:7") && m.contains("policy check failed")),
        "{e:?}"
    );
    assert_eq!(
        combine(&cluster_half, &other_pcr, "vol-1")
            .expect("PCR 8 unchanged")
            .expose(),
        by_8.expose()
    );
    assert!(combine(&cluster_half, &unsealed, "vol-1").is_ok());

    // A reboot into the same state (PCRs reset): the same half again.
    node.restart();
    assert_eq!(
        combine(&cluster_half, &sealed, "vol-1")
            .expect("after the reboot")
            .expose(),
        first.expose()
    );
}

/// The PCRs the rotation tests' node halves are sealed to.
const ROTATION_PCRS: &str = "sha256:7";

/// A `tpm2` volume `vol` of a rotation test: a swtpm whose key is sealed to
/// [`ROTATION_PCRS`], the cluster KEK (`cluster-1`, bytes 0x42), the old and new data keys,
/// wrapped, and the passphrases they make with the node's half.
struct TpmVolume {
    node: Swtpm,
    tpm: std::sync::Arc<dyn moor_runtime::keys::tpm2::Tpm>,
    new: Dek,
    old_wrapped: moor_runtime::keys::WrappedDek,
    new_wrapped: moor_runtime::keys::WrappedDek,
    old_key: Dek,
    new_key: Dek,
}

fn tpm_volume(name: &str, vol: &str) -> TpmVolume {
    let node = Swtpm::start(name);
    let tpm = node
        .tools(&node.key_dir())
        .with_pcrs(ROTATION_PCRS)
        .expect("a selection");
    tpm.ensure_key().expect("the node's key");
    let tpm: std::sync::Arc<dyn moor_runtime::keys::tpm2::Tpm> = std::sync::Arc::new(tpm);
    let kek = Kek::new("cluster-1", &[0x42; 32]).expect("kek");
    let (old, new) = (Dek::generate().expect("old"), Dek::generate().expect("new"));
    let combined = |dek: &Dek| {
        moor_runtime::keys::tpm2::NodeHalf::of(&*tpm, Some(ROTATION_PCRS), vol)
            .and_then(|h| h.combine(dek))
            .expect("combined")
    };
    let (old_key, new_key) = (combined(&old), combined(&new));
    TpmVolume {
        old_wrapped: old.wrap(&kek, vol).expect("wrap"),
        new_wrapped: new.wrap(&kek, vol).expect("wrap"),
        node,
        tpm,
        new,
        old_key,
        new_key,
    }
}

/// A `tpm2` volume's data key rotated through the engine (`Engine::rotate_dek`) on the real
/// cryptsetup, a LUKS2 header on a loop device, its node half from swtpm sealed to PCR 7:
/// after it only the new key combined with the node's half opens, the old combined key and
/// the new cluster half alone are refused, the journal names the new key; from each state a
/// crash leaves the header in (made by hand, the journal at the step after), the rotation
/// resumes, the TPM asked again; with PCR 7 changed it is refused, nothing touched. Needs
/// root (the loop device).
#[test]
fn a_tpm2_volume_s_data_key_rotates_on_real_cryptsetup_and_resumes_from_each_state() {
    use std::sync::Arc;

    use moor_node::engine::{Engine, EngineConfig, NodeTpm, RotateDek};
    use moor_node::journal::{Durability, Journal, RotationRecord, RotationStep, VolumeRecord};
    use moor_runtime::keys::source::KeySource;

    if let Some(why) = missing_tools() {
        eprintln!("skipped: {why}");
        return;
    }
    const VOL: &str = "vol-tpm2-rot";
    const PCRS: &str = ROTATION_PCRS;
    let TpmVolume {
        mut node,
        tpm,
        old_wrapped,
        new_wrapped,
        old_key,
        new_key,
        new,
        ..
    } = tpm_volume("rotate", VOL);
    // The header's slots 0 to 3, each named by the passphrase it opens with.
    let slots = |dev: &Path| -> Vec<(u32, &'static str)> {
        (0..4)
            .filter_map(|s| {
                if luks::slot_opens(dev, s, old_key.expose()) {
                    Some((s, "old"))
                } else if luks::slot_opens(dev, s, new_key.expose()) {
                    Some((s, "new"))
                } else {
                    None
                }
            })
            .collect()
    };
    // The header as each step leaves it, by hand (the first `n`), and the step journaled next.
    type Step = fn(&Path, &[u8], &[u8]);
    let by_hand: [Step; 4] = [
        |d, o, _| luks::add_key(d, 1, o, o),
        |d, o, _| luks::kill_slot(d, 0, o),
        |d, o, n| luks::add_key(d, 0, o, n),
        |d, _, n| luks::kill_slot(d, 1, n),
    ];
    let states = [
        (0, None),
        (1, Some(RotationStep::KillOld)),
        (2, Some(RotationStep::AddNew)),
        (3, Some(RotationStep::Record)),
        (4, Some(RotationStep::KillSpare)),
    ];
    for (n, step) in states {
        let sb = moor_privileged::Sandbox::new("tpm2-rotate");
        let dev = sb.loop_device("luks.img", 32 << 20);
        luks::format_device(&dev, old_key.expose());
        for hand in &by_hand[..n] {
            hand(&dev, old_key.expose(), new_key.expose());
        }
        let (journal, _) = Journal::open(&sb.state, false).expect("journal");
        let mut record = VolumeRecord::new(VOL);
        let mut crypt = luks::crypt_record(VOL, Some("tpm2"), &old_wrapped.encode());
        crypt.device.clone_from(&dev);
        crypt.tpm2_pcrs = Some(PCRS.to_owned());
        crypt.rotation = step.map(|step| RotationRecord {
            old_wrapped: old_wrapped.encode(),
            new_wrapped: new_wrapped.encode(),
            step,
        });
        record.crypt = Some(crypt);
        journal.put(&record, Durability::Power).expect("record");
        let os = Arc::new(moor_node::sys::linux::Linux::new(&sb.kubelet).expect("os"));
        let cfg = EngineConfig {
            kubelet_dir: sb.kubelet.clone(),
            ..EngineConfig::default()
        };
        let engine = Engine::new(os, Arc::new(journal), cfg);
        let req = RotateDek {
            volume_id: VOL.to_owned(),
            kek: Arc::new(KeySource::Secret(
                Kek::new("cluster-1", &[0x42; 32]).expect("kek"),
            )),
            old_wrapped: old_wrapped.clone(),
            new_wrapped: new_wrapped.clone(),
            pbkdf: "pbkdf2".to_owned(),
            tpm: NodeTpm(Arc::clone(&tpm)),
        };
        if n == 0 {
            // PCR 7 changed (another boot): refused before any step, the header untouched.
            node.extend_pcr(7);
            let e = engine.rotate_dek(&req).expect_err("PCR 7 changed");
            assert_eq!(code(&e), tonic::Code::FailedPrecondition, "{e}");
            assert!(e.to_string().contains("policy check failed"), "{e}");
            assert_eq!(slots(&dev), [(0, "old")]);
            node.restart();
        }
        let report = engine
            .rotate_dek(&req)
            .unwrap_or_else(|e| panic!("from state {n}: {e}"));
        eprintln!("tpm2 rotation from state {n}: ran {:?}", report.ran);
        assert_eq!(slots(&dev), [(0, "new")], "from state {n}");
        assert!(
            !luks::slot_opens(&dev, 0, new.expose()),
            "the cluster half alone opens nothing"
        );
        let c = engine
            .journal()
            .get(VOL)
            .and_then(|r| r.crypt)
            .expect("record");
        assert_eq!(c.wrapped_dek, Some(new_wrapped.encode()), "from state {n}");
        assert_eq!(c.rotation, None);
    }
}

/// A `tpm2` volume's data key rotated by a running moor-node (`moor.keys.v1.NodeKeys/
/// RotateVolumeKey` on its socket), its node half from swtpm as moor-node finds its TPM
/// (`TPM2TOOLS_TCTI`, `MOOR_TPM2_DIR`), sealed to PCR 7 as the mapping's record says: the
/// header on a loop device ends with the new combined key alone. Needs root and the binaries
/// (`cargo build --bins`).
#[test]
fn a_running_moor_node_rotates_a_tpm2_volume_s_key_with_its_tpm() {
    use moor_node::journal::{Durability, Journal, VolumeRecord};
    use moor_privileged::client::{Daemon, connect};
    use moor_proto::keys::v1 as keys;

    if let Some(why) = missing_tools() {
        eprintln!("skipped: {why}");
        return;
    }
    const VOL: &str = "vol-tpm2-node";
    const PCRS: &str = ROTATION_PCRS;
    let v = tpm_volume("node-rotate", VOL);
    let raw = [0x42; 32];
    let (old_wrapped, new_wrapped) = (v.old_wrapped.encode(), v.new_wrapped.encode());
    let (node, old_key, new_key, new) = (&v.node, &v.old_key, &v.new_key, &v.new);
    let sb = moor_privileged::Sandbox::new("tpm2-node-rotate");
    let _sweep = moor_privileged::LoopSweep(sb.root.clone());
    let dev = sb.loop_device("luks.img", 32 << 20);
    luks::format_device(&dev, old_key.expose());
    {
        // The mapping's record as a stage leaves it; `rotated`, so that the daemon's start
        // pass keeps it (this host has no device-mapper to open the mapping).
        let (journal, _) = Journal::open(&sb.state, false).expect("journal");
        let mut record = VolumeRecord::new(VOL);
        let mut crypt = luks::crypt_record(VOL, Some("tpm2"), &old_wrapped);
        crypt.device.clone_from(&dev);
        crypt.tpm2_pcrs = Some(PCRS.to_owned());
        crypt.rotated = true;
        record.crypt = Some(crypt);
        journal.put(&record, Durability::Power).expect("record");
    }
    let rt = moor_privileged::runtime();
    let node_sock = sb.root.join("node.sock");
    let tcti = format!("swtpm:host=127.0.0.1,port={}", node.port);
    let key_dir = node.key_dir().display().to_string();
    let mut daemon = rt.block_on(Daemon::start_program_env(
        "moor-node",
        &node_sock,
        &sb.node_args("n1", &[]),
        &[("TPM2TOOLS_TCTI", &tcti), ("MOOR_TPM2_DIR", &key_dir)],
    ));
    let answer = rt.block_on(async {
        let mut client =
            keys::node_keys_client::NodeKeysClient::new(connect(&node_sock).await.expect("socket"));
        client
            .rotate_volume_key(keys::RotateVolumeKeyRequest {
                volume_id: VOL.into(),
                old_wrapped_dek: old_wrapped.clone(),
                new_wrapped_dek: new_wrapped.clone(),
                luks_pbkdf: "pbkdf2".into(),
                secrets: secret_entries("cluster-1", &raw).into_iter().collect(),
            })
            .await
    });
    rt.block_on(daemon.stop());
    let answer = answer
        .expect("RotateVolumeKey of a tpm2 volume")
        .into_inner();
    assert_eq!(answer.steps.len(), 6, "{:?}", answer.steps);
    for (what, key, takes) in [
        ("the new combined key", new_key.expose(), true),
        ("the old combined key", old_key.expose(), false),
        ("the new cluster half alone", new.expose(), false),
    ] {
        assert_eq!(
            (0..4).any(|s| luks::slot_opens(&dev, s, key)),
            takes,
            "{what}"
        );
    }
    assert!(luks::slot_opens(&dev, 0, new_key.expose()));
}
