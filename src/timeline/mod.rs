//! The Chrome-trace timeline (`RVOD_TIMELINE`, `hvd.start_timeline`): where every tensor's time goes, on
//! every rank, in one file that chrome://tracing and Perfetto load.
//!
//! - One row (trace "process") per tensor, named by the tensor's name; one sub-row (trace "thread") per
//!   rank, the rank number as thread id, so a straggler shows as the rank whose `NEGOTIATE_<OP>` bar ends
//!   last-submitted. The coordinator adds a tick per rank as that rank's request reaches it.
//! - Each op's bar (`ALLREDUCE`, ...) holds its phases: `QUEUE` (agreed, waiting behind other responses),
//!   `MEMCPY_IN_FUSION_BUFFER`, the transport's collective (`SHM_ALLREDUCE`, `TCP_ALLGATHER`, ...),
//!   `MEMCPY_OUT_FUSION_BUFFER`. `CYCLE_START` marks each negotiation round when asked.
//!
//! Cost: when off, recording is one relaxed atomic load. When on, the engine builds a small event and
//! sends it down a channel; the writer thread ([`writer`]) formats and appends it to the file
//! ([`file`]), so the engine never waits on file I/O.

pub mod file;
mod writer;

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Sender};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use crate::coordinator::message::Response;
use crate::error::EngineError;
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

/// What a span shows.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Stage {
    /// From submission to the round that agreed on the tensor.
    Negotiate,
    /// From agreement to the start of execution.
    Queue,
    /// The whole op.
    Op,
    MemcpyInFusionBuffer,
    /// The transport's collective; `&'static str` is the transport ("shm", "tcp").
    Collective(&'static str),
    MemcpyOutFusionBuffer,
}

pub(crate) enum Event {
    /// `stage` on `rank`'s row of the subject's tensors (all of them, or only `tensor`).
    Span { subject: Arc<Subject>, tensor: Option<usize>, rank: usize, stage: Stage, start: Instant, end: Instant },
    /// On the coordinator `rank`: `ready_rank` submitted tensor `name`.
    Tick { set_id: u32, kind: CollectiveKind, name: String, rank: usize, ready_rank: usize, at: Instant },
    /// `rank` started a negotiation round.
    Cycle { rank: usize, at: Instant },
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
    /// Instant and wall clock (µs since the epoch) read together: timestamps comparable across ranks.
    origin: (Instant, f64),
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
        let wall = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs_f64() * 1e6).unwrap_or(0.0);
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

    /// Start writing to `path` (closing the current file first, if any). Every rank that calls this for
    /// the same session appends to the same file.
    pub fn start(&self, path: PathBuf, mark_cycles: bool) -> Result<(), EngineError> {
        self.stop();
        let mut state = self.state();
        let session = state.sessions;
        state.sessions += 1;
        let header = writer::header(&self.hub.job, session);
        let file = file::TraceFile::open(&path, &header).map_err(|e| {
            EngineError::InvalidArgument(format!("cannot write the timeline to '{}': {e}", path.display()))
        })?;
        let (sender, receiver) = mpsc::channel();
        let writer = writer::Writer::new(file, path, self.hub.rank, self.hub.origin);
        let thread = std::thread::Builder::new()
            .name("rvod-timeline".into())
            .spawn(move || writer.run(receiver))
            .map_err(|e| EngineError::Init(format!("cannot start the timeline writer: {e}")))?;
        state.recording = Some(Recording { sender, thread });
        self.hub.mark_cycles.store(mark_cycles, Ordering::Relaxed);
        self.hub.on.store(true, Ordering::Relaxed);
        Ok(())
    }

    /// Stop recording: everything recorded so far is in the file when this returns. No-op when off.
    /// The engine never waits for this: the lock is released before the flush.
    pub fn stop(&self) {
        self.hub.on.store(false, Ordering::Relaxed);
        let recording = self.state().recording.take();
        if let Some(recording) = recording {
            let (done, flushed) = mpsc::channel();
            if recording.sender.send(Message::Stop(done)).is_ok() {
                let _ = flushed.recv();
            }
            let _ = recording.thread.join();
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

    /// The subject of `response`'s events, or `None` when the timeline is off.
    pub fn subject(&self, response: &Response) -> Option<Arc<Subject>> {
        if !self.is_on() {
            return None;
        }
        Some(Arc::new(Subject {
            set_id: self.set_id,
            kind: response.kind,
            dtype: response.dtype,
            tensors: response.entries.iter().map(|e| (e.name.clone(), e.shape.clone())).collect(),
        }))
    }

    /// Record `stage` from `start` to `end` on this rank's row of `subject` (tensor `tensor` only, or all).
    pub fn span(&self, subject: &Arc<Subject>, tensor: Option<usize>, stage: Stage, start: Instant, end: Instant) {
        self.timeline.send(Event::Span {
            subject: Arc::clone(subject),
            tensor,
            rank: self.timeline.rank(),
            stage,
            start,
            end,
        });
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

    /// Mark the start of a negotiation round, if cycles are marked.
    pub fn cycle(&self) {
        if self.timeline.marks_cycles() {
            self.timeline.send(Event::Cycle { rank: self.timeline.rank(), at: Instant::now() });
        }
    }

    /// A clock for the phases of executing `response` (does nothing when the timeline is off).
    pub fn phases(&self, response: &Response) -> Phases {
        Phases { recording: self.subject(response).map(|s| (self.clone(), s, Instant::now())) }
    }
}

/// Records consecutive phases of one op: each `mark` closes the phase that began at the previous one.
pub struct Phases {
    recording: Option<(SetTimeline, Arc<Subject>, Instant)>,
}

impl Phases {
    pub fn off() -> Phases {
        Phases { recording: None }
    }

    /// The phase that just ended was `stage`.
    pub fn mark(&mut self, stage: Stage) {
        if let Some((timeline, subject, since)) = &mut self.recording {
            let now = Instant::now();
            timeline.span(subject, None, stage, *since, now);
            *since = now;
        }
    }

    /// The phase that just ended was the transport's collective.
    pub fn mark_collective(&mut self) {
        if let Some((timeline, _, _)) = &self.recording {
            let transport = timeline.transport;
            self.mark(Stage::Collective(transport));
        }
    }
}

#[cfg(test)]
mod tests;
