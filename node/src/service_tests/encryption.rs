//! Encrypted volumes (docs/encryption.md): LUKS2 made on a blank device at the first stage,
//! opened at each stage with the data key the stage secret's KEK unwraps, closed at unstage
//! after the filesystem, resized before it grows; each step resumable, and a wrong or missing
//! key opening nothing. The fake's cryptsetup checks the key it reads on stdin.

use moor_runtime::keys::{Dek, Kek};

use super::*;

/// The mapping of the harness's volume.
pub(super) const MAPPER: &str = "/dev/mapper/moor-vol-1";

/// A volume's keys: the KEK of the stage secret, and the data key wrapped for `vol-1`.
pub(super) struct Keys {
    pub(super) secrets: HashMap<String, String>,
    pub(super) wrapped: String,
    pub(super) dek: Dek,
}

pub(super) fn keys(kek_byte: u8) -> Keys {
    let raw = [kek_byte; 32];
    let kek = Kek::new("kek-1", &raw).expect("kek");
    let dek = Dek::generate().expect("dek");
    let wrapped = dek.wrap(&kek, "vol-1").expect("wrap").encode();
    let secrets = moor_runtime::keys::secret_entries("kek-1", &raw)
        .into_iter()
        .collect();
    Keys {
        secrets,
        wrapped,
        dek,
    }
}

/// NodeStageVolume of the encrypted `vol-1` with `cap`, its data key `k.wrapped`, the stage
/// secret `k.secrets`.
pub(super) fn encrypted_req(cap: csi::VolumeCapability, k: &Keys) -> csi::NodeStageVolumeRequest {
    let mut req = stage_req(cap);
    req.volume_context = [
        ("encrypted", "true"),
        ("kmsID", "secret"),
        ("luksCipher", "aes-xts-plain64"),
        ("luksKeySize", "512"),
        ("luksSectorSize", "4096"),
        ("luksPBKDF", "pbkdf2"),
        ("encryptedDEK", k.wrapped.as_str()),
    ]
    .into_iter()
    .map(|(a, b)| (a.to_owned(), b.to_owned()))
    .collect();
    req.secrets = k.secrets.clone();
    req
}

pub(super) async fn stage_encrypted(
    h: &Harness,
    cap: csi::VolumeCapability,
    k: &Keys,
) -> Result<(), tonic::Status> {
    h.svc
        .node_stage_volume(Request::new(encrypted_req(cap, k)))
        .await
        .map(drop)
}

/// The tools run, as `program subcommand-or-device`.
pub(super) fn tools(h: &Harness) -> Vec<String> {
    tool_calls(h)
        .into_iter()
        .filter_map(|c| match c {
            Call::Tool(p, a) if p == "cryptsetup" => Some(format!("cryptsetup {}", a[0])),
            Call::Tool(p, a) => Some(format!("{p} {}", a.last().cloned().unwrap_or_default())),
            _ => None,
        })
        .collect()
}

/// No key byte in any argument the fake saw, nor in the journal.
pub(super) fn no_key_anywhere(h: &Harness, k: &Keys) {
    let hex: String = k.dek.expose().iter().map(|b| format!("{b:02x}")).collect();
    let kek = &k.secrets["kek"];
    for c in h.os.calls() {
        let text = format!("{c:?}");
        assert!(
            !text.contains(&hex) && !text.contains(kek.as_str()),
            "{text}"
        );
    }
    let log = std::fs::read(h.state.join(journal::LOG_FILE)).unwrap_or_default();
    let log = String::from_utf8_lossy(&log);
    assert!(!log.contains(&hex) && !log.contains(kek.as_str()));
    let raw = k.dek.expose();
    assert!(!log.as_bytes().windows(raw.len()).any(|w| w == raw));
}

