//! Encrypted volumes on a real kernel (docs/encryption.md): moor-controller on the host makes
//! two encrypted volumes of its embedded backend (a data key each, wrapped by the provisioner
//! secret's KEK, in the volume context); in one guest of the VM lab, whose Debian kernel has
//! dm-crypt, moor-node stages them from loop devices of their files: a mount volume and a
//! block volume, each made LUKS2 at its first stage and opened to `/dev/mapper/moor-<id>`.
//! The test shows:
//!
//! * what a pod writes is on the mapping and nowhere in the volume's file in the clear;
//! * unstaged, the mapping is closed; staged again, the data is there (no second luksFormat,
//!   no second mkfs);
//! * a wrong KEK (AES-GCM refuses the wrapped key) and a data key the LUKS header has no slot
//!   for (cryptsetup's exit 2) are FAILED_PRECONDITION, and nothing is opened;
//! * moor-node killed while the volume is staged and published, and started again, finds its
//!   mapping in the journal: the volume is healthy, its unstage closes the mapping;
//! * a snapshot of the volume restored into a new encrypted volume opens with the source's
//!   data key (wrapped for the copy), holds the data, is never formatted, and its file holds
//!   no plaintext; the KEK is rotated before the restore and the old one retired: the
//!   snapshot's key was rewrapped, and the restore and its stage take the new KEK alone.
//!
//! The guest's agent is reached over a bridge of the test's own (no Ceph cluster needed).
//! Skipped, with the reason, without the VM lab.

use std::collections::HashMap;
use std::path::Path;

use csi::volume_capability::access_mode::Mode;
use moor_lab::ceph::{block, ext4, publish};
use moor_lab::krbd_lab::start_node_in;
use moor_lab::vm::{Bridge, Vm};
use moor_privileged::client::Daemon;
use moor_privileged::requests::{unpublish_req, unstage_req};
use moor_privileged::{Sandbox, runtime};
use moor_proto::csi::v1 as csi;
use moor_proto::csi::v1::controller_client::ControllerClient;
use moor_proto::csi::v1::node_client::NodeClient;
use moor_runtime::contract::{BACKING_FILE_KEY, DEVICE_PATH_KEY};
use moor_runtime::keys::{Dek, Kek, secret_entries};
use tonic::transport::Channel;

const MIB: i64 = 1 << 20;
/// What the pods write: a line no filesystem or LUKS metadata holds.
const PATTERN: &str = "MOOR-ENCRYPTION-LAB-PLAINTEXT-4f1c9a";
/// The KEK, and one that is not it.
const KEK: [u8; 32] = [0x42; 32];
const WRONG_KEK: [u8; 32] = [0x43; 32];

fn secrets(kek: &[u8]) -> HashMap<String, String> {
    secret_entries("lab-kek", kek).into_iter().collect()
}

/// The KEK a KEK rotation moves the records to, under an id of its own.
const NEW_KEK: [u8; 32] = [0x44; 32];

fn new_secrets() -> HashMap<String, String> {
    secret_entries("lab-kek-2", &NEW_KEK).into_iter().collect()
}

/// An encrypted volume made by the controller, and its file.
struct Volume {
    id: String,
    context: HashMap<String, String>,
    file: String,
}

async fn create(
    ctl: &mut ControllerClient<Channel>,
    name: &str,
    cap: csi::VolumeCapability,
) -> Volume {
    create_from(ctl, name, cap, None).await
}

/// [`create`], of a content source (a clone, a restore) when one is given.
async fn create_from(
    ctl: &mut ControllerClient<Channel>,
    name: &str,
    cap: csi::VolumeCapability,
    source: Option<csi::VolumeContentSource>,
) -> Volume {
    create_with(ctl, name, cap, source, secrets(&KEK)).await
}

