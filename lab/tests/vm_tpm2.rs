//! The `tpm2` key source on a real kernel (docs/encryption.md): a guest of the VM lab with a
//! TPM 2.0 (swtpm on the host, QEMU's `tpm-tis` device, the guest's `/dev/tpmrm0`), moor-node
//! in it. moor-controller on the host makes an encrypted volume of `kmsID: tpm2` (its DEK
//! wrapped by the provisioner secret's KEK: the cluster half); moor-node stages it: its TPM
//! makes the node's key at the first stage, and the LUKS passphrase is both halves combined.
//! The test shows:
//!
//! * the volume is LUKS2, what a pod writes is on the mapping and not in the clear in its file;
//! * unstaged and staged again, it opens with the same two halves (no second luksFormat);
//! * without the cluster half (a wrong KEK; a stage secret without `kek`) nothing opens;
//! * with the cluster half but another TPM key (the node's key blobs moved away: the node makes
//!   a new key in its TPM, as a node with another TPM would have) nothing opens: cryptsetup
//!   refuses the passphrase, FAILED_PRECONDITION;
//! * the blobs back, it opens again with its data;
//! * grown (ControllerExpandVolume, then NodeExpandVolume with the node-expand secret): the
//!   mapping takes the device's new size with both halves, then the filesystem; without the
//!   secret INVALID_ARGUMENT, with a wrong cluster KEK FAILED_PRECONDITION, nothing grown;
//! * a volume of a class sealed to PCR 16 (`tpm2PCRs`) opens while the PCR is as sealed, is
//!   refused once the guest extends it, and opens again once it is reset.
//!
//! Needs the VM lab, swtpm and tpm2-tools (Debian: `swtpm`, `tpm2-tools`; the guest runs the
//! host's tools); skipped, with the reason, without them.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use moor_lab::ceph::{ext4, publish};
use moor_lab::krbd_lab::start_node_in;
use moor_lab::vm::{Bridge, Vm};
use moor_privileged::client::Daemon;
use moor_privileged::requests::{unpublish_req, unstage_req};
use moor_privileged::{Sandbox, runtime};
use moor_proto::csi::v1 as csi;
use moor_proto::csi::v1::controller_client::ControllerClient;
use moor_proto::csi::v1::node_client::NodeClient;
use moor_runtime::contract::{BACKING_FILE_KEY, DEVICE_PATH_KEY};
use moor_runtime::keys::secret_entries;
use tonic::transport::Channel;

const MIB: i64 = 1 << 20;
/// What the pod writes: a line no filesystem or LUKS metadata holds.
const PATTERN: &str = "MOOR-TPM2-LAB-PLAINTEXT-7d30b2";
/// The cluster KEK, and one that is not it.
const KEK: [u8; 32] = [0x24; 32];
const WRONG_KEK: [u8; 32] = [0x25; 32];
/// The volume's size once grown, in MiB (made with 96).
const GROWN_MIB: i64 = 192;
/// How long swtpm may take to make its socket.
const SWTPM_DEADLINE: Duration = Duration::from_secs(60);

fn secrets(kek: &[u8]) -> HashMap<String, String> {
    secret_entries("cluster-kek", kek).into_iter().collect()
}

/// swtpm on the host, its state and control socket under `dir`; killed on drop.
struct Swtpm(Child);

