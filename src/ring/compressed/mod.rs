//! Compressed allreduce of floating-point tensors with error feedback ([`Compression`] other than none).
//!
//! The executor hands over one dense float32 vector holding every tensor of the op back to back (converted
//! from the tensors' dtype, prescaled) and a [`Span`] per tensor; an algorithm leaves in it the approximate
//! sum of every rank's values, the same bits on every rank. What a rank could not send is kept per tensor
//! name in [`Feedback`] and added to that tensor's values the next time, so changes of fusion leave it
//! intact.
//!
//! - [`blocks`]: the int8 and 1-bit block codecs.
//! - [`quantized`]: the int8 and 1-bit allreduce, a reduce-scatter and an allgather of encoded blocks.
//! - [`powersgd`]: PowerSGD's allreduce of low-rank factors.
//! - [`feedback`]: the per-tensor state (residuals, PowerSGD's warm-started factors).
//!
//! [`Compression`]: crate::types::Compression

/// Define `fn $name` whose body runs compiled for AVX2 where the CPU has it (checked at run time: the wheel
/// targets baseline x86-64) and as baseline code elsewhere. The arithmetic is the same either way (no fused
/// multiply-add, partial sums in a fixed order), so every rank gets the same bits whatever its CPU.
/// Everything the body calls must be `#[inline(always)]` to be compiled for AVX2 with it.
macro_rules! wide_where_possible {
    ($(#[$doc:meta])* fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $body:block) => {
        $(#[$doc])*
        fn $name($($arg: $ty),*) {
            #[inline(always)]
            fn body($($arg: $ty),*) $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx2")]
                fn wide($($arg: $ty),*) {
                    body($($arg),*)
                }
                if std::arch::is_x86_feature_detected!("avx2") {
                    // SAFETY: the CPU has AVX2, just checked.
                    return unsafe { wide($($arg),*) };
                }
            }
            body($($arg),*)
        }
    };
}

pub mod blocks;
pub mod feedback;
pub mod powersgd;
pub mod quantized;

pub use feedback::Feedback;

use crate::ring::allgather::allgather_ring;
use crate::ring::args::invalid_argument;
use crate::ring::chunks::Blocks;
use crate::ring::reducescatter::reduce_scatter_ring;
use crate::transport::{HostParts, Transport, TransportError};
use crate::types::{Combine, Compression, DataType};

/// How compressed allreduces run, from the configuration.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Settings {
    /// Compress inside one host's shared memory too (`RVOD_COMPRESSION_WITHIN_HOST`).
    pub within_host: bool,
    /// Reduce each tensor exactly for its first this many steps (`RVOD_COMPRESSION_WARMUP_STEPS`), as DDP's
    /// PowerSGD hook (`start_powerSGD_iter`) and 1-bit Adam's warm-up do: early gradients change fast and
    /// the compressors' memory of them would lag.
    pub warmup_steps: u64,
}

/// One tensor's place in the dense vector of an op's values.
#[derive(Clone, Copy, Debug)]
pub struct Span<'a> {
    /// The tensor's name, which keys its error feedback.
    pub name: &'a str,
    /// Its shape (PowerSGD reads it as a matrix of `shape[0]` rows).
    pub shape: &'a [i64],
    /// Its first element in the dense vector.
    pub start: usize,
    /// Its number of elements.
    pub len: usize,
    /// This rank submitted it (a joined rank contributes zeros and keeps no residual for it).
    pub contributes: bool,
}

impl Span<'_> {
    pub(crate) fn range(&self) -> std::ops::Range<usize> {
        self.start..self.start + self.len
    }
}

/// Where a tensor's values come from and its result goes when an algorithm reads and writes the caller's
/// memory itself (PowerSGD's compressed matrices, see [`powersgd::compresses`]) rather than through the op's
/// dense vector, which saves a copy in and a copy out of every value.
pub enum Memory<'m> {
    /// Through the dense vector: filled (and prescaled) before the algorithm runs, read (and postscaled)
    /// after.
    Values,
    /// The caller's float32 tensor, read and then overwritten with the result.
    InPlace(&'m mut [f32]),
    /// Read from the first, the result written into the second.
    Separate(&'m [f32], &'m mut [f32]),
}

