//! One negotiation round, run in lockstep by every rank of a communicator.
//!
//! 1. Each rank looks its new requests up in the response cache and sends every other rank a
//!    [`RoundHeader`] (flags, cache hits, invalid bits). Every rank ANDs the hits of the ranks that have
//!    not joined and ORs the invalid bits, so all reach the same verdict with no coordinator involved:
//!    in steady state this is the whole round.
//! 2. Only if some rank has uncached requests (or an entry became invalid), workers send them to the
//!    coordinator (rank 0), which answers everyone with the same [`ResponseList`].
//! 3. Every rank updates its cache with the new responses in the same order.
//! 4. If the coordinator's header carried autotuned values, every rank applies the response cache's state
//!    now, so the next round uses it everywhere; the caller applies the rest.
//!
//! A round decides and returns what it decided ([`RoundOutcome`]); the engine fuses the agreed responses
//! (`crate::fusion`) and records the coordinator's ticks in the timeline.
//!
//! Small communicators send every header to every rank (all-to-all: one step, and small tensors' data rides
//! along); larger ones combine the headers into one [`RoundSummary`] by recursive doubling, gather requests
//! and broadcast responses along binomial trees (see [`crate::coordinator::tree`]), so a rank sends
//! O(log n) messages per round. Both reach the same verdict from the same headers.
//!
//! A rank starts a round when it has new work; an idle rank joins when a peer's first message arrives.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::config::Negotiation;
use crate::coordinator::cache::{caches_kind, CacheLookup, ResponseCache};
use crate::coordinator::lateness::{Lateness, NameChange};
use crate::coordinator::message_table::MessageTable;
use crate::coordinator::pending::{Announcement, PendingRequest, PendingRequests};
use crate::coordinator::tree;
use crate::protocol::bitset::BitSet;
use crate::protocol::codec::{WireMessage, WireWriter};
use crate::protocol::message::{OpParams, Response, CPU_DEVICE};
use crate::protocol::round::{EagerPayload, RequestList, ResponseList, RoundHeader, StopReason};
use crate::protocol::summary::{Ages, RankRequests, RoundSummary};
use crate::protocol::tuned::TunedValues;
use crate::transport::{Transport, TransportError};
use crate::types::{CollectiveKind, Compression, ReduceOp};

/// Control messages larger than this are treated as corrupt.
const MAX_CONTROL_MESSAGE: usize = 256 * 1024 * 1024;

/// Cached allreduces, broadcasts and allgathers whose contribution is at most this size travel inside the
/// round header (see [`EagerOp`]). Every rank then sends its data to every other rank and folds all of them,
/// which beats a data exchange after the round up to here: 2 ranks over shared memory, 8 KiB allreduce 7.8 ->
/// 3.6 us and 16 KiB 10 -> 6 us against a 4 KiB limit, 4 ranks on 2 cores 8 KiB 46-52 -> 22-27 us; at 32 KiB
/// riding gained little and cost allgathers as much (this VM, alternating jobs).
pub const EAGER_TENSOR_BYTES: usize = 16 << 10;
/// ... and while a rank sends at most this much of one tensor's data in all (its size times the `n - 1`
/// peers): 16 KiB up to 4 ranks, 6.8 KiB at 8. Beyond that a data exchange after the round costs less.
pub const EAGER_SENT_BYTES: usize = 48 << 10;
/// At most this much eager data rides in one header, so headers stay small.
pub const EAGER_HEADER_BYTES: usize = 64 * 1024;

/// A small allreduce, broadcast or allgather whose data every rank already received with the round headers:
/// each rank reduces the contributions locally, in rank order (an allreduce), takes the root's (a broadcast)
/// or concatenates them in rank order (an allgather), so all get identical bits and no data exchange is
/// needed.
pub struct EagerOp {
    /// The single-tensor cached response.
    pub response: Response,
    /// Each rank's contribution in rank order; `None` for a joined rank (it contributes zeros).
    pub contributions: Vec<Option<Vec<u8>>>,
}

/// How many bytes of one tensor ride in the round headers of `n` ranks negotiating all-to-all (see
/// [`EAGER_SENT_BYTES`]); nothing rides on a tree, which has no headers to ride in.
pub fn eager_limit(n: usize, tree: bool) -> usize {
    if tree {
        0
    } else {
        EAGER_TENSOR_BYTES.min(EAGER_SENT_BYTES / n.saturating_sub(1).max(1))
    }
}

/// Whether a cached tensor of `kind` with `bytes` of data (this rank's contribution) rides in the round
/// headers when every rank hits it (up to `limit` bytes, see [`eager_limit`]): a small allreduce (Adasum excepted: it is not a rank-order fold of the
/// contributions, it always runs its tree; a compressed one too: its error feedback is kept where it runs),
/// a small broadcast (every rank sends its data; all take the
/// root's) or a small allgather (every rank's rows, concatenated in rank order).
pub fn rides_in_header(
    kind: CollectiveKind,
    reduce_op: ReduceOp,
    compression: Compression,
    bytes: usize,
    limit: usize,
) -> bool {
    let eager_kind = match kind {
        CollectiveKind::Allreduce => reduce_op != ReduceOp::Adasum && compression.is_none(),
        CollectiveKind::Broadcast | CollectiveKind::Allgather => true,
        _ => false,
    };
    eager_kind && bytes <= limit
}

/// What a round decided.
pub struct RoundOutcome {
    /// Small allreduces and broadcasts already complete in data (run them locally, in any order).
    pub eager: Vec<EagerOp>,
    /// Responses to run now, identical on every rank, in order (not fused yet).
    pub responses: Vec<Response>,
    /// Ranks that asked to stop, and why; if any did, every rank leaves after running `responses`.
    pub shutdown_by: Vec<(usize, StopReason)>,
    /// Autotuned values the coordinator announced this round; the negotiator has applied its own part
    /// (the response cache), the caller applies the rest.
    pub tuned: Option<TunedValues>,
    /// On the coordinator: the request lists it received this round, each with its sender's communicator
    /// rank (its own first), for the timeline's ticks of each rank's readiness.
    pub received: ReceivedLists,
    /// Ranks this round named the straggler, or no longer does (see [`crate::coordinator::lateness`]).
    pub stragglers: Vec<NameChange>,
    /// Collectives agreed through the response cache this round, and through the coordinator.
    pub cache_hits: usize,
    pub cache_misses: usize,
}

/// Request lists with their senders' communicator ranks (see [`RoundOutcome::received`]).
pub type ReceivedLists = Vec<(usize, RequestList)>;

