//! The `tpm2` key source (see docs/encryption.md): a volume opens only with two halves, one
//! held by the cluster and one by the node's TPM, neither of which alone opens it.
//!
//! * the **cluster half** is the volume's DEK as every source has it: made by the controller,
//!   stored only wrapped by a cluster KEK (a Secret's, or a KMIP server's), with the volume;
//! * the **node half** is an HMAC-SHA256 of the volume's id under a key that lives in the node's
//!   TPM: made inside the TPM (`tpm2_create -G hmac`), never outside it in the clear. Its blobs
//!   on the node's disk are encrypted by the TPM's storage key and load only into that TPM.
//!
//! The LUKS passphrase is HKDF-SHA256 of both ([`combine`]). Without the cluster KEK, the TPM
//! gives an HMAC that opens nothing; without the TPM (a stolen disk, a copied record, another
//! node), the unwrapped DEK opens nothing. What it does not protect against: root on the
//! running node while it holds the cluster KEK (it can ask its TPM), and the key is bound to
//! the TPM, not to the boot state unless it is sealed to PCRs ([`Tpm2Tools::with_pcrs`]).
//!
//! The TPM is reached through tpm2-tools ([`Tpm2Tools`]), executed with the volume id on stdin
//! and the HMAC read from stdout: no key in an argument, the environment or a file. Which TPM
//! is the TCTI's (`TPM2TOOLS_TCTI`): the kernel's resource manager `device:/dev/tpmrm0` on a
//! node, swtpm's socket in the tests.

use std::fmt;
use std::io::{Read, Write};
use std::os::unix::fs::DirBuilderExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ring::hkdf;
/// What [`Tpm::hmac`] answers in: zeroed when dropped.
pub use zeroize::Zeroizing;

use super::{Dek, KEY_LEN, KeyError, Result, Secret};

/// The `kmsID` of this source.
pub const KMS_TPM2: &str = "tpm2";

/// Where moor-node keeps its TPM key's blobs when `MOOR_TPM2_DIR` does not say.
pub const DEFAULT_DIR: &str = "/var/lib/moor/tpm2";

/// What salts the combination: the format's version.
const SALT: &[u8] = b"moor-tpm2-v1";

/// How long one tpm2-tools call may take before it is killed and the TPM taken as
/// unreachable ([`KeyError::Unavailable`]): a TPM (or its resource manager, or swtpm) that
/// hangs must fail a stage, never hold it. A call on a real TPM takes well under a second;
/// an ECC primary key on a slow firmware TPM a few.
pub const DEADLINE: Duration = Duration::from_secs(30);

/// The node's TPM: an HMAC-SHA256 under a key that never leaves it.
pub trait Tpm: Send + Sync {
    /// HMAC-SHA256 of `message` under the node's TPM-held key.
    fn hmac(&self, message: &[u8]) -> Result<Zeroizing<Vec<u8>>>;

    /// Makes the node's key if it has none yet (the first stage of a `tpm2` volume on the
    /// node). Nothing for a TPM whose key always exists.
    fn ensure_key(&self) -> Result<()> {
        Ok(())
    }

    /// The same TPM, its key sealed to the PCRs `pcrs` names ([`pcr_selection`]'s form).
    fn sealed_to(&self, pcrs: &str) -> Result<Box<dyn Tpm + '_>> {
        Err(KeyError::Refused(format!(
            "this TPM cannot seal its key to the PCRs {pcrs}"
        )))
    }
}

/// The node half of one volume's passphrase: the TPM's HMAC of its id, held for the
/// combinations of one call (a rotation combines both its data keys with the one half, the
/// TPM asked once). Zeroed when dropped; its `Debug` shows no byte.
pub struct NodeHalf {
    volume: String,
    hmac: Zeroizing<Vec<u8>>,
}

impl fmt::Debug for NodeHalf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "NodeHalf({:?})", self.volume)
    }
}

