//! Rabenseifner's allreduce: a reduce-scatter by recursive halving, then an allgather by recursive
//! doubling, over the largest power of two `p <= n` ranks. It moves the ring's `2(p-1)/p * S` bytes per
//! rank in `2 log2(p)` steps instead of the ring's `2(n-1)`, which is what pays for medium buffers on many
//! ranks.
//!
//! Ranks `p..n` first send their whole buffer to rank `r - p`, which combines it into its own, and get the
//! result back at the end (the same fold as recursive doubling). Halving step `d = p/2, p/4, .., 1`: a rank
//! keeps the half of its current window of segments on its side of bit `d`, sends the other half to
//! `rank ^ d` and combines the partner's copy of its half in as it streams in; after `log2(p)` steps rank `r`
//! holds segment `r` fully combined. Every element is combined by one rank only and then copied, so all
//! ranks end with the same bits.

use crate::ring::args::invalid_argument;
use crate::ring::chunks::Blocks;
use crate::ring::disjoint::read_write_pair;
use crate::ring::reduce::scale_in_place;
use crate::ring::streaming::StreamingReducer;
use crate::transport::{Transport, TransportError};
use crate::types::{Combine, DataType};

/// Combine `buf` element-wise across all ranks, in place; with a `src`, out of place: `buf` (of `src`'s
/// length) gets the result and `src` is only read.
pub(crate) fn rabenseifner(
    t: &mut dyn Transport,
    mut src: Option<&[u8]>,
    buf: &mut [u8],
    dtype: DataType,
    (combine, postscale): (Combine, f64),
) -> Result<(), TransportError> {
    let (rank, n) = (t.rank(), t.size());
    let core = 1usize << n.max(1).ilog2();
    let len = buf.len();
    if rank >= core {
        let partner = rank - core;
        t.send(partner, src.unwrap_or(&*buf))?;
        return t.recv(partner, buf);
    }
    let folded = rank + core;
    if folded < n {
        let mut reducer = match src.take() {
            Some(src) => StreamingReducer::from_base(src, buf, dtype, combine),
            None => StreamingReducer::new(buf, dtype, combine),
        };
        t.exchange(folded, &[], folded, len, &mut |_, piece| reducer.accept(piece))?;
    }
    let segments = Blocks::even(len / dtype.size(), core, dtype.size());
    let bytes = |(lo, hi): (usize, usize)| segments.range(lo).start..segments.range(hi - 1).end;
    let overlap = || invalid_argument(rank, "allreduce", "Rabenseifner segments overlap".to_string());
    // Reduce-scatter by recursive halving: the window [lo, hi) of segments this rank is combining.
    let mut window = (0, core);
    let mut distance = core / 2;
    while distance > 0 {
        let (lo, hi) = window;
        let mid = lo + distance;
        let (keep, give, partner) = if rank & distance == 0 {
            ((lo, mid), (mid, hi), rank + distance)
        } else {
            ((mid, hi), (lo, mid), rank - distance)
        };
        let (keep_bytes, give_bytes) = (bytes(keep), bytes(give));
        let keep_len = keep_bytes.len();
        match src.take() {
            Some(src) => {
                let base = &src[keep_bytes.clone()];
                let mut reducer = StreamingReducer::from_base(base, &mut buf[keep_bytes], dtype, combine);
                t.exchange(partner, &src[give_bytes], partner, keep_len, &mut |_, piece| reducer.accept(piece))?;
            }
            None => {
                let (outgoing, incoming) = read_write_pair(buf, give_bytes, keep_bytes).ok_or_else(overlap)?;
                let mut reducer = StreamingReducer::new(incoming, dtype, combine);
                t.exchange(partner, outgoing, partner, keep_len, &mut |_, piece| reducer.accept(piece))?;
            }
        }
        window = keep;
        distance /= 2;
    }
    if let Some(src) = src {
        // One rank: nothing was exchanged.
        buf.copy_from_slice(src);
    }
    // This rank's window is finished: scaled once here, before the allgather copies it to the others.
    scale_in_place(&mut buf[bytes(window)], dtype, postscale);
    // Allgather by recursive doubling: this rank's window of `distance` segments for the partner's.
    let mut distance = 1;
    while distance < core {
        let partner = rank ^ distance;
        let mine = rank - rank % distance;
        let theirs = partner - partner % distance;
        let (outgoing, incoming) =
            read_write_pair(buf, bytes((mine, mine + distance)), bytes((theirs, theirs + distance)))
                .ok_or_else(overlap)?;
        let incoming_len = incoming.len();
        t.exchange(partner, outgoing, partner, incoming_len, &mut |offset, piece| {
            incoming[offset..offset + piece.len()].copy_from_slice(piece)
        })?;
        distance <<= 1;
    }
    if folded < n {
        t.send(folded, buf)?;
    }
    Ok(())
}
