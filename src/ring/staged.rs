//! Allreduce through staging areas that every rank can read (the shared-memory transport's fusion
//! buffers): no bytes travel through channels at all (reduce-scatter and allgather likewise:
//! [`staged_blocks`](super::staged_blocks)). The engine uses it for fused tensors and packed
//! groups, which must be packed somewhere anyway.
//!
//! 1. Each rank packs its contribution to the other ranks' blocks straight into its own area and
//!    announces it.
//! 2. Each rank reduces its own block piece by piece: it writes its own contribution for the piece into
//!    its area, combines every other rank's piece straight out of their areas into it, scales it, and hands
//!    it over while it is still in cache (the caller unpacks it then). The pieces are small enough to stay
//!    in cache across the sources. Every block is reduced once, by its owner, so all ranks read the same
//!    bits. Then it announces the block.
//! 3. Each rank unpacks the other blocks straight out of their owners' areas and announces that it is
//!    done reading.
//!
//! Per rank that is one pass to pack the others' blocks, one over all sources of its own block, and one to
//! unpack the others' results: against packing into a private buffer and running the ring over channels it
//! saves the copies into and out of the channels, and it takes three waits instead of `2(n-1)` hand-offs.
//! Before packing, a rank waits until every rank has finished reading the areas of the previous staged
//! allreduce.

use std::ops::Range;

use crate::ring::args::invalid_argument;
use crate::ring::chunks::Blocks;
use crate::ring::reduce::{reduce_into, scale_in_place};
use crate::transport::{Staging, Transport, TransportError};
use crate::types::{Combine, DataType};

/// Bytes of a block reduced against all sources before moving on: the destination piece stays in cache.
pub(crate) const REDUCE_PIECE_BYTES: usize = 64 * 1024;

/// Whether `t` can run a [`StagedAllreduce`] of `len` bytes.
pub fn fits(t: &mut dyn Transport, len: usize) -> bool {
    t.size() > 1 && t.staging().is_some_and(|s| s.area_len() >= len)
}

/// This rank's staging areas and the start of every rank's area, for a staged `op` writing up to `len` bytes
/// into each: waits until every rank has finished reading the areas for the previous staged op (each one's
/// last step says so). Fails, naming `op`, where `len` bytes do not fit an area.
pub(crate) fn open<'t>(
    t: &'t mut dyn Transport,
    len: usize,
    op: &str,
) -> Result<(&'t mut dyn Staging, Vec<*mut u8>), TransportError> {
    let (me, n) = (t.rank(), t.size());
    let Some(staging) = t.staging().filter(|s| s.area_len() >= len) else {
        return Err(invalid_argument(me, op, format!("{len} bytes do not fit the staging areas")));
    };
    let areas = (0..n).map(|r| staging.area(r)).collect();
    let previous = staging.completed();
    staging.wait_for(previous)?;
    Ok((staging, areas))
}

/// What [`StagedAllreduce::reduce`] asks of its caller for each piece of this rank's block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OwnPiece {
    /// Write this rank's contribution for the piece (prescaled) into the slice.
    Contribute,
    /// The slice holds the piece's final result.
    Result,
}

/// One staged allreduce in progress, driven by its caller phase by phase: [`StagedAllreduce::begin`],
/// write the contribution outside [`StagedAllreduce::own_block`] into [`StagedAllreduce::own_area`],
/// [`StagedAllreduce::reduce`] (which asks for the own block's contribution and hands its result over piece
/// by piece), read the other blocks' [`StagedAllreduce::others_results`]. Dropping it tells the other ranks
/// this rank is done reading.
pub struct StagedAllreduce<'t> {
    staging: &'t mut dyn Staging,
    areas: Vec<*mut u8>,
    blocks: Blocks,
    me: usize,
    len: usize,
    dtype: DataType,
    reduced: bool,
}

