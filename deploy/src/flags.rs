//! The command-line flags of moor's binaries, read from their clap commands
//! (`moor_node::args::Args` and `moor_controller::args::Args`), and a check of the arguments a
//! manifest passes against them.
//!
//! [`from_command`] takes every long flag of a command with what clap knows of it: whether it
//! takes a value, its value type or possible values, whether it is required, the environment
//! variable that can stand for it (clap's `env`), its default, its aliases. What a manifest
//! cannot pass as `--name=value` (positional arguments, subcommands) is an error, never
//! skipped.

use std::collections::BTreeMap;

/// Whether a flag takes a value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arity {
    /// `--flag`.
    Switch,
    /// `--flag=value` or `--flag value`.
    Value,
}

/// What a flag's value must look like.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ValueKind {
    /// Anything (strings, paths, types the parser does not know).
    Any,
    /// A non-negative integer.
    Unsigned,
    /// An integer.
    Signed,
    /// One of these names (a clap `ValueEnum`).
    OneOf(Vec<String>),
}

/// One flag of a binary.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Flag {
    /// The long name, without `--`.
    pub name: String,
    /// Switch or value.
    pub arity: Arity,
    /// What the value must look like.
    pub kind: ValueKind,
    /// Required (no default; not `Option`, `Vec` or `bool`).
    pub required: bool,
    /// The environment variable clap reads it from, if any.
    pub env: Option<String>,
    /// The default value, as written in the source (for `default_value = "..."` and
    /// `default_value_t = literal`).
    pub default: Option<String>,
    /// May be given more than once (`Vec<_>`, `ArgAction::Append`/`Count`).
    pub repeatable: bool,
    /// Not in the binary yet: allowed by [`COMING_FLAGS`].
    pub coming: bool,
}

/// A binary's command line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cli {
    /// The binary's name.
    pub binary: String,
    /// Flags by long name.
    pub flags: BTreeMap<String, Flag>,
}

/// A flag a manifest may use before its binary has it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ComingFlag {
    /// `moor-node` or `moor-controller`.
    pub binary: &'static str,
    /// Long name, without `--`.
    pub name: &'static str,
    /// Switch or value.
    pub arity: Arity,
}

/// COMING FLAGS: flags the manifests may pass although the binaries do not parse them yet.
///
/// Remove an entry once its flag is in the binary's `Args` (the binary then wins, and the
/// tests print a note that the entry is stale). Only the optional overlays may use a flag that
/// is still coming: the default overlay (`overlays/registrar`) must run with today's binaries,
/// and a test enforces it.
pub const COMING_FLAGS: &[ComingFlag] = &[];

impl Cli {
    /// Adds the [`COMING_FLAGS`] of this binary that it does not define yet.
    ///
    /// Returns the notes about stale entries (the flag is in the binary now) and the errors
    /// (the binary defines it with another arity than the manifests expect).
    pub fn with_coming(mut self, coming: &[ComingFlag]) -> (Self, Vec<String>, Vec<String>) {
        let (mut notes, mut errors) = (Vec::new(), Vec::new());
        for c in coming.iter().filter(|c| c.binary == self.binary) {
            match self.flags.get(c.name) {
                Some(f) if f.arity == c.arity => notes.push(format!(
                    "{} --{} has landed: remove it from COMING_FLAGS in deploy/src/flags.rs",
                    c.binary, c.name
                )),
                Some(_) => errors.push(format!(
                    "{} --{} landed as a {:?}, but COMING_FLAGS (and so the manifests) expect \
                     a {:?}",
                    c.binary, c.name, self.flags[c.name].arity, c.arity
                )),
                None => {
                    self.flags.insert(
                        c.name.to_owned(),
                        Flag {
                            name: c.name.to_owned(),
                            arity: c.arity,
                            kind: ValueKind::Any,
                            required: false,
                            env: None,
                            default: None,
                            repeatable: false,
                            coming: true,
                        },
                    );
                }
            }
        }
        (self, notes, errors)
    }

