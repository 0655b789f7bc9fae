//! The int8 and 1-bit allreduce: a reduce-scatter and an allgather of encoded blocks, with error feedback on
//! both sides.
//!
//! The values are cut into units of at most [`BLOCK`] values that never cross a tensor's end, each reduced
//! by a rank chosen from its tensor's name and its place in it: a tensor's blocks, the ranks that reduce
//! them and so its result are the same whatever it is fused with. Each rank adds its residual to its values
//! and encodes the units other ranks own; the units rank `j` owns go to rank `j` (one all-to-all), which
//! decodes the `n - 1` contributions, sums them with its own values in rank order (its own exactly: they
//! never travel, so they leave no residual), adds its own residual of that sum, and encodes the result
//! once more, as int8 for either codec (see [`Codec::for_sums`]); an allgather of those encodings gives
//! every rank every unit, which all decode alike (the owner too, so every rank holds the same bits). A rank sends
//! and receives about `(n-1)/n` of each encoded size: in all a quarter (int8) or about 5/32 (1-bit out,
//! int8 back) of the float32 ring's traffic, plus a 4-byte scale per block.
//!
//! Tensors that are 1-D (biases, normalisation scales) or smaller than [`EXACT_BELOW`] values travel as they
//! are ([`Codec::Float32`], summed exactly, no residual), in the same exchanges: few bytes, and the
//! parameters a model is most sensitive to (DDP's PowerSGD hook leaves vectors uncompressed likewise).

use std::ops::Range;

use crate::ring::allgather::allgatherv;
use crate::ring::alltoall::alltoallv;
#[cfg(test)]
use crate::ring::compressed::blocks::ONEBIT_BLOCK;
use crate::ring::compressed::blocks::{Codec, BLOCK};
use crate::ring::compressed::feedback::{Feedback, Kind};
use crate::ring::compressed::Span;
use crate::transport::{Transport, TransportError};

/// Tensors of fewer values than this travel uncompressed (see the module doc).
pub const EXACT_BELOW: usize = 1024;

/// Whether `span`'s tensor travels uncompressed (see the module doc).
pub fn travels_exact(span: &Span<'_>) -> bool {
    span.shape.len() < 2 || span.len < EXACT_BELOW
}

/// A unit of values: at most [`BLOCK`] values of one tensor (or of no tensor), and the rank that reduces it.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Unit {
    range: Range<usize>,
    /// The span it belongs to, and its first value's offset in that tensor.
    tensor: Option<(usize, usize)>,
    owner: usize,
    /// Its tensor travels uncompressed ([`travels_exact`]).
    exact: bool,
}

impl Unit {
    /// The codec this unit travels in where the allreduce's is `codec`.
    fn codec(&self, codec: Codec) -> Codec {
        if self.exact {
            Codec::Float32
        } else {
            codec
        }
    }
}

/// The units of `total` values laid out as `spans` on `n` ranks: each span cut into pieces of [`BLOCK`]
/// values (the last may be shorter), and the values no span covers likewise. A tensor's `k`-th unit is
/// reduced by rank `(seed + k) mod n`, `seed` a hash of its name: the same rank whatever the tensor is fused
/// with, so that rank keeps the unit's residual from step to step.
fn units(spans: &[Span<'_>], total: usize, n: usize) -> Vec<Unit> {
    let mut units = Vec::with_capacity(total / BLOCK + spans.len() + 1);
    let mut cut = |range: Range<usize>, tensor: Option<(usize, &str, usize)>, exact: bool| {
        let seed = tensor.map_or(0, |(_, name, _)| name_seed(name));
        let mut at = range.start;
        let mut k = 0usize;
        while at < range.end {
            let end = (at + BLOCK).min(range.end);
            let owner = (seed.wrapping_add(k as u64) % n.max(1) as u64) as usize;
            units.push(Unit {
                range: at..end,
                tensor: tensor.map(|(i, _, first)| (i, first + at - range.start)),
                owner,
                exact,
            });
            at = end;
            k += 1;
        }
    };
    let mut ordered: Vec<(usize, &Span<'_>)> = spans.iter().enumerate().collect();
    ordered.sort_by_key(|(_, span)| span.start);
    let mut covered = 0;
    for (i, span) in ordered {
        let start = span.start.max(covered);
        let end = (span.start + span.len).max(start);
        cut(covered..start, None, false);
        cut(start..end, Some((i, span.name, start - span.start)), travels_exact(span));
        covered = covered.max(end);
    }
    cut(covered..total, None, false);
    units
}

/// FNV-1a of `name`: where a tensor's units start being dealt out.
fn name_seed(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3))
}

