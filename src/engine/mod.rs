//! The per-process engine: one [`Communicator`](communicator::Communicator) (transport, negotiation and
//! background thread) per process set this rank belongs to, a handle table shared by all of them, and the
//! registry of process sets.
//!
//! - [`submission`]: what callers hand in and get back; [`grouped`]: a grouped allreduce submitted as one
//!   packed tensor per dtype.
//! - [`metrics`]: counters for Prometheus, served by [`metrics_server`] where `RVOD_METRICS_PORT` is set.
//! - [`handles`]: the handle table callers wait on; [`peer_hosts`]: the host each rank runs on, for errors
//!   naming a peer.
//! - [`process_sets`]: which sets exist and how ids are assigned.
//! - [`heartbeat`]: an elastic worker's heartbeat to its driver, with the ranks found hung.
//! - [`connect`]: rendezvous and transport set-up; [`roll_call`]: every rank comes to `init()` in time, or the
//!   error names those that did not.
//!
//! A communicator's loop, bottom to top (each uses only those above it in this list):
//! - [`table`]: the tensors submitted on this rank and not yet completed; [`algorithms`]: which flat
//!   algorithm each allreduce, allgather and broadcast runs, logged once per choice; [`execute`]: running one
//!   agreed response (packing fused tensors through [`crate::fusion`]); [`gpu_route`]: the way a process set's
//!   GPU collectives travel, agreed by its members (NCCL or host staging); [`execute_nccl`]: one whose
//!   tensors are on GPUs, through NCCL; [`execute_device`]: one whose tensors are on GPUs, on the set's
//!   route (through [`execute_nccl`], or staged through pinned host memory around [`execute`]);
//!   [`execute_compressed`]: a compressed allreduce (int8, 1-bit, PowerSGD) on the communicator's route.
//! - [`shared`]: what callers and the loop share (the inbox, the stop request, values set by hand).
//! - [`step`]: the loop's state and one step of it (negotiate, fuse, execute, complete handles).
//! - [`fast_lane`]: a small synchronous op run by its caller as one exchange of round headers.
//! - [`driver`]: who runs the loop (its engine thread, or a caller waiting for its own op).
//! - [`communicator`]: one process set's loop, driver and thread; [`affinity`]: pinning the thread to a core.
//! - [`small_op`]: a caller's synchronous op, on the fast lane or submitted and driven.
//!
//! Besides: [`fork`]: what a process forked from a running rank may still do (nothing with the job);
//! [`validate_submission`](mod@validate_submission): argument checks done before anything is sent.
//!
//! Invariant: a submission either fails at once (nothing queued) or its handle is completed exactly once,
//! with a result or an error, including when the engine stops or fails.

pub mod affinity;
pub mod algorithms;
pub mod communicator;
pub mod connect;
pub mod driver;
pub mod execute;
pub mod execute_compressed;
pub mod execute_device;
pub mod execute_nccl;
pub mod fast_lane;
pub mod fork;
pub mod gpu_route;
pub mod grouped;
pub mod handles;
pub mod heartbeat;
pub mod metrics;
pub mod metrics_server;
pub mod peer_hosts;
pub mod process_sets;
pub mod roll_call;
pub mod shared;
pub mod small_op;
pub mod step;
pub mod submission;
pub mod table;
pub mod validate_submission;

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::config::{Config, Topology};
use crate::coordinator::message_table::{BARRIER_NAME, JOIN_NAME};
use crate::error::EngineError;
use crate::protocol::message::{OpParams, Request, CPU_DEVICE};
use crate::protocol::round::StopReason;
use crate::tensor::RawTensor;
use crate::timeline::{self, Timeline};
use crate::transport::rendezvous::StoreClient;
use crate::types::{CollectiveKind, DataType};

use communicator::Communicator;
use handles::{HandleId, HandleTable, WaitOutcome};
use peer_hosts::PeerHosts;
use process_sets::{ProcessSetEntry, ProcessSetRegistry};
use submission::OpSubmission;
use table::TensorEntry;

/// Id of the set of all ranks.
pub const GLOBAL_PROCESS_SET: u32 = 0;

