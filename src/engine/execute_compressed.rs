//! Running one agreed compressed allreduce (`Compression::Int8`, `OneBit`, `PowerSgd`) on this rank: its
//! tensors gathered into one float32 vector (float32 ones copied straight in, others packed and converted)
//! and prescaled, reduced by `ring::compressed` on the route the communicator calls for, then scaled and
//! written back in their own dtype. The float32 tensors PowerSGD compresses on the flat route skip the vector:
//! it reads them and writes their results itself ([`Memory`]), a copy in and a copy out less of most of
//! the op's bytes.
//!
//! Routes (the same on every rank: they depend on the transport every member shares and the configuration):
//! - across hosts: exact inside each host, compressed between hosts (`allreduce_hierarchical`) where every
//!   host has the same number of ranks; compressed among all ranks otherwise;
//! - inside one host over shared memory: exact, since memory is faster than the compression, unless
//!   `RVOD_COMPRESSION_WITHIN_HOST` forces it;
//! - any other transport (TCP, UCX between single-rank hosts): compressed among all ranks;
//! - exact, whatever the transport, during a tensor's warm-up steps (`RVOD_COMPRESSION_WARMUP_STEPS`).

use half::{bf16, f16};

use crate::engine::execute::{effective_postscale, TensorResult};
use crate::engine::table::TensorEntry;
use crate::error::EngineError;
use crate::fusion::layout::FusionLayout;
use crate::fusion::packing::{gather, scatter};
use crate::fusion::tensor_io::{TensorIo, TensorMemory};
use crate::protocol::message::Response;
use crate::ring::compressed::{self, powersgd, Feedback, Memory, Scales, Settings, Span};
use crate::timeline::{OpRecord, Stage};
use crate::transport::{Transport, TransportError};
use crate::types::{Compression, DataType};

/// How a compressed allreduce runs on this communicator.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Route {
    /// Exact: one host's shared memory.
    Exact,
    /// Exact inside hosts, compressed between them.
    Hierarchical,
    /// Compressed among all ranks.
    Flat,
}

fn route(t: &mut dyn Transport, within_host: bool) -> Route {
    if within_host {
        return Route::Flat;
    }
    let spans_hosts = t.hosts().map(|parts| parts.layout.hosts() > 1 && parts.layout.is_homogeneous());
    match spans_hosts {
        Some(true) => Route::Hierarchical,
        Some(false) => Route::Flat,
        None if t.capabilities().cheap_handoffs => Route::Exact,
        None => Route::Flat,
    }
}

/// Memory a compressed allreduce reuses from op to op (allocating and zeroing megabytes per op cost more than
/// PowerSGD's arithmetic on them): the tensors packed in their dtype, `layout`'s total bytes of the
/// executor's fusion buffer, and the values as float32.
pub(crate) struct Scratch<'a> {
    pub packed: &'a mut [u8],
    pub values: &'a mut Vec<f32>,
}

