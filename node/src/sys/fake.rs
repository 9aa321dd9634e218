//! A recording fake of [`Os`]: an in-memory model of directories, files, block devices and
//! the mount table, good enough for the engine's logic to be tested without root.
//!
//! One file, over the usual length: it is one model (every method reads and changes the same
//! state under one lock), and splitting it would scatter that state's invariants.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use super::mount_table::MountEntry;
use super::{
    BackingFs, BackingStore, BindMount, BlockDevice, FsMount, FsUsage, GroupReport, Held,
    HeldDevice, MountPoint, MountState, Os, OwnershipError, SysError, SysResult, ToolError,
    ToolRun,
};
use crate::sys::discovery::{
    self, BackingFile, DeviceFacts, DeviceIdentity, DiscoveryError, EventSource, FoundDevice,
    Verdict,
};

/// One call made to the fake, for assertions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Call {
    /// `mount_fs`.
    MountFs(FsMount),
    /// `bind`.
    Bind(BindMount),
    /// `unmount(target, detach)`.
    Unmount(PathBuf, bool),
    /// `make_dir`.
    MakeDir(PathBuf),
    /// `make_file`.
    MakeFile(PathBuf),
    /// `remove`.
    Remove(PathBuf),
    /// `run_tool`: program and arguments.
    Tool(String, Vec<String>),
    /// `share_with_group(path, gid)`.
    ShareWithGroup(PathBuf, u32),
    /// `find_device(identity, wait)`.
    FindDevice(DeviceIdentity, Duration),
    /// `write_cgroup(path, line)`.
    WriteCgroup(PathBuf, String),
}

#[derive(Debug, Clone)]
struct FakeMount {
    id: u64,
    dev: (u32, u32),
    rdev: Option<(u32, u32)>,
    read_only: bool,
    is_dir: bool,
    source: PathBuf,
}

#[derive(Debug, Clone)]
struct FakeDevice {
    rdev: (u32, u32),
    size: u64,
    /// Written extents: offset -> bytes. Everything else reads as zero.
    data: BTreeMap<u64, Vec<u8>>,
}

/// A LUKS volume cryptsetup made on a fake device: the key that opens it, and what its
/// mapping held when it was last closed.
#[derive(Debug, Clone)]
struct FakeLuks {
    /// The passphrases of its key slots, by slot (a fake's: it models the checks, nothing
    /// else).
    slots: BTreeMap<u32, Vec<u8>>,
    /// The mapping's written extents.
    data: BTreeMap<u64, Vec<u8>>,
}

impl FakeLuks {
    /// Whether some key slot opens with `key`.
    fn opens(&self, key: &[u8]) -> bool {
        self.slots.values().any(|k| k == key)
    }
}

/// The device-mapper major number of the fake's mappings.
pub const FAKE_DM_MAJOR: u32 = 253;

/// What a fake LUKS header takes of its device: the mapping is this much smaller.
pub const FAKE_LUKS_HEADER: u64 = 16 << 20;

/// A device that appears while a `find_device` waits (as if announced by an event).
#[derive(Debug, Clone)]
struct Arrival {
    path: PathBuf,
    rdev: (u32, u32),
    size: u64,
    backing: PathBuf,
}

#[derive(Debug, Default)]
struct State {
    dirs: BTreeSet<PathBuf>,
    files: BTreeSet<PathBuf>,
    devices: HashMap<PathBuf, FakeDevice>,
    mounts: HashMap<PathBuf, Vec<FakeMount>>,
    corrupted: HashMap<PathBuf, i32>,
    failures: HashMap<&'static str, i32>,
    tool_failures: HashMap<String, i32>,
    /// A crash of a later run of a program: (program, runs left before it, whether that run
    /// does its work before it fails).
    tool_crash: Option<(String, u32, bool)>,
    missing_programs: BTreeSet<String>,
    backing: HashMap<(u32, u32), PathBuf>,
    deleted_backing: BTreeSet<(u32, u32)>,
    backing_fs: HashMap<PathBuf, BackingFs>,
    serials: HashMap<(u32, u32), String>,
    fs_errors: HashMap<(u32, u32), u64>,
    arrivals: Vec<Arrival>,
    selinux: bool,
    unknown_labels: Vec<String>,
    /// cgroupfs control files and their text, as the kernel would show them.
    cgroup: BTreeMap<PathBuf, String>,
    next_mount_id: u64,
    /// LUKS volumes by their device.
    luks: HashMap<PathBuf, FakeLuks>,
    /// Open mappings: name -> the LUKS device under it.
    mappings: BTreeMap<String, PathBuf>,
    next_dm_minor: u32,
    calls: Vec<Call>,
    /// The cgroup control files read, in order (reads are not [`Call`]s: they change nothing).
    cgroup_reads: Vec<PathBuf>,
    /// The paths resolved from the kubelet dir, in order: each one an `openat2` on the real
    /// OS (what a held object spares).
    resolutions: Vec<PathBuf>,
    /// A mount to replace right after it is next checked and held: (path, the new mount's
    /// device).
    swap_after_check: Option<(PathBuf, (u32, u32))>,
    /// The directories held as parents ([`Os::hold_parent`]), by the path each was held at:
    /// where it is now (a rename moves it, as it moves a descriptor's directory).
    held_dirs: HashMap<PathBuf, PathBuf>,
    /// Renames made right after the directory at a path is next held as a parent: (that
    /// path, each rename's (from, to) in turn).
    renames_after_hold: Option<(PathBuf, Vec<(PathBuf, PathBuf)>)>,
}

/// The fake OS. Cheap to build; every test makes its own.
#[derive(Debug, Default)]
pub struct FakeOs {
    state: Mutex<State>,
}

fn err(step: &'static str, path: &Path, errno: i32) -> SysError {
    SysError::new(step, path, std::io::Error::from_raw_os_error(errno))
}

