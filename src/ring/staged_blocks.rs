//! Reduce-scatter and allgather through the staging areas every rank can read (the shared-memory
//! transport's), as [`staged`](super::staged) runs allreduce: no bytes go through channels, and a collective
//! takes two steps of all ranks instead of a ring's `n - 1` hand-offs between neighbours. That matters most
//! where ranks outnumber cores: a ring step needs both neighbours running, while here each rank does its
//! share whenever it runs.
//!
//! - Reduce-scatter: each rank packs its whole contribution into its own area and announces it; each then
//!   reduces its own block straight out of every rank's area, in rank order and piece by piece (a piece of
//!   the result stays in cache across the sources), and announces that it is done reading.
//! - Allgather: each rank writes its block into its own area and announces it; each then copies the other
//!   ranks' blocks straight out of their areas, and announces that it is done reading.
//!
//! A rank writes its area for the next staged op only once every rank is done reading it ([`open`]).

use crate::ring::args::expect_len;
use crate::ring::chunks::Blocks;
use crate::ring::reduce::{reduce_into, scale_in_place};
use crate::ring::staged::{open, REDUCE_PIECE_BYTES};
use crate::tensor::{copy_streaming, STREAMING_MIN_BYTES};
use crate::transport::{Transport, TransportError};
use crate::types::{Combine, DataType};

/// Reduce-scatter through the staging areas: `pack(area)` writes this rank's whole contribution (the blocks
/// of every rank in rank order, `blocks.total()` bytes, already prescaled) into the slice it is given, and
/// `deliver(offset, piece)` receives this rank's block of the combination, scaled by `postscale`, piece by
/// piece in order (`offset` within the block; the piece is still in cache). Every rank combines its block
/// in rank order, so the result does not depend on timing. The caller checked that `blocks.total()` bytes
/// fit an area ([`super::staged::fits`]).
pub fn reducescatter(
    t: &mut dyn Transport,
    pack: &mut dyn FnMut(&mut [u8]),
    blocks: &Blocks,
    dtype: DataType,
    combine: Combine,
    postscale: f64,
    deliver: &mut dyn FnMut(usize, &[u8]),
) -> Result<(), TransportError> {
    const OP: &str = "reducescatter";
    let me = t.rank();
    let total = blocks.total();
    let (staging, areas) = open(t, total, OP)?;
    // SAFETY: this rank's area holds at least `total` bytes (checked by `open`), and nobody reads it until
    // this rank announces its contribution below.
    pack(unsafe { std::slice::from_raw_parts_mut(areas[me], total) });
    let packed = staging.arrive();
    staging.wait_for(packed)?;
    let block = blocks.range(me);
    let step = REDUCE_PIECE_BYTES - REDUCE_PIECE_BYTES % dtype.size();
    let mut scratch = vec![0u8; step.min(block.len())];
    let mut start = block.start;
    while start < block.end {
        let end = block.end.min(start + step);
        let dst = &mut scratch[..end - start];
        for (r, &area) in areas.iter().enumerate() {
            // SAFETY: every rank announced its packed contribution, and none writes its area again until
            // this rank announces below that it is done reading.
            let src = unsafe { std::slice::from_raw_parts(area.add(start) as *const u8, end - start) };
            if r == 0 {
                dst.copy_from_slice(src);
            } else {
                reduce_into(dst, src, dtype, combine);
            }
        }
        scale_in_place(dst, dtype, postscale);
        deliver(start - block.start, dst);
        start = end;
    }
    staging.arrive();
    Ok(())
}

