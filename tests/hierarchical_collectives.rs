//! Communicators that span hosts, with ranks as threads of this process: each rank gets its own
//! `RVOD_HOSTNAME`, so `connect_members` builds the composite transport (shared memory among a "host"'s
//! ranks, TCP on loopback between "hosts") exactly as a real multi-host job does. Checked on 2x2 hosts,
//! on 2x2 with hosts interleaved in rank order, and on uneven 1+3 hosts: every collective over the
//! composite (flat) transport, and the hierarchical allreduce and allgather against the flat ones, for
//! every dtype and combine and sizes that are multiples of nothing. Inputs are small integers, exact in
//! every dtype, so hierarchical and flat must agree bit for bit; random floats must at least give every
//! rank the same bits.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr};
use std::sync::Barrier;
use std::time::{Duration, Instant};

use half::{bf16, f16};
use rvod::config::Config;
use rvod::engine::connect::connect_members;
use rvod::engine::peer_hosts::PeerHosts;
use rvod::ring;
use rvod::transport::rendezvous::{RendezvousServer, StoreClient};
use rvod::transport::{Activity, Transport, TransportError, Waker};
use rvod::types::{Combine, DataType};

mod common;
use common::encode;

const SECRET: &[u8] = b"hierarchical-test-secret";
const LOOPBACK: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);
const COMBINES: [Combine; 4] = [Combine::Sum, Combine::Min, Combine::Max, Combine::Product];
const SIZES: [usize; 4] = [0, 1, 7, 4097];
/// Past the ring threshold for every dtype (run for a few: debug builds reduce slowly).
const RING_SIZE: usize = 70_001;
const BIG: usize = 1_000_003;
/// Int32 elements in more than two pipeline pieces, the last one short.
const PIPELINED: usize = 2 * ring::hierarchical::PIPELINE_PIECE_BYTES / 4 + 1_000_003;
const TWO_BY_TWO: [usize; 4] = [0, 0, 1, 1];
const INTERLEAVED: [usize; 4] = [0, 1, 0, 1];
const ONE_PLUS_THREE: [usize; 4] = [0, 1, 1, 1];

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Run `body` on every rank of a communicator whose rank `r` runs on host `hosts[r]`; results in rank order.
fn on_hosts<R: Send>(hosts: &[usize], body: impl Fn(&mut dyn Transport) -> R + Sync) -> Vec<R> {
    let server = RendezvousServer::start(LOOPBACK, 0, SECRET.to_vec()).unwrap();
    let n = hosts.len();
    let members: Vec<usize> = (0..n).collect();
    let shm_dir = std::env::temp_dir();
    std::thread::scope(|s| {
        let ranks: Vec<_> = (0..n)
            .map(|rank| {
                let (body, members, server, shm_dir) = (&body, &members, &server, &shm_dir);
                s.spawn(move || {
                    let vars: HashMap<String, String> = [
                        ("RVOD_SIZE", n.to_string()),
                        ("RVOD_RANK", rank.to_string()),
                        ("RVOD_HOSTNAME", format!("host{}", hosts[rank])),
                        ("RVOD_RENDEZVOUS_ADDR", "127.0.0.1".to_string()),
                        ("RVOD_RENDEZVOUS_PORT", server.port().to_string()),
                        ("RVOD_SECRET", hex(SECRET)),
                        ("RVOD_TIMEOUT", "20".to_string()),
                        ("RVOD_FUSION_THRESHOLD", "0".to_string()),
                        ("RVOD_SHM_DIR", shm_dir.display().to_string()),
                    ]
                    .into_iter()
                    .map(|(k, v)| (k.to_string(), v))
                    .collect();
                    let config = Config::from_lookup(|name| vars.get(name).cloned(), None).unwrap();
                    let mut store = StoreClient::connect(server.addr(), SECRET, Duration::from_secs(10)).unwrap();
                    let mut t = connect_members(
                        &config,
                        Some(LOOPBACK),
                        Some(&mut store),
                        "world",
                        members,
                        &PeerHosts::default(),
                    )
                    .unwrap();
                    body(t.as_mut())
                })
            })
            .collect();
        ranks.into_iter().map(|r| r.join().unwrap()).collect()
    })
}

fn input_value(dtype: DataType, rank: usize, i: usize) -> i64 {
    let v = ((i * 7 + rank * 3 + i / 5) % 5) as i64;
    match dtype {
        DataType::Bool => i64::from(v % 2 == 1),
        DataType::Uint8 | DataType::Uint16 => v,
        _ => v - 2,
    }
}

