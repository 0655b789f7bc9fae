//! The loop of a communicator, one [`Loop::step`] at a time: take local work, wait (without spinning) for
//! it or for a peer's round, run a negotiation round, fuse and execute what it agreed, complete handles. A
//! transport failure ends the loop and fails every pending and later op with an error that names the
//! peer. Who runs the steps, the engine thread or a caller, is [`super::driver`]'s business.
//!
//! The loop's state is here (`Loop`), with what it shares with callers in [`super::shared`]; the fast lane
//! ([`super::fast_lane`]), the driver and the communicator build on this module, never the reverse.
//!
//! With autotune on, the global communicator's rank 0 also runs the parameter manager: it counts each
//! round's allreduces, and its decisions go out with its next round header; every rank applies what the
//! round carried when the round's work is done (see [`crate::autotune`]). Values set by hand at run time
//! ([`crate::protocol::tuned::RequestedValues`]) go out the same way, on rank 0, in a round without an announcement.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::autotune::manager::ParameterManager;
use crate::config::Config;
use crate::coordinator::lateness::{NameChange, RankLateness};
use crate::coordinator::negotiation::{Negotiator, RoundOutcome};
use crate::coordinator::stall::StallClock;
use crate::engine::execute::{execute_eager, staged_reducescatters, Executor, HierarchyChoice, TensorResult};
use crate::engine::execute_device::{self, StagedFailure};
use crate::engine::gpu_route::GpuRoute;
use crate::engine::handles::{CompletedPart, PartResult};
use crate::engine::heartbeat;
use crate::engine::metrics::METRICS;
use crate::engine::shared::{AppliedValues, Shared};
use crate::engine::table::{TensorEntry, TensorTable};
use crate::error::EngineError;
use crate::fusion::plan_fusion;
use crate::protocol::round::{RoundHeader, StopReason};
use crate::protocol::tuned::TunedValues;
use crate::ring::compressed;
use crate::transport::{Activity, Transport, TransportError};
use crate::types::CollectiveKind;

/// How long an idle engine sleeps between checks when nothing else bounds the wait.
const IDLE_WAIT: Duration = Duration::from_secs(1);

/// When a peer starts a round while this rank has nothing pending, it usually means this rank is about
/// to submit the same op. Waiting this long for that submission before answering turns two rounds (an
/// empty one, then the real one) into one, which halves small-op latency in lockstep loops.
pub(crate) const JOIN_GRACE: Duration = Duration::from_micros(200);

/// While batching a burst (see `RVOD_CYCLE_TIME`), a pause this long between two submissions ends the burst:
/// the round starts then instead of waiting out the whole cycle.
const BURST_GAP: Duration = Duration::from_micros(100);

/// How often the loop looks at GPU work still running after its ops were handed back (asynchronous
/// completion): how late an NCCL error or a dead peer is noticed, at most, while nothing else happens.
const GPU_WATCH: Duration = Duration::from_millis(2);

/// How the failure of an op pending when the job shut down begins.
const SHUT_DOWN: &str = "rvod has been shut down: ";

pub(crate) struct Loop {
    pub(super) shared: Arc<Shared>,
    pub(super) transport: Box<dyn Transport>,
    pub(super) config: Config,
    pub(super) table: TensorTable,
    pub(super) negotiator: Negotiator,
    executor: Executor,
    /// The GPU route of this process set (see [`execute_device`]).
    gpu_route: GpuRoute,
    stall_clock: Option<StallClock>,
    /// Negotiation rounds run so far (the same count on every rank of the communicator).
    pub(super) rounds: u64,
    /// The autotuner, on rank 0 of the global communicator with `RVOD_AUTOTUNE` on.
    pub(super) autotune: Option<ParameterManager>,
    /// How the loop ended, once it has (a coordinated stop with its reason, or the failure); set by
    /// whichever thread ran the last step, acted on by the engine thread.
    pub(super) finished: Option<Result<String, EngineError>>,
    /// Buffers of the fast lane (see [`super::fast_lane`]).
    pub(super) fast: Scratch,
}