impl FakeOs {
    /// A fake with `/` only.
    pub fn new() -> Self {
        let fake = Self::default();
        fake.lock().dirs.insert(PathBuf::from("/"));
        fake
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Adds a cgroup control file holding `text` (an empty rule list: "").
    pub fn add_cgroup_file(&self, path: impl AsRef<Path>, text: &str) {
        self.lock()
            .cgroup
            .insert(path.as_ref().to_path_buf(), text.to_string());
    }

    /// The text of a cgroup control file, if there is one.
    pub fn cgroup_file(&self, path: impl AsRef<Path>) -> Option<String> {
        self.lock().cgroup.get(path.as_ref()).cloned()
    }

    /// Removes every cgroup file under `dir` (the pod's cgroup died with it).
    pub fn remove_cgroup(&self, dir: impl AsRef<Path>) {
        self.lock()
            .cgroup
            .retain(|p, _| !p.starts_with(dir.as_ref()));
    }

    /// The open LUKS mappings: name -> the device under it.
    pub fn luks_mappings(&self) -> BTreeMap<String, PathBuf> {
        self.lock().mappings.clone()
    }

    /// Whether the key `key` opens the LUKS volume on `device`.
    pub fn luks_opens_with(&self, device: impl AsRef<Path>, key: &[u8]) -> bool {
        self.lock()
            .luks
            .get(device.as_ref())
            .is_some_and(|l| l.opens(key))
    }

    /// Makes `device` a LUKS2 volume whose header has no key slot yet, of UUID `uuid`: what
    /// `cryptsetup luksFormat` leaves when it is cut before its first key slot.
    pub fn luks_format_without_key_slot(&self, device: impl AsRef<Path>, uuid: &str) {
        let device = device.as_ref().to_path_buf();
        let mut st = self.lock();
        let Some(d) = st.devices.get_mut(&device) else {
            return;
        };
        d.data.clear();
        d.data
            .insert(0, fake_luks2_header(Some(uuid), std::iter::empty()));
        st.luks.insert(
            device,
            FakeLuks {
                slots: BTreeMap::new(),
                data: BTreeMap::new(),
            },
        );
    }

    /// The key slots of the LUKS volume on `device` and the key each opens with.
    pub fn luks_slots(&self, device: impl AsRef<Path>) -> BTreeMap<u32, Vec<u8>> {
        self.lock()
            .luks
            .get(device.as_ref())
            .map(|l| l.slots.clone())
            .unwrap_or_default()
    }

    /// Drops every mapping, as a reboot does (what they held stays in their LUKS volumes).
    pub fn close_all_mappings(&self) {
        let mut st = self.lock();
        for (name, _) in std::mem::take(&mut st.mappings) {
            st.devices.remove(&mapper_path(&name));
        }
    }

    /// Creates a directory and all its parents.
    pub fn add_dir(&self, path: impl AsRef<Path>) {
        let mut st = self.lock();
        for p in path.as_ref().ancestors() {
            st.dirs.insert(p.to_path_buf());
        }
    }

    /// Adds a blank block device of `size` bytes with device number `rdev`.
    pub fn add_device(&self, path: impl AsRef<Path>, rdev: (u32, u32), size: u64) {
        let dev = FakeDevice {
            rdev,
            size,
            data: BTreeMap::new(),
        };
        self.lock().devices.insert(path.as_ref().to_path_buf(), dev);
    }

    /// Writes bytes onto a fake device.
    pub fn write_device(&self, path: impl AsRef<Path>, offset: u64, bytes: &[u8]) {
        if let Some(d) = self.lock().devices.get_mut(path.as_ref()) {
            d.data.insert(offset, bytes.to_vec());
        }
    }

    /// What has been written to a fake device: (offset, bytes) extents.
    pub fn device_data(&self, path: impl AsRef<Path>) -> Vec<(u64, Vec<u8>)> {
        self.lock()
            .devices
            .get(path.as_ref())
            .map(|d| d.data.iter().map(|(o, b)| (*o, b.clone())).collect())
            .unwrap_or_default()
    }

    /// Resizes a fake device.
    pub fn resize_device(&self, path: impl AsRef<Path>, size: u64) {
        if let Some(d) = self.lock().devices.get_mut(path.as_ref()) {
            d.size = size;
        }
    }

    /// Removes a fake device (it "vanished").
    pub fn remove_device(&self, path: impl AsRef<Path>) {
        self.lock().devices.remove(path.as_ref());
    }

    /// Makes every access to `path` fail with `errno`, as a dead FUSE mount does.
    pub fn corrupt(&self, path: impl AsRef<Path>, errno: i32) {
        self.lock()
            .corrupted
            .insert(path.as_ref().to_path_buf(), errno);
    }

    /// Makes the next call of operation `op` ("mount_fs", "bind", "unmount", "mkdir", "tool",
    /// "share", ...) fail with `errno`; "share_deadline" makes the next `share_with_group` run
    /// past its deadline.
    pub fn fail_next(&self, op: &'static str, errno: i32) {
        self.lock().failures.insert(op, errno);
    }

    /// Makes the next run of `program` exit with `code`.
    pub fn fail_tool(&self, program: &str, code: i32) {
        self.lock().tool_failures.insert(program.to_owned(), code);
    }

    /// Cuts the run of `program` after `skip` more runs short, as a crash of the caller
    /// would: with `done`, the run does its work and then fails (the caller never learns it
    /// ran), else it fails before it does anything. The failure is no exit code a caller
    /// understands (signal 9's 137).
    pub fn crash_tool_at(&self, program: &str, skip: u32, done: bool) {
        self.lock().tool_crash = Some((program.to_owned(), skip, done));
    }

    /// Makes the device `rdev` a loop device backed by `file`.
    pub fn set_backing_file(&self, rdev: (u32, u32), file: impl AsRef<Path>) {
        self.lock()
            .backing
            .insert(rdev, file.as_ref().to_path_buf());
    }

    /// Makes the filesystem holding backing file `file` say `fs` (a file without one is on a
    /// healthy filesystem with room to spare).
    pub fn set_backing_fs(&self, file: impl AsRef<Path>, fs: BackingFs) {
        self.lock()
            .backing_fs
            .insert(file.as_ref().to_path_buf(), fs);
    }

    /// Marks the file behind loop device `rdev` as unlinked (the kernel's "(deleted)").
    pub fn set_backing_file_deleted(&self, rdev: (u32, u32)) {
        self.lock().deleted_backing.insert(rdev);
    }

    /// Gives the device `rdev` a serial number.
    pub fn set_serial(&self, rdev: (u32, u32), serial: &str) {
        self.lock().serials.insert(rdev, serial.to_string());
    }

    /// Makes the filesystem on device `rdev` fail as ext4 does on I/O errors: `errors`
    /// recorded, and every mount of it read-only when `read_only` (the kernel's remount).
    pub fn fail_filesystem(&self, rdev: (u32, u32), errors: u64, read_only: bool) {
        let mut st = self.lock();
        st.fs_errors.insert(rdev, errors);
        if read_only {
            for m in st.mounts.values_mut().flatten().filter(|m| m.dev == rdev) {
                m.read_only = true;
            }
        }
    }

    /// Queues a loop device (`path`, `rdev`, `size` bytes, backed by `backing`) that appears
    /// only once a `find_device` is waiting, as a device announced by an event does.
    pub fn attach_on_event(
        &self,
        path: impl AsRef<Path>,
        rdev: (u32, u32),
        size: u64,
        backing: impl AsRef<Path>,
    ) {
        self.lock().arrivals.push(Arrival {
            path: path.as_ref().to_path_buf(),
            rdev,
            size,
            backing: backing.as_ref().to_path_buf(),
        });
    }

    fn facts(st: &State, rdev: (u32, u32)) -> DeviceFacts {
        DeviceFacts {
            backing_file: st.backing.get(&rdev).map(|p| BackingFile {
                path: p.clone(),
                deleted: st.deleted_backing.contains(&rdev),
            }),
            serials: st.serials.get(&rdev).cloned().into_iter().collect(),
            wwns: Vec::new(),
        }
    }

    fn find_present(st: &State, want: &DeviceIdentity) -> Option<FoundDevice> {
        let mut devices: Vec<_> = st.devices.iter().collect();
        devices.sort_by(|a, b| a.0.cmp(b.0));
        devices.into_iter().find_map(|(path, d)| {
            (discovery::verdict(want, &Self::facts(st, d.rdev)) == Verdict::Match).then(|| {
                FoundDevice {
                    path: path.clone(),
                    rdev: d.rdev,
                }
            })
        })
    }

    /// Says whether the kernel has SELinux (a new fake has not).
    pub fn set_selinux(&self, present: bool) {
        self.lock().selinux = present;
    }

    /// Says the policy does not know `label` (a new fake's knows every label).
    pub fn set_label_unknown(&self, label: &str) {
        self.lock().unknown_labels.push(label.to_string());
    }

    /// Pretends a program is not installed.
    pub fn remove_program(&self, program: &str) {
        self.lock().missing_programs.insert(program.to_string());
    }

    /// Right after the mount at `path` is next checked and held ([`Os::mount_state_held`]),
    /// unmounts it and mounts a filesystem of device `dev` there instead, behind the
    /// engine's back: a remount between a check and the call that acts on what it checked.
    pub fn swap_mount_after_check(&self, path: impl AsRef<Path>, dev: (u32, u32)) {
        self.lock().swap_after_check = Some((path.as_ref().to_path_buf(), dev));
    }

    /// Right after the directory `dir` is next held as a parent ([`Os::hold_parent`]),
    /// renames each `(from, to)` in turn behind the engine's back, with everything below it
    /// and mounted in it: a directory swapped in at a path between the check of what is there
    /// and the call that acts on it.
    pub fn rename_after_hold(&self, dir: impl AsRef<Path>, renames: &[(&str, &str)]) {
        let renames = renames
            .iter()
            .map(|(from, to)| (PathBuf::from(from), PathBuf::from(to)))
            .collect();
        self.lock().renames_after_hold = Some((dir.as_ref().to_path_buf(), renames));
    }

    /// Unmounts behind the engine's back.
    pub fn force_unmount(&self, target: impl AsRef<Path>) {
        let mut st = self.lock();
        if let Some(stack) = st.mounts.get_mut(target.as_ref()) {
            stack.pop();
        }
    }

    /// The calls made so far.
    pub fn calls(&self) -> Vec<Call> {
        self.lock().calls.clone()
    }

    /// Calls that changed something (mounts, unmounts, mkdirs, removals, tools).
    pub fn mutations(&self) -> Vec<Call> {
        self.calls()
    }

    /// Forgets the calls recorded so far, and the cgroup files read.
    pub fn clear_calls(&self) {
        let mut st = self.lock();
        st.calls.clear();
        st.cgroup_reads.clear();
        st.resolutions.clear();
    }

    /// The paths resolved so far (since [`FakeOs::clear_calls`]), as the real OS resolves
    /// them: a path looked at or mounted on, a bind's source, and the parent of a path made,
    /// removed or unmounted; none for what a [`Held`] holds.
    pub fn resolutions(&self) -> Vec<PathBuf> {
        self.lock().resolutions.clone()
    }

    /// The cgroup control files read so far (since [`FakeOs::clear_calls`]).
    pub fn cgroup_reads(&self) -> Vec<PathBuf> {
        self.lock().cgroup_reads.clone()
    }

    /// How many mounts are stacked on `target`.
    pub fn mount_depth(&self, target: impl AsRef<Path>) -> usize {
        self.lock().mounts.get(target.as_ref()).map_or(0, Vec::len)
    }

    /// Whether `path` exists as a directory or file.
    pub fn exists(&self, path: impl AsRef<Path>) -> bool {
        let st = self.lock();
        st.dirs.contains(path.as_ref()) || st.files.contains(path.as_ref())
    }

    /// A tool run: mkfs writes a superblock, cryptsetup makes, opens, closes and resizes
    /// LUKS volumes (`key`: what it read on its standard input).
    fn tool(&self, run: &ToolRun, key: Option<&[u8]>) -> Result<(), ToolError> {
        let mut st = self.lock();
        st.calls
            .push(Call::Tool(run.program.clone(), run.args.clone()));
        let failure = match st.tool_failures.remove(&run.program) {
            Some(code) => Some(code),
            None => st.failures.remove("tool"),
        };
        if let Some(code) = failure {
            return Err(tool_failed(run, code, "injected failure"));
        }
        let crash = match st.tool_crash.as_mut() {
            Some((program, 0, done)) if *program == run.program => {
                let done = *done;
                st.tool_crash = None;
                Some(done)
            }
            Some((program, left, _)) if *program == run.program => {
                *left -= 1;
                None
            }
            _ => None,
        };
        if crash == Some(false) {
            return Err(tool_failed(run, 137, "crashed before it ran"));
        }
        if run.program == "cryptsetup" {
            let result = cryptsetup(&mut st, run, key);
            if crash == Some(true) {
                return Err(tool_failed(run, 137, "crashed after it ran"));
            }
            return result;
        }

        // mkfs writes a superblock the probe recognises; the device is its last argument.
        let fs = run.program.strip_prefix("mkfs.");
        let device = run.args.last().map(PathBuf::from);
        if let (Some(fs), Some(device)) = (fs, device) {
            let Some(d) = st.devices.get_mut(&device) else {
                return Err(tool_failed(
                    run,
                    1,
                    &format!("{}: no such device", device.display()),
                ));
            };
            let uuid = mkfs_uuid(&run.args);
            for (offset, bytes) in superblock_with_uuid(fs, uuid.as_deref()) {
                d.data.insert(offset, bytes);
            }
        }
        Ok(())
    }

    /// What is at `path`, resolved (and recorded as such).
    fn state_at(&self, path: &Path) -> SysResult<MountState> {
        let mut st = self.lock();
        st.resolutions.push(path.to_path_buf());
        Ok(state_of(&st, path))
    }

    fn take_failure(st: &mut State, op: &'static str, path: &Path) -> SysResult<()> {
        match st.failures.remove(op) {
            Some(errno) => Err(err(op, path, errno)),
            None => Ok(()),
        }
    }
}

/// What is at `path`.
fn state_of(st: &State, path: &Path) -> MountState {
    if let Some(errno) = st.corrupted.get(path) {
        return MountState::Corrupted { errno: *errno };
    }
    if let Some(m) = st.mounts.get(path).and_then(|s| s.last()) {
        return MountState::Mounted(MountPoint {
            mount_id: m.id,
            dev: m.dev,
            rdev: m.rdev,
            is_dir: m.is_dir,
            read_only: m.read_only,
        });
    }
    if st.dirs.contains(path) {
        MountState::NotMounted { is_dir: true }
    } else if st.files.contains(path) {
        MountState::NotMounted { is_dir: false }
    } else {
        MountState::Absent
    }
}

/// Where `path`, looked up by its last component in the directory `parent` holds, is now:
/// wherever that directory was moved since it was held. EINVAL when `path`'s parent is not
/// the directory held.
fn in_held(st: &State, step: &'static str, path: &Path, parent: &Held) -> SysResult<PathBuf> {
    let name = path
        .file_name()
        .filter(|_| path.parent() == Some(parent.path.as_path()))
        .ok_or_else(|| err(step, path, libc::EINVAL))?;
    let dir = st.held_dirs.get(&parent.path).unwrap_or(&parent.path);
    Ok(dir.join(name))
}

/// `path` after a rename of `from` to `to`, if it is at or below `from`.
fn renamed(path: &Path, from: &Path, to: &Path) -> Option<PathBuf> {
    let rest = path.strip_prefix(from).ok()?;
    Some(if rest.as_os_str().is_empty() {
        to.to_path_buf()
    } else {
        to.join(rest)
    })
}

/// Renames `from` to `to`: every directory, file and mount at or below it moves along, and
/// so does a held directory.
fn rename(st: &mut State, from: &Path, to: &Path) {
    let moved = |p: PathBuf| renamed(&p, from, to).unwrap_or(p);
    st.dirs = std::mem::take(&mut st.dirs)
        .into_iter()
        .map(moved)
        .collect();
    st.files = std::mem::take(&mut st.files)
        .into_iter()
        .map(moved)
        .collect();
    st.mounts = std::mem::take(&mut st.mounts)
        .into_iter()
        .map(|(p, m)| (moved(p), m))
        .collect();
    st.corrupted = std::mem::take(&mut st.corrupted)
        .into_iter()
        .map(|(p, e)| (moved(p), e))
        .collect();
    for now in st.held_dirs.values_mut() {
        if let Some(p) = renamed(now, from, to) {
            *now = p;
        }
    }
}

fn parent_exists(st: &State, path: &Path) -> bool {
    path.parent().is_some_and(|p| st.dirs.contains(p))
}

/// Records the resolution of `path`'s parent.
fn resolve_parent(st: &mut State, path: &Path) {
    let parent = path.parent().unwrap_or(path).to_path_buf();
    st.resolutions.push(parent);
}

impl Os for FakeOs {
    fn mount_state(&self, path: &Path) -> SysResult<MountState> {
        self.mount_state_held(path).map(|(state, _)| state)
    }