/// The units rank `owner` reduces, in order.
fn owned_by(units: &[Unit], owner: usize) -> Vec<Unit> {
    units.iter().filter(|unit| unit.owner == owner).cloned().collect()
}

/// Bytes of `units` encoded by `codec` (each unit in [its own](Unit::codec)).
fn encoded_len(codec: Codec, units: &[Unit]) -> usize {
    units.iter().map(|unit| unit.codec(codec).encoded_len(unit.range.len())).sum()
}

/// Encode `units` of `values` one after another into `out`, writing what was lost into `residual` (both
/// indexed like `values`, or by the units' places in a packed buffer of them with `packed`).
fn encode(codec: Codec, units: &[Unit], values: &[f32], out: &mut [u8], residual: &mut [f32], packed: bool) {
    let (mut at, mut value_at) = (0, 0);
    for unit in units {
        let (len, codec) = (unit.range.len(), unit.codec(codec));
        let range = if packed { value_at..value_at + len } else { unit.range.clone() };
        let size = codec.encoded_len(len);
        codec.encode(&values[range.clone()], &mut out[at..at + size], &mut residual[range]);
        at += size;
        value_at += len;
    }
}

/// Decode `bytes` (`units` one after another) into `values`, adding if `add`; `packed` as for [`encode`].
fn decode(codec: Codec, units: &[Unit], bytes: &[u8], values: &mut [f32], add: bool, packed: bool) {
    let (mut at, mut value_at) = (0, 0);
    for unit in units {
        let (len, codec) = (unit.range.len(), unit.codec(codec));
        let range = if packed { value_at..value_at + len } else { unit.range.clone() };
        let size = codec.encoded_len(len);
        if add {
            codec.decode_add(&bytes[at..at + size], &mut values[range]);
        } else {
            codec.decode(&bytes[at..at + size], &mut values[range]);
        }
        at += size;
        value_at += len;
    }
}

/// Add this rank's own `values` of `units` to `reduced` (the units' values packed one after another).
fn add_own(units: &[Unit], values: &[f32], reduced: &mut [f32]) {
    let mut value_at = 0;
    for unit in units {
        let len = unit.range.len();
        for (r, v) in reduced[value_at..value_at + len].iter_mut().zip(&values[unit.range.clone()]) {
            *r += v;
        }
        value_at += len;
    }
}

/// The buffers of one allreduce, kept from op to op on the thread that runs them (the engine's executor):
/// allocating them afresh cost more in page faults and zeroing than the encoding itself.
#[derive(Default)]
struct Buffers {
    send: Vec<u8>,
    received: Vec<u8>,
    residual: Vec<f32>,
    reduced: Vec<f32>,
    server_residual: Vec<f32>,
    own: Vec<u8>,
    all: Vec<u8>,
}

thread_local! {
    static BUFFERS: std::cell::RefCell<Buffers> = std::cell::RefCell::default();
}

/// The first `len` elements of `buffer`, grown (never shrunk) to hold them; their contents are whatever the
/// last op left.
fn reused<T: Copy + Default>(buffer: &mut Vec<T>, len: usize) -> &mut [T] {
    if buffer.len() < len {
        buffer.resize(len, T::default());
    }
    &mut buffer[..len]
}

