//! Allreduce: every rank's buffer becomes the element-wise combination of all ranks' buffers, with
//! bitwise identical results on every rank.
//!
//! Three algorithms, chosen by size and number of ranks ([`choose_allreduce`]) or forced by the
//! configuration. Recursive doubling: `log2(n)` whole-buffer exchanges, with the ranks beyond the largest
//! power of two first folding their data onto a partner and getting the result back at the end. Partners
//! always combine in rank order (lower rank's operand on the left), so both compute the same expression on
//! the same bits even where `a ⊕ b` and `b ⊕ a` differ (NaN payloads). Rabenseifner's (see
//! [`rabenseifner`](super::rabenseifner)): recursive halving, then recursive doubling of the pieces. The
//! bandwidth-optimal ring: reduce-scatter, where each block is combined along one chain, then allgather,
//! which copies the finished blocks to everyone. Two ranks over a transport with cheap hand-offs (shared
//! memory; see [`Capabilities`]) pipeline the ring's two phases instead (see [`two_ranks_pipelined`]).
//!
//! [`Capabilities`]: crate::transport::Capabilities
//! [`choose_allreduce`]: crate::ring::choice::choose_allreduce

use crate::ring::allgather::allgather_ring;
use crate::ring::args::invalid_argument;
use crate::ring::choice::{choose_allreduce, AllreduceAlgorithm};
use crate::ring::chunks::Blocks;
use crate::ring::rabenseifner::rabenseifner;
use crate::ring::reduce::{reduce_into, scale_in_place};
use crate::ring::reducescatter::reduce_scatter_ring;
use crate::ring::streaming::StreamingReducer;
use crate::tensor::{copy_streaming, STREAMING_MIN_BYTES};
use crate::transport::{Transport, TransportError};
use crate::types::{Combine, DataType};

/// Piece of the pipelined two-rank allreduce: small enough that a reduced piece is still in cache when it
/// is sent back, large enough that the two hand-offs per piece cost little (a few microseconds over
/// shared memory, which is why TCP, with ~22 us per hand-off, keeps the ring).
const PIPELINE_PIECE_BYTES: usize = 256 * 1024;

/// Combine `buf` element-wise across all ranks, in place, by the algorithm its size and the number of
/// ranks call for.
pub fn allreduce(
    t: &mut dyn Transport,
    buf: &mut [u8],
    dtype: DataType,
    combine: Combine,
) -> Result<(), TransportError> {
    let algorithm = choose_allreduce(buf.len(), t.size(), t.capabilities().cheap_handoffs, None);
    allreduce_by(t, None, buf, dtype, combine, algorithm)
}

/// Combine `src` element-wise across all ranks into `dst` (of the same length), leaving `src` as it is:
/// the same bits as copying `src` into `dst` and reducing in place, by the algorithm its size and the number
/// of ranks call for.
pub fn allreduce_into(
    t: &mut dyn Transport,
    src: &[u8],
    dst: &mut [u8],
    dtype: DataType,
    combine: Combine,
) -> Result<(), TransportError> {
    let algorithm = choose_allreduce(src.len(), t.size(), t.capabilities().cheap_handoffs, None);
    allreduce_by(t, Some(src), dst, dtype, combine, algorithm)
}

/// Combine `buf` element-wise across all ranks by `algorithm` (every rank must pass the same), in place; with
/// a `src` (of `buf`'s length), out of place: `buf` gets the result and `src` is left as it is. Two ranks with
/// cheap hand-offs read `src` and write `buf` piece by piece, and the ring and Rabenseifner's read `src` in
/// their first steps, so the result costs no pass of its own over memory (a 64 MiB copy takes about as long
/// as the collective); recursive doubling copies `src` first.
pub fn allreduce_by(
    t: &mut dyn Transport,
    src: Option<&[u8]>,
    buf: &mut [u8],
    dtype: DataType,
    combine: Combine,
    algorithm: AllreduceAlgorithm,
) -> Result<(), TransportError> {
    allreduce_scaled_by(t, src, buf, dtype, (combine, 1.0), algorithm)
}