impl Drop for Swtpm {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Swtpm {
    fn start(dir: &Path) -> (Self, PathBuf) {
        std::fs::create_dir_all(dir).expect("swtpm dir");
        let socket = dir.join("swtpm.sock");
        let child = Command::new("swtpm")
            .args(["socket", "--tpm2", "--tpmstate"])
            .arg(format!("dir={}", dir.display()))
            .arg("--ctrl")
            .arg(format!("type=unixio,path={}", socket.display()))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("swtpm starts");
        let mut tpm = Self(child);
        let until = Instant::now() + SWTPM_DEADLINE;
        while !socket.exists() {
            if let Ok(Some(status)) = tpm.0.try_wait() {
                panic!("swtpm exited ({status}) before making {}", socket.display());
            }
            assert!(
                Instant::now() < until,
                "swtpm made no socket {} within {SWTPM_DEADLINE:?}",
                socket.display()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        (tpm, socket)
    }
}

#[test]
fn a_tpm2_volume_opens_with_both_halves_only() {
    let test = "vm_tpm2";
    if !moor_lab::vm::available(test) {
        return;
    }
    for program in ["swtpm", "tpm2_createprimary"] {
        if Command::new(program).arg("--version").output().is_err() {
            eprintln!("{test}: skipped: no {program} (Debian: swtpm, tpm2-tools)");
            return;
        }
    }
    let sb = Sandbox::new("vm-tpm2");
    let (_swtpm, socket) = Swtpm::start(&sb.root.join("swtpm"));
    let bridge = Bridge::new("mtpm", 253);
    let vm = Vm::boot_for_dm_crypt_with(
        "moor-tpm2",
        &bridge,
        &sb,
        "1G",
        vec![
            "-chardev".into(),
            format!("socket,id=chrtpm,path={}", socket.display()),
            "-tpmdev".into(),
            "emulator,id=tpm0,chardev=chrtpm".into(),
            "-device".into(),
            "tpm-tis,tpmdev=tpm0".into(),
        ],
    );
    let log = sb.state.join("node.log");
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        vm.sh("test -c /dev/tpmrm0");
        runtime().block_on(life(&sb, &vm, &log));
    }));
    vm.clear_volumes(&sb.kubelet);
    if let Err(e) = result {
        eprintln!(
            "{test}: moor-node's log:\n{}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        std::panic::resume_unwind(e);
    }
}

/// The node's TPM key dir in the guest (a dir the guest writes).
fn key_dir(sb: &Sandbox) -> PathBuf {
    sb.state.join("tpm2")
}

async fn start_node(sb: &Sandbox, vm: &Vm, log: &Path) -> NodeClient<Channel> {
    let env = format!("MOOR_TPM2_DIR={}", key_dir(sb).display());
    start_node_in(
        vm,
        "node-c",
        &sb.kubelet,
        "moor-node",
        &[&env],
        &sb.state,
        log,
    )
    .await
}

/// The size of the filesystem mounted at `at` in the guest, in MiB.
fn fs_mib(vm: &Vm, at: &Path) -> i64 {
    let out = vm.sh(&format!("stat -f -c '%b %S' {}", at.display()));
    let mut it = out
        .split_whitespace()
        .map(|v| v.parse::<i64>().expect("stat -f"));
    let (blocks, size) = (it.next().expect("blocks"), it.next().expect("size"));
    blocks * size / MIB
}

/// A volume of a `tpm2` class (and `more` parameters) named and sized (MiB) as `(name, mib)`,
/// made by the controller, its file attached in the guest: the volume, its file, its device.
async fn tpm2_volume(
    ctl: &mut ControllerClient<Channel>,
    vm: &Vm,
    (name, mib): (&str, i64),
    more: &[(&str, &str)],
) -> (csi::Volume, String, String) {
    let mut parameters = HashMap::from([
        ("encrypted".to_owned(), "true".to_owned()),
        ("kmsID".to_owned(), "tpm2".to_owned()),
    ]);
    parameters.extend(more.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())));
    let v = ctl
        .create_volume(csi::CreateVolumeRequest {
            name: name.into(),
            capacity_range: Some(csi::CapacityRange {
                required_bytes: mib * MIB,
                limit_bytes: 0,
            }),
            volume_capabilities: vec![ext4()],
            parameters,
            secrets: secrets(&KEK),
            ..Default::default()
        })
        .await
        .expect("CreateVolume of a tpm2 class")
        .into_inner()
        .volume
        .expect("a volume");
    let file = moor_lab::vm::embedded_volume_file(ctl, &v, "node-c", ext4()).await;
    let dev = vm
        .sh(&format!("losetup -f --show {file}"))
        .trim()
        .to_string();
    (v, file, dev)
}

/// NodeStageVolume of `v` on its `(device, file)` at `staging`, the stage secret's KEK `kek`.
fn stage_request(
    v: &csi::Volume,
    (dev, file): (&str, &str),
    staging: &Path,
    kek: &[u8],
) -> csi::NodeStageVolumeRequest {
    csi::NodeStageVolumeRequest {
        volume_id: v.volume_id.clone(),
        publish_context: HashMap::from([
            (DEVICE_PATH_KEY.into(), dev.to_owned()),
            (BACKING_FILE_KEY.into(), file.to_owned()),
        ]),
        staging_target_path: staging.display().to_string(),
        volume_capability: Some(ext4()),
        secrets: secrets(kek),
        volume_context: v.volume_context.clone(),
    }
}

/// `s` is FAILED_PRECONDITION saying `says`, and no mapping is open.
fn refused_opening_nothing(vm: &Vm, s: &tonic::Status, says: &str) {
    assert_eq!(s.code(), tonic::Code::FailedPrecondition, "{s:?}");
    assert!(s.message().contains(says), "{}", s.message());
    assert!(
        mappings(vm).is_empty(),
        "nothing opened: {:?}",
        mappings(vm)
    );
}

/// The mappings open in the guest.
fn mappings(vm: &Vm) -> Vec<String> {
    vm.sh("dmsetup ls --target crypt 2>/dev/null | awk '$1 ~ /^moor-/ {print $1}'; true")
        .lines()
        .map(str::to_string)
        .collect()
}

