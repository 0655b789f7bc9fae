//! Which algorithm a flat allreduce, allgather or broadcast runs, by message size and number of ranks, as
//! MPI libraries and NCCL choose: the latency-bound algorithms (`log2(n)` steps) for small messages, the
//! bandwidth-bound ones (ring, pipelined chain) where each step's bytes make latency negligible.
//!
//! Every choice is a pure function of the size in bytes, the number of ranks, whether the transport's
//! hand-offs are cheap (the same on every rank of a communicator) and the configured override
//! (`RVOD_ALLREDUCE_ALGORITHM`, `RVOD_ALLGATHER_ALGORITHM`, `RVOD_BROADCAST_ALGORITHM`, parsed in
//! `crate::config`), so every rank of a collective picks the same algorithm without talking.
//!
//! The constants come from timing each algorithm over the in-memory transport (ranks as threads on a shared
//! 2-core VM, release build, float32 sums; the median of 5 rounds; `measure_algorithms` in
//! `tests/ring_algorithms.rs`, numbers in `docs/performance.md`): see each constant for what was measured.
//! That transport has no wire latency and its ranks share two cores, so it shows what each algorithm
//! costs in copies and reductions but understates what its number of steps costs over shared memory
//! (a few microseconds each) or TCP (~22 us); where the two disagree the constants lean towards fewer
//! steps.

pub use crate::types::{AlgorithmOverrides, AllgatherAlgorithm, AllreduceAlgorithm, BroadcastAlgorithm, Named};

/// Allreduces of at most this many bytes on up to [`RING_ONLY_MAX_RANKS`] ranks use recursive doubling: a
/// handful of whole-buffer exchanges beat twice as many steps of pieces. Per link recursive doubling sends
/// `log2(n) * S` bytes in `log2(n)` steps, the ring `2(n-1)/n * S` in `2(n-1)` steps; with TCP's ~22 us per
/// step and ~1.5 GB/s links they cost the same near 100 KiB for n = 2..8. Measured (n = 2 and 4) recursive
/// doubling is 1.5-3x faster at 64 KiB and the ring 2x faster from 128-256 KiB.
pub const RECURSIVE_DOUBLING_MAX_BYTES: usize = 64 * 1024;

/// [`RECURSIVE_DOUBLING_MAX_BYTES`] on more than [`RING_ONLY_MAX_RANKS`] ranks, where Rabenseifner's is the
/// alternative: recursive doubling sends `log2(n)` whole buffers, Rabenseifner's two in `2 log2(n)` steps.
/// Measured, recursive doubling against Rabenseifner's (us): n = 5: 64 / 86 at 32 KiB, 112 / 102 at 64 KiB;
/// n = 8: 78 / 90 at 16 KiB, 115 / 112 at 32 KiB, 185 / 157 at 64 KiB; n = 12: 193 / 193 at 32 KiB;
/// n = 16: 245 / 292 at 16 KiB, 425 / 334 at 32 KiB, 908 / 476 at 64 KiB.
pub const RECURSIVE_DOUBLING_MAX_BYTES_MANY_RANKS: usize = 32 * 1024;

/// Two ranks over a transport with cheap hand-offs use the pipelined two-rank exchange from this size on:
/// each rank moves and reduces half the buffer, reducing straight out of the channel, where recursive
/// doubling exchanges and reduces all of it through a scratch copy (2 ranks over shared memory, this VM,
/// 64 KiB in place: 17.6 -> 12.3 us in cache, 26.8 -> 19.9 us from DRAM; no change at 16 KiB, where the
/// second hand-off costs what the halving saves).
pub const PIPELINE_THRESHOLD_BYTES: usize = 8 << 10;