#[tokio::test]
async fn the_first_stage_makes_luks2_opens_it_and_formats_the_mapping_and_the_next_only_opens() {
    let h = harness();
    let k = keys(7);
    stage_encrypted(&h, ext4(), &k).await.expect("stage");
    assert_eq!(
        tools(&h),
        [
            "cryptsetup luksFormat",
            "cryptsetup open",
            &format!("mkfs.ext4 {MAPPER}"),
        ]
    );
    // The key went on stdin: luksFormat and open read it from `-`.
    for c in tool_calls(&h) {
        if let Call::Tool(p, a) = c
            && p == "cryptsetup"
        {
            assert!(a.contains(&"--key-file=-".to_owned()), "{a:?}");
            assert!(a.contains(&DEV.to_owned()), "of the device: {a:?}");
        }
    }
    assert!(h.os.luks_opens_with(DEV, k.dek.expose()));
    let mounted = h.os.calls().into_iter().find_map(|c| match c {
        Call::MountFs(m) => Some(m),
        _ => None,
    });
    assert_eq!(mounted.expect("mounted").device, PathBuf::from(MAPPER));
    let record = h.engine.journal().get("vol-1").expect("record");
    let crypt = record.crypt.expect("the mapping's record");
    assert_eq!(crypt.name, "moor-vol-1");
    assert_eq!(crypt.phase, journal::Phase::Done);
    assert!(
        !crypt.fresh,
        "the filesystem is made: never formatted again"
    );
    assert_eq!(
        record.stage.expect("staged").device,
        PathBuf::from(MAPPER),
        "the stage is of the mapping"
    );
    no_key_anywhere(&h, &k);

    // A retry does nothing.
    h.os.clear_calls();
    stage_encrypted(&h, ext4(), &k).await.expect("again");
    assert!(tools(&h).is_empty(), "{:?}", tools(&h));

    // Unstage: the filesystem first, then the mapping; the journal forgets both.
    h.os.clear_calls();
    h.svc
        .node_unstage_volume(Request::new(unstage_req()))
        .await
        .expect("unstage");
    let calls = h.os.calls();
    let unmount = calls
        .iter()
        .position(|c| matches!(c, Call::Unmount(p, _) if p == Path::new(STAGING)))
        .expect("unmounted");
    let close = calls
        .iter()
        .position(|c| matches!(c, Call::Tool(p, a) if p == "cryptsetup" && a[0] == "close"))
        .expect("closed");
    assert!(unmount < close, "{calls:?}");
    assert!(h.os.luks_mappings().is_empty());
    assert!(h.engine.journal().get("vol-1").is_none());

    // The next stage opens it, and makes nothing.
    h.os.clear_calls();
    stage_encrypted(&h, ext4(), &k).await.expect("stage again");
    assert_eq!(
        tools(&h),
        ["cryptsetup open", &format!("e2fsck {MAPPER}")],
        "no luksFormat, no mkfs; the filesystem checked on the mapping"
    );
    assert_eq!(h.os.mount_depth(STAGING), 1);
    no_key_anywhere(&h, &k);
}

#[test]
fn the_checked_request_shows_no_key_byte() {
    let k = keys(7);
    let stage = crate::validate::stage(&encrypted_req(ext4(), &k), Path::new(K)).expect("valid");
    let enc = stage.encryption.as_ref().expect("encrypted");
    assert_eq!(enc.key.expose(), k.dek.expose(), "the data key, unwrapped");
    for text in [format!("{stage:?}"), format!("{stage:#?}")] {
        no_secret_in(&text, &k);
        assert!(text.contains("Dek(..)"), "{text}");
    }
}

/// The value after `flag` in the luksFormat's arguments.
fn luks_format_flag(h: &Harness, flag: &str) -> Option<String> {
    tool_calls(h).into_iter().find_map(|c| match c {
        Call::Tool(p, a) if p == "cryptsetup" && a[0] == "luksFormat" => a
            .iter()
            .position(|x| x == flag)
            .and_then(|i| a.get(i + 1).cloned()),
        _ => None,
    })
}

#[tokio::test]
async fn the_key_slots_pbkdf_has_a_fixed_cost_argon2_with_its_memory() {
    // pbkdf2 at cryptsetup's minimum; argon2id at 4 iterations and 64 MiB: without
    // `--pbkdf-memory`, cryptsetup's default (1 GiB, or half the node's memory) is needed at
    // every open (measured by the `vm_crypt` bench: 943 MiB, 35 s an open in the VM lab).
    let h = harness();
    let k = keys(7);
    stage_encrypted(&h, ext4(), &k).await.expect("stage");
    assert_eq!(luks_format_flag(&h, "--pbkdf").as_deref(), Some("pbkdf2"));
    assert_eq!(
        luks_format_flag(&h, "--pbkdf-force-iterations").as_deref(),
        Some("1000")
    );
    assert_eq!(luks_format_flag(&h, "--pbkdf-memory"), None);

    let h = harness();
    let mut req = encrypted_req(ext4(), &k);
    req.volume_context
        .insert("luksPBKDF".into(), "argon2id".into());
    h.svc
        .node_stage_volume(Request::new(req))
        .await
        .expect("stage with argon2id");
    assert_eq!(luks_format_flag(&h, "--pbkdf").as_deref(), Some("argon2id"));
    assert_eq!(
        luks_format_flag(&h, "--pbkdf-force-iterations").as_deref(),
        Some("4")
    );
    assert_eq!(
        luks_format_flag(&h, "--pbkdf-memory").as_deref(),
        Some("65536"),
        "argon2's memory is fixed, not cryptsetup's default"
    );
}

