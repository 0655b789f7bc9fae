//! Meeting the other ranks of a job a launcher started: rank 0 serves the rendezvous store, every rank finds
//! it, and the ranks learn from each other's hosts what the launcher did not say about the topology.
//!
//! How the others find rank 0's store, first that applies:
//! 1. over MPI (mpi4py importable, or `hvd.init(comm=...)`): rank 0 broadcasts its addresses, port and a
//!    fresh secret ([`Offer`]);
//! 2. one host (the launcher says so) and no `RVOD_RENDEZVOUS_ADDR`: rank 0 writes its port and a fresh
//!    secret to a private 0600 file ([`crate::private_file`]) that the other ranks on the host read;
//! 3. an address: `RVOD_RENDEZVOUS_ADDR`, torchrun's `MASTER_ADDR` or the first host of Slurm's node list,
//!    on `RVOD_RENDEZVOUS_PORT`, `MASTER_PORT + 1` or a port derived from the Slurm job id; the secret comes
//!    from `RVOD_SECRET` / `RVOD_SECRET_FILE`. Without one this is refused unless `RVOD_INSECURE_RENDEZVOUS`
//!    asks for an unauthenticated job.
//!
//! [`serve`] runs first (rank 0 starts its store; quick, so the caller may hold the GIL for the MPI
//! broadcast), then [`meet`] blocks until every rank has registered or the start timeout passes.

use std::net::{IpAddr, Ipv4Addr, SocketAddr, ToSocketAddrs, UdpSocket};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use crate::config::{Config, Rendezvous};
use crate::error::EngineError;
use crate::launched::BindAddress;
use crate::launched::{LaunchPlan, Launcher};
use crate::private_file;
use crate::transport::rendezvous::{RendezvousServer, StoreClient};

/// Secret of a job run with `RVOD_INSECURE_RENDEZVOUS`: public, so it authenticates nobody.
const INSECURE_SECRET: &[u8] = b"rvod insecure rendezvous: no secret";
/// Longest single attempt to reach one candidate address before trying the next.
const ATTEMPT: Duration = Duration::from_secs(2);
const POLL: Duration = Duration::from_millis(50);
const OFFER_MAGIC: &str = "rvod-offer 1";
const FAILED_MAGIC: &str = "rvod-offer failed";

/// Rank 0's store, alive as long as the engine; dropping it stops serving and removes the private file.
pub struct HostedStore {
    server: Option<RendezvousServer>,
    file: Option<PathBuf>,
    port: u16,
    secret: Vec<u8>,
    /// Where rank 0 itself reaches its store.
    own_addr: IpAddr,
}

impl Drop for HostedStore {
    fn drop(&mut self) {
        if let Some(server) = self.server.take() {
            server.stop();
        }
        if let Some(file) = self.file.take() {
            let _ = std::fs::remove_file(file);
        }
    }
}

/// What rank 0 sends the others over MPI: where its store listens and the job's secret.
#[derive(Clone, Debug, PartialEq)]
pub struct Offer {
    pub addrs: Vec<String>,
    pub port: u16,
    pub secret: Vec<u8>,
}

impl Offer {
    pub fn encode(&self) -> Vec<u8> {
        let secret: String = self.secret.iter().map(|b| format!("{b:02x}")).collect();
        format!("{OFFER_MAGIC}\n{}\n{secret}\n{}", self.port, self.addrs.join(" ")).into_bytes()
    }

    /// What rank 0 sends instead of an offer when it cannot serve, so the others fail too instead of waiting.
    pub fn failure(error: &EngineError) -> Vec<u8> {
        let reason = match error {
            EngineError::Init(reason) => reason.clone(),
            other => other.to_string(),
        };
        format!("{FAILED_MAGIC}\n{reason}").into_bytes()
    }

    pub fn decode(bytes: &[u8]) -> Result<Offer, EngineError> {
        let bad = || EngineError::Init("rank 0's rendezvous offer received over MPI is malformed".into());
        let text = std::str::from_utf8(bytes).map_err(|_| bad())?;
        if let Some(reason) = text.strip_prefix(FAILED_MAGIC) {
            let reason = reason.trim_start();
            return Err(EngineError::Init(format!("rank 0 could not start the job's rendezvous store: {reason}")));
        }
        let mut lines = text.split('\n');
        if lines.next() != Some(OFFER_MAGIC) {
            return Err(bad());
        }
        let port = lines.next().and_then(|p| p.parse::<u16>().ok()).ok_or_else(bad)?;
        let secret = lines.next().and_then(|s| private_file::parse_hex(s).ok()).ok_or_else(bad)?;
        let addrs: Vec<String> = lines.next().unwrap_or("").split_whitespace().map(str::to_string).collect();
        if port == 0 || secret.is_empty() || addrs.is_empty() {
            return Err(bad());
        }
        Ok(Offer { addrs, port, secret })
    }
}

