//! The `kmip` key source against a real KMIP server: PyKMIP 0.11's `pykmip-server`, with TLS
//! and client certificates this test makes (openssl). moor creates and activates a KEK on the
//! server, wraps a DEK through it and unwraps it for its volume only; the server's refusals
//! (another volume's record, an unknown key) are `Refused`, a server that is gone is
//! `Unavailable`. NodeExpandVolume's key of a `kmip` volume (`validate::expand_key`) is the
//! key its stage made the LUKS header with (the real cryptsetup's `--test-passphrase`; the
//! mapping's resize needs dm-crypt, not in this host's kernel).
//!
//! Needs the server (`bash .ci/pykmip` installs it from PyPI and prints
//! `MOOR_PYKMIP_SERVER=...`; the default place is looked at too) and the `openssl` program;
//! skipped, saying why, without them. It needs no root: it is here beside the other tests that
//! run the real programs.

use std::collections::HashMap;
use std::net::{TcpListener, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use moor_node::validate;
use moor_privileged::luks;
use moor_runtime::keys::kmip::{
    self, KMIP_CA_CERT_KEY, KMIP_CLIENT_CERT_KEY, KMIP_CLIENT_KEY_KEY, KMIP_ENDPOINT_KEY,
    KMIP_TLS_SERVER_NAME_KEY, KMIP_UNIQUE_IDENTIFIER_KEY, KmipConfig,
};
use moor_runtime::keys::tpm2::Tpm2Tools;
use moor_runtime::keys::{Dek, KeyError};

/// Where `.ci/pykmip` puts the server when not told otherwise.
const DEFAULT_SERVER: &str = "/var/tmp/moor-pykmip/bin/pykmip-server";

/// How long the server may take to listen (Python and SQLAlchemy start slowly on a busy box).
const LISTEN_DEADLINE: Duration = Duration::from_secs(120);

/// The server program, or why the test is skipped.
fn server_program() -> Result<PathBuf, String> {
    let path = std::env::var_os("MOOR_PYKMIP_SERVER")
        .map_or_else(|| PathBuf::from(DEFAULT_SERVER), PathBuf::from);
    if !path.is_file() {
        return Err(format!(
            "no PyKMIP server at {} (run `bash .ci/pykmip`, set MOOR_PYKMIP_SERVER)",
            path.display()
        ));
    }
    if Command::new("openssl").arg("version").output().is_err() {
        return Err("no openssl program to make the test's certificates".into());
    }
    Ok(path)
}

/// Runs `openssl` with `args` in `dir`; panics with its stderr when it fails.
fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("openssl runs");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A CA named `name` in `dir` (`<name>.pem`, `<name>.key`). Every key is ECDSA P-256:
/// PyKMIP's TLS 1.2 suite offers AES-GCM only with ECDSA (with RSA only CBC suites, which
/// rustls does not speak).
fn ca(dir: &Path, name: &str) {
    let (pem, key) = (format!("{name}.pem"), format!("{name}.key"));
    openssl(
        dir,
        &[
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-days",
            "2",
            "-subj",
            &format!("/CN={name}"),
            "-keyout",
            &key,
            "-out",
            &pem,
            "-addext",
            "basicConstraints=critical,CA:TRUE",
            "-addext",
            "keyUsage=critical,keyCertSign,cRLSign",
        ],
    );
}

/// A certificate `<leaf>.pem`, `<leaf>.key` for `cn` signed by the CA `ca`, with `ext`.
fn leaf(dir: &Path, ca: &str, leaf: &str, cn: &str, ext: &str) {
    let ext_file = format!("{leaf}.ext");
    std::fs::write(dir.join(&ext_file), ext).expect("ext file");
    let csr = format!("{leaf}.csr");
    openssl(
        dir,
        &[
            "req",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-subj",
            &format!("/CN={cn}"),
            "-keyout",
            &format!("{leaf}.key"),
            "-out",
            &csr,
        ],
    );
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            &csr,
            "-CA",
            &format!("{ca}.pem"),
            "-CAkey",
            &format!("{ca}.key"),
            "-CAcreateserial",
            "-days",
            "2",
            "-out",
            &format!("{leaf}.pem"),
            "-extfile",
            &ext_file,
        ],
    );
}