    /// Checks a container's `args` against this command line. `env` lists the environment
    /// variables the container defines (they satisfy required flags clap reads from `env`).
    pub fn check_args(&self, args: &[String], env: &[&str]) -> Vec<String> {
        let mut problems = Vec::new();
        let mut seen: BTreeMap<&str, usize> = BTreeMap::new();
        let mut i = 0;
        while i < args.len() {
            let arg = &args[i];
            i += 1;
            let Some(long) = arg.strip_prefix("--") else {
                problems.push(format!(
                    "{}: argument {arg:?} is not a long flag (--name or --name=value)",
                    self.binary
                ));
                continue;
            };
            let (name, inline) = match long.split_once('=') {
                Some((n, v)) => (n, Some(v.to_owned())),
                None => (long, None),
            };
            let Some(flag) = self.flags.get(name) else {
                let known: Vec<_> = self.flags.keys().map(|k| format!("--{k}")).collect();
                problems.push(format!(
                    "{} has no flag --{name} (it has: {})",
                    self.binary,
                    known.join(" ")
                ));
                continue;
            };
            *seen.entry(&flag.name).or_default() += 1;
            match flag.arity {
                Arity::Switch => {
                    if let Some(v) = inline {
                        problems.push(format!(
                            "{}: --{name} is a switch and takes no value (found {v:?})",
                            self.binary
                        ));
                    }
                }
                Arity::Value => {
                    let value = match inline {
                        Some(v) => v,
                        None if i < args.len() && !args[i].starts_with("--") => {
                            i += 1;
                            args[i - 1].clone()
                        }
                        None => {
                            problems.push(format!("{}: --{name} needs a value", self.binary));
                            continue;
                        }
                    };
                    if let Some(p) = check_value(&value, &flag.kind) {
                        problems.push(format!("{}: --{name}={value}: {p}", self.binary));
                    }
                }
            }
        }
        for (name, count) in &seen {
            if *count > 1 && !self.flags[*name].repeatable {
                problems.push(format!("{}: --{name} is given {count} times", self.binary));
            }
        }
        for f in self
            .flags
            .iter()
            .filter(|(k, f)| f.required && **k == f.name)
            .map(|(_, f)| f)
        {
            let from_env = f.env.as_deref().is_some_and(|e| env.contains(&e));
            if !seen.contains_key(f.name.as_str()) && !from_env {
                problems.push(format!(
                    "{}: required flag --{} is missing",
                    self.binary, f.name
                ));
            }
        }
        problems
    }
}

fn check_value(value: &str, kind: &ValueKind) -> Option<String> {
    if value.contains("$(") {
        // Expanded by the kubelet from the container's environment: checked elsewhere.
        return None;
    }
    match kind {
        ValueKind::Any => None,
        ValueKind::Unsigned => value
            .parse::<u64>()
            .is_err()
            .then(|| "not a non-negative integer".to_owned()),
        ValueKind::Signed => value
            .parse::<i64>()
            .is_err()
            .then(|| "not an integer".to_owned()),
        ValueKind::OneOf(names) => {
            (!names.iter().any(|n| n == value)).then(|| format!("not one of {}", names.join(", ")))
        }
    }
}