/// How this job's ranks find rank 0's store.
#[derive(Debug)]
enum Way {
    Mpi,
    PrivateFile(PathBuf),
    Address { host: String, host_source: String, port: u16, port_source: String, secret: Vec<u8> },
}

fn who(config: &Config, plan: &LaunchPlan) -> String {
    format!("rank {} of {} (started by {})", config.topology.rank, config.topology.size, plan.launcher.name())
}

fn init_error(message: String) -> EngineError {
    EngineError::Init(message)
}

fn way(config: &Config, plan: &LaunchPlan, over_mpi: bool, announce: bool) -> Result<Way, EngineError> {
    if over_mpi {
        return Ok(Way::Mpi);
    }
    let named_host = plan.store_host.as_ref().filter(|(_, source)| source.ends_with("_RENDEZVOUS_ADDR"));
    if plan.one_host == Some(true) && named_host.is_none() {
        let path = private_file::rendezvous_path(&plan.run_key)
            .map_err(|e| init_error(format!("{}: cannot use a private rendezvous file: {e}", who(config, plan))))?;
        return Ok(Way::PrivateFile(path));
    }
    let mpi_hint =
        if plan.launcher.is_mpi() { "install mpi4py (rank 0 then sends the address over MPI), or " } else { "" };
    let (host, host_source) = plan.store_host.clone().ok_or_else(|| {
        init_error(format!(
            "{}: the ranks may run on several hosts and nothing says where rank 0's rendezvous store is: \
             {mpi_hint}set RVOD_RENDEZVOUS_ADDR to rank 0's host (and RVOD_RENDEZVOUS_PORT)",
            who(config, plan)
        ))
    })?;
    let (port, port_source) = plan.store_port.clone().ok_or_else(|| {
        init_error(format!(
            "{}: set RVOD_RENDEZVOUS_PORT to the port rank 0's rendezvous store listens on",
            who(config, plan)
        ))
    })?;
    let secret = match (&plan.secret, plan.insecure) {
        (Some((secret, _)), _) => secret.clone(),
        (None, true) => {
            if announce {
                tracing::warn!(
                    "{}: RVOD_INSECURE_RENDEZVOUS is set and no secret is: anybody who can reach {host}:{port} can \
                     join this job or read what it exchanges",
                    who(config, plan)
                );
            }
            INSECURE_SECRET.to_vec()
        }
        (None, false) => {
            // A setting the user must give, not a failure of the machine: ValueError.
            return Err(EngineError::Config(format!(
                "{}: the ranks may run on several hosts and no secret is set, so rank 0's rendezvous store could \
                 not authenticate anybody. Set RVOD_SECRET (hex digits, e.g. from `openssl rand -hex 32`) or \
                 RVOD_SECRET_FILE (a 0600 file holding them) to the same value on every rank, {mpi_hint}\
                 set RVOD_INSECURE_RENDEZVOUS=1 to run without authentication",
                who(config, plan)
            )));
        }
    };
    Ok(Way::Address { host, host_source, port, port_source, secret })
}

fn fresh_secret() -> Result<Vec<u8>, EngineError> {
    let mut secret = vec![0u8; 32];
    getrandom::getrandom(&mut secret).map_err(|e| init_error(format!("no randomness for the job's secret: {e}")))?;
    Ok(secret)
}

fn parse_ip(text: &str, name: &str) -> Result<IpAddr, EngineError> {
    text.parse().map_err(|_| init_error(format!("{name}={text} is not an IP address")))
}

fn is_loopback_host(host: &str) -> bool {
    (host, 0).to_socket_addrs().map(|mut addrs| addrs.all(|a| a.ip().is_loopback())).unwrap_or(false)
}

