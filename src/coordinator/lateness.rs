//! Stragglers: how late each rank announces the collectives every rank ends up running, so that the rank
//! holding the others back can be named. Where every rank sees every rank's round headers (all-to-all
//! negotiation), each keeps this record from the same announcements (the times are its own clock's); on a
//! tree each learns, one round later, which rank was last and by how much ([`Lateness::note_last`]).
//!
//! A collective's lateness for rank `r` is the time from the round in which the first rank announced it
//! to the round in which `r` did (zero for the first). Each decision (a round in which cached collectives
//! became ready on every rank, or a fast-lane op, whose lateness is when each rank's header arrived) gives
//! every rank its largest lateness over those collectives; the ranks with the largest, when it is not
//! zero, were that decision's last. A rank is named the straggler while, over the last [`WINDOW`]
//! decisions, it was last in at least [`NAMED_LAST`] of them, and its mean lateness is at least
//! [`NAME_FRACTION`] of the mean time between decisions and at least [`MIN_LATENESS`] (jitter of a tight
//! loop is not worth a name).

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use rustc_hash::FxHashMap as HashMap;

use crate::protocol::bitset::BitSet;

/// Decisions a name is judged over.
pub const WINDOW: usize = 10;
/// Of the last [`WINDOW`] decisions, how many a rank must have been last in to be named.
pub const NAMED_LAST: usize = 8;
/// A named rank's mean lateness is at least this share of the mean time between decisions.
pub const NAME_FRACTION: f64 = 0.25;
/// ... and at least this long (a healthy 2-rank job's systematic millisecond is not worth a warning).
pub const MIN_LATENESS: Duration = Duration::from_millis(5);

/// One rank's record (communicator rank), as `hvd.straggler_report()` shows it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RankLateness {
    /// Decisions this rank took part in.
    pub rounds: u64,
    /// Decisions in which it was last.
    pub times_last: u64,
    /// Its lateness summed over those decisions.
    pub total_lateness: Duration,
    /// Whether it is named the straggler now.
    pub straggler: bool,
}

impl RankLateness {
    pub fn mean_lateness(&self) -> Duration {
        if self.rounds == 0 {
            Duration::ZERO
        } else {
            self.total_lateness / u32::try_from(self.rounds).unwrap_or(u32::MAX)
        }
    }
}

struct Decision {
    at: Instant,
    /// Each rank's lateness (`None`: a joined rank, which took no part).
    lateness: Vec<Option<Duration>>,
    last: Vec<usize>,
}

/// A rank named or no longer named (see [`Lateness::note_round`]).
#[derive(Clone, Debug, PartialEq)]
pub struct NameChange {
    pub rank: usize,
    pub named: bool,
    /// "last in 9 of the last 10 rounds, 51.2 ms late on average (102.0 ms between rounds)".
    pub why: String,
}

/// The lateness record of one communicator.
pub struct Lateness {
    /// When each rank first announced each cache bit not yet run (indexed by communicator rank).
    first_seen: HashMap<usize, Vec<Option<Instant>>>,
    ranks: Vec<RankLateness>,
    recent: VecDeque<Decision>,
}

impl Lateness {
    pub fn new(size: usize) -> Lateness {
        Lateness { first_seen: HashMap::default(), ranks: vec![RankLateness::default(); size], recent: VecDeque::new() }
    }

    pub fn report(&self) -> &[RankLateness] {
        &self.ranks
    }

