//! An in-memory [`Attacher`] for tests without root: "devices" are entries in a table, bound
//! to the identity of real files, with hooks to simulate what the real world does (a device
//! that vanishes, a number reused for another file, a leaked device, no free device, a race
//! lost every time).

use std::collections::BTreeMap;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};

use super::attach::{AttachError, Attacher, Attachment, Detach, FileId};

/// A failure [`FakeAttacher::attach`] returns once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FakeFailure {
    /// No free device.
    NoFreeDevice,
    /// Lost every race.
    Busy,
    /// An I/O error.
    Io,
}

#[derive(Debug, Clone)]
struct FakeDevice {
    backing: PathBuf,
    file: FileId,
    read_only: bool,
    size_refreshes: u32,
}

#[derive(Debug, Default)]
struct State {
    devices: BTreeMap<u32, FakeDevice>,
    next_failure: Option<FakeFailure>,
    unavailable: bool,
    flushes: u32,
    /// Devices a detach leaves bound (an opener keeps them).
    held_open: Vec<u32>,
}

/// The fake [`Attacher`].
#[derive(Debug, Default)]
pub struct FakeAttacher {
    state: Mutex<State>,
}

/// Where fake devices live (never a real path).
pub const FAKE_DEV_DIR: &str = "/fake-dev";

fn number_of(device: &Path) -> Option<u32> {
    device
        .strip_prefix(FAKE_DEV_DIR)
        .ok()?
        .to_str()?
        .strip_prefix("loop")?
        .parse()
        .ok()
}

fn device_path(n: u32) -> PathBuf {
    PathBuf::from(format!("{FAKE_DEV_DIR}/loop{n}"))
}

impl FakeAttacher {
    /// No devices.
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn bind_locked(st: &mut State, backing: &Path, read_only: bool) -> io::Result<PathBuf> {
        let file = FileId::of_path(backing)?;
        let n = (0..).find(|n| !st.devices.contains_key(n)).unwrap_or(0);
        st.devices.insert(
            n,
            FakeDevice {
                backing: backing.to_path_buf(),
                file,
                read_only,
                size_refreshes: 0,
            },
        );
        Ok(device_path(n))
    }

    /// Binds `backing` outside any record (a device leaked by a crash, or someone else's).
    pub fn bind(&self, backing: &Path) -> io::Result<PathBuf> {
        Self::bind_locked(&mut self.lock(), backing, false)
    }

    /// Makes `device` vanish (a reboot, or someone else's detach).
    pub fn remove(&self, device: &Path) {
        if let Some(n) = number_of(device) {
            self.lock().devices.remove(&n);
        }
    }

    /// Rebinds `device` to another file (its number reused after it went away).
    pub fn rebind(&self, device: &Path, backing: &Path) -> io::Result<()> {
        let file = FileId::of_path(backing)?;
        if let Some(n) = number_of(device) {
            self.lock().devices.insert(
                n,
                FakeDevice {
                    backing: backing.to_path_buf(),
                    file,
                    read_only: false,
                    size_refreshes: 0,
                },
            );
        }
        Ok(())
    }

    /// The next attach fails with `f`.
    pub fn fail_next_attach(&self, f: FakeFailure) {
        self.lock().next_failure = Some(f);
    }

    /// Makes [`Attacher::check`] fail (or work again).
    pub fn set_unavailable(&self, unavailable: bool) {
        self.lock().unavailable = unavailable;
    }

    /// Keeps `device` bound through a detach, as an opener would.
    pub fn hold_open(&self, device: &Path) {
        if let Some(n) = number_of(device) {
            self.lock().held_open.push(n);
        }
    }

    /// Every bound device and its backing file.
    pub fn devices(&self) -> Vec<(PathBuf, PathBuf)> {
        self.lock()
            .devices
            .iter()
            .map(|(n, d)| (device_path(*n), d.backing.clone()))
            .collect()
    }

    /// Whether `device` is bound read-only.
    pub fn is_read_only(&self, device: &Path) -> Option<bool> {
        let n = number_of(device)?;
        self.lock().devices.get(&n).map(|d| d.read_only)
    }

