//! The coordinator's message table (kept by rank 0 of the communicator): requests gathered from every
//! rank until a tensor is ready everywhere, join bookkeeping, stall detection, and (elastic jobs) the ranks
//! judged hung.

use std::collections::{BTreeMap, BTreeSet};

use rustc_hash::FxHashMap as HashMap;
use std::time::{Duration, Instant};

use crate::coordinator::stall::{stall_warning, HungRank, MissingRanks, NAMES_PER_RANK};
use crate::coordinator::validate::{construct_response, describe};
use crate::error::ErrorKind;
use crate::protocol::message::{Request, Response, ResponseEntry};
use crate::types::{CollectiveKind, Compression, DataType, ReduceOp};

/// Name every rank's join request carries.
pub const JOIN_NAME: &str = "join.noname";
/// Name every rank's barrier request carries.
pub const BARRIER_NAME: &str = "barrier.noname";

struct PendingTensor {
    requests: BTreeMap<u32, Request>,
    first_seen: Instant,
    /// When the stall warning last named this tensor.
    warned_at: Option<Instant>,
}

pub struct MessageTable {
    size: usize,
    /// Global rank of each communicator rank, for messages.
    global_ranks: Vec<usize>,
    /// Tensors some ranks submitted, in order of first arrival.
    pending: BTreeMap<u64, String>,
    by_name: HashMap<String, (u64, PendingTensor)>,
    next_arrival: u64,
    joined: BTreeSet<u32>,
    last_joined: i32,
    /// Responses decided outside a round (stall time-outs), sent with the next one.
    queued: Vec<Response>,
    /// Cached responses ranks wait on this round (see `note_cached_waits`).
    cached_waits: Vec<(u32, Response)>,
    /// A conflict between a cached wait and a pending tensor was seen outside a slow path.
    recheck: bool,
}

impl MessageTable {
    pub fn new(global_ranks: Vec<usize>) -> MessageTable {
        MessageTable {
            size: global_ranks.len(),
            global_ranks,
            pending: BTreeMap::new(),
            by_name: HashMap::default(),
            next_arrival: 0,
            joined: BTreeSet::new(),
            last_joined: -1,
            queued: Vec::new(),
            cached_waits: Vec::new(),
            recheck: false,
        }
    }

    fn global(&self, rank: u32) -> u32 {
        self.global_ranks.get(rank as usize).map_or(rank, |&g| g as u32)
    }

    /// Record a request from `request.rank`, submitted just now.
    pub fn add(&mut self, request: Request) {
        self.add_waited(request, Duration::ZERO);
    }

    /// Record a request from `request.rank` that had already waited `waited` on its rank (stall times
    /// count from the first submission of a tensor on any rank).
    pub fn add_waited(&mut self, request: Request, waited: Duration) {
        let submitted = Instant::now().checked_sub(waited).unwrap_or_else(Instant::now);
        if request.params.kind == CollectiveKind::Join {
            self.joined.insert(request.rank);
            self.last_joined = request.rank as i32;
            return;
        }
        let name = request.name.clone();
        match self.by_name.get_mut(&name) {
            Some((_, pending)) => {
                pending.first_seen = pending.first_seen.min(submitted);
                pending.requests.insert(request.rank, request);
            }
            None => {
                let arrival = self.next_arrival;
                self.next_arrival += 1;
                self.pending.insert(arrival, name.clone());
                let mut requests = BTreeMap::new();
                requests.insert(request.rank, request);
                self.by_name
                    .insert(name, (arrival, PendingTensor { requests, first_seen: submitted, warned_at: None }));
            }
        }
    }

