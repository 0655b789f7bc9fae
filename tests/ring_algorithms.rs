//! Every algorithm of `rvod::ring::choice`, forced, on 1..=17 ranks and 31, 32 and 33 (powers of two and
//! not), as threads over the in-memory transport: allreduce for every dtype and combine at 0, 1, 7 and 4,097
//! elements and a large buffer, allgatherv with uneven and empty blocks, broadcast from several roots. Each
//! result must equal a serial reference (exactly for inputs that are small integers, within rounding for
//! random floats) and be bit-identical on every rank.

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};

use rvod::ring::choice::{AllgatherAlgorithm, AllreduceAlgorithm, BroadcastAlgorithm, Named};
use rvod::ring::{allgatherv_by, allreduce_by, broadcast_by, reduce_into};
use rvod::transport::memory::{run_ranks, MemoryTransport};
use rvod::transport::Transport;
use rvod::types::{Combine, DataType};

mod common;
use common::encode;

const COMBINES: [Combine; 4] = [Combine::Sum, Combine::Min, Combine::Max, Combine::Product];
const COUNTS: [usize; 4] = [0, 1, 7, 4097];
const LARGE: usize = 65_537;
/// Inputs (and so results) repeat with this period in the element index; buffers are built by tiling.
const PERIOD: usize = 25;

fn rank_counts() -> impl Iterator<Item = usize> {
    (1..=17).chain([31, 32, 33])
}

fn digest(bytes: &[u8]) -> u64 {
    let mut hasher = DefaultHasher::new();
    bytes.hash(&mut hasher);
    hasher.finish()
}

/// Rank `rank`'s element `i`: a small integer (non-negative for unsigned types, 0/1 for bool). For products
/// only ranks below 8 contribute magnitudes above 1, so no float product overflows or rounds.
fn value(dtype: DataType, combine: Combine, rank: usize, i: usize) -> f64 {
    let v = ((i * 7 + rank * 3 + i / 5) % 5) as i64;
    let v = match dtype {
        DataType::Bool => v % 2,
        DataType::Uint8 | DataType::Uint16 => v,
        _ => v - 2,
    };
    let v = if combine == Combine::Product && rank >= 8 && v.abs() > 1 { v.signum() } else { v };
    v as f64
}

/// `period` (whole elements) repeated to `count` elements.
fn tile(period: &[u8], dtype: DataType, count: usize) -> Vec<u8> {
    period.iter().copied().cycle().take(count * dtype.size()).collect()
}

fn input(dtype: DataType, combine: Combine, rank: usize, count: usize) -> Vec<u8> {
    let period: Vec<u8> = (0..PERIOD).flat_map(|i| encode(dtype, value(dtype, combine, rank, i))).collect();
    tile(&period, dtype, count)
}

/// The combination of every rank's input, folded in rank order by the library's own kernel. Integer
/// arithmetic wraps, and every float partial result here is a small integer, so any order gives these bits.
fn reference(dtype: DataType, combine: Combine, n: usize, count: usize) -> Vec<u8> {
    let mut out = input(dtype, combine, 0, PERIOD);
    for rank in 1..n {
        reduce_into(&mut out, &input(dtype, combine, rank, PERIOD), dtype, combine);
    }
    tile(&out, dtype, count)
}

/// Pseudo-random floats of many magnitudes, where the order of additions changes the rounding.
fn random_f64s(rank: usize, count: usize) -> Vec<f64> {
    let mut state = 0x2545_F491_4F6C_DD1D_u64 ^ (rank as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    (0..count)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            ((state >> 11) as f64 / (1u64 << 53) as f64 - 0.5) * 2f64.powi((state % 20) as i32 - 10)
        })
        .collect()
}

