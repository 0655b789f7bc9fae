//! Reduce-scatter: every rank contributes a whole tensor and rank `r` receives block `r` of the
//! element-wise combination of all of them.
//!
//! Ring algorithm: `n - 1` steps, each sending one (partially reduced) block to the right neighbour while
//! the left neighbour's block streams in and is combined with this rank's own block of the input as its
//! bytes arrive, so no message is ever staged whole and the input is never copied or changed. Partial
//! results pass through two block-sized scratch buffers (none with two ranks); the last step writes the
//! finished block straight into the output, scaled there by the op's postscale (no second pass over it). Each block is combined in a fixed chain order, so its result
//! does not depend on timing. `reduce_scatter_ring`, the in-place form, is also the first half of the
//! large-message allreduce.

use crate::ring::args::{expect_len, invalid_argument};
use crate::ring::chunks::{reduce_scatter_step, Blocks};
use crate::ring::disjoint::read_write_pair;
use crate::ring::reduce::scale_in_place;
use crate::ring::streaming::StreamingReducer;
use crate::tensor::{AlignedBuffer, STREAMING_MIN_BYTES};
use crate::transport::{Transport, TransportError};
use crate::types::{Combine, DataType};

/// Combine `input` across ranks and leave rank `r`'s block (`elems_per_rank[r]` elements, the blocks laid
/// out in rank order in `input`) in `out`, multiplied by `postscale`. `input` is only read.
pub fn reducescatter(
    t: &mut dyn Transport,
    input: &[u8],
    elems_per_rank: &[usize],
    dtype: DataType,
    combine: Combine,
    postscale: f64,
    out: &mut [u8],
) -> Result<(), TransportError> {
    const OP: &str = "reducescatter";
    let rank = t.rank();
    expect_len(rank, OP, "number of per-rank element counts", elems_per_rank.len(), t.size())?;
    let blocks = Blocks::from_lengths(elems_per_rank, dtype.size())
        .ok_or_else(|| invalid_argument(rank, OP, "per-rank element counts overflow".to_string()))?;
    expect_len(rank, OP, "input length in bytes", input.len(), blocks.total())?;
    expect_len(rank, OP, "output length in bytes", out.len(), blocks.len(rank))?;
    if t.size() == 1 || blocks.total() == 0 {
        out.copy_from_slice(&input[blocks.range(rank)]);
        scale_in_place(out, dtype, postscale);
        return Ok(());
    }
    reduce_scatter_ring_into(t, input, &blocks, dtype, (combine, postscale), out)
}

/// The ring reduce-scatter of `input` (only read) into `out`, this rank's block of the result, scaled.
fn reduce_scatter_ring_into(
    t: &mut dyn Transport,
    input: &[u8],
    blocks: &Blocks,
    dtype: DataType,
    (combine, postscale): (Combine, f64),
    out: &mut [u8],
) -> Result<(), TransportError> {
    let (rank, n) = (t.rank(), t.size());
    let right = (rank + 1) % n;
    let left = (rank + n - 1) % n;
    // Step s reduces into scratch s % 2 what step s + 1 sends on; the last step reduces into `out`.
    let largest = if n > 2 { (0..n).map(|b| blocks.len(b)).max().unwrap_or(0) } else { 0 };
    let mut scratch = [AlignedBuffer::for_overwrite(largest), AlignedBuffer::for_overwrite(largest)];
    // A large result, nobody reads before the op completes, is written with streaming stores.
    let streaming = out.len() >= STREAMING_MIN_BYTES;
    for step in 0..n - 1 {
        let (send_block, recv_block) = reduce_scatter_step(rank, n, step);
        let (even, odd) = scratch.split_at_mut(1);
        let (reduced_before, reducing_now) = if step % 2 == 0 {
            (odd[0].as_mut_slice(), even[0].as_mut_slice())
        } else {
            (even[0].as_mut_slice(), odd[0].as_mut_slice())
        };
        let outgoing: &[u8] =
            if step == 0 { &input[blocks.range(send_block)] } else { &reduced_before[..blocks.len(send_block)] };
        let target: &mut [u8] = if step == n - 2 { &mut *out } else { &mut reducing_now[..blocks.len(recv_block)] };
        let base = &input[blocks.range(recv_block)];
        let last = step == n - 2;
        let mut reducer = if last && streaming {
            StreamingReducer::from_base_streaming(base, target, dtype, combine).scaled(postscale)
        } else if last {
            StreamingReducer::from_base(base, target, dtype, combine).scaled(postscale)
        } else {
            StreamingReducer::from_base(base, target, dtype, combine)
        };
        t.exchange(right, outgoing, left, blocks.len(recv_block), &mut |_, piece| reducer.accept(piece))?;
    }
    Ok(())
}

