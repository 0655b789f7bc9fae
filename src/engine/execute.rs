//! Running one agreed response on this rank: gathering its tensors (zeros for a joined rank), packing
//! fused tensors and packed groups (into the shared-memory staging area where the transport has one, else
//! into a private fusion buffer), calling the collective algorithm, scaling, and producing each tensor's
//! result.
//!
//! A transport failure is returned as `Err` (the engine treats it as fatal); everything else becomes a
//! per-tensor result.

use crate::coordinator::negotiation::EagerOp;
use crate::engine::algorithms::Algorithms;
use crate::engine::execute_compressed;
use crate::engine::table::TensorEntry;
use crate::error::EngineError;
use crate::fusion::layout::{FusionLayout, FusionSlot};
use crate::fusion::packing::{gather, scatter};
use crate::fusion::reducescatter_fuses;
use crate::fusion::tensor_io::{Produced, TensorIo, TensorMemory};
use crate::gpu::tensor::{DeviceDone, DeviceOutput};
use crate::protocol::message::{shape_elements, Response, ResponseEntry};
use crate::ring;
use crate::ring::choice::Named;
use crate::ring::chunks::Blocks;
use crate::ring::compressed::{self, Feedback};
use crate::ring::hierarchical::Step;
use crate::ring::staged::{OwnPiece, StagedAllreduce};
use crate::tensor::OutputTensor;
use crate::tensor::{copy_streaming, AlignedBuffer, RawTensor, STREAMING_MIN_BYTES};
use crate::timeline::{OpRecord, Stage};
use crate::transport::composite::HostLayout;
use crate::transport::{HostParts, Transport, TransportError};
use crate::types::{CollectiveKind, Combine, DataType, ReduceOp};

/// What one tensor of a response produced.
#[derive(Debug, Default)]
pub struct TensorResult {
    pub output: Option<OutputTensor>,
    pub received_splits: Option<Vec<i64>>,
    pub last_joined_rank: Option<i32>,
    /// A packed group: each member's (output slot, result), `None` where written in place.
    pub members: Vec<(usize, Option<OutputTensor>)>,
    /// A tensor on a GPU: its out-of-place result there (`output` is then `None`).
    pub device_output: Option<DeviceOutput>,
    /// A tensor on a GPU: the event after which its result is written.
    pub done: Option<DeviceDone>,
}

impl From<Produced> for TensorResult {
    fn from(produced: Produced) -> TensorResult {
        match produced {
            Produced::InPlace => TensorResult::default(),
            Produced::Tensor(output) => TensorResult { output: Some(output), ..TensorResult::default() },
            Produced::Members(members) => TensorResult { members, ..TensorResult::default() },
        }
    }
}

/// `entry`'s tensor of `len` bytes (`None`: a joined rank's) as the fusion buffer's packing reads and
/// writes it.
fn tensor_io(entry: Option<&mut TensorEntry>, len: usize, dtype: DataType) -> TensorIo<'_> {
    TensorIo::new(entry.map_or(TensorMemory::Joined, TensorEntry::memory), len, dtype)
}

/// The first `len` bytes of `buffer`, made (or grown to) at least that long.
fn grown(buffer: &mut Option<AlignedBuffer>, len: usize) -> &mut [u8] {
    let buffer = buffer.get_or_insert_with(|| AlignedBuffer::zeroed(len));
    buffer.ensure_len(len);
    &mut buffer.as_mut_slice()[..len]
}

/// Reusable memory for fused and scratch work; grows to the largest need and stays.
#[derive(Default)]
pub struct Executor {
    fusion_buffer: Option<AlignedBuffer>,
    hierarchy: HierarchyChoice,
    /// Working memory of Adasum allreduces.
    adasum_scratch: Vec<u8>,
    /// Compressed allreduces' per-tensor state (residuals, PowerSGD factors).
    feedback: Feedback,
    /// Compressed allreduces' values as float32.
    compressed_values: Vec<f32>,
    /// How compressed allreduces run (the configuration's choices).
    compression: compressed::Settings,
    /// Which flat algorithm each allreduce, allgather and broadcast runs.
    algorithms: Algorithms,
}

/// Whether allreduce and allgather take the hierarchical algorithms on communicators that span hosts:
/// forced on or off by the configuration, or chosen by [`hierarchical_pays`].
#[derive(Clone, Copy, Debug, Default)]
pub struct HierarchyChoice {
    pub allreduce: Option<bool>,
    pub allgather: Option<bool>,
}

/// Whether a hierarchical collective of `bytes` runs on a communicator laid out as `layout`. It applies
/// where there are several hosts, all with the same number of ranks, more than one each; then it runs
/// when forced, or by default above the size where the flat allreduce on up to 4 ranks leaves recursive
/// doubling, 64 KiB (small buffers are latency-bound, and recursive doubling crosses hosts in as few
/// steps). Depends only on the
/// response and on what every rank agreed, so every rank takes the same path.
fn hierarchical_pays(forced: Option<bool>, layout: &HostLayout, bytes: usize) -> bool {
    let applies = layout.hosts() > 1 && layout.is_homogeneous() && layout.members(0).len() > 1;
    applies && forced.unwrap_or(bytes > ring::choice::RECURSIVE_DOUBLING_MAX_BYTES)
}