impl<'t> StagedAllreduce<'t> {
    /// Start an allreduce of `len` bytes of `dtype` (the caller checked [`fits`]): waits until every rank
    /// has finished reading the areas for the previous one.
    pub fn begin(t: &'t mut dyn Transport, len: usize, dtype: DataType) -> Result<StagedAllreduce<'t>, TransportError> {
        let (me, n) = (t.rank(), t.size());
        if len % dtype.size() != 0 {
            let detail = format!("{len} bytes is not a whole number of {dtype} elements");
            return Err(invalid_argument(me, "allreduce", detail));
        }
        let (staging, areas) = open(t, len, "allreduce")?;
        let blocks = Blocks::even(len / dtype.size(), n, dtype.size());
        Ok(StagedAllreduce { staging, areas, blocks, me, len, dtype, reduced: false })
    }

    /// The bytes of the block this rank reduces: [`Self::reduce`] asks for the contribution to it.
    pub fn own_block(&self) -> Range<usize> {
        self.blocks.range(self.me)
    }

    /// The `len` bytes of this rank's area, for its contribution outside [`Self::own_block`] (before
    /// [`Self::reduce`]).
    pub fn own_area(&mut self) -> &mut [u8] {
        debug_assert!(!self.reduced, "the contribution is written before the reduction");
        // SAFETY: this rank's area holds at least `len` bytes (checked in `begin`), and until this rank
        // announces its contribution nobody else reads it; `&mut self` keeps this the only view.
        unsafe { std::slice::from_raw_parts_mut(self.areas[self.me], self.len) }
    }

    /// Announce the contribution, wait for everyone's, and reduce this rank's block straight out of all
    /// the areas: for each piece, `own(OwnPiece::Contribute, offset, piece)` writes this rank's contribution
    /// into it, the other ranks' pieces are combined in, the piece is scaled by `postscale`, and
    /// `own(OwnPiece::Result, offset, piece)` reads the result. Then waits until every block is done.
    pub fn reduce(
        &mut self,
        combine: Combine,
        postscale: f64,
        own: &mut dyn FnMut(OwnPiece, usize, &mut [u8]),
    ) -> Result<(), TransportError> {
        let packed = self.staging.arrive();
        self.staging.wait_for(packed)?;
        let (me, dtype) = (self.me, self.dtype);
        let block = self.blocks.range(me);
        let step = REDUCE_PIECE_BYTES - REDUCE_PIECE_BYTES % dtype.size();
        let mut start = block.start;
        while start < block.end {
            let end = block.end.min(start + step);
            // SAFETY: `start..end` lies in this rank's block of its own area, which only this rank touches in
            // this step; the other areas are not written until everyone announces the next step, and they
            // are distinct mappings, so the slices do not overlap.
            let dst = unsafe { std::slice::from_raw_parts_mut(self.areas[me].add(start), end - start) };
            own(OwnPiece::Contribute, start, dst);
            for &area in self.areas.iter().enumerate().filter(|&(r, _)| r != me).map(|(_, a)| a) {
                let src = unsafe { std::slice::from_raw_parts(area.add(start), end - start) };
                reduce_into(dst, src, dtype, combine);
            }
            scale_in_place(dst, dtype, postscale);
            own(OwnPiece::Result, start, dst);
            start = end;
        }
        self.reduced = true;
        let done = self.staging.arrive();
        self.staging.wait_for(done)
    }

    /// The other blocks' results as (offset, bytes), in order of offset, read straight out of their owners'
    /// areas (after [`Self::reduce`], which handed over this rank's own block).
    pub fn others_results(&self) -> Vec<(usize, &[u8])> {
        debug_assert!(self.reduced, "the result is read after the reduction");
        let piece = |(owner, &area): (usize, &*mut u8)| {
            let block = self.blocks.range(owner);
            // SAFETY: every owner finished its block (`reduce` waited for that) and writes its area again
            // only after this rank is dropped and announces it is done reading.
            (block.start, unsafe { std::slice::from_raw_parts(area.add(block.start) as *const u8, block.len()) })
        };
        self.areas.iter().enumerate().filter(|&(owner, _)| owner != self.me).map(piece).collect()
    }
}

impl Drop for StagedAllreduce<'_> {
    fn drop(&mut self) {
        // Done reading (or never got as far as reading): the others may write their areas again. A rank
        // that failed before announcing its contribution stays behind, and the others time out or see it
        // close, as with any failed collective.
        if self.reduced {
            self.staging.arrive();
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::transport::memory::{run_ranks, MemoryTransport};
    use crate::transport::shm::ShmTransport;
    use std::time::Duration;

    /// `n` ranks of one shared-memory segment with staging areas of `staging` bytes.
    pub(crate) fn mesh(n: usize, staging: usize) -> Vec<ShmTransport> {
        ShmTransport::local_mesh(n, staging, &std::env::temp_dir(), Duration::from_secs(20)).unwrap()
    }

    pub(crate) fn f64_bytes(values: impl IntoIterator<Item = f64>) -> Vec<u8> {
        values.into_iter().flat_map(f64::to_ne_bytes).collect()
    }

    /// Runs `ops` staged allreduces of `count` f64 per rank and returns each rank's results per op.
    fn run(n: usize, count: usize, ops: usize, combine: Combine, postscale: f64) -> Vec<Vec<Vec<u8>>> {
        run_ranks(mesh(n, 1 << 16), move |t| {
            (0..ops)
                .map(|op| {
                    let mine = f64_bytes((0..count).map(|i| (i * (t.rank() + 1) + op) as f64));
                    assert!(fits(t, mine.len()));
                    let mut staged = StagedAllreduce::begin(t, mine.len(), DataType::Float64).unwrap();
                    let own = staged.own_block();
                    let area = staged.own_area();
                    area[..own.start].copy_from_slice(&mine[..own.start]);
                    area[own.end..].copy_from_slice(&mine[own.end..]);
                    let mut out = vec![0u8; mine.len()];
                    let mut covered = vec![false; mine.len()];
                    let mut record = |offset: usize, bytes: &[u8]| {
                        out[offset..offset + bytes.len()].copy_from_slice(bytes);
                        covered[offset..offset + bytes.len()].iter_mut().for_each(|c| {
                            assert!(!*c, "every byte of the result comes once");
                            *c = true;
                        });
                    };
                    staged
                        .reduce(combine, postscale, &mut |phase, offset, piece| match phase {
                            OwnPiece::Contribute => piece.copy_from_slice(&mine[offset..offset + piece.len()]),
                            OwnPiece::Result => record(offset, piece),
                        })
                        .unwrap();
                    for (offset, bytes) in staged.others_results() {
                        record(offset, bytes);
                    }
                    assert!(covered.iter().all(|&c| c));
                    assert_eq!(out.len(), mine.len());
                    out
                })
                .collect()
        })
    }

    #[test]
    fn sums_and_scales_on_every_rank_over_repeated_ops() {
        for n in [2, 3, 4] {
            for count in [1, 7, 1000, 8192] {
                let results = run(n, count, 3, Combine::Sum, 0.5);
                for op in 0..3 {
                    let rank_sum: usize = (1..=n).sum();
                    let want = f64_bytes((0..count).map(|i| (i * rank_sum + n * op) as f64 * 0.5));
                    for (rank, per_op) in results.iter().enumerate() {
                        assert_eq!(per_op[op], want, "n={n} count={count} op={op} rank={rank}");
                    }
                }
            }
        }
    }

    #[test]
    fn max_picks_the_largest_contribution() {
        let results = run(3, 100, 1, Combine::Max, 1.0);
        let want = f64_bytes((0..100).map(|i| (i * 3) as f64));
        assert!(results.iter().all(|r| r[0] == want));
    }

    #[test]
    fn too_large_or_ragged_buffers_are_refused() {
        let results = run_ranks(mesh(2, 4096), |t| {
            let fits_large = fits(t, 8192);
            let too_large = StagedAllreduce::begin(t, 8192, DataType::Int32).is_err();
            let ragged = StagedAllreduce::begin(t, 6, DataType::Int32).is_err();
            (fits_large, too_large, ragged)
        });
        assert!(results.iter().all(|&r| r == (false, true, true)));
        let memory = run_ranks(MemoryTransport::mesh(2), |t| fits(t, 1));
        assert_eq!(memory, vec![false, false], "transports without shared memory have no staging areas");
    }

    #[test]
    fn a_rank_that_closes_fails_the_others() {
        let results = run_ranks(mesh(3, 4096), |t| {
            if t.rank() == 2 {
                t.close();
                return None;
            }
            let staged = StagedAllreduce::begin(t, 64, DataType::Int32);
            Some(staged.and_then(|mut s| s.reduce(Combine::Sum, 1.0, &mut |_, _, _| {})))
        });
        for result in results.into_iter().flatten() {
            assert!(matches!(result, Err(TransportError::PeerClosed { peer: 2 })), "{result:?}");
        }
    }
}