impl NodeHalf {
    /// `volume`'s node half from `tpm`: the TPM's HMAC of the volume id, under its key
    /// sealed to `pcrs` when the volume names some (the PCR policy is checked by the TPM).
    pub fn of(tpm: &dyn Tpm, pcrs: Option<&str>, volume: &str) -> Result<Self> {
        let sealed = pcrs.map(|p| tpm.sealed_to(p)).transpose()?;
        let tpm = sealed.as_deref().unwrap_or(tpm);
        let message = [SALT, volume.as_bytes()].join(&0u8);
        let hmac = tpm.hmac(&message)?;
        if hmac.len() != KEY_LEN {
            return Err(KeyError::Refused(format!(
                "the node's TPM gave an HMAC of {} bytes, not {KEY_LEN}",
                hmac.len()
            )));
        }
        Ok(Self {
            volume: volume.to_owned(),
            hmac,
        })
    }

    /// The passphrase of the volume's LUKS key slot under the `tpm2` source: HKDF-SHA256 of
    /// the cluster half (`cluster`, the unwrapped DEK) and this node half, with the volume id
    /// as the HKDF info.
    pub fn combine(&self, cluster: &Dek) -> Result<Dek> {
        let mut ikm = Zeroizing::new(Vec::with_capacity(2 * KEY_LEN));
        ikm.extend_from_slice(cluster.expose());
        ikm.extend_from_slice(&self.hmac);
        let mut out = Secret::zeroed();
        let info = [self.volume.as_bytes()];
        hkdf::Salt::new(hkdf::HKDF_SHA256, SALT)
            .extract(&ikm)
            .expand(&info, OutLen)
            .and_then(|okm| okm.fill(out.0.as_mut_slice()))
            .map_err(|_| KeyError::Wrap(self.volume.clone()))?;
        Ok(Dek(out))
    }
}

/// The passphrase of `volume`'s LUKS key slot under the `tpm2` source: [`NodeHalf::combine`]
/// of the cluster half (`cluster`, the unwrapped DEK) and the node half `tpm` gives.
pub fn combine(cluster: &Dek, tpm: &dyn Tpm, volume: &str) -> Result<Dek> {
    NodeHalf::of(tpm, None, volume)?.combine(cluster)
}

/// HKDF's output length: one key.
struct OutLen;

impl hkdf::KeyType for OutLen {
    fn len(&self) -> usize {
        KEY_LEN
    }
}

/// The node's TPM through tpm2-tools. The HMAC key's blobs (`hmac.pub`, `hmac.priv`, the
/// private part encrypted by the TPM) and the saved contexts live in `dir`.
pub struct Tpm2Tools {
    /// Where the key's blobs are.
    dir: PathBuf,
    /// `TPM2TOOLS_TCTI`, when not the tools' default.
    tcti: Option<String>,
    /// One TPM conversation at a time: without a resource manager (swtpm's socket) the TPM
    /// holds three transient objects, and the saved contexts are files in `dir`.
    lock: Arc<Mutex<()>>,
    /// How long one call may take ([`DEADLINE`]).
    deadline: Duration,
    /// The directory of the tpm2-tools programs, when not the PATH's.
    programs: Option<PathBuf>,
    /// The PCRs the key is sealed to ([`pcr_selection`]'s form), if any.
    pcrs: Option<String>,
}

/// The PCR selection `text` (`<bank>:<index>[,<index>...]`, the bank `sha1`, `sha256` or
/// `sha384`, indices 0 to 23), checked and in its one form (indices sorted, each once): it
/// reaches tpm2-tools' argv and names the key's blobs. [`KeyError::Malformed`] naming
/// `tpm2PCRs` otherwise.
pub fn pcr_selection(text: &str) -> Result<String> {
    let malformed = |problem: &str| KeyError::Malformed {
        field: "tpm2PCRs",
        problem: problem.to_owned(),
    };
    let (bank, list) = text
        .split_once(':')
        .ok_or_else(|| malformed("is not <bank>:<index>[,<index>...]"))?;
    if !matches!(bank, "sha1" | "sha256" | "sha384") {
        return Err(malformed("names a bank other than sha1, sha256, sha384"));
    }
    let mut indices = list
        .split(',')
        .map(|i| i.parse::<u8>().ok().filter(|i| *i <= 23))
        .collect::<Option<Vec<_>>>()
        .filter(|v| !v.is_empty())
        .ok_or_else(|| malformed("has an index that is not 0 to 23"))?;
    indices.sort_unstable();
    indices.dedup();
    let list: Vec<String> = indices.iter().map(u8::to_string).collect();
    Ok(format!("{bank}:{}", list.join(",")))
}

