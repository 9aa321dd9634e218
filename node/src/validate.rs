//! Request validation for every Node RPC, in one place.
//!
//! Each function turns a CSI request into a typed request the engine can trust, or an
//! INVALID_ARGUMENT naming the field, before anything on the node is touched. Secrets never
//! appear in an error; the one secret read here is an encrypted volume's key-encryption key,
//! to unwrap its data key (`encryption`).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use csi::volume_capability::{AccessType, access_mode::Mode};
use moor_proto::csi::v1 as csi;
use moor_runtime::contract::{
    BACKING_FILE_FIELD, BACKING_FILE_KEY, DEVICE_PATH_FIELD, DEVICE_PATH_KEY, DEVICE_SERIAL_FIELD,
    DEVICE_SERIAL_KEY, DEVICE_WWN_FIELD, DEVICE_WWN_KEY, ENCRYPTED_DEK_FIELD, ENCRYPTED_DEK_KEY,
    ENCRYPTED_DEK_PENDING_FIELD, ENCRYPTED_DEK_PENDING_KEY, ENCRYPTED_FIELD, ENCRYPTED_KEY,
    Filesystem, KMS_ID_KEY, LUKS_CIPHER_KEY, LUKS_KEY_SIZE_KEY, LUKS_PBKDF_KEY,
    LUKS_SECTOR_SIZE_KEY, PUBLISHED_DEK_FIELD, QOS_LIMITS_FIELD, QOS_LIMITS_KEY, QosLimits,
    TPM2_PCRS_KEY, qos_from_context,
};
use moor_runtime::keys::kmip::KMIP_ENDPOINT_KEY;
use moor_runtime::keys::source::{KMS_IDS, KMS_KMIP, KMS_SECRET, KMS_TPM2, KeySource};
use moor_runtime::keys::tpm2::{self, NodeHalf, Tpm, Tpm2Tools};
use moor_runtime::keys::{KeyError, WrappedDek};
use moor_runtime::limits::{self, trunc};

use crate::engine::{
    Access, Capability, Encryption, Expand, ExpandKey, HealthQuery, Publish, Stage, Stats,
    Unpublish, Unstage,
};
use crate::error::{Error, Result};
use crate::mount_options;
use crate::sys::MountAttrs;
use crate::sys::discovery::DeviceIdentity;

/// Longest volume id (the spec's general limit for strings).
pub const MAX_ID_LEN: usize = limits::MAX_STRING_LEN;
/// Longest path (PATH_MAX).
pub const MAX_PATH_LEN: usize = 4096;
/// Most bytes in all keys and values of one map (the spec's 4 KiB for maps).
pub const MAX_MAP_BYTES: usize = limits::MAX_MAP_BYTES;
/// Most mount flags in one capability.
pub const MAX_MOUNT_FLAGS: usize = 64;
/// Longest serial number or WWN accepted.
pub const MAX_DEVICE_ID_LEN: usize = 256;
/// Filesystem used when the capability names none.
pub const DEFAULT_FS: Filesystem = Filesystem::Ext4;

/// Checks a volume id.
pub fn volume_id(field: &'static str, id: &str) -> Result<String> {
    match limits::id_problem(id, MAX_ID_LEN) {
        Some(reason) => Err(Error::invalid(field, reason)),
        None => Ok(id.to_string()),
    }
}

/// Checks that `raw` is an absolute, clean path strictly below `root`.
pub fn path_under(field: &'static str, raw: &str, root: &Path) -> Result<PathBuf> {
    let path = clean_absolute(field, raw)?;
    if !path.starts_with(root) || path == root {
        return Err(Error::invalid(
            field,
            format!("must lie under {}", root.display()),
        ));
    }
    Ok(path)
}

