//! The kernel attacher against a fake sysfs: its control files are FIFOs that a test thread
//! reads as the kernel would (so each request is seen byte for byte, and a kernel that does
//! not answer is one that nobody reads), and its devices are directories the test makes.

use std::io::Read as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use super::*;
use crate::attach::Credentials;

const KEY: &str = "AQBkQkNnAAAAABAAbm9vcmtleW5vb3JrZXlub29yaw==";
const MAJOR: u32 = 251;

struct FakeKernel {
    root: PathBuf,
    sysfs: PathBuf,
    dev: PathBuf,
}

impl Drop for FakeKernel {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

fn fifo(path: &Path) {
    rustix::fs::mknodat(
        rustix::fs::CWD,
        path,
        rustix::fs::FileType::Fifo,
        rustix::fs::Mode::from_raw_mode(0o600),
        0,
    )
    .expect("mkfifo");
}

impl FakeKernel {
    fn new(name: &str) -> Self {
        static N: AtomicU32 = AtomicU32::new(0);
        let root = std::env::temp_dir().join(format!(
            "moor-krbd-{name}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&root);
        let sysfs = root.join("sys/bus/rbd");
        let dev = root.join("dev");
        std::fs::create_dir_all(sysfs.join("devices")).unwrap();
        std::fs::create_dir_all(&dev).unwrap();
        fifo(&sysfs.join("add_single_major"));
        fifo(&sysfs.join("remove_single_major"));
        Self { root, sysfs, dev }
    }

    fn attacher(&self, map: Duration, unmap: Duration) -> KernelAttacher {
        KernelAttacher::new(&self.sysfs, &self.dev, Deadlines { map, unmap }).expect("attacher")
    }

    /// Reads the next request written to control file `name`, as the kernel would.
    fn take(&self, name: &str) -> String {
        let mut f = std::fs::File::open(self.sysfs.join(name)).unwrap();
        let mut s = String::new();
        f.read_to_string(&mut s).unwrap();
        s
    }

    /// Shows mapping `id` of `pool/image@snap`.
    fn add_device(&self, id: u32, pool: &str, image: &str, snap: &str, ro: bool) {
        let d = self.sysfs.join(format!("devices/{id}"));
        std::fs::create_dir_all(d.join(format!("block/rbd{id}"))).unwrap();
        for (f, v) in [
            ("pool", pool.to_string()),
            ("name", image.to_string()),
            ("current_snap", snap.to_string()),
            ("major", MAJOR.to_string()),
            ("minor", (id * 16).to_string()),
            ("pool_ns", String::new()),
        ] {
            std::fs::write(d.join(f), format!("{v}\n")).unwrap();
        }
        std::fs::write(
            d.join(format!("block/rbd{id}/ro")),
            if ro { "1\n" } else { "0\n" },
        )
        .unwrap();
    }

    /// Maps with `a` as `req` asks, answering as the kernel does: the request written to
    /// `add_single_major` is read, then mapping `id` of the image is shown (read-only as
    /// the request asks). The request as the kernel read it, and the map's outcome.
    fn answer_map(
        &self,
        a: &KernelAttacher,
        req: &MapRequest<'_>,
        id: u32,
    ) -> (String, Result<Mapping, AttachError>) {
        std::thread::scope(|s| {
            let h = s.spawn(|| a.map(req));
            let got = self.take("add_single_major");
            let image = req.image;
            self.add_device(id, &image.pool, &image.image, "-", req.read_only);
            (got, h.join().unwrap())
        })
    }

    fn remove_device(&self, id: u32) {
        std::fs::remove_dir_all(self.sysfs.join(format!("devices/{id}"))).unwrap();
    }
}

fn spec(pool: &str, image: &str) -> ImageSpec {
    ImageSpec {
        cluster_id: None,
        pool: pool.into(),
        image: image.into(),
    }
}

fn creds() -> Credentials {
    Credentials {
        user: "moor".into(),
        key: Secret::new(KEY),
    }
}

const SECS: Duration = Duration::from_secs(20);

/// A read-write map of a volume whose StorageClass sets exclusiveLock asks for the exclusive
/// lock, held (no hand-over to another node).
#[test]
fn a_map_writes_one_request_and_returns_the_device_it_made() {
    let k = FakeKernel::new("map");
    let a = k.attacher(SECS, SECS);
    // Another image already mapped: not the answer.
    k.add_device(0, "moor", "other", "-", false);
    let image = spec("moor", "csi-vol-1");
    let creds = creds();
    let req = MapRequest {
        image: &image,
        monitors: "10.0.0.1:6789,10.0.0.2:6789",
        credentials: &creds,
        read_only: false,
        exclusive: true,
    };
    let (got, m) = k.answer_map(&a, &req, 1);
    assert_eq!(
        got,
        format!(
            "10.0.0.1:6789,10.0.0.2:6789 name=moor,secret={KEY},exclusive,\
             mount_timeout=20 moor csi-vol-1"
        )
    );
    let m = m.unwrap();
    assert_eq!(m.device, k.dev.join("rbd1"));
    assert_eq!(m.rdev, (MAJOR, 16));
    assert!(!m.read_only);
    assert_eq!(a.find(&image).unwrap().unwrap().device, k.dev.join("rbd1"));
}

#[test]
fn a_read_only_map_asks_the_kernel_for_ro() {
    let k = FakeKernel::new("ro");
    let a = k.attacher(SECS, SECS);
    let image = spec("moor", "img");
    let creds = creds();
    let req = MapRequest {
        image: &image,
        monitors: "10.0.0.1",
        credentials: &creds,
        read_only: true,
        exclusive: false,
    };
    let (got, m) = k.answer_map(&a, &req, 0);
    assert_eq!(
        got,
        format!("10.0.0.1:6789 name=moor,secret={KEY},ro,mount_timeout=20 moor img")
    );
    assert!(m.unwrap().read_only);
}

#[test]
fn only_the_head_of_the_image_outside_namespaces_is_found() {
    let k = FakeKernel::new("find");
    let a = k.attacher(SECS, SECS);
    let image = spec("moor", "img");
    k.add_device(0, "moor", "img", "snap1", true);
    k.add_device(1, "other", "img", "-", false);
    k.add_device(2, "moor", "img", "-", false);
    std::fs::write(k.sysfs.join("devices/2/pool_ns"), "tenant\n").unwrap();
    k.add_device(3, "moor", "img2", "-", false);
    assert_eq!(a.find(&image).unwrap(), None);
    k.add_device(4, "moor", "img", "-", false);
    let m = a.find(&image).unwrap().unwrap();
    assert_eq!((m.device, m.rdev), (k.dev.join("rbd4"), (MAJOR, 64)));
    // The identity check: the held device's number against sysfs.
    a.verify(&image, (MAJOR, 64)).unwrap();
    assert!(a.verify(&image, (MAJOR, 48)).is_err());
    assert!(a.verify(&spec("moor", "img2"), (MAJOR, 64)).is_err());
    // Every mapping of an image head is listed, and none is taken for moor's.
    assert_eq!(a.list().unwrap().len(), 3);
    assert!(!a.owns_all_listed());
}

/// The attribute files of mapping `id` opened since the watch began, by name (inotify's
/// IN_OPEN on its directory; `block/rbd<id>/ro` is one level down and not counted). Closes
/// are watched too: inotify merges an event with the one queued before it when they are the
/// same, so two opens of one file in a row would count once.
struct Opens {
    watch: rustix::fd::OwnedFd,
}

impl Opens {
    fn watch(k: &FakeKernel, id: u32) -> Self {
        use rustix::fs::inotify;
        let watch =
            inotify::init(inotify::CreateFlags::NONBLOCK | inotify::CreateFlags::CLOEXEC).unwrap();
        inotify::add_watch(
            &watch,
            k.sysfs.join(format!("devices/{id}")),
            inotify::WatchFlags::OPEN | inotify::WatchFlags::CLOSE_NOWRITE,
        )
        .unwrap();
        Self { watch }
    }

    fn take(&self) -> Vec<String> {
        let mut buf = [std::mem::MaybeUninit::uninit(); 4096];
        let mut events = rustix::fs::inotify::Reader::new(&self.watch, &mut buf);
        let mut names = Vec::new();
        loop {
            match events.next() {
                Ok(e) => {
                    if let Some(n) = e.file_name()
                        && e.events().contains(rustix::fs::inotify::ReadFlags::OPEN)
                    {
                        names.push(n.to_string_lossy().into_owned());
                    }
                }
                Err(rustix::io::Errno::AGAIN) => break,
                Err(e) => panic!("inotify: {e}"),
            }
        }
        names.sort();
        names
    }
}

/// In a storm every map looks its image up among every mapping on the node, four times per
/// stage (find, the map's before and after, verify): another image's mapping costs one read
/// of its `name` per lookup, not its seven attributes.
#[test]
fn a_lookup_reads_only_the_name_of_another_images_mapping() {
    let k = FakeKernel::new("lookup");
    let a = k.attacher(SECS, SECS);
    k.add_device(0, "moor", "other", "-", false);
    // The same name in another pool: its pool is read too, nothing more.
    k.add_device(1, "elsewhere", "csi-vol-1", "-", false);
    let (other, same_name) = (Opens::watch(&k, 0), Opens::watch(&k, 1));
    let image = spec("moor", "csi-vol-1");
    let creds = creds();
    assert_eq!(a.find(&image).unwrap(), None);
    let req = MapRequest {
        image: &image,
        monitors: "10.0.0.1",
        credentials: &creds,
        read_only: false,
        exclusive: false,
    };
    k.answer_map(&a, &req, 2).1.unwrap();
    a.verify(&image, (MAJOR, 32)).unwrap();
    // find, the map's lookup before its write and at least one after, verify.
    let lookups = other.take();
    assert!(lookups.len() >= 4, "{lookups:?}");
    assert!(
        lookups.iter().all(|n| n == "name"),
        "another image's mapping: only its name is read, got {lookups:?}"
    );
    let same = same_name.take();
    assert!(
        same.iter().all(|n| n == "name" || n == "pool"),
        "a mapping of the same name in another pool: its name and pool, got {same:?}"
    );
    // Listing every mapping still reads them whole.
    assert_eq!(a.list().unwrap().len(), 3);
    assert!(other.take().contains(&"major".to_string()));
}

#[test]
fn an_unmap_writes_the_id_and_an_unmapped_image_writes_nothing() {
    let k = FakeKernel::new("unmap");
    let a = k.attacher(SECS, Duration::from_millis(300));
    let image = spec("moor", "img");
    // Nothing mapped: nothing written (a write would find no reader and miss its deadline).
    a.unmap(&image).unwrap();
    k.add_device(7, "moor", "img", "-", false);
    std::thread::scope(|s| {
        let h = s.spawn(|| a.unmap(&image));
        assert_eq!(k.take("remove_single_major"), "7");
        k.remove_device(7);
        h.join().unwrap().unwrap();
    });
    assert_eq!(a.find(&image).unwrap(), None);
}

#[test]
fn a_map_past_its_deadline_blocks_every_other_map_of_the_image_until_the_kernel_answers() {
    let k = FakeKernel::new("deadline");
    let a = k.attacher(Duration::from_millis(200), SECS);
    let image = spec("moor", "img");
    let creds = creds();
    let req = MapRequest {
        image: &image,
        monitors: "10.0.0.1",
        credentials: &creds,
        read_only: false,
        exclusive: true,
    };
    // Nobody reads the request: the kernel is stuck talking to the cluster.
    let e = a.map(&req).unwrap_err();
    assert_eq!(e.code(), tonic::Code::DeadlineExceeded, "{e}");
    assert!(e.may_have_mapped());
    assert!(a.in_flight(&image));
    let again = a.map(&req).unwrap_err();
    assert_eq!(again.code(), tonic::Code::Aborted, "{again}");
    assert!(
        matches!(a.unmap(&image), Ok(())),
        "nothing shows mapped yet"
    );
    // The kernel answers late: the mapping appears, and the image is free again.
    assert!(k.take("add_single_major").contains(" moor img"));
    k.add_device(0, "moor", "img", "-", false);
    // The attacher's thread sees it on its next look: a bound on a hang, not on its speed.
    let start = std::time::Instant::now();
    while a.in_flight(&image) && start.elapsed() < Duration::from_secs(120) {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(!a.in_flight(&image), "still in flight after 120 s");
    // What a retry finds first: the late mapping, reused instead of mapped twice.
    assert_eq!(a.find(&image).unwrap().unwrap().device, k.dev.join("rbd0"));
}

#[test]
fn the_key_is_in_no_error_and_no_debug_output() {
    let k = FakeKernel::new("secret");
    // A control file the kernel refuses (here: cannot be opened for writing).
    std::fs::remove_file(k.sysfs.join("add_single_major")).unwrap();
    std::fs::create_dir(k.sysfs.join("add_single_major")).unwrap();
    let a = k.attacher(SECS, SECS);
    let image = spec("moor", "img");
    let creds = creds();
    let req = MapRequest {
        image: &image,
        monitors: "10.0.0.1",
        credentials: &creds,
        read_only: false,
        exclusive: true,
    };
    let e = a.map(&req).unwrap_err();
    assert_eq!(e.code(), tonic::Code::Internal);
    for text in [
        e.to_string(),
        format!("{e:?}"),
        format!("{req:?}"),
        format!(
            "{:?}",
            add_request(&req, &kernel_monitors(req.monitors).unwrap(), SECS)
        ),
        format!("{a:?}"),
    ] {
        assert!(!text.contains(KEY), "{text}");
        assert!(!text.contains("AQBk"), "{text}");
    }
    assert!(!a.in_flight(&image));
}

#[test]
fn what_the_kernel_answers_maps_to_codes_kubelet_acts_on() {
    let image = spec("moor", "img");
    let err = |n| io::Error::from_raw_os_error(n);
    assert_eq!(
        write_error("unmap", &image, &err(libc::EBUSY)).code(),
        tonic::Code::FailedPrecondition
    );
    assert_eq!(
        write_error("map", &image, &err(libc::ENOENT)).code(),
        tonic::Code::NotFound
    );
    let denied = write_error("map", &image, &err(libc::EACCES));
    assert_eq!(denied.code(), tonic::Code::Internal);
    assert!(denied.to_string().contains("refused"), "{denied}");
    // ceph-csi #5150: a map after a reboot must blocklist the dead client holding the lock.
    assert!(denied.to_string().contains("mon 'profile rbd'"), "{denied}");
    let unmap = write_error("unmap", &image, &err(libc::EACCES)).to_string();
    assert!(!unmap.contains("blocklisted"), "{unmap}");
}

#[test]
fn without_the_rbd_module_there_is_no_kernel_attacher() {
    let k = FakeKernel::new("absent");
    let deadlines = Deadlines {
        map: SECS,
        unmap: SECS,
    };
    assert!(KernelAttacher::new(k.root.join("nothing"), &k.dev, deadlines).is_none());
    // A module without single_major: the plain control files.
    std::fs::remove_file(k.sysfs.join("add_single_major")).unwrap();
    std::fs::remove_file(k.sysfs.join("remove_single_major")).unwrap();
    std::fs::write(k.sysfs.join("add"), "").unwrap();
    let a = KernelAttacher::new(&k.sysfs, &k.dev, deadlines).unwrap();
    assert_eq!(a.control("add"), k.sysfs.join("add"));
    assert_eq!(a.control("remove"), k.sysfs.join("remove"));
}

/// Monitors as docs write them (`ip:6789`), as `ceph mon dump` shows them first (`ip:3300`,
/// msgr2, which the kernel speaks only when `ms_mode` asks), with `v1:`/`v2:`, without a port,
/// by name: each becomes what the kernel client can reach.
#[test]
fn monitors_are_given_to_the_kernel_in_the_protocol_their_ports_speak() {
    let km = |l: &str| kernel_monitors(l).unwrap_or_else(|e| panic!("{l}: {e}"));
    let v1 = |a: &str| KernelMonitors {
        addrs: a.into(),
        ms_mode: None,
    };
    let v2 = |a: &str| KernelMonitors {
        addrs: a.into(),
        ms_mode: Some("prefer-crc"),
    };
    assert_eq!(
        km("10.0.0.1:6789,10.0.0.2:6789"),
        v1("10.0.0.1:6789,10.0.0.2:6789")
    );
    assert_eq!(km("10.0.0.1"), v1("10.0.0.1:6789"));
    assert_eq!(km("v1:10.0.0.1"), v1("10.0.0.1:6789"));
    assert_eq!(km("10.0.0.1:6790"), v1("10.0.0.1:6790"));
    assert_eq!(
        km("10.0.0.1:3300,10.0.0.2:3300"),
        v2("10.0.0.1:3300,10.0.0.2:3300")
    );
    assert_eq!(km("v2:10.0.0.1"), v2("10.0.0.1:3300"));
    assert_eq!(
        km("10.0.0.1:3300,10.0.0.2"),
        v2("10.0.0.1:3300,10.0.0.2:3300")
    );
    assert_eq!(km("[fd00::1]:3300"), v2("[fd00::1]:3300"));
    assert_eq!(km("[fd00::1]"), v1("[fd00::1]:6789"));
    assert_eq!(km("localhost:6789"), v1("127.0.0.1:6789"));
    for bad in ["10.0.0.1:3300,10.0.0.2:6789", "v2:10.0.0.1,v1:10.0.0.2"] {
        let e = kernel_monitors(bad).unwrap_err();
        assert!(e.contains("mix msgr2"), "{bad}: {e}");
    }
    assert!(kernel_monitors("10.0.0.1:http").is_err());
    assert!(kernel_monitors("[fd00::1:3300").is_err());
    assert!(kernel_monitors("no-such-host.invalid").is_err());
}

/// A msgr2 list maps with `ms_mode`; a mixed one is refused with INVALID_ARGUMENT and writes
/// nothing to the kernel (nobody reads the control file: a write would hang the test).
#[test]
fn a_msgr2_map_asks_for_ms_mode_and_a_mixed_list_is_refused_before_the_kernel_sees_it() {
    let k = FakeKernel::new("msgr2");
    let a = k.attacher(SECS, SECS);
    let image = spec("moor", "img");
    let creds = creds();
    let mixed = a
        .map(&MapRequest {
            image: &image,
            monitors: "10.0.0.1:3300,10.0.0.2:6789",
            credentials: &creds,
            read_only: false,
            exclusive: true,
        })
        .unwrap_err();
    assert_eq!(mixed.code(), tonic::Code::InvalidArgument, "{mixed}");
    assert!(!mixed.may_have_mapped());
    assert!(!a.in_flight(&image));
    let req = MapRequest {
        image: &image,
        monitors: "10.0.0.1:3300",
        credentials: &creds,
        read_only: false,
        exclusive: true,
    };
    let (got, m) = k.answer_map(&a, &req, 0);
    assert_eq!(
        got,
        format!(
            "10.0.0.1:3300 name=moor,secret={KEY},exclusive,ms_mode=prefer-crc,\
             mount_timeout=20 moor img"
        )
    );
    m.unwrap();
}

/// Without exclusiveLock a read-write map leaves the lock to the kernel's cooperative
/// hand-over (so the controller can grow the image while it is mapped).
#[test]
fn a_map_without_exclusive_lock_asks_for_no_exclusive() {
    let k = FakeKernel::new("coop");
    let a = k.attacher(SECS, SECS);
    let image = spec("moor", "img");
    let creds = creds();
    let req = MapRequest {
        image: &image,
        monitors: "10.0.0.1:6789",
        credentials: &creds,
        read_only: false,
        exclusive: false,
    };
    let (got, m) = k.answer_map(&a, &req, 0);
    assert_eq!(
        got,
        format!("10.0.0.1:6789 name=moor,secret={KEY},mount_timeout=20 moor img")
    );
    m.unwrap();
}
