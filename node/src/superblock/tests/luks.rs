//! Real LUKS1 and LUKS2 headers made by `cryptsetup luksFormat` on an image file (no
//! device-mapper needed), when cryptsetup is installed: never blank, also with the primary
//! header wiped, at every LUKS2 metadata size.

use super::super::*;
use super::mkfs::{TempImage, tool, windows};
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::Path;
use std::process::{Command, Stdio};

/// The LUKS2 metadata sizes cryptsetup accepts: the secondary header starts at each.
const METADATA_SIZES: [u64; 9] = [
    0x4000, 0x8000, 0x10000, 0x20000, 0x40000, 0x80000, 0x100000, 0x200000, 0x400000,
];

/// The UUID every image here is made with (`--uuid`).
const LUKS_UUID_TEXT: &str = "6d6f6f72-0000-4000-8000-000000000040";

/// What the probe says of an image made here.
fn luks(version: u16) -> Content {
    Content::Luks {
        version,
        uuid: Some(LUKS_UUID_TEXT.to_owned()),
    }
}

/// A 32 MiB image luksFormatted with `args`, or `None` if cryptsetup is not installed. The
/// passphrase goes through a pipe; a cheap PBKDF keeps the test fast.
fn luks_format(tag: &str, args: &[&str]) -> Option<TempImage> {
    let cryptsetup = tool("cryptsetup")?;
    let image = TempImage::new(tag, 32 << 20);
    let mut child = Command::new(cryptsetup)
        .args(["luksFormat", "--batch-mode", "--key-file=-"])
        .args(["--pbkdf-force-iterations", "1000", "--uuid", LUKS_UUID_TEXT])
        .args(args)
        .arg(&image.0)
        .stdin(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run cryptsetup");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(b"not a real passphrase")
        .expect("write passphrase");
    let out = child.wait_with_output().expect("wait for cryptsetup");
    assert!(
        out.status.success(),
        "cryptsetup luksFormat {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Some(image)
}

/// The whole blank proof, as `Engine::probe_device` makes it: the two windows, then, if they
/// are blank, the far blocks inside the image.
fn blank_proof(path: &Path) -> Content {
    let (head, tail, size) = windows(path);
    let content = probe(&head, &tail, size);
    if !content.is_blank() {
        return content;
    }
    let mut file = File::open(path).expect("open image");
    let far: Vec<(u64, Vec<u8>)> = FAR_OFFSETS
        .iter()
        .filter(|&&at| at + FAR_LEN as u64 <= size)
        .map(|&at| {
            let mut block = vec![0; FAR_LEN];
            file.seek(SeekFrom::Start(at)).expect("seek");
            file.read_exact(&mut block).expect("read far block");
            (at, block)
        })
        .collect();
    let far: Vec<(u64, &[u8])> = far.iter().map(|(at, b)| (*at, &b[..])).collect();
    confirm_blank(&far)
}

/// Overwrites the first `len` bytes of the image with zeros.
fn wipe_start(path: &Path, len: u64) {
    let mut file = OpenOptions::new().write(true).open(path).expect("open");
    file.write_all(&vec![0; len as usize]).expect("wipe");
    file.sync_all().expect("sync");
}

#[test]
fn real_luks1() {
    let Some(image) = luks_format("luks1", &["--type", "luks1"]) else {
        return;
    };
    let (head, tail, size) = windows(&image.0);
    assert_eq!(probe(&head, &tail, size), luks(1));
    assert_eq!(probe_quick(&head), None);
    assert_eq!(blank_proof(&image.0), luks(1));
}

#[test]
fn real_luks2_at_every_metadata_size_also_with_its_primary_header_wiped() {
    for metadata in METADATA_SIZES {
        let size = metadata.to_string();
        let args = [
            "--type",
            "luks2",
            "--pbkdf",
            "pbkdf2",
            "--luks2-metadata-size",
            &size,
        ];
        let Some(image) = luks_format(&format!("luks2-{metadata:x}"), &args) else {
            return;
        };
        let (head, tail, size) = windows(&image.0);
        assert_eq!(probe(&head, &tail, size), luks(2), "metadata {metadata:#x}");
        assert_eq!(probe_quick(&head), None);
        // The primary header and its JSON area gone: cryptsetup can still open the volume
        // from the secondary header, so the device is LUKS2, never blank.
        wipe_start(&image.0, metadata);
        assert_eq!(
            blank_proof(&image.0),
            luks(2),
            "metadata {metadata:#x}, primary header wiped"
        );
    }
}

/// The key slots of each LUKS2 header copy on `path`: the primary's and the secondary's, as
/// the stage reads them.
fn key_slots_of_copies(path: &Path) -> Vec<Option<usize>> {
    let mut file = File::open(path).expect("open image");
    luks2_header_offsets()
        .into_iter()
        .filter_map(|at| {
            let mut block = vec![0; LUKS2_BINARY_HEADER];
            file.seek(SeekFrom::Start(at)).expect("seek");
            file.read_exact(&mut block).expect("read header block");
            let len = luks2_header_size(&block, at)?;
            let mut header = vec![0; len];
            file.seek(SeekFrom::Start(at)).expect("seek");
            file.read_exact(&mut header).expect("read header");
            Some(luks2_key_slots(&header))
        })
        .collect()
}

#[test]
fn real_luks2_header_key_slots_are_read_from_both_copies_also_when_there_are_none() {
    let args = ["--type", "luks2", "--pbkdf", "pbkdf2"];
    let Some(image) = luks_format("luks2-slots", &args) else {
        return;
    };
    assert_eq!(key_slots_of_copies(&image.0), [Some(1), Some(1)]);
    // Its last key slot killed: what a luksFormat cut before its key slot leaves.
    let out = Command::new(tool("cryptsetup").expect("cryptsetup"))
        .args(["luksKillSlot", "--batch-mode"])
        .arg(&image.0)
        .arg("0")
        .output()
        .expect("run cryptsetup");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(key_slots_of_copies(&image.0), [Some(0), Some(0)]);
    // A JSON area torn: unknown, never "no key slot".
    let mut torn = vec![0; 0x4000];
    File::open(&image.0)
        .expect("open")
        .read_exact(&mut torn)
        .expect("read");
    torn[LUKS2_BINARY_HEADER + 20] = b'\xff';
    assert_eq!(luks2_key_slots(&torn), None);
    // A LUKS1 header has no LUKS2 copies.
    let Some(luks1) = luks_format("luks1-slots", &["--type", "luks1"]) else {
        return;
    };
    assert!(key_slots_of_copies(&luks1.0).is_empty());
}