/// The server and its directory: killed and removed on drop, whatever the test did.
struct Server {
    child: Child,
    dir: PathBuf,
    port: u16,
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop();
        if std::thread::panicking() {
            let log = std::fs::read_to_string(self.dir.join("server.log")).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(40).collect();
            eprintln!(
                "the PyKMIP server's log, last lines first:\n{}",
                tail.join("\n")
            );
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Server {
    /// The server and the session processes it forks (its process group) killed.
    fn stop(&mut self) {
        let pid = rustix::process::Pid::from_child(&self.child);
        let _ = rustix::process::kill_process_group(pid, rustix::process::Signal::KILL);
        let _ = self.child.wait();
    }

    /// Certificates made, the server started, and listening.
    fn start(program: &Path) -> Self {
        // One dir per server: the tests of this file run at once.
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("moor-kmip-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("policies")).expect("test dir");
        // A free port: bound, read, released (the server binds it right after).
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        ca(&dir, "ca");
        ca(&dir, "other-ca");
        leaf(
            &dir,
            "ca",
            "server",
            "localhost",
            "basicConstraints=CA:FALSE\nsubjectAltName=DNS:localhost,IP:127.0.0.1\n\
             extendedKeyUsage=serverAuth\n",
        );
        for (issuer, name) in [("ca", "client"), ("other-ca", "stranger")] {
            leaf(
                &dir,
                issuer,
                name,
                "moor",
                "basicConstraints=CA:FALSE\nextendedKeyUsage=clientAuth\n",
            );
        }
        let conf = format!(
            "[server]\nhostname=127.0.0.1\nport={port}\ncertificate_path={d}/server.pem\n\
             key_path={d}/server.key\nca_path={d}/ca.pem\nauth_suite=TLS1.2\n\
             enable_tls_client_auth=True\npolicy_path={d}/policies\n\
             database_path={d}/kmip.db\nlogging_level=DEBUG\n",
            d = dir.display()
        );
        std::fs::write(dir.join("server.conf"), conf).expect("server.conf");
        let child = Command::new(program)
            .arg("-f")
            .arg(dir.join("server.conf"))
            .arg("-l")
            .arg(dir.join("server.log"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0)
            .spawn()
            .expect("pykmip-server starts");
        let mut server = Self { child, dir, port };
        let until = Instant::now() + LISTEN_DEADLINE;
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            if let Ok(Some(status)) = server.child.try_wait() {
                panic!("pykmip-server exited ({status}) before it listened on {port}");
            }
            assert!(
                Instant::now() < until,
                "pykmip-server did not listen on 127.0.0.1:{port} within {LISTEN_DEADLINE:?}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        server
    }

    /// The CSI secrets of the `kmip` source for this server, with the client `client` and
    /// the key `kek_id`.
    fn secrets(&self, client: &str, kek_id: &str) -> HashMap<&'static str, String> {
        let read = |f: &str| std::fs::read_to_string(self.dir.join(f)).expect("pem");
        HashMap::from([
            (KMIP_ENDPOINT_KEY, format!("127.0.0.1:{}", self.port)),
            (KMIP_TLS_SERVER_NAME_KEY, "localhost".to_owned()),
            (KMIP_CA_CERT_KEY, read("ca.pem")),
            (KMIP_CLIENT_CERT_KEY, read(&format!("{client}.pem"))),
            (KMIP_CLIENT_KEY_KEY, read(&format!("{client}.key"))),
            (KMIP_UNIQUE_IDENTIFIER_KEY, kek_id.to_owned()),
        ])
    }

    /// [`Self::secrets`], as a request's secrets hold them.
    fn owned_secrets(&self, client: &str, kek_id: &str) -> HashMap<String, String> {
        self.secrets(client, kek_id)
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v))
            .collect()
    }

    fn config(&self, client: &str, kek_id: &str) -> KmipConfig {
        let s = self.secrets(client, kek_id);
        KmipConfig::from_secrets(|k| s.get(k).map(String::as_str)).expect("config")
    }
}

/// A server holding a KEK moor made on it, and the KEK's id; None (the test skipped, saying
/// why) without the server program.
fn server_with_kek() -> Option<(Server, String)> {
    let program = match server_program() {
        Ok(p) => p,
        Err(why) => {
            eprintln!("skipped: {why}");
            return None;
        }
    };
    let server = Server::start(&program);
    let maker = server.config("client", "unset");
    let kek_id =
        kmip::create_kek(&mut maker.connect().expect("connect")).expect("a KEK on the server");
    Some((server, kek_id))
}

#[test]
fn pykmip_wraps_and_unwraps_a_dek_and_refuses_what_it_must() {
    let Some((mut server, kek_id)) = server_with_kek() else {
        return;
    };
    let config = server.config("client", &kek_id);

    let dek = Dek::generate().expect("dek");
    let wrapped = config.wrap(&dek, "vol-1").expect("wrap");
    assert_eq!(wrapped.kek_id(), kek_id);
    let stored = wrapped.encode();
    let back = moor_runtime::keys::WrappedDek::decode(&stored).expect("decode");
    let opened = config.unwrap(&back, "vol-1").expect("unwrap");
    assert_eq!(opened.expose(), dek.expose(), "the same key back");

    // Another volume's record: the server's GCM tag check refuses.
    let e = config.unwrap(&back, "vol-2").expect_err("another volume");
    assert!(matches!(&e, KeyError::Refused(_)), "{e:?}");

    // A key the server does not have.
    let missing = server.config("client", "999");
    let e = missing.wrap(&dek, "vol-1").expect_err("no such key");
    assert!(
        matches!(&e, KeyError::Refused(m) if m.contains("item not found")),
        "{e:?}"
    );

    // A client the server does not trust: the TLS handshake fails, nothing is wrapped.
    let stranger = server.config("stranger", &kek_id);
    let e = stranger.wrap(&dek, "vol-1").expect_err("an unknown client");
    assert!(matches!(&e, KeyError::Unavailable(_)), "{e:?}");

    // The server gone: unavailable, and says which server.
    server.stop();
    let e = config.unwrap(&back, "vol-1").expect_err("server gone");
    assert!(
        matches!(&e, KeyError::Unavailable(m) if m.contains(&format!("127.0.0.1:{}", server.port))),
        "{e:?}"
    );
}

#[test]
fn a_kmip_volume_grows_with_the_key_its_stage_opened_with() {
    let Some((mut server, kek_id)) = server_with_kek() else {
        return;
    };
    let secrets = server.owned_secrets("client", &kek_id);
    let dek = Dek::generate().expect("dek");
    let wrapped = server
        .config("client", &kek_id)
        .wrap(&dek, "vol-1")
        .expect("wrap")
        .encode();
    // The first stage: the key the server unwraps makes the LUKS header.
    let req = luks::encrypted_stage_req("vol-1", "kmip", &wrapped, &secrets);
    let tpm = Tpm2Tools::from_env();
    let header = server.dir.join("luks.img");
    luks::luks_format(&header, &luks::stage_key(&req, &tpm));

    // NodeExpandVolume with the node-expand secret (the same KMIP configuration): the server
    // unwraps the journal's wrapped key, and it opens the header; a record from before the
    // source was kept finds the server by the secrets.
    for kms in [Some("kmip"), None] {
        let record = luks::crypt_record("vol-1", kms, &wrapped);
        let key = validate::expand_key("vol-1", &record, &secrets, &tpm).expect("expand key");
        assert!(luks::opens(&header, key.key.expose()), "{kms:?}");
        assert_eq!(key.kek_id, kek_id);
    }
    let record = luks::crypt_record("vol-1", Some("kmip"), &wrapped);
    // A Secret's KEK in its place: INVALID_ARGUMENT naming the field the source needs.
    let not_kmip: HashMap<String, String> = moor_runtime::keys::secret_entries("k", &[1; 32])
        .into_iter()
        .collect();
    let e = validate::expand_key("vol-1", &record, &not_kmip, &tpm).expect_err("a Secret");
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e}");
    assert!(e.to_string().contains(KMIP_ENDPOINT_KEY), "{e}");
    // Another volume's journal record: the server refuses (GCM's tag), FAILED_PRECONDITION.
    let e = validate::expand_key("vol-2", &record, &secrets, &tpm).expect_err("vol-2");
    assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e}");
    // The server gone: UNAVAILABLE, nothing resized.
    server.stop();
    let e = validate::expand_key("vol-1", &record, &secrets, &tpm).expect_err("gone");
    assert_eq!(e.code(), tonic::Code::Unavailable, "{e}");
    assert!(e.to_string().contains("nothing was resized"), "{e}");
}