    /// Whether some tensors wait for ranks that have not submitted them.
    pub fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }

    /// Whether a round is needed even though no rank has new work: responses are waiting to be sent, or a
    /// conflict between names needs the slow path to be reported.
    pub fn has_queued(&self) -> bool {
        !self.queued.is_empty() || self.recheck
    }

    /// Responses for every tensor now submitted by all ranks (joined ranks count as submitted), in order
    /// of first arrival, then the join response once every rank has joined.
    pub fn ready_responses(&mut self) -> Vec<Response> {
        let mut out = std::mem::take(&mut self.queued);
        let ready: Vec<(u64, String)> = self
            .pending
            .iter()
            .filter(|(_, name)| {
                self.by_name.get(*name).is_some_and(|(_, p)| {
                    (0..self.size as u32).all(|r| p.requests.contains_key(&r) || self.joined.contains(&r))
                })
            })
            .map(|(a, n)| (*a, n.clone()))
            .collect();
        for (arrival, name) in ready {
            self.pending.remove(&arrival);
            if let Some((_, tensor)) = self.by_name.remove(&name) {
                let any_joined = tensor.requests.len() < self.size;
                let requests: Vec<Request> = tensor.requests.into_values().collect();
                out.push(construct_response(&requests, &self.global_ranks, any_joined));
            }
        }
        out.extend(self.different_ops_under_one_name());
        if self.size > 0 && self.joined.len() == self.size {
            out.push(join_response(self.last_joined));
            self.joined.clear();
            self.last_joined = -1;
        }
        out
    }

    /// Record which cached responses each rank is waiting on this round (its cache hits that not every
    /// rank shares yet): a rank waiting on a cached `allreduce.x` while another submits `allgather.x` is
    /// the same conflict as two fresh requests. Cleared by the next [`ready_responses`](Self::ready_responses).
    pub fn note_cached_waits(&mut self, waits: Vec<(u32, Response)>) {
        self.cached_waits = waits;
    }

    /// Between slow paths: remember the cached responses ranks wait on, and ask for a round (see
    /// [`wants_round`](Self::wants_round)) if they conflict with a pending tensor, so the conflict is
    /// reported now rather than at the stall time.
    pub fn note_waits_between_rounds(&mut self, waits: Vec<(u32, Response)>) {
        if !self.pending.is_empty() && !waits.is_empty() && !self.find_conflicts(&waits).1.is_empty() {
            self.cached_waits = waits;
            self.recheck = true;
        }
    }

    /// Which ranks claim each name (submitted it, or wait on it cached), and the keys whose names conflict.
    #[allow(clippy::type_complexity)]
    fn find_conflicts(
        &self,
        cached_waits: &[(u32, Response)],
    ) -> (BTreeMap<String, (Vec<u32>, CollectiveKind)>, Vec<(String, Vec<String>)>) {
        let mut claims: BTreeMap<String, (Vec<u32>, CollectiveKind)> = BTreeMap::new();
        for name in self.pending.values() {
            if let Some((_, tensor)) = self.by_name.get(name) {
                let kind = tensor.requests.values().next().map_or(CollectiveKind::Allreduce, |r| r.params.kind);
                claims.insert(name.clone(), (tensor.requests.keys().copied().collect(), kind));
            }
        }
        for (rank, cached) in cached_waits {
            if let Some(entry) = cached.entries.first() {
                let claim = claims.entry(entry.name.clone()).or_insert_with(|| (Vec::new(), cached.kind));
                if !claim.0.contains(rank) {
                    claim.0.push(*rank);
                }
            }
        }
        let mut by_key: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
        for name in claims.keys() {
            if let Some((_, key)) = name.split_once('.') {
                by_key.entry(key).or_default().push(name);
            }
        }
        let active: Vec<u32> = (0..self.size as u32).filter(|r| !self.joined.contains(r)).collect();
        let mut conflicts = Vec::new();
        for (key, names) in by_key.into_iter().filter(|(_, names)| names.len() > 1) {
            let mut seen: BTreeMap<u32, usize> = BTreeMap::new();
            for rank in names.iter().flat_map(|name| claims[*name].0.iter()) {
                *seen.entry(*rank).or_default() += 1;
            }
            if !active.is_empty() && active.iter().all(|r| seen.get(r) == Some(&1)) {
                conflicts.push((key.to_string(), names.iter().map(|n| n.to_string()).collect()));
            }
        }
        (claims, conflicts)
    }

    /// Tensors that can never complete because ranks called different ops under the same name: names are
    /// `<op>.<name>`, so `allreduce.x` on one rank and `allgather.x` on another would each wait forever for
    /// the other ranks. When every rank that has not joined submitted (or waits on a cached) exactly one of
    /// the ops under a name, all of them fail with a mismatch naming the ops (as in Horovod, where the name
    /// alone identifies a tensor). A rank that submits both is not in conflict, so that use still waits.
    fn different_ops_under_one_name(&mut self) -> Vec<Response> {
        let cached_waits = std::mem::take(&mut self.cached_waits);
        self.recheck = false;
        let (claims, conflicts) = self.find_conflicts(&cached_waits);
        let mut out = Vec::new();
        for (key, names) in conflicts {
            let mut sent: Vec<(usize, String)> = Vec::new();
            for name in &names {
                let (ranks, kind) = &claims[name];
                sent.extend(ranks.iter().map(|&r| (self.global(r) as usize, format!("{kind} ('{name}')"))));
            }
            sent.sort();
            let message = format!(
                "Mismatched operations for tensor '{key}': {}. Every rank must call the same collective under a name.",
                describe(&sent)
            );
            for name in &names {
                if let Some((arrival, tensor)) = self.by_name.remove(name) {
                    self.pending.remove(&arrival);
                    if let Some(first) = tensor.requests.into_values().next() {
                        out.push(mismatch_error(first, message.clone()));
                    }
                } else if let Some((_, cached)) =
                    cached_waits.iter().find(|(_, c)| c.entries.first().is_some_and(|e| &e.name == name))
                {
                    out.push(Response { error: Some((ErrorKind::Mismatch, message.clone())), ..cached.clone() });
                }
            }
        }
        out
    }

    /// Tensors pending longer than `warn_after`, by missing rank; those pending longer than `fail_after`
    /// are failed (queued as error responses for the next round). Returns the warning text, if any. Called
    /// often (about every second): a tensor is warned about when it first passes `warn_after`, then again
    /// every `warn_after`, so the warning comes on time without repeating every call.
    pub fn check_stalls(&mut self, now: Instant, warn_after: Duration, fail_after: Option<Duration>) -> Option<String> {
        let mut missing = MissingRanks::new();
        let mut stalled_out = BTreeSet::new();
        let mut to_fail = Vec::new();
        let mut longest = Duration::ZERO;
        for (arrival, name) in &self.pending {
            let Some((_, tensor)) = self.by_name.get_mut(name) else { continue };
            let waited = now.saturating_duration_since(tensor.first_seen);
            let failing = fail_after.is_some_and(|limit| waited >= limit);
            let warn_due = waited >= warn_after
                && tensor.warned_at.map_or(true, |at| now.saturating_duration_since(at) >= warn_after);
            if !warn_due && !failing {
                continue;
            }
            tensor.warned_at = Some(now);
            longest = longest.max(waited);
            for rank in 0..self.size as u32 {
                if !tensor.requests.contains_key(&rank) && !self.joined.contains(&rank) {
                    let global = self.global_ranks.get(rank as usize).map_or(rank, |&g| g as u32);
                    missing.entry(global).or_default().push(name.clone());
                    if failing {
                        stalled_out.insert(global);
                    }
                }
            }
            if failing {
                to_fail.push((*arrival, name.clone()));
            }
        }
        if missing.is_empty() && to_fail.is_empty() {
            return None;
        }
        let stalled: Vec<u32> = stalled_out.iter().copied().collect();
        let text = stall_warning(&missing, warn_after.min(longest), fail_after, &stalled);
        for (arrival, name) in to_fail {
            self.pending.remove(&arrival);
            if let Some((_, tensor)) = self.by_name.remove(&name) {
                let waiting_for: Vec<String> = (0..self.size as u32)
                    .filter(|r| !tensor.requests.contains_key(r))
                    .map(|r| self.global(r).to_string())
                    .collect();
                if let Some(first) = tensor.requests.into_values().next() {
                    let message = format!(
                        "{} of tensor '{}' stalled: ranks [{}] did not submit it within {:.0} s.",
                        first.params.kind,
                        first.name,
                        waiting_for.join(", "),
                        fail_after.map(|d| d.as_secs_f64()).unwrap_or_default()
                    );
                    self.queued.push(stall_error(first, message));
                }
            }
        }
        Some(text)
    }

    /// The ranks that made no progress for `after`: each is missing from a tensor other ranks submitted at
    /// least `after` ago, has not joined, and has no pending request of its own in this table (a rank that
    /// waits in a collective is held up, not hung; the hung rank is the one the others wait for). By global
    /// rank, with the longest wait and the tensors it holds up, oldest first.
    pub fn hung_ranks(&self, now: Instant, after: Duration) -> Vec<HungRank> {
        let waiting: BTreeSet<u32> =
            self.by_name.values().flat_map(|(_, tensor)| tensor.requests.keys().copied()).collect();
        let mut hung: BTreeMap<u32, HungRank> = BTreeMap::new();
        for name in self.pending.values() {
            let Some((_, tensor)) = self.by_name.get(name) else { continue };
            let waited = now.saturating_duration_since(tensor.first_seen);
            if waited < after {
                continue;
            }
            for rank in (0..self.size as u32).filter(|r| !waiting.contains(r) && !self.joined.contains(r)) {
                let global = self.global(rank);
                let entry =
                    hung.entry(global).or_insert_with(|| HungRank { rank: global, waited, tensors: Vec::new() });
                entry.waited = entry.waited.max(waited);
                if entry.tensors.len() < NAMES_PER_RANK {
                    entry.tensors.push(name.clone());
                }
            }
        }
        hung.into_values().collect()
    }
}

