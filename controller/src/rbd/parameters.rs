//! The RBD backend's StorageClass parameters, and the capabilities it serves.
//!
//! ```yaml
//! parameters:
//!   backend: rbd                      # moor's key choosing this backend
//!   clusterID: prod                   # a cluster of the controller's list, or:
//!   # monitors: 10.0.0.1:6789,10.0.0.2:6789
//!   pool: kubernetes
//!   imageFeatures: layering,exclusive-lock   # optional (this is the default)
//!   dataPool: ec-data                 # optional: an erasure-coded pool for the data
//!   exclusiveLock: "true"             # optional: nodes map with the lock held (below)
//!   csi.storage.k8s.io/fstype: ext4   # optional, as for the embedded backend
//! ```
//!
//! Parameters are normalized (aliases folded, features in librbd's order) so that a later
//! request with the same StorageClass compares equal. Keys with the prefix
//! `csi.storage.k8s.io/` are the CO's (secret names, PVC name) and ignored; `imageFormat: "2"`
//! is accepted for StorageClasses written for ceph-csi; anything else is INVALID_ARGUMENT.

use moor_rbd::Features;

use super::clusters::Clusters;
use super::ids::{ClusterRef, Location, check_fits, cluster_id_ok, normalize_monitors, pool_ok};
use crate::backend::{AccessMode, Capability, Parameters};
use crate::embedded::{self, FS_TYPE_KEY, K8S_FS_TYPE_KEY, K8S_PREFIX};
use crate::error::{Error, Result, trunc};

/// The parameter that chooses the backend.
pub const BACKEND_KEY: &str = "backend";
/// Its value for this backend.
pub const BACKEND_NAME: &str = "rbd";
/// A cluster of the controller's cluster list.
pub const CLUSTER_ID_KEY: &str = "clusterID";
/// Monitor addresses, comma-separated (instead of a clusterID).
pub const MONITORS_KEY: &str = "monitors";
/// The pool the images are made in.
pub const POOL_KEY: &str = "pool";
/// RBD image features, comma-separated.
pub const IMAGE_FEATURES_KEY: &str = "imageFeatures";
/// A pool for the images' data.
pub const DATA_POOL_KEY: &str = "dataPool";
/// "true": the kernel client maps the image with its exclusive lock held and never hands it
/// over, so no other client can write while a node has it mapped (a second writer gets
/// EROFS), at a price: the image cannot grow while it is mapped (librbd's resize needs the
/// lock), so such volumes expand offline. Default: the lock is handed over on request, as
/// librbd and ceph-csi do, and volumes grow online.
pub const EXCLUSIVE_LOCK_KEY: &str = "exclusiveLock";
/// ceph-csi's image format key: only "2" is taken (and dropped).
pub const IMAGE_FORMAT_KEY: &str = "imageFormat";
/// The volume context key naming the image.
pub const IMAGE_NAME_KEY: &str = "imageName";

/// Features an image may be made with: what moor's attachers can open (rbd-fuse opens any;
/// the kernel client of any maintained kernel opens these).
const ALLOWED_FEATURES: &str = "layering,exclusive-lock,object-map,fast-diff,deep-flatten";

/// Features from the parameter, checked: layering (snapshots restore by cloning), and each
/// feature's own dependencies.
fn parse_features(text: &str) -> Result<Features> {
    let bad = |why: String| Error::invalid("parameters", format!("{IMAGE_FEATURES_KEY}: {why}"));
    let features = Features::from_names(text)
        .ok_or_else(|| bad(format!("{:?} names an unknown feature", trunc(text))))?;
    let allowed = Features::from_names(ALLOWED_FEATURES).unwrap_or(Features::NONE);
    if !allowed.contains(features) {
        return Err(bad(format!(
            "moor makes images with {ALLOWED_FEATURES} only, not {features}"
        )));
    }
    if !features.contains(Features::LAYERING) {
        return Err(bad(
            "layering is required: snapshots and clones are RBD clones".into(),
        ));
    }
    if features.contains(Features::OBJECT_MAP) && !features.contains(Features::EXCLUSIVE_LOCK) {
        return Err(bad("object-map needs exclusive-lock".into()));
    }
    if features.contains(Features::FAST_DIFF) && !features.contains(Features::OBJECT_MAP) {
        return Err(bad("fast-diff needs object-map".into()));
    }
    Ok(features)
}

/// The features of normalized parameters.
pub fn features_of(params: &Parameters) -> Features {
    params
        .get(IMAGE_FEATURES_KEY)
        .and_then(|t| Features::from_names(t))
        .unwrap_or(Features::MOOR_DEFAULT)
}

