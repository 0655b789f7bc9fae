//! The coordinator's message table (kept by rank 0 of the communicator): requests gathered from every
//! rank until a tensor is ready everywhere, join bookkeeping, and stall detection.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::{Duration, Instant};

use crate::coordinator::message::{Request, Response, ResponseEntry, ErrorKind};
use crate::coordinator::stall::{stall_warning, MissingRanks};
use crate::coordinator::validate::construct_response;
use crate::types::{CollectiveKind, DataType, ReduceOp};

/// Name every rank's join request carries.
pub const JOIN_NAME: &str = "join.noname";
/// Name every rank's barrier request carries.
pub const BARRIER_NAME: &str = "barrier.noname";

struct PendingTensor {
    requests: BTreeMap<u32, Request>,
    first_seen: Instant,
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
}

impl MessageTable {
    pub fn new(global_ranks: Vec<usize>) -> MessageTable {
        MessageTable {
            size: global_ranks.len(),
            global_ranks,
            pending: BTreeMap::new(),
            by_name: HashMap::new(),
            next_arrival: 0,
            joined: BTreeSet::new(),
            last_joined: -1,
            queued: Vec::new(),
        }
    }

    fn global(&self, rank: u32) -> u32 {
        self.global_ranks.get(rank as usize).map_or(rank, |&g| g as u32)
    }

    /// Record a request from `request.rank`.
    pub fn add(&mut self, request: Request) {
        if request.kind == CollectiveKind::Join {
            self.joined.insert(request.rank);
            self.last_joined = request.rank as i32;
            return;
        }
        let name = request.name.clone();
        match self.by_name.get_mut(&name) {
            Some((_, pending)) => {
                pending.requests.insert(request.rank, request);
            }
            None => {
                let arrival = self.next_arrival;
                self.next_arrival += 1;
                self.pending.insert(arrival, name.clone());
                let mut requests = BTreeMap::new();
                requests.insert(request.rank, request);
                self.by_name.insert(name, (arrival, PendingTensor { requests, first_seen: Instant::now() }));
            }
        }
    }

    /// Whether responses are waiting to be sent even though no rank has new work.
    pub fn has_queued(&self) -> bool {
        !self.queued.is_empty()
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
        if self.size > 0 && self.joined.len() == self.size {
            out.push(join_response(self.last_joined));
            self.joined.clear();
            self.last_joined = -1;
        }
        out
    }

    /// Tensors pending longer than `warn_after`, by missing rank; those pending longer than `fail_after`
    /// are failed (queued as error responses for the next round). Returns the warning text, if any.
    pub fn check_stalls(&mut self, now: Instant, warn_after: Duration, fail_after: Option<Duration>) -> Option<String> {
        let mut missing = MissingRanks::new();
        let mut stalled_out = BTreeSet::new();
        let mut to_fail = Vec::new();
        let mut longest = Duration::ZERO;
        for (arrival, name) in &self.pending {
            let Some((_, tensor)) = self.by_name.get(name) else { continue };
            let waited = now.saturating_duration_since(tensor.first_seen);
            if waited < warn_after {
                continue;
            }
            longest = longest.max(waited);
            let failing = fail_after.is_some_and(|limit| waited >= limit);
            for rank in 0..self.size as u32 {
                if !tensor.requests.contains_key(&rank) && !self.joined.contains(&rank) {
                    let global = self.global(rank);
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
        if missing.is_empty() {
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
                        first.kind,
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
}

fn join_response(last_joined: i32) -> Response {
    Response {
        kind: CollectiveKind::Join,
        entries: vec![ResponseEntry { name: JOIN_NAME.to_string(), shape: Vec::new(), per_rank: Vec::new(), packed: false }],
        dtype: DataType::Int32,
        reduce_op: ReduceOp::Sum,
        root_rank: -1,
        prescale: 1.0,
        postscale: 1.0,
        error: None,
        last_joined_rank: last_joined,
    }
}

fn stall_error(request: Request, message: String) -> Response {
    Response {
        kind: request.kind,
        entries: vec![ResponseEntry {
            packed: !request.parts.is_empty(),
            name: request.name,
            shape: request.shape,
            per_rank: Vec::new(),
        }],
        dtype: request.dtype,
        reduce_op: request.reduce_op,
        root_rank: request.root_rank,
        prescale: request.prescale,
        postscale: request.postscale,
        error: Some((ErrorKind::Invalid, message)),
        last_joined_rank: -1,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(rank: u32, name: &str, kind: CollectiveKind) -> Request {
        Request {
            rank,
            kind,
            name: name.into(),
            dtype: DataType::Float32,
            shape: vec![2],
            reduce_op: ReduceOp::Sum,
            root_rank: -1,
            prescale: 1.0,
            postscale: 1.0,
            splits: Vec::new(),
            parts: Vec::new(),
        }
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
}