#[tokio::test]
async fn a_block_volume_is_its_mapping() {
    let h = harness();
    let k = keys(7);
    stage_encrypted(&h, block_cap(), &k).await.expect("stage");
    assert_eq!(tools(&h), ["cryptsetup luksFormat", "cryptsetup open"]);
    let target = format!("{K}/plugins/kubernetes.io/csi/volumeDevices/publish/pv1/uid");
    let mut publish = publish_req(block_cap(), false);
    publish.target_path = target.clone();
    h.svc
        .node_publish_volume(Request::new(publish))
        .await
        .expect("publish");
    let bound = h.os.calls().into_iter().find_map(|c| match c {
        Call::Bind(b) => Some(b),
        _ => None,
    });
    assert_eq!(bound.expect("bound").source, PathBuf::from(MAPPER));
    // Published: the mapping stays.
    assert_eq!(
        code(h.svc.node_unstage_volume(Request::new(unstage_req()))).await,
        Code::FailedPrecondition
    );
    assert_eq!(h.os.luks_mappings().len(), 1);
    h.svc
        .node_unpublish_volume(Request::new(unpublish_req(&target)))
        .await
        .expect("unpublish");
    h.svc
        .node_unstage_volume(Request::new(unstage_req()))
        .await
        .expect("unstage");
    assert!(h.os.luks_mappings().is_empty());
}

#[tokio::test]
async fn a_wrong_key_opens_nothing_and_says_which_key() {
    let h = harness();
    let k = keys(7);
    stage_encrypted(&h, ext4(), &k).await.expect("stage");
    h.svc
        .node_unstage_volume(Request::new(unstage_req()))
        .await
        .expect("unstage");
    // Another KEK under the same id: the wrapped key does not unwrap (AES-GCM's tag).
    h.os.clear_calls();
    let mut wrong = keys(8);
    wrong.wrapped = k.wrapped.clone();
    let s = stage_encrypted(&h, ext4(), &wrong)
        .await
        .expect_err("wrong KEK");
    assert_eq!(s.code(), Code::FailedPrecondition, "{s:?}");
    assert!(s.message().contains("kek-1"), "{}", s.message());
    assert!(tools(&h).is_empty(), "nothing run: {:?}", tools(&h));
    // The right KEK, but a data key that is not this volume's (its device holds another
    // volume's LUKS, or the record was swapped): cryptsetup finds no slot for it (exit 2).
    let other = keys(7);
    let s = stage_encrypted(&h, ext4(), &other)
        .await
        .expect_err("another data key");
    assert_eq!(s.code(), Code::FailedPrecondition, "{s:?}");
    assert!(
        s.message().contains("does not open volume \"vol-1\"") && s.message().contains("kek-1"),
        "{}",
        s.message()
    );
    assert!(h.os.luks_mappings().is_empty(), "nothing opened");
    assert_eq!(h.os.mount_depth(STAGING), 0);
    assert_eq!(mkfs_calls(&h), 0);
    assert!(h.engine.journal().get("vol-1").is_none());
    no_secret_in(s.message(), &k);
    no_secret_in(s.message(), &other);
    // A data key wrapped for another volume does not unwrap here either.
    let kek = Kek::new("kek-1", &[7; 32]).unwrap();
    let mut swapped = keys(7);
    swapped.wrapped = k.dek.wrap(&kek, "vol-2").unwrap().encode();
    let s = stage_encrypted(&h, ext4(), &swapped)
        .await
        .expect_err("another volume's key");
    assert_eq!(s.code(), Code::FailedPrecondition, "{s:?}");
    assert!(h.os.luks_mappings().is_empty());
}

fn no_secret_in(message: &str, k: &Keys) {
    let hex: String = k.dek.expose().iter().map(|b| format!("{b:02x}")).collect();
    assert!(!message.contains(&hex), "{message}");
    assert!(!message.contains(k.secrets["kek"].as_str()), "{message}");
}

/// A change to a stage request.
type Change = dyn Fn(&mut csi::NodeStageVolumeRequest);