pub struct Negotiator {
    cache: ResponseCache,
    /// The configured cache capacity, restored when autotune turns the cache back on.
    cache_capacity: usize,
    /// On the coordinator: autotuned values to send in the next header.
    announcement: Option<TunedValues>,
    /// Cached entries pending longer than this are invalidated so the coordinator can report the stall.
    stall_check: Option<Duration>,
    coordinator: Option<MessageTable>,
    /// How late each rank announces what runs (read by callers through [`Negotiator::lateness`]).
    lateness: Arc<Mutex<Lateness>>,
    /// Rounds travel along trees (see [`crate::coordinator::tree`]), not all-to-all.
    tree: bool,
    /// Bytes of one tensor that ride in round headers ([`eager_limit`]).
    eager_limit: usize,
    /// On a tree: when this rank first announced each cache hit it still announces, and its age for the
    /// last decision (see [`Ages`]), sent with the next round's summary.
    announced: rustc_hash::FxHashMap<usize, Instant>,
    age_to_send: Option<Duration>,
}

/// What a rank saw of the other ranks' headers in a round: all of them (all-to-all), or only the summary,
/// with its own cache hits (tree).
enum Seen {
    Every(Vec<RoundHeader>),
    Own(BitSet),
}

/// Control messages (round headers and summaries, request and response lists) this process has sent, for
/// the metrics: per round, O(log n) on a tree, `n - 1` all-to-all.
pub static CONTROL_MESSAGES_SENT: AtomicU64 = AtomicU64::new(0);

/// Count `messages` control messages sent.
pub(crate) fn count_sent(messages: usize) {
    CONTROL_MESSAGES_SENT.fetch_add(messages as u64, Ordering::Relaxed);
}

/// `body` with its length in front, as `recv_message` reads it.
pub(crate) fn framed(body: &[u8]) -> Vec<u8> {
    let mut frame = Vec::with_capacity(4 + body.len());
    frame.extend_from_slice(&(body.len() as u32).to_le_bytes());
    frame.extend_from_slice(body);
    frame
}

pub(crate) fn send_message(t: &mut dyn Transport, peer: usize, body: &[u8]) -> Result<(), TransportError> {
    count_sent(1);
    t.send(peer, &framed(body))
}

pub(crate) fn recv_message<M: WireMessage>(t: &mut dyn Transport, peer: usize) -> Result<M, TransportError> {
    let mut body = Vec::new();
    recv_body(t, peer, &mut body)?;
    decode_message(peer, &body)
}

/// Receive `peer`'s next message into `body` (resized to it), undecoded.
pub fn recv_body(t: &mut dyn Transport, peer: usize, body: &mut Vec<u8>) -> Result<(), TransportError> {
    let mut len = [0u8; 4];
    // Where the length has already arrived, the frame is taken in one read instead of two.
    let ahead = t.peek(peer, &mut len);
    if !ahead {
        t.recv(peer, &mut len)?;
    }
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_CONTROL_MESSAGE {
        return Err(TransportError::Protocol { peer, detail: format!("control message of {len} bytes") });
    }
    body.resize(len, 0);
    if !ahead {
        return t.recv(peer, body);
    }
    t.exchange(peer, &[], peer, 4 + len, &mut |offset, bytes| {
        // Pieces come in any size: the length's 4 bytes may end inside a piece, or fill several.
        let skip = 4usize.saturating_sub(offset).min(bytes.len());
        if skip < bytes.len() {
            let at = offset + skip - 4;
            body[at..at + bytes.len() - skip].copy_from_slice(&bytes[skip..]);
        }
    })
}

/// Decode `peer`'s message `body`; what does not decode is a protocol error naming the peer.
pub fn decode_message<M: WireMessage>(peer: usize, body: &[u8]) -> Result<M, TransportError> {
    M::from_bytes(body).map_err(|e| TransportError::Protocol { peer, detail: e.to_string() })
}

/// What [`Negotiator::round`] sends for [`RoundHeader::single_hit`]`(bit, data)`, byte for byte, written
/// into `frame` (its allocation reused): the fast lane's header (see `engine::fast_lane`).
pub fn frame_single_hit(frame: Vec<u8>, bit: usize, data: Option<&[u8]>) -> Vec<u8> {
    let mut w = WireWriter::reusing(frame);
    w.put_u32(0); // the body's length, written below
    RoundHeader::put_head(&mut w);
    RoundHeader::encode_single_hit(&mut w, bit, data);
    let mut frame = w.into_bytes();
    let body_len = frame.len() as u32 - 4;
    frame[..4].copy_from_slice(&body_len.to_le_bytes());
    frame
}

/// Send `header` to every other rank and receive theirs: every rank's header, in rank order.
pub fn exchange_headers(t: &mut dyn Transport, mut header: RoundHeader) -> Result<Vec<RoundHeader>, TransportError> {
    let (me, n) = (t.rank(), t.size());
    let frame = framed(&header.to_bytes());
    for peer in (0..n).filter(|&p| p != me) {
        t.send(peer, &frame)?;
    }
    count_sent(n - 1);
    let mut headers = Vec::with_capacity(n);
    for peer in 0..n {
        if peer == me {
            headers.push(std::mem::take(&mut header));
        } else {
            headers.push(recv_message::<RoundHeader>(t, peer)?);
        }
    }
    Ok(headers)
}

/// Every rank's contribution to `cached` (the cached tensor at `bit`) if all of them sent it in their headers,
/// each of the size the response says; `None` when some rank did not, sent another size, or the tensor does
/// not ride in headers. A joined rank contributes zeros to an allreduce; an allgather, which a joined rank
/// cannot join, is left to the ordinary path then (which reports it). Tensors on GPUs never ride: their data
/// is read by the GPU route only, in stream order, and every rank, a joined one too, takes part in it.
fn eager_contributions(
    headers: &[RoundHeader],
    bit: usize,
    cached: &Response,
    limit: usize,
) -> Option<Vec<Option<Vec<u8>>>> {
    if cached.on_gpu {
        return None;
    }
    let allgather = cached.kind == CollectiveKind::Allgather;
    // An allgather's contributions differ in size from rank to rank; the others' are all the tensor's.
    let (per_rank, tensor_bytes) = match cached.entries.first() {
        Some(spec) if allgather => (spec.allgather_bytes_per_rank(cached.dtype), 0),
        _ => (Vec::new(), cached.tensor_bytes()),
    };
    let bytes_of = |rank: usize| if allgather { per_rank.get(rank).copied() } else { Some(tensor_bytes) };
    let rides = |rank| {
        bytes_of(rank)
            .is_some_and(|bytes| rides_in_header(cached.kind, cached.reduce_op, cached.compression, bytes, limit))
    };
    if !(0..headers.len()).all(rides) {
        return None;
    }
    headers
        .iter()
        .enumerate()
        .map(|(rank, h)| (h, bytes_of(rank).unwrap_or_default()))
        .map(|(h, bytes)| match h.eager.iter().find(|p| p.bit == bit as u64) {
            Some(p) if p.data.len() == bytes => Some(Some(p.data.clone())),
            Some(_) => None,
            None if h.joined && !allgather => Some(None),
            None => None,
        })
        .collect()
}

