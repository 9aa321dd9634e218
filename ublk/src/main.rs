//! moor-ublk: serve an RBD image as /dev/ublkbN, or take over a device whose server died.
//!
//!   moor-ublk add     --mon-host H --user U (--keyring K | --keyfile F) --pool P --image I
//!   moor-ublk recover --dev N (and the same connection flags)
//!   moor-ublk info    --dev N
//!   moor-ublk delete  --dev N
//!
//! `add` and `recover` print `dev N /dev/ublkbN` once the device is served, then serve it until
//! it is deleted, in a session of their own (a signal to the process group or the terminal of
//! whoever started them does not reach them). `info` of a device the driver does not have
//! prints `dev N state gone`.

use std::io::Write as _;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use moor_rbd::{Auth, Cluster, ConnectOptions, Secret};
use moor_ublk::Rbd;

#[derive(Parser, Debug)]
#[command(
    name = "moor-ublk",
    about = "An RBD image as a recoverable ublk device"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Args, Debug)]
struct Image {
    #[arg(long)]
    mon_host: String,
    #[arg(long)]
    user: String,
    /// A keyring file holding the user's key.
    #[arg(long, required_unless_present = "keyfile", conflicts_with = "keyfile")]
    keyring: Option<PathBuf>,
    /// A file holding the key itself (what rbd-fuse's `--keyfile` takes).
    #[arg(long)]
    keyfile: Option<PathBuf>,
    #[arg(long)]
    pool: String,
    #[arg(long)]
    image: String,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// A new device serving the image.
    Add(Image),
    /// Take over device N, whose server died, serving the image.
    Recover {
        #[arg(long)]
        dev: u32,
        /// How long to wait for the driver to quiesce the device (seconds).
        #[arg(long, default_value_t = 120)]
        deadline: u64,
        /// The dead server's client (`client.N`, as it said): when it still holds the image's
        /// lock, its address is blocklisted (an hour) and its lock broken, so this server need
        /// not wait for the cluster to time its watch out (about 30 s).
        #[arg(long)]
        fence: Option<String>,
        #[command(flatten)]
        image: Image,
    },
    /// The driver's view of device N.
    Info {
        #[arg(long)]
        dev: u32,
    },
    /// Stop and delete device N.
    Delete {
        #[arg(long)]
        dev: u32,
    },
}

/// The image, through a connection of its own (kept: the server's client, as the image's
/// lockers name it, is `client.<instance id>`).
fn open(i: &Image) -> Result<(Cluster, moor_rbd::Image, u64), String> {
    let auth = match (&i.keyring, &i.keyfile) {
        (Some(k), _) => Auth::Keyring(k.clone()),
        (None, Some(f)) => Auth::Key(Secret::new(
            std::fs::read_to_string(f).map_err(|e| format!("{}: {e}", f.display()))?,
        )),
        (None, None) => return Err("--keyring or --keyfile".into()),
    };
    // librbd's cache off: a write is acknowledged only once the OSDs have it. The device is
    // recoverable, so the kernel never learns that a server died: with the cache on, writes
    // it acknowledged and held (up to a second, librbd's default) would be gone when it was
    // killed, and the filesystem above would carry on as if they were on the image (the next
    // flush, sent to the new server, flushes nothing). A flush is then nothing to wait for.
    let options = ConnectOptions::new(&i.mon_host, &i.user, auth).option("rbd_cache", "false");
    let cluster = Cluster::connect(&options).map_err(|e| e.to_string())?;
    let pool = cluster.pool(&i.pool).map_err(|e| e.to_string())?;
    let image = pool.open_image(&i.image).map_err(|e| e.to_string())?;
    refuse_cache_override(&pool, &image)?;
    let size = image.size().map_err(|e| e.to_string())?;
    Ok((cluster, image, size))
}

