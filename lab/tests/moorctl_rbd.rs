//! moorctl with RBD volumes (run as root, against the cluster `.ci/ceph-cluster up` brings
//! up): `volume create --backend rbd` and the rest of a volume's life through the same
//! commands as for an embedded volume, with the CSI secrets from `--secrets FILE`; and
//! `moorctl status` showing the mapping beside the mounts. Without a cluster the test says it
//! is skipped and passes.

use std::path::Path;
use std::process::{Command, Output};

use moor_lab::ceph::{CLUSTER_ID, Ceph, World};
use moor_privileged::client::binary;
use moor_privileged::{mount_depth, runtime};
use serde_json::Value;

/// Runs moorctl against `socket` with the secrets file; its output.
fn moorctl(socket: &Path, secrets: &Path, args: &[&str]) -> Output {
    Command::new(binary("moorctl"))
        .arg("--endpoint")
        .arg(socket)
        .arg("--secrets")
        .arg(secrets)
        .args(["--output", "json"])
        .args(args)
        .output()
        .expect("run moorctl")
}

/// moorctl's JSON answer, asserting it succeeded.
fn ok(out: &Output, what: &str) -> Value {
    assert!(
        out.status.success(),
        "{what}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{what}: {e}"))
}

#[test]
fn moorctl_runs_an_rbd_volume_through_the_same_commands() {
    let Some(ceph) = Ceph::from_env("moorctl_runs_an_rbd_volume_through_the_same_commands") else {
        return;
    };
    let mut w = World::new("moorctl-rbd", ceph, 1);
    let rt = runtime();
    let ctl_socket = rt.block_on(async {
        drop(w.start_controller(&[]).await);
        drop(w.start(0, "moor-node", &[]).await);
        w.sb.root.join("controller/controller.sock")
    });
    let node_socket = w.nodes[0].socket.clone();
    let secrets = w.sb.root.join("secrets");
    std::fs::write(
        &secrets,
        format!("userID={}\nuserKey={}\n", w.ceph.user, w.ceph.key),
    )
    .expect("secrets file");
    let name = format!("moorctl-rbd-{}", std::process::id());
    let pool = w.ceph.pool.clone();

    let out = moorctl(
        &ctl_socket,
        &secrets,
        &[
            "volume",
            "create",
            &name,
            "--size",
            "64MiB",
            "--backend",
            "rbd",
            "--pool",
            &pool,
            "--cluster-id",
            CLUSTER_ID,
        ],
    );
    let v = ok(&out, "volume create");
    let id = v["volume_id"].as_str().expect("an id").to_string();
    let listed = ok(&moorctl(&ctl_socket, &secrets, &["volume", "list"]), "list");
    assert!(listed.to_string().contains(&id), "{listed}");

    let node = w.nodes[0].name.clone();
    let published = ok(
        &moorctl(&ctl_socket, &secrets, &["publish", &id, "--node", &node]),
        "publish",
    );
    let context: Vec<String> = published["publish_context"]
        .as_object()
        .expect("a publish context")
        .iter()
        .map(|(k, v)| format!("{k}={}", v.as_str().unwrap_or_default()))
        .collect();
    w.images.push(
        published["publish_context"]["rbdImage"]
            .as_str()
            .expect("the image")
            .to_string(),
    );
    let staging = w.staging(0, "pv");
    let target = w.target(0, "pv");
    let staging_arg = staging.display().to_string();
    let target_arg = target.display().to_string();
    let mut stage = vec!["stage", &id, "--staging", &staging_arg];
    for c in &context {
        stage.extend(["--context", c]);
    }
    ok(&moorctl(&node_socket, &secrets, &stage), "stage");
    ok(
        &moorctl(
            &node_socket,
            &secrets,
            &[
                "mount",
                &id,
                "--staging",
                &staging_arg,
                "--target",
                &target_arg,
            ],
        ),
        "mount",
    );
    std::fs::write(target.join("hello"), b"through moorctl").expect("write");

    // status: the mapping, the staging mount and the publication, all healthy.
    let state = w.nodes[0].state.display().to_string();
    let status = ok(
        &moorctl(&node_socket, &secrets, &["status", "--state-dir", &state]),
        "status",
    );
    let text = status.to_string();
    assert!(text.contains("\"mapping\""), "the mapping is shown: {text}");
    assert!(
        !text.contains("drifted") && !text.contains("device-gone") && !text.contains("unknown"),
        "{text}"
    );

    ok(
        &moorctl(
            &node_socket,
            &secrets,
            &["unmount", &id, "--target", &target_arg],
        ),
        "unmount",
    );
    ok(
        &moorctl(
            &node_socket,
            &secrets,
            &["unstage", &id, "--staging", &staging_arg],
        ),
        "unstage",
    );
    assert_eq!(mount_depth(&staging), 0);
    assert_eq!(w.leftovers(0), (0, 0, 0), "unmapped");
    ok(
        &moorctl(&ctl_socket, &secrets, &["unpublish", &id, "--node", &node]),
        "unpublish",
    );
    ok(
        &moorctl(&ctl_socket, &secrets, &["volume", "delete", &id]),
        "delete",
    );
    let listed = ok(&moorctl(&ctl_socket, &secrets, &["volume", "list"]), "list");
    assert!(!listed.to_string().contains(&id), "{listed}");

    // Without the secrets file the key is nowhere on moorctl's command line, and a missing
    // file is a usage error that names the file only.
    let out = moorctl(&ctl_socket, &w.sb.root.join("absent"), &["volume", "list"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("secrets file"));
}