impl Memory<'_> {
    /// What to read the tensor's values from, where not from the dense vector.
    fn source(&self) -> Option<&[f32]> {
        match self {
            Memory::Values => None,
            Memory::InPlace(memory) => Some(memory),
            Memory::Separate(input, _) => Some(input),
        }
    }

    /// Where to write the tensor's result, where not into the dense vector.
    fn destination(&mut self) -> Option<&mut [f32]> {
        match self {
            Memory::Values => None,
            Memory::InPlace(memory) => Some(memory),
            Memory::Separate(_, output) => Some(output),
        }
    }
}

/// The factors an op's values are scaled by before (`pre`) and after (`post`) the reduction, for the
/// tensors an algorithm reads and writes itself ([`Memory`]); the executor scales the others.
#[derive(Clone, Copy, Debug)]
pub struct Scales {
    pub pre: f32,
    pub post: f32,
}

/// Allreduce (sum) `values`, the tensors of `spans` back to back, compressed as `compression` says, with
/// each tensor's error feedback from and into `feedback`. On one rank nothing is sent and `values` stays.
pub fn allreduce(
    t: &mut dyn Transport,
    compression: Compression,
    values: &mut [f32],
    spans: &[Span<'_>],
    feedback: &mut Feedback,
) -> Result<(), TransportError> {
    if let Some(span) = spans.iter().find(|s| s.start.checked_add(s.len).map_or(true, |end| end > values.len())) {
        let detail = format!("tensor '{}' lies outside the op's {} values", span.name, values.len());
        return Err(invalid_argument(t.rank(), "compressed allreduce", detail));
    }
    if t.size() == 1 {
        return Ok(());
    }
    match compression {
        Compression::None => sum_exactly(t, values),
        Compression::Int8 => quantized::allreduce(t, blocks::Codec::Int8, values, spans, feedback),
        Compression::OneBit => quantized::allreduce(t, blocks::Codec::OneBit, values, spans, feedback),
        Compression::PowerSgd { rank } => powersgd::allreduce(t, usize::from(rank), values, spans, feedback),
    }
}

/// Lay `spans` out for [`allreduce_hierarchical`]: the tensors each local rank carries across hosts (its
/// [`Feedback::carrier`]) back to back, local rank 0's first, each carrier's in the order given. Returns
/// each span's carrier and the number of values each local rank carries. The executor reads the op's values
/// into the dense vector at these places, so the hierarchical steps work on whole blocks of it in place.
pub fn group_by_carrier(
    spans: &mut [Span<'_>],
    feedback: &mut Feedback,
    local_size: usize,
) -> (Vec<usize>, Vec<usize>) {
    let carriers: Vec<usize> = spans.iter().map(|s| feedback.carrier(s.name, s.len, local_size)).collect();
    let mut carried = vec![0usize; local_size.max(1)];
    for (span, &carrier) in spans.iter().zip(&carriers) {
        carried[carrier] += span.len;
    }
    let mut next: Vec<usize> = carried
        .iter()
        .scan(0, |start, &len| {
            let here = *start;
            *start += len;
            Some(here)
        })
        .collect();
    for (span, &carrier) in spans.iter_mut().zip(&carriers) {
        span.start = next[carrier];
        next[carrier] += span.len;
    }
    (carriers, carried)
}

/// The hierarchical compressed allreduce over a communicator that spans hosts, on `values` laid out by
/// [`group_by_carrier`]: a reduce-scatter inside each host (shared memory: faster than any compression)
/// leaves each local rank the exact host sum of the tensors it carries, which it compresses across hosts
/// with the same local rank of every other host (so each tensor crosses once per host and keeps its
/// residual with its carrier), and an allgather inside the host shares the results again. Every step works
/// on the dense vector in place: no tensor is copied out for the cross-host step or back after it.
/// `on_step` is told of each step (0: the local reduce-scatter, 1: the cross-host step, 2: the local
/// allgather).
pub fn allreduce_hierarchical(
    mut parts: HostParts<'_>,
    compression: Compression,
    values: &mut [f32],
    spans: &[Span<'_>],
    feedback: &mut Feedback,
    on_step: &mut dyn FnMut(u8),
) -> Result<(), TransportError> {
    const OP: &str = "hierarchical compressed allreduce";
    let (local_rank, local_size) = (parts.local.rank(), parts.local.size());
    let mut laid_out = spans.to_vec();
    let (carriers, carried) = group_by_carrier(&mut laid_out, feedback, local_size);
    if laid_out.iter().zip(spans).any(|(want, have)| want.start != have.start)
        || carried.iter().sum::<usize>() != values.len()
    {
        let detail = "the op's values are not laid out by the tensors' carriers (group_by_carrier)".to_string();
        return Err(invalid_argument(local_rank, OP, detail));
    }
    let blocks = Blocks::from_lengths(&carried, std::mem::size_of::<f32>())
        .ok_or_else(|| invalid_argument(local_rank, OP, format!("{} values overflow", values.len())))?;
    if local_size > 1 {
        reduce_scatter_ring(&mut parts.local, None, f32_bytes_mut(values), &blocks, DataType::Float32, Combine::Sum)?;
    }
    on_step(0);
    let first = blocks.range(local_rank).start / std::mem::size_of::<f32>();
    let mine = first..first + carried[local_rank];
    let carried_spans: Vec<Span<'_>> = spans
        .iter()
        .zip(&carriers)
        .filter(|(_, &carrier)| carrier == local_rank)
        .map(|(span, _)| Span { start: span.start - first, ..*span })
        .collect();
    allreduce(&mut parts.cross, compression, &mut values[mine], &carried_spans, feedback)?;
    on_step(1);
    if local_size > 1 {
        allgather_ring(&mut parts.local, f32_bytes_mut(values), &blocks)?;
    }
    on_step(2);
    Ok(())
}

/// The exact sum of `values` over the communicator (the ring's, bit-identical on every rank).
pub(crate) fn sum_exactly(t: &mut dyn Transport, values: &mut [f32]) -> Result<(), TransportError> {
    crate::ring::allreduce(t, f32_bytes_mut(values), DataType::Float32, Combine::Sum)
}

/// `values` as their native-endian bytes.
pub(crate) fn f32_bytes(values: &[f32]) -> &[u8] {
    // SAFETY: as in `f32_bytes_mut`, borrowed shared.
    unsafe { std::slice::from_raw_parts(values.as_ptr().cast::<u8>(), std::mem::size_of_val(values)) }
}

/// `values` as their native-endian bytes, to write.
pub(crate) fn f32_bytes_mut(values: &mut [f32]) -> &mut [u8] {
    let len = std::mem::size_of_val(values);
    // SAFETY: every bit pattern is a valid u8, u8 has alignment 1, and the byte slice covers exactly the
    // memory of `values`, which it borrows mutably for its lifetime.
    unsafe { std::slice::from_raw_parts_mut(values.as_mut_ptr().cast::<u8>(), len) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn group_by_carrier_lays_each_local_ranks_tensors_back_to_back_in_their_order() {
        let names = ["a", "b", "c", "d", "e"];
        let lens = [500, 300, 0, 250, 100];
        let spans = |starts: &[usize]| -> Vec<Span<'static>> {
            names
                .iter()
                .zip(lens)
                .zip(starts)
                .map(|((name, len), &start)| Span { name, shape: &[], start, len, contributes: true })
                .collect()
        };
        let mut feedback = Feedback::default();
        let mut laid_out = spans(&[0, 500, 800, 800, 1050]);
        let (carriers, carried) = group_by_carrier(&mut laid_out, &mut feedback, 2);
        // Each new tensor goes to the rank carrying least so far (ties to the lower rank).
        assert_eq!(carriers, [0, 1, 1, 1, 0]);
        assert_eq!(carried, [600, 550]);
        let starts: Vec<usize> = laid_out.iter().map(|s| s.start).collect();
        assert_eq!(starts, [0, 600, 900, 900, 500]);
        // The carriers are kept: the same layout the next time.
        let mut again = spans(&[0; 5]);
        assert_eq!(group_by_carrier(&mut again, &mut feedback, 2), (carriers, carried));
        assert_eq!(again.iter().map(|s| s.start).collect::<Vec<_>>(), starts);
        // One local rank carries everything.
        let mut alone = spans(&[0; 5]);
        let (_, carried) = group_by_carrier(&mut alone, &mut Feedback::default(), 1);
        assert_eq!(carried, [1150]);
        assert_eq!(alone.iter().map(|s| s.start).collect::<Vec<_>>(), [0, 500, 800, 800, 1050]);
    }
}
