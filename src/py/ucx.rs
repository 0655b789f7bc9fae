//! UCX as Python sees it: `ucx_library()`, what `rvodrun --check-build` reports about the transport between
//! hosts (whether libucp was found, its version, the transports and devices it reports, which of them are
//! RDMA, and `RVOD_TRANSPORT`). The library is loaded on the first ask (see [`crate::transport::ucx`]).

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::config::HostsConfig;
use crate::transport::ucx::{rdma_transports, ucx};

/// `transport` (RVOD_TRANSPORT); `path` and `version` of the libucp found (None when none, and `error` says
/// why); `resources` ("transport/device" as UCX reports them after UCX_TLS), `rdma` (those that are RDMA)
/// and `resources_error` (why they could not be read).
#[pyfunction]
pub fn ucx_library(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let config = HostsConfig::from_env().map_err(|e| PyValueError::new_err(e.to_string()))?;
    let info = PyDict::new(py);
    info.set_item("transport", config.transport.name())?;
    let found = crate::py::detached::detached_once(py, || {
        let ucx = ucx(config.ucx_library.as_deref())?;
        let resources = ucx.resources().map(<[String]>::to_vec);
        Ok::<_, String>((ucx, resources))
    });
    let (path, version, error, resources) = match found {
        Ok((ucx, resources)) => {
            (Some(ucx.path.display().to_string()), Some(ucx.version.clone()), None, Some(resources))
        }
        Err(why) => (None, None, Some(why), None),
    };
    info.set_item("path", path)?;
    info.set_item("version", version)?;
    info.set_item("error", error)?;
    let (listed, resources_error) = match resources {
        Some(Ok(listed)) => (listed, None),
        Some(Err(why)) => (Vec::new(), Some(why)),
        None => (Vec::new(), None),
    };
    info.set_item("rdma", rdma_transports(&listed))?;
    info.set_item("resources", listed)?;
    info.set_item("resources_error", resources_error)?;
    Ok(info)
}
