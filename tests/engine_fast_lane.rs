//! The fast lane (`engine::fast_lane`): small synchronous ops run by their callers as one exchange of round
//! headers. Values against the ordinary path, ranks on different paths in the same round, and the checks
//! the round still makes (mismatches, joins, a peer stopping).

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use common::*;
use rvod::coordinator::message_table::BARRIER_NAME;
use rvod::engine::fast_lane::{SmallOp, SmallOutcome};
use rvod::engine::submission::{OpSubmission, TensorSubmission};
use rvod::engine::Engine;
use rvod::error::EngineError;
use rvod::protocol::message::OpParams;
use rvod::tensor::RawTensor;
use rvod::types::{CollectiveKind, DataType, ReduceOp};

/// A small op on one rank: its tensor and settings.
#[derive(Clone)]
struct Small {
    kind: CollectiveKind,
    name: &'static str,
    dtype: DataType,
    data: Vec<u8>,
    in_place: bool,
    reduce_op: ReduceOp,
    prescale: f64,
    postscale: f64,
    /// Global rank of a broadcast's root; -1 otherwise.
    root: i32,
}

impl Small {
    fn allreduce(name: &'static str, values: &[f32]) -> Small {
        Small {
            kind: CollectiveKind::Allreduce,
            name,
            dtype: DataType::Float32,
            data: f32_bytes(values),
            in_place: false,
            reduce_op: ReduceOp::Sum,
            prescale: 1.0,
            postscale: 1.0,
            root: -1,
        }
    }

    fn broadcast(name: &'static str, values: &[f32], root: i32) -> Small {
        Small { kind: CollectiveKind::Broadcast, root, ..Small::allreduce(name, values) }
    }

    fn allgather(name: &'static str, values: &[f32]) -> Small {
        Small { kind: CollectiveKind::Allgather, ..Small::allreduce(name, values) }
    }

    fn barrier() -> Small {
        Small { kind: CollectiveKind::Barrier, name: BARRIER_NAME, data: Vec::new(), ..Small::allreduce("", &[]) }
    }

    fn shape(&self) -> Vec<i64> {
        match self.kind {
            CollectiveKind::Barrier => Vec::new(),
            _ => vec![(self.data.len() / self.dtype.size()) as i64],
        }
    }

    fn input(&mut self) -> RawTensor {
        // SAFETY: every caller keeps `self.data` alive and untouched until the op completes.
        unsafe { RawTensor::new(self.data.as_mut_ptr(), self.data.len()) }
    }

    fn submission(&mut self) -> OpSubmission {
        let mut sub = OpSubmission::new(self.kind);
        sub.params.reduce_op = self.reduce_op;
        sub.params.prescale = self.prescale;
        sub.params.postscale = self.postscale;
        sub.params.root_rank = self.root;
        if self.kind != CollectiveKind::Barrier {
            let (name, dtype, shape, in_place, input) =
                (self.name.to_string(), self.dtype, self.shape(), self.in_place, self.input());
            sub.tensors.push(TensorSubmission {
                name,
                dtype,
                shape,
                input,
                in_place,
                packed: None,
                device: None,
                into: None,
            });
        }
        sub
    }
}

/// How an op ran on one rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Path {
    FastLane,
    /// It went into the ordinary round after the headers showed more.
    Queued,
    /// The fast lane did not take it (not cached yet, or busy): submitted as usual.
    Ordinary,
}

