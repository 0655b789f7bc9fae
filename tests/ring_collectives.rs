//! Every collective of `rvod::ring`, run with 1..=5 ranks as threads over the in-memory transport and over
//! the shared-memory transport, for
//! every dtype and combine, sizes that are multiples of nothing, uneven and empty per-rank blocks, and
//! failures (a peer that closes, a peer that never answers). Inputs are small integers, exact in every
//! dtype, so the reference result does not depend on the order in which the algorithm combines them.

use std::cell::Cell;
use std::sync::Barrier;
use std::time::{Duration, Instant};

use rvod::ring::*;
use rvod::transport::memory::{run_ranks, MemoryTransport, DEFAULT_TIMEOUT};
use rvod::transport::shm::ShmTransport;
use rvod::transport::{Transport, TransportError};
use rvod::types::*;

mod common;
use common::encode;

const COMBINES: [Combine; 4] = [Combine::Sum, Combine::Min, Combine::Max, Combine::Product];
const SIZES: [usize; 4] = [0, 1, 7, 4097];
/// Above the ring threshold even for one-byte types, so every dtype also takes the ring path.
const RING_SIZE: usize = 70_001;
const BIG_SIZE: usize = 1_000_003;

#[derive(Clone, Copy, Debug)]
enum Kind {
    Memory,
    SharedMemory,
}

thread_local! {
    static KIND: Cell<Kind> = const { Cell::new(Kind::Memory) };
}

/// Run `test` once over each transport (`on_ranks` builds meshes of the current kind).
fn over_every_transport(test: impl Fn()) {
    for kind in [Kind::Memory, Kind::SharedMemory] {
        KIND.with(|k| k.set(kind));
        test();
    }
}

fn mesh(n: usize, timeout: Duration) -> Vec<Box<dyn Transport>> {
    match KIND.with(Cell::get) {
        Kind::Memory => MemoryTransport::mesh_with_timeout(n, timeout).into_iter().map(|t| Box::new(t) as _).collect(),
        Kind::SharedMemory => ShmTransport::local_mesh(n, 1 << 20, &std::env::temp_dir(), timeout)
            .unwrap()
            .into_iter()
            .map(|t| Box::new(t) as _)
            .collect(),
    }
}

fn on_ranks<R: Send>(n: usize, body: impl Fn(&mut dyn Transport) -> R + Sync) -> Vec<R> {
    run_ranks(mesh(n, DEFAULT_TIMEOUT), |t| body(t.as_mut()))
}

/// Inputs and results repeat with this period in the element index, so buffers are built by tiling.
const PERIOD: usize = 25;

/// The value rank `rank` contributes at element `i`: a small integer (0/1 for bool, non-negative for uint8).
fn input_value(dtype: DataType, rank: usize, i: usize) -> i64 {
    let v = ((i * 7 + rank * 3 + i / 5) % 5) as i64;
    match dtype {
        DataType::Bool => i64::from(v % 2 == 1),
        DataType::Uint8 | DataType::Uint16 => v,
        _ => v - 2,
    }
}

/// Elements `elements` of the sequence whose element `i` is `element(i % PERIOD)`.
fn tiled(dtype: DataType, elements: std::ops::Range<usize>, element: impl Fn(usize) -> f64) -> Vec<u8> {
    let size = dtype.size();
    let period: Vec<u8> = (0..PERIOD).flat_map(|i| encode(dtype, element(i))).collect();
    let mut out = Vec::with_capacity(elements.len() * size);
    let mut next = elements.start;
    while next < elements.end {
        let phase = next % PERIOD;
        let take = (PERIOD - phase).min(elements.end - next);
        out.extend_from_slice(&period[phase * size..(phase + take) * size]);
        next += take;
    }
    out
}

fn input(dtype: DataType, rank: usize, count: usize) -> Vec<u8> {
    tiled(dtype, 0..count, |i| input_value(dtype, rank, i) as f64)
}

/// Element `i` of the combination over `n` ranks, computed the obvious way. Every intermediate is a small
/// integer, exact in f64; a float product of zero keeps its sign, as the kernels' does.
fn expected_value(dtype: DataType, combine: Combine, n: usize, i: usize) -> f64 {
    let values = (0..n).map(|rank| input_value(dtype, rank, i) as f64);
    let (min, max) = (values.clone().fold(f64::INFINITY, f64::min), values.clone().fold(f64::NEG_INFINITY, f64::max));
    match (combine, dtype) {
        (Combine::Sum, DataType::Bool) | (Combine::Max, _) => max,
        (Combine::Product, DataType::Bool) | (Combine::Min, _) => min,
        (Combine::Sum, _) => values.sum(),
        (Combine::Product, _) => values.product(),
    }
}

