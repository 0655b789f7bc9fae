//! Whole-engine tests: N engines as threads of one process, meeting through a real rendezvous server and
//! talking over shared memory and over TCP on loopback. They exercise negotiation, the response cache, fusion, join, mismatch
//! errors and shutdown without Python.

mod common;

use std::time::Duration;

use common::*;
use rvod::engine::handles::HandleId;
use rvod::engine::submission::OpSubmission;
use rvod::engine::Engine;
use rvod::error::EngineError;
use rvod::protocol::round::StopReason;
use rvod::types::{CollectiveKind, DataType, ReduceOp};

#[test]
fn many_async_allreduces_fuse_and_repeat_through_the_cache() {
    over_every_transport(|| {
        let (engines, _server) = start_job(3, &[]);
        for step in 0..3 {
            let results = on_every_rank(&engines, |rank, engine| {
                let mut buffers: Vec<Vec<u8>> =
                    (0..40).map(|i| f32_bytes(&vec![(rank + i + step) as f32; 1 + i * 37])).collect();
                let ids: Vec<HandleId> = buffers
                    .iter_mut()
                    .enumerate()
                    .map(|(i, b)| {
                        let len = (b.len() / 4) as i64;
                        engine.submit(allreduce(&format!("t{i}"), b, len, ReduceOp::Sum), 0).unwrap()
                    })
                    .collect();
                ids.into_iter().map(|id| wait(engine, id).unwrap()).collect::<Vec<_>>()
            });
            for outputs in results {
                for (i, out) in outputs.iter().enumerate() {
                    let t = out.tensors[0].as_ref().unwrap();
                    let expected = (0..3).map(|r| (r + i + step) as f32).sum::<f32>();
                    assert_eq!(as_f32(t.buffer.as_slice()), vec![expected; 1 + i * 37], "tensor {i} step {step}");
                }
            }
        }
    });
}

#[test]
fn average_min_max_and_scaling() {
    over_every_transport(|| {
        let (engines, _server) = start_job(2, &[]);
        for (op, expected) in
            [(ReduceOp::Average, 1.5f32), (ReduceOp::Min, 1.0), (ReduceOp::Max, 2.0), (ReduceOp::Product, 2.0)]
        {
            let outs = on_every_rank(&engines, |rank, engine| {
                let mut data = f32_bytes(&[(rank + 1) as f32; 5]);
                let id = engine.submit(allreduce("op", &mut data, 5, op), 0).unwrap();
                wait(engine, id).unwrap()
            });
            for out in outs {
                assert_eq!(as_f32(out.tensors[0].as_ref().unwrap().buffer.as_slice()), vec![expected; 5], "{op}");
            }
        }
        let outs = on_every_rank(&engines, |rank, engine| {
            let mut data = f32_bytes(&[(rank + 1) as f32; 3]);
            let mut sub = allreduce("scaled", &mut data, 3, ReduceOp::Sum);
            sub.params.prescale = 2.0;
            sub.params.postscale = 0.5;
            let id = engine.submit(sub, 0).unwrap();
            wait(engine, id).unwrap()
        });
        for out in outs {
            assert_eq!(as_f32(out.tensors[0].as_ref().unwrap().buffer.as_slice()), vec![3.0; 3]);
        }
    });
}

#[test]
fn mismatched_shapes_fail_on_every_rank_and_the_job_goes_on() {
    over_every_transport(|| {
        let (engines, _server) = start_job(2, &[]);
        let errors = on_every_rank(&engines, |rank, engine| {
            let len = 4 + rank as i64;
            let mut data = f32_bytes(&vec![1.0; len as usize]);
            let id = engine.submit(allreduce("bad", &mut data, len, ReduceOp::Sum), 0).unwrap();
            wait(engine, id).unwrap_err()
        });
        for err in errors {
            match err {
                EngineError::Mismatch(m) => {
                    assert!(m.contains("rank 0 sent [4]") && m.contains("rank 1 sent [5]"), "{m}")
                }
                other => panic!("expected a mismatch, got {other:?}"),
            }
        }
        let outs = on_every_rank(&engines, |_, engine| {
            let mut data = f32_bytes(&[1.0; 2]);
            let id = engine.submit(allreduce("good", &mut data, 2, ReduceOp::Sum), 0).unwrap();
            wait(engine, id).unwrap()
        });
        for out in outs {
            assert_eq!(as_f32(out.tensors[0].as_ref().unwrap().buffer.as_slice()), vec![2.0; 2]);
        }
    });
}

