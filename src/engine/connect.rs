//! Connecting communicators: the rendezvous store, the address data connections listen on, and a transport
//! among the members of a process set: shared memory when every member runs on this host (and `RVOD_SHM`
//! is not 0); across hosts a [`CompositeTransport`] (shared memory among this host's members, TCP to the
//! others); TCP for everyone where shared memory is off, cannot be set up, or no host has two members.

use std::net::{IpAddr, SocketAddr, ToSocketAddrs};
use std::time::Duration;

use crate::config::{Config, Rendezvous, Topology};
use crate::error::EngineError;
use crate::transport::composite::{CompositeTransport, HostLayout};
use crate::transport::memory::MemoryTransport;
use crate::transport::rendezvous::StoreClient;
use crate::transport::shm::ShmTransport;
use crate::transport::tcp::TcpTransport;
use crate::transport::{Transport, TransportError};

fn resolve(host: &str, port: u16) -> Result<SocketAddr, EngineError> {
    (host, port)
        .to_socket_addrs()
        .map_err(|e| EngineError::Init(format!("cannot resolve rendezvous address {host}:{port}: {e}")))?
        .next()
        .ok_or_else(|| EngineError::Init(format!("rendezvous address {host}:{port} resolves to nothing")))
}

/// The address this rank's data listeners bind to and advertise (see [`crate::transport::net`]), logged
/// with the reason it was chosen.
pub fn data_address(rdv: &Rendezvous, rank: usize) -> Result<IpAddr, EngineError> {
    let rendezvous = resolve(&rdv.addr, rdv.port)?;
    let (addr, why) = crate::transport::net::choose_bind_address(&rdv.bind, rendezvous).map_err(EngineError::Init)?;
    tracing::info!("rank {rank}: data connections listen on {why}");
    Ok(addr)
}

/// Connect to the job's rendezvous store.
pub fn connect_store(rdv: &Rendezvous, timeout: Duration) -> Result<StoreClient, EngineError> {
    let addr = resolve(&rdv.addr, rdv.port)?;
    StoreClient::connect(addr, &rdv.secret, timeout)
        .map_err(|e| EngineError::transport("connecting to the rendezvous store", &e))
}

/// A transport among `members` (global ranks, sorted, containing this rank), meeting in `scope`.
pub fn connect_members(
    config: &Config,
    data_addr: Option<IpAddr>,
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
    let (Some(rdv), Some(store), Some(bind)) = (&config.rendezvous, store, data_addr) else {
        return Err(EngineError::Internal("a multi-rank communicator needs the rendezvous store".into()));
    };
    let secret = &rdv.secret;
    // Transports number peers by position; errors name them by global rank (`numbers[position]`).
    let failed = |op: &str, numbers: &[usize], e: TransportError| EngineError::transport(op, &e.renumbered(numbers));
    let tcp_mesh = |store: &mut StoreClient, scope: &str, numbers: &[usize], rank: usize, linked: &[bool]| {
        TcpTransport::connect_mesh_linked(
            rank,
            numbers.len(),
            store,
            scope,
            secret,
            bind,
            &bind.to_string(),
            config.timeout,
            linked,
        )
        .map_err(|e| failed("connecting to the other ranks", numbers, e))
    };
    let everyone = vec![true; members.len()];
    if !config.shm {
        return Ok(Box::new(tcp_mesh(store, scope, members, local_rank, &everyone)?));
    }
    let layout = host_layout(store, scope, local_rank, members, &config.topology.hostname, config.timeout)?;
    if layout.hosts() == 1 {
        if let Some(shm) = shared_memory(config, store, scope, members, local_rank)? {
            return Ok(Box::new(shm));
        }
        return Ok(Box::new(tcp_mesh(store, scope, members, local_rank, &everyone)?));
    }
    let host = layout.host_of(local_rank);
    let host_members = layout.members(host).len();
    if (0..layout.hosts()).all(|h| layout.members(h).len() == 1) {
        return Ok(Box::new(tcp_mesh(store, scope, members, local_rank, &everyone)?));
    }
    // Spanning hosts: shared memory among this host's members, TCP to the members on other hosts.
    let local_scope = format!("{scope}/host{host}");
    let index = layout.local_index(local_rank);
    let here: Vec<usize> = layout.members(host).iter().map(|&r| members[r]).collect();
    let local: Box<dyn Transport> = if host_members == 1 {
        Box::new(MemoryTransport::mesh(1).pop().ok_or_else(|| EngineError::Internal("no transport".into()))?)
    } else {
        match shared_memory(config, store, &local_scope, &here, index)? {
            Some(shm) => Box::new(shm),
            None => Box::new(tcp_mesh(store, &format!("{local_scope}/tcp"), &here, index, &vec![true; host_members])?),
        }
    };
    let linked: Vec<bool> = (0..members.len()).map(|r| layout.host_of(r) != host).collect();
    let remote = tcp_mesh(store, &format!("{scope}/cross"), members, local_rank, &linked)?;
    tracing::info!(
        "rank {me}: a communicator of {} ranks on {} hosts: {} here through {}, the others through TCP",
        members.len(),
        layout.hosts(),
        host_members,
        local.label()
    );
    let composite = CompositeTransport::new(local_rank, layout, local, Box::new(remote))
        .map_err(|e| failed("connecting to the other ranks", members, e))?;
    Ok(Box::new(composite))
}