/// Above [`RECURSIVE_DOUBLING_MAX_BYTES_MANY_RANKS`], allreduces on more than [`RING_ONLY_MAX_RANKS`] ranks
/// use Rabenseifner's algorithm until each rank's ring block (`bytes / n`) reaches this size, the ring from
/// there: Rabenseifner moves the ring's bytes in `2 log2(n)` steps instead of `2(n - 1)`, which matters
/// while a step's latency is a good part of its cost; the ring streams small blocks through the cache,
/// which matters more for large buffers. Measured, Rabenseifner's against the ring (us): n = 5: 279 / 334
/// at 256 KiB, 757 / 642 at 512 KiB; n = 6: 2811 / 3300 at 1 MiB; n = 8: 407 / 410 at 256 KiB, 11186 /
/// 9989 at 1 MiB; n = 12: 376 / 616 at 128 KiB, 1634 / 1545 at 256 KiB; n = 16: 476 / 651 at 64 KiB, 1227 /
/// 1087 at 128 KiB, 13037 / 7726 at 1 MiB: the crossing lies at blocks of 20-100 KiB with no wire
/// latency, and later with it (16 ranks over TCP: 30 ring steps cost ~660 us more than 8).
pub const RING_MIN_BLOCK_BYTES: usize = 64 * 1024;

/// [`RING_MIN_BLOCK_BYTES`] on more than [`RING_MEASURED_MAX_RANKS`] ranks where `n` is a power of two. A ring
/// step moves one block and pays one message latency, so the share of the bandwidth it loses is the
/// latency's share of a block's transfer: over RDMA (~3 us a message, 12.5 GB/s a link) 12.5% at 256 KiB
/// blocks, 6.7% at 512 KiB, while Rabenseifner's moves the same bytes in `2 log2(n)` steps and loses under
/// 1%; at 1,024 ranks a 256 MiB allreduce is 0.87x of the bandwidth bound by the ring and 0.99x by
/// Rabenseifner's (`benches/scale_model.py`, docs/scale.md). Where `n` is not a power of two, Rabenseifner's
/// first folds the extra ranks' whole buffers onto partners, which costs more than the ring's latency, so
/// those keep [`RING_MIN_BLOCK_BYTES`] (the hierarchical allreduce is their answer at that scale).
pub const RING_MIN_BLOCK_BYTES_MANY_RANKS: usize = 512 * 1024;

/// Up to this many ranks the ring starts at [`RING_MIN_BLOCK_BYTES`], which was measured there (beyond, the
/// wire's latency decides, see [`RING_MIN_BLOCK_BYTES_MANY_RANKS`]).
pub const RING_MEASURED_MAX_RANKS: usize = 16;

/// Up to this many ranks medium and large allreduces keep the ring as before: Rabenseifner's saves at most
/// 2 steps there (none on 2 ranks; on 3 it adds a whole-buffer fold), and measured at n = 4 it is within
/// the noise of the ring from 128 KiB to 4 MiB.
pub const RING_ONLY_MAX_RANKS: usize = 4;

/// Allgathers whose result is at most this many bytes per rank on 4 or more ranks use Bruck's algorithm
/// (`ceil(log2 n)` steps against the ring's `n - 1`, so the limit grows with `n`); 2 and 3 ranks take as
/// many steps either way, and the ring copies less. Measured, Bruck's against the ring (us, total result): n = 4: 28 / 34 at 16 KiB, 56 / 46 at
/// 64 KiB; n = 8: 68 / 80 at 16 KiB, 124 / 116 at 64 KiB; n = 16: 233 / 243 at 16 KiB, 329 / 306 at 64 KiB,
/// 1692 / 1105 at 256 KiB.
pub const BRUCK_MAX_BYTES_PER_RANK: usize = 4 * 1024;

/// Broadcasts of at most this many bytes go down the tree on any number of ranks (unchanged from before the
/// choice depended on `n`). At this size the chain, with two chunks, is no slower than the tree for n = 3
/// and 4 (and identical at n = 2).
pub const BROADCAST_CHAIN_THRESHOLD_BYTES: usize = 1024 * 1024;

