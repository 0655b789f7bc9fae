//! Synchronous ops run on the caller's thread where the transport allows it (`engine::driver`): values,
//! hand-offs to the engine thread when a peer is late or the loop is busy, and TCP's engine-thread-only path.

mod common;

use std::time::Duration;

use common::*;
use rvod::engine::Engine;
use rvod::types::ReduceOp;

/// Submit an allreduce the way a synchronous Python op does (queued without waking the engine thread, then
/// driven by the caller) and wait for it.
fn sync_allreduce(engine: &Engine, name: &str, values: &[f32]) -> Vec<f32> {
    let mut data = f32_bytes(values);
    let (id, communicator) =
        engine.submit_to_drive(allreduce(name, &mut data, values.len() as i64, ReduceOp::Sum), 0).unwrap();
    communicator.drive(id);
    let out = wait(engine, id).unwrap();
    as_f32(out.tensors[0].as_ref().unwrap().buffer.as_slice())
}

#[test]
fn lockstep_small_ops_run_on_the_callers_threads_with_the_right_values() {
    let (engines, _server) = start_job(2, &[]);
    on_every_rank(&engines, |rank, engine| {
        for step in 0..300 {
            let got = sync_allreduce(engine, "small", &[rank as f32 + step as f32, 1.0]);
            assert_eq!(got, vec![1.0 + 2.0 * step as f32, 2.0], "rank {rank} step {step}");
        }
    });
    for (rank, engine) in engines.iter().enumerate() {
        let by_callers = engine.caller_rounds(0).unwrap();
        assert!(by_callers >= 150, "rank {rank}: callers ran only {by_callers} of ~300 rounds");
    }
}

#[test]
fn a_late_peer_and_a_busy_loop_hand_the_op_to_whoever_runs_next() {
    let (engines, _server) = start_job(2, &[]);
    on_every_rank(&engines, |rank, engine| {
        for step in 0..5 {
            if rank == 1 {
                std::thread::sleep(Duration::from_millis(if step % 2 == 0 { 150 } else { 1 }));
            }
            assert_eq!(sync_allreduce(engine, "late", &[1.0, step as f32]), vec![2.0, 2.0 * step as f32]);
        }
        // Async ops from another thread keep the engine thread busy while this one waits synchronously.
        std::thread::scope(|s| {
            let burst = s.spawn(|| {
                let mut buffers: Vec<Vec<u8>> = (0..64).map(|i| f32_bytes(&[i as f32; 16])).collect();
                let ids: Vec<_> = buffers
                    .iter_mut()
                    .enumerate()
                    .map(|(i, b)| engine.submit(allreduce(&format!("burst{i}"), b, 16, ReduceOp::Sum), 0).unwrap())
                    .collect();
                for (i, id) in ids.into_iter().enumerate() {
                    let out = wait(engine, id).unwrap();
                    assert_eq!(as_f32(out.tensors[0].as_ref().unwrap().buffer.as_slice()), vec![2.0 * i as f32; 16]);
                }
            });
            for step in 0..20 {
                assert_eq!(sync_allreduce(engine, "mixed", &[step as f32]), vec![2.0 * step as f32]);
            }
            burst.join().unwrap();
        });
    });
}

#[test]
fn over_tcp_the_engine_thread_runs_every_op() {
    over_every_transport(|| {
        let (engines, _server) = start_job(2, &[]);
        let tcp = engines[0].transport_kind(0) == Some("tcp");
        on_every_rank(&engines, |_, engine| {
            for step in 0..20 {
                assert_eq!(sync_allreduce(engine, "t", &[step as f32]), vec![2.0 * step as f32]);
            }
        });
        if tcp {
            assert_eq!(engines[0].caller_rounds(0), Some(0), "callers may not run the loop over TCP");
        }
    });
}

#[test]
fn a_peer_that_shuts_down_while_a_caller_drives_fails_its_op() {
    let (engines, _server) = start_job(2, &[]);
    let mut data = f32_bytes(&[1.0; 2]);
    let (id, communicator) = engines[1].submit_to_drive(allreduce("never", &mut data, 2, ReduceOp::Sum), 0).unwrap();
    communicator.drive(id);
    std::thread::scope(|s| {
        s.spawn(|| {
            std::thread::sleep(Duration::from_millis(100));
            engines[0].shutdown(rvod::protocol::round::StopReason::Shutdown);
        });
        let err = wait(&engines[1], id).unwrap_err().to_string();
        assert!(err.contains("rank 0 called shutdown()"), "{err}");
    });
}
