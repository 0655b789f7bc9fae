//! Building a [`TcpTransport`] mesh: listen, publish the address in the rendezvous store, connect to every
//! lower rank and accept every higher one, each connection authenticated with the job secret (the
//! connector's claim, its rank and the mesh's scope, is covered by the proof). Strangers and ranks of other
//! communicators are dropped, with rate-limited warnings, while accepting goes on.

use std::io;
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use super::link::Link;
use super::{poll_once, TcpTransport};
use crate::transport::dropped_connections::DropLog;
use crate::transport::handshake::{self, Purpose, MAX_CLAIM_LEN};
use crate::transport::rendezvous::StoreClient;
use crate::transport::{TransportError, Waker};

/// Longest time an accepted connection may take to authenticate before it is dropped.
const ACCEPT_HANDSHAKE_LIMIT: Duration = Duration::from_secs(10);

/// Where a rank joins a TCP mesh: its place, the store scope the ranks meet in, the job secret, the address
/// it listens on (`bind`, an ephemeral port) and advertises (`advertise_host`), the no-progress limit of
/// set-up and of every operation (`timeout`), and which ranks it connects with (`linked`, by rank, the same
/// relation on every rank; operations with the others are errors).
#[derive(Clone, Copy, Debug)]
pub struct MeshPlace<'a> {
    pub rank: usize,
    pub size: usize,
    pub scope: &'a str,
    pub secret: &'a [u8],
    pub bind: IpAddr,
    pub advertise_host: &'a str,
    pub timeout: Duration,
    pub linked: &'a [bool],
}

impl TcpTransport {
    /// Builds the full mesh for `rank` of `size`, rendezvousing through `store` under `scope` (see
    /// [`MeshPlace`] for the rest).
    #[allow(clippy::too_many_arguments)]
    pub fn connect_mesh(
        rank: usize,
        size: usize,
        store: &mut StoreClient,
        scope: &str,
        secret: &[u8],
        bind: IpAddr,
        advertise_host: &str,
        timeout: Duration,
    ) -> Result<TcpTransport, TransportError> {
        let linked = vec![true; size];
        let place = MeshPlace { rank, size, scope, secret, bind, advertise_host, timeout, linked: &linked };
        Self::connect_mesh_linked(store, &place)
    }

    /// [`connect_mesh`](Self::connect_mesh), connecting only the pairs of ranks that `place.linked` says talk
    /// to each other: the ranks on other hosts, in a communicator whose members on this host use shared
    /// memory.
    pub fn connect_mesh_linked(store: &mut StoreClient, place: &MeshPlace<'_>) -> Result<TcpTransport, TransportError> {
        let MeshPlace { rank, size, scope, secret, bind, advertise_host, timeout, linked } = *place;
        check_mesh(rank, size, scope, linked)?;
        let deadline = handshake::deadline_after(timeout);
        let listener = listen_and_publish(store, scope, rank, bind, advertise_host)?;
        let events = Arc::new(Waker::new().map_err(|err| setup_error("eventfd", err))?);
        let abort = AtomicBool::new(false);
        let mut links: Vec<Option<Link>> = (0..size).map(|_| None).collect();
        let mesh = MeshIdentity { rank, size, scope, secret, linked };
        let (lower, higher) = std::thread::scope(|scope_threads| {
            let acceptor = scope_threads.spawn(|| accept_higher(&listener, &mesh, deadline, &events, &abort));
            let lower = connect_lower(&mesh, store, deadline);
            if lower.is_err() {
                abort.store(true, Ordering::SeqCst);
                events.wake();
            }
            let higher =
                acceptor.join().unwrap_or_else(|_| Err(TransportError::Setup("the accepting thread panicked".into())));
            (lower, higher)
        });
        drop(listener);
        for (peer, stream) in lower?.into_iter().chain(higher?) {
            tune(&stream).map_err(|err| TransportError::Connect { peer, detail: format!("socket options: {err}") })?;
            links[peer] = Some(Link::new(stream));
        }
        Ok(TcpTransport::from_links(rank, links, timeout))
    }
}

/// Who this rank is in the mesh being built, and what proves it.
struct MeshIdentity<'a> {
    rank: usize,
    size: usize,
    scope: &'a str,
    secret: &'a [u8],
    /// Whether this rank connects with each rank.
    linked: &'a [bool],
}

/// Set-up errors name no rank of their own: this rank raises them, and inside a process set its position here
/// is not the rank users know.
pub(super) fn setup_error(what: &str, err: io::Error) -> TransportError {
    TransportError::Setup(format!("{what}: {err}"))
}