fn input(dtype: DataType, rank: usize, count: usize) -> Vec<u8> {
    (0..count).flat_map(|i| encode(dtype, input_value(dtype, rank, i) as f64)).collect()
}

fn expected(dtype: DataType, combine: Combine, n: usize, count: usize) -> Vec<u8> {
    (0..count)
        .flat_map(|i| {
            let values = (0..n).map(|rank| input_value(dtype, rank, i) as f64);
            let (min, max) =
                (values.clone().fold(f64::INFINITY, f64::min), values.clone().fold(f64::NEG_INFINITY, f64::max));
            let v = match (combine, dtype) {
                (Combine::Sum, DataType::Bool) | (Combine::Max, _) => max,
                (Combine::Product, DataType::Bool) | (Combine::Min, _) => min,
                (Combine::Sum, _) => values.sum(),
                (Combine::Product, _) => values.product(),
            };
            encode(dtype, v)
        })
        .collect()
}

fn flat_allreduce(t: &mut dyn Transport, buf: &mut [u8], dtype: DataType, combine: Combine) {
    ring::allreduce(t, buf, dtype, combine).unwrap();
}

fn hierarchical_allreduce(t: &mut dyn Transport, buf: &mut [u8], dtype: DataType, combine: Combine) {
    ring::hierarchical::allreduce(t.hosts().expect("a composite transport"), buf, dtype, combine, &mut |_| {}).unwrap();
}

#[test]
fn mixed_communicators_use_shared_memory_inside_hosts_and_tcp_across() {
    for (hosts, counts) in [(&TWO_BY_TWO, vec![2, 2]), (&INTERLEAVED, vec![2, 2]), (&ONE_PLUS_THREE, vec![1, 3])] {
        let seen = on_hosts(hosts, |t| {
            let (kind, flat_cheap) = (t.label(), t.capabilities().cheap_handoffs);
            let parts = t.hosts().expect("a composite transport");
            let sizes: Vec<usize> = (0..parts.layout.hosts()).map(|h| parts.layout.members(h).len()).collect();
            let cheap =
                (flat_cheap, parts.local.capabilities().cheap_handoffs, parts.cross.capabilities().cheap_handoffs);
            (kind, cheap, sizes, parts.local.rank(), parts.local.size(), parts.cross.rank(), parts.cross.size())
        });
        for (rank, (kind, cheap, sizes, local_rank, local_size, cross_rank, cross_size)) in seen.into_iter().enumerate()
        {
            assert_eq!(kind, "shm+tcp", "{hosts:?} rank {rank}");
            // Hand-offs are cheap inside a host's shared memory only (a rank alone there has no peer in it).
            assert_eq!(cheap, (false, local_size > 1, false), "{hosts:?} rank {rank}");
            assert_eq!(sizes, counts, "{hosts:?} rank {rank}");
            let host = hosts[rank];
            let host_ranks: Vec<usize> = (0..4).filter(|&r| hosts[r] == host).collect();
            assert_eq!(local_rank, host_ranks.iter().position(|&r| r == rank).unwrap());
            assert_eq!(local_size, host_ranks.len());
            // The cross part: one rank per host that has this local rank.
            let expected_cross = counts.iter().filter(|&&c| c > local_rank).count();
            assert_eq!(cross_size, expected_cross, "{hosts:?} rank {rank}");
            assert!(cross_rank < cross_size);
        }
    }
}

#[test]
fn hierarchical_allreduce_equals_flat_for_every_dtype_and_combine() {
    // Hosts interleaved in rank order take the same code with other rank numbers: a few dtypes suffice there.
    let few = [DataType::Bool, DataType::Int8, DataType::Float16, DataType::Float64];
    for (hosts, dtypes) in [(&TWO_BY_TWO, &DataType::ALL[..]), (&INTERLEAVED, &few[..])] {
        let results = on_hosts(hosts, |t| {
            let mut out = Vec::new();
            for &dtype in dtypes {
                for combine in COMBINES {
                    let ring_size = matches!(dtype, DataType::Uint8 | DataType::Float32).then_some(RING_SIZE);
                    for count in SIZES.into_iter().chain(ring_size) {
                        let mut flat = input(dtype, t.rank(), count);
                        flat_allreduce(t, &mut flat, dtype, combine);
                        let mut hier = input(dtype, t.rank(), count);
                        hierarchical_allreduce(t, &mut hier, dtype, combine);
                        out.push(((dtype, combine, count), flat, hier));
                    }
                }
            }
            out
        });
        for (rank, cases) in results.iter().enumerate() {
            for ((dtype, combine, count), flat, hier) in cases {
                let want = expected(*dtype, *combine, 4, *count);
                assert!(flat == &want, "{hosts:?} flat {dtype} {combine:?} count={count}: rank {rank} wrong");
                assert!(hier == &want, "{hosts:?} hierarchical {dtype} {combine:?} count={count}: rank {rank} wrong");
            }
        }
    }
}

