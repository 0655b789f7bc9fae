//! The Chrome-trace timeline (`RVOD_TIMELINE`, `hvd.start_timeline`): where every tensor's time goes, on
//! every rank, in one file that chrome://tracing and Perfetto load.
//!
//! - One row (trace "process") per tensor, named by the tensor's name; one sub-row (trace "thread") per
//!   rank, the rank number as thread id, so a straggler shows as the rank whose `NEGOTIATE_<OP>` bar ends
//!   last-submitted. The coordinator adds a tick per rank as that rank's request reaches it.
//! - Each op's bar (`ALLREDUCE`, ...) holds its phases: `QUEUE` (agreed, waiting behind other responses),
//!   `MEMCPY_IN_FUSION_BUFFER`, the transport's collective (`SHM_ALLREDUCE`, `TCP_ALLGATHER`, ...; a flat
//!   allreduce, allgather or broadcast names its algorithm in the phase's args: `{"algorithm":"ring"}`),
//!   `MEMCPY_OUT_FUSION_BUFFER`. A hierarchical allreduce shows its steps instead of one collective:
//!   `SHM_REDUCESCATTER` inside the host, `TCP_ALLREDUCE` across hosts, `SHM_ALLGATHER` inside the host
//!   (pipelined in pieces for large buffers, so they alternate; `TCP_ALLREDUCE` is then the time this rank
//!   waited for the network); a hierarchical allgather `SHM_ALLGATHER`, `TCP_ALLGATHER`, `SHM_ALLGATHER`.
//!   `CYCLE_START` marks each negotiation round when asked.
//!
//! Cost: when off, recording is one relaxed atomic load. When on, the engine builds a small event and
//! sends it down a channel; the writer thread ([`writer`]) formats and appends it to the file
//! ([`file`]), so the engine never waits on file I/O.
//!
//! Keeping what was recorded: the writer writes at least every 100 ms, `stop()` (shutdown, also the
//! `atexit` after an unhandled exception) writes everything, and so does a SIGTERM or SIGHUP that ends the
//! process ([`signal_flush`]); the file is valid JSON after every write, and a write cut short by SIGKILL
//! costs only the events of that write ([`file`]).

pub mod file;
mod signal_flush;
mod writer;

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Sender};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use crate::error::EngineError;
use crate::protocol::message::Response;
use crate::types::{CollectiveKind, DataType};

/// The value of `RVOD_TIMELINE` that enables `start_timeline()` without writing anything at start.
pub const DYNAMIC: &str = "DYNAMIC";

/// The tensors of one response, as the timeline names them.
pub struct Subject {
    pub set_id: u32,
    pub kind: CollectiveKind,
    pub dtype: DataType,
    /// Each tensor's name and shape.
    pub tensors: Vec<(String, Vec<i64>)>,
}

/// A phase of an op (besides `NEGOTIATE_<OP>`, `QUEUE` and the op itself, which every op has).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Stage {
    MemcpyInFusionBuffer,
    /// The transport's collective; `&'static str` is the transport ("shm", "tcp").
    Collective(&'static str),
    /// The transport's collective by a named algorithm ("ring", "rabenseifner", "bruck", "tree", ...; see
    /// [`crate::ring::choice`]): named as [`Stage::Collective`] is, with the algorithm in its `args`.
    Algorithm {
        transport: &'static str,
        algorithm: &'static str,
    },
    /// A step of a hierarchical collective: `transport` is the part's ("shm" inside the host, "tcp" across
    /// hosts), `collective` the step's ("REDUCESCATTER", "ALLREDUCE", "ALLGATHER").
    Hierarchical {
        transport: &'static str,
        collective: &'static str,
    },
    MemcpyOutFusionBuffer,
    /// A compressed allreduce over `transport`; `compression` is its kind ("INT8", "ONEBIT", "POWERSGD").
    Compressed {
        transport: &'static str,
        compression: &'static str,
    },
}

pub(crate) enum Event {
    /// One op on `rank`, everything about it in one message (one send per response, however many tensors).
    Op(Box<OpEvent>),
    /// On the coordinator `rank`: `ready_rank` submitted tensor `name`.
    Tick { set_id: u32, kind: CollectiveKind, name: String, rank: usize, ready_rank: usize, at: Instant },
    /// `rank` started a negotiation round.
    Cycle { rank: usize, at: Instant },
    /// `rank`'s record names global rank `straggler` the straggler (`named`), or no longer does.
    Straggler { rank: usize, straggler: usize, named: bool, why: String, at: Instant },
}

