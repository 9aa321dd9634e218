//! SELinux mount labels on a kernel that enforces them: a guest of the VM lab boots Debian's
//! kernel with SELinux in its LSM list, loads Debian's reference policy (selinux-policy-default,
//! built by `.ci/vm setup`) and enforces it. moor-node in the guest stages and publishes mount
//! volumes (ext4, xfs) with kubelet's `context="..."` mount flag, as kubelet 1.28+ sends it in
//! `VolumeCapability.MountVolume.mount_flags` when the CSIDriver says `seLinuxMount: true`; the
//! staging mount is shared by two pods of the same label. The test shows:
//!
//! * the label is the mount's: files made under a pod's target carry it (`security.selinux`),
//!   and so do files that were on the volume before, seen through the mount;
//! * a process of another domain is refused the volume by the enforcing kernel, and its AVC
//!   denial names the volume's label, while the node's own domain reads it; as between two
//!   pods, a process of the pod's label reads it and one of other MCS categories is refused;
//! * the recursive relabel `context=` exists to avoid never runs: after the volume's life, a
//!   mount without the flag shows the files as they are on disk (the file that was there keeps
//!   its own label, the one made in the pod has none written);
//! * a read-only publish of the same label (bind, then remount read-only) keeps it;
//! * a pod asking another label of the staged volume is refused (FAILED_PRECONDITION, the
//!   target left unmounted): the staged filesystem has one label. kubelet does not send that
//!   call: with SELinuxMount it refuses to start a pod whose label conflicts with a volume
//!   already mounted for another pod (its volume manager's SELinux label check), so moor's
//!   refusal is the defence behind kubelet's, never what a pod sees first;
//! * a label the policy does not know (`container_file_t`, which kubelet takes from Debian's
//!   `lxc_contexts`, though the policy has no such type) is refused before a blank device is
//!   formatted (FAILED_PRECONDITION), where the kernel would refuse the mount after mkfs.
//!
//! Debian's reference policy has no `container_file_t` (that type is container-selinux's, on
//! Fedora and RHEL): the label here is `svirt_image_t`, refpolicy's type for a sandboxed
//! guest's files, with MCS categories as kubelet gives a pod. The refused process is the
//! policy's `ntpd_t` (a confined daemon's domain), reached from the guest's `kernel_t` through
//! the two dynamic transitions the policy allows (to `init_t`, then to a system daemon). The
//! pods' processes run in `svirt_t`, refpolicy's MCS-constrained sandbox domain (as
//! `container_t` is), at the pod's categories or another pod's.
//!
//! Everything the guest runs (its init, the agent, moor-node) is in `kernel_t`, which the
//! lab's policy makes permissive (`.ci/vm`: the host's shared files have no labels the policy
//! knows, and a node plugin's domain is unconfined on a cluster anyway); every other domain,
//! the refused reader's among them, is enforced, and its denial says `permissive=0`.
//!
//! The guest's agent is reached over a bridge of the test's own (no Ceph cluster needed).
//! Skipped, with the reason, without the VM lab or the policy. `MOOR_VM_SELINUX_QUICK=1` (the
//! test command) runs the life once per filesystem; without it, moor-node is also restarted
//! between the two pods' publishes, and the second publish must find the label in its journal.

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Command;

use moor_lab::ceph::publish;
use moor_lab::krbd_lab::start_node_in;
use moor_lab::vm::{Bridge, Vm, VmOptions};
use moor_privileged::requests::{unpublish_req, unstage_req};
use moor_privileged::{Sandbox, fs_cap, runtime};
use moor_proto::csi::v1 as csi;
use moor_proto::csi::v1::node_client::NodeClient;
use moor_runtime::contract::DEVICE_PATH_KEY;
use tonic::transport::Channel;

