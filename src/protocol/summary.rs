//! The messages of a negotiation round combined along a tree (communicators larger than the all-to-all
//! exchange suits, see `coordinator::tree`).
//!
//! - [`RoundSummary`]: what a group of ranks' round headers say together: the AND of their cache hits
//!   (over the ranks that have not joined, and over all), the OR of their invalid bits and flags, who asked
//!   to stop and why, and rank 0's autotuned values. Two summaries combine ([`RoundSummary::combine`])
//!   associatively and commutatively, so recursive doubling reaches the same summary of every rank on every
//!   rank, whatever order the groups met in.
//!   It also carries how early each rank announced what the previous round ran ([`Ages`]), reduced to the
//!   rank that was last and by how much: the straggler record on a tree.
//! - [`GatheredRequests`]: the uncached requests of a subtree of ranks on their way to the coordinator,
//!   each rank's list with its rank and the cache bits it hit that are still waiting for other ranks.

use crate::protocol::bitset::BitSet;
use crate::protocol::codec::{DecodeError, MessageKind, Wire, WireMessage, WireReader, WireWriter};
use crate::protocol::round::{RequestList, RoundHeader, StopReason};
use crate::protocol::tuned::TunedValues;

const HAS_UNCACHED: u8 = 1;
const HAS_ACTIVE_HITS: u8 = 1 << 1;
const HAS_ALL_HITS: u8 = 1 << 2;
const HAS_TUNED: u8 = 1 << 3;
const HAS_AGES: u8 = 1 << 4;
const KNOWN: u8 = HAS_UNCACHED | HAS_ACTIVE_HITS | HAS_ALL_HITS | HAS_TUNED | HAS_AGES;

/// How long before the previous round's decision the ranks announced what it ran (each rank's own clock:
/// a rank's age is the time from its first announcement of those collectives to the decision). The youngest
/// was the last to announce; the others were that much earlier.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ages {
    /// The smallest age, in microseconds, and its rank (the lowest rank among equals).
    pub youngest_us: u64,
    pub youngest_rank: u32,
    /// The largest age, in microseconds.
    pub oldest_us: u64,
}

impl Ages {
    /// One rank's age.
    pub fn of(rank: usize, age_us: u64) -> Ages {
        Ages { youngest_us: age_us, youngest_rank: rank as u32, oldest_us: age_us }
    }

    fn combine(self, other: Ages) -> Ages {
        let youngest = (self.youngest_us, self.youngest_rank).min((other.youngest_us, other.youngest_rank));
        Ages { youngest_us: youngest.0, youngest_rank: youngest.1, oldest_us: self.oldest_us.max(other.oldest_us) }
    }
}

/// The round headers of a group of ranks, combined.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RoundSummary {
    /// How many ranks' headers this combines.
    pub ranks: u32,
    /// How many of them have joined.
    pub joined: u32,
    /// Some rank has requests that missed the cache.
    pub has_uncached: bool,
    /// The AND of the cache hits of the ranks that have not joined (`None`: every rank has joined).
    pub active_hits: Option<BitSet>,
    /// The AND of every rank's cache hits (`None` only for the summary of no rank).
    pub all_hits: Option<BitSet>,
    /// The OR of the invalid bits.
    pub invalid: BitSet,
    /// Ranks (communicator ranks, ascending) that asked to stop, and why.
    pub shutdown_by: Vec<(u32, StopReason)>,
    /// Rank 0's autotuned values, if its header carried them.
    pub tuned: Option<TunedValues>,
    /// The ranks' ages for the previous round's decision (set by the caller, not from the header).
    pub ages: Option<Ages>,
}

impl RoundSummary {
    /// The summary of one rank's header.
    pub fn of(rank: usize, header: &RoundHeader) -> RoundSummary {
        RoundSummary {
            ranks: 1,
            joined: u32::from(header.joined),
            has_uncached: header.has_uncached,
            active_hits: (!header.joined).then(|| header.cache_hits.clone()),
            all_hits: Some(header.cache_hits.clone()),
            invalid: header.invalid.clone(),
            shutdown_by: header.shutdown.map(|why| (rank as u32, why)).into_iter().collect(),
            tuned: header.tuned.clone(),
            ages: None,
        }
    }