#[test]
fn a_joined_rank_contributes_zeros_and_join_returns_the_last_rank() {
    over_every_transport(|| {
        let (engines, _server) = start_job(3, &[]);
        let results = on_every_rank(&engines, |rank, engine| {
            let mut sums = Vec::new();
            if rank != 1 {
                // Rank 1 joins at once; ranks 0 and 2 reduce first: two fresh names, then one name three times
                // (cache hits, small enough to travel in the round headers, with rank 1 contributing zeros).
                for step in 0..5 {
                    let name = if step < 2 { format!("j{step}") } else { "j-repeated".to_string() };
                    let mut data = f32_bytes(&[(rank + 1) as f32; 4]);
                    let id = engine.submit(allreduce(&name, &mut data, 4, ReduceOp::Sum), 0).unwrap();
                    sums.push(as_f32(wait(engine, id).unwrap().tensors[0].as_ref().unwrap().buffer.as_slice()));
                }
                if rank == 2 {
                    std::thread::sleep(Duration::from_millis(200));
                }
            }
            let id = engine.submit(OpSubmission::new(CollectiveKind::Join), 0).unwrap();
            (sums, wait(engine, id).unwrap().last_joined_rank)
        });
        for (rank, (sums, last)) in results.into_iter().enumerate() {
            assert_eq!(last, Some(2), "rank {rank}");
            for sum in sums {
                assert_eq!(sum, vec![4.0; 4]);
            }
        }
    });
}

#[test]
fn collectives_other_than_allreduce_fail_at_once_while_a_rank_has_joined_even_from_the_cache() {
    over_every_transport(|| {
        let (engines, _server) = start_job(2, &[]);
        let gather = |engine: &Engine, name: &str| {
            let mut data = f32_bytes(&[1.0, 2.0]);
            let mut sub = OpSubmission::new(CollectiveKind::Allgather);
            sub.tensors.push(tensor(name, &mut data, DataType::Float32, vec![2]));
            wait(engine, engine.submit(sub, 0).unwrap())
        };
        for round in 0..2 {
            let results = on_every_rank(&engines, |rank, engine| {
                if rank == 0 {
                    // Twice, so the name is in the response cache when rank 1 joins.
                    for _ in 0..2 {
                        gather(engine, "cached").unwrap();
                    }
                    let start = std::time::Instant::now();
                    let errors = vec![gather(engine, "cached").unwrap_err(), gather(engine, "fresh").unwrap_err()];
                    assert!(start.elapsed() < Duration::from_secs(2), "round {round}: {:?}", start.elapsed());
                    let id = engine.submit(OpSubmission::new(CollectiveKind::Join), 0).unwrap();
                    (errors, wait(engine, id).unwrap().last_joined_rank)
                } else {
                    for _ in 0..2 {
                        gather(engine, "cached").unwrap();
                    }
                    let id = engine.submit(OpSubmission::new(CollectiveKind::Join), 0).unwrap();
                    (Vec::new(), wait(engine, id).unwrap().last_joined_rank)
                }
            });
            for err in &results[0].0 {
                let message = err.to_string();
                assert!(matches!(err, EngineError::Rejected(_)), "{err:?}");
                assert!(message.starts_with("Allgather is not supported with Join at this time."), "{message}");
                assert!(message.contains("rank 1 joined"), "{message}");
            }
            assert_eq!(results[0].1, Some(0), "rank 0 joined last");
            assert_eq!(results[1].1, Some(0));
        }
    });
}

