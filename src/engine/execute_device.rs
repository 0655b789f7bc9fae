//! Running a response whose tensors are on GPUs: on the process set's route ([`crate::engine::gpu_route`]),
//! through NCCL ([`crate::engine::execute_nccl`]) where the route is NCCL and NCCL can run the response as
//! the host path does ([`crate::gpu::plan`]), else by host staging, which this module does.
//!
//! Host staging: rvod's stream waits for each tensor's
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
use crate::engine::execute_nccl;
use crate::engine::gpu_route::{GpuRoute, NcclRoute, Way};
use crate::engine::table::TensorEntry;
use crate::error::EngineError;
use crate::gpu::cuda::CudaPinned;
use crate::gpu::device::{Device, PinnedBuffer};
use crate::gpu::plan::{nccl_plan, NcclPlan};
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

/// Alignment of each tensor's place in the pinned buffer.
const ALIGN: usize = 64;

/// Run `response` on this rank: a response without GPU tensors through `executor` as it is; a GPU one on
/// the process set's route (agreed with the other members at its first GPU response, see
/// [`crate::engine::gpu_route`]): through NCCL ([`crate::engine::execute_nccl`]) where the route is NCCL and
/// [`nccl_plan`] has calls for it, else by host staging (see the module doc).
pub fn execute(
    executor: &mut Executor,
    route: &mut GpuRoute,
    t: &mut dyn Transport,
    response: &Response,
    entries: &mut [Option<TensorEntry>],
    phases: &mut OpRecord,
) -> Result<Results, StagedFailure> {
    if !response.on_gpu || response.error.is_some() {
        return Ok(executor.execute_recorded(t, response, entries, phases)?);
    }
    let rank = t.rank();
    let mut devices = entries.iter().flatten().filter_map(|e| e.device.as_ref());
    let first = devices.next().map(|d| d.context.clone());
    let ordinal = first.as_ref().map(|c| c.ordinal());
    if let (Some(ordinal), Some(other)) = (ordinal, devices.find(|d| Some(d.ordinal()) != ordinal)) {
        let message = format!(
            "rank {rank}: the tensors of one {} are on GPUs {ordinal} and {}; rvod runs one op's tensors on one GPU",
            response.kind,
            other.ordinal()
        );
        return Err(StagedFailure::Gpu(EngineError::Gpu(message)));
    }
    let ran = match route.way(t, ordinal)? {
        Way::Refused(why) => {
            let err = EngineError::Gpu(why.to_string());
            return Ok(entries.iter().map(|_| Err(err.clone())).collect());
        }
        Way::Staging => None,
        Way::Nccl(nccl) => match planned(nccl, response) {
            Ok(plan) => Some(keeping_current_device(&nccl.context, rank, || {
                Ok(execute_nccl::execute(nccl, &plan, response, entries, phases))
            })?),
            Err(why) => {
                tracing::debug!("{} of '{}' goes through host staging: {why}", response.kind, first_name(response));
                None
            }
        },
    };
    match ran {
        Some(Ok(results)) => return Ok(results),
        Some(Err(why)) => {
            route.fail(&why);
            return Err(StagedFailure::Gpu(EngineError::Gpu(why)));
        }
        None => {}
    }
    // A rank without a tensor on a GPU here (it joined) takes part with the host executor's zeros.
    let Some(context) = first else {
        return Ok(executor.execute_recorded(t, response, entries, phases)?);
    };
    keeping_current_device(&context, rank, || staged(executor, &context, t, response, entries, phases))
}

fn first_name(response: &Response) -> &str {
    response.entries.first().map_or("", |e| e.name.as_str())
}

/// The NCCL calls for `response` on this rank, or why it goes through host staging.
fn planned(route: &NcclRoute, response: &Response) -> Result<NcclPlan, String> {
    if response.entries.iter().any(|e| e.packed) {
        return Err("a packed group runs through host staging".into());
    }
    nccl_plan(response, route.comm.rank, route.comm.size, route.version)
}

/// Run `f`, which makes `context`'s GPU current, and make the thread's current device the one it was again
/// (the loop may run on a caller's thread, see `engine::driver`).
fn keeping_current_device<R>(
    context: &DeviceContext,
    rank: usize,
    f: impl FnOnce() -> Result<R, StagedFailure>,
) -> Result<R, StagedFailure> {
    let failed = |e: GpuError| StagedFailure::Gpu(EngineError::Gpu(format!("rank {rank}: {e}")));
    let runtime = context.device().runtime();
    let previous = runtime.current_device().map_err(failed)?;
    let outcome = f();
    let restored = runtime.set_current_device(previous).map_err(failed);
    let value = outcome?;
    restored?;
    Ok(value)
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
    Ok(DeviceDone { context: context.clone(), event: Arc::new(done?), queued: None })
}
