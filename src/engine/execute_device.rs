//! Running a response whose tensors are on a GPU, by host staging: rvod's stream waits for each tensor's
//! ready event, copies the inputs into the device's pinned buffer, and the host waits for that copy's event
//! only; the CPU executor then runs the response unchanged on views of the pinned buffer; the results are
//! copied back on rvod's stream (in place into the input's memory, or into a pooled device buffer), and the
//! event recorded after those copies completes each tensor's handle.
//!
//! The host waits for that last event too before returning: the copies read host memory (the pinned
//! buffer, the CPU results) that is reused or freed next. A consumer's stream still waits on the event
//! (cheap: it has completed), so the contract is the one an asynchronous route will keep.
//!
//! A GPU failure before the collective ran is fatal for the process set (as a transport failure is): the
//! other ranks are waiting in the collective, and this rank's leaving is how they learn of it.

use std::sync::Arc;

use crate::engine::execute::{Executor, TensorResult};
use crate::engine::table::TensorEntry;
use crate::error::EngineError;
use crate::gpu::cuda::CudaPinned;
use crate::gpu::device::{Device, PinnedBuffer};
use crate::gpu::runtime::DeviceContext;
use crate::gpu::tensor::{DeviceDone, DeviceOutput};
use crate::gpu::GpuError;
use crate::protocol::message::Response;
use crate::tensor::RawTensor;
use crate::timeline::OpRecord;
use crate::transport::{Transport, TransportError};

/// Why a staged response could not run at all.
pub enum StagedFailure {
    Transport(TransportError),
    Gpu(EngineError),
}

impl From<TransportError> for StagedFailure {
    fn from(e: TransportError) -> StagedFailure {
        StagedFailure::Transport(e)
    }
}

type Results = Vec<Result<TensorResult, EngineError>>;

/// What a process set's loop keeps about its GPU route: whether it has said which one it takes (at
/// `info`, what `rvodrun --verbose` shows), once, at its first response with GPU tensors.
#[derive(Default)]
pub struct GpuRoute {
    announced: bool,
}

impl GpuRoute {
    fn announce(&mut self, set_id: u32, rank: usize, ordinal: i32) {
        if !self.announced {
            self.announced = true;
            tracing::info!(
                "process set {set_id}: GPU collectives via host staging (rank {rank} on GPU {ordinal}; the NCCL \
                 route is not built yet)"
            );
        }
    }
}

/// Alignment of each tensor's place in the pinned buffer.
const ALIGN: usize = 64;

/// Run `response` on this rank through `executor`, staging the entries that are on a GPU (see the module
/// doc). Responses without GPU tensors run as they are.
pub fn execute(
    executor: &mut Executor,
    route: &mut GpuRoute,
    set_id: u32,
    t: &mut dyn Transport,
    response: &Response,
    entries: &mut [Option<TensorEntry>],
    phases: &mut OpRecord,
) -> Result<Results, StagedFailure> {
    let Some(context) = entries.iter().flatten().find_map(|e| e.device.as_ref().map(|d| d.context.clone())) else {
        return Ok(executor.execute_recorded(t, response, entries, phases)?);
    };
    let rank = t.rank();
    route.announce(set_id, rank, context.ordinal());
    let failed = |e: GpuError| StagedFailure::Gpu(EngineError::Gpu(format!("rank {rank}: {e}")));
    let ordinal = context.ordinal();
    if let Some(other) = entries.iter().flatten().filter_map(|e| e.device.as_ref()).find(|d| d.ordinal() != ordinal) {
        let message = format!(
            "rank {rank}: the tensors of one {} are on GPUs {ordinal} and {}; rvod runs one op's tensors on one GPU",
            response.kind,
            other.ordinal()
        );
        return Err(StagedFailure::Gpu(EngineError::Gpu(message)));
    }
    // The loop may run on a caller's thread (see `engine::driver`): its current device stays what it was.
    let runtime = context.device().runtime();
    let previous = runtime.current_device().map_err(failed)?;
    let outcome = staged(executor, &context, t, response, entries, phases);
    let restored = runtime.set_current_device(previous).map_err(failed);
    let results = outcome?;
    restored?;
    Ok(results)
}

/// [`execute`] of a response with GPU entries, all on `context`'s GPU.
fn staged(
    executor: &mut Executor,
    context: &Arc<DeviceContext>,
    t: &mut dyn Transport,
    response: &Response,
    entries: &mut [Option<TensorEntry>],
    phases: &mut OpRecord,
) -> Result<Results, StagedFailure> {
    let rank = t.rank();
    let failed = |e: GpuError| StagedFailure::Gpu(EngineError::Gpu(format!("rank {rank}: {e}")));
    let mut slot = context.pinned();
    let places = stage_in(context, &mut slot, entries).map_err(failed)?;
    let results = executor.execute_recorded(t, response, entries, phases);
    // The views into the pinned buffer end here, whatever happened.
    for entry in entries.iter_mut().flatten().filter(|e| e.device.is_some()) {
        // SAFETY: a zero-length view of no memory.
        entry.input = unsafe { RawTensor::new(std::ptr::null_mut(), 0) };
    }
    let mut results = results?;
    let done = stage_out(context, &mut slot, entries, &places, &mut results).map_err(failed)?;
    for (entry, result) in entries.iter().zip(results.iter_mut()) {
        if let (Some(TensorEntry { device: Some(_), .. }), Ok(result)) = (entry, result) {
            result.done = Some(done.clone());
        }
    }
    Ok(results)
}