#[test]
fn duplicate_names_in_flight_are_refused() {
    over_every_transport(|| {
        let (engines, _server) = start_job(2, &[]);
        let mut first = f32_bytes(&[1.0; 2]);
        let mut second = f32_bytes(&[1.0; 2]);
        let id = engines[0].submit(allreduce("same", &mut first, 2, ReduceOp::Sum), 0).unwrap();
        let err = engines[0].submit(allreduce("same", &mut second, 2, ReduceOp::Sum), 0).unwrap_err();
        assert!(matches!(err, EngineError::DuplicateName { .. }), "{err:?}");
        let mut other = f32_bytes(&[2.0; 2]);
        let peer = engines[1].submit(allreduce("same", &mut other, 2, ReduceOp::Sum), 0).unwrap();
        assert_eq!(as_f32(wait(&engines[0], id).unwrap().tensors[0].as_ref().unwrap().buffer.as_slice()), vec![3.0; 2]);
        wait(&engines[1], peer).unwrap();
    });
}

#[test]
fn shutdown_of_one_rank_fails_pending_ops_elsewhere_saying_why() {
    over_every_transport(|| {
        for (why, expected) in [
            (StopReason::Shutdown, "rank 0 called shutdown(); collectives cannot run after that"),
            (StopReason::Exiting, "rank 0 exited without calling shutdown()"),
        ] {
            let (engines, _server) = start_job(2, &[]);
            let mut data = f32_bytes(&[1.0; 2]);
            let id = engines[1].submit(allreduce("never", &mut data, 2, ReduceOp::Sum), 0).unwrap();
            engines[0].shutdown(why);
            match wait(&engines[1], id) {
                Err(EngineError::ShutDown(reason)) => {
                    assert!(reason.contains(expected), "{reason}");
                    assert!(!reason.contains("or finished"), "{reason}");
                }
                other => panic!("expected a shut-down error, got {other:?}"),
            }
            let mut more = f32_bytes(&[1.0; 2]);
            assert!(matches!(
                engines[1].submit(allreduce("later", &mut more, 2, ReduceOp::Sum), 0),
                Err(EngineError::ShutDown(_))
            ));
        }
    });
}

#[test]
fn broadcast_allgather_alltoall_reducescatter_and_barrier() {
    over_every_transport(|| {
        let (engines, _server) = start_job(3, &[]);
        let outs = on_every_rank(&engines, |rank, engine| {
            let mut results = Vec::new();
            let mut b = f32_bytes(&[rank as f32; 3]);
            let mut sub = OpSubmission::new(CollectiveKind::Broadcast);
            sub.params.root_rank = 2;
            sub.tensors.push(tensor("b", &mut b, DataType::Float32, vec![3]));
            results.push(wait(engine, engine.submit(sub, 0).unwrap()).unwrap());

            let rows = rank + 1;
            let mut g = f32_bytes(&vec![rank as f32; rows * 2]);
            let mut sub = OpSubmission::new(CollectiveKind::Allgather);
            sub.tensors.push(tensor("g", &mut g, DataType::Float32, vec![rows as i64, 2]));
            results.push(wait(engine, engine.submit(sub, 0).unwrap()).unwrap());

            let mut a = f32_bytes(&[rank as f32; 6]);
            let mut sub = OpSubmission::new(CollectiveKind::Alltoall);
            sub.params.splits = vec![1, 2, 3];
            sub.tensors.push(tensor("a", &mut a, DataType::Float32, vec![6]));
            results.push(wait(engine, engine.submit(sub, 0).unwrap()).unwrap());

            let mut rs = f32_bytes(&[1.0; 7]);
            let mut sub = OpSubmission::new(CollectiveKind::Reducescatter);
            sub.tensors.push(tensor("rs", &mut rs, DataType::Float32, vec![7]));
            results.push(wait(engine, engine.submit(sub, 0).unwrap()).unwrap());

            wait(engine, engine.submit(OpSubmission::new(CollectiveKind::Barrier), 0).unwrap()).unwrap();
            results
        });
        for (rank, results) in outs.iter().enumerate() {
            let data = |i: usize| as_f32(results[i].tensors[0].as_ref().unwrap().buffer.as_slice());
            assert_eq!(data(0), vec![2.0; 3]);
            assert_eq!(data(1), vec![0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0]);
            assert_eq!(results[1].tensors[0].as_ref().unwrap().shape, vec![6, 2]);
            assert_eq!(
                data(2),
                vec![0.0; rank + 1]
                    .into_iter()
                    .chain(vec![1.0; rank + 1])
                    .chain(vec![2.0; rank + 1])
                    .collect::<Vec<_>>()
            );
            assert_eq!(results[2].received_splits, Some(vec![(rank + 1) as i64; 3]));
            let rows = if rank == 0 { 3 } else { 2 };
            assert_eq!(data(3), vec![3.0; rows]);
        }
    });
}

