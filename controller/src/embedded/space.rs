//! What a data dir can still take: the space model behind GetCapacity and behind every
//! operation that takes space (create, expand, clone, restore, snapshot).
//!
//! Two kinds of volume share the data dir's filesystem:
//!
//! * **thick** (`provisioning: thick`): the whole file is allocated when it is made
//!   (`fallocate`) and when it grows, and never shares an extent with another file, so no
//!   write to it ever needs space it does not already hold;
//! * **thin** (the default): a sparse file, which takes space as it is written.
//!
//! What thin volumes may still claim, their sizes minus what they hold, is their *unbacked*
//! bytes. With an overcommit ratio `r` (moor-controller `--thin-overcommit`), the backend keeps
//! `unbacked ≤ r × free`, free being what the filesystem has left: at `r = 1` every thin
//! volume can be written whole (as long as nothing else fills the filesystem), at `r = 2` the
//! free space backs half of what thin volumes may still claim. An operation that takes space
//! is admitted only if that holds after it ([`admits`]); one that would break it is refused
//! with RESOURCE_EXHAUSTED and leaves nothing behind. Without a ratio, thin volumes are not
//! limited (what the one-node backend always did) and only the filesystem's free space counts.
//!
//! What a new volume can have ([`thick_available`], [`thin_available`]) follows from the same
//! rule, so GetCapacity says exactly what CreateVolume will admit.

use std::fmt;
use std::os::unix::fs::MetadataExt as _;
use std::path::Path;

/// How much thin volumes may be overcommitted, in thousandths (1000: not at all), or None:
/// without limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Overcommit(Option<u64>);

/// The largest ratio accepted: beyond it a "limit" limits nothing.
pub const MAX_RATIO: f64 = 1000.0;

impl Overcommit {
    /// No limit.
    pub const UNLIMITED: Self = Self(None);

    /// A ratio of at least 1 (a thin volume never backed by more than all the free space) and
    /// at most [`MAX_RATIO`]; kept to the thousandth.
    pub fn ratio(r: f64) -> Result<Self, String> {
        if !r.is_finite() || !(1.0..=MAX_RATIO).contains(&r) {
            return Err(format!(
                "{r}: the thin overcommit ratio is at least 1 (no overcommit) and at most \
                 {MAX_RATIO}"
            ));
        }
        // In range and finite: the product fits a u64.
        Ok(Self(Some((r * 1000.0).round() as u64)))
    }

    /// The ratio in thousandths, if there is one.
    pub fn milli(self) -> Option<u64> {
        self.0
    }
}

impl fmt::Display for Overcommit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            None => f.write_str("unlimited"),
            Some(m) => write!(f, "{}", m as f64 / 1000.0),
        }
    }
}

/// What the data dir's filesystem has, and what thin volumes may still claim of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Space {
    /// The filesystem's size.
    pub total: u64,
    /// What it has free (for an unprivileged writer: reserved blocks do not count).
    pub free: u64,
    /// What the thin volumes may still claim: their sizes minus what they hold.
    pub unbacked: u64,
}

/// What an operation will take.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Claim {
    /// Bytes it allocates (a thick volume, a copy not yet made).
    pub allocates: u64,
    /// Bytes it adds to what thin volumes may claim (a new or grown thin volume).
    pub unbacked: u64,
}

/// What operations admitted and not yet finished have claimed: their files are still being
/// made, not yet measured (a thin volume's file counts once its record is saved), so every
/// admission counts them on top of what [`measure`] finds. Counting an operation twice while
/// its file is made and its claim still pending only refuses more, never admits more.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Pending {
    allocates: u64,
    unbacked: u64,
}

impl Pending {
    /// `measured` with the pending claims taken: their allocations out of what is free, their
    /// unbacked bytes added.
    pub fn apply(&self, measured: Space) -> Space {
        Space {
            total: measured.total,
            free: measured.free.saturating_sub(self.allocates),
            unbacked: measured.unbacked.saturating_add(self.unbacked),
        }
    }

    /// `c` is now pending.
    pub fn add(&mut self, c: Claim) {
        self.allocates = self.allocates.saturating_add(c.allocates);
        self.unbacked = self.unbacked.saturating_add(c.unbacked);
    }