/// Allreduce `buf` with the algorithm `forced`, the communicator's layout and `algorithms` call for; with a
/// `src`, out of place: `buf` gets the result of reducing `src`, which is left as it is. The result comes
/// multiplied by `postscale`.
#[allow(clippy::too_many_arguments)]
fn allreduce_buffer(
    t: &mut dyn Transport,
    forced: Option<bool>,
    algorithms: &mut Algorithms,
    src: Option<&[u8]>,
    buf: &mut [u8],
    dtype: DataType,
    (combine, postscale): (Combine, f64),
    phases: &mut OpRecord,
) -> Result<(), TransportError> {
    if let Some(parts) = t.hosts() {
        if hierarchical_pays(forced, parts.layout, buf.len()) {
            tracing::debug!("hierarchical allreduce of {} bytes over {} hosts", buf.len(), parts.layout.hosts());
            if let Some(src) = src {
                buf.copy_from_slice(src);
            }
            let mut on_step = hierarchical_steps(&parts, phases);
            ring::hierarchical::allreduce(parts, buf, dtype, combine, &mut on_step)?;
            ring::scale_in_place(buf, dtype, postscale);
            return Ok(());
        }
    }
    let algorithm = algorithms.allreduce(t, buf.len());
    // Scaled by the rank that finishes each element, before it goes to the others (no pass of its own).
    ring::allreduce_scaled_by(t, src, buf, dtype, (combine, postscale), algorithm)?;
    phases.mark_algorithm(algorithm.name());
    Ok(())
}

/// What marks a hierarchical collective's steps in the timeline, named by the parts' transports.
fn hierarchical_steps<'a>(parts: &HostParts<'_>, phases: &'a mut OpRecord) -> impl FnMut(Step) + 'a {
    let (local, cross) = (parts.local.label(), parts.cross.label());
    move |step: Step| {
        let transport = if step.is_local() { local } else { cross };
        phases.mark(Stage::Hierarchical { transport, collective: step.collective() });
    }
}

/// Adasum of `buf` (tensors of `counts` elements back to back) over the communicator. Where it spans
/// several hosts with the same number of ranks each, more than one, it is hierarchical as in Horovod's
/// GPU build (Adasum across hosts of each host's average, see
/// [`ring::adasum::adasum_allreduce_hierarchical`]) unless the configuration turns hierarchical allreduce
/// off; the choice never depends on the size, so a tensor's result does not either.
fn adasum_buffer(
    t: &mut dyn Transport,
    forced: Option<bool>,
    buf: &mut [u8],
    dtype: DataType,
    counts: &[usize],
    scratch: &mut Vec<u8>,
) -> Result<(), TransportError> {
    if forced != Some(false) {
        if let Some(parts) = t.hosts() {
            let layout = parts.layout;
            if layout.hosts() > 1 && layout.is_homogeneous() && layout.members(0).len() > 1 {
                tracing::debug!("hierarchical adasum of {} bytes over {} hosts", buf.len(), layout.hosts());
                return ring::adasum::adasum_allreduce_hierarchical(parts, buf, dtype, counts, scratch);
            }
        }
    }
    ring::adasum_allreduce(t, buf, dtype, counts, scratch)
}

pub(crate) fn combine_of(op: ReduceOp) -> Combine {
    match op {
        ReduceOp::Min => Combine::Min,
        ReduceOp::Max => Combine::Max,
        ReduceOp::Product => Combine::Product,
        ReduceOp::Sum | ReduceOp::Average | ReduceOp::Adasum => Combine::Sum,
    }
}

fn postscale_of(response: &Response, size: usize) -> f64 {
    effective_postscale(response.reduce_op, response.postscale, size)
}

/// The factor a reduction's result is scaled by on `size` ranks: the postscale factor, divided by `size`
/// for an average.
pub(crate) fn effective_postscale(reduce_op: ReduceOp, postscale: f64, size: usize) -> f64 {
    if reduce_op == ReduceOp::Average {
        postscale / size as f64
    } else {
        postscale
    }
}

fn output(buffer: AlignedBuffer, shape: Vec<i64>, dtype: DataType) -> Option<OutputTensor> {
    Some(OutputTensor { buffer, shape, dtype })
}

/// Bytes of one row (all dimensions but the first) of `shape`.
fn row_bytes(shape: &[i64], dtype: DataType) -> usize {
    shape_elements(shape.get(1..).unwrap_or(&[])) * dtype.size()
}

impl Executor {
    pub fn new(hierarchy: HierarchyChoice, compression: compressed::Settings) -> Executor {
        Executor { hierarchy, compression, ..Executor::default() }
    }

    /// This executor with the configured algorithm `overrides`, logging its choices under `communicator`'s
    /// name.
    pub fn with_algorithms(self, overrides: ring::choice::AlgorithmOverrides, communicator: String) -> Executor {
        Executor { algorithms: Algorithms::new(overrides, communicator), ..self }
    }

    /// Number of tensors whose compression state (residuals, PowerSGD factors) this executor keeps.
    pub fn compressed_tensors(&self) -> usize {
        self.feedback.tensors()
    }

    /// Change the hierarchical choices (autotune; every rank does it at the same round).
    pub fn set_hierarchy(&mut self, hierarchy: HierarchyChoice) {
        self.hierarchy = hierarchy;
    }

    fn fusion_buffer(&mut self, len: usize) -> &mut [u8] {
        grown(&mut self.fusion_buffer, len)
    }

    /// Run `response`. `entries[i]` is this rank's tensor for `response.entries[i]`, or `None` if this rank
    /// joined and contributes zeros.
    pub fn execute(
        &mut self,
        t: &mut dyn Transport,
        response: &Response,
        entries: &mut [Option<TensorEntry>],
    ) -> Result<Vec<Result<TensorResult, EngineError>>, TransportError> {
        self.execute_recorded(t, response, entries, &mut OpRecord::off())
    }