    /// The summary of every rank's header (`headers[r]` from rank `r`).
    pub fn of_all(headers: &[RoundHeader]) -> RoundSummary {
        headers.iter().enumerate().fold(RoundSummary::default(), |mut acc, (rank, h)| {
            acc.combine(RoundSummary::of(rank, h));
            acc
        })
    }

    /// Fold `other` (a disjoint group of ranks) into this summary.
    pub fn combine(&mut self, other: RoundSummary) {
        fn and(a: &mut Option<BitSet>, b: Option<BitSet>) {
            match (a.as_mut(), b) {
                (_, None) => {}
                (None, b) => *a = b,
                (Some(a), Some(b)) => a.intersect_with(&b),
            }
        }
        self.ranks = self.ranks.saturating_add(other.ranks);
        self.joined = self.joined.saturating_add(other.joined);
        self.has_uncached |= other.has_uncached;
        and(&mut self.active_hits, other.active_hits);
        and(&mut self.all_hits, other.all_hits);
        self.invalid.union_with(&other.invalid);
        self.shutdown_by.extend(other.shutdown_by);
        self.shutdown_by.sort_by_key(|(rank, _)| *rank);
        if self.tuned.is_none() {
            self.tuned = other.tuned;
        }
        self.ages = match (self.ages, other.ages) {
            (Some(a), Some(b)) => Some(a.combine(b)),
            (a, b) => a.or(b),
        };
    }

    /// The cache bits every voting rank hit: those that have not joined, or every rank when all have.
    pub fn common_hits(&self) -> BitSet {
        self.active_hits.clone().or_else(|| self.all_hits.clone()).unwrap_or_default()
    }
}

fn stop_code(why: StopReason) -> u8 {
    match why {
        StopReason::Shutdown => 0,
        StopReason::Exiting => 1,
        StopReason::Removed => 2,
    }
}

fn stop_reason(code: u8) -> Result<StopReason, DecodeError> {
    match code {
        0 => Ok(StopReason::Shutdown),
        1 => Ok(StopReason::Exiting),
        2 => Ok(StopReason::Removed),
        tag => Err(DecodeError::BadTag { what: "stop reason", tag }),
    }
}

/// A rank that asked to stop, as the summary's sequence holds it.
struct Stopped(u32, StopReason);

impl Wire for Stopped {
    fn encode(&self, w: &mut WireWriter) {
        w.put_u32(self.0);
        w.put_u8(stop_code(self.1));
    }

    fn decode(r: &mut WireReader<'_>) -> Result<Self, DecodeError> {
        Ok(Stopped(r.u32("stopping rank")?, stop_reason(r.u8("stop reason")?)?))
    }
}

impl Wire for RoundSummary {
    fn encode(&self, w: &mut WireWriter) {
        let mut flags = 0;
        for (set, flag) in [
            (self.has_uncached, HAS_UNCACHED),
            (self.active_hits.is_some(), HAS_ACTIVE_HITS),
            (self.all_hits.is_some(), HAS_ALL_HITS),
            (self.tuned.is_some(), HAS_TUNED),
            (self.ages.is_some(), HAS_AGES),
        ] {
            if set {
                flags |= flag;
            }
        }
        w.put_u8(flags);
        w.put_u32(self.ranks);
        w.put_u32(self.joined);
        for hits in [&self.active_hits, &self.all_hits].into_iter().flatten() {
            hits.encode(w);
        }
        self.invalid.encode(w);
        let stopped: Vec<Stopped> = self.shutdown_by.iter().map(|&(rank, why)| Stopped(rank, why)).collect();
        w.put_seq(&stopped);
        if let Some(tuned) = &self.tuned {
            tuned.encode(w);
        }
        if let Some(ages) = &self.ages {
            w.put_u64(ages.youngest_us);
            w.put_u32(ages.youngest_rank);
            w.put_u64(ages.oldest_us);
        }
    }