/// Checks that `raw` is an absolute path with no empty, `.` or `..` components.
pub fn clean_absolute(field: &'static str, raw: &str) -> Result<PathBuf> {
    path_string(field, raw)?;
    let Some(rest) = raw.strip_prefix('/') else {
        return Err(Error::invalid(field, "must be an absolute path"));
    };
    for part in rest.split('/') {
        if part.is_empty() || part == "." || part == ".." {
            return Err(Error::invalid(
                field,
                "must be a clean path (no empty, '.' or '..' components)",
            ));
        }
    }
    Ok(PathBuf::from(raw))
}

/// Checks that `raw` is set and could be a path at all: not longer than PATH_MAX, no NUL.
fn path_string(field: &'static str, raw: &str) -> Result<()> {
    if raw.is_empty() {
        return Err(Error::invalid(field, "must be set"));
    }
    if raw.len() > MAX_PATH_LEN {
        return Err(Error::invalid(
            field,
            format!("longer than {MAX_PATH_LEN} bytes"),
        ));
    }
    if raw.contains('\0') {
        return Err(Error::invalid(field, "contains a NUL byte"));
    }
    Ok(())
}

/// Checks NodeGetVolumeStats' and NodeExpandVolume's volume_path, which names where the volume
/// is staged or published. A missing or malformed string is INVALID_ARGUMENT; a path that
/// moor can never have staged or published a volume at (relative, not clean, not below the
/// kubelet dir) is the spec's "volume does not exist on volume_path": NOT_FOUND, decided
/// without touching the path.
fn volume_path(volume_id: &str, raw: &str, kubelet_dir: &Path) -> Result<PathBuf> {
    path_string("volume_path", raw)?;
    path_under("volume_path", raw, kubelet_dir).map_err(|e| match e {
        Error::InvalidArgument { reason, .. } => Error::VolumeNotFound {
            volume: volume_id.to_string(),
            reason: format!(
                "volume_path {:?} is not a path a volume can be staged or published at ({reason})",
                trunc(raw)
            ),
        },
        e => e,
    })
}

/// Checks a map's total size; its contents are never quoted (it may hold secrets).
fn map_size(field: &'static str, map: &HashMap<String, String>) -> Result<()> {
    match limits::map_problem(map) {
        Some(reason) => Err(Error::invalid(field, reason)),
        None => Ok(()),
    }
}

/// Checks a volume capability.
pub fn capability(cap: Option<&csi::VolumeCapability>) -> Result<Capability> {
    let cap = cap.ok_or_else(|| Error::invalid("volume_capability", "must be set"))?;
    let mode_raw = cap
        .access_mode
        .as_ref()
        .ok_or_else(|| Error::invalid("volume_capability.access_mode", "must be set"))?
        .mode;
    let mode = Mode::try_from(mode_raw)
        .ok()
        .filter(|m| *m != Mode::Unknown)
        .ok_or_else(|| {
            Error::invalid(
                "volume_capability.access_mode.mode",
                format!("unknown mode {mode_raw}"),
            )
        })?;
    let access = match &cap.access_type {
        None => {
            return Err(Error::invalid(
                "volume_capability.access_type",
                "must be set",
            ));
        }
        Some(AccessType::Block(_)) => Access::Block {
            attrs: MountAttrs::default(),
        },
        Some(AccessType::Mount(m)) => {
            let fs = if m.fs_type.is_empty() {
                DEFAULT_FS
            } else {
                Filesystem::from_name(&m.fs_type).ok_or_else(|| {
                    Error::invalid(
                        "volume_capability.mount.fs_type",
                        format!(
                            "{:?} is not supported (ext2, ext3, ext4, xfs, btrfs)",
                            trunc(&m.fs_type)
                        ),
                    )
                })?
            };
            if m.mount_flags.len() > MAX_MOUNT_FLAGS
                || m.mount_flags.iter().map(String::len).sum::<usize>() > MAX_MAP_BYTES
            {
                return Err(Error::invalid(
                    "volume_capability.mount.mount_flags",
                    "too many or too long",
                ));
            }
            let options = mount_options::parse(&m.mount_flags, fs)?;
            let group = if m.volume_mount_group.is_empty() {
                None
            } else {
                Some(m.volume_mount_group.parse::<u32>().map_err(|_| {
                    Error::invalid(
                        "volume_capability.mount.volume_mount_group",
                        format!(
                            "{:?} is not a numeric group id",
                            trunc(&m.volume_mount_group)
                        ),
                    )
                })?)
            };
            Access::Mount { fs, options, group }
        }
    };
    if !access.is_block()
        && matches!(
            mode,
            Mode::MultiNodeMultiWriter | Mode::MultiNodeSingleWriter
        )
    {
        return Err(Error::FailedPrecondition(format!(
            "access mode {} is not supported for a filesystem volume: ext4, xfs and btrfs are not \
             cluster filesystems",
            mode.as_str_name()
        )));
    }
    Ok(Capability { access, mode })
}