/// [`create_from`] with the provisioner secret `secrets`.
async fn create_with(
    ctl: &mut ControllerClient<Channel>,
    name: &str,
    cap: csi::VolumeCapability,
    source: Option<csi::VolumeContentSource>,
    secrets: HashMap<String, String>,
) -> Volume {
    let v = ctl
        .create_volume(csi::CreateVolumeRequest {
            name: name.into(),
            volume_content_source: source,
            capacity_range: Some(csi::CapacityRange {
                required_bytes: 96 * MIB,
                limit_bytes: 0,
            }),
            volume_capabilities: vec![cap.clone()],
            parameters: HashMap::from([
                ("encrypted".into(), "true".into()),
                ("kmsID".into(), "secret".into()),
            ]),
            secrets,
            ..Default::default()
        })
        .await
        .expect("CreateVolume of an encrypted class")
        .into_inner()
        .volume
        .expect("a volume");
    assert!(
        v.volume_context.contains_key("encryptedDEK"),
        "{:?}",
        v.volume_context
    );
    // Its file, by the publish context; detached again: the guest binds it.
    let file = moor_lab::vm::embedded_volume_file(ctl, &v, "node-c", cap).await;
    Volume {
        id: v.volume_id,
        context: v.volume_context,
        file,
    }
}

/// The guest's side of a volume: its loop device and its kubelet paths.
struct Staged<'a> {
    v: &'a Volume,
    dev: String,
    staging: std::path::PathBuf,
    target: std::path::PathBuf,
    cap: csi::VolumeCapability,
}

impl Staged<'_> {
    fn stage_req(&self, kek: &[u8]) -> csi::NodeStageVolumeRequest {
        self.stage_req_with(secrets(kek))
    }

    fn stage_req_with(&self, secrets: HashMap<String, String>) -> csi::NodeStageVolumeRequest {
        csi::NodeStageVolumeRequest {
            volume_id: self.v.id.clone(),
            publish_context: HashMap::from([
                (DEVICE_PATH_KEY.into(), self.dev.clone()),
                (BACKING_FILE_KEY.into(), self.v.file.clone()),
            ]),
            staging_target_path: self.staging.display().to_string(),
            volume_capability: Some(self.cap.clone()),
            secrets,
            volume_context: self.v.context.clone(),
        }
    }

    fn mapper(&self) -> String {
        format!("/dev/mapper/moor-{}", self.v.id)
    }

    /// Staged with the KEK and published at its target.
    async fn bring_up(&self, node: &mut NodeClient<Channel>) {
        node.node_stage_volume(self.stage_req(&KEK))
            .await
            .unwrap_or_else(|e| panic!("stage {}: {e:?}", self.v.id));
        node.node_publish_volume(publish(
            &self.v.id,
            &self.staging,
            &self.target,
            self.cap.clone(),
        ))
        .await
        .unwrap_or_else(|e| panic!("publish {}: {e:?}", self.v.id));
    }

    /// Unpublished and unstaged: no mapping is left open in the guest.
    async fn take_down(&self, node: &mut NodeClient<Channel>, vm: &Vm) {
        node.node_unpublish_volume(unpublish_req(&self.v.id, &self.target))
            .await
            .expect("unpublish");
        node.node_unstage_volume(unstage_req(&self.v.id, &self.staging))
            .await
            .expect("unstage");
        assert!(mappings(vm).is_empty(), "{:?}", mappings(vm));
    }
}

/// How many times the volume's file on the host holds `PATTERN` (read on the host: what a
/// thief of the backend's file gets).
fn in_the_clear(file: &str) -> usize {
    let bytes = std::fs::read(file).expect("the volume's file");
    bytes
        .windows(PATTERN.len())
        .filter(|w| *w == PATTERN.as_bytes())
        .count()
}

/// How many luksFormats moor-node's log shows.
fn luks_formats(log: &Path) -> usize {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains("formatted as LUKS2"))
        .count()
}

/// The volume unpublished and unstaged.
async fn end(node: &mut NodeClient<Channel>, s: &Staged<'_>) {
    node.node_unpublish_volume(unpublish_req(&s.v.id, &s.target))
        .await
        .unwrap_or_else(|e| panic!("unpublish {}: {e:?}", s.v.id));
    node.node_unstage_volume(unstage_req(&s.v.id, &s.staging))
        .await
        .unwrap_or_else(|e| panic!("unstage {}: {e:?}", s.v.id));
}

