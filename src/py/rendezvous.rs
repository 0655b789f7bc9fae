//! `RendezvousServer`: the job's authenticated key-value store, started by `rvodrun`; `StoreClient`: a
//! connection to it from Python (`rvod.run` ships the function and collects the results through it; an
//! elastic worker's heartbeat beats through one, see `engine::heartbeat`).

use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::py::detached::{detached, detached_once};
use crate::py::error::{runtime_error, to_py_err};
use crate::transport::rendezvous;
use crate::transport::rendezvous::StoreClient as NativeStoreClient;

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
        crate::py::api::init_logging(&crate::config::log_level_from_env(), crate::config::log_hide_time_from_env());
        let server = detached_once(py, || rendezvous::RendezvousServer::start(ip, port, secret))
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
            detached_once(py, || server.stop());
        }
    }
}

fn timeout_from_seconds(seconds: f64) -> PyResult<Duration> {
    Duration::try_from_secs_f64(seconds)
        .map_err(|_| PyValueError::new_err(format!("timeout must be a number of seconds >= 0, got {seconds}")))
}

#[pyclass(name = "StoreClient", module = "rvod._rvod")]
pub struct StoreClient {
    client: Option<NativeStoreClient>,
}

impl StoreClient {
    fn connected(&mut self) -> PyResult<&mut NativeStoreClient> {
        self.client.as_mut().ok_or_else(|| runtime_error("the store client is closed".to_string()))
    }
}

#[pymethods]
impl StoreClient {
    /// Connects to the store at `host:port` and proves knowledge of `secret`, retrying for `timeout` seconds.
    #[new]
    #[pyo3(signature = (host, port, secret, timeout))]
    fn new(py: Python<'_>, host: &str, port: u16, secret: Vec<u8>, timeout: f64) -> PyResult<Self> {
        let ip: IpAddr = host.parse().map_err(|_| PyValueError::new_err(format!("'{host}' is not an IP address")))?;
        let timeout = timeout_from_seconds(timeout)?;
        let client = detached_once(py, || NativeStoreClient::connect(SocketAddr::new(ip, port), &secret, timeout))
            .map_err(|e| runtime_error(e.to_string()))?;
        Ok(StoreClient { client: Some(client) })
    }

    /// Hands this connection to the elastic heartbeat (`engine::heartbeat`): `key` is set now, then every
    /// `interval` seconds from a native thread, until the store goes. This client is closed after.
    fn start_heartbeat(&mut self, py: Python<'_>, key: &str, interval: f64) -> PyResult<()> {
        let interval = timeout_from_seconds(interval)?;
        let client = self.client.take().ok_or_else(|| runtime_error("the store client is closed".to_string()))?;
        let key = key.to_string();
        detached_once(py, || crate::engine::heartbeat::start(client, key, interval)).map_err(to_py_err)
    }

    fn set(&mut self, py: Python<'_>, key: &str, value: Vec<u8>) -> PyResult<()> {
        let client = self.connected()?;
        detached_once(py, || client.set(key, &value)).map_err(|e| runtime_error(e.to_string()))
    }

    /// The value of `key`, waiting up to `timeout` seconds for some client to set it (RuntimeError after that).
    /// The wait is in slices, so Ctrl-C raises `KeyboardInterrupt` meanwhile.
    fn get(&mut self, py: Python<'_>, key: &str, timeout: f64) -> PyResult<Vec<u8>> {
        let timeout = timeout_from_seconds(timeout)?;
        let client = self.connected()?;
        let deadline = Instant::now() + timeout;
        let found = detached(py, |slice| {
            let left = deadline.saturating_duration_since(Instant::now());
            match client.try_get(key, left.min(slice)) {
                Ok(None) if !left.is_zero() => None,
                outcome => Some(outcome),
            }
        })?;
        match found.map_err(|e| runtime_error(e.to_string()))? {
            Some(value) => Ok(value),
            None => Err(runtime_error(client.missing(key, timeout).to_string())),
        }
    }

    /// The value of `key`, or None when no client set it within `timeout` seconds (0: look once).
    fn try_get(&mut self, py: Python<'_>, key: &str, timeout: f64) -> PyResult<Option<Vec<u8>>> {
        let timeout = timeout_from_seconds(timeout)?;
        let client = self.connected()?;
        detached_once(py, || client.try_get(key, timeout)).map_err(|e| runtime_error(e.to_string()))
    }

    fn close(&mut self) {
        self.client = None;
    }
}