/// Rank 0 starts its store (and, for a one-host job, publishes the private file); returns what it offers
/// the others over MPI when `over_mpi`. Other ranks only check that the job can be authenticated.
/// Nothing happens for a job rvodrun started (no launch plan).
pub fn serve(config: &Config, over_mpi: bool) -> Result<(Option<HostedStore>, Option<Offer>), EngineError> {
    let Some(plan) = &config.launch else { return Ok((None, None)) };
    let way = way(config, plan, over_mpi, true)?;
    if config.topology.rank != 0 {
        return Ok((None, None));
    }
    let iface = plan.iface_addr.as_deref().map(|a| parse_ip(a, "RVOD_IFACE_ADDR")).transpose()?;
    let loopback = IpAddr::V4(Ipv4Addr::LOCALHOST);
    let one_host = plan.one_host == Some(true);
    let (bind, port, secret) = match &way {
        Way::Mpi => (
            iface.unwrap_or(if one_host { loopback } else { Ipv4Addr::UNSPECIFIED.into() }),
            named_port(plan),
            plan_secret(plan)?,
        ),
        Way::PrivateFile(_) => (iface.unwrap_or(loopback), named_port(plan), plan_secret(plan)?),
        Way::Address { host, port, secret, .. } => {
            let local = if is_loopback_host(host) { loopback } else { Ipv4Addr::UNSPECIFIED.into() };
            (iface.unwrap_or(local), *port, secret.clone())
        }
    };
    let server = RendezvousServer::start(bind, port, secret.clone()).map_err(|e| {
        init_error(format!(
            "{}: cannot start the rendezvous store on {bind}:{port}: {e}{}",
            who(config, plan),
            if port != 0 { " (set RVOD_RENDEZVOUS_PORT to a free port)" } else { "" }
        ))
    })?;
    let own_addr = if bind.is_unspecified() { loopback } else { bind };
    let mut hosted =
        HostedStore { port: server.port(), server: Some(server), file: None, secret: secret.clone(), own_addr };
    if let Way::PrivateFile(path) = &way {
        private_file::publish(path, hosted.port, &secret)
            .map_err(|e| init_error(format!("{}: {e}", who(config, plan))))?;
        hosted.file = Some(path.clone());
    }
    let offer = over_mpi.then(|| Offer { addrs: advertised(iface, one_host), port: hosted.port, secret });
    Ok((Some(hosted), offer))
}

/// `RVOD_RENDEZVOUS_PORT` when the user named one; else any free port (the others learn it).
fn named_port(plan: &LaunchPlan) -> u16 {
    plan.store_port.as_ref().filter(|(_, source)| source.ends_with("_RENDEZVOUS_PORT")).map_or(0, |(port, _)| *port)
}

fn plan_secret(plan: &LaunchPlan) -> Result<Vec<u8>, EngineError> {
    match &plan.secret {
        Some((secret, _)) => Ok(secret.clone()),
        None => fresh_secret(),
    }
}

/// The addresses rank 0 tells the others to try, best first.
fn advertised(iface: Option<IpAddr>, one_host: bool) -> Vec<String> {
    if let Some(iface) = iface {
        return vec![iface.to_string()];
    }
    if one_host {
        return vec![Ipv4Addr::LOCALHOST.to_string()];
    }
    let mut addrs = local_ipv4_addresses(&std::fs::read_to_string("/proc/net/fib_trie").unwrap_or_default());
    addrs.push(crate::launched::system_hostname());
    addrs.push(Ipv4Addr::LOCALHOST.to_string());
    addrs
}

/// This host's IPv4 addresses other than loopback, from the kernel's local routing table (`/proc/net/fib_trie`).
fn local_ipv4_addresses(fib_trie: &str) -> Vec<String> {
    let mut addrs: Vec<String> = Vec::new();
    let mut last: Option<&str> = None;
    for line in fib_trie.lines() {
        let line = line.trim();
        if let Some(ip) = line.strip_prefix("|-- ") {
            last = Some(ip);
        } else if line == "/32 host LOCAL" {
            if let Some(ip) = last.and_then(|ip| ip.parse::<Ipv4Addr>().ok()) {
                if !ip.is_loopback() && !addrs.contains(&ip.to_string()) {
                    addrs.push(ip.to_string());
                }
            }
        }
    }
    addrs
}

/// What identifies this host among the ranks: its name, boot id and network namespace.
fn host_identity(hostname: &str) -> String {
    let boot_id = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    let netns = std::fs::read_link("/proc/self/ns/net").map(|p| p.display().to_string()).unwrap_or_default();
    format!("{hostname}/{}/{netns}", boot_id.trim())
}

