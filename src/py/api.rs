//! The functions `rvod.common` calls: engine life cycle, topology, submit / poll / wait.
//!
//! The engine of this process lives here (one per process, replaced on re-init). Blocking work runs through
//! `py::detached` (GIL released; waits turn Ctrl-C into `KeyboardInterrupt`).

use std::cell::RefCell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyString, PyTuple};
use pyo3::IntoPyObjectExt;

use crate::coordinator::message_table::BARRIER_NAME;
use crate::coordinator::negotiation::EAGER_TENSOR_BYTES;
use crate::engine::fast_lane::SmallOp;
use crate::engine::handles::WaitOutcome;
use crate::engine::small_op::SmallRun;
use crate::engine::submission::{OpOutput, OpSubmission, TensorSubmission};
use crate::engine::{fork, Engine};
use crate::error::EngineError;
use crate::fusion::packed_group::GroupMember;
use crate::gpu::device::Device;
use crate::launch::meet::{self, HostedStore, Offer};
use crate::protocol::message::OpParams;
use crate::protocol::round::StopReason;
use crate::py::detached::{detached, detached_once, Detached};
use crate::py::dlpack::{export_capsule, export_device_capsule, import_capsule, is_capsule, ImportedTensor};
use crate::py::error::{invalid_argument, to_py_err};
use crate::py::ndarray::{empty_like, empty_shaped, import_array};
use crate::tensor::RawTensor;
use crate::types::{CollectiveKind, Compression, DataType, ReduceOp};

#[derive(Default)]
struct ProcessState {
    engine: Option<Arc<Engine>>,
    /// Rank 0's rendezvous store in a job a launcher (not rvodrun) started; lives as long as the engine.
    hosted: Option<HostedStore>,
    /// Number of inits so far; names the rendezvous scope of the next one.
    generation: u64,
}

static STATE: Mutex<ProcessState> = Mutex::new(ProcessState { engine: None, hosted: None, generation: 0 });

fn state() -> MutexGuard<'static, ProcessState> {
    STATE.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn engine() -> PyResult<Arc<Engine>> {
    refuse_if_forked()?;
    state().engine.clone().ok_or_else(|| to_py_err(EngineError::NotInitialized))
}

/// Bumped (under the state's lock) whenever the engine is set or taken, so that a thread's cached handle
/// on it (see [`with_engine`]) knows it is stale.
static ENGINE_EPOCH: AtomicU64 = AtomicU64::new(0);

thread_local! {
    /// The engine this thread last used, and the epoch it was current in.
    static ENGINE_SEEN: RefCell<Option<(u64, Arc<Engine>)>> = const { RefCell::new(None) };
}

/// Call `f` with the engine, as [`engine`] finds it, without the process-wide lock while the engine has
/// not changed since this thread last used it (the path of every small op).
fn with_engine<R>(f: impl FnOnce(&Arc<Engine>) -> PyResult<R>) -> PyResult<R> {
    refuse_if_forked()?;
    let epoch = ENGINE_EPOCH.load(Ordering::Acquire);
    ENGINE_SEEN.with(|seen| {
        let Ok(mut seen) = seen.try_borrow_mut() else {
            return f(&engine()?); // re-entered while in use on this thread: the plain way
        };
        if !matches!(&*seen, Some((at, _)) if *at == epoch) {
            *seen = None;
            *seen = Some((epoch, engine()?));
        }
        match &*seen {
            Some((_, engine)) => f(engine),
            None => Err(to_py_err(EngineError::NotInitialized)),
        }
    })
}

/// In a process forked from a running rank, every use of the job is refused (see `engine::fork`).
fn refuse_if_forked() -> PyResult<()> {
    match fork::forked_from() {
        Some((rank, parent, child)) => Err(to_py_err(EngineError::Forked { rank, parent, child })),
        None => Ok(()),
    }
}

/// Send the engine's log lines (at the level RVOD_LOG_LEVEL / HOROVOD_LOG_LEVEL asks) to stderr; once per process.
pub(crate) fn init_logging(level: &str, hide_time: bool) {
    let filter = match level.to_ascii_lowercase().as_str() {
        "trace" => "trace",
        "debug" => "debug",
        "info" => "info",
        "error" | "fatal" => "error",
        _ => "warn",
    };
    let builder = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(format!("rvod={filter}")))
        .with_writer(std::io::stderr)
        .with_target(false)
        .with_ansi(false);
    let _ = if hide_time { builder.without_time().try_init() } else { builder.try_init() };
}

