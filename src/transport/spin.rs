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
/// late.
const PAUSE_WINDOW: Duration = Duration::from_micros(2);
/// Checks between clock reads while pausing.
const PAUSES_PER_CLOCK_READ: u32 = 16;
/// Most pause credit a thread keeps (see [`PAUSE_CREDIT`]).
const MAX_PAUSE_CREDIT: i32 = 16;
/// A thread without pause credit still pauses on one wait in this many, to notice when pausing pays again.
const PAUSE_PROBE_EVERY: u32 = 64;

thread_local! {
    /// Whether pausing paid off lately on this thread: a wait that ended while pausing earns credit, one that
    /// needed the yields loses it. Without credit the thread yields from the first check: its peer is then
    /// usually not running at the same time (two ranks on one core, more ranks than cores), and cannot
    /// answer until this thread gives the core up (pausing there cost every op ~2 us of its peer's time).
    static PAUSE_CREDIT: Cell<(i32, u32)> = const { Cell::new((MAX_PAUSE_CREDIT, 0)) };
}

/// Check `ready` repeatedly for up to `window`, whatever earlier spins did: without yielding for the first
/// [`PAUSE_WINDOW`] (where pausing paid off lately on this thread), then yielding the CPU between checks.
pub fn spin_for(window: Duration, mut ready: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    let (credit, waits) = PAUSE_CREDIT.with(Cell::get);
    if credit > 0 || waits % PAUSE_PROBE_EVERY == 0 {
        let pause_until = PAUSE_WINDOW.min(window);
        loop {
            for _ in 0..PAUSES_PER_CLOCK_READ {
                if ready() {
                    PAUSE_CREDIT.with(|c| c.set(((credit + 1).min(MAX_PAUSE_CREDIT), waits.wrapping_add(1))));
                    return true;
                }
                std::hint::spin_loop();
            }
            if start.elapsed() >= pause_until {
                break;
            }
        }
    }
    let mut yielded = false;
    let ready_at_all = loop {
        if ready() {
            break true;
        }
        if start.elapsed() >= window {
            break false;
        }
        std::thread::yield_now();
        yielded = true;
    };
    // A wait over before the first yield says nothing against pausing; one that needed yields does.
    let credit = if yielded { (credit - 2).max(-MAX_PAUSE_CREDIT) } else { (credit + 1).min(MAX_PAUSE_CREDIT) };
    PAUSE_CREDIT.with(|c| c.set((credit, waits.wrapping_add(1))));
    ready_at_all
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
    fn pausing_stops_when_only_yields_pay_off_and_resumes_when_pausing_does() {
        let pause_credit = || PAUSE_CREDIT.with(Cell::get).0;
        // Waits that end only after the pause window (a peer that runs only when this thread yields).
        let late = |start: Instant| move || start.elapsed() > PAUSE_WINDOW * 3;
        let mut waits = 0;
        while pause_credit() > 0 {
            assert!(spin_for(Duration::from_secs(1), late(Instant::now())));
            waits += 1;
            assert!(waits <= MAX_PAUSE_CREDIT, "pausing never stopped");
        }
        // Without credit the first check is followed by a yield, not by pauses: a wait that a running peer
        // would have ended in the pause window now ends after the second check, past a yield.
        let checks = std::cell::Cell::new(0);
        let (_, before) = PAUSE_CREDIT.with(Cell::get);
        let probe = before % PAUSE_PROBE_EVERY == 0;
        assert!(spin_for(Duration::from_secs(1), || {
            checks.set(checks.get() + 1);
            checks.get() == 2
        }));
        if !probe {
            assert!(pause_credit() < 0, "a wait that needed a yield earns no pause credit");
        }
        // Every PAUSE_PROBE_EVERY waits one pauses anyway; waits that end while pausing earn credit back.
        for _ in 0..PAUSE_PROBE_EVERY * (MAX_PAUSE_CREDIT as u32 + 2) {
            spin_for(Duration::from_secs(1), || true);
            if pause_credit() > 0 {
                return;
            }
        }
        panic!("pausing never resumed");
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