pub(crate) struct OpEvent {
    pub(crate) subject: Arc<Subject>,
    pub(crate) rank: usize,
    /// When this rank submitted each tensor (`None`: a joined rank's zeros).
    pub(crate) submitted: Vec<Option<Instant>>,
    pub(crate) agreed: Instant,
    pub(crate) started: Instant,
    /// Consecutive phases of the op: (what, from, to).
    pub(crate) phases: Vec<(Stage, Instant, Instant)>,
    pub(crate) end: Instant,
}

pub(crate) enum Message {
    Event(Event),
    /// Flush, close the file, then answer.
    Stop(Sender<()>),
}

struct Recording {
    sender: Sender<Message>,
    thread: JoinHandle<()>,
}

impl Recording {
    /// Flush and close the file; returns when the writer thread is done.
    fn close(self) {
        let (done, flushed) = mpsc::channel();
        if self.sender.send(Message::Stop(done)).is_ok() {
            let _ = flushed.recv();
        }
        let _ = self.thread.join();
    }
}

struct State {
    recording: Option<Recording>,
    /// `start_timeline` calls so far; numbers the sessions so every rank's n-th file is the same session.
    sessions: u64,
}

struct Hub {
    on: AtomicBool,
    mark_cycles: AtomicBool,
    /// This process's global rank.
    rank: usize,
    /// Identifies the job, so files of an earlier run are replaced rather than extended.
    job: String,
    /// Instant and wall clock (ns since the epoch) read together: timestamps comparable across ranks.
    origin: (Instant, u128),
    state: Mutex<State>,
}

/// This process's timeline: cheap to clone; every communicator records into the same one.
#[derive(Clone)]
pub struct Timeline {
    hub: Arc<Hub>,
}

impl Default for Timeline {
    fn default() -> Self {
        Timeline::new(0, String::new())
    }
}

impl Timeline {
    /// A timeline for global rank `rank` of the job identified by `job` (the same string on every rank).
    pub fn new(rank: usize, job: String) -> Timeline {
        let wall = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
        Timeline {
            hub: Arc::new(Hub {
                on: AtomicBool::new(false),
                mark_cycles: AtomicBool::new(false),
                rank,
                job,
                origin: (Instant::now(), wall),
                state: Mutex::new(State { recording: None, sessions: 0 }),
            }),
        }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.hub.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    pub fn is_on(&self) -> bool {
        self.hub.on.load(Ordering::Relaxed)
    }

    pub fn marks_cycles(&self) -> bool {
        self.hub.mark_cycles.load(Ordering::Relaxed) && self.is_on()
    }

    pub fn rank(&self) -> usize {
        self.hub.rank
    }

    /// Start writing to `path`, switching from the current file, if any. The switch is atomic for the
    /// engine: recording never pauses, so an op in flight lands whole in the old file or the new one.
    /// A path that cannot be written is an error that leaves the current file recording. Every rank that
    /// calls this for the same session appends to the same file.
    pub fn start(&self, path: PathBuf, mark_cycles: bool) -> Result<(), EngineError> {
        let mut state = self.state();
        let session = state.sessions;
        state.sessions += 1;
        let header = writer::header(&self.hub.job, session);
        let file = file::TraceFile::open(&path, &header).map_err(|e| {
            EngineError::InvalidArgument(format!("cannot write the timeline to '{}': {e}", path.display()))
        })?;
        let (sender, receiver) = mpsc::channel();
        let writer = writer::Writer::new(file, path, self.hub.rank, self.hub.origin);
        // Counted before the thread runs, so a terminating signal right after `start` waits for this writer.
        let requests = signal_flush::SignalFlush::register();
        let thread = std::thread::Builder::new()
            .name("rvod-timeline".into())
            .spawn(move || writer.run(receiver, requests))
            .map_err(|e| EngineError::Init(format!("cannot start the timeline writer: {e}")))?;
        let previous = state.recording.replace(Recording { sender, thread });
        self.hub.mark_cycles.store(mark_cycles, Ordering::Relaxed);
        self.hub.on.store(true, Ordering::Relaxed);
        drop(state);
        if let Some(previous) = previous {
            previous.close();
        }
        Ok(())
    }

    /// Stop recording: everything recorded so far is in the file when this returns. No-op when off.
    /// The engine never waits for this: the lock is released before the flush.
    pub fn stop(&self) {
        self.hub.on.store(false, Ordering::Relaxed);
        let recording = self.state().recording.take();
        if let Some(recording) = recording {
            recording.close();
        }
    }

    pub(crate) fn send(&self, event: Event) {
        if let Some(recording) = &self.state().recording {
            let _ = recording.sender.send(Message::Event(event));
        }
    }
}

/// One communicator's view of the timeline: its set, its members' global ranks and its transport.
#[derive(Clone, Default)]
pub struct SetTimeline {
    timeline: Timeline,
    set_id: u32,
    global_ranks: Arc<[usize]>,
    transport: &'static str,
}

impl SetTimeline {
    pub fn new(timeline: Timeline, set_id: u32, global_ranks: &[usize], transport: &'static str) -> SetTimeline {
        SetTimeline { timeline, set_id, global_ranks: global_ranks.into(), transport }
    }

