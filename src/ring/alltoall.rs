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