/// Validates NodeStageVolume but for its device: what must hold before the controller on the
/// node is asked to attach the volume (see [`crate::local_controller`]).
pub fn stage_but_device(
    req: &csi::NodeStageVolumeRequest,
    kubelet_dir: &Path,
) -> Result<(String, PathBuf, Capability)> {
    let volume_id = volume_id("volume_id", &req.volume_id)?;
    let staging = path_under("staging_target_path", &req.staging_target_path, kubelet_dir)?;
    let cap = capability(req.volume_capability.as_ref())?;
    map_size("publish_context", &req.publish_context)?;
    map_size("volume_context", &req.volume_context)?;
    map_size("secrets", &req.secrets)?;
    encrypted_context(&req.volume_context, &req.publish_context)?;
    Ok((volume_id, staging, cap))
}

/// What an encrypted volume's context says of how to open it (docs/encryption.md), checked;
/// `None` for a volume that is not encrypted (`encrypted` absent or `"false"`).
struct EncryptedContext<'a> {
    /// The key source, one of `KMS_IDS`.
    kms: &'a str,
    /// The wrapped data keys that may open it, in the order they are tried: the
    /// publish_context's current and pending keys (the controller's record, which a rotation
    /// changes), then the volume context's (the key the volume was made with). Never empty.
    wrapped: Vec<WrappedDek>,
    cipher: &'a str,
    key_size: u32,
    sector_size: u32,
    pbkdf: &'a str,
    /// The PCRs a `tpm2` volume's node half is sealed to, checked, if any.
    tpm2_pcrs: Option<String>,
}

