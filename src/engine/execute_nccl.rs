//! Running a response whose tensors are on GPUs through NCCL, as [`crate::gpu::plan::nccl_plan`] planned it:
//! the process set's stream waits for each input's ready event, the NCCL call(s) run on it (a fused
//! allreduce through a device fusion buffer: inputs copied in device to device, one `ncclAllReduce`, results
//! copied out), results land in place or in pooled device buffers, and the event recorded after them
//! completes each tensor's handle. A joined rank (no tensor) takes part with zeros on its GPU.
//!
//! The engine does not wait for that work: the op's handle completes once it is queued, and the op is kept
//! as [`InFlight`] until its event has completed; the loop looks at those often ([`NcclRoute::settle`],
//! through `GpuRoute::watch`), polling `ncclCommGetAsyncError` too, so a dead peer, an NCCL error or an op
//! past `RVOD_TIMEOUT` becomes an error instead of a hang: the communicator is aborted (this rank's peers'
//! NCCL calls then fail too, and work stuck on a dead peer ends) and the process set's loop ends. The engine
//! meanwhile negotiates and queues the next ops, so the GPU runs them back to back.
//!
//! For the op's caller ([`crate::gpu::tensor::Queued`]), by default (Horovod's), the op completes once its
//! work has run: `wait` and `poll` look at the event on the host, and a failure of the set's NCCL work
//! raises there. With `RVOD_ENABLE_ASYNC_COMPLETION` (Horovod's `HOROVOD_ENABLE_ASYNC_COMPLETION`) it
//! completes as soon as it is queued: the consumer's stream waits for the event and the host does not, as
//! PyTorch DDP's NCCL work does; a failure then raises at the next op (or where a host waits on the failed
//! op's results). The communicator is not destroyed under queued work.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::engine::execute::TensorResult;
use crate::engine::gpu_route::NcclRoute;
use crate::engine::table::TensorEntry;
use crate::error::EngineError;
use crate::gpu::cuda::{CudaDevice, CudaEvent};
use crate::gpu::device::{Device, DevicePtr};
use crate::gpu::nccl::wait_or_abort;
use crate::gpu::plan::NcclPlan;
use crate::gpu::runtime::PooledBuffer;
use crate::gpu::tensor::{DeviceDone, DeviceOutput, Queued};
use crate::gpu::GpuError;
use crate::protocol::message::Response;
use crate::timeline::OpRecord;

type Results = Vec<Result<TensorResult, EngineError>>;

/// The wait for an NCCL op polls its event and the communicator's error back to back for this long, then
/// this often.
const POLL: Duration = Duration::from_micros(100);

/// Run `response` on this rank through `route` as `plan` says (see the module doc). `Err`: why it failed,
/// naming the rank and GPU; the communicator must then be aborted.
pub fn execute(
    route: &NcclRoute,
    plan: &NcclPlan,
    response: &Response,
    entries: &mut [Option<TensorEntry>],
    phases: &mut OpRecord,
) -> Result<Results, String> {
    route.settle()?;
    let mut op = Op { route, gpu: route.context.device(), rank: route.comm.rank, scratch: Vec::new() };
    let ordinal = route.context.ordinal();
    op.gpu.make_current().map_err(|e| op.failed(e))?;
    for device in entries.iter().flatten().map(|e| e.device.as_ref()) {
        match device {
            Some(d) if d.ordinal() == ordinal => {
                op.gpu.wait_event(&route.stream, &d.ready).map_err(|e| op.failed(e))?
            }
            Some(d) => {
                return Err(format!(
                    "rank {}: a tensor on GPU {} in a process set whose NCCL communicator is on GPU {ordinal}; rvod \
                     runs a process set's GPU tensors on one GPU per rank",
                    op.rank,
                    d.ordinal()
                ))
            }
            None => return Err(format!("rank {}: a host tensor in a GPU collective", op.rank)),
        }
    }
    let mut results: Vec<TensorResult> = entries.iter().map(|_| TensorResult::default()).collect();
    let enqueued = op.enqueue(plan, response, entries, &mut results);
    let done = op.gpu.record(&route.stream).map_err(|e| op.failed(e));
    if let (Err(_), Ok(event)) = (&enqueued, &done) {
        // Work already queued may still read the inputs: wait for it (after the abort that follows it ends).
        let _ = op.wait(event, response);
    }
    enqueued?;
    // Work still queued may use the scratch buffers: each one's drop marks the end of that work on the set's
    // stream (their consumer), and the pool's next user waits for the mark.
    drop(op.scratch);
    phases.mark_collective();
    let event = Arc::new(done?);
    let what = format!("rank {} (GPU {}): {}", route.comm.rank, route.context.ordinal(), describe(response));
    lock(&route.in_flight).push_back(InFlight { event: event.clone(), what, since: Instant::now() });
    let queued = Queued { failure: route.failure.clone(), complete_on_host: !route.async_completion };
    let done = DeviceDone { context: route.context.clone(), event, queued: Some(queued) };
    Ok(entries
        .iter()
        .zip(results)
        .map(|(entry, mut result)| {
            if entry.is_some() {
                result.done = Some(done.clone());
            }
            Ok(result)
        })
        .collect())
}