/// Finds rank 0's store (every rank, rank 0 included), registers this rank's host, and returns `config` with
/// its rendezvous and any topology the launcher did not give filled in. `hosted` is rank 0's store,
/// `offer` what rank 0 sent over MPI. A job without a launch plan is returned unchanged.
pub fn meet(
    mut config: Config,
    generation: u64,
    hosted: Option<&HostedStore>,
    offer: Option<Offer>,
) -> Result<Config, EngineError> {
    let Some(plan) = config.launch.clone() else { return Ok(config) };
    let way = way(&config, &plan, offer.is_some(), false)?;
    let deadline = Instant::now() + config.start_timeout;
    // Rank 0 marks its store as this init's; a rank that reached the store of an earlier init (still
    // stopping) finds no mark, and tries again.
    let open_key = format!("launch{generation}/open");
    let (mut client, reached, secret, how) = loop {
        let (mut client, reached, secret, how) = match (hosted, &way) {
            (Some(hosted), _) => {
                let addr = SocketAddr::new(hosted.own_addr, hosted.port);
                let client = StoreClient::connect(addr, &hosted.secret, config.start_timeout).map_err(|e| {
                    init_error(format!("{}: cannot reach its own rendezvous store: {e}", who(&config, &plan)))
                })?;
                (client, addr, hosted.secret.clone(), "its own store".to_string())
            }
            (None, Way::Mpi) => {
                let offer =
                    offer.as_ref().ok_or_else(|| EngineError::Internal("no rendezvous offer received".into()))?;
                let how = "address and secret sent by rank 0 over MPI";
                let (client, reached) = reach(&config, &plan, &offer.addrs, offer.port, &offer.secret, deadline, how)?;
                (client, reached, offer.secret.clone(), how.to_string())
            }
            (None, Way::PrivateFile(path)) => {
                let (client, reached, secret) = reach_through_file(&config, &plan, path, deadline)?;
                (client, reached, secret, format!("port and secret from the private file {}", path.display()))
            }
            (None, Way::Address { host, host_source, port, port_source, secret }) => {
                let how = format!("{host_source}, port {port_source}");
                let (client, reached) =
                    reach(&config, &plan, std::slice::from_ref(host), *port, secret, deadline, &how)?;
                (client, reached, secret.clone(), how)
            }
        };
        let fail =
            |e: crate::transport::TransportError| init_error(format!("{}: rendezvous store: {e}", who(&config, &plan)));
        if hosted.is_some() {
            client.set(&open_key, b"1").map_err(fail)?;
            break (client, reached, secret, how);
        }
        let left = deadline.saturating_duration_since(Instant::now());
        match client.get(&open_key, left.min(Duration::from_secs(1))) {
            Ok(_) => break (client, reached, secret, how),
            Err(_) if Instant::now() < deadline => std::thread::sleep(POLL),
            Err(e) => return Err(fail(e)),
        }
    };
    tracing::info!("{}: reached rank 0's rendezvous store at {reached} ({how})", who(&config, &plan));
    let peers = exchange_hosts(&mut client, &config, &plan, generation, reached.ip(), deadline)?;
    drop(client);
    complete_topology(&mut config, &plan, &peers);
    let bind = match &plan.data_bind {
        BindAddress::Auto => BindAddress::Explicit(
            data_address(&config, &peers, reached.ip()).parse().unwrap_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED)),
        ),
        chosen => chosen.clone(),
    };
    config.rendezvous = Some(Rendezvous { addr: reached.ip().to_string(), port: reached.port(), secret, bind });
    Ok(config)
}

/// Tries `candidates` on `port` in turn until one answers with the job's secret, or the deadline passes.
fn reach(
    config: &Config,
    plan: &LaunchPlan,
    candidates: &[String],
    port: u16,
    secret: &[u8],
    deadline: Instant,
    source: &str,
) -> Result<(StoreClient, SocketAddr), EngineError> {
    let mut last_error = String::from("no attempt was made");
    loop {
        for candidate in candidates {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            let addr = match (candidate.as_str(), port).to_socket_addrs().map(|mut a| a.find(SocketAddr::is_ipv4)) {
                Ok(Some(addr)) => addr,
                Ok(None) => {
                    last_error = format!("{candidate} has no IPv4 address");
                    continue;
                }
                Err(e) => {
                    last_error = format!("cannot resolve {candidate}: {e}");
                    continue;
                }
            };
            match StoreClient::connect(addr, secret, left.min(ATTEMPT)) {
                Ok(client) => return Ok((client, addr)),
                Err(e) => last_error = e.to_string(),
            }
        }
        if Instant::now() >= deadline {
            return Err(EngineError::StartTimeout(format!(
                "{}: could not reach rank 0's rendezvous store at {} port {port} ({source}) within {:.1} s: \
                 {last_error}. Is rank 0 running and calling hvd.init(), on that host and port? \
                 (RVOD_START_TIMEOUT sets the wait)",
                who(config, plan),
                candidates.join(" or "),
                config.start_timeout.as_secs_f64()
            )));
        }
        std::thread::sleep(POLL);
    }
}

