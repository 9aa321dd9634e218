//! What NodeStageVolume says of an RBD volume: the image in its publish_context, the user in
//! its secrets. Everything here ends up in a sysfs write or on a command line, so each value
//! is checked to a strict alphabet first: nothing can smuggle in an option, an argument or a
//! second request. The key is never quoted in an error.

use std::collections::HashMap;

use moor_proto::csi::v1 as csi;

use moor_runtime::contract::{
    RBD_CLUSTER_ID_FIELD, RBD_CLUSTER_ID_KEY, RBD_EXCLUSIVE_FIELD, RBD_EXCLUSIVE_KEY,
    RBD_IMAGE_FIELD, RBD_IMAGE_KEY, RBD_MONITORS_FIELD, RBD_MONITORS_KEY, RBD_POOL_FIELD,
    RBD_POOL_KEY, RBD_READ_ONLY_FIELD, RBD_READ_ONLY_KEY, RBD_USER_ID_SECRET, RBD_USER_KEY_SECRET,
};

use super::{Credentials, ImageSpec, Secret};
use crate::error::{Error, Result};

/// Longest pool, image or cluster name accepted.
pub const MAX_NAME_LEN: usize = 250;
/// Longest monitor list accepted.
pub const MAX_MONITORS_LEN: usize = 1024;
/// Longest user name or key accepted.
pub const MAX_CREDENTIAL_LEN: usize = 256;

/// The RBD part of a NodeStageVolume request.
#[derive(Debug)]
pub struct RbdStage {
    /// The image.
    pub image: ImageSpec,
    /// The monitors, comma-separated.
    pub monitors: String,
    /// The user it is mapped as.
    pub credentials: Credentials,
    /// The controller published it read-only (`rbdReadOnly`): mapped and staged read-only,
    /// whatever the capability.
    pub read_only: bool,
    /// Mapped with the exclusive lock held (`rbdExclusiveLock`; the kernel attacher only).
    pub exclusive: bool,
}

/// Whether a publish_context names an RBD image.
pub fn is_rbd(ctx: &HashMap<String, String>) -> bool {
    ctx.contains_key(RBD_POOL_KEY) || ctx.contains_key(RBD_IMAGE_KEY)
}

/// The RBD part of NodeStageVolume, or None for a volume that is not RBD.
pub fn stage(req: &csi::NodeStageVolumeRequest) -> Result<Option<RbdStage>> {
    let ctx = &req.publish_context;
    if !is_rbd(ctx) {
        return Ok(None);
    }
    let field = |key: &'static str, field: &'static str| {
        ctx.get(key)
            .ok_or_else(|| Error::invalid(field, "must be set for an RBD volume"))
    };
    let pool = name(RBD_POOL_FIELD, field(RBD_POOL_KEY, RBD_POOL_FIELD)?)?;
    let image = name(RBD_IMAGE_FIELD, field(RBD_IMAGE_KEY, RBD_IMAGE_FIELD)?)?;
    let monitors = monitors(field(RBD_MONITORS_KEY, RBD_MONITORS_FIELD)?)?;
    let cluster_id = ctx
        .get(RBD_CLUSTER_ID_KEY)
        .filter(|c| !c.is_empty())
        .map(|c| name(RBD_CLUSTER_ID_FIELD, c))
        .transpose()?;
    let flag = |key: &str, field: &'static str| match ctx.get(key).map(String::as_str) {
        None | Some("" | "false") => Ok(false),
        Some("true") => Ok(true),
        Some(other) => Err(Error::invalid(
            field,
            format!(
                "{:?} is neither \"true\" nor \"false\"",
                moor_runtime::limits::trunc(other)
            ),
        )),
    };
    let read_only = flag(RBD_READ_ONLY_KEY, RBD_READ_ONLY_FIELD)?;
    let exclusive = flag(RBD_EXCLUSIVE_KEY, RBD_EXCLUSIVE_FIELD)?;
    let credentials = credentials(&req.secrets)?;
    Ok(Some(RbdStage {
        image: ImageSpec {
            cluster_id,
            pool,
            image,
        },
        monitors,
        credentials,
        read_only,
        exclusive,
    }))
}