    fn mount_state_held(&self, path: &Path) -> SysResult<(MountState, Option<Held>)> {
        let state = self.state_at(path)?;
        let held = match state {
            MountState::Mounted(mp) => Some(Held::new(path.to_path_buf(), Some(mp.mount_id), None)),
            _ => None,
        };
        if held.is_some() {
            let mut st = self.lock();
            if let Some((_, dev)) = st.swap_after_check.take_if(|(p, _)| p == path) {
                st.next_mount_id += 1;
                let id = st.next_mount_id;
                if let Some(stack) = st.mounts.get_mut(path) {
                    stack.pop();
                    stack.push(FakeMount {
                        id,
                        dev,
                        rdev: None,
                        read_only: false,
                        is_dir: true,
                        source: PathBuf::from("/dev/swapped-in"),
                    });
                }
            }
        }
        Ok((state, held))
    }

    fn hold_parent(&self, path: &Path) -> SysResult<Option<Held>> {
        let mut st = self.lock();
        resolve_parent(&mut st, path);
        let dir = path.parent().unwrap_or(path).to_path_buf();
        if st.files.contains(&dir) {
            return Err(err("open parent", path, libc::ENOTDIR));
        }
        if !st.dirs.contains(&dir) {
            return Ok(None);
        }
        st.held_dirs.insert(dir.clone(), dir.clone());
        if let Some((_, renames)) = st.renames_after_hold.take_if(|(d, _)| *d == dir) {
            for (from, to) in renames {
                rename(&mut st, &from, &to);
            }
        }
        Ok(Some(Held::new(dir, None, None)))
    }

