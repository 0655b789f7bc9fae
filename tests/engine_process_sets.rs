//! Process sets in the engine: collectives on subsets of ranks, each set negotiating on its own, so
//! disjoint sets run concurrently and one set's stall never blocks another.

mod common;

use std::time::{Duration, Instant};

use common::*;
use rvod::engine::submission::OpSubmission;
use rvod::error::EngineError;
use rvod::types::{CollectiveKind, DataType, ReduceOp};

#[test]
fn static_sets_get_ids_in_order_and_reduce_over_their_members_only() {
    over_every_transport(|| {
        let (engines, _server) = start_job_with_sets(4, &[], &[vec![0, 2], vec![3, 1]]);
        assert_eq!(engines[0].process_sets(), vec![(0, vec![0, 1, 2, 3]), (1, vec![0, 2]), (2, vec![1, 3])]);
        let results = on_every_rank(&engines, |rank, engine| {
            let set = if rank % 2 == 0 { 1 } else { 2 };
            let mut data = f32_bytes(&[rank as f32 + 1.0; 3]);
            let id = engine.submit(allreduce("x", &mut data, 3, ReduceOp::Average), set).unwrap();
            as_f32(wait(engine, id).unwrap().tensors[0].as_ref().unwrap().buffer.as_slice())
        });
        // Set 1 = ranks {0, 2}: values 1 and 3; set 2 = ranks {1, 3}: values 2 and 4. Average over the set.
        assert_eq!(results, vec![vec![2.0; 3], vec![3.0; 3], vec![2.0; 3], vec![3.0; 3]]);
    });
}

#[test]
fn a_rank_outside_the_set_is_refused_at_once() {
    over_every_transport(|| {
        let (engines, _server) = start_job_with_sets(3, &[], &[vec![0, 1]]);
        let mut data = f32_bytes(&[1.0]);
        let err = engines[2].submit(allreduce("x", &mut data, 1, ReduceOp::Sum), 1).unwrap_err();
        match err {
            EngineError::InvalidArgument(m) => assert!(m.contains("Rank 2 is not a member"), "{m}"),
            other => panic!("{other:?}"),
        }
        let err = engines[0].submit(allreduce("x", &mut data, 1, ReduceOp::Sum), 7).unwrap_err();
        assert!(matches!(err, EngineError::InvalidArgument(ref m) if m.contains("does not exist")), "{err:?}");
    });
}

#[test]
fn broadcast_root_is_a_global_rank_that_must_belong_to_the_set() {
    over_every_transport(|| {
        let (engines, _server) = start_job_with_sets(3, &[], &[vec![1, 2]]);
        let results = on_every_rank(&engines[1..], |i, engine| {
            let rank = i + 1;
            let mut data = f32_bytes(&[rank as f32; 2]);
            let mut sub = OpSubmission::new(CollectiveKind::Broadcast);
            sub.params.root_rank = 2;
            sub.tensors.push(tensor("b", &mut data, DataType::Float32, vec![2]));
            let id = engine.submit(sub, 1).unwrap();
            as_f32(wait(engine, id).unwrap().tensors[0].as_ref().unwrap().buffer.as_slice())
        });
        assert_eq!(results, vec![vec![2.0; 2], vec![2.0; 2]]);
        let mut data = f32_bytes(&[1.0]);
        let mut sub = OpSubmission::new(CollectiveKind::Broadcast);
        sub.params.root_rank = 0;
        sub.tensors.push(tensor("b", &mut data, DataType::Float32, vec![1]));
        assert!(matches!(engines[1].submit(sub, 1), Err(EngineError::InvalidArgument(_))));
    });
}

#[test]
fn disjoint_sets_run_concurrently_while_one_waits_for_a_sleeping_rank() {
    over_every_transport(|| {
        let (engines, _server) = start_job_with_sets(4, &[], &[vec![0, 1], vec![2, 3]]);
        let start = Instant::now();
        let finished = on_every_rank(&engines, |rank, engine| {
            let set = if rank < 2 { 1 } else { 2 };
            if rank == 3 {
                std::thread::sleep(Duration::from_millis(1500));
            }
            let mut data = f32_bytes(&[1.0; 4]);
            let id = engine.submit(allreduce("y", &mut data, 4, ReduceOp::Sum), set).unwrap();
            let out = wait(engine, id).unwrap();
            assert_eq!(as_f32(out.tensors[0].as_ref().unwrap().buffer.as_slice()), vec![2.0; 4]);
            start.elapsed()
        });
        assert!(finished[0] < Duration::from_millis(1000), "set 1 waited for set 2: {finished:?}");
        assert!(finished[3] >= Duration::from_millis(1500));
    });
}