    /// [`Executor::execute`], marking the op's phases in `phases` (the timeline).
    pub fn execute_recorded(
        &mut self,
        t: &mut dyn Transport,
        response: &Response,
        entries: &mut [Option<TensorEntry>],
        phases: &mut OpRecord,
    ) -> Result<Vec<Result<TensorResult, EngineError>>, TransportError> {
        if let Some((kind, message)) = &response.error {
            let err = EngineError::negotiated(*kind, message.clone());
            return Ok(entries.iter().map(|_| Err(err.clone())).collect());
        }
        let results = match response.kind {
            CollectiveKind::Allreduce => return self.allreduce(t, response, entries, phases),
            CollectiveKind::Allgather => {
                // An allgather marks its own phases (a hierarchical one has three).
                let forced = self.hierarchy.allgather;
                let algorithms = &mut self.algorithms;
                return each(entries, |e| allgather(t, forced, algorithms, response, e, phases));
            }
            CollectiveKind::Broadcast => {
                // A broadcast marks its phase with its algorithm.
                let algorithms = &mut self.algorithms;
                return each(entries, |e| broadcast(t, algorithms, response, e, phases));
            }
            CollectiveKind::Alltoall => each(entries, |e| alltoall(t, response, e)),
            CollectiveKind::Reducescatter
                if entries.len() > 1
                    && entries.iter().all(Option::is_some)
                    && (reducescatter_fuses(entries.iter().flatten().map(|e| e.input.as_slice().len()))
                        || staged_reducescatter_pays(
                            t,
                            entries.iter().flatten().map(|e| e.input.as_slice().len()).sum(),
                        )) =>
            {
                // A reduce-scatter marks its phase: the transport's collective, or staged.
                let mut fused: Vec<&mut TensorEntry> = entries.iter_mut().flatten().collect();
                let algorithms = &mut self.algorithms;
                return reducescatter_fused(t, response, &mut fused, &mut self.fusion_buffer, algorithms, phases);
            }
            CollectiveKind::Reducescatter => {
                let (size, rank, algorithms) = (t.size(), t.rank(), &mut self.algorithms);
                return each(entries, |e| reducescatter(t, response, e, (rank, size), algorithms, phases));
            }
            CollectiveKind::Barrier => Ok(entries.iter().map(|_| Ok(TensorResult::default())).collect()),
            CollectiveKind::Join => Ok(entries
                .iter()
                .map(|_| {
                    Ok(TensorResult { last_joined_rank: Some(response.last_joined_rank), ..TensorResult::default() })
                })
                .collect()),
        };
        // One phase: the transport's collective (an allreduce marks its own phases).
        phases.mark_collective();
        results
    }

    /// An allreduce by the strategy its response calls for (the choice depends on the response and on what
    /// every rank agreed, so every rank, a joined one too, takes the same): one plain tensor reduced in its own
    /// memory ([`allreduce_single`]), one rank whose tensors already hold their results
    /// ([`one_rank_in_place`]), the tensors packed into the transport's shared-memory staging areas
    /// ([`allreduce_staged`]) or into this rank's fusion buffer ([`allreduce_fused`]). Adasum has its own
    /// ([`Executor::adasum`]).
    fn allreduce(
        &mut self,
        t: &mut dyn Transport,
        response: &Response,
        entries: &mut [Option<TensorEntry>],
        phases: &mut OpRecord,
    ) -> Result<Vec<Result<TensorResult, EngineError>>, TransportError> {
        let reduction = Reduction {
            dtype: response.dtype,
            combine: combine_of(response.reduce_op),
            prescale: response.prescale,
            postscale: postscale_of(response, t.size()),
            forced: self.hierarchy.allreduce,
        };
        let Some(layout) = FusionLayout::for_response(response) else {
            let err = EngineError::Internal("fused tensors are too large to address".into());
            return Ok(entries.iter().map(|_| Err(err.clone())).collect());
        };
        if response.reduce_op == ReduceOp::Adasum {
            return self.adasum(t, response, entries, &layout);
        }
        if !response.compression.is_none() {
            let packed = grown(&mut self.fusion_buffer, layout.total_bytes());
            let scratch = execute_compressed::Scratch { packed, values: &mut self.compressed_values };
            let state = (&mut self.feedback, self.compression);
            return execute_compressed::allreduce(t, response, entries, &layout, state, scratch, phases);
        }
        let total = layout.total_bytes();
        let plain_single = matches!(response.entries.as_slice(), [spec] if !spec.packed);
        let staged = staging_pays(t, total, plain_single);
        if let ([entry], [spec], true, false) = (&mut *entries, response.entries.as_slice(), plain_single, staged) {
            return Ok(vec![Ok(allreduce_single(t, &reduction, &mut self.algorithms, entry, spec, phases)?)]);
        }
        let unscaled = reduction.prescale == 1.0 && reduction.postscale == 1.0;
        if t.size() == 1 && unscaled && entries.iter().all(|e| e.as_ref().map_or(true, |e| e.in_place)) {
            return Ok(one_rank_in_place(entries, reduction.dtype));
        }
        let slots = layout.slots();
        let mut tensors: Vec<TensorIo<'_>> = entries
            .iter_mut()
            .zip(slots)
            .map(|(entry, slot)| tensor_io(entry.as_mut(), slot.bytes, reduction.dtype))
            .collect();
        if staged {
            allreduce_staged(t, &reduction, &mut tensors, slots, total, phases)?;
        } else {
            let buffer = grown(&mut self.fusion_buffer, total);
            allreduce_fused(t, &reduction, &mut self.algorithms, &mut tensors, slots, buffer, phases)?;
        }
        Ok(tensors.into_iter().map(|io| Ok(io.finish().into())).collect())
    }
}

/// How an allreduce combines and scales, and whether it is forced (not) hierarchical.
struct Reduction {
    dtype: DataType,
    combine: Combine,
    prescale: f64,
    postscale: f64,
    forced: Option<bool>,
}