#[test]
fn flat_allreduce_on_uneven_hosts_and_hierarchical_refuses_them() {
    let results = on_hosts(&ONE_PLUS_THREE, |t| {
        let mut out = Vec::new();
        for dtype in DataType::ALL {
            for combine in COMBINES {
                let ring_size = matches!(dtype, DataType::Int8 | DataType::Float64).then_some(RING_SIZE);
                for count in SIZES.into_iter().chain(ring_size) {
                    let mut buf = input(dtype, t.rank(), count);
                    flat_allreduce(t, &mut buf, dtype, combine);
                    out.push(((dtype, combine, count), buf));
                }
            }
        }
        let refused = ring::hierarchical::allreduce(
            t.hosts().unwrap(),
            &mut [0u8; 8],
            DataType::Float32,
            Combine::Sum,
            &mut |_| {},
        );
        (out, refused.map_err(|e| e.to_string()))
    });
    for (rank, (cases, refused)) in results.iter().enumerate() {
        for ((dtype, combine, count), got) in cases {
            assert!(got == &expected(*dtype, *combine, 4, *count), "{dtype} {combine:?} count={count}: rank {rank}");
        }
        let err = refused.as_ref().unwrap_err();
        assert!(err.contains("different numbers of ranks"), "{err}");
    }
}

#[test]
fn large_allreduce_hierarchical_and_flat_on_two_by_two() {
    let results = on_hosts(&TWO_BY_TWO, |t| {
        let mut flat = input(DataType::Float32, t.rank(), BIG);
        flat_allreduce(t, &mut flat, DataType::Float32, Combine::Sum);
        let mut hier = input(DataType::Float32, t.rank(), BIG);
        hierarchical_allreduce(t, &mut hier, DataType::Float32, Combine::Sum);
        // Random floats of many magnitudes: rounding depends on the order, but every rank agrees.
        let mut state = 0x9E37_79B9_7F4A_7C15_u64 ^ (t.rank() as u64 + 1);
        let mut random: Vec<u8> = (0..300_007)
            .flat_map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                ((state >> 11) as f64 / (1u64 << 53) as f64 * 2f64.powi((state % 30) as i32 - 15)).to_ne_bytes()
            })
            .collect();
        hierarchical_allreduce(t, &mut random, DataType::Float64, Combine::Sum);
        // Above twice the pipeline piece: reduced in pieces, the cross-host part on a helper thread.
        let mut pipelined = input(DataType::Int32, t.rank(), PIPELINED);
        hierarchical_allreduce(t, &mut pipelined, DataType::Int32, Combine::Sum);
        (flat, hier, random, pipelined)
    });
    let want = expected(DataType::Float32, Combine::Sum, 4, BIG);
    let want_pipelined = expected(DataType::Int32, Combine::Sum, 4, PIPELINED);
    for (rank, (flat, hier, random, pipelined)) in results.iter().enumerate() {
        assert!(flat == &want && hier == &want, "rank {rank}");
        assert!(random == &results[0].2, "rank {rank}: random floats differ from rank 0");
        assert!(pipelined == &want_pipelined, "rank {rank}: pipelined hierarchical allreduce wrong");
    }
}

/// Bytes rank `rank` contributes to an allgather: `len` bytes that say who sent them.
fn gather_input(rank: usize, len: usize) -> Vec<u8> {
    (0..len).map(|i| (rank * 50 + i % 47) as u8).collect()
}

/// What an allgather of [`gather_input`]s gives every rank when rank `r` contributes `bytes[r]` bytes.
fn gathered(bytes: &[usize]) -> Vec<u8> {
    bytes.iter().enumerate().flat_map(|(r, &len)| gather_input(r, len)).collect()
}

