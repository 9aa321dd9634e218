//! The mountinfo parser against the kernel's documented example, this machine's table, real
//! and malformed lines, escapes, and mutations of all of them.

use super::*;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

const DOC_LINE: &[u8] =
    b"36 35 98:0 /mnt1 /mnt2 rw,noatime master:1 - ext3 /dev/root rw,errors=continue";

#[test]
fn kernel_documentation_example() {
    let m = parse_line(DOC_LINE).unwrap();
    assert_eq!(
        m,
        MountInfo {
            mount_id: 36,
            parent_id: 35,
            major: 98,
            minor: 0,
            root: PathBuf::from("/mnt1"),
            mount_point: PathBuf::from("/mnt2"),
            mount_options: "rw,noatime".to_owned(),
            optional_fields: vec!["master:1".to_owned()],
            fs_type: "ext3".to_owned(),
            source: "/dev/root".to_owned(),
            super_options: "rw,errors=continue".to_owned(),
        }
    );
    assert_eq!(m.dev(), (98, 0));
    assert!(!m.is_read_only());
}

#[test]
fn this_machines_mountinfo_parses_fully() {
    let table = std::fs::read("/proc/self/mountinfo").expect("read /proc/self/mountinfo");
    let entries = parse(&table).unwrap();
    let lines = table
        .split(|&b| b == b'\n')
        .filter(|l| !l.is_empty())
        .count();
    assert_eq!(entries.len(), lines);
    assert!(entries.iter().any(|m| m.mount_point == Path::new("/")));
    for m in &entries {
        assert!(m.mount_point.is_absolute(), "{m:?}");
        assert!(!m.fs_type.is_empty(), "{m:?}");
    }
}

#[test]
fn real_lines() {
    let lines: [&[u8]; 4] = [
        b"27 1 254:0 / / rw,relatime - ext4 /dev/vda rw,discard,resuid=65534\n",
        b"22 27 0:21 / /proc rw,relatime - proc proc rw",
        b"41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw",
        b"28 27 0:25 / /mnt/x ro,nosuid,nodev,relatime - tmpfs tools ro,size=4k,mode=755",
    ];
    let parsed: Vec<MountInfo> = lines.iter().map(|l| parse_line(l).unwrap()).collect();
    assert_eq!(parsed[0].mount_point, Path::new("/"));
    assert_eq!(parsed[0].source, "/dev/vda");
    assert_eq!(parsed[0].dev(), (254, 0));
    assert_eq!(parsed[1].fs_type, "proc");
    assert_eq!(parsed[2].super_options, "rw");
    assert!(parsed[3].is_read_only());
    assert!(parsed.iter().all(|m| m.optional_fields.is_empty()));
}

#[test]
fn escaped_paths_and_source() {
    let line = b"100 27 8:1 /a\\040b /mnt/x\\011y\\012z\\134w rw - ext4 /dev/my\\040disk rw";
    let m = parse_line(line).unwrap();
    assert_eq!(m.root, Path::new("/a b"));
    assert_eq!(m.mount_point, Path::new("/mnt/x\ty\nz\\w"));
    assert_eq!(m.source, "/dev/my disk");
}

#[test]
fn non_utf8_paths() {
    let line = b"100 27 8:1 /\xff\xfe /mnt/\\377x rw - ext4 /dev/sda1 rw";
    let m = parse_line(line).unwrap();
    assert_eq!(m.root.as_os_str().as_bytes(), b"/\xff\xfe");
    assert_eq!(m.mount_point.as_os_str().as_bytes(), b"/mnt/\xffx");
}

#[test]
fn many_optional_fields() {
    let line = b"1 2 0:3 / /x rw shared:1 master:2 propagate_from:3 unbindable - tmpfs t rw";
    let m = parse_line(line).unwrap();
    assert_eq!(
        m.optional_fields,
        ["shared:1", "master:2", "propagate_from:3", "unbindable"]
    );
    assert_eq!(m.fs_type, "tmpfs");
}

#[test]
fn none_and_empty_source() {
    let m = parse_line(b"1 2 0:3 / /x rw - tmpfs none rw").unwrap();
    assert_eq!(m.source, "none");
    let m = parse_line(b"1 2 0:3 / /x rw - tmpfs  rw,size=4k").unwrap();
    assert_eq!(m.source, "");
    assert_eq!(m.super_options, "rw,size=4k");
}

#[test]
fn fs_type_with_subtype() {
    let m = parse_line(b"1 2 0:50 / /x rw - fuse.sshfs u@h:/ rw,user_id=0").unwrap();
    assert_eq!(m.fs_type, "fuse.sshfs");
    assert_eq!(m.source, "u@h:/");
}