/// The mappings open in the guest (`dmsetup ls`'s names).
fn mappings(vm: &Vm) -> Vec<String> {
    vm.sh("dmsetup ls --target crypt 2>/dev/null | awk '$1 ~ /^moor-/ {print $1}'; true")
        .lines()
        .map(str::to_string)
        .collect()
}

#[test]
fn encrypted_volumes_on_a_real_kernel() {
    in_a_dm_crypt_guest(
        "vm_encryption",
        ("vm-encryption", "moor-encryption", "menc", 254),
        |sb, vm, log| runtime().block_on(life(sb, vm, log)),
    );
}

/// Runs `body` with a sandbox, a booted guest whose kernel has dm-crypt and moor-node's log
/// file (`names`: the sandbox's, the guest's, its bridge's tag and second octet); whatever
/// happens, nothing is left mounted, open or bound in the guest, and a failure prints
/// moor-node's log. Skipped, with the reason, without the VM lab.
fn in_a_dm_crypt_guest(
    test: &str,
    (sandbox, guest, tag, second): (&str, &str, &str, u8),
    body: impl FnOnce(&Sandbox, &Vm, &Path),
) {
    if !moor_lab::vm::available(test) {
        return;
    }
    let sb = Sandbox::new(sandbox);
    let bridge = Bridge::new(tag, second);
    let vm = Vm::boot_for_dm_crypt(guest, &bridge, &sb, "1G");
    let log = sb.state.join("node.log");
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        body(&sb, &vm, &log);
    }));
    // Whatever happened: nothing left mounted, open or bound in the guest.
    vm.clear_volumes(&sb.kubelet);
    if let Err(e) = result {
        eprintln!(
            "{test}: moor-node's log:\n{}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        std::panic::resume_unwind(e);
    }
}

/// moor-controller on the host, its embedded backend in the sandbox, and a client of it.
async fn start_controller(sb: &Sandbox) -> (Daemon, ControllerClient<Channel>) {
    let data = sb.data.join("controller").display().to_string();
    let csocket = sb.root.join("controller.sock");
    let controller = Daemon::start_program(
        "moor-controller",
        &csocket,
        &["--node-id", "node-c", "--data-dir", data.as_str()],
    )
    .await;
    let ctl = ControllerClient::new(
        moor_runtime::client::connect(&csocket)
            .await
            .expect("the controller's socket"),
    );
    (controller, ctl)
}

async fn start_node(sb: &Sandbox, vm: &Vm, log: &Path) -> NodeClient<Channel> {
    start_node_in(vm, "node-c", &sb.kubelet, "moor-node", &[], &sb.state, log).await
}

