//! An encrypted volume's key paths against the real cryptsetup, on a host without dm-crypt:
//! the key the node's stage gets (`validate::stage_with_tpm`) makes a LUKS2 header on a
//! file, as the first stage's luksFormat does, and a key NodeExpandVolume gets
//! (`validate::expand_key`) is proven by `cryptsetup open --test-passphrase`, which reads the
//! header's key slots and needs no device-mapper. The mapping itself, its `resize` and the
//! filesystem's growth need dm-crypt: the VM lab's part (`lab/tests/vm_tpm2.rs`).

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use moor_node::journal::{CryptRecord, Phase};
use moor_node::validate;
use moor_proto::csi::v1 as csi;
use moor_runtime::keys::tpm2::Tpm;

/// The kubelet dir the requests' paths are under.
pub const KUBELET: &str = "/var/lib/kubelet";

/// NodeStageVolume of the encrypted `vol` of key source `kms`, its data key `wrapped`, the
/// stage secrets `secrets` (the device and staging paths are only checked, never used).
pub fn encrypted_stage_req(
    vol: &str,
    kms: &str,
    wrapped: &str,
    secrets: &HashMap<String, String>,
) -> csi::NodeStageVolumeRequest {
    let mut req = crate::requests::stage_req(
        vol,
        Path::new("/dev/loop0"),
        &Path::new(KUBELET).join("plugins/kubernetes.io/csi/moor.csi.io/x/globalmount"),
        "ext4",
    );
    req.volume_context = [
        ("encrypted", "true"),
        ("kmsID", kms),
        ("luksCipher", "aes-xts-plain64"),
        ("luksKeySize", "512"),
        ("luksSectorSize", "4096"),
        ("luksPBKDF", "pbkdf2"),
        ("encryptedDEK", wrapped),
    ]
    .into_iter()
    .map(|(a, b)| (a.to_owned(), b.to_owned()))
    .collect();
    req.secrets = secrets.clone();
    req
}

/// The journal's record of `vol`'s open mapping, as its stage writes it: the wrapped data
/// key and the key source (`None`: a record from before the source was kept).
pub fn crypt_record(vol: &str, kms: Option<&str>, wrapped: &str) -> CryptRecord {
    CryptRecord {
        name: format!("moor-{vol}"),
        device: PathBuf::from("/dev/loop0"),
        rdev: (7, 0),
        wrapped_dek: Some(wrapped.to_owned()),
        luks_uuid: None,
        fresh: false,
        phase: Phase::Done,
        boot: None,
        rotation: None,
        rotated: false,
        kms_id: kms.map(str::to_owned),
        tpm2_pcrs: None,
    }
}

/// The key NodeStageVolume opens (or first formats) `req`'s volume with, `tpm` the node's.
pub fn stage_key(req: &csi::NodeStageVolumeRequest, tpm: &dyn Tpm) -> Vec<u8> {
    let stage = validate::stage_with_tpm(req, Path::new(KUBELET), tpm).expect("the stage's key");
    stage
        .encryption
        .expect("an encrypted stage")
        .key
        .expose()
        .to_vec()
}

/// `cryptsetup args...` with `input` (a key, never on argv) on its standard input; whether it
/// succeeded, and its exit code.
pub fn run_cryptsetup(args: &[&str], input: &[u8]) -> (bool, Option<i32>) {
    let mut child = Command::new("cryptsetup")
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("cryptsetup runs");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(input)
        .expect("key written");
    let status = child.wait().expect("cryptsetup ends");
    (status.success(), status.code())
}

/// cryptsetup `args`, then `--key-file=- file`, with `key` on its standard input.
fn cryptsetup(args: &[&str], file: &Path, key: &[u8]) -> (bool, Option<i32>) {
    let file = file.display().to_string();
    let mut all = args.to_vec();
    all.extend(["--key-file=-", file.as_str()]);
    run_cryptsetup(&all, key)
}

/// A LUKS2 header on a 20 MiB file `file`, its key slot's passphrase `key` (moor's first
/// stage's luksFormat, with its fixed PBKDF cost).
pub fn luks_format(file: &Path, key: &[u8]) {
    std::fs::File::create(file)
        .and_then(|f| f.set_len(20 << 20))
        .expect("the file");
    format_device(file, key);
}

/// A LUKS2 header on `dev` (a file or a loop device), `key` in slot 0.
pub fn format_device(dev: &Path, key: &[u8]) {
    let (ok, code) = cryptsetup(
        &[
            "luksFormat",
            "--batch-mode",
            "--type",
            "luks2",
            "--pbkdf",
            "pbkdf2",
            "--pbkdf-force-iterations",
            "1000",
        ],
        dev,
        key,
    );
    assert!(ok, "luksFormat failed ({code:?})");
}

/// Whether `slot` of the header on `dev` opens with `key` (`open --test-passphrase
/// --key-slot`).
pub fn slot_opens(dev: &Path, slot: u32, key: &[u8]) -> bool {
    let s = slot.to_string();
    cryptsetup(&["open", "--test-passphrase", "--key-slot", &s], dev, key).0
}

/// `luksAddKey` of `new` into `slot` of `dev`, opened by `opening`, by hand: both keys on
/// one stdin, as moor's rotation gives them.
pub fn add_key(dev: &Path, slot: u32, opening: &[u8], new: &[u8]) {
    let d = dev.display().to_string();
    let s = slot.to_string();
    let both = [opening, new].concat();
    let (ok, code) = run_cryptsetup(
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
    assert!(ok, "luksAddKey into slot {slot} ({code:?})");
}

/// `luksKillSlot` of `slot` of `dev`, proven by `remaining` (another slot's key), by hand.
pub fn kill_slot(dev: &Path, slot: u32, remaining: &[u8]) {
    let d = dev.display().to_string();
    let s = slot.to_string();
    let (ok, code) = run_cryptsetup(
        &[
            "luksKillSlot",
            "--key-file=-",
            "--keyfile-size",
            "32",
            &d,
            &s,
        ],
        remaining,
    );
    assert!(ok, "luksKillSlot {slot} ({code:?})");
}

/// Whether a key slot of `file`'s LUKS header takes `key` (`cryptsetup open
/// --test-passphrase`: no mapping made). Exit 2 is "no slot takes it"; anything else fails.
pub fn opens(file: &Path, key: &[u8]) -> bool {
    match cryptsetup(&["open", "--test-passphrase", "--type", "luks2"], file, key) {
        (true, _) => true,
        (false, Some(2)) => false,
        (false, code) => panic!("cryptsetup open --test-passphrase failed ({code:?})"),
    }
}