fn expected(dtype: DataType, combine: Combine, n: usize, elements: std::ops::Range<usize>) -> Vec<u8> {
    tiled(dtype, elements, |i| expected_value(dtype, combine, n, i))
}

fn check_allreduce(n: usize, dtype: DataType, combine: Combine, count: usize) {
    let results = on_ranks(n, |t| {
        let mut buf = input(dtype, t.rank(), count);
        allreduce(t, &mut buf, dtype, combine).unwrap();
        buf
    });
    let want = expected(dtype, combine, n, 0..count);
    for (rank, got) in results.iter().enumerate() {
        assert!(got == &want, "allreduce n={n} {dtype} {combine:?} count={count}: rank {rank} differs");
    }
}

#[test]
fn allreduce_every_dtype_and_combine() {
    over_every_transport(|| {
        for n in 1..=5 {
            for dtype in DataType::ALL {
                for combine in COMBINES {
                    for count in SIZES.into_iter().chain([RING_SIZE]) {
                        check_allreduce(n, dtype, combine, count);
                    }
                }
            }
        }
    });
}

#[test]
fn allreduce_large_buffers() {
    over_every_transport(|| {
        for n in 1..=5 {
            check_allreduce(n, DataType::Float32, Combine::Sum, BIG_SIZE);
        }
        for n in [2, 5] {
            check_allreduce(n, DataType::Bfloat16, Combine::Max, BIG_SIZE);
        }
    });
}

/// Out of place: `dst` gets exactly the in-place result (bit for bit, every dtype)
/// and `src` is left untouched, below the ring threshold (copied first), on the ring (its reduce-scatter
/// reads `src`) and above the two-rank pipeline's threshold (the two-rank shared-memory case reads `src`
/// and writes `dst` piece by piece), for odd element counts.
#[test]
fn allreduce_into_matches_in_place_and_leaves_the_source() {
    over_every_transport(|| {
        for n in 1..=4 {
            for (dtype, count) in [
                (DataType::Float32, 7),
                (DataType::Int8, 70_001),
                (DataType::Float32, 300_007),
                (DataType::Int16, 700_001),
            ] {
                for combine in COMBINES {
                    let results = on_ranks(n, |t| {
                        let src = input(dtype, t.rank(), count);
                        let mut dst = vec![0xa5u8; src.len()];
                        allreduce_into(t, &src, &mut dst, dtype, combine).unwrap();
                        (src == input(dtype, t.rank(), count), dst)
                    });
                    let want = expected(dtype, combine, n, 0..count);
                    for (rank, (src_kept, got)) in results.iter().enumerate() {
                        assert!(src_kept, "allreduce_into n={n} {dtype} {combine:?}: rank {rank}'s source changed");
                        assert!(
                            got == &want,
                            "allreduce_into n={n} {dtype} {combine:?} count={count}: rank {rank} differs"
                        );
                    }
                }
            }
        }
        for n in [2, 3] {
            let results = on_ranks(n, |t| {
                // No NaNs: which operand's NaN payload a sum keeps may differ from call to call (LLVM treats
                // fadd as commutative), in place as well; every rank still gets the same bits.
                let src = random_f32(t.rank(), 600_001, false);
                let mut in_place = src.clone();
                allreduce(t, &mut in_place, DataType::Float32, Combine::Sum).unwrap();
                let mut dst = vec![0u8; src.len()];
                allreduce_into(t, &src, &mut dst, DataType::Float32, Combine::Sum).unwrap();
                (in_place, dst)
            });
            for (rank, (in_place, out)) in results.iter().enumerate() {
                assert!(in_place == out, "n={n} rank {rank}: out-of-place bits differ from in-place");
                assert!(out == &results[0].1, "n={n} rank {rank}: out-of-place bits differ from rank 0");
            }
        }
        let errors = on_ranks(2, |t| allreduce_into(t, &[0; 8], &mut [0; 4], DataType::Float32, Combine::Sum));
        for error in errors {
            let message = error.unwrap_err().to_string();
            assert!(message.contains("the source has 8 bytes and the destination 4"), "{message}");
        }
    });
}