/// Chunk forwarded at once along the broadcast chain: large enough that the per-step latency (~22 us over
/// TCP) is small against its transfer time, small enough that the pipeline fills quickly.
pub const BROADCAST_CHUNK_BYTES: usize = 512 * 1024;

/// The allreduce of `bytes` on `n` ranks: `forced` if configured, else recursive doubling for small
/// buffers ([`RECURSIVE_DOUBLING_MAX_BYTES`], or [`RECURSIVE_DOUBLING_MAX_BYTES_MANY_RANKS`] on more than
/// [`RING_ONLY_MAX_RANKS`] ranks), Rabenseifner's for medium ones on more than [`RING_ONLY_MAX_RANKS`]
/// ranks, the ring for large ones (from blocks of [`RING_MIN_BLOCK_BYTES`], or of
/// [`RING_MIN_BLOCK_BYTES_MANY_RANKS`] on more than [`RING_MEASURED_MAX_RANKS`] ranks, a power of two). Two ranks with
/// `cheap_handoffs` take the (pipelined) ring from [`PIPELINE_THRESHOLD_BYTES`].
pub fn choose_allreduce(
    bytes: usize,
    n: usize,
    cheap_handoffs: bool,
    forced: Option<AllreduceAlgorithm>,
) -> AllreduceAlgorithm {
    if let Some(forced) = forced {
        return forced;
    }
    if n == 2 && cheap_handoffs && bytes >= PIPELINE_THRESHOLD_BYTES {
        return AllreduceAlgorithm::Ring;
    }
    if n <= RING_ONLY_MAX_RANKS {
        return if bytes <= RECURSIVE_DOUBLING_MAX_BYTES {
            AllreduceAlgorithm::RecursiveDoubling
        } else {
            AllreduceAlgorithm::Ring
        };
    }
    if bytes <= RECURSIVE_DOUBLING_MAX_BYTES_MANY_RANKS {
        AllreduceAlgorithm::RecursiveDoubling
    } else if bytes / n >= ring_min_block_bytes(n) {
        AllreduceAlgorithm::Ring
    } else {
        AllreduceAlgorithm::Rabenseifner
    }
}

/// Each rank's block (`bytes / n`) from which an allreduce on `n` (more than [`RING_ONLY_MAX_RANKS`]) ranks
/// takes the ring instead of Rabenseifner's.
pub fn ring_min_block_bytes(n: usize) -> usize {
    if n > RING_MEASURED_MAX_RANKS && n.is_power_of_two() {
        RING_MIN_BLOCK_BYTES_MANY_RANKS
    } else {
        RING_MIN_BLOCK_BYTES
    }
}

/// The allgather of `total_bytes` (all ranks' blocks together) on `n` ranks: `forced` if configured, else
/// Bruck's algorithm on 4 or more ranks up to [`BRUCK_MAX_BYTES_PER_RANK`] times `n`, the ring above.
pub fn choose_allgather(total_bytes: usize, n: usize, forced: Option<AllgatherAlgorithm>) -> AllgatherAlgorithm {
    if let Some(forced) = forced {
        return forced;
    }
    if n >= 4 && total_bytes <= BRUCK_MAX_BYTES_PER_RANK.saturating_mul(n) {
        AllgatherAlgorithm::Bruck
    } else {
        AllgatherAlgorithm::Ring
    }
}