/// Reads a binary's command line from its clap [`clap::Command`] (`Args::command()`), named
/// by the command's name.
///
/// Every argument with a long name is a flag, under that name and each of its aliases. An
/// argument whose action takes values takes a value; the others are switches. Values of an
/// unsigned or signed integer type, or with a fixed set of possible values (a `ValueEnum`), are
/// checked. `--help` and `--version` are left out: a manifest that passes them gets a
/// container that exits at once.
///
/// # Errors
/// When the command has what a manifest's `args` cannot give as `--name=value`: positional
/// arguments or subcommands.
pub fn from_command(cmd: &clap::Command) -> Result<Cli, String> {
    let binary = cmd.get_name().to_owned();
    if let Some(sub) = cmd.get_subcommands().next() {
        return Err(format!(
            "{binary}: subcommand {} is not supported by deploy's flag reader",
            sub.get_name()
        ));
    }
    let mut flags = BTreeMap::new();
    for arg in cmd.get_arguments() {
        let action = arg.get_action();
        if matches!(
            action,
            clap::ArgAction::Help
                | clap::ArgAction::HelpShort
                | clap::ArgAction::HelpLong
                | clap::ArgAction::Version
        ) {
            continue;
        }
        let Some(name) = arg.get_long() else {
            return Err(format!(
                "{binary}: argument {} has no long flag (positional or short only)",
                arg.get_id()
            ));
        };
        let arity = if action.takes_values() {
            Arity::Value
        } else {
            Arity::Switch
        };
        let flag = Flag {
            name: name.to_owned(),
            arity,
            kind: value_kind(arg),
            required: arg.is_required_set(),
            env: arg.get_env().map(|e| e.to_string_lossy().into_owned()),
            default: arg
                .get_default_values()
                .first()
                .map(|d| d.to_string_lossy().into_owned()),
            repeatable: matches!(action, clap::ArgAction::Append | clap::ArgAction::Count),
            coming: false,
        };
        let aliases = arg.get_all_aliases().unwrap_or_default();
        for n in std::iter::once(name).chain(aliases) {
            if flags.insert(n.to_owned(), flag.clone()).is_some() {
                return Err(format!("{binary}: flag --{n} is defined twice"));
            }
        }
    }
    Ok(Cli { binary, flags })
}