/// The volume context's encryption keys, checked: `encrypted` `"true"` or `"false"`, and for
/// an encrypted volume the key source `secret`, its wrapped data key and the LUKS parameters,
/// each a plain word (they reach cryptsetup's command line, as arguments of their own).
fn encrypted_context<'a>(
    ctx: &'a HashMap<String, String>,
    published: &HashMap<String, String>,
) -> Result<Option<EncryptedContext<'a>>> {
    match ctx.get(ENCRYPTED_KEY).map(String::as_str) {
        None | Some("false") => return Ok(None),
        Some("true") => {}
        Some(other) => {
            return Err(Error::invalid(
                ENCRYPTED_FIELD,
                format!("{:?}: either \"true\" or \"false\"", trunc(other)),
            ));
        }
    }
    let word = |key: &'static str| -> Result<&str> {
        let v = ctx.get(key).map(String::as_str).unwrap_or_default();
        let plain = !v.is_empty()
            && v.len() <= 64
            && !v.starts_with('-')
            && v.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b',' || b == b'-');
        if plain {
            Ok(v)
        } else {
            Err(Error::invalid(
                "volume_context",
                format!(
                    "{key}={:?}: required for an encrypted volume, a plain word",
                    trunc(v)
                ),
            ))
        }
    };
    let number = |key: &'static str| -> Result<u32> {
        word(key)?.parse().map_err(|_| {
            Error::invalid(
                "volume_context",
                format!("{key}: required for an encrypted volume, a number"),
            )
        })
    };
    let kms = word(KMS_ID_KEY)?;
    if !KMS_IDS.contains(&kms) {
        return Err(Error::invalid(
            "volume_context",
            format!(
                "{KMS_ID_KEY}={:?}: this moor-node knows the key sources {KMS_IDS:?}",
                trunc(kms)
            ),
        ));
    }
    let decode = |field: &'static str, t: &String| {
        WrappedDek::decode(t).map_err(|e| Error::invalid(field, e.to_string()))
    };
    let given = ctx
        .get(ENCRYPTED_DEK_KEY)
        .ok_or_else(|| Error::invalid(ENCRYPTED_DEK_FIELD, "required for an encrypted volume"))
        .and_then(|t| decode(ENCRYPTED_DEK_FIELD, t))?;
    let mut wrapped = Vec::new();
    for (key, field) in [
        (ENCRYPTED_DEK_KEY, PUBLISHED_DEK_FIELD),
        (ENCRYPTED_DEK_PENDING_KEY, ENCRYPTED_DEK_PENDING_FIELD),
    ] {
        if let Some(t) = published.get(key) {
            wrapped.push(decode(field, t)?);
        }
    }
    wrapped.push(given);
    wrapped.dedup_by(|a, b| a.encode() == b.encode());
    let tpm2_pcrs = match ctx.get(TPM2_PCRS_KEY) {
        None => None,
        Some(_) if kms != KMS_TPM2 => {
            return Err(Error::invalid(
                "volume_context",
                format!("{TPM2_PCRS_KEY}: only for a volume of the {KMS_TPM2:?} key source"),
            ));
        }
        Some(v) => Some(
            tpm2::pcr_selection(v).map_err(|e| Error::invalid("volume_context", e.to_string()))?,
        ),
    };
    Ok(Some(EncryptedContext {
        kms,
        tpm2_pcrs,
        wrapped,
        cipher: word(LUKS_CIPHER_KEY)?,
        key_size: number(LUKS_KEY_SIZE_KEY)?,
        sector_size: number(LUKS_SECTOR_SIZE_KEY)?,
        pbkdf: word(LUKS_PBKDF_KEY)?,
    }))
}

/// Which CSI secret configures the key source, for errors.
#[derive(Debug, Clone, Copy)]
enum KeyCall {
    /// NodeStageVolume: opens (and makes the node's TPM key at the first `tpm2` stage).
    Stage,
    /// NodeExpandVolume: resizes (never makes a TPM key: a node without one never opened the
    /// volume).
    Expand,
}

impl KeyCall {
    fn secret(self) -> &'static str {
        match self {
            Self::Stage => "node-stage secret (csi.storage.k8s.io/node-stage-secret-name)",
            Self::Expand => "node-expand secret (csi.storage.k8s.io/node-expand-secret-name)",
        }
    }

    fn nothing(self) -> &'static str {
        match self {
            Self::Stage => "nothing was opened",
            Self::Expand => "nothing was resized",
        }
    }
}

/// What [`data_key`] got: which wrapped key unwrapped (its index), the passphrase, the source,
/// and for `tpm2` the node half it was combined with (for the stage's other keys).
struct DataKey {
    chosen: usize,
    dek: moor_runtime::keys::Dek,
    source: KeySource,
    half: Option<NodeHalf>,
}