/// Buffers the fast lane reuses from op to op: its header frame and the peers' header bodies.
#[derive(Default)]
pub(crate) struct Scratch {
    pub(super) frame: Vec<u8>,
    pub(super) bodies: Vec<Vec<u8>>,
}

/// How a step may wait.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    /// Sleep in the transport until there is something to do (an engine thread whose transport has no
    /// [`IdleWaiter`](crate::transport::IdleWaiter)).
    Sleep,
    /// Never sleep for work: return [`Step::Idle`] instead. With `answer_peers`, a round a peer started
    /// is joined even when this rank has nothing pending; without, the step reports it and returns. With
    /// `batch`, a burst of submissions is given up to a cycle time to fuse (see `RVOD_CYCLE_TIME`); a
    /// caller running its own op does not wait for more.
    Poll { answer_peers: bool, batch: bool },
}

/// What a step did.
pub(crate) enum Step {
    /// It ran a round or picked up work: step again.
    Progress,
    /// Nothing to do for up to `timeout`; `peer_waiting`: a peer started a round while this rank has
    /// nothing pending (see [`JOIN_GRACE`]).
    Idle { timeout: Duration, peer_waiting: bool },
    /// The loop is over (see [`Loop::is_finished`]).
    Finished,
}

impl Loop {
    pub(crate) fn new(shared: Arc<Shared>, mut transport: Box<dyn Transport>, config: Config) -> Loop {
        let mut negotiator = Negotiator::new(
            transport.rank(),
            shared.global_ranks.clone(),
            config.cache_capacity,
            config.inspect_after(),
            config.negotiation,
        );
        negotiator.share_lateness(Arc::clone(&shared.lateness));
        let executor = Executor::new(
            HierarchyChoice { allreduce: config.hierarchical_allreduce, allgather: config.hierarchical_allgather },
            compressed::Settings {
                within_host: config.compression_within_host,
                warmup_steps: config.compression_warmup_steps,
            },
        )
        .with_algorithms(config.collective_algorithms, shared.describe());
        let autotune = match &config.autotune {
            Some(settings) if shared.set_id == 0 && transport.rank() == 0 && transport.size() > 1 => {
                let initial = TunedValues {
                    fusion_threshold: config.fusion_threshold,
                    cycle_time: config.cycle_time,
                    cache_enabled: config.cache_capacity > 0,
                    hierarchical_allreduce: config.hierarchical_allreduce,
                    hierarchical_allgather: config.hierarchical_allgather,
                };
                // Every rank's staging area has the same size: a fused buffer up to it takes the staged path.
                let staging = transport.staging().map(|s| s.area_len());
                Some(ParameterManager::new(settings.clone(), initial, staging, config.topology.cross_size > 1))
            }
            _ => None,
        };
        let gpu_route = GpuRoute::new(shared.set_id, shared.global_ranks.clone(), &config);
        Loop {
            rounds: 0,
            autotune,
            stall_clock: config.inspect_after().map(StallClock::new),
            shared,
            transport,
            config,
            table: TensorTable::default(),
            negotiator,
            executor,
            gpu_route,
            finished: None,
            fast: Default::default(),
        }
    }

    /// One pass of the loop: take new submissions, maybe wait (see [`Mode`]), run a negotiation round and
    /// what it agreed. A failure or a coordinated stop ends the loop ([`Step::Finished`]).
    pub(crate) fn step(&mut self, mode: Mode) -> Step {
        if self.finished.is_some() {
            return Step::Finished;
        }
        let result = self.step_or_end(mode);
        self.end_step(result)
    }

    /// What a step came to; a failure or a coordinated stop ends the loop.
    fn end_step(&mut self, result: Result<Option<Step>, Result<String, EngineError>>) -> Step {
        match result {
            Ok(Some(step)) => step,
            Ok(None) => Step::Progress,
            Err(end) => {
                if let Err(err) = &end {
                    tracing::error!("rank {}: {err}", self.config.topology.rank);
                }
                self.finished = Some(end);
                Step::Finished
            }
        }
    }