/// The ring reduce-scatter over `buf` split into `blocks` (one per rank, lengths whole elements), in place;
/// with a `src`, out of place: `src` holds this rank's contribution and is only read, and the blocks this
/// rank combines are written to `buf` (each block is combined here before it is sent on, so every block
/// sent after the first step is already in `buf`). On return block `rank` of `buf` holds the combination
/// of every rank's block; the blocks this rank combined on the way hold partial results, and with a `src`
/// the one block it never combines is left as it was.
pub(crate) fn reduce_scatter_ring(
    t: &mut dyn Transport,
    src: Option<&[u8]>,
    buf: &mut [u8],
    blocks: &Blocks,
    dtype: DataType,
    combine: Combine,
) -> Result<(), TransportError> {
    let (rank, n) = (t.rank(), t.size());
    let right = (rank + 1) % n;
    let left = (rank + n - 1) % n;
    for step in 0..n - 1 {
        let (send_block, recv_block) = reduce_scatter_step(rank, n, step);
        let (outgoing, incoming) = read_write_pair(buf, blocks.range(send_block), blocks.range(recv_block))
            .ok_or_else(|| {
                invalid_argument(rank, "reduce-scatter", "ring blocks overlap or overrun the buffer".into())
            })?;
        let incoming_len = incoming.len();
        let (outgoing, mut reducer) = match src {
            Some(src) => {
                let outgoing = if step == 0 { &src[blocks.range(send_block)] } else { outgoing };
                (outgoing, StreamingReducer::from_base(&src[blocks.range(recv_block)], incoming, dtype, combine))
            }
            None => (outgoing, StreamingReducer::new(incoming, dtype, combine)),
        };
        t.exchange(right, outgoing, left, incoming_len, &mut |_, piece| reducer.accept(piece))?;
    }
    Ok(())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::transport::memory::{run_ranks, MemoryTransport};

    #[test]
    fn each_rank_gets_its_reduced_block() {
        let elems_per_rank = [2, 0, 3];
        let results = run_ranks(MemoryTransport::mesh(3), |t| {
            let input: Vec<u8> = (0..5).map(|i| (i * 10 + t.rank()) as u8).collect();
            let mut out = vec![0; elems_per_rank[t.rank()]];
            reducescatter(t, &input, &elems_per_rank, DataType::Uint8, Combine::Max, 1.0, &mut out).unwrap();
            out
        });
        assert_eq!(results, vec![vec![2, 12], vec![], vec![22, 32, 42]]);
    }

    /// The postscale applied while the last step writes gives the bits of scaling the finished block after:
    /// float32 and float16 sums scaled by a factor that rounds (1/3), int32 truncated toward zero, on 1-3
    /// ranks, and blocks large enough for streaming stores (4 MiB and more) as well as small ones.
    #[test]
    fn postscale_while_writing_equals_scaling_the_result_after() {
        let cases =
            [(DataType::Float32, 1 << 20), (DataType::Float32, 1000), (DataType::Float16, 999), (DataType::Int32, 77)];
        for size in 1..=3 {
            for &(dtype, elems_per_rank) in &cases {
                let counts = vec![elems_per_rank; size];
                let results = run_ranks(MemoryTransport::mesh(size), |t| {
                    let input = contribution(dtype, elems_per_rank * t.size(), t.rank());
                    let mut scaled = vec![0; elems_per_rank * dtype.size()];
                    reducescatter(t, &input, &counts, dtype, Combine::Sum, 1.0 / 3.0, &mut scaled).unwrap();
                    let mut after = vec![0; scaled.len()];
                    reducescatter(t, &input, &counts, dtype, Combine::Sum, 1.0, &mut after).unwrap();
                    scale_in_place(&mut after, dtype, 1.0 / 3.0);
                    (scaled, after)
                });
                for (rank, (scaled, after)) in results.into_iter().enumerate() {
                    assert!(scaled == after, "{dtype} x {elems_per_rank} on {size} ranks: rank {rank} differs");
                    assert!(scaled.iter().any(|&b| b != 0), "{dtype}: the result is all zero, so nothing was tested");
                }
            }
        }
    }

    /// Rank `rank`'s contribution of `len` elements (float32, float16 or int32): values whose sums and thirds
    /// round in `dtype`.
    pub(crate) fn contribution(dtype: DataType, len: usize, rank: usize) -> Vec<u8> {
        let value = |i: usize| ((i * 7 + rank * 13) % 101) as f64 * 0.37 - 17.0;
        let mut out = Vec::with_capacity(len * dtype.size());
        for i in 0..len {
            match dtype {
                DataType::Float32 => out.extend_from_slice(&(value(i) as f32).to_ne_bytes()),
                DataType::Float16 => out.extend_from_slice(&half::f16::from_f64(value(i)).to_ne_bytes()),
                DataType::Int32 => out.extend_from_slice(&((value(i) * 100.0) as i32).to_ne_bytes()),
                _ => unreachable!("not a tested dtype"),
            }
        }
        out
    }

    #[test]
    fn mismatched_output_is_rejected() {
        let results = run_ranks(MemoryTransport::mesh(1), |t| {
            reducescatter(t, &[0; 4], &[4], DataType::Uint8, Combine::Sum, 1.0, &mut [0; 3])
        });
        assert!(matches!(&results[0], Err(TransportError::Io { .. })));
    }
}