const MIB: u64 = 1 << 20;
/// The pods' label, and kubelet's mount flag for it (quoted: the label has a comma).
const LABEL: &str = "system_u:object_r:svirt_image_t:s0:c15,c25";
/// Another pod's label: same type, other categories.
const OTHER: &str = "system_u:object_r:svirt_image_t:s0:c7,c8";
/// The label kubelet makes of Debian's `lxc_contexts`: a type the reference policy lacks.
const UNKNOWN: &str = "system_u:object_r:container_file_t:s0:c15,c25";
/// The pods' domain: refpolicy's MCS-constrained sandbox (container-selinux's `container_t`).
const POD_DOMAIN: &str = "svirt_t";
/// The label on disk of a file that was on the volume before its life.
const PRE_LABEL: &str = "system_u:object_r:etc_t:s0";
/// The kernel command line that turns SELinux on in Debian's kernel (built without the
/// `selinux=` boot parameter; AppArmor, first in its default list, is left out).
const LSM: &str = "lsm=landlock,lockdown,yama,integrity,selinux,bpf";
/// The confined domain the refused process runs in, and the way there from `kernel_t`.
const REFUSED_DOMAIN: &str = "ntpd_t";
const TRANSITIONS: &str = "system_u:system_r:init_t:s0 system_u:system_r:ntpd_t:s0";
/// A process that opens the directory `argv[1]` (O_PATH), moves to each context of `argv[2]`
/// (`/proc/self/attr/current`), then reads `argv[3]` in that directory: exit 0 when it read
/// the file, 13 when refused (EACCES), 2 otherwise. The directory is opened first so that
/// only the volume's own label is checked after the move.
const READER: &str = r#"
import os, sys
d = os.open(sys.argv[1], os.O_PATH | os.O_DIRECTORY)
for ctx in sys.argv[2].split():
    with open("/proc/self/attr/current", "w") as f:
        f.write(ctx)
try:
    fd = os.open(sys.argv[3], os.O_RDONLY, dir_fd=d)
    os.read(fd, 64)
    os._exit(0)
except PermissionError:
    os._exit(13)
except BaseException:
    os._exit(2)
"#;

fn flag(label: &str) -> String {
    format!("context=\"{label}\"")
}

fn cap(fs: &str, label: &str) -> csi::VolumeCapability {
    let mut c = fs_cap(
        fs,
        csi::volume_capability::access_mode::Mode::SingleNodeMultiWriter,
    );
    if let Some(csi::volume_capability::AccessType::Mount(m)) = c.access_type.as_mut() {
        m.mount_flags = vec![flag(label)];
    }
    c
}

/// The reference policy `.ci/vm setup` built, or None with the reason printed.
fn policy(test: &str) -> Option<String> {
    let out = Command::new("bash")
        .arg(moor_lab::vm::script())
        .arg("selinux-policy")
        .output()
        .expect("run .ci/vm selinux-policy");
    if out.status.success() {
        Some(String::from_utf8_lossy(&out.stdout).trim().to_string())
    } else {
        eprintln!(
            "{test}: skipped: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
        None
    }
}

/// The guest's block device with `serial`.
fn disk(vm: &Vm, serial: &str) -> String {
    vm.sh(&format!(
        "for d in /sys/block/vd*; do [ \"$(cat $d/serial 2>/dev/null)\" = {serial} ] && \
         echo /dev/${{d##*/}}; done; true"
    ))
    .trim()
    .to_string()
}

/// The label of guest file `path`, as the kernel answers for `security.selinux`.
fn label_of(vm: &Vm, path: &str) -> String {
    vm.sh(&format!(
        "python3 -c 'import os,sys; print(os.getxattr(sys.argv[1], \"security.selinux\")\
         .rstrip(b\"\\0\").decode())' {path}"
    ))
    .trim()
    .to_string()
}

/// The superblock options of the mount at `path` in the guest.
fn super_options(vm: &Vm, path: &str) -> String {
    vm.sh(&format!(
        "awk '$5 == \"{path}\" {{ print $NF }}' /proc/self/mountinfo | tail -n 1"
    ))
    .trim()
    .to_string()
}

/// Prints the guest's AVC denials and moor-node's log (`.1`, a guest path) when the test fails
/// while it lives.
struct Denials<'a>(&'a Vm, String);

impl Drop for Denials<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let o = self.0.exec(&["sh", "-c", "dmesg | grep 'avc: *denied'"]);
            eprintln!("the guest's AVC denials:\n{}", o.stdout);
            eprintln!("moor-node's log:\n{}", self.0.read(&self.1));
        }
    }
}

