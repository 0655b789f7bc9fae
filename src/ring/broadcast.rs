//! Broadcast: the root's buffer is copied to every rank.
//!
//! Two algorithms, chosen by size and number of ranks ([`choose_broadcast`]) or forced by the
//! configuration. The binomial tree: `ceil(log2 n)` rounds, each a whole-buffer send. The pipelined chain
//! root -> root+1 -> ... in chunks, each middle rank forwarding chunk `k` while chunk `k + 1` arrives, so the
//! time approaches `S / bandwidth` however many ranks there are once the pipeline is full (`n - 2` chunk
//! steps), while a tree needs `log2(n) * S / bandwidth`.
//!
//! [`choose_broadcast`]: crate::ring::choice::choose_broadcast

use crate::ring::args::invalid_argument;
use crate::ring::choice::{choose_broadcast, BroadcastAlgorithm, BROADCAST_CHUNK_BYTES};
use crate::ring::disjoint::read_write_pair;
use crate::transport::{Transport, TransportError};

/// Copy `root`'s `buf` into `buf` on every rank, by the algorithm its size and the number of ranks call for.
pub fn broadcast(t: &mut dyn Transport, buf: &mut [u8], root: usize) -> Result<(), TransportError> {
    let algorithm = choose_broadcast(buf.len(), t.size(), None);
    broadcast_by(t, buf, root, algorithm)
}

/// Copy `root`'s `buf` into `buf` on every rank by `algorithm` (every rank must pass the same).
pub fn broadcast_by(
    t: &mut dyn Transport,
    buf: &mut [u8],
    root: usize,
    algorithm: BroadcastAlgorithm,
) -> Result<(), TransportError> {
    let (rank, n) = (t.rank(), t.size());
    if root >= n {
        return Err(invalid_argument(rank, "broadcast", format!("root rank {root} is not below the size {n}")));
    }
    if n <= 1 || buf.is_empty() {
        return Ok(());
    }
    match algorithm {
        BroadcastAlgorithm::Tree => binomial_tree(t, buf, root),
        BroadcastAlgorithm::Chain => pipelined_chain(t, buf, root),
    }
}

fn binomial_tree(t: &mut dyn Transport, buf: &mut [u8], root: usize) -> Result<(), TransportError> {
    let (rank, n) = (t.rank(), t.size());
    let relative = (rank + n - root) % n;
    let to_rank = |relative_peer: usize| (relative_peer + root) % n;
    // Receive from the parent: the rank that differs in this rank's lowest set bit.
    let mut bit = 1;
    while bit < n {
        if relative & bit != 0 {
            t.recv(to_rank(relative - bit), buf)?;
            break;
        }
        bit <<= 1;
    }
    // Send to the children: this rank plus each lower bit.
    bit >>= 1;
    while bit > 0 {
        if relative + bit < n {
            t.send(to_rank(relative + bit), buf)?;
        }
        bit >>= 1;
    }
    Ok(())
}

fn pipelined_chain(t: &mut dyn Transport, buf: &mut [u8], root: usize) -> Result<(), TransportError> {
    let (rank, n) = (t.rank(), t.size());
    let relative = (rank + n - root) % n;
    let next = (rank + 1) % n;
    let previous = (rank + n - 1) % n;
    if relative == 0 {
        return t.send(next, buf);
    }
    if relative == n - 1 {
        return t.recv(previous, buf);
    }
    let len = buf.len();
    let chunk = |k: usize| (k * BROADCAST_CHUNK_BYTES).min(len)..((k + 1) * BROADCAST_CHUNK_BYTES).min(len);
    let chunks = len.div_ceil(BROADCAST_CHUNK_BYTES);
    t.recv(previous, &mut buf[chunk(0)])?;
    for k in 0..chunks {
        let (outgoing, incoming) = read_write_pair(buf, chunk(k), chunk(k + 1))
            .ok_or_else(|| invalid_argument(rank, "broadcast", "chain chunks overlap".to_string()))?;
        t.sendrecv(next, outgoing, previous, incoming)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ring::choice::BROADCAST_CHAIN_THRESHOLD_BYTES;
    use crate::transport::memory::{run_ranks, MemoryTransport};

    fn check(n: usize, root: usize, len: usize) {
        let data: Vec<u8> = (0..len).map(|i| (i % 253) as u8).collect();
        let results = run_ranks(MemoryTransport::mesh(n), |t| {
            let mut buf = if t.rank() == root { data.clone() } else { vec![0; len] };
            broadcast(t, &mut buf, root).unwrap();
            buf
        });
        assert!(results.iter().all(|r| r == &data), "n={n} root={root} len={len}");
    }

    #[test]
    fn tree_reaches_every_rank() {
        for root in 0..6 {
            check(6, root, 1000);
        }
    }

    #[test]
    fn chain_reaches_every_rank_with_a_partial_last_chunk() {
        check(4, 2, BROADCAST_CHAIN_THRESHOLD_BYTES + BROADCAST_CHUNK_BYTES / 2 + 1);
    }

    #[test]
    fn root_outside_the_communicator_is_rejected() {
        let results = run_ranks(MemoryTransport::mesh(2), |t| broadcast(t, &mut [1], 2));
        assert!(results.iter().all(|r| matches!(r, Err(TransportError::Io { .. }))));
    }
}