async fn life(sb: &Sandbox, vm: &Vm, log: &Path) {
    let (mut controller, mut ctl) = start_controller(sb).await;
    let fs_vol = create(&mut ctl, "pvc-encrypted-fs", ext4()).await;
    let block_vol = create(
        &mut ctl,
        "pvc-encrypted-block",
        block(Mode::SingleNodeWriter),
    )
    .await;
    let loop_of = |file: &str| {
        vm.sh(&format!("losetup -f --show {file}"))
            .trim()
            .to_string()
    };
    let fs = Staged {
        v: &fs_vol,
        dev: loop_of(&fs_vol.file),
        staging: sb.staging("pv-fs"),
        target: sb.target("pod-a", "pv-fs"),
        cap: ext4(),
    };
    let blk = Staged {
        v: &block_vol,
        dev: loop_of(&block_vol.file),
        staging: sb.staging("pv-block"),
        target: sb.block_target("pod-a", "pv-block"),
        cap: block(Mode::SingleNodeWriter),
    };
    let mut node = start_node(sb, vm, log).await;

    // First stage: LUKS2 made, opened, the filesystem made on the mapping; a pod writes.
    for s in [&fs, &blk] {
        node.node_stage_volume(s.stage_req(&KEK))
            .await
            .unwrap_or_else(|e| panic!("stage {}: {e:?}", s.v.id));
        node.node_publish_volume(publish(&s.v.id, &s.staging, &s.target, s.cap.clone()))
            .await
            .unwrap_or_else(|e| panic!("publish {}: {e:?}", s.v.id));
    }
    assert_eq!(mappings(vm).len(), 2, "{:?}", mappings(vm));
    let file = fs.target.join("secret.txt").display().to_string();
    vm.sh(&format!(
        "for i in $(seq 2000); do echo {PATTERN}; done | dd of={file} conv=fsync status=none"
    ));
    vm.sh(&format!(
        "for i in $(seq 2000); do echo {PATTERN}; done | dd of={} oflag=direct,sync bs=64k iflag=fullblock status=none; true",
        blk.target.display()
    ));
    vm.sh("sync");
    for s in [&fs, &blk] {
        assert_eq!(
            vm.sh(&format!(
                "luks=$(blkid -p -o value -s TYPE {}); echo $luks",
                s.dev
            ))
            .trim(),
            "crypto_LUKS",
            "{} is LUKS",
            s.dev
        );
        let seen = vm.sh(&format!("grep -a -c {PATTERN} {} || true", s.mapper()));
        assert!(
            seen.trim().parse::<usize>().unwrap_or(0) > 0,
            "the pattern is on {}'s mapping: {seen}",
            s.v.id
        );
        let raw = vm.sh(&format!("grep -a -c {PATTERN} {} || true", s.dev));
        assert_eq!(
            raw.trim(),
            "0",
            "the raw device of {} shows no plaintext",
            s.v.id
        );
        assert_eq!(
            in_the_clear(&s.v.file),
            0,
            "{}'s file shows no plaintext",
            s.v.id
        );
    }

    // moor-node killed and started again mid-life: its journal has the mappings.
    vm.exec(&["pkill", "-KILL", "-x", "moor-node"]);
    vm.sh("while pgrep -x moor-node >/dev/null; do sleep 0.1; done");
    let mut node = start_node(sb, vm, log).await;
    let stats = node
        .node_get_volume_stats(csi::NodeGetVolumeStatsRequest {
            volume_id: fs.v.id.clone(),
            volume_path: fs.target.display().to_string(),
            staging_target_path: String::new(),
        })
        .await
        .expect("NodeGetVolumeStats after the restart")
        .into_inner();
    assert!(
        !stats.volume_condition.as_ref().is_some_and(|c| c.abnormal),
        "{stats:?}"
    );

    // Unstaged: each mapping closed after its filesystem.
    for s in [&fs, &blk] {
        end(&mut node, s).await;
    }
    assert!(mappings(vm).is_empty(), "{:?}", mappings(vm));

    // A wrong KEK: the wrapped key does not unwrap; nothing is opened.
    let s = node
        .node_stage_volume(fs.stage_req(&WRONG_KEK))
        .await
        .expect_err("a wrong KEK");
    assert_eq!(s.code(), tonic::Code::FailedPrecondition, "{s:?}");
    assert!(s.message().contains("lab-kek"), "{}", s.message());
    // The right KEK, but a data key no key slot of the header takes: cryptsetup's exit 2.
    let kek = Kek::new("lab-kek", &KEK).expect("kek");
    let other = Dek::generate()
        .expect("dek")
        .wrap(&kek, &fs.v.id)
        .expect("wrap");
    let mut req = fs.stage_req(&KEK);
    req.volume_context
        .insert("encryptedDEK".into(), other.encode());
    let s = node
        .node_stage_volume(req)
        .await
        .expect_err("another data key");
    assert_eq!(s.code(), tonic::Code::FailedPrecondition, "{s:?}");
    assert!(
        s.message().contains("does not open volume"),
        "{}",
        s.message()
    );
    assert!(
        mappings(vm).is_empty(),
        "nothing opened: {:?}",
        mappings(vm)
    );
    assert!(
        !vm.exec(&["mountpoint", "-q", &fs.staging.display().to_string()])
            .ok()
    );

    // Staged again with its key: the data is there, nothing was formatted again.
    node.node_stage_volume(fs.stage_req(&KEK))
        .await
        .expect("stage again");
    node.node_publish_volume(publish(&fs.v.id, &fs.staging, &fs.target, fs.cap.clone()))
        .await
        .expect("publish again");
    let back = vm.sh(&format!("grep -c {PATTERN} {file}"));
    assert_eq!(
        back.trim(),
        "2000",
        "the pod's data after unstage and stage"
    );
    assert_eq!(luks_formats(log), 2, "one luksFormat a volume in its life");
    end(&mut node, &fs).await;
    assert!(mappings(vm).is_empty(), "{:?}", mappings(vm));

    // A snapshot of it, restored into a new encrypted volume: the copy holds the source's
    // LUKS header, opens with the source's data key (wrapped for the copy), holds the data,
    // and is as encrypted as its source.
    let snap = ctl
        .create_snapshot(csi::CreateSnapshotRequest {
            source_volume_id: fs.v.id.clone(),
            name: "snap-encrypted-fs".into(),
            ..Default::default()
        })
        .await
        .expect("a snapshot of an encrypted volume")
        .into_inner()
        .snapshot
        .expect("a snapshot");
    // The KEK rotated, and the old one retired: the snapshot's record carries its source's
    // key rewrapped under the new KEK, and the restore and its stage take the new KEK alone.
    let mut keys_ctl = moor_proto::keys::v1::controller_keys_client::ControllerKeysClient::new(
        moor_runtime::client::connect(&sb.root.join("controller.sock"))
            .await
            .expect("the controller's socket"),
    );
    let rotated = keys_ctl
        .rotate_key_encryption_key(moor_proto::keys::v1::RotateKeyEncryptionKeyRequest {
            kms_id: String::new(),
            old_secrets: secrets(&KEK),
            new_secrets: new_secrets(),
        })
        .await
        .expect("RotateKeyEncryptionKey")
        .into_inner();
    assert!(
        rotated.rewrapped.contains(&snap.snapshot_id) && rotated.other_keks.is_empty(),
        "{rotated:?}"
    );
    let restored_vol = create_with(
        &mut ctl,
        "pvc-encrypted-restore",
        ext4(),
        Some(csi::VolumeContentSource {
            r#type: Some(csi::volume_content_source::Type::Snapshot(
                csi::volume_content_source::SnapshotSource {
                    snapshot_id: snap.snapshot_id.clone(),
                },
            )),
        }),
        new_secrets(),
    )
    .await;
    assert_ne!(
        restored_vol.context["encryptedDEK"], fs.v.context["encryptedDEK"],
        "wrapped for the copy"
    );
    let restored = Staged {
        v: &restored_vol,
        dev: loop_of(&restored_vol.file),
        staging: sb.staging("pv-restored"),
        target: sb.target("pod-b", "pv-restored"),
        cap: ext4(),
    };
    node.node_stage_volume(restored.stage_req_with(new_secrets()))
        .await
        .expect("stage the restored volume with the new KEK alone");
    node.node_publish_volume(publish(
        &restored.v.id,
        &restored.staging,
        &restored.target,
        restored.cap.clone(),
    ))
    .await
    .expect("publish the restored volume");
    let copied = restored.target.join("secret.txt").display().to_string();
    assert_eq!(
        vm.sh(&format!("grep -c {PATTERN} {copied}")).trim(),
        "2000",
        "the snapshot's data in the restored volume"
    );
    assert_eq!(
        in_the_clear(&restored.v.file),
        0,
        "the restored volume's file shows no plaintext"
    );
    assert_eq!(
        mappings(vm),
        [format!("moor-{}", restored.v.id)],
        "the copy opened under its own name"
    );
    assert_eq!(luks_formats(log), 2, "the restore is never formatted");
    end(&mut node, &restored).await;
    assert!(mappings(vm).is_empty(), "{:?}", mappings(vm));
    controller.stop().await;
}

