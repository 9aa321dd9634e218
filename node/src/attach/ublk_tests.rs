//! The ublk attacher against a fake moor-ublk: a shell script over a fake driver (a dir with a
//! file per device holding its server's pid: live while that process is, quiesced once it is
//! gone) and fake `/dev` and `/sys/block` dirs. Each call of the script is recorded with the
//! key its `--keyfile` held.

use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use super::*;
use crate::attach::Credentials;

const KEY: &str = "AQBkQkNnAAAAABAAbm9vcmtleW5vb3JrZXlub29yaw==";

struct FakeUblk {
    root: PathBuf,
    attacher: UblkAttacher,
}

impl Drop for FakeUblk {
    fn drop(&mut self) {
        // Every server still running ends with the test.
        for pid in self.servers() {
            kill(pid);
        }
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

const SCRIPT: &str = r#"#!/bin/sh
R="$(dirname "$0")"
cmd=$1; shift
key=; dev=; image=; fence=
while [ $# -gt 0 ]; do
  case $1 in
    --fence) fence=" fence=$2"; shift 2 ;;
    --keyfile) key=$(cat "$2"); shift 2 ;;
    --dev) dev=$2; shift 2 ;;
    --image) image=$2; shift 2 ;;
    *) shift ;;
  esac
done
echo "$cmd dev=$dev image=$image key=$key$fence" >> "$R/calls"
state() {
  if [ ! -e "$R/driver/$1" ]; then echo gone
  elif kill -0 "$(cat "$R/driver/$1")" 2>/dev/null; then echo live
  else echo quiesced; fi
}
case $cmd in
  add)
    if [ "$image" = missing ]; then
      echo "moor-ublk: open image: No such file or directory (errno 2)" >&2; exit 1
    fi
    n=0; while [ -e "$R/driver/$n" ]; do n=$((n+1)); done
    echo $$ > "$R/driver/$n"
    mkdir -p "$R/sys/ublkb$n"; echo "259:$n" > "$R/sys/ublkb$n/dev"; : > "$R/dev/ublkb$n"
    echo "dev $n $R/dev/ublkb$n client.$$"
    exec sleep 100000 ;;
  recover)
    [ "$(state "$dev")" = quiesced ] || { echo "moor-ublk: recover: busy" >&2; exit 1; }
    echo $$ > "$R/driver/$dev"
    echo "dev $dev $R/dev/ublkb$dev client.$$"
    exec sleep 100000 ;;
  info)
    echo "dev $dev state $(state "$dev")" ;;
  delete)
    [ -e "$R/driver/$dev" ] || { echo "moor-ublk: No such device" >&2; exit 1; }
    kill "$(cat "$R/driver/$dev")" 2>/dev/null
    rm -rf "$R/driver/$dev" "$R/sys/ublkb$dev" "$R/dev/ublkb$dev" ;;
esac
"#;

