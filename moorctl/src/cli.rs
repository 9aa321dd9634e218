//! The command line: every command, its arguments and the documented exit codes.

use std::collections::BTreeMap;
use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};

/// Exit codes, also printed at the end of `--help`.
pub const EXIT_CODES: &str = "\
Exit codes:
  0  success
  1  the driver answered the call with a gRPC error
  2  usage error (bad arguments)
  3  cannot connect to the endpoint
  4  status: at least one volume is not healthy, or a journal record is unreadable
  5  a local failure: the journal or the mount table cannot be read, or a demo step failed";

/// moorctl: calls moor's CSI sockets by hand, reports what a node has mounted, runs the demo.
#[derive(Debug, Parser)]
#[command(name = "moorctl", version, after_help = EXIT_CODES)]
pub struct Cli {
    /// The CSI socket: a unix:// URL or a plain path (a node's or the controller's).
    #[arg(
        long,
        global = true,
        default_value = "unix:///csi/csi.sock",
        env = "CSI_ENDPOINT"
    )]
    pub endpoint: String,
    /// How to print answers: a table for people, JSON for scripts.
    #[arg(long, short, global = true, value_enum, default_value_t = Output::Table)]
    pub output: Output,
    /// Deadline for connecting and for each call, in seconds.
    #[arg(long, global = true, default_value_t = 120)]
    pub timeout: u64,
    /// The CSI secrets every call that carries secrets is given, as the CSI sidecars pass a
    /// StorageClass's secrets (an RBD volume's `userID` and `userKey`): a file of KEY=VALUE
    /// lines (`#` starts a comment), or a JSON object. A file, so that no key shows in the
    /// process list or the shell's history; it is never printed.
    #[arg(long, global = true, env = "MOOR_SECRETS")]
    pub secrets: Option<PathBuf>,
    /// The command.
    #[command(subcommand)]
    pub command: Command,
}

/// Output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Output {
    /// Aligned columns and sentences.
    Table,
    /// One JSON document on stdout.
    Json,
}