/// A `kmip` volume's data key rotated (docs/encryption.md, "Rotation"): the new data key
/// wrapped by the KMIP server (as the controller's `BeginVolumeKeyRotation` wraps it, with the
/// volume's own source), the node's request checked as `NodeKeys/RotateVolumeKey` checks it
/// (the KMIP secrets pick the KMIP source), and the slot steps run by the engine in the same
/// crash-safe order, the server unwrapping both keys, on a LUKS2 header the real cryptsetup
/// made: after it the new key alone opens it and the journal names it. With the server gone,
/// a further rotation is UNAVAILABLE and touches nothing.
#[test]
fn a_kmip_volume_data_key_is_rotated_with_keys_the_server_wraps() {
    use moor_node::engine::{Engine, EngineConfig};
    use moor_node::journal::{CryptRecord, Durability, Journal, VolumeRecord};
    use moor_proto::keys::v1::RotateVolumeKeyRequest;
    let Some((mut server, kek_id)) = server_with_kek() else {
        return;
    };
    let secrets = server.owned_secrets("client", &kek_id);
    let config = server.config("client", &kek_id);
    let keys: Vec<Dek> = (0..3).map(|_| Dek::generate().expect("dek")).collect();
    let wrapped: Vec<String> = keys
        .iter()
        .map(|k| config.wrap(k, "vol-1").expect("wrap").encode())
        .collect();
    let header = server.dir.join("rotated.img");
    luks::luks_format(&header, keys[0].expose());
    let (state, kubelet) = (server.dir.join("state"), server.dir.join("kubelet"));
    std::fs::create_dir_all(&kubelet).expect("kubelet dir");
    let (journal, _) = Journal::open(&state, false).expect("journal");
    let mut record = VolumeRecord::new("vol-1");
    record.crypt = Some(CryptRecord {
        device: header.clone(),
        ..luks::crypt_record("vol-1", Some("kmip"), &wrapped[0])
    });
    journal.put(&record, Durability::Power).expect("record");
    let os = std::sync::Arc::new(moor_node::sys::linux::Linux::new(&kubelet).expect("os"));
    let cfg = EngineConfig {
        kubelet_dir: kubelet,
        ..EngineConfig::default()
    };
    let engine = Engine::new(os, std::sync::Arc::new(journal), cfg);
    let request = |old: &str, new: &str| {
        moor_node::keys_service::rotate(
            &RotateVolumeKeyRequest {
                volume_id: "vol-1".into(),
                old_wrapped_dek: old.to_owned(),
                new_wrapped_dek: new.to_owned(),
                luks_pbkdf: "pbkdf2".into(),
                secrets: secrets.clone(),
            },
            moor_node::engine::NodeTpm::from_env(),
        )
        .expect("a KMIP rotation's request")
    };
    let report = engine
        .rotate_dek(&request(&wrapped[0], &wrapped[1]))
        .expect("rotated");
    assert_eq!(report.kek_id, kek_id);
    assert_eq!(report.ran.len(), 6, "{:?}", report.ran);
    assert!(
        luks::opens(&header, keys[1].expose()),
        "the new key opens it"
    );
    assert!(
        !luks::opens(&header, keys[0].expose()),
        "the old key no longer"
    );
    let named = engine.journal().get("vol-1").and_then(|r| r.crypt);
    assert_eq!(
        named.and_then(|c| c.wrapped_dek).as_deref(),
        Some(wrapped[1].as_str())
    );
    // The server gone: nothing can be unwrapped, nothing is touched.
    let next = request(&wrapped[1], &wrapped[2]);
    server.stop();
    let e = engine.rotate_dek(&next).expect_err("server gone");
    assert!(e.to_string().contains("nothing was rotated"), "{e}");
    assert!(luks::opens(&header, keys[1].expose()), "still the new key");
    assert!(!luks::opens(&header, keys[2].expose()));
}

