//! How the demo shows its steps: a spinner while one runs, then its outcome and duration; the
//! signals that stop it.

use std::future::Future;
use std::io::Write as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicI32, AtomicU32, Ordering};
use std::time::{Duration, Instant};

use super::Failure;
use crate::error::code_name;

/// Signals received so far.
#[derive(Debug, Default)]
pub(super) struct Interrupts {
    pub(super) count: AtomicU32,
    pub(super) last: AtomicI32,
}

impl Interrupts {
    pub(super) fn count(&self) -> u32 {
        self.count.load(Ordering::SeqCst)
    }

    pub(super) fn name(&self) -> &'static str {
        if self.last.load(Ordering::SeqCst) == libc::SIGTERM {
            "SIGTERM"
        } else {
            "SIGINT"
        }
    }
}

/// How steps are shown.
#[derive(Debug)]
pub(super) struct Ui {
    /// A spinner is drawn on stderr only when it is a terminal.
    pub(super) spinner: bool,
    pub(super) interrupts: Arc<Interrupts>,
}

impl Ui {
    /// Runs one step: a spinner with the elapsed time while it runs, then `ok`/`FAIL`, its
    /// name and its duration. With `cancellable`, a second signal abandons it.
    pub(super) async fn step<T>(
        &self,
        name: &str,
        cancellable: bool,
        fut: impl Future<Output = Result<T, String>>,
    ) -> Result<T, Failure> {
        if cancellable && self.interrupts.count() > 0 {
            let reason = format!("interrupted by {} before this step", self.interrupts.name());
            println!("  STOP  {name}\n        {reason}");
            return Err(Failure {
                step: name.to_string(),
                reason,
                interrupted: true,
            });
        }
        let start = Instant::now();
        let mut fut = std::pin::pin!(fut);
        let mut frame = 0usize;
        let r = loop {
            tokio::select! {
                r = &mut fut => break r,
                () = tokio::time::sleep(Duration::from_millis(100)) => {
                    if cancellable && self.interrupts.count() > 1 {
                        break Err(format!(
                            "abandoned on a second {}", self.interrupts.name()
                        ));
                    }
                    if self.spinner {
                        let frames = ['|', '/', '-', '\\'];
                        let note = if self.interrupts.count() > 0 {
                            " (interrupted: finishing this step, then cleaning up)"
                        } else {
                            ""
                        };
                        eprint!(
                            "\r\x1b[2K  {} {name} {:.1}s{note}",
                            frames.get(frame % 4).copied().unwrap_or('|'),
                            start.elapsed().as_secs_f64()
                        );
                        let _ = std::io::stderr().flush();
                        frame += 1;
                    }
                }
            }
        };
        if self.spinner && frame > 0 {
            eprint!("\r\x1b[2K");
            let _ = std::io::stderr().flush();
        }
        let ms = start.elapsed().as_secs_f64() * 1000.0;
        match &r {
            Ok(_) => println!("  ok    {name:<62} {ms:>9.1} ms"),
            Err(e) => println!(
                "  FAIL  {name:<62} {ms:>9.1} ms\n        {}",
                e.trim_end().replace('\n', "\n        ")
            ),
        }
        let interrupted = cancellable && self.interrupts.count() > 1;
        r.map_err(|reason| Failure {
            step: name.to_string(),
            reason,
            interrupted,
        })
    }
}

/// A gRPC error as a sentence with its code.
pub(super) fn status(rpc: &'static str) -> impl FnOnce(tonic::Status) -> String {
    move |s| format!("{rpc} failed: {}: {}", code_name(s.code()), s.message())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_errors_in_steps_name_the_code() {
        let f = status("NodeStageVolume")(tonic::Status::failed_precondition("not blank"));
        assert_eq!(f, "NodeStageVolume failed: FAILED_PRECONDITION: not blank");
    }

    #[test]
    fn interrupts_name_their_signal() {
        let i = Interrupts::default();
        assert_eq!(i.count(), 0);
        i.last.store(libc::SIGTERM, Ordering::SeqCst);
        assert_eq!(i.name(), "SIGTERM");
        i.last.store(libc::SIGINT, Ordering::SeqCst);
        assert_eq!(i.name(), "SIGINT");
    }
}
