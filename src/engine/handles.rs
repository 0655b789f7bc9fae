//! The handle table: ops in flight on this rank, their names, and their results once complete.
//!
//! Submitting threads insert; the engine thread completes; waiting threads block on one condition
//! variable. A name stays reserved from submission until its tensor completes, which is how a second
//! in-flight op with the same name is refused.

use rustc_hash::{FxHashMap as HashMap, FxHashSet as HashSet};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::Duration;

use crate::engine::submission::OpOutput;
use crate::error::EngineError;
use crate::gpu::tensor::{DeviceDone, DeviceOutput};
use crate::tensor::OutputTensor;

pub type HandleId = u64;

/// How long a waiter checks for completion without sleeping.
const SPIN: Duration = Duration::from_micros(30);

struct HandleState {
    /// The process set the op runs on.
    set: u32,
    /// Tensors (or barrier/join events) still to complete.
    remaining: usize,
    /// Threads asleep waiting for this handle: its completion wakes them (and only a waited-for handle's
    /// completion signals the condition variable: a thread waiting on one op of a burst is not woken by
    /// each of the others).
    waiters: usize,
    output: OpOutput,
    error: Option<EngineError>,
}

#[derive(Default)]
struct Table {
    next_id: HandleId,
    handles: HashMap<HandleId, HandleState>,
    /// Names of the tensors in flight, per process set id.
    names_in_flight: HashMap<u32, HashSet<String>>,
}

#[derive(Default)]
pub struct HandleTable {
    table: Mutex<Table>,
    completed: Condvar,
}

/// One completed part of op `id`: the tensor `name` (or barrier or join event) and what it gives the op.
pub struct CompletedPart {
    pub id: HandleId,
    pub name: String,
    pub result: PartResult,
}

/// What a completed part gives its op.
pub enum PartResult {
    /// The result for output slot `index` (`None` where it was written in place), with alltoall's received
    /// splits and join's last rank where the op has them.
    Tensor {
        index: usize,
        output: Option<OutputTensor>,
        received_splits: Option<Vec<i64>>,
        last_joined_rank: Option<i32>,
        /// A tensor on a GPU: its out-of-place result there, and the event after which it is written.
        device_output: Option<DeviceOutput>,
        done: Option<DeviceDone>,
    },
    /// A packed group's results, each with its output slot.
    Members(Vec<(usize, Option<OutputTensor>)>),
    /// The op fails with this error (its first error is the one reported).
    Failed(EngineError),
}

/// Outcome of [`HandleTable::wait`].
pub enum WaitOutcome {
    Done(Result<OpOutput, EngineError>),
    /// Still running after the wait slice.
    Pending,
    Unknown,
}