/// A one-host job: waits for rank 0's private file, then its store (a stale file from an earlier run is
/// read again until rank 0 replaces it).
fn reach_through_file(
    config: &Config,
    plan: &LaunchPlan,
    path: &std::path::Path,
    deadline: Instant,
) -> Result<(StoreClient, SocketAddr, Vec<u8>), EngineError> {
    let mut last_error = None;
    while Instant::now() < deadline {
        match private_file::read_rendezvous(path) {
            Err(e) => return Err(init_error(format!("{}: {e}", who(config, plan)))),
            Ok(None) => {}
            Ok(Some(published)) => {
                let addr = SocketAddr::new(Ipv4Addr::LOCALHOST.into(), published.port);
                let left = deadline.saturating_duration_since(Instant::now());
                match StoreClient::connect(addr, &published.secret, left.min(Duration::from_millis(500))) {
                    Ok(client) => return Ok((client, addr, published.secret)),
                    Err(e) => {
                        last_error =
                            Some(format!("rank 0 (pid {}) published port {}, but: {e}", published.pid, published.port))
                    }
                }
            }
        }
        std::thread::sleep(POLL);
    }
    Err(EngineError::StartTimeout(format!(
        "{}: rank 0 did not publish a reachable rendezvous store in {} within {:.1} s{}. Is rank 0 running and \
         calling hvd.init()? (RVOD_START_TIMEOUT sets the wait)",
        who(config, plan),
        path.display(),
        config.start_timeout.as_secs_f64(),
        last_error.map(|e| format!(" ({e})")).unwrap_or_default()
    )))
}

/// What each rank registered: its host and, when the launcher said, its local rank.
#[derive(Debug, Clone, PartialEq)]
struct Peer {
    host: String,
    local_rank: Option<usize>,
    /// The address through which this rank reached rank 0's store.
    reached: String,
}

fn exchange_hosts(
    client: &mut StoreClient,
    config: &Config,
    plan: &LaunchPlan,
    generation: u64,
    reached: IpAddr,
    deadline: Instant,
) -> Result<Vec<Peer>, EngineError> {
    let topo = &config.topology;
    let fail = |e: crate::transport::TransportError| {
        init_error(format!("{}: registering with the other ranks: {e}", who(config, plan)))
    };
    let key = |rank: usize| format!("launch{generation}/peer/{rank}");
    let local = if plan.local_known { topo.local_rank.to_string() } else { String::new() };
    let mine = format!("{}\n{local}\n{reached}", host_identity(&topo.hostname));
    client.set(&key(topo.rank), mine.as_bytes()).map_err(fail)?;
    let mut peers = Vec::with_capacity(topo.size);
    let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
    let keys: Vec<(usize, String)> = (0..topo.size).map(|rank| (rank, key(rank))).collect();
    let values = client.get_all_from(&keys, left).map_err(|e| {
        let rank = e.peers().first().map_or_else(|| "a rank".to_string(), |rank| format!("rank {rank}"));
        EngineError::StartTimeout(format!(
            "{}: {rank} did not register with rank 0's rendezvous store within {:.1} s ({e}); \
             is it running and calling hvd.init()?",
            who(config, plan),
            config.start_timeout.as_secs_f64()
        ))
    })?;
    for value in values {
        let text = String::from_utf8_lossy(&value);
        let mut parts = text.splitn(3, '\n');
        let host = parts.next().unwrap_or_default().to_string();
        let local_rank = parts.next().and_then(|l| l.parse::<usize>().ok());
        let reached = parts.next().unwrap_or_default().to_string();
        peers.push(Peer { host, local_rank, reached });
    }
    Ok(peers)
}