/// The shared-memory mesh on this host of the ranks `numbers` (global ranks; this rank is at position `rank`)
/// meeting in `scope`, or `None` where shared memory is unusable (every rank learns the same).
fn shared_memory(
    config: &Config,
    store: &mut StoreClient,
    scope: &str,
    numbers: &[usize],
    rank: usize,
) -> Result<Option<ShmTransport>, EngineError> {
    ShmTransport::connect_mesh(rank, numbers, store, scope, &config.shm_dir, config.fusion_threshold, config.timeout)
        .map_err(|e| EngineError::transport("setting up shared memory with the other ranks", &e.renumbered(numbers)))
}

/// What identifies this machine: the launcher's host name plus the kernel's boot id, so that two machines
/// given the same name are still told apart.
fn host_identity(hostname: &str) -> String {
    let boot_id = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    format!("{hostname}/{}", boot_id.trim())
}

/// Which host each of the `members` (global ranks) of the communicator in `scope` runs on (every member
/// learns the same layout). Keys are numbered by position; errors name global ranks.
fn host_layout(
    store: &mut StoreClient,
    scope: &str,
    local_rank: usize,
    members: &[usize],
    hostname: &str,
    timeout: Duration,
) -> Result<HostLayout, EngineError> {
    let fail = |e: TransportError| EngineError::transport("exchanging host names", &e.renumbered(members));
    store.set(&format!("{scope}/host/{local_rank}"), host_identity(hostname).as_bytes()).map_err(fail)?;
    let mut keys = Vec::with_capacity(members.len());
    for rank in 0..members.len() {
        keys.push(store.get_from(rank, &format!("{scope}/host/{rank}"), timeout).map_err(fail)?);
    }
    Ok(HostLayout::from_keys(&keys))
}

/// Every rank publishes its host's rank count; the job is homogeneous when all are equal.
pub fn all_hosts_equal(
    store: &mut StoreClient,
    scope: &str,
    topo: &Topology,
    timeout: Duration,
) -> Result<bool, EngineError> {
    let fail = |e: TransportError| EngineError::transport("exchanging host sizes", &e);
    store.set(&format!("{scope}/local_size/{}", topo.rank), topo.local_size.to_string().as_bytes()).map_err(fail)?;
    let mut equal = true;
    for rank in 0..topo.size {
        let value = store.get_from(rank, &format!("{scope}/local_size/{rank}"), timeout).map_err(fail)?;
        equal &= value == topo.local_size.to_string().as_bytes();
    }
    Ok(equal)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::rendezvous::RendezvousServer;
    use std::net::Ipv4Addr;

    #[test]
    fn a_set_up_timeout_inside_a_process_set_names_the_global_rank_that_never_published() {
        let server = RendezvousServer::start(Ipv4Addr::LOCALHOST.into(), 0, b"k".to_vec()).unwrap();
        let mut store = StoreClient::connect(server.addr(), b"k", Duration::from_secs(5)).unwrap();
        // Global rank 5 is position 1 of the set [2, 5]; position 0 (global rank 2) never publishes.
        let err = host_layout(&mut store, "set1", 1, &[2, 5], "h", Duration::from_millis(100)).unwrap_err().to_string();
        assert!(err.contains("waiting for rank 2 to publish 'set1/host/0'"), "{err}");
        assert!(err.contains("exchanging host names"), "{err}");
        assert!(!err.contains("rank 0") && !err.contains("rank 1 "), "{err}");
    }
}