impl Negotiator {
    /// `global_ranks[r]` is the global rank of communicator rank `r`; `rank` is this rank's position;
    /// `negotiation` chooses all-to-all or trees (see [`tree::uses_tree`]).
    pub fn new(
        rank: usize,
        global_ranks: Vec<usize>,
        cache_capacity: usize,
        stall_check: Option<Duration>,
        negotiation: Negotiation,
    ) -> Self {
        let n = global_ranks.len();
        let tree = tree::uses_tree(negotiation, n);
        Negotiator {
            tree,
            eager_limit: eager_limit(n, tree),
            announced: Default::default(),
            age_to_send: None,
            cache: ResponseCache::new(cache_capacity),
            cache_capacity,
            announcement: None,
            stall_check,
            lateness: Arc::new(Mutex::new(Lateness::new(global_ranks.len()))),
            coordinator: (rank == 0).then(|| MessageTable::new(global_ranks)),
        }
    }

    /// Whether rounds travel along trees rather than all-to-all.
    pub fn negotiates_on_trees(&self) -> bool {
        self.tree
    }

    /// Bytes of one tensor that ride in round headers (see [`eager_limit`]).
    pub fn eager_limit(&self) -> usize {
        self.eager_limit
    }

    /// Keep each rank's lateness record in `lateness`, which callers read (`hvd.straggler_report()`).
    pub fn share_lateness(&mut self, lateness: Arc<Mutex<Lateness>>) {
        self.lateness = lateness;
    }

    /// The coordinator's state, on rank 0.
    pub fn coordinator(&self) -> Option<&MessageTable> {
        self.coordinator.as_ref()
    }

    /// The coordinator's state, on rank 0, to change.
    pub fn coordinator_mut(&mut self) -> Option<&mut MessageTable> {
        self.coordinator.as_mut()
    }

    /// On the coordinator: send `values` with the next round's header; every rank applies them when that
    /// round ends (ignored on other ranks).
    pub fn announce(&mut self, values: TunedValues) {
        if self.coordinator.is_some() {
            self.announcement = Some(values);
        }
    }

    /// Whether the response cache is in use.
    pub fn cache_enabled(&self) -> bool {
        self.cache.capacity() > 0
    }

    /// Apply the negotiation's part of autotuned values: the cache on or off. A cache turned off forgets its
    /// entries and this rank's pending hits go to the coordinator instead; one turned on starts empty, as at
    /// start-up. Every rank does this at the same round, so caches agree.
    fn apply(&mut self, values: &TunedValues, table: &mut impl PendingRequests) {
        if values.cache_enabled == self.cache_enabled() {
            return;
        }
        let capacity = if values.cache_enabled { self.cache_capacity } else { 0 };
        self.cache = ResponseCache::new(capacity);
        table.for_each(|_, announcement| {
            if let Announcement::CacheHit(_) = *announcement {
                *announcement = Announcement::Unsent;
            }
        });
    }

    /// The cache bit of a tensor `name` submitted with `params` when a round announcing that hit alone would
    /// be decided without the coordinator (see `engine::fast_lane`): the cache serves it, and this rank has
    /// nothing else to say in a round (no autotuned values to announce, no queued errors, no requests the
    /// coordinator holds for other ranks). `None` otherwise.
    pub fn steady_hit(&self, name: &str, params: &OpParams) -> Option<usize> {
        let quiet = self.announcement.is_none() && self.coordinator.as_ref().map_or(true, |c| !c.has_pending());
        if self.tree || !quiet || self.wants_round() || !caches_kind(params.kind) {
            return None;
        }
        match self.cache.lookup_params(name, params) {
            CacheLookup::Hit(bit) => Some(bit),
            CacheLookup::Invalid(_) | CacheLookup::Miss => None,
        }
    }

    /// Record a round that ran only the steady hit at `bit` (every rank announced it and nothing else), as
    /// [`decide`](Self::decide) records it: the hit is the cache's most recent entry.
    pub fn ran_steady_hit(&mut self, bit: usize) {
        self.cache.touch(bit);
    }

    /// Whether this rank should start a round even without new work (queued stall errors).
    pub fn wants_round(&self) -> bool {
        self.coordinator.as_ref().is_some_and(MessageTable::has_queued)
    }

    /// Run one round. `shutdown` asks every rank to stop after it.
    pub fn round(
        &mut self,
        t: &mut dyn Transport,
        table: &mut impl PendingRequests,
        shutdown: Option<StopReason>,
    ) -> Result<RoundOutcome, TransportError> {
        let mut header = self.local_header(table, shutdown);
        header.tuned = self.announcement.take();
        if !self.tree {
            let headers = exchange_headers(t, header)?;
            return self.decide(t, table, headers);
        }
        let now = Instant::now();
        self.announced.retain(|bit, _| header.cache_hits.contains(*bit));
        for bit in header.cache_hits.iter_ones() {
            self.announced.entry(bit).or_insert(now);
        }
        let mut own = RoundSummary::of(t.rank(), &header);
        own.ages = self.age_to_send.take().map(|age| Ages::of(t.rank(), micros(age)));
        let summary = tree::combine_summaries(t, own)?;
        self.settle(t, table, summary, Seen::Own(header.cache_hits))
    }

    /// The rest of a round once every rank's header is in (`headers[r]` from communicator rank `r`, this
    /// rank's own among them): the verdict on cache hits and invalid bits, the slow path if any rank needs
    /// it, autotuned values. The same headers give the same verdict on every rank.
    pub fn decide(
        &mut self,
        t: &mut dyn Transport,
        table: &mut impl PendingRequests,
        headers: Vec<RoundHeader>,
    ) -> Result<RoundOutcome, TransportError> {
        let summary = RoundSummary::of_all(&headers);
        self.settle(t, table, summary, Seen::Every(headers))
    }