async fn life(sb: &Sandbox, vm: &Vm, log: &Path) {
    let data = sb.data.join("controller").display().to_string();
    let csocket = sb.root.join("controller.sock");
    let mut controller = Daemon::start_program(
        "moor-controller",
        &csocket,
        &["--node-id", "node-c", "--data-dir", data.as_str()],
    )
    .await;
    let mut ctl = ControllerClient::new(
        moor_runtime::client::connect(&csocket)
            .await
            .expect("the controller's socket"),
    );
    let (v, file, dev) = tpm2_volume(&mut ctl, vm, ("pvc-tpm2", 96), &[]).await;
    let staging = sb.staging("pv-tpm2");
    let target = sb.target("pod-a", "pv-tpm2");
    let stage_req = |kek: &[u8]| stage_request(&v, (&dev, &file), &staging, kek);
    let mut node = start_node(sb, vm, log).await;

    // First stage: the node's TPM key made, LUKS2 made with both halves, a pod writes.
    node.node_stage_volume(stage_req(&KEK))
        .await
        .expect("first stage");
    for blob in ["hmac.pub", "hmac.priv"] {
        assert!(key_dir(sb).join(blob).is_file(), "the node's {blob}");
    }
    node.node_publish_volume(publish(&v.volume_id, &staging, &target, ext4()))
        .await
        .expect("publish");
    let written = target.join("secret.txt").display().to_string();
    vm.sh(&format!(
        "for i in $(seq 2000); do echo {PATTERN}; done | dd of={written} conv=fsync status=none; sync"
    ));
    assert_eq!(
        vm.sh(&format!("blkid -p -o value -s TYPE {dev}")).trim(),
        "crypto_LUKS"
    );
    let raw = std::fs::read(&file).expect("the volume's file");
    assert!(
        !raw.windows(PATTERN.len()).any(|w| w == PATTERN.as_bytes()),
        "the volume's file shows no plaintext"
    );
    let unstage = |node: &mut NodeClient<Channel>| {
        let (id, target, staging) = (v.volume_id.clone(), target.clone(), staging.clone());
        let mut node = node.clone();
        async move {
            node.node_unpublish_volume(unpublish_req(&id, &target))
                .await
                .expect("unpublish");
            node.node_unstage_volume(unstage_req(&id, &staging))
                .await
                .expect("unstage");
        }
    };
    unstage(&mut node).await;
    assert!(mappings(vm).is_empty(), "{:?}", mappings(vm));

    // Without the cluster half: a wrong KEK, and a stage secret without one.
    let s = node
        .node_stage_volume(stage_req(&WRONG_KEK))
        .await
        .expect_err("a wrong cluster KEK");
    assert_eq!(s.code(), tonic::Code::FailedPrecondition, "{s:?}");
    let mut req = stage_req(&KEK);
    req.secrets.remove("kek");
    let s = node
        .node_stage_volume(req)
        .await
        .expect_err("no cluster KEK");
    assert_eq!(s.code(), tonic::Code::InvalidArgument, "{s:?}");
    assert!(
        mappings(vm).is_empty(),
        "nothing opened: {:?}",
        mappings(vm)
    );

    // The cluster half with another TPM key: the passphrase is another, no slot takes it.
    let aside = sb.state.join("tpm2-aside");
    std::fs::rename(key_dir(sb), &aside).expect("the key blobs moved aside");
    let s = node
        .node_stage_volume(stage_req(&KEK))
        .await
        .expect_err("another TPM key");
    refused_opening_nothing(vm, &s, "does not open volume");

    // The node's own key back: both halves, the data is there, nothing formatted again.
    std::fs::remove_dir_all(key_dir(sb)).expect("the other key's blobs");
    std::fs::rename(&aside, key_dir(sb)).expect("the key blobs back");
    node.node_stage_volume(stage_req(&KEK))
        .await
        .expect("stage again with both halves");
    node.node_publish_volume(publish(&v.volume_id, &staging, &target, ext4()))
        .await
        .expect("publish again");
    assert_eq!(
        vm.sh(&format!("grep -c {PATTERN} {written}")).trim(),
        "2000"
    );
    let formats = std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains("formatted as LUKS2"))
        .count();
    assert_eq!(formats, 1, "one luksFormat in the volume's life");

    // Growth: the controller grows the volume's file, the loop device takes its size, and
    // NodeExpandVolume grows the mapping with both halves (the node-expand secret's cluster
    // half, this node's TPM), then the filesystem.
    ctl.controller_expand_volume(csi::ControllerExpandVolumeRequest {
        volume_id: v.volume_id.clone(),
        capacity_range: Some(csi::CapacityRange {
            required_bytes: GROWN_MIB * MIB,
            limit_bytes: 0,
        }),
        secrets: secrets(&KEK),
        volume_capability: Some(ext4()),
    })
    .await
    .expect("ControllerExpandVolume");
    // The guest's view of the shared file may be the size it cached: set to the grown size
    // (the controller's already), then the loop device told, as moor's local attacher does.
    vm.sh(&format!(
        "truncate -s {} {file} && losetup -c {dev}",
        GROWN_MIB * MIB
    ));
    assert_eq!(
        vm.sh(&format!("blockdev --getsize64 {dev}")).trim(),
        (GROWN_MIB * MIB).to_string(),
        "the loop device has the grown size"
    );
    let before = fs_mib(vm, &target);
    let expand_req = |secrets: HashMap<String, String>| csi::NodeExpandVolumeRequest {
        volume_id: v.volume_id.clone(),
        volume_path: target.display().to_string(),
        capacity_range: Some(csi::CapacityRange {
            required_bytes: GROWN_MIB * MIB,
            limit_bytes: 0,
        }),
        staging_target_path: staging.display().to_string(),
        volume_capability: Some(ext4()),
        secrets,
    };
    let s = node
        .node_expand_volume(expand_req(HashMap::new()))
        .await
        .expect_err("no node-expand secret");
    assert_eq!(s.code(), tonic::Code::InvalidArgument, "{s:?}");
    let s = node
        .node_expand_volume(expand_req(secrets(&WRONG_KEK)))
        .await
        .expect_err("a wrong cluster KEK");
    assert_eq!(s.code(), tonic::Code::FailedPrecondition, "{s:?}");
    assert_eq!(fs_mib(vm, &target), before, "nothing grown");
    node.node_expand_volume(expand_req(secrets(&KEK)))
        .await
        .expect("NodeExpandVolume of a tpm2 volume");
    let after = fs_mib(vm, &target);
    eprintln!("vm_tpm2: the filesystem grew from {before} MiB to {after} MiB");
    assert!(
        after >= before + (GROWN_MIB - 96) / 2,
        "the filesystem grew from {before} MiB to {after} MiB only"
    );
    assert_eq!(
        vm.sh(&format!("grep -c {PATTERN} {written}")).trim(),
        "2000"
    );
    unstage(&mut node).await;
    assert!(mappings(vm).is_empty(), "{:?}", mappings(vm));
    sealed_to_a_pcr(sb, vm, &mut ctl, &mut node).await;
    controller.stop().await;
}