/// An encrypted volume's key: the first of the data keys `wrapped` that the key source `kms`
/// names unwraps (its index returned), configured by `secrets`; for `tpm2`, combined with
/// this node's TPM half (`tpm`).
/// The one way both stage and expand get it, with the same codes. A secret without a field
/// the source needs, or a malformed one: INVALID_ARGUMENT naming the secrets key (a required
/// field of the request is missing). A key server or TPM that cannot be reached (or hangs
/// past its deadline): UNAVAILABLE. A well-formed key that does not unwrap the volume's data
/// key (another KEK, a wrapped key of another volume, a damaged one, a key server's refusal,
/// a node without its TPM key): FAILED_PRECONDITION, naming the key's id, never a byte.
fn data_key(
    (volume_id, kms, wrapped): (&str, &str, &[WrappedDek]),
    pcrs: Option<&str>,
    secrets: &HashMap<String, String>,
    tpm: &dyn Tpm,
    call: KeyCall,
) -> Result<DataKey> {
    let source =
        KeySource::from_secrets(kms, |k| secrets.get(k).map(String::as_str)).map_err(|e| {
            Error::invalid(
                "secrets",
                format!(
                    "{e}: an encrypted volume's {} configures its key source {kms:?}",
                    call.secret()
                ),
            )
        })?;
    let refused = |e: KeyError| match e {
        KeyError::Unavailable(m) => Error::Unavailable(format!("{m}; {}", call.nothing())),
        e => Error::FailedPrecondition(format!("{e}; {}", call.nothing())),
    };
    // The first key the source unwraps is the one the open tries first; the others are tried
    // after it (a rotation's other key, the volume context's when the record's is under
    // another key-encryption key). None unwraps: the first one's refusal.
    let mut first_refusal = None;
    let mut unwrapped = None;
    for (i, w) in wrapped.iter().enumerate() {
        match source.unwrap(w, volume_id) {
            Ok(dek) => {
                unwrapped = Some((i, dek));
                break;
            }
            Err(e @ KeyError::Unavailable(_)) => return Err(refused(e)),
            Err(e) => {
                first_refusal.get_or_insert(e);
            }
        }
    }
    let Some((chosen, mut dek)) = unwrapped else {
        return Err(refused(first_refusal.unwrap_or_else(|| {
            KeyError::Damaged("no wrapped data key".into())
        })));
    };
    let mut half = None;
    if kms == KMS_TPM2 {
        // The node's half: this node's TPM (its key made at the first stage), its key sealed
        // to the volume's PCRs when it names some.
        if matches!(call, KeyCall::Stage) {
            let sealed = pcrs
                .map(|p| tpm.sealed_to(p))
                .transpose()
                .map_err(refused)?;
            sealed
                .as_deref()
                .unwrap_or(tpm)
                .ensure_key()
                .map_err(refused)?;
        }
        let node = NodeHalf::of(tpm, pcrs, volume_id).map_err(refused)?;
        dek = node.combine(&dek).map_err(refused)?;
        half = Some(node);
    }
    Ok(DataKey {
        chosen,
        dek,
        source,
        half,
    })
}

/// An encrypted volume's data key, as [`data_key`] gets it with the stage secrets (the
/// StorageClass's node-stage secret), and how to open the volume.
fn encryption(
    volume_id: &str,
    ctx: EncryptedContext<'_>,
    secrets: &HashMap<String, String>,
    tpm: &dyn Tpm,
) -> Result<Encryption> {
    let DataKey {
        chosen,
        dek,
        source,
        half,
    } = data_key(
        (volume_id, ctx.kms, &ctx.wrapped),
        ctx.tpm2_pcrs.as_deref(),
        secrets,
        tpm,
        KeyCall::Stage,
    )?;
    let mut others = ctx.wrapped;
    let wrapped = others.remove(chosen);
    Ok(Encryption {
        key: std::sync::Arc::new(dek),
        wrapped,
        others,
        kek_id: source.kek_id().to_owned(),
        kek: std::sync::Arc::new(source),
        cipher: ctx.cipher.to_owned(),
        key_size: ctx.key_size,
        sector_size: ctx.sector_size,
        pbkdf: ctx.pbkdf.to_owned(),
        kms_id: ctx.kms.to_owned(),
        tpm2_pcrs: ctx.tpm2_pcrs,
        node_half: half.map(std::sync::Arc::new),
    })
}