#[tokio::test]
async fn a_missing_key_or_context_is_invalid_and_touches_nothing() {
    let k = keys(7);
    let cases: [(&str, Box<Change>); 9] = [
        // The KMIP source with a Secret source's fields: its endpoint is missing.
        (
            "KMIP_ENDPOINT",
            Box::new(|r| drop(r.volume_context.insert("kmsID".into(), "kmip".into()))),
        ),
        (
            "kmsID",
            Box::new(|r| drop(r.volume_context.insert("kmsID".into(), "vault".into()))),
        ),
        ("kek", Box::new(|r| drop(r.secrets.remove("kek")))),
        ("kekID", Box::new(|r| drop(r.secrets.remove("kekID")))),
        (
            "kek",
            Box::new(|r| drop(r.secrets.insert("kek".into(), "c2hvcnQ=".into()))),
        ),
        (
            "encryptedDEK",
            Box::new(|r| drop(r.volume_context.remove("encryptedDEK"))),
        ),
        (
            "encryptedDEK",
            Box::new(|r| {
                drop(
                    r.volume_context
                        .insert("encryptedDEK".into(), "v1:x:zz".into()),
                )
            }),
        ),
        (
            "volume_context.encrypted",
            Box::new(|r| drop(r.volume_context.insert("encrypted".into(), "yes".into()))),
        ),
        (
            "luksCipher",
            Box::new(|r| {
                drop(
                    r.volume_context
                        .insert("luksCipher".into(), "--debug".into()),
                )
            }),
        ),
    ];
    for (named, change) in cases {
        let h = harness();
        let mut req = encrypted_req(ext4(), &k);
        change(&mut req);
        let s = h
            .svc
            .node_stage_volume(Request::new(req))
            .await
            .expect_err("refused");
        assert_eq!(s.code(), Code::InvalidArgument, "{named}: {s:?}");
        assert!(s.message().contains(named), "{named}: {}", s.message());
        no_secret_in(s.message(), &k);
        assert!(h.os.calls().is_empty(), "{named}: {:?}", h.os.calls());
        assert!(h.engine.journal().get("vol-1").is_none());
    }
    // "false" is a volume in the clear, staged as any.
    let h = harness();
    let mut req = stage_req(ext4());
    req.volume_context
        .insert("encrypted".into(), "false".into());
    h.svc
        .node_stage_volume(Request::new(req))
        .await
        .expect("staged");
    assert_eq!(tools(&h), [format!("mkfs.ext4 {DEV}")]);
}

#[tokio::test]
async fn a_volume_in_the_clear_is_never_encrypted_in_place() {
    let h = harness();
    for (offset, bytes) in superblock("ext4") {
        h.os.write_device(DEV, offset, &bytes);
    }
    let s = stage_encrypted(&h, ext4(), &keys(7))
        .await
        .expect_err("refused");
    assert_eq!(s.code(), Code::FailedPrecondition, "{s:?}");
    assert!(s.message().contains("in the clear"), "{}", s.message());
    assert!(tool_calls(&h).is_empty());
    assert!(h.engine.journal().get("vol-1").is_none());
}

#[tokio::test]
async fn a_failed_mount_closes_the_mapping_and_a_failed_close_at_unstage_resumes() {
    let h = harness();
    let k = keys(7);
    // The mount fails after the open: the stage leaves nothing half-done (kubelet sends no
    // NodeUnstageVolume after a final error): the mapping it opened is closed, its record
    // gone; the retry opens it again and mounts the filesystem made before.
    h.os.fail_next("mount_fs", libc::EIO);
    stage_encrypted(&h, ext4(), &k)
        .await
        .expect_err("mount failed");
    assert!(
        h.os.luks_mappings().is_empty(),
        "{:?}",
        h.os.luks_mappings()
    );
    assert!(h.engine.journal().get("vol-1").is_none());
    h.os.clear_calls();
    stage_encrypted(&h, ext4(), &k).await.expect("retry");
    assert_eq!(
        tools(&h),
        ["cryptsetup open".to_owned(), format!("e2fsck {MAPPER}")],
        "opened again, formatted once"
    );
    assert_eq!(h.os.mount_depth(STAGING), 1);
    // The close fails after the unmount (busy): the unstage fails, its retry closes.
    h.os.fail_tool("cryptsetup", 5);
    assert_eq!(
        code(h.svc.node_unstage_volume(Request::new(unstage_req()))).await,
        Code::Internal
    );
    assert_eq!(h.os.mount_depth(STAGING), 0);
    assert_eq!(h.os.luks_mappings().len(), 1);
    h.svc
        .node_unstage_volume(Request::new(unstage_req()))
        .await
        .expect("retry");
    assert!(h.os.luks_mappings().is_empty());
    assert!(h.engine.journal().get("vol-1").is_none());
}