/// `(launcher, rank, size)` when a launcher other than rvodrun started this multi-rank job (launcher is
/// `"openmpi"`, `"pmi"`, `"torchrun"` or `"slurm"`), else None (also when the configuration does not read:
/// `init` reports that).
#[pyfunction]
pub fn launcher() -> Option<(&'static str, usize, usize)> {
    let config = crate::launch::config_from_env().ok()?;
    let launcher = meet::launcher(&config)?;
    Some((launcher.id(), config.topology.rank, config.topology.size))
}

/// Start the engine (idempotent while running) and register `process_sets` (lists of global ranks, the
/// same on every rank); `dynamic_process_sets` turns dynamic process sets on whatever the environment says.
/// Waiting for the other ranks releases the GIL and can be interrupted with Ctrl-C.
/// `mpi` is `(rank, size, bcast)` from an mpi4py communicator: rank and size in it, and its `bcast`, over
/// which rank 0 sends the others its rendezvous store's address and the job's secret.
#[pyfunction]
#[pyo3(signature = (process_sets=Vec::new(), mpi=None, dynamic_process_sets=false))]
pub fn init(
    py: Python<'_>,
    process_sets: Vec<Vec<usize>>,
    mpi: Option<(usize, usize, PyObject)>,
    dynamic_process_sets: bool,
) -> PyResult<()> {
    refuse_if_forked()?;
    if state().engine.is_some() {
        return Ok(());
    }
    init_logging(&crate::config::log_level_from_env(), crate::config::log_hide_time_from_env());
    let mut config = crate::launch::config_from_env().map_err(|e| to_py_err(EngineError::Config(e.to_string())))?;
    config.dynamic_process_sets |= dynamic_process_sets;
    let bcast = match mpi {
        Some((rank, size, bcast)) => {
            config = crate::launch::for_communicator(config, rank, size).map_err(to_py_err)?;
            config.launch.is_some().then_some(bcast)
        }
        None => None,
    };
    let served = meet::serve(&config, bcast.is_some());
    let offer = match bcast {
        Some(bcast) => {
            // Rank 0 sends its offer, or why it has none, so the other ranks never wait in vain.
            let payload = match (&served, config.topology.rank) {
                (Ok((_, Some(offer))), _) => Some(offer.encode()),
                (Err(error), 0) => Some(Offer::failure(error)),
                _ => None,
            };
            let received: Vec<u8> = bcast.call1(py, (payload.map(|p| PyBytes::new(py, &p)),))?.extract(py)?;
            let offer = Offer::decode(&received);
            served.as_ref().map_err(|e| to_py_err(e.clone()))?;
            Some(offer.map_err(to_py_err)?)
        }
        None => None,
    };
    let (hosted, _) = served.map_err(to_py_err)?;
    // The generation names the rendezvous scope; it is used up only once every rank has met in it (see
    // `Engine::meet`). An init that failed before (a bad setting, a store address that does not resolve, a
    // rank that never came) keeps it: every rank meets again in the same scope on re-init, whichever of
    // them failed and however. An elastic job's ranks meet in the round its driver assigned (ranks started
    // later have had fewer inits).
    let generation = config.elastic_round.unwrap_or(state().generation);
    let (done, started) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name("rvod-init".into())
        .spawn(move || {
            let met = meet::meet(config, generation, hosted.as_ref(), offer)
                .and_then(|config| Engine::meet(config, generation));
            let used_generation = met.is_ok();
            let started = met.and_then(|meeting| meeting.start(&process_sets));
            let _ = done.send((started.map(|engine| (engine, hosted)), used_generation));
        })
        .map_err(|e| to_py_err(EngineError::Init(format!("cannot start the init thread: {e}"))))?;
    // The receiver moves into the wait because it may not be shared across threads.
    let outcome = detached(py, move |slice| match started.recv_timeout(slice) {
        Ok(outcome) => Some(Some(outcome)),
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => None,
        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => Some(None),
    })?;
    let Some((result, used_generation)) = outcome else {
        return Err(to_py_err(EngineError::Internal("the init thread stopped without an answer".into())));
    };
    let mut state = state();
    if used_generation {
        state.generation += 1;
    }
    let (engine, hosted) = result.map_err(to_py_err)?;
    fork::engine_started(engine.topology().rank);
    state.engine = Some(Arc::new(engine));
    ENGINE_EPOCH.fetch_add(1, Ordering::Release);
    state.hosted = hosted;
    Ok(())
}