    fn decode(r: &mut WireReader<'_>) -> Result<Self, DecodeError> {
        let flags = r.u8("round summary flags")?;
        if flags & !KNOWN != 0 {
            return Err(DecodeError::BadTag { what: "round summary flags", tag: flags });
        }
        let ranks = r.u32("round summary rank count")?;
        let joined = r.u32("round summary joined count")?;
        let active_hits = if flags & HAS_ACTIVE_HITS != 0 { Some(BitSet::decode(r)?) } else { None };
        let all_hits = if flags & HAS_ALL_HITS != 0 { Some(BitSet::decode(r)?) } else { None };
        let invalid = BitSet::decode(r)?;
        let stopped: Vec<Stopped> = r.seq("stopping ranks")?;
        let tuned = if flags & HAS_TUNED != 0 { Some(TunedValues::decode(r)?) } else { None };
        let ages = if flags & HAS_AGES != 0 {
            Some(Ages {
                youngest_us: r.u64("youngest age")?,
                youngest_rank: r.u32("youngest rank")?,
                oldest_us: r.u64("oldest age")?,
            })
        } else {
            None
        };
        Ok(RoundSummary {
            ranks,
            joined,
            has_uncached: flags & HAS_UNCACHED != 0,
            active_hits,
            all_hits,
            invalid,
            shutdown_by: stopped.into_iter().map(|Stopped(rank, why)| (rank, why)).collect(),
            tuned,
            ages,
        })
    }
}

impl WireMessage for RoundSummary {
    const KIND: MessageKind = MessageKind::RoundSummary;
}

/// One rank's part of [`GatheredRequests`].
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RankRequests {
    /// The rank (communicator rank) whose requests these are.
    pub rank: u32,
    pub list: RequestList,
    /// Cache bits this rank hit that not every rank hit yet (the coordinator sees the whole picture of
    /// each name with them: a rank waiting on a cached `allreduce.x` while another submitted `allgather.x`).
    pub waiting_hits: BitSet,
}

impl Wire for RankRequests {
    fn encode(&self, w: &mut WireWriter) {
        w.put_u32(self.rank);
        self.list.encode(w);
        self.waiting_hits.encode(w);
    }

    fn decode(r: &mut WireReader<'_>) -> Result<Self, DecodeError> {
        Ok(RankRequests {
            rank: r.u32("requesting rank")?,
            list: RequestList::decode(r)?,
            waiting_hits: BitSet::decode(r)?,
        })
    }
}

/// The request lists of a subtree of ranks, on their way to the coordinator.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct GatheredRequests {
    pub lists: Vec<RankRequests>,
}

impl Wire for GatheredRequests {
    fn encode(&self, w: &mut WireWriter) {
        w.put_seq(&self.lists);
    }

    fn decode(r: &mut WireReader<'_>) -> Result<Self, DecodeError> {
        Ok(GatheredRequests { lists: r.seq("gathered request lists")? })
    }
}

impl WireMessage for GatheredRequests {
    const KIND: MessageKind = MessageKind::GatheredRequests;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::codec::tests::arb_request;
    use crate::protocol::fuzz::{self, decodes_stably, samples, Target};
    use proptest::prelude::*;

    fn arb_bitset() -> impl Strategy<Value = BitSet> {
        prop::collection::vec(0usize..200, 0..12).prop_map(|bits| bits.into_iter().collect())
    }

    fn arb_header() -> impl Strategy<Value = RoundHeader> {
        let reason = prop_oneof![
            Just(None),
            Just(Some(StopReason::Shutdown)),
            Just(Some(StopReason::Exiting)),
            Just(Some(StopReason::Removed)),
        ];
        (reason, any::<bool>(), prop::bool::weighted(0.2), arb_bitset(), arb_bitset()).prop_map(
            |(shutdown, has_uncached, joined, cache_hits, invalid)| RoundHeader {
                shutdown,
                has_uncached,
                joined,
                cache_hits,
                invalid,
                ..RoundHeader::default()
            },
        )
    }

