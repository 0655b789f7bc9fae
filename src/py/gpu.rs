//! GPU libraries as Python sees them: `gpu_libraries()` (what `nccl_built()`, `cuda_built()` and
//! `rvodrun --check-build` report), `device_stream(ordinal)` (rvod's stream on a GPU), and the device a
//! GPU tensor is taken on, or its refusal with the reason.
//!
//! The NVIDIA Python packages' directories are found here, through `importlib` (no framework is imported),
//! and handed to [`crate::gpu::library`], which loads the libraries on the first ask.
//!
//! Every GPU tensor asks for its device ([`usable_device`]); once one was taken, nothing it checks can change
//! in the process (libraries, driver, devices, the GPU settings), so later tensors only take their device's
//! context: no library lookup, no settings read, no GIL release, no `cudaGetDeviceCount` per op.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::config::{GpuConfig, GpuTransport};
use crate::gpu::library::{libraries, GpuLibraries};
use crate::gpu::nccl::version_text;
use crate::gpu::runtime::{context, DeviceContext};
use crate::py::error::invalid_argument;

/// The directories of the `nvidia` namespace package (where nvidia-nccl-cu12/cu13 and
/// nvidia-cuda-runtime put their lib folders); empty when it is not installed.
fn nvidia_dirs(py: Python<'_>) -> Vec<PathBuf> {
    let found = (|| -> PyResult<Vec<PathBuf>> {
        let spec = py.import("importlib.util")?.call_method1("find_spec", ("nvidia",))?;
        if spec.is_none() {
            return Ok(Vec::new());
        }
        let locations = spec.getattr("submodule_search_locations")?;
        if locations.is_none() {
            return Ok(Vec::new());
        }
        locations.try_iter()?.map(|dir| dir?.extract::<PathBuf>()).collect()
    })();
    found.unwrap_or_default()
}

/// This process's GPU libraries, loaded on the first call (with the GPU settings read then; a later call
/// still refuses bad settings).
pub fn loaded(py: Python<'_>) -> PyResult<&'static GpuLibraries> {
    let config = GpuConfig::from_env().map_err(|e| PyValueError::new_err(e.to_string()))?;
    if let Some(libs) = crate::gpu::library::loaded() {
        return Ok(libs); // where to look and the GIL's release serve the first load only
    }
    let dirs = nvidia_dirs(py);
    Ok(crate::py::detached::detached_once(py, || libraries(&config, &dirs)))
}

/// What was found: `nccl_version` (NCCL_VERSION_CODE, 0 when none), `nccl_version_text`, `nccl_path`,
/// `nccl_error`; `cuda_runtime_version` (0 when none), `cuda_path`, `cuda_error`, `cuda_driver_version`
/// (0 without a driver), `device_count` and `device_error` (why there is no device to use, e.g. "no CUDA
/// driver: ..."); `gpu_transport` (RVOD_GPU_TRANSPORT); `gpu_collectives` (whether this build runs
/// collectives on GPU tensors: where the libraries, a driver and a device are there), `nccl_collectives`
/// (whether they may go through NCCL: where they run and `RVOD_GPU_TRANSPORT` is not `host`; each process
/// set takes NCCL where every member has a GPU of its own, host staging where ranks share one) and
/// `unavailable` (the reason a GPU tensor is refused; None when it is not).
#[pyfunction]
pub fn gpu_libraries(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let libs = loaded(py)?;
    let info = PyDict::new(py);
    match &libs.nccl {
        Ok(nccl) => {
            info.set_item("nccl_version", nccl.version)?;
            info.set_item("nccl_version_text", version_text(nccl.version))?;
            info.set_item("nccl_path", nccl.path.display().to_string())?;
            info.set_item("nccl_error", py.None())?;
        }
        Err(why) => {
            info.set_item("nccl_version", 0)?;
            info.set_item("nccl_version_text", py.None())?;
            info.set_item("nccl_path", py.None())?;
            info.set_item("nccl_error", why)?;
        }
    }
    match &libs.cuda {
        Ok(cuda) => {
            info.set_item("cuda_runtime_version", cuda.runtime_version)?;
            info.set_item("cuda_path", cuda.path.display().to_string())?;
            info.set_item("cuda_error", py.None())?;
            info.set_item("cuda_driver_version", cuda.driver_version())?;
            match cuda.device_count() {
                Ok(count) => {
                    info.set_item("device_count", count)?;
                    info.set_item("device_error", py.None())?;
                }
                Err(why) => {
                    info.set_item("device_count", 0)?;
                    info.set_item("device_error", why)?;
                }
            }
        }
        Err(why) => {
            info.set_item("cuda_runtime_version", 0)?;
            info.set_item("cuda_path", py.None())?;
            info.set_item("cuda_error", why)?;
            info.set_item("cuda_driver_version", 0)?;
            info.set_item("device_count", 0)?;
            info.set_item("device_error", why)?;
        }
    }
    let config = GpuConfig::from_env().map_err(|e| PyValueError::new_err(e.to_string()))?;
    info.set_item("gpu_transport", config.transport.name())?;
    let unavailable = libs.unavailable();
    info.set_item("gpu_collectives", unavailable.is_none())?;
    info.set_item("nccl_collectives", unavailable.is_none() && config.transport != GpuTransport::Host)?;
    info.set_item("unavailable", unavailable)?;
    Ok(info)
}

/// Set once [`usable_device`] found the libraries, a driver, a device and NCCL there and the GPU settings
/// valid (see the module doc).
static USABLE: AtomicBool = AtomicBool::new(false);

/// The context of CUDA device `device` for a tensor on it (`what()` names the tensor; called only for an
/// error), or the error saying why rvod cannot run collectives on it here (what is missing, or the device's
/// own error).
pub fn usable_device(py: Python<'_>, what: impl Fn() -> String, device: i32) -> PyResult<Arc<DeviceContext>> {
    if USABLE.load(Ordering::Acquire) {
        // What the checks below found holds still: only this device's context can fail, as below.
        return context(device).map_err(|error| refused(&what(), device, &error.to_string()));
    }
    let reason = match loaded(py) {
        Ok(libs) => match (libs.unavailable(), GpuConfig::from_env()) {
            (Some(why), _) => why,
            (None, Err(error)) => error.to_string(),
            (None, Ok(_)) => {
                USABLE.store(true, Ordering::Release);
                match context(device) {
                    Ok(context) => return Ok(context),
                    Err(error) => error.to_string(),
                }
            }
        },
        Err(error) => error.to_string(),
    };
    Err(refused(&what(), device, &reason))
}

/// The refusal of a tensor on CUDA device `device` (`what` names it), and why.
fn refused(what: &str, device: i32, reason: &str) -> PyErr {
    invalid_argument(format!(
        "{what}: the tensor is on CUDA device {device}, and rvod cannot run collectives on it here: {reason}. \
         Move the tensor to the CPU (e.g. tensor.cpu())."
    ))
}

/// rvod's stream on GPU `ordinal` (a `cudaStream_t` as a number): what a producer's `__dlpack__(stream=...)`
/// makes wait for its tensor.
#[pyfunction]
pub fn device_stream(py: Python<'_>, ordinal: i32) -> PyResult<usize> {
    usable_device(py, || format!("device_stream({ordinal})"), ordinal).map(|context| context.stream_handle())
}