/// Whether `rank`, `size`, `scope` and `linked` describe a mesh this rank can join.
pub(super) fn check_mesh(rank: usize, size: usize, scope: &str, linked: &[bool]) -> Result<(), TransportError> {
    if linked.len() != size {
        return Err(TransportError::Setup(format!("{} link flags for {size} ranks", linked.len())));
    }
    if rank >= size || size > u32::MAX as usize {
        return Err(TransportError::Setup(format!("rank {rank} is outside a communicator of {size} ranks")));
    }
    if scope.len() + 4 > MAX_CLAIM_LEN {
        return Err(TransportError::Setup(format!(
            "mesh scope '{scope}' is {} bytes long, the limit is {}",
            scope.len(),
            MAX_CLAIM_LEN - 4
        )));
    }
    Ok(())
}

/// Listens on `(bind, ephemeral port)` and publishes `advertise_host:port` as this rank's address in `scope`.
pub(super) fn listen_and_publish(
    store: &mut StoreClient,
    scope: &str,
    rank: usize,
    bind: IpAddr,
    advertise_host: &str,
) -> Result<TcpListener, TransportError> {
    let listener = TcpListener::bind((bind, 0)).map_err(|err| setup_error(&format!("cannot listen on {bind}"), err))?;
    let port = listener.local_addr().map_err(|err| setup_error("listener address", err))?.port();
    let host = if advertise_host.contains(':') && !advertise_host.starts_with('[') {
        format!("[{advertise_host}]")
    } else {
        advertise_host.to_string()
    };
    store.set(&address_key(scope, rank), format!("{host}:{port}").as_bytes())?;
    Ok(listener)
}

pub(super) fn address_key(scope: &str, rank: usize) -> String {
    format!("{scope}/addr/{rank}")
}

/// The identity a connecting rank claims: its rank and the scope of the mesh.
pub(super) fn mesh_claim(rank: usize, scope: &str) -> Vec<u8> {
    let mut claim = (rank as u32).to_be_bytes().to_vec();
    claim.extend_from_slice(scope.as_bytes());
    claim
}

/// The rank claimed by `claim` if it belongs to `scope` and is another rank of the mesh than `acceptor_rank`.
fn claimed_rank(claim: &[u8], scope: &str, acceptor_rank: usize, size: usize) -> Option<usize> {
    let (rank, claimed_scope) = claim.split_first_chunk::<4>()?;
    let rank = u32::from_be_bytes(*rank) as usize;
    (claimed_scope == scope.as_bytes() && rank != acceptor_rank && rank < size).then_some(rank)
}

/// Socket settings for the data path. Buffer sizes are left to the kernel's autotuning: fixed 4 MiB
/// `SO_SNDBUF`/`SO_RCVBUF` measured no faster over loopback, turn autotuning off, and are silently capped
/// by `net.core.{w,r}mem_max` (often 208 KiB), which would make them slower.
pub(super) fn tune(stream: &TcpStream) -> io::Result<()> {
    stream.set_nodelay(true)?;
    stream.set_read_timeout(None)?;
    stream.set_write_timeout(None)?;
    stream.set_nonblocking(true)
}

/// Connects to and authenticates with every lower rank, in order.
fn connect_lower(
    mesh: &MeshIdentity<'_>,
    store: &mut StoreClient,
    deadline: Instant,
) -> Result<Vec<(usize, TcpStream)>, TransportError> {
    let claim = mesh_claim(mesh.rank, mesh.scope);
    let mut streams = Vec::with_capacity(mesh.rank);
    for peer in (0..mesh.rank).filter(|&peer| mesh.linked[peer]) {
        let fail = |detail: String| TransportError::Connect { peer, detail };
        let left = deadline.saturating_duration_since(Instant::now());
        let address = store.get_from(peer, &address_key(mesh.scope, peer), left)?;
        let address = String::from_utf8(address).map_err(|_| fail("its published address is not text".into()))?;
        let mut stream = connect_to(&address, deadline).map_err(|err| fail(format!("{address}: {err}")))?;
        handshake::connect(&mut stream, mesh.secret, Purpose::Mesh, &claim, deadline)
            .map_err(|err| fail(format!("{address}: {err}")))?;
        streams.push((peer, stream));
    }
    Ok(streams)
}