    /// The verdict of a round from the `summary` of every rank's header, and what this rank `seen` of them.
    fn settle(
        &mut self,
        t: &mut dyn Transport,
        table: &mut impl PendingRequests,
        summary: RoundSummary,
        seen: Seen,
    ) -> Result<RoundOutcome, TransportError> {
        let shutdown_by: Vec<(usize, StopReason)> =
            summary.shutdown_by.iter().map(|&(rank, why)| (rank as usize, why)).collect();
        let any_shutdown = !shutdown_by.is_empty();
        let any_uncached = summary.has_uncached;
        let mut invalid = summary.invalid.clone();
        let common = summary.common_hits();
        if summary.joined > 0 {
            // Only allreduce runs while ranks have joined: a cached hit of another kind goes back to the
            // coordinator, which fails it at once on every active rank (a joined rank cannot take part).
            for bit in common.iter_ones() {
                if self.cache.get(bit).is_some_and(|cached| cached.kind != CollectiveKind::Allreduce) {
                    invalid.insert(bit);
                }
            }
        }

        // Invalid entries are erased everywhere; local hits on them go the slow way this same round.
        for bit in invalid.iter_ones() {
            self.cache.erase(bit);
        }
        if !invalid.is_empty() {
            table.for_each(|_, announcement| {
                if let Announcement::CacheHit(bit) = *announcement {
                    if invalid.contains(bit) {
                        *announcement = Announcement::Unsent;
                    }
                }
            });
        }

        let ready: BitSet = common.iter_ones().filter(|b| !invalid.contains(*b)).collect();
        // On a tree a rank sees only the summary of every header: the last rank of the previous decision, and
        // its own age for this one, sent with the next round's summary.
        let headers = match &seen {
            Seen::Every(headers) => headers.as_slice(),
            Seen::Own(_) => &[],
        };
        let stragglers = if headers.is_empty() {
            let now = Instant::now();
            self.age_to_send = ready
                .iter_ones()
                .filter_map(|bit| self.announced.remove(&bit))
                .map(|at| now.saturating_duration_since(at))
                .min(); // none on a joined rank: it announces nothing that runs
            for bit in invalid.iter_ones() {
                self.announced.remove(&bit);
            }
            let mut lateness = self.lateness.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            match summary.ages {
                Some(ages) => lateness.note_last(
                    now,
                    ages.youngest_rank as usize,
                    Duration::from_micros(ages.oldest_us.saturating_sub(ages.youngest_us)),
                ),
                None => Vec::new(),
            }
        } else {
            let hits: Vec<Option<&BitSet>> = headers.iter().map(|h| (!h.joined).then_some(&h.cache_hits)).collect();
            let mut lateness = self.lateness.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            lateness.note_round(Instant::now(), &hits, &ready, &invalid)
        };
        let mut responses = Vec::new();
        let mut eager = Vec::new();
        for bit in ready.iter_ones() {
            if let Some(cached) = self.cache.get(bit) {
                let contributions =
                    if headers.is_empty() { None } else { eager_contributions(headers, bit, cached, self.eager_limit) };
                match contributions {
                    Some(contributions) => eager.push(EagerOp { response: cached.clone(), contributions }),
                    None => responses.push(cached.clone()),
                }
                self.cache.touch(bit);
            }
        }

        let cache_hits = eager.len() + responses.len();
        let slow = any_uncached || !invalid.is_empty();
        // On a tree each rank's waiting hits travel with its requests (see `slow_path`), and a coordinator
        // with pending requests always asks for the slow path (see `local_header`).
        let coordinator = self.coordinator.as_mut().filter(|c| !headers.is_empty() && (slow || c.has_pending()));
        if let Some(coordinator) = coordinator {
            // Hits that wait for other ranks, so the coordinator sees the whole picture of each name (a rank
            // waiting on a cached `allreduce.x` while another submitted `allgather.x`).
            let mut waits = Vec::new();
            for (rank, h) in headers.iter().enumerate() {
                for bit in h.cache_hits.iter_ones().filter(|b| !common.contains(*b) && !invalid.contains(*b)) {
                    if let Some(cached) = self.cache.get(bit) {
                        waits.push((rank as u32, cached.clone()));
                    }
                }
            }
            if slow {
                coordinator.note_cached_waits(waits);
            } else {
                coordinator.note_waits_between_rounds(waits);
            }
        }
        let mut received = Vec::new();
        let mut cache_misses = 0;
        if slow {
            let waiting = match &seen {
                Seen::Every(_) => BitSet::new(),
                Seen::Own(hits) => hits.iter_ones().filter(|b| !common.contains(*b) && !invalid.contains(*b)).collect(),
            };
            let new_responses;
            (new_responses, received) = self.slow_path(t, table, any_shutdown, waiting)?;
            for response in &new_responses {
                self.cache.put(response, |name| table.request(name).map(|request| request.params.clone()));
            }
            // A put may have evicted an entry whose bit a pending hit of ours still announces (and may even
            // have given that bit to another tensor): such hits go back to being looked up afresh.
            let cache = &self.cache;
            table.for_each(|entry, announcement| {
                if let Announcement::CacheHit(bit) = *announcement {
                    let cached_name = cache.get(bit).and_then(|r| r.entries.first()).map(|e| e.name.as_str());
                    if cached_name != Some(entry.request().name.as_str()) {
                        *announcement = Announcement::Unsent;
                    }
                }
            });
            cache_misses = new_responses.len();
            responses.extend(new_responses);
        }

        // Only the coordinator announces values; every rank sees them in the summary.
        let tuned = summary.tuned;
        if let Some(values) = &tuned {
            self.apply(values, table);
        }
        Ok(RoundOutcome { eager, responses, shutdown_by, tuned, received, stragglers, cache_hits, cache_misses })
    }

    /// This rank's header: classify new requests against the cache and collect hits and invalid bits.
    fn local_header(&mut self, table: &mut impl PendingRequests, shutdown: Option<StopReason>) -> RoundHeader {
        let mut header = RoundHeader { shutdown, joined: table.has_join(), ..RoundHeader::default() };
        let cache = &self.cache;
        let use_cache = cache.capacity() > 0;
        let stall_deadline = self.stall_check.and_then(|d| Instant::now().checked_sub(d));
        // On a tree the coordinator sees the other ranks' waiting hits only on the slow path, so it asks for
        // that path while it holds requests.
        let forced = self.wants_round() || (self.tree && self.coordinator.as_ref().is_some_and(|c| c.has_pending()));
        let mut eager_bytes = 0;
        let eager_limit = self.eager_limit;
        table.for_each(|entry, announcement| {
            if *announcement == Announcement::Unsent && use_cache && caches_kind(entry.request().params.kind) {
                match cache.lookup(entry.request()) {
                    CacheLookup::Hit(bit) => *announcement = Announcement::CacheHit(bit),
                    CacheLookup::Invalid(bit) => header.invalid.insert(bit),
                    CacheLookup::Miss => {}
                }
            }
            match *announcement {
                Announcement::CacheHit(bit) => {
                    // A hit waiting longer than the stall time is invalidated so the coordinator sees it.
                    if stall_deadline.is_some_and(|deadline| entry.submitted() < deadline) {
                        header.invalid.insert(bit);
                    } else {
                        header.cache_hits.insert(bit);
                        let len = entry.contribution_len();
                        let request = entry.request();
                        // A GPU tensor's data is read by the executor only, in stream order: it never rides.
                        if request.params.device == CPU_DEVICE
                            && rides_in_header(
                                request.params.kind,
                                request.params.reduce_op,
                                request.params.compression,
                                len,
                                eager_limit,
                            )
                            && eager_bytes + len <= EAGER_HEADER_BYTES
                        {
                            eager_bytes += len;
                            let mut data = vec![0u8; len];
                            entry.copy_contribution(&mut data);
                            header.eager.push(EagerPayload { bit: bit as u64, data });
                        }
                    }
                }
                Announcement::Unsent => header.has_uncached = true,
                Announcement::SentToCoordinator => {}
            }
        });
        header.has_uncached |= forced;
        header
    }

