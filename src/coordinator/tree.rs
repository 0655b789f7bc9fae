//! Negotiation along trees: how a round's messages travel on communicators too large for every rank to send
//! its header to every other one.
//!
//! - [`combine_summaries`]: every rank's [`RoundSummary`] combined by recursive doubling, so every rank ends
//!   with the summary of all of them after `log2(p)` exchanges (`p` the largest power of two not above `n`;
//!   the `n - p` ranks beyond it first fold onto a partner, which hands them the result at the end). No rank
//!   sends more than `log2(p) + 2` messages (`log2(p)` where `n` is a power of two).
//!
//! A round must wake every idle rank (an idle rank starts its part of a round when a peer's message arrives),
//! so every rank hears from a peer before it must send: a rank that starts a round sends to its first
//! partner, who wakes and sends on to its own, and so on; the partner a rank folds onto opens with its own
//! summary (which the folded rank reads and drops) instead of waiting silently for the folded rank's.
//! - [`gather_to_root`]: request lists sent up a binomial tree to rank 0 (the coordinator). Each rank sends
//!   one message; rank 0 receives `ceil(log2 n)`. Lists reach rank 0 in rank order.
//! - [`broadcast_from_root`]: the coordinator's response list sent down the same tree, forwarded as bytes.
//!
//! Every message is framed as the all-to-all round frames its messages, and what arrives is checked against
//! the tree's shape: a summary must cover the ranks its sender stands for, a gathered list only ranks of its
//! sender's subtree, each once and in order.

use crate::config::Negotiation;
use crate::coordinator::negotiation::{count_sent, framed, recv_body, recv_message, send_message};
use crate::protocol::codec::WireMessage;
use crate::protocol::summary::{GatheredRequests, RankRequests, RoundSummary};
use crate::transport::{Transport, TransportError};

/// Communicators of up to this many ranks negotiate all-to-all unless told otherwise: each rank's header
/// goes to every other rank in one step, with small tensors' data riding along (the eager path), which
/// beats `log2 n` dependent steps while `n - 1` sends cost little.
pub const ALL_TO_ALL_MAX_RANKS: usize = 8;

/// Whether a communicator of `n` ranks negotiates along trees under `choice`.
pub fn uses_tree(choice: Negotiation, n: usize) -> bool {
    match choice {
        Negotiation::Auto => n > ALL_TO_ALL_MAX_RANKS,
        Negotiation::AllToAll => false,
        Negotiation::Tree => n > 1,
    }
}

/// Where `rank` of `n` stands in recursive doubling over `p` (the largest power of two not above `n`) ranks.
#[derive(Debug, PartialEq, Eq)]
enum Doubling {
    /// One of the `n - p` ranks beyond `p`: hands its summary to `onto` and gets the total back from it (after
    /// `onto`'s own summary, which wakes it).
    Folded { onto: usize },
    /// Takes part as `virtual_rank` of `p`; `folded` is the rank that folded onto it, if any.
    Takes { virtual_rank: usize, folded: Option<usize> },
}

fn largest_power_of_two_within(n: usize) -> usize {
    if n == 0 {
        0
    } else {
        1 << (usize::BITS - 1 - n.leading_zeros())
    }
}

fn doubling_role(rank: usize, n: usize) -> Doubling {
    let extra = n - largest_power_of_two_within(n);
    if rank < 2 * extra {
        if rank % 2 == 1 {
            Doubling::Folded { onto: rank - 1 }
        } else {
            Doubling::Takes { virtual_rank: rank / 2, folded: Some(rank + 1) }
        }
    } else {
        Doubling::Takes { virtual_rank: rank - extra, folded: None }
    }
}

/// The real rank of `virtual_rank` in recursive doubling over `n` ranks.
fn real_rank(virtual_rank: usize, n: usize) -> usize {
    let extra = n - largest_power_of_two_within(n);
    if virtual_rank < extra {
        virtual_rank * 2
    } else {
        virtual_rank + extra
    }
}

/// The partners `rank` of `n` exchanges with, in order (the ranks it sends to and receives from).
pub fn doubling_partners(rank: usize, n: usize) -> Vec<usize> {
    let p = largest_power_of_two_within(n);
    match doubling_role(rank, n) {
        Doubling::Folded { onto } => vec![onto],
        Doubling::Takes { virtual_rank, folded } => {
            let steps = (0..p.trailing_zeros()).map(|k| real_rank(virtual_rank ^ (1 << k), n));
            folded.into_iter().chain(steps).collect()
        }
    }
}

