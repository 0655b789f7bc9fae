//! One communicator: the ranks of one process set that this rank belongs to, with its own transport,
//! negotiation, response cache, fusion and background thread. Collectives on disjoint sets therefore
//! run concurrently, and a stall in one set never blocks another.

use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;

use crate::config::Config;
use crate::engine::affinity;
use crate::engine::background::Loop;
use crate::engine::driver::Driver;
use crate::engine::fast_lane::{SmallOp, SmallOutcome};
use crate::engine::handles::{HandleId, HandleTable};
use crate::engine::table::TensorEntry;
use crate::error::EngineError;
use crate::protocol::round::StopReason;
use crate::protocol::tuned::{RequestedValues, TunedValues};
use crate::timeline::{SetTimeline, Timeline};
use crate::transport::{Transport, Waker};
use crate::types::CollectiveKind;

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
}

pub struct Communicator {
    shared: Arc<Shared>,
    driver: Arc<Driver>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl Communicator {
    /// Start the background thread of a communicator whose transport is already connected.
    pub fn start(
        set_id: u32,
        global_ranks: Vec<usize>,
        transport: Box<dyn Transport>,
        config: &Config,
        handles: Arc<HandleTable>,
        timeline: Timeline,
    ) -> Result<Communicator, EngineError> {
        let shared = Arc::new(Shared {
            handles,
            inbox: Mutex::new(Inbox::default()),
            waker: Waker::new().map_err(|e| EngineError::Init(format!("cannot create the wake-up event: {e}")))?,
            shutdown_requested: AtomicBool::new(false),
            stop_reason: AtomicU8::new(0),
            idle: AtomicBool::new(false),
            set_id,
            timeline: SetTimeline::new(timeline, set_id, &global_ranks, transport.label()),
            global_ranks,
            transport_kind: transport.label(),
            autotune_applied: Mutex::new(Vec::new()),
            requested_values: Mutex::new(None),
            values_requested: AtomicBool::new(false),
            queued: AtomicBool::new(false),
        });
        shared.waker.set_doorbell(transport.doorbell());
        let waiter = transport.idle_waiter();
        let driver = Arc::new(Driver::new(
            Loop::new(Arc::clone(&shared), transport, config.clone()),
            waiter,
            Arc::clone(&shared),
        ));
        let thread_driver = Arc::clone(&driver);
        let affinity = config.thread_affinity;
        let name = format!("rvod-set{set_id}");
        let (started, on_started) = std::sync::mpsc::channel();
        let thread = std::thread::Builder::new()
            .name(name.clone())
            .spawn(move || {
                affinity::apply(affinity, &name);
                let _ = started.send(());
                thread_driver.run_engine_thread()
            })
            .map_err(|e| EngineError::Init(format!("cannot start the engine thread: {e}")))?;
        // Callers may run the first ops themselves before the engine thread is ever scheduled: wait until it
        // is named and pinned, so that what init() leaves behind is the same whoever runs first.
        let _ = on_started.recv();
        Ok(Communicator { shared, driver, thread: Mutex::new(Some(thread)) })
    }

    /// This rank's position in the communicator.
    pub fn local_rank_of(&self, global_rank: usize) -> Option<usize> {
        self.shared.global_ranks.iter().position(|&r| r == global_rank)
    }

    /// What carries this communicator's bytes: "shm", "tcp" or "memory".
    pub fn transport_kind(&self) -> &'static str {
        self.shared.transport_kind
    }

    pub fn size(&self) -> usize {
        self.shared.global_ranks.len()
    }