    /// Whether the loop has ended (the engine thread winds it up).
    pub(crate) fn is_finished(&self) -> bool {
        self.finished.is_some()
    }

    /// [`step`](Self::step), with the end of the loop as the error: `Err(Ok(reason))` for a coordinated
    /// stop, `Err(Err(_))` for a failure.
    fn step_or_end(&mut self, mode: Mode) -> Result<Option<Step>, Result<String, EngineError>> {
        let had_outstanding = !self.table.is_empty();
        let mut first_new = self.take_inbox();
        let stop = self.shared.stop_requested();
        let shutdown = stop.is_some();
        self.check_stalls();
        crate::memory::trim_idle();
        if let Err(why) = self.gpu_route.watch() {
            return Err(Err(EngineError::Gpu(why)));
        }

        let mut start = first_new.is_some() || shutdown || self.negotiator.wants_round();
        if !start {
            let activity = match mode {
                Mode::Sleep => self.sleep_until_activity(self.idle_timeout()),
                Mode::Poll { .. } => self.transport.wait_for_activity(&self.shared.waker, Duration::ZERO),
            };
            match activity {
                Ok(Activity::Local) => {
                    self.shared.waker.drain();
                    return Ok(None);
                }
                Ok(Activity::Peer) => {
                    start = true;
                    if self.table.is_empty() {
                        match mode {
                            Mode::Sleep => self.await_own_work(JOIN_GRACE).map_err(Err)?,
                            Mode::Poll { answer_peers: true, .. } => {
                                self.take_inbox();
                            }
                            Mode::Poll { answer_peers: false, .. } => {
                                return Ok(Some(Step::Idle { timeout: JOIN_GRACE, peer_waiting: true }))
                            }
                        }
                    }
                }
                Ok(Activity::Idle) => start = self.cached_entry_stalled(),
                Err(e) => return Err(Err(self.transport_failure("waiting for the other ranks", e))),
            }
            if !start {
                return Ok(match mode {
                    Mode::Sleep => None,
                    Mode::Poll { .. } => Some(Step::Idle { timeout: self.idle_timeout(), peer_waiting: false }),
                });
            }
        } else if had_outstanding
            && !shutdown
            && !self.config.cycle_time.is_zero()
            && !matches!(mode, Mode::Poll { batch: false, .. })
        {
            // Busy: give other tensors of this burst up to one cycle to arrive, so they fuse.
            if let Some(first) = first_new.take() {
                self.batch_until(first + self.config.cycle_time).map_err(Err)?;
            }
        }

        self.shared.timeline.cycle();
        if let Some(values) = self.autotune.as_mut().and_then(ParameterManager::take_announcement) {
            self.negotiator.announce(values);
        } else if let Some(requested) = self.shared.take_requested_values() {
            // Values set by hand take the same path as the autotuner's (only the coordinator's count).
            self.negotiator.announce(TunedValues {
                fusion_threshold: requested.fusion_threshold,
                cycle_time: requested.cycle_time,
                cache_enabled: requested.cache_enabled,
                hierarchical_allreduce: self.config.hierarchical_allreduce,
                hierarchical_allgather: self.config.hierarchical_allgather,
            });
        }
        self.rounds += 1;
        let negotiating = Instant::now();
        let outcome = match self.negotiator.round(&mut *self.transport, &mut self.table, stop) {
            Ok(outcome) => {
                METRICS.round(outcome.cache_hits, outcome.cache_misses, negotiating.elapsed());
                outcome
            }
            Err(_) if shutdown => return Err(Ok(self.own_stop_reason(stop))),
            Err(e) => return Err(Err(self.transport_failure("negotiation", e))),
        };
        self.run_outcome(outcome, stop)?;
        Ok(None)
    }