#[tokio::test]
async fn a_fresh_luks_volume_whose_mkfs_was_cut_short_is_formatted_and_only_it() {
    let (h, k) = first_stage_failing("mkfs.ext4", 1).await;
    // The mapping the failed stage opened is closed; the mkfs record of it dropped.
    assert!(h.os.luks_mappings().is_empty());
    let record = h.engine.journal().get("vol-1").expect("record");
    assert!(record.stage.is_none(), "{:?}", record.stage);
    assert!(
        record.crypt.is_some_and(|c| c.fresh),
        "the fresh LUKS volume is recorded"
    );
    // What the mapping of a fresh LUKS volume holds: noise (zeros decrypt to it).
    write_through_mapping(&h, &k, 1_000_000, &[0xAB; 16]);
    h.os.clear_calls();
    stage_encrypted(&h, ext4(), &k).await.expect("retry");
    assert_eq!(
        tools(&h),
        ["cryptsetup open".to_owned(), format!("mkfs.ext4 {MAPPER}")]
    );
    let record = h.engine.journal().get("vol-1").expect("record");
    assert!(!record.crypt.expect("crypt").fresh);
    // Once made, unknown data in the mapping is never formatted.
    h.svc
        .node_unstage_volume(Request::new(unstage_req()))
        .await
        .expect("unstage");
    h.os.close_all_mappings();
    h.os.clear_calls();
    stage_encrypted(&h, ext4(), &k).await.expect("stage");
    let mkfs = tools(&h).iter().filter(|t| t.starts_with("mkfs")).count();
    assert_eq!(mkfs, 0);
}

#[tokio::test]
async fn expansion_resizes_the_mapping_with_its_key_before_the_filesystem() {
    let h = harness();
    let k = keys(7);
    stage_encrypted(&h, ext4(), &k).await.expect("stage");
    h.os.resize_device(DEV, 2 * GIB);
    // Without the node-expand secret: INVALID_ARGUMENT, nothing resized.
    h.os.clear_calls();
    let s = h
        .svc
        .node_expand_volume(Request::new(expand_req(STAGING, 2 * GIB as i64)))
        .await
        .expect_err("no key");
    assert_eq!(s.code(), Code::InvalidArgument, "{s:?}");
    assert!(s.message().contains("node-expand"), "{}", s.message());
    assert!(tools(&h).is_empty());
    // Another KEK: FAILED_PRECONDITION, nothing resized.
    let mut req = expand_req(STAGING, 2 * GIB as i64);
    req.secrets = keys(8).secrets;
    let s = h
        .svc
        .node_expand_volume(Request::new(req))
        .await
        .expect_err("wrong key");
    assert_eq!(s.code(), Code::FailedPrecondition, "{s:?}");
    assert!(tools(&h).is_empty());
    // With it: the mapping, then the filesystem on it.
    let mut req = expand_req(STAGING, 2 * GIB as i64);
    req.secrets = k.secrets.clone();
    h.svc
        .node_expand_volume(Request::new(req))
        .await
        .expect("expand");
    grew_mapping_then_filesystem(&h);
    no_key_anywhere(&h, &k);
}

/// The expansion ran: the mapping resized (with a key the fake's cryptsetup took), then the
/// filesystem on it, to the device's 2 GiB less the LUKS header.
pub(super) fn grew_mapping_then_filesystem(h: &Harness) {
    assert_eq!(
        tools(h),
        ["cryptsetup resize", &format!("resize2fs {MAPPER}")]
    );
    let grown = h.os.block_device(Path::new(MAPPER)).expect("mapping").size;
    assert_eq!(grown, 2 * GIB - crate::sys::fake::FAKE_LUKS_HEADER);
}

fn reconcile(h: &Harness) -> Vec<crate::reconcile::Action> {
    crate::reconcile::Reconciler::new(Arc::clone(&h.engine), "moor.csi.io")
        .run()
        .expect("reconcile")
}

/// The actions on dm-crypt mappings a pass took or found.
fn crypt_actions(actions: &[crate::reconcile::Action]) -> Vec<String> {
    actions
        .iter()
        .filter(|a| a.kind().starts_with("crypt"))
        .map(|a| a.kind().to_owned())
        .collect()
}

