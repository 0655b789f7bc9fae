//! Connecting communicators: the rendezvous store, the address data connections listen on, and a transport
//! among the members of a process set: shared memory when every member runs on this host (and `RVOD_SHM`
//! is not 0); across hosts a [`CompositeTransport`] (shared memory among this host's members, TCP or UCX to
//! the others, see [`hosts_transport`]); TCP for everyone where shared memory is off or cannot be set up,
//! and TCP or UCX for everyone where no host has two members. TCP links are made at set-up, a full mesh, on
//! communicators of up to 8 ranks (where negotiation is all-to-all and uses every pair at once), and each when
//! first needed on larger ones (`RVOD_CONNECTIONS`), so a rank holds only the links its algorithms use.

use std::net::{IpAddr, SocketAddr, ToSocketAddrs};
use std::time::Duration;

use super::peer_hosts::PeerHosts;
use crate::config::{Config, Connections, HostsConfig, HostsTransport, Rendezvous, Topology};
use crate::coordinator::tree::ALL_TO_ALL_MAX_RANKS;
use crate::error::EngineError;
use crate::transport::composite::{CompositeTransport, HostLayout};
use crate::transport::memory::MemoryTransport;
use crate::transport::rendezvous::StoreClient;
use crate::transport::shm::ShmTransport;
use crate::transport::tcp::{MeshPlace, TcpTransport};
use crate::transport::ucx::{self, Ucx, UcxTransport};
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
    hosts: &PeerHosts,
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
    // Transports number peers by position; errors name them by global rank (`numbers[position]`) and host.
    let failed = |op: &str, numbers: &[usize], e: TransportError| hosts.failure(op, &e.renumbered(numbers));
    let on_demand = |numbers: &[usize]| match config.connections {
        Connections::Auto => numbers.len() > ALL_TO_ALL_MAX_RANKS,
        Connections::FullMesh => false,
        Connections::OnDemand => true,
    };
    // A TCP mesh among `numbers`: connected on demand (larger communicators) or in full at set-up; UCX's
    // control mesh (`eager`) always in full, since UCX connects every pair through it.
    let tcp_mesh =
        |store: &mut StoreClient, scope: &str, numbers: &[usize], rank: usize, linked: &[bool], eager: bool| {
            let (size, host, timeout) = (numbers.len(), bind.to_string(), config.timeout);
            let place = MeshPlace { rank, size, scope, secret, bind, advertise_host: &host, timeout, linked };
            let built = if on_demand(numbers) && !eager {
                TcpTransport::connect_on_demand(store, &place)
            } else {
                TcpTransport::connect_mesh_linked(store, &place)
            };
            built.map_err(|e| failed("connecting to the other ranks", numbers, e))
        };
    let everyone = vec![true; members.len()];
    if !config.shm {
        return Ok(Box::new(tcp_mesh(store, scope, members, local_rank, &everyone, false)?));
    }
    let layout = host_layout(store, scope, local_rank, members, &config.topology.hostname, config.timeout)?;
    if layout.hosts() == 1 {
        if let Some(shm) = shared_memory(config, store, scope, members, local_rank)? {
            return Ok(Box::new(shm));
        }
        return Ok(Box::new(tcp_mesh(store, scope, members, local_rank, &everyone, false)?));
    }
    let host = layout.host_of(local_rank);
    let host_members = layout.members(host).len();
    let over_ucx = hosts_transport(config, store, scope, local_rank, members)?;
    // Between hosts: rvod's TCP mesh, or UCX over an authenticated TCP mesh kept as its control channel.
    let cross = |store: &mut StoreClient, scope: &str, linked: &[bool]| -> Result<Box<dyn Transport>, EngineError> {
        let Some(ucx) = over_ucx else {
            return Ok(Box::new(tcp_mesh(store, scope, members, local_rank, linked, false)?));
        };
        let control = tcp_mesh(store, &format!("{scope}-ucx"), members, local_rank, linked, true)?;
        let resources = ucx
            .resources()
            .map_err(|e| failed("reading UCX's transports", members, TransportError::Setup(format!("UCX: {e}"))))?;
        let tuning = ucx::tuned(resources, &|name| config.hosts.ucx_settings_set.contains(&name));
        if !tuning.peer_error_handling {
            tracing::debug!(
                "UCX without RDMA here: settings over the environment's {:?}, peer failures seen by rvod's \
                 control mesh (not UCX's error handling, which would cost its TCP transport the zero-copy put)",
                tuning.settings
            );
        }
        let transport = UcxTransport::over(control, ucx, &tuning, config.timeout)
            .map_err(|e| failed("connecting to the other ranks over UCX", members, e))?;
        Ok(Box::new(transport))
    };
    if (0..layout.hosts()).all(|h| layout.members(h).len() == 1) {
        return cross(store, scope, &everyone);
    }
    // Spanning hosts: shared memory among this host's members, TCP or UCX to the members on other hosts.
    let local_scope = format!("{scope}/host{host}");
    let index = layout.local_index(local_rank);
    let here: Vec<usize> = layout.members(host).iter().map(|&r| members[r]).collect();
    let local: Box<dyn Transport> = if host_members == 1 {
        Box::new(MemoryTransport::mesh(1).pop().ok_or_else(|| EngineError::Internal("no transport".into()))?)
    } else {
        match shared_memory(config, store, &local_scope, &here, index)? {
            Some(shm) => Box::new(shm),
            None => Box::new(tcp_mesh(
                store,
                &format!("{local_scope}/tcp"),
                &here,
                index,
                &vec![true; host_members],
                false,
            )?),
        }
    };
    let linked: Vec<bool> = (0..members.len()).map(|r| layout.host_of(r) != host).collect();
    let remote = cross(store, &format!("{scope}/cross"), &linked)?;
    tracing::info!(
        "rank {me}: a communicator of {} ranks on {} hosts: {} here through {}, the others through {}",
        members.len(),
        layout.hosts(),
        host_members,
        local.label(),
        remote.label()
    );
    let composite = CompositeTransport::new(local_rank, layout, local, remote)
        .map_err(|e| failed("connecting to the other ranks", members, e))?;
    Ok(Box::new(composite))
}