pub(super) fn connect_to(address: &str, deadline: Instant) -> io::Result<TcpStream> {
    let mut last_error = io::Error::new(io::ErrorKind::NotFound, "the address resolves to nothing");
    for candidate in address.to_socket_addrs()? {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(io::ErrorKind::TimedOut, "out of time"));
        }
        match TcpStream::connect_timeout(&candidate, left) {
            Ok(stream) => return Ok(stream),
            Err(err) => last_error = err,
        }
    }
    Err(last_error)
}

/// What an accepting rank does with authenticated connections: which claimed ranks it lets in, and where
/// the streams of those it let in go. Called from the threads that authenticate connections.
pub(super) trait Admission: Send + Sync {
    /// Whether `peer`, whose claim is authentic, is let in (answered in the handshake's verdict).
    fn admit(&self, peer: usize) -> bool;
    /// The authenticated connection from `peer`, which `admit` let in.
    fn deliver(&self, peer: usize, stream: TcpStream);
    /// `peer` was let in, but its connection broke before the handshake finished.
    fn failed(&self, _peer: usize) {}
}

/// The eager mesh's admission: every higher rank, handed to the set-up over a channel.
struct HigherRanks {
    rank: usize,
    done: mpsc::Sender<(usize, TcpStream)>,
    events: Arc<Waker>,
}

impl Admission for HigherRanks {
    fn admit(&self, peer: usize) -> bool {
        peer > self.rank
    }

    fn deliver(&self, peer: usize, stream: TcpStream) {
        // The receiver is gone only if set-up already finished or failed; then the stream just closes.
        if self.done.send((peer, stream)).is_ok() {
            self.events.wake();
        }
    }
}

/// Accepts connections until every higher rank has authenticated. Each handshake runs on its own short-lived
/// thread, so a silent stranger delays nobody; finished ones come back over a channel and ring `events`.
fn accept_higher(
    listener: &TcpListener,
    mesh: &MeshIdentity<'_>,
    deadline: Instant,
    events: &Arc<Waker>,
    abort: &AtomicBool,
) -> Result<Vec<(usize, TcpStream)>, TransportError> {
    let rank = mesh.rank;
    let fail = |detail: String| TransportError::Setup(format!("accepting the other ranks: {detail}"));
    listener.set_nonblocking(true).map_err(|err| fail(err.to_string()))?;
    let (done_tx, done_rx) = mpsc::channel::<(usize, TcpStream)>();
    let handshakes = Handshakes {
        rank,
        size: mesh.size,
        scope: mesh.scope.into(),
        secret: mesh.secret.into(),
        admission: Arc::new(HigherRanks { rank, done: done_tx, events: events.clone() }),
    };
    let mut accepted: Vec<Option<TcpStream>> = (0..mesh.size).map(|_| None).collect();
    let mut missing = (rank + 1..mesh.size).filter(|&peer| mesh.linked[peer]).count();
    while missing > 0 {
        while let Ok((peer, stream)) = done_rx.try_recv() {
            if !mesh.linked[peer] {
                tracing::warn!(rank, peer, "mesh: dropped a connection from a rank this one does not link with");
            } else if accepted[peer].is_none() {
                accepted[peer] = Some(stream);
                missing -= 1;
            } else {
                tracing::warn!(rank, peer, "mesh: dropped a second connection claiming the same rank");
            }
        }
        if missing == 0 {
            break;
        }
        if abort.load(Ordering::SeqCst) {
            return Err(fail("set-up was abandoned".into()));
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            let peers = (rank + 1..mesh.size).filter(|&peer| mesh.linked[peer] && accepted[peer].is_none()).collect();
            return Err(TransportError::NotConnected { peers });
        }
        let mut fds = [
            libc::pollfd { fd: listener.as_raw_fd(), events: libc::POLLIN, revents: 0 },
            libc::pollfd { fd: events.as_raw_fd(), events: libc::POLLIN, revents: 0 },
        ];
        poll_once(&mut fds, left).map_err(|err| fail(err.to_string()))?;
        events.drain();
        handshakes.accept_waiting(listener, deadline);
    }
    Ok(accepted.into_iter().enumerate().filter_map(|(peer, stream)| Some((peer, stream?))).collect())
}

/// Connections the mesh listeners of this process dropped (rate-limited warnings).
static MESH_DROPS: DropLog = DropLog::new("mesh");

