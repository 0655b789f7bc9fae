//! `RendezvousServer`: the job's authenticated key-value store, started by `rvodrun`.

use std::net::IpAddr;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::py::error::runtime_error;
use crate::transport::rendezvous;

#[pyclass(name = "RendezvousServer", module = "rvod._rvod")]
pub struct RendezvousServer {
    server: Option<rendezvous::RendezvousServer>,
    port: u16,
}

#[pymethods]
impl RendezvousServer {
    #[new]
    #[pyo3(signature = (host, port, secret))]
    fn new(py: Python<'_>, host: &str, port: u16, secret: Vec<u8>) -> PyResult<Self> {
        let ip: IpAddr = host.parse().map_err(|_| PyValueError::new_err(format!("'{host}' is not an IP address")))?;
        if secret.is_empty() {
            return Err(PyValueError::new_err("the rendezvous secret must not be empty"));
        }
        // The store runs in rvodrun's process, which never calls init(): its warnings (dropped strangers)
        // need a log of their own.
        crate::py::api::init_logging(&crate::config::log_level_from_env());
        let server = py
            .allow_threads(|| rendezvous::RendezvousServer::start(ip, port, secret))
            .map_err(|e| runtime_error(format!("cannot start the rendezvous server on {host}:{port}: {e}")))?;
        let port = server.port();
        Ok(RendezvousServer { server: Some(server), port })
    }

    #[getter]
    fn port(&self) -> u16 {
        self.port
    }

    /// Stop serving; idempotent.
    fn close(&mut self, py: Python<'_>) {
        if let Some(server) = self.server.take() {
            py.allow_threads(|| server.stop());
        }
    }
}