/// A data key rotation of a staged, published volume while a pod's writer runs (issue 40,
/// point 3; docs/encryption.md, "Rotation"): moor-node's `RotateVolumeKey` in the guest, on
/// dm-crypt, the mapping open throughout. The writer appends numbered lines, each fsynced,
/// and counts the last one synced; after the rotation every synced line is there, in order;
/// the header has one key slot, which the new key opens and the old does not; unstaged and
/// staged again with the volume context's old key, the volume opens (the journal's rotated
/// key) with its data.
#[test]
fn a_data_key_rotation_under_a_writer_on_a_real_kernel() {
    in_a_dm_crypt_guest(
        "vm_encryption (rotation)",
        ("vm-rotation", "moor-rotation", "mrot", 251),
        |sb, vm, log| runtime().block_on(rotation(sb, vm, log)),
    );
}

/// In the guest: waits (5 minutes at most) until the writer has synced `n` lines.
fn wait_synced(vm: &Vm, n: u64) {
    vm.sh(&format!(
        "timeout 300 sh -c 'until [ \"$(cat /tmp/synced 2>/dev/null || echo 0)\" -ge {n} ]; \
         do sleep 0.2; done' || {{ echo 'the writer did not sync {n} lines in 5 minutes'; \
         exit 1; }}"
    ));
}