/// Stop the engine of this process; the other ranks stop too. Safe to call when not initialized.
/// `exiting`: called by the exit handler of a process that never called shutdown() itself (the other
/// ranks then report that this rank exited).
#[pyfunction]
#[pyo3(signature = (exiting=false))]
pub fn shutdown(py: Python<'_>, exiting: bool) {
    if fork::forked_from().is_some() {
        // The engine's threads, sockets and shared memory belong to the parent: leave them untouched.
        if let Ok(mut state) = STATE.try_lock() {
            std::mem::forget(state.engine.take());
        }
        return;
    }
    detached_once(py, || {
        let (engine, hosted) = {
            let mut state = state();
            ENGINE_EPOCH.fetch_add(1, Ordering::Release);
            (state.engine.take(), state.hosted.take())
        };
        // This thread's handle on it goes now (other threads drop theirs on their next call).
        ENGINE_SEEN.with(|seen| seen.try_borrow_mut().map(|mut seen| *seen = None).ok());
        if let Some(engine) = engine {
            fork::engine_stopped();
            engine.shutdown(if exiting { StopReason::Exiting } else { StopReason::Shutdown });
        }
        drop(hosted);
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

/// One input: a DLPack capsule (a GPU one's ready event recorded on `stream`, see `import_capsule`), or an
/// array (see `ndarray::import_array`).
fn import_input(
    object: &Bound<'_, PyAny>,
    in_place: bool,
    stream: Option<usize>,
    what: impl Fn() -> String,
) -> PyResult<ImportedTensor> {
    if is_capsule(object) {
        import_capsule(object, stream, what)
    } else {
        import_array(object, in_place, what)
    }
}

/// The collective kind and reduce op a Python call names by their codes.
fn read_codes(kind: u8, reduce_op: u8) -> PyResult<(CollectiveKind, ReduceOp)> {
    let kind =
        CollectiveKind::from_code(kind).ok_or_else(|| PyValueError::new_err(format!("unknown collective {kind}")))?;
    let reduce_op = ReduceOp::from_code(reduce_op)
        .ok_or_else(|| PyValueError::new_err(format!("unknown reduce op {reduce_op}")))?;
    Ok((kind, reduce_op))
}

/// An imported tensor submitted as it is (not a member of a packed group).
fn whole_tensor(name: String, imported: ImportedTensor, in_place: bool) -> TensorSubmission {
    TensorSubmission {
        name,
        dtype: imported.dtype,
        shape: imported.shape,
        input: imported.tensor,
        in_place,
        packed: None,
        device: imported.device,
        into: None,
    }
}

/// Submit a collective: the one entry of every op. `names` and `tensors` are either one name (the user's, or
/// `noname.<n>`; the op is named `<kind>.<name>`) and one tensor (or None: a barrier), or lists of full names
/// and tensors (the names say which). A tensor is a DLPack capsule or an exact C-contiguous `numpy.ndarray`
/// of native byte order, which the caller keeps alive until the handle completes. With `packed` (a grouped allreduce), `names`
/// holds the group's one name and the tensors are packed into one per dtype (see `engine::grouped`). With
/// `wait`, the caller waits for the op at once: it may run right here, with the GIL released.
///
/// One tensor with `wait` (the fast path of every small synchronous op): in steady state a small cached op
/// on an array runs as one exchange of round headers (see `engine::small_op`). It returns None (done: in
/// place, or a barrier), a new array (done: the out-of-place result) or an int (the handle to `wait` for).
/// One tensor without `wait`: the handle. Either returns `NotImplemented` when the tensor is not one the
/// engine reads as it is (nothing was submitted: export it and submit the lists). Lists: the handle, and
/// what the engine cannot read is refused with an error.
///
/// A capsule of a tensor on a GPU is taken where the GPU libraries are usable: `stream` is the framework's
/// current stream on its device (a `cudaStream_t` as a number), on which its ready event is recorded; without
/// one, the producer is expected to have made rvod's stream (`device_stream`) wait for the tensor.
///
/// `output` (an asynchronous reducescatter of one tensor in host memory): host memory of the input's dtype
/// the result is written into instead of a new buffer; the handle's result is then None, as in place. Its
/// size is checked when the op runs (this rank's block is known then).
#[pyfunction]
#[pyo3(signature = (kind, names, tensors, in_place, reduce_op, prescale, postscale, root_rank, process_set_id, wait=false, packed=false, splits=None, stream=None, compression=0, output=None))]
#[allow(clippy::too_many_arguments)]
pub fn submit<'py>(
    py: Python<'py>,
    kind: u8,
    names: &Bound<'py, PyAny>,
    tensors: Option<&Bound<'py, PyAny>>,
    in_place: bool,
    reduce_op: u8,
    prescale: f64,
    postscale: f64,
    root_rank: i32,
    process_set_id: u32,
    wait: bool,
    packed: bool,
    splits: Option<Vec<i64>>,
    stream: Option<usize>,
    compression: u16,
    output: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyAny>> {
    let (kind, reduce_op) = read_codes(kind, reduce_op)?;
    let compression = Compression::from_code(compression)
        .ok_or_else(|| PyValueError::new_err(format!("unknown compression code {compression}")))?;
    let params =
        Params { kind, in_place, reduce_op, prescale, postscale, root_rank, process_set_id, stream, compression };
    // The names say which form this is: ops.py makes them (a tensor is the user's object, maybe a list).
    let Ok(name) = names.downcast::<PyString>() else {
        let names: Vec<String> = names.extract()?;
        let tensors: Vec<Bound<'py, PyAny>> = tensors.map(|t| t.extract()).transpose()?.unwrap_or_default();
        return submit_lists(py, params, names, &tensors, splits.unwrap_or_default(), packed, wait)?
            .into_bound_py_any(py);
    };
    let name = name.to_str()?;
    if let Some(output) = output {
        let Some(tensor) = tensors.filter(|_| !wait && kind == CollectiveKind::Reducescatter) else {
            return Err(PyValueError::new_err(format!(
                "{kind} '{name}': an output tensor is taken by an asynchronous reducescatter of one tensor only"
            )));
        };
        return submit_into(py, params, name, tensor, output)?.into_bound_py_any(py);
    }
    match tensors {
        Some(tensor) if !wait || is_capsule(tensor) => submit_one(py, params, name, tensor, wait),
        None if !wait => Err(PyValueError::new_err(format!("{kind} needs a tensor"))),
        array => with_engine(|engine| run_with(py, engine, params, name, array)),
    }
}

/// An op's settings, as `submit` was given them (codes read).
#[derive(Clone, Copy)]
struct Params {
    kind: CollectiveKind,
    in_place: bool,
    reduce_op: ReduceOp,
    prescale: f64,
    postscale: f64,
    root_rank: i32,
    process_set_id: u32,
    /// The framework's current stream, for tensors on a GPU.
    stream: Option<usize>,
    compression: Compression,
}

impl Params {
    fn op(&self, tensors: Vec<TensorSubmission>, splits: Vec<i64>) -> OpSubmission {
        let Params { kind, reduce_op, prescale, postscale, root_rank, compression, .. } = *self;
        OpSubmission {
            params: OpParams { reduce_op, prescale, postscale, root_rank, splits, compression, ..OpParams::new(kind) },
            tensors,
        }
    }
}

/// `submit` of lists of names and tensors.
fn submit_lists(
    py: Python<'_>,
    params: Params,
    names: Vec<String>,
    tensors: &[Bound<'_, PyAny>],
    splits: Vec<i64>,
    packed: bool,
    wait: bool,
) -> PyResult<u64> {
    let Params { kind, in_place, process_set_id, stream, .. } = params;
    if packed {
        let (Some(name), true) = (names.first(), names.len() == 1 && kind == CollectiveKind::Allreduce) else {
            return Err(PyValueError::new_err("a packed submission is one allreduce group with one name"));
        };
        let mut members = Vec::with_capacity(tensors.len());
        let mut on_gpu = Vec::new();
        for (i, tensor) in tensors.iter().enumerate() {
            let imported = import_input(tensor, in_place, stream, || format!("{kind} '{name}_{i}'"))?;
            if imported.device.is_some() {
                // GPU tensors are not packed on the host: the group's tensors go as one op of tensors named
                // '<name>_<index>', negotiated together and fused.
                on_gpu.push(whole_tensor(format!("{name}_{i}"), imported, in_place));
                continue;
            }
            members.push(GroupMember { input: imported.tensor, dtype: imported.dtype, shape: imported.shape });
        }
        if !on_gpu.is_empty() {
            if !members.is_empty() {
                return Err(invalid_argument(format!(
                    "{kind} '{name}': a group mixes tensors on a GPU with tensors in host memory"
                )));
            }
            let op = params.op(on_gpu, splits);
            return with_engine(|engine| queue(py, engine, op, process_set_id, wait));
        }
        let op = params.op(Vec::new(), splits);
        let drive = wait.then_some(Detached(py));
        return with_engine(|engine| {
            engine.submit_group(name, members, in_place, op, process_set_id, drive.as_ref()).map_err(to_py_err)
        });
    }
    if names.len() != tensors.len() {
        return Err(PyValueError::new_err("one name per tensor is required"));
    }
    let mut submitted = Vec::with_capacity(tensors.len());
    for (name, tensor) in names.into_iter().zip(tensors) {
        let imported = import_input(tensor, in_place, stream, || format!("{kind} '{name}'"))?;
        submitted.push(whole_tensor(name, imported, in_place));
    }
    let op = params.op(submitted, splits);
    with_engine(|engine| queue(py, engine, op, process_set_id, wait))
}

/// `submit` of one tensor (a capsule, or an array without `wait`): the path a burst of a thousand small async
/// ops takes, no lists on either side.
fn submit_one<'py>(
    py: Python<'py>,
    params: Params,
    name: &str,
    tensor: &Bound<'py, PyAny>,
    wait: bool,
) -> PyResult<Bound<'py, PyAny>> {
    let Params { kind, in_place, process_set_id, stream, .. } = params;
    if matches!(kind, CollectiveKind::Barrier | CollectiveKind::Join) {
        return Err(PyValueError::new_err(format!("{kind} takes no tensor")));
    }
    let name = [kind.name(), ".", name].concat();
    let Ok(imported) = import_input(tensor, in_place, stream, || format!("{kind} '{name}'")) else {
        return Ok(py.NotImplemented().into_bound(py));
    };
    let op = params.op(vec![whole_tensor(name, imported, in_place)], Vec::new());
    with_engine(|engine| queue(py, engine, op, process_set_id, wait))?.into_bound_py_any(py)
}

/// `submit` of one tensor whose result goes into `output` (see `submit`): both in host memory, one dtype.
fn submit_into(
    py: Python<'_>,
    params: Params,
    name: &str,
    tensor: &Bound<'_, PyAny>,
    output: &Bound<'_, PyAny>,
) -> PyResult<u64> {
    let Params { kind, process_set_id, stream, .. } = params;
    let name = [kind.name(), ".", name].concat();
    let imported = import_input(tensor, false, stream, || format!("{kind} '{name}'"))?;
    let into = import_input(output, true, stream, || format!("the output of {kind} '{name}'"))?;
    if imported.device.is_some() || into.device.is_some() {
        return Err(invalid_argument(format!(
            "{kind} '{name}': an output tensor is taken for tensors in host memory only (this one is on a GPU)"
        )));
    }
    if into.tensor.overlaps(&imported.tensor) {
        return Err(invalid_argument(format!(
            "{kind} '{name}': the output tensor shares memory with the input, which the op reads while it writes \
             the output; give it memory of its own"
        )));
    }
    if into.dtype != imported.dtype {
        return Err(invalid_argument(format!(
            "{kind} '{name}': the output tensor is {}, the input {}; they must be of one dtype",
            into.dtype, imported.dtype
        )));
    }
    let mut submission = whole_tensor(name, imported, false);
    submission.into = Some(into.tensor);
    let op = params.op(vec![submission], Vec::new());
    with_engine(|engine| queue(py, engine, op, process_set_id, false))
}

thread_local! {
    /// Where the fast lane leaves an out-of-place result on this thread (at most a header's worth of data from
    /// each rank).
    static SMALL_RESULT: std::cell::RefCell<Vec<u8>> = std::cell::RefCell::new(vec![0; EAGER_TENSOR_BYTES]);
}

/// `submit` of one array (or None: a barrier) with `wait`, on `engine`.
fn run_with<'py>(
    py: Python<'py>,
    engine: &Arc<Engine>,
    params: Params,
    name: &str,
    array: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyAny>> {
    let Params { kind, in_place, reduce_op, prescale, postscale, root_rank, process_set_id, compression, .. } = params;
    // A barrier is matched by the engine's own name for it, as `submit` does.
    let full_name;
    let name = if kind == CollectiveKind::Barrier {
        BARRIER_NAME
    } else {
        full_name = [kind.name(), ".", name].concat();
        &full_name
    };
    let imported = match array {
        Some(array) => match import_array(array, in_place, || format!("{kind} '{name}'")) {
            Ok(imported) => Some(imported),
            Err(_) => return Ok(py.NotImplemented().into_bound(py)),
        },
        None => None,
    };
    let (input, dtype, shape) = match imported {
        Some(ImportedTensor { tensor, dtype, shape, .. }) => (tensor, dtype, shape),
        // SAFETY: a zero-length view of no memory.
        None => (unsafe { RawTensor::new(std::ptr::null_mut(), 0) }, DataType::Uint8, Vec::new()),
    };
    let params =
        OpParams { dtype, shape, reduce_op, prescale, postscale, root_rank, compression, ..OpParams::new(kind) };
    let op = SmallOp { name, params, input, in_place };
    let run = SMALL_RESULT.with(|out| engine.run_small(op, process_set_id, &mut out.borrow_mut(), &Detached(py)));
    match run.map_err(to_py_err)? {
        SmallRun::Done { len, shape } => match array {
            Some(array) if !in_place => {
                let (result, mut memory) = match shape {
                    Some(shape) => empty_shaped(array, &shape)?,
                    None => empty_like(array)?,
                };
                let len = memory.len().min(len);
                SMALL_RESULT.with(|out| memory.as_mut_slice()[..len].copy_from_slice(&out.borrow()[..len]));
                Ok(result)
            }
            _ => Ok(py.None().into_bound(py)),
        },
        SmallRun::Handle(handle) => handle.into_bound_py_any(py),
    }
}

/// Queue `op`. An async submission never blocks (it queues and maybe wakes the engine), so the GIL is
/// kept: releasing and re-taking it would cost more than the call. With `wait` (the caller waits for the
/// handle next), the op may run right here, with the GIL released (see `engine::driver`).
fn queue(py: Python<'_>, engine: &Arc<Engine>, op: OpSubmission, process_set_id: u32, wait: bool) -> PyResult<u64> {
    if !wait {
        return engine.submit(op, process_set_id).map_err(to_py_err);
    }
    engine.submit_and_drive(op, process_set_id, &Detached(py)).map_err(to_py_err)
}

/// Register a process set at run time (every rank calls this, in the same order); returns its id.
#[pyfunction]
pub fn add_process_set(py: Python<'_>, ranks: Vec<usize>) -> PyResult<u32> {
    let engine = engine()?;
    detached_once(py, || engine.add_process_set(&ranks)).map_err(to_py_err)
}

/// Whether process sets may be added and removed after init (the running engine's configuration).
#[pyfunction]
pub fn dynamic_process_sets() -> PyResult<bool> {
    Ok(engine()?.config().dynamic_process_sets)
}

/// Remove a process set (every rank calls this); false for the global set or an unknown id.
#[pyfunction]
pub fn remove_process_set(py: Python<'_>, process_set_id: u32) -> PyResult<bool> {
    let engine = engine()?;
    Ok(detached_once(py, || engine.remove_process_set(process_set_id)))
}

/// Every registered process set as (id, ranks).
/// What carries the bytes of a process set on this rank: "shm", "tcp" or "memory" (one-rank sets), or
/// None when this rank is not a member.
#[pyfunction]
#[pyo3(signature = (process_set_id=0))]
pub fn transport_kind(process_set_id: u32) -> PyResult<Option<&'static str>> {
    Ok(engine()?.transport_kind(process_set_id))
}

/// `hvd.straggler_report()`'s records: (global rank, rounds, times last, mean lateness in seconds, named)
/// for each member of the set; `None` where this rank is not a member.
#[pyfunction]
#[allow(clippy::type_complexity)]
pub fn straggler_report(process_set_id: u32) -> PyResult<Option<Vec<(usize, u64, u64, f64, bool)>>> {
    Ok(engine()?.straggler_report(process_set_id).map(|records| {
        records
            .into_iter()
            .map(|(rank, r)| (rank, r.rounds, r.times_last, r.mean_lateness().as_secs_f64(), r.straggler))
            .collect()
    }))
}

/// `RVOD_ELASTIC_HUNG_TIMEOUT` in seconds as read from `env` (None: the check is off); ValueError naming
/// the variable when a value does not parse. For the elastic driver and its workers' heartbeat.
#[pyfunction]
pub fn elastic_hung_timeout(env: std::collections::HashMap<String, String>) -> PyResult<Option<f64>> {
    crate::config::elastic_hung_timeout(|name| env.get(name).cloned())
        .map(|timeout| timeout.map(|d| d.as_secs_f64()))
        .map_err(|err| PyValueError::new_err(err.to_string()))
}

/// Count an elastic reset this process took part in (`rvod_elastic_resets_total`).
#[pyfunction]
pub fn note_elastic_reset() {
    crate::engine::metrics::METRICS.elastic_reset();
}

#[pyfunction]
pub fn process_sets() -> PyResult<Vec<(u32, Vec<usize>)>> {
    Ok(engine()?.process_sets())
}

/// True once the handle completed (its result is then ready for `wait`).
#[pyfunction]
pub fn poll(handle: u64) -> PyResult<bool> {
    with_engine(|engine| engine.poll(handle).ok_or_else(|| PyValueError::new_err(format!("unknown handle {handle}"))))
}

/// Block until the handle completes (GIL released). Returns (outputs, received_splits, last_joined_rank):
/// one DLPack capsule per tensor (a CUDA one for a tensor on a GPU), or None where the result was written
/// in place. For an op on GPU tensors, `stream` (a `cudaStream_t` as a number: the framework's current
/// stream) is made to wait for the results, without blocking; without one, the host waits for them.
#[pyfunction]
#[pyo3(signature = (handle, stream=None))]
pub fn wait(py: Python<'_>, handle: u64, stream: Option<usize>) -> PyResult<Bound<'_, PyTuple>> {
    with_engine(|engine| {
        // A handle already complete (most of a burst's, by the time they are waited for) is taken at once,
        // with the GIL held: releasing it would cost more than the rest.
        match engine.take_done(handle) {
            Some(result) => wait_result(py, result, stream),
            None => match detached(py, |slice| match engine.wait(handle, slice) {
                WaitOutcome::Pending => None,
                outcome => Some(outcome),
            })? {
                WaitOutcome::Done(result) => wait_result(py, result, stream),
                _ => Err(PyValueError::new_err(format!("unknown handle {handle}"))),
            },
        }
    })
}

/// The host waits for `event` (an op's GPU results), with the GIL released and Ctrl-C seen between slices
/// (the work may take long: with asynchronous completion the op is handed back before it runs, and work stuck
/// on a dead peer ends only when the engine aborts its communicator).
fn host_wait(
    py: Python<'_>,
    device: &crate::gpu::cuda::CudaDevice,
    event: &crate::gpu::cuda::CudaEvent,
) -> PyResult<Result<(), crate::gpu::GpuError>> {
    /// Looks at the event back to back for this long, then sleeps this long between looks.
    const SPIN: std::time::Duration = std::time::Duration::from_micros(200);
    const POLL: std::time::Duration = std::time::Duration::from_micros(50);
    match device.query(event) {
        Ok(false) => {}
        done => return Ok(done.map(|_| ())),
    }
    let started = std::time::Instant::now();
    detached(py, |slice| {
        let until = std::time::Instant::now() + slice;
        loop {
            match device.query(event) {
                Ok(false) if std::time::Instant::now() >= until => return None,
                Ok(false) if started.elapsed() < SPIN => std::thread::yield_now(),
                Ok(false) => std::thread::sleep(POLL),
                done => return Some(done.map(|_| ())),
            }
        }
    })
}

/// What `wait` returns for a completed op, once `stream` (or the host) waits for its GPU results.
fn wait_result(
    py: Python<'_>,
    result: Result<OpOutput, EngineError>,
    stream: Option<usize>,
) -> PyResult<Bound<'_, PyTuple>> {
    let output = result.map_err(to_py_err)?;
    for done in &output.done {
        let device = done.context.device();
        if done.host_waits() {
            // Handed back with its NCCL work queued; by default the op is complete once that work has run.
            host_wait(py, device, &done.event)?.map_err(|e| to_py_err(EngineError::Gpu(e.to_string())))?;
        }
        let waited = match stream {
            Some(stream) => {
                // SAFETY: the caller passes its framework's live stream on this device.
                let borrowed = unsafe { device.borrowed_stream(stream) };
                device.wait_event(&borrowed, &done.event)
            }
            None => host_wait(py, device, &done.event)?,
        };
        waited.map_err(|e| to_py_err(EngineError::Gpu(e.to_string())))?;
        // The process set's NCCL work failed after the op was handed back.
        if let Some(why) = done.failure() {
            let message = if done.host_waits() {
                why.to_string()
            } else {
                format!("{why} (the op was handed back before its GPU work ran: RVOD_ENABLE_ASYNC_COMPLETION)")
            };
            return Err(to_py_err(EngineError::Gpu(message)));
        }
    }
    let outputs = PyList::empty(py);
    let mut on_device = output.device_tensors.into_iter();
    for tensor in output.tensors {
        match (tensor, on_device.next().flatten()) {
            (Some(t), _) => outputs.append(export_capsule(py, t.buffer, t.shape, t.dtype)?)?,
            (None, Some(d)) => outputs.append(export_device_capsule(py, d, stream)?)?,
            (None, None) => outputs.append(py.None())?,
        }
    }
    (outputs, output.received_splits, output.last_joined_rank).into_pyobject(py)
}

/// What this build contains, for `rvodrun --check-build` and `hvd.*_built()`.
#[pyfunction]
pub fn build_info(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let info = PyDict::new(py);
    info.set_item("version", env!("CARGO_PKG_VERSION"))?;
    info.set_item("transports", vec!["tcp", "shm", "ucx"])?;
    // What Horovod's `*_built()` functions report: this build links none of these libraries. CUDA and NCCL
    // are loaded at run time instead: `gpu_libraries()` says what was found.
    for library in ["mpi", "gloo", "rocm", "ddl", "ccl"] {
        info.set_item(library, false)?;
    }
    Ok(info)
}

/// `hvd.start_timeline(file_path, mark_cycles)`: record into `file_path` (switching files if one is open).
#[pyfunction]
pub fn start_timeline(py: Python<'_>, file_path: String, mark_cycles: bool) -> PyResult<()> {
    let engine = engine()?;
    detached_once(py, || engine.start_timeline(&file_path, mark_cycles)).map_err(to_py_err)
}

/// `hvd.stop_timeline()`: close the current timeline file once everything recorded is in it.
#[pyfunction]
pub fn stop_timeline(py: Python<'_>) -> PyResult<()> {
    let engine = engine()?;
    detached_once(py, || engine.stop_timeline()).map_err(to_py_err)
}

/// Private, for benchmarks that compare settings inside one job (benches/autotune.py): from the end of the
/// global process set's next round on, every rank fuses up to `fusion_threshold` bytes, batches for
/// `cycle_time_ms` and uses the response cache or not, applied through the path autotune's values take
/// (rank 0's round header; see `crate::protocol::tuned::RequestedValues`). Call it on every rank at the same step
/// with the same values: only rank 0's call counts. The values apply when the next round that rank 0 takes
/// part in ends; after one collective completes everywhere, the collectives submitted next run with them.
/// They show in `autotune_applied()`. Meant for autotune off or after its closing line: a tuning in
/// progress announces its own values over them. ValueError for a negative or non-finite cycle time.
#[pyfunction]
#[pyo3(name = "_set_tuned_values")]
pub fn set_tuned_values(fusion_threshold: usize, cycle_time_ms: f64, cache_enabled: bool) -> PyResult<()> {
    let cycle_time = crate::config::cycle_time_from_ms(cycle_time_ms).ok_or_else(|| {
        PyValueError::new_err(format!("cycle_time_ms must be a non-negative number, got {cycle_time_ms}"))
    })?;
    let requested = crate::protocol::tuned::RequestedValues { fusion_threshold, cycle_time, cache_enabled };
    if engine()?.request_tuned_values(requested) {
        Ok(())
    } else {
        Err(PyValueError::new_err("this rank has no global process set"))
    }
}

/// The autotuned values this rank applied on the global process set, in order, as dicts with the round
/// they were applied after (`round`, `fusion_threshold`, `cycle_time_ms`, `cache_enabled`,
/// `hierarchical_allreduce`, `hierarchical_allgather`; the last two None when the executor chooses).
/// Empty with autotune off, unless `_set_tuned_values` set some. For tests and diagnosis: every rank's list is
/// the same.
#[pyfunction]
pub fn autotune_applied(py: Python<'_>) -> PyResult<Vec<Bound<'_, PyDict>>> {
    let applied = engine()?.autotune_applied();
    applied
        .into_iter()
        .map(|a| {
            let d = PyDict::new(py);
            d.set_item("round", a.round)?;
            d.set_item("fusion_threshold", a.values.fusion_threshold)?;
            d.set_item("cycle_time_ms", a.values.cycle_time.as_secs_f64() * 1e3)?;
            d.set_item("cache_enabled", a.values.cache_enabled)?;
            d.set_item("hierarchical_allreduce", a.values.hierarchical_allreduce)?;
            d.set_item("hierarchical_allgather", a.values.hierarchical_allgather)?;
            Ok(d)
        })
        .collect()
}