/// NodeExpandVolume of an encrypted volume: the key of its mapping (`crypt`, the journal's
/// record), got as its stage got it ([`data_key`]) with the request's secrets (the
/// StorageClass's node-expand secret), from the wrapped data key the journal keeps, by the
/// key source the journal names. A record from before the source was kept: a KMIP server's
/// when the secrets name one, else a Secret's KEK. It asks a key server or the TPM, and so
/// blocks, for `kmip` and `tpm2`.
pub fn expand_key(
    volume_id: &str,
    crypt: &crate::journal::CryptRecord,
    secrets: &HashMap<String, String>,
    tpm: &dyn Tpm,
) -> Result<ExpandKey> {
    let text = crypt.wrapped_dek.as_deref().ok_or_else(|| {
        Error::FailedPrecondition(format!(
            "volume {volume_id:?}: the journal has no wrapped data key of its mapping; stage \
             it again to record one; nothing was resized"
        ))
    })?;
    let wrapped = WrappedDek::decode(text)
        .map_err(|e| Error::FailedPrecondition(format!("volume {volume_id:?}: {e}")))?;
    let kms = crypt.kms_id.as_deref().unwrap_or_else(|| {
        if secrets.contains_key(KMIP_ENDPOINT_KEY) {
            KMS_KMIP
        } else {
            KMS_SECRET
        }
    });
    let DataKey { dek, source, .. } = data_key(
        (volume_id, kms, std::slice::from_ref(&wrapped)),
        crypt.tpm2_pcrs.as_deref(),
        secrets,
        tpm,
        KeyCall::Expand,
    )?;
    Ok(ExpandKey {
        key: std::sync::Arc::new(dek),
        wrapped: text.to_owned(),
        kek_id: source.kek_id().to_owned(),
    })
}

/// Whether NodeExpandVolume of a volume with this mapping record asks a key server or the
/// node's TPM for its key (and so blocks).
#[must_use]
pub fn expand_asks_a_key_source(
    crypt: &crate::journal::CryptRecord,
    secrets: &HashMap<String, String>,
) -> bool {
    crypt.kms_id.as_deref().map_or_else(
        || secrets.contains_key(KMIP_ENDPOINT_KEY),
        |k| k != KMS_SECRET,
    )
}

/// Whether the stage of a volume with this context asks a key server or the node's TPM for
/// its key (an encrypted volume of the `kmip` or `tpm2` source): it blocks while it does.
#[must_use]
pub fn asks_a_key_source(ctx: &HashMap<String, String>) -> bool {
    ctx.get(ENCRYPTED_KEY).is_some_and(|v| v == "true")
        && ctx
            .get(KMS_ID_KEY)
            .is_some_and(|k| k != moor_runtime::keys::source::KMS_SECRET)
}

/// Validates NodeStageVolume (an encrypted volume's TPM half, for `tpm2`, from this node's
/// TPM as moor-node finds it: [`Tpm2Tools::from_env`]).
pub fn stage(req: &csi::NodeStageVolumeRequest, kubelet_dir: &Path) -> Result<Stage> {
    stage_with_tpm(req, kubelet_dir, &Tpm2Tools::from_env())
}

/// Validates NodeStageVolume, an encrypted `tpm2` volume's node half from `tpm`.
pub fn stage_with_tpm(
    req: &csi::NodeStageVolumeRequest,
    kubelet_dir: &Path,
    tpm: &dyn Tpm,
) -> Result<Stage> {
    let (volume_id, staging, cap) = stage_but_device(req, kubelet_dir)?;
    let (device, identity) = device_identity(&req.publish_context, kubelet_dir)?;
    let encryption = encrypted_context(&req.volume_context, &req.publish_context)?
        .map(|ctx| encryption(&volume_id, ctx, &req.secrets, tpm))
        .transpose()?;
    Ok(Stage {
        volume_id,
        device,
        identity,
        staging,
        cap,
        encryption,
    })
}

/// A serial number or WWN from publish_context (surrounding blanks dropped).
fn device_id(field: &'static str, raw: &str) -> Result<String> {
    let v = raw.trim();
    match limits::id_problem(v, MAX_DEVICE_ID_LEN) {
        Some(reason) => Err(Error::invalid(field, reason)),
        None => Ok(v.to_string()),
    }
}

