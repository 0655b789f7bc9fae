//! The per-process engine: accepts submissions from any thread, runs negotiation and collectives on one
//! background thread, and completes handles.
//!
//! - [`submission`]: what callers hand in and get back.
//! - [`handles`]: the handle table callers wait on.
//! - [`table`]: the background thread's tensors in negotiation.
//! - [`background`]: the loop (wait for work or a peer, negotiate, execute).
//! - [`execute`]: running one agreed response.
//! - [`validate_submission`](mod@validate_submission): argument checks done before anything is sent.
//!
//! Invariant: a submission either fails at once (nothing queued) or its handle is completed exactly once,
//! with a result or an error, including when the engine stops or fails.

pub mod background;
pub mod execute;
pub mod handles;
pub mod submission;
pub mod table;
pub mod validate_submission;

use std::net::{IpAddr, SocketAddr, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::config::{Config, Topology};
use crate::coordinator::message::Request;
use crate::coordinator::message_table::{BARRIER_NAME, JOIN_NAME};
use crate::error::EngineError;
use crate::transport::memory::MemoryTransport;
use crate::transport::rendezvous::StoreClient;
use crate::transport::tcp::TcpTransport;
use crate::transport::{Transport, Waker};
use crate::types::CollectiveKind;

use handles::{HandleId, HandleTable, WaitOutcome};
use submission::OpSubmission;
use table::TensorEntry;

/// Submissions waiting for the background thread, and whether it still takes them.
#[derive(Default)]
struct Inbox {
    entries: Vec<TensorEntry>,
    /// Set when the background thread stopped; later submissions fail with this error.
    closed: Option<EngineError>,
}

/// State shared between callers and the background thread.
pub(crate) struct Shared {
    handles: HandleTable,
    inbox: Mutex<Inbox>,
    waker: Waker,
    shutdown_requested: AtomicBool,
}

impl Shared {
    fn inbox(&self) -> MutexGuard<'_, Inbox> {
        self.inbox.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

pub struct Engine {
    config: Config,
    shared: Arc<Shared>,
    thread: Mutex<Option<JoinHandle<()>>>,
    homogeneous: bool,
}

fn resolve(host: &str, port: u16) -> Result<SocketAddr, EngineError> {
    (host, port)
        .to_socket_addrs()
        .map_err(|e| EngineError::Init(format!("cannot resolve rendezvous address {host}:{port}: {e}")))?
        .next()
        .ok_or_else(|| EngineError::Init(format!("rendezvous address {host}:{port} resolves to nothing")))
}

/// Connect to the other ranks; also learns whether every host runs the same number of ranks.
fn connect(config: &Config, generation: u64) -> Result<(Box<dyn Transport>, bool), EngineError> {
    let topo = &config.topology;
    let Some(rdv) = &config.rendezvous else {
        let mut mesh = MemoryTransport::mesh(1);
        let transport = mesh.pop().ok_or_else(|| EngineError::Internal("no transport".into()))?;
        return Ok((Box::new(transport), true));
    };
    let addr = resolve(&rdv.addr, rdv.port)?;
    let bind: IpAddr = rdv
        .bind_addr
        .parse()
        .map_err(|_| EngineError::Init(format!("RVOD_IFACE_ADDR={} is not an IP address", rdv.bind_addr)))?;
    let mut store = StoreClient::connect(addr, &rdv.secret, config.start_timeout)
        .map_err(|e| EngineError::transport("connecting to the rendezvous store", &e))?;
    let scope = format!("init{generation}/global");
    let homogeneous = all_hosts_equal(&mut store, &scope, topo, config.start_timeout)?;
    let transport = TcpTransport::connect_mesh(
        topo.rank,
        topo.size,
        &mut store,
        &scope,
        &rdv.secret,
        bind,
        &rdv.bind_addr,
        config.timeout,
    )
    .map_err(|e| EngineError::transport("connecting to the other ranks", &e))?;
    Ok((Box::new(transport), homogeneous))
}

/// Every rank publishes its host's rank count; the job is homogeneous when all are equal.
fn all_hosts_equal(store: &mut StoreClient, scope: &str, topo: &Topology, timeout: Duration) -> Result<bool, EngineError> {
    let fail = |e: crate::transport::TransportError| EngineError::transport("exchanging host sizes", &e);
    store.set(&format!("{scope}/local_size/{}", topo.rank), topo.local_size.to_string().as_bytes()).map_err(fail)?;
    let mut equal = true;
    for rank in 0..topo.size {
        let value = store.get(&format!("{scope}/local_size/{rank}"), timeout).map_err(fail)?;
        equal &= value == topo.local_size.to_string().as_bytes();
    }
    Ok(equal)
}

impl Engine {
    /// Connect to every other rank and start the background thread. `generation` counts the inits of this
    /// process, so a re-init after shutdown meets its peers in a fresh rendezvous scope.
    pub fn start(config: Config, generation: u64) -> Result<Engine, EngineError> {
        let (transport, homogeneous) = connect(&config, generation)?;
        let shared = Arc::new(Shared {
            handles: HandleTable::default(),
            inbox: Mutex::new(Inbox::default()),
            waker: Waker::new().map_err(|e| EngineError::Init(format!("cannot create the wake-up event: {e}")))?,
            shutdown_requested: AtomicBool::new(false),
        });
        let thread_shared = Arc::clone(&shared);
        let thread_config = config.clone();
        let thread = std::thread::Builder::new()
            .name("rvod-engine".into())
            .spawn(move || background::run(thread_shared, transport, thread_config))
            .map_err(|e| EngineError::Init(format!("cannot start the engine thread: {e}")))?;
        Ok(Engine { config, shared, thread: Mutex::new(Some(thread)), homogeneous })
    }

    pub fn topology(&self) -> &Topology {
        &self.config.topology
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    /// Queue a collective. Fails at once (and queues nothing) on bad arguments, a name already in flight,
    /// or a stopped engine.
    pub fn submit(&self, op: OpSubmission) -> Result<HandleId, EngineError> {
        let size = self.config.topology.size;
        let rank = self.config.topology.rank as u32;
        validate_submission::check(&op, size)?;
        let names: Vec<String> = match op.kind {
            CollectiveKind::Barrier => vec![BARRIER_NAME.to_string()],
            CollectiveKind::Join => vec![JOIN_NAME.to_string()],
            _ => op.tensors.iter().map(|t| t.name.clone()).collect(),
        };
        let id = self.shared.handles.register(op.kind.name(), &names, names.len(), op.tensors.len())?;
        let now = Instant::now();
        let request = |name: String, dtype, shape| Request {
            rank,
            kind: op.kind,
            name,
            dtype,
            shape,
            reduce_op: op.reduce_op,
            root_rank: op.root_rank,
            prescale: op.prescale,
            postscale: op.postscale,
            splits: op.splits.clone(),
        };
        let entries: Vec<TensorEntry> = if op.tensors.is_empty() {
            let name = names[0].clone();
            // SAFETY: a zero-length view of no memory.
            let input = unsafe { crate::tensor::RawTensor::new(std::ptr::null_mut(), 0) };
            vec![TensorEntry {
                handle: id,
                index: 0,
                request: request(name, crate::types::DataType::Uint8, Vec::new()),
                input,
                in_place: false,
                submitted: now,
            }]
        } else {
            op.tensors
                .into_iter()
                .enumerate()
                .map(|(index, t)| TensorEntry {
                    handle: id,
                    index,
                    request: request(t.name, t.dtype, t.shape),
                    input: t.input,
                    in_place: t.in_place,
                    submitted: now,
                })
                .collect()
        };
        {
            let mut inbox = self.shared.inbox();
            if let Some(err) = &inbox.closed {
                let err = err.clone();
                drop(inbox);
                self.shared.handles.unregister(id, &names);
                return Err(err);
            }
            inbox.entries.extend(entries);
        }
        self.shared.waker.wake();
        Ok(id)
    }

    /// `Some(true)` once the handle completed, `None` for an unknown handle.
    pub fn poll(&self, id: HandleId) -> Option<bool> {
        self.shared.handles.is_done(id)
    }

    /// Wait up to `slice` for a handle (callers loop, checking for interrupts in between).
    pub fn wait(&self, id: HandleId, slice: Duration) -> WaitOutcome {
        self.shared.handles.wait(id, slice)
    }

    /// Forget a completed handle whose result nobody will collect.
    pub fn release(&self, id: HandleId) {
        self.shared.handles.release(id)
    }

    /// Stop this rank's engine: tell the other ranks (they stop too), fail what is still pending, and join
    /// the background thread.
    pub fn shutdown(&self) {
        self.shared.shutdown_requested.store(true, Ordering::SeqCst);
        self.shared.waker.wake();
        let thread = self.thread.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).take();
        if let Some(thread) = thread {
            // The loop never panics by design; if it did, its handles were already failed by the unwinding.
            let _ = thread.join();
        }
    }

    /// Whether every host runs the same number of ranks.
    pub fn is_homogeneous(&self) -> bool {
        self.homogeneous
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.shutdown();
    }
}
