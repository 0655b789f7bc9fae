//! Adaptive spin-then-block: a wait first checks for readiness without sleeping (yielding the CPU between
//! checks), because waking a sleeping thread costs tens of microseconds on a VM; but a thread whose waits
//! keep outlasting the spin window stops spinning, so ranks busy computing (or sharing cores) do not burn
//! CPU they need. Each thread keeps its own record of how spinning went.

use std::cell::Cell;
use std::time::{Duration, Instant};

/// Credit ceiling: how many recent successes a thread remembers.
const MAX_CREDIT: i32 = 8;
/// A failed spin costs this much credit; a wait that blocked without spinning earns one back.
const FAILURE_COST: i32 = 3;

thread_local! {
    static CREDIT: Cell<i32> = const { Cell::new(MAX_CREDIT / 2) };
}

/// Check `ready` repeatedly for up to `window` (yielding in between) if this thread's recent spins paid
/// off. Returns whether `ready` became true; on `false` the caller blocks as usual.
pub fn spin_until(window: Duration, mut ready: impl FnMut() -> bool) -> bool {
    let credit = CREDIT.with(Cell::get);
    if credit <= 0 || window.is_zero() {
        CREDIT.with(|c| c.set(credit + 1));
        return false;
    }
    let start = Instant::now();
    loop {
        if ready() {
            CREDIT.with(|c| c.set((credit + 1).min(MAX_CREDIT)));
            return true;
        }
        if start.elapsed() >= window {
            CREDIT.with(|c| c.set(credit - FAILURE_COST));
            return false;
        }
        std::thread::yield_now();
    }
}

/// How long [`spin_for`] checks without yielding first: about one shared-memory round trip, the time a
/// peer that is already running takes to answer. A yield costs a system call and a pass through the
/// scheduler (~0.5-1 us here), so yielding from the first check made a waiting rank notice its peer's bytes
/// late; a peer that is not running (more ranks than cores) costs this rank at most this much.
const PAUSE_WINDOW: Duration = Duration::from_micros(2);
/// Checks between clock reads while pausing.
const PAUSES_PER_CLOCK_READ: u32 = 16;

/// Check `ready` repeatedly for up to `window`, whatever earlier spins did: without yielding for the first
/// [`PAUSE_WINDOW`], then yielding the CPU between checks.
pub fn spin_for(window: Duration, mut ready: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    let pause_until = PAUSE_WINDOW.min(window);
    'pausing: loop {
        for _ in 0..PAUSES_PER_CLOCK_READ {
            if ready() {
                return true;
            }
            std::hint::spin_loop();
        }
        if start.elapsed() >= pause_until {
            break 'pausing;
        }
    }
    loop {
        if ready() {
            return true;
        }
        if start.elapsed() >= window {
            return false;
        }
        std::thread::yield_now();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spin_for_ignores_the_credit() {
        while spin_until(Duration::from_micros(10), || false) || CREDIT.with(Cell::get) > 0 {}
        let mut calls = 0;
        assert!(spin_for(Duration::from_millis(50), || {
            calls += 1;
            calls == 3
        }));
        assert!(!spin_for(Duration::from_micros(100), || false));
    }

    #[test]
    fn spinning_stops_after_failures_and_resumes_later() {
        let window = Duration::from_micros(200);
        assert!(spin_until(window, || true));
        let mut failures = 0;
        while spin_until(window, || false) || CREDIT.with(Cell::get) > 0 {
            failures += 1;
            assert!(failures < 10, "spinning never stopped");
        }
        // With no credit left, a wait does not spin (even if it would succeed) but earns credit back.
        let mut calls = 0;
        assert!(!spin_until(window, || {
            calls += 1;
            true
        }));
        assert_eq!(calls, 0);
        let mut resumed = false;
        for _ in 0..MAX_CREDIT {
            if spin_until(window, || true) {
                resumed = true;
                break;
            }
        }
        assert!(resumed, "spinning never resumed");
    }
}