    /// Finish a round whose headers were exchanged outside [`step`](Self::step) (see
    /// [`super::fast_lane`]): decide it and run what was agreed, ending the loop as `step` does on a failure
    /// or a coordinated stop. `headers[r]` is communicator rank `r`'s header, this rank's own among them.
    pub(super) fn finish_round(&mut self, headers: Vec<RoundHeader>) -> Step {
        self.rounds += 1;
        let ended = match self.negotiator.decide(&mut *self.transport, &mut self.table, headers) {
            Ok(outcome) => {
                METRICS.round(outcome.cache_hits, outcome.cache_misses, Duration::ZERO);
                self.run_outcome(outcome, None).map(|()| None)
            }
            Err(e) => Err(Err(self.transport_failure("negotiation", e))),
        };
        self.end_step(ended)
    }

    /// Run what a round agreed: the coordinator's ticks in the timeline, its eager ops, its responses fused
    /// (with the fusion threshold of this round, before autotuned values change it), autotuned values; a
    /// coordinated stop ends the loop (`Err(Ok(reason))`), as does a transport failure (`Err(Err(_))`).
    fn run_outcome(
        &mut self,
        mut outcome: RoundOutcome,
        stop: Option<StopReason>,
    ) -> Result<(), Result<String, EngineError>> {
        for (rank, list) in &outcome.received {
            for request in &list.requests {
                self.shared.timeline.tick(&request.name, request.params.kind, *rank);
            }
        }
        for change in &outcome.stragglers {
            self.say_straggler(change);
        }
        let staged_reducescatters = staged_reducescatters(&mut *self.transport);
        outcome.responses =
            plan_fusion(std::mem::take(&mut outcome.responses), self.config.fusion_threshold, staged_reducescatters);
        let shutdown = stop.is_some();
        let agreed = Instant::now();
        for eager in &outcome.eager {
            if let Some(name) = eager.response.entries.first().map(|e| e.name.clone()) {
                let mut entry = self.table.take(&name);
                let record =
                    self.shared.timeline.op(&eager.response, [entry.as_ref().map(|e| e.submitted)].into_iter(), agreed);
                let result = execute_eager(eager, entry.as_mut());
                record.finish();
                METRICS.ran(eager.response.kind, 1, eager.response.tensor_bytes());
                if let Some(entry) = entry {
                    self.complete(entry, result);
                }
            }
        }
        for response in &outcome.responses {
            self.execute(response, agreed).map_err(Err)?;
        }
        if let Some(values) = &outcome.tuned {
            self.apply_tuned(values);
        }
        if let Some(manager) = self.autotune.as_mut() {
            manager.record(outcome.eager.iter().map(|e| &e.response).chain(&outcome.responses));
        }
        if !outcome.shutdown_by.is_empty() {
            return Err(Ok(if shutdown {
                self.own_stop_reason(stop)
            } else {
                self.peers_stop_reason(&outcome.shutdown_by)
            }));
        }
        Ok(())
    }

    /// After the loop finished: close the transport and fail everything still pending.
    pub(crate) fn wind_up(&mut self) {
        let stopped_because = match self.finished.take() {
            Some(Ok(reason)) => EngineError::ShutDown(reason),
            Some(Err(err)) => err,
            None => EngineError::ShutDown(format!("{SHUT_DOWN}the engine thread stopped")),
        };
        let failure = match &stopped_because {
            EngineError::ShutDown(_) => None,
            err => Some(err.to_string()),
        };
        self.gpu_route.close(failure.as_deref());
        self.transport.close();
        self.fail_everything(stopped_because);
    }

    /// The loop's part of autotuned values (the negotiator applied the cache's).
    fn apply_tuned(&mut self, values: &TunedValues) {
        self.config.fusion_threshold = values.fusion_threshold;
        self.config.cycle_time = values.cycle_time;
        self.config.hierarchical_allreduce = values.hierarchical_allreduce;
        self.config.hierarchical_allgather = values.hierarchical_allgather;
        self.executor.set_hierarchy(HierarchyChoice {
            allreduce: values.hierarchical_allreduce,
            allgather: values.hierarchical_allgather,
        });
        if let Some(manager) = self.autotune.as_mut() {
            manager.applied(values);
        }
        tracing::debug!(
            "autotune: rank {} applies {} after round {}",
            self.config.topology.rank,
            crate::autotune::log::describe(values),
            self.rounds
        );
        let mut applied = self.shared.autotune_applied.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        applied.push(AppliedValues { round: self.rounds, values: values.clone() });
    }