/// The device hint and identity NodeStageVolume's publish_context gives: at least one of them.
fn device_identity(
    ctx: &HashMap<String, String>,
    kubelet_dir: &Path,
) -> Result<(Option<PathBuf>, DeviceIdentity)> {
    let device = match ctx.get(DEVICE_PATH_KEY) {
        Some(raw) => {
            let device = clean_absolute(DEVICE_PATH_FIELD, raw)?;
            if !device.starts_with("/dev") || device.starts_with(kubelet_dir) {
                return Err(Error::invalid(
                    DEVICE_PATH_FIELD,
                    "must name a device under /dev",
                ));
            }
            Some(device)
        }
        None => None,
    };
    let identity = DeviceIdentity {
        backing_file: ctx
            .get(BACKING_FILE_KEY)
            .map(|raw| clean_absolute(BACKING_FILE_FIELD, raw))
            .transpose()?,
        serial: ctx
            .get(DEVICE_SERIAL_KEY)
            .map(|raw| device_id(DEVICE_SERIAL_FIELD, raw))
            .transpose()?,
        wwn: ctx
            .get(DEVICE_WWN_KEY)
            .map(|raw| device_id(DEVICE_WWN_FIELD, raw))
            .transpose()?,
    };
    // An RBD image's device is the one this node maps for it (`attach`).
    if device.is_none() && identity.is_empty() && !crate::attach::request::is_rbd(ctx) {
        return Err(Error::invalid(
            "publish_context",
            format!(
                "must name the device: {DEVICE_PATH_KEY:?}, or its identity \
                 ({BACKING_FILE_KEY:?}, {DEVICE_SERIAL_KEY:?} or {DEVICE_WWN_KEY:?})"
            ),
        ));
    }
    Ok((device, identity))
}

/// Validates NodeUnstageVolume.
pub fn unstage(req: &csi::NodeUnstageVolumeRequest, kubelet_dir: &Path) -> Result<Unstage> {
    Ok(Unstage {
        volume_id: volume_id("volume_id", &req.volume_id)?,
        staging: path_under("staging_target_path", &req.staging_target_path, kubelet_dir)?,
    })
}

/// Validates NodePublishVolume.
pub fn publish(req: &csi::NodePublishVolumeRequest, kubelet_dir: &Path) -> Result<Publish> {
    let volume_id = volume_id("volume_id", &req.volume_id)?;
    let target = path_under("target_path", &req.target_path, kubelet_dir)?;
    let cap = capability(req.volume_capability.as_ref())?;
    map_size("publish_context", &req.publish_context)?;
    map_size("volume_context", &req.volume_context)?;
    map_size("secrets", &req.secrets)?;
    if req.staging_target_path.is_empty() {
        // moor advertises STAGE_UNSTAGE_VOLUME: the spec's row "staging target path not set".
        return Err(Error::FailedPrecondition(
            "staging_target_path must be set: moor stages volumes before publishing them".into(),
        ));
    }
    let staging = path_under("staging_target_path", &req.staging_target_path, kubelet_dir)?;
    if staging == target || target.starts_with(&staging) || staging.starts_with(&target) {
        return Err(Error::invalid(
            "target_path",
            "must not overlap staging_target_path",
        ));
    }
    Ok(Publish {
        volume_id,
        staging,
        target,
        cap,
        readonly: req.readonly,
        pod_uid: pod_uid(&req.volume_context),
        limits: qos_limits(req)?,
    })
}

/// The volume_context key kubelet gives the pod's UID in (with `podInfoOnMount`).
pub const POD_UID_KEY: &str = "csi.storage.k8s.io/pod.uid";

/// The pod's UID kubelet gives, when it can be one (else the engine takes the target path's).
fn pod_uid(context: &HashMap<String, String>) -> Option<String> {
    context
        .get(POD_UID_KEY)
        .filter(|u| crate::engine::is_pod_uid(u))
        .cloned()
}