/// Hosts in order of their first rank, and each rank's host index.
fn hosts_of(peers: &[Peer]) -> (Vec<&str>, Vec<usize>) {
    let mut hosts: Vec<&str> = Vec::new();
    let index = peers
        .iter()
        .map(|peer| match hosts.iter().position(|h| *h == peer.host) {
            Some(i) => i,
            None => {
                hosts.push(&peer.host);
                hosts.len() - 1
            }
        })
        .collect();
    (hosts, index)
}

/// Local and cross rank and size where the launcher did not give them, from where every rank runs: local
/// ranks number a host's ranks in rank order; a rank's cross rank is its host's index among the hosts
/// that run a rank with its local rank (Horovod's definition).
fn complete_topology(config: &mut Config, plan: &LaunchPlan, peers: &[Peer]) {
    let (_, host_of) = hosts_of(peers);
    let me = config.topology.rank;
    let local_ranks: Vec<usize> = (0..peers.len())
        .map(|r| match (plan.local_known, peers[r].local_rank) {
            (true, Some(local)) => local,
            _ => (0..r).filter(|&q| host_of[q] == host_of[r]).count(),
        })
        .collect();
    if !plan.local_known {
        config.topology.local_rank = local_ranks[me];
        config.topology.local_size = host_of.iter().filter(|&&h| h == host_of[me]).count();
    }
    if !plan.cross_known {
        let local_rank = config.topology.local_rank;
        let mut hosts_with_local_rank: Vec<usize> =
            (0..peers.len()).filter(|&r| local_ranks[r] == local_rank).map(|r| host_of[r]).collect();
        hosts_with_local_rank.sort_unstable();
        hosts_with_local_rank.dedup();
        config.topology.cross_size = hosts_with_local_rank.len().max(1);
        config.topology.cross_rank = hosts_with_local_rank.iter().position(|&h| h == host_of[me]).unwrap_or(0);
    }
}

/// The address this rank's data listener binds to and advertises: loopback when every rank runs on this
/// host; on rank 0's host, the address a rank on another host reached rank 0 at; elsewhere, this host's
/// address on the route to rank 0.
fn data_address(config: &Config, peers: &[Peer], reached: IpAddr) -> String {
    let (hosts, host_of) = hosts_of(peers);
    if hosts.len() <= 1 {
        return Ipv4Addr::LOCALHOST.to_string();
    }
    let me = config.topology.rank;
    if host_of[me] == host_of[0] || reached.is_loopback() {
        let seen_from_elsewhere =
            (0..peers.len()).find(|&r| host_of[r] != host_of[0]).map(|r| peers[r].reached.clone());
        if let Some(addr) = seen_from_elsewhere.filter(|a| a.parse::<IpAddr>().is_ok_and(|ip| !ip.is_loopback())) {
            return addr;
        }
    }
    route_to(reached).map(|ip| ip.to_string()).unwrap_or_else(|| Ipv4Addr::UNSPECIFIED.to_string())
}

/// This host's address on the route to `peer` (no packet is sent).
fn route_to(peer: IpAddr) -> Option<IpAddr> {
    let any: SocketAddr = if peer.is_ipv4() { (Ipv4Addr::UNSPECIFIED, 0).into() } else { "[::]:0".parse().ok()? };
    let socket = UdpSocket::bind(any).ok()?;
    socket.connect((peer, 9)).ok()?;
    socket.local_addr().ok().map(|a| a.ip())
}

