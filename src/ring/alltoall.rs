//! All-to-all with per-pair sizes: rank `r` sends block `p` of its input to rank `p` and receives rank
//! `p`'s block for it into block `p` of its output.
//!
//! Pairwise schedule: at step `k` (1..n) a rank sends to `rank + k` while receiving from `rank - k` in one
//! full-duplex exchange, so every rank is busy every step and no cycle of blocked sends can form.

use crate::ring::args::{expect_len, invalid_argument};
use crate::ring::chunks::Blocks;
use crate::transport::{Transport, TransportError};

/// Exchange `send` (rank-major, `send_bytes[p]` bytes for rank `p`) for `recv` (rank-major,
/// `recv_bytes[p]` bytes from rank `p`). Any block may be empty.
pub fn alltoallv(
    t: &mut dyn Transport,
    send: &[u8],
    send_bytes: &[usize],
    recv: &mut [u8],
    recv_bytes: &[usize],
) -> Result<(), TransportError> {
    const OP: &str = "alltoallv";
    let (rank, n) = (t.rank(), t.size());
    expect_len(rank, OP, "number of per-rank send sizes", send_bytes.len(), n)?;
    expect_len(rank, OP, "number of per-rank receive sizes", recv_bytes.len(), n)?;
    let overflow = || invalid_argument(rank, OP, "per-rank sizes overflow".to_string());
    let send_blocks = Blocks::from_lengths(send_bytes, 1).ok_or_else(overflow)?;
    let recv_blocks = Blocks::from_lengths(recv_bytes, 1).ok_or_else(overflow)?;
    expect_len(rank, OP, "send length in bytes", send.len(), send_blocks.total())?;
    expect_len(rank, OP, "receive length in bytes", recv.len(), recv_blocks.total())?;
    expect_len(rank, OP, "bytes this rank receives from itself", recv_blocks.len(rank), send_blocks.len(rank))?;
    recv[recv_blocks.range(rank)].copy_from_slice(&send[send_blocks.range(rank)]);
    for step in 1..n {
        let to = (rank + step) % n;
        let from = (rank + n - step) % n;
        t.sendrecv(to, &send[send_blocks.range(to)], from, &mut recv[recv_blocks.range(from)])?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::memory::{run_ranks, MemoryTransport};

    #[test]
    fn blocks_reach_their_ranks() {
        // Rank r sends r + 1 copies of byte 10 * r + p to rank p, except nothing to rank 0 from rank 2.
        let size = |from: usize, to: usize| if from == 2 && to == 0 { 0 } else { from + 1 };
        let results = run_ranks(MemoryTransport::mesh(3), |t| {
            let rank = t.rank();
            let send_bytes: Vec<usize> = (0..3).map(|to| size(rank, to)).collect();
            let recv_bytes: Vec<usize> = (0..3).map(|from| size(from, rank)).collect();
            let send: Vec<u8> = (0..3).flat_map(|to| vec![(10 * rank + to) as u8; size(rank, to)]).collect();
            let mut recv = vec![0; recv_bytes.iter().sum()];
            alltoallv(t, &send, &send_bytes, &mut recv, &recv_bytes).unwrap();
            recv
        });
        assert_eq!(results[0], vec![0, 10, 10]);
        assert_eq!(results[1], vec![1, 11, 11, 21, 21, 21]);
        assert_eq!(results[2], vec![2, 12, 12, 22, 22, 22]);
    }
}
