//! Rate-limited warnings about connections a listener drops (strangers, garbage, wrong secrets).
//!
//! A stranger that opens hundreds of connections to a rank's mesh listener or to the rendezvous store must
//! not flood the job's log: in each window of [`WINDOW`] the first [`LOGGED_PER_WINDOW`] drops are logged
//! one line each, one line then says that further drops are only counted, and the first drop after the
//! window says how many went unlogged.

use std::net::SocketAddr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

const WINDOW: Duration = Duration::from_secs(60);
const LOGGED_PER_WINDOW: u32 = 5;

/// What to log for one dropped connection.
#[derive(Debug, PartialEq, Eq)]
enum Verdict {
    /// Log it, after saying how many went unlogged in the window before (if any).
    Log { unlogged_before: u64 },
    /// Log it, and say that further drops in this window are only counted.
    LogLast,
    /// Count it only.
    Count,
}

#[derive(Default)]
struct Window {
    started: Option<Instant>,
    logged: u32,
    unlogged: u64,
}

impl Window {
    fn decide(&mut self, now: Instant) -> Verdict {
        let expired = self.started.map_or(true, |start| now.saturating_duration_since(start) >= WINDOW);
        if expired {
            let unlogged_before = std::mem::take(&mut self.unlogged);
            *self = Window { started: Some(now), logged: 1, unlogged: 0 };
            return Verdict::Log { unlogged_before };
        }
        if self.logged + 1 < LOGGED_PER_WINDOW {
            self.logged += 1;
            Verdict::Log { unlogged_before: 0 }
        } else if self.logged + 1 == LOGGED_PER_WINDOW {
            self.logged += 1;
            Verdict::LogLast
        } else {
            self.unlogged += 1;
            Verdict::Count
        }
    }
}

/// The drop log of one kind of listener ("mesh" or "rendezvous server").
pub struct DropLog {
    listener: &'static str,
    window: Mutex<Window>,
}

impl DropLog {
    pub const fn new(listener: &'static str) -> DropLog {
        DropLog { listener, window: Mutex::new(Window { started: None, logged: 0, unlogged: 0 }) }
    }

    /// Warn (within the rate limit) that a connection from `from` was dropped because `why`.
    pub fn dropped(&self, from: SocketAddr, why: &str) {
        let verdict = self.window.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).decide(Instant::now());
        let listener = self.listener;
        match verdict {
            Verdict::Log { unlogged_before } => {
                if unlogged_before > 0 {
                    tracing::warn!("{listener}: {unlogged_before} more connections were dropped without a log line");
                }
                tracing::warn!("{listener}: dropped a connection from {from}: {why}");
            }
            Verdict::LogLast => tracing::warn!(
                "{listener}: dropped a connection from {from}: {why} (further dropped connections in the next {} s \
                 are counted, not logged)",
                WINDOW.as_secs()
            ),
            Verdict::Count => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_few_lines_per_window_then_a_count() {
        let mut window = Window::default();
        let start = Instant::now();
        let verdicts: Vec<Verdict> = (0..200).map(|_| window.decide(start)).collect();
        assert_eq!(verdicts.iter().filter(|v| matches!(v, Verdict::Log { .. })).count(), 4);
        assert_eq!(verdicts[4], Verdict::LogLast);
        assert!(verdicts[5..].iter().all(|v| *v == Verdict::Count));
        assert_eq!(window.decide(start + WINDOW), Verdict::Log { unlogged_before: 195 });
        assert_eq!(window.decide(start + WINDOW), Verdict::Log { unlogged_before: 0 });
    }
}