/// One plain tensor (`None`: this rank joined, and reduces zeros): reduced straight in its output, no fusion
/// buffer. Out of place and unscaled, the input is read where it is (no copy into the output first).
fn allreduce_single(
    t: &mut dyn Transport,
    reduction: &Reduction,
    algorithms: &mut Algorithms,
    entry: &mut Option<TensorEntry>,
    spec: &ResponseEntry,
    phases: &mut OpRecord,
) -> Result<TensorResult, TransportError> {
    let Reduction { dtype, combine, prescale, postscale, forced } = *reduction;
    let len = spec.num_elements() * dtype.size();
    let mut owned = None;
    let mut src = None;
    let buf: &mut [u8] = match entry {
        Some(e) if e.in_place => e.input.as_mut_slice(),
        Some(e) => {
            let copy = if prescale == 1.0 {
                src = Some(e.input.as_slice());
                AlignedBuffer::for_overwrite(len)
            } else {
                AlignedBuffer::from_slice(e.input.as_slice())
            };
            owned.insert(copy).as_mut_slice()
        }
        None => owned.insert(AlignedBuffer::zeroed(len)).as_mut_slice(),
    };
    ring::scale_in_place(buf, dtype, prescale);
    allreduce_buffer(t, forced, algorithms, src, buf, dtype, (combine, postscale), phases)?;
    let out = match (entry, owned) {
        (Some(e), Some(b)) if !e.in_place => output(b, spec.shape.clone(), dtype),
        _ => None,
    };
    Ok(TensorResult { output: out, ..TensorResult::default() })
}

/// One rank, in place, nothing to scale: every tensor already holds its result.
fn one_rank_in_place(entries: &mut [Option<TensorEntry>], dtype: DataType) -> Vec<Result<TensorResult, EngineError>> {
    entries.iter_mut().map(|e| Ok(tensor_io(e.as_mut(), 0, dtype).finish().into())).collect()
}

