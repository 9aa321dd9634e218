//! What the manifests rely on in the rest of the repository: the binaries' flags (from their
//! clap commands) and the container build file.

use moor_deploy::containerfile::{self, Stage};
use moor_deploy::flags::{Arity, COMING_FLAGS, ValueKind};
use moor_deploy::read_repo_file;

#[test]
fn flags_are_read_from_the_binaries_commands() {
    let (node, controller, _) = moor_deploy::binaries(false).unwrap();
    let names = |cli: &moor_deploy::flags::Cli| cli.flags.keys().cloned().collect::<Vec<_>>();
    let node_names = names(&node);
    for f in [
        "endpoint",
        "node-id",
        "driver-name",
        "state-dir",
        "kubelet-dir",
        "max-volumes",
        "log-format",
        "journal-fsync",
        "tool-timeout",
        "shutdown-grace",
    ] {
        assert!(
            node_names.contains(&f.to_owned()),
            "moor-node --{f}: {node_names:?}"
        );
    }
    let controller_names = names(&controller);
    for f in [
        "endpoint",
        "driver-name",
        "node-id",
        "data-dir",
        "log-format",
    ] {
        assert!(
            controller_names.contains(&f.to_owned()),
            "moor-controller --{f}: {controller_names:?}"
        );
    }
    assert_eq!(node.flags["journal-fsync"].arity, Arity::Switch);
    assert_eq!(node.flags["max-volumes"].kind, ValueKind::Unsigned);
    let formats = ValueKind::OneOf(vec!["text".into(), "json".into()]);
    assert_eq!(node.flags["log-format"].kind, formats);
    assert_eq!(controller.flags["log-format"].kind, formats);
    assert_eq!(node.flags["node-id"].env.as_deref(), Some("NODE_ID"));
}

#[test]
fn coming_flags_are_listed_once_and_reported_when_they_land() {
    let (node, controller, notes) = moor_deploy::binaries(true).unwrap();
    for n in &notes {
        eprintln!("note: {n}");
    }
    for c in COMING_FLAGS {
        let cli = if c.binary == "moor-node" {
            &node
        } else {
            &controller
        };
        let f = cli
            .flags
            .get(c.name)
            .unwrap_or_else(|| panic!("{} --{}", c.binary, c.name));
        assert_eq!(f.arity, c.arity, "{} --{}", c.binary, c.name);
        let landed = notes
            .iter()
            .any(|n| n.contains(&format!("{} --{} ", c.binary, c.name)));
        assert_eq!(f.coming, !landed, "{} --{}", c.binary, c.name);
        let twice = COMING_FLAGS
            .iter()
            .filter(|d| d.binary == c.binary && d.name == c.name)
            .count();
        assert_eq!(twice, 1, "{} --{} listed twice", c.binary, c.name);
    }
}

fn stages() -> Vec<Stage> {
    containerfile::parse(&read_repo_file("deploy/Containerfile").unwrap()).unwrap()
}

#[test]
fn containerfile_builds_the_binaries_with_the_pinned_toolchain() {
    let stages = stages();
    assert_eq!(stages.len(), 2, "a builder and a runtime stage");
    let builder = &stages[0];
    let toolchain = read_repo_file("rust-toolchain.toml").unwrap();
    let channel = toolchain
        .lines()
        .find_map(|l| l.trim().strip_prefix("channel"))
        .and_then(|l| l.split('"').nth(1))
        .expect("rust-toolchain.toml names a channel");
    assert_eq!(
        builder.from,
        format!("docker.io/library/rust:{channel}-slim-bookworm"),
        "the builder image must carry the toolchain rust-toolchain.toml pins"
    );
    assert_eq!(builder.name.as_deref(), Some("builder"));
    // libudev-sys (moor-node's udev crate) builds against libudev, found with pkg-config.
    assert!(
        read_repo_file("Cargo.lock")
            .unwrap()
            .contains("name = \"libudev-sys\"")
    );
    assert_eq!(builder.apt_packages(), ["libudev-dev", "pkg-config"]);
    let build: Vec<&str> = builder
        .all("RUN")
        .filter(|r| r.contains("cargo build"))
        .collect();
    assert_eq!(
        build,
        [
            "cargo build --release --locked --bin moor-node --bin moor-controller --bin moorctl --bin moor-ublk"
        ]
    );
    // Every workspace member is in the build context the builder copies.
    let manifest = read_repo_file("Cargo.toml").unwrap();
    let members = manifest
        .split("members = [")
        .nth(1)
        .and_then(|m| m.split(']').next())
        .expect("workspace members");
    let copied: Vec<String> = builder
        .all("COPY")
        .flat_map(|c| {
            let words: Vec<&str> = c.split_whitespace().collect();
            words[..words.len() - 1]
                .iter()
                .map(|w| (*w).to_owned())
                .collect::<Vec<_>>()
        })
        .collect();
    for m in members.split(',').map(|m| m.trim().trim_matches('"')) {
        if !m.is_empty() {
            assert!(
                copied.contains(&m.to_owned()),
                "member {m} is not copied: {copied:?}"
            );
        }
    }
    for f in ["Cargo.toml", "Cargo.lock", "rust-toolchain.toml"] {
        assert!(copied.contains(&f.to_owned()), "{f} is not copied");
    }
}