pub struct Engine {
    config: Config,
    handles: Arc<HandleTable>,
    registry: Mutex<ProcessSetRegistry>,
    /// Kept open for registering process sets at run time (None in a job of size 1).
    store: Mutex<Option<StoreClient>>,
    generation: u64,
    homogeneous: bool,
    /// The host each global rank runs on, for errors naming a peer.
    hosts: PeerHosts,
    /// Where this rank's data listeners bind (None in a job of size 1).
    data_addr: Option<std::net::IpAddr>,
    timeline: Timeline,
    /// The global set's communicator, also in the registry: the fast lane reaches it without the registry's
    /// lock. It is never removed; after shutdown it is stopped, and refuses ops as the registry would.
    global: std::sync::OnceLock<Arc<Communicator>>,
}

fn sorted_unique(ranks: &[usize]) -> Vec<usize> {
    let mut ranks = ranks.to_vec();
    ranks.sort_unstable();
    ranks.dedup();
    ranks
}

/// A rank that has met every other rank in the rendezvous scope of its init (see [`Engine::meet`]).
pub struct Meeting {
    config: Config,
    store: Option<StoreClient>,
    generation: u64,
}

impl Engine {
    /// Connect to every other rank, then register `static_sets` (the same list on every rank). `generation`
    /// counts the inits of this process, so a re-init after shutdown meets its peers in a fresh scope.
    pub fn start(config: Config, generation: u64, static_sets: &[Vec<usize>]) -> Result<Engine, EngineError> {
        Engine::meet(config, generation)?.start(static_sets)
    }

    /// The first part of [`start`](Self::start): reach the store and meet every other rank in the scope of
    /// `generation`. An init that fails here (the store unreachable, a rank that never came) leaves the
    /// scope unused, on every rank alike, so that a re-init meets in it again; once every rank has met,
    /// the scope is used up whatever happens next.
    pub fn meet(config: Config, generation: u64) -> Result<Meeting, EngineError> {
        let topo = &config.topology;
        let mut store = match &config.rendezvous {
            Some(rdv) => Some(connect::connect_store(rdv, config.start_timeout)?),
            None => None,
        };
        if let Some(s) = store.as_mut() {
            roll_call::call_the_roll(s, &format!("init{generation}"), topo.rank, topo.size, config.start_timeout)?;
        }
        Ok(Meeting { config, store, generation })
    }
}

impl Meeting {
    /// The rest of [`Engine::start`]: connect the global set and register `static_sets`.
    pub fn start(self, static_sets: &[Vec<usize>]) -> Result<Engine, EngineError> {
        let Meeting { config, mut store, generation } = self;
        let topo = config.topology.clone();
        crate::memory::set_pool_limit(config.buffer_pool_bytes);
        let data_addr = match &config.rendezvous {
            Some(rdv) => Some(connect::data_address(rdv, topo.rank)?),
            None => None,
        };
        let (homogeneous, hosts) = match store.as_mut() {
            Some(s) => {
                let found = connect::job_hosts(s, &format!("init{generation}"), &topo, config.start_timeout)?;
                (found.homogeneous, found.names)
            }
            None => (true, PeerHosts::default()),
        };
        let timeline = Timeline::new(topo.rank, job_key(&config));
        if let Some(path) = config.timeline.as_deref().filter(|p| *p != timeline::DYNAMIC) {
            timeline.start(path.into(), config.timeline_mark_cycles)?;
        }
        let engine = Engine {
            timeline,
            handles: Arc::new(HandleTable::default()),
            registry: Mutex::new(ProcessSetRegistry::default()),
            store: Mutex::new(store),
            generation,
            homogeneous,
            hosts,
            data_addr,
            config,
            global: std::sync::OnceLock::new(),
        };
        engine.register((0..topo.size).collect())?;
        if let Some(global) = engine.global.get() {
            metrics::METRICS.started(global.lateness());
        }
        if let Some(port) = engine.config.metrics_port {
            let spans_hosts = engine.hosts.spans_hosts();
            let ip = engine.data_addr.filter(|_| spans_hosts).unwrap_or(std::net::Ipv4Addr::LOCALHOST.into());
            let port = port.saturating_add(u16::try_from(topo.local_rank).unwrap_or(u16::MAX));
            metrics_server::serve(ip, port, topo.rank);
        }
        for ranks in static_sets {
            engine.add_process_set(ranks)?;
        }
        Ok(engine)
    }
}