    /// The failure of `op` as users see it: the transport names the peer by its position in this
    /// communicator, users know it by its global rank and host. The transport notes the cause first, to
    /// pass on as it closes (a failure inside one part of a communicator spanning hosts reaches the
    /// other part's peers too).
    pub(super) fn transport_failure(&mut self, op: impl Into<String>, e: TransportError) -> EngineError {
        self.transport.note_failure(&e);
        self.shared.hosts.failure(op, &e.renumbered(&self.shared.global_ranks))
    }

    /// Why pending ops fail when this rank stopped the communicator.
    fn own_stop_reason(&self, stop: Option<StopReason>) -> String {
        match stop {
            Some(StopReason::Removed) => {
                format!("{} was removed (remove_process_set()) while this op was pending on it", self.shared.describe())
            }
            Some(StopReason::Exiting) => format!("{SHUT_DOWN}this process is exiting"),
            _ => format!("{SHUT_DOWN}this rank called shutdown()"),
        }
    }

    /// Why pending ops fail when other ranks stopped the communicator (`by` holds communicator ranks).
    fn peers_stop_reason(&self, by: &[(usize, StopReason)]) -> String {
        let global = |r: usize| self.shared.global_ranks.get(r).copied().unwrap_or(r);
        let ranks = |why: StopReason| -> Vec<String> {
            by.iter().filter(|(_, w)| *w == why).map(|(r, _)| global(*r).to_string()).collect()
        };
        let named = |ranks: &[String]| format!("rank{} {}", if ranks.len() == 1 { "" } else { "s" }, ranks.join(", "));
        let mut parts = Vec::new();
        let removed = ranks(StopReason::Removed);
        if !removed.is_empty() {
            parts.push(format!("{} removed {} (remove_process_set())", named(&removed), self.shared.describe()));
            if removed.len() == by.len() {
                return format!("{}; collectives cannot run on it after that", parts.join("; "));
            }
        }
        let exited = ranks(StopReason::Exiting);
        if !exited.is_empty() {
            parts.push(format!("{} exited without calling shutdown() (the script ended or raised)", named(&exited)));
        }
        let stopped = ranks(StopReason::Shutdown);
        if !stopped.is_empty() {
            parts.push(format!("{} called shutdown()", named(&stopped)));
        }
        format!("{SHUT_DOWN}{}; collectives cannot run after that", parts.join("; "))
    }

    /// Move submissions into the table; returns when the earliest of them arrived.
    fn take_inbox(&mut self) -> Option<Instant> {
        let entries = self.shared.take_queued();
        let first = entries.iter().map(|e| e.submitted).min();
        for entry in entries {
            self.table.insert(entry);
        }
        first
    }

    /// Wait for more local work while a burst of submissions goes on: until `deadline`, but only as long as
    /// each submission follows the previous one within [`BURST_GAP`]; start at once if a peer starts the round.
    fn batch_until(&mut self, deadline: Instant) -> Result<(), EngineError> {
        let mut quiet_from = Instant::now() + BURST_GAP;
        loop {
            let now = Instant::now();
            let until = deadline.min(quiet_from);
            if now >= until {
                return Ok(());
            }
            match self.transport.wait_for_activity(&self.shared.waker, until - now) {
                Ok(Activity::Local) => {
                    self.shared.waker.drain();
                    if self.take_inbox().is_some() {
                        quiet_from = Instant::now() + BURST_GAP;
                    }
                    if self.shared.shutdown_requested.load(Ordering::SeqCst) {
                        return Ok(());
                    }
                }
                Ok(Activity::Idle) => {}
                Ok(Activity::Peer) => return Ok(()),
                Err(e) => return Err(self.transport_failure("waiting for the other ranks", e)),
            }
        }
    }

