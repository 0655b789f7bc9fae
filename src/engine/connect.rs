//! Connecting communicators: the rendezvous store, and a transport among the members of a process set:
//! shared memory when every member runs on this host (and `RVOD_SHM` is not 0), TCP otherwise or when the
//! shared-memory segment cannot be set up.

use std::net::{IpAddr, SocketAddr, ToSocketAddrs};
use std::time::Duration;

use crate::config::{Config, Rendezvous, Topology};
use crate::error::EngineError;
use crate::transport::memory::MemoryTransport;
use crate::transport::rendezvous::StoreClient;
use crate::transport::shm::ShmTransport;
use crate::transport::tcp::TcpTransport;
use crate::transport::Transport;

fn resolve(host: &str, port: u16) -> Result<SocketAddr, EngineError> {
    (host, port)
        .to_socket_addrs()
        .map_err(|e| EngineError::Init(format!("cannot resolve rendezvous address {host}:{port}: {e}")))?
        .next()
        .ok_or_else(|| EngineError::Init(format!("rendezvous address {host}:{port} resolves to nothing")))
}

/// Connect to the job's rendezvous store.
pub fn connect_store(rdv: &Rendezvous, timeout: Duration) -> Result<StoreClient, EngineError> {
    let addr = resolve(&rdv.addr, rdv.port)?;
    StoreClient::connect(addr, &rdv.secret, timeout).map_err(|e| EngineError::transport("connecting to the rendezvous store", &e))
}

/// A transport among `members` (global ranks, sorted, containing this rank), meeting in `scope`.
pub fn connect_members(
    config: &Config,
    store: Option<&mut StoreClient>,
    scope: &str,
    members: &[usize],
) -> Result<Box<dyn Transport>, EngineError> {
    let me = config.topology.rank;
    let local_rank = members
        .iter()
        .position(|&r| r == me)
        .ok_or_else(|| EngineError::Internal(format!("rank {me} is not a member of {members:?}")))?;
    if members.len() == 1 {
        let transport = MemoryTransport::mesh(1).pop().ok_or_else(|| EngineError::Internal("no transport".into()))?;
        return Ok(Box::new(transport));
    }
    let (Some(rdv), Some(store)) = (&config.rendezvous, store) else {
        return Err(EngineError::Internal("a multi-rank communicator needs the rendezvous store".into()));
    };
    if config.shm && all_on_this_host(store, scope, local_rank, members.len(), &config.topology.hostname, config.timeout)? {
        let shm = ShmTransport::connect_mesh(
            local_rank,
            members.len(),
            store,
            scope,
            &config.shm_dir,
            config.fusion_threshold,
            config.timeout,
        )
            .map_err(|e| EngineError::transport("setting up shared memory with the other ranks", &e))?;
        if let Some(transport) = shm {
            return Ok(Box::new(transport));
        }
    }
    let bind: IpAddr = rdv
        .bind_addr
        .parse()
        .map_err(|_| EngineError::Config(format!("RVOD_IFACE_ADDR={} is not an IP address", rdv.bind_addr)))?;
    let transport = TcpTransport::connect_mesh(
        local_rank,
        members.len(),
        store,
        scope,
        &rdv.secret,
        bind,
        &rdv.bind_addr,
        config.timeout,
    )
    .map_err(|e| EngineError::transport("connecting to the other ranks", &e))?;
    Ok(Box::new(transport))
}

/// What identifies this machine: the launcher's host name plus the kernel's boot id, so that two machines
/// given the same name are still told apart.
fn host_identity(hostname: &str) -> String {
    let boot_id = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    format!("{hostname}/{}", boot_id.trim())
}

/// Whether all `size` members of the communicator in `scope` run on the same host (every member learns the
/// same answer).
fn all_on_this_host(
    store: &mut StoreClient,
    scope: &str,
    local_rank: usize,
    size: usize,
    hostname: &str,
    timeout: Duration,
) -> Result<bool, EngineError> {
    let fail = |e: crate::transport::TransportError| EngineError::transport("exchanging host names", &e);
    let mine = host_identity(hostname);
    store.set(&format!("{scope}/host/{local_rank}"), mine.as_bytes()).map_err(fail)?;
    let mut same = true;
    for rank in 0..size {
        same &= store.get(&format!("{scope}/host/{rank}"), timeout).map_err(fail)? == mine.as_bytes();
    }
    Ok(same)
}

/// Every rank publishes its host's rank count; the job is homogeneous when all are equal.
pub fn all_hosts_equal(store: &mut StoreClient, scope: &str, topo: &Topology, timeout: Duration) -> Result<bool, EngineError> {
    let fail = |e: crate::transport::TransportError| EngineError::transport("exchanging host sizes", &e);
    store.set(&format!("{scope}/local_size/{}", topo.rank), topo.local_size.to_string().as_bytes()).map_err(fail)?;
    let mut equal = true;
    for rank in 0..topo.size {
        let value = store.get(&format!("{scope}/local_size/{rank}"), timeout).map_err(fail)?;
        equal &= value == topo.local_size.to_string().as_bytes();
    }
    Ok(equal)
}
