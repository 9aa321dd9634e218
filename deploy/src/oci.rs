//! The OCI runtime configuration (the runtime-spec's `config.json`, for crun or runc) of one
//! container of a rendered workload, made from its pod spec the way a CRI runtime (containerd)
//! makes it: the command and args with `$(VAR)` expanded, the environment with `fieldRef`s
//! resolved, the default mounts (`/proc`, `/dev`, `/sys`, ...) less those a volume mount
//! replaces, each volume mount as a recursive bind with its propagation, the namespaces of
//! the pod's network, and a privileged container's capabilities, devices and unmasked paths.
//!
//! It is how the image test runs moor's containers as their pods run, without a kubelet.
//! Only what moor's manifests use is implemented: privileged containers, `hostPath` and
//! `emptyDir` volumes, `env` with `value` or `fieldRef`; anything else is an error.

use std::path::{Path, PathBuf};

use serde_json::{Value, json};

/// Every capability of Linux 5.9 and later, by the name the runtime spec uses, in the order of
/// their numbers.
pub const ALL_CAPABILITIES: [&str; 41] = [
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_DAC_READ_SEARCH",
    "CAP_FOWNER",
    "CAP_FSETID",
    "CAP_KILL",
    "CAP_SETGID",
    "CAP_SETUID",
    "CAP_SETPCAP",
    "CAP_LINUX_IMMUTABLE",
    "CAP_NET_BIND_SERVICE",
    "CAP_NET_BROADCAST",
    "CAP_NET_ADMIN",
    "CAP_NET_RAW",
    "CAP_IPC_LOCK",
    "CAP_IPC_OWNER",
    "CAP_SYS_MODULE",
    "CAP_SYS_RAWIO",
    "CAP_SYS_CHROOT",
    "CAP_SYS_PTRACE",
    "CAP_SYS_PACCT",
    "CAP_SYS_ADMIN",
    "CAP_SYS_BOOT",
    "CAP_SYS_NICE",
    "CAP_SYS_RESOURCE",
    "CAP_SYS_TIME",
    "CAP_SYS_TTY_CONFIG",
    "CAP_MKNOD",
    "CAP_LEASE",
    "CAP_AUDIT_WRITE",
    "CAP_AUDIT_CONTROL",
    "CAP_SETFCAP",
    "CAP_MAC_OVERRIDE",
    "CAP_MAC_ADMIN",
    "CAP_SYSLOG",
    "CAP_WAKE_ALARM",
    "CAP_BLOCK_SUSPEND",
    "CAP_AUDIT_READ",
    "CAP_PERFMON",
    "CAP_BPF",
    "CAP_CHECKPOINT_RESTORE",
];

/// The capabilities of this process's bounding set (`CapBnd` of `/proc/self/status`): what a
/// privileged container gets, as containerd gives it (a host may lack some, a VM's
/// `CAP_SYS_RESOURCE` for one, and a runtime refuses to grant what it does not have).
///
/// # Errors
/// When `/proc/self/status` cannot be read or has no bounding set.
pub fn current_capabilities() -> Result<Vec<&'static str>, String> {
    let status = std::fs::read_to_string("/proc/self/status")
        .map_err(|e| format!("/proc/self/status: {e}"))?;
    let mask = status
        .lines()
        .find_map(|l| l.strip_prefix("CapBnd:"))
        .and_then(|m| u64::from_str_radix(m.trim(), 16).ok())
        .ok_or("/proc/self/status has no CapBnd")?;
    Ok(ALL_CAPABILITIES
        .iter()
        .enumerate()
        .filter(|(bit, _)| mask & (1 << bit) != 0)
        .map(|(_, name)| *name)
        .collect())
}

/// Where the pod's containers find their network when the pod is not on the host's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PodNetwork {
    /// A network namespace of the container's own (only a loopback interface).
    Own,
    /// The network namespace at this path (`/proc/<pid>/ns/net`, `/run/netns/<name>`).
    Join(PathBuf),
}