    fn arb_summary() -> impl Strategy<Value = RoundSummary> {
        let ages = prop::option::of(prop::collection::vec(0u64..1_000_000, 1..6));
        (prop::collection::vec(arb_header(), 1..6), ages).prop_map(|(headers, ages)| {
            let mut summary = RoundSummary::of_all(&headers);
            for (rank, age) in ages.unwrap_or_default().into_iter().enumerate() {
                let mut one = RoundSummary { ages: Some(Ages::of(rank, age)), ..RoundSummary::default() };
                one.combine(std::mem::take(&mut summary));
                summary = one;
            }
            summary
        })
    }

    fn arb_gathered() -> impl Strategy<Value = GatheredRequests> {
        let list = (any::<u32>(), prop::collection::vec(arb_request(), 0..3), arb_bitset()).prop_map(
            |(rank, requests, waiting_hits)| RankRequests {
                rank,
                list: RequestList { waited_ms: vec![7; requests.len()], requests },
                waiting_hits,
            },
        );
        prop::collection::vec(list, 0..4).prop_map(|lists| GatheredRequests { lists })
    }

    /// What the all-to-all round computes from every header: the AND of the hits of the ranks that have
    /// not joined (of all when every rank has), the OR of invalid bits, the stopping ranks in order.
    fn by_hand(headers: &[RoundHeader]) -> (BitSet, BitSet, Vec<(u32, StopReason)>, bool) {
        let active: Vec<&RoundHeader> = headers.iter().filter(|h| !h.joined).collect();
        let voters: Vec<&RoundHeader> = if active.is_empty() { headers.iter().collect() } else { active };
        let mut common = voters[0].cache_hits.clone();
        for h in &voters[1..] {
            common.intersect_with(&h.cache_hits);
        }
        let mut invalid = BitSet::new();
        for h in headers {
            invalid.union_with(&h.invalid);
        }
        let stops = headers.iter().enumerate().filter_map(|(r, h)| h.shutdown.map(|w| (r as u32, w))).collect();
        (common, invalid, stops, headers.iter().any(|h| h.has_uncached))
    }

    proptest! {
        #[test]
        fn summaries_combined_in_any_grouping_say_what_every_header_says(
            headers in prop::collection::vec(arb_header(), 1..12),
            split in 0usize..12,
        ) {
            let split = split.min(headers.len());
            let mut left = RoundSummary::of_all(&headers[..split]);
            let mut right = headers[split..].iter().enumerate().fold(RoundSummary::default(), |mut acc, (i, h)| {
                acc.combine(RoundSummary::of(split + i, h));
                acc
            });
            let whole = RoundSummary::of_all(&headers);
            let mut other_order = right.clone();
            other_order.combine(left.clone());
            left.combine(std::mem::take(&mut right));
            prop_assert_eq!(&left, &whole);
            prop_assert_eq!(&other_order, &whole);
            let (common, invalid, stops, uncached) = by_hand(&headers);
            prop_assert_eq!(whole.common_hits(), common);
            prop_assert_eq!(&whole.invalid, &invalid);
            prop_assert_eq!(&whole.shutdown_by, &stops);
            prop_assert_eq!(whole.has_uncached, uncached);
            prop_assert_eq!(whole.ranks as usize, headers.len());
            prop_assert_eq!(whole.joined as usize, headers.iter().filter(|h| h.joined).count());
        }

        #[test]
        fn a_summary_roundtrips(summary in arb_summary()) {
            prop_assert_eq!(RoundSummary::from_bytes(&summary.to_bytes()).unwrap(), summary.clone());
            let bytes = summary.to_bytes();
            for cut in 0..bytes.len() {
                prop_assert!(RoundSummary::from_bytes(&bytes[..cut]).is_err());
            }
        }

        #[test]
        fn gathered_requests_roundtrip(gathered in arb_gathered()) {
            let bytes = gathered.to_bytes();
            prop_assert_eq!(GatheredRequests::from_bytes(&bytes).unwrap().to_bytes(), bytes.clone());
            for cut in 0..bytes.len() {
                prop_assert!(GatheredRequests::from_bytes(&bytes[..cut]).is_err());
            }
        }
    }