/// Every command.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Plugin info, capabilities, readiness, and node info or controller capabilities.
    #[command(after_help = EXIT_CODES)]
    Info,
    /// Asks the plugin whether it is ready (Probe).
    #[command(after_help = EXIT_CODES)]
    Probe(ProbeArgs),
    /// Volumes on the controller.
    #[command(subcommand)]
    Volume(VolumeCommand),
    /// Snapshots on the controller.
    #[command(subcommand)]
    Snapshot(SnapshotCommand),
    /// Attaches a volume to a node (ControllerPublishVolume); prints the publish context.
    #[command(after_help = EXIT_CODES)]
    Publish(PublishArgs),
    /// Detaches a volume from a node (ControllerUnpublishVolume).
    #[command(after_help = EXIT_CODES)]
    Unpublish(UnpublishArgs),
    /// Stages a volume on this node, as kubelet would (NodeStageVolume).
    #[command(after_help = EXIT_CODES)]
    Stage(StageArgs),
    /// Unstages a volume (NodeUnstageVolume).
    #[command(after_help = EXIT_CODES)]
    Unstage(UnstageArgs),
    /// Mounts a staged volume at a pod's target (NodePublishVolume).
    #[command(after_help = EXIT_CODES)]
    Mount(MountArgs),
    /// Unmounts a volume from a pod's target (NodeUnpublishVolume).
    #[command(after_help = EXIT_CODES)]
    Unmount(UnmountArgs),
    /// Usage and condition of a mounted volume (NodeGetVolumeStats).
    #[command(after_help = EXIT_CODES)]
    Stats(StatsArgs),
    /// Rotates an encrypted volume's data key on the node where it is staged.
    ///
    /// With `--controller` (the way to rotate): the controller's record is the truth for the
    /// volume's wrapped key. The controller makes the new key and writes it into the record as
    /// pending (BeginVolumeKeyRotation on `--controller`), the node where the volume is staged
    /// (`--endpoint`) moves the LUKS key slot from the current key to the pending one online,
    /// each step journaled, and verifies it (RotateVolumeKey), and the controller then makes
    /// the pending key current (FinishVolumeKeyRotation). Run again, it resumes where a crash
    /// left it. `--secrets` holds the key-encryption key (`kek`, `kekID`).
    ///
    /// Without `--controller`: the node's call alone, with `--old-dek`; the new key is made
    /// here and printed on standard error before the call (keep it): nothing writes it into
    /// the controller's record, so the volume then opens only on this node or with that key.
    #[command(after_help = EXIT_CODES)]
    RotateKey(RotateKeyArgs),
    /// Rotates the key-encryption key of every encrypted volume's record on the controller.
    ///
    /// moor's own RotateKeyEncryptionKey call on the controller's socket (`--endpoint`): each
    /// record's data keys (current and a rotation's pending one) unwrapped with the KEK of
    /// `--secrets` and wrapped again with the KEK of `--new-secrets`, one record at a time,
    /// no LUKS header and no data touched. Run again after a crash, it resumes. Then give the
    /// nodes the new KEK (the node-stage and node-expand secrets); retire the old one once no
    /// volume is staged with it (docs/encryption.md, "KEK rotation").
    #[command(after_help = EXIT_CODES)]
    RotateKek(RotateKekArgs),
    /// An encrypted volume's keys, by hand, with no moor daemon (`key unwrap`).
    #[command(subcommand)]
    Key(KeyCommand),
    /// Checks every volume moor staged or published here against the mount table and device.
    ///
    /// Reads moor-node's journal (without changing it) and compares each staged or published
    /// path with the live mount table and the recorded device. Verdicts: healthy, remembered
    /// (recorded before the node's last reboot and not mounted since: a memory moor-node holds
    /// nothing by, no fault), kubelet-forgot (mounted as recorded, but the vol_data.json
    /// kubelet keeps beside it is gone: kubelet no longer knows the mount, which moor-node
    /// leaves mounted), drifted
    /// (a recorded mount is missing or from another device, an operation never finished, or a
    /// loop device's file was deleted), unknown (the device cannot be checked: an error other
    /// than "not there", or it reads as 0 bytes, as a detached loop device does), corrupted
    /// (the mount fails with ENOTCONN, ESTALE, EIO...), device-gone (the device node is
    /// missing or another device: moor-node's own rule). Run it on the node, as root. Exits 4
    /// when any volume is neither healthy nor remembered.
    #[command(after_help = EXIT_CODES)]
    Status(StatusArgs),
    /// Runs moor-controller and moor-node in a temp dir and walks a whole volume life.
    ///
    /// Create, attach, stage, publish, write a file, snapshot, restore and read back, expand
    /// online, a raw block volume, then unpublish, unstage, detach and delete. Needs root.
    /// It runs in a private mount namespace, and removes everything it made (daemons, mounts,
    /// loop devices, files), also when a step fails or on Ctrl-C: the first Ctrl-C lets the
    /// running step finish, a second abandons it.
    #[command(after_help = EXIT_CODES)]
    Demo(DemoArgs),
    /// Prints a shell completion script.
    #[command(after_help = EXIT_CODES)]
    Completion(CompletionArgs),
}

/// `volume ...`.
#[derive(Debug, Subcommand)]
pub enum VolumeCommand {
    /// Creates a volume (CreateVolume).
    #[command(after_help = EXIT_CODES)]
    Create(VolumeCreateArgs),
    /// Deletes a volume (DeleteVolume).
    #[command(after_help = EXIT_CODES)]
    Delete(IdArg),
    /// Lists volumes (ListVolumes, every page).
    #[command(after_help = EXIT_CODES)]
    List,
    /// Shows one volume (ControllerGetVolume).
    #[command(after_help = EXIT_CODES)]
    Get(IdArg),
    /// Grows a volume (ControllerExpandVolume).
    #[command(after_help = EXIT_CODES)]
    Expand(VolumeExpandArgs),
}

/// `snapshot ...`.
#[derive(Debug, Subcommand)]
pub enum SnapshotCommand {
    /// Snapshots a volume (CreateSnapshot).
    #[command(after_help = EXIT_CODES)]
    Create(SnapshotCreateArgs),
    /// Deletes a snapshot (DeleteSnapshot).
    #[command(after_help = EXIT_CODES)]
    Delete(IdArg),
    /// Lists snapshots (ListSnapshots, every page).
    #[command(after_help = EXIT_CODES)]
    List(SnapshotListArgs),
}