#[test]
fn allgather_hierarchical_equals_flat_with_uneven_and_empty_blocks() {
    let layouts: [(&[usize], bool); 3] = [(&TWO_BY_TWO, true), (&INTERLEAVED, true), (&ONE_PLUS_THREE, false)];
    // The last two are gathered in place on the consecutive layouts (at least IN_PLACE_MIN_BYTES).
    let per_rank_cases: [[usize; 4]; 7] = [
        [0, 0, 0, 0],
        [1, 0, 3, 2],
        [7, 7, 7, 7],
        [4097, 0, 1, 100_003],
        [1_000_003, 5, 0, 1],
        [1_500_007, 3, 0, 700_001],
        [0, 0, 1 << 20, 0],
    ];
    for (hosts, homogeneous) in layouts {
        let results = on_hosts(hosts, |t| {
            per_rank_cases
                .iter()
                .map(|bytes| {
                    let send = gather_input(t.rank(), bytes[t.rank()]);
                    let mut flat = vec![0u8; bytes.iter().sum()];
                    ring::allgatherv(t, &send, &mut flat, bytes).unwrap();
                    let hier = homogeneous.then(|| {
                        let mut hier = vec![0u8; bytes.iter().sum()];
                        ring::hierarchical::allgatherv(t.hosts().unwrap(), &send, &mut hier, bytes, &mut |_| {})
                            .unwrap();
                        hier
                    });
                    (flat, hier)
                })
                .collect::<Vec<_>>()
        });
        for (rank, cases) in results.iter().enumerate() {
            for (bytes, (flat, hier)) in per_rank_cases.iter().zip(cases) {
                let want = gathered(bytes);
                assert!(flat == &want, "{hosts:?} {bytes:?}: flat allgather wrong on rank {rank}");
                if let Some(hier) = hier {
                    assert!(hier == &want, "{hosts:?} {bytes:?}: hierarchical allgather wrong on rank {rank}");
                }
            }
        }
    }
}

#[test]
fn allgather_on_three_hosts_in_place_and_through_scratch_gathers_every_block() {
    // 3 hosts x 2 ranks, consecutive: large results are gathered in place (a cross ring of three, then a
    // local ring for each of the two other hosts); the same op below IN_PLACE_MIN_BYTES goes through scratch.
    use ring::hierarchical::{Step, IN_PLACE_MIN_BYTES};
    let hosts = [0, 0, 1, 1, 2, 2];
    let cases: [[usize; 6]; 3] = [[400_001, 0, 3, 350_000, 299_999, 17], [262_144; 6], [10, 0, 3, 4, 5, 6]];
    assert!(
        cases[0].iter().sum::<usize>() >= IN_PLACE_MIN_BYTES && cases[1].iter().sum::<usize>() >= IN_PLACE_MIN_BYTES
    );
    let results = on_hosts(&hosts, |t| {
        cases
            .iter()
            .map(|bytes| {
                let send = gather_input(t.rank(), bytes[t.rank()]);
                let mut out = vec![0xee; bytes.iter().sum()];
                let mut steps = Vec::new();
                ring::hierarchical::allgatherv(t.hosts().unwrap(), &send, &mut out, bytes, &mut |s| steps.push(s))
                    .unwrap();
                (out, steps)
            })
            .collect::<Vec<_>>()
    });
    use Step::*;
    for (rank, cases_seen) in results.iter().enumerate() {
        for (bytes, (out, steps)) in cases.iter().zip(cases_seen) {
            assert!(out == &gathered(bytes), "{bytes:?}: hierarchical allgather wrong on rank {rank}");
            assert_eq!(steps, &[LocalAllgather, CrossAllgather, LocalAllgather], "{bytes:?}, rank {rank}");
        }
    }
}