    /// Workers send their uncached requests to the coordinator, which answers everyone. Returns the
    /// responses and, on the coordinator, the request lists it received (see [`RoundOutcome::received`]).
    /// On a tree, `waiting` (this rank's cache hits not every rank hit) travels with the requests.
    fn slow_path(
        &mut self,
        t: &mut dyn Transport,
        table: &mut impl PendingRequests,
        shutdown: bool,
        waiting: BitSet,
    ) -> Result<(Vec<Response>, ReceivedLists), TransportError> {
        let (me, n) = (t.rank(), t.size());
        let mut mine = RequestList::default();
        table.for_each(|entry, announcement| {
            if *announcement == Announcement::Unsent {
                *announcement = Announcement::SentToCoordinator;
                mine.requests.push(entry.request().clone());
                mine.waited_ms.push(i64::try_from(entry.submitted().elapsed().as_millis()).unwrap_or(i64::MAX));
            }
        });
        if self.tree {
            return self.slow_path_on_tree(t, mine, waiting, shutdown);
        }
        match self.coordinator.as_mut() {
            Some(coordinator) => {
                let mut received = Vec::with_capacity(n);
                add_requests(coordinator, me, me, &mine)?;
                received.push((me, mine));
                for peer in (0..n).filter(|&p| p != me) {
                    let list = recv_message::<RequestList>(t, peer)?;
                    add_requests(coordinator, peer, peer, &list)?;
                    received.push((peer, list));
                }
                let decision = ResponseList { responses: coordinator.ready_responses(), shutdown };
                let bytes = decision.to_bytes();
                for peer in (0..n).filter(|&p| p != me) {
                    send_message(t, peer, &bytes)?;
                }
                Ok((decision.responses, received))
            }
            None => {
                send_message(t, 0, &mine.to_bytes())?;
                let decision = recv_message::<ResponseList>(t, 0)?;
                Ok((decision.responses, Vec::new()))
            }
        }
    }