/// Authenticates the connections a rank's listener accepts, each on a short-lived thread of its own, and
/// hands those its [`Admission`] lets in to it.
pub(super) struct Handshakes {
    pub(super) rank: usize,
    pub(super) size: usize,
    pub(super) scope: Arc<str>,
    pub(super) secret: Arc<[u8]>,
    pub(super) admission: Arc<dyn Admission>,
}

impl Handshakes {
    /// Accepts every connection waiting on the (non-blocking) `listener` and starts authenticating each,
    /// giving it until `deadline` at most.
    pub(super) fn accept_waiting(&self, listener: &TcpListener, deadline: Instant) {
        loop {
            match listener.accept() {
                Ok((stream, from)) => {
                    let job = HandshakeJob {
                        rank: self.rank,
                        size: self.size,
                        scope: self.scope.clone(),
                        secret: self.secret.clone(),
                        deadline: deadline.min(Instant::now() + ACCEPT_HANDSHAKE_LIMIT),
                        admission: self.admission.clone(),
                    };
                    let spawned = std::thread::Builder::new()
                        .name("rvod-mesh-handshake".into())
                        .spawn(move || job.run(stream, from));
                    if let Err(err) = spawned {
                        tracing::warn!(rank = self.rank, %from, error = %err, "mesh: no thread to authenticate a connection");
                    }
                }
                Err(err) if err.kind() == io::ErrorKind::WouldBlock => break,
                Err(err) if err.kind() == io::ErrorKind::Interrupted => {}
                Err(err) => {
                    tracing::warn!(rank = self.rank, error = %err, "mesh: accept failed");
                    break;
                }
            }
        }
    }
}

/// Authenticates one accepted connection on its own thread.
struct HandshakeJob {
    rank: usize,
    size: usize,
    scope: Arc<str>,
    secret: Arc<[u8]>,
    deadline: Instant,
    admission: Arc<dyn Admission>,
}

impl HandshakeJob {
    fn run(self, mut stream: TcpStream, from: SocketAddr) {
        let (rank, size, scope) = (self.rank, self.size, &*self.scope);
        if let Err(err) = stream.set_nonblocking(false) {
            MESH_DROPS.dropped(from, &format!("cannot make it blocking: {err}"));
            return;
        }
        let (mut claimed, mut admitted) = (None, false);
        let verified = handshake::accept(&mut stream, &self.secret, Purpose::Mesh, self.deadline, |claim| {
            claimed = claimed_rank(claim, scope, rank, size);
            admitted = claimed.is_some_and(|peer| self.admission.admit(peer));
            admitted
        });
        match (verified, claimed) {
            (Ok(_), Some(peer)) => self.admission.deliver(peer, stream),
            (Ok(_), None) => {}
            // A rank of this mesh that is not let in (a connection crossing this rank's own) is told so in the
            // verdict and needs no warning.
            (Err(handshake::HandshakeError::Unexpected), Some(_)) if !admitted => {}
            (Err(err), claimed) => {
                if let Some(peer) = claimed.filter(|_| admitted) {
                    self.admission.failed(peer);
                }
                MESH_DROPS.dropped(from, &format!("rank {rank}: it failed authentication: {err}"));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::fuzz::{self, Target};

    fn claim_reads(bytes: &[u8]) -> bool {
        match claimed_rank(bytes, "world", 1, 4) {
            Some(rank) => {
                assert!(rank != 1 && rank < 4);
                true
            }
            None => false,
        }
    }

    fn claim_target() -> Target {
        Target { name: "mesh_claim", seeds: vec![mesh_claim(3, "world"), mesh_claim(2, "world")], decode: claim_reads }
    }

    #[test]
    fn fuzz_short_mesh_claim() {
        fuzz::run(&claim_target(), fuzz::SHORT_RUN);
    }

    #[test]
    #[ignore = "long fuzz run: see docs/fuzzing.md"]
    fn fuzz_long_mesh_claim() {
        fuzz::run(&claim_target(), fuzz::LONG_RUN);
    }

    #[test]
    fn claims_round_trip_and_reject_strangers() {
        let claim = mesh_claim(3, "world");
        assert_eq!(claimed_rank(&claim, "world", 1, 4), Some(3));
        assert_eq!(claimed_rank(&claim, "other", 1, 4), None);
        assert_eq!(claimed_rank(&claim, "world", 3, 4), None);
        assert_eq!(claimed_rank(&mesh_claim(0, "world"), "world", 3, 4), Some(0));
        assert_eq!(claimed_rank(&claim, "world", 0, 3), None);
        assert_eq!(claimed_rank(b"ab", "world", 0, 4), None);
    }
}