#[test]
fn every_allreduce_algorithm_on_any_number_of_ranks_every_dtype_and_combine() {
    for n in rank_counts() {
        // Every combine and size for a float and an integer type, and a large buffer; every dtype too on up to
        // 9 ranks (the kernels do not depend on the schedule, which is what depends on `n`).
        let dtypes: &[DataType] = if n <= 9 { &DataType::ALL } else { &[DataType::Float32, DataType::Int8] };
        let cases: Vec<(DataType, Combine, usize)> = dtypes
            .iter()
            .flat_map(|&dtype| COMBINES.into_iter().map(move |c| (dtype, c, COUNTS[3])))
            .chain([DataType::Float32, DataType::Int8].into_iter().flat_map(|dtype| {
                COMBINES.into_iter().flat_map(move |c| COUNTS[..3].iter().map(move |&k| (dtype, c, k)))
            }))
            .chain([(DataType::Float32, Combine::Sum, LARGE)])
            .collect();
        let inputs: Vec<Vec<Vec<u8>>> =
            (0..n).map(|rank| cases.iter().map(|&(d, c, k)| input(d, c, rank, k)).collect()).collect();
        let references: Vec<Vec<u8>> = cases.iter().map(|&(d, c, k)| reference(d, c, n, k)).collect();
        let results = run_ranks(MemoryTransport::mesh(n), |t| {
            let mut wrong = Vec::new();
            let mut digests = Vec::new();
            for &algorithm in AllreduceAlgorithm::ALL {
                for ((&(dtype, combine, count), want), input) in cases.iter().zip(&references).zip(&inputs[t.rank()]) {
                    let mut buf = input.clone();
                    allreduce_by(t, None, &mut buf, dtype, combine, algorithm).unwrap();
                    if &buf != want {
                        wrong.push(format!("{algorithm} {dtype} {combine:?} count={count}"));
                    }
                    digests.push(digest(&buf));
                }
            }
            (wrong, digests)
        });
        for (rank, (wrong, digests)) in results.iter().enumerate() {
            assert!(wrong.is_empty(), "n={n} rank {rank}: wrong results for {wrong:?}");
            assert!(digests == &results[0].1, "n={n} rank {rank}: bits differ from rank 0's");
        }
    }
}

#[test]
fn every_allreduce_algorithm_out_of_place_matches_in_place_and_keeps_the_source() {
    let f32_bytes = |values: Vec<f64>| -> Vec<u8> { values.iter().flat_map(|&v| (v as f32).to_ne_bytes()).collect() };
    for n in [1, 2, 3, 5, 8, 11, 16] {
        let sources: Vec<Vec<Vec<u8>>> =
            (0..n).map(|rank| [7, 4097, 30_001].map(|count| f32_bytes(random_f64s(rank, count))).to_vec()).collect();
        let results = run_ranks(MemoryTransport::mesh(n), |t| {
            let mut out = Vec::new();
            for &algorithm in AllreduceAlgorithm::ALL {
                for original in &sources[t.rank()] {
                    let src = original.clone();
                    let mut in_place = src.clone();
                    allreduce_by(t, None, &mut in_place, DataType::Float32, Combine::Sum, algorithm).unwrap();
                    let mut dst = vec![0xa5; src.len()];
                    allreduce_by(t, Some(&src), &mut dst, DataType::Float32, Combine::Sum, algorithm).unwrap();
                    let case = format!("{algorithm} count={}", src.len() / 4);
                    out.push((case, &src == original, in_place == dst, digest(&dst)));
                }
            }
            out
        });
        for (rank, cases) in results.iter().enumerate() {
            for (i, (case, kept, same, bits)) in cases.iter().enumerate() {
                assert!(kept, "n={n} rank {rank} {case}: the source changed");
                assert!(same, "n={n} rank {rank} {case}: out of place differs from in place");
                assert_eq!(*bits, results[0][i].3, "n={n} rank {rank} {case}: bits differ from rank 0's");
            }
        }
    }
}