/// The controller's half of a `kmip` volume's data key rotation, through a real
/// moor-controller: CreateVolume wraps the first key through the server, Begin has the server
/// wrap a new one (the record's pending key, a key the server unwraps for this volume to
/// another data key), Finish promotes it; Begin with a Secret's KEK instead is refused,
/// nothing written.
#[test]
fn a_kmip_volume_rotation_is_begun_and_finished_by_the_controller() {
    use moor_privileged::client::{Daemon, connect};
    use moor_proto::csi::v1 as csi;
    use moor_proto::keys::v1 as keys;
    let Some((mut server, kek_id)) = server_with_kek() else {
        return;
    };
    let secrets = server.owned_secrets("client", &kek_id);
    let config = server.config("client", &kek_id);
    let rt = moor_privileged::runtime();
    let (sock, data) = (server.dir.join("controller.sock"), server.dir.join("ctl"));
    let data = data.display().to_string();
    let mut controller = rt.block_on(Daemon::start_program(
        "moor-controller",
        &sock,
        &["--node-id", "n1", "--data-dir", &data],
    ));
    let (mut ctl, mut ck) = rt.block_on(async {
        (
            csi::controller_client::ControllerClient::new(connect(&sock).await.expect("socket")),
            keys::controller_keys_client::ControllerKeysClient::new(
                connect(&sock).await.expect("socket"),
            ),
        )
    });
    let volume = rt
        .block_on(
            ctl.create_volume(moor_privileged::requests::encrypted_create_req(
                "pvc-kmip",
                16 << 20,
                "kmip",
                &[],
                &secrets,
            )),
        )
        .expect("CreateVolume")
        .into_inner()
        .volume
        .expect("volume");
    let id = volume.volume_id;
    let unwrap = |text: &str| {
        let w = moor_runtime::keys::WrappedDek::decode(text).expect("decode");
        assert_eq!(w.kek_id(), kek_id, "wrapped by the server's KEK");
        config.unwrap(&w, &id).expect("the server unwraps it")
    };
    let not_kmip: HashMap<String, String> = moor_runtime::keys::secret_entries("k", &[1; 32])
        .into_iter()
        .collect();
    let begin = |ck: &mut keys::controller_keys_client::ControllerKeysClient<_>, s| {
        rt.block_on(
            ck.begin_volume_key_rotation(keys::BeginVolumeKeyRotationRequest {
                volume_id: id.clone(),
                secrets: s,
                if_rotations: None,
            }),
        )
    };
    let e = begin(&mut ck, not_kmip).expect_err("a Secret's KEK");
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    let begun = begin(&mut ck, secrets.clone())
        .expect("BeginVolumeKeyRotation")
        .into_inner();
    assert_eq!(
        begun.current_wrapped_dek,
        volume.volume_context["encryptedDEK"]
    );
    let (old, new) = (
        unwrap(&begun.current_wrapped_dek),
        unwrap(&begun.pending_wrapped_dek),
    );
    assert_ne!(old.expose(), new.expose(), "a new data key");
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
    assert_eq!(done.rotations, 1);
    rt.block_on(controller.stop());
    server.stop();
}
