//! The functions `rvod.common` calls: engine life cycle, topology, submit / poll / wait.
//!
//! The engine of this process lives here (one per process, replaced on re-init). Blocking work runs with
//! the GIL released; waits wake every few milliseconds to turn Ctrl-C into `KeyboardInterrupt`.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple};

use crate::config::Config;
use crate::engine::handles::WaitOutcome;
use crate::engine::packed::{pack_group, GroupMember};
use crate::engine::submission::{OpSubmission, TensorSubmission};
use crate::engine::Engine;
use crate::error::EngineError;
use crate::py::ndarray::import_array;
use crate::py::dlpack::{export_capsule, import_capsule, is_capsule, ImportedTensor};
use crate::py::error::to_py_err;
use crate::types::{CollectiveKind, ReduceOp};

/// How long one wait slice lasts before checking for signals.
const WAIT_SLICE: Duration = Duration::from_millis(50);

#[derive(Default)]
struct ProcessState {
    engine: Option<Arc<Engine>>,
    /// Number of inits so far; names the rendezvous scope of the next one.
    generation: u64,
}

static STATE: Mutex<ProcessState> = Mutex::new(ProcessState { engine: None, generation: 0 });

fn state() -> MutexGuard<'static, ProcessState> {
    STATE.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn engine() -> PyResult<Arc<Engine>> {
    state().engine.clone().ok_or_else(|| to_py_err(EngineError::NotInitialized))
}

fn init_logging(level: &str) {
    let filter = match level.to_ascii_lowercase().as_str() {
        "trace" => "trace",
        "debug" => "debug",
        "info" => "info",
        "error" | "fatal" => "error",
        _ => "warn",
    };
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(format!("rvod={filter}")))
        .with_writer(std::io::stderr)
        .with_target(false)
        .with_ansi(false)
        .try_init();
}

/// Start the engine (idempotent while running) and register `process_sets` (lists of global ranks, the
/// same on every rank). Waiting for the other ranks releases the GIL and can be interrupted with Ctrl-C.
#[pyfunction]
#[pyo3(signature = (process_sets=Vec::new()))]
pub fn init(py: Python<'_>, process_sets: Vec<Vec<usize>>) -> PyResult<()> {
    if state().engine.is_some() {
        return Ok(());
    }
    init_logging(&crate::config::log_level_from_env());
    let config = Config::from_env().map_err(|e| to_py_err(EngineError::Init(e.to_string())))?;
    let generation = {
        let mut state = state();
        state.generation += 1;
        state.generation - 1
    };
    let (done, mut started) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name("rvod-init".into())
        .spawn(move || {
            let _ = done.send(Engine::start(config, generation, &process_sets));
        })
        .map_err(|e| to_py_err(EngineError::Init(format!("cannot start the init thread: {e}"))))?;
    loop {
        // The receiver moves in and out because it may not be shared across threads.
        let (receiver, outcome) = py.allow_threads(move || {
            let outcome = started.recv_timeout(WAIT_SLICE);
            (started, outcome)
        });
        started = receiver;
        match outcome {
            Ok(result) => {
                let engine = result.map_err(to_py_err)?;
                state().engine = Some(Arc::new(engine));
                return Ok(());
            }
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => py.check_signals()?,
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                return Err(to_py_err(EngineError::Internal("the init thread stopped without an answer".into())))
            }
        }
    }
}

/// Stop the engine of this process; the other ranks stop too. Safe to call when not initialized.
#[pyfunction]
pub fn shutdown(py: Python<'_>) {
    py.allow_threads(|| {
        let engine = state().engine.take();
        if let Some(engine) = engine {
            engine.shutdown();
        }
    })
}

#[pyfunction]
pub fn is_initialized() -> bool {
    state().engine.is_some()
}