#[test]
fn evictions_do_not_strand_pending_cache_hits() {
    over_every_transport(|| {
        // The cache holds exactly the 4 tensors of a step; one extra name per step (alternating) evicts the
        // least recently used, so the next step mixes a miss with hits. Rank 1 submits with small gaps, so hits
        // of rank 0 are still pending while the miss's response is put into the cache. Each step must complete
        // promptly (not after the stall check) with correct sums.
        let (engines, _server) = start_job(2, &[("RVOD_CACHE_CAPACITY", "4"), ("RVOD_STALL_CHECK_TIME_SECONDS", "20")]);
        for step in 0..8 {
            let started = std::time::Instant::now();
            let results = on_every_rank(&engines, |rank, engine| {
                let mut buffers: Vec<Vec<u8>> = (0..4).map(|i| f32_bytes(&[(rank + i) as f32; 8])).collect();
                let mut ids = Vec::new();
                for (i, b) in buffers.iter_mut().enumerate() {
                    if rank == 1 {
                        std::thread::sleep(Duration::from_micros(300));
                    }
                    ids.push(engine.submit(allreduce(&format!("t.{i}"), b, 8, ReduceOp::Sum), 0).unwrap());
                }
                let outputs: Vec<_> = ids.into_iter().map(|id| wait(engine, id).unwrap()).collect();
                let mut extra = f32_bytes(&[1.0]);
                let id =
                    engine.submit(allreduce(&format!("extra.{}", step % 2), &mut extra, 1, ReduceOp::Sum), 0).unwrap();
                wait(engine, id).unwrap();
                outputs
            });
            assert!(started.elapsed() < Duration::from_secs(5), "step {step} took {:?}", started.elapsed());
            for outputs in results {
                for (i, out) in outputs.iter().enumerate() {
                    let got = as_f32(out.tensors[0].as_ref().unwrap().buffer.as_slice());
                    assert_eq!(got, vec![(2 * i + 1) as f32; 8], "step {step} tensor {i}");
                }
            }
        }
    });
}

#[test]
fn values_set_by_hand_on_rank_0_apply_on_every_rank_after_the_same_round() {
    use rvod::protocol::tuned::RequestedValues;
    over_every_transport(|| {
        let (engines, _server) = start_job(2, &[]);
        let mine =
            RequestedValues { fusion_threshold: 1 << 20, cycle_time: Duration::from_micros(200), cache_enabled: false };
        let applied = on_every_rank(&engines, |rank, engine| {
            // Only rank 0's request counts; rank 1's differs to show it.
            let request =
                if rank == 0 { mine.clone() } else { RequestedValues { fusion_threshold: 7, ..mine.clone() } };
            assert!(engine.request_tuned_values(request));
            for step in 0..3 {
                let mut data = f32_bytes(&[rank as f32 + step as f32; 5]);
                let id = engine.submit(allreduce("x", &mut data, 5, ReduceOp::Sum), 0).unwrap();
                let out = wait(engine, id).unwrap();
                let got = as_f32(out.tensors[0].as_ref().unwrap().buffer.as_slice());
                assert_eq!(got, vec![1.0 + 2.0 * step as f32; 5], "rank {rank} step {step}");
            }
            engine.autotune_applied()
        });
        assert_eq!(applied[0], applied[1], "both ranks applied the same values after the same round");
        assert_eq!(applied[0].len(), 1, "{:?}", applied[0]);
        let values = &applied[0][0].values;
        assert_eq!(
            (values.fusion_threshold, values.cycle_time, values.cache_enabled),
            (1 << 20, mine.cycle_time, false)
        );
        assert_eq!((values.hierarchical_allreduce, values.hierarchical_allgather), (None, None));
        assert!(applied[0][0].round >= 1);
    });
}