    /// How often `device` was told its file grew.
    pub fn size_refreshes(&self, device: &Path) -> u32 {
        number_of(device)
            .and_then(|n| self.lock().devices.get(&n).map(|d| d.size_refreshes))
            .unwrap_or(0)
    }

    /// How many flushes were asked for.
    pub fn flushes(&self) -> u32 {
        self.lock().flushes
    }

    fn checked(&self, device: &Path, expect: FileId) -> Result<u32, AttachError> {
        let st = self.lock();
        match number_of(device).and_then(|n| st.devices.get(&n).map(|d| (n, d.file))) {
            Some((n, file)) if file == expect => Ok(n),
            _ => Err(AttachError::NotOurs(device.to_path_buf())),
        }
    }
}

impl Attacher for FakeAttacher {
    fn attach(&self, backing: &Path, read_only: bool) -> Result<PathBuf, AttachError> {
        let mut st = self.lock();
        match st.next_failure.take() {
            Some(FakeFailure::NoFreeDevice) => {
                return Err(AttachError::NoFreeDevice(io::Error::from_raw_os_error(
                    rustix::io::Errno::NOSPC.raw_os_error(),
                )));
            }
            Some(FakeFailure::Busy) => return Err(AttachError::Busy(3)),
            Some(FakeFailure::Io) => {
                return Err(AttachError::Sys {
                    step: "LOOP_CONFIGURE",
                    path: PathBuf::from(FAKE_DEV_DIR),
                    source: io::Error::from_raw_os_error(rustix::io::Errno::IO.raw_os_error()),
                });
            }
            None => {}
        }
        Self::bind_locked(&mut st, backing, read_only).map_err(|e| AttachError::Sys {
            step: "open backing file",
            path: backing.to_path_buf(),
            source: e,
        })
    }

    fn detach(&self, device: &Path, expect: FileId) -> Result<Detach, AttachError> {
        let mut st = self.lock();
        let Some(n) = number_of(device) else {
            return Ok(Detach::AlreadyGone);
        };
        match st.devices.get(&n) {
            None => Ok(Detach::AlreadyGone),
            Some(d) if d.file != expect => Ok(Detach::NotOurs),
            Some(_) if st.held_open.contains(&n) => Ok(Detach::Deferred),
            Some(_) => {
                st.devices.remove(&n);
                Ok(Detach::Done)
            }
        }
    }

    fn backing_of(&self, device: &Path) -> Result<Option<FileId>, AttachError> {
        let st = self.lock();
        Ok(number_of(device).and_then(|n| st.devices.get(&n).map(|d| d.file)))
    }

    fn refresh_size(&self, device: &Path, expect: FileId) -> Result<(), AttachError> {
        let n = self.checked(device, expect)?;
        if let Some(d) = self.lock().devices.get_mut(&n) {
            d.size_refreshes += 1;
        }
        Ok(())
    }

    fn flush(&self, device: &Path, expect: FileId) -> Result<(), AttachError> {
        self.checked(device, expect)?;
        self.lock().flushes += 1;
        Ok(())
    }

    fn list(&self, root: &Path) -> Result<Vec<Attachment>, AttachError> {
        let st = self.lock();
        Ok(st
            .devices
            .iter()
            .filter(|(_, d)| d.backing.starts_with(root))
            .map(|(n, d)| {
                // A device whose file was unlinked reports it as the kernel does.
                let deleted = FileId::of_path(&d.backing).ok() != Some(d.file);
                Attachment {
                    device: device_path(*n),
                    backing: d.backing.clone(),
                    deleted,
                    file: d.file,
                    read_only: d.read_only,
                }
            })
            .collect())
    }

    fn check(&self) -> Result<(), AttachError> {
        if self.lock().unavailable {
            return Err(AttachError::Sys {
                step: "open",
                path: PathBuf::from("/dev/loop-control"),
                source: io::Error::from_raw_os_error(rustix::io::Errno::NOENT.raw_os_error()),
            });
        }
        Ok(())
    }
}
