//! A strict YAML loader for manifests: YAML text to [`serde_json::Value`] documents.
//!
//! Stricter than Kubernetes on purpose, so that what the checks see is what the API server sees:
//!
//! - duplicate keys, non-string keys, anchors, aliases and tags are errors (kubectl would take
//!   the last duplicate silently; the others are never needed in a manifest);
//! - a plain (unquoted) scalar is resolved with the YAML 1.2 core schema, and is an error when
//!   YAML 1.1, which Kubernetes' YAML reader follows, reads it differently: `yes`, `on`, `n`
//!   are booleans there, `0644` is octal, `1_000` is a number, `2024-01-02` a timestamp. Quote
//!   such values.
//! - `.inf` and `.nan` are errors (JSON has no such numbers).

use serde_json::{Map, Number, Value};
use yaml_rust2::parser::{Event, Parser};
use yaml_rust2::scanner::{Marker, TScalarStyle};

/// One YAML document of a stream.
#[derive(Debug, Clone, PartialEq)]
pub struct Doc {
    /// The document's content.
    pub value: Value,
    /// 1-based line where the document's content starts.
    pub line: usize,
}

enum Frame {
    Seq(Vec<Value>),
    Map {
        map: Map<String, Value>,
        key: Option<String>,
    },
}

fn at(mark: Marker, msg: impl std::fmt::Display) -> String {
    format!("line {}, column {}: {msg}", mark.line(), mark.col())
}

/// Parses every document of `src`. Empty documents are skipped.
///
/// # Errors
/// The first syntax error or strictness violation, with its line and column.
pub fn load_all(src: &str) -> Result<Vec<Doc>, String> {
    let mut parser = Parser::new_from_str(src);
    let mut docs = Vec::new();
    let mut stack: Vec<Frame> = Vec::new();
    let mut root: Option<(Value, usize)> = None;
    let mut doc_line = 1;
    loop {
        let (event, mark) = parser.next_token().map_err(|e| at(*e.marker(), e.info()))?;
        let value = match event {
            Event::StreamEnd => break,
            Event::StreamStart | Event::Nothing => continue,
            Event::DocumentStart => continue,
            Event::DocumentEnd => {
                if let Some((value, line)) = root.take()
                    && !value.is_null()
                {
                    docs.push(Doc { value, line });
                }
                continue;
            }
            Event::Alias(_) => return Err(at(mark, "aliases are not allowed in manifests")),
            Event::Scalar(text, style, anchor, tag) => {
                if anchor != 0 {
                    return Err(at(mark, "anchors are not allowed in manifests"));
                }
                if let Some(tag) = tag {
                    return Err(at(
                        mark,
                        format!("tags are not allowed ({}{})", tag.handle, tag.suffix),
                    ));
                }
                if stack.is_empty() {
                    doc_line = mark.line();
                }
                if style == TScalarStyle::Plain {
                    resolve_plain(&text).map_err(|e| at(mark, e))?
                } else {
                    Value::String(text)
                }
            }
            Event::SequenceStart(anchor, ref tag) | Event::MappingStart(anchor, ref tag) => {
                if anchor != 0 {
                    return Err(at(mark, "anchors are not allowed in manifests"));
                }
                if tag.is_some() {
                    return Err(at(mark, "tags are not allowed in manifests"));
                }
                if stack.is_empty() {
                    doc_line = mark.line();
                }
                stack.push(if matches!(event, Event::SequenceStart(..)) {
                    Frame::Seq(Vec::new())
                } else {
                    Frame::Map {
                        map: Map::new(),
                        key: None,
                    }
                });
                continue;
            }
            Event::SequenceEnd => match stack.pop() {
                Some(Frame::Seq(items)) => Value::Array(items),
                _ => return Err(at(mark, "unbalanced sequence")),
            },
            Event::MappingEnd => match stack.pop() {
                Some(Frame::Map { map, key: None }) => Value::Object(map),
                _ => return Err(at(mark, "unbalanced mapping")),
            },
        };
        match stack.last_mut() {
            None => root = Some((value, doc_line)),
            Some(Frame::Seq(items)) => items.push(value),
            Some(Frame::Map { map, key }) => match key.take() {
                Some(k) => {
                    map.insert(k, value);
                }
                None => {
                    let Value::String(k) = value else {
                        return Err(at(mark, format!("mapping key {value} is not a string")));
                    };
                    if map.contains_key(&k) {
                        return Err(at(mark, format!("duplicate key {k:?}")));
                    }
                    *key = Some(k);
                }
            },
        }
    }
    Ok(docs)
}