/// Run `op` as `_rvod.run` does: the fast lane first, the ordinary path if it does not take it. Returns the
/// result bytes (the input's, in place) and the path.
fn run(engine: &Engine, op: &mut Small) -> (Result<Vec<u8>, EngineError>, Path) {
    let mut out = vec![0u8; op.data.len()];
    let params = OpParams {
        dtype: op.dtype,
        shape: op.shape(),
        reduce_op: op.reduce_op,
        prescale: op.prescale,
        postscale: op.postscale,
        root_rank: op.root,
        ..OpParams::new(op.kind)
    };
    let small = SmallOp { name: op.name, params, input: op.input(), in_place: op.in_place };
    let communicator = engine.fast_lane(0).expect("a member of the global set");
    let (handle, path) = match communicator.run_small(small, &mut out) {
        SmallOutcome::Done(result_len) => {
            out.truncate(result_len);
            let result = if op.in_place { op.data.clone() } else { out };
            return (Ok(result), Path::FastLane);
        }
        SmallOutcome::Failed(err) => return (Err(err), Path::FastLane),
        SmallOutcome::Queued(handle) => (handle, Path::Queued),
        SmallOutcome::NotRun(returned) => {
            assert_eq!(returned.params.root_rank, op.root, "NotRun hands the op back as it came");
            match engine.submit_to_drive(op.submission(), 0) {
                Ok((handle, communicator)) => {
                    communicator.drive(handle);
                    (handle, Path::Ordinary)
                }
                Err(err) => return (Err(err), Path::Ordinary),
            }
        }
    };
    let result = wait(engine, handle).map(|output| match output.tensors.first() {
        Some(Some(tensor)) => tensor.buffer.as_slice().to_vec(),
        _ => op.data.clone(),
    });
    (result, path)
}

/// The ordinary path alone, for comparison.
fn run_ordinarily(engine: &Engine, op: &mut Small) -> Result<Vec<u8>, EngineError> {
    let (handle, communicator) = engine.submit_to_drive(op.submission(), 0).unwrap();
    communicator.drive(handle);
    wait(engine, handle).map(|output| match output.tensors.first() {
        Some(Some(tensor)) => tensor.buffer.as_slice().to_vec(),
        _ => op.data.clone(),
    })
}

/// Each rank's ops of one lockstep step, from its rank and the step.
fn step_ops(rank: usize, step: usize) -> Vec<Small> {
    let r = rank as f32;
    let s = step as f32;
    let mut averaged = Small::allreduce("averaged", &[r + s, 0.5 * r, -r, 3.0]);
    averaged.reduce_op = ReduceOp::Average;
    averaged.prescale = 0.5;
    averaged.postscale = 3.0;
    let mut maximum = Small::allreduce("max", &[]);
    maximum.dtype = DataType::Int32;
    maximum.data = [rank as i32 * 7 - 5, -(rank as i32), step as i32].iter().flat_map(|v| v.to_ne_bytes()).collect();
    maximum.reduce_op = ReduceOp::Max;
    let mut in_place = Small::allreduce("in_place", &[r, s]);
    in_place.in_place = true;
    let mut half = Small::allreduce("half", &[]);
    half.dtype = DataType::Float16;
    half.data = [0.25 + r, s].iter().flat_map(|&v| half::f16::from_f32(v).to_ne_bytes()).collect();
    let mut broadcast_in_place = Small::broadcast("bcast_", &[r, s, 1.0], 1);
    broadcast_in_place.in_place = true;
    vec![
        averaged,
        maximum,
        in_place,
        half,
        Small::broadcast("bcast", &[r * 10.0 + s], 0),
        broadcast_in_place,
        Small::barrier(),
        Small::allgather("gathered", &[r, s, -1.5]),
        // As many rows as rank + 1: the headers differ in length, so the ordinary round completes it.
        Small::allgather("uneven", &vec![r * 10.0 + s; rank + 1]),
    ]
}