/// The volume's QoS limits: those of the controller's publish (of the moment), else those of
/// the volume's creation; none when neither says.
fn qos_limits(req: &csi::NodePublishVolumeRequest) -> Result<QosLimits> {
    let (field, text) = match (
        req.publish_context.get(QOS_LIMITS_KEY),
        req.volume_context.get(QOS_LIMITS_KEY),
    ) {
        (Some(t), _) => (QOS_LIMITS_FIELD, t),
        (None, Some(t)) => ("volume_context.qosLimits", t),
        (None, None) => return Ok([None; 4]),
    };
    qos_from_context(text).map_err(|why| Error::invalid(field, why))
}

/// Validates NodeUnpublishVolume.
pub fn unpublish(req: &csi::NodeUnpublishVolumeRequest, kubelet_dir: &Path) -> Result<Unpublish> {
    Ok(Unpublish {
        volume_id: volume_id("volume_id", &req.volume_id)?,
        target: path_under("target_path", &req.target_path, kubelet_dir)?,
    })
}

/// Validates NodeGetVolumeStats.
pub fn stats(req: &csi::NodeGetVolumeStatsRequest, kubelet_dir: &Path) -> Result<Stats> {
    let volume_id = volume_id("volume_id", &req.volume_id)?;
    let path = volume_path(&volume_id, &req.volume_path, kubelet_dir)?;
    Ok(Stats { volume_id, path })
}

/// Validates NodeGetVolumeHealth: a volume id, and each path given below the kubelet dir.
pub fn volume_health(
    req: &csi::NodeGetVolumeHealthRequest,
    kubelet_dir: &Path,
) -> Result<HealthQuery> {
    let volume_id = volume_id("volume_id", &req.volume_id)?;
    let mut paths = Vec::new();
    for (field, raw) in [
        ("staging_target_path", &req.staging_target_path),
        ("volume_publish_path", &req.volume_publish_path),
    ] {
        if !raw.is_empty() {
            paths.push(path_under(field, raw, kubelet_dir)?);
        }
    }
    Ok(HealthQuery { volume_id, paths })
}

/// Validates NodeExpandVolume.
pub fn expand(req: &csi::NodeExpandVolumeRequest, kubelet_dir: &Path) -> Result<Expand> {
    let volume_id = volume_id("volume_id", &req.volume_id)?;
    path_string("volume_path", &req.volume_path)?;
    map_size("secrets", &req.secrets)?;
    let staging = if req.staging_target_path.is_empty() {
        None
    } else {
        Some(path_under(
            "staging_target_path",
            &req.staging_target_path,
            kubelet_dir,
        )?)
    };
    let (required_bytes, limit_bytes) = match &req.capacity_range {
        None => (0, 0),
        Some(r) => {
            let req_b = u64::try_from(r.required_bytes).map_err(|_| {
                Error::invalid("capacity_range.required_bytes", "must not be negative")
            })?;
            let lim_b = u64::try_from(r.limit_bytes).map_err(|_| {
                Error::invalid("capacity_range.limit_bytes", "must not be negative")
            })?;
            if lim_b != 0 && req_b > lim_b {
                return Err(Error::invalid(
                    "capacity_range",
                    "required_bytes exceeds limit_bytes",
                ));
            }
            (req_b, lim_b)
        }
    };
    let cap = match req.volume_capability.as_ref() {
        None => None,
        Some(c) => Some(capability(Some(c))?),
    };
    // An encrypted volume's key (its mapping grows only with it) is got from the secrets by
    // `expand_key`, once the journal says the volume has a mapping and by which source.
    // Last: a malformed field is INVALID_ARGUMENT even when the volume is not there.
    let path = volume_path(&volume_id, &req.volume_path, kubelet_dir)?;
    Ok(Expand {
        volume_id,
        path,
        key: None,
        staging,
        required_bytes,
        limit_bytes,
        cap,
    })
}
