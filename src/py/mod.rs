//! The Python extension module `rvod._rvod`: the only place that uses pyo3.
//!
//! - [`api`]: engine life cycle and ops, called by `rvod.common`.
//! - [`boundary`]: the codes of collective kinds, reduce ops and dtypes, as name -> code dictionaries.
//! - [`dlpack`]: tensors in and out as DLPack capsules.
//! - [`ndarray`], [`buffer`]: NumPy arrays in without a capsule per array (NumPy's struct, the buffer
//!   protocol).
//! - [`detached`]: every blocking call, with the GIL released and Ctrl-C turned into `KeyboardInterrupt`.
//! - [`error`]: engine errors as Python exceptions.
//! - [`gpu`]: the GPU libraries found (`nccl_built()`, `--check-build`) and the refusal of GPU tensors.
//! - [`rendezvous`]: the rendezvous server class used by `rvodrun`, and a client of it for `rvod.run`.
//! - [`ucx`]: the UCX library found (`--check-build`).

pub mod api;
pub mod boundary;
pub mod buffer;
pub mod detached;
pub mod dlpack;
pub mod error;
pub mod gpu;
pub mod ndarray;
pub mod rendezvous;
pub mod ucx;

use pyo3::prelude::*;

#[pymodule]
fn _rvod(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    boundary::add_codes(m)?;
    m.add_function(wrap_pyfunction!(api::init, m)?)?;
    m.add_function(wrap_pyfunction!(api::launcher, m)?)?;
    m.add_function(wrap_pyfunction!(api::shutdown, m)?)?;
    m.add_function(wrap_pyfunction!(api::is_initialized, m)?)?;
    m.add_function(wrap_pyfunction!(api::topology, m)?)?;
    m.add_function(wrap_pyfunction!(api::submit, m)?)?;
    m.add_function(wrap_pyfunction!(api::poll, m)?)?;
    m.add_function(wrap_pyfunction!(api::wait, m)?)?;
    m.add_function(wrap_pyfunction!(api::add_process_set, m)?)?;
    m.add_function(wrap_pyfunction!(api::remove_process_set, m)?)?;
    m.add_function(wrap_pyfunction!(api::process_sets, m)?)?;
    m.add_function(wrap_pyfunction!(api::dynamic_process_sets, m)?)?;
    m.add_function(wrap_pyfunction!(api::transport_kind, m)?)?;
    m.add_function(wrap_pyfunction!(api::straggler_report, m)?)?;
    m.add_function(wrap_pyfunction!(api::note_elastic_reset, m)?)?;
    m.add_function(wrap_pyfunction!(api::elastic_hung_timeout, m)?)?;
    m.add_function(wrap_pyfunction!(api::build_info, m)?)?;
    m.add_function(wrap_pyfunction!(gpu::gpu_libraries, m)?)?;
    m.add_function(wrap_pyfunction!(gpu::device_stream, m)?)?;
    m.add_function(wrap_pyfunction!(ucx::ucx_library, m)?)?;
    m.add_function(wrap_pyfunction!(api::start_timeline, m)?)?;
    m.add_function(wrap_pyfunction!(api::stop_timeline, m)?)?;
    m.add_function(wrap_pyfunction!(api::autotune_applied, m)?)?;
    m.add_function(wrap_pyfunction!(api::set_tuned_values, m)?)?;
    m.add_function(wrap_pyfunction!(dlpack::relabel_bool_as_uint8, m)?)?;
    m.add_function(wrap_pyfunction!(dlpack::capsule_device, m)?)?;
    m.add_class::<rendezvous::RendezvousServer>()?;
    m.add_class::<rendezvous::StoreClient>()?;
    Ok(())
}