/// What the host gives the container: its root, its image's environment, the values of the
/// pod's `fieldRef`s, and where its volumes are.
#[derive(Clone)]
pub struct Host<'a> {
    /// The container's root filesystem (the unpacked image).
    pub rootfs: &'a Path,
    /// The image config's `Env` (`PATH=...`), before the container's own `env`.
    pub image_env: &'a [String],
    /// The value of each field a `fieldRef` may name (`spec.nodeName`, ...).
    pub fields: &'a [(&'a str, &'a str)],
    /// Where each `hostPath` volume's path is on this host (the path itself on a real node).
    pub host_path: &'a dyn Fn(&str) -> PathBuf,
    /// The dir of each `emptyDir` volume, by volume name.
    pub empty_dir: &'a dyn Fn(&str) -> PathBuf,
    /// The network of a pod that is not on the host's network.
    pub pod_network: PodNetwork,
    /// The capabilities a privileged container gets ([`current_capabilities`] on a real
    /// host).
    pub capabilities: &'a [&'a str],
    /// The container's cgroup path.
    pub cgroups_path: &'a str,
}

impl std::fmt::Debug for Host<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Host")
            .field("rootfs", &self.rootfs)
            .field("image_env", &self.image_env)
            .field("fields", &self.fields)
            .field("pod_network", &self.pod_network)
            .field("capabilities", &self.capabilities)
            .field("cgroups_path", &self.cgroups_path)
            .finish_non_exhaustive()
    }
}

/// The pod spec of a workload (DaemonSet, Deployment, ...) or a Pod.
///
/// # Errors
/// When the object has none.
pub fn pod_spec(workload: &Value) -> Result<&Value, String> {
    let spec = &workload["spec"];
    let pod = if workload["kind"] == "Pod" {
        spec
    } else {
        &spec["template"]["spec"]
    };
    if pod.is_object() {
        Ok(pod)
    } else {
        Err(format!("{} has no pod spec", workload["kind"]))
    }
}

/// Replaces the path `from` with `to` in every string of `doc` that names it or a path below
/// it, also after a `=` (`--kubelet-dir=/var/lib/kubelet`): what an overlay for a host that
/// keeps that dir elsewhere changes.
pub fn relocate(doc: &mut Value, from: &str, to: &str) {
    match doc {
        Value::String(s) => {
            let mut out = String::new();
            let mut rest = s.as_str();
            while let Some(i) = rest.find(from) {
                let after = &rest[i + from.len()..];
                let starts = i == 0 || rest[..i].ends_with('=');
                let ends = after.is_empty() || after.starts_with('/');
                out.push_str(&rest[..i]);
                out.push_str(if starts && ends { to } else { from });
                rest = after;
            }
            out.push_str(rest);
            *s = out;
        }
        Value::Array(items) => items.iter_mut().for_each(|v| relocate(v, from, to)),
        Value::Object(map) => map.values_mut().for_each(|v| relocate(v, from, to)),
        _ => {}
    }
}

/// Expands Kubernetes' `$(VAR)` references to the container's variables; `$$` is a `$`, and
/// an unknown variable stays as written.
fn expand(text: &str, vars: &[(String, String)]) -> String {
    let mut out = String::new();
    let mut rest = text;
    while let Some(i) = rest.find('$') {
        out.push_str(&rest[..i]);
        let after = &rest[i + 1..];
        if let Some(a) = after.strip_prefix('$') {
            out.push('$');
            rest = a;
        } else if let Some(end) = after.strip_prefix('(').and_then(|a| a.find(')')) {
            let name = &after[1..=end];
            match vars.iter().find(|(n, _)| n == name) {
                Some((_, v)) => out.push_str(v),
                None => out.push_str(&rest[i..i + end + 3]),
            }
            rest = &after[end + 2..];
        } else {
            out.push('$');
            rest = after;
        }
    }
    out.push_str(rest);
    out
}

/// The runtime's own mounts, as containerd gives them: `(destination, type, source, options)`.
fn default_mounts(
    privileged: bool,
) -> Vec<(&'static str, &'static str, &'static str, Vec<&'static str>)> {
    let sys = if privileged { "rw" } else { "ro" };
    vec![
        ("/proc", "proc", "proc", vec!["nosuid", "noexec", "nodev"]),
        (
            "/dev",
            "tmpfs",
            "tmpfs",
            vec!["nosuid", "strictatime", "mode=755", "size=65536k"],
        ),
        (
            "/dev/pts",
            "devpts",
            "devpts",
            vec![
                "nosuid",
                "noexec",
                "newinstance",
                "ptmxmode=0666",
                "mode=0620",
                "gid=5",
            ],
        ),
        (
            "/dev/shm",
            "tmpfs",
            "shm",
            vec!["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"],
        ),
        (
            "/dev/mqueue",
            "mqueue",
            "mqueue",
            vec!["nosuid", "noexec", "nodev"],
        ),
        (
            "/sys",
            "sysfs",
            "sysfs",
            vec!["nosuid", "noexec", "nodev", sys],
        ),
    ]
}