/// Whether `key` opens a slot of the LUKS header on `dev` in the guest.
fn guest_opens(vm: &Vm, dev: &str, key: &Dek) -> bool {
    let escaped: String = key.expose().iter().map(|b| format!("\\{b:03o}")).collect();
    vm.sh(&format!(
        "printf '{escaped}' | cryptsetup open --test-passphrase --key-file=- {dev}; echo rc=$?"
    ))
    .contains("rc=0")
}

/// `vol` as an ext4 volume of the guest: its file bound to a loop device there, its kubelet
/// paths under the pod `pod-r` and the PV `pv`.
fn mount_in_guest<'a>(sb: &Sandbox, vm: &Vm, vol: &'a Volume, pv: &str) -> Staged<'a> {
    Staged {
        v: vol,
        dev: vm
            .sh(&format!("losetup -f --show {}", vol.file))
            .trim()
            .to_string(),
        staging: sb.staging(pv),
        target: sb.target("pod-r", pv),
        cap: ext4(),
    }
}

async fn rotation(sb: &Sandbox, vm: &Vm, log: &Path) {
    use moor_proto::keys::v1::RotateVolumeKeyRequest;
    use moor_proto::keys::v1::node_keys_client::NodeKeysClient;
    let (mut controller, mut ctl) = start_controller(sb).await;
    let vol = create(&mut ctl, "pvc-rotated", ext4()).await;
    let fs = mount_in_guest(sb, vm, &vol, "pv-rot");
    let mut node = start_node(sb, vm, log).await;
    fs.bring_up(&mut node).await;
    let file = fs.target.join("lines.txt").display().to_string();
    vm.sh(&format!(
        "rm -f /tmp/stop-writer /tmp/synced /tmp/writer-done; nohup sh -c 'i=1; \
         while [ ! -e /tmp/stop-writer ]; do echo line-$i | dd of={file} oflag=append \
         conv=notrunc,fsync status=none || break; echo $i > /tmp/synced; i=$((i+1)); done; \
         touch /tmp/writer-done' >/dev/null 2>&1 &"
    ));
    wait_synced(vm, 20);

    let kek = Kek::new("lab-kek", &KEK).expect("kek");
    let old_text = fs.v.context["encryptedDEK"].clone();
    let old = kek
        .unwrap(
            &moor_runtime::keys::WrappedDek::decode(&old_text).expect("decode"),
            &fs.v.id,
        )
        .expect("old key");
    let new = Dek::generate().expect("dek");
    let new_wrapped = new.wrap(&kek, &fs.v.id).expect("wrap");
    let mut keys = NodeKeysClient::new(
        vm.channel(moor_lab::krbd_lab::SOCKET)
            .await
            .expect("the node's socket"),
    );
    let before: u64 = vm.sh("cat /tmp/synced").trim().parse().expect("synced");
    let answer = keys
        .rotate_volume_key(RotateVolumeKeyRequest {
            volume_id: fs.v.id.clone(),
            old_wrapped_dek: old_text.clone(),
            new_wrapped_dek: new_wrapped.encode(),
            luks_pbkdf: "pbkdf2".into(),
            secrets: secrets(&KEK),
        })
        .await
        .expect("RotateVolumeKey")
        .into_inner();
    assert_eq!(answer.steps.len(), 6, "{:?}", answer.steps);
    // The writer went on through the rotation and after it.
    wait_synced(vm, before + 20);
    vm.sh(
        "touch /tmp/stop-writer; timeout 300 sh -c 'until [ -e /tmp/writer-done ]; do sleep \
         0.2; done'",
    );
    let synced: u64 = vm.sh("cat /tmp/synced").trim().parse().expect("synced");
    let same = |what: &str| {
        let out = vm.sh(&format!(
            "seq -f line-%g 1 {synced} > /tmp/want; head -n {synced} {file} | cmp - /tmp/want \
             && echo same"
        ));
        assert!(
            out.contains("same"),
            "{what}: the {synced} synced lines: {out}"
        );
    };
    same("after the rotation");
    eprintln!(
        "vm_encryption (rotation): {synced} lines synced, {before} before the rotation; \
         steps {:?}",
        answer.steps
    );
    let slots = vm.sh(&format!(
        "cryptsetup luksDump {} | grep -c ': luks2$'",
        fs.dev
    ));
    assert_eq!(slots.trim(), "1", "one key slot left");
    assert!(guest_opens(vm, &fs.dev, &new), "the new key opens it");
    assert!(
        !guest_opens(vm, &fs.dev, &old),
        "the old key no longer does"
    );

    // Unstaged and staged again with the volume context's (old) key: the journal's rotated
    // key opens it, the data is there.
    fs.take_down(&mut node, vm).await;
    fs.bring_up(&mut node).await;
    same("staged again");
    fs.take_down(&mut node, vm).await;
    controller.stop().await;
}

