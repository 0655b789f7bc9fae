//! The one mapping from engine errors to Python exceptions (classes defined in `rvod/exceptions.py`).

use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::PyErr;

use crate::error::EngineError;

pyo3::import_exception!(rvod.exceptions, RvodInternalError);
pyo3::import_exception!(rvod.exceptions, RvodInvalidArgumentError);
pyo3::import_exception!(rvod.exceptions, RvodMismatchError);
pyo3::import_exception!(rvod.exceptions, RvodTimeoutError);

pub fn to_py_err(err: EngineError) -> PyErr {
    let message = err.to_string();
    match err {
        // Refused at submission: a ValueError, and a RuntimeError as Horovod's refusals are.
        EngineError::NotInitialized | EngineError::DuplicateName { .. } | EngineError::InvalidArgument(_) => {
            RvodInvalidArgumentError::new_err(message)
        }
        EngineError::Config(_) => PyValueError::new_err(message),
        EngineError::Mismatch(_) => RvodMismatchError::new_err(message),
        EngineError::Transport { ref cause, .. } if cause.timed_out => RvodTimeoutError::new_err(message),
        EngineError::StartTimeout(_) => RvodTimeoutError::new_err(message),
        EngineError::Forked { .. } => PyRuntimeError::new_err(message),
        EngineError::ShutDown(_)
        | EngineError::Rejected(_)
        | EngineError::Transport { .. }
        | EngineError::Init(_)
        | EngineError::Internal(_)
        | EngineError::Gpu(_) => RvodInternalError::new_err(message),
    }
}

/// A tensor or argument refused before anything is sent: a `ValueError`, and a `RuntimeError` as Horovod's
/// refusals are (`RvodInvalidArgumentError`).
pub fn invalid_argument(message: String) -> PyErr {
    RvodInvalidArgumentError::new_err(message)
}

/// For failures outside the engine (e.g. the rendezvous server could not start).
pub fn runtime_error(message: String) -> PyErr {
    PyRuntimeError::new_err(message)
}
