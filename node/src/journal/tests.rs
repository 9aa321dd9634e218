use super::*;

fn sample() -> VolumeRecord {
    let mut r = VolumeRecord::new("vol/1 ü");
    r.stage = Some(StageRecord {
        path: "/k/plugins/s".into(),
        device: "/dev/loop3".into(),
        rdev: (7, 3),
        access: AccessRecord::Mount {
            fs_type: "ext4".into(),
            fs_options: vec![],
            group: Some(5),
        },
        attrs: MountAttrs::default(),
        access_mode: 7,
        phase: Phase::Done,
        fs_uuid: None,
        boot: Some("b1".into()),
    });
    r.publishes.insert(
        "/k/pods/t".into(),
        PublishRecord {
            block: false,
            attrs: MountAttrs::default(),
            access_mode: 7,
            phase: Phase::Done,
            boot: None,
        },
    );
    r
}

#[test]
fn crc32c_by_eight_matches_bit_by_bit() {
    fn bitwise(data: &[u8]) -> u32 {
        let mut crc = !0u32;
        for &b in data {
            crc ^= u32::from(b);
            for _ in 0..8 {
                crc = if crc & 1 != 0 {
                    0x82F6_3B78 ^ (crc >> 1)
                } else {
                    crc >> 1
                };
            }
        }
        !crc
    }
    let mut x = 0x2545_F491_4F6C_DD1Du64;
    let data: Vec<u8> = (0..300)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect();
    for len in 0..data.len() {
        for start in [0, 1, 3, 7] {
            let d = &data[start.min(len)..len];
            assert_eq!(crc32c(d), bitwise(d), "len {len} start {start}");
        }
    }
}

#[test]
fn crc32c_known_value() {
    assert_eq!(crc32c(b"123456789"), 0xE306_9283);
    assert_eq!(crc32c(b""), 0);
    assert_eq!(crc32c(&[0u8; 32]), 0x8A91_36AA);
}

#[test]
fn round_trip() {
    let r = sample();
    assert_eq!(decode(&encode(&r)).unwrap(), r);
}

