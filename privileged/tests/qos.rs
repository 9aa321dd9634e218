//! A volume's QoS limits in its pod's cgroup, on this host's kernel: a pod's cgroup made as
//! kubelet's cgroupfs driver makes it (`kubepods/burstable/pod<uid>`), a local volume on a
//! loop device staged and published for that pod, the kernel's throttling files holding the
//! rule for the loop device, direct I/O from a process in that cgroup counted there on that
//! device, and the rule gone after the unpublish. cgroup v1's blkio where the host has it
//! (this machine), else cgroup v2's io controller; skipped, saying why, with neither.
//!
//! The pod's cgroup lives in a cgroup of the test's own (removed after), which the engine sees
//! as its cgroup root through a bind mount in the test's private mount namespace.

use std::collections::HashMap;
use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};
use std::process::Command;

use moor_privileged::{Sandbox, fs_cap, require_root, runtime};
use moor_proto::csi::v1 as csi;
use moor_proto::csi::v1::node_server::Node as _;
use tonic::Request;

const UID: &str = "5d7a3c1e-0f42-4b8e-9c6d-1a2b3c4d5e6f";
const MIB: u64 = 1 << 20;

/// The host's hierarchy that throttles block I/O.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Version {
    V1,
    V2,
}

/// The test's own cgroup and the pod's below it; removed (deepest first) when dropped.
struct Cgroups {
    version: Version,
    /// The test's cgroup: the engine's hierarchy root.
    top: PathBuf,
    /// The pod's cgroup, as kubelet's cgroupfs driver makes it.
    pod: PathBuf,
    made: Vec<PathBuf>,
}

impl Cgroups {
    fn new(name: &str) -> Option<Self> {
        let (version, hier) =
            if Path::new("/sys/fs/cgroup/blkio/blkio.throttle.read_bps_device").exists() {
                (Version::V1, PathBuf::from("/sys/fs/cgroup/blkio"))
            } else if std::fs::read_to_string("/sys/fs/cgroup/cgroup.controllers")
                .is_ok_and(|c| c.split_whitespace().any(|x| x == "io"))
            {
                (Version::V2, PathBuf::from("/sys/fs/cgroup"))
            } else {
                return None;
            };
        let top = hier.join(format!("moor-qos-{name}-{}", std::process::id()));
        let mut me = Self {
            version,
            pod: top.join(format!("kubepods/burstable/pod{UID}")),
            top: top.clone(),
            made: Vec::new(),
        };
        let mut dir = top;
        for part in ["", "kubepods", "burstable", &format!("pod{UID}")] {
            if !part.is_empty() {
                dir = dir.join(part);
            }
            if version == Version::V2 {
                // The io controller reaches a cgroup only through its parent's subtree_control.
                let parent = dir.parent().expect("parent");
                std::fs::write(parent.join("cgroup.subtree_control"), "+io")
                    .unwrap_or_else(|e| panic!("+io in {}: {e}", parent.display()));
            }
            std::fs::create_dir(&dir).unwrap_or_else(|e| panic!("mkdir {}: {e}", dir.display()));
            me.made.push(dir.clone());
        }
        Some(me)
    }

    /// The rule file's text for one limit (v1) or all (v2).
    fn rules(&self, v1_file: &str) -> String {
        let file = match self.version {
            Version::V1 => v1_file,
            Version::V2 => "io.max",
        };
        std::fs::read_to_string(self.pod.join(file)).expect("read the rule file")
    }

    /// Bytes read and written on device `dev` by the pod's cgroup, as the kernel counted them.
    fn io_bytes(&self, dev: (u32, u32)) -> (u64, u64) {
        let want = format!("{}:{}", dev.0, dev.1);
        let (mut read, mut written) = (0, 0);
        match self.version {
            Version::V1 => {
                let text =
                    std::fs::read_to_string(self.pod.join("blkio.throttle.io_service_bytes"))
                        .expect("io_service_bytes");
                for line in text.lines() {
                    let w: Vec<&str> = line.split_whitespace().collect();
                    if let [d, op, n] = w.as_slice()
                        && *d == want
                    {
                        let n: u64 = n.parse().expect("a count");
                        match *op {
                            "Read" => read = n,
                            "Write" => written = n,
                            _ => {}
                        }
                    }
                }
            }
            Version::V2 => {
                let text = std::fs::read_to_string(self.pod.join("io.stat")).expect("io.stat");
                for line in text.lines().filter(|l| l.starts_with(&format!("{want} "))) {
                    for kv in line.split_whitespace().skip(1) {
                        match kv.split_once('=') {
                            Some(("rbytes", n)) => read = n.parse().expect("a count"),
                            Some(("wbytes", n)) => written = n.parse().expect("a count"),
                            _ => {}
                        }
                    }
                }
            }
        }
        (read, written)
    }
}

impl Drop for Cgroups {
    fn drop(&mut self) {
        for dir in self.made.iter().rev() {
            if let Err(e) = std::fs::remove_dir(dir) {
                eprintln!("cannot remove cgroup {}: {e}", dir.display());
            }
        }
    }
}

/// Runs `sh -c script` as a process of the pod's cgroup (it moves itself there first).
fn in_pod(cg: &Cgroups, script: &str) {
    let procs = cg.pod.join("cgroup.procs");
    let st = Command::new("sh")
        .arg("-c")
        .arg(format!("echo $$ > {} && {script}", procs.display()))
        .status()
        .expect("sh");
    assert!(st.success(), "{script} in the pod's cgroup");
}