fn recv_summary(t: &mut dyn Transport, peer: usize, covers: usize) -> Result<RoundSummary, TransportError> {
    let summary: RoundSummary = recv_message(t, peer)?;
    let n = t.size();
    if summary.ranks as usize != covers || summary.shutdown_by.iter().any(|&(rank, _)| rank as usize >= n) {
        return Err(TransportError::Protocol {
            peer,
            detail: format!(
                "its round summary covers {} ranks (expected {covers}) or names a rank outside the {n}",
                summary.ranks
            ),
        });
    }
    Ok(summary)
}

/// Combine this rank's `own` summary with every other rank's: every rank returns the same summary of all.
pub fn combine_summaries(t: &mut dyn Transport, own: RoundSummary) -> Result<RoundSummary, TransportError> {
    let (me, n) = (t.rank(), t.size());
    let p = largest_power_of_two_within(n);
    let mut total = own;
    let (virtual_rank, folded) = match doubling_role(me, n) {
        Doubling::Folded { onto } => {
            send_message(t, onto, &total.to_bytes())?;
            recv_summary(t, onto, 1)?; // `onto`'s wake-up call
            return recv_summary(t, onto, n);
        }
        Doubling::Takes { virtual_rank, folded } => (virtual_rank, folded),
    };
    if let Some(peer) = folded {
        send_message(t, peer, &total.to_bytes())?;
        total.combine(recv_summary(t, peer, 1)?);
    }
    for k in 0..p.trailing_zeros() {
        let partner = real_rank(virtual_rank ^ (1 << k), n);
        send_message(t, partner, &total.to_bytes())?;
        // The partner's group is as large as this rank's so far: 2^k virtual ranks and those folded onto them.
        let group = (0..1usize << k).map(|i| ((virtual_rank ^ (1 << k)) & !((1 << k) - 1)) + i);
        let covers = group.map(|v| if v < n - p { 2 } else { 1 }).sum();
        total.combine(recv_summary(t, partner, covers)?);
    }
    if let Some(peer) = folded {
        send_message(t, peer, &total.to_bytes())?;
    }
    Ok(total)
}

/// Send `own` up the binomial tree. Rank 0 returns every rank's list in rank order, each with the peer it
/// came from (itself for its own); the others return an empty list once theirs has gone up.
pub fn gather_to_root(t: &mut dyn Transport, own: RankRequests) -> Result<Vec<(usize, RankRequests)>, TransportError> {
    let (me, n) = (t.rank(), t.size());
    let mut lists = vec![(me, own)];
    let mut mask = 1;
    while mask < n {
        if me & mask != 0 {
            let gathered = GatheredRequests { lists: lists.into_iter().map(|(_, list)| list).collect() };
            send_message(t, me - mask, &gathered.to_bytes())?;
            return Ok(Vec::new());
        }
        let child = me + mask;
        if child < n {
            let gathered: GatheredRequests = recv_message(t, child)?;
            let subtree = child..(child + mask).min(n);
            let ranks: Vec<usize> = gathered.lists.iter().map(|l| l.rank as usize).collect();
            if !ranks.iter().copied().eq(subtree.clone()) {
                return Err(TransportError::Protocol {
                    peer: child,
                    detail: format!("it forwarded request lists of ranks {ranks:?} for its subtree {subtree:?}"),
                });
            }
            lists.extend(gathered.lists.into_iter().map(|list| (child, list)));
        }
        mask <<= 1;
    }
    Ok(lists)
}