/// Allgather through the staging areas: rank `r`'s `blocks.len(r)` bytes (this rank's are `send`) land at
/// `blocks.range(r)` of `recv`. The caller checked that the largest block fits an area
/// ([`super::staged::fits`]).
pub fn allgather(t: &mut dyn Transport, send: &[u8], recv: &mut [u8], blocks: &Blocks) -> Result<(), TransportError> {
    const OP: &str = "allgatherv";
    let (me, n) = (t.rank(), t.size());
    expect_len(me, OP, "send length in bytes", send.len(), blocks.len(me))?;
    expect_len(me, OP, "receive length in bytes", recv.len(), blocks.total())?;
    let largest = (0..n).map(|r| blocks.len(r)).max().unwrap_or(0);
    let (staging, areas) = open(t, largest, OP)?;
    // Large blocks and results nobody reads before the op completes are written with streaming stores.
    let copy_for = |len: usize| -> fn(&mut [u8], &[u8]) {
        if len >= STREAMING_MIN_BYTES {
            copy_streaming
        } else {
            |dst, src| dst.copy_from_slice(src)
        }
    };
    // SAFETY: as in `reducescatter`: this rank's area holds `largest` bytes, unread until announced.
    copy_for(send.len())(unsafe { std::slice::from_raw_parts_mut(areas[me], send.len()) }, send);
    let written = staging.arrive();
    let copy = copy_for(recv.len());
    copy(&mut recv[blocks.range(me)], send);
    staging.wait_for(written)?;
    for (r, &area) in areas.iter().enumerate().filter(|&(r, _)| r != me) {
        let range = blocks.range(r);
        // SAFETY: rank `r` announced its block, and writes its area again only after this rank is done.
        copy(&mut recv[range.clone()], unsafe { std::slice::from_raw_parts(area as *const u8, range.len()) });
    }
    staging.arrive();
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ring::staged::fits;
    use crate::ring::staged::tests::{f64_bytes, mesh};
    use crate::transport::memory::run_ranks;

    #[test]
    fn reducescatter_leaves_each_rank_its_scaled_block_of_the_sum_over_repeated_ops() {
        for n in [2, 3, 4] {
            // Even blocks, and uneven ones (rank 0's the shortest).
            for counts in [vec![3usize; n], (0..n).map(|r| 10_000 * r + 7).collect::<Vec<_>>()] {
                let blocks = Blocks::from_lengths(&counts, 8).unwrap();
                let total: usize = counts.iter().sum();
                let results = run_ranks(mesh(n, 1 << 20), |t| {
                    (0..3)
                        .map(|op| {
                            let mine = f64_bytes((0..total).map(|i| (i * (t.rank() + 1) + op) as f64));
                            assert!(fits(t, mine.len()));
                            let mut out = Vec::new();
                            let mut pack = |area: &mut [u8]| {
                                area.copy_from_slice(&mine);
                                scale_in_place(area, DataType::Float64, 2.0);
                            };
                            let mut deliver = |offset: usize, piece: &[u8]| {
                                assert_eq!(offset, out.len(), "pieces come in order");
                                out.extend_from_slice(piece);
                            };
                            reducescatter(t, &mut pack, &blocks, DataType::Float64, Combine::Sum, 0.25, &mut deliver)
                                .unwrap();
                            out
                        })
                        .collect::<Vec<_>>()
                });
                let rank_sum: usize = (1..=n).sum();
                for (rank, per_op) in results.iter().enumerate() {
                    for (op, out) in per_op.iter().enumerate() {
                        let range = blocks.range(rank);
                        let want = f64_bytes(
                            (range.start / 8..range.end / 8).map(|i| (i * rank_sum + n * op) as f64 * 2.0 * 0.25),
                        );
                        assert_eq!(out, &want, "n={n} counts={counts:?} rank={rank} op={op}");
                    }
                }
            }
        }
    }

    #[test]
    fn allgather_joins_blocks_of_different_lengths_in_rank_order() {
        for n in [2, 3, 4] {
            let lengths: Vec<usize> = (0..n).map(|r| if r == 1 { 0 } else { 40_000 + r * 8 }).collect();
            let blocks = Blocks::from_lengths(&lengths, 1).unwrap();
            let results = run_ranks(mesh(n, 1 << 16), |t| {
                (0..3u8)
                    .map(|op| {
                        let me = t.rank();
                        let send: Vec<u8> = (0..lengths[me]).map(|i| (i % 251) as u8 ^ (me as u8 * 17 + op)).collect();
                        let mut recv = vec![0u8; blocks.total()];
                        allgather(t, &send, &mut recv, &blocks).unwrap();
                        recv
                    })
                    .collect::<Vec<_>>()
            });
            for op in 0..3u8 {
                let want: Vec<u8> =
                    (0..n).flat_map(|r| (0..lengths[r]).map(move |i| (i % 251) as u8 ^ (r as u8 * 17 + op))).collect();
                assert!(results.iter().all(|per_op| per_op[op as usize] == want), "n={n} op={op}");
            }
        }
    }

    #[test]
    fn a_rank_that_closes_fails_the_others() {
        let blocks = Blocks::from_lengths(&[4, 4, 4], 4).unwrap();
        let results = run_ranks(mesh(3, 4096), |t| {
            if t.rank() == 2 {
                t.close();
                return None;
            }
            Some(reducescatter(t, &mut |_| {}, &blocks, DataType::Int32, Combine::Sum, 1.0, &mut |_, _| {}))
        });
        for result in results.into_iter().flatten() {
            assert!(matches!(result, Err(TransportError::PeerClosed { peer: 2 })), "{result:?}");
        }
    }

    #[test]
    fn blocks_larger_than_the_areas_are_refused() {
        let blocks = Blocks::from_lengths(&[8192, 8192], 1).unwrap();
        let results = run_ranks(mesh(2, 4096), |t| {
            let mut recv = vec![0u8; 16384];
            allgather(t, &[0u8; 8192], &mut recv, &blocks).map_err(|e| e.to_string())
        });
        for result in results {
            let err = result.unwrap_err();
            assert!(err.contains("allgatherv") && err.contains("do not fit the staging areas"), "{err}");
        }
    }
}