/// The cluster and pool of normalized parameters.
pub fn location_of(params: &Parameters) -> Option<Location> {
    let cluster = match (params.get(CLUSTER_ID_KEY), params.get(MONITORS_KEY)) {
        (Some(id), None) => ClusterRef::Id(id.clone()),
        (None, Some(m)) => ClusterRef::Monitors(m.clone()),
        _ => return None,
    };
    Some(Location {
        cluster,
        pool: params.get(POOL_KEY)?.clone(),
    })
}

/// The cluster and pool of normalized parameters, which creating a volume needs (GetCapacity
/// without them has nothing to measure); INVALID_ARGUMENT naming what is missing.
pub fn require_location(params: &Parameters) -> Result<Location> {
    let invalid = |why: String| Error::invalid("parameters", why);
    if !params.contains_key(CLUSTER_ID_KEY) && !params.contains_key(MONITORS_KEY) {
        return Err(invalid(format!(
            "{CLUSTER_ID_KEY} or {MONITORS_KEY} is required: which Ceph cluster"
        )));
    }
    if !params.contains_key(POOL_KEY) {
        return Err(invalid(format!(
            "{POOL_KEY} is required: the pool images are made in"
        )));
    }
    location_of(params).ok_or_else(|| invalid("the cluster is named twice".into()))
}

/// Whether normalized parameters are this backend's.
pub fn is_rbd(params: &Parameters) -> bool {
    params.get(BACKEND_KEY).map(String::as_str) == Some(BACKEND_NAME)
}

/// Parses and normalizes the parameters (see the module's doc). A clusterID must name a
/// cluster of `clusters`. The cluster and the pool may be missing here (a GetCapacity without
/// parameters); creating a volume requires them ([`require_location`]).
pub fn parse_parameters(raw: &Parameters, clusters: &Clusters) -> Result<Parameters> {
    let invalid = |why: String| Error::invalid("parameters", why);
    let mut out = Parameters::from([(BACKEND_KEY.to_string(), BACKEND_NAME.to_string())]);
    let mut fs_keys = Parameters::new();
    for (key, value) in raw {
        match key.as_str() {
            BACKEND_KEY => {
                if value != BACKEND_NAME {
                    return Err(invalid(format!(
                        "{BACKEND_KEY}={:?} is not this backend",
                        trunc(value)
                    )));
                }
            }
            CLUSTER_ID_KEY => {
                if !cluster_id_ok(value) {
                    return Err(invalid(format!(
                        "{CLUSTER_ID_KEY}={:?}: 1 to 64 letters, digits, '.', '_' or '-'",
                        trunc(value)
                    )));
                }
                if clusters.get(value).is_none() {
                    return Err(invalid(format!(
                        "{CLUSTER_ID_KEY}={value:?} is not in the controller's cluster list \
                         (--rbd-clusters){}",
                        if clusters.is_empty() {
                            "; the controller has none"
                        } else {
                            ""
                        }
                    )));
                }
                out.insert(CLUSTER_ID_KEY.into(), value.clone());
            }
            MONITORS_KEY => {
                let m = normalize_monitors(value).ok_or_else(|| {
                    invalid(format!(
                        "{MONITORS_KEY}={:?}: a comma-separated list of monitor addresses",
                        trunc(value)
                    ))
                })?;
                out.insert(MONITORS_KEY.into(), m);
            }
            POOL_KEY | DATA_POOL_KEY => {
                if !pool_ok(value) {
                    return Err(invalid(format!(
                        "{key}={:?}: 1 to 63 letters, digits, '.', '_' or '-', not starting \
                         with '.'",
                        trunc(value)
                    )));
                }
                out.insert(key.clone(), value.clone());
            }
            IMAGE_FEATURES_KEY => {
                let f = parse_features(value)?;
                out.insert(IMAGE_FEATURES_KEY.into(), f.names().join(","));
            }
            EXCLUSIVE_LOCK_KEY => match value.as_str() {
                "true" => {
                    out.insert(EXCLUSIVE_LOCK_KEY.into(), "true".into());
                }
                "false" => {}
                other => {
                    return Err(invalid(format!(
                        "{EXCLUSIVE_LOCK_KEY}={:?}: \"true\" or \"false\"",
                        trunc(other)
                    )));
                }
            },
            IMAGE_FORMAT_KEY => {
                if value != "2" {
                    return Err(invalid(format!(
                        "{IMAGE_FORMAT_KEY}={:?}: only format 2 images are made",
                        trunc(value)
                    )));
                }
            }
            k if k == FS_TYPE_KEY || k.eq_ignore_ascii_case(K8S_FS_TYPE_KEY) => {
                fs_keys.insert(key.clone(), value.clone());
            }
            k if k.starts_with(K8S_PREFIX) => {}
            _ => {
                return Err(invalid(format!(
                    "unknown key {:?}: the rbd backend takes {BACKEND_KEY}, {CLUSTER_ID_KEY} or \
                     {MONITORS_KEY}, {POOL_KEY}, {IMAGE_FEATURES_KEY}, {DATA_POOL_KEY}, \
                     {EXCLUSIVE_LOCK_KEY}, {FS_TYPE_KEY} (and ignores {K8S_PREFIX}*)",
                    trunc(key)
                )));
            }
        }
    }
    // The filesystem keys, checked as the embedded backend checks them.
    out.extend(embedded::parse_parameters(&fs_keys)?);
    if out.contains_key(CLUSTER_ID_KEY) && out.contains_key(MONITORS_KEY) {
        return Err(invalid(format!(
            "give {CLUSTER_ID_KEY} or {MONITORS_KEY}, not both"
        )));
    }
    out.entry(IMAGE_FEATURES_KEY.into())
        .or_insert_with(|| Features::MOOR_DEFAULT.names().join(","));
    if out.contains_key(EXCLUSIVE_LOCK_KEY) && !features_of(&out).contains(Features::EXCLUSIVE_LOCK)
    {
        return Err(invalid(format!(
            "{EXCLUSIVE_LOCK_KEY}=true needs the exclusive-lock image feature"
        )));
    }
    if let Some(loc) = location_of(&out) {
        check_fits(&loc)?;
    }
    Ok(out)
}