impl fmt::Debug for Tpm2Tools {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tpm2Tools")
            .field("dir", &self.dir)
            .field("tcti", &self.tcti)
            .field("deadline", &self.deadline)
            .field("programs", &self.programs)
            .finish_non_exhaustive()
    }
}

impl Tpm2Tools {
    /// The TPM `tcti` names (the tools' default when `None`), its key's blobs in `dir`.
    #[must_use]
    pub fn new(dir: &Path, tcti: Option<String>) -> Self {
        Self {
            dir: dir.to_owned(),
            tcti,
            lock: Arc::new(Mutex::new(())),
            deadline: DEADLINE,
            programs: None,
            pcrs: None,
        }
    }

    /// The node's key sealed to the PCRs `selection` names ([`pcr_selection`]): made with a
    /// policy of their values now, it gives an HMAC only while they hold the same values (the
    /// same firmware, bootloader, kernel, Secure Boot state, as the PCRs chosen measure). Its
    /// blobs are named by the selection, beside the unsealed key's.
    pub fn with_pcrs(mut self, selection: &str) -> Result<Self> {
        self.pcrs = Some(pcr_selection(selection)?);
        Ok(self)
    }

    /// The name of the key's blob `ext` (`pub`, `priv`), by its PCRs.
    fn blob(&self, ext: &str) -> String {
        match &self.pcrs {
            None => format!("hmac.{ext}"),
            Some(p) => format!("hmac-{}.{ext}", p.replace([':', ','], "_")),
        }
    }

    /// Each tpm2-tools call killed after `deadline` rather than [`DEADLINE`].
    #[must_use]
    pub fn with_deadline(mut self, deadline: Duration) -> Self {
        self.deadline = deadline;
        self
    }

    /// The tpm2-tools programs taken from `dir` rather than the PATH.
    #[must_use]
    pub fn with_programs(mut self, dir: &Path) -> Self {
        self.programs = Some(dir.to_owned());
        self
    }

    /// The node's TPM as moor-node finds it: the key's blobs in `MOOR_TPM2_DIR` (default
    /// [`DEFAULT_DIR`]), the TPM the tools' `TPM2TOOLS_TCTI` names (inherited; the tools'
    /// default, the kernel's `/dev/tpmrm0`, without it).
    #[must_use]
    pub fn from_env() -> Self {
        let dir =
            std::env::var_os("MOOR_TPM2_DIR").map_or_else(|| DEFAULT_DIR.into(), PathBuf::from);
        Self::new(&dir, None)
    }