    fn mount_state_in(&self, path: &Path, parent: &Held) -> SysResult<MountState> {
        let st = self.lock();
        let at = in_held(&st, "open", path, parent)?;
        Ok(state_of(&st, &at))
    }

    fn make_dir_held(&self, path: &Path) -> SysResult<Held> {
        self.make_dir(path)?;
        Ok(Held::new(
            path.parent().unwrap_or(path).to_path_buf(),
            None,
            None,
        ))
    }

    fn bind_held(
        &self,
        b: &BindMount,
        source: Option<&Held>,
        parent: Option<&Held>,
    ) -> SysResult<()> {
        let mut st = self.lock();
        st.calls.push(Call::Bind(b.clone()));
        Self::take_failure(&mut st, "bind", &b.target)?;
        let held_mount = source.and_then(|h| h.mount_id);
        if held_mount.is_none() {
            st.resolutions.push(b.source.clone());
        }
        match parent {
            Some(p) if b.target.parent() == Some(p.path.as_path()) => {}
            Some(_) => return Err(err("open mount target", &b.target, libc::EINVAL)),
            None => st.resolutions.push(b.target.clone()),
        }
        let (dev, rdev, is_dir) = if let Some(id) = held_mount {
            // The held mount itself, wherever it is; gone (unmounted since): the kernel's
            // EINVAL, never what the path names now.
            let m = st
                .mounts
                .values()
                .flatten()
                .find(|m| m.id == id)
                .ok_or_else(|| err("open_tree", &b.source, libc::EINVAL))?;
            (m.dev, m.rdev, m.is_dir)
        } else if let Some(m) = st.mounts.get(&b.source).and_then(|s| s.last()) {
            (m.dev, m.rdev, m.is_dir)
        } else if let Some(d) = st.devices.get(&b.source) {
            ((0, 5), Some(d.rdev), false)
        } else if st.dirs.contains(&b.source) {
            ((0, 1), None, true)
        } else {
            return Err(err("open_tree", &b.source, libc::ENOENT));
        };
        let target_is_dir = st.dirs.contains(&b.target);
        if !target_is_dir && !st.files.contains(&b.target) {
            return Err(err("open mount target", &b.target, libc::ENOENT));
        }
        if target_is_dir != is_dir {
            return Err(err("move_mount", &b.target, libc::ENOTDIR));
        }
        st.next_mount_id += 1;
        let id = st.next_mount_id;
        let mount = FakeMount {
            id,
            dev,
            rdev,
            read_only: b.attrs.read_only,
            is_dir,
            source: b.source.clone(),
        };
        st.mounts.entry(b.target.clone()).or_default().push(mount);
        Ok(())
    }

