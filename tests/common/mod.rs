//! Helpers for whole-engine tests: N engines as threads of one process, meeting through a real
//! rendezvous server and talking over shared memory or TCP on loopback ([`over_every_transport`]).
#![allow(dead_code)]

use std::cell::Cell;
use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr};
use std::time::Duration;

use half::{bf16, f16};
use rvod::config::Config;
use rvod::engine::handles::{HandleId, WaitOutcome};
use rvod::engine::submission::{OpOutput, OpSubmission, TensorSubmission};
use rvod::engine::Engine;
use rvod::error::EngineError;
use rvod::tensor::RawTensor;
use rvod::transport::rendezvous::RendezvousServer;
use rvod::types::{CollectiveKind, DataType, ReduceOp};

pub const SECRET: &[u8] = b"engine-test-secret";

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

thread_local! {
    /// The transport jobs started by this thread use: "shm" or "tcp".
    static TRANSPORT: Cell<&'static str> = const { Cell::new("shm") };
}

/// Run `test` once with jobs over shared memory and once over TCP (`RVOD_SHM=0`).
pub fn over_every_transport(test: impl Fn()) {
    for kind in ["shm", "tcp"] {
        TRANSPORT.with(|t| t.set(kind));
        test();
    }
}

/// Start `n` engines (one per rank) with extra settings; returns them in rank order and the server.
pub fn start_job(n: usize, extra: &[(&str, &str)]) -> (Vec<Engine>, RendezvousServer) {
    start_job_with_sets(n, extra, &[])
}

/// Like `start_job`, registering `sets` at start-up.
pub fn start_job_with_sets(n: usize, extra: &[(&str, &str)], sets: &[Vec<usize>]) -> (Vec<Engine>, RendezvousServer) {
    let server = RendezvousServer::start(IpAddr::V4(Ipv4Addr::LOCALHOST), 0, SECRET.to_vec()).unwrap();
    let port = server.port().to_string();
    let handles: Vec<_> = (0..n)
        .map(|rank| {
            let mut vars: HashMap<String, String> = HashMap::new();
            for (k, v) in [
                ("RVOD_RANK", rank.to_string()),
                ("RVOD_SIZE", n.to_string()),
                ("RVOD_LOCAL_RANK", rank.to_string()),
                ("RVOD_LOCAL_SIZE", n.to_string()),
                ("RVOD_RENDEZVOUS_ADDR", "127.0.0.1".to_string()),
                ("RVOD_RENDEZVOUS_PORT", port.clone()),
                ("RVOD_SECRET", hex(SECRET)),
                ("RVOD_TIMEOUT", "20".to_string()),
                ("RVOD_SHM", if TRANSPORT.with(Cell::get) == "shm" { "1" } else { "0" }.to_string()),
            ] {
                vars.insert(k.to_string(), v);
            }
            for (k, v) in extra {
                vars.insert(k.to_string(), v.to_string());
            }
            let sets = sets.to_vec();
            std::thread::spawn(move || {
                let config = Config::from_lookup(|k| vars.get(k).cloned(), None).unwrap();
                Engine::start(config, 0, &sets).unwrap()
            })
        })
        .collect();
    let engines: Vec<Engine> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    if n > 1 && !extra.iter().any(|(k, _)| *k == "RVOD_SHM") {
        let want = TRANSPORT.with(Cell::get);
        for engine in &engines {
            assert_eq!(engine.transport_kind(0), Some(want), "the job should run over {want}");
        }
    }
    (engines, server)
}

pub fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

pub fn as_f32(bytes: &[u8]) -> Vec<f32> {
    bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

pub fn tensor(name: &str, data: &mut Vec<u8>, dtype: DataType, shape: Vec<i64>) -> TensorSubmission {
    // SAFETY: every test keeps `data` alive and untouched until the handle completes.
    let input = unsafe { RawTensor::new(data.as_mut_ptr(), data.len()) };
    TensorSubmission {
        name: name.to_string(),
        dtype,
        shape,
        input,
        in_place: false,
        packed: None,
        device: None,
        into: None,
    }
}

pub fn wait(engine: &Engine, id: HandleId) -> Result<OpOutput, EngineError> {
    match engine.wait(id, Duration::from_secs(30)) {
        WaitOutcome::Done(result) => result,
        WaitOutcome::Pending => panic!("handle {id} did not complete within 30 s"),
        WaitOutcome::Unknown => panic!("unknown handle {id}"),
    }
}

pub fn allreduce(name: &str, data: &mut Vec<u8>, len: i64, op: ReduceOp) -> OpSubmission {
    let mut sub = OpSubmission::new(CollectiveKind::Allreduce);
    sub.params.reduce_op = op;
    sub.tensors.push(tensor(name, data, DataType::Float32, vec![len]));
    sub
}

/// Run `per_rank(rank, engine)` on every engine at once.
pub fn on_every_rank<T: Send>(engines: &[Engine], per_rank: impl Fn(usize, &Engine) -> T + Sync) -> Vec<T> {
    std::thread::scope(|s| {
        let handles: Vec<_> = engines
            .iter()
            .enumerate()
            .map(|(r, e)| {
                s.spawn({
                    let per_rank = &per_rank;
                    move || per_rank(r, e)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// `value` (an integer, or a signed zero) in `dtype`'s encoding; integers wrap like the kernels' Sum and Product.
pub fn encode(dtype: DataType, value: f64) -> Vec<u8> {
    let integer = value as i64;
    match dtype {
        DataType::Uint8 => vec![integer as u8],
        DataType::Uint16 => (integer as u16).to_ne_bytes().to_vec(),
        DataType::Int8 => vec![integer as i8 as u8],
        DataType::Int16 => (integer as i16).to_ne_bytes().to_vec(),
        DataType::Int32 => (integer as i32).to_ne_bytes().to_vec(),
        DataType::Int64 => integer.to_ne_bytes().to_vec(),
        DataType::Float16 => f16::from_f64(value).to_ne_bytes().to_vec(),
        DataType::Bfloat16 => bf16::from_f64(value).to_ne_bytes().to_vec(),
        DataType::Float32 => (value as f32).to_ne_bytes().to_vec(),
        DataType::Float64 => value.to_ne_bytes().to_vec(),
        DataType::Bool => vec![u8::from(value != 0.0)],
    }
}
