//! The stall inspector: the coordinator's record of tensors that some ranks submitted and others did not,
//! the warning that names the missing ranks, and in elastic jobs the ranks judged hung ([`HungRank`]).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// Tensor names waiting for each missing rank, sorted by rank.
pub type MissingRanks = BTreeMap<u32, Vec<String>>;

/// At most this many tensor names are listed per missing rank.
pub const NAMES_PER_RANK: usize = 6;

/// Horovod-style warning text naming, for each missing rank, the tensors it has not submitted.
pub fn stall_warning(
    missing: &MissingRanks,
    waited: Duration,
    shutdown_after: Option<Duration>,
    stalled_out: &[u32],
) -> String {
    let mut text = format!(
        "One or more tensors were submitted to be reduced, gathered or broadcasted by subset of ranks and are waiting \
         for remainder of ranks for more than {} seconds. This may indicate that different ranks are trying to submit \
         different tensors or that only subset of ranks is submitting tensors, which will cause deadlock.\nMissing ranks:",
        waited.as_secs()
    );
    for (rank, names) in missing {
        let marker = if stalled_out.contains(rank) { "!" } else { "" };
        let shown: Vec<&str> = names.iter().take(NAMES_PER_RANK).map(String::as_str).collect();
        let more = if names.len() > NAMES_PER_RANK { ", ..." } else { "" };
        text.push_str(&format!("\n{rank}{marker}: [{}{more}]", shown.join(", ")));
    }
    if let Some(limit) = shutdown_after {
        if !stalled_out.is_empty() {
            text.push_str(&format!(
                "\nOne or more rank (marked by \"!\") is stalled for longer than {} seconds. Their collectives fail.",
                limit.as_secs()
            ));
        }
    }
    text
}

/// A rank that made no progress: it has not submitted collectives the others have waited on for at least the
/// elastic hung time, and waits on nothing itself (it is not in any collective, so it is blocked in the
/// script). Found by the coordinator (`MessageTable::hung_ranks`), reported to the elastic driver.
#[derive(Clone, Debug, PartialEq)]
pub struct HungRank {
    /// Global rank.
    pub rank: u32,
    /// How long the oldest collective it holds up has waited.
    pub waited: Duration,
    /// The collectives it holds up (at most [`NAMES_PER_RANK`]).
    pub tensors: Vec<String>,
}

impl HungRank {
    /// What the coordinator logs, with the rank's host where known: "rank 2 on host X made no progress for 5.0 s".
    pub fn describe(&self, host: Option<&str>) -> String {
        let host = host.map(|h| format!(" on host {h}")).unwrap_or_default();
        format!(
            "rank {}{host} made no progress for {:.1} s: it has not submitted [{}], which the other ranks wait on",
            self.rank,
            self.waited.as_secs_f64(),
            self.tensors.join(", ")
        )
    }
}

/// When the next stall check is due.
pub struct StallClock {
    interval: Duration,
    next_check: Instant,
}

/// Stalls are checked at least this often, so warnings and failures come within this of their time (well
/// inside the second Horovod users are promised; a check only looks at this rank's own table).
const CHECK_EVERY: Duration = Duration::from_millis(250);

impl StallClock {
    /// A clock for a stall time of `warn_after`: checks every `CHECK_EVERY` (or every `warn_after`, if shorter).
    pub fn new(warn_after: Duration) -> StallClock {
        let interval = warn_after.min(CHECK_EVERY).max(Duration::from_millis(10));
        StallClock { interval, next_check: Instant::now() + interval }
    }

    /// Whether a check is due now; if so the next one is scheduled.
    pub fn due(&mut self, now: Instant) -> bool {
        if now < self.next_check {
            return false;
        }
        self.next_check = now + self.interval;
        true
    }

    /// Time left until the next check.
    pub fn remaining(&self, now: Instant) -> Duration {
        self.next_check.saturating_duration_since(now)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warning_names_ranks_and_tensors() {
        let mut missing = MissingRanks::new();
        missing.insert(1, vec!["allreduce.a".into(), "allreduce.b".into()]);
        missing.insert(2, (0..8).map(|i| format!("t{i}")).collect());
        let text = stall_warning(&missing, Duration::from_secs(60), None, &[]);
        assert!(text.contains("more than 60 seconds"));
        assert!(text.contains("\n1: [allreduce.a, allreduce.b]"));
        assert!(text.contains("\n2: [t0, t1, t2, t3, t4, t5, ...]"));
        let text = stall_warning(&missing, Duration::from_secs(60), Some(Duration::from_secs(90)), &[2]);
        assert!(text.contains("\n2!: ["));
        assert!(text.contains("stalled for longer than 90 seconds"));
    }

    #[test]
    fn hung_rank_is_described_by_rank_host_and_time() {
        let hung = HungRank { rank: 2, waited: Duration::from_millis(5040), tensors: vec!["allreduce.x".into()] };
        assert_eq!(
            hung.describe(Some("node7")),
            "rank 2 on host node7 made no progress for 5.0 s: it has not submitted [allreduce.x], which the other \
             ranks wait on"
        );
        assert!(hung.describe(None).starts_with("rank 2 made no progress for 5.0 s"));
    }

    #[test]
    fn clock_fires_once_per_interval() {
        let start = Instant::now();
        let mut clock = StallClock::new(Duration::from_secs(10));
        assert!(!clock.due(start));
        assert!(clock.due(start + Duration::from_millis(300)), "checked every 250 ms, not every stall time");
        assert!(!clock.due(start + Duration::from_millis(450)));
        assert!(clock.due(start + Duration::from_millis(600)));
    }
}