/// The broadcast of `bytes` on `n` ranks: `forced` if configured, else the tree up to
/// [`BROADCAST_CHAIN_THRESHOLD_BYTES`] and while it is faster, the chain above. The tree takes
/// `ceil(log2 n)` whole-buffer rounds, the chain `n - 2 + k` steps of one of its `k` chunks, so the chain
/// wins once `k (ceil(log2 n) - 1) > n - 2` where every rank has its own link: from 1 MiB up to n = 4,
/// 1.5 MiB at n = 8, 2.5 MiB at n = 16 and 57 MiB at n = 1,024. (Over the in-memory transport on 2 shared
/// cores, where the cores and not the links are the bottleneck, the chain was as fast or faster from
/// 512 KiB-1 MiB at n = 4, 8 and 16; that cannot show the tree's parallel links, so this follows the
/// model.)
pub fn choose_broadcast(bytes: usize, n: usize, forced: Option<BroadcastAlgorithm>) -> BroadcastAlgorithm {
    if let Some(forced) = forced {
        return forced;
    }
    if n <= 2 || bytes <= BROADCAST_CHAIN_THRESHOLD_BYTES {
        return BroadcastAlgorithm::Tree;
    }
    let chunks = bytes.div_ceil(BROADCAST_CHUNK_BYTES);
    let tree_rounds = n.next_power_of_two().ilog2() as usize;
    if chunks.saturating_mul(tree_rounds - 1) > n - 2 {
        BroadcastAlgorithm::Chain
    } else {
        BroadcastAlgorithm::Tree
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use AllreduceAlgorithm::{Rabenseifner, RecursiveDoubling, Ring};

    const KIB: usize = 1024;
    const MIB: usize = 1024 * 1024;

    #[test]
    fn small_allreduces_double_large_ones_ring_and_medium_ones_on_many_ranks_halve() {
        for n in [2, 3, 4, 5, 8, 16, 1024] {
            assert_eq!(choose_allreduce(0, n, false, None), RecursiveDoubling, "n={n}");
            assert_eq!(choose_allreduce(4, n, true, None), RecursiveDoubling, "n={n}");
            assert_eq!(choose_allreduce(32 * KIB, n, false, None), RecursiveDoubling, "n={n}");
            assert_eq!(choose_allreduce(1 << 30, n, false, None), Ring, "n={n}");
        }
        // Up to 4 ranks, as before: recursive doubling up to 64 KiB, the ring above.
        for n in 2..=4 {
            assert_eq!(choose_allreduce(64 * KIB, n, false, None), RecursiveDoubling, "n={n}");
            assert_eq!(choose_allreduce(64 * KIB + 1, n, false, None), Ring, "n={n}");
        }
        // More ranks: Rabenseifner above 32 KiB until each rank's block reaches RING_MIN_BLOCK_BYTES (or, on
        // more than 16 ranks a power of two, RING_MIN_BLOCK_BYTES_MANY_RANKS).
        for (n, block) in [(5, 64 * KIB), (8, 64 * KIB), (16, 64 * KIB), (33, 64 * KIB), (1000, 64 * KIB)]
            .into_iter()
            .chain([(32, 512 * KIB), (1024, 512 * KIB), (16384, 512 * KIB)])
        {
            assert_eq!(ring_min_block_bytes(n), block, "n={n}");
            assert_eq!(choose_allreduce(32 * KIB + 4, n, false, None), Rabenseifner, "n={n}");
            let ring_from = n * block;
            assert_eq!(choose_allreduce(ring_from - 4, n, false, None), Rabenseifner, "n={n}");
            assert_eq!(choose_allreduce(ring_from, n, false, None), Ring, "n={n}");
        }
        // Issue 32's large case: 256 MiB on 1,024 ranks is Rabenseifner's (256 KiB blocks), on 1,000 the ring.
        assert_eq!(choose_allreduce(256 * MIB, 1024, false, None), Rabenseifner);
        assert_eq!(choose_allreduce(256 * MIB, 1000, false, None), Ring);
    }

    #[test]
    fn two_ranks_with_cheap_hand_offs_pipeline_from_8_kib() {
        assert_eq!(choose_allreduce(PIPELINE_THRESHOLD_BYTES - 4, 2, true, None), RecursiveDoubling);
        assert_eq!(choose_allreduce(PIPELINE_THRESHOLD_BYTES, 2, true, None), Ring);
        assert_eq!(choose_allreduce(PIPELINE_THRESHOLD_BYTES, 2, false, None), RecursiveDoubling);
        assert_eq!(choose_allreduce(PIPELINE_THRESHOLD_BYTES, 3, true, None), RecursiveDoubling);
    }

    #[test]
    fn allgathers_use_bruck_for_small_results_on_four_or_more_ranks() {
        use AllgatherAlgorithm::{Bruck, Ring};
        assert_eq!(choose_allgather(100, 2, None), Ring, "two ranks: one step either way");
        assert_eq!(choose_allgather(100, 3, None), Ring, "three ranks: two steps either way");
        for n in [4, 5, 7, 16, 1024] {
            assert_eq!(choose_allgather(0, n, None), Bruck, "n={n}");
            assert_eq!(choose_allgather(n * 4 * KIB, n, None), Bruck, "n={n}");
            assert_eq!(choose_allgather(n * 4 * KIB + 1, n, None), Ring, "n={n}");
        }
        assert_eq!(choose_allgather(16 * KIB, 4, None), Bruck);
        assert_eq!(choose_allgather(64 * KIB, 16, None), Bruck);
        assert_eq!(choose_allgather(64 * KIB, 8, None), Ring);
    }

    #[test]
    fn broadcasts_take_the_chain_later_on_more_ranks() {
        use BroadcastAlgorithm::{Chain, Tree};
        for n in [2, 3, 4, 8, 16, 1024] {
            assert_eq!(choose_broadcast(MIB, n, None), Tree, "n={n}");
        }
        assert_eq!(choose_broadcast(4 * MIB, 2, None), Tree, "two ranks: one send either way");
        for n in [3, 4] {
            assert_eq!(choose_broadcast(MIB + 1, n, None), Chain, "n={n}");
        }
        assert_eq!(choose_broadcast(3 * MIB / 2, 8, None), Tree);
        assert_eq!(choose_broadcast(3 * MIB / 2 + 1, 8, None), Chain);
        assert_eq!(choose_broadcast(2 * MIB, 16, None), Tree);
        assert_eq!(choose_broadcast(3 * MIB, 16, None), Chain);
        assert_eq!(choose_broadcast(16 * MIB, 1024, None), Tree);
        assert_eq!(choose_broadcast(64 * MIB, 1024, None), Chain);
    }

    #[test]
    fn a_configured_algorithm_wins_at_every_size() {
        for (bytes, n) in [(0, 1), (4, 2), (100 * KIB, 8), (1 << 30, 33)] {
            for &a in AllreduceAlgorithm::ALL {
                assert_eq!(choose_allreduce(bytes, n, true, Some(a)), a);
            }
            for &a in AllgatherAlgorithm::ALL {
                assert_eq!(choose_allgather(bytes, n, Some(a)), a);
            }
            for &a in BroadcastAlgorithm::ALL {
                assert_eq!(choose_broadcast(bytes, n, Some(a)), a);
            }
        }
    }

    #[test]
    fn knob_values_parse_by_name_and_errors_list_the_accepted_ones() {
        assert_eq!(AllreduceAlgorithm::parse_choice("auto"), Ok(None));
        assert_eq!(AllreduceAlgorithm::parse_choice(" Recursive-Doubling "), Ok(Some(RecursiveDoubling)));
        assert_eq!(AllreduceAlgorithm::parse_choice("rabenseifner"), Ok(Some(Rabenseifner)));
        assert_eq!(AllgatherAlgorithm::parse_choice("BRUCK"), Ok(Some(AllgatherAlgorithm::Bruck)));
        assert_eq!(BroadcastAlgorithm::parse_choice("chain"), Ok(Some(BroadcastAlgorithm::Chain)));
        assert_eq!(
            AllreduceAlgorithm::parse_choice("tree"),
            Err("expected one of auto, recursive_doubling, rabenseifner, ring".to_string())
        );
        assert_eq!(BroadcastAlgorithm::parse_choice("ring"), Err("expected one of auto, tree, chain".to_string()));
        assert_eq!(AllreduceAlgorithm::Rabenseifner.to_string(), "rabenseifner");
    }
}
