//! What the validator knows beyond the v1.24 OpenAPI documents: value sets Kubernetes
//! enforces that the documents give only in prose, and fields of later releases the manifests
//! use.

/// Value sets that Kubernetes enforces but the v1.24 documents give only in prose:
/// `(schema, property, allowed values)`. For an array property, each item must be allowed.
pub const EXTRA_ENUMS: &[(&str, &str, &[&str])] = &[
    (
        "io.k8s.api.core.v1.VolumeMount",
        "mountPropagation",
        &["None", "HostToContainer", "Bidirectional"],
    ),
    (
        "io.k8s.api.core.v1.HostPathVolumeSource",
        "type",
        &[
            "",
            "DirectoryOrCreate",
            "Directory",
            "FileOrCreate",
            "File",
            "Socket",
            "CharDevice",
            "BlockDevice",
        ],
    ),
    (
        "io.k8s.api.core.v1.Container",
        "terminationMessagePolicy",
        &["File", "FallbackToLogsOnError"],
    ),
    (
        "io.k8s.api.core.v1.PodSpec",
        "restartPolicy",
        &["Always", "OnFailure", "Never"],
    ),
    (
        "io.k8s.api.core.v1.Toleration",
        "operator",
        &["Exists", "Equal"],
    ),
    (
        "io.k8s.api.apps.v1.DaemonSetUpdateStrategy",
        "type",
        &["RollingUpdate", "OnDelete"],
    ),
    (
        "io.k8s.api.apps.v1.DeploymentStrategy",
        "type",
        &["Recreate", "RollingUpdate"],
    ),
    (
        "io.k8s.api.storage.v1.CSIDriverSpec",
        "fsGroupPolicy",
        &["None", "File", "ReadWriteOnceWithFSType"],
    ),
    (
        "io.k8s.api.storage.v1.CSIDriverSpec",
        "volumeLifecycleModes",
        &["Persistent", "Ephemeral"],
    ),
    (
        "io.k8s.api.storage.v1.StorageClass",
        "volumeBindingMode",
        &["Immediate", "WaitForFirstConsumer"],
    ),
    (
        "io.k8s.api.storage.v1.StorageClass",
        "reclaimPolicy",
        &["Delete", "Retain"],
    ),
    (
        "io.k8s.api.rbac.v1.Subject",
        "kind",
        &["ServiceAccount", "User", "Group"],
    ),
    (
        "io.k8s.api.rbac.v1.RoleRef",
        "kind",
        &["Role", "ClusterRole"],
    ),
];

/// Fields Kubernetes added after the v1.24 documents that the manifests use, each with the
/// release that added it: `(schema, property, release, property type)`. [`Schemas::add_field`](super::Schemas::add_field)
/// puts them in; anything else newer stays an unknown field.
pub const LATER_FIELDS: &[(&str, &str, &str, &str)] = &[
    (
        "io.k8s.api.storage.v1.CSIDriverSpec",
        "seLinuxMount",
        "v1.25",
        "boolean",
    ),
    (
        "io.k8s.api.storage.v1.CSIDriverSpec",
        "nodeAllocatableUpdatePeriodSeconds",
        "v1.33",
        "integer",
    ),
];
