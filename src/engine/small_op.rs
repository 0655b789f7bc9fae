//! A synchronous op from a caller that waits for it at once: the fast lane when it can run there (see
//! [`super::fast_lane`]), the ordinary submission, driven by the caller, otherwise.
//!
//! The binding only brings the tensors across and says how to wait without holding its interpreter ([`Detach`]).

use std::sync::Arc;

use crate::engine::fast_lane::{SmallOp, SmallOutcome};
use crate::engine::handles::HandleId;
use crate::engine::submission::{OpSubmission, TensorSubmission};
use crate::engine::Engine;
use crate::error::EngineError;
use crate::types::CollectiveKind;

/// How a caller waits: the binding releases its interpreter's lock around `f` (see `py::detached`).
pub trait Detach {
    fn detach<T: Send>(&self, f: impl FnOnce() -> T + Send) -> T;
}

/// What became of a [`SmallOp`] given to [`Engine::run_small`].
#[derive(Debug, PartialEq)]
pub enum SmallRun {
    /// Complete. An out-of-place result of `len` bytes is at the start of the caller's `out`; `shape` is the
    /// result's shape where it differs from the input's (an allgather: every rank's rows), else `None`.
    Done { len: usize, shape: Option<Vec<i64>> },
    /// Submitted (or queued by the fast lane) and maybe run already: wait for this handle.
    Handle(HandleId),
}

impl Engine {
    /// Run `op` on process set `set_id` for a caller that waits for it at once. In steady state it runs right
    /// here as one exchange of round headers; when every peer's header is in already it is not expected to
    /// wait, so `detach` is not used (releasing a lock and taking it back would cost more than the op).
    /// Otherwise it is submitted and driven, as [`Engine::submit_and_drive`] does.
    pub fn run_small(
        &self,
        op: SmallOp<'_>,
        set_id: u32,
        out: &mut Vec<u8>,
        detach: &impl Detach,
    ) -> Result<SmallRun, EngineError> {
        // An allgather's result shape is worked out from its input's.
        let (input_shape, input_len) =
            ((op.params.kind == CollectiveKind::Allgather).then(|| op.params.shape.clone()), op.input.len());
        let outcome = match self.fast_lane(set_id) {
            Some(communicator) if communicator.peers_sent() => communicator.run_small(op, out),
            Some(communicator) => detach.detach(|| communicator.run_small(op, out)),
            None => SmallOutcome::NotRun(op),
        };
        match outcome {
            SmallOutcome::Done(len) => {
                let shape = input_shape.map(|shape| gathered_shape(shape, len, input_len));
                Ok(SmallRun::Done { len, shape })
            }
            SmallOutcome::Queued(handle) => Ok(SmallRun::Handle(handle)),
            SmallOutcome::Failed(err) => Err(err),
            SmallOutcome::NotRun(mut op) => {
                let tensors = match op.params.kind {
                    CollectiveKind::Barrier => Vec::new(),
                    _ => vec![TensorSubmission {
                        name: op.name.to_string(),
                        dtype: op.params.dtype,
                        shape: std::mem::take(&mut op.params.shape),
                        input: op.input,
                        in_place: op.in_place,
                        packed: None,
                        device: None,
                        into: None,
                    }],
                };
                let submission = OpSubmission { params: op.params, tensors };
                self.submit_and_drive(submission, set_id, detach).map(SmallRun::Handle)
            }
        }
    }

    /// Queue `op` for a caller that waits for it next: the op may run right here, under `detach` (see
    /// [`super::driver`]). The caller then waits for the handle.
    pub fn submit_and_drive(
        &self,
        op: OpSubmission,
        set_id: u32,
        detach: &impl Detach,
    ) -> Result<HandleId, EngineError> {
        let (id, communicator): (HandleId, Arc<_>) = self.submit_to_drive(op, set_id)?;
        detach.detach(|| communicator.drive(id));
        Ok(id)
    }
}

/// The shape of an allgather's result that the fast lane completed with `result_len` bytes from an input of
/// `input_len` bytes shaped `shape`: as many rows from every rank as this rank's (the fast lane takes no
/// allgather of empty rows).
fn gathered_shape(mut shape: Vec<i64>, result_len: usize, input_len: usize) -> Vec<i64> {
    let ranks = (result_len / input_len.max(1)) as i64;
    if let Some(rows) = shape.first_mut() {
        *rows *= ranks;
    }
    shape
}

#[cfg(test)]
mod tests {
    use super::gathered_shape;

    #[test]
    fn an_allgather_result_has_every_ranks_rows() {
        assert_eq!(gathered_shape(vec![2, 3], 4 * 2 * 3 * 4, 2 * 3 * 4), vec![8, 3]);
        assert_eq!(gathered_shape(vec![5], 5 * 2, 5), vec![10]);
        assert_eq!(gathered_shape(vec![], 8, 4), Vec::<i64>::new());
    }
}