#[tokio::test]
async fn reconciliation_closes_a_mapping_whose_stage_is_gone_and_only_that() {
    let h = harness();
    let k = keys(7);
    stage_encrypted(&h, ext4(), &k).await.expect("stage");
    // Staged: the mapping is the stage's, left open.
    assert!(crypt_actions(&reconcile(&h)).is_empty());
    assert_eq!(h.os.luks_mappings().len(), 1);
    // An unstage cut short after the unmount and before the close (the close fails, and
    // kubelet does not retry: it restarted, or the volume went elsewhere).
    h.os.fail_tool("cryptsetup", 5);
    assert_eq!(
        code(h.svc.node_unstage_volume(Request::new(unstage_req()))).await,
        Code::Internal
    );
    let record = h.engine.journal().get("vol-1").expect("record");
    assert!(record.stage.is_none(), "the journal says unstaged");
    assert_eq!(h.os.luks_mappings().len(), 1, "the mapping is still open");
    // moor-node's start: the mapping is closed, its record dropped, what it held kept.
    assert_eq!(crypt_actions(&reconcile(&h)), ["crypt_closed"]);
    assert!(h.os.luks_mappings().is_empty());
    assert!(h.engine.journal().get("vol-1").is_none());
    assert!(
        h.os.luks_opens_with(DEV, k.dek.expose()),
        "the volume is intact"
    );
    // Nothing more at the next pass, and the next stage opens it again.
    assert!(crypt_actions(&reconcile(&h)).is_empty());
    h.os.clear_calls();
    stage_encrypted(&h, ext4(), &k).await.expect("stage again");
    assert_eq!(
        tools(&h),
        ["cryptsetup open".to_owned(), format!("e2fsck {MAPPER}")]
    );
}

#[tokio::test]
async fn reconciliation_leaves_a_mapping_something_uses_though_the_journal_lost_its_stage() {
    let h = harness();
    let k = keys(7);
    stage_encrypted(&h, ext4(), &k).await.expect("stage");
    // The journal lost the staging, the filesystem is still mounted on the mapping.
    let mut record = h.engine.journal().get("vol-1").expect("record");
    record.stage = None;
    h.engine
        .journal()
        .put(&record, journal::Durability::Process)
        .expect("put");
    h.os.clear_calls();
    assert_eq!(crypt_actions(&reconcile(&h)), ["crypt_in_use"]);
    assert_eq!(h.os.luks_mappings().len(), 1, "left open");
    assert!(
        !tools(&h).iter().any(|t| t == "cryptsetup close"),
        "no close was tried"
    );
    assert_eq!(h.os.mount_depth(STAGING), 1);
}

#[tokio::test]
async fn a_mapping_open_under_the_volumes_name_on_another_device_is_not_used() {
    let h = harness();
    let k = keys(7);
    // Another device, LUKS opening with the same key, open under vol-1's mapping name.
    let other = "/dev/loop9";
    h.os.add_device(other, (7, 9), GIB);
    let run = |args: &[&str]| crate::sys::ToolRun {
        program: "cryptsetup".into(),
        args: args.iter().map(|a| (*a).to_owned()).collect(),
        deadline: std::time::Duration::from_secs(1),
    };
    h.os.run_tool_with_key(&run(&["luksFormat", "--key-file=-", other]), k.dek.expose())
        .expect("luksFormat");
    h.os.run_tool_with_key(
        &run(&["open", "--key-file=-", other, "moor-vol-1"]),
        k.dek.expose(),
    )
    .expect("open");
    h.os.clear_calls();
    let err = h
        .svc
        .node_stage_volume(Request::new(encrypted_req(ext4(), &k)))
        .await
        .expect_err("refused");
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    assert!(err.message().contains("7:9"), "{}", err.message());
    assert!(tools(&h).is_empty(), "nothing formatted, opened or made");
    assert_eq!(h.os.mount_depth(STAGING), 0);
    assert!(
        !h.os.luks_opens_with(DEV, k.dek.expose()),
        "the volume's device untouched"
    );
    assert_eq!(
        h.os.luks_mappings().get("moor-vol-1"),
        Some(&PathBuf::from(other)),
        "the other mapping left as it was"
    );
}