    /// Runs the tpm2-tools program `program` with `args` in `dir`, `stdin` on its standard
    /// input; its standard output. A failure names the program and the TPM's words.
    /// The call is killed (with anything it started: its own process group) when it has not
    /// ended within the deadline: [`KeyError::Unavailable`], saying so.
    fn run(&self, program: &str, args: &[&str], stdin: &[u8]) -> Result<Zeroizing<Vec<u8>>> {
        let path = self
            .programs
            .as_ref()
            .map_or_else(|| PathBuf::from(program), |d| d.join(program));
        let mut cmd = Command::new(path);
        cmd.args(args)
            .current_dir(&self.dir)
            .process_group(0)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if let Some(t) = &self.tcti {
            cmd.env("TPM2TOOLS_TCTI", t);
        }
        let unavailable =
            |e: std::io::Error| KeyError::Unavailable(format!("the node's TPM: {program}: {e}"));
        let mut child = cmd.spawn().map_err(unavailable)?;
        let group = rustix::process::Pid::from_child(&child);
        // Read on threads of their own, so that a tool filling a pipe cannot stall the wait.
        let reader = |pipe: Option<Box<dyn Read + Send>>| {
            std::thread::spawn(move || {
                let mut out = Zeroizing::new(Vec::new());
                if let Some(mut p) = pipe {
                    let _ = p.read_to_end(&mut out);
                }
                out
            })
        };
        let stdout = reader(child.stdout.take().map(|p| Box::new(p) as _));
        let stderr = reader(child.stderr.take().map(|p| Box::new(p) as _));
        let written = child
            .stdin
            .take()
            .map_or(Ok(()), |mut input| input.write_all(stdin));
        let until = Instant::now() + self.deadline;
        let mut pause = Duration::from_millis(1);
        let status = loop {
            match child.try_wait() {
                Ok(Some(status)) => break status,
                Ok(None) if Instant::now() < until => {
                    std::thread::sleep(pause);
                    pause = (pause * 2).min(Duration::from_millis(50));
                }
                outcome => {
                    let _ =
                        rustix::process::kill_process_group(group, rustix::process::Signal::KILL);
                    let _ = child.wait();
                    // The readers end when the group's last process holding the pipes is
                    // gone; they are not waited for.
                    return Err(match outcome {
                        Err(e) => unavailable(e),
                        _ => KeyError::Unavailable(format!(
                            "the node's TPM: {program} did not answer within {:?} and was \
                             killed (the TPM, its resource manager or the TCTI hangs)",
                            self.deadline
                        )),
                    });
                }
            }
        };
        let stdout = stdout.join().unwrap_or_default();
        let stderr = stderr.join().unwrap_or_default();
        // The tool's own exit says more than a pipe it closed early.
        if status.success() {
            written.map_err(unavailable)?;
            return Ok(stdout);
        }
        let stderr = String::from_utf8_lossy(&stderr);
        let said: String = stderr
            .lines()
            .rfind(|l| l.contains("policy check failed"))
            .or_else(|| stderr.lines().rfind(|l| l.contains("ERROR")))
            .unwrap_or("")
            .chars()
            .take(200)
            .collect();
        // The TPM cannot be talked to (no device, swtpm gone): the call may work later.
        // The TPM answers but refuses (the blobs are another TPM's): the source must change.
        let unreachable = [
            "tcti",
            "Connection refused",
            "No such file",
            "Failed to initialize",
        ]
        .iter()
        .any(|w| stderr.contains(w));
        let what = format!("the node's TPM: {program} failed ({status}): {said}");
        Err(if unreachable {
            KeyError::Unavailable(what)
        } else {
            KeyError::Refused(what)
        })
    }

    /// Frees the TPM's transient objects (the next command loads what it needs from the
    /// saved contexts).
    fn flush(&self) -> Result<()> {
        self.run("tpm2_flushcontext", &["-t"], &[]).map(drop)
    }

    /// The storage primary key (deterministic from the TPM's owner seed: the same key each
    /// time), saved as `primary.ctx`.
    fn primary(&self) -> Result<()> {
        self.run(
            "tpm2_createprimary",
            &[
                "-Q",
                "-C",
                "o",
                "-g",
                "sha256",
                "-G",
                "ecc256",
                "-c",
                "primary.ctx",
            ],
            &[],
        )?;
        self.flush()
    }

    /// Makes the node's HMAC key in the TPM if `dir` holds none yet. The key is made inside
    /// the TPM; what is written is its public part and its private part encrypted by the
    /// TPM's storage key.
    pub fn ensure_key(&self) -> Result<()> {
        let _held = self
            .lock
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let (public, private) = (self.blob("pub"), self.blob("priv"));
        if self.dir.join(&private).exists() {
            return Ok(());
        }
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&self.dir)
            .map_err(|e| {
                KeyError::Unavailable(format!(
                    "the node's TPM key dir {}: {e}",
                    self.dir.display()
                ))
            })?;
        self.primary()?;
        let (public_new, private_new) = (format!("{public}.new"), format!("{private}.new"));
        let mut args = vec![
            "-Q",
            "-C",
            "primary.ctx",
            "-G",
            "hmac",
            "-u",
            &public_new,
            "-r",
            &private_new,
        ];
        // Sealed to the PCRs: the policy of their values now (a trial session), and the key
        // usable only through it (tpm2_create clears `userwithauth` when given a policy).
        if let Some(pcrs) = &self.pcrs {
            let policy = self.run(
                "tpm2_createpolicy",
                &["-Q", "--policy-pcr", "-l", pcrs, "-L", "pcr.policy"],
                &[],
            );
            self.flush()?;
            policy?;
            args.extend(["-L", "pcr.policy"]);
        }
        let made = self.run("tpm2_create", &args, &[]);
        self.flush()?;
        made?;
        let rename = |from: &str, to: &str| {
            std::fs::rename(self.dir.join(from), self.dir.join(to))
                .map_err(|e| KeyError::Unavailable(format!("the node's TPM key blobs: {e}")))
        };
        // The private blob last: its presence says the key is whole.
        rename(&public_new, &public)?;
        rename(&private_new, &private)
    }
}

