//! The timeline's writer thread: turns events into Chrome trace JSON and appends them to the file in
//! batches (at most every [`FLUSH_EVERY`], or sooner when a batch grows large), so the engine never
//! waits for the disk and a rank killed by SIGKILL loses at most the last batch. A SIGTERM or SIGHUP that
//! ends the process first has the writer write everything queued ([`SignalFlush`]); `stop()` (shutdown,
//! the `atexit` after an unhandled exception) writes everything too.

use std::collections::HashSet;
use std::fmt::Write as _;
use std::path::PathBuf;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use super::file::TraceFile;
use super::signal_flush::SignalFlush;
use super::{Event, Message, Stage};
use crate::exit_signals;

/// Longest time an event waits in memory before it is written.
const FLUSH_EVERY: Duration = Duration::from_millis(100);
/// A batch this large is written at once.
const FLUSH_BYTES: usize = 1 << 20;
/// How often an idle writer looks for a flush asked by a terminating signal (see [`SignalFlush`]).
const SIGNAL_POLL: Duration = Duration::from_millis(10);
/// Row (trace process id) of the engine-wide row: the file's header and the `CYCLE_START` marks.
const ENGINE_ROW: u64 = 0;

/// The session header: names the engine row and carries the session key (see [`TraceFile`]).
pub(crate) fn header(job: &str, session: u64) -> String {
    let mut key = String::new();
    escape_into(&mut key, &format!("{job}/{session}"));
    format!(
        r#"{{"name":"process_name","ph":"M","pid":{ENGINE_ROW},"args":{{"name":"rvod engine cycles","session":"{key}"}}}}"#
    )
}

#[derive(PartialEq)]
enum Next {
    Continue,
    Exit,
}

pub(crate) struct Writer {
    file: TraceFile,
    path: PathBuf,
    rank: usize,
    origin: (Instant, u128),
    /// Events formatted and not yet written, joined by `,\n`.
    pending: String,
    pending_since: Option<Instant>,
    /// Rows and (row, rank) threads whose names this writer already wrote.
    named_rows: HashSet<u64>,
    named_threads: HashSet<u64>,
    /// Set after a write failed or a newer session took the file: nothing more is written.
    stopped: bool,
}

impl Writer {
    pub(crate) fn new(file: TraceFile, path: PathBuf, rank: usize, origin: (Instant, u128)) -> Writer {
        Writer {
            file,
            path,
            rank,
            origin,
            pending: String::new(),
            pending_since: None,
            named_rows: HashSet::new(),
            named_threads: HashSet::new(),
            stopped: false,
        }
    }

    /// The writer thread's loop; `requests` was registered by the thread that started it.
    pub(crate) fn run(mut self, messages: Receiver<Message>, mut requests: SignalFlush) {
        exit_signals::block_in_this_thread();
        loop {
            if requests.asked() {
                // A signal is ending the process: write everything queued, now.
                while let Ok(message) = messages.try_recv() {
                    if self.handle(message, &messages) == Next::Exit {
                        requests.served();
                        return;
                    }
                }
                self.flush();
                requests.served();
            }
            let wait = match self.pending_since {
                Some(since) => FLUSH_EVERY.saturating_sub(since.elapsed()).min(SIGNAL_POLL),
                None => SIGNAL_POLL,
            };
            match messages.recv_timeout(wait) {
                Ok(message) => {
                    if self.handle(message, &messages) == Next::Exit {
                        return;
                    }
                }
                Err(RecvTimeoutError::Timeout) => self.flush_if_due(),
                Err(RecvTimeoutError::Disconnected) => {
                    self.flush();
                    return;
                }
            }
        }
    }

    fn handle(&mut self, message: Message, messages: &Receiver<Message>) -> Next {
        match message {
            Message::Event(event) => {
                self.format(&event);
                self.pending_since.get_or_insert_with(Instant::now);
                // Checked after every event too: a steady stream never lets the wait above time out.
                self.flush_if_due();
                Next::Continue
            }
            Message::Stop(done) => {
                // Events sent before the stop are already queued ahead of it.
                while let Ok(Message::Event(event)) = messages.try_recv() {
                    self.format(&event);
                }
                self.flush();
                let _ = done.send(());
                Next::Exit
            }
        }
    }

