//! A recording fake [`Attacher`] over the fake OS: a map adds a loop device backed by the
//! image's file to the [`FakeOs`] (a new device number each time, holding what the image
//! holds), an unmap removes it, keeping what was written for the next map. An unmap of a
//! device the fake OS still has mounted is refused as busy, as the real ones are. Failures
//! are set by the test: the next map or unmap of a kind, or the n-th call of any step that
//! can fail (find, map, unmap, verify, refresh, list), for fault injection. An image can grow
//! (the controller's resize), and its device shows the new size once refreshed.

use std::collections::BTreeMap;
use std::path::Path;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};

use super::{AttachError, Attacher, Deadlines, ImageSpec, MapRequest, Mapping};
use crate::sys::discovery::DeviceIdentity;
use crate::sys::fake::FakeOs;

/// A call made to the fake attacher.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AttachCall {
    /// `map(image, read_only)`.
    Map(ImageSpec, bool),
    /// `unmap(image)`.
    Unmap(ImageSpec),
    /// `abort(image)`.
    Abort(ImageSpec),
    /// `recover(image)` that took a dead server's device over.
    Recover(ImageSpec),
}

/// What the next call of a kind does instead of its work.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// It fails (INTERNAL).
    Fail,
    /// It runs past its deadline; for a map, the image ends up mapped anyway.
    Timeout,
    /// The device is in use (unmap).
    Busy,
    /// The image does not exist (map).
    NotFound,
}

#[derive(Debug)]
struct State {
    mapped: BTreeMap<ImageSpec, Mapping>,
    calls: Vec<AttachCall>,
    fail_map: Option<Failure>,
    fail_unmap: Option<Failure>,
    /// Fallible calls made so far (find, map, unmap, verify, refresh, list).
    steps: usize,
    /// The fallible call (by its count) that fails, and how.
    fail_step: Option<(usize, Failure)>,
    next: u32,
    not_owned: bool,
    doubles: usize,
    /// What each image holds while it is not mapped.
    images: BTreeMap<ImageSpec, Vec<(u64, Vec<u8>)>>,
    /// The size of each image grown past the fake's default.
    sizes: BTreeMap<ImageSpec, u64>,
    /// What [`Attacher::activity`] reports.
    activity: u64,
    deadlines: Deadlines,
    /// Why the clusters do not answer, when they do not.
    cluster_away: Option<String>,
    /// Mapped images whose server died (their device waits for a new one).
    dead_servers: std::collections::BTreeSet<ImageSpec>,
}

impl Default for State {
    fn default() -> Self {
        Self {
            mapped: BTreeMap::new(),
            calls: Vec::new(),
            fail_map: None,
            fail_unmap: None,
            steps: 0,
            fail_step: None,
            next: 0,
            not_owned: false,
            doubles: 0,
            images: BTreeMap::new(),
            sizes: BTreeMap::new(),
            activity: 0,
            cluster_away: None,
            dead_servers: std::collections::BTreeSet::new(),
            deadlines: Deadlines {
                map: std::time::Duration::from_secs(60),
                unmap: std::time::Duration::from_secs(30),
            },
        }
    }
}

/// The fake attacher.
#[derive(Debug)]
pub struct FakeAttacher {
    os: Arc<FakeOs>,
    size: u64,
    state: Mutex<State>,
}

/// Where the fake keeps an image's file (the loop device's backing file).
pub fn image_file(image: &ImageSpec) -> PathBuf {
    PathBuf::from(format!(
        "/var/lib/moor/rbd/{}+{}/{}",
        image.pool, image.image, image.image
    ))
}