#[test]
fn configured_algorithms_run_and_give_the_same_results() {
    over_every_transport(|| {
        let forced = [
            ("RVOD_ALLREDUCE_ALGORITHM", "rabenseifner"),
            ("RVOD_ALLGATHER_ALGORITHM", "bruck"),
            ("RVOD_BROADCAST_ALGORITHM", "chain"),
        ];
        let (engines, _server) = start_job(3, &forced);
        // Large enough not to ride in the round headers.
        let count = 30_001;
        let outs = on_every_rank(&engines, |rank, engine| {
            let mut results = Vec::new();
            let mut r = f32_bytes(&vec![rank as f32 + 1.0; count]);
            results.push(wait(engine, engine.submit(allreduce("r", &mut r, count as i64, ReduceOp::Sum), 0).unwrap()));
            let rows = (rank + 1) * 5_000;
            let mut g = f32_bytes(&vec![rank as f32; rows * 2]);
            let mut sub = OpSubmission::new(CollectiveKind::Allgather);
            sub.tensors.push(tensor("g", &mut g, DataType::Float32, vec![rows as i64, 2]));
            results.push(wait(engine, engine.submit(sub, 0).unwrap()));
            let mut b = f32_bytes(&vec![rank as f32; count]);
            let mut sub = OpSubmission::new(CollectiveKind::Broadcast);
            sub.params.root_rank = 1;
            sub.tensors.push(tensor("b", &mut b, DataType::Float32, vec![count as i64]));
            results.push(wait(engine, engine.submit(sub, 0).unwrap()));
            results.into_iter().map(|r| r.unwrap()).collect::<Vec<_>>()
        });
        for results in &outs {
            let data = |i: usize| as_f32(results[i].tensors[0].as_ref().unwrap().buffer.as_slice());
            assert_eq!(data(0), vec![6.0; count]);
            let gathered: Vec<f32> = (0..3).flat_map(|r| vec![r as f32; (r + 1) * 5_000 * 2]).collect();
            assert_eq!(data(1), gathered);
            assert_eq!(data(2), vec![1.0; count]);
        }
    });
}

#[test]
fn reducescatters_in_flight_together_fuse_and_give_each_rank_its_rows() {
    over_every_transport(|| {
        let (engines, _server) = start_job(3, &[]);
        // Tensors of 1..=8 rows of 3 elements (uneven splits, ranks without rows), submitted together so
        // that the engine fuses them; an average with both scale factors.
        let rows = |i: usize| i + 1;
        for step in 0..2 {
            let outs = on_every_rank(&engines, |rank, engine| {
                let mut buffers: Vec<Vec<u8>> = (0..8)
                    .map(|i| f32_bytes(&(0..rows(i) * 3).map(|e| (e + rank * 100 + i) as f32).collect::<Vec<_>>()))
                    .collect();
                let ids: Vec<HandleId> = buffers
                    .iter_mut()
                    .enumerate()
                    .map(|(i, b)| {
                        let mut sub = OpSubmission::new(CollectiveKind::Reducescatter);
                        sub.params.reduce_op = ReduceOp::Average;
                        sub.params.prescale = 2.0;
                        sub.params.postscale = 0.5;
                        sub.tensors.push(tensor(&format!("rs{i}"), b, DataType::Float32, vec![rows(i) as i64, 3]));
                        engine.submit(sub, 0).unwrap()
                    })
                    .collect();
                ids.into_iter().map(|id| wait(engine, id).unwrap()).collect::<Vec<_>>()
            });
            for (rank, results) in outs.iter().enumerate() {
                for (i, result) in results.iter().enumerate() {
                    let out = result.tensors[0].as_ref().unwrap();
                    let (n, size) = (rows(i), 3);
                    let mine = n / size + usize::from(rank < n % size);
                    let first = (0..rank).map(|r| n / size + usize::from(r < n % size)).sum::<usize>();
                    // Average of (e + 100 r + i) over r = 0, 1, 2, times 2 then 0.5: e + 100 + i.
                    let expected: Vec<f32> = (first * 3..(first + mine) * 3).map(|e| (e + 100 + i) as f32).collect();
                    assert_eq!(out.shape, vec![mine as i64, 3], "rank {rank} tensor {i} step {step}");
                    assert_eq!(as_f32(out.buffer.as_slice()), expected, "rank {rank} tensor {i} step {step}");
                }
            }
        }
    });
}