/// A pool, image or cluster name: printable ASCII without blanks, `/` or `@` (which the
/// kernel's request and the rbd tools give a meaning), not starting with `-` or `.`.
fn name(field: &'static str, raw: &str) -> Result<String> {
    if raw.is_empty() || raw.len() > MAX_NAME_LEN {
        return Err(Error::invalid(
            field,
            format!("must be 1 to {MAX_NAME_LEN} bytes"),
        ));
    }
    let bad = raw
        .bytes()
        .any(|b| !b.is_ascii_graphic() || matches!(b, b'/' | b'@' | b'\\' | b',' | b'%'));
    if bad || raw.starts_with(['-', '.']) {
        return Err(Error::invalid(
            field,
            format!(
                "{:?} is not a name moor maps (printable ASCII without blanks, '/', '@', ',', \
                 '%' or '\\', not starting with '-' or '.')",
                moor_runtime::limits::trunc(raw)
            ),
        ));
    }
    Ok(raw.to_string())
}

/// The monitors: comma-separated addresses (`host[:port]`, `[v6][:port]`, optionally with a
/// `v1:`/`v2:` prefix).
fn monitors(raw: &str) -> Result<String> {
    const FIELD: &str = RBD_MONITORS_FIELD;
    let raw = raw.trim();
    if raw.is_empty() || raw.len() > MAX_MONITORS_LEN {
        return Err(Error::invalid(
            FIELD,
            format!("must be 1 to {MAX_MONITORS_LEN} bytes"),
        ));
    }
    for addr in raw.split(',') {
        let ok = !addr.is_empty()
            && addr.bytes().all(|b| {
                b.is_ascii_alphanumeric() || matches!(b, b'.' | b':' | b'[' | b']' | b'-')
            })
            && !addr.starts_with('-');
        if !ok {
            return Err(Error::invalid(
                FIELD,
                format!(
                    "{:?} is not a monitor address (host[:port], [ipv6][:port])",
                    moor_runtime::limits::trunc(addr)
                ),
            ));
        }
    }
    Ok(raw.to_string())
}

