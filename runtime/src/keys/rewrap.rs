//! A KEK rotation's one step for one volume (docs/encryption.md, "Rotation"): the volume's
//! wrapped data key unwrapped by the old key-encryption key, wrapped again by the new one,
//! and the new wrapped form proven before it is returned: it unwraps under the new KEK to
//! the very key the old one gave. The data key itself, and so the LUKS header and the data,
//! are untouched; only its wrapped form (the record's `encryptedDEK`) changes.

use super::{Dek, Kek, KeyError, Result, WrappedDek};

/// `wrapped`, the data key of `volume` under `old`, wrapped again under `new`. A wrapped key
/// already under `new` is returned as it is (a rotation that is run again, or resumed after a
/// crash between a record's write and the next, does nothing twice). Errors: the old KEK does
/// not unwrap it (as [`Kek::unwrap`]), or the new form does not give the same key back
/// ([`KeyError::Wrap`]); no key byte is in either.
pub fn rewrap(wrapped: &WrappedDek, volume: &str, old: &Kek, new: &Kek) -> Result<WrappedDek> {
    if wrapped.kek_id() == new.id() {
        // Proven all the same: a record naming the new id must unwrap under it.
        new.unwrap(wrapped, volume)?;
        return Ok(wrapped.clone());
    }
    let dek = old.unwrap(wrapped, volume)?;
    let rewrapped = dek.wrap(new, volume)?;
    let back = new.unwrap(&rewrapped, volume)?;
    if back.expose() != dek.expose() {
        return Err(KeyError::Wrap(volume.to_owned()));
    }
    Ok(rewrapped)
}

/// `opening`'s bytes followed by `new`'s, for the one place both go: the pipe to a
/// `cryptsetup luksAddKey` that reads the key opening a slot and the key of the new slot
/// from its standard input, one after the other. Zeroed when dropped.
#[must_use]
pub fn key_pair(opening: &Dek, new: &Dek) -> zeroize::Zeroizing<Vec<u8>> {
    let mut both = zeroize::Zeroizing::new(Vec::with_capacity(2 * super::KEY_LEN));
    both.extend_from_slice(opening.expose());
    both.extend_from_slice(new.expose());
    both
}