#[test]
fn a_volume_rotated_through_the_controller_opens_on_a_second_node_instance() {
    in_a_dm_crypt_guest(
        "vm_encryption (rotation through the controller)",
        ("vm-rotctl", "moor-rotctl", "mrct", 249),
        |sb, vm, log| runtime().block_on(rotation_through_the_controller(sb, vm, log)),
    );
}

/// The controller's record keys of the volume, as ControllerPublishVolume gives them (the
/// host's loop device it attaches is detached again: the guest binds the file).
async fn published_keys(
    ctl: &mut ControllerClient<Channel>,
    v: &Volume,
    cap: &csi::VolumeCapability,
) -> HashMap<String, String> {
    let ctx = moor_lab::ceph::published_context(
        ctl,
        csi::ControllerPublishVolumeRequest {
            volume_id: v.id.clone(),
            node_id: "node-c".into(),
            volume_capability: Some(cap.clone()),
            volume_context: v.context.clone(),
            ..Default::default()
        },
    )
    .await;
    ctx.into_iter()
        .filter(|(k, _)| k.starts_with("encryptedDEK"))
        .collect()
}

/// A data key rotation owned by the controller on a real kernel: a volume staged by node A
/// (moor-node in the guest), a pod's data synced on it; the rotation's three steps, as
/// `moorctl rotate-key --controller` makes them (the pending key into the controller's record,
/// the slot steps on node A, the promotion); unstaged; then a second moor-node instance with
/// an empty journal (another node, as far as its journal knows) stages it from the request
/// alone, the controller's publish_context giving the record's key: it opens, and the data is
/// there. The same stage without the publish_context's key (the volume context's old key
/// only) is refused with nothing opened.
async fn rotation_through_the_controller(sb: &Sandbox, vm: &Vm, log: &Path) {
    use moor_proto::keys::v1::controller_keys_client::ControllerKeysClient;
    use moor_proto::keys::v1::node_keys_client::NodeKeysClient;
    use moor_proto::keys::v1::{
        BeginVolumeKeyRotationRequest, FinishVolumeKeyRotationRequest, RotateVolumeKeyRequest,
    };
    let (mut controller, mut ctl) = start_controller(sb).await;
    let vol = create(&mut ctl, "pvc-rotated-ctl", ext4()).await;
    let fs = mount_in_guest(sb, vm, &vol, "pv-rotctl");
    let mut node_a = start_node(sb, vm, log).await;
    fs.bring_up(&mut node_a).await;
    let file = fs.target.join("kept.txt").display().to_string();
    vm.sh(&format!(
        "echo {PATTERN} | dd of={file} conv=fsync status=none"
    ));

    let mut keys_ctl = ControllerKeysClient::new(
        moor_runtime::client::connect(&sb.root.join("controller.sock"))
            .await
            .expect("the controller's socket"),
    );
    let begun = keys_ctl
        .begin_volume_key_rotation(BeginVolumeKeyRotationRequest {
            volume_id: vol.id.clone(),
            secrets: secrets(&KEK),
            if_rotations: None,
        })
        .await
        .expect("BeginVolumeKeyRotation")
        .into_inner();
    assert_eq!(begun.current_wrapped_dek, vol.context["encryptedDEK"]);
    // Pending in the record before the node is asked: every stage is given both keys.
    let during = published_keys(&mut ctl, &vol, &fs.cap).await;
    assert_eq!(
        during.get("encryptedDEKPending"),
        Some(&begun.pending_wrapped_dek)
    );
    let mut keys_node = NodeKeysClient::new(
        vm.channel(moor_lab::krbd_lab::SOCKET)
            .await
            .expect("the node's socket"),
    );
    let answer = keys_node
        .rotate_volume_key(RotateVolumeKeyRequest {
            volume_id: vol.id.clone(),
            old_wrapped_dek: begun.current_wrapped_dek.clone(),
            new_wrapped_dek: begun.pending_wrapped_dek.clone(),
            luks_pbkdf: begun.luks_pbkdf.clone(),
            secrets: secrets(&KEK),
        })
        .await
        .expect("RotateVolumeKey")
        .into_inner();
    assert_eq!(answer.steps.len(), 6, "{:?}", answer.steps);
    keys_ctl
        .finish_volume_key_rotation(FinishVolumeKeyRotationRequest {
            volume_id: vol.id.clone(),
            new_wrapped_dek: begun.pending_wrapped_dek.clone(),
        })
        .await
        .expect("FinishVolumeKeyRotation");
    fs.take_down(&mut node_a, vm).await;

    // A second node instance: its own state dir (an empty journal) and socket.
    let state_b = sb.root.join("state-b");
    std::fs::create_dir_all(&state_b).expect("state dir");
    let launch = moor_lab::krbd_lab::Launch {
        program: "moor-node",
        attacher: "kernel",
        socket: "/run/moor-csi-b.sock",
        wrap: &[],
        env: &[],
    };
    let log_b = sb.root.join("node-b.log");
    let mut node_b =
        moor_lab::krbd_lab::start_node_as(vm, "node-c", &sb.kubelet, &launch, &state_b, &log_b)
            .await;
    // Without the record's key: the volume context's old key opens no slot; nothing opened.
    let e = node_b
        .node_stage_volume(fs.stage_req(&KEK))
        .await
        .expect_err("the volume context's key after the rotation");
    assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e:?}");
    assert!(mappings(vm).is_empty(), "{:?}", mappings(vm));
    // With the controller's publish_context: the record's key opens it, the data is there.
    let after = published_keys(&mut ctl, &vol, &fs.cap).await;
    assert_eq!(after.get("encryptedDEK"), Some(&begun.pending_wrapped_dek));
    assert_eq!(after.get("encryptedDEKPending"), None);
    let mut req = fs.stage_req(&KEK);
    req.publish_context.extend(after);
    node_b.node_stage_volume(req).await.unwrap_or_else(|e| {
        panic!(
            "the second node's stage: {e:?}\n{}",
            std::fs::read_to_string(&log_b).unwrap_or_default()
        )
    });
    node_b
        .node_publish_volume(publish(&vol.id, &fs.staging, &fs.target, fs.cap.clone()))
        .await
        .expect("publish on the second node");
    let read = vm.sh(&format!("cat {file}"));
    assert!(
        read.contains(PATTERN),
        "the data after the rotation: {read:?}"
    );
    fs.take_down(&mut node_b, vm).await;
    controller.stop().await;
}