impl Tpm for Tpm2Tools {
    fn ensure_key(&self) -> Result<()> {
        Tpm2Tools::ensure_key(self)
    }

    /// The key sealed to `pcrs`, its calls taking turns with this one's (one lock).
    fn sealed_to(&self, pcrs: &str) -> Result<Box<dyn Tpm + '_>> {
        Ok(Box::new(
            Self {
                dir: self.dir.clone(),
                tcti: self.tcti.clone(),
                lock: Arc::clone(&self.lock),
                deadline: self.deadline,
                programs: self.programs.clone(),
                pcrs: None,
            }
            .with_pcrs(pcrs)?,
        ))
    }

    fn hmac(&self, message: &[u8]) -> Result<Zeroizing<Vec<u8>>> {
        let _held = self
            .lock
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let (public, private) = (self.blob("pub"), self.blob("priv"));
        if !self.dir.join(&private).exists() {
            return Err(KeyError::Refused(format!(
                "this node has no TPM key for moor in {}: a volume of the tpm2 source opens \
                 only on the node that made it",
                self.dir.display()
            )));
        }
        self.primary()?;
        let loaded = self.run(
            "tpm2_load",
            &[
                "-Q",
                "-C",
                "primary.ctx",
                "-u",
                &public,
                "-r",
                &private,
                "-c",
                "hmac.ctx",
            ],
            &[],
        );
        self.flush()?;
        loaded?;
        let Some(pcrs) = &self.pcrs else {
            let mac = self.run("tpm2_hmac", &["-c", "hmac.ctx", "-g", "sha256"], message);
            self.flush()?;
            return mac;
        };
        // Sealed: a policy session that holds only if the PCRs are as they were. The message
        // (not secret: the salt and the volume id) from a file: from stdin tpm2_hmac runs a
        // sequence, whose object a refused session leaves in a TPM without a resource manager.
        std::fs::write(self.dir.join("hmac.msg"), message)
            .map_err(|e| KeyError::Unavailable(format!("the node's TPM key dir: {e}")))?;
        let session = self.run(
            "tpm2_startauthsession",
            &["--policy-session", "-S", "session.ctx"],
            &[],
        );
        let mac = session
            .and_then(|_| {
                self.run(
                    "tpm2_policypcr",
                    &["-Q", "-S", "session.ctx", "-l", pcrs],
                    &[],
                )
            })
            .and_then(|_| {
                self.run(
                    "tpm2_hmac",
                    &[
                        "-c",
                        "hmac.ctx",
                        "-g",
                        "sha256",
                        "-p",
                        "session:session.ctx",
                        "hmac.msg",
                    ],
                    &[],
                )
            });
        let _ = self.run("tpm2_flushcontext", &["session.ctx"], &[]);
        self.flush()?;
        mac.map_err(|e| match e {
            KeyError::Refused(m) if m.contains("policy check failed") => {
                KeyError::Refused(format!(
                    "the node's TPM refuses its key sealed to the PCRs {pcrs}: they no longer hold \
                 the values it was sealed to (the node booted other firmware, bootloader, \
                 kernel or Secure Boot state than when the key was made); nothing opens until \
                 they do, or the volume's key is sealed again ({m})"
                ))
            }
            e => e,
        })
    }
}

#[cfg(test)]
mod tests;