    fn flush_if_due(&mut self) {
        let due = self.pending_since.is_some_and(|since| since.elapsed() >= FLUSH_EVERY);
        if due || self.pending.len() >= FLUSH_BYTES {
            self.flush();
        }
    }

    fn flush(&mut self) {
        self.pending_since = None;
        if self.pending.is_empty() {
            return;
        }
        let batch = std::mem::take(&mut self.pending);
        if self.stopped {
            return;
        }
        match self.file.append(&batch) {
            Ok(true) => {}
            Ok(false) => {
                tracing::warn!(
                    "rank {}: timeline '{}' was restarted by a newer start_timeline(); this rank stops writing to it",
                    self.rank,
                    self.path.display()
                );
                self.stopped = true;
            }
            Err(e) => {
                tracing::warn!(
                    "rank {}: cannot write the timeline '{}': {e}; recording stops",
                    self.rank,
                    self.path.display()
                );
                self.stopped = true;
            }
        }
    }

    /// Nanoseconds since the epoch of `at`, on the clock of every rank.
    fn ts(&self, at: Instant) -> u128 {
        let (origin, wall_ns) = self.origin;
        match at.checked_duration_since(origin) {
            Some(after) => wall_ns + after.as_nanos(),
            None => wall_ns.saturating_sub(origin.duration_since(at).as_nanos()),
        }
    }

    /// `ts(at)` as JSON microseconds: whole ones. Microseconds since the epoch take 16 digits, which a double
    /// (what trace viewers read them into) holds exactly only without a fraction; with nanoseconds after the
    /// point, back-to-back phases rounded into each other and Perfetto dropped them as overlapping.
    fn ts_us(&self, at: Instant) -> u128 {
        self.ts(at) / 1000
    }

