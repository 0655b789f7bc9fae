//! Every timeline is written out before SIGTERM or SIGHUP ends the process (`rvodrun` stops the other
//! ranks with SIGTERM when one dies; their last events would otherwise die with them).
//!
//! The hook ([`crate::exit_signals`]) asks every running writer thread to write what it holds and waits
//! for all of them, at most [`PATIENCE`], before the process ends. The hook only touches atomics, reads
//! the monotonic clock and sleeps (async-signal-safe); the writers do the work. Writer threads block those
//! signals, so the hook never runs on a thread it waits for. A writer notices a request within
//! `SIGNAL_POLL` (see `writer`).

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use crate::exit_signals;

/// Longest time a terminating signal waits for the writers (`rvodrun` waits 5 s before SIGKILL).
const PATIENCE: Duration = Duration::from_secs(1);

/// Writer threads running.
static RUNNING: AtomicUsize = AtomicUsize::new(0);
/// Flush requests so far (each terminating signal makes one).
static REQUESTS: AtomicU64 = AtomicU64::new(0);
/// Writers that have written everything since the latest request.
static SERVED: AtomicUsize = AtomicUsize::new(0);

/// A writer thread's view of the requests; counts the thread as running while it lives.
pub(super) struct SignalFlush {
    /// The latest request this writer saw.
    seen: u64,
    /// The latest request this writer served.
    served: u64,
}

impl SignalFlush {
    /// Called as a writer thread is started, before it runs (which then blocks the signals, see
    /// [`exit_signals::block_in_this_thread`]): a flush asked from then on waits for it.
    pub(super) fn register() -> SignalFlush {
        exit_signals::on_terminating_signal(flush_every_timeline);
        RUNNING.fetch_add(1, Ordering::AcqRel);
        let now = REQUESTS.load(Ordering::Acquire);
        SignalFlush { seen: now, served: now }
    }

    /// Whether a request came since the last call.
    pub(super) fn asked(&mut self) -> bool {
        let latest = REQUESTS.load(Ordering::Acquire);
        let new = latest != self.seen;
        self.seen = latest;
        new
    }

    /// Everything queued up to the request just seen is in the file.
    pub(super) fn served(&mut self) {
        if self.served != self.seen {
            self.served = self.seen;
            SERVED.fetch_add(1, Ordering::AcqRel);
        }
    }
}

impl Drop for SignalFlush {
    fn drop(&mut self) {
        // A writer that ends has written everything (its last act is a flush): it serves any request.
        if self.served != REQUESTS.load(Ordering::Acquire) {
            SERVED.fetch_add(1, Ordering::AcqRel);
        }
        RUNNING.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The hook: ask every writer to flush and wait until all did, or [`PATIENCE`] ran out.
pub(super) extern "C" fn flush_every_timeline() {
    let writers = RUNNING.load(Ordering::Acquire);
    if writers == 0 {
        return;
    }
    SERVED.store(0, Ordering::Release);
    REQUESTS.fetch_add(1, Ordering::AcqRel);
    let start = Instant::now();
    while SERVED.load(Ordering::Acquire) < writers && start.elapsed() < PATIENCE {
        std::thread::sleep(Duration::from_millis(1));
    }
}