/// Resolves a plain scalar with the YAML 1.2 core schema, refusing the ones YAML 1.1 reads
/// differently.
fn resolve_plain(s: &str) -> Result<Value, String> {
    if let Some(why) = yaml11_differs(s) {
        return Err(format!(
            "plain scalar {s:?} reads differently in YAML 1.1 (Kubernetes) and YAML 1.2 ({why}): \
             quote it"
        ));
    }
    Ok(match s {
        "" | "~" | "null" | "Null" | "NULL" => Value::Null,
        "true" | "True" | "TRUE" => Value::Bool(true),
        "false" | "False" | "FALSE" => Value::Bool(false),
        _ => {
            if let Some(n) = core_int(s) {
                n?
            } else if is_core_float(s) {
                let f: f64 = s
                    .parse()
                    .map_err(|e| format!("number {s:?} does not parse: {e}"))?;
                Value::Number(
                    Number::from_f64(f).ok_or_else(|| format!("number {s:?} is not finite"))?,
                )
            } else if matches!(
                s.trim_start_matches(['-', '+']),
                ".inf" | ".Inf" | ".INF" | ".nan" | ".NaN" | ".NAN"
            ) {
                return Err(format!("{s:?} is not a JSON number"));
            } else {
                Value::String(s.to_owned())
            }
        }
    })
}

/// YAML 1.2 core integers: decimal, `0o` octal, `0x` hex. `None` when `s` is not one.
fn core_int(s: &str) -> Option<Result<Value, String>> {
    let too_big = || format!("integer {s:?} does not fit in 64 bits");
    if let Some(oct) = s.strip_prefix("0o") {
        if !oct.is_empty() && oct.bytes().all(|b| (b'0'..=b'7').contains(&b)) {
            return Some(
                u64::from_str_radix(oct, 8)
                    .map(Value::from)
                    .map_err(|_| too_big()),
            );
        }
        return None;
    }
    if let Some(hex) = s.strip_prefix("0x") {
        if !hex.is_empty() && hex.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Some(
                u64::from_str_radix(hex, 16)
                    .map(Value::from)
                    .map_err(|_| too_big()),
            );
        }
        return None;
    }
    let digits = s.strip_prefix(['-', '+']).unwrap_or(s);
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let plus = s.strip_prefix('+').unwrap_or(s);
    Some(if let Ok(i) = plus.parse::<i64>() {
        Ok(Value::from(i))
    } else if let Ok(u) = plus.parse::<u64>() {
        Ok(Value::from(u))
    } else {
        Err(too_big())
    })
}

/// YAML 1.2 core floats: `[-+]? ( \. [0-9]+ | [0-9]+ ( \. [0-9]* )? ) ( [eE] [-+]? [0-9]+ )?`.
fn is_core_float(s: &str) -> bool {
    let s = s.strip_prefix(['-', '+']).unwrap_or(s);
    let (mantissa, exp) = match s.find(['e', 'E']) {
        Some(i) => (&s[..i], Some(&s[i + 1..])),
        None => (s, None),
    };
    let digits = |t: &str| !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit());
    let mantissa_ok = match mantissa.split_once('.') {
        Some(("", frac)) => digits(frac),
        Some((int, frac)) => digits(int) && (frac.is_empty() || digits(frac)),
        None => digits(mantissa),
    };
    let exp_ok = exp.is_none_or(|e| digits(e.strip_prefix(['-', '+']).unwrap_or(e)));
    mantissa_ok && exp_ok
}