#[test]
fn broadcast_alltoall_and_reducescatter_across_hosts() {
    for hosts in [&TWO_BY_TWO, &ONE_PLUS_THREE, &INTERLEAVED] {
        let results = on_hosts(hosts, |t| {
            let me = t.rank();
            let mut out = Vec::new();
            for (root, len) in [(0, 7), (3, 4097), (2, 3 << 20)] {
                let mut buf = if me == root { gather_input(root, len) } else { vec![0; len] };
                ring::broadcast(t, &mut buf, root).unwrap();
                out.push(buf);
            }
            // Alltoall: rank r sends r + p + 1 bytes to rank p (and 70,001 more to the next rank).
            let size = |from: usize, to: usize| from + to + 1 + if to == (from + 1) % 4 { 70_001 } else { 0 };
            let send_bytes: Vec<usize> = (0..4).map(|p| size(me, p)).collect();
            let recv_bytes: Vec<usize> = (0..4).map(|p| size(p, me)).collect();
            let send: Vec<u8> = (0..4).flat_map(|p| vec![(10 * me + p) as u8; size(me, p)]).collect();
            let mut recv = vec![0; recv_bytes.iter().sum()];
            ring::alltoallv(t, &send, &send_bytes, &mut recv, &recv_bytes).unwrap();
            out.push(recv);
            let elems = [3usize, 0, 70_001, 5];
            let contribution = input(DataType::Int32, me, elems.iter().sum());
            let mut mine = vec![0u8; elems[me] * 4];
            ring::reducescatter(t, &contribution, &elems, DataType::Int32, Combine::Sum, 1.0, &mut mine).unwrap();
            out.push(mine);
            out
        });
        let full = expected(DataType::Int32, Combine::Sum, 4, 70_009);
        let offsets = [0usize, 3, 3, 70_004, 70_009];
        for (rank, out) in results.iter().enumerate() {
            for (i, (root, len)) in [(0, 7), (3, 4097), (2, 3 << 20)].into_iter().enumerate() {
                assert!(out[i] == gather_input(root, len), "{hosts:?} broadcast {i}: rank {rank}");
            }
            let size = |from: usize, to: usize| from + to + 1 + if to == (from + 1) % 4 { 70_001 } else { 0 };
            let want: Vec<u8> = (0..4).flat_map(|p| vec![(10 * p + rank) as u8; size(p, rank)]).collect();
            assert!(out[3] == want, "{hosts:?} alltoall: rank {rank}");
            assert!(out[4] == full[offsets[rank] * 4..offsets[rank + 1] * 4], "{hosts:?} reducescatter: rank {rank}");
        }
    }
}

#[test]
fn a_round_started_on_either_part_wakes_a_waiting_rank() {
    let barrier = Barrier::new(4);
    let seen = on_hosts(&TWO_BY_TWO, |t| {
        let waker = Waker::new().unwrap();
        // As the engine does: the waker also rings what the transport sleeps on.
        waker.set_doorbell(t.doorbell());
        let mut seen = Vec::new();
        // 0: nothing happens. 1: rank 1 (same host) sends. 2: rank 2 (other host) sends. 3: the waker rings.
        for phase in 0..4 {
            barrier.wait();
            if t.rank() == 0 {
                let started = Instant::now();
                let timeout = Duration::from_millis(if phase == 0 { 50 } else { 5_000 });
                let activity = std::thread::scope(|s| {
                    if phase == 3 {
                        // A submission from another thread while this one sleeps.
                        s.spawn(|| {
                            std::thread::sleep(Duration::from_millis(20));
                            waker.wake();
                        });
                    }
                    t.wait_for_activity(&waker, timeout).unwrap()
                });
                let from = [None, Some(1), Some(2), None][phase];
                if let Some(from) = from {
                    let mut byte = [0u8; 1];
                    t.recv(from, &mut byte).unwrap();
                }
                waker.drain();
                seen.push((activity, started.elapsed()));
            } else if (phase == 1 && t.rank() == 1) || (phase == 2 && t.rank() == 2) {
                std::thread::sleep(Duration::from_millis(20));
                t.send(0, &[7]).unwrap();
            }
        }
        // A rank that returns closes its transport, which rank 0 would see as activity: stay until it is done.
        barrier.wait();
        seen
    });
    let rank0 = &seen[0];
    assert_eq!(rank0[0].0, Activity::Idle);
    assert_eq!(rank0[1].0, Activity::Peer);
    assert_eq!(rank0[2].0, Activity::Peer);
    assert_eq!(rank0[3].0, Activity::Local);
    for (activity, took) in &rank0[1..] {
        assert!(*took < Duration::from_secs(2), "{activity:?} took {took:?}");
    }
}