#[test]
fn read_only_detection() {
    let base = parse_line(DOC_LINE).unwrap();
    let with = |mount: &str, sup: &str| MountInfo {
        mount_options: mount.to_owned(),
        super_options: sup.to_owned(),
        ..base.clone()
    };
    assert!(with("ro,relatime", "rw").is_read_only());
    assert!(with("rw,relatime", "ro,errors=remount-ro").is_read_only());
    assert!(!with("rw,relatime", "rw,errors=remount-ro").is_read_only());
    assert!(!with("rox", "xro").is_read_only());
}

#[test]
fn trailing_newline_blank_lines_and_line_numbers() {
    let table = b"\n1 0 0:1 / / rw - rootfs rootfs rw\n\n  \n2 1 0:2 / /x rw - tmpfs t rw\n";
    let entries = parse(table).unwrap();
    assert_eq!(entries.len(), 2);
    assert_eq!(entries[1].mount_point, Path::new("/x"));
    let no_newline = b"1 0 0:1 / / rw - rootfs rootfs rw";
    assert_eq!(parse(no_newline).unwrap().len(), 1);
    assert_eq!(parse(b"").unwrap(), []);
    assert_eq!(parse(b"\n\n").unwrap(), []);

    let bad = b"1 0 0:1 / / rw - rootfs rootfs rw\n\nx 1 0:2 / /x rw - tmpfs t rw\n";
    let err = parse(bad).unwrap_err();
    assert_eq!(err.line(), 3);
    assert_eq!(
        err.to_string(),
        "mountinfo line 3: mount id is not a decimal number"
    );
}

#[test]
fn malformed_lines() {
    use ParseError::*;
    let cases: [(&[u8], ParseError); 27] = [
        (
            b"",
            InvalidNumber {
                line: 1,
                field: "mount id",
            },
        ),
        (
            b"x 2 0:3 / /x rw - t s rw",
            InvalidNumber {
                line: 1,
                field: "mount id",
            },
        ),
        (
            b"+1 2 0:3 / /x rw - t s rw",
            InvalidNumber {
                line: 1,
                field: "mount id",
            },
        ),
        (
            b"-1 2 0:3 / /x rw - t s rw",
            InvalidNumber {
                line: 1,
                field: "mount id",
            },
        ),
        (
            b"1 2x 0:3 / /x rw - t s rw",
            InvalidNumber {
                line: 1,
                field: "parent id",
            },
        ),
        (
            b"1 18446744073709551616 0:3 / /x rw - t s rw",
            InvalidNumber {
                line: 1,
                field: "parent id",
            },
        ),
        (
            b" 1 2 0:3 / /x rw - t s rw",
            InvalidNumber {
                line: 1,
                field: "mount id",
            },
        ),
        (
            b"1",
            MissingField {
                line: 1,
                field: "parent id",
            },
        ),
        (
            b"1 2",
            MissingField {
                line: 1,
                field: "device",
            },
        ),
        (b"1 2 03 / /x rw - t s rw", InvalidDevice { line: 1 }),
        (b"1 2 0: / /x rw - t s rw", InvalidDevice { line: 1 }),
        (b"1 2 :3 / /x rw - t s rw", InvalidDevice { line: 1 }),
        (b"1 2 a:b / /x rw - t s rw", InvalidDevice { line: 1 }),
        (b"1 2 0:3:4 / /x rw - t s rw", InvalidDevice { line: 1 }),
        (
            b"1 2 4294967296:0 / /x rw - t s rw",
            InvalidDevice { line: 1 },
        ),
        (
            b"1 2 0:3",
            MissingField {
                line: 1,
                field: "root",
            },
        ),
        (
            b"1 2 0:3 /",
            MissingField {
                line: 1,
                field: "mount point",
            },
        ),
        (
            b"1 2 0:3  /x rw - t s rw",
            EmptyField {
                line: 1,
                field: "root",
            },
        ),
        (
            b"1 2 0:3 / /x",
            MissingField {
                line: 1,
                field: "mount options",
            },
        ),
        (b"1 2 0:3 / /x rw", MissingSeparator { line: 1 }),
        (
            b"1 2 0:3 / /x rw shared:1 t s rw",
            MissingSeparator { line: 1 },
        ),
        (
            b"1 2 0:3 / /x rw shared:1  - t s rw",
            EmptyField {
                line: 1,
                field: "optional field",
            },
        ),
        (
            b"1 2 0:3 / /x rw -",
            MissingField {
                line: 1,
                field: "filesystem type",
            },
        ),
        (
            b"1 2 0:3 / /x rw -  s rw",
            EmptyField {
                line: 1,
                field: "filesystem type",
            },
        ),
        (
            b"1 2 0:3 / /x rw - t",
            MissingField {
                line: 1,
                field: "source",
            },
        ),
        (
            b"1 2 0:3 / /x rw - t s",
            MissingField {
                line: 1,
                field: "super options",
            },
        ),
        (b"1 2 0:3 / /x rw - t s rw extra", TrailingField { line: 1 }),
    ];
    for (line, expected) in cases {
        assert_eq!(
            parse_line(line).unwrap_err(),
            expected,
            "{:?}",
            String::from_utf8_lossy(line)
        );
    }
}