/// Why YAML 1.1 (as Kubernetes' reader applies it) resolves the plain scalar `s` differently
/// than YAML 1.2 core, or `None` when both agree.
fn yaml11_differs(s: &str) -> Option<&'static str> {
    const BOOLS_11: [&str; 16] = [
        "y", "Y", "yes", "Yes", "YES", "n", "N", "no", "No", "NO", "on", "On", "ON", "off", "Off",
        "OFF",
    ];
    if BOOLS_11.contains(&s) {
        return Some("a boolean in YAML 1.1");
    }
    if s == "=" || s == "<<" {
        return Some("a value or merge key in YAML 1.1");
    }
    let unsigned = s.strip_prefix(['-', '+']).unwrap_or(s);
    let digits_ = |t: &str| !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit() || b == b'_');
    if unsigned.len() > 1 && unsigned.starts_with('0') && digits_(unsigned) {
        return Some("octal in YAML 1.1");
    }
    if let Some(bin) = unsigned.strip_prefix("0b")
        && !bin.is_empty()
        && bin.bytes().all(|b| matches!(b, b'0' | b'1' | b'_'))
    {
        return Some("binary in YAML 1.1");
    }
    if s.starts_with("0o") && core_int(s).is_some() {
        return Some("a string in YAML 1.1");
    }
    if unsigned.contains('_') && unsigned.bytes().any(|b| b.is_ascii_digit()) {
        let stripped: String = unsigned.chars().filter(|&c| c != '_').collect();
        if is_core_float(&stripped) {
            return Some("a number with digit separators in YAML 1.1");
        }
    }
    // Sexagesimal numbers: 1:20, 190:20:30.15
    if let Some((head, rest)) = unsigned.split_once(':')
        && digits_(head)
        && head.bytes().next().is_some_and(|b| b.is_ascii_digit())
    {
        let (rest, _frac) = rest.split_once('.').unwrap_or((rest, ""));
        if rest
            .split(':')
            .all(|p| !p.is_empty() && p.len() <= 2 && p.bytes().all(|b| b.is_ascii_digit()))
        {
            return Some("a base-60 number in YAML 1.1");
        }
    }
    // Timestamps: 2001-12-14, 2001-12-14t21:59:43.10-05:00
    let b = s.as_bytes();
    if b.len() >= 8
        && b[..4].iter().all(u8::is_ascii_digit)
        && b[4] == b'-'
        && s[5..]
            .split(['-', 't', 'T', ' '])
            .next()
            .is_some_and(|m| !m.is_empty() && m.len() <= 2 && m.bytes().all(|c| c.is_ascii_digit()))
    {
        return Some("a timestamp in YAML 1.1");
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn one(src: &str) -> Result<Value, String> {
        let mut docs = load_all(src)?;
        assert_eq!(docs.len(), 1, "{docs:?}");
        Ok(docs.remove(0).value)
    }

    #[test]
    fn scalars_resolve_as_yaml_1_2_core() {
        let v = one(
            "a: 1\nb: -2\nc: 1.5\nd: true\ne: ~\nf: text\ng: '0644'\nh: \"yes\"\ni: 0x1f\n\
             j: 1e3\nk: 18446744073709551615\nl: unix:///csi/csi.sock\nm: 10m\n",
        )
        .unwrap();
        assert_eq!(
            v,
            json!({"a": 1, "b": -2, "c": 1.5, "d": true, "e": null, "f": "text", "g": "0644",
                   "h": "yes", "i": 31, "j": 1000.0, "k": 18446744073709551615u64,
                   "l": "unix:///csi/csi.sock", "m": "10m"})
        );
    }

    #[test]
    fn yaml_1_1_ambiguities_are_rejected() {
        for bad in [
            "a: yes",
            "a: off",
            "a: N",
            "a: 0644",
            "a: 1_000",
            "a: 0b101",
            "a: 1:20",
            "a: 2024-01-02",
            "on: x",
            "a: 0o17",
            "<<: {}",
        ] {
            let e = one(bad).unwrap_err();
            assert!(e.contains("YAML 1.1"), "{bad}: {e}");
        }
        for good in [
            "a: '0644'",
            "a: \"on\"",
            "a: 0",
            "a: 10:x",
            "a: v1.2.3",
            "a: 127.0.0.1:9808",
            "a: :9808",
        ] {
            one(good).unwrap_or_else(|e| panic!("{good}: {e}"));
        }
    }

    #[test]
    fn structure_errors() {
        assert!(
            one("a: 1\na: 2\n")
                .unwrap_err()
                .contains("duplicate key \"a\"")
        );
        assert!(one("1: x\n").unwrap_err().contains("not a string"));
        assert!(one("a: &x 1\nb: *x\n").unwrap_err().contains("anchors"));
        assert!(one("a: !!str 1\n").unwrap_err().contains("tags"));
        assert!(one("a: .inf\n").unwrap_err().contains("not a JSON number"));
        assert!(one("a: [1\n").is_err());
    }

    #[test]
    fn multi_document_streams() {
        let docs = load_all("---\na: 1\n---\n# only a comment\n---\nb: [x, {c: d}]\n").unwrap();
        assert_eq!(docs.len(), 2);
        assert_eq!(docs[0].value, json!({"a": 1}));
        assert_eq!(docs[1].value, json!({"b": ["x", {"c": "d"}]}));
        assert_eq!(docs[0].line, 2);
        assert_eq!(docs[1].line, 6);
    }
}
