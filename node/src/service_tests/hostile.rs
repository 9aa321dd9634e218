//! Hostile input: oversized or secret-bearing requests, path escapes.

use super::*;

/// A secret value no log line, error or metric may contain.
const SECRET_MARKER: &str = "s3cr3t-m4rk3r-7f1c";

fn secrets() -> HashMap<String, String> {
    HashMap::from([
        ("password".to_string(), SECRET_MARKER.to_string()),
        (SECRET_MARKER.to_string(), "key-is-secret-too".to_string()),
    ])
}

#[tokio::test]
async fn oversized_secrets_are_refused_naming_the_field_without_quoting_them() {
    let h = harness();
    let big = HashMap::from([(
        "k".to_string(),
        format!("{SECRET_MARKER}{}", "v".repeat(5000)),
    )]);
    let mut stage = stage_req(ext4());
    stage.secrets = big.clone();
    let e = h
        .svc
        .node_stage_volume(Request::new(stage))
        .await
        .expect_err("oversized secrets");
    assert_eq!(e.code(), Code::InvalidArgument);
    assert!(e.message().contains("secrets"), "{}", e.message());
    assert!(!e.message().contains(SECRET_MARKER));
    let mut publish = publish_req(ext4(), false);
    publish.secrets = big.clone();
    let e = h
        .svc
        .node_publish_volume(Request::new(publish))
        .await
        .expect_err("oversized secrets");
    assert_eq!(e.code(), Code::InvalidArgument);
    assert!(!e.message().contains(SECRET_MARKER));
    let mut expand = expand_req(TARGET, 0);
    expand.secrets = big;
    let e = h
        .svc
        .node_expand_volume(Request::new(expand))
        .await
        .expect_err("oversized secrets");
    assert_eq!(e.code(), Code::InvalidArgument);
    assert!(mutating_calls(&h).is_empty(), "{:?}", mutating_calls(&h));
}

#[tokio::test]
async fn errors_never_quote_secrets() {
    let h = harness();
    // Refused for every reason the validator has, each request carrying secrets.
    let mut reqs = Vec::new();
    for (field, value) in [
        ("volume_id", ""),
        ("staging", "relative"),
        ("staging", "/etc/x"),
        ("fs", "vfat"),
        ("flag", "bind"),
        ("device", "/etc/passwd"),
    ] {
        let mut r = stage_req(ext4());
        match field {
            "volume_id" => r.volume_id = value.into(),
            "staging" => r.staging_target_path = value.into(),
            "fs" => r.volume_capability = Some(mount_cap(value, &[], Mode::SingleNodeWriter)),
            "flag" => {
                r.volume_capability = Some(mount_cap("ext4", &[value], Mode::SingleNodeWriter))
            }
            _ => {
                r.publish_context
                    .insert(moor_runtime::contract::DEVICE_PATH_KEY.into(), value.into());
            }
        }
        r.secrets = secrets();
        reqs.push(r);
    }
    for r in reqs {
        let e = h
            .svc
            .node_stage_volume(Request::new(r))
            .await
            .expect_err("refused");
        assert_eq!(e.code(), Code::InvalidArgument, "{}", e.message());
        assert!(!e.message().contains(SECRET_MARKER), "{}", e.message());
    }
    let mut p = publish_req(ext4(), false);
    p.target_path = "/etc".into();
    p.secrets = secrets();
    let e = h
        .svc
        .node_publish_volume(Request::new(p))
        .await
        .expect_err("refused");
    assert!(!e.message().contains(SECRET_MARKER));
    // A publish that fails after validation (nothing staged) does not quote them either.
    let mut p = publish_req(ext4(), false);
    p.secrets = secrets();
    let e = h
        .svc
        .node_publish_volume(Request::new(p))
        .await
        .expect_err("not staged");
    assert!(!e.message().contains(SECRET_MARKER), "{}", e.message());
    assert!(mutating_calls(&h).is_empty(), "{:?}", mutating_calls(&h));
}

#[tokio::test]
async fn path_escapes_are_refused_before_the_os_is_touched() {
    let h = harness();
    let escapes = [
        format!("{K}/../../etc"),
        format!("{K}/pods/../../../etc"),
        format!("{K}/pods/./x"),
        format!("{K}//pods"),
        format!("{K}/pods/"),
        format!("{K}/pods\0/x"),
        format!("{K}-other/pods/x"),
        K.to_string(),
        "/".to_string(),
        "pods/x".to_string(),
        format!("{K}/{}", "a/".repeat(2100)),
    ];
    for p in &escapes {
        let mut r = stage_req(ext4());
        r.staging_target_path = p.clone();
        let e = h
            .svc
            .node_stage_volume(Request::new(r))
            .await
            .expect_err("escape");
        assert_eq!(e.code(), Code::InvalidArgument, "{p:?}");
        assert!(
            e.message().contains("staging_target_path"),
            "{}",
            e.message()
        );
        let mut r = publish_req(ext4(), false);
        r.target_path = p.clone();
        let e = h
            .svc
            .node_publish_volume(Request::new(r))
            .await
            .expect_err("escape");
        assert_eq!(e.code(), Code::InvalidArgument, "{p:?}");
        assert!(e.message().contains("target_path"), "{}", e.message());
        let e = h
            .svc
            .node_unpublish_volume(Request::new(unpublish_req(p)))
            .await
            .expect_err("escape");
        assert_eq!(e.code(), Code::InvalidArgument, "{p:?}");
        let mut r = unstage_req();
        r.staging_target_path = p.clone();
        let e = h
            .svc
            .node_unstage_volume(Request::new(r))
            .await
            .expect_err("escape");
        assert_eq!(e.code(), Code::InvalidArgument, "{p:?}");
        // No volume can be staged or published at such a path: NOT_FOUND, unless the string
        // cannot be a path at all.
        let want = if p.contains('\0') || p.len() > 4096 {
            Code::InvalidArgument
        } else {
            Code::NotFound
        };
        let e = h
            .svc
            .node_get_volume_stats(Request::new(stats_req(p)))
            .await
            .expect_err("escape");
        assert_eq!(e.code(), want, "{p:?}");
        let e = h
            .svc
            .node_expand_volume(Request::new(expand_req(p, 0)))
            .await
            .expect_err("escape");
        assert_eq!(e.code(), want, "{p:?}");
    }
    assert!(mutating_calls(&h).is_empty(), "{:?}", mutating_calls(&h));
}