/// Pseudo-random floats of many magnitudes (and, with `nans`, NaNs with rank-specific payloads), where
/// summation order changes the rounding, so only a deterministic algorithm gives every rank the same bits.
fn random_f32(rank: usize, count: usize, nans: bool) -> Vec<u8> {
    let mut state = 0x2545_F491_4F6C_DD1D_u64 ^ (rank as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    (0..count)
        .flat_map(|i| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let mantissa = (state >> 11) as f64 / (1u64 << 53) as f64 - 0.5;
            let value = if nans && i % 11 == 3 {
                f32::from_bits(0x7fc0_0000 | (rank as u32 + 1) << 8 | (i as u32 & 0xff))
            } else {
                (mantissa * 2f64.powi((state % 40) as i32 - 20)) as f32
            };
            value.to_ne_bytes()
        })
        .collect()
}

#[test]
fn allreduce_results_are_bitwise_identical_on_every_rank() {
    over_every_transport(|| {
        for n in 2..=5 {
            for count in [7, 4097, 100_003, 300_007] {
                for (combine, nans) in
                    [(Combine::Sum, false), (Combine::Sum, true), (Combine::Min, true), (Combine::Max, true)]
                {
                    let results = on_ranks(n, |t| {
                        let mut buf = random_f32(t.rank(), count, nans);
                        allreduce(t, &mut buf, DataType::Float32, combine).unwrap();
                        buf
                    });
                    for (rank, got) in results.iter().enumerate().skip(1) {
                        assert!(got == &results[0], "n={n} count={count} {combine:?}: rank {rank} differs from rank 0");
                    }
                }
            }
        }
    });
}

/// Per-rank element counts: even splits, and uneven ones with empty blocks.
fn split_patterns(n: usize, total: usize) -> Vec<Vec<usize>> {
    let even = (0..n).map(|r| segment_bounds(total, n, r).1).collect();
    let uneven = (0..n).map(|r| if r % 2 == 1 { 0 } else { total / (r + 1) + r }).collect();
    let all_on_last = (0..n).map(|r| if r == n - 1 { total } else { 0 }).collect();
    vec![even, uneven, all_on_last]
}

#[test]
fn reducescatter_even_and_uneven_blocks() {
    over_every_transport(|| {
        for n in 1..=5 {
            for dtype in DataType::ALL {
                for combine in COMBINES {
                    for total in SIZES.into_iter().chain([RING_SIZE]) {
                        for elems_per_rank in split_patterns(n, total) {
                            let count: usize = elems_per_rank.iter().sum();
                            let results = on_ranks(n, |t| {
                                let rank = t.rank();
                                let buf = input(dtype, rank, count);
                                let mut out = vec![0xAA; elems_per_rank[rank] * dtype.size()];
                                reducescatter(t, &buf, &elems_per_rank, dtype, combine, 1.0, &mut out).unwrap();
                                assert!(buf == input(dtype, rank, count), "rank {rank}'s input changed");
                                out
                            });
                            let mut start = 0;
                            for (rank, got) in results.iter().enumerate() {
                                let end = start + elems_per_rank[rank];
                                let want = expected(dtype, combine, n, start..end);
                                assert!(
                                    got == &want,
                                    "reducescatter n={n} {dtype} {combine:?} {elems_per_rank:?}: rank {rank} differs"
                                );
                                start = end;
                            }
                        }
                    }
                }
            }
        }
    });
}

#[test]
fn reducescatter_large_buffer() {
    over_every_transport(|| {
        for n in [2, 3, 5] {
            let elems_per_rank: Vec<usize> = (0..n).map(|r| segment_bounds(BIG_SIZE, n, r).1).collect();
            let results = on_ranks(n, |t| {
                let rank = t.rank();
                let buf = input(DataType::Float32, rank, BIG_SIZE);
                let mut out = vec![0; elems_per_rank[rank] * 4];
                reducescatter(t, &buf, &elems_per_rank, DataType::Float32, Combine::Sum, 1.0, &mut out).unwrap();
                assert!(buf == input(DataType::Float32, rank, BIG_SIZE), "rank {rank}'s input changed");
                out
            });
            let mut start = 0;
            for (rank, got) in results.iter().enumerate() {
                let end = start + elems_per_rank[rank];
                assert!(got == &expected(DataType::Float32, Combine::Sum, n, start..end), "rank {rank}");
                start = end;
            }
        }
    });
}