/// Copy every GPU entry's input into the pinned buffer (in stream order, after its ready event), wait for
/// those copies, and point each entry's `input` at its copy. Returns each entry's offset in the buffer.
fn stage_in(
    context: &Arc<DeviceContext>,
    slot: &mut Option<CudaPinned>,
    entries: &mut [Option<TensorEntry>],
) -> Result<Vec<Option<usize>>, GpuError> {
    let mut places = Vec::with_capacity(entries.len());
    let mut total = 0;
    for entry in entries.iter() {
        match entry.as_ref().and_then(|e| e.device.as_ref()) {
            Some(device) => {
                places.push(Some(total));
                total += device.len.div_ceil(ALIGN) * ALIGN;
            }
            None => places.push(None),
        }
    }
    let pinned = context.grow_pinned(slot, total)?;
    let (gpu, stream) = (context.device(), context.stream());
    gpu.make_current()?;
    let mut copied = Ok(());
    for (entry, place) in entries.iter().zip(&places) {
        let (Some(device), Some(offset)) = (entry.as_ref().and_then(|e| e.device.as_ref()), place) else { continue };
        copied = gpu.wait_event(stream, &device.ready);
        if copied.is_ok() && device.len > 0 {
            let dst = &mut pinned.as_mut_slice()[*offset..*offset + device.len];
            // SAFETY: the framework keeps the tensor's device memory alive until the handle completes; the
            // pinned buffer is held (locked) by this op and read only after the event below completed.
            copied = unsafe { gpu.copy_to_host(stream, device.ptr, dst) };
        }
        if copied.is_err() {
            break;
        }
    }
    // Wait even after a failed copy: earlier copies may still be writing into the pinned buffer.
    let staged = gpu.record(stream).and_then(|event| gpu.synchronize(&event));
    copied?;
    staged?;
    let base = pinned.as_mut_slice().as_mut_ptr();
    for (entry, place) in entries.iter_mut().zip(&places) {
        let (Some(entry), Some(offset)) = (entry.as_mut(), place) else { continue };
        let len = entry.device.as_ref().map_or(0, |d| d.len);
        // SAFETY: `offset + len` lies inside the pinned buffer, which stays alive and locked until
        // `execute` resets this view; entries' places do not overlap.
        entry.input = unsafe { RawTensor::new(base.add(*offset), len) };
    }
    Ok(places)
}

/// Copy the results to the GPU: an in-place one back into its input's memory, a new one into a pooled
/// device buffer (its host result is dropped). Returns the event after the copies, which has completed.
fn stage_out(
    context: &Arc<DeviceContext>,
    slot: &mut Option<CudaPinned>,
    entries: &[Option<TensorEntry>],
    places: &[Option<usize>],
    results: &mut [Result<TensorResult, EngineError>],
) -> Result<DeviceDone, GpuError> {
    let (gpu, stream) = (context.device(), context.stream());
    let mut host_results = Vec::new();
    let mut copied = Ok(());
    for ((entry, place), result) in entries.iter().zip(places).zip(results.iter_mut()) {
        let (Some(entry), Some(offset), Ok(result)) = (entry.as_ref(), place, result) else { continue };
        let Some(device) = entry.device.as_ref() else { continue };
        match result.output.take() {
            Some(output) => {
                let made = context.buffer(output.buffer.len());
                let buffer = match made {
                    Ok(buffer) => buffer,
                    Err(e) => {
                        copied = Err(e);
                        break;
                    }
                };
                if !output.buffer.is_empty() {
                    // SAFETY: a fresh pooled buffer of the output's length; the host result is kept alive
                    // below until the copies' event has completed.
                    copied = unsafe { gpu.copy_to_device(stream, output.buffer.as_slice(), buffer.ptr()) };
                }
                result.device_output = Some(DeviceOutput { buffer, shape: output.shape.clone(), dtype: output.dtype });
                host_results.push(output);
            }
            None if entry.in_place && device.len > 0 => {
                let src = slot.as_ref().map(|p| &p.as_slice()[*offset..*offset + device.len]).unwrap_or_default();
                // SAFETY: the input's device memory is alive until the handle completes; the pinned buffer
                // stays locked until the event below has completed.
                copied = unsafe { gpu.copy_to_device(stream, src, device.ptr) };
            }
            None => {}
        }
        if copied.is_err() {
            break;
        }
    }
    let done = gpu.record(stream);
    let waited = match &done {
        Ok(event) => gpu.synchronize(event),
        Err(e) => Err(e.clone()),
    };
    drop(host_results);
    copied?;
    waited?;
    Ok(DeviceDone { context: context.clone(), event: Arc::new(done?) })
}