/// Allreduce (sum) `values` as `codec` blocks; see the module doc.
pub fn allreduce(
    t: &mut dyn Transport,
    codec: Codec,
    values: &mut [f32],
    spans: &[Span<'_>],
    feedback: &mut Feedback,
) -> Result<(), TransportError> {
    BUFFERS.with(|buffers| allreduce_with(t, codec, values, spans, feedback, &mut buffers.borrow_mut()))
}

fn allreduce_with(
    t: &mut dyn Transport,
    codec: Codec,
    values: &mut [f32],
    spans: &[Span<'_>],
    feedback: &mut Feedback,
    buffers: &mut Buffers,
) -> Result<(), TransportError> {
    let (rank, n) = (t.rank(), t.size());
    for span in spans.iter().filter(|s| s.contributes) {
        let residual = feedback.get(Kind::Worker, span.name, span.len, None);
        for (v, r) in values[span.range()].iter_mut().zip(residual.iter()) {
            *v += r;
        }
    }
    let units = units(spans, values.len(), n);
    let by_rank: Vec<Vec<Unit>> = (0..n).map(|owner| owned_by(&units, owner)).collect();
    let sizes: Vec<usize> = by_rank.iter().map(|owned| encoded_len(codec, owned)).collect();
    // What this rank sends: every other rank's units, encoded. Its own contribution to the units it
    // reduces never travels, so it is added exactly and leaves no residual.
    let send_sizes: Vec<usize> = (0..n).map(|to| if to == rank { 0 } else { sizes[to] }).collect();
    let send = reused(&mut buffers.send, send_sizes.iter().sum());
    // Every value of `residual` is written: the units cover all of `values`.
    let residual = reused(&mut buffers.residual, values.len());
    let mut at = 0;
    for (owned, &size) in by_rank.iter().zip(&send_sizes) {
        if size == 0 {
            for unit in owned {
                residual[unit.range.clone()].fill(0.0);
            }
            continue;
        }
        encode(codec, owned, values, &mut send[at..at + size], residual, false);
        at += size;
    }
    for span in spans.iter().filter(|s| s.contributes) {
        feedback.get(Kind::Worker, span.name, span.len, None).copy_from_slice(&residual[span.range()]);
    }

    // Reduce-scatter: the other ranks' encodings of the units this rank owns and its own values, summed in
    // rank order.
    let mine = &by_rank[rank];
    let my_size = sizes[rank];
    let receive_sizes: Vec<usize> = (0..n).map(|from| if from == rank { 0 } else { my_size }).collect();
    let received = reused(&mut buffers.received, my_size * (n - 1));
    alltoallv(t, send, &send_sizes, received, &receive_sizes)?;
    let reduced = reused(&mut buffers.reduced, mine.iter().map(|unit| unit.range.len()).sum());
    reduced.fill(0.0);
    if my_size > 0 {
        let mut contributions = received.chunks_exact(my_size);
        for from in 0..n {
            if from == rank {
                add_own(mine, values, reduced);
            } else if let Some(contribution) = contributions.next() {
                decode(codec, mine, contribution, reduced, true, true);
            }
        }
    }
    let server_places = |unit: &Unit| unit.tensor.map(|(i, offset)| (&spans[i], offset..offset + unit.range.len()));
    let mut value_at = 0;
    for unit in mine {
        if let Some((span, range)) = server_places(unit) {
            let residual = feedback.get(Kind::Server, span.name, span.len, None);
            for (v, r) in reduced[value_at..value_at + unit.range.len()].iter_mut().zip(&residual[range]) {
                *v += r;
            }
        }
        value_at += unit.range.len();
    }
    let sums = codec.for_sums();
    let gather_sizes: Vec<usize> = by_rank.iter().map(|owned| encoded_len(sums, owned)).collect();
    let own = reused(&mut buffers.own, gather_sizes[rank]);
    let server_residual = reused(&mut buffers.server_residual, reduced.len());
    encode(sums, mine, reduced, own, server_residual, true);
    let mut value_at = 0;
    for unit in mine {
        if let Some((span, range)) = server_places(unit) {
            let residual = feedback.get(Kind::Server, span.name, span.len, None);
            residual[range].copy_from_slice(&server_residual[value_at..value_at + unit.range.len()]);
        }
        value_at += unit.range.len();
    }

    // Allgather: every rank's encoded sums, decoded alike by every rank.
    let all = reused(&mut buffers.all, gather_sizes.iter().sum());
    allgatherv(t, own, all, &gather_sizes)?;
    let mut at = 0;
    for (owned, &size) in by_rank.iter().zip(&gather_sizes) {
        decode(sums, owned, &all[at..at + size], values, false, false);
        at += size;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::memory::{run_ranks, MemoryTransport};

    #[test]
    fn units_never_cross_a_tensors_end_and_each_keeps_its_rank_whatever_it_is_fused_with() {
        let spans = [
            Span { name: "a", shape: &[600], start: 0, len: 600, contributes: true },
            Span { name: "b", shape: &[10], start: 600, len: 10, contributes: true },
        ];
        let all = units(&spans, 620, 3);
        let ranges: Vec<_> = all.iter().map(|u| u.range.clone()).collect();
        assert_eq!(ranges, vec![0..256, 256..512, 512..600, 600..610, 610..620]);
        assert_eq!(all[1].tensor, Some((0, 256)));
        assert_eq!(all[4].tensor, None);
        let seed = name_seed("a") % 3;
        let owners: Vec<_> = all[..3].iter().map(|u| u.owner as u64).collect();
        assert_eq!(owners, vec![seed, (seed + 1) % 3, (seed + 2) % 3], "dealt out in turn");
        // "b" alone, or after "a": the same owner and offsets.
        let alone = units(&[Span { start: 0, ..spans[1] }], 10, 3);
        assert_eq!((alone[0].owner, alone[0].tensor), (all[3].owner, Some((0, 0))));
    }

    const VALUES: usize = 2355;

    /// Rank `r`'s values of the test: two tensors, 1,200 and 1,155 values.
    fn contribution(rank: usize) -> Vec<f32> {
        (0..VALUES).map(|i| ((i * 31 + rank * 17) % 97) as f32 / 13.0 - 3.0 + rank as f32).collect()
    }

    /// Two matrices, large enough to be compressed (below [`EXACT_BELOW`] values only for this test's scale).
    fn spans() -> [Span<'static>; 2] {
        [
            Span { name: "a", shape: &[30, 40], start: 0, len: 1200, contributes: true },
            Span { name: "b", shape: &[7, 11, 15], start: 1200, len: 1155, contributes: true },
        ]
    }

    /// Each rank's results of `steps` allreduces of the same values.
    fn run(codec: Codec, n: usize, steps: usize) -> Vec<Vec<Vec<f32>>> {
        run_ranks(MemoryTransport::mesh(n), |t| {
            let mut feedback = Feedback::default();
            let mut results = Vec::new();
            for _ in 0..steps {
                let mut values = contribution(t.rank());
                allreduce(t, codec, &mut values, &spans(), &mut feedback).unwrap();
                results.push(values);
            }
            results
        })
    }

    #[test]
    fn every_rank_gets_the_same_bits_close_to_the_sum() {
        let largest = |values: &[f32]| values.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        for (codec, n) in [(Codec::Int8, 3), (Codec::Int8, 4), (Codec::OneBit, 2)] {
            let results = run(codec, n, 1);
            let exact: Vec<f32> = (0..VALUES).map(|i| (0..n).map(|r| contribution(r)[i]).sum()).collect();
            // int8: half a step of each rank's encoding and of the sum's; 1-bit: no more than every value's
            // magnitude and the sum's.
            let worst_values: f32 = (0..n).map(|r| largest(&contribution(r))).sum::<f32>() + largest(&exact);
            let tolerance = if codec == Codec::Int8 { worst_values / 254.0 + 1e-4 } else { 2.0 * worst_values };
            for rank in 1..n {
                assert_eq!(results[rank][0], results[0][0], "{codec:?}: rank {rank} differs from rank 0");
            }
            let worst = results[0][0].iter().zip(&exact).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
            assert!(worst < tolerance, "{codec:?} on {n} ranks: off by {worst}");
        }
    }

    #[test]
    fn vectors_and_small_tensors_are_summed_exactly_and_matrices_compressed() {
        let spans = [
            Span { name: "weight", shape: &[40, 30], start: 0, len: 1200, contributes: true },
            Span { name: "bias", shape: &[1500], start: 1200, len: 1500, contributes: true },
            Span { name: "kernel", shape: &[4, 1, 3, 3], start: 2700, len: 36, contributes: true },
        ];
        let value = |rank: usize, i: usize| ((i * 29 + rank * 13) % 89) as f32 / 11.0 - 4.0 + 0.1 * rank as f32;
        for (codec, n) in [(Codec::OneBit, 3), (Codec::Int8, 2)] {
            let results = run_ranks(MemoryTransport::mesh(n), |t| {
                let mut feedback = Feedback::default();
                let mut values: Vec<f32> = (0..2736).map(|i| value(t.rank(), i)).collect();
                allreduce(t, codec, &mut values, &spans, &mut feedback).unwrap();
                let mut leftover = |name, len| feedback.get(Kind::Worker, name, len, None).iter().any(|&r| r != 0.0);
                (values, leftover("weight", 1200), leftover("bias", 1500), leftover("kernel", 36))
            });
            // Summed in rank order, as the owner of each unit sums its contributions.
            let exact: Vec<f32> = (0..2736).map(|i| (0..n).fold(0.0f32, |sum, r| sum + value(r, i))).collect();
            let (values, weight_left, bias_left, kernel_left) = &results[0];
            assert_eq!(values[1200..], exact[1200..], "{codec:?}: the vector and the small kernel exact");
            assert_ne!(values[..1200], exact[..1200], "{codec:?}: the matrix compressed");
            assert!(*weight_left && !bias_left && !kernel_left, "{codec:?}: a residual for the matrix only");
        }
    }

    #[test]
    fn the_owner_adds_its_own_values_exactly_and_keeps_no_residual_for_them() {
        // Rank 0 sends a matrix, rank 1 zeros. A unit rank 0 reduces comes back as the int8 round trip of
        // rank 0's exact values; a unit rank 1 reduces, as the int8 round trip of rank 0's 1-bit encoding.
        let span = Span { name: "w", shape: &[8, 160], start: 0, len: 1280, contributes: true };
        let value = |i: usize| ((i * 37) % 101) as f32 / 7.0 - 7.0;
        let round_trip = |codec: Codec, values: &[f32]| {
            let (mut bytes, mut lost) = (vec![0u8; codec.encoded_len(values.len())], vec![0.0f32; values.len()]);
            codec.encode(values, &mut bytes, &mut lost);
            let mut out = vec![0.0f32; values.len()];
            codec.decode(&bytes, &mut out);
            out
        };
        let results = run_ranks(MemoryTransport::mesh(2), |t| {
            let mut feedback = Feedback::default();
            let mut values: Vec<f32> = (0..1280).map(|i| if t.rank() == 0 { value(i) } else { 0.0 }).collect();
            allreduce(t, Codec::OneBit, &mut values, &[span], &mut feedback).unwrap();
            (values, feedback.get(Kind::Worker, "w", 1280, None).to_vec())
        });
        let (result, residual) = &results[0];
        let all = units(&[span], 1280, 2);
        assert!(all.iter().any(|u| u.owner == 0) && all.iter().any(|u| u.owner == 1));
        for unit in all {
            let exact: Vec<f32> = unit.range.clone().map(value).collect();
            let sent: Vec<f32> = exact.chunks(ONEBIT_BLOCK).flat_map(|b| round_trip(Codec::OneBit, b)).collect();
            let own = unit.owner == 0;
            let want = round_trip(Codec::Int8, if own { &exact } else { &sent });
            assert_eq!(result[unit.range.clone()], want[..], "unit {:?} reduced by rank {}", unit.range, unit.owner);
            let lost: Vec<f32> =
                if own { vec![0.0; exact.len()] } else { exact.iter().zip(&sent).map(|(e, s)| e - s).collect() };
            assert_eq!(residual[unit.range.clone()], lost[..], "residual of unit {:?}", unit.range);
        }
    }

    #[test]
    fn error_feedback_makes_the_running_sum_converge_to_the_true_one() {
        // Over k steps of the same values, everything dropped is carried to the next step: the sum of the k
        // results stays within one step's error of k times the exact sum, where without feedback the error
        // would grow k-fold.
        for codec in [Codec::Int8, Codec::OneBit] {
            let (n, steps) = (3, 40);
            let results = run(codec, n, steps);
            let exact: Vec<f32> = (0..VALUES).map(|i| (0..n).map(|r| contribution(r)[i]).sum()).collect();
            let one_step = results[0][0].iter().zip(&exact).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
            let mut total = vec![0.0f32; VALUES];
            for step in &results[0] {
                for (t, v) in total.iter_mut().zip(step) {
                    *t += v;
                }
            }
            let drift = total.iter().zip(&exact).map(|(t, e)| (t / steps as f32 - e).abs()).fold(0.0, f32::max);
            assert!(drift < one_step / 4.0, "{codec:?}: mean of {steps} steps off by {drift}, one step by {one_step}");
        }
    }
}
