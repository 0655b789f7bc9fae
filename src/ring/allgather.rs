//! Allgather with per-rank sizes: every rank ends with all ranks' blocks, concatenated in rank order.
//!
//! Two algorithms, chosen by the result's size and the number of ranks ([`choose_allgather`]) or forced by
//! the configuration: Bruck's (see [`bruck`](super::bruck)), `ceil(log2 n)` steps, for small results; the
//! ring for large ones: `n - 1` steps, each forwarding the block received in the previous step to the right
//! neighbour while the next block arrives from the left straight into its final place.
//! `allgather_ring` is also the second half of the large-message allreduce.
//!
//! [`choose_allgather`]: crate::ring::choice::choose_allgather

use std::ops::Range;

use crate::ring::args::{expect_len, invalid_argument};
use crate::ring::bruck::allgather_bruck;
use crate::ring::choice::{choose_allgather, AllgatherAlgorithm};
use crate::ring::chunks::{allgather_step, Blocks};
use crate::ring::disjoint::read_write_pair;
use crate::tensor::{copy_streaming, STREAMING_MIN_BYTES};
use crate::transport::{Transport, TransportError};

/// Gather every rank's `send` into `recv` in rank order; rank `r` contributes `bytes_per_rank[r]` bytes
/// (possibly 0) and `recv.len()` is their sum. The algorithm is the one the total size and the number of
/// ranks call for.
pub fn allgatherv(
    t: &mut dyn Transport,
    send: &[u8],
    recv: &mut [u8],
    bytes_per_rank: &[usize],
) -> Result<(), TransportError> {
    let algorithm = choose_allgather(recv.len(), t.size(), None);
    allgatherv_by(t, send, recv, bytes_per_rank, algorithm)
}

/// [`allgatherv`] by `algorithm` (every rank must pass the same).
pub fn allgatherv_by(
    t: &mut dyn Transport,
    send: &[u8],
    recv: &mut [u8],
    bytes_per_rank: &[usize],
    algorithm: AllgatherAlgorithm,
) -> Result<(), TransportError> {
    const OP: &str = "allgatherv";
    let rank = t.rank();
    expect_len(rank, OP, "number of per-rank byte counts", bytes_per_rank.len(), t.size())?;
    let blocks = Blocks::from_lengths(bytes_per_rank, 1)
        .ok_or_else(|| invalid_argument(rank, OP, "per-rank byte counts overflow".to_string()))?;
    expect_len(rank, OP, "send length in bytes", send.len(), blocks.len(rank))?;
    expect_len(rank, OP, "receive length in bytes", recv.len(), blocks.total())?;
    // A large `recv` is a result nobody reads before the op completes: written with streaming stores (see
    // `copy_streaming`), its old contents are never read.
    let streaming = blocks.total() >= STREAMING_MIN_BYTES;
    let own = &mut recv[blocks.range(rank)];
    if streaming {
        copy_streaming(own, send);
    } else {
        own.copy_from_slice(send);
    }
    if t.size() > 1 && blocks.total() > 0 {
        match algorithm {
            AllgatherAlgorithm::Bruck => allgather_bruck(t, recv, &blocks)?,
            AllgatherAlgorithm::Ring => ring(t, recv, &blocks, streaming)?,
        }
    }
    Ok(())
}

/// The ring allgather over `buf` split into `blocks`, where block `rank` is already in place.
pub(crate) fn allgather_ring(t: &mut dyn Transport, buf: &mut [u8], blocks: &Blocks) -> Result<(), TransportError> {
    ring(t, buf, blocks, false)
}

/// The ring allgather over blocks of `buf` anywhere in it: rank `r`'s block is `range_of(r)` (disjoint from
/// the others), and this rank's is already in place.
pub(crate) fn allgather_ring_at(
    t: &mut dyn Transport,
    buf: &mut [u8],
    range_of: &dyn Fn(usize) -> Range<usize>,
) -> Result<(), TransportError> {
    ring_at(t, buf, range_of, false)
}

/// [`allgather_ring`], writing what arrives with streaming stores if `streaming`.
fn ring(t: &mut dyn Transport, buf: &mut [u8], blocks: &Blocks, streaming: bool) -> Result<(), TransportError> {
    ring_at(t, buf, &|block| blocks.range(block), streaming)
}

/// [`allgather_ring_at`], writing what arrives with streaming stores if `streaming`.
fn ring_at(
    t: &mut dyn Transport,
    buf: &mut [u8],
    range_of: &dyn Fn(usize) -> Range<usize>,
    streaming: bool,
) -> Result<(), TransportError> {
    let (rank, n) = (t.rank(), t.size());
    let right = (rank + 1) % n;
    let left = (rank + n - 1) % n;
    for step in 0..n - 1 {
        let (send_block, recv_block) = allgather_step(rank, n, step);
        let (outgoing, incoming) = read_write_pair(buf, range_of(send_block), range_of(recv_block))
            .ok_or_else(|| invalid_argument(rank, "allgather", "ring blocks overlap or overrun the buffer".into()))?;
        if streaming {
            let incoming_len = incoming.len();
            t.exchange(right, outgoing, left, incoming_len, &mut |offset, piece| {
                copy_streaming(&mut incoming[offset..offset + piece.len()], piece)
            })?;
        } else {
            // Straight into place where the transport can (`sendrecv`).
            t.sendrecv(right, outgoing, left, incoming)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::memory::{run_ranks, MemoryTransport};

    #[test]
    fn blocks_land_in_rank_order() {
        let bytes_per_rank = [1, 0, 3, 2];
        let results = run_ranks(MemoryTransport::mesh(4), |t| {
            let send = vec![t.rank() as u8; bytes_per_rank[t.rank()]];
            let mut recv = vec![9; 6];
            allgatherv(t, &send, &mut recv, &bytes_per_rank).unwrap();
            recv
        });
        assert!(results.iter().all(|r| r == &[0, 2, 2, 2, 3, 3]));
    }
}