#[tokio::test]
async fn an_encrypted_rbd_volume_opens_on_its_mapped_image_and_closes_before_the_unmap() {
    use super::rbd::{rbd_harness, rbd_stage};
    let r = rbd_harness();
    let h = &r.h;
    let k = keys(7);
    // (A stage after the unmap is not shown here: the fake's LUKS volumes are per device
    // path, and the next map may give another one; the VM lab's tests stage again.)
    let mut req = encrypted_req(ext4(), &k);
    let rbd = rbd_stage("vol-1", ext4());
    req.publish_context = rbd.publish_context;
    req.secrets.extend(rbd.secrets);
    h.svc
        .node_stage_volume(Request::new(req))
        .await
        .expect("stage");
    // LUKS made on the image's mapped device, and the filesystem on the mapping.
    let under = h.os.luks_mappings().get("moor-vol-1").cloned();
    let mapped = under.expect("open on the mapped image");
    assert_ne!(mapped, PathBuf::from(DEV));
    assert!(h.os.luks_opens_with(&mapped, k.dek.expose()));
    // An unstage cut short at the close: the image stays mapped under the open mapping.
    h.os.fail_tool("cryptsetup", 5);
    assert_eq!(
        code(h.svc.node_unstage_volume(Request::new(unstage_req()))).await,
        Code::Internal
    );
    assert_eq!(h.os.luks_mappings().len(), 1);
    let unmapped = |r: &super::rbd::Rbd| {
        r.attacher
            .calls()
            .iter()
            .filter(|c| matches!(c, crate::attach::fake::AttachCall::Unmap(..)))
            .count()
    };
    assert_eq!(unmapped(&r), 0, "not unmapped under an open mapping");
    // Reconciliation closes the mapping first, then unmaps the image it sat on.
    let kinds: Vec<&str> = reconcile(h)
        .iter()
        .map(crate::reconcile::Action::kind)
        .filter(|k| matches!(*k, "crypt_closed" | "unmapped"))
        .collect();
    assert_eq!(kinds, ["crypt_closed", "unmapped"]);
    assert!(h.os.luks_mappings().is_empty());
    assert_eq!(unmapped(&r), 1);
    assert!(h.engine.journal().get("vol-1").is_none(), "nothing left");
}

/// Writes `bytes` at `offset` of what the LUKS volume on the harness's device holds, through a
/// mapping opened and closed by hand (as another tool would).
fn write_through_mapping(h: &Harness, k: &Keys, offset: u64, bytes: &[u8]) {
    use crate::sys::ToolRun;
    let run = |args: &[&str]| ToolRun {
        program: "cryptsetup".to_owned(),
        args: args.iter().map(|&a| a.to_owned()).collect(),
        deadline: std::time::Duration::from_secs(60),
    };
    h.os.run_tool_with_key(
        &run(&["open", "--type", "luks2", "--key-file=-", DEV, "by-hand"]),
        k.dek.expose(),
    )
    .expect("open by hand");
    h.os.write_device("/dev/mapper/by-hand", offset, bytes);
    h.os.run_tool(&run(&["close", "by-hand"]))
        .expect("close by hand");
}

/// Nothing the stage opened is left: no mapping, no mount, no record of the volume (or only
/// a fresh LUKS volume's, closed, when `fresh`).
fn nothing_left(h: &Harness, fresh: bool) {
    assert!(
        h.os.luks_mappings().is_empty(),
        "{:?}",
        h.os.luks_mappings()
    );
    assert_eq!(h.os.mount_depth(STAGING), 0);
    let record = h.engine.journal().get("vol-1");
    if fresh {
        let record = record.expect("the fresh LUKS volume's record");
        assert!(record.stage.is_none(), "{:?}", record.stage);
        let crypt = record.crypt.expect("crypt");
        assert!(crypt.fresh);
        assert_eq!(crypt.phase, journal::Phase::InProgress, "closed");
    } else {
        assert!(record.is_none(), "{record:?}");
    }
}

/// A LUKS2 header with no key slot (a first stage's luksFormat cut before its key slot, with
/// the node's journal lost): FAILED_PRECONDITION saying so and what to do, nothing opened,
/// and never formatted (the blank proof sees the header), encrypted or not, on every retry.
#[tokio::test]
async fn a_luks_header_without_a_key_slot_is_refused_failed_precondition_never_formatted() {
    let h = harness();
    let k = keys(7);
    h.os.luks_format_without_key_slot(DEV, "6d6f6f72-0000-4000-8000-000000000040");
    for _ in 0..2 {
        let s = stage_encrypted(&h, ext4(), &k).await.expect_err("refused");
        assert_eq!(s.code(), Code::FailedPrecondition, "{s:?}");
        for words in [
            "no key slot",
            "cut short",
            "re-create the volume",
            "not blank",
        ] {
            assert!(s.message().contains(words), "{words}: {}", s.message());
        }
        no_secret_in(s.message(), &k);
        assert!(tools(&h).is_empty(), "{:?}", tools(&h));
        nothing_left(&h, false);
    }
    // The blank proof refuses it.
    let size = h.os.block_device(Path::new(DEV)).expect("device").size;
    let content = h.engine.probe_device(Path::new(DEV), size).expect("probe");
    assert!(
        matches!(content, crate::superblock::Content::Luks { .. }),
        "{content:?}"
    );
    let s = h
        .svc
        .node_stage_volume(Request::new(stage_req(ext4())))
        .await
        .expect_err("not blank");
    assert_eq!(s.code(), Code::FailedPrecondition, "{s:?}");
    assert!(tools(&h).is_empty(), "nothing formatted: {:?}", tools(&h));
    assert!(h.os.luks_slots(DEV).is_empty());
}