impl Engine {
    fn registry(&self) -> MutexGuard<'_, ProcessSetRegistry> {
        self.registry.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Register a set with `ranks` (sorted, unique); members connect to each other.
    fn register(&self, ranks: Vec<usize>) -> Result<u32, EngineError> {
        let (id, sequence) = self.registry().reserve();
        let me = self.config.topology.rank;
        if id != GLOBAL_PROCESS_SET {
            if let Err(err) = self.agree_on_registration(sequence, &ranks) {
                self.registry().release(id);
                return Err(err);
            }
        }
        let communicator = if ranks.contains(&me) {
            match self.start_communicator(id, sequence, &ranks) {
                Ok(communicator) => {
                    let communicator = Arc::new(communicator);
                    if id == GLOBAL_PROCESS_SET {
                        let _ = self.global.set(Arc::clone(&communicator));
                    }
                    Some(communicator)
                }
                Err(err) => {
                    self.registry().release(id);
                    return Err(err);
                }
            }
        } else {
            None
        };
        self.registry().insert(id, ProcessSetEntry { ranks, communicator });
        Ok(id)
    }

    /// Connect to the other members of set `id` and start its background thread.
    fn start_communicator(&self, id: u32, sequence: u64, ranks: &[usize]) -> Result<Communicator, EngineError> {
        let scope = format!("init{}/set{sequence}", self.generation);
        let mut store = self.store.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let transport =
            connect::connect_members(&self.config, self.data_addr, store.as_mut(), &scope, ranks, &self.hosts)?;
        drop(store);
        Communicator::start(
            id,
            ranks.to_vec(),
            transport,
            &self.config,
            Arc::clone(&self.handles),
            self.timeline.clone(),
            self.hosts.clone(),
        )
    }

    /// Every rank publishes the ranks it is registering as its `sequence`-th set and checks that all ranks
    /// registered the same set; otherwise every rank fails with the same message.
    fn agree_on_registration(&self, sequence: u64, ranks: &[usize]) -> Result<(), EngineError> {
        let mut store = self.store.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let Some(store) = store.as_mut() else { return Ok(()) };
        let topo = &self.config.topology;
        let fail = |e: crate::transport::TransportError| EngineError::transport("agreeing on a process set", &e);
        let key = |rank: usize| format!("init{}/register{sequence}/{rank}", self.generation);
        store.set(&key(topo.rank), format!("{ranks:?}").as_bytes()).map_err(fail)?;
        let wait = self.config.start_timeout.max(self.config.timeout);
        let keys: Vec<(usize, String)> = (0..topo.size).map(|rank| (rank, key(rank))).collect();
        let values = store.get_all_from(&keys, wait).map_err(fail)?;
        let proposals: Vec<(usize, String)> = values
            .iter()
            .enumerate()
            .map(|(rank, value)| (rank, String::from_utf8_lossy(value).into_owned()))
            .collect();
        if proposals.iter().all(|(_, p)| *p == proposals[0].1) {
            return Ok(());
        }
        let listing: Vec<String> = proposals.iter().map(|(r, p)| format!("rank {r} registered {p}")).collect();
        Err(EngineError::InvalidArgument(format!(
            "Ranks registered different process sets at the same point: {}. Every rank must add the same \
             process sets in the same order.",
            listing.join("; ")
        )))
    }

    /// Register a process set. Every rank must call this with the same sets in the same order; it returns
    /// the set's id (the same on every rank). Members block until all members have connected.
    pub fn add_process_set(&self, ranks: &[usize]) -> Result<u32, EngineError> {
        let size = self.config.topology.size;
        if ranks.is_empty() {
            return Err(EngineError::InvalidArgument("a process set needs at least one rank".into()));
        }
        if let Some(bad) = ranks.iter().find(|&&r| r >= size) {
            return Err(EngineError::InvalidArgument(format!(
                "process set ranks must be in 0..{size}; got rank {bad}"
            )));
        }
        let ranks = sorted_unique(ranks);
        if let Some(id) = self.registry().find(&ranks) {
            return Err(EngineError::InvalidArgument(format!(
                "Attempted to add a duplicate process set: ranks {ranks:?} are already process set {id}"
            )));
        }
        self.register(ranks)
    }