    /// A round decided at `now`: `hits[r]` holds the cache bits rank `r` announced (`None` for a joined
    /// rank), `ready` those that run now on every rank, `erased` those the round invalidated.
    pub fn note_round(
        &mut self,
        now: Instant,
        hits: &[Option<&BitSet>],
        ready: &BitSet,
        erased: &BitSet,
    ) -> Vec<NameChange> {
        let size = self.ranks.len();
        for (rank, bits) in hits.iter().enumerate() {
            for bit in bits.iter().flat_map(|b| b.iter_ones()) {
                let seen = self.first_seen.entry(bit).or_insert_with(|| vec![None; size]);
                if let Some(at) = seen.get_mut(rank) {
                    at.get_or_insert(now);
                }
            }
        }
        for bit in erased.iter_ones() {
            self.first_seen.remove(&bit);
        }
        let mut lateness: Vec<Option<Duration>> = vec![None; size];
        let mut any = false;
        for bit in ready.iter_ones() {
            let Some(seen) = self.first_seen.remove(&bit) else { continue };
            let Some(first) = seen.iter().flatten().min().copied() else { continue };
            any = true;
            for (rank, at) in seen.iter().enumerate() {
                if let Some(at) = at {
                    let late = at.saturating_duration_since(first);
                    let slot = &mut lateness[rank];
                    *slot = Some(slot.map_or(late, |l| l.max(late)));
                }
            }
        }
        if !any {
            return Vec::new();
        }
        self.record(now, lateness)
    }

    /// A fast-lane op decided at `now`: `arrivals[r]` is when rank `r`'s header was here (this rank's own:
    /// when it sent it).
    pub fn note_arrivals(&mut self, now: Instant, arrivals: &[Instant]) -> Vec<NameChange> {
        let Some(first) = arrivals.iter().min().copied() else { return Vec::new() };
        let lateness = arrivals.iter().map(|at| Some(at.saturating_duration_since(first))).collect();
        self.record(now, lateness)
    }

    /// A decision on a tree (see `coordinator::tree`) at `now`, where only the last rank to announce and by
    /// how much it was later than the first are known: the others count as on time.
    pub fn note_last(&mut self, now: Instant, last: usize, by: Duration) -> Vec<NameChange> {
        let lateness = (0..self.ranks.len()).map(|rank| Some(if rank == last { by } else { Duration::ZERO })).collect();
        self.record(now, lateness)
    }

    fn record(&mut self, at: Instant, lateness: Vec<Option<Duration>>) -> Vec<NameChange> {
        let worst = lateness.iter().flatten().max().copied().unwrap_or_default();
        let last: Vec<usize> = if worst.is_zero() {
            Vec::new()
        } else {
            (0..lateness.len()).filter(|&r| lateness[r] == Some(worst)).collect()
        };
        for (rank, late) in lateness.iter().enumerate() {
            if let (Some(late), Some(record)) = (late, self.ranks.get_mut(rank)) {
                record.rounds += 1;
                record.total_lateness += *late;
                record.times_last += u64::from(last.contains(&rank));
            }
        }
        self.recent.push_back(Decision { at, lateness, last });
        if self.recent.len() > WINDOW {
            self.recent.pop_front();
        }
        self.judge()
    }