/// A volume or snapshot id.
#[derive(Debug, Args)]
pub struct IdArg {
    /// The id.
    pub id: String,
}

/// How a volume is accessed: a filesystem or a raw block device, and the access mode.
#[derive(Debug, Clone, Args)]
pub struct CapabilityArgs {
    /// Raw block access instead of a filesystem.
    #[arg(long)]
    pub block: bool,
    /// Filesystem type (ignored with --block).
    #[arg(long, default_value = "ext4")]
    pub fs_type: String,
    /// Mount flag (repeatable; ignored with --block).
    #[arg(long = "mount-flag")]
    pub mount_flags: Vec<String>,
    /// Access mode.
    #[arg(long, value_enum, default_value_t = AccessMode::SingleNodeWriter)]
    pub access_mode: AccessMode,
}

/// CSI access modes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum AccessMode {
    /// SINGLE_NODE_WRITER.
    SingleNodeWriter,
    /// SINGLE_NODE_READER_ONLY.
    SingleNodeReaderOnly,
    /// MULTI_NODE_READER_ONLY.
    MultiNodeReaderOnly,
    /// MULTI_NODE_SINGLE_WRITER.
    MultiNodeSingleWriter,
    /// MULTI_NODE_MULTI_WRITER.
    MultiNodeMultiWriter,
    /// SINGLE_NODE_SINGLE_WRITER.
    SingleNodeSingleWriter,
    /// SINGLE_NODE_MULTI_WRITER.
    SingleNodeMultiWriter,
}

/// `volume create`.
#[derive(Debug, Args)]
pub struct VolumeCreateArgs {
    /// The volume's name (CreateVolume is idempotent by name).
    pub name: String,
    /// Size: bytes or with a unit (K, M, G, T, KiB, MiB, GiB, TiB).
    #[arg(long, value_parser = parse_size)]
    pub size: u64,
    /// Fill it from this snapshot.
    #[arg(long, conflicts_with = "from_volume")]
    pub from_snapshot: Option<String>,
    /// Clone it from this volume.
    #[arg(long)]
    pub from_volume: Option<String>,
    /// The backend that makes it: `embedded` (the controller's loop devices, its default) or
    /// `rbd` (an image of a Ceph cluster; with --pool, and --cluster-id or --monitors). Sets
    /// the storage-class parameter `backend`.
    #[arg(long)]
    pub backend: Option<String>,
    /// The RBD pool (the parameter `pool`).
    #[arg(long)]
    pub pool: Option<String>,
    /// The Ceph cluster, by its clusterID in the controller's cluster list (the parameter
    /// `clusterID`).
    #[arg(long)]
    pub cluster_id: Option<String>,
    /// The Ceph cluster, by its monitors, comma-separated (the parameter `monitors`).
    #[arg(long)]
    pub monitors: Option<String>,
    /// A storage-class parameter KEY=VALUE (repeatable).
    #[arg(long = "param", value_parser = parse_key_value)]
    pub params: Vec<(String, String)>,
    /// Access.
    #[command(flatten)]
    pub cap: CapabilityArgs,
}

impl VolumeCreateArgs {
    /// The storage-class parameters: the named options, then `--param`s (which a named
    /// option given too must agree with).
    pub fn parameters(&self) -> Result<BTreeMap<String, String>, String> {
        let named = [
            ("backend", &self.backend),
            ("pool", &self.pool),
            ("clusterID", &self.cluster_id),
            ("monitors", &self.monitors),
        ];
        let mut out: BTreeMap<String, String> = named
            .iter()
            .filter_map(|(k, v)| v.as_ref().map(|v| ((*k).to_string(), v.clone())))
            .collect();
        for (k, v) in &self.params {
            match out.get(k) {
                Some(old) if old != v => {
                    return Err(format!("--param {k}={v} contradicts {k}={old}"));
                }
                _ => {
                    out.insert(k.clone(), v.clone());
                }
            }
        }
        Ok(out)
    }
}

/// `volume expand`.
#[derive(Debug, Args)]
pub struct VolumeExpandArgs {
    /// The volume id.
    pub id: String,
    /// New size: bytes or with a unit.
    #[arg(long, value_parser = parse_size)]
    pub size: u64,
    /// Access.
    #[command(flatten)]
    pub cap: CapabilityArgs,
}