/// Refuses an image for which librbd's cache is on after all: an image's or its pool's
/// `conf_rbd_cache` (`rbd config image set` / `rbd config pool set`) is set by librbd over this
/// client's `rbd_cache=false` (the image's own over the pool's).
fn refuse_cache_override(pool: &moor_rbd::Pool, image: &moor_rbd::Image) -> Result<(), String> {
    const OPTION: &str = "rbd_cache";
    let (from, value) = match image
        .metadata(&format!("conf_{OPTION}"))
        .map_err(|e| e.to_string())?
    {
        Some(v) => ("the image's", v),
        None => match pool.config_override(OPTION).map_err(|e| e.to_string())? {
            Some(v) => ("its pool's", v),
            None => return Ok(()),
        },
    };
    if cache_off(&value) {
        return Ok(());
    }
    Err(format!(
        "{}: {from} configuration sets {OPTION}={value:?}, which would turn librbd's cache on \
         under this server: a write it acknowledged from the cache would be lost with it if \
         it died, unseen by the kernel (the device is recoverable); remove the override \
         (rbd config image|pool remove ... {OPTION})",
        image.spec()
    ))
}

/// Whether a librbd boolean option's text says off (anything else is taken as on).
fn cache_off(value: &str) -> bool {
    matches!(
        value.trim().to_ascii_lowercase().as_str(),
        "false" | "0" | "no" | "off"
    )
}

/// Says `dev N /dev/ublkbN client.C` (C: this server's client, for the next server to fence),
/// then serves.
fn served(s: moor_ublk::Served, cluster: &Cluster) -> Result<(), String> {
    println!(
        "dev {} {} client.{}",
        s.dev_id,
        s.block_device(),
        cluster.instance_id()
    );
    let _ = std::io::stdout().flush();
    s.wait().map_err(|e| e.to_string())
}

/// Blocklists the dead server's client `dead` and breaks its lock of `image`, if it holds it;
/// a failure (a user without `mon 'profile rbd'`) is said, and the recovery goes on (librbd
/// then waits for the dead client's watch to time out).
fn fence_dead(cluster: &Cluster, image: &moor_rbd::Image, dead: &str) {
    let lockers = match image.lockers() {
        Ok(l) => l.lockers,
        Err(e) => {
            eprintln!("moor-ublk: the image's lockers: {e}");
            return;
        }
    };
    for l in lockers.iter().filter(|l| l.client == dead) {
        let fenced = cluster
            .blocklist_add(&l.address, Duration::from_secs(3600))
            .and_then(|()| image.break_lock(l));
        match fenced {
            Ok(()) => eprintln!("moor-ublk: fenced the dead server's {dead} ({})", l.address),
            Err(e) => eprintln!("moor-ublk: fencing the dead server's {dead}: {e}"),
        }
    }
}

fn run(cli: Cli) -> Result<(), String> {
    match cli.cmd {
        Cmd::Add(i) => {
            moor_ublk::own_session();
            let (cluster, image, size) = open(&i)?;
            let s = moor_ublk::add(size, Box::new(Rbd(image))).map_err(|e| format!("add: {e}"))?;
            served(s, &cluster)
        }
        Cmd::Recover {
            dev,
            deadline,
            fence,
            image,
        } => {
            moor_ublk::own_session();
            let (cluster, rbd, _) = open(&image)?;
            if let Some(dead) = &fence {
                fence_dead(&cluster, &rbd, dead);
            }
            let s = moor_ublk::recover(dev, Box::new(Rbd(rbd)), Duration::from_secs(deadline))
                .map_err(|e| format!("recover: {e}"))?;
            served(s, &cluster)
        }
        Cmd::Info { dev } => {
            let i = match moor_ublk::info(dev) {
                Ok(i) => i,
                Err(e) if e.raw_os_error() == Some(libc::ENODEV) => {
                    println!("dev {dev} state gone");
                    return Ok(());
                }
                Err(e) => return Err(e.to_string()),
            };
            println!(
                "dev {dev} state {} pid {} flags {:#x}",
                moor_ublk::state_name(i.state),
                i.ublksrv_pid,
                i.flags
            );
            Ok(())
        }
        Cmd::Delete { dev } => moor_ublk::delete(dev).map_err(|e| e.to_string()),
    }
}

fn main() {
    if let Err(e) = run(Cli::parse()) {
        eprintln!("moor-ublk: {e}");
        std::process::exit(1);
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn only_a_value_that_says_off_is_off() {
        for off in ["false", "0", "no", "off", " FALSE ", "Off"] {
            assert!(super::cache_off(off), "{off:?}");
        }
        for on in ["true", "1", "yes", "on", "", "maybe"] {
            assert!(!super::cache_off(on), "{on:?}");
        }
    }
}