/// The runtime configuration of container `name` of `workload` on `host`.
///
/// # Errors
/// When the container or a volume it mounts is missing, a `hostPath` of type `Directory` is
/// not a directory on the host, or the spec uses what is not implemented here.
pub fn runtime_config(workload: &Value, name: &str, host: &Host) -> Result<Value, String> {
    let pod = pod_spec(workload)?;
    let container = pod["containers"]
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["name"] == name))
        .ok_or_else(|| format!("no container {name}"))?;
    let privileged = container["securityContext"]["privileged"] == true;
    if !privileged {
        return Err(format!(
            "{name}: only privileged containers are implemented (moor's are)"
        ));
    }
    // The environment: the image's, then the container's, in order.
    let mut vars: Vec<(String, String)> = host
        .image_env
        .iter()
        .filter_map(|e| e.split_once('='))
        .map(|(n, v)| (n.to_owned(), v.to_owned()))
        .collect();
    for e in container["env"].as_array().into_iter().flatten() {
        let var = e["name"].as_str().ok_or("an env entry without a name")?;
        let value = if let Some(v) = e.get("value") {
            expand(v.as_str().ok_or("env value is not a string")?, &vars)
        } else if let Some(field) = e["valueFrom"]["fieldRef"]["fieldPath"].as_str() {
            host.fields
                .iter()
                .find(|(f, _)| *f == field)
                .map(|(_, v)| (*v).to_owned())
                .ok_or_else(|| format!("env {var}: no value for the field {field}"))?
        } else {
            return Err(format!(
                "env {var}: only value and fieldRef are implemented"
            ));
        };
        vars.retain(|(n, _)| n != var);
        vars.push((var.to_owned(), value));
    }
    let strings = |key: &str| -> Result<Vec<String>, String> {
        container[key]
            .as_array()
            .into_iter()
            .flatten()
            .map(|a| {
                a.as_str()
                    .map(|a| expand(a, &vars))
                    .ok_or_else(|| format!("{name}: {key} holds a non-string"))
            })
            .collect()
    };
    let mut args = strings("command")?;
    if args.is_empty() {
        return Err(format!("{name}: no command (the image has no entrypoint)"));
    }
    args.extend(strings("args")?);

    // Volume mounts: recursive binds of the volumes' host dirs.
    let mut user_mounts = Vec::new();
    let mut propagations = Vec::new();
    for m in container["volumeMounts"].as_array().into_iter().flatten() {
        let vol_name = m["name"].as_str().ok_or("a volume mount without a name")?;
        let dest = m["mountPath"]
            .as_str()
            .ok_or("a volume mount without a path")?;
        if m.get("subPath").is_some() || m.get("subPathExpr").is_some() {
            return Err(format!("{name}: subPath is not implemented"));
        }
        let volume = pod["volumes"]
            .as_array()
            .and_then(|vs| vs.iter().find(|v| v["name"] == vol_name))
            .ok_or_else(|| format!("{name}: no volume {vol_name}"))?;
        let source = if let Some(hp) = volume.get("hostPath") {
            let path = hp["path"].as_str().ok_or("a hostPath without a path")?;
            let on_host = (host.host_path)(path);
            match hp["type"].as_str().unwrap_or("") {
                "DirectoryOrCreate" => std::fs::create_dir_all(&on_host)
                    .map_err(|e| format!("hostPath {}: {e}", on_host.display()))?,
                "Directory" if !on_host.is_dir() => {
                    return Err(format!(
                        "volume {vol_name}: hostPath {} is not a directory",
                        on_host.display()
                    ));
                }
                "Directory" | "" => {}
                other => return Err(format!("hostPath type {other} is not implemented")),
            }
            on_host
        } else if volume.get("emptyDir").is_some() {
            (host.empty_dir)(vol_name)
        } else {
            return Err(format!(
                "volume {vol_name}: only hostPath and emptyDir are implemented"
            ));
        };
        let propagation = match m["mountPropagation"].as_str().unwrap_or("None") {
            "None" => "rprivate",
            "HostToContainer" => "rslave",
            "Bidirectional" => "rshared",
            other => return Err(format!("mountPropagation {other}")),
        };
        propagations.push(propagation);
        let rw = if m["readOnly"] == true { "ro" } else { "rw" };
        user_mounts.push(json!({
            "destination": dest,
            "type": "bind",
            "source": source,
            "options": ["rbind", propagation, rw],
        }));
    }
    let replaced = |dest: &str| {
        user_mounts.iter().any(|m| {
            let d = m["destination"].as_str().unwrap_or("");
            d == dest || (d == "/dev" && dest.starts_with("/dev/"))
        })
    };
    let mut mounts: Vec<Value> = default_mounts(privileged)
        .into_iter()
        .filter(|(dest, ..)| !replaced(dest))
        .map(|(dest, kind, source, options)| {
            json!({"destination": dest, "type": kind, "source": source, "options": options})
        })
        .collect();
    mounts.extend(user_mounts);

    // Namespaces: the pod's network (or the host's), its own PID, IPC and mounts; a pod on the
    // host network shares the host's UTS namespace too.
    let host_network = pod["hostNetwork"] == true;
    let mut namespaces = vec![json!({"type": "mount"})];
    if pod["hostPID"] != true {
        namespaces.push(json!({"type": "pid"}));
    }
    if pod["hostIPC"] != true {
        namespaces.push(json!({"type": "ipc"}));
    }
    if !host_network {
        namespaces.push(json!({"type": "uts"}));
        namespaces.push(match &host.pod_network {
            PodNetwork::Own => json!({"type": "network"}),
            PodNetwork::Join(path) => json!({"type": "network", "path": path}),
        });
    }
    let mut linux = json!({
        "namespaces": namespaces,
        "cgroupsPath": host.cgroups_path,
        // Privileged: every device, no masked or read-only paths, no seccomp filter.
        "resources": {"devices": [{"allow": true, "access": "rwm"}]},
    });
    // Bidirectional mounts need a shared root, HostToContainer ones a slave one (as CRI sets).
    if propagations.contains(&"rshared") {
        linux["rootfsPropagation"] = json!("rshared");
    } else if propagations.contains(&"rslave") {
        linux["rootfsPropagation"] = json!("rslave");
    }
    let caps = host.capabilities;
    let mut config = json!({
        "ociVersion": "1.0.2",
        "process": {
            "terminal": false,
            "user": {"uid": 0, "gid": 0},
            "args": args,
            "env": vars.iter().map(|(n, v)| format!("{n}={v}")).collect::<Vec<_>>(),
            "cwd": "/",
            "capabilities": {
                "bounding": caps, "effective": caps, "permitted": caps, "inheritable": caps,
            },
            "noNewPrivileges": false,
        },
        "root": {"path": host.rootfs, "readonly": false},
        "mounts": mounts,
        "linux": linux,
    });
    if !host_network {
        config["hostname"] = json!(name);
    }
    Ok(config)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn base() -> Vec<crate::kustomize::Resource> {
        crate::kustomize::build(&crate::deploy_dir().join("base")).expect("base renders")
    }

    fn workload<'a>(res: &'a [crate::kustomize::Resource], kind: &str) -> &'a Value {
        &res.iter().find(|r| r.doc["kind"] == kind).expect(kind).doc
    }

    fn config(kind: &str, container: &str) -> Value {
        let rootfs = Path::new("/r");
        let created = std::env::temp_dir().join(format!("moor-oci-{kind}-{}", std::process::id()));
        let host_path = |p: &str| created.join(p.trim_start_matches('/'));
        let empty_dir = |v: &str| PathBuf::from(format!("/empty/{v}"));
        let env = ["PATH=/usr/bin".to_owned()];
        let host = Host {
            rootfs,
            image_env: &env,
            fields: &[("spec.nodeName", "n1")],
            host_path: &host_path,
            empty_dir: &empty_dir,
            pod_network: PodNetwork::Own,
            cgroups_path: "/moor/x",
            capabilities: &ALL_CAPABILITIES,
        };
        // Directory hostPaths must exist.
        for d in [
            "dev",
            "sys",
            "sys/fs/cgroup",
            "var/lib/kubelet/plugins_registry",
        ] {
            std::fs::create_dir_all(created.join(d)).unwrap();
        }
        let res = base();
        let c = runtime_config(workload(&res, kind), container, &host).unwrap();
        let _ = std::fs::remove_dir_all(&created);
        c
    }

    fn namespaces(c: &Value) -> Vec<&str> {
        c["linux"]["namespaces"]
            .as_array()
            .unwrap()
            .iter()
            .map(|n| n["type"].as_str().unwrap())
            .collect()
    }

    fn mount<'a>(c: &'a Value, dest: &str) -> &'a Value {
        c["mounts"]
            .as_array()
            .unwrap()
            .iter()
            .find(|m| m["destination"] == dest)
            .unwrap_or_else(|| panic!("no mount at {dest}: {c}"))
    }

    #[test]
    fn the_node_runs_privileged_on_the_host_network_with_the_kubelet_dir_shared() {
        let c = config("DaemonSet", "moor-node");
        let args = c["process"]["args"].as_array().unwrap();
        assert_eq!(args[0], "/usr/local/bin/moor-node");
        assert!(args.contains(&json!("--node-id=n1")), "{args:?}");
        assert!(
            c["process"]["env"]
                .as_array()
                .unwrap()
                .contains(&json!("NODE_ID=n1"))
        );
        let kubelet = mount(&c, "/var/lib/kubelet");
        assert_eq!(kubelet["options"], json!(["rbind", "rshared", "rw"]));
        assert!(
            kubelet["source"]
                .as_str()
                .unwrap()
                .ends_with("/var/lib/kubelet")
        );
        assert_eq!(c["linux"]["rootfsPropagation"], "rshared");
        assert_eq!(mount(&c, "/dev")["type"], "bind");
        assert_eq!(mount(&c, "/sys")["type"], "bind");
        assert_eq!(
            mount(&c, "/csi")["options"],
            json!(["rbind", "rprivate", "rw"])
        );
        assert_eq!(mount(&c, "/proc")["type"], "proc");
        // The host's /dev replaces the runtime's, and everything below it.
        let dests: Vec<&str> = c["mounts"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["destination"].as_str().unwrap())
            .collect();
        assert!(
            !dests.contains(&"/dev/pts") && !dests.contains(&"/dev/shm"),
            "{dests:?}"
        );
        assert_eq!(
            namespaces(&c),
            ["mount", "pid", "ipc"],
            "host network, host UTS"
        );
        assert_eq!(
            c["process"]["capabilities"]["bounding"]
                .as_array()
                .unwrap()
                .len(),
            41
        );
        assert_eq!(c["linux"]["resources"]["devices"][0]["allow"], true);
        assert!(c["linux"].get("maskedPaths").is_none());
    }

    #[test]
    fn the_controller_runs_on_its_pod_network_with_its_data_dir_and_dev() {
        let c = config("Deployment", "moor-controller");
        assert_eq!(namespaces(&c), ["mount", "pid", "ipc", "uts", "network"]);
        assert_eq!(mount(&c, "/csi")["source"], "/empty/socket-dir");
        assert_eq!(mount(&c, "/dev")["type"], "bind");
        assert_eq!(
            mount(&c, "/sys")["type"],
            "sysfs",
            "privileged: the runtime's, read-write"
        );
        assert!(
            mount(&c, "/sys")["options"]
                .as_array()
                .unwrap()
                .contains(&json!("rw"))
        );
        // The kubelet's mounts reach it (HostToContainer), for freezing group members in use.
        assert_eq!(c["linux"]["rootfsPropagation"], "rslave");
        assert!(
            mount(&c, "/var/lib/kubelet")["options"]
                .as_array()
                .unwrap()
                .contains(&json!("rslave"))
        );
        assert!(
            mount(&c, "/var/lib/moor-controller")["source"]
                .as_str()
                .unwrap()
                .ends_with("/var/lib/moor-controller")
        );
    }

    #[test]
    fn current_capabilities_are_named_by_their_bits() {
        let caps = current_capabilities().unwrap();
        assert!(
            caps.iter().all(|c| ALL_CAPABILITIES.contains(c)),
            "{caps:?}"
        );
        assert_eq!(ALL_CAPABILITIES[21], "CAP_SYS_ADMIN");
        assert_eq!(ALL_CAPABILITIES[40], "CAP_CHECKPOINT_RESTORE");
    }

    #[test]
    fn relocate_and_expand() {
        let mut doc = json!({"a": ["/var/lib/kubelet", "--kubelet-dir=/var/lib/kubelet",
            "/var/lib/kubelet/plugins/x", "/var/lib/kubelet2", "/x/var/lib/kubelet"]});
        relocate(&mut doc, "/var/lib/kubelet", "/t/k");
        assert_eq!(
            doc,
            json!({"a": ["/t/k", "--kubelet-dir=/t/k", "/t/k/plugins/x", "/var/lib/kubelet2",
                "/x/var/lib/kubelet"]})
        );
        let vars = [("A".to_owned(), "1".to_owned())];
        assert_eq!(
            expand("--a=$(A) $(B) $$(A) $ x", &vars),
            "--a=1 $(B) $(A) $ x"
        );
    }
}