/// `snapshot create`.
#[derive(Debug, Args)]
pub struct SnapshotCreateArgs {
    /// The snapshot's name.
    pub name: String,
    /// The volume to snapshot.
    #[arg(long)]
    pub volume: String,
}

/// `snapshot list`.
#[derive(Debug, Args)]
pub struct SnapshotListArgs {
    /// Only snapshots of this volume.
    #[arg(long)]
    pub volume: Option<String>,
}

/// `publish`.
#[derive(Debug, Args)]
pub struct PublishArgs {
    /// The volume id.
    pub volume: String,
    /// The node to attach it to.
    #[arg(long)]
    pub node: String,
    /// Attach read-only.
    #[arg(long)]
    pub readonly: bool,
    /// Access.
    #[command(flatten)]
    pub cap: CapabilityArgs,
}

/// `unpublish`.
#[derive(Debug, Args)]
pub struct UnpublishArgs {
    /// The volume id.
    pub volume: String,
    /// The node to detach it from.
    #[arg(long)]
    pub node: String,
}

/// `stage`.
#[derive(Debug, Args)]
pub struct StageArgs {
    /// The volume id.
    pub volume: String,
    /// kubelet's staging path.
    #[arg(long)]
    pub staging: PathBuf,
    /// The device (sets publish_context devicePath).
    #[arg(long)]
    pub device: Option<String>,
    /// A publish_context entry KEY=VALUE, as ControllerPublishVolume returned it (repeatable).
    #[arg(long = "context", value_parser = parse_key_value)]
    pub context: Vec<(String, String)>,
    /// Access.
    #[command(flatten)]
    pub cap: CapabilityArgs,
}

/// `unstage`.
#[derive(Debug, Args)]
pub struct UnstageArgs {
    /// The volume id.
    pub volume: String,
    /// kubelet's staging path.
    #[arg(long)]
    pub staging: PathBuf,
}

/// `rotate-key`.
#[derive(Debug, Args)]
pub struct RotateKeyArgs {
    /// The volume id.
    pub volume: String,
    /// The controller whose record holds the volume's keys (its socket, `unix://...`): the
    /// rotation begins and ends there, and `--old-dek` and `--new-dek` come from its record.
    #[arg(long, conflicts_with_all = ["old_dek", "new_dek"])]
    pub controller: Option<String>,
    /// Without `--controller`: the volume's data key now, wrapped (its `encryptedDEK`,
    /// `v1:<kek id>:<base64>`).
    #[arg(long, required_unless_present = "controller")]
    pub old_dek: Option<String>,
    /// The new data key, wrapped by the same key-encryption key: to resume a rotation with
    /// the key the first run printed. Made here when not given.
    #[arg(long)]
    pub new_dek: Option<String>,
    /// The new key slot's PBKDF: the volume's `luksPBKDF`.
    #[arg(long, default_value = "pbkdf2")]
    pub pbkdf: String,
}

/// `key ...`.
#[derive(Debug, Subcommand)]
pub enum KeyCommand {
    /// Writes a volume's data key, unwrapped, to standard output, for a pipe only.
    ///
    /// The recovery without moor (docs/encryption.md, "Recovery when the key source is
    /// gone"): the data key of `--volume`, unwrapped from `--wrapped-dek` by the key source
    /// `--kms-id` that `--secrets` configures (the Secret's `kek` and `kekID`, or a KMIP
    /// server's fields), written to standard output as exactly the bytes moor gives
    /// cryptsetup: `moorctl key unwrap ... | cryptsetup open --key-file=- <device> <name>`.
    /// No daemon is asked. Refused when standard output is a terminal (a key is never shown
    /// on a screen) and for a `tpm2` volume (its passphrase also needs its node's TPM).
    #[command(after_help = EXIT_CODES)]
    Unwrap(KeyUnwrapArgs),
}

/// `key unwrap`.
#[derive(Debug, Args)]
pub struct KeyUnwrapArgs {
    /// The volume id: the wrap is bound to it, so another volume's id unwraps nothing.
    #[arg(long)]
    pub volume: String,
    /// The volume's wrapped data key (`v1:<kek id>:<base64>`): its `encryptedDEK`, from the
    /// PV's volume attributes, the embedded record file or the RBD image's metadata
    /// `moor.csi.io/encryptedDEK`. Not secret.
    #[arg(long)]
    pub wrapped_dek: String,
    /// The volume's key source (its `kmsID`: `secret`, `kmip`; `tpm2` is refused).
    #[arg(long)]
    pub kms_id: String,
}