/// The fusion buffer in shared memory: pack straight into this rank's staging area, reduce out of everyone's
/// (this rank's own block is gathered and unpacked piece by piece, in cache), unpack the rest straight out of
/// the owners' areas.
fn allreduce_staged(
    t: &mut dyn Transport,
    reduction: &Reduction,
    tensors: &mut [TensorIo<'_>],
    slots: &[FusionSlot],
    total: usize,
    phases: &mut OpRecord,
) -> Result<(), TransportError> {
    let Reduction { dtype, combine, prescale, postscale, .. } = *reduction;
    let mut op = StagedAllreduce::begin(t, total, dtype)?;
    let own = op.own_block();
    let area = op.own_area();
    for range in [0..own.start, own.end..total] {
        let piece = &mut area[range.clone()];
        gather(tensors, slots, range.start, piece);
        ring::scale_in_place(piece, dtype, prescale);
    }
    phases.mark(Stage::MemcpyInFusionBuffer);
    op.reduce(combine, postscale, &mut |phase, offset, piece| match phase {
        OwnPiece::Contribute => {
            gather(tensors, slots, offset, piece);
            ring::scale_in_place(piece, dtype, prescale);
        }
        OwnPiece::Result => scatter(tensors, slots, offset, piece),
    })?;
    phases.mark_collective();
    for (offset, bytes) in op.others_results() {
        scatter(tensors, slots, offset, bytes);
    }
    phases.mark(Stage::MemcpyOutFusionBuffer);
    Ok(())
}

/// The tensors packed into this rank's fusion `buffer`, reduced there, and unpacked.
fn allreduce_fused(
    t: &mut dyn Transport,
    reduction: &Reduction,
    algorithms: &mut Algorithms,
    tensors: &mut [TensorIo<'_>],
    slots: &[FusionSlot],
    buffer: &mut [u8],
    phases: &mut OpRecord,
) -> Result<(), TransportError> {
    let Reduction { dtype, combine, prescale, postscale, forced } = *reduction;
    gather(tensors, slots, 0, buffer);
    ring::scale_in_place(buffer, dtype, prescale);
    phases.mark(Stage::MemcpyInFusionBuffer);
    allreduce_buffer(t, forced, algorithms, None, buffer, dtype, (combine, postscale), phases)?;
    scatter(tensors, slots, 0, buffer);
    phases.mark(Stage::MemcpyOutFusionBuffer);
    Ok(())
}

impl Executor {
    /// An Adasum allreduce: the tensors are packed into the fusion buffer and combined by
    /// [`ring::adasum_allreduce`], each tensor with its own coefficients.
    fn adasum(
        &mut self,
        t: &mut dyn Transport,
        response: &Response,
        entries: &mut [Option<TensorEntry>],
        layout: &FusionLayout,
    ) -> Result<Vec<Result<TensorResult, EngineError>>, TransportError> {
        let dtype = response.dtype;
        if !dtype.is_float() {
            let err = EngineError::InvalidArgument(format!("Adasum reduces only floating-point tensors, not {dtype}"));
            return Ok(entries.iter().map(|_| Err(err.clone())).collect());
        }
        if let ([entry], [spec]) = (&mut *entries, response.entries.as_slice()) {
            if !spec.packed {
                // One tensor: combined straight in its output, no fusion buffer.
                let len = spec.num_elements() * dtype.size();
                let mut owned = None;
                let buf: &mut [u8] = match entry {
                    Some(e) if e.in_place => e.input.as_mut_slice(),
                    Some(e) => owned.insert(AlignedBuffer::from_slice(e.input.as_slice())).as_mut_slice(),
                    None => owned.insert(AlignedBuffer::zeroed(len)).as_mut_slice(),
                };
                ring::scale_in_place(buf, dtype, response.prescale);
                let forced = self.hierarchy.allreduce;
                adasum_buffer(t, forced, buf, dtype, &[len / dtype.size()], &mut self.adasum_scratch)?;
                ring::scale_in_place(buf, dtype, response.postscale);
                let out = match (entry, owned) {
                    (Some(e), Some(b)) if !e.in_place => output(b, spec.shape.clone(), dtype),
                    _ => None,
                };
                return Ok(vec![Ok(TensorResult { output: out, ..TensorResult::default() })]);
            }
        }
        let (slots, total) = (layout.slots(), layout.total_bytes());
        // Each tensor's part of the buffer runs to the next tensor's start: the zeroed gap after it adds
        // nothing to its dot product or norms and stays zero.
        let counts: Vec<usize> = slots
            .iter()
            .enumerate()
            .map(|(i, slot)| (slots.get(i + 1).map_or(total, |next| next.offset) - slot.offset) / dtype.size())
            .collect();
        let mut tensors: Vec<TensorIo<'_>> =
            entries.iter_mut().zip(slots).map(|(entry, slot)| tensor_io(entry.as_mut(), slot.bytes, dtype)).collect();
        let mut scratch = std::mem::take(&mut self.adasum_scratch);
        let forced = self.hierarchy.allreduce;
        let buffer = self.fusion_buffer(total);
        gather(&tensors, slots, 0, buffer);
        ring::scale_in_place(buffer, dtype, response.prescale);
        let reduced = adasum_buffer(t, forced, buffer, dtype, &counts, &mut scratch);
        self.adasum_scratch = scratch;
        reduced?;
        let buffer = self.fusion_buffer(total);
        ring::scale_in_place(buffer, dtype, response.postscale);
        scatter(&mut tensors, slots, 0, buffer);
        Ok(tensors.into_iter().map(|io| Ok(io.finish().into())).collect())
    }
}

/// Whether an allreduce of `len` bytes runs through the transport's staging areas (shared memory): fused
/// tensors and packed groups do where they fit, since packing into the area replaces packing into a private
/// buffer and saves every copy through the channels (measured, 2 cores: 8 x 512 KiB fused 1.5-2.5x faster
/// on 2 ranks, 1.6-1.8x on 4; 1,024 x 4 KiB grouped ~1.25x). A single tensor is reduced in its own memory
/// over the channels, which needs no packing at all (staging it measured slower at 128 KiB on 2 ranks and
/// at 16 MiB on 4).
fn staging_pays(t: &mut dyn Transport, len: usize, plain_single: bool) -> bool {
    !plain_single && ring::staged::fits(t, len)
}

/// The timeline's algorithm of a reduce-scatter or allgather through the staging areas.
const STAGED: &str = "staged";

/// Whether a reduce-scatter of `len` bytes of input runs through the transport's staging areas
/// ([`ring::staged_blocks`]): where they fit, on three ranks or more ([`staged_reducescatters`]). Two steps of
/// all ranks instead of the ring's `n - 1` hand-offs (measured, 4 ranks on 2 cores, 6 x 4 MiB + 6 x 4 KiB
/// grouped: 21 -> 15 ms); two ranks keep their pipelined exchange (6 ms there against 9 staged), which
/// moves half the bytes of packing a whole contribution.
fn staged_reducescatter_pays(t: &mut dyn Transport, len: usize) -> bool {
    staged_reducescatters(t) && len > 0 && ring::staged::fits(t, len)
}

/// Whether an allgather whose largest block is `len` bytes runs through the transport's staging areas
/// ([`ring::staged_blocks`]), where they fit (measured, 6 x 1 MiB + 6 x 1 KiB blocks: 4 ranks on 2 cores
/// 14.5 -> 7 ms; a sharded optimizer's parameter allgathers on 2 ranks 10 -> 6 ms).
fn staged_allgather_pays(t: &mut dyn Transport, len: usize) -> bool {
    len > 0 && ring::staged::fits(t, len)
}

/// Whether `t`'s reduce-scatters go through its staging areas where they fit ([`staged_reducescatter_pays`]),
/// so that large ones fuse too (the same on every rank of a communicator: its size, and areas all or none
/// have).
pub fn staged_reducescatters(t: &mut dyn Transport) -> bool {
    t.size() >= 3 && t.staging().is_some()
}

/// Finish an allreduce, broadcast or allgather whose every contribution arrived with the round headers:
/// reduce them locally in rank order, take the root's, or concatenate them in rank order (identical bits on
/// every rank), and write the result.
pub fn execute_eager(eager: &EagerOp, entry: Option<&mut TensorEntry>) -> Result<TensorResult, EngineError> {
    let response = &eager.response;
    let dtype = response.dtype;
    let name = || response.entries.first().map_or("", |e| e.name.as_str());
    if response.kind == CollectiveKind::Allgather {
        let spec = response.entries.first();
        let parts: Option<Vec<&[u8]>> = eager.contributions.iter().map(Option::as_deref).collect();
        let (Some(spec), Some(parts)) = (spec, parts) else {
            return Err(EngineError::Internal(format!(
                "allgather of '{}': a rank's data did not come with its round header",
                name()
            )));
        };
        let mut result = AlignedBuffer::for_overwrite(parts.iter().map(|p| p.len()).sum());
        concatenate(parts, result.as_mut_slice());
        return Ok(TensorResult { output: output(result, spec.allgather_shape(), dtype), ..TensorResult::default() });
    }
    let len = response.tensor_bytes();
    let mut result = AlignedBuffer::for_overwrite(len);
    if response.kind == CollectiveKind::Broadcast {
        let root = usize::try_from(response.root_rank).ok().and_then(|root| eager.contributions.get(root));
        let Some(Some(data)) = root else {
            return Err(EngineError::Internal(format!(
                "broadcast of '{}': the root's data did not come with its round header",
                name()
            )));
        };
        result.as_mut_slice().copy_from_slice(data);
    } else {
        fold_contributions(
            eager.contributions.iter().map(Option::as_deref),
            dtype,
            combine_of(response.reduce_op),
            response.prescale,
            postscale_of(response, eager.contributions.len()),
            result.as_mut_slice(),
        );
    }
    Ok(match entry {
        Some(e) if e.packed.is_none() && !e.in_place => {
            let shape = response.entries.first().map(|e| e.shape.clone()).unwrap_or_default();
            TensorResult { output: output(result, shape, dtype), ..TensorResult::default() }
        }
        entry => {
            let mut io = tensor_io(entry, len, dtype);
            io.write(0, result.as_slice());
            io.finish().into()
        }
    })
}

/// `parts` one after another into `out` (their total length): a small allgather's result from every rank's
/// contribution in rank order; rounds and the fast lane ([`super::fast_lane`]) both build it with this.
pub fn concatenate<'a>(parts: impl IntoIterator<Item = &'a [u8]>, out: &mut [u8]) {
    let mut at = 0;
    for part in parts {
        out[at..at + part.len()].copy_from_slice(part);
        at += part.len();
    }
}

/// A small allreduce's result from every rank's contribution in rank order (`None`: a joined rank's
/// zeros), into `out`: each contribution scaled by `prescale`, combined in rank order, the result scaled by
/// `postscale`. Every rank folds the same bytes in the same order, so all get identical bits; rounds and
/// the fast lane ([`super::fast_lane`]) both fold with this.
pub fn fold_contributions<'a>(
    contributions: impl IntoIterator<Item = Option<&'a [u8]>>,
    dtype: DataType,
    combine: Combine,
    prescale: f64,
    postscale: f64,
    out: &mut [u8],
) {
    let mut first = true;
    for contribution in contributions {
        if first {
            match contribution {
                Some(data) => out.copy_from_slice(data),
                None => out.fill(0),
            }
            ring::scale_in_place(out, dtype, prescale);
            first = false;
            continue;
        }
        match contribution {
            // Unscaled: combined straight from the header's bytes, no copy.
            Some(data) if prescale == 1.0 => ring::reduce_into(out, data, dtype, combine),
            _ => {
                let mut part = match contribution {
                    Some(data) => AlignedBuffer::from_slice(data),
                    None => AlignedBuffer::zeroed(out.len()),
                };
                ring::scale_in_place(part.as_mut_slice(), dtype, prescale);
                ring::reduce_into(out, part.as_slice(), dtype, combine);
            }
        }
    }
    if first {
        out.fill(0);
    }
    ring::scale_in_place(out, dtype, postscale);
}