/// Whether the links between hosts of the communicator in `scope` go over UCX (the library) or TCP (`None`),
/// as `RVOD_TRANSPORT` says: `ucx` forces UCX (an error where libucp cannot be loaded or is too old); `auto`
/// picks it when every member's UCX reports an RDMA-capable transport (every member learns the same through
/// the store), TCP otherwise, silently but for the log line saying why.
fn hosts_transport(
    config: &Config,
    store: &mut StoreClient,
    scope: &str,
    local_rank: usize,
    members: &[usize],
) -> Result<Option<&'static Ucx>, EngineError> {
    let me = config.topology.rank;
    let hosts = &config.hosts;
    match hosts.transport {
        HostsTransport::Tcp => {
            tracing::info!("rank {me}: between hosts through TCP (RVOD_TRANSPORT=tcp)");
            Ok(None)
        }
        HostsTransport::Ucx => {
            let ucx = ucx::ucx(hosts.ucx_library.as_deref())
                .map_err(|why| EngineError::Init(format!("rank {me}: RVOD_TRANSPORT=ucx, but {why}")))?;
            tracing::info!(
                "rank {me}: between hosts through UCX {} from {} (RVOD_TRANSPORT=ucx)",
                ucx.version,
                ucx.path.display()
            );
            Ok(Some(ucx))
        }
        HostsTransport::Auto => {
            let (ucx, why) = rdma_here(hosts);
            let fail = |e: TransportError| EngineError::transport("exchanging RDMA support", &e.renumbered(members));
            store.set(&format!("{scope}/rdma/{local_rank}"), if ucx.is_some() { b"1" } else { b"0" }).map_err(fail)?;
            let keys: Vec<(usize, String)> =
                (0..members.len()).map(|rank| (rank, format!("{scope}/rdma/{rank}"))).collect();
            let answers = store.get_all_from(&keys, config.timeout).map_err(fail)?;
            let without = members.iter().zip(&answers).find(|(_, answer)| answer.as_slice() != b"1").map(|(&g, _)| g);
            match (ucx, without) {
                (Some(ucx), None) => {
                    tracing::info!("rank {me}: between hosts through UCX (RVOD_TRANSPORT=auto): {why}");
                    Ok(Some(ucx))
                }
                (_, Some(rank)) if rank != me => {
                    tracing::info!(
                        "rank {me}: between hosts through TCP (RVOD_TRANSPORT=auto): rank {rank} has no RDMA"
                    );
                    Ok(None)
                }
                _ => {
                    tracing::info!("rank {me}: between hosts through TCP (RVOD_TRANSPORT=auto): {why}");
                    Ok(None)
                }
            }
        }
    }
}

/// This rank's UCX where it reports an RDMA-capable transport, and what was found (or why not).
fn rdma_here(hosts: &HostsConfig) -> (Option<&'static Ucx>, String) {
    let devices = std::fs::read_dir("/sys/class/infiniband").map(|dir| dir.count()).unwrap_or(0);
    if devices == 0 {
        return (None, "no RDMA device here (/sys/class/infiniband is empty or absent)".into());
    }
    let ucx = match ucx::ucx(hosts.ucx_library.as_deref()) {
        Ok(ucx) => ucx,
        Err(why) => return (None, why),
    };
    match ucx.resources() {
        Err(why) => (None, format!("UCX {}: {why}", ucx.version)),
        Ok(resources) => {
            let rdma = ucx::rdma_transports(resources);
            if rdma.is_empty() {
                (None, format!("UCX {} reports no RDMA transport (only {})", ucx.version, resources.join(", ")))
            } else {
                (Some(ucx), format!("UCX {} reports {}", ucx.version, rdma.join(", ")))
            }
        }
    }
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
    let names: Vec<(usize, String)> = (0..members.len()).map(|rank| (rank, format!("{scope}/host/{rank}"))).collect();
    let keys = store.get_all_from(&names, timeout).map_err(fail)?;
    Ok(HostLayout::from_keys(&keys))
}

/// What every rank learns of the job's hosts at `init()`: the host each global rank runs on, and whether
/// the job is homogeneous (every host runs as many ranks).
pub struct JobHosts {
    pub names: PeerHosts,
    pub homogeneous: bool,
}

/// Every rank publishes its host's rank count and its host name (one key); all learn everyone's.
pub fn job_hosts(
    store: &mut StoreClient,
    scope: &str,
    topo: &Topology,
    timeout: Duration,
) -> Result<JobHosts, EngineError> {
    let fail = |e: TransportError| EngineError::transport("exchanging host names and sizes", &e);
    let mine = format!("{} {}", topo.local_size, topo.hostname);
    store.set(&format!("{scope}/host/{}", topo.rank), mine.as_bytes()).map_err(fail)?;
    let mut homogeneous = true;
    let mut names = Vec::with_capacity(topo.size);
    let keys: Vec<(usize, String)> = (0..topo.size).map(|rank| (rank, format!("{scope}/host/{rank}"))).collect();
    for value in store.get_all_from(&keys, timeout).map_err(fail)? {
        let value = String::from_utf8_lossy(&value);
        let (local_size, name) = value.split_once(' ').unwrap_or((&value, ""));
        homogeneous &= local_size == topo.local_size.to_string();
        names.push(name.to_string());
    }
    Ok(JobHosts { names: PeerHosts::new(names), homogeneous })
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