/// moor's own luksFormat cut before its key slot (its journal's fresh record names the
/// header's UUID): made again, then opened and formatted.
#[tokio::test]
async fn moors_own_luks_format_cut_before_its_key_slot_is_made_again() {
    let (h, k) = first_stage_failing("cryptsetup", 137).await;
    let uuid = h
        .engine
        .journal()
        .get("vol-1")
        .and_then(|r| r.crypt)
        .and_then(|c| c.luks_uuid)
        .expect("the fresh record's UUID");
    h.os.luks_format_without_key_slot(DEV, &uuid);
    h.os.clear_calls();
    stage_encrypted(&h, ext4(), &k).await.expect("resumed");
    assert_eq!(
        tools(&h),
        [
            "cryptsetup luksFormat",
            "cryptsetup open",
            &format!("mkfs.ext4 {MAPPER}"),
        ]
    );
    assert!(h.os.luks_opens_with(DEV, k.dek.expose()));
}

/// A stage that opened the mapping and failed afterwards closes it, whatever step failed,
/// and journals the close; its retry fails the same way and leaks nothing either.
#[tokio::test]
async fn a_stage_failing_after_its_open_closes_the_mapping_at_every_step() {
    // The first stage: luksFormat, open, then a step fails.
    // A fresh LUKS volume's record stays (closed) while its filesystem is not made.
    for (step, fresh) in [("mkfs", true), ("mount", false)] {
        let h = harness();
        let k = keys(7);
        for _ in 0..2 {
            if step == "mkfs" {
                h.os.fail_tool("mkfs.ext4", 1);
            } else {
                h.os.fail_next("mount_fs", libc::EIO);
            }
            stage_encrypted(&h, ext4(), &k).await.expect_err(step);
            nothing_left(&h, fresh);
        }
        stage_encrypted(&h, ext4(), &k)
            .await
            .expect("then it stages");
        assert_eq!(h.os.mount_depth(STAGING), 1, "{step}");
    }
    // A later stage (the filesystem made): the check fails, or the mapping holds unknown data
    // (a complete LUKS header over a data area mkfs never finished).
    for step in ["e2fsck", "unknown data"] {
        let h = harness();
        let k = keys(7);
        stage_encrypted(&h, ext4(), &k).await.expect("stage");
        h.svc
            .node_unstage_volume(Request::new(unstage_req()))
            .await
            .expect("unstage");
        if step == "unknown data" {
            write_through_mapping(&h, &k, 0, &[0x5A; 8192]);
            for (offset, bytes) in superblock("ext4") {
                write_through_mapping(&h, &k, offset, &vec![0x5A; bytes.len()]);
            }
        }
        for _ in 0..2 {
            if step == "e2fsck" {
                h.os.fail_tool("e2fsck", 4);
            }
            h.os.clear_calls();
            let s = stage_encrypted(&h, ext4(), &k).await.expect_err(step);
            if step == "unknown data" {
                assert_eq!(s.code(), Code::FailedPrecondition, "{s:?}");
                assert!(s.message().contains("unknown data at offset 0"), "{s:?}");
                assert!(
                    !tools(&h).iter().any(|t| t.starts_with("mkfs")),
                    "never formatted: {:?}",
                    tools(&h)
                );
            }
            nothing_left(&h, false);
        }
    }
}

/// A failed stage that found the mapping open (an earlier stage's, in use) leaves it.
#[tokio::test]
async fn a_failed_stage_leaves_a_mapping_it_found_open() {
    let h = harness();
    let k = keys(7);
    stage_encrypted(&h, ext4(), &k).await.expect("stage");
    h.os.fail_next("mount_fs", libc::EIO);
    h.os.unmount(Path::new(STAGING), false).expect("unmount");
    stage_encrypted(&h, ext4(), &k)
        .await
        .expect_err("mount failed");
    assert_eq!(h.os.luks_mappings().len(), 1, "the mapping stays");
}

/// A harness whose first stage of the encrypted `vol-1` failed: `program`'s next run exited
/// `code`. Its keys.
async fn first_stage_failing(program: &str, code: i32) -> (Harness, Keys) {
    let h = harness();
    let k = keys(7);
    h.os.fail_tool(program, code);
    stage_encrypted(&h, ext4(), &k)
        .await
        .expect_err("the injected failure");
    (h, k)
}