#[test]
fn a_rank_that_leaves_fails_the_others_naming_a_rank() {
    let results = on_hosts(&TWO_BY_TWO, |t| {
        if t.rank() == 3 {
            t.close();
            return None;
        }
        let started = Instant::now();
        let mut buf = input(DataType::Float32, t.rank(), 300_001);
        let result = ring::allreduce(t, &mut buf, DataType::Float32, Combine::Sum);
        Some((result, started.elapsed()))
    });
    for (rank, result) in results.iter().enumerate().take(3) {
        let (result, took) = result.as_ref().unwrap();
        match result {
            Err(TransportError::PeerClosed { peer }) => assert!(*peer < 4 && *peer != rank, "rank {rank} named {peer}"),
            other => panic!("rank {rank}: expected a closed peer, got {other:?}"),
        }
        assert!(*took < Duration::from_secs(10), "rank {rank} took {took:?}");
    }
}

/// Deterministic values in [-1, 1) for Adasum, different per rank, salt and element.
fn adasum_values(rank: usize, salt: usize, len: usize) -> Vec<f64> {
    let mut state = 0x2545_f491_4f6c_dd1du64 ^ ((rank * 131 + salt) as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 11) as f64 / (1u64 << 52) as f64 - 1.0
        })
        .collect()
}

fn decode_float(dtype: DataType, bytes: &[u8]) -> Vec<f64> {
    bytes
        .chunks_exact(dtype.size())
        .map(|b| match dtype {
            DataType::Float16 => f16::from_ne_bytes([b[0], b[1]]).to_f64(),
            DataType::Bfloat16 => bf16::from_ne_bytes([b[0], b[1]]).to_f64(),
            DataType::Float32 => f64::from(f32::from_ne_bytes([b[0], b[1], b[2], b[3]])),
            _ => f64::from_ne_bytes(b.try_into().unwrap()),
        })
        .collect()
}

/// Adasum of two vectors tensor by tensor, from the formula (coefficient 1 below Horovod's threshold).
fn adasum_pair(a: &[f64], b: &[f64], counts: &[usize]) -> Vec<f64> {
    let mut out = Vec::new();
    let mut at = 0;
    for &count in counts {
        let (x, y) = (&a[at..at + count], &b[at..at + count]);
        let dot: f64 = x.iter().zip(y).map(|(p, q)| p * q).sum();
        let coeff = |v: &[f64]| {
            let norm2: f64 = v.iter().map(|p| p * p).sum();
            if norm2 >= f64::MIN_POSITIVE.sqrt() {
                1.0 - dot / (2.0 * norm2)
            } else {
                1.0
            }
        };
        let (ca, cb) = (coeff(x), coeff(y));
        out.extend(x.iter().zip(y).map(|(p, q)| ca * p + cb * q));
        at += count;
    }
    out
}

/// Hierarchical Adasum, written out: each host's average, then docs/adasum.md's order over the hosts
/// (hosts beyond the largest power of two fold into host `h - p`, then the halving-doubling tree).
fn hierarchical_adasum_reference(hosts: &[usize], inputs: &[Vec<f64>], counts: &[usize]) -> Vec<f64> {
    let host_count = hosts.iter().max().unwrap() + 1;
    let mut vectors: Vec<Vec<f64>> = (0..host_count)
        .map(|h| {
            let members: Vec<&Vec<f64>> = inputs.iter().zip(hosts).filter(|(_, &x)| x == h).map(|(v, _)| v).collect();
            let width = members.len() as f64;
            (0..inputs[0].len()).map(|i| members.iter().map(|v| v[i]).sum::<f64>() / width).collect()
        })
        .collect();
    let core = 1usize << host_count.ilog2();
    for extra in core..host_count {
        vectors[extra - core] = adasum_pair(&vectors[extra - core], &vectors[extra], counts);
    }
    let mut distance = 1;
    while distance < core {
        for base in (0..core).step_by(2 * distance) {
            vectors[base] = adasum_pair(&vectors[base], &vectors[base + distance], counts);
        }
        distance <<= 1;
    }
    vectors.swap_remove(0)
}

