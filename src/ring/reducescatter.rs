//! Reduce-scatter: every rank contributes a whole tensor and rank `r` receives block `r` of the
//! element-wise combination of all of them.
//!
//! Ring algorithm: `n - 1` steps, each sending one (partially reduced) block to the right neighbour while
//! the left neighbour's block streams in and is combined into the local copy as its bytes arrive, so no
//! message is ever staged whole. Each block is combined in a fixed chain order, so its result does not
//! depend on timing. `reduce_scatter_ring` is also the first half of the large-message allreduce.

use crate::ring::args::{expect_len, invalid_argument};
use crate::ring::chunks::{reduce_scatter_step, Blocks};
use crate::ring::disjoint::read_write_pair;
use crate::ring::streaming::StreamingReducer;
use crate::transport::{Transport, TransportError};
use crate::types::{Combine, DataType};

/// Combine `input` across ranks and leave rank `r`'s block (`elems_per_rank[r]` elements, the blocks laid
/// out in rank order in `input`) in `out`. `input` is used as scratch and holds garbage afterwards.
pub fn reducescatter(
    t: &mut dyn Transport,
    input: &mut [u8],
    elems_per_rank: &[usize],
    dtype: DataType,
    combine: Combine,
    out: &mut [u8],
) -> Result<(), TransportError> {
    const OP: &str = "reducescatter";
    let rank = t.rank();
    expect_len(rank, OP, "number of per-rank element counts", elems_per_rank.len(), t.size())?;
    let blocks = Blocks::from_lengths(elems_per_rank, dtype.size())
        .ok_or_else(|| invalid_argument(rank, OP, "per-rank element counts overflow".to_string()))?;
    expect_len(rank, OP, "input length in bytes", input.len(), blocks.total())?;
    expect_len(rank, OP, "output length in bytes", out.len(), blocks.len(rank))?;
    if t.size() > 1 && blocks.total() > 0 {
        reduce_scatter_ring(t, input, &blocks, dtype, combine)?;
    }
    out.copy_from_slice(&input[blocks.range(rank)]);
    Ok(())
}

/// The ring reduce-scatter over `buf` split into `blocks` (one per rank, lengths whole elements). On return
/// block `rank` of `buf` holds the combination of every rank's block; other blocks hold partial results.
pub(crate) fn reduce_scatter_ring(
    t: &mut dyn Transport,
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
        let mut reducer = StreamingReducer::new(incoming, dtype, combine);
        t.exchange(right, outgoing, left, incoming_len, &mut |_, piece| reducer.accept(piece))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::memory::{run_ranks, MemoryTransport};

    #[test]
    fn each_rank_gets_its_reduced_block() {
        let elems_per_rank = [2, 0, 3];
        let results = run_ranks(MemoryTransport::mesh(3), |t| {
            let mut input: Vec<u8> = (0..5).map(|i| (i * 10 + t.rank()) as u8).collect();
            let mut out = vec![0; elems_per_rank[t.rank()]];
            reducescatter(t, &mut input, &elems_per_rank, DataType::Uint8, Combine::Max, &mut out).unwrap();
            out
        });
        assert_eq!(results, vec![vec![2, 12], vec![], vec![22, 32, 42]]);
    }

    #[test]
    fn mismatched_output_is_rejected() {
        let results = run_ranks(MemoryTransport::mesh(1), |t| {
            reducescatter(t, &mut [0; 4], &[4], DataType::Uint8, Combine::Sum, &mut [0; 3])
        });
        assert!(matches!(&results[0], Err(TransportError::Io { .. })));
    }
}