#[test]
fn added_sets_can_be_removed_and_added_again_with_reused_ids() {
    over_every_transport(|| {
        let (engines, _server) = start_job(3, &[]);
        let ids = on_every_rank(&engines, |_, engine| engine.add_process_set(&[2, 0]).unwrap());
        assert_eq!(ids, vec![1, 1, 1]);
        let dup = engines[0].add_process_set(&[0, 2]).unwrap_err();
        assert!(matches!(dup, EngineError::InvalidArgument(ref m) if m.contains("duplicate")), "{dup:?}");
        let sums = on_every_rank(&engines, |rank, engine| {
            if rank == 1 {
                return None;
            }
            let mut data = f32_bytes(&[rank as f32]);
            let id = engine.submit(allreduce("z", &mut data, 1, ReduceOp::Sum), 1).unwrap();
            Some(as_f32(wait(engine, id).unwrap().tensors[0].as_ref().unwrap().buffer.as_slice()))
        });
        assert_eq!(sums, vec![Some(vec![2.0]), None, Some(vec![2.0])]);
        let removed = on_every_rank(&engines, |_, engine| engine.remove_process_set(1));
        assert_eq!(removed, vec![true, true, true]);
        assert!(!engines[0].remove_process_set(0));
        let mut data = f32_bytes(&[1.0]);
        assert!(engines[0].submit(allreduce("z", &mut data, 1, ReduceOp::Sum), 1).is_err());
        let ids = on_every_rank(&engines, |_, engine| engine.add_process_set(&[1, 2]).unwrap());
        assert_eq!(ids, vec![1, 1, 1]);
        let sums = on_every_rank(&engines, |rank, engine| {
            if rank == 0 {
                return None;
            }
            let mut data = f32_bytes(&[rank as f32]);
            let id = engine.submit(allreduce("z", &mut data, 1, ReduceOp::Sum), 1).unwrap();
            Some(as_f32(wait(engine, id).unwrap().tensors[0].as_ref().unwrap().buffer.as_slice()))
        });
        assert_eq!(sums, vec![None, Some(vec![3.0]), Some(vec![3.0])]);
    });
}

#[test]
fn an_op_pending_when_its_set_is_removed_fails_naming_the_removal() {
    over_every_transport(|| {
        let (engines, _server) = start_job(3, &[]);
        on_every_rank(&engines, |_, engine| engine.add_process_set(&[0, 2]).unwrap());
        // Rank 2 submits on set 1; rank 0 never does and removes the set instead.
        let mut data = f32_bytes(&[1.0; 4]);
        let id = engines[2].submit(allreduce("orphan", &mut data, 4, ReduceOp::Sum), 1).unwrap();
        let removed =
            on_every_rank(&engines, |rank, engine| if rank == 2 { true } else { engine.remove_process_set(1) });
        assert_eq!(removed, vec![true, true, true]);
        match wait(&engines[2], id) {
            Err(EngineError::ShutDown(reason)) => {
                assert!(
                    reason.contains("process set 1 (ranks [0, 2])") && reason.contains("remove_process_set()"),
                    "{reason}"
                );
                assert!(!reason.contains("called shutdown()"), "{reason}");
            }
            other => panic!("expected the removal to fail the op, got {other:?}"),
        }
        assert!(engines[2].remove_process_set(1));
    });
}

#[test]
fn mismatch_in_a_set_names_global_ranks() {
    over_every_transport(|| {
        let (engines, _server) = start_job_with_sets(3, &[], &[vec![1, 2]]);
        let errors = on_every_rank(&engines[1..], |i, engine| {
            let len = 2 + i as i64;
            let mut data = f32_bytes(&vec![1.0; len as usize]);
            let id = engine.submit(allreduce("m", &mut data, len, ReduceOp::Sum), 1).unwrap();
            wait(engine, id).unwrap_err()
        });
        for err in errors {
            match err {
                EngineError::Mismatch(m) => assert!(m.contains("rank 1 sent [2]; rank 2 sent [3]"), "{m}"),
                other => panic!("{other:?}"),
            }
        }
    });
}

#[test]
fn ranks_that_register_different_sets_all_fail_and_can_register_again() {
    over_every_transport(|| {
        let (engines, _server) = start_job(3, &[]);
        let errors = on_every_rank(&engines, |rank, engine| {
            let ranks: Vec<usize> = if rank == 2 { vec![1, 2] } else { vec![0, 1] };
            engine.add_process_set(&ranks).unwrap_err()
        });
        for err in errors {
            match err {
                EngineError::InvalidArgument(m) => {
                    assert!(m.contains("rank 0 registered [0, 1]") && m.contains("rank 2 registered [1, 2]"), "{m}")
                }
                other => panic!("{other:?}"),
            }
        }
        let ids = on_every_rank(&engines, |_, engine| engine.add_process_set(&[0, 1]).unwrap());
        assert_eq!(ids, vec![1, 1, 1]);
    });
}
