//! Proof by counting (tests only): communicators of 2 to 256 ranks, as threads over the in-memory
//! transport, run real negotiation rounds and collectives while every message and byte each rank sends is
//! counted. A steady-state round, a small allreduce, a small allgather (Bruck's) and a small broadcast (a
//! binomial tree) cost O(log n) messages per rank; the ring sends within 5% of the `2(n-1)/n` bytes per byte
//! of the buffer that bounds any allreduce, and so does Rabenseifner's where n is a power of two.

use crate::config::Negotiation;
use crate::coordinator::negotiation::Negotiator;
use crate::coordinator::test_requests::FakeTable;
use crate::coordinator::tree::ALL_TO_ALL_MAX_RANKS;
use crate::ring;
use crate::transport::memory::{run_ranks, Recorded};
use crate::transport::{Capabilities, Transport};
use crate::types::{AllreduceAlgorithm, Combine, DataType};

/// A rank's sends since the last call, as (messages, bytes), forgotten.
fn take_sent(t: &mut Recorded) -> (u64, u64) {
    let sent = std::mem::take(&mut t.sent);
    (sent.len() as u64, sent.iter().sum::<usize>() as u64)
}

fn log2_floor(n: usize) -> u64 {
    u64::from(usize::BITS - 1 - n.leading_zeros())
}

fn log2_ceil(n: usize) -> u64 {
    u64::from(n.next_power_of_two().trailing_zeros())
}

/// What one rank sent in each phase: (messages, bytes).
#[derive(Debug)]
struct Counts {
    uncached_round: (u64, u64),
    steady_round: (u64, u64),
    small_allreduce: (u64, u64),
    small_allgather: (u64, u64),
    small_broadcast: (u64, u64),
    ring_allreduce: (u64, u64),
    rabenseifner_allreduce: (u64, u64),
}

/// On `n` ranks: a round with a new tensor (the slow path), a steady-state round with it cached, a 4-byte
/// allreduce, allgather and broadcast (their algorithms chosen as the engine chooses them), and allreduces of
/// `large` bytes by the ring and by Rabenseifner's; each rank's sends counted in each.
fn count(n: usize, large: usize) -> Vec<Counts> {
    run_ranks(Recorded::mesh(n, Capabilities::NONE), |t| {
        let rank = t.rank();
        let mut negotiator = Negotiator::new(rank, (0..n).collect(), 64, None, Negotiation::Auto);
        let mut table = FakeTable::default();
        // 256 float32 values: 1 KiB, too large to ride in the headers of more than a few dozen ranks.
        table.submit(rank, "grad", 256, 1);
        let first = negotiator.round(t, &mut table, None).expect("uncached round");
        assert_eq!(first.responses.len(), 1, "n={n} rank {rank}");
        table.complete("grad");
        let uncached_round = take_sent(t);
        table.submit(rank, "grad", 256, 1);
        let steady = negotiator.round(t, &mut table, None).expect("steady round");
        assert_eq!(steady.cache_hits, 1, "n={n} rank {rank}");
        let steady_round = take_sent(t);

        let mut small = 1.0f32.to_le_bytes();
        ring::allreduce(t, &mut small, DataType::Float32, Combine::Sum).expect("small allreduce");
        assert_eq!(f32::from_le_bytes(small), n as f32);
        let small_allreduce = take_sent(t);

        let mut gathered = vec![0u8; 4 * n];
        ring::allgatherv(t, &(rank as u32).to_le_bytes(), &mut gathered, &vec![4; n]).expect("small allgather");
        assert!(gathered.chunks(4).enumerate().all(|(r, c)| c == (r as u32).to_le_bytes()), "n={n}");
        let small_allgather = take_sent(t);
        let mut word = if rank == n - 1 { 7u32 } else { 0 }.to_le_bytes();
        ring::broadcast(t, &mut word, n - 1).expect("small broadcast");
        assert_eq!(u32::from_le_bytes(word), 7);
        let small_broadcast = take_sent(t);

        let mut large_by = |algorithm| {
            let mut buf: Vec<u8> = (0..large / 4).flat_map(|i| ((i % 7) as f32).to_le_bytes()).collect();
            ring::allreduce_by(t, None, &mut buf, DataType::Float32, Combine::Sum, algorithm).expect("large allreduce");
            assert_eq!(&buf[4..8], &(n as f32).to_le_bytes(), "n={n} {algorithm:?}");
            take_sent(t)
        };
        let ring_allreduce = large_by(AllreduceAlgorithm::Ring);
        let rabenseifner_allreduce = large_by(AllreduceAlgorithm::Rabenseifner);
        Counts {
            uncached_round,
            steady_round,
            small_allreduce,
            small_allgather,
            small_broadcast,
            ring_allreduce,
            rabenseifner_allreduce,
        }
    })
}