#[test]
fn steady_small_ops_take_the_fast_lane_and_give_the_ordinary_paths_bits() {
    for n in [2, 3] {
        let (engines, _server) = start_job(n, &[]);
        // The ordinary path first: it caches every op, and gives the expected results.
        let expected: Vec<Vec<Vec<u8>>> = on_every_rank(&engines, |rank, engine| {
            (0..20)
                .flat_map(|step| step_ops(rank, step))
                .map(|mut op| run_ordinarily(engine, &mut op).unwrap())
                .collect()
        });
        let (fast, fast_allgathers) = (AtomicUsize::new(0), AtomicUsize::new(0));
        let got: Vec<Vec<Vec<u8>>> = on_every_rank(&engines, |rank, engine| {
            (0..20)
                .flat_map(|step| step_ops(rank, step))
                .map(|mut op| {
                    let (result, path) = run(engine, &mut op);
                    if path == Path::FastLane {
                        fast.fetch_add(1, Ordering::Relaxed);
                        if op.kind == CollectiveKind::Allgather {
                            fast_allgathers.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    result.unwrap()
                })
                .collect()
        });
        let fast_allgathers = fast_allgathers.load(Ordering::Relaxed);
        assert!(fast_allgathers >= n * 10, "{n} ranks: only {fast_allgathers} allgathers took the fast lane");
        assert_eq!(got, expected, "{n} ranks: the fast lane's results are the ordinary path's, bit for bit");
        let ops = n * 20 * step_ops(0, 0).len();
        let fast = fast.load(Ordering::Relaxed);
        assert!(fast * 2 >= ops, "{n} ranks: only {fast} of {ops} ops took the fast lane");
        for rank in 1..n {
            // Every rank got the root's values from the broadcasts.
            assert_eq!(got[rank][4], got[0][4]);
            assert_eq!(as_f32(&got[rank][5]), vec![1.0, 0.0, 1.0]);
        }
        let per_step = step_ops(0, 0).len();
        for (rank, results) in got.iter().enumerate() {
            for step in [0, 19] {
                // Every rank's rows in rank order, also where the ranks have different numbers of rows.
                let s = step as f32;
                let gathered: Vec<f32> = (0..n).flat_map(|r| [r as f32, s, -1.5]).collect();
                assert_eq!(as_f32(&results[step * per_step + 7]), gathered, "{n} ranks, rank {rank}, step {step}");
                let uneven: Vec<f32> = (0..n).flat_map(|r| vec![r as f32 * 10.0 + s; r + 1]).collect();
                assert_eq!(as_f32(&results[step * per_step + 8]), uneven, "{n} ranks, rank {rank}, step {step}");
            }
        }
    }
}

#[test]
fn an_op_not_cached_yet_or_too_large_is_handed_back_unsent() {
    let (engines, _server) = start_job(2, &[]);
    on_every_rank(&engines, |rank, engine| {
        let mut first = Small::broadcast("first", &[rank as f32], 1);
        assert_eq!(run(engine, &mut first).1, Path::Ordinary, "not cached yet");
        assert_eq!(as_f32(&run(engine, &mut first).0.unwrap()), vec![1.0]);
        let mut large = Small::allreduce("large", &vec![1.0; 4097]);
        for _ in 0..3 {
            let (result, path) = run(engine, &mut large);
            assert_eq!(path, Path::Ordinary, "16,388 bytes do not ride in a header");
            assert_eq!(as_f32(&result.unwrap()), vec![2.0; 4097]);
        }
    });
}

#[test]
fn a_rank_on_the_ordinary_path_and_one_in_the_fast_lane_share_rounds() {
    let (engines, _server) = start_job(2, &[]);
    let paths = on_every_rank(&engines, |rank, engine| {
        run_ordinarily(engine, &mut Small::allreduce("mixed", &[0.0])).unwrap();
        let mut paths = Vec::new();
        for step in 0..40 {
            let name = format!("async{step}");
            let mut pending = vec![0u8; 4];
            // On even steps rank 1 has an asynchronous op in flight when it starts the small one (so the
            // fast lane does not take it, and its header says more than rank 0's); rank 0 submits its part
            // of that op only after the small one.
            let early = (rank == 1 && step % 2 == 0)
                .then(|| engine.submit(allreduce(&name, &mut pending, 1, ReduceOp::Sum), 0).unwrap());
            let (result, path) = run(engine, &mut Small::allreduce("mixed", &[rank as f32 + step as f32]));
            assert_eq!(as_f32(&result.unwrap()), vec![1.0 + 2.0 * step as f32], "rank {rank} step {step}");
            paths.push(path);
            if step % 2 == 0 {
                let id = match early {
                    Some(id) => id,
                    None => engine.submit(allreduce(&name, &mut pending, 1, ReduceOp::Sum), 0).unwrap(),
                };
                wait(engine, id).unwrap();
            }
        }
        paths
    });
    assert!(paths[1].iter().step_by(2).all(|&p| p == Path::Ordinary), "{:?}", paths[1]);
    assert!(paths[0].contains(&Path::Queued), "rank 0's fast lane never met rank 1's longer header: {:?}", paths[0]);
    assert!(paths[0].contains(&Path::FastLane), "{:?}", paths[0]);
}

#[test]
fn a_mismatch_is_reported_to_a_rank_in_the_fast_lane() {
    let (engines, _server) = start_job(2, &[]);
    // Rank 0 takes the fast lane only when its engine thread is not in a step at that moment, so the
    // scene is played under fresh names until rank 0 has met the mismatch from the fast lane; whichever
    // path it took, both ranks get the mismatch and the job goes on.
    let mut rank0_paths = Vec::new();
    for name in ["shape", "shape-2", "shape-3", "shape-4", "shape-5", "shape-6", "shape-7", "shape-8"] {
        let errors = on_every_rank(&engines, |rank, engine| {
            let mut op = Small::allreduce(name, &[1.0, 2.0]);
            run_ordinarily(engine, &mut op).unwrap();
            // Rank 0 hits the cache; rank 1 submits the name with another shape.
            let mut op = Small::allreduce(name, if rank == 0 { &[1.0, 2.0] } else { &[1.0, 2.0, 3.0] });
            let (result, path) = run(engine, &mut op);
            (result.unwrap_err(), path)
        });
        let (err, path) = &errors[0];
        assert_ne!(*path, Path::FastLane, "rank 0 completed an op rank 1 submitted with another shape");
        assert!(matches!(err, EngineError::Mismatch(_)), "{err:?}");
        assert!(err.to_string().contains("[2]") && err.to_string().contains("[3]"), "{err}");
        assert!(matches!(errors[1].0, EngineError::Mismatch(_)), "{:?}", errors[1].0);
        // The job goes on: the name is negotiated afresh.
        on_every_rank(&engines, |_, engine| {
            let mut op = Small::allreduce(name, &[1.0, 2.0]);
            assert_eq!(as_f32(&run(engine, &mut op).0.unwrap()), vec![2.0, 4.0]);
        });
        rank0_paths.push(*path);
        if *path == Path::Queued {
            break;
        }
    }
    assert!(
        rank0_paths.contains(&Path::Queued),
        "rank 0 never announced its hit and then met rank 1's invalid bit: {rank0_paths:?}"
    );
}

#[test]
fn a_joined_peer_contributes_zeros_to_a_fast_lane_allreduce() {
    let (engines, _server) = start_job(2, &[]);
    on_every_rank(&engines, |rank, engine| {
        let mut op = Small::allreduce("joined", &[1.0 + rank as f32]);
        run_ordinarily(engine, &mut op).unwrap();
        if rank == 1 {
            let id = engine.submit(OpSubmission::new(CollectiveKind::Join), 0).unwrap();
            let out = wait(engine, id).unwrap();
            assert_eq!(out.last_joined_rank, Some(0));
        } else {
            let (result, path) = run(engine, &mut Small::allreduce("joined", &[5.0]));
            assert_ne!(path, Path::FastLane, "rank 1's header says it joined");
            assert_eq!(as_f32(&result.unwrap()), vec![5.0]);
            let id = engine.submit(OpSubmission::new(CollectiveKind::Join), 0).unwrap();
            wait(engine, id).unwrap();
        }
    });
}

#[test]
fn a_peer_that_stops_fails_the_fast_lane_op_naming_it() {
    let (engines, _server) = start_job(2, &[]);
    on_every_rank(&engines, |_, engine| {
        run_ordinarily(engine, &mut Small::barrier()).unwrap();
    });
    std::thread::scope(|s| {
        s.spawn(|| {
            std::thread::sleep(Duration::from_millis(100));
            engines[1].shutdown(rvod::protocol::round::StopReason::Shutdown);
        });
        let (result, _) = run(&engines[0], &mut Small::barrier());
        let err = result.unwrap_err().to_string();
        assert!(err.contains("rank 1 called shutdown()"), "{err}");
    });
    // Later ops fail at once, and say why.
    let (result, _) = run(&engines[0], &mut Small::barrier());
    assert!(result.unwrap_err().to_string().contains("shut down"));
}
