//! Fork safety. A process that forks while its engine runs (PyTorch DataLoader workers with the `fork`
//! start method are the common case) gets a copy of the engine's memory but none of its threads, and shares
//! its sockets, shared memory and wake-up events with the parent. The child must never touch them: a
//! shutdown there would join threads that do not exist, or tell the parent's peers that the job ended.
//!
//! [`arm`] installs a `pthread_atfork` child handler once; the child learns from [`forked_from`] which
//! rank and process it was forked from, and the Python layer then refuses collectives with a clear error
//! and leaves the inherited engine alone (it is leaked, never dropped).

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::Once;

static INSTALLED: Once = Once::new();
/// Set while an engine runs in this process (between a successful init and shutdown).
static ENGINE_LIVE: AtomicBool = AtomicBool::new(false);
/// Set in a child forked while an engine was live.
static FORKED: AtomicBool = AtomicBool::new(false);
static OWNER_PID: AtomicU32 = AtomicU32::new(0);
static OWNER_RANK: AtomicUsize = AtomicUsize::new(0);

extern "C" fn in_child() {
    // Only async-signal-safe work here: atomics.
    if ENGINE_LIVE.load(Ordering::SeqCst) {
        FORKED.store(true, Ordering::SeqCst);
    }
}

/// Record that `rank`'s engine now runs in this process, installing the fork handler on first use.
pub fn engine_started(rank: usize) {
    INSTALLED.call_once(|| {
        // SAFETY: registers a plain function that only touches atomics; it stays valid for the process's life.
        unsafe {
            libc::pthread_atfork(None, None, Some(in_child));
        }
    });
    OWNER_PID.store(std::process::id(), Ordering::SeqCst);
    OWNER_RANK.store(rank, Ordering::SeqCst);
    ENGINE_LIVE.store(true, Ordering::SeqCst);
}

/// Record that this process's engine stopped (a child forked from now on may start its own).
pub fn engine_stopped() {
    ENGINE_LIVE.store(false, Ordering::SeqCst);
}

/// In a process forked from one whose engine was running: (rank, parent pid, this pid).
pub fn forked_from() -> Option<(usize, u32, u32)> {
    FORKED
        .load(Ordering::Relaxed)
        .then(|| (OWNER_RANK.load(Ordering::Relaxed), OWNER_PID.load(Ordering::Relaxed), std::process::id()))
}