    /// Remove a process set (every rank calls this, in the same order). Its pending ops fail. Returns
    /// false for the global set or an unknown id.
    pub fn remove_process_set(&self, id: u32) -> bool {
        if id == GLOBAL_PROCESS_SET {
            return false;
        }
        let entry = self.registry().remove(id);
        match entry {
            Some(entry) => {
                if let Some(communicator) = entry.communicator {
                    communicator.stop(StopReason::Removed);
                }
                true
            }
            None => false,
        }
    }

    /// Every registered set: (id, global ranks).
    pub fn process_sets(&self) -> Vec<(u32, Vec<usize>)> {
        self.registry().list()
    }

    /// What carries the bytes of set `set_id` on this rank ("shm", "tcp" or "memory"), if this rank is a member.
    pub fn transport_kind(&self, set_id: u32) -> Option<&'static str> {
        let registry = self.registry();
        registry.get(set_id)?.communicator.as_ref().map(|c| c.transport_kind())
    }

    /// How late each member of process set `set_id` announces what runs, by global rank; `None` where this
    /// rank is not a member.
    pub fn straggler_report(&self, set_id: u32) -> Option<Vec<(usize, crate::coordinator::lateness::RankLateness)>> {
        let registry = self.registry();
        registry.get(set_id)?.communicator.as_ref().map(|c| c.straggler_report())
    }

    /// Steps of process set `set_id`'s loop that callers ran themselves (see [`driver`]); `None` where this
    /// rank is not a member.
    pub fn caller_rounds(&self, set_id: u32) -> Option<u64> {
        let registry = self.registry();
        registry.get(set_id)?.communicator.as_ref().map(|c| c.caller_rounds())
    }

    /// The autotuned values this rank applied on the global process set, in order, with the rounds at which
    /// it applied them (empty with autotune off, unless values were set by hand).
    pub fn autotune_applied(&self) -> Vec<shared::AppliedValues> {
        let registry = self.registry();
        registry.get(0).and_then(|set| set.communicator.as_ref()).map_or_else(Vec::new, |c| c.autotune_applied())
    }

    /// Apply `values` on every rank of the global process set from the end of its next round on, as the
    /// autotuner applies its values (see [`crate::protocol::tuned::RequestedValues`]; only rank 0's request counts).
    /// Shown by [`autotune_applied`](Self::autotune_applied) like the autotuner's. False where this rank has
    /// no global communicator.
    pub fn request_tuned_values(&self, values: crate::protocol::tuned::RequestedValues) -> bool {
        let registry = self.registry();
        registry.get(0).and_then(|set| set.communicator.as_ref()).map(|c| c.request_values(values)).is_some()
    }

    pub fn topology(&self) -> &Topology {
        &self.config.topology
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    /// Whether every host runs the same number of ranks.
    pub fn is_homogeneous(&self) -> bool {
        self.homogeneous
    }

    /// The communicator of set `set_id`, or why an op on it is refused.
    fn communicator_for(&self, set_id: u32, kind: CollectiveKind) -> Result<Arc<Communicator>, EngineError> {
        let registry = self.registry();
        let entry = registry.get(set_id).ok_or_else(|| {
            EngineError::InvalidArgument(format!(
                "{kind}: Process set provided does not exist, or has not been registered (id {set_id})."
            ))
        })?;
        entry.communicator.clone().ok_or_else(|| {
            EngineError::InvalidArgument(format!(
                "{kind}: Rank {} is not a member of the provided process set (id {set_id}, ranks {:?}).",
                self.config.topology.rank, entry.ranks
            ))
        })
    }

    /// Queue a collective on process set `set_id`. Fails at once (and queues nothing) on bad arguments, a
    /// name already in flight, or a stopped engine.
    pub fn submit(&self, op: OpSubmission, set_id: u32) -> Result<HandleId, EngineError> {
        self.submit_to(op, set_id, true).map(|(id, _)| id)
    }

    /// [`submit`](Self::submit) for a caller that waits for the op at once: the engine thread is not woken;
    /// the caller must pass the handle to the communicator's [`drive`](Communicator::drive) next (with
    /// the GIL released), which may run the op on the caller's thread.
    pub fn submit_to_drive(&self, op: OpSubmission, set_id: u32) -> Result<(HandleId, Arc<Communicator>), EngineError> {
        self.submit_to(op, set_id, false)
    }

    fn submit_to(
        &self,
        mut op: OpSubmission,
        set_id: u32,
        wake: bool,
    ) -> Result<(HandleId, Arc<Communicator>), EngineError> {
        if op.params.kind == CollectiveKind::Join && set_id != GLOBAL_PROCESS_SET {
            return Err(EngineError::InvalidArgument("join() works on the global process set only".into()));
        }
        let communicator = self.communicator_for(set_id, op.params.kind)?;
        let me = self.config.topology.rank;
        let local_rank = communicator.local_rank_of(me).ok_or_else(|| EngineError::Internal("lost my rank".into()))?;
        if op.params.kind == CollectiveKind::Broadcast {
            // Callers give the root as a global rank; the set's communicator numbers its members from 0.
            let root = usize::try_from(op.params.root_rank).ok().and_then(|root| communicator.local_rank_of(root));
            op.params.root_rank = match root {
                Some(local) => local as i32,
                None => {
                    return Err(EngineError::InvalidArgument(format!(
                        "broadcast root_rank {} is not a rank of this process set (size {})",
                        op.params.root_rank,
                        communicator.size()
                    )))
                }
            };
        }
        validate_submission::check(&op, communicator.size())?;
        let names: Vec<String> = match op.params.kind {
            CollectiveKind::Barrier => vec![BARRIER_NAME.to_string()],
            CollectiveKind::Join => vec![JOIN_NAME.to_string()],
            _ => op.tensors.iter().map(|t| t.name.clone()).collect(),
        };
        let slots = op.tensors.iter().map(|t| t.output_slots()).sum();
        let id = self.handles.register(op.params.kind.name(), set_id, &names, names.len(), slots)?;
        let entries = entries_for(op, id, local_rank as u32, &names);
        if let Err(err) = communicator.enqueue(entries, wake) {
            self.handles.unregister(id, set_id, &names);
            return Err(err);
        }
        Ok((id, communicator))
    }

    /// The communicator of process set `set_id` on this rank, for its fast lane (see [`fast_lane`]): the
    /// global set's without the registry's lock. `None` where this rank has none (the ordinary submission
    /// then says why).
    pub fn fast_lane(&self, set_id: u32) -> Option<CommunicatorRef<'_>> {
        match (set_id, self.global.get()) {
            (GLOBAL_PROCESS_SET, Some(global)) => Some(CommunicatorRef::Global(global)),
            _ => self.registry().get(set_id)?.communicator.clone().map(CommunicatorRef::Registered),
        }
    }

    /// `Some(true)` once the handle completed, `None` for an unknown handle. An op handed back with its NCCL
    /// work still queued completes, by default, once that work has run (see `engine::execute_nccl`).
    pub fn poll(&self, id: HandleId) -> Option<bool> {
        let done = self.handles.is_done(id)?;
        Some(
            done && self
                .handles
                .device_done(id)
                .iter()
                .all(|d| !d.host_waits() || d.failure().is_some() || d.context.device().query(&d.event) != Ok(false)),
        )
    }

    /// The result of handle `id` if it has completed (it is then forgotten), without waiting.
    pub fn take_done(&self, id: HandleId) -> Option<Result<submission::OpOutput, EngineError>> {
        self.handles.take_done(id)
    }

    /// Wait up to `slice` for a handle (callers loop, checking for interrupts in between).
    pub fn wait(&self, id: HandleId, slice: Duration) -> WaitOutcome {
        let start = Instant::now();
        let communicator = self.handles.pending_on(id).and_then(|set| self.registry().get(set)?.communicator.clone());
        if let Some(communicator) = communicator {
            communicator.wait_driving(id, slice);
        }
        self.handles.wait(id, slice.saturating_sub(start.elapsed()))
    }

    /// Forget a completed handle whose result nobody will collect.
    pub fn release(&self, id: HandleId) {
        self.handles.release(id)
    }

    /// Stop this rank's engine: every communicator tells its other ranks (they stop too, and say `why`),
    /// fails what is still pending, and joins its thread. The global set stops last.
    pub fn shutdown(&self, why: StopReason) {
        let mut communicators = self.registry().take_all();
        communicators.reverse();
        for communicator in communicators {
            communicator.stop(why);
        }
        self.timeline.stop();
        heartbeat::forget_hung();
    }

    /// `start_timeline()`: record into `path` from now on (switching files if one is open). Refused unless
    /// the job started with `RVOD_TIMELINE` set (a path or `DYNAMIC`), as in Horovod.
    pub fn start_timeline(&self, path: &str, mark_cycles: bool) -> Result<(), EngineError> {
        if self.config.timeline.is_none() {
            return Err(EngineError::InvalidArgument(
                "Set HOROVOD_TIMELINE=DYNAMIC to enable dynamic timeline usage.".into(),
            ));
        }
        if path.is_empty() {
            return Err(EngineError::InvalidArgument("start_timeline() needs a file path".into()));
        }
        self.timeline.start(path.into(), mark_cycles)
    }

    /// `stop_timeline()`: close the current file (everything recorded is in it on return).
    pub fn stop_timeline(&self) -> Result<(), EngineError> {
        if self.config.timeline.is_none() {
            return Err(EngineError::InvalidArgument(
                "Set HOROVOD_TIMELINE=DYNAMIC to enable dynamic timeline usage.".into(),
            ));
        }
        self.timeline.stop();
        Ok(())
    }
}

