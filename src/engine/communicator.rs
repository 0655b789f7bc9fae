//! One communicator: the ranks of one process set that this rank belongs to, with its own transport,
//! negotiation, response cache, fusion and background thread. Collectives on disjoint sets therefore
//! run concurrently, and a stall in one set never blocks another.

use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use crate::config::Config;
use crate::coordinator::lateness::RankLateness;
use crate::engine::affinity;
use crate::engine::driver::Driver;
use crate::engine::fast_lane::{SmallOp, SmallOutcome};
use crate::engine::handles::{HandleId, HandleTable};
use crate::engine::peer_hosts::PeerHosts;
use crate::engine::shared::{AppliedValues, Shared};
use crate::engine::step::Loop;
use crate::engine::table::TensorEntry;
use crate::error::EngineError;
use crate::protocol::round::StopReason;
use crate::protocol::tuned::RequestedValues;
use crate::timeline::Timeline;
use crate::transport::Transport;
use crate::types::CollectiveKind;

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
        hosts: PeerHosts,
    ) -> Result<Communicator, EngineError> {
        let shared = Arc::new(Shared::new(handles, set_id, global_ranks, transport.label(), timeline, hosts)?);
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

    /// The lateness record its loop keeps (see [`crate::coordinator::lateness`]).
    pub fn lateness(&self) -> Arc<Mutex<crate::coordinator::lateness::Lateness>> {
        Arc::clone(&self.shared.lateness)
    }

    /// Each member's lateness record, by global rank (see [`crate::coordinator::lateness`]).
    pub fn straggler_report(&self) -> Vec<(usize, RankLateness)> {
        let lateness = self.shared.lateness.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let global = |rank: usize| self.shared.global_ranks.get(rank).copied().unwrap_or(rank);
        lateness.report().iter().enumerate().map(|(rank, record)| (global(rank), record.clone())).collect()
    }

    /// The autotuned values this rank applied so far, in order (empty with autotune off).
    pub fn autotune_applied(&self) -> Vec<AppliedValues> {
        self.shared.autotune_applied.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).clone()
    }

    /// Ask for `values` to be applied on every rank (see [`RequestedValues`]): the loop's next round sends
    /// them, on rank 0; a later request replaces one not sent yet.
    pub fn request_values(&self, values: RequestedValues) {
        self.shared.request_values(values)
    }

    /// Queue entries for the background thread, all or none (a group is negotiated in one round). With
    /// `wake` false, the caller promises to call [`drive`](Self::drive) next, which runs them or wakes the
    /// thread.
    pub(crate) fn enqueue(&self, entries: Vec<TensorEntry>, wake: bool) -> Result<(), EngineError> {
        self.shared.enqueue(entries, wake)
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
        self.shared.request_stop(why);
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
