//! Which way a process set's GPU collectives travel, agreed once by all its members at its first response
//! with GPU tensors (every rank executes responses in the same order, a joined one too, so all come to that
//! point together): NCCL where every member has a GPU of its own, host staging where ranks share one (NCCL
//! refuses two ranks on one GPU), as `RVOD_GPU_TRANSPORT` allows (see [`crate::gpu::choice`]).
//!
//! The members exchange host, GPU (PCI bus id) and NCCL version over the set's own transport
//! ([`crate::gpu::bootstrap`]); for NCCL, rank 0's unique id comes with the answer, every member starts its
//! communicator (on a stream of its own for this set, so two sets' NCCL work never queues behind each other's
//! on one stream), and all learn whether every member's start succeeded. Where one failed, `auto` falls back
//! to host staging, `nccl` refuses. A rank with no tensor in that first response (it joined) takes part with
//! the GPU it last submitted a tensor on. The route and why are logged at `info` once per process set (what
//! `rvodrun --verbose` shows); a refusal (only where `RVOD_GPU_TRANSPORT=nccl`) at `warn`, and every GPU op of
//! the set then fails with it, on every rank alike.

use std::collections::VecDeque;
use std::ffi::c_char;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use crate::config::{Config, GpuTransport};
use crate::engine::execute_nccl::InFlight;
use crate::gpu::bootstrap::{agree_on_outcome, agree_on_route, BootstrapError, Placement, Setup};
use crate::gpu::cuda::CudaStream;
use crate::gpu::library::loaded;
use crate::gpu::nccl::{Communicator, Nccl, UniqueId};
use crate::gpu::runtime::{context, last_used, DeviceContext};
use crate::transport::{Transport, TransportError};

/// A process set's NCCL communicator on this rank's GPU, with the stream its NCCL work runs on.
pub struct NcclRoute {
    pub comm: Communicator,
    pub context: Arc<DeviceContext>,
    /// This set's stream on the GPU (not rvod's per-GPU stream, which every set's staging shares).
    pub stream: CudaStream,
    /// The loaded NCCL's version code (what [`crate::gpu::plan::nccl_plan`] plans for).
    pub version: i32,
    /// `RVOD_TIMEOUT`: how long a collective may take before the communicator is aborted.
    pub timeout: Duration,
    /// `RVOD_ENABLE_ASYNC_COMPLETION`: ops complete for their callers once their work is queued, not once it
    /// has run (see `engine::execute_nccl`).
    pub async_completion: bool,
    /// Ops handed back whose work has not been seen done yet, oldest first.
    pub in_flight: Mutex<VecDeque<InFlight>>,
    /// Why the route failed after handing ops back, for the callers that wait on their events.
    pub failure: Arc<OnceLock<String>>,
}