    /// Sleep until local work, a peer's round, or `timeout`. Submitters wake the thread only while it sleeps
    /// here; the inbox is checked again after announcing the sleep so no submission is missed.
    fn sleep_until_activity(&mut self, timeout: Duration) -> Result<Activity, TransportError> {
        self.shared.idle.store(true, Ordering::SeqCst);
        let activity = if !self.shared.has_queued() {
            self.transport.wait_for_activity(&self.shared.waker, timeout)
        } else {
            Ok(Activity::Local)
        };
        self.shared.idle.store(false, Ordering::SeqCst);
        activity
    }

    /// Wait up to `grace` for a local submission (a peer is already waiting for this rank's header).
    fn await_own_work(&mut self, grace: Duration) -> Result<(), EngineError> {
        self.shared.idle.store(true, Ordering::SeqCst);
        let pending = self.shared.has_queued() || self.shared.waker.wait(grace);
        self.shared.idle.store(false, Ordering::SeqCst);
        if pending {
            self.shared.waker.drain();
            self.take_inbox();
        }
        Ok(())
    }

    fn idle_timeout(&self) -> Duration {
        let wait = match (&self.stall_clock, self.table.is_empty()) {
            (Some(clock), false) => clock.remaining(Instant::now()).max(Duration::from_millis(10)).min(IDLE_WAIT),
            _ => IDLE_WAIT,
        };
        // Ops handed back before their GPU work ran are looked at this often (see `GpuRoute::watch`).
        if self.gpu_route.has_in_flight() {
            wait.min(GPU_WATCH)
        } else {
            wait
        }
    }

    /// Whether a cache hit on this rank has waited past the inspection time (the next round invalidates it, so
    /// the coordinator sees the request).
    fn cached_entry_stalled(&self) -> bool {
        match (self.config.inspect_after(), self.table.oldest_cache_hit()) {
            (Some(limit), Some(oldest)) => oldest.elapsed() >= limit,
            _ => false,
        }
    }

    /// A rank named the straggler, or no longer: marked in the timeline, and said once per job (by this
    /// communicator's rank 0) at WARN, or INFO when cleared.
    fn say_straggler(&self, change: &NameChange) {
        self.shared.timeline.straggler(change.rank, change.named, &change.why);
        if self.transport.rank() != 0 {
            return;
        }
        let rank = self.shared.global_ranks.get(change.rank).copied().unwrap_or(change.rank);
        let host = self.shared.hosts.host_of(rank).map(|h| format!(" on host {h}")).unwrap_or_default();
        if change.named {
            tracing::warn!(
                "In {}: rank {rank}{host} is holding the others back: {}",
                self.shared.describe(),
                change.why
            );
        } else {
            tracing::info!("In {}: rank {rank}{host} keeps up again: {}", self.shared.describe(), change.why);
        }
    }

    /// The slowest ranks by mean lateness (those ever last, at most 3), for the stall warning.
    fn slowest_ranks(&self) -> Option<String> {
        let lateness = self.shared.lateness.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let mut late: Vec<(usize, &RankLateness)> =
            lateness.report().iter().enumerate().filter(|(_, r)| r.times_last > 0).collect();
        late.sort_by_key(|(_, r)| std::cmp::Reverse(r.mean_lateness()));
        let shown: Vec<String> = late
            .iter()
            .take(3)
            .map(|(rank, r)| {
                let global = self.shared.global_ranks.get(*rank).copied().unwrap_or(*rank);
                format!(
                    "{global} (last in {} of {} rounds, {:.1} ms late on average)",
                    r.times_last,
                    r.rounds,
                    r.mean_lateness().as_secs_f64() * 1e3
                )
            })
            .collect();
        (!shown.is_empty()).then(|| format!("\nSlowest ranks: {}", shown.join(", ")))
    }