/// The launcher this configuration came from, if a launcher (not rvodrun) started the job.
pub fn launcher(config: &Config) -> Option<Launcher> {
    config.launch.as_ref().map(|plan| plan.launcher)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::fuzz::{self, Target};

    /// Decodes an offer; one that decodes must encode to one that decodes the same.
    fn offer_decodes_stably(bytes: &[u8]) -> bool {
        match Offer::decode(bytes) {
            Ok(offer) => {
                assert_eq!(Offer::decode(&offer.encode()).unwrap(), offer);
                true
            }
            Err(err) => {
                assert!(err.to_string().contains("rank 0"), "{err}");
                false
            }
        }
    }

    fn offer_target() -> Target {
        let offer = |addrs: &[&str], port, secret: &[u8]| {
            Offer { addrs: addrs.iter().map(|a| a.to_string()).collect(), port, secret: secret.to_vec() }.encode()
        };
        let seeds = vec![
            offer(&["10.0.0.1", "node1"], 4000, &[1, 2, 3]),
            offer(&["::1"], 65535, &[0xff; 32]),
            offer(&["h"], 1, &[0]),
        ];
        Target { name: "mpi_offer", seeds, decode: offer_decodes_stably }
    }

    #[test]
    fn fuzz_short_mpi_offer() {
        fuzz::run(&offer_target(), fuzz::SHORT_RUN);
    }

    #[test]
    #[ignore = "long fuzz run: see docs/fuzzing.md"]
    fn fuzz_long_mpi_offer() {
        fuzz::run(&offer_target(), fuzz::LONG_RUN);
    }

    #[test]
    fn offers_round_trip_and_reject_garbage() {
        let offer = Offer { addrs: vec!["10.0.0.1".into(), "node1".into()], port: 4000, secret: vec![1, 2, 3] };
        assert_eq!(Offer::decode(&offer.encode()).unwrap(), offer);
        assert!(Offer::decode(b"hello").is_err());
        assert!(Offer::decode(b"rvod-offer 1\n0\n0102\nh").is_err());
        assert!(Offer::decode(b"rvod-offer 1\n5\nzz\nh").is_err());
        let failed = Offer::decode(&Offer::failure(&EngineError::Init("port 7 is taken".into()))).unwrap_err();
        assert!(
            failed.to_string().contains("rank 0 could not start the job's rendezvous store")
                && failed.to_string().contains("port 7 is taken"),
            "{failed}"
        );
    }

    #[test]
    fn local_addresses_come_from_the_routing_table() {
        let fib = "Main:\n  +-- 0.0.0.0/0 3 0 5\n     |-- 0.0.0.0\n        /0 universe UNICAST\n     +-- 127.0.0.0/8 2 0 2\n\
                   \x20       |-- 127.0.0.1\n           /32 host LOCAL\n     |-- 192.0.2.7\n        /32 host LOCAL\n\
                   \x20    |-- 192.0.2.255\n        /32 link BROADCAST\nLocal:\n     |-- 192.0.2.7\n        /32 host LOCAL\n";
        assert_eq!(local_ipv4_addresses(fib), ["192.0.2.7"]);
    }

    fn peer(host: &str, local: Option<usize>) -> Peer {
        Peer { host: host.into(), local_rank: local, reached: "192.0.2.1".into() }
    }

    fn plan(local_known: bool, cross_known: bool) -> LaunchPlan {
        LaunchPlan {
            launcher: Launcher::OpenMpi,
            run_key: "k".into(),
            one_host: None,
            store_host: None,
            store_port: None,
            secret: None,
            insecure: false,
            iface_addr: None,
            data_bind: crate::launched::BindAddress::Auto,
            local_known,
            cross_known,
        }
    }

    fn topology_of(rank: usize, peers: &[Peer], plan: &LaunchPlan) -> (usize, usize, usize, usize) {
        let mut config = Config::from_lookup(|_| None, None).unwrap();
        config.topology.rank = rank;
        config.topology.size = peers.len();
        if plan.local_known {
            config.topology.local_rank = peers[rank].local_rank.unwrap();
        }
        complete_topology(&mut config, plan, peers);
        let t = &config.topology;
        (t.local_rank, t.local_size, t.cross_rank, t.cross_size)
    }

    #[test]
    fn topology_from_hosts_on_uneven_hosts() {
        // Ranks 0 and 2 on host a, rank 1 alone on b, rank 3 and 4 on c.
        let peers = [peer("a", None), peer("b", None), peer("a", None), peer("c", None), peer("c", None)];
        let plan = plan(false, false);
        assert_eq!(topology_of(0, &peers, &plan), (0, 2, 0, 3));
        assert_eq!(topology_of(1, &peers, &plan), (0, 1, 1, 3));
        assert_eq!(topology_of(2, &peers, &plan), (1, 2, 0, 2));
        assert_eq!(topology_of(4, &peers, &plan), (1, 2, 1, 2));
    }

    #[test]
    fn launcher_local_ranks_are_kept() {
        let peers = [peer("a", Some(1)), peer("a", Some(0)), peer("b", Some(0))];
        let mut config = Config::from_lookup(|_| None, None).unwrap();
        config.topology.rank = 0;
        config.topology.size = 3;
        config.topology.local_rank = 1;
        config.topology.local_size = 2;
        complete_topology(&mut config, &plan(true, false), &peers);
        let t = &config.topology;
        assert_eq!((t.local_rank, t.local_size, t.cross_rank, t.cross_size), (1, 2, 0, 1));
    }
}