/// (rank, size, local_rank, local_size, cross_rank, cross_size, is_homogeneous)
#[pyfunction]
pub fn topology(py: Python<'_>) -> PyResult<Bound<'_, PyTuple>> {
    let engine = engine()?;
    let t = engine.topology();
    (t.rank, t.size, t.local_rank, t.local_size, t.cross_rank, t.cross_size, engine.is_homogeneous()).into_pyobject(py)
}

/// One input: a DLPack capsule, or an array (see `ndarray::import_array`).
fn import_input(object: &Bound<'_, PyAny>, in_place: bool, what: impl Fn() -> String) -> PyResult<ImportedTensor> {
    if is_capsule(object) {
        import_capsule(object, what)
    } else {
        import_array(object, in_place, what)
    }
}

/// Queue a collective; returns its handle. `capsules` are DLPack capsules, or C-contiguous arrays of
/// native byte order (exact `numpy.ndarray`s), which the caller keeps alive until the handle completes. With `packed` (a grouped allreduce), `names` holds the group's one name and the
/// tensors are packed into one per dtype (see `engine::packed`).
#[pyfunction]
#[pyo3(signature = (kind, names, capsules, in_place, reduce_op, prescale, postscale, root_rank, splits, process_set_id, packed=false))]
#[allow(clippy::too_many_arguments)]
pub fn submit(
    kind: u8,
    names: Vec<String>,
    capsules: Vec<Bound<'_, PyAny>>,
    in_place: bool,
    reduce_op: u8,
    prescale: f64,
    postscale: f64,
    root_rank: i32,
    splits: Vec<i64>,
    process_set_id: u32,
    packed: bool,
) -> PyResult<u64> {
    let kind = CollectiveKind::from_code(kind).ok_or_else(|| PyValueError::new_err(format!("unknown collective {kind}")))?;
    let reduce_op =
        ReduceOp::from_code(reduce_op).ok_or_else(|| PyValueError::new_err(format!("unknown reduce op {reduce_op}")))?;
    if packed {
        let (Some(name), true) = (names.first(), names.len() == 1 && kind == CollectiveKind::Allreduce) else {
            return Err(PyValueError::new_err("a packed submission is one allreduce group with one name"));
        };
        let mut members = Vec::with_capacity(capsules.len());
        for (i, capsule) in capsules.iter().enumerate() {
            let imported = import_input(capsule, in_place, || format!("{kind} '{name}_{i}'"))?;
            members.push(GroupMember { input: imported.tensor, dtype: imported.dtype, shape: imported.shape });
        }
        let tensors = pack_group(name, members, in_place);
        let op = OpSubmission { kind, tensors, reduce_op, prescale, postscale, root_rank, splits };
        return engine()?.submit(op, process_set_id).map_err(to_py_err);
    }
    if names.len() != capsules.len() {
        return Err(PyValueError::new_err("one name per tensor is required"));
    }
    let engine = engine()?;
    let mut tensors = Vec::with_capacity(capsules.len());
    for (name, capsule) in names.into_iter().zip(&capsules) {
        let imported = import_input(capsule, in_place, || format!("{kind} '{name}'"))?;
        tensors.push(TensorSubmission {
            name,
            dtype: imported.dtype,
            shape: imported.shape,
            input: imported.tensor,
            in_place,
            packed: None,
        });
    }
    let op = OpSubmission { kind, tensors, reduce_op, prescale, postscale, root_rank, splits };
    // Submitting never blocks (it queues and maybe wakes the engine), so the GIL is kept: releasing and
    // re-taking it would cost more than the call.
    engine.submit(op, process_set_id).map_err(to_py_err)
}

/// Register a process set at run time (every rank calls this, in the same order); returns its id.
#[pyfunction]
pub fn add_process_set(py: Python<'_>, ranks: Vec<usize>) -> PyResult<u32> {
    let engine = engine()?;
    py.allow_threads(|| engine.add_process_set(&ranks)).map_err(to_py_err)
}

/// Remove a process set (every rank calls this); false for the global set or an unknown id.
#[pyfunction]
pub fn remove_process_set(py: Python<'_>, process_set_id: u32) -> PyResult<bool> {
    let engine = engine()?;
    Ok(py.allow_threads(|| engine.remove_process_set(process_set_id)))
}

/// Every registered process set as (id, ranks).
/// What carries the bytes of a process set on this rank: "shm", "tcp" or "memory" (one-rank sets), or
/// None when this rank is not a member.
#[pyfunction]
#[pyo3(signature = (process_set_id=0))]
pub fn transport_kind(process_set_id: u32) -> PyResult<Option<&'static str>> {
    Ok(engine()?.transport_kind(process_set_id))
}

#[pyfunction]
pub fn process_sets() -> PyResult<Vec<(u32, Vec<usize>)>> {
    Ok(engine()?.process_sets())
}

/// True once the handle completed (its result is then ready for `wait`).
#[pyfunction]
pub fn poll(handle: u64) -> PyResult<bool> {
    engine()?
        .poll(handle)
        .ok_or_else(|| PyValueError::new_err(format!("unknown handle {handle}")))
}

/// Block until the handle completes (GIL released). Returns (outputs, received_splits, last_joined_rank):
/// one DLPack capsule per tensor, or None where the result was written in place.
#[pyfunction]
pub fn wait(py: Python<'_>, handle: u64) -> PyResult<Bound<'_, PyTuple>> {
    let engine = engine()?;
    loop {
        match py.allow_threads(|| engine.wait(handle, WAIT_SLICE)) {
            WaitOutcome::Pending => py.check_signals()?,
            WaitOutcome::Unknown => return Err(PyValueError::new_err(format!("unknown handle {handle}"))),
            WaitOutcome::Done(Err(e)) => return Err(to_py_err(e)),
            WaitOutcome::Done(Ok(output)) => {
                let outputs = PyList::empty(py);
                for tensor in output.tensors {
                    match tensor {
                        Some(t) => outputs.append(export_capsule(py, t.buffer, t.shape, t.dtype)?)?,
                        None => outputs.append(py.None())?,
                    }
                }
                return (outputs, output.received_splits, output.last_joined_rank).into_pyobject(py);
            }
        }
    }
}

/// What this build contains, for `rvodrun --check-build`.
#[pyfunction]
pub fn build_info(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let info = PyDict::new(py);
    info.set_item("version", env!("CARGO_PKG_VERSION"))?;
    info.set_item("transports", vec!["tcp"])?;
    info.set_item("nccl", false)?;
    Ok(info)
}

/// `hvd.start_timeline(file_path, mark_cycles)`: record into `file_path` (switching files if one is open).
#[pyfunction]
pub fn start_timeline(py: Python<'_>, file_path: String, mark_cycles: bool) -> PyResult<()> {
    let engine = engine()?;
    py.allow_threads(|| engine.start_timeline(&file_path, mark_cycles)).map_err(to_py_err)
}

/// `hvd.stop_timeline()`: close the current timeline file once everything recorded is in it.
#[pyfunction]
pub fn stop_timeline(py: Python<'_>) -> PyResult<()> {
    let engine = engine()?;
    py.allow_threads(|| engine.stop_timeline()).map_err(to_py_err)
}