    fn mount_table(&self) -> SysResult<Vec<MountEntry>> {
        let st = self.lock();
        let mut table: Vec<MountEntry> = st
            .mounts
            .iter()
            .flat_map(|(point, stack)| {
                stack.iter().map(|m| MountEntry {
                    id: m.id,
                    parent: 1,
                    dev: m.dev,
                    root: PathBuf::from("/"),
                    mount_point: point.clone(),
                    fs_type: if m.rdev.is_some() { "devtmpfs" } else { "fake" }.into(),
                    source: m.source.display().to_string(),
                })
            })
            .collect();
        table.sort_by_key(|m| m.id);
        Ok(table)
    }

    fn mount_fs(&self, m: &FsMount) -> SysResult<()> {
        let mut st = self.lock();
        st.calls.push(Call::MountFs(m.clone()));
        st.resolutions.push(m.target.clone());
        Self::take_failure(&mut st, "mount_fs", &m.target)?;
        let dev = st
            .devices
            .get(&m.device)
            .ok_or_else(|| err("fsconfig source", &m.device, libc::ENOENT))?;
        let rdev = dev.rdev;
        if !st.dirs.contains(&m.target) {
            return Err(err("open mount target", &m.target, libc::ENOENT));
        }
        st.next_mount_id += 1;
        let id = st.next_mount_id;
        let read_only = m.attrs.read_only || m.sb_read_only;
        let mount = FakeMount {
            id,
            dev: rdev,
            rdev: None,
            read_only,
            is_dir: true,
            source: m.device.clone(),
        };
        st.mounts.entry(m.target.clone()).or_default().push(mount);
        Ok(())
    }

    fn unmount_held(&self, target: &Path, detach: bool, parent: Option<&Held>) -> SysResult<()> {
        let mut st = self.lock();
        // What is unmounted: the name in the held directory, wherever it is now.
        let at = match parent {
            Some(p) => in_held(&st, "open unmount target", target, p)?,
            None => {
                resolve_parent(&mut st, target);
                target.to_path_buf()
            }
        };
        st.calls.push(Call::Unmount(at.clone(), detach));
        Self::take_failure(&mut st, "unmount", target)?;
        if st.corrupted.remove(&at).is_some() {
            if let Some(stack) = st.mounts.get_mut(&at) {
                stack.pop();
            }
            return Ok(());
        }
        if let Some(stack) = st.mounts.get_mut(&at).filter(|s| !s.is_empty()) {
            stack.pop();
            return Ok(());
        }
        if st.dirs.contains(&at) || st.files.contains(&at) {
            Err(err("umount2", target, libc::EINVAL))
        } else {
            Err(err("open unmount target", target, libc::ENOENT))
        }
    }

    fn make_dir(&self, path: &Path) -> SysResult<()> {
        let mut st = self.lock();
        st.calls.push(Call::MakeDir(path.to_path_buf()));
        resolve_parent(&mut st, path);
        Self::take_failure(&mut st, "mkdir", path)?;
        if st.files.contains(path) {
            return Err(err("mkdir", path, libc::ENOTDIR));
        }
        if !parent_exists(&st, path) {
            return Err(err("open parent", path, libc::ENOENT));
        }
        st.dirs.insert(path.to_path_buf());
        Ok(())
    }

    fn make_file(&self, path: &Path) -> SysResult<()> {
        let mut st = self.lock();
        st.calls.push(Call::MakeFile(path.to_path_buf()));
        resolve_parent(&mut st, path);
        Self::take_failure(&mut st, "mkfile", path)?;
        if st.dirs.contains(path) {
            return Err(err("create file", path, libc::EISDIR));
        }
        if !parent_exists(&st, path) {
            return Err(err("open parent", path, libc::ENOENT));
        }
        st.files.insert(path.to_path_buf());
        Ok(())
    }

    fn remove_held(&self, path: &Path, parent: Option<&Held>) -> SysResult<()> {
        let mut st = self.lock();
        // What is removed: the name in the held directory, wherever it is now.
        let at = match parent {
            Some(p) => in_held(&st, "open parent", path, p)?,
            None => {
                resolve_parent(&mut st, path);
                path.to_path_buf()
            }
        };
        st.calls.push(Call::Remove(at.clone()));
        Self::take_failure(&mut st, "remove", path)?;
        if st.mounts.get(&at).is_some_and(|s| !s.is_empty()) {
            return Err(err("remove", path, libc::EBUSY));
        }
        if st.dirs.iter().any(|d| d.parent() == Some(&at))
            || st.files.iter().any(|f| f.parent() == Some(&at))
        {
            return Err(err("remove", path, libc::ENOTEMPTY));
        }
        st.dirs.remove(&at);
        st.files.remove(&at);
        Ok(())
    }

    fn block_device(&self, path: &Path) -> SysResult<BlockDevice> {
        let st = self.lock();
        if st.dirs.contains(path) || st.files.contains(path) {
            return Err(err("open device", path, libc::ENOTBLK));
        }
        let d = st
            .devices
            .get(path)
            .ok_or_else(|| err("open device", path, libc::ENOENT))?;
        Ok(BlockDevice {
            rdev: d.rdev,
            size: d.size,
        })
    }

    fn hold_device(&self, path: &Path) -> SysResult<HeldDevice> {
        let dev = self.block_device(path)?;
        Ok(HeldDevice::new(
            dev,
            path.to_path_buf(),
            path.to_path_buf(),
            None,
        ))
    }

    fn check_unclaimed(&self, dev: &HeldDevice) -> SysResult<()> {
        let mut st = self.lock();
        Self::take_failure(&mut st, "claim", &dev.handle)?;
        let mounted = st
            .mounts
            .values()
            .flatten()
            .any(|m| m.rdev.is_none() && m.dev == dev.rdev);
        if mounted {
            return Err(err("open device exclusively", &dev.handle, libc::EBUSY));
        }
        Ok(())
    }

    fn read_device(&self, path: &Path, offset: u64, buf: &mut [u8]) -> SysResult<usize> {
        let st = self.lock();
        let d = st
            .devices
            .get(path)
            .ok_or_else(|| err("open device", path, libc::ENOENT))?;
        let len = (buf.len() as u64).min(d.size.saturating_sub(offset)) as usize;
        let buf = buf.get_mut(..len).unwrap_or_default();
        buf.fill(0);
        let end = offset + len as u64;
        for (&at, bytes) in &d.data {
            let at_end = at + bytes.len() as u64;
            if at_end <= offset || at >= end {
                continue;
            }
            let from = offset.max(at);
            let to = end.min(at_end);
            let dst = buf.get_mut((from - offset) as usize..(to - offset) as usize);
            let src = bytes.get((from - at) as usize..(to - at) as usize);
            if let (Some(dst), Some(src)) = (dst, src) {
                dst.copy_from_slice(src);
            }
        }
        Ok(len)
    }