/// `rotate-kek`.
#[derive(Debug, Args)]
pub struct RotateKekArgs {
    /// A file of KEY=VALUE lines holding the new key-encryption key (`kek`, `kekID`; its id
    /// must differ from the old one's), as `--secrets` holds the old one.
    #[arg(long)]
    pub new_secrets: PathBuf,
    /// The key source both KEKs belong to (`kmsID`).
    #[arg(long, default_value = "secret")]
    pub kms_id: String,
}

/// `mount`.
#[derive(Debug, Args)]
pub struct MountArgs {
    /// The volume id.
    pub volume: String,
    /// kubelet's staging path.
    #[arg(long)]
    pub staging: PathBuf,
    /// The pod's target path.
    #[arg(long)]
    pub target: PathBuf,
    /// Mount read-only.
    #[arg(long)]
    pub readonly: bool,
    /// Access.
    #[command(flatten)]
    pub cap: CapabilityArgs,
}

/// `unmount`.
#[derive(Debug, Args)]
pub struct UnmountArgs {
    /// The volume id.
    pub volume: String,
    /// The pod's target path.
    #[arg(long)]
    pub target: PathBuf,
}

/// `probe`.
#[derive(Debug, Args)]
pub struct ProbeArgs {
    /// Waits up to SECONDS for the socket to answer a call, as for a daemon that is starting
    /// (its socket may not exist yet, or refuse connections); without it a socket that does not
    /// answer at once is exit code 3.
    #[arg(long, value_name = "SECONDS")]
    pub wait: Option<u64>,
    /// With --wait: stop waiting as soon as process PID (the daemon, started a moment ago)
    /// has exited.
    #[arg(long, value_name = "PID", requires = "wait")]
    pub wait_pid: Option<u32>,
}

/// `stats`.
#[derive(Debug, Args)]
pub struct StatsArgs {
    /// The volume id.
    pub volume: String,
    /// A path where it is published or staged.
    #[arg(long)]
    pub path: PathBuf,
    /// Its staging path, if known.
    #[arg(long)]
    pub staging: Option<PathBuf>,
}

/// moor-node's default --state-dir.
pub const DEFAULT_STATE_DIR: &str = "/var/lib/moor";

/// `status`.
#[derive(Debug, Args)]
pub struct StatusArgs {
    /// moor-node's --state-dir. Default: the one the moor-node at --endpoint reports, or
    /// /var/lib/moor when --endpoint is not given and nothing answers on the default one.
    #[arg(long)]
    pub state_dir: Option<PathBuf>,
}

/// `demo`.
#[derive(Debug, Args)]
pub struct DemoArgs {
    /// Filesystem for the demo's volumes.
    #[arg(long, value_parser = ["xfs", "ext4", "btrfs"], default_value = "xfs")]
    pub fs_type: String,
    /// Where moor-node and moor-controller are (default: next to moorctl).
    #[arg(long)]
    pub bin_dir: Option<PathBuf>,
}

/// `completion`.
#[derive(Debug, Args)]
pub struct CompletionArgs {
    /// The shell.
    pub shell: clap_complete::Shell,
}

/// Parses a size: plain bytes, or a number with K/M/G/T (powers of 1000) or KiB/MiB/GiB/TiB
/// (powers of 1024).
pub fn parse_size(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("{text:?} is not a size (e.g. 1GiB, 512MiB, 1073741824)"))?;
    let mult: u64 = match unit.trim() {
        "" | "B" => 1,
        "K" | "KB" => 1000,
        "M" | "MB" => 1000_u64.pow(2),
        "G" | "GB" => 1000_u64.pow(3),
        "T" | "TB" => 1000_u64.pow(4),
        "Ki" | "KiB" => 1 << 10,
        "Mi" | "MiB" => 1 << 20,
        "Gi" | "GiB" => 1 << 30,
        "Ti" | "TiB" => 1 << 40,
        other => return Err(format!("unknown size unit {other:?} in {text:?}")),
    };
    n.checked_mul(mult)
        .filter(|b| i64::try_from(*b).is_ok())
        .ok_or_else(|| format!("{text:?} is too large"))
}