#[test]
fn error_messages_name_the_line() {
    let err = parse(b"\n\n1 2 0:3 / /x rw\n").unwrap_err();
    let text = err.to_string();
    assert_eq!(
        text,
        "mountinfo line 3: no \"-\" separator after the optional fields"
    );
}

#[test]
fn unescape_edge_cases() {
    let cases: [(&[u8], &[u8]); 12] = [
        (b"", b""),
        (b"plain", b"plain"),
        (b"\\040", b" "),
        (b"a\\011b\\012c\\134d", b"a\tb\nc\\d"),
        (b"\\134040", b"\\040"),
        (b"\\", b"\\"),
        (b"x\\04", b"x\\04"),
        (b"\\08a", b"\\08a"),
        (b"\\400", b"\\400"),
        (b"\\377", b"\xff"),
        (b"\\000", b"\0"),
        (b"\\\\040", b"\\ "),
    ];
    for (input, expected) in cases {
        assert_eq!(
            unescape(input),
            expected,
            "{:?}",
            String::from_utf8_lossy(input)
        );
    }
}

#[test]
fn for_each_stops_early() {
    let table = synthetic(100);
    let mut seen = 0;
    let result = for_each(&table, |m| {
        seen += 1;
        if m.mount_id == 1010 {
            ControlFlow::Break(())
        } else {
            ControlFlow::Continue(())
        }
    });
    assert_eq!(result, Ok(()));
    assert_eq!(seen, 11);

    // Lines after the stop are not parsed, even when malformed.
    let mut table = synthetic(3);
    table.extend_from_slice(b"garbage\n");
    let mut first = None;
    let result = for_each(&table, |m| {
        first = Some(m.mount_id);
        ControlFlow::Break(())
    });
    assert_eq!(result, Ok(()));
    assert_eq!(first, Some(1000));
    assert_eq!(parse(&table).unwrap_err().line(), 4);
}

/// A table of `n` mounts with varied escapes and optional fields.
fn synthetic(n: usize) -> Vec<u8> {
    let mut table = Vec::new();
    for i in 0..n {
        let optional = match i % 3 {
            0 => String::new(),
            1 => format!(" shared:{i}"),
            _ => format!(" shared:{i} master:{}", i / 2),
        };
        let source = if i % 5 == 0 { "" } else { "/dev/sdb" };
        let line = format!(
            "{} {} {}:{} /vol\\040{i} /var/lib/kubelet/pods/{i}/mount rw,relatime{optional} \
             - ext4 {source} rw\n",
            1000 + i,
            999 + i,
            i % 256,
            i,
        );
        table.extend_from_slice(line.as_bytes());
    }
    table
}

#[test]
fn ten_thousand_lines() {
    let table = synthetic(10_000);
    let entries = parse(&table).unwrap();
    assert_eq!(entries.len(), 10_000);
    for (i, m) in entries.iter().enumerate() {
        assert_eq!(m.mount_id, 1000 + i as u64);
        assert_eq!(m.parent_id, 999 + i as u64);
        assert_eq!(m.dev(), ((i % 256) as u32, i as u32));
        assert_eq!(m.root, PathBuf::from(format!("/vol {i}")));
        let point = format!("/var/lib/kubelet/pods/{i}/mount");
        assert_eq!(m.mount_point, PathBuf::from(point));
        assert_eq!(m.optional_fields.len(), i % 3);
        assert_eq!(m.source, if i % 5 == 0 { "" } else { "/dev/sdb" });
    }
}

/// A small deterministic xorshift generator, so the test needs no dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

#[test]
fn prefixes_and_mutations_never_panic() {
    let table = synthetic(20);
    for len in 0..=table.len() {
        let _ = parse(&table[..len]);
        let _ = parse_line(&table[..len]);
    }
    let alphabet = b" -:\\0123456789abc\n\xff/";
    let mut rng = Rng(0x2545_f491_4f6c_dd1d);
    for _ in 0..2000 {
        let mut buf = table.clone();
        for _ in 0..(rng.next() % 8) {
            let i = (rng.next() % buf.len() as u64) as usize;
            let j = (rng.next() % alphabet.len() as u64) as usize;
            buf[i] = alphabet[j];
        }
        if let Ok(entries) = parse(&buf) {
            assert!(entries.len() <= 20 + 8);
        }
    }
}
