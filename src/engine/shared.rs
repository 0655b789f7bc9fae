//! The state a communicator's callers and whoever runs its loop share: the inbox of submissions, the stop
//! request, values set by hand for the next round, and what autotuning applied. Callers write it without
//! holding the loop; the loop ([`super::step`]) reads it at each step.

use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::coordinator::lateness::Lateness;
use crate::engine::handles::HandleTable;
use crate::engine::peer_hosts::PeerHosts;
use crate::engine::table::TensorEntry;
use crate::error::EngineError;
use crate::protocol::round::StopReason;
use crate::protocol::tuned::{RequestedValues, TunedValues};
use crate::timeline::{SetTimeline, Timeline};
use crate::transport::Waker;

/// Submissions waiting for the background thread, and whether it still takes them.
#[derive(Default)]
pub(crate) struct Inbox {
    pub(crate) entries: Vec<TensorEntry>,
    /// Set when the background thread stopped; later submissions fail with this error.
    pub(crate) closed: Option<EngineError>,
}

/// State shared between callers and one communicator's background thread.
pub(crate) struct Shared {
    pub(crate) handles: Arc<HandleTable>,
    inbox: Mutex<Inbox>,
    pub(crate) waker: Waker,
    pub(crate) shutdown_requested: AtomicBool,
    /// Why the stop was requested (a [`StopReason`] code), read once `shutdown_requested` is set.
    stop_reason: AtomicU8,
    /// Set while the background thread sleeps waiting for work: only then does a submission need to wake
    /// it (a busy or batching thread picks submissions up by itself, so waking it would only cost time).
    pub(crate) idle: AtomicBool,
    /// Process set id and its ranks (global rank numbers, sorted), for messages.
    pub(crate) set_id: u32,
    pub(crate) global_ranks: Vec<usize>,
    /// The host each global rank runs on, for errors naming a peer.
    pub(crate) hosts: PeerHosts,
    /// How late each member announces what runs (kept by the loop's negotiator; see
    /// [`crate::coordinator::lateness`]).
    pub(crate) lateness: Arc<Mutex<Lateness>>,
    /// What the transport is ("shm", "tcp", ...), for diagnostics.
    pub(crate) transport_kind: &'static str,
    pub(crate) timeline: SetTimeline,
    /// With autotune on: each set of tuned values this rank applied, with the round it applied them at.
    pub(crate) autotune_applied: Mutex<Vec<AppliedValues>>,
    /// Values set by hand, waiting for the loop's next round (see [`RequestedValues`]).
    requested_values: Mutex<Option<RequestedValues>>,
    /// Whether `requested_values` holds some, readable without its lock.
    values_requested: AtomicBool,
    /// Whether the inbox holds entries, readable without its lock (set and cleared under it).
    queued: AtomicBool,
}

/// Autotuned values as one rank applied them: after round `round` of its communicator (rounds are
/// counted from 1 and run in lockstep, so every rank's numbers name the same rounds).
#[derive(Clone, Debug, PartialEq)]
pub struct AppliedValues {
    pub round: u64,
    pub values: TunedValues,
}

impl Shared {
    /// The state of set `set_id` (ranks `global_ranks`, bytes carried by `transport_kind`), nothing queued.
    pub(crate) fn new(
        handles: Arc<HandleTable>,
        set_id: u32,
        global_ranks: Vec<usize>,
        transport_kind: &'static str,
        timeline: Timeline,
        hosts: PeerHosts,
    ) -> Result<Shared, EngineError> {
        Ok(Shared {
            handles,
            inbox: Mutex::new(Inbox::default()),
            waker: Waker::new().map_err(|e| EngineError::Init(format!("cannot create the wake-up event: {e}")))?,
            shutdown_requested: AtomicBool::new(false),
            stop_reason: AtomicU8::new(0),
            idle: AtomicBool::new(false),
            set_id,
            timeline: SetTimeline::new(timeline, set_id, &global_ranks, transport_kind),
            lateness: Arc::new(Mutex::new(Lateness::new(global_ranks.len()))),
            global_ranks,
            hosts,
            transport_kind,
            autotune_applied: Mutex::new(Vec::new()),
            requested_values: Mutex::new(None),
            values_requested: AtomicBool::new(false),
            queued: AtomicBool::new(false),
        })
    }