    fn fs_usage(&self, path: &Path) -> SysResult<FsUsage> {
        let st = self.lock();
        if let Some(errno) = st.corrupted.get(path) {
            return Err(err("statvfs", path, *errno));
        }
        let size = st
            .mounts
            .get(path)
            .and_then(|s| s.last())
            .and_then(|m| {
                st.devices
                    .values()
                    .find(|d| d.rdev == m.dev)
                    .map(|d| d.size)
            })
            .unwrap_or(1 << 30);
        Ok(FsUsage {
            total_bytes: size,
            available_bytes: size / 2,
            used_bytes: size / 2,
            total_inodes: 1000,
            free_inodes: 900,
            used_inodes: 100,
        })
    }

    fn fs_errors(&self, dev: (u32, u32)) -> SysResult<Option<u64>> {
        let mut st = self.lock();
        Self::take_failure(&mut st, "fs_errors", Path::new("/sys/fs/ext4"))?;
        Ok(st.fs_errors.get(&dev).copied())
    }

    fn backing_store(&self, dev: (u32, u32)) -> SysResult<Option<BackingStore>> {
        let mut st = self.lock();
        Self::take_failure(&mut st, "backing_store", Path::new("/sys/dev/block"))?;
        Ok(st.backing.get(&dev).map(|file| BackingStore {
            file: file.clone(),
            deleted: st.deleted_backing.contains(&dev),
            fs: Some(
                st.backing_fs
                    .get(file)
                    .copied()
                    .unwrap_or(BackingFs::Answers {
                        read_only: false,
                        available_bytes: 1 << 40,
                    }),
            ),
        }))
    }

    fn devices_under(&self, dev: (u32, u32)) -> SysResult<Vec<(u32, u32)>> {
        let mut st = self.lock();
        Self::take_failure(&mut st, "devices_under", Path::new("/sys/dev/block"))?;
        let under = st
            .mappings
            .iter()
            .find(|(name, _)| {
                st.devices
                    .get(&mapper_path(name))
                    .is_some_and(|m| m.rdev == dev)
            })
            .and_then(|(_, device)| st.devices.get(device))
            .map(|d| d.rdev);
        Ok(under.into_iter().collect())
    }

    fn share_with_group(
        &self,
        path: &Path,
        gid: u32,
        deadline: Duration,
    ) -> Result<GroupReport, OwnershipError> {
        let mut st = self.lock();
        st.calls.push(Call::ShareWithGroup(path.to_path_buf(), gid));
        Self::take_failure(&mut st, "share", path)?;
        if st.failures.remove("share_deadline").is_some() {
            return Err(OwnershipError::Deadline {
                path: path.to_path_buf(),
                gid,
                deadline,
                entries: 0,
            });
        }
        Ok(GroupReport::default())
    }

    fn selinux(&self) -> bool {
        self.lock().selinux
    }

    fn selinux_label_known(&self, label: &str) -> bool {
        !self.lock().unknown_labels.iter().any(|l| l == label)
    }

    fn read_cgroup(&self, path: &Path) -> SysResult<String> {
        let mut st = self.lock();
        st.cgroup_reads.push(path.to_path_buf());
        Self::take_failure(&mut st, "read_cgroup", path)?;
        st.cgroup
            .get(path)
            .cloned()
            .ok_or_else(|| err("read cgroup file", path, libc::ENOENT))
    }

    fn write_cgroup(&self, path: &Path, line: &str) -> SysResult<()> {
        let mut st = self.lock();
        st.calls
            .push(Call::WriteCgroup(path.to_path_buf(), line.to_string()));
        Self::take_failure(&mut st, "write_cgroup", path)?;
        let Some(text) = st.cgroup.get_mut(path) else {
            return Err(err("open cgroup file", path, libc::ENOENT));
        };
        *text = kernel_rules(path, text, line)
            .ok_or_else(|| err("write cgroup file", path, libc::EINVAL))?;
        Ok(())
    }

    fn run_tool(&self, run: &ToolRun) -> Result<(), ToolError> {
        self.tool(run, None)
    }

    fn run_tool_with_key(&self, run: &ToolRun, key: &[u8]) -> Result<(), ToolError> {
        self.tool(run, Some(key))
    }

    fn has_program(&self, program: &str) -> bool {
        !self.lock().missing_programs.contains(program)
    }

    fn identify(&self, rdev: (u32, u32), want: &DeviceIdentity) -> Verdict {
        discovery::verdict(want, &Self::facts(&self.lock(), rdev))
    }