impl HandleTable {
    fn lock(&self) -> MutexGuard<'_, Table> {
        // A panic while holding this lock cannot leave the table inconsistent (each update is one step),
        // so a poisoned lock is still usable.
        self.table.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Reserve `names` in process set `set` and create a handle expecting `parts` completions (`tensors`
    /// output slots). Fails without side effects if a name is already in flight in that set.
    pub fn register(
        &self,
        op: &str,
        set: u32,
        names: &[String],
        parts: usize,
        tensors: usize,
    ) -> Result<HandleId, EngineError> {
        let mut t = self.lock();
        let in_flight = t.names_in_flight.entry(set).or_default();
        let duplicate = match names {
            [name] => in_flight.contains(name.as_str()).then_some(name),
            _ => {
                let mut seen = HashSet::default();
                names.iter().find(|&name| in_flight.contains(name.as_str()) || !seen.insert(name))
            }
        };
        if let Some(name) = duplicate {
            return Err(EngineError::DuplicateName { op: op.to_string(), name: name.clone() });
        }
        in_flight.extend(names.iter().cloned());
        t.next_id += 1;
        let id = t.next_id;
        let output = OpOutput { tensors: (0..tensors).map(|_| None).collect(), ..OpOutput::default() };
        t.handles.insert(id, HandleState { set, remaining: parts.max(1), waiters: 0, output, error: None });
        Ok(id)
    }

    /// Undo a registration whose submission could not be queued.
    pub fn unregister(&self, id: HandleId, set: u32, names: &[String]) {
        let mut t = self.lock();
        t.handles.remove(&id);
        if let Some(in_flight) = t.names_in_flight.get_mut(&set) {
            for name in names {
                in_flight.remove(name.as_str());
            }
        }
    }

    /// Record completed parts of ops of process set `set`, under one lock (a fused response completes
    /// hundreds of tensors at once): each part's name is free again in the set, and an op whose parts are
    /// all in is complete.
    pub fn complete(&self, set: u32, parts: impl IntoIterator<Item = CompletedPart>) {
        let mut t = self.lock();
        let mut wake = false;
        for part in parts {
            if let Some(in_flight) = t.names_in_flight.get_mut(&set) {
                in_flight.remove(part.name.as_str());
            }
            let Some(state) = t.handles.get_mut(&part.id) else { continue };
            match part.result {
                PartResult::Tensor { index, output, received_splits, last_joined_rank, device_output, done } => {
                    if let Some(slot) = state.output.tensors.get_mut(index) {
                        *slot = output;
                    }
                    if let Some(device_output) = device_output {
                        let slots = state.output.tensors.len();
                        state.output.device_tensors.resize_with(slots, || None);
                        if let Some(slot) = state.output.device_tensors.get_mut(index) {
                            *slot = Some(device_output);
                        }
                    }
                    state.output.done.extend(done);
                    if received_splits.is_some() {
                        state.output.received_splits = received_splits;
                    }
                    if last_joined_rank.is_some() {
                        state.output.last_joined_rank = last_joined_rank;
                    }
                }
                PartResult::Members(members) => {
                    for (index, output) in members {
                        if let Some(slot) = state.output.tensors.get_mut(index) {
                            *slot = output;
                        }
                    }
                }
                PartResult::Failed(e) => {
                    if state.error.is_none() {
                        state.error = Some(e);
                    }
                }
            }
            state.remaining = state.remaining.saturating_sub(1);
            wake |= state.remaining == 0 && state.waiters > 0;
        }
        if wake {
            self.completed.notify_all();
        }
    }

    /// The process set of a handle still pending (`None` once it completed, or for an unknown handle).
    pub fn pending_on(&self, id: HandleId) -> Option<u32> {
        self.lock().handles.get(&id).filter(|s| s.remaining > 0).map(|s| s.set)
    }

    pub fn is_done(&self, id: HandleId) -> Option<bool> {
        self.lock().handles.get(&id).map(|s| s.remaining == 0)
    }

    /// The events after which `id`'s GPU results are written (those it has so far).
    pub fn device_done(&self, id: HandleId) -> Vec<DeviceDone> {
        self.lock().handles.get(&id).map(|s| s.output.done.clone()).unwrap_or_default()
    }

    /// The result of `id` if it has completed (the handle is then removed), without waiting.
    pub fn take_done(&self, id: HandleId) -> Option<Result<OpOutput, EngineError>> {
        let mut t = self.lock();
        if t.handles.get(&id)?.remaining > 0 {
            return None;
        }
        let state = t.handles.remove(&id)?;
        Some(match state.error {
            Some(e) => Err(e),
            None => Ok(state.output),
        })
    }

    /// Wait up to `slice` for `id`; a finished handle is removed and its result returned. Small ops often
    /// finish within microseconds, so the caller first checks for [`SPIN`] (yielding the CPU between
    /// checks) before sleeping: being woken from a sleep costs more than that on a VM.
    pub fn wait(&self, id: HandleId, slice: Duration) -> WaitOutcome {
        crate::transport::spin::spin_until(SPIN.min(slice), || self.is_done(id) != Some(false));
        let mut t = self.lock();
        let deadline = std::time::Instant::now() + slice;
        loop {
            match t.handles.get(&id) {
                None => return WaitOutcome::Unknown,
                Some(state) if state.remaining == 0 => {
                    let state = match t.handles.remove(&id) {
                        Some(s) => s,
                        None => return WaitOutcome::Unknown,
                    };
                    return WaitOutcome::Done(match state.error {
                        Some(e) => Err(e),
                        None => Ok(state.output),
                    });
                }
                Some(_) => {}
            }
            let now = std::time::Instant::now();
            if now >= deadline {
                return WaitOutcome::Pending;
            }
            t = self.sleep_on(t, id, deadline - now);
        }
    }

    /// Sleep until `id` completes or `timeout` passes, leaving its result in the table.
    pub fn wait_done(&self, id: HandleId, timeout: Duration) {
        let deadline = std::time::Instant::now() + timeout;
        let mut t = self.lock();
        while t.handles.get(&id).is_some_and(|s| s.remaining > 0) {
            let now = std::time::Instant::now();
            if now >= deadline {
                return;
            }
            t = self.sleep_on(t, id, deadline - now);
        }
    }

    /// Sleep up to `timeout` as a waiter of pending handle `id` (its completion wakes this thread).
    fn sleep_on<'a>(&'a self, mut t: MutexGuard<'a, Table>, id: HandleId, timeout: Duration) -> MutexGuard<'a, Table> {
        if let Some(state) = t.handles.get_mut(&id) {
            state.waiters += 1;
        }
        t = match self.completed.wait_timeout(t, timeout) {
            Ok((guard, _)) => guard,
            Err(poisoned) => poisoned.into_inner().0,
        };
        if let Some(state) = t.handles.get_mut(&id) {
            state.waiters -= 1;
        }
        t
    }

    /// Forget a handle the caller no longer wants (its result is dropped when it completes).
    pub fn release(&self, id: HandleId) {
        let mut t = self.lock();
        if t.handles.get(&id).is_some_and(|s| s.remaining == 0) {
            t.handles.remove(&id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn duplicate_names_are_refused_until_completion() {
        let t = HandleTable::default();
        let a = t.register("allreduce", 0, &["x".into()], 1, 1).unwrap();
        let err = t.register("allreduce", 0, &["x".into()], 1, 1).unwrap_err();
        assert!(matches!(err, EngineError::DuplicateName { .. }));
        let other_set = t.register("allreduce", 1, &["x".into()], 1, 1).unwrap();
        assert_eq!(t.is_done(a), Some(false));
        let done = PartResult::Tensor {
            index: 0,
            output: None,
            received_splits: None,
            last_joined_rank: None,
            device_output: None,
            done: None,
        };
        t.complete(0, [CompletedPart { id: a, name: "x".into(), result: done }]);
        assert_eq!(t.is_done(a), Some(true));
        assert!(matches!(t.wait(a, Duration::ZERO), WaitOutcome::Done(Ok(_))));
        assert!(matches!(t.wait(a, Duration::ZERO), WaitOutcome::Unknown));
        t.register("allreduce", 0, &["x".into()], 1, 1).unwrap();
        assert_eq!(t.is_done(other_set), Some(false));
    }

    #[test]
    fn duplicate_within_one_group_is_refused() {
        let t = HandleTable::default();
        assert!(t.register("allreduce", 0, &["a".into(), "a".into()], 2, 2).is_err());
        t.register("allreduce", 0, &["a".into()], 1, 1).unwrap();
    }

    #[test]
    fn wait_times_out_then_completes() {
        let t = HandleTable::default();
        let a = t.register("barrier", 0, &[], 1, 0).unwrap();
        assert!(matches!(t.wait(a, Duration::from_millis(5)), WaitOutcome::Pending));
        let failed = PartResult::Failed(EngineError::Internal("boom".into()));
        t.complete(0, [CompletedPart { id: a, name: String::new(), result: failed }]);
        match t.wait(a, Duration::ZERO) {
            WaitOutcome::Done(Err(EngineError::Internal(m))) => assert_eq!(m, "boom"),
            _ => panic!("expected the error"),
        }
    }
}
