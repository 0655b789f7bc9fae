//! Adasum through the whole engine: N engines as threads of one process over shared memory and TCP.
//! Fused tensors keep their own coefficients, cached repeats give the same result, a joined rank counts
//! as a zero vector, and integer tensors are refused before anything is sent.

mod common;

use std::time::Duration;

use common::*;
use rvod::engine::handles::HandleId;
use rvod::engine::submission::OpSubmission;
use rvod::error::EngineError;
use rvod::types::{CollectiveKind, DataType, ReduceOp};

/// Per rank: a tensor equal on every rank (Adasum gives it back), one orthogonal across ranks (Adasum
/// adds them) and a mixed one, submitted together so that they fuse.
fn inputs(rank: usize, n: usize) -> Vec<Vec<f32>> {
    let parallel = vec![0.5, -1.0, 2.0, 3.0, 0.25];
    let orthogonal: Vec<f32> = (0..n).map(|i| if i == rank { (i + 1) as f32 } else { 0.0 }).collect();
    let mixed = vec![1.0, rank as f32];
    vec![parallel, orthogonal, mixed]
}

/// Adasum of two vectors (the formula, in f64).
fn pair(a: &[f64], b: &[f64]) -> Vec<f64> {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| x * y).sum();
    let coeff = |v: &[f64]| {
        let norm2: f64 = v.iter().map(|x| x * x).sum();
        if norm2 >= f64::MIN_POSITIVE.sqrt() {
            1.0 - dot / (2.0 * norm2)
        } else {
            1.0
        }
    };
    let (ca, cb) = (coeff(a), coeff(b));
    a.iter().zip(b).map(|(x, y)| ca * x + cb * y).collect()
}

#[test]
fn fused_adasum_keeps_per_tensor_coefficients_on_three_ranks() {
    over_every_transport(|| {
        let n = 3;
        let (engines, _server) = start_job(n, &[]);
        for step in 0..3 {
            // The same names every step: later steps run from the response cache.
            let results = on_every_rank(&engines, |rank, engine| {
                let mut buffers: Vec<Vec<u8>> = inputs(rank, n).iter().map(|v| f32_bytes(v)).collect();
                let ids: Vec<HandleId> = buffers
                    .iter_mut()
                    .enumerate()
                    .map(|(i, b)| {
                        let len = (b.len() / 4) as i64;
                        engine.submit(allreduce(&format!("ada{i}"), b, len, ReduceOp::Adasum), 0).unwrap()
                    })
                    .collect();
                ids.into_iter()
                    .map(|id| as_f32(wait(engine, id).unwrap().tensors[0].as_ref().unwrap().buffer.as_slice()))
                    .collect::<Vec<_>>()
            });
            let mixed: Vec<Vec<f64>> =
                (0..n).map(|r| inputs(r, n)[2].iter().map(|&x| f64::from(x)).collect()).collect();
            // Three ranks: rank 2 folds into rank 0 first, then (g0, g2) meets g1.
            let want_mixed = pair(&pair(&mixed[0], &mixed[2]), &mixed[1]);
            for outputs in &results {
                assert_eq!(outputs, &results[0], "every rank gets the same bits (step {step})");
                assert_eq!(outputs[0], inputs(0, n)[0], "equal vectors stay (step {step})");
                assert_eq!(outputs[1], vec![1.0, 2.0, 3.0], "orthogonal vectors add (step {step})");
                for (got, want) in outputs[2].iter().zip(&want_mixed) {
                    assert!((f64::from(*got) - want).abs() < 1e-6, "step {step}: {got} vs {want}");
                }
            }
        }
    });
}

#[test]
fn a_joined_rank_is_a_zero_vector() {
    over_every_transport(|| {
        let (engines, _server) = start_job(3, &[]);
        let results = on_every_rank(&engines, |rank, engine| {
            let mut out = None;
            if rank != 1 {
                let mut data = f32_bytes(&[1.0 + rank as f32, 2.0]);
                let id = engine.submit(allreduce("joined", &mut data, 2, ReduceOp::Adasum), 0).unwrap();
                out = Some(as_f32(wait(engine, id).unwrap().tensors[0].as_ref().unwrap().buffer.as_slice()));
                if rank == 2 {
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
            let id = engine.submit(OpSubmission::new(CollectiveKind::Join), 0).unwrap();
            wait(engine, id).unwrap();
            out
        });
        let want: Vec<f32> = pair(&[1.0, 2.0], &[3.0, 2.0]).into_iter().map(|x| x as f32).collect();
        assert_eq!(results[0].as_ref(), Some(&want));
        assert_eq!(results[2].as_ref(), Some(&want));
    });
}

#[test]
fn integer_tensors_are_refused_with_their_name() {
    let (engines, _server) = start_job(1, &[]);
    let mut data = vec![0u8; 8];
    let mut sub = OpSubmission::new(CollectiveKind::Allreduce);
    sub.params.reduce_op = ReduceOp::Adasum;
    sub.tensors.push(tensor("counts", &mut data, DataType::Int32, vec![2]));
    match engines[0].submit(sub, 0) {
        Err(EngineError::InvalidArgument(message)) => {
            assert!(
                message.contains("Adasum") && message.contains("'counts'") && message.contains("int32"),
                "{message}"
            );
        }
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
}