    fn find_device(
        &self,
        want: &DeviceIdentity,
        wait: Duration,
    ) -> Result<FoundDevice, DiscoveryError> {
        let mut st = self.lock();
        st.calls.push(Call::FindDevice(want.clone(), wait));
        if let Some(errno) = st.failures.remove("find_device") {
            return Err(DiscoveryError::NoEventSource {
                source_kind: EventSource::Kernel,
                source: std::io::Error::from_raw_os_error(errno),
            });
        }
        if let Some(found) = Self::find_present(&st, want) {
            return Ok(found);
        }
        if wait.is_zero() {
            return Err(DiscoveryError::NotPresent {
                identity: want.to_string(),
            });
        }
        // Each queued arrival is one event received while waiting.
        for a in std::mem::take(&mut st.arrivals) {
            st.devices.insert(
                a.path.clone(),
                FakeDevice {
                    rdev: a.rdev,
                    size: a.size,
                    data: BTreeMap::new(),
                },
            );
            st.backing.insert(a.rdev, a.backing);
            if let Some(found) = Self::find_present(&st, want) {
                return Ok(found);
            }
        }
        Err(DiscoveryError::Deadline {
            identity: want.to_string(),
            waited: wait,
            source_kind: EventSource::Kernel,
        })
    }
}

/// The UUID an mkfs command line asks for (`-U <uuid>`, or xfs's `-m uuid=<uuid>`).
fn mkfs_uuid(args: &[String]) -> Option<String> {
    args.windows(2)
        .find_map(|w| match (w[0].as_str(), w[1].as_str()) {
            ("-U", u) => Some(u.to_owned()),
            ("-m", m) => m.strip_prefix("uuid=").map(str::to_owned),
            _ => None,
        })
}

/// A throttling file's rules after the kernel took `line` (`MAJ:MIN ...`): cgroup v2's
/// `io.max` merges the keys given into the device's rule (dropped when all are `max`), v1's
/// `blkio.throttle.*` sets the device's number (dropped at 0). None: a line the kernel refuses.
fn kernel_rules(path: &Path, text: &str, line: &str) -> Option<String> {
    let mut words = line.split_whitespace();
    let dev = words.next().filter(|d| d.split_once(':').is_some())?;
    let v2 = path.file_name().is_some_and(|n| n == "io.max");
    let mut rules: BTreeMap<String, String> = text
        .lines()
        .filter_map(|l| l.split_once(' '))
        .map(|(d, r)| (d.to_string(), r.to_string()))
        .collect();
    let rule = if v2 {
        let mut keys: BTreeMap<&str, String> = ["rbps", "wbps", "riops", "wiops"]
            .into_iter()
            .map(|k| (k, "max".to_string()))
            .collect();
        if let Some(old) = rules.get(dev) {
            for w in old.split_whitespace() {
                let (k, v) = w.split_once('=')?;
                if let Some(slot) = keys.get_mut(k) {
                    *slot = v.to_string();
                }
            }
        }
        for w in words {
            let (k, v) = w.split_once('=')?;
            if v != "max" && v.parse::<u64>().ok().filter(|n| *n > 0).is_none() {
                return None;
            }
            *keys.get_mut(k)? = v.to_string();
        }
        let all_max = keys.values().all(|v| v == "max");
        let order = ["rbps", "wbps", "riops", "wiops"];
        (!all_max).then(|| {
            order
                .iter()
                .map(|k| format!("{k}={}", keys.get(k).map_or("max", String::as_str)))
                .collect::<Vec<_>>()
                .join(" ")
        })
    } else {
        let n: u64 = words.next()?.parse().ok()?;
        (n > 0).then(|| n.to_string())
    };
    match rule {
        Some(r) => rules.insert(dev.to_string(), r),
        None => rules.remove(dev),
    };
    Some(rules.iter().map(|(d, r)| format!("{d} {r}\n")).collect())
}

/// The signature bytes a real mkfs would leave, with the filesystem's UUID (hyphenated hex)
/// where its superblock keeps it.
pub fn superblock_with_uuid(fs: &str, uuid: Option<&str>) -> Vec<(u64, Vec<u8>)> {
    let mut blocks = superblock(fs);
    let Some(bytes) = uuid.and_then(uuid_bytes) else {
        return blocks;
    };
    let at = match fs {
        "xfs" => 32,
        "btrfs" => 65536 + 0x20,
        "ext2" | "ext3" | "ext4" => 1024 + 0x68,
        _ => return blocks,
    };
    blocks.push((at, bytes.to_vec()));
    blocks
}

/// The 16 bytes of a hyphenated UUID.
fn uuid_bytes(text: &str) -> Option<[u8; 16]> {
    let hex: Vec<u8> = text.bytes().filter(|&b| b != b'-').collect();
    let mut out = [0u8; 16];
    if hex.len() != 32 {
        return None;
    }
    for (i, pair) in hex.chunks(2).enumerate() {
        out[i] = u8::from_str_radix(std::str::from_utf8(pair).ok()?, 16).ok()?;
    }
    Some(out)
}

/// The signature bytes a real mkfs would leave, enough for the probe.
pub fn superblock(fs: &str) -> Vec<(u64, Vec<u8>)> {
    match fs {
        "xfs" => vec![(0, b"XFSB".to_vec())],
        "btrfs" => vec![(65536 + 0x40, b"_BHRfS_M".to_vec())],
        "ext2" | "ext3" | "ext4" => {
            let mut sb = vec![0u8; 0x68];
            sb[0x38] = 0x53;
            sb[0x39] = 0xEF;
            if fs == "ext3" || fs == "ext4" {
                sb[0x5C] = 0x04; // has_journal
            }
            if fs == "ext4" {
                sb[0x60] = 0x40; // extents
                sb[0x61] = 0x02; // flex_bg
            }
            vec![(1024, sb)]
        }
        _ => vec![(0, b"\x7fmoor-fake-unknown".to_vec())],
    }
}

/// A tool's failure with exit code `code`.
fn tool_failed(run: &ToolRun, code: i32, stderr: &str) -> ToolError {
    ToolError::Failed {
        program: run.program.clone(),
        code: Some(code),
        status: format!("exit status: {code}"),
        stderr: stderr.to_owned(),
    }
}

/// The fake's LUKS2 primary header (16 KiB, `hdr_size`): magic, version, size, the UUID
/// `uuid`, and a JSON area whose `keyslots` lists `slots`.
fn fake_luks2_header<'a>(uuid: Option<&str>, slots: impl Iterator<Item = &'a u32>) -> Vec<u8> {
    let mut header = vec![0u8; 16 << 10];
    header[..6].copy_from_slice(b"LUKS\xba\xbe");
    header[7] = 2;
    header[8..16].copy_from_slice(&(16u64 << 10).to_be_bytes());
    if let Some(uuid) = uuid {
        let n = uuid.len().min(39);
        header[168..168 + n].copy_from_slice(&uuid.as_bytes()[..n]);
    }
    let slots: Vec<String> = slots
        .map(|s| format!("\"{s}\":{{\"type\":\"luks2\"}}"))
        .collect();
    let json = format!(
        "{{\"keyslots\":{{{}}},\"tokens\":{{}},\"segments\":{{}},\"digests\":{{}},\
         \"config\":{{}}}}",
        slots.join(",")
    );
    header[4096..4096 + json.len()].copy_from_slice(json.as_bytes());
    header
}

/// The fake LUKS2 header on `device` rewritten to list its volume's key slots now.
fn rewrite_fake_luks2_slots(st: &mut State, device: &Path) {
    let Some(luks) = st.luks.get(device) else {
        return;
    };
    let Some(d) = st.devices.get_mut(device) else {
        return;
    };
    let uuid = d
        .data
        .get(&0)
        .and_then(|h| h.get(168..208))
        .map(|u| String::from_utf8_lossy(u).trim_end_matches('\0').to_owned());
    d.data
        .insert(0, fake_luks2_header(uuid.as_deref(), luks.slots.keys()));
}

/// Where a mapping named `name` appears.
fn mapper_path(name: &str) -> PathBuf {
    Path::new("/dev/mapper").join(name)
}