fn device_number(dev: &Path) -> (u32, u32) {
    let rdev = std::fs::metadata(dev).expect("stat device").rdev();
    (rustix::fs::major(rdev), rustix::fs::minor(rdev))
}

#[test]
fn a_pods_cgroup_holds_its_volumes_limits_and_counts_its_direct_io_there() {
    require_root();
    let Some(cg) = Cgroups::new("publish") else {
        eprintln!(
            "SKIPPED: this host has neither cgroup v1's blkio nor cgroup v2's io controller \
             at /sys/fs/cgroup"
        );
        return;
    };
    let sb = Sandbox::new("qos");
    // The engine's cgroup root: the test's cgroup, where the hierarchy's root would be.
    let root = sb.root.join("cgroot");
    let seen = match cg.version {
        Version::V1 => root.join("blkio"),
        Version::V2 => root.clone(),
    };
    std::fs::create_dir_all(&seen).expect("cgroup root dir");
    rustix::mount::mount_bind(cg.top.as_path(), seen.as_path()).expect("bind the test's cgroup");
    let svc = sb.node_service_with(&sb.state, |c| c.cgroup_root = root.clone());

    let dev = sb.loop_device("qos", 64 * MIB);
    let rdev = device_number(&dev);
    let staging = sb.staging("pv-qos");
    let target = sb.target(UID, "pv-qos");
    let cap = fs_cap(
        "ext4",
        csi::volume_capability::access_mode::Mode::SingleNodeWriter,
    );
    let rt = runtime();
    rt.block_on(
        svc.node_stage_volume(Request::new(csi::NodeStageVolumeRequest {
            volume_id: "vol-qos".into(),
            publish_context: HashMap::from([("devicePath".into(), dev.display().to_string())]),
            staging_target_path: staging.display().to_string(),
            volume_capability: Some(cap.clone()),
            secrets: HashMap::new(),
            volume_context: HashMap::new(),
        })),
    )
    .expect("stage");
    let limits = "readBytesPerSecond=8388608,writeBytesPerSecond=4194304,writeIOPS=2000";
    rt.block_on(
        svc.node_publish_volume(Request::new(csi::NodePublishVolumeRequest {
            volume_id: "vol-qos".into(),
            publish_context: HashMap::from([("qosLimits".into(), limits.into())]),
            staging_target_path: staging.display().to_string(),
            target_path: target.display().to_string(),
            volume_capability: Some(cap),
            readonly: false,
            secrets: HashMap::new(),
            volume_context: HashMap::from([("csi.storage.k8s.io/pod.uid".into(), UID.into())]),
        })),
    )
    .expect("publish");

    // The kernel's files hold the rule for the loop device.
    let (major, minor) = rdev;
    match cg.version {
        Version::V1 => {
            for (file, want) in [
                ("blkio.throttle.read_bps_device", "8388608"),
                ("blkio.throttle.write_bps_device", "4194304"),
                ("blkio.throttle.write_iops_device", "2000"),
            ] {
                assert_eq!(
                    cg.rules(file).trim(),
                    format!("{major}:{minor} {want}"),
                    "{file}"
                );
            }
            assert_eq!(cg.rules("blkio.throttle.read_iops_device"), "");
        }
        Version::V2 => assert_eq!(
            cg.rules("").trim(),
            format!("{major}:{minor} rbps=8388608 wbps=4194304 riops=max wiops=2000")
        ),
    }

    // Direct I/O from a process of the pod's cgroup is counted there, on that device.
    let file = target.join("data");
    let (r0, w0) = cg.io_bytes(rdev);
    in_pod(
        &cg,
        &format!(
            "dd if=/dev/zero of={} bs=64k count=32 oflag=direct status=none && \
             dd if={} of=/dev/null bs=64k iflag=direct status=none",
            file.display(),
            file.display()
        ),
    );
    let (r1, w1) = cg.io_bytes(rdev);
    assert!(
        w1 - w0 >= 2 * MIB,
        "the pod's cgroup counted {} bytes written on {major}:{minor}, not the 2 MiB written",
        w1 - w0
    );
    assert!(
        r1 - r0 >= 2 * MIB,
        "the pod's cgroup counted {} bytes read on {major}:{minor}, not the 2 MiB read",
        r1 - r0
    );

    // Unpublished: the rule is gone from the pod's cgroup, which is still there.
    rt.block_on(
        svc.node_unpublish_volume(Request::new(csi::NodeUnpublishVolumeRequest {
            volume_id: "vol-qos".into(),
            target_path: target.display().to_string(),
        })),
    )
    .expect("unpublish");
    let prefix = format!("{major}:{minor} ");
    for file in [
        "blkio.throttle.read_bps_device",
        "blkio.throttle.write_bps_device",
        "blkio.throttle.write_iops_device",
    ] {
        assert!(
            !cg.rules(file).lines().any(|l| l.starts_with(&prefix)),
            "{file} after the unpublish: {}",
            cg.rules(file)
        );
    }
    rt.block_on(
        svc.node_unstage_volume(Request::new(csi::NodeUnstageVolumeRequest {
            volume_id: "vol-qos".into(),
            staging_target_path: staging.display().to_string(),
        })),
    )
    .expect("unstage");
    drop(sb);
    drop(cg);
}