    /// On the coordinator, warn about tensors some ranks never submitted, and in an elastic job find the
    /// ranks that hang.
    fn check_stalls(&mut self) {
        let Some(clock) = self.stall_clock.as_mut() else { return };
        let now = Instant::now();
        if !clock.due(now) {
            return;
        }
        let fail_after = self.config.stall_shutdown;
        if let (Some(limit), Some(table)) = (self.config.stall_check, self.negotiator.coordinator_mut()) {
            if let Some(warning) = table.check_stalls(now, limit, fail_after) {
                METRICS.stall_warning();
                let slowest = self.slowest_ranks().unwrap_or_default();
                tracing::warn!("In {}: {warning}{slowest}", self.shared.describe());
            }
        }
        let elastic = self.config.elastic_hung_timeout.zip(self.config.elastic_round);
        if let (Some((after, round)), Some(table)) = (elastic, self.negotiator.coordinator()) {
            // Kept for the elastic driver (the worker's heartbeat carries them), said once per rank found.
            for rank in heartbeat::note_hung(round, self.shared.set_id, table.hung_ranks(now, after)) {
                let host = self.shared.hosts.host_of(rank.rank as usize);
                tracing::error!(
                    "In {}: {}; the elastic driver replaces it",
                    self.shared.describe(),
                    rank.describe(host)
                );
            }
        }
    }

    fn execute(&mut self, response: &crate::protocol::message::Response, agreed: Instant) -> Result<(), EngineError> {
        let mut entries: Vec<Option<TensorEntry>> = response.entries.iter().map(|e| self.table.take(&e.name)).collect();
        let mut record =
            self.shared.timeline.op(response, entries.iter().map(|e| e.as_ref().map(|e| e.submitted)), agreed);
        let transport = &mut *self.transport;
        let started = Instant::now();
        let outcome = execute_device::execute(
            &mut self.executor,
            &mut self.gpu_route,
            transport,
            response,
            &mut entries,
            &mut record,
        );
        record.finish();
        METRICS.collective(started.elapsed());
        let bytes = response.tensor_bytes();
        METRICS.ran(response.kind, response.entries.len(), bytes);
        if response.entries.len() > 1 {
            METRICS.fused(response.entries.len(), bytes);
        }
        match outcome {
            Err(StagedFailure::Gpu(err)) => {
                let parts = entries.into_iter().flatten().map(|entry| completed(entry, Err(err.clone())));
                self.shared.handles.complete(self.shared.set_id, parts);
                Err(err)
            }
            Ok(results) => {
                let parts = entries.into_iter().zip(results).filter_map(|(e, result)| Some(completed(e?, result)));
                self.shared.handles.complete(self.shared.set_id, parts);
                Ok(())
            }
            Err(StagedFailure::Transport(e)) => {
                let err = self.transport_failure(
                    format!(
                        "{} of tensor '{}'",
                        response.kind,
                        response.entries.first().map(|e| e.name.as_str()).unwrap_or("")
                    ),
                    e,
                );
                let parts = entries.into_iter().flatten().map(|entry| completed(entry, Err(err.clone())));
                self.shared.handles.complete(self.shared.set_id, parts);
                Err(err)
            }
        }
    }

    fn complete(&self, entry: TensorEntry, result: Result<TensorResult, EngineError>) {
        self.shared.handles.complete(self.shared.set_id, [completed(entry, result)]);
    }

    /// Close the inbox and fail every entry still pending with `err`.
    fn fail_everything(&mut self, err: EngineError) {
        let queued = self.shared.close_inbox(err.clone());
        let parts = self.table.drain().into_iter().chain(queued).map(|entry| {
            let own = naming_tensor(&err, entry.request.params.kind, &entry.request.name);
            completed(entry, Err(own))
        });
        self.shared.handles.complete(self.shared.set_id, parts);
    }
}