#[test]
fn costs_per_rank_grow_as_log_n_and_large_allreduces_stay_at_the_bandwidth_bound() {
    for n in [2, 3, 4, 5, 8, 9, 16, 17, 31, 64, 256] {
        // The ring and Rabenseifner's are forced: their bytes per rank matter here, not their time (debug
        // builds reduce slowly), so one block of 2 KiB per rank, at least 128 KiB, will do.
        let large = (n * 2048).max(128 << 10);
        let counts = count(n, large);
        let most = |phase: fn(&Counts) -> (u64, u64)| {
            counts.iter().map(phase).fold((0, 0), |a, b| (a.0.max(b.0), a.1.max(b.1)))
        };
        let (steady, steady_bytes) = most(|c| c.steady_round);
        let (uncached, _) = most(|c| c.uncached_round);
        let (small, small_bytes) = most(|c| c.small_allreduce);
        let (gather, _) = most(|c| c.small_allgather);
        let (bcast, _) = most(|c| c.small_broadcast);
        let (_, ring_bytes) = most(|c| c.ring_allreduce);
        let (_, rabenseifner_bytes) = most(|c| c.rabenseifner_allreduce);
        // Recursive doubling: log2 n exchanges; where n is no power of two, the ranks beyond the largest one
        // fold onto a partner first and get the total back (in a round the partner also opens with its own
        // summary, which wakes an idle folded rank: one more message).
        let folds = u64::from(!n.is_power_of_two());
        let doubling = log2_floor(n) + 2 * folds;
        let small_doubling = log2_floor(n) + folds;
        if n <= ALL_TO_ALL_MAX_RANKS {
            // All-to-all: one header to each peer, whatever the round.
            assert_eq!(steady, n as u64 - 1, "n={n}: steady-state round");
            assert_eq!(uncached, 2 * (n as u64 - 1), "n={n}: rank 0 answers every rank");
        } else {
            assert!(steady <= doubling, "n={n}: a steady-state round sent {steady} messages (> {doubling})");
            // The summary, one gathered list up, and at most ceil(log2 n) copies of the answer down.
            let bound = doubling + 1 + log2_ceil(n);
            assert!(uncached <= bound, "n={n}: an uncached round sent {uncached} messages (> {bound})");
            assert!(steady_bytes <= doubling * 96, "n={n}: a steady-state round sent {steady_bytes} bytes");
        }
        assert!(small <= small_doubling, "n={n}: a 4-byte allreduce sent {small} messages (> {small_doubling})");
        assert!(small_bytes <= 4 * small_doubling, "n={n}: a 4-byte allreduce sent {small_bytes} bytes");
        // Bruck's allgather: ceil(log2 n) steps (the ring's n - 1 up to 3 ranks, the same count there); a
        // binomial tree: no rank sends more than ceil(log2 n) copies.
        assert!(gather <= log2_ceil(n), "n={n}: a 4-byte allgather sent {gather} messages");
        assert!(bcast <= log2_ceil(n), "n={n}: a 4-byte broadcast sent {bcast} messages");
        let bound = 2.0 * (n - 1) as f64 / n as f64 * large as f64;
        let ring_ratio = ring_bytes as f64 / bound;
        let rabenseifner_ratio = rabenseifner_bytes as f64 / bound;
        assert!(ring_ratio <= 1.05, "n={n}: the ring sent {ring_bytes} bytes of {large}, {ring_ratio:.3}x the bound");
        if n.is_power_of_two() {
            assert!(rabenseifner_ratio <= 1.05, "n={n}: Rabenseifner's sent {rabenseifner_ratio:.3}x the bound");
        }
        eprintln!(
            "n={n:>3}: steady round {steady} msgs {steady_bytes} B, uncached round {uncached} msgs, \
             4 B allreduce {small} msgs, allgather {gather}, broadcast {bcast}; large allreduce: ring \
             {ring_ratio:.3}x the 2(n-1)/n bound, Rabenseifner's {rabenseifner_ratio:.3}x"
        );
    }
}
