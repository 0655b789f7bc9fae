//! Long exchanges cut into pieces: a ring step's block (megabytes) goes as a sequence of exchanges of at
//! most [`PIECE_BYTES`] each way. Each piece is then read on the other side soon after it was written, while
//! it is still in cache; one exchange of a whole block kept the shared-memory channel full, every byte
//! waiting a whole channel's length before its reader came to it (a 64 MiB reducescatter of two ranks took
//! 2.4x as long as in pieces, measured).

use crate::transport::{Transport, TransportError};

/// Most bytes a piece carries each way: a few of them fit in a core's L2 with the data they meet.
pub(crate) const PIECE_BYTES: usize = 256 * 1024;

/// `t.exchange(to, send, from, recv_len, sink)` as exchanges of at most [`PIECE_BYTES`] each way, in
/// order; `sink` gets each received piece with its offset in the whole message.
pub(crate) fn exchange_in_pieces(
    t: &mut dyn Transport,
    to: usize,
    send: &[u8],
    from: usize,
    recv_len: usize,
    sink: &mut dyn FnMut(usize, &[u8]),
) -> Result<(), TransportError> {
    let pieces = send.len().max(recv_len).div_ceil(PIECE_BYTES).max(1);
    for i in 0..pieces {
        let part = |len: usize| len.min(i * PIECE_BYTES)..len.min((i + 1) * PIECE_BYTES);
        let (outgoing, incoming) = (part(send.len()), part(recv_len));
        let base = incoming.start;
        t.exchange(to, &send[outgoing], from, incoming.len(), &mut |offset, piece| sink(base + offset, piece))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::memory::{run_ranks, MemoryTransport};

    #[test]
    fn pieces_arrive_whole_and_in_order_whatever_the_two_lengths() {
        for (a, b) in [(0, 5), (PIECE_BYTES * 2 + 7, 3), (PIECE_BYTES + 1, PIECE_BYTES * 3 - 1)] {
            let results = run_ranks(MemoryTransport::mesh(2), |t| {
                let me = t.rank();
                let len = |rank: usize| if rank == 0 { a } else { b };
                let send: Vec<u8> = (0..len(me)).map(|i| (i * 31 + me) as u8).collect();
                let mut got = vec![0u8; len(1 - me)];
                exchange_in_pieces(t, 1 - me, &send, 1 - me, got.len(), &mut |offset, piece| {
                    got[offset..offset + piece.len()].copy_from_slice(piece)
                })
                .unwrap();
                got
            });
            for (rank, got) in results.iter().enumerate() {
                let peer = 1 - rank;
                let expected: Vec<u8> = (0..got.len()).map(|i| (i * 31 + peer) as u8).collect();
                assert_eq!(got, &expected, "lengths {a} and {b}, rank {rank}");
            }
        }
    }
}