/// An op handed back with its work still queued (see the module doc).
pub struct InFlight {
    /// Recorded after its work.
    event: Arc<CudaEvent>,
    /// "rank r (GPU g): allreduce of 'name'", for errors.
    what: String,
    /// When it was queued.
    since: Instant,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// "allreduce of 'name'": what a response is, for messages.
fn describe(response: &Response) -> String {
    format!("{} of '{}'", response.kind, response.entries.first().map_or("", |e| e.name.as_str()))
}

impl NcclRoute {
    /// Whether ops handed back still have work queued.
    pub fn has_in_flight(&self) -> bool {
        !lock(&self.in_flight).is_empty()
    }

    /// Forget the ops handed back whose work is done; `Err`, why (the communicator must then be aborted),
    /// where NCCL reported an error or the oldest still queued was queued `RVOD_TIMEOUT` ago.
    pub fn settle(&self) -> Result<(), String> {
        let mut in_flight = lock(&self.in_flight);
        let gpu = self.context.device();
        while let Some(op) = in_flight.front() {
            match gpu.query(&op.event) {
                Ok(true) => {
                    in_flight.pop_front();
                }
                Ok(false) => break,
                Err(e) => return Err(format!("{}: {e}", op.what)),
            }
        }
        let Some(oldest) = in_flight.front() else { return Ok(()) };
        self.comm.async_error()?;
        if oldest.since.elapsed() >= self.timeout {
            return Err(format!(
                "{} did not complete within {:.0} s (RVOD_TIMEOUT); the NCCL communicator was aborted",
                oldest.what,
                self.timeout.as_secs_f64()
            ));
        }
        Ok(())
    }

    /// Wait until the work of every op handed back has run: `Err`, why, on an NCCL error or after
    /// `RVOD_TIMEOUT` (the communicator must then be aborted).
    pub fn drain(&self) -> Result<(), String> {
        if self.comm.is_aborted() {
            return Ok(()); // its work ends without the communicator
        }
        let Some((event, what)) = lock(&self.in_flight).back().map(|op| (op.event.clone(), op.what.clone())) else {
            return Ok(());
        };
        let gpu = self.context.device();
        let comm = &self.comm;
        let query = || gpu.query(&event).map_err(|e| format!("{what}: {e}"));
        wait_or_abort(query, || comm.async_error(), |_| {}, self.timeout, POLL, &what)?;
        lock(&self.in_flight).clear();
        Ok(())
    }
}

impl Drop for NcclRoute {
    /// The communicator is not destroyed under work still queued: wait for it (an NCCL error or
    /// `RVOD_TIMEOUT` aborts it, and its waiters raise).
    fn drop(&mut self) {
        if let Err(why) = self.drain() {
            let _ = self.failure.set(why.clone());
            self.comm.abort();
            tracing::warn!("closing the process set's NCCL communicator: {why}");
        }
    }
}

/// One response's NCCL work on this rank.
struct Op<'a> {
    route: &'a NcclRoute,
    gpu: &'a CudaDevice,
    rank: usize,
    /// Device memory the work uses besides inputs and results (the fusion buffer, a joined rank's zeros),
    /// kept until it has completed.
    scratch: Vec<PooledBuffer>,
}

