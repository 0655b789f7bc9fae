//! Allreduce through staging areas that every rank can read (the shared-memory transport's fusion
//! buffers): no bytes travel through channels at all. The engine uses it for fused tensors and packed
//! groups, which must be packed somewhere anyway.
//!
//! 1. Each rank packs its contribution straight into its own area and announces it.
//! 2. Each rank reduces its block of the elements straight out of every rank's area into its own area,
//!    in pieces small enough to stay in cache across the sources, scales it, and announces it. Every block
//!    is reduced once, by its owner, so all ranks read the same bits.
//! 3. Each rank unpacks the finished blocks straight out of their owners' areas and announces that it is
//!    done reading.
//!
//! Per rank that is one pass to pack, one over all sources of one block, and one to unpack: against
//! packing into a private buffer and running the ring over channels it saves the copies into and out of
//! the channels, and it takes three waits instead of `2(n-1)` hand-offs. Before packing, a rank waits
//! until every rank has finished reading the areas of the previous staged allreduce.

use crate::ring::args::invalid_argument;
use crate::ring::chunks::Blocks;
use crate::ring::reduce::{reduce_into, scale_in_place};
use crate::transport::{Staging, Transport, TransportError};
use crate::types::{Combine, DataType};

/// Bytes of a block reduced against all sources before moving on: the destination piece stays in cache.
const REDUCE_PIECE_BYTES: usize = 64 * 1024;

/// Whether `t` can run a [`StagedAllreduce`] of `len` bytes.
pub fn fits(t: &mut dyn Transport, len: usize) -> bool {
    t.size() > 1 && t.staging().is_some_and(|s| s.area_len() >= len)
}

/// One staged allreduce in progress, driven by its caller phase by phase: [`StagedAllreduce::begin`],
/// write the contribution into [`StagedAllreduce::own_area`], [`StagedAllreduce::reduce`], read the
/// [`StagedAllreduce::result`] pieces. Dropping it tells the other ranks this rank is done reading.
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
        let Some(staging) = t.staging().filter(|s| s.area_len() >= len) else {
            return Err(invalid_argument(me, "allreduce", format!("{len} bytes do not fit the staging areas")));
        };
        let areas = (0..n).map(|r| staging.area(r)).collect();
        let previous = staging.completed();
        staging.wait_for(previous)?;
        let blocks = Blocks::even(len / dtype.size(), n, dtype.size());
        Ok(StagedAllreduce { staging, areas, blocks, me, len, dtype, reduced: false })
    }

    /// The `len` bytes of this rank's area, for its contribution (before [`Self::reduce`]).
    pub fn own_area(&mut self) -> &mut [u8] {
        assert!(!self.reduced, "the contribution is written before the reduction");
        // SAFETY: this rank's area holds at least `len` bytes (checked in `begin`), and until this rank
        // announces its contribution nobody else reads it; `&mut self` keeps this the only view.
        unsafe { std::slice::from_raw_parts_mut(self.areas[self.me], self.len) }
    }

    /// Announce the contribution, wait for everyone's, and reduce (then scale by `postscale`) this rank's
    /// block straight out of all the areas; then wait until every block is done.
    pub fn reduce(&mut self, combine: Combine, postscale: f64) -> Result<(), TransportError> {
        let packed = self.staging.arrive();
        self.staging.wait_for(packed)?;
        let (me, dtype) = (self.me, self.dtype);
        let block = self.blocks.range(me);
        let step = REDUCE_PIECE_BYTES - REDUCE_PIECE_BYTES % dtype.size();
        let mut start = block.start;
        while start < block.end {
            let end = block.end.min(start + step);
            // SAFETY: `start..end` lies in this rank's block of its own area, which only this rank writes in
            // this step; the other areas are not written until everyone announces the next step, and they
            // are distinct mappings, so the slices do not overlap.
            let dst = unsafe { std::slice::from_raw_parts_mut(self.areas[me].add(start), end - start) };
            for &area in self.areas.iter().enumerate().filter(|&(r, _)| r != me).map(|(_, a)| a) {
                let src = unsafe { std::slice::from_raw_parts(area.add(start), end - start) };
                reduce_into(dst, src, dtype, combine);
            }
            scale_in_place(dst, dtype, postscale);
            start = end;
        }
        self.reduced = true;
        let done = self.staging.arrive();
        self.staging.wait_for(done)
    }

    /// The reduced bytes as (offset, bytes) pieces in order of offset, covering `0..len` once, read straight
    /// out of their owners' areas (after [`Self::reduce`]).
    pub fn result(&self) -> Vec<(usize, &[u8])> {
        assert!(self.reduced, "the result is read after the reduction");
        let piece = |(owner, &area): (usize, &*mut u8)| {
            let block = self.blocks.range(owner);
            // SAFETY: every owner finished its block (`reduce` waited for that) and writes its area again
            // only after this rank is dropped and announces it is done reading.
            (block.start, unsafe { std::slice::from_raw_parts(area.add(block.start) as *const u8, block.len()) })
        };
        self.areas.iter().enumerate().map(piece).collect()
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
mod tests {
    use super::*;
    use crate::transport::memory::{run_ranks, MemoryTransport};
    use crate::transport::shm::ShmTransport;
    use std::time::Duration;

    fn mesh(n: usize, staging: usize) -> Vec<ShmTransport> {
        ShmTransport::local_mesh(n, staging, &std::env::temp_dir(), Duration::from_secs(20)).unwrap()
    }

    fn f64_bytes(values: impl IntoIterator<Item = f64>) -> Vec<u8> {
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
                    staged.own_area().copy_from_slice(&mine);
                    staged.reduce(combine, postscale).unwrap();
                    let mut out = Vec::new();
                    for (offset, bytes) in staged.result() {
                        assert_eq!(offset, out.len(), "pieces come in order and cover everything once");
                        out.extend_from_slice(bytes);
                    }
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
            Some(staged.and_then(|mut s| s.reduce(Combine::Sum, 1.0)))
        });
        for result in results.into_iter().flatten() {
            assert!(matches!(result, Err(TransportError::PeerClosed { peer: 2 })), "{result:?}");
        }
    }
}