/// Sums of random floats: within rounding of the exact sum, and the same bits on every rank, for every
/// algorithm (each combines in its own order).
#[test]
fn every_allreduce_algorithm_sums_random_floats_within_rounding_identically_on_every_rank() {
    let count = 4099;
    for n in [3, 4, 6, 9, 13, 17, 32] {
        let inputs: Vec<Vec<f64>> = (0..n).map(|rank| random_f64s(rank, count)).collect();
        for dtype in [DataType::Float32, DataType::Float64] {
            let results = run_ranks(MemoryTransport::mesh(n), |t| {
                AllreduceAlgorithm::ALL
                    .iter()
                    .map(|&algorithm| {
                        let mut buf: Vec<u8> = inputs[t.rank()].iter().flat_map(|&v| encode(dtype, v)).collect();
                        allreduce_by(t, None, &mut buf, dtype, Combine::Sum, algorithm).unwrap();
                        buf
                    })
                    .collect::<Vec<_>>()
            });
            for (a, &algorithm) in AllreduceAlgorithm::ALL.iter().enumerate() {
                for rank in 1..n {
                    assert!(results[rank][a] == results[0][a], "n={n} {dtype} {algorithm}: rank {rank} differs");
                }
                let (eps, size) = if dtype == DataType::Float32 { (f32::EPSILON as f64, 4) } else { (f64::EPSILON, 8) };
                for (i, bytes) in results[0][a].chunks(size).enumerate() {
                    let got = if size == 4 {
                        f32::from_ne_bytes(bytes.try_into().unwrap()) as f64
                    } else {
                        f64::from_ne_bytes(bytes.try_into().unwrap())
                    };
                    // The inputs as the dtype holds them, summed exactly enough in f64.
                    let terms: Vec<f64> =
                        inputs.iter().map(|v| if size == 4 { v[i] as f32 as f64 } else { v[i] }).collect();
                    let exact: f64 = terms.iter().sum();
                    let scale: f64 = terms.iter().map(|v| v.abs()).sum();
                    assert!((got - exact).abs() <= 2.0 * n as f64 * eps * scale, "n={n} {dtype} {algorithm} [{i}]");
                }
            }
        }
    }
}

#[test]
fn every_allgather_algorithm_with_uneven_and_empty_blocks() {
    for n in rank_counts() {
        let patterns: Vec<Vec<usize>> = vec![
            vec![0; n],
            (0..n).map(|r| r % 3).collect(),
            (0..n).map(|r| if r % 2 == 1 { 0 } else { 4097 / (r + 1) + r }).collect(),
            (0..n).map(|r| if r == n - 1 { 9 } else { 0 }).collect(),
            (0..n).map(|r| 7 + r % 2).collect(),
            (0..n).map(|r| if r == n / 2 { 70_001 } else { r }).collect(),
        ];
        let results = run_ranks(MemoryTransport::mesh(n), |t| {
            let mut out = Vec::new();
            for &algorithm in AllgatherAlgorithm::ALL {
                for (p, sizes) in patterns.iter().enumerate() {
                    let send: Vec<u8> = (0..sizes[t.rank()]).map(|i| (i * 31 + t.rank() * 7 + p) as u8).collect();
                    let mut recv = vec![0xa5; sizes.iter().sum()];
                    allgatherv_by(t, &send, &mut recv, sizes, algorithm).unwrap();
                    out.push((algorithm, p, recv));
                }
            }
            out
        });
        for (rank, cases) in results.iter().enumerate() {
            for (algorithm, p, got) in cases {
                let sizes = &patterns[*p];
                let want: Vec<u8> =
                    (0..n).flat_map(|r| (0..sizes[r]).map(move |i| (i * 31 + r * 7 + p) as u8)).collect();
                assert!(got == &want, "n={n} rank {rank} {algorithm} sizes {sizes:?}: wrong result");
            }
        }
    }
}

#[test]
fn every_broadcast_algorithm_from_several_roots() {
    for n in rank_counts() {
        // Every length from three roots; the large one (three chain chunks) from the middle rank.
        let cases: Vec<(usize, usize)> = [0, n / 2, n - 1]
            .into_iter()
            .flat_map(|root| [0, 1, 7, 4097].map(|len| (root, len)))
            .chain([(n / 2, 1_100_001)])
            .collect();
        let datas: Vec<Vec<u8>> =
            cases.iter().map(|&(root, len)| (0..251u8).cycle().skip(root % 251).take(len).collect()).collect();
        let results = run_ranks(MemoryTransport::mesh(n), |t| {
            let mut out = Vec::new();
            for &algorithm in BroadcastAlgorithm::ALL {
                for (&(root, len), data) in cases.iter().zip(&datas) {
                    let mut buf = if t.rank() == root { data.clone() } else { vec![0xa5; len] };
                    broadcast_by(t, &mut buf, root, algorithm).unwrap();
                    out.push((format!("{algorithm} root {root} len {len}"), &buf == data));
                }
            }
            out
        });
        for (rank, cases) in results.iter().enumerate() {
            for (case, right) in cases {
                assert!(right, "n={n} rank {rank} {case}: wrong result");
            }
        }
    }
}