    /// [`slow_path`](Self::slow_path) along trees: request lists gathered up a binomial tree to the
    /// coordinator, its response list broadcast down it.
    fn slow_path_on_tree(
        &mut self,
        t: &mut dyn Transport,
        mine: RequestList,
        waiting: BitSet,
        shutdown: bool,
    ) -> Result<(Vec<Response>, ReceivedLists), TransportError> {
        let me = t.rank();
        let lists = tree::gather_to_root(t, RankRequests { rank: me as u32, list: mine, waiting_hits: waiting })?;
        let cache = &self.cache;
        let Some(coordinator) = self.coordinator.as_mut() else {
            let lowest = me & me.wrapping_neg();
            let body = tree::broadcast_from_root(t, Vec::new())?;
            let decision: ResponseList = decode_message(me - lowest, &body)?;
            return Ok((decision.responses, Vec::new()));
        };
        let waits = lists.iter().flat_map(|(_, list)| {
            list.waiting_hits
                .iter_ones()
                .filter_map(move |bit| cache.get(bit).map(|cached| (list.rank, cached.clone())))
        });
        coordinator.note_cached_waits(waits.collect());
        let mut received = Vec::with_capacity(lists.len());
        for (peer, list) in lists {
            add_requests(coordinator, peer, list.rank as usize, &list.list)?;
            received.push((list.rank as usize, list.list));
        }
        let decision = ResponseList { responses: coordinator.ready_responses(), shutdown };
        tree::broadcast_from_root(t, decision.to_bytes())?;
        Ok((decision.responses, received))
    }
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

/// Give the coordinator `rank`'s request `list`, which came through `peer`; a request claiming another
/// rank is a protocol error naming the peer.
fn add_requests(
    coordinator: &mut MessageTable,
    peer: usize,
    rank: usize,
    list: &RequestList,
) -> Result<(), TransportError> {
    for (i, request) in list.requests.iter().enumerate() {
        if request.rank as usize != rank {
            return Err(TransportError::Protocol {
                peer,
                detail: format!(
                    "a request in rank {rank}'s list says it comes from position {} of the communicator",
                    request.rank
                ),
            });
        }
        let waited_ms = list.waited_ms.get(i).copied().unwrap_or(0).clamp(0, 1 << 40) as u64;
        coordinator.add_waited(request.clone(), Duration::from_millis(waited_ms));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::coordinator::test_requests::{allreduce_request, changed, FakeEntry, FakeTable};
    use crate::error::ErrorKind;
    use crate::transport::memory::{run_ranks, MemoryTransport};

    fn negotiator(rank: usize, size: usize) -> Negotiator {
        Negotiator::new(rank, (0..size).collect(), 16, None, Negotiation::AllToAll)
    }

    fn negotiator_on_tree(rank: usize, size: usize) -> Negotiator {
        Negotiator::new(rank, (0..size).collect(), 16, None, Negotiation::Tree)
    }

    fn names(responses: &[Response]) -> Vec<String> {
        responses.iter().flat_map(|r| r.entries.iter().map(|e| e.name.clone())).collect()
    }

    /// Submit `name` on this rank (`submit` puts it in the table), run a round, complete it, submit it again
    /// and run another: the first goes to the coordinator, which decides for everybody; the second is a cache
    /// hit on every rank, small enough to travel in the headers. Returns the second round's outcome.
    fn submitted_twice(t: &mut dyn Transport, name: &str, submit: impl Fn(&mut FakeTable)) -> RoundOutcome {
        let rank = t.rank();
        let mut negotiator = negotiator(rank, t.size());
        let mut table = FakeTable::default();
        submit(&mut table);
        let first = negotiator.round(t, &mut table, None).unwrap();
        assert_eq!(names(&first.responses), [name], "rank {rank}");
        assert!(first.eager.is_empty() && first.shutdown_by.is_empty());
        assert_eq!(table.entries[0].1, Announcement::SentToCoordinator);
        table.complete(name);
        submit(&mut table);
        let second = negotiator.round(t, &mut table, None).unwrap();
        assert!(second.responses.is_empty(), "rank {rank}: cached, so nothing for the coordinator");
        assert!(matches!(table.entries[0].1, Announcement::CacheHit(_)));
        assert_eq!(second.eager.len(), 1, "rank {rank}");
        second
    }

    #[test]
    fn a_round_agrees_on_every_rank_then_the_cache_skips_the_coordinator() {
        let outcomes = run_ranks(MemoryTransport::mesh(3), |t| {
            let rank = t.rank();
            let second = submitted_twice(t, "grad", |table| table.submit(rank, "grad", 2, rank as u8 + 1));
            second.eager[0].contributions.clone()
        });
        let expected: Vec<Option<Vec<u8>>> = (1..=3u8).map(|fill| Some(vec![fill; 8])).collect();
        for contributions in outcomes {
            assert_eq!(contributions, expected, "every rank holds every contribution, in rank order");
        }
    }

    #[test]
    fn a_cached_allgather_rides_in_headers_with_each_ranks_rows() {
        let outcomes = run_ranks(MemoryTransport::mesh(3), |t| {
            let rank = t.rank();
            // Rank r gathers r + 1 rows of two float32 values, each byte set to r + 1.
            let second = submitted_twice(t, "rows", |table| {
                let rows = rank as i64 + 1;
                let request = changed(allreduce_request(rank as u32, "rows", &[rows, 2]), |p| {
                    p.kind = CollectiveKind::Allgather;
                });
                let data = vec![rank as u8 + 1; rows as usize * 8];
                table.entries.push((FakeEntry { request, submitted: Instant::now(), data }, Announcement::Unsent));
            });
            let spec = &second.eager[0].response.entries[0];
            assert_eq!(spec.allgather_shape(), [6, 2], "rank {rank}");
            second.eager[0].contributions.clone()
        });
        let expected: Vec<Option<Vec<u8>>> = (0..3u8).map(|r| Some(vec![r + 1; (r as usize + 1) * 8])).collect();
        for contributions in outcomes {
            assert_eq!(contributions, expected, "every rank holds every rank's rows, in rank order");
        }
    }

    #[test]
    fn the_coordinators_tuned_values_apply_on_every_rank_when_the_round_ends() {
        let tuned = TunedValues {
            fusion_threshold: 4096,
            cycle_time: Duration::from_micros(2500),
            cache_enabled: false,
            hierarchical_allreduce: Some(true),
            hierarchical_allgather: None,
        };
        let outcomes = run_ranks(MemoryTransport::mesh(3), |t| {
            let rank = t.rank();
            let mut negotiator = negotiator(rank, 3);
            let mut table = FakeTable::default();
            table.submit(rank, "grad", 2, 1);
            negotiator.round(t, &mut table, None).unwrap();
            table.complete("grad");
            // "grad" is cached now; rank 0 announces values with the next round, whose hit still runs eagerly
            // under the old values (a worker's announcement is ignored).
            negotiator.announce(TunedValues { fusion_threshold: 7, ..tuned.clone() });
            if rank == 0 {
                negotiator.announce(tuned.clone());
            }
            table.submit(rank, "grad", 2, 1);
            let announced = negotiator.round(t, &mut table, None).unwrap();
            assert_eq!(announced.eager.len(), 1, "rank {rank}: the cache served this round");
            assert!(!negotiator.cache_enabled(), "rank {rank}");
            table.complete("grad");
            // With the cache off, the same tensor goes to the coordinator again.
            table.submit(rank, "grad", 2, 1);
            let after = negotiator.round(t, &mut table, None).unwrap();
            assert!(after.eager.is_empty() && after.tuned.is_none(), "rank {rank}");
            assert_eq!(names(&after.responses), ["grad"]);
            assert_eq!(table.entries[0].1, Announcement::SentToCoordinator);
            announced.tuned
        });
        for got in outcomes {
            assert_eq!(got.as_ref(), Some(&tuned), "every rank got rank 0's values in the same round");
        }
    }

    #[test]
    fn a_tensor_waits_for_the_last_rank_and_a_mismatch_fails_on_every_rank() {
        let outcomes = run_ranks(MemoryTransport::mesh(2), |t| {
            let rank = t.rank();
            let mut negotiator = negotiator(rank, 2);
            let mut table = FakeTable::default();
            if rank == 0 {
                table.submit(rank, "late", 4, 0);
            }
            let waiting = negotiator.round(t, &mut table, None).unwrap();
            assert!(waiting.responses.is_empty(), "rank {rank}: rank 1 has not submitted 'late' yet");
            if rank == 1 {
                table.submit(rank, "late", 4, 0);
            }
            // Rank 0 asks for shape [3] and rank 1 for [5] under one name.
            table.submit(rank, "shapes", 3 + 2 * rank as i64, 0);
            let decided = negotiator.round(t, &mut table, None).unwrap();
            let mut by_name: Vec<(String, Option<(ErrorKind, String)>)> =
                decided.responses.iter().map(|r| (r.entries[0].name.clone(), r.error.clone())).collect();
            by_name.sort_by(|a, b| a.0.cmp(&b.0));
            by_name
        });
        assert_eq!(outcomes[0], outcomes[1], "both ranks decide the same");
        let [(late, late_error), (shapes, shapes_error)] = &outcomes[0][..] else {
            panic!("expected two responses: {:?}", outcomes[0]);
        };
        assert_eq!((late.as_str(), late_error), ("late", &None));
        assert_eq!(shapes, "shapes");
        let (kind, message) = shapes_error.as_ref().expect("a mismatch is an error");
        assert_eq!(*kind, ErrorKind::Mismatch);
        assert!(message.contains("rank 0 sent [3]") && message.contains("rank 1 sent [5]"), "{message}");
    }

    #[test]
    fn an_allgather_whose_rows_no_rank_could_hold_fails_on_every_rank_naming_the_claimant() {
        let outcomes = run_ranks(MemoryTransport::mesh(3), |t| {
            let rank = t.rank();
            let mut negotiator = negotiator(rank, 3);
            let mut table = FakeTable::default();
            // Rank 2 claims 2^42 rows of two float32 values (32 TiB); the others have 1 row each.
            let rows = if rank == 2 { 1 << 42 } else { 1 };
            let request = changed(allreduce_request(rank as u32, "rows", &[rows, 2]), |p| {
                p.kind = CollectiveKind::Allgather;
            });
            table
                .entries
                .push((FakeEntry { request, submitted: Instant::now(), data: vec![0; 8] }, Announcement::Unsent));
            let decided = negotiator.round(t, &mut table, None).unwrap();
            decided.responses.iter().map(|r| (r.entries[0].name.clone(), r.error.clone())).collect::<Vec<_>>()
        });
        assert!(outcomes.iter().all(|o| *o == outcomes[0]), "every rank decides the same: {outcomes:?}");
        let [(name, Some((kind, message)))] = &outcomes[0][..] else { panic!("one refused response: {outcomes:?}") };
        assert_eq!((name.as_str(), *kind), ("rows", ErrorKind::Invalid));
        assert!(message.starts_with("Allgather of tensor 'rows': rank 2 sent 4398046511104 rows"), "{message}");
    }

    /// On a tree each rank learns, a round later, which rank announced last and by how much: rank 6 of 9,
    /// which submits each step's tensor a round after the others (8 ms later), is named on every rank.
    #[test]
    fn on_a_tree_the_rank_that_announces_last_is_named_the_straggler() {
        let (n, late_rank) = (9, 6);
        let named = run_ranks(MemoryTransport::mesh(n), |t| {
            let rank = t.rank();
            let mut negotiator = negotiator_on_tree(rank, n);
            let mut table = FakeTable::default();
            table.submit(rank, "grad", 2, 1);
            negotiator.round(t, &mut table, None).unwrap();
            table.complete("grad");
            let mut changes = Vec::new();
            for _ in 0..lateness_window_rounds() {
                if rank != late_rank {
                    table.submit(rank, "grad", 2, 1);
                }
                let waiting = negotiator.round(t, &mut table, None).unwrap();
                assert!(waiting.responses.is_empty(), "rank {rank}: rank {late_rank} has not announced it");
                changes.extend(waiting.stragglers);
                std::thread::sleep(Duration::from_millis(8));
                if rank == late_rank {
                    table.submit(rank, "grad", 2, 1);
                }
                let ran = negotiator.round(t, &mut table, None).unwrap();
                assert_eq!(names(&ran.responses), ["grad"], "rank {rank}");
                changes.extend(ran.stragglers);
                table.complete("grad");
            }
            let report = negotiator.lateness.lock().unwrap().report().to_vec();
            (changes, report)
        });
        for (rank, (changes, report)) in named.iter().enumerate() {
            let named: Vec<usize> = changes.iter().filter(|c| c.named).map(|c| c.rank).collect();
            assert_eq!(named, [late_rank], "rank {rank}: {changes:?}");
            assert!(report[late_rank].times_last >= 8, "rank {rank}: {report:?}");
            assert!(report[late_rank].mean_lateness() >= Duration::from_millis(5), "rank {rank}: {report:?}");
            assert!(report.iter().enumerate().all(|(r, l)| r == late_rank || l.times_last <= 1), "{report:?}");
        }
    }

    /// Enough decisions for the straggler window, and one more (a tree learns of a decision a round late).
    fn lateness_window_rounds() -> usize {
        crate::coordinator::lateness::WINDOW + 2
    }

    #[test]
    fn a_shutdown_request_reaches_every_rank() {
        let outcomes = run_ranks(MemoryTransport::mesh(3), |t| {
            let rank = t.rank();
            let stop = (rank == 2).then_some(StopReason::Shutdown);
            negotiator(rank, 3).round(t, &mut FakeTable::default(), stop).unwrap().shutdown_by
        });
        for shutdown_by in outcomes {
            assert_eq!(shutdown_by, [(2, StopReason::Shutdown)]);
        }
    }

    /// On a tree (any size, beyond a power of two too) a round decides what the all-to-all round decides:
    /// the coordinator answers new requests, the cache serves them next time without it (no data rides),
    /// a hit waits for the last rank, a mismatch fails on every rank naming the rank, rank 0's tuned values
    /// and a stop reach everyone.
    #[test]
    fn on_a_tree_rounds_reach_the_all_to_all_verdicts() {
        let tuned = TunedValues {
            fusion_threshold: 4096,
            cycle_time: Duration::from_micros(2500),
            cache_enabled: true,
            hierarchical_allreduce: None,
            hierarchical_allgather: Some(false),
        };
        for n in [2, 5, 8, 11] {
            let outcomes = run_ranks(MemoryTransport::mesh(n), |t| {
                let (rank, last) = (t.rank(), n - 1);
                let mut negotiator = negotiator_on_tree(rank, n);
                assert!(negotiator.negotiates_on_trees() && negotiator.eager_limit() == 0);
                let mut table = FakeTable::default();
                table.submit(rank, "grad", 2, 1);
                let first = negotiator.round(t, &mut table, None).unwrap();
                assert_eq!((names(&first.responses), first.cache_misses), (vec!["grad".to_string()], 1));
                table.complete("grad");

                // Cached now: every rank but the last hits it; the last also has a mismatched tensor.
                if rank == 0 {
                    negotiator.announce(tuned.clone());
                }
                if rank != last {
                    table.submit(rank, "grad", 2, 1);
                }
                table.submit(rank, "shapes", 3 + (rank == last) as i64, 0);
                let second = negotiator.round(t, &mut table, None).unwrap();
                assert_eq!(second.tuned.as_ref(), Some(&tuned), "rank {rank}");
                let errors: Vec<(String, bool)> =
                    second.responses.iter().map(|r| (r.entries[0].name.clone(), r.error.is_some())).collect();
                assert_eq!(errors, [("shapes".to_string(), true)], "rank {rank}: grad waits for rank {last}");
                let message = second.responses[0].error.as_ref().map(|e| e.1.clone()).unwrap_or_default();
                table.complete("shapes");

                if rank == last {
                    table.submit(rank, "grad", 2, 1);
                }
                let stop = (rank == 1).then_some(StopReason::Exiting);
                let third = negotiator.round(t, &mut table, stop).unwrap();
                assert!(third.eager.is_empty(), "nothing rides on a tree");
                assert_eq!((names(&third.responses), third.cache_hits), (vec!["grad".to_string()], 1), "rank {rank}");
                (message, third.shutdown_by)
            });
            for (message, shutdown_by) in &outcomes {
                assert!(message.contains(&format!("rank {} sent [4]", n - 1)), "n={n}: {message}");
                assert_eq!(shutdown_by, &[(1, StopReason::Exiting)], "n={n}");
            }
        }
    }

    #[test]
    fn eager_data_gives_way_as_ranks_grow() {
        assert_eq!(eager_limit(2, false), EAGER_TENSOR_BYTES);
        assert_eq!(eager_limit(4, false), EAGER_TENSOR_BYTES);
        assert_eq!(eager_limit(8, false), EAGER_SENT_BYTES / 7);
        assert_eq!(eager_limit(1, false), EAGER_TENSOR_BYTES);
        assert_eq!(eager_limit(64, false), EAGER_SENT_BYTES / 63);
        assert_eq!(eager_limit(4, true), 0);
    }

    fn header(joined: bool, eager: &[(u64, &[u8])]) -> RoundHeader {
        RoundHeader {
            joined,
            eager: eager.iter().map(|(bit, data)| EagerPayload { bit: *bit, data: data.to_vec() }).collect(),
            ..RoundHeader::default()
        }
    }

    /// A cached response for a tensor of `bytes` uint8 values; for an allgather, `rows` are every rank's.
    fn cached(kind: CollectiveKind, bytes: i64, rows: &[i64]) -> Response {
        let mut response = Response::for_one_tensor(kind, "t", crate::types::DataType::Uint8, bytes);
        response.entries[0].per_rank = rows.to_vec();
        response
    }

    #[test]
    fn eager_only_when_every_active_rank_sent_the_right_size() {
        let allreduce = |bytes| cached(CollectiveKind::Allreduce, bytes, &[]);
        let all = [header(false, &[(3, &[1, 2])]), header(false, &[(1, &[9]), (3, &[3, 4])])];
        assert_eq!(
            eager_contributions(&all, 3, &allreduce(2), EAGER_TENSOR_BYTES),
            Some(vec![Some(vec![1, 2]), Some(vec![3, 4])])
        );
        assert_eq!(eager_contributions(&all, 1, &allreduce(1), EAGER_TENSOR_BYTES), None, "rank 0 did not send bit 1");
        assert_eq!(eager_contributions(&all, 3, &allreduce(4), EAGER_TENSOR_BYTES), None, "wrong size");
        let with_joined = [header(false, &[(3, &[1, 2])]), header(true, &[])];
        assert_eq!(
            eager_contributions(&with_joined, 3, &allreduce(2), EAGER_TENSOR_BYTES),
            Some(vec![Some(vec![1, 2]), None])
        );
        let on_gpu = Response { on_gpu: true, ..allreduce(2) };
        assert_eq!(
            eager_contributions(&with_joined, 3, &on_gpu, EAGER_TENSOR_BYTES),
            None,
            "a GPU tensor runs on its GPU route"
        );
        let too_large = vec![0; EAGER_TENSOR_BYTES + 1];
        let large = [header(false, &[(3, &too_large)]), header(false, &[(3, &too_large)])];
        assert_eq!(
            eager_contributions(&large, 3, &allreduce(too_large.len() as i64), EAGER_TENSOR_BYTES),
            None,
            "too large to ride"
        );
    }

    #[test]
    fn an_eager_allgather_takes_each_ranks_rows_and_no_joined_rank() {
        // Rows of one byte (shape [rows]): rank 0 has one row, rank 1 two.
        let allgather = |rows: &[i64]| cached(CollectiveKind::Allgather, rows[0], rows);
        let all = [header(false, &[(3, &[1])]), header(false, &[(3, &[2, 3])])];
        assert_eq!(
            eager_contributions(&all, 3, &allgather(&[1, 2]), EAGER_TENSOR_BYTES),
            Some(vec![Some(vec![1]), Some(vec![2, 3])])
        );
        assert_eq!(
            eager_contributions(&all, 3, &allgather(&[2, 1]), EAGER_TENSOR_BYTES),
            None,
            "rows differ from the response's"
        );
        assert_eq!(eager_contributions(&all, 3, &allgather(&[1]), EAGER_TENSOR_BYTES), None, "one rank's rows missing");
        let with_joined = [header(false, &[(3, &[1])]), header(true, &[])];
        assert_eq!(
            eager_contributions(&with_joined, 3, &allgather(&[1, 0]), EAGER_TENSOR_BYTES),
            None,
            "a joined rank cannot gather"
        );
    }

    #[test]
    fn a_single_hit_frame_is_what_a_round_sends_for_that_header() {
        for (bit, data) in [(0, None), (5, Some(&[1u8, 2, 3][..])), (200, Some(&[][..])), (64, None)] {
            let reused = vec![9u8; 300];
            let frame = frame_single_hit(reused, bit, data);
            assert_eq!(frame, framed(&RoundHeader::single_hit(bit, data).to_bytes()), "bit {bit}");
        }
    }

    /// Frames received whole where their length has arrived (one read, see `recv_body`) or in two reads,
    /// with their lengths split across the shared-memory ring's wrap on the way: every body comes out right.
    #[test]
    fn frames_come_out_whole_however_they_lie_in_the_ring() {
        use crate::transport::shm::ShmTransport;
        let dir = std::env::temp_dir();
        let mesh = ShmTransport::local_mesh(2, 0, &dir, Duration::from_secs(20)).unwrap();
        // 524 frames of 2,000 bytes and one of 574 end 2 bytes short of the ring's 1 MiB: the next frame's
        // length is split by the wrap. Then frames of odd sizes wrap the ring at other places.
        let capacity = crate::transport::shm::layout::channel_capacity(2);
        assert_eq!(524 * 2000 + 574, capacity - 2);
        let lengths: Vec<usize> =
            [1996; 524].into_iter().chain([570]).chain((0..3000).map(|i| (i * 7919) % 1999 + 1)).collect();
        let body_of = |i: usize| -> Vec<u8> { (0..lengths[i]).map(|j| (i * 31 + j) as u8).collect() };
        let received = run_ranks(mesh, |t| {
            let mut got = Vec::new();
            if t.rank() == 0 {
                for i in 0..lengths.len() {
                    send_message(t, 1, &body_of(i)).unwrap();
                }
            } else {
                let mut body = Vec::new();
                for i in 0..lengths.len() {
                    if i % 500 == 0 || i == 525 {
                        std::thread::sleep(Duration::from_millis(5)); // let frames pile up: they are peeked
                    }
                    recv_body(t, 0, &mut body).unwrap();
                    got.push(body.clone());
                }
            }
            got
        });
        assert_eq!(received[1].len(), lengths.len());
        for (i, body) in received[1].iter().enumerate() {
            assert!(body == &body_of(i), "frame {i} of {} bytes came out wrong", lengths[i]);
        }
    }

    #[test]
    fn small_allreduces_broadcasts_and_allgathers_ride_in_headers() {
        assert!(rides_in_header(
            CollectiveKind::Allreduce,
            ReduceOp::Sum,
            Compression::None,
            EAGER_TENSOR_BYTES,
            EAGER_TENSOR_BYTES
        ));
        assert!(rides_in_header(CollectiveKind::Broadcast, ReduceOp::Sum, Compression::None, 8, EAGER_TENSOR_BYTES));
        assert!(!rides_in_header(
            CollectiveKind::Allreduce,
            ReduceOp::Sum,
            Compression::None,
            EAGER_TENSOR_BYTES + 1,
            EAGER_TENSOR_BYTES
        ));
        assert!(!rides_in_header(
            CollectiveKind::Broadcast,
            ReduceOp::Sum,
            Compression::None,
            EAGER_TENSOR_BYTES + 1,
            EAGER_TENSOR_BYTES
        ));
        assert!(
            !rides_in_header(CollectiveKind::Allreduce, ReduceOp::Adasum, Compression::None, 4, EAGER_TENSOR_BYTES),
            "Adasum runs its tree"
        );
        assert!(
            !rides_in_header(CollectiveKind::Allreduce, ReduceOp::Sum, Compression::Int8, 4, EAGER_TENSOR_BYTES),
            "compressed"
        );
        assert!(rides_in_header(
            CollectiveKind::Allgather,
            ReduceOp::Sum,
            Compression::None,
            EAGER_TENSOR_BYTES,
            EAGER_TENSOR_BYTES
        ));
        assert!(!rides_in_header(
            CollectiveKind::Allgather,
            ReduceOp::Sum,
            Compression::None,
            EAGER_TENSOR_BYTES + 1,
            EAGER_TENSOR_BYTES
        ));
        assert!(!rides_in_header(
            CollectiveKind::Reducescatter,
            ReduceOp::Sum,
            Compression::None,
            4,
            EAGER_TENSOR_BYTES
        ));
        assert!(!rides_in_header(CollectiveKind::Barrier, ReduceOp::Sum, Compression::None, 0, EAGER_TENSOR_BYTES));
    }
}