/// Whether the RBD backend serves `cap` for a volume with `params`: one writer at a time
/// (single-node modes), or many readers (MULTI_NODE_READER_ONLY); block or a filesystem the
/// node makes, matching the volume's `fsType`.
pub fn check_capability(cap: &Capability, params: &Parameters) -> Result<(), String> {
    let mut as_single = cap.clone();
    match cap.mode {
        AccessMode::MultiNodeMultiWriter | AccessMode::MultiNodeSingleWriter => {
            return Err(format!(
                "access mode {} is not supported: an RBD image is written from one node at a \
                 time (MULTI_NODE_READER_ONLY is supported)",
                cap.mode.name()
            ));
        }
        // Checked for the filesystem as a single-node reader would be.
        AccessMode::MultiNodeReaderOnly => as_single.mode = AccessMode::SingleNodeReaderOnly,
        _ => {}
    }
    embedded::check_capability(&as_single, params)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::AccessType;

    fn clusters() -> Clusters {
        Clusters::from_json(r#"[{"clusterID": "prod", "monitors": ["10.0.0.1:6789"]}]"#).unwrap()
    }

    fn params(pairs: &[(&str, &str)]) -> Parameters {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn parameters_are_normalized() {
        let p = parse_parameters(
            &params(&[
                ("backend", "rbd"),
                ("clusterID", "prod"),
                ("pool", "kube"),
                ("imageFeatures", "exclusive-lock, layering"),
                ("imageFormat", "2"),
                ("csi.storage.k8s.io/fstype", "xfs"),
                ("csi.storage.k8s.io/provisioner-secret-name", "s"),
            ]),
            &clusters(),
        )
        .unwrap();
        assert_eq!(
            p,
            params(&[
                ("backend", "rbd"),
                ("clusterID", "prod"),
                ("pool", "kube"),
                ("imageFeatures", "layering,exclusive-lock"),
                ("fsType", "xfs"),
            ])
        );
        assert_eq!(location_of(&p).unwrap().pool, "kube");
        assert!(is_rbd(&p));
        let m = parse_parameters(
            &params(&[
                ("monitors", "10.0.0.1:6789, 10.0.0.2:6789"),
                ("pool", "kube"),
            ]),
            &clusters(),
        )
        .unwrap();
        assert_eq!(m["monitors"], "10.0.0.1:6789,10.0.0.2:6789");
        assert_eq!(m["imageFeatures"], "layering,exclusive-lock");
        assert_eq!(features_of(&m), Features::MOOR_DEFAULT);
    }

    #[test]
    fn exclusive_lock_is_kept_only_when_true_and_needs_its_feature() {
        let with = |v: &str, features: &str| {
            parse_parameters(
                &params(&[
                    ("pool", "kube"),
                    ("clusterID", "prod"),
                    ("exclusiveLock", v),
                    ("imageFeatures", features),
                ]),
                &clusters(),
            )
        };
        let on = with("true", "layering,exclusive-lock").unwrap();
        assert_eq!(on[EXCLUSIVE_LOCK_KEY], "true");
        let off = with("false", "layering,exclusive-lock").unwrap();
        assert!(!off.contains_key(EXCLUSIVE_LOCK_KEY), "{off:?}");
        for (v, f) in [("yes", "layering,exclusive-lock"), ("true", "layering")] {
            let e = with(v, f).unwrap_err();
            assert_eq!(e.code(), tonic::Code::InvalidArgument, "{v} {f}: {e}");
            assert!(e.to_string().contains(EXCLUSIVE_LOCK_KEY), "{e}");
        }
    }

    #[test]
    fn bad_parameters_are_invalid_naming_the_key() {
        let c = clusters();
        for (raw, want) in [
            (
                vec![("clusterID", "prod"), ("monitors", "m"), ("pool", "p")],
                "not both",
            ),
            (
                vec![("clusterID", "nope"), ("pool", "p")],
                "not in the controller",
            ),
            (vec![("clusterID", "prod"), ("pool", ".mgr")], "pool"),
            (
                vec![
                    ("clusterID", "prod"),
                    ("pool", "p"),
                    ("imageFeatures", "exclusive-lock"),
                ],
                "layering is required",
            ),
            (
                vec![
                    ("clusterID", "prod"),
                    ("pool", "p"),
                    ("imageFeatures", "layering,journaling"),
                ],
                "moor makes images with",
            ),
            (
                vec![
                    ("clusterID", "prod"),
                    ("pool", "p"),
                    ("imageFeatures", "layering,object-map"),
                ],
                "object-map needs exclusive-lock",
            ),
            (
                vec![("clusterID", "prod"), ("pool", "p"), ("mounter", "rbd-nbd")],
                "unknown key",
            ),
            (
                vec![("clusterID", "prod"), ("pool", "p"), ("imageFormat", "1")],
                "format 2",
            ),
            (
                vec![("clusterID", "prod"), ("pool", "p"), ("fsType", "zfs")],
                "fsType",
            ),
            (
                vec![
                    ("backend", "embedded"),
                    ("clusterID", "prod"),
                    ("pool", "p"),
                ],
                "not this backend",
            ),
        ] {
            let e = parse_parameters(&params(&raw), &c).unwrap_err();
            assert!(
                matches!(
                    e,
                    Error::InvalidArgument {
                        field: "parameters",
                        ..
                    }
                ),
                "{raw:?}: {e}"
            );
            assert!(e.to_string().contains(want), "{raw:?}: {e}");
        }
    }

    #[test]
    fn creating_needs_the_cluster_and_the_pool() {
        let c = clusters();
        let only_pool = parse_parameters(&params(&[("pool", "kube")]), &c).unwrap();
        let e = require_location(&only_pool).unwrap_err();
        assert!(
            e.to_string().contains("clusterID or monitors is required"),
            "{e}"
        );
        let only_cluster = parse_parameters(&params(&[("clusterID", "prod")]), &c).unwrap();
        let e = require_location(&only_cluster).unwrap_err();
        assert!(e.to_string().contains("pool is required"), "{e}");
        let none = parse_parameters(&Parameters::new(), &c).unwrap();
        assert!(is_rbd(&none) && location_of(&none).is_none());
        let both = parse_parameters(&params(&[("clusterID", "prod"), ("pool", "p")]), &c).unwrap();
        assert_eq!(require_location(&both).unwrap().pool, "p");
    }

    #[test]
    fn one_writer_or_many_readers() {
        let mount = |mode, fs: Option<&str>| Capability {
            access: AccessType::Mount {
                fs_type: fs.map(str::to_string),
            },
            mode,
        };
        let p = params(&[("fsType", "ext4")]);
        assert!(check_capability(&mount(AccessMode::SingleNodeWriter, None), &p).is_ok());
        assert!(
            check_capability(&mount(AccessMode::MultiNodeReaderOnly, Some("ext4")), &p).is_ok()
        );
        assert!(check_capability(&mount(AccessMode::MultiNodeMultiWriter, None), &p).is_err());
        assert!(check_capability(&mount(AccessMode::MultiNodeSingleWriter, None), &p).is_err());
        assert!(check_capability(&mount(AccessMode::SingleNodeWriter, Some("xfs")), &p).is_err());
        let block = Capability {
            access: AccessType::Block,
            mode: AccessMode::MultiNodeReaderOnly,
        };
        assert!(check_capability(&block, &p).is_ok());
    }
}