/// The algorithms every rank picks without a configured one are what `choose_*` says, and an allreduce by
/// the automatic choice gives the same bits as by that algorithm forced.
#[test]
fn the_automatic_choice_runs_the_chosen_algorithm() {
    use rvod::ring::allreduce;
    use rvod::ring::choice::choose_allreduce;
    use AllreduceAlgorithm::{Rabenseifner, RecursiveDoubling, Ring};
    for (n, count, expected) in [(4, 10, RecursiveDoubling), (6, 40_000, Rabenseifner), (8, 524_288, Ring)] {
        let results = run_ranks(MemoryTransport::mesh(n), |t| {
            let chosen = choose_allreduce(count * 4, n, t.capabilities().cheap_handoffs, None);
            let period: Vec<u8> = random_f64s(t.rank(), 1000).iter().flat_map(|&v| (v as f32).to_ne_bytes()).collect();
            let src = tile(&period, DataType::Float32, count);
            let (mut auto, mut forced) = (src.clone(), src);
            allreduce(t, &mut auto, DataType::Float32, Combine::Sum).unwrap();
            allreduce_by(t, None, &mut forced, DataType::Float32, Combine::Sum, chosen).unwrap();
            (chosen, auto == forced)
        });
        for (rank, (chosen, same)) in results.iter().enumerate() {
            assert_eq!(*chosen, expected, "n={n} count={count} rank {rank}");
            assert!(same, "n={n} count={count} rank {rank}: automatic and forced bits differ");
        }
    }
}

/// Time of one op on `n` ranks in microseconds: the median over a few rounds of `reps` ops each (after one
/// warm-up op), as rank 0 sees it.
fn time_op(n: usize, bytes: usize, op: impl Fn(&mut MemoryTransport, &mut Vec<u8>) + Sync) -> f64 {
    let reps = (16 << 20) / bytes.max(1024);
    let reps = reps.clamp(3, 100);
    let times = run_ranks(MemoryTransport::mesh(n), |t| {
        let mut buf = vec![1u8; bytes];
        op(t, &mut buf);
        let mut rounds: Vec<f64> = (0..5)
            .map(|_| {
                let started = std::time::Instant::now();
                for _ in 0..reps {
                    op(t, &mut buf);
                }
                started.elapsed().as_secs_f64() * 1e6 / reps as f64
            })
            .collect();
        rounds.sort_by(f64::total_cmp);
        rounds[2]
    });
    times[0]
}

/// The measurement behind the constants of `rvod::ring::choice`: each algorithm's time per op over the
/// in-memory transport at n = 2 to 16 (`cargo test --release --test ring_algorithms -- --ignored
/// --nocapture`).
#[test]
#[ignore = "timing, run by hand in release"]
fn measure_algorithms() {
    for n in [2, 4, 5, 6, 8, 12, 16] {
        for kib in [4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096] {
            let bytes = kib * 1024;
            let row: Vec<String> = AllreduceAlgorithm::ALL
                .iter()
                .map(|&algorithm| {
                    let us = time_op(n, bytes, |t, buf| {
                        allreduce_by(t, None, buf, DataType::Float32, Combine::Sum, algorithm).unwrap()
                    });
                    format!("{algorithm} {us:.0}")
                })
                .collect();
            println!("allreduce n={n} {kib} KiB: {}", row.join(", "));
        }
    }
    for n in [4, 8, 16] {
        for kib in [1, 4, 16, 64, 256, 1024] {
            let bytes = kib * 1024;
            let row: Vec<String> = AllgatherAlgorithm::ALL
                .iter()
                .map(|&algorithm| {
                    let us = time_op(n, bytes, |t, buf| {
                        let sizes: Vec<usize> = (0..n).map(|r| bytes / n + usize::from(r < bytes % n)).collect();
                        let send = vec![1u8; sizes[t.rank()]];
                        allgatherv_by(t, &send, buf, &sizes, algorithm).unwrap()
                    });
                    format!("{algorithm} {us:.0}")
                })
                .collect();
            println!("allgather n={n} {kib} KiB: {}", row.join(", "));
        }
    }
    for n in [4, 8, 16] {
        for kib in [512, 1024, 2048, 4096, 8192] {
            let row: Vec<String> = BroadcastAlgorithm::ALL
                .iter()
                .map(|&algorithm| {
                    let us = time_op(n, kib * 1024, |t, buf| broadcast_by(t, buf, 0, algorithm).unwrap());
                    format!("{algorithm} {us:.0}")
                })
                .collect();
            println!("broadcast n={n} {kib} KiB: {}", row.join(", "));
        }
    }
}