    /// One complete ("X") event, from `start` to `end` in whole microseconds: it ends exactly where an event
    /// starting at `end` begins, never after.
    fn span(&mut self, name: &str, start: Instant, end: Instant, row: u64, rank: usize, args: Option<&str>) {
        let ts = self.ts_us(start);
        let dur = self.ts_us(end).saturating_sub(ts);
        if !self.pending.is_empty() {
            self.pending.push_str(",\n");
        }
        let out = &mut self.pending;
        let _ = write!(out, r#"{{"name":"{name}","ph":"X","ts":{ts},"dur":{dur},"pid":{row},"tid":{rank}"#);
        if let Some(args) = args {
            out.push_str(r#","args":"#);
            out.push_str(args);
        }
        out.push('}');
    }

    fn push(&mut self, event: &str) {
        if !self.pending.is_empty() {
            self.pending.push_str(",\n");
        }
        self.pending.push_str(event);
    }

    /// The row of tensor `name` in process set `set_id`, naming it (and this rank's thread) on first use.
    fn row(&mut self, set_id: u32, name: &str) -> u64 {
        let row = row_id(set_id, name);
        if self.named_rows.insert(row) {
            let mut label = String::new();
            escape_into(&mut label, name);
            if set_id != 0 {
                let _ = write!(label, " (process set {set_id})");
            }
            let event = format!(r#"{{"name":"process_name","ph":"M","pid":{row},"args":{{"name":"{label}"}}}}"#);
            self.push(&event);
        }
        self.name_thread(row);
        row
    }

    fn name_thread(&mut self, row: u64) {
        let rank = self.rank;
        if self.named_threads.insert(row) {
            let event = format!(
                r#"{{"name":"thread_name","ph":"M","pid":{row},"tid":{rank},"args":{{"name":"rank {rank}"}}}}"#
            );
            self.push(&event);
            let event = format!(
                r#"{{"name":"thread_sort_index","ph":"M","pid":{row},"tid":{rank},"args":{{"sort_index":{rank}}}}}"#
            );
            self.push(&event);
        }
    }

    fn format(&mut self, event: &Event) {
        match event {
            Event::Op(op) => {
                let subject = &op.subject;
                let op_name = subject.kind.name().to_ascii_uppercase();
                let negotiate = format!("NEGOTIATE_{op_name}");
                let phase_names: Vec<String> = op.phases.iter().map(|p| stage_name(p.0, &op_name)).collect();
                for (i, (tensor_name, shape)) in subject.tensors.iter().enumerate() {
                    let row = self.row(subject.set_id, tensor_name);
                    let mut args = String::new();
                    let _ = write!(
                        args,
                        r#"{{"dtype":"{}","shape":{shape:?},"process_set":{},"fused_with":{}}}"#,
                        subject.dtype.name(),
                        subject.set_id,
                        subject.tensors.len() - 1
                    );
                    if let Some(Some(submitted)) = op.submitted.get(i) {
                        self.span(&negotiate, *submitted, op.agreed, row, op.rank, Some(&args));
                    }
                    self.span("QUEUE", op.agreed, op.started, row, op.rank, None);
                    self.span(&op_name, op.started, op.end, row, op.rank, Some(&args));
                    for ((stage, from, to), name) in op.phases.iter().zip(&phase_names) {
                        let args = stage_args(*stage);
                        self.span(name, *from, *to, row, op.rank, args.as_deref());
                    }
                }
            }
            Event::Tick { set_id, kind, name, rank, ready_rank, at } => {
                let row = self.row(*set_id, name);
                let ts = self.ts_us(*at);
                let op = kind.name().to_ascii_uppercase();
                let json = format!(
                    r#"{{"name":"{ready_rank}","ph":"i","s":"t","ts":{ts},"pid":{row},"tid":{rank},"args":{{"ready_rank":{ready_rank},"negotiating":"NEGOTIATE_{op}"}}}}"#
                );
                self.push(&json);
            }
            Event::Cycle { rank, at } => {
                self.name_thread(ENGINE_ROW);
                let ts = self.ts_us(*at);
                let json =
                    format!(r#"{{"name":"CYCLE_START","ph":"i","s":"t","ts":{ts},"pid":{ENGINE_ROW},"tid":{rank}}}"#);
                self.push(&json);
            }
            Event::Straggler { rank, straggler, named, why, at } => {
                self.name_thread(ENGINE_ROW);
                let ts = self.ts_us(*at);
                let name = if *named { "STRAGGLER" } else { "STRAGGLER_CLEARED" };
                let mut escaped = String::new();
                escape_into(&mut escaped, why);
                let why = escaped;
                let json = format!(
                    r#"{{"name":"{name}","ph":"i","s":"g","ts":{ts},"pid":{ENGINE_ROW},"tid":{rank},"args":{{"rank":{straggler},"why":"{why}"}}}}"#
                );
                self.push(&json);
            }
        }
    }
}

fn stage_name(stage: Stage, op: &str) -> String {
    match stage {
        Stage::MemcpyInFusionBuffer => "MEMCPY_IN_FUSION_BUFFER".to_string(),
        Stage::Collective(transport) | Stage::Algorithm { transport, .. } => {
            format!("{}_{op}", transport.to_ascii_uppercase())
        }
        Stage::Hierarchical { transport, collective } => format!("{}_{collective}", transport.to_ascii_uppercase()),
        Stage::MemcpyOutFusionBuffer => "MEMCPY_OUT_FUSION_BUFFER".to_string(),
        Stage::Compressed { transport, compression } => {
            format!("{}_{compression}_{op}", transport.to_ascii_uppercase())
        }
    }
}

/// The `args` of a phase's span: the algorithm of a collective that names one.
fn stage_args(stage: Stage) -> Option<String> {
    match stage {
        Stage::Algorithm { algorithm, .. } => Some(format!(r#"{{"algorithm":"{algorithm}"}}"#)),
        _ => None,
    }
}

/// A stable row id for a tensor (the same on every rank): FNV-1a of the set and name, kept positive in
/// 31 bits (trace viewers read ids as signed 32-bit) and never the engine row.
fn row_id(set_id: u32, name: &str) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in set_id.to_le_bytes().iter().chain(name.as_bytes()) {
        hash ^= u64::from(*byte);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    ((hash ^ (hash >> 31)) & 0x7fff_ffff).max(1)
}

/// Append `text` to `out` as the inside of a JSON string.
fn escape_into(out: &mut String, text: &str) {
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_escaped_and_rows_stable() {
        let mut out = String::new();
        escape_into(&mut out, "a\"b\\c\nd");
        assert_eq!(out, "a\\\"b\\\\c\\u000ad");
        assert_eq!(row_id(0, "allreduce.x"), row_id(0, "allreduce.x"));
        assert_ne!(row_id(0, "allreduce.x"), row_id(1, "allreduce.x"));
        assert!(row_id(0, "") > 0 && row_id(0, "") < 1 << 31);
    }
}