impl FakeUblk {
    fn new(name: &str) -> Self {
        static N: AtomicU32 = AtomicU32::new(0);
        let root = std::env::temp_dir().join(format!(
            "moor-ublk-{name}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&root);
        for d in ["driver", "sys", "dev"] {
            std::fs::create_dir_all(root.join(d)).unwrap();
        }
        let program = root.join("moor-ublk");
        std::fs::write(&program, SCRIPT).unwrap();
        std::fs::set_permissions(&program, std::fs::Permissions::from_mode(0o755)).unwrap();
        let attacher = UblkAttacher::with_paths(
            &root.join("state"),
            &program.display().to_string(),
            &root.join("dev"),
            &root.join("sys"),
            Deadlines {
                map: Duration::from_secs(60),
                unmap: Duration::from_secs(30),
            },
        )
        .expect("attacher");
        Self { root, attacher }
    }

    /// The script's calls: `<cmd> dev=N image=I key=K`.
    fn calls(&self) -> Vec<String> {
        std::fs::read_to_string(self.root.join("calls"))
            .unwrap_or_default()
            .lines()
            .map(str::to_string)
            .collect()
    }

    /// The servers' pids, by device.
    fn servers(&self) -> Vec<u32> {
        std::fs::read_dir(self.root.join("driver"))
            .map(|d| {
                d.flatten()
                    .filter_map(|e| std::fs::read_to_string(e.path()).ok())
                    .filter_map(|p| p.trim().parse().ok())
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Device `dev`'s server.
    fn server(&self, dev: u32) -> u32 {
        std::fs::read_to_string(self.root.join(format!("driver/{dev}")))
            .unwrap()
            .trim()
            .parse()
            .unwrap()
    }

    /// Kills device `dev`'s server and waits until it is gone (reaped by the attacher's
    /// thread), as the driver sees it: quiesced.
    fn kill_server(&self, dev: u32) {
        let pid = self.server(dev);
        kill(pid);
        wait_gone(pid, "SIGKILL");
    }

    /// What is left in the attacher's state dir.
    fn state_files(&self) -> Vec<std::ffi::OsString> {
        std::fs::read_dir(self.root.join("state"))
            .unwrap()
            .flatten()
            .map(|e| e.file_name())
            .collect()
    }
}

/// Waits until process `pid` is gone (reaped by the attacher's thread), after `what`.
fn wait_gone(pid: u32, what: &str) {
    let start = std::time::Instant::now();
    while Path::new(&format!("/proc/{pid}")).exists() {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "server {pid} still there a minute after {what}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn spec(image: &str) -> ImageSpec {
    ImageSpec {
        cluster_id: None,
        pool: "moor".into(),
        image: image.into(),
    }
}

fn map(f: &FakeUblk, image: &ImageSpec, read_only: bool) -> Result<Mapping, AttachError> {
    let creds = Credentials {
        user: "moor".into(),
        key: crate::attach::Secret::new(KEY),
    };
    f.attacher.map(&MapRequest {
        image,
        monitors: "10.0.0.1:6789",
        credentials: &creds,
        read_only,
        exclusive: false,
    })
}

#[test]
fn a_map_serves_the_image_and_keeps_what_a_new_server_needs() {
    let f = FakeUblk::new("map");
    let image = spec("csi-vol-1");
    let m = map(&f, &image, false).expect("map");
    assert_eq!(m.device, f.root.join("dev/ublkb0"));
    assert_eq!(m.rdev, (259, 0));
    assert_eq!(f.attacher.find(&image).unwrap(), Some(m.clone()));
    f.attacher.verify(&image, (259, 0)).expect("verify");
    assert!(f.attacher.verify(&image, (259, 1)).is_err());
    assert_eq!(f.calls(), [format!("add dev= image=csi-vol-1 key={KEY}")]);
    // The key stays for the next server, readable by root alone.
    let key = f.root.join("state/.moor+csi-vol-1.key");
    assert_eq!(std::fs::read_to_string(&key).unwrap(), KEY);
    let mode = std::fs::metadata(&key).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600);
    assert_eq!(
        f.attacher.list().unwrap(),
        [(image.clone(), Some(m.device.clone()))]
    );
    // Mapped again: the same device, no second server.
    assert_eq!(map(&f, &image, false).unwrap(), m);
    assert_eq!(f.calls().iter().filter(|c| c.starts_with("add")).count(), 1);
    // A live server is left alone.
    assert!(!f.attacher.recover(&image).unwrap());
}

#[test]
fn a_device_whose_server_died_is_taken_over_with_the_same_number_and_key() {
    let f = FakeUblk::new("recover");
    let image = spec("csi-vol-1");
    let m = map(&f, &image, false).expect("map");
    let other = map(&f, &spec("csi-vol-2"), false).expect("map another");
    let first = f.server(0);
    f.kill_server(0);
    assert_eq!(f.attacher.state(&image, 0).unwrap(), DevState::Quiesced);
    // Still the image's mapping while it waits: its mounts stay.
    assert_eq!(f.attacher.find(&image).unwrap(), Some(m.clone()));
    assert!(f.attacher.recover(&image).expect("recover"));
    assert_eq!(f.attacher.state(&image, 0).unwrap(), DevState::Live);
    assert!(
        f.calls().contains(&format!(
            "recover dev=0 image=csi-vol-1 key={KEY} fence=client.{first}"
        )),
        "{:?}",
        f.calls()
    );
    assert_eq!(f.attacher.find(&image).unwrap(), Some(m));
    // The next recovery fences the new server's client.
    let second = f.server(0);
    f.kill_server(0);
    assert!(f.attacher.recover(&image).expect("recover again"));
    assert!(
        f.calls().contains(&format!(
            "recover dev=0 image=csi-vol-1 key={KEY} fence=client.{second}"
        )),
        "{:?}",
        f.calls()
    );
    // The other image's server lives: nothing to do.
    assert!(!f.attacher.recover(&spec("csi-vol-2")).unwrap());
    assert_eq!(other.device, f.root.join("dev/ublkb1"));
    assert_eq!(
        f.calls()
            .iter()
            .filter(|c| c.starts_with("recover"))
            .count(),
        2
    );
}

#[test]
fn an_unmap_deletes_the_device_and_leaves_nothing() {
    let f = FakeUblk::new("unmap");
    let image = spec("csi-vol-1");
    map(&f, &image, false).expect("map");
    let server = f.servers()[0];
    f.attacher.unmap(&image).expect("unmap");
    assert!(f.calls().contains(&"delete dev=0 image= key=".to_string()));
    assert_eq!(f.attacher.find(&image).unwrap(), None);
    assert!(f.attacher.list().unwrap().is_empty());
    assert!(f.servers().is_empty());
    wait_gone(server, "its device's delete");
    assert_eq!(f.state_files(), Vec::<std::ffi::OsString>::new());
    // Unmapped again: done.
    f.attacher.unmap(&image).expect("unmap again");
    // A device gone with a reboot is dropped without a delete.
    map(&f, &image, false).expect("map");
    std::fs::remove_file(f.root.join("driver/0")).unwrap();
    f.attacher.unmap(&image).expect("unmap after a reboot");
    assert_eq!(
        f.calls().iter().filter(|c| c.starts_with("delete")).count(),
        1
    );
}

#[test]
fn a_missing_image_is_not_found_and_a_read_only_map_unsupported() {
    let f = FakeUblk::new("missing");
    let err = map(&f, &spec("missing"), false).unwrap_err();
    assert!(matches!(err, AttachError::NotFound(_)), "{err:?}");
    assert_eq!(f.state_files(), Vec::<std::ffi::OsString>::new());
    let err = map(&f, &spec("csi-vol-1"), true).unwrap_err();
    assert_eq!(err.code(), tonic::Code::FailedPrecondition, "{err:?}");
    assert!(f.servers().is_empty());
}
