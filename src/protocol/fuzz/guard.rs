//! What the fuzzer watches besides panics: the memory a decoder allocates and the time it takes.
//!
//! [`Counting`] is the unit-test binary's global allocator: it counts, per thread and only while
//! [`measure`] runs a decoder, the bytes live and their peak, so a decoder that allocates for what a length
//! prefix *declares* rather than for the bytes that came is caught; a single request beyond
//! [`HARD_LIMIT`] is refused on the spot (the process aborts, naming the run's current input) before it
//! could exhaust the machine. [`Watchdog`] aborts the process, printing the input, when one input runs
//! longer than a limit: a hang never returns to be reported otherwise.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Largest single allocation a decoder may ask for while measured.
pub(crate) const HARD_LIMIT: usize = 1 << 30;

thread_local! {
    static MEASURING: Cell<bool> = const { Cell::new(false) };
    static LIVE: Cell<usize> = const { Cell::new(0) };
    static PEAK: Cell<usize> = const { Cell::new(0) };
}

/// Counts what the measured thread allocates; everything else passes straight to the system allocator.
pub(crate) struct Counting;

#[global_allocator]
static ALLOCATOR: Counting = Counting;

fn measuring() -> bool {
    MEASURING.try_with(Cell::get).unwrap_or(false)
}

fn grew(bytes: usize) {
    let live = LIVE.get().saturating_add(bytes);
    LIVE.set(live);
    PEAK.set(PEAK.get().max(live));
}

fn shrank(bytes: usize) {
    LIVE.set(LIVE.get().saturating_sub(bytes));
}

/// Whether a measured request of `size` bytes is refused (after saying so: the process will abort).
fn refused(size: usize) -> bool {
    if size <= HARD_LIMIT {
        return false;
    }
    MEASURING.set(false);
    eprintln!("fuzz: a decoder asked for {size} bytes at once (limit {HARD_LIMIT}); see the input below");
    print_current_input();
    true
}

// SAFETY: every call is passed to `System` with the same arguments; the bookkeeping touches only
// const-initialised thread-locals without destructors, which never allocate.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if measuring() {
            if refused(layout.size()) {
                return std::ptr::null_mut();
            }
            grew(layout.size());
        }
        // SAFETY: the caller's contract for `alloc` is passed on unchanged.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if measuring() {
            if refused(layout.size()) {
                return std::ptr::null_mut();
            }
            grew(layout.size());
        }
        // SAFETY: as for `alloc`.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        if measuring() {
            shrank(layout.size());
        }
        // SAFETY: `ptr` came from `System` with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if measuring() {
            if refused(new_size) {
                return std::ptr::null_mut();
            }
            // A moving realloc holds both blocks for a moment: count the new one before dropping the old.
            grew(new_size);
            shrank(layout.size());
        }
        // SAFETY: as for `alloc`.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

/// Runs `decode` while counting this thread's allocations; returns its result and the peak of bytes it
/// held at once (what it allocated and had not freed).
pub(crate) fn measure<T>(decode: impl FnOnce() -> T) -> (T, usize) {
    /// Stops counting however `decode` ends, a panic included.
    struct Stop;
    impl Drop for Stop {
        fn drop(&mut self) {
            MEASURING.set(false);
        }
    }
    LIVE.set(0);
    PEAK.set(0);
    MEASURING.set(true);
    let stop = Stop;
    let out = decode();
    drop(stop);
    (out, PEAK.get())
}

/// The input being decoded, for the messages of [`Counting`] and [`Watchdog`].
static CURRENT: Mutex<(String, u64, Vec<u8>)> = Mutex::new((String::new(), 0, Vec::new()));

/// Records the input about to run (target name, index, bytes).
pub(crate) fn set_current_input(target: &str, index: u64, input: &[u8]) {
    let mut current = CURRENT.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    if current.0 != target {
        current.0 = target.to_string();
    }
    current.1 = index;
    current.2.clear();
    current.2.extend_from_slice(input);
}

fn print_current_input() {
    // try_lock: the allocator may be called while this thread holds the lock.
    if let Ok(current) = CURRENT.try_lock() {
        eprintln!("fuzz: target {} input {}: {}", current.0, current.1, super::hex(&current.2));
    }
}

/// Aborts the process when an input runs longer than its limit.
pub(crate) struct Watchdog {
    busy_since: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    epoch: Instant,
}

const IDLE: u64 = u64::MAX;

impl Watchdog {
    pub(crate) fn start(limit: Duration) -> Watchdog {
        let busy_since = Arc::new(AtomicU64::new(IDLE));
        let stop = Arc::new(AtomicBool::new(false));
        let epoch = Instant::now();
        let thread = {
            let (busy_since, stop) = (busy_since.clone(), stop.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    std::thread::sleep(Duration::from_millis(50));
                    let since = busy_since.load(Ordering::Relaxed);
                    let now = epoch.elapsed().as_nanos() as u64;
                    if since != IDLE && now.saturating_sub(since) > limit.as_nanos() as u64 {
                        eprintln!("fuzz: one input ran longer than {limit:?}: a hang");
                        print_current_input();
                        std::process::abort();
                    }
                }
            })
        };
        Watchdog { busy_since, stop, thread: Some(thread), epoch }
    }

    /// An input starts.
    pub(crate) fn busy(&self) {
        self.busy_since.store(self.epoch.elapsed().as_nanos() as u64, Ordering::Relaxed);
    }

    /// The input ended.
    pub(crate) fn idle(&self) {
        self.busy_since.store(IDLE, Ordering::Relaxed);
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn measure_sees_what_a_closure_holds_at_its_peak() {
        let ((), peak) = measure(|| {
            let a = vec![0u8; 10_000];
            let b = vec![0u8; 5_000];
            drop((a, b));
            let _c = vec![0u8; 1_000];
        });
        assert!((15_000..16_000).contains(&peak), "peak {peak}");
        let ((), nothing) = measure(|| {});
        assert_eq!(nothing, 0);
    }
}