    /// `c` (added before) no longer is.
    pub fn remove(&mut self, c: Claim) {
        self.allocates = self.allocates.saturating_sub(c.allocates);
        self.unbacked = self.unbacked.saturating_sub(c.unbacked);
    }
}

/// `x × milli / 1000`, without overflow.
fn scale(x: u64, milli: u64) -> u64 {
    u64::try_from(u128::from(x) * u128::from(milli) / 1000).unwrap_or(u64::MAX)
}

/// The free space kept for the thin volumes' claims: `unbacked / r`, rounded up.
pub fn reserve(s: &Space, oc: Overcommit) -> u64 {
    match oc.0 {
        None => 0,
        Some(m) => u64::try_from((u128::from(s.unbacked) * 1000).div_ceil(u128::from(m.max(1))))
            .unwrap_or(u64::MAX),
    }
}

/// The largest thick volume (or allocation) [`admits`] takes now.
pub fn thick_available(s: &Space, oc: Overcommit) -> u64 {
    s.free.saturating_sub(reserve(s, oc))
}

/// The largest thin volume [`admits`] takes now; None: any size (no ratio).
pub fn thin_available(s: &Space, oc: Overcommit) -> Option<u64> {
    oc.0.map(|m| scale(s.free, m).saturating_sub(s.unbacked))
}

/// Whether the data dir can take `c` now; the error says why not.
pub fn admits(s: &Space, oc: Overcommit, c: Claim) -> Result<(), String> {
    let Some(free) = s.free.checked_sub(c.allocates) else {
        return Err(format!(
            "it needs {} bytes and the data dir's filesystem has {} free",
            c.allocates, s.free
        ));
    };
    if let Some(m) = oc.0 {
        let unbacked = s.unbacked.saturating_add(c.unbacked);
        if unbacked > scale(free, m) {
            return Err(format!(
                "thin volumes could then claim {unbacked} bytes with {free} free, more than the \
                 overcommit ratio {oc} allows (what thin volumes and thick ones can still have: \
                 {} and {} bytes)",
                thin_available(s, oc).unwrap_or(u64::MAX),
                thick_available(s, oc)
            ));
        }
    }
    Ok(())
}

/// The bytes a file holds (its allocated blocks) and its size.
pub fn held(path: &Path) -> std::io::Result<(u64, u64)> {
    let m = std::fs::metadata(path)?;
    Ok((m.blocks().saturating_mul(512), m.len()))
}