/// Results of at least `rvod::tensor::STREAMING_MIN_BYTES` are written with streaming stores: the
/// out-of-place allreduce, reducescatter and allgather of such sizes, with odd lengths (unaligned ends).
#[test]
fn large_results_written_around_the_cache_are_right() {
    const COUNT: usize = 2_500_007; // float32 elements: 10 MB
    over_every_transport(|| {
        for n in [2, 3] {
            let elems_per_rank: Vec<usize> = (0..n).map(|r| segment_bounds(COUNT, n, r).1).collect();
            let bytes_per_rank: Vec<usize> = (0..n).map(|r| 5_000_011 + 13 * r).collect();
            let results = on_ranks(n, |t| {
                let rank = t.rank();
                let src = input(DataType::Float32, rank, COUNT);
                let mut reduced = vec![0xa5u8; src.len()];
                allreduce_into(t, &src, &mut reduced, DataType::Float32, Combine::Sum).unwrap();
                let mut scattered = vec![0xa5u8; elems_per_rank[rank] * 4];
                reducescatter(t, &src, &elems_per_rank, DataType::Float32, Combine::Max, 1.0, &mut scattered).unwrap();
                let send = rank_bytes(rank, 3, bytes_per_rank[rank]);
                let mut gathered = vec![0xa5u8; bytes_per_rank.iter().sum()];
                allgatherv(t, &send, &mut gathered, &bytes_per_rank).unwrap();
                assert!(src == input(DataType::Float32, rank, COUNT), "rank {rank}'s input changed");
                (reduced, scattered, gathered)
            });
            let gathered: Vec<u8> = (0..n).flat_map(|r| rank_bytes(r, 3, bytes_per_rank[r])).collect();
            let mut start = 0;
            for (rank, (reduced, scattered, got)) in results.iter().enumerate() {
                assert!(
                    reduced == &expected(DataType::Float32, Combine::Sum, n, 0..COUNT),
                    "n={n} allreduce rank {rank}"
                );
                let end = start + elems_per_rank[rank];
                let want = expected(DataType::Float32, Combine::Max, n, start..end);
                assert!(scattered == &want, "n={n} reducescatter rank {rank}");
                start = end;
                assert!(got == &gathered, "n={n} allgatherv rank {rank}");
            }
        }
    });
}

fn rank_bytes(rank: usize, salt: usize, len: usize) -> Vec<u8> {
    (0..len).map(|j| ((rank * 31 + salt * 17 + j) % 251) as u8).collect()
}

#[test]
fn allgatherv_with_uneven_and_empty_contributions() {
    over_every_transport(|| {
        for n in 1..=5 {
            for total in SIZES.into_iter().chain([RING_SIZE, BIG_SIZE]) {
                for bytes_per_rank in split_patterns(n, total) {
                    let want: Vec<u8> = (0..n).flat_map(|r| rank_bytes(r, 0, bytes_per_rank[r])).collect();
                    let results = on_ranks(n, |t| {
                        let send = rank_bytes(t.rank(), 0, bytes_per_rank[t.rank()]);
                        let mut recv = vec![0; want.len()];
                        allgatherv(t, &send, &mut recv, &bytes_per_rank).unwrap();
                        recv
                    });
                    for (rank, got) in results.iter().enumerate() {
                        assert!(got == &want, "allgatherv n={n} {bytes_per_rank:?}: rank {rank} differs");
                    }
                }
            }
        }
    });
}

#[test]
fn alltoallv_with_uneven_and_zero_splits() {
    over_every_transport(|| {
        for n in 1..=5 {
            for unit in [1, 7, 4097, 300_007] {
                // Bytes rank `from` sends to rank `to`; some pairs send nothing.
                let size = |from: usize, to: usize| ((from * 7 + to * 3) % 5) * unit / 2;
                let results = on_ranks(n, |t| {
                    let rank = t.rank();
                    let send_bytes: Vec<usize> = (0..n).map(|to| size(rank, to)).collect();
                    let recv_bytes: Vec<usize> = (0..n).map(|from| size(from, rank)).collect();
                    let send: Vec<u8> = (0..n).flat_map(|to| rank_bytes(rank, to, send_bytes[to])).collect();
                    let mut recv = vec![0; recv_bytes.iter().sum()];
                    alltoallv(t, &send, &send_bytes, &mut recv, &recv_bytes).unwrap();
                    recv
                });
                for (rank, got) in results.iter().enumerate() {
                    let want: Vec<u8> = (0..n).flat_map(|from| rank_bytes(from, rank, size(from, rank))).collect();
                    assert!(got == &want, "alltoallv n={n} unit={unit}: rank {rank} differs");
                }
            }
        }
    });
}

#[test]
fn broadcast_from_every_root() {
    over_every_transport(|| {
        let chain_size = 3 * BROADCAST_CHAIN_THRESHOLD_BYTES + 17;
        for n in 1..=5 {
            for root in 0..n {
                for len in SIZES.into_iter().chain([BIG_SIZE, chain_size]) {
                    let want = rank_bytes(root, 9, len);
                    let results = on_ranks(n, |t| {
                        let mut buf = if t.rank() == root { want.clone() } else { vec![0; len] };
                        broadcast(t, &mut buf, root).unwrap();
                        buf
                    });
                    for (rank, got) in results.iter().enumerate() {
                        assert!(got == &want, "broadcast n={n} root={root} len={len}: rank {rank} differs");
                    }
                }
            }
        }
    });
}

