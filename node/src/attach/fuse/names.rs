//! The mount dir of an image: `<pool>+<image>` or `<cluster>+<pool>+<image>` under the state
//! dir's `rbd/`, each part escaped (`[A-Za-z0-9._-]` as is, anything else `%XX`), so the name
//! says which image it serves and parses back.

use super::NAME_MAX;
use crate::attach::{AttachError, ImageSpec};

/// Escapes a name part for a dir name: `[A-Za-z0-9._-]` as is, anything else `%XX`.
fn escape(part: &str) -> String {
    let mut out = String::with_capacity(part.len());
    for b in part.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-') {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

fn unescape(part: &str) -> Option<String> {
    let bytes = part.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while let Some(&b) = bytes.get(i) {
        if b == b'%' {
            let hex = std::str::from_utf8(bytes.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(b);
            i += 1;
        }
    }
    String::from_utf8(out).ok().filter(|s| !s.is_empty())
}

/// The mount dir's name for an image.
pub fn dir_name(image: &ImageSpec) -> Result<String, AttachError> {
    let mut parts = Vec::new();
    if let Some(c) = &image.cluster_id {
        parts.push(escape(c));
    }
    parts.push(escape(&image.pool));
    parts.push(escape(&image.image));
    let name = parts.join("+");
    if name.len() > NAME_MAX || image.image.len() > NAME_MAX {
        return Err(AttachError::Unsupported {
            image: image.to_string(),
            reason: format!(
                "the names are too long for rbd-fuse's mount dir ({} bytes, at most {NAME_MAX})",
                name.len()
            ),
        });
    }
    Ok(name)
}

/// The image a mount dir's name names.
pub fn parse_dir_name(name: &str) -> Option<ImageSpec> {
    let parts: Vec<&str> = name.split('+').collect();
    match parts.as_slice() {
        [pool, image] => Some(ImageSpec {
            cluster_id: None,
            pool: unescape(pool)?,
            image: unescape(image)?,
        }),
        [cluster, pool, image] => Some(ImageSpec {
            cluster_id: Some(unescape(cluster)?),
            pool: unescape(pool)?,
            image: unescape(image)?,
        }),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dir_names_escape_and_parse_back() {
        for spec in [
            ImageSpec {
                cluster_id: None,
                pool: "moor".into(),
                image: "csi-vol-0a1b".into(),
            },
            ImageSpec {
                cluster_id: Some("ceph+east".into()),
                pool: "p:1".into(),
                image: "img+x~y".into(),
            },
        ] {
            let name = dir_name(&spec).unwrap();
            assert!(
                name.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"._-%+".contains(&b)),
                "{name}"
            );
            assert_eq!(parse_dir_name(&name), Some(spec));
        }
        assert_eq!(
            dir_name(&ImageSpec {
                cluster_id: None,
                pool: "moor".into(),
                image: "a".into()
            })
            .unwrap(),
            "moor+a"
        );
        assert_eq!(parse_dir_name("a+b+c+d"), None);
        assert_eq!(parse_dir_name("a+%zz"), None);
        assert_eq!(parse_dir_name("+b"), None);
        let long = ImageSpec {
            cluster_id: None,
            pool: "p".into(),
            image: "x".repeat(200),
        };
        assert!(
            dir_name(&ImageSpec {
                pool: "~".repeat(30),
                ..long.clone()
            })
            .is_err()
        );
        assert!(dir_name(&long).is_ok());
    }
}