/// Measures the data dir at `root`, with `thin` the thin volumes' files (a file that is gone
/// claims nothing).
pub fn measure<'a>(
    root: &Path,
    thin: impl IntoIterator<Item = &'a Path>,
) -> std::io::Result<Space> {
    let st = rustix::fs::statvfs(root)?;
    let unbacked = thin
        .into_iter()
        .filter_map(|p| held(p).ok())
        .map(|(holds, size)| size.saturating_sub(holds))
        .fold(0u64, u64::saturating_add);
    Ok(Space {
        total: st.f_blocks.saturating_mul(st.f_frsize),
        free: st.f_bavail.saturating_mul(st.f_frsize),
        unbacked,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    fn space(free: u64, unbacked: u64) -> Space {
        Space {
            total: 100 * GIB,
            free,
            unbacked,
        }
    }

    #[test]
    fn ratios_are_checked() {
        assert_eq!(Overcommit::ratio(1.0).unwrap().milli(), Some(1000));
        assert_eq!(Overcommit::ratio(2.5).unwrap().milli(), Some(2500));
        assert_eq!(Overcommit::ratio(2.5).unwrap().to_string(), "2.5");
        assert_eq!(Overcommit::UNLIMITED.to_string(), "unlimited");
        for bad in [0.0, 0.5, -1.0, f64::NAN, f64::INFINITY, 1000.5] {
            assert!(Overcommit::ratio(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn without_a_ratio_only_free_space_counts() {
        let s = space(10 * GIB, 500 * GIB);
        let oc = Overcommit::UNLIMITED;
        assert_eq!(thick_available(&s, oc), 10 * GIB);
        assert_eq!(thin_available(&s, oc), None);
        assert!(
            admits(
                &s,
                oc,
                Claim {
                    allocates: 0,
                    unbacked: 1 << 50
                }
            )
            .is_ok()
        );
        assert!(
            admits(
                &s,
                oc,
                Claim {
                    allocates: 10 * GIB,
                    unbacked: 0
                }
            )
            .is_ok()
        );
        assert!(
            admits(
                &s,
                oc,
                Claim {
                    allocates: 10 * GIB + 1,
                    unbacked: 0
                }
            )
            .is_err()
        );
    }

    #[test]
    fn at_ratio_one_thin_volumes_are_backed_whole() {
        let oc = Overcommit::ratio(1.0).unwrap();
        // 10 GiB free, thin volumes may still claim 4 GiB of it.
        let s = space(10 * GIB, 4 * GIB);
        assert_eq!(reserve(&s, oc), 4 * GIB);
        assert_eq!(thick_available(&s, oc), 6 * GIB);
        assert_eq!(thin_available(&s, oc), Some(6 * GIB));
        let thick = |n| Claim {
            allocates: n,
            unbacked: 0,
        };
        let thin = |n| Claim {
            allocates: 0,
            unbacked: n,
        };
        assert!(admits(&s, oc, thick(6 * GIB)).is_ok());
        assert!(admits(&s, oc, thick(6 * GIB + 1)).is_err());
        assert!(admits(&s, oc, thin(6 * GIB)).is_ok());
        let e = admits(&s, oc, thin(6 * GIB + 1)).unwrap_err();
        assert!(e.contains("overcommit ratio 1"), "{e}");
        // What GetCapacity says is exactly what is admitted.
        for oc in [1.0, 1.5, 3.0].map(|r| Overcommit::ratio(r).unwrap()) {
            for s in [space(10 * GIB, 0), space(7 * GIB + 3, 2 * GIB + 1)] {
                let t = thick_available(&s, oc);
                assert!(admits(&s, oc, thick(t)).is_ok(), "{s:?} {oc}");
                assert!(admits(&s, oc, thick(t + 1)).is_err(), "{s:?} {oc}");
                let n = thin_available(&s, oc).unwrap();
                assert!(admits(&s, oc, thin(n)).is_ok(), "{s:?} {oc}");
                assert!(admits(&s, oc, thin(n + 1)).is_err(), "{s:?} {oc}");
            }
        }
    }

    #[test]
    fn a_ratio_overcommits_thin_volumes_and_keeps_thick_ones_clear_of_them() {
        let oc = Overcommit::ratio(2.0).unwrap();
        let s = space(10 * GIB, 4 * GIB);
        // Twice the free space may be claimed by thin volumes: 20 GiB, 4 of them already.
        assert_eq!(thin_available(&s, oc), Some(16 * GIB));
        // A thick volume must leave half of what thin volumes may claim free: 2 GiB.
        assert_eq!(thick_available(&s, oc), 8 * GIB);
        // A full filesystem takes nothing more of either kind.
        let full = space(0, 4 * GIB);
        assert_eq!(thin_available(&full, oc), Some(0));
        assert_eq!(thick_available(&full, oc), 0);
        // Thin volumes that already claim more than the ratio allows (written elsewhere
        // filled the filesystem) leave nothing for anyone.
        let over = space(GIB, 4 * GIB);
        assert_eq!(thin_available(&over, oc), Some(0));
        assert_eq!(thick_available(&over, oc), 0);
    }

    #[test]
    fn a_sparse_file_claims_what_it_does_not_hold() {
        let dir = crate::embedded::testdir::TestDir::new("space-measure");
        let f = dir.path().join("thin.img");
        let file = std::fs::File::create(&f).unwrap();
        file.set_len(64 << 20).unwrap();
        std::os::unix::fs::FileExt::write_all_at(&file, &[1u8; 1 << 20], 0).unwrap();
        file.sync_all().unwrap();
        let (holds, size) = held(&f).unwrap();
        assert_eq!(size, 64 << 20);
        let s = measure(dir.path(), [f.as_path(), dir.path().join("gone").as_path()]).unwrap();
        assert_eq!(s.unbacked, size - holds);
        assert!(s.unbacked >= 62 << 20 && s.unbacked < 64 << 20, "{s:?}");
        assert!(s.free > 0 && s.total >= s.free, "{s:?}");
    }
}