/// What the members agreed, as this rank runs it.
pub enum Way<'a> {
    /// Host staging (`engine::execute_device`).
    Staging,
    Nccl(&'a NcclRoute),
    /// No route: every GPU op of the set fails with this (the same on every rank).
    Refused(&'a str),
}

enum State {
    Unagreed,
    Staging,
    Nccl(NcclRoute),
    Refused(String),
}

/// A process set's GPU route (see the module doc).
pub struct GpuRoute {
    set_id: u32,
    global_ranks: Vec<usize>,
    setting: GpuTransport,
    host: String,
    timeout: Duration,
    async_completion: bool,
    state: State,
}

impl GpuRoute {
    /// The route of process set `set_id` (members `global_ranks`), not agreed yet.
    pub fn new(set_id: u32, global_ranks: Vec<usize>, config: &Config) -> GpuRoute {
        GpuRoute {
            set_id,
            global_ranks,
            setting: config.gpu.transport,
            host: config.topology.hostname.clone(),
            timeout: config.timeout,
            async_completion: config.gpu.async_completion,
            state: State::Unagreed,
        }
    }

    /// The route for a GPU response, agreed with the other members the first time (`ordinal`: the GPU of this
    /// rank's tensors in it, `None` where it has none).
    pub fn way(&mut self, t: &mut dyn Transport, ordinal: Option<i32>) -> Result<Way<'_>, TransportError> {
        if matches!(self.state, State::Unagreed) {
            self.state = self.agree(t, ordinal.or_else(last_used))?;
        }
        Ok(match &self.state {
            State::Unagreed | State::Staging => Way::Staging,
            State::Nccl(route) => Way::Nccl(route),
            State::Refused(why) => Way::Refused(why),
        })
    }

    /// Whether ops handed back still have work queued on the GPU (the loop then looks at them often, see
    /// [`GpuRoute::watch`]).
    pub fn has_in_flight(&self) -> bool {
        matches!(&self.state, State::Nccl(route) if route.has_in_flight())
    }

    /// Look at the ops handed back with their NCCL work queued: forget those done; `Err` (the route has
    /// failed, see [`GpuRoute::fail`]) where NCCL reported an error or one took longer than `RVOD_TIMEOUT`.
    pub fn watch(&mut self) -> Result<(), String> {
        let State::Nccl(route) = &self.state else { return Ok(()) };
        let settled = route.settle();
        if let Err(why) = &settled {
            self.fail(why);
        }
        settled
    }

    /// The loop has ended (`failure`: why, where it failed): the ops handed back must not wait for a watch
    /// that is gone. After a failure the route fails at once; after a coordinated stop their work is waited
    /// for (an NCCL error or `RVOD_TIMEOUT` fails the route), so every waiter returns or raises.
    pub fn close(&mut self, failure: Option<&str>) {
        let State::Nccl(route) = &self.state else { return };
        if !route.has_in_flight() {
            return;
        }
        let drained = match failure {
            Some(why) => Err(why.to_string()),
            None => route.drain(),
        };
        if let Err(why) = drained {
            self.fail(&why);
        }
    }

    /// The NCCL route failed (`why`): its communicator is aborted (so no peer waits on it) and every later
    /// GPU op of the set fails.
    pub fn fail(&mut self, why: &str) {
        if let State::Nccl(route) = &self.state {
            // Before the abort, which lets work stuck on a dead peer end: a host waiting for it reads this.
            let _ = route.failure.set(why.to_string());
            route.comm.abort();
        }
        self.state = State::Refused(format!("the process set's NCCL communicator failed earlier: {why}"));
    }

    fn agree(&self, t: &mut dyn Transport, ordinal: Option<i32>) -> Result<State, TransportError> {
        let rank = t.rank();
        let nccl: Result<&'static Nccl, String> = match loaded() {
            Some(libraries) => libraries.nccl.as_ref().map_err(Clone::clone),
            None => Err("the GPU libraries were not loaded".into()),
        };
        let device = ordinal.map(|ordinal| {
            context(ordinal).and_then(|context| {
                let bus = context.device().pci_bus_id()?;
                Ok((context, bus))
            })
        });
        if let Some(Err(e)) = &device {
            tracing::warn!("process set {}: rank {rank} cannot use its GPU: {e}", self.set_id);
        }
        let device = device.and_then(Result::ok);
        let placement = Placement {
            host: self.host.clone(),
            gpu: device.as_ref().map(|(_, bus)| bus.clone()).unwrap_or_default(),
            nccl: nccl.as_ref().map(|n| n.version).map_err(Clone::clone),
        };
        let make_id = || {
            let (Ok(nccl), Some(ordinal)) = (&nccl, ordinal) else { return Err("no NCCL or no GPU".to_string()) };
            nccl.unique_id(rank, ordinal).map(|id| id.internal.map(|c| c as u8))
        };
        let on_gpu = ordinal.map_or("no GPU yet".to_string(), |o| format!("GPU {o}"));
        let (unique_id, reason) = match agree_on_route(t, &self.global_ranks, &placement, self.setting, make_id) {
            Err(BootstrapError::Transport(e)) => return Err(e),
            Err(BootstrapError::Refused(why)) => return Ok(self.refused(why)),
            Ok(Setup::HostStaging { reason }) => {
                tracing::info!(
                    "process set {}: GPU collectives via host staging (rank {rank} on {on_gpu}): {reason}",
                    self.set_id
                );
                return Ok(State::Staging);
            }
            Ok(Setup::Nccl { unique_id, reason }) => (unique_id, reason),
        };
        // The choice gave NCCL only where every member has a GPU and NCCL.
        let started = match (nccl, device) {
            (Ok(nccl), Some((context, _))) => self.start(t, nccl, context, unique_id),
            _ => Err(format!("rank {rank} has no GPU or no NCCL")),
        };
        let agreed = agree_on_outcome(t, &self.global_ranks, started.as_ref().map(|_| ()).map_err(String::as_str));
        match agreed {
            Err(BootstrapError::Transport(e)) => Err(e),
            Err(BootstrapError::Refused(why)) | Ok(Err(why)) => {
                drop(started);
                let why = format!("NCCL could not start ({why})");
                if self.setting == GpuTransport::Nccl {
                    return Ok(self.refused(format!("RVOD_GPU_TRANSPORT=nccl, but {why}")));
                }
                tracing::info!(
                    "process set {}: GPU collectives via host staging (rank {rank} on {on_gpu}): {why}; staging \
                     through host memory",
                    self.set_id
                );
                Ok(State::Staging)
            }
            Ok(Ok(())) => match started {
                Ok(route) => {
                    tracing::info!(
                        "process set {}: GPU collectives via NCCL (rank {rank} on {on_gpu}): {reason}",
                        self.set_id
                    );
                    Ok(State::Nccl(route))
                }
                Err(why) => Ok(self.refused(why)),
            },
        }
    }

    /// This rank's communicator and stream on `context`'s GPU (made current meanwhile; NCCL takes the
    /// current device as the communicator's).
    fn start(
        &self,
        t: &mut dyn Transport,
        nccl: &'static Nccl,
        context: Arc<DeviceContext>,
        unique_id: [u8; 128],
    ) -> Result<NcclRoute, String> {
        let (rank, size, ordinal) = (t.rank(), t.size(), context.ordinal());
        let runtime = context.device().runtime();
        let mut comm = Err(String::new());
        let stream = runtime
            .keeping_current_device(|| {
                context.device().bind()?;
                let id = UniqueId { internal: unique_id.map(|b| b as c_char) };
                comm = Communicator::init(nccl, id, size, rank, ordinal);
                context.device().new_stream()
            })
            .map_err(|e| format!("rank {rank}: {e}"))?;
        Ok(NcclRoute {
            comm: comm?,
            context,
            stream,
            version: nccl.version,
            timeout: self.timeout,
            async_completion: self.async_completion,
            in_flight: Mutex::new(VecDeque::new()),
            failure: Arc::new(OnceLock::new()),
        })
    }

    fn refused(&self, why: String) -> State {
        tracing::warn!("process set {}: no GPU collectives: {why}", self.set_id);
        State::Refused(why)
    }
}