/// The user and key from NodeStageVolume's secrets; the key's value is never quoted.
fn credentials(secrets: &HashMap<String, String>) -> Result<Credentials> {
    let user = secrets
        .get(RBD_USER_ID_SECRET)
        .ok_or_else(|| Error::invalid("secrets", "userID must be set for an RBD volume"))?;
    let user = user.strip_prefix("client.").unwrap_or(user);
    let user_ok = !user.is_empty()
        && user.len() <= MAX_CREDENTIAL_LEN
        && user
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
        && !user.starts_with('-');
    if !user_ok {
        return Err(Error::invalid(
            "secrets",
            "userID must be a Ceph user name (letters, digits, '.', '_', '-')",
        ));
    }
    let key = secrets
        .get(RBD_USER_KEY_SECRET)
        .ok_or_else(|| Error::invalid("secrets", "userKey must be set for an RBD volume"))?;
    let key = key.trim();
    let key_ok = !key.is_empty()
        && key.len() <= MAX_CREDENTIAL_LEN
        && key
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'+' | b'/' | b'='));
    if !key_ok {
        return Err(Error::invalid(
            "secrets",
            "userKey is not a cephx key (base64)",
        ));
    }
    Ok(Credentials {
        user: user.to_string(),
        key: Secret::new(key),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const POOL_KEY: &str = RBD_POOL_KEY;
    const IMAGE_KEY: &str = RBD_IMAGE_KEY;
    const MONITORS_KEY: &str = RBD_MONITORS_KEY;
    const CLUSTER_ID_KEY: &str = RBD_CLUSTER_ID_KEY;
    const USER_ID_KEY: &str = RBD_USER_ID_SECRET;
    const USER_KEY_KEY: &str = RBD_USER_KEY_SECRET;
    const KEY: &str = "AQBkQkNnAAAAABAAbm9vcmtleW5vb3JrZXlub29yaw==";

    fn req(ctx: &[(&str, &str)], secrets: &[(&str, &str)]) -> csi::NodeStageVolumeRequest {
        csi::NodeStageVolumeRequest {
            publish_context: ctx
                .iter()
                .map(|(k, v)| ((*k).to_string(), (*v).to_string()))
                .collect(),
            secrets: secrets
                .iter()
                .map(|(k, v)| ((*k).to_string(), (*v).to_string()))
                .collect(),
            ..Default::default()
        }
    }

    fn good_ctx() -> Vec<(&'static str, &'static str)> {
        vec![
            (POOL_KEY, "moor"),
            (IMAGE_KEY, "csi-vol-1"),
            (
                MONITORS_KEY,
                "10.0.0.1:6789,[fd00::1]:3300,v2:10.0.0.2:3300",
            ),
        ]
    }

    #[test]
    fn a_volume_without_rbd_keys_is_not_rbd() {
        assert!(
            stage(&req(&[("devicePath", "/dev/loop1")], &[]))
                .unwrap()
                .is_none()
        );
    }

    #[test]
    fn a_full_request_parses() {
        let mut ctx = good_ctx();
        ctx.push((CLUSTER_ID_KEY, "ceph-a"));
        let r = stage(&req(
            &ctx,
            &[(USER_ID_KEY, "client.moor"), (USER_KEY_KEY, KEY)],
        ))
        .unwrap()
        .unwrap();
        assert_eq!(r.image.to_string(), "ceph-a:moor/csi-vol-1");
        assert!(!r.read_only);
        assert_eq!(r.credentials.user, "moor");
        assert_eq!(r.credentials.key.expose(), KEY);
        assert!(!format!("{r:?}").contains(KEY), "{r:?}");
    }

    #[test]
    fn a_read_only_publication_says_so() {
        let mut ctx = good_ctx();
        ctx.push((RBD_READ_ONLY_KEY, "true"));
        let secrets = [(USER_ID_KEY, "moor"), (USER_KEY_KEY, KEY)];
        assert!(stage(&req(&ctx, &secrets)).unwrap().unwrap().read_only);
        ctx.pop();
        ctx.push((RBD_READ_ONLY_KEY, "false"));
        assert!(!stage(&req(&ctx, &secrets)).unwrap().unwrap().read_only);
    }

    #[test]
    fn an_exclusive_publication_says_so_and_a_bad_flag_is_refused() {
        let secrets = [(USER_ID_KEY, "moor"), (USER_KEY_KEY, KEY)];
        let mut ctx = good_ctx();
        assert!(!stage(&req(&ctx, &secrets)).unwrap().unwrap().exclusive);
        ctx.push((RBD_EXCLUSIVE_KEY, "true"));
        assert!(stage(&req(&ctx, &secrets)).unwrap().unwrap().exclusive);
        ctx.pop();
        ctx.push((RBD_EXCLUSIVE_KEY, "yes"));
        let e = stage(&req(&ctx, &secrets)).unwrap_err();
        assert!(e.to_string().contains(RBD_EXCLUSIVE_FIELD), "{e}");
    }

    #[test]
    fn injection_and_missing_fields_are_refused_without_quoting_the_key() {
        let secrets = [(USER_ID_KEY, "moor"), (USER_KEY_KEY, KEY)];
        for (key, bad) in [
            (POOL_KEY, "moor rbd"),
            (POOL_KEY, "a/b"),
            (IMAGE_KEY, "img snap"),
            (IMAGE_KEY, "img@snap"),
            (IMAGE_KEY, "-o"),
            (IMAGE_KEY, ""),
            (MONITORS_KEY, "10.0.0.1:6789 name=admin"),
            (MONITORS_KEY, "10.0.0.1,,10.0.0.2"),
            (CLUSTER_ID_KEY, "a b"),
            (RBD_READ_ONLY_KEY, "yes"),
        ] {
            let mut ctx = good_ctx();
            ctx.retain(|(k, _)| *k != key);
            ctx.push((key, bad));
            let e = stage(&req(&ctx, &secrets)).unwrap_err();
            assert_eq!(e.code(), tonic::Code::InvalidArgument, "{key}={bad:?}: {e}");
        }
        for missing in [IMAGE_KEY, MONITORS_KEY] {
            let mut ctx = good_ctx();
            ctx.retain(|(k, _)| *k != missing);
            assert!(stage(&req(&ctx, &secrets)).is_err(), "{missing}");
        }
        for bad in [
            vec![(USER_ID_KEY, "moor")],
            vec![(USER_KEY_KEY, KEY)],
            vec![(USER_ID_KEY, "moor,secret=x"), (USER_KEY_KEY, KEY)],
            vec![(USER_ID_KEY, "moor"), (USER_KEY_KEY, "AQB key,ro")],
        ] {
            let e = stage(&req(&good_ctx(), &bad)).unwrap_err();
            assert_eq!(e.code(), tonic::Code::InvalidArgument, "{bad:?}");
            assert!(!e.to_string().contains("AQB"), "{e}");
        }
    }
}