/// A volume of a class sealed to PCR 16 (the debug PCR, which the guest may extend and reset):
/// it opens while the PCR holds the value it was sealed to, is refused once it is extended
/// (FAILED_PRECONDITION naming the PCRs, nothing opened), and opens again once it is reset.
async fn sealed_to_a_pcr(
    sb: &Sandbox,
    vm: &Vm,
    ctl: &mut ControllerClient<Channel>,
    node: &mut NodeClient<Channel>,
) {
    let (v, file, dev) = tpm2_volume(
        ctl,
        vm,
        ("pvc-tpm2-sealed", 64),
        &[("tpm2PCRs", "sha256:16")],
    )
    .await;
    let staging = sb.staging("pv-tpm2-sealed");
    let stage_req = stage_request(&v, (&dev, &file), &staging, &KEK);
    let tpm = "TPM2TOOLS_TCTI=device:/dev/tpmrm0";
    vm.sh(&format!("{tpm} tpm2_pcrreset 16"));
    node.node_stage_volume(stage_req.clone())
        .await
        .expect("first stage, PCR 16 as sealed");
    assert!(key_dir(sb).join("hmac-sha256_16.priv").is_file());
    node.node_unstage_volume(unstage_req(&v.volume_id, &staging))
        .await
        .expect("unstage");
    vm.sh(&format!(
        "{tpm} tpm2_pcrextend 16:sha256={}",
        "ab".repeat(32)
    ));
    let s = node
        .node_stage_volume(stage_req.clone())
        .await
        .expect_err("PCR 16 changed");
    refused_opening_nothing(vm, &s, "sealed to the PCRs sha256:16");
    vm.sh(&format!("{tpm} tpm2_pcrreset 16"));
    node.node_stage_volume(stage_req)
        .await
        .expect("PCR 16 as sealed again");
    node.node_unstage_volume(unstage_req(&v.volume_id, &staging))
        .await
        .expect("unstage");
    assert!(mappings(vm).is_empty(), "{:?}", mappings(vm));
    vm.sh(&format!("losetup -d {dev}"));
}
