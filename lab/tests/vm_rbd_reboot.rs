//! A reboot without a drain, with RBD volumes mapped by the kernel client (issue 38, point 2;
//! the field's report: ceph-csi #5150, "can't map PV after node reboot ... (13) Permission
//! denied"). A guest of the VM lab holds three volumes staged and published (a filesystem a
//! writer appends to and fsyncs, a filesystem of an `exclusiveLock` StorageClass, a block
//! volume) when its QEMU is killed: no unmount, no unmap, the dead client's watches and the
//! images' locks left on the cluster. The guest boots again, moor-node starts, and kubelet's
//! retried stage and publish of each volume map it again at once (the kernel breaks the dead
//! client's lock, blocklisting that one instance, not the node), with every synced byte there
//! and nothing formatted (each filesystem's UUID and moor-node's count of formats unchanged).
//! How long each re-map took, and how long after the cut, is printed.
//!
//! Quick mode (the test command): one cut; `MOOR_VM_REBOOT_CUTS=N` cuts N times. Skipped, with
//! the reason, without the lab (`.ci/vm setup`) or a cluster on a bridge (`.ci/ceph-cluster up`).

use std::collections::HashMap;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use moor_lab::ceph::{World, block, ext4, ms};
use moor_lab::krbd_lab::*;
use moor_privileged::runtime;
use moor_proto::csi::v1::volume_capability::access_mode::Mode;
use moor_runtime::contract::{RBD_USER_ID_SECRET, RBD_USER_KEY_SECRET};
use rustix::process::{Pid, Signal, kill_process};

/// The UUID of the filesystem on volume `v`'s kernel device in guest `i` (as blkid reads it).
fn fs_uuid(lab: &Lab, v: &Volume, i: usize) -> String {
    lab.vms[i]
        .sh(&format!(
            "for d in /sys/bus/rbd/devices/*; do [ \"$(cat $d/name)\" = '{}' ] && \
             blkid -p -s UUID -o value /dev/rbd$(basename $d); done; true",
            v.image
        ))
        .trim()
        .to_string()
}

/// A Ceph user that may map and write the pool's images but not blocklist a client (`mon
/// 'allow r'`, not `profile rbd`), as in ceph-csi #5150: its CSI secrets.
fn user_who_cannot_blocklist(w: &World) -> HashMap<String, String> {
    let name = format!("client.moorcut{}", std::process::id());
    let out = Command::new("timeout")
        .args(["120", "ceph", "-c", &w.ceph.conf, "-n", "client.admin"])
        .args(["auth", "get-or-create-key", &name, "mon", "allow r", "osd"])
        .arg(format!("profile rbd pool={}", w.ceph.pool))
        .output()
        .expect("ceph auth get-or-create-key");
    assert!(out.status.success(), "ceph auth: {out:?}");
    let key = String::from_utf8_lossy(&out.stdout).trim().to_string();
    HashMap::from([
        (
            RBD_USER_ID_SECRET.into(),
            name["client.".len()..].to_string(),
        ),
        (RBD_USER_KEY_SECRET.into(), key),
    ])
}

/// Removes the user [`user_who_cannot_blocklist`] makes when dropped, also after a failure.
struct RemoveUser(String);

impl Drop for RemoveUser {
    fn drop(&mut self) {
        let _ = Command::new("timeout")
            .args([
                "120",
                "ceph",
                "-c",
                &self.0,
                "-n",
                "client.admin",
                "auth",
                "del",
            ])
            .arg(format!("client.moorcut{}", std::process::id()))
            .output();
    }
}

/// A librbd client on the host that can be frozen as a dead node's client would be: killed
/// and reaped when dropped, also after a failure.
struct StoppedClient(Child);

impl StoppedClient {
    /// Freezes it (SIGSTOP): it holds what it held, answers nothing, pings no OSD.
    fn stop(&self) {
        let pid = Pid::from_raw(self.0.id() as i32).expect("a pid");
        kill_process(pid, Signal::STOP).expect("SIGSTOP");
    }
}

