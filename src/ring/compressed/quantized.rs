//! The int8 and 1-bit allreduce: a reduce-scatter and an allgather of encoded blocks, with error feedback on
//! both sides.
//!
//! Each rank adds its residual to its values and encodes them in `n` chunks of whole blocks; chunk `j`
//! goes to rank `j` (one all-to-all), which decodes the `n` contributions, sums them in rank order, adds
//! its own residual of that sum, and encodes the result once more; an allgather of those encodings gives
//! every rank every chunk, which all decode alike (the owner too, so every rank holds the same bits). A
//! rank sends and receives about `2 (n-1)/n` of the encoded size: a quarter (int8) or a thirty-second
//! (1-bit) of the float32 ring's traffic, plus a 4-byte scale per 256 values.

use std::ops::Range;

use crate::ring::allgather::allgatherv;
use crate::ring::alltoall::alltoallv;
use crate::ring::chunks::segment_bounds;
use crate::ring::compressed::blocks::{Codec, BLOCK};
use crate::ring::compressed::feedback::{Feedback, Kind};
use crate::ring::compressed::Span;
use crate::transport::{Transport, TransportError};

/// The elements of `total` owned by each of `n` ranks: whole blocks, split as evenly as they go.
fn chunks(total: usize, n: usize) -> Vec<Range<usize>> {
    let blocks = total.div_ceil(BLOCK);
    (0..n)
        .map(|j| {
            let (first, count) = segment_bounds(blocks, n, j);
            (first * BLOCK).min(total)..((first + count) * BLOCK).min(total)
        })
        .collect()
}

/// Where `spans` meet `range`: (the span, the first element of the overlap in the tensor, the overlap in the
/// dense vector).
fn overlaps<'s, 'a>(
    spans: &'s [Span<'a>],
    range: &Range<usize>,
) -> impl Iterator<Item = (&'s Span<'a>, usize, Range<usize>)> + 's {
    let range = range.clone();
    spans.iter().filter_map(move |span| {
        let start = span.start.max(range.start);
        let end = (span.start + span.len).min(range.end);
        (start < end).then(|| (span, start - span.start, start..end))
    })
}

/// Allreduce (sum) `values` as `codec` blocks; see the module doc.
pub fn allreduce(
    t: &mut dyn Transport,
    codec: Codec,
    values: &mut [f32],
    spans: &[Span<'_>],
    feedback: &mut Feedback,
) -> Result<(), TransportError> {
    let (rank, n) = (t.rank(), t.size());
    for span in spans.iter().filter(|s| s.contributes) {
        let residual = feedback.get(Kind::Worker, span.name, span.len, None);
        for (v, r) in values[span.range()].iter_mut().zip(residual.iter()) {
            *v += r;
        }
    }
    let chunks = chunks(values.len(), n);
    let sizes: Vec<usize> = chunks.iter().map(|c| codec.encoded_len(c.len())).collect();
    let mut send = vec![0u8; sizes.iter().sum()];
    let mut residual = vec![0.0f32; values.len()];
    let mut at = 0;
    for (chunk, &size) in chunks.iter().zip(&sizes) {
        codec.encode(&values[chunk.clone()], &mut send[at..at + size], &mut residual[chunk.clone()]);
        at += size;
    }
    for span in spans.iter().filter(|s| s.contributes) {
        feedback.get(Kind::Worker, span.name, span.len, None).copy_from_slice(&residual[span.range()]);
    }

    // Reduce-scatter: every rank's encoding of this rank's chunk, summed in rank order.
    let mine = chunks[rank].clone();
    let my_size = sizes[rank];
    let mut received = vec![0u8; my_size * n];
    alltoallv(t, &send, &sizes, &mut received, &vec![my_size; n])?;
    let mut reduced = vec![0.0f32; mine.len()];
    for contribution in received.chunks_exact(my_size.max(1)).take(n) {
        codec.decode_add(contribution, &mut reduced);
    }
    for (span, offset, overlap) in overlaps(spans, &mine) {
        let residual = feedback.get(Kind::Server, span.name, span.len, None);
        let residual = &residual[offset..offset + overlap.len()];
        for (v, r) in reduced[overlap.start - mine.start..overlap.end - mine.start].iter_mut().zip(residual) {
            *v += r;
        }
    }
    let mut own = vec![0u8; my_size];
    let mut server_residual = vec![0.0f32; mine.len()];
    codec.encode(&reduced, &mut own, &mut server_residual);
    for (span, offset, overlap) in overlaps(spans, &mine) {
        let residual = feedback.get(Kind::Server, span.name, span.len, None);
        residual[offset..offset + overlap.len()]
            .copy_from_slice(&server_residual[overlap.start - mine.start..overlap.end - mine.start]);
    }

    // Allgather: every chunk's encoded sum, decoded alike by every rank.
    let mut all = vec![0u8; send.len()];
    allgatherv(t, &own, &mut all, &sizes)?;
    let mut at = 0;
    for (chunk, &size) in chunks.iter().zip(&sizes) {
        codec.decode(&all[at..at + size], &mut values[chunk.clone()]);
        at += size;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::memory::{run_ranks, MemoryTransport};

    #[test]
    fn chunks_are_whole_blocks_and_cover_everything() {
        let total = 5 * BLOCK + 7;
        let chunks = chunks(total, 3);
        assert_eq!(chunks, vec![0..2 * BLOCK, 2 * BLOCK..4 * BLOCK, 4 * BLOCK..total]);
        assert_eq!(super::chunks(10, 4), vec![0..10, 10..10, 10..10, 10..10]);
    }

    /// Rank `r`'s values of the test: two tensors, 300 and 77 values.
    fn contribution(rank: usize) -> Vec<f32> {
        (0..377).map(|i| ((i * 31 + rank * 17) % 97) as f32 / 13.0 - 3.0 + rank as f32).collect()
    }

    fn spans() -> [Span<'static>; 2] {
        [
            Span { name: "a", shape: &[300], start: 0, len: 300, contributes: true },
            Span { name: "b", shape: &[7, 11], start: 300, len: 77, contributes: true },
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
            let exact: Vec<f32> = (0..377).map(|i| (0..n).map(|r| contribution(r)[i]).sum()).collect();
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
    fn error_feedback_makes_the_running_sum_converge_to_the_true_one() {
        // Over k steps of the same values, everything dropped is carried to the next step: the sum of the k
        // results stays within one step's error of k times the exact sum, where without feedback the error
        // would grow k-fold.
        for codec in [Codec::Int8, Codec::OneBit] {
            let (n, steps) = (3, 40);
            let results = run(codec, n, steps);
            let exact: Vec<f32> = (0..377).map(|i| (0..n).map(|r| contribution(r)[i]).sum()).collect();
            let one_step = results[0][0].iter().zip(&exact).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
            let mut total = vec![0.0f32; 377];
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