/// Run a one-tensor collective for each entry (these kinds are never fused).
fn each(
    entries: &mut [Option<TensorEntry>],
    mut run: impl FnMut(&mut TensorEntry) -> Result<Result<TensorResult, EngineError>, TransportError>,
) -> Result<Vec<Result<TensorResult, EngineError>>, TransportError> {
    let mut results = Vec::with_capacity(entries.len());
    for entry in entries.iter_mut() {
        results.push(match entry {
            Some(e) => run(e)?,
            None => Err(EngineError::Internal("a joined rank was asked to run a collective it cannot join".into())),
        });
    }
    Ok(results)
}

fn allgather(
    t: &mut dyn Transport,
    forced: Option<bool>,
    algorithms: &mut Algorithms,
    response: &Response,
    entry: &mut TensorEntry,
    phases: &mut OpRecord,
) -> Result<Result<TensorResult, EngineError>, TransportError> {
    let spec = &response.entries[0];
    let dtype = response.dtype;
    let bytes_per_rank = spec.allgather_bytes_per_rank(dtype);
    let Some(total) = spec.allgather_total_bytes(dtype) else {
        // Every rank reads the same response, so every rank fails the op here, before any exchange.
        let detail = format!(
            "allgather of '{}': the ranks' rows {:?} add up to more bytes than memory can address",
            spec.name, spec.per_rank
        );
        return Ok(Err(EngineError::InvalidArgument(detail)));
    };
    let mut out = AlignedBuffer::for_overwrite(total);
    let hierarchical = t.hosts().map(|parts| hierarchical_pays(forced, parts.layout, out.len()));
    if let (Some(true), Some(parts)) = (hierarchical, t.hosts()) {
        tracing::debug!("hierarchical allgather of {} bytes over {} hosts", out.len(), parts.layout.hosts());
        let mut on_step = hierarchical_steps(&parts, phases);
        ring::hierarchical::allgatherv(
            parts,
            entry.input.as_slice(),
            out.as_mut_slice(),
            &bytes_per_rank,
            &mut on_step,
        )?;
    } else if let Some(blocks) = Blocks::from_lengths(&bytes_per_rank, 1).filter(|b| {
        let largest = (0..t.size()).map(|r| b.len(r)).max().unwrap_or(0);
        !algorithms.allgather_configured() && staged_allgather_pays(t, largest)
    }) {
        algorithms.staged(t, CollectiveKind::Allgather, out.len());
        ring::staged_blocks::allgather(t, entry.input.as_slice(), out.as_mut_slice(), &blocks)?;
        phases.mark_algorithm(STAGED);
    } else {
        let algorithm = algorithms.allgather(t, out.len());
        ring::allgatherv_by(t, entry.input.as_slice(), out.as_mut_slice(), &bytes_per_rank, algorithm)?;
        phases.mark_algorithm(algorithm.name());
    }
    Ok(Ok(TensorResult { output: output(out, spec.allgather_shape(), dtype), ..TensorResult::default() }))
}

