//! Running one agreed compressed allreduce (`Compression::Int8`, `OneBit`, `PowerSgd`) on this rank: its
//! tensors packed, converted to float32 and prescaled, reduced by `ring::compressed` on the route the
//! communicator calls for, then scaled and written back in their own dtype.
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
use crate::ring::compressed::{self, Feedback, Settings, Span};
use crate::timeline::{OpRecord, Stage};
use crate::transport::{Transport, TransportError};
use crate::types::DataType;

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
    gather(&tensors, slots, 0, packed);
    phases.mark(Stage::MemcpyInFusionBuffer);

    let counts: Vec<usize> = slots.iter().map(|slot| slot.bytes / dtype.size()).collect();
    values.clear();
    let mut spans = Vec::with_capacity(slots.len());
    for (((slot, &count), spec), &contributes) in slots.iter().zip(&counts).zip(&response.entries).zip(&contributes) {
        let start = values.len();
        to_f32(&packed[slot.offset..slot.offset + slot.bytes], dtype, values);
        spans.push(Span { name: &spec.name, shape: &spec.shape, start, len: count, contributes });
    }
    let values = values.as_mut_slice();
    scale(values, response.prescale);

    feedback.begin(compression.code());
    let warm = feedback.step_past_warmup(spans.iter().map(|s| s.name), settings.warmup_steps);
    let route = if warm { route(t, settings.within_host) } else { Route::Exact };
    let label = t.label();
    tracing::debug!(
        "{compression} allreduce of {} tensor(s), {} values, {route:?} over {label}: {}",
        spans.len(),
        values.len(),
        spans.iter().map(|s| s.name).collect::<Vec<_>>().join(", ")
    );
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
        compressed::allreduce(t, compression, values, &spans, feedback)?;
        phases.mark(Stage::Compressed { transport: label, compression: kind });
    }

    scale(values, effective_postscale(response.reduce_op, response.postscale, t.size()));
    for ((slot, &count), span) in slots.iter().zip(&counts).zip(&spans) {
        let bytes = &mut packed[slot.offset..slot.offset + slot.bytes];
        from_f32(&values[span.start..span.start + count], dtype, bytes);
    }
    scatter(&mut tensors, slots, 0, packed);
    phases.mark(Stage::MemcpyOutFusionBuffer);
    Ok(tensors.into_iter().map(|io| Ok(io.finish().into())).collect())
}

fn scale(values: &mut [f32], factor: f64) {
    if factor != 1.0 {
        let factor = factor as f32;
        values.iter_mut().for_each(|v| *v *= factor);
    }
}

/// `bytes` (native-endian values of the floating-point `dtype`) as float32, appended to `out`.
fn to_f32(bytes: &[u8], dtype: DataType, out: &mut Vec<f32>) {
    let values = bytes.chunks_exact(dtype.size());
    match dtype {
        DataType::Float16 => out.extend(values.map(|b| f16::from_ne_bytes([b[0], b[1]]).to_f32())),
        DataType::Bfloat16 => out.extend(values.map(|b| bf16::from_ne_bytes([b[0], b[1]]).to_f32())),
        DataType::Float64 => {
            out.extend(values.map(|b| f64::from_ne_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]) as f32))
        }
        _ => out.extend(values.map(|b| f32::from_ne_bytes([b[0], b[1], b[2], b[3]]))),
    }
}

/// `values` written into `bytes` as the floating-point `dtype` (rounded to nearest).
fn from_f32(values: &[f32], dtype: DataType, bytes: &mut [u8]) {
    let width = dtype.size();
    for (&v, b) in values.iter().zip(bytes.chunks_exact_mut(width)) {
        match dtype {
            DataType::Float16 => b.copy_from_slice(&f16::from_f32(v).to_ne_bytes()),
            DataType::Bfloat16 => b.copy_from_slice(&bf16::from_f32(v).to_ne_bytes()),
            DataType::Float64 => b.copy_from_slice(&f64::from(v).to_ne_bytes()),
            _ => b.copy_from_slice(&v.to_ne_bytes()),
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
            let mut back = vec![7.0f32];
            to_f32(&bytes, dtype, &mut back);
            assert_eq!(back[1..], values, "{dtype}");
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