fn is_mounted(vm: &Vm, path: &str) -> bool {
    vm.exec(&["mountpoint", "-q", path]).ok()
}

/// The volume's files as they are on disk: mounted without a label at a dir of its own.
fn plain_mount(vm: &Vm, dev: &str, dir: &str) {
    vm.sh(&format!("mkdir -p {dir} && mount {dev} {dir}"));
}

#[test]
fn a_volume_labelled_by_its_mount_on_an_enforcing_kernel() {
    let test = "vm_selinux";
    if !moor_lab::vm::available(test) {
        return;
    }
    let Some(policy) = policy(test) else {
        return;
    };
    let quick = std::env::var("MOOR_VM_SELINUX_QUICK").is_ok_and(|v| v == "1");
    let sb = Sandbox::new("vm-selinux");
    let bridge = Bridge::new("msel", 253);
    let filesystems = ["ext4", "xfs"];
    let mut qemu_opts = Vec::new();
    // A disk per filesystem, and a blank one for a label the policy does not know.
    for (k, fs) in filesystems.iter().chain(&["blank"]).enumerate() {
        let file = sb.data.join(format!("{fs}.img"));
        std::fs::File::create(&file)
            .and_then(|f| f.set_len(320 * MIB))
            .expect("disk file");
        qemu_opts.push("-drive".into());
        qemu_opts.push(format!(
            "file={},if=none,id=sel{k},format=raw,cache=unsafe",
            file.display()
        ));
        qemu_opts.push("-device".into());
        qemu_opts.push(format!("virtio-blk-pci,drive=sel{k},serial=sel-{fs}"));
    }
    let vm = Vm::boot(VmOptions {
        name: "moor-selinux".into(),
        bridge: bridge.name.clone(),
        ip: format!("{}.2", bridge.net),
        // The node's dirs are the guest's own (under its /run, a tmpfs of its own): a file
        // made under a dir of the host's (9p, the guest's /tmp too: an overlay on the host's)
        // would inherit its parent's `unlabeled_t`, which the policy lets no file have.
        rwdirs: Vec::new(),
        dir: sb.root.join("vm"),
        memory: "1G".into(),
        hotplug: 0,
        qemu_opts,
        append: vec![LSM.into()],
        udev: false,
    });
    // The modules the volumes need are loaded before the policy: the guest's kernel_t may not
    // load modules from the host's (unlabelled) files once it is enforced.
    // rbd: the lab starts moor-node with the kernel attacher, which wants its client there.
    vm.sh("modprobe -a loop ext4 xfs rbd");
    vm.sh(
        "grep -qw selinux /sys/kernel/security/lsm && mount -t selinuxfs selinuxfs /sys/fs/selinux",
    );
    // The policy in one write, as the kernel takes it.
    vm.sh(&format!(
        "python3 -c 'import sys; d = open(sys.argv[1], \"rb\").read(); \
         open(\"/sys/fs/selinux/load\", \"wb\", buffering=0).write(d)' {policy}"
    ));
    vm.sh("echo 1 > /sys/fs/selinux/enforce");
    assert_eq!(vm.read("/sys/fs/selinux/enforce").trim(), "1");
    let me = vm.read("/proc/self/attr/current");
    eprintln!("the guest enforces {policy}; its processes run as {me}");

    let dirs = Dirs {
        state: "/run/moor-selinux/state".into(),
        kubelet: "/run/moor-selinux/kubelet".into(),
    };
    vm.sh(&format!(
        "mkdir -p {} {}",
        dirs.state.display(),
        dirs.kubelet.display()
    ));
    let _denials = Denials(&vm, dirs.log().display().to_string());
    runtime().block_on(async {
        let mut node = dirs.start(&vm).await;
        for fs in filesystems {
            life(&vm, &dirs, &mut node, fs, quick).await;
        }
        unknown_label(&vm, &dirs, &mut node).await;
    });
    // The whole run's denials: each is the refused reader's, of the volume's label.
    let avc = vm.sh("dmesg | grep 'avc: *denied' || true");
    eprintln!("AVC denials in the guest:\n{avc}");
}