/// Parses `KEY=VALUE`.
pub fn parse_key_value(text: &str) -> Result<(String, String), String> {
    match text.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_string(), v.to_string())),
        _ => Err(format!("{text:?} is not KEY=VALUE")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory as _;

    #[test]
    fn the_command_line_is_consistent() {
        Cli::command().debug_assert();
    }

    fn create_args(args: &[&str]) -> VolumeCreateArgs {
        let cli = Cli::try_parse_from(
            ["moorctl", "volume", "create", "v", "--size", "1G"]
                .iter()
                .chain(args),
        )
        .unwrap();
        match cli.command {
            Command::Volume(VolumeCommand::Create(a)) => a,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn an_rbd_volume_is_named_by_backend_pool_and_cluster() {
        let a = create_args(&[
            "--backend",
            "rbd",
            "--pool",
            "kube",
            "--cluster-id",
            "east",
            "--param",
            "imageFeatures=layering",
        ]);
        let p = a.parameters().unwrap();
        assert_eq!(p["backend"], "rbd");
        assert_eq!(p["pool"], "kube");
        assert_eq!(p["clusterID"], "east");
        assert_eq!(p["imageFeatures"], "layering");
        assert!(!p.contains_key("monitors"));
        // A --param that says the same is fine; one that contradicts is refused.
        let same = create_args(&["--backend", "rbd", "--param", "backend=rbd"]);
        assert_eq!(same.parameters().unwrap().len(), 1);
        let e = create_args(&["--pool", "kube", "--param", "pool=other"])
            .parameters()
            .unwrap_err();
        assert!(e.contains("pool=other") && e.contains("pool=kube"), "{e}");
        // Without any, the controller's default backend.
        assert!(create_args(&[]).parameters().unwrap().is_empty());
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("1GiB"), Ok(1 << 30));
        assert_eq!(parse_size("512MiB"), Ok(512 << 20));
        assert_eq!(parse_size("2G"), Ok(2_000_000_000));
        assert_eq!(parse_size("4096"), Ok(4096));
        assert!(parse_size("1 parsec").is_err());
        assert!(parse_size("GiB").is_err());
        assert!(parse_size("99999999999TiB").is_err());
    }

    #[test]
    fn key_values() {
        assert_eq!(
            parse_key_value("devicePath=/dev/loop3"),
            Ok(("devicePath".into(), "/dev/loop3".into()))
        );
        assert_eq!(parse_key_value("k="), Ok(("k".into(), String::new())));
        assert!(parse_key_value("=v").is_err());
        assert!(parse_key_value("novalue").is_err());
    }

    #[test]
    fn endpoint_and_output_are_global() {
        let cli =
            Cli::try_parse_from(["moorctl", "volume", "list", "--output", "json"]).expect("parse");
        assert_eq!(cli.output, Output::Json);
        assert_eq!(cli.endpoint, "unix:///csi/csi.sock");
    }

    #[test]
    fn rotate_key_takes_its_keys_from_the_controller_or_from_the_command_line() {
        let parse = |args: &[&str]| {
            Cli::try_parse_from(["moorctl", "rotate-key", "vol-1"].iter().chain(args))
        };
        let Command::RotateKey(a) = parse(&["--controller", "unix:///c.sock"])
            .expect("parse")
            .command
        else {
            panic!("rotate-key");
        };
        assert_eq!(a.controller.as_deref(), Some("unix:///c.sock"));
        assert_eq!(a.old_dek, None);
        assert!(parse(&["--old-dek", "v1:k:x"]).is_ok());
        // One or the other: the controller's record, or the keys given here.
        assert!(parse(&[]).is_err());
        assert!(parse(&["--controller", "unix:///c.sock", "--old-dek", "v1:k:x"]).is_err());
        assert!(parse(&["--controller", "unix:///c.sock", "--new-dek", "v1:k:x"]).is_err());
        let cli = Cli::try_parse_from(["moorctl", "rotate-kek", "--new-secrets", "/k2.env"])
            .expect("parse");
        let Command::RotateKek(k) = cli.command else {
            panic!("rotate-kek");
        };
        assert_eq!(k.kms_id, "secret");
    }
}