fn broadcast(
    t: &mut dyn Transport,
    algorithms: &mut Algorithms,
    response: &Response,
    entry: &mut TensorEntry,
    phases: &mut OpRecord,
) -> Result<Result<TensorResult, EngineError>, TransportError> {
    let root = response.root_rank.max(0) as usize;
    let algorithm = algorithms.broadcast(t, entry.input.len());
    if entry.in_place {
        ring::broadcast_by(t, entry.input.as_mut_slice(), root, algorithm)?;
        phases.mark_algorithm(algorithm.name());
        return Ok(Ok(TensorResult::default()));
    }
    let mut out = if t.rank() == root {
        AlignedBuffer::from_slice(entry.input.as_slice())
    } else {
        AlignedBuffer::for_overwrite(entry.input.len())
    };
    ring::broadcast_by(t, out.as_mut_slice(), root, algorithm)?;
    phases.mark_algorithm(algorithm.name());
    Ok(Ok(TensorResult {
        output: output(out, entry.request.params.shape.clone(), response.dtype),
        ..TensorResult::default()
    }))
}

fn alltoall(
    t: &mut dyn Transport,
    response: &Response,
    entry: &mut TensorEntry,
) -> Result<Result<TensorResult, EngineError>, TransportError> {
    let n = t.size();
    let me = t.rank();
    let spec = &response.entries[0];
    let dtype = response.dtype;
    let row = row_bytes(&entry.request.params.shape, dtype);
    let matrix = &spec.per_rank;
    if matrix.len() != n * n {
        return Ok(Err(EngineError::Internal(format!(
            "alltoall split matrix has {} entries for {n} ranks",
            matrix.len()
        ))));
    }
    let rows = |sender: usize, receiver: usize| matrix[sender * n + receiver].max(0) as usize;
    let send_bytes: Vec<usize> = (0..n).map(|d| rows(me, d) * row).collect();
    let recv_rows: Vec<i64> = (0..n).map(|s| rows(s, me) as i64).collect();
    let recv_bytes: Vec<usize> = recv_rows.iter().map(|&r| r as usize * row).collect();
    let send_total: usize = send_bytes.iter().sum();
    let input = entry.input.as_slice();
    if send_total > input.len() {
        return Ok(Err(EngineError::InvalidArgument(format!(
            "alltoall of tensor '{}': splits send {send_total} bytes but the tensor has {}",
            entry.request.name,
            input.len()
        ))));
    }
    let mut out = AlignedBuffer::for_overwrite(recv_bytes.iter().sum());
    ring::alltoallv(t, &input[..send_total], &send_bytes, out.as_mut_slice(), &recv_bytes)?;
    let mut shape = entry.request.params.shape.clone();
    if let Some(first) = shape.first_mut() {
        *first = recv_rows.iter().sum();
    }
    Ok(Ok(TensorResult {
        output: output(out, shape, dtype),
        received_splits: Some(recv_rows),
        ..TensorResult::default()
    }))
}

/// Elements of each rank's block of a reduce-scatter of a tensor of `shape` over `size` ranks: whole rows
/// of the first dimension, the first `rows % size` ranks one row more.
fn reducescatter_blocks(shape: &[i64], size: usize) -> Vec<usize> {
    let dim0 = shape.first().copied().unwrap_or(0).max(0) as usize;
    let row_elements = shape_elements(shape.get(1..).unwrap_or(&[]));
    (0..size).map(|r| (dim0 / size + usize::from(r < dim0 % size)) * row_elements).collect()
}

/// The shape of rank `rank`'s result of a reduce-scatter of a tensor of `shape` over `size` ranks.
fn reducescatter_shape(shape: &[i64], rank: usize, size: usize) -> Vec<i64> {
    let mut out_shape = shape.to_vec();
    if let Some(first) = out_shape.first_mut() {
        let dim0 = (*first).max(0) as usize;
        *first = (dim0 / size + usize::from(rank < dim0 % size)) as i64;
    }
    out_shape
}