    #[test]
    fn rank_zeros_tuned_values_survive_combining() {
        let tuned = TunedValues {
            fusion_threshold: 1 << 20,
            cycle_time: std::time::Duration::from_millis(2),
            cache_enabled: true,
            hierarchical_allreduce: None,
            hierarchical_allgather: Some(true),
        };
        let headers = [RoundHeader { tuned: Some(tuned.clone()), ..RoundHeader::default() }, RoundHeader::default()];
        let mut from_one = RoundSummary::of(1, &headers[1]);
        from_one.combine(RoundSummary::of(0, &headers[0]));
        assert_eq!(from_one.tuned, Some(tuned.clone()));
        assert_eq!(RoundSummary::from_bytes(&from_one.to_bytes()).unwrap().tuned, Some(tuned));
    }

    #[test]
    fn ages_name_the_youngest_rank_whatever_the_grouping() {
        let ages = [(0, 900), (1, 40), (2, 40), (3, 1200)];
        let mut forward = RoundSummary::default();
        let mut backward = RoundSummary::default();
        for &(rank, age) in &ages {
            forward.combine(RoundSummary { ages: Some(Ages::of(rank, age)), ..RoundSummary::default() });
        }
        for &(rank, age) in ages.iter().rev() {
            backward.combine(RoundSummary { ages: Some(Ages::of(rank, age)), ..RoundSummary::default() });
        }
        let expected = Ages { youngest_us: 40, youngest_rank: 1, oldest_us: 1200 };
        assert_eq!((forward.ages, backward.ages), (Some(expected), Some(expected)));
        assert_eq!(RoundSummary::from_bytes(&forward.to_bytes()).unwrap().ages, Some(expected));
    }

    #[test]
    fn an_unknown_stop_reason_is_refused() {
        let summary = RoundSummary::of(3, &RoundHeader { shutdown: Some(StopReason::Removed), ..Default::default() });
        let mut bytes = summary.to_bytes();
        let last = bytes.len() - 1;
        assert_eq!(bytes[last], 2);
        bytes[last] = 9;
        assert_eq!(RoundSummary::from_bytes(&bytes).unwrap_err(), DecodeError::BadTag { what: "stop reason", tag: 9 });
    }

    fn summary_target() -> Target {
        let mut seeds: Vec<Vec<u8>> = samples(arb_summary(), 12).iter().map(RoundSummary::to_bytes).collect();
        seeds.push(RoundSummary::default().to_bytes());
        Target { name: "round_summary", seeds, decode: decodes_stably::<RoundSummary> }
    }

    fn gathered_target() -> Target {
        let mut seeds: Vec<Vec<u8>> = samples(arb_gathered(), 12).iter().map(GatheredRequests::to_bytes).collect();
        seeds.push(GatheredRequests::default().to_bytes());
        Target { name: "gathered_requests", seeds, decode: decodes_stably::<GatheredRequests> }
    }

    #[test]
    fn fuzz_short_round_summary() {
        fuzz::run(&summary_target(), fuzz::SHORT_RUN);
    }

    #[test]
    fn fuzz_short_gathered_requests() {
        fuzz::run(&gathered_target(), fuzz::SHORT_RUN);
    }

    #[test]
    #[ignore = "long fuzz run: see docs/fuzzing.md"]
    fn fuzz_long_round_summary() {
        fuzz::run(&summary_target(), fuzz::LONG_RUN);
    }

    #[test]
    #[ignore = "long fuzz run: see docs/fuzzing.md"]
    fn fuzz_long_gathered_requests() {
        fuzz::run(&gathered_target(), fuzz::LONG_RUN);
    }
}