    fn inbox(&self) -> MutexGuard<'_, Inbox> {
        self.inbox.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Whether values set by hand wait to be sent.
    pub(crate) fn has_requested_values(&self) -> bool {
        self.values_requested.load(Ordering::Acquire)
    }

    /// Values set by hand that the loop has not sent yet (taken once).
    pub(crate) fn take_requested_values(&self) -> Option<RequestedValues> {
        if !self.has_requested_values() {
            return None;
        }
        let mut requested = self.requested_values.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        self.values_requested.store(false, Ordering::Release);
        requested.take()
    }

    /// Whether submissions wait in the inbox (a glance without its lock: one arriving right after counts as
    /// arriving later).
    pub(crate) fn has_queued(&self) -> bool {
        self.queued.load(Ordering::SeqCst)
    }

    /// Take every queued submission, in submission order.
    pub(crate) fn take_queued(&self) -> Vec<TensorEntry> {
        let mut inbox = self.inbox();
        self.queued.store(false, Ordering::SeqCst);
        std::mem::take(&mut inbox.entries)
    }

    /// Refuse later submissions with `err`; returns what was queued.
    pub(crate) fn close_inbox(&self, err: EngineError) -> Vec<TensorEntry> {
        let mut inbox = self.inbox();
        inbox.closed = Some(err);
        self.queued.store(false, Ordering::SeqCst);
        std::mem::take(&mut inbox.entries)
    }

    /// Why this rank asked its communicator to stop, if it did.
    pub(crate) fn stop_requested(&self) -> Option<StopReason> {
        if !self.shutdown_requested.load(Ordering::SeqCst) {
            return None;
        }
        Some(match self.stop_reason.load(Ordering::SeqCst) {
            1 => StopReason::Exiting,
            2 => StopReason::Removed,
            _ => StopReason::Shutdown,
        })
    }

    /// "process set 1 (ranks [0, 2])", or "the global process set".
    pub(crate) fn describe(&self) -> String {
        if self.set_id == 0 {
            "the global process set".to_string()
        } else {
            format!("process set {} (ranks {:?})", self.set_id, self.global_ranks)
        }
    }

    /// Queue entries for the loop, all or none (a group is negotiated in one round); with `wake`, wake the
    /// engine thread if it sleeps waiting for work.
    pub(crate) fn enqueue(&self, entries: Vec<TensorEntry>, wake: bool) -> Result<(), EngineError> {
        {
            let mut inbox = self.inbox();
            if let Some(err) = &inbox.closed {
                return Err(err.clone());
            }
            inbox.entries.extend(entries);
            // SeqCst: pairs with the engine thread's store to `idle` before it looks at this (see below).
            self.queued.store(true, Ordering::SeqCst);
        }
        // Pairs with the background thread's store to `idle` before it re-checks the inbox (SeqCst on both
        // sides), so a submission is either seen by that check or wakes the thread.
        if wake && self.idle.load(Ordering::SeqCst) {
            self.waker.wake();
        }
        Ok(())
    }

    /// Keep `values` for the loop's next round; a later request replaces one not sent yet.
    pub(crate) fn request_values(&self, values: RequestedValues) {
        let mut requested = self.requested_values.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        *requested = Some(values);
        self.values_requested.store(true, Ordering::Release);
    }

    /// Ask the loop to stop (the first reason asked for wins) and wake the engine thread.
    pub(crate) fn request_stop(&self, why: StopReason) {
        let code = match why {
            StopReason::Shutdown => 0,
            StopReason::Exiting => 1,
            StopReason::Removed => 2,
        };
        // The first reason wins (a set removed while the process exits was removed).
        let _ = self.stop_reason.compare_exchange(0, code, Ordering::SeqCst, Ordering::SeqCst);
        self.shutdown_requested.store(true, Ordering::SeqCst);
        self.waker.wake();
    }
}