/// What a finished table entry gives its op. A result the executor made in a buffer of its own for an entry
/// with caller memory to write it into (`into`) is copied there, or refused when the sizes differ.
fn completed(mut entry: TensorEntry, result: Result<TensorResult, EngineError>) -> CompletedPart {
    let result = match (result, entry.into.take()) {
        (Ok(mut result), Some(mut into)) => match result.output.take() {
            None => Ok(result),
            Some(out) if out.buffer.len() == into.len() => {
                into.as_mut_slice().copy_from_slice(out.buffer.as_slice());
                Ok(result)
            }
            Some(out) => Err(EngineError::InvalidArgument(format!(
                "{} '{}': the output tensor given holds {} bytes, and this rank's result is {} bytes (shape {:?})",
                entry.request.params.kind,
                entry.request.name,
                into.len(),
                out.buffer.len(),
                out.shape
            ))),
        },
        (result, _) => result,
    };
    let result = match result {
        Ok(TensorResult { members, .. }) if entry.packed.is_some() => PartResult::Members(members),
        Ok(TensorResult { output, received_splits, last_joined_rank, device_output, done, .. }) => {
            PartResult::Tensor { index: entry.index, output, received_splits, last_joined_rank, device_output, done }
        }
        Err(e) => PartResult::Failed(e),
    };
    CompletedPart { id: entry.handle, name: entry.request.name, result }
}

/// The engine-wide failure `err` as seen by the pending `kind` of tensor `name`: a transport failure names
/// the tensor too.
pub(super) fn naming_tensor(err: &EngineError, kind: CollectiveKind, name: &str) -> EngineError {
    match err {
        EngineError::Transport { op, cause } => {
            EngineError::Transport { op: format!("{kind} of tensor '{name}' ({op})"), cause: cause.clone() }
        }
        other => other.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::message::{OpParams, Request};
    use crate::tensor::{AlignedBuffer, OutputTensor, RawTensor};
    use crate::types::DataType;

    fn entry_into(into: &mut [u8]) -> TensorEntry {
        TensorEntry {
            handle: 7,
            index: 0,
            request: Request {
                rank: 0,
                name: "reducescatter.g".into(),
                params: OpParams::new(CollectiveKind::Reducescatter),
            },
            // SAFETY: a zero-length view of no memory.
            input: unsafe { RawTensor::new(std::ptr::null_mut(), 0) },
            in_place: false,
            submitted: Instant::now(),
            packed: None,
            device: None,
            // SAFETY: `into` outlives the entry, which `completed` consumes at once.
            into: Some(unsafe { RawTensor::new(into.as_mut_ptr(), into.len()) }),
        }
    }

    fn made_by_the_executor(bytes: &[u8]) -> Result<TensorResult, EngineError> {
        let output = OutputTensor {
            buffer: AlignedBuffer::from_slice(bytes),
            shape: vec![bytes.len() as i64],
            dtype: DataType::Uint8,
        };
        Ok(TensorResult { output: Some(output), ..TensorResult::default() })
    }

    #[test]
    fn a_result_made_in_a_buffer_of_its_own_is_copied_into_the_callers_memory() {
        let mut into = [0u8; 4];
        let part = completed(entry_into(&mut into), made_by_the_executor(&[1, 2, 3, 4]));
        assert!(
            matches!(part.result, PartResult::Tensor { output: None, index: 0, .. }),
            "not a result written in place"
        );
        assert_eq!(into, [1, 2, 3, 4]);
    }

    #[test]
    fn a_result_of_another_size_than_the_callers_memory_is_refused_naming_both() {
        let mut into = [9u8; 3];
        let part = completed(entry_into(&mut into), made_by_the_executor(&[1, 2, 3, 4]));
        let PartResult::Failed(EngineError::InvalidArgument(message)) = part.result else {
            panic!("a result of the wrong size was not refused");
        };
        assert!(
            message.contains("'reducescatter.g'")
                && message.contains("holds 3 bytes")
                && message.contains("is 4 bytes"),
            "{message}"
        );
        assert_eq!(into, [9, 9, 9], "nothing is written into memory of the wrong size");
    }
}