/// cryptsetup on the fake: `luksFormat` (a LUKS2 header the probe knows, with the `--uuid`
/// asked for, the key read from stdin in its one slot), `open` (exit 2 for a key no slot
/// takes, 1 for a device without LUKS, 5 for a name in use), `close` (5 while the mapping is
/// mounted or bound), `resize` (with the key, as cryptsetup 2.6 asks for it). The exit codes
/// are cryptsetup's.
fn cryptsetup(st: &mut State, run: &ToolRun, key: Option<&[u8]>) -> Result<(), ToolError> {
    let args = &run.args;
    let arg_after = |flag: &str| args.windows(2).find(|w| w[0] == flag).map(|w| w[1].clone());
    let last = |back: usize| {
        args.len()
            .checked_sub(back)
            .and_then(|i| args.get(i))
            .cloned()
            .unwrap_or_default()
    };
    let key_on_stdin = args.iter().any(|a| a == "--key-file=-");
    match args.first().map(String::as_str) {
        Some("luksFormat") => {
            let (Some(key), true) = (key, key_on_stdin) else {
                return Err(tool_failed(run, 1, "no key on stdin"));
            };
            let device = PathBuf::from(last(1));
            let Some(d) = st.devices.get_mut(&device) else {
                return Err(tool_failed(run, 4, "no such device"));
            };
            let slots = BTreeMap::from([(0, key.to_vec())]);
            d.data.clear();
            d.data.insert(
                0,
                fake_luks2_header(arg_after("--uuid").as_deref(), slots.keys()),
            );
            st.luks.insert(
                device,
                FakeLuks {
                    slots,
                    data: BTreeMap::new(),
                },
            );
            Ok(())
        }
        Some("open") if args.iter().any(|a| a == "--test-passphrase") => {
            let device = PathBuf::from(last(1));
            let Some(luks) = st.luks.get(&device) else {
                return Err(tool_failed(run, 1, "not a valid LUKS device"));
            };
            let key = key.filter(|_| key_on_stdin).unwrap_or_default();
            match arg_after("--key-slot").and_then(|s| s.parse::<u32>().ok()) {
                Some(slot) => match luks.slots.get(&slot) {
                    None => Err(tool_failed(run, 1, "No usable keyslot is available.")),
                    Some(k) if k.as_slice() == key => Ok(()),
                    Some(_) => Err(tool_failed(
                        run,
                        2,
                        "No key available with this passphrase.",
                    )),
                },
                None if luks.opens(key) => Ok(()),
                None => Err(tool_failed(
                    run,
                    2,
                    "No key available with this passphrase.",
                )),
            }
        }
        Some("luksAddKey") => {
            // The opening key, then the new one, both on stdin (`--keyfile-size`,
            // `--new-keyfile-size`, the new key file `/dev/stdin`).
            let size = |flag: &str| arg_after(flag).and_then(|s| s.parse::<usize>().ok());
            let (Some(keys), true, Some(n), Some(m), "/dev/stdin") = (
                key,
                key_on_stdin,
                size("--keyfile-size"),
                size("--new-keyfile-size"),
                last(1).as_str(),
            ) else {
                return Err(tool_failed(run, 1, "both keys must come on stdin"));
            };
            let (Some(opening), Some(new)) = (keys.get(..n), keys.get(n..n + m)) else {
                return Err(tool_failed(run, 1, "short key input"));
            };
            let device = PathBuf::from(last(2));
            let Some(luks) = st.luks.get_mut(&device) else {
                return Err(tool_failed(run, 1, "not a valid LUKS device"));
            };
            if !luks.opens(opening) {
                return Err(tool_failed(
                    run,
                    2,
                    "No key available with this passphrase.",
                ));
            }
            let Some(slot) = arg_after("--new-key-slot").and_then(|s| s.parse::<u32>().ok()) else {
                return Err(tool_failed(run, 1, "the fake wants --new-key-slot"));
            };
            if luks.slots.contains_key(&slot) {
                return Err(tool_failed(
                    run,
                    1,
                    &format!("Key slot {slot} is full, please select another one."),
                ));
            }
            luks.slots.insert(slot, new.to_vec());
            rewrite_fake_luks2_slots(st, &device);
            Ok(())
        }
        Some("luksKillSlot") => {
            // Without --batch-mode: the key given must open a slot other than the one killed.
            let device = PathBuf::from(last(2));
            let Some(luks) = st.luks.get_mut(&device) else {
                return Err(tool_failed(run, 1, "not a valid LUKS device"));
            };
            let Ok(slot) = last(1).parse::<u32>() else {
                return Err(tool_failed(run, 1, "no key slot"));
            };
            if !luks.slots.contains_key(&slot) {
                return Err(tool_failed(
                    run,
                    1,
                    &format!("Keyslot {slot} is not active."),
                ));
            }
            let batch = args.iter().any(|a| a == "--batch-mode" || a == "-q");
            let key = key.filter(|_| key_on_stdin).unwrap_or_default();
            let proven = luks
                .slots
                .iter()
                .any(|(s, k)| *s != slot && k.as_slice() == key);
            if !batch && !proven {
                return Err(tool_failed(
                    run,
                    2,
                    "No key available with this passphrase.",
                ));
            }
            luks.slots.remove(&slot);
            rewrite_fake_luks2_slots(st, &device);
            Ok(())
        }
        Some("open") => {
            let (device, name) = (PathBuf::from(last(2)), last(1));
            let Some(luks) = st.luks.get(&device) else {
                return Err(tool_failed(run, 1, "not a valid LUKS device"));
            };
            if luks.slots.is_empty() {
                return Err(tool_failed(run, 1, "No usable keyslot is available."));
            }
            if !key_on_stdin || !key.is_some_and(|k| luks.opens(k)) {
                return Err(tool_failed(
                    run,
                    2,
                    "No key available with this passphrase.",
                ));
            }
            let data = luks.data.clone();
            let path = mapper_path(&name);
            if st.devices.contains_key(&path) {
                return Err(tool_failed(run, 5, "Device already exists."));
            }
            let size = st
                .devices
                .get(&device)
                .map_or(0, |d| d.size.saturating_sub(FAKE_LUKS_HEADER));
            st.next_dm_minor += 1;
            let rdev = (FAKE_DM_MAJOR, st.next_dm_minor);
            st.devices.insert(path, FakeDevice { rdev, size, data });
            st.mappings.insert(name, device);
            Ok(())
        }
        Some("close") => {
            let name = last(1);
            let path = mapper_path(&name);
            let Some(rdev) = st.devices.get(&path).map(|d| d.rdev) else {
                return Err(tool_failed(run, 4, "Device is not active."));
            };
            let busy = st
                .mounts
                .values()
                .flatten()
                .any(|m| m.source == path || m.dev == rdev || m.rdev == Some(rdev));
            if busy {
                return Err(tool_failed(run, 5, "Device is still in use."));
            }
            let gone = st.devices.remove(&path);
            if let (Some(device), Some(gone)) = (st.mappings.remove(&name), gone)
                && let Some(luks) = st.luks.get_mut(&device)
            {
                luks.data = gone.data;
            }
            Ok(())
        }
        Some("resize") => {
            let name = last(1);
            let opens = st
                .mappings
                .get(&name)
                .and_then(|d| st.luks.get(d))
                .is_some_and(|l| key_on_stdin && key.is_some_and(|k| l.opens(k)));
            if !opens {
                return Err(tool_failed(
                    run,
                    2,
                    "No key available with this passphrase.",
                ));
            }
            let size = st
                .mappings
                .get(&name)
                .and_then(|d| st.devices.get(d))
                .map(|d| d.size.saturating_sub(FAKE_LUKS_HEADER));
            match (size, st.devices.get_mut(&mapper_path(&name))) {
                (Some(size), Some(m)) => {
                    m.size = size;
                    Ok(())
                }
                _ => Err(tool_failed(run, 4, "Device is not active.")),
            }
        }
        _ => Err(tool_failed(run, 1, "unknown action")),
    }
}