#[test]
fn hierarchical_adasum_is_adasum_across_hosts_of_host_averages() {
    // Fused buffers with an empty tensor, buffers smaller than a host (empty blocks), and a large one.
    let cases: [&[usize]; 4] = [&[7, 0, 1, 33, 2], &[1], &[3, 2], &[5000, 70_001]];
    let layouts: [&[usize]; 3] = [&TWO_BY_TWO, &INTERLEAVED, &[0, 0, 1, 1, 2, 2]];
    for hosts in layouts {
        let results = on_hosts(hosts, |t| {
            let mut out = Vec::new();
            for (salt, counts) in cases.iter().enumerate() {
                for (dtype, _) in ADASUM_TYPES {
                    let total: usize = counts.iter().sum();
                    let values = adasum_values(t.rank(), salt, total);
                    let mut buf: Vec<u8> = values.iter().flat_map(|&v| encode(dtype, v)).collect();
                    let parts = t.hosts().expect("a composite transport");
                    ring::adasum::adasum_allreduce_hierarchical(parts, &mut buf, dtype, counts, &mut Vec::new())
                        .unwrap();
                    out.push(buf);
                }
            }
            out
        });
        let mut case = 0;
        for (salt, counts) in cases.iter().enumerate() {
            for (dtype, tolerance) in ADASUM_TYPES {
                let total: usize = counts.iter().sum();
                let inputs: Vec<Vec<f64>> = (0..hosts.len())
                    .map(|r| {
                        let bytes: Vec<u8> =
                            adasum_values(r, salt, total).iter().flat_map(|&v| encode(dtype, v)).collect();
                        decode_float(dtype, &bytes)
                    })
                    .collect();
                let want = hierarchical_adasum_reference(hosts, &inputs, counts);
                for (rank, got) in results.iter().enumerate() {
                    assert!(
                        got[case] == results[0][case],
                        "{hosts:?} {dtype} {counts:?}: rank {rank} differs from rank 0"
                    );
                }
                let got = decode_float(dtype, &results[0][case]);
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    let ok = (g - w).abs() <= tolerance * (1.0 + w.abs());
                    assert!(ok, "{hosts:?} {dtype} {counts:?} element {i}: {g}, reference {w}");
                }
                case += 1;
            }
        }
    }
    let refused = on_hosts(&ONE_PLUS_THREE, |t| {
        let parts = t.hosts().unwrap();
        ring::adasum::adasum_allreduce_hierarchical(parts, &mut [0u8; 8], DataType::Float32, &[2], &mut Vec::new())
            .map_err(|e| e.to_string())
    });
    for err in refused {
        assert!(err.unwrap_err().contains("different numbers of ranks"));
    }
}

/// Float types Adasum takes, with the tolerance their rounding (host sum in the type) calls for.
const ADASUM_TYPES: [(DataType, f64); 4] =
    [(DataType::Float64, 1e-12), (DataType::Float32, 1e-5), (DataType::Float16, 2e-2), (DataType::Bfloat16, 1e-1)];

#[test]
fn hierarchical_steps_are_reported_in_the_order_they_end() {
    use ring::hierarchical::{Step, PIPELINE_PIECE_BYTES};
    let small = 64 << 10;
    let pipelined = 3 * PIPELINE_PIECE_BYTES;
    let seen = on_hosts(&TWO_BY_TWO, |t| {
        let mut steps = Vec::new();
        for len in [small, pipelined] {
            let mut buf = vec![0u8; len];
            let mut heard = Vec::new();
            ring::hierarchical::allreduce(t.hosts().unwrap(), &mut buf, DataType::Float32, Combine::Sum, &mut |s| {
                heard.push(s)
            })
            .unwrap();
            steps.push(heard);
        }
        let mut heard = Vec::new();
        let mut out = vec![0u8; 4 * 1024];
        ring::hierarchical::allgatherv(t.hosts().unwrap(), &[1u8; 1024], &mut out, &[1024; 4], &mut |s| heard.push(s))
            .unwrap();
        steps.push(heard);
        steps
    });
    use Step::*;
    for (rank, steps) in seen.into_iter().enumerate() {
        assert_eq!(steps[0], [LocalReduceScatter, CrossAllreduce, LocalAllgather], "rank {rank}, one piece");
        // Three pieces, at most two with the helper: RS RS RS, then each piece back (cross wait) and gathered.
        let three = [LocalReduceScatter, LocalReduceScatter, LocalReduceScatter, CrossAllreduce, LocalAllgather];
        assert_eq!(steps[1][..5], three, "rank {rank}, pipelined: {:?}", steps[1]);
        assert_eq!(steps[1][5..], [CrossAllreduce, LocalAllgather, CrossAllreduce, LocalAllgather], "rank {rank}");
        assert_eq!(steps[2], [LocalAllgather, CrossAllgather, LocalAllgather], "rank {rank}, allgather");
    }
}
