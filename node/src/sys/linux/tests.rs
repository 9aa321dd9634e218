use super::*;

#[test]
fn aligned_and_unaligned_reads_give_the_same_bytes() {
    // A regular file stands in for the device: O_DIRECT where the filesystem takes it,
    // the cached read where it refuses (EINVAL); the bytes are the same either way.
    let path = std::env::temp_dir().join(format!("moor-read-{}", std::process::id()));
    let data: Vec<u8> = (0..3 * DIRECT_ALIGN + 100)
        .map(|i| (i % 251) as u8)
        .collect();
    std::fs::write(&path, &data).unwrap();
    let os = Linux::new(&std::env::temp_dir()).unwrap();
    let mut aligned = crate::sys::AlignedBuf::zeroed(2 * DIRECT_ALIGN);
    let n = os
        .read_device(&path, DIRECT_ALIGN as u64, aligned.as_mut_slice())
        .unwrap();
    let mut unaligned = vec![0u8; 2 * DIRECT_ALIGN + 1];
    let m = os
        .read_device(&path, DIRECT_ALIGN as u64, &mut unaligned[1..])
        .unwrap();
    // Past the end: a short read, not an error.
    let mut tail = crate::sys::AlignedBuf::zeroed(DIRECT_ALIGN);
    let t = os
        .read_device(&path, 3 * DIRECT_ALIGN as u64, tail.as_mut_slice())
        .unwrap();
    let _ = std::fs::remove_file(&path);
    assert_eq!((n, m, t), (2 * DIRECT_ALIGN, 2 * DIRECT_ALIGN, 100));
    assert_eq!(aligned.as_slice(), &data[DIRECT_ALIGN..3 * DIRECT_ALIGN]);
    assert_eq!(&unaligned[1..], &data[DIRECT_ALIGN..3 * DIRECT_ALIGN]);
    assert_eq!(&tail.as_slice()[..100], &data[3 * DIRECT_ALIGN..]);
    assert_eq!(aligned.as_slice().as_ptr() as usize % DIRECT_ALIGN, 0);
}

#[test]
fn tool_failure_carries_stderr() {
    let run = ToolRun {
        program: "sh".into(),
        args: vec!["-c".into(), "echo boom >&2; exit 3".into()],
        deadline: Duration::from_secs(10),
    };
    let err = run_with_deadline(&run).unwrap_err();
    let text = err.to_string();
    assert!(text.contains("boom") && text.contains('3'), "{text}");
}

#[test]
fn tool_stderr_is_capped_and_never_blocks_the_tool() {
    // 200 KB of stderr (three times a pipe's buffer), then a failure.
    let run = ToolRun {
        program: "sh".into(),
        args: vec![
            "-c".into(),
            "head -c 200000 /dev/zero | tr '\\0' x >&2; echo end >&2; exit 4".into(),
        ],
        deadline: Duration::from_secs(20),
    };
    match run_with_deadline(&run) {
        Err(ToolError::Failed { stderr, status, .. }) => {
            assert_eq!(stderr.len(), ToolStderr::KEEP, "{status}");
            assert!(stderr.bytes().all(|b| b == b'x'));
            assert!(status.contains('4'), "{status}");
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_descendant_holding_stderr_does_not_hold_the_caller() {
    // The tool exits at once; what it started keeps the pipe open for 30 s: returning well
    // before (whatever the machine's load) is not waiting for it.
    let run = ToolRun {
        program: "sh".into(),
        args: vec![
            "-c".into(),
            "echo started >&2; sleep 30 >&2 & exit 5".into(),
        ],
        deadline: Duration::from_secs(60),
    };
    let start = Instant::now();
    let err = run_with_deadline(&run).unwrap_err();
    assert!(
        start.elapsed() < Duration::from_secs(20),
        "waited for the descendant ({:?})",
        start.elapsed()
    );
    assert!(err.to_string().contains("started"), "{err}");
}

#[test]
fn tool_past_deadline_is_killed() {
    let run = ToolRun {
        program: "sleep".into(),
        args: vec!["30".into()],
        deadline: Duration::from_millis(200),
    };
    let err = run_with_deadline(&run).unwrap_err();
    assert!(matches!(err, ToolError::Timeout { .. }), "{err}");
}

#[test]
fn tool_success() {
    let run = ToolRun {
        program: "true".into(),
        args: vec![],
        deadline: Duration::from_secs(10),
    };
    run_with_deadline(&run).unwrap();
}

#[test]
fn missing_tool_is_a_spawn_error() {
    let run = ToolRun {
        program: "moor-no-such-tool".into(),
        args: vec![],
        deadline: Duration::from_secs(1),
    };
    assert!(matches!(
        run_with_deadline(&run),
        Err(ToolError::Spawn { .. })
    ));
}

#[test]
fn a_held_parent_is_the_directory_checked_and_acted_in_after_a_rename() {
    // The parent held is that directory, wherever it goes: a name checked and removed in it
    // is its own, not the one of a directory renamed into its old path; no root needed.
    struct Removed(PathBuf);
    impl Drop for Removed {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
    let root = std::env::temp_dir().join(format!("moor-held-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let _cleanup = Removed(root.clone());
    let dir = root.join("pv1");
    let target = dir.join("mount");
    std::fs::create_dir_all(&target).unwrap();
    let os = Linux::new(&root).unwrap();
    let parent = os
        .hold_parent(&target)
        .unwrap()
        .expect("the parent is there");
    std::fs::rename(&dir, root.join("pv1-moved")).unwrap();
    std::fs::create_dir_all(dir.join("mount/other's")).unwrap();
    let state = os.mount_state_in(&target, &parent).unwrap();
    let removed = os.remove_held(&target, Some(&parent));
    let other_kept = dir.join("mount/other's").is_dir();
    let own_gone = !root.join("pv1-moved/mount").exists();
    // A symlink at the name is removed itself, never followed.
    std::os::unix::fs::symlink(&dir, root.join("pv1-moved/mount")).unwrap();
    let link = os.mount_state_in(&target, &parent).unwrap();
    let unlinked = os.remove_held(&target, Some(&parent));
    let link_gone = std::fs::symlink_metadata(root.join("pv1-moved/mount")).is_err();
    let link_target_kept = dir.join("mount/other's").is_dir();
    // Nothing there, or no parent at all: nothing to remove.
    let absent = os.remove_held(&target, Some(&parent));
    let no_parent = os.hold_parent(&root.join("none/mount")).unwrap();
    assert_eq!(state, MountState::NotMounted { is_dir: true });
    removed.unwrap();
    assert!(
        other_kept,
        "the directory renamed into the path is left alone"
    );
    assert!(own_gone, "the held directory's entry is removed");
    assert_eq!(link, MountState::NotMounted { is_dir: false });
    unlinked.unwrap();
    assert!(link_gone && link_target_kept, "the symlink, not its target");
    absent.unwrap();
    assert!(no_parent.is_none());
}