/// Run the compressed allreduce `response` (its tensors in `layout`; `entries[i]` is `None` where this
/// rank joined) as `settings` say.
pub(crate) fn allreduce(
    t: &mut dyn Transport,
    response: &Response,
    entries: &mut [Option<TensorEntry>],
    layout: &FusionLayout,
    (feedback, settings): (&mut Feedback, Settings),
    scratch: Scratch<'_>,
    phases: &mut OpRecord,
) -> Result<Vec<Result<TensorResult, EngineError>>, TransportError> {
    let (dtype, compression) = (response.dtype, response.compression);
    if !dtype.is_float() {
        let err = EngineError::InvalidArgument(format!(
            "{compression} compression applies to floating-point tensors, not {dtype}"
        ));
        return Ok(entries.iter().map(|_| Err(err.clone())).collect());
    }
    let slots = layout.slots();
    let contributes: Vec<bool> = entries.iter().map(Option::is_some).collect();
    let mut tensors: Vec<TensorIo<'_>> = entries
        .iter_mut()
        .zip(slots)
        .map(|(entry, slot)| {
            TensorIo::new(entry.as_mut().map_or(TensorMemory::Joined, TensorEntry::memory), slot.bytes, dtype)
        })
        .collect();
    let Scratch { packed, values } = scratch;
    let counts: Vec<usize> = slots.iter().map(|slot| slot.bytes / dtype.size()).collect();
    let mut spans = Vec::with_capacity(slots.len());
    let mut total = 0;
    for ((spec, &count), &contributes) in response.entries.iter().zip(&counts).zip(&contributes) {
        spans.push(Span { name: &spec.name, shape: &spec.shape, start: total, len: count, contributes });
        total += count;
    }
    feedback.begin(compression.code());
    let warm = feedback.step_past_warmup(spans.iter().map(|s| s.name), settings.warmup_steps);
    let route = if warm { route(t, settings.within_host) } else { Route::Exact };
    if route == Route::Hierarchical {
        // Each local rank's carried tensors back to back: the hierarchical steps work on blocks in place.
        let local_size = t.hosts().map_or(1, |parts| parts.local.size());
        compressed::group_by_carrier(&mut spans, feedback, local_size);
    }
    let label = t.label();
    tracing::debug!(
        "{compression} allreduce of {} tensor(s), {total} values, {route:?} over {label}: {}",
        spans.len(),
        spans.iter().map(|s| s.name).collect::<Vec<_>>().join(", ")
    );

    // Float32 tensors are read straight into `values` and their results written straight from it, except
    // those PowerSGD compresses on the flat route, which it reads and writes itself; other dtypes go through
    // the packed buffer and a conversion.
    let direct = dtype == DataType::Float32;
    let reads_itself = |span: &Span<'_>| match compression {
        Compression::PowerSgd { rank } => direct && route == Route::Flat && powersgd::compresses(span, rank.into()),
        _ => false,
    };
    let mut memories: Vec<Memory<'_>> = if direct {
        // Every value outside the tensors PowerSGD reads itself is read over: what the last op left needs no
        // clearing, and the vector only ever grows (zeroing megabytes per op costs as much as copying them).
        if values.len() < total {
            values.resize(total, 0.0);
        }
        let mut itself = Vec::with_capacity(spans.len());
        for (io, span) in tensors.iter_mut().zip(&spans) {
            itself.push(reads_itself(span) && f32_memory(io).is_some());
            if !itself[itself.len() - 1] {
                let part = &mut values[span.range()];
                io.read(0, compressed::f32_bytes_mut(part));
                scale(part, response.prescale);
            }
        }
        // `f32_memory` depends only on the tensor's memory, so it gives the same memory again: the fallback
        // is never taken.
        tensors
            .iter_mut()
            .zip(&itself)
            .map(|(io, &itself)| if itself { f32_memory(io).unwrap_or(Memory::Values) } else { Memory::Values })
            .collect()
    } else {
        if values.len() < total {
            values.resize(total, 0.0);
        }
        gather(&tensors, slots, 0, packed);
        for (slot, span) in slots.iter().zip(&spans) {
            to_f32(&packed[slot.offset..slot.offset + slot.bytes], dtype, &mut values[span.range()]);
        }
        scale(&mut values[..total], response.prescale);
        spans.iter().map(|_| Memory::Values).collect()
    };
    phases.mark(Stage::MemcpyInFusionBuffer);

    let values = &mut values[..total];
    let postscale = effective_postscale(response.reduce_op, response.postscale, t.size());
    let kind = compression.kind_name();
    let parts = if route == Route::Hierarchical { t.hosts() } else { None };
    if let Some(parts) = parts {
        let (local, cross) = (parts.local.label(), parts.cross.label());
        let mut on_step = |step: u8| {
            phases.mark(match step {
                0 => Stage::Hierarchical { transport: local, collective: "ALLREDUCE" },
                1 => Stage::Compressed { transport: cross, compression: kind },
                _ => Stage::Hierarchical { transport: local, collective: "ALLGATHER" },
            })
        };
        compressed::allreduce_hierarchical(parts, compression, values, &spans, feedback, &mut on_step)?;
    } else if route == Route::Exact {
        compressed::sum_exactly(t, values)?;
        phases.mark_collective();
    } else {
        if let Compression::PowerSgd { rank } = compression {
            let scales = Scales { pre: response.prescale as f32, post: postscale as f32 };
            powersgd::allreduce_in_memory(t, rank.into(), values, &spans, (&mut memories, scales), feedback)?;
        } else {
            compressed::allreduce(t, compression, values, &spans, feedback)?;
        }
        phases.mark(Stage::Compressed { transport: label, compression: kind });
    }

    let written: Vec<bool> = memories.iter().map(|memory| !matches!(memory, Memory::Values)).collect();
    drop(memories);
    if direct {
        for ((io, span), _) in tensors.iter_mut().zip(&spans).zip(&written).filter(|(_, &written)| !written) {
            let result = &mut values[span.range()];
            match io.output_mut() {
                Some(out) => write_scaled(result, postscale, out),
                None => {
                    scale(result, postscale);
                    io.write(0, compressed::f32_bytes(result));
                }
            }
        }
    } else {
        scale(values, postscale);
        for (slot, span) in slots.iter().zip(&spans) {
            from_f32(&values[span.range()], dtype, &mut packed[slot.offset..slot.offset + slot.bytes]);
        }
        scatter(&mut tensors, slots, 0, packed);
    }
    phases.mark(Stage::MemcpyOutFusionBuffer);
    Ok(tensors.into_iter().map(|io| Ok(io.finish().into())).collect())
}