impl FakeAttacher {
    /// A fake whose images are `size` bytes, as devices of `os`.
    pub fn new(os: Arc<FakeOs>, size: u64) -> Self {
        Self {
            os,
            size,
            state: Mutex::default(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Makes every cluster not answer, saying `why` (None: they answer again).
    pub fn set_cluster_away(&self, why: Option<&str>) {
        self.lock().cluster_away = why.map(str::to_string);
    }

    /// The calls made so far.
    pub fn calls(&self) -> Vec<AttachCall> {
        self.lock().calls.clone()
    }

    /// The images mapped now.
    pub fn mapped(&self) -> Vec<ImageSpec> {
        self.lock().mapped.keys().cloned().collect()
    }

    /// Sets the deadlines it reports.
    pub fn set_deadlines(&self, d: Deadlines) {
        self.lock().deadlines = d;
    }

    /// Makes the mapped images' server look busy (its activity grows by `n`).
    pub fn work(&self, n: u64) {
        self.lock().activity += n;
    }

    /// How many maps were asked of an image already mapped.
    pub fn doubles(&self) -> usize {
        self.lock().doubles
    }

    /// Makes the next map do `f`.
    pub fn fail_next_map(&self, f: Failure) {
        self.lock().fail_map = Some(f);
    }

    /// Makes the next unmap do `f`.
    pub fn fail_next_unmap(&self, f: Failure) {
        self.lock().fail_unmap = Some(f);
    }

    /// Makes the `n`-th fallible call from the start (find, map, unmap, verify, refresh,
    /// list; counting from 1) do `f`: a map or an unmap as [`fail_next_map`](Self::fail_next_map)
    /// and [`fail_next_unmap`](Self::fail_next_unmap) say, any other step fails (INTERNAL, or
    /// DEADLINE_EXCEEDED for a timeout).
    pub fn fail_step(&self, n: usize, f: Failure) {
        self.lock().fail_step = Some((n, f));
    }

    /// How many fallible calls were made so far.
    pub fn steps(&self) -> usize {
        self.lock().steps
    }

    /// Grows the image to `size` bytes, as the controller's resize does: its device shows the
    /// new size once refreshed (or mapped again).
    pub fn grow(&self, image: &ImageSpec, size: u64) {
        self.lock().sizes.insert(image.clone(), size);
    }

    /// The image's size.
    pub fn size_of(&self, image: &ImageSpec) -> u64 {
        self.lock().sizes.get(image).copied().unwrap_or(self.size)
    }

    /// What the image holds (read through its device while it is mapped).
    pub fn image_data(&self, image: &ImageSpec) -> Vec<(u64, Vec<u8>)> {
        let st = self.lock();
        match st.mapped.get(image) {
            Some(m) => self.os.device_data(&m.device),
            None => st.images.get(image).cloned().unwrap_or_default(),
        }
    }

    /// Gives an unmapped image `data` (the cluster kept it while this node rebooted).
    pub fn restore(&self, image: &ImageSpec, data: Vec<(u64, Vec<u8>)>) {
        self.lock().images.insert(image.clone(), data);
    }

    /// The mapped image's live mapping.
    pub fn mapping_of(&self, image: &ImageSpec) -> Option<Mapping> {
        self.lock().mapped.get(image).cloned()
    }

    /// Makes the next devices' numbers start `n` higher (as after a reboot, where the loop
    /// devices are numbered afresh).
    pub fn skip_devices(&self, n: u32) {
        self.lock().next += n;
    }

    /// Maps `image` behind moor's back (a mapping the journal does not know).
    pub fn map_unrecorded(&self, image: &ImageSpec, read_only: bool) -> Mapping {
        let mut st = self.lock();
        self.make(&mut st, image, read_only)
    }

    /// Makes [`Attacher::owns_all_listed`] false (as for the kernel's mappings).
    pub fn disown_listed(&self) {
        self.lock().not_owned = true;
    }

    /// Whether the fake OS has `device` mounted (a filesystem or a bind of the node).
    fn mounted(&self, device: &Path) -> bool {
        use crate::sys::Os as _;
        self.os
            .mount_table()
            .is_ok_and(|t| t.iter().any(|m| Path::new(&m.source) == device))
    }

    /// Kills the mapped image's server, as the end of moor-node's container does to a ublk
    /// server: the device stays, and waits for [`Attacher::recover`].
    pub fn kill_server(&self, image: &ImageSpec) {
        let mut st = self.lock();
        if st.mapped.contains_key(image) {
            st.dead_servers.insert(image.clone());
        }
    }

    /// Whether the mapped image's server is dead.
    pub fn server_dead(&self, image: &ImageSpec) -> bool {
        self.lock().dead_servers.contains(image)
    }

    /// Drops the image's mapping as a reboot does (whatever is mounted of it).
    pub fn lose(&self, image: &ImageSpec) {
        let mut st = self.lock();
        if let Some(m) = st.mapped.remove(image) {
            st.images
                .insert(image.clone(), self.os.device_data(&m.device));
            self.os.remove_device(&m.device);
        }
    }

    /// Counts a fallible call: the failure set for it, if any.
    fn step(st: &mut State) -> Option<Failure> {
        st.steps += 1;
        match st.fail_step {
            Some((n, f)) if n == st.steps => {
                st.fail_step = None;
                Some(f)
            }
            _ => None,
        }
    }

    /// A probe's injected failure (find, verify, refresh, list).
    fn probe_failure(st: &mut State, step: &'static str, image: String) -> Result<(), AttachError> {
        match Self::step(st) {
            None => Ok(()),
            Some(Failure::Timeout) => Err(AttachError::Timeout {
                step,
                image,
                deadline: std::time::Duration::from_secs(1),
            }),
            Some(_) => Err(AttachError::Failed {
                step,
                image,
                reason: "injected".into(),
            }),
        }
    }

    fn make(&self, st: &mut State, image: &ImageSpec, read_only: bool) -> Mapping {
        let n = 100 + st.next;
        st.next += 1;
        let device = PathBuf::from(format!("/dev/loop{n}"));
        let rdev = (7, n);
        let size = st.sizes.get(image).copied().unwrap_or(self.size);
        self.os.add_device(&device, rdev, size);
        for (offset, bytes) in st.images.get(image).cloned().unwrap_or_default() {
            self.os.write_device(&device, offset, &bytes);
        }
        let file = image_file(image);
        self.os.set_backing_file(rdev, &file);
        let m = Mapping {
            device,
            rdev,
            identity: DeviceIdentity {
                backing_file: Some(file),
                ..DeviceIdentity::default()
            },
            read_only,
        };
        st.mapped.insert(image.clone(), m.clone());
        m
    }
}

impl Attacher for FakeAttacher {
    fn kind(&self) -> &'static str {
        "fuse"
    }

    /// The fake's clusters answer unless [`set_cluster_away`](Self::set_cluster_away) says
    /// otherwise (no monitor is asked).
    fn cluster_answers(&self, _monitors: &str) -> Result<(), String> {
        self.lock().cluster_away.clone().map_or(Ok(()), Err)
    }

    fn deadlines(&self) -> Deadlines {
        self.lock().deadlines
    }

    fn find(&self, image: &ImageSpec) -> Result<Option<Mapping>, AttachError> {
        let mut st = self.lock();
        Self::probe_failure(&mut st, "find", image.to_string())?;
        Ok(st.mapped.get(image).cloned())
    }

    fn map(&self, req: &MapRequest<'_>) -> Result<Mapping, AttachError> {
        let mut st = self.lock();
        st.calls
            .push(AttachCall::Map(req.image.clone(), req.read_only));
        let image = req.image.to_string();
        let injected = Self::step(&mut st);
        match st.fail_map.take().or(injected) {
            None => {}
            Some(Failure::Timeout) => {
                self.make(&mut st, req.image, req.read_only);
                return Err(AttachError::Timeout {
                    step: "map",
                    image,
                    deadline: std::time::Duration::from_secs(1),
                });
            }
            Some(Failure::NotFound) => return Err(AttachError::NotFound(image)),
            Some(Failure::Fail | Failure::Busy) => {
                return Err(AttachError::Failed {
                    step: "map",
                    image,
                    reason: "injected".into(),
                });
            }
        }
        if let Some(m) = st.mapped.get(req.image).cloned() {
            // A real attacher would have made a second device.
            st.doubles += 1;
            return Ok(m);
        }
        Ok(self.make(&mut st, req.image, req.read_only))
    }

    fn unmap(&self, image: &ImageSpec) -> Result<(), AttachError> {
        let mut st = self.lock();
        st.calls.push(AttachCall::Unmap(image.clone()));
        let name = image.to_string();
        let injected = Self::step(&mut st);
        match st.fail_unmap.take().or(injected) {
            None => {}
            Some(Failure::Busy) => {
                return Err(AttachError::Busy {
                    image: name,
                    what: "its device".into(),
                });
            }
            Some(Failure::Timeout) => {
                return Err(AttachError::Timeout {
                    step: "unmap",
                    image: name,
                    deadline: std::time::Duration::from_secs(1),
                });
            }
            Some(Failure::Fail | Failure::NotFound) => {
                return Err(AttachError::Failed {
                    step: "unmap",
                    image: name,
                    reason: "injected".into(),
                });
            }
        }
        let Some(m) = st.mapped.get(image).cloned() else {
            return Ok(());
        };
        // Deleting the device ends its server, dead or not.
        st.dead_servers.remove(image);
        if self.mounted(&m.device) {
            return Err(AttachError::Busy {
                image: name,
                what: m.device.display().to_string(),
            });
        }
        st.mapped.remove(image);
        st.images
            .insert(image.clone(), self.os.device_data(&m.device));
        self.os.remove_device(&m.device);
        Ok(())
    }

    fn verify(&self, image: &ImageSpec, rdev: (u32, u32)) -> Result<(), AttachError> {
        let mut st = self.lock();
        Self::probe_failure(&mut st, "map", image.to_string())?;
        match st.mapped.get(image) {
            Some(m) if m.rdev == rdev => Ok(()),
            _ => Err(AttachError::Failed {
                step: "map",
                image: image.to_string(),
                reason: format!("{}:{} is not its device", rdev.0, rdev.1),
            }),
        }
    }

    fn refresh(&self, image: &ImageSpec) -> Result<(), AttachError> {
        let mut st = self.lock();
        Self::probe_failure(&mut st, "refresh", image.to_string())?;
        let size = st.sizes.get(image).copied().unwrap_or(self.size);
        if let Some(m) = st.mapped.get(image) {
            self.os.resize_device(&m.device, size);
        }
        Ok(())
    }

    fn list(&self) -> Result<Vec<(ImageSpec, Option<PathBuf>)>, AttachError> {
        let mut st = self.lock();
        Self::probe_failure(&mut st, "list", "*".into())?;
        Ok(st
            .mapped
            .iter()
            .map(|(s, m)| (s.clone(), Some(m.device.clone())))
            .collect())
    }

    fn owns_all_listed(&self) -> bool {
        !self.lock().not_owned
    }

    fn in_flight(&self, _image: &ImageSpec) -> bool {
        false
    }

    fn activity(&self, image: &ImageSpec) -> Option<u64> {
        let st = self.lock();
        st.mapped.contains_key(image).then_some(st.activity)
    }

    fn recover(&self, image: &ImageSpec) -> Result<bool, AttachError> {
        let mut st = self.lock();
        if !st.dead_servers.remove(image) {
            return Ok(false);
        }
        st.calls.push(AttachCall::Recover(image.clone()));
        Ok(true)
    }

    fn abort(&self, image: &ImageSpec) {
        self.lock().calls.push(AttachCall::Abort(image.clone()));
    }
}