fn join_response(last_joined: i32) -> Response {
    Response {
        kind: CollectiveKind::Join,
        entries: vec![ResponseEntry {
            name: JOIN_NAME.to_string(),
            shape: Vec::new(),
            per_rank: Vec::new(),
            packed: false,
        }],
        dtype: DataType::Int32,
        reduce_op: ReduceOp::Sum,
        root_rank: -1,
        prescale: 1.0,
        postscale: 1.0,
        error: None,
        last_joined_rank: last_joined,
        on_gpu: false,
        compression: Compression::None,
    }
}

fn mismatch_error(request: Request, message: String) -> Response {
    Response { error: Some((ErrorKind::Mismatch, message)), ..stall_error(request, String::new()) }
}

fn stall_error(request: Request, message: String) -> Response {
    let error = Some((ErrorKind::Invalid, message));
    Response { error, ..Response::for_params(request.name, &request.params, Vec::new()) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::coordinator::test_requests::{allreduce_request, changed};

    fn req(rank: u32, name: &str, kind: CollectiveKind) -> Request {
        changed(allreduce_request(rank, name, &[2]), |p| p.kind = kind)
    }

    #[test]
    fn ready_only_when_every_rank_submitted_in_arrival_order() {
        let mut c = MessageTable::new(vec![0, 1]);
        c.add(req(0, "b", CollectiveKind::Allreduce));
        c.add(req(0, "a", CollectiveKind::Allreduce));
        assert!(c.ready_responses().is_empty());
        c.add(req(1, "a", CollectiveKind::Allreduce));
        c.add(req(1, "b", CollectiveKind::Allreduce));
        let names: Vec<String> = c.ready_responses().iter().map(|r| r.entries[0].name.clone()).collect();
        assert_eq!(names, vec!["b", "a"]);
        assert!(c.ready_responses().is_empty());
    }

    #[test]
    fn joined_ranks_count_as_submitted_and_join_completes_with_last_rank() {
        let mut c = MessageTable::new(vec![0, 1, 2]);
        c.add(req(1, JOIN_NAME, CollectiveKind::Join));
        c.add(req(0, "x", CollectiveKind::Allreduce));
        assert!(c.ready_responses().is_empty());
        c.add(req(2, "x", CollectiveKind::Allreduce));
        let r = c.ready_responses();
        assert_eq!(r.len(), 1);
        assert!(r[0].error.is_none());
        c.add(req(2, JOIN_NAME, CollectiveKind::Join));
        c.add(req(0, JOIN_NAME, CollectiveKind::Join));
        let r = c.ready_responses();
        assert_eq!(r.len(), 1);
        assert_eq!(r[0].kind, CollectiveKind::Join);
        assert_eq!(r[0].last_joined_rank, 0);
    }

    #[test]
    fn different_ops_under_one_name_fail_every_rank_at_once() {
        let mut c = MessageTable::new(vec![0, 1, 2]);
        c.add(req(0, "allreduce.x", CollectiveKind::Allreduce));
        c.add(req(1, "allgather.x", CollectiveKind::Allgather));
        assert!(c.ready_responses().is_empty(), "rank 2 may still submit either");
        c.add(req(2, "allreduce.x", CollectiveKind::Allreduce));
        let r = c.ready_responses();
        assert_eq!(r.len(), 2);
        let mut names: Vec<&str> = r.iter().map(|r| r.entries[0].name.as_str()).collect();
        names.sort();
        assert_eq!(names, vec!["allgather.x", "allreduce.x"]);
        for response in &r {
            let (kind, message) = response.error.clone().unwrap();
            assert_eq!(kind, ErrorKind::Mismatch);
            assert_eq!(
                message,
                "Mismatched operations for tensor 'x': ranks 0, 2 sent allreduce ('allreduce.x'); rank 1 sent allgather \
                 ('allgather.x'). Every rank must call the same collective under a name."
            );
        }
        assert!(c.ready_responses().is_empty());

        // A rank waiting on a cached allreduce while the other submits an allgather under the same name;
        // seen between slow paths, it asks for a round to report it.
        let mut c = MessageTable::new(vec![0, 1]);
        c.add(req(1, "allgather.z", CollectiveKind::Allgather));
        let cached = construct_response(&[req(0, "allreduce.z", CollectiveKind::Allreduce)], &[0, 1], false);
        c.note_waits_between_rounds(vec![(
            0,
            construct_response(&[req(0, "allreduce.w", CollectiveKind::Allreduce)], &[0, 1], false),
        )]);
        assert!(!c.has_queued(), "no conflict, no round");
        c.note_waits_between_rounds(vec![(0, cached.clone())]);
        assert!(c.has_queued(), "a conflict asks for a round");
        c.note_cached_waits(vec![(0, cached)]);
        let r = c.ready_responses();
        assert_eq!(r.len(), 2, "{r:?}");
        assert!(
            r.iter().all(|r| r.error.as_ref().is_some_and(|(k, m)| *k == ErrorKind::Mismatch
                && m.contains("rank 0 sent allreduce ('allreduce.z'); rank 1 sent allgather ('allgather.z')"))),
            "{r:?}"
        );
        assert!(c.ready_responses().is_empty());
        assert!(!c.has_queued());

        // A rank that submits both ops under one name is not in conflict: both wait for the others.
        let mut c = MessageTable::new(vec![0, 1]);
        c.add(req(0, "allreduce.y", CollectiveKind::Allreduce));
        c.add(req(0, "broadcast.y", CollectiveKind::Broadcast));
        c.add(req(1, "broadcast.y", CollectiveKind::Broadcast));
        let r = c.ready_responses();
        assert_eq!(r.len(), 1);
        assert!(r[0].error.is_none());
        assert!(c.ready_responses().is_empty());
    }

    #[test]
    fn stall_warning_and_failure() {
        let mut c = MessageTable::new(vec![0, 1, 2]);
        c.add(req(0, "x", CollectiveKind::Allreduce));
        let later = Instant::now() + Duration::from_secs(100);
        let text = c.check_stalls(later, Duration::from_secs(60), None).unwrap();
        assert!(text.contains("\n1: [x]") && text.contains("\n2: [x]"), "{text}");
        assert!(!c.has_queued());
        let text = c.check_stalls(later, Duration::from_secs(60), Some(Duration::from_secs(90))).unwrap();
        assert!(text.contains("1!"));
        assert!(c.has_queued());
        let r = c.ready_responses();
        assert!(r[0].error.as_ref().unwrap().1.contains("ranks [1, 2] did not submit"));
        assert!(c.check_stalls(later, Duration::from_secs(60), None).is_none());
    }

    #[test]
    fn the_rank_the_others_wait_for_is_hung_not_the_waiters() {
        let mut c = MessageTable::new(vec![4, 5, 6]);
        let after = Duration::from_secs(5);
        c.add_waited(req(0, "grad", CollectiveKind::Allreduce), Duration::from_secs(6));
        c.add_waited(req(2, "grad", CollectiveKind::Allreduce), Duration::from_millis(5500));
        // Rank 0 ran ahead to a tensor rank 2 has not reached (rank 2 waits on "grad"): only rank 1 is hung.
        c.add_waited(req(0, "later", CollectiveKind::Allreduce), Duration::from_secs(6));
        let now = Instant::now();
        assert!(c.hung_ranks(now, Duration::from_secs(7)).is_empty(), "not before the hung time");
        let hung = c.hung_ranks(now, after);
        assert_eq!(hung.len(), 1, "{hung:?}");
        assert_eq!(hung[0].rank, 5, "reported by global rank");
        assert!(hung[0].waited >= Duration::from_secs(6) && hung[0].waited < Duration::from_secs(7));
        assert_eq!(hung[0].tensors, vec!["grad".to_string(), "later".to_string()]);
    }

    #[test]
    fn joined_ranks_and_every_rank_waiting_are_not_hung() {
        let mut c = MessageTable::new(vec![0, 1, 2]);
        let now = Instant::now();
        c.add_waited(req(0, "x", CollectiveKind::Allreduce), Duration::from_secs(9));
        c.add(req(1, "", CollectiveKind::Join));
        let hung = c.hung_ranks(now, Duration::from_secs(5));
        assert_eq!(hung.iter().map(|h| h.rank).collect::<Vec<_>>(), vec![2], "a joined rank is not hung");
        // Two tensors each missing a rank that waits on the other: a mismatch for the stall warning, not a hang.
        let mut c = MessageTable::new(vec![0, 1]);
        c.add_waited(req(0, "a", CollectiveKind::Allreduce), Duration::from_secs(9));
        c.add_waited(req(1, "b", CollectiveKind::Allreduce), Duration::from_secs(9));
        assert!(c.hung_ranks(now, Duration::from_secs(5)).is_empty());
        // Once the tensor is ready (every rank submitted) nobody is hung.
        let mut c = MessageTable::new(vec![0, 1]);
        c.add_waited(req(0, "a", CollectiveKind::Allreduce), Duration::from_secs(9));
        c.add(req(1, "a", CollectiveKind::Allreduce));
        assert_eq!(c.ready_responses().len(), 1);
        assert!(c.hung_ranks(Instant::now(), Duration::from_secs(5)).is_empty());
    }

    #[test]
    fn stall_time_counts_from_the_submission_on_the_rank() {
        let mut c = MessageTable::new(vec![0, 1]);
        c.add_waited(req(0, "x", CollectiveKind::Allreduce), Duration::from_secs(4));
        let now = Instant::now();
        assert!(c.check_stalls(now + Duration::from_millis(1500), Duration::from_secs(5), None).is_some());
    }

    #[test]
    fn stall_warnings_come_once_per_period_and_failures_on_time() {
        let mut c = MessageTable::new(vec![0, 1]);
        let start = Instant::now();
        c.add(req(0, "x", CollectiveKind::Allreduce));
        let at = |secs: f64| start + Duration::from_secs_f64(secs);
        let (warn, fail) = (Duration::from_secs(5), Some(Duration::from_secs(12)));
        assert!(c.check_stalls(at(4.9), warn, fail).is_none());
        assert!(c.check_stalls(at(5.2), warn, fail).is_some(), "warned as soon as 5 s have passed");
        assert!(c.check_stalls(at(6.2), warn, fail).is_none(), "not again within the period");
        assert!(c.check_stalls(at(10.3), warn, fail).is_some(), "again after another period");
        assert!(c.check_stalls(at(11.9), warn, fail).is_none());
        assert!(!c.has_queued());
        let text = c.check_stalls(at(12.1), warn, fail).unwrap();
        assert!(text.contains("1!"), "{text}");
        assert!(c.has_queued(), "failed as soon as 12 s have passed");
    }
}