/// [`allreduce_by`], the result multiplied by `postscale` (`scale_in_place`'s arithmetic, the same bits as
/// scaling it after): each element is scaled once, by the rank that finishes reducing it, before it is sent
/// to the others (the two-rank pipeline scales a piece while it is in cache, the ring and Rabenseifner's
/// scale this rank's block between their two phases), so an `Average` costs a pass over `1/n` of the buffer
/// instead of all of it. Recursive doubling, where every rank reduces everything, scales at the end.
pub fn allreduce_scaled_by(
    t: &mut dyn Transport,
    src: Option<&[u8]>,
    buf: &mut [u8],
    dtype: DataType,
    (combine, postscale): (Combine, f64),
    algorithm: AllreduceAlgorithm,
) -> Result<(), TransportError> {
    if let Some(src) = src {
        if src.len() != buf.len() {
            let detail = format!("the source has {} bytes and the destination {}", src.len(), buf.len());
            return Err(invalid_argument(t.rank(), "allreduce", detail));
        }
    }
    check_whole_elements(t, buf.len(), dtype)?;
    let n = t.size();
    if n <= 1 || buf.is_empty() {
        if let Some(src) = src {
            buf.copy_from_slice(src);
        }
        scale_in_place(buf, dtype, postscale);
        return Ok(());
    }
    match algorithm {
        AllreduceAlgorithm::Ring if n == 2 && t.capabilities().cheap_handoffs => {
            two_ranks_pipelined(t, src, buf, dtype, (combine, postscale))
        }
        AllreduceAlgorithm::Ring => {
            // The reduce-scatter reads `src` and writes every block but one; the allgather the rest.
            let blocks = Blocks::even(buf.len() / dtype.size(), n, dtype.size());
            reduce_scatter_ring(t, src, buf, &blocks, dtype, combine)?;
            scale_in_place(&mut buf[blocks.range(t.rank())], dtype, postscale);
            allgather_ring(t, buf, &blocks)
        }
        AllreduceAlgorithm::Rabenseifner => rabenseifner(t, src, buf, dtype, (combine, postscale)),
        AllreduceAlgorithm::RecursiveDoubling => {
            if let Some(src) = src {
                buf.copy_from_slice(src);
            }
            recursive_doubling(t, buf, dtype, combine)?;
            scale_in_place(buf, dtype, postscale);
            Ok(())
        }
    }
}

fn check_whole_elements(t: &dyn Transport, len: usize, dtype: DataType) -> Result<(), TransportError> {
    if len % dtype.size() != 0 {
        let detail = format!("{len} bytes is not a whole number of {dtype} elements");
        return Err(invalid_argument(t.rank(), "allreduce", detail));
    }
    Ok(())
}

/// Two ranks: rank 0 owns the first half of the elements, rank 1 the second. Piece by piece, each rank
/// sends the peer the raw piece of the peer's half and reduces the peer's raw piece of its own half into
/// its buffer, then at once sends that reduced piece back (still in cache) and stores the peer's reduced
/// piece. The ring's allgather phase would read the reduced half back from memory; this saves that pass
/// (4 instead of 5 half-buffer passes over DRAM per rank). Each half is reduced once, by its owner, so both
/// ranks end with the same bits. With a separate `src`, the raw pieces are read from it and this rank's
/// half is combined from it into `buf` as the peer's piece arrives.
fn two_ranks_pipelined(
    t: &mut dyn Transport,
    src: Option<&[u8]>,
    buf: &mut [u8],
    dtype: DataType,
    (combine, postscale): (Combine, f64),
) -> Result<(), TransportError> {
    let rank = t.rank();
    let peer = 1 - rank;
    let buf_len = buf.len();
    let half = buf.len() / dtype.size() / 2 * dtype.size();
    let (first, second) = buf.split_at_mut(half);
    let (mine, theirs) = if rank == 0 { (first, second) } else { (second, first) };
    let src_halves = src.map(|s| s.split_at(half)).map(|(a, b)| if rank == 0 { (a, b) } else { (b, a) });
    let piece = PIPELINE_PIECE_BYTES - PIPELINE_PIECE_BYTES % dtype.size();
    let bounds = |len: usize, i: usize| (len.min(i * piece), len.min((i + 1) * piece));
    let steps = mine.len().max(theirs.len()).div_ceil(piece);
    // Out of place and large, this rank's reduced piece is made in a scratch piece (in cache), sent from
    // there, and written to the result with streaming stores, as the peer's piece is: the result's memory
    // is never read. Smaller results are written in place, and stay in cache for their reader.
    let streaming = src_halves.is_some() && buf_len >= STREAMING_MIN_BYTES;
    let mut scratch = if streaming { vec![0u8; piece.min(mine.len())] } else { Vec::new() };
    for i in 0..steps {
        let (m0, m1) = bounds(mine.len(), i);
        let (t0, t1) = bounds(theirs.len(), i);
        let (raw_theirs, mut reducer) = match src_halves {
            Some((src_mine, src_theirs)) => {
                let target = if streaming { &mut scratch[..m1 - m0] } else { &mut mine[m0..m1] };
                let reducer = StreamingReducer::from_base(&src_mine[m0..m1], target, dtype, combine);
                (&src_theirs[t0..t1], reducer.scaled(postscale))
            }
            None => (&theirs[t0..t1], StreamingReducer::new(&mut mine[m0..m1], dtype, combine).scaled(postscale)),
        };
        t.exchange(peer, raw_theirs, peer, m1 - m0, &mut |_, bytes| reducer.accept(bytes))?;
        let theirs_piece = &mut theirs[t0..t1];
        if streaming {
            let reduced = &scratch[..m1 - m0];
            t.exchange(peer, reduced, peer, t1 - t0, &mut |offset, bytes| {
                copy_streaming(&mut theirs_piece[offset..offset + bytes.len()], bytes)
            })?;
            copy_streaming(&mut mine[m0..m1], reduced);
        } else {
            t.exchange(peer, &mine[m0..m1], peer, t1 - t0, &mut |offset, bytes| {
                theirs_piece[offset..offset + bytes.len()].copy_from_slice(bytes)
            })?;
        }
    }
    Ok(())
}