/// A communicator of this engine: the global set's, borrowed, or another set's.
pub enum CommunicatorRef<'a> {
    Global(&'a Arc<Communicator>),
    Registered(Arc<Communicator>),
}

impl std::ops::Deref for CommunicatorRef<'_> {
    type Target = Communicator;

    fn deref(&self) -> &Communicator {
        match self {
            CommunicatorRef::Global(communicator) => communicator,
            CommunicatorRef::Registered(communicator) => communicator,
        }
    }
}

/// Identifies this run of the job on every rank (from the job's secret and rendezvous address), so a
/// timeline file left by an earlier run is replaced, not extended.
fn job_key(config: &Config) -> String {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    match &config.rendezvous {
        Some(rdv) => (&rdv.secret, &rdv.addr, rdv.port).hash(&mut hasher),
        None => (std::process::id(), std::time::SystemTime::now()).hash(&mut hasher),
    }
    format!("{:016x}", hasher.finish())
}

/// The table entries of one submission, each with its request as this rank sends it.
fn entries_for(op: OpSubmission, handle: HandleId, rank: u32, names: &[String]) -> Vec<TensorEntry> {
    let now = Instant::now();
    // Each request names its tensor's device: the CPU, or the GPU's ordinal (ranks must agree on which).
    let request = |name: String, dtype, shape, parts, device| Request {
        rank,
        name,
        params: OpParams { device, ..op.params.for_tensor(dtype, shape, parts) },
    };
    if op.tensors.is_empty() {
        // SAFETY: a zero-length view of no memory.
        let input = unsafe { RawTensor::new(std::ptr::null_mut(), 0) };
        return vec![TensorEntry {
            handle,
            index: 0,
            request: request(names[0].clone(), DataType::Uint8, Vec::new(), Vec::new(), CPU_DEVICE),
            input,
            in_place: false,
            submitted: now,
            packed: None,
            device: None,
            into: None,
        }];
    }
    let requests: Vec<Request> = op
        .tensors
        .iter()
        .map(|t| {
            let parts = t.packed.as_ref().map(|g| g.encoded_shapes()).unwrap_or_default();
            let device = t.device.as_ref().map_or(CPU_DEVICE, |d| d.ordinal());
            request(t.name.clone(), t.dtype, t.shape.clone(), parts, device)
        })
        .collect();
    op.tensors
        .into_iter()
        .zip(requests)
        .enumerate()
        .map(|(index, (t, request))| TensorEntry {
            handle,
            index,
            request,
            input: t.input,
            in_place: t.in_place,
            submitted: now,
            packed: t.packed,
            device: t.device,
            into: t.into,
        })
        .collect()
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.shutdown(StopReason::Shutdown);
    }
}
