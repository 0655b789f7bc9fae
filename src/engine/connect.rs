//! Connecting communicators: the rendezvous store, and a transport among the members of a process set.

use std::net::{IpAddr, SocketAddr, ToSocketAddrs};
use std::time::Duration;

use crate::config::{Config, Rendezvous, Topology};
use crate::error::EngineError;
use crate::transport::memory::MemoryTransport;
use crate::transport::rendezvous::StoreClient;
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
    let bind: IpAddr = rdv
        .bind_addr
        .parse()
        .map_err(|_| EngineError::Init(format!("RVOD_IFACE_ADDR={} is not an IP address", rdv.bind_addr)))?;
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