/// Which Debian package provides each program moor-node runs ([`moor_node::service::programs`]).
const TOOL_PACKAGES: &[(&str, &str)] = &[
    ("mkfs.ext2", "e2fsprogs"),
    ("mkfs.ext3", "e2fsprogs"),
    ("mkfs.ext4", "e2fsprogs"),
    ("e2fsck", "e2fsprogs"),
    ("resize2fs", "e2fsprogs"),
    ("mkfs.xfs", "xfsprogs"),
    ("xfs_growfs", "xfsprogs"),
    ("mkfs.btrfs", "btrfs-progs"),
    ("btrfs", "btrfs-progs"),
    ("rbd-fuse", "rbd-fuse"),
    ("cryptsetup", "cryptsetup-bin"),
];

/// Which Debian package provides each library the daemons load: the ones the controller's RBD
/// backend opens ([`moor_rbd::LIBRARIES`]), and libudev, which moor-node links (the `udev`
/// crate).
const LIBRARY_PACKAGES: &[(&str, &str)] = &[
    ("librados.so.2", "librados2"),
    ("librbd.so.1", "librbd1"),
    ("libudev.so.1", "libudev1"),
];

/// The packages the daemons need, each once, in the order they are first needed.
fn needed_packages() -> Vec<String> {
    let programs = moor_node::service::programs();
    let libraries = moor_rbd::LIBRARIES.iter().copied().chain(["libudev.so.1"]);
    let mut needed: Vec<String> = Vec::new();
    let wanted = programs
        .iter()
        .map(|p| (p.as_str(), TOOL_PACKAGES))
        .chain(libraries.map(|l| (l, LIBRARY_PACKAGES)));
    for (what, table) in wanted {
        let pkg = table
            .iter()
            .find(|(t, _)| *t == what)
            .unwrap_or_else(|| {
                panic!("which Debian package has {what}? add it to deploy/tests/sources.rs")
            })
            .1;
        if !needed.iter().any(|n| n == pkg) {
            needed.push(pkg.to_owned());
        }
    }
    needed
}

#[test]
fn the_image_packages_are_exactly_what_the_daemons_run_and_load() {
    let listed: Vec<String> = moor_deploy::image_packages()
        .unwrap()
        .into_iter()
        .map(|(p, _)| p)
        .collect();
    let needed = needed_packages();
    for n in &needed {
        assert!(listed.contains(n), "deploy/packages lacks {n}: {listed:?}");
    }
    for l in &listed {
        assert!(
            needed.contains(l),
            "deploy/packages lists {l}, which no program or library of the daemons needs"
        );
    }
    assert_eq!(listed.len(), needed.len(), "listed twice? {listed:?}");
}

#[test]
fn containerfile_runtime_has_the_binaries_and_the_image_packages() {
    let stages = stages();
    let runtime = &stages[1];
    assert_eq!(runtime.from, "docker.io/library/debian:bookworm-slim");
    let listed: Vec<String> = moor_deploy::image_packages()
        .unwrap()
        .into_iter()
        .map(|(p, _)| p)
        .collect();
    assert_eq!(
        runtime.apt_packages(),
        listed,
        "deploy/Containerfile must install the packages of deploy/packages, in its order"
    );
    assert!(runtime.all("RUN").any(
        |r| r.contains("--no-install-recommends") && r.contains("rm -rf /var/lib/apt/lists/*")
    ));
    let copies: Vec<&str> = runtime.all("COPY").collect();
    assert_eq!(
        copies,
        [
            "--from=builder /src/target/release/moor-node /src/target/release/moor-controller \
             /src/target/release/moorctl /src/target/release/moor-ublk /usr/local/bin/"
        ]
    );
    assert_eq!(moor_deploy::install_dir().unwrap(), "/usr/local/bin");
    assert!(runtime.all("ENTRYPOINT").next().is_none() && runtime.all("CMD").next().is_none());
}