fn recursive_doubling(
    t: &mut dyn Transport,
    buf: &mut [u8],
    dtype: DataType,
    combine: Combine,
) -> Result<(), TransportError> {
    let (rank, n) = (t.rank(), t.size());
    let core = 1usize << n.ilog2();
    if rank >= core {
        let partner = rank - core;
        t.send(partner, buf)?;
        return t.recv(partner, buf);
    }
    let folded_partner = rank + core;
    let mut received = vec![0u8; buf.len()];
    if folded_partner < n {
        t.recv(folded_partner, &mut received)?;
        reduce_into(buf, &received, dtype, combine);
    }
    let mut distance = 1;
    while distance < core {
        let partner = rank ^ distance;
        t.sendrecv(partner, buf, partner, &mut received)?;
        if partner < rank {
            reduce_into(&mut received, buf, dtype, combine);
            buf.copy_from_slice(&received);
        } else {
            reduce_into(buf, &received, dtype, combine);
        }
        distance <<= 1;
    }
    if folded_partner < n {
        t.send(folded_partner, buf)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ring::choice::RECURSIVE_DOUBLING_MAX_BYTES;
    use crate::ring::reducescatter::tests::contribution;
    use crate::transport::memory::{run_ranks, MemoryTransport, Recorded};
    use crate::transport::Capabilities;
    use crate::types::Named;

    fn f32_bytes(values: impl IntoIterator<Item = f32>) -> Vec<u8> {
        values.into_iter().flat_map(f32::to_ne_bytes).collect()
    }

    #[test]
    fn nan_payloads_come_out_identical_on_every_rank() {
        // x86 keeps the first operand's payload when adding two NaNs, so a ⊕ b and b ⊕ a differ bitwise.
        for n in 2..=5 {
            for count in [3, RECURSIVE_DOUBLING_MAX_BYTES / 4 + 1] {
                let results = run_ranks(MemoryTransport::mesh(n), |t| {
                    let nan = f32::from_bits(0x7fc0_0000 | (t.rank() as u32 + 1));
                    let mut buf = f32_bytes((0..count).map(|_| nan));
                    allreduce(t, &mut buf, DataType::Float32, Combine::Sum).unwrap();
                    buf
                });
                assert!(results.iter().all(|r| r == &results[0]), "n={n} count={count}");
            }
        }
    }

    #[test]
    fn both_sides_of_the_threshold_sum_correctly() {
        for n in [3, 4] {
            for count in [RECURSIVE_DOUBLING_MAX_BYTES / 4, RECURSIVE_DOUBLING_MAX_BYTES / 4 + 1] {
                let results = run_ranks(MemoryTransport::mesh(n), |t| {
                    let mut buf = f32_bytes((0..count).map(|i| (i % 7) as f32 + t.rank() as f32));
                    allreduce(t, &mut buf, DataType::Float32, Combine::Sum).unwrap();
                    buf
                });
                let rank_sum = (n * (n - 1) / 2) as f32;
                let want = f32_bytes((0..count).map(|i| n as f32 * (i % 7) as f32 + rank_sum));
                assert!(results.iter().all(|r| r == &want), "n={n} count={count}");
            }
        }
    }

    /// Each rank's result and exchange sizes of an allreduce of `count` floats on two ranks (in place, or
    /// out of place with `into`) over transports with cheap hand-offs or not.
    fn two_ranks(count: usize, cheap: bool, into: bool) -> Vec<(Vec<u8>, Vec<usize>)> {
        // The pipelined two-rank path sends halves where recursive doubling sends the whole buffer.
        run_ranks(Recorded::mesh(2, Capabilities { cheap_handoffs: cheap }), |t| {
            let src = f32_bytes((0..count).map(|i| (i % 5) as f32 * 0.25 + t.rank() as f32));
            let mut buf = if into { vec![0; src.len()] } else { src.clone() };
            if into {
                allreduce_into(t, &src, &mut buf, DataType::Float32, Combine::Sum).unwrap();
            } else {
                allreduce(t, &mut buf, DataType::Float32, Combine::Sum).unwrap();
            }
            (buf, std::mem::take(&mut t.sent))
        })
    }

    /// Scaled by the rank that finishes each element (in the two-rank pipeline's pieces, between the ring's
    /// and Rabenseifner's phases, after recursive doubling) gives the bits of scaling the whole result after:
    /// every algorithm, 1-5 ranks (5 folds a rank onto a partner), in place and out of place, float32 large
    /// enough for the pipeline's streaming stores, float16 and int32 (truncated toward zero).
    #[test]
    fn every_algorithm_scaled_by_its_last_reducer_equals_scaling_the_result_after() {
        let cases =
            [(DataType::Float32, 1 << 20), (DataType::Float32, 4097), (DataType::Float16, 999), (DataType::Int32, 77)];
        for n in 1..=5 {
            for cheap in [false, true] {
                if cheap && n != 2 {
                    continue; // hand-offs matter to the two-rank pipeline only
                }
                let outcomes = run_ranks(Recorded::mesh(n, Capabilities { cheap_handoffs: cheap }), |t| {
                    let mut outcomes = Vec::new();
                    for &(dtype, count) in &cases {
                        let src = contribution(dtype, count, t.rank());
                        for &algorithm in AllreduceAlgorithm::ALL {
                            for into in [false, true] {
                                let mut scaled = if into { vec![0; src.len()] } else { src.clone() };
                                let from = into.then_some(&src[..]);
                                allreduce_scaled_by(t, from, &mut scaled, dtype, (Combine::Sum, 1.0 / 3.0), algorithm)
                                    .unwrap();
                                let mut after = if into { vec![0; src.len()] } else { src.clone() };
                                allreduce_by(t, from, &mut after, dtype, Combine::Sum, algorithm).unwrap();
                                scale_in_place(&mut after, dtype, 1.0 / 3.0);
                                let changed = scaled != src;
                                outcomes.push((
                                    format!("{dtype} x {count} {algorithm} into {into}"),
                                    scaled == after,
                                    changed,
                                ));
                            }
                        }
                    }
                    outcomes
                });
                for (rank, outcomes) in outcomes.iter().enumerate() {
                    for (case, same, changed) in outcomes {
                        assert!(
                            same,
                            "{n} ranks (cheap hand-offs {cheap}), rank {rank}, {case}: differs from scaling after"
                        );
                        assert!(
                            changed,
                            "{n} ranks, rank {rank}, {case}: the result equals the input, so nothing was tested"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn two_ranks_pipeline_where_the_transport_says_hand_offs_are_cheap() {
        let count = RECURSIVE_DOUBLING_MAX_BYTES / 4; // 64 KiB: recursive doubling unless the two ranks pipeline
        let want = f32_bytes((0..count).map(|i| (i % 5) as f32 * 0.5 + 1.0));
        for into in [false, true] {
            let (cheap, costly) = (two_ranks(count, true, into), two_ranks(count, false, into));
            for rank in 0..2 {
                assert_eq!(cheap[rank].0, want, "cheap hand-offs, rank {rank}, into {into}");
                assert_eq!(costly[rank].0, want, "costly hand-offs, rank {rank}, into {into}");
                // Pipelined: each half raw, then reduced; recursive doubling: the whole buffer once.
                let half = count * 4 / 2;
                assert_eq!(cheap[rank].1, vec![half, half], "rank {rank}, into {into}");
                assert_eq!(costly[rank].1, vec![count * 4], "rank {rank}, into {into}");
            }
        }
        // Large: pieces of PIPELINE_PIECE_BYTES against the ring's two half-buffer steps, same bits.
        let count = 3 * PIPELINE_PIECE_BYTES / 4 + 3;
        for into in [false, true] {
            let (cheap, costly) = (two_ranks(count, true, into), two_ranks(count, false, into));
            assert_eq!(cheap[0].0, costly[0].0, "into {into}");
            assert_eq!(cheap[1].0, costly[0].0, "into {into}");
            assert!(cheap[0].1.len() > 2 && cheap[0].1.iter().all(|&n| n <= PIPELINE_PIECE_BYTES), "{:?}", cheap[0].1);
            assert_eq!(costly[0].1.len(), 2, "{:?}", costly[0].1);
        }
    }

    #[test]
    fn partial_elements_are_rejected() {
        let results = run_ranks(MemoryTransport::mesh(1), |t| allreduce(t, &mut [0; 3], DataType::Int16, Combine::Sum));
        assert!(matches!(&results[0], Err(TransportError::Io { .. })));
    }
}