#[test]
fn inconsistent_arguments_are_errors_not_panics() {
    over_every_transport(|| {
        let results = on_ranks(2, |t| {
            let mut odd = vec![0u8; 6];
            let allreduce_error = allreduce(t, &mut odd, DataType::Float32, Combine::Sum);
            let broadcast_error = broadcast(t, &mut odd, 2);
            let mut out = vec![0u8; 4];
            let reducescatter_error = reducescatter(t, &odd, &[1, 1], DataType::Float32, Combine::Sum, 1.0, &mut out);
            let allgather_error = allgatherv(t, &[1, 2, 3], &mut out, &[2, 2]);
            let alltoall_error = alltoallv(t, &[1], &[1], &mut out, &[1, 1]);
            [allreduce_error, broadcast_error, reducescatter_error, allgather_error, alltoall_error]
        });
        for errors in results {
            for error in errors {
                match error {
                    Err(TransportError::Io { source, .. }) => {
                        assert_eq!(source.kind(), std::io::ErrorKind::InvalidInput, "{source}")
                    }
                    other => panic!("expected an invalid-argument error, got {other:?}"),
                }
            }
        }
    });
}

#[test]
fn closed_peer_fails_the_collective_on_every_other_rank() {
    over_every_transport(|| {
        for count in [7, 100_003] {
            let started = Instant::now();
            let results = on_ranks(3, |t| {
                if t.rank() == 2 {
                    t.close();
                    return None;
                }
                let mut buf = input(DataType::Float32, t.rank(), count);
                Some(allreduce(t, &mut buf, DataType::Float32, Combine::Sum))
            });
            for (rank, result) in results.iter().enumerate().take(2) {
                assert!(
                    matches!(result, Some(Err(TransportError::PeerClosed { .. }))),
                    "count={count}: rank {rank} got {result:?}"
                );
            }
            assert!(started.elapsed() < Duration::from_secs(10));
        }
    });
}

#[test]
fn silent_peer_times_out_instead_of_hanging() {
    over_every_transport(|| {
        let timeout = Duration::from_millis(200);
        let finished = Barrier::new(2);
        let started = Instant::now();
        let results = run_ranks(mesh(2, timeout), |t| {
            let t = t.as_mut();
            let result = if t.rank() == 0 {
                let mut buf = input(DataType::Int32, 0, 4097);
                Some(allreduce(t, &mut buf, DataType::Int32, Combine::Sum))
            } else {
                None
            };
            // Rank 1 keeps its transport open, without taking part, until rank 0 has given up.
            finished.wait();
            result
        });
        match &results[0] {
            Some(Err(TransportError::Timeout { peer: 1, seconds })) => assert!((seconds - 0.2).abs() < 1e-9),
            other => panic!("expected a timeout naming rank 1, got {other:?}"),
        }
        assert!(started.elapsed() < Duration::from_secs(10));
    });
}

/// Exchanges longer than the shared-memory transport's exchange piece (256 KiB), of unequal lengths each
/// way, reach the sink whole, in order and at the right offsets, on every transport: a ring of 2 and 3
/// ranks where each rank sends a length of its own (one not a multiple of any piece) to its right.
#[test]
fn long_exchanges_of_unequal_lengths_arrive_whole_and_in_order() {
    let length = |rank: usize| (3 << 18) + 1001 * rank + 7;
    let byte = |from: usize, i: usize| (i.wrapping_mul(31) ^ (from * 97)) as u8;
    over_every_transport(|| {
        for n in [2, 3] {
            let results = on_ranks(n, |t| {
                let (rank, right, left) = (t.rank(), (t.rank() + 1) % n, (t.rank() + n - 1) % n);
                let send: Vec<u8> = (0..length(rank)).map(|i| byte(rank, i)).collect();
                let mut got = Vec::new();
                t.exchange(right, &send, left, length(left), &mut |offset, piece| {
                    assert_eq!(offset, got.len(), "rank {rank}: a piece out of order");
                    got.extend_from_slice(piece);
                })
                .unwrap();
                (left, got)
            });
            for (rank, (left, got)) in results.into_iter().enumerate() {
                let want: Vec<u8> = (0..length(left)).map(|i| byte(left, i)).collect();
                assert!(got == want, "n={n} rank {rank}: {} bytes from rank {left}, wanted {}", got.len(), want.len());
            }
        }
    });
}