/// A record carries the boot it was written in; one written before moor kept it reads without
/// one, which no boot takes as an earlier one's (nor does a node whose boot is unknown).
#[test]
fn a_record_is_from_an_earlier_boot_only_when_both_boots_are_known_and_differ() {
    let r = sample();
    let line = String::from_utf8(encode(&r)).expect("utf-8");
    assert!(line.contains(r#""boot":"b1""#), "{line}");
    let mut old = r.clone();
    if let Some(s) = old.stage.as_mut() {
        s.boot = None;
    }
    let line = String::from_utf8(encode(&old)).expect("utf-8");
    assert!(!line.contains("boot"), "no boot, no field: {line}");
    assert_eq!(decode(line.as_bytes()), Ok(old));
    let (b1, b2) = (Boot::new(Some("b1".into())), Boot::new(Some("b2".into())));
    assert!(b2.is_earlier(Some("b1")));
    assert!(!b1.is_earlier(Some("b1")));
    assert!(!b2.is_earlier(None));
    assert!(!Boot::new(None).is_earlier(Some("b1")));
    assert!(!Boot::new(Some(String::new())).is_earlier(Some("b1")));
    assert_eq!(b2.stamp().as_deref(), Some("b2"));
}

#[test]
fn truncation_and_garbage_are_detected() {
    let bytes = encode(&sample());
    for cut in 0..bytes.len() {
        assert!(decode(&bytes[..cut]).is_err(), "cut at {cut}");
    }
    let mut flipped = bytes.clone();
    let mid = flipped.len() / 2;
    flipped[mid] ^= 0x01;
    assert!(decode(&flipped).is_err());
    assert_eq!(decode(b"garbage"), Err(DecodeError::BadMagic));
}

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("moor-journal-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn emptied(mut r: VolumeRecord) -> VolumeRecord {
    r.stage = None;
    r.publishes.clear();
    r
}

#[test]
fn replay_keeps_the_newest_line_and_skips_damage() {
    let a = sample();
    let mut a2 = sample();
    a2.publishes.clear();
    let mut b = sample();
    b.volume_id = "b".into();
    let mut log = Vec::new();
    log.extend(encode(&a));
    log.extend(encode(&b));
    log.extend(encode(&a2));
    log.extend(b"moor-journal v1 0000zz {}\n");
    log.extend(encode(&emptied(b.clone())));
    let mut cut = encode(&a);
    cut.truncate(cut.len() - 3);
    let torn = cut.len();
    log.extend(cut);
    let r = replay(&log);
    assert_eq!(r.lines, 5);
    assert_eq!(r.records.len(), 1);
    assert_eq!(r.records.get("vol/1 ü"), Some(&a2));
    assert_eq!(r.problems.len(), 1);
    assert_eq!(r.problems[0].0, 4);
    // The unterminated last line is an append cut short, not damage.
    assert_eq!(r.torn_tail, torn);
}

#[test]
fn unreadable_lines_after_the_last_readable_one_are_a_torn_tail() {
    let a = sample();
    let mut log = encode(&a);
    let good = log.len();
    // What a real ext4 left after a power cut: the file grown, its new page not written.
    log.extend([0u8; 100]);
    log.push(b'\n');
    let mut torn_page = encode(&a);
    torn_page[20..40].fill(0);
    log.extend(&torn_page);
    log.extend([0u8; 30]);
    let r = replay(&log);
    assert!(r.problems.is_empty(), "{:?}", r.problems);
    assert_eq!(r.lines, 1);
    assert_eq!(r.torn_tail, log.len() - good);
    assert_eq!(r.records.get("vol/1 ü"), Some(&a));
    // A damaged line with a readable one after it is damage.
    log.truncate(good);
    log.extend(&torn_page);
    log.extend(encode(&a));
    let r = replay(&log);
    assert_eq!(r.problems.len(), 1);
    assert_eq!(r.torn_tail, 0);
}

#[test]
fn a_log_ending_in_an_append_cut_short_opens_without_it_and_without_a_corrupt_copy() {
    let dir = temp_dir("torn");
    std::fs::create_dir_all(&dir).unwrap();
    let a = sample();
    let mut log = encode(&a);
    let mut b = sample();
    b.volume_id = "b".into();
    let cut = encode(&b);
    log.extend(&cut[..cut.len() / 2]);
    std::fs::write(dir.join(LOG_FILE), &log).unwrap();
    let (j, problems) = Journal::open(&dir, false).unwrap();
    assert!(problems.is_empty(), "{problems:?}");
    assert_eq!(j.torn_tail(), cut.len() / 2);
    assert_eq!(j.all(), vec![a]);
    assert!(!dir.join(CORRUPT_FILE).exists());
    // The rewritten log ends on a whole line.
    let (again, problems) = Journal::open(&dir, false).unwrap();
    assert!(problems.is_empty());
    assert_eq!(again.torn_tail(), 0);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn journal_persists_compacts_and_forgets() {
    let dir = temp_dir("persist");
    {
        let (j, problems) = Journal::open(&dir, false).unwrap();
        assert!(problems.is_empty());
        j.put(&sample(), Durability::Power).unwrap();
        let mut other = sample();
        other.volume_id = "other".into();
        for _ in 0..(COMPACT_SLACK + 10) {
            j.put(&other, Durability::Process).unwrap();
        }
        j.put(&emptied(other), Durability::Process).unwrap();
        assert!(std::fs::metadata(dir.join(LOG_FILE)).unwrap().len() < 64 * 1024);
    }
    let (j, problems) = Journal::open(&dir, false).unwrap();
    assert!(problems.is_empty());
    assert_eq!(j.all(), vec![sample()]);
    assert_eq!(read_state(&dir).unwrap().0, vec![sample()]);
    j.put(&emptied(sample()), Durability::Process).unwrap();
    assert!(j.get("vol/1 ü").is_none());
    drop(j);
    let (j, _) = Journal::open(&dir, false).unwrap();
    assert!(j.all().is_empty());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn only_a_mkfs_in_progress_guards_data_and_compaction_keeps_it() {
    let mut formatting = sample();
    assert!(!formatting.guards_data());
    if let Some(st) = formatting.stage.as_mut() {
        st.phase = Phase::Formatting;
    }
    assert!(formatting.guards_data());
    assert!(!VolumeRecord::new("v").guards_data());

    // Compactions with and without a guarding record live both leave a whole log.
    let dir = temp_dir("guard");
    {
        let (j, _) = Journal::open(&dir, false).unwrap();
        let mut other = sample();
        other.volume_id = "other".into();
        for _ in 0..(COMPACT_SLACK + 10) {
            j.put(&other, Durability::Process).unwrap();
        }
        j.put(&formatting, Durability::Power).unwrap();
        for _ in 0..(COMPACT_SLACK + 10) {
            j.put(&other, Durability::Process).unwrap();
        }
        assert!(std::fs::metadata(dir.join(LOG_FILE)).unwrap().len() < 64 * 1024);
    }
    let (j, problems) = Journal::open(&dir, false).unwrap();
    assert!(problems.is_empty());
    assert_eq!(j.get("vol/1 ü"), Some(formatting));
    assert!(j.get("other").is_some());
    assert!(!dir.join("journal.log.tmp").exists());
    drop(j);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn damaged_logs_are_set_aside_and_rebuilt() {
    let dir = temp_dir("garbage");
    {
        let (j, _) = Journal::open(&dir, false).unwrap();
        j.put(&sample(), Durability::Process).unwrap();
    }
    // No mark of what is synced (a log an earlier moor-node wrote): every damaged line with
    // a readable one after it is damage.
    std::fs::remove_file(dir.join(SYNCED_FILE)).unwrap();
    let mut bytes = std::fs::read(dir.join(LOG_FILE)).unwrap();
    let good = bytes.clone();
    bytes.extend_from_slice(b"moor-journal v1 12\n");
    bytes.extend_from_slice(&good);
    std::fs::write(dir.join(LOG_FILE), &bytes).unwrap();
    let (j, problems) = Journal::open(&dir, false).unwrap();
    assert_eq!(problems.len(), 1);
    assert_eq!(j.all(), vec![sample()]);
    assert_eq!(std::fs::read(dir.join(CORRUPT_FILE)).unwrap(), bytes);
    drop(j);
    // The rewritten log is clean.
    let (_, problems) = Journal::open(&dir, false).unwrap();
    assert!(problems.is_empty());

    std::fs::remove_file(dir.join(SYNCED_FILE)).unwrap();
    let mut garbage = vec![0xffu8, 0, 17, b'\n'];
    garbage.extend(encode(&emptied(sample())));
    garbage.push(3);
    std::fs::write(dir.join(LOG_FILE), &garbage).unwrap();
    let (j, problems) = Journal::open(&dir, false).unwrap();
    assert_eq!(problems.len(), 1);
    assert_eq!(j.torn_tail(), 1);
    assert!(j.all().is_empty());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A line as a newer moor-node might write it: `body` under the header of `version`, with its
/// checksum right.
fn line_of(version: u32, body: &str) -> Vec<u8> {
    format!(
        "moor-journal v{version} {:08x} {body}\n",
        crc32c(body.as_bytes())
    )
    .into_bytes()
}

/// Issue 38, point 9 (a downgrade): a moor-node given the log of a newer one refuses it, says
/// why, and leaves the log exactly as it was (no `journal.log.corrupt`, no rewrite), so the
/// newer moor-node started again finds all it wrote.
#[test]
fn a_log_a_newer_moor_node_wrote_is_refused_before_anything_changes() {
    let known = String::from_utf8(encode(&sample())).unwrap();
    let known_body = known.splitn(4, ' ').nth(3).unwrap().trim_end().to_string();
    // A field this moor-node does not know, in a record otherwise its own.
    let extra = known_body.replacen('{', r#"{"shared_with":["pod-a"],"#, 1);
    // A phase it does not know.
    let phase = known_body.replace(r#""phase":"Done""#, r#""phase":"Quiescing""#);
    assert_ne!(phase, known_body, "the sample has a Done phase to change");
    type Case = (&'static str, Vec<u8>, fn(&DecodeError) -> bool);
    let cases: [Case; 3] = [
        ("a line of format v2", line_of(2, "{\"anything\":1}"), |e| {
            *e == DecodeError::NewerFormat(2)
        }),
        (
            "an unknown field",
            line_of(1, &extra),
            |e| matches!(e, DecodeError::NotUnderstood(w) if w.contains("shared_with")),
        ),
        (
            "an unknown phase",
            line_of(1, &phase),
            |e| matches!(e, DecodeError::NotUnderstood(w) if w.contains("Quiescing")),
        ),
    ];
    for (what, newer, is_it) in cases {
        let dir = temp_dir("newer");
        std::fs::create_dir_all(&dir).unwrap();
        // Its own lines before and after: the newer line is refused wherever it is, even last
        // (where an unreadable tail would be an append cut short).
        for log in [
            [known.as_bytes(), &newer].concat(),
            [newer.as_slice(), known.as_bytes()].concat(),
        ] {
            std::fs::write(dir.join(LOG_FILE), &log).unwrap();
            let line = if log.starts_with(&newer) { 1 } else { 2 };
            match Journal::open(&dir, false) {
                Err(JournalError::Newer {
                    line: at, error, ..
                }) => {
                    assert_eq!(at, line, "{what}");
                    assert!(is_it(&error), "{what}: {error:?}");
                    let said = JournalError::Newer {
                        path: dir.join(LOG_FILE),
                        line: at,
                        error,
                    }
                    .to_string();
                    assert!(
                        said.contains("changed nothing") && said.contains("newer"),
                        "{what}: {said}"
                    );
                }
                other => panic!("{what}: opened {:?}", other.map(|(j, p)| (j.all(), p))),
            }
            assert!(
                matches!(read_state(&dir), Err(JournalError::Newer { .. })),
                "{what}: moorctl status reads it"
            );
            assert_eq!(
                std::fs::read(dir.join(LOG_FILE)).unwrap(),
                log,
                "{what}: the log changed"
            );
            assert!(!dir.join(CORRUPT_FILE).exists(), "{what}: set aside");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

/// A line of this format that is not whole stays damage (set aside, the log rebuilt), not a
/// newer moor-node's: only a line whose checksum holds can be one.
#[test]
fn a_damaged_line_is_not_taken_for_a_newer_one() {
    let mut bad = line_of(
        1,
        r#"{"volume_id":"x","stage":null,"publishes":{},"new":1}"#,
    );
    bad[30] ^= 1;
    let mut log = bad.clone();
    log.extend(encode(&sample()));
    let dir = temp_dir("damaged-not-newer");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join(LOG_FILE), &log).unwrap();
    let (j, problems) = Journal::open(&dir, false).unwrap();
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert!(!problems[0].error.is_newer(), "{problems:?}");
    assert_eq!(j.all(), vec![sample()]);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The journal the last release's moor-node wrote: commit 10525bb (the last landed main,
/// taken as the last release, moor having no tags), made by running that commit's moor-node,
/// moor-controller and moorctl with `fixtures/make.sh` (which says how), as root on loop
/// devices: an ext4 volume staged and published, a raw block volume staged and published
/// (SINGLE_NODE_SINGLE_WRITER), an xfs volume with `noatime` staged (SINGLE_NODE_MULTI_WRITER).
const RELEASE_10525BB: &[u8] = include_bytes!("fixtures/10525bb/journal.log");

/// Issue 38, point 9, an upgrade from the last release: its journal reads with every volume
/// intact, and what this code writes of those records is byte for byte what the release
/// wrote, so the release reads this code's journal of them too (a downgrade reads it).
#[test]
fn the_journal_of_the_last_release_is_read_with_every_volume_intact() {
    let dir = temp_dir("release-10525bb");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join(LOG_FILE), RELEASE_10525BB).unwrap();
    let (j, problems) = Journal::open(&dir, false).unwrap();
    assert!(problems.is_empty(), "{problems:?}");
    assert_eq!(j.torn_tail(), 0);
    let root = "/tmp/moor-fixture.vu4H2s/kubelet";
    let boot = Some("f9f2403a-f7b5-47b0-a6ce-e51826031e7d".to_string());
    let attrs = |atime| MountAttrs {
        atime,
        ..MountAttrs::default()
    };
    let done_publish = |block| PublishRecord {
        block,
        attrs: attrs(crate::sys::Atime::Relative),
        access_mode: if block { 6 } else { 1 },
        phase: Phase::Done,
        boot: boot.clone(),
    };
    // A stage as the release recorded it: (path under the kubelet dir, loop device number,
    // access, atime, access mode, the UUID of moor's mkfs).
    let staged = |path: &str, n: u32, access, atime, access_mode, fs_uuid: Option<&str>| {
        Some(StageRecord {
            path: format!("{root}/plugins/kubernetes.io/csi/{path}").into(),
            device: format!("/dev/loop{n}").into(),
            rdev: (7, n),
            access,
            attrs: attrs(atime),
            access_mode,
            phase: Phase::Done,
            fs_uuid: fs_uuid.map(str::to_string),
            boot: boot.clone(),
        })
    };
    let mount = |fs: &str, options: &[&str]| AccessRecord::Mount {
        fs_type: fs.into(),
        fs_options: options.iter().map(|o| (*o).to_string()).collect(),
        group: None,
    };
    let relative = crate::sys::Atime::Relative;
    let mut a = VolumeRecord::new("vol-c8bac33f6c6a4a72");
    a.stage = staged(
        "moor.csi.io/a/globalmount",
        0,
        mount("ext4", &[]),
        relative,
        1,
        Some("d30f8de1-2acd-4002-a36c-2d9407f6fafa"),
    );
    a.publishes.insert(
        format!("{root}/pods/pod-a/volumes/kubernetes.io~csi/pvc-a/mount").into(),
        done_publish(false),
    );
    let mut b = VolumeRecord::new("vol-0303446ecad272c8");
    b.stage = staged(
        "volumeDevices/staging/pvc-b",
        1,
        AccessRecord::Block,
        relative,
        6,
        None,
    );
    b.publishes.insert(
        format!("{root}/pods/pod-b/volumeDevices/kubernetes.io~csi/pvc-b").into(),
        done_publish(true),
    );
    let mut c = VolumeRecord::new("vol-9064927857a2428d");
    c.stage = staged(
        "moor.csi.io/c/globalmount",
        2,
        mount("xfs", &["nouuid"]),
        crate::sys::Atime::None,
        7,
        Some("08e8db3c-673b-4d4b-92f9-6b7a0e7ce149"),
    );
    let mut got = j.all();
    got.sort_by(|x, y| x.volume_id.cmp(&y.volume_id));
    assert_eq!(got, vec![b, c, a]);
    // Each volume's newest line, as the release wrote it, is what this code writes.
    let text = std::str::from_utf8(RELEASE_10525BB).unwrap();
    for r in &got {
        let newest = text
            .lines()
            .rfind(|l| l.contains(&format!("{{\"volume_id\":\"{}\"", r.volume_id)))
            .unwrap();
        assert_eq!(
            std::str::from_utf8(&encode(r)).unwrap().trim_end(),
            newest,
            "{}",
            r.volume_id
        );
    }
    // And the log this code rewrote at open reads back the same.
    drop(j);
    let (again, problems) = Journal::open(&dir, false).unwrap();
    assert!(problems.is_empty(), "{problems:?}");
    let mut back = again.all();
    back.sort_by(|x, y| x.volume_id.cmp(&y.volume_id));
    assert_eq!(back, got);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A record of volume `id`.
fn of(id: &str) -> VolumeRecord {
    let mut r = sample();
    r.volume_id = id.into();
    r
}

/// `line` as a power cut can leave an append in the middle of the unsynced part: its page
/// written back with a hole in it, its newline there.
fn torn(line: &[u8]) -> Vec<u8> {
    let mut t = line.to_vec();
    t[20..40].fill(0);
    t
}

#[test]
fn damage_after_the_synced_part_is_a_tear_and_inside_it_damage() {
    // a, b synced; c, d, e appended after; d came back torn, e whole (what the VM lab's real
    // power cut left: line 5 of 12 failing its checksum, the 7 after it fine).
    let synced = [encode(&of("a")), encode(&of("b"))].concat();
    let mut log = synced.clone();
    log.extend(encode(&of("c")));
    let tear_at = log.len();
    log.extend(torn(&encode(&of("d"))));
    log.extend(encode(&of("e")));
    let r = replay_after_sync(&log, Some(synced.len()));
    assert!(r.problems.is_empty(), "{:?}", r.problems);
    assert_eq!(r.torn_tail, log.len() - tear_at, "from the torn line on");
    assert_eq!(r.lines, 3);
    let ids: Vec<&str> = r.records.keys().map(String::as_str).collect();
    assert_eq!(ids, ["a", "b", "c"], "an in-order prefix of the appends");
    // Without knowing what is durable, the same log is damage, as before.
    let r = replay(&log);
    assert_eq!(r.problems.len(), 1);
    assert_eq!(r.torn_tail, 0);
    // Damage inside the synced part is damage whatever follows.
    let mut inside = torn(&encode(&of("a")));
    inside.extend(encode(&of("b")));
    inside.extend(torn(&encode(&of("c"))));
    inside.extend(encode(&of("e")));
    let r = replay_after_sync(&inside, Some(synced.len()));
    assert_eq!(r.problems.len(), 1, "{:?}", r.problems);
    assert_eq!(r.problems[0].0, 1);
    // A whole line of a newer moor-node after the synced part is refused, never torn.
    let mut newer = synced.clone();
    newer.extend(line_of(2, "{}"));
    newer.extend(encode(&of("e")));
    let r = replay_after_sync(&newer, Some(synced.len()));
    assert!(r.newer.is_some());
}

#[test]
fn a_mark_counts_only_for_the_log_it_was_written_for() {
    let synced = [encode(&of("a")), encode(&of("b"))].concat();
    let mark = SyncedMark {
        len: synced.len() as u64,
        crc: crc32c(&synced),
    };
    let bytes = mark.encode();
    assert_eq!(SyncedMark::decode(&bytes), Some(mark));
    assert_eq!(
        SyncedMark {
            len: u64::MAX,
            crc: 0
        }
        .encode()
        .len(),
        bytes.len(),
        "one length: written in place"
    );
    let mut log = synced.clone();
    log.extend(torn(&encode(&of("c"))));
    assert_eq!(mark.durable_in(&log), Some(synced.len()));
    // Damage inside the part it names, another log (a compaction's), a shorter log: nothing.
    let mut damaged = torn(&encode(&of("a")));
    damaged.extend(encode(&of("b")));
    assert_eq!(mark.durable_in(&damaged), None);
    assert_eq!(mark.durable_in(&encode(&of("b"))), None);
    // A torn mark says nothing: every cut of it and every byte of it damaged.
    for cut in 0..bytes.len() {
        assert_eq!(SyncedMark::decode(&bytes[..cut]), None, "cut at {cut}");
        let mut bad = bytes.clone();
        bad[cut] ^= 0x10;
        assert_eq!(SyncedMark::decode(&bad), None, "byte {cut}");
    }
}

#[test]
fn a_journal_opens_past_a_torn_unsynced_line_and_stops_at_damage_in_the_synced_part() {
    let dir = temp_dir("torn-middle");
    std::fs::create_dir_all(&dir).unwrap();
    let (j, _) = Journal::open(&dir, false).unwrap();
    let mut formatting = of("a");
    if let Some(s) = formatting.stage.as_mut() {
        s.phase = Phase::Formatting;
    }
    j.put(&formatting, Durability::Power).unwrap();
    j.put(&of("b"), Durability::Process).unwrap();
    j.put(&of("c"), Durability::Process).unwrap();
    drop(j);
    let log = std::fs::read(dir.join(LOG_FILE)).unwrap();
    let first = encode(&formatting).len();
    let b = encode(&of("b")).len();
    // The power cut: b's page came back torn, c's whole.
    let mut cut = log.clone();
    cut[first..first + b].copy_from_slice(&torn(&log[first..first + b]));

    std::fs::write(dir.join(LOG_FILE), &cut).unwrap();
    let (j, problems) = Journal::open(&dir, false).unwrap();
    assert!(problems.is_empty(), "{problems:?}");
    assert_eq!(j.torn_tail(), log.len() - first);
    assert_eq!(j.all(), vec![formatting.clone()]);
    assert!(!dir.join(CORRUPT_FILE).exists());
    drop(j);
    // The reopened log is marked synced whole: damage in it now is damage.
    let mut damaged = std::fs::read(dir.join(LOG_FILE)).unwrap();
    damaged.extend(encode(&of("b")));
    let t = torn(&damaged[..first]);
    damaged[..first].copy_from_slice(&t);
    std::fs::write(dir.join(LOG_FILE), &damaged).unwrap();
    let (_, problems) = Journal::open(&dir, false).unwrap();
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert!(dir.join(CORRUPT_FILE).exists());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_torn_mark_leaves_every_damaged_line_damage() {
    let dir = temp_dir("torn-mark");
    std::fs::create_dir_all(&dir).unwrap();
    let (j, _) = Journal::open(&dir, false).unwrap();
    j.put(&of("a"), Durability::Power).unwrap();
    j.put(&of("b"), Durability::Process).unwrap();
    j.put(&of("c"), Durability::Process).unwrap();
    drop(j);
    let mut log = std::fs::read(dir.join(LOG_FILE)).unwrap();
    let first = encode(&of("a")).len();
    let b = encode(&of("b")).len();
    let t = torn(&log[first..first + b]);
    log[first..first + b].copy_from_slice(&t);
    std::fs::write(dir.join(LOG_FILE), &log).unwrap();
    let mut mark = std::fs::read(dir.join(SYNCED_FILE)).unwrap();
    mark.truncate(mark.len() / 2);
    std::fs::write(dir.join(SYNCED_FILE), &mark).unwrap();
    let (j, problems) = Journal::open(&dir, false).unwrap();
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert_eq!(j.torn_tail(), 0);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Waits (up to a generous deadline) until `cond` holds of the journal's state.
fn wait_for_state(j: &Journal, what: &str, cond: impl Fn(&State) -> bool) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    // try_lock: a put that held the lock through its sync would otherwise hang the test.
    while !j.state.try_lock().is_ok_and(|st| cond(&st)) {
        assert!(
            std::time::Instant::now() < deadline,
            "waited 60 s for {what}"
        );
        std::thread::yield_now();
    }
}

fn named(id: &str) -> VolumeRecord {
    let mut r = sample();
    r.volume_id = id.into();
    r
}

#[test]
fn durable_puts_at_once_share_their_syncs() {
    let dir = temp_dir("group-commit");
    let (j, _) = Journal::open(&dir, false).unwrap();
    let j = std::sync::Arc::new(j);
    let (release, gate) = std::sync::mpsc::channel();
    j.lock().sync_gate = Some(gate);
    let put = |id: &'static str| {
        let j = std::sync::Arc::clone(&j);
        std::thread::spawn(move || j.put(&named(id), Durability::Power))
    };
    // a syncs, held at the gate without the lock; b and c append meanwhile and wait.
    let a = put("a");
    wait_for_state(&j, "a's sync to start", |st| st.syncing);
    let (b, c) = (put("b"), put("c"));
    wait_for_state(&j, "b and c to be written and wait for a sync", |st| {
        st.sync_waiters == 3
    });
    assert_eq!(
        j.lock().lines,
        3,
        "b's and c's lines were appended during a's sync"
    );
    release.send(()).unwrap();
    for h in [a, b, c] {
        h.join().unwrap().unwrap();
    }
    {
        let st = j.lock();
        // a's sync covered a's line only (it started before the others); one more covered b
        // and c both, whichever of them ran it.
        assert_eq!(st.syncs, 2, "three durable puts at once, two syncs");
        assert_eq!(st.synced, st.len, "every line durable");
        assert_eq!(st.sync_waiters, 0);
    }
    let mut ids: Vec<_> = j.all().into_iter().map(|r| r.volume_id).collect();
    ids.sort();
    assert_eq!(ids, ["a", "b", "c"]);
    // The mark proves the whole log durable.
    let log = std::fs::read(dir.join(LOG_FILE)).unwrap();
    assert_eq!(durable_part(&dir, &log), Some(log.len()));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_failed_sync_fails_the_put_leaves_memory_and_refuses_every_later_change() {
    let dir = temp_dir("failed-sync");
    let (j, _) = Journal::open(&dir, false).unwrap();
    j.put(&named("before"), Durability::Power).unwrap();
    j.fail_next_sync();
    let e = j.put(&named("cut"), Durability::Power).unwrap_err();
    assert!(e.to_string().contains("Input/output error"), "{e}");
    assert!(
        j.get("cut").is_none(),
        "a put whose sync failed is not in memory"
    );
    // After a failed fdatasync nothing can be called durable: no later change is recorded,
    // durable or not, and each says why.
    for d in [Durability::Process, Durability::Power] {
        let e = j.put(&named("after"), d).unwrap_err();
        assert!(
            e.to_string()
                .contains("an earlier sync of the journal failed"),
            "{e}"
        );
    }
    assert!(j.get("after").is_none());
    assert!(j.get("before").is_some());
    drop(j);
    // Restarted, moor-node reads the log back: the line whose sync failed may be there (it
    // was written); what was durable before is.
    let (j, problems) = Journal::open(&dir, false).unwrap();
    assert!(problems.is_empty(), "{problems:?}");
    assert!(j.get("before").is_some());
    j.put(&named("after"), Durability::Power).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
}