    /// Name or clear each rank by the last [`WINDOW`] decisions.
    fn judge(&mut self) -> Vec<NameChange> {
        if self.recent.len() < WINDOW {
            return Vec::new();
        }
        let (Some(first), Some(newest)) = (self.recent.front(), self.recent.back()) else { return Vec::new() };
        let between = newest.at.saturating_duration_since(first.at) / (WINDOW as u32 - 1);
        let mut changes = Vec::new();
        for rank in 0..self.ranks.len() {
            let times_last = self.recent.iter().filter(|d| d.last.contains(&rank)).count();
            let late: Vec<Duration> =
                self.recent.iter().filter_map(|d| d.lateness.get(rank).copied().flatten()).collect();
            let mean = if late.is_empty() { Duration::ZERO } else { late.iter().sum::<Duration>() / late.len() as u32 };
            let named = times_last >= NAMED_LAST
                && mean >= MIN_LATENESS
                && mean.as_secs_f64() >= NAME_FRACTION * between.as_secs_f64();
            if named != self.ranks[rank].straggler {
                self.ranks[rank].straggler = named;
                let why = format!(
                    "last in {times_last} of the last {WINDOW} rounds, {:.1} ms late on average ({:.1} ms between rounds)",
                    mean.as_secs_f64() * 1e3,
                    between.as_secs_f64() * 1e3
                );
                changes.push(NameChange { rank, named, why });
            }
        }
        changes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bits(ones: &[usize]) -> BitSet {
        ones.iter().copied().collect()
    }

    /// `steps` steps of 3 ranks, one collective (bit 0) each, `step` apart; rank 2 announces it `late` after
    /// the others (one round later). Returns the name changes.
    fn run(lateness: &mut Lateness, start: Instant, steps: u32, step: Duration, late: Duration) -> Vec<NameChange> {
        let mut changes = Vec::new();
        let (one, none) = (bits(&[0]), BitSet::new());
        for i in 0..steps {
            let t = start + step * i;
            if late.is_zero() {
                changes.extend(lateness.note_round(t, &[Some(&one), Some(&one), Some(&one)], &one, &none));
            } else {
                changes.extend(lateness.note_round(t, &[Some(&one), Some(&one), Some(&none)], &none, &none));
                changes.extend(lateness.note_round(t + late, &[Some(&one), Some(&one), Some(&one)], &one, &none));
            }
        }
        changes
    }

    #[test]
    fn a_rank_late_every_step_is_named_after_the_window_and_cleared_once_it_keeps_up() {
        let mut lateness = Lateness::new(3);
        let start = Instant::now();
        let step = Duration::from_millis(30);
        let named = run(&mut lateness, start, 12, step, Duration::from_millis(15));
        assert_eq!(named.len(), 1, "{named:?}");
        assert_eq!((named[0].rank, named[0].named), (2, true));
        assert!(
            named[0].why.starts_with("last in 10 of the last 10 rounds, 15.0 ms late on average"),
            "{}",
            named[0].why
        );
        let report = lateness.report();
        assert_eq!(
            (report[2].rounds, report[2].times_last, report[2].mean_lateness()),
            (12, 12, Duration::from_millis(15))
        );
        assert_eq!((report[0].times_last, report[0].mean_lateness(), report[0].straggler), (0, Duration::ZERO, false));
        assert!(report[2].straggler);
        // Once rank 2 keeps up, it is cleared when fewer than 8 of the last 10 rounds had it last.
        let cleared = run(&mut lateness, start + step * 12, 3, step, Duration::ZERO);
        assert_eq!(cleared.iter().map(|c| (c.rank, c.named)).collect::<Vec<_>>(), [(2, false)]);
        assert_eq!(lateness.report()[2].rounds, 15);
    }

    #[test]
    fn lateness_under_five_milliseconds_or_a_quarter_of_the_step_names_nobody() {
        let mut lateness = Lateness::new(3);
        let start = Instant::now();
        assert!(run(&mut lateness, start, 50, Duration::from_millis(8), Duration::from_millis(4)).is_empty());
        assert_eq!(lateness.report()[2].times_last, 50);
        let mut lateness = Lateness::new(3);
        assert!(run(&mut lateness, start, 50, Duration::from_millis(100), Duration::from_millis(20)).is_empty());
    }

    #[test]
    fn fast_lane_arrivals_joined_ranks_and_erased_bits() {
        let mut lateness = Lateness::new(3);
        let t = Instant::now();
        lateness.note_arrivals(t, &[t, t + Duration::from_millis(4), t + Duration::from_millis(1)]);
        let report = lateness.report();
        assert_eq!(report.iter().map(|r| r.times_last).collect::<Vec<_>>(), [0, 1, 0]);
        assert_eq!(report[1].mean_lateness(), Duration::from_millis(4));
        // A joined rank (None) takes no part; an erased bit's first announcement is forgotten.
        let (one, none) = (bits(&[1]), BitSet::new());
        lateness.note_round(t, &[Some(&one), None, Some(&none)], &none, &none);
        lateness.note_round(t + Duration::from_millis(9), &[Some(&one), None, Some(&none)], &none, &one);
        lateness.note_round(t + Duration::from_millis(10), &[Some(&one), None, Some(&one)], &one, &none);
        let report = lateness.report();
        assert_eq!(report.iter().map(|r| r.rounds).collect::<Vec<_>>(), [2, 1, 2]);
        assert_eq!(report[2].times_last, 0, "both announced bit 1 anew at the same round");
    }
}