/// The caller's float32 memory of `io`, for an algorithm to read and write itself: `None` for a joined
/// rank, a packed group, or memory not aligned for float32.
fn f32_memory<'m>(io: &'m mut TensorIo<'_>) -> Option<Memory<'m>> {
    fn floats(bytes: &[u8]) -> Option<&[f32]> {
        // SAFETY: every bit pattern is a valid f32; `align_to` puts only aligned whole values in the middle.
        let (head, floats, tail) = unsafe { bytes.align_to::<f32>() };
        (head.is_empty() && tail.is_empty()).then_some(floats)
    }
    fn floats_mut(bytes: &mut [u8]) -> Option<&mut [f32]> {
        // SAFETY: as in `floats`.
        let (head, floats, tail) = unsafe { bytes.align_to_mut::<f32>() };
        (head.is_empty() && tail.is_empty()).then_some(floats)
    }
    match io.input_and_output()? {
        (None, memory) => Some(Memory::InPlace(floats_mut(memory)?)),
        (Some(input), output) => Some(Memory::Separate(floats(input)?, floats_mut(output)?)),
    }
}

/// `values` times `factor` written into `out` as native-endian float32, in one pass.
fn write_scaled(values: &[f32], factor: f64, out: &mut [u8]) {
    if factor == 1.0 {
        out[..std::mem::size_of_val(values)].copy_from_slice(compressed::f32_bytes(values));
        return;
    }
    let factor = factor as f32;
    for (&v, b) in values.iter().zip(out.chunks_exact_mut(4)) {
        b.copy_from_slice(&(v * factor).to_ne_bytes());
    }
}

fn scale(values: &mut [f32], factor: f64) {
    if factor != 1.0 {
        let factor = factor as f32;
        values.iter_mut().for_each(|v| *v *= factor);
    }
}

/// `bytes` (native-endian values of the floating-point `dtype`) as float32, written into `out`. One loop per
/// dtype, each over a fixed width, so each vectorises.
fn to_f32(bytes: &[u8], dtype: DataType, out: &mut [f32]) {
    match dtype {
        DataType::Float16 => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = f16::from_ne_bytes([b[0], b[1]]).to_f32();
            }
        }
        DataType::Bfloat16 => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = bf16::from_ne_bytes([b[0], b[1]]).to_f32();
            }
        }
        DataType::Float64 => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(8)) {
                *o = f64::from_ne_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]) as f32;
            }
        }
        _ => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_ne_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
    }
}

/// `values` written into `bytes` as the floating-point `dtype` (rounded to nearest); one loop per dtype, as
/// in [`to_f32`].
fn from_f32(values: &[f32], dtype: DataType, bytes: &mut [u8]) {
    match dtype {
        DataType::Float16 => {
            for (&v, b) in values.iter().zip(bytes.chunks_exact_mut(2)) {
                b.copy_from_slice(&f16::from_f32(v).to_ne_bytes());
            }
        }
        DataType::Bfloat16 => {
            for (&v, b) in values.iter().zip(bytes.chunks_exact_mut(2)) {
                b.copy_from_slice(&bf16::from_f32(v).to_ne_bytes());
            }
        }
        DataType::Float64 => {
            for (&v, b) in values.iter().zip(bytes.chunks_exact_mut(8)) {
                b.copy_from_slice(&f64::from(v).to_ne_bytes());
            }
        }
        _ => {
            let len = values.len().min(bytes.len() / 4);
            bytes[..len * 4].copy_from_slice(compressed::f32_bytes(&values[..len]));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_float_dtype_converts_through_float32() {
        let values = [1.5f32, -2.25, 0.0, 1024.0];
        for dtype in [DataType::Float16, DataType::Bfloat16, DataType::Float32, DataType::Float64] {
            let mut bytes = vec![0u8; values.len() * dtype.size()];
            from_f32(&values, dtype, &mut bytes);
            let mut back = vec![7.0f32; values.len() + 1];
            to_f32(&bytes, dtype, &mut back[..values.len()]);
            assert_eq!(back[..values.len()], values, "{dtype}");
            assert_eq!(back[values.len()], 7.0, "{dtype}: written past its values");
        }
    }

    #[test]
    fn one_hosts_shared_memory_is_exact_unless_forced() {
        use crate::transport::memory::MemoryTransport;
        let mut mesh = MemoryTransport::mesh(2);
        let t = &mut mesh[0];
        let expected = if t.capabilities().cheap_handoffs { Route::Exact } else { Route::Flat };
        assert_eq!(route(t, false), expected);
        assert_eq!(route(t, true), Route::Flat);
    }
}