/// moor-node's dirs in the guest.
struct Dirs {
    state: PathBuf,
    kubelet: PathBuf,
}

impl Dirs {
    fn log(&self) -> PathBuf {
        self.state.join("node.log")
    }

    /// Starts moor-node in the guest and connects.
    async fn start(&self, vm: &Vm) -> NodeClient<Channel> {
        let (state, log) = (&self.state, &self.log());
        start_node_in(
            vm,
            "moor-selinux",
            &self.kubelet,
            "moor-node",
            &[],
            state,
            log,
        )
        .await
    }
}

/// Kubelet's label on a node with Debian's reference policy: its pod file type comes from the
/// runtime's `lxc_contexts`, which names `container_file_t`, a type this policy does not have.
/// The kernel would refuse the mount (EINVAL) after mkfs; moor refuses the stage first
/// (FAILED_PRECONDITION), the device left blank.
async fn unknown_label(vm: &Vm, dirs: &Dirs, node: &mut NodeClient<Channel>) {
    let dev = disk(vm, "sel-blank");
    let staging = dirs.kubelet.join("plugins/staging/vol-unknown");
    let req = csi::NodeStageVolumeRequest {
        volume_id: "vol-unknown".into(),
        publish_context: HashMap::from([(DEVICE_PATH_KEY.into(), dev.clone())]),
        staging_target_path: staging.display().to_string(),
        volume_capability: Some(cap("ext4", UNKNOWN)),
        ..Default::default()
    };
    let e = node
        .node_stage_volume(req)
        .await
        .expect_err("a stage with a label the policy does not know");
    assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e:?}");
    assert!(
        e.message().contains("policy does not know"),
        "{}",
        e.message()
    );
    assert!(!is_mounted(vm, &staging.display().to_string()));
    // Blank still: blkid finds nothing (exit 2).
    let probe = vm.exec(&["blkid", "-p", &dev]);
    assert_eq!(probe.code, Some(2), "the device was written: {probe:?}");
    eprintln!("a stage of {UNKNOWN}: {}: {}", e.code(), e.message());
}