/// Several reduce-scatters fused (one dtype, op and scale factors) as one reduce-scatter: block `r` of the
/// fused input holds block `r` of every tensor in turn, so this rank's block of the fused result holds its
/// block of each tensor side by side. One copy of the inputs into the staging area where it pays
/// ([`staged_reducescatter_pays`]), else into the executor's fusion buffer for the ring, and one of this rank's
/// blocks out, for one collective instead of one per tensor.
fn reducescatter_fused(
    t: &mut dyn Transport,
    response: &Response,
    entries: &mut [&mut TensorEntry],
    fusion_buffer: &mut Option<AlignedBuffer>,
    algorithms: &mut Algorithms,
    phases: &mut OpRecord,
) -> Result<Vec<Result<TensorResult, EngineError>>, TransportError> {
    let (rank, size) = (t.rank(), t.size());
    let dtype = response.dtype;
    let element = dtype.size();
    let blocks: Vec<Vec<usize>> = entries.iter().map(|e| reducescatter_blocks(&e.request.params.shape, size)).collect();
    let fused_blocks: Vec<usize> = (0..size).map(|r| blocks.iter().map(|b| b[r]).sum()).collect();
    // Each tensor's block goes into the caller's memory where it gave some of the right size, else into a
    // new buffer (a wrong size is refused in `completed`).
    let mut intos: Vec<Option<RawTensor>> =
        entries.iter_mut().zip(&blocks).map(|(e, b)| e.into.take_if(|into| into.len() == b[rank] * element)).collect();
    let mut owned: Vec<Option<AlignedBuffer>> = (intos.iter().zip(&blocks))
        .map(|(into, b)| into.is_none().then(|| AlignedBuffer::for_overwrite(b[rank] * element)))
        .collect();
    let mut outs: Vec<&mut [u8]> = (owned.iter_mut().zip(intos.iter_mut()))
        .map(|(own, into)| match (own, into) {
            (Some(buffer), _) => buffer.as_mut_slice(),
            (None, into) => into.as_mut().map_or(&mut [][..], RawTensor::as_mut_slice),
        })
        .collect();
    let mut pack = |packed: &mut [u8]| {
        let copy = copy_for(packed.len());
        let mut at = 0;
        for r in 0..size {
            for (entry, tensor_blocks) in entries.iter().zip(&blocks) {
                let start = tensor_blocks[..r].iter().sum::<usize>() * element;
                let len = tensor_blocks[r] * element;
                copy(&mut packed[at..at + len], &entry.input.as_slice()[start..start + len]);
                at += len;
            }
        }
        ring::scale_in_place(&mut packed[..at], dtype, response.prescale);
    };
    let (combine, postscale) = (combine_of(response.reduce_op), postscale_of(response, size));
    if let Some(staged) =
        Blocks::from_lengths(&fused_blocks, element).filter(|b| staged_reducescatter_pays(t, b.total()))
    {
        // Packed straight into this rank's staging area; the reduced pieces go straight to the outputs.
        algorithms.staged(t, CollectiveKind::Reducescatter, staged.total());
        let mut deliver = scatter_into(&mut outs);
        ring::staged_blocks::reducescatter(t, &mut pack, &staged, dtype, combine, postscale, &mut deliver)?;
        phases.mark_algorithm(STAGED);
    } else {
        let packed = grown(fusion_buffer, fused_blocks.iter().sum::<usize>() * element);
        pack(packed);
        let mut out = AlignedBuffer::for_overwrite(fused_blocks[rank] * element);
        ring::reducescatter(t, packed, &fused_blocks, dtype, combine, postscale, out.as_mut_slice())?;
        scatter_into(&mut outs)(0, out.as_slice());
        phases.mark_collective();
    }
    drop(outs);
    Ok(entries
        .iter()
        .zip(owned)
        .map(|(entry, mine)| {
            let shape = reducescatter_shape(&entry.request.params.shape, rank, size);
            Ok(TensorResult { output: mine.and_then(|mine| output(mine, shape, dtype)), ..TensorResult::default() })
        })
        .collect())
}

/// How a contribution of `len` bytes is packed: with streaming stores where it is large (it goes out to
/// memory before anyone reads it, so reading the destination in first would be wasted).
fn copy_for(len: usize) -> fn(&mut [u8], &[u8]) {
    if len >= STREAMING_MIN_BYTES {
        copy_streaming
    } else {
        |dst, src| dst.copy_from_slice(src)
    }
}

/// Writes consecutive pieces of bytes, handed over in order from offset 0, across `outs` one after another.
fn scatter_into<'a, 'b>(outs: &'a mut [&'b mut [u8]]) -> impl FnMut(usize, &[u8]) + use<'a, 'b> {
    let (mut index, mut at) = (0, 0);
    move |_offset, mut piece: &[u8]| {
        while !piece.is_empty() {
            let out = &mut *outs[index];
            if at == out.len() {
                (index, at) = (index + 1, 0); // full, or empty (a tensor of fewer rows than ranks)
                continue;
            }
            let n = (out.len() - at).min(piece.len());
            out[at..at + n].copy_from_slice(&piece[..n]);
            (piece, at) = (&piece[n..], at + n);
        }
    }
}

fn reducescatter(
    t: &mut dyn Transport,
    response: &Response,
    entry: &mut TensorEntry,
    (rank, size): (usize, usize),
    algorithms: &mut Algorithms,
    phases: &mut OpRecord,
) -> Result<Result<TensorResult, EngineError>, TransportError> {
    let dtype = response.dtype;
    let shape = &entry.request.params.shape;
    let elems_per_rank = reducescatter_blocks(shape, size);
    let len = elems_per_rank[rank] * dtype.size();
    // The caller's memory where it gave some of the right size (else a new buffer; see `completed`).
    let mut owned = None;
    let out: &mut [u8] = match entry.into.as_mut().filter(|into| into.len() == len) {
        Some(into) => into.as_mut_slice(),
        None => owned.insert(AlignedBuffer::for_overwrite(len)).as_mut_slice(),
    };
    let combine = combine_of(response.reduce_op);
    let input = entry.input.as_slice();
    let staged =
        Blocks::from_lengths(&elems_per_rank, dtype.size()).filter(|b| staged_reducescatter_pays(t, b.total()));
    if let Some(blocks) = staged {
        let mut pack = |area: &mut [u8]| {
            copy_for(area.len())(area, input);
            ring::scale_in_place(area, dtype, response.prescale);
        };
        let postscale = postscale_of(response, size);
        let mut deliver = |offset: usize, piece: &[u8]| out[offset..offset + piece.len()].copy_from_slice(piece);
        algorithms.staged(t, CollectiveKind::Reducescatter, blocks.total());
        ring::staged_blocks::reducescatter(t, &mut pack, &blocks, dtype, combine, postscale, &mut deliver)?;
        phases.mark_algorithm(STAGED);
    } else {
        // The input is read where it is, unless it must be scaled first.
        let scaled = (response.prescale != 1.0).then(|| {
            let mut copy = AlignedBuffer::from_slice(input);
            ring::scale_in_place(copy.as_mut_slice(), dtype, response.prescale);
            copy
        });
        let input = scaled.as_ref().map_or(input, AlignedBuffer::as_slice);
        let postscale = postscale_of(response, size);
        ring::reducescatter(t, input, &elems_per_rank, dtype, combine, postscale, out)?;
        phases.mark_collective();
    }
    let out_shape = reducescatter_shape(shape, rank, size);
    Ok(Ok(TensorResult { output: owned.and_then(|out| output(out, out_shape, dtype)), ..TensorResult::default() }))
}