/// What an argument's values must look like: from its possible values, or the type its value
/// parser makes.
fn value_kind(arg: &clap::Arg) -> ValueKind {
    use std::any::TypeId;
    let values = arg.get_possible_values();
    if !values.is_empty() {
        return ValueKind::OneOf(
            values
                .iter()
                .flat_map(|v| v.get_name_and_aliases().map(str::to_owned))
                .collect(),
        );
    }
    let ty = arg.get_value_parser().type_id();
    macro_rules! one_of {
        ($($t:ty),+) => { false $(|| ty == TypeId::of::<$t>())+ };
    }
    if one_of!(u8, u16, u32, u64, u128, usize) {
        ValueKind::Unsigned
    } else if one_of!(i8, i16, i32, i64, i128, isize) {
        ValueKind::Signed
    } else {
        ValueKind::Any
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[allow(dead_code, reason = "only the command is read")]
    #[derive(Debug, Clone, Copy, clap::ValueEnum)]
    enum LogFormat {
        Text,
        Json,
        #[value(name = "logfmt")]
        KeyValue,
        #[value(skip)]
        Hidden,
    }

    #[derive(Debug, clap::Args)]
    struct Common {
        #[arg(long, allow_negative_numbers = true)]
        offset: Option<i32>,
    }

    #[allow(dead_code, reason = "only the command is read")]
    #[derive(Debug, clap::Parser)]
    #[command(name = "x", version)]
    struct Args {
        #[arg(long, default_value = "unix:///csi/csi.sock", env = "CSI_ENDPOINT")]
        endpoint: String,
        #[arg(long, env = "NODE_ID")]
        node_id: String,
        #[arg(long = "max", default_value_t = 0)]
        max_volumes: u64,
        #[arg(long, value_enum, default_value_t = LogFormat::Text)]
        log_format: LogFormat,
        #[arg(long)]
        journal_fsync: bool,
        #[arg(long, alias = "old-dir")]
        dir: Option<std::path::PathBuf>,
        #[arg(long, action = clap::ArgAction::Append)]
        label: Vec<String>,
        #[arg(long)]
        required_one: String,
        #[command(flatten)]
        common: Common,
    }

    fn cli() -> Cli {
        from_command(&Args::command()).unwrap()
    }

    #[test]
    fn reads_flags() {
        let cli = cli();
        let names: Vec<_> = cli.flags.keys().map(String::as_str).collect();
        assert_eq!(
            names,
            [
                "dir",
                "endpoint",
                "journal-fsync",
                "label",
                "log-format",
                "max",
                "node-id",
                "offset",
                "old-dir",
                "required-one"
            ],
            "flattened flags are in, --help and --version out"
        );
        let f = &cli.flags;
        assert_eq!(f["journal-fsync"].arity, Arity::Switch);
        assert!(f["node-id"].required && !f["endpoint"].required && !f["dir"].required);
        assert!(f["required-one"].required && !f["label"].required && f["label"].repeatable);
        assert_eq!(f["node-id"].env.as_deref(), Some("NODE_ID"));
        assert_eq!(
            f["endpoint"].default.as_deref(),
            Some("unix:///csi/csi.sock")
        );
        assert_eq!(f["max"].kind, ValueKind::Unsigned);
        assert_eq!(f["offset"].kind, ValueKind::Signed);
        assert_eq!(f["dir"], f["old-dir"]);
        assert_eq!(
            f["log-format"].kind,
            ValueKind::OneOf(vec!["text".into(), "json".into(), "logfmt".into()])
        );
    }

    #[test]
    fn checks_args() {
        let cli = cli();
        let args = |a: &[&str]| a.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
        let ok = args(&[
            "--node-id=$(NODE_ID)",
            "--max",
            "3",
            "--journal-fsync",
            "--log-format=json",
            "--label=a",
            "--label=b",
            "--required-one=x",
        ]);
        assert_eq!(cli.check_args(&ok, &[]), Vec::<String>::new());
        let bad = args(&[
            "--nope",
            "--journal-fsync=true",
            "--max=-1",
            "--offset=x",
            "--log-format=xml",
            "--dir=/a",
            "--old-dir=/b",
            "positional",
            "--required-one",
        ]);
        let p = cli.check_args(&bad, &[]).join("\n");
        for want in [
            "has no flag --nope",
            "--journal-fsync is a switch",
            "--max=-1: not a non-negative integer",
            "--offset=x: not an integer",
            "--log-format=xml: not one of text, json, logfmt",
            "--dir is given 2 times",
            "\"positional\" is not a long flag",
            "--required-one needs a value",
            "required flag --node-id is missing",
        ] {
            assert!(p.contains(want), "{want} not in:\n{p}");
        }
        // clap reads NODE_ID from the environment: the env var satisfies the required flag.
        let p = cli.check_args(&args(&["--required-one=x"]), &["NODE_ID"]);
        assert_eq!(p, Vec::<String>::new());
    }

    #[test]
    fn coming_flags_merge() {
        let coming = [
            ComingFlag {
                binary: "x",
                name: "later",
                arity: Arity::Value,
            },
            ComingFlag {
                binary: "x",
                name: "max",
                arity: Arity::Value,
            },
            ComingFlag {
                binary: "x",
                name: "journal-fsync",
                arity: Arity::Value,
            },
            ComingFlag {
                binary: "other",
                name: "elsewhere",
                arity: Arity::Switch,
            },
        ];
        let (cli, notes, errors) = cli().with_coming(&coming);
        assert!(cli.flags["later"].coming && !cli.flags.contains_key("elsewhere"));
        assert_eq!(notes.len(), 1, "{notes:?}");
        assert!(notes[0].contains("--max has landed"));
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert!(errors[0].contains("--journal-fsync landed as a Switch"));
    }

    #[test]
    fn commands_a_manifest_cannot_drive_are_errors() {
        let positional = clap::Command::new("a").arg(clap::Arg::new("path"));
        let e = from_command(&positional).unwrap_err();
        assert!(e.contains("argument path has no long flag"), "{e}");
        let short = clap::Command::new("a").arg(clap::Arg::new("v").short('v'));
        assert!(from_command(&short).is_err());
        let sub = clap::Command::new("a").subcommand(clap::Command::new("run"));
        let e = from_command(&sub).unwrap_err();
        assert!(e.contains("subcommand run"), "{e}");
        let twice = clap::Command::new("a")
            .arg(clap::Arg::new("one").long("one").alias("two"))
            .arg(clap::Arg::new("two").long("two"));
        let e = from_command(&twice).unwrap_err();
        assert!(e.contains("--two is defined twice"), "{e}");
    }
}