impl Op<'_> {
    fn failed(&self, e: GpuError) -> String {
        format!("rank {}: {e}", self.rank)
    }

    /// A result buffer of `len` bytes (the framework reads it; see `gpu::runtime`).
    fn output(&self, len: usize) -> Result<PooledBuffer, String> {
        self.route.context.buffer_for(len, &self.route.stream).map_err(|e| self.failed(e))
    }

    /// `len` bytes of device memory for this op only (`what` names it in an allocation failure).
    fn scratch(&mut self, len: usize, what: &str) -> Result<DevicePtr, String> {
        let mut buffer = self.route.context.buffer_for(len, &self.route.stream).map_err(|e| {
            format!(
                "rank {}: cannot allocate {what} ({len} bytes) on GPU {}: {e}",
                self.rank,
                self.route.context.ordinal()
            )
        })?;
        buffer.set_consumer(Some(self.route.stream.raw() as usize));
        let ptr = buffer.ptr();
        self.scratch.push(buffer);
        Ok(ptr)
    }

    fn zeros(&mut self, len: usize) -> Result<DevicePtr, String> {
        let ptr = self.scratch(len, "a joined rank's zeros")?;
        // SAFETY: a scratch buffer of `len` bytes, kept until the op's work has completed.
        unsafe { self.gpu.zero(&self.route.stream, ptr, len) }.map_err(|e| self.failed(e))?;
        Ok(ptr)
    }

    /// The device address of `entry`'s input, which must hold at least `need` bytes.
    fn input(&self, entry: &TensorEntry, need: usize) -> Result<DevicePtr, String> {
        match &entry.device {
            Some(d) if d.len >= need => Ok(d.ptr),
            Some(d) => Err(format!(
                "rank {}: tensor '{}' holds {} bytes, and its {} reads {need}",
                self.rank, entry.request.name, d.len, entry.request.params.kind
            )),
            None => Err(format!("rank {}: tensor '{}' is not on a GPU", self.rank, entry.request.name)),
        }
    }

    fn copy(&self, src: DevicePtr, dst: DevicePtr, len: usize) -> Result<(), String> {
        // SAFETY: callers pass inputs, results and scratch buffers of at least `len` bytes, alive until the
        // op's work has completed (the framework keeps inputs alive until the handle completes).
        unsafe { self.gpu.copy_on_device(&self.route.stream, src, dst, len) }.map_err(|e| self.failed(e))
    }

    /// Wait for the op's work (see the module doc).
    fn wait(&self, event: &CudaEvent, response: &Response) -> Result<(), String> {
        let what = describe(response);
        let comm = &self.route.comm;
        wait_or_abort(
            || self.gpu.query(event).map_err(|e| self.failed(e)),
            || comm.async_error(),
            |why| {
                // Before the abort, which lets queued work end: the waiters of ops handed back read it.
                let _ = self.route.failure.set(why.to_string());
                comm.abort();
            },
            self.route.timeout,
            POLL,
            &format!("rank {} (GPU {}): {what}", self.rank, self.route.context.ordinal()),
        )
    }

    /// Enqueue the plan's NCCL calls (and copies) on the set's stream; results go into `results`.
    fn enqueue(
        &mut self,
        plan: &NcclPlan,
        response: &Response,
        entries: &[Option<TensorEntry>],
        results: &mut [TensorResult],
    ) -> Result<(), String> {
        let dtype = response.dtype;
        let size = dtype.size();
        let (route, rank) = (self.route, self.rank);
        let comm = &route.comm;
        let stream = route.stream.raw();
        let spec = response.entries.first();
        let reduction = move |op| comm.reduction(op, dtype).map_err(|e| format!("rank {rank}: {e}"));
        let one = |what: &str| single(entries, rank, what);
        match *plan {
            NcclPlan::AllReduce { count, dtype: nccl_dtype, op } => {
                let reduction = reduction(op)?;
                if let ([entry], [spec]) = (entries, response.entries.as_slice()) {
                    let len = count * size;
                    let (send, recv) = match entry {
                        Some(e) if e.in_place => {
                            let input = self.input(e, len)?;
                            (input, input)
                        }
                        Some(e) => {
                            let input = self.input(e, len)?;
                            let out = self.output(len)?;
                            let recv = out.ptr();
                            results[0].device_output =
                                Some(DeviceOutput { buffer: out, shape: spec.shape.clone(), dtype });
                            (input, recv)
                        }
                        None => {
                            let zeros = self.zeros(len)?;
                            (zeros, zeros)
                        }
                    };
                    if count > 0 {
                        // SAFETY: `send` and `recv` hold `count` elements (checked above) until the op completes.
                        unsafe { comm.all_reduce(send.0, recv.0, count, nccl_dtype, reduction.code, stream) }?;
                    }
                    return Ok(());
                }
                // Fused: through a fusion buffer on the device, the tensors back to back.
                let total = count * size;
                let fusion = self
                    .scratch(total, "the fusion buffer")
                    .map_err(|e| format!("{e}; a smaller RVOD_FUSION_THRESHOLD makes the fusion buffer smaller"))?;
                let lens: Vec<usize> = response.entries.iter().map(|spec| spec.num_elements() * size).collect();
                let mut offset = 0;
                for (entry, &len) in entries.iter().zip(&lens) {
                    match entry {
                        Some(e) => self.copy(self.input(e, len)?, fusion.offset(offset), len)?,
                        // SAFETY: inside the fusion buffer, kept until the op's work has completed.
                        None => unsafe { self.gpu.zero(&self.route.stream, fusion.offset(offset), len) }
                            .map_err(|e| self.failed(e))?,
                    }
                    offset += len;
                }
                if count > 0 {
                    // SAFETY: the fusion buffer holds `count` elements until the op completes.
                    unsafe { comm.all_reduce(fusion.0, fusion.0, count, nccl_dtype, reduction.code, stream) }?;
                }
                let mut offset = 0;
                for (((entry, &len), spec), result) in entries.iter().zip(&lens).zip(&response.entries).zip(results) {
                    match entry {
                        Some(e) if e.in_place => self.copy(fusion.offset(offset), self.input(e, len)?, len)?,
                        Some(_) => {
                            let out = self.output(len)?;
                            self.copy(fusion.offset(offset), out.ptr(), len)?;
                            result.device_output = Some(DeviceOutput { buffer: out, shape: spec.shape.clone(), dtype });
                        }
                        None => {}
                    }
                    offset += len;
                }
                Ok(())
            }
            NcclPlan::Broadcast { count, dtype: nccl_dtype, root } => {
                let entry = one("broadcast")?;
                let len = count * size;
                let input = self.input(entry, len)?;
                let recv = if entry.in_place {
                    input
                } else {
                    let out = self.output(len)?;
                    let recv = out.ptr();
                    let shape = entry.request.params.shape.clone();
                    results[0].device_output = Some(DeviceOutput { buffer: out, shape, dtype });
                    recv
                };
                if count > 0 {
                    // SAFETY: both hold `count` elements until the op completes.
                    unsafe { comm.broadcast(input.0, recv.0, count, nccl_dtype, root, stream) }?;
                }
                Ok(())
            }
            NcclPlan::AllGather { count, dtype: nccl_dtype } => {
                let entry = one("allgather")?;
                let input = self.input(entry, count * size)?;
                let out = self.output(count * comm.size * size)?;
                if count > 0 {
                    // SAFETY: the input holds `count` elements, the output `count * size`, until the op completes.
                    unsafe { comm.all_gather(input.0, out.ptr().0, count, nccl_dtype, stream) }?;
                }
                let shape = spec.map(|s| s.allgather_shape()).unwrap_or_default();
                results[0].device_output = Some(DeviceOutput { buffer: out, shape, dtype });
                Ok(())
            }
            NcclPlan::AllGatherV { ref parts, dtype: nccl_dtype } => {
                let entry = one("allgather")?;
                let mine = parts.iter().find(|(root, _, _)| *root == comm.rank).map_or(0, |&(_, _, count)| count);
                let input = self.input(entry, mine * size)?;
                let total: usize = parts.iter().map(|&(_, _, count)| count).sum();
                let out = self.output(total * size)?;
                let base = out.ptr();
                comm.group(|comm| {
                    for &(root, offset, count) in parts.iter().filter(|(_, _, count)| *count > 0) {
                        let recv = base.offset(offset * size);
                        // The root sends its input; the others' send buffer is not read (NCCL's broadcast).
                        let send = if root == comm.rank { input } else { recv };
                        // SAFETY: the root's input holds `count` elements, the output `total`, until the op
                        // completes.
                        unsafe { comm.broadcast(send.0, recv.0, count, nccl_dtype, root, stream) }?;
                    }
                    Ok(())
                })?;
                let shape = spec.map(|s| s.allgather_shape()).unwrap_or_default();
                results[0].device_output = Some(DeviceOutput { buffer: out, shape, dtype });
                Ok(())
            }
            NcclPlan::Exchange { ref sends, ref recvs, dtype: nccl_dtype } => {
                let entry = one("alltoall")?;
                let sent = sends.iter().map(|&(_, offset, count)| offset + count).max().unwrap_or(0);
                let input = self.input(entry, sent * size)?;
                let received: usize = recvs.iter().map(|&(_, _, count)| count).sum();
                let out = self.output(received * size)?;
                let at = |base: DevicePtr, list: &[(usize, usize, usize)]| -> Vec<(usize, u64, usize)> {
                    list.iter()
                        .filter(|(_, _, count)| *count > 0)
                        .map(|&(peer, offset, count)| (peer, base.offset(offset * size).0, count))
                        .collect()
                };
                // SAFETY: every range lies inside the input or the output (sizes checked above), alive until
                // the op completes.
                unsafe { comm.exchange(&at(input, sends), &at(out.ptr(), recvs), nccl_dtype, stream) }?;
                let rows = received_rows(response, rank, comm.size);
                let mut shape = entry.request.params.shape.clone();
                if let Some(first) = shape.first_mut() {
                    *first = rows.iter().sum();
                }
                results[0].device_output = Some(DeviceOutput { buffer: out, shape, dtype });
                results[0].received_splits = Some(rows);
                Ok(())
            }
            NcclPlan::ReduceScatter { recv_count, dtype: nccl_dtype, op } => {
                let entry = one("reducescatter")?;
                let reduction = reduction(op)?;
                let input = self.input(entry, recv_count * comm.size * size)?;
                let out = self.output(recv_count * size)?;
                if recv_count > 0 {
                    // SAFETY: the input holds `recv_count * size` elements, the output `recv_count`.
                    unsafe {
                        comm.reduce_scatter(input.0, out.ptr().0, recv_count, nccl_dtype, reduction.code, stream)
                    }?;
                }
                let mut shape = entry.request.params.shape.clone();
                if let Some(first) = shape.first_mut() {
                    *first /= comm.size.max(1) as i64;
                }
                results[0].device_output = Some(DeviceOutput { buffer: out, shape, dtype });
                Ok(())
            }
        }
    }
}

/// This rank's one tensor of a collective that is never fused (a joined rank takes part in allreduces only).
fn single<'e>(entries: &'e [Option<TensorEntry>], rank: usize, what: &str) -> Result<&'e TensorEntry, String> {
    match entries {
        [Some(entry)] => Ok(entry),
        _ => Err(format!("rank {rank}: a {what} takes one tensor of this rank's")),
    }
}

/// The rows this rank (`me` of `n`) receives from each sender in an alltoall: its column of the splits
/// matrix (row = sender), as the host path reads it.
fn received_rows(response: &Response, me: usize, n: usize) -> Vec<i64> {
    let matrix = response.entries.first().map_or(&[][..], |s| s.per_rank.as_slice());
    (0..n).map(|sender| matrix.get(sender * n + me).map_or(0, |&rows| rows.max(0))).collect()
}
