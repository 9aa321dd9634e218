//! The kernel RBD client's cost, side by side in one guest of the VM lab (`.ci/vm`, Debian's
//! kernel under QEMU/TCG) on the Ceph test cluster: moor-node's map + stage (a first one, with
//! mkfs; and one of a formatted image) and unstage + unmap, against what ceph-csi's node plugin
//! does for the same volume, exec'ing the `ceph-common` CLI and the filesystem tools:
//! `rbd map` then `mkfs.ext4` and `mount`; `umount` then `rbd unmap`.
//!
//! moor's times are its own, as its log gives each call's (the call's gRPC hop through the
//! guest's agent is left out); the reference's are taken in the guest around the commands. TCG
//! makes every instruction slow, so the ratios mean more than the times.
//!
//! Run as root beside a cluster (`.ci/ceph-cluster up DIR`, then `. DIR/env`) with the lab set
//! up (`.ci/vm setup`): `cargo bench -p moor-bench --bench vm_rbd`. Skipped, with the
//! reason, otherwise. `MOOR_BENCH_QUICK=1`: 2 rounds instead of 7.

use std::collections::HashMap;

use moor_lab::ceph::ext4;
use moor_lab::krbd_lab::{Lab, attach, create, detach, stage_req};
use moor_privileged::requests::unstage_req;
use moor_privileged::runtime;
use moor_proto::csi::v1 as csi;

/// The milliseconds of moor-node's last logged call `rpc` in the guest.
fn last_call_ms(lab: &Lab, rpc: &str) -> f64 {
    lab.log(0)
        .lines()
        .rev()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find(|v| v["rpc"] == rpc && v["message"] == "ok")
        .and_then(|v| v["micros"].as_f64())
        .map(|us| us / 1e3)
        .unwrap_or_else(|| panic!("no {rpc} in the log"))
}

/// Runs `script` in the guest and returns the milliseconds it took there.
fn timed_sh(lab: &Lab, script: &str) -> f64 {
    let out = lab.vms[0].sh(&format!(
        "s=$(date +%s%N); {{ {script} ; }} >/dev/null; e=$(date +%s%N); echo $(( (e - s) / 1000 ))"
    ));
    out.trim().parse::<f64>().expect("microseconds") / 1e3
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let name = "vm-krbd-bench";
    let Some(mut lab) = Lab::new(name, 1, 90) else {
        return;
    };
    let rounds = if std::env::var_os("MOOR_BENCH_QUICK").is_some() {
        2
    } else {
        7
    };
    let mut rows: HashMap<&str, (Vec<f64>, Vec<f64>)> = HashMap::new();
    runtime().block_on(async {
        let mut ctl = lab.world.start_controller(&[]).await;
        let mut node = lab.start_node(0, "moor-node", &[]).await;
        let w = &lab.world;
        let ceph = &w.ceph;
        let rbd = format!(
            "rbd -c {} --id {} --keyring {} -p {}",
            ceph.conf, ceph.user, ceph.keyring, ceph.pool
        );
        for round in 0..rounds {
            // moor: a volume from the controller, staged and unstaged twice.
            let mut v = create(w, &mut ctl, &format!("bench-{round}"), ext4()).await;
            let ctx = attach(w, &mut ctl, &mut v, 0).await.expect("publish");
            let staging = w.staging(0, &v.id);
            for (stage_row, unstage_row) in [
                (
                    "map + stage, first (mkfs)",
                    "unstage + unmap (after the first)",
                ),
                ("map + stage, formatted", "unstage + unmap"),
            ] {
                node.node_stage_volume(stage_req(w, &v, &ctx, 0))
                    .await
                    .expect("stage");
                rows.entry(stage_row)
                    .or_default()
                    .0
                    .push(last_call_ms(&lab, "NodeStageVolume"));
                node.node_unstage_volume(unstage_req(&v.id, &staging))
                    .await
                    .expect("unstage");
                rows.entry(unstage_row)
                    .or_default()
                    .0
                    .push(last_call_ms(&lab, "NodeUnstageVolume"));
            }
            detach(w, &mut ctl, &v, 0).await;
            ctl.delete_volume(csi::DeleteVolumeRequest {
                volume_id: v.id.clone(),
                secrets: w.secrets(),
            })
            .await
            .expect("DeleteVolume");

            // The reference: the same steps exec'd, on an image of the same size.
            let image = format!("bench-ref-{round}-{}", std::process::id());
            ceph.create(&image, 256);
            let dir = format!("/run/bench-ref-{round}");
            let map = format!("dev=$({rbd} map {image}) && mkdir -p {dir}");
            for (stage_row, unstage_row, mkfs) in [
                (
                    "map + stage, first (mkfs)",
                    "unstage + unmap (after the first)",
                    true,
                ),
                ("map + stage, formatted", "unstage + unmap", false),
            ] {
                let fs = if mkfs { "mkfs.ext4 -q $dev && " } else { "" };
                let ms = timed_sh(&lab, &format!("{map} && {fs}mount $dev {dir}"));
                rows.entry(stage_row).or_default().1.push(ms);
                let ms = timed_sh(&lab, &format!("umount {dir} && {rbd} unmap {image}"));
                rows.entry(unstage_row).or_default().1.push(ms);
            }
            let _ = ceph.rbd(&["rm", "--no-progress", &image]);
        }
        drop(node);
    });
    println!(
        "\nvm_rbd: the kernel RBD client in a TCG guest, median of {rounds} rounds (ms; moor's \
         from its log, the reference's inside the guest)\n"
    );
    println!("| step | moor | ceph-csi's way (rbd CLI + tools) | moor / reference |");
    println!("| --- | --- | --- | --- |");
    for row in [
        "map + stage, first (mkfs)",
        "map + stage, formatted",
        "unstage + unmap (after the first)",
        "unstage + unmap",
    ] {
        let (mut m, mut r) = rows.remove(row).unwrap_or_default();
        if m.is_empty() || r.is_empty() {
            continue;
        }
        let (m, r) = (median(&mut m), median(&mut r));
        println!("| {row} | {m:.0} | {r:.0} | {:.2} |", m / r);
    }
    lab.vms.clear();
}
