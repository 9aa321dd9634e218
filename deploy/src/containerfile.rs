//! What a Containerfile (Dockerfile syntax) builds and installs, read without building it.

/// One instruction: keyword (upper case) and its arguments, continuation lines joined and
/// whitespace runs made single spaces.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Instruction {
    /// `FROM`, `RUN`, `COPY`, ...
    pub keyword: String,
    /// The rest of the instruction.
    pub args: String,
}

/// A build stage.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Stage {
    /// The base image.
    pub from: String,
    /// `AS name`, if given.
    pub name: Option<String>,
    /// The stage's instructions after FROM.
    pub instructions: Vec<Instruction>,
}

impl Stage {
    /// The arguments of every instruction of this keyword.
    pub fn all(&self, keyword: &str) -> impl Iterator<Item = &str> {
        self.instructions
            .iter()
            .filter(move |i| i.keyword == keyword)
            .map(|i| i.args.as_str())
    }

    /// Packages installed by `apt-get install` in RUN instructions.
    pub fn apt_packages(&self) -> Vec<String> {
        let mut out = Vec::new();
        for run in self.all("RUN") {
            for cmd in run.split("&&").flat_map(|c| c.split(';')) {
                let words: Vec<&str> = cmd.split_whitespace().collect();
                let Some(pos) = words.windows(2).position(|w| w == ["apt-get", "install"]) else {
                    continue;
                };
                out.extend(
                    words[pos + 2..]
                        .iter()
                        .filter(|w| !w.starts_with('-'))
                        .map(|w| (*w).to_owned()),
                );
            }
        }
        out
    }
}

/// Splits a Containerfile into stages.
///
/// # Errors
/// When an instruction comes before the first FROM (other than ARG), or a FROM is malformed.
pub fn parse(text: &str) -> Result<Vec<Stage>, String> {
    let mut logical = Vec::new();
    let mut cur = String::new();
    for line in text.lines() {
        let t = line.trim();
        if cur.is_empty() && (t.is_empty() || t.starts_with('#')) {
            continue;
        }
        if t.starts_with('#') {
            continue;
        }
        match t.strip_suffix('\\') {
            Some(part) => {
                cur.push_str(part);
                cur.push(' ');
            }
            None => {
                cur.push_str(t);
                logical.push(std::mem::take(&mut cur));
            }
        }
    }
    if !cur.is_empty() {
        logical.push(cur);
    }
    let mut stages: Vec<Stage> = Vec::new();
    for l in logical {
        let (kw, args) = l.split_once(char::is_whitespace).unwrap_or((&l, ""));
        let args = args.split_whitespace().collect::<Vec<_>>().join(" ");
        let kw = kw.to_ascii_uppercase();
        if kw == "FROM" {
            let words: Vec<&str> = args
                .split_whitespace()
                .filter(|w| !w.starts_with("--"))
                .collect();
            let stage = match words[..] {
                [image] => Stage {
                    from: image.to_owned(),
                    ..Stage::default()
                },
                [image, as_, name] if as_.eq_ignore_ascii_case("as") => Stage {
                    from: image.to_owned(),
                    name: Some(name.to_owned()),
                    ..Stage::default()
                },
                _ => return Err(format!("FROM {args}: expected IMAGE [AS NAME]")),
            };
            stages.push(stage);
        } else if let Some(stage) = stages.last_mut() {
            stage.instructions.push(Instruction { keyword: kw, args });
        } else if kw != "ARG" {
            return Err(format!("{kw} before the first FROM"));
        }
    }
    Ok(stages)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stages_and_packages() {
        let text = "# syntax=docker/dockerfile:1\nARG X=1\nFROM rust:1 AS builder\n\
                    RUN cargo build \\\n    --release\nFROM debian:12\n# comment\n\
                    RUN apt-get update \\\n && apt-get install -y --no-install-recommends \\\n\
                    a b \\\n && rm -rf /x\nCOPY --from=builder /a /b\n";
        let s = parse(text).unwrap();
        assert_eq!(s.len(), 2);
        assert_eq!(s[0].name.as_deref(), Some("builder"));
        assert_eq!(
            s[0].all("RUN").collect::<Vec<_>>(),
            ["cargo build --release"]
        );
        assert_eq!(s[1].from, "debian:12");
        assert_eq!(s[1].apt_packages(), ["a", "b"]);
        assert!(parse("RUN x\nFROM y\n").is_err());
        assert!(parse("FROM a b\n").is_err());
    }
}