    pub fn is_on(&self) -> bool {
        self.timeline.is_on()
    }

    /// The record of executing `response` on this rank, which starts now; `submitted` gives when this rank
    /// submitted each of its tensors, `agreed` when the round agreed on it. Does nothing when off.
    pub fn op(
        &self,
        response: &Response,
        submitted: impl Iterator<Item = Option<Instant>>,
        agreed: Instant,
    ) -> OpRecord {
        if !self.is_on() {
            return OpRecord::off();
        }
        let subject = Arc::new(Subject {
            set_id: self.set_id,
            kind: response.kind,
            dtype: response.dtype,
            tensors: response.entries.iter().map(|e| (e.name.clone(), e.shape.clone())).collect(),
        });
        let now = Instant::now();
        OpRecord {
            recording: Some(Box::new((
                self.clone(),
                OpEvent {
                    subject,
                    rank: self.timeline.rank(),
                    submitted: submitted.collect(),
                    agreed,
                    started: now,
                    phases: Vec::with_capacity(3),
                    end: now,
                },
            ))),
        }
    }

    /// On the coordinator: communicator rank `ready` submitted `name`.
    pub fn tick(&self, name: &str, kind: CollectiveKind, ready: usize) {
        if !self.is_on() {
            return;
        }
        self.timeline.send(Event::Tick {
            set_id: self.set_id,
            kind,
            name: name.to_string(),
            rank: self.timeline.rank(),
            ready_rank: self.global_ranks.get(ready).copied().unwrap_or(ready),
            at: Instant::now(),
        });
    }

    /// Mark that communicator rank `straggler` is named the straggler (`named`) or no longer is, and why.
    pub fn straggler(&self, straggler: usize, named: bool, why: &str) {
        if !self.is_on() {
            return;
        }
        self.timeline.send(Event::Straggler {
            rank: self.timeline.rank(),
            straggler: self.global_ranks.get(straggler).copied().unwrap_or(straggler),
            named,
            why: why.to_string(),
            at: Instant::now(),
        });
    }

    /// Mark the start of a negotiation round, if cycles are marked.
    pub fn cycle(&self) {
        if self.timeline.marks_cycles() {
            self.timeline.send(Event::Cycle { rank: self.timeline.rank(), at: Instant::now() });
        }
    }
}

/// One op being executed: each `mark` closes the phase that began at the previous one (or at the start);
/// `finish` sends the whole op to the writer.
pub struct OpRecord {
    recording: Option<Box<(SetTimeline, OpEvent)>>,
}

impl OpRecord {
    pub fn off() -> OpRecord {
        OpRecord { recording: None }
    }

    /// The phase that just ended was `stage` (one phase with the phase before it when that was `stage` too).
    pub fn mark(&mut self, stage: Stage) {
        if let Some(recording) = &mut self.recording {
            let op = &mut recording.1;
            let now = Instant::now();
            match op.phases.last_mut() {
                Some(last) if last.0 == stage => last.2 = now,
                last => {
                    let from = last.map_or(op.started, |p| p.2);
                    op.phases.push((stage, from, now));
                }
            }
        }
    }

    /// The phase that just ended was the transport's collective.
    pub fn mark_collective(&mut self) {
        if let Some(recording) = &self.recording {
            let transport = recording.0.transport;
            self.mark(Stage::Collective(transport));
        }
    }

    /// The phase that just ended was the transport's collective, by `algorithm`.
    pub fn mark_algorithm(&mut self, algorithm: &'static str) {
        if let Some(recording) = &self.recording {
            let transport = recording.0.transport;
            self.mark(Stage::Algorithm { transport, algorithm });
        }
    }

    /// The op ended now.
    pub fn finish(self) {
        if let Some(recording) = self.recording {
            let (timeline, mut op) = *recording;
            op.end = Instant::now();
            timeline.timeline.send(Event::Op(Box::new(op)));
        }
    }
}

#[cfg(test)]
mod tests;