impl Drop for StoppedClient {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The writer's lines: each the next number from 1, none missing, none torn.
fn lines_in_order(text: &str) -> u64 {
    let mut n = 0;
    for line in text.lines() {
        n += 1;
        assert_eq!(
            line,
            n.to_string(),
            "line {n} of the writer's file: {text:?}"
        );
    }
    n
}

#[test]
fn a_node_cut_off_with_volumes_in_use_maps_them_again_at_once() {
    let test = "vm-krbd-cut";
    let cuts: usize = std::env::var("MOOR_VM_REBOOT_CUTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    let Some(mut lab) = Lab::new(test, 1, 95) else {
        return;
    };
    runtime().block_on(async {
        let mut ctl = lab.world.start_controller(&[]).await;
        let mut node = lab.start_node(0, "moor-node", &[]).await;
        let mut fs = create(&lab.world, &mut ctl, "vmcutfs", ext4()).await;
        let mut excl = create_with(
            &lab.world,
            &mut ctl,
            "vmcutx",
            ext4(),
            &[("exclusiveLock", "true")],
        )
        .await;
        let mut blk = create(
            &lab.world,
            &mut ctl,
            "vmcutblk",
            block(Mode::SingleNodeWriter),
        )
        .await;
        let mut ctxs = Vec::new();
        for v in [&mut fs, &mut excl, &mut blk] {
            let ctx = attach(&lab.world, &mut ctl, v, 0).await.expect("publish");
            mount(&lab.world, &mut node, v, &ctx, 0)
                .await
                .expect("first stage");
            ctxs.push(ctx);
        }
        let vols = [&fs, &excl, &blk];
        let uuids = [fs_uuid(&lab, &fs, 0), fs_uuid(&lab, &excl, 0)];
        assert!(
            uuids.iter().all(|u| !u.is_empty()),
            "both filesystems have a UUID: {uuids:?}"
        );
        let _remove = RemoveUser(lab.world.ceph.conf.clone());
        let limited = user_who_cannot_blocklist(&lab.world);
        let seq = lab
            .world
            .target(0, &fs.id)
            .join("seq")
            .display()
            .to_string();
        let dev = lab.world.block_target(0, &blk.id).display().to_string();

        for cut in 1..=cuts {
            let w = &lab.world;
            // The pods at work: a writer appending a line at a time, each fsynced (its count
            // of synced lines in /run, outside the volume); a write to each other volume.
            lab.vms[0].spawn(
                &[
                    "sh",
                    "-c",
                    &format!(
                        "i=$(wc -l < {seq} 2>/dev/null || echo 0); while :; do i=$((i+1)); \
                         echo $i | dd of={seq} oflag=append conv=notrunc,fsync status=none \
                         && echo $i > /run/synced.tmp && mv /run/synced.tmp /run/synced \
                         || echo \"write $i failed\"; done"
                    ),
                ],
                "/run/writer.log",
            );
            let text = format!("synced before cut {cut}");
            pod_write(&lab, &excl, 0, &text);
            let sum = lab.vms[0].sh(&format!(
                "head -c 1048576 /dev/urandom > /run/blk && dd if=/run/blk of={dev} bs=1M \
                 oflag=direct conv=fsync status=none && sha256sum < /run/blk"
            ));
            let synced = || {
                lab.vms[0]
                    .read("/run/synced")
                    .trim()
                    .parse::<u64>()
                    .unwrap_or(0)
            };
            let start = synced();
            let waited = Instant::now();
            while synced() < start + 5 {
                assert!(
                    waited.elapsed() < Duration::from_secs(300),
                    "waited 300 s for the writer to sync 5 lines: {}",
                    lab.vms[0].read("/run/writer.log")
                );
                tokio::time::sleep(Duration::from_millis(200)).await;
            }

            // The cut: QEMU killed mid-write, nothing unmounted or unmapped.
            let before = synced();
            drop(node);
            lab.vms[0].kill();
            let cut_at = Instant::now();
            let lingering: Vec<usize> = vols.iter().map(|v| w.ceph.watchers(&v.image)).collect();
            eprintln!(
                "{test}: cut {cut}: the writer had synced {before} lines; the dead client's \
                 watchers per image right after the cut: {lingering:?}"
            );
            lab.vms[0].reboot();
            lab.vms[0].sh("modprobe rbd");
            assert!(lab.mappings(0).is_empty(), "a reboot drops every mapping");
            node = lab.start_node(0, "moor-node", &[]).await;
            let lingering: Vec<usize> = vols.iter().map(|v| w.ceph.watchers(&v.image)).collect();
            eprintln!(
                "{test}: cut {cut}: guest and moor-node up {} after the cut; watchers per \
                 image: {lingering:?}",
                ms(cut_at.elapsed())
            );

            // ceph-csi #5150: a user that may not blocklist cannot take the lock the dead
            // client holds; the map fails, saying what the user lacks, and leaves nothing.
            let mut denied = stage_req(w, &excl, &ctxs[1], 0);
            denied.secrets = limited.clone();
            let e = node
                .node_stage_volume(denied)
                .await
                .expect_err("a map that must blocklist the dead client, by a user who may not");
            eprintln!("{test}: cut {cut}: the stage by a user who may not blocklist: {e:?}");
            assert_eq!(e.code(), tonic::Code::Internal, "{e:?}");
            assert!(e.message().contains("mon 'profile rbd'"), "{e:?}");
            assert!(lab.mappings(0).is_empty(), "{:?}", lab.mappings(0));

            // kubelet, after the node's reboot, stages and publishes each volume again.
            for (v, ctx) in vols.iter().zip(&ctxs) {
                let since_cut = cut_at.elapsed();
                let staged = mount(w, &mut node, v, ctx, 0).await.unwrap_or_else(|e| {
                    panic!(
                        "cut {cut}: kubelet's stage of {} after the reboot: {e:?}; the \
                             kernel: {}; moor-node: {}",
                        v.id,
                        lab.vms[0].sh("dmesg | grep -E 'rbd|libceph'; true"),
                        lab.log(0)
                    )
                });
                eprintln!(
                    "{test}: cut {cut}: re-map (stage) of {} after the reboot: {} ({} after \
                     the cut)",
                    v.image,
                    ms(staged),
                    ms(since_cut + staged)
                );
            }
            eprintln!(
                "{test}: cut {cut}: the kernel: {}",
                lab.vms[0].sh("dmesg | grep -E 'rbd[0-9]*:'; true")
            );
            assert_eq!(lab.mappings(0).len(), 3, "{:?}", lab.mappings(0));

            // The data is there, nothing is formatted.
            let lines = lines_in_order(&lab.vms[0].read(&seq));
            assert!(
                lines >= before,
                "cut {cut}: {lines} lines after the reboot, {before} were synced"
            );
            assert_eq!(pod_read(&lab, &excl, 0), text, "cut {cut}");
            let back = lab.vms[0].sh(&format!(
                "dd if={dev} bs=1M count=1 iflag=direct status=none | sha256sum"
            ));
            assert_eq!(back, sum, "cut {cut}: the block volume's synced data");
            assert_eq!(
                [fs_uuid(&lab, &fs, 0), fs_uuid(&lab, &excl, 0)],
                uuids,
                "cut {cut}: the filesystems are the ones made at the first stage"
            );
            for v in [&fs, &excl] {
                assert_eq!(
                    lab.formats(0, &v.id),
                    1,
                    "cut {cut}: {} formatted once: {}",
                    v.id,
                    lab.log(0)
                );
            }
            // The new client holds each image: one watcher, this guest's.
            for v in vols {
                assert_eq!(
                    w.ceph.watcher_hosts(&v.image),
                    vec![format!("{}.95", lab.net)],
                    "cut {cut}: {}",
                    v.image
                );
            }
        }

        // A dead client whose watch is still there, as a node back within the watch timeout
        // would meet (the lab's guests boot slower): librbd on the host writes to a fourth
        // image, holding its lock, and is stopped (SIGSTOP: no pings, no answers). The
        // guest's map asks it for the lock, waits for its watch to time out and breaks it.
        let w = &lab.world;
        let mut live = create(w, &mut ctl, "vmcutlive", block(Mode::SingleNodeWriter)).await;
        let live_ctx = attach(w, &mut ctl, &mut live, 0).await.expect("publish");
        let owner = StoppedClient(
            Command::new("rbd")
                .args(["-c", &w.ceph.conf, "--id", &w.ceph.user, "-p", &w.ceph.pool])
                .args(["bench", "--io-type", "write", "--io-size", "4096"])
                .args(["--io-threads", "1", "--io-total", "200M", &live.image])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("rbd bench"),
        );
        let waited = Instant::now();
        while !w
            .ceph
            .rbd(&["lock", "ls", &live.image])
            .is_ok_and(|l| l.contains("auto"))
        {
            assert!(
                waited.elapsed() < Duration::from_secs(120),
                "waited 120 s for librbd on the host to take the image's lock"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        owner.stop();
        let stopped = Instant::now();
        let staged = mount(w, &mut node, &live, &live_ctx, 0)
            .await
            .expect("stage of an image whose dead owner's watch is still there");
        eprintln!(
            "{test}: re-map of an image whose dead owner still watches it: {} ({} after the \
             owner stopped; the OSDs' watch timeout is 30 s)",
            ms(staged),
            ms(stopped.elapsed())
        );
        assert_eq!(
            w.ceph.watcher_hosts(&live.image),
            vec![format!("{}.95", lab.net)],
            "the guest's client alone holds the image"
        );
        drop(owner);
        unmount(&lab, &mut node, &live, 0).await;
        detach(w, &mut ctl, &live, 0).await;
        delete(w, &mut ctl, &live).await;

        for v in vols {
            unmount(&lab, &mut node, v, 0).await;
            detach(w, &mut ctl, v, 0).await;
        }
        assert!(lab.mappings(0).is_empty(), "{:?}", lab.mappings(0));
        for v in vols {
            delete(w, &mut ctl, v).await;
        }
    });
    lab.vms.clear();
}