/// Rank 0's `message` (a framed-message body; ignored on other ranks) sent down the binomial tree: every
/// rank returns it.
pub fn broadcast_from_root(t: &mut dyn Transport, message: Vec<u8>) -> Result<Vec<u8>, TransportError> {
    let (me, n) = (t.rank(), t.size());
    let (body, mut mask) = if me == 0 {
        (message, n.next_power_of_two())
    } else {
        let lowest = me & me.wrapping_neg();
        let mut body = Vec::new();
        recv_body(t, me - lowest, &mut body)?;
        (body, lowest)
    };
    let frame = framed(&body);
    mask >>= 1;
    while mask > 0 {
        if me + mask < n {
            t.send(me + mask, &frame)?;
            count_sent(1);
        }
        mask >>= 1;
    }
    Ok(body)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::bitset::BitSet;
    use crate::protocol::round::{RequestList, RoundHeader, StopReason};
    use crate::transport::memory::{run_ranks, MemoryTransport};

    #[test]
    fn every_rank_is_someones_partner_and_partners_agree() {
        for n in 1..=40 {
            for rank in 0..n {
                let partners = doubling_partners(rank, n);
                assert!(partners.len() <= largest_power_of_two_within(n).trailing_zeros() as usize + 1);
                if n.is_power_of_two() {
                    assert_eq!(partners.len(), n.trailing_zeros() as usize);
                }
                for &p in &partners {
                    assert!(p < n && p != rank, "n={n} rank={rank} partners={partners:?}");
                    assert!(doubling_partners(p, n).contains(&rank), "n={n}: {rank} -> {p} is one-sided");
                }
            }
        }
    }

    #[test]
    fn the_tree_mode_follows_the_choice_and_the_size() {
        assert!(!uses_tree(Negotiation::Auto, ALL_TO_ALL_MAX_RANKS));
        assert!(uses_tree(Negotiation::Auto, ALL_TO_ALL_MAX_RANKS + 1));
        assert!(uses_tree(Negotiation::Tree, 2));
        assert!(!uses_tree(Negotiation::Tree, 1));
        assert!(!uses_tree(Negotiation::AllToAll, 1000));
    }

    fn header(rank: usize, n: usize) -> RoundHeader {
        let mut header = RoundHeader {
            // Bit 0 hit by all, bit 1 by all but the last rank, bit (2 + rank) by this rank alone.
            cache_hits: [0, 2 + rank].into_iter().chain((rank + 1 < n).then_some(1)).collect(),
            joined: n > 2 && rank == 1,
            has_uncached: rank == n / 2,
            ..RoundHeader::default()
        };
        if rank == n - 1 {
            header.shutdown = Some(StopReason::Exiting);
            header.invalid.insert(100 + rank);
        }
        header
    }

    #[test]
    fn recursive_doubling_gives_every_rank_the_all_to_all_verdict() {
        for n in [1, 2, 3, 5, 6, 7, 8, 9, 13, 16, 17, 33] {
            let expected = RoundSummary::of_all(&(0..n).map(|r| header(r, n)).collect::<Vec<_>>());
            let got = run_ranks(MemoryTransport::mesh(n), |t| {
                let own = RoundSummary::of(t.rank(), &header(t.rank(), n));
                combine_summaries(t, own).unwrap()
            });
            for (rank, summary) in got.iter().enumerate() {
                assert_eq!(summary, &expected, "n={n}, rank {rank}");
            }
            let common: BitSet = if n > 1 { [0].into_iter().collect() } else { [0, 2].into_iter().collect() };
            assert_eq!(expected.common_hits(), common, "n={n}");
        }
    }

    #[test]
    fn requests_gather_in_rank_order_and_the_answer_reaches_everyone() {
        for n in [1, 2, 3, 4, 7, 8, 11, 16, 21] {
            let got = run_ranks(MemoryTransport::mesh(n), |t| {
                let me = t.rank();
                let own = RankRequests {
                    rank: me as u32,
                    list: RequestList { requests: Vec::new(), waited_ms: vec![me as i64] },
                    waiting_hits: [me].into_iter().collect(),
                };
                let lists = gather_to_root(t, own).unwrap();
                let answer = if me == 0 { format!("{} lists", lists.len()).into_bytes() } else { Vec::new() };
                (lists, broadcast_from_root(t, answer).unwrap())
            });
            let (root_lists, _) = &got[0];
            let ranks: Vec<u32> = root_lists.iter().map(|(_, l)| l.rank).collect();
            assert_eq!(ranks, (0..n as u32).collect::<Vec<_>>(), "n={n}");
            for (from, list) in root_lists {
                assert_eq!(list.list.waited_ms, vec![list.rank as i64]);
                // The peer a list came through is rank 0's child whose subtree holds it.
                assert!(*from <= list.rank as usize, "n={n}: rank {} came through {from}", list.rank);
            }
            for (rank, (lists, answer)) in got.iter().enumerate() {
                assert_eq!(answer, format!("{n} lists").as_bytes(), "n={n} rank {rank}");
                assert_eq!(lists.is_empty(), rank != 0);
            }
        }
    }

    #[test]
    fn a_subtree_that_forwards_a_foreign_rank_is_refused() {
        let got = run_ranks(MemoryTransport::mesh(2), |t| {
            let rank = if t.rank() == 1 { 5 } else { 0 };
            gather_to_root(t, RankRequests { rank, ..RankRequests::default() }).map(|_| ())
        });
        let err = got[0].as_ref().unwrap_err();
        assert!(matches!(err, TransportError::Protocol { peer: 1, .. }), "{err:?}");
        assert!(err.to_string().contains("ranks [5] for its subtree 1..2"), "{err}");
    }
}