    /// The autotuned values this rank applied so far, in order (empty with autotune off).
    pub fn autotune_applied(&self) -> Vec<AppliedValues> {
        self.shared.autotune_applied.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).clone()
    }

    /// Ask for `values` to be applied on every rank (see [`RequestedValues`]): the loop's next round sends
    /// them, on rank 0; a later request replaces one not sent yet.
    pub fn request_values(&self, values: RequestedValues) {
        let mut requested = self.shared.requested_values.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        *requested = Some(values);
        self.shared.values_requested.store(true, Ordering::Release);
    }

    /// Queue entries for the background thread, all or none (a group is negotiated in one round). With
    /// `wake` false, the caller promises to call [`drive`](Self::drive) next, which runs them or wakes the
    /// thread.
    pub(crate) fn enqueue(&self, entries: Vec<TensorEntry>, wake: bool) -> Result<(), EngineError> {
        {
            let mut inbox = self.shared.inbox();
            if let Some(err) = &inbox.closed {
                return Err(err.clone());
            }
            inbox.entries.extend(entries);
            // SeqCst: pairs with the engine thread's store to `idle` before it looks at this (see below).
            self.shared.queued.store(true, Ordering::SeqCst);
        }
        // Pairs with the background thread's store to `idle` before it re-checks the inbox (SeqCst on both
        // sides), so a submission is either seen by that check or wakes the thread.
        if wake && self.shared.idle.load(Ordering::SeqCst) {
            self.shared.waker.wake();
        }
        Ok(())
    }

    /// Run the op `id`, queued with `enqueue(.., false)`, on this thread if the engine is idle (see
    /// [`driver`](super::driver)); otherwise hand it to the engine thread. Call with the GIL released.
    pub fn drive(&self, id: HandleId) {
        self.driver.drive(id)
    }

    /// Run `op` (its root, for a broadcast, a global rank) on this thread by the fast lane if it can run
    /// there now (see [`fast_lane`](super::fast_lane)); `NotRun` hands it back as it came. `out` receives an
    /// out-of-place result (grown to its size if shorter). Call with the GIL released, unless [`peers_sent`](Self::peers_sent).
    pub fn run_small<'a>(&self, mut op: SmallOp<'a>, out: &mut Vec<u8>) -> SmallOutcome<'a> {
        let global_root = op.params.root_rank;
        if op.params.kind == CollectiveKind::Broadcast {
            match usize::try_from(global_root).ok().and_then(|root| self.local_rank_of(root)) {
                Some(local) => op.params.root_rank = local as i32,
                None => return SmallOutcome::NotRun(op),
            }
        }
        match self.driver.run_small(op, out) {
            SmallOutcome::NotRun(mut op) => {
                op.params.root_rank = global_root;
                SmallOutcome::NotRun(op)
            }
            outcome => outcome,
        }
    }

    /// Whether every peer has already sent this rank its next header: a fast-lane op is then not expected
    /// to wait for them (and may run without releasing the GIL).
    pub fn peers_sent(&self) -> bool {
        self.driver.peers_sent()
    }

    /// Steps of the loop run by callers instead of the engine thread so far (see [`driver`](super::driver)).
    pub fn caller_rounds(&self) -> u64 {
        self.driver.caller_rounds()
    }

    /// Wait up to `slice` for `id`, running the loop on this thread where that is allowed (see
    /// [`driver`](super::driver)); returns at once where it is not. Call with the GIL released.
    pub fn wait_driving(&self, id: HandleId, slice: std::time::Duration) {
        self.driver.wait_driving(id, slice)
    }

    /// Coordinated stop: the other ranks of the set stop too (their errors say `why`); pending ops fail;
    /// the thread is joined.
    pub fn stop(&self, why: StopReason) {
        let code = match why {
            StopReason::Shutdown => 0,
            StopReason::Exiting => 1,
            StopReason::Removed => 2,
        };
        // The first reason wins (a set removed while the process exits was removed).
        let _ = self.shared.stop_reason.compare_exchange(0, code, Ordering::SeqCst, Ordering::SeqCst);
        self.shared.shutdown_requested.store(true, Ordering::SeqCst);
        self.shared.waker.wake();
        let thread = self.thread.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).take();
        if let Some(thread) = thread {
            // The loop never panics by design; if it did, its handles were already failed by the unwinding.
            let _ = thread.join();
        }
    }
}

impl Drop for Communicator {
    fn drop(&mut self) {
        self.stop(StopReason::Shutdown);
    }
}