async fn life(vm: &Vm, dirs: &Dirs, node: &mut NodeClient<Channel>, fs: &str, quick: bool) {
    let vol = format!("vol-{fs}");
    let node_log = || vm.read(&dirs.log().display().to_string());
    let dev = disk(vm, &format!("sel-{fs}"));
    assert!(!dev.is_empty(), "no disk sel-{fs} in the guest");
    // A volume that already holds a file, labelled on disk by the policy as it was made.
    let pre_dir = format!("/tmp/pre-{fs}");
    vm.sh(&format!("mkfs.{fs} -q {dev}"));
    plain_mount(vm, &dev, &pre_dir);
    // Its label on disk, one of its own (the node's domain may relabel): what a relabel of
    // the volume would overwrite.
    vm.sh(&format!(
        "echo before > {pre_dir}/pre && python3 -c 'import os, sys; \
         os.setxattr(sys.argv[1], \"security.selinux\", sys.argv[2].encode())' \
         {pre_dir}/pre {PRE_LABEL} && umount {pre_dir}"
    ));
    plain_mount(vm, &dev, &pre_dir);
    let on_disk = label_of(vm, &format!("{pre_dir}/pre"));
    vm.sh(&format!("umount {pre_dir}"));
    assert_eq!(on_disk, PRE_LABEL, "{fs}: pre's label on disk");
    eprintln!("{fs}: the file made before the volume's life is labelled {on_disk} on disk");

    let staging = dirs.kubelet.join(format!("plugins/staging/{vol}"));
    let targets: Vec<_> = ["pod-a", "pod-b", "pod-c", "pod-ro"]
        .iter()
        .map(|p| dirs.kubelet.join(format!("pods/{p}/volumes/{vol}/mount")))
        .collect();
    // The parents kubelet makes before its calls.
    for p in std::iter::once(&staging).chain(&targets) {
        let parent = p.parent().expect("a parent").display().to_string();
        vm.sh(&format!("mkdir -p {parent}"));
    }
    let stage = csi::NodeStageVolumeRequest {
        volume_id: vol.clone(),
        publish_context: HashMap::from([(DEVICE_PATH_KEY.into(), dev.clone())]),
        staging_target_path: staging.display().to_string(),
        volume_capability: Some(cap(fs, LABEL)),
        ..Default::default()
    };
    node.node_stage_volume(stage.clone())
        .await
        .unwrap_or_else(|e| {
            panic!(
                "{fs}: the labelled stage: {e:?}; moor-node's log:\n{}",
                node_log()
            )
        });
    let staging_s = staging.display().to_string();
    let opts = super_options(vm, &staging_s);
    // The label, once, as the kernel shows it (quoted).
    assert_eq!(
        opts.matches(&flag(LABEL)).count(),
        1,
        "{fs}: the staging mount's options: {opts}"
    );

    // Two pods of the same label share the staging mount.
    for (k, target) in targets[..2].iter().enumerate() {
        if k == 1 && !quick {
            // moor-node restarted between them: the label is in its journal.
            // Killed, and gone (the agent's deadline bounds the wait) before the next starts.
            vm.sh(
                "pkill -KILL -x moor-node; while pgrep -x moor-node >/dev/null; do sleep 0.1; done",
            );
            *node = dirs.start(vm).await;
        }
        node.node_publish_volume(publish(&vol, &staging, target, cap(fs, LABEL)))
            .await
            .unwrap_or_else(|e| {
                panic!(
                    "{fs}: publish {k} with the stage's label: {e:?}; moor-node's log:\n{}",
                    node_log()
                )
            });
        let t = target.display().to_string();
        assert!(is_mounted(vm, &t), "{fs}: target {k} is not mounted");
        let opts = super_options(vm, &t);
        assert_eq!(
            opts.matches(&flag(LABEL)).count(),
            1,
            "{fs}: target {k}'s options: {opts}"
        );
    }
    let a = targets[0].display().to_string();
    let b = targets[1].display().to_string();

    // Files made in the pod carry the label; the file that was there shows it too.
    vm.sh(&format!(
        "echo from-the-pod > {a}/new && mkdir {a}/dir && echo deep > {a}/dir/f"
    ));
    for f in [
        format!("{a}/new"),
        format!("{a}/dir/f"),
        format!("{a}/pre"),
        format!("{b}/new"),
    ] {
        assert_eq!(label_of(vm, &f), LABEL, "{fs}: the label of {f}");
    }
    eprintln!("{fs}: {a}/new, {a}/dir/f and {a}/pre are labelled {LABEL}");

    // The node's domain reads the volume; a confined domain is refused by the kernel.
    let read = |transitions: &str| {
        vm.exec(&["python3", "-c", READER, &a, transitions, "new"])
            .code
    };
    assert_eq!(
        read(""),
        Some(0),
        "{fs}: the node's domain reads the volume"
    );
    assert_eq!(
        read(TRANSITIONS),
        Some(13),
        "{fs}: a process in {REFUSED_DOMAIN} must be refused the volume"
    );
    let denial = vm.sh(&format!(
        "dmesg | grep 'avc: *denied' | grep 'scontext=system_u:system_r:{REFUSED_DOMAIN}:s0' \
         | grep 'tcontext={LABEL} ' | tail -n 1"
    ));
    assert!(
        !denial.trim().is_empty(),
        "{fs}: no AVC denial of {REFUSED_DOMAIN} on {LABEL}: {}",
        vm.sh("dmesg | grep avc || true")
    );
    // Enforced, not only logged: the guest's own domain is permissive (`.ci/vm`), this one not.
    assert!(denial.contains("permissive=0"), "{fs}: {denial}");
    eprintln!("{fs}: the refused read: {}", denial.trim());

    // MCS, as between two pods: a process of the pod's own label (refpolicy's sandbox domain,
    // MCS-constrained as container_t is) reads the volume; one of the other pod's categories is
    // refused. The lab's permissive kernel_t moves straight into the domain (the move is only
    // logged); the read is the sandbox domain's own, enforced.
    let pod = |level: &str| format!("system_u:system_r:{POD_DOMAIN}:{level}");
    assert_eq!(
        read(&pod("s0:c15,c25")),
        Some(0),
        "{fs}: a process of the pod's label reads the volume"
    );
    assert_eq!(
        read(&pod("s0:c7,c8")),
        Some(13),
        "{fs}: a process of the other pod's categories must be refused the volume"
    );
    let denial = vm.sh(&format!(
        "dmesg | grep 'avc: *denied' | grep 'scontext={} ' | grep 'tcontext={LABEL} ' \
         | tail -n 1",
        pod("s0:c7,c8")
    ));
    assert!(
        denial.contains("permissive=0"),
        "{fs}: no enforced AVC denial of {} on {LABEL}: {}",
        pod("s0:c7,c8"),
        vm.sh("dmesg | grep avc || true")
    );
    eprintln!("{fs}: the other pod's read: {}", denial.trim());

    // A pod of another label: refused, nothing mounted.
    let e = node
        .node_publish_volume(publish(&vol, &staging, &targets[2], cap(fs, OTHER)))
        .await
        .expect_err("a publish of another label");
    assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{fs}: {e:?}");
    assert!(e.message().contains(LABEL), "{fs}: {}", e.message());
    assert!(!is_mounted(vm, &targets[2].display().to_string()));
    eprintln!("{fs}: a publish of {OTHER}: {}: {}", e.code(), e.message());

    // A read-only publish (a bind mount, then its remount read-only) of the same label: the
    // remount keeps the label, and the pod reads the files with it.
    let mut ro = publish(&vol, &staging, &targets[3], cap(fs, LABEL));
    ro.readonly = true;
    node.node_publish_volume(ro)
        .await
        .unwrap_or_else(|e| panic!("{fs}: a read-only publish with the label: {e:?}"));
    let r = targets[3].display().to_string();
    assert!(
        is_mounted(vm, &r),
        "{fs}: the read-only target is not mounted"
    );
    assert_eq!(label_of(vm, &format!("{r}/new")), LABEL, "{fs}: {r}/new");
    let write = vm.exec(&["sh", "-c", &format!("echo x > {r}/ro")]);
    assert!(!write.ok(), "{fs}: the read-only target took a write");

    for target in [&targets[0], &targets[1], &targets[3]] {
        node.node_unpublish_volume(unpublish_req(&vol, target))
            .await
            .unwrap_or_else(|e| panic!("{fs}: unpublish: {e:?}"));
    }
    node.node_unstage_volume(unstage_req(&vol, &staging))
        .await
        .unwrap_or_else(|e| panic!("{fs}: unstage: {e:?}"));
    assert!(!is_mounted(vm, &staging_s));

    // No relabel ran: on disk, the old file keeps its label, the pod's files have none
    // written (a plain mount shows them with the policy's label for unlabelled files).
    plain_mount(vm, &dev, &pre_dir);
    assert_eq!(
        label_of(vm, &format!("{pre_dir}/pre")),
        on_disk,
        "{fs}: pre"
    );
    let unlabelled = label_of(vm, &format!("{pre_dir}/new"));
    assert_ne!(
        unlabelled, LABEL,
        "{fs}: the pod's file was labelled on disk"
    );
    assert_eq!(
        label_of(vm, &format!("{pre_dir}/dir/f")),
        unlabelled,
        "{fs}: dir/f"
    );
    vm.sh(&format!("umount {pre_dir}"));
    if fs == "ext4" {
        // ext4's own record of the inode's extended attributes: none on the pod's file.
        let eas = |f: &str| vm.sh(&format!("debugfs -R 'ea_list /{f}' {dev} 2>/dev/null"));
        let new = eas("new");
        assert!(
            !new.contains("selinux"),
            "{fs}: new's xattrs on disk: {new}"
        );
        let pre = eas("pre");
        assert!(pre.contains(PRE_LABEL), "{fs}: pre's xattrs on disk: {pre}");
    }
    eprintln!(
        "{fs}: after the life, on disk: pre {on_disk}, the pod's files {unlabelled} (no xattr)"
    );
}
